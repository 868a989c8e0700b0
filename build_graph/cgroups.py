"""Per-action CPU time and peak memory, through cgroups each sandboxed action is started in.

A parent's child rusage cannot give either: bubblewrap reaps the action's processes inside its
PID namespace, so their CPU never reaches bgraph; and a child's ru_maxrss starts from the
forking parent's high-water mark (exec records the old address space's peak into the child's
rusage, after fork, vfork and posix_spawn alike), so every action of a large bgraph would
report bgraph's own size. A cgroup counts every process started in it, however it ends, and
only what they charge.

Where this host lets bgraph make cgroups, each action gets one per hierarchy it uses: cgroup
v1's cpuacct for CPU and v1's memory controller for memory (separate hierarchies, so two
groups), or one group in a cgroup v2 subtree of bgraph's own (CPU always; memory where the
memory controller can be enabled there). Groups are made below bgraph's own cgroup of each
hierarchy, so an action stays inside whatever limits bgraph runs under. Elsewhere CPU time is
not measured (0) and memory is sampled from the process tree (sandbox.PeakSampler).

The same groups bound what an action may take of the host (red-team K14): an action's processes
sit in no group of the host's own, so a fork bomb took every PID of the host (bgraph's next fork,
a worker's heartbeat then failed; uid 0 ignores RLIMIT_NPROC) and an action could push the host
into a global OOM kill, whose victim is the largest process: bgraph, not the action. Each action
gets a pids limit (ACTION_TASKS; with cgroup v1's pids hierarchy, or v2's pids controller) and a
memory limit (memory_limit_mb), and the parent group of all actions (`base`) bounds them together
(ALL_ACTIONS_TASKS_SHARE of the host's PIDs, the host's RAM less MEMORY_RESERVE for bgraph): a
limit reached refuses the action a process (fork fails) or kills one of its processes (an OOM kill
inside its group), never one of bgraph's. An action that reached one fails with one line naming it
(`limit_hit`). A controller the host lacks is skipped (no limit, as before); one the host has but
bgraph cannot use is said once on stderr (`warn_once`), never dropped without a word.

Groups are made in three levels (red-team K16): `base` (shared by every bgraph of this cgroup:
the host-wide cap of all their actions together), one group per bgraph process below it (named
"<pid>-<start time>-<pid namespace>-<random>", so a later process that gets the same pid never
takes a group a killed one left, nor judges one of another PID namespace; it carries that
process's own all-actions caps, and is removed at exit, or by remove_stale once its process is
gone), and one group per action below that. One build's actions can then take at most its own
task cap, half of the shared one: another build's action is never refused a process for it. An
action's own task limit is at most 3/4 of its build's cap, so one fork bomb leaves its build's
other actions room. Part of the sandbox layer: only it calls this."""

from __future__ import annotations

import atexit
import errno
import itertools
import os
import secrets
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from build_graph.errors import ActionFailed, UsageError

# At most this many processes and threads at once per action (the kernel counts both as tasks):
# a configure script or a compile's driver, assembler and linker take tens; `make -j128` a few
# hundred; a JVM or a many-threaded linker hundreds more. All actions together may take at most
# ALL_ACTIONS_TASKS_SHARE of the host's tasks (the lower of kernel.pid_max and threads-max): the
# rest stay free for bgraph, its workers' heartbeats and the host, however many actions run.
ACTION_TASKS = 8192
ALL_ACTIONS_TASKS_SHARE = 3 / 4
# One bgraph process's actions together take at most this share of the shared cap above (its own
# group's pids.max): whatever one build does, half stays for the others. One action takes at most
# ACTION_SHARE of its build's cap: a fork bomb leaves its build's other actions a quarter.
BUILD_TASKS_SHARE = 1 / 2
ACTION_SHARE = 3 / 4
# Memory kept out of reach of the actions, all together: bgraph's own (a large graph's plan, the
# store's buffers) and the host's. Not the scheduler's --max-mem, a budget of declared hints that
# real steps exceed (a link takes more than its hint), and not known here (bgraph's runner is
# made without it): the bound is what keeps the host's OOM killer off bgraph, the host's RAM less
# this reserve: the larger of 1 GiB and an eighth of RAM.
MEMORY_RESERVE_MB = 1024
MEMORY_RESERVE_SHARE = 1 / 8
# The environment variables that set an action's limits lower or higher (a whole number; the
# memory one is bounded by the all-actions limit all the same).
TASKS_VARIABLE = "BGRAPH_ACTION_TASKS"
MEMORY_VARIABLE = "BGRAPH_ACTION_MEMORY_MB"
# How often running actions' groups are checked for a limit reached (Accounting's watcher): a
# fork bomb at its limit never ends by itself (each process forks again as soon as another
# exits), nor does a program whose threads wait on one that could not start; such an action is
# killed at once, its failure naming the limit.
WATCH_S = 0.25

# The action's first process joins its cgroups (the files named before "--"), then becomes bwrap:
# nothing of the action runs outside them, and nothing of bgraph's memory is charged to them
# (a process's pages stay charged where they were when it moves; sh has exec'd by then).
# The shell's PWD (which sh exports, the directory bgraph runs in: the workspace) is unset before
# the exec: bwrap would pass it on, and the sandbox's /proc/1/environ would show that host path.
JOIN_AND_EXEC = ('while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; '
                 'unset PWD OLDPWD; exec "$@"')

# An action's processes are killed by its groups, not only by bwrap's process group: after its
# bwrap ends (Accounting.kill_left, before its outputs are read), when bgraph stops (kill_all),
# when a group will not go (_remove: EBUSY), at exit and in a dead bgraph's stale groups
# (_remove_tree). A process that got out of the PID namespace's teardown (ptrace of bwrap's init
# clears its parent-death signal: red-team R2 pid1_ptrace) stays in the groups it was started in,
# where it cannot leave (no cgroup file is writable in the sandbox). Killing it takes at most
# this long; one in uninterruptible sleep past it is left to the next try (rmdir, remove_stale).
KILL_WAIT_S = 2.0
SETTLE_S = 0.5  # how long a process left after bwrap ended may take to show it is on its way out


