"""The build loop: plan targets in dependency order, ask the rebuilder, run misses on the
scheduler, store results, record reasons in the trace, and tell the reporter."""

from __future__ import annotations

import random
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from build_graph import archive
from build_graph.errors import ActionFailed, BgraphError
from build_graph.graph import build_graph, deps as graph_deps
from build_graph.labels import Label, parse_label
from build_graph.model import Action, ActionResult, Digester, HostTool, Outcome, TargetOutput, Tree
from build_graph.planner import TargetPlan, expand_sources, plan_target
from build_graph.rebuilder import Hit, Miss, Rebuilder
from build_graph.rules.registry import RULES
from build_graph.scheduler import Scheduler
from build_graph.store.action_cache import LocalActionCache
from build_graph.store.cas import LocalCas
from build_graph.store.trace import Trace
from build_graph.workspace import Workspace, host_platform


@dataclass
class ActionRecord:
    label: str
    name: str
    mnemonic: str
    key: str
    status: str  # executed | hit | cutoff | failed | skipped
    reason: str = ""
    duration_s: float = 0.0
    differs: bool = False


@dataclass
class BuildOptions:
    jobs: int = 2
    max_mem_mb: int = 4096
    keep_going: bool = False
    check: bool = False
    check_sample: int | None = None
    platform: str = field(default_factory=host_platform)


@dataclass
class BuildResult:
    records: list[ActionRecord]
    outputs: dict[Label, TargetOutput]
    failures: list[BgraphError]
    wall_s: float
    requested: list[Label]

    def count(self, status: str) -> int:
        return sum(1 for r in self.records if r.status == status)

    def summary(self) -> dict[str, Any]:
        return {
            "ok": not self.failures,
            "executed": self.count("executed"),
            "hits": self.count("hit"),
            "cut_off": self.count("cutoff"),
            "failed": self.count("failed"),
            "differing": [f"{r.label} {r.name}" for r in self.records if r.differs],
            "wall_s": round(self.wall_s, 3),
            "targets": [str(t) for t in self.requested],
            "actions": [asdict(r) for r in self.records],
            "errors": [e.render() for e in self.failures],
        }


class Reporter(Protocol):
    def start(self, total_targets: int) -> None: ...
    def action_started(self, label: Label, action: Action) -> None: ...
    def action_done(self, record: ActionRecord) -> None: ...
    def target_done(self, label: Label) -> None: ...
    def finish(self) -> None: ...


class NullReporter:
    def start(self, total_targets: int) -> None: ...
    def action_started(self, label: Label, action: Action) -> None: ...
    def action_done(self, record: ActionRecord) -> None: ...
    def target_done(self, label: Label) -> None: ...
    def finish(self) -> None: ...


