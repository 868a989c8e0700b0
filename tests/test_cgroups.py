"""Per-action CPU time through cgroups (the sandbox's processes are invisible to child rusage)."""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest
from bgraph_testlib import action, requires_bwrap

from build_graph import cgroups
from build_graph.cgroups import Accounting, CpuAccounting, _kill, _own_v2_path, _wrap

# Spends at least 0.4 s of CPU in a grandchild that the sandbox's own init reaps.
BURN = {"targets/p.toml": '''[burn]
kind = "genrule"
outs = ["o.txt"]
cmd = "/usr/bin/python3 -c 'import time\\nwhile time.process_time() < 0.4: pass' & wait; echo ok > $OUT/o.txt"
'''}


def no_cgroup_reason(root: Path = Path("/sys/fs/cgroup"), self_cgroup: Path = Path("/proc/self/cgroup")) -> str:
    """The skip reason where CpuAccounting.probe() finds nothing: what it looked for, what it
    found, and what to enable (it appears in pytest's -rs summary, as CI prints it)."""
    v1 = root / "cpuacct" / "cpuacct.usage"
    v1_state = (f"cgroup v1 {v1.parent} is there but bgraph cannot make a group in it" if v1.exists()
                else f"no cgroup v1 cpuacct ({v1} absent)")
    own = _own_v2_path(self_cgroup)
    if own is None:
        v2_state = f"no cgroup v2 entry in {self_cgroup}"
    elif not (root / "cgroup.controllers").exists():
        v2_state = f"no cgroup v2 hierarchy ({root / 'cgroup.controllers'} absent)"
    else:
        v2_state = f"cgroup v2 subtree {root / own} is not writable"
    return ("cgroups unavailable, so per-action CPU time is untested (reported as 0): "
            f"{v1_state}; {v2_state}. Enable: run as root with /sys/fs/cgroup writable (a container: "
            "--privileged, or --cgroupns=private with a read-write cgroup mount), or in a delegated "
            "cgroup v2 subtree (systemd-run --scope -p Delegate=yes)")


def test_no_cgroup_skip_reason_names_what_is_missing_and_how_to_enable_it(tmp_path):
    (tmp_path / "cgroup").write_text("0::/ci.scope\n")
    nothing = tmp_path / "sys"
    assert CpuAccounting.probe(root=nothing, self_cgroup=tmp_path / "cgroup") is None
    reason = no_cgroup_reason(nothing, tmp_path / "cgroup")
    assert reason.startswith("cgroups unavailable, so per-action CPU time is untested")
    assert f"no cgroup v1 cpuacct ({nothing}/cpuacct/cpuacct.usage absent)" in reason
    assert f"no cgroup v2 hierarchy ({nothing}/cgroup.controllers absent)" in reason
    assert "Enable: run as root with /sys/fs/cgroup writable" in reason and "Delegate=yes" in reason
    # A v2 hierarchy whose subtree bgraph may not write to (a file where the group would go).
    nothing.mkdir()
    (nothing / "cgroup.controllers").write_text("cpu\n")
    (nothing / "ci.scope").write_text("")
    assert CpuAccounting.probe(root=nothing, self_cgroup=tmp_path / "cgroup") is None
    assert f"cgroup v2 subtree {nothing}/ci.scope is not writable" in no_cgroup_reason(nothing, tmp_path / "cgroup")
    (tmp_path / "cgroup").write_text("4:memory:/x\n")
    assert f"no cgroup v2 entry in {tmp_path / 'cgroup'}" in no_cgroup_reason(nothing, tmp_path / "cgroup")


def test_no_cgroups_means_no_accounting(tmp_path):
    (tmp_path / "cgroup").write_text("0::/\n")
    assert CpuAccounting.probe(root=tmp_path / "sys", self_cgroup=tmp_path / "cgroup") is None


def test_own_cgroup_v2_path(tmp_path):
    f = tmp_path / "cgroup"
    f.write_text("4:memory:/x\n0::/user.slice/session-1.scope\n")
    assert _own_v2_path(f) == "user.slice/session-1.scope"
    f.write_text("0::/\n")
    assert _own_v2_path(f) == ""
    assert _own_v2_path(tmp_path / "missing") is None


