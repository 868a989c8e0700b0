"""Core data: digests, Merkle trees, actions and their results, and the Store / ActionCache / Runner seams.

Everything here is immutable data. Trees are kept flat in memory (path -> entry) and
hashed as a Merkle DAG of directories, like REAPI's `Directory`, so that a tree digest
is the digest of its root directory node and every subdirectory has its own digest.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Protocol

import blake3
import orjson

if TYPE_CHECKING:  # the strategies (incremental/discovery.py) import this module
    from build_graph.incremental.discovery import Discovery

DIGEST_FUNCTIONS = ("blake3", "sha256")
FETCH_KEY_FIELDS = ("sha256", "filename")


def canonical_json(value: Any) -> bytes:
    """The one canonical encoding that keys, tree nodes and signatures are hashed over."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def key_json(value: Any) -> bytes:
    """canonical_json, byte for byte, of what keys and tree nodes are made of (str, int, bool,
    None, lists, str-keyed dicts), several times faster. Not for floats: orjson spells 1e-05
    and 1e+16 differently."""
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)


@dataclass(frozen=True)
class Digester:
    """The workspace's digest function (blake3 by default, sha256 where a remote demands it)."""

    name: str = "blake3"

    def __post_init__(self) -> None:
        if self.name not in DIGEST_FUNCTIONS:
            raise ValueError(f"unknown digest function {self.name!r}; use one of {', '.join(DIGEST_FUNCTIONS)}")

    def new(self):
        return blake3.blake3(max_threads=blake3.blake3.AUTO) if self.name == "blake3" else hashlib.sha256()

    def of(self, data: bytes) -> str:
        h = self.new()
        h.update(data)
        return h.hexdigest()

    def of_json(self, value: Any) -> str:
        """The digest of a key's description (see key_json: no floats)."""
        return self.of(key_json(value))


@dataclass(frozen=True)
class FileEntry:
    digest: str
    size: int
    executable: bool = False


@dataclass(frozen=True)
class SymlinkEntry:
    target: str


@dataclass(frozen=True)
class DirEntry:
    """An explicitly empty directory (non-empty ones are implied by their contents)."""


Entry = FileEntry | SymlinkEntry | DirEntry


def check_relpath(path: str) -> str:
    """Normalise a tree path; refuse absolute paths and `..` components."""
    if "\0" in path:  # no file system name holds one; a tar reader cuts the name there
        raise ValueError(f"path {path!r} holds a NUL byte")
    norm = posixpath.normpath(path)
    if path.startswith("/") or norm == ".." or norm.startswith("../") or norm == ".":
        raise ValueError(f"path {path!r} escapes the tree root")
    return norm


_DIR = object()  # a child that is a directory, while directory nodes are computed


def _kids_of(children: dict[str, dict[str, Any]], d: str) -> dict[str, Any]:
    """The children of directory `d`, creating it and its ancestors (each parent names it as a
    directory unless that name is already taken). A function of the module, not a closure: a
    recursive closure is a reference cycle, and one per tree left 7 objects per target of a
    plan for the collector."""
    kids = children.get(d)
    if kids is None:
        kids = children[d] = {}
        up, _, name = d.rpartition("/")
        _kids_of(children, up).setdefault(name, _DIR)
    return kids


