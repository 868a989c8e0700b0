"""A staged build directory is kept between actions that stage the same tree (issue 34), and only
while what is left of it is the layout exactly as staged: no action sees anything of an earlier
one's, through /bgraph/out or on it."""

from __future__ import annotations

import pytest

from bgraph_testlib import requires_bwrap

# What an action can see of its staged output directory: every name with its type, link target,
# mode, link count and size, and the extended attributes of every directory.
LOOK = r"""python3 - <<'EOF' > /tmp/l
import os
for d, dirs, files in sorted(os.walk('/bgraph/out')):
    st = os.lstat(d)
    print(d, oct(st.st_mode), st.st_nlink, st.st_size, os.listxattr(d))
    for f in sorted(files + [x for x in dirs if os.path.islink(os.path.join(d, x))]):
        p = os.path.join(d, f)
        print(' ', p, os.readlink(p) if os.path.islink(p) else 'file')
EOF
mv /tmp/l /bgraph/out/l"""


# Every staged link's modification time (its atime changes as links are read).
LINK_TIMES = r"""python3 - <<'EOF' > /tmp/l
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


def _build_dir(cas):
    from build_graph.model import DirEntry, Tree

    return Tree({"build.ninja": cas.put_bytes(b"rule x\n"), "gen/a.cu": cas.put_bytes(b"a\n"),
                 "gen/sub/b.h": cas.put_bytes(b"b\n"), "empty": DirEntry()})


def _run(runner, tree, name: str, cmd: str) -> str:
    from build_graph.model import Action

    action = Action(name=name, mnemonic="NinjaEdge", env=(("PATH", "/usr/bin"),), argv=("/usr/bin/sh", "-c", cmd),
                    inputs=(("/bgraph/build", tree),), outputs=("l",), host_paths=("/usr",), staged="/bgraph/build")
    out, _result = runner.run(action)
    return runner.cas.read_bytes(out.entries["l"]).decode()


def _act_dirs(runner) -> set[str]:
    return {p.name for p in runner.cas.tmp.iterdir() if p.name.startswith("act-")}


@requires_bwrap
def test_a_staged_directory_serves_the_next_action_as_staged(runner):
    tree = _build_dir(runner.cas)
    fresh = _run(runner, tree, "first", LOOK)
    assert "/bgraph/out/gen/sub/b.h /bgraph/build/gen/sub/b.h" in fresh and "/bgraph/out/empty " in fresh, fresh
    kept = _act_dirs(runner)
    # Outputs and litter beside and below the staged files are removed; the layout is kept as is.
    _run(runner, tree, "litter", "mkdir -p gen/new/deep; echo x > gen/new/deep/f; echo y > gen/stray; "
                                 "ln -s /nowhere empty/link; echo > l")
    assert _run(runner, tree, "after-litter", LOOK) == fresh
    assert _act_dirs(runner) == kept  # the same directory, not staged again
    assert runner._staged_dirs and not runner._free_dirs


@requires_bwrap
@pytest.mark.parametrize("change", [
    "rm gen/a.cu",  # a staged link gone
    "rm gen/a.cu; ln -s /etc/passwd gen/a.cu",  # retargeted
    "rm gen/a.cu; echo mine > gen/a.cu",  # replaced by a file
    "chmod 700 gen/sub",  # a staged directory's mode
    "python3 -c \"import os; os.setxattr('gen', 'user.left', b'1')\"",  # an extended attribute
    "rmdir empty; echo > empty",  # a staged directory replaced
    "chmod 700 /bgraph/out",  # the output directory itself
    "for i in $(seq 300); do echo > gen/sub/long-name-to-grow-the-directory-$i; done",  # a directory grown
])
def test_a_staged_directory_an_action_changed_is_staged_afresh(runner, change):
    tree = _build_dir(runner.cas)
    fresh = _run(runner, tree, "first", LOOK)
    assert runner._staged_dirs
    _run(runner, tree, "change", f"{change}; echo > l")
    assert not any(runner._staged_dirs.values())  # not kept as staged: emptied (or removed)
    assert _run(runner, tree, "after", LOOK) == fresh


@requires_bwrap
def test_another_tree_is_staged_in_an_empty_directory(runner):
    from build_graph.model import Tree

    tree = _build_dir(runner.cas)
    other = Tree({"build.ninja": runner.cas.put_bytes(b"rule y\n")})
    _run(runner, tree, "first", LOOK)
    seen = _run(runner, other, "other", LOOK)
    assert "/bgraph/build/build.ninja" in seen and "gen" not in seen, seen
    runner.close()
    assert not _act_dirs(runner)


@requires_bwrap
def test_an_output_below_a_staged_input_is_refused_not_made_through_its_link(runner):
    """A declared output's directories were made with mkdir(parents=True) through the staged
    layout's links, which lead into the sandbox's mounts: on the host, other paths (K15)."""
    from build_graph.errors import SandboxError
    from build_graph.model import Action

    tree = _build_dir(runner.cas)
    action = Action(name="edge", mnemonic="NinjaEdge", env=(("PATH", "/usr/bin"),), argv=("/usr/bin/true",),
                    inputs=(("/bgraph/build", tree),), outputs=("gen/a.cu/sub/x.o",), host_paths=("/usr",),
                    staged="/bgraph/build")
    with pytest.raises(SandboxError, match="lies below gen/a.cu"):
        runner.run(action)


@requires_bwrap
def test_staged_links_have_fixed_times_fresh_and_after_an_action_re_timed_them(runner):
    """A staged layout's symlinks carry FIXED_MTIME, fresh or reused: an action that re-times a
    link it owns (touch -h) leaves nothing the next action staging the same tree can see
    (red-team K14 hole 4)."""
    from build_graph.model import Tree
    from build_graph.store.cas import FIXED_MTIME

    tree = Tree({"build.ninja": runner.cas.put_bytes(b"rule x\n"), "gen/a.cu": runner.cas.put_bytes(b"a\n")})
    fixed = FIXED_MTIME * 10**9
    fresh = _run(runner, tree, "fresh", LINK_TIMES)
    assert fresh == f"/bgraph/out/build.ninja {fixed}\n/bgraph/out/gen/a.cu {fixed}\n", fresh
    dirs = set(runner.cas.tmp.iterdir())
    _run(runner, tree, "re-time", "touch -h -d 2001-01-01 gen/a.cu build.ninja; readlink gen/a.cu; echo > l")
    assert runner._staged_dirs and set(runner.cas.tmp.iterdir()) == dirs  # kept as staged, not made again
    assert _run(runner, tree, "next", LINK_TIMES) == fresh