class Engine:
    def __init__(self, ws: Workspace, cache_dir: Path, options: BuildOptions | None = None,
                 reporter: Reporter | None = None):
        self.ws = ws
        self.options = options or BuildOptions()
        self.reporter = reporter or NullReporter()
        self.digester = Digester(ws.digest_function)
        self.cas = LocalCas(cache_dir, self.digester)
        self.ac = LocalActionCache(self.cas.base, self.cas.tmp)
        self.trace = Trace(self.cas.base, self.cas.tmp)
        self.rebuilder = Rebuilder(self.cas, self.ac, self.digester)
        self.graph = build_graph(ws)
        self._sandbox = None
        self._fetcher = None
        self._host_cache: dict[tuple[str, ...], tuple[HostTool, ...]] = {}

    # -- I/O seams, created on first use so a fully cached build needs neither -------------
    @property
    def sandbox(self):
        if self._sandbox is None:
            from build_graph.sandbox import BwrapRunner
            self._sandbox = BwrapRunner(self.cas)
        return self._sandbox

    def probe_host(self, tools: tuple[str, ...]) -> tuple[HostTool, ...]:
        if tools not in self._host_cache:
            from build_graph.sandbox import probe_host_tools
            self._host_cache[tools] = probe_host_tools(tools, self.digester)
        return self._host_cache[tools]

    def execute(self, action: Action) -> tuple[Tree, ActionResult]:
        """Run one action on the runner its kind needs."""
        if action.kind == "fetch":
            if self._fetcher is None:
                from build_graph.fetcher import Fetcher
                self._fetcher = Fetcher(self.cas)
            return self._fetcher.run(action)
        if action.kind == "extract":
            return archive.extract(self.cas, action)
        return self.sandbox.run(action)

    def _run_and_record(self, action: Action) -> tuple[Tree, ActionResult]:
        tree, result = self.execute(action)
        self.rebuilder.record(action, tree, result)
        return tree, result

    # -- the loop ------------------------------------------------------------------------
    def build(self, labels: list[Label]) -> BuildResult:
        start = time.monotonic()
        order = graph_deps(self.graph, labels)
        for label in order:  # a missing source is a load error: report it before running anything
            expand_sources(self.ws, self.ws.targets[label])
        self.reporter.start(len(order))
        outputs: dict[Label, TargetOutput] = {}
        records: list[ActionRecord] = []
        failures: list[BgraphError] = []
        failed_targets: set[Label] = set()
        dirty: set[Label] = set()  # targets that executed an action in this build
        remaining = list(order)
        plans: dict[Label, TargetPlan] = {}
        state: dict[Label, dict[str, Any]] = {}
        inflight: dict[Future, tuple[Label, int]] = {}
        scheduler = Scheduler(self.options.jobs, self.options.max_mem_mb)
        stopping = False
        # --check-sample N: re-execute N of the actions the last build recorded for these targets.
        sample = self._sample_keys(order, self.options.check_sample) if self.options.check_sample else None

        def fail(label: Label, err: BgraphError) -> None:
            nonlocal stopping
            failures.append(err)
            failed_targets.add(label)
            plans.pop(label, None)
            if not self.options.keep_going:
                stopping = True
                scheduler.cancel_pending()

        def finish_target(label: Label, plan: TargetPlan) -> None:
            outputs[label] = plan.output  # type: ignore[assignment]
            st = state.pop(label)
            self.trace.save(str(label), {"actions": st["trace_actions"], "last_build": st["records"]})
            plans.pop(label, None)
            self.reporter.target_done(label)

        def dispatch(label: Label) -> None:
            """Check the current batch; submit misses; resume the plan when all are known."""
            plan = plans[label]
            st = state[label]
            while plan.output is None:
                st["outcomes"] = [None] * len(plan.batch)
                st["waiting"] = 0
                upstream_dirty = st["batch_dirty"] or any(
                    parse_label(t, package=label.package) in dirty for _k, t in RULES[plan.target.kind].deps(plan.target.attrs))
                for i, action in enumerate(plan.batch):
                    prev = st["prev"].get(action.name)
                    decision = self.rebuilder.check(action, prev)
                    key = action.key(self.digester)
                    st["trace_actions"][action.name] = {"key": key, "description": action.description(self.digester)}
                    if isinstance(decision, Hit) and not self._check_this(key, sample):
                        status = "cutoff" if upstream_dirty else "hit"
                        rec = ActionRecord(str(label), action.name, action.mnemonic, key, status,
                                           "inputs unchanged" if status == "hit" else "upstream rebuilt to identical outputs")
                        records.append(rec)
                        st["records"].append(asdict(rec))
                        self.reporter.action_done(rec)
                        st["outcomes"][i] = Outcome(action, decision.tree, status)
                        continue
                    reason = decision.reason if isinstance(decision, Miss) else "--check: re-executing to compare outputs"
                    st.setdefault("reasons", {})[i] = (reason, decision.tree if isinstance(decision, Hit) else None)
                    self.reporter.action_started(label, action)
                    fut = scheduler.submit(lambda a=action: self._run_and_record(a), action.memory_mb)
                    inflight[fut] = (label, i)
                    st["waiting"] += 1
                if st["waiting"]:
                    return
                plan.resume(st["outcomes"])
            finish_target(label, plan)

        def start_ready() -> None:
            for label in list(remaining):
                if stopping:
                    return
                target = self.ws.targets[label]
                needed = [parse_label(t, package=label.package) for _k, t in RULES[target.kind].deps(target.attrs)]
                if any(d in failed_targets for d in needed):
                    remaining.remove(label)
                    failed_targets.add(label)
                    continue
                if not all(d in outputs for d in needed):
                    continue
                remaining.remove(label)
                try:
                    expanded = expand_sources(self.ws, target)
                    sources = Tree({p: self.cas.put_file(self.ws.root / p)
                                    for paths in expanded.values() for p in paths})
                    prev = self.trace.load(str(label)).get("actions", {})
                    state[label] = {"prev": prev, "trace_actions": {}, "records": [], "batch_dirty": False}
                    plans[label] = plan_target(self.ws, target, self.options.platform, self.digester, outputs,
                                               sources, expanded, self.cas.read_bytes, self.probe_host)
                    plans[label].start()
                    dispatch(label)
                except BgraphError as e:
                    fail(label, e)

        try:
            start_ready()
            while inflight:
                done, _ = wait(list(inflight), return_when=FIRST_COMPLETED)
                for fut in done:
                    label, i = inflight.pop(fut)
                    if label not in plans:
                        continue
                    plan, st = plans[label], state[label]
                    action = plan.batch[i]
                    reason, cached_tree = st["reasons"].pop(i)
                    key = action.key(self.digester)
                    if fut.cancelled():
                        continue
                    err = fut.exception()
                    if err is not None:
                        if not isinstance(err, BgraphError):
                            err = ActionFailed(f"{type(err).__name__}: {err}", where=action.name)
                        err.where = f"{label} {action.name}" if not err.where else f"{label}: {err.where}"
                        rec = ActionRecord(str(label), action.name, action.mnemonic, key, "failed", reason)
                        records.append(rec)
                        self.reporter.action_done(rec)
                        fail(label, err)
                        continue
                    tree, result = fut.result()
                    differs = cached_tree is not None and tree != cached_tree
                    rec = ActionRecord(str(label), action.name, action.mnemonic, key, "executed", reason,
                                       result.duration_s, differs)
                    records.append(rec)
                    st["records"].append(asdict(rec))
                    self.reporter.action_done(rec)
                    dirty.add(label)
                    st["batch_dirty"] = True
                    st["outcomes"][i] = Outcome(action, tree, "executed", reason)
                    st["waiting"] -= 1
                    if st["waiting"] == 0 and not stopping:
                        try:
                            plan.resume(st["outcomes"])
                            dispatch(label)
                        except BgraphError as e:
                            fail(label, e)
                if not stopping:
                    start_ready()
        except KeyboardInterrupt:
            scheduler.cancel_pending()
            if self._sandbox is not None:
                self._sandbox.stop()
            scheduler.join()
            raise
        finally:
            self.reporter.finish()
            self.cas.save_stamps()
        scheduler.join()
        if not failures and remaining:
            failures.append(ActionFailed("targets left unbuilt: " + ", ".join(map(str, remaining))))
        return BuildResult(records, outputs, failures, time.monotonic() - start, labels)

    def _check_this(self, key: str, sample: set[str] | None) -> bool:
        """Under --check, whether this cached action is re-executed to compare outputs."""
        if not self.options.check:
            return False
        return sample is None or key in sample

    def _sample_keys(self, order: list[Label], n: int) -> set[str]:
        """--check-sample: pick N of the actions recorded for these targets by the last build."""
        keys = sorted({a["key"] for label in order
                       for a in self.trace.load(str(label)).get("actions", {}).values()})
        return set(random.Random(0).sample(keys, min(n, len(keys))))

    def link_outputs(self, result: BuildResult, out_dir: Path) -> dict[str, Path]:
        """bgraph-out/<package>/<name> -> the materialized output of each requested target."""
        links = {}
        for label in result.requested:
            if label not in result.outputs:
                continue
            path = self.cas.materialize(result.outputs[label].tree)
            link = out_dir / label.package / label.name
            link.parent.mkdir(parents=True, exist_ok=True)
            if link.is_symlink() or link.exists():
                link.unlink()
            link.symlink_to(path)
            links[str(label)] = link
        return links
