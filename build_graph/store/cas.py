"""The local content-addressable store.

On-disk layout (versioned; bump the version instead of migrating)::

    <cache>/v1/<digest-fn>/cas/ab/cdef…        blob, mode 0444, named by its digest
    <cache>/v1/<digest-fn>/cas/ab/cdef….x      the same blob, mode 0555 (for executables)
    <cache>/v1/<digest-fn>/dirs/ab/cdef…       Merkle directory node (canonical JSON)
    <cache>/v1/<digest-fn>/trees/<digest>/     a tree materialized read-only (bind-mounted into sandboxes)
    <cache>/v1/<digest-fn>/ac/ab/<key>.json    action cache (see action_cache.py)
    <cache>/v1/<digest-fn>/state-v2.sqlite     traces, a memo of results, the fast paths' rows (statefile.py)
    <cache>/v1/<digest-fn>/trace/<label>.json  an older cache's traces (read only, see trace.py)
    <cache>/v1/<digest-fn>/roots/<hash>         symlink to a bgraph-out link: its tree is a gc root
    <cache>/v1/tmp/<pid>-xxx/                  a build's staging; written here, then renamed
    <cache>/v1/tmp/<pid>-xxx.{lock,holds}      its lease, and what it holds (see lease.py)
    <cache>/v1/trash/                          evicted trees a running build may still mount

A blob is verified (size and digest) before it is used; a bad one is deleted with a warning
and reported as missing, so the action that made it runs again.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import itertools
import logging
import os
import stat
import tempfile
import threading
import time
from pathlib import Path

import orjson

from build_graph.errors import StoreError
from build_graph.store.atomic import rename_into_shard, stage
from build_graph.store.json_table import JsonTable
from build_graph.incremental import filestate
from build_graph.store.lease import Holds, live_builds, take_if_free
from build_graph.model import DirEntry, Digester, FileEntry, SymlinkEntry, Tree

LAYOUT_VERSION = "v1"
# Every file and directory an action can see carries this mtime (1980-01-01, as
# SOURCE_DATE_EPOCH): tools record mtimes (nvcc's -lineinfo file table does), and a clock
# must never reach an output.
FIXED_MTIME = 315532800
log = logging.getLogger("bgraph.store")
CHUNK = 1 << 20
# An output file over this many bytes, or one that takes an ingest's (one action's) files over
# MAX_OUTPUT_TOTAL, is refused before it is hashed (red-team K14): the hash reads every byte, a
# sparse file's holes too, so `truncate -s 1T` costs the action nothing and bgraph ~47 min per TiB
# here (a remote worker the same, then an upload of the whole size). A fixed bound, not one from
# the cache disk's free space: a sparse file takes no space. 64 GiB hashes in about 3 minutes
# here and keeps real large outputs (a disk image, a model's weights) possible.
MAX_OUTPUT_FILE = 64 << 30
MAX_OUTPUT_TOTAL = 256 << 30


def output_size_problem(rel: str, size: int, before: int) -> str | None:
    """Why output file `rel` of `size` bytes, after `before` bytes of the same action's, is
    refused (one line), or None."""
    if size > MAX_OUTPUT_FILE:
        return (f"output {rel} is {size} bytes, over the {_bound(MAX_OUTPUT_FILE)} an output file may be "
                "(refused before it is hashed: a sparse file's holes are read too)")
    if before + size > MAX_OUTPUT_TOTAL:
        return (f"outputs reach {before + size} bytes with {rel}, over the {_bound(MAX_OUTPUT_TOTAL)} an "
                "action's outputs may be together (refused before it is hashed)")
    return None


def _bound(n: int) -> str:
    return f"{n >> 30} GiB" if n >= 1 << 30 and not n % (1 << 30) else f"{n} bytes"


OUTPUT_SIZE_HINT = "have the action make smaller outputs: split or compress them (a sparse file counts its whole size)"


class CorruptBlob(StoreError):
    """A blob on disk does not match its digest; it has been removed."""


def stat_stamp(st: os.stat_result) -> list:
    """The stamp a blob hashed good is trusted by while it holds (filestate: size, mtime, ctime,
    inode, mode): any write or chmod, through any hard link of it, moves it."""
    return filestate.of(st)


def restamp_linked(stamps: JsonTable, blob: str | os.PathLike, before: os.stat_result) -> None:
    """Making or removing a hard link of a blob moves its ctime, part of its stamp. `before`: the
    blob's stat taken just before this process made or removed one link. Where the stamp
    recorded was the blob's then, and it is still but for ctime, take the new ctime, else the
    next build re-hashes the blob. ctime is also what shows a write whose mtime was put back:
    only the instant between `before` and now is taken on trust, never a whole materialize or
    collection (a write landing in such a window was recorded as verified, red team K11)."""
    name = os.path.basename(blob)
    old = stamps.table.get(name)
    if old is None or old != stat_stamp(before):
        return
    try:
        st = os.stat(blob)
    except FileNotFoundError:
        return
    new = stat_stamp(st)
    if new != old and filestate.same_but_links(old, new):
        stamps.set(name, new)


_read_buffers = threading.local()


def hash_file(path: str | os.PathLike, digester: Digester) -> str:
    """The digest of a file's bytes, read in chunks into this thread's one buffer. Reading into
    a new 1 MiB bytes object per file cost its allocation and page faults (up to 16 µs a file,
    however small); the buffered file layer cost 7 µs: a plan of 100,000 sources is 100,000 reads."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return _hash_fd(fd, digester)
    finally:
        os.close(fd)


def _hash_fd(fd: int, digester: Digester) -> str:
    """hash_file, of an open file read from its current offset."""
    buf = getattr(_read_buffers, "buf", None)
    if buf is None:
        buf = _read_buffers.buf = bytearray(CHUNK)
    view = memoryview(buf)
    h = digester.new()
    while n := os.readv(fd, (buf,)):
        h.update(view[:n])
    return h.hexdigest()


FS_IOC_GETFLAGS = 0x80086601  # _IOR('f', 1, long): chattr's inode flags


def inode_marks(fd: int) -> tuple[bytes, list]:
    """What an inode carries besides its bytes, mode, owner and times: its inode flags (chattr's;
    an owner may set several without a capability) and its extended attributes, names and
    values (user.*, a POSIX ACL)."""
    try:
        flags = fcntl.ioctl(fd, FS_IOC_GETFLAGS, b"\0" * 8)
    except OSError:  # a file system without inode flags: none can be set either
        flags = b""
    marks = []
    for name in sorted(os.listxattr(fd)):
        try:
            marks.append((name, os.getxattr(fd, name)))
        except OSError:  # removed meanwhile, or not readable: still a mark
            marks.append((name, None))
    return flags, marks


