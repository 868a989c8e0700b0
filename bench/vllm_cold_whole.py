#!/usr/bin/env python3
"""Benchmark: the cold build of the whole //wheels:vllm-sm121, and vLLM's own cold `pip wheel` of the
same source beside it, in one run (issue 9, (e)). About two hours of a 2-core machine; run it with
nothing else on the machine.

  bgraph  a fresh cache (--cache, wiped first) that holds only the wheel's inputs, built untimed
          (the pinned downloads: torch's 29 wheels, the CUDA wheels, the vLLM and FlashInfer sdists;
          the toolkit prefix, CUTLASS, the patched source); then, timed, `bgraph build -j2
          --profile //wheels:vllm-sm121`: the configure, every compile step, the links, the wheel
  vllm    bench/vllm_own_build.py --steps cold (setup.py, ccache empty, MAX_JOBS=2) with
          --build-type (Release by default, as bgraph's target builds; vLLM's default is
          RelWithDebInfo)

Usage: python3 bench/vllm_cold_whole.py --venv /tmp/vv [--cache /tmp/bgraph-cold] [--work /tmp/vllm-own]
                                        [--build-type Release] [--order bgraph,vllm] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

from vllm_own import REPO, bgraph_json

WHEEL = "//wheels:vllm-sm121"
COMPILE = "//vllm:build-sm121"


def run_bgraph(cache: Path) -> dict:
    shutil.rmtree(cache, ignore_errors=True)
    bgraph = partial(bgraph_json, "--cache-dir", str(cache))
    deps = [t["label"] for t in bgraph("query", "--output", "json", f"deps({WHEEL})")["targets"]
            if t["label"] not in (WHEEL, COMPILE)]
    bgraph("build", "-j2", "--json", *deps)  # the inputs, untimed
    profile = Path(tempfile.mkdtemp(prefix="cold-profile-")) / "profile.json"
    start = time.monotonic()
    summary = bgraph("build", "-j2", "--json", "--profile", str(profile), WHEEL)
    wall = time.monotonic() - start
    executed = [a for a in summary["actions"] if a["status"] == "executed"]
    top = sorted(executed, key=lambda a: -a["duration_s"])[:10]
    return {"wall_s": round(wall, 1), "executed": len(executed), "hits": summary["hits"],
            "action_s": round(sum(a["duration_s"] for a in executed), 1), "cpu_s": summary.get("cpu_s"),
            "profile": summary["profile"], "profile_file": str(profile),
            "top10": [[a["name"], a["duration_s"], a.get("cpu_s"), a["peak_mb"]] for a in top]}


def run_vllm(venv: Path, work: Path, build_type: str) -> dict:
    out = work.parent / f"{work.name}-cold.json"
    out.unlink(missing_ok=True)
    subprocess.run([sys.executable, REPO / "bench" / "vllm_own_build.py", "--venv", venv, "--work", work,
                    "--steps", "cold", "--build-type", build_type, "--json-out", out], check=True)
    return json.loads(out.read_text())["cold"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--venv", required=True, type=Path, help="a venv with torch 2.14.0 (see vllm_own_build.py)")
    ap.add_argument("--cache", type=Path, default=Path("/tmp/bgraph-cold"), help="wiped first")
    ap.add_argument("--work", type=Path, default=Path("/tmp/vllm-own"))
    ap.add_argument("--build-type", default="Release")
    ap.add_argument("--order", default="bgraph,vllm")
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args()
    result: dict = {"build_type_vllm": args.build_type}
    for who in args.order.split(","):
        result[who] = run_bgraph(args.cache) if who == "bgraph" else run_vllm(args.venv, args.work, args.build_type)
        print(who, json.dumps({k: v for k, v in result[who].items() if k not in ("top10", "compiles")}), flush=True)
        if args.json_out:
            args.json_out.write_text(json.dumps(result, indent=1))
    if "bgraph" in result and "vllm" in result:
        result["wall_ratio_bgraph_over_vllm"] = round(result["bgraph"]["wall_s"] / result["vllm"]["wall_s"], 3)
    print(json.dumps(result, indent=1))
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
