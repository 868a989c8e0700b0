"""`bgraph build --profile`: the build's timeline in the Chrome trace event format."""

from __future__ import annotations

import json

from bgraph_testlib import requires_bwrap
from build_graph.profile import Profile

# Two independent one-second actions: at -j2 they overlap.
PARALLEL = {
    "targets/p.toml": "".join(
        f'[{n}]\nkind = "genrule"\nouts = ["o"]\ncmd = "sleep 1; echo {n} > o"\n\n' for n in ("x", "y")),
}


def test_actions_are_packed_into_the_fewest_lanes_and_phases_stay_in_theirs():
    p = Profile(jobs=2)
    t = p.origin
    p.action("a", t + 0.0, {"process_start": t + 0.1, "process_end": t + 0.9, "executed": t + 1.0}, t + 1.1)
    p.action("b", t + 0.2, {"process_start": t + 0.3, "process_end": t + 0.5, "executed": t + 0.6}, t + 0.7)
    p.action("c", t + 0.8, {"process_start": t + 0.85, "process_end": t + 1.0, "executed": t + 1.0}, t + 1.0)
    p.plan("plan //p:a", t)
    events = [e for e in p.chrome_trace()["traceEvents"] if e["ph"] == "X"]
    lane = {e["name"]: e["tid"] for e in events if e["cat"] == "action"}
    assert lane["a"] != lane["b"] and lane["c"] == lane["b"]  # c starts after b ended: b's lane is free
    assert {e["tid"] for e in events if e["cat"] == "plan"} == {0}
    phases = [e for e in events if e["cat"] in ("sandbox", "process", "store")]
    assert len(phases) == 3 * 4
    for e in phases:  # each phase lies inside an action of its own lane
        assert any(a["tid"] == e["tid"] and a["ts"] <= e["ts"] and e["ts"] + e["dur"] <= a["ts"] + a["dur"]
                   for a in events if a["cat"] == "action")
    summary = p.summary(wall_s=1.1)
    assert summary["actions"] == 3
    assert abs(summary["process_s"] - (0.8 + 0.2 + 0.15)) < 1e-6
    assert abs(summary["sandbox_and_store_s"] - (1.1 + 0.5 + 0.2 - 1.15)) < 1e-6
    assert summary["lanes_busy"] == round((1.1 + 0.5 + 0.2) / (1.1 * 2), 3)


@requires_bwrap
def test_build_writes_a_chrome_trace_of_what_ran(make_ws, tmp_path):
    ws = make_ws(PARALLEL)
    trace = tmp_path / "profile.json"
    run = ws.build("//p:x", "//p:y", args=("-j2", "--profile", str(trace)))
    assert run.rc == 0, run.stderr
    events = json.loads(trace.read_text())["traceEvents"]
    actions = {e["name"]: e for e in events if e.get("cat") == "action"}
    assert set(actions) == {f"{a['label']} {a['name']}" for a in run.json["actions"]} and len(actions) == 2
    x, y = actions.values()
    assert x["tid"] != y["tid"] and x["ts"] < y["ts"] + y["dur"] and y["ts"] < x["ts"] + x["dur"]  # they overlapped
    processes = [e for e in events if e.get("cat") == "process"]
    assert len(processes) == 2 and all(e["dur"] >= 1_000_000 for e in processes)  # the sleeps, in µs
    assert any(e.get("cat") == "plan" and e["name"] == "plan //p:x" for e in events)
    assert {e["args"]["name"] for e in events if e["ph"] == "M"} >= {"planning and cache checks", "action lane 1"}
    profile = run.json["profile"]
    assert profile["actions"] == 2 and profile["process_s"] >= 2.0 and 0 < profile["lanes_busy"] <= 1

    # People get one line about it; a cached build's profile holds planning and no actions.
    again = ws.cli("build", "--profile", str(trace), "//p:x", "//p:y")
    assert again.rc == 0 and "profile:" in again.stderr and str(trace) in again.stderr
    events = json.loads(trace.read_text())["traceEvents"]
    assert not [e for e in events if e.get("cat") == "action"]
    assert [e for e in events if e.get("cat") == "plan"]


@requires_bwrap
def test_an_unwritable_profile_path_is_refused_before_anything_runs(make_ws, tmp_path):
    ws = make_ws(PARALLEL)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    run = ws.cli("build", "--profile", str(blocker / "profile.json"), "//p:x")
    assert run.rc == 2 and "Traceback" not in run.stderr
    assert f"cannot write the profile to {blocker / 'profile.json'}" in run.stderr and "hint:" in run.stderr
    assert not (ws.cache / "v1").exists() or not ws.ac_entries()  # nothing ran
