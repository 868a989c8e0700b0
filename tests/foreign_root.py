"""Another distribution, for real, on this machine: a Debian root made by debootstrap from the
mirror apt is configured with, entered through a private mount namespace and pivot_root (a
chroot will not do: the kernel refuses a chrooted process a new user namespace, so bwrap fails
there), with bgraph installed into it for the root's own Python.

Shared by tests/test_cross_distro.py and bench/cross_distro.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from bgraph_testlib import REPO, workspace_copy

# Enter ROOT as / in a private mount namespace: bind it onto itself, give it proc, dev, sys and a
# tmpfs /tmp, pivot_root into it, drop the old root, and run the command with a clean environment.
_ENTER = r'''
set -e
root=$1; shift
mount --bind "$root" "$root"
mount -t proc proc "$root/proc"
mount --rbind /dev "$root/dev"
mount --rbind /sys "$root/sys"
mount -t tmpfs tmpfs "$root/tmp"
mkdir -p "$root/.oldroot"
cd "$root"
pivot_root . .oldroot
umount -l /.oldroot
cd /
exec env -i PATH=/opt/bgraph/bin:/usr/local/bin:/usr/bin:/bin HOME=/root LANG=C.UTF-8 "$@"
'''


def can_make_roots() -> str | None:
    """Why a foreign root cannot be made here (None when it can)."""
    if os.geteuid() != 0:
        return "entering a root with pivot_root needs root"
    for tool in ("debootstrap", "unshare", "bwrap"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install -y debootstrap util-linux bubblewrap)"
    return None


def debian_mirror() -> str:
    """The Debian archive apt on this machine is configured with (never a name written here)."""
    from build_graph.debian.sources import mirrors_for, read_apt_sources, suites_in_order

    sources = read_apt_sources()
    if not sources:
        raise RuntimeError("apt has no configured sources to make a root from")
    return mirrors_for(sources, suites_in_order(sources)[0], "amd64")[0]


def make_root(dest: Path, suite: str = "trixie") -> Path:
    """A minimal Debian `suite` root with python3, venv, bubblewrap and certificates."""
    subprocess.run(["debootstrap", "--variant=minbase", "--include=python3,python3-venv,bubblewrap,ca-certificates",
                    suite, str(dest), debian_mirror()], check=True, capture_output=True)
    return dest


def python_version(root: Path) -> str:
    return run_in(root, ["python3", "-c", "import sys; print('%d.%d' % sys.version_info[:2])"]).stdout.strip()


def install_bgraph(root: Path, workspace: bool = True, source: Path = REPO) -> None:
    """bgraph's source at /src, its dependencies in a venv at /opt/bgraph for the root's Python
    (wheels fetched here through pip's configuration, installed there offline), and a copy of
    the workspace at `source` (this checkout, or a snapshot of it) at /work."""
    version = python_version(root)
    wheels = root / "wheels"
    wheels.mkdir(exist_ok=True)
    import tomllib
    deps = tomllib.loads((source / "pyproject.toml").read_text())["project"]["dependencies"]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--python-version", version, "--only-binary=:all:",
                    *(f"--platform={p}" for p in ("manylinux2014_x86_64", "manylinux_2_17_x86_64",
                                                  "manylinux_2_28_x86_64", "manylinux_2_34_x86_64")),
                    "-d", str(wheels), *deps], check=True, capture_output=True)
    run_in(root, ["python3", "-m", "venv", "/opt/bgraph"])
    run_in(root, ["/opt/bgraph/bin/pip", "install", "-q", "--no-index", "--find-links", "/wheels", *deps])
    shutil.rmtree(root / "src", ignore_errors=True)
    shutil.copytree(source / "build_graph", root / "src" / "build_graph",
                    ignore=shutil.ignore_patterns("__pycache__"))
    if workspace:
        shutil.rmtree(root / "work", ignore_errors=True)
        workspace_copy(root / "work", source)


def run_in(root: Path, argv: list[str], check: bool = True, timeout: float | None = None,
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run `argv` inside `root` as its /; `env` is added to its clean environment."""
    extra = [f"{k}={v}" for k, v in (env or {}).items()]
    cmd = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", _ENTER, "enter", str(root),
           *(["env", *extra] if extra else []), *argv]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} in {root} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                           f"{proc.stderr[-3000:]}")
    return proc


def bgraph_in(root: Path, *args: str, timeout: float | None = None) -> subprocess.CompletedProcess:
    """`bgraph ARGS` inside the root, with its own Python, on /work, cache /cache."""
    return run_in(root, ["/opt/bgraph/bin/python", "-m", "build_graph", "-C", "/work", "--cache-dir", "/cache",
                         *args], check=False, timeout=timeout, env={"PYTHONPATH": "/src"})
