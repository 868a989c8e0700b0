"""Leases: what each running build holds, so `bgraph cache gc` and eviction never pull a file
from under it.

Every build process owns a staging directory `v1/tmp/<pid>-xxx/` with a lock file beside it,
flocked for the process's lifetime (a killed process releases it). Next to it, `<...>.holds`
lists what the build uses, one `<kind> <digest>` line each: `key` for an action-cache entry it
took as a hit (so the blobs that entry names stay), `tree` for a materialized tree it mounts,
`blob` for a workspace source it stored or found stored.
Anything a running build created (blobs, nodes, entries, trees) is newer than its lease and is
kept by age.

The race between a build taking a hit and a collection deciding what to drop is closed by
`v1/gc.lock`: a build appends to its holds under a shared lock, *before* it verifies the entry's
blobs; a collection holds the lock exclusively while it decides and deletes. Either the
collection sees the hold, or the build verifies after the collection and sees a miss.
"""

from __future__ import annotations

import fcntl
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path


def gc_lock_path(layout_root: Path) -> Path:
    """The lock that serializes collections against holds (`<cache>/v1/gc.lock`)."""
    return layout_root / "gc.lock"


class Holds:
    """A build's half of the protocol: append what it uses to its holds file."""

    def __init__(self, staging: Path, layout_root: Path):
        self.path = Path(f"{staging}.holds")
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._gc_fd = os.open(gc_lock_path(layout_root), os.O_RDWR | os.O_CREAT, 0o644)
        # flock is per open file: threads of one build must not unlock each other's section.
        self._mutex = threading.Lock()
        self._held: set[tuple[str, str]] = set()

    def hold(self, kind: str, digest: str) -> None:
        """Record that this build uses `digest`; returns once no collection can miss it."""
        if (kind, digest) not in self._held:
            self.hold_many(kind, (digest,))

    def hold_many(self, kind: str, digests) -> None:
        """hold() for many digests at once: one lock and one write."""
        new = [(kind, d) for d in dict.fromkeys(digests) if (kind, d) not in self._held]
        if not new:
            return
        with self._mutex:
            fcntl.flock(self._gc_fd, fcntl.LOCK_SH)
            try:
                os.write(self._fd, "".join(f"{k} {d}\n" for k, d in new).encode())
            finally:
                fcntl.flock(self._gc_fd, fcntl.LOCK_UN)
            self._held.update(new)

    def close(self) -> None:
        for fd in (self._fd, self._gc_fd):
            try:
                os.close(fd)
            except OSError:
                pass


@dataclass
class LiveBuilds:
    """What all running builds hold, as one collection sees it."""

    keys: set[str] = field(default_factory=set)
    trees: set[str] = field(default_factory=set)
    blobs: set[str] = field(default_factory=set)
    oldest_start: float | None = None  # seconds since the epoch; None when no build runs
    count: int = 0


def take_if_free(lock: Path) -> int | None:
    """The lease lock, flocked by us, if no live build holds it; else (or if gone) None."""
    try:
        fd = os.open(lock, os.O_RDWR)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def live_builds(staging_root: Path) -> LiveBuilds:
    """Read the holds of every build whose lease lock is still held (dead leases are skipped)."""
    live = LiveBuilds()
    for lock in staging_root.glob("*.lock"):
        fd = take_if_free(lock)
        if fd is not None:
            os.close(fd)  # nobody holds it: a dead build's leftovers
            continue
        try:
            start = lock.stat().st_mtime
        except FileNotFoundError:
            continue  # the build ended just now
        live.count += 1
        live.oldest_start = start if live.oldest_start is None else min(live.oldest_start, start)
        try:
            text = Path(str(lock)[: -len(".lock")] + ".holds").read_text()
        except FileNotFoundError:
            continue
        for line in text.splitlines():
            kind, _, digest = line.partition(" ")
            if kind == "key":
                live.keys.add(digest)
            elif kind == "tree":
                live.trees.add(digest)
            elif kind == "blob":
                live.blobs.add(digest)
    return live
