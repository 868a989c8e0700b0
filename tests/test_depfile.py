"""Make-syntax depfiles as gcc and nvcc write them."""

from build_graph.depfile import absolute, parse_depfile


def test_rules_continuations_escapes_and_phony_targets():
    text = ("obj.o: /bgraph/src/a.cu /bgraph/src/my\\ dir/b.h \\\n /bgraph/toolchain/include/c.h \\\n"
            "  rel/d.h\n/bgraph/src/my\\ dir/b.h:\nrel/d.h:\n")
    assert parse_depfile(text) == ["/bgraph/src/a.cu", "/bgraph/src/my dir/b.h",
                                   "/bgraph/toolchain/include/c.h", "rel/d.h"]


def test_dollar_and_empty():
    assert parse_depfile("x.o: a$$b.h\n") == ["a$b.h"]
    assert parse_depfile("") == []


def test_relative_paths_resolve_against_cwd():
    assert absolute("rel/../d.h", "/bgraph/out") == "/bgraph/out/d.h"
    assert absolute("/bgraph/src/./a.h", "/bgraph/out") == "/bgraph/src/a.h"
