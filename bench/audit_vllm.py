#!/usr/bin/env python3
"""Benchmark: `bgraph audit` on the real vLLM 0.33.0 sources (issue 22, item 3), on a copy of the
workspace (`git archive` of --rev) and the user's cache (a full build of the wheels there makes the
baselines cache hits).

  (a) the software E2M1 patch (patches/legacy-dgx/vllm/0003) on vLLM's FP4 quantization TUs, for
      12.1a (//vllm:smoke-fp4-sm121-legacy) and 12.0f (//vllm:smoke-fp4-sm12x-legacy): minutes.
      Expected (DOMAIN.md): its three function hunks live for 121a only, in the FP4 TUs; the
      helper hunk breaks the 121a build (the others call it); all four dead for 120f.
  (b) the whole legacy wheel, //wheels:vllm-sm121-legacy: every hunk of patches/vllm/0002-0003,
      patches/legacy-dgx/vllm/*, the CCCL patch and the FP4 shim. Each CCCL hunk and the shim change
      the toolkit: with the audit's cutoff (build_graph/audit_cutoff.py) such a variant re-runs the
      configure and every TU's preprocessing, and takes the compile steps from the baseline (before
      it, every TU recompiled: about an hour each on 2 cores). Legacy 0001 builds every TU for 12.0f
      (about an hour: no baseline step has the same work). Expected: CUDA_SUPPORTED_ARCHS (legacy
      0001) live everywhere (121a device code only with it, 120f only without); the arch-list hunks
      (legacy 0002), the CCCL hunks and the shim dead; our 0002/0003 break the build (GCC 12,
      offline configure).
  (e) as (b) without legacy 0001: every other unit, the toolkit ones included.
  (c) our own patches on //wheels:vllm-sm121: patches/vllm/0001 live everywhere as legacy 0001,
      0002/0003 break the build. The 0001 variant builds all of vLLM for 12.0f (about an hour).
  (s) as (b), (d) as (c), on the smoke targets (the configure and the three FP4 quantization TUs):
      every hunk, the CCCL patch and the shim included, at the cost of those TUs only.

For each part: every hunk's verdict, TUs and archs, and the audit's cost (variant builds, actions
executed, CPU and wall time), as JSON (--json-out) and as Markdown tables for BENCHMARKS.md.

Usage: python3 bench/audit_vllm.py [--rev HEAD] [--cache ~/.cache/bgraph] [--parts a,b,c] [-j 2]
                                   [--only PATTERN ...] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
E2M1 = "patches/legacy-dgx/vllm/0003-nvfp4-software-e2m1-sm121.patch"
PARTS = {
    "a": [("//vllm:smoke-fp4-sm121-legacy", [E2M1]), ("//vllm:smoke-fp4-sm12x-legacy", [E2M1])],
    "b": [("//wheels:vllm-sm121-legacy", [])],
    "c": [("//wheels:vllm-sm121", [])],
    # One audit per group, so each group's report is kept (--json-out) as soon as it is done;
    # the cheapest first.
    "e": [("//wheels:vllm-sm121-legacy", [E2M1]),
          ("//wheels:vllm-sm121-legacy", ["patches/legacy-dgx/vllm/0002*"]),
          ("//wheels:vllm-sm121-legacy", ["//toolchains:cccl-patched add include"]),
          ("//wheels:vllm-sm121-legacy", ["patches/legacy-dgx/cccl/*"]),
          ("//wheels:vllm-sm121-legacy", ["patches/vllm/*"])],
    # (b) and (c) restricted to what the FP4 quantization TUs see: every hunk of the legacy set (the
    # CCCL patch and the shim included) and of our own patches, on the smoke targets; an hour or so.
    "s": [("//vllm:smoke-fp4-sm121-legacy", [])],
    "d": [("//vllm:smoke-fp4-sm121", [])],
}


def snapshot(rev: str) -> Path:
    ws = Path(tempfile.mkdtemp(prefix="audit-vllm-"))
    archive = subprocess.run(["git", "-C", REPO, "archive", rev], capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(ws, filter="data")
    return ws


def audit(ws: Path, cache: Path, label: str, only: list[str], jobs: int) -> tuple[float, dict]:
    argv = [sys.executable, "-m", "build_graph", "-C", str(ws), "--cache-dir", str(cache), "audit", "--json",
            "-j", str(jobs), label, *(x for p in only for x in ("--only", p))]
    print("$ " + " ".join(argv[1:]), file=sys.stderr, flush=True)
    start = time.monotonic()
    proc = subprocess.run(argv, stdout=subprocess.PIPE, text=True)  # progress lines go to the terminal
    wall = time.monotonic() - start
    if proc.returncode not in (0, 1) or not proc.stdout.strip():
        sys.exit(f"audit of {label} failed (exit {proc.returncode})")
    return wall, json.loads(proc.stdout)


def table(label: str, wall: float, report: dict) -> list[str]:
    c, b = report["cost"], report["baseline"]
    lines = [f"### `bgraph audit {label}`", "",
             f"{report['hunks']} hunks; baseline {b['executed']} actions executed ({b['wall_s']} s); "
             f"{c['builds']} variant builds, {c['executed']} actions executed, "
             f"{c.get('substituted', 0)} compile steps taken from the baseline, {c['cpu_s']} CPU-s, "
             f"{wall / 60:.1f} min wall", "",
             "| hunk | file | verdict | archs | TUs | actions executed | taken from baseline | samples agree | CPU | wall |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for p in report["patches"]:
        for u in p["units"]:
            archs = ", ".join(u["archs"]) or ""
            if u["archs_only_with"] or u["archs_only_without"]:
                archs += f" (only with: {', '.join(u['archs_only_with'])}; only without: {', '.join(u['archs_only_without'])})"
            tus = f"{len(u['tus'])}: " + ", ".join(t.rsplit("/", 1)[-1] for t in u["tus"][:3]) if u["tus"] else ""
            cost = u.get("cost") or {}
            samples = cost.get("samples") or []
            agree = f"{sum(x['same'] for x in samples)}/{len(samples)}" if samples else ""
            lines.append(f"| `{u['id']}` | {u['file']} | {u['verdict']} | {archs} | {tus} | "
                         f"{cost.get('executed', '')} | {cost.get('substituted', '')} | {agree} | "
                         f"{cost.get('cpu_s', '')} s | {cost.get('wall_s', '')} s |")
    return lines + [""]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rev", default="HEAD")
    p.add_argument("--cache", default=os.environ.get("BGRAPH_CACHE", "~/.cache/bgraph"))
    p.add_argument("--parts", default="a", help="which parts to run: a, b, c, d, e, s (comma-separated; default a)")
    p.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 2)
    p.add_argument("--only", action="append", default=[], help="passed to every audit (fnmatch on hunk ids)")
    p.add_argument("--json-out", help="write every report and its wall time here")
    args = p.parse_args()
    ws, cache = snapshot(args.rev), Path(os.path.expanduser(args.cache))
    results, markdown = [], []
    for part in args.parts.split(","):
        for label, only in PARTS[part.strip()]:
            wall, report = audit(ws, cache, label, only + args.only, args.jobs)
            results.append({"part": part, "label": label, "only": only + args.only, "wall_s": round(wall, 1),
                            "report": report})
            markdown += table(label, wall, report)
            if args.json_out:  # after each audit: a later one may take hours
                Path(args.json_out).write_text(json.dumps(results, indent=1))
    print("\n".join(markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
