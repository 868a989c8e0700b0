"""Targets -> actions: builds each rule's context and drives its plan (a generator that may
yield several batches of actions, each planned from the outcomes of the last: continuations)."""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass, field
from typing import Callable

from build_graph.errors import LoadError, PlanError, where
from build_graph.labels import Label, parse_label
from build_graph.model import Action, Digester, FileEntry, HostTool, Outcome, TargetOutput, Tree
from build_graph.rules.base import RuleContext
from build_graph.rules.registry import RULES
from build_graph.workspace import Target, Workspace


def expand_sources(ws: Workspace, target: Target) -> dict[str, list[str]]:
    """Each source attribute's workspace paths, globs expanded and sorted; missing files are errors."""
    out: dict[str, list[str]] = {}
    for key, pattern in RULES[target.kind].sources(target.attrs):
        loc = where(target.file, target.table, key)
        if pattern.startswith("/") or ".." in pattern.split("/"):
            raise LoadError(f"source {pattern!r} must be a path inside the workspace", where=loc)
        if any(c in pattern for c in "*?["):
            matches = sorted(os.path.relpath(p, ws.root) for p in glob.glob(str(ws.root / pattern), recursive=True)
                             if os.path.isfile(p))
            if not matches:
                raise LoadError(f"glob {pattern!r} matches no file", where=loc)
        else:
            if not (ws.root / pattern).is_file():
                raise LoadError(f"source file {pattern!r} does not exist", where=loc)
            matches = [pattern]
        out.setdefault(key, [])
        out[key] += [m for m in matches if m not in out[key]]
    return out


@dataclass
class TargetPlan:
    """One target's plan in progress."""

    target: Target
    gen: object
    batch: list[Action] = field(default_factory=list)
    output: TargetOutput | None = None

    def start(self) -> None:
        self._advance(None)

    def resume(self, outcomes: list[Outcome]) -> None:
        self._advance(outcomes)

    def _advance(self, value) -> None:
        try:
            batch = self.gen.send(value)  # type: ignore[attr-defined]
        except StopIteration as stop:
            if not isinstance(stop.value, TargetOutput):
                raise PlanError("rule returned no TargetOutput", where=str(self.target.label)) from None
            self.output, self.batch = stop.value, []
            return
        if not batch:
            raise PlanError("rule yielded an empty batch", where=str(self.target.label))
        self.batch = list(batch)


def plan_target(ws: Workspace, target: Target, platform: str, digester: Digester,
                outputs: dict[Label, TargetOutput], sources: Tree, expanded: dict[str, list[str]],
                read: Callable[[FileEntry], bytes],
                probe_host: Callable[[tuple[str, ...]], tuple[HostTool, ...]]) -> TargetPlan:
    rule = RULES[target.kind]
    deps = {}
    for key, text in rule.deps(target.attrs):
        lab = parse_label(text, package=target.label.package)
        deps[lab] = outputs[lab]
    ctx = RuleContext(
        label=target.label, attrs=target.attrs, file=target.file, table=target.table, platform=platform,
        digester=digester, deps=deps, sources=sources, pins=ws.pin, arch_sets=ws.archs, read=read,
        probe_host=probe_host, rule_version=f"{target.kind}/{rule.version}", extra={"expanded": expanded})
    return TargetPlan(target, rule.plan(ctx))
