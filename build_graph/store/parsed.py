"""The parsed workspace, kept between commands: `workspace.load` parses and validates every target
file (tomllib is pure Python: about 0.6 ms per one-line target), and its result is a function of
WORKSPACE.toml, targets/**/*.toml and bgraph's code alone.

It is kept in the cache, never in the workspace (a checkout could ship one), as JSON: the
validated models dumped by pydantic and validated again on load, so nothing kept is executed or
unpickled. A kept parse is used while the file-state stamp (incremental/filestate.py) of each of
those files holds; a load during which one of them was racily clean is not kept. A damaged,
foreign or unreadable one is ignored (the workspace is parsed).
"""

from __future__ import annotations

import hashlib
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from build_graph.incremental import filestate
from build_graph.store import uptodate
from build_graph.store.atomic import write_bytes

if TYPE_CHECKING:
    from build_graph.workspace import Workspace

FORMAT = 1


def _inputs(root: Path) -> dict[str, Any]:
    """The stamps the parse depends on: the workspace's own files, bgraph's code, Python."""
    files = [root / "WORKSPACE.toml", *sorted((root / "targets").rglob("*.toml"))]
    return {"format": FORMAT, "python": sys.version, "root": str(root),
            "files": {str(p): filestate.stamp(p) for p in [*files, *map(Path, uptodate.code_files())]}}


def kept_path(records: Path, root: Path) -> Path:
    """Where the parse of the workspace at `root` is kept: beside the cache's no-op records."""
    return records / f"{hashlib.sha256(str(root).encode()).hexdigest()[:32]}.parsed"


def load(root: Path, parse, records: Path | None) -> Workspace:
    """`parse(root)`, or the kept result of the last parse while none of its inputs changed;
    `records` is the cache's record directory (None: nothing is kept)."""
    root = root.resolve()
    started = time.time_ns()
    inputs = _inputs(root)
    path = kept_path(records, root) if records is not None else None
    if path is not None:
        kept = _read(path, inputs)
        if kept is not None:
            return kept
    workspace = parse(root)
    if path is not None and not any(s is None or filestate.racy(s, started) for s in inputs["files"].values()):
        _keep(path, inputs, workspace)
    return workspace


def _read(path: Path, inputs: dict[str, Any]) -> Workspace | None:
    from pydantic import ValidationError

    from build_graph.labels import parse_label
    from build_graph.rules.registry import RULES
    from build_graph.workspace import Target, Workspace, WorkspaceModel

    try:
        raw = orjson.loads(path.read_bytes())
        if raw.get("inputs") != orjson.loads(orjson.dumps(inputs)):
            return None
        targets = {}
        for label_text, kind, attrs, file, table in raw["targets"]:
            label = parse_label(label_text)
            targets[label] = Target(label, kind, RULES[kind].attrs.model_validate(attrs), file, table)
        return Workspace(Path(inputs["root"]), WorkspaceModel.model_validate(raw["model"]), targets,
                         acyclic=bool(raw["acyclic"]))
    except (OSError, orjson.JSONDecodeError, ValidationError, KeyError, TypeError, ValueError, AttributeError):
        return None  # missing, damaged, or written by another bgraph: parse
    except Exception:  # noqa: BLE001 - a label that no longer parses, or any other surprise: parse
        return None


def _keep(path: Path, inputs: dict[str, Any], workspace: Workspace) -> None:
    try:
        data = {"inputs": inputs,
                "model": workspace.model.model_dump(mode="json", by_alias=True),
                "targets": [[str(t.label), t.kind, t.attrs.model_dump(mode="json", by_alias=True), t.file, t.table]
                            for t in workspace.targets.values()],
                "acyclic": workspace.acyclic}
        path.parent.mkdir(parents=True, exist_ok=True)
        write_bytes(path, orjson.dumps(data))
    except (OSError, TypeError, ValueError):
        pass  # not kept: the next command parses again
