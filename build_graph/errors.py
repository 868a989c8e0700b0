"""One error type per layer; each carries where it happened (file, table, key, label, action)."""

from __future__ import annotations


class BgraphError(Exception):
    """Base of every error bgraph reports to a user (never a traceback)."""

    layer = "error"

    def __init__(self, message: str, *, where: str | None = None, hint: str | None = None):
        self.message = message
        self.where = where
        self.hint = hint
        super().__init__(self.render())

    def render(self) -> str:
        head = f"{self.where}: {self.message}" if self.where else self.message
        return f"{head}\n  hint: {self.hint}" if self.hint else head


class UsageError(BgraphError):
    """A command-line option that cannot work (checked before anything runs)."""

    layer = "usage"


class LoadError(BgraphError):
    layer = "load"


class LabelError(LoadError):
    layer = "label"


class GraphError(BgraphError):
    layer = "graph"


class QueryError(BgraphError):
    layer = "query"


class PlanError(BgraphError):
    layer = "plan"


class FetchError(BgraphError):
    layer = "fetch"


class ArchiveError(BgraphError):
    layer = "archive"


class SandboxError(BgraphError):
    layer = "sandbox"


class ActionFailed(BgraphError):
    layer = "action"


class StoreError(BgraphError):
    layer = "store"


def where(file: str | None = None, table: str | None = None, key: str | None = None, line: int | None = None) -> str:
    """Format a location as `file:line [table] key` from whichever parts are known."""
    parts = []
    if file:
        parts.append(f"{file}:{line}" if line else file)
    if table:
        parts.append(f"[{table}]")
    if key:
        parts.append(f"key '{key}'")
    return " ".join(parts)


def disk_full(cache_dir) -> StoreError:
    """The one-line error for ENOSPC under the cache: where, how much is free, what to do."""
    import os
    import shutil

    try:
        free = f"{shutil.disk_usage(cache_dir).free / 2**20:.0f} MiB free"
    except OSError:
        free = "free space unknown"
    return StoreError(f"no space left in the cache directory {os.fspath(cache_dir)} ({free})",
                      hint="`bgraph cache gc --max-size SIZE` shrinks the cache; or free disk space "
                           "there, or build with --cache-dir on a larger disk; nothing partial was stored")
