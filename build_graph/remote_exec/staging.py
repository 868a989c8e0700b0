"""A lease's inputs: its Command and input root read from the server's CAS into the worker's own
local CAS, and the input root turned into the sandbox's mounts (worker.py's contract).

Blobs already in the local CAS are not fetched again; REAPI Directory messages are kept there too
(they are blobs by digest). The root is mounted a subtree at a time, as the local sandbox mounts
each input: every top-level directory is one read-only mount, except a directory that holds an
output directory (`bgraph`) or is `bgraph/in`, whose children are mounted one by one. A mounted
subtree becomes a bgraph Tree (kept per Directory digest, its blobs local) that LocalCas lays out
once as hard links and every later lease showing it reuses: a pinned /usr, a dependency's outputs.
"""

from __future__ import annotations

import posixpath
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from build_graph.model import DirEntry, FileEntry, SymlinkEntry, Tree
from build_graph.store.cas import LocalCas

RESERVED = ("proc", "dev", "tmp")  # the sandbox's own top-level directories
SPLIT = ("bgraph/in",)  # directories whose children are mounted one by one (each input its own tree)
MAX_SPLIT = 256  # above this many children, such a directory is one mount (as sandbox.MAX_MOUNTS)
KEEP_TREES = 1024  # subtrees kept in memory (their Tree, digest included) between leases


class MissingInputs(Exception):
    """Blobs the server's CAS does not hold: (hash, size) each."""

    def __init__(self, blobs: list[tuple[str, int]]):
        super().__init__(f"{len(blobs)} input blob(s) missing from the server's CAS")
        self.blobs = blobs


class BadInput(Exception):
    """A Command or input root the worker refuses (INVALID_ARGUMENT): the action is wrong, not us."""


class CorruptInput(Exception):
    """A blob the server sent does not hash to its digest (UNAVAILABLE: the server may retry)."""


@dataclass
class Mounts:
    """The sandbox's filesystem for one lease, in mount order: ("dir", path) made empty,
    ("tree", path, Tree) a read-only subtree, ("file", path, FileEntry), ("symlink", target, path);
    and per writable directory what the input root holds below it (copied there)."""

    ops: list[tuple] = field(default_factory=list)
    writable: dict[str, dict[str, object]] = field(default_factory=dict)


