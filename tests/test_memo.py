"""The per-target memo (store/memo.py, noop.Previous.reuse, build_run.BuildRun._reused): after an
edit of file contents only, targets none of whose sources changed and whose dependencies'
outputs are as they were are taken from the last build unplanned; anything else takes the full
path, and the outputs are always those a full build gives."""

from __future__ import annotations

import json
import os
import sqlite3
import time

from bgraph_testlib import requires_bwrap
from test_noop import age, build

from build_graph.incremental import filestate
from build_graph.model import FileEntry, TargetOutput, Tree
from build_graph.store import memo, uptodate
from build_graph.store.statefile import STATE_FILE

pytestmark = requires_bwrap

FILES = {
    "a.txt": "b\na\n",
    "c.txt": "c\n",
    "README": "not read by any target\n",
    "targets/p.toml": '[a]\nkind = "genrule"\nsrcs = ["a.txt"]\nouts = ["a.txt"]\n'
                      'cmd = "sort -u $SRC/a.txt > $OUT/a.txt"\n\n'
                      '[b]\nkind = "genrule"\nouts = ["b.txt"]\ndeps = { a = ":a" }\n'
                      'cmd = "wc -l < $IN_A/a.txt > $OUT/b.txt"\n\n'
                      '[c]\nkind = "genrule"\nsrcs = ["c.txt"]\nouts = ["c.txt"]\n'
                      'cmd = "cp $SRC/c.txt $OUT/c.txt"\n\n'
                      '[top]\nkind = "genrule"\nouts = ["top.txt"]\ndeps = { b = ":b", c = ":c" }\n'
                      'cmd = "cat $IN_B/b.txt $IN_C/c.txt > $OUT/top.txt"\n',
}


def reused(run) -> int:
    """How many targets the build took from the memo (its summary line says, when any)."""
    line = next(l for l in run.stderr.splitlines() if "executed" in l)
    return int(line.split("(")[1].split()[0]) if "unchanged since the last build" in line else 0


def edited(ws, files: dict[str, str]):
    """Edit `files` (another stamp, old enough to be recorded) and build."""
    ws.write(files)
    past = time.time() - 20
    for name in files:
        os.utime(ws.root / name, (past, past))
    time.sleep(filestate.RACY_NS / 1e9 + 0.05)  # ctime cannot be put back: wait out the racy window
    return build(ws, "//p:top")


def ready(make_ws):
    ws = make_ws(FILES)
    age(ws.root)
    first = build(ws, "//p:top")
    assert "executed 4" in first.stderr and reused(first) == 0
    return ws


def test_an_edit_replans_only_what_it_reaches(make_ws):
    ws = ready(make_ws)
    run = edited(ws, {"c.txt": "C\n"})
    # :c and :top ran; :a, :b and the shell toolchain were taken as they were (neither planned nor looked up)
    assert "executed 2" in run.stderr and reused(run) == 3, run.stderr
    assert ws.read_output("//p:top", "top.txt") == "2\nC\n"
    run = edited(ws, {"a.txt": "x\ny\nz\n"})
    assert "executed 3" in run.stderr and reused(run) == 2  # :a, :b, :top; :c and the toolchain reused
    assert ws.read_output("//p:top", "top.txt") == "3\nC\n"


def test_json_takes_the_memo_and_lists_every_action(make_ws):
    ws = ready(make_ws)
    full = ws.cli("build", "--json", "//p:top")  # the no-op answer: every action, each a hit
    ws.write({"c.txt": "J\n"})
    past = time.time() - 20
    os.utime(ws.root / "c.txt", (past, past))
    run = ws.cli("build", "--json", "//p:top")
    assert run.rc == 0, run.output
    summary = json.loads(run.stdout)
    assert summary["targets_reused"] == 3 and summary["executed"] == 2, summary
    listed = {(a["label"], a["name"]): a["status"] for a in summary["actions"]}
    assert listed.keys() == {(a["label"], a["name"]) for a in json.loads(full.stdout)["actions"]}
    assert next(s for (label, _), s in listed.items() if label == "//p:a") == "hit"
    assert summary["hits"] == sum(s == "hit" for s in listed.values())


