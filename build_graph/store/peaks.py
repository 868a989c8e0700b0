"""Learned peak memory per action: `<label> <action name>` -> MiB, from the last run (the
scheduler budgets with it instead of the declared estimate)."""

from __future__ import annotations

import re
from pathlib import Path

from build_graph.store.json_table import JsonTable

HEADROOM = 1.25  # runs of one action vary a little; budget a quarter more than last time


_ARCH_SUFFIX = re.compile(r" (?:\d{2,4}[af]?)$")  # "cicc <object> 121a", "devpp <object> 1210"


def _without_arch(step: str) -> str:
    """The step's name without its trailing arch, if it has one."""
    m = _ARCH_SUFFIX.search(step)
    return step[:m.start()] if m else step


class Peaks(JsonTable):
    def __init__(self, base: Path, tmp: Path):
        super().__init__(base / "peaks.json", tmp)
        # A damaged file's entries of the wrong shape (valid JSON, "x" or a list for a peak) are
        # dropped, as a damaged state file is: the TypeError they raised while planning was
        # reported as a bug in the rule. The next save writes the file without them.
        kept = {k: v for k, v in self.table.items()
                if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < 1 << 40}
        if len(kept) != len(self.table):
            self.table, self.dirty = kept, True
        self._siblings: dict[tuple[str, str], int] | None = None  # (label or "", step) -> largest peak

    def budget(self, name: str, declared_mb: int) -> int:
        """What to reserve for a run of `name`: the learned peak with headroom; for a step never
        run, the largest peak of the same step for another arch (cicc of one TU for 12.0a
        needs about what it needed for 12.1a) in this target, else of the same step in any
        target; else the declaration."""
        learned = self.table.get(name) or self._sibling_peak(name)
        return max(64, int(learned * HEADROOM)) if learned else declared_mb

    def _sibling_peak(self, name: str) -> int | None:
        label, _, step = name.partition(" ")
        if self._siblings is None:
            self._siblings = {}
            for known, peak in self.table.items():
                known_label, _, known_step = known.partition(" ")
                base = _without_arch(known_step)
                for k in ((known_label, base), ("", base)):
                    self._siblings[k] = max(self._siblings.get(k, 0), peak)
        base = _without_arch(step)
        # Across targets only for a step that names its object ("hostcc x.cu.o"), not a bare
        # kind ("genrule") that unrelated targets share.
        return self._siblings.get((label, base)) or (self._siblings.get(("", base)) if " " in base else None)

    def record(self, name: str, peak_mb: int) -> None:
        if peak_mb > 0:
            self.set(name, peak_mb)
