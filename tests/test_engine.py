"""The build loop: caching, early cutoff, reasons, reproducibility, failures, scheduling."""

from __future__ import annotations

import tarfile
import threading
import time

import pytest

from bgraph_testlib import action, recorded_traces, requires_bwrap, statuses
from build_graph.model import Digester
from build_graph.scheduler import Scheduler

B3 = Digester("blake3")

# //p:a strips comments from in.txt; //p:b counts a's lines.
CUTOFF = {
    "in.txt": "# a comment\nalpha\nbeta\n",
    "targets/p.toml": '''[a]
kind = "genrule"
srcs = ["in.txt"]
outs = ["a.txt"]
cmd = "grep -v '^#' $SRC/in.txt > $OUT/a.txt"

[b]
kind = "genrule"
outs = ["b.txt"]
deps = { a = ":a" }
cmd = "wc -l < $IN_A/a.txt > $OUT/b.txt"
''',
}


# -- caching and early cutoff ---------------------------------------------------------------------------
@requires_bwrap
def test_second_build_executes_nothing(make_ws):
    ws = make_ws(CUTOFF)
    first = ws.build("//p:b")
    assert first.rc == 0, first.stderr
    assert statuses(first.json) == {"//p:a": "executed", "//p:b": "executed"}
    assert ws.read_output("//p:b", "b.txt").strip() == "2"
    second = ws.build("//p:b")
    assert second.rc == 0
    assert second.json["executed"] == 0 and second.json["hits"] == 2
    assert statuses(second.json) == {"//p:a": "hit", "//p:b": "hit"}
    assert all(a["reason"] == "inputs unchanged" for a in second.json["actions"])
    # The in-process API agrees, and a fully cached build never starts the sandbox.
    engine = ws.engine()
    from build_graph.labels import parse_label
    result = engine.build([parse_label("//p:b")])
    assert not result.failures and result.count("executed") == 0
    assert engine._sandbox is None


@requires_bwrap
def test_early_cutoff(make_ws):
    ws = make_ws(CUTOFF)
    assert ws.build("//p:b").rc == 0

    ws.write({"in.txt": "# another comment, edited\nalpha\nbeta\n"})
    run = ws.build("//p:b")
    assert run.rc == 0, run.stderr
    a, b = action(run.json, "//p:a"), action(run.json, "//p:b")
    assert a["status"] == "executed"
    assert "in.txt" in a["reason"]
    assert b["status"] == "cutoff"
    assert run.json["executed"] == 1 and run.json["cut_off"] == 1

    explain = ws.cli("explain", "//p:b")
    assert explain.rc == 0
    assert "cut off" in explain.stdout
    assert "upstream rebuilt to identical outputs" in explain.stdout
    explain_a = ws.cli("explain", "//p:a")
    assert "ran genrule" in explain_a.stdout and "/bgraph/src/in.txt" in explain_a.stdout
    records = ws.cli("explain", "//p:b", "--json").json
    assert [r["status"] for r in records] == ["cutoff"]


@requires_bwrap
def test_early_cutoff_is_the_same_answer_when_the_memo_could_take_the_target(make_ws):
    """Past the racy window the memo may take a target whole; one whose dependency ran again
    is still decided by the rebuilder: cut off, with the reason in its trace."""
    ws = make_ws(CUTOFF)
    time.sleep(2.2)  # the workspace's files leave the racy-clean window (filestate.RACY_NS)
    assert ws.build("//p:b").rc == 0
    ws.write({"in.txt": "# another comment, edited\nalpha\nbeta\n"})
    run = ws.build("//p:b")
    assert run.rc == 0, run.stderr
    assert action(run.json, "//p:a")["status"] == "executed"
    assert action(run.json, "//p:b")["status"] == "cutoff"
    assert run.json["executed"] == 1 and run.json["cut_off"] == 1
    assert "upstream rebuilt to identical outputs" in ws.cli("explain", "//p:b").stdout


@requires_bwrap
def test_real_edit_rebuilds_both_and_names_the_file(make_ws):
    ws = make_ws(CUTOFF)
    assert ws.build("//p:b").rc == 0
    ws.write({"in.txt": "# a comment\nalpha\nbeta\ngamma\n"})
    run = ws.build("//p:b")
    assert run.rc == 0, run.stderr
    a, b = action(run.json, "//p:a"), action(run.json, "//p:b")
    assert a["status"] == b["status"] == "executed"
    assert a["reason"].startswith("input /bgraph/src/in.txt ")
    assert b["reason"].startswith("input /bgraph/in/a/a.txt ")
    assert ws.read_output("//p:b", "b.txt").strip() == "3"
    explain = ws.cli("explain", "//p:a", "--json").json
    assert explain[0]["reason"] == a["reason"]


