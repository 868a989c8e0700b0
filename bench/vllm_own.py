"""What the benches of vLLM's own build share (bench/vllm_own_build.py, bench/vllm_smoke_cold.py):
bgraph's pinned inputs, a writable copy of the patched source, the CMake cache variables that
point vLLM's CMake at those inputs, and timing a command with the CPU the machine spent meanwhile."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from bgraph_testlib import workspace_copy  # noqa: E402

INPUTS = ("//sources:vllm-patched", "//vllm:cuda-toolkit", "//vllm:cutlass", "//vllm:cuda-driver-stub")


_WORKSPACE: list[Path] = []


def bench_workspace() -> Path:
    """A copy of this workspace in a temporary directory, made once per bench run: building it
    writes bgraph-out/ links there, never into the checkout (the cache is the user's, shared)."""
    if not _WORKSPACE:
        import tempfile
        _WORKSPACE.append(workspace_copy(Path(tempfile.mkdtemp(prefix="bgraph-bench-ws-")) / "ws"))
    return _WORKSPACE[0]


def bgraph_json(*args: str, ok: tuple[int, ...] = (0,)) -> dict:
    """Run `bgraph ARGS` on a copy of this workspace and return its JSON output (exit if it fails)."""
    proc = subprocess.run([sys.executable, "-m", "build_graph", "-C", bench_workspace(), *args],
                          capture_output=True, text=True)
    if proc.returncode not in ok:
        sys.exit(f"bgraph {' '.join(args)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout)


def bgraph_outputs(*labels: str) -> dict[str, Path]:
    """Build (normally: hit) the labels and return their output trees."""
    return {k: Path(v) for k, v in bgraph_json("build", "--json", *labels)["outputs"].items()}


def ninja_log_edges(text: str) -> list[tuple[int, int, str]]:
    """The edge runs of a `.ninja_log`: start and end (ms since the build began) and the output."""
    edges = []
    for line in text.splitlines():
        if line and not line.startswith("#"):
            start, end, _mtime, output = line.split("\t")[:4]
            edges.append((int(start), int(end), output))
    return edges


def writable_copy(tree: Path, dest: Path) -> None:
    """A plain copy of an output tree: bgraph's trees are hard links into its store and stay
    read-only, and vLLM's configure writes generated sources into its source tree."""
    shutil.copytree(tree, dest, copy_function=shutil.copy)
    for path in dest.rglob("*"):
        if not path.is_symlink():
            path.chmod(path.stat().st_mode | 0o200)


def cmake_cache(outputs: dict[str, Path]) -> dict[str, Any]:
    """The cache variables of //vllm:build-sm121's configure, with bgraph's input trees."""
    toolkit, cutlass = outputs["//vllm:cuda-toolkit"], outputs["//vllm:cutlass"]
    return {"FETCHCONTENT_FULLY_DISCONNECTED": "ON", "VLLM_CUTLASS_SRC_DIR": cutlass,
            "CUTLASS_INCLUDE_DIR": cutlass / "include",
            "CUTLASS_TOOLS_UTIL_INCLUDE_DIR": cutlass / "tools/util/include",
            "CUDA_cuda_driver_LIBRARY": outputs["//vllm:cuda-driver-stub"] / "libcuda.so",
            "CUDAToolkit_ROOT": toolkit, "CUDA_TOOLKIT_ROOT_DIR": toolkit,
            "CMAKE_CUDA_COMPILER": toolkit / "bin" / "nvcc", "CMAKE_C_COMPILER": "/usr/bin/gcc",
            "CMAKE_CXX_COMPILER": "/usr/bin/g++", "CMAKE_CUDA_HOST_COMPILER": "/usr/bin/g++"}


def machine_busy_s() -> float:
    """CPU seconds the whole machine has spent busy since boot (/proc/stat: all but idle and iowait)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def timed(run: Callable[[], Any]) -> tuple[float, float, Any]:
    """(wall seconds, CPU seconds the machine spent meanwhile, the result of `run`). Machine-wide,
    because a process's child rusage does not see into bubblewrap: a sandboxed compiler's CPU is
    reaped inside the sandbox's PID namespace and never reaches bgraph. The machine must
    otherwise be idle (the benches say so)."""
    before = machine_busy_s()
    start = time.monotonic()
    result = run()
    wall = time.monotonic() - start
    return wall, machine_busy_s() - before, result
