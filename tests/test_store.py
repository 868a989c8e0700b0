"""The local CAS, action cache and trace: atomic writes, verified reads, corruption recovery."""

from __future__ import annotations

import os
import stat
import threading
import time

import pytest

from bgraph_testlib import action, requires_bwrap
from build_graph.incremental import filestate
from build_graph.model import ActionResult, DirEntry, Digester, FileEntry, SymlinkEntry, Tree, canonical_json
from build_graph.store.action_cache import LocalActionCache
from build_graph.store.cas import FIXED_MTIME, CorruptBlob, LocalCas, StoreError
from build_graph.store.trace import Trace

B3 = Digester("blake3")


@pytest.fixture
def cas(tmp_path):
    return LocalCas(tmp_path / "cache", B3)


def leftovers(cas: LocalCas) -> list[str]:
    return sorted(os.listdir(cas.tmp))


# -- CAS -------------------------------------------------------------------------------------
def test_a_shard_directory_removed_is_made_again(tmp_path):
    """Blobs and nodes are renamed into their shard directory, which is made when it is missing
    (not stat-ed or made before every write); nothing is left in the staging directory."""
    first = LocalCas(tmp_path / "cache", B3)
    e = first.put_bytes(b"one")
    digest = first.put_tree(Tree({"a/one": e}))
    first.close()
    for d in (first.blob_path(e.digest).parent, first.dirs / digest[:2]):
        for p in d.iterdir():
            os.chmod(p, 0o644)
            p.unlink()
        d.rmdir()
    cas = LocalCas(tmp_path / "cache", B3)
    assert cas.put_bytes(b"one") == e and cas.read_bytes(e) == b"one"
    assert cas.put_tree(Tree({"a/one": e})) == digest
    assert cas.get_tree(digest) == Tree({"a/one": e})
    assert leftovers(cas) == []


def test_put_and_read_bytes(cas):
    e = cas.put_bytes(b"hello")
    assert e == FileEntry(B3.of(b"hello"), 5, False)
    path = cas.blob_path(e.digest)
    assert path == cas.base / "cas" / e.digest[:2] / e.digest[2:]
    assert path.read_bytes() == b"hello"
    assert stat.S_IMODE(path.stat().st_mode) == 0o444
    assert cas.read_bytes(e) == b"hello"
    assert cas.has(e) and cas.verify(e)
    assert cas.put_bytes(b"hello") == e  # idempotent
    assert cas.put_bytes(b"hello", executable=True) == FileEntry(e.digest, 5, True)
    assert leftovers(cas) == []


def test_sha256_layout(tmp_path):
    cas = LocalCas(tmp_path / "c", Digester("sha256"))
    e = cas.put_bytes(b"x")
    assert cas.blob_path(e.digest).is_relative_to(tmp_path / "c" / "v1" / "sha256" / "cas")


def test_put_file_copy_and_move(cas, tmp_path):
    src = tmp_path / "tool"
    src.write_bytes(b"#!/bin/sh\necho hi\n")
    src.chmod(0o755)
    e = cas.put_file(src)
    assert e.executable and e.size == src.stat().st_size
    assert src.exists()  # copied, not moved
    staged = cas.tmp / "staged"
    staged.write_bytes(b"moved content")
    e2 = cas.put_file(staged, move=True)
    assert not staged.exists()
    assert cas.read_bytes(e2) == b"moved content"
    assert leftovers(cas) == []


def test_writes_are_atomic(cas, monkeypatch):
    """Every blob is written in the staging dir and renamed into place; a crash before the
    rename leaves nothing at the blob's path."""
    real_replace = os.replace
    calls = []

    def crashing_replace(src, dst):
        calls.append((str(src), str(dst)))
        raise OSError("simulated crash")

    monkeypatch.setattr(os, "replace", crashing_replace)
    with pytest.raises(OSError, match="simulated crash"):
        cas.put_bytes(b"payload")
    [(src, dst)] = calls
    assert os.path.dirname(src) == str(cas.tmp)
    assert dst == str(cas.blob_path(B3.of(b"payload")))
    assert not os.path.exists(dst)
    assert open(src, "rb").read() == b"payload"  # the complete staged file
    monkeypatch.setattr(os, "replace", real_replace)
    e = cas.put_bytes(b"payload")
    assert cas.read_bytes(e) == b"payload"


def test_concurrent_puts_of_the_same_blob(cas):
    data = os.urandom(3 << 20)
    results, errors = [], []

    def put():
        try:
            results.append(cas.put_bytes(data))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=put) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(set(results)) == 1
    assert cas.read_bytes(results[0]) == data
    assert leftovers(cas) == []


