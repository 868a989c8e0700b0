"""Cache upkeep: `bgraph cache gc` (collect what nothing needs, least recently used first) and
`bgraph cache verify` (re-hash everything, find what is corrupt or dangling).

What is live: the action-cache entries kept (those running builds hold, then the most recently
used while they fit in `--max-size`), every blob and directory node their outputs name, the
trees behind `bgraph-out` links (gc roots), and anything a running build holds or created since
it started (see lease.py). Materialized trees hold no bytes of their own (they hard-link blobs):
any that no running build holds and no root names is removed, and re-made on next use.
"""

from __future__ import annotations

import fcntl
import json
import os
import stat
import time
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

from build_graph.model import Digester
from build_graph.store.atomic import write_json
from build_graph.store.state import STATE_FILE, BuildState
from build_graph.store.json_table import JsonTable
from build_graph.store.uptodate import bump_generation
from build_graph.store.cas import discard_tree, evict_blob, hash_file, restamp_linked, rmtree
from build_graph.store.lease import LiveBuilds, gc_lock_path, live_builds


@dataclass
class _Blob:
    size: int = 0  # bytes on disk, with the executable copy
    ctime: float = 0.0
    paths: list[Path] = field(default_factory=list)
    inodes: list[int] = field(default_factory=list)


@dataclass
class _Entry:
    key: str
    path: Path
    mtime: float
    result: dict | None  # None: unreadable


@dataclass
class CollectReport:
    entries_kept: int = 0
    entries_removed: int = 0
    held_by_builds: int = 0
    blobs_removed: int = 0
    bytes_before: int = 0
    bytes_after: int = 0
    nodes_removed: int = 0
    trees_removed: int = 0
    running_builds: int = 0


@dataclass
class VerifyReport:
    blobs_checked: int = 0
    nodes_checked: int = 0
    entries_checked: int = 0
    trees_checked: int = 0
    corrupt_blobs: list[str] = field(default_factory=list)
    corrupt_nodes: list[str] = field(default_factory=list)
    dangling_entries: list[str] = field(default_factory=list)
    bad_trees: list[str] = field(default_factory=list)
    bad_state: list[str] = field(default_factory=list)  # a state file SQLite finds damaged
    # Paths in the sharded stores that are not a shard directory holding regular files: a link,
    # a directory in a shard, a FIFO (never followed, opened or hashed; --repair removes them).
    stray: list[str] = field(default_factory=list)
    repaired: bool = False

    @property
    def clean(self) -> bool:
        return not (self.corrupt_blobs or self.corrupt_nodes or self.dangling_entries or self.bad_trees
                    or self.bad_state or self.stray)


