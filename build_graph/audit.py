"""`bgraph audit LABEL`: what each patch hunk in LABEL's closure still changes.

For every patched_tree target in the closure, each patch is split into one patch file per hunk
(patches.py). A hunk's variant is that target with the hunk left out, its other hunks applied
in order as patch files of their own by the same rule; LABEL is built in that variant through
the ordinary Engine and cache (variants.py), so the variant executes only what the hunk
reaches. The variant's build and the ordinary one (the baseline) are then compared action by
action (same target, same action name): each action's output tree, and for a preprocessing
step whether its text differs in code or only in line positions (line markers, blank lines).
A `add`ed tree of a patched_tree (a header shim) is audited the same way, left out whole.
A hunk in the toolkit (a CCCL header, the shim) changes the key of every step that uses the
toolkit; audit_cutoff.py takes the steps after preprocessing from the baseline where they would
do its work again, so such a hunk costs the preprocessing it reaches (plus one checked sample of
each step kind), not a rebuild of every TU.

Per hunk:
- "breaks the build": LABEL fails without it (when LABEL fails with every hunk: builds without it);
- "dead": no compiled output, no other action's output and no file of LABEL's outputs changes in
  code (the preprocessed text may move lines; with line information compiled in, outputs that
  differ only because of that count as moved lines too);
- "live": which TUs, which archs (device code per arch), which host sides, which objects and
  cubins, which files of LABEL's outputs (members of a wheel or other zip), which actions exist
  only with or only without it (a CMake edit that changes the arch list renames them).

Hunks are independent by default: each variant leaves out one. Hunks that only apply together
(leaving out A makes patch fail on B, whose context holds A's lines) are left out together:
the variant grows by each hunk that then fails to apply, and the verdict is the group's, named
in the report. Hunks that apply apart but only build together (a helper and its callers) are
not grouped: leaving out the helper "breaks the build", and that is the finding.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from build_graph import patches as patchlib
from build_graph.audit_cutoff import Cutoff, Recorder, run_samples
from build_graph.engine import BuildOptions, BuildResult, Engine, NullReporter
from build_graph.errors import UsageError
from build_graph.graph import dependency_map, deps_in_order
from build_graph.labels import Label
from build_graph.model import FileEntry, Tree
from build_graph.planner import SourceFiles, expand_sources
from build_graph.variants import Variant
from build_graph.workspace import Target, Workspace

# Action mnemonics -> the stage of a TU's compile they make (nvcc_compile.STEP_MNEMONIC, cmake_project).
STAGES = {
    "CudaDevicePreprocess": "device_preprocessed", "CudaCicc": "ptx", "CudaPtxas": "cubins",
    "CudaHostPreprocess": "host_preprocessed", "CudaFrontend": "host_frontend", "CudaHostCompile": "host_objects",
    # fatbinary's step makes the TU's object (cubins embedded, joined to the host object); older
    # traces had a separate fatbin object (CudaFatbinObject) and link (CudaObjectLink).
    "CudaFatbinary": "objects", "CudaFatbinObject": "fatbinaries", "CudaObjectLink": "objects",
    "CmakeCompile": "objects", "CmakeConfigure": "configure",
}
PER_ARCH = {"CudaDevicePreprocess", "CudaCicc", "CudaPtxas"}
PREPROCESS = {"CudaDevicePreprocess", "CudaHostPreprocess"}
DEVICE_STAGES = ("device_preprocessed", "ptx", "cubins")
HOST_STAGES = ("host_preprocessed", "host_frontend", "host_objects")
COMPILE_STAGES = (*DEVICE_STAGES, *HOST_STAGES, "fatbinaries", "objects")
_APPLY_FAILED = re.compile(r"bgraph: patch (\S+) does not apply")
_LINE_MARKER = re.compile(rb"^#(?:line)?\s*\d+(?:\s.*)?$")


# -- what is audited ----------------------------------------------------------------------
@dataclass(frozen=True)
class Unit:
    """One thing a variant leaves out: a hunk of a patch, or a tree a patched_tree adds."""

    id: str  # "patches/x.patch#2" (also its virtual patch file's path), or "//t:cccl add include"
    target: Label  # the patched_tree target
    file: str  # the file a hunk changes; the directory an added tree goes to
    header: str = ""  # a hunk's @@ line
    added: int = 0
    removed: int = 0
    patch: str | None = None  # a hunk's patch file
    index: int = 0  # a hunk's position in its patch
    add: str | None = None  # an added tree's `add` key
    source: str | None = None  # an added tree's label

    def to_json(self) -> dict[str, Any]:
        out = {"id": self.id, "target": str(self.target), "file": self.file}
        if self.patch is not None:
            out.update(patch=self.patch, hunk=self.index, header=self.header, added=self.added, removed=self.removed)
        else:
            out.update(added_tree=self.source)
        return out


@dataclass
class Subject:
    """A patched_tree target in LABEL's closure and its units."""

    target: Target
    units: list[Unit]  # what is audited
    hunks: list[Unit]  # every hunk of the target's patches, in order
    blobs: dict[str, FileEntry]  # hunk id -> its patch file in the CAS

    def without(self, group: list[Unit]) -> Variant:
        """The variant of the workspace with `group` left out of this target."""
        gone = {u.id for u in group}
        hunks = [u for u in self.hunks if u.id not in gone]
        attrs = self.target.attrs.model_copy(update={
            "patches": [u.id for u in hunks],
            "add": {k: v for k, v in self.target.attrs.add.items()
                    if not any(u.add == k for u in group)}})
        name = f"audit {self.target.label} without " + (", ".join(sorted(gone)) or "nothing (hunks apart)")
        return Variant(name, {self.target.label: dataclasses.replace(self.target, attrs=attrs)},
                       {u.id: self.blobs[u.id] for u in hunks})