def _copy_name(entry: FileEntry, st: os.stat_result) -> str:
    """The stamp table's name of a tree's copy of a blob (not a link of it): by its inode."""
    return f"{entry.digest[2:]}@{st.st_ino}"


def copy_sparse(src: int, dst: int) -> None:
    """Copy open file `src` into the empty open file `dst`, its holes left holes: only the data
    regions (SEEK_DATA / SEEK_HOLE) are copied, in the kernel where it can (copy_file_range). A
    sparse file an action claims to be a terabyte costs no disk here."""
    size = os.fstat(src).st_size
    pos = 0
    while pos < size:
        try:
            start = os.lseek(src, pos, os.SEEK_DATA)
        except OSError as e:
            if e.errno == errno.ENXIO:  # nothing but a hole up to the end
                break
            raise
        end = os.lseek(src, start, os.SEEK_HOLE)
        while start < end:
            n = _copy_range(src, dst, start, min(end - start, 1 << 30))
            if n == 0:  # the file shrank meanwhile
                end = start
                break
            start += n
        pos = end
    os.ftruncate(dst, size)


def _copy_range(src: int, dst: int, offset: int, count: int) -> int:
    """Copy up to `count` bytes at `offset` of `src` to the same offset of `dst`; bytes copied."""
    try:
        return os.copy_file_range(src, dst, count, offset, offset)
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
            raise
    data = os.pread(src, min(count, CHUNK), offset)
    written = 0
    while written < len(data):
        written += os.pwrite(dst, data[written:], offset + written)
    return len(data)


# The most directory levels an output tree may nest: deeper ones are refused when stored (paths
# near PATH_MAX, and tree code that recurses per level, could not hold them; none is legitimate).
MAX_DEPTH = 256
MAX_PATH = 3000  # characters of an output's path in its tree: a cache path and a mount go in front

# A tree this large, once materialized, is checked through that copy (LocalCas.damaged).
_CHECK_THROUGH_COPY = 256


def _shard(root: Path, digest: str) -> Path:
    return root / digest[:2] / digest[2:]


def _node_name(name: str, node: str) -> str:
    """One name of a directory node, refused if it could leave the tree (a node pulled from a
    remote is checked against its digest, not for what it names)."""
    if not name or name in (".", "..") or "/" in name or "\0" in name:
        raise CorruptBlob(f"directory node {node[:16]} names {name!r}; refused")
    return name


