#!/usr/bin/env python3
"""Issue 21 item 7: FlashInfer's AOT modules built by bgraph (`ninja_generator`: FlashInfer's own
enumeration writes the ninja files in the sandbox, every nvcc edge a per-(TU, arch) action with
early cutoff) beside FlashInfer's own `python -m flashinfer.aot` (its ninja, MAX_JOBS=2), on the
same module set, in one run:

  cold   bgraph: a fresh --cache-dir holding only the fetched and unpacked inputs (the pinned
         sdist's tree, nvcc 13.0.88's toolkit, the torch and tvm_ffi environments, the Debian
         GCC 12 tree, Ninja); FlashInfer: its venv (the pinned sdist installed with torch 2.14.0
         and its other requirements), an empty build directory
  edit   one shared header (--header) gains an unused constexpr: bgraph through a patch on the
         source tree (one patch action), FlashInfer's build in its source tree edited in place
  arch   12.0a added to 12.1a (FLASHINFER_CUDA_ARCH_LIST="12.0a 12.1a"), the edit kept

Both sides get the same inputs: nvcc from bgraph's //vllm:cuda-toolkit tree (never the host's
/usr/local/cuda), GCC 12 (bgraph: the pinned Debian tree; FlashInfer: the host's /usr/bin/g++, the
same Debian 12 version), the sdist's 3rdparty/cccl as CCCL (targets/flashinfer_aot.py sets it for
both: FlashInfer #3159), the same `flashinfer.aot` flags; FlashInfer's enumeration is narrowed to the
module set by name (its own build step, `build_jit_specs` and ninja, runs unchanged).

CPU: bgraph's is its actions' CPU (its --json, measured in each sandbox's cgroup) plus its own
process's (RUSAGE_CHILDREN: planning, hashing, starting sandboxes); FlashInfer's is RUSAGE_CHILDREN
of its process tree (Python's enumeration and ninja's compilers). Where a cgroup can be made
(bench/cpu_group.py), each side's build also runs in one of its own: "group_cpu" is then exact for
both, whatever else the machine runs, and bgraph's "engine_exact" is its group less its actions'
(RUSAGE_CHILDREN counts bwrap's outer process twice: it runs in the action's cgroup too). The machine's other load during each build
(CPU of processes not ours, sampled) is printed beside: walls on a shared machine measure the queue.

Usage: python3 bench/flashinfer_aot.py [--work /tmp/bgraph-fi-bench] [--venv DIR] [--steps cold,edit,arch]
                                       [--modules norm,rope,...] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import difflib
import json
import resource
import shutil
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "bench"))
from arch_cache import Meter, rmtree  # noqa: E402
from cpu_group import CpuGroup  # noqa: E402
from bgraph_testlib import hermetic_env, workspace_copy  # noqa: E402
from vllm_own import ninja_log_edges  # noqa: E402

MODULES = "norm,rope,page,silu_and_mul,gelu_and_mul,gelu_tanh_and_mul"
HEADER = "include/flashinfer/vec_dtypes.cuh"
EDIT = ("\nnamespace flashinfer {\nconstexpr int bgraph_bench_edit = 1;  // bench/flashinfer_aot.py\n"
        "}  // namespace flashinfer\n")
AOT_ARGS = "--add-moe false --add-comm false --fa2-head-dim 64,64 128,128"  # as //flashinfer:aot-sm121's
ARCHS = {"cold": "12.1a", "edit": "12.1a", "arch": "12.0a 12.1a"}
PREFILL = ["//sources:flashinfer-sdist", "//sources:flashinfer", "//vllm:cuda-toolkit", "//vllm:torch-env",
           "//flashinfer:gen-env", "//toolchains:host-cc", "//toolchains:host", "//toolchains:ninja",
           "//toolchains:cuobjdump"]
TORCH, NINJA = "torch==2.14.0", "ninja==1.13.2"  # the pins of //vllm:torch-env and //toolchains:ninja

# FlashInfer's own AOT build with its enumeration narrowed to argv[1]'s module names; CCCL as
# targets/flashinfer_aot.py sets it (the sdist's 3rdparty/cccl, what a wheel build would hold).
FI_DRIVER = r'''
import sys
from pathlib import Path
from flashinfer import aot
from flashinfer.jit import core
names = set(sys.argv[1].split(","))
root = Path(aot.__file__).resolve().parents[1]
cccl = root / "3rdparty" / "cccl"
core.jit_env.CCCL_INCLUDE_DIRS = [cccl / "cub", cccl / "libcudacxx" / "include", cccl / "thrust"]
enumerate_all = aot.gen_all_modules
def narrowed(*args, **kwargs):
    specs = [s for s in enumerate_all(*args, **kwargs) if s.name in names]
    missing = names - {s.name for s in specs}
    if missing:
        sys.exit(f"FlashInfer's enumeration gave no module {sorted(missing)}")
    return specs
aot.gen_all_modules = narrowed
sys.argv = ["flashinfer.aot", *sys.argv[2:]]
aot.main()
'''


def bgraph(ws: Path, cache: Path, *args: str, group: CpuGroup | None = None) -> dict:
    """`bgraph --json ARGS` on the bench workspace (inside `group` where given); exits with its
    tail if it fails."""
    argv = [sys.executable, "-m", "build_graph", "-C", str(ws), "--cache-dir", str(cache), *args]
    proc = subprocess.run(group.wrap(argv) if group is not None else argv,
                          capture_output=True, text=True, env=hermetic_env(), cwd=ws)
    try:
        out = json.loads(proc.stdout)
    except json.JSONDecodeError:
        out = None
    if proc.returncode != 0 or not out or not out.get("ok", True):
        sys.exit(f"bgraph {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return out


def write_targets(ws: Path, modules: str, patched: bool) -> None:
    """//fibench: the module set for 12.1a (:aot) and for 12.0a + 12.1a (:aot-spark), over the
    sdist's tree with the header edit as a patch once `patched`."""
    cmd = (f"python3 -S $WS/targets/flashinfer_aot.py --src $SRC --modules {modules} "
           f"--manifest $OUT/modules.tsv -- --build-dir $OUT {AOT_ARGS}")
    patches = '["patches/fibench/edit.patch"]' if patched else "[]"
    (ws / "targets" / "fibench.toml").write_text(
        'package = "//fibench"\n\n'
        "[src]\n" 'kind = "patched_tree"\n' 'src = "//sources:flashinfer"\n' f"patches = {patches}\n\n"
        "[aot]\n" 'base = "//flashinfer:aot-sm121"\n' 'src = ":src"\n'
        # (a base's ":x" labels would read as //fibench's: spelled out)
        'ext = { torch = "//vllm:torch-env", gen = "//flashinfer:gen-env" }\n' f"cmd = {json.dumps(cmd)}\n\n"
        "[aot-spark]\n" 'base = ":aot"\n' 'archs = "spark"\n')


