"""The cache's one state file (SQLite, `<cache>/v1/<digest-fn>/state-v2.sqlite`): opened here, with
its schema and its transactions, and the rows of the fast paths that answer before anything else
is loaded. state.BuildState adds the action results and traces of a build.

    meta(name, value)                  schema version
    results(key, result, tree)         action key -> result (state.py)
    traces(label, digest, trace)       configured target -> its trace (state.py)
    records(request, record, memo)     the no-op record of a request (store/uptodate.py) and the
                                       per-target memo of the same build (store/memo.py), one row:
                                       written in one transaction, so a memo is always its record's
    families(family, request)          the last recorded request of a family (noop.Request.family)
    parses(root, parse)                the kept parse of a workspace (store/parsed.py)
    probes(key, lookups)               a stored file's lookups as input discovery reads them
                                       (incremental/discovery.py), keyed by the file's content
                                       digest and the digest of the code that reads it (state.py)

A row is validated by its reader (a damaged one is a miss, never trusted). Writes are SQLite
transactions: a killed build leaves the old rows or the new, and concurrent builds are serialised
by SQLite's locking (30 s busy timeout). Only sqlite3 and the standard library are imported here:
the no-op check reads its record before bgraph's model is imported.
"""

from __future__ import annotations

import atexit
import sqlite3
import threading
from pathlib import Path
from typing import Any, Iterable

SCHEMA = "2"  # bump on any change of the tables or of their encodings; 2: records, families, parses
STATE_FILE = f"state-v{SCHEMA}.sqlite"  # another schema's file has another name, so neither touches the other
TABLES = (
    "meta(name TEXT PRIMARY KEY, value TEXT)",
    "results(key TEXT PRIMARY KEY, result BLOB, tree BLOB)",
    "traces(label TEXT PRIMARY KEY, digest TEXT, trace BLOB)",
    "records(request TEXT PRIMARY KEY, record BLOB, memo BLOB)",
    "families(family TEXT PRIMARY KEY, request TEXT)",
    "parses(root TEXT PRIMARY KEY, parse BLOB)",
    # Added without a schema bump: a table is created where missing, and older bgraph never reads it.
    "probes(key TEXT PRIMARY KEY, lookups BLOB)",
)


def _schema(db: sqlite3.Connection) -> str | None:
    try:
        row = db.execute("SELECT value FROM meta WHERE name = 'schema'").fetchone()
    except sqlite3.OperationalError:  # no meta table: a new file
        return None
    return row[0] if row else None


_OPEN: list[sqlite3.Connection] = []  # (a Connection takes no weak reference)


def _close_all() -> None:
    """Close every state file this process opened, at exit: the last connection to close folds
    SQLite's write-ahead log into the file, so what a command wrote is in the state file itself
    when it ends, however the process's objects were last referenced (`bgraph` leaves by
    os._exit, after the exit handlers). A connection still in use by a thread is left as is."""
    for db in list(_OPEN):
        try:
            db.close()
        except sqlite3.Error:
            pass


atexit.register(_close_all)


def connect(path: Path, create: bool = True) -> sqlite3.Connection | None:
    """The state file at `path`, its tables made where it has none; None where it is missing
    (`create=False`), unreadable, or of another schema (not ours to read or write)."""
    if not create and not path.exists():
        return None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)  # a named variant's own directory
        db = sqlite3.connect(path, timeout=30, isolation_level=None, check_same_thread=False)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")  # WAL: a crash loses at most the last commits, never consistency
        schema = _schema(db)
        if schema is None:  # made once, in one transaction (a reader of a made file writes nothing)
            db.execute("BEGIN IMMEDIATE")
            for table in TABLES:
                db.execute(f"CREATE TABLE IF NOT EXISTS {table}")
            db.execute("INSERT OR IGNORE INTO meta VALUES ('schema', ?)", (SCHEMA,))
            db.execute("COMMIT")
            schema = _schema(db)
        if schema != SCHEMA:
            db.close()
            return None
        _OPEN.append(db)
        return db
    except (sqlite3.Error, OSError):
        # An unreadable state file costs speed, never correctness: every memo in it is a miss.
        return None


