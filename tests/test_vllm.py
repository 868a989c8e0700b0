"""vLLM 0.33.0 for 12.1a, the CI part: the real offline configure in the sandbox (torch 2.14.0
from pinned wheels, CUTLASS from the FlashInfer sdist), the import of its Ninja graph, and
vLLM's FP4 quantization TUs compiled for sm_121a. (The full build is a benchmark: an hour.)"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bgraph_testlib import hermetic_env, workspace_copy
from build_graph.labels import parse_label
from build_graph.workspace import host_platform

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")

SMOKE = "//vllm:smoke-fp4-sm121"
# The smoke build's cache holds torch's 29 wheels and their extracted tree: 12.4 GB measured.
SMOKE_DISK_GB = 14
WHEELS = ("vllm-sm121", "vllm-sm120", "vllm-sm12x")
PLATFORMS = ("x86_64", "aarch64")


@pytest.fixture(scope="module")
def ws(module_tmp) -> Path:
    return workspace_copy(module_tmp / "ws")


def bgraph(ws, cache, *args, timeout=2400):
    return subprocess.run([sys.executable, "-m", "build_graph", "-C", str(ws), "--cache-dir", str(cache), *args],
                          capture_output=True, text=True, timeout=timeout, env=hermetic_env(), cwd=ws)


def planned_fetches(ws, cache, wheel, platform, flag="--host-platform") -> dict[str, str]:
    """'label action-name' -> key of every Fetch a dry run plans for `wheel` on a `platform` host
    (the native build there; with flag --platform: built for `platform` on this host, and labels
    keep their configuration: "//vllm:torch-env (aarch64)" beside the exec machine's
    "//vllm:torch-env"). Planned on another host, labels lose the tag ("(aarch64 on aarch64)").
    A native build there also builds for that host: `--platform` overrides a target's own
    (vllm-sm121 says aarch64)."""
    native = ("--platform", platform) if flag == "--host-platform" else ()
    run = bgraph(ws, cache, "build", "--json", "--dry-run", flag, platform, *native, f"//wheels:{wheel}")
    assert run.returncode == 0, run.stderr
    label = (lambda t: t) if flag == "--platform" else (lambda t: t.split(' (')[0])
    return {f"{label(a['label'])} {a['name']}": a["key"] for a in json.loads(run.stdout)["actions"]
            if a["mnemonic"] == "Fetch"}


def pins_named(value, pins) -> set[str]:
    """The pin names among a target's attribute values (strings, lists and tables of them)."""
    if isinstance(value, str):
        return {value} & pins
    if isinstance(value, dict):
        return set().union(*(pins_named(v, pins) for v in value.values())) if value else set()
    if isinstance(value, (list, tuple)):
        return set().union(*(pins_named(v, pins) for v in value)) if value else set()
    return set()


def expected_fetches(workspace, closure, platform) -> dict[str, tuple[str, str, str]]:
    """'label fetch NAME' -> (file name, sha256, source) for every file the targets in `closure`
    pin for `platform`: the WORKSPACE.toml pins their attributes name, and the .deb files their
    Debian lock files hold for it. Fails where a pin has no file for the platform."""
    from build_graph.debian import DEB_ARCH
    from build_graph.debian.lockfile import parse as parse_lock
    all_pins = set(workspace.model.pins)
    files = {}
    for label in closure:
        target = workspace.targets[label]
        if target.kind == "deb_packages":
            if platform not in target.attrs.locked_for:  # a cross compiler of another host
                continue
            lock = target.attrs.lock
            locked = parse_lock((workspace.root / lock).read_text(), where=lock).get(platform)
            assert locked is not None, f"{lock} has no packages for {platform}"
            for e in locked.packages:
                assert e.architecture in (DEB_ARCH[platform], "all"), (lock, platform, e)
                files[f"{label} fetch {e.basename}"] = (e.basename, e.sha256, "debian")
            continue
        for name in sorted(pins_named(target.attrs.model_dump(), all_pins)):
            pin = workspace.pin(name)
            try:
                f = pin.for_platform(platform)
            except KeyError:
                pytest.fail(f"pin {name!r} (needed by {label}) has no file for {platform}")
            files[f"{label} fetch {name}"] = (f.filename or f.url.rsplit("/", 1)[-1], f.sha256, pin.kind)
    return files


