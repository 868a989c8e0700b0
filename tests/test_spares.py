"""Spares (build_graph/spares.py): processes that join an action's cgroups before the action is
handed to them. Real bwrap and real cgroups; skipped where this host lets bgraph make none."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from bgraph_testlib import requires_bwrap
from build_graph.cgroups import Accounting
from build_graph.model import Action, Digester
from build_graph.spares import Spares, environment_options, launch_script
from build_graph.store.cas import LocalCas


def accounting_or_skip() -> Accounting:
    accounting = Accounting.probe()
    if accounting.cpu is None and accounting.memory is None:
        from test_cgroups import no_cgroup_reason
        pytest.skip(no_cgroup_reason())
    return accounting


def ready(spares: Spares, timeout: float = 10.0):
    """Take a spare once the starter thread has one ready."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        spare = spares.take()
        if spare is not None:
            return spare
        time.sleep(0.01)
    raise AssertionError("no spare became ready")


def joined(pid: int, groups: dict[str, Path], timeout: float = 10.0) -> bool:
    """Whether process `pid` is listed in every one of `groups` (it joins them itself)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(str(pid) in (g / "cgroup.procs").read_text().split() for g in groups.values()):
            return True
        time.sleep(0.01)
    return False


def test_a_spare_joins_its_groups_before_it_is_handed_an_action_and_close_ends_it():
    accounting = accounting_or_skip()
    spares = Spares(accounting, 1)
    spare = ready(spares)
    assert spare.proc.poll() is None  # waiting for its launch script
    assert joined(spare.proc.pid, spare.groups)
    spares.discard(spare)
    assert spare.proc.returncode == 0  # end of file on its pipe: it leaves quietly
    assert not any(g.exists() for g in spare.groups.values())
    deadline = time.monotonic() + 10
    while not spares._ready and time.monotonic() < deadline:  # the starter thread made one behind it
        time.sleep(0.01)
    [idle] = spares._ready
    spares.close()
    assert idle.proc.returncode == 0 and not any(g.exists() for g in idle.groups.values())
    assert spares.taken == 1


def test_the_launch_script_gives_the_action_exactly_its_argv_and_environment(tmp_path):
    """Arguments with quotes, spaces, newlines and `$`, and an environment set only by bwrap's
    options: nothing of the spare's shell leaks into the action. The script, the options and the
    output are memory files: nothing is written on disk."""
    import subprocess

    from build_graph.sandbox import find_bwrap
    from build_graph.spares import Outputs, memfd, read_memfd

    argv = ["/usr/bin/env", "-0"]
    env = {"A": "it's \"quoted\" $HOME `x`\nsecond line", "PATH": "/usr/bin"}
    options = ["--ro-bind", "/usr", "/usr", "--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64",
               "--symlink", "usr/bin", "/bin", "--chdir", "/", *environment_options(env)]

    def run(argv):
        args, script, outputs = memfd("options"), memfd("launch"), Outputs.new()
        try:
            os.write(args, b"".join(a.encode() + b"\0" for a in options))
            os.lseek(args, 0, os.SEEK_SET)
            os.write(script, launch_script(find_bwrap(), args, argv).encode())
            run = subprocess.run(["/bin/sh", "-c", '. "/proc/self/fd/$1"', "sh", str(script)], env={"LEAK": "1"},
                                 stdout=outputs.stdout, stderr=outputs.stderr, pass_fds=(args, script))
            out, err = outputs.read()
            assert run.returncode == 0, err
            return out.decode()
        finally:
            os.close(args), os.close(script), outputs.close()

    got = dict(v.split("=", 1) for v in run(argv).split("\0") if v)
    assert got == {**env, "PWD": "/"}
    weird = ["/usr/bin/printf", "%s|", "a b", "it's", "$HOME", "new\nline", ""]
    assert run(weird) == "a b|it's|$HOME|new\nline||"
    assert read_memfd(memfd("empty")) == b""


def test_environment_options_refuse_what_bwrap_cannot_take():
    assert environment_options({"A": "1"}) == ["--clearenv", "--setenv", "A", "1"]
    assert environment_options({f"V{i}": "x" for i in range(4000)}) is None  # started the direct way


@requires_bwrap
def test_later_actions_start_through_spares_and_are_measured(tmp_path):
    """A runner's actions, one after another: the first `jobs` start the direct way (a build of
    one or two actions needs no spare), later ones through a spare already in its groups; each
    sees exactly its environment, and its CPU time and peak memory are its own, as through the
    direct way."""
    from build_graph.sandbox import BwrapRunner

    accounting_or_skip()
    cas = LocalCas(tmp_path / "cache", Digester("blake3"))
    runner = BwrapRunner(cas, jobs=1)
    try:
        results, envs = [], []
        for i in range(4):
            # Busy for a moment, then ~100 MiB resident, then print its environment.
            script = ('i=0; while [ $i -lt 20000 ]; do i=$((i+1)); done; '
                      'python3 -c "b = bytearray(100 << 20); b[::4096] = b\'x\' * (len(b) // 4096)"; '
                      'env | sort > /bgraph/out/env')
            action = Action(name=f"a{i}", mnemonic="Genrule", argv=("/usr/bin/sh", "-c", script),
                            env=(("N", str(i)), ("PATH", "/usr/bin")), inputs=(), outputs=("env",),
                            host_paths=("/usr",))
            tree, result = runner.run(action)
            results.append(result)
            envs.append(cas.read_bytes(tree.entries["env"]).decode().replace(f"N={i}\n", "N=<i>\n"))
            # Let the starter thread have the next spare ready, as a build's planning does.
            deadline = time.monotonic() + 10
            while runner.spares._open and not runner.spares._ready and time.monotonic() < deadline:
                time.sleep(0.01)
        assert runner.spares.taken >= 2
        # The first two started the direct way: the others' environments are the same.
        assert envs == [envs[0]] * 4 and "N=<i>\nPATH=/usr/bin\n" in envs[0], envs
        if runner.accounting.cpu is not None:
            assert all(r.cpu_s > 0 for r in results), [r.cpu_s for r in results]
        if runner.accounting.memory is not None:
            assert all(90 <= r.peak_mb <= 200 for r in results), [r.peak_mb for r in results]
    finally:
        runner.close()
        cas.close()
    assert not runner.spares._ready
    # The finished actions' groups were removed off their path (retired), all of them by now:
    # none is left in this process's own group (cgroups.py; it stays until the process exits).
    mine = [g for a in (runner.accounting.cpu, runner.accounting.memory) if a is not None
            for own in a.base.iterdir() if own.name.startswith(f"{os.getpid()}-")
            for g in own.iterdir() if g.is_dir()]
    assert not mine, mine


@requires_bwrap
def test_stop_kills_an_action_that_started_through_a_spare(tmp_path):
    import threading

    from build_graph.errors import ActionFailed
    from build_graph.sandbox import BwrapRunner

    accounting_or_skip()
    cas = LocalCas(tmp_path / "cache", Digester("blake3"))
    runner = BwrapRunner(cas, jobs=1)
    quick = Action(name="quick", mnemonic="Genrule", argv=("/usr/bin/sh", "-c", ": > /bgraph/out/x"),
                   env=(), inputs=(), outputs=("x",), host_paths=("/usr",))
    runner.run(quick)
    runner.run(quick)  # the first `jobs` actions start the direct way; spares follow
    deadline = time.monotonic() + 10
    while not runner.spares._ready and time.monotonic() < deadline:
        time.sleep(0.01)
    slow = Action(name="slow", mnemonic="Genrule", argv=("/usr/bin/sleep", "60"), env=(), inputs=(),
                  outputs=(), host_paths=("/usr",))
    failure: list[BaseException] = []

    def run():
        try:
            runner.run(slow)
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            failure.append(e)

    thread = threading.Thread(target=run)
    start = time.monotonic()
    thread.start()
    while runner.spares.taken < 1 and time.monotonic() - start < 10:
        time.sleep(0.01)
    time.sleep(0.3)
    runner.stop()
    thread.join(timeout=20)
    assert not thread.is_alive() and time.monotonic() - start < 20
    assert runner.spares.taken >= 1
    assert failure and isinstance(failure[0], ActionFailed) and "interrupted" in str(failure[0])
    runner.close()
    cas.close()
    assert not any(p.pid for p in runner._procs)


@requires_bwrap
def test_a_spare_that_died_is_passed_over(tmp_path):
    """A spare gone before it is handed its action (killed, or its join refused): the action
    starts the direct way, and its groups are removed."""
    import signal

    from build_graph.sandbox import BwrapRunner

    accounting_or_skip()
    cas = LocalCas(tmp_path / "cache", Digester("blake3"))
    runner = BwrapRunner(cas, jobs=1)
    try:
        spare = ready(runner.spares)
        runner.spares._ready.append(spare)  # back, for the runner to take
        spare.proc.send_signal(signal.SIGKILL)
        spare.proc.wait()
        action = Action(name="after", mnemonic="Genrule", argv=("/usr/bin/sh", "-c", "echo ran > /bgraph/out/x"),
                        env=(), inputs=(), outputs=("x",), host_paths=("/usr",))
        tree, _result = runner.run(action)
        assert cas.read_bytes(tree.entries["x"]) == b"ran\n"
        assert not any(g.exists() for g in spare.groups.values())
    finally:
        runner.close()
        cas.close()


def test_an_actions_stdout_is_read_capped_however_large_it_claims_to_be():
    """An action can make its stdout memory file any size for free (ftruncate): bgraph keeps the
    last STREAM_CAP bytes at most, read alone (not the whole file into memory and then into a
    blob), after a line that says how many were dropped. A small output is kept whole."""
    from build_graph.spares import STREAM_CAP, memfd, read_memfd
    fd = memfd("stdout")
    try:
        os.write(fd, b"hello\n")
        assert read_memfd(fd) == b"hello\n"
        os.write(fd, b"0123456789")
        assert read_memfd(fd, cap=4) == b"[bgraph: the first 12 bytes of this output were dropped; " \
                                         b"the last 4 are kept]\n6789"
        os.ftruncate(fd, 2 << 30)  # 2 GiB of hole
        os.pwrite(fd, b"the end\n", (2 << 30) - 8)
        kept = read_memfd(fd)
        head, _, tail = kept.partition(b"\n")
        assert len(tail) == STREAM_CAP and tail.endswith(b"the end\n")
        assert head == f"[bgraph: the first {(2 << 30) - STREAM_CAP} bytes of this output were dropped; " \
                       f"the last {STREAM_CAP} are kept]".encode()
    finally:
        os.close(fd)