@contextmanager
def _exclusive(layout_root: Path):
    """Hold `v1/gc.lock` exclusively: builds wait before their next hold until we are done."""
    fd = os.open(gc_lock_path(layout_root), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _sharded(root: Path, stray: list[str] | None = None):
    """(shard name + file name, DirEntry) for every regular file of a `ab/cdef…` sharded
    directory. Nothing else is followed, opened or hashed: a shard that is a link (into a user's
    directory: verify --repair deleted the files there as corrupt blobs) or not a directory, and
    an entry of a shard that is a directory, link, FIFO or socket, are added to `stray` by path."""
    try:
        shards = os.scandir(root)
    except FileNotFoundError:
        return
    with shards:
        for shard in shards:
            if not shard.is_dir(follow_symlinks=False):
                if stray is not None:
                    stray.append(shard.path)
                continue
            with os.scandir(shard.path) as it:
                for e in it:
                    if e.is_file(follow_symlinks=False):
                        yield shard.name + e.name, e
                    elif stray is not None:
                        stray.append(e.path)


def _scan_blobs(cas_root: Path, stray: list[str] | None = None) -> dict[str, _Blob]:
    blobs: dict[str, _Blob] = {}
    for name, e in _sharded(cas_root, stray):
        st = e.stat(follow_symlinks=False)
        b = blobs.setdefault(name.removesuffix(".x"), _Blob())
        b.size += st.st_size
        b.ctime = max(b.ctime, st.st_ctime)
        b.paths.append(Path(e.path))
        b.inodes.append(st.st_ino)
    return blobs


def _scan_nodes(dirs_root: Path, stray: list[str] | None = None) -> dict[str, tuple[Path, float]]:
    return {name: (Path(e.path), e.stat(follow_symlinks=False).st_ctime) for name, e in _sharded(dirs_root, stray)}


def _scan_entries(ac_root: Path, stray: list[str] | None = None) -> tuple[list[_Entry], list[Path]]:
    """Action-cache entries, and the depfile manifests beside them."""
    entries, manifests = [], []
    for name, e in _sharded(ac_root, stray):
        if name.endswith(".reads.json"):
            manifests.append(Path(e.path))
            continue
        if not name.endswith(".json"):
            continue
        try:
            result = json.loads(Path(e.path).read_bytes())
            if not isinstance(result, dict) or not isinstance(result.get("output_tree"), str):
                result = None
        except (ValueError, OSError):
            result = None
        entries.append(_Entry(name[: -len(".json")], Path(e.path), e.stat(follow_symlinks=False).st_mtime, result))
    return entries, manifests


class _Closure:
    """What an output tree needs: its directory nodes and blobs (memoized per node)."""

    def __init__(self, dirs_root: Path, digester: Digester, check: bool):
        self.dirs_root, self.digester, self.check = dirs_root, digester, check
        self.memo: dict[str, tuple[frozenset[str], frozenset[str]] | None] = {}

    def of_node(self, digest: str) -> tuple[frozenset[str], frozenset[str]] | None:
        """(nodes, blobs) under a directory node; None if a node is missing or corrupt."""
        if digest in self.memo:
            return self.memo[digest]
        self.memo[digest] = None  # a cycle cannot occur in a Merkle DAG; this guards garbage
        try:
            raw = (self.dirs_root / digest[:2] / digest[2:]).read_bytes()
            if self.check and self.digester.of(raw) != digest:
                return None
            node = json.loads(raw)
            nodes, blobs = {digest}, {f[1] for f in node["files"]}
            for _name, sub in node["dirs"]:
                below = self.of_node(sub)
                if below is None:
                    return None
                nodes |= below[0]
                blobs |= below[1]
        except (OSError, ValueError, KeyError, TypeError, IndexError):
            return None
        self.memo[digest] = (frozenset(nodes), frozenset(blobs))
        return self.memo[digest]

    def of_result(self, result: dict) -> tuple[frozenset[str], frozenset[str]] | None:
        tree = self.of_node(result["output_tree"])
        if tree is None:
            return None
        logs = {d for d in (result.get("stdout"), result.get("stderr")) if isinstance(d, str)}
        return tree[0], tree[1] | logs


def _roots(base: Path) -> set[str]:
    """Tree digests that `bgraph-out` links still point at; stale root records are dropped."""
    live = set()
    roots = base / "roots"
    if not roots.exists():
        return live
    trees = (base / "trees").resolve()
    for record in roots.iterdir():
        try:
            target = Path(os.readlink(os.readlink(record)))
        except OSError:
            record.unlink(missing_ok=True)  # the link is gone or no longer a link
            continue
        if target.parent == trees:
            live.add(target.name)
        else:
            record.unlink(missing_ok=True)
    return live


def _empty_trash(layout_root: Path, held: set[str], unlinked=None) -> None:
    trash = layout_root / "trash"
    if trash.exists():
        for t in trash.iterdir():
            if t.name.rsplit("-", 1)[0] not in held:
                rmtree(t, unlinked)


def collect(layout_root: Path, digester: Digester, max_size: int | None = None) -> CollectReport:
    """Remove what nothing needs; with `max_size` (bytes of blobs), also the least recently
    used action-cache entries until what stays fits."""
    base = layout_root / digester.name
    report = CollectReport()
    started = time.time()
    with _exclusive(layout_root):
        live: LiveBuilds = live_builds(layout_root / "tmp")
        report.running_builds = live.count
        # Whatever a running build created or used since it started is newer than this.
        horizon = min(started, live.oldest_start or started)
        blobs = _scan_blobs(base / "cas")
        nodes = _scan_nodes(base / "dirs")
        entries, manifests = _scan_entries(base / "ac")
        report.bytes_before = sum(b.size for b in blobs.values())
        closure = _Closure(base / "dirs", digester, check=False)
        root_trees = _roots(base)

        def pinned(e: _Entry) -> bool:
            return e.key in live.keys or e.mtime >= horizon

        entries.sort(key=lambda e: (not pinned(e), -e.mtime))
        keep_blobs: set[str] = set()
        keep_nodes: set[str] = set()
        kept_keys: set[str] = set()
        removed_keys: list[str] = []
        total, full = 0, False
        for e in entries:
            need = closure.of_result(e.result) if e.result is not None else None
            if need is None and not pinned(e):
                e.path.unlink(missing_ok=True)  # unreadable or dangling: useless
                report.entries_removed += 1
                removed_keys.append(e.key)
                continue
            need_nodes, need_blobs = need or (frozenset(), frozenset())
            added = sum(blobs[d].size for d in need_blobs - keep_blobs if d in blobs)
            if not pinned(e) and max_size is not None and (full or total + added > max_size):
                full = True  # least recently used from here on: all of it goes
                e.path.unlink(missing_ok=True)
                report.entries_removed += 1
                removed_keys.append(e.key)
                continue
            report.held_by_builds += e.key in live.keys
            kept_keys.add(e.key)
            keep_blobs |= need_blobs
            keep_nodes |= need_nodes
            total += added
        report.entries_kept = len(kept_keys)
        for digest in root_trees:
            rooted = closure.of_node(digest)
            if rooted is not None:
                keep_nodes |= rooted[0]
                keep_blobs |= rooted[1]
        _rewrite_manifests(manifests, kept_keys, layout_root / "tmp")
        _forget_results(base, removed_keys)
        held_trees = live.trees | root_trees
        trees_root = base / "trees"
        with _keeping_stamps(base, blobs, layout_root / "tmp") as unlinked:
            if trees_root.exists():
                for t in trees_root.iterdir():
                    if t.name not in held_trees:
                        rmtree(t, unlinked)
                        report.trees_removed += 1
            _empty_trash(layout_root, live.trees, unlinked)
        keep_blobs |= live.blobs
        for digest, b in blobs.items():
            if digest in keep_blobs or b.ctime >= horizon:
                report.bytes_after += b.size
                continue
            # The trees left are held or rooted: their own hard links keep their bytes.
            for path in b.paths:
                path.unlink(missing_ok=True)
            report.blobs_removed += 1
        for digest, (path, ctime) in nodes.items():
            if digest not in keep_nodes and ctime < horizon:
                path.unlink(missing_ok=True)
                report.nodes_removed += 1
        if report.entries_removed or report.blobs_removed or report.nodes_removed or report.trees_removed:
            # Still under the lock: a build that holds keys after this sees the new generation
            # (a build that reuses targets from its memo checks it then: store/memo.py).
            bump_generation(layout_root)
            _drop_records(layout_root)
    return report


def _drop_records(layout_root: Path) -> None:
    """The no-op records and memos of every workspace (rows of each state file): none holds once
    the generation moved, so they go with what was collected rather than wait for a rebuild."""
    for path in layout_root.glob(f"*/{STATE_FILE}"):
        BuildState(path, create=False).drop_records()


@contextmanager
def _keeping_stamps(base: Path, blobs: dict[str, _Blob], tmp_dir: Path):
    """Removing a tree unlinks hard links of blobs, which moves their ctime, part of the stamp
    that lets a build trust a blob without re-hashing it (cas.verify). Yields the callback the
    removals call with each file's lstat just before its unlink: where it is a blob's and the
    blob's stamp was that, and only its ctime moved since, the new ctime is taken into the stamp
    (else the next build re-hashes the whole store: 33.9 s instead of 3.9 s for the vLLM no-op,
    measured). Only that instant is trusted, never the whole collection: a write into a blob
    (mtime put back) while gc ran was recorded as verified (red team K11)."""
    stamps = JsonTable(base / "verified.json", tmp_dir)
    by_inode = {ino: p for b in blobs.values() for p, ino in zip(b.paths, b.inodes)} if stamps.table else {}

    def unlinked(st: os.stat_result) -> None:
        blob = by_inode.get(st.st_ino)
        if blob is not None:
            restamp_linked(stamps, blob, st)

    yield unlinked
    stamps.save()


def _forget_results(base: Path, keys: list[str]) -> None:
    """Drop the build state's rows of removed entries (a row alone would still be checked blob
    by blob before use; this keeps the state file from outgrowing the cache)."""
    if keys:
        state = BuildState(base / STATE_FILE, create=False)
        state.drop_results(keys)
        state.close()


def _rewrite_manifests(manifests: list[Path], kept_keys: set[str], tmp_dir: Path) -> None:
    for m in manifests:
        try:
            items = json.loads(m.read_text())
        except (OSError, ValueError):
            m.unlink(missing_ok=True)
            continue
        left = [i for i in items if isinstance(i, dict) and i.get("key") in kept_keys] \
            if isinstance(items, list) else []
        if not left:
            m.unlink(missing_ok=True)
        elif len(left) != len(items):
            write_json(m, left, tmp_dir, sort_keys=True)


def verify(layout_root: Path, digester: Digester, repair: bool = False) -> VerifyReport:
    """Re-hash every blob and directory node, and check that every action-cache entry and
    materialized tree is whole. With `repair`, drop what is bad (a corrupt blob takes with it
    only the trees that hold it)."""
    base = layout_root / digester.name
    report = VerifyReport(repaired=repair)
    with _exclusive(layout_root) if repair else nullcontext():
        blobs = _scan_blobs(base / "cas", report.stray)
        for digest, b in sorted(blobs.items()):
            report.blobs_checked += 1
            if any(hash_file(p, digester) != digest for p in b.paths):
                report.corrupt_blobs.append(digest)
                if repair:
                    evict_blob(layout_root, b.paths[0].with_name(b.paths[0].name.removesuffix(".x")))
        nodes = _scan_nodes(base / "dirs", report.stray)
        for digest, (path, _ctime) in sorted(nodes.items()):
            report.nodes_checked += 1
            if hash_file(path, digester) != digest:
                report.corrupt_nodes.append(digest)
                if repair:
                    path.unlink(missing_ok=True)
        bad_blobs = set(report.corrupt_blobs)
        closure = _Closure(base / "dirs", digester, check=True)
        entries, _ = _scan_entries(base / "ac", report.stray)
        for e in entries:
            report.entries_checked += 1
            need = closure.of_result(e.result) if e.result is not None else None
            if need is None or any(d not in blobs or d in bad_blobs for d in need[1]):
                report.dangling_entries.append(e.key)
                if repair:
                    e.path.unlink(missing_ok=True)
        if repair:
            _forget_results(base, report.dangling_entries)
            for path in report.stray:
                rmtree(path)  # a link itself, never what it points at
        good_inodes = {i for d, b in blobs.items() if d not in bad_blobs for i in b.inodes}
        good = {d for d in blobs if d not in bad_blobs}
        # Which blob each copy in a tree was made of (cas._copy_of_blob's stamps, `<digest>@<inode>`).
        copies = {k for k in JsonTable(base / "verified.json", layout_root / "tmp").table if "@" in k}
        trees = _TreeEntries(layout_root.parent, digester)
        trees_root = base / "trees"
        held = live_builds(layout_root / "tmp").trees
        for t in sorted(trees_root.iterdir()) if trees_root.exists() else ():
            report.trees_checked += 1
            if not _tree_is_whole(t, good_inodes, lambda path, ino: _a_copy_of(t, path, ino, good, copies, trees)):
                report.bad_trees.append(t.name)
                if repair:
                    discard_tree(layout_root, t, held)
        state = base / STATE_FILE
        if state.exists() and not _state_is_whole(state):
            report.bad_state.append(str(state))
            if repair:  # its rows are what builds learned (records, memos, traces): the next build learns them again
                for suffix in ("", "-wal", "-shm", "-journal"):
                    Path(f"{state}{suffix}").unlink(missing_ok=True)
        if repair and not report.clean:
            bump_generation(layout_root)  # under the lock, as in collect
    return report


def _state_is_whole(path: Path) -> bool:
    """SQLite's own check of a state file (a damaged one is read as empty by builds, which then
    miss what it held: correct, but every build slow)."""
    import sqlite3

    try:
        con = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)
        try:
            return con.execute("PRAGMA quick_check").fetchone() == ("ok",)
        finally:
            con.close()
    except sqlite3.DatabaseError:
        return False


