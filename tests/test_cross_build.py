"""The Spark's FP4 kernels wheel cross-built on x86_64 (`//wheels:fp4-kernels-sm121` is fixed to
aarch64) and checked under emulation: the pinned cross compiler (//toolchains:cross-cc-aarch64)
standing in for //toolchains:host-cc, nvcc from the x86_64 wheels with the aarch64 CUDA runtime
(//toolchains:cuda-13.0 configured for aarch64), qemu-aarch64-static and an aarch64 CPython 3.11
with NumPy and pip from pinned Debian 12 packages (//toolchains:qemu-user, :target-python): pip
installs the wheel, the package imports, its library loads and runs its C ABI into the aarch64
CUDA runtime (no GPU here: it reports the missing driver). Every ELF file is AArch64, the cubins
are sm_120a and sm_121a, the wheel is tagged by auditwheel's policy, two workspaces give the same
bytes, and the x86_64 build of the same label shares only platform-free work with it.

Builds run in workspace copies with their own caches (nothing is written into the checkout)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from bgraph_testlib import hermetic_env, workspace_copy
from build_graph.workspace import host_platform

pytestmark = [
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed"),
    pytest.mark.skipif(host_platform() != "x86_64", reason="cross-building for aarch64 is checked on x86_64 hosts"),
]

WHEEL = "//wheels:fp4-kernels-sm121"
EM_AARCH64 = 183  # ELF e_machine


def bgraph(ws: Path, cache: Path, *args: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "build_graph", "-C", str(ws), "--cache-dir", str(cache),
                           "build", "--json", *args], capture_output=True, text=True, env=hermetic_env(), cwd=ws)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def built(module_tmp):
    ws, cache = workspace_copy(module_tmp / "ws"), module_tmp / "cache"
    summary = bgraph(ws, cache, WHEEL, "//toolchains:qemu-user", "//toolchains:cuobjdump")
    python = bgraph(ws, cache, "--platform", "aarch64", "//toolchains:target-python")
    out = {**summary["outputs"], **python["outputs"]}
    [wheel] = Path(out[f"{WHEEL} (aarch64)"]).glob("*.whl")
    return {"ws": ws, "cache": cache, "summary": summary, "wheel": wheel,
            "qemu": Path(out["//toolchains:qemu-user"]) / "usr/bin/qemu-aarch64-static",
            "root": Path(out["//toolchains:target-python (aarch64)"]),
            "cuobjdump": Path(out["//toolchains:cuobjdump"]) / "bin/cuobjdump"}


def emulated(built, *args: str, **kw) -> subprocess.CompletedProcess:
    """The aarch64 python3.11 of //toolchains:target-python under qemu-aarch64-static."""
    root = built["root"]
    env = {"PATH": "/usr/bin:/bin", "HOME": str(kw.pop("home")), "PIP_CONFIG_FILE": os.devnull,
           "PYTHONNOUSERSITE": "1", "LC_ALL": "C"}
    return subprocess.run([str(built["qemu"]), "-L", str(root), str(root / "usr/bin/python3.11"), *args],
                          capture_output=True, text=True, env=env, timeout=600, **kw)


def test_outputs_of_the_two_platforms_live_apart(built):
    outputs = built["summary"]["outputs"]
    assert outputs[f"{WHEEL} (aarch64)"] == str(built["ws"] / "bgraph-out/aarch64/wheels/fp4-kernels-sm121")
    assert outputs["//toolchains:qemu-user"] == str(built["ws"] / "bgraph-out/toolchains/qemu-user")
    assert f"{WHEEL} (aarch64)" in built["summary"]["targets"]


