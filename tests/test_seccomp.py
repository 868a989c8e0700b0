"""The seccomp program every action's bwrap installs (build_graph/seccomp): no keyring syscall
(ENOSYS) and no tracing (EPERM) inside a sandbox, on every path that starts one: the direct
start, a spare, `bgraph exec`'s, the host tool version probe, a remote worker's lease, and a
genrule built by bgraph (red-team R2 holes 1 and 2: an action read the login's session keyring
and left keys later actions read; it ptraced the sandbox's init and outlived bgraph; R10: it took
init's exit-status eventfd with pidfd_getfd and forged a success). Real
bubblewrap; the probe program is built by the host's gcc."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import threading
from pathlib import Path

import pytest

from bgraph_testlib import TOOLCHAINS_TOML, requires_bwrap
from build_graph import seccomp
from build_graph.model import Action, Digester

# One line: what each call gave ("ok" or the errno's name), then "done" (the program was not killed).
PROBE_C = r"""
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/ptrace.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

static const char *how(long r, int e) {
    static char buf[32];
    if (r >= 0) return "ok";
    if (e == ENOSYS) return "ENOSYS";
    if (e == EPERM) return "EPERM";
    snprintf(buf, sizeof buf, "errno%d", e);
    return buf;
}
static void let_go(void) {  /* the hole: let the sandbox's init (attached, stopped) go again */
    int st;
    waitpid(1, &st, __WALL);
    ptrace(PTRACE_DETACH, 1, 0, 0);
}
#define SHOW(name, call) do { errno = 0; long r_ = (call); printf("%s=%s ", name, how(r_, errno)); } while (0)

int main(void) {
    char a[8] = "abcdefg", b[8];
    struct iovec here = {b, sizeof b}, there = {a, sizeof a};
    SHOW("keyctl", syscall(SYS_keyctl, 0 /* KEYCTL_GET_KEYRING_ID */, -3 /* session */, 0));
    /* Into the process keyring (-2, gone with the process): unfiltered, nothing is left on the host. */
    SHOW("add_key", syscall(SYS_add_key, "user", "bgraph-seccomp-test", "x", 1, -2));
    SHOW("request_key", syscall(SYS_request_key, "user", "bgraph-seccomp-test", NULL, 0));
    errno = 0;
    long r = syscall(SYS_ptrace, PTRACE_ATTACH, 1, 0, 0);
    printf("ptrace=%s ", how(r, errno));
    if (r == 0) let_go();
    SHOW("process_vm_readv", syscall(SYS_process_vm_readv, getpid(), &here, 1, &there, 1, 0));
    SHOW("process_vm_writev", syscall(SYS_process_vm_writev, getpid(), &there, 1, &here, 1, 0));
    /* init's descriptors (its exit-status eventfd among them): pidfd_open itself stays allowed. */
    int init = (int)syscall(SYS_pidfd_open, 1, 0);
    SHOW("pidfd_getfd", init < 0 ? init : syscall(SYS_pidfd_getfd, init, 0, 0));
#if defined(__x86_64__)
    /* The i386 ABI (int 0x80) from a 64-bit process: its own numbers, the same rules. */
    long k;
    __asm__ volatile("int $0x80" : "=a"(k) : "a"(288 /* keyctl */), "b"(0), "c"(-3), "d"(0) : "memory");
    printf("i386_keyctl=%s ", how(k, (int)-k));
    __asm__ volatile("int $0x80" : "=a"(k) : "a"(26 /* ptrace */), "b"(PTRACE_ATTACH), "c"(1), "d"(0), "S"(0)
                     : "memory");
    printf("i386_ptrace=%s ", how(k, (int)-k));
    if (k == 0) let_go();
#endif
    printf("done\n");
    return 0;
}
"""

EXPECTED = ("keyctl=ENOSYS add_key=ENOSYS request_key=ENOSYS ptrace=EPERM process_vm_readv=EPERM "
            "process_vm_writev=EPERM pidfd_getfd=EPERM " + ("i386_keyctl=ENOSYS i386_ptrace=EPERM " if platform.machine() == "x86_64"
                                          else "") + "done")


@pytest.fixture(scope="module")
def probe(tmp_path_factory) -> Path:
    """The probe program, built by the host's gcc in a directory of its own."""
    cc = shutil.which("gcc")
    if cc is None:
        pytest.skip("no gcc to build the probe program")
    where = tmp_path_factory.mktemp("seccomp-probe")
    (where / "probe.c").write_text(PROBE_C)
    subprocess.run([cc, "-O1", "-o", str(where / "probe"), str(where / "probe.c")], check=True)
    (where / "probe.c").unlink()
    return where / "probe"


