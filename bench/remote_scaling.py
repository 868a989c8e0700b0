"""How a build would scale over 1, 2, 4, ... 256 remote workers (issue 36): a list-scheduling
simulation driven by a recorded build's actions, their durations, their dependencies and the bytes
each one reads and writes, plus a check of the simulation against real 1- and 2-worker runs.

    python3 bench/remote_scaling.py recorded --cache /var/tmp/vllm-cache \\
        --log /var/tmp/vllm-cache/logs/build-20261127-072024.log --json vllm.json
    python3 bench/remote_scaling.py flashinfer --json flashinfer.json     # an ESTIMATE (see below)
    python3 bench/remote_scaling.py check --json check.json               # real runs, ~5 minutes
    python3 bench/remote_scaling.py order --json order.json               # FIFO vs priority, real runs

**What is recorded, and where** (nothing of the cache is written: its state file is opened
read-only and directory nodes are read as files): each target's trace (`traces` rows of
`<cache>/v1/<fn>/state-v2.sqlite`) names its actions, their key and their description (kind, input
trees per mount); the action's result (`results` row, else `ac/<key>.json`; a depfile action's
trace key is its pre-key, whose `.reads.json` manifest names the key its result is filed under)
gives its wall (`duration_s`) and its processes' CPU (`cpu_s`, 0 where not measured) and its output
tree; directory nodes (`dirs/`) give every tree's blobs and sizes. **Dependencies are not recorded
as such**: an action depends on the actions whose output blobs (or output directories) its input
trees hold, found by walking its input trees (for a depfile action's narrowed mounts, the files
its manifest says it read). A blob produced by several actions (identical bytes) counts as produced
by the earliest of them to finish (the build log's order, else the results' filing order); empty
files are no dependency. Waits that no data shows are added: every action of a target waits for
the target's planning actions (CMake configure, Ninja generator, nvcc dry run) that ended before it.

**The model** (`simulate`, pure): W workers of `slots` slots each run the exec actions; the
client's own `local_jobs` lanes run fetches and unpacks (they stay local, as `--remote-executor`
does). An action is ready when every producer's outputs are back on the client (bgraph fetches all
outputs of a remote action before its dependents start: a blake3 workspace keys them by blake3).
Ready actions are taken in FIFO order (bgraph's scheduler before issue 36's priorities, and with
BGRAPH_SCHEDULE=fifo), longest-remaining-path first (`--priority critical`: the ideal, from the
true graph and durations), or by bgraph's own priority (`--priority bgraph`: build_graph/priority.py
fed only what a previous build of the same graph would have recorded, see `bgraph_ranks`). A remote action on worker w: the client first uploads the inputs the
server lacks (client link), then w downloads the input blobs its own CAS lacks (server link, at
most the worker's bandwidth), is held for the action's duration plus its own overhead
(`overhead_s`: fetch, staging, collection, upload: 47-65 ms measured for a trivial action),
uploads its outputs (server link),
and the client sees the action done `latency_s` later (the rest of Execute to done: BuildGrid's
queue and SQL, the lease, the client's stream: 236-250 ms in all for a trivial action alone,
463 ms median with 2 in flight under load; BENCHMARKS.md "Remote execution on BuildGrid") and
fetches its outputs (client link). Latency delays dependents but holds no worker: with actions
queued, a worker takes its next lease at once. A link carries one transfer at a time (each takes
the earliest gap long enough for it). Worker caches start empty (cold) or holding everything the
remote actions did not make (`--warm`: a fleet that has the toolchains already).
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import json
import math
import os
import re
import sqlite3
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import networkx as nx

REPO = Path(__file__).resolve().parents[1]
WORKERS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
GB = 1e9
# Actions whose outputs plan the rest of their target (a CMake configure, a Ninja generator, nvcc's
# dry run): the actions planned from them read nothing of theirs, so no data edge shows the wait.
PLANNING = frozenset({"CmakeConfigure", "NinjaGenerate", "CudaDryrun"})


# -- the model ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Params:
    """One simulated setting. Bandwidths in bytes per second (math.inf: transfers are free)."""

    workers: int
    slots: int = 1
    local_jobs: int = 2
    overhead_s: float = 0.06  # a worker's own time per action (fetch, staging, collection, upload)
    latency_s: float = 0.19  # the rest of Execute-to-done: queue, lease, the client seeing it done
    worker_bw: float = 1.25 * GB  # 10 Gb/s per worker
    server_bw: float = 3.125 * GB  # 25 Gb/s at the CAS server, shared by every worker
    client_bw: float = 1.25 * GB  # the client's own link, shared by its uploads and fetches
    priority: str = "fifo"  # fifo | critical (longest remaining path first) | bgraph (priority.py's)
    warm: bool = False  # workers and server start with every blob no remote action makes


class Link:
    """A link that carries one transfer at a time at its bandwidth: a transfer takes the earliest
    gap, at or after the time it is asked for, long enough for it (transfers are booked when an
    action starts, its upload ahead of the transfers other actions ask for meanwhile)."""

    def __init__(self, bandwidth: float):
        self.bandwidth = bandwidth
        self.busy: list[tuple[float, float]] = []  # booked (start, end), sorted, disjoint
        self.bytes = 0

    def transfer(self, t: float, nbytes: int, cap: float = math.inf) -> float:
        """When `nbytes` sent at `t` have arrived (the sender's own `cap` may be lower)."""
        self.bytes += max(nbytes, 0)
        if nbytes <= 0 or math.isinf(self.bandwidth) and math.isinf(cap):
            return t
        length = nbytes / self.bandwidth
        i = max(bisect.bisect_right(self.busy, (t, math.inf)) - 1, 0)
        start = t
        while i < len(self.busy):
            b0, b1 = self.busy[i]
            if b1 <= start:
                i += 1
                continue
            if b0 >= start + length:
                break
            start = b1
            i += 1
        bisect.insort(self.busy, (start, start + length))
        return start + nbytes / min(self.bandwidth, cap)


def critical_path(g: nx.DiGraph, overhead_s: float = 0.0) -> tuple[float, list[str]]:
    """The longest path by duration (each remote action plus `overhead_s`: its overhead and
    latency) and its actions."""
    best: dict[str, tuple[float, str | None]] = {}
    for n in nx.topological_sort(g):
        own = g.nodes[n]["seconds"] + (overhead_s if g.nodes[n].get("remote", True) else 0.0)
        before = max(((best[p][0], p) for p in g.predecessors(n)), default=(0.0, None))
        best[n] = (before[0] + own, before[1])
    if not best:
        return 0.0, []
    end = max(best, key=lambda n: best[n][0])
    length, path = best[end][0], []
    node: str | None = end
    while node is not None:
        path.append(node)
        node = best[node][1]
    return length, path[::-1]


def bgraph_ranks(g: nx.DiGraph, recorded: str = "wall_s") -> dict[str, float]:
    """The priority bgraph's scheduler gives each action (build_graph/priority.py), from what a
    previous build of this graph left in its traces, not from the graph itself: per target (node
    attribute `label`; none: one target), each action's recorded seconds (the node's `recorded`
    attribute, else `seconds`: bgraph records an action's wall, not its CPU) and the action whose
    end released it (its predecessor in the same target that ended last, by `order`); between
    targets, only which target waits on which (an edge between two targets' actions)."""
    sys.path.insert(0, str(REPO))
    from build_graph.priority import Priorities, Timing
    nodes = g.nodes
    seconds: dict[str, dict[str, float]] = {}
    after: dict[str, dict[str, str | None]] = {}
    dependents: dict[str, set[str]] = {}
    for n in g:
        target = nodes[n].get("label", "")
        same = [q for q in g.predecessors(n) if nodes[q].get("label", "") == target]
        last = max(same, key=lambda q: nodes[q].get("order", 0)) if same else None
        seconds.setdefault(target, {})[n] = float(nodes[n].get(recorded, nodes[n]["seconds"]))
        after.setdefault(target, {})[n] = last
        for q in g.predecessors(n):
            if nodes[q].get("label", "") != target:
                dependents.setdefault(nodes[q].get("label", ""), set()).add(target)
    timing = {t: Timing(seconds[t], after[t]) for t in seconds}
    prio = Priorities(lambda t: sorted(dependents.get(t, ())), lambda t: timing.get(t, Timing()))
    return {n: prio.of(nodes[n].get("label", ""), n) for n in g}


def _blobs(units: dict[str, dict[str, int]], ids) -> dict[str, int]:
    out: dict[str, int] = {}
    for u in ids:
        out.update(units.get(u, {}))
    return out


def simulate(g: nx.DiGraph, units: dict[str, dict[str, int]], p: Params) -> dict[str, Any]:
    """List-schedule `g` on `p.workers` x `p.slots` remote slots and `p.local_jobs` local lanes.
    Nodes carry `seconds`, `remote` (bool), `reads` (unit ids), `writes` (a unit id or None) and
    `order` (the recorded completion order, FIFO's tie-break); `units` maps a unit id to its
    blobs {digest: bytes}. Returns the wall and what moved where."""
    if p.workers < 1 or p.slots < 1 or p.local_jobs < 1:
        raise ValueError("workers, slots and local jobs must be at least 1")
    nodes = g.nodes
    made_remotely = {nodes[n]["writes"] for n in g if nodes[n].get("remote", True) and nodes[n].get("writes")}
    made_locally = {nodes[n]["writes"] for n in g if not nodes[n].get("remote", True) and nodes[n].get("writes")}
    # What exists before the build: every unit no action writes (sources, earlier builds' outputs).
    given = {u for u in units if u not in made_remotely and u not in made_locally}
    client: set[str] = set(_blobs(units, given))
    server: set[str] = set()
    held: list[set[str]] = [set() for _ in range(p.workers)]  # each worker's CAS: blobs
    held_units: list[set[str]] = [set() for _ in range(p.workers)]  # ... and the units it holds whole
    if p.warm:
        pre = set(_blobs(units, set(units) - made_remotely))
        server |= pre
        for w in range(p.workers):
            held[w] |= pre
            held_units[w] |= set(units) - made_remotely
    client_link, server_link = Link(p.client_bw), Link(p.server_bw)
    down = [0] * p.workers
    moved = {"client_upload_bytes": 0, "client_fetch_bytes": 0}
    rank: dict[str, float] = {}
    if p.priority == "critical":  # longest path from the node to the end, the node included
        for n in reversed(list(nx.topological_sort(g))):
            rank[n] = nodes[n]["seconds"] + max((rank[s] for s in g.successors(n)), default=0.0)
    elif p.priority == "bgraph":
        rank = bgraph_ranks(g)
    elif p.priority != "fifo":
        raise ValueError(f"unknown priority {p.priority!r}")

    waiting = {n: g.in_degree(n) for n in g}
    events: list[tuple[float, int, str]] = []  # (time, seq, node): the node may be queued from then on
    seq = 0

    def release(n: str, t: float) -> None:
        """`n`'s inputs are all on the client at `t`: it is queued once the server has them too."""
        nonlocal seq
        if nodes[n].get("remote", True):
            lack = {d: z for d, z in _blobs(units, nodes[n].get("reads", ())).items() if d not in server and d in client}
            t = client_link.transfer(t, sum(lack.values()))
            moved["client_upload_bytes"] += sum(lack.values())
            server.update(lack)
        heapq.heappush(events, (t, seq, n))
        seq += 1

    queues: dict[bool, list] = {True: [], False: []}  # remote / local: heaps of ready nodes
    free: dict[bool, list[tuple[float, int]]] = {  # (free at, slot): slot // p.slots is the worker
        True: [(0.0, s) for s in range(p.workers * p.slots)], False: [(0.0, s) for s in range(p.local_jobs)]}
    busy = {True: 0.0, False: 0.0}
    done_at: dict[str, float] = {}
    now = 0.0

    def key(n: str, t: float) -> tuple:
        order = nodes[n].get("order", 0)
        return (-rank[n], t, order) if rank else (t, order)

    def run(n: str, start: float, slot: int) -> tuple[float, float]:
        """Start `n` at `start` on `slot`: (when the slot is free again, when its outputs are on the client)."""
        a = nodes[n]
        out = units.get(a.get("writes") or "", {})
        if not a.get("remote", True):
            end = start + a["seconds"]
            busy[False] += a["seconds"]
            client.update(out)
            return end, end
        w = slot // p.slots
        need: dict[str, int] = {}
        for u in a.get("reads", ()):
            if u not in held_units[w]:
                need.update((d, s) for d, s in units.get(u, {}).items() if d not in held[w])
                held_units[w].add(u)
        got = server_link.transfer(start, sum(need.values()), p.worker_bw)
        held[w].update(need)
        down[w] += sum(need.values())
        ran = got + p.overhead_s + a["seconds"]
        new = {d: s for d, s in out.items() if d not in server}
        free_at = server_link.transfer(ran, sum(new.values()), p.worker_bw)
        server.update(new)
        held[w].update(out)
        busy[True] += free_at - start
        fetch = {d: s for d, s in out.items() if d not in client}
        back = client_link.transfer(free_at + p.latency_s, sum(fetch.values()))
        moved["client_fetch_bytes"] += sum(fetch.values())
        client.update(fetch)
        return free_at, back

    finishing: list[tuple[float, int, str]] = []  # (outputs on the client, seq, node)
    for n in sorted((n for n in g if waiting[n] == 0), key=lambda n: nodes[n].get("order", 0)):
        release(n, 0.0)
    while events or queues[True] or queues[False] or finishing:
        # The next moment something changes: a node becomes queueable, its outputs arrive, a slot frees.
        candidates = [h[0][0] for h in (events, finishing) if h]
        candidates += [max(now, free[r][0][0]) for r in (True, False) if queues[r]]
        now = max(now, min(candidates))
        while finishing and finishing[0][0] <= now:
            t, _, n = heapq.heappop(finishing)
            done_at[n] = t
            for s in g.successors(n):
                waiting[s] -= 1
                if waiting[s] == 0:
                    release(s, max(done_at[q] for q in g.predecessors(s)))
        while events and events[0][0] <= now:
            t, _, n = heapq.heappop(events)
            heapq.heappush(queues[nodes[n].get("remote", True)], (*key(n, t), n))
        for remote in (True, False):
            while queues[remote] and free[remote][0][0] <= now:
                n = heapq.heappop(queues[remote])[-1]
                _, slot = heapq.heappop(free[remote])
                slot_free, back = run(n, now, slot)
                heapq.heappush(free[remote], (slot_free, slot))
                heapq.heappush(finishing, (back, seq, n))
                seq += 1
    wall = max(done_at.values(), default=0.0)
    if len(done_at) != len(g):
        raise ValueError("the graph has a cycle or an unreachable node")
    return {"workers": p.workers, "slots": p.slots, "wall_s": round(wall, 3),
            "remote_busy_s": round(busy[True], 3), "local_busy_s": round(busy[False], 3),
            "worker_download_bytes": sum(down), "server_link_bytes": server_link.bytes,
            "client_link_bytes": client_link.bytes, **moved,
            "remote_efficiency": round(busy[True] / max(wall * p.workers * p.slots, 1e-9), 4)}


def curve(g: nx.DiGraph, units: dict[str, dict[str, int]], base: Params, workers=WORKERS) -> list[dict[str, Any]]:
    """`simulate` for each worker count, with the speed-up over one worker and the efficiency."""
    rows = []
    for w in workers:
        r = simulate(g, units, Params(**{**base.__dict__, "workers": w}))
        rows.append(r)
    one = rows[0]["wall_s"] if rows and rows[0]["workers"] == 1 else None
    for r in rows:
        if one:
            r["speedup"] = round(one / r["wall_s"], 2) if r["wall_s"] else None
            r["efficiency"] = round(r["speedup"] / r["workers"], 3) if r["speedup"] else None
    return rows


# -- a recorded build, read from its cache ------------------------------------------------------

class Recorded:
    """A cache's recorded actions, read without writing anything there."""

    def __init__(self, cache: Path):
        bases = sorted(p.parent for p in (cache / "v1").glob("*/state-v2.sqlite"))
        if not bases:
            raise SystemExit(f"error: no state file under {cache}/v1/*/state-v2.sqlite\n"
                             "hint: --cache is the directory a build's --cache-dir named")
        self.base = bases[0]
        self.db = sqlite3.connect(f"file:{self.base / 'state-v2.sqlite'}?mode=ro", uri=True)
        self.nodes: dict[str, dict] = {}  # directory digest -> its node, read once

    def traces(self) -> dict[str, dict]:
        """Every target's trace: label -> {"actions": {name: {"key", "description"}}, ...}."""
        return {label: json.loads(trace) for label, trace in self.db.execute("SELECT label, trace FROM traces")}

    def result(self, key: str) -> tuple[dict, int, dict] | None:
        """The action result filed under `key` (or, for a depfile action's pre-key, under the key its
        newest manifest entry names), its filing order (results' rowid; 0 where from ac/) and what
        that manifest entry says the action read ({mount: {path: digest}}, {} for other actions)."""
        entry = (self._manifest(key) or [{}])[0]
        for k, reads in ((key, {}), (entry.get("key", ""), entry.get("reads") or {})):
            if not k:
                continue
            row = self.db.execute("SELECT result, rowid FROM results WHERE key = ?", (k,)).fetchone()
            if row:
                return json.loads(row[0]), row[1], reads
            try:
                return json.loads((self.base / "ac" / k[:2] / f"{k[2:]}.json").read_text()), 0, reads
            except (FileNotFoundError, ValueError):
                continue
        return None

    def _manifest(self, key: str) -> list[dict]:
        try:
            entries = json.loads((self.base / "ac" / key[:2] / f"{key[2:]}.reads.json").read_text())
        except (FileNotFoundError, ValueError):
            return []
        return [e for e in entries if isinstance(e, dict)] if isinstance(entries, list) else []

    def node(self, digest: str) -> dict:
        """A directory node: {"files": [[name, digest, size, exec]], "dirs": [[name, digest]], ...}."""
        if digest not in self.nodes:
            try:
                self.nodes[digest] = json.loads((self.base / "dirs" / digest[:2] / digest[2:]).read_bytes())
            except FileNotFoundError:
                self.nodes[digest] = {"files": [], "dirs": [], "symlinks": [], "missing": True}
        return self.nodes[digest]

    def blobs(self, tree: str, memo: dict[str, dict[str, int]]) -> dict[str, int]:
        """Every blob of a tree: {digest: size}."""
        if tree not in memo:
            node = self.node(tree)
            out = {f[1]: f[2] for f in node["files"]}
            for _, sub in node["dirs"]:
                out.update(self.blobs(sub, memo))
            memo[tree] = out
        return memo[tree]

    def subtrees(self, tree: str, into: set[str]) -> set[str]:
        """Every directory digest under `tree`, `tree` included."""
        if tree not in into:
            into.add(tree)
            for _, sub in self.node(tree)["dirs"]:
                self.subtrees(sub, into)
        return into


LOG_LINE = re.compile(r"^ran (?P<rest>.+) \((?P<secs>[0-9.]+)s[^)]*\) — ")


def logged_actions(log: Path, labels: list[str]) -> list[tuple[str, str]]:
    """The (label, action name) pairs a build's log says ran, in the order they ended."""
    by_length = sorted(labels, key=len, reverse=True)  # "//a:b (aarch64)" before "//a:b"
    out = []
    for line in log.read_text(errors="replace").splitlines():
        m = LOG_LINE.match(line)
        if not m:
            continue
        rest = m.group("rest")
        label = next((lb for lb in by_length if rest.startswith(lb + " ")), None)
        if label is not None:
            out.append((label, rest[len(label) + 1:]))
    return out


def load_recorded(cache: Path, log: Path | None = None, duration: str = "cpu",
                  labels: str | None = None) -> tuple[nx.DiGraph, dict[str, dict[str, int]], dict[str, Any]]:
    """The graph of a recorded build: one node per executed action (those its `log` names, else
    every action with a result) with its seconds (`cpu`: its processes' CPU where measured, else
    its wall; `wall`: its wall as recorded), whether it runs remotely (exec) and what it reads and
    writes; `units` holds each input and output tree's blobs."""
    rec = Recorded(cache)
    traces = rec.traces()
    if labels:
        traces = {lb: t for lb, t in traces.items() if re.search(labels, lb)}
    wanted = None
    if log is not None:
        if not log.is_file():
            raise SystemExit(f"error: no build log at {log}\nhint: <cache>/logs/build-*.log of the build to simulate")
        wanted = {pair: i for i, pair in enumerate(logged_actions(log, list(traces)))}
    memo: dict[str, dict[str, int]] = {}
    g = nx.DiGraph()
    units: dict[str, dict[str, int]] = {}
    info = {"actions_in_traces": 0, "without_result": 0, "not_in_log": 0}
    mounts: dict[tuple[str, str], str] = {}  # (label, mount) -> a tree an action of it mounts whole there
    narrowed: list[tuple[str, str, str, str]] = []
    seen_keys: set[str] = set()
    for label, trace in traces.items():
        for name, a in trace.get("actions", {}).items():
            info["actions_in_traces"] += 1
            if wanted is not None and (label, name) not in wanted:
                info["not_in_log"] += 1
                continue
            if a["key"] in seen_keys:  # one action reached from two targets runs once
                continue
            got = rec.result(a["key"])
            if got is None:
                info["without_result"] += 1
                continue
            seen_keys.add(a["key"])
            result, rowid, narrowed_reads = got
            desc = a["description"]
            secs = result["duration_s"]
            if duration == "cpu" and result.get("cpu_s", 0) > 0:
                secs = result["cpu_s"]
            whole = {m: t for m, t in desc.get("inputs", {}).items() if t != "narrowed"}
            for m, t in whole.items():
                units[t] = rec.blobs(t, memo)
                mounts.setdefault((label, m), t)
            reads = set(whole.values())
            for m in set(desc.get("inputs", {})) - set(whole):
                # A narrowed mount (a depfile action): its trace keeps no tree digest. The remote
                # input root is the whole tree, which the target's other actions mount under the same
                # name (see below); the files it read (its manifest) give its dependencies.
                unit = f"read:{a['key']}:{m}"
                units[unit] = dict.fromkeys((narrowed_reads.get(m) or {}).values(), 0)
                narrowed.append((f"{label} {name}", label, m, unit))
            reads = tuple(sorted(reads))
            out = "out:" + result["output_tree"]
            units[out] = rec.blobs(result["output_tree"], memo)
            node = f"{label} {name}"
            g.add_node(node, label=label, seconds=float(secs), wall_s=result["duration_s"], cpu_s=result.get("cpu_s", 0.0),
                       remote=desc.get("kind") == "exec" and not desc.get("host_paths"),
                       mnemonic=desc.get("mnemonic", ""), reads=reads, writes=out, tree=result["output_tree"],
                       order=wanted[(label, name)] if wanted is not None else rowid)
    sizes: dict[str, int] = {}
    for blobs in memo.values():
        sizes.update(blobs)
    for node, label, m, unit in narrowed:  # what a narrowed mount read gives dependencies ...
        units[unit] = {d: sizes.get(d, 0) for d in units[unit]}
        a = g.nodes[node]
        a.setdefault("dep_reads", a["reads"])  # the trees it mounts whole, before the line below
        a["dep_reads"] += (unit,)
        # ... and its whole tree (another action's of the target at that mount) is what is sent
        a["reads"] = tuple(sorted(set(a["reads"]) | {mounts.get((label, m), unit)}))
    _link_producers(g, rec, units, memo)
    info["planning_edges"] = _link_planners(g)
    info.update(actions=g.number_of_nodes(), edges=g.number_of_edges(),
                missing_directory_nodes=sum(1 for n in rec.nodes.values() if n.get("missing")))
    return g, units, info


def _link_planners(g: nx.DiGraph) -> int:
    """Each action of a target waits for the planning actions (PLANNING) of that target, of another
    mnemonic than its own, that ended before it; returns the edges added."""
    added = 0
    by_label: dict[str, list[str]] = {}
    for n, a in g.nodes(data=True):
        by_label.setdefault(a["label"], []).append(n)
    for members in by_label.values():
        members.sort(key=lambda n: g.nodes[n]["order"])
        planners: list[str] = []
        for n in members:
            for p in planners:  # dry runs wait for the configure, not for each other
                if g.nodes[p]["mnemonic"] != g.nodes[n]["mnemonic"] and not g.has_edge(p, n):
                    g.add_edge(p, n)
                    added += 1
            if g.nodes[n]["mnemonic"] in PLANNING:
                planners.append(n)
    return added


def _link_producers(g: nx.DiGraph, rec: Recorded, units: dict[str, dict[str, int]], memo) -> None:
    """Add an edge producer -> consumer wherever a consumer's input trees hold a producer's output
    directory or a non-empty output blob; of several producers of the same bytes, the earliest to
    end that ended before the consumer."""
    by_dir: dict[str, list[str]] = {}
    by_blob: dict[str, list[str]] = {}
    for n, a in g.nodes(data=True):
        for d in rec.subtrees(a["tree"], set()):
            if sum(rec.blobs(d, memo).values()) > 0:  # an empty directory is no dependency
                by_dir.setdefault(d, []).append(n)
        for b, size in units[a["writes"]].items():
            if size > 0:
                by_blob.setdefault(b, []).append(n)
    order = {n: g.nodes[n]["order"] for n in g}
    for lst in list(by_dir.values()) + list(by_blob.values()):
        lst.sort(key=order.__getitem__)
    groups: dict[str, set[tuple[str, ...]]] = {}  # tree -> the producer lists its content comes from

    def sources(tree: str) -> set[tuple[str, ...]]:
        if tree not in groups:
            if tree in by_dir:
                found = {tuple(by_dir[tree])}
            else:
                node = rec.node(tree)
                found = {tuple(by_blob[f[1]]) for f in node["files"] if f[1] in by_blob}
                for _, sub in node["dirs"]:
                    found |= sources(sub)
            groups[tree] = found
        return groups[tree]

    for n in list(g):
        mine = order[n]
        for unit in set(g.nodes[n].get("dep_reads", g.nodes[n]["reads"])):
            found = (sources(unit) if not unit.startswith("read:")
                     else {tuple(by_blob[d]) for d in units[unit] if d in by_blob})
            for producers in found:
                first = next((p for p in producers if p != n and order[p] < mine), None)
                if first is not None:
                    g.add_edge(first, n)


# -- FlashInfer's SM12x set: an ESTIMATE (never built; no recorded durations) ---------------------

# Where each figure comes from (BENCHMARKS.md): the set's shape ("FlashInfer 0.7.2.post1 AOT
# modules": 160 modules, 670 TUs, of them 148 CUTLASS TUs (fused_moe_120 96, gemm_sm120 28,
# fp4_gemm_cutlass_sm120 17, mxfp8 7) and 384 XQA TUs); a CUTLASS SM120 GEMM TU 75-79 CPU-s per arch
# ("CUTLASS SM120 NVFP4 GEMM compile"); the 11 light modules of //flashinfer:aot-sm121, 976 CPU-s in
# all, topk's cub_topk.cu alone ~700 (718 for its module at 9.0a); any other TU the six-module runs'
# mean, 114.5 CPU-s / 9 TUs = 12.7 s; the generator 17 s. Assumed, not measured: how a TU's CPU
# splits over bgraph's nvcc steps (STEP_SHARES: the host compile was 44% of the six modules'
# action CPU), every XQA and FA2 TU costing the six-module mean, 2 s per module link, the bytes.
STEP_SHARES = (("hostpp", 0.03), ("cudafe", 0.03), ("devpp", 0.03), ("cicc", 0.25), ("ptxas", 0.20),
               ("fatbinary", 0.01), ("host compile", 0.44), ("link", 0.01))
LIGHT_MODULES = {"topk": (700.0, 9.0, 9.0), "sampling": (29.3, 29.3, 29.4), "rope": (18.0, 18.0),
                 "norm": (17.0, 17.0), "page": (7.5, 7.5), "silu_and_mul": (3.5,), "gelu_and_mul": (3.5,),
                 "gelu_tanh_and_mul": (3.5,), "cascade": (8.3, 8.3, 8.4), "quantization": (12.5, 12.5),
                 "batch_decode_bf16_128": (8.3, 8.3, 8.4)}  # 23 TUs, 976.5 CPU-s
CUTLASS_MODULES = {"fused_moe_120": 96, "gemm_sm120": 28, "fp4_gemm_cutlass_sm120": 17, "mxfp8_gemm_cutlass_sm120": 7}
CUTLASS_TU_S, OTHER_TU_S, GENERATOR_S, MODULE_LINK_S = 77.0, 12.7, 17.0, 2.0
XQA_MODULES, XQA_TUS_EACH = 128, 3  # 384 TUs
OTHER_TUS, OTHER_MODULES = 670 - 23 - 148 - 384, 160 - 11 - 4 - 128  # FA2, FP4 quantization, ...
MB = 1_000_000
TOOLKIT_BYTES, USR_BYTES, TORCH_BYTES, BUILD_DIR_BYTES = 2_102 * MB, 328 * MB, 5_324 * MB, 150 * MB


def flashinfer_estimate() -> tuple[nx.DiGraph, dict[str, dict[str, int]], dict[str, Any]]:
    """The estimated graph of //flashinfer:aot-vllm-sm121 (see the figures above): the generator,
    then per TU a chain of bgraph's nvcc steps, then one link per module."""
    g = nx.DiGraph()
    units: dict[str, dict[str, int]] = {
        "toolkit": {"toolkit": TOOLKIT_BYTES}, "usr": {"usr": USR_BYTES}, "torch": {"torch": TORCH_BYTES}}
    order = iter(range(1_000_000))

    def add(name: str, secs: float, reads: tuple[str, ...], out_bytes: int) -> str:
        units["out:" + name] = {"out:" + name: out_bytes}
        g.add_node(name, seconds=secs, remote=True, reads=("toolkit", "usr", *reads), writes="out:" + name,
                   order=next(order), mnemonic=name.split(" ")[0])
        return name

    gen = add("generate", GENERATOR_S, ("torch",), BUILD_DIR_BYTES)
    modules: list[tuple[str, list[float], int]] = [(m, list(tus), MB) for m, tus in LIGHT_MODULES.items()]
    modules += [(m, [CUTLASS_TU_S] * n, 4 * MB) for m, n in CUTLASS_MODULES.items()]
    modules += [(f"xqa_{i}", [OTHER_TU_S] * XQA_TUS_EACH, MB) for i in range(XQA_MODULES)]
    per, extra = divmod(OTHER_TUS, OTHER_MODULES)
    modules += [(f"other_{i}", [OTHER_TU_S] * (per + (i < extra)), MB) for i in range(OTHER_MODULES)]
    for module, tus, step_bytes in modules:
        ends = []
        for t, tu_s in enumerate(tus):
            prev = gen
            for step, share in STEP_SHARES:  # each step reads the build directory and the step before
                reads = ("out:" + gen,) + (("out:" + prev,) if prev != gen else ())
                node = add(f"{step} {module}/{t}", tu_s * share, reads, step_bytes)
                g.add_edge(prev, node)
                prev = node
            ends.append(prev)
        link = add(f"module link {module}", MODULE_LINK_S, tuple("out:" + e for e in ends), 10 * MB)
        for e in ends:
            g.add_edge(e, link)
    assumptions = {
        "modules": len(modules), "tus": sum(len(t) for _, t, _ in modules), "step_shares": dict(STEP_SHARES),
        "cutlass_tu_s": CUTLASS_TU_S, "other_tu_s": OTHER_TU_S, "light_modules_s": sum(map(sum, LIGHT_MODULES.values())),
        "generator_s": GENERATOR_S, "module_link_s": MODULE_LINK_S,
        "bytes": {"toolkit": TOOLKIT_BYTES, "usr": USR_BYTES, "torch (generator only)": TORCH_BYTES,
                  "build dir": BUILD_DIR_BYTES, "per step output": "4 MB (CUTLASS) or 1 MB", "module": 10 * MB}}
    return g, units, assumptions


# -- the check against real runs ----------------------------------------------------------------

def sleep_targets() -> tuple[str, float, float]:
    """The check's workload as a target file: 4 chains of 3 genrules, 12 independent ones and one
    over all of them; each sleeps a known time and reads its dependencies' outputs. Returns the
    file, the sum of the sleeps and the longest chain of sleeps."""
    lines, total, ends = [], 0.0, []
    for i in range(4):
        for j in range(3):
            secs = 1.0 + 0.5 * ((i + j) % 3)
            total += secs
            dep = f'deps = {{ p = ":c{i}-{j - 1}" }}\n' if j else ""
            read = "cat $IN_P/o > /dev/null; " if j else ""
            lines.append(f'[c{i}-{j}]\nkind = "genrule"\n{dep}outs = ["o"]\n'
                         f'cmd = "{read}sleep {secs}; echo c{i}-{j} > $OUT/o"\n')
        ends.append(f"c{i}-2")
    for k in range(12):
        secs = 0.5 + 0.25 * (k % 4)
        total += secs
        lines.append(f'[f{k}]\nkind = "genrule"\nouts = ["o"]\ncmd = "sleep {secs}; echo f{k} > $OUT/o"\n')
        ends.append(f"f{k}")
    deps = ", ".join(f'{n.replace("-", "_")} = ":{n}"' for n in ends)
    reads = " ".join(f"$IN_{n.replace('-', '_').upper()}/o" for n in ends)
    lines.append(f'[top]\nkind = "genrule"\ndeps = {{ {deps} }}\nouts = ["o"]\n'
                 f'cmd = "cat {reads} > /dev/null; sleep 1.0; echo top > $OUT/o"\n')
    for w in range(4):  # the warm-up: each worker gets the pinned /usr before the timed build
        lines.append(f'[warm{w}]\nkind = "genrule"\nouts = ["o"]\ncmd = "sleep 1; echo warm{w} > $OUT/o"\n')
    return "\n".join(lines), total + 1.0, 4.5 + 1.0


def _bgraph(ws: Path, cache: Path, *args: str, timeout: float = 900,
            env: dict[str, str] | None = None) -> tuple[dict, float]:
    """`bgraph build --json ARGS` in `ws` on `cache`: its summary and the wall seen from outside."""
    import subprocess
    sys.path.insert(0, str(REPO / "tests"))
    from bgraph_testlib import hermetic_env
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "build_graph", "-C", str(ws), "--cache-dir", str(cache),
                           "build", "--json", *args], capture_output=True, text=True, env=hermetic_env(env),
                          cwd=ws, timeout=timeout, check=False)
    wall = time.monotonic() - start
    try:
        summary = json.loads(proc.stdout)
    except ValueError:
        raise SystemExit(f"error: bgraph build {' '.join(args)} failed (rc {proc.returncode}): "
                         f"{proc.stderr[-1500:]}") from None
    if not summary.get("ok"):
        raise SystemExit(f"error: bgraph build {' '.join(args)} failed: {summary.get('errors')}")
    return summary, wall