@requires_bwrap
def test_action_cpu_time_is_measured_through_the_sandbox(make_ws):
    accounting = CpuAccounting.probe()
    if accounting is None:
        pytest.skip(no_cgroup_reason())
    ws = make_ws(BURN)
    run = ws.build("//p:burn")
    assert run.rc == 0, run.output
    burn = action(run.json, "//p:burn")
    assert 0.4 <= burn["cpu_s"] <= 2 * burn["duration_s"] + 0.5  # what the grandchild burnt, no more than 2 cores
    assert run.json["cpu_s"] == burn["cpu_s"]
    # A --check re-execution measures it again; each action's group is gone after it.
    again = ws.build("//p:burn", args=("--check",))
    assert again.rc == 0 and action(again.json, "//p:burn")["cpu_s"] >= 0.4
    stale = [g for g in accounting.base.iterdir()
             if g.is_dir() and g.name.partition("-")[0].isdigit()
             and not Path(f"/proc/{g.name.partition('-')[0]}").exists()]
    assert stale == []
    # People read it in the build log, with the peak memory, and in the summary line.
    human = ws.cli("build", "--check", "//p:burn")
    assert human.rc == 0, human.stderr
    assert re.search(r"actions' CPU \d+\.\ds", human.stderr)
    log = Path(re.search(r"executed actions and their reasons: (\S+)", human.stderr).group(1))
    assert re.search(r"ran //p:burn genrule \(\d+\.\d\ds, CPU \d+\.\d\ds, peak \d+ MiB\) — ", log.read_text())


# -- memory -------------------------------------------------------------------------------------------
def test_memory_peak_leaves_out_the_page_cache_the_action_still_holds(tmp_path):
    """The kernel's peak counts page cache (files read first or written); what the group still
    holds of it at the end is taken off. tmpfs (shmem) is memory, and stays counted."""
    from build_graph.cgroups import MemoryAccounting

    v1 = tmp_path / "v1"
    v1.mkdir()
    (v1 / "memory.max_usage_in_bytes").write_text(str(700 << 20) + "\n")
    (v1 / "memory.stat").write_text(f"cache {250 << 20}\nrss 0\nshmem {50 << 20}\n"
                                    f"total_cache {250 << 20}\ntotal_rss 0\ntotal_shmem {50 << 20}\n")
    assert MemoryAccounting(tmp_path, 1).peak_mb(v1) == 700 - 200
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "memory.peak").write_text(str((300 << 20) + 1) + "\n")
    (v2 / "memory.stat").write_text(f"anon 0\nfile {100 << 20}\nkernel 4096\nshmem {100 << 20}\n")
    assert MemoryAccounting(tmp_path, 2).peak_mb(v2) == 301  # rounded up: 0 would read as unmeasured
    assert MemoryAccounting(tmp_path, 2).peak_mb(tmp_path / "gone") is None


