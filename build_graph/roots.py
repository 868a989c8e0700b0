"""Where a workspace and the user's config live: found without loading either (no pydantic), so
that the no-op check can run before anything heavy is imported."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from build_graph.errors import LoadError


# What of a workspace is never a source: bgraph's own output links, and the directories the no-op
# scan (store/uptodate.py) does not read. Target files, globs and the scan all go by these, so no
# file can be read by a build and unseen by the record that answers "up to date" for it.
OUT_DIR = "bgraph-out"
UNSCANNED_DIRS = frozenset({".git", "__pycache__"})


def globbed(rel: str) -> bool:
    """Whether a glob may match the workspace path `rel`: not under bgraph-out/ nor a .git/ or
    __pycache__/ directory (a glob there would see files the record never stamps)."""
    parts = rel.split("/")
    return parts[0] != OUT_DIR and not UNSCANNED_DIRS.intersection(parts[:-1])


def target_files(root: Path) -> list[Path]:
    """The workspace's target files: every targets/**/*.toml outside the unscanned directories."""
    return sorted(p for p in (root / "targets").rglob("*.toml")
                  if not UNSCANNED_DIRS.intersection(p.relative_to(root).parts[:-1]))


def regular_bytes(path: Path) -> bytes:
    """The bytes of `path`, where it is a regular file (or a link to one); OSError where it cannot
    be read, NotRegular where it is something else: a FIFO's read blocks until a writer comes
    (forever), a device's never ends, so neither is opened."""
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        raise NotRegular(_KINDS.get(stat.S_IFMT(mode), "not a regular file"))
    return path.read_bytes()


class NotRegular(Exception):
    """A path that should be a file is a FIFO, a directory, a device or a socket (the message says which)."""


_KINDS = {stat.S_IFIFO: "a FIFO", stat.S_IFDIR: "a directory", stat.S_IFCHR: "a character device",
          stat.S_IFBLK: "a block device", stat.S_IFSOCK: "a socket"}


def find_root(start: Path) -> Path:
    """The nearest directory at or above `start` holding WORKSPACE.toml."""
    for d in [start, *start.parents]:
        if (d / "WORKSPACE.toml").is_file():
            return d
    raise LoadError("no WORKSPACE.toml here or in any parent directory", where=str(start))


def workspace_root(flag: str | None) -> Path:
    """-C/--workspace if given, else the nearest workspace at or above the current directory."""
    return Path(flag).resolve() if flag else find_root(Path.cwd())


def chosen_cache(flag: str | None, root: Path) -> Path | None:
    """The cache named by --cache-dir or $BGRAPH_CACHE (known before WORKSPACE.toml is read), if any;
    a LoadError for `--cache-dir ''` (a script's unset variable), which would otherwise be no flag
    and build into the user's everyday cache."""
    if flag == "":
        raise LoadError("--cache-dir is empty", hint="name the cache directory, or leave the flag out "
                        "for $BGRAPH_CACHE, WORKSPACE.toml's cache_dir or ~/.cache/bgraph")
    chosen = flag or os.environ.get("BGRAPH_CACHE")
    return under(root, chosen) if chosen else None


def under(root: Path, chosen: str) -> Path:
    """A configured path: `~` expanded, relative to the workspace root."""
    path = Path(os.path.expanduser(chosen))
    return path if path.is_absolute() else root / path


def cache_root(flag: str | None, root: Path, configured: str | None) -> Path:
    """--cache-dir, else $BGRAPH_CACHE, else WORKSPACE.toml's [defaults] cache_dir (`configured`),
    else ~/.cache/bgraph; a LoadError naming the setting where that is something other than a
    directory (it is made where missing)."""
    path = chosen_cache(flag, root) or under(root, configured or "~/.cache/bgraph")
    if os.path.lexists(path) and not path.is_dir():
        source = ("--cache-dir" if flag else "$BGRAPH_CACHE" if os.environ.get("BGRAPH_CACHE")
                  else "WORKSPACE.toml [defaults] cache_dir" if configured else "the default cache directory")
        raise LoadError(f"{source} names {path}, which is not a directory",
                        hint="give a directory for bgraph's cache (it is created where missing)")
    return path


def state_file(flag: str | None, root: Path) -> Path | None:
    """The cache's state file, where the no-op records, memos and kept parses of this workspace's
    builds are rows (store/statefile.py): `<cache>/v1/<digest-fn>/state-v2.sqlite`, the cache and
    digest function chosen as the build will choose them (WORKSPACE.toml read with tomllib alone,
    and only where it can choose one of them); None where WORKSPACE.toml cannot be read (the
    build reports it)."""
    from build_graph.store.statefile import STATE_FILE
    try:
        data = regular_bytes(root / "WORKSPACE.toml")
    except (OSError, NotRegular):
        return None
    raw: dict = {}
    # Parsed only where it can choose something here: tomllib is pure Python (its import and a
    # parse of this repository's file are 15-20 ms of a 0.1 s no-op).
    if chosen_cache(flag, root) is None or b"digest_function" in data:
        import tomllib

        try:
            raw = tomllib.loads(data.decode())
        except (UnicodeDecodeError, tomllib.TOMLDecodeError, RecursionError):
            return None  # the build reports it
    try:
        configured = None if chosen_cache(flag, root) else raw.get("defaults", {}).get("cache_dir")
        digest_function = raw.get("workspace", {}).get("digest_function", "blake3")
    except AttributeError:  # a table where a value belongs: the build reports it
        return None
    if not (configured is None or isinstance(configured, str)) or digest_function not in ("blake3", "sha256"):
        return None
    return cache_root(flag, root, configured) / "v1" / digest_function / STATE_FILE


def user_config_path() -> Path:
    """$BGRAPH_CONFIG, else $XDG_CONFIG_HOME/bgraph/config.toml, else ~/.config/bgraph/config.toml."""
    explicit = os.environ.get("BGRAPH_CONFIG")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.expanduser("~/.config")
    return Path(base) / "bgraph" / "config.toml"
