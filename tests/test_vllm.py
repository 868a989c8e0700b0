"""vLLM 0.33.0 for 12.1a, the CI part: the real offline configure in the sandbox (torch 2.14.0
from pinned wheels, CUTLASS from the FlashInfer sdist), the import of its Ninja graph, and
vLLM's FP4 quantization TUs compiled for sm_121a. (The full build is a benchmark: an hour.)"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from bgraph_testlib import REPO, hermetic_env

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")

SMOKE = "//vllm:smoke-fp4-sm121"
# The smoke build's cache holds torch's 29 wheels and their extracted tree: 12.4 GB measured.
SMOKE_DISK_GB = 14


def bgraph(cache, *args, timeout=2400):
    return subprocess.run([sys.executable, "-m", "build_graph", "-C", str(REPO), "--cache-dir", str(cache), *args],
                          capture_output=True, text=True, timeout=timeout, env=hermetic_env())


def test_all_three_wheels_resolve_for_both_platforms():
    for name in ("vllm-sm121", "vllm-sm120", "vllm-sm12x"):
        run = bgraph(REPO / "unused-cache", "query", f"deps(//wheels:{name})")
        assert run.returncode == 0, run.stderr
        assert "//vllm:torch-env" in run.stdout and "//sources:vllm-patched" in run.stdout
    ws = (REPO / "WORKSPACE.toml").read_text()
    assert ws.count("[pins.py-") == 29 and "torch-2.14.0-cp311-cp311-manylinux_2_28_aarch64.whl" in ws


def test_the_aarch64_graph_plans_every_pin_for_aarch64(tmp_path):
    """`--dry-run --platform aarch64`: the fetches planned for the wheel's closure (those of
    targets that wait on no other target's output) resolve a pinned file for aarch64 (a pin
    without one is an error), and the platform-specific ones get other keys."""
    keys = {}
    for platform in ("x86_64", "aarch64"):
        run = bgraph(tmp_path / "cache", "build", "--json", "--dry-run", "--platform", platform, "//wheels:vllm-sm121")
        assert run.returncode == 0, run.stderr
        fetches = {f"{a['label']} {a['name']}": a["key"] for a in json.loads(run.stdout)["actions"]
                   if a["mnemonic"] == "Fetch"}
        assert len(fetches) >= 33
        keys[platform] = fetches
    assert keys["x86_64"].keys() == keys["aarch64"].keys()
    differ = {name for name in keys["x86_64"] if keys["x86_64"][name] != keys["aarch64"][name]}
    assert {"//vllm:torch-env fetch py-torch", "//vllm:torch-env fetch py-triton",
            "//toolchains:cmake-wheel fetch cmake"} <= differ
    assert "//sources:vllm-sdist fetch vllm-sdist" not in differ  # an sdist is the same file everywhere
    assert not (tmp_path / "cache" / "v1" / "blake3" / "cas").exists() or not any(
        (tmp_path / "cache" / "v1" / "blake3" / "cas").rglob("*")), "a dry run downloaded something"
    refused = bgraph(tmp_path / "cache", "build", "--platform", "aarch64", "//wheels:vllm-sm121")
    assert refused.returncode == 2 and "no cross-builds yet" in refused.stderr


def test_offline_configure_import_and_fp4_quantization_tus(tmp_path):
    free_gb = shutil.disk_usage(tmp_path).free / 1e9
    if free_gb < SMOKE_DISK_GB:
        pytest.skip(f"needs {SMOKE_DISK_GB} GB of free disk for torch's wheels, {free_gb:.1f} GB free")
    cache = tmp_path / "cache"
    run = bgraph(cache, "build", "--json", "-j2", SMOKE, "//toolchains:cuobjdump")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads(run.stdout)
    names = {a["name"] for a in summary["actions"] if a["status"] == "executed"}
    assert "configure" in names
    assert any(n.startswith("cicc ") and "nvfp4_quant_kernels" in n and n.endswith("121a") for n in names)
    out = REPO / "bgraph-out" / "vllm" / "smoke-fp4-sm121"
    cuobjdump = REPO / "bgraph-out" / "toolchains" / "cuobjdump" / "bin" / "cuobjdump"
    for obj in ("nvfp4_quant_kernels", "activation_nvfp4_quant_fusion_kernels", "nvfp4_experts_quant"):
        path = out / f"CMakeFiles/_C_stable_libtorch.dir/csrc/quantization/fp4/{obj}.cu.o"
        listed = subprocess.run([str(cuobjdump), "--list-elf", str(path)], capture_output=True, text=True).stdout
        assert "sm_121a" in listed and "sm_120" not in listed, listed
    # Another build of the same target: nothing runs (the configure included).
    again = json.loads(bgraph(cache, "build", "--json", SMOKE).stdout)
    assert again["executed"] == 0