def test_memory_groups_are_made_below_bgraphs_own_memory_cgroup(tmp_path):
    """cgroup v1: under this process's own memory cgroup (its limit keeps holding the actions),
    and the action joins the cpuacct group and the memory group both."""
    from build_graph.cgroups import (
        Accounting,
        CpuAccounting,
        MemoryAccounting,
        _own_v1_path,
    )

    (tmp_path / "cgroup").write_text("4:memory:/ci/job-7\n3:cpu,cpuacct:/\n0::/\n")
    assert _own_v1_path(tmp_path / "cgroup", "memory") == "ci/job-7"
    assert _own_v1_path(tmp_path / "cgroup", "cpuacct") == ""
    assert _own_v1_path(tmp_path / "cgroup", "pids") is None
    root = tmp_path / "sys"
    (root / "memory" / "ci" / "job-7").mkdir(parents=True)
    (root / "memory" / "memory.max_usage_in_bytes").write_text("0\n")
    # Not a cgroup file system, so nothing can be started in a group here: no accounting.
    assert MemoryAccounting.probe(root=root, self_cgroup=tmp_path / "cgroup") is None
    root = tmp_path / "sys2"  # a fake hierarchy in which groups are plain directories
    accounting = Accounting(CpuAccounting(root / "cpuacct" / "bgraph", 1),
                            MemoryAccounting(root / "memory" / "ci" / "job-7" / "bgraph", 1))
    (root / "cpuacct" / "bgraph").mkdir(parents=True)
    (root / "memory" / "ci" / "job-7" / "bgraph").mkdir(parents=True)
    groups = accounting.new_groups()
    assert set(groups) == {"cpu", "memory"} and groups["memory"].parent == root / "memory/ci/job-7/bgraph"
    argv = accounting.wrap(groups, ["bwrap", "--", "cc"])
    assert argv[-3:] == ["bwrap", "--", "cc"]
    assert {str(groups["cpu"] / "cgroup.procs"), str(groups["memory"] / "cgroup.procs")} <= set(argv)
    accounting.remove(groups)
    assert not groups["cpu"].exists() and not groups["memory"].exists()
    # cgroup v2: one group per action for both (a process is in one v2 group only).
    shared = Accounting(CpuAccounting(root / "v2" / "bgraph-actions", 2), MemoryAccounting(root / "v2" / "bgraph-actions", 2))
    (root / "v2" / "bgraph-actions").mkdir(parents=True)
    groups = shared.new_groups()
    assert groups["cpu"] == groups["memory"] and accounting.wrap(groups, ["x"]).count(str(groups["cpu"] / "cgroup.procs")) == 1
    shared.remove(groups)


