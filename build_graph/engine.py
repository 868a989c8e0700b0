"""The engine: one workspace and cache, the stores and seams a build uses (rebuilder, sandbox,
fetcher, state file, trace), and what a build returns. The build loop itself, one build's
state from its first plan to its last result, is build_run.BuildRun."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from build_graph import archive, configs
from build_graph.configs import Configured
from build_graph.errors import ActionFailed, BgraphError, StoreError
from build_graph.graph import dependency_map
from build_graph.labels import Label
from build_graph.model import Action, ActionResult, Digester, HostTool, Tree
from build_graph.profile import Profile
from build_graph.rebuilder import Rebuilder
from build_graph.scheduler import Later
from build_graph.store.action_cache import LocalActionCache
from build_graph.store.cas import LocalCas
from build_graph.store.json_table import JsonTable
from build_graph.store.origins import BuildTrust, Origins
from build_graph.store.peaks import Peaks
from build_graph.store.state import STATE_FILE, BuildState
from build_graph.store.trace import Trace
from build_graph.store.uptodate import generation_of, moved_by_others
from build_graph.variants import Variant
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
    peak_mb: int = 0
    cpu_s: float = 0.0


@dataclass
class BuildOptions:
    jobs: int = 2
    max_mem_mb: int = 4096
    keep_going: bool = False
    check: bool = False
    check_sample: int | None = None
    dry_run: bool = False  # plan and look up the cache; run nothing
    remote: Any = None  # a workspace.RemoteSection with a url: the shared cache behind the local one
    platform: str | None = None  # --platform: every target's target platform (else its own, else exec_platform)
    exec_platform: str = field(default_factory=host_platform)  # where actions run (another: plan only)
    profile: bool = False  # collect the build's timeline (--profile)
    reuse: Any = None  # a store.memo.Reuse: targets the last build of this request left as they are
    remote_executor: Any = None  # a workspace.RemoteSection with an executor: where exec actions run (remote_exec/)
    remote_jobs: int = 0  # remote Executes in flight, beside `jobs` local actions (the scheduler has both)
    # the [remote] settings of the user config and the command line alone (no WORKSPACE.toml):
    # the origins the user vouches for in every workspace (store/origins.py)
    remote_user: Any = None


@dataclass
class BuildResult:
    records: list[ActionRecord]
    outputs: configs.Outputs  # configured target -> output (a plain Label finds its one configuration)
    failures: list[BgraphError]
    wall_s: float
    requested: list[configs.Configured]
    unplanned: list[configs.Configured] = field(default_factory=list)  # --dry-run: targets waiting on a miss
    remote: dict[str, Any] | None = None  # what the remote cache did, when one is configured
    profile: Profile | None = None  # the timeline, under --profile
    memo: dict[str, Any] = field(default_factory=dict)  # str(target) -> store.memo.Entry, for the next build
    reused: int = 0  # targets taken from the last build's memo, unplanned
    reused_hits: int = 0  # the actions of those not even visited (counted as hits; no record each)
    reused_targets: tuple[str, ...] = ()  # which targets those are (their actions are in `memo`)

    def count(self, status: str) -> int:
        return sum(1 for r in self.records if r.status == status)

    def summary(self, list_reused: bool = False) -> dict[str, Any]:
        """The build's summary; `list_reused` also lists the actions of the targets taken from
        the last build's memo, as hits (--json lists every action)."""
        counts = Counter(r.status for r in self.records)  # one pass: a dry run has 100,000 records
        actions = [dict(r.__dict__) for r in self.records]
        if list_reused:
            actions += [dict(ActionRecord(n, name, mnemonic, key, "hit", "inputs unchanged").__dict__)
                        for n in self.reused_targets for name, mnemonic, key in self.memo[n].actions]
        return {
            "ok": not self.failures,
            "executed": counts["executed"],
            "hits": counts["hit"] + self.reused_hits,
            "cut_off": counts["cutoff"],
            "failed": counts["failed"],
            "would_run": counts["would-run"],
            "differing": [f"{r.label} {r.name}" for r in self.records if r.differs],
            "wall_s": round(self.wall_s, 3),
            # CPU of the executed actions' processes, where the host lets the sandbox account it (else 0)
            "cpu_s": round(sum(r.cpu_s for r in self.records if r.status == "executed"), 3),
            "targets": [str(t) for t in self.requested],
            "actions": actions,
            "errors": [e.render() for e in self.failures],
            **({"targets_unplanned": [str(t) for t in self.unplanned]} if self.unplanned else {}),
            **({"targets_reused": self.reused} if self.reused else {}),
            **({"remote": self.remote} if self.remote is not None else {}),
            **({"profile": self.profile.summary(self.wall_s)} if self.profile is not None else {}),
        }


