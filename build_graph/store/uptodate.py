"""The no-op record: a build that would change nothing is answered from one file, without loading
the workspace, planning or computing a key (Ninja's `.ninja_log` idea, taken one step further).

After a successful build of a request (the targets as typed, and every flag or environment
variable that chooses what is built, where it is cached and how it is configured), the engine
files a row of the cache's state file (store/statefile.py, `records`, by request digest: one
transaction with the per-target memo) holding the file-state stamp (incremental/filestate.py:
size, mtime, ctime, inode, mode, link text) of:

- every file under the workspace root, except `bgraph-out/`, `.git/`, `__pycache__/` and the
  cache directory (when it lies inside the root): the target files, the sources, the patches,
  the locks, whatever a target globs; a file added or removed changes the set;
- bgraph's own code, the user's config file, the host binaries the build probed;
- the cache's generation file, which `cache gc` and `cache verify --repair` rewrite whenever they
  remove something (so after either, the next build checks every action again);
- each requested target's `bgraph-out` link (where it points) and the files it points to.

The next build of the same request compares those stamps; if every one holds, nothing the build
reads has changed and its outputs are where it left them, so the build is a no-op and says so.
Anything else (one stamp, a missing or damaged row, another bgraph) takes the full path,
which checks every action as before: the record can only skip work, never change a result.

Why it is exact: a build's outputs are a function of its inputs, and every input comes from the
files above (the workspace and bgraph's code), from pins fixed by sha256, or from the cache,
which is content-addressed. Two races are closed: a file edited while the build ran (the root is
scanned before and after the build; a record is written only if both scans agree), and a file
edited twice within one tick of the file system's clock (a file whose mtime or ctime is within
filestate.RACY_NS of the scan is "racily clean", as git calls it: the record lists it as always
changed, so the next build checks it and what reads it, and only that: an edit-build-edit loop
keeps its record). Every stamp of a workspace file, of bgraph's code and of a host tool is settled
(filestate.settle): a recent file's pages dirtied through a shared mapping are written back before
it is stat'ed, so a later store through that mapping moves its stamp.
"""

from __future__ import annotations

import functools
import hashlib
import os
import stat as stat_mod
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from build_graph.incremental import filestate
from build_graph.incremental.filestate import Stamp
from build_graph.roots import OUT_DIR, UNSCANNED_DIRS
from build_graph.store.atomic import write_bytes

if TYPE_CHECKING:
    from build_graph.store.statefile import StateFile

FORMAT = 4  # 2: filestate stamps (ctime, mode, link text); 3: a row, its memo beside it; 4: outputs stamp directories and links too


def request_digest(parts: dict[str, Any]) -> str:
    """The record's name: a digest of what chooses the build (targets, flags, environment)."""
    return hashlib.sha256(orjson.dumps(parts, option=orjson.OPT_SORT_KEYS)).hexdigest()[:32]


# Settled stamps (filestate.settle): a workspace file, bgraph's code, the config, a host tool,
# the generation file. The outputs' stamps are not settled (output_stamp): they are the cache's
# read-only blobs and trees, just written by the build, whose write-back would cost every build.
stamp_of = filestate.stamp


def output_stamp(path: str) -> Stamp | None:
    return filestate.stamp(path, settle_first=False)


class Unrecordable(Exception):
    """The workspace holds something whose changes a stamp scan cannot see (a link to a directory)."""


def scan(root: Path, skip: tuple[str, ...] = ()) -> dict[str, Stamp]:
    """Every file under `root` (relative path -> stamp), but bgraph-out/, .git/, __pycache__/
    and the directories in `skip` (absolute paths). A link is followed to its file (its text
    is part of the stamp); a link to a directory raises Unrecordable (what changes behind it
    would go unseen). A name that is not valid UTF-8 is kept as "\\0" and its bytes in hex (no
    source can have such a name: planner.expand_sources refuses it)."""
    skipped = {str(root / OUT_DIR), *skip}
    files: dict[str, Stamp] = {}
    prefix = len(str(root)) + 1
    stack = [str(root)]
    while stack:
        top = stack.pop()
        with os.scandir(top) as it:
            for entry in it:
                if entry.name in UNSCANNED_DIRS or entry.path in skipped:
                    continue
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
                    continue
                st = filestate.of_entry(entry)
                if stat_mod.S_ISDIR(st[4]):
                    raise Unrecordable(f"{entry.path} links to a directory")
                name = entry.path[prefix:]
                if not filestate.utf8_name(name):  # the record is JSON: such a name is kept as its bytes in hex
                    name = "\0" + name.encode("utf-8", "surrogateescape").hex()
                files[name] = st
    return files



@functools.cache
def code_files() -> tuple[str, ...]:
    """bgraph's own source files and data (the seccomp programs: R12): a change to any of them may
    change what a build does (listed once per process: the kept parse and the record both stamp them)."""
    base = Path(__file__).resolve().parents[1]
    return tuple(sorted(str(p) for p in (*base.rglob("*.py"), *base.rglob("*.bpf")) if "__pycache__" not in p.parts))


