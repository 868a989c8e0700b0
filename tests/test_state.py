"""The build state file (store/state.py): a no-op build answers from one indexed file, and
every guarantee of the per-file stores still holds (corruption, gc, old caches, concurrency)."""

from __future__ import annotations

import sqlite3
import subprocess
import sys

from bgraph_testlib import action, hermetic_env, requires_bwrap, statuses
from build_graph.model import ActionResult, Digester, FileEntry, SymlinkEntry, DirEntry, Tree
from build_graph.store.state import STATE_FILE, BuildState, decode_tree, encode_tree

B3 = Digester("blake3")

CHAIN = {
    "in.txt": "alpha\nbeta\n",
    "targets/p.toml": '[a]\nkind = "genrule"\nsrcs = ["in.txt"]\nouts = ["a.txt"]\n'
                      'cmd = "cat $SRC/in.txt $SRC/in.txt > $OUT/a.txt"\n\n'
                      '[b]\nkind = "genrule"\nouts = ["b.txt"]\ndeps = { a = ":a" }\n'
                      'cmd = "wc -l < $IN_A/a.txt > $OUT/b.txt"\n',
}


def test_rows_round_trip_and_survive_a_new_process(tmp_path):
    tree = Tree({"a/x": FileEntry("1" * 64, 3, True), "l": SymlinkEntry("a/x"), "e": DirEntry()})
    assert decode_tree(encode_tree(tree)) == tree
    result = ActionResult(tree.digest(B3), 0, "o" * 64, "e" * 64, 0.5, 3)
    state = BuildState(tmp_path / STATE_FILE)
    state.put_result("k" * 64, result, tree)
    state.put_trace("//p:a", "d" * 64, b'{"actions": {}}')
    assert state.result("k" * 64, B3) == (result, tree)  # pending rows answer before the flush
    state.close()
    again = BuildState(tmp_path / STATE_FILE)
    found, found_tree = again.result("k" * 64, B3)
    assert found == result and found_tree == tree and found_tree.digest(B3) == result.output_tree
    assert again.trace("//p:a") == {"actions": {}} and again.trace_digest("//p:a") == "d" * 64
    again.drop_results(["k" * 64])
    assert again.result("k" * 64, B3) is None


def test_a_state_file_of_another_schema_is_not_read(tmp_path):
    db = sqlite3.connect(tmp_path / STATE_FILE)
    db.execute("CREATE TABLE meta(name TEXT PRIMARY KEY, value TEXT)")
    db.execute("INSERT INTO meta VALUES ('schema', '999')")
    db.execute("CREATE TABLE results(key TEXT PRIMARY KEY, result BLOB, tree BLOB)")
    db.execute("INSERT INTO results VALUES ('k', 'garbage', NULL)")
    db.commit()
    db.close()
    state = BuildState(tmp_path / STATE_FILE)
    assert state.result("k", B3) is None and not state.usable
    state.put_trace("//p:a", "d", b"{}")
    state.close()  # writes nothing into a file it does not understand
    assert sqlite3.connect(tmp_path / STATE_FILE).execute("SELECT COUNT(*) FROM results").fetchone() == (1,)


@requires_bwrap
def test_a_no_op_reads_results_from_the_state_file_alone(make_ws, monkeypatch):
    ws = make_ws(CHAIN)
    assert ws.build("//p:b").rc == 0
    from build_graph.store.action_cache import LocalActionCache
    from build_graph.store.cas import LocalCas

    def per_file(*_a, **_k):
        raise AssertionError("a no-op read a per-target file")
    monkeypatch.setattr(LocalActionCache, "get", per_file)
    monkeypatch.setattr(LocalCas, "get_tree", per_file)
    monkeypatch.setattr("build_graph.store.trace.Trace._path", per_file)
    result = ws.engine_build("//p:b")
    assert not result.failures and result.count("hit") == 2 and result.count("executed") == 0


@requires_bwrap
def test_a_row_whose_blobs_were_collected_is_a_miss(make_ws):
    ws = make_ws(CHAIN)
    assert ws.build("//p:a").rc == 0
    (ws.root / "bgraph-out" / "p" / "a").unlink()  # no root keeps a's output now
    gc = ws.cli("cache", "gc", "--max-size", "0")
    assert gc.rc == 0 and "kept 0 entries" in gc.stdout, gc.stdout + gc.stderr
    rows = sqlite3.connect(ws.store / STATE_FILE).execute("SELECT COUNT(*) FROM results").fetchone()
    assert rows == (0,)  # gc forgot the rows of what it removed
    run = ws.build("//p:a")
    assert run.rc == 0 and action(run.json, "//p:a")["status"] == "executed"


@requires_bwrap
def test_a_cache_from_before_the_state_file_is_explained_from_its_trace_files(make_ws):
    ws = make_ws(CHAIN)
    assert ws.build("//p:b").rc == 0
    # Make the cache look like one an older bgraph wrote: traces as files, no state file.
    from build_graph.store.trace import Trace
    trace = Trace(ws.store, ws.cache / "v1" / "tmp")
    old = {label: trace.load(label) for label in trace.labels()}
    trace.state.close()
    (ws.store / STATE_FILE).unlink()
    for suffix in ("-wal", "-shm"):
        (ws.store / (STATE_FILE + suffix)).unlink(missing_ok=True)
    (ws.store / "trace").mkdir()
    import json
    from urllib.parse import quote
    for label, data in old.items():
        (ws.store / "trace" / f"{quote(label, safe='')}.json").write_text(json.dumps(data))
    ws.write({"in.txt": "alpha\ngamma\n"})
    run = ws.build("//p:b")
    assert run.rc == 0
    assert "in.txt" in action(run.json, "//p:a")["reason"]  # the old trace named the change
    assert ws.build("//p:b").json["executed"] == 0


@requires_bwrap
def test_concurrent_builds_share_the_state_file(make_ws):
    files = dict(CHAIN)
    files["targets/q.toml"] = "".join(
        f'[t{i}]\nkind = "genrule"\nouts = ["t.txt"]\ncmd = "sleep 0.2; echo {i} > $OUT/t.txt"\n\n' for i in range(6))
    ws = make_ws(files)
    procs = [subprocess.Popen([sys.executable, "-m", "build_graph", "-C", str(ws.root), "--cache-dir", str(ws.cache),
                               "build", "--json", *targets], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=hermetic_env())
             for targets in (["//p:b", "//q:t0", "//q:t1", "//q:t2"], ["//q:t3", "//q:t4", "//q:t5", "//q:t1"])]
    for p in procs:
        _out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    again = ws.build("//p:b", *(f"//q:t{i}" for i in range(6)))
    assert again.rc == 0 and again.json["executed"] == 0
    assert set(statuses(again.json).values()) == {"hit"}


def test_a_trace_kept_apart_is_recorded_where_no_directory_was(tmp_path):
    """A named build variant keeps its trace under <cache>/.../variants/<hash>/ (variants.py),
    a directory its first build makes."""
    from build_graph.store.trace import Trace
    apart = tmp_path / "v1" / "blake3" / "variants" / "abc"
    Trace(apart, tmp_path).save("//p:a", {"actions": {"x": 1}})
    assert Trace(apart, tmp_path).load("//p:a") == {"actions": {"x": 1}}
