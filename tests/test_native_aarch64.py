"""The native path on a Spark (issue 20, item 6), proven as far as this x86_64 machine allows:
the plan of an aarch64 host (`--host-platform aarch64`: its own pins and keys), and one FP4 TU
compiled by the aarch64 nvcc and arm64 GCC under qemu (tests/native_aarch64.py), step by step
beside the cross build's outputs (x86_64 nvcc + Debian's aarch64 cross GCC)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

import native_aarch64 as native
from bgraph_testlib import hermetic_env, workspace_copy
from build_graph.model import Action, FileEntry, Tree
from build_graph.workspace import host_platform

pytestmark = [
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed"),
    pytest.mark.skipif(host_platform() != "x86_64", reason="emulates an aarch64 host on x86_64"),
]


def test_the_native_plan_takes_every_pin_for_aarch64(tmp_path):
    """A dry run of //kernels:fp4 as on a Spark: every target is configured for an aarch64 exec
    platform, the system it compiles on is Debian's arm64 GCC (not the cross compiler), and the
    toolkit's wheels are the aarch64 ones; a run that would execute is refused."""
    ws = workspace_copy(tmp_path / "ws")
    run = subprocess.run([sys.executable, "-m", "build_graph", "-C", str(ws), "--cache-dir", str(tmp_path / "c"),
                          "build", "--json", "--dry-run", "--host-platform", "aarch64", "//kernels:fp4"],
                         capture_output=True, text=True, env=hermetic_env(), cwd=ws)
    assert run.returncode == 0, run.stderr
    plan = json.loads(run.stdout)
    fetches = [a["name"] for a in plan["actions"] if a["mnemonic"] == "Fetch"]
    # The systems it compiles on: GCC, and GCC with its plugin headers (for the macro plugin).
    assert {a["label"] for a in plan["actions"]} == {"//toolchains:host-cc (aarch64 on aarch64)",
                                                      "//toolchains:host-cc-plugin (aarch64 on aarch64)"}
    assert any(n.startswith("fetch gcc-12_") and n.endswith("_arm64.deb") for n in fetches), fetches
    assert all(n.endswith(("_arm64.deb", "_all.deb")) for n in fetches), fetches
    assert not any("aarch64-linux-gnu-gcc" in n or "cross" in n for n in fetches), fetches
    # The toolkit waits on the system it probes nvcc with; its wheels are the aarch64 ones.
    assert "//toolchains:cuda-13.0 (aarch64 on aarch64)" in plan["targets_unplanned"]
    from build_graph.labels import parse_label
    from build_graph.workspace import load
    workspace = load(ws)
    for pin in workspace.targets[parse_label("//toolchains:cuda-13.0")].attrs.wheels:
        assert "aarch64" in workspace.pin(pin).for_platform("aarch64").filename, pin
    refused = subprocess.run([sys.executable, "-m", "build_graph", "-C", str(ws), "--cache-dir", str(tmp_path / "c"),
                              "build", "--host-platform", "aarch64", "//kernels:fp4"],
                             capture_output=True, text=True, env=hermetic_env(), cwd=ws)
    assert refused.returncode == 2 and "--dry-run --host-platform aarch64" in refused.stderr, refused.stderr


def _action(argv, mnemonic="CudaPtxas", env=(("PATH", "/bgraph/toolchain/bin:/usr/bin:/bin"),)):
    usr = Tree({"bin/gcc": FileEntry("a" * 64, 1, True), "bin/sed": FileEntry("b" * 64, 1, True)})
    toolkit = Tree({"bin/nvcc": FileEntry("c" * 64, 1, True), "bin/ptxas": FileEntry("d" * 64, 1, True)})
    return Action(name="step", mnemonic=mnemonic, argv=tuple(argv), env=env,
                  inputs=(("/bgraph/toolchain", toolkit), ("/usr", usr)), platform="aarch64")


