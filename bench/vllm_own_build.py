#!/usr/bin/env python3
"""Benchmark (e) of issue 9: vLLM's own build, `pip wheel` through its setup.py with ccache and
MAX_JOBS=2, for the same three steps bgraph is measured on in bench/vllm_incremental.py:

  cold   a fresh copy of the patched source, an empty ccache, no build directory
  resume the same again without wiping anything (a cold build stopped part way goes on)
  b      a Python-only change (a line added to vllm/envs.py), in the same source tree
  c      a constexpr added to csrc/quantization/fp4/nvfp4_utils.cuh, in the same source tree

Same inputs as //wheels:vllm-sm121: the patched source tree (//sources:vllm-patched), the CUDA
toolkit prefix (//vllm:cuda-toolkit, nvcc 13.0.88), CUTLASS (//vllm:cutlass), the driver link stub
(//vllm:cuda-driver-stub), arch 12.1a, CMake 3.31.10, Ninja 1.13.2, the host GCC 12, and a venv with
torch 2.14.0 (--venv; the script installs vLLM's other build requirements into it). The Rust
frontend is left out as in bgraph's wheel (no cargo on PATH; it is optional in setup.py).

pip builds a local directory in place, so setup.py's CMake build directory (build/temp.*) persists
between the steps: ccache and Ninja both get their chance, which is vLLM's best case.

Usage: python3 bench/vllm_own_build.py --venv /tmp/vv --work /tmp/vllm-own [--steps cold,b,c]
                                        [--build-type RelWithDebInfo|Release] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from vllm_own import INPUTS, bgraph_outputs, cmake_cache, ninja_log_edges, timed, writable_copy

BUILD_REQUIREMENTS = ["cmake==3.31.10", "ninja==1.13.2", "setuptools>=77.0.3,<81", "setuptools-scm>=8",
                      "setuptools-rust>=1.9", "wheel", "jinja2", "packaging>=24.2"]


def build_only_configured_targets(setup_py: Path) -> None:
    """setup.py asks CMake for every extension's target, the left-out externals' too (upstream
    always fetches them), and then copies triton_kernels' Python files unconditionally: ask only
    for the targets the configure made, as bgraph's wheel does, and copy what exists."""
    text = setup_py.read_text()
    edits = [
        ("        num_jobs, _ = self.compute_num_jobs()\n",
         "        known = subprocess.check_output(['ninja', '-t', 'targets', 'all'], cwd=self.build_temp, text=True)\n"
         "        known = {line.split(':')[0] for line in known.splitlines()}\n"
         "        targets = [t for t in targets if t in known]\n"
         "        num_jobs, _ = self.compute_num_jobs()\n"),
        ("        if _is_cuda() or _is_hip():\n            # copy vllm/third_party/triton_kernels",
         "        if (_is_cuda() or _is_hip()) and os.path.isdir(\n"
         "                f\"{self.build_lib}/vllm/third_party/triton_kernels\"):\n"
         "            # copy vllm/third_party/triton_kernels")]
    for before, after in edits:
        if before not in text:
            sys.exit(f"{setup_py}: cannot find {before.strip()[:60]!r}")
        text = text.replace(before, after, 1)
    setup_py.write_text(text)


def ninja_log(src: Path) -> Path | None:
    logs = sorted(src.glob("build/temp.*/.ninja_log"))
    return logs[0] if logs else None


def ninja_edges_since(src: Path, offset: int) -> list[str]:
    """The outputs Ninja built since the log had `offset` bytes (one line per edge run)."""
    log = ninja_log(src)
    if log is None:
        return []
    return [output for _start, _end, output in ninja_log_edges(log.read_bytes()[offset:].decode())]


def ccache_stats(env: dict) -> dict:
    out = subprocess.run(["ccache", "--print-stats"], env=env, capture_output=True, text=True, check=True).stdout
    stats = dict(line.split("\t", 1) for line in out.splitlines() if "\t" in line)
    keys = ("direct_cache_hit", "preprocessed_cache_hit", "cache_miss")
    return {k: int(stats.get(k, 0)) for k in keys}