class Tree:
    """An immutable directory tree: relative posix path -> FileEntry | SymlinkEntry | DirEntry."""

    __slots__ = ("entries", "__dict__")

    def __init__(self, entries: Mapping[str, Entry] | Iterable[tuple[str, Entry]] = ()):
        items = dict(entries)
        self.entries: dict[str, Entry] = {check_relpath(p): e for p, e in sorted(items.items())}

    @classmethod
    def from_checked(cls, entries: dict[str, Entry]) -> "Tree":
        """A tree of paths known to be normal (taken from other trees, or joined from checked
        names): only sorted. Trees are built by the thousand in a no-op build; normalising
        every path again was a tenth of it."""
        tree = cls.__new__(cls)
        tree.entries = dict(sorted(entries.items()))
        return tree

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Tree) and self.entries == other.entries

    def __hash__(self) -> int:
        return hash(tuple(self.entries.items()))

    def __repr__(self) -> str:
        return f"Tree({len(self.entries)} entries)"

    def __len__(self) -> int:
        return len(self.entries)

    def files(self) -> dict[str, FileEntry]:
        return {p: e for p, e in self.entries.items() if isinstance(e, FileEntry)}

    def get(self, path: str) -> Entry | None:
        return self.entries.get(path)

    def file_digests(self) -> dict[str, str]:
        """Path -> digest of every file (memoized): what a depfile manifest is checked against."""
        digests = self.__dict__.get("_file_digests")
        if digests is None:
            digests = {p: e.digest for p, e in self.entries.items() if isinstance(e, FileEntry)}
            self.__dict__["_file_digests"] = digests
        return digests

    def by_name(self) -> dict[str, tuple[str, ...]]:
        """File name -> every path in the tree with that name (memoized): what decides whether
        a new file could shadow an #include."""
        index = self.__dict__.get("_by_name")
        if index is None:
            grouped: dict[str, list[str]] = {}
            for p in self.entries:
                grouped.setdefault(p.rpartition("/")[2], []).append(p)
            index = {name: tuple(paths) for name, paths in grouped.items()}
            self.__dict__["_by_name"] = index
        return index

    def subtree(self, prefix: str) -> "Tree":
        """The part of the tree under `prefix`, re-rooted there."""
        prefix = prefix.strip("/")
        if not prefix:
            return self
        cut = prefix + "/"
        return Tree.from_checked({p[len(cut):]: e for p, e in self.entries.items() if p.startswith(cut)})

    def prefixed(self, prefix: str) -> "Tree":
        """The same tree moved under `prefix`."""
        prefix = prefix.strip("/")
        if not prefix:
            return self
        prefix = check_relpath(prefix)
        return Tree.from_checked({f"{prefix}/{p}": e for p, e in self.entries.items()})

    def select(self, paths: Iterable[str]) -> "Tree":
        """Only the given files, or directories with everything below them."""
        wanted = [p.strip("/") for p in paths]
        return Tree.from_checked({p: e for p, e in self.entries.items()
                                 if any(p == w or p.startswith(w + "/") for w in wanted)})

    def merged(self, *others: "Tree") -> "Tree":
        """Union of trees; a path present in two trees with different content is an error."""
        out = dict(self.entries)
        for other in others:
            for p, e in other.entries.items():
                if p in out and out[p] != e:
                    raise ValueError(f"conflicting entries for {p!r} when merging trees")
                out[p] = e
        return Tree.from_checked(out)

    def overlaid(self, top: "Tree") -> "Tree":
        """This tree with `top`'s entries added, replacing any at the same path."""
        return Tree.from_checked({**self.entries, **top.entries})

    def with_executable(self, predicate) -> "Tree":
        """Mark files whose path satisfies `predicate` executable (wheels lose exec bits)."""
        return Tree.from_checked({p: (FileEntry(e.digest, e.size, True) if isinstance(e, FileEntry) and predicate(p)
                                     else e) for p, e in self.entries.items()})

    def directory_nodes(self, digester: Digester) -> dict[str, tuple[str, bytes]]:
        """Merkle directory nodes: dir path ('' = root) -> (digest, canonical encoding).
        Computed once per tree and digest function (trees are immutable)."""
        cache = self.__dict__.get("_nodes")
        if cache is None:
            cache = self.__dict__["_nodes"] = {}
        nodes = cache.get(digester.name)
        if nodes is None:
            nodes = cache[digester.name] = self._directory_nodes(digester)
        return nodes

    def _directory_nodes(self, digester: Digester) -> dict[str, tuple[str, bytes]]:
        children: dict[str, dict[str, Any]] = {"": {}}
        for path, entry in self.entries.items():
            up, _, name = path.rpartition("/")
            if isinstance(entry, DirEntry):
                _kids_of(children, path)
                _kids_of(children, up)[name] = _DIR
            else:
                _kids_of(children, up)[name] = entry
        nodes: dict[str, tuple[str, bytes]] = {}
        # Deepest first so every subdirectory digest is known before its parent's.
        for d in sorted(children, key=lambda s: (s.count("/") + (1 if s else 0)), reverse=True):
            files, links, dirs = [], [], []
            for name, child in sorted(children[d].items()):
                if child is _DIR:
                    dirs.append([name, nodes[f"{d}/{name}" if d else name][0]])
                elif isinstance(child, FileEntry):
                    files.append([name, child.digest, child.size, child.executable])
                else:
                    links.append([name, child.target])
            encoded = key_json({"dirs": dirs, "files": files, "symlinks": links})
            nodes[d] = (digester.of(encoded), encoded)
        return nodes

    def digest(self, digester: Digester) -> str:
        roots = self.__dict__.get("_root")
        if roots is not None:
            known = roots.get(digester.name)
            if known is not None:
                return known
        return self.directory_nodes(digester)[""][0]

    def know_digest(self, digester: Digester, digest: str) -> "Tree":
        """Record the root digest of a tree read back from the store by that (verified) digest,
        so it is not recomputed from every entry."""
        self.__dict__.setdefault("_root", {})[digester.name] = digest
        return self


