"""What input discovery reads of the host (incremental/discovery.py, Contents): only what the
sandbox shows under the action's host paths, never through a host link out of them, never a FIFO."""

import os

from build_graph.incremental.discovery import Contents
from build_graph.model import Action, Digester
from build_graph.store.cas import LocalCas


def test_a_host_file_is_read_for_its_macros_only_inside_the_host_paths(tmp_path):
    usr = tmp_path / "usr"
    (usr / "include").mkdir(parents=True)
    (usr / "include" / "ok.h").write_text("#define OK 1\n")
    (tmp_path / "secret.h").write_text("#define SECRET 1\n")  # outside every mount
    os.symlink(tmp_path / "secret.h", usr / "include" / "s.h")  # as /usr/lib/ssl/private -> /etc/ssl/private
    os.mkfifo(usr / "include" / "fifo.h")
    action = Action(name="pp", mnemonic="CudaHostPreprocess", argv=("/usr/bin/true",), env=(), inputs=(),
                    outputs=("o",), platform="x86_64", host_paths=(str(usr),), rule_version="t/1")
    digester = Digester("blake3")
    cas = LocalCas(tmp_path / "cache", digester)
    try:
        contents = Contents(cas, digester)
        assert contents.defined_in(action, f"{usr}/include/ok.h") == frozenset({"OK"})
        assert contents.defined_in(action, f"{usr}/include/s.h") is None
        assert contents.defined_in(action, f"{usr}/include/fifo.h") is None  # not a read that never ends
    finally:
        cas.close()
