#!/usr/bin/env python3
"""Benchmark: cold builds of many tiny actions (issue 34), bgraph beside tools with no sandbox.

Parts (--parts, comma-separated; all by default):

  genrule  N one-line genrules (`cat` one source file into the output, then `echo` onto it) over a
           `host_tools` shell (the host's /usr, as tests/bgraph_testlib.py's workspaces use), built cold (an
           empty cache, a fresh workspace) with `bgraph build -j J //many:all`, beside the very same
           shell commands under plain `make -j J` and `ninja -j J` (no sandbox). Builders are
           interleaved within each repeat, their order rotated per repeat. Then, per repeat, one
           more cold bgraph build with `--profile` (Chrome trace) for per-action timings.
           bgraph's own wall per action = (bgraph wall - make wall) / N.
  floor    bubblewrap alone, 100 times each: `bwrap --unshare-all --ro-bind / / -- /bin/true`, the
           same without a network namespace, and bgraph's whole option set for a genrule (no
           capability, no nested user namespace, read-only /proc, tmpfs /tmp, /usr bound, merged-/usr
           links), and that set less one of --unshare-net, --dev, --proc/--remount-ro, --disable-userns;
           beside a plain fork/exec of /bin/true and of the genrule's own `sh -c` command.
  cprofile one more cold genrule build run under cProfile, one profiler per thread (the planning
           thread, each action thread, the spares thread): the cumulative time of the functions that
           make up issue 34's parts (planning and keys, input staging and mounts, bwrap and cgroup
           start, waiting, output hashing and CAS, trace/state writes, progress).
  pyspy    the same build sampled by py-spy (where installed and allowed to attach), twice: `--idle`
           (every thread, running or waiting) and `--gil` (only the thread holding the interpreter
           lock), its stacks put into the same parts: the low-overhead cross-check.
  gil      the cold genrule build with Python's GIL switch interval at 5 ms (the default) and at
           0.5 ms (sys.setswitchinterval in a wrapper; bgraph unchanged), alternated: how much of the
           action threads' time is waiting for the interpreter while the planning thread computes.
  strace   system calls and processes per action, counted (not timed) by `strace -f -ff` over the
           whole process tree: cold genrule builds of --strace-n and twice as many genrules under
           bgraph and under make, the difference per added action, split by the program each process
           ran (bgraph's Python, the spare's sh, bwrap, the action's sh and cat). Counts do not depend
           on load.
  cuda     a `cuda_library` of --tus tiny .cu TUs for two archs (12.0a, 12.1a), cold, beside plain
           nvcc under `make -j J` and `sccache nvcc` under `make -j J` (a fresh sccache cache and
           server). Every builder uses bgraph's `//toolchains:cuda-13.0` nvcc (plain and sccache with
           the host's gcc; bgraph with its pinned host-cc). The toolchain (and cuobjdump) are built
           into --toolchain-cache, once, untimed, and reused between runs; each cold bgraph build
           starts from a copy of it, stamped by an untimed build of the toolchain targets, so no
           toolchain time is in the measurement. Cubins of every builder are compared with plain's.
           Each build (and sccache's server) runs in a cgroup of its own (bench/cpu_group.py): its CPU
           is exact, the sandboxes' included, whatever else the machine runs; bgraph's own CPU is
           that less its actions' (each sandbox's cgroup, from --json).

Wall times on a shared machine measure the queue for the cores as much as the builds: compare the
builders of one run as ratios, never figures across runs. Each build's own CPU (machine busy time
minus the other processes' sampled CPU, arch_cache.Meter) is given beside it.

bgraph runs from a `git archive` snapshot of --bgraph-rev (default HEAD), so edits to the checkout
during a run cannot mix versions; `--bgraph-rev worktree` runs the checkout's build_graph/.

Before/after: `--base-rev REV` runs a second commit as builder "bgraph-base" beside the others in every
genrule and cuda repeat (interleaved, the order rotated), and reports each one's own wall and CPU per
action and their ratio within each repeat; `--no-profile` skips the --profile builds. `--bgraph-rev dir:PATH` runs
bgraph from a tree prepared elsewhere.

Usage: python3 bench/small_actions.py [--parts genrule,floor,cprofile,pyspy,gil,strace,cuda] [--n 300]
                                      [--tus 24] [--repeat 3] [--cuda-repeat 2] [--gil-repeat 2] [--strace-n 100]
                                      [--jobs 2] [--bgraph-rev REV] [--base-rev REV] [--no-profile]
                                      [--toolchain-cache DIR] [--json-out FILE] [--keep-traces DIR] [--keep]

The figures and the command of the recorded run: BENCHMARKS.md, "Small actions (issue 34)".
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from arch_cache import (Meter, SccacheBuilder, age, clean_env, compare, cubins, defer_deletions,  # noqa: E402
                        empty_trash, free_port, gencode, real_tool, rmtree, tool_version)
from cpu_group import CpuGroup  # noqa: E402

PARTS = ["genrule", "floor", "cprofile", "pyspy", "gil", "strace", "cuda"]
ARCHS = ["12.0a", "12.1a"]
COPTS = ["-std=c++17", "-O2"]
TOOLCHAIN_TARGETS = ["//toolchains:cuda-13.0", "//toolchains:host-cc"]
DEFAULT_TOOLCHAIN_CACHE = Path.home() / ".cache" / "bgraph-bench" / "small-actions-toolchain"

# ---------------------------------------------------------------------------------------------
# the genrule workload: the same command per action for bgraph, make and ninja


def genrule_cmd(i: int, src: str, out: str) -> str:
    # cat, not cp: cp keeps the source's mode, and an action's inputs are read-only blobs (0444)
    # that root without CAP_DAC_OVERRIDE (the capability-free sandbox) cannot append to.
    return f"cat {src}/f{i}.txt > {out}/o{i}.txt && echo {i} >> {out}/o{i}.txt"


def write_genrule_workspace(root: Path, n: int) -> None:
    """A bgraph workspace (WORKSPACE.toml, a host_tools shell, N genrules), a Makefile and a
    build.ninja over the same N sources, running the same shell command per output."""
    (root / "targets").mkdir(parents=True)
    (root / "src").mkdir()
    (root / "WORKSPACE.toml").write_text('[workspace]\nname = "small-actions"\ndigest_function = "blake3"\n')
    (root / "targets" / "toolchains.toml").write_text(
        'package = "//toolchains"\n\n[host]\nkind = "host_tools"\npaths = ["/usr"]\n'
        'tools = ["/usr/bin/sh", "/usr/bin/cat"]\n')
    rules, make, ninja = [], ["all:"], ["rule sh\n  command = $cmd\n"]
    for i in range(n):
        (root / "src" / f"f{i}.txt").write_text(f"{i}\n")
        rules.append(f'[g{i}]\nkind = "genrule"\nsrcs = ["src/f{i}.txt"]\nouts = ["o{i}.txt"]\n'
                     f'cmd = "{genrule_cmd(i, "$SRC/src", "$OUT")}"\n')
        make[0] += f" out/o{i}.txt"
        make.append(f"out/o{i}.txt: src/f{i}.txt\n\t{genrule_cmd(i, 'src', 'out')}")
        ninja.append(f"build out/o{i}.txt: sh src/f{i}.txt\n  cmd = {genrule_cmd(i, 'src', 'out')}\n")
    (root / "targets" / "many.toml").write_text("\n".join(rules))
    (root / "Makefile").write_text("\n".join(make) + "\n")
    (root / "build.ninja").write_text("".join(ninja))


def timed(argv: list[str], cwd: Path, env: dict[str, str], out: Path | None = None,
          group: CpuGroup | None = None) -> dict:
    """Run one build: wall seconds, own CPU (Meter: the machine's busy time less the other
    processes' sampled CPU), the CPU of its own process tree (the rusage of the build and every
    process it waited for, exact but blind to kernel threads working for it and to what
    bubblewrap's PID namespaces reap), and its exit status checked. With `group` (a CpuGroup it
    runs in, possibly holding a server started earlier), `group_cpu` is everything charged to the
    group: exact, sandboxes included, and blind to the other sessions' load."""
    import resource
    os.sync()  # the setup's dirty pages written back now, not during the timed build
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start_cpu = group.cpu_s() if group is not None else 0.0
    with open(out or os.devnull, "wb") as sink, Meter() as m:
        proc = subprocess.run(group.wrap(argv) if group is not None else argv, cwd=cwd, env=env, stdout=sink,
                              stderr=subprocess.STDOUT)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        tail = out.read_bytes()[-3000:].decode(errors="replace") if out else ""
        raise RuntimeError(f"failed ({proc.returncode}): {' '.join(argv)}\n{tail}")
    tree = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    r = {"wall": m.wall, "own_cpu": m.own, "foreign_cpu": m.foreign, "tree_cpu": tree,
         "tree_sys": after.ru_stime - before.ru_stime}
    if group is not None:
        r["group_cpu"] = group.cpu_s() - start_cpu
    return r


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def med(xs):
    return statistics.median(xs) if xs else float("nan")


