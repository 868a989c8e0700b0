"""The per-target memo: what each configured target of the last successful build of a request
read from the workspace, what it produced and which actions it took, kept beside that build's
no-op record (`bgraph-out/.uptodate/<request>.memo`).

The no-op record answers "did anything change"; the memo answers "what does this change reach".
When only the contents of workspace files changed since the record (no file added or removed,
no target file, no code, config, host tool or cache generation: `uptodate.changed_files`), a
target is reused whole, without expanding, storing or hashing its sources, planning it or
computing a key, where none of its own sources changed and every dependency's output equals the
one it was built from (early cutoff at target level). Every other target takes the full path.

Why reuse is exact: a target's plan is a function of its definition (fixed while no target file
and no code changed), its configuration (part of the request), its sources (stamps unchanged),
its dependencies' outputs (compared), probed host tools (stamped in the record) and the action
cache, whose entries a reused target's actions were hits in; what `cache gc` or `cache verify
--repair` removes bumps the generation, checked again after the build holds the reused keys
(engine.py). A source outside the record's scan (under `.git/`, `__pycache__/` or the cache),
whose changes the stamps cannot see, makes its target never reused ("volatile").

The memo names the record it belongs to; a memo whose record was replaced (a crash between the
two writes, a concurrent build) is not used. A damaged or foreign memo is ignored.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from build_graph.store.atomic import write_bytes
from build_graph.store.uptodate import RECORD_DIR

if TYPE_CHECKING:  # not imported by a no-op (pickle imports it when a memo is loaded)
    from build_graph.model import TargetOutput

FORMAT = 1


@dataclass(frozen=True)
class Entry:
    """One configured target as the last build left it."""

    sources: tuple[str, ...]  # workspace paths of its sources (globs expanded)
    output: TargetOutput
    actions: tuple[tuple[str, str, str], ...]  # (name, mnemonic, key) of each action it took
    volatile: bool = False  # a source the stamps cannot see: never reused


def path(root: Path, digest: str) -> Path:
    return root / "bgraph-out" / RECORD_DIR / f"{digest}.memo"


def save(root: Path, digest: str, name: str, entries: dict[str, Entry]) -> None:
    """Write the memo of the record called `name` (str(configured target) -> entry)."""
    path(root, digest).parent.mkdir(parents=True, exist_ok=True)
    write_bytes(path(root, digest), pickle.dumps((FORMAT, name, entries), protocol=pickle.HIGHEST_PROTOCOL))


def load(root: Path, digest: str, name: str) -> dict[str, Entry] | None:
    """The memo of the record called `name`, if it is there, whole and of this bgraph."""
    if not name:
        return None
    try:
        with open(path(root, digest), "rb") as f:
            fmt, kept_name, entries = pickle.load(f)
    except Exception:  # missing, damaged, or another bgraph's: every target takes the full path
        return None
    return entries if fmt == FORMAT and kept_name == name else None


def forget(root: Path, digest: str) -> None:
    try:
        path(root, digest).unlink()
    except OSError:
        pass


@dataclass
class Reuse:
    """A build's view of the memo: which targets it may take as they were."""

    entries: dict[str, Entry]
    changed: set[str]  # workspace files whose contents changed since the memo's build
    generation: Path  # the cache's generation file, checked again once the reused keys are held
    generation_stamp: list | None

    def entry(self, label: str) -> Entry | None:
        """The memo's entry for a target none of whose own sources changed, else None."""
        e = self.entries.get(label)
        if e is None or e.volatile or (self.changed and not self.changed.isdisjoint(e.sources)):
            return None
        return e

    def keys(self) -> list[str]:
        """Every action key the memo's targets took (held by the build before any is reused)."""
        return [key for e in self.entries.values() for _name, _mnemonic, key in e.actions]

    def still_valid(self) -> bool:
        """Nothing was collected from the cache since the record was checked."""
        from build_graph.store.uptodate import stamp_of
        return stamp_of(self.generation) == self.generation_stamp
