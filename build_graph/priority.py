"""Which ready action to start first (issue 36): the one with the longest expected time from its
start to the end of the build, as Ninja (1.12+, from .ninja_log), Bazel and Buck2 order theirs.

An action's priority is its expected duration plus the longest expected path through what waits
on it, from what is known when it is submitted:
- inside its target, the actions its end released in the last build (the `after` edges the
  build records: an action becomes ready when the last thing it waits on ends, so these edges are
  the ones its critical path ran through), each with its recorded duration;
- beyond its target, the targets that depend on it in this build's graph, each weighing the
  longest chain of its own recorded actions, and recursively what depends on them.

Durations and edges come from the previous builds' traces in this cache, by target label and
action name (stable when an edit changes every key). An action or target never recorded weighs
DEFAULT_S (Ninja's default weight is 1 too), so on a fresh cache the order is by depth alone.

Pure: no I/O, no clock. A priority only orders the scheduler's queue; what runs, every key and
every cache decision are made elsewhere and never read it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterable

DEFAULT_S = 1.0  # the expected seconds of an action no earlier build recorded


@dataclass(frozen=True)
class Timing:
    """What one target's last build recorded of its actions: seconds each, and which action's
    end released each (None or absent: ready when the target was planned)."""

    seconds: dict[str, float] = field(default_factory=dict)
    after: dict[str, str | None] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The trace's `timing` entry."""
        return {"seconds": dict(sorted(self.seconds.items())), "after": dict(sorted(self.after.items()))}

    @classmethod
    def from_trace(cls, trace: Any) -> "Timing":
        """A trace's `timing` (the cache's, but JSON all the same: anything malformed is dropped,
        never trusted and never an error)."""
        raw = trace.get("timing") if isinstance(trace, dict) else None
        if not isinstance(raw, dict):
            return cls()
        seconds = {n: float(s) for n, s in (raw.get("seconds") or {}).items()
                   if isinstance(n, str) and isinstance(s, (int, float)) and math.isfinite(s) and s >= 0} \
            if isinstance(raw.get("seconds"), dict) else {}
        after = {n: a for n, a in (raw.get("after") or {}).items()
                 if isinstance(n, str) and (a is None or isinstance(a, str))} \
            if isinstance(raw.get("after"), dict) else {}
        return cls(seconds, after)


def _fold(start: Hashable, children: Callable[[Hashable], Iterable[Hashable]],
          value: Callable[[Hashable], float], done: dict) -> None:
    """Put value(n) in `done` for `start` and everything `children` reaches from it, children
    first (value reads theirs from `done`), without recursion (a chain of thousands of steps or
    targets); a cycle, which a damaged trace could hold, is cut where it closes."""
    stack, open_ = [(start, False)], set()
    while stack:
        node, expanded = stack.pop()
        if expanded:
            open_.discard(node)
            done[node] = value(node)
            continue
        if node in done or node in open_:
            continue
        open_.add(node)
        stack.append((node, True))
        stack.extend((c, False) for c in children(node) if c not in done and c not in open_)


def remaining(t: Timing) -> dict[str, float]:
    """Each recorded action's expected seconds from its start to the end of the last action its
    end led to inside the target (its own seconds included)."""
    children: dict[str, list[str]] = {}
    for name, parent in t.after.items():
        if parent is not None and parent != name:
            children.setdefault(parent, []).append(name)
    out: dict[str, float] = {}

    def value(name: str) -> float:
        return t.seconds.get(name, DEFAULT_S) + max(
            (out[c] for c in children.get(name, ()) if c in out), default=0.0)

    for root in set(t.seconds) | set(t.after) | set(children):
        _fold(root, lambda n: children.get(n, ()), value, out)
    return out


def span(t: Timing) -> float:
    """The target's expected longest chain of its own actions (DEFAULT_S where none is recorded)."""
    rest = remaining(t)
    roots = [n for n in rest if t.after.get(n) is None]
    return max((rest[n] for n in roots or rest), default=DEFAULT_S)


class Priorities:
    """Priorities for one build: `dependents(target)` lists the targets of this build that wait on
    `target`; `timing(target)` is what the last build recorded of it. Each target's timing and
    tail are computed once, and only for targets whose actions are submitted (and what waits on
    them), so a build of hits computes none."""

    def __init__(self, dependents: Callable[[Hashable], Iterable[Hashable]],
                 timing: Callable[[Hashable], Timing]):
        self._dependents = dependents
        self._timing = timing
        self._timings: dict[Hashable, Timing] = {}
        self._remaining: dict[Hashable, dict[str, float]] = {}
        self._tails: dict[Hashable, float] = {}
        self._spans: dict[Hashable, float] = {}

    def _of(self, target: Hashable) -> Timing:
        if target not in self._timings:
            self._timings[target] = self._timing(target)
        return self._timings[target]

    def _span(self, target: Hashable) -> float:
        if target not in self._spans:
            self._spans[target] = span(self._of(target))
        return self._spans[target]

    def tail(self, target: Hashable) -> float:
        """The longest expected path through the targets that wait on `target` (0: none)."""
        if target not in self._tails:
            _fold(target, self._dependents, lambda t: max(
                (self._span(d) + self._tails.get(d, 0.0) for d in self._dependents(t)), default=0.0), self._tails)
        return self._tails[target]

    def of(self, target: Hashable, action: str) -> float:
        """`action` of `target`: its expected seconds to the end of the build."""
        if target not in self._remaining:
            self._remaining[target] = remaining(self._of(target))
        own = self._remaining[target].get(action, DEFAULT_S)
        return own + self.tail(target)
