"""A lease's inputs: its Command and input root read from the server's CAS into the worker's own
local CAS, and the input root turned into the sandbox's view (worker.py's contract).

Blobs already in the local CAS are not fetched again; REAPI Directory messages are kept there too
(they are blobs by digest), so a pinned /usr fetched for one lease serves every later one. Each
top-level directory of the input root becomes a bgraph Tree that LocalCas.materialize lays out
once, as hard links, read-only, reused by every lease that shows the same tree.
"""

from __future__ import annotations

import posixpath
import threading

from build_graph.model import DirEntry, FileEntry, SymlinkEntry, Tree
from build_graph.store.cas import LocalCas

RESERVED = ("proc", "dev", "tmp")  # the sandbox's own top-level directories


class MissingInputs(Exception):
    """Blobs the server's CAS does not hold: (hash, size) each."""

    def __init__(self, blobs: list[tuple[str, int]]):
        super().__init__(f"{len(blobs)} input blob(s) missing from the server's CAS")
        self.blobs = blobs


class BadInput(Exception):
    """A Command or input root the worker refuses (INVALID_ARGUMENT): the action is wrong, not us."""


class CorruptInput(Exception):
    """A blob the server sent does not hash to its digest (UNAVAILABLE: the server may retry)."""


class Stager:
    """Fetches a lease's Command and input root through `remote` (a ReapiRemote) into `cas`."""

    def __init__(self, remote, cas: LocalCas):
        self.remote, self.cas = remote, cas
        self.pb = remote.pb
        self._trees: dict[str, dict[str, object]] = {}  # Directory digest -> its entries (memo)
        self._lock = threading.Lock()

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

    # -- the input root ----------------------------------------------------------------------
    def directories(self, root) -> dict[str, object]:
        """Every Directory of the tree below `root` (hash -> Directory), fetched a level at a time."""
        pb = self.pb
        found: dict[str, object] = {}
        level = {root.hash: root.size_bytes}
        while level:
            self.fetch_blobs(level)
            following: dict[str, int] = {}
            for h, s in level.items():
                try:
                    d = pb.Directory.FromString(self.cas.read_bytes(FileEntry(h, s)))
                except Exception:  # noqa: BLE001
                    raise BadInput(f"blob {h[:16]}… is not a Directory") from None
                found[h] = d
                for sub in d.directories:
                    if sub.digest.hash not in found:
                        following[sub.digest.hash] = sub.digest.size_bytes
            level = following
        return found

    def entries(self, root) -> dict[str, object]:
        """The input root as bgraph tree entries (path -> FileEntry | SymlinkEntry | DirEntry),
        every file blob brought into the local CAS."""
        with self._lock:
            known = self._trees.get(root.hash)
        if known is not None:
            self.fetch_blobs({e.digest: e.size for e in known.values() if isinstance(e, FileEntry)})
            return known
        dirs = self.directories(root)
        out: dict[str, object] = {}
        blobs: dict[str, int] = {}

        def walk(h: str, prefix: str, depth: int) -> None:
            if depth > 256:
                raise BadInput("the input root nests more than 256 directories deep")
            d = dirs[h]
            if not (d.files or d.directories or d.symlinks) and prefix:
                out[prefix] = DirEntry()
            for node in d.files:
                path = _join(prefix, node.name)
                out[path] = FileEntry(node.digest.hash, node.digest.size_bytes, node.is_executable)
                blobs[node.digest.hash] = node.digest.size_bytes
            for node in d.symlinks:
                out[_join(prefix, node.name)] = SymlinkEntry(node.target)
            for node in d.directories:
                walk(node.digest.hash, _join(prefix, node.name), depth + 1)
        walk(root.hash, "", 0)
        self.fetch_blobs(blobs)
        with self._lock:
            if len(self._trees) > 64:  # a bounded memo: the last input roots seen
                self._trees.pop(next(iter(self._trees)))
            self._trees[root.hash] = out
        return out


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


def writable_dirs(outputs: list[str]) -> list[str]:
    """The directories made writable: each output's parent, only the outermost of nested ones."""
    parents = set()
    for o in outputs:
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


def split_view(entries: dict[str, object], writable: list[str]) -> tuple[dict[str, tuple], dict[str, dict]]:
    """The read-only top-level mounts and, per writable directory, what the input root holds
    below it (to be copied there). A writable directory inside a mounted tree stays in that tree
    as an empty directory: its mount point."""
    below: dict[str, dict] = {w: {} for w in writable}
    ro: dict[str, object] = {}
    for path, entry in entries.items():
        owner = next((w for w in writable if path == w or path.startswith(w + "/")), None)
        if owner is None:
            ro[path] = entry
        elif path != owner:
            below[owner][path[len(owner) + 1:]] = entry
        elif not isinstance(entry, DirEntry):
            raise BadInput(f"the outputs' directory {owner} is not a directory in the input root")
    for w in writable:
        top = w.split("/", 1)[0]
        if w != top and not isinstance(ro.get(top, DirEntry()), DirEntry) and top in ro:
            raise BadInput(f"the outputs' directory {w} lies below {top}, which is not a directory")
        if "/" in w:
            parent = w.rpartition("/")[0]
            if isinstance(ro.get(parent), (FileEntry, SymlinkEntry)):
                raise BadInput(f"the outputs' directory {w} lies below {parent}, which is not a directory")
    top: dict[str, tuple] = {}
    trees: dict[str, dict[str, object]] = {}
    for path, entry in ro.items():
        name, _, rest = path.partition("/")
        if name in RESERVED:
            raise BadInput(f"the input root holds /{name}, which is the sandbox's own")
        if not rest:
            if isinstance(entry, SymlinkEntry):
                top[name] = ("symlink", entry.target)
            elif isinstance(entry, FileEntry):
                top[name] = ("file", entry)
            else:
                trees.setdefault(name, {})
        else:
            trees.setdefault(name, {})[rest] = entry
    for w in writable:  # mount points inside read-only trees
        name, _, rest = w.partition("/")
        if name in RESERVED:
            raise BadInput(f"output directory /{w} lies in the sandbox's own /{name}")
        if rest and name in trees:
            t = trees[name]
            if not any(p == rest or p.startswith(rest + "/") for p in t):
                t[rest] = DirEntry()
    for name, t in trees.items():
        top[name] = ("tree", Tree.from_checked(dict(sorted(t.items()))) if t else Tree())
    return top, below
