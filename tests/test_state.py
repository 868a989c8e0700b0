"""The build state file (store/state.py): a no-op build answers from one indexed file, and
every guarantee of the per-file stores still holds (corruption, gc, old caches, concurrency)."""

from __future__ import annotations

import json
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


# -- the fast paths' rows (store/statefile.py): the no-op record, the memo, families, kept parses ---------

def test_the_fast_paths_rows_round_trip_and_go_together(tmp_path):
    from build_graph.store.statefile import StateFile

    rows = StateFile(tmp_path / STATE_FILE)
    rows.put_record("r1", b"record-1", b"memo-1", family="f")
    rows.put_record("q", b"answer")  # a query's record: no memo, no family pointer
    rows.put_parse("/ws", b"parse")
    again = StateFile(tmp_path / STATE_FILE, create=False)
    assert (again.record("r1"), again.memo("r1"), again.family("f")) == (b"record-1", b"memo-1", "r1")
    assert again.memo("q") is None and again.parse("/ws") == b"parse" and again.record("absent") is None
    rows.put_record("r1", b"record-2")  # a record written without a memo replaces the memo too
    assert (again.record("r1"), again.memo("r1")) == (b"record-2", None)
    rows.put_record("r1", None, family="f")  # a build that cannot be recorded drops the row and the pointer
    assert again.record("r1") is None and again.family("f") is None
    rows.drop_records()
    assert again.record("q") is None and again.parse("/ws") == b"parse"
    # A reader makes no file where none is, and writes nothing there.
    StateFile(tmp_path / "none" / STATE_FILE, create=False).put_record("r", b"x")
    assert not (tmp_path / "none").exists()


def test_an_older_schema_file_is_read_as_empty_and_never_written(tmp_path):
    from build_graph import noop
    from build_graph.store.statefile import SCHEMA, StateFile

    path = tmp_path / STATE_FILE
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE meta(name TEXT PRIMARY KEY, value TEXT)")
    db.execute("INSERT INTO meta VALUES ('schema', ?)", (str(int(SCHEMA) - 1),))
    db.execute("CREATE TABLE records(request TEXT PRIMARY KEY, record BLOB, memo BLOB)")
    db.execute("INSERT INTO records VALUES ('d', 'old', 'old')")
    db.commit()
    db.close()
    rows = StateFile(path)
    assert rows.record("d") is None and rows.memo("d") is None and not rows.usable
    rows.put_record("d", b"new", b"new")
    rows.put_parse("/ws", b"new")
    assert sqlite3.connect(path).execute("SELECT record FROM records").fetchall() == [("old",)]
    (tmp_path / "WORKSPACE.toml").write_text("")
    assert noop.Previous(noop.Request(tmp_path, "d", path)).record is None
    # The file of the schema before (its own name) is never opened: a new cache beside it starts empty.
    assert STATE_FILE != "state-v1.sqlite" and not StateFile(tmp_path / "state-v1.sqlite", create=False).record("d")


FAST = {"in.txt": "alpha\nbeta\n", **{k: v for k, v in CHAIN.items() if k != "in.txt"}}


def _aged(ws, seconds: float = 30):
    from test_noop import age
    age(ws.root, seconds)


def _sql(ws, sql: str, args: tuple = ()) -> list:
    with sqlite3.connect(ws.store / STATE_FILE) as db:
        return db.execute(sql, args).fetchall()


@requires_bwrap
def test_a_damaged_row_of_each_table_is_a_miss_without_a_traceback(make_ws):
    ws = make_ws(FAST)
    _aged(ws)
    first = ws.cli("build", "//p:b")
    assert first.rc == 0, first.output
    damages = [("records", "record", b"\x00garbage{"), ("records", "record", b"[1, 2]"),
               ("records", "record", b'{"root": 1, "format": 3}'), ("records", "memo", b"\x80"),
               ("records", "memo", b'{"format": 4, "entries": 7}'), ("families", "request", 12),
               ("parses", "parse", b"not json"), ("parses", "parse", b'{"inputs": 1}'),
               ("results", "result", b"{"), ("results", "tree", b'[["x"'), ("traces", "trace", b"[]")]
    for n, (table, column, value) in enumerate(damages):
        assert _sql(ws, f"SELECT COUNT(*) FROM {table}")[0][0] > 0, table
        _sql(ws, f"UPDATE {table} SET {column} = ?", (value,))
        if table == "families":  # read only for a request with no record of its own
            _sql(ws, "DELETE FROM records")
        ws.write({"in.txt": f"line {n}\n"})
        _aged(ws, 20 - n)
        run = ws.cli("build", "//p:b")
        assert run.rc == 0 and "Traceback" not in run.output, (table, column, run.output)
        assert ws.read_output("//p:b", "b.txt").strip() == "2", (table, column)  # a: the line twice
        again = ws.cli("build", "//p:b")  # and the next build records and answers again
        assert again.rc == 0 and "up to date" in again.stderr, (table, column, again.output)
    # Whole JSON of the right shape whose fields are not what a record holds: no traceback either.
    [(record,)] = _sql(ws, "SELECT record FROM records")
    for bad in ({"summary": {}}, {"links": {"x": 5}}, {"summary": {"outputs": {}, "text": 1}}):
        _sql(ws, "UPDATE records SET record = ?", (json.dumps({**json.loads(record), **bad}).encode(),))
        run = ws.cli("build", "//p:b")
        assert run.rc == 0 and "Traceback" not in run.output and "up to date" not in run.stderr, (bad, run.output)
        assert ws.read_output("//p:b", "b.txt").strip() == "2"


