"""The `bgraph` entry point: keep bgraph's bytecode, then run the command line."""

from __future__ import annotations

import os
import sys


def keep_bytecode() -> None:
    """Let this process write the bytecode of what it imports, under bgraph's own directory,
    where PYTHONDONTWRITEBYTECODE forbids writing it beside the sources.

    That variable is set in many container images and CI machines (this project's VM too), and
    with it every command compiled bgraph's ~100 modules from source again: 0.15-0.2 CPU-s per
    command, a tenth of a cold build's own cost on small actions and most of a no-op (issue 34).
    The bytecode goes under the caller's PYTHONPYCACHEPREFIX, else $XDG_CACHE_HOME/bgraph-bytecode
    (else ~/.cache/bgraph-bytecode), never beside a source, which is what the variable is there
    to prevent. (Under a new prefix Python also compiles the standard library's modules once.)
    Bytecode is only Python's cache of a source: it
    is checked against the source's mtime and size on each import, and no key or stamp of
    bgraph's reads it (the code stamp skips __pycache__)."""
    if not sys.dont_write_bytecode:
        return
    if sys.pycache_prefix is None:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        sys.pycache_prefix = os.path.join(os.path.abspath(base), "bgraph-bytecode")
    sys.dont_write_bytecode = False


def run() -> None:
    """The `bgraph` command."""
    keep_bytecode()
    from build_graph.cli import run as cli_run

    cli_run()
