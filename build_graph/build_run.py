"""One build's loop: plan targets in dependency order, ask the rebuilder, run misses on the
scheduler, store results, record reasons in the trace, and tell the reporter. A BuildRun holds
the state of one build (engine.Engine keeps none between builds)."""

from __future__ import annotations

import errno
import os
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import Any

from build_graph import configs
from build_graph.configs import Configured
from build_graph.engine import ActionRecord, BuildResult, Engine
from build_graph.errors import ActionFailed, BgraphError, PlanError, disk_full
from build_graph.labels import Label
from build_graph.model import Action, ActionResult, Outcome, Tree
from build_graph.planner import SourceFiles, TargetPlan, plan_target
from build_graph.priority import Priorities, Timing
from build_graph.profile import Profile
from build_graph.rebuilder import Hit, Miss
from build_graph.scheduler import Later, Scheduler
from build_graph.store.memo import Entry, definition_of, encode_node
from build_graph.store.trace import trace_bytes
from build_graph.store.uptodate import bump_generation


@dataclass
class _TargetState:
    """One target's progress within one build."""

    plan: TargetPlan
    sources: tuple[str, ...]  # its sources' workspace paths (for the memo)
    load_trace: Any  # () -> the whole trace the last build left (read on a first miss only)
    recorded_digest: Any  # () -> its digest, where the state file has it (asked when it completes)
    trace_actions: dict[str, Any] = field(default_factory=dict)
    records: list[dict[str, Any]] = field(default_factory=list)
    executed_any: bool = False  # an action of this target ran: later hits here are cut off
    running: int = 0  # actions submitted and not yet finished
    # What this build saw of its actions, for the next build's priorities (priority.Timing):
    # seconds each (a hit's from its cached result), and which action's end released each
    # (absent: ready when its target was planned). Made on first use: a dry run records neither.
    seconds: dict[str, float] | None = None
    after: dict[str, str | None] | None = None

    _trace: dict[str, Any] | None = None

    def trace(self) -> dict[str, Any]:
        """The whole trace the last build left (read once, on a first miss)."""
        if self._trace is None:
            self._trace = self.load_trace()
        return self._trace

    def complete(self, slot: Any, outcome: Outcome) -> list[tuple[Any, Action, str]]:
        """Give the plan an action's outcome: the actions it made ready, each with the name of
        the action whose end released it (the `after` edge priority.Timing records)."""
        return [(s, a, outcome.action.name) for s, a in self.plan.complete(slot, outcome)]

    def timed(self, name: str, seconds: float | None, after: str | None = None) -> None:
        """Note action `name`'s seconds (None: not known yet) or what released it."""
        if seconds is not None:
            self.seconds = self.seconds or {}
            self.seconds[name] = seconds
        if after is not None:
            self.after = self.after or {}
            self.after[name] = after

    def previous(self, name: str) -> dict[str, Any] | None:
        """What the last build recorded for action `name` (to explain a miss)."""
        return self.trace().get("actions", {}).get(name)


