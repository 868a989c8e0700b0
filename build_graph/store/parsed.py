"""The parsed workspace, kept between commands: `workspace.load` parses and validates every target
file (tomllib and pydantic: ~0.15 ms per one-line target, 1.5 s at 10,000), and its result is a
function of WORKSPACE.toml, targets/**/*.toml and bgraph's code alone. It is pickled to
`bgraph-out/.uptodate/workspace.pickle` with the stat stamps of exactly those files, and used
while every stamp holds. A file written within uptodate.RACY_S of the load is not trusted by its
stamp: such a load is not kept. A damaged or foreign pickle is ignored (the workspace is parsed).
"""

from __future__ import annotations

import pickle
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from build_graph.store import uptodate
from build_graph.store.atomic import write_bytes

if TYPE_CHECKING:
    from build_graph.workspace import Workspace

NAME = "workspace.pickle"


def _inputs(root: Path) -> dict[str, Any]:
    """The stamps the parse depends on: the workspace's own files, bgraph's code, Python."""
    files = [root / "WORKSPACE.toml", *sorted((root / "targets").rglob("*.toml"))]
    return {"python": sys.version,
            "files": {str(p): uptodate.stamp_of(p) for p in [*files, *map(Path, uptodate.code_files())]}}


def load(root: Path, parse) -> Workspace:
    """`parse(root)`, or the kept result of the last parse while none of its inputs changed."""
    root = root.resolve()
    path = root / "bgraph-out" / uptodate.RECORD_DIR / NAME
    started = time.time_ns()
    inputs = _inputs(root)
    try:
        with open(path, "rb") as f:
            kept_inputs, workspace = pickle.load(f)
        if kept_inputs == inputs:
            return workspace
    except Exception:  # missing, damaged, or written by another bgraph: parse
        pass
    workspace = parse(root)
    if not uptodate.racy({p: s for p, s in inputs["files"].items() if s}, started):
        _keep(path, inputs, workspace)
    return workspace


def _keep(path: Path, inputs: dict[str, Any], workspace: Workspace) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_bytes(path, pickle.dumps((inputs, workspace), protocol=pickle.HIGHEST_PROTOCOL))
    except (OSError, pickle.PicklingError, TypeError, AttributeError):
        pass  # not kept: the next command parses again
