"""Which recorded actions read a file: `bgraph why LABEL FILE` goes from a target down to the
actions (per TU and arch) that read a file, or the files a patch changes, as the last build of
each target in LABEL's closure recorded them (the trace) and as those actions' depfiles say.

A patch is followed through the patched_tree targets that apply it to the files it changes; a
file is looked up as a workspace source of a target and as a file a patched_tree's patches
change. An action read such a file if its depfile names it under one of the action's mounts
(`<mount>/<path>`) and, where the store can tell, with the digest the file has in that
target's output (so another tree's file of the same name is not taken for it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from build_graph import patches as patchlib
from build_graph.audit import action_subject, target_arch, target_archs
from build_graph.depfile import absolute, parse_depfile
from build_graph.graph import dependency_map, deps_in_order
from build_graph.labels import Label, parse_label
from build_graph.model import Digester, FileEntry
from build_graph.planner import expand_sources
from build_graph.store.action_cache import LocalActionCache
from build_graph.store.cas import LocalCas
from build_graph.store.trace import Trace
from build_graph.workspace import Workspace


@dataclass
class Provider:
    """A target that gives the file(s): a patched_tree applying the patch, or a target with
    the file among its sources."""

    label: Label | None  # None: no target of the closure names the file (it is looked for by path)
    files: dict[str, str | None]  # path in the target's output (or workspace path) -> digest, if known
    patch: str | None = None
    added_from: str | None = None  # a tree a patched_tree adds (`add`) holds it

    def via(self) -> str:
        if self.label is None:
            return "found by its path"
        if self.patch:
            return f"{self.patch}, applied by {self.label}"
        if self.added_from:
            return f"{self.added_from}, added by {self.label}"
        return f"from {self.label}"


@dataclass
class Read:
    target: str
    action: str
    mnemonic: str
    tu: str | None
    arch: str | None
    file: str
    provider: Provider


@dataclass
class Provenance:
    label: Label
    subject: str  # the patch or file asked about
    providers: list[Provider]
    reads: list[Read] = field(default_factory=list)
    recorded: bool = True  # whether LABEL's last build left a trace

    def to_json(self) -> dict[str, Any]:
        return {"label": str(self.label), "file": self.subject, "recorded": self.recorded,
                "providers": [{"target": p.label and str(p.label), "patch": p.patch, "added_from": p.added_from,
                               "files": sorted(p.files)} for p in self.providers],
                "reads": [{"target": r.target, "action": r.action, "mnemonic": r.mnemonic, "tu": r.tu,
                           "arch": r.arch, "file": r.file, "provider": r.provider.label and str(r.provider.label)}
                          for r in self.reads]}


class Finder:
    def __init__(self, ws: Workspace, base):
        self.ws = ws
        self.digester = Digester(ws.digest_function)
        self.trace = Trace(base, base.parent / "tmp")
        self.ac = LocalActionCache(base, base.parent / "tmp", create=False)
        self._cas = None
        self.base = base
        self._trees: dict[str, Any] = {}  # mounted trees by digest (one toolkit for a thousand actions)

    @property
    def cas(self) -> LocalCas:
        if self._cas is None:
            self._cas = LocalCas(self.base.parent.parent, self.digester)
        return self._cas

    def _output_tree(self, key: str):
        cached = self.ac.get(key)
        if cached is None:
            return None
        try:
            return self.cas.get_tree(cached.output_tree)
        except Exception:
            return None

    def _patched_output(self, label: Label):
        """The tree a patched_tree's last build made, where recorded."""
        for rec in self.trace.load(str(label)).get("last_build", []):
            if rec.get("name") == "apply patches":
                tree = self._output_tree(rec["key"])
                return tree.subtree("tree") if tree is not None else None
        return None

    def providers(self, closure: list[Label], path: str) -> list[Provider]:
        out = []
        for lab in closure:
            target = self.ws.targets[lab]
            try:
                expanded = expand_sources(self.ws, target)
            except Exception:
                continue
            if target.kind == "patched_tree":
                made = self._patched_output(lab)
                for patch in expanded.get("patches", []):
                    text = patchlib.decode((self.ws.root / patch).read_bytes())
                    changed = patchlib.files_changed(patch, text, target.attrs.strip)
                    if patch == path or path in changed:
                        files = changed if patch == path else [path]
                        out.append(Provider(lab, {f: _digest_in(made, f) for f in files}, patch))
                for prefix, source in target.attrs.add.items():
                    if not prefix or path.startswith(prefix.rstrip("/") + "/"):
                        if made is None or path in made.entries:
                            out.append(Provider(lab, {path: _digest_in(made, path)},
                                                added_from=str(parse_label(source, package=lab.package))))
            if any(path in paths for paths in expanded.values()):
                out.append(Provider(lab, {path: self.digester.of((self.ws.root / path).read_bytes())}))
        return out

    def reads(self, closure: list[Label], providers: list[Provider]) -> tuple[list[Read], bool]:
        """Every recorded action of the closure that read a provider's file; and whether the
        trace held anything at all."""
        wanted: dict[str, list[tuple[Provider, str, str | None]]] = {}  # file name -> candidates
        for p in providers:
            for f, digest in p.files.items():
                wanted.setdefault(f.rpartition("/")[2], []).append((p, f, digest))
        found: list[Read] = []
        recorded = False
        for lab in closure:
            data = self.trace.load(str(lab))
            recorded = recorded or bool(data)
            described = data.get("actions", {})
            archs = target_archs((r.get("name", ""), r.get("mnemonic", "")) for r in data.get("last_build", []))
            for rec in data.get("last_build", []):
                info = described.get(rec.get("name"), {})
                desc = info.get("description", {})
                if not desc.get("depfiles") or rec.get("status") not in ("executed", "hit", "cutoff"):
                    continue
                tree = self._output_tree(rec["key"])
                if tree is None:
                    continue
                mounts = set(desc.get("inputs", {}))
                hits = self._matches(tree, desc, mounts, wanted)
                if not hits:
                    continue
                entry = self._manifest_entry(info.get("key"), rec["key"])
                tu, arch = action_subject(rec["name"], rec.get("mnemonic", ""))
                arch = target_arch(tu, arch, archs)
                for provider, f, mount in hits:
                    if not self._same_digest(provider.files[f], entry, desc, mount, f):
                        continue
                    found.append(Read(str(lab), rec["name"], rec.get("mnemonic", ""), tu, arch, f, provider))
        return found, recorded

    def _matches(self, tree, desc, mounts, wanted):
        out = []
        for depfile in desc["depfiles"]:
            entry = tree.entries.get(depfile)
            if not isinstance(entry, FileEntry):
                continue
            for dep in parse_depfile(self.cas.read_bytes(entry).decode(errors="replace")):
                name = dep.rpartition("/")[2]
                if name not in wanted:
                    continue
                path = absolute(dep, desc.get("cwd", "/bgraph/out"))
                for provider, f, _digest in wanted[name]:
                    for mount in mounts:
                        if path == f"{mount}/{f}" and (provider, f, mount) not in out:
                            out.append((provider, f, mount))
        return out

    def _manifest_entry(self, prekey: str | None, key: str) -> dict | None:
        if not prekey:
            return None
        return next((e for e in self.ac.get_manifest(prekey) if e.get("key") == key), None)

    def _same_digest(self, digest: str | None, entry: dict | None, desc: dict, mount: str, f: str) -> bool:
        """Whether the file the action read at mount/f is the provider's (True where unknown)."""
        if digest is None:
            return True
        if entry is not None and mount in entry.get("reads", {}):
            read = entry["reads"][mount]
            return read.get(f, digest) == digest if "*" not in read else True
        mounted = desc.get("inputs", {}).get(mount)
        if mounted and mounted != "narrowed":
            if mounted not in self._trees:
                try:
                    self._trees[mounted] = self.cas.get_tree(mounted)
                except Exception:
                    self._trees[mounted] = None
            tree = self._trees[mounted]
            return tree is None or getattr(tree.entries.get(f), "digest", None) == digest
        return True

    def find(self, label: Label, path: str) -> Provenance:
        closure = deps_in_order(dependency_map(self.ws), [label])
        providers = self.providers(closure, path)
        if not providers:  # a file inside some tree no patch touches: look for it by path alone
            providers = [Provider(None, {path: None})]
        reads, recorded = self.reads(closure, providers)
        return Provenance(label, path, providers, reads, recorded)


def _digest_in(tree, path: str) -> str | None:
    if tree is None:
        return None
    entry = tree.entries.get(path)
    return entry.digest if isinstance(entry, FileEntry) else None
