#!/usr/bin/env python3
"""Benchmark: graph size. A package of N one-line genrules (each copies one source file) and one
target that depends on all of them; the same graph as a build.ninja. Measured side by side:
the cold build (bgraph only at N <= --cold-max), the no-op build, and `bgraph query` of the
whole graph, with Ninja's no-op beside.

Usage: python3 bench/scale.py [--sizes 1000,10000] [--cold-max 1000] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def generate(root: Path, n: int) -> None:
    (root / "targets").mkdir(parents=True)
    (root / "src").mkdir()
    shutil.copy(REPO / "WORKSPACE.toml", root / "WORKSPACE.toml")
    shutil.copy(REPO / "targets" / "toolchains.toml", root / "targets" / "toolchains.toml")
    rules, ninja = [], ["rule cp\n  command = cp $in $out\n"]
    for i in range(n):
        (root / "src" / f"f{i}.txt").write_text(f"{i}\n")
        rules.append(f'[g{i}]\nkind = "genrule"\nsrcs = ["src/f{i}.txt"]\nouts = ["o{i}.txt"]\n'
                     f'cmd = "cp $SRC/src/f{i}.txt $OUT/o{i}.txt"\n')
        ninja.append(f"build out/o{i}.txt: cp src/f{i}.txt\n")
    deps = ", ".join(f'd{i} = ":g{i}"' for i in range(n))
    rules.append(f'[all-of-them]\nkind = "genrule"\nouts = ["count.txt"]\ndeps = {{ {deps} }}\n'
                 'cmd = "ls /bgraph/in | wc -l > $OUT/count.txt"\n')
    (root / "targets" / "many.toml").write_text("\n".join(rules))
    ninja.append("build out/count.txt: cp " + " ".join(f"out/o{i}.txt" for i in range(n)) + "\n")
    (root / "build.ninja").write_text("".join(ninja).replace("build out/count.txt: cp",
                                                              "rule count\n  command = ls out | wc -l > $out\n"
                                                              "build out/count.txt: count"))


def timed(argv, cwd) -> float:
    start = time.monotonic()
    proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"failed: {argv}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return time.monotonic() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1000,10000")
    ap.add_argument("--cold-max", type=int, default=1000)
    ap.add_argument("--json-out")
    args = ap.parse_args()
    bgraph = [sys.executable, "-m", "build_graph"]
    rows = []
    for n in (int(x) for x in args.sizes.split(",")):
        root = Path(tempfile.mkdtemp(prefix=f"scale-{n}-"))
        generate(root, n)
        row = {"n": n}
        row["query_s"] = timed([*bgraph, "query", "deps(//many:all-of-them)"], root)
        if n <= args.cold_max:
            cache = root / "cache"
            row["cold_s"] = timed([*bgraph, "--cache-dir", str(cache), "build", "-j2", "//many:all-of-them"], root)
            row["noop_s"] = timed([*bgraph, "--cache-dir", str(cache), "build", "//many:all-of-them"], root)
        ninja = shutil.which("ninja")
        if ninja:
            timed([ninja, "-j2"], root)
            row["ninja_noop_s"] = timed([ninja], root)
        rows.append(row)
        print(json.dumps(row))
        shutil.rmtree(root, ignore_errors=True)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