@requires_bwrap
def test_reason_names_a_changed_command(make_ws):
    ws = make_ws(CUTOFF)
    assert ws.build("//p:a").rc == 0
    ws.write({"targets/p.toml": CUTOFF["targets/p.toml"].replace("grep -v '^#'", "grep -v '^[#]'")})
    run = ws.build("//p:a")
    reason = action(run.json, "//p:a")["reason"]
    assert reason.startswith("argv[2] ") and "'^[#]'" in reason


@requires_bwrap
def test_rich_output_survives_markup_in_commands(make_ws):
    """Reasons quote commands; text like `[/x]` in them is not rich markup (it used to crash)."""
    ws = make_ws({"targets/p.toml": '[a]\nkind = "genrule"\nouts = ["o"]\ncmd = "echo one > o"\n'})
    assert ws.cli("build", "//p:a").rc == 0
    ws.write({"targets/p.toml": '[a]\nkind = "genrule"\nouts = ["o"]\ncmd = "echo \'[/x] [bold]\' > o"\n'})
    run = ws.cli("build", "-v", "//p:a")  # the human reporter (executed actions shown), not --json
    assert run.rc == 0, run.stderr
    assert "Traceback" not in run.stderr
    assert "[/x] [bold]" in run.stderr
    explain = ws.cli("explain", "//p:a")
    assert explain.rc == 0 and "[/x] [bold]" in explain.stdout


# -- reproducibility --------------------------------------------------------------------------------------
REPRO = {
    "src/data.txt": "zeta\nalpha\nmid\n",
    "src/tool.sh": "#!/bin/sh\nsort \"$1\"\n",
    "targets/p.toml": '''[gen]
kind = "genrule"
srcs = ["src/*"]
outs = ["sorted.txt", "meta/env.txt", "meta/tool", "link"]
cmd = """
sh $SRC/src/tool.sh $SRC/src/data.txt > sorted.txt
mkdir -p meta
(pwd; hostname; id -u; echo $HOME $TMPDIR $TZ; date -u -d @$SOURCE_DATE_EPOCH; ls /tmp | wc -l) > meta/env.txt
cp $SRC/src/tool.sh meta/tool && chmod 755 meta/tool
ln -s sorted.txt link
"""

[tar]
kind = "genrule"
deps = { gen = ":gen" }
outs = ["gen.tar"]
cmd = "tar --sort=name --mtime=@$SOURCE_DATE_EPOCH --owner=0 --group=0 --numeric-owner -cf gen.tar -C $IN_GEN ."
''',
}


@requires_bwrap
def test_clean_builds_in_two_places_are_identical(make_ws, tmp_path):
    ws1 = make_ws(REPRO, name="one")
    ws2 = make_ws(REPRO, name="two/nested")
    r1 = ws1.engine_build("//p:gen", "//p:tar")
    r2 = ws2.engine_build("//p:gen", "//p:tar")
    assert not r1.failures and not r2.failures, (r1.failures, r2.failures)
    from build_graph.labels import parse_label
    for label in ("//p:gen", "//p:tar"):
        t1, t2 = r1.outputs[parse_label(label)].tree, r2.outputs[parse_label(label)].tree
        assert t1 == t2
        assert t1.digest(B3) == t2.digest(B3)
    gen = r1.outputs[parse_label("//p:gen")].tree
    assert gen.entries["meta/tool"].executable
    assert {r.key for r in r1.records} == {r.key for r in r2.records}
    # The CLI agrees: same keys, same bytes.
    c1, c2 = ws1.build("//p:tar"), ws2.build("//p:tar")
    assert action(c1.json, "//p:tar")["key"] == action(c2.json, "//p:tar")["key"]
    assert (ws1.root / "bgraph-out/p/tar/gen.tar").read_bytes() == (ws2.root / "bgraph-out/p/tar/gen.tar").read_bytes()
    with tarfile.open(ws1.root / "bgraph-out/p/tar/gen.tar") as tf:
        assert sorted(tf.getnames()) == [".", "./link", "./meta", "./meta/env.txt", "./meta/tool", "./sorted.txt"]
    # Nothing about the host in the environment the action saw.
    r = ws1.build("//p:gen")
    meta = ws1.read_output("//p:gen", "meta/env.txt").splitlines()
    assert meta[:3] == ["/bgraph/out", "bgraph", "0"]
    assert meta[3] == "/tmp /tmp UTC"
    assert meta[4].startswith("Tue Jan  1 00:00:00 UTC 1980")
    assert meta[5] == "0"
    assert r.json["executed"] == 0