def run_check(work: Path, settings=((0.06, 0.19), (0.06, 0.40))) -> dict[str, Any]:
    """Build the sleep workload locally (`-j1`, its durations recorded), then remotely on 1 and 2
    workers of 1 slot each (a fresh BuildGrid each time, every worker warmed with the pinned /usr
    first), and put the simulation's walls beside the real ones."""
    import shutil
    sys.path[:0] = [str(REPO / "tests"), str(REPO)]
    from bgraph_testlib import copy_toolchains
    from remote_exec_servers import ExecStack, missing_reason
    if missing_reason():
        raise SystemExit(f"error: {missing_reason()}")
    work.mkdir(parents=True, exist_ok=True)
    ws, base = work / "ws", work / "base-cache"
    copy_toolchains(ws)
    text, total, chain = sleep_targets()
    (ws / "targets" / "sim.toml").write_text(text)
    timed = ["//sim:top"]
    _bgraph(ws, base, "//toolchains:host")  # the pinned /usr, in every copy below

    def fresh(name: str) -> Path:
        dest = work / name
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(base, dest, symlinks=True)
        return dest

    out: dict[str, Any] = {"workload": {"actions": 25, "sleep_sum_s": total, "sleep_chain_s": chain}, "runs": []}
    local_cache = fresh("local")
    summary, wall = _bgraph(ws, local_cache, "-j1", *timed)
    out["runs"].append({"run": "local -j1", "wall_s": summary["wall_s"], "outside_s": round(wall, 2),
                        "executed": summary["executed"], "load": os.getloadavg()[0]})
    g, units, info = load_recorded(local_cache, duration="wall", labels=r"^//sim:")
    out["graph"] = {**info, "critical_path_s": round(critical_path(g)[0], 3),
                    "sum_s": round(sum(g.nodes[n]["seconds"] for n in g), 3)}
    for workers in (1, 2):
        root = Path(work / f"stack-{workers}")
        shutil.rmtree(root, ignore_errors=True)
        stack = ExecStack(root, workers=workers)
        try:
            cache = fresh(f"remote-{workers}")
            remote = ("--remote-executor", stack.url, "--remote-jobs", "16")
            for attempt in range(3):  # a fresh BuildGrid's first SQL connections may still be settling
                try:
                    _bgraph(ws, cache, *remote, *[f"//sim:warm{w}" for w in range(2 * workers)])
                    break
                except SystemExit as e:
                    print(f"warm-up {attempt + 1} failed, retried: {str(e)[:300]}", file=sys.stderr)
                    time.sleep(3)
            else:
                raise SystemExit("error: the warm-up build failed three times (BuildGrid's log: "
                                 f"{root}/bgd/bgd.log)")
            load = os.getloadavg()[0]
            summary, wall = _bgraph(ws, cache, *remote, *timed)
        finally:
            stack.stop()
        row = {"run": f"remote, {workers} worker(s) x 1 slot", "wall_s": summary["wall_s"],
               "outside_s": round(wall, 2), "executed": summary["executed"], "load": load}
        for o, lat in settings:  # (a worker's own time, the latency) per action
            sim = simulate(g, units, Params(workers=workers, overhead_s=o, latency_s=lat, warm=True, local_jobs=2))
            row[f"simulated_s@{o}+{lat}"] = sim["wall_s"]
            row[f"real/simulated@{o}+{lat}"] = round(summary["wall_s"] / sim["wall_s"], 3)
        out["runs"].append(row)
    return out


