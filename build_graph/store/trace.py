"""The build trace: per target, each action's last description (to explain the next miss)
and what the last build did (for `bgraph explain`). Kept in the cache's state file (state.py),
one row per target; a cache from before that file has one `trace/<label>.json` per target,
still read (never written) until the target's next build records it anew.

Traces are the cache's, per configured target (`//x:y`, `//x:y (aarch64)`), and so shared by
every workspace that builds with the cache: each says which workspace's build wrote it
(`workspace`), so that `explain` and `why` can say when what they show is another one's."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import quote

import blake3
import orjson

from build_graph.store.state import STATE_FILE, BuildState


def trace_bytes(data: dict[str, Any]) -> tuple[str, bytes]:
    """(digest, encoding) of a trace: a build compares digests to skip rewriting an unchanged one."""
    encoded = orjson.dumps(data, option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS)
    return blake3.blake3(encoded).hexdigest(), encoded


class Trace:
    def __init__(self, base: Path, tmp: Path, state: BuildState | None = None, create: bool = True):
        """`create=False`: a reader (explain, why) that makes no state file where none is."""
        self.root = base / "trace"  # the per-file traces of an older cache (read only)
        self._old = self.root.is_dir()  # checked once: a cache made since the state file has none
        self.tmp = tmp
        self.state = state or BuildState(base / STATE_FILE, create=create)
        self._owned = state is None

    def _path(self, label: str) -> Path:
        # Percent-encoding is one-to-one: //a__b:c and //a/b:c get different files.
        return self.root / f"{quote(label, safe='')}.json"

    def load(self, label: str) -> dict[str, Any]:
        found = self.state.trace(label)
        if found is not None or not self._old:
            return found or {}
        try:
            return orjson.loads(self._path(label).read_bytes())
        except (FileNotFoundError, NotADirectoryError, ValueError):
            return {}

    def has(self, label: str) -> bool:
        """Whether a trace is recorded for `label`."""
        if self.state.trace_digest(label) is not None:
            return True
        return self._old and self._path(label).is_file()

    def labels_of(self, label: str) -> list[str]:
        """The configured targets of `label` with a trace: `//x:y` and `//x:y (<platform>)`."""
        found = [x for x in self.labels() if x == label or x.startswith(label + " (")]
        if self._old and label not in found and self._path(label).is_file():
            found.append(label)
        return sorted(found)

    def digest(self, label: str) -> str | None:
        """The digest of the trace recorded for `label` in the state file (None: none there)."""
        return self.state.trace_digest(label)

    def save(self, label: str, data: dict[str, Any], encoded: tuple[str, bytes] | None = None) -> None:
        """Record `label`'s trace (written with the build state's next flush)."""
        digest, raw = encoded or trace_bytes(data)
        self.state.put_trace(label, digest, raw)
        if self._owned:
            self.state.flush()

    def labels(self) -> list[str]:
        """Every label with a trace in the state file."""
        return self.state.trace_labels()
