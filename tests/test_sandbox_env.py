"""An action's environment reaches only its sandbox: no host process bgraph starts for it (the
cgroup-joining sh, bwrap) runs with it, on the spare path, the direct path and the path for more
variables than bwrap's arguments hold alike, and the action sees the same either way
(red-team K14 hole 1)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from build_graph.errors import SandboxError
from build_graph.model import Action, Digester
from build_graph.sandbox_env import MAX_SETENV_ARGS, EnvironmentRefused, handover

requires_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")

PRELOAD_C = r"""
#include <stdio.h>
__attribute__((constructor)) static void mark(void) {
    FILE *f = fopen(MARK, "a");  /* a host path: inside the sandbox it does not exist */
    if (f) { fputs("loaded\n", f); fclose(f); }
}
"""


def preload_library(tmp: Path) -> tuple[Path, Path]:
    """A shared library that appends to a marker file (a host path) when it is loaded, and the
    marker's path; skips where there is no C compiler."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler to build the LD_PRELOAD library")
    mark, src, lib = tmp / "MARK", tmp / "mark.c", tmp / "mark.so"
    src.write_text(PRELOAD_C)
    subprocess.run([cc, "-shared", "-fPIC", f'-DMARK="{mark}"', "-o", str(lib), str(src)], check=True)
    # The library works: loaded into a host process, it writes the marker.
    subprocess.run(["/bin/true"], env={"LD_PRELOAD": str(lib)}, check=True)
    assert mark.read_text() == "loaded\n"
    mark.unlink()
    return lib, mark


def many(n: int) -> dict[str, str]:
    return {f"IN_D{i}": f"/bgraph/in/d{i} with 'quotes' and\nnewline $HOME" for i in range(n)}


def env_action(name: str, env: dict[str, str], host_paths=("/usr",), argv=("/usr/bin/env", "-0")) -> Action:
    """An action that prints its environment (or, with `argv`, whatever that prints)."""
    return Action(name=name, mnemonic="Genrule", argv=argv, env=tuple(sorted(env.items())), outputs=(),
                  host_paths=host_paths)


FDS = ("/usr/bin/ls", "-l", "--time-style=+", "/proc/self/fd")  # each descriptor and what it is


def printed(runner, action: Action) -> tuple[str, bytes]:
    """How `action` was started ("spare" or "direct") and its stdout."""
    spares = runner.spares
    taken = spares.taken if spares is not None else 0
    _tree, result = runner.run(action)
    way = "spare" if spares is not None and spares.taken > taken else "direct"
    return way, runner.cas.blob_path(result.stdout).read_bytes()


def parsed(raw: bytes) -> dict[str, str]:
    return dict(item.split("=", 1) for item in raw.decode().split("\0") if item)


def test_handover_picks_setenv_then_the_shell_and_refuses_one_line():
    small = handover({"A": "1"}, has_shell=False)
    assert small.options == ["--clearenv", "--setenv", "A", "1"] and small.prefix == [] and small.script is None
    big = many(MAX_SETENV_ARGS // 3 + 1)
    shell = handover(big, has_shell=True)
    assert shell.options == ["--clearenv"] and shell.prefix[0] == "/bin/sh" and shell.script.count(b"\nexport ") == len(big) - 1
    with pytest.raises(EnvironmentRefused, match="no /bin/sh"):
        handover(big, has_shell=False)
    with pytest.raises(EnvironmentRefused, match="'BAD-NAME' is not a shell variable name"):
        handover({**big, "BAD-NAME": "x"}, has_shell=True)


@requires_bwrap
def test_spare_direct_and_shell_paths_give_the_same_environment_and_descriptors(tmp_path):
    from build_graph.sandbox import BwrapRunner
    from build_graph.store.cas import LocalCas

    cas = LocalCas(tmp_path / "cache", Digester("blake3"))
    runner = BwrapRunner(cas, jobs=1)
    env = {"PATH": "/usr/bin:/bin", "A": "x y", "PWD_NOT": "1", "Q": "it's"}
    try:
        envs, fds = [], []
        for i in range(5):  # the first actions start the direct way, the later ones through a spare
            envs.append(printed(runner, env_action(f"e{i}", env)))
            fds.append(printed(runner, env_action(f"f{i}", env, argv=FDS)))
        for views in (envs, fds):
            assert "direct" in {way for way, _ in views}
            if runner.spares is not None:
                assert "spare" in {way for way, _ in views}, "no action went through a spare"
            assert len({out for _way, out in views}) == 1, views
        # Exactly the action's variables, nothing of bgraph's or a shell's; PWD is bwrap's (its
        # working directory), as ever.
        assert parsed(envs[0][1]) == {**env, "PWD": "/bgraph/out"}
        assert b" 0 -> /dev/null" in fds[0][1] and b"3 -> /proc/" in fds[0][1] and b" 4 -> " not in fds[0][1]
        # More variables than bwrap's arguments hold: the sandbox's shell sets them; the action
        # sees exactly them, and the same descriptors.
        big = {**env, **many(MAX_SETENV_ARGS // 3 + 10)}
        assert parsed(printed(runner, env_action("big", big))[1]) == {**big, "PWD": "/bgraph/out"}
        big["PWD"] = "/elsewhere"  # bwrap's own wins on every path
        assert parsed(printed(runner, env_action("bigpwd", big))[1]) == {**big, "PWD": "/bgraph/out"}
        assert parsed(printed(runner, env_action("pwd", {**env, "PWD": "/x"}))[1]) == {**env, "PWD": "/bgraph/out"}
        assert printed(runner, env_action("bigfds", big, argv=FDS))[1] == fds[0][1]
    finally:
        runner.close()
        cas.close()


@requires_bwrap
def test_too_many_variables_without_a_shell_are_one_line(tmp_path):
    from build_graph.sandbox import BwrapRunner
    from build_graph.store.cas import LocalCas

    cas = LocalCas(tmp_path / "cache", Digester("blake3"))
    runner = BwrapRunner(cas)
    try:
        with pytest.raises(SandboxError) as e:
            runner.run(env_action("noshell", many(MAX_SETENV_ARGS // 3 + 1), host_paths=()))
        line, hint = str(e.value).splitlines()  # one line, and the hint
        assert line.startswith("noshell: 2001 environment variables") and line.endswith("no /bin/sh to set them")
        assert "hint:" in hint
    finally:
        runner.close()
        cas.close()


@requires_bwrap
def test_ld_preload_of_an_action_never_runs_on_the_host(tmp_path):
    """A local action's LD_PRELOAD names a host library that writes a marker when loaded: no
    process on the host loads it (direct, spare and shell paths); the action sees the variable."""
    from build_graph.sandbox import BwrapRunner
    from build_graph.store.cas import LocalCas

    lib, mark = preload_library(tmp_path)
    cas = LocalCas(tmp_path / "cache", Digester("blake3"))
    runner = BwrapRunner(cas, jobs=1)
    try:
        for i, extra in enumerate([{}, {}, {}, many(MAX_SETENV_ARGS // 3 + 1)]):
            env = {"PATH": "/usr/bin:/bin", "LD_PRELOAD": str(lib), **extra}
            assert parsed(printed(runner, env_action(f"p{i}", env))[1])["LD_PRELOAD"] == str(lib)
            assert not mark.exists(), f"action {i}: the library ran on the host: {mark.read_text()}"
    finally:
        runner.close()
        cas.close()
