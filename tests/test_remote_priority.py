"""bgraph's priority sent to the remote engine (issue 36): each Execute carries REAPI's
ExecutionPolicy.priority from bgraph's own longest-path-first order (queue_priority.py), so that
with more Executes in flight than the fleet has slots BuildGrid's queue starts the critical path
first, and the Action (every key) is the same whatever the priority.

The real-engine tests run PostgreSQL, BuildGrid 0.9.1 and one `bgraph worker` of one slot
(tests/remote_exec_servers.py) and read what the engine itself recorded: each job's priority
and the moment it was leased to the worker (BuildGrid's `jobs` table)."""

from __future__ import annotations

import dataclasses
import math
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from build_graph.remote_exec.queue_priority import LEVELS_PER_DOUBLING, MAX_LEVEL, reapi_priority


# -- the mapping -----------------------------------------------------------------------------------

def test_no_expected_time_is_the_servers_default():
    for nothing in (0.0, -3.0, None, math.nan, -math.inf):
        assert reapi_priority(nothing) == 0


def test_more_expected_time_runs_sooner_and_never_later():
    seconds = [0.0, 0.01, 0.1, 0.4, 1.0, 1.6, 3.0, 9.0, 9.4, 60.0, 1960.0, 86400.0, 1e7, 1e30, math.inf]
    values = [reapi_priority(s) for s in seconds]
    assert values == sorted(values, reverse=True)  # monotonic: lower (sooner) for more time
    assert all(-MAX_LEVEL <= v <= 0 for v in values) and values[-1] == -MAX_LEVEL
    # log buckets: 16 per doubling of (1 + s); distinct where (1 + s) differs by more than 2^(1/16)
    assert reapi_priority(1.0) == -LEVELS_PER_DOUBLING and reapi_priority(3.0) == -2 * LEVELS_PER_DOUBLING
    assert reapi_priority(9.0) < reapi_priority(1.6) < reapi_priority(0.4) < 0
    assert reapi_priority(1e30) == -MAX_LEVEL and -(2 ** 31) < -MAX_LEVEL  # bounded, far inside int32
    assert reapi_priority(100.0) == reapi_priority(100.5)  # within one bucket: a tie (the server: oldest first)


def test_switched_off_for_comparisons(monkeypatch):
    from build_graph.remote_exec import queue_priority
    assert queue_priority.sent()
    monkeypatch.setenv("BGRAPH_REMOTE_PRIORITY", "off")
    assert not queue_priority.sent()


def test_a_scheduler_job_knows_its_priority():
    """The runner reads the priority of the job it runs in from the scheduler's thread."""
    from build_graph.scheduler import Scheduler, running_priority
    s = Scheduler(jobs=2, max_mem_mb=1000)
    got = [s.submit(running_priority, 0, priority=p) for p in (7.5, 0.0, 1960.0)]
    s.join()
    assert [f.result() for f in got] == [7.5, 0.0, 1960.0]
    assert running_priority() == 0.0  # off a job's thread


# -- with the real engine ----------------------------------------------------------------------------

from bgraph_testlib import WS, copy_toolchains  # noqa: E402
from remote_exec_servers import PG_BIN, ExecStack, missing_reason  # noqa: E402

needs_stack = pytest.mark.skipif(missing_reason() is not None, reason=missing_reason() or "")

# A chain z1 -> z2 -> z3 of CHAIN_S steps beside LEAVES independent actions of LEAF_S, all ready
# at once but z2 and z3, which become ready only when the step before ends, after every leaf was
# queued: BuildGrid's queue, in arrival order, would lease them after every leaf.
CHAIN_S, LEAF_S, LEAVES = 1.0, 0.4, 10


def _targets() -> str:
    out = []
    for name, secs, dep in ([(f"z{i}", CHAIN_S, f"z{i - 1}" if i > 1 else None) for i in (1, 2, 3)]
                            + [(f"s{k}", LEAF_S, None) for k in range(LEAVES)]):
        read = " && cat $IN_D/o >> $OUT/o" if dep else ""
        # the name in the command: no two actions are alike, and the server's record names each
        out.append(f'[{name}]\nkind = "genrule"\nsrcs = ["common.txt"]\nouts = ["o"]\n'
                   + (f'deps = {{ d = ":{dep}" }}\n' if dep else "")
                   + f'cmd = "sleep {secs}; echo {name} > $OUT/o; cat $SRC/common.txt >> $OUT/o{read}"\n')
    return "\n".join(out)


TIPS = ["//p:z3"] + [f"//p:s{k}" for k in range(LEAVES)]


@pytest.fixture(scope="module")
def one_slot(tmp_path_factory):
    """PostgreSQL, bgd and one worker of one slot."""
    if missing_reason() is not None:
        pytest.skip(missing_reason())
    s = ExecStack(tmp_path_factory.mktemp("prio"), workers=1)
    yield s
    s.stop()


def _sql(stack, query: str) -> list[list[str]]:
    """Rows of `query` on BuildGrid's database (psql, as the test cluster trusts local TCP)."""
    psql = PG_BIN / "psql" if (PG_BIN / "psql").exists() else Path(shutil.which("psql") or "psql")
    out = subprocess.run([str(psql), "-h", "127.0.0.1", "-p", str(stack.pg.port), "-U", "bgd", "-d", "bgd",
                          "-At", "-F", "|", "-c", query], check=True, capture_output=True, text=True).stdout
    return [line.split("|") for line in out.splitlines() if line]


def _mark(stack) -> str:
    """The newest job's creation time: the jobs of a build started after this are newer."""
    return _sql(stack, "SELECT coalesce(max(create_timestamp), 'epoch') FROM jobs")[0][0]