@requires_bwrap
def test_check_reports_nondeterministic_actions(make_ws):
    ws = make_ws({"targets/p.toml": '[det]\nkind = "genrule"\nouts = ["o"]\ncmd = "echo same > o"\n\n'
                                    '[nondet]\nkind = "genrule"\nouts = ["o"]\n'
                                    'cmd = "cat /proc/sys/kernel/random/uuid > o"\n'})
    assert ws.build("//p:det", "//p:nondet").rc == 0
    run = ws.build("//p:det", args=("--check",))
    assert run.rc == 0, run.stderr
    assert action(run.json, "//p:det")["status"] == "executed" and run.json["differing"] == []
    run = ws.build("//p:det", "//p:nondet", args=("--check",))
    assert run.rc == 3
    assert run.json["differing"] == ["//p:nondet genrule"]
    assert action(run.json, "//p:nondet")["differs"] is True


@requires_bwrap
def test_check_sample_reexecutes_only_n_actions(make_ws):
    files = {"targets/p.toml": "".join(f'[t{i}]\nkind = "genrule"\nouts = ["o"]\ncmd = "echo {i} > o"\n\n'
                                       for i in range(4))}
    ws = make_ws(files)
    assert ws.build("//p:all").rc == 0
    run = ws.build("//p:all", args=("--check-sample", "2"))
    assert run.rc == 0, run.stderr
    assert run.json["executed"] == 2 and run.json["hits"] == 2 and run.json["differing"] == []


# -- failures ------------------------------------------------------------------------------------------------
FAILING = {
    "targets/p.toml": '''[bad]
kind = "genrule"
outs = ["o"]
cmd = "echo broken >&2; exit 1"

[after-bad]
kind = "genrule"
deps = { bad = ":bad" }
outs = ["o"]
cmd = "cp $IN_BAD/o o"

[good]
kind = "genrule"
outs = ["o"]
cmd = "sleep 0.3; echo good > o"

[good2]
kind = "genrule"
deps = { good = ":good" }
outs = ["o"]
cmd = "cat $IN_GOOD/o $IN_GOOD/o > o"
''',
}


@requires_bwrap
def test_keep_going_builds_independent_targets(make_ws):
    ws = make_ws(FAILING)
    run = ws.build("//p:all", args=("--keep-going", "-j", "2"))
    assert run.rc == 1
    s = run.json
    assert not s["ok"]
    st = statuses(s)
    assert st["//p:bad"] == "failed"
    assert st["//p:good"] == "executed" and st["//p:good2"] == "executed"
    assert "//p:after-bad" not in st  # never started: its dependency failed
    assert s["failed"] == 1 and len(s["errors"]) == 1 and "broken" in s["errors"][0]
    assert len(ws.ac_entries()) == 2
    # The good targets are cached now; the bad one runs (and fails) again.
    again = ws.build("//p:all", args=("-k",))
    assert statuses(again.json) == {"//p:bad": "failed", "//p:good": "hit", "//p:good2": "hit"}


@requires_bwrap
def test_without_keep_going_the_build_stops(make_ws):
    ws = make_ws(FAILING)
    # bad fails at once while good (0.3 s) is still running; good2, which needs good, never starts.
    run = ws.build("//p:bad", "//p:good2", args=("-j", "2"))
    assert run.rc == 1
    st = statuses(run.json)
    assert st["//p:bad"] == "failed"
    assert "//p:good2" not in st
    assert len(run.json["errors"]) == 1


@requires_bwrap
def test_failed_builds_leave_the_store_untouched(make_ws):
    ws = make_ws(CUTOFF)
    assert ws.build("//p:b").rc == 0
    before = ws.ac_entries()
    traces = recorded_traces(ws)
    assert len(before) == 2
    ws.write({"targets/p.toml": CUTOFF["targets/p.toml"].replace("grep -v", "exit 7; grep -v")})
    run = ws.build("//p:b")
    assert run.rc == 1 and "exited with status 7" in run.stderr
    assert ws.ac_entries() == before
    assert recorded_traces(ws) == traces
    assert not list((ws.cache / "v1" / "tmp").iterdir())
    # And the previous outputs are still served from the cache once the edit is undone.
    ws.write(CUTOFF)
    run = ws.build("//p:b")
    assert run.rc == 0 and run.json["executed"] == 0


@requires_bwrap
def test_patch_that_does_not_apply_names_patch_and_hunk(make_ws):
    good = ("--- a/hello.txt\n+++ b/hello.txt\n@@ -1,3 +1,3 @@\n line1\n-line2\n+line two\n line3\n")
    bad = ("--- a/hello.txt\n+++ b/hello.txt\n@@ -1,3 +1,3 @@\n line1\n-something else\n+line 2\n line3\n")
    ws = make_ws({
        "patches/p/0001-good.patch": good,
        "targets/p.toml": '''[orig]
kind = "genrule"
outs = ["hello.txt"]
cmd = "printf 'line1\\\\nline2\\\\nline3\\\\n' > hello.txt"

[patched]
kind = "patched_tree"
src = ":orig"
patches = ["patches/p/*.patch"]
''',
    })
    run = ws.build("//p:patched")
    assert run.rc == 0, run.stderr
    assert ws.read_output("//p:patched", "hello.txt") == "line1\nline two\nline3\n"

    ws.write({"patches/p/0002-bad.patch": bad})
    run = ws.build("//p:patched")
    assert run.rc == 1
    assert "patches/p/0002-bad.patch" in run.stderr
    assert "Hunk #1 FAILED" in run.stderr
    assert "does not apply" in run.stderr
    assert any("Hunk #1 FAILED" in e for e in run.json["errors"])