def rmtree(path: str | os.PathLike, unlinked=None) -> None:
    """Remove a file, link or directory tree, whatever an action left in it: read-only or
    unreadable directories (made u+rwx to be emptied), FIFOs and sockets (unlinked, never
    opened), links (removed, never followed), and trees deeper than a path can name or Python
    can recurse (walked with an explicit stack and one directory descriptor at a time). A path
    that does not exist is nothing to do. `unlinked`: called with each regular file's lstat
    taken just before its unlink (the store keeps its blobs' stamps through it)."""
    path = os.fspath(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        _in_parent(os.unlink, path)
        return
    fd = enter_dir(path)
    # The directories from `path` down to the one open (`fd`): its name in its parent, its
    # (device, inode), and the subdirectories of it left to remove.
    frames = [("", _identity(fd), _clear(fd, unlinked))]
    try:
        while True:
            _name, _ident, pending = frames[-1]
            if pending:
                name = pending.pop()
                sub = enter_dir(name, fd)
                os.close(fd)
                fd = sub
                frames.append((name, _identity(fd), _clear(fd, unlinked)))
                continue
            name = frames.pop()[0]
            if not frames:
                break
            # Back up through "..", checked to be the directory we came down from: only two
            # descriptors are ever open, however deep the tree.
            up = os.open("..", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = up
            if _identity(fd) != frames[-1][1]:
                raise OSError(errno.ESTALE, "a directory was moved while it was being removed", path)
            try:
                os.rmdir(name, dir_fd=fd)
            except FileNotFoundError:
                pass
    finally:
        os.close(fd)
    _in_parent(os.rmdir, path)


def _identity(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def enter_dir(name: str | os.PathLike, dir_fd: int | None = None) -> int:
    """A descriptor of directory `name` (in `dir_fd`), opened never through a link and made
    u+rwx first where it is not (an action may leave 0000 or 0555 directories): its entries are
    to be listed, made or removed. Its other mode bits are kept."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
    except PermissionError:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if not stat.S_ISDIR(st.st_mode):
            raise
        # A directory a moment ago: O_NOFOLLOW below checks again.
        os.chmod(name, stat.S_IMODE(st.st_mode) | 0o700, dir_fd=dir_fd)
        fd = os.open(name, flags, dir_fd=dir_fd)
    try:
        st = os.fstat(fd)
        if st.st_mode & 0o700 != 0o700:
            os.fchmod(fd, stat.S_IMODE(st.st_mode) | 0o700)
    except OSError:
        os.close(fd)
        raise
    return fd


def _clear(fd: int, unlinked=None) -> list[str]:
    """Unlink every entry of the open directory that is not a directory (a file, link, FIFO or
    socket: none is opened or followed); returns the names of its subdirectories. `unlinked`:
    called with each regular file's lstat taken just before its unlink, once it is gone."""
    subdirs = []
    with os.scandir(fd) as it:
        for e in it:
            if e.is_dir(follow_symlinks=False):
                subdirs.append(e.name)
            else:
                try:
                    st = os.lstat(e.name, dir_fd=fd) if unlinked is not None else None
                    os.unlink(e.name, dir_fd=fd)
                except FileNotFoundError:
                    continue
                if st is not None and stat.S_ISREG(st.st_mode):
                    unlinked(st)
    return subdirs


def _in_parent(remove, path: str) -> None:
    """unlink or rmdir `path`, making its parent u+rwx first if it refuses (an action may leave
    its output directory, or a directory in it, read-only)."""
    try:
        remove(path)
    except FileNotFoundError:
        pass
    except PermissionError:
        parent = os.path.dirname(path) or "."
        os.chmod(parent, stat.S_IMODE(os.stat(parent).st_mode) | 0o700)
        remove(path)


def trees_holding(trees_root: Path, inodes: set[int]) -> list[Path]:
    """The materialized trees that hard-link any of `inodes` (readdir gives inode numbers
    without a stat per file)."""
    found = []
    for top in os.scandir(trees_root):
        if not top.is_dir(follow_symlinks=False):
            continue
        stack = [top.path]
        while stack:
            hit = False
            with os.scandir(stack.pop()) as it:
                for e in it:
                    if e.is_dir(follow_symlinks=False):
                        stack.append(e.path)
                    elif e.inode() in inodes:
                        hit = True
                        break
            if hit:
                found.append(Path(top.path))
                break
    return found


def discard_tree(layout_root: Path, tree_dir: Path, held: set[str]) -> None:
    """Remove a materialized tree; one a running build holds (a sandbox may have it mounted)
    is renamed into `v1/trash/` instead, and removed by a later collection."""
    if tree_dir.name in held:
        trash = layout_root / "trash"
        trash.mkdir(exist_ok=True)
        try:
            os.rename(tree_dir, trash / f"{tree_dir.name}-{os.urandom(4).hex()}")
        except FileNotFoundError:
            pass
        return
    rmtree(tree_dir)


def evict_blob(layout_root: Path, blob: Path) -> list[Path]:
    """Delete a blob (and its executable copy) and the trees that hold it; returns those trees."""
    inodes = set()
    for p in (blob, Path(f"{blob}.x")):
        try:
            st = p.lstat()
        except FileNotFoundError:
            continue
        if st.st_nlink > 1:
            inodes.add(st.st_ino)
        p.unlink(missing_ok=True)
    trees_root = blob.parents[2] / "trees"
    if not inodes or not trees_root.exists():
        return []
    held = live_builds(layout_root / "tmp").trees
    found = trees_holding(trees_root, inodes)
    for t in found:
        discard_tree(layout_root, t, held)
    return found


def _remove_lease(stem: Path, fd: int) -> None:
    """Remove a lease whose lock `fd` we hold: the lock file first (a build that opened it but
    had not locked it yet sees the link count drop to 0 and takes another name), then its
    staging and holds."""
    Path(f"{stem}.lock").unlink(missing_ok=True)
    rmtree(stem)
    Path(f"{stem}.holds").unlink(missing_ok=True)
    os.close(fd)


def _drop_staging(path: Path, fd: int) -> None:
    if fd not in LocalCas._leases:
        return  # closed already
    LocalCas._leases.remove(fd)
    _remove_lease(path, fd)


class LocalCas:
    """Blobs and Merkle directories by digest, with atomic writes and verified reads."""

    def __init__(self, cache_dir: Path, digester: Digester):
        self.digester = digester
        self.layout_root = Path(cache_dir) / LAYOUT_VERSION
        self.base = self.layout_root / digester.name
        self.blobs = self.base / "cas"
        self._blobs_dir = os.fspath(self.blobs)
        self.dirs = self.base / "dirs"
        self._dirs_dir = os.fspath(self.dirs)
        self.trees = self.base / "trees"
        staging = Path(cache_dir) / LAYOUT_VERSION / "tmp"
        for d in (self.blobs, self.dirs, self.trees, staging):
            d.mkdir(parents=True, exist_ok=True)
        self.tmp, self._lease_fd = self._lease_staging(staging)
        self._tmp_dir = os.fspath(self.tmp)
        self._tmp_names = itertools.count()  # names in our own staging (see _staged)
        self.holds = Holds(self.tmp, self.layout_root)
        self._verified: set[str] = set()
        self._intact: set[str] = set()  # materialized trees checked whole by this process
        # One lock per tree digest: two lanes finding one damaged tree must not both remake it
        # (one would remove the directory the other is filling or mounting).
        self._tree_locks: dict[str, threading.Lock] = {}
        self._tree_locks_lock = threading.Lock()
        self._source_of: dict[str, str] = {}  # digest -> workspace path of a source stored by this process
        # Blob name -> stat stamp of the copy last hashed good (see verify).
        self._stamps = JsonTable(self.base / "verified.json", self.tmp)
        self._stored_trees: set[str] = set()  # root digests whose nodes this process has written
        self._exec_lock = threading.Lock()
        # Held from a stamp's stat to its record: two lanes linking or touching one blob (the
        # empty one, every action's stdout) must not record the older ctime last.
        self._stamp_lock = threading.Lock()
        self._refreshed: set[str] = set()
        # Workspace path -> stat stamp and digest (see put_source).
        self._sources = JsonTable(self.base / "sources.json", self.tmp)
        self._unstored: dict[str, str] = {}  # digest -> workspace path of a source hashed, not stored
        self._fresh: tuple[bytes, list] | None = None  # see _fresh_marks

    def close(self) -> None:
        """Give up this process's lease and staging now (else at exit)."""
        self.holds.close()
        _drop_staging(self.tmp, self._lease_fd)

    @staticmethod
    def _lease_staging(staging: Path) -> tuple[Path, int]:
        """This process's own staging directory, held by a lock for its lifetime (a lease).
        Staging that a killed or failed build left behind (its lock is free) is removed now;
        a running build's is never touched."""
        for lock in staging.glob("*.lock"):
            fd = take_if_free(lock)
            if fd is not None:  # else a live build holds it (or it is gone)
                _remove_lease(Path(str(lock)[: -len(".lock")]), fd)
        while True:
            stem = staging / f"{os.getpid()}-{os.urandom(4).hex()}"
            try:
                fd = os.open(f"{stem}.lock", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                continue
            fcntl.flock(fd, fcntl.LOCK_EX)  # released when this process exits, however it exits
            if os.fstat(fd).st_nlink:
                break
            os.close(fd)  # a cleaner took it for dead between create and lock: pick another
        stem.mkdir()
        LocalCas._leases.append(fd)
        atexit.register(_drop_staging, stem, fd)
        return stem, fd

    _leases: list[int] = []

    # -- blobs -------------------------------------------------------------------------
    def blob_path(self, digest: str) -> Path:
        return _shard(self.blobs, digest)

    def _blob_str(self, digest: str) -> str:
        """blob_path as a string, for the per-source hot paths (no pathlib objects)."""
        return f"{self._blobs_dir}/{digest[:2]}/{digest[2:]}"

    def _install(self, tmp_path: str, digest: str, size: int) -> None:
        # An existing copy is trusted only once verified: a corrupted one is evicted and
        # replaced by these (known good) bytes, so it can never reach an action's inputs.
        if self.verify(FileEntry(digest, size)):
            os.unlink(tmp_path)
            self._refresh(digest)
            return
        os.chmod(tmp_path, 0o444)
        os.utime(tmp_path, (FIXED_MTIME, FIXED_MTIME))
        dest = self._blob_str(digest)
        rename_into_shard(tmp_path, dest)
        self._verified.add(digest)
        self._stamp_written(dest)

    def _stamp_written(self, path: str) -> None:
        """Record the stamp of a blob this process just wrote from bytes it hashed: the next
        build trusts it as if it had hashed it (else the first build after a fetch re-hashed
        the whole toolchain it had just stored, 0.45 s before nvcc's first step)."""
        try:
            with self._stamp_lock:
                self._stamps.set(os.path.basename(path), stat_stamp(os.stat(path)))
        except FileNotFoundError:  # collected at once by a concurrent gc: nothing to trust
            pass

    def _staged(self, data: bytes) -> str:
        """A new file holding `data` in this process's staging directory (leased, so a counter
        names it)."""
        return stage(self._tmp_dir, "b", self._tmp_names, data)

    def put_bytes(self, data: bytes, executable: bool = False) -> FileEntry:
        digest = self.digester.of(data)
        if not self.verify(FileEntry(digest, len(data))):
            self._install(self._staged(data), digest, len(data))
        else:
            self._refresh(digest)
        return FileEntry(digest, len(data), executable)

    def put_stream(self, src, executable: bool = False) -> FileEntry:
        """Store what a file object reads (an archive member), a chunk at a time: a member of
        half a gigabyte (torch's and CUDA's libraries) is never held in memory whole."""
        first = src.read(CHUNK)
        second = src.read(CHUNK) if first else b""
        if not second:  # a small member (most are): hashed first, written only if new
            return self.put_bytes(first, executable)
        fd, tmp = tempfile.mkstemp(dir=self.tmp)
        h, size = self.digester.new(), 0
        try:
            with os.fdopen(fd, "wb") as dst:
                chunk = first
                while chunk:
                    h.update(chunk)
                    dst.write(chunk)
                    size += len(chunk)
                    chunk, second = second, (src.read(CHUNK) if second else b"")
        except BaseException:
            os.unlink(tmp)
            raise
        digest = h.hexdigest()
        self._install(tmp, digest, size)
        return FileEntry(digest, size, executable)

    def _refresh(self, digest: str) -> None:
        """Mark a blob this build stored again (its bytes were present) as in use: its ctime
        becomes newer than this build's lease, and a collection keeps what is newer."""
        if digest in self._refreshed:
            return
        p = self.blob_path(digest)
        with self._stamp_lock:
            try:
                os.utime(p, (FIXED_MTIME, FIXED_MTIME))  # same times; the kernel moves ctime
                st = p.stat()
            except FileNotFoundError:
                return
            if p.name in self._stamps.table:  # it was verified a moment ago; keep that
                self._stamps.set(p.name, stat_stamp(st))
            self._refreshed.add(digest)

    def put_file(self, path: str | os.PathLike, executable: bool | None = None, move: bool = False) -> FileEntry:
        """Store a file's bytes. With move=True the file (in our staging area) is renamed in."""
        path = os.fspath(path)
        return self._put_file(path, os.lstat(path), executable, move)

    def _put_file(self, path: str, st: os.stat_result, executable: bool | None, move: bool) -> FileEntry:
        """put_file, given the file's lstat."""
        if executable is None:
            executable = bool(st.st_mode & stat.S_IXUSR)
        if move:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            try:
                if inode_marks(fd) != self._fresh_marks():
                    # An xattr, ACL or inode flag the action set would reach every tree and action
                    # that shares this blob: a blob carries bytes and mode only, so its bytes go
                    # into a fresh file instead.
                    return self._put_copy(fd, executable)
                digest = _hash_fd(fd, self.digester)
            finally:
                os.close(fd)
            self._install(path, digest, st.st_size)
            return FileEntry(digest, st.st_size, executable)
        if st.st_size <= CHUNK:  # small files (most sources): hash first, copy only if new
            with open(path, "rb") as src:
                data = src.read()
            if len(data) == st.st_size:
                return self.put_bytes(data, executable)
        fd, tmp = tempfile.mkstemp(dir=self.tmp)
        size = 0
        h = self.digester.new()  # hashed while copied: a big file is read once
        with open(path, "rb") as src, os.fdopen(fd, "wb") as dst:
            while chunk := src.read(CHUNK):
                h.update(chunk)
                dst.write(chunk)
                size += len(chunk)
        digest = h.hexdigest()
        self._install(tmp, digest, size)
        return FileEntry(digest, size, executable)

    def _fresh_marks(self) -> tuple[bytes, list]:
        """inode_marks of a file newly made in this process's staging (a file system may give
        every file some, an SELinux label or the extents flag): an output that carries just
        these is moved in as it is."""
        if self._fresh is None:
            path = self._staged(b"")
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                self._fresh = inode_marks(fd)
            finally:
                os.close(fd)
                os.unlink(path)
        return self._fresh

    def _put_copy(self, src: int, executable: bool) -> FileEntry:
        """Store the bytes of open file `src` through a fresh file (holes kept holes), hashed as
        written there."""
        fd, tmp = tempfile.mkstemp(dir=self.tmp)
        try:
            try:
                copy_sparse(src, fd)
                os.lseek(fd, 0, os.SEEK_SET)
                digest = _hash_fd(fd, self.digester)
                size = os.fstat(fd).st_size
            finally:
                os.close(fd)
            self._install(tmp, digest, size)
        except BaseException:
            if os.path.lexists(tmp):
                os.unlink(tmp)
            raise
        return FileEntry(digest, size, executable)

    # -- workspace sources: digests remembered by stat stamp (like git's index) -----------
    def put_source(self, path: Path | str) -> FileEntry:
        """Store a workspace file, skipping the read and hash when its stat stamp (size, mtime,
        ctime, inode, mode) is the one recorded with its digest. Whether that blob is still
        stored is for the caller to check (store_sources does, once it holds them)."""
        return self._source(os.fspath(path), store=True)

    def _source(self, key: str, store: bool) -> FileEntry:
        """A workspace file's entry, from its stamp or by reading it (and storing it, with `store`)."""
        # A link is read through: its stamp, size and mode are its target's (os.stat), on the
        # first build as on later ones (the link's own mode, 0777, made a first build's entry
        # executable and the next one's not, so the keys changed between them).
        lst = os.lstat(key)
        link = stat.S_ISLNK(lst.st_mode)
        # Settled (filestate.settle): a recent file's pages a mapping dirtied are written back
        # first, so bytes stored through it since then move the stamp.
        st = filestate.settle(key, os.stat(key) if link else lst)
        stamp = filestate.of(st, os.readlink(key) if link else "")
        known = self._sources.table.get(key)
        if known and known[:6] == stamp:
            if store:
                self._source_of[known[6]] = key
            return FileEntry(known[6], st.st_size, bool(st.st_mode & stat.S_IXUSR))
        try:
            entry = (self._put_file(key, st, None, False) if store else
                     FileEntry(hash_file(key, self.digester), st.st_size, bool(st.st_mode & stat.S_IXUSR)))
        except OSError as e:  # name the source: a read error from the hasher carries no file name
            if e.filename is None and e.errno != errno.ENOSPC:
                e.filename = key
            raise
        if not filestate.racy(stamp, time.time_ns()):  # a racily clean stamp proves nothing yet
            self._sources.set(key, [*stamp, entry.digest])
        if store:
            self._source_of[entry.digest] = key
        return entry

    def hash_sources(self, root: Path, paths) -> Tree:
        """store_sources for a build that runs nothing (--dry-run): the same entries, from the
        stamps or by hashing, with no blob written; a source a rule reads while it plans is
        stored by that read (read_bytes)."""
        base = os.fspath(root)
        entries = {}
        for p in paths:
            key = os.path.join(base, p)
            entries[p] = entry = self._source(key, store=False)
            self._unstored[entry.digest] = key
        return Tree(entries)

    def store_sources(self, root: Path, paths) -> Tree:
        """The workspace files `paths` (relative to `root`) as a tree, their blobs stored and
        held by this build (so a collection keeps them) before they are checked present."""
        base = os.fspath(root)  # string joins: pathlib's were a third of a 10,000-source no-op's time here
        tree = Tree({p: self.put_source(os.path.join(base, p)) for p in paths})
        self.holds.hold_many("blob", (f.digest for f in tree.entries.values()))
        gone = [p for p, f in tree.entries.items() if not self.has(f)]
        if gone:  # collected since its stamp was recorded: forget the stamp, store it again
            for p in gone:
                self._sources.discard(os.fspath(root / p))
            tree = Tree({**tree.entries, **{p: self.put_source(root / p) for p in gone}})
        return tree

    def has(self, entry: FileEntry) -> bool:
        d = entry.digest
        try:
            return os.stat(self._blob_str(d)).st_size == entry.size
        except FileNotFoundError:
            return False

    def save_stamps(self) -> None:
        """Persist what this process learned: blobs hashed good and sources digested, each
        keyed by its stat stamp."""
        self._stamps.save()
        self._sources.save()

    def verify(self, entry: FileEntry) -> bool:
        """True if the blob is present and hashes to its digest; a bad blob is removed.
        For an executable entry, its executable copy (`.x`, which materialized trees link to)
        is checked too.
        A blob hashed good before is trusted while its stat stamp (size, mtime, ctime, inode)
        is unchanged: any write to it moves ctime, so corruption is still caught before use."""
        d = entry.digest
        seen = d + ".x" if entry.executable else d
        if seen in self._verified:
            return True
        # Plain strings and os.stat: a no-op build of vLLM checks 40,000 blobs here.
        p = self._blob_str(d)
        try:
            copies = [(p, d[2:], os.stat(p))]
            if entry.executable:  # materialized trees link an executable file to this copy
                try:
                    copies.append((p + ".x", d[2:] + ".x", os.stat(p + ".x")))
                except FileNotFoundError:
                    pass
            for copy, name, st in copies:
                if st.st_size != entry.size:
                    raise CorruptBlob("size mismatch")
                stamp = stat_stamp(st)
                if self._stamps.table.get(name) == stamp:
                    continue
                if hash_file(copy, self.digester) != entry.digest:
                    raise CorruptBlob("digest mismatch")
                mode = 0o555 if copy.endswith(".x") else 0o444
                if stat.S_IMODE(st.st_mode) != mode:
                    # A chmod through a linked output (hard links share the mode): the bytes were
                    # just hashed sound, so the mode every tree linking this inode shows is put back.
                    log.warning("cache blob %s had its mode changed; put back", entry.digest[:16])
                    os.chmod(copy, mode)
                    stamp = stat_stamp(os.stat(copy))
                self._keep_stamp(name, copy, stamp)
        except FileNotFoundError:
            return self._restore_source(entry)
        except CorruptBlob as e:
            log.warning("cache blob %s is corrupted (%s); removed, it will be rebuilt or refetched",
                        entry.digest[:16], e.message)
            self.evict(entry.digest)
            return self._restore_source(entry)
        self._verified.add(seen)
        return True

    def _restore_source(self, entry: FileEntry) -> bool:
        """A missing or evicted blob that is also a workspace source this build stored is stored
        again from the workspace, where the file still has those bytes (else False: the action
        that made it runs again, or the build says the blob is gone)."""
        try:
            return self._store_source_again(self._source_of, entry)
        except OSError:
            return False

    def evict(self, digest: str) -> None:
        """Drop a bad blob, and the materialized trees that hold it (they hard-link it)."""
        from build_graph.store.uptodate import bump_generation
        for tree in evict_blob(self.layout_root, self.blob_path(digest)):
            self._intact.discard(tree.name)  # removed (or set aside): materialize makes it again
        bump_generation(self.layout_root)  # the cache lost something: no record or memo of it holds
        self._verified.discard(digest)
        self._verified.discard(digest + ".x")
        self._refreshed.discard(digest)
        for suffix in ("", ".x"):
            self._stamps.discard(digest[2:] + suffix)

    def read_bytes(self, entry: FileEntry) -> bytes:
        if not self.verify(entry) and not self._store_hashed(entry):
            raise CorruptBlob(f"blob {entry.digest[:16]} is missing or corrupted")
        return self.blob_path(entry.digest).read_bytes()

    def _store_hashed(self, entry: FileEntry) -> bool:
        """Store a source hash_sources hashed without storing, if it still has that content."""
        return self._store_source_again(self._unstored, entry)

    def _store_source_again(self, paths: dict[str, str], entry: FileEntry) -> bool:
        """Store the workspace file `paths` names for the entry's digest (its stamp forgotten, so
        it is read), if it still has that content."""
        key = paths.pop(entry.digest, None)
        if key is None:
            return False
        self._sources.discard(key)
        return self.put_source(key).digest == entry.digest and self.verify(entry)

    def stamped_good(self, stamps) -> bool:
        """Whether every regular file among `stamps` (of materialized files: a hard link's stat
        is its blob's) has the stamp its blob was last hashed good under. A link's stamp (the
        file it leads to, with the link's text) is not a blob's: the file it leads to inside the
        output is checked as its own entry (comparing the link's stamp too, texts and all, failed
        every output holding a link, `lib.so -> lib.so.1`, so such builds never recorded)."""
        with self._stamp_lock:
            good = {tuple(s) for s in self._stamps.table.values()}
        return all(tuple(s) in good for s in stamps if s is not None and stat.S_ISREG(s[4]) and not s[5])

    def verify_tree(self, tree: Tree) -> list[str]:
        """Paths in `tree` whose blobs are missing or corrupted (bad ones are removed)."""
        return [p for p, e in tree.files().items() if not self.verify(e)]

    def damaged(self, tree: Tree) -> list[str]:
        """verify_tree, through the tree's materialized copy where one exists: its intact check
        proves every blob it links (one lstat each) and spares the later materialize its own pass
        over the same inodes (a toolchain of 10,000 files was checked twice per build)."""
        if len(tree.entries) >= _CHECK_THROUGH_COPY:
            digest = tree.digest(self.digester)
            dest = self.trees / digest
            self.holds.hold("tree", digest)  # as materialize does: a collection now keeps it
            if digest in self._intact:
                return []
            if dest.is_dir():
                with self._tree_lock(digest):
                    if digest in self._intact or self._is_intact(tree, dest):
                        self._intact.add(digest)
                        return []
        return self.verify_tree(tree)

    # -- trees -------------------------------------------------------------------------
    def put_tree(self, tree: Tree) -> str:
        """Store the tree's Merkle directory nodes; return the root digest."""
        root = tree.digest(self.digester)
        if root in self._stored_trees:
            return root
        for digest, encoded in tree.directory_nodes(self.digester).values():
            self.put_node(digest, encoded)
        self._stored_trees.add(root)
        return root

    def node_bytes(self, digest: str) -> bytes | None:
        """A directory node's stored bytes, if present and sound (a bad one is removed)."""
        p = _shard(self.dirs, digest)
        try:
            raw = p.read_bytes()
        except FileNotFoundError:
            return None
        if self.digester.of(raw) != digest:
            p.unlink(missing_ok=True)
            return None
        return raw

    def put_node(self, digest: str, raw: bytes) -> None:
        """Store a directory node (the caller made it, or checked its digest)."""
        dest = f"{self._dirs_dir}/{digest[:2]}/{digest[2:]}"
        if os.path.exists(dest):
            return
        rename_into_shard(self._staged(raw), dest)

    def has_digest(self, digest: str) -> bool:
        """Whether a sound blob with this digest is stored (its size taken from disk)."""
        try:
            size = self.blob_path(digest).stat().st_size
        except FileNotFoundError:
            return False
        return self.verify(FileEntry(digest, size))

    def get_tree(self, digest: str) -> Tree:
        """The tree stored under `digest`, every node re-hashed as it is read."""
        entries: dict[str, object] = {}
        dirs = str(self.dirs)

        def walk(d: str, prefix: str) -> None:
            p = f"{dirs}/{d[:2]}/{d[2:]}"
            try:
                with open(p, "rb") as f:
                    raw = f.read()
            except FileNotFoundError:
                raise StoreError(f"directory node {d[:16]} is missing from the store") from None
            if self.digester.of(raw) != d:
                os.unlink(p)
                raise CorruptBlob(f"directory node {d[:16]} is corrupted; removed")
            try:
                node = orjson.loads(raw)
                files, links, subdirs = node["files"], node["symlinks"], node["dirs"]
                names = [n for n, *_ in files] + [n for n, _ in links] + [n for n, _ in subdirs]
                if len(set(names)) != len(names):
                    raise ValueError("a name listed twice")
                for name, fd, size, ex in files:
                    if not (isinstance(fd, str) and isinstance(size, int) and size >= 0 and isinstance(ex, bool)):
                        raise ValueError("a file entry of another shape")
                    entries[prefix + _node_name(name, d)] = FileEntry(fd, size, ex)
                for name, target in links:
                    if not isinstance(target, str) or not target or "\0" in target:
                        raise ValueError(f"a link target {target!r}")
                    entries[prefix + _node_name(name, d)] = SymlinkEntry(target)
            except (ValueError, KeyError, TypeError) as e:  # another shape (a remote's, a damaged one)
                raise CorruptBlob(f"directory node {d[:16]} is not one bgraph writes ({e})") from None
            for name, sub in subdirs:
                before = len(entries)
                walk(sub, prefix + _node_name(name, d) + "/")
                if len(entries) == before:
                    entries[prefix + name] = DirEntry()

        walk(digest, "")
        # Every path is made of checked names: no need to normalise each again.
        return Tree.from_checked(entries).know_digest(self.digester, digest)

    def _exec_blob(self, entry: FileEntry) -> Path:
        """The blob's executable copy (a separate inode: hard links share the mode)."""
        x = Path(str(self.blob_path(entry.digest)) + ".x")
        with self._exec_lock:  # sandboxes materialize in parallel; make each copy once
            if not x.exists():
                fd, tmp = tempfile.mkstemp(dir=self.tmp)
                try:
                    src = os.open(self.blob_path(entry.digest), os.O_RDONLY | os.O_CLOEXEC)
                    try:
                        copy_sparse(src, fd)  # a sparse blob's copy stays sparse
                    finally:
                        os.close(src)
                finally:
                    os.close(fd)
                os.chmod(tmp, 0o555)
                os.utime(tmp, (FIXED_MTIME, FIXED_MTIME))
                try:
                    # Made only where missing: another process sharing the cache (a second build,
                    # a second worker) may have made it first, and replacing it would give the
                    # trees linked to its inode another one, which makes them look changed to it.
                    os.link(tmp, x)
                    made = True
                except FileExistsError:
                    made = False
                finally:
                    os.unlink(tmp)
                if made:  # stamped once its temporary name is gone (that unlink moves its ctime)
                    self._stamp_written(str(x))  # a copy of a blob verified just before (materialize)
        return x

    def materialize(self, tree: Tree) -> Path:
        """A read-only directory holding `tree`, built once per tree digest and reused."""
        digest = tree.digest(self.digester)
        self.holds.hold("tree", digest)  # before looking: a collection now keeps it
        dest = self.trees / digest
        if digest in self._intact:
            return dest
        with self._tree_lock(digest):
            return self._materialize(tree, digest, dest)

    def _tree_lock(self, digest: str) -> threading.Lock:
        """The lock of one tree digest: two lanes finding one damaged tree must not both remake it."""
        with self._tree_locks_lock:
            return self._tree_locks.setdefault(digest, threading.Lock())

    def _materialize(self, tree: Tree, digest: str, dest: Path) -> Path:
        if dest.exists():
            if digest in self._intact or self._is_intact(tree, dest):
                self._intact.add(digest)
                return dest
            # Changed in place (root can write below a read-only tree): made again, never used.
            log.warning("materialized tree %s was changed; made again", digest[:16])
            stale = True
        else:
            stale = False
        bad = self.verify_tree(tree)
        if bad:
            raise CorruptBlob(f"cannot materialize: {len(bad)} blob(s) missing or corrupted, e.g. {bad[0]}")
        for path in tree.entries:
            if path.startswith("/") or "/../" in f"/{path}/" or "/./" in f"/{path}/":
                raise StoreError(f"cannot materialize: {path!r} is not a path inside the tree")
            # Never create anything through a symlink (or below a file): it could land outside.
            parent = path.rpartition("/")[0]
            while parent:
                if not isinstance(tree.entries.get(parent, DirEntry()), DirEntry):
                    raise StoreError(f"cannot materialize: {path!r} lies below non-directory {parent!r}")
                parent = parent.rpartition("/")[0]
        staging = Path(tempfile.mkdtemp(dir=self.tmp, prefix="tree-"))
        linked: dict[tuple[int, int], Path] = {}  # (device, inode) -> the blob
        copied = False
        try:
            for path, entry in tree.entries.items():
                target = staging / path
                target.parent.mkdir(parents=True, exist_ok=True)
                if isinstance(entry, FileEntry):
                    source = self._exec_blob(entry) if entry.executable else self.blob_path(entry.digest)
                    before = os.stat(source)
                    try:
                        os.link(source, target)
                    except OSError as e:
                        if e.errno != errno.EMLINK:
                            raise
                        # The blob has the file system's most links (ext4: 65,000), which other
                        # targets' trees can reach (red team R10: two genrules of 32,500 empty
                        # files each stopped every tree holding an empty file): a copy of it.
                        self._copy_of_blob(entry, source, target)
                        copied = True
                        continue
                    self._restamp(source, before)
                    linked[before.st_dev, before.st_ino] = source
                elif isinstance(entry, SymlinkEntry):
                    os.symlink(entry.target, target)
                    # Its own times too, or an action that archives or lists the tree would see when
                    # this cache made it (R6 symlink_mtime); never through the link.
                    os.utime(target, (FIXED_MTIME, FIXED_MTIME), follow_symlinks=False)
                else:
                    target.mkdir(exist_ok=True)
            for d, _dirs, _files in os.walk(staging, topdown=False):
                os.chmod(d, 0o555)
                os.utime(d, (FIXED_MTIME, FIXED_MTIME))
            aside = None
            if stale:
                # Moved aside only once the new tree is ready, so that the path is missing for the
                # least time (another process's sandbox may be about to mount it), then removed
                # (its links of the blobs go now, before any record stamps them).
                aside = Path(tempfile.mkdtemp(dir=self.tmp, prefix="stale-tree-"))
                with contextlib.suppress(FileNotFoundError):
                    os.rename(dest, aside / digest)
            try:
                os.rename(staging, dest)
            except OSError:
                if not dest.exists():
                    raise
                rmtree(staging)
            finally:
                if aside is not None:
                    # The stale tree's links of the same blobs go too: their stamps kept the same way.
                    rmtree(aside, lambda st: (blob := linked.get((st.st_dev, st.st_ino))) is not None
                           and self._restamp(blob, st))
        except BaseException:
            rmtree(staging)
            raise
        if copied:  # a copy's stamp is how `cache verify` knows it: kept now, not at the build's end
            with self._stamp_lock:
                self._stamps.save()
        self._intact.add(digest)
        return dest

    def _is_intact(self, tree: Tree, dest: Path) -> bool:
        """Whether a materialized tree is still `tree`: every file the blob's own inode, sound, with
        its mode, every link and directory as listed, and nothing more (a file replaced, added or
        removed below it, or a blob written through a link of it, is found here; bgraph-out/
        links such trees). One pass over the directories (scandir's entry types are free; a file
        costs one lstat): what is found must each be an entry of the tree or a directory the tree
        implies, which is never empty, and as many entries must be found as the tree has."""
        entries = tree.entries
        stamps = self._stamps.table
        matched = 0
        pending = [("", os.fspath(dest), False)]  # (relative path, path, whether the tree lists it)
        try:
            while pending:
                rel, path, listed = pending.pop()
                empty = True
                with os.scandir(path) as found:
                    for de in found:
                        empty = False
                        name = f"{rel}/{de.name}" if rel else de.name
                        entry = entries.get(name)
                        if entry is None:
                            # Only a directory some entry lies below may be unlisted: one that is
                            # not holds nothing listed, so it ends in an empty one or a stray file.
                            if not de.is_dir(follow_symlinks=False):
                                return False
                            pending.append((name, de.path, False))
                            continue
                        matched += 1
                        if isinstance(entry, FileEntry):
                            if not self._links_its_blob(entry, de.stat(follow_symlinks=False), stamps, de.path):
                                return False
                        elif isinstance(entry, SymlinkEntry):
                            if not de.is_symlink() or os.readlink(de.path) != entry.target:
                                return False
                            if de.stat(follow_symlinks=False).st_mtime != FIXED_MTIME:
                                return False  # a link made before its time was fixed: made again
                        elif de.is_dir(follow_symlinks=False):
                            pending.append((name, de.path, True))
                        else:
                            return False
                if empty and not listed and rel:
                    return False  # an unlisted directory the tree does not imply
        except OSError:
            return False
        return matched == len(entries)

    def _links_its_blob(self, entry: FileEntry, st: os.stat_result, stamps: dict, path: str) -> bool:
        """Whether a materialized file (its lstat `st`, at `path`) is a sound link of `entry`'s
        blob. A link shares its blob's inode, so its stat is the blob's: the stamp the blob was
        hashed good under (inode, size, mtime, ctime, mode) proves both at once. A copy made where
        the blob had the most links (_copy_of_blob) is sound with its own stamp, or once hashed."""
        if not stat.S_ISREG(st.st_mode):
            return False
        copy = ".x" if entry.executable else ""  # materialize links executables to the .x copy
        stamp = stat_stamp(st)
        if stamps.get(entry.digest[2:] + copy) == stamp and st.st_size == entry.size:
            return True
        if st.st_nlink == 1 and st.st_size == entry.size:
            if stamps.get(_copy_name(entry, st)) == stamp:
                return True
            if stat.S_IMODE(st.st_mode) == (0o555 if entry.executable else 0o444) and \
                    hash_file(path, self.digester) == entry.digest:
                self._keep_stamp(_copy_name(entry, st), path, stamp)
                return True
        return self.verify(entry) and st.st_ino == os.stat(self._blob_str(entry.digest) + copy).st_ino

    def _copy_of_blob(self, entry: FileEntry, source: Path, target: Path) -> None:
        """Write `target` as a copy of the blob `source` (its mode and fixed time), stamped as sound."""
        src = os.open(source, os.O_RDONLY | os.O_CLOEXEC)
        try:
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                copy_sparse(src, fd)
                os.fchmod(fd, 0o555 if entry.executable else 0o444)
            finally:
                os.close(fd)
        finally:
            os.close(src)
        os.utime(target, (FIXED_MTIME, FIXED_MTIME))
        st = os.lstat(target)
        if hash_file(str(target), self.digester) != entry.digest:  # the blob was verified just before: never
            raise CorruptBlob(f"blob {entry.digest[:16]} changed while it was copied")
        self._keep_stamp(_copy_name(entry, st), str(target), stat_stamp(st))

    def _keep_stamp(self, name: str, path: str, stamp) -> None:
        """Record `stamp` as the one `path` (a blob, or a tree's copy of one) was hashed good
        under, only if nothing touched the file while it was hashed (its stamp now is the same)."""
        with self._stamp_lock:
            if stat_stamp(os.lstat(path)) == stamp:
                self._stamps.set(name, stamp)

    def _restamp(self, blob: Path, before: os.stat_result) -> None:
        """Linking a blob into a tree moves its ctime, part of the stamp `verify` just recorded:
        take the new ctime where it alone moved since `before` (the stat just before the link),
        else the next build would re-hash every blob this one linked."""
        with self._stamp_lock:
            restamp_linked(self._stamps, blob, before)

    def add_root(self, link: Path) -> None:
        """Make the tree `link` points at a gc root while the link stays (like a Nix result
        link): `roots/<digest of the link's path>` points at the link."""
        roots = self.base / "roots"
        roots.mkdir(exist_ok=True)
        record = roots / self.digester.of(os.fsencode(link.absolute()))[:32]
        if os.path.islink(record) and os.readlink(record) == str(link.absolute()):
            return
        tmp = Path(tempfile.mktemp(dir=self.tmp))
        os.symlink(link.absolute(), tmp)
        os.replace(tmp, record)

    def ingest_dir(self, root: Path, paths: list[str] | None = None, move: bool = False) -> Tree:
        """Store everything under `root` (or only `paths` below it) and return the tree. Walked
        with an explicit stack, every directory read or refused with the reason (os.walk skipped
        an unreadable one in silence, and recursed): a tree nested deeper than MAX_DEPTH is
        refused, as the rest of bgraph (and a path) could not hold it."""
        entries: dict[str, object] = {}
        starts = [root / p for p in paths] if paths is not None else [root]
        total = 0  # bytes of the files taken so far (MAX_OUTPUT_TOTAL)
        for start in starts:
            if start.is_symlink() or start.is_file():
                rel = start.relative_to(root).as_posix()
                total = _sized(start, rel, total)
                entries[rel] = self._entry(start, move)
                continue
            if not start.exists():
                continue
            top = start.relative_to(root).as_posix()
            pending = ["" if top == "." else top]
            while pending:
                rel_d = pending.pop()
                if rel_d.count("/") + 1 > MAX_DEPTH or len(rel_d) > MAX_PATH:
                    raise StoreError(f"output directory {rel_d[:60]}… is nested {rel_d.count('/') + 1} levels "
                                     f"({len(rel_d)} characters) deep: more than {MAX_DEPTH} levels or {MAX_PATH} "
                                     "characters is refused",
                                     hint="an output tree must not nest that deep; have the action flatten it")
                try:
                    with os.scandir(root / rel_d if rel_d else root) as it:
                        listed = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
                except OSError as err:
                    raise StoreError(f"cannot read output directory {rel_d[:200] or '.'}: {err.strerror}") from None
                for name, is_dir in listed:
                    rel = f"{rel_d}/{name}" if rel_d else name
                    if not filestate.utf8_name(name):  # a tree path is text: such a name cannot be keyed or mounted
                        raise StoreError(f"output {rel.encode('utf-8', 'surrogateescape')!r} has a name that is "
                                         "not valid UTF-8", hint="have the action name its outputs in UTF-8")
                    if is_dir:
                        pending.append(rel)
                    else:
                        total = _sized(root / rel, rel, total)
                        entries[rel] = self._entry(root / rel, move)
                if not listed and rel_d:
                    entries[rel_d] = DirEntry()
        return Tree(entries)

    def _entry(self, p: Path, move: bool):
        if p.is_symlink():
            target = os.readlink(p)
            if not filestate.utf8_name(target):
                raise StoreError(f"output link {p.name!r} points at a name that is not valid UTF-8",
                                 hint="have the action name its outputs in UTF-8")
            return SymlinkEntry(target)
        if not p.is_file():
            raise StoreError(f"{p.name}: not a regular file, directory or symlink")
        return self.put_file(p, move=move)


def _sized(p: Path, rel: str, before: int) -> int:
    """`before` plus the size of `p` where it is a regular file (never followed); an output over
    the bounds (output_size_problem) is a StoreError."""
    try:
        st = p.lstat()
    except OSError:
        return before  # _entry says what is wrong with it
    if not stat.S_ISREG(st.st_mode):
        return before
    problem = output_size_problem(rel, st.st_size, before)
    if problem:
        raise StoreError(problem, hint=OUTPUT_SIZE_HINT)
    return before + st.st_size