def test_verify_detects_and_evicts_bad_blobs(cas, caplog):
    e = cas.put_bytes(b"original content")
    path = cas.blob_path(e.digest)
    path.chmod(0o644)
    path.write_bytes(b"ORIGINAL content")  # same size, different bytes
    path.chmod(0o444)  # its mode put back: only the bytes tell
    fresh = LocalCas(cas.base.parent.parent, B3)  # a new process: nothing verified yet
    with caplog.at_level("WARNING", logger="bgraph.store"):
        assert not fresh.verify(e)
    assert "corrupted" in caplog.text and "digest mismatch" in caplog.text
    assert not path.exists()
    with pytest.raises(CorruptBlob):
        fresh.read_bytes(e)
    # Truncation is caught by size alone.
    e2 = fresh.put_bytes(b"some longer content")
    p2 = fresh.blob_path(e2.digest)
    p2.chmod(0o644)
    p2.write_bytes(b"some")
    assert not LocalCas(cas.base.parent.parent, B3).verify(e2)
    assert not fresh.has(e2)


def test_tree_roundtrip(cas):
    a = cas.put_bytes(b"a")
    x = cas.put_bytes(b"#!x", executable=True)
    tree = Tree({"a": a, "d/e/a": a, "bin/x": x, "link": SymlinkEntry("d/e"), "empty/sub": DirEntry(),
                 "other_empty": DirEntry()})
    digest = cas.put_tree(tree)
    assert digest == tree.digest(B3)
    assert cas.get_tree(digest) == tree
    assert cas.get_tree(cas.put_tree(Tree())) == Tree()


def test_corrupted_directory_node(cas):
    tree = Tree({"d/a": cas.put_bytes(b"a")})
    digest = cas.put_tree(tree)
    node = cas.dirs / digest[:2] / digest[2:]
    node.write_bytes(b'{"dirs":[],"files":[],"symlinks":[]}')
    with pytest.raises(CorruptBlob):
        cas.get_tree(digest)
    assert not node.exists()


def test_materialize(cas):
    a = cas.put_bytes(b"data")
    x = cas.put_bytes(b"#!/bin/sh\n", executable=True)
    tree = Tree({"f": a, "sub/g": a, "bin/x": x, "l": SymlinkEntry("sub/g"), "e": DirEntry()})
    root = cas.materialize(tree)
    assert root == cas.trees / tree.digest(B3)
    assert (root / "sub/g").read_bytes() == b"data"
    assert os.readlink(root / "l") == "sub/g"
    assert os.lstat(root / "l").st_mtime == FIXED_MTIME  # R6: not when this cache made the tree
    assert (root / "e").is_dir()
    assert os.access(root / "bin/x", os.X_OK) and not os.access(root / "f", os.X_OK)
    assert stat.S_IMODE((root / "bin/x").stat().st_mode) == 0o555
    assert stat.S_IMODE((root / "f").stat().st_mode) == 0o444
    assert stat.S_IMODE((root / "sub").stat().st_mode) == 0o555
    assert cas.materialize(tree) == root  # reused
    assert leftovers(cas) == []


def test_two_processes_on_one_cache_never_remake_each_others_trees(cas):
    """Two stores on one cache (two builds, or two remote workers sharing a cache): the second
    to need a blob's executable copy takes the first's, so the tree the first made holds the
    same inode and is intact to the second. Before, the second replaced the copy, took the
    first's tree as changed and removed it, while a sandbox of the first had it mounted (the
    remote vLLM build's link step: 'bwrap: Can't find source path …/trees/…')."""
    x = cas.put_bytes(b"#!/bin/sh\nexit 0\n", executable=True)
    tree = Tree({"bin/x": x})
    root = cas.materialize(tree)
    inode = (root / "bin/x").stat().st_ino
    other = LocalCas(cas.base.parent.parent, B3)  # another process: its own locks and stamps
    assert other.materialize(Tree({"y": x})) is not None  # needs the executable copy too
    assert other.materialize(tree) == root and (root / "bin/x").stat().st_ino == inode
    # A tree found changed is replaced by a rename once the new one is ready (the path is never
    # missing for long), and the old one removed.
    os.chmod(root, 0o755)
    (root / "stray").write_text("x")
    held = os.open(root, os.O_RDONLY)
    try:
        again = LocalCas(cas.base.parent.parent, B3).materialize(tree)  # a third process
        assert again == root and not (again / "stray").exists()
        assert os.fstat(held).st_ino != os.stat(again).st_ino and not os.path.exists(f"/proc/self/fd/{held}/stray")
    finally:
        os.close(held)


def _writable(path):
    """Root writes below a read-only tree (the tamperings below are what another process could do)."""
    for d in [path, *path.parents]:
        if d.name.startswith("tree") or len(d.name) == 64:
            break
        d.chmod(0o755)


def _add_file(root):
    _writable(root / "sub")
    (root / "sub" / "stray").write_bytes(b"x")


