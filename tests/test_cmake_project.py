"""cmake_project: the test project under tests/data/cmake_project imported and built for real
(CMake and Ninja from pinned wheels, nvcc 13.0, bubblewrap). Each test copies the project into
a new workspace directory; all share one cache, so every build after the first is incremental
(and the copies prove the keys hold no workspace path)."""

from __future__ import annotations

import ctypes
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from bgraph_testlib import REPO, WS, copy_toolchains

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")

LABEL = "//demo:lib"
TARGET = """\
[lib]
kind = "cmake_project"
srcs = ["demo/**"]
strip_prefix = "demo"
archs = ["12.0a", "12.1a"]
outputs = ["libdemo.so", "libdemo_cuda.a", "libdemo_cpp.a"]
"""
COMPILES = ("CudaHostPreprocess", "CudaDevicePreprocess", "CudaFrontend", "CudaCicc", "CudaPtxas",
            "CudaHostCompile", "CmakeCompile")


def new_ws(root: Path, cache: Path) -> WS:
    (root / "targets").mkdir(parents=True)
    copy_toolchains(root)
    (root / "targets" / "demo.toml").write_text(TARGET)
    shutil.copytree(REPO / "tests" / "data" / "cmake_project", root / "demo")
    return WS(root, cache)


@pytest.fixture(scope="module")
def cache(module_tmp):
    """One cache for the module, warmed by a first build."""
    path = module_tmp / "cmake-cache"
    ws = new_ws(module_tmp / "warm" / "ws", path)
    run = ws.build(LABEL)
    assert run.rc == 0, run.output
    return path


@pytest.fixture
def ws(tmp_path, cache) -> WS:
    return new_ws(tmp_path / "ws", cache)


def ran(summary: dict, mnemonics=COMPILES) -> list[str]:
    """Names of the executed actions with these mnemonics."""
    return sorted(a["name"] for a in summary["actions"] if a["status"] == "executed" and a["mnemonic"] in mnemonics)


def build_ok(ws: WS) -> dict:
    run = ws.build(LABEL)
    assert run.rc == 0, run.output
    return run.json


def test_built_library_loads_with_both_parts(ws):
    summary = build_ok(ws)
    assert summary["executed"] == 0  # another workspace directory, same cache: all hits
    lib = ws.root / "bgraph-out" / "demo" / "lib" / "libdemo.so"
    symbols = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True).stdout
    assert " T demo_cuda_scale" in symbols and " T demo_cpp_greet" in symbols
    dll = ctypes.CDLL(str(lib))
    dll.demo_cpp_greet.restype = ctypes.c_char_p
    assert dll.demo_cpp_greet() == b"hello from demo_cpp"
    assert dll.demo_table_value(7) == 49  # from the source the custom command generated
    query = ws.cli("query", "kind(cmake_project, //...)")
    assert query.rc == 0 and query.stdout.split() == [LABEL]


def test_cu_edit_in_one_arch_recompiles_that_tu_and_arch(ws):
    scale = ws.root / "demo" / "kernels" / "scale.cu"
    scale.write_text(scale.read_text().replace("return x * DEMO_SCALE_FACTOR;  // sm_121 path",
                                               "return x * DEMO_SCALE_FACTOR + 1.0f;  // sm_121 path"))
    common = ws.root / "demo" / "include" / "demo_common.cuh"
    common.write_text(common.read_text().replace("return x * DEMO_SCALE_FACTOR;  // sm_121 path",
                                                 "return x * DEMO_SCALE_FACTOR + 1.0f;  // sm_121 path"))
    summary = build_ok(ws)
    executed = ran(summary)
    assert executed, summary
    assert all("scale.cu" in n for n in executed), executed  # offset.cu did not run
    assert "cicc CMakeFiles/demo_cuda.dir/kernels/scale.cu.o 121a" in executed
    assert "cicc CMakeFiles/demo_cuda.dir/kernels/scale.cu.o 120a" not in executed  # 1200 text unchanged


def test_reconfigure_with_unchanged_edges_compiles_nothing(ws):
    cml = ws.root / "demo" / "CMakeLists.txt"
    cml.write_text(cml.read_text() + "\n# a comment: the configure re-runs, the edges stay as they were\n")
    summary = build_ok(ws)
    assert ran(summary, ("CmakeConfigure",)) == ["configure"]
    assert ran(summary) == []


def test_header_edit_recompiles_only_its_includers(ws):
    hdr = ws.root / "demo" / "include" / "demo_offset.cuh"
    hdr.write_text(hdr.read_text().replace("return x + by;", "return by + x;"))
    summary = build_ok(ws)
    executed = ran(summary)
    assert executed and all("offset.cu" in n for n in executed), executed
    explain = ws.cli("explain", LABEL)
    assert "demo_offset.cuh" in explain.stdout
    records = json.loads(ws.cli("explain", "--json", LABEL).stdout)
    preprocessed = [r for r in records if r["status"] == "executed" and r["mnemonic"].endswith("Preprocess")]
    assert len(preprocessed) == 3  # offset.cu: host, sm_120a, sm_121a
    for r in preprocessed:
        assert "/bgraph/src/include/demo_offset.cuh" in r["reason"], r


