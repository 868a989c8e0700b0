"""`bgraph py lock`: resolve python_lock targets with uv, keep one wheel per package and platform.

uv (`uv pip compile --format pylock.toml`, PEP 751) resolves the requirements once per platform
(CPython `python`, manylinux up to the image's glibc, wheels only) against the indexes pip is
configured with (fetcher.pip_indexes: no host is named here), pooled as pip pools them. From each
package's wheels the one the platform prefers is kept (packaging's tag order). A lock file is
rewritten only when its text changes, after every target resolved (an error changes no lock).
Nothing goes to the build cache; a build never runs this (no network at build time).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable
from urllib.parse import unquote, urlparse

from build_graph.errors import UsageError, where
from build_graph.labels import Label
from build_graph.lock_files import check_writable, read_lock, write_lock
from build_graph.python_lock.lockfile import (Lock, LockedWheel, LockInput, PyLockError, diff, normalize, parse,
                                              render)
from build_graph.python_lock.requirements import canonical
from build_graph.workspace import Workspace

UV_HINT = "install the resolver with `pip install uv` (any uv >= 0.8 writes PEP 751 pylock.toml)"
# uv's name for a platform: CPU and the newest manylinux glibc the image's system has.
_UV_ARCH = {"x86_64": "x86_64", "aarch64": "aarch64"}


@dataclass
class PyLockResult:
    labels: list[str]
    lock: str  # workspace path
    written: bool
    changes: list[str]
    totals: dict[str, tuple[int, int]] = field(default_factory=dict)  # platform -> (wheels, bytes)
    notes: list[str] = field(default_factory=list)


def lock_targets(ws: Workspace, labels: list[Label]) -> dict[str, list[Label]]:
    """Lock path -> the python_lock targets reading it (`labels`, or every python_lock target)."""
    if labels:
        for label in labels:
            kind = ws.target(label).kind
            if kind != "python_lock":
                raise UsageError(f"{label} is a {kind} target; `bgraph py lock` locks python_lock targets")
    else:
        labels = sorted((l for l, t in ws.targets.items() if t.kind == "python_lock"), key=str)
    by_path: dict[str, list[Label]] = {}
    for label in labels:
        by_path.setdefault(ws.targets[label].attrs.lock, []).append(label)
    return by_path


def lock_input(attrs) -> LockInput:
    """What a target asks its lock to be resolved from."""
    return LockInput(tuple(sorted(attrs.requirements)), attrs.python, attrs.glibc, tuple(sorted(attrs.platforms)))


def uv_command() -> list[str]:
    """How to run uv: the `uv` on PATH, else the uv package of this interpreter."""
    found = shutil.which("uv")
    if found:
        return [found]
    try:
        from uv import find_uv_bin  # the PyPI package `uv` ships the binary and this finder
    except ImportError:
        raise UsageError("no uv to resolve with (not on PATH, not installed for this Python)", hint=UV_HINT) from None
    return [find_uv_bin()]


def lock(ws: Workspace, labels: list[Label], progress: Callable[[str], None] = lambda m: None) -> list[PyLockResult]:
    """Resolve each lock path's targets for every platform; returns what changed per lock file."""
    from build_graph.fetcher import pip_indexes

    uv = uv_command()
    version = subprocess.run([*uv, "--version"], capture_output=True, text=True).stdout.strip() or "uv"
    indexes = pip_indexes()
    results, writes = [], []
    by_path = lock_targets(ws, labels)
    for path in by_path:  # a lock path through a symlink is refused before uv runs
        check_writable(ws.root, path)
    for path, targets in by_path.items():
        inputs = {lock_input(ws.targets[l].attrs) for l in targets}
        if len(inputs) != 1:
            raise UsageError(f"targets {', '.join(map(str, targets))} share {path} but ask for different "
                             "requirements, python, glibc or platforms", hint="give each its own lock file")
        [inp] = inputs
        platforms = {}
        for platform in inp.platforms:
            progress(f"{path}: resolving {len(inp.requirements)} requirement(s) for {platform} with {version}")
            platforms[platform] = resolve(uv, inp, platform, indexes, where(ws.targets[targets[0]].file,
                                                                           ws.targets[targets[0]].table, "requirements"))
        new = Lock(inp, f"{version} pip compile (PEP 751 pylock.toml)", platforms)
        old_text = read_lock(ws.root, path)
        notes = []
        try:
            old = parse(old_text, path) if old_text is not None else None
        except PyLockError as e:
            old, notes = None, [f"the old lock was not readable ({e.message}); replaced"]
        text = render(new)
        if text != old_text:
            writes.append((path, text))
        totals = {p: (len(ws_), sum(w.size for w in ws_)) for p, ws_ in platforms.items()}
        results.append(PyLockResult([str(l) for l in targets], path, text != old_text, diff(old, new), totals,
                                    notes + pin_differences(ws, new)))
    for path, text in writes:
        write_lock(ws.root, path, text)
    return results


