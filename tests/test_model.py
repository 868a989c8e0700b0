"""Digests, Merkle trees and action keys."""

from __future__ import annotations

import hashlib
import json

import blake3
import pytest

from bgraph_testlib import action, recorded_traces, requires_bwrap
from build_graph.incremental.discovery import Depfile, Preprocessed, RecordedMacros
from build_graph.model import (Action, DirEntry, Digester, FileEntry, HostTool, SymlinkEntry, Tree,
                               canonical_json, check_relpath, key_json)

B3 = Digester("blake3")
SHA = Digester("sha256")


def f(data: bytes, executable: bool = False, d: Digester = B3) -> FileEntry:
    return FileEntry(d.of(data), len(data), executable)


def sample_tree() -> Tree:
    return Tree({
        "README": f(b"hello\n"),
        "bin/tool": f(b"#!/bin/sh\n", executable=True),
        "src/a/x.c": f(b"int x;\n"),
        "src/a/y.c": f(b"int y;\n"),
        "src/b/z.c": f(b"int z;\n"),
        "link": SymlinkEntry("src/a"),
        "empty": DirEntry(),
    })


# -- digesters ---------------------------------------------------------------------------
def test_digesters_match_reference_implementations():
    data = b"bgraph\x00" * 1000
    assert B3.of(data) == blake3.blake3(data).hexdigest()
    assert SHA.of(data) == hashlib.sha256(data).hexdigest()
    assert B3.of(data) != SHA.of(data)
    assert len(B3.of(b"")) == len(SHA.of(b"")) == 64


def test_unknown_digest_function():
    with pytest.raises(ValueError, match="unknown digest function 'md5'"):
        Digester("md5")


def test_key_json_is_canonical_json_byte_for_byte():
    """Keys and tree nodes are hashed over key_json (orjson); every stored key was first made
    with canonical_json (json): the two must never differ on what keys are made of."""
    import random

    rng = random.Random(0)
    chars = [chr(i) for i in range(0, 300)] + ["é", "字", "😀", "\u2028", "\u2029", "\\", '"', "/"]
    for _ in range(3000):
        s = "".join(rng.choice(chars) for _ in range(rng.randint(0, 10)))
        value = {"dirs": [[s, "ab"]], "files": [[s + "x", "cd", rng.randint(0, 2**62), rng.random() < 0.5]],
                 "symlinks": [[s, s]], s: None, "k" + s: [1, True, None, -5, {"z": s, "a": []}]}
        assert key_json(value) == canonical_json(value), repr(s)


def test_canonical_json_is_order_independent():
    assert canonical_json({"b": 1, "a": [1, {"d": 2, "c": 3}]}) == canonical_json({"a": [1, {"c": 3, "d": 2}], "b": 1})
    assert canonical_json({"é": "ü"}) == '{"é":"ü"}'.encode()


# -- trees -------------------------------------------------------------------------------
def test_tree_digest_is_stable():
    # A fixed value: a change in the encoding changes every key in every cache (bump the layout).
    t = Tree({"a.txt": FileEntry(B3.of(b"a"), 1)})
    root = canonical_json({"dirs": [], "files": [["a.txt", B3.of(b"a"), 1, False]], "symlinks": []})
    assert t.digest(B3) == B3.of(root)
    assert Tree().digest(B3) == B3.of(canonical_json({"dirs": [], "files": [], "symlinks": []}))
    # The nested tree (subdirectories, a symlink, an empty directory, an executable) against
    # digests recorded once: any change to how nodes are encoded or nested must show here.
    assert sample_tree().digest(B3) == "66be224fd1f67a43e4be72cf742a33b24239623df74e2bc09f81f0fff6c82285"
    assert sample_tree().digest(SHA) == "78fc436d484cbe44fbaf601e69893587c1000b4636bf8daa7d352c00949e71f7"
    # And by hand: the root node names each subdirectory by its name and its own node's digest.
    src_a = canonical_json({"dirs": [], "files": [["x.c", B3.of(b"int x;\n"), 7, False],
                                                  ["y.c", B3.of(b"int y;\n"), 7, False]], "symlinks": []})
    src_b = canonical_json({"dirs": [], "files": [["z.c", B3.of(b"int z;\n"), 7, False]], "symlinks": []})
    src = canonical_json({"dirs": [["a", B3.of(src_a)], ["b", B3.of(src_b)]], "files": [], "symlinks": []})
    bin_ = canonical_json({"dirs": [], "files": [["tool", B3.of(b"#!/bin/sh\n"), 10, True]], "symlinks": []})
    empty = canonical_json({"dirs": [], "files": [], "symlinks": []})
    root = canonical_json({"dirs": [["bin", B3.of(bin_)], ["empty", B3.of(empty)], ["src", B3.of(src)]],
                           "files": [["README", B3.of(b"hello\n"), 6, False]], "symlinks": [["link", "src/a"]]})
    assert sample_tree().digest(B3) == B3.of(root)


