"""`bgraph cache gc` and `bgraph cache verify`: what they remove, what they keep (what running
builds hold, bgraph-out links), and that they are safe while a build runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from bgraph_testlib import hermetic_env, requires_bwrap, statuses
from build_graph.incremental import filestate
from build_graph.model import Digester
from build_graph.store.cas import LocalCas

B3 = Digester("blake3")

# //p:a and //p:c are independent; //p:b reads a's output (slowly, when SLOW is set).
TARGETS = {
    "in.txt": "alpha\nbeta\n",
    "targets/p.toml": '''[a]
kind = "genrule"
srcs = ["in.txt"]
outs = ["a.txt"]
cmd = "cat $SRC/in.txt $SRC/in.txt > $OUT/a.txt"

[b]
kind = "genrule"
outs = ["b.txt"]
deps = { a = ":a" }
cmd = "wc -l < $IN_A/a.txt > $OUT/b.txt"

[c]
kind = "genrule"
outs = ["c.bin"]
cmd = "head -c 400000 /dev/zero | tr '\\\\0' c > $OUT/c.bin"

[d]
kind = "genrule"
outs = ["d.bin"]
cmd = "head -c 400000 /dev/zero | tr '\\\\0' d > $OUT/d.bin"
''',
}


def trees(ws) -> set[str]:
    return set(os.listdir(ws.store / "trees"))


def blob_files(ws) -> set[str]:
    return {p.name for p in (ws.store / "cas").rglob("*") if p.is_file()}


def assert_stamps_current(ws) -> int:
    """Every blob's recorded stamp matches its file now; returns how many were checked."""
    stamps = json.loads((ws.store / "verified.json").read_text())
    checked = 0
    for blob in (ws.store / "cas").rglob("*"):
        if blob.is_file() and blob.name in stamps:
            st = blob.stat()
            assert stamps[blob.name] == filestate.of(st), blob.name
            checked += 1
    return checked


@requires_bwrap
def test_linking_the_outputs_leaves_every_stamp_current(make_ws):
    """bgraph-out's links materialize the outputs after the build saved its stamps, and each
    hard link moves a blob's ctime: those stamps are saved again, else the next build re-hashes
    every blob of a newly linked output (a toolchain's 5,000, 0.2 s before its first action)."""
    ws = make_ws(TARGETS)
    assert ws.build("//p:b", "//p:c").rc == 0
    assert any(os.stat(b).st_nlink > 1 for b in (ws.store / "cas").rglob("*") if b.is_file())  # linked
    assert assert_stamps_current(ws) > 0


@requires_bwrap
def test_gc_removes_what_nothing_needs_and_keeps_hits_and_links(make_ws):
    ws = make_ws(TARGETS)
    assert ws.build("//p:b", "//p:c").rc == 0
    stray = LocalCas(ws.cache, B3)
    orphan = stray.put_bytes(b"referenced by nothing")
    stray.close()
    assert orphan.digest[2:] in blob_files(ws)
    assert ws.build("//p:b", "//p:c").json["executed"] == 0  # checks the blobs: stamps recorded
    trees_before = trees(ws)
    out = ws.cli("cache", "gc")
    assert out.rc == 0, out.stderr
    assert "removed 0 action-cache entries" in out.stdout
    # Unlinking the trees' hard links moved the blobs' ctime; gc took that into their stamps, so
    # the next build trusts them without re-hashing the store.
    assert len(trees_before) > len(trees(ws))
    assert assert_stamps_current(ws) > 0
    assert orphan.digest[2:] not in blob_files(ws)
    # Trees nothing holds are gone; those behind bgraph-out links stay and still read.
    assert ws.read_output("//p:b", "b.txt").strip() == "4"
    assert len(trees(ws)) == 2
    again = ws.build("//p:b", "//p:c")
    assert again.json["executed"] == 0
    assert ws.cli("cache", "verify").rc == 0


