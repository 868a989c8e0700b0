"""The shape of a remote ActionResult, checked before anything of it is fetched or filed.

A server (or anyone who wrote its action cache) chooses every path, name, link target and digest
of a result. The client takes one only as strictly as the worker takes an input root
(staging.py) and as the local sandbox's ingest gives outputs (LocalCas.ingest_dir):
- an output path is one the Command declared, each declared output at most once;
- a name in a Tree is non-empty, not `.` or `..`, holds no `/` and no NUL, and is UTF-8; a
  Directory names each entry once; a symlink's target is non-empty, UTF-8 and holds no NUL;
- no entry lies below a file or a symlink, and no path is given twice with different contents;
- a digest is a hex hash of the server's function with a size of at least 0;
- a Tree is walked once per distinct Directory digest: its entry count and depth are known
  before a single path is made, so a Tree naming one small Directory 8^30 times is refused at
  once (MAX_ENTRIES, MAX_DEPTH, MAX_PATH, MAX_TREE_BYTES).
Any violation is BadResult, whose text names what was wrong; the client makes it a
RemoteFailure (a local run under --remote-local-fallback) and files nothing of the result.
"""

from __future__ import annotations

import bisect
import string
from collections.abc import Callable
from dataclasses import dataclass, field

from build_graph.model import DirEntry, SymlinkEntry
from build_graph.store.cas import MAX_DEPTH, MAX_PATH

MAX_ENTRIES = 1 << 20  # files, links and empty directories of one action's outputs
MAX_TREE_BYTES = 64 << 20  # one output directory's Tree message, plus Directory blobs read by digest
_HEX = frozenset(string.hexdigits.lower())


class BadResult(Exception):
    """A result whose shape the client refuses (the server's fault, never the action's)."""


@dataclass(frozen=True)
class RemoteFile:
    """An output file as the server names it: its remote digest and executable bit."""

    hash: str
    size: int
    executable: bool


@dataclass
class Outputs:
    """A checked result's outputs, relative to the output directory: files still to fetch,
    symlinks and empty directories."""

    entries: dict[str, object] = field(default_factory=dict)  # path -> RemoteFile | SymlinkEntry | DirEntry


def check_name(name: str, where: str) -> str:
    """A Directory entry's name, refused where it is not one plain path component."""
    if not name or name in (".", "..") or "/" in name or "\0" in name:
        raise BadResult(f"the output tree at {where or '.'} holds an invalid name {name!r}")
    _utf8(name, f"a name in the output tree at {where or '.'}")
    return name


def check_target(target: str, where: str) -> str:
    """A symlink's target, refused where empty, holding NUL or not UTF-8."""
    if not target or "\0" in target:
        raise BadResult(f"output symlink {where} has an invalid target {target!r}")
    _utf8(target, f"the target of output symlink {where}")
    return target


def _utf8(text: str, what: str) -> None:
    try:
        text.encode()
    except UnicodeEncodeError:
        raise BadResult(f"{what} is not UTF-8: {text!r}") from None


def check_digest(digest, where: str, length: int = 64) -> tuple[str, int]:
    """A Digest's (hash, size), refused where the hash is no hex hash of `length` digits (it
    goes into ByteStream resource names) or the size is negative."""
    h, size = digest.hash, digest.size_bytes
    if len(h) != length or not set(h) <= _HEX:
        raise BadResult(f"{where} names a malformed digest {h[:80]!r}")
    if size < 0:
        raise BadResult(f"{where} names a negative size {size}")
    return h, size