# Action groups are named "<n>" inside this process's own group: n from one counter per process,
# so two accounting objects (two runners made at once by two action threads) never pick the same
# name; a name taken all the same (EEXIST) is skipped.
_IDS = itertools.count()
# This process's own group in each hierarchy ({(pid, base): group}), made once, removed at exit.
_OWN: dict[tuple[int, Path], Path] = {}
_OWN_LOCK = threading.Lock()
_WARNED: set[str] = set()
_NAMES: dict[int, str] = {}  # this process's own groups' name (_own_name)


def warn_once(message: str) -> None:
    """Say `message` on stderr, once per process (a limit the host has but bgraph cannot set)."""
    with _OWN_LOCK:
        if message in _WARNED:
            return
        _WARNED.add(message)
    try:
        sys.stderr.write(f"warning: {message}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def _start_time(pid: int | str) -> str | None:
    """The start time of process `pid` (/proc/<pid>/stat field 22, clock ticks since boot), or
    None where it is gone: with the pid, it names one process for as long as the host is up."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()  # the command name may hold spaces and parentheses
    return fields[19] if len(fields) > 19 else None


def _pid_namespace() -> str:
    """This process's PID namespace (its inode), in hex: pids of another mean nothing here."""
    try:
        return f"{os.stat('/proc/self/ns/pid').st_ino:x}"
    except OSError:
        return "0"


def _own_name(fresh: bool = False) -> str:
    """This process's group name, the same in each hierarchy: "<pid>-<start time>-<pid
    namespace>-<random>" (a bgraph in another PID namespace sharing the hierarchy, a
    container's, cannot judge it by its pid). `fresh`: another random part (the name was taken)."""
    pid = os.getpid()
    if fresh or pid not in _NAMES:
        _NAMES[pid] = f"{pid}-{_start_time('self')}-{_pid_namespace()}-{secrets.token_hex(4)}"
    return _NAMES[pid]


def _is_stale(name: str) -> bool:
    """Whether the group `name` (a process's own group, or an action group of the layout before
    these, "<pid>-<n>") belongs to a bgraph process that is no longer running."""
    parts = name.split("-")
    if not parts[0].isdecimal():
        return False
    if len(parts) == 4:  # another PID namespace's: left to a bgraph there
        return parts[2] == _pid_namespace() and _start_time(parts[0]) != parts[1]
    return len(parts) == 2 and not Path(f"/proc/{parts[0]}").exists()


def _remove_own_groups() -> None:
    """At exit: this process's own groups (and action groups left in them) go."""
    with _OWN_LOCK:
        own = [group for (pid, _), group in _OWN.items() if pid == os.getpid()]
    for group in own:
        _remove_tree(group)


atexit.register(_remove_own_groups)


def _wrap(procs_files: list[Path], argv: list[str]) -> list[str]:
    return ["/bin/sh", "-c", JOIN_AND_EXEC, "bgraph-join", *map(str, procs_files), "--", *argv]


class _Groups:
    """One group per action under `base`: made, joined, removed (stale ones too)."""

    def __init__(self, base: Path, version: int, own: bool = False):
        """`own`: actions' groups go in this process's own group below `base` (what probe makes;
        without it, straight below `base`, which then stands for that group)."""
        self.base, self.version, self.own = base, version, own
        self.recreated = False  # own group made again (new_group): its caps are to be set again

    def own_group(self) -> Path:
        """This process's group below `base` (made the first time), parent of its actions'."""
        key = (os.getpid(), self.base)
        with _OWN_LOCK:
            group = _OWN.get(key)
            if group is None:
                for attempt in range(100):
                    group = self.base / _own_name(fresh=attempt > 0)
                    try:
                        group.mkdir()
                        break
                    except FileExistsError:
                        continue
                else:
                    raise FileExistsError(errno.EEXIST, "no free group name", str(self.base))
                _OWN[key] = group
        return group

    def new_group(self) -> Path:
        own = self.own_group() if self.own else self.base
        for _ in range(1000):
            group = own / str(next(_IDS))
            try:
                group.mkdir()
                return group
            except FileExistsError:
                continue
            except FileNotFoundError:
                if not self.own or not own.parent.is_dir() or own.exists():
                    raise
                # Removed under us (by hand, say): made again; its caps with it (Accounting).
                with _OWN_LOCK:
                    _OWN.pop((os.getpid(), self.base), None)
                self.recreated = True
                own = self.own_group()
                self._enable_below(own)
        raise FileExistsError(errno.EEXIST, "no free group name", str(own))

    def wrap(self, group: Path, argv: list[str]) -> list[str]:
        """`argv`, started inside `group`."""
        return _wrap([group / "cgroup.procs"], argv)

    def remove_stale(self) -> None:
        """Remove the groups that bgraph processes no longer running left (killed, say), with
        the action groups in them (a process's own group is told by its start time: its pid may
        be another process's now)."""
        for group in self.base.iterdir():
            if group.is_dir() and _is_stale(group.name):
                _remove_tree(group)

    def remove(self, group: Path) -> None:
        _remove(group)

    def _enable_below(self, own: Path) -> None:
        """v2: the controllers on for `base`'s children, on for `own`'s too (its actions')."""
        if self.version == 2:
            control = own / "cgroup.subtree_control"
            for controller in set((self.base / "cgroup.subtree_control").read_text().split()) - set(
                    control.read_text().split()):
                control.write_text(f"+{controller}")

    def _works(self, read, limit=None) -> bool:
        """Whether a short-lived process can be started in a new group here (`limit` applied to
        it first, where given) and `read` gives a figure for it afterwards (why not: `self.why`)."""
        self.why = ""
        try:
            self.base.mkdir(exist_ok=True)
            self.remove_stale()
            if self.own:
                self._enable_below(self.own_group())
            group = self.new_group()
            try:
                if limit is not None:
                    limit(group)
                run = subprocess.run(self.wrap(group, ["/bin/true"]), capture_output=True)
                if run.returncode != 0:
                    self.why = f"a process could not join a group in {self.base} ({run.stderr.decode(errors='replace').strip()[-200:]})"
                    return False
                if read(group) is None:
                    self.why = f"a group in {self.base} gives no figure"
                    return False
                return True
            finally:
                self.remove(group)
        except OSError as e:
            self.why = f"{self.base}: {e.strerror or e}"
            return False


class CpuAccounting(_Groups):
    """Makes one cgroup per action under `base` and reads its CPU time back."""

    @classmethod
    def probe(cls, root: Path = Path("/sys/fs/cgroup"), self_cgroup: Path = Path("/proc/self/cgroup")
              ) -> "CpuAccounting | None":
        """The accounting this host allows (tried by moving a short-lived process), or None."""
        candidates = []
        if (root / "cpuacct" / "cpuacct.usage").exists():
            own = _own_v1_path(self_cgroup, "cpuacct") or ""
            candidates.append((root / "cpuacct" / own / "bgraph", 1))
        own = _own_v2_path(self_cgroup)
        if own is not None and (root / "cgroup.controllers").exists():
            candidates.append((root / own / "bgraph-actions", 2))
        for base, version in candidates:
            accounting = cls(base, version, own=True)
            if accounting._works(accounting.cpu_s):
                return accounting
        return None

    def cpu_s(self, group: Path) -> float | None:
        """CPU seconds (user + system) of every process that ran in `group`."""
        try:
            if self.version == 1:
                return int((group / "cpuacct.usage").read_text()) / 1e9
            for line in (group / "cpu.stat").read_text().splitlines():
                name, _, value = line.partition(" ")
                if name == "usage_usec":
                    return int(value) / 1e6
        except (OSError, ValueError):
            pass
        return None


class MemoryAccounting(_Groups):
    """Makes one memory cgroup per action under `base` and reads its peak back.

    The kernel's peak (v1 memory.max_usage_in_bytes, v2 memory.peak) counts everything charged
    to the group: anonymous memory, tmpfs (the sandbox's /tmp is memory) and the memory files
    its stdout and stderr go to (sandbox.py), kernel memory (page tables), and the page cache of
    files the action read first or wrote. Page cache is
    reclaimable and is not what the scheduler must budget, so the page cache the group still
    holds when the action has ended (its files other than tmpfs) is taken off: the result is
    the action's peak of non-reclaimable memory. A file the action wrote and deleted again
    (outside /tmp) is counted: its cache was freed before the end. Pages that were already
    cached by someone else (tools, inputs) are charged to whoever read them first, and are not
    counted; they are shared."""

    @classmethod
    def probe(cls, root: Path = Path("/sys/fs/cgroup"), self_cgroup: Path = Path("/proc/self/cgroup"),
              cpu: CpuAccounting | None = None, limit_mb: int = 0) -> "MemoryAccounting | None":
        """The memory accounting this host allows, or None. Under cgroup v2 a process is in one
        group only: when CPU is accounted in a v2 subtree, memory must use the same one (`cpu`).
        `limit_mb`, where given, must be settable on a group."""
        candidates = []
        own_v1 = _own_v1_path(self_cgroup, "memory")
        if own_v1 is not None and (root / "memory" / "memory.max_usage_in_bytes").exists():
            candidates.append((root / "memory" / own_v1 / "bgraph", 1))
        own = _own_v2_path(self_cgroup)
        if own is not None and (root / "cgroup.controllers").exists():
            candidates.append((root / own / "bgraph-actions", 2))
        for base, version in candidates:
            if version == 2 and not _enable_v2_memory(root / own, base):
                if limit_mb and "memory" in _controllers(root / own):
                    warn_once(f"actions run without a memory limit: the memory controller cannot be enabled in {base}")
                continue
            if version == 2 and cpu is not None and cpu.version == 2 and cpu.base != base:
                continue
            accounting = cls(base, version, own=True)
            limit = (lambda group: accounting.limit(group, limit_mb)) if limit_mb else None
            if accounting._works(accounting.peak_mb, limit):
                return accounting
            if limit_mb:
                warn_once(f"actions run without a memory limit: the memory cgroup cannot be used ({accounting.why})")
        return None

    def limit(self, group: Path, mb: int) -> None:
        """At most `mb` MiB charged to `group` (the kernel reclaims page cache first, then kills
        one of the group's processes)."""
        (group / ("memory.limit_in_bytes" if self.version == 1 else "memory.max")).write_text(str(mb << 20))

    def oom_killed(self, group: Path) -> bool:
        """Whether the kernel killed a process of `group` for memory (its limit or its parent's)."""
        name = "memory.oom_control" if self.version == 1 else "memory.events"
        try:
            return _stat(group / name).get("oom_kill", 0) > 0
        except OSError:
            return False

    def own_limit_reached(self, group: Path) -> bool | None:
        """Whether `group`'s own limit was reached (v1 memory.failcnt, v2 memory.events' max: each
        counts in the group whose limit it was), else an OOM kill there came from an ancestor's
        (its build's cap, or all builds' together); None where the kernel does not say."""
        try:
            if self.version == 1:
                return int((group / "memory.failcnt").read_text()) > 0
            return _stat(group / "memory.events").get("max", 0) > 0
        except (OSError, ValueError):
            return None

    def peak_mb(self, group: Path) -> int | None:
        """The group's peak, less the page cache it holds now (read after its processes ended)."""
        try:
            if self.version == 1:
                peak = int((group / "memory.max_usage_in_bytes").read_text())
                stat = _stat(group / "memory.stat")
                cached = stat.get("total_cache", stat.get("cache", 0)) - stat.get("total_shmem", stat.get("shmem", 0))
            else:
                peak = int((group / "memory.peak").read_text())
                stat = _stat(group / "memory.stat")
                cached = stat.get("file", 0) - stat.get("shmem", 0)
        except (OSError, ValueError):
            return None
        return -(-max(0, peak - max(0, cached)) >> 20)  # rounded up: 0 means not measured


class PidsLimit(_Groups):
    """One pids group per action under `base`: how many processes and threads it may have."""

    @classmethod
    def probe(cls, root: Path = Path("/sys/fs/cgroup"), self_cgroup: Path = Path("/proc/self/cgroup"),
              cpu: CpuAccounting | None = None, tasks: int = ACTION_TASKS) -> "PidsLimit | None":
        """The pids groups this host allows (a limit of `tasks` set on one, a short-lived process
        started in it), or None: cgroup v1's pids hierarchy, or the pids controller in the v2
        subtree CPU is accounted in (`cpu`: a process is in one v2 group only)."""
        candidates = []
        own_v1 = _own_v1_path(self_cgroup, "pids")
        if own_v1 is not None and (root / "pids" / "cgroup.procs").exists():
            candidates.append((root / "pids" / own_v1 / "bgraph", 1))
        own = _own_v2_path(self_cgroup)
        if own is not None and (root / "cgroup.controllers").exists():
            candidates.append((root / own / "bgraph-actions", 2))
        for base, version in candidates:
            if version == 2 and (cpu is None or cpu.version != 2 or cpu.base != base
                                 or not _enable_v2(root / own, base, "pids")):
                if cpu is not None and cpu.base == base and "pids" in _controllers(root / own):
                    warn_once(f"actions run without a task limit: the pids controller cannot be enabled in {base}")
                continue
            pids = cls(base, version, own=True)
            if pids._works(pids.refused, lambda group: pids.limit(group, tasks)):
                return pids
            warn_once(f"actions run without a task limit: the pids cgroup cannot be used ({pids.why})")
        return None

    def limit(self, group: Path, tasks: int) -> None:
        """At most `tasks` processes and threads in `group` at once: a fork beyond fails (EAGAIN)."""
        (group / "pids.max").write_text(str(tasks))

    def refused(self, group: Path) -> bool | None:
        """Whether a fork in `group` failed at its limit or an ancestor's (None: not readable).
        v1 counts a refused fork in the group that forked; v2 in the group whose limit was hit
        (pids.events) and, on kernels that have it, in the one that forked (pids.events.local)."""
        try:
            refused = _stat(group / "pids.events").get("max", 0) > 0
        except OSError:
            return None
        try:
            return refused or _stat(group / "pids.events.local").get("max", 0) > 0
        except OSError:
            return refused

    def own_limit_reached(self, group: Path) -> bool | None:
        """Whether `group`'s own limit is what refused a fork (else an ancestor's: its build's
        cap, or all builds' together), None where this kernel does not tell. A refusal is
        counted in the group that forked whichever limit refused it (v1), so the group's peak
        (pids.peak, Linux 6.1+) is compared with its own pids.max: a fork is refused by the
        group's own limit only when it holds that many. Without pids.peak, v2's pids.events
        counts in the group whose limit was reached; v1 then cannot tell."""
        try:
            peak, most = (group / "pids.peak").read_text().strip(), (group / "pids.max").read_text().strip()
            return most != "max" and int(peak) >= int(most)
        except (OSError, ValueError):
            pass
        if self.version == 2:
            try:
                return _stat(group / "pids.events").get("max", 0) > 0
            except OSError:
                pass
        return None


@dataclass(frozen=True)
class Limits:
    """What one action may take of the host, all actions of this bgraph process together, and all
    bgraph processes' actions on the host together (`host_*`: the shared group's cap); 0: no limit."""

    tasks: int
    all_tasks: int
    memory_mb: int
    all_memory_mb: int
    host_tasks: int = 0
    host_memory_mb: int = 0

    @property
    def action_tasks(self) -> int:
        """An action's task limit: `tasks`, at most ACTION_SHARE of its build's cap."""
        if not self.all_tasks:
            return self.tasks
        return max(1, min(self.tasks, int(self.all_tasks * ACTION_SHARE)))

    @classmethod
    def of_host(cls, environ=os.environ, memory_mb: int | None = None) -> "Limits":
        """This host's limits (`memory_mb`: the memory bgraph may use, its RAM where not given),
        an action's own lowered or raised by TASKS_VARIABLE / MEMORY_VARIABLE; a bad value is
        one line with a hint. Memory is not split between builds (that would halve what one
        build may use on a host that runs one): each build's cap is the host-wide one."""
        host_tasks = max(1, int(_host_tasks() * ALL_ACTIONS_TASKS_SHARE))
        all_tasks = max(1, int(host_tasks * BUILD_TASKS_SHARE))
        ram = memory_mb if memory_mb is not None else _host_memory_mb()
        all_memory = max(64, ram - max(MEMORY_RESERVE_MB, int(ram * MEMORY_RESERVE_SHARE))) if ram else 0
        tasks = _whole(environ, TASKS_VARIABLE) or ACTION_TASKS
        memory = _whole(environ, MEMORY_VARIABLE) or all_memory
        return cls(max(1, min(tasks, int(all_tasks * ACTION_SHARE))), all_tasks,
                   min(memory, all_memory) if all_memory else memory, all_memory, host_tasks, all_memory)


def _whole(environ, name: str) -> int | None:
    value = environ.get(name)
    if value is None or value == "":
        return None
    # isdecimal, not isdigit: '²' is a digit that int() refuses (red-team K16 hole 7).
    if not value.strip().isdecimal() or int(value) < 1:
        raise UsageError(f"{name}={value!r} is not a whole number of at least 1",
                         hint=f"unset {name} for the default, or give a number such as 4096")
    return int(value)


def _host_tasks() -> int:
    """How many tasks the host can have at once: the lower of kernel.pid_max and threads-max."""
    found = []
    for name in ("pid_max", "threads-max"):
        try:
            found.append(int(Path(f"/proc/sys/kernel/{name}").read_text()))
        except (OSError, ValueError):
            pass
    return min(found) if found else 32768  # the kernel's default pid_max


def _host_memory_mb() -> int:
    """The host's RAM in MiB (0 where /proc/meminfo cannot be read)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) >> 10
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _group_limit_mb(group: Path, version: int) -> int | None:
    """The memory limit of `group` in MiB, or None where it has none (or cannot be read)."""
    try:
        text = (group / ("memory.limit_in_bytes" if version == 1 else "memory.max")).read_text().strip()
        return None if text == "max" or int(text) >= 1 << 60 else int(text) >> 20
    except (OSError, ValueError):
        return None


def _stat(path: Path) -> dict[str, int]:
    out = {}
    for line in path.read_text().splitlines():
        name, _, value = line.partition(" ")
        if value.strip().isdigit():
            out[name] = int(value)
    return out


def _controllers(group: Path) -> list[str]:
    """The v2 controllers `group` may use (cgroup.controllers); none where unreadable."""
    try:
        return (group / "cgroup.controllers").read_text().split()
    except OSError:
        return []


def _enable_v2_memory(own: Path, base: Path) -> bool:
    """Turn the memory controller on for `base`'s children."""
    return _enable_v2(own, base, "memory")


def _enable_v2(own: Path, base: Path, controller: str) -> bool:
    """Turn `controller` on for `base`'s children (it must be on in `own`'s subtree first, which
    the kernel refuses where `own` holds processes and is not the root)."""
    try:
        for parent in (own, base):
            if parent == base:
                base.mkdir(exist_ok=True)
            control = parent / "cgroup.subtree_control"
            if controller not in control.read_text().split():
                control.write_text(f"+{controller}")
        return True
    except OSError:
        return False


class Accounting:
    """What the sandbox uses: the groups one action starts in, what they measured, and the
    limits they hold it to (`limits`; the groups made by `pids` and `memory` get them)."""

    def __init__(self, cpu: CpuAccounting | None, memory: MemoryAccounting | None,
                 pids: PidsLimit | None = None, limits: Limits | None = None):
        self.cpu, self.memory, self.pids, self.limits = cpu, memory, pids, limits
        self._live: list[dict[str, Path]] = []  # groups made and not yet removed, watched
        self._all: list[dict[str, Path]] = []  # every group made and not yet removed (kill_all)
        # Groups (their id) kill_left left processes in, for wait_left (which may come after the
        # groups' removal has begun: kept until then).
        self._pending: set[int] = set()
        self._space: dict[str, SpaceWatch] = {}  # space_watch's, by path
        self._lock = threading.Lock()
        self._watcher: threading.Thread | None = None
        self._capped = False  # this process's own caps set (_set_own_caps)

    @classmethod
    def probe(cls, root: Path = Path("/sys/fs/cgroup"), self_cgroup: Path = Path("/proc/self/cgroup"),
              environ=os.environ) -> "Accounting":
        """The groups this host allows, with the limits of Limits.of_host set on the parent of
        all actions' groups (where the kernel takes them: a controller absent is skipped)."""
        cpu = CpuAccounting.probe(root, self_cgroup)
        # The memory bgraph may use: the host's RAM, or less where its own group has a limit (a
        # container's): an OOM kill there may pick bgraph too.
        ram, own_limit = _host_memory_mb(), None
        own_v1, own_v2 = _own_v1_path(self_cgroup, "memory"), _own_v2_path(self_cgroup)
        if own_v1 is not None and (root / "memory" / own_v1).is_dir():
            own_limit = _group_limit_mb(root / "memory" / own_v1, 1)
        elif own_v2 is not None and (root / "cgroup.controllers").exists():
            own_limit = _group_limit_mb(root / own_v2, 2)
        if own_limit is not None:
            ram = min(ram, own_limit) if ram else own_limit
        limits = Limits.of_host(environ, ram)
        memory = MemoryAccounting.probe(root, self_cgroup, cpu, limits.memory_mb)
        pids = PidsLimit.probe(root, self_cgroup, cpu, limits.tasks)
        # All bgraphs' actions together: set on `base`, which every bgraph of this cgroup shares
        # (each sets the same figure). Where the kernel refuses (what is charged there is above
        # it already), this process's own cap (new_groups) and each action's limit still hold.
        for base_limit in ((lambda: pids.limit(pids.base, limits.host_tasks)) if pids else None,
                           (lambda: memory.limit(memory.base, limits.host_memory_mb))
                           if memory and limits.host_memory_mb else None):
            try:
                if base_limit is not None:
                    base_limit()
            except OSError:
                pass
        return cls(cpu, memory, pids, limits)

    def _set_own_caps(self) -> None:
        """This process's all-actions caps, on its own groups (once): said once where refused."""
        with self._lock:
            if self._capped or self.limits is None:
                return
            self._capped = True
        for what, controller, cap in (("task", self.pids, self.limits.all_tasks),
                                      ("memory", self.memory, self.limits.all_memory_mb)):
            if controller is None or not controller.own or not cap:
                continue
            try:
                controller.limit(controller.own_group(), cap)
            except OSError as e:
                warn_once(f"this build's all-actions {what} cap ({cap}) cannot be set in "
                          f"{controller.base} ({e.strerror or e}): each action keeps its own limit")

    def new_groups(self) -> dict[str, Path]:
        """{"cpu": group, "memory": group, "pids": group} for what is measured or limited (one
        group for all under v2), each limited as `limits` says."""
        groups: dict[str, Path] = {}
        if not self._capped:
            self._set_own_caps()
        try:
            if self.cpu is not None:
                groups["cpu"] = self.cpu.new_group()
            if self.memory is not None:
                shared = self.cpu is not None and self.memory.base == self.cpu.base
                groups["memory"] = groups["cpu"] if shared else self.memory.new_group()
                if self.limits is not None and self.limits.memory_mb:
                    self.memory.limit(groups["memory"], self.limits.memory_mb)
            if self.pids is not None:
                shared = self.cpu is not None and self.pids.base == self.cpu.base
                groups["pids"] = groups["cpu"] if shared else self.pids.new_group()
                if self.limits is not None:
                    self.pids.limit(groups["pids"], self.limits.action_tasks)
            if any(c is not None and c.recreated for c in (self.cpu, self.memory, self.pids)):
                for c in (self.cpu, self.memory, self.pids):
                    if c is not None:
                        c.recreated = False
                self._capped = False
                self._set_own_caps()
        except OSError:
            self.remove(groups)
            raise
        with self._lock:
            self._all.append(groups)
        if self.limits is not None and ("pids" in groups or "memory" in groups):
            with self._lock:
                self._live.append(groups)
                if self._watcher is None:
                    self._watcher = threading.Thread(target=self._watch, name="bgraph-limits", daemon=True)
                    self._watcher.start()
        return groups

    def _watch(self) -> None:
        """Kill the processes of every action that reached a limit (see WATCH_S); never ends."""
        while True:
            time.sleep(WATCH_S)
            with self._lock:
                live = list(self._live)
            for groups in live:
                try:
                    if self.limit_hit(groups) is not None:
                        _kill(groups.get("pids") or groups["memory"])
                except (OSError, ValueError):
                    pass  # removed meanwhile

    def wrap(self, groups: dict[str, Path], argv: list[str]) -> list[str]:
        if not groups:
            return argv
        return _wrap(sorted({g / "cgroup.procs" for g in groups.values()}), argv)

    def limit_hit(self, groups: dict[str, Path]) -> ActionFailed | None:
        """The failure of an action (its processes ended) that reached one of its limits: a
        fork refused, or a process killed for memory. Its result is not kept even where it
        exited 0: what it made may depend on a process it could not start or that was killed.
        Its own limit is named only where its own group reached it; else the all-actions cap."""
        limits = self.limits or Limits(0, 0, 0, 0)
        if "pids" in groups and self.pids is not None and self.pids.refused(groups["pids"]):
            own = self.pids.own_limit_reached(groups["pids"])
            if own is False:
                return ActionFailed(
                    f"stopped at the all-actions task cap: a new process or thread was refused, the action "
                    f"itself under its limit of {limits.action_tasks}: this build's actions together reached "
                    f"{limits.all_tasks}, or all bgraph builds' on this host {limits.host_tasks or 'their cap'}",
                    hint="run fewer actions at once (-j), or build again once other builds on this host are done")
            which = "its" if own else "a"
            return ActionFailed(
                f"stopped at {which} task limit: a new process or thread was refused ({limits.action_tasks} at once "
                f"for one action, {limits.all_tasks} for this build's actions together"
                + (")" if own else "; this kernel does not say which)"),
                hint=f"an action that needs more: set {TASKS_VARIABLE} (at most "
                     f"{int(limits.all_tasks * ACTION_SHARE) if limits.all_tasks else limits.tasks} here)")
        if "memory" in groups and self.memory is not None and self.memory.oom_killed(groups["memory"]):
            if self.memory.own_limit_reached(groups["memory"]) is False:
                return ActionFailed(
                    f"killed for memory at the all-actions cap: the action itself stayed under its limit of "
                    f"{limits.memory_mb} MiB, all running actions together reached {limits.all_memory_mb} MiB "
                    "(the host's memory less what is kept for bgraph; other builds on this host count too)",
                    hint="run fewer actions (or builds) at once (-j)")
            return ActionFailed(
                f"killed for memory: a process went over its memory limit ({limits.memory_mb} MiB for one "
                f"action, {limits.all_memory_mb} MiB for all running actions together: the host's memory "
                "less what is kept for bgraph)",
                hint=f"run fewer actions at once (-j), or set {MEMORY_VARIABLE} (at most {limits.all_memory_mb} here)")
        return None

    def cpu_s(self, groups: dict[str, Path]) -> float | None:
        """The action's CPU seconds."""
        return self.cpu.cpu_s(groups["cpu"]) if "cpu" in groups else None

    def peak_mb(self, groups: dict[str, Path]) -> int | None:
        return self.memory.peak_mb(groups["memory"]) if "memory" in groups else None

    def remove(self, groups: dict[str, Path]) -> None:
        """Remove an ended action's groups (a process still in one is killed first: _remove)."""
        with self._lock:
            self._live = [g for g in self._live if g is not groups]
            self._all = [g for g in self._all if g is not groups]
        for group in set(groups.values()):
            _remove(group)

    def kill_left(self, groups: dict[str, Path], wait: bool = True) -> int:
        """Kill whatever is still in an action's groups once its bwrap has ended, and (`wait`)
        wait until each is out: nothing of the action runs while its outputs are read. Returns
        how many of those were alive: a process that outlived the sandbox (bwrap's PID
        namespace kills every other one; its init may still be listed, on its way out, and is
        not counted). One group is enough: every process of the action is in each of its groups
        and cannot leave them (no cgroup file is writable inside); the others' processes are
        killed where they will not go (_remove). An ordinary action costs one read of that
        group's process list, and where bwrap's init is still listed (about half of small
        actions here, ~1 ms before the kernel schedules it into its exit on a busy host) a look
        at each listed process: without `wait` nothing more where none is alive, the rest left
        to wait_left, which the sandbox calls off the action's slot."""
        group = next((groups[n] for n in ("pids", "memory", "cpu") if n in groups), None)
        if group is None:
            return 0
        if wait:
            with self._lock:
                self._pending.discard(id(groups))
            return _kill_until_empty(group)
        listed = _left(group)
        if not listed:
            return 0
        alive = _alive(listed)
        # A snapshot is not enough: bwrap's init may have taken its SIGKILL off the pending set
        # and not yet entered its exit (no sign of either in /proc) while a busy host runs
        # something else; a build failed so, as "outlived its sandbox" (2026-11-28). A process
        # is counted only while it still looks alive after SETTLE_S; one that got out of the
        # teardown stays alive, and is killed.
        settle = time.monotonic() + SETTLE_S
        while alive and time.monotonic() < settle:
            time.sleep(0.002)
            listed = _left(group)
            alive = _alive(listed) if listed else []
        if alive:
            _kill_until_empty(group)  # a process that got out: killed, and waited for, at once
        elif listed:
            with self._lock:
                self._pending.add(id(groups))
        return len(alive)

    def wait_left(self, groups: dict[str, Path]) -> None:
        """Where kill_left without `wait` left processes on their way out: kill again and wait (at
        most KILL_WAIT_S) until each is in its exit or gone; else nothing to do."""
        with self._lock:
            if id(groups) not in self._pending:
                return
        self.kill_left(groups, wait=True)

    def kill_all(self) -> None:
        """Kill every process in every group this object made and has not removed: bgraph stops
        (Ctrl-C, SIGTERM). Idle spares' shells go too; nothing of an action is left on the host."""
        with self._lock:
            made = list(self._all)
        for groups in made:
            try:
                self.kill_left(groups)
            except OSError:
                pass

    def space_watch(self, path: Path, low_bytes: int) -> "SpaceWatch":
        """The one SpaceWatch of `path`'s file system for this object's actions."""
        key = str(path)
        with self._lock:
            watch = self._space.get(key)
            if watch is None:
                watch = self._space[key] = SpaceWatch(path, low_bytes)
        return watch


# How often the cache's file system is sampled while actions run (SpaceWatch), and the free inodes
# below which it counts as full (free bytes: the caller's floor, sandbox.LOW_SPACE).
SPACE_WATCH_S = 0.05
LOW_INODES = 256


class SpaceWatch:
    """Whether the cache's file system was full while an action ran (red-team R2 diskfull).

    One action can fill the disk (an undeclared file in its output directory) and free it again
    before it ends; a concurrent action's writes fail with ENOSPC meanwhile, and a command that
    goes on after a failed write (a shell without `set -e`) exits 0 with truncated outputs, which
    would be stored as good and served as hits. So while any action runs, one thread samples the
    file system (statvfs: free bytes, and free inodes where it counts them) every SPACE_WATCH_S,
    and each action samples it once more at its end: an action that was running at a sample
    below the floor is failed (`end`), never recorded, and the largest writer among the actions
    running then (the biggest output directory) is named. The thread waits on a condition while
    no action runs; an action costs a lock, a notify and one statvfs.

    What sampling cannot see: a fill and free shorter than SPACE_WATCH_S that falls between two
    samples (an action writing at that moment may still lose a write unseen); a full disk other
    than the cache's (the sandbox's /tmp is memory: a write past its size fails there, as on
    any machine, and is the action's own); space freed by someone else before the first sample."""

    def __init__(self, path: Path, low_bytes: int, low_inodes: int = LOW_INODES,
                 interval_s: float = SPACE_WATCH_S):
        self.path, self.low_bytes, self.low_inodes, self.interval_s = path, low_bytes, low_inodes, interval_s
        self._cond = threading.Condition()
        self._running: dict[int, tuple[str, Path]] = {}  # token -> (action name, output directory)
        self._full: dict[int, str] = {}  # token -> why its action fails
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None

    def begin(self, name: str, out_dir: Path, outputs: tuple[str, ...] = ()) -> int:
        """An action starts writing into `out_dir`: watched until `end`. Its name and declared
        `outputs` name it where it is the largest writer (an action knows no target label)."""
        if outputs and outputs != (".",):
            name = f"{name} with outputs {', '.join(outputs[:3])}{', ...' if len(outputs) > 3 else ''}"
        with self._cond:
            token = next(self._ids)
            self._running[token] = (name, out_dir)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="bgraph-space", daemon=True)
                self._thread.start()
            self._cond.notify()
        return token

    def end(self, token: int) -> str | None:
        """The action has ended: None where the disk stayed above the floor at every sample while
        it ran (and now), else the one line its failure says."""
        low = self.low()
        if low is not None:
            self._mark(low)
        with self._cond:
            self._running.pop(token, None)
            return self._full.pop(token, None)

    def low(self) -> str | None:
        """What is free, where the file system is below the floor now; else None."""
        try:
            st = os.statvfs(self.path)
        except OSError:
            return None
        free = st.f_bavail * st.f_frsize  # an action has no capability: root's reserve is not its
        inodes = st.f_favail if st.f_files else None  # some file systems count no inodes (0)
        if free >= self.low_bytes and (inodes is None or inodes >= self.low_inodes):
            return None
        return f"{free / (1 << 20):.1f} MiB" + (f" and {inodes} inodes" if inodes is not None else "") + " free"

    def _mark(self, low: str) -> None:
        """Every running action fails: the disk was full while it ran."""
        line = f"ran while the cache disk was full ({low} on {_mount_of(self.path)}); its outputs may be truncated"
        with self._cond:  # marked at once: one that ends while the writer is looked for fails all the same
            new = [t for t in self._running if t not in self._full]
            for t in new:
                self._full[t] = line
            running = list(self._running.values())
        if not new:
            return
        writer = _largest_writer(running)
        if writer is not None:
            named = (f"{line}; the largest writer of the actions running then: the {writer[0]} "
                     f"({writer[1] / (1 << 20):.0f} MiB in its output directory)")
            with self._cond:
                for t in new:
                    if t in self._full and t in self._running:
                        self._full[t] = named

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._running:
                    self._cond.wait()
            low = self.low()
            if low is not None:
                self._mark(low)
            time.sleep(self.interval_s)


