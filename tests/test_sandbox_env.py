"""An action's environment reaches only its sandbox: no host process bgraph starts for it (the
cgroup-joining sh, bwrap) runs with it, on the spare path, the direct path and the path for more
variables than bwrap's arguments hold alike, and the action sees the same either way
(red-team K14 hole 1)."""

from __future__ import annotations

import re
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


# What no path can hand the action as given (red-team K16 hole 6): refused on every path alike,
# whatever the size of the environment, with one line naming the variable.
REFUSED = [({"X": "a\0b"}, "'X' has a NUL in its value"), ({"A=B": "1"}, "'A=B' has '=' in its name"),
           ({"": "1"}, "'' has an empty name"), ({"A\0B": "1"}, "'A\\x00B' has a NUL in its name"),
           ({"OPTIND": "abc"}, "'OPTIND' is one a /bin/sh keeps"), ({"UID": "0"}, "'UID' is one a /bin/sh keeps"),
           ({"SHLVL": "1"}, "'SHLVL' is one a /bin/sh keeps"), ({"_": "x"}, "'_' is one a /bin/sh keeps")]


@pytest.mark.parametrize("bad,words", REFUSED)
def test_a_variable_no_path_hands_over_is_refused_on_every_path(bad, words):
    small, big = {"A": "1", **bad}, {**many(MAX_SETENV_ARGS // 3 + 1), **bad}
    errors = []
    for env, shell in ((small, False), (small, True), (big, True), (big, False)):
        with pytest.raises(EnvironmentRefused) as e:
            handover(env, has_shell=shell)
        errors.append((str(e.value), e.value.hint))
    assert len(set(errors)) == 1, errors
    message, hint = errors[0]
    assert message.startswith("environment variable ") and words in message and "\n" not in message, message
    assert hint and "\n" not in hint


def test_the_shells_own_names_do_not_reach_an_action_through_dash_or_bash_as_given():
    """SHELL_OWN is what it says: every name in it is one dash or bash would not `export` as
    given, and names next to them (IFS, PATH, OPTARG, BASH_ENV) go through both unchanged."""
    from build_graph.sandbox_env import SHELL_OWN

    shells = [s for s in (shutil.which("dash"), shutil.which("bash")) if s]
    if not shells:
        pytest.skip("neither dash nor bash here")

    def passes(shell: str, name: str) -> bool:
        run = subprocess.run([shell, "-c", f"export {name}=abc; exec /usr/bin/env -0"], env={}, capture_output=True,
                             check=False)  # a shell that refuses the export fails
        return f"{name}=abc".encode() in run.stdout.split(b"\0")

    new_in_bash_53 = {"BASH_MONOSECONDS", "BASH_TRAPSIG"}
    for name in sorted(SHELL_OWN - new_in_bash_53):
        assert not all(passes(s, name) for s in shells), f"{name} goes through {shells} as given"
    for name in ("IFS", "PATH", "OPTARG", "BASH_ENV", "HOME", "PS4"):
        assert all(passes(s, name) for s in shells), name


def test_a_rule_env_attribute_is_refused_at_load():
    """cmake_project's and ninja_generator's free `env` (and cross.env, arch_env) refuse the same
    variables when the target is loaded, not when its action runs."""
    from pydantic import ValidationError

    from build_graph.rules.cmake_project import CmakeProjectAttrs
    from build_graph.rules.ninja_generator import NinjaGeneratorAttrs
    from build_graph.workspace import HINT

    makers = [lambda **kw: CmakeProjectAttrs(outputs=["x"], **kw),
              lambda **kw: NinjaGeneratorAttrs(cmd="x", src="//a:b", outputs=["x"], **kw)]
    for make in makers:
        make(env={"OK": "1"}, cross={"env": {"PYTHONPATH": "/x"}}, arch_env="ARCHS")
        for bad, words in REFUSED:
            for kw, loc in (({"env": bad}, ("env",)), ({"cross": {"env": bad}}, ("cross", "env"))):
                with pytest.raises(ValidationError) as e:
                    make(**kw)
                err = e.value.errors()[0]
                assert err["loc"] == loc and words in err["msg"] and HINT in err["msg"], err
        with pytest.raises(ValidationError, match="'A=B' has '=' in its name"):
            make(arch_env="A=B")


@requires_bwrap
def test_a_load_error_names_the_target_and_the_variable(make_ws):
    """Through the CLI: one line naming the target, its key and the variable, with a hint."""
    body = ('[g]\nkind = "ninja_generator"\ncmd = "true"\nsrc = ":g"\noutputs = ["x"]\n'
            'env = { X = "a\\u0000b" }\n')
    run = make_ws({"targets/p.toml": body}).cli("build", "//p:g")
    assert run.rc != 0 and "Traceback" not in run.output, run.output
    errors = [line for line in run.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "targets/p.toml:6 [g] key 'env'" in errors[0], run.output
    assert "environment variable 'X' has a NUL in its value" in errors[0] and "hint:" in run.stderr, run.output


@requires_bwrap
def test_a_program_that_cannot_run_fails_alike_on_every_path(tmp_path):
    """A missing program, one found nowhere on PATH, and a directory: the same status and message
    through --setenv (bwrap's execvp) and through the sandbox's shell (which checks first)."""
    from build_graph.errors import ActionFailed
    from build_graph.sandbox import BwrapRunner
    from build_graph.store.cas import LocalCas

    cas = LocalCas(tmp_path / "cache", Digester("blake3"))
    runner = BwrapRunner(cas, jobs=1)
    small = {"PATH": "/usr/bin:/bin"}
    big = {**small, **many(MAX_SETENV_ARGS // 3 + 1)}
    try:
        for i, argv in enumerate([("/nonexistent",), ("no-such-program", "x"), ("/usr/bin",)]):
            seen = []
            for env in (small, big):
                with pytest.raises(ActionFailed) as e:
                    runner.run(env_action(f"m{i}-{len(env)}", env, argv=argv))
                seen.append(str(e.value).replace(f"m{i}-{len(env)}", "NAME"))
            assert seen[0] == seen[1], seen
            assert f"bwrap: execvp {argv[0]}: " in seen[0] and "status 1" in seen[0], seen[0]
    finally:
        runner.close()
        cas.close()


@requires_bwrap
@pytest.mark.parametrize("bad,words", REFUSED[:5])
def test_a_workers_command_with_such_a_variable_is_bad_input(bad, words, tmp_path):
    """The worker refuses a Command's variable no path hands over as given (INVALID_ARGUMENT: no
    other worker would run it), few variables or many, before it starts anything."""
    from build_graph.remote_exec.runner import Process
    from build_graph.remote_exec.staging import BadInput

    for env in ({"A": "1", **bad}, {**many(MAX_SETENV_ARGS // 3 + 1), **bad}):
        with pytest.raises(BadInput, match=re.escape(words)):
            Process(["--ro-bind", "/usr", "/usr"], ["/usr/bin/true"], env, tmp_path / "out", tmp_path / "err")
        assert not (tmp_path / "out").exists()
