"""Targets -> actions: builds each rule's context and drives its plan (a generator that may
yield several batches of actions, each planned from the outcomes of the last: continuations)."""

from __future__ import annotations

import errno
import glob
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Container

from build_graph.incremental.filestate import utf8_name
from build_graph.errors import LoadError, PlanError, where
from build_graph.configs import Config
from build_graph.labels import Label
from build_graph.roots import globbed
from build_graph.model import Action, Digester, FileEntry, HostTool, Outcome, TargetOutput, Tree
from build_graph.rules.base import Dataflow, Parallel, RuleContext
from build_graph.rules.registry import RULES
from build_graph.workspace import Target, Workspace


def expand_sources(ws: Workspace, target: Target, files: "SourceFiles",
                   virtual: Container[str] = ()) -> dict[str, list[str]]:
    """Each source attribute's workspace paths, globs expanded and sorted; missing files are errors.
    `files`: the build's SourceFiles, shared by the targets it expands; it knows the cache, which
    no glob may reach (required: a caller that forgot it let a memo-path glob into the cache).
    `virtual`: paths that exist only in the CAS (a build variant's files, variants.py), named literally."""
    out: dict[str, list[str]] = {}
    seen: dict[str, set[str]] = {}  # out's paths per key (a list's `in` made a big glob quadratic)
    is_file, cache = files.is_file, files.cache_prefix
    for key, pattern in RULES[target.kind].sources(target.attrs):
        if pattern.startswith("/") or ".." in pattern.split("/"):
            raise LoadError(f"source {pattern!r} must be a path inside the workspace",
                            where=where(target.file, target.table, key))
        if "*" in pattern or "?" in pattern or "[" in pattern:
            matches = sorted(rel for p in glob.glob(str(ws.root / pattern), recursive=True)
                             if globbed(rel := os.path.relpath(p, ws.root)) and not (cache and rel.startswith(cache))
                             and os.path.isfile(p))
            if not matches:
                raise LoadError(f"glob {pattern!r} matches no file", where=where(target.file, target.table, key))
            for m in matches:
                if not utf8_name(m):  # a tree path is text: such a name cannot be keyed or mounted
                    raise LoadError(f"glob {pattern!r} matches {m.encode('utf-8', 'surrogateescape')!r}, whose "
                                    "name is not valid UTF-8", where=where(target.file, target.table, key),
                                    hint="rename the file (e.g. `convmv -f latin1 -t utf-8`), or narrow the glob")
        else:
            if pattern not in virtual and not is_file(pattern):
                raise LoadError(f"source file {pattern!r} does not exist", where=where(target.file, target.table, key))
            matches = [pattern]
        have, known = out.setdefault(key, []), seen.setdefault(key, set())
        new = [m for m in matches if m not in known]
        have += new
        known.update(new)
    return out


_MISSING = (errno.ENOENT, errno.ENOTDIR, errno.EBADF, errno.ELOOP)


def _is_file(root: str, path: str) -> bool:
    """`(Path(root) / path).is_file()` without making a Path per source (the same answers and
    errors: pathlib drops a trailing slash, so such a path goes through pathlib)."""
    if path.endswith("/"):
        return (Path(root) / path).is_file()
    try:
        return stat.S_ISREG(os.stat(f"{root}/{path}").st_mode)
    except OSError as e:
        if e.errno not in _MISSING:
            raise
        return False
    except ValueError:
        return False


class SourceFiles:
    """Whether workspace paths are files, for one build's expansion: `_is_file`'s answers, but a
    directory asked about LIST_AFTER times is listed once, where each entry's type needs no stat
    (100,000 genrules over one directory were 100,000 stats, a twentieth of planning them). An
    entry the listing cannot tell (a symlink, an unknown type) is stat'ed as before."""

    LIST_AFTER = 32

    def __init__(self, root: Path, cache: Path | None) -> None:
        self.root = os.fspath(root)
        # The build's cache, where it lies inside the workspace: the no-op scan skips it, so a
        # glob must never match there (its files change with every build).
        inside = cache is not None and Path(os.path.realpath(cache)).is_relative_to(os.path.realpath(root))
        self.cache_prefix = os.path.relpath(os.path.realpath(cache), os.path.realpath(root)) + "/" if inside else None
        self._asked: dict[str, int] = {}
        self._listed: dict[str, dict[str, bool | None]] = {}

    def is_file(self, path: str) -> bool:
        directory, _, name = path.rpartition("/")
        if not name:  # a trailing slash: pathlib's answer
            return _is_file(self.root, path)
        listed = self._listed.get(directory)
        if listed is None:
            asked = self._asked[directory] = self._asked.get(directory, 0) + 1
            if asked < self.LIST_AFTER or (listed := self._list(directory)) is None:
                return _is_file(self.root, path)
        found = listed.get(name, False)
        return found if found is not None else _is_file(self.root, path)

    def _list(self, directory: str) -> dict[str, bool | None] | None:
        """name -> is a regular file (None: ask stat); None where the directory cannot be listed."""
        try:
            with os.scandir(f"{self.root}/{directory}" if directory else self.root) as entries:
                listed = {e.name: None if e.is_symlink() else e.is_file(follow_symlinks=False) for e in entries}
        except OSError:
            return None
        self._listed[directory] = listed
        return listed


@dataclass(eq=False)
class _Frame:
    """One running generator: the rule's plan, or a sub-plan started with Parallel."""

    gen: Any
    parent: "_Frame | None"
    index: int  # position in the parent's results
    results: list[Any] = field(default_factory=list)
    waiting: int = 0


