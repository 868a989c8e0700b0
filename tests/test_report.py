"""Build progress (issue 23, item 4): counted in actions; a plain line at a steady interval where
the output is no terminal (a CI log), the live line on a terminal."""

from __future__ import annotations

import io
import re
import subprocess
import sys
import threading
import time

from rich.console import Console

from bgraph_testlib import hermetic_env, requires_bwrap
from build_graph.engine import ActionRecord
from build_graph.labels import parse_label
from build_graph.model import Action
from build_graph.report import BuildProgress, RichReporter


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_progress_counts_actions_known_so_far_and_says_when_more_are_to_plan():
    clock = Clock()
    p = BuildProgress(jobs=2, clock=clock)
    p.start(total_targets=3)
    assert p.line() == "[0s] planning 3 target(s), no action known yet"
    p.done("//p:a", "fetch x", "hit")
    p.started("//p:a", "cicc one", "Cicc")
    clock.now += 5
    p.started("//p:a", "cicc two", "Cicc")
    p.started("//p:a", "cicc three", "Cicc")  # no job slot: waits
    assert (p.done_count, p.known, len(p.running), len(p.waiting), p.unplanned) == (1, 4, 2, 1, 2)
    clock.now += 60
    line = p.line()
    assert line.startswith("[1m05s] 1/4 actions done (0 ran, 1 cached), 2 running, 1 waiting; ")
    assert "+ more to plan: 2 of 3 targets not planned yet" in line
    assert "running longest: //p:a cicc one (1m05s)" in line
    assert "ETA" not in line  # targets left to plan: the total is not known
    p.done("//p:a", "cicc one", "executed", "Cicc", 65.0)  # its slot goes to the waiting one
    assert set(p.running) == {("//p:a", "cicc two"), ("//p:a", "cicc three")} and not p.waiting
    p.target_done("//p:a")
    p.started("//p:b", "link", "Link")
    p.started("//p:c", "copy", "Copy")
    assert p.unplanned == 0
    assert p.eta_s() is None  # Link and Copy were never timed in this build
    assert "ETA" not in p.line()


def test_eta_only_from_timed_kinds_and_only_once_everything_is_planned():
    clock = Clock()
    p = BuildProgress(jobs=2, clock=clock)
    p.start(total_targets=1)
    for n in ("a", "b"):
        p.started("//p:t", f"cc {n}", "Cc")
    clock.now += 10
    p.done("//p:t", "cc a", "executed", "Cc", 10.0)
    p.done("//p:t", "cc b", "executed", "Cc", 20.0)  # mean 15 s
    for n in ("c", "d", "e"):
        p.started("//p:t", f"cc {n}", "Cc")
    clock.now += 5  # c and d have run 5 s: 10 s left each; e waits: 15 s
    assert p.eta_s() == (10 + 10 + 15) / 2
    assert p.line().endswith("; ETA ~17s for the known actions")
    # A failed action's target reports nothing more: its other actions stop counting.
    p.done("//p:t", "cc c", "failed")
    assert (p.failed, len(p.running), len(p.waiting)) == (1, 0, 0)
    assert "1 failed" in p.line()


def _record(label: str, name: str, status: str, mnemonic: str = "Genrule", duration_s: float = 0.0) -> ActionRecord:
    return ActionRecord(label, name, mnemonic, "k", status, "why", duration_s)


def test_terminal_live_line_counts_actions_not_targets():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=200)
    reporter = RichReporter(console, jobs=2)
    assert reporter.live
    reporter.start(total_targets=2)
    task = reporter.progress.tasks[0]
    assert task.total is None and task.fields["counts"] == "planning"  # no bar while the total is unknown
    action = Action(name="genrule", mnemonic="Genrule", argv=("true",))
    reporter.action_done(_record("//p:a", "fetch", "hit"))
    reporter.action_started(parse_label("//p:a"), action)
    task = reporter.progress.tasks[0]
    assert task.total is None and task.fields["counts"] == "1/2 actions + more to plan"
    reporter.action_done(_record("//p:a", "genrule", "executed", duration_s=1.0))
    reporter.target_done(parse_label("//p:a"))
    reporter.action_started(parse_label("//p:b"), action)  # the last target is planned: the bar has a total
    task = reporter.progress.tasks[0]
    assert (task.completed, task.total, task.fields["counts"]) == (2, 3, "2/3 actions")
    assert task.fields["status"].startswith("1 ran, 1 cached, 1 running, 0 waiting, ETA ~")
    reporter.finish()
    assert reporter._ticker is None  # a terminal gets no plain lines