def _add_empty_dir(root):
    _writable(root)
    (root / "extra").mkdir()


def _add_nested_dirs(root):
    _writable(root / "sub")
    (root / "sub" / "deeper" / "deepest").mkdir(parents=True)


def _remove_file(root):
    _writable(root / "sub")
    (root / "sub" / "g").unlink()


def _replace_file_same_bytes(root):
    _writable(root / "sub")
    (root / "sub" / "g").unlink()
    (root / "sub" / "g").write_bytes(b"data")


def _retarget_link(root):
    _writable(root)
    (root / "l").unlink()
    (root / "l").symlink_to("f")


def _link_made_before_its_time_was_fixed(root):
    os.utime(root / "l", (1_700_000_000, 1_700_000_000), follow_symlinks=False)


def _listed_dir_to_file(root):
    _writable(root)
    (root / "e").rmdir()
    (root / "e").write_bytes(b"")


def _link_to_dir(root):
    _writable(root)
    (root / "l").unlink()
    (root / "l").mkdir()


def _write_through(root):
    p = root / "f"
    p.chmod(0o644)
    p.write_bytes(b"DATA")


def _remove_implied_dir(root):
    _writable(root)
    for name in ("g",):
        _writable(root / "sub")
        (root / "sub" / name).unlink()
    (root / "sub").rmdir()


@pytest.mark.parametrize("tamper", [_add_file, _add_empty_dir, _add_nested_dirs, _remove_file, _replace_file_same_bytes,
                                    _retarget_link, _link_made_before_its_time_was_fixed, _listed_dir_to_file, _link_to_dir, _write_through,
                                    _remove_implied_dir])
def test_a_materialized_tree_changed_in_place_is_not_intact(cas, tmp_path, tamper):
    """The one-pass check of a materialized copy (how the next build checks a toolchain's 10,000
    files) finds every way its directory can differ from the tree."""
    a = cas.put_bytes(b"data")
    x = cas.put_bytes(b"#!/bin/sh\n", executable=True)
    tree = Tree({"f": a, "sub/g": a, "bin/x": x, "l": SymlinkEntry("sub/g"), "e": DirEntry()})
    root = cas.materialize(tree)
    cas.save_stamps()
    cas.close()
    assert LocalCas(tmp_path / "cache", B3)._is_intact(tree, root)  # the next build, nothing changed
    tamper(root)
    assert not LocalCas(tmp_path / "cache", B3)._is_intact(tree, root)


def test_a_blob_stored_is_trusted_by_the_next_build_until_it_is_written(cas, tmp_path, monkeypatch):
    """The stamp of a blob is recorded when it is stored (its bytes were hashed then): the next
    build does not hash it again (a fetched toolchain was re-hashed by the first build that
    used it); a write to it moves its stamp and is caught."""
    import build_graph.store.cas as cas_module

    a = cas.put_bytes(b"stored once" * 100)
    x = cas.put_bytes(b"#!/bin/sh\n", executable=True)
    cas.materialize(Tree({"f": a, "bin/x": x}))  # makes x's executable copy
    cas.save_stamps()
    hashed = []
    real = cas_module.hash_file
    monkeypatch.setattr(cas_module, "hash_file", lambda path, d: hashed.append(path) or real(path, d))
    later = LocalCas(tmp_path / "cache", B3)
    assert later.verify(a) and later.verify(x) and hashed == []
    path = cas.blob_path(a.digest)
    path.chmod(0o644)
    path.write_bytes(b"STORED ONCE" * 100)  # same size, other bytes
    path.chmod(0o444)  # mode put back: the moved ctime alone tells
    assert not LocalCas(tmp_path / "cache", B3).verify(a) and hashed


def test_materializing_keeps_the_verify_stamps_current(cas, tmp_path):
    """Linking a verified blob into a tree moves its ctime; the stamp follows, so the next
    build trusts the blob without re-hashing it (the gc test flaked on this at a clock tick)."""
    import json
    import time

    a = cas.put_bytes(b"data")
    x = cas.put_bytes(b"#!/bin/sh\n", executable=True)
    tree = Tree({"f": a, "bin/x": x})
    cas.close()
    later = LocalCas(tmp_path / "cache", B3)  # the next build: it hashes each blob once and stamps it
    assert later.verify_tree(tree) == []
    time.sleep(0.05)  # past the coarse kernel clock tick, so the links visibly move ctime
    later.materialize(tree)
    later.save_stamps()
    stamps = json.loads((cas.base / "verified.json").read_text())
    p = cas.blob_path(a.digest)
    st = p.stat()
    assert st.st_nlink == 2
    assert stamps[p.name] == filestate.of(st)


