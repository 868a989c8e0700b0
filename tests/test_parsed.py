"""The parsed workspace kept between commands (store/parsed.py): used only while WORKSPACE.toml,
every targets/**/*.toml and bgraph's code keep their stamps."""

from __future__ import annotations

import os
import time

from bgraph_testlib import TOOLCHAINS_TOML, WORKSPACE_TOML
from build_graph.store import parsed
from build_graph.workspace import load

FILES = {"WORKSPACE.toml": WORKSPACE_TOML, "targets/toolchains.toml": TOOLCHAINS_TOML,
         "targets/p.toml": '[a]\nkind = "genrule"\nouts = ["a"]\ncmd = "true"\n'}


def write(root, files, age=30.0):
    past = time.time() - age
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        os.utime(path, (past, past))


def counting():
    calls = []

    def parse(root):
        calls.append(root)
        return load(root)
    return parse, calls


def test_the_kept_parse_is_used_until_a_target_file_changes(tmp_path):
    write(tmp_path, FILES)
    parse, calls = counting()
    first = parsed.load(tmp_path, parse)
    again = parsed.load(tmp_path, parse)
    assert len(calls) == 1 and list(again.targets) == list(first.targets)
    write(tmp_path, {"targets/p.toml": FILES["targets/p.toml"] + '\n[b]\nkind = "genrule"\nouts = ["b"]\ncmd = "true"\n'},
          age=20)
    assert {"//p:a", "//p:b"} <= set(map(str, parsed.load(tmp_path, parse).targets)) and len(calls) == 2
    write(tmp_path, {"targets/q/more.toml": '[c]\nkind = "genrule"\nouts = ["c"]\ncmd = "true"\n'}, age=10)
    assert "//q/more:c" in map(str, parsed.load(tmp_path, parse).targets) and len(calls) == 3
    parsed.load(tmp_path, parse)
    assert len(calls) == 3


def test_a_fresh_file_or_a_damaged_pickle_means_parsing(tmp_path):
    write(tmp_path, FILES, age=0)  # written now: its stamp may not change on the next write
    parse, calls = counting()
    parsed.load(tmp_path, parse)
    parsed.load(tmp_path, parse)
    assert len(calls) == 2
    write(tmp_path, FILES)
    parsed.load(tmp_path, parse)
    kept = tmp_path / "bgraph-out" / ".uptodate" / parsed.NAME
    kept.write_bytes(b"not a pickle")
    assert "//p:a" in map(str, parsed.load(tmp_path, parse).targets) and len(calls) == 4
