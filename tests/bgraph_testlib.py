"""Helpers for the test suite: small data workspaces written into tmp_path, driven through the
real CLI (`python -m build_graph`) or the Engine API, with the real bubblewrap sandbox.

(A module of its own rather than conftest.py, so tests can import it unambiguously.)"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
USER_HOME: Path | None = None  # the user's real home; conftest gives the session a private one
CHECKOUT_AT_START: dict[str, str] | None = None  # checkout_state() when the session started
# What a test run may leave in the checkout: Python's and pytest's own caches, pip's egg-info.
_SCRATCH = ("__pycache__", ".pytest_cache")

WORKSPACE_TOML = """\
[workspace]
name = "test"
digest_function = "blake3"
"""

TOOLCHAINS_TOML = """\
[host]
kind = "host_tools"
paths = ["/usr"]
tools = ["/usr/bin/sh", "/usr/bin/cp", "/usr/bin/patch"]
"""

requires_bwrap = pytest.mark.skipif(
    shutil.which("bwrap") is None,
    reason="bubblewrap (bwrap) is not installed; these tests run real sandboxed actions "
           "(apt-get install -y bubblewrap)")


def write_files(root: Path, files: dict[str, str | bytes]) -> None:
    """Write {relative path: text or bytes} under root, creating directories."""
    for rel, content in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)


def checkout_state(root: Path = REPO) -> dict[str, str]:
    """Every path in the checkout (but .git and Python's caches) -> what it is: a link's target,
    a file's size and mtime. Two states differ exactly where something was added, removed,
    re-pointed or written."""
    state: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d != ".git" and d not in _SCRATCH and not d.endswith(".egg-info")]
        here = Path(dirpath)
        for name in filenames + [d for d in dirnames if (here / d).is_symlink()]:
            path = here / name
            rel = path.relative_to(root).as_posix()
            if path.is_symlink():
                state[rel] = "link -> " + os.readlink(path)
            else:
                st = path.lstat()
                state[rel] = f"file {st.st_size} bytes, mtime {st.st_mtime_ns}"
    return state


def workspace_copy(dest: Path, root: Path = REPO) -> Path:
    """A copy of this repository's workspace (WORKSPACE.toml, targets, sources, patches) at `dest`,
    so a test builds it without writing bgraph-out/ links (or anything else) into the checkout."""
    skip = {".git", "bgraph-out", ".ci", "bench", "docs", "build_graph", *_SCRATCH}  # the code runs from the checkout
    shutil.copytree(root, dest, symlinks=True, dirs_exist_ok=True,
                    ignore=lambda d, names: [n for n in names if n in skip or n.endswith(".egg-info")])
    return dest


def copy_toolchains(dest: Path, root: Path = REPO) -> None:
    """This workspace's WORKSPACE.toml, targets/toolchains.toml and the Debian locks its pinned
    systems need (toolchains/), into the workspace at `dest`."""
    (dest / "targets").mkdir(parents=True, exist_ok=True)
    shutil.copy(root / "WORKSPACE.toml", dest / "WORKSPACE.toml")
    shutil.copy(root / "targets" / "toolchains.toml", dest / "targets" / "toolchains.toml")
    shutil.copytree(root / "toolchains", dest / "toolchains", dirs_exist_ok=True)


def hermetic_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The test process's environment minus what could leak host configuration into bgraph."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BGRAPH_", "PIP_"))}
    env["PIP_CONFIG_FILE"] = os.devnull  # no host pip.conf (its extra indexes)
    env["COLUMNS"] = "2000"  # rich must not wrap the lines tests look at
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra or {})
    return env


@dataclass
class Run:
    rc: int
    stdout: str
    stderr: str

    @property
    def json(self) -> Any:
        return json.loads(self.stdout)

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


@dataclass
class WS:
    """A data workspace on disk, plus its cache directory."""

    root: Path
    cache: Path
    env: dict[str, str] = field(default_factory=dict)

    def write(self, files: dict[str, str | bytes]) -> None:
        write_files(self.root, files)

    def cli(self, *args: str, env: dict[str, str] | None = None, timeout: float = 120) -> Run:
        proc = subprocess.run(
            [sys.executable, "-m", "build_graph", "-C", str(self.root), "--cache-dir", str(self.cache), *args],
            capture_output=True, text=True, timeout=timeout, env=hermetic_env({**self.env, **(env or {})}),
            cwd=self.root)
        return Run(proc.returncode, proc.stdout, proc.stderr)

    def build(self, *targets: str, args: tuple[str, ...] = (), env: dict[str, str] | None = None) -> Run:
        """`bgraph build --json`; the summary is `run.json`."""
        return self.cli("build", "--json", *args, *targets, env=env)

    # -- the in-process API, for what the CLI does not show ---------------------------
    def load(self):
        from build_graph.workspace import load
        return load(self.root)

    def engine(self, jobs: int = 2, max_mem_mb: int = 4096, **kw):
        from build_graph.engine import BuildOptions, Engine
        return Engine(self.load(), self.cache, BuildOptions(jobs=jobs, max_mem_mb=max_mem_mb, **kw))

    def engine_build(self, *labels: str, **kw):
        from build_graph.labels import parse_label
        return self.engine(**kw).build([parse_label(x) for x in labels])

    # -- the store, on disk ---------------------------------------------------------------
    @property
    def store(self) -> Path:
        return self.cache / "v1" / "blake3"

    def ac_entries(self) -> set[str]:
        root = self.store / "ac"
        return {p.relative_to(root).as_posix() for p in root.rglob("*.json")} if root.exists() else set()

    def read_output(self, label: str, path: str) -> str:
        """A file of a built target through bgraph-out/ (the CLI's output links)."""
        pkg, name = label[2:].split(":")
        return (self.root / "bgraph-out" / pkg / name / path).read_text()


def action(summary: dict[str, Any], label: str, name: str | None = None) -> dict[str, Any]:
    """The one action record of `label` (optionally by action name) in a build summary."""
    found = [a for a in summary["actions"] if a["label"] == label and (name is None or a["name"] == name)]
    assert len(found) == 1, f"expected one action for {label} {name or ''}, got {found}"
    return found[0]


def recorded_traces(ws: WS) -> dict[str, Any]:
    """label -> the trace the cache's state file holds for it."""
    from build_graph.store.trace import Trace
    trace = Trace(ws.store, ws.cache / "v1" / "tmp")
    return {label: trace.load(label) for label in trace.labels()}


def statuses(summary: dict[str, Any]) -> dict[str, str]:
    """label -> status, for targets with one action each."""
    return {a["label"]: a["status"] for a in summary["actions"]}