def test_an_output_that_did_not_change_cuts_off_its_dependents(make_ws):
    ws = ready(make_ws)
    run = edited(ws, {"a.txt": "a\nb\na\n"})  # sorted and unique: the same a.txt
    # :a ran to the same output: its dependent is cut off by the rebuilder (the one answer, with
    # its trace); the targets past it are reused whole.
    assert "executed 1" in run.stderr and "cut off 1" in run.stderr and reused(run) == 3, run.stderr
    assert ws.read_output("//p:top", "top.txt") == "2\nc\n"


def test_a_file_no_target_reads_changes_nothing(make_ws):
    ws = ready(make_ws)
    run = edited(ws, {"README": "edited\n"})
    assert "executed 0" in run.stderr and reused(run) == 5


def test_an_edited_target_file_replans_only_the_targets_whose_definitions_changed(make_ws):
    ws = ready(make_ws)
    toml = FILES["targets/p.toml"].replace("cp $SRC/c.txt", "cat $SRC/c.txt $SRC/c.txt >")
    run = edited(ws, {"targets/p.toml": toml})
    # :c (redefined) and :top ran; :a, :b and the shell toolchain are taken as they were
    assert reused(run) == 3 and "executed 2" in run.stderr, run.stderr
    assert ws.read_output("//p:top", "top.txt") == "2\nc\nc\n"
    # A comment, the tables in another order: every definition is what it was.
    reordered = toml.split("\n\n")
    run = edited(ws, {"targets/p.toml": "# reordered\n" + "\n\n".join(reordered[::-1]) + "\n"})
    assert reused(run) == 5 and "executed 0" in run.stderr, run.stderr
    # A new dependency of :b: the graph is built afresh, :b and :top run, :a and :c are reused.
    toml = toml.replace('deps = { a = ":a" }', 'deps = { a = ":a", c = ":c" }')
    run = edited(ws, {"targets/p.toml": toml.replace("wc -l < $IN_A/a.txt", "cat $IN_C/c.txt $IN_A/a.txt | wc -l")})
    assert reused(run) == 3 and "executed 2" in run.stderr, run.stderr
    assert ws.read_output("//p:top", "top.txt") == "4\nc\nc\n"


def test_a_cycle_made_by_a_target_file_edit_is_an_error_before_anything_runs(make_ws):
    ws = ready(make_ws)
    toml = FILES["targets/p.toml"].replace('deps = { a = ":a" }', 'deps = { a = ":a", t = ":top" }')
    ws.write({"targets/p.toml": toml, "c.txt": "x\n"})
    run = ws.cli("build", "//p:top")
    assert run.rc != 0 and "cycle" in run.stderr and "Traceback" not in run.output, run.output
    assert "executed" not in run.stderr, run.stderr
    assert ws.read_output("//p:top", "top.txt") == "2\nc\n"


def test_an_edited_workspace_file_or_added_file_takes_the_full_path(make_ws):
    ws = ready(make_ws)
    workspace = (ws.root / "WORKSPACE.toml").read_text()
    run = edited(ws, {"WORKSPACE.toml": workspace + "\n# edited\n", "c.txt": "w\n"})
    assert reused(run) == 0 and "executed 2" in run.stderr, run.stderr
    run = edited(ws, {"new.txt": "added\n", "c.txt": "d\n"})
    assert reused(run) == 0 and ws.read_output("//p:top", "top.txt") == "2\nd\n"


