"""cuda_library with the real nvcc 13.0 toolchain (from pinned wheels) under bubblewrap.

Each test edits a small two-arch workspace and asserts exactly which per-(TU, arch) steps ran.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bgraph_testlib import copy_toolchains

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")

KERNEL_A = """#include "k/common.cuh"
__global__ void scale(float* x) {
#if __CUDA_ARCH__ == 1210
  x[0] *= 2.0f;  // sm_121a tuning
#else
  x[0] *= 1.0f;
#endif
}
#ifndef __CUDA_ARCH__
int host_answer() { return 42; }
#endif
#if 0
int unused = 1;
#endif
"""
KERNEL_B = """#include "k/common.cuh"
#include "k/only_b.cuh"
__global__ void add(int* y) { y[0] += ONLY_B; }
"""


def write_workspace(root: Path, archs: str = '["12.0a", "12.1a"]', copts: str = "[]") -> Path:
    (root / "targets").mkdir(parents=True, exist_ok=True)
    (root / "k").mkdir(exist_ok=True)
    copy_toolchains(root)
    (root / "k" / "a.cu").write_text(KERNEL_A)
    (root / "k" / "b.cu").write_text(KERNEL_B)
    (root / "k" / "common.cuh").write_text("#pragma once\n#define COMMON 1\n")
    (root / "k" / "only_b.cuh").write_text("#pragma once\n#define ONLY_B 3\n")
    (root / "targets" / "k.toml").write_text(
        f'[lib]\nkind = "cuda_library"\nsrcs = ["k/a.cu", "k/b.cu"]\nhdrs = ["k/*.cuh"]\n'
        f"archs = {archs}\ncopts = {copts}\n")
    return root


def build(ws: Path, cache: Path, *extra: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "build_graph", "-C", str(ws), "--cache-dir", str(cache),
                           "build", "--json", *extra, "//k:lib"], capture_output=True, text=True)
    assert proc.returncode in (0, 3), proc.stderr + proc.stdout
    return json.loads(proc.stdout)


def ran(summary: dict, *mnemonic_words: str) -> list[str]:
    """Names of executed actions whose name starts with one of the step kinds."""
    return sorted(a["name"] for a in summary["actions"]
                  if a["status"] == "executed" and a["name"].split(" ")[0] in mnemonic_words)


COMPILES = ("cicc", "ptxas", "cudafe", "fatbin", "hostcc")


@pytest.fixture(scope="module")
def cache(module_tmp) -> Path:
    return module_tmp / "cache"


@pytest.fixture
def ws(tmp_path, cache) -> Path:
    root = write_workspace(tmp_path / "ws")
    first = build(root, cache)
    assert first["ok"]
    return root


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new))


def archive_bytes(ws: Path) -> bytes:
    return (ws / "bgraph-out" / "k" / "lib" / "liblib.a").read_bytes()


def test_second_build_executes_nothing(ws, cache):
    again = build(ws, cache)
    assert again["executed"] == 0 and again["hits"] > 0


def test_edit_inside_sm121_block_recompiles_only_sm121a(ws, cache, tmp_path):
    edit(ws / "k" / "a.cu", "x[0] *= 2.0f;", "x[0] *= 3.0f;")
    s = build(ws, cache)
    assert ran(s, "cicc", "ptxas") == ["cicc k/a.cu 121a", "ptxas k/a.cu 121a"]
    assert ran(s, "hostcc") == []  # the host object does not embed the fatbinary
    # cudafe++ sees the edited .cu (its module id comes from the file's metadata): it re-runs,
    # to the same output, so the host compile is cut off.
    assert ran(s, "cudafe") == ["cudafe k/a.cu"]
    # The new object holds the new sm_121a cubin: identical to a clean build from scratch.
    fresh = tmp_path / "fresh"
    shutil.copytree(ws, fresh, ignore=shutil.ignore_patterns("bgraph-out"))
    clean = build(fresh, tmp_path / "fresh-cache")
    assert clean["ok"]
    assert archive_bytes(ws) == archive_bytes(fresh)


def test_header_edit_in_another_archs_group_skips_the_other_preprocessing(ws, cache, tmp_path):
    # common.cuh gains an sm_121a-only block; only_b.cuh (read by b.cu alone) names
    # __CUDA_ARCH__ in a #define, which makes the macro's value unknown to b.cu's steps.
    edit(ws / "k" / "common.cuh", "#define COMMON 1\n",
         "#define COMMON 1\n#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 1210\n#define TUNE 2\n#endif\n")
    edit(ws / "k" / "only_b.cuh", "#define ONLY_B 3\n", "#define ONLY_B 3\n#if 0\n#define __CUDA_ARCH__ 0\n#endif\n")
    assert build(ws, cache)["ok"]
    edit(ws / "k" / "common.cuh", "#define TUNE 2", "#define TUNE 3")
    s = build(ws, cache)
    assert ran(s, "hostpp", "devpp") == ["devpp k/a.cu 121a", "devpp k/b.cu 120a", "devpp k/b.cu 121a",
                                         "hostpp k/b.cu"]
    why = {a["name"]: a["reason"] for a in s["actions"]}
    assert "skipped with __CUDA_ARCH__=1200" in why["devpp k/a.cu 120a"]
    assert "skipped with __CUDA_ARCH__ undefined" in why["hostpp k/a.cu"]
    assert ran(s, "cicc", "ptxas") == []  # TUNE is used nowhere: every preprocessed text is unchanged
    fresh = tmp_path / "fresh"
    shutil.copytree(ws, fresh, ignore=shutil.ignore_patterns("bgraph-out"))
    assert build(fresh, tmp_path / "fresh-cache")["ok"]
    assert archive_bytes(ws) == archive_bytes(fresh)


def test_host_only_edit_is_never_missed(ws, cache):
    before = archive_bytes(ws)
    edit(ws / "k" / "a.cu", "return 42;", "return 43;")
    s = build(ws, cache)
    # No device step: fatbinary's step re-runs only to join the new host object to the same cubins.
    assert ran(s, *COMPILES) == ["cudafe k/a.cu", "fatbin k/a.cu", "hostcc k/a.cu"]
    assert ran(s, "cicc", "ptxas", "devpp") == []
    assert archive_bytes(ws) != before


def test_edit_with_no_preprocessed_change_compiles_nothing(ws, cache):
    edit(ws / "k" / "a.cu", "// sm_121a tuning", "// tuned for GB10")  # a comment
    edit(ws / "k" / "a.cu", "int unused = 1;", "int unused = 2;")     # code under #if 0
    s = build(ws, cache)
    # Only cudafe++ re-runs: it reads the .cu itself (for its module id), to the same output.
    assert ran(s, *(c for c in COMPILES if c != "cudafe")) == []
    cut = [a["name"] for a in s["actions"] if a["status"] == "cutoff"]
    assert "cicc k/a.cu 121a" in cut and "hostcc k/a.cu" in cut


def test_header_edit_touches_only_including_tus(ws, cache):
    edit(ws / "k" / "only_b.cuh", "#define ONLY_B 3", "#define ONLY_B 4")
    s = build(ws, cache)
    compiled = ran(s, *COMPILES)
    assert compiled and all(" k/b.cu" in n for n in compiled), compiled
    assert "cicc k/b.cu 120a" in compiled and "cicc k/b.cu 121a" in compiled


def test_adding_an_arch_compiles_only_the_new_arch(tmp_path):
    cache = tmp_path / "cache"  # fresh: the shared one already holds every sm_121a step
    root = write_workspace(tmp_path / "ws", archs='["12.0a"]')
    assert build(root, cache)["ok"]
    (root / "targets" / "k.toml").write_text((root / "targets" / "k.toml").read_text()
                                             .replace('archs = ["12.0a"]', 'archs = ["12.0a", "12.1a"]'))
    s = build(root, cache)
    assert ran(s, "cicc", "ptxas") == ["cicc k/a.cu 121a", "cicc k/b.cu 121a",
                                       "ptxas k/a.cu 121a", "ptxas k/b.cu 121a"]
    # -D__CUDA_ARCH_LIST__ changed on every step, but GCC (its macro plugin) says the host and
    # sm_120a preprocessing never read it: taken from the cache, not re-run.
    assert ran(s, "hostpp", "devpp") == ["devpp k/a.cu 121a", "devpp k/b.cu 121a"]
    why = {a["name"]: a["reason"] for a in s["actions"]}
    assert why["devpp k/a.cu 120a"] == "-D/-U of __CUDA_ARCH_LIST__ changed; the recorded run never used it"
    assert ran(s, "cudafe") == []
    # The host compile gets the highest arch's __CUDA_ARCH__, which it reads: 12.1a is new there.
    assert ran(s, "hostcc") == ["hostcc k/a.cu", "hostcc k/b.cu"]
    assert "that run used __CUDA_ARCH__" in why["hostcc k/a.cu"]


def test_adding_a_lower_arch_reruns_no_step_of_the_others(tmp_path):
    """10.0a below 12.0a and 12.1a: every existing step is a hit (only __CUDA_ARCH_LIST__
    changes for it), the archive is a clean build's, and a TU that reads the list re-runs."""
    cache = tmp_path / "cache"
    root = write_workspace(tmp_path / "ws")
    (root / "k" / "c.cu").write_text('#include "k/common.cuh"\n__global__ void c(int* y) {\n'
                                     "#ifdef __CUDA_ARCH_LIST__\n  y[0] = 1;\n#endif\n}\n")
    toml = root / "targets" / "k.toml"
    toml.write_text(toml.read_text().replace('"k/b.cu"]', '"k/b.cu", "k/c.cu"]'))
    assert build(root, cache)["ok"]
    toml.write_text(toml.read_text().replace('archs = ["12.0a", "12.1a"]', 'archs = ["12.0a", "12.1a", "10.0a"]'))
    s = build(root, cache)
    assert s["ok"]
    assert ran(s, "hostpp", "devpp") == ["devpp k/a.cu 100a", "devpp k/b.cu 100a", "devpp k/c.cu 100a",
                                         "devpp k/c.cu 120a", "devpp k/c.cu 121a", "hostpp k/c.cu"]
    # c.cu's host text comes out the same (the list is defined either way), and the host
    # compile itself does not read the list: no host compile runs.
    assert ran(s, "hostcc", "cudafe") == []
    assert ran(s, "cicc") == ["cicc k/a.cu 100a", "cicc k/b.cu 100a", "cicc k/c.cu 100a"]
    why = {a["name"]: a["reason"] for a in s["actions"]}
    assert "that run used __CUDA_ARCH_LIST__" in why["devpp k/c.cu 120a"]
    fresh = tmp_path / "fresh"
    shutil.copytree(root, fresh, ignore=shutil.ignore_patterns("bgraph-out"))
    assert build(fresh, tmp_path / "fresh-cache")["ok"]
    assert archive_bytes(root) == archive_bytes(fresh)
    # One arch set in another order is the same build.
    toml.write_text(toml.read_text().replace('["12.0a", "12.1a", "10.0a"]', '["12.1a", "10.0a", "12.0a"]'))
    assert build(root, cache)["executed"] == 0