def test_all_three_wheels_resolve_for_both_platforms(ws, tmp_path):
    """For each wheel and platform, every file its dependency closure pins (WORKSPACE.toml's pins,
    the Debian lock files) resolves for that platform: a wheel tagged for that CPU (or for any), a
    .deb of its Debian architecture (or all), never the other CPU's. The fetches a dry run plans
    (the targets that wait on no other) are exactly of those files, keyed on their name and sha256;
    a pin without a file for the platform is an error."""
    from build_graph.labels import parse_label
    from build_graph.model import Digester
    from build_graph.rules.base import fetch
    from build_graph.workspace import load
    workspace = load(ws)
    digester = Digester(workspace.digest_function)
    torch_env = workspace.targets[parse_label("//vllm:torch-env")].attrs.wheels
    assert len(torch_env) == 29
    for wheel in WHEELS:
        query = bgraph(ws, tmp_path / "cache", "query", f"deps(//wheels:{wheel})")
        assert query.returncode == 0, query.stderr
        closure = [parse_label(line) for line in query.stdout.split()]
        for platform in PLATFORMS:
            other = next(p for p in PLATFORMS if p != platform)
            files = expected_fetches(workspace, closure, platform)
            pinned = {name.rsplit(" fetch ", 1)[1] for name in files}
            assert set(torch_env) | {"vllm-sdist", "flashinfer-sdist", "cmake", "ninja", "cuda-nvcc-13-0"} <= pinned
            assert sum(name.endswith(".deb") for name in pinned) > 50, (wheel, platform)
            for name, (filename, _sha, _source) in files.items():
                if filename.endswith(".whl"):
                    tags = filename[:-4].split("-")[-1]
                    assert platform in tags or tags == "any", (wheel, platform, filename)
                # (a .deb's architecture is checked above: a cross compiler's name says its target)
                assert other not in filename or filename.endswith(".deb"), (wheel, platform, filename)
            planned = planned_fetches(ws, tmp_path / "cache", wheel, platform)
            assert set(planned) <= set(files), set(planned) - set(files)
            assert {f"//vllm:torch-env fetch {n}" for n in torch_env} <= set(planned), (wheel, platform)
            assert any(name.startswith("//toolchains:host-cc fetch gcc-12_") for name in planned), (wheel, platform)
            for name, key in planned.items():
                filename, sha256, source = files[name]
                assert key == fetch("", filename, sha256, source).key(digester), (wheel, platform, name)
    # A pin with no file for the platform asked for is an error naming the pin and the platform.
    broken = workspace_copy(tmp_path / "broken")
    text = (broken / "WORKSPACE.toml").read_text()
    aarch64_torch = next(line for line in text.splitlines()
                         if line.startswith("platforms.aarch64") and "torch-2.14.0-" in line)
    (broken / "WORKSPACE.toml").write_text(text.replace(aarch64_torch + "\n", ""))
    run = bgraph(broken, tmp_path / "cache", "build", "--dry-run", "--platform", "aarch64", "//wheels:vllm-sm121")
    assert run.returncode != 0 and "pin 'py-torch' has no file for platform aarch64" in run.stderr, run.stderr
    assert planned_fetches(broken, tmp_path / "cache", "vllm-sm121", "x86_64")


