"""What a download may read and write: which files a `file:` URL may name (the workspace, and the
directories the user allows: never WORKSPACE.toml, whose author is who this defends against), how
many bytes one download may take, and URLs as errors may show them (no credentials).

Bounds, documented in the README:
- a download larger than its pin's declared size (Debian and Python locks record one), else than
  BGRAPH_FETCH_MAX_MB (default 16 GiB), is stopped;
- a download that would leave less than BGRAPH_FETCH_MIN_FREE_MB (default 1 GiB) free on the
  cache's disk is stopped;
- a `file:` URL must name a regular file (a FIFO's open blocks forever, /dev/zero never ends),
  not a symbolic link, inside the workspace or below a directory of BGRAPH_FILE_URL_DIRS or the
  user config's [fetch] file_url_dirs.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from pathlib import Path
from urllib.parse import unquote, urlsplit, urlunsplit

from build_graph.errors import FetchError
from build_graph.roots import _KINDS

MAX_FETCH_MB = 16 << 10  # no pinned size: the largest download (CUDA's .debs and torch's wheels are a few GiB)
MIN_FREE_MB = 1 << 10  # what a download leaves free on the cache's disk, at least
SPACE_CHECK_EVERY = 64 << 20  # bytes between two looks at the free space
DIRS_VAR = "BGRAPH_FILE_URL_DIRS"
ALLOW_HINT = (f"put the file inside the workspace, or allow its directory with {DIRS_VAR}=DIR[:DIR...] or "
              "file_url_dirs = [\"DIR\"] under [fetch] in ~/.config/bgraph/config.toml (WORKSPACE.toml cannot "
              "allow it)")
_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC


def shown(url: str) -> str:
    """`url` with any `user:password@` replaced by `***@`, for messages."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return url.split("@", 1)[-1] if "@" in url else url
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc="***@" + parts.netloc.rsplit("@", 1)[1]))


def scrub(text: str, url: str) -> str:
    """`text` (an exception's words) without the credentials of `url`."""
    try:
        userinfo = urlsplit(url).netloc.rpartition("@")[0]
    except ValueError:
        userinfo = url.partition("://")[2].rpartition("@")[0]
    if not userinfo:
        return text
    for secret in sorted({userinfo, *userinfo.split(":", 1), unquote(userinfo)}, key=len, reverse=True):
        if len(secret) > 1:
            text = text.replace(secret, "***")
    return text


def _env_mb(name: str, default: int) -> int:
    raw = os.environ.get(name, "")
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise FetchError(f"{name}={raw!r} is not a number of MiB", hint=f"set {name} to a whole number, e.g. {default}")
    return value


def allowed_dirs() -> list[Path]:
    """The directories outside the workspace a `file:` URL may name: $BGRAPH_FILE_URL_DIRS
    (':'-separated), then the user config's [fetch] file_url_dirs; each must be absolute."""
    named = [d for d in os.environ.get(DIRS_VAR, "").split(os.pathsep) if d]
    from build_graph.workspace import user_fetch_settings

    named += user_fetch_settings().get("file_url_dirs", [])
    for d in named:
        if not os.path.isabs(d):
            raise FetchError(f"{DIRS_VAR} / file_url_dirs entry {d!r} is not an absolute path",
                             hint="name each allowed directory by its absolute path")
    return [Path(os.path.realpath(d)) for d in named]


def _inside(path: str, roots: list[Path]) -> bool:
    return any(path == str(r) or path.startswith(str(r).rstrip("/") + "/") for r in roots)


def local_path(url: str) -> str:
    """The path a `file:` URL names; FetchError for another host's (file://host/...)."""
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise FetchError(f"{shown(url)} names host {parts.netloc.rpartition('@')[2]!r}; a file: URL must name a "
                         "local absolute path", hint="write file:///absolute/path (three slashes)")
    path = unquote(parts.path)
    if "\0" in path:
        raise FetchError(f"{shown(url)} names a path with a NUL byte (%00), which no file has",
                         hint="fix the URL")
    return path