@requires_bwrap
def test_missing_source_file_is_a_clear_error(make_ws):
    ws = make_ws({"targets/p.toml": '[a]\nkind = "genrule"\nsrcs = ["nope.txt", "*.md"]\nouts = ["o"]\ncmd = "true"\n'})
    run = ws.cli("build", "//p:a")
    assert run.rc == 2  # a load error, reported before anything runs
    assert "targets/p.toml [a] key 'srcs': source file 'nope.txt' does not exist" in run.stderr


# -- scheduling ----------------------------------------------------------------------------------------------
def test_scheduler_limits_jobs_and_memory():
    sched = Scheduler(jobs=3, max_mem_mb=1000)
    gate = threading.Event()
    running, peak = [0], [0]
    lock = threading.Lock()

    def job():
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        gate.wait(5)
        with lock:
            running[0] -= 1
        return "done"

    futures = [sched.submit(job, 400) for _ in range(4)]
    time.sleep(0.2)
    assert running[0] == 2  # 3 jobs allowed, but 3 x 400 MB > 1000 MB
    gate.set()
    assert [f.result(5) for f in futures] == ["done"] * 4
    sched.join()
    assert sched.peak_running == peak[0] == 2
    assert sched.peak_mem_mb == 800


def test_scheduler_big_job_runs_alone_and_small_ones_pass():
    sched = Scheduler(jobs=4, max_mem_mb=100)
    order = []
    gate = threading.Event()

    def job(name, wait):
        def run():
            order.append(("start", name))
            if wait:
                gate.wait(5)
            order.append(("end", name))
        return run

    big = sched.submit(job("first", True), 60)
    huge = sched.submit(job("huge", False), 500)  # over the whole budget: waits, then runs alone
    small = sched.submit(job("small", False), 30)  # fits beside the first: does not wait for huge
    small.result(5)
    assert ("start", "huge") not in order
    gate.set()
    big.result(5), huge.result(5)
    sched.join()
    assert order.index(("start", "huge")) > max(order.index(("end", "first")), order.index(("end", "small")))
    assert sched.peak_running == 2 and sched.peak_mem_mb == 500


def test_scheduler_cancel_pending():
    sched = Scheduler(jobs=1, max_mem_mb=100)
    gate = threading.Event()
    first = sched.submit(lambda: gate.wait(5), 10)
    queued = [sched.submit(lambda: 1, 10) for _ in range(3)]
    sched.cancel_pending()
    gate.set()
    assert first.result(5) is True
    assert all(f.cancelled() for f in queued)
    sched.join()


def test_scheduler_starts_nothing_after_a_failure_without_keep_going():
    for stop, expect_ran in ((True, False), (False, True)):
        sched = Scheduler(jobs=1, max_mem_mb=100, stop_on_failure=stop)
        ran = threading.Event()
        gate = threading.Event()

        def boom():
            gate.wait(5)
            raise RuntimeError("boom")
        failing = sched.submit(boom, 10)
        queued = sched.submit(ran.set, 10)
        gate.set()
        with pytest.raises(RuntimeError):
            failing.result(5)
        time.sleep(0.2)  # the queued job would have started by now
        assert ran.is_set() is expect_ran
        if stop:  # still queued, never started: the failure stopped the scheduler
            assert not queued.running() and not queued.done()
            assert sched.peak_running == 1
        else:  # ran to the end, after the failure
            assert queued.done() and not queued.cancelled() and queued.result(0) is None
        sched.cancel_pending()
        assert queued.cancelled() is stop  # only a job that never started is cancelled
        sched.join()


def test_a_later_gives_the_slot_back_before_its_second_part_ends():
    """A job that returns Later(fn): its slot goes to the next job while `fn` runs on a filer,
    and its future is done only when `fn` is (its value, or its exception)."""
    from build_graph.scheduler import Later

    sched = Scheduler(jobs=1, max_mem_mb=100)
    filing, second_started = threading.Event(), threading.Event()

    def first():
        def store():
            filing.wait(5)
            return "filed"
        return Later(store)

    a = sched.submit(first, 10)
    b = sched.submit(lambda: second_started.set() or "second", 10)
    assert second_started.wait(5)  # ran on the one slot while the first was still being filed
    assert b.result(5) == "second"
    assert not a.done()  # whoever waits on it (dependents) waits for the filing
    filing.set()
    assert a.result(5) == "filed"
    failing = sched.submit(lambda: Later(lambda: 1 / 0), 10)
    with pytest.raises(ZeroDivisionError):
        failing.result(5)
    sched.join()
    assert not any(t.is_alive() for t in sched._threads) and not sched._filers  # the filers ended
    assert sched.peak_running == 1


