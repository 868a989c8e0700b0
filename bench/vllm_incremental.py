#!/usr/bin/env python3
"""Benchmark: incremental rebuilds of //wheels:vllm-sm121 (issue 9, item 9), on a copy of the
workspace (`git archive` of --rev) and the user's cache, which must hold a full build.

  (a) no-op rebuild of the wheel
  (b) a Python-only patch (a line added to vllm/envs.py, as a patch under patches/vllm/): the
      number of compile-side actions run (goal 0) and the wall time of the new wheel
  (c) a patch to csrc/quantization/fp4/nvfp4_utils.cuh (a constexpr added in namespace vllm):
      which TUs and which steps re-run, the wall time, and what `bgraph explain` gives as the
      reason of each re-run compile step (it must name the header)
  (d) arch 12.1a -> 12.1a + 12.0a, on the CI smoke subset (//vllm:smoke-fp4-sm121: the real
      configure and vLLM's three FP4 quantization TUs), or with --d-whole on the wheel itself:
      which actions run, per step and arch
Each step starts from the previous one's patches removed (the cache makes that a no-op).

(e), vLLM's own `pip wheel` build with ccache for the cold build, (b) and (c), is
bench/vllm_own_build.py.

Usage: python3 bench/vllm_incremental.py [--rev HEAD] [--cache ~/.cache/bgraph] [--json-out FILE]
                                         [--d-whole] [--only-d | --skip-d]
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from build_graph.model import Digester
from build_graph.store.action_cache import LocalActionCache
from build_graph.store.cas import LocalCas
from build_graph.store.trace import Trace

REPO = Path(__file__).resolve().parents[1]
WHEEL = "//wheels:vllm-sm121"
COMPILE_MNEMONICS = ("CudaHostPreprocess", "CudaDevicePreprocess", "CudaFrontend", "CudaCicc", "CudaPtxas",
                     "CudaHostCompile", "CmakeCompile")


def snapshot(rev: str) -> Path:
    ws = Path(tempfile.mkdtemp(prefix="vllm-incr-"))
    archive = subprocess.run(["git", "-C", REPO, "archive", rev], capture_output=True, check=True).stdout
    with tarfile.open(fileobj=__import__("io").BytesIO(archive)) as tar:
        tar.extractall(ws, filter="data")
    return ws


def build(ws: Path, cache: Path, label: str = WHEEL) -> tuple[float, dict]:
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "build_graph", "-C", ws, "--cache-dir", cache, "build", "-j2",
                           "--json", label], capture_output=True, text=True)
    wall = time.monotonic() - start
    if proc.returncode != 0:
        sys.exit(f"build failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return wall, json.loads(proc.stdout)


def source_file(cache: Path, ws: Path, path: str) -> str:
    """A file of the patched vLLM tree, as the build sees it (through the built target)."""
    proc = subprocess.run([sys.executable, "-m", "build_graph", "-C", ws, "--cache-dir", cache, "build", "--json",
                           "//sources:vllm-patched"], capture_output=True, text=True, check=True)
    root = Path(json.loads(proc.stdout)["outputs"]["//sources:vllm-patched"])
    return (root / path).read_text()


def add_patch(ws: Path, name: str, path: str, before: str, after: str, why: str) -> None:
    diff = difflib.unified_diff(before.splitlines(keepends=True), after.splitlines(keepends=True),
                                f"a/{path}", f"b/{path}")
    (ws / "patches" / "vllm" / name).write_text(why + "\n\n" + "".join(diff))


def ran(summary: dict) -> list[str]:
    return sorted(a["name"] for a in summary["actions"]
                  if a["status"] == "executed" and a["mnemonic"] in COMPILE_MNEMONICS)


def by_step(actions: list[dict]) -> dict[str, int]:
    """Counts per step, the device steps per arch ("ptxas 120a")."""
    counts: dict[str, int] = {}
    for a in actions:
        words = a["name"].split()
        step = words[0] + (f" {words[-1]}" if words[0] in ("devpp", "cicc", "ptxas") else "")
        counts[step] = counts.get(step, 0) + 1
    return dict(sorted(counts.items()))


def recorded(ac: LocalActionCache, key: str):
    """The cached result of a build's action key; for a depfile-narrowed compile the key is its
    prekey, and the result is filed under the narrowed key its newest manifest entry names."""
    result = ac.get(key)
    if result is None and (entries := ac.get_manifest(key)):
        result = ac.get(entries[0]["key"])
    return result


# CCCL names its inline namespaces after __CUDA_ARCH_LIST__ (CUB_300001_SM_1210 -> CUB_300001_SM_1200_1210),
# so adding an arch changes the code of every TU that includes CUB or Thrust, for every arch.
CCCL_NAMESPACE = re.compile(rb"\d*(CUB|THRUST|CCCL)_\d+_SM_[0-9_]+?(_NS)?(?=[^0-9_]|_[^0-9])")


def old_arch_ptx_rerun(cache: Path, ac: LocalActionCache, before: dict, after: dict) -> dict:
    """The 12.1a cicc steps that (d) re-ran, and how many of their PTX files differ from the 12.1a
    build's only in CCCL's arch-list namespace names."""
    cas = LocalCas(cache, Digester())
    rerun = [n for n, v in after.items() if n.startswith("cicc ") and n.endswith(" 121a")
             and n in before and before[n]["key"] != v["key"]]
    only_namespaces = 0
    for name in rerun:
        old, new = (recorded(ac, t[name]["key"]) for t in (before, after))
        if old is None or new is None:
            continue
        trees = [cas.get_tree(r.output_tree) for r in (old, new)]
        ptx = [p for p in trees[0].entries if p.endswith(".ptx")]
        if ptx and all(p in trees[1].entries for p in ptx) and all(
                CCCL_NAMESPACE.sub(b"NS", cas.read_bytes(trees[0].entries[p]))
                == CCCL_NAMESPACE.sub(b"NS", cas.read_bytes(trees[1].entries[p])) for p in ptx):
            only_namespaces += 1
    return {"cicc_121a_rerun": len(rerun), "ptx_differs_only_in_cccl_namespaces": only_namespaces}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rev", default="HEAD")
    ap.add_argument("--cache", default=os.environ.get("BGRAPH_CACHE", "~/.cache/bgraph"))
    ap.add_argument("--json-out")
    ap.add_argument("--d-whole", action="store_true",
                    help="(d) on the whole wheel (about an hour of 12.0a device code on 2 cores)")
    ap.add_argument("--only-d", action="store_true", help="skip (a)-(c)")
    ap.add_argument("--skip-d", action="store_true", help="skip (d)")
    args = ap.parse_args()
    cache = Path(os.path.expanduser(args.cache))
    store = cache / "v1" / "blake3"
    ws = snapshot(args.rev)
    result = {}
    build(ws, cache)  # settle (the snapshot's first build re-plans everything from the cache)
    if not args.only_d:
        wall, summary = build(ws, cache)
        result["a_noop"] = {"wall_s": round(wall, 2), "executed": summary["executed"]}

        envs = source_file(cache, ws, "vllm/envs.py")
        add_patch(ws, "9001-bench-python-only.patch", "vllm/envs.py", envs,
                  envs + f"# bgraph bench: Python only {os.urandom(4).hex()}\n",
                  "Benchmark (b): a Python-only change.")
        wall, summary = build(ws, cache)
        result["b_python_patch"] = {"wall_s": round(wall, 2), "executed": summary["executed"],
                                    "compile_side": ran(summary)}
        (ws / "patches" / "vllm" / "9001-bench-python-only.patch").unlink()
        build(ws, cache)

        utils = source_file(cache, ws, "csrc/quantization/fp4/nvfp4_utils.cuh")
        # A new value each run: an edit the cache has never seen (an earlier run's would be a hit).
        marker = int.from_bytes(os.urandom(4), "little")
        changed = utils.replace("namespace vllm {", f"namespace vllm {{\nconstexpr int kBgraphBenchMarker = {marker};", 1)
        add_patch(ws, "9002-bench-nvfp4-utils.patch", "csrc/quantization/fp4/nvfp4_utils.cuh", utils, changed,
                  "Benchmark (c): a change to the FP4 utilities header.")
        wall, summary = build(ws, cache)
        steps = ran(summary)
        result["c_header_patch"] = {
            "wall_s": round(wall, 2), "executed": summary["executed"], "compile_side": len(steps),
            "tus": sorted({s.split()[1] for s in steps}),
            "by_step": {k: sum(1 for s in steps if s.startswith(k + " ")) for k in
                        ("hostpp", "devpp", "cudafe", "cicc", "ptxas", "hostcc", "compile")},
            "cut_off": summary["cut_off"]}
        explain = subprocess.run([sys.executable, "-m", "build_graph", "-C", ws, "--cache-dir", cache, "explain",
                                  "--json", "//vllm:build-sm121"], capture_output=True, text=True, check=True)
        reasons = {r["name"]: r["reason"] for r in json.loads(explain.stdout)
                   if r["status"] == "executed" and r["mnemonic"] in COMPILE_MNEMONICS}
        result["c_header_patch"]["explain"] = {
            "compile_steps": len(reasons),
            "naming_the_header": sum("nvfp4_utils.cuh" in why for why in reasons.values()),
            "example": next(iter(sorted(reasons.items())), None)}
        # What a user reads: `bgraph explain` of the wheel, which goes on into its dependencies.
        text = subprocess.run([sys.executable, "-m", "build_graph", "-C", ws, "--cache-dir", cache, "explain", WHEEL],
                              capture_output=True, text=True, check=True, env={**os.environ, "COLUMNS": "400"}).stdout
        blocks = text.split("  ran ")[1:]
        result["c_header_patch"]["explain_wheel"] = {
            "tu_blocks": sum(1 for b in blocks if " steps of " in b.splitlines()[0]),
            "tu_blocks_naming_the_header": sum(1 for b in blocks if " steps of " in b.splitlines()[0]
                                               and "nvfp4_utils.cuh" in b),
            "text": text.splitlines()[:40]}
        (ws / "patches" / "vllm" / "9002-bench-nvfp4-utils.patch").unlink()
        build(ws, cache)

    if args.skip_d:
        print(json.dumps(result, indent=1))
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(result, indent=1))
        return
    # (d) on the smoke subset (CI-sized), or with --d-whole on the wheel itself.
    table, label = ("build-sm121", WHEEL) if args.d_whole else ("smoke-fp4-sm121", "//vllm:smoke-fp4-sm121")
    _, base = build(ws, cache, label)  # settle (shared with the full build's actions)
    base_keys = {a["key"] for a in base["actions"]}
    compile_target = "//vllm:build-sm121" if args.d_whole else label
    base_trace = Trace(store, store / "tmp").load(compile_target).get("actions", {})
    toml = ws / "targets" / "vllm.toml"
    text = toml.read_text()
    head, _, tail = text.partition(f"[{table}]")
    toml.write_text(head + f"[{table}]" + tail.replace('archs = "sm121"', 'archs = ["12.1a", "12.0a"]', 1))
    wall, summary = build(ws, cache, label)
    executed = [a for a in summary["actions"] if a["status"] == "executed"]
    # What (d) has to run on a cache that holds only the 12.1a build: the actions whose key the 12.1a graph
    # lacks. It does not depend on what this cache already holds (a resumed run executes fewer); their CPU
    # time is what the action cache recorded when each ran.
    new = [a for a in summary["actions"] if a["key"] not in base_keys]
    ac = LocalActionCache(store, store / "tmp")
    new_cpu = sum((r.duration_s if (r := recorded(ac, a["key"])) else 0.0) for a in new)
    result["d_add_arch_whole" if args.d_whole else "d_add_arch_smoke"] = {
        "wall_s": round(wall, 2), "executed": len(executed), "by_step": by_step(executed),
        "cut_off": summary["cut_off"], "hits": summary["hits"],
        "cpu_s": round(sum(a.get("duration_s") or 0 for a in executed), 1),
        "graph_actions": len(summary["actions"]), "base_graph_actions": len(base["actions"]),
        "new_keys": len(new), "new_keys_by_step": by_step(new), "new_keys_action_s": round(new_cpu, 1),
        "old_arch_ptx_rerun": old_arch_ptx_rerun(cache, ac, base_trace,
                                                 Trace(store, store / "tmp").load(compile_target).get("actions", {}))}
    toml.write_text(text)
    print(json.dumps(result, indent=1))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
