"""Learned peak memory per action: `<label> <action name>` -> MiB, from the last run (the
scheduler budgets with it instead of the declared estimate). One JSON file, written atomically."""

from __future__ import annotations

from pathlib import Path

import orjson

from build_graph.store.atomic import write_json

HEADROOM = 1.25  # runs of one action vary a little; budget a quarter more than last time


class Peaks:
    def __init__(self, base: Path, tmp: Path):
        self.path = base / "peaks.json"
        self.tmp = tmp
        try:
            self.table: dict[str, int] = orjson.loads(self.path.read_bytes())
        except (FileNotFoundError, ValueError):
            self.table = {}
        self.dirty = False

    def budget(self, name: str, declared_mb: int) -> int:
        """What to reserve for a run of `name`: the learned peak with headroom, else the declaration."""
        learned = self.table.get(name)
        return max(64, int(learned * HEADROOM)) if learned else declared_mb

    def record(self, name: str, peak_mb: int) -> None:
        if peak_mb > 0 and self.table.get(name) != peak_mb:
            self.table[name] = peak_mb
            self.dirty = True

    def save(self) -> None:
        if not self.dirty:
            return
        write_json(self.path, self.table, self.tmp, sort_keys=True)
        self.dirty = False
