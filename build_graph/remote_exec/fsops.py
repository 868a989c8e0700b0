"""File-system steps the worker takes in a lease directory, where an action (or its input root)
decides what lies there: nothing here follows a symlink it did not make, opens a FIFO or socket,
or recurses (an action may leave a directory nested thousands deep, past PATH_MAX too)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

from build_graph.store.cas import FIXED_MTIME, copy_sparse, rmtree

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class Refused(OSError):
    """A path the worker will not create: a component on the way is not a directory it may enter."""


def remove_tree(path: Path | str) -> None:
    """Remove `path` and everything below it: the store's remover (store/cas.rmtree), which
    opens nothing but directories, never follows a link and does not recurse."""
    rmtree(path)


class Layout:
    """Creates entries below directory `root` (a lease's writable directory) by relative path,
    each parent entered with O_NOFOLLOW: a symlink the input root or an earlier step put on the
    way is refused, never followed, so nothing is made outside `root`."""

    def __init__(self, root: Path):
        self.root = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self._fds: dict[str, int] = {"": self.root}

    def close(self) -> None:
        """Close every directory held open."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> Layout:
        return self

    def __exit__(self, *_exc) -> None:
        self.close()

    def directory(self, rel: str) -> int:
        """The fd of directory `rel` below the root, made (0755) where missing."""
        if rel in self._fds:
            return self._fds[rel]
        parent, _, name = rel.rpartition("/")
        pfd = self.directory(parent)
        try:
            os.mkdir(name, 0o755, dir_fd=pfd)
        except FileExistsError:
            pass
        try:
            fd = os.open(name, _DIR, dir_fd=pfd)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR):
                raise Refused(errno.ENOTDIR, f"{rel} is not a directory (a symlink or file is there)") from None
            raise
        self._fds[rel] = fd
        return fd

    def _parent(self, rel: str) -> tuple[int, str]:
        parent, _, name = rel.rpartition("/")
        return self.directory(parent), name

    def copy(self, source: Path | str, rel: str, mode: int, mtime: int) -> None:
        """A new file `rel` holding `source`'s bytes (holes kept), with `mode` and `mtime`."""
        pfd, name = self._parent(rel)
        try:
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=pfd)
        except FileExistsError:
            raise Refused(errno.EEXIST, f"{rel} is there already") from None
        try:
            with open(source, "rb") as src:
                copy_sparse(src.fileno(), fd)
            os.fchmod(fd, mode)
            os.utime(fd, (mtime, mtime))
        finally:
            os.close(fd)

    def symlink(self, target: str, rel: str) -> None:
        """A symlink `rel` -> `target` (made, never followed)."""
        pfd, name = self._parent(rel)
        try:
            os.symlink(target, name, dir_fd=pfd)
        except FileExistsError:
            raise Refused(errno.EEXIST, f"{rel} is there already") from None
        # The link's own times are every input's (a local sandbox's links have them too).
        os.utime(name, (FIXED_MTIME, FIXED_MTIME), dir_fd=pfd, follow_symlinks=False)
