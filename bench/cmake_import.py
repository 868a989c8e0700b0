#!/usr/bin/env python3
"""Benchmark: the CMake import (`cmake_project`) against CMake's own Ninja build, plain and with
ccache, on the test project tests/data/cmake_project (2 CUDA TUs for 12.0a + 12.1a, 3 C++ TUs,
a generated source, a shared library).

Every builder uses the same CMake 3.31.10, Ninja 1.13.2 and nvcc 13.0.88: bgraph's own
`//toolchains:cmake`, `:ninja` and `:cuda-13.0` outputs (built first, untimed).

Steps, wall seconds, builders interleaved within a step and rotated per repeat:
  cold         empty build dir (and empty ccache / bgraph cache, toolchains excepted): configure + build
  no-op        build again, nothing changed
  header       a code edit in include/demo_offset.cuh (read by one CUDA TU), build
  reconfigure  a comment added to CMakeLists.txt, then a fresh configure and build, as a CI job
               or a Docker rebuild does it (plain Ninja recompiles all; ccache and bgraph should not)

Usage: python3 bench/cmake_import.py [--repeat 3] [--json-out FILE]
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

REPO = Path(__file__).resolve().parents[1]
PROJECT = REPO / "tests" / "data" / "cmake_project"
STEPS = ["cold", "no-op", "header", "reconfigure"]
BUILDERS = ["ninja", "ninja+ccache", "bgraph"]
TARGET = """[lib]
kind = "cmake_project"
srcs = ["demo/**"]
strip_prefix = "demo"
archs = ["12.0a", "12.1a"]
outputs = ["libdemo.so"]
"""


def sh(argv, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, **kw)
    if proc.returncode != 0:
        sys.exit(f"failed: {' '.join(map(str, argv))}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return proc


def timed(fn) -> float:
    start = time.monotonic()
    fn()
    return time.monotonic() - start


class Tools:
    """Toolchain paths from bgraph's own outputs (so every builder runs the same binaries)."""

    def __init__(self, work: Path):
        cache = work / "tools-cache"
        out = sh([sys.executable, "-m", "build_graph", "-C", str(REPO), "--cache-dir", str(cache), "build", "--json",
                  "//toolchains:cmake", "//toolchains:ninja", "//toolchains:cuda-13.0"]).stdout
        links = json.loads(out)["outputs"]
        self.cmake = str(Path(links["//toolchains:cmake"]).resolve() / "bin" / "cmake")
        ninja_dir = Path(links["//toolchains:ninja"]).resolve()
        self.ninja = str(ninja_dir / "ninja")
        self.cuda = Path(links["//toolchains:cuda-13.0"]).resolve()
        self.cache_template = cache


class NinjaBuilder:
    def __init__(self, name: str, work: Path, tools: Tools):
        self.name, self.tools = name, tools
        self.src = work / name / "src"
        self.build_dir = work / name / "build"
        self.env = dict(os.environ, CCACHE_DIR=str(work / name / "ccache"), CCACHE_NOHASHDIR="1")
        shutil.copytree(PROJECT, self.src)

    def configure(self) -> None:
        shutil.rmtree(self.build_dir, ignore_errors=True)
        args = [self.tools.cmake, "-G", "Ninja", "-S", str(self.src), "-B", str(self.build_dir),
                f"-DCMAKE_MAKE_PROGRAM={self.tools.ninja}", "-DCMAKE_BUILD_TYPE=Release",
                f"-DCMAKE_CUDA_COMPILER={self.tools.cuda}/bin/nvcc", "-DCMAKE_CUDA_ARCHITECTURES=120a;121a",
                "-DCMAKE_C_COMPILER=/usr/bin/gcc", "-DCMAKE_CXX_COMPILER=/usr/bin/g++"]
        if self.name == "ninja+ccache":
            args += ["-DCMAKE_CUDA_COMPILER_LAUNCHER=ccache", "-DCMAKE_CXX_COMPILER_LAUNCHER=ccache"]
        sh(args, env=self.env)

    def build(self) -> None:
        sh([self.tools.ninja, "-C", str(self.build_dir), "-j2"], env=self.env)

    def step(self, step: str) -> float:
        if step == "cold":
            shutil.rmtree(Path(self.env["CCACHE_DIR"]), ignore_errors=True)
            return timed(lambda: (self.configure(), self.build()))
        if step == "reconfigure":
            return timed(lambda: (self.configure(), self.build()))
        return timed(self.build)

    def edit_dir(self) -> Path:
        return self.src


