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
not measured (0) and memory is sampled from the process tree (sandbox.PeakSampler). Part of the
sandbox layer: only it calls this."""

from __future__ import annotations

import errno
import itertools
import os
import subprocess
import time
from pathlib import Path

# The action's first process joins its cgroups (the files named before "--"), then becomes bwrap:
# nothing of the action runs outside them, and nothing of bgraph's memory is charged to them
# (a process's pages stay charged where they were when it moves; sh has exec'd by then).
JOIN_AND_EXEC = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"'


# Group names are "<pid>-<n>": n from one counter per process, so two accounting objects (two
# runners made at once by two action threads) never pick the same name.
_IDS = itertools.count()


def _wrap(procs_files: list[Path], argv: list[str]) -> list[str]:
    return ["/bin/sh", "-c", JOIN_AND_EXEC, "bgraph-join", *map(str, procs_files), "--", *argv]


class _Groups:
    """One group per action under `base`: made, joined, removed (stale ones too)."""

    def __init__(self, base: Path, version: int):
        self.base, self.version = base, version

    def new_group(self) -> Path:
        group = self.base / f"{os.getpid()}-{next(_IDS)}"
        group.mkdir()
        return group

    def wrap(self, group: Path, argv: list[str]) -> list[str]:
        """`argv`, started inside `group`."""
        return _wrap([group / "cgroup.procs"], argv)

    def remove_stale(self) -> None:
        """Remove the groups that bgraph processes no longer running left (killed, say)."""
        for group in self.base.iterdir():
            pid = group.name.partition("-")[0]
            if group.is_dir() and pid.isdigit() and not Path(f"/proc/{pid}").exists():
                try:
                    group.rmdir()
                except OSError:
                    pass

    def remove(self, group: Path) -> None:
        _remove(group)

    def _works(self, read) -> bool:
        """Whether a short-lived process can be started in a new group here and `read` gives
        a figure for it afterwards."""
        try:
            self.base.mkdir(exist_ok=True)
            self.remove_stale()
            group = self.new_group()
            try:
                ok = subprocess.run(self.wrap(group, ["/bin/true"]), capture_output=True).returncode == 0
                return ok and read(group) is not None
            finally:
                self.remove(group)
        except OSError:
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
            accounting = cls(base, version)
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
              cpu: CpuAccounting | None = None) -> "MemoryAccounting | None":
        """The memory accounting this host allows, or None. Under cgroup v2 a process is in one
        group only: when CPU is accounted in a v2 subtree, memory must use the same one (`cpu`)."""
        candidates = []
        own_v1 = _own_v1_path(self_cgroup, "memory")
        if own_v1 is not None and (root / "memory" / "memory.max_usage_in_bytes").exists():
            candidates.append((root / "memory" / own_v1 / "bgraph", 1))
        own = _own_v2_path(self_cgroup)
        if own is not None and (root / "cgroup.controllers").exists():
            candidates.append((root / own / "bgraph-actions", 2))
        for base, version in candidates:
            if version == 2 and not _enable_v2_memory(root / own, base):
                continue
            if version == 2 and cpu is not None and cpu.version == 2 and cpu.base != base:
                continue
            accounting = cls(base, version)
            if accounting._works(accounting.peak_mb):
                return accounting
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


def _stat(path: Path) -> dict[str, int]:
    out = {}
    for line in path.read_text().splitlines():
        name, _, value = line.partition(" ")
        if value.strip().isdigit():
            out[name] = int(value)
    return out


def _enable_v2_memory(own: Path, base: Path) -> bool:
    """Turn the memory controller on for `base`'s children (it must be on in `own`'s subtree
    first, which the kernel refuses where `own` holds processes and is not the root)."""
    try:
        for parent in (own, base):
            if parent == base:
                base.mkdir(exist_ok=True)
            control = parent / "cgroup.subtree_control"
            if "memory" not in control.read_text().split():
                control.write_text("+memory")
        return True
    except OSError:
        return False


class Accounting:
    """What the sandbox uses: the groups one action starts in, and what they measured."""

    def __init__(self, cpu: CpuAccounting | None, memory: MemoryAccounting | None):
        self.cpu, self.memory = cpu, memory

    @classmethod
    def probe(cls, root: Path = Path("/sys/fs/cgroup"), self_cgroup: Path = Path("/proc/self/cgroup")
              ) -> "Accounting":
        cpu = CpuAccounting.probe(root, self_cgroup)
        return cls(cpu, MemoryAccounting.probe(root, self_cgroup, cpu))

    def new_groups(self) -> dict[str, Path]:
        """{"cpu": group, "memory": group} for what is measured (one group for both under v2)."""
        groups: dict[str, Path] = {}
        try:
            if self.cpu is not None:
                groups["cpu"] = self.cpu.new_group()
            if self.memory is not None:
                shared = self.cpu is not None and self.memory.base == self.cpu.base
                groups["memory"] = groups["cpu"] if shared else self.memory.new_group()
        except OSError:
            self.remove(groups)
            raise
        return groups

    def wrap(self, groups: dict[str, Path], argv: list[str]) -> list[str]:
        if not groups:
            return argv
        return _wrap(sorted({g / "cgroup.procs" for g in groups.values()}), argv)

    def cpu_s(self, groups: dict[str, Path]) -> float | None:
        return self.cpu.cpu_s(groups["cpu"]) if "cpu" in groups else None

    def peak_mb(self, groups: dict[str, Path]) -> int | None:
        return self.memory.peak_mb(groups["memory"]) if "memory" in groups else None

    def remove(self, groups: dict[str, Path]) -> None:
        for group in set(groups.values()):
            _remove(group)


def _remove(group: Path) -> None:
    """Remove the group once its last process is gone (the kernel may take a moment). A group
    that will not go is left to remove_stale: its action has finished either way."""
    for _ in range(50):
        try:
            group.rmdir()
            return
        except OSError as e:
            if e.errno != errno.EBUSY:
                return
            time.sleep(0.01)


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
