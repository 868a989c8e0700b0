"""This workspace's content: the CUDA 13.0 toolchain from pinned wheels, and the patched vLLM tree."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bgraph_testlib import workspace_copy

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")


@pytest.fixture(scope="module")
def workspace(module_tmp) -> Path:
    """This repository's workspace, copied: building it writes bgraph-out/ links there."""
    return workspace_copy(module_tmp / "ws")


@pytest.fixture(scope="module")
def cache(module_tmp, workspace) -> Path:
    return module_tmp / "cache"


def bgraph(cache: Path, *args: str) -> subprocess.CompletedProcess:
    """bgraph on the module's workspace copy (beside its cache in module_tmp)."""
    return subprocess.run([sys.executable, "-m", "build_graph", "-C", str(cache.parent / "ws"), "--cache-dir",
                           str(cache), *args], capture_output=True, text=True)


def test_toolchain_builds_once_and_nvcc_runs_in_the_sandbox(cache):
    first = json.loads(bgraph(cache, "build", "--json", "//toolchains:cuda-13.0").stdout)
    own = [a for a in first["actions"] if a["label"].startswith("//toolchains:cuda-") and a["status"] == "executed"]
    assert first["ok"] and len(own) == 11  # 5 fetches, 5 extracts, nvcc --version
    # nvcc --version ran on the pinned GCC 12 system: one fetch and one unpack per locked package.
    system = [a for a in first["actions"] if a["label"] == "//toolchains:host-cc"]
    assert system and {a["mnemonic"] for a in system} == {"Fetch", "Extract"}
    # The macro plugin, compiled on that system plus GCC's plugin headers: only the packages
    # host-cc lacks are fetched again; the others ran once for both.
    plugin = [a for a in first["actions"] if a["label"] in ("//toolchains:host-cc-plugin", "//toolchains:gcc-macro-use")
              and a["status"] == "executed"]
    assert [a["name"] for a in plugin if a["mnemonic"] == "Genrule"] == ["genrule"]
    assert {a["name"] for a in plugin if a["mnemonic"] == "Fetch"} >= {"fetch gcc-12-plugin-dev_12.2.0-14+deb12u1_amd64.deb"}
    ran = [a["name"] for a in system + plugin if a["status"] == "executed"]
    assert len(ran) == len(set(ran))  # a package both systems lock is fetched and unpacked once
    assert first["executed"] == len(own) + len(ran)
    second = json.loads(bgraph(cache, "build", "--json", "//toolchains:cuda-13.0").stdout)
    assert second["executed"] == 0 and second["hits"] == len(first["actions"])
    version = bgraph(cache, "exec", "//toolchains:cuda-13.0", "--", "bin/nvcc", "--version")
    assert version.returncode == 0, version.stderr
    assert "release 13.0, V13.0.88" in version.stdout
    out = Path(second["outputs"]["//toolchains:cuda-13.0"])
    assert "V13.0.88" in (out / "bgraph" / "version.txt").read_text()
    assert (out / "bgraph" / "gcc_macro_use.so").is_file()


def test_patched_vllm_supports_sm121_with_cuda13(cache):
    run = bgraph(cache, "build", "--json", "//sources:vllm-patched")
    summary = json.loads(run.stdout)
    assert summary["ok"], summary["errors"]
    cmake = (Path(summary["outputs"]["//sources:vllm-patched"]) / "CMakeLists.txt").read_text()
    assert cmake.count('"7.5;8.0;8.6;8.7;8.9;9.0;10.0;10.7;11.0;12.0;12.1"') == 1  # CUDA >= 13.4
    assert cmake.count('"7.5;8.0;8.6;8.7;8.9;9.0;10.0;11.0;12.0;12.1"') == 1       # CUDA >= 13.0
    explain = bgraph(cache, "explain", "//sources:vllm-patched")
    assert "apply patches" in explain.stdout


def test_a_cross_toolkit_keeps_the_exec_tools_and_takes_the_targets_libraries():
    """The prefix of a cross build (cuda_toolchain for another target platform): bin/, nvvm/ and
    the headers of the exec platform, lib/ of the target's wheels only, and the
    targets/aarch64-linux directory nvcc (with an aarch64 host compiler) and CMake look in."""
    from build_graph.model import FileEntry, SymlinkEntry, Tree
    from build_graph.rules.cuda_toolchain import cross_prefix
    f = lambda c: FileEntry(c * 64, 1)  # noqa: E731
    tools = Tree({"bin/nvcc": f("a"), "nvvm/bin/cicc": f("b"), "include/cuda.h": f("c"),
                  "lib/libcudart_static.a": f("d"), "lib/libnvvm.so": f("e")})
    target = Tree({"lib/libcudart_static.a": f("1"), "lib/libcudart.so.13": f("2")})
    prefix = cross_prefix(tools, target, "aarch64")
    assert prefix.entries == {
        "bin/nvcc": f("a"), "nvvm/bin/cicc": f("b"), "include/cuda.h": f("c"),
        "lib/libcudart_static.a": f("1"), "lib/libcudart.so.13": f("2"),
        "targets/aarch64-linux/include": SymlinkEntry("../../include"),
        "targets/aarch64-linux/lib": SymlinkEntry("../../lib")}
