"""Progress, summaries, and the rendering of `why`, `query` and `explain`."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, Iterable

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.tree import Tree as RichTree

from build_graph.labels import Label
from build_graph.model import Action


class RichReporter:
    """One live line: targets done/total, actions done (ran / cached), what is running, and an
    ETA for the work already queued (from the mean time of each kind of step so far). Each
    executed action's line goes to the log file, and to the screen only with --verbose."""

    def __init__(self, console: Console, jobs: int = 1, verbose: bool = False, log_path: Path | None = None):
        self.console, self.jobs, self.verbose = console, max(jobs, 1), verbose
        self.log = open(log_path, "w") if log_path else None
        self.running: dict[int, tuple[str, str]] = {}  # id(action) -> (name, mnemonic)
        self.hits = 0
        self.executed = 0
        self.took: dict[str, list[float]] = {}  # mnemonic -> durations of executed actions
        self.lock = threading.Lock()
        self.progress = Progress(SpinnerColumn(), TextColumn("[bold]{task.description}"), BarColumn(),
                                 MofNCompleteColumn(), TextColumn("{task.fields[status]}"), TimeElapsedColumn(),
                                 console=console, transient=True)
        self.task = None

    def start(self, total_targets: int) -> None:
        self.progress.start()
        self.task = self.progress.add_task("targets", total=total_targets, status="")

    def eta_s(self) -> float | None:
        """Seconds to finish the queued and running actions at the mean pace of their kinds."""
        known = [m for _n, m in self.running.values() if m in self.took]
        if not known:
            return None
        return sum(sum(self.took[m]) / len(self.took[m]) for m in known) / self.jobs

    def _refresh(self) -> None:
        names = [n for n, _m in self.running.values()]
        status = (f"actions {self.executed + self.hits} done ({self.executed} ran, {self.hits} cached), "
                  f"{len(names)} queued or running")
        eta = self.eta_s()
        if eta is not None:
            status += f", ETA {int(eta // 60)}m{int(eta % 60):02d}s"
        if names:
            status += ": " + escape(", ".join(names[:2]))[:120] + (" …" if len(names) > 2 else "")
        self.progress.update(self.task, status=status)

    def action_started(self, label: Label, action: Action) -> None:
        with self.lock:
            self.running[id(action)] = (action.name, action.mnemonic)
            self._refresh()

    def action_done(self, record) -> None:
        with self.lock:
            self.running = {k: v for k, v in self.running.items() if v[0] != record.name}
            if record.status in ("hit", "cutoff"):
                self.hits += 1
            elif record.status == "executed":
                self.executed += 1
                self.took.setdefault(record.mnemonic, []).append(record.duration_s)
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
        self.progress.advance(self.task)

    def finish(self) -> None:
        self.progress.stop()
        if self.log:
            self.log.close()


def print_summary(console: Console, summary: dict[str, Any]) -> None:
    state = "[green]OK[/]" if summary["ok"] else "[red]FAILED[/]"
    if summary.get("would_run"):
        waiting = len(summary["targets_unplanned"]) if "targets_unplanned" in summary else 0
        console.print(f"dry run: {summary['would_run']} action(s) would run, cache hits {summary['hits']}"
                      + (f"; {waiting} target(s) wait on their outputs" if waiting else ""), highlight=False)
        return
    console.print(f"{state}: executed {summary['executed']}, cache hits {summary['hits']}, "
                  f"cut off {summary['cut_off']}, failed {summary['failed']}, wall {summary['wall_s']:.2f}s"
                  + (f", actions' CPU {summary['cpu_s']:.1f}s" if summary.get("cpu_s") else ""), highlight=False)
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