def edited(text: str) -> str:
    """The header with an unused constexpr before its last line (its include guard's #endif)."""
    head, sep, tail = text.rstrip("\n").rpartition("\n")
    return head + EDIT + sep + tail + "\n"


def bgraph_step(ws: Path, cache: Path, label: str, jobs: int) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    group = CpuGroup.make()  # exact: every process of the build, the sandboxes' included
    try:
        with Meter() as m:
            out = bgraph(ws, cache, "build", "--json", "-j", str(jobs), label, group=group)
        group_cpu = group.cpu_s() if group is not None else None
    finally:
        if group is not None:
            group.remove()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    # bgraph's own process (planning, hashing, the sandboxes' setup): the compilers' CPU is reaped
    # inside the sandboxes' PID namespaces and reaches bgraph only through its cgroup figures.
    # RUSAGE_CHILDREN also holds bwrap's outer process, which runs in the action's cgroup too
    # (counted twice); the build's own cgroup less the actions' is exact ("engine_exact").
    engine = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    mine = [a for a in out["actions"] if a["label"].startswith("//fibench:")]
    ran = [a for a in mine if a["status"] == "executed"]
    by = defaultdict(lambda: [0, 0.0])
    for a in ran:
        by[a["mnemonic"]][0] += 1
        by[a["mnemonic"]][1] += a["cpu_s"]
    tus_cicc = sorted({a["name"].split()[1] for a in ran if a["mnemonic"] == "CudaCicc"})
    actions_cpu = sum(a["cpu_s"] for a in ran)
    exact = {} if group_cpu is None else {"group_cpu": group_cpu, "engine_exact": group_cpu - actions_cpu}
    return {**exact, "wall": m.wall, "cpu": actions_cpu + engine, "actions_cpu": actions_cpu, "engine_cpu": engine,
            "foreign_cpu": m.foreign,
            "executed": len(ran), "hits": sum(a["status"] == "hit" for a in mine),
            "cut_off": sum(a["status"] == "cutoff" for a in mine),
            "by_mnemonic": {k: [v[0], round(v[1], 1)] for k, v in sorted(by.items())},
            "tus_cicc_ran": tus_cicc, "outputs": out["outputs"]}