def test_a_failed_second_part_stops_the_scheduler():
    from build_graph.scheduler import Later

    sched = Scheduler(jobs=1, max_mem_mb=100, stop_on_failure=True)
    gate = threading.Event()
    failing = sched.submit(lambda: Later(lambda: gate.wait(5) and 1 / 0), 10)
    time.sleep(0.1)
    queued = sched.submit(lambda: 8, 10)  # submitted while the first's second part runs
    gate.set()
    with pytest.raises(ZeroDivisionError):
        failing.result(5)
    time.sleep(0.2)
    if not queued.done():  # it may have started on the freed slot before the failure: else never
        sched.cancel_pending()
        assert queued.cancelled()
    sched.join()


def test_join_waits_for_second_parts_still_being_filed():
    from build_graph.scheduler import Later

    sched = Scheduler(jobs=2, max_mem_mb=100)
    filed = []
    futures = [sched.submit(lambda i=i: Later(lambda: time.sleep(0.05) or filed.append(i)), 10) for i in range(6)]
    sched.join()
    assert sorted(filed) == list(range(6)) and all(f.done() for f in futures)


def test_scheduler_reports_exceptions():
    sched = Scheduler(jobs=2, max_mem_mb=100)
    fut = sched.submit(lambda: 1 / 0, 10)
    with pytest.raises(ZeroDivisionError):
        fut.result(5)
    assert sched.submit(lambda: 7, 10).result(5) == 7
    sched.join()


# Each action stamps the (host-wide) clock as it starts and as it ends, 1 s later: run together,
# the two intervals overlap; one after the other, they cannot.
STAMPED = {
    "targets/p.toml": "".join(
        f'[{n}]\nkind = "genrule"\nouts = ["start", "end"]\nmemory_mb = 100\n'
        f'cmd = "date +%s%N > start; sleep 1; date +%s%N > end; echo {n} >> end"\n\n'
        for n in ("x", "y")),
}


def stamped_intervals(ws, result) -> dict[str, tuple[int, int]]:
    """label -> (start, end) in ns, as the actions of STAMPED wrote them."""
    from build_graph.labels import parse_label
    from build_graph.store.cas import LocalCas
    cas = LocalCas(ws.cache, B3)
    out = {}
    for label in ("//p:x", "//p:y"):
        tree = result.outputs[parse_label(label)].tree
        out[label] = tuple(int(cas.read_bytes(tree.entries[f]).split()[0]) for f in ("start", "end"))
    return out


def overlap_s(intervals: dict[str, tuple[int, int]]) -> float:
    (s1, e1), (s2, e2) = intervals.values()
    return (min(e1, e2) - max(s1, s2)) / 1e9


@pytest.fixture
def scheduler_spy(monkeypatch):
    import build_graph.build_run as build_run
    made: list[Scheduler] = []

    class Spy(Scheduler):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            made.append(self)

    monkeypatch.setattr(build_run, "Scheduler", Spy)
    return made


@requires_bwrap
def test_memory_budget_serializes_actions(make_ws, scheduler_spy):
    ws = make_ws(STAMPED)
    result = ws.engine_build("//p:x", "//p:y", jobs=2, max_mem_mb=100)
    assert not result.failures
    assert result.count("executed") == 2
    [sched] = scheduler_spy
    assert sched.peak_running == 1
    assert sched.peak_mem_mb == 100
    assert overlap_s(stamped_intervals(ws, result)) < 0  # one after the other


@requires_bwrap
def test_actions_run_in_parallel_within_budget(make_ws, scheduler_spy):
    """The two sandboxed processes really run at the same time (their clock stamps overlap),
    not just two scheduler slots taken: a serial run anywhere below the scheduler fails this."""
    ws = make_ws(STAMPED)
    result = ws.engine_build("//p:x", "//p:y", jobs=2, max_mem_mb=200)
    assert not result.failures, result.failures
    assert result.count("executed") == 2
    [sched] = scheduler_spy
    assert sched.peak_running == 2
    intervals = stamped_intervals(ws, result)
    assert all(end - start >= 0.9e9 for start, end in intervals.values()), intervals
    assert overlap_s(intervals) > 0.2, intervals  # each slept 1 s; any overlap at all means together
    # -j 1 serializes whatever the memory: the intervals are then disjoint.
    ws2 = make_ws(STAMPED)
    result = ws2.engine_build("//p:x", "//p:y", jobs=1, max_mem_mb=100000)
    assert not result.failures and scheduler_spy[-1].peak_running == 1
    assert overlap_s(stamped_intervals(ws2, result)) < 0


