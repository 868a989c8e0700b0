#!/usr/bin/env python3
"""Benchmark: graph size. A package of N one-line genrules (each copies one source file) and one
target that depends on all of them; the same graph as a build.ninja. Measured side by side:
the cold build and the no-op build (at N <= --cold-max), planning all N actions against a cache
that holds only the genrules' shell toolchain (`bgraph build --dry-run`: N sources stored, N keys
computed and looked up; nothing runs) with its peak RSS, `bgraph query` of the whole graph and
`bgraph why` from the top target to one genrule (after the cold build), one source edited and
rebuilt, then a second source (the next edit of an edit-build loop), then bgraph-out/ removed and
built again (`make clean`), then one target's definition edited (its genrule's command) and
rebuilt; Ninja's cold, no-op, edit and edited-edge builds beside. `query` is run three times: the first loads the
workspace, the others are answered from the record of the first (noop.py).

--bgraph-path DIR runs the bgraph found there (a snapshot of one commit: `git archive REV | tar -x
-C DIR`) instead of the installed one, so edits to the checkout during a run cannot mix versions.

Usage: python3 bench/scale.py [--sizes 1000,10000,100000] [--cold-max 10000] [--ninja-max N]
                              [--bgraph-path DIR] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import os
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
    shutil.copytree(REPO / "toolchains", root / "toolchains")
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


def age(root: Path, seconds: float = 60) -> None:
    """Date every generated file back (a tree edited a while before the build)."""
    past = time.time() - seconds
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            os.utime(os.path.join(dirpath, name), (past, past), follow_symlinks=False)


def edit(root: Path, i: int) -> None:
    """A user's edit of one source (new content, written now: Ninja compares mtimes)."""
    (root / "src" / f"f{i}.txt").write_text(f"edited {i}\n")


def redefine_target(root: Path, i: int) -> None:
    """A user's edit of one target's definition: genrule g<i> gets another command; every other
    target stays as it was."""
    toml = root / "targets" / "many.toml"
    old = f'cmd = "cp $SRC/src/f{i}.txt $OUT/o{i}.txt"'
    # cat, not cp: cp keeps the input's read-only mode, and an action (no capability, as root
    # too) cannot then append to its own copy.
    toml.write_text(toml.read_text().replace(old, f'cmd = "cat $SRC/src/f{i}.txt > $OUT/o{i}.txt && echo >> $OUT/o{i}.txt"', 1))


def redefine_edge(root: Path, i: int) -> None:
    """The same edit for Ninja: edge out/o<i>.txt gets another command (a rule of its own)."""
    ninja = root / "build.ninja"
    text = ninja.read_text().replace(f"build out/o{i}.txt: cp ", f"build out/o{i}.txt: cpx ", 1)
    ninja.write_text("rule cpx\n  command = cp $in $out && echo >> $out\n" + text)


ENV = dict(os.environ)


CPU: dict[str, float] = {}  # the last timed command's CPU seconds (user + system, from wait4)