def _mount_of(path: Path) -> str:
    """The mount point `path` lies on (said where the disk is full)."""
    here = os.path.abspath(path)
    while not os.path.ismount(here) and os.path.dirname(here) != here:
        here = os.path.dirname(here)
    return here


def _largest_writer(running: list[tuple[str, Path]], most: int = 100_000) -> tuple[str, int] | None:
    """The action whose output directory takes the most of the disk (blocks, at most `most`
    entries walked per directory), with its size; only when the disk is full."""
    best = None
    for name, out_dir in running:
        size, todo, seen = 0, [str(out_dir)], 0
        while todo and seen < most:
            try:
                with os.scandir(todo.pop()) as entries:
                    for e in entries:
                        seen += 1
                        try:
                            st = e.stat(follow_symlinks=False)
                        except OSError:
                            continue
                        size += st.st_blocks * 512
                        if e.is_dir(follow_symlinks=False):
                            todo.append(e.path)
            except OSError:
                continue
        if best is None or size > best[1]:
            best = (name, size)
    return best


def _kill(group: Path, rounds: int = 100) -> None:
    """SIGKILL every process in `group` (cgroup v2's cgroup.kill where there is one; else each
    listed process, again until none is left: one may have forked meanwhile). Never a process
    outside it: a listed pid may end and be reused by another process before the kill, so each
    is pinned first (a pidfd, which names that process and no later one), the group is listed
    again, and only a pinned process still listed is killed, through its pidfd. Where the kernel
    has no pidfd (before 5.3), a pid is killed only if the second listing still holds it: that
    narrows the window to the two system calls between, it cannot close it."""
    if (group / "cgroup.kill").exists():
        (group / "cgroup.kill").write_text("1")
        return
    for _ in range(rounds):
        pids = _procs(group)
        if not pids:
            return
        for start in range(0, len(pids), 256):  # a bounded number of descriptors at once
            pinned: dict[int, int | None] = {}
            try:
                for pid in pids[start:start + 256]:
                    try:
                        pinned[pid] = os.pidfd_open(pid)
                    except ProcessLookupError:
                        pass  # gone already
                    except (OSError, AttributeError):
                        pinned[pid] = None  # no pidfd on this kernel
                still = set(_procs(group))
                for pid, fd in pinned.items():
                    if pid not in still:
                        continue
                    try:
                        if fd is None:
                            os.kill(pid, signal.SIGKILL)
                        else:
                            signal.pidfd_send_signal(fd, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            finally:
                for fd in pinned.values():
                    if fd is not None:
                        os.close(fd)


def _procs(group: Path) -> list[int]:
    return [int(p) for p in (group / "cgroup.procs").read_text().split()]


def _remove_tree(group: Path) -> None:
    """Remove a process's own group: the action groups left in it, then itself (where empty).
    A process still in one (an action's that outlived its sandbox and its bgraph) is killed."""
    try:
        for child in group.iterdir():
            if child.is_dir():
                try:
                    child.rmdir()
                except OSError as e:
                    if e.errno == errno.EBUSY and _kill_until_empty(child):
                        _remove(child)
        group.rmdir()
    except OSError:
        pass


def _remove(group: Path) -> None:
    """Remove the group once its last process is gone (the kernel may take a moment). Its action
    has ended: a process still in it outlived the sandbox and is killed. A group that will not
    go is left to remove_stale: its action has finished either way."""
    killed = False
    for _ in range(50):
        try:
            group.rmdir()
            return
        except OSError as e:
            if e.errno != errno.EBUSY:
                return
            if not killed:
                killed = True
                try:
                    _kill_until_empty(group)
                except OSError:
                    pass
                continue
            time.sleep(0.01)


def _left(group: Path) -> list[int]:
    """The processes in `group` (none where it is gone)."""
    try:
        return _procs(group)
    except (OSError, ValueError):
        return []


def _kill_until_empty(group: Path, wait_s: float = KILL_WAIT_S) -> int:
    """Kill every process in `group` until none is left or each is in its exit (at most `wait_s`;
    0: one round, no wait): first no new process (pids.max 0, where the group has a pids limit:
    a fork fails), then SIGKILL, again while any is listed. Returns how many of those listed at first were alive (_alive: not one already
    on its way out, such as bwrap's init tearing its PID namespace down, which may still be
    listed when the outer bwrap has ended); 0 where none was listed, and nothing is written."""
    first = _left(group)
    if not first:
        return 0
    alive = len(_alive(first))
    try:
        (group / "pids.max").write_text("0")
    except OSError:
        pass  # no pids limit here (v1 cpuacct or memory): the kill loop catches forks
    deadline = time.monotonic() + wait_s
    pause = 0.0005
    while True:
        try:
            _kill(group, rounds=1)
        except (OSError, ValueError):
            pass
        left = _left(group)
        # Done once each one listed is in its exit (PF_EXITING: it runs none of its own code
        # again, nor is it inside a system call such as a write): bwrap's init tearing down its
        # mount namespace takes ~1 ms more before it leaves the group, not waited for here.
        if not left or time.monotonic() >= deadline or all(_exiting(pid) for pid in left):
            return alive
        # SIGKILLed processes: waited for on their pidfds (readable at the exit), at most 50 ms
        # a round (one may have forked meanwhile); polled where there is no pidfd.
        if not _exited(left, min(deadline, time.monotonic() + 0.05)):
            time.sleep(pause)
            pause = min(pause * 2, 0.05)


def _exiting(pid: int) -> bool:
    """Whether process `pid` is gone, a zombie, or in its exit (the kernel's PF_EXITING)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        fields = stat[stat.rfind(")") + 2:].split()
        return fields[0] in ("Z", "X", "x") or bool(int(fields[6]) & _PF_EXITING)
    except (OSError, ValueError, IndexError):
        return True


def _exited(pids: list[int], until: float) -> bool:
    """Wait until each of `pids` has exited, or the clock reaches `until`; False where this
    kernel has no pidfd (the caller polls)."""
    fds = []
    try:
        for pid in pids:
            try:
                fds.append(os.pidfd_open(pid))
            except ProcessLookupError:
                pass
        while fds and (wait := until - time.monotonic()) > 0:
            for fd in select.select(fds, [], [], wait)[0]:
                fds.remove(fd)
                os.close(fd)
        return True
    except (OSError, AttributeError):
        return False
    finally:
        for fd in fds:
            os.close(fd)


_PF_EXITING = 0x4  # /proc/<pid>/stat's flags: the process is in exit
_SIGKILL_BIT = 1 << (signal.SIGKILL - 1)


def _alive(pids: list[int]) -> list[int]:
    """Those of `pids` (one group's) that are not on their way out: gone, exiting, a SIGKILL
    pending (the parent-death signal bwrap's init gets when the outer bwrap ends), or below one
    of them in `pids` (the processes of a PID namespace whose init is dying: it kills them next)."""
    parent, dying = {}, set()
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            fields = stat[stat.rfind(")") + 2:].split()
            parent[pid] = int(fields[1])
            if fields[0] in ("Z", "X", "x") or int(fields[6]) & _PF_EXITING:
                dying.add(pid)
                continue
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith(("SigPnd:", "ShdPnd:")) and int(line.split()[1], 16) & _SIGKILL_BIT:
                    dying.add(pid)
                    break
        except (OSError, ValueError, IndexError):
            dying.add(pid)  # gone
    alive = []
    for pid in pids:
        here, seen = pid, set()
        while here in parent and here not in dying and here not in seen:
            seen.add(here)
            here = parent[here]
        if here not in dying:
            alive.append(pid)
    return alive


def _own_v1_path(self_cgroup: Path, controller: str) -> str | None:
    """This process's path in the cgroup v1 hierarchy of `controller`, relative to its root."""
    try:
        for line in self_cgroup.read_text().splitlines():
            _n, _, rest = line.partition(":")
            controllers, _, path = rest.partition(":")
            if controller in controllers.split(","):
                return path.strip().strip("/")
    except OSError:
        pass
    return None


def _own_v2_path(self_cgroup: Path) -> str | None:
    """This process's cgroup v2 path (the "0::" line), relative to the hierarchy's root."""
    try:
        for line in self_cgroup.read_text().splitlines():
            if line.startswith("0::"):
                return line[3:].strip("/")
    except OSError:
        pass
    return None
