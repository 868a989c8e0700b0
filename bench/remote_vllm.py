#!/usr/bin/env python3
"""The vLLM wheel rebuilt through BuildGrid with two local workers, against the local build (issue
36, Done-when 1): byte-identical outputs, the engine's overhead per action, the build's wall.

CACHE must hold a local build of LABEL made by this commit (`bgraph build LABEL` all hits). The
script moves the action-cache entries of REBUILD's targets (their keys and depfile manifests, from
the targets' traces) aside into WORK/aside, a cache directory of its own; everything upstream
(toolchains, torch, the patched source) stays a hit. Then PostgreSQL + bgd + two `bgraph worker`s
(one slot each, one shared worker cache) start on 127.0.0.1 (tests/remote_exec_servers.py) and
`bgraph build --remote-executor … --check-against WORK/aside LABEL` runs every moved action on the
workers: each result is compared with the local one filed under the same key, and the wheel's
bytes with the local wheel's. Where the remote run left no entry, the local one is moved back, so
CACHE ends as complete as it began. Long: the whole compile of the wheel (~1 h on 2 cores).

Per action, the overhead is the client's wall from taking the action up to its result filed
(input root, uploads, BuildGrid's queue and lease, the worker's staging and upload, fetching the
outputs back) less the process's own run on the worker (ExecutedActionMetadata).

With --local-cold the local build is made in the same run: CACHE is wiped, the label's inputs are
built untimed (downloads, toolchains, torch, the patched source), then the label is built locally,
timed, `-j2 --profile`; the local wall of the REBUILD targets' actions (first start to last end in
that profile) stands beside the remote run's wall of the same actions.

Usage: python3 bench/remote_vllm.py --cache /var/tmp/vllm-cache --workspace /var/tmp/vllm-ws \\
         --work /var/tmp/rvllm [--label //wheels:vllm-sm121] [--rebuild //vllm:build-sm121,//wheels:vllm-sm121]
         [--local-cold]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests"), str(REPO)]
from remote_exec_servers import ExecStack, WorkerProcess, missing_reason  # noqa: E402

from build_graph.store.trace import Trace  # noqa: E402


def bgraph(ws: Path, cache: Path, *args: str) -> dict:
    """`bgraph build --json ARGS` in `ws` with `cache`: its summary, also where outputs differed
    (exit with the tail on any other failure)."""
    p = subprocess.run([sys.executable, "-m", "build_graph", "-C", str(ws), "--cache-dir", str(cache), "build",
                        "--json", *args], capture_output=True, text=True, cwd=REPO)
    if p.returncode != 0 and not (p.stdout.startswith("{") and json.loads(p.stdout).get("differing")):
        sys.exit(f"bgraph build {' '.join(args)} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return json.loads(p.stdout)


def wheel_digests(tree: Path) -> dict[str, str]:
    """sha256 of each .whl below the output `tree`."""
    return {w.name: hashlib.sha256(w.read_bytes()).hexdigest() for w in sorted(Path(tree).resolve().rglob("*.whl"))}


def entry_files(ac: Path, keys: set[str]) -> list[Path]:
    """The action-cache files of `keys`: each result and its depfile manifest, where present."""
    found = []
    for key in keys:
        for suffix in (".json", ".reads.json"):
            path = ac / key[:2] / f"{key[2:]}{suffix}"
            if path.exists():
                found.append(path)
    return found


def move_aside(cache: Path, aside: Path, labels: list[str]) -> int:
    """Move the entries of `labels`' traced actions from `cache` into the cache dir `aside`
    (where `aside` holds one already, from an interrupted run, the cache's is the remote one: kept)."""
    base = cache / "v1" / "blake3"
    trace = Trace(base, base / "tmp", create=False)
    keys: set[str] = set()
    for label in labels:
        t = trace.load(label)
        if not t:
            sys.exit(f"{label}: no trace in {cache}: build it locally first")
        keys |= {a["key"] for a in t.get("actions", {}).values()}
        keys |= {r["key"] for r in t.get("last_build", [])}
    moved = 0
    for path in entry_files(base / "ac", keys):
        dest = aside / "v1" / "blake3" / "ac" / path.parent.name / path.name
        if dest.exists():
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, dest)
        moved += 1
    # The state file's rows are memos of those entries: the results filed there, and the per-target
    # memos and no-op records (forgotten all at once, as `cache gc` does when it removes anything).
    trace.state.drop_results(keys)
    trace.state.drop_records()
    trace.state.close()
    return moved


