"""An action's REAPI input root: its whole filesystem view as the local bubblewrap sandbox gives
it (sandbox.sandbox_layout), as one Merkle tree of REAPI `Directory` messages.

Every read-only mount becomes a subtree at its in-sandbox path (`usr/`, `bgraph/src`,
`bgraph/in/<name>`, `bgraph/toolchain`, ...), the merged-/usr links are symlinks at the root,
and `bgraph/out` holds what the local runner puts in the output directory before the run (the
staged inputs' symlinks, each declared output's parent). The worker binds the root's top-level
entries read-only at `/<name>` and makes the outputs writable (worker.py's contract).

Digests are the remote's digest function: the workspace's own where the server offers it;
else (a blake3 workspace on a sha256-only server such as BuildGrid) every file is hashed again
once, and the correspondence is kept in the cache (DigestMap), never in a key.
"""

from __future__ import annotations

import hashlib
import posixpath
import threading
from dataclasses import dataclass, field
from pathlib import Path

from build_graph.model import Action, DirEntry, FileEntry, SymlinkEntry, Tree
from build_graph.sandbox import OUT_MOUNT, sandbox_layout
from build_graph.store.json_table import JsonTable


_DIR = object()  # a child that is a directory of this encoding (not a mounted subtree)


class NotRemotable(Exception):
    """This action's view cannot be sent as content (a host path, a mount below another)."""