def test_tree_equal_regardless_of_insertion_order():
    items = list(sample_tree().entries.items())
    t1 = Tree(items)
    t2 = Tree(reversed(items))
    t3 = Tree(dict(sorted(items, key=lambda kv: hash(kv[0]))))
    assert t1 == t2 == t3
    assert hash(t1) == hash(t2)
    assert t1.digest(B3) == t2.digest(B3) == t3.digest(B3)
    assert t1.digest(SHA) == t2.digest(SHA)


def test_tree_is_merkle():
    base = sample_tree()
    nodes = base.directory_nodes(B3)
    assert set(nodes) == {"", "bin", "src", "src/a", "src/b", "empty"}
    # The root node refers to its subdirectories by digest.
    root = json.loads(nodes[""][1])
    assert ["src", nodes["src"][0]] in root["dirs"]
    assert ["empty", nodes["empty"][0]] in root["dirs"]
    assert ["link", "src/a"] in root["symlinks"]

    changed = Tree({**base.entries, "src/a/x.c": f(b"int x = 1;\n")})
    new_nodes = changed.directory_nodes(B3)
    assert changed.digest(B3) != base.digest(B3)
    # Only the directories on the path to the change get new digests.
    assert new_nodes["src/a"][0] != nodes["src/a"][0]
    assert new_nodes["src"][0] != nodes["src"][0]
    assert new_nodes["src/b"][0] == nodes["src/b"][0]
    assert new_nodes["bin"][0] == nodes["bin"][0]


@pytest.mark.parametrize("change", [
    lambda e: {**e, "bin/tool": f(b"#!/bin/sh\n", executable=False)},   # exec bit
    lambda e: {**e, "link": SymlinkEntry("src/b")},                       # link target
    lambda e: {**{k: v for k, v in e.items() if k != "empty"}},          # an empty dir removed
    lambda e: {**e, "src/a/new": f(b"")},                                 # a file added
    lambda e: {k.replace("src/b/z.c", "src/b/w.c"): v for k, v in e.items()},  # a rename
])
def test_every_kind_of_change_changes_the_root(change):
    base = sample_tree()
    assert Tree(change(dict(base.entries))).digest(B3) != base.digest(B3)


def test_tree_digest_depends_on_digest_function():
    assert sample_tree().digest(B3) != sample_tree().digest(SHA)


def test_tree_paths_are_checked():
    for bad in ("/etc/passwd", "../x", "a/../../x", "."):
        with pytest.raises(ValueError, match="escapes the tree root"):
            Tree({bad: f(b"x")})
    assert check_relpath("a/./b") == "a/b"


def test_tree_operations():
    t = sample_tree()
    assert t.subtree("src").entries == {"a/x.c": t.entries["src/a/x.c"], "a/y.c": t.entries["src/a/y.c"],
                                        "b/z.c": t.entries["src/b/z.c"]}
    assert t.subtree("src").prefixed("src") == t.select(["src"])
    assert set(t.select(["src/a", "README"]).entries) == {"README", "src/a/x.c", "src/a/y.c"}
    assert set(t.files()) == {"README", "bin/tool", "src/a/x.c", "src/a/y.c", "src/b/z.c"}
    merged = Tree({"a": f(b"1")}).merged(Tree({"b": f(b"2")}), Tree({"a": f(b"1")}))
    assert set(merged.entries) == {"a", "b"}
    with pytest.raises(ValueError, match="conflicting entries for 'a'"):
        Tree({"a": f(b"1")}).merged(Tree({"a": f(b"2")}))
    ex = t.with_executable(lambda p: p.startswith("src/a/"))
    assert ex.entries["src/a/x.c"].executable and not ex.entries["src/b/z.c"].executable


# -- action keys ---------------------------------------------------------------------------
def base_action(**kw) -> Action:
    fields = dict(
        name="genrule", mnemonic="Genrule", argv=("/bin/sh", "-c", "cp $SRC/a $OUT/b"),
        env=(("LC_ALL", "C"), ("PATH", "/usr/bin")),
        inputs=(("/bgraph/src", Tree({"a": f(b"aaa")})),), outputs=("b",), platform="x86_64",
        host_paths=("/usr",), host_tools=(HostTool("/usr/bin/sh", "", B3.of(b"sh")),),
        rule_version="genrule/1")
    fields.update(kw)
    return Action(**fields)


def test_action_key_ignores_name():
    assert base_action().key(B3) == base_action(name="something else").key(B3)