def test_the_aarch64_graph_plans_every_pin_for_aarch64(ws, tmp_path):
    """`--dry-run --platform aarch64`: the fetches planned for the wheel's closure (those of
    targets that wait on no other target's output) resolve a pinned file for aarch64 (a pin
    without one is an error), and the platform-specific ones get other keys: the same pins,
    and Debian packages of the other architecture (an `all` package is the same file)."""
    keys = {}
    for platform in PLATFORMS:
        fetches = planned_fetches(ws, tmp_path / "cache", "vllm-sm121", platform)
        assert len(fetches) >= 33
        keys[platform] = fetches
    debs = {p: {n: k for n, k in keys[p].items() if n.endswith(".deb")} for p in PLATFORMS}
    pins = {p: {n: k for n, k in keys[p].items() if n not in debs[p]} for p in PLATFORMS}
    assert pins["x86_64"].keys() == pins["aarch64"].keys()
    differ = {name for name in pins["x86_64"] if pins["x86_64"][name] != pins["aarch64"][name]}
    assert {"//vllm:torch-env fetch py-torch", "//vllm:torch-env fetch py-triton",
            "//toolchains:cmake-wheel fetch cmake"} <= differ
    assert "//sources:vllm-sdist fetch vllm-sdist" not in differ  # an sdist is the same file everywhere
    assert all(n.endswith(("_arm64.deb", "_all.deb")) for n in debs["aarch64"]), debs["aarch64"]
    assert all(n.endswith(("_amd64.deb", "_all.deb")) for n in debs["x86_64"]), debs["x86_64"]
    arch_free = {n for n in debs["aarch64"] if n.endswith("_all.deb")}
    assert arch_free and all(debs["aarch64"][n] == debs["x86_64"][n] for n in arch_free)
    assert any(n.startswith("//toolchains:host-cc fetch gcc-12_") for n in debs["aarch64"])
    # A dry run stores the workspace files its plans read (lock files, WORKSPACE.toml), and nothing else.
    from build_graph.model import Digester
    b3 = Digester("blake3")
    workspace_files = {b3.of(p.read_bytes()) for p in ws.rglob("*") if p.is_file() and not p.is_symlink()}
    cas = tmp_path / "cache" / "v1" / "blake3" / "cas"
    stored = {p.parent.name + p.name for p in cas.rglob("*") if p.is_file()}  # cas/ab/cdef…
    assert stored <= workspace_files, f"a dry run downloaded something: {len(stored - workspace_files)} blob(s)"
    refused = bgraph(ws, tmp_path / "cache", "build", "--host-platform", "aarch64", "//wheels:vllm-sm121")
    assert refused.returncode == 2 and "--dry-run --host-platform aarch64" in refused.stderr, refused.stderr


def test_the_cross_build_plans_aarch64_targets_with_x86_64_tools(ws, tmp_path):
    """`--dry-run --platform aarch64` on this x86_64 host: the wheel and what it packs are built for
    aarch64 (the aarch64 torch), by the cross compiler standing in for //toolchains:host-cc (amd64
    packages) and the x86_64 CMake and Ninja (exec transition); the configure imports the x86_64 torch. (The toolkit waits on torch: a dry
    run cannot plan it; test_cross_build.py builds the aarch64 toolkit of the FP4 kernels.)"""
    if host_platform() != "x86_64":
        pytest.skip("the cross build is planned from an x86_64 host")
    from build_graph.workspace import load
    workspace = load(ws)
    cross = planned_fetches(ws, tmp_path / "cache", "vllm-sm121", "aarch64", flag="--platform")
    native = planned_fetches(ws, tmp_path / "cache", "vllm-sm121", "x86_64")
    spark = planned_fetches(ws, tmp_path / "cache", "vllm-sm121", "aarch64")  # planned on a Spark
    for name in ("//vllm:torch-env fetch py-torch", "//vllm:torch-env fetch py-triton"):
        target = name.replace("torch-env", "torch-env (aarch64)")
        assert cross[target] == spark[name] != native[name]  # the aarch64 files, to link
        assert cross[name] == native[name]  # and the exec machine's, for the configure's Python
    for name in ("//toolchains:cmake-wheel fetch cmake", "//toolchains:ninja-wheel fetch ninja"):
        assert cross[name] == native[name] != spark[name]  # x86_64 tools
    debs = {n for n in cross if n.endswith(".deb")}
    assert any(n.startswith("//toolchains:cross-cc-aarch64 fetch g++-12-aarch64-linux-gnu_") for n in debs), debs
    sysroot = {n for n in debs if n.startswith("//toolchains:target-python (aarch64) ")}  # arm64 Python headers
    assert sysroot and all(n.endswith(("_arm64.deb", "_all.deb")) for n in sysroot), sysroot
    assert all(n.endswith(("_amd64.deb", "_all.deb")) for n in debs - sysroot), debs  # every system runs here
    assert not any(n.startswith("//toolchains:host-cc fetch gcc-12_") for n in debs)  # the stand-in serves it
    assert "cross-cc-aarch64" in str(workspace.targets[parse_label("//toolchains:host-cc")].attrs.cross)