@dataclass
class Record:
    """What one successful build of a request saw, and what it left."""

    root: str
    skip: list[str]  # absolute directories the scan leaves out (the cache, when inside the root)
    files: dict[str, Stamp]  # the workspace scan
    racy: list[str]  # scanned files modified within RACY_S of the scan: always taken as changed
    extra: dict[str, Stamp | None]  # absolute path -> stamp: code, config, host tools, the cache's generation
    links: dict[str, str]  # requested target -> its bgraph-out link's target
    outputs: dict[str, Stamp]  # absolute path -> stamp, for every file, directory and link under those link targets
    summary: dict[str, Any] = field(default_factory=dict)  # counts and the link of each label, as printed
    python: str = sys.version
    format: int = FORMAT

    def to_bytes(self) -> bytes:
        return orjson.dumps(self.__dict__)

    @classmethod
    def from_bytes(cls, data: Any) -> Record | None:
        """The record `to_bytes` wrote; None for anything else (damaged, another bgraph's)."""
        try:
            record = cls(**orjson.loads(data))
        except (orjson.JSONDecodeError, TypeError, AttributeError):
            return None
        shapes = ((record.root, str), (record.skip, list), (record.files, dict), (record.racy, list),
                  (record.extra, dict), (record.links, dict), (record.outputs, dict), (record.summary, dict))
        return record if record.format == FORMAT and all(isinstance(v, t) for v, t in shapes) else None


def output_stamps(links: dict[str, str]) -> dict[str, Stamp]:
    """The stamp of every file, directory and link the outputs' links lead to: a directory's
    stamp moves when a name is added, removed or renamed in it, and a link's holds its text, so
    an output tree changed in shape (a file added, a directory link re-pointed) is seen too."""
    stamps: dict[str, Stamp] = {}
    for target in links.values():
        stamps[target] = output_stamp(target)
        if not os.path.isdir(target):
            continue
        for dirpath, dirs, names in os.walk(target):  # links to directories are in `dirs`, not followed
            for name in dirs + names:
                path = os.path.join(dirpath, name)
                stamps[path] = output_stamp(path)
    return stamps


def load(state: StateFile, digest: str) -> Record | None:
    """The record of the last successful build of this request, if any (a damaged one is none)."""
    data = state.record(digest)
    return Record.from_bytes(data) if data is not None else None