# -- FIFO against bgraph's priority, real builds -------------------------------------------------

def order_workspace(ws: Path) -> list[str]:
    """Write the ordering workload's workspace at `ws` (order_targets, four warm-up genrules, the
    pinned toolchains); returns the targets to build, z3 first: the configured walk then lists z1
    after every short chain's head (FIFO's worst)."""
    sys.path[:0] = [str(REPO / "tests"), str(REPO)]
    from bgraph_testlib import copy_toolchains
    copy_toolchains(ws)
    (ws / "targets" / "sim.toml").write_text(order_targets())
    (ws / "targets" / "warm.toml").write_text("\n".join(
        f'[warm{w}]\nkind = "genrule"\nouts = ["o"]\ncmd = "sleep 1; echo warm{w} > $OUT/o"\n' for w in range(4)))
    (ws / "common.txt").write_text("0\n")
    return ["//sim:z3"] + [f"//sim:a{c}-4" for c in range(6)]


def order_targets(chain_s: float = 3.0, short_s: float = 0.4, chains: int = 6, depth: int = 4) -> str:
    """The order workload (tests/test_priority.py's shape): a chain z1 -> z2 -> z3 of `chain_s`
    steps beside `chains` chains of `depth` steps of `short_s`; each step echoes its name (no two
    actions are alike) and reads common.txt, so one edit reruns all under the same names."""
    out = []
    for name, secs, dep in ([(f"z{i}", chain_s, f"z{i - 1}" if i > 1 else None) for i in range(1, 4)]
                            + [(f"a{c}-{i}", short_s, f"a{c}-{i - 1}" if i > 1 else None)
                               for c in range(chains) for i in range(1, depth + 1)]):
        read = " && cat $IN_D/o >> $OUT/o" if dep else ""
        out.append(f'[{name}]\nkind = "genrule"\nsrcs = ["common.txt"]\nouts = ["o"]\n'
                   + (f'deps = {{ d = ":{dep}" }}\n' if dep else "")
                   + f'cmd = "sleep {secs}; echo {name} > $OUT/o; cat $SRC/common.txt >> $OUT/o{read}"\n')
    return "\n".join(out)


