"""bgraph's own memory (issue 23, item 2): unpacking a wheel holds no member in memory whole.
torch's and CUDA's wheels hold libraries of about 500 MiB (libtorch_cuda.so, libcublasLt.so.13);
read whole, and two unpacks at -j2, they took bgraph to 1.6-1.9 GiB."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import zipfile

from bgraph_testlib import REPO


def test_put_stream_stores_what_put_bytes_stores(tmp_path):
    from build_graph.model import Digester
    from build_graph.store.cas import CHUNK, LocalCas

    class Trickle(io.RawIOBase):  # short reads: a stream may return less than asked before its end
        def __init__(self, data: bytes):
            self.data, self.at = data, 0

        def read(self, n: int = -1) -> bytes:
            piece = self.data[self.at:self.at + min(n if n >= 0 else len(self.data), 1000)]
            self.at += len(piece)
            return piece

    cas = LocalCas(tmp_path / "cache", Digester("blake3"))
    for size in (0, 1, 999, 1000, 1001, CHUNK, CHUNK + 1, 3 * CHUNK + 17):
        data = os.urandom(size)
        for src in (io.BytesIO(data), Trickle(data)):
            entry = cas.put_stream(src, executable=True)
            assert entry == cas.put_bytes(data, executable=True)
            assert cas.read_bytes(entry) == data
    assert not list(cas.tmp.glob("tmp*"))  # no temporary file left
    cas.close()


def test_unpacking_a_wheel_with_a_large_member_keeps_bgraph_small(tmp_path):
    """A 256 MiB member (half of it random, so it stays large when compressed): the unpack
    grows bgraph's peak RSS by far less than the member (it grew by 2.3 times the member)."""
    wheel = tmp_path / "big-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as z:
        with z.open("big/lib/libbig.so", "w", force_zip64=True) as f:
            for _ in range(256):
                f.write(os.urandom(1 << 19) + bytes(1 << 19))
        z.writestr("big/__init__.py", "")
    script = f"""
import resource, sys
from pathlib import Path
from build_graph import archive
from build_graph.model import Action, Digester, Tree
from build_graph.store.cas import LocalCas
cas = LocalCas(Path({str(tmp_path / 'cache')!r}), Digester("blake3"))
blob = cas.put_file({str(wheel)!r})
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
action = Action(name="extract", mnemonic="Extract", kind="extract",
                inputs=(("archive", Tree({{"big.whl": blob}})),), outputs=(".",))
tree, _ = archive.extract(cas, action)
assert tree.entries["big/lib/libbig.so"].size == 256 << 20
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) >> 10)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr
    grew_mb = int(out.stdout.split()[-1])
    assert grew_mb < 64, f"unpacking grew bgraph by {grew_mb} MiB"
