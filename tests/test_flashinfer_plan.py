"""FlashInfer's full SM12x wheels (issue 37), the CI part: `bgraph build --dry-run --json` of
`//wheels:flashinfer-*-full` plans for x86_64 and for aarch64 (the Spark's, a cross build here),
and each arch's module list is the one docs/flashinfer.md gives. Nothing is built: on an empty
cache the plan stops at the fetches (the generator's output decides the rest).

With FLASHINFER_TEST_BGRAPH_CACHE naming a cache where the full set's generate actions ran (any
interrupted build of the target leaves them), the dry run also plans every module, and its
counts are checked against the generator's own manifest (test_counts_match_the_generator).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bgraph_testlib import hermetic_env, workspace_copy
from build_graph.labels import parse_label
from build_graph.workspace import host_platform

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")

FULL = {"sm121": "aot-vllm-sm121", "sm120": "aot-vllm-sm120", "sm12x": "aot-vllm-sm12x", "sm90": "aot-vllm-sm90"}
# FlashInfer gates these on major 12: the sm90 set cannot hold them.
SM12X_ONLY = ("fused_moe_120", "gemm_sm120", "fp4_gemm_cutlass_sm120", "mxfp8_gemm_cutlass_sm120")


@pytest.fixture(scope="module")
def ws(module_tmp) -> Path:
    return workspace_copy(module_tmp / "ws")


def bgraph(ws: Path, cache: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "build_graph", "-C", str(ws), "--cache-dir", str(cache), *args],
                          capture_output=True, text=True, timeout=timeout, env=hermetic_env(), cwd=ws)


def generator_args(ws: Path, target: str) -> dict[str, list[str]]:
    """The --modules globs, --extra and --skip functions of //flashinfer:<target>'s generator command."""
    from build_graph.workspace import load
    argv = shlex.split(load(ws).targets[parse_label(f"//flashinfer:{target}")].attrs.cmd)
    return {name: argv[argv.index(f"--{name}") + 1].split(",") if f"--{name}" in argv else []
            for name in ("modules", "extra", "skip")}


def test_module_lists_per_arch(ws):
    lists = {arch: generator_args(ws, target) for arch, target in FULL.items()}
    light = set(generator_args(ws, "aot-sm121")["modules"]) - {m for m in generator_args(ws, "aot-sm121")["modules"]
                                                              if m.startswith("batch_decode")}
    for arch, args in lists.items():
        assert light <= set(args["modules"]), (arch, light - set(args["modules"]))  # the light set is in each
        assert any(m.startswith("xqa_input_") for m in args["modules"]), arch
        assert any(m.startswith("batch_prefill_with_kv_cache_") for m in args["modules"]), arch
    # FP4 quantization: the runtime asks for fp4_quantization_120f on every SM12x part with CUDA >= 12.9.
    assert [m for m in lists["sm121"]["modules"] if m.startswith("fp4_q")] == ["fp4_quantization_121"]
    assert [m for m in lists["sm120"]["modules"] if m.startswith("fp4_q")] == ["fp4_quantization_120"]
    assert [m for m in lists["sm12x"]["modules"] if m.startswith("fp4_q")] == []  # 12.0f offers 120f itself
    for arch in ("sm121", "sm120", "sm12x"):
        assert lists[arch]["extra"] == ["gen_fp4_quantization_sm120f_module"], arch
        assert set(SM12X_ONLY) <= set(lists[arch]["modules"]), arch
        # FlashInfer's fmha_v2 generator runs a host program it builds: not in a cross build.
        assert lists[arch]["skip"] == ["gen_trtllm_fmha_v2_sm120_module"], arch
    assert not set(SM12X_ONLY) & set(lists["sm90"]["modules"]) and lists["sm90"]["extra"] == []
    assert not any(m.startswith("fp4_q") for m in lists["sm90"]["modules"])