def move_back(cache: Path, aside: Path) -> int:
    """Put back every aside entry the cache has no entry for now; returns how many."""
    src, back = aside / "v1" / "blake3" / "ac", 0
    for path in sorted(src.rglob("*.json")) if src.is_dir() else []:
        dest = cache / "v1" / "blake3" / "ac" / path.parent.name / path.name
        if not dest.exists():
            os.replace(path, dest)
            back += 1
    return back


def span_of(profile: dict, labels: list[str]) -> dict:
    """First start to last end (s) of the profile's actions whose target is one of `labels`, and
    how many there were."""
    events = [e for e in profile["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "action"
              and any(e["name"].startswith(label + " ") for label in labels)]
    if not events:
        return {"actions": 0, "wall_s": 0.0}
    start = min(e["ts"] for e in events)
    end = max(e["ts"] + e["dur"] for e in events)
    return {"actions": len(events), "wall_s": round((end - start) / 1e6, 1)}


def build_local_cold(args: argparse.Namespace, suffix: str) -> dict:
    """The local side of the run: a wiped cache, the label's inputs untimed, then the label timed."""
    shutil.rmtree(args.cache, ignore_errors=True)
    rebuild = args.rebuild.split(",")
    listed = subprocess.run([sys.executable, "-m", "build_graph", "-C", str(args.workspace), "--cache-dir",
                             str(args.cache), "query", "--output", "json",
                             f"deps({args.label})"], capture_output=True, text=True, cwd=REPO, check=True)
    deps = [t["label"] for t in json.loads(listed.stdout)["targets"] if t["label"] not in rebuild]
    t0 = time.monotonic()
    bgraph(args.workspace, args.cache, "-j2", "--platform", args.platform, *deps)
    inputs_s = time.monotonic() - t0
    profile = args.work / "local-profile.json"
    t0 = time.monotonic()
    summary = bgraph(args.workspace, args.cache, "-j2", "--platform", args.platform, "--profile", str(profile),
                     args.label)
    wall = time.monotonic() - t0
    ran = [a for a in summary["actions"] if a["status"] == "executed"]
    return {"inputs_untimed_s": round(inputs_s, 1), "wall_s": round(wall, 1), "executed": len(ran),
            "process_s": round(sum(a.get("duration_s") or 0 for a in ran), 1), "cpu_s": summary.get("cpu_s"),
            "rebuild_span": span_of(json.loads(profile.read_text()), [label + suffix for label in rebuild])}


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else 0.0


def overheads(profile: dict, summary: dict, suffix: str) -> list[float]:
    """Per action run remotely: the client's span less the worker's run of the process."""
    spans = {e["name"]: e["dur"] / 1e6 for e in profile["traceEvents"]
             if e.get("ph") == "X" and e.get("cat") == "action"}
    out = []
    for a in summary["actions"]:
        if a["status"] != "executed" or a.get("duration_s") is None:
            continue
        for label in (a["label"], a["label"] + suffix):  # the profile names the configured target
            if f"{label} {a['name']}" in spans:
                out.append(spans[f"{label} {a['name']}"] - a["duration_s"])
                break
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", type=Path, required=True, help="the cache holding the local build")
    ap.add_argument("--workspace", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True, help="scratch: the aside cache, the stack, reports")
    ap.add_argument("--label", default="//wheels:vllm-sm121")
    ap.add_argument("--rebuild", default="//vllm:build-sm121,//wheels:vllm-sm121")
    ap.add_argument("--platform", default="aarch64")
    ap.add_argument("--remote-jobs", default="2", help="in flight at once (default: the workers' slots)")
    ap.add_argument("--resume", action="store_true",
                    help="go on after a run that stopped: the actions it ran remotely are kept, the rest run")
    ap.add_argument("--local-cold", action="store_true",
                    help="wipe CACHE and make the local build in this run, timed (the side-by-side wall)")
    args = ap.parse_args()
    if missing_reason():
        sys.exit(missing_reason())
    suffix = f" ({args.platform})"
    local_cold = None
    if args.local_cold:
        shutil.rmtree(args.work, ignore_errors=True)
        args.work.mkdir(parents=True)
        local_cold = build_local_cold(args, suffix)
        print("local", json.dumps(local_cold), flush=True)
        (args.work / "local.json").write_text(json.dumps(local_cold, indent=1))
    local = bgraph(args.workspace, args.cache, "--platform", args.platform, args.label)
    if local["executed"]:
        sys.exit(f"{args.label} is not built in {args.cache} by this commit ({local['executed']} actions ran)")
    [local_out] = local["outputs"].values()
    local_wheels = wheel_digests(Path(local_out))
    aside = args.work / "aside"
    shutil.rmtree(args.work / "stack" if args.resume or local_cold else args.work, ignore_errors=True)
    if local_cold:
        shutil.rmtree(aside, ignore_errors=True)
    moved = move_aside(args.cache, aside, [label + suffix for label in args.rebuild.split(",")])
    report: dict = {"label": args.label, "platform": args.platform, "moved_entries": moved}
    stack = ExecStack(args.work / "stack", workers=0)
    try:
        shared = args.work / "stack" / "workers" / "cache"  # both workers stage from one local CAS
        shared.mkdir(parents=True)
        for name in ("w0", "w1"):
            (args.work / "stack" / "workers" / name).mkdir(parents=True)
            os.symlink(shared, args.work / "stack" / "workers" / name / "cache")
            stack.workers.append(WorkerProcess(stack.url, args.work / "stack" / "workers", name))
        time.sleep(5)
        for w in stack.workers:
            if w.proc.poll() is not None:
                sys.exit(f"a worker exited at start:\n{w.log.read_text()[-2000:]}")
        t0 = time.monotonic()
        remote = bgraph(args.workspace, args.cache, "--platform", args.platform, "--remote-executor", stack.url,
                        "--remote-jobs", args.remote_jobs, "--profile", str(args.work / "profile.json"),
                        "--check-against", str(aside), args.label)
        report["wall_s"] = round(time.monotonic() - t0, 1)
        if local_cold:
            report["local_cold"] = local_cold
            report["remote_span"] = span_of(json.loads((args.work / "profile.json").read_text()),
                                            [label + suffix for label in args.rebuild.split(",")])
    finally:
        stack.stop()
        report["moved_back"] = move_back(args.cache, aside)
    [remote_out] = remote["outputs"].values()
    ran = [a for a in remote["actions"] if a["status"] == "executed"]
    over = overheads(json.loads((args.work / "profile.json").read_text()), remote, suffix)
    report.update({
        "executed": len(ran), "remote_execution": remote.get("remote_execution"),
        "compared_with_local": remote.get("compared_with_other_cache"), "differing": remote.get("differing"),
        "wheels_local": local_wheels, "wheels_remote": wheel_digests(Path(remote_out)),
        "process_s_on_workers": round(sum(a.get("duration_s") or 0 for a in ran), 1),
        "overhead_s": {"n": len(over), "median": round(statistics.median(over), 3) if over else None,
                       "p95": round(percentile(over, 0.95), 3), "sum": round(sum(over), 1)},
    })
    report["identical"] = report["wheels_local"] == report["wheels_remote"] and not report["differing"]
    (args.work / "report.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    return 0 if report["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