def test_every_elf_file_is_aarch64_and_the_cubins_are_the_sparks(built, tmp_path):
    wheel = built["wheel"]
    assert re.fullmatch(r"bgraph_fp4-0\.1\.0-py3-none-manylinux_2_\d+_aarch64\.whl", wheel.name), wheel.name
    with zipfile.ZipFile(wheel) as zf:
        elves = {n: zf.read(n) for n in zf.namelist() if zf.read(n)[:4] == b"\x7fELF"}
        tag = zf.read("bgraph_fp4-0.1.0.dist-info/WHEEL").decode()
    assert list(elves) == ["bgraph_fp4/libbgraph_fp4.so"]
    assert all(int.from_bytes(data[18:20], "little") == EM_AARCH64 for data in elves.values())
    assert f"Tag: {wheel.name.removesuffix('.whl').split('-', 2)[2]}" in tag
    lib = tmp_path / "libbgraph_fp4.so"
    lib.write_bytes(elves["bgraph_fp4/libbgraph_fp4.so"])
    listing = subprocess.run([str(built["cuobjdump"]), "--list-elf", str(lib)], capture_output=True, text=True)
    assert "sm_120a.cubin" in listing.stdout and "sm_121a.cubin" in listing.stdout, listing.stdout + listing.stderr


def test_pip_installs_it_under_qemu_and_its_library_runs(built, tmp_path):
    site = tmp_path / "site"
    pip = emulated(built, "-m", "pip", "install", "--no-deps", "--no-index", "--root-user-action=ignore",
                   "--disable-pip-version-check", "--target", str(site), str(built["wheel"]), home=tmp_path)
    assert pip.returncode == 0, pip.stdout + pip.stderr
    assert "Successfully installed bgraph-fp4-0.1.0" in pip.stdout
    assert "WARNING" not in pip.stdout + pip.stderr and "RECORD" not in pip.stdout + pip.stderr, pip.stderr
    code = f"""
import ctypes, platform, sys
sys.path.insert(0, {str(site)!r})
import numpy as np, bgraph_fp4, bgraph_fp4.reference as ref
print(platform.machine())
lib = ctypes.CDLL(str(bgraph_fp4.library_path()))
print(bool(lib.bgraph_fp4_last_error))
try:
    bgraph_fp4.has_hw_cvt()
except bgraph_fp4.Fp4Error as e:
    print("Fp4Error:", e)
print(ref.e2m1_decode(ref.e2m1_encode(np.array([0.3, 1.2, 7.0], dtype=np.float32))).tolist())
"""
    run = emulated(built, "-c", code, home=tmp_path)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0] == "aarch64" and lines[1] == "True"
    # the aarch64 CUDA runtime ran and says what is missing on this machine: a driver
    assert lines[2].startswith("Fp4Error:") and "driver" in lines[2], lines[2]
    assert lines[3] == "[0.5, 1.0, 6.0]"


@pytest.mark.slow  # a second cold build (test_wheel.py checks the same for the x86_64 wheel by default)
def test_an_independent_build_gives_the_same_aarch64_wheel(built, module_tmp):
    ws_b, cache_b = workspace_copy(module_tmp / "elsewhere" / "ws-b"), module_tmp / "cache-b"
    summary = bgraph(ws_b, cache_b, WHEEL)
    [wheel_b] = Path(summary["outputs"][f"{WHEEL} (aarch64)"]).glob("*.whl")
    assert any(a["mnemonic"] == "CudaCicc" and a["status"] == "executed" for a in summary["actions"])
    assert wheel_b.name == built["wheel"].name
    assert hashlib.sha256(wheel_b.read_bytes()).hexdigest() == hashlib.sha256(built["wheel"].read_bytes()).hexdigest()


def test_the_x86_64_build_shares_only_platform_free_work(built):
    """`--platform x86_64` builds the same label for this machine into the same cache: the two
    share fetches and unpacks of platform-free files (and exec-machine systems), never a
    compile; nvcc's steps differ for aarch64 (--unsigned_chars, --arm_cross_compiler)."""
    native = bgraph(built["ws"], built["cache"], "--platform", "x86_64", WHEEL)
    [wheel] = Path(native["outputs"][WHEEL]).glob("*.whl")
    assert re.fullmatch(r"bgraph_fp4-0\.1\.0-py3-none-manylinux_2_\d+_x86_64\.whl", wheel.name), wheel.name
    cross_keys = {a["key"]: a for a in built["summary"]["actions"]}
    shared = [a for a in native["actions"] if a["key"] in cross_keys]
    assert shared and {a["mnemonic"] for a in shared} <= {"Fetch", "Extract"}, \
        {(a["label"], a["name"]) for a in shared if a["mnemonic"] not in ("Fetch", "Extract")}
    compiles = [a for a in native["actions"] if a["mnemonic"].startswith("Cuda")]
    assert compiles and all(a["status"] == "executed" for a in compiles)
    from build_graph.store.trace import Trace
    trace = Trace(built["cache"] / "v1" / "blake3", built["cache"] / "v1" / "tmp").load("//kernels:fp4 (aarch64)")
    cicc = next(d["description"]["argv"] for n, d in trace["actions"].items() if n.startswith("cicc "))
    assert "--unsigned_chars" in cicc and "--arm_cross_compiler" in cicc


