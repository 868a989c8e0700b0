"""The build trace: per target, each action's last description (to explain the next miss)
and what the last build did (for `bgraph explain`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import quote

import orjson

from build_graph.store.atomic import write_json


class Trace:
    def __init__(self, base: Path, tmp: Path):
        self.root = base / "trace"
        self.tmp = tmp
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, label: str) -> Path:
        # Percent-encoding is one-to-one: //a__b:c and //a/b:c get different files.
        return self.root / f"{quote(label, safe='')}.json"

    def load(self, label: str) -> dict[str, Any]:
        try:
            return orjson.loads(self._path(label).read_bytes())
        except (FileNotFoundError, ValueError):
            return {}

    def save(self, label: str, data: dict[str, Any]) -> None:
        write_json(self._path(label), data, self.tmp, sort_keys=True, indent=1)