def _leased(stack, since: str) -> list[tuple[str, int]]:
    """(target name, priority) of the jobs created after `since`, in the order the server
    leased them to the worker."""
    rows = _sql(stack, "SELECT command, priority FROM jobs WHERE create_timestamp > "
                       f"'{since}' AND worker_start_timestamp IS NOT NULL ORDER BY worker_start_timestamp")
    out = []
    for command, priority in rows:
        m = re.search(r"echo (\w+) > \$OUT/o", command)
        if m:
            out.append((m.group(1), int(priority)))
    return out


@pytest.fixture(scope="module")
def prio_ws(one_slot, module_tmp) -> WS:
    """The workspace built once remotely: the worker has the pinned /usr, and every action's
    duration is recorded (what the priorities of the next builds come from)."""
    root = module_tmp / "ws"
    copy_toolchains(root)
    (root / "targets" / "p.toml").write_text(_targets())
    (root / "common.txt").write_text("start\n")
    ws = WS(root, module_tmp / "cache")
    run = ws.cli("build", "--json", "--remote-executor", one_slot.url, "-j1", "--remote-jobs", "16", *TIPS,
                 timeout=900)
    assert run.rc == 0, run.stderr[-3000:]
    return ws


def _build(stack, ws: WS, edit: str, env: dict[str, str] | None = None) -> list[tuple[str, int]]:
    """Every action again (common.txt edited, same names), 16 Executes in flight for 1 slot;
    returns what the server leased, in order."""
    ws.write({"common.txt": f"{edit}\n"})
    since = _mark(stack)
    run = ws.cli("build", "--json", "--remote-executor", stack.url, "-j1", "--remote-jobs", "16", *TIPS,
                 env=env, timeout=600)
    assert run.rc == 0, run.stderr[-3000:]
    assert run.json["remote_execution"]["executed"] == 3 + LEAVES, run.json["remote_execution"]
    leased = _leased(stack, since)
    assert sorted(n for n, _p in leased) == sorted(["z1", "z2", "z3"] + [f"s{k}" for k in range(LEAVES)])
    return leased


def _leaves_before(leased: list[tuple[str, int]], name: str) -> int:
    names = [n for n, _p in leased]
    return sum(1 for n in names[:names.index(name)] if n.startswith("s"))


@needs_stack
def test_the_critical_path_is_leased_before_the_queued_short_actions(one_slot, prio_ws):
    """With bgraph's priority sent, each chain step, though queued after every leaf, is leased
    before them: at most the leaf that found the worker idle before z1 arrived, and the one or
    two that take the slot while the client files a step and sends the next, run ahead of it.
    The server's record shows the priorities: the chain's head most urgent, each step after it
    less, every leaf least."""
    leased = _build(one_slot, prio_ws, "edit 1")
    prio = dict(leased)
    assert prio["z1"] < prio["z2"] < prio["z3"] < min(p for n, p in leased if n.startswith("s")) <= 0, leased
    assert _leaves_before(leased, "z2") <= 5, leased  # arrival order: all 10
    assert _leaves_before(leased, "z3") <= 7, leased


@needs_stack
def test_without_the_priority_the_queue_is_arrival_order(one_slot, prio_ws):
    """The control (BGRAPH_REMOTE_PRIORITY=off, the client's own order unchanged): every job at
    the server's default priority, and each chain step leased only after every leaf queued before
    it, which is what the test above would see if the priority were not sent."""
    leased = _build(one_slot, prio_ws, "edit 2", env={"BGRAPH_REMOTE_PRIORITY": "off"})
    assert {p for _n, p in leased} == {0}, leased
    assert _leaves_before(leased, "z2") >= LEAVES - 2, leased


@needs_stack
def test_the_action_digest_does_not_depend_on_the_priority(one_slot, tmp_path):
    """One action Executed from two scheduler jobs of different priorities: the second is
    BuildGrid's action-cache hit (the same Action digest), and the server recorded both jobs
    under that digest, each with its own priority."""
    from build_graph.model import Digester, Tree
    from build_graph.scheduler import Scheduler
    from build_graph.store.cas import LocalCas
    from test_remote_exec import _runner, sample_action
    cas = LocalCas(tmp_path / "cache", Digester("blake3"))
    action = sample_action(cas, staged=False)
    src = Tree({**action.input_tree("/bgraph/src").entries, "rand": cas.put_bytes(os.urandom(32))})
    action = dataclasses.replace(action, inputs=tuple((m, src if m == "/bgraph/src" else t) for m, t in action.inputs))
    since = _mark(one_slot)
    # The second takes BuildGrid's cached answer: by default a client asks the executor to skip its
    # action cache (any client may write it), so this one opts in as --remote-accept-cached does.
    runners = [_runner(cas, one_slot.url), _runner(cas, one_slot.url, accept_cached=True)]
    s = Scheduler(jobs=1, max_mem_mb=1000)
    first = s.submit(lambda: runners[0].run(action), 0, priority=0.0)
    first.result(timeout=300)
    second = s.submit(lambda: runners[1].run(action), 0, priority=100.0)
    second.result(timeout=300)
    s.join()
    assert runners[0].stats["executed"] == 1 and runners[1].stats["cached"] == 1
    rows = _sql(one_slot, f"SELECT action_digest, priority FROM jobs WHERE create_timestamp > '{since}' "
                          "ORDER BY create_timestamp")
    assert len(rows) == 2 and rows[0][0] == rows[1][0], rows
    assert [int(p) for _d, p in rows] == [0, reapi_priority(100.0)], rows