# ---------------------------------------------------------------------------------------------
# the --profile trace, per action


def profile_per_action(trace_path: Path) -> dict:
    """Per executed action (ms): its lane time and phases, from `bgraph build --profile`."""
    events = json.loads(trace_path.read_text())["traceEvents"]
    spans = [e for e in events if e.get("ph") == "X"]
    actions = sorted((e for e in spans if e["cat"] == "action"), key=lambda e: e["ts"])
    phases = defaultdict(list)  # phase name -> durations, in the order of `actions` per lane
    by_lane_ts: dict[tuple[int, int], dict] = {}
    for a in actions:
        by_lane_ts[(a["tid"], a["ts"])] = {"total": a["dur"] / 1e3,
                                           "queued": a.get("args", {}).get("queued_s", 0) * 1e3}
    for e in spans:
        if e["cat"] in ("sandbox", "process", "store"):
            # a phase lies inside its action: find the action of its lane that holds it
            for a in actions:
                if a["tid"] == e["tid"] and a["ts"] <= e["ts"] <= a["ts"] + a["dur"]:
                    by_lane_ts[(a["tid"], a["ts"])][e["name"]] = e["dur"] / 1e3
                    break
    plan = [e for e in spans if e["cat"] == "plan"]
    busy = sorted((e["ts"], e["ts"] + e["dur"]) for e in plan)
    for a in actions:  # how much of the action's time the planning thread was busy (GIL contention)
        lo, hi, inside = a["ts"], a["ts"] + a["dur"], 0
        for b0, b1 in busy:
            if b1 > lo and b0 < hi:
                inside += min(b1, hi) - max(b0, lo)
        by_lane_ts[(a["tid"], a["ts"])]["planning_overlap"] = inside / max(a["dur"], 1)
    rows = list(by_lane_ts.values())
    split = {}
    for name, keep in (("planning thread busy > 50% of the action", lambda r: r["planning_overlap"] > 0.5),
                       ("planning thread busy < 5% of the action", lambda r: r["planning_overlap"] < 0.05)):
        sel = [r for r in rows if keep(r)]
        split[name] = {"actions": len(sel), **{k: round(med([r[k] for r in sel if k in r]), 2)
                                                for k in ("total", "set up sandbox", "process",
                                                          "take outputs into the store", "file result")}}
    for r in rows:
        r.pop("planning_overlap")
    for r in rows:
        for k, v in r.items():
            phases[k].append(v)
    first = min((a["ts"] for a in actions), default=0)
    last = max((a["ts"] + a["dur"] for a in actions), default=0)
    return {"rows": rows, "n": len(rows), "by_planning_overlap_median_ms": split,
            "phase_median_ms": {k: round(med(v), 3) for k, v in phases.items()},
            "phase_p90_ms": {k: round(pct(v, 0.9), 3) for k, v in phases.items()},
            "phase_sum_s": {k: round(sum(v) / 1e3, 3) for k, v in phases.items()},
            "planning_thread_s": round(sum(e["dur"] for e in plan) / 1e6, 3),
            "planning_spans": {k: round(sum(e["dur"] for e in plan if e["name"].startswith(k)) / 1e6, 3)
                               for k in ("plan ", "take back ")},
            "actions_window_s": round((last - first) / 1e6, 3),
            "lanes": max((a["tid"] for a in actions), default=0)}


# ---------------------------------------------------------------------------------------------
# attribution of profiler time to the parts issue 34 names

# py-spy: (part, patterns of a frame's "Qualname (file:line)" text), in priority order: a sampled
# stack belongs to the first part one of whose patterns any of its frames holds (so inner parts
# come first: materialize is called from inside the sandbox's start, which is inside run).
PROCESS = "process running (the action thread in waitpid: bwrap + sh + cat)"
PYSPY_PARTS = [
    ("finish: bgraph-out links (output trees materialized)", ["Engine.link_outputs ("]),
    ("input staging: materialize and mounts", ["LocalCas.materialize (", "_stage (build_graph/sandbox",
                                               "coalesced_mounts ("]),
    ("bwrap and cgroup start (bwrap args, spare or fork/exec)", ["BwrapRunner._start (", "(build_graph/spares.py",
                                                                "(build_graph/cgroups.py", "nesting_options (",
                                                                "BwrapRunner.__init__ ("]),
    ("planning: sources hashed and stored (variants.store)", ["(build_graph/variants.py"]),
    ("output hashing and CAS insertion", ["LocalCas.ingest_dir (", "LocalCas.put_tree (", "LocalCas.put_bytes (",
                                          "_symlinked_parent ("]),
    ("trace/state writes (action cache, state rows, traces, stamps)",
     ["Rebuilder.record (", "(build_graph/store/state.py", "(build_graph/store/trace.py",
      "(build_graph/store/action_cache.py", "save_stamps (", "(build_graph/store/peaks.py"]),
    ("sandbox work dir and teardown", ["rmtree (", "mkdtemp ("]),
    ("progress/reporting", ["(build_graph/report.py", "rich/"]),
    ("scheduler: a new thread per action", ["Scheduler.submit (", "Scheduler._launch (", "Thread.start (",
                                            "Event.set (threading"]),
    ("action thread, rest of the sandbox run (output checks, stdout/stderr read, cgroup figures)",
     ["BwrapRunner.run (", "Engine._run_and_record ("]),
    ("waiting (idle: futures, conditions)", ["wait (concurrent", "Condition.wait (", "Event.wait (",
                                             "Thread.join ("]),
    ("planning and key computation", ["plan_target (", "(build_graph/variants.py", "Rebuilder.check (",
                                      "(build_graph/model.py", "BuildRun._dispatch (", "BuildRun._start_ready (",
                                      "(build_graph/rules/", "(build_graph/planner.py", "BuildRun._finished (",
                                      "BuildRun.run ("]),
    ("start-up and finish: imports, load, configure, link outputs, no-op record",
     ["_find_and_load", "<module>", "(build_graph/workspace.py", "(build_graph/configs.py",
      "(build_graph/graph.py", "Engine.link_outputs (", "(build_graph/noop.py", "(build_graph/store/uptodate.py",
      "(build_graph/store/parsed.py", "(build_graph/store/memo.py", "Engine.__init__ (", "(build_graph/cli.py"]),
]


WAITS = ("wait (concurrent", "Condition.wait (", "Event.wait (", "Thread.join (")


def part_of_stack(frames: list[str], waitpid_leaf: str) -> str:
    if frames and frames[-1].startswith(waitpid_leaf):
        return PROCESS
    if frames and frames[-1].startswith(WAITS) and not any("Scheduler." in f for f in frames):
        return "waiting (idle: futures, conditions)"
    for part, pats in PYSPY_PARTS:
        if any(p in f for f in frames for p in pats):
            return part
    return "other"


def pyspy_parts(raw: Path, rate: int, waitpid_leaf: str) -> dict:
    """py-spy's raw (collapsed) output, per thread class and part, in seconds."""
    out: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        thread, *body = stack.split(";")
        text = ";".join(body)
        if not body or not body[0].startswith("Thread._bootstrap"):
            cls = "planning thread (main)"
        elif "Scheduler._work (" in text or "Scheduler._filer (" in text:  # action threads and filers
            cls = "action threads"
        elif "_Starter._run (" in text:
            cls = "spares thread"
        elif "bgraph-progress" in thread or "(build_graph/report.py" in text or "rich/" in text:
            cls = "progress thread"
        elif "PeakSampler" in text:
            cls = "memory sampler threads"
        else:
            cls = "other threads"
        out[cls][part_of_stack(body, waitpid_leaf)] += int(count) / rate
    return {k: dict(sorted(((p, round(v, 3)) for p, v in d.items()), key=lambda kv: -kv[1])) for k, d in out.items()}


