#!/usr/bin/env python3
"""Benchmark: one target's definition edited in an N-genrule workspace (`bench/scale.py`'s graph
and its `redefine_target` edit), two bgraph commits side by side, interleaved.

Each commit gets its own copy of the workspace and its own cache (a record or memo written by one
commit's code is not valid for the other's, so they cannot share one), both built cold first.
Then, `--reps` times, each commit in turn (the order alternating) has the same genrule's command
edited and rebuilds; the wall time of that build is taken. Both are run from `git archive`
snapshots, compiled to bytecode as `pip install` leaves them.

Usage: python3 bench/target_edit_ab.py [--base REV] [--new REV] [--sizes 1000,10000] [--reps 4] [--json-out F]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import scale  # noqa: E402  (the generator and the edit)

REPO = Path(__file__).resolve().parents[1]


def snapshot(rev: str, dest: Path) -> Path:
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(dest / "build_graph")], check=True)
    return dest


def timed_build(code: Path, root: Path) -> tuple[float, float]:
    """(wall, CPU) seconds of `bgraph build //many:all-of-them` with the code at `code` (CPU: user +
    system of the bgraph process and its children, from wait4)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPATH"] = str(code)
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-P", "-m", "build_graph", "--cache-dir", str(root / "cache"),
                             "build", "-j2", "//many:all-of-them"], cwd=root, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out = proc.stdout.read()
    _pid, status, usage = os.wait4(proc.pid, 0)
    wall = time.monotonic() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"build failed in {root}:\n{out.decode(errors='replace')[-3000:]}")
    return wall, usage.ru_utime + usage.ru_stime


def build(code: Path, root: Path) -> float:
    return timed_build(code, root)[0]


def ab_setup(prefix: str) -> tuple[argparse.Namespace, Path, dict[str, Path], dict[str, str]]:
    """The A/B benches' shared start: their arguments, a work directory, each commit's code
    snapshot and short hash."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="HEAD~1")
    ap.add_argument("--new", default="HEAD")
    ap.add_argument("--sizes", default="1000,10000")
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--json-out")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix=prefix, dir="/var/tmp"))
    revs = {"base": args.base, "new": args.new}
    code = {name: snapshot(rev, work / f"code-{name}") for name, rev in revs.items()}
    commits = {name: subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", rev], check=True,
                                    capture_output=True, text=True).stdout.strip() for name, rev in revs.items()}
    return args, work, code, commits


def main() -> None:
    args, work, code, commits = ab_setup("target-edit-ab-")
    rows = []
    for n in (int(x) for x in args.sizes.split(",")):
        roots = {}
        for name in code:
            roots[name] = work / f"ws-{n}-{name}"
            scale.generate(roots[name], n)
            scale.age(roots[name])
            print(f"N={n} {name} ({commits[name]}) cold {build(code[name], roots[name]):.1f} s", flush=True)
        times: dict[str, list[float]] = {name: [] for name in code}
        for rep in range(args.reps):
            for name in (["base", "new"] if rep % 2 == 0 else ["new", "base"]):
                scale.redefine_target(roots[name], 10 + rep)
                past = time.time() - 20  # edited a while ago: its stamp is trusted at once
                os.utime(roots[name] / "targets" / "many.toml", (past, past))
                times[name].append(build(code[name], roots[name]))
        row = {"n": n, **{f"{name}_s": [round(t, 3) for t in ts] for name, ts in times.items()},
               **{f"{name}_median_s": round(statistics.median(ts), 3) for name, ts in times.items()},
               "commits": commits}
        print(json.dumps(row), flush=True)
        rows.append(row)
        for root in roots.values():
            shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(work, ignore_errors=True)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
