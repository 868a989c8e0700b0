"""Per-action CPU time, through a cgroup each sandboxed action is started in.

A parent's child rusage cannot give it: bubblewrap reaps the action's processes inside its PID
namespace, and their CPU never reaches bgraph. A cgroup counts every process started in it,
however it ends. Where this host lets bgraph make cgroups (cgroup v1's cpuacct hierarchy, or a
cgroup v2 subtree of its own), each action gets one; elsewhere CPU time is simply not measured
(0), and nothing else changes. Part of the sandbox layer: only it calls this."""

from __future__ import annotations

import errno
import itertools
import os
import subprocess
import time
from pathlib import Path

# The action's first process joins its cgroup, then becomes bwrap: nothing runs outside it.
JOIN_AND_EXEC = 'echo $$ > "$0" && exec "$@"'


class CpuAccounting:
    """Makes one cgroup per action under `base` and reads its CPU time back."""

    def __init__(self, base: Path, version: int):
        self.base, self.version = base, version
        self._ids = itertools.count()

    @classmethod
    def probe(cls, root: Path = Path("/sys/fs/cgroup"), self_cgroup: Path = Path("/proc/self/cgroup")
              ) -> "CpuAccounting | None":
        """The accounting this host allows (tried by moving a short-lived process), or None."""
        candidates = []
        if (root / "cpuacct" / "cpuacct.usage").exists():
            candidates.append((root / "cpuacct" / "bgraph", 1))
        own = _own_v2_path(self_cgroup)
        if own is not None and (root / "cgroup.controllers").exists():
            candidates.append((root / own / "bgraph-actions", 2))
        for base, version in candidates:
            accounting = cls(base, version)
            try:
                base.mkdir(exist_ok=True)
                accounting.remove_stale()
                group = accounting.new_group()
                ok = subprocess.run(accounting.wrap(group, ["/bin/true"]), capture_output=True).returncode == 0
                used = accounting.cpu_s(group)
                accounting.remove(group)
            except OSError:
                continue
            if ok and used is not None:
                return accounting
        return None

    def new_group(self) -> Path:
        group = self.base / f"{os.getpid()}-{next(self._ids)}"
        group.mkdir()
        return group

    def wrap(self, group: Path, argv: list[str]) -> list[str]:
        """`argv`, started inside `group`."""
        return ["/bin/sh", "-c", JOIN_AND_EXEC, str(group / "cgroup.procs"), *argv]

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

    def remove_stale(self) -> None:
        """Remove the groups that bgraph processes no longer running left (killed, say)."""
        for group in self.base.iterdir():
            pid = group.name.partition("-")[0]
            if pid.isdigit() and not Path(f"/proc/{pid}").exists():
                try:
                    group.rmdir()
                except OSError:
                    pass

    def remove(self, group: Path) -> None:
        """Remove the group once its last process is gone (the kernel may take a moment). A
        group that will not go is left to remove_stale: its action has finished either way."""
        for _ in range(50):
            try:
                group.rmdir()
                return
            except OSError as e:
                if e.errno != errno.EBUSY:
                    return
                time.sleep(0.01)


def _own_v2_path(self_cgroup: Path) -> str | None:
    """This process's cgroup v2 path (the "0::" line), relative to the hierarchy's root."""
    try:
        for line in self_cgroup.read_text().splitlines():
            if line.startswith("0::"):
                return line[3:].strip("/")
    except OSError:
        pass
    return None
