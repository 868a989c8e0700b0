"""FlashInfer 0.7.2.post1 with AOT modules (targets/flashinfer.toml), built for real and checked as
a user would meet it: the wheel installed into a fresh venv, `import flashinfer` with
FLASHINFER_DISABLE_JIT=1 and an empty read-only JIT workspace, every module under
flashinfer/data/aot found by FlashInfer's own lookup and loaded (tvm_ffi; the driver stub on the
library path, no GPU here), FlashInfer's own loader returning the AOT norm module without compiling,
and cuobjdump showing cubins for the wanted arch only.

Slow: the builds need torch's environment (~12 GB of cache cold). FLASHINFER_TEST_BGRAPH_CACHE
names a cache to build in (e.g. a warm ~/.cache/bgraph); default: a fresh one.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from bgraph_testlib import hermetic_env, workspace_copy

pytestmark = [pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed"),
              pytest.mark.slow]

# Runs in the fresh venv: which AOT modules FlashInfer finds and loads, with JIT disabled.
CHECK = r'''
import json, os, pathlib, sys
import flashinfer, tvm_ffi
from flashinfer.jit import env
from flashinfer.jit.core import MissingJITCacheError
aot = pathlib.Path(flashinfer.__file__).parent / "data" / "aot"
found, loaded = {}, []
for d in sorted(aot.iterdir()):
    arts = env.get_aot_artifacts(d.name)
    found[d.name] = str(arts[0].path) if arts else None
    tvm_ffi.load_module(str(d / f"{d.name}.so"))
    loaded.append(d.name)
from flashinfer.jit.norm import gen_norm_module
norm = gen_norm_module()
norm.build_and_load()  # FlashInfer's own path: the AOT file, or MissingJITCacheError with JIT disabled
from flashinfer.jit.mhc import gen_mhc_module  # a module these wheels do not hold
try:
    gen_mhc_module().build_and_load()
    missing = "compiled"
except MissingJITCacheError:
    missing = "MissingJITCacheError"
except Exception as e:
    missing = type(e).__name__
print(json.dumps({"found": found, "loaded": loaded, "norm": str(norm.aot_path), "missing": missing,
                  "version": flashinfer.__version__, "tvm_ffi": tvm_ffi.__version__}))
'''


def bgraph(ws: Path, cache: Path, *args: str, timeout: float = 7200) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "build_graph", "-C", str(ws), "--cache-dir", str(cache), *args],
                          capture_output=True, text=True, timeout=timeout, env=hermetic_env(), cwd=ws)


def check_wheel(wheel: Path, torch_env: Path, runtime_env: Path, stub: Path, cuobjdump: Path, arch: str,
                scratch: Path, requirements: tuple[str, ...] = (), check: str = CHECK) -> dict:
    """Install `wheel` into a fresh venv (torch and the runtime wheels through a .pth file, after
    `requirements`, installed first from pip's configured index, which take precedence) and run
    `check` (default CHECK) there; also list each module's cubins. Returns its report plus 'archs'."""
    env_dir = scratch / "venv"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    if requirements:
        pip = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", *requirements],
                             capture_output=True, text=True)
        assert pip.returncode == 0, pip.stderr
    pip = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                         capture_output=True, text=True)
    assert pip.returncode == 0, pip.stderr
    site = Path(subprocess.check_output([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                        text=True).strip())
    (site / "bgraph_deps.pth").write_text(f"{runtime_env}\n{torch_env}\n")
    jit = scratch / "jit-cache"
    jit.mkdir()
    jit.chmod(0o555)
    libs = [str(p) for p in (torch_env / "nvidia" / "cu13" / "lib", stub) if p.is_dir()]
    run_env = {**hermetic_env(), "FLASHINFER_DISABLE_JIT": "1", "FLASHINFER_WORKSPACE_BASE": str(jit),
               "FLASHINFER_CUDA_ARCH_LIST": arch, "LD_LIBRARY_PATH": ":".join(libs), "HOME": str(scratch)}
    run = subprocess.run([str(py), "-c", check], capture_output=True, text=True, env=run_env, cwd=scratch)
    assert run.returncode == 0, run.stderr[-4000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    # Nothing compiled or cached: FlashInfer makes its workspace directories, its log and the lock
    # of the module it then reports missing (as root a read-only mode stops none of them), but no
    # source, ninja file, object or library.
    written = [str(p.relative_to(jit)) for p in jit.rglob("*") if not p.is_dir()]
    assert [w for w in written if not w.endswith((".log", ".lock"))] == [], written
    aot = site / "flashinfer" / "data" / "aot"
    report["archs"] = {}
    for so in sorted(aot.glob("*/*.so")):
        listed = subprocess.run([str(cuobjdump), "--list-elf", str(so)], capture_output=True, text=True).stdout
        report["archs"][so.parent.name] = sorted({w for line in listed.splitlines() for w in line.split(".")
                                                  if w.startswith("sm_")})
    return report


@pytest.fixture(scope="module")
def built(module_tmp):
    """The wheel of //wheels:flashinfer-sm121 and the trees its check needs."""
    cache = Path(os.environ.get("FLASHINFER_TEST_BGRAPH_CACHE") or module_tmp / "cache")
    ws = workspace_copy(module_tmp / "ws")
    labels = ["//wheels:flashinfer-sm121", "//flashinfer:aot-sm121", "//flashinfer:runtime-env", "//vllm:torch-env",
              "//vllm:cuda-driver-stub", "//toolchains:cuobjdump"]
    run = bgraph(ws, cache, "build", "--json", "-j", "2", *labels)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = ws / "bgraph-out"
    [wheel] = (out / "wheels" / "flashinfer-sm121").glob("*.whl")
    return {"wheel": wheel, "torch_env": out / "vllm" / "torch-env", "runtime_env": out / "flashinfer" / "runtime-env",
            "stub": out / "vllm" / "cuda-driver-stub", "cuobjdump": out / "toolchains" / "cuobjdump" / "bin" / "cuobjdump",
            "modules": sorted(p.name for p in (out / "flashinfer" / "aot-sm121").iterdir())}


def test_wheel_installs_and_every_aot_module_loads_without_jit(built, tmp_path):
    report = check_wheel(built["wheel"], built["torch_env"], built["runtime_env"], built["stub"],
                         built["cuobjdump"], "12.1a", tmp_path)
    assert report["version"] == "0.7.2.post1"
    assert sorted(report["loaded"]) == built["modules"] and "norm" in built["modules"]
    # FlashInfer's own lookup finds each module in the installed package, not in a JIT cache.
    for name, path in report["found"].items():
        assert path and path.endswith(f"flashinfer/data/aot/{name}/{name}.so"), (name, path)
    assert report["norm"].endswith("flashinfer/data/aot/norm/norm.so")
    assert report["missing"] == "MissingJITCacheError"  # JIT is off: a module not built is an error
    # Cubins for 12.1a and no other arch, in every module.
    assert report["archs"] and all(archs == ["sm_121a"] for archs in report["archs"].values()), report["archs"]


@pytest.fixture(scope="module")
def vllm_wheel(built, module_tmp):
    """vLLM 0.33.0's x86_64 wheel for 12.1a (`--platform x86_64 //wheels:vllm-sm121`: the target's
    own platform is the Spark's aarch64, whose wheel pip cannot install here). A whole vLLM build
    when the cache lacks it (about an hour on 2 cores): skipped then unless
    FLASHINFER_TEST_BUILD_VLLM=1."""
    cache = Path(os.environ.get("FLASHINFER_TEST_BGRAPH_CACHE") or module_tmp / "cache")
    ws = module_tmp / "ws"
    args = ("build", "--json", "-j", "2", "--platform", "x86_64", "//wheels:vllm-sm121")
    if os.environ.get("FLASHINFER_TEST_BUILD_VLLM") != "1":
        dry = bgraph(ws, cache, *args[:2], "--dry-run", *args[2:])
        would = json.loads(dry.stdout)["would_run"] if dry.returncode == 0 else None
        if would != 0:
            pytest.skip(f"the x86_64 vLLM wheel is not in {cache} ({would} actions would run): "
                        "FLASHINFER_TEST_BUILD_VLLM=1 builds it")
    run = bgraph(ws, cache, *args)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    [wheel] = (ws / "bgraph-out" / "wheels" / "vllm-sm121").glob("*.whl")
    assert wheel.name.endswith("_x86_64.whl")
    return wheel


def test_wheel_resolves_beside_the_vllm_wheel_and_loads_with_what_pip_picks(built, vllm_wheel, tmp_path):
    # pip resolves both wheels and every requirement of either together, from its configured index
    # (the machine's, not bgraph's pins): vLLM asks flashinfer-python==0.7.2.post1, ours is that.
    env_dir = tmp_path / "resolve"
    venv.create(env_dir, with_pip=True)
    resolve = subprocess.run([str(env_dir / "bin" / "python"), "-m", "pip", "install", "--dry-run",
                              "--ignore-installed", "--report", str(tmp_path / "report.json"),
                              str(vllm_wheel), str(built["wheel"])], capture_output=True, text=True)
    assert resolve.returncode == 0, resolve.stdout[-3000:] + resolve.stderr[-3000:]
    picked = {i["metadata"]["name"].lower().replace("_", "-"): i
              for i in json.loads((tmp_path / "report.json").read_text())["install"]}
    for name, wheel in (("vllm", vllm_wheel), ("flashinfer-python", built["wheel"])):
        assert picked[name]["download_info"]["url"] == wheel.as_uri(), (name, picked[name]["download_info"])
    # vLLM pins apache-tvm-ffi (0.1.11) lower than the generator's environment (0.1.15.post2, whose
    # headers the modules were compiled against): the modules must load with the version pip picks.
    tvm_ffi = picked["apache-tvm-ffi"]["metadata"]["version"]
    report = check_wheel(built["wheel"], built["torch_env"], built["runtime_env"], built["stub"],
                         built["cuobjdump"], "12.1a", tmp_path / "check", (f"apache-tvm-ffi=={tvm_ffi}",))
    assert report["tvm_ffi"] == tvm_ffi
    assert sorted(report["loaded"]) == built["modules"]
    assert report["missing"] == "MissingJITCacheError"


# Runs in the fresh venv of the FP4 wheel: the module found by FlashInfer's lookup and returned by
# FlashInfer's own FP4 entry point for an SM121 GPU (backend "121", which CUDA >= 12.9 maps to 120f).
FP4_CHECK = r'''
import json, pathlib
import flashinfer, tvm_ffi
from flashinfer.jit import env
aot = pathlib.Path(flashinfer.__file__).parent / "data" / "aot"
found = {d.name: (str(env.get_aot_artifacts(d.name)[0].path) if env.get_aot_artifacts(d.name) else None)
         for d in sorted(aot.iterdir())}
loaded = [d.name for d in sorted(aot.iterdir()) if tvm_ffi.load_module(str(d / f"{d.name}.so"))]
from flashinfer.jit.fp4_quantization import gen_fp4_quantization_sm120f_module
from flashinfer.quantization.fp4_quantization import get_fp4_quantization_module
get_fp4_quantization_module("121")  # FlashInfer's path on SM121: the AOT file, or MissingJITCacheError
print(json.dumps({"found": found, "loaded": loaded, "fp4": str(gen_fp4_quantization_sm120f_module().aot_path)}))
'''


def test_full_set_fp4_module_loads_without_jit(module_tmp, tmp_path):
    """Issue 37's first slice: fp4_quantization_120f, a module of the full SM12x set that the light
    wheel lacks, built alone (//flashinfer:aot-fp4q-sm121) and packed (//wheels:flashinfer-fp4q-sm121):
    found by FlashInfer's lookup with JIT off, loaded by its own FP4 entry point for SM121, sm_120f
    cubins only (family cubins, which run on SM121)."""
    cache = Path(os.environ.get("FLASHINFER_TEST_BGRAPH_CACHE") or module_tmp / "cache")
    ws = workspace_copy(module_tmp / "ws-fp4")
    labels = ["//wheels:flashinfer-fp4q-sm121", "//flashinfer:runtime-env", "//vllm:torch-env",
              "//vllm:cuda-driver-stub", "//toolchains:cuobjdump"]
    run = bgraph(ws, cache, "build", "--json", "-j", "2", *labels)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = ws / "bgraph-out"
    [wheel] = (out / "wheels" / "flashinfer-fp4q-sm121").glob("*.whl")
    report = check_wheel(wheel, out / "vllm" / "torch-env", out / "flashinfer" / "runtime-env",
                         out / "vllm" / "cuda-driver-stub", out / "toolchains" / "cuobjdump" / "bin" / "cuobjdump",
                         "12.1a", tmp_path, check=FP4_CHECK)
    name = "fp4_quantization_120f"
    assert report["loaded"] == [name] and report["found"][name].endswith(f"flashinfer/data/aot/{name}/{name}.so")
    assert report["fp4"] == report["found"][name]
    # cuobjdump names a family cubin's file sm_120 (list-elf); its ELF header says the arch: sm_120f.
    assert report["archs"] == {name: ["sm_120"]}, report["archs"]
    [so] = (tmp_path / "venv").glob(f"lib/python*/site-packages/flashinfer/data/aot/{name}/{name}.so")
    dumped = subprocess.run([str(out / "toolchains" / "cuobjdump" / "bin" / "cuobjdump"), "--dump-elf", str(so)],
                            capture_output=True, text=True).stdout
    assert {line.split("=")[1].strip() for line in dumped.splitlines() if line.startswith("arch =")} == {"sm_120f"}
