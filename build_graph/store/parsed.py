"""The parsed workspace, kept between commands: `workspace.load` parses and validates every target
file (tomllib is pure Python: about 0.6 ms per one-line target), and its result is a function of
WORKSPACE.toml, targets/**/*.toml and bgraph's code alone.

It is kept in the cache, never in the workspace (a checkout could ship one), as a row of the
cache's state file (store/statefile.py, `parses`, by workspace root) holding JSON: the
validated models dumped by pydantic and validated again on load, so nothing kept is executed or
unpickled. A kept parse is used while the file-state stamp (incremental/filestate.py, settled:
a target file edited through a shared mapping is written back before it is stamped) of each of
those files holds; a load during which one of them was racily clean is not kept. A damaged,
foreign or unreadable one is ignored (the workspace is parsed). A command that only reads
(explain, why) keeps none in a cache that has no state file yet.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from build_graph.incremental import filestate
from build_graph.roots import target_files
from build_graph.store import uptodate
from build_graph.store.statefile import StateFile

if TYPE_CHECKING:
    from build_graph.workspace import Workspace

FORMAT = 2  # 2: a row of the state file


def _inputs(root: Path) -> dict[str, Any]:
    """The stamps the parse depends on: the workspace's own files, bgraph's code, Python."""
    files = [root / "WORKSPACE.toml", *target_files(root)]
    return {"format": FORMAT, "python": sys.version, "root": str(root),
            "files": {str(p): filestate.stamp(p) for p in [*files, *map(Path, uptodate.code_files())]}}


def load(root: Path, parse, state: Path | None, create: bool = True) -> Workspace:
    """`parse(root)`, or the kept result of the last parse while none of its inputs changed;
    `state` is the cache's state file (None: nothing is kept; `create=False`: a reader's, which
    keeps nothing where the file is missing)."""
    root = root.resolve()
    started = time.time_ns()
    inputs = _inputs(root)
    rows = StateFile(state, create) if state is not None else None
    if rows is not None:
        kept = _read(rows.parse(str(root)), inputs)
        if kept is not None:
            return kept
    workspace = parse(root)
    if rows is not None and not any(s is None or filestate.racy(s, started) for s in inputs["files"].values()):
        _keep(rows, inputs, workspace)
    return workspace


def _read(data: bytes | None, inputs: dict[str, Any]) -> Workspace | None:
    from build_graph.labels import parse_label
    from build_graph.rules.registry import RULES
    from build_graph.workspace import Target, Workspace, WorkspaceModel

    if data is None:
        return None
    try:
        raw = orjson.loads(data)
        if raw.get("inputs") != orjson.loads(orjson.dumps(inputs)):
            return None
        targets = {}
        for label_text, kind, attrs, file, table in raw["targets"]:
            label = parse_label(label_text)
            targets[label] = Target(label, kind, RULES[kind].attrs.model_validate(attrs), file, table)
        return Workspace(Path(inputs["root"]), WorkspaceModel.model_validate(raw["model"]), targets,
                         acyclic=bool(raw["acyclic"]))
    except Exception:  # noqa: BLE001 - damaged, another bgraph's, a label that no longer parses: parse
        return None


def _keep(rows: StateFile, inputs: dict[str, Any], workspace: Workspace) -> None:
    try:
        data = {"inputs": inputs,
                "model": workspace.model.model_dump(mode="json", by_alias=True),
                "targets": [[str(t.label), t.kind, t.attrs.model_dump(mode="json", by_alias=True), t.file, t.table]
                            for t in workspace.targets.values()],
                "acyclic": workspace.acyclic}
        encoded = orjson.dumps(data)
    except (TypeError, ValueError):
        return  # not kept: the next command parses again
    rows.put_parse(inputs["root"], encoded)
