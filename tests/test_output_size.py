"""Output files over a size bound are refused before they are hashed (red-team K14 hole 2).

Hashing reads every byte of a file, a sparse file's holes too: `truncate -s 1T out` costs an
action nothing and bgraph (or a remote worker, which then uploads the whole size) hours. Every
test file here is SPARSE (truncate): no test writes more than a few bytes to disk."""

from __future__ import annotations

import signal
import time
from contextlib import contextmanager

import pytest

from bgraph_testlib import requires_bwrap
from build_graph.model import Digester
from build_graph.remote_exec import outputs as outs
from build_graph.store import cas as cas_module
from build_graph.store.cas import LocalCas, StoreError
from build_graph.store.reapi import reapi_pb2 as pb

TIB = 1 << 40


def sparse(path, size: int):
    """A file of `size` bytes that takes no disk (one byte written at its start)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(b"x")
        f.truncate(size)
    return path


@contextmanager
def within(seconds: int):
    """Fail (rather than hang for hours hashing a TiB) where the block takes longer."""
    def late(_sig, _frame):
        raise AssertionError(f"still running after {seconds} s: the file is being read")
    old = signal.signal(signal.SIGALRM, late)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.fixture
def cas(tmp_path):
    c = LocalCas(tmp_path / "cache", Digester("sha256"))
    yield c
    c.close()


def test_a_tib_sparse_output_is_refused_before_it_is_hashed(cas, tmp_path):
    out = tmp_path / "out"
    sparse(out / "big", TIB)
    (out / "small").write_text("ok")
    start = time.monotonic()
    with within(30), pytest.raises(StoreError) as e:
        cas.ingest_dir(out, ["small", "big"], move=True)
    assert time.monotonic() - start < 5
    assert e.value.message.startswith(f"output big is {TIB} bytes, over the 64 GiB an output file may be")
    assert "sparse" in e.value.hint and "\n" not in e.value.message
    # The same below a directory (the whole output directory taken).
    sparse(out / "d" / "e" / "huge", TIB)
    (out / "big").unlink()
    with within(30), pytest.raises(StoreError, match=r"^output d/e/huge is 1099511627776 bytes"):
        cas.ingest_dir(out, None, move=True)


def test_the_bounds_per_file_and_per_action(cas, tmp_path, monkeypatch):
    """Small bounds (the real ones are 64 GiB and 256 GiB): a file at the bound is taken, one
    byte over is refused, and so is the file that takes the action's total over its bound."""
    monkeypatch.setattr(cas_module, "MAX_OUTPUT_FILE", 1 << 20)
    monkeypatch.setattr(cas_module, "MAX_OUTPUT_TOTAL", 3 << 20)
    out = tmp_path / "out"
    sparse(out / "at", 1 << 20)
    tree = cas.ingest_dir(out, ["at"])
    assert tree.entries["at"].size == 1 << 20
    sparse(out / "over", (1 << 20) + 1)
    with pytest.raises(StoreError, match="output over is 1048577 bytes, over the 1048576 bytes an output file may be"):
        cas.ingest_dir(out, ["at", "over"])
    (out / "over").unlink()
    for name in ("b", "c", "d"):
        sparse(out / "many" / name, 1 << 20)
    with pytest.raises(StoreError, match=r"outputs reach 4194304 bytes with many/\w, over the 3145728 bytes an action's"):
        cas.ingest_dir(out, None)


def test_a_remote_worker_refuses_a_tib_sparse_output_before_hashing_or_uploading(cas, tmp_path):
    """outputs.collect (what a worker runs after the action) refuses it as BadOutput (the action's
    own doing: INVALID_ARGUMENT, not retried), naming the output by its path in the action."""
    work = tmp_path / "w"
    sparse(work / "bgraph" / "out" / "big", TIB)
    with within(30), pytest.raises(outs.BadOutput) as e:
        outs.collect(pb, cas, lambda path: str(work / path), ["bgraph/out/big"], "bgraph")
    assert str(e.value).startswith(f"output out/big is {TIB} bytes, over the 64 GiB an output file may be")
    sparse(work / "bgraph" / "out" / "d" / "sub" / "huge", TIB)
    (work / "bgraph" / "out" / "big").unlink()
    with within(30), pytest.raises(outs.BadOutput, match=r"^output out/d/sub/huge is 1099511627776 bytes"):
        outs.collect(pb, cas, lambda path: str(work / path), ["bgraph/out/d"], "bgraph")


def test_a_remote_worker_keeps_the_per_action_total(cas, tmp_path, monkeypatch):
    monkeypatch.setattr(cas_module, "MAX_OUTPUT_FILE", 1 << 20)
    monkeypatch.setattr(cas_module, "MAX_OUTPUT_TOTAL", 3 << 20)
    work = tmp_path / "w"
    for name in ("a", "b", "c"):
        sparse(work / "o" / name, 1 << 20)
    got = outs.collect(pb, cas, lambda path: str(work / path), ["o"], "")
    assert got.size == 3 << 20
    sparse(work / "o2", 1)
    with pytest.raises(outs.BadOutput, match="outputs reach 3145729 bytes with o2"):
        outs.collect(pb, cas, lambda path: str(work / path), ["o", "o2"], "")


@requires_bwrap
def test_an_action_making_a_tib_sparse_output_fails_at_once_with_one_line(make_ws):
    ws = make_ws({"targets/p.toml": '''[big]
kind = "genrule"
outs = ["big"]
cmd = "truncate -s 1T $OUT/big"
'''})
    start = time.monotonic()
    run = ws.cli("build", "--json", "//p:big", timeout=60)
    assert run.rc != 0, run.output
    assert f"output big is {TIB} bytes, over the 64 GiB an output file may be" in run.output
    assert "//p:big" in run.output and "Traceback" not in run.output
    assert time.monotonic() - start < 45