@requires_bwrap
def test_gc_max_size_drops_least_recently_used_first(make_ws):
    ws = make_ws(TARGETS)
    assert ws.build("//p:c").rc == 0
    assert ws.build("//p:d").rc == 0
    time.sleep(0.05)
    assert ws.build("//p:c").json["executed"] == 0  # c used last
    for name in "cd":
        os.unlink(ws.root / "bgraph-out" / "p" / name)  # no roots: only recency counts
    out = ws.cli("cache", "gc", "--max-size", "450K")  # room for one of them
    assert out.rc == 0 and "removed 1 action-cache entries" in out.stdout, out.stdout
    assert statuses(ws.build("//p:c").json) == {"//p:c": "hit"}
    assert statuses(ws.build("//p:d").json) == {"//p:d": "executed"}
    for name in "cd":
        os.unlink(ws.root / "bgraph-out" / "p" / name)
    out = ws.cli("cache", "gc", "--max-size", "0")
    assert "kept 0 entries" in out.stdout, out.stdout
    assert statuses(ws.build("//p:c", "//p:d").json) == {"//p:c": "executed", "//p:d": "executed"}


@requires_bwrap
def test_gc_and_verify_while_a_build_runs_keep_what_it_holds(make_ws):
    ws = make_ws(TARGETS)
    assert ws.build("//p:b").rc == 0
    ws.write({"targets/p.toml": TARGETS["targets/p.toml"].replace(
        "wc -l < $IN_A/a.txt", "sleep 4; wc -l < $IN_A/a.txt")})
    build = subprocess.Popen(
        [sys.executable, "-m", "build_graph", "-C", str(ws.root), "--cache-dir", str(ws.cache),
         "build", "--json", "//p:b"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=hermetic_env())
    staging = ws.cache / "v1" / "tmp"
    deadline = time.time() + 60
    while not any(staging.glob("*/act-*")):  # b's sandbox is running, over a's tree
        assert build.poll() is None and time.time() < deadline, build.communicate()
        time.sleep(0.05)
    gc = ws.cli("cache", "gc", "--max-size", "0")
    assert gc.rc == 0 and "held by 1 running build(s)" in gc.stdout, gc.stdout + gc.stderr
    verify = ws.cli("cache", "verify")
    assert verify.rc == 0, verify.stdout
    stdout, stderr = build.communicate(timeout=60)
    assert build.returncode == 0, stderr
    assert ws.read_output("//p:b", "b.txt").strip() == "4"
    # a's entry was held (a hit of the running build) and b's was written after: both stay.
    assert ws.build("//p:b").json["executed"] == 0


@requires_bwrap
def test_verify_finds_a_corrupt_blob_and_repair_drops_only_what_holds_it(make_ws):
    ws = make_ws(TARGETS)
    assert ws.build("//p:a", "//p:c").rc == 0
    before = trees(ws)
    a_tree = os.path.basename(os.readlink(ws.root / "bgraph-out" / "p" / "a"))
    a_file = os.path.realpath(ws.root / "bgraph-out" / "p" / "a" / "a.txt")
    os.chmod(a_file, 0o644)
    with open(a_file, "r+b") as f:  # the tree hard-links the blob: this corrupts both
        f.write(b"X")
    out = ws.cli("cache", "verify")
    assert out.rc == 1
    assert "corrupt blob" in out.stdout and "dangling action-cache entry" in out.stdout
    assert "broken tree" in out.stdout and "--repair" in out.stderr
    fixed = ws.cli("cache", "verify", "--repair")
    assert fixed.rc == 0 and "(removed)" in fixed.stdout
    assert before - trees(ws) == {a_tree}  # the others (c's, a's sources) never held the bad blob
    assert ws.cli("cache", "verify").rc == 0
    again = ws.build("//p:a", "//p:c")
    assert statuses(again.json) == {"//p:a": "executed", "//p:c": "hit"}
    assert ws.read_output("//p:a", "a.txt") == "alpha\nbeta\nalpha\nbeta\n"


def test_evicting_a_blob_keeps_trees_that_do_not_hold_it(tmp_path):
    from build_graph.model import Tree

    cas = LocalCas(tmp_path / "cache", B3)
    one = Tree({"x": cas.put_bytes(b"one")})
    two = Tree({"y": cas.put_bytes(b"two")})
    d1, d2 = cas.materialize(one), cas.materialize(two)
    cas.evict(one.entries["x"].digest)
    assert not d1.exists() and (d2 / "y").read_bytes() == b"two"
    cas.close()


def test_cache_gc_size_argument_is_checked(make_ws):
    ws = make_ws({})
    out = ws.cli("cache", "gc", "--max-size", "lots")
    assert out.rc == 2 and "not a size: 'lots'" in out.stderr


@requires_bwrap
def test_a_source_collected_after_its_stamp_was_recorded_is_stored_again(make_ws):
    ws = make_ws(TARGETS)
    time.sleep(2.1)  # a stamp is recorded only for a file unchanged for 2 s (mtime and ctime)
    assert ws.build("//p:a").rc == 0
    sources = __import__("json").loads((ws.store / "sources.json").read_text())
    digest = next(v[6] for k, v in sources.items() if k.endswith("in.txt"))
    assert ws.cli("cache", "gc").rc == 0
    assert not (ws.store / "cas" / digest[:2] / digest[2:]).exists()  # nothing kept the source
    ws.write({"targets/p.toml": TARGETS["targets/p.toml"].replace("cat $SRC/in.txt $SRC/in.txt",
                                                                  "cat $SRC/in.txt")})
    run = ws.build("//p:a")  # its stamp still names the blob: it must be stored again, not assumed
    assert run.rc == 0, run.stderr
    assert statuses(run.json) == {"//p:a": "executed"}
    assert ws.read_output("//p:a", "a.txt") == "alpha\nbeta\n"


def test_verify_finds_a_damaged_state_file_and_repair_starts_it_afresh(make_ws):
    """A state file SQLite finds malformed is read as empty by builds (correct but slow): verify
    says so, and --repair removes it; the next build is correct and records again (red-team read)."""
    ws = make_ws(TARGETS)
    assert ws.build("//p:a").rc == 0
    [state] = list((ws.cache / "v1").glob("*/state-v*.sqlite"))
    data = bytearray(state.read_bytes())
    data[4096:8192] = b"\xa5" * 4096  # a page of garbage
    state.write_bytes(bytes(data))
    out = ws.cli("cache", "verify")
    assert out.rc == 1 and "damaged state file" in out.stdout, out.output
    fixed = ws.cli("cache", "verify", "--repair")
    assert fixed.rc == 0 and "(removed)" in fixed.stdout, fixed.output
    assert ws.cli("cache", "verify").rc == 0
    again = ws.build("//p:a")
    assert again.rc == 0 and ws.read_output("//p:a", "a.txt") == "alpha\nbeta\nalpha\nbeta\n"


@requires_bwrap
def test_verify_and_gc_never_follow_a_linked_shard_and_repair_removes_stray_entries(make_ws, tmp_path):
    """A CAS shard that is a link into a user's directory: `cache verify --repair` deleted every
    file there as a corrupt blob, and gc as an unneeded one. A directory in a shard stopped
    verify with 'Is a directory' and no path; a FIFO in one would hang it. Each is now a stray
    entry, named by its path, never followed, opened or hashed; --repair removes the entry itself
    (the link, not what it points at), and the builds' own results are untouched (red-team K7)."""
    ws = make_ws(TARGETS)
    assert ws.build("//p:a").rc == 0
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    cas = ws.store / "cas"
    shard = sorted(p for p in cas.iterdir())[0]
    link = cas / "zz"
    link.symlink_to(precious)
    (shard / "stray" / "inner").mkdir(parents=True)
    os.mkfifo(ws.store / "dirs" / sorted(os.listdir(ws.store / "dirs"))[0] / "fifo")
    assert ws.cli("cache", "gc", timeout=60).rc == 0
    assert (precious / "notes.txt").read_text() == "keep me"
    out = ws.cli("cache", "verify", timeout=60)
    assert out.rc == 1 and "Traceback" not in out.output, out.output
    named = {line.removeprefix("stray entry ") for line in out.stdout.splitlines() if line.startswith("stray entry")}
    assert named == {str(link), str(shard / "stray"), str(next((ws.store / "dirs").glob("*/fifo")))}, out.stdout
    fixed = ws.cli("cache", "verify", "--repair", timeout=60)
    assert fixed.rc == 0 and f"stray entry {link} (removed)" in fixed.stdout, fixed.output
    assert (precious / "notes.txt").read_text() == "keep me"
    assert not os.path.lexists(link) and not (shard / "stray").exists()
    assert ws.cli("cache", "verify").rc == 0
    again = ws.build("//p:a")
    assert statuses(again.json) == {"//p:a": "hit"}
