"""The local CAS, action cache and trace: atomic writes, verified reads, corruption recovery."""

from __future__ import annotations

import os
import stat
import threading

import pytest

from bgraph_testlib import action, requires_bwrap
from build_graph.incremental import filestate
from build_graph.model import ActionResult, DirEntry, Digester, FileEntry, SymlinkEntry, Tree, canonical_json
from build_graph.store.action_cache import LocalActionCache
from build_graph.store.cas import CorruptBlob, LocalCas, StoreError
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
    assert (root / "e").is_dir()
    assert os.access(root / "bin/x", os.X_OK) and not os.access(root / "f", os.X_OK)
    assert stat.S_IMODE((root / "bin/x").stat().st_mode) == 0o555
    assert stat.S_IMODE((root / "f").stat().st_mode) == 0o444
    assert stat.S_IMODE((root / "sub").stat().st_mode) == 0o555
    assert cas.materialize(tree) == root  # reused
    assert leftovers(cas) == []


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
                                    _retarget_link, _listed_dir_to_file, _link_to_dir, _write_through,
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
