"""The build state: one indexed file per cache instead of files per target (like Ninja's
`.ninja_log` and `.ninja_deps`), so a no-op build opens one file, not three per target.

    <cache>/v1/<digest-fn>/state-v2.sqlite    (WAL mode; see docs/engine-state.md; the file, its
                                               schema and the fast paths' rows: statefile.py)
      results(key, result, tree)               action key -> ActionResult JSON and its output
                                               tree inline (small trees), as last filed or used
      traces(label, digest, trace)             per target: what `trace/<label>.json` held, and
                                               the digest of that JSON (a no-op compares digests)
      probes(key, lookups)                     what input discovery found in a stored file (the
                                               __has_include names it probes), by content digest
                                               and the digest of the code that found it

Rows are a memo, never the only copy of what they say: `ac/` stays the action cache that `cache
gc`, `cache verify` and remotes read, and a result row is used only like an `ac/` entry is,
after the build holds its key and the blobs of its tree are verified (a stat each, by stamp).
A row whose blobs are gone is a miss. A killed build loses only its unflushed rows (SQLite's
transactions are atomic); concurrent builds write through SQLite's own locking. A cache whose
state file has another schema version is read as having none (it is rebuilt as builds run).
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any

import orjson

from build_graph.model import ActionResult, DirEntry, Digester, FileEntry, SymlinkEntry, Tree
from build_graph.store.listing import MissListing
from build_graph.store.statefile import SCHEMA, STATE_FILE, StateFile

__all__ = ["SCHEMA", "STATE_FILE", "BuildState", "decode_tree", "encode_tree"]
INLINE_ENTRIES = 256  # an output tree up to this size is kept in its row (else read from dirs/)
FLUSH_S = 2.0  # write buffered rows at most this long after the first (a killed build loses less)


def encode_tree(tree: Tree) -> bytes:
    """A tree's entries as compact JSON: [path, digest, size, exec] / [path, link target] / [path]."""
    rows: list[list[Any]] = []
    for path, e in tree.entries.items():
        if isinstance(e, FileEntry):
            rows.append([path, e.digest, e.size, e.executable])
        elif isinstance(e, SymlinkEntry):
            rows.append([path, e.target])
        else:
            rows.append([path])
    return orjson.dumps(rows)


def decode_tree(raw: bytes | list) -> Tree:
    """The tree encode_tree wrote, as bytes or as its rows once read (a memo holds them inside
    its own JSON); its paths were checked when the tree was made, and materialize refuses a path
    below a link or outside the tree whatever its source."""
    entries: dict[str, Any] = {}
    for row in orjson.loads(raw) if isinstance(raw, bytes) else raw:
        n = len(row)
        entries[row[0]] = FileEntry(row[1], row[2], row[3]) if n == 4 else SymlinkEntry(row[1]) if n == 2 else DirEntry()
    return Tree.from_checked(entries)


