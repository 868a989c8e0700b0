"""Absent keys answered from memory once a store has missed many lookups.

Planning many new actions asks the state file and the action cache for keys they do not hold:
100,000 new actions were 200,000 SQLite queries and 100,000 failed opens, an eighth of the plan.
After `LIST_AFTER_MISSES` misses a store's keys are read once (one query, one directory walk),
and a key not among them, nor filed by this process since, is a miss without asking.

A key another process files after the listing is then a miss for this build (it runs the action
again and files the same result): a cost, never a wrong answer. A listed key is still looked up
(it may have been collected since), so a hit is decided by the store as before.
"""

from __future__ import annotations

import threading
from typing import Callable, Iterable

LIST_AFTER_MISSES = 1000


class MissListing:
    """The keys of one store, read in one go after `after` misses; None until then."""

    def __init__(self, read_all: Callable[[], Iterable[str]], after: int = LIST_AFTER_MISSES):
        self._read_all = read_all
        self._after = after
        self._misses = 0
        self._keys: set[str] | None = None
        self._lock = threading.Lock()  # action threads file keys while the planner looks them up

    def absent(self, key: str) -> bool:
        """True when `key` is known to be absent without asking the store."""
        keys = self._keys
        return keys is not None and key not in keys

    def missed(self) -> None:
        """Count a lookup the store answered with nothing; list its keys at the threshold."""
        self._misses += 1
        if self._misses != self._after:
            return
        with self._lock:
            try:
                self._keys = set(self._read_all())
            except Exception:  # noqa: BLE001 - an unreadable listing only costs the shortcut
                self._keys = None

    def added(self, key: str) -> None:
        """A key this process filed (after the listing it must not read as absent)."""
        with self._lock:
            if self._keys is not None:
                self._keys.add(key)
