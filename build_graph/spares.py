"""Processes started ahead of their actions, already inside the actions' cgroups.

Joining a cgroup (a write to its cgroup.procs) write-locks the kernel's
cgroup_threadgroup_rwsem, which since Linux 6.0 (commit 6a010a49b63a) waits for an RCU grace
period unless the hierarchy is mounted with `favordynmods`: 5-10 ms measured on a host whose
last join was 50-200 ms earlier, under 0.3 ms back to back. An action's process must not run
before it has joined (its memory would be charged elsewhere), so every action waited that
long before it started: 4-5% of a build of small steps. (clone3's CLONE_INTO_CGROUP, cgroup v2
only, avoids the lock; Python's subprocess cannot use it.)

A spare is a /bin/sh that joins the next action's groups while earlier actions run, then waits
on a pipe for the word to run its launch script: the action starts without the wait, its first
process already counted in its groups. A spare that is gone when its action comes (killed, or
its join refused) is passed over: the sandbox starts that action the direct way.

A spare touches no file of its action: it is started with three memory files (memfd) of its own,
its stdout and stderr (the action's) and bwrap's options, a descriptor of the seccomp program
(seccomp/, which bwrap reads and closes), and with no environment. The action's
thread writes the options, then one newline and the launch script on the pipe, and closes it;
the spare sources the script from the pipe and execs bwrap, which reads its options from their
descriptor (and closes it): the action inherits no descriptor of the spare's but its stdout and
stderr, as on the direct way. The action's environment is in the options (sandbox_env.py). (Before, each action wrote the
options and the script as files, and two empty stdout/stderr files, and removed them: four files
made and removed per action, and the spare read the script's path a byte at a time.)

Spares are started by one thread per bgraph process, which never ends: bwrap --die-with-parent
kills the sandbox when the thread that started its process exits, and an action's thread ends
with its action. The same thread removes finished actions' groups. Part of the sandbox layer:
only sandbox.py uses this.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

from build_graph import seccomp
from build_graph.cgroups import Accounting
from build_graph.sandbox_env import HOST_ENV, setenv_options

# Join every group named (the arguments), then wait for a line on stdin and run the launch
# script that follows it on stdin (the pipe: read whole, up to bgraph's close) in this process;
# end quietly when bgraph closes the pipe instead (the spare is not needed).
SPARE = ('for f; do echo $$ > "$f" || exit 125; done; '
         'IFS= read -r go || exit 0; . /proc/self/fd/0')


@dataclass
class Outputs:
    """The memory files an action's process writes its stdout and stderr into (bgraph keeps its
    own descriptors of them, to read when the process has ended)."""

    stdout: int
    stderr: int

    @classmethod
    def new(cls) -> "Outputs":
        return cls(memfd("stdout"), memfd("stderr"))

    def read(self) -> tuple[bytes, bytes]:
        return read_memfd(self.stdout), read_memfd(self.stderr)

    def close(self) -> None:
        for fd in (self.stdout, self.stderr):
            _close(fd)


@dataclass
class Spare:
    proc: subprocess.Popen
    groups: dict[str, Path]
    outputs: Outputs  # its stdout and stderr, which the action inherits
    options: int  # bwrap's options, read by bwrap on the descriptor of the same number
    seccomp: int  # the spare's own descriptor (this number) of the seccomp program; bgraph's is closed

    def launch(self, bwrap: str, options: bytes, argv: list[str]) -> bool:
        """Hand the spare its action: bwrap's options (NUL-separated, as --args reads them) and
        the argv after them; False if it is gone (then it is reaped). The options start with the
        seccomp program's, read from the spare's own descriptor of it."""
        try:
            _fill(self.options, b"".join(a.encode() + b"\0" for a in seccomp.options(self.seccomp)) + options)
            self.proc.stdin.write(b"\n" + launch_script(bwrap, self.options, argv).encode())
            self.proc.stdin.close()
            return True
        except (OSError, ValueError):  # a broken pipe: it ended before its action came
            try:
                self.proc.stdin.close()
            except (OSError, ValueError):
                pass
            self.proc.wait()
            return False
        finally:
            self.close_inputs()

    def close_inputs(self) -> None:
        """bgraph's descriptor of the options (the spare has its own)."""
        _close(self.options)
        self.options = -1


def launch_script(bwrap: str, options_fd: int, argv: list[str]) -> str:
    """The script a spare sources: stdin for the action, then exec bwrap (whose options, the
    environment's included, come from descriptor `options_fd`; stdout and stderr are the spare's)."""
    q = shlex.quote
    return f"exec {q(bwrap)} --args {options_fd} -- {' '.join(map(q, argv))} </dev/null\n"


def memfd(name: str) -> int:
    """A new memory file (no file system: nothing is made or removed on disk), closed on exec
    unless passed on."""
    return os.memfd_create(f"bgraph-{name}", os.MFD_CLOEXEC)


def _fill(fd: int, data: bytes) -> None:
    """`data` as the whole of memory file `fd`, read from its start by whoever shares it."""
    view, offset = memoryview(data), 0
    while offset < len(view):
        offset += os.pwrite(fd, view[offset:], offset)


# The most of an action's stdout (and of its stderr) that is kept: the last this many bytes. An
# action can make its memory file any size for free (ftruncate: 2 GiB cost it nothing, and cost
# bgraph 4 GB of memory and a 2 GB blob), or fill it; logs past this are cut from the front.
STREAM_CAP = 16 << 20