def open_file_url(url: str, roots: list[Path] | None) -> int:
    """A read-only descriptor of the regular file `url` names (OSError where it cannot be opened). `roots`: the directories it must lie
    in, judged by the real path before the open and again by the descriptor after it (a link
    swapped between the two); None for a URL the user configured (a pip index, an apt source)."""
    path = local_path(url)
    if not os.path.isabs(path):
        raise FetchError(f"{shown(url)} names no absolute path", hint="write file:///absolute/path (three slashes)")
    if roots is not None and not _inside(os.path.realpath(path), roots):
        # Said before anything is opened: an open alone can act (a tape device rewinds), and the
        # answer would tell whether the file exists.
        raise FetchError(f"{shown(url)} names a file outside the workspace and the directories the user allows "
                         "for file: URLs", hint=ALLOW_HINT)
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as e:  # the caller words the others (a mirror without the file is tried past)
        if e.errno == errno.ELOOP:  # the last component is a link (O_NOFOLLOW)
            raise FetchError(f"{shown(url)} is a symbolic link", hint="name the file itself in the URL") from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise FetchError(f"{shown(url)} is {_KINDS.get(stat.S_IFMT(mode), 'not a regular file')}, not a regular "
                             "file", hint="a file: URL must name a regular file")
        if roots is not None and not _inside(os.readlink(f"/proc/self/fd/{fd}"), roots):
            raise FetchError(f"{shown(url)} names a file outside the workspace and the directories the user allows "
                             "for file: URLs", hint=ALLOW_HINT)
    except BaseException:
        os.close(fd)
        raise
    return fd


class Budget:
    """The bytes one download may still write: up to its pinned size (else MAX_FETCH_MB), and
    never so many that the cache's disk keeps less than MIN_FREE_MB free."""

    def __init__(self, url: str, size: int, space_dir: Path):
        self.url, self.space_dir = shown(url), space_dir
        self.pinned = size > 0
        self.limit = size if self.pinned else _env_mb("BGRAPH_FETCH_MAX_MB", MAX_FETCH_MB) << 20
        self.floor = _env_mb("BGRAPH_FETCH_MIN_FREE_MB", MIN_FREE_MB) << 20
        self.written = 0
        self._next_check = 0

    def expect(self, length: int) -> None:
        """Refuse at once a download whose size is known up front (a file's, a Content-Length)."""
        if length > self.limit:
            raise self._over(length)
        self._space(length)

    def take(self, n: int) -> None:
        """Count `n` more bytes before they are written; FetchError past a bound."""
        self.written += n
        if self.written > self.limit:
            raise self._over(self.written)
        if self.written >= self._next_check:
            self._space(n)
            self._next_check = self.written + SPACE_CHECK_EVERY

    def _over(self, size: int) -> FetchError:
        if self.pinned:
            return FetchError(f"{self.url} is larger than its pinned size ({self.limit} bytes; {size} or more); "
                              "nothing was stored", hint="the source or the lock is wrong: re-lock if the file is trusted")
        return FetchError(f"{self.url} is larger than {self.limit >> 20} MiB, the bound for a download without a "
                          "pinned size; nothing was stored",
                          hint="raise BGRAPH_FETCH_MAX_MB if the file is meant to be that large")

    def _space(self, more: int) -> None:
        try:
            free = shutil.disk_usage(self.space_dir).free
        except OSError:
            return
        if free - more < self.floor:
            raise FetchError(f"{self.url}: the download would leave less than {self.floor >> 20} MiB free on the "
                             f"cache's disk ({free >> 20} MiB free); nothing was stored",
                             hint="free disk space (`bgraph cache gc --max-size SIZE`), build with --cache-dir on a "
                                  "larger disk, or lower BGRAPH_FETCH_MIN_FREE_MB")