def timed(argv, cwd, rss: bool = False):
    """Wall seconds of one command (and its peak RSS in MiB, from wait4, with rss=True); its CPU
    seconds go to CPU["last"]: on a machine shared with other builds, wall time measures the
    queue for the cores, CPU time what the command itself cost."""
    with tempfile.TemporaryFile() as out:
        start = time.monotonic()
        proc = subprocess.Popen(argv, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, env=ENV)
        _pid, status, usage = os.wait4(proc.pid, 0)
        wall = time.monotonic() - start
        CPU["last"] = usage.ru_utime + usage.ru_stime
        if os.waitstatus_to_exitcode(status) != 0:
            out.seek(0)
            sys.exit(f"failed: {argv}\n{out.read()[-3000:].decode(errors='replace')}")
    return (wall, usage.ru_maxrss / 1024) if rss else wall


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1000,10000,100000")
    ap.add_argument("--cold-max", type=int, default=10000)
    ap.add_argument("--ninja-max", type=int, default=10**9, help="run Ninja only at N <= this")
    ap.add_argument("--bgraph-path", help="run bgraph from this directory (PYTHONPATH)")
    ap.add_argument("--json-out")
    args = ap.parse_args()
    if args.bgraph_path:
        ENV["PYTHONPATH"] = str(Path(args.bgraph_path).resolve())
        # Bytecode, as `pip install` leaves it (a host with PYTHONDONTWRITEBYTECODE set would
        # otherwise compile every module on every run).
        subprocess.run([sys.executable, "-m", "compileall", "-q", str(Path(args.bgraph_path) / "build_graph")],
                       check=True)
    bgraph = [sys.executable, "-P", "-m", "build_graph"]  # -P: never the current directory's bgraph
    rows = []
    template = Path(tempfile.mkdtemp(prefix="scale-toolchain-"))  # the shell toolchain, built once, untimed
    for n in (int(x) for x in args.sizes.split(",")):
        root = Path(tempfile.mkdtemp(prefix=f"scale-{n}-"))
        generate(root, n)
        if not (template / "v1").exists():
            timed([*bgraph, "--cache-dir", str(template), "build", "-j2", "//toolchains:host"], root)
        row = {"n": n}
        age(root)  # as files edited a while ago: bgraph trusts no stamp younger than its racy window
        queries = [(timed([*bgraph, "query", "deps(//many:all-of-them)"], root), CPU["last"]) for _ in range(3)]
        row["query_first_s"], row["query_first_cpu_s"] = queries[0]  # loads the workspace
        row["query_s"], row["query_cpu_s"] = min(w for w, _c in queries[1:]), min(c for _w, c in queries[1:])
        subprocess.run(["cp", "-a", str(template), str(root / "plan-cache")], check=True)
        row["plan_s"], row["plan_rss_mib"] = timed(
            [*bgraph, "--cache-dir", str(root / "plan-cache"), "build", "--dry-run", "//many:all-of-them"],
            root, rss=True)
        row["plan_cpu_s"] = CPU["last"]
        shutil.rmtree(root / "plan-cache", ignore_errors=True)
        if n <= args.cold_max:
            cache = root / "cache"
            subprocess.run(["cp", "-a", str(template), str(cache)], check=True)
            row["cold_s"] = timed([*bgraph, "--cache-dir", str(cache), "build", "-j2", "//many:all-of-them"], root)
            noops = [(timed([*bgraph, "--cache-dir", str(cache), "build", "//many:all-of-them"], root), CPU["last"])
                     for _ in range(3)]
            row["noop_s"], row["noop_cpu_s"] = min(w for w, _c in noops), min(c for _w, c in noops)
            row["noop_rss_mib"] = timed([*bgraph, "--cache-dir", str(cache), "build", "//many:all-of-them"], root,
                                        rss=True)[1]
            whys = [(timed([*bgraph, "--cache-dir", str(cache), "why", "//many:all-of-them", "//many:g0"], root),
                     CPU["last"]) for _ in range(3)]
            row["why_s"], row["why_cpu_s"] = min(w for w, _c in whys), min(c for _w, c in whys)
            edit(root, 0)
            row["edit_s"] = timed([*bgraph, "--cache-dir", str(cache), "build", "-j2", "//many:all-of-them"], root)
            row["edit_cpu_s"] = CPU["last"]
            edit(root, 2)  # the next edit of an edit-build loop (the last build was just after an edit)
            row["edit2_s"] = timed([*bgraph, "--cache-dir", str(cache), "build", "-j2", "//many:all-of-them"], root)
            row["edit2_cpu_s"] = CPU["last"]
            time.sleep(2.5)  # past the racy window: the next build can be a no-op
            timed([*bgraph, "--cache-dir", str(cache), "build", "//many:all-of-them"], root)
            shutil.rmtree(root / "bgraph-out")  # `make clean`: the links come back from the record
            row["clean_s"] = timed([*bgraph, "--cache-dir", str(cache), "build", "//many:all-of-them"], root)
            row["clean_cpu_s"] = CPU["last"]
            redefine_target(root, 3)
            row["target_edit_s"] = timed([*bgraph, "--cache-dir", str(cache), "build", "-j2", "//many:all-of-them"],
                                         root)
            row["target_edit_cpu_s"] = CPU["last"]
        ninja = shutil.which("ninja")
        if ninja and n <= args.ninja_max:
            row["ninja_cold_s"] = timed([ninja, "-j2"], root)
            noops = [(timed([ninja], root), CPU["last"]) for _ in range(3)]
            row["ninja_noop_s"], row["ninja_noop_cpu_s"] = min(w for w, _c in noops), min(c for _w, c in noops)
            edit(root, 1)
            row["ninja_edit_s"] = timed([ninja, "-j2"], root)
            row["ninja_edit_cpu_s"] = CPU["last"]
            redefine_edge(root, 3)
            row["ninja_target_edit_s"] = timed([ninja, "-j2"], root)
            row["ninja_target_edit_cpu_s"] = CPU["last"]
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
        rows.append(row)
        shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(template, ignore_errors=True)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
