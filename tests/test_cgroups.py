"""Per-action CPU time through cgroups (the sandbox's processes are invisible to child rusage)."""

from __future__ import annotations

import re
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