class BuildState(StateFile):
    """The state file of one cache layout: lookups go to SQLite, writes are buffered and
    flushed in one transaction (at the latest FLUSH_S after they start, and at close)."""

    def __init__(self, path: Path, create: bool = True):
        """`create=False`: a reader (explain, why) that makes no file where none is."""
        super().__init__(path, create)
        self._results: dict[str, tuple[str, bytes | None]] = {}
        self._traces: dict[str, tuple[str, bytes]] = {}
        self._probes: dict[str, bytes] = {}
        self._first_pending: float | None = None
        # After many misses, each table's keys are read once (store/listing.py).
        self._listed_results = MissListing(lambda: self._column("SELECT key FROM results"))
        self._listed_traces = MissListing(lambda: self._column("SELECT label FROM traces"))
        self._listed_probes = MissListing(lambda: self._column("SELECT key FROM probes"))

    def _column(self, sql: str) -> list[str]:
        db = self._conn()
        if db is None:
            raise sqlite3.Error("no state file")
        with self._lock:
            return [v for (v,) in db.execute(sql)]

    def _row(self, listing: MissListing, key: str, sql: str) -> Any:
        """The row `sql` finds for `key`, unless the listing knows it absent."""
        if listing.absent(key):
            return None
        row = self._query(sql, (key,))
        if row is None:
            listing.missed()
        return row

    # -- action results --------------------------------------------------------------------
    def result(self, key: str, digester: Digester) -> tuple[ActionResult, Tree | None] | None:
        """The result filed under `key` and, for a small output, its tree (its digest known)."""
        pending = self._results.get(key)
        row = pending if pending is not None else self._row(self._listed_results, key,
                                                            "SELECT result, tree FROM results WHERE key = ?")
        if row is None:
            return None
        try:
            result = ActionResult.from_json(orjson.loads(row[0]))
            tree = decode_tree(row[1]).know_digest(digester, result.output_tree) if row[1] else None
        except (ValueError, TypeError, KeyError, IndexError):
            return None
        return result, tree

    def put_result(self, key: str, result: ActionResult, tree: Tree | None) -> None:
        small = tree is not None and len(tree.entries) <= INLINE_ENTRIES
        with self._lock:
            self._results[key] = (orjson.dumps(result.to_json()).decode(), encode_tree(tree) if small else None)
            self._pending()
        self._listed_results.added(key)

    def drop_results(self, keys) -> None:
        """Forget results (an entry found corrupt, or collected)."""
        keys = list(keys)
        with self._lock:
            for k in keys:
                self._results.pop(k, None)
        if keys:
            self._write([("DELETE FROM results WHERE key = ?", ((k,) for k in keys))])

    # -- traces ----------------------------------------------------------------------------
    def trace_digest(self, label: str) -> str | None:
        pending = self._traces.get(label)
        if pending is not None:
            return pending[0]
        row = self._row(self._listed_traces, label, "SELECT digest FROM traces WHERE label = ?")
        return row[0] if row else None

    def trace(self, label: str) -> dict[str, Any] | None:
        """The trace recorded for `label` (None: none in this file)."""
        pending = self._traces.get(label)
        row = pending if pending is not None else self._row(self._listed_traces, label,
                                                            "SELECT digest, trace FROM traces WHERE label = ?")
        if row is None:
            return None
        try:
            value = orjson.loads(row[1])
        except ValueError:
            return None
        return value if isinstance(value, dict) else None

    def trace_labels(self) -> list[str]:
        self.flush()
        db = self._conn()
        if db is None:
            return []
        with self._lock:
            return sorted(label for (label,) in db.execute("SELECT label FROM traces"))

    def put_trace(self, label: str, digest: str, encoded: bytes) -> None:
        with self._lock:
            self._traces[label] = (digest, encoded)
            self._pending()
        self._listed_traces.added(label)

    # -- discovery's probes of stored files -----------------------------------------------------
    def probe(self, key: str) -> bytes | None:
        """The lookups filed under `key` as written (the reader validates them), or None."""
        pending = self._probes.get(key)
        if pending is not None:
            return pending
        row = self._row(self._listed_probes, key, "SELECT lookups FROM probes WHERE key = ?")
        return row[0] if row else None

    def put_probe(self, key: str, encoded: bytes) -> None:
        with self._lock:
            self._probes[key] = encoded
            self._pending()
        self._listed_probes.added(key)

    # -- writing -----------------------------------------------------------------------------
    def _pending(self) -> None:
        if self._first_pending is None:
            self._first_pending = time.monotonic()

    def maybe_flush(self) -> None:
        """Flush if rows have waited FLUSH_S (called between actions by the build loop)."""
        if self._first_pending is not None and time.monotonic() - self._first_pending > FLUSH_S:
            self.flush()

    def flush(self) -> None:
        """Write the buffered rows in one transaction."""
        with self._lock:
            results, traces, probes = self._results, self._traces, self._probes
            if not results and not traces and not probes:
                return
            self._results, self._traces, self._probes, self._first_pending = {}, {}, {}, None
            self._write([("INSERT OR REPLACE INTO results VALUES (?, ?, ?)",
                          ((k, r, t) for k, (r, t) in results.items())),
                         ("INSERT OR REPLACE INTO traces VALUES (?, ?, ?)",
                          ((label, d, t) for label, (d, t) in traces.items())),
                         ("INSERT OR REPLACE INTO probes VALUES (?, ?)", probes.items())])

    def close(self) -> None:
        self.flush()
        super().close()