def restore_links(record: Record, layout_root: Path) -> int | None:
    """Put back the recorded bgraph-out links that were removed, where the trees
    they led to are still whole in the cache at `layout_root` (their files' stamps as recorded);
    returns how many, or None where one cannot be restored (the build relinks it). Checked again
    after relinking, under the cache's gc lock, against the generation: a collection that ran
    meanwhile (it may have taken a tree no link rooted) makes this None."""
    from build_graph.errors import BgraphError
    from build_graph.store import outlinks

    # Read and made through bgraph-out/ without following a link below it (outlinks.py).
    base = os.path.join(record.root, OUT_DIR)
    missing = []
    for link, target in record.links.items():
        rel = os.path.relpath(link, base)
        if rel.startswith("../") or rel == "..":
            return None
        found = outlinks.read(base, rel)
        if found == target:
            continue
        if found is not None or os.path.lexists(link):
            return None  # re-pointed by another build since, or something else there: the build decides
        missing.append((rel, target))
    if not all(output_stamp(p) == s for p, s in record.outputs.items()):
        return None
    for rel, target in missing:
        try:
            outlinks.place(base, rel, target)
        except (OSError, BgraphError):
            return None
    generation = str(generation_path(layout_root))
    if generation not in record.extra:  # a record of another cache
        return None
    import fcntl

    from build_graph.store.lease import gc_lock_path
    fd = os.open(gc_lock_path(layout_root), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        whole = stamp_of(generation) == record.extra[generation] and all(
            output_stamp(p) == s for p, s in record.outputs.items())
    finally:
        os.close(fd)
    return len(missing) if whole else None


def changed_files(record: Record, seen: dict[str, Stamp] | None = None) -> set[str] | None:
    """The workspace files (relative paths) whose stamps changed since the record; None where
    more than the contents of files changed: a file added or removed, bgraph's code, Python, the
    user's config, a probed host tool, or the cache's generation (something was collected).
    `seen`, when given, receives the scan (the build's scan before it starts: one walk serves both)."""
    if record.python != sys.version:
        return None
    if any(stamp_of(p) != s for p, s in record.extra.items()):
        return None
    if not record.extra.keys() >= set(code_files()):  # a code file was added
        return None
    try:
        now = scan(Path(record.root), tuple(record.skip))
    except (OSError, Unrecordable):
        return None
    if seen is not None:
        seen.update(now)
    if now.keys() != record.files.keys():
        return None
    files = record.files
    return {p for p, s in now.items() if files[p] != s}.union(record.racy)


def racy(files: dict[str, Stamp], scanned_at_ns: int) -> list[str]:
    """The files racily clean at the scan (filestate.racy): each may change again without a new
    stamp, so a record takes them as changed whatever their stamps say."""
    return [p for p, s in files.items() if filestate.racy(s, scanned_at_ns)]


def generation_path(layout_root: Path) -> Path:
    """<cache>/v1/generation: rewritten whenever `cache gc` or `cache verify --repair` removes something."""
    return layout_root / "generation"


def bump_generation(layout_root: Path) -> None:
    """The cache lost something: every no-op record of it stops holding (their next build checks
    each action again)."""
    path = generation_path(layout_root)
    before = generation_of(layout_root)
    after = f"{time.time_ns()}\n".encode()
    write_bytes(path, after)
    with _OWN_LOCK:
        _OWN_BUMPS.setdefault(str(path), []).append((before, after))


def generation_of(layout_root: Path) -> bytes | None:
    """The cache's generation as it is now (None: never bumped)."""
    try:
        return generation_path(layout_root).read_bytes()
    except FileNotFoundError:
        return None


def moved_by_others(layout_root: Path, since: bytes | None) -> bool:
    """Whether the generation moved since it read `since`, other than by this process's own bumps
    taken in turn from there (a build that evicted a damaged blob and ran its action again knows
    what it did; another command's bump it cannot know)."""
    with _OWN_LOCK:
        own = list(_OWN_BUMPS.get(str(generation_path(layout_root)), ()))
    seen = since
    for before, after in own:
        if before == seen:
            seen = after
    return generation_of(layout_root) != seen


_OWN_BUMPS: dict[str, list[tuple[bytes | None, bytes]]] = {}  # generation file -> (before, after) this process wrote
_OWN_LOCK = threading.Lock()


class Recording:
    """A command's scan of the workspace before it ran and, once it succeeded, the record of it:
    filed by the engine (Engine.remember) or, for query and why, by `remember`."""

    def __init__(self, request: Any, skip: tuple[str, ...] = (), previous: Any = None):
        """`request`: a noop.Request; `previous`: its noop.Previous, whose scan (just made, with the
        same directories left out) serves as this one."""
        self.request, self.root, self.skip = request, request.root, skip
        # bgraph's code and the user's config as this command found them: what it runs and reads
        # from now on (a rule's module is imported when first asked for). A record stamps them
        # as they were here, and none is written where they moved by the end.
        self.code = _code_stamps()
        if previous is not None and previous.scanned and sorted(previous.record.skip) == sorted(skip):
            self.started_ns, self.before = previous.started_ns, previous.scanned
            return
        self.started_ns = time.time_ns()
        try:
            self.before: dict[str, Stamp] | None = scan(self.root, skip)
        except (OSError, Unrecordable):
            self.before = None  # nothing will be recorded: every run takes the full path

    def of_build(self, cache: Path, summary: dict[str, Any], links: dict[str, Path],
                 host_tools: list[str]) -> Record | None:
        """The record of a successful build that linked `links`; None where it cannot be recorded
        (then the request's old record goes too)."""
        link_targets = {str(link): os.readlink(link) for link in links.values()}
        return self._record(cache, [str(generation_path(cache / "v1")), *host_tools,
                                    *(os.path.realpath(p) for p in host_tools)],
                            link_targets, {"actions": summary["executed"] + summary["hits"] + summary["cut_off"],
                                           "outputs": {label: str(link) for label, link in links.items()},
                                           "remote": "remote" in summary})

    def remember(self, text: str, code: int, cache: Path) -> None:
        """Record the answer of a command that reads only the workspace (query, why)."""
        from build_graph.store.statefile import StateFile

        record = self._record(cache, [], {}, {"text": text, "code": code})
        StateFile(self.request.state).put_record(self.request.digest, record and record.to_bytes())

    def _record(self, cache: Path, extra_paths: list[str], links: dict[str, str],
                summary: dict[str, Any]) -> Record | None:
        if self.before is None:
            return None
        cache_path = os.path.realpath(cache)
        skip = sorted({*self.skip, cache_path} if Path(cache_path).is_relative_to(self.root) else set(self.skip))
        inside = tuple(os.path.relpath(d, self.root) + "/" for d in skip if Path(d).is_relative_to(self.root))
        before = {p: s for p, s in self.before.items() if not p.startswith(inside)} if inside else self.before
        try:
            after = scan(self.root, tuple(skip))
        except (OSError, Unrecordable):
            return None
        if after != before:
            return None  # edited while it ran: the next run checks everything
        if _code_stamps() != self.code:
            return None  # bgraph's code or the config changed while it ran: its output may be the old code's
        return Record(root=str(self.root), skip=skip, files=after, racy=racy(after, self.started_ns),
                      extra={**self.code, **{p: stamp_of(p) for p in extra_paths}}, links=links,
                      outputs=output_stamps(links), summary=summary)


def _code_stamps() -> dict[str, Stamp | None]:
    """The stamps of bgraph's own code and of the user's config file."""
    from build_graph.roots import user_config_path

    return {p: stamp_of(p) for p in (*code_files(), str(user_config_path()))}