# cProfile (wall-clock timer, one profiler per thread): the cumulative time of named functions,
# (function name, file suffix) -> row; indented rows lie inside the row above them.
CPROFILE_ROWS = {
    "actions": [
        ("action threads in all (Scheduler._work)", [("_work", "scheduler.py")]),
        (" BwrapRunner.run", [("run", "sandbox.py")]),
        ("  _stage (staged inputs)", [("_stage", "sandbox.py")]),
        ("  _start (bwrap args, spare or Popen)", [("_start", "sandbox.py")]),
        ("   command() (materialize inside)", [("command", "sandbox.py")]),
        ("    LocalCas.materialize", [("materialize", "cas.py")]),
        ("   Spares.take + Spare.launch", [("take", "spares.py"), ("launch", "spares.py")]),
        ("   subprocess.Popen (direct start)", [("__init__", "subprocess.py")]),
        ("  os.waitpid (the sandboxed process)", [("<built-in method posix.waitpid>", "~")]),
        ("  cgroup figures (cpu_s, peak_mb)", [("cpu_s", "cgroups.py"), ("peak_mb", "cgroups.py")]),
        ("  LocalCas.ingest_dir (outputs hashed, moved in)", [("ingest_dir", "cas.py")]),
        ("  LocalCas.put_tree", [("put_tree", "cas.py")]),
        ("  LocalCas.put_bytes (stdout, stderr)", [("put_bytes", "cas.py")]),
        ("  tempfile.mkdtemp", [("mkdtemp", "tempfile.py")]),
        ("  rmtree (work dir)", [("rmtree", "cas.py")]),
        (" Rebuilder.record (action cache entry, state row)", [("record", "rebuilder.py")]),
        ("  LocalActionCache.put", [("put", "action_cache.py")]),
        ("  BuildState.put_result", [("put_result", "state.py")]),
    ],
    "main": [
        ("cmd_build", [("cmd_build", "cli.py")]),
        (" imports (outermost)", [("_find_and_load", "<frozen importlib._bootstrap>")]),
        (" workspace load", [("_workspace", "cli.py")]),
        (" Engine.__init__", [("__init__", "engine.py")]),
        (" BuildRun.run", [("run", "build_run.py")]),
        ("  _start_ready (targets planned)", [("_start_ready", "build_run.py")]),
        ("   variants.store (sources into the CAS)", [("store", "variants.py")]),
        ("   plan_target", [("plan_target", "planner.py")]),
        ("   _dispatch (check, trace, submit)", [("_dispatch", "build_run.py")]),
        ("    Rebuilder.check", [("check", "rebuilder.py")]),
        ("    Action.traced + Action.key", [("traced", "model.py"), ("key", "model.py")]),
        ("    Trace.save", [("save", "trace.py")]),
        ("    Scheduler.submit (a thread per action)", [("submit", "scheduler.py")]),
        ("  _finished (results taken back)", [("_finished", "build_run.py")]),
        ("  concurrent.futures.wait (idle)", [("wait", "_base.py")]),
        ("  BuildState.maybe_flush + flush", [("maybe_flush", "state.py"), ("flush", "state.py")]),
        ("  reporter (RichReporter)", [("action_started", "report.py"), ("action_done", "report.py"),
                                       ("target_done", "report.py"), ("start", "report.py"),
                                       ("finish", "report.py")]),
        ("  LocalCas.save_stamps", [("save_stamps", "cas.py")]),
        (" Engine.link_outputs", [("link_outputs", "engine.py")]),
        (" no-op record (Recording.finish)", [("finish", "noop.py")]),
    ],
    "other": [
        ("spare starter: Spares._start", [("_start", "spares.py")]),
        ("spare starter: cgroup removal", [("remove", "cgroups.py")]),
    ],
}


def cprofile_parts(stats_file: Path, rows_for: str) -> dict:
    import pstats
    st = pstats.Stats(str(stats_file))
    out = {}
    for title, fns in CPROFILE_ROWS[rows_for]:
        calls, cum = 0, 0.0
        for (file, _line, fn), (_cc, nc, _tt, ct, _callers) in st.stats.items():
            if any(fn == name and file.endswith(suffix) for name, suffix in fns):
                calls, cum = calls + nc, cum + ct
        out[title] = {"calls": calls, "cum_s": round(cum, 3)}
    return out


def cprofile_child(out_prefix: str, argv: list[str]) -> int:
    """Run bgraph's CLI in this process with one cProfile profiler per thread; write
    OUT.main.prof, OUT.actions.prof (every action thread merged) and OUT.other.prof."""
    import cProfile
    import threading

    profs: list[tuple[str, cProfile.Profile]] = []
    lock = threading.Lock()
    orig = threading.Thread.run

    def run(self):
        p = cProfile.Profile()
        with lock:
            profs.append((self.name, p))
        p.enable()
        try:
            orig(self)
        finally:
            p.disable()

    threading.Thread.run = run
    main = cProfile.Profile()
    main.enable()
    try:
        from build_graph.cli import main as cli_main
        code = cli_main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    finally:
        main.disable()
    main.dump_stats(out_prefix + ".main.prof")
    import pstats
    groups: dict[str, list] = defaultdict(list)
    with lock:
        for name, p in profs:
            # a thread per action ("Thread-N (_work)") and, since issue 34's Deliver 2, the filers
            groups["actions" if "_work" in name or name.startswith("bgraph-filer") else "other"].append(p)
    for g, ps in groups.items():
        merged = None
        for p in ps:
            try:
                p.create_stats()
            except Exception:  # a profiler of a thread still running
                continue
            merged = pstats.Stats(p) if merged is None else merged.add(p)
        if merged is not None:
            merged.dump_stats(out_prefix + f".{g}.prof")
    return int(code or 0)


# ---------------------------------------------------------------------------------------------
# the parts


class Bgraph:
    """How to run bgraph: a snapshot of one commit (or the worktree)."""

    def __init__(self, rev: str, root: Path, name: str = "bgraph-src"):
        if rev.startswith("dir:"):  # a tree prepared elsewhere (say, HEAD with some files laid over it)
            self.src, self.commit = Path(rev[4:]).resolve(), "-"
            self.version = f"directory {self.src}"
        elif rev == "worktree":
            self.src, self.commit = REPO, run_out(["git", "-C", str(REPO), "rev-parse", "HEAD"])
            dirty = run_out(["git", "-C", str(REPO), "status", "--porcelain", "build_graph"])
            self.version = f"working tree at {self.commit[:12]}" + (" (build_graph/ modified)" if dirty else "")
        else:
            self.commit = run_out(["git", "-C", str(REPO), "rev-parse", "--verify", rev + "^{commit}"])
            self.src = root / name
            self.src.mkdir()
            archive = subprocess.run(["git", "-C", str(REPO), "archive", self.commit], capture_output=True,
                                     check=True).stdout
            subprocess.run(["tar", "-x", "-C", str(self.src)], input=archive, check=True)
            subject = run_out(["git", "-C", str(REPO), "log", "-1", "--format=%s", self.commit])
            self.version = f"commit {self.commit[:12]} ({subject[:80]})"
        # Bytecode, as `pip install` leaves it (PYTHONDONTWRITEBYTECODE hosts compile every run).
        subprocess.run([sys.executable, "-m", "compileall", "-q", str(self.src / "build_graph")], check=True)
        self.env = clean_env(PYTHONPATH=str(self.src))
        self.cmd = [sys.executable, "-P", "-m", "build_graph"]  # -P: never the cwd's build_graph


def run_out(cmd: list[str]) -> str:
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()


