"""Learned peak memory per action: `<label> <action name>` -> MiB, from the last run (the
scheduler budgets with it instead of the declared estimate)."""

from __future__ import annotations

from pathlib import Path

from build_graph.store.json_table import JsonTable

HEADROOM = 1.25  # runs of one action vary a little; budget a quarter more than last time


class Peaks(JsonTable):
    def __init__(self, base: Path, tmp: Path):
        super().__init__(base / "peaks.json", tmp)

    def budget(self, name: str, declared_mb: int) -> int:
        """What to reserve for a run of `name`: the learned peak with headroom, else the declaration."""
        learned = self.table.get(name)
        return max(64, int(learned * HEADROOM)) if learned else declared_mb

    def record(self, name: str, peak_mb: int) -> None:
        if peak_mb > 0:
            self.set(name, peak_mb)