def run_order(work: Path, rounds: int = 2, remote: bool = True) -> dict[str, Any]:
    """Build the order workload once (durations recorded), then after each edit of common.txt
    (every action again, same names) with bgraph's priority and with BGRAPH_SCHEDULE=fifo, in
    turn, `rounds` times: locally at -j2, and through BuildGrid with 2 workers of 1 slot
    (`-j1 --remote-jobs 2`: the client's queue, not BuildGrid's, decides the order)."""
    import shutil
    work.mkdir(parents=True, exist_ok=True)
    ws = work / "ws"
    shutil.rmtree(ws, ignore_errors=True)
    tips = order_workspace(ws)
    base = work / "base-cache"
    _bgraph(ws, base, "//toolchains:host")  # the pinned /usr (fetched once), in every copy below
    out: dict[str, Any] = {"workload": {"chain_s": 9.0, "short_s": 24 * 0.4, "actions": 27}, "runs": []}
    edits = iter(range(1, 1000))

    def series(name: str, cache: Path, *extra: str) -> None:
        _bgraph(ws, cache, *extra, *tips)  # the first build: durations recorded
        for r in range(rounds):
            for policy in (("priority", "fifo") if r % 2 == 0 else ("fifo", "priority")):
                (ws / "common.txt").write_text(f"{next(edits)}\n")
                env = {"BGRAPH_SCHEDULE": "fifo"} if policy == "fifo" else {}
                load = os.getloadavg()[0]
                summary, wall = _bgraph(ws, cache, *extra, *tips, env=env)
                out["runs"].append({"where": name, "order": policy, "round": r + 1, "wall_s": summary["wall_s"],
                                    "executed": summary["executed"], "load": round(load, 2)})
                print(json.dumps(out["runs"][-1]), flush=True)

    local = work / "local-cache"
    shutil.rmtree(local, ignore_errors=True)
    shutil.copytree(base, local, symlinks=True)
    series("local -j2", local, "-j2")
    if remote:
        from remote_exec_servers import ExecStack, missing_reason
        if missing_reason():
            out["remote_skipped"] = missing_reason()
            return out
        cache = work / "remote-cache"
        shutil.rmtree(cache, ignore_errors=True)
        shutil.copytree(base, cache, symlinks=True)
        stack = ExecStack(work / "stack", workers=2)
        try:
            flags = ("--remote-executor", stack.url, "-j1", "--remote-jobs", "2")
            for attempt in range(3):  # a fresh BuildGrid's first SQL connections may still be settling
                try:
                    _bgraph(ws, cache, *flags, *[f"//warm:warm{w}" for w in range(4)])
                    break
                except SystemExit as e:
                    print(f"warm-up {attempt + 1} failed, retried: {str(e)[:300]}", file=sys.stderr)
                    time.sleep(3)
            series("BuildGrid, 2 workers x 1 slot", cache, *flags)
        finally:
            stack.stop()
    return out


