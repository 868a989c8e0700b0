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
        pytest.skip("this host lets bgraph make no cgroup (CPU time is then reported as 0)")
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
