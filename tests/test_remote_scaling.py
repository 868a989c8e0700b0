"""bench/remote_scaling.py's simulation on a toy graph whose answers are known by hand."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import networkx as nx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import remote_scaling as rs

FREE = {"worker_bw": math.inf, "server_bw": math.inf, "client_bw": math.inf, "latency_s": 0.0}


def toy() -> nx.DiGraph:
    """a(2) -> b(3) -> d(1), a -> c(5) -> d, e(4) alone: sum 15, critical path a-c-d = 8."""
    g = nx.DiGraph()
    for i, (n, s) in enumerate([("a", 2.0), ("b", 3.0), ("c", 5.0), ("d", 1.0), ("e", 4.0)]):
        g.add_node(n, seconds=s, remote=True, reads=(), writes=None, order=i)
    g.add_edges_from([("a", "b"), ("a", "c"), ("b", "d"), ("c", "d")])
    return g


def test_critical_path_by_hand():
    length, path = rs.critical_path(toy())
    assert (length, path) == (8.0, ["a", "c", "d"])
    assert rs.critical_path(toy(), overhead_s=0.5)[0] == 9.5  # three remote actions on it


def test_one_worker_is_the_sum_and_many_the_critical_path():
    g = toy()
    assert rs.simulate(g, {}, rs.Params(workers=1, overhead_s=0.0, **FREE))["wall_s"] == 15.0
    assert rs.simulate(g, {}, rs.Params(workers=1, overhead_s=0.25, **FREE))["wall_s"] == 15.0 + 5 * 0.25
    many = rs.simulate(g, {}, rs.Params(workers=64, overhead_s=0.25, **FREE))
    assert many["wall_s"] == 8.0 + 3 * 0.25  # a, c, d each pay the overhead
    # slots are workers too: 1 worker x 64 slots is as wide as 64 workers
    assert rs.simulate(g, {}, rs.Params(workers=1, slots=64, overhead_s=0.25, **FREE))["wall_s"] == many["wall_s"]


def test_latency_delays_dependents_but_holds_no_worker():
    """Latency 0.5 s per remote action: on the critical path a-c-d each adds it; three independent
    1 s actions on one worker run back to back, and only the last one's latency shows."""
    p = {**FREE, "latency_s": 0.5}
    assert rs.simulate(toy(), {}, rs.Params(workers=64, overhead_s=0.25, **p))["wall_s"] == 8.0 + 3 * 0.75
    g = nx.DiGraph()
    for i, n in enumerate("xyz"):
        g.add_node(n, seconds=1.0, remote=True, reads=(), writes=None, order=i)
    assert rs.simulate(g, {}, rs.Params(workers=1, overhead_s=0.0, **p))["wall_s"] == 3.5


def test_two_workers_by_hand():
    """2 workers. FIFO: a and e start at 0; at 2 b (listed first) takes a's worker until 5, c waits
    for e's until 4 and ends at 9; d 9-10. Longest path first: c at 2 (ends 7), b at 4 (ends 7), d 7-8."""
    assert rs.simulate(toy(), {}, rs.Params(workers=2, overhead_s=0.0, **FREE))["wall_s"] == 10.0
    assert rs.simulate(toy(), {}, rs.Params(workers=2, overhead_s=0.0, priority="critical", **FREE))["wall_s"] == 8.0


def test_critical_path_first_beats_fifo_where_order_matters():
    """x(1), y(1) and z(10) are all ready at 0, z listed last. On 2 workers FIFO runs x and y
    first (z from 1: wall 11); longest-path-first runs z at once (wall 10)."""
    g = nx.DiGraph()
    for i, (n, s) in enumerate([("x", 1.0), ("y", 1.0), ("z", 10.0)]):
        g.add_node(n, seconds=s, remote=True, reads=(), writes=None, order=i)
    fifo = rs.simulate(g, {}, rs.Params(workers=2, overhead_s=0.0, **FREE))["wall_s"]
    crit = rs.simulate(g, {}, rs.Params(workers=2, overhead_s=0.0, priority="critical", **FREE))["wall_s"]
    assert (fifo, crit) == (11.0, 10.0)