class BgraphBuilder:
    name = "bgraph"

    def __init__(self, work: Path, tools: Tools):
        self.ws = work / "bgraph" / "ws"
        self.cache = work / "bgraph" / "cache"
        self.tools = tools
        (self.ws / "targets").mkdir(parents=True)
        shutil.copy(REPO / "WORKSPACE.toml", self.ws)
        shutil.copy(REPO / "targets" / "toolchains.toml", self.ws / "targets")
        shutil.copytree(REPO / "toolchains", self.ws / "toolchains")
        (self.ws / "targets" / "demo.toml").write_text(TARGET)
        shutil.copytree(PROJECT, self.ws / "demo")
        self.last: dict = {}

    def build(self) -> None:
        out = sh([sys.executable, "-m", "build_graph", "-C", str(self.ws), "--cache-dir", str(self.cache),
                  "build", "-j2", "--json", "//demo:lib"]).stdout
        self.last = json.loads(out)

    def step(self, step: str) -> float:
        if step == "cold":  # an empty cache but for the toolchains (downloads are not the subject)
            shutil.rmtree(self.cache, ignore_errors=True)
            shutil.copytree(self.tools.cache_template, self.cache, symlinks=True)
        return timed(self.build)

    def edit_dir(self) -> Path:
        return self.ws / "demo"

    def compiles(self) -> int:
        return sum(1 for a in self.last.get("actions", []) if a["status"] == "executed"
                   and a["mnemonic"].startswith(("Cuda", "CmakeCompile")) and a["mnemonic"] != "CudaDryrun")


def edit(builder, step: str, n: int) -> None:
    root = builder.edit_dir()
    if step == "header":
        hdr = root / "include" / "demo_offset.cuh"
        hdr.write_text(hdr.read_text().replace("return x + by;", f"return x + by + {n + 1}.0f;"))
    elif step == "reconfigure":
        cml = root / "CMakeLists.txt"
        cml.write_text(cml.read_text() + f"\n# reconfigure {n}\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json-out")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-cmake-"))
    tools = Tools(work)
    times = {b: {s: [] for s in STEPS} for b in BUILDERS}
    compiles = {s: [] for s in STEPS}
    for r in range(args.repeat):
        builders = [NinjaBuilder("ninja", work / f"r{r}", tools), NinjaBuilder("ninja+ccache", work / f"r{r}", tools),
                    BgraphBuilder(work / f"r{r}", tools)]
        builders = builders[r % 3:] + builders[:r % 3]
        for step in STEPS:
            for b in builders:
                edit(b, step, r)
                times[b.name][step].append(b.step(step))
                if isinstance(b, BgraphBuilder):
                    compiles[step].append(b.compiles())
    result = {"steps": {}, "repeat": args.repeat}
    print(f"{'step':<12} " + " ".join(f"{b:>14}" for b in BUILDERS) + "   bgraph/ninja  ccache/ninja  bgraph compiles")
    for step in STEPS:
        med = {b: statistics.median(times[b][step]) for b in BUILDERS}
        result["steps"][step] = {"median_s": med, "bgraph_compiles": compiles[step],
                                 "ratio_bgraph": med["bgraph"] / med["ninja"],
                                 "ratio_ccache": med["ninja+ccache"] / med["ninja"]}
        print(f"{step:<12} " + " ".join(f"{med[b]:>13.3f}s" for b in BUILDERS)
              + f"   {med['bgraph'] / med['ninja']:>11.3f}x  {med['ninja+ccache'] / med['ninja']:>11.3f}x  {compiles[step]}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=1))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
