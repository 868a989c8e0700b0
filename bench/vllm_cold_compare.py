#!/usr/bin/env python3
"""Where a cold bgraph build of vLLM spends its time against vLLM's own build, object by object:
bgraph's `--profile` trace (each executed action, its process and its sandbox and store phases,
its CPU seconds) beside the `.ninja_log` of setup.py's CMake build (each edge's start and end).
Both builds ran two jobs on the same 2 cores (bench/vllm_cold_whole.py), so a lane-second on one
side is comparable with an edge-second on the other.

bgraph splits each nvcc edge into its steps (dryrun, hostpp, cudafe, devpp, cicc, ptxas, fatbin,
hostcc); their actions are summed back to the object they make.

Usage: python3 bench/vllm_cold_compare.py --profile PROFILE.json --ninja-log BUILD/.ninja_log [--top 15]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from vllm_own import ninja_log_edges


def bgraph_actions(profile: Path) -> list[dict]:
    """Executed actions of the trace: label, step, output name, seconds, process seconds, CPU."""
    events = [e for e in json.loads(profile.read_text())["traceEvents"] if e.get("ph") == "X"]
    actions = [e for e in events if e["cat"] == "action"]
    process = defaultdict(list)  # lane -> [(ts, dur)] of process phases
    for e in events:
        if e["cat"] == "process":
            process[e["tid"]].append((e["ts"], e["dur"]))
    rows = []
    for a in actions:
        label, step, rest = (a["name"].split(" ", 2) + ["", ""])[:3]
        head, _, arch = rest.rpartition(" ")  # "OBJECT ARCH" for device steps, "OBJECT" otherwise
        obj = head if head and arch.isalnum() else rest
        inside = sum(d for t, d in process[a["tid"]] if a["ts"] <= t <= a["ts"] + a["dur"])
        rows.append({"label": label, "step": step, "object": obj, "s": a["dur"] / 1e6, "process_s": inside / 1e6,
                     "cpu_s": (a.get("args") or {}).get("cpu_s") or 0.0})
    return rows


def ninja_edges(log: Path) -> dict[str, float]:
    """Seconds of each output's last run in a .ninja_log."""
    return {output: (end - start) / 1000 for start, end, output in ninja_log_edges(log.read_text())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", required=True, type=Path)
    ap.add_argument("--ninja-log", required=True, type=Path)
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    rows, edges = bgraph_actions(args.profile), ninja_edges(args.ninja_log)

    per_step: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0.0])
    per_object: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for r in rows:
        s = per_step[r["step"]]
        s[0] += 1
        s[1] += r["s"]
        s[2] += r["process_s"]
        s[3] += r["cpu_s"]
        if r["object"] in edges:
            per_object[r["object"]][0] += r["s"]
            per_object[r["object"]][1] += r["cpu_s"]
    matched_bgraph = sum(v[0] for v in per_object.values())
    matched_ninja = sum(edges[o] for o in per_object)
    print(f"bgraph: {len(rows)} actions, {sum(r['s'] for r in rows) / 60:.1f} lane-min, "
          f"{sum(r['process_s'] for r in rows) / 60:.1f} min in processes, {sum(r['cpu_s'] for r in rows) / 60:.1f} CPU-min")
    print(f"ninja:  {len(edges)} edges, {sum(edges.values()) / 60:.1f} edge-min")
    print(f"objects on both sides: {len(per_object)}: bgraph {matched_bgraph / 60:.1f} lane-min, "
          f"ninja {matched_ninja / 60:.1f} edge-min, ratio {matched_bgraph / max(matched_ninja, 1e-9):.3f}")
    unmatched = sorted({r["object"] for r in rows} - set(per_object))
    print(f"bgraph outputs not in the ninja log: {len(unmatched)} "
          f"({sum(r['s'] for r in rows if r['object'] in unmatched) / 60:.1f} lane-min)")
    print("\nper step: actions, lane-min, process-min, CPU-min")
    for step, (n, s, p, c) in sorted(per_step.items(), key=lambda kv: -kv[1][1]):
        print(f"  {step:12s} {n:5d} {s / 60:8.1f} {p / 60:8.1f} {c / 60:8.1f}")
    print(f"\nthe {args.top} objects where bgraph spent most over ninja: bgraph s, CPU s, ninja s, ratio")
    worst = sorted(per_object.items(), key=lambda kv: -(kv[1][0] - edges[kv[0]]))[:args.top]
    for obj, (s, cpu) in worst:
        print(f"  {s:7.1f} {cpu:7.1f} {edges[obj]:7.1f} {s / max(edges[obj], 1e-9):6.2f}  {obj}")


if __name__ == "__main__":
    main()
