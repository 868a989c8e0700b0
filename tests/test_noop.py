"""The no-op record (noop.py, store/uptodate.py): an unchanged request is answered without
loading the workspace, and every change that could alter a build's result takes the full path."""

from __future__ import annotations

import mmap
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from bgraph_testlib import requires_bwrap
from build_graph import noop
from build_graph.incremental import filestate
from build_graph.store import uptodate
from build_graph.store.statefile import STATE_FILE, StateFile

pytestmark = requires_bwrap

FILES = {
    "in.txt": "alpha\nbeta\n",
    "srcs/x.txt": "x\n",
    "targets/p.toml": '[a]\nkind = "genrule"\nsrcs = ["in.txt"]\nouts = ["a.txt"]\n'
                      'cmd = "cat $SRC/in.txt $SRC/in.txt > $OUT/a.txt"\n\n'
                      '[b]\nkind = "genrule"\nouts = ["b.txt"]\ndeps = { a = ":a" }\n'
                      'cmd = "wc -l < $IN_A/a.txt > $OUT/b.txt"\n\n'
                      '[g]\nkind = "genrule"\nsrcs = ["srcs/*.txt"]\nouts = ["n.txt"]\n'
                      'cmd = "ls $SRC/srcs | wc -l > $OUT/n.txt"\n',
}
UP_TO_DATE = "up to date: no input changed"


def age(root: Path, seconds: float = 30) -> None:
    """Date every file back, as an edit made a while before the build would be, and wait out the
    racy-clean window: a file changed (mtime or ctime) within filestate.RACY_NS of a build is never
    trusted by its stamp (the test would only see full paths), and ctime cannot be set back."""
    past = time.time() - seconds
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            os.utime(os.path.join(dirpath, name), (past, past), follow_symlinks=False)
    time.sleep(filestate.RACY_NS / 1e9 + 0.05)


def records(ws) -> list[bytes]:
    """The no-op records kept for this workspace's requests (rows of its cache's state file)."""
    return [r for p in (ws.cache / "v1").glob(f"*/{STATE_FILE}")
            for (r,) in sqlite3.connect(p).execute("SELECT record FROM records")]


def build(ws, *targets: str):
    run = ws.cli("build", *targets)
    assert run.rc == 0, run.output
    return run


def ready(make_ws, *targets: str):
    """A workspace built once (full path, record written) and aged."""
    ws = make_ws(FILES)
    age(ws.root)
    first = build(ws, *targets)
    assert UP_TO_DATE not in first.stderr and "executed" in first.stderr
    return ws


def test_an_unchanged_build_is_answered_from_the_record(make_ws):
    ws = ready(make_ws, "//p:b")
    again = build(ws, "//p:b")
    assert UP_TO_DATE in again.stderr and "executed 0, cache hits" in again.stderr
    assert ws.read_output("//p:b", "b.txt").strip() == "4"
    # Another request (another target) has its own record: the first time, it takes the full path.
    assert UP_TO_DATE not in build(ws, "//p:a").stderr


def test_an_edited_source_rebuilds_and_is_seen(make_ws):
    ws = ready(make_ws, "//p:b")
    ws.write({"in.txt": "one\n"})
    age(ws.root, 20)  # a different stamp, old enough to record
    run = build(ws, "//p:b")
    assert UP_TO_DATE not in run.stderr and "executed 2" in run.stderr  # :a ran, :b ran (1 line -> 2)
    assert ws.read_output("//p:b", "b.txt").strip() == "2"
    assert UP_TO_DATE in build(ws, "//p:b").stderr


def test_an_added_file_a_glob_reads_rebuilds(make_ws):
    ws = ready(make_ws, "//p:g")
    ws.write({"srcs/y.txt": "y\n"})
    age(ws.root, 20)
    assert UP_TO_DATE not in build(ws, "//p:g").stderr
    assert ws.read_output("//p:g", "n.txt").strip() == "2"


