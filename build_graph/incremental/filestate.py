"""One file-state stamp and one racy-clean rule, for every check that trusts a stat instead of
reading a file (Ninja's DiskInterface, Bazel's FileStateValue): the no-op record's workspace scan
and output stamps, the kept parse, the source-digest index, verified CAS blobs, probed host tools.

A stamp is `[size, mtime_ns, ctime_ns, inode, mode, link]`: `link` is the text of a symbolic
link ("" for anything else), the rest are the stat of what the path leads to. Why each field:
- size and mtime: an ordinary edit;
- ctime: every write, chmod, rename or link count change moves it, and no user call can set it
  back, so a same-size rewrite whose mtime was put back (`touch -r`, `cp -p`, `rsync -a
  --inplace`, unpacking a reproducible archive) is still seen;
- inode: a file replaced by another one (an editor's save-by-rename);
- mode: `chmod +x` / `-x` changes what a build sees (an executable bit is part of a tree);
- link: a link retargeted to another file with an equal stat.

Racily clean (git's term): a file changed within RACY_NS of the moment its stamp was taken could
change again within the same clock tick without moving its stamp, so such a stamp is never
trusted (the caller hashes or re-checks the file every time, until the stamp is old enough).

Settled (`settle`): ctime does not move on every write. A store through a shared writable mapping
(mmap MAP_SHARED) moves mtime and ctime only when it faults on a clean page; later stores into
the same page, dirty and writable until the kernel writes it back, change the bytes and nothing
else. So before a stamp of a recently changed regular file is taken to be trusted or filed, the
file's dirty pages are written back and waited for (sync_file_range; fdatasync where that is
missing), and only then is it stat'ed: write-back makes every mapping of those pages read-only
again, so the next store faults and moves ctime, after the stamp (the stamp differs next time) or
before it (the stamp is racily clean). Why only recent files: one whose mtime and ctime are both
older than the kernel's write-back window (window_ns: vm.dirty_expire_centisecs +
dirty_writeback_centisecs, twice for a margin) took no write fault within it, and the kernel has
since written back on its own what its last fault dirtied, so its next store faults anyway: such
a file (nearly all of a workspace) costs no more than its stat. Not closed by this: a file system
that never writes back (tmpfs), where a page a mapping dirtied stays writable for good.
"""

from __future__ import annotations

import functools
import os
import stat as stat_mod
import time
from pathlib import Path

RACY_NS = 2_000_000_000

Stamp = list  # [size, mtime_ns, ctime_ns, inode, mode, link]


def of(st: os.stat_result, link: str = "") -> Stamp:
    """The stamp of a stat result (and, for a symbolic link, its text)."""
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_mode, link]


def stamp(path: str | os.PathLike, settle_first: bool = True) -> Stamp | None:
    """A path's stamp, a link followed to what it leads to (its text kept); a dangling link is
    stamped by the link alone (its target may appear later); None where nothing is there.
    Settled (see the module's docstring) unless `settle_first` is False: only for files nobody
    can map writable (the cache's read-only outputs), where a write-back would cost the build."""
    s = _stamp(path)
    if settle_first and s is not None and _unsettled(s[4], s[1], s[2]) and _write_back(path):
        s = _stamp(path)
    return s


def _stamp(path) -> Stamp | None:
    try:
        lst = os.lstat(path)
    except OSError:
        return None
    if not stat_mod.S_ISLNK(lst.st_mode):
        return of(lst)
    return _through_link(path, lst)


def of_entry(entry: os.DirEntry) -> Stamp:
    """stamp() of a directory entry, settled (one stat where the entry is no link and settled)."""
    if not entry.is_symlink():
        s = of(entry.stat(follow_symlinks=False))
    else:
        s = _through_link(entry.path, entry.stat(follow_symlinks=False))
    if _unsettled(s[4], s[1], s[2]) and _write_back(entry.path):
        return _stamp(entry.path) or s  # gone meanwhile: the caller's second look sees that
    return s


def settle(path: str | os.PathLike, st: os.stat_result) -> os.stat_result:
    """`st` (a stat of `path`, a link followed), or where the file is within the write-back
    window, its stat taken again after its dirty pages were written back (module docstring):
    what a caller that stats a file itself takes its stamp from."""
    if _unsettled(st.st_mode, st.st_mtime_ns, st.st_ctime_ns) and _write_back(path):
        try:
            return os.stat(path)
        except OSError:
            return st  # gone meanwhile: the caller's read fails
    return st


def _unsettled(mode: int, mtime_ns: int, ctime_ns: int) -> bool:
    """Whether a regular file changed recently enough that a page a mapping dirtied may still be
    unwritten (and writable without a fault)."""
    return stat_mod.S_ISREG(mode) and time.time_ns() - max(mtime_ns, ctime_ns) < window_ns()


DEFAULT_WINDOW_NS = 70_000_000_000  # Linux's defaults (30 s expiry + 5 s flusher period), twice


@functools.cache
def window_ns() -> int:
    """How long after a page is dirtied the kernel may take to write it back on its own: the
    expiry age of dirty data plus the flusher's period, twice (a margin for a busy disk). With
    the flusher turned off (period 0) the kernel writes back only under memory pressure: every
    regular file is then written back before each stamp, whatever its age."""
    try:
        expire, period = (int(Path("/proc/sys/vm", name).read_text())
                          for name in ("dirty_expire_centisecs", "dirty_writeback_centisecs"))
    except (OSError, ValueError):
        return DEFAULT_WINDOW_NS
    if period <= 0 or expire < 0:
        return 1 << 62
    return 2 * (expire + period) * 10_000_000


@functools.cache
def _sync_file_range():
    """libc's sync_file_range, or None (not Linux, or no libc to load)."""
    try:
        import ctypes

        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError, ImportError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


# SYNC_FILE_RANGE_WAIT_BEFORE | WRITE | WAIT_AFTER: every page dirty now is written and waited for.
_WRITE_AND_WAIT = 1 | 2 | 4


def _write_back(path) -> bool:
    """Write back the file's dirty pages and wait for them (whatever mapping dirtied them);
    whether that was done. Opened read-only, without blocking (a FIFO put there meanwhile)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError:
        return False
    try:
        fn = _sync_file_range()
        if fn is not None and fn(fd, 0, 0, _WRITE_AND_WAIT) == 0:
            return True
        getattr(os, "fdatasync", os.fsync)(fd)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _through_link(path, lst: os.stat_result) -> Stamp:
    try:
        text = os.readlink(path)
    except OSError:
        text = "?"
    try:
        return of(os.stat(path), text)
    except OSError:
        return [-1, lst.st_mtime_ns, lst.st_ctime_ns, lst.st_ino, lst.st_mode, text]


def racy(s: Stamp, taken_ns: int) -> bool:
    """Whether a stamp taken at `taken_ns` is racily clean: the file changed (content, mode or
    links: mtime or ctime) within RACY_NS before it, so the stamp proves nothing yet."""
    return taken_ns - max(s[1], s[2]) < RACY_NS


def same_but_links(old: Stamp, new: Stamp) -> bool:
    """Whether two stamps of one file differ at most in ctime: what making or removing a hard
    link of it does (the CAS links blobs into trees). Only a caller that just verified the file,
    and made the links itself, may take the new stamp on this ground."""
    return old[:2] == new[:2] and old[3:] == new[3:]


def utf8_name(name: str) -> bool:
    """Whether a path read from the file system (surrogate-escaped) is valid UTF-8 text."""
    try:
        name.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False
