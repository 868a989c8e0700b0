"""ninja_graph on recorded `ninja -t compdb -x` / `ninja -t query` output of the test project
(tests/data/cmake_project configured for 12.0a + 12.1a): the planning input, without CMake."""

from __future__ import annotations

from pathlib import Path

import pytest

from build_graph.ninja_graph import NinjaGraphError, load_graph, parse_query

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="module")
def graph():
    return load_graph((DATA / "ninja1.13-demo-compdb.json").read_text(),
                      (DATA / "ninja1.13-demo-query.txt").read_text(), "/bgraph/out")


def test_edges_needed_for_the_shared_library_come_dependencies_first(graph):
    order = [e.outputs[0] for e in graph.needed(["libdemo.so"])]
    assert order[-1] == "libdemo.so"
    assert len(order) == 10  # 2 nvcc, 4 C++ compiles, 2 archives, 1 custom command, the link
    for dep in ("libdemo_cuda.a", "libdemo_cpp.a", "CMakeFiles/demo.dir/table.cpp.o"):
        assert order.index(dep) < order.index("libdemo.so")
    assert order.index("table.cpp") < order.index("CMakeFiles/demo.dir/table.cpp.o")


def test_build_dir_paths_are_relative_and_aliases_share_one_edge(graph):
    edge = graph.producer["table.cpp"]
    assert edge.rule == "CUSTOM_COMMAND"
    assert "/bgraph/src/gen/make_table.cmake" in edge.explicit
    # CMake names the generated file twice (relative and absolute): one edge, one output.
    assert edge.outputs == ["table.cpp"]
    link = graph.producer["libdemo.so"]
    assert {"libdemo_cuda.a", "libdemo_cpp.a"} <= set(link.implicit)


def test_each_nvcc_edge_keeps_its_own_command(graph):
    scale = graph.producer["CMakeFiles/demo_cuda.dir/kernels/scale.cu.o"]
    assert scale.command.startswith("/bgraph/toolchain/bin/nvcc ")
    assert "arch=compute_121a" in scale.command and "-MF" in scale.command


def test_phony_targets_resolve_to_files(graph):
    assert graph.resolve("demo") == ["libdemo.so"]
    assert "libdemo.so" in graph.resolve("all")


def test_unknown_output_is_a_clear_error(graph):
    with pytest.raises(NinjaGraphError, match="no build edge produces 'libnope.so'"):
        graph.needed(["libnope.so"])


def test_query_parse_separates_explicit_implicit_and_order_only():
    text = "out.o:\n  input: CXX\n    a.cpp\n    | gen.h\n    || order\n  outputs:\n    lib.so\n"
    assert parse_query(text, "/bgraph/out") == {"out.o": ("CXX", ["a.cpp"], ["gen.h"], ["order"])}
