#!/usr/bin/env python3
"""Benchmark: a cold build of the same real vLLM work, bgraph against vLLM's own CMake + Ninja,
side by side in one run (interleaved, --repeat times): the configure and the three FP4
quantization TUs of //vllm:smoke-fp4-sm121 (nvfp4_quant_kernels, activation_nvfp4_quant_fusion_
kernels, nvfp4_experts_quant) for 12.1a, Release.

  bgraph  `bgraph build --check //vllm:smoke-fp4-sm121`: every action of the target re-executed
          (configure, then per TU: dryrun, preprocessing, cudafe++, cicc, ptxas, fatbinary, host
          compile, `ld -r`), in the sandbox, its inputs (toolkit, torch, CUTLASS) from the cache
  vllm    `cmake -G Ninja` of the same patched source with the same cache variables into a fresh
          build directory, then `ninja` of the same three objects (plain nvcc, no ccache)

Both use the same nvcc 13.0.88 toolkit prefix, CUTLASS, torch 2.14.0, GCC 12, CMake 3.31.10 and
Ninja 1.13.2. CPU is what the machine spent during each run (run it on an otherwise idle
machine): bubblewrap hides sandboxed processes from a parent's child rusage. bgraph's --check
also re-executes the target's dependencies (extracting torch's wheels, CUTLASS, the sources),
so its figures come twice: the whole run, and the target's own actions (from --profile).
The whole wheel's cold figures are in BENCHMARKS.md; this isolates the per-TU cost
of bgraph's decomposition on identical work.

Usage: python3 bench/vllm_smoke_cold.py --venv /tmp/vv [--repeat 2] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from vllm_own import INPUTS, bgraph_json, bgraph_outputs, cmake_cache, timed, writable_copy

SMOKE = "//vllm:smoke-fp4-sm121"
OBJECTS = ["CMakeFiles/_C_stable_libtorch.dir/csrc/quantization/fp4/nvfp4_quant_kernels.cu.o",
           "CMakeFiles/_C_stable_libtorch.dir/csrc/quantization/fp4/activation_nvfp4_quant_fusion_kernels.cu.o",
           "CMakeFiles/_C_stable_libtorch.dir/csrc/quantization/fp4/nvfp4_experts_quant.cu.o"]


def run_checked(argv: list, **kw) -> tuple[float, float]:
    """(wall, CPU the machine spent meanwhile) of one command, which must succeed."""
    wall, cpu, proc = timed(lambda: subprocess.run(argv, capture_output=True, text=True, **kw))
    if proc.returncode != 0:
        sys.exit(f"{argv[0]} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return wall, cpu


def run_bgraph() -> dict:
    """--check also re-executes the dependencies (fetches, the torch tree's 29 wheels, CUTLASS,
    the patched source), which vLLM's side does not build: the target's own figures come from
    --profile: from its first action's start to its last one's end, and the time inside them."""
    profile = Path(tempfile.mkdtemp(prefix="smoke-profile-")) / "profile.json"
    # Exit 3: some action's outputs differ (counted below), not a failure.
    wall, cpu, summary = timed(lambda: bgraph_json("build", "-j2", "--json", "--check", "--profile", str(profile),
                                                   SMOKE, ok=(0, 3)))
    executed = [a for a in summary["actions"] if a["status"] == "executed" and a["label"] == SMOKE]
    own = [e for e in json.loads(profile.read_text())["traceEvents"]
           if e.get("cat") == "action" and e["name"].startswith(SMOKE + " ")]
    span = (max(e["ts"] + e["dur"] for e in own) - min(e["ts"] for e in own)) / 1e6
    shutil.rmtree(profile.parent)
    return {"wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "target_span_s": round(span, 1),
            "target_action_s": round(sum(e["dur"] for e in own) / 1e6, 1),
            "actions": len(executed), "differing": sum(1 for a in executed if a.get("differs"))}


def run_vllm(venv: Path, src: Path, inputs: dict[str, Path]) -> dict:
    toolkit = inputs["//vllm:cuda-toolkit"]
    build = Path(tempfile.mkdtemp(prefix="vllm-own-smoke-"))
    env = {"PATH": f"{venv / 'bin'}:{toolkit / 'bin'}:/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root"),
           "LANG": "C.UTF-8", "CUDA_HOME": str(toolkit), "TORCH_CUDA_ARCH_LIST": "12.1a"}
    cache = {"CMAKE_BUILD_TYPE": "Release", "VLLM_TARGET_DEVICE": "cuda",
             "VLLM_PYTHON_EXECUTABLE": venv / "bin" / "python", **cmake_cache(inputs)}
    configure = run_checked([venv / "bin" / "cmake", "-G", "Ninja", "-S", src, "-B", build,
                             *(f"-D{k}={v}" for k, v in cache.items())], env=env)
    compile_ = run_checked([venv / "bin" / "ninja", "-C", build, "-j2", *OBJECTS], env=env)
    shutil.rmtree(build)
    return {"wall_s": round(configure[0] + compile_[0], 1), "cpu_s": round(configure[1] + compile_[1], 1),
            "configure_s": round(configure[0], 1), "compile_s": round(compile_[0], 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--venv", required=True, type=Path, help="a venv with torch 2.14.0, cmake 3.31.10, ninja")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args()
    inputs = bgraph_outputs(*INPUTS, SMOKE)
    src = Path(tempfile.mkdtemp(prefix="vllm-src-")) / "vllm"  # one writable copy for every run
    writable_copy(inputs["//sources:vllm-patched"], src)
    runs: dict[str, list] = {"bgraph": [], "vllm": []}
    for i in range(args.repeat):
        order = ("bgraph", "vllm") if i % 2 == 0 else ("vllm", "bgraph")
        for who in order:
            runs[who].append(run_bgraph() if who == "bgraph" else run_vllm(args.venv.resolve(), src, inputs))
            print(who, json.dumps(runs[who][-1]), flush=True)
    shutil.rmtree(src.parent)
    med = {who: sorted(r["wall_s"] for r in rs)[len(rs) // 2] for who, rs in runs.items()}
    span = sorted(r["target_span_s"] for r in runs["bgraph"])[len(runs["bgraph"]) // 2]
    cpu = {who: sorted(r["cpu_s"] for r in rs)[len(rs) // 2] for who, rs in runs.items()}
    result = {"runs": runs, "wall_ratio_bgraph_over_vllm": round(med["bgraph"] / med["vllm"], 3),
              "target_span_ratio_bgraph_over_vllm": round(span / med["vllm"], 3),
              "cpu_ratio_bgraph_over_vllm": round(cpu["bgraph"] / cpu["vllm"], 3)}
    print(json.dumps(result, indent=1))
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