@requires_bwrap
def test_actions_that_start_together_share_one_runner(make_ws, monkeypatch):
    """The first actions of a build ask for the sandbox runner at once: one runner is made
    (its stop() must reach every process, and a second would probe the cgroups again)."""
    import time

    from build_graph import sandbox
    made = []

    class Slow(sandbox.BwrapRunner):
        def __init__(self, *a, **kw):
            time.sleep(0.3)  # both lanes arrive while the first runner is being made
            super().__init__(*a, **kw)
            made.append(self)

    monkeypatch.setattr(sandbox, "BwrapRunner", Slow)
    ws = make_ws(STAMPED)
    result = ws.engine_build("//p:x", "//p:y", jobs=2, max_mem_mb=200)
    assert not result.failures and result.count("executed") == 2
    assert len(made) == 1


@requires_bwrap
@pytest.mark.parametrize("sig, rc, said", [("SIGINT", 130, "interrupted"), ("SIGTERM", 143, "terminated")])
def test_ctrl_c_leaves_the_store_consistent(make_ws, sig, rc, said):
    """SIGINT mid-build (and SIGTERM, taken the same way: a CI timeout, `kill`): exit 130 (143),
    the running sandbox is killed, nothing partial is cached, the staging area is empty, and the
    next build completes."""
    import signal
    import subprocess
    import sys
    import time

    from bgraph_testlib import hermetic_env

    ws = make_ws({"targets/p.toml": '[fast]\nkind = "genrule"\nouts = ["o"]\ncmd = "echo done > o"\n\n'
                                    '[slow]\nkind = "genrule"\nouts = ["o"]\ncmd = "echo part > o; sleep 30; echo x >> o"\n'})
    assert ws.build("//p:fast").rc == 0
    before = ws.ac_entries()
    proc = subprocess.Popen([sys.executable, "-m", "build_graph", "-C", str(ws.root), "--cache-dir", str(ws.cache),
                             "build", "//p:slow"], env=hermetic_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            # A shell's background job (`.ci/run &`) ignores SIGINT, and a child
                            # would inherit that: give it the default, as a terminal's Ctrl-C sees.
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 20
    while not list((ws.cache / "v1" / "tmp").glob("act-*")) and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.send_signal(getattr(signal, sig))
    _out, err = proc.communicate(timeout=20)
    assert proc.returncode == rc, err
    assert said in err
    assert ws.ac_entries() == before
    assert not list((ws.cache / "v1" / "tmp").glob("act-*"))
    assert ws.build("//p:fast").json["executed"] == 0


KILLED_BUILD = """
import os, signal, sys
from build_graph.store import action_cache, cas
when = sys.argv[1]
if when == "stored":  # the outputs' blobs and tree node are stored: die before the result is filed
    put_tree = cas.LocalCas.put_tree
    def killing(self, tree):
        digest = put_tree(self, tree)
        if "o" in tree.entries:
            os.kill(os.getpid(), signal.SIGKILL)
        return digest
    cas.LocalCas.put_tree = killing
else:  # the ac/ entry is written: die before the state row is flushed
    put = action_cache.LocalActionCache.put
    def killing(self, key, result):
        put(self, key, result)
        os.kill(os.getpid(), signal.SIGKILL)
    action_cache.LocalActionCache.put = killing
from build_graph.cli import main
sys.exit(main(sys.argv[2:]))
"""


@requires_bwrap
@pytest.mark.parametrize("when", ["stored", "entry written"])
def test_a_build_killed_between_storing_and_filing_leaves_the_cache_consistent(make_ws, when):
    """Outputs are stored and filed off the action's slot, in the order blob, tree node, ac/
    entry, state row: a build killed (SIGKILL) after the outputs are stored but before the
    result is filed leaves no entry (the next build runs the action again); one killed after
    the entry leaves an entry whose blobs are all there (the next build takes it as a hit).
    Either way `bgraph cache verify` finds nothing wrong and the next build's output is right."""
    import subprocess
    import sys

    from bgraph_testlib import hermetic_env

    ws = make_ws({"targets/p.toml": '[k]\nkind = "genrule"\nouts = ["o"]\ncmd = "echo made > o"\n'})
    proc = subprocess.run([sys.executable, "-c", KILLED_BUILD, "stored" if when == "stored" else "entry",
                           "-C", str(ws.root), "--cache-dir", str(ws.cache), "build", "//p:k"],
                          env=hermetic_env(), capture_output=True, text=True, timeout=120, cwd=ws.root)
    assert proc.returncode == -9, proc.stderr
    assert bool(ws.ac_entries()) is (when != "stored")
    verify = ws.cli("cache", "verify")
    assert verify.rc == 0, verify.output
    again = ws.build("//p:k")
    assert again.rc == 0, again.stderr
    assert action(again.json, "//p:k")["status"] == ("executed" if when == "stored" else "hit")
    assert ws.read_output("//p:k", "o") == "made\n"
    assert ws.cli("cache", "verify").rc == 0


# -- memory: learned peaks ----------------------------------------------------------------------------
@requires_bwrap
def test_peak_memory_is_measured_and_learned(make_ws):
    ws = make_ws({"targets/p.toml": '''[big]
kind = "genrule"
outs = ["o.txt"]
memory_mb = 8000
cmd = "/usr/bin/python3 -c 'import time; b = bytearray(300 << 20); b[::4096] = b\\"x\\" * len(b[::4096]); time.sleep(1)' && echo ok > $OUT/o.txt"
'''})
    run = ws.build("//p:big")
    assert run.rc == 0, run.output
    peak = action(run.json, "//p:big")["peak_mb"]
    assert 300 <= peak < 1000  # the grandchild's 300 MiB, seen through bwrap's process tree
    from build_graph.store.peaks import Peaks
    learned = Peaks(ws.store, ws.store).budget("//p:big genrule", 8000)
    assert learned == int(peak * 1.25)  # the next build budgets what it measured, not the declared 8000


@requires_bwrap
def test_check_against_another_cache_names_a_nondeterministic_action(make_ws, tmp_path):
    files = {"targets/p.toml": '''[stable]
kind = "genrule"
outs = ["s.txt"]
cmd = "echo same > $OUT/s.txt"

[random]
kind = "genrule"
outs = ["r.txt"]
cmd = "cat /proc/sys/kernel/random/uuid > $OUT/r.txt"
'''}
    first = make_ws(files)
    second = make_ws(files)
    assert first.build("//p:all").rc == 0 and second.build("//p:all").rc == 0
    run = second.build("//p:all", args=("--check-against", str(first.cache)))
    assert run.rc == 3
    assert run.json["differing"] == ["//p:random genrule"]
    assert run.json["compared_with_other_cache"] == 2


@requires_bwrap
def test_dry_run_lists_what_would_run_and_runs_nothing(make_ws):
    ws = make_ws(CUTOFF)
    assert ws.build("//p:b").rc == 0
    ws.write({"in.txt": "# a comment\nalpha\nbeta\ngamma\n"})
    dry = ws.build("//p:b", args=("--dry-run",))
    assert dry.rc == 0, dry.stderr
    s = dry.json
    assert s["would_run"] == 1 and s["executed"] == 0 and s["targets_unplanned"] == ["//p:a", "//p:b"]
    assert "in.txt" in action(s, "//p:a")["reason"]
    text = ws.cli("build", "-n", "//p:b")
    assert "would run //p:a genrule" in text.stdout and "1 action(s) would run" in text.stderr
    real = ws.build("//p:b")
    assert statuses(real.json) == {"//p:a": "executed", "//p:b": "executed"}


@requires_bwrap
def test_dry_run_keeps_no_plan_of_a_target_that_waits(make_ws):
    """A dry run of 100,000 targets held every waiting target's plan (2 GiB); it drops them."""
    from build_graph.build_run import BuildRun
    from build_graph.labels import parse_label
    ws = make_ws(CUTOFF)
    run = BuildRun(ws.engine(dry_run=True), [parse_label("//p:b")])
    result = run.run()
    assert [str(t) for t in result.unplanned] == ["//p:a", "//p:b"] and result.count("would-run") == 1
    assert not run.targets


@requires_bwrap
def test_dry_run_of_new_actions_writes_no_directory_nodes(make_ws):
    """A new action has no recorded inputs to compare with, so a miss stores none of its input
    trees (a dry run of 100,000 new genrules wrote 200,000 node files); a changed one still
    stores them, so that its reason names the changed file."""
    ws = make_ws(CUTOFF)
    assert ws.build("//p:b").rc == 0
    nodes = lambda: sorted(p.name for p in (ws.store / "dirs").rglob("*") if p.is_file())
    before = nodes()
    ws.write({"new.txt": "new\n", "targets/p.toml": CUTOFF["targets/p.toml"]
              + '[c]\nkind = "genrule"\nsrcs = ["new.txt"]\nouts = ["c.txt"]\ncmd = "cp $SRC/new.txt $OUT/c.txt"\n'})
    dry = ws.build("//p:c", args=("--dry-run",))
    assert dry.rc == 0, dry.stderr
    assert action(dry.json, "//p:c")["reason"] == "new action (never built)"
    assert nodes() == before
    ws.write({"in.txt": "# a comment\nalpha\nbeta\ngamma\n"})
    dry = ws.build("//p:a", args=("--dry-run",))
    assert action(dry.json, "//p:a")["reason"].startswith("input /bgraph/src/in.txt ")
    assert len(nodes()) > len(before)


@requires_bwrap
def test_dry_run_hashes_sources_without_storing_them(make_ws):
    """A dry run computes every key but runs nothing: it writes no source into the store (100,000
    file creations were a third of planning 100,000 genrules); the next real build stores them."""
    from build_graph.model import Digester
    ws = make_ws(CUTOFF)
    ws.write({"in.txt": "never stored before\n"})
    digest = Digester("blake3").of(b"never stored before\n")
    blob = ws.store / "cas" / digest[:2] / digest[2:]
    dry = ws.build("//p:b", args=("--dry-run",))
    assert dry.rc == 0 and dry.json["would_run"] >= 1, dry.stderr
    assert not blob.exists()
    real = ws.build("//p:b")
    assert real.rc == 0 and blob.exists(), real.stderr


def test_a_linked_source_is_stored_with_its_targets_mode(tmp_path):
    """A link's entry is its target's (mode included) on the first store as on later ones: the
    link's own mode (0777) made a first build's entry executable and the next one's not."""
    from build_graph.model import Digester
    from build_graph.store.cas import LocalCas
    cas = LocalCas(tmp_path / "cache", Digester("blake3"))
    (tmp_path / "t.txt").write_text("x\n")
    (tmp_path / "l.txt").symlink_to("t.txt")
    linked = cas.put_source(tmp_path / "l.txt")
    assert linked == cas.put_source(tmp_path / "t.txt") and not linked.executable


def test_explain_groups_a_big_targets_steps_by_translation_unit():
    """A target with many actions is explained per TU: the change that started it (a header a
    preprocessing step read), then the steps its outputs set off; cut-off steps are counted."""
    import io

    from rich.console import Console

    from build_graph.report import render_explain

    header = "input /bgraph/src/csrc/fp4/utils.cuh 1a2b… -> 3c4d…"
    records = [
        {"name": "hostpp obj/a.cu.o", "status": "executed", "reason": header, "duration_s": 1.0},
        {"name": "devpp obj/a.cu.o 121a", "status": "executed", "reason": header, "duration_s": 1.0},
        {"name": "cicc obj/a.cu.o 121a", "status": "executed", "duration_s": 5.0,
         "reason": "input /bgraph/in/a.compute_121a.cpp1.ii 5e… -> 6f…"},
        # Named by the mount's digest when the earlier input tree is no longer in the store
        {"name": "hostcc obj/a.cu.o", "status": "executed", "duration_s": 2.0,
         "reason": "input /bgraph/in 41f75c412e01… -> aa399f61512b…"},
    ] + [{"name": f"cicc obj/t{i}.cu.o 121a", "status": "cutoff", "reason": "upstream rebuilt to identical outputs",
          "duration_s": 0.0} for i in range(30)]
    out = io.StringIO()
    render_explain("//vllm:build", {"last_build": records}, Console(file=out, width=300, emoji=False))
    text = out.getvalue()
    assert "ran 4 steps of obj/a.cu.o (9.00s)" in text
    assert f"because (hostpp, devpp 121a): {header}" in text
    assert "then: cicc 121a, hostcc (their inputs, made by the steps above, changed)" in text
    assert "30 cut off and 0 hits not listed" in text and "cicc obj/t3.cu.o" not in text


TWINS = {
    "targets/p.toml": "".join(
        f'[{n}]\nkind = "genrule"\nouts = ["out.txt"]\nmemory_mb = 100\n'
        f'cmd = "sleep 0.5; echo $$ > $OUT/out.txt"\n\n' for n in ("x", "y"))
    + '[fails1]\nkind = "genrule"\nouts = ["o"]\ncmd = "sleep 0.5; exit 3"\n\n'
      '[fails2]\nkind = "genrule"\nouts = ["o"]\ncmd = "sleep 0.5; exit 3"\n',
}


@requires_bwrap
def test_one_action_planned_by_two_targets_at_once_runs_once(make_ws):
    """Two targets whose actions have one key, ready together at -j2: the action runs once and
    the second slot takes its outputs (Bazel's shared actions), so both outputs are one file."""
    ws = make_ws(TWINS)
    result = ws.engine_build("//p:x", "//p:y", jobs=2, max_mem_mb=400)
    assert not result.failures and result.count("executed") == 1 and result.count("hit") >= 1, result.records
    shared = [r for r in result.records if r.status == "hit" and r.reason.startswith("ran once in this build")]
    assert len(shared) == 1
    outputs = {str(label): out.tree for label, out in result.outputs.items() if str(label).startswith("//p:")}
    assert len(outputs) == 2 and len(set(outputs.values())) == 1, outputs  # one run, one output


@requires_bwrap
def test_a_shared_action_that_fails_fails_both_targets(make_ws):
    ws = make_ws(TWINS)
    result = ws.engine_build("//p:fails1", "//p:fails2", jobs=2, max_mem_mb=400, keep_going=True)
    assert result.count("executed") == 0 and result.count("failed") == 2, result.records
    assert {e.where.split()[0].rstrip(":") for e in result.failures} == {"//p:fails1", "//p:fails2"}, result.failures