def test_a_source_under_a_directory_the_scan_leaves_out_is_never_taken_as_unchanged(make_ws):
    """The scan skips .git/ and __pycache__/ (their churn would spoil every record), so a target
    that reads a file there (a version stamped from .git/HEAD) must not be answered from the record:
    the record takes such a source as always changed, and the build replans that target."""
    files = {**FILES, ".git/HEAD": "ref: refs/heads/main\n", "py/__pycache__/data.txt": "one\n",
             "targets/v.toml": '[version]\nkind = "genrule"\nsrcs = [".git/HEAD", "py/__pycache__/data.txt"]\nouts = ["v.txt"]\n'
                               'cmd = "cat $SRC/.git/HEAD $SRC/py/__pycache__/data.txt > $OUT/v.txt"\n'}
    ws = make_ws(files)
    age(ws.root)
    build(ws, "//v:version")
    assert UP_TO_DATE not in build(ws, "//v:version").stderr  # nothing changed: the target is replanned, a hit
    ws.write({".git/HEAD": "ref: refs/heads/release\n", "py/__pycache__/data.txt": "two\n"})
    age(ws.root, 20)
    run = build(ws, "//v:version")
    assert UP_TO_DATE not in run.stderr and "executed 1" in run.stderr, run.stderr
    assert ws.read_output("//v:version", "v.txt") == "ref: refs/heads/release\ntwo\n"
    # Other requests keep their records.
    build(ws, "//p:a")
    assert UP_TO_DATE in build(ws, "//p:a").stderr


def test_an_edited_target_file_rebuilds(make_ws):
    ws = ready(make_ws, "//p:a")
    toml = (ws.root / "targets/p.toml").read_text().replace("$SRC/in.txt $SRC/in.txt", "$SRC/in.txt")
    ws.write({"targets/p.toml": toml})
    age(ws.root, 20)
    assert "executed 1" in build(ws, "//p:a").stderr
    assert ws.read_output("//p:a", "a.txt") == "alpha\nbeta\n"


def test_a_changed_output_or_collected_cache_takes_the_full_path(make_ws):
    ws = ready(make_ws, "//p:b")
    (ws.root / "bgraph-out/p/b").unlink()
    assert "1 output link(s) put back" in build(ws, "//p:b").stderr  # the tree is whole in the cache
    # An output file changed in place (the tree is read-only, but root may write): the full path.
    out = (ws.root / "bgraph-out/p/b/b.txt").resolve()
    os.chmod(out, 0o644)
    out.write_text("tampered\n")
    assert UP_TO_DATE not in build(ws, "//p:b").stderr
    assert UP_TO_DATE in build(ws, "//p:b").stderr
    # `cache gc` that removes something (here: :a's output, which no root holds) invalidates every record.
    gc = ws.cli("cache", "gc")
    assert gc.rc == 0 and "removed 0 action-cache entries, 0 blobs" not in gc.stdout, gc.output
    assert UP_TO_DATE not in build(ws, "//p:b").stderr


def test_a_file_written_just_before_the_build_is_not_trusted_by_its_stamp(make_ws):
    ws = make_ws(FILES)
    age(ws.root, -3600)  # dated after the scan, as a file written during its clock tick is (a loaded host may
    build(ws, "//p:a")   # start the build more than RACY_NS after make_ws wrote the files)
    assert UP_TO_DATE not in build(ws, "//p:a").stderr


def test_an_edit_while_the_build_runs_leaves_no_record(tmp_path):
    (tmp_path / "WORKSPACE.toml").write_text("")
    (tmp_path / "f.txt").write_text("1")
    age(tmp_path)
    asked = noop.Request(tmp_path, "d" * 32, tmp_path / "cache" / "v1" / "blake3" / STATE_FILE)
    recording = uptodate.Recording(asked)
    (tmp_path / "f.txt").write_text("2")  # after the scan, before the build read it (or after)
    age(tmp_path, 10)
    recording.remember("answer\n", 0, tmp_path / "cache")
    assert uptodate.load(StateFile(asked.state), asked.digest) is None
    recording = uptodate.Recording(asked)
    recording.remember("answer\n", 0, tmp_path / "cache")
    assert noop.replay(asked) == ("answer\n", 0)