@pytest.mark.parametrize("platform", ["x86_64", "aarch64"])
def test_full_wheels_plan_for_both_cpus(ws, tmp_path, platform):
    """The four full wheels plan on an empty cache; what waits on the generator is each wheel and its
    module set, for `platform` (tagged on a cross build), and the generator's own inputs are fetched
    for this machine when it is a cross build (torch and tvm_ffi of the exec platform)."""
    if platform != host_platform() and host_platform() != "x86_64":
        pytest.skip("the cross build is planned from an x86_64 host")
    wheels = [f"//wheels:flashinfer-{arch}-full" for arch in FULL]
    run = bgraph(ws, tmp_path / "cache", "build", "--dry-run", "--json", "--platform", platform, *wheels)
    assert run.returncode == 0, run.stderr[-3000:]
    plan = json.loads(run.stdout)
    assert plan["ok"] and plan["errors"] == [] and plan["executed"] == 0
    tag = "" if platform == host_platform() else f" ({platform})"
    waiting = set(plan["targets_unplanned"])
    assert {w + tag for w in wheels} <= waiting, waiting
    assert {f"//flashinfer:{t}{tag}" for t in FULL.values()} <= waiting, waiting
    fetches = {f"{a['label']} {a['name']}" for a in plan["actions"] if a["mnemonic"] == "Fetch"}
    assert {a["status"] for a in plan["actions"]} == {"would-run"}
    assert f"//vllm:torch-env{tag} fetch py-torch" in fetches and f"//sources:flashinfer-sdist{tag} fetch flashinfer-sdist" in fetches
    if tag:  # the generator runs here: this machine's torch and tvm_ffi beside the target's
        assert "//vllm:torch-env fetch py-torch" in fetches and "//flashinfer:gen-env fetch py-apache-tvm-ffi" in fetches
        assert any(f.startswith("//toolchains:cross-cc-aarch64 fetch ") for f in fetches)


def generator_manifest(cache: Path, plan: dict, label: str) -> dict[str, int] | None:
    """module -> source count of the modules the generator kept for `label`, read from its cached
    output (modules.tsv); None when the plan did not find the generate action cached."""
    from build_graph.model import Digester
    from build_graph.store.action_cache import LocalActionCache
    from build_graph.store.cas import LocalCas
    [generate] = [a for a in plan["actions"] if a["label"] == label and a["mnemonic"] == "NinjaGenerate"]
    if generate["status"] != "hit":
        return None
    cas = LocalCas(cache, Digester("blake3"))
    result = LocalActionCache(cas.base, cas.tmp, create=False).get(generate["key"])
    manifest = cas.blob_path(cas.get_tree(result.output_tree).entries["modules.tsv"].digest).read_text()
    rows = [line.split("\t") for line in manifest.splitlines()]
    return {name: int(count) for name, count, kept in rows if kept == "kept"}


def planned_tus(plan: dict, label: str) -> dict[str, int]:
    """module -> TUs the dry run plans for `label`: one first step per TU (nvcc's dry run for a .cu,
    the compile for a .cpp), named by its object under cached_ops/<module>/."""
    firsts = [a["name"].split()[1] for a in plan["actions"] if a["label"] == label
              and a["mnemonic"] in ("CudaDryrun", "NinjaCompile")]
    tus: dict[str, int] = {}
    for obj in firsts:
        module = obj.split("/")[1]
        tus[module] = tus.get(module, 0) + 1
    return tus


@pytest.mark.parametrize("platform", ["x86_64", "aarch64"])
def test_counts_match_the_generator(ws, platform):
    """With a cache where the generator of //flashinfer:aot-vllm-sm121 ran for `platform`, the dry
    run of the full wheel plans exactly the modules it kept and, per module, as many TUs as it listed
    sources (each TU's first step; the later steps wait on it). Without one: skipped."""
    cache = os.environ.get("FLASHINFER_TEST_BGRAPH_CACHE")
    if not cache:
        pytest.skip("FLASHINFER_TEST_BGRAPH_CACHE names no cache where the full set's generator ran")
    if platform != host_platform() and host_platform() != "x86_64":
        pytest.skip("the cross build is planned from an x86_64 host")
    run = bgraph(ws, Path(cache), "build", "--dry-run", "--json", "--platform", platform, "//wheels:flashinfer-sm121-full")
    assert run.returncode == 0, run.stderr[-3000:]
    plan = json.loads(run.stdout)
    label = "//flashinfer:aot-vllm-sm121" + ("" if platform == host_platform() else f" ({platform})")
    kept = generator_manifest(Path(cache), plan, label)
    if kept is None:
        pytest.skip(f"the generator of {label} has not run in {cache}")
    assert planned_tus(plan, label) == kept
    assert len(kept) == 160 and sum(kept.values()) == 670  # vLLM 0.33.0's SM12x set (docs/flashinfer.md)