def fi_env(venv: Path, toolkit: Path, work: Path, archs: str) -> dict[str, str]:
    return {"PATH": f"{venv}/bin:{toolkit}/bin:/usr/bin:/bin", "HOME": str(work / "fi-home"),
            "CUDA_HOME": str(toolkit), "CUDA_PATH": str(toolkit), "CXX": "/usr/bin/g++", "MAX_JOBS": "2",
            "FLASHINFER_CUDA_ARCH_LIST": archs, "FLASHINFER_WORKSPACE_BASE": str(work / "fi-home"),
            "PYTHONPATH": str(work / "fi-src"), "PYTHONDONTWRITEBYTECODE": "1", "LANG": "C.UTF-8"}


def fi_step(work: Path, venv: Path, toolkit: Path, modules: str, archs: str) -> dict:
    build = work / "fi-build"
    log = build / "cached_ops" / ".ninja_log"
    offset = log.stat().st_size if log.exists() else 0
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    group = CpuGroup.make()
    try:
        with Meter() as m:
            argv = [str(venv / "bin" / "python"), str(work / "fi_driver.py"), modules, "--build-dir", str(build),
                    *AOT_ARGS.split()]
            proc = subprocess.run(group.wrap(argv) if group is not None else argv,
                                  capture_output=True, text=True, env=fi_env(venv, toolkit, work, archs), cwd=work)
        group_cpu = group.cpu_s() if group is not None else None
    finally:
        if group is not None:
            group.remove()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    (work / "fi-last.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        sys.exit(f"FlashInfer's AOT build failed (all of it in {work / 'fi-last.log'}):\n{proc.stdout[-3000:]}\n"
                 f"{proc.stderr[-3000:]}")
    ran = [out for _s, _e, out in ninja_log_edges(log.read_bytes()[offset:].decode())] if log.exists() else []
    kinds = Counter("nvcc" if o.endswith(".cuda.o") else "link" if o.endswith(".so") else "c++" for o in ran)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return {**({} if group_cpu is None else {"group_cpu": group_cpu}),
            "wall": m.wall, "cpu": cpu, "foreign_cpu": m.foreign, "edges": len(ran), "by_kind": dict(kinds),
            "tus_ran": sorted(o.removeprefix(str(build / "cached_ops") + "/") for o in ran if o.endswith(".cuda.o"))}


def ensure_venv(venv: Path, sdist: Path) -> None:
    """FlashInfer's own environment: the pinned sdist installed with its requirements, torch as
    //vllm:torch-env pins it, Ninja as //toolchains:ninja pins it (pip's configured index)."""
    if (venv / "bin" / "python").exists():
        return
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", str(sdist), TORCH, NINJA], check=True)