class DigestMap:
    """Local blob digest -> the remote function's digest of the same bytes, for a workspace
    whose digest function the server does not offer. Learned by hashing the local blob once,
    kept in the cache between builds (a pinned /usr is hashed again only on its first use)."""

    def __init__(self, cas, function: str):
        self.cas, self.function = cas, function
        self.table = JsonTable(cas.base / f"reapi-digests-{cas.digester.name}-{function}.json", cas.tmp)
        self._lock = threading.Lock()

    def remote(self, entry: FileEntry) -> str:
        """The remote digest of a local blob (read and hashed where not known yet)."""
        known = self.table.table.get(entry.digest)
        if known is not None:
            return known
        if not self.cas.verify(entry):
            raise NotRemotable(f"input blob {entry.digest[:16]}… is missing from the local cache")
        h = hashlib.new(self.function)
        with open(self.cas.blob_path(entry.digest), "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
        digest = h.hexdigest()
        with self._lock:
            self.table.set(entry.digest, digest)
        return digest

    def save(self) -> None:
        with self._lock:
            self.table.save()


@dataclass
class Encoded:
    """A tree as REAPI directories: its root's (hash, size), every Directory message by hash,
    and every file by remote hash (the local entry to upload it from)."""

    root: tuple[str, int]
    directories: dict[str, bytes] = field(default_factory=dict)
    files: dict[str, FileEntry] = field(default_factory=dict)


class Encoder:
    """Turns bgraph trees into REAPI Directory messages in the remote's digest function.
    Each Tree object is encoded once (trees are immutable and shared: one pinned /usr serves
    every action of a build)."""

    def __init__(self, pb, function: str, file_digest):
        self.pb, self.function, self.file_digest = pb, function, file_digest
        self._lock = threading.Lock()

    def hash(self, data: bytes) -> str:
        return hashlib.new(self.function, data).hexdigest()

    def tree(self, tree: Tree) -> Encoded:
        """The REAPI encoding of `tree` (memoized on the tree)."""
        memo = tree.__dict__.setdefault("_reapi", {})
        known = memo.get(self.function)
        if known is None:
            known = memo[self.function] = self._encode(tree.entries, {})
        return known

    def _encode(self, entries: dict, mounted: dict[str, Encoded]) -> Encoded:
        """Encode flat `entries` (path -> Entry) plus whole subtrees `mounted` (path -> Encoded)."""
        pb = self.pb
        out = Encoded(("", 0))
        kids: dict[str, dict[str, object]] = {"": {}}

        def dir_of(d: str) -> dict[str, object]:
            if d not in kids:
                kids[d] = {}
                up, _, name = d.rpartition("/")
                dir_of(up).setdefault(name, _DIR)
            return kids[d]

        for path, entry in entries.items():
            up, _, name = path.rpartition("/")
            if isinstance(entry, DirEntry):
                dir_of(path)
            else:
                dir_of(up)[name] = entry
        for path, enc in mounted.items():
            up, _, name = path.rpartition("/")
            if path in kids or name in dir_of(up):
                raise NotRemotable(f"/{path} is mounted over other content")
            dir_of(up)[name] = enc
            out.directories.update(enc.directories)
            out.files.update(enc.files)
        for d in kids:  # a directory made below a name already taken (a mount, a file, a link)
            up, _, name = d.rpartition("/")
            if d and kids[up].get(name) is not _DIR:
                raise NotRemotable(f"/{d} lies below a mount or a file")
        digests: dict[str, tuple[str, int]] = {}
        for d in sorted(kids, key=lambda s: s.count("/") + (1 if s else 0), reverse=True):
            msg = pb.Directory()
            for name, child in sorted(kids[d].items()):
                if child is _DIR:
                    h, size = digests[f"{d}/{name}" if d else name]
                    msg.directories.add(name=name, digest=pb.Digest(hash=h, size_bytes=size))
                elif isinstance(child, Encoded):
                    msg.directories.add(name=name, digest=pb.Digest(hash=child.root[0], size_bytes=child.root[1]))
                elif isinstance(child, FileEntry):
                    h = self.file_digest(child)
                    out.files[h] = child
                    msg.files.add(name=name, digest=pb.Digest(hash=h, size_bytes=child.size),
                                  is_executable=child.executable)
                elif isinstance(child, SymlinkEntry):
                    msg.symlinks.add(name=name, target=child.target)
            # REAPI wants names sorted within each kind; a name is one kind only, so the above
            # (one sorted pass) keeps each list sorted.
            data = msg.SerializeToString(deterministic=True)
            h = self.hash(data)
            out.directories[h] = data
            digests[d] = (h, len(data))
        out.root = digests[""]
        return out

    def input_root(self, action: Action) -> Encoded:
        """The whole filesystem view of `action` as one REAPI tree (see the module's docstring)."""
        entries: dict[str, object] = {"bgraph": DirEntry()}
        mounted: dict[str, Encoded] = {}
        for op in sandbox_layout(action):
            if op[0] == "host":
                raise NotRemotable(f"it reads host path {op[1]} (host_tools), which is not content")
            if op[0] == "symlink":
                entries[op[2].lstrip("/")] = SymlinkEntry(op[1])
            else:
                mounted[op[1].strip("/")] = self.tree(op[2])
        out = OUT_MOUNT.lstrip("/")
        entries[out] = DirEntry()
        for path, entry in output_dir_view(action).entries.items():
            entries[f"{out}/{path}"] = entry
        return self._encode(entries, mounted)


def output_dir_view(action: Action) -> Tree:
    """What the local runner puts in the output directory before the action runs: a staged
    mount's files as symlinks into that mount (its directories as directories), and the parent
    directory of each declared output."""
    entries: dict[str, object] = {}
    if action.staged:
        for path, entry in action.input_tree(action.staged).entries.items():
            entries[path] = DirEntry() if isinstance(entry, DirEntry) else SymlinkEntry(f"{action.staged}/{path}")
    for o in action.outputs:
        parent = posixpath.dirname(o)
        if parent and parent not in entries:
            entries[parent] = DirEntry()
    return Tree.from_checked(entries)


def working_directory(action: Action) -> str:
    """The action's working directory, relative to the input root."""
    return action.cwd.strip("/")


def output_paths(action: Action) -> list[str]:
    """The declared outputs as REAPI output paths (relative to the working directory); the
    whole output directory is the working directory's path to it ('' when they are one)."""
    paths = []
    for o in action.outputs:
        full = OUT_MOUNT if o == "." else f"{OUT_MOUNT}/{o}"
        rel = posixpath.relpath(full, action.cwd)
        if rel == ".." or rel.startswith("../"):
            raise NotRemotable(f"output {o} lies outside the working directory {action.cwd}")
        paths.append("" if rel == "." else rel)
    return paths


def out_relative(action: Action, output_path: str) -> str:
    """An output path as the action cache names it: relative to the output directory."""
    full = posixpath.normpath(posixpath.join(action.cwd, output_path))
    return posixpath.relpath(full, OUT_MOUNT)


def local_blob_path(cas, entry: FileEntry) -> Path:
    """Where a local blob's bytes are (checked first: a corrupted blob is never uploaded)."""
    if not cas.verify(entry):
        raise NotRemotable(f"input blob {entry.digest[:16]}… is missing from the local cache")
    return cas.blob_path(entry.digest)