def test_every_program_of_a_step_starts_through_qemu():
    """How the helper runs a native step here (without binfmt_misc): the program through qemu,
    gcc's own tools through its -wrapper, a script's tools through shell functions, nvcc's gcc
    through the shim; a script it does not know is refused rather than run natively."""
    qemu, shim = Tree({"usr/bin/qemu-aarch64-static": FileEntry("e" * 64, 1, True)}), FileEntry("f" * 64, 1, True)
    step = native.emulated(_action(["ptxas", "-arch=sm_121a", "x.ptx"]), qemu, shim)
    assert step.argv == (native.QEMU, "/bgraph/toolchain/bin/ptxas", "-arch=sm_121a", "x.ptx")
    assert dict(step.inputs)[native.QEMU_MOUNT] == qemu
    gcc = native.emulated(_action(["gcc", "-E", "x.cpp"]), qemu, shim)
    assert gcc.argv[:4] == (native.QEMU, "/usr/bin/gcc", "-wrapper", native.WRAP)
    script = native.emulated(_action(["/bin/sh", "-c", 'sed s/a/b/ "$1" > y\nexec /usr/bin/gcc -c y', "s", "x"]),
                             qemu, shim)
    assert script.argv[:2] == (native.QEMU, "/bin/sh")
    assert f'sed() {{ {native.QEMU} /usr/bin/sed "$@"; }}' in script.argv[3]
    assert f"exec {native.QEMU} /usr/bin/gcc -wrapper {native.WRAP} -c y" in script.argv[3]
    dry = native.emulated(_action(["/bin/sh", "-c", '"$@" 2> dryrun.txt || exit 1', "nvcc",
                                   "/bgraph/toolchain/bin/nvcc", "--dryrun"], "CudaDryrun"), qemu, shim)
    assert dry.argv[4:] == ("nvcc", native.QEMU, "/bgraph/toolchain/bin/nvcc", "--dryrun")
    assert dict(dry.inputs)["/bgraph/toolchain"].entries["bin/gcc"] == shim
    with pytest.raises(native.EmulationError, match="does not know"):
        native.emulated(_action(["/bin/sh", "-c", "make all"]), qemu, shim)
    with pytest.raises(native.EmulationError, match="not found along PATH"):
        native.emulated(_action(["cicc", "x.ii"]), qemu, shim)


@pytest.fixture(scope="module")
def built(module_tmp):
    return native.build_both(module_tmp, jobs=2)


@pytest.mark.slow  # the aarch64 nvcc, cicc, ptxas and GCC under qemu (~1 min of CPU), both toolkits
def test_the_native_tu_matches_the_cross_build_step_by_step(built):
    """The device code is byte-identical (PTX, cubins, cudafe's module id, cicc's stub); the
    preprocessed text is the same code with other include directories; cudafe++'s
    host file spells some float literals otherwise; the host objects differ only in .comment,
    the GCC build's version string."""
    rows = {(r["step"].split()[0], r["file"]): r for r in native.compare(built)}
    same = [k for k, r in rows.items() if r["identical"]]
    for step, suffix in (("cicc", ".ptx"), ("cicc", ".stub.c"), ("ptxas", ".cubin"), ("cudafe", ".module_id")):
        assert any(s == step and f.endswith(suffix) for s, f in same), (step, suffix)
    assert sum(s == "ptxas" for s, _ in same) == 2  # sm_120a and sm_121a
    for (step, f), r in rows.items():
        if f.endswith(".ii"):
            assert not r["identical"] and r["why"].startswith("the same code"), r
        if f.endswith(".cudafe1.cpp"):
            assert "floating-point literals" in r["why"], r
        if step in ("hostcc", "fatbin"):  # fatbinary's action joins its image to the host object
            assert r["why"].startswith("only .comment differs") and "12.2.0-14+deb12u1" in r["why"], r
    native_obj = next(built["native_out"].rglob("*.cu.o")).read_bytes()
    assert int.from_bytes(native_obj[18:20], "little") == 183  # EM_AARCH64
    listed = subprocess.run([str(built["cuobjdump"]), "--list-elf", str(next(built["native_out"].rglob("*.cu.o")))],
                            capture_output=True, text=True).stdout
    assert "sm_121a" in listed and "sm_120a" in listed, listed


@pytest.mark.slow
def test_a_spark_and_a_cross_build_share_fetches_and_unpacks_only(built):
    """What a remote cache filled by one serves the other: the same keys. Only fetches and
    unpacks: the aarch64 CUDA wheels both toolkits take (the cross toolkit for their lib/) and
    Debian's `all` packages; every program run differs in its exec platform, toolchain and /usr."""
    assert native.shared_keys(built) == {"Fetch": 5, "Extract": 5}
    for r in native.compare(built):
        assert not r["same_key"]
        assert {"exec_platform", "toolchain", "inputs[/usr]"} <= set(r["key_fields"]), r
    # A second native build is all hits: the emulated results are filed under the native keys.
    from build_graph.labels import parse_label
    again = built["engine"].build([parse_label(native.LABEL)])
    assert not again.failures and again.count("executed") == 0
