"""The worker's own cache, bounded (`bgraph worker --max-cache SIZE`): every blob a lease fetched or
made stays for the next leases, so a long-running worker would fill its disk. When what it holds
passes the bound, the cache is emptied between leases (no lease runs meanwhile; new ones wait) and
refilled by the next leases. Cruder than an LRU, but it needs no use times, and what a worker
needs again (a pinned /usr) comes back in one fetch."""

from __future__ import annotations

import os
import re
import threading
from contextlib import contextmanager

from build_graph.errors import LoadError

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """'20G', '500M', '1024' -> bytes; a LoadError naming the option otherwise."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*", text or "", re.IGNORECASE)
    if not m:
        raise LoadError(f"--max-cache {text!r} is not a size", hint="e.g. --max-cache 50G (K, M, G, T)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def tree_bytes(path: str | os.PathLike) -> int:
    """Bytes of the files below `path` (each inode once: materialized trees are hard links)."""
    seen: set[int] = set()
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                st = os.lstat(os.path.join(root, name))
            except OSError:
                continue
            if st.st_ino not in seen:
                seen.add(st.st_ino)
                total += st.st_size
    return total


class Uses:
    """Leases share the cache; an emptying has it alone (it waits for running leases; new ones
    wait for it)."""

    def __init__(self):
        self._cond = threading.Condition()
        self._running = 0
        self._emptying = False

    @contextmanager
    def lease(self):
        """Held while a lease uses the cache."""
        with self._cond:
            while self._emptying:
                self._cond.wait()
            self._running += 1
        try:
            yield
        finally:
            with self._cond:
                self._running -= 1
                self._cond.notify_all()

    @contextmanager
    def alone(self):
        """Held while the cache is emptied: no lease runs."""
        with self._cond:
            while self._emptying:
                self._cond.wait()
            self._emptying = True
            while self._running:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._emptying = False
                self._cond.notify_all()
