"""`bgraph deb lock`: resolve deb_packages targets against the mirrors' indexes, write their locks.

Indexes are downloaded once per architecture per run (every target shares them); a lock file is
rewritten only when its text changes, atomically. Nothing is stored in the build cache.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from build_graph.debian import DEB_ARCH, LockError
from build_graph.debian.index import Index, fetch_index, session
from build_graph.debian.lockfile import LockEntry, PlatformLock, diff, parse, render
from build_graph.debian.resolve import resolve
from build_graph.debian.sources import APT_ETC, configured_sources, suites_in_order
from build_graph.errors import UsageError, where
from build_graph.labels import Label
from build_graph.lock_files import check_writable, read_lock, write_lock
from build_graph.workspace import Workspace


@dataclass
class LockResult:
    label: str
    lock: str  # workspace path
    written: bool
    changes: list[str]
    totals: dict[str, tuple[int, int]] = field(default_factory=dict)  # platform -> (packages, bytes of .deb)
    note: str = ""


def deb_targets(ws: Workspace, labels: list[Label]) -> list[Label]:
    """`labels` (all must be deb_packages targets), or every deb_packages target when none are given."""
    if not labels:
        return sorted((l for l, t in ws.targets.items() if t.kind == "deb_packages"), key=str)
    for label in labels:
        kind = ws.target(label).kind
        if kind != "deb_packages":
            raise UsageError(f"{label} is a {kind} target; `bgraph deb lock` locks deb_packages targets")
    return labels


def lock(ws: Workspace, labels: list[Label], progress: Callable[[str], None] = lambda m: None,
         apt_etc: Path = APT_ETC) -> list[LockResult]:
    """Lock each target for every platform; returns what changed per lock file."""
    section = ws.model.debian
    sources = configured_sources(section.mirrors, section.suites, section.components, apt_etc)
    suites = section.suites or suites_in_order(sources)
    s = session()
    from build_graph.fetch_guard import allowed_dirs

    file_roots = [Path(os.path.realpath(ws.root)), *allowed_dirs()]  # where a file: mirror it names may lie
    indexes: dict[str, Index] = {}
    results = []
    writes: list[tuple[str, str]] = []  # written once every target resolved: an error changes no lock
    for label in labels:  # a lock path through a symlink is refused before any index is read
        check_writable(ws.root, ws.targets[label].attrs.lock)
    for label in labels:
        target = ws.targets[label]
        attrs = target.attrs
        new: dict[str, PlatformLock] = {}
        why: dict[str, dict[str, tuple[str, str]]] = {}
        for platform in attrs.locked_for:
            arch = DEB_ARCH[platform]
            if arch not in indexes:
                start = time.monotonic()
                progress(f"reading the {arch} indexes of {', '.join(suites)}")
                indexes[arch] = fetch_index(sources, suites, arch, s, progress, file_roots)
                progress(f"{arch}: {len(indexes[arch].versions)} packages in {time.monotonic() - start:.1f}s")
            loc = f"{where(target.file, target.table, 'packages')} ({platform})"
            res = resolve(indexes[arch], attrs.roots(platform), attrs.excluded(platform), loc)
            new[platform] = PlatformLock(tuple(attrs.roots(platform)), tuple(attrs.excluded(platform)),
                                         tuple(LockEntry.of(c) for c in res.packages))
            why[platform] = res.required_by
        old_text = read_lock(ws.root, attrs.lock)
        note = ""
        try:
            old = parse(old_text, attrs.lock) if old_text is not None else {}
        except LockError as e:
            old, note = {}, f"the old lock was not readable ({e.message}); replaced"
        text = render(new)
        changes = [_with_why(line, why) for line in diff(old, new)]
        if text != old_text:
            writes.append((attrs.lock, text))
        totals = {p: (len(pl.packages), sum(e.size for e in pl.packages)) for p, pl in new.items()}
        results.append(LockResult(str(label), attrs.lock, text != old_text, changes, totals, note))
    for path, text in writes:
        write_lock(ws.root, path, text)
    return results


def _with_why(line: str, why: dict[str, dict[str, tuple[str, str]]]) -> str:
    """'x86_64: + libmpc3 1.3.1-1' -> '… (for cpp-12)' for an added dependency."""
    platform, _, rest = line.partition(": ")
    if not rest.startswith("+ "):
        return line
    name = rest.split()[1]
    parent = why.get(platform, {}).get(name)
    return f"{line} (for {parent[0]})" if parent else f"{line} (root)"