def test_a_blob_written_while_a_tree_is_materialized_is_never_taken_as_verified(cas, tmp_path, monkeypatch):
    """Only the instant around each link is taken on trust: a same-size write into a blob with its
    mtime put back (ctime alone moves) while the tree is being linked is caught by the next
    verify. The ctime change was taken into the stamp for every blob at the end of the whole
    materialize, which recorded such a write as hashed good (red team K11)."""
    import time

    import build_graph.store.cas as cas_module

    a = cas.put_bytes(b"first file")
    b = cas.put_bytes(b"other file")
    tree = Tree({"a": a, "b": b})
    cas.close()
    later = LocalCas(tmp_path / "cache", B3)
    assert later.verify_tree(tree) == []
    time.sleep(0.05)  # past the coarse kernel clock tick, so the write visibly moves ctime
    blob_b = later.blob_path(b.digest)
    real_link = os.link

    def link_then_write_b(src, dst, *args, **kw):
        real_link(src, dst, *args, **kw)
        if os.fspath(src) == os.fspath(later.blob_path(a.digest)):  # while a is linked, b is written
            st = blob_b.stat()
            blob_b.chmod(0o644)
            blob_b.write_bytes(b"OTHER FILE")
            blob_b.chmod(0o444)
            os.utime(blob_b, ns=(st.st_atime_ns, st.st_mtime_ns))

    monkeypatch.setattr(cas_module.os, "link", link_then_write_b)
    later.materialize(Tree({"a": a, "b": b}))
    monkeypatch.setattr(cas_module.os, "link", real_link)
    later.save_stamps()
    assert not LocalCas(tmp_path / "cache", B3).verify(b)  # re-hashed: the write is found
    assert LocalCas(tmp_path / "cache", B3).verify(a)


@pytest.mark.parametrize("node, why", [
    ({"files": [], "dirs": []}, "'symlinks'"),
    ({"files": [], "dirs": [], "symlinks": [["l", "a\0b"]]}, "a link target"),
    ({"files": [], "dirs": [], "symlinks": [["l", ""]]}, "a link target"),
    ({"files": [["x", "d" * 64, 1, False]], "dirs": [], "symlinks": [["x", "t"]]}, "a name listed twice"),
    ({"files": [["x", "d" * 64, -1, False]], "dirs": [], "symlinks": []}, "another shape"),
])
def test_a_directory_node_of_another_shape_is_corrupt(cas, node, why):
    """A node pulled from a remote is checked against its digest, not for what it says: one bgraph
    never writes is refused as corrupt (a signed node without "symlinks" broke every later build
    with a KeyError, a link target with NUL with a traceback: red team K12)."""
    import json

    raw = json.dumps(node).encode()
    digest = cas.digester.of(raw)
    cas.put_node(digest, raw)
    with pytest.raises(CorruptBlob, match=why):
        cas.get_tree(digest)


def test_only_declared_outputs_make_a_hit():
    """A cached tree with a path no declared output holds is not the action's (a local run keeps
    only what it declared; a remote entry may say anything)."""
    from build_graph.rebuilder import undeclared

    f = FileEntry("a" * 64, 1)
    tree = Tree({"o.txt": f, "d/x/y": f, "nested/out.o": f})
    assert undeclared(tree, ("o.txt", "d", "nested/out.o")) is None
    assert undeclared(tree, ("./o.txt", "d/", "nested/out.o")) is None
    assert undeclared(tree, ("o.txt", "d")) == "nested/out.o"
    assert undeclared(Tree({"stolen.txt": f}), ("o.txt",)) == "stolen.txt"


def test_action_cache(tmp_path, cas):
    ac = LocalActionCache(cas.base, cas.tmp)
    r = ActionResult("t" * 64, 0, "o" * 64, "e" * 64, 1.5, 3)
    key = "ab" + "c" * 62
    assert ac.get(key) is None
    ac.put(key, r)
    assert ac.get(key) == r
    assert (cas.base / "ac" / "ab" / ("c" * 62 + ".json")).is_file()
    (cas.base / "ac" / "ab" / ("c" * 62 + ".json")).write_text("{not json")
    assert ac.get(key) is None  # a damaged entry is a miss, never a crash
    ac.remove(key)
    assert ac.get(key) is None
    assert leftovers(cas) == []


def test_trace_files_are_distinct_per_label(cas):
    trace = Trace(cas.base, cas.tmp)
    labels = ["//a__b:c", "//a/b:c", "//a:b--c", "//a--b:c", "//:a--b__c"]
    for i, label in enumerate(labels):
        trace.save(label, {"n": i})
    assert [trace.load(label)["n"] for label in labels] == list(range(len(labels)))
    assert trace.load("//never:built") == {}