class Reporter(Protocol):
    def start(self, total_targets: int) -> None: ...
    def action_started(self, label: Configured, action: Action) -> None: ...
    def action_done(self, record: ActionRecord) -> None: ...
    def target_done(self, label: Configured) -> None: ...
    def finish(self) -> None: ...


class NullReporter:
    def start(self, total_targets: int) -> None: ...
    def action_started(self, label: Configured, action: Action) -> None: ...
    def action_done(self, record: ActionRecord) -> None: ...
    def target_done(self, label: Configured) -> None: ...
    def finish(self) -> None: ...


class Engine:
    def __init__(self, ws: Workspace, cache_dir: Path, options: BuildOptions | None = None,
                 reporter: Reporter | None = None, warn=None, variant: Variant | None = None):
        self.variant = variant or Variant()  # the workspace as it is, or an audit's variant of it
        self.ws = ws = self.variant.workspace(ws)
        self.options = options or BuildOptions()
        self.reporter = reporter or NullReporter()
        self.warn = warn or (lambda message: None)
        # The target whose action this thread runs (set by BuildRun._run): a warning from inside
        # the runner (a remote action run locally instead) names it, not only the action.
        self.acting = threading.local()
        self.digester = Digester(ws.digest_function)
        self.cache_dir = cache_dir
        self.cas = LocalCas(cache_dir, self.digester)
        # The cache's generation as this build found it: where another command moves it while
        # this one runs, what this build took may be gone or replaced, and it records nothing.
        self.generation_at_start = generation_of(self.cas.layout_root)
        self.ac = LocalActionCache(self.cas.base, self.cas.tmp)
        # Which results made elsewhere (a remote cache's, an executor's) this build takes: those
        # its own [remote] settings trust, whichever workspace filed them (store/origins.py).
        self.origins = Origins(BuildTrust.of(
            self.options.remote if self.options.remote is not None else self.options.remote_executor),
            BuildTrust.of(self.options.remote_user), str(ws.root), self.warn)
        self.remote = None
        if self.options.remote is not None and self.options.remote.url:
            from build_graph.store.layered import configured
            self.ac = self.remote = configured(self.ac, self.cas, self.digester, self.options.remote,
                                               warn or (lambda message: None), self.origins)
        # One state file holds the traces and a memo of results (store/state.py); a remote
        # cache that backfills sees every local hit, so with one the memo is not consulted.
        self.state = BuildState(self.cas.base / STATE_FILE)
        self.trace = (self.variant.trace(self.cas.base, self.cas.tmp) if self.variant.name
                      else Trace(self.cas.base, self.cas.tmp, self.state))
        self.peaks = Peaks(self.cas.base, self.cas.tmp)
        self.host_probes = JsonTable(self.cas.base / "host-tools.json", self.cas.tmp)
        self.rebuilder = Rebuilder(self.cas, self.ac, self.digester, None if self.remote else self.state, self.origins)
        # A cycle is an error before anything runs. A kept parse says whether it was checked, and
        # so does a memo whose graph is this build's (Reuse.graph_current).
        reuse = self.options.reuse
        if (reuse is None or not reuse.graph_current) and not ws.acyclic:
            dependency_map(ws)
        self._sandbox = None
        self._fetcher = None
        self._seams = threading.Lock()  # the first actions of a build ask for the runners at once
        self._host_cache: dict[tuple[str, ...], tuple[HostTool, ...]] = {}

    # -- I/O seams, created on first use so a fully cached build needs neither -------------
    @property
    def sandbox(self):
        with self._seams:  # one runner: stop() kills what it started, and a second would probe again
            if self._sandbox is None:
                from build_graph.sandbox import BwrapRunner
                remote = self.options.remote_executor
                if remote is None:
                    self._sandbox = BwrapRunner(self.cas, self.options.jobs)
                else:  # same surface; local runs (fallbacks, host paths) on a BwrapRunner it makes
                    from build_graph.remote_exec.client import RemoteRunner
                    self._sandbox = RemoteRunner(
                        self.cas, remote.executor, lambda: BwrapRunner(self.cas, self.options.jobs),
                        jobs=self.options.remote_jobs, local_jobs=self.options.jobs,
                        local_fallback=remote.local_fallback, queue_timeout_s=remote.queue_timeout_s,
                        skip_cache_lookup=self.options.check, accept_cached=remote.accept_cached,
                        warn=self._warn_naming_target)
            return self._sandbox

    def _warn_naming_target(self, message: str) -> None:
        label = getattr(self.acting, "label", None)
        self.warn(f"{label}: {message}" if label else message)

    def runs_remotely(self, action: Action) -> bool:
        """Whether `action` is sent to the remote executor (its memory is not this machine's)."""
        return self.options.remote_executor is not None and action.kind == "exec" and not action.host_paths

    def probe_host(self, tools: tuple[str, ...]) -> tuple[HostTool, ...]:
        if tools not in self._host_cache:
            from build_graph.sandbox import probe_host_tools
            self._host_cache[tools] = probe_host_tools(tools, self.digester, self.host_probes)
        return self._host_cache[tools]

    def moved_host_tool(self, tools: tuple[HostTool, ...]) -> str | None:
        """The first of `tools` that is no longer what the build identified (its stat stamp moved
        and its content or version with it), else None: a tool replaced while the build ran."""
        from build_graph.sandbox import SandboxError, probe_host_tools

        declared = tuple(t.path.split("=", 1)[0] for t in tools)
        try:
            now = probe_host_tools(declared, self.digester, self.host_probes)
        except SandboxError:
            now = ()
        return next((p for p, was, is_ in zip(declared, tools, now + (None,) * len(tools)) if was != is_), None)

    def host_tools_of(self, result: BuildResult) -> list[str] | None:
        """The host binaries the build's targets were planned with (probed by this build or
        taken whole from the memo), or None where one changed since it was identified: a record
        stamping its new state would answer "up to date" for outputs of the old one."""
        tools = {HostTool(*t) for out in result.outputs.values() for t in out.info.get("host_tools", ())}
        tools.update(t for probed in self._host_cache.values() for t in probed)
        if self.moved_host_tool(tuple(sorted(tools, key=lambda t: t.path))) is not None:
            return None
        return sorted({t.path.split("=", 1)[0] for t in tools})

    def execute(self, action: Action, stamps: dict[str, float] | None = None) -> tuple[Tree, ActionResult]:
        """Run one action on the runner its kind needs (a sandboxed one leaves its process's
        start and end in `stamps`)."""
        if action.kind == "fetch":
            with self._seams:
                if self._fetcher is None:
                    from build_graph.fetcher import Fetcher
                    self._fetcher = Fetcher(self.cas, self.ws.root)  # file: URLs may name its files
            return self._fetcher.run(action)
        if action.kind == "extract":
            return archive.extract(self.cas, action)
        return self.sandbox.run(action, stamps)

    def _run_and_record(self, action: Action, stamps: dict[str, float] | None = None):
        """Execute, file the result; returns it with the key it was filed under. A sandboxed
        action returns that as a scheduler.Later once its process has ended well: its outputs
        are taken into the store and its result filed off its slot, in the same order as ever
        (blobs, tree node, then the `ac/` entry and the state row), and the result is the job's
        only when all of that is done, so nothing plans on outputs not yet stored and verified."""
        if action.kind in ("fetch", "extract"):
            tree, result = self.execute(action, stamps)
            return self._file(action, tree, result, stamps)
        store = self.sandbox.run_process(action, stamps)
        # a remote executor's store says so (remote_exec/client.py); a local run's does not
        return Later(lambda: self._file(action, *store(), stamps, getattr(store, "made_by", None)))

    def _file(self, action: Action, tree: Tree, result: ActionResult, stamps: dict[str, float] | None,
              made_by: tuple[str, str] | None = None) -> tuple[Tree, ActionResult, str]:
        if stamps is not None:
            stamps["executed"] = time.monotonic()
        # The key names the host tools as probed: one replaced while the action ran made the
        # outputs of another tool, which must not be filed under that key.
        moved = self.moved_host_tool(action.host_tools) if action.host_tools else None
        if moved is not None:
            raise ActionFailed(f"host tool {moved} changed while the action ran: its result is not kept",
                               where=action.name, hint="build again: the tool is probed anew")
        return tree, result, self.rebuilder.record(action, tree, result, made_by)

    # -- the loop ------------------------------------------------------------------------
    def build(self, labels: list[Label]) -> BuildResult:
        """Build `labels` and everything they need; failures are collected, not raised."""
        from build_graph.build_run import BuildRun  # it reads this module's types

        return BuildRun(self, labels).run()

    def _check_this(self, key: str, sample: set[str] | None) -> bool:
        """Under --check, whether this cached action is re-executed to compare outputs."""
        if not self.options.check:
            return False
        return sample is None or key in sample

    def _sample_keys(self, order: list[Configured], n: int) -> set[str]:
        """--check-sample: pick N of the actions recorded for these targets by the last build."""
        keys = sorted({a["key"] for label in order
                       for a in self.trace.load(str(label)).get("actions", {}).values()})
        return set(random.Random(0).sample(keys, min(n, len(keys))))

    def compare_with(self, result: BuildResult, other_cache: Path) -> int:
        """--check-against: mark each action of this build whose result another cache holds under
        the same key with a different output tree (like `nix build --check` against a trusted
        result) as differing; returns how many actions both caches hold."""
        other = LocalActionCache(Path(other_cache) / "v1" / self.digester.name, self.cas.tmp, create=False)
        compared = 0
        for r in result.records:
            if r.status == "failed":
                continue
            theirs, ours = other.get(r.key), self.ac.get(r.key)
            if theirs is None or ours is None:
                continue
            compared += 1
            if theirs.output_tree != ours.output_tree:
                r.differs = True
        return compared

    def link_outputs(self, result: BuildResult, out_dir: Path) -> dict[str, Path]:
        """bgraph-out/<Configured.out_path()> -> the materialized output of each requested target."""
        from build_graph.store import outlinks

        linked = [label for label in result.requested if label in result.outputs]
        clash = outlinks.overlap([label.out_path() for label in linked])
        if clash is not None:
            a, b = (next(str(x) for x in linked if x.out_path() == rel) for rel in clash)
            raise StoreError(f"the output links of {a} (bgraph-out/{clash[0]}) and {b} (bgraph-out/{clash[1]}) "
                             "overlap: one would lie inside the other's output",
                             hint="build them in separate commands, or rename one of them (a target named like "
                                  "a package, or a root target named like a platform)")
        links = {}
        for label in linked:
            tree = result.outputs[label].tree
            self.cas.put_tree(tree)  # so `bgraph cache gc` can keep the blobs of a rooted tree
            path = self.cas.materialize(tree)
            # Never through a link below bgraph-out/: an older output link on the way would lead
            # into a stored output tree (outlinks.py).
            outlinks.place(out_dir, label.out_path(), str(path))
            link = out_dir / label.out_path()
            self.cas.add_root(link)
            links[str(label)] = link
        # Materializing linked blobs and moved their ctimes after the build saved its stamps:
        # without this save, the next build re-hashes every blob of a newly linked output.
        self.cas.save_stamps()
        return links

    def remember(self, recording: Any, result: BuildResult, summary: dict[str, Any], links: dict[str, Path]) -> None:
        """File what this successful build decided, for the fast paths of the next (noop.py): the
        no-op record (`recording`, a store.uptodate.Recording) and the per-target memo, one row of
        the state file; where the build cannot be recorded, the request's old row goes."""
        from build_graph.store import memo

        tools = self.host_tools_of(result)
        record = recording.of_build(self.cache_dir, summary, links, tools) if tools is not None else None
        if record is not None and moved_by_others(self.cas.layout_root, self.generation_at_start):
            # A gc, a repair or a --check that replaced a result ran beside this build (red team
            # R12): a record stamped with the new generation would keep what this build took.
            record = None
        if record is not None and not self.cas.stamped_good(record.outputs.values()):
            # An output's blob is not in the state it was last hashed good in (written through a
            # link while the build ran): what the record would stamp is not what the build made.
            record = None
        if record is not None and result.memo:
            # A source the scan leaves out (under .git/ or __pycache__/) shows no stamp: the record
            # takes it as always changed, as a racily clean file, so the next build replans what
            # reads it (the memo marks those targets volatile) instead of answering "up to date".
            unseen = {p for e in result.memo.values() for p in e.sources if p not in record.files}
            record.racy = sorted(unseen.union(record.racy))
        entries = memo.encode(result.memo, record.files) if record is not None and result.memo else None
        self.state.put_record(recording.request.digest, record and record.to_bytes(), entries,
                              recording.request.family)