KILL_IN_THE_RECORD = """
import os, signal, sys
from build_graph.store import statefile
write = statefile.StateFile._write

def dying(self, statements):
    statements = [(sql, list(rows)) for sql, rows in statements]
    if any("INTO records" in sql for sql, _ in statements):
        db = self._conn()
        db.execute("BEGIN IMMEDIATE")
        for sql, rows in statements:
            db.executemany(sql, rows)
        os.kill(os.getpid(), signal.SIGKILL)  # the rows written, the transaction not committed
    return write(self, statements)

statefile.StateFile._write = dying
sys.argv[0] = "bgraph"
from build_graph.cli import run
run()
"""


@requires_bwrap
def test_a_build_killed_while_it_files_its_record_leaves_the_old_rows(make_ws):
    """A build killed between the writes of its record, its memo and its family's pointer (one
    transaction) leaves the last build's rows, all of them, and the next build is sound."""
    ws = make_ws(FAST)
    _aged(ws)
    assert ws.cli("build", "//p:b").rc == 0
    before = _sql(ws, "SELECT request, record, memo FROM records") + _sql(ws, "SELECT * FROM families")
    ws.write({"in.txt": "one\n"})
    _aged(ws, 20)
    killed = subprocess.run([sys.executable, "-c", KILL_IN_THE_RECORD, "-C", str(ws.root), "--cache-dir",
                             str(ws.cache), "build", "//p:b"], capture_output=True, text=True, env=hermetic_env(),
                            cwd=ws.root, timeout=120)
    assert killed.returncode == -9, killed.stdout + killed.stderr
    assert ws.read_output("//p:b", "b.txt").strip() == "2"  # it linked its outputs, then died
    assert _sql(ws, "SELECT request, record, memo FROM records") + _sql(ws, "SELECT * FROM families") == before
    run = ws.cli("build", "//p:b")  # the old record does not hold (in.txt changed): the memo path decides
    assert run.rc == 0 and "up to date" not in run.stderr, run.output
    assert ws.read_output("//p:b", "b.txt").strip() == "2"
    assert "up to date" in ws.cli("build", "//p:b").stderr


@requires_bwrap
def test_an_old_format_record_directory_in_the_cache_is_ignored(make_ws):
    """Records, memos and kept parses were JSON files under <cache>/v1/uptodate/: such a
    directory left by an older bgraph is neither read nor written."""
    from build_graph.store import uptodate

    ws = make_ws(FAST)
    _aged(ws)
    assert ws.cli("build", "//p:b").rc == 0
    [(request, record, memo)] = _sql(ws, "SELECT request, record, memo FROM records")
    [(family, _)] = _sql(ws, "SELECT * FROM families")
    old = ws.cache / "v1" / "uptodate"
    old.mkdir()
    raw = json.loads(record)
    # What the older bgraph wrote: the same record (format 2, a memo named by it) and its memo, family pointer, parse.
    (old / f"{request}.json").write_text(json.dumps({**raw, "format": 2, "memo": "m"}))
    (old / f"{request}.memo").write_text(json.dumps({**json.loads(memo), "format": 3, "name": "m"}))
    (old / f"{family}.last").write_text(request)
    (old / ("0" * 32 + ".parsed")).write_bytes(b"\x80")
    listing = {p.name: p.read_bytes() for p in old.iterdir()}
    _sql(ws, "DELETE FROM records")
    run = ws.cli("build", "//p:b")
    assert run.rc == 0 and "up to date" not in run.stderr and "not replanned" not in run.stderr, run.output
    assert {p.name: p.read_bytes() for p in old.iterdir()} == listing  # never written either
    assert uptodate.Record.from_bytes(_sql(ws, "SELECT record FROM records")[0][0]) is not None