def test_the_join_script_starts_the_command_in_each_group(tmp_path):
    """The action's first process writes its pid into every group's cgroup.procs, then execs."""
    from build_graph.cgroups import _wrap

    a, b = tmp_path / "a.procs", tmp_path / "b.procs"
    out = __import__("subprocess").run(_wrap([a, b], ["/bin/sh", "-c", 'echo "$$ $1"', "sh", "-- x"]),
                                       capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    pid, arg = out.stdout.split(" ", 1)
    assert a.read_text().strip() == b.read_text().strip() == pid  # the same process, which became the command
    assert arg.strip() == "-- x"
    failing = __import__("subprocess").run(_wrap([tmp_path / "missing" / "procs"], ["/bin/true"]), capture_output=True)
    assert failing.returncode == 125


@requires_bwrap
def test_action_memory_is_measured_through_a_memory_cgroup(make_ws):
    from build_graph.cgroups import Accounting

    accounting = Accounting.probe()
    if accounting.memory is None:
        pytest.skip(no_cgroup_reason().replace("per-action CPU time is untested (reported as 0)",
                                               "per-action memory is sampled, not measured through a cgroup"))
    ws = make_ws({"targets/p.toml": '''[tmpfs]
kind = "genrule"
outs = ["o.txt"]
cmd = "head -c 200000000 /dev/zero > /tmp/big && head -c 100000000 /dev/zero > $OUT/o.txt"
'''})
    run = ws.build("//p:tmpfs")
    assert run.rc == 0, run.output
    # 190 MiB in the sandbox's tmpfs /tmp is memory; the 95 MiB output file is page cache.
    assert 180 <= action(run.json, "//p:tmpfs")["peak_mb"] <= 250, run.json
    left = [g for g in accounting.memory.base.iterdir() if g.is_dir()
            and g.name.partition("-")[0].isdigit() and not Path(f"/proc/{g.name.partition('-')[0]}").exists()]
    assert left == []


# -- limits (red-team K14 hole 3) -----------------------------------------------------------------
# many: 40 processes at once, ok only when every one could be started; stuck: 100 threads waiting
# on an event never set (Python waits for them at exit: it never ends by itself).
MANY = {"targets/p.toml": '''[many]
kind = "genrule"
outs = ["o.txt"]
cmd = "for i in $(seq 40); do sleep 1 & done; wait; echo ok > $OUT/o.txt"

[stuck]
kind = "genrule"
outs = ["o.txt"]
cmd = "/usr/bin/python3 -c 'import threading\\ne = threading.Event()\\nfor i in range(100): threading.Thread(target=e.wait).start()'; echo ok > $OUT/o.txt"

[tmpfs]
kind = "genrule"
outs = ["o.txt"]
cmd = "head -c 300000000 /dev/zero > /tmp/big; echo ok > $OUT/o.txt"
'''}


def test_limits_of_the_host_and_their_overrides():
    from build_graph.cgroups import ACTION_TASKS, Limits, _host_tasks
    from build_graph.errors import UsageError

    limits = Limits.of_host({}, memory_mb=16384)
    # All bgraphs' actions: 3/4 of the host; one build's: half of that; one action: 3/4 of its build's.
    assert limits.host_tasks == int(_host_tasks() * 3 / 4) and limits.all_tasks == limits.host_tasks // 2
    assert limits.tasks == limits.action_tasks == min(ACTION_TASKS, int(limits.all_tasks * 3 / 4))
    assert limits.all_memory_mb == limits.memory_mb == 16384 - 2048  # an eighth kept for bgraph
    assert Limits.of_host({}, memory_mb=4096).all_memory_mb == 4096 - 1024  # at least 1 GiB kept
    small = Limits.of_host({"BGRAPH_ACTION_TASKS": "16", "BGRAPH_ACTION_MEMORY_MB": "64"}, memory_mb=16384)
    assert (small.tasks, small.memory_mb, small.all_memory_mb) == (16, 64, 14336)
    # An action's own limit never above all actions' together.
    big = Limits.of_host({"BGRAPH_ACTION_TASKS": str(10 ** 9), "BGRAPH_ACTION_MEMORY_MB": str(10 ** 9)}, 16384)
    assert (big.tasks, big.memory_mb) == (int(big.all_tasks * 3 / 4), 14336)
    for bad in ("x", "0", "-3", "1.5"):
        with pytest.raises(UsageError) as e:
            Limits.of_host({"BGRAPH_ACTION_TASKS": bad})
        assert "BGRAPH_ACTION_TASKS" in str(e.value) and "hint:" in str(e.value)


def test_a_digit_that_is_no_number_is_one_line_with_the_variables_hint():
    """Red-team K16 hole 7: '²' is a digit to str.isdigit, not to int(): every action failed
    with a ValueError instead of the variable's own line."""
    from build_graph.cgroups import Limits
    from build_graph.errors import UsageError

    for name in ("BGRAPH_ACTION_TASKS", "BGRAPH_ACTION_MEMORY_MB"):
        for bad in ("\u00b2", "1\u00b3", "\u2460"):
            with pytest.raises(UsageError) as e:
                Limits.of_host({name: bad}, memory_mb=16384)
            assert f"{name}={bad!r} is not a whole number of at least 1" in str(e.value) and "hint:" in str(e.value)
    assert Limits.of_host({"BGRAPH_ACTION_TASKS": "\u0663\u0662"}).tasks == 32  # decimal digits int() takes


def test_each_actions_groups_get_its_limits(tmp_path):
    """In a fake hierarchy (groups are plain directories): the pids and memory groups are
    written their limits; a fork refused or an OOM kill in them is one failure naming the limit."""
    from build_graph.cgroups import (
        Accounting,
        CpuAccounting,
        Limits,
        MemoryAccounting,
        PidsLimit,
    )
    from build_graph.errors import ActionFailed

    root = tmp_path / "sys"
    for d in ("cpuacct/bgraph", "memory/bgraph", "pids/bgraph", "v2/bgraph-actions"):
        (root / d).mkdir(parents=True)
    limits = Limits(tasks=100, all_tasks=1000, memory_mb=64, all_memory_mb=512)
    accounting = Accounting(CpuAccounting(root / "cpuacct/bgraph", 1), MemoryAccounting(root / "memory/bgraph", 1),
                            PidsLimit(root / "pids/bgraph", 1), limits)
    groups = accounting.new_groups()
    assert set(groups) == {"cpu", "memory", "pids"} and groups["pids"].parent == root / "pids/bgraph"
    assert (groups["pids"] / "pids.max").read_text() == "100"
    assert (groups["memory"] / "memory.limit_in_bytes").read_text() == str(64 << 20)
    assert str(groups["pids"] / "cgroup.procs") in accounting.wrap(groups, ["x"])
    (groups["cpu"] / "cpuacct.usage").write_text("2000000000\n")
    (groups["pids"] / "pids.events").write_text("max 0\n")
    (groups["memory"] / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 0\n")
    assert accounting.limit_hit(groups) is None and accounting.cpu_s(groups) == 2.0
    (groups["pids"] / "pids.events").write_text("max 3\n")
    hit = accounting.limit_hit(groups)  # what the sandbox asks once the process has ended
    assert isinstance(hit, ActionFailed) and accounting.cpu_s(groups) == 2.0
    assert "task limit" in hit.message and "100 at once" in hit.message
    assert "BGRAPH_ACTION_TASKS" in hit.hint and "\n" not in hit.message
    (groups["pids"] / "pids.events").write_text("max 0\n")
    (groups["memory"] / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 1\n")
    hit = accounting.limit_hit(groups)
    assert "killed for memory" in hit.message and "64 MiB" in hit.message and "BGRAPH_ACTION_MEMORY_MB" in hit.hint
    accounting.remove(groups)
    # cgroup v2: one group for all three; memory.max and memory.events.
    v2 = Accounting(CpuAccounting(root / "v2/bgraph-actions", 2), MemoryAccounting(root / "v2/bgraph-actions", 2),
                    PidsLimit(root / "v2/bgraph-actions", 2), limits)
    groups = v2.new_groups()
    assert groups["cpu"] == groups["memory"] == groups["pids"]
    assert (groups["pids"] / "memory.max").read_text() == str(64 << 20) and (groups["pids"] / "pids.max").read_text() == "100"
    (groups["pids"] / "pids.events").write_text("max 0\n")
    (groups["pids"] / "memory.events").write_text("low 0\nhigh 0\nmax 5\noom 1\noom_kill 1\n")
    assert "killed for memory" in v2.limit_hit(groups).message
    v2.remove(groups)


def test_a_host_without_pids_groups_gets_none(tmp_path):
    from build_graph.cgroups import PidsLimit

    (tmp_path / "cgroup").write_text("4:memory:/x\n0::/\n")
    assert PidsLimit.probe(root=tmp_path / "sys", self_cgroup=tmp_path / "cgroup") is None


def _limited_accounting():
    from build_graph.cgroups import Accounting

    accounting = Accounting.probe()
    if accounting.pids is None or accounting.memory is None:
        pytest.skip("no pids or memory cgroup here: actions' limits are untested. " + no_cgroup_reason())
    return accounting


@requires_bwrap
def test_an_action_over_its_task_limit_fails_with_one_line(make_ws):
    accounting = _limited_accounting()
    assert accounting.limits.all_tasks < int(Path("/proc/sys/kernel/pid_max").read_text())
    ws = make_ws(MANY)
    # A limit of 16 (bwrap and the shell take 3): the 40 sleeps cannot all start.
    run = ws.build("//p:many", env={"BGRAPH_ACTION_TASKS": "16"})
    assert run.rc != 0, run.output
    assert "stopped at its task limit: a new process or thread was refused (16 at once for one action" in run.output
    assert "hint: an action that needs more: set BGRAPH_ACTION_TASKS" in run.output
    assert "Traceback" not in run.output
    # Threads waiting on one that could not start: the action would never end by itself.
    start = time.monotonic()
    stuck = ws.cli("build", "--json", "//p:stuck", env={"BGRAPH_ACTION_TASKS": "16"}, timeout=60)
    assert stuck.rc != 0 and "stopped at its task limit" in stuck.output, stuck.output
    assert time.monotonic() - start < 30
    bad = ws.build("//p:many", env={"BGRAPH_ACTION_TASKS": "lots"})
    assert bad.rc != 0 and "BGRAPH_ACTION_TASKS='lots' is not a whole number of at least 1" in bad.output
    assert "Traceback" not in bad.output
    # The default limit lets it run; its group is gone after it.
    ok = ws.build("//p:many")
    assert ok.rc == 0, ok.output
    left = [g for g in accounting.pids.base.iterdir() if g.is_dir()
            and g.name.partition("-")[0].isdigit() and not Path(f"/proc/{g.name.partition('-')[0]}").exists()]
    assert left == []


@requires_bwrap
def test_an_action_over_its_memory_limit_is_killed_and_fails_with_one_line(make_ws):
    _limited_accounting()
    ws = make_ws(MANY)
    # 286 MiB into the sandbox's tmpfs /tmp (memory, not reclaimable) with a limit of 64 MiB.
    run = ws.build("//p:tmpfs", env={"BGRAPH_ACTION_MEMORY_MB": "64"})
    assert run.rc != 0, run.output
    assert "killed for memory: a process went over its memory limit (64 MiB for one action" in run.output
    assert "Traceback" not in run.output
    ok = ws.build("//p:tmpfs")
    assert ok.rc == 0, ok.output


# -- red-team K16: stale names, one build's cap, the kill ---------------------------------------
# Starts threads (each a task) until one is refused, says how many it started, holds them for
# argv[1] seconds, then ends by itself: nothing is left behind for the host's init to reap.
THREADS = ("import sys, threading, time\ne = threading.Event()\nn = 0\ntry:\n"
           "    while n < 1000:\n        threading.Thread(target=e.wait).start()\n        n += 1\n"
           "except RuntimeError:\n    pass\nprint(n, flush=True)\ntime.sleep(float(sys.argv[1]))\ne.set()\n")


def _real_pids_root() -> Path:
    root = Path("/sys/fs/cgroup/pids")
    if not (root / "cgroup.procs").exists() or not os.access(root, os.W_OK):
        pytest.skip("no writable cgroup v1 pids hierarchy here: " + no_cgroup_reason())
    return root


@pytest.fixture
def private_pids_base():
    """A private pids group standing for the shared `base` of all bgraphs (cap 40), removed after."""
    base = _real_pids_root() / f"bgraph-test-{os.getpid()}-{secrets.token_hex(3)}"
    base.mkdir()
    (base / "pids.max").write_text("40")
    yield base
    deadline = time.monotonic() + 10
    while base.exists() and time.monotonic() < deadline:
        for own in [d for d in base.iterdir() if d.is_dir()]:
            for group in [d for d in own.iterdir() if d.is_dir()]:
                _kill(group)
                group.rmdir() if not (group / "cgroup.procs").read_text().split() else None
            if not [d for d in own.iterdir() if d.is_dir()]:
                own.rmdir()
        try:
            base.rmdir()
        except OSError:
            time.sleep(0.1)


def _threads(groups_or_group, accounting: Accounting | None, hold_s: float) -> subprocess.Popen:
    argv = ["/usr/bin/python3", "-c", THREADS, str(hold_s)]
    if accounting is not None:
        argv = accounting.wrap(groups_or_group, argv)
    else:
        argv = _wrap([groups_or_group / "cgroup.procs"], argv)
    return subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)


def test_a_killed_bgraphs_groups_of_a_reused_pid_neither_drop_a_limit_nor_fail_an_action():
    """Red-team K16 hole 1: groups "<pid>-<n>" that a SIGKILLed bgraph left, with the pid now
    this process's, made the pids probe fail without a word (no task limit at all) or the first
    action fail with FileExistsError."""
    root = _real_pids_root()
    base = root / "bgraph"
    base.mkdir(exist_ok=True)
    first = next(cgroups._IDS)
    left = [base / f"{os.getpid()}-{n}" for n in range(first, first + 64)]
    for group in left:
        group.mkdir()
    try:
        accounting = Accounting.probe(environ={"BGRAPH_ACTION_TASKS": "16"})
        assert accounting.pids is not None and accounting.limits.tasks == 16
        groups = accounting.new_groups()
        try:
            proc = _threads(groups, accounting, 0)
            out, _ = proc.communicate(timeout=30)
            assert int(out) < 16  # the limit holds
            hit = accounting.limit_hit(groups)
            assert hit is not None and "stopped at its task limit" in hit.message and "16 at once" in hit.message
            assert groups["pids"].parent.parent == base and groups["pids"].parent.name.startswith(f"{os.getpid()}-")
        finally:
            accounting.remove(groups)
        assert all(group.exists() for group in left)  # another process's, as far as it can tell: kept
    finally:
        for group in left:
            group.rmdir()


def test_stale_groups_are_told_by_start_time_and_go_with_what_they_hold(tmp_path):
    """A process's own group is "<pid>-<start time>-<random>": one whose pid now names another
    process (another start time) is stale, with the action groups in it; legacy "<pid>-<n>"
    groups go when their pid is gone."""
    base = tmp_path / "bgraph"
    me, start, ns = os.getpid(), cgroups._start_time(os.getpid()), cgroups._pid_namespace()
    mine = base / f"{me}-{start}-{ns}-abcd0123"
    reused = base / f"{me}-{int(start) + 1}-{ns}-abcd0123"
    dead = base / f"999999999-5-{ns}-00000000"
    foreign = base / "999999999-5-1234abc-00000000"  # another PID namespace's: not judged here
    legacy_dead, legacy_live = base / "999999999-3", base / f"{me}-3"
    for group in (mine / "0", reused / "0", reused / "1", dead / "7", foreign / "1", legacy_dead, legacy_live):
        group.mkdir(parents=True)
    cgroups.PidsLimit(base, 1, own=True).remove_stale()
    assert sorted(p.name for p in base.iterdir()) == sorted([mine.name, foreign.name, legacy_live.name])
    # Names never collide with what is there: the own group and an action group on EEXIST.
    pids = cgroups.PidsLimit(tmp_path / "fresh", 1, own=True)
    (tmp_path / "fresh").mkdir()
    own = pids.own_group()
    assert own.name.startswith(f"{me}-{start}-") and own.parent == tmp_path / "fresh"
    taken = own / str(next(cgroups._IDS) + 1)
    taken.mkdir()
    a, b = pids.new_group(), pids.new_group()
    assert len({a, b, taken}) == 3 and a.parent == b.parent == own
    # The own group removed under it (by hand, or a bgraph of a PID namespace that misjudged it):
    # made again, and its caps set again on the next action's groups.
    accounting = Accounting(None, None, pids, cgroups.Limits(8, 20, 0, 0, 40))
    groups = accounting.new_groups()
    assert (pids.own_group() / "pids.max").read_text() == "20" and (groups["pids"] / "pids.max").read_text() == "8"
    __import__("shutil").rmtree(own)  # plain directories here: files and all
    groups = accounting.new_groups()
    again = pids.own_group()
    assert again.is_dir() and (again / "pids.max").read_text() == "20"
    assert groups["pids"].parent == again


def test_a_pids_hierarchy_that_cannot_be_used_is_said_once(tmp_path, capsys):
    """Where the host has the controller but bgraph cannot use it (here: plain files give no
    figure), the task limit is not dropped without a word."""
    (tmp_path / "cgroup").write_text("8:pids:/\n0::/\n")
    root = tmp_path / "sys"
    (root / "pids").mkdir(parents=True)
    (root / "pids" / "cgroup.procs").write_text("")
    for _ in range(2):
        assert cgroups.PidsLimit.probe(root=root, self_cgroup=tmp_path / "cgroup") is None
    err = capsys.readouterr().err
    assert err.count("warning: actions run without a task limit: the pids cgroup cannot be used (") == 1, err


def test_one_builds_actions_cannot_take_another_builds_tasks(private_pids_base):
    """Red-team K16 hole 2: all bgraphs' actions shared one cap, so one build's fork bomb made
    another build's action fail, blamed on that action's own limit. Each process now has its own
    group, capped at half the shared one (here 20 of 40): this process's actions fill its cap
    (one at its own limit, one refused by the build's cap, each told so), while another bgraph
    process's action starts all 19 threads its own limit allows."""
    limits = cgroups.Limits(tasks=1000, all_tasks=20, memory_mb=0, all_memory_mb=0, host_tasks=40)
    assert limits.action_tasks == 15
    pids = cgroups.PidsLimit(private_pids_base, 1, own=True)
    accounting = Accounting(None, None, pids, limits)
    one = accounting.new_groups()
    assert (pids.own_group() / "pids.max").read_text().strip() == "20"
    first = _threads(one, accounting, 3)
    assert int(first.stdout.readline()) == 14  # its own 15: python (the join's sh became it) and 14 threads
    two = accounting.new_groups()
    second = _threads(two, accounting, 3)
    assert int(second.stdout.readline()) == 4  # the build's cap (20) reached, under its own 15
    other = subprocess.run(
        [sys.executable, "-c", OTHER_BUILD, str(private_pids_base), THREADS],
        capture_output=True, text=True, timeout=60, check=False, env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)})
    assert other.returncode == 0, other.stderr
    started, hit = other.stdout.split("|")
    # All of its own 20 (1 + 19 threads): the shared 40 still had them; refused at its own limit, and told so.
    assert int(started) == 19 and hit.strip().startswith("stopped at its task limit"), other.stdout
    for proc in (first, second):
        proc.wait(timeout=30)
    own_hit, cap_hit = accounting.limit_hit(one), accounting.limit_hit(two)
    assert own_hit is not None and own_hit.message.startswith("stopped at its task limit"), own_hit
    assert "BGRAPH_ACTION_TASKS" in own_hit.hint
    assert cap_hit is not None and cap_hit.message.startswith("stopped at the all-actions task cap"), cap_hit
    assert "under its limit of 15" in cap_hit.message and "reached 20" in cap_hit.message and "-j" in cap_hit.hint
    for groups in (one, two):
        accounting.remove(groups)