def test_transfers_at_a_stated_bandwidth():
    """p writes 100 bytes that q reads; a toolchain of 300 bytes exists before the build. At 100 B/s
    on every link, one worker: the client uploads the toolchain (3 s), the worker fetches it (3 s),
    p runs (1 s), uploads its output (1 s), the client fetches it (1 s); q needs nothing new (the
    worker holds both), runs (1 s), uploads (1 s), the client fetches it (1 s) = 12 s."""
    g = nx.DiGraph()
    g.add_node("p", seconds=1.0, remote=True, reads=("tc",), writes="out:p", order=0)
    g.add_node("q", seconds=1.0, remote=True, reads=("tc", "out:p"), writes="out:q", order=1)
    g.add_edge("p", "q")
    units = {"tc": {"t": 300}, "out:p": {"p": 100}, "out:q": {"q": 100}}
    slow = {"worker_bw": 100.0, "server_bw": 100.0, "client_bw": 100.0, "overhead_s": 0.0, "latency_s": 0.0}
    r = rs.simulate(g, units, rs.Params(workers=1, **slow))
    assert r["wall_s"] == 12.0 and r["worker_download_bytes"] == 300
    # warm workers already hold the toolchain: 6 s less
    assert rs.simulate(g, units, rs.Params(workers=1, warm=True, **slow))["wall_s"] == 6.0


def test_a_shared_link_serialises_two_downloads():
    """Two independent actions on two cold workers both fetch a 100-byte toolchain over a server
    link of 100 B/s: the second fetch waits for the first (1 s + 1 s), then runs 1 s = 3 s."""
    g = nx.DiGraph()
    for i, n in enumerate("uv"):
        g.add_node(n, seconds=1.0, remote=True, reads=("tc",), writes=None, order=i)
    units = {"tc": {"t": 100}}
    r = rs.simulate(g, units, rs.Params(workers=2, overhead_s=0.0, latency_s=0.0, worker_bw=math.inf,
                                        server_bw=100.0, client_bw=math.inf))
    assert r["wall_s"] == 3.0 and r["worker_download_bytes"] == 200


def test_local_actions_use_the_clients_lanes():
    g = nx.DiGraph()
    for i, n in enumerate("fgh"):
        g.add_node(n, seconds=2.0, remote=False, reads=(), writes=None, order=i)
    assert rs.simulate(g, {}, rs.Params(workers=256, local_jobs=1, **FREE))["wall_s"] == 6.0
    assert rs.simulate(g, {}, rs.Params(workers=1, local_jobs=3, **FREE))["wall_s"] == 2.0


def test_curve_speedup_and_efficiency():
    rows = rs.curve(toy(), {}, rs.Params(workers=1, overhead_s=0.0, **FREE), workers=(1, 2, 4))
    assert [r["wall_s"] for r in rows] == [15.0, 10.0, 8.0]
    assert rows[1]["speedup"] == 1.5 and rows[1]["efficiency"] == 0.75


def test_bad_input_is_one_line(capsys):
    assert rs.main(["recorded", "--workers", "0,2"]) == 2
    assert capsys.readouterr().out.startswith("error: --workers")
    with pytest.raises(SystemExit, match="no state file"):
        rs.main(["recorded", "--cache", "/nonexistent-cache"])