def resolve(uv: list[str], inp: LockInput, platform: str, indexes: list[str], loc: str) -> tuple[LockedWheel, ...]:
    """One `uv pip compile` for `platform`; its pylock.toml reduced to the platform's wheel per package."""
    try:  # checked at load too; here as uv obeys whatever the requirements file says
        lines = [canonical(r) for r in inp.requirements]
    except ValueError as e:
        raise PyLockError(str(e), where=loc, hint="name projects the indexes serve (PEP 508)") from None
    with tempfile.TemporaryDirectory(prefix="bgraph-pylock-") as tmp:
        req = Path(tmp) / "requirements.in"
        req.write_text("".join(r + "\n" for r in lines))
        out = Path(tmp) / "pylock.toml"
        argv = [*uv, "pip", "compile", str(req), "--format", "pylock.toml", "-o", str(out), "--no-header",
                "--no-config", "--quiet", "--refresh", "--python-version", inp.python,
                # wheels only, and nothing built: --no-build also refuses a local project, where
                # --only-binary :all: (which uv will not take with it) still builds an editable
                "--no-build", "--no-sources", "--no-python-downloads",
                # this interpreter: uv would otherwise look for one, and run a `.venv/bin/python` it
                # finds in its directory or any above (the workspace's, or one planted in /tmp)
                "--python", sys.executable,
                "--python-platform", f"{_UV_ARCH[platform]}-manylinux_{inp.glibc.replace('.', '_')}",
                # --refresh: a refresh must see releases made since uv cached the index pages;
                # pip pools every index it is given and takes the best version: so does this lock
                "--index-strategy", "unsafe-best-match", "--index-url", indexes[0],
                *(a for extra in indexes[1:] for a in ("--extra-index-url", extra))]
        # a fresh directory (not the workspace) and an environment of bgraph's own: uv reads no
        # project, config or UV_* setting the caller's shell or the workspace would bring
        proc = subprocess.run(argv, capture_output=True, text=True, env=uv_environment(), cwd=tmp)
        if proc.returncode != 0:
            last = [l for l in proc.stderr.strip().splitlines() if l.strip()]
            raise PyLockError(f"uv found no resolution for {platform}: " + " ".join(l.strip() for l in last[-3:]),
                              where=loc, hint="change the requirements, or check the indexes pip is configured with")
        data = tomllib.loads(out.read_text())
    for package in data.get("packages", []):
        source = next((k for k in ("directory", "archive", "vcs") if k in package), None)
        if source:
            raise PyLockError(f"uv resolved {package.get('name')} from a {source}, not from an index's wheels",
                              where=loc, hint="name projects the indexes serve as wheels")
    tags = supported_tags(inp.python, inp.glibc, platform)
    chosen = []
    for package in data.get("packages", []):
        best = None
        for wheel in package.get("wheels", []):
            filename = wheel.get("name") or wheel["url"].rsplit("/", 1)[-1]
            rank = wheel_rank(filename, tags)
            if rank is not None and (best is None or rank < best[0]):
                best = (rank, filename, wheel["hashes"]["sha256"], _size(wheel))
        if best is None:
            raise PyLockError(f"{package['name']} {package.get('version')} has no wheel for {platform} "
                              f"(CPython {inp.python}, glibc {inp.glibc})", where=loc,
                              hint="pin a version that ships one, or leave the requirement out")
        chosen.append(LockedWheel(normalize(package["name"]), str(package["version"]), best[1], best[2], best[3]))
    return tuple(sorted(chosen, key=lambda w: w.name))