EMPTY_TREE = Tree()


@dataclass(frozen=True)
class HostTool:
    """A host binary an action may use, identified by path, version line and content digest."""

    path: str
    version: str
    digest: str


@dataclass(frozen=True)
class Action:
    """Small frozen data: what to run, over which inputs, producing which outputs.

    kind: "exec" (sandboxed process), "fetch" (fixed-output download), "extract"
    (archive -> tree, in-process with escape checks).
    """

    name: str
    mnemonic: str
    kind: str = "exec"
    argv: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    inputs: tuple[tuple[str, Tree], ...] = ()
    outputs: tuple[str, ...] = ()
    platform: str = ""
    # Set only where it differs from `platform` (a cross build): the machine the action runs on.
    exec_platform: str = ""
    toolchain: str | None = None
    host_paths: tuple[str, ...] = ()
    host_tools: tuple[HostTool, ...] = ()
    cwd: str = "/bgraph/out"
    memory_mb: int = 512
    rule_version: str = ""
    spec: tuple[tuple[str, str], ...] = ()
    cacheable: bool = True
    # An input mount whose files appear (as symlinks into its read-only mount) inside the
    # writable /bgraph/out before the run: imported Ninja edges write next to their inputs.
    staged: str | None = None
    # How a recorded run is matched to this one where it is keyed on less than all it can read
    # (incremental/discovery.py: depfile narrowing, preprocessed views, recorded macros); its
    # description joins the key. None: keyed on every input.
    discovery: Discovery | None = None

    @property
    def manifested(self) -> bool:
        """Filed under a prekey's manifest (rebuilder.py): its discovery narrows inputs, records macros, or both."""
        return self.cacheable and self.discovery is not None and self.discovery.narrows

    def description(self, digester: Digester) -> dict[str, Any]:
        """The canonical description the key is the digest of. Names and labels are left out
        so identical work planned by two targets is shared. (Memoized: do not mutate it.)"""
        return self._memo("_description", digester, lambda: self._describe(digester, narrowed=False))

    def prekey_description(self, digester: Digester) -> dict[str, Any]:
        """The description with each narrowed mount written as "narrowed" (its content is
        never digested: a whole source tree per compile was the largest cost of a no-op build)."""
        return self._memo("_prekey_description", digester, lambda: self._describe(digester, narrowed=True))

    def _describe(self, digester: Digester, narrowed: bool) -> dict[str, Any]:
        argv, left_out = list(self.argv), ()
        if narrowed and self.discovery is not None:
            argv, left_out = self.discovery.prekey_argv(self.argv), self.discovery.mounts
        described = {
            "kind": self.kind,
            "mnemonic": self.mnemonic,
            "argv": argv,
            "env": dict(self.env),
            "inputs": {mount: "narrowed" if mount in left_out else tree.digest(digester)
                       for mount, tree in self.inputs},
            "outputs": list(self.outputs),
            "platform": self.platform,
            "toolchain": self.toolchain,
            "host_paths": list(self.host_paths),
            "host_tools": {t.path: [t.version, t.digest] for t in self.host_tools},
            "cwd": self.cwd,
            "rule_version": self.rule_version,
            # A fetch is fixed-output (like Nix): its key is the bytes it must produce, not where from.
            "spec": ({k: v for k, v in self.spec if k in FETCH_KEY_FIELDS} if self.kind == "fetch"
                     else dict(self.spec)),
        }
        # Only when set, so actions that use none of them keep their keys.
        for name in ("exec_platform", "staged"):
            if getattr(self, name):
                described[name] = getattr(self, name)
        if self.discovery is not None:
            described.update(self.discovery.described())
        return described

    def _memo(self, attr: str, digester: Digester, compute):
        cache = self.__dict__.get(attr)
        if cache is None or cache[0] != digester.name:
            cache = (digester.name, compute())
            object.__setattr__(self, attr, cache)
        return cache[1]

    def prekey(self, digester: Digester) -> str:
        """The key with the narrowed mounts (and recorded -D/-U) left out: what a manifest is filed under."""
        return self._memo("_prekey", digester, lambda: digester.of_json(self.prekey_description(digester)))

    def traced(self, digester: Digester) -> tuple[str, dict[str, Any]]:
        """(key, description) as a build's trace records them: for an action with narrowed
        mounts, its prekey and the description without those mounts (what decides its manifest)."""
        if self.manifested:
            return self.prekey(digester), self.prekey_description(digester)
        return self.key(digester), self.description(digester)

    def key(self, digester: Digester) -> str:
        return self._memo("_key", digester, lambda: digester.of_json(self.description(digester)))

    def input_tree(self, mount: str) -> Tree:
        for m, t in self.inputs:
            if m == mount:
                return t
        raise KeyError(mount)