# Another bgraph process: its own group below the same shared base; one action of up to 20 tasks.
OTHER_BUILD = '''import sys
from pathlib import Path
from build_graph import cgroups
pids = cgroups.PidsLimit(Path(sys.argv[1]), 1, own=True)
accounting = cgroups.Accounting(None, None, pids, cgroups.Limits(1000, 20, 0, 0, 40))
groups = accounting.new_groups()
pids.limit(groups["pids"], 20)
import subprocess
out = subprocess.run(accounting.wrap(groups, ["/usr/bin/python3", "-c", sys.argv[2], "0"]), capture_output=True, text=True)
print(out.stdout.strip(), "|", accounting.limit_hit(groups).message)
accounting.remove(groups)
'''


def test_the_kill_reaches_only_processes_still_in_the_group(private_pids_base):
    """v1 has no cgroup.kill: each listed process is pinned (a pidfd) and killed only if the
    group still lists it, so a pid that ended and was reused outside meanwhile is never hit."""
    group = private_pids_base / "g"
    group.mkdir()
    inside = subprocess.Popen(_wrap([group / "cgroup.procs"], ["/bin/sleep", "30"]))
    outside = subprocess.Popen(["/bin/sleep", "30"])
    try:
        deadline = time.monotonic() + 10
        while not (group / "cgroup.procs").read_text().split() and time.monotonic() < deadline:
            time.sleep(0.01)
        real = cgroups._procs

        def listing(g):  # the first listing also names `outside`, as a reused pid would look
            cgroups._procs = real
            return real(g) + [outside.pid]

        cgroups._procs = listing
        try:
            _kill(group)
        finally:
            cgroups._procs = real
        assert inside.wait(timeout=10) == -9
        assert outside.poll() is None
    finally:
        outside.kill()
        outside.wait()
        inside.kill()
        inside.wait()