class Stager:
    """Fetches a lease's Command and input root through `remote` (a ReapiRemote) into `cas`."""

    def __init__(self, remote, cas: LocalCas):
        self.remote, self.cas = remote, cas
        self.pb = remote.pb
        self._dirs: dict[str, object] = {}  # Directory digest -> message (small; cleared when large)
        self._trees: OrderedDict[str, Tree] = OrderedDict()  # Directory digest -> Tree, blobs local
        self._lock = threading.Lock()
        self.fetched_bytes = 0  # what this stager brought into the cache (worker --max-cache)

    # -- blobs -------------------------------------------------------------------------------
    def _have(self, digest: str, size: int) -> bool:
        return self.cas.verify(FileEntry(digest, size))

    def fetch_blobs(self, wanted: dict[str, int]) -> None:
        """Bring every blob of `wanted` (hash -> size) into the local CAS; MissingInputs names
        those the server lacks."""
        need = {h: s for h, s in wanted.items() if not self._have(h, s)}
        if not need:
            return
        got = self.remote.get_blobs(need)
        missing = [(h, s) for h, s in need.items() if h not in got]
        for h, data in got.items():
            self.fetched_bytes += len(data)
            entry = self.cas.put_bytes(data)
            if entry.digest != h:
                raise CorruptInput(f"the server's blob {h[:16]}… hashes to {entry.digest[:16]}…")
        if missing:
            raise MissingInputs(sorted(missing))

    def message(self, digest, kind):
        """A message of type `kind` read from CAS blob `digest` (fetched where not local)."""
        self.fetch_blobs({digest.hash: digest.size_bytes})
        try:
            return kind.FromString(self.cas.read_bytes(FileEntry(digest.hash, digest.size_bytes)))
        except Exception as e:  # noqa: BLE001 - a blob that is no such message is a bad action
            raise BadInput(f"blob {digest.hash[:16]}… is not a {kind.DESCRIPTOR.name}: {e}") from None

    # -- directories -------------------------------------------------------------------------
    def _load(self, root) -> None:
        """Every Directory message below `root` in memory, fetched a level at a time; subtrees
        known whole from an earlier lease are not walked again."""
        pb = self.pb
        with self._lock:
            if len(self._dirs) > 200_000:
                self._dirs.clear()
        level = {root.hash: root.size_bytes}
        while level:
            self.fetch_blobs({h: s for h, s in level.items() if h not in self._dirs})
            following: dict[str, int] = {}
            for h, s in level.items():
                d = self._dirs.get(h)
                if d is None:
                    try:
                        d = pb.Directory.FromString(self.cas.read_bytes(FileEntry(h, s)))
                    except Exception:  # noqa: BLE001
                        raise BadInput(f"blob {h[:16]}… is not a Directory") from None
                    self._dirs[h] = d
                for sub in d.directories:
                    if sub.digest.hash not in self._trees:
                        following[sub.digest.hash] = sub.digest.size_bytes
            level = following

    def tree(self, digest, where: str = "") -> Tree:
        """The subtree at Directory `digest` as a bgraph Tree, every file blob local; `where`
        (its path in the input root) names it in a refusal."""
        with self._lock:
            known = self._trees.get(digest.hash)
            if known is not None:
                self._trees.move_to_end(digest.hash)
                return known
        self._load(digest)
        out: dict[str, object] = {}
        blobs: dict[str, int] = {}

        def walk(node_digest, prefix: str, depth: int) -> None:
            if depth > 256:
                raise BadInput("the input root nests more than 256 directories deep")
            h = node_digest.hash
            sub_tree = self._trees.get(h)
            if sub_tree is not None and prefix:  # known whole: its entries, prefixed
                if not sub_tree.entries:
                    out[prefix] = DirEntry()
                for p, e in sub_tree.entries.items():
                    out[f"{prefix}/{p}"] = e
                return
            d = self._dirs.get(h)
            if d is None:  # dropped meanwhile (another lease's load, the memo's bound): again
                self._load(node_digest)
                d = self._dirs[h]
            if not (d.files or d.directories or d.symlinks) and prefix:
                out[prefix] = DirEntry()
            unique_names(d, "/".join(p for p in (where, prefix) if p))
            for node in d.files:
                out[_join(prefix, node.name)] = FileEntry(node.digest.hash, node.digest.size_bytes, node.is_executable)
                blobs[node.digest.hash] = node.digest.size_bytes
            for node in d.symlinks:
                out[_join(prefix, node.name)] = SymlinkEntry(node.target)
            for node in d.directories:
                walk(node.digest, _join(prefix, node.name), depth + 1)
        walk(digest, "", 0)
        self.fetch_blobs(blobs)
        tree = Tree.from_checked(out)
        with self._lock:
            self._trees[digest.hash] = tree
            while len(self._trees) > KEEP_TREES:
                self._trees.popitem(last=False)
        return tree

    def directories(self, root, paths: list[str]) -> set[str]:
        """Those of `paths` (relative to the input root) that are directories of root `root`."""
        found = set()

        def directory(digest):
            return self._dirs.get(digest.hash) or self.message(digest, self.pb.Directory)

        for path in paths:
            node = directory(root)
            parts = path.split("/")
            for i, name in enumerate(parts):
                sub = next((d for d in node.directories if d.name == name), None)
                if sub is None:
                    break
                if i == len(parts) - 1:
                    found.add(path)
                else:
                    node = directory(sub.digest)
        return found

    def mounts(self, root, writable: list[str]) -> Mounts:
        """The input root `root` as the sandbox's mounts, with `writable` (writable_dirs) bound
        where they are; what the root holds below them is given to be copied there."""
        self._load(root)
        got = Mounts(writable={w: {} for w in writable})

        def owner(path: str) -> str | None:
            return next((w for w in writable if path == w or path.startswith(w + "/")), None)

        leaves: dict[str, int] = {}  # blobs of files outside any subtree: fetched here

        def leaf(path: str, entry) -> None:
            if isinstance(entry, FileEntry):
                leaves[entry.digest] = entry.size
            w = owner(path)
            if w == path or any(x.startswith(path + "/") for x in writable):
                raise BadInput(f"the outputs' directory {w or path} is not a directory in the input root")
            if w is not None:
                got.writable[w][path[len(w) + 1:]] = entry
            elif isinstance(entry, SymlinkEntry):
                got.ops.append(("symlink", entry.target, path))
            else:
                got.ops.append(("file", path, entry))

        def visit(d, path: str, depth: int) -> None:
            if depth > 256:
                raise BadInput("the input root nests more than 256 directories deep")
            unique_names(d, path)
            for node in d.files:
                leaf(_join(path, node.name), FileEntry(node.digest.hash, node.digest.size_bytes, node.is_executable))
            for node in d.symlinks:
                leaf(_join(path, node.name), SymlinkEntry(node.target))
            for node in d.directories:
                p = _join(path, node.name)
                w = owner(p)
                if w is not None:  # copied into the writable directory
                    below = self.tree(node.digest, p)
                    rel = p[len(w) + 1:] if p != w else ""
                    if rel and not below.entries:
                        got.writable[w][rel] = DirEntry()
                    for q, e in below.entries.items():
                        got.writable[w][f"{rel}/{q}" if rel else q] = e
                    continue
                sub = self._dirs.get(node.digest.hash)
                holds_output = any(x.startswith(p + "/") for x in writable)
                split = p in SPLIT and sub is not None and len(sub.directories) + len(sub.files) <= MAX_SPLIT
                if holds_output or split:
                    if sub is None:  # known whole from an earlier lease: its message again
                        self._trees.pop(node.digest.hash, None)
                        self._load(node.digest)
                        sub = self._dirs[node.digest.hash]
                    got.ops.append(("dir", p))
                    visit(sub, p, depth + 1)
                else:
                    got.ops.append(("tree", p, self.tree(node.digest, p)))

        root_dir = self._dirs[root.hash]
        for name in [n.name for n in (*root_dir.files, *root_dir.symlinks, *root_dir.directories)]:
            if name in RESERVED:
                raise BadInput(f"the input root holds /{name}, which is the sandbox's own")
        for w in writable:
            if w.split("/", 1)[0] in RESERVED:
                raise BadInput(f"output directory /{w} lies in the sandbox's own /{w.split('/', 1)[0]}")
        visit(root_dir, "", 0)
        for w, entries in got.writable.items():
            _nothing_below_a_non_directory(w, entries)
        self.fetch_blobs(leaves)
        return got