class _TreeEntries:
    """The file entries of materialized trees, read from their directory nodes on first use."""

    def __init__(self, cache_dir: Path, digester: Digester):
        self.cache_dir, self.digester, self.cas, self.known = cache_dir, digester, None, {}

    def digest_at(self, tree: str, rel: str) -> str | None:
        if tree not in self.known:
            from build_graph.store.cas import CorruptBlob, LocalCas, StoreError
            self.cas = self.cas or LocalCas(self.cache_dir, self.digester)
            try:
                self.known[tree] = {p: e.digest for p, e in self.cas.get_tree(tree).files().items()}
            except (CorruptBlob, StoreError, OSError, ValueError, KeyError):
                self.known[tree] = {}
        return self.known[tree].get(rel)


def _a_copy_of(tree_dir: Path, path: str, ino: int, good: set[str], copies: set[str], trees: _TreeEntries) -> bool:
    """Whether the tree file `path` (inode `ino`) is a sound copy: its bytes a good blob's, the
    very blob the tree lists at that path (red team R11: any good blob's bytes were taken). The
    copy's stamp (cas._copy_of_blob) spares reading the tree's nodes."""
    digest = hash_file(path, trees.digester)
    if digest not in good:
        return False
    return f"{digest[2:]}@{ino}" in copies or trees.digest_at(tree_dir.name, os.path.relpath(path, tree_dir)) == digest


def _tree_is_whole(tree_dir: Path, good_inodes: set[int], a_sound_copy: Callable[[str, int], bool]) -> bool:
    """A materialized tree is whole if it is a directory (not a link) and each of its files is a
    hard link of a blob that hashed good (the blob was just re-hashed; the link shares its
    bytes), or a copy of one (a file of one link, read-only, that the cache made as a copy of a
    good blob where the blob had the file system's most links), and it holds nothing but files,
    links and directories. Walked with a stack."""
    if tree_dir.is_symlink() or not tree_dir.is_dir():
        return False
    pending = [os.fspath(tree_dir)]
    try:
        while pending:
            with os.scandir(pending.pop()) as it:
                for e in it:
                    if e.is_dir(follow_symlinks=False):
                        pending.append(e.path)
                    elif e.is_symlink():
                        continue
                    elif not e.is_file(follow_symlinks=False):
                        return False
                    elif (st := e.stat(follow_symlinks=False)).st_ino not in good_inodes and not (
                            st.st_nlink == 1 and stat.S_IMODE(st.st_mode) in (0o444, 0o555)
                            and a_sound_copy(e.path, st.st_ino)):
                        return False
    except OSError:
        return False
    return True
