"""One FP4 TU (kernels/fp4/convert.cu, 12.0a + 12.1a) built as a Spark would (aarch64 nvcc, arm64
GCC; here under qemu-aarch64-static) beside the x86_64 cross build (`--platform aarch64`), step by
step: each output identical or how it differs, the wall time of each step (the native one under
qemu), the key fields that differ, and the actions whose keys both builds share.

    python3 bench/native_aarch64_step.py [--root /tmp/native-aarch64] [--json FILE]

The root keeps the workspace copy and the cache: a second run re-compares without re-running
qemu (the wall times shown are those recorded when each step ran)."""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests"), str(REPO)]

import native_aarch64 as native  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", type=Path, default=Path("/tmp/native-aarch64"))
    p.add_argument("--json", type=Path, help="write the rows and the shared keys here")
    args = p.parse_args()
    start = time.monotonic()
    built = native.build_both(args.root, jobs=2)
    rows, shared = native.compare(built), native.shared_keys(built)
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, commit {commit}, {platform.machine()}, "
          f"{len(__import__('os').sched_getaffinity(0))} cores; {time.monotonic() - start:.0f} s this run")
    print(f"| step | output | identical | cross s | qemu s | ratio | how it differs |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = r["native_s"] / r["cross_s"] if r["cross_s"] else 0
        print(f"| {r['step']} | {r['file']} | {'yes' if r['identical'] else 'no'} | {r['cross_s']:.2f} | "
              f"{r['native_s']:.2f} | {ratio:.1f}x | {r['why']} |")
    steps = {r["step"]: r for r in rows}
    total_c, total_n = sum(r["cross_s"] for r in steps.values()), sum(r["native_s"] for r in steps.values())
    print(f"\nall steps: cross {total_c:.1f} s, native under qemu {total_n:.1f} s ({total_n / total_c:.1f}x)")
    fields = sorted({f for r in rows for f in r["key_fields"]})
    print(f"key fields that differ in some step: {', '.join(fields)}; "
          f"in every step: {', '.join(sorted(set.intersection(*(set(r['key_fields']) for r in rows))))}")
    print(f"actions with the same key in both builds: {shared} "
          f"(cross {len(built['cross']['actions'])} actions, native {len(built['native']['actions'])})")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "shared": shared}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