def test_offline_configure_import_and_fp4_quantization_tus(ws, tmp_path):
    free_gb = shutil.disk_usage(tmp_path).free / 1e9
    if free_gb < SMOKE_DISK_GB:
        pytest.skip(f"needs {SMOKE_DISK_GB} GB of free disk for torch's wheels, {free_gb:.1f} GB free")
    cache = tmp_path / "cache"
    run = bgraph(ws, cache, "build", "--json", "-j2", SMOKE, "//toolchains:cuobjdump")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads(run.stdout)
    names = {a["name"] for a in summary["actions"] if a["status"] == "executed"}
    assert "configure" in names
    assert any(n.startswith("cicc ") and "nvfp4_quant_kernels" in n and n.endswith("121a") for n in names)
    out = ws / "bgraph-out" / "vllm" / "smoke-fp4-sm121"
    cuobjdump = ws / "bgraph-out" / "toolchains" / "cuobjdump" / "bin" / "cuobjdump"
    for obj in ("nvfp4_quant_kernels", "activation_nvfp4_quant_fusion_kernels", "nvfp4_experts_quant"):
        path = out / f"CMakeFiles/_C_stable_libtorch.dir/csrc/quantization/fp4/{obj}.cu.o"
        listed = subprocess.run([str(cuobjdump), "--list-elf", str(path)], capture_output=True, text=True).stdout
        assert "sm_121a" in listed and "sm_120" not in listed, listed
    # Another build of the same target: nothing runs (the configure included).
    again = json.loads(bgraph(ws, cache, "build", "--json", SMOKE).stdout)
    assert again["executed"] == 0


@pytest.mark.slow  # two torch environments (~25 GB of cache): the aarch64 one to link, the x86_64 one to configure
def test_the_fp4_quantization_tus_cross_compile_for_aarch64(ws, tmp_path):
    """`--platform aarch64 //vllm:smoke-fp4-sm121` on x86_64: vLLM's own configure, cross (CMake
    told the processor; the configure's Python imports the exec machine's torch, CMake takes the
    aarch64 one), then vLLM's FP4 quantization TUs: AArch64 objects with sm_121a cubins only."""
    if host_platform() != "x86_64":
        pytest.skip("the cross build is checked from an x86_64 host")
    free_gb = shutil.disk_usage(tmp_path).free / 1e9
    if free_gb < 2 * SMOKE_DISK_GB:
        pytest.skip(f"needs {2 * SMOKE_DISK_GB} GB of free disk for two torch environments, {free_gb:.1f} GB free")
    cache = tmp_path / "cache"
    tools = bgraph(ws, cache, "build", "--json", "//toolchains:cuobjdump")
    assert tools.returncode == 0, tools.stderr[-3000:]
    run = bgraph(ws, cache, "build", "--json", "-j2", "--platform", "aarch64", SMOKE)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads(run.stdout)
    labels = {a["label"] for a in summary["actions"]}
    assert {f"{SMOKE} (aarch64)", "//vllm:torch-env", "//vllm:torch-env (aarch64)",
            "//toolchains:cross-cc-aarch64"} <= labels, labels
    out = ws / "bgraph-out" / "aarch64" / "vllm" / "smoke-fp4-sm121"
    cuobjdump = ws / "bgraph-out" / "toolchains" / "cuobjdump" / "bin" / "cuobjdump"
    for obj in ("nvfp4_quant_kernels", "activation_nvfp4_quant_fusion_kernels", "nvfp4_experts_quant"):
        path = out / f"CMakeFiles/_C_stable_libtorch.dir/csrc/quantization/fp4/{obj}.cu.o"
        assert int.from_bytes(path.read_bytes()[18:20], "little") == 183  # EM_AARCH64
        listed = subprocess.run([str(cuobjdump), "--list-elf", str(path)], capture_output=True, text=True).stdout
        assert "sm_121a" in listed and "sm_120" not in listed, listed
    from build_graph.store.trace import Trace
    trace = Trace(cache / "v1" / "blake3", cache / "v1" / "tmp").load(f"{SMOKE} (aarch64)")
    configure = trace["actions"]["configure"]["description"]
    assert "-DCMAKE_SYSTEM_PROCESSOR=aarch64" in configure["argv"] and configure["exec_platform"] == "x86_64"