def test_a_first_build_of_other_targets_takes_the_last_builds_memo(make_ws):
    ws = make_ws(FILES)
    age(ws.root)
    first = build(ws, "//p:c")
    assert "executed 1" in first.stderr and reused(first) == 0, first.stderr
    run = build(ws, "//p:top")  # no record of its own: :c and the shell toolchain come from //p:c's memo
    assert "up to date" not in run.stderr and "executed 3" in run.stderr and reused(run) == 2, run.stderr
    assert ws.read_output("//p:top", "top.txt") == "2\nc\n"
    # Fewer targets than the memo's build, one of them edited: only what this request needs runs.
    ws.write({"a.txt": "q\n", "c.txt": "C\n"})
    past = time.time() - 20
    for name in ("a.txt", "c.txt"):
        os.utime(ws.root / name, (past, past))
    run = build(ws, "//p:b")
    assert "executed 2" in run.stderr and reused(run) == 1, run.stderr  # :a and :b; :c is not needed
    assert ws.read_output("//p:b", "b.txt") == "1\n"
    run = build(ws, "//p:top")  # its own record (older than //p:b's): :a and :b are hits, :c and :top run
    assert "executed 2" in run.stderr and "cache hits 2" in run.stderr and reused(run) == 1, run.stderr
    assert ws.read_output("//p:top", "top.txt") == "1\nC\n"


def test_the_last_builds_memo_serves_a_build_run_from_another_directory(make_ws):
    """The directory bgraph is run from is no part of the family: a target's plan never reads it."""
    import subprocess
    import sys

    from bgraph_testlib import hermetic_env

    ws = make_ws(FILES)
    age(ws.root)
    assert reused(build(ws, "//p:c")) == 0
    proc = subprocess.run([sys.executable, "-m", "build_graph", "-C", str(ws.root), "--cache-dir", str(ws.cache),
                           "build", "//p:top"], capture_output=True, text=True, timeout=120,
                          env=hermetic_env(ws.env), cwd=ws.root / "targets")
    assert proc.returncode == 0, proc.stderr
    assert "executed 3" in proc.stderr and reused(proc) == 2, proc.stderr
    assert ws.read_output("//p:top", "top.txt") == "2\nc\n"


def test_a_build_just_after_an_edit_keeps_the_reuse_for_the_next(make_ws):
    ws = ready(make_ws)
    ws.write({"c.txt": "h\n"})  # written now: its stamp cannot be trusted yet ("racily clean")
    run = build(ws, "//p:top")
    assert "executed 2" in run.stderr and reused(run) == 3, run.stderr
    # Recorded, with c.txt as always changed: only :c is checked again (a hit), the rest is reused.
    run = build(ws, "//p:top")
    assert "up to date" not in run.stderr and "executed 0" in run.stderr and reused(run) == 4, run.stderr
    assert ws.read_output("//p:top", "top.txt") == "2\nh\n"


def test_a_failure_among_the_visited_targets_is_reported_and_nothing_is_kept(make_ws):
    ws = ready(make_ws)
    toml = FILES["targets/p.toml"].replace("cp $SRC/c.txt $OUT/c.txt", "grep -v BAD $SRC/c.txt > $OUT/c.txt")
    ws.write({"targets/p.toml": toml, "c.txt": "c\n"})
    age(ws.root, 25)
    build(ws, "//p:top")  # the full path (a target file changed), recorded
    run = ws.cli("build", "//p:top")
    assert "up to date" in run.stderr
    ws.write({"c.txt": "BAD\n"})  # grep selects nothing: :c fails
    failed = ws.cli("build", "//p:top")
    assert failed.rc != 0 and ":c" in failed.stderr, failed.output
    assert ws.read_output("//p:top", "top.txt") == "2\nc\n"  # the last good output stays linked
    run = edited(ws, {"c.txt": "fine\n"})
    assert ws.read_output("//p:top", "top.txt") == "2\nfine\n" and "executed 2" in run.stderr, run.stderr


def test_a_collected_cache_takes_the_full_path(make_ws):
    ws = ready(make_ws)
    build(ws, "//p:c")  # another request: :top's output stays rooted, :a's and :b's do not
    gc = ws.cli("cache", "gc")
    assert gc.rc == 0 and "removed 0 action-cache entries, 0 blobs" not in gc.stdout, gc.output
    assert not _rows(ws, "SELECT memo FROM records")  # none could hold: dropped with what was collected
    run = edited(ws, {"c.txt": "e\n"})
    assert reused(run) == 0 and ws.read_output("//p:top", "top.txt") == "2\ne\n"