def test_bgraph_code_or_config_edited_while_the_command_runs_leaves_no_record(tmp_path, monkeypatch):
    """The code a command runs is the code it found at its start (a rule's module is imported when
    first asked for): a record stamping the code as it is at the end answered "up to date" with the
    old code's output after an edit made while the build ran (red team K11)."""
    (tmp_path / "ws").mkdir()
    (tmp_path / "ws" / "WORKSPACE.toml").write_text("")
    code = tmp_path / "rule.py"
    code.write_text("V = 1\n")
    monkeypatch.setattr(uptodate, "code_files", lambda: (str(code),))
    age(tmp_path)
    asked = noop.Request(tmp_path / "ws", "d" * 32, tmp_path / "cache" / "v1" / "blake3" / STATE_FILE)
    recording = uptodate.Recording(asked)
    code.write_text("V = 2\n")  # while it runs (the workspace itself unchanged)
    past = time.time() - 10
    os.utime(code, (past, past))
    time.sleep(filestate.RACY_NS / 1e9 + 0.05)
    recording.remember("answer\n", 0, tmp_path / "cache")
    assert uptodate.load(StateFile(asked.state), asked.digest) is None
    recording = uptodate.Recording(asked)  # the next command, which finds the new code
    recording.remember("answer\n", 0, tmp_path / "cache")
    assert noop.replay(asked) == ("answer\n", 0)


def test_a_link_to_a_directory_is_never_recorded(make_ws, tmp_path):
    ws = make_ws(FILES)
    (tmp_path / "elsewhere").mkdir()
    (ws.root / "srcs" / "more").symlink_to(tmp_path / "elsewhere")  # what changes there would go unseen
    age(ws.root)
    build(ws, "//p:a")
    assert UP_TO_DATE not in build(ws, "//p:a").stderr


def test_a_query_answer_is_replayed_until_a_target_file_changes(make_ws):
    ws = make_ws(FILES)
    age(ws.root)
    first = ws.cli("query", "deps(//p:b)")
    assert first.rc == 0 and "//p:a" in first.stdout
    assert len(list(records(ws))) == 1
    assert ws.cli("query", "deps(//p:b)").stdout == first.stdout
    ws.write({"targets/p.toml": (ws.root / "targets/p.toml").read_text().replace('deps = { a = ":a" }', "")})
    age(ws.root, 20)
    second = ws.cli("query", "deps(//p:b)")
    assert second.rc == 0 and "//p:a" not in second.stdout


def test_a_why_answer_is_recorded_with_the_cache_inside_the_workspace(make_ws, tmp_path):
    ws = make_ws(FILES, cache=tmp_path / "ws-in" / "cache", name="ws-in")
    age(ws.root)
    build(ws, "//p:b")  # fills the cache, inside the root: the scan must leave it out
    first = ws.cli("why", "//p:b", "//p:a")
    assert first.rc == 0 and "//p:a" in first.stdout
    kept = list(records(ws))
    assert len(kept) == 2  # the build's and the why's
    assert all("cache/" not in p for r in kept for p in uptodate.Record.from_bytes(r).files)
    assert ws.cli("why", "//p:b", "//p:a").stdout == first.stdout


def test_removed_output_links_are_put_back_from_the_record(make_ws):
    ws = ready(make_ws, "//p:b")
    import shutil
    shutil.rmtree(ws.root / "bgraph-out")  # `make clean`: the records live in the cache
    run = build(ws, "//p:b")
    assert UP_TO_DATE in run.stderr and "1 output link(s) put back" in run.stderr, run.stderr
    assert ws.read_output("//p:b", "b.txt").strip() == "4"
    # A collection while the link was gone may have taken its tree: the full path links it again.
    shutil.rmtree(ws.root / "bgraph-out")
    gc = ws.cli("cache", "gc")
    assert gc.rc == 0 and "0 materialized trees" not in gc.stdout, gc.output
    run = build(ws, "//p:b")
    assert UP_TO_DATE not in run.stderr and ws.read_output("//p:b", "b.txt").strip() == "4"