def subjects(ws: Workspace, label: Label, put_bytes: Callable[[bytes], FileEntry], files: SourceFiles,
             only: list[str] | None = None) -> list[Subject]:
    """Every patched_tree in `label`'s closure with its hunks (each hunk's patch file stored
    with `put_bytes`; `files`: the workspace's SourceFiles, which know the cache) and added
    trees; `only` (fnmatch patterns) keeps the units whose id or patch file matches one of them."""
    out = []
    for lab in deps_in_order(dependency_map(ws), [label]):
        target = ws.targets[lab]
        if target.kind != "patched_tree":
            continue
        units: list[Unit] = []
        blobs: dict[str, FileEntry] = {}
        for patch in expand_sources(ws, target, files).get("patches", []):
            text = patchlib.decode((ws.root / patch).read_bytes())
            for h in patchlib.split(patch, text, target.attrs.strip):
                units.append(Unit(h.id, lab, h.file, h.header, h.added, h.removed, patch, h.index))
                blobs[h.id] = put_bytes(patchlib.encode(h.text))
        hunks = list(units)
        for key, source in sorted(target.attrs.add.items()):
            units.append(Unit(f"{lab} add {key or '.'}", lab, key or ".", add=key, source=source))
        if only:
            units = [u for u in units if any(fnmatch.fnmatch(u.id, p) or fnmatch.fnmatch(u.patch or "", p)
                                             for p in only)]
        if units:
            out.append(Subject(target, units, hunks, blobs))
    return out


# -- one build, as the comparison sees it --------------------------------------------------
@dataclass
class Snapshot:
    ok: bool
    errors: list[str]
    actions: dict[tuple[str, str], tuple[str, str | None]]  # (label, action) -> (mnemonic, output tree)
    outputs: dict[str, Tree]  # requested label -> its output
    trees: dict[str, Tree] = field(default_factory=dict)  # other targets' outputs the audit looks at
    executed: int = 0
    hits: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0
    steps: dict[str, int] = field(default_factory=dict)  # mnemonic -> actions executed
    substituted: int = 0  # steps taken from the baseline (audit_cutoff.py)
    unread: int = 0  # preprocessing steps taken from the baseline: they read no toolkit file that differs
    samples: list[dict] = field(default_factory=list)  # the cutoff's check: one step of each kind run

    def cost(self) -> dict[str, Any]:
        return {"executed": self.executed, "hits": self.hits, "wall_s": round(self.wall_s, 1),
                "cpu_s": round(self.cpu_s, 1), "steps": dict(sorted(self.steps.items())),
                "substituted": self.substituted, "unread": self.unread, "samples": self.samples}