def read_memfd(fd: int, cap: int = STREAM_CAP) -> bytes:
    """What was written to memory file `fd` (by the processes that share it): its last `cap`
    bytes at most, read alone, after a line saying how many bytes before them were dropped."""
    size = os.fstat(fd).st_size
    start = max(0, size - cap)
    chunks, offset = [], start
    while offset < size:
        chunk = os.pread(fd, min(size - offset, 1 << 20), offset)
        if not chunk:
            break
        chunks.append(chunk)
        offset += len(chunk)
    if start:
        chunks.insert(0, f"[bgraph: the first {start} bytes of this output were dropped; "
                         f"the last {cap} are kept]\n".encode())
    return b"".join(chunks)


def _close(fd: int) -> None:
    if fd >= 0:
        try:
            os.close(fd)
        except OSError:
            pass


def environment_options(env: dict[str, str]) -> list[str] | None:
    """bwrap options that give the action exactly `env`, or None where there are too many."""
    return setenv_options(env)


class Spares:
    """Up to `size` spares kept ready, each in fresh groups of `accounting`."""

    def __init__(self, accounting: Accounting, size: int) -> None:
        self.accounting, self.size = accounting, max(1, size)
        self._ready: list[Spare] = []
        self._open = False  # refilled by the starter thread
        self._failed = False  # no group could be made: no more spares are tried
        self._retired: list[dict[str, Path]] = []  # finished actions' groups, removed by the starter thread
        self._busy = 0  # the starter thread is starting a spare or removing groups for this pool
        self._asked = 0  # take() calls since the last close(): the build's actions so far
        self.taken = 0  # how many actions started through a spare

    def take(self) -> Spare | None:
        """A spare that has started (it may still be joining), or None; the starter thread
        starts a new one behind it. The first `size` actions of a build start the direct way:
        a build of one or two actions (an edit) would start and discard spares for nothing."""
        with _STARTER.cond:
            self._asked += 1
            if self._asked <= self.size:
                return None
            self._open = True
            spare = self._ready.pop() if self._ready else None
            if spare is not None:
                self.taken += 1
            _STARTER.want(self)
        return spare

    def retire(self, groups: dict[str, Path]) -> None:
        """Have a finished action's groups removed off the action's path (their figures read):
        a memory cgroup's rmdir waits while the kernel lets go of it, up to tens of ms."""
        if groups:
            with _STARTER.cond:
                self._retired.append(groups)
                _STARTER.want(self)

    def close(self) -> None:
        """End the idle spares and remove the retired groups, once the starter thread has
        finished what it was doing for this pool (bgraph may exit right after: a group left
        behind would outlive it). A later take starts new ones."""
        with _STARTER.cond:
            self._open = False
            self._asked = 0
            while self._busy:
                _STARTER.cond.wait()
            idle, self._ready = self._ready, []
            retired, self._retired = self._retired, []
        for spare in idle:
            self.discard(spare)
        for groups in retired:
            self.accounting.remove(groups)

    def discard(self, spare: Spare) -> None:
        """End an unused spare and remove its groups."""
        try:
            spare.proc.stdin.close()  # it reads end-of-file and exits
        except OSError:
            pass
        spare.proc.wait()
        spare.close_inputs()
        spare.outputs.close()
        self.accounting.remove(spare.groups)

    def _wants_more(self) -> bool:
        return self._open and not self._failed and len(self._ready) < self.size

    def _start(self) -> Spare | None:
        try:
            groups = self.accounting.new_groups()
        except OSError:
            return None  # no group can be made now: actions start the direct way
        procs = sorted({str(g / "cgroup.procs") for g in groups.values()})
        fds = []
        program = -1
        try:
            outputs = Outputs.new()
            fds += [outputs.stdout, outputs.stderr]
            options = memfd("options")
            fds.append(options)
            program = seccomp.open_program()  # the spare's, passed as the memory files are
            # In "/": sh exports PWD (where bgraph runs), which bwrap would pass on to the sandbox.
            proc = subprocess.Popen(["/bin/sh", "-c", SPARE, "bgraph-spare", *procs], cwd="/",
                                    stdin=subprocess.PIPE, stdout=outputs.stdout, stderr=outputs.stderr,
                                    pass_fds=(options, program), env=dict(HOST_ENV), start_new_session=True)
        except OSError:
            for fd in fds:
                _close(fd)
            self.accounting.remove(groups)
            return None
        finally:
            _close(program)
        return Spare(proc, groups, outputs, options, program)


class _Starter:
    """The one thread that starts the spares of every pool in this process. It never ends: bwrap
    --die-with-parent kills a sandbox when the thread that started its process exits."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self._pools: list[Spares] = []
        self._thread: threading.Thread | None = None

    def want(self, pool: Spares) -> None:
        """`pool` may want more spares (call with `cond` held)."""
        if pool not in self._pools:
            self._pools.append(pool)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="bgraph-spares", daemon=True)
            self._thread.start()
        self.cond.notify_all()  # close() may be waiting on the same condition

    def _run(self) -> None:
        while True:
            with self.cond:
                while not (pools := [p for p in self._pools if p._wants_more() or p._retired]):
                    self._pools = [p for p in self._pools if p._open and not p._failed]
                    self.cond.wait()
                work = [(p, p._retired, p._wants_more()) for p in pools]
                for pool in pools:
                    pool._retired = []
                    pool._busy += 1
            for pool, retired, start in work:
                try:
                    for groups in retired:
                        pool.accounting.remove(groups)
                    spare = pool._start() if start else None
                    with self.cond:
                        if start and spare is None:
                            pool._failed = True
                        elif spare is not None and pool._open:
                            pool._ready.append(spare)
                            spare = None
                    if spare is not None:  # closed meanwhile
                        pool.discard(spare)
                finally:
                    with self.cond:
                        pool._busy -= 1
                        self.cond.notify_all()


_STARTER = _Starter()
