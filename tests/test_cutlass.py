"""CUTLASS SM120 block-scaled NVFP4 GEMM: compiles for sm_120a and sm_121a (compile-only here)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bgraph_testlib import workspace_copy

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")]


def test_cutlass_nvfp4_gemm_builds_for_both_spark_archs(tmp_path):
    ws = workspace_copy(tmp_path / "ws")  # building writes bgraph-out/ links: never into the checkout
    proc = subprocess.run([sys.executable, "-m", "build_graph", "-C", str(ws), "--cache-dir", str(tmp_path / "cache"),
                           "build", "--json", "//kernels:cutlass-nvfp4-gemm", "//toolchains:cuobjdump"],
                          capture_output=True, text=True)
    summary = json.loads(proc.stdout)
    assert summary["ok"], summary["errors"]
    lib = Path(summary["outputs"]["//kernels:cutlass-nvfp4-gemm"]) / "libcutlass-nvfp4-gemm.a"
    cuobjdump = Path(summary["outputs"]["//toolchains:cuobjdump"]) / "bin" / "cuobjdump"
    listing = subprocess.run([cuobjdump, "--list-elf", lib], capture_output=True, text=True, check=True).stdout
    assert "sm_120a" in listing and "sm_121a" in listing
    ciccs = [a for a in summary["actions"] if a["name"].startswith("cicc ")]
    assert sorted(a["name"].rsplit(" ", 1)[1] for a in ciccs) == ["120a", "121a"]
