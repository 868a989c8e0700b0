"""`bgraph why LABEL FILE|PATCH` (provenance.py) on the imported CMake demo (tests/data/cmake_project),
patched by a patched_tree, built natively and, under a wheel fixed to aarch64, cross-built: the
answer comes from the last build of LABEL in its configuration (its own platform, `--platform`,
or the one configuration it was built in), through the imported edges' depfile reads, the
configure's reads, the actions that are not narrowed (they can read every file of a mount) and
the patch application itself; and it says when another workspace sharing the cache wrote it.

The assertions hold whether the configure and the imported compiles are narrowed by a depfile or
keyed on their whole source tree: only which actions read a file is asserted, not how."""

from __future__ import annotations

import difflib
import shutil
from pathlib import Path

import pytest

from bgraph_testlib import REPO, WS, copy_toolchains
from build_graph.workspace import host_platform

pytestmark = [
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed"),
    pytest.mark.skipif(host_platform() != "x86_64", reason="the cross build (aarch64 on x86_64) needs an x86_64 host"),
]

LIB, WHEEL, PATCHED = "//why:lib", "//why:wheel", "//why:patched"
SPARK = "//why:lib (aarch64)"  # the library as the aarch64 wheel's build planned it
HDR, CML = "patches/why/0001-offset.patch", "patches/why/0002-cmake.patch"
OFFSET = "CMakeFiles/demo_cuda.dir/kernels/offset.cu.o"
TARGETS = """\
# The demo's sources as a tree, patched, imported; and a wheel of it for the Spark (aarch64).
[orig]
kind = "genrule"
srcs = ["demo/**"]
outs = {outs}
cmd = "cd $SRC/demo && cp --parents {files} $OUT/"

[patched]
kind = "patched_tree"
src = ":orig"
patches = ["patches/why/*.patch"]

[lib]
kind = "cmake_project"
src = ":patched"
archs = ["12.0a", "12.1a"]
outputs = ["libdemo.so", "libdemo_cuda.a", "libdemo_cpp.a"]

[wheel]
kind = "py_wheel"
distribution = "whydemo"
version = "0.1.0"
srcs = ["py/whydemo/__init__.py"]
strip_prefix = "py"
files = {{ "whydemo/libdemo.so" = [":lib", "libdemo.so"] }}
platform = "aarch64"
"""


def diff(path: str, a: str, b: str) -> str:
    return "".join(difflib.unified_diff(a.splitlines(True), b.splitlines(True), f"a/{path}", f"b/{path}"))


def new_ws(root: Path, cache: Path) -> WS:
    copy_toolchains(root)
    demo = REPO / "tests" / "data" / "cmake_project"
    shutil.copytree(demo, root / "demo")
    offset = (demo / "include" / "demo_offset.cuh").read_text()
    cml = (demo / "CMakeLists.txt").read_text()
    assert "return x + by;" in offset and "set(CMAKE_CXX_STANDARD 17)" in cml  # what the patches change
    files = sorted(p.relative_to(demo).as_posix() for p in demo.rglob("*") if p.is_file())
    ws = WS(root, cache)
    ws.write({"targets/why.toml": TARGETS.format(outs=str(files).replace("'", '"'), files=" ".join(files)),
              "py/whydemo/__init__.py": "# the wheel's package\n",
              HDR: diff("include/demo_offset.cuh", offset, offset.replace("return x + by;", "return by + x;")),
              CML: diff("CMakeLists.txt", cml, cml.replace("set(CMAKE_CXX_STANDARD 17)",
                                                           "# patched\nset(CMAKE_CXX_STANDARD 17)"))})
    return ws


@pytest.fixture(scope="module")
def built(module_tmp):
    """The aarch64 wheel built first (so //why:lib has only its aarch64 build for a while), then
    the library for this machine."""
    ws = new_ws(module_tmp / "ws", module_tmp / "cache")
    run = ws.build(WHEEL)
    assert run.rc == 0, run.output
    only_cross = {"why": ws.cli("why", "--json", LIB, HDR), "explain": ws.cli("explain", LIB)}
    run = ws.build(LIB)
    assert run.rc == 0, run.output
    return {"ws": ws, "only_cross": only_cross}