def cubin_archs(cuobjdump: Path, so: Path) -> list[str]:
    listed = subprocess.run([str(cuobjdump), "--list-elf", str(so)], capture_output=True, text=True).stdout
    return sorted({w for line in listed.splitlines() for w in line.split(".") if w.startswith("sm_")})


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", type=Path, default=Path("/tmp/bgraph-fi-bench"))
    p.add_argument("--venv", type=Path, help="FlashInfer's venv (default WORK/venv; made if missing)")
    p.add_argument("--modules", default=MODULES)
    p.add_argument("--header", default=HEADER)
    p.add_argument("--steps", default="cold,edit,arch")
    p.add_argument("-j", "--jobs", type=int, default=2)
    p.add_argument("--json-out", type=Path)
    args = p.parse_args()
    work = args.work.resolve()
    venv = (args.venv or work / "venv").resolve()
    steps = [s for s in args.steps.split(",") if s]
    t0 = time.monotonic()
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    print(f"commit {commit}, modules {args.modules}, header {args.header}, -j{args.jobs}", flush=True)

    # Setup (not timed): the workspace copy, bgraph's fresh cache with the inputs fetched and
    # unpacked, FlashInfer's venv and a writable copy of the sdist's tree.
    for d in ("ws", "cache", "fi-src", "fi-build", "fi-home"):
        rmtree(work / d)
    ws = workspace_copy(work / "ws")
    write_targets(ws, args.modules, patched=False)
    cache = work / "cache"
    with Meter() as m:
        pre = bgraph(ws, cache, "build", "--json", "-j", str(args.jobs), *PREFILL)
    print(f"prefill: {pre['executed']} actions (fetch, unpack), {m.wall:.0f} s", flush=True)
    trees = {k: Path(v) for k, v in pre["outputs"].items()}
    [sdist] = [f for f in trees["//sources:flashinfer-sdist"].rglob("*.tar.gz")]
    ensure_venv(venv, sdist)
    shutil.copytree(trees["//sources:flashinfer"], work / "fi-src", copy_function=shutil.copy)
    subprocess.run(["chmod", "-R", "u+w", str(work / "fi-src")], check=True)
    (work / "fi-home").mkdir()
    (work / "fi_driver.py").write_text(FI_DRIVER)
    toolkit, cuobjdump = trees["//vllm:cuda-toolkit"], trees["//toolchains:cuobjdump"] / "bin" / "cuobjdump"
    header = work / "fi-src" / args.header
    if not header.is_file():
        sys.exit(f"--header {args.header}: no such file in the sdist")

    results = {}
    for step in steps:
        if step == "edit" or (step == "arch" and "edit" not in steps):
            original = header.read_text()
            if "bgraph_bench_edit" not in original:
                new = edited(original)
                diff = difflib.unified_diff(original.splitlines(True), new.splitlines(True),
                                            f"a/{args.header}", f"b/{args.header}")
                (ws / "patches" / "fibench").mkdir(parents=True, exist_ok=True)
                (ws / "patches" / "fibench" / "edit.patch").write_text("".join(diff))
                header.write_text(new)
                write_targets(ws, args.modules, patched=True)
        label = "//fibench:aot-spark" if step == "arch" else "//fibench:aot"
        b = bgraph_step(ws, cache, label, args.jobs)
        print(f"{step:5s} bgraph     {b['wall']:7.1f} s wall  {b['cpu']:7.1f} CPU-s (actions {b['actions_cpu']:.1f}, "
              f"engine {b['engine_cpu']:.1f})  executed {b['executed']}, "
              f"hits {b['hits']}, cut off {b['cut_off']}  (others' CPU meanwhile {b['foreign_cpu']:.0f} s)", flush=True)
        print(f"      by mnemonic (count, CPU-s): {b['by_mnemonic']}", flush=True)
        if "group_cpu" in b:
            print(f"      exact (its cgroup): {b['group_cpu']:.1f} CPU-s, engine {b['engine_exact']:.1f}", flush=True)
        f = fi_step(work, venv, toolkit, args.modules, ARCHS[step])
        print(f"{step:5s} FlashInfer {f['wall']:7.1f} s wall  {f['cpu']:7.1f} CPU-s  ninja edges {f['edges']} "
              f"{f['by_kind']}  (others' CPU meanwhile {f['foreign_cpu']:.0f} s)", flush=True)
        if "group_cpu" in f and "group_cpu" in b:
            print(f"      exact (its cgroup): {f['group_cpu']:.1f} CPU-s; bgraph / FlashInfer "
                  f"{b['group_cpu'] / f['group_cpu']:.3f}x (actions only {b['actions_cpu'] / f['group_cpu']:.3f}x)",
                  flush=True)
        # Same modules, same cubin archs on both sides.
        built = work / "fi-build" / "cached_ops"
        ours = {so.parent.name: cubin_archs(cuobjdump, so) for so in Path(b["outputs"][label]).glob("*/*.so")}
        theirs = {n: cubin_archs(cuobjdump, built / n / f"{n}.so") for n in args.modules.split(",")}
        same = ours == theirs
        print(f"      modules and cubin archs {'match' if same else 'DIFFER'}: {sorted(set(sum(theirs.values(), [])))}",
              flush=True)
        results[step] = {"bgraph": {k: v for k, v in b.items() if k != "outputs"}, "flashinfer": f,
                         "archs": ARCHS[step], "cubins_match": same}
    print(f"bench wall {time.monotonic() - t0:.0f} s", flush=True)
    if args.json_out:
        args.json_out.write_text(json.dumps({"commit": commit, "modules": args.modules, "header": args.header,
                                             "jobs": args.jobs, "steps": results}, indent=1))
    return 0 if all(r["cubins_match"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