def test_the_programs_are_libseccomps():
    """The committed programs are what libseccomp makes (`python3 -m build_graph.seccomp`)."""
    for machine in seccomp.ABIS:
        try:
            made = seccomp.generate(machine)
        except OSError as e:
            pytest.skip(f"libseccomp unusable here: {e}")
        assert made == seccomp.program_path(machine).read_bytes(), f"{machine}: run python3 -m build_graph.seccomp"


def test_the_programs_are_package_data():
    import tomllib

    root = Path(__file__).resolve().parents[1]
    data = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "*.bpf" in data["build_graph.seccomp"]


def probe_action(probe: Path, name: str = "probe") -> Action:
    return Action(name=name, mnemonic="Genrule", argv=(str(probe),), env=(("PATH", "/usr/bin:/bin"),), outputs=(),
                  host_paths=("/usr", str(probe.parent)))


@requires_bwrap
def test_no_keyring_and_no_tracing_on_the_direct_and_spare_paths(tmp_path, probe):
    from build_graph.sandbox import BwrapRunner
    from build_graph.store.cas import LocalCas
    from test_sandbox_env import printed

    cas = LocalCas(tmp_path / "cache", Digester("blake3"))
    runner = BwrapRunner(cas, jobs=1)
    try:
        views = [printed(runner, probe_action(probe, f"p{i}")) for i in range(5)]
    finally:
        runner.close()
        cas.close()
    assert "direct" in {way for way, _ in views}
    if runner.spares is not None:
        assert "spare" in {way for way, _ in views}, "no action went through a spare"
    for way, out in views:
        assert out.decode().strip() == EXPECTED, way


@requires_bwrap
def test_no_keyring_and_no_tracing_in_bgraph_exec(tmp_path, probe):
    from build_graph.sandbox import BwrapRunner
    from build_graph.store.cas import LocalCas

    cas = LocalCas(tmp_path / "cache", Digester("blake3"))
    runner = BwrapRunner(cas, jobs=1)
    try:
        out_dir = tmp_path / "out"
        out_dir.mkdir()
        argv, env, stdin = runner.interactive(probe_action(probe), out_dir)
        run = subprocess.run(argv, env=env, stdin=stdin, capture_output=True, text=True, timeout=60)
    finally:
        runner.close()
        cas.close()
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == EXPECTED


@requires_bwrap
def test_no_keyring_and_no_tracing_in_the_host_tool_probe(probe):
    from build_graph.sandbox import _sandboxed_version

    assert _sandboxed_version(str(probe)) == EXPECTED


@requires_bwrap
def test_no_keyring_and_no_tracing_in_a_workers_lease(tmp_path, probe):
    from build_graph.remote_exec.runner import Process, bwrap_options, find_bwrap

    mounts = [("ro", "/usr", "usr"), ("ro", str(probe.parent), str(probe.parent)[1:])]
    mounts += [("symlink", os.readlink(f"/{d}"), d) for d in ("bin", "lib", "lib64") if os.path.islink(f"/{d}")]
    proc = Process(bwrap_options(find_bwrap(), mounts, [], ""), [str(probe)], {"PATH": "/usr/bin"},
                   tmp_path / "stdout", tmp_path / "stderr")
    ended = proc.wait(60, threading.Event())
    assert ended.exit_code == 0, (tmp_path / "stderr").read_text()
    assert (tmp_path / "stdout").read_text().strip() == EXPECTED


@requires_bwrap
def test_a_genrule_builds_with_gcc_and_gets_no_keyring_or_tracing_nor_does_bgraph_exec(make_ws):
    if shutil.which("gcc") is None:
        pytest.skip("no gcc")
    toolchains = TOOLCHAINS_TOML.replace('"/usr/bin/patch"]', '"/usr/bin/patch", "/usr/bin/gcc"]')
    ws = make_ws({"targets/toolchains.toml": toolchains, "probe.c": PROBE_C,
                  "targets/p.toml": '[probe]\nkind = "genrule"\nsrcs = ["probe.c"]\nouts = ["probe", "result.txt"]\n'
                                    'cmd = "gcc -O1 -o $OUT/probe $SRC/probe.c && $OUT/probe > $OUT/result.txt"\n'})
    run = ws.build("//p:probe")
    assert run.rc == 0, run.stderr
    assert ws.read_output("//p:probe", "result.txt").strip() == EXPECTED
    # `bgraph exec` runs its command in a sandbox of its own: the same program there.
    run = ws.cli("exec", "//p:probe", "--", "./probe")
    assert run.rc == 0, run.stderr
    assert run.stdout.strip() == EXPECTED