def part_genrule(bg: Bgraph, root: Path, args, results: dict, base: Bgraph | None = None) -> None:
    """`base`: a second bgraph (--base-rev), run as builder "bgraph-base" beside the others in
    every repeat (interleaved, the order rotated), for a before/after of two commits."""
    n, j = args.n, args.jobs
    ninja = shutil.which("ninja")
    bgs = {"bgraph": bg, **({"bgraph-base": base} if base is not None else {})}
    builders = ["make", *(["ninja"] if ninja else []), *bgs]
    rows = []
    profiles = []
    for rep in range(args.repeat):
        order = builders[rep % len(builders):] + builders[:rep % len(builders)]
        print(f"== genrule repeat {rep + 1}/{args.repeat} (order: {', '.join(order)})", flush=True)
        for name in order:
            ws = root / f"g-{name}-{rep}"
            write_genrule_workspace(ws, n)
            age(ws)
            if name == "make":
                (ws / "out").mkdir()
                r = timed(["make", f"-j{j}", "-s"], ws, clean_env())
                got = (ws / "out" / "o7.txt").read_text()
            elif name == "ninja":
                r = timed([ninja, f"-j{j}"], ws, clean_env())
                got = (ws / "out" / "o7.txt").read_text()
            else:
                b = bgs[name]
                cache = root / f"g-cache-{rep}"
                r = timed([*b.cmd, "-C", str(ws), "--cache-dir", str(cache), "build", f"-j{j}", "//many:all"],
                          ws, b.env, out=root / f"g-{name}-{rep}.log")
                got = (ws / "bgraph-out" / "many" / "g7" / "o7.txt").read_text()
            assert got == "7\n7\n", got
            r.update(builder=name, repeat=rep)
            rows.append(r)
            print(f"  {name:11s} wall {r['wall']:7.3f}s  own cpu {r['own_cpu']:6.2f}s  foreign {r['foreign_cpu']:6.2f}s",
                  flush=True)
            rmtree(ws)
            if name in bgs:
                rmtree(root / f"g-cache-{rep}")
        if args.no_profile:
            continue
        # the same cold build with --profile --json, for per-action timings (not in the ratio)
        for name in [b for b in order if b in bgs]:
            b = bgs[name]
            ws, cache = root / f"g-prof-{rep}", root / f"g-prof-cache-{rep}"
            write_genrule_workspace(ws, n)
            age(ws)
            trace = root / f"profile-{name}-{rep}.json"
            summary_path = root / f"profile-{name}-{rep}.summary.json"
            r = timed([*b.cmd, "-C", str(ws), "--cache-dir", str(cache), "build", f"-j{j}", "--json",
                       "--profile", str(trace), "//many:all"], ws, b.env, out=summary_path)
            summary = json.loads(summary_path.read_text())
            per = profile_per_action(trace)
            per.update(builder=name, wall=r["wall"], own_cpu=r["own_cpu"], internal_wall=summary["wall_s"],
                       executed=summary["executed"], profile_summary=summary.get("profile"))
            if args.keep_traces:
                shutil.copy(trace, Path(args.keep_traces) / trace.name)
            per["rows"] = per["rows"] if args.json_rows else None
            profiles.append(per)
            print(f"  {name} --profile: wall {r['wall']:.3f}s, inside the build {summary['wall_s']:.3f}s, "
                  f"{per['n']} actions, phase medians (ms) {per['phase_median_ms']}", flush=True)
            rmtree(ws)
            rmtree(cache)
    results["genrule"] = {"n": n, "jobs": j, "runs": rows, "profiles": profiles,
                          "versions": {k: v.version for k, v in bgs.items()}}


def drop(argv: list[str], option: str, values: int) -> list[str]:
    """`argv` without `option` and the `values` arguments after it."""
    i = argv.index(option)
    return argv[:i] + argv[i + 1 + values:]


def part_floor(root: Path, results: dict, reps: int = 100) -> None:
    bwrap = shutil.which("bwrap")
    usr_links = [a for link in ("bin", "lib", "lib64", "sbin") if os.path.islink(f"/{link}")
                 for a in ("--symlink", os.readlink(f"/{link}"), f"/{link}")]
    src = root / "floor-src"
    src.mkdir()
    (src / "f1.txt").write_text("1\n")
    out = root / "floor-out"
    out.mkdir()
    full = [bwrap, "--unshare-all", "--cap-drop", "ALL", "--unshare-user", "--disable-userns", "--die-with-parent",
            "--new-session", "--hostname", "bgraph", "--proc", "/proc", "--remount-ro", "/proc", "--dev", "/dev",
            "--tmpfs", "/tmp", "--dir", "/bgraph", "--ro-bind", "/usr", "/usr", *usr_links,
            "--ro-bind", str(src), "/bgraph/src", "--bind", str(out), "/bgraph/out", "--chdir", "/"]
    cmd = ["/bin/sh", "-c", genrule_cmd(1, "/bgraph/src", "/bgraph/out")]
    variants = {
        "fork/exec /bin/true": ["/bin/true"],
        "the genrule's sh -c (cat > && echo >>), no sandbox": ["/bin/sh", "-c", genrule_cmd(1, str(src), str(out))],
        "bwrap --unshare-all --ro-bind / / -- /bin/true": [bwrap, "--unshare-all", "--ro-bind", "/", "/", "--",
                                                           "/bin/true"],
        "the same without --unshare-net": [bwrap, "--unshare-user-try", "--unshare-ipc", "--unshare-pid",
                                           "--unshare-uts", "--unshare-cgroup-try", "--ro-bind", "/", "/", "--",
                                           "/bin/true"],
        "bgraph's genrule options -- /bin/true": [*full, "--", "/bin/true"],
        "bgraph's genrule options -- the genrule's sh -c": [*full, "--", *cmd],
        "bgraph's genrule options minus --unshare-net -- sh -c": [
            bwrap, "--unshare-user", "--unshare-ipc", "--unshare-pid", "--unshare-uts", "--unshare-cgroup-try",
            *full[2:], "--", *cmd],
        "bgraph's genrule options minus --dev /dev -- sh -c": [*drop(full, "--dev", 1), "--", *cmd],
        "bgraph's genrule options minus --proc, --remount-ro /proc -- sh -c": [
            *drop(drop(full, "--proc", 1), "--remount-ro", 1), "--", *cmd],
        "bgraph's genrule options minus --disable-userns -- sh -c": [*drop(full, "--disable-userns", 0), "--", *cmd],
    }
    rows = {}
    names = list(variants)
    samples: dict[str, list[float]] = {k: [] for k in names}
    for i in range(reps):  # interleaved, so the machine's load reaches every variant alike
        for name in names[i % len(names):] + names[:i % len(names)]:
            t0 = time.perf_counter()
            subprocess.run(variants[name], check=True, stdin=subprocess.DEVNULL)
            samples[name].append((time.perf_counter() - t0) * 1e3)
    for name in names:
        xs = samples[name]
        rows[name] = {"median_ms": round(med(xs), 2), "p90_ms": round(pct(xs, 0.9), 2), "min_ms": round(min(xs), 2)}
        print(f"  floor {name:60s} median {rows[name]['median_ms']:6.2f} ms  p90 {rows[name]['p90_ms']:6.2f} ms  "
              f"min {rows[name]['min_ms']:6.2f} ms", flush=True)
    results["floor"] = {"reps": reps, "variants": rows}


def part_cprofile(bg: Bgraph, root: Path, args, results: dict) -> None:
    ws, cache = root / "g-cprof", root / "g-cprof-cache"
    write_genrule_workspace(ws, args.n)
    age(ws)
    prefix = str(root / "cprof")
    argv = ["-C", str(ws), "--cache-dir", str(cache), "build", f"-j{args.jobs}", "//many:all"]
    r = timed([sys.executable, "-P", str(Path(__file__).resolve()), "--cprofile-child", prefix, "--", *argv],
              ws, bg.env, out=root / "cprof.log")
    out = {"wall": r["wall"], "own_cpu": r["own_cpu"]}
    for g in ("main", "actions", "other"):
        f = Path(f"{prefix}.{g}.prof")
        if f.exists():
            out[g] = cprofile_parts(f, g)
            if args.keep_traces:
                shutil.copy(f, Path(args.keep_traces) / f.name)
    results["cprofile"] = out
    print(f"  cProfile build: wall {r['wall']:.2f}s", flush=True)
    for g in ("main", "actions", "other"):
        for title, row in out.get(g, {}).items():
            print(f"   {g:8s} {title:55s} calls {row['calls']:6d}  cum {row['cum_s']:8.3f}s", flush=True)
    rmtree(ws)
    rmtree(cache)