# -- corruption, end to end -----------------------------------------------------------------------
CHAIN = {
    "in.txt": "source text\n",
    "targets/p.toml": '[a]\nkind = "genrule"\nsrcs = ["in.txt"]\nouts = ["a.txt"]\n'
                      'cmd = "tr a-z A-Z < $SRC/in.txt > $OUT/a.txt"\n\n'
                      '[b]\nkind = "genrule"\nouts = ["b.txt"]\ndeps = { a = ":a" }\n'
                      'cmd = "rev < $IN_A/a.txt > $OUT/b.txt"\n',
}


def damage(ws, content: bytes, how: str) -> None:
    """Overwrite (same size) or truncate the blob holding `content`, as a disk error would."""
    path = ws.store / "cas" / B3.of(content)[:2] / B3.of(content)[2:]
    assert path.is_file(), "the blob should be in the store"
    path.chmod(0o644)
    with open(path, "r+b") as f:
        if how == "flip":
            data = bytearray(f.read())
            data[0] = ord("#") if data[0] != ord("#") else ord("%")
            f.seek(0)
            f.write(bytes(data))
        else:
            f.truncate(3)


@requires_bwrap
@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_corrupted_output_blob_is_rebuilt(make_ws, how):
    ws = make_ws(CHAIN)
    first = ws.build("//p:a", "//p:b")
    assert first.rc == 0, first.stderr
    assert ws.read_output("//p:a", "a.txt") == "SOURCE TEXT\n"
    damage(ws, b"SOURCE TEXT\n", how)

    run = ws.build("//p:a", "//p:b")
    assert run.rc == 0, run.stderr
    assert "corrupted" in run.stderr  # the warning
    a = action(run.json, "//p:a")
    assert a["status"] == "executed"
    assert "corrupted" in a["reason"] and "a.txt" in a["reason"]
    # b's inputs are identical once a is rebuilt: it is not run again.
    assert action(run.json, "//p:b")["status"] in ("hit", "cutoff")
    assert ws.read_output("//p:a", "a.txt") == "SOURCE TEXT\n"
    assert ws.read_output("//p:b", "b.txt") == "TXET ECRUOS\n"

    again = ws.build("//p:a", "//p:b")
    assert again.rc == 0 and again.json["executed"] == 0 and "corrupted" not in again.stderr


@requires_bwrap
def test_corrupted_source_blob_is_replaced_from_the_workspace(make_ws):
    """A bad blob of a *source* file must not reach an action: the workspace has the truth."""
    ws = make_ws(CHAIN)
    assert ws.build("//p:a", "//p:b").rc == 0
    damage(ws, b"source text\n", "flip")
    # Change the command so the action runs (and mounts its sources) again.
    ws.write({"targets/p.toml": CHAIN["targets/p.toml"].replace("tr a-z A-Z", "tr 'a-z' 'A-Z'")})
    run = ws.build("//p:a", "//p:b")
    assert run.rc == 0, run.stderr
    assert action(run.json, "//p:a")["status"] == "executed"
    assert ws.read_output("//p:a", "a.txt") == "SOURCE TEXT\n"


@requires_bwrap
def test_corrupted_executable_copy_is_detected(make_ws):
    """Executables are materialized from a `.x` copy of the blob; that copy is checked too."""
    ws = make_ws({"targets/p.toml": '[t]\nkind = "genrule"\nouts = ["tool"]\n'
                                    'cmd = "printf \'#!/bin/sh\\\\necho good\\\\n\' > tool; chmod +x tool"\n'})
    assert ws.build("//p:t").rc == 0
    content = (ws.root / "bgraph-out/p/t/tool").read_bytes()
    assert content == b"#!/bin/sh\necho good\n"
    x = ws.store / "cas" / B3.of(content)[:2] / (B3.of(content)[2:] + ".x")
    assert x.is_file()
    x.chmod(0o755)
    x.write_bytes(content.replace(b"good", b"evil"))
    run = ws.build("//p:t")
    assert run.rc == 0, run.stderr
    assert "corrupted" in run.stderr
    assert action(run.json, "//p:t")["status"] == "executed"
    assert (ws.root / "bgraph-out/p/t/tool").read_bytes() == content
    assert os.access(ws.root / "bgraph-out/p/t/tool", os.X_OK)


@pytest.mark.parametrize("name", ["..", ".", "", "a/b"])
def test_tree_node_naming_a_path_outside_is_refused(cas, name):
    """A node is checked against its digest; what it names must be checked too (a remote
    could serve a well-hashed node that names `..`)."""
    blob = cas.put_bytes(b"x")
    raw = canonical_json({"dirs": [], "files": [[name, blob.digest, blob.size, False]], "symlinks": []})
    digest = B3.of(raw)
    cas.put_node(digest, raw)
    with pytest.raises(CorruptBlob, match="refused"):
        cas.get_tree(digest)