# -- the command line ---------------------------------------------------------------------------

def _params(args) -> Params:
    return Params(workers=1, slots=args.slots, local_jobs=args.local_jobs, overhead_s=args.overhead,
                  latency_s=args.latency,
                  worker_bw=args.bandwidth * GB / 8, server_bw=args.server_bandwidth * GB / 8,
                  client_bw=args.client_bandwidth * GB / 8, priority=args.priority, warm=args.warm)


def report(name: str, g: nx.DiGraph, units: dict[str, dict[str, int]], base: Params, workers) -> dict[str, Any]:
    """The critical path and the curve for one graph, printed and returned."""
    cp, path = critical_path(g)
    per_action = base.overhead_s + base.latency_s
    cp_o, _ = critical_path(g, per_action)
    total = sum(g.nodes[n]["seconds"] for n in g)
    print(f"{name}: {g.number_of_nodes()} actions ({sum(1 for n in g if g.nodes[n].get('remote', True))} remote), "
          f"{g.number_of_edges()} edges, {total:,.0f} s of work; critical path {cp:,.0f} s "
          f"({cp_o:,.0f} s with {per_action:g} s per remote action), {len(path)} actions: the longest are")
    for n in sorted(path, key=lambda n: -g.nodes[n]["seconds"])[:4]:
        print(f"    {g.nodes[n]['seconds']:8.1f} s  {n[:120]}")
    rows = curve(g, units, base, workers)
    print(f"  {'workers':>7} {'wall s':>9} {'speed-up':>8} {'effic.':>6} {'to workers GB':>13} "
          f"{'client up GB':>12} {'client fetch GB':>15}")
    for r in rows:
        print(f"  {r['workers']:>7} {r['wall_s']:>9,.0f} {r.get('speedup') or 0:>8.2f} {r.get('efficiency') or 0:>6.2f}"
              f" {r['worker_download_bytes'] / GB:>13.1f} {r['client_upload_bytes'] / GB:>12.1f}"
              f" {r['client_fetch_bytes'] / GB:>15.2f}")
    return {"name": name, "actions": g.number_of_nodes(), "edges": g.number_of_edges(), "work_s": round(total, 1),
            "critical_path_s": round(cp, 1), "critical_path_with_overhead_s": round(cp_o, 1),
            "critical_path": path, "params": base.__dict__, "curve": rows}


