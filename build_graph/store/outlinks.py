"""The links under bgraph-out/: each requested target's link to its materialized output, made and
read without ever following a link below bgraph-out/ itself.

A link's directory may hold an older link where this one needs a directory: `//p:w` built before
`//p/w:x`, whose link is bgraph-out/p/w/x, or a root target `//:aarch64` before a build for
`--platform aarch64`. Following bgraph-out/p/w there made the new link inside //p:w's output tree
in the cache, changing a stored output that other targets and workspaces share (K13). Each step
below the root is taken through a directory descriptor opened O_NOFOLLOW: an older link in the
way is an output link of an earlier build (bgraph-out holds nothing else) and is replaced by the
directory this link needs; a directory of links where this link goes is replaced by it; anything
else in the way is refused, and nothing is removed.
"""

from __future__ import annotations

import os
import stat
import threading
from itertools import pairwise

from build_graph.errors import StoreError

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _parts(rel: str) -> list[str]:
    parts = rel.split("/")
    if not rel or any(p in ("", ".", "..") for p in parts):
        raise StoreError(f"output link path {rel!r} is not a plain relative path")
    return parts


def overlap(rels: list[str]) -> tuple[str, str] | None:
    """Two of these link paths where one would lie inside the other (component-wise), if any."""
    ordered = sorted(rels, key=lambda r: r.split("/"))
    for a, b in pairwise(ordered):
        if b.split("/")[:len(a.split("/"))] == a.split("/"):
            return a, b
    return None


def place(root: str | os.PathLike, rel: str, target: str) -> None:
    """Point root/`rel` at `target`: a new link made beside it and renamed over the old one (a
    reader never finds it missing); the directories on the way made, none of them followed."""
    parts = _parts(rel)
    os.makedirs(root, exist_ok=True)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # the root itself may be a link
    try:
        for i, part in enumerate(parts[:-1]):
            inner = _enter(fd, part, root, parts[:i + 1])
            os.close(fd)
            fd = inner
        _link(fd, parts, root, target)
    except StoreError:
        raise
    except OSError as e:  # what another build linking here at the same moment leaves in the way
        raise StoreError(f"{os.path.join(root, *parts)}: {e.strerror or e}",
                         hint="another bgraph build may be linking outputs in this workspace at the same time; "
                              "build again") from None
    finally:
        os.close(fd)


def _link(fd: int, parts: list[str], root, target: str) -> None:
    """The last step of place(): the link itself, in the directory `fd`."""
    name = parts[-1]
    try:
        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
    except FileNotFoundError:
        st = None
    if st is not None and stat.S_ISDIR(st.st_mode):
        _remove_link_dir(fd, name, root, parts)  # the links of targets below this one's name
    elif st is not None and not stat.S_ISLNK(st.st_mode):
        raise _in_the_way(root, parts)
    fresh = f".{name}.{os.getpid()}.{threading.get_ident()}"
    try:
        os.unlink(fresh, dir_fd=fd)
    except FileNotFoundError:
        pass
    os.symlink(target, fresh, dir_fd=fd)
    try:
        os.replace(fresh, name, src_dir_fd=fd, dst_dir_fd=fd)
    except OSError:
        os.unlink(fresh, dir_fd=fd)
        raise


def read(root: str | os.PathLike, rel: str) -> str | None:
    """The text of the link root/`rel`, or None where it, or a plain directory on its way, is
    missing (a link on the way is not followed: the link asked for is then not there)."""
    parts = _parts(rel)
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        for part in parts[:-1]:
            try:
                nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except (FileNotFoundError, NotADirectoryError, OSError):
                return None  # missing, a file, or a link (ELOOP under O_NOFOLLOW)
            os.close(fd)
            fd = nfd
        try:
            return os.readlink(parts[-1], dir_fd=fd)
        except (FileNotFoundError, OSError):
            return None  # missing, or not a link
    finally:
        os.close(fd)


def _enter(fd: int, part: str, root, upto: list[str]) -> int:
    """A new descriptor of directory `part` in `fd` (made if missing; an output link there is
    replaced by it); `fd` stays open (the caller's to close)."""
    for _ in range(3):  # another build may make or replace it at the same time
        try:
            st = os.stat(part, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            try:
                os.mkdir(part, 0o755, dir_fd=fd)
            except FileExistsError:
                continue
            st = os.stat(part, dir_fd=fd, follow_symlinks=False)
        if stat.S_ISLNK(st.st_mode):  # an earlier build's output link where a directory goes now
            try:
                os.unlink(part, dir_fd=fd)
            except FileNotFoundError:
                pass
            continue
        if not stat.S_ISDIR(st.st_mode):
            raise _in_the_way(root, upto)
        try:
            return os.open(part, _DIR_FLAGS, dir_fd=fd)
        except OSError:
            continue  # replaced by a link or removed meanwhile: look again
    raise StoreError(f"{os.path.join(root, *upto)} keeps changing while bgraph links its outputs",
                     hint="another bgraph build is linking outputs in this workspace; build again")


def _remove_link_dir(fd: int, name: str, root, parts: list[str]) -> None:
    """Remove directory `name` (in `fd`) holding only links and such directories: the output
    links of targets whose names lie below this link's (an earlier build). Anything else in it
    is refused, and nothing is removed."""
    def only_links(dfd: int) -> bool:
        for entry in os.listdir(dfd):
            st = os.stat(entry, dir_fd=dfd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                sub = os.open(entry, _DIR_FLAGS, dir_fd=dfd)
                try:
                    if not only_links(sub):
                        return False
                finally:
                    os.close(sub)
            elif not stat.S_ISLNK(st.st_mode):
                return False
        return True

    def remove(dfd: int) -> None:
        for entry in os.listdir(dfd):
            st = os.stat(entry, dir_fd=dfd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                sub = os.open(entry, _DIR_FLAGS, dir_fd=dfd)
                try:
                    remove(sub)
                finally:
                    os.close(sub)
                os.rmdir(entry, dir_fd=dfd)
            else:
                os.unlink(entry, dir_fd=dfd)

    sub = os.open(name, _DIR_FLAGS, dir_fd=fd)
    try:
        if not only_links(sub):
            raise _in_the_way(root, parts)
        remove(sub)
    finally:
        os.close(sub)
    os.rmdir(name, dir_fd=fd)


def _in_the_way(root, parts: list[str]) -> StoreError:
    path = os.path.join(root, *parts)
    return StoreError(f"{path} is in the way of an output link and is not one of bgraph's links",
                      hint="bgraph-out/ holds only bgraph's links: move that file or directory elsewhere")
