"""bgraph's priority (build_graph/priority.py: an action's expected seconds to the end of the
build, higher = start sooner) as REAPI's `ExecutionPolicy.priority` (an int32, lower = run
sooner, 0 = the server's default), so that the server's queue, not only the client's, starts the
critical path first when more Executes are in flight than the fleet has slots.

The mapping is logarithmic buckets, an absolute scale rather than ranks: an action's value does
not depend on what else is queued, so actions sent at different moments of a build (a chain's
later steps) compare correctly with those already waiting, and BuildGrid never needs a queued
job re-ranked (it re-ranks only when the same action is sent again with a better value).

    reapi = -min(MAX_LEVEL, round(LEVELS_PER_DOUBLING * log2(1 + seconds)))

- 0 s (or anything unknown, or BGRAPH_SCHEDULE=fifo's 0.0) is 0, the server's default;
- more expected time is a lower (more urgent) value, never a higher one (monotonic);
- 16 levels per doubling of (1 + seconds): two actions whose (1 + seconds) differ by more than
  about 4.4 % get different values; closer ones tie, and the server takes the older first;
- MAX_LEVEL bounds it (reached at 2^62 s: never, in practice): the values stay in
  [-MAX_LEVEL, 0], far inside int32, and a server shared with other clients sees bgraph's jobs
  between its default (0) and -1000, not at int32's edge.

BGRAPH_REMOTE_PRIORITY=off sends no priority (0 for every action), for comparisons; the client's
own order and every key are unchanged by either."""

from __future__ import annotations

import math
import os

LEVELS_PER_DOUBLING = 16
MAX_LEVEL = 1000


def reapi_priority(seconds: float | None) -> int:
    """The REAPI ExecutionPolicy.priority for an action expected to keep the build busy for
    `seconds` more (None, NaN or not above 0: 0, the server's default)."""
    if seconds is None or math.isnan(seconds) or seconds <= 0:
        return 0
    if math.isinf(seconds):
        return -MAX_LEVEL
    return -min(MAX_LEVEL, round(LEVELS_PER_DOUBLING * math.log2(1.0 + seconds)))


def sent() -> bool:
    """Whether priorities are sent at all (BGRAPH_REMOTE_PRIORITY=off: no, for comparisons)."""
    return os.environ.get("BGRAPH_REMOTE_PRIORITY") != "off"
