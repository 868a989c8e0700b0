"""Build variants: the workspace with some targets' attributes replaced and some source files
given as blobs already in the CAS instead of files on disk, built by the ordinary Engine with
the ordinary cache (so a variant executes only what differs from what was built before).

`bgraph audit` (audit.py) makes one per patch hunk: the patched_tree target with its patches
split into one patch file per hunk (patches.py), those files virtual, and one hunk left out.
The default Variant() is the workspace as it is. A named variant keeps its own build trace
(under <cache>/variants/), so the next ordinary build still explains its misses against the
last ordinary build.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from build_graph.labels import Label
from build_graph.model import FileEntry, Tree
from build_graph.planner import SourceFiles, expand_sources
from build_graph.store.trace import Trace
from build_graph.workspace import Target, Workspace


@dataclass(frozen=True, eq=False)
class Variant:
    name: str = ""  # what the variant changes, for people; "" is the workspace as it is
    targets: Mapping[Label, Target] = field(default_factory=dict)  # replaced targets (same labels)
    files: Mapping[str, FileEntry] = field(default_factory=dict)  # virtual workspace path -> blob

    def workspace(self, ws: Workspace) -> Workspace:
        if not self.targets:
            return ws
        return dataclasses.replace(ws, targets={**ws.targets, **self.targets})

    def trace(self, base: Path, tmp: Path) -> Trace:
        if not self.name:
            return Trace(base, tmp)
        return Trace(base / "variants" / hashlib.sha256(self.name.encode()).hexdigest()[:24], tmp)

    def expand(self, ws: Workspace, target: Target, files: SourceFiles) -> dict[str, list[str]]:
        """A target's source paths (expand_sources), virtual files included."""
        return expand_sources(ws, target, files, self.files)

    def store(self, cas, root: Path, expanded: dict[str, list[str]], hash_only: bool = False) -> Tree:
        """The target's sources as a tree: files from disk stored (cas.store_sources; only hashed
        with `hash_only`, for a build that runs nothing), virtual ones as they are (their blobs
        held by this build, like every source's)."""
        paths = [p for ps in expanded.values() for p in ps]
        disk = [p for p in paths if p not in self.files]
        tree = cas.hash_sources(root, disk) if hash_only else cas.store_sources(root, disk)
        virtual = {p: self.files[p] for p in paths if p in self.files}
        if not virtual:
            return tree
        cas.holds.hold_many("blob", (f.digest for f in virtual.values()))
        return Tree({**tree.entries, **virtual})