def _rows(ws, sql: str, args: tuple = ()) -> list:
    """Rows of the workspace's cache's state file (store/statefile.py), written back by `sql` when it changes them."""
    [path] = (ws.cache / "v1").glob(f"*/{STATE_FILE}")
    with sqlite3.connect(path) as db:
        return db.execute(sql, args).fetchall()


def test_a_damaged_or_foreign_memo_is_ignored(make_ws):
    ws = ready(make_ws)
    _rows(ws, "UPDATE records SET memo = ?", (b"\x80not JSON",))
    run = edited(ws, {"c.txt": "f\n"})
    assert reused(run) == 0 and ws.read_output("//p:top", "top.txt") == "2\nf\n"
    # a memo of another bgraph (another format), or one whose entries are not entries
    [(row,)] = _rows(ws, "SELECT memo FROM records")
    for bad in ({**json.loads(row), "format": memo.FORMAT - 1}, {"format": memo.FORMAT, "entries": {"//p:a": [1]}}):
        _rows(ws, "UPDATE records SET memo = ?", (json.dumps(bad).encode(),))
        run = edited(ws, {"c.txt": f"g{len(str(bad))}\n"})
        assert reused(run) == 0 and ws.read_output("//p:top", "top.txt") == f"2\ng{len(str(bad))}\n"


def _entry(*sources: str) -> memo.Entry:
    tree = Tree({"o": FileEntry("0" * 64, 1)})
    return memo.Entry(sources, TargetOutput(tree), (("run", "Genrule", "k" * 64),))


def test_a_collection_after_the_check_stops_the_reuse(tmp_path):
    generation = uptodate.generation_path(tmp_path)
    uptodate.bump_generation(tmp_path)
    reuse = memo.Reuse({"//p:a": _entry("a.txt")}, {"b.txt"}, generation, uptodate.stamp_of(generation))
    assert reuse.still_valid() and reuse.entry("//p:a") is not None and reuse.keys() == ["k" * 64]
    uptodate.bump_generation(tmp_path)  # `cache gc` removed something in between
    assert not reuse.still_valid()


def test_an_entry_is_reused_only_while_its_sources_and_the_scan_allow(tmp_path):
    entries = {"//p:a": _entry("a.txt"), "//p:v": _entry("__pycache__/x.pyc")}
    marked = memo.decode(memo.encode(entries, {"a.txt": [1, 2, 3]}))
    assert not marked["//p:a"].volatile and marked["//p:v"].volatile  # its source is outside the scan
    reuse = memo.Reuse(marked, {"a.txt"}, tmp_path / "generation", None)
    assert reuse.entry("//p:a") is None and reuse.entry("//p:v") is None
    assert memo.Reuse(marked, {"c.txt"}, tmp_path / "generation", None).entry("//p:a") is marked["//p:a"]


def test_a_memo_that_cannot_be_kept_or_read_is_none():
    assert memo.encode({"//p:a": _entry("a.txt")}, {"a.txt": [1]}) is not None
    unkept = memo.Entry(("a.txt",), TargetOutput(Tree({}), {"x": object()}), ())
    assert memo.encode({"//p:a": unkept}, {}) is None  # not JSON: no memo (the full path next time)
    assert all(memo.decode(bad) is None for bad in (None, b"", b"\x80", b"[]", b'{"format": 4}'))


def test_the_memo_is_json_and_round_trips_outputs_with_trees(tmp_path):
    """Issue 33 item 7: the memo is data (JSON), not a pickle; an output's info holding a tree
    (a system root) or a tuple decodes equal to what was saved."""
    system = Tree({"usr/bin/sh": FileEntry("1" * 64, 3, True), "usr/lib": None and FileEntry("2" * 64, 1)
                   or FileEntry("2" * 64, 1)})
    out = TargetOutput(Tree({"o": FileEntry("0" * 64, 1)}), {"system_root": system, "archs": ("12.0a",), "n": [1]})
    entry = memo.Entry(("a.txt",), out, (("run", "Genrule", "k" * 64),), ("//p:d",),
                       None, definition="d")
    data = memo.encode({"//p:x": entry}, {"a.txt": [1]})
    assert json.loads(data)["format"] == memo.FORMAT
    assert memo.decode(data) == {"//p:x": entry}