def test_the_aarch64_driver_link_stubs(built):
    """The CUDA driver link stubs a cross build makes are AArch64 with soname libcuda.so.1: the
    toolkit's own (cuda_toolchain driver_stub) and //vllm:cuda-driver-stub's genrule (every cu*
    function of cuda.h), here over //toolchains:cuda-13.0's wheels instead of the torch-sized
    //vllm:cuda-toolkit."""
    import tomllib
    ws = built["ws"]
    stub = tomllib.loads((ws / "targets/vllm.toml").read_text())["cuda-driver-stub"]
    (ws / "targets/xstub.toml").write_text(f'''[tk]
kind = "cuda_toolchain"
version = "13.0.88"
wheels = ["cuda-nvcc-13-0", "cuda-nvvm-13-0", "cuda-crt-13-0", "cuda-cccl-13-0", "cuda-runtime-13-0"]
driver_stub = true

[stub]
kind = "genrule"
outs = ["libcuda.so"]
toolchain = ":tk"
tools = "//toolchains:host-cc"
cmd = {json.dumps(stub["cmd"])}
''')
    out = bgraph(ws, built["cache"], "--platform", "aarch64", "//xstub:tk", "//xstub:stub")["outputs"]
    for lib in (Path(out["//xstub:tk (aarch64)"]) / "lib/stubs/libcuda.so", Path(out["//xstub:stub (aarch64)"]) / "libcuda.so"):
        data = lib.read_bytes()
        assert int.from_bytes(data[18:20], "little") == EM_AARCH64, lib
        assert b"libcuda.so.1" in data
    assert b"cuInit" in (Path(out["//xstub:stub (aarch64)"]) / "libcuda.so").read_bytes()
    tk = Path(out["//xstub:tk (aarch64)"])
    assert (tk / "targets/aarch64-linux/lib/libcudart_static.a").is_file()
    assert int.from_bytes((tk / "lib/libcudart.so.13").read_bytes()[18:20], "little") == EM_AARCH64


@pytest.mark.slow  # the whole aarch64 vLLM wheel (about 50 CPU-minutes on a fresh cache) and torch under qemu
def test_the_sparks_vllm_wheel_installs_imports_and_loads_under_qemu():
    """bench/vllm_wheel_check.py --platform aarch64 on //wheels:vllm-sm121 (an aarch64 wheel from
    any host): pip under qemu installs it with no warning, `import vllm` beside the aarch64 torch,
    both extension libraries load, scaled_fp4_quant is registered, every ELF file is AArch64, the
    cubins are sm_121a and no sm_120a."""
    script = Path(__file__).resolve().parents[1] / "bench" / "vllm_wheel_check.py"
    run = subprocess.run([sys.executable, str(script), "--platform", "aarch64"], capture_output=True, text=True,
                         timeout=4 * 3600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(run.stdout)
    assert report["ok"] and report["all_elf_aarch64"] and not report["pip_warnings"]
    assert re.fullmatch(r"vllm-0\.33\.0-cp38-abi3-manylinux_2_\d+_aarch64\.whl", report["wheel"])
    assert report["scaled_fp4_quant"] and report["vllm"] == "0.33.0"
    archs = set().union(*report["cubin_archs"].values())
    assert "sm_121a" in archs and "sm_120a" not in archs