def snapshot(engine: Engine, result: BuildResult, labels: list[Label], extra: list[Label] = ()) -> Snapshot:
    actions = {}
    steps: dict[str, int] = {}
    for r in result.records:
        if r.status == "executed":
            steps[r.mnemonic] = steps.get(r.mnemonic, 0) + 1
        if r.status in ("executed", "hit", "cutoff"):
            cached = engine.ac.get(r.key)
            actions[(r.label, r.name)] = (r.mnemonic, cached.output_tree if cached else None)
    outputs, trees = {}, {}
    for lab in [*labels, *extra]:
        try:
            (outputs if lab in labels else trees)[str(lab)] = result.outputs[lab].tree
        except KeyError:
            pass
    summary = result.summary()
    cutoff = engine.rebuilder if isinstance(engine.rebuilder, Cutoff) else None
    return Snapshot(not result.failures, [e.render() for e in result.failures], actions, outputs, trees,
                    summary["executed"], summary["hits"] + summary["cut_off"], result.wall_s, summary["cpu_s"],
                    steps, len(cutoff.substituted) if cutoff else 0, len(cutoff.unread) if cutoff else 0)


# -- comparing two builds ----------------------------------------------------------------
def action_subject(name: str, mnemonic: str) -> tuple[str | None, str | None]:
    """(TU, arch) an action works on, from its name ("devpp k/a.cu 121a", "compile x.o")."""
    if mnemonic not in STAGES or mnemonic == "CmakeConfigure" or " " not in name:
        return None, None
    rest = name.split(" ", 1)[1]
    if mnemonic in PER_ARCH and " " in rest:
        tu, arch = rest.rsplit(" ", 1)
        return tu, arch
    return rest, None


def code_lines(data: bytes) -> list[bytes]:
    """Preprocessed text without what only says where it came from: line markers and blank lines."""
    return [line for line in data.split(b"\n") if line.strip() and not _LINE_MARKER.match(line)]