@dataclass(frozen=True)
class ActionResult:
    """What the action cache stores for a key."""

    output_tree: str
    exit_code: int
    stdout: str
    stderr: str
    duration_s: float
    output_entries: int = 0
    peak_mb: int = 0  # peak resident memory of the action's processes (0: not measured)
    cpu_s: float = 0.0  # CPU time (user + system) of the action's processes (0: not measured)
    # (signer, source, who vouched) of a result made elsewhere, filed in the same write as the
    # rest (store/origins.py); None: built by this machine's sandbox
    origin: tuple[str, str, str] | None = None

    def to_json(self) -> dict[str, Any]:
        data = self.__dict__.copy()
        if data["origin"] is None:
            del data["origin"]  # a local result's entry reads as it always did
        else:
            data["origin"] = list(data["origin"])
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "ActionResult":
        """Raises TypeError where `data` is not one (a damaged origin included: a miss, never local)."""
        origin = data.get("origin")
        if origin is not None:
            if not (isinstance(origin, list) and len(origin) == 3 and all(isinstance(o, str) for o in origin)):
                raise TypeError("a damaged origin")
            data = {**data, "origin": tuple(origin)}
        return cls(**data)


@dataclass(frozen=True)
class Outcome:
    """What a rule sees of a finished action: its output tree and how it was obtained."""

    action: Action
    tree: Tree
    status: str  # "executed" | "hit" | "cutoff"
    reason: str = ""


@dataclass(frozen=True)
class TargetOutput:
    """What a target provides to its dependents: a tree plus small JSON-able facts."""

    tree: Tree
    info: Mapping[str, Any] = field(default_factory=dict)


class Store(Protocol):
    """The CAS seam: blobs and trees by digest."""

    digester: Digester

    def put_bytes(self, data: bytes, executable: bool = False) -> FileEntry: ...
    def put_file(self, path: str, executable: bool = False) -> FileEntry: ...
    def read_bytes(self, entry: FileEntry) -> bytes: ...
    def has(self, entry: FileEntry) -> bool: ...
    def put_tree(self, tree: Tree) -> str: ...
    def get_tree(self, digest: str) -> Tree: ...
    def materialize(self, tree: Tree) -> str: ...


class ActionCache(Protocol):
    """The action-cache seam: results by key, and depfile manifests by prekey. Implemented by
    the local store (store/action_cache.py) and by the layered one (store/layered.py: local
    first, then a remote, whose hits arrive with their blobs verified in the local CAS), so the
    rebuilder and engine never know whether a remote is behind it."""

    def get(self, key: str) -> ActionResult | None: ...
    def put(self, key: str, result: ActionResult) -> None: ...
    def touch(self, key: str) -> None: ...
    def remove(self, key: str) -> None: ...
    def get_manifest(self, prekey: str) -> list[dict]: ...
    def add_manifest(self, prekey: str, entry: dict, keep: int = 8) -> None: ...


class Runner(Protocol):
    """The execution seam: runs one action and returns its output tree."""

    def run(self, action: Action) -> tuple[Tree, ActionResult]: ...