def pip_wheel(venv: Path, src: Path, dist: Path, env: dict, log: Path) -> tuple[float, float]:
    """(wall seconds, CPU seconds of pip and everything it ran: ninja, nvcc, cicc, ptxas, gcc)."""
    with open(log, "w") as out:
        wall, cpu, proc = timed(lambda: subprocess.run(
            [venv / "bin" / "python", "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-v", "-w", dist,
             src], env=env, stdout=out, stderr=subprocess.STDOUT))
    if proc.returncode != 0:
        sys.exit(f"pip wheel failed ({proc.returncode}); see {log}")
    return wall, cpu


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--venv", required=True, type=Path, help="a venv with torch 2.14.0")
    ap.add_argument("--work", required=True, type=Path)
    ap.add_argument("--steps", default="cold,b,c")
    ap.add_argument("--json-out", type=Path)
    ap.add_argument("--build-type", default="RelWithDebInfo",
                    help="setup.py's CMAKE_BUILD_TYPE: its default RelWithDebInfo, or Release as bgraph builds")
    args = ap.parse_args()
    steps = args.steps.split(",")
    venv, work = args.venv.resolve(), args.work.resolve()
    subprocess.run([venv / "bin" / "python", "-m", "pip", "install", "-q", *BUILD_REQUIREMENTS], check=True)

    out = bgraph_outputs(*INPUTS)
    toolkit = out["//vllm:cuda-toolkit"]
    src, dist, ccache_dir = work / "src", work / "dist", work / "ccache"
    if "cold" in steps:
        for path in (src, dist, ccache_dir):
            shutil.rmtree(path, ignore_errors=True)
        writable_copy(out["//sources:vllm-patched"], src)
        build_only_configured_targets(src / "setup.py")
    dist.mkdir(parents=True, exist_ok=True)
    env = {
        "PATH": f"{venv / 'bin'}:{toolkit / 'bin'}:/usr/local/bin:/usr/bin:/bin",  # no cargo: no Rust frontend
        "HOME": os.environ.get("HOME", "/root"), "LANG": "C.UTF-8", "TMPDIR": str(work / "tmp"),
        "CUDA_HOME": str(toolkit), "TORCH_CUDA_ARCH_LIST": "12.1a", "VLLM_TARGET_DEVICE": "cuda",
        "MAX_JOBS": "2", "CCACHE_DIR": str(ccache_dir), "CCACHE_MAXSIZE": "30G", "CMAKE_BUILD_TYPE": args.build_type,
        "CMAKE_ARGS": " ".join(f"-D{k}={v}" for k, v in cmake_cache(out).items()),
        "PIP_NO_INDEX": "1"}  # nothing downloads during the build
    (work / "tmp").mkdir(parents=True, exist_ok=True)

    result: dict = json.loads(args.json_out.read_text()) if args.json_out and args.json_out.exists() else {}
    for step in steps:
        if step == "b":
            envs = src / "vllm" / "envs.py"
            envs.write_text(envs.read_text() + f"# bench (e): Python only {os.urandom(4).hex()}\n")
        elif step == "c":
            header = src / "csrc" / "quantization" / "fp4" / "nvfp4_utils.cuh"
            marker = int.from_bytes(os.urandom(4), "little")
            header.write_text(header.read_text().replace(
                "namespace vllm {", f"namespace vllm {{\nconstexpr int kBgraphBenchMarker = {marker};", 1))
        log = ninja_log(src)
        offset = log.stat().st_size if log else 0
        subprocess.run(["ccache", "-z"], env=env, capture_output=True, check=True)
        for old in dist.glob("*.whl"):
            old.unlink()
        wall, cpu = pip_wheel(venv, src, dist, env, work / f"log-{step}.txt")
        edges = ninja_edges_since(src, offset)
        wheels = sorted(dist.glob("*.whl"))
        result[step] = {
            "wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "ninja_edges": len(edges),
            "compiles": sorted(e for e in edges if e.endswith(".o")), "ccache": ccache_stats(env),
            "wheel": wheels[0].name if wheels else None}
        print(json.dumps({step: {k: v for k, v in result[step].items() if k != "compiles"}}), flush=True)
        if args.json_out:
            args.json_out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
