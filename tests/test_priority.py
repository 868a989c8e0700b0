"""Longest-path-first order (issue 36): the priority computation (build_graph/priority.py) on
graphs whose answers are known by hand, and real builds of sleeping genrules at -j2 whose order,
read from the --profile timeline, follows the durations the previous build recorded."""

from __future__ import annotations

import json

import pytest

from bgraph_testlib import requires_bwrap
from build_graph.priority import DEFAULT_S, Priorities, Timing, remaining, span


def test_remaining_follows_the_recorded_release_edges():
    """In one target: conf (1) released a (5) and b (2); a released link (3); b released nothing."""
    t = Timing({"conf": 1.0, "a": 5.0, "b": 2.0, "link": 3.0},
               {"conf": None, "a": "conf", "b": "conf", "link": "a"})
    assert remaining(t) == {"conf": 9.0, "a": 8.0, "b": 2.0, "link": 3.0}
    assert span(t) == 9.0


def test_unknown_actions_and_targets_weigh_the_default():
    assert span(Timing()) == DEFAULT_S
    t = Timing({"a": 4.0}, {"a": None, "b": "a"})  # b was released by a, its time never recorded
    assert remaining(t) == {"a": 4.0 + DEFAULT_S, "b": DEFAULT_S}


def test_a_damaged_timing_is_ignored_or_cut_never_an_error():
    assert Timing.from_trace({"timing": "junk"}) == Timing()
    assert Timing.from_trace(None) == Timing()
    t = Timing.from_trace({"timing": {"seconds": {"a": 2, "b": "x", "c": -1, "d": float("nan")},
                                      "after": {"a": "b", "b": "a", "e": 3}}})
    assert t.seconds == {"a": 2.0} and t.after == {"a": "b", "b": "a"}
    rest = remaining(t)  # a cycle a <-> b: cut where it closes, every name answered
    assert set(rest) == {"a", "b"} and all(v > 0 for v in rest.values())
    assert Timing.from_trace({"timing": t.to_json()}) == t  # what a build writes, it reads back


def test_priority_is_own_time_plus_the_longest_path_through_what_waits():
    """Targets: lib (a 10 s compile, a 1 s one) <- app (2 s link) <- image (4 s); lib <- test (30 s).
    lib's long compile: 10 + max(app 2 + image 4, test 30) = 40; its short one 31."""
    deps_of = {"app": ["lib"], "image": ["app"], "test": ["lib"], "lib": []}
    dependents = {t: [d for d, ds in deps_of.items() if t in ds] for t in deps_of}
    timing = {"lib": Timing({"long": 10.0, "short": 1.0}, {"long": None, "short": None}),
              "app": Timing({"link": 2.0}, {"link": None}), "image": Timing({"img": 4.0}, {"img": None}),
              "test": Timing({"run": 30.0}, {"run": None})}
    asked: list[str] = []
    p = Priorities(lambda t: dependents[t], lambda t: asked.append(t) or timing[t])
    assert p.of("lib", "long") == 40.0 and p.of("lib", "short") == 31.0
    assert p.of("app", "link") == 6.0 and p.of("image", "img") == 4.0
    assert p.of("lib", "new-action") == DEFAULT_S + 30.0  # never recorded: the default
    assert sorted(asked) == ["app", "image", "lib", "test"]  # each target's record read once


def test_without_records_the_order_is_by_depth():
    """A fresh cache: every action weighs DEFAULT_S, so a chain's head outranks a lone target."""
    dependents = {"c1": ["c2"], "c2": ["c3"], "c3": [], "alone": []}
    p = Priorities(lambda t: dependents[t], lambda t: Timing())
    assert p.of("c1", "genrule") == 3 * DEFAULT_S > p.of("alone", "genrule") == DEFAULT_S


def test_a_chain_of_ten_thousand_targets_needs_no_recursion():
    n = 10_000
    p = Priorities(lambda t: [t + 1] if t + 1 < n else [], lambda t: Timing({"g": 0.5}, {"g": None}))
    assert p.of(0, "g") == n * 0.5


# -- real builds ---------------------------------------------------------------------------------

# The chain (9 s) is the critical path; the short steps (9.6 s) fill the other slot, and are
# still waiting when each chain step becomes ready.
CHAIN_S, SHORT_S, SHORT_CHAINS, SHORT_DEPTH = 3.0, 0.4, 6, 4