class ResultChecker:
    """Checks one ActionResult against the action's declared outputs. `declared` maps each
    output path the Command named (as the server may write it back) to its path relative to
    the output directory; `ignored` are declared paths whose output is dropped (the client's
    own marker); `load_tree(output, digest)` returns the Tree message of an output directory
    and every Directory it names (digest -> message), within MAX_TREE_BYTES."""

    def __init__(self, declared: dict[str, str], ignored: set[str], load_tree: Callable, hash_length: int = 64):
        self.declared, self.ignored, self.load_tree = declared, ignored, load_tree
        self.hash_length = hash_length
        self.out = Outputs()
        self._owner: dict[str, str] = {}  # path -> the declared output that gave it

    def check(self, result) -> Outputs:
        """Every output of `result`, checked (see the module's docstring)."""
        seen: set[str] = set()

        def declared(path: str, kind: str) -> str | None:
            if path not in self.declared:
                raise BadResult(f"the result holds {kind} {path[:200]!r}, which the action never declared")
            rel = self.declared[path]
            if rel in seen:
                raise BadResult(f"the result gives declared output {path[:200]!r} more than once")
            seen.add(rel)
            return None if path in self.ignored else rel

        for f in result.output_files:
            rel = declared(f.path, "output file")
            h, size = check_digest(f.digest, f"output file {f.path!r}", self.hash_length)
            if rel is not None:
                self._add(rel, RemoteFile(h, size, f.is_executable), rel)
        for s in [*result.output_symlinks, *result.output_file_symlinks, *result.output_directory_symlinks]:
            rel = declared(s.path, "output symlink")
            if rel is not None:
                self._add(rel, SymlinkEntry(check_target(s.target, s.path)), rel)
        for d in result.output_directories:
            rel = declared(d.path, "output directory")
            digest = check_digest(d.tree_digest, f"output directory {d.path!r}", self.hash_length)
            if rel is not None:
                tree, directories = self.load_tree(d.path, digest)
                self._directory(rel, tree, directories)
        self._nothing_below_a_non_directory()
        return self.out

    def _add(self, path: str, entry: object, owner: str) -> None:
        """One entry at `path`; the same path from two declared outputs (one nested in the
        other, as the local ingest allows) only with the same contents."""
        if path in ("", "."):
            raise BadResult("the result gives a file or symlink as the whole output directory")
        if len(self.out.entries) >= MAX_ENTRIES:
            raise BadResult(f"the result holds more than {MAX_ENTRIES} output entries")
        if len(path) > MAX_PATH:
            raise BadResult(f"output path {path[:60]!r}… is longer than {MAX_PATH} characters")
        known = self.out.entries.get(path)
        if known is not None and (known != entry or self._owner[path] == owner):
            raise BadResult(f"the result gives output {path[:200]!r} twice, differently")
        self.out.entries[path] = entry
        self._owner[path] = owner

    def _directory(self, rel: str, tree, directories: dict) -> None:
        """Output directory `rel`: its Tree checked once per distinct Directory (names, entry
        count, depth), then laid out as entries."""
        counts: dict[str, tuple[int, int]] = {}  # digest -> (entries below, depth below)
        active: set[str] = set()

        def measure(h: str, where: str) -> tuple[int, int]:
            known = counts.get(h)
            if known is not None:
                return known
            if h in active:  # cannot happen with true digests; a loop is refused, never walked
                raise BadResult(f"output directory {rel} names a directory inside itself")
            directory = directories.get(h)
            if directory is None:
                raise BadResult(f"output directory {rel} names directory {h[:16]}…, which the server does not hold")
            active.add(h)
            counts[h] = self._measure(directory, where, measure)
            active.discard(h)
            return counts[h]

        total, depth = self._measure(tree.root, rel, measure)
        if total > MAX_ENTRIES:
            raise BadResult(f"output directory {rel} holds more than {MAX_ENTRIES} entries")
        if depth + rel.count("/") > MAX_DEPTH:
            raise BadResult(f"output directory {rel} nests more than {MAX_DEPTH} directories deep")
        stack = [("" if rel == "." else rel, tree.root)]
        while stack:
            prefix, directory = stack.pop()
            if not (directory.files or directory.directories or directory.symlinks) and prefix:
                self._add(prefix, DirEntry(), rel)  # an empty directory, as the local ingest records it
            for node in directory.files:
                self._add(_join(prefix, node.name), RemoteFile(node.digest.hash, node.digest.size_bytes,
                                                               node.is_executable), rel)
            for node in directory.symlinks:
                self._add(_join(prefix, node.name), SymlinkEntry(node.target), rel)
            for node in directory.directories:
                stack.append((_join(prefix, node.name), directories[node.digest.hash]))

    def _measure(self, directory, where: str, measure) -> tuple[int, int]:
        """(entries, depth) of one Directory, its names and digests checked; children through
        `measure` (memoized by digest)."""
        names: set[str] = set()
        for node in (*directory.files, *directory.symlinks, *directory.directories):
            check_name(node.name, where)
            if node.name in names:
                raise BadResult(f"the output tree at {where} names {node.name!r} twice")
            names.add(node.name)
        for node in directory.files:
            check_digest(node.digest, f"output file {where}/{node.name}", self.hash_length)
        for node in directory.symlinks:
            check_target(node.target, f"{where}/{node.name}")
        total, depth = len(directory.files) + len(directory.symlinks), 0
        for node in directory.directories:
            h, _size = check_digest(node.digest, f"output directory {where}/{node.name}", self.hash_length)
            below, below_depth = measure(h, f"{where}/{node.name}")
            total += max(below, 1)  # an empty directory is one entry
            depth = max(depth, below_depth + 1)
            if total > MAX_ENTRIES:
                raise BadResult(f"output directory {where} holds more than {MAX_ENTRIES} entries")
            if depth > MAX_DEPTH:
                raise BadResult(f"output directory {where} nests more than {MAX_DEPTH} directories deep")
        return total, depth

    def _nothing_below_a_non_directory(self) -> None:
        """Refuse an entry below a file or a symlink of the outputs (LocalCas.materialize could not
        lay it out, locally or in any later build). Sorted once: each non-directory's first
        path below it, if any, is found by bisection."""
        paths = sorted(self.out.entries)
        for path, entry in self.out.entries.items():
            if isinstance(entry, DirEntry):
                continue
            i = bisect.bisect_left(paths, path + "/")
            if i < len(paths) and paths[i].startswith(path + "/"):
                raise BadResult(f"the result holds output {paths[i][:200]!r} below non-directory {path[:200]!r}")


def _join(prefix: str, name: str) -> str:
    return f"{prefix}/{name}" if prefix else name
