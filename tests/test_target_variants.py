"""Target variants in target files: `base = ":other"` is that target with the keys given replaced
(workspace.py). Errors name the file, table and key; nothing is built here."""

from __future__ import annotations

import subprocess
import sys

import pytest

from bgraph_testlib import REPO, hermetic_env
from build_graph.errors import LoadError
from build_graph.labels import Label
from build_graph.workspace import load

BASE = '''\
[a]
kind = "genrule"
outs = ["o"]
cmd = "echo a > $OUT/o"
srcs = ["x.txt"]
memory_mb = 100
'''


def error(ws) -> str:
    with pytest.raises(LoadError) as info:
        load(ws.root)
    return str(info.value)


def test_variant_replaces_only_the_keys_given(make_ws):
    ws = make_ws({"targets/p.toml": BASE + '[b]\nbase = ":a"\ncmd = "echo b > $OUT/o"\n'
                                           '[c]\nbase = ":b"\nmemory_mb = 300\n'})
    targets = load(ws.root).targets
    a, b, c = (targets[Label("p", n)].attrs for n in "abc")
    assert (b.cmd, b.srcs, b.memory_mb, b.outs) == ("echo b > $OUT/o", ["x.txt"], 100, ["o"])
    assert (c.cmd, c.memory_mb) == ("echo b > $OUT/o", 300)  # a variant of a variant
    assert targets[Label("p", "c")].kind == "genrule"
    assert a.cmd == "echo a > $OUT/o"


def test_variant_of_a_target_in_another_package(make_ws):
    ws = make_ws({"targets/p.toml": BASE, "targets/q.toml": '[v]\nbase = "//p:a"\nmemory_mb = 7\n'})
    assert load(ws.root).targets[Label("q", "v")].attrs.memory_mb == 7


def test_unknown_base_is_named_with_a_suggestion(make_ws):
    ws = make_ws({"targets/p.toml": BASE + '\n[b]\nbase = ":aa"\n'})
    text = error(ws)
    assert "unknown base //p:aa" in text and "targets/p.toml" in text and "did you mean //p:a" in text


def test_unknown_key_in_a_variant_is_named(make_ws):
    ws = make_ws({"targets/p.toml": BASE + '\n[b]\nbase = ":a"\nmemroy_mb = 1\n'})
    text = error(ws)
    assert "unknown key 'memroy_mb'" in text and "[b]" in text and "memory_mb" in text


def test_variant_cannot_change_kind_or_loop(make_ws):
    ws = make_ws({"targets/p.toml": BASE + '\n[b]\nbase = ":a"\nkind = "extract"\n'})
    assert "keeps its base's kind" in error(ws)
    ws = make_ws({"targets/p.toml": '[x]\nbase = ":y"\n[y]\nbase = ":x"\n'})
    assert "base cycle" in error(ws)


def test_bad_variant_is_one_error_line_from_the_cli(make_ws):
    ws = make_ws({"targets/p.toml": BASE + '\n[b]\nbase = ":nope"\n'})
    run = subprocess.run([sys.executable, "-m", "build_graph", "-C", str(ws.root), "query", "//p:b"],
                         capture_output=True, text=True, env=hermetic_env(), cwd=REPO)
    assert run.returncode != 0 and "Traceback" not in run.stderr, run.stderr
    assert "unknown base //p:nope" in run.stderr