def test_materialize_never_writes_through_symlinks(cas, tmp_path):
    """A tree merged from several sources may put a symlink where another has a directory."""
    a = cas.put_bytes(b"boom")
    tree = Tree({"x/l": SymlinkEntry("../.."), "y": a}).merged(Tree({"x/l/escaped": a}))
    with pytest.raises(StoreError, match="'x/l/escaped' lies below non-directory 'x/l'"):
        cas.materialize(tree)
    assert not list(tmp_path.rglob("escaped"))
    assert leftovers(cas) == []


# -- a full disk ----------------------------------------------------------------------------------
@pytest.fixture
def tiny_cache(tmp_path):
    """A 4 MiB tmpfs as the cache directory (needs root, as CI runs)."""
    import os
    import subprocess
    path = tmp_path / "tiny-cache"
    path.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(path)]).returncode:
        pytest.skip("mounting a small tmpfs needs root")
    yield path
    subprocess.run(["umount", str(path)])


@requires_bwrap
def test_full_cache_disk_gives_one_line_and_leaves_no_staging(make_ws, tiny_cache):
    ws = make_ws({"targets/p.toml": '[big]\nkind = "genrule"\nouts = ["big.bin"]\n'
                                    'cmd = "head -c 6000000 /dev/zero > $OUT/big.bin"\n'}, cache=tiny_cache)
    for _ in range(2):  # the second build starts over a cache the first one filled
        run = ws.cli("build", "//p:big")
        assert run.rc == 1
        assert f"no space left in the cache directory {tiny_cache}" in run.output
        assert "MiB free" in run.output and "Traceback" not in run.output
        assert [p.name for p in (tiny_cache / "v1" / "tmp").iterdir()] == []  # staging removed


@requires_bwrap
def test_full_disk_names_the_cache_the_workspace_configures(make_ws, tiny_cache):
    """No --cache-dir and no $BGRAPH_CACHE: the cache is WORKSPACE.toml's defaults.cache_dir, and a
    disk filled while storing a source must name that directory, not ~/.cache/bgraph."""
    import subprocess
    import sys

    from bgraph_testlib import hermetic_env
    ws = make_ws({"WORKSPACE.toml": f'[workspace]\nname = "t"\n[defaults]\ncache_dir = "{tiny_cache}"\n',
                  "big.bin": b"\1" * 6_000_000,
                  "targets/p.toml": '[a]\nkind = "genrule"\nsrcs = ["big.bin"]\nouts = ["o"]\n'
                                    'cmd = "wc -c < $SRC/big.bin > $OUT/o"\n'})
    proc = subprocess.run([sys.executable, "-m", "build_graph", "-C", str(ws.root), "build", "//p:a"],
                          capture_output=True, text=True, env=hermetic_env(), timeout=120)
    assert proc.returncode in (1, 2)
    assert f"no space left in the cache directory {tiny_cache}" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


def test_a_blob_whose_mode_changed_is_hashed_and_its_mode_put_back(cas):
    """A chmod through a linked output changes every tree that links the blob: the stamp no
    longer holds, the bytes are hashed, and (sound) the blob's mode is put back for all of them."""
    e = cas.put_bytes(b"plain")
    path = cas.blob_path(e.digest)
    path.chmod(0o755)
    fresh = LocalCas(cas.base.parent.parent, B3)
    assert fresh.verify(e) and stat.S_IMODE(path.stat().st_mode) == 0o444
    path.chmod(0o644)
    path.write_bytes(b"PLAIN")  # and with other bytes: removed
    assert not LocalCas(cas.base.parent.parent, B3).verify(e) and not path.exists()


# -- what an action can leave in its output directory (red-team read K6) ------------------------
def _flags_settable(path) -> bool:
    """Whether this file system lets an owner set an inode flag (nodump) on `path`."""
    import fcntl
    fd = os.open(path, os.O_RDONLY)
    try:
        flags = int.from_bytes(fcntl.ioctl(fd, 0x80086601, b"\0" * 8), "little")
        fcntl.ioctl(fd, 0x40086602, (flags | 0x40).to_bytes(8, "little"))  # FS_IOC_SETFLAGS, FS_NODUMP_FL
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def test_a_moved_output_carrying_an_xattr_or_inode_flag_becomes_a_bare_blob(cas):
    """An output is moved into the store as it is only when it carries nothing a fresh file does
    not: one with a user.* xattr (an ACL is one too) or an inode flag gets a fresh blob of its
    bytes, so no other target or source with those bytes, and no dependant, sees the mark."""
    from build_graph.store.cas import inode_marks
    marked = cas.tmp / "x"
    marked.write_bytes(b"shared-content\n")
    try:
        os.setxattr(marked, "user.evil", b"planted")
    except OSError:
        pytest.skip("this file system takes no user.* xattr")
    e = cas.put_file(marked, move=True)
    blob = cas.blob_path(e.digest)
    assert os.listxattr(blob) == [] and cas.read_bytes(e) == b"shared-content\n"
    assert stat.S_IMODE(blob.stat().st_mode) == 0o444
    marked.unlink()  # the caller empties the output directory
    assert leftovers(cas) == []
    flagged = cas.tmp / "y"
    flagged.write_bytes(b"flagged\n")
    if _flags_settable(flagged):
        e = cas.put_file(flagged, move=True)
        fd = os.open(cas.blob_path(e.digest), os.O_RDONLY)
        try:
            fresh_fd = os.open(cas.blob_path(cas.put_bytes(b"fresh").digest), os.O_RDONLY)
            assert inode_marks(fd) == inode_marks(fresh_fd)
            os.close(fresh_fd)
        finally:
            os.close(fd)
        flagged.unlink()
    plain = cas.tmp / "z"
    plain.write_bytes(b"plain\n")
    ino = plain.stat().st_ino
    e = cas.put_file(plain, move=True)  # nothing on it: still moved, not copied
    assert not plain.exists() and cas.blob_path(e.digest).stat().st_ino == ino