def test_edit_to_a_file_no_tu_reads_reconfigures_and_compiles_nothing(ws):
    """The configure may read any file of the tree, so it re-runs; its outputs come out
    byte-identical, so every edge after it is cut off: no compile, archive or link runs."""
    (ws.root / "demo" / "README.md").write_text("edited\n")
    (ws.root / "demo" / "include" / "unused.h").write_text("#pragma once\n")
    summary = build_ok(ws)
    assert ran(summary, ("CmakeConfigure",)) == ["configure"]
    assert ran(summary) == []
    # Only the custom command runs again (it may read the whole tree), and writes the same table.
    assert ran(summary, ("CmakeEdge",)) == ["custom_command table.cpp"]


def outputs_of(ws: WS) -> dict[str, bytes]:
    return {name: (ws.root / "bgraph-out" / "demo" / "lib" / name).read_bytes()
            for name in ("libdemo.so", "libdemo_cuda.a", "libdemo_cpp.a")}


def assert_equal_to_a_clean_build(ws: WS, tmp_path: Path) -> None:
    """The workspace's tree, as it is now, built in an empty cache: the same outputs."""
    clean = WS(tmp_path / "clean" / "ws", tmp_path / "clean" / "cache")
    shutil.copytree(ws.root, clean.root, ignore=shutil.ignore_patterns("bgraph-out"))
    build_ok(clean)
    assert outputs_of(ws) == outputs_of(clean)


def members(ws: WS) -> list[str]:
    archive = ws.root / "bgraph-out" / "demo" / "lib" / "libdemo_cpp.a"
    return sorted(subprocess.run(["ar", "t", str(archive)], capture_output=True, text=True, check=True).stdout.split())


def test_isystem_header_under_mmd_recompiles_its_includer(ws, tmp_path):
    """sum.cpp reads sysinclude/demo_sum_start.h through -isystem and its compile writes a -MMD
    depfile, which leaves the header out: bgraph runs it with -MD, so the edit is seen."""
    header = ws.root / "demo" / "sysinclude" / "demo_sum_start.h"
    header.write_text(header.read_text().replace("#define DEMO_SUM_START 0", "#define DEMO_SUM_START 100"))
    summary = build_ok(ws)
    assert ran(summary) == ["compile CMakeFiles/demo_cpp.dir/cpp/sum.cpp.o"], ran(summary)
    dll = ctypes.CDLL(str(ws.root / "bgraph-out" / "demo" / "lib" / "libdemo.so"))
    values = (ctypes.c_int * 3)(1, 2, 3)
    assert dll.demo_cpp_sum(values, 3) == 106
    assert_equal_to_a_clean_build(ws, tmp_path)


def test_files_the_configure_reads_that_cmake_does_not_list(ws, tmp_path):
    """CMake's own re-run inputs leave out what file(GLOB) without CONFIGURE_DEPENDS matched
    (extra/*.cpp) and what file(READ) read (config/greeting.txt): the configure is keyed on the
    whole tree, so adding, removing and editing them re-configures, and the outputs are a clean
    build's."""
    assert build_ok(ws)["executed"] == 0  # the module's warm build, in another directory: all hits
    assert members(ws) == ["answer.cpp.o", "greet.cpp.o", "sum.cpp.o"]
    (ws.root / "demo" / "extra" / "more.cpp").write_text('extern "C" int demo_extra_more(void) { return 7; }\n')
    (ws.root / "demo" / "config" / "greeting.txt").write_text("hello again\n")
    summary = build_ok(ws)
    assert ran(summary, ("CmakeConfigure",)) == ["configure"]
    assert ran(summary) == ["compile CMakeFiles/demo_cpp.dir/cpp/greet.cpp.o",
                            "compile CMakeFiles/demo_cpp.dir/extra/more.cpp.o"], ran(summary)
    assert members(ws) == ["answer.cpp.o", "greet.cpp.o", "more.cpp.o", "sum.cpp.o"]
    dll = ctypes.CDLL(str(ws.root / "bgraph-out" / "demo" / "lib" / "libdemo.so"))
    dll.demo_cpp_greet.restype = ctypes.c_char_p
    assert dll.demo_cpp_greet() == b"hello again"
    (ws.root / "demo" / "extra" / "answer.cpp").unlink()
    summary = build_ok(ws)
    assert ran(summary, ("CmakeConfigure",)) == ["configure"] and ran(summary) == []
    assert members(ws) == ["greet.cpp.o", "more.cpp.o", "sum.cpp.o"]
    assert_equal_to_a_clean_build(ws, tmp_path)