def _size(wheel: dict) -> int:
    """The file's size: the index's word for it, else (a PEP 503 page gives none) the file's own or
    the server's Content-Length; 0 where none says."""
    if wheel.get("size"):
        return int(wheel["size"])
    url = urlparse(wheel.get("url", ""))
    if url.scheme == "file" and os.path.isfile(unquote(url.path)):
        return os.path.getsize(unquote(url.path))
    if url.scheme in ("http", "https"):
        import requests

        try:
            return int(requests.head(wheel["url"], allow_redirects=True, timeout=60).headers.get("Content-Length", 0))
        except (requests.RequestException, ValueError):
            return 0
    return 0


# What uv may see of the caller's environment: where programs and the home (cache, netrc) are, and
# how the network is reached. The indexes are passed as options, from pip's configuration.
_UV_ENV = ("PATH", "HOME", "XDG_CACHE_HOME", "TMPDIR", "SSL_CERT_FILE", "SSL_CERT_DIR",
           "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "all_proxy", "no_proxy")


def uv_environment() -> dict[str, str]:
    """The environment uv runs with: only `_UV_ENV` of bgraph's own."""
    return {k: os.environ[k] for k in _UV_ENV if k in os.environ}


def supported_tags(python: str, glibc: str, platform: str) -> dict:
    """Wheel tag -> preference (lower first) for CPython `python` on Linux `platform` with `glibc`."""
    from packaging import tags

    major, minor = (int(x) for x in python.split("."))
    top = int(glibc.split(".")[1])
    plats = [f"manylinux_2_{m}_{platform}" for m in range(top, 16, -1)] + [f"manylinux2014_{platform}"]
    if platform == "x86_64":
        plats += ["manylinux_2_12_x86_64", "manylinux2010_x86_64", "manylinux_2_5_x86_64", "manylinux1_x86_64"]
    plats.append(f"linux_{platform}")
    abi = f"cp{major}{minor}"
    ordered = [*tags.cpython_tags((major, minor), abis=[abi], platforms=plats),
               *tags.compatible_tags((major, minor), abi, plats)]
    return {t: i for i, t in reversed(list(enumerate(ordered)))}


def wheel_rank(filename: str, tags: dict) -> int | None:
    """The best preference among a wheel's tags, or None where none fits."""
    from packaging.utils import InvalidWheelFilename, parse_wheel_filename

    try:
        _, _, _, wheel_tags = parse_wheel_filename(filename)
    except InvalidWheelFilename:
        return None
    ranks = [tags[t] for t in wheel_tags if t in tags]
    return min(ranks) if ranks else None


def pin_differences(ws: Workspace, new: Lock) -> list[str]:
    """Where the lock takes a version of a project that no WORKSPACE.toml wheel pin of it has (the
    wheel checks' torch environment): said, not refused, as the lock follows its requirements."""
    pinned: dict[str, dict[str, str]] = {}  # project -> version -> pin name
    for name, pin in sorted(ws.model.pins.items()):
        if pin.kind == "pypi" and pin.file == "wheel":
            pinned.setdefault(normalize(pin.project), {}).setdefault(pin.version, name)
    found: dict[tuple[str, str], list[str]] = {}
    for platform, wheels in sorted(new.platforms.items()):
        for w in wheels:
            if w.name in pinned and w.version not in pinned[w.name]:
                found.setdefault((w.name, w.version), []).append(platform)
    return [f"{name} {version} here ({', '.join(plats)}); WORKSPACE.toml pins "
            + ", ".join(f"{pin} {v}" for v, pin in sorted(pinned[name].items()))
            for (name, version), plats in sorted(found.items())]
