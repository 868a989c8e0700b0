"""An aarch64 worker on this x86_64 machine (issue 36, item 4): `bgraph worker --isa aarch64 --qemu
FILE` offers ISA=aarch64 to BuildGrid and runs each lease in bgraph's sandbox inside a user
namespace whose own binfmt_misc hands aarch64 programs to the pinned qemu-user
(//toolchains:qemu-user). Every program an action starts, children included, is aarch64; the host
registers nothing. `bgraph build --host-platform aarch64 --remote-executor` sends a Spark's
actions there, under the keys a Spark computes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bgraph_testlib import REPO, WS, copy_toolchains, hermetic_env
from build_graph.remote_exec.runner import emulation_problem
from build_graph.workspace import host_platform
from remote_exec_servers import ExecStack, missing_reason

pytestmark = pytest.mark.skipif(host_platform() != "x86_64", reason="emulates aarch64 on an x86_64 host")

# What the action's programs are: uname, CPython's idea of the machine and its pointer size, the
# ELF machine field of the shell running the command (0xb7 0x00: EM_AARCH64), and a child the
# shell starts (od) that itself ran: every one aarch64.
ARM_TARGETS = """\
[uname]
kind = "genrule"
outs = ["m.txt"]
cmd = "uname -m > $OUT/m.txt; python3 -c 'import platform, struct; print(platform.machine(), struct.calcsize(\\"P\\"))' >> $OUT/m.txt; od -An -tx1 -j18 -N2 /bin/sh | tr -d ' ' >> $OUT/m.txt"
"""


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    ws = tmp_path_factory.mktemp("emulated") / "ws"
    copy_toolchains(ws)
    (ws / "targets" / "arm.toml").write_text(ARM_TARGETS)
    return ws


@pytest.fixture(scope="module")
def qemu(root, tmp_path_factory) -> str:
    """The pinned qemu-user's binfmt interpreter for aarch64 (its -binfmt-P name keeps argv[0])."""
    ws = WS(root, tmp_path_factory.mktemp("qemu-cache"))
    run = ws.build("//toolchains:qemu-user")
    assert run.rc == 0, run.stderr[-3000:]
    path = str(Path(run.json["outputs"]["//toolchains:qemu-user"]) / "usr/libexec/qemu-binfmt/aarch64-binfmt-P")
    problem = emulation_problem("aarch64", path)
    if problem:
        pytest.skip(problem)
    return path


@pytest.fixture(scope="module")
def stack(tmp_path_factory, qemu):
    """BuildGrid with one x86_64 worker and one aarch64 worker (emulating)."""
    if missing_reason() is not None:
        pytest.skip(missing_reason())
    s = ExecStack(tmp_path_factory.mktemp("exec"), workers=1)
    s.add_worker("arm", extra=("--isa", "aarch64", "--qemu", qemu))
    yield s
    s.stop()


def test_a_sparks_action_runs_on_the_aarch64_worker_with_every_program_emulated(stack, root, tmp_path):
    """The genrule's shell, CPython and a child the shell starts are all aarch64 (the x86_64
    worker beside it could run none of them); a second build from another cache plans the same key."""
    ws = WS(root, tmp_path / "cache")
    run = ws.build("//arm:uname", args=("--host-platform", "aarch64", "--remote-executor", stack.url))
    assert run.rc == 0, run.stderr[-3000:]
    out = Path(run.json["outputs"]["//arm:uname (aarch64 on aarch64)"]) / "m.txt"
    assert out.read_text() == "aarch64\naarch64 8\nb700\n"
    assert run.json["remote_execution"]["executed"] >= 1 and run.json["remote_execution"]["fell_back"] == 0
    again = WS(root, tmp_path / "cache2").build("//arm:uname", args=("--host-platform", "aarch64", "--remote-executor",
                                                                    stack.url))
    assert again.rc == 0, again.stderr[-3000:]
    keys = [{a["key"] for a in r.json["actions"] if a["label"].startswith("//arm:uname")} for r in (run, again)]
    assert keys[0] == keys[1] and len(keys[0]) == 1  # one key for it, whichever cache plans it


def test_an_aarch64_action_never_runs_on_this_machine(stack, root, tmp_path):
    """Without an executor a foreign --host-platform plans only; an action that cannot be sent
    (a host path) is refused with one line instead of running here."""
    ws = WS(root, tmp_path / "cache")
    run = ws.build("//arm:uname", args=("--host-platform", "aarch64"))
    assert run.rc != 0 and "Traceback" not in run.stderr
    assert "cannot run actions for an aarch64 host on this x86_64 machine" in run.stderr
    assert "bgraph worker --isa aarch64" in run.stderr
    (root / "targets" / "hosty.toml").write_text(
        'package = "//hosty"\n\n[tools]\nkind = "host_tools"\ntools = ["/usr/bin/sh"]\n\n'
        '[g]\nkind = "genrule"\ntools = ":tools"\nouts = ["o"]\ncmd = "echo x > $OUT/o"\n')
    try:
        run = ws.build("//hosty:g", args=("--host-platform", "aarch64", "--remote-executor", stack.url))
    finally:
        (root / "targets" / "hosty.toml").unlink()
    assert run.rc != 0 and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert "cannot run on this x86_64 machine" in run.stderr, run.stderr[-2000:]


def test_a_worker_for_another_cpu_without_qemu_is_one_line(tmp_path):
    env = hermetic_env({"PYTHONPATH": str(REPO)})
    for extra, says in ((["--isa", "aarch64"], "--qemu is missing"),
                        (["--isa", "aarch64", "--qemu", str(tmp_path / "none")], "is not an executable file"),
                        (["--qemu", "/bin/true"], "--qemu is for a worker of another CPU")):
        p = subprocess.run([sys.executable, "-m", "build_graph", "worker", "--server", "grpc://127.0.0.1:9",
                            "--cache", str(tmp_path / "c"), *extra], capture_output=True, text=True, env=env,
                           timeout=60)
        assert p.returncode != 0 and says in p.stderr and "Traceback" not in p.stderr, (extra, p.stderr)
        assert len([line for line in p.stderr.splitlines() if line.strip()]) <= 2, p.stderr
