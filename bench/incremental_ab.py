#!/usr/bin/env python3
"""Benchmark: the no-op and the edit paths of an N-genrule workspace (`bench/scale.py`'s graph),
two bgraph commits side by side, interleaved (issue 33 item 2: the figures must hold within 20 %).

Each commit gets its own copy of the workspace and its own cache (records and memos of one
commit's code are not the other's), both built cold first. Then, `--reps` times, each commit in
turn (the order alternating):
- no-op: the same request again, nothing changed (the no-op record answers);
- source edit: one source file's contents changed (the per-target memo answers);
- definition edit: one genrule's command changed in the target file.
Every edited file is written, then left alone past the 2 s racy-clean window (mtime and ctime) before
the build, for both commits alike. Wall and CPU seconds (user + system of the bgraph process and
its children) are taken; the CPU figure is the one to compare on a busy machine.

Usage: python3 bench/incremental_ab.py [--base REV] [--new REV] [--sizes 1000,10000] [--reps 4] [--json-out F]
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import scale  # noqa: E402  (the generator and the edits)
from target_edit_ab import ab_setup, timed_build as build  # noqa: E402

RACY_S = 2.1  # past the racy-clean window of either commit


def main() -> None:
    args, work, code, commits = ab_setup("incremental-ab-")
    rows = []
    for n in (int(x) for x in args.sizes.split(",")):
        roots = {}
        for name in code:
            roots[name] = work / f"ws-{n}-{name}"
            scale.generate(roots[name], n)
            scale.age(roots[name])
            time.sleep(RACY_S)
            print(f"N={n} {name} ({commits[name]}) cold {build(code[name], roots[name])[0]:.1f} s", flush=True)
            build(code[name], roots[name])  # the record is written by a build that found nothing racy
        steps = {"noop": lambda root, i: None,
                 "source_edit": lambda root, i: scale.edit(root, 10 + i),
                 "definition_edit": lambda root, i: scale.redefine_target(root, 20 + i)}
        figures: dict[str, dict[str, list]] = {s: {name: [] for name in code} for s in steps}
        for rep in range(args.reps):
            for step, change in steps.items():
                for name in (["base", "new"] if rep % 2 == 0 else ["new", "base"]):
                    change(roots[name], rep)
                    time.sleep(RACY_S)
                    figures[step][name].append(build(code[name], roots[name]))
        row = {"n": n, "commits": commits}
        for step, by in figures.items():
            for name, runs in by.items():
                row[f"{step}_{name}_wall_s"] = round(statistics.median(w for w, _ in runs), 3)
                row[f"{step}_{name}_cpu_s"] = round(statistics.median(c for _, c in runs), 3)
            row[f"{step}_cpu_ratio"] = round(row[f"{step}_new_cpu_s"] / row[f"{step}_base_cpu_s"], 3)
        print(json.dumps(row), flush=True)
        rows.append(row)
        for root in roots.values():
            shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(work, ignore_errors=True)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