def unique_names(d, prefix: str) -> None:
    """Refuse a Directory naming one entry twice (REAPI: names are unique). A symlink `a` and a
    directory `a` side by side would put `a/b` below a symlink: laid out, `b` went through it."""
    seen: set[str] = set()
    for node in (*d.files, *d.symlinks, *d.directories):
        if node.name in seen:
            raise BadInput(f"input root names {_join(prefix, node.name)} twice (a Directory's names must be unique)")
        seen.add(node.name)


def _nothing_below_a_non_directory(w: str, entries: dict[str, object]) -> None:
    """Refuse an entry of writable directory `w` below a symlink or file of it (as
    LocalCas.materialize refuses one in a tree): laid out, it would be made through the link."""
    for path in entries:
        parent = path.rpartition("/")[0]
        while parent:
            if not isinstance(entries.get(parent, DirEntry()), DirEntry):
                raise BadInput(f"input root holds {w}/{path} below non-directory {w}/{parent}")
            parent = parent.rpartition("/")[0]


def _join(prefix: str, name: str) -> str:
    if not name or name in (".", "..") or "/" in name or "\0" in name:
        raise BadInput(f"input root holds an invalid name {name!r} in {prefix or '/'}")
    return f"{prefix}/{name}" if prefix else name


def output_paths(command, working_directory: str) -> list[str]:
    """The Command's outputs as paths relative to the input root (REAPI names them relative to
    the working directory): `output_paths`, else `output_files` + `output_directories`."""
    named = list(command.output_paths) or [*command.output_files, *command.output_directories]
    paths = []
    for o in named:
        p = posixpath.normpath(posixpath.join(working_directory, o))
        if o.startswith("/") or p == "." or p == ".." or p.startswith("../"):
            raise BadInput(f"output path {o!r} is not inside the input root")
        paths.append(p)
    return paths


def writable_dirs(outputs: list[str], directories: frozenset[str] | set[str] = frozenset()) -> list[str]:
    """The directories made writable: each output's parent, or the output itself where it is one
    of the input root's `directories`; only the outermost of nested ones."""
    parents = set()
    for o in outputs:
        if o in directories:
            # An output that is a directory of the root (a whole-output action's working
            # directory, `bgraph/out`) is bound writable itself, as the local sandbox binds
            # /bgraph/out: its parent stays the sandbox's own directory of read-only mounts.
            parents.add(o)
            continue
        parent = posixpath.dirname(o)
        if not parent:
            raise BadInput(f"output {o!r} lies at the input root's top level: it has no parent directory "
                           "to make writable (put outputs below a directory such as bgraph/out)")
        parents.add(parent)
    keep = []
    for p in sorted(parents, key=len):
        if not any(p == k or p.startswith(k + "/") for k in keep):
            keep.append(p)
    return keep
