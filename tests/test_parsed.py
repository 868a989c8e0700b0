"""The parsed workspace kept between commands (store/parsed.py): kept in the cache as JSON, a row
of its state file (never a pickle, never in the workspace), used only while WORKSPACE.toml, every targets/**/*.toml and
bgraph's code keep their file-state stamps."""

from __future__ import annotations

import os
import pickle
import time
from pathlib import Path

from bgraph_testlib import REPO, TOOLCHAINS_TOML, WORKSPACE_TOML
from build_graph.incremental import filestate
from build_graph.store import parsed
from build_graph.store.memo import definition_of
from build_graph.store.statefile import STATE_FILE, StateFile
from build_graph.workspace import load

FILES = {"WORKSPACE.toml": WORKSPACE_TOML, "targets/toolchains.toml": TOOLCHAINS_TOML,
         "targets/p.toml": '[a]\nkind = "genrule"\nouts = ["a"]\ncmd = "true"\n'}


def settle() -> None:
    """Wait out the racy-clean window (ctime cannot be set back)."""
    time.sleep(filestate.RACY_NS / 1e9 + 0.05)


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
    ws, state = tmp_path / "ws", tmp_path / "cache" / STATE_FILE
    write(ws, FILES)
    settle()
    parse, calls = counting()
    first = parsed.load(ws, parse, state)
    again = parsed.load(ws, parse, state)
    assert len(calls) == 1 and list(again.targets) == list(first.targets)
    assert not (ws / "bgraph-out").exists()  # nothing is kept in the workspace
    write(ws, {"targets/p.toml": FILES["targets/p.toml"] + '\n[b]\nkind = "genrule"\nouts = ["b"]\ncmd = "true"\n'},
          age=20)
    settle()
    assert {"//p:a", "//p:b"} <= set(map(str, parsed.load(ws, parse, state).targets)) and len(calls) == 2
    write(ws, {"targets/q/more.toml": '[c]\nkind = "genrule"\nouts = ["c"]\ncmd = "true"\n'}, age=10)
    settle()
    assert "//q/more:c" in map(str, parsed.load(ws, parse, state).targets) and len(calls) == 3
    parsed.load(ws, parse, state)
    assert len(calls) == 3


def test_a_same_size_rewrite_with_its_mtime_put_back_is_seen(tmp_path):
    ws, state = tmp_path / "ws", tmp_path / "cache" / STATE_FILE
    write(ws, FILES)
    settle()
    parse, calls = counting()
    parsed.load(ws, parse, state)
    target = ws / "targets/p.toml"
    st = target.stat()
    with open(target, "r+") as f:  # in place: the same inode and size
        f.write(FILES["targets/p.toml"].replace('"a"', '"z"'))
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
    settle()
    ws_now = parsed.load(ws, parse, state)
    assert len(calls) == 2 and ws_now.targets[next(iter(ws_now.targets))].attrs is not None
    assert any(t.attrs.model_dump().get("outs") == ["z"] for t in ws_now.targets.values())


def test_a_fresh_file_or_a_damaged_kept_parse_means_parsing(tmp_path):
    ws, state = tmp_path / "ws", tmp_path / "cache" / STATE_FILE
    write(ws, FILES, age=0)  # written now: its stamp may not change on the next write
    parse, calls = counting()
    parsed.load(ws, parse, state)
    parsed.load(ws, parse, state)
    assert len(calls) == 2
    settle()
    parsed.load(ws, parse, state)  # parsed, and kept
    assert len(calls) == 3 and StateFile(state).parse(str(ws.resolve())) is not None
    for n, damaged in enumerate((b"not JSON", b'{"inputs": 1}', b"[]"), start=4):
        StateFile(state).put_parse(str(ws.resolve()), damaged)
        assert "//p:a" in map(str, parsed.load(ws, parse, state).targets) and len(calls) == n


def test_a_reader_keeps_no_parse_in_a_cache_with_no_state_file(tmp_path):
    """A command that only reads (`why`, `explain` before any build) makes no state file."""
    ws, state = tmp_path / "ws", tmp_path / "cache" / STATE_FILE
    write(ws, FILES)
    settle()
    parse, calls = counting()
    parsed.load(ws, parse, state, create=False)
    parsed.load(ws, parse, state, create=False)
    assert len(calls) == 2 and not state.exists()


class _Boom:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_a_pickle_shipped_in_the_workspace_is_never_loaded(tmp_path, monkeypatch):
    """Issue 33 item 7: `bgraph-out/.uptodate/workspace.pickle` was unpickled by every command."""
    ws, state = tmp_path / "ws", tmp_path / "cache" / STATE_FILE
    write(ws, FILES)
    (ws / "bgraph-out" / ".uptodate").mkdir(parents=True)
    (ws / "bgraph-out" / ".uptodate" / "workspace.pickle").write_bytes(pickle.dumps(_Boom()))
    monkeypatch.chdir(tmp_path)
    parse, calls = counting()
    parsed.load(ws, parse, state)
    parsed.load(ws, parse, None)
    assert not (tmp_path / "PWNED").exists()
    assert not any(p.suffix == ".pickle" for p in state.parent.rglob("*"))


def test_the_repository_workspace_round_trips_exactly(tmp_path):
    """A kept parse validates to the same models: every target's definition digest (what the memo
    compares) is the one of a fresh parse."""
    rows, root = StateFile(tmp_path / "cache" / STATE_FILE), Path(REPO).resolve()
    fresh = load(Path(REPO))
    parsed._keep(rows, parsed._inputs(root), fresh)
    kept = parsed._read(rows.parse(str(root)), parsed._inputs(root))
    assert kept is not None
    assert kept.model == fresh.model
    assert {str(k): definition_of(t) for k, t in kept.targets.items()} == \
           {str(k): definition_of(t) for k, t in fresh.targets.items()}