class Comparer:
    """Compares a variant's build with the baseline through the CAS."""

    def __init__(self, cas):
        self.cas = cas
        self._moved: dict[tuple[str, str], bool] = {}

    def moved_only(self, a: FileEntry, b: FileEntry) -> bool:
        """Whether two preprocessed files differ only in line positions (memoized)."""
        pair = (a.digest, b.digest)
        if pair not in self._moved:
            try:
                self._moved[pair] = code_lines(self.cas.read_bytes(a)) == code_lines(self.cas.read_bytes(b))
            except Exception:  # evicted meanwhile: not known to be the same
                self._moved[pair] = False
        return self._moved[pair]

    def _tree(self, digest: str | None) -> Tree | None:
        try:
            return self.cas.get_tree(digest) if digest else None
        except Exception:  # evicted meanwhile: compared by digest alone
            return None

    def positions_only(self, a: str | None, b: str | None) -> bool:
        """Whether two preprocessing outputs differ only in line positions."""
        ta, tb = self._tree(a), self._tree(b)
        if ta is None or tb is None:
            return False
        for path in set(ta.entries) | set(tb.entries):
            ea, eb = ta.entries.get(path), tb.entries.get(path)
            if ea == eb:
                continue
            if not (isinstance(ea, FileEntry) and isinstance(eb, FileEntry) and path.endswith((".ii", ".i"))):
                return False
            if not self.moved_only(ea, eb):
                return False
        return True

    def files(self, a: Tree | None, b: Tree | None) -> list[str]:
        """Paths of LABEL's output files that differ; inside a wheel (or other zip) its members."""
        if a is None or b is None:
            return []
        out = []
        for path in sorted(set(a.entries) | set(b.entries)):
            ea, eb = a.entries.get(path), b.entries.get(path)
            if ea == eb:
                continue
            members = self._zip_members(ea, eb) if path.endswith((".whl", ".zip")) else None
            out += [f"{path}:{m}" for m in members] if members else [path]
        return out

    def _zip_members(self, a, b) -> list[str] | None:
        """Members whose CRC or size differ (from the central directories: nothing is unpacked)."""
        if not (isinstance(a, FileEntry) and isinstance(b, FileEntry)):
            return None
        try:
            with zipfile.ZipFile(self.cas.blob_path(a.digest)) as za, zipfile.ZipFile(self.cas.blob_path(b.digest)) as zb:
                ia = {i.filename: (i.CRC, i.file_size) for i in za.infolist()}
                ib = {i.filename: (i.CRC, i.file_size) for i in zb.infolist()}
        except (OSError, zipfile.BadZipFile):
            return None
        return sorted(n for n in set(ia) | set(ib) if ia.get(n) != ib.get(n)) or None

    def compare(self, base: Snapshot, var: Snapshot, skip: set[str]) -> tuple[list[dict], list[dict]]:
        """(action changes, output file changes) of `var` against `base`; actions of targets in
        `skip` (the patched tree itself) are left out. Each change: label, action, stage, tu,
        arch, change ("code", "positions", "only with", "only without")."""
        changes: list[dict] = []
        # A target built in one of the two only is an edge the unit itself removed (an `add
        # include` left out drops the added tree's target): what it did shows downstream or not
        # at all, so its own actions say nothing (else every such unit came out live).
        if base.ok and var.ok:
            base_labels = {label for label, _ in base.actions}
            var_labels = {label for label, _ in var.actions}
            skip = set(skip) | {label.split(" ")[0] for label in base_labels ^ var_labels}
        for key in sorted(set(base.actions) | set(var.actions)):
            label, name = key
            if label.split(" ")[0] in skip:
                continue
            b, v = base.actions.get(key), var.actions.get(key)
            if b is not None and v is not None and b[1] == v[1]:
                continue
            if v is None and not var.ok:
                continue  # not reached in the failed variant: nothing to say
            mnemonic = (b or v)[0]
            tu, arch = action_subject(name, mnemonic)
            if b is None or v is None:
                change = "only without" if b is None else "only with"
            elif mnemonic in PREPROCESS and self.positions_only(b[1], v[1]):
                change = "positions"
            else:
                change = "code"
            changes.append({"label": label, "action": name, "mnemonic": mnemonic,
                            "stage": STAGES.get(mnemonic, "other"), "tu": tu, "arch": arch, "change": change})
        _name_archs(changes, [*base.actions.items(), *var.actions.items()])
        _attribute(changes)
        compiled = [c for c in changes if c["stage"] in COMPILE_STAGES]
        moved_only = bool(compiled) and all(c["change"] == "positions" for c in compiled)
        for c in changes:
            if c["stage"] not in COMPILE_STAGES and c["change"] == "code" and moved_only:
                c["change"] = "positions"
        files = [{"path": f"{label}:{p}", "change": "positions" if moved_only else "code"}
                 for label in sorted(set(base.outputs) & set(var.outputs))
                 for p in self.files(base.outputs[label], var.outputs[label])]
        return changes, files


def target_archs(named: Iterable[tuple[str, str]]) -> dict[str, set[str]]:
    """TU -> the archs its cicc and ptxas steps are named after (121a), from (name, mnemonic)."""
    archs: dict[str, set[str]] = {}
    for name, mnemonic in named:
        if mnemonic in ("CudaCicc", "CudaPtxas"):
            tu, arch = action_subject(name, mnemonic)
            archs.setdefault(tu, set()).add(arch)
    return archs


