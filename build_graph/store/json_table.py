"""A small JSON table in the cache (one file, loaded whole, written atomically when changed):
what bgraph learns between builds (peak memory per action, host tool probes, the stat stamps
of verified blobs and of workspace sources)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

from build_graph.store.atomic import write_json


class JsonTable:
    def __init__(self, path: Path, tmp: Path):
        self.path, self.tmp = path, tmp
        try:
            self.table: dict[str, Any] = orjson.loads(path.read_bytes())
        except (OSError, ValueError):  # missing or unreadable: nothing learned yet
            self.table = {}
        if not isinstance(self.table, dict):
            self.table = {}
        self.dirty = False

    def set(self, name: str, value: Any) -> None:
        if self.table.get(name) != value:
            self.table[name] = value
            self.dirty = True

    def discard(self, name: str) -> None:
        if self.table.pop(name, None) is not None:
            self.dirty = True

    def save(self) -> None:
        if not self.dirty:
            return
        write_json(self.path, self.table, self.tmp, sort_keys=True)
        self.dirty = False