class BuildRun:
    """The mutable state of one build; the Engine keeps none between builds."""

    def __init__(self, engine: Engine, labels: list[Label]):
        self.e = engine
        self.labels = configs.requested(engine.ws, labels, engine.options.exec_platform, engine.options.platform)
        self.outputs = configs.Outputs()
        self.memo: dict[str, Any] = {}  # str(target) -> memo.Entry, as this build leaves it
        self.reused = self.reused_hits = 0  # targets (and their actions) taken from the memo
        self.reused_targets: tuple[str, ...] = ()
        self.reuse = self._reusable(engine)
        part = self.reuse.subgraph(self.labels) if self.reuse is not None else None
        if part is not None and any(engine.cas.damaged(o.tree) for o in part[1].values()):
            part = None  # an output the memo would hand on is damaged: every target is checked in full
        if part is not None:  # only the targets an edited source reaches are visited
            self.graph, prebuilt, visited = part
            self.outputs.update(prebuilt)
            self.reused_targets = tuple(n for n in self.reuse.entries if n not in visited)
            self.memo.update((n, self.reuse.entries[n]) for n in self.reused_targets)
            self.reused = len(self.reused_targets)
            self.reused_hits = sum(len(self.reuse.entries[n].actions) for n in self.reused_targets)
        else:
            self.graph = configs.configure(engine.ws, self.labels, engine.options.platform)
        self.order = self.graph.order
        # A missing source is a load error: report it before running anything (kept for planning).
        # A target the memo knows had these same files then (no file was added or removed).
        files = self.files = SourceFiles(engine.ws.root, engine.cache_dir)
        # After a target file changed, the targets whose definitions differ from the memo's.
        self.redefined = {label for label in self.order if self.reuse is not None and self.reuse.definitions
                          and str(label) in self.reuse.entries
                          and self.reuse.entries[str(label)].definition != definition_of(engine.ws.targets[label.label])}
        self.expanded = {label: engine.variant.expand(engine.ws, engine.ws.targets[label.label], files)
                         for label in self.order
                         if self.reuse is None or str(label) not in self.reuse.entries or label in self.redefined}
        self.records: list[ActionRecord] = []
        self.failures: list[BgraphError] = []
        self.failed: set[Configured] = set()
        self.dirty: set[Configured] = set()  # targets that executed an action in this build
        self.remaining = set(self.order)  # targets not planned yet
        # Dependency counting (Kahn): a target becomes ready when its last dependency is built.
        self.deps = self.graph.deps
        self.waiting_on = {label: {d for d in ds if d not in self.outputs} for label, ds in self.deps.items()}
        self.dependents: dict[Configured, list[Configured]] = {label: [] for label in self.order}
        for label, ds in self.waiting_on.items():
            for d in ds:
                self.dependents[d].append(label)
        self.ready = deque(label for label in self.order if not self.waiting_on[label])
        self.targets: dict[Configured, _TargetState] = {}
        # future -> (label, plan slot, action, miss reason, cached tree under --check)
        self.inflight: dict[Future, tuple[Configured, Any, Action, str, Tree | None]] = {}
        # An action that is already running for another slot (the same key: two targets fetching
        # one pin, TUs sharing one dryrun) is not run twice: its slot waits on the running one.
        self.running_keys: dict[str, Future] = {}
        self.followers: dict[Future, tuple[str, list[tuple[Configured, Any, Action]]]] = {}  # its key, who waits
        self.scheduler = Scheduler(engine.options.jobs + engine.options.remote_jobs, engine.options.max_mem_mb,
                                   stop_on_failure=not engine.options.keep_going)
        self.stopping = False
        # Longest expected path first (priority.py); BGRAPH_SCHEDULE=fifo starts actions in the
        # order they are planned, as before issue 36 (for benchmarks: it changes only the order).
        self.fifo = os.environ.get("BGRAPH_SCHEDULE") == "fifo"
        self.priorities: Priorities | None = None  # made at the first submission (a dry run makes none)
        self.profile = Profile(engine.options.jobs) if engine.options.profile else None
        # --check-sample N: re-execute N of the actions the last build recorded for these targets.
        n = engine.options.check_sample
        self.sample = engine._sample_keys(self.order, n) if n else None

    def _timing(self, label: Configured) -> Timing:
        """What the last build recorded of `label`'s actions (its trace, read once per build)."""
        state = self.targets.get(label)
        return Timing.from_trace(state.trace() if state is not None else self.e.trace.load(str(label)))

    def _priority(self, label: Configured, name: str) -> float:
        """Action `name` of `label`'s place in the queue: its expected time to the build's end."""
        if self.fifo:
            return 0.0
        if self.priorities is None:
            self.priorities = Priorities(lambda t: self.dependents.get(t, ()), self._timing)
        try:
            return self.priorities.of(label, name)
        except Exception:  # an unreadable record (a state file another bgraph damaged) only costs the order
            return 0.0

    @staticmethod
    def _reusable(e: Engine):
        """The memo this build may take targets from (store/memo.py), its action keys held first
        so that no collection removes what a reused target's dependents will read."""
        reuse, o = e.options.reuse, e.options
        if reuse is None or e.variant.name or o.dry_run or o.check or e.remote is not None:
            return None
        e.cas.holds.hold_many("key", reuse.keys())
        return reuse if reuse.still_valid() else None

    def run(self) -> BuildResult:
        start = time.monotonic()
        self.e.reporter.start(len(self.order))
        try:
            self._start_ready()
            while self.inflight:
                done, _ = wait(list(self.inflight), return_when=FIRST_COMPLETED)
                for fut in done:
                    taken, (label, _slot, action, *_rest) = time.monotonic(), self.inflight[fut]
                    self._finished(fut)
                    self.e.state.maybe_flush()
                    if self.profile is not None:
                        self.profile.plan(f"take back {label} {action.name}", taken)
                if not self.stopping:
                    self._start_ready()
        except KeyboardInterrupt:
            self.scheduler.cancel_pending()
            if self.e._sandbox is not None:
                self.e._sandbox.stop()
            if self.e._fetcher is not None:  # a download blocked in a read would hold join() up
                self.e._fetcher.stop()
            self.scheduler.join()
            raise
        finally:
            self.scheduler.close()  # its filers end once nothing is left for them
            if self.e._sandbox is not None:
                self.e._sandbox.close()
            self.e.reporter.finish()
            self.e.cas.save_stamps()
            self.e.state.flush()
            self.e.peaks.save()
            self.e.host_probes.save()
        self.scheduler.join()
        if not self.failures and self.remaining and not self.e.options.dry_run:
            left = [t for t in self.order if t in self.remaining]
            self.failures.append(ActionFailed("targets left unbuilt: " + ", ".join(map(str, left))))
        unplanned = [t for t in self.order if t not in self.outputs] if self.e.options.dry_run else []
        return BuildResult(self.records, self.outputs, self.failures, time.monotonic() - start, self.labels,
                           unplanned, self.e.remote.stats.to_json() if self.e.remote else None, self.profile,
                           self.memo, self.reused, self.reused_hits, self.reused_targets)

    def _record(self, state: _TargetState | None, rec: ActionRecord) -> None:
        self.records.append(rec)
        if state is not None and rec.status != "failed":
            state.records.append(dict(rec.__dict__))
        self.e.reporter.action_done(rec)

    def _fail(self, label: Configured, err: BgraphError) -> None:
        self.failures.append(err)
        self._mark_failed(label)
        if not self.e.options.keep_going:
            self.stopping = True
            self.scheduler.cancel_pending()

    def _mark_failed(self, label: Configured) -> None:
        """`label` failed: so does everything that needs it (they never become ready)."""
        stack = [label]
        while stack:
            t = stack.pop()
            if t in self.failed:
                continue
            self.failed.add(t)
            self.remaining.discard(t)
            self.targets.pop(t, None)
            stack.extend(self.dependents.get(t, ()))

    def _built(self, label: Configured) -> None:
        for t in self.dependents[label]:
            self.waiting_on[t].discard(label)
            if not self.waiting_on[t] and t in self.remaining:
                self.ready.append(t)

    def _start_ready(self) -> None:
        """Plan every target whose dependencies are built."""
        if self.ready and not self.fifo and not self.e.options.dry_run:  # a dry run submits nothing
            with self.scheduler.hold():  # the wave's most urgent action takes the first free slot
                self._plan_ready()
        else:
            self._plan_ready()

    def _plan_ready(self) -> None:
        e = self.e
        while self.ready and not self.stopping:
            label = self.ready.popleft()
            if label not in self.remaining:
                continue  # failed meanwhile
            self.remaining.discard(label)
            if self.reuse is not None and self._reused(label):
                continue
            target = e.ws.targets[label.label]
            planned = time.monotonic()
            try:
                expanded = (self.expanded.pop(label) if label in self.expanded
                            else e.variant.expand(e.ws, target, self.files))
                sources = e.variant.store(e.cas, e.ws.root, expanded, hash_only=e.options.dry_run)
                plan = plan_target(e.ws, target, label.config, e.digester, self.graph.inputs(label, self.outputs),
                                   sources, expanded, e.cas.read_bytes, e.probe_host)
                self.targets[label] = _TargetState(plan, tuple(p for ps in expanded.values() for p in ps),
                                                   lambda name=str(label): e.trace.load(name),
                                                   lambda name=str(label): e.trace.digest(name))
                self._dispatch(label, [(slot, action, None) for slot, action in plan.start()])
            except Exception as err:  # a rule's bug or an unreadable source: one line, never a traceback
                self._fail(label, self._as_error(label, err))
            if self.profile is not None:
                self.profile.plan(f"plan {label}", planned)

    def _reused(self, label: Configured) -> bool:
        """Take `label` as the last build left it, if none of its sources changed and each
        dependency's output is the one it was built from (store/memo.py)."""
        if any(d in self.dirty for d in self.deps[label]):
            return False  # a dependency ran again: the rebuilder decides (a cutoff, with its trace)
        name = str(label)
        entry = self.reuse.taken(name, label in self.redefined, {str(d): self.outputs[d] for d in self.deps[label]},
                                 self.e.cas.damaged)
        if entry is None:
            return False
        self.outputs[label] = entry.output
        self.memo[name] = entry
        self.reused += 1
        for action, mnemonic, key in entry.actions:
            self._record(None, ActionRecord(name, action, mnemonic, key, "hit", "no input changed since the last build"))
        self._built(label)
        self.e.reporter.target_done(label)
        return True

    def _dispatch(self, label: Configured, ready: list) -> None:
        """Check each ready (slot, action, the name of the action whose end released it): a hit
        completes its slot at once (possibly readying more), a miss goes to the scheduler. The
        target is done when its plan returns."""
        e, state = self.e, self.targets[label]
        # Only _finished changes these, so a hit in this call is cut off or not for all of them.
        upstream_dirty = state.executed_any or any(d in self.dirty for d in self.deps[label])
        while ready:
            slot, action, after = ready.pop(0)
            state.timed(action.name, None, after)  # no `after`: ready when planned (the default)
            decision = e.rebuilder.check(action, lambda name=action.name: state.previous(name))
            key, description = action.traced(e.digester)
            state.trace_actions[action.name] = {"key": key, "description": description}
            checked = e._check_this(key, self.sample)  # --check samples by the traced key
            if isinstance(decision, Hit) and decision.key:
                key = decision.key  # filed under its narrowed key
            if isinstance(decision, Hit) and not checked:
                status = "cutoff" if upstream_dirty else "hit"
                why = decision.why or ("inputs unchanged" if status == "hit" else "upstream rebuilt to identical outputs")
                self._record(state, ActionRecord(str(label), action.name, action.mnemonic, key, status, why))
                state.timed(action.name, decision.result.duration_s)
                ready += state.complete(slot, Outcome(action, decision.tree, status))
                continue
            if isinstance(decision, Miss):
                reason, cached = decision.reason, None
            else:
                reason, cached = "--check: re-executing to compare outputs", decision.tree
            if e.options.dry_run:  # this target (and what needs it) can plan no further
                self._record(state, ActionRecord(str(label), action.name, action.mnemonic, key, "would-run", reason))
                continue
            narrowed = action.discovery is not None and action.discovery.mounts
            same = action.key(e.digester) if cached is None and action.cacheable and not narrowed else None
            if same is not None and same in self.running_keys:
                self.followers[self.running_keys[same]][1].append((label, slot, action))
                state.running += 1
                continue
            e.reporter.action_started(label, action)
            budget = 0 if e.runs_remotely(action) else e.peaks.budget(f"{label} {action.name}", action.memory_mb)
            fut = self.scheduler.submit(lambda a=action, r=reason, t=time.monotonic(): self._run(label, a, r, t), budget,
                                        self._priority(label, action.name))
            self.inflight[fut] = (label, slot, action, reason, cached)
            if same is not None:
                self.running_keys[same], self.followers[fut] = fut, (same, [])
            state.running += 1
        if e.options.dry_run and state.plan.output is None and not state.running:
            del self.targets[label]  # it waits on actions that will not run: its plan can go (100,000 of them)
            return
        if state.plan.output is not None and not state.running:
            self.outputs[label] = state.plan.output
            self.memo[str(label)] = Entry(state.sources, state.plan.output,
                                          tuple((r["name"], r["mnemonic"], r["key"]) for r in state.records),
                                          tuple(map(str, self.deps[label])),
                                          encode_node(label, self.graph.dep_labels[label]),
                                          definition=definition_of(e.ws.targets[label.label]))
            self._built(label)
            # Which workspace's build this is: the cache (and its traces) may be shared (provenance.py).
            trace = {"actions": state.trace_actions, "last_build": state.records, "workspace": str(e.ws.root),
                     "timing": Timing(state.seconds or {}, state.after or {}).to_json()}
            encoded = trace_bytes(trace)
            if encoded[0] != state.recorded_digest():  # a no-op build rewrites no trace
                e.trace.save(str(label), trace, encoded)
            del self.targets[label]
            e.reporter.target_done(label)

    def _run(self, label: Configured, action: Action, reason: str, submitted: float):
        """On an action thread: execute and file `action` (filed off its slot, as a Later, when
        it ran in the sandbox), timed under --profile."""
        self.e.acting.label = str(label)  # each action has a thread of its own (scheduler.py)
        if self.profile is None:
            return self.e._run_and_record(action)
        start, stamps = time.monotonic(), {}
        out = self.e._run_and_record(action, stamps)

        def timed(out: tuple[Tree, ActionResult, str]) -> tuple[Tree, ActionResult, str]:
            self.profile.action(f"{label} {action.name}", start, stamps, time.monotonic(),
                                mnemonic=action.mnemonic, reason=reason, queued_s=round(start - submitted, 3),
                                peak_mb=out[1].peak_mb, cpu_s=out[1].cpu_s)
            return out
        return Later(lambda: timed(out.fn())) if isinstance(out, Later) else timed(out)

    def _finished(self, fut: Future) -> None:
        """Take one finished (or failed, or cancelled) action back into its target's plan."""
        label, slot, action, reason, cached_tree = self.inflight.pop(fut)
        if fut in self.followers:
            same, waiting = self.followers.pop(fut)
            del self.running_keys[same]
            self._take_followers(fut, waiting, label, action)
        state = self.targets.get(label)
        if state is None or fut.cancelled():
            return
        state.running -= 1
        key = action.traced(self.e.digester)[0]
        err = fut.exception()
        if err is not None:
            if isinstance(err, OSError) and err.errno == errno.ENOSPC:
                err = disk_full(self.e.cache_dir)
            elif not isinstance(err, BgraphError):
                err = ActionFailed(f"{type(err).__name__}: {err}", where=action.name)
            err.where = f"{label} {action.name}" if not err.where else f"{label}: {err.where}"
            self._record(None, ActionRecord(str(label), action.name, action.mnemonic, key, "failed", reason))
            self._fail(label, err)
            return
        tree, result, key = fut.result()
        differs = cached_tree is not None and tree != cached_tree
        if differs:
            # --check filed another result under a key the cache held: a no-op record or memo of
            # any request may have taken the old one, and none of them may hold now (R9).
            bump_generation(self.e.cas.layout_root)
        self._record(state, ActionRecord(str(label), action.name, action.mnemonic, key, "executed", reason,
                                         result.duration_s, differs, result.peak_mb, result.cpu_s))
        self.e.peaks.record(f"{label} {action.name}", result.peak_mb)
        state.timed(action.name, result.duration_s)
        self.dirty.add(label)
        state.executed_any = True
        if self.stopping:
            return
        try:
            self._dispatch(label, state.complete(slot, Outcome(action, tree, "executed", reason)))
        except Exception as err:
            self._fail(label, self._as_error(label, err))

    def _take_followers(self, fut: Future, waiting: list[tuple[Configured, Any, Action]], leader: Configured,
                        leader_action: Action) -> None:
        """The slots that waited on `fut`'s action: each gets its outputs as a hit, or fails with it."""
        for label, slot, action in waiting:
            state = self.targets.get(label)
            if state is None:
                continue
            state.running -= 1
            if fut.cancelled() or self.stopping:
                continue
            key = action.traced(self.e.digester)[0]
            err = fut.exception()
            if err is not None:
                self._record(None, ActionRecord(str(label), action.name, action.mnemonic, key, "failed",
                                                f"the same action failed for {leader}"))
                self._fail(label, ActionFailed(f"the same action failed for {leader} {leader_action.name}",
                                               where=f"{label} {action.name}"))
                continue
            tree, result, _key = fut.result()
            state.timed(action.name, result.duration_s)
            self._record(state, ActionRecord(str(label), action.name, action.mnemonic, key, "hit",
                                             f"ran once in this build, for {leader} {leader_action.name}"))
            try:
                self._dispatch(label, state.complete(slot, Outcome(action, tree, "hit")))
            except Exception as err:
                self._fail(label, self._as_error(label, err))

    def _as_error(self, label: Configured, err: Exception) -> BgraphError:
        """Any exception from planning as the one-line error the user sees: a full disk names
        the cache, an unreadable file names the file, anything else names the target and rule."""
        if isinstance(err, BgraphError):
            return err
        if isinstance(err, OSError) and err.errno == errno.ENOSPC:
            return disk_full(self.e.cache_dir)
        kind = self.e.ws.targets[label.label].kind
        if isinstance(err, OSError):
            return PlanError(f"cannot read {err.filename or 'a file'}: {err.strerror or err}", where=str(label),
                             hint="check that the file is readable (a source, a lock, a patch)")
        return PlanError(f"the {kind} rule failed: {type(err).__name__}: {err}", where=str(label),
                         hint="this is a bug in bgraph's rule (not in your targets); please report it "
                              "with this line")