def test_no_terminal_prints_plain_lines_at_the_interval():
    out = io.StringIO()
    reporter = RichReporter(Console(file=out, width=200), jobs=1, progress_interval_s=0.05)
    assert not reporter.live
    reporter.start(total_targets=1)
    reporter.action_started(parse_label("//p:a"), Action(name="genrule", mnemonic="Genrule", argv=("true",)))
    time.sleep(0.3)
    reporter.finish()
    lines = out.getvalue().splitlines()
    assert lines[0] == "[0s] planning 1 target(s), no action known yet"  # once at the start
    assert len(lines) >= 3 and all(re.match(r"\[\d+s\] ", l) for l in lines)
    assert "0/1 actions done (0 ran, 0 cached), 1 running, 0 waiting; running longest: //p:a genrule (0s)" in lines[-1]
    n = len(out.getvalue())
    time.sleep(0.15)
    assert len(out.getvalue()) == n  # finished: no more lines


# Two cached actions, then four that sleep 2 s each at -j2 (about 4 s), then one that needs them
# all (planned only once they are done); with //toolchains:host, 8 targets.
SLOW = {"targets/p.toml": "".join(
    f'[s{i}]\nkind = "genrule"\nouts = ["o"]\ncmd = "sleep 2; echo {i} > o"\n\n' for i in range(4))
    + '[c0]\nkind = "genrule"\nouts = ["o"]\ncmd = "echo c0 > o"\n\n'
    + '[c1]\nkind = "genrule"\nouts = ["o"]\ncmd = "echo c1 > o"\n\n'
    + '[all]\nkind = "genrule"\nouts = ["o"]\ncmd = "cat /bgraph/in/*/o > o"\n'
      'deps = { a = ":s0", b = ":s1", c = ":s2", d = ":s3", e = ":c0", f = ":c1" }\n'}


@requires_bwrap
def test_a_piped_build_prints_progress_lines_while_it_runs(make_ws):
    """`bgraph build` with stdout and stderr as pipes (a CI log): progress lines come during the
    build, each with the action counts, before the summary."""
    ws = make_ws(SLOW)
    assert ws.build("//p:c0", "//p:c1").rc == 0  # these two come from the cache below
    proc = subprocess.Popen(
        [sys.executable, "-m", "build_graph", "-C", str(ws.root), "--cache-dir", str(ws.cache), "build", "-j2",
         "//p:all"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ws.root,
        env=hermetic_env({"BGRAPH_PROGRESS_INTERVAL": "1"}))
    began = time.monotonic()
    lines: list[tuple[float, str]] = []
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(proc.stdout))
    reader.start()
    for line in proc.stderr:  # as the lines come
        lines.append((time.monotonic() - began, line.rstrip("\n")))
    proc.wait(timeout=60)
    reader.join()
    ended = time.monotonic() - began
    text = "\n".join(l for _t, l in lines)
    assert proc.returncode == 0, text + "".join(out)
    summary = next(t for t, l in lines if l.startswith("OK: executed 5"))
    progress = [(t, l) for t, l in lines if re.match(r"\[\d+(m\d\ds)?s?\] ", l)]
    assert progress and progress[0][1].startswith("[0s] planning 8 target(s)"), text
    during = [(t, l) for t, l in progress if " actions done " in l]
    assert len(during) >= 2, text  # the build takes about 4 s; a line each second
    assert all(t < summary for t, _l in progress) and during[0][0] < ended - 1.5, lines
    counts = [re.search(r"(\d+)/(\d+) actions done \((\d+) ran, (\d+) cached\), (\d+) running, (\d+) waiting", l)
              for _t, l in during]
    assert all(counts), text
    first = counts[0]
    assert first.group(4) == "2" and int(first.group(5)) == 2  # the cached two; two of the sleepers running
    assert "+ more to plan: 1 of 8 targets not planned yet" in during[0][1]  # //p:all waits on them
    assert "running longest: //p:s" in during[0][1]
    done = [int(c.group(1)) for c in counts]
    assert done == sorted(done)