def test_the_executable_copy_of_a_sparse_blob_stays_sparse(cas):
    """A sparse executable output (1 GiB claimed, no block used) costs no disk when its `.x`
    copy is made: holes are copied as holes, data regions as data."""
    out = cas.tmp / "big"
    with open(out, "wb") as f:
        f.truncate(1 << 30)
        f.seek(1 << 29)
        f.write(b"data in the middle")
    out.chmod(0o755)
    e = cas.put_file(out, move=True)
    assert e.executable and e.size == 1 << 30
    x = cas._exec_blob(e)
    assert x.stat().st_size == 1 << 30 and x.stat().st_blocks * 512 < 1 << 20
    with open(x, "rb") as f:
        f.seek(1 << 29)
        assert f.read(18) == b"data in the middle"
    assert cas.verify(e)


def _nested(top, depth: int) -> None:
    """`top`/d/d/… `depth` directories deep, made by relative steps (the path outgrows PATH_MAX)."""
    here = os.getcwd()
    try:
        os.chdir(top)
        for _ in range(depth):
            os.mkdir("d")
            os.chdir("d")
        with open("f", "w") as f:
            f.write("deep")
    finally:
        os.chdir(here)


def test_rmtree_removes_fifos_sockets_links_and_deep_unreadable_trees(tmp_path):
    """cas.rmtree empties whatever an action leaves: a FIFO is unlinked, never opened (shutil
    opened it and hung); a socket is unlinked (shutil raised a TypeError); a link is removed,
    never followed; read-only and mode-0 directories are made u+rwx; a tree 2,100 deep (beyond
    PATH_MAX and Python's recursion) is removed with two descriptors open."""
    import socket
    import threading

    from build_graph.store.cas import rmtree
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("mine")
    top = tmp_path / "out"
    top.mkdir()
    os.mkfifo(top / "fifo")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(top / "sock"))
    sock.close()
    os.symlink(outside, top / "link")
    (top / "ro" / "none").mkdir(parents=True)
    (top / "ro" / "f").write_text("x")
    os.chmod(top / "ro" / "none", 0)
    os.chmod(top / "ro", 0o500)
    _nested(top, 2100)
    done = threading.Event()
    failed = []

    def remove():
        try:
            rmtree(top)
        except BaseException as e:  # reported below
            failed.append(e)
        done.set()

    threading.Thread(target=remove, daemon=True).start()
    if not done.wait(120):
        os.close(os.open(top / "fifo", os.O_WRONLY | os.O_NONBLOCK))  # let a hung open return
        pytest.fail("rmtree hung on the FIFO")
    assert failed == []
    assert not os.path.lexists(top) and (outside / "keep").read_text() == "mine"
    rmtree(top)  # gone: nothing to do
    link = tmp_path / "l"
    os.symlink(outside, link)
    rmtree(link)
    assert not os.path.lexists(link) and (outside / "keep").exists()


def test_an_output_tree_too_deep_is_refused_in_one_line_and_a_deep_one_is_stored(cas):
    """ingest_dir walks with its own stack: a directory nested beyond MAX_DEPTH is refused with
    a StoreError (not a RecursionError, not an unreadable level skipped in silence), and a tree
    just within it is stored, read back and materialized."""
    from build_graph.store.cas import MAX_DEPTH, rmtree
    ok, deep = cas.tmp / "ok", cas.tmp / "deep"
    ok.mkdir()
    deep.mkdir()
    _nested(ok, MAX_DEPTH - 2)
    _nested(deep, 2100)
    try:
        tree = cas.ingest_dir(cas.tmp, ["ok"], move=True)
        (path,) = tree.entries
        assert path.count("/") == MAX_DEPTH - 1 and path.endswith("/f")
        assert cas.get_tree(cas.put_tree(tree)) == tree
        assert (cas.materialize(tree) / path).read_text() == "deep"
        with pytest.raises(StoreError, match="nested 257 levels"):
            cas.ingest_dir(cas.tmp, ["deep"], move=True)
    finally:
        rmtree(deep)  # pytest's own cleanup (shutil) recurses


