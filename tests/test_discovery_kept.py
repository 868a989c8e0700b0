"""Input discovery's lookups kept between builds (incremental/discovery.py, Contents with a state
file): by a stored file's content digest and the digest of the code that scans it, never by a host
path, and a damaged row is scanned again."""

import itertools
import os
import random
import re

import pytest

from build_graph.incremental import discovery
from build_graph.incremental.discovery import Contents
from build_graph.model import Action, Digester, Tree
from build_graph.store.cas import LocalCas
from build_graph.store.state import STATE_FILE, BuildState

HEADER = b'#pragma once\n#if __has_include(<cuda/probe.h>)\n#include <cuda/probe.h>\n#endif\n'


@pytest.fixture
def store(tmp_path):
    digester = Digester("blake3")
    cas = LocalCas(tmp_path / "cache", digester)
    yield digester, cas, tmp_path / "cache" / STATE_FILE
    cas.close()


def action_reading(tree: Tree, host: str = "") -> Action:
    return Action(name="pp", mnemonic="CudaHostPreprocess", argv=("/usr/bin/true",), env=(),
                  inputs=(("/bgraph/toolchain", tree),), outputs=("o",), platform="x86_64",
                  host_paths=(host,) if host else (), rule_version="t/1")


def lookups_in_a_new_build(digester, cas, state_path, action, path):
    state = BuildState(state_path)
    try:
        return Contents(cas, digester, state).lookups(action, path)
    finally:
        state.close()


def test_a_later_build_takes_the_kept_lookups_without_reading_the_file(store):
    digester, cas, state_path = store
    entry = cas.put_bytes(HEADER)
    action = action_reading(Tree({"include/h.h": entry}))
    first = lookups_in_a_new_build(digester, cas, state_path, action, "/bgraph/toolchain/include/h.h")
    assert first is not None and "probe.h" in first.names and not first.opaque
    blob = cas.blob_path(entry.digest)
    os.chmod(blob.parent, 0o755)
    blob.unlink()  # the bytes are gone: only the kept row can answer now
    again = lookups_in_a_new_build(digester, cas, state_path, action, "/bgraph/toolchain/include/h.h")
    assert again == first
    # without the state file the blob is needed: gone, the caller takes the worst (None)
    assert Contents(cas, digester).lookups(action, "/bgraph/toolchain/include/h.h") is None


def test_other_code_never_reads_a_kept_row(store, monkeypatch):
    digester, cas, state_path = store
    entry = cas.put_bytes(HEADER)
    action = action_reading(Tree({"include/h.h": entry}))
    assert lookups_in_a_new_build(digester, cas, state_path, action, "/bgraph/toolchain/include/h.h")
    monkeypatch.setattr(discovery, "_lookups", lambda data, wrappers: discovery.NOTHING)
    monkeypatch.setattr(discovery, "_probe_code", lambda digester: "edited-scanner")
    assert lookups_in_a_new_build(digester, cas, state_path, action,
                                  "/bgraph/toolchain/include/h.h") == discovery.NOTHING


def test_a_damaged_row_is_scanned_again(store):
    digester, cas, state_path = store
    entry = cas.put_bytes(HEADER)
    action = action_reading(Tree({"include/h.h": entry}))
    first = lookups_in_a_new_build(digester, cas, state_path, action, "/bgraph/toolchain/include/h.h")
    state = BuildState(state_path)
    state._write([("UPDATE probes SET lookups = ?", [(b'["probe.h"], "not a list", 1]',)])])
    state.close()
    assert lookups_in_a_new_build(digester, cas, state_path, action, "/bgraph/toolchain/include/h.h") == first


def test_a_host_file_is_never_kept(store, tmp_path):
    digester, cas, state_path = store
    usr = tmp_path / "usr"
    (usr / "include").mkdir(parents=True)
    header = usr / "include" / "h.h"
    header.write_bytes(HEADER)
    action = action_reading(Tree({}), host=str(usr))
    assert "probe.h" in lookups_in_a_new_build(digester, cas, state_path, action, str(header)).names
    header.write_bytes(b"#pragma once\n")  # the same path, other bytes: a host path is no content key
    assert lookups_in_a_new_build(digester, cas, state_path, action, str(header)).names == frozenset()
    state = BuildState(state_path)
    assert state._query("SELECT count(*) FROM probes", ())[0] == 0
    state.close()


# The scan's fast forms against the plain patterns they stand for (a look-behind first, which
# `re` tries at every position): the same answer on pieces, tails, splices and #import in every
# neighbourhood that matters (identifier characters on either side, comments, trigraphs).
_PLAIN_PIECE = re.compile(rb"(?<![A-Za-z0-9_$])(?:" + b"|".join(sorted(discovery._RARE_PIECES, key=len, reverse=True))
                          + rb")(?![A-Za-z0-9_$])")
_PLAIN_TAIL = re.compile(rb"(?<![A-Za-z0-9_$])(?:(?:a?s)?_)?include(?:_next)?(?![A-Za-z0-9_$])")


def _plain_tails(data: bytes) -> list[tuple[int, bytes]]:
    return [(m.start(), m.group(0)) for m in _PLAIN_TAIL.finditer(data)]


def _corpus() -> list[bytes]:
    pieces = [b"__has_i", b"__has_include", b"has_include", b"_has_include_next", b"s_include", b"as_include",
              b"include", b"_include", b"include_next", b"#include", b"__h", b"__has_", b"import", b"# import",
              b"#/* c */import", b"%:import", b"??=import", b"#/* a\n b */ import", b"// import\n", b"important",
              b"\\\n", b"??/\n", b"\\ \t\r\n", b"x", b"$", b"9", b"_", b" ", b"\n", b"/*", b"*/", b"\"", b"(", b"##"]
    rng = random.Random(1234)
    out = [a + b for a, b in itertools.product(pieces, repeat=2)]
    out += [b"".join(rng.choice(pieces) for _ in range(rng.randint(1, 12))) for _ in range(20000)]
    return out


def test_the_fast_scans_answer_as_the_plain_patterns():
    tails = discovery._TAILS
    for data in _corpus():
        assert discovery._rare_piece(data) == (_PLAIN_PIECE.search(data) is not None), data
        fast = [(s, w) for s, w in discovery._identifiers_at(data, b"include") if w in tails]
        assert fast == _plain_tails(data), data
        plain_spliced = discovery._SPLICES.sub(b"", data) if b"\\" in data or b"??/" in data else data
        assert discovery._spliced(data) == plain_spliced, data
        spliced = discovery._spliced(data)
        plain_import = b"import" in spliced and discovery._IMPORT.search(discovery._code(spliced)) is not None
        assert discovery._imports(spliced) == plain_import, data