def _targets() -> str:
    """A chain z1 -> z2 -> z3 of CHAIN_S steps, and SHORT_CHAINS chains of SHORT_DEPTH steps of
    SHORT_S each. All read common.txt, so one edit reruns all."""
    out = []

    def rule(name: str, seconds: float, dep: str | None) -> None:
        # echo the name: no two actions are alike (equal actions would run once, for all)
        cmd = f"sleep {seconds}; echo {name} > $OUT/o; cat $SRC/common.txt >> $OUT/o" + (" && cat $IN_D/o >> $OUT/o" if dep else "")
        out.append(f'[{name}]\nkind = "genrule"\nsrcs = ["common.txt"]\nouts = ["o"]\n'
                   + (f'deps = {{ d = ":{dep}" }}\n' if dep else "") + f'cmd = "{cmd}"\n')
    for i in range(1, 4):
        rule(f"z{i}", CHAIN_S, f"z{i - 1}" if i > 1 else None)
    for c in range(SHORT_CHAINS):
        for i in range(1, SHORT_DEPTH + 1):
            rule(f"a{c}-{i}", SHORT_S, f"a{c}-{i - 1}" if i > 1 else None)
    return "\n".join(out)


def _starts(path) -> list[tuple[float, str]]:
    """(start in s, target name) of every executed action, from the --profile timeline."""
    events = json.loads(path.read_text())["traceEvents"]
    return sorted((e["ts"] / 1e6, e["name"].split()[0].split(":")[1]) for e in events if e.get("cat") == "action")


def _build(ws, profile, n: int, env=None):
    ws.write({"common.txt": f"edit {n}\n"})
    # z3 asked for first: the configured walk then lists z1 after every short head, so a FIFO
    # build plans it last (the FIFO check below says so).
    tips = ["//p:z3"] + [f"//p:a{c}-{SHORT_DEPTH}" for c in range(SHORT_CHAINS)]
    run = ws.cli("build", "--json", "-j", "2", "--profile", str(profile), *tips, env=env, timeout=300)
    assert run.rc == 0, run.stderr
    return run.json, _starts(profile)


@pytest.fixture(scope="module")
def sleepers(tmp_path_factory):
    """The workspace built once on a fresh cache (order by depth: no durations yet)."""
    from bgraph_testlib import TOOLCHAINS_TOML, WORKSPACE_TOML, WS, write_files
    root = tmp_path_factory.mktemp("priority") / "ws"
    root.mkdir()
    write_files(root, {"WORKSPACE.toml": WORKSPACE_TOML, "targets/toolchains.toml": TOOLCHAINS_TOML,
                       "targets/p.toml": _targets(), "common.txt": "start\n"})
    ws = WS(root, root.parent / "cache")
    first, starts = _build(ws, root.parent / "first.json", 0)
    return ws, first, starts


@requires_bwrap
def test_a_fresh_cache_orders_by_depth(sleepers):
    """No durations yet: the short chains (4 deep) outrank the long one (3 deep), so their heads
    take the first slots; z1 comes before their second steps (equal rank, submitted first)."""
    _ws, _summary, starts = sleepers
    names = [n for _t, n in starts]
    assert set(names[:2]) <= {f"a{c}-1" for c in range(SHORT_CHAINS)}, names
    assert names.index("z1") < min(names.index(f"a{c}-2") for c in range(SHORT_CHAINS)), names


@requires_bwrap
def test_recorded_durations_put_the_long_chain_first(sleepers, tmp_path):
    """After an edit that reruns every action under the same names, the recorded durations make
    z1 the first action started, and each later step of the chain start before the short steps
    that were waiting when it became ready: the build's wall is close to the chain's, not to
    FIFO's (which, on the same edit, starts z1 after every short chain's head)."""
    ws = sleepers[0]
    summary, starts = _build(ws, tmp_path / "second.json", 1)
    names = [n for _t, n in starts]
    assert names[0] == "z1", names
    executed = {a["label"].split(":")[1]: a for a in summary["actions"] if a["status"] == "executed"}
    assert len(executed) == SHORT_CHAINS * SHORT_DEPTH + 3
    chain = sum(executed[f"z{i}"]["duration_s"] for i in range(1, 4))
    shorts = sum(a["duration_s"] for n, a in executed.items() if n.startswith("a"))
    at = dict((n, t) for t, n in starts)
    # When z2 and z3 became ready, short steps were still queued, and only those that took a slot
    # before the build saw the chain step's end and planned the next (one per slot, one more on
    # a loaded machine) started between them.
    for k in (2, 3):
        ended = at[f"z{k - 1}"] + executed[f"z{k - 1}"]["duration_s"]
        between = [n for t, n in starts if ended <= t < at[f"z{k}"]]
        assert len(between) <= 3, (k, between, starts)
    assert any(t > at["z3"] for t, n in starts if n.startswith("a")), starts  # shorts were still waiting
    wall = summary["wall_s"]
    assert wall < chain + SHORT_CHAINS * SHORT_DEPTH * SHORT_S / 2, (wall, chain, shorts)

    fifo, fifo_starts = _build(ws, tmp_path / "fifo.json", 2, env={"BGRAPH_SCHEDULE": "fifo"})
    fifo_names = [n for _t, n in fifo_starts]
    assert fifo_names.index("z1") >= SHORT_CHAINS, fifo_names  # after every short head: planned last
    print(f"walls: priority {wall:.2f} s, fifo {fifo['wall_s']:.2f} s, chain {chain:.2f} s, shorts {shorts:.2f} s")
