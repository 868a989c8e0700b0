"""Per-action CPU time through cgroups (the sandbox's processes are invisible to child rusage)."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from bgraph_testlib import action, requires_bwrap
from build_graph.cgroups import CpuAccounting, _own_v2_path

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
    from build_graph.cgroups import Accounting, CpuAccounting, MemoryAccounting, _own_v1_path

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
    assert limits.all_tasks == int(_host_tasks() * 3 / 4) and limits.tasks == min(ACTION_TASKS, limits.all_tasks)
    assert limits.all_memory_mb == limits.memory_mb == 16384 - 2048  # an eighth kept for bgraph
    assert Limits.of_host({}, memory_mb=4096).all_memory_mb == 4096 - 1024  # at least 1 GiB kept
    small = Limits.of_host({"BGRAPH_ACTION_TASKS": "16", "BGRAPH_ACTION_MEMORY_MB": "64"}, memory_mb=16384)
    assert (small.tasks, small.memory_mb, small.all_memory_mb) == (16, 64, 14336)
    # An action's own limit never above all actions' together.
    big = Limits.of_host({"BGRAPH_ACTION_TASKS": str(10 ** 9), "BGRAPH_ACTION_MEMORY_MB": str(10 ** 9)}, 16384)
    assert (big.tasks, big.memory_mb) == (big.all_tasks, 14336)
    for bad in ("x", "0", "-3", "1.5"):
        with pytest.raises(UsageError) as e:
            Limits.of_host({"BGRAPH_ACTION_TASKS": bad})
        assert "BGRAPH_ACTION_TASKS" in str(e.value) and "hint:" in str(e.value)


def test_each_actions_groups_get_its_limits(tmp_path):
    """In a fake hierarchy (groups are plain directories): the pids and memory groups are
    written their limits; a fork refused or an OOM kill in them is one failure naming the limit."""
    from build_graph.cgroups import Accounting, CpuAccounting, Limits, MemoryAccounting, PidsLimit
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