def test_a_link_put_back_is_checked_against_a_collection_that_ran_meanwhile(make_ws):
    ws = ready(make_ws, "//p:b")
    [row] = records(ws)
    record = uptodate.Record.from_bytes(row)
    (ws.root / "bgraph-out/p/b").unlink()
    layout = ws.cache / "v1"
    uptodate.bump_generation(layout)  # as a gc between the checks and the relink would
    assert uptodate.restore_links(record, layout) is None


def test_records_live_in_the_state_file_the_build_will_choose(tmp_path, monkeypatch):
    from build_graph.roots import state_file

    monkeypatch.delenv("BGRAPH_CACHE", raising=False)
    (tmp_path / "WORKSPACE.toml").write_text('[workspace]\nname = "t"\n[defaults]\ncache_dir = "c"\n')
    assert state_file(None, tmp_path) == tmp_path / "c" / "v1" / "blake3" / STATE_FILE
    assert state_file("/elsewhere", tmp_path) == Path("/elsewhere/v1/blake3") / STATE_FILE
    monkeypatch.setenv("BGRAPH_CACHE", str(tmp_path / "e"))
    assert state_file(None, tmp_path) == tmp_path / "e" / "v1" / "blake3" / STATE_FILE
    (tmp_path / "WORKSPACE.toml").write_text('[workspace]\nname = "t"\ndigest_function = "sha256"\n')
    assert state_file(None, tmp_path) == tmp_path / "e" / "v1" / "sha256" / STATE_FILE
    monkeypatch.delenv("BGRAPH_CACHE")
    (tmp_path / "WORKSPACE.toml").write_text("[defaults\n")  # the build reports it; no record is used
    assert state_file(None, tmp_path) is None


def test_a_json_no_op_lists_every_action_as_a_hit(make_ws):
    import json

    ws = make_ws(FILES)
    age(ws.root)
    first = ws.cli("build", "--json", "//p:b")
    assert first.rc == 0, first.output
    built = json.loads(first.stdout)
    again = ws.cli("build", "--json", "//p:b")
    summary = json.loads(again.stdout)
    assert summary["up_to_date"] and summary["executed"] == 0 and summary["hits"] == len(built["actions"])
    assert {(a["label"], a["name"], a["key"]) for a in summary["actions"]} == \
        {(a["label"], a["name"], a["key"]) for a in built["actions"]}
    assert all(a["status"] == "hit" for a in summary["actions"]) and summary["outputs"] == built["outputs"]
    # After an edit, --json takes the full path (every action listed, none taken from the memo unlisted).
    ws.write({"in.txt": "one\n"})
    age(ws.root, 20)
    edited = json.loads(ws.cli("build", "--json", "//p:b").stdout)
    assert edited["executed"] == 2 and "targets_reused" not in edited and len(edited["actions"]) == len(built["actions"])


def test_a_check_build_drops_the_record_it_relinks_over(make_ws):
    """Issue 33 item 4: --check (like --profile, --check-against, uploads) relinks bgraph-out/ and
    records nothing, so the plain request's record is dropped: the next plain build takes the
    full path instead of putting an old link back."""
    ws = ready(make_ws, "//p:b")
    ws.write({"in.txt": "one\n"})
    age(ws.root, 20)
    checked = ws.cli("build", "--check", "//p:b")
    assert checked.rc == 0, checked.output
    assert ws.read_output("//p:b", "b.txt").strip() == "2"
    assert not list(records(ws))  # the plain request's record (and its memo) went with the relink
    again = build(ws, "//p:b")
    assert UP_TO_DATE not in again.stderr
    assert ws.read_output("//p:b", "b.txt").strip() == "2"


