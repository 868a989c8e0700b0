"""A build's exact CPU time, whatever else the machine runs: a cgroup for one build.

A build started in its own group is charged for every process it starts and every process those
start, sandboxes included (bubblewrap's PID namespaces reap the compilers, so RUSAGE_CHILDREN never
sees them), and nothing of the other sessions on a shared machine. On cgroup v1 the group is a
cpuacct group (its usage is charged to every ancestor as it runs, so bgraph's own per-action groups
below it count, removed or not); on v2 a group below this process's own, read from cpu.stat.
Where no group can be made here (no permission, no such controller) `CpuGroup.make` gives None and
callers fall back to sampled figures.
"""

from __future__ import annotations

import itertools
import os
import time
from pathlib import Path

JOIN = 'echo $$ > "$1" || exit 125; shift; exec "$@"'  # the first process joins, then becomes the build
_IDS = itertools.count()


def _own(controller: str | None) -> str | None:
    """This process's path in the hierarchy of `controller` (v1), or its v2 path (None)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _n, names, path = line.split(":", 2)
        if (controller is None and names == "") or (controller is not None and controller in names.split(",")):
            return path
    return None


class CpuGroup:
    """One cgroup a build runs in; `cpu_s()` is every CPU second charged to it so far."""

    def __init__(self, path: Path, version: int):
        self.path, self.version = path, version

    @classmethod
    def make(cls, root: Path = Path("/sys/fs/cgroup")) -> CpuGroup | None:
        """A new, empty group, or None where this host gives none."""
        name = f"bench-{os.getpid()}-{next(_IDS)}"
        own1, own2 = _own("cpuacct"), _own(None)
        candidates = []
        if own1 is not None and (root / "cpuacct" / own1.lstrip("/") / "cpuacct.usage").exists():
            candidates.append((root / "cpuacct" / own1.lstrip("/") / name, 1))
        if own2 is not None and (root / "cgroup.controllers").exists():
            candidates.append((root / own2.lstrip("/") / name, 2))
        for path, version in candidates:
            try:
                path.mkdir()
            except OSError:
                continue
            return cls(path, version)
        return None

    def wrap(self, argv: list[str]) -> list[str]:
        """`argv`, started inside the group."""
        return ["/bin/sh", "-c", JOIN, "join", str(self.path / "cgroup.procs"), *argv]

    def cpu_s(self) -> float:
        """CPU seconds charged to the group and every group below it."""
        if self.version == 1:
            return int((self.path / "cpuacct.usage").read_text()) / 1e9
        for line in (self.path / "cpu.stat").read_text().splitlines():
            if line.startswith("usage_usec "):
                return int(line.split()[1]) / 1e6
        return 0.0

    def remove(self) -> None:
        """Remove the group and the empty groups a build left below it (bgraph's own)."""
        for _ in range(50):  # a process that just exited may still be leaving the group
            try:
                for dirpath, dirs, _files in os.walk(self.path, topdown=False):
                    for d in dirs:
                        os.rmdir(os.path.join(dirpath, d))
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)
