"""rules/nvcc_compile.py: one nvcc --dryrun shared by the TUs of a directory (placeholder names),
checked against nvcc 13.0's own dryrun of a real TU (both recorded with the same flags)."""

from __future__ import annotations

from pathlib import Path

from build_graph.nvcc import parse_dryrun
from build_graph.rules.nvcc_compile import OBJECT, TU_STEM, for_tu, shared_dryrun

DATA = Path(__file__).parent / "data"
FLAGS = ["-gencode", "arch=compute_120a,code=sm_120a", "-gencode", "arch=compute_121a,code=sm_121a",
         "-Xcompiler=-fPIC", "-O2", "-I/bgraph/src"]


def test_a_shared_dryrun_gives_each_tu_the_steps_of_its_own_dryrun():
    args = [*FLAGS, "-c", "/bgraph/src/src/my-kernel.v2.cu"]
    obj = "src_my-kernel.v2.cu.o"
    shared = shared_dryrun(args, obj)
    assert shared == [*FLAGS, "-c", f"/bgraph/src/src/{TU_STEM}.cu"]
    placeholder = (DATA / "nvcc13.0-dryrun-shared-placeholder.txt").read_text()
    own = (DATA / "nvcc13.0-dryrun-shared-my-kernel.v2.txt").read_text()
    assert TU_STEM in placeholder and OBJECT in placeholder
    derived = for_tu(placeholder, args, obj)
    assert TU_STEM not in derived and OBJECT not in derived
    env_a, steps_a = parse_dryrun(derived, obj, "__sym")
    env_b, steps_b = parse_dryrun(own, obj, "__sym")
    assert env_a == env_b
    assert [(s.kind, s.arch, s.argv, s.inputs, s.outputs, s.aliases, s.paths) for s in steps_a] == \
           [(s.kind, s.arch, s.argv, s.inputs, s.outputs, s.aliases, s.paths) for s in steps_b]
    assert any("my-kernel.v2.cpp4.ii" in " ".join(s.argv) for s in steps_a)


def test_names_that_cannot_be_substituted_get_their_own_dryrun():
    assert shared_dryrun([*FLAGS, "-c", "/bgraph/src/a b.cu"], "a_b.cu.o") is None  # nvcc quotes it
    assert shared_dryrun([*FLAGS, "-c", '/bgraph/src/a"b.cu'], "a_b.cu.o") is None
    assert shared_dryrun([*FLAGS, "-c", "/bgraph/src/noext"], "noext.o") is None
    assert shared_dryrun([*FLAGS, "-c", "/bgraph/src/k.cu"], "k.obj") is None
    assert shared_dryrun([*FLAGS, "-c", f"/bgraph/src/{TU_STEM}.cu"], "x.o") is None
    assert shared_dryrun([*FLAGS, "-c", "/bgraph/src/k.cu"], f"{TU_STEM}.o") is None
    assert shared_dryrun([*FLAGS, "-c", "/bgraph/src/a.cu", "-c", "/bgraph/src/b.cu"], "a.o") is None
    assert shared_dryrun([*FLAGS, "-c", "k.cu"], "k.cu.o") == [*FLAGS, "-c", f"{TU_STEM}.cu"]