@dataclass(eq=False)
class _Flow:
    """A Dataflow a frame yielded: which steps are done, and how many needs each one still waits on."""

    frame: _Frame  # resumed with `done` once every step is
    steps: dict[str, tuple[tuple[str, ...], Callable[[dict[str, Any]], Action]]]
    missing: dict[str, int]
    dependents: dict[str, list[str]]
    done: dict[str, Any] = field(default_factory=dict)


Slot = tuple[_Frame | _Flow, Any]  # (frame, index in its batch) or (flow, step name)


class TargetPlan:
    """One target's plan in progress: a tree of generator frames.

    A frame yields a list of actions (resumed with their Outcomes once all are known), a
    Parallel of sub-plans (resumed with their return values), or a Dataflow (each step made
    and run once the steps it needs are done; resumed with all their Outcomes). Sibling
    sub-plans advance independently, so one translation unit's chain never waits at another's
    barrier, and a Dataflow's steps never wait at a wave's.
    """

    def __init__(self, target: Target, gen: Any):
        self.target = target
        self.root = _Frame(gen, None, 0)
        self.output: TargetOutput | None = None

    def start(self) -> list[tuple[Slot, Action]]:
        """Run the plan to its first actions; returns them with the slots to complete."""
        return self._send(self.root, None)

    def complete(self, slot: Slot, outcome: Outcome) -> list[tuple[Slot, Action]]:
        """Record one action's outcome; returns the actions this made ready."""
        frame, i = slot
        if isinstance(frame, _Flow):
            return self._flow_done(frame, i, outcome)
        frame.results[i] = outcome
        frame.waiting -= 1
        return self._send(frame, frame.results) if frame.waiting == 0 else []

    def _send(self, frame: _Frame, value: Any) -> list[tuple[Slot, Action]]:
        ready: list[tuple[Slot, Action]] = []
        while True:
            try:
                step = frame.gen.send(value)
            except StopIteration as stop:
                if frame.parent is None:
                    if not isinstance(stop.value, TargetOutput):
                        raise PlanError("rule returned no TargetOutput", where=str(self.target.label)) from None
                    self.output = stop.value
                    return ready
                parent = frame.parent
                parent.results[frame.index] = stop.value
                parent.waiting -= 1
                if parent.waiting:
                    return ready
                frame, value = parent, parent.results
                continue
            if isinstance(step, Parallel):
                frame.results, frame.waiting = [None] * len(step.plans), len(step.plans)
                if not step.plans:
                    value = []
                    continue
                for i, sub in enumerate(step.plans):
                    ready += self._send(_Frame(sub, frame, i), None)
                return ready
            if isinstance(step, Dataflow):
                if not step.steps:
                    value = {}
                    continue
                return ready + self._flow_start(frame, step)
            batch = list(step)
            if not batch:
                raise PlanError("rule yielded an empty batch", where=str(self.target.label))
            frame.results, frame.waiting = [None] * len(batch), len(batch)
            return ready + [((frame, i), a) for i, a in enumerate(batch)]


    def _flow_start(self, frame: _Frame, flow: Dataflow) -> list[tuple[Slot, Action]]:
        """Check the graph (every need a step, no cycle) and return its first actions."""
        dependents: dict[str, list[str]] = {name: [] for name in flow.steps}
        for name, (needs, _make) in flow.steps.items():
            for n in dict.fromkeys(needs):
                if n not in dependents:
                    raise PlanError(f"step {name!r} needs {n!r}, which no step makes", where=str(self.target.label))
                dependents[n].append(name)
        missing = {name: len(set(needs)) for name, (needs, _make) in flow.steps.items()}
        order = [name for name, m in missing.items() if not m]
        left = dict(missing)
        for name in order:  # Kahn's walk: every step must be reachable
            for d in dependents[name]:
                left[d] -= 1
                if not left[d]:
                    order.append(d)
        if len(order) != len(flow.steps):
            stuck = sorted(set(flow.steps) - set(order))
            raise PlanError(f"steps form a cycle: {', '.join(stuck[:4])}", where=str(self.target.label))
        state = _Flow(frame, flow.steps, missing, dependents)
        return [self._flow_make(state, name) for name, m in missing.items() if not m]

    def _flow_make(self, flow: _Flow, name: str) -> tuple[Slot, Action]:
        needs, make = flow.steps[name]
        return (flow, name), make({n: flow.done[n] for n in needs})

    def _flow_done(self, flow: _Flow, name: str, outcome: Outcome) -> list[tuple[Slot, Action]]:
        """One step of a Dataflow done: the steps it was the last need of, or the frame's resumption."""
        flow.done[name] = outcome
        if len(flow.done) == len(flow.steps):
            return self._send(flow.frame, flow.done)
        ready = []
        for d in flow.dependents[name]:
            flow.missing[d] -= 1
            if not flow.missing[d]:
                ready.append(self._flow_make(flow, d))
        return ready


def plan_target(ws: Workspace, target: Target, config: Config, digester: Digester,
                deps: dict[Label, TargetOutput], sources: Tree, expanded: dict[str, list[str]],
                read: Callable[[FileEntry], bytes],
                probe_host: Callable[[tuple[str, ...]], tuple[HostTool, ...]]) -> TargetPlan:
    """Start `target`'s rule in `config`, over its dependencies' outputs (by label, each in the
    configuration configs.py gave that edge)."""
    rule = RULES[target.kind]
    ctx = RuleContext(
        label=target.label, attrs=target.attrs, file=target.file, table=target.table, platform=config.target,
        exec_platform=config.exec, digester=digester, deps=deps, sources=sources, pins=ws.pin,
        arch_sets=ws.archs, read=read, probe_host=probe_host, rule_version=f"{target.kind}/{rule.version}",
        extra={"expanded": expanded})
    return TargetPlan(target, rule.plan(ctx))