def test_what_the_configure_overwrites_or_removes_in_the_sources_is_built(ws, tmp_path):
    """R7: a source the configure overwrote keeping the old time (`cp -p`, tar) and one it
    removed (file(REMOVE)) left no trace: the compiles read the original files. What the
    configure did to the tree is now told by content. (sum.cpp's <demo_sum_start.h> is found in
    include/ first; removed, in sysinclude/, which the configure overwrote with 1000.)"""
    variant = ws.root / "demo" / "variants" / "demo_sum_start.h"
    variant.parent.mkdir()
    variant.write_text("#pragma once\n#define DEMO_SUM_START 1000\n")
    (ws.root / "demo" / "include" / "demo_sum_start.h").write_text("#pragma once\n#define DEMO_SUM_START 50\n")
    cml = ws.root / "demo" / "CMakeLists.txt"
    cml.write_text(cml.read_text().replace(
        "set(CMAKE_CXX_STANDARD 17)",
        'execute_process(COMMAND cp -p variants/demo_sum_start.h sysinclude/demo_sum_start.h\n'
        '                WORKING_DIRECTORY "${CMAKE_CURRENT_SOURCE_DIR}" COMMAND_ERROR_IS_FATAL ANY)\n'
        'file(REMOVE "${CMAKE_CURRENT_SOURCE_DIR}/include/demo_sum_start.h")\nset(CMAKE_CXX_STANDARD 17)', 1))
    summary = build_ok(ws)
    assert "compile CMakeFiles/demo_cpp.dir/cpp/sum.cpp.o" in ran(summary), ran(summary)
    dll = ctypes.CDLL(str(ws.root / "bgraph-out" / "demo" / "lib" / "libdemo.so"))
    values = (ctypes.c_int * 3)(1, 2, 3)
    assert dll.demo_cpp_sum(values, 3) == 1006
    assert_equal_to_a_clean_build(ws, tmp_path)


def test_new_header_shadowing_an_include_recompiles(ws):
    # offset.cu says #include "demo_offset.cuh": its own directory is searched before include/.
    (ws.root / "demo" / "kernels" / "demo_offset.cuh").write_text(
        "#pragma once\n__device__ __forceinline__ float demo_offset(float x, float by) { return x - by; }\n")
    summary = build_ok(ws)
    executed = ran(summary)
    assert "hostpp CMakeFiles/demo_cuda.dir/kernels/offset.cu.o" in executed, summary
    assert all("offset.cu" in n for n in executed), executed
    reasons = [a["reason"] for a in summary["actions"] if a["name"].startswith("hostpp") and a["status"] == "executed"]
    assert any("shadow" in r for r in reasons), reasons


def test_configure_that_needs_the_network_fails_clearly(ws):
    cml = ws.root / "demo" / "CMakeLists.txt"
    cml.write_text(cml.read_text().replace(
        "set(CMAKE_CXX_STANDARD 17)",
        'file(DOWNLOAD "https://downloads.example.org/dep-1.0.tar.gz" "${CMAKE_BINARY_DIR}/dep.tgz" STATUS st)\n'
        'list(GET st 0 code)\nif(code)\n  message(FATAL_ERROR "download failed: ${st}")\nendif()\n'
        "set(CMAKE_CXX_STANDARD 17)"))
    run = ws.build(LABEL)
    assert run.rc == 1
    assert "https://downloads.example.org/dep-1.0.tar.gz" in run.output
    assert "no network" in run.output and "Traceback" not in run.output


def test_configure_error_shows_cmakes_own_text(ws):
    cml = ws.root / "demo" / "CMakeLists.txt"
    cml.write_text(cml.read_text().replace("set(CMAKE_CXX_STANDARD 17)",
                                           'message(FATAL_ERROR "demo: broken on purpose")'))
    run = ws.cli("build", LABEL)
    assert run.rc == 1
    assert "demo: broken on purpose" in run.output and "CMake Error" in run.output
    assert "Traceback" not in run.output


def test_relocatable_across_workspaces_and_caches(tmp_path, ws):
    """Another directory and another (empty) cache: the same keys and byte-identical outputs,
    with -lineinfo in the CUDA flags."""
    other = new_ws(tmp_path / "elsewhere" / "deeper", tmp_path / "other-cache")
    first, second = build_ok(ws), build_ok(other)
    assert second["executed"] > 0
    keys = lambda s: sorted(a["key"] for a in s["actions"])  # noqa: E731
    assert keys(first) == keys(second)
    for name in ("libdemo.so", "libdemo_cuda.a", "libdemo_cpp.a"):
        a = (ws.root / "bgraph-out" / "demo" / "lib" / name).read_bytes()
        b = (other.root / "bgraph-out" / "demo" / "lib" / name).read_bytes()
        assert a == b, name
    # Every action's output, not only the wanted ones: against the other cache, key by key.
    checked = other.build(LABEL, args=("--check-against", str(ws.cache)))
    assert checked.rc == 0 and checked.json["differing"] == [], checked.json["differing"]
    assert checked.json["compared_with_other_cache"] == len(second["actions"])