@pytest.mark.parametrize("change", [
    dict(argv=("/bin/sh", "-c", "cp $SRC/a $OUT/b ")),
    dict(env=(("LC_ALL", "C"), ("PATH", "/usr/bin:/bin"))),
    dict(env=(("LC_ALL", "C"), ("PATH", "/usr/bin"), ("X", "1"))),
    dict(inputs=(("/bgraph/src", Tree({"a": f(b"aab")})),)),
    dict(inputs=(("/bgraph/src", Tree({"a": f(b"aaa", executable=True)})),)),
    dict(inputs=(("/bgraph/in/x", Tree({"a": f(b"aaa")})),)),
    dict(outputs=("b", "c")),
    dict(platform="aarch64"),
    dict(host_tools=(HostTool("/usr/bin/sh", "", B3.of(b"dash 0.6")),)),
    dict(rule_version="genrule/2"),
    dict(mnemonic="Other"),
    dict(kind="extract"),
    dict(toolchain="0" * 64),
    dict(spec=(("sha256", "0" * 64),)),
    dict(cwd="/bgraph/out/sub"),
    dict(host_paths=("/usr", "/opt")),
    dict(staged="/bgraph/src"),
    dict(discovery=Depfile(("/bgraph/src",))),
    dict(discovery=Depfile(depfiles=("a.d",))),
    dict(discovery=RecordedMacros(record="a.macros")),
])
def test_action_key_changes_with_what_it_runs(change):
    assert base_action(**change).key(B3) != base_action().key(B3)


def test_discovery_joins_the_key_spelled_as_the_action_fields_it_replaced():
    """narrow, depfiles and macro_record were Action fields; the strategy that holds them now writes
    them into the description as they were (sorted mounts, lists, only when set), so no key moved.
    A depfile alone narrows nothing: such an action is keyed on all its inputs, not manifested."""
    argv = ("gcc", "-D__CUDA_ARCH__=1200", "-E", "a.cu")
    strategy = Preprocessed(("/bgraph/src", "/bgraph/ext/x"), ("a.d",), "a.macros")
    action = base_action(argv=argv, discovery=strategy)
    old_spelling = {**base_action(argv=argv).description(B3), "narrow": ["/bgraph/ext/x", "/bgraph/src"],
                    "depfiles": ["a.d"], "macro_record": "a.macros"}
    assert action.description(B3) == old_spelling and action.key(B3) == B3.of_json(old_spelling)
    assert action.prekey_description(B3)["argv"] == ["gcc", "-E", "a.cu", "(-D/-U left out: recorded per run)"]
    assert action.prekey_description(B3)["inputs"]["/bgraph/src"] == "narrowed" and action.manifested
    assert not base_action(discovery=Preprocessed(depfiles=("a.d",))).manifested
    assert base_action(discovery=RecordedMacros(record="a.macros")).manifested
    assert not base_action(discovery=Depfile(("/bgraph/src",)), cacheable=False).manifested


def test_action_key_depends_on_digest_function():
    a = base_action()
    k1 = a.key(B3)
    assert a.key(SHA) != k1
    assert a.key(B3) == k1  # the cached key follows the digester asked for


def test_action_key_ignores_memory_and_cacheability():
    key = base_action().key(B3)
    assert base_action(memory_mb=1).key(B3) == base_action(memory_mb=9999).key(B3) == key
    assert base_action().cacheable is True
    assert base_action(cacheable=False).key(B3) == key
    assert base_action(cacheable=False, memory_mb=1).key(SHA) == base_action().key(SHA)


# -- no host paths in keys: the same workspace in two directories -------------------------------
GENRULE_WS = {
    "src/in.txt": "hello\n",
    "targets/p.toml": '[a]\nkind = "genrule"\nsrcs = ["src/in.txt"]\nouts = ["a.txt"]\n'
                      'cmd = "pwd > $OUT/a.txt; cat $SRC/src/in.txt >> $OUT/a.txt"\n\n'
                      '[b]\nkind = "genrule"\nouts = ["b.txt"]\ndeps = { a = ":a" }\n'
                      'cmd = "cat $IN_A/a.txt > $OUT/b.txt"\n',
}


@requires_bwrap
def test_action_keys_contain_no_host_paths(make_ws, tmp_path):
    ws1 = make_ws(GENRULE_WS, name="first")
    ws2 = make_ws(GENRULE_WS, name="second/elsewhere/deeper")
    r1, r2 = ws1.build("//p:b"), ws2.build("//p:b")
    assert r1.rc == 0 and r2.rc == 0, r1.stderr + r2.stderr
    s1, s2 = r1.json, r2.json
    for label in ("//p:a", "//p:b"):
        assert action(s1, label)["key"] == action(s2, label)["key"]
        assert action(s1, label)["status"] == action(s2, label)["status"] == "executed"
    # And no host path appears in the recorded action descriptions.
    # (A trace names the workspace whose build wrote it, for explain/why on a shared cache: that
    # is who built it, not what the actions saw.)
    traces = recorded_traces(ws1).values()
    assert all(t.get("workspace") == str(ws1.root) for t in traces)
    trace = "".join(json.dumps({k: v for k, v in t.items() if k != "workspace"}) for t in traces)
    assert '"argv"' in trace
    assert str(tmp_path) not in trace
    # A third copy sharing the first cache is fully cached.
    ws3 = make_ws(GENRULE_WS, name="third", cache=ws1.cache)
    r3 = ws3.build("//p:b")
    assert r3.rc == 0 and r3.json["executed"] == 0 and r3.json["hits"] == 2
