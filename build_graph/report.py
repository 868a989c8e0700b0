"""Progress, summaries, and the rendering of `why`, `query` and `explain`."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Iterable

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.tree import Tree as RichTree

from build_graph.labels import Label
from build_graph.model import Action


PROGRESS_INTERVAL_S = 30.0  # where the output is no terminal: one progress line this often
PROGRESS_INTERVAL_ENV = "BGRAPH_PROGRESS_INTERVAL"  # seconds; overrides the default (tests use 1)


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m"


class BuildProgress:
    """What a progress report says, counted in actions (not targets) from the engine's reporter
    calls: actions done of those known so far (ran, cached, failed), how many run and wait, the
    targets not planned yet (their actions are not known: the total can only grow while there
    are any, and rules plan follow-up steps from earlier outputs too), the action running
    longest, and an ETA for the known actions, from the mean time of each kind of step in this
    build, given only when no target is left to plan and every kind in flight has been timed.

    The engine says when an action is handed to the scheduler, not when it starts: which of
    the handed-over actions run is followed the scheduler's way (at most `jobs`, first come
    first served; a job held back for memory can make this differ for a while)."""

    def __init__(self, jobs: int = 1, clock=time.monotonic):
        self.jobs, self.clock = max(jobs, 1), clock
        self.began = clock()
        self.total_targets = 0
        self.targets_seen: set[str] = set()  # targets with an action known, or done
        self.targets_done = 0
        self.ran = self.cached = self.failed = self.other = 0
        self.running: dict[tuple[str, str], tuple[str, float]] = {}  # (label, name) -> (mnemonic, since)
        self.waiting: dict[tuple[str, str], str] = {}  # handed over, no job slot yet (insertion order)
        self.took: dict[str, list[float]] = {}  # mnemonic -> durations of executed actions
        self.lock = threading.RLock()

    # -- what the engine reports ----------------------------------------------------------
    def start(self, total_targets: int) -> None:
        with self.lock:
            self.began, self.total_targets = self.clock(), total_targets

    def started(self, label: str, name: str, mnemonic: str) -> None:
        with self.lock:
            self.targets_seen.add(label)
            if len(self.running) < self.jobs:
                self.running[(label, name)] = (mnemonic, self.clock())
            else:
                self.waiting[(label, name)] = mnemonic

    def done(self, label: str, name: str, status: str, mnemonic: str = "", duration_s: float = 0.0) -> None:
        with self.lock:
            self.targets_seen.add(label)
            key = (label, name)
            self.running.pop(key, None)
            self.waiting.pop(key, None)
            if status in ("hit", "cutoff"):
                self.cached += 1
            elif status == "executed":
                self.ran += 1
                self.took.setdefault(mnemonic, []).append(duration_s)
            elif status == "failed":
                self.failed += 1
                # The engine reports nothing more of a failed target's other actions: stop counting them.
                for k in [k for k in (*self.running, *self.waiting) if k[0] == label]:
                    self.running.pop(k, None)
                    self.waiting.pop(k, None)
            else:
                self.other += 1  # would-run (--dry-run)
            while self.waiting and len(self.running) < self.jobs:  # a job slot came free
                k = next(iter(self.waiting))
                self.running[k] = (self.waiting.pop(k), self.clock())

    def target_done(self, label: str) -> None:
        with self.lock:
            self.targets_seen.add(label)
            self.targets_done += 1

    # -- what to say ----------------------------------------------------------------------
    @property
    def done_count(self) -> int:
        return self.ran + self.cached + self.failed + self.other

    @property
    def known(self) -> int:
        return self.done_count + len(self.running) + len(self.waiting)

    @property
    def unplanned(self) -> int:
        """Targets whose planning has not begun (they wait on dependencies)."""
        return max(0, self.total_targets - len(self.targets_seen))

    def longest(self) -> tuple[str, float] | None:
        """The action running longest: 'label name' and its seconds so far."""
        if not self.running:
            return None
        (label, name), (_m, since) = min(self.running.items(), key=lambda kv: kv[1][1])
        return f"{label} {name}", self.clock() - since

    def eta_s(self) -> float | None:
        """Seconds to finish the known actions at the mean pace of their kinds in this build, or
        None where that would mislead: targets left to plan, or a kind in flight never timed."""
        with self.lock:
            if self.unplanned or not (self.running or self.waiting):
                return None
            mean = {m: sum(d) / len(d) for m, d in self.took.items()}
            now, work = self.clock(), 0.0
            for m, since in self.running.values():
                if m not in mean:
                    return None
                work += max(0.0, mean[m] - (now - since))
            for m in self.waiting.values():
                if m not in mean:
                    return None
                work += mean[m]
            return work / self.jobs

    def counts(self) -> str:
        """'532/1140 actions done' plus, while targets wait to be planned, that more will come."""
        text = f"{self.done_count}/{self.known} actions"
        return text + (" + more to plan" if self.unplanned else "")

    def line(self) -> str:
        """One plain line (a CI log's progress report)."""
        with self.lock:
            parts = [f"[{_duration(self.clock() - self.began)}]"]
            if not self.known:
                parts.append(f"planning {self.total_targets} target(s), no action known yet")
                return " ".join(parts)
            done = f"{self.done_count}/{self.known} actions done ({self.ran} ran, {self.cached} cached"
            done += f", {self.failed} failed)" if self.failed else ")"
            parts.append(done + f", {len(self.running)} running, {len(self.waiting)} waiting")
            if self.unplanned:
                parts[-1] += f"; + more to plan: {self.unplanned} of {self.total_targets} targets not planned yet"
            longest = self.longest()
            if longest:
                parts[-1] += f"; running longest: {longest[0]} ({_duration(longest[1])})"
            eta = self.eta_s()
            if eta is not None:
                parts[-1] += f"; ETA ~{_duration(eta)} for the known actions"
            return " ".join(parts)

    def status(self) -> str:
        """The terminal's live line, after its bar and counts."""
        with self.lock:
            status = f"{self.ran} ran, {self.cached} cached, {len(self.running)} running, {len(self.waiting)} waiting"
            eta = self.eta_s()
            if eta is not None:
                status += f", ETA ~{_duration(eta)}"
            longest = self.longest()
            if longest:
                status += f" — longest: {longest[0][:80]} ({_duration(longest[1])})"
            return status


class RichReporter:
    """Progress in actions (done of those known so far, ran / cached, what runs longest, ETA
    when honest; see BuildProgress). On a terminal, one live line; where the output is no
    terminal (a CI log), a plain line at the start and then every `progress_interval_s`
    (default 30 s, or $BGRAPH_PROGRESS_INTERVAL). Each executed action's line goes to the
    log file, and to the screen only with --verbose."""

    def __init__(self, console: Console, jobs: int = 1, verbose: bool = False, log_path: Path | None = None,
                 progress_interval_s: float | None = None):
        self.console, self.jobs, self.verbose = console, max(jobs, 1), verbose
        self.log = open(log_path, "w") if log_path else None
        self.state = BuildProgress(self.jobs)
        self.lock = threading.Lock()
        self.live = console.is_terminal and not console.is_dumb_terminal
        if progress_interval_s is None:
            progress_interval_s = _interval_from_env()
        self.interval_s = progress_interval_s
        self.progress = Progress(SpinnerColumn(), TextColumn("[bold]{task.description}"), BarColumn(),
                                 TextColumn("{task.fields[counts]}"), TextColumn("[dim]|[/] {task.fields[status]}"),
                                 TimeElapsedColumn(), console=console, transient=True)
        self.task = None
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None

    def start(self, total_targets: int) -> None:
        self.state.start(total_targets)
        if self.live:
            self.progress.start()
            self.task = self.progress.add_task("actions", total=None, counts="planning", status="")
            return
        self._print_line()
        self._ticker = threading.Thread(target=self._tick, name="bgraph-progress", daemon=True)
        self._ticker.start()

    def _tick(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._print_line()

    def _print_line(self) -> None:
        self.console.print(self.state.line(), markup=False, highlight=False, soft_wrap=True)

    def eta_s(self) -> float | None:
        return self.state.eta_s()

    def _refresh(self) -> None:
        if self.task is None:
            return
        s = self.state
        # The bar fills only once every target is planned: before that the total is unknown.
        self.progress.update(self.task, total=None if s.unplanned else max(s.known, 1), completed=s.done_count,
                             counts=escape(s.counts()), status=escape(s.status()))

    def action_started(self, label: Label, action: Action) -> None:
        with self.lock:
            self.state.started(str(label), action.name, action.mnemonic)
            self._refresh()

    def action_done(self, record) -> None:
        with self.lock:
            self.state.done(record.label, record.name, record.status, record.mnemonic, record.duration_s)
            if record.status == "executed":
                cpu = f", CPU {record.cpu_s:.2f}s" if record.cpu_s else ""
                peak = f", peak {record.peak_mb} MiB" if record.peak_mb else ""
                line = f"ran {record.label} {record.name} ({record.duration_s:.2f}s{cpu}{peak}) — {record.reason}"
                if self.log:
                    self.log.write(line + "\n")
                    self.log.flush()
                if self.verbose:
                    self.console.print(f"[green]ran[/] {record.label} [dim]{escape(record.name)}[/] "
                                       f"({record.duration_s:.2f}s) [dim]— {escape(record.reason)}[/]", highlight=False)
            elif record.status == "failed":
                if self.log:
                    self.log.write(f"FAILED {record.label} {record.name}\n")
                self.console.print(f"[red]FAILED[/] {record.label} {escape(record.name)}", highlight=False)
            self._refresh()

    def target_done(self, label: Label) -> None:
        with self.lock:
            self.state.target_done(str(label))
            self._refresh()

    def finish(self) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join(timeout=5)
        if self.live:
            self.progress.stop()
        if self.log:
            self.log.close()


def _interval_from_env() -> float:
    text = os.environ.get(PROGRESS_INTERVAL_ENV, "")
    try:
        value = float(text)
    except ValueError:
        return PROGRESS_INTERVAL_S
    return value if value > 0 else PROGRESS_INTERVAL_S


def print_summary(console: Console, summary: dict[str, Any]) -> None:
    state = "[green]OK[/]" if summary["ok"] else "[red]FAILED[/]"
    if summary.get("would_run"):
        waiting = len(summary["targets_unplanned"]) if "targets_unplanned" in summary else 0
        console.print(f"dry run: {summary['would_run']} action(s) would run, cache hits {summary['hits']}"
                      + (f"; {waiting} target(s) wait on their outputs" if waiting else ""), highlight=False)
        return
    console.print(f"{state}: executed {summary['executed']}, cache hits {summary['hits']}, "
                  f"cut off {summary['cut_off']}, failed {summary['failed']}, wall {summary['wall_s']:.2f}s"
                  + (f", actions' CPU {summary['cpu_s']:.1f}s" if summary.get("cpu_s") else "")
                  + (f" ({summary['targets_reused']} target(s) unchanged since the last build, not replanned)"
                     if summary.get("targets_reused") else ""), highlight=False)
    if "remote" in summary:
        r = summary["remote"]
        console.print(f"remote cache: {r['hits']} hits, {r['misses']} misses, {r['ignored']} ignored, "
                      f"{r['uploaded']} uploaded", highlight=False)
    if summary["differing"]:
        console.print(f"[red]{len(summary['differing'])} action(s) produced different outputs:[/]")
        for d in summary["differing"]:
            console.print(f"  {escape(d)}", highlight=False)


def render_labels(labels: Iterable[Label], edges: list[tuple[Label, Label]], fmt: str, console: Console,
                  kinds: dict[Label, str]) -> None:
    labels = list(labels)
    if fmt == "json":
        print(json.dumps({"targets": [{"label": str(l), "kind": kinds[l]} for l in labels],
                          "edges": [[str(a), str(b)] for a, b in edges]}, indent=1))
    elif fmt == "tree":
        console.print(paths_tree(labels, edges))
    else:
        for label in labels:
            print(label)


def paths_tree(labels: list[Label], edges: list[tuple[Label, Label]], root: Label | None = None) -> RichTree:
    """Render a DAG (edges: target -> dependency) as a tree from its roots."""
    children: dict[Label, list[Label]] = {}
    has_parent = set()
    for a, b in edges:
        children.setdefault(a, []).append(b)
        has_parent.add(b)
    roots = [root] if root else [l for l in labels if l not in has_parent] or labels[:1]
    top = RichTree("[bold]query[/]", hide_root=True)

    def add(node: RichTree, label: Label, seen: tuple[Label, ...]) -> None:
        branch = node.add(str(label))
        for child in sorted(children.get(label, [])):
            if child not in seen:
                add(branch, child, seen + (child,))

    for r in roots:
        add(top, r, (r,))
    return top


def _step_and_subject(name: str) -> tuple[str, str]:
    """'cicc obj/a.cu.o 121a' -> ('cicc 121a', 'obj/a.cu.o'); a one-word name is its own subject."""
    parts = name.split(" ")
    if len(parts) < 2:
        return name, name
    return " ".join([parts[0], *parts[2:]]), parts[1]


def _is_downstream(reason: str) -> bool:
    """A miss caused by a file an earlier step of the same build made (/bgraph/in holds those),
    named by path, or by the mount's digest where the earlier inputs are no longer stored."""
    return reason.startswith(("input /bgraph/in/", "input /bgraph/in "))


LIST_ALL_UNDER = 20  # targets with more actions than this are summarized per subject (per TU)


def render_explain(label: str, trace: dict[str, Any], console: Console, show_all: bool = False) -> None:
    records = trace.get("last_build") or []
    if not records:
        console.print(f"{label}: no recorded build")
        return
    by = {s: [r for r in records if r["status"] == s] for s in ("executed", "cutoff", "hit")}
    console.print(f"[bold]{label}[/]: last build executed {len(by['executed'])}, cut off {len(by['cutoff'])}, "
                  f"hits {len(by['hit'])}", highlight=False)
    small = len(records) <= LIST_ALL_UNDER
    if small or show_all:
        for r in by["executed"]:
            console.print(f"  [green]ran[/] {escape(r['name'])} ({r['duration_s']:.2f}s)\n"
                          f"      why: {escape(r['reason'])}", highlight=False)
    else:
        # Per subject (a TU's object, for compile steps): the steps that ran because of a change
        # outside this build, then those that ran because an earlier step's output changed.
        groups: dict[str, list[dict]] = {}
        for r in by["executed"]:
            groups.setdefault(_step_and_subject(r["name"])[1], []).append(r)
        for subject, rs in groups.items():
            took = sum(r["duration_s"] for r in rs)
            if len(rs) == 1:
                console.print(f"  [green]ran[/] {escape(rs[0]['name'])} ({took:.2f}s)\n"
                              f"      why: {escape(rs[0]['reason'])}", highlight=False)
                continue
            console.print(f"  [green]ran[/] {len(rs)} steps of {escape(subject)} ({took:.2f}s)", highlight=False)
            causes: dict[str, list[str]] = {}
            for r in rs:
                if not _is_downstream(r["reason"]):
                    causes.setdefault(r["reason"], []).append(_step_and_subject(r["name"])[0])
            for reason, steps in causes.items():
                console.print(f"      because ({escape(', '.join(steps))}): {escape(reason)}", highlight=False)
            later = [_step_and_subject(r["name"])[0] for r in rs if _is_downstream(r["reason"])]
            if later:
                console.print(f"      then: {escape(', '.join(later))} (their inputs, made by the steps above, "
                              "changed)", highlight=False)
    if small or show_all:
        for r in by["cutoff"]:
            console.print(f"  [yellow]cut off[/] {escape(r['name'])}: {escape(r['reason'])}", highlight=False)
        for r in by["hit"]:
            console.print(f"  [dim]hit {escape(r['name'])}[/]", highlight=False)
    elif by["cutoff"] or by["hit"]:
        console.print(f"  [dim]{len(by['cutoff'])} cut off and {len(by['hit'])} hits not listed "
                      "(--all lists them)[/]", highlight=False)