def test_an_unreadable_output_directory_is_refused_not_skipped(cas):
    """A directory the walk cannot list fails the store naming it (os.walk skipped it and stored
    the tree without it)."""
    if os.geteuid() == 0:
        pytest.skip("root lists any directory")
    out = cas.tmp / "o"
    (out / "hidden").mkdir(parents=True)
    (out / "hidden" / "f").write_text("x")
    os.chmod(out / "hidden", 0)
    try:
        with pytest.raises(StoreError, match="cannot read output directory o/hidden"):
            cas.ingest_dir(cas.tmp, ["o"], move=True)
    finally:
        os.chmod(out / "hidden", 0o755)


# -- a blob with the file system's most links ---------------------------------------------------
def test_a_blob_with_the_most_links_is_copied_into_a_tree_and_the_copy_is_checked(tmp_path):
    """Red team R10 (link_exhaustion): other targets' trees gave a common blob (an empty file)
    ext4's 65,000 links, and every later tree holding it failed. The tree gets a copy of the
    blob instead, read-only with the fixed time; a later process finds the tree intact without
    re-hashing it, `cache verify` finds it whole, and a write into the copy is found."""
    import errno

    from build_graph.store import upkeep

    cas = LocalCas(tmp_path / "cache", B3)
    entry, other = cas.put_bytes(b""), cas.put_bytes(b"x")
    crowd = tmp_path / "crowd"  # stands for the trees of other targets
    crowd.mkdir()
    blob, n = cas.blob_path(entry.digest), 0
    try:
        while n < 70_000:
            os.link(blob, crowd / str(n))
            n += 1
        pytest.skip("this file system has no hard link limit under 70,000")
    except OSError as e:
        assert e.errno == errno.EMLINK
    tree = Tree({"pkg/__init__.py": entry, "pkg/x": other, "tool": FileEntry(entry.digest, 0, True)})
    dest = cas.materialize(tree)
    st = os.lstat(dest / "pkg/__init__.py")
    assert (st.st_nlink, stat.S_IMODE(st.st_mode), st.st_mtime, (dest / "pkg/__init__.py").read_bytes()) == (
        1, 0o444, FIXED_MTIME, b"")
    # The others are links as ever (an executable links the blob's own executable copy).
    assert os.lstat(dest / "pkg/x").st_nlink == os.lstat(dest / "tool").st_nlink == 2
    cas.save_stamps()
    later = LocalCas(tmp_path / "cache", B3)
    assert any("@" in name for name in later._stamps.table)  # the copy's own stamp, kept
    assert later._is_intact(tree, dest)
    assert not upkeep.verify(cas.layout_root, B3).bad_trees
    copy = dest / "pkg/__init__.py"
    for poison in (b"poison", b"x"):  # R11: another good blob's bytes are no sound copy either
        os.chmod(copy, 0o644)
        copy.write_bytes(poison)
        os.chmod(copy, 0o444)
        assert not LocalCas(tmp_path / "cache", B3)._is_intact(tree, dest)
        assert upkeep.verify(cas.layout_root, B3).bad_trees == [dest.name]
    for i in range(n):
        os.unlink(crowd / str(i))


def test_a_result_filed_over_another_moves_the_generation(tmp_path):
    """Two builds at once of a non-reproducible action each file their own result under its key:
    the second replaces the first, which a record or memo of the first build may hold (red team
    R12). Filing other outputs (or another exit code) over an entry moves the cache's generation;
    filing the same outputs again, or a first result, does not."""
    from build_graph.store.uptodate import generation_path, stamp_of

    cas = LocalCas(tmp_path / "cache", B3)
    ac = LocalActionCache(cas.base, cas.tmp)
    one, two = (ActionResult(cas.put_tree(Tree({"o": cas.put_bytes(data)})), 0, "", "", 0.1) for data in (b"1", b"2"))
    generation = generation_path(cas.layout_root)

    def moved(put) -> bool:
        before = stamp_of(generation)
        time.sleep(0.01)
        put()
        return stamp_of(generation) != before

    assert not moved(lambda: ac.put("ab" * 32, one))  # the first result
    assert not moved(lambda: ac.put("ab" * 32, ActionResult(one.output_tree, 0, "", "", 0.7)))  # same outputs, rerun
    assert moved(lambda: ac.put("ab" * 32, two))  # other outputs
    assert moved(lambda: ac.put("ab" * 32, ActionResult(two.output_tree, 1, "", "", 0.1)))  # another exit code
    assert ac.get("ab" * 32).exit_code == 1