def main(argv: list[str] | None = None) -> int:
    """Parse the command line, run the chosen part, print and write its JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("part", choices=["recorded", "flashinfer", "check", "order"])
    ap.add_argument("--cache", type=Path, help="(recorded) the build's --cache-dir")
    ap.add_argument("--log", type=Path, help="(recorded) its <cache>/logs/build-*.log: only the actions it ran")
    ap.add_argument("--labels", help="(recorded) only targets whose label matches this regex")
    ap.add_argument("--duration", choices=["cpu", "wall"], default="cpu",
                    help="(recorded) an action's time on a worker: its CPU where measured (default), or its wall")
    ap.add_argument("--workers", default=",".join(map(str, WORKERS)), help="worker counts, comma-separated")
    ap.add_argument("--slots", type=int, default=1, help="slots per worker")
    ap.add_argument("--local-jobs", type=int, default=2, help="the client's lanes for fetches and unpacks")
    ap.add_argument("--overhead", type=float, default=0.06, help="seconds a worker spends per action beside it")
    ap.add_argument("--latency", type=float, default=0.19,
                    help="seconds from a worker's end of an action to the client seeing it done")
    ap.add_argument("--bandwidth", type=float, default=10, help="Gb/s of each worker's link")
    ap.add_argument("--server-bandwidth", type=float, default=25, help="Gb/s of the CAS server's link (shared)")
    ap.add_argument("--client-bandwidth", type=float, default=10, help="Gb/s of the client's link")
    ap.add_argument("--priority", choices=["fifo", "critical", "bgraph"], default="fifo",
                    help="the ready actions' order: FIFO, the ideal longest path first, or bgraph's priority")
    ap.add_argument("--warm", action="store_true", help="workers start with every blob no remote action makes")
    ap.add_argument("--work", type=Path, default=Path("/var/tmp/bgraph-scaling-check"), help="(check) scratch dir")
    ap.add_argument("--rounds", type=int, default=2, help="(order) builds per order and place")
    ap.add_argument("--local-only", action="store_true", help="(order) no BuildGrid run")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args(argv)
    try:
        workers = tuple(int(w) for w in args.workers.split(","))
        if min(workers) < 1:
            raise ValueError
    except ValueError:
        print(f"error: --workers {args.workers!r} is not a list of positive integers\nhint: --workers 1,2,4,8")
        return 2
    base = _params(args)
    if args.part == "recorded":
        if args.cache is None:
            print("error: recorded needs --cache\nhint: --cache /var/tmp/vllm-cache --log <cache>/logs/build-*.log")
            return 2
        try:
            if args.labels:
                re.compile(args.labels)
            g, units, info = load_recorded(args.cache, args.log, args.duration, args.labels)
        except re.error as e:
            print(f"error: --labels {args.labels!r} is not a regular expression: {e}\nhint: --labels '^//vllm:'")
            return 2
        except (sqlite3.Error, KeyError, TypeError, ValueError) as e:
            print(f"error: the state file under {args.cache} could not be read: {e}\n"
                  "hint: a cache of another bgraph version, or damaged; simulate another build's cache")
            return 2
        print(f"read {info}")
        out = {"source": {"cache": str(args.cache), "log": str(args.log) if args.log else None,
                          "duration": args.duration, **info},
               **report(f"recorded ({args.cache.name})", g, units, base, workers)}
    elif args.part == "flashinfer":
        g, units, assumptions = flashinfer_estimate()
        out = {"estimate": True, "assumptions": assumptions,
               **report("FlashInfer SM12x set (ESTIMATE)", g, units, base, workers)}
    elif args.part == "order":
        out = run_order(args.work, args.rounds, remote=not args.local_only)
    else:
        out = run_check(args.work)
        print(json.dumps(out, indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