def target_arch(tu: str | None, arch: str | None, archs: dict[str, set[str]]) -> str | None:
    """Device preprocessing is named after the target (121a) as the later steps are; a trace
    recorded before that names it after __CUDA_ARCH__ (1210): the target name, where exactly
    one of the TU's fits."""
    if not arch or not arch.isdigit():
        return arch
    fits = [a for a in archs.get(tu, ()) if a.rstrip("af") == str(int(arch) // 10)]
    return fits[0] if len(fits) == 1 else arch


def _name_archs(changes: list[dict], actions) -> None:
    archs = target_archs((name, mnemonic) for (_label, name), (mnemonic, _tree) in actions)
    for c in changes:
        if c["stage"] == "device_preprocessed":
            c["arch"] = target_arch(c["tu"], c["arch"], archs)


def _attribute(changes: list[dict]) -> None:
    """A compile step whose preprocessed input moved lines only differs for that reason (line
    information): its change is "positions" too."""
    dev = {(c["tu"], c["arch"]): c["change"] for c in changes if c["stage"] == "device_preprocessed"}
    host = {c["tu"]: c["change"] for c in changes if c["stage"] == "host_preprocessed"}
    for c in changes:
        if c["change"] != "code":
            continue
        tu = c["tu"]
        if c["stage"] in ("ptx", "cubins"):
            moved = dev.get((tu, c["arch"])) == "positions"
        elif c["stage"] in ("host_frontend", "host_objects"):
            moved = host.get(tu) == "positions"
        elif c["stage"] in ("fatbinaries", "objects") and c["mnemonic"] != "CmakeCompile":
            mine = [v for (t, _a), v in dev.items() if t == tu] + ([host[tu]] if tu in host else [])
            moved = bool(mine) and all(v == "positions" for v in mine)
        else:
            moved = False
        if moved:
            c["change"] = "positions"


# -- verdicts ------------------------------------------------------------------------------
@dataclass
class UnitResult:
    unit: Unit
    group: list[Unit]
    verdict: str  # "dead" | "live" | "breaks the build" | "unknown"
    changes: list[dict] = field(default_factory=list)
    files: list[dict] = field(default_factory=list)
    error: str | None = None
    note: str | None = None
    cost: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        code = [c for c in self.changes if c["change"] != "positions"]

        def stage(name: str, per_arch: bool) -> list[dict]:
            return [{"tu": c["tu"], **({"arch": c["arch"]} if per_arch else {}), "change": c["change"]}
                    for c in self.changes if c["stage"] == name]

        archs = sorted({c["arch"] for c in code if c["stage"] in DEVICE_STAGES and c["arch"]})
        out = {
            **self.unit.to_json(),
            "group": [u.id for u in self.group],
            "verdict": self.verdict,
            "tus": sorted({c["tu"] for c in code if c["tu"] and c["stage"] in COMPILE_STAGES}),
            "archs": archs,
            "archs_only_with": sorted({c["arch"] for c in code if c["change"] == "only with" and c["arch"]}),
            "archs_only_without": sorted({c["arch"] for c in code if c["change"] == "only without" and c["arch"]}),
            "host": sorted({c["tu"] for c in code if c["stage"] in HOST_STAGES and c["tu"]}),
            "device_preprocessed": stage("device_preprocessed", True),
            "host_preprocessed": stage("host_preprocessed", False),
            "ptx": stage("ptx", True),
            "cubins": stage("cubins", True),
            "objects": stage("objects", False),
            "configure": next((c["change"] for c in self.changes if c["stage"] == "configure"), None),
            "outputs": self.files,
            "other_actions": [{"label": c["label"], "action": c["action"], "change": c["change"]}
                              for c in self.changes if c["stage"] not in COMPILE_STAGES and c["stage"] != "configure"],
            "error": self.error,
            "note": self.note,
            "cost": self.cost,
        }
        return out


def verdict(changes: list[dict], files: list[dict]) -> str:
    if any(c["change"] != "positions" for c in changes) or any(f["change"] != "positions" for f in files):
        return "live"
    return "dead"


# -- the audit -----------------------------------------------------------------------------
@dataclass
class AuditOptions:
    jobs: int = 2
    max_mem_mb: int = 4096
    only: list[str] = field(default_factory=list)
    cutoff: bool = True  # take unchanged compile steps from the baseline (audit_cutoff.py)


class Audit:
    """Runs the baseline and every unit's variant; `progress(line)` hears what it does and
    `reporter()` gives each build's reporter."""

    def __init__(self, ws: Workspace, cache_dir: Path, label: Label, options: AuditOptions | None = None,
                 progress: Callable[[str], None] | None = None, reporter: Callable[[], Any] | None = None):
        self.ws, self.cache_dir, self.label = ws, cache_dir, label
        self.options = options or AuditOptions()
        self.progress = progress or (lambda line: None)
        self.reporter = reporter or NullReporter
        self.builds: list[Snapshot] = []
        self._recorder: Recorder | None = None
        self._comparer: Comparer | None = None

    def _build(self, variant: Variant | None, labels: list[Label], keep_going: bool) -> Snapshot:
        opts = BuildOptions(jobs=self.options.jobs, max_mem_mb=self.options.max_mem_mb, keep_going=keep_going)
        engine = Engine(self.ws, self.cache_dir, opts, self.reporter(), variant=variant)
        if self._recorder is not None and self._comparer is not None:
            engine.rebuilder = Cutoff(engine.rebuilder, engine.digester, self._recorder.outcomes,
                                      self._comparer.moved_only, self._comparer.cas.read_bytes)
        try:
            snap = snapshot(engine, engine.build(labels), labels)
            if isinstance(engine.rebuilder, Cutoff) and snap.ok:
                start = time.monotonic()
                snap.samples = run_samples(engine, engine.rebuilder)
                snap.wall_s += time.monotonic() - start
                for sample in snap.samples:
                    if sample["ran"]:
                        snap.executed += 1
                        snap.cpu_s += sample["cpu_s"]
                        snap.steps[sample["mnemonic"]] = snap.steps.get(sample["mnemonic"], 0) + 1
        finally:
            if variant is not None:
                engine.cas.close()
        self.builds.append(snap)
        return snap

    def run(self) -> dict[str, Any]:
        start = time.monotonic()
        ws, label = self.ws, self.label
        ws.target(label)
        base_engine = Engine(ws, self.cache_dir, BuildOptions(jobs=self.options.jobs,
                                                              max_mem_mb=self.options.max_mem_mb), self.reporter())
        found = subjects(ws, label, base_engine.cas.put_bytes, SourceFiles(ws.root, self.cache_dir),
                         self.options.only)
        if not found:
            raise UsageError(f"no patch hunk in {label}'s closure" + (f" matches {self.options.only}"
                                                                      if self.options.only else ""),
                             hint="audit a target built from a patched_tree (kind = \"patched_tree\")")
        self.progress(f"baseline: {label}")
        comparer = self._comparer = Comparer(base_engine.cas)
        if self.options.cutoff:
            base_engine.rebuilder = self._recorder = Recorder(base_engine.rebuilder, base_engine.digester)
        base = snapshot(base_engine, base_engine.build([label]), [label], [s.target.label for s in found])
        self.builds.append(base)
        total = sum(len(s.units) for s in found)
        report_subjects = []
        n = 0
        for subject in found:
            done: dict[frozenset[str], UnitResult] = {}
            reference, note = self._reference(subject, base, comparer)
            results = []
            for unit in subject.units:
                n += 1
                self.progress(f"[{n}/{total}] without {unit.id}")
                r = self._audit_unit(subject, unit, reference, comparer, done)
                results.append(r)
                self.progress(f"[{n}/{total}] {unit.id}: {r.verdict}"
                              + (f" ({r.cost['executed']} actions executed, {r.cost['wall_s']} s)" if r.cost else ""))
            report_subjects.append((subject, note, results))
        return self._report(base, report_subjects, time.monotonic() - start)

    def _reference(self, subject: Subject, base: Snapshot, comparer: Comparer) -> tuple[Snapshot, str | None]:
        """The baseline, checked against the patched tree built from the hunks apart: where the
        two differ (hunks that overlap), the build from the hunks apart is the reference."""
        lab = subject.target.label
        if not base.ok:
            return base, None
        variant = subject.without([])
        apart = self._build(variant, [lab], keep_going=False)
        if apart.ok and apart.outputs.get(str(lab)) == base.trees.get(str(lab)):
            return base, None
        self.progress(f"{lab}: applied hunk by hunk, the tree differs from the whole patches; "
                      "comparing against the build from the hunks apart")
        ref = self._build(variant, [self.label], keep_going=False)
        return ref, (f"{lab} applied hunk by hunk differs from the whole patches (overlapping hunks); "
                     "variants are compared with the build from the hunks apart")

    def _audit_unit(self, subject: Subject, unit: Unit, reference: Snapshot, comparer: Comparer,
                    done: dict[frozenset[str], UnitResult]) -> UnitResult:
        by_id = {u.id: u for u in subject.hunks}
        group = [unit]
        # Hunks that only apply together: grow the group by each hunk that then fails to apply.
        while True:
            applied = self._build(subject.without(group), [subject.target.label], keep_going=False)
            if applied.ok:
                break
            failing = next((m.group(1) for e in applied.errors for m in [_APPLY_FAILED.search(e)] if m), None)
            if failing not in by_id or by_id[failing] in group:
                return UnitResult(unit, group, "unknown", error=applied.errors[0] if applied.errors else None,
                                  note="the patched tree cannot be made without it", cost=applied.cost())
            group.append(by_id[failing])
        key = frozenset(u.id for u in group)
        if key in done:
            shared = done[key]
            return dataclasses.replace(shared, unit=unit, note=f"the same variant as {shared.unit.id}", cost={})
        var = self._build(subject.without(group), [self.label], keep_going=True)
        note = (f"applies only together with {', '.join(u.id for u in group[1:])}: left out together"
                if len(group) > 1 else None)
        if not reference.ok:
            result = UnitResult(unit, group, "breaks the build" if var.ok else "unknown", cost=var.cost(),
                                note=(f"{self.label} fails with it and builds without it" if var.ok
                                      else f"{self.label} fails with and without it"),
                                error=reference.errors[0] if reference.errors else None)
        elif not var.ok:
            changes, files = comparer.compare(reference, var, {str(subject.target.label)})
            result = UnitResult(unit, group, "breaks the build", changes, files, var.errors[0], note, var.cost())
        else:
            changes, files = comparer.compare(reference, var, {str(subject.target.label)})
            result = UnitResult(unit, group, verdict(changes, files), changes, files, None, note, var.cost())
            failed = [s["action"] for s in var.samples if not s["same"] and s["inputs"] == "toolkit"]
            if failed:  # the cutoff's assumption does not hold for this unit: its verdict is not known
                result.verdict = "unknown"
                result.note = (f"the cutoff's check failed: {failed[0]} gives another output with this toolkit; "
                               "audit it with AuditOptions(cutoff=False)")
        done[key] = result
        return result

    def _report(self, base: Snapshot, found, wall_s: float) -> dict[str, Any]:
        patches_out = []
        for subject, note, results in found:
            by_patch: dict[str | None, list[UnitResult]] = {}
            for r in results:
                by_patch.setdefault(r.unit.patch, []).append(r)
            for patch, rs in by_patch.items():
                counts: dict[str, int] = {}
                for r in rs:
                    counts[r.verdict] = counts.get(r.verdict, 0) + 1
                patches_out.append({"patch": patch, "target": str(subject.target.label), "verdicts": counts,
                                    "note": note, "units": [r.to_json() for r in rs]})
        variants = self.builds[1:]
        substituted = sum(s.substituted + s.unread for s in variants)
        return {
            "label": str(self.label),
            "baseline": {"ok": base.ok, "error": base.errors[0] if base.errors else None, **base.cost()},
            "patches": patches_out,
            "hunks": sum(len(p["units"]) for p in patches_out),
            "cost": {"builds": len(variants), "executed": sum(s.executed for s in variants),
                     "substituted": substituted, "cpu_s": round(sum(s.cpu_s for s in variants), 1),
                     "wall_s": round(wall_s, 1)},
        }