def part_pyspy(bg: Bgraph, root: Path, args, results: dict) -> None:
    """Two sampled builds: `--idle` (every thread, running or not: where each thread's time goes)
    and `--gil` (only the thread holding the interpreter lock: what Python itself computes)."""
    pyspy = real_tool("py-spy")
    if not pyspy:
        results["pyspy"] = {"skipped": "py-spy is not installed (pip install py-spy)"}
        print("  py-spy: not installed, skipped", flush=True)
        return
    lines = (bg.src / "build_graph" / "sandbox.py").read_text().splitlines()
    line = next(i + 1 for i, l in enumerate(lines) if "os.waitpid(proc.pid" in l)
    rate, out = 250, {}
    for mode in ("idle", "gil"):
        ws, cache = root / "g-pyspy", root / "g-pyspy-cache"
        write_genrule_workspace(ws, args.n)
        age(ws)
        raw = root / f"pyspy-{mode}.txt"
        argv = [pyspy, "record", f"--{mode}", "--threads", "--nonblocking", "--format", "raw", "-r", str(rate),
                "-o", str(raw), "--", *bg.cmd, "-C", str(ws), "--cache-dir", str(cache), "build",
                f"-j{args.jobs}", "//many:all"]
        try:
            r = timed(argv, ws, bg.env, out=root / "pyspy.log")
        except RuntimeError as e:
            out[mode] = {"skipped": f"py-spy failed here: {str(e)[-300:]}"}
            print(f"  py-spy failed: {str(e)[-300:]}", flush=True)
            continue
        parts = pyspy_parts(raw, rate, f"BwrapRunner.run (build_graph/sandbox.py:{line})")
        out[mode] = {"wall": r["wall"], "rate": rate, "by_thread_and_part_s": parts}
        if args.keep_traces:
            shutil.copy(raw, Path(args.keep_traces) / raw.name)
        print(f"  py-spy --{mode} build: wall {r['wall']:.2f}s", flush=True)
        for cls, p in parts.items():
            print(f"   {cls}: {json.dumps({k: round(v, 2) for k, v in p.items()})}", flush=True)
        rmtree(ws)
        rmtree(cache)
    results["pyspy"] = out


# -- the small-TU cuda_library


HEADER = """#pragma once
namespace tiny {
__device__ __forceinline__ float f(float x) { return x * x + 1.0f; }
}
"""


KERNELS_PER_TU = 1  # --kernels-per-tu: a larger TU of the same shape


def tu_source(i: int) -> str:
    kernels = "".join(f"__global__ void k{i}_{j}(float* y, const float* x, int n) {{\n"
                      f"  int t = blockIdx.x * blockDim.x + threadIdx.x;\n"
                      f"  if (t < n) y[t] = tiny::f(x[t]) * {j + 1}.0f + {i}.0f;\n}}\n" for j in range(KERNELS_PER_TU))
    return f'#include "tiny.cuh"\n{kernels}int tiny_tu_{i}() {{ return {i}; }}\n'


def write_tiny_sources(root: Path, tus: int) -> None:
    (root / "src").mkdir(parents=True, exist_ok=True)
    (root / "src" / "tiny.cuh").write_text(HEADER)
    for i in range(tus):
        (root / "src" / f"k{i}.cu").write_text(tu_source(i))


class TinyMake:
    """nvcc under make -j, optionally through a launcher (sccache)."""

    name = "plain"

    def __init__(self, root: Path, nvcc: str, launcher: str | None, tus: int, jobs: int, env: dict[str, str]):
        self.root, self.nvcc, self.launcher, self.tus, self.jobs, self.env = root, nvcc, launcher, tus, jobs, env
        self.group: CpuGroup | None = None  # the cgroup the next build runs in (exact CPU)

    def setup(self) -> None:
        rmtree(self.root)
        write_tiny_sources(self.root, self.tus)
        flags = " ".join([*gencode(ARCHS), "-Xcompiler=-fPIC", *COPTS, "-I."])
        (self.root / "Makefile").write_text(
            f"NVCC := {(self.launcher + ' ') if self.launcher else ''}{self.nvcc}\nFLAGS := {flags}\n"
            f"OBJS := {' '.join(f'obj/k{i}.o' for i in range(self.tus))}\nall: $(OBJS)\n"
            "obj/%.o: src/%.cu src/tiny.cuh Makefile\n\t@mkdir -p obj\n\t$(NVCC) $(FLAGS) -c $< -o $@\n")
        age(self.root)
        self.group = CpuGroup.make()

    def build(self) -> dict:
        try:
            return timed(["make", f"-j{self.jobs}", "-s"], self.root, self.env, group=self.group)
        finally:
            self.drop_group()

    def drop_group(self) -> None:
        if self.group is not None:
            self.group.remove()
            self.group = None

    def objects(self) -> list[Path]:
        return sorted((self.root / "obj").glob("*.o"))


class TinySccache(TinyMake):
    name = "sccache"

    def __init__(self, *a, sccache: str, cache_dir: Path, **kw):
        super().__init__(*a, **kw)
        # arch_cache's server handling (fresh cache dir, foreground server, stop)
        self.scc = SccacheBuilder.__new__(SccacheBuilder)
        self.scc.sccache, self.scc.cache_dir, self.scc.env, self.scc.running = sccache, cache_dir, self.env, False

    def setup(self) -> None:
        self.stop()
        super().setup()
        if self.group is not None:
            # The server compiles: it runs in the build's group (every sccache call joins it,
            # --stop-server included), the make and client processes join it through timed().
            script = self.root.parent / "sccache-in-group.sh"
            script.write_text(f"#!/bin/sh\necho $$ > '{self.group.path}/cgroup.procs' || exit 125\n"
                              f"exec '{self.launcher}' \"$@\"\n")
            script.chmod(0o755)
            self.scc.sccache = str(script)
        self.scc.reset_cache()

    def build(self) -> dict:
        # the group is kept: the server, idle now, lives in it until stop()
        return timed(["make", f"-j{self.jobs}", "-s"], self.root, self.env, group=self.group)

    def stop(self) -> None:
        self.scc.stop()
        self.scc.sccache = self.launcher
        self.drop_group()


class TinyBgraph:
    name = "bgraph"

    def __init__(self, root: Path, bg: Bgraph, cache: Path, template: Path, tus: int, jobs: int):
        self.root, self.bg, self.cache, self.template, self.tus, self.jobs = root, bg, cache, template, tus, jobs
        self.group: CpuGroup | None = None

    def setup(self) -> None:
        rmtree(self.root)
        (self.root / "targets").mkdir(parents=True)
        shutil.copy(self.bg.src / "WORKSPACE.toml", self.root / "WORKSPACE.toml")
        shutil.copy(self.bg.src / "targets" / "toolchains.toml", self.root / "targets" / "toolchains.toml")
        shutil.copytree(self.bg.src / "toolchains", self.root / "toolchains")
        write_tiny_sources(self.root, self.tus)
        (self.root / "targets" / "bench.toml").write_text(
            f'package = "//bench"\n\n[lib]\nkind = "cuda_library"\nsrcs = ["src/*.cu"]\nhdrs = ["src/*.cuh"]\n'
            f"archs = {json.dumps(ARCHS)}\ncopts = {json.dumps(COPTS)}\n")
        age(self.root)
        rmtree(self.cache)
        subprocess.run(["cp", "-a", str(self.template), str(self.cache)], check=True)
        # the toolchain's blobs stamped at their new inodes (untimed), as a user's cache is
        subprocess.run([*self.bg.cmd, "-C", str(self.root), "--cache-dir", str(self.cache), "build", "--json",
                        *TOOLCHAIN_TARGETS], env=self.bg.env, check=True, capture_output=True)
        rmtree(self.root / "bgraph-out")
        self.group = CpuGroup.make()

    def build(self) -> dict:
        """The timed cold build; beside its figures, the actions' own CPU (each sandbox's cgroup,
        from --json) and, with a group, bgraph's own: the group's CPU less the actions'."""
        out = self.root.parent / "tiny-bgraph.json"
        try:
            r = timed([*self.bg.cmd, "-C", str(self.root), "--cache-dir", str(self.cache), "build",
                       f"-j{self.jobs}", "--json", "//bench:lib"], self.root, self.bg.env, out=out, group=self.group)
        finally:
            if self.group is not None:
                self.group.remove()
                self.group = None
        s = json.loads(out.read_text())
        assert s["ok"], s["errors"]
        ran = [a for a in s["actions"] if a["status"] == "executed"]
        acts = [a for a in ran if a["label"] == "//bench:lib"]
        by = defaultdict(lambda: [0, 0.0, 0.0])
        for a in acts:
            by[a["mnemonic"]][0] += 1
            by[a["mnemonic"]][1] += a["duration_s"]
            by[a["mnemonic"]][2] += a.get("cpu_s", 0.0)
        actions_cpu = sum(a.get("cpu_s", 0.0) for a in ran)
        r.update(executed=len(acts), executed_all=len(ran), internal_wall=s["wall_s"],
                 sum_durations=round(sum(a["duration_s"] for a in acts), 3), actions_cpu=round(actions_cpu, 3),
                 by_mnemonic={k: [v[0], round(v[1], 3), round(v[2], 3)] for k, v in sorted(by.items())})
        if "group_cpu" in r:
            r["bgraph_own_cpu"] = r["group_cpu"] - actions_cpu
        return r

    def objects(self) -> list[Path]:
        lib = self.root / "bgraph-out" / "bench" / "lib" / "liblib.a"
        d = self.root.parent / "tiny-bgraph-ar-x"
        rmtree(d)
        d.mkdir()
        subprocess.run(["ar", "x", str(lib.resolve())], cwd=d, check=True)
        return sorted(d.glob("*.o"))


