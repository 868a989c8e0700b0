"""A staged layout's symlinks carry FIXED_MTIME, fresh or reused: an action that re-times a link
it owns (touch -h) leaves nothing the next action staging the same tree can see (red-team K14
hole 4)."""

from __future__ import annotations

import pytest
from bgraph_testlib import requires_bwrap

# Every staged link's modification time (its atime changes as links are read).
LOOK = r"""python3 - <<'EOF' > /tmp/l
import os
for d, dirs, files in sorted(os.walk('/bgraph/out')):
    for f in sorted(files + dirs):
        p = os.path.join(d, f)
        if os.path.islink(p):
            st = os.lstat(p)
            print(p, st.st_mtime_ns)
EOF
mv /tmp/l /bgraph/out/l"""


@pytest.fixture
def runner(tmp_path):
    from build_graph.model import Digester
    from build_graph.sandbox import BwrapRunner
    from build_graph.store.cas import LocalCas

    cas = LocalCas(tmp_path / "cache", Digester("blake3"))
    r = BwrapRunner(cas, jobs=1)
    yield r
    r.close()
    cas.close()


def _run(runner, tree, name: str, cmd: str) -> str:
    from build_graph.model import Action

    action = Action(name=name, mnemonic="NinjaEdge", env=(("PATH", "/usr/bin"),), argv=("/usr/bin/sh", "-c", cmd),
                    inputs=(("/bgraph/build", tree),), outputs=("l",), host_paths=("/usr",), staged="/bgraph/build")
    out, _result = runner.run(action)
    return runner.cas.read_bytes(out.entries["l"]).decode()


@requires_bwrap
def test_staged_links_have_fixed_times_fresh_and_after_an_action_re_timed_them(runner):
    from build_graph.model import Tree
    from build_graph.store.cas import FIXED_MTIME

    tree = Tree({"build.ninja": runner.cas.put_bytes(b"rule x\n"), "gen/a.cu": runner.cas.put_bytes(b"a\n")})
    fixed = FIXED_MTIME * 10**9
    fresh = _run(runner, tree, "fresh", LOOK)
    assert fresh == f"/bgraph/out/build.ninja {fixed}\n/bgraph/out/gen/a.cu {fixed}\n", fresh
    dirs = set(runner.cas.tmp.iterdir())
    _run(runner, tree, "re-time", "touch -h -d 2001-01-01 gen/a.cu build.ninja; readlink gen/a.cu; echo > l")
    assert runner._staged_dirs and set(runner.cas.tmp.iterdir()) == dirs  # kept as staged, not made again
    assert _run(runner, tree, "next", LOOK) == fresh