def test_a_dependency_configured_for_another_platform_is_another_node(make_ws):
    """X depends on G; G gains `platform = "aarch64"`, and //p:G (aarch64) is already in the memo
    (W built it). X's edge now leads to that node: X must be rebuilt from it, not taken whole
    because the node it reaches now is as the memo left it."""
    toolchains = ('[host]\nkind = "host_tools"\npaths = ["/usr"]\n'
                  'tools = ["/usr/bin/sh", "/usr/bin/cp", "/usr/bin/patch", "/usr/bin/python3"]\n')
    files = {"g/__init__.py": "X = 1\n", "targets/toolchains.toml": toolchains,
             "targets/p.toml": '[G]\nkind = "py_wheel"\ndistribution = "g"\nversion = "1"\nsrcs = ["g/__init__.py"]\n\n'
                               '[W]\nkind = "py_wheel"\ndistribution = "w"\nversion = "1"\nplatform = "aarch64"\n'
                               'dirs = { "inner" = ":G" }\n\n'
                               '[X]\nkind = "genrule"\nouts = ["x.txt"]\ndeps = { g = ":G" }\n'
                               'cmd = "ls $IN_G > $OUT/x.txt"\n'}
    ws = make_ws(files)
    age(ws.root)
    build(ws, "//p:X", "//p:W")
    assert "x86_64" in ws.read_output("//p:X", "x.txt")
    toml = (ws.root / "targets/p.toml").read_text().replace('srcs = ["g/__init__.py"]\n',
                                                             'srcs = ["g/__init__.py"]\nplatform = "aarch64"\n')
    ws.write({"targets/p.toml": toml})
    past = time.time() - 20
    os.utime(ws.root / "targets/p.toml", (past, past))
    time.sleep(filestate.RACY_NS / 1e9 + 0.05)
    build(ws, "//p:X", "//p:W")
    listed = ws.read_output("//p:X", "x.txt")
    assert "aarch64" in listed and "x86_64" not in listed, listed


def test_a_target_planned_again_on_the_memo_path_never_globs_the_cache(make_ws, tmp_path):
    """With the cache inside the workspace, a glob never reaches it, on the full path and on
    the memo path alike (a target the memo does not take is expanded again: that expansion
    once forgot the cache, and `**/*.log` read the cache's build logs)."""
    ws = make_ws({"src/one.log": "x\n", "src/a.txt": "a\n",
                  "targets/p.toml": '[list]\nkind = "genrule"\nsrcs = ["**/*.log"]\nouts = ["files.lst"]\n'
                                    'cmd = "cd $SRC && find . -type f | sort > $OUT/files.lst"\n\n'
                                    '[g]\nkind = "genrule"\nsrcs = ["src/a.txt"]\nouts = ["o.txt"]\n'
                                    'cmd = "cp $SRC/src/a.txt $OUT/o.txt"\n'},
                 name="wsc", cache=tmp_path / "wsc" / "cache")
    age(ws.root)
    build(ws, "//p:list", "//p:g")
    assert ws.read_output("//p:list", "files.lst") == "./src/one.log\n"
    ws.write({"src/one.log": "y\n"})
    past = time.time() - 20
    os.utime(ws.root / "src/one.log", (past, past))
    time.sleep(filestate.RACY_NS / 1e9 + 0.05)
    run = build(ws, "//p:list", "//p:g")
    assert reused(run) >= 1, run.stderr  # the memo path: :g and the toolchain taken as they were
    assert ws.read_output("//p:list", "files.lst") == "./src/one.log\n"
