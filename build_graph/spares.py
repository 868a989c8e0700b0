"""Processes started ahead of their actions, already inside the actions' cgroups.

Joining a cgroup (a write to its cgroup.procs) write-locks the kernel's
cgroup_threadgroup_rwsem, which since Linux 6.0 (commit 6a010a49b63a) waits for an RCU grace
period unless the hierarchy is mounted with `favordynmods`: 5-10 ms measured on a host whose
last join was 50-200 ms earlier, under 0.3 ms back to back. An action's process must not run
before it has joined (its memory would be charged elsewhere), so every action waited that
long before it started: 4-5% of a build of small steps. (clone3's CLONE_INTO_CGROUP, cgroup v2
only, avoids the lock; Python's subprocess cannot use it.)

A spare is a /bin/sh that joins the next action's groups while earlier actions run, then waits
on a pipe for the script that says what to exec: the action starts without the wait, its first
process already counted in its groups. A spare that is gone when its action comes (killed, or
its join refused) is passed over: the sandbox starts that action the direct way.

Spares are started by one thread per bgraph process, which never ends: bwrap --die-with-parent
kills the sandbox when the thread that started its process exits, and an action's thread ends
with its action. The same thread removes finished actions' groups. Part of the sandbox layer:
only sandbox.py uses this.
"""

from __future__ import annotations

import shlex
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

from build_graph.cgroups import Accounting

# Join every group named, then wait for the path of the launch script (a line on stdin) and run
# it in this process; end quietly when bgraph closes the pipe instead (the spare is not needed).
SPARE = 'for f; do echo $$ > "$f" || exit 125; done; IFS= read -r launch || exit 0; . "$launch"'

# bwrap takes at most 9,000 arguments; an environment that needs more --setenv options than
# this is started the direct way (the sandbox passes it as bwrap's own environment).
MAX_SETENV_ARGS = 6000


@dataclass
class Spare:
    proc: subprocess.Popen
    groups: dict[str, Path]

    def launch(self, script: Path) -> bool:
        """Hand the spare its launch script; False if it is gone (then it is reaped)."""
        try:
            self.proc.stdin.write(str(script).encode() + b"\n")
            self.proc.stdin.close()
            return True
        except (OSError, ValueError):  # a broken pipe: it ended before its action came
            self.proc.wait()
            return False


def launch_script(bwrap: str, options_file: Path, argv: list[str], stdout: Path, stderr: Path) -> str:
    """The script a spare sources: its descriptors for the action, then exec bwrap (whose options,
    the environment's included, come from `options_file`, read on descriptor 3)."""
    q = shlex.quote
    return (f"exec 3<{q(str(options_file))} </dev/null >{q(str(stdout))} 2>{q(str(stderr))}\n"
            f"exec {q(bwrap)} --args 3 -- {' '.join(map(q, argv))}\n")


def environment_options(env: dict[str, str]) -> list[str] | None:
    """bwrap options that give the action exactly `env`, or None where there are too many."""
    if 2 * len(env) > MAX_SETENV_ARGS:
        return None
    options = ["--clearenv"]
    for name, value in env.items():
        options += ["--setenv", name, value]
    return options


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
        self.accounting.remove(spare.groups)

    def _wants_more(self) -> bool:
        return self._open and not self._failed and len(self._ready) < self.size

    def _start(self) -> Spare | None:
        try:
            groups = self.accounting.new_groups()
        except OSError:
            return None  # no group can be made now: actions start the direct way
        procs = sorted({str(g / "cgroup.procs") for g in groups.values()})
        try:
            proc = subprocess.Popen(["/bin/sh", "-c", SPARE, "bgraph-spare", *procs], stdin=subprocess.PIPE,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={},
                                    start_new_session=True)
        except OSError:
            self.accounting.remove(groups)
            return None
        return Spare(proc, groups)


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