def test_reproducible_across_directories_and_caches_with_debug_info(tmp_path):
    copts = '["-g", "-lineinfo", "-O2"]'
    one = write_workspace(tmp_path / "one" / "ws", copts=copts)
    two = write_workspace(tmp_path / "two" / "somewhere" / "else", copts=copts)
    a = build(one, tmp_path / "cache1")
    b = build(two, tmp_path / "cache2")
    assert a["ok"] and b["ok"]
    assert archive_bytes(one) == archive_bytes(two)
    check = build(one, tmp_path / "cache1", "--check")
    assert check["differing"] == [] and check["executed"] > 0
    for ws, cache in ((one, tmp_path / "cache1"), (two, tmp_path / "cache2")):  # and both caches are sound
        proc = subprocess.run([sys.executable, "-m", "build_graph", "-C", str(ws), "--cache-dir", str(cache),
                               "cache", "verify"], capture_output=True, text=True)
        assert proc.returncode == 0 and "the cache is clean" in proc.stdout, proc.stdout + proc.stderr


def test_includes_are_workspace_relative_and_a_missing_one_is_named(tmp_path):
    root = write_workspace(tmp_path / "ws", archs='["12.1a"]')
    (root / "k" / "inc").mkdir()
    (root / "k" / "inc" / "deep.cuh").write_text("#pragma once\n#define DEEP 7\n")
    (root / "k" / "a.cu").write_text('#include "deep.cuh"\n__global__ void f(int* y) { y[0] = DEEP; }\n')
    (root / "targets" / "k.toml").write_text(
        '[lib]\nkind = "cuda_library"\nsrcs = ["k/a.cu"]\nhdrs = ["k/inc/*.cuh"]\n'
        'archs = ["12.1a"]\nincludes = ["k/inc"]\n')
    assert build(root, tmp_path / "cache")["ok"]
    (root / "targets" / "k.toml").write_text(
        '[lib]\nkind = "cuda_library"\nsrcs = ["k/a.cu"]\nhdrs = ["k/inc/*.cuh"]\n'
        'archs = ["12.1a"]\nincludes = ["kernels/x/inc"]\n')
    proc = subprocess.run([sys.executable, "-m", "build_graph", "-C", str(root), "--cache-dir",
                           str(tmp_path / "cache"), "build", "//k:lib"], capture_output=True, text=True)
    assert proc.returncode != 0
    assert "includes entry 'kernels/x/inc'" in proc.stderr and "k.toml" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_two_sources_never_share_an_object(tmp_path, cache):
    """k/a.cu and k_a.cu flatten to the same object name: the archive must not silently keep one."""
    root = write_workspace(tmp_path / "ws", archs='["12.1a"]')
    (root / "k_a.cu").write_text("__global__ void other(int* y) { y[0] = 5; }\n")
    (root / "targets" / "k.toml").write_text(
        '[lib]\nkind = "cuda_library"\nsrcs = ["k/a.cu", "k_a.cu"]\nhdrs = ["k/*.cuh"]\narchs = ["12.1a"]\n')
    proc = subprocess.run([sys.executable, "-m", "build_graph", "-C", str(root), "--cache-dir", str(cache),
                           "build", "//k:lib"], capture_output=True, text=True)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "'k/a.cu'" in proc.stderr and "'k_a.cu'" in proc.stderr and "k_a.cu.o" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