def test_a_check_that_replaces_a_result_drops_every_record_of_the_cache(make_ws):
    """R9 check_other_request: --check re-ran a non-reproducible //p:n and filed its other
    output; the record of another request (//p:c, built from n) still answered "up to date"
    with c made from the old n, as did its memo after an edit. A replaced result now makes every
    record and memo of the cache stop holding."""
    ws = make_ws({**FILES, "targets/p.toml": FILES["targets/p.toml"] +
                  '\n[n]\nkind = "genrule"\nsrcs = ["srcs/x.txt"]\nouts = ["n.txt"]\ncmd = "date +%N > $OUT/n.txt"\n'
                  '\n[c]\nkind = "genrule"\nouts = ["c.txt"]\ndeps = { n = ":n", a = ":a" }\n'
                  'cmd = "cat $IN_N/n.txt $IN_A/a.txt > $OUT/c.txt"\n'})
    age(ws.root)
    build(ws, "//p:c")
    assert UP_TO_DATE in build(ws, "//p:c").stderr  # the record holds
    checked = ws.cli("build", "--check", "//p:n")
    assert "n.txt" in checked.output or checked.rc != 0  # it differs (random bytes)
    again = build(ws, "//p:c")
    assert UP_TO_DATE not in again.stderr
    assert ws.read_output("//p:c", "c.txt").startswith(ws.read_output("//p:n", "n.txt"))


