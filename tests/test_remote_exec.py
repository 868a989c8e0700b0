"""Remote execution's client (issue 36, item 1): an action as REAPI Action + Command + input
root, and builds through BuildGrid with `bgraph worker`s (tests/remote_exec_servers.py).

The translation tests need no server: the input root of an action, decoded back from its
Directory messages, is compared with what the local bubblewrap sandbox shows the same action
(listed from inside it by a real run), so the two views cannot drift apart."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest

from bgraph_testlib import requires_bwrap
from build_graph.model import Action, Digester, DirEntry, FileEntry, SymlinkEntry, Tree
from build_graph.remote_exec.client import SANDBOX_VERSION, platform_properties
from build_graph.remote_exec.input_root import (Encoder, NotRemotable, out_relative, output_paths,
                                                working_directory)
from build_graph.store.cas import LocalCas
from build_graph.store.reapi import reapi_pb2 as pb

# Lists the sandbox's filesystem from inside it with dash built-ins and readlink: one line per
# entry, "<kind> <path>[ -> <target>]" (f: file, x: executable file, d: directory, l: link).
LISTER = r"""
walk() {
  for e in "$1"/* "$1"/.[!.]*; do
    [ -e "$e" ] || [ -L "$e" ] || continue
    if [ -L "$e" ]; then echo "l $e -> $(readlink "$e")"
    elif [ -d "$e" ]; then echo "d $e"; walk "$e"
    elif [ -x "$e" ]; then echo "x $e"
    else echo "f $e"; fi
  done
}
top=$(for t in /*; do case "$t" in /proc|/dev|/tmp) ;; *) echo "$t";; esac; done)
listing=$(for t in $top; do
  if [ -L "$t" ]; then echo "l $t -> $(readlink "$t")"; else echo "d $t"; walk "$t"; fi
done)
mkdir -p "$OUT/d"
echo "$listing" > "$OUT/listing"
echo made > "$OUT/d/x"
"""


def host_usr(cas: LocalCas) -> Tree:
    """A tiny pinned /usr made of the host's dash, readlink, libc and loader (real binaries)."""
    files = {"bin/sh": "/usr/bin/dash", "bin/readlink": "/usr/bin/readlink",
             "lib/x86_64-linux-gnu/libc.so.6": "/lib/x86_64-linux-gnu/libc.so.6",
             "lib64/ld-linux-x86-64.so.2": "/lib64/ld-linux-x86-64.so.2"}
    return Tree({p: cas.put_file(os.path.realpath(src), executable=True) for p, src in files.items()})


def sample_action(cas: LocalCas, staged: bool = True) -> Action:
    """An action with every kind of mount: a pinned /usr, sources with an empty directory and a
    link, a dependency (staged into the output directory), declared outputs with a parent."""
    src = Tree({"a.txt": cas.put_bytes(b"a\n"), "sub/b.sh": cas.put_bytes(b"#!/bin/sh\n", True),
                "empty": DirEntry(), "link": SymlinkEntry("a.txt")})
    dep = Tree({"gen/h.h": cas.put_bytes(b"int x;\n"), "top": cas.put_bytes(b"t\n")})
    return Action(name="list", mnemonic="Genrule", argv=("/bin/sh", "-c", LISTER),
                  env=(("OUT", "/bgraph/out"), ("PATH", "/usr/bin"), ("LC_ALL", "C")),
                  inputs=(("/bgraph/in/dep", dep), ("/bgraph/src", src), ("/usr", host_usr(cas))),
                  outputs=("listing", "d/x"), platform="x86_64", staged="/bgraph/in/dep" if staged else None)


def decoded(encoded, root_hash: str | None = None, prefix: str = "") -> set[str]:
    """The input root's entries in the lister's notation, read back from the Directory messages."""
    lines = set()
    directory = pb.Directory.FromString(encoded.directories[root_hash or encoded.root[0]])
    for f in directory.files:
        lines.add(f"{'x' if f.is_executable else 'f'} {prefix}/{f.name}")
    for s in directory.symlinks:
        lines.add(f"l {prefix}/{s.name} -> {s.target}")
    for d in directory.directories:
        lines.add(f"d {prefix}/{d.name}")
        lines |= decoded(encoded, d.digest.hash, f"{prefix}/{d.name}")
    return lines


@pytest.fixture
def cas(tmp_path) -> LocalCas:
    return LocalCas(tmp_path / "cache", Digester("blake3"))


def sha256_encoder(cas: LocalCas) -> Encoder:
    from build_graph.remote_exec.input_root import DigestMap
    return Encoder(pb, "sha256", DigestMap(cas, "sha256").remote)


@requires_bwrap
@pytest.mark.skipif(not os.path.exists("/lib/x86_64-linux-gnu/libc.so.6"), reason="an x86_64 Debian host's libc")
def test_input_root_is_the_local_sandboxes_view(cas):
    """Run the action in the local sandbox, which lists what it sees before writing; the input
    root decoded from its REAPI messages holds exactly those entries (links with their targets,
    executable bits), plus the outputs the action then made."""
    from build_graph.sandbox import BwrapRunner
    action = sample_action(cas)
    runner = BwrapRunner(cas)
    try:
        tree, _result = runner.run(action)
    finally:
        runner.close()
    seen = set(cas.read_bytes(tree.entries["listing"]).decode().split("\n")) - {""}
    encoded = sha256_encoder(cas).input_root(action)
    # The lister made d/ (an output's parent, which both views already hold) before listing.
    assert seen == decoded(encoded)
    assert "l /bin -> usr/bin" in seen and "l /bgraph/out/gen/h.h -> /bgraph/in/dep/gen/h.h" in seen
    assert "d /bgraph/src/empty" in seen and "x /bgraph/src/sub/b.sh" in seen and "d /bgraph/out/d" in seen


def test_input_root_digests_are_the_servers_function(cas):
    """A blake3 workspace on a sha256 server: every file and Directory is named by its sha256,
    and a Directory's digest is that of its serialized bytes."""
    action = sample_action(cas)
    encoded = sha256_encoder(cas).input_root(action)
    for h, entry in encoded.files.items():
        assert hashlib.sha256(cas.read_bytes(entry)).hexdigest() == h
    for h, data in encoded.directories.items():
        assert hashlib.sha256(data).hexdigest() == h
    assert encoded.root[1] == len(encoded.directories[encoded.root[0]])
    # Same action, same root: the encoding is deterministic (and memoized per tree).
    assert sha256_encoder(cas).input_root(sample_action(cas)).root == encoded.root
    # One changed byte of one input changes the root.
    other = sample_action(cas)
    src = other.input_tree("/bgraph/src").overlaid(Tree({"a.txt": cas.put_bytes(b"b\n")}))
    changed = Action(**{**other.__dict__, "inputs": tuple((m, src if m == "/bgraph/src" else t)
                                                          for m, t in other.inputs)})
    changed.__dict__.pop("_key", None)
    assert sha256_encoder(cas).input_root(changed).root != encoded.root


def test_command_and_platform():
    """Argv as is, environment and output paths as the Command lists them, the working
    directory relative to the root, and the platform: OSFamily, ISA of where it runs, sandbox."""
    action = Action(name="a", mnemonic="M", argv=("/bin/sh", "-c", "x"), env=(("B", "2"), ("A", "1")),
                    outputs=("o", "d/p"), platform="aarch64", exec_platform="x86_64")
    assert working_directory(action) == "bgraph/out"
    assert output_paths(action) == ["o", "d/p"]
    assert platform_properties(action) == [("ISA", "x86-64"), ("OSFamily", "Linux"),
                                           ("bgraph-sandbox", SANDBOX_VERSION)]
    native = Action(name="a", mnemonic="M", platform="aarch64", outputs=(".",))
    assert dict(platform_properties(native))["ISA"] == "aarch64"
    assert output_paths(native) == [""] and out_relative(native, "") == "."
    elsewhere = Action(name="a", mnemonic="M", outputs=("o",), cwd="/bgraph/out/build")
    assert working_directory(elsewhere) == "bgraph/out/build"
    with pytest.raises(NotRemotable):
        output_paths(elsewhere)


def test_host_paths_are_not_sent(cas):
    """An action that mounts host paths (host_tools) has no content view to send: it runs locally."""
    action = Action(name="a", mnemonic="M", argv=("/bin/true",), host_paths=("/usr",), outputs=("o",))
    with pytest.raises(NotRemotable, match="host path /usr"):
        sha256_encoder(cas).input_root(action)
