"""One lease's process in bubblewrap, as worker.py's contract says: the input root's top-level
entries read-only at /<name>, writable output directories, nothing else of the host.

The isolation options are sandbox.py's own (no capability, no nested user namespace, read-only
/proc), so a remote action is confined exactly as a local one. The process can be killed at any
time (timeout, cancelled lease): its whole tree goes, since bwrap's PID namespace ends with it.

A worker for another CPU (`bgraph worker --isa aarch64 --qemu FILE`) runs each lease's bwrap
inside a user namespace of its own that has its own binfmt_misc (Linux 6.7 and later give each
user namespace one): registered there, with the F flag (the kernel opens the interpreter once,
so the sandbox needs no path to it), qemu-user runs every program of that CPU the action starts,
and nothing is registered on the host. bwrap's own namespaces, made inside that one, inherit it;
the action's confinement is the same as on any worker.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from build_graph import seccomp
from build_graph.remote_exec.staging import BadInput
from build_graph.sandbox import (
    NO_CAPABILITIES,
    READ_ONLY_PROC,
    find_bwrap,
    nesting_options,
)
from build_graph.sandbox_env import (
    HOST_ENV,
    SHELL,
    EnvironmentRefused,
    handover,
    host_lookup,
    resolves,
    stdin_fd,
)
from build_graph.spares import memfd, read_memfd

# binfmt_misc's magic and mask of each CPU a worker may emulate: an ELF64 executable or shared
# object for its e_machine (as Debian's qemu-user-static registers them).
BINFMT = {
    "aarch64": (r"\x7f\x45\x4c\x46\x02\x01\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x02\x00\xb7\x00",
                r"\xff\xff\xff\xff\xff\xff\xff\x00\xff\xff\xff\xff\xff\xff\xff\xff\xfe\xff\xff\xff"),
}
# In the new user and mount namespace: its own binfmt_misc, the one entry, then bwrap (mount by
# its path, as $2).
_REGISTER_AND_EXEC = ('"$2" -t binfmt_misc bgraph /proc/sys/fs/binfmt_misc && '
                      'printf %s "$1" > /proc/sys/fs/binfmt_misc/register && shift 2 && exec "$@"')


def emulating(isa: str, qemu: str) -> list[str]:
    """The argv prefix that starts bwrap where `qemu` (a static qemu-user binary; its Debian
    `*-binfmt-P` name keeps each program's argv[0]) runs programs of `isa`."""
    magic, mask = BINFMT[isa]
    flags = "FP" if qemu.endswith("-binfmt-P") else "F"
    entry = f":bgraph-{isa}:M::{magic}:{mask}:{qemu}:{flags}"
    return [shutil.which("unshare") or "/usr/bin/unshare", "--user", "--map-root-user", "--mount", "--",
            "/bin/sh", "-c", _REGISTER_AND_EXEC, "bgraph-binfmt", entry, shutil.which("mount") or "/usr/bin/mount"]


def emulation_problem(isa: str, qemu: str) -> str | None:
    """Why this host cannot run `isa` programs through `qemu` as emulating() does, or None."""
    if isa not in BINFMT:
        return f"no binfmt entry for {isa} (known: {', '.join(sorted(BINFMT))})"
    if not (os.path.isfile(qemu) and os.access(qemu, os.X_OK)):
        return f"{qemu} is not an executable file"
    try:
        probe = subprocess.run([*emulating(isa, qemu), "/bin/true"], capture_output=True, text=True, timeout=30,
                               check=False, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"cannot start a user namespace with its own binfmt_misc: {e}"
    if probe.returncode != 0:
        return ("this kernel gives a user namespace no binfmt_misc of its own (Linux 6.7 or later does; "
                f"unshare and mount from util-linux are needed): {probe.stderr.strip()[-300:]}")
    return None


@dataclass
class Ended:
    """How the process ended: its exit code, and whether the worker ended it (and why)."""

    exit_code: int
    started: bool  # bwrap started the command (else the sandbox itself failed)
    killed: str = ""  # "timeout" or "cancelled" where the worker killed it
    start: float = 0.0
    end: float = 0.0


def bwrap_options(bwrap: str, mounts: list[tuple], writable: list[tuple[Path, str]], cwd: str) -> list[str]:
    """bwrap's options (before `--`): `mounts` are, in order, ("ro", host_path, path) |
    ("symlink", target, path) | ("dir", path) (an empty directory of the sandbox's own tmpfs);
    `writable` pairs a host directory with its path in the sandbox."""
    args = ["--unshare-all", NO_CAPABILITIES[0], NO_CAPABILITIES[1], *nesting_options(bwrap),
            "--die-with-parent", "--new-session", "--hostname", "bgraph", *READ_ONLY_PROC,
            "--dev", "/dev", "--tmpfs", "/tmp"]
    for op in mounts:
        if op[0] == "dir":
            args += ["--dir", f"/{op[1]}"]
        elif op[0] == "symlink":
            args += ["--symlink", op[1], f"/{op[2]}"]
        else:
            args += ["--ro-bind", str(op[1]), f"/{op[2]}"]
    for host, inside in sorted(writable, key=lambda w: w[1].count("/")):
        args += ["--bind", str(host), f"/{inside}"]
    return args + ["--chdir", "/" + cwd if cwd else "/"]


def has_shell(options: list[str]) -> bool:
    """Whether /bin/sh is a file in the sandbox that bwrap_options() `options` make."""
    binds: list[tuple[str, object]] = []
    links: dict[str, str] = {}
    i = 0
    while i < len(options):
        if options[i] in ("--ro-bind", "--bind"):
            binds.append((options[i + 2], options[i + 1]))
            i += 3
        elif options[i] == "--symlink":
            links[options[i + 2]] = options[i + 1]
            i += 3
        else:
            i += 1
    return resolves(SHELL, binds, links, host_lookup)


_ACCOUNTING = None  # cgroups.Accounting, probed once per worker process (its limit watcher too)
_ACCOUNTING_LOCK = threading.Lock()


def accounting():
    """The worker's cgroups: each lease's process in groups of its own, bounded as a local
    action's are (cgroups.py: tasks and memory), so a fork bomb or a runaway lease cannot take
    the worker's host, its heartbeat or its other leases down."""
    global _ACCOUNTING
    with _ACCOUNTING_LOCK:
        if _ACCOUNTING is None:
            from build_graph.cgroups import Accounting

            _ACCOUNTING = Accounting.probe()
        return _ACCOUNTING


class Process:
    """The sandboxed command of one lease; kill() may be called from another thread."""

    def __init__(self, options: list[str], argv: list[str], env: dict[str, str], stdout: Path, stderr: Path,
                 launcher: list[str] = ()):
        """`launcher`: what starts bwrap (emulating()'s prefix), exec'ing into it: the process is
        bwrap's all the same (one process group, killed as one). `env`, the Command's, reaches
        only the sandbox (sandbox_env.py): BadInput where it cannot."""
        self.bwrap = find_bwrap()
        self._killed = ""
        self._lock = threading.Lock()
        # Exactly the Command's environment, given by bwrap inside the sandbox: no host process
        # started here (the launcher's unshare and sh, bwrap) runs with it, where LD_PRELOAD
        # and the like would run the action's code on the worker's host.
        try:
            handed = handover(env, lambda: has_shell(options))
        except EnvironmentRefused as e:  # the worker's INVALID_ARGUMENT: no other worker would run it
            raise BadInput(str(e)) from None
        self._stderr = stderr
        self._accounting = accounting()
        try:
            self._groups = self._accounting.new_groups()
        except OSError:  # none can be made now: the lease runs unbounded, as where the host has none
            self._groups = {}
        opts = memfd("options")
        status = memfd("status")
        self._status = status
        stdin = program = None
        try:
            program = seccomp.open_program()  # the seccomp program every action's bwrap installs
            os.write(opts, b"".join(a.encode() + b"\0" for a in [*seccomp.options(program), *options,
                                                                 *handed.options, "--json-status-fd", str(status)]))
            os.lseek(opts, 0, os.SEEK_SET)
            stdin = stdin_fd(handed.script)
            command = self._accounting.wrap(self._groups, [*launcher, self.bwrap, "--args", str(opts), "--",
                                                           *handed.prefix, *argv])
            with open(stdout, "wb") as out, open(stderr, "wb") as err:
                self.proc = subprocess.Popen(command, env=dict(HOST_ENV), stdout=out, stderr=err, stdin=stdin,
                                             pass_fds=(opts, status, program), start_new_session=True)
        except BaseException:
            os.close(status)
            self._accounting.remove(self._groups)
            raise
        finally:
            os.close(opts)
            for fd in (stdin, program):
                if fd is not None:
                    os.close(fd)
        self.start = time.time()

    def kill(self, why: str) -> None:
        """Kill the process tree (bwrap and, through its PID namespace, all the action made)."""
        with self._lock:
            if self.proc.returncode is not None:
                return
            self._killed = self._killed or why
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def wait(self, timeout_s: float | None, cancelled: threading.Event) -> Ended:
        """Wait for the end, killing the process at `timeout_s` or once `cancelled` is set."""
        deadline = self.start + timeout_s if timeout_s else None
        try:
            # A pidfd is readable when the process ends: the end is seen at once, not at the
            # next poll (polling every 50 ms cost a trivial action 25 ms on average).
            ended = os.pidfd_open(self.proc.pid)
        except OSError:  # a kernel before 5.3: polled
            ended = None
        try:
            while True:
                step = 0.25 if deadline is None else max(0.0, min(0.25, deadline - time.time()))
                if ended is not None:
                    if select.select([ended], [], [], step)[0]:
                        break
                else:
                    try:
                        self.proc.wait(timeout=min(step, 0.05))
                        break
                    except subprocess.TimeoutExpired:
                        pass
                if cancelled.is_set():
                    self.kill("cancelled")
                elif deadline is not None and time.time() >= deadline:
                    self.kill("timeout")
        finally:
            if ended is not None:
                os.close(ended)
        self.proc.wait()
        end = time.time()
        try:
            text = read_memfd(self._status).decode(errors="replace")
            hit = self._accounting.limit_hit(self._groups) if self._groups else None
        finally:
            os.close(self._status)
            self._accounting.remove(self._groups)
        started = "child-pid" in text
        code = self.proc.returncode
        for doc in text.replace("}{", "}\n{").splitlines():
            try:
                parsed = json.loads(doc)
            except ValueError:
                continue
            if "exit-code" in parsed:
                code = parsed["exit-code"]
        if hit is not None:  # a fork refused or a process killed for memory: an ordinary failure, said in its stderr
            with open(self._stderr, "ab") as err:
                err.write(f"\nbgraph worker: {hit.render()}\n".encode())
            code = code or 1
        return Ended(exit_code=code, started=started, killed=self._killed, start=self.start, end=end)
