"""bgraph's priority sent to BuildGrid or not (issue 36), real builds side by side in one run:

    python3 bench/remote_priority.py --json prio.json        # ~4 minutes on an idle machine
    python3 bench/remote_priority.py --in-flight 27          # every action in flight at once

The workload is `bench/remote_scaling.py order`'s (BENCHMARKS "Longest path first"): a chain
z1 -> z2 -> z3 of 3 s sleeps (9 s) beside 6 chains of 4 steps of 0.4 s (9.6 s), 27 genrules that
all read common.txt, the chain's tip first on the command line. One BuildGrid 0.9.1 (PostgreSQL,
tests/remote_exec_servers.py's tuned config) with 2 `bgraph worker`s of 1 slot; one build records
the durations, then each edit of common.txt reruns all 27 under the same names, built in turn:

- `-j1 --remote-jobs 8` (`--in-flight`; more Executes in flight than the fleet's 2 slots:
  BuildGrid's queue picks the next action) with the priority sent (REAPI
  ExecutionPolicy.priority, the default);
- the same with BGRAPH_REMOTE_PRIORITY=off (every Execute at the server's default: its queue is
  arrival order; the client's own order is unchanged);
- `-j1 --remote-jobs 2` (as many Executes as slots: the client's queue picks), for reference.

The order of the three rotates from round to round, so that load drifting on a shared machine
does not favour one. Each row gives bgraph's own wall (the summary's `wall_s`) and the load."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

def modes(in_flight: int) -> tuple[tuple[str, tuple[str, ...], dict[str, str]], ...]:
    """(name, flags, environment) of the three builds compared."""
    n = str(in_flight)
    return ((f"priority sent, --remote-jobs {n}", ("--remote-jobs", n), {}),
            (f"priority not sent, --remote-jobs {n}", ("--remote-jobs", n), {"BGRAPH_REMOTE_PRIORITY": "off"}),
            ("client's queue, --remote-jobs 2", ("--remote-jobs", "2"), {}))


def run(work: Path, rounds: int, in_flight: int = 8) -> dict[str, Any]:
    """The builds, in rotating order, `rounds` times each; returns every row and the medians."""
    compared = modes(in_flight)
    sys.path[:0] = [str(HERE), str(REPO / "tests"), str(REPO)]
    from remote_exec_servers import ExecStack, missing_reason
    from remote_scaling import _bgraph, order_workspace
    if missing_reason():
        raise SystemExit(f"error: {missing_reason()}")
    work.mkdir(parents=True, exist_ok=True)
    ws, cache = work / "ws", work / "cache"
    for old in (ws, cache, work / "stack"):
        shutil.rmtree(old, ignore_errors=True)
    tips = order_workspace(ws)
    out: dict[str, Any] = {"workload": {"chain_s": 9.0, "short_s": 24 * 0.4, "actions": 27, "workers": 2, "slots": 1},
                           "runs": []}
    stack = ExecStack(work / "stack", workers=2)
    try:
        flags = ("--remote-executor", stack.url, "-j1")
        for attempt in range(3):  # a fresh BuildGrid's first SQL connections may still be settling
            try:
                _bgraph(ws, cache, *flags, "--remote-jobs", "4", *[f"//warm:warm{w}" for w in range(4)])
                break
            except SystemExit as e:
                print(f"warm-up {attempt + 1} failed, retried: {str(e)[:300]}", file=sys.stderr)
                time.sleep(3)
        else:
            raise SystemExit(f"error: the warm-up build failed three times (BuildGrid's log: {stack.grid.log})")
        _bgraph(ws, cache, *flags, "--remote-jobs", "8", *tips)  # the first build: durations recorded
        edit = 0
        for r in range(rounds):
            for i in range(len(compared)):
                name, extra, env = compared[(i + r) % len(compared)]
                edit += 1
                (ws / "common.txt").write_text(f"{edit}\n")
                load = os.getloadavg()[0]
                summary, outside = _bgraph(ws, cache, *flags, *extra, *tips, env=env)
                row = {"mode": name, "round": r + 1, "wall_s": summary["wall_s"], "outside_s": round(outside, 2),
                       "executed": summary["executed"], "load": round(load, 2)}
                out["runs"].append(row)
                print(json.dumps(row), flush=True)
    finally:
        stack.stop()
        shutil.rmtree(work / "stack", ignore_errors=True)
    out["medians"] = {}
    for name, _extra, _env in compared:
        walls = sorted(r["wall_s"] for r in out["runs"] if r["mode"] == name)
        out["medians"][name] = walls[len(walls) // 2]
    return out


def main(argv: list[str] | None = None) -> int:
    """Parse the command line, run the builds, print and write the figures."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=Path("/var/tmp/bgraph-remote-priority"), help="scratch dir")
    ap.add_argument("--rounds", type=int, default=3, help="builds per mode")
    ap.add_argument("--in-flight", type=int, default=8, help="--remote-jobs of the two builds compared")
    ap.add_argument("--keep", action="store_true", help="keep the scratch dir (caches, workspace)")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        print(f"error: --rounds {args.rounds} is below 1\nhint: --rounds 3")
        return 2
    if args.in_flight < 3:
        print(f"error: --in-flight {args.in_flight} is not above the fleet's 2 slots\nhint: --in-flight 8")
        return 2
    try:
        out = run(args.work, args.rounds, args.in_flight)
    finally:
        if not args.keep:
            shutil.rmtree(args.work, ignore_errors=True)
    print(json.dumps(out["medians"], indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
