"""The per-target memo: what each configured target of the last successful build of a request
read from the workspace, what it produced and which actions it took, kept in the same row of the
cache's state file as that build's no-op record (store/statefile.py, `records.memo`), filed by
the engine at the end of the build (Engine.remember).

The no-op record answers "did anything change"; the memo answers "what does this change reach".
When only the contents of workspace files changed since the record (no file added or removed,
no code, config, host tool or cache generation: `uptodate.changed_files`; not WORKSPACE.toml), a
target is reused whole, without expanding, storing or hashing its sources, planning it or
computing a key, where none of its own sources changed and every dependency's output equals the
one it was built from (early cutoff at target level). Every other target takes the full path.

A changed target file (targets/*.toml) does not void the memo: each entry keeps a digest of its
target's definition (`definition`), and a target is reused only where that digest is the one of
its definition now. The configured graph is then built afresh (a dependency may have been added),
and the targets are checked one by one (`Reuse.definitions`) instead of through the memo's graph.

Why reuse is exact: a target's plan is a function of its definition (its digest compared, and no
code changed), its configuration (part of the request), its sources (stamps unchanged),
its dependencies' outputs (compared), probed host tools (stamped in the record) and the action
cache, whose entries a reused target's actions were hits in; what `cache gc` or `cache verify
--repair` removes bumps the generation, checked again after the build holds the reused keys
(engine.py). A source outside the record's scan (under `.git/`, `__pycache__/` or the cache),
whose changes the stamps cannot see, makes its target never reused ("volatile").

A request with no record of its own (a first build of these targets) takes the memo of the last
build of its family: the same workspace, cache and configuration, other targets (`noop.Request.
family`). Its targets are then checked one by one, like after a target-file edit.

The memo and its record are written in one transaction, so a memo is always its record's (a
killed or concurrent build leaves both old or both new). A damaged or foreign memo is ignored.
It is JSON (orjson), never a pickle: reading bgraph's state runs no code, whoever wrote the cache.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from graphlib import TopologicalSorter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

if TYPE_CHECKING:  # not imported by a no-op
    from build_graph.model import TargetOutput

FORMAT = 4  # 3: JSON; 4: a row beside its record (no name)

@dataclass(frozen=True)
class Entry:
    """One configured target as the last build left it."""

    sources: tuple[str, ...]  # workspace paths of its sources (globs expanded)
    output: TargetOutput
    actions: tuple[tuple[str, str, str], ...]  # (name, mnemonic, key) of each action it took
    deps: tuple[str, ...] = ()  # its configured dependencies
    node: Any = None  # encode_node(configs.Configured, its configured edges): decoded only if it is planned again
    volatile: bool = False  # a source the stamps cannot see: never reused
    definition: str = ""  # definition_of(its target) when it was planned


def definition_of(target: Any) -> str:
    """A digest of everything a workspace.Target says (label, kind, where it is written, every
    attribute with its default): two targets with one digest plan alike."""
    head = f"{target.label}\0{target.kind}\0{target.file}\0{target.table}\0".encode()
    return hashlib.sha256(head + target.attrs.model_dump_json().encode()).hexdigest()


def encode_node(node: Any, edges: dict) -> list:
    """A configured target and its edges ((attribute key, label) -> configured dependency) as JSON."""
    def configured(c: Any) -> list:
        return [str(c.label), c.config.exec, c.config.target, c.tag]
    return [configured(node), [[key, str(label), *configured(dep)] for (key, label), dep in edges.items()]]


def decode_node(raw: list) -> tuple[Any, dict]:
    """What encode_node wrote: (configs.Configured, its edges)."""
    from build_graph.configs import Config, Configured
    from build_graph.labels import parse_label

    def configured(label: str, exec_: str, target: str, tag: str) -> Any:
        return Configured(parse_label(label), Config(exec_, target), tag)
    node, edges = raw
    return configured(*node), {(key, parse_label(label)): configured(*dep) for key, label, *dep in edges}


def _encode_value(v: Any) -> Any:
    """A target output's info as JSON: trees (a system root) and tuples tagged, so they decode
    to what they were (an output compares equal to the one it was built from)."""
    from build_graph.model import Tree
    from build_graph.store.state import encode_tree

    if isinstance(v, Tree):
        return {"$tree": orjson.Fragment(encode_tree(v))}
    if isinstance(v, dict):
        if not all(isinstance(k, str) for k in v):
            raise TypeError("info keys must be strings")
        return {k: _encode_value(x) for k, x in v.items()}
    if isinstance(v, tuple):
        return {"$tuple": [_encode_value(x) for x in v]}
    if isinstance(v, list):
        return [_encode_value(x) for x in v]
    if v is None or isinstance(v, (str, int, float, bool)):
        return v
    raise TypeError(f"cannot keep {type(v).__name__} in a memo")


def _decode_value(v: Any) -> Any:
    if isinstance(v, dict):
        if "$tree" in v:
            from build_graph.store.state import decode_tree
            return decode_tree(v["$tree"])
        if "$tuple" in v:
            return tuple(_decode_value(x) for x in v["$tuple"])
        return {k: _decode_value(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_decode_value(x) for x in v]
    return v


def _encode_entry(e: Entry) -> list:
    from build_graph.store.state import encode_tree
    return [list(e.sources), orjson.Fragment(encode_tree(e.output.tree)), _encode_value(dict(e.output.info)),
            [list(a) for a in e.actions], list(e.deps), e.node, e.volatile, e.definition]


def _decode_entry(raw: list) -> Entry:
    from build_graph.model import TargetOutput
    from build_graph.store.state import decode_tree
    sources, rows, info, actions, deps, node, volatile, definition = raw
    return Entry(tuple(sources), TargetOutput(decode_tree(rows), _decode_value(info) if info else {}),
                 tuple(tuple(a) for a in actions), tuple(deps), node, bool(volatile), definition)


def encode(entries: dict[str, Entry], scanned: dict[str, Any]) -> bytes | None:
    """The memo's row (str(configured target) -> entry), each entry with a source outside the
    workspace scan `scanned` (whose changes no stamp shows) marked never to be reused; None where
    an output cannot be kept (its target then takes the full path next time, like every other)."""
    try:
        return orjson.dumps({"format": FORMAT, "entries": {
            k: _encode_entry(e if e.volatile or all(p in scanned for p in e.sources) else replace(e, volatile=True))
            for k, e in entries.items()}})
    except (TypeError, ValueError, AttributeError, orjson.JSONEncodeError):
        return None


def decode(data: Any) -> dict[str, Entry] | None:
    """The entries `encode` wrote, if they are whole and of this bgraph."""
    if data is None:
        return None
    try:
        raw = orjson.loads(data)
        if raw["format"] != FORMAT:
            return None
        return {k: _decode_entry(e) for k, e in raw["entries"].items()}
    except Exception:  # noqa: BLE001 - damaged, or another bgraph's: every target takes the full path
        return None


@dataclass
class Reuse:
    """A build's view of the memo: which targets it may take as they were."""

    entries: dict[str, Entry]
    changed: set[str]  # workspace files whose contents changed since the memo's build
    generation: Path  # the cache's generation file, checked again once the reused keys are held
    generation_stamp: list | None
    # A target file changed: an entry holds only for a target whose definition_of is the entry's,
    # and the memo's graph is not the workspace's (subgraph() offers none).
    definitions: bool = False
    # The memo is another request's (the last build of other targets, same workspace and
    # configuration): its graph is not this request's either.
    other_request: bool = False

    @property
    def graph_current(self) -> bool:
        """Whether the memo's configured graph is this build's: the request's own, no target file
        changed (its build checked it for cycles, and subgraph() may stand in for configuring)."""
        return not (self.definitions or self.other_request)

    def _touched(self, e: Entry) -> bool:
        """Whether a changed file (or one the stamps cannot see) is among the target's sources."""
        return e.volatile or not self.changed.isdisjoint(e.sources)

    def entry(self, label: str) -> Entry | None:
        """The memo's entry for a target none of whose own sources changed, else None."""
        e = self.entries.get(label)
        return None if e is None or self._touched(e) else e

    def taken(self, name: str, redefined: bool, deps: dict[str, Any], damaged) -> Entry | None:
        """The entry of a target the build takes as the last one left it: none of its sources
        changed, its definition did not (`redefined`), its dependencies (`deps`: name -> output
        now) are the configured targets it was built from, each with the output it had then, and
        its own output verifies (`damaged(tree)` lists nothing: else it was changed or
        collected); None: the rebuilder decides."""
        e = self.entry(name)
        if e is None or redefined:
            return None
        if set(deps) != set(e.deps):
            return None  # a dependency configured otherwise now (another platform): another node
        for dep, output in deps.items():
            was = self.entries.get(dep)
            if was is None or output != was.output:
                return None
        return None if damaged(e.output.tree) else e

    def affected(self) -> set[str]:
        """The targets a changed source reaches: those reading one (or a volatile source), and
        everything that depends on them. The rest are taken as they were, unvisited."""
        todo = [name for name, e in self.entries.items() if self._touched(e)]
        if not todo:
            return set()
        dependents: dict[str, list[str]] = {}
        for name, e in self.entries.items():
            for d in e.deps:
                dependents.setdefault(d, []).append(name)
        seen = set(todo)
        while todo:
            for up in dependents.get(todo.pop(), ()):
                if up not in seen:
                    seen.add(up)
                    todo.append(up)
        return seen

    def subgraph(self, requested: list) -> tuple[Any, dict, set[str]] | None:
        """The part of the configured graph a build must visit (configs.ConfiguredGraph over the
        affected targets), the outputs of the targets it reads and does not visit, and the names
        of those visited; None where the memo does not cover the request, is another request's,
        or a target file changed."""
        from build_graph.configs import ConfiguredGraph

        if not self.graph_current or any(str(r) not in self.entries for r in requested):
            return None
        names = self.affected()
        entries = self.entries
        if any(not entries[n].node for n in names):
            return None
        deps, dep_labels = {}, {}
        for name in names:
            node, edges = decode_node(entries[name].node)
            dep_labels[node] = edges
            deps[node] = list(dict.fromkeys(edges.values()))
        order = list(TopologicalSorter({n: [d for d in ds if str(d) in names] for n, ds in deps.items()}).static_order())
        known = {str(d): d for ds in deps.values() for d in ds} | {str(r): r for r in requested}
        prebuilt = {c: entries[n].output for n, c in known.items() if n not in names}
        return ConfiguredGraph(order, deps, dep_labels), prebuilt, names

    def keys(self) -> list[str]:
        """Every action key the memo's targets took (held by the build before any is reused)."""
        return [key for e in self.entries.values() for _name, _mnemonic, key in e.actions]

    def still_valid(self) -> bool:
        """Nothing was collected from the cache since the record was checked."""
        from build_graph.store.uptodate import stamp_of
        return stamp_of(self.generation) == self.generation_stamp
