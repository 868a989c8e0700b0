"""`bgraph build --profile FILE`: the build's timeline in the Chrome trace event format (open it in
Perfetto or chrome://tracing), as Bazel's --profile does: what the planning thread did, and when
each executed action ran, split into running its process and the sandbox and store work around it."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from build_graph.errors import BgraphError, UsageError


@dataclass
class Span:
    name: str
    category: str  # plan | action, and an action's phases: sandbox | process | store
    start: float  # time.monotonic()
    end: float
    args: dict[str, Any] = field(default_factory=dict)
    parent: "Span | None" = None  # a phase of an action: drawn in its action's lane


class Profile:
    """Spans collected from the planning thread and the action threads of one build."""

    def __init__(self, jobs: int) -> None:
        self.jobs = jobs
        self.origin = time.monotonic()
        self.spans: list[Span] = []
        self._lock = threading.Lock()

    def add(self, span: Span) -> Span:
        with self._lock:
            self.spans.append(span)
        return span

    def plan(self, name: str, start: float, **args: Any) -> None:
        """A stretch of the planning thread (planning a target, taking an action's result back)."""
        self.add(Span(name, "plan", start, time.monotonic(), args))

    def action(self, name: str, start: float, stamps: dict[str, float], end: float, **args: Any) -> None:
        """An executed action, from its thread's start to its result filed, with the phases whose
        stamps the runner left: setting up the sandbox, the process, taking its outputs into the
        store (up to `stamps["executed"]`), then filing the result."""
        outer = self.add(Span(name, "action", start, end, args))
        executed = stamps.get("executed", end)
        if "process_start" in stamps:
            phases = [("set up sandbox", "sandbox", start, stamps["process_start"]),
                      ("process", "process", stamps["process_start"], stamps["process_end"]),
                      ("take outputs into the store", "store", stamps["process_end"], executed)]
        else:  # a fetch or an archive extraction: no sandboxed process
            phases = [("run", "process", start, executed)]
        for phase, category, a, b in phases + [("file result", "store", executed, end)]:
            self.add(Span(phase, category, a, max(a, b), parent=outer))

    def summary(self, wall_s: float) -> dict[str, Any]:
        """How busy the action lanes and the planning thread were, over the build's wall time."""
        actions = [s for s in self.spans if s.category == "action"]
        process = sum(s.end - s.start for s in self.spans if s.category == "process")
        busy = sum(s.end - s.start for s in actions)
        planning = sum(s.end - s.start for s in self.spans if s.category == "plan")
        capacity = max(wall_s, 1e-9) * max(self.jobs, 1)
        return {"actions": len(actions), "action_s": round(busy, 3), "process_s": round(process, 3),
                "sandbox_and_store_s": round(busy - process, 3), "planning_thread_s": round(planning, 3),
                "lanes_busy": round(busy / capacity, 3)}

    def chrome_trace(self) -> dict[str, Any]:
        """The trace event JSON: the planning thread is lane 0; actions are packed into the fewest
        lanes (1, 2, …) in which none overlaps another; an action's phases share its lane."""
        lanes_end: list[float] = []
        lane_of: dict[int, int] = {}
        events: list[dict[str, Any]] = []
        for span in sorted(self.spans, key=lambda s: (s.start, s.parent is not None)):
            if span.category == "plan":
                tid = 0
            elif span.parent is not None:
                tid = lane_of.get(id(span.parent), 0)
            else:
                free = next((i for i, end in enumerate(lanes_end) if end <= span.start), None)
                if free is None:
                    lanes_end.append(span.end)
                    free = len(lanes_end) - 1
                lanes_end[free] = span.end
                tid = lane_of[id(span)] = free + 1
            events.append({"name": span.name, "cat": span.category, "ph": "X", "pid": 1, "tid": tid,
                           "ts": round((span.start - self.origin) * 1e6), "dur": round((span.end - span.start) * 1e6),
                           **({"args": span.args} if span.args else {})})
        names = [{"name": "thread_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": "planning and cache checks"}}]
        names += [{"name": "thread_name", "ph": "M", "pid": 1, "tid": i + 1, "args": {"name": f"action lane {i + 1}"}}
                  for i in range(len(lanes_end))]
        return {"traceEvents": names + events, "displayTimeUnit": "ms"}

    def write(self, path: Path) -> None:
        """Write the trace to `path`; a BgraphError naming it where that fails (a full disk: the
        cache is not to blame, and `cache gc` is no remedy)."""
        try:
            path.write_text(json.dumps(self.chrome_trace()))
        except OSError as e:
            raise BgraphError(f"cannot write the profile to {path}: {e.strerror or e}",
                              hint="free space where it goes, or give --profile a file on another disk; "
                                   "the build itself is done and its outputs are linked") from None


def writable_profile_path(path: str) -> Path:
    """`path`, once it is known to be writable (checked before the build, not after an hour of it)."""
    p = Path(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        with open(p, "a"):
            pass
    except OSError as e:
        raise UsageError(f"cannot write the profile to {path}: {e.strerror}",
                         hint="give --profile a file in a writable directory") from None
    return p
