"""Labels (`//pkg:name`, `:name`) and patterns (`//pkg:all`, `//...`, `//pkg/...`)."""

from __future__ import annotations

import pytest

from build_graph.errors import LabelError
from build_graph.labels import Label, Pattern, expand, parse_label, parse_pattern, unknown_label


@pytest.mark.parametrize("text, package, name", [
    ("//a:b", "a", "b"),
    ("//a/b/c:d", "a/b/c", "d"),
    ("//:top", "", "top"),
    ("//sources:vllm-sdist", "sources", "vllm-sdist"),
    ("//toolchains:cuda-13.0", "toolchains", "cuda-13.0"),
    ("//x_y.z+w:n_1.2+3", "x_y.z+w", "n_1.2+3"),
])
def test_parse_label(text, package, name):
    label = parse_label(text)
    assert label == Label(package, name)
    assert str(label) == text


def test_relative_label_needs_a_package():
    assert parse_label(":b", package="a/x") == Label("a/x", "b")
    with pytest.raises(LabelError):
        parse_label(":b")


@pytest.mark.parametrize("text", [
    "//a:b:c", "foo", "//a b:c", "//a:", "a:b", "//a", "///a:b", "//a//b:c", "//a:b c", "", "//a:b/c",
    # a segment of dots alone: bgraph-out/<package>/<name> would lead out of bgraph-out
    "//..:x", "//../victim:x", "//a/./b:c", "//a:..", "//a:.",
])
def test_bad_labels_name_the_text(text):
    with pytest.raises(LabelError) as info:
        parse_label(text)
    assert repr(text) in str(info.value)
    assert "//package:name" in str(info.value)  # the hint says what a label looks like


def test_bad_label_error_carries_where():
    with pytest.raises(LabelError) as info:
        parse_label("//a:b:c", where="targets/p.toml [x] key 'src'")
    assert str(info.value).startswith("targets/p.toml [x] key 'src': bad label '//a:b:c'")


def test_parse_pattern_forms():
    assert parse_pattern("//pkg:all") == Pattern("pkg", None)
    assert parse_pattern("//...") == Pattern("", None, recursive=True)
    assert parse_pattern("//pkg/...") == Pattern("pkg", None, recursive=True)
    assert parse_pattern("//a/b/...") == Pattern("a/b", None, recursive=True)
    assert parse_pattern("//pkg:x") == Pattern("pkg", "x")
    with pytest.raises(LabelError):
        parse_pattern("//pkg/..")
    with pytest.raises(LabelError):
        parse_pattern("pkg/...")


KNOWN = [Label("pkg", "a"), Label("pkg", "b"), Label("pkg/sub", "c"), Label("pkg/sub/deep", "d"),
         Label("pkgx", "e"), Label("other", "f"), Label("", "root")]


def test_pattern_matching():
    assert expand(["//pkg:all"], KNOWN) == [Label("pkg", "a"), Label("pkg", "b")]
    assert expand(["//pkg/..."], KNOWN) == [Label("pkg", "a"), Label("pkg", "b"), Label("pkg/sub", "c"),
                                            Label("pkg/sub/deep", "d")]
    # //pkg/... is a directory prefix, not a string prefix: //pkgx is not under it.
    assert Label("pkgx", "e") not in expand(["//pkg/..."], KNOWN)
    assert expand(["//pkg/sub/..."], KNOWN) == [Label("pkg/sub", "c"), Label("pkg/sub/deep", "d")]
    assert sorted(expand(["//..."], KNOWN)) == sorted(KNOWN)
    assert expand(["//:root"], KNOWN) == [Label("", "root")]


def test_expand_keeps_order_and_drops_duplicates():
    assert expand(["//other:f", "//pkg:all", "//pkg:a"], KNOWN) == [
        Label("other", "f"), Label("pkg", "a"), Label("pkg", "b")]


def test_unknown_label_suggests_close_match():
    with pytest.raises(LabelError) as info:
        expand(["//pkg:bb"], KNOWN)
    msg = str(info.value)
    assert "no target matches '//pkg:bb'" in msg
    assert "did you mean" in msg and "//pkg:b" in msg


def test_unknown_label_without_close_match_points_at_query():
    err = unknown_label("//zzzzzz:qqqqqq", KNOWN)
    assert "did you mean" not in str(err)
    assert "bgraph query //..." in str(err)


def test_pattern_matching_nothing_is_an_error():
    with pytest.raises(LabelError, match="no target matches '//nope/...'"):
        expand(["//nope/..."], KNOWN)
    with pytest.raises(LabelError, match="no target matches '//nope:all'"):
        expand(["//nope:all"], KNOWN)


def test_cli_unknown_label_exits_2_with_suggestion(make_ws):
    ws = make_ws({"targets/p.toml": '[hello]\nkind = "genrule"\nouts = ["o"]\ncmd = "true"\n'})
    run = ws.cli("build", "//p:helo")
    assert run.rc == 2
    assert "no target matches '//p:helo'" in run.stderr
    assert "did you mean //p:hello?" in run.stderr
    assert "Traceback" not in run.stderr
    run = ws.cli("build", "//p:a:b")
    assert run.rc == 2 and "bad label '//p:a:b'" in run.stderr


@pytest.mark.parametrize("text", ["//p:ok\n", "//p\n:ok", ":ok\n", "//...\n", "//p/...\n", "//p:all\n"])
def test_a_final_newline_is_no_label_or_pattern(text):
    """`$` matches before a final newline: //p:ok\\n was //p:ok."""
    with pytest.raises(LabelError):
        parse_pattern(text) if "..." in text or "all" in text else parse_label(text, package="p")


def test_a_package_with_a_final_newline_is_invalid():
    from build_graph.labels import valid_package
    assert valid_package("a/b") and not valid_package("a/b\n")


def test_a_segment_longer_than_200_bytes_is_refused():
    """Each segment is a file name under bgraph-out/ (255 bytes at most, with temporary suffixes)."""
    assert parse_label("//" + "p" * 200 + ":" + "n" * 200) == Label("p" * 200, "n" * 200)
    for text in ("//p:" + "n" * 201, "//" + "p" * 201 + ":n", "//a/" + "p" * 201 + "/b:n"):
        with pytest.raises(LabelError, match="is 201 bytes, more than 200"):
            parse_label(text)
