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
"""

from __future__ import annotations

import os
import stat as stat_mod

RACY_NS = 2_000_000_000

Stamp = list  # [size, mtime_ns, ctime_ns, inode, mode, link]


def of(st: os.stat_result, link: str = "") -> Stamp:
    """The stamp of a stat result (and, for a symbolic link, its text)."""
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_mode, link]


def stamp(path: str | os.PathLike) -> Stamp | None:
    """A path's stamp, a link followed to what it leads to (its text kept); a dangling link is
    stamped by the link alone (its target may appear later); None where nothing is there."""
    try:
        lst = os.lstat(path)
    except OSError:
        return None
    if not stat_mod.S_ISLNK(lst.st_mode):
        return of(lst)
    return _through_link(path, lst)


def of_entry(entry: os.DirEntry) -> Stamp:
    """stamp() of a directory entry (one stat where the entry is no link)."""
    if not entry.is_symlink():
        return of(entry.stat(follow_symlinks=False))
    return _through_link(entry.path, entry.stat(follow_symlinks=False))


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
