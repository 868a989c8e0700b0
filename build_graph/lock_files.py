"""Reading and writing a lock file inside the workspace (`bgraph deb lock`, `bgraph py lock`), never
through a symlink.

A lock path comes from the workspace (a target's `lock` key), and so may its directories: a
workspace could ship `locks -> /somewhere` and have the lock's text written over any file the user
may write. So the path is walked from the workspace root one directory at a time, each opened
relative to the last with O_NOFOLLOW: a symlink (or anything not a directory) on the way, or a
lock that is itself a symlink or not a regular file, is one error line. The write is atomic: a
temporary file beside the lock, renamed over it, both named relative to the directory's fd, so a
link swapped in after the check is not followed either.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from pathlib import Path

from build_graph.errors import UsageError

_HINT = "lock files live in the workspace: replace the symlink with a directory (or the file), or point `lock` elsewhere"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _parts(rel: str) -> list[str]:
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    if rel.startswith("/") or not parts or ".." in parts:
        raise UsageError(f"lock path {rel!r} is not a path inside the workspace", hint=_HINT)
    return parts


@contextlib.contextmanager
def _parent_fd(root: Path, rel: str, create: bool):
    """An fd of the lock's directory, reached from the root without following a link; None where a
    directory is missing and `create` is false."""
    *dirs, _ = _parts(rel)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # the root is the user's choice
    try:
        walked = []
        for name in dirs:
            walked.append(name)
            try:
                nxt = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    os.close(fd)
                    fd = -1
                    yield None
                    return
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, 0o755, dir_fd=fd)
                nxt = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    kind = "a symlink" if _is_link(fd, name) else "not a directory"
                    raise UsageError(f"lock path {rel}: {'/'.join(walked)} is {kind}; a lock is never read or "
                                     "written through one", hint=_HINT) from None
                raise
            os.close(fd)
            fd = nxt
        yield fd
    finally:
        if fd >= 0:
            os.close(fd)


def _is_link(dir_fd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _refuse_odd_file(dir_fd: int, rel: str) -> bool:
    """Whether the lock exists; an error where it is a symlink or not a regular file."""
    name = rel.rstrip("/").rsplit("/", 1)[-1]
    try:
        mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
    except FileNotFoundError:
        return False
    if stat.S_ISREG(mode):
        return True
    kind = "a symlink" if stat.S_ISLNK(mode) else "not a regular file"
    raise UsageError(f"lock path {rel} is {kind}; a lock is never read or written through one", hint=_HINT)


def read_lock(root: Path, rel: str) -> str | None:
    """The text of the lock at workspace path `rel`, or None where there is none yet."""
    with _parent_fd(root, rel, create=False) as dir_fd:
        if dir_fd is None or not _refuse_odd_file(dir_fd, rel):
            return None
        name = _parts(rel)[-1]
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
        except OSError as e:
            if e.errno == errno.ELOOP:  # swapped for a link since the check
                raise UsageError(f"lock path {rel} is a symlink; a lock is never read through one",
                                 hint=_HINT) from None
            raise
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise UsageError(f"lock path {rel} is not a regular file", hint=_HINT)
            return f.read().decode()


def check_writable(root: Path, rel: str) -> None:
    """Refuse, before any work, a lock path that leads through a symlink or names one."""
    with _parent_fd(root, rel, create=False) as dir_fd:
        if dir_fd is not None:
            _refuse_odd_file(dir_fd, rel)


def write_lock(root: Path, rel: str, text: str) -> None:
    """Write `text` to workspace path `rel` atomically (a temporary file renamed over it)."""
    name = _parts(rel)[-1]
    with _parent_fd(root, rel, create=True) as dir_fd:
        _refuse_odd_file(dir_fd, rel)
        tmp = f".{name}.{secrets.token_hex(6)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dir_fd)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(text.encode())
                os.fchmod(f.fileno(), 0o644)
            # rename replaces whatever is at `name` (a link too) and follows nothing
            os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=dir_fd)
