"""The `bgraph` entry point: keep bgraph's bytecode, then run the command line."""

from __future__ import annotations

import hashlib
import os
import shutil
import sys

KEPT_VERSIONS = 3  # bytecode directories of this many versions of bgraph's code are kept


def code_digest(package: str) -> str:
    """A digest of every source file of bgraph's package as stat sees it (size, mtime and ctime
    in ns, inode): what the no-op record's code stamp compares (store/uptodate.code_files)."""
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(package):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in sorted(filenames):
            if name.endswith(".py"):
                st = os.stat(os.path.join(dirpath, name))
                h.update(f"{dirpath}/{name}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}\0{st.st_ino}\n"
                         .encode("utf-8", "surrogateescape"))
    return h.hexdigest()[:20]


def keep_bytecode() -> None:
    """Let this process write the bytecode of what it imports, under bgraph's own directory,
    where PYTHONDONTWRITEBYTECODE forbids writing it beside the sources.

    That variable is set in many container images and CI machines (this project's VM too), and
    with it every command compiled bgraph's ~100 modules from source again: 0.15-0.2 CPU-s per
    command, a tenth of a cold build's own cost on small actions and most of a no-op (issue 34).
    The bytecode goes under the caller's PYTHONPYCACHEPREFIX, else $XDG_CACHE_HOME/bgraph-bytecode
    (else ~/.cache/bgraph-bytecode; a relative XDG_CACHE_HOME is ignored, as the XDG spec says),
    never beside a source, which is what the variable is there to prevent.

    In a directory of its own per version of bgraph's code (code_digest): Python takes a .pyc
    as current where the source's whole-second mtime and size match, so an edit within the same
    second at the same size would run the old bytecode while the no-op record's code stamp (ns
    times, ctime, inode) says new (red-team K16). Under a new directory Python compiles the
    standard library's modules once too (~0.8 CPU-s); the last KEPT_VERSIONS directories stay."""
    if not sys.dont_write_bytecode:
        return
    base = sys.pycache_prefix
    if base is None:
        xdg = os.environ.get("XDG_CACHE_HOME", "")
        cache = xdg if os.path.isabs(xdg) else os.path.join(os.path.expanduser("~"), ".cache")
        base = os.path.join(cache, "bgraph-bytecode")
    package = os.path.dirname(os.path.abspath(__file__))
    try:
        version = code_digest(package)
    except OSError:  # a source removed meanwhile: compile from source, as without this
        return
    prefix = os.path.join(os.path.abspath(base), version)
    if not os.path.isdir(prefix):
        _prune(os.path.abspath(base), version)
    sys.pycache_prefix = prefix
    sys.dont_write_bytecode = False


def _prune(base: str, keep: str) -> None:
    """Remove all but the newest KEPT_VERSIONS - 1 version directories under `base` (and `keep`)."""
    try:
        entries = [e for e in os.scandir(base) if e.is_dir(follow_symlinks=False) and e.name != keep
                   and len(e.name) == 20 and all(c in "0123456789abcdef" for c in e.name)]
    except OSError:
        return
    entries.sort(key=lambda e: e.stat(follow_symlinks=False).st_mtime_ns, reverse=True)
    for old in entries[KEPT_VERSIONS - 1:]:
        shutil.rmtree(old.path, ignore_errors=True)


def run() -> None:
    """The `bgraph` command."""
    keep_bytecode()
    from build_graph.cli import run as cli_run

    cli_run()