def part_cuda(bg: Bgraph, root: Path, args, results: dict, base: Bgraph | None = None) -> None:
    """`base` (--base-rev): a second bgraph, run as builder "bgraph-base" in every repeat."""
    template = Path(args.toolchain_cache)
    setup_ws = root / "tc-ws"
    (setup_ws / "targets").mkdir(parents=True)
    shutil.copy(bg.src / "WORKSPACE.toml", setup_ws / "WORKSPACE.toml")
    shutil.copy(bg.src / "targets" / "toolchains.toml", setup_ws / "targets" / "toolchains.toml")
    shutil.copytree(bg.src / "toolchains", setup_ws / "toolchains")
    t0 = time.monotonic()
    p = subprocess.run([*bg.cmd, "-C", str(setup_ws), "--cache-dir", str(template), "build", f"-j{args.jobs}",
                        "--json", *TOOLCHAIN_TARGETS, "//toolchains:cuobjdump"], env=bg.env, capture_output=True,
                       text=True)
    if p.returncode != 0:
        raise RuntimeError(f"toolchain build failed:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    summary = json.loads(p.stdout)
    nvcc = str(Path(summary["outputs"]["//toolchains:cuda-13.0"]).resolve() / "bin" / "nvcc")
    cuobjdump = str(Path(summary["outputs"]["//toolchains:cuobjdump"]).resolve() / "bin" / "cuobjdump")
    print(f"toolchain (untimed, {template}): {time.monotonic() - t0:.1f}s; nvcc {tool_version([nvcc, '--version'])}",
          flush=True)
    sccache = real_tool("sccache")
    scc_env = clean_env(SCCACHE_DIR=str(root / "sccache"), SCCACHE_SERVER_PORT=str(free_port()),
                        SCCACHE_IDLE_TIMEOUT="0", SCCACHE_CONF=str(root / "sccache.conf"), SCCACHE_CACHE_SIZE="5G",
                        SCCACHE_LOG="")
    (root / "sccache.conf").write_text("")
    builders = {"plain": TinyMake(root / "tiny-plain", nvcc, None, args.tus, args.jobs, clean_env())}
    if sccache:
        builders["sccache"] = TinySccache(root / "tiny-sccache", nvcc, sccache, args.tus, args.jobs, scc_env,
                                          sccache=sccache, cache_dir=root / "sccache")
    builders["bgraph"] = TinyBgraph(root / "tiny-bgraph", bg, root / "tiny-bgraph-cache", template, args.tus,
                                    args.jobs)
    if base is not None:
        builders["bgraph-base"] = TinyBgraph(root / "tiny-bgraph-base", base, root / "tiny-bgraph-base-cache",
                                             template, args.tus, args.jobs)
    names = list(builders)
    rows, ref = [], None
    scratch = root / "scratch"
    scratch.mkdir(exist_ok=True)
    try:
        for rep in range(args.cuda_repeat):
            order = names[rep % len(names):] + names[:rep % len(names)]
            print(f"== cuda repeat {rep + 1}/{args.cuda_repeat} (order: {', '.join(order)})", flush=True)
            for name in order:
                b = builders[name]
                b.setup()
                r = b.build()
                got = cubins(b.objects(), cuobjdump, scratch)
                if name == "plain" and ref is None:
                    ref = got
                ok, verdict = compare(got, ref) if ref is not None else (True, "reference")
                r.update(builder=name, repeat=rep, correct=ok, verdict=verdict)
                rows.append(r)
                extra = (f"  executed {r['executed']} (sum of durations {r['sum_durations']:.1f}s, inside "
                         f"{r['internal_wall']:.1f}s; actions' CPU {r['actions_cpu']:.1f}s, bgraph's own "
                         f"{r.get('bgraph_own_cpu', float('nan')):.2f}s)") if name.startswith("bgraph") else ""
                print(f"  {name:11s} wall {r['wall']:7.2f}s  group cpu {r.get('group_cpu', float('nan')):6.2f}s  "
                      f"own cpu {r['own_cpu']:6.1f}s  foreign {r['foreign_cpu']:5.1f}s  {verdict}{extra}", flush=True)
    finally:
        if "sccache" in builders:
            builders["sccache"].stop()
    results["cuda"] = {"tus": args.tus, "archs": ARCHS, "kernels_per_tu": KERNELS_PER_TU, "jobs": args.jobs, "runs": rows,
                       "versions": {k: b.bg.version for k, b in builders.items() if isinstance(b, TinyBgraph)},
                       "sccache": tool_version([sccache, "--version"]) if sccache else "not installed",
                       "nvcc": tool_version([nvcc, "--version"])}


# ---------------------------------------------------------------------------------------------
# report


def walls(rows: list[dict]) -> str:
    return ", ".join(f"{r['wall']:.2f}" for r in rows)


def report(results: dict) -> None:
    print("\n## Results\n")
    m = results.get("machine", {})
    print(f"machine: {m.get('cpu')}; kernel {m.get('kernel')}; bgraph {m.get('bgraph')}")
    g = results.get("genrule")
    if g:
        n = g["n"]
        by = defaultdict(list)
        for r in g["runs"]:
            by[r["builder"]].append(r)
        w = {k: med([r["wall"] for r in v]) for k, v in by.items()}
        print(f"\n### {n} tiny genrules, cold, -j{g['jobs']} (median of {len(by['make'])})\n")
        print("| builder | wall s (median) | every repeat | ratio to make | own CPU s (median) | process tree CPU s (median) |")
        print("|---|---:|---|---:|---:|---:|")
        for k, v in by.items():
            print(f"| {k} | {w[k]:.3f} | {walls(v)} | {w[k] / w['make']:.2f}x | "
                  f"{med([r['own_cpu'] for r in v]):.2f} | {med([r.get('tree_cpu', 0) for r in v]):.2f} |")
        for name, version in g.get("versions", {"bgraph": m.get("bgraph")}).items():
            own = [(b["wall"] - mk["wall"]) / n * 1e3 for b, mk in zip(by[name], by["make"])]
            cpu = [(b["own_cpu"] - mk["own_cpu"]) / n * 1e3 for b, mk in zip(by[name], by["make"])]
            tree = [(b.get("tree_cpu", 0) - mk.get("tree_cpu", 0)) / n * 1e3 for b, mk in zip(by[name], by["make"])]
            ratio = [b["wall"] / mk["wall"] for b, mk in zip(by[name], by["make"])]
            print(f"\n{name} ({version}): own wall per action, ({name} wall - make wall) / {n}, per repeat: "
                  f"{', '.join(f'{x:.1f}' for x in own)} ms (median {med(own):.1f} ms, p90 {pct(own, 0.9):.1f} ms); "
                  f"own CPU per action (median) {med(cpu):.1f} ms, of its process tree {med(tree):.1f} ms; "
                  f"wall ratio to make (median) {med(ratio):.2f}x")
        if "bgraph-base" in by:
            print("bgraph / bgraph-base within each repeat:")
            for what, key in (("wall", "wall"), ("own CPU", "own_cpu"), ("process tree CPU", "tree_cpu")):
                r = [a.get(key, 0) / max(b.get(key, 0), 1e-9) for a, b in zip(by["bgraph"], by["bgraph-base"])]
                print(f"  {what}: {', '.join(f'{x:.2f}' for x in r)} (median {med(r):.2f}x)")
        for i, p in enumerate(g["profiles"]):
            print(f"\n--profile build {i + 1} ({p.get('builder', 'bgraph')}): wall {p['wall']:.2f}s "
                  f"(inside the build {p['internal_wall']:.2f}s), "
                  f"{p['n']} actions over {p['actions_window_s']:.2f}s, planning thread busy "
                  f"{p['planning_thread_s']:.2f}s {p['planning_spans']}")
            print("| per action (ms) | median | p90 | sum over actions (s) |")
            print("|---|---:|---:|---:|")
            for k in p["phase_median_ms"]:
                print(f"| {k} | {p['phase_median_ms'][k]:.2f} | {p['phase_p90_ms'][k]:.2f} | "
                      f"{p['phase_sum_s'][k]:.2f} |")
            for k, v in p.get("by_planning_overlap_median_ms", {}).items():
                print(f"  medians (ms) where the {k}: {v}")
    f = results.get("floor")
    if f:
        print(f"\n### bubblewrap floor ({f['reps']} runs each, interleaved)\n")
        print("| command | median ms | p90 ms | min ms |")
        print("|---|---:|---:|---:|")
        for k, v in f["variants"].items():
            print(f"| {k} | {v['median_ms']:.2f} | {v['p90_ms']:.2f} | {v['min_ms']:.2f} |")
    cp = results.get("cprofile")
    if cp:
        print(f"\n### cProfile, one profiler per thread (wall-clock timer; build wall {cp['wall']:.2f}s)\n")
        print("| thread | function | calls | cumulative s |")
        print("|---|---|---:|---:|")
        for g in ("main", "actions", "other"):
            for title, row in cp.get(g, {}).items():
                print(f"| {g} | {title.replace(' ', '&nbsp;', len(title) - len(title.lstrip()))} | {row['calls']} | "
                      f"{row['cum_s']:.3f} |")
    for mode, ps in (results.get("pyspy") or {}).items():
        if "by_thread_and_part_s" not in ps:
            print(f"\npy-spy --{mode}: {ps.get('skipped')}")
            continue
        what = "every thread, running or waiting" if mode == "idle" else "only the thread holding the GIL"
        print(f"\n### py-spy --{mode}, {ps['rate']} samples/s, {what} (build wall {ps['wall']:.2f}s)\n")
        print("| thread | part | s | share of the thread |")
        print("|---|---|---:|---:|")
        for cls, d in ps["by_thread_and_part_s"].items():
            tot = sum(d.values()) or 1
            for part, v in d.items():
                print(f"| {cls} | {part} | {v:.2f} | {v / tot:.0%} |")
    gl = results.get("gil")
    if gl:
        print("\n### GIL switch interval (cold genrule builds, alternated)\n")
        print("| switch interval | walls s | median wall s | own CPU s (median) |")
        print("|---|---|---:|---:|")
        for iv in sorted({r["interval_ms"] for r in gl["runs"]}, reverse=True):
            rs = [r for r in gl["runs"] if r["interval_ms"] == iv]
            print(f"| {iv:.1f} ms | {walls(rs)} | {med([r['wall'] for r in rs]):.2f} | "
                  f"{med([r['own_cpu'] for r in rs]):.2f} |")
    sc = results.get("strace")
    if sc and "make" in sc:
        print(f"\n### system calls per action (strace -f -ff, cold builds of {sc['n']} and {2 * sc['n']} genrules: "
              f"the difference / {sc['n']}; counted, not timed)\n")
        print("| builder | syscalls | clone/fork | execve | by program | most frequent (per action) |")
        print("|---|---:|---:|---:|---|---|")
        for name in ("make", "bgraph"):
            r = sc[name]
            top = ", ".join(f"{k} {v:g}" for k, v in list(r["top_per_action"].items())[:16])
            progs = ", ".join(f"{k} {v:g}" for k, v in r["by_program"].items() if abs(v) >= 1)
            print(f"| {name} | {r['syscalls_per_action']:g} | {r['processes_per_action']:g} | "
                  f"{r['execve_per_action']:g} | {progs} | {top} |")
        for prog, top in sc["bgraph"]["top_by_program"].items():
            if abs(sc["bgraph"]["by_program"].get(prog, 0)) >= 1:
                print(f"  bgraph, {prog}: " + ", ".join(f"{k} {v:g}" for k, v in top.items()))
    c = results.get("cuda")
    if c:
        by = defaultdict(list)
        for r in c["runs"]:
            by[r["builder"]].append(r)
        w = {k: med([r["wall"] for r in v]) for k, v in by.items()}
        print(f"\n### cuda_library, {c['tus']} tiny TUs x {c['archs']}, cold, -j{c['jobs']}\n")
        print("| builder | wall s (median) | every repeat | ratio to plain | own CPU s (median) | CPU ratio | cubins |")
        print("|---|---:|---|---:|---:|---:|---|")
        cpu = {k: med([r["own_cpu"] for r in v]) for k, v in by.items()}
        for k, v in by.items():
            print(f"| {k} | {w[k]:.2f} | {walls(v)} | {w[k] / w['plain']:.2f}x | "
                  f"{cpu[k]:.1f} | {cpu[k] / cpu['plain']:.2f}x | {'; '.join(sorted({r['verdict'] for r in v}))} |")
        if by.get("bgraph"):
            ex = by["bgraph"][0]["executed"]
            per = [(b["wall"] - p["wall"]) / ex * 1e3 for b, p in zip(by["bgraph"], by["plain"])]
            print(f"\nbgraph executed {ex} actions ({by['bgraph'][0]['by_mnemonic']}); (bgraph wall - plain wall) / "
                  f"actions per repeat: {', '.join(f'{x:.0f}' for x in per)} ms")
        if all("group_cpu" in r for r in c["runs"]):
            # exact CPU (each build in its own cgroup), as ratios to plain within each repeat
            print("\n| builder | CPU s per repeat (its cgroup) | median | ratio to plain, per repeat | median ratio |")
            print("|---|---|---:|---|---:|")
            for k, v in by.items():
                ratios = [r["group_cpu"] / p["group_cpu"] for r, p in zip(v, by["plain"])]
                cpus = ", ".join(f"{r['group_cpu']:.2f}" for r in v)
                print(f"| {k} | {cpus} | {med([r['group_cpu'] for r in v]):.2f} "
                      f"| {', '.join(f'{x:.3f}' for x in ratios)} | {med(ratios):.3f}x |")
            for k, v in by.items():
                if k.startswith("bgraph"):
                    own = [r["bgraph_own_cpu"] for r in v]
                    ex = v[0]["executed_all"]
                    acts = ", ".join(f"{r['actions_cpu']:.2f}" for r in v)
                    print(f"{k}: actions' CPU (their sandboxes' cgroups) {acts} s; "
                          f"bgraph's own (the rest of its group) {', '.join(f'{x:.2f}' for x in own)} s = "
                          f"{med(own) / ex * 1e3:.1f} ms per action, {med(own) / c['tus'] * 1e3:.0f} ms per TU (median)")


def part_gil(bg: Bgraph, root: Path, args, results: dict) -> None:
    """The same cold genrule build with Python's GIL switch interval at its default (5 ms) and at
    0.5 ms, alternated: how long the action threads wait for the interpreter while the planning
    thread computes (an action thread that returns from a system call waits up to one interval)."""
    rows = []
    for rep in range(args.gil_repeat):
        for interval in ((0.005, 0.0005) if rep % 2 == 0 else (0.0005, 0.005)):
            ws, cache = root / "g-gil", root / "g-gil-cache"
            write_genrule_workspace(ws, args.n)
            age(ws)
            r = timed([sys.executable, "-P", str(Path(__file__).resolve()), "--switch-interval-child", str(interval),
                       "--", "-C", str(ws), "--cache-dir", str(cache), "build", f"-j{args.jobs}", "//many:all"],
                      ws, bg.env, out=root / "gil.log")
            r.update(interval_ms=interval * 1e3, repeat=rep)
            rows.append(r)
            print(f"  switch interval {interval * 1e3:.1f} ms: wall {r['wall']:.2f}s own cpu {r['own_cpu']:.2f}s",
                  flush=True)
            rmtree(ws)
            rmtree(cache)
    results["gil"] = {"runs": rows}


def strace_by_program(outdir: Path, first: str) -> dict[str, dict[str, int]]:
    """`strace -ff -o DIR/t` traces -> {program: {syscall: calls}}. A call counts for the program
    its process ran then: after an execve the new one, before it the program of the parent when it
    cloned this process (bwrap's namespace children, spares before they exec, bgraph's threads);
    the traced command itself is `first`. bgraph's interpreter counts as "bgraph (python)"."""
    calls: dict[int, list[tuple[str, str]]] = {}
    for f in outdir.iterdir():
        rows = []
        with open(f, errors="replace") as fh:
            for line in fh:
                name = line.split("(", 1)[0]
                if name and (name[0].isalpha() or name[0] == "_") and " " not in name:
                    rows.append((name, line))
        calls[int(f.name.rsplit(".", 1)[1])] = rows
    parent_prog: dict[int, str] = {}
    root = min(calls)  # the first pid strace started
    order = sorted(calls)
    for pid in order:  # parents are cloned before their children: lower pids first (no pid wrap here)
        prog = parent_prog.get(pid, first if pid == root else "?")
        for name, line in calls[pid]:
            if name == "execve" and line.rstrip().endswith(" = 0"):
                prog = os.path.basename(line.split('"', 2)[1])
                prog = "bgraph (python)" if prog.startswith("python") else prog
            elif name in ("clone", "clone3", "fork", "vfork"):
                child = line.rstrip().rsplit("= ", 1)[-1].split()[0]
                if child.isdigit():
                    parent_prog[int(child)] = prog
    out: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for pid in order:
        prog = parent_prog.get(pid, first if pid == root else "?")
        for name, line in calls[pid]:
            out[prog][name] += 1
            if name == "execve" and line.rstrip().endswith(" = 0"):
                prog = os.path.basename(line.split('"', 2)[1])
                prog = "bgraph (python)" if prog.startswith("python") else prog
    return {k: dict(v) for k, v in out.items()}


def part_strace(bg: Bgraph, root: Path, args, results: dict) -> None:
    """Counts at N and 2N genrules; per action = (count at 2N - count at N) / N, so that fixed
    costs (bgraph's start-up, make's parse) drop out."""
    strace = shutil.which("strace")
    if not strace:
        results["strace"] = {"skipped": "strace is not installed"}
        return
    n, out = args.strace_n, {}
    for name in ("make", "bgraph"):
        counts = {}
        for size in (n, 2 * n):
            ws = root / f"g-strace-{name}"
            write_genrule_workspace(ws, size)
            age(ws)
            traces = root / f"strace-{name}-{size}"
            traces.mkdir()
            if name == "make":
                (ws / "out").mkdir()
                argv, env = ["make", f"-j{args.jobs}", "-s"], clean_env()
            else:
                argv = [*bg.cmd, "-C", str(ws), "--cache-dir", str(root / "g-strace-cache"), "build",
                        f"-j{args.jobs}", "//many:all"]
                env = bg.env
            timed([strace, "-f", "-ff", "-o", str(traces / "t"), *argv], ws, env, out=root / f"strace-{name}.log")
            counts[size] = strace_by_program(traces, "strace")
            rmtree(traces)
            rmtree(ws)
            rmtree(root / "g-strace-cache")
        progs = set(counts[n]) | set(counts[2 * n])
        per = {p: {k: (counts[2 * n].get(p, {}).get(k, 0) - counts[n].get(p, {}).get(k, 0)) / n
                   for k in set(counts[n].get(p, {})) | set(counts[2 * n].get(p, {}))} for p in progs}
        total = defaultdict(float)
        for p in per.values():
            for k, v in p.items():
                total[k] += v
        procs = sum(total.get(k, 0) for k in ("clone", "clone3", "fork", "vfork"))
        out[name] = {"syscalls_per_action": round(sum(total.values()), 1),
                     "processes_per_action": round(procs, 2), "execve_per_action": round(total.get("execve", 0), 2),
                     "by_program": {p: round(sum(v.values()), 1) for p, v in
                                    sorted(per.items(), key=lambda kv: -sum(kv[1].values()))},
                     "top_by_program": {p: {k: round(x, 1) for k, x in sorted(v.items(), key=lambda kv: -kv[1])[:12]}
                                        for p, v in per.items()},
                     "top_per_action": {k: round(v, 1) for k, v in sorted(total.items(), key=lambda kv: -kv[1])[:30]}}
        print(f"  strace {name}: {out[name]['syscalls_per_action']} syscalls, {out[name]['processes_per_action']} "
              f"clones, {out[name]['execve_per_action']} execve per action; by program {out[name]['by_program']}",
              flush=True)
    results["strace"] = {"n": n, **out}


def main() -> int:
    global ARCHS, KERNELS_PER_TU
    if len(sys.argv) > 2 and sys.argv[1] == "--switch-interval-child":
        sys.setswitchinterval(float(sys.argv[2]))
        from build_graph.cli import run as cli_run
        sys.argv = ["bgraph", *sys.argv[sys.argv.index("--") + 1:]]
        cli_run()
    if len(sys.argv) > 2 and sys.argv[1] == "--cprofile-child":
        return cprofile_child(sys.argv[2], sys.argv[sys.argv.index("--") + 1:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--n", type=int, default=300, help="genrules")
    ap.add_argument("--tus", type=int, default=24, help="tiny .cu translation units")
    ap.add_argument("--archs", default=",".join(ARCHS), help="cuda part: the arch list, comma-separated")
    ap.add_argument("--kernels-per-tu", type=int, default=1, help="cuda part: __global__ functions per TU")
    ap.add_argument("--repeat", type=int, default=3, help="repeats of the genrule part")
    ap.add_argument("--cuda-repeat", type=int, default=2, help="repeats of the cuda part")
    ap.add_argument("--gil-repeat", type=int, default=2, help="pairs of builds in the gil part")
    ap.add_argument("--strace-n", type=int, default=100, help="genrules in the strace part")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--bgraph-rev", default="HEAD")
    ap.add_argument("--base-rev", help="genrule and cuda parts: also run this commit, as builder bgraph-base, interleaved "
                                       "(a before/after of two commits in one run)")
    ap.add_argument("--no-profile", action="store_true", help="genrule part: no --profile builds")
    ap.add_argument("--toolchain-cache", default=str(DEFAULT_TOOLCHAIN_CACHE),
                    help="bgraph cache holding the CUDA toolchain, built once and reused between runs")
    ap.add_argument("--workdir")
    ap.add_argument("--json-out")
    ap.add_argument("--json-rows", action="store_true", help="keep every action's profile row in the JSON")
    ap.add_argument("--keep-traces", help="copy the --profile traces and profiler outputs into this directory")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    ARCHS, KERNELS_PER_TU = [a for a in args.archs.split(",") if a], args.kernels_per_tu
    parts = args.parts.split(",")
    if args.keep_traces:
        Path(args.keep_traces).mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="small-actions-", dir=args.workdir))
    print(f"work dir: {root}", flush=True)
    defer_deletions(root / "trash")
    results: dict = {"args": vars(args)}
    try:
        bg = Bgraph(args.bgraph_rev, root)
        base = Bgraph(args.base_rev, root, "bgraph-base-src") if args.base_rev else None
        model = next((l.split(":", 1)[1].strip() for l in run_out(["lscpu"]).splitlines()
                      if l.startswith("Model name")), "?")
        results["machine"] = {"cpu": f"{model}, {os.cpu_count()} CPUs", "kernel": os.uname().release,
                              "bgraph": bg.version, **({"bgraph_base": base.version} if base else {}),
                              "bwrap": tool_version(["bwrap", "--version"]),
                              "make": tool_version(["make", "--version"]),
                              "ninja": tool_version(["ninja", "--version"]) if shutil.which("ninja") else "-",
                              "loadavg_start": os.getloadavg()}
        print(f"bgraph: {bg.version}; {results['machine']}", flush=True)
        t0 = time.monotonic()
        if "floor" in parts:
            part_floor(root, results)
        if "genrule" in parts:
            part_genrule(bg, root, args, results, base)
        if "cprofile" in parts:
            part_cprofile(bg, root, args, results)
        if "pyspy" in parts:
            part_pyspy(bg, root, args, results)
        if "gil" in parts:
            part_gil(bg, root, args, results)
        if "strace" in parts:
            part_strace(bg, root, args, results)
        if "cuda" in parts:
            part_cuda(bg, root, args, results, base)
        results["total_wall_s"] = round(time.monotonic() - t0, 1)
        results["machine"]["loadavg_end"] = os.getloadavg()
        report(results)
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(results, indent=1))
            print(f"raw results: {args.json_out}")
    finally:
        empty_trash()
        if args.keep:
            print(f"kept {root}")
        else:
            rmtree(root)
    return 0


if __name__ == "__main__":
    sys.exit(main())