class StateFile:
    """One state file, opened on first use; the rows of the no-op record, the memo, the family
    pointers and the kept parse. `create=False`: a reader that makes no file where none is."""

    def __init__(self, path: Path, create: bool = True):
        self.path = path
        self.create = create
        self._db: sqlite3.Connection | None = None
        self._lock = threading.RLock()  # action threads file results while the engine plans (a flush writes under it)
        self.usable = True

    def _conn(self) -> sqlite3.Connection | None:
        if self._db is None and self.usable:
            if not self.create and not self.path.exists():
                return None
            self._db = connect(self.path, self.create)
            self.usable = self._db is not None
        return self._db

    def _query(self, sql: str, args: tuple) -> Any:
        db = self._conn()
        if db is None:
            return None
        try:
            with self._lock:
                return db.execute(sql, args).fetchone()
        except sqlite3.Error:
            return None

    def _write(self, statements: Iterable[tuple[str, Iterable[tuple]]]) -> None:
        """Run (sql, rows) pairs in one transaction; a failure (a full disk, a lock held past the
        timeout) loses them all: every row is a memo."""
        db = self._conn()
        if db is None:
            return
        with self._lock:
            try:
                db.execute("BEGIN IMMEDIATE")
                for sql, rows in statements:
                    db.executemany(sql, rows)
                db.execute("COMMIT")
            except sqlite3.Error:
                try:
                    db.execute("ROLLBACK")
                except sqlite3.Error:
                    pass

    # -- the fast paths' rows ------------------------------------------------------------------
    def record(self, request: str) -> bytes | None:
        """The no-op record of `request` as written (its reader validates it)."""
        row = self._query("SELECT record FROM records WHERE request = ?", (request,))
        return row[0] if row else None

    def memo(self, request: str) -> bytes | None:
        """The per-target memo written with the record of `request`."""
        row = self._query("SELECT memo FROM records WHERE request = ?", (request,))
        return row[0] if row else None

    def put_record(self, request: str, record: bytes | None, memo: bytes | None = None, family: str = "") -> None:
        """File a request's record and memo together, and where there is a memo make it its
        family's last; `record=None` drops the request's record (and its family's pointer to it)."""
        if record is None:
            self.drop_record(request, family)
            return
        statements = [("INSERT OR REPLACE INTO records VALUES (?, ?, ?)", [(request, record, memo)])]
        if memo is not None and family:
            statements.append(("INSERT OR REPLACE INTO families VALUES (?, ?)", [(family, request)]))
        self._write(statements)

    def drop_record(self, request: str, family: str = "") -> None:
        """Forget a request's record and memo, and its family's pointer to it."""
        self._write([("DELETE FROM records WHERE request = ?", [(request,)]),
                     ("DELETE FROM families WHERE family = ? AND request = ?", [(family, request)])])

    def drop_records(self) -> None:
        """Forget every record and memo (`cache gc` removed something: none holds)."""
        self._write([("DELETE FROM records", [()]), ("DELETE FROM families", [()])])

    def family(self, family: str) -> str | None:
        """The request last recorded with a memo in `family`."""
        row = self._query("SELECT request FROM families WHERE family = ?", (family,))
        return row[0] if row and isinstance(row[0], str) else None

    def parse(self, root: str) -> bytes | None:
        """The kept parse of the workspace at `root` as written (store/parsed.py validates it)."""
        row = self._query("SELECT parse FROM parses WHERE root = ?", (root,))
        return row[0] if row else None

    def put_parse(self, root: str, parse: bytes) -> None:
        self._write([("INSERT OR REPLACE INTO parses VALUES (?, ?)", [(root, parse)])])

    def close(self) -> None:
        """Close the state file (its log folded in where this was the last connection)."""
        if self._db is not None:
            self._db.close()
            if self._db in _OPEN:
                _OPEN.remove(self._db)
            self._db = None