def reads(run) -> list[dict]:
    assert run.rc == 0, run.output
    return run.json["reads"]


def preprocessing(found: list[dict], target: str) -> set[tuple]:
    """(TU, arch) of each nvcc preprocessing step of `target` that read the file."""
    return {(r["tu"], r["arch"]) for r in found if r["target"] == target and r["mnemonic"].endswith("Preprocess")}


def test_a_header_patch_names_the_tus_archs_and_steps_that_read_it(built):
    ws = built["ws"]
    found = reads(ws.cli("why", "--json", LIB, HDR))
    assert preprocessing(found, LIB) >= {(OFFSET, None), (OFFSET, "120a"), (OFFSET, "121a")}, found
    # What a depfile says was read is offset.cu's alone (scale.cu does not include the header).
    assert {r["tu"] for r in found if r["narrowed"] and r["tu"]} <= {OFFSET}
    # The patch application itself reads the patch.
    assert {(r["target"], r["action"], r["file"]) for r in found if r["target"] == PATCHED} == \
        {(PATCHED, "apply patches", HDR)}
    text = ws.cli("why", LIB, HDR)
    assert text.rc == 0, text.output
    assert text.stdout.startswith(f"{LIB} reaches {HDR} ({PATCHED})")
    for line in (f"TU {OFFSET}", "arch 120a (devpp)", "arch 121a (devpp)", "host (hostpp)",
                 f"include/demo_offset.cuh <- {HDR}, applied by {PATCHED}", "apply patches",
                 f"{HDR} <- from {PATCHED} (reads all of /bgraph/src, not narrowed)"):
        assert line in text.stdout, text.stdout
    # The header itself, asked by its path in the tree: the same steps.
    assert preprocessing(reads(ws.cli("why", "--json", LIB, "include/demo_offset.cuh")), LIB) >= \
        {(OFFSET, None), (OFFSET, "120a"), (OFFSET, "121a")}


def test_a_patch_to_cmakelists_names_the_configure(built):
    ws = built["ws"]
    found = reads(ws.cli("why", "--json", LIB, CML))
    assert (LIB, "configure", "CMakeLists.txt") in {(r["target"], r["action"], r["file"]) for r in found}, found
    assert "configure" in ws.cli("why", LIB, CML).stdout


def test_a_file_no_depfile_names_is_read_by_the_actions_that_mount_it_whole(built):
    """The custom command that generates table.cpp reads make_table.cmake: it has no depfile,
    so it is keyed on (and can read) the whole source tree, and `why` says so."""
    ws = built["ws"]
    found = reads(ws.cli("why", "--json", LIB, "gen/make_table.cmake"))
    custom = [r for r in found if r["target"] == LIB and r["mnemonic"] == "CmakeEdge"]
    assert custom and all(not r["narrowed"] and r["mount"] == "/bgraph/src" for r in custom), found
    assert "(reads all of /bgraph/src, not narrowed)" in ws.cli("why", LIB, "gen/make_table.cmake").stdout


def test_the_cross_built_library_under_the_aarch64_wheel(built):
    """The wheel is aarch64 from this x86_64 host: its library's build is `//why:lib (aarch64)`,
    and that build's records answer (before, `why` looked for the x86_64 ones: "no action read it")."""
    ws = built["ws"]
    run = ws.cli("why", "--json", WHEEL, HDR)
    assert run.json["configured"] == f"{WHEEL} (aarch64)" and run.json["platform"] == "aarch64"
    found = reads(run)
    assert preprocessing(found, SPARK) >= {(OFFSET, None), (OFFSET, "120a"), (OFFSET, "121a")}, found
    assert not preprocessing(found, LIB)  # nothing from the x86_64 build
    assert (f"{PATCHED} (aarch64)", "apply patches", HDR) in {(r["target"], r["action"], r["file"]) for r in found}
    text = ws.cli("why", WHEEL, HDR).stdout
    assert f"{WHEEL} (aarch64)\n└── {SPARK}\n" in text and "arch 121a (devpp)" in text, text
    found = reads(ws.cli("why", "--json", WHEEL, CML))
    assert (SPARK, "configure", "CMakeLists.txt") in {(r["target"], r["action"], r["file"]) for r in found}, found
    # The library itself, with --platform: the same build; explain takes --platform alike.
    run = ws.cli("why", "--json", "--platform", "aarch64", LIB, HDR)
    assert run.json["configured"] == SPARK
    assert preprocessing(reads(run), SPARK) >= {(OFFSET, "121a")}
    explain = ws.cli("explain", "--platform", "aarch64", LIB)
    assert explain.rc == 0 and explain.stdout.startswith(f"{SPARK}: last build"), explain.output