def test_a_build_during_which_the_cache_generation_moved_records_nothing(make_ws):
    """R12 check_race_generation: a --check (or a gc) that replaced or removed something while
    another build ran bumped the generation; that build then filed its record stamped with the
    new generation, keeping what it had taken before: its no-op and memo served c from the
    replaced result. A build now records nothing where the generation moved while it ran."""
    from bgraph_testlib import hermetic_env

    ws = make_ws({**FILES, "targets/p.toml": FILES["targets/p.toml"] +
                  '\n[c]\nkind = "genrule"\nouts = ["c.txt"]\ndeps = { a = ":a" }\n'
                  'cmd = "sleep 3.217; cat $IN_A/a.txt > $OUT/c.txt"\n'})
    age(ws.root)
    started = subprocess.Popen([sys.executable, "-m", "build_graph", "-C", str(ws.root), "--cache-dir", str(ws.cache),
                                "build", "//p:c"], env=hermetic_env(ws.env), cwd=ws.root,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while subprocess.run(["pgrep", "-f", "sleep 3.217"], capture_output=True).returncode != 0:
        assert started.poll() is None and time.monotonic() < deadline, started.communicate()[0]
        time.sleep(0.05)
    uptodate.bump_generation(ws.cache / "v1")  # what a --check that replaced a result does
    assert started.wait(60) == 0, started.communicate()[0]
    assert UP_TO_DATE not in build(ws, "//p:c").stderr  # no record was filed: the full path ran
    assert UP_TO_DATE in build(ws, "//p:c").stderr  # and recorded, with nothing moving beside it


def test_a_link_another_build_repointed_is_not_put_back(make_ws):
    """A record whose bgraph-out link another request re-pointed does not hold: the link is that
    build's, and only a full path may decide what it should lead to."""
    ws = ready(make_ws, "//p:a")
    link = ws.root / "bgraph-out" / "p" / "a"
    before = os.readlink(link)
    ws.write({"in.txt": "one\n"})
    age(ws.root, 20)
    build(ws, "//p:a", "//p:b")  # another request relinks p/a to the new output
    assert os.readlink(link) != before
    ws.write({"in.txt": "alpha\nbeta\n"})
    age(ws.root, 30)
    run = build(ws, "//p:a")
    assert ws.read_output("//p:a", "a.txt") == "alpha\nbeta\n" * 2


def _tamper_in_place(path: Path, data: bytes) -> None:
    """Root writes through a read-only, hard-linked output and puts its mtime back."""
    st = path.stat()
    with open(path, "r+b") as f:
        f.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_an_output_written_in_place_is_never_relinked(make_ws):
    """Issue 33 item 5: an output changed in place (its blob hard-linked into bgraph-out/) is
    neither answered up to date nor re-linked by the memo or materialize: it is built again."""
    ws = ready(make_ws, "//p:b")
    out = ws.root / "bgraph-out" / "p" / "b" / "b.txt"
    _tamper_in_place(out, b"9\n")
    time.sleep(filestate.RACY_NS / 1e9 + 0.05)
    run = build(ws, "//p:b")
    assert UP_TO_DATE not in run.stderr
    assert ws.read_output("//p:b", "b.txt") == "4\n"
    # An edit elsewhere (the memo path) after tampering with an output it would take whole.
    _tamper_in_place(ws.root / "bgraph-out" / "p" / "b" / "b.txt", b"7\n")
    ws.write({"srcs/x.txt": "y\n"})
    age(ws.root, 20)
    build(ws, "//p:b")
    assert ws.read_output("//p:b", "b.txt") == "4\n"


def test_an_output_chmod_or_replaced_file_is_built_again(make_ws):
    ws = ready(make_ws, "//p:a")
    out = ws.root / "bgraph-out" / "p" / "a" / "a.txt"
    os.chmod(out, 0o755)
    time.sleep(filestate.RACY_NS / 1e9 + 0.05)
    build(ws, "//p:a")
    assert ws.read_output("//p:a", "a.txt") == "alpha\nbeta\n" * 2
    assert (os.stat(ws.root / "bgraph-out" / "p" / "a" / "a.txt").st_mode & 0o111) == 0
    # a file replaced inside the materialized tree (another inode): the tree is made again
    real = Path(os.path.realpath(out))
    real.unlink()
    real.write_text("forged\n")
    time.sleep(filestate.RACY_NS / 1e9 + 0.05)
    build(ws, "//p:a")
    assert ws.read_output("//p:a", "a.txt") == "alpha\nbeta\n" * 2


def test_globs_never_reach_what_the_scan_leaves_out(make_ws):
    """A glob matches no file under bgraph-out/ or a __pycache__/ directory (the record never
    stamps those, so a new one there would go unseen); a file named outright there still counts."""
    files = {**FILES, "py/m.py": "x = 1\n",
             "targets/q.toml": '[all]\nkind = "genrule"\nsrcs = ["**/*.txt", "py/**"]\nouts = ["l.txt"]\n'
                               'cmd = "cd $SRC && find . -type f | sort > $OUT/l.txt"\n'}
    ws = make_ws(files)
    age(ws.root)
    build(ws, "//p:a", "//q:all")
    ws.write({"py/__pycache__/m.cpython-311.pyc": "bytecode\n"})
    age(ws.root, 20)
    listed = build(ws, "//q:all") and ws.read_output("//q:all", "l.txt")
    assert "__pycache__" not in listed and "bgraph-out" not in listed and "./in.txt" in listed, listed


def test_a_target_file_under_a_skipped_directory_is_not_loaded(make_ws):
    """targets/**/__pycache__/*.toml and .git/ hold no target files: the record does not stamp them."""
    ws = make_ws({**FILES, "targets/__pycache__/z.toml": '[z]\nkind = "genrule"\nouts = ["z"]\ncmd = "true"\n'})
    run = ws.cli("build", "//__pycache__/z:z")
    assert run.rc != 0 and "no target matches '//__pycache__/z:z'" in run.stderr, run.output


def test_an_output_tree_changed_in_shape_takes_the_full_path(make_ws):
    """A file added to a linked output tree, or a directory link in it re-pointed, is seen by the
    no-op (directories and links are stamped too), and the full path makes the tree again."""
    files = {**FILES, "targets/t.toml": '[t]\nkind = "genrule"\nouts = ["d"]\n'
                                        'cmd = "mkdir -p $OUT/d/one $OUT/d/two && echo 1 > $OUT/d/one/f && '
                                        'echo 2 > $OUT/d/two/f && ln -s one $OUT/d/link"\n'}
    ws = make_ws(files)
    age(ws.root)
    build(ws, "//t:t")
    top = (ws.root / "bgraph-out/t/t/d").resolve()
    os.chmod(top, 0o755)
    (top / "extra.txt").write_text("added\n")
    assert UP_TO_DATE not in build(ws, "//t:t").stderr
    assert not (ws.root / "bgraph-out/t/t/d/extra.txt").exists()
    assert UP_TO_DATE in build(ws, "//t:t").stderr
    top = (ws.root / "bgraph-out/t/t/d").resolve()
    os.chmod(top, 0o755)
    (top / "link").unlink()
    (top / "link").symlink_to("two")
    assert UP_TO_DATE not in build(ws, "//t:t").stderr
    assert ws.read_output("//t:t", "d/link/f") == "1\n"


def _running(marker: str) -> bool:
    """Whether some process's command line holds `marker`."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                return True
        except OSError:
            pass
    return False


def _tool_ws(make_ws, tmp_path, cmd: str):
    tools = tmp_path / "tools"
    tools.mkdir(exist_ok=True)
    tool = tools / "mytool"
    tool.write_text("#!/bin/sh\necho tool-v1\n")
    tool.chmod(0o755)
    ws = make_ws({**FILES, "b.txt": "b\n",
                  "targets/toolchains.toml": f'[host]\nkind = "host_tools"\npaths = ["/usr"]\n'
                                             f'tools = ["/usr/bin/sh", "{tool}"]\n',
                  "targets/t.toml": f'[x]\nkind = "genrule"\nsrcs = ["in.txt"]\nouts = ["x.txt"]\n'
                                    f'cmd = "{cmd}"\n\n'
                                    '[y]\nkind = "genrule"\nsrcs = ["b.txt"]\nouts = ["y.txt"]\n'
                                    'cmd = "cat $SRC/b.txt > $OUT/y.txt"\n'})
    return ws, tool


def test_a_host_tool_is_stamped_by_a_build_that_took_its_target_from_the_memo(make_ws, tmp_path):
    """A build on the memo path (an unrelated edit) runs no probe; its record must still stamp
    the host tools, else a tool upgrade afterwards is answered "up to date"."""
    ws, tool = _tool_ws(make_ws, tmp_path, f"{tmp_path}/tools/mytool > $OUT/x.txt")
    age(ws.root)
    build(ws, "//t:x", "//t:y")
    ws.write({"b.txt": "bb\n"})
    age(ws.root, 20)
    build(ws, "//t:x", "//t:y")  # the memo path: //toolchains:host taken whole
    time.sleep(1)
    tool.write_text("#!/bin/sh\necho tool-v2\n")
    past = time.time() - 20
    os.utime(tool, (past, past))
    time.sleep(filestate.RACY_NS / 1e9 + 0.05)
    assert UP_TO_DATE not in build(ws, "//t:x", "//t:y").stderr
    assert ws.read_output("//t:x", "x.txt") == "tool-v2\n"


def test_a_host_tool_replaced_while_its_action_runs_leaves_no_result(make_ws, tmp_path):
    """The key names the tool as probed: an action that ran another one fails and files nothing,
    and the next build runs it with the tool as it is."""
    ws, tool = _tool_ws(make_ws, tmp_path, f"sleep 2.0123; {tmp_path}/tools/mytool > $OUT/x.txt")
    age(ws.root)
    proc = subprocess.Popen([sys.executable, "-m", "build_graph", "-C", str(ws.root), "--cache-dir", str(ws.cache),
                             "build", "//t:x"], stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while time.time() < deadline and not _running("2.0123"):  # planned, probed, its action started
        time.sleep(0.05)
    new = tool.with_name("mytool.new")
    new.write_text("#!/bin/sh\necho tool-v2\n")
    new.chmod(0o755)
    new.rename(tool)
    _out, err = proc.communicate(timeout=120)
    assert proc.returncode != 0 and "changed while the action ran" in err, err
    run = build(ws, "//t:x")
    assert "executed 1" in run.stderr and ws.read_output("//t:x", "x.txt") == "tool-v2\n"


def test_an_output_holding_a_link_is_recorded(make_ws):
    """A link in an output (`lib.so -> lib.so.1`, every toolchain tree) stamps the file it leads
    to with the link's text: that stamp is no blob's, and taking it for one left every build of
    such a target without a record (each took the full path)."""
    ws = make_ws({**FILES, "targets/l.toml": '[l]\nkind = "genrule"\nouts = ["o", "sub/l"]\n'
                                            'cmd = "echo hi > $OUT/o && ln -s ../o $OUT/sub/l"\n'})
    age(ws.root)
    assert UP_TO_DATE not in build(ws, "//l:l").stderr
    assert UP_TO_DATE in build(ws, "//l:l").stderr
    assert (ws.root / "bgraph-out" / "l" / "l" / "sub" / "l").read_text() == "hi\n"


def _writes_back(path: Path) -> bool:
    """Whether the file system under `path` writes dirty pages back (tmpfs never does: there a
    page a mapping dirtied stays writable, and no stamp can see stores into it; filestate.settle)."""
    kind = subprocess.run(["stat", "-f", "-c", "%T", str(path)], capture_output=True, text=True).stdout.strip()
    return kind not in ("tmpfs", "ramfs")


@pytest.mark.parametrize("path", ["no-op", "full", "unrecorded", "target file"])
def test_a_file_rewritten_through_a_shared_mapping_is_seen(make_ws, tmp_path, path):
    """A store through a shared writable mapping moves mtime and ctime only when it faults on a
    clean page; later stores into the same page (dirty until the kernel writes it back, ~30 s)
    move nothing. Stamps are taken only after the page is written back (filestate.settle), so
    the next store faults and is seen: by the record's scan (no-op path); by the source digest
    table, where a file added voids the record (full) or a link to a directory keeps the workspace
    from being recorded at all (unrecorded: the scan stops at the link before it reaches deep/,
    and only the table judges the source); and by the kept parse (target file, unrecorded too).
    Red-team R1 H1."""
    ws = make_ws({**FILES, "deep/m.txt": "alpha\n",
                  "targets/q.toml": '[m]\nkind = "genrule"\nsrcs = ["deep/m.txt"]\nouts = ["m.txt", "v.txt"]\n'
                                    'cmd = "echo 11111 > $OUT/v.txt; '
                                    'cat $SRC/deep/m.txt $SRC/deep/m.txt > $OUT/m.txt"\n'})
    if not _writes_back(ws.root):
        pytest.skip("the workspace lies on a file system that never writes back (tmpfs)")
    if path in ("unrecorded", "target file"):
        (tmp_path / "elsewhere").mkdir()
        (ws.root / "dirlink").symlink_to(tmp_path / "elsewhere")
    age(ws.root)
    mapped = ws.root / ("targets/q.toml" if path == "target file" else "deep/m.txt")
    at = mapped.read_bytes().index(b"11111" if path == "target file" else b"alpha")
    fd = os.open(mapped, os.O_RDWR)
    try:
        os.fdatasync(fd)  # a clean page: the first store below faults (and dirties the inode now)
        m = mmap.mmap(fd, 0)
        m[at:at + 5] = b"22222" if path == "target file" else b"gamma"  # faults: mtime and ctime move now
        time.sleep(filestate.RACY_NS / 1e9 + 0.05)
        assert UP_TO_DATE not in build(ws, "//q:m").stderr
        time.sleep(filestate.RACY_NS / 1e9 + 0.05)
        if path == "no-op":
            assert UP_TO_DATE in build(ws, "//q:m").stderr  # the record holds
        m[at:at + 5] = b"33333" if path == "target file" else b"delta"  # the same dirty page: no fault
        if path == "full":
            ws.write({"other.txt": "x\n"})  # the record no longer holds: planned, sources by stamp
        run = build(ws, "//q:m")
        m.close()
    finally:
        os.close(fd)
    assert UP_TO_DATE not in run.stderr
    if path == "target file":
        assert ws.read_output("//q:m", "v.txt") == "33333\n"
    else:
        assert ws.read_output("//q:m", "m.txt") == "delta\n" * 2