def test_flashinfer_estimate_has_the_sets_shape(tmp_path):
    g, _units, assumptions = rs.flashinfer_estimate()
    assert (assumptions["modules"], assumptions["tus"]) == (160, 670)
    assert nx.is_directed_acyclic_graph(g)
    out = tmp_path / "fi.json"
    assert rs.main(["flashinfer", "--workers", "1,256", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["curve"]
    assert rows[0]["wall_s"] > 5 * rows[1]["wall_s"]  # wide: 5,500 steps


def test_a_recorded_cache_that_is_not_one_is_one_line(tmp_path, capsys):
    """A state file that is not SQLite, and a bad --labels regex: one line each, no traceback."""
    base = tmp_path / "v1" / "blake3"
    base.mkdir(parents=True)
    (base / "state-v2.sqlite").write_bytes(b"not a database, not even close" * 100)
    assert rs.main(["recorded", "--cache", str(tmp_path)]) == 2
    assert capsys.readouterr().out.startswith("error: the state file")
    assert rs.main(["recorded", "--cache", str(tmp_path), "--labels", "["]) == 2
    assert capsys.readouterr().out.startswith("error: --labels")


def test_the_graph_read_back_from_a_real_build_is_the_one_built(make_ws):
    """Three genrules built by bgraph (b reads a; c reads a and b; d alone): the loader finds exactly
    those dependencies in the cache, each action's recorded wall, and its output's bytes."""
    ws = make_ws({"targets/t.toml": """
[a]
kind = "genrule"
outs = ["o"]
cmd = "echo alpha-output > $OUT/o"

[b]
kind = "genrule"
deps = { a = ":a" }
outs = ["o"]
cmd = "cat $IN_A/o > $OUT/o; echo beta >> $OUT/o"

[c]
kind = "genrule"
deps = { a = ":a", b = ":b" }
outs = ["o"]
cmd = "cat $IN_A/o $IN_B/o > $OUT/o; sleep 0.3"

[d]
kind = "genrule"
outs = ["o"]
cmd = "echo delta > $OUT/o"
"""})
    run = ws.build("//t:c", "//t:d")
    assert run.rc == 0, run.output[-2000:]
    g, units, _info = rs.load_recorded(ws.cache, duration="wall", labels=r"^//t:")
    label = {n: n.split(" ")[0].removeprefix("//t:") for n in g}
    assert sorted(label.values()) == ["a", "b", "c", "d"]
    assert sorted((label[u], label[v]) for u, v in g.edges) == [("a", "b"), ("a", "c"), ("b", "c")]
    c = next(n for n in g if label[n] == "c")
    assert g.nodes[c]["seconds"] >= 0.3
    # make_ws's //toolchains:host is host_tools (the host's /usr mounted): such an action has no
    # content to send, and --remote-executor runs it locally; the loader says the same
    assert not g.nodes[c]["remote"]
    assert sum(units[g.nodes[c]["writes"]].values()) == len("alpha-output\nalpha-output\nbeta\n")
    assert rs.critical_path(g)[1][-1] == c


def test_bgraphs_priority_from_the_release_edges_by_hand():
    """One target (no labels): a released b and c, c (ended after b) released d. bgraph's ranks:
    a 2+max(3, 5+1) = 8, b 3, c 6, d 1, e 4; on 2 workers c goes before b, as longest path first."""
    ranks = rs.bgraph_ranks(toy())
    assert ranks == {"a": 8.0, "b": 3.0, "c": 6.0, "d": 1.0, "e": 4.0}
    assert rs.simulate(toy(), {}, rs.Params(workers=2, overhead_s=0.0, priority="bgraph", **FREE))["wall_s"] == 8.0


def test_bgraphs_priority_sees_targets_and_recorded_walls_not_the_true_graph():
    """Targets //t:a (1 s) <- //t:b (10 s), //t:c (2 s): a's rank carries b's whole span. Ranks
    come from what bgraph records (`wall_s`), not from the CPU seconds the simulation runs."""
    g = nx.DiGraph()
    for i, (n, label, cpu, wall) in enumerate([("a", "//t:a", 1.0, 1.0), ("b", "//t:b", 10.0, 10.0),
                                                ("c", "//t:c", 2.0, 20.0)]):
        g.add_node(n, label=label, seconds=cpu, wall_s=wall, remote=True, reads=(), writes=None, order=i)
    g.add_edge("a", "b")
    assert rs.bgraph_ranks(g) == {"a": 11.0, "b": 10.0, "c": 20.0}
    assert rs.bgraph_ranks(g, recorded="seconds") == {"a": 11.0, "b": 10.0, "c": 2.0}
    with pytest.raises(ValueError):
        rs.simulate(g, {}, rs.Params(workers=1, priority="nope", **FREE))