def test_a_workspace_file_under_strip_prefix_is_found_where_the_target_puts_it(built):
    """The wheel takes py/whydemo/__init__.py as whydemo/__init__.py (strip_prefix): the wheel
    step, which mounts its whole content, can read it there."""
    found = reads(built["ws"].cli("why", "--json", WHEEL, "py/whydemo/__init__.py"))
    assert [(r["target"], r["mnemonic"], r["file"], r["mount"], r["narrowed"]) for r in found] == \
        [(f"{WHEEL} (aarch64)", "PyWheel", "whydemo/__init__.py", "/bgraph/in/pkg", False)], found
    text = built["ws"].cli("why", WHEEL, "py/whydemo/__init__.py").stdout
    assert (f"whydemo/__init__.py <- py/whydemo/__init__.py, from {WHEEL} (aarch64) "
            "(reads all of /bgraph/in/pkg, not narrowed)") in text, text


def test_a_library_built_only_for_the_other_platform_answers_from_that_build(built):
    """Before //why:lib was built for this machine, its one recorded build was the aarch64 one:
    `why` and `explain` answer from it, and say so."""
    why, explain = built["only_cross"]["why"], built["only_cross"]["explain"]
    assert why.rc == 0, why.output
    assert why.json["configured"] == SPARK
    assert why.json["note"].startswith(f"{LIB} has no recorded build; shown is the last build of {SPARK}")
    assert preprocessing(why.json["reads"], SPARK) >= {(OFFSET, "120a"), (OFFSET, "121a")}
    assert explain.rc == 0 and f"note: {LIB} has no recorded build; shown is the last build of {SPARK}" in explain.stdout
    assert f"{SPARK}: last build executed" in explain.stdout


def test_no_recorded_build_is_one_line_with_the_command_to_run(make_ws):
    ws = make_ws({"targets/p.toml": '[a]\nkind = "genrule"\nouts = ["a.txt"]\ncmd = "echo a > $OUT/a.txt"\n'})
    run = ws.cli("why", "//p:a", "a.txt")
    assert run.rc == 1 and run.stdout == "//p:a has no recorded build: run `bgraph build //p:a` first\n", run.output
    assert not (ws.cache / "v1").exists() or not list((ws.cache / "v1").rglob("state-v*.sqlite"))
    bad = ws.cli("why", "//p:nope", "a.txt")
    assert bad.rc == 2 and "Traceback" not in bad.output and len(bad.stderr.strip().splitlines()) <= 2, bad.output


def test_a_trace_written_by_another_workspace_is_said_to_be(built, tmp_path):
    """Traces are the cache's: a build of the same label in another checkout on this cache is
    the last build `explain` and `why` see, and they name that checkout."""
    ws = built["ws"]
    other = new_ws(tmp_path / "other", ws.cache)
    assert other.build(LIB).rc == 0
    explain = ws.cli("explain", LIB)
    note = f"the last build of {LIB} recorded in this cache ran in another workspace, {other.root}"
    assert f"note: {note}" in explain.stdout, explain.stdout
    why = ws.cli("why", LIB, HDR)
    assert why.rc == 0 and note in why.stdout, why.stdout
    assert ws.cli("why", "--json", LIB, HDR).json["traces_from_other_workspaces"][LIB] == str(other.root)
    assert note not in other.cli("explain", LIB).stdout  # its own build, there
    # An edit here plans //why:lib again in this workspace: its build is the last one recorded.
    script = ws.root / "demo" / "gen" / "make_table.cmake"
    script.write_text(script.read_text() + "# edited\n")
    assert ws.build(LIB).rc == 0
    assert "another workspace" not in ws.cli("explain", LIB).stdout
    assert "another workspace" not in ws.cli("why", LIB, HDR).stdout
