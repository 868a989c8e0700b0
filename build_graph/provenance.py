"""Which recorded actions read a file: `bgraph why LABEL FILE` goes from a target down to the
actions (per TU and arch) that read a file, or the files a patch changes, as the last build of
LABEL in its configuration recorded them (the trace of each configured target below it) and
as those actions' depfiles say.

LABEL is taken in the configuration a build of it has (configs.py): `--platform`'s, else its
own `platform`, else this machine's; where that one has no record and exactly one other
configuration of it does (a library built only under the Spark's aarch64 wheel), that one, and
the answer says so. Every target below it is the configured target that build planned
(`//vllm:build-sm121 (aarch64)`), whose trace is the one read.

A patch is followed through the patched_tree targets that apply it to the files it changes; a
file is looked up as a workspace source of a target (under its `strip_prefix`, where it has
one) and as a file a patched_tree's patches change. What counts as a read, from what each
action's record says:

- a depfile names the file under one of the action's mounts (`<mount>/<path>`; the staged
  build directory also at /bgraph/out), with the digest the file has in the provider's output
  where the store can tell (so another tree's file of the same name is not taken for it);
- an action whose mount is not narrowed (no depfile decides what it read: a custom command,
  a link, the patch application, a configure keyed on its whole tree) holds every file of that
  mount in its key and can read any of them: it "reads all of <mount> (not narrowed)" where the
  mounted tree holds the file with the provider's digest. A narrowed mount that its run
  recorded whole (a depfile path through a symlink) counts the same way.

Each trace says which workspace's build wrote it (traces live in the cache, which workspaces
may share): an answer read from another workspace's build says so.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import orjson

from build_graph import configs
from build_graph import patches as patchlib
from build_graph.audit import action_subject, target_arch, target_archs
from build_graph.depfile import absolute, parse_depfile
from build_graph.labels import Label, parse_label
from build_graph.model import Digester, FileEntry
from build_graph.planner import SourceFiles, expand_sources
from build_graph.store.action_cache import LocalActionCache
from build_graph.store.cas import LocalCas
from build_graph.store.trace import Trace
from build_graph.workspace import Workspace, host_platform

USED = ("executed", "hit", "cutoff")  # statuses of the actions a build's outputs came from
OUT = "/bgraph/out"
_UNKNOWN = object()  # a mounted tree the store no longer holds


@dataclass
class Provider:
    """A target that gives the file(s): a patched_tree applying the patch, or a target with
    the file among its sources."""

    label: configs.Configured | None  # None: no target of the closure names the file (looked for by path)
    files: dict[str, str | None]  # path in the target's tree -> digest, if known
    patch: str | None = None
    added_from: str | None = None  # a tree a patched_tree adds (`add`) holds it
    source: str | None = None  # the workspace path, where the tree's path differs (strip_prefix)

    def via(self) -> str:
        if self.label is None:
            return "found by its path"
        if self.patch:
            return f"{self.patch}, applied by {self.label}"
        if self.added_from:
            return f"{self.added_from}, added by {self.label}"
        return f"{self.source}, from {self.label}" if self.source else f"from {self.label}"


@dataclass
class Read:
    target: str
    action: str
    mnemonic: str
    tu: str | None
    arch: str | None
    file: str
    provider: Provider
    mount: str = ""  # where the action saw the file
    whole: bool = False  # not narrowed: the action's key holds the whole mount, the file among them

    def how(self) -> str:
        return f"reads all of {self.mount} (not narrowed)" if self.whole else f"depfile: {self.mount}/{self.file}"


@dataclass
class Provenance:
    label: Label
    subject: str  # the patch or file asked about
    providers: list[Provider]
    reads: list[Read] = field(default_factory=list)
    recorded: bool = True  # whether LABEL's last build (in this configuration) left a trace
    root: configs.Configured | None = None  # LABEL in the configuration answered for
    note: str | None = None  # how that configuration was chosen, where not the obvious one
    other_configs: list[str] = field(default_factory=list)  # recorded configurations of LABEL not taken
    chains: dict[str, list[str]] = field(default_factory=dict)  # reading target -> path from LABEL
    foreign: dict[str, str] = field(default_factory=dict)  # target -> the other workspace its trace is from
    unchecked: int = 0  # actions whose recorded outputs or mounts the cache no longer holds
    build_command: str = ""  # the build that would record what is asked about

    def to_json(self) -> dict[str, Any]:
        return {"label": str(self.label), "configured": self.root and str(self.root),
                "platform": self.root and self.root.config.target, "file": self.subject,
                "recorded": self.recorded, "note": self.note, "other_configurations": self.other_configs,
                "providers": [{"target": p.label and str(p.label), "patch": p.patch, "added_from": p.added_from,
                               "files": sorted(p.files)} for p in self.providers],
                "reads": [{"target": r.target, "action": r.action, "mnemonic": r.mnemonic, "tu": r.tu,
                           "arch": r.arch, "file": r.file, "provider": r.provider.label and str(r.provider.label),
                           "mount": r.mount, "narrowed": not r.whole}
                          for r in self.reads],
                "traces_from_other_workspaces": self.foreign, "unchecked_actions": self.unchecked}


def trace_workspace(data: dict[str, Any], ws: Workspace) -> str | None:
    """The other workspace whose build wrote this trace (None: this one's, or not recorded)."""
    written = data.get("workspace")
    if not written or _same_dir(written, ws.root):
        return None
    return written


def _same_dir(a, b) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def configured(ws: Workspace, trace: Trace, label: Label, platform: str | None
               ) -> tuple[configs.Configured, str | None, str | None, list[str]]:
    """LABEL in the configuration of its last build: (configured target, the --platform to
    configure its dependencies with, a note where the configuration was not the requested one,
    the other recorded configurations of it)."""
    [root] = configs.requested(ws, [label], None, platform)
    others = [x for x in trace.labels_of(str(label)) if x != str(root)]
    if platform or trace.has(str(root)):
        return root, platform, None, others
    machine = host_platform()
    cross = [x for x in others if " on " not in x]  # "(aarch64 on x86_64)" is a plan for another host
    if len(cross) != 1:
        return root, platform, None, others
    target = cross[0][len(str(label)) + 2:-1] if cross[0] != str(label) else machine
    config = configs.own_config(ws, label, configs.Config(machine, target), None)
    forced = None  # as a dependency of a target built for `target` (its own platform attribute is kept)
    if config.target != target:  # its own platform attribute says otherwise: that build had --platform
        [alt] = configs.requested(ws, [label], None, target)
        forced = target
    else:
        alt = configs.Configured(label, config, config.tag(machine))
    note = (f"{root} has no recorded build; shown is the last build of {alt}, for {target} "
            f"(`--platform {root.config.target}` asks for the other)")
    return alt, forced, note, []


class Finder:
    def __init__(self, ws: Workspace, base):
        self.ws = ws
        self.digester = Digester(ws.digest_function)
        self.trace = Trace(base, base.parent / "tmp", create=False)
        self.ac = LocalActionCache(base, base.parent / "tmp", create=False)
        self._cas = None
        self.base = base
        # base is <cache>/v1/<digest function>: globs never reach the cache, as in a build.
        self.files = SourceFiles(ws.root, base.parent.parent)
        self._nodes: dict[str, Any] = {}  # directory node digest -> parsed node (None: not stored)
        self._held: dict[tuple[str, str], Any] = {}  # (mounted tree, path) -> FileEntry | None | _UNKNOWN
        self._inodes: dict[str, set[int]] = {}
        self._depfiles: dict[str, list[str]] = {}
        self._traces: dict[str, dict] = {}

    @property
    def cas(self) -> LocalCas:
        if self._cas is None:
            self._cas = LocalCas(self.base.parent.parent, self.digester)
        return self._cas

    def load(self, node) -> dict[str, Any]:
        name = str(node)
        if name not in self._traces:
            self._traces[name] = self.trace.load(name)
        return self._traces[name]

    def _output_tree(self, key: str):
        cached = self.ac.get(key)
        if cached is None:
            return None
        try:
            return self.cas.get_tree(cached.output_tree)
        except Exception:
            return None

    def _patched_output(self, node):
        """The tree a patched_tree's last build made, where recorded."""
        for rec in self.load(node).get("last_build", []):
            if rec.get("name") == "apply patches":
                tree = self._output_tree(rec["key"])
                return tree.subtree("tree") if tree is not None else None
        return None

    def providers(self, closure: list, path: str) -> list[Provider]:
        out = []
        expanded_by: dict[Label, dict[str, list[str]] | None] = {}
        for node in closure:
            lab = node.label
            target = self.ws.targets[lab]
            if lab not in expanded_by:
                try:
                    expanded_by[lab] = expand_sources(self.ws, target, self.files)
                except Exception:
                    expanded_by[lab] = None
            expanded = expanded_by[lab]
            if expanded is None:
                continue
            if target.kind == "patched_tree":
                made = self._patched_output(node)
                for patch in expanded.get("patches", []):
                    text = patchlib.decode((self.ws.root / patch).read_bytes())
                    changed = patchlib.files_changed(patch, text, target.attrs.strip)
                    if patch == path or path in changed:
                        files = changed if patch == path else [path]
                        out.append(Provider(node, {f: _digest_in(made, f) for f in files}, patch))
                for prefix, source in target.attrs.add.items():
                    if not prefix or path.startswith(prefix.rstrip("/") + "/"):
                        if made is None or path in made.entries:
                            out.append(Provider(node, {path: _digest_in(made, path)},
                                                added_from=str(parse_label(source, package=lab.package))))
            if any(path in paths for paths in expanded.values()):
                digest = self.digester.of((self.ws.root / path).read_bytes())
                prefix = (getattr(target.attrs, "strip_prefix", "") or "").strip("/")
                if prefix and path.startswith(prefix + "/"):  # the target's tree has it without the prefix
                    out.append(Provider(node, {path[len(prefix) + 1:]: digest}, source=path))
                else:
                    out.append(Provider(node, {path: digest}))
        return out

    def reads(self, closure: list, providers: list[Provider]) -> tuple[list[Read], int]:
        """Every recorded action of the closure that read (or, not narrowed, could read) a
        provider's file; and how many actions could not be checked (gone from the cache)."""
        wanted: dict[str, list[tuple[Provider, str, str | None]]] = {}  # file name -> candidates
        for p in providers:
            for f, digest in p.files.items():
                wanted.setdefault(f.rpartition("/")[2], []).append((p, f, digest))
        found: list[Read] = []
        unchecked = 0
        for node in closure:
            data = self.load(node)
            described = data.get("actions", {})
            records = data.get("last_build", [])
            archs = target_archs((r.get("name", ""), r.get("mnemonic", "")) for r in records)
            for rec in records:
                info = described.get(rec.get("name"))
                if info is None or rec.get("status") not in USED:
                    continue
                hits, gone = self._action_reads(rec, info, wanted)
                unchecked += gone
                if not hits:
                    continue
                tu, arch = action_subject(rec["name"], rec.get("mnemonic", ""))
                arch = target_arch(tu, arch, archs)
                for provider, f, mount, whole in hits:
                    found.append(Read(str(node), rec["name"], rec.get("mnemonic", ""), tu, arch, f, provider,
                                      mount, whole))
        return found, unchecked

    def _action_reads(self, rec: dict, info: dict, wanted) -> tuple[list[tuple], int]:
        """(provider, file, mount, whole) for each provider file this action read; and 1 where
        what it read could not be told (its outputs or a mounted tree are gone from the cache)."""
        desc = info.get("description", {})
        inputs: dict[str, str] = desc.get("inputs", {})
        hits: list[tuple] = []
        gone = 0
        entry = None
        if desc.get("depfiles"):
            deps = self._depfile_reads(rec["key"], desc)
            if deps is None:
                gone = 1
            else:
                entry = self._manifest_entry(info.get("key"), rec["key"]) if desc.get("narrow") else None
                staged = desc.get("staged")
                for dep in deps:
                    for provider, f, digest in wanted.get(dep.rpartition("/")[2], ()):
                        for mount in inputs:
                            roots = (mount, OUT) if mount == staged else (mount,)
                            if not any(dep == f"{r}/{f}" for r in roots):
                                continue
                            if any(h[:3] == (provider, f, mount) for h in hits):
                                continue
                            if self._same_digest(digest, entry, inputs, mount, f):
                                hits.append((provider, f, mount, False))
        # Mounts held whole: not narrowed, or narrowed but recorded whole by the run.
        whole: dict[str, str] = {m: d for m, d in inputs.items() if d != "narrowed"}
        if any(d == "narrowed" for d in inputs.values()):
            entry = entry or self._manifest_entry(info.get("key"), rec["key"])
            for mount, files in ((entry or {}).get("reads") or {}).items():
                if "*" in files and inputs.get(mount) == "narrowed":
                    whole[mount] = files["*"]
        for mount, tree in whole.items():
            for candidates in wanted.values():
                for provider, f, digest in candidates:
                    if any(h[:3] == (provider, f, mount) for h in hits):
                        continue
                    held = self._held_file(tree, f, digest)
                    if held is _UNKNOWN:
                        gone = 1
                    elif held:
                        hits.append((provider, f, mount, True))
        return hits, gone

    def _depfile_reads(self, key: str, desc: dict) -> list[str] | None:
        """Every path the action's depfiles name (absolute, normalised); None: its outputs are gone."""
        if key in self._depfiles:
            return self._depfiles[key]
        tree = self._output_tree(key)
        deps: list[str] | None = None
        if tree is not None:
            deps = []
            cwd = desc.get("cwd", OUT)
            for depfile in desc["depfiles"]:
                entry = tree.entries.get(depfile)
                if isinstance(entry, FileEntry):
                    text = self.cas.read_bytes(entry).decode(errors="replace")
                    deps.extend(absolute(d, cwd) for d in parse_depfile(text))
        self._depfiles[key] = deps
        return deps

    def _manifest_entry(self, prekey: str | None, key: str) -> dict | None:
        if not prekey:
            return None
        return next((e for e in self.ac.get_manifest(prekey) if e.get("key") == key), None)

    def _same_digest(self, digest: str | None, entry: dict | None, inputs: dict, mount: str, f: str) -> bool:
        """Whether the file the action read at mount/f is the provider's (True where unknown)."""
        if digest is None:
            return True
        if entry is not None and mount in entry.get("reads", {}):
            read = entry["reads"][mount]
            return read.get(f, digest) == digest if "*" not in read else True
        mounted = inputs.get(mount)
        if mounted and mounted != "narrowed":
            held = self._held_file(mounted, f, digest)
            return held is _UNKNOWN or bool(held)
        return True

    # -- files of mounted trees --------------------------------------------------------
    # An input mount's tree is known by its digest. The store has its directory nodes where it
    # was once an output (a patched tree, a toolkit), and every tree an action ran with is
    # materialized under trees/<digest> until `cache gc` removes it.

    def _held_file(self, tree: str, path: str, digest: str | None):
        """Whether the mounted tree holds `path` (with `digest`, where given): True, False, or
        _UNKNOWN where the store holds neither its nodes nor its materialized copy."""
        key = (tree, path)
        if key not in self._held:
            self._held[key] = self._lookup(tree, path)
        entry = self._held[key]
        if entry is _UNKNOWN or entry is None:
            return entry if entry is _UNKNOWN else False
        if isinstance(entry, FileEntry):
            return digest is None or entry.digest == digest
        return digest is None or self._same_inode(entry, digest)  # a materialized file: its path

    def _lookup(self, tree: str, path: str):
        """FileEntry (from the tree's nodes), the path of the materialized file, None (absent)
        or _UNKNOWN."""
        node = self._node(tree)
        if node is not None:
            parts = path.split("/")
            for i, part in enumerate(parts):
                if i == len(parts) - 1:
                    for name, fd, size, ex in node.get("files", ()):
                        if name == part:
                            return FileEntry(fd, size, ex)
                    return None
                sub = next((d for name, d in node.get("dirs", ()) if name == part), None)
                node = self._node(sub) if sub else None
                if node is None:
                    return None if sub is None else _UNKNOWN
        materialized = self.cas.trees / tree
        if not materialized.is_dir():
            return _UNKNOWN
        where = materialized / path
        return str(where) if where.is_file() and not where.is_symlink() else None

    def _node(self, digest: str):
        if digest not in self._nodes:
            raw = self.cas.node_bytes(digest)
            self._nodes[digest] = orjson.loads(raw) if raw is not None else None
        return self._nodes[digest]

    def _same_inode(self, where: str, digest: str) -> bool:
        """Whether a materialized file is the blob `digest` (a hard link to it, or its bytes)."""
        if digest not in self._inodes:
            inodes = set()
            blob = self.cas.blob_path(digest)
            for p in (blob, blob.with_name(blob.name + ".x")):
                try:
                    inodes.add(os.stat(p).st_ino)
                except OSError:
                    pass
            self._inodes[digest] = inodes
        try:
            if os.stat(where).st_ino in self._inodes[digest]:
                return True
            with open(where, "rb") as f:
                return self.digester.of(f.read()) == digest
        except OSError:
            return False

    def find(self, label: Label, path: str, platform: str | None = None) -> Provenance:
        root, forced, note, others = configured(self.ws, self.trace, label, platform)
        graph = configs.configure(self.ws, [root], forced)
        closure = graph.order
        providers = self.providers(closure, path)
        if not providers:  # a file inside some tree no patch touches: look for it by path alone
            providers = [Provider(None, {path: None})]
        recorded = self.trace.has(str(root))
        reads, unchecked = self.reads(closure, providers) if recorded else ([], 0)
        prov = Provenance(label, path, providers, reads, recorded, root, note, others,
                          unchecked=unchecked)
        prov.chains = _chains(graph, root, {r.target for r in reads})
        [own] = configs.requested(self.ws, [label], None, None)
        prov.build_command = f"bgraph build {label}" if own == root else \
            f"bgraph build --platform {root.config.target} {label}"
        for node in closure:
            other = trace_workspace(self.load(node), self.ws) if self.trace.has(str(node)) else None
            if other and (node == root or str(node) in prov.chains):
                prov.foreign[str(node)] = other
        return prov


def _chains(graph: configs.ConfiguredGraph, root, targets: set[str]) -> dict[str, list[str]]:
    """For each reading target, one path of configured targets from root down to it."""
    parent: dict[Any, Any] = {root: None}
    queue = [root]
    for node in queue:  # breadth first: the shortest path
        for dep in graph.deps.get(node, ()):
            if dep not in parent:
                parent[dep] = node
                queue.append(dep)
    out = {}
    for node in parent:
        if str(node) in targets:
            chain = []
            at = node
            while at is not None:
                chain.append(str(at))
                at = parent[at]
            out[str(node)] = chain[::-1]
    return out


def _digest_in(tree, path: str) -> str | None:
    if tree is None:
        return None
    entry = tree.entries.get(path)
    return entry.digest if isinstance(entry, FileEntry) else None
