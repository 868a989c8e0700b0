"""The audit's cutoff after preprocessing: a hunk costs the preprocessing it reaches, not every
compile step downstream of a changed toolkit.

Every action that uses a toolkit is keyed on the whole toolkit tree, so a variant whose toolkit
differs by one header (a CCCL hunk, the FP4 shim) misses on every step of every TU: cicc,
ptxas, cudafe++ and the host compile of a TU that never includes the header run again, and so
do those of a TU whose preprocessed text only moved lines. Both are the same work as the
baseline's: nvcc's steps after preprocessing read the preprocessed text, the PTX, the cubins
and the toolkit's programs, not the headers a TU includes (those reach them only through
preprocessing, which always runs again here, so its output is compared, never assumed).

So in a variant a step after preprocessing whose baseline counterpart (the same command,
environment, outputs and mounts) differs from it only
- in the toolkit, at headers (files under include/), and/or
- in preprocessed text (.ii) that moves lines only (what the audit counts as no change),
is taken from the baseline instead of run. The assumption is checked in each variant: after the
build, one step of each kind taken from the baseline (the quickest in the baseline, one that
differs in the toolkit alone where there is one) runs for real; a different output there makes
the unit's verdict "unknown". (The host compile and the fatbinary object include the toolkit's
crt/host_runtime.h and fatbinary_section.h: a unit that changes those fails its check.)
The substituted results are never filed under the variant's keys: the cache holds only what ran.

A preprocessing step is taken from the baseline where its depfile says it read none of the
toolkit files that differ (the depfile-narrowed key the rebuilder gives source trees, applied to
the toolkit), all its other inputs being the same. A file the variant adds to the toolkit or
takes away (the FP4 shim) could change the output unread: through `__has_include` or by
shadowing a header of that name. Such a step is taken from the baseline only if no file it read
has that name or mentions it.
"""

from __future__ import annotations

from typing import Any, Callable

from build_graph.depfile import absolute, parse_depfile
from build_graph.model import Action, FileEntry, Tree
from build_graph.rebuilder import Hit, Miss
from build_graph.rules.base import OUT, TOOLCHAIN

# nvcc's steps after preprocessing (nvcc_compile.STEP_MNEMONIC, less the two preprocessing steps;
# CudaFatbinObject: traces from before fatbinary's action made the fatbin object too).
AFTER_PREPROCESSING = frozenset({"CudaDryrun", "CudaFrontend", "CudaCicc", "CudaPtxas", "CudaFatbinary",
                                 "CudaFatbinObject", "CudaHostCompile", "CudaObjectLink"})
PREPROCESSING = frozenset({"CudaDevicePreprocess", "CudaHostPreprocess"})
HEADERS = "include/"


def shape(action: Action, digester) -> str:
    """What must match for two actions to be counterparts: the description without the
    content of the inputs and the toolkit (the mount names stay)."""
    described = dict(action.traced(digester)[1])  # a narrowed action's prekey description
    described["argv"] = list(action.argv)  # with its -D/-U, which a prekey may leave out (macro_use.py)
    described["inputs"] = sorted(described["inputs"])
    described.pop("toolchain", None)
    return digester.of_json(described)


def toolkit_diff(a: Tree, b: Tree) -> tuple[set[str], set[str]] | None:
    """(paths that differ, names of files only one of the two has) of two toolkit trees; None
    where they differ outside include/."""
    ea, eb = a.entries, b.entries
    apart = set(ea) ^ set(eb)
    differ = apart | {p for p in ea if p in eb and ea[p] != eb[p]}
    if not all(p.startswith(HEADERS) for p in differ):
        return None
    return differ, {p.rpartition("/")[2] for p in apart}


class Recorder:
    """Wraps an engine's rebuilder (the baseline's): remembers the outcome of each step after
    preprocessing by its shape."""

    def __init__(self, inner, digester):
        self.inner, self.digester = inner, digester
        # Shape -> every step of that shape: two TUs of one file name (vLLM's marlin/ and
        # moe/marlin_moe_wna16/ sm80_kernel_*.cu) give ptxas and fatbinary steps of one shape.
        self.outcomes: dict[str, list[tuple[Action, Hit]]] = {}

    def _keep(self, action: Action, hit: Hit) -> None:
        if (action.mnemonic in AFTER_PREPROCESSING or action.mnemonic in PREPROCESSING) and action.cacheable:
            self.outcomes.setdefault(shape(action, self.digester), []).append((action, hit))

    def check(self, action: Action, recorded: Callable[[], dict[str, Any] | None]) -> Hit | Miss:
        decision = self.inner.check(action, recorded)
        if isinstance(decision, Hit):
            self._keep(action, decision)
        return decision

    def record(self, action: Action, tree: Tree, result, made_by: tuple[str, str] | None = None) -> str:
        key = self.inner.record(action, tree, result, made_by)
        self._keep(action, Hit(result, tree, key))
        return key

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


class Cutoff:
    """Wraps a variant's rebuilder: a miss on a step after preprocessing whose baseline
    counterpart differs only as the module docstring says is the counterpart's hit."""

    def __init__(self, inner, digester, baseline: dict[str, list[tuple[Action, Hit]]],
                 moved_only: Callable[[FileEntry, FileEntry], bool], read: Callable[[FileEntry], bytes]):
        self.inner, self.digester = inner, digester
        self.baseline, self.moved_only, self.read = baseline, moved_only, read
        # (action, the baseline's hit, whether only the toolkit differs), in the order taken
        self.substituted: list[tuple[Action, Hit, bool]] = []
        self.unread: list[str] = []  # preprocessing steps taken from the baseline by their depfiles
        self._toolkits: dict[tuple[str, str], tuple[set[str], set[str]] | None] = {}
        self._mentions: dict[tuple[str, frozenset[str]], bool] = {}

    def check(self, action: Action, recorded: Callable[[], dict[str, Any] | None]) -> Hit | Miss:
        # Taken from the baseline even where an earlier audit ran it (a sample): each audit of a
        # unit then builds the same thing, and the samples are checked apart (run_samples).
        if action.mnemonic in PREPROCESSING and action.cacheable:
            for base, hit in self.baseline.get(shape(action, self.digester), ()):
                if self._not_read(base, hit, action):
                    self.unread.append(action.name)
                    return hit
        elif action.mnemonic in AFTER_PREPROCESSING and action.cacheable:
            for base, hit in self.baseline.get(shape(action, self.digester), ()):
                if base.key(self.digester) == action.key(self.digester):
                    break  # the baseline's own step: an ordinary hit
                same = self._same_work(base, action)
                if same is not None:
                    self.substituted.append((action, hit, same == "toolkit"))
                    return hit
        return self.inner.check(action, recorded)

    def record(self, action: Action, tree: Tree, result, made_by: tuple[str, str] | None = None) -> str:
        return self.inner.record(action, tree, result, made_by)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def samples(self) -> list[tuple[Action, Hit, bool]]:
        """The check: per step kind, the substituted step that took least time in the baseline,
        one whose inputs differ in the toolkit alone where there is one."""
        best: dict[str, tuple[Action, Hit, bool]] = {}
        for entry in self.substituted:
            action, hit, pure = entry
            rank = (not pure, hit.result.duration_s, action.name)
            now = best.get(action.mnemonic)
            if now is None or rank < (not now[2], now[1].result.duration_s, now[0].name):
                best[action.mnemonic] = entry
        return [best[m] for m in sorted(best)]

    def _same_work(self, base: Action, action: Action) -> str | None:
        """None where the two do different work; "toolkit" where they differ in toolkit headers
        alone, "moved" where preprocessed text they read also moved lines."""
        mine = dict(action.inputs)
        kind = "toolkit"
        for mount, tree in base.inputs:
            other = mine.get(mount)
            if other is None:
                return None
            if mount == TOOLCHAIN:
                if base.toolchain != action.toolchain and self._toolkit_diff(base, tree, action, other) is None:
                    return None
                continue
            if other is tree or other.entries == tree.entries:
                continue
            a, b = tree.entries, other.entries
            if set(a) != set(b):
                return None
            for path, entry in a.items():
                if b[path] == entry:
                    continue
                if not (path.endswith((".ii", ".i")) and isinstance(entry, FileEntry)
                        and isinstance(b[path], FileEntry) and self.moved_only(entry, b[path])):
                    return None
                kind = "moved"
        return kind


    def _toolkit_diff(self, base: Action, a: Tree, action: Action, b: Tree):
        """toolkit_diff, once per pair of toolkits (ten thousand files each)."""
        pair = (base.toolchain or "", action.toolchain or "")
        if pair not in self._toolkits:
            self._toolkits[pair] = toolkit_diff(a, b)
        return self._toolkits[pair]

    def _not_read(self, base: Action, hit: Hit, action: Action) -> bool:
        """Whether a preprocessing step differs from its baseline counterpart only in toolkit
        files its depfile says it did not read (see the module docstring)."""
        depfiles = base.discovery.depfiles if base.discovery is not None else ()
        if base.toolchain == action.toolchain or not depfiles:
            return False
        mine = dict(action.inputs)
        toolkit = None
        for mount, tree in base.inputs:
            other = mine.get(mount)
            if other is None:
                return False
            if mount == TOOLCHAIN:
                toolkit = self._toolkit_diff(base, tree, action, other)
                if toolkit is None:
                    return False
            elif not (other is tree or other.entries == tree.entries):
                return False
        if toolkit is None:
            return False
        differ, names = toolkit
        read = []
        for depfile in depfiles:
            entry = hit.tree.entries.get(depfile)
            if not isinstance(entry, FileEntry):
                return False
            read += [absolute(dep, base.cwd) for dep in parse_depfile(self.read(entry).decode(errors="replace"))]
        toolkit_tree = dict(base.inputs)[TOOLCHAIN]
        for path in read:
            if path.startswith(TOOLCHAIN + "/"):
                rel = path[len(TOOLCHAIN) + 1:]
                # A file that differs, or one read through a symlink (its file cannot be told).
                if rel in differ or not isinstance(toolkit_tree.entries.get(rel), FileEntry):
                    return False
        if names:
            if any(p.rpartition("/")[2] in names for p in read):
                return False
            mounts = dict(base.inputs)
            for path in read:
                entry = _entry(mounts, base.staged, path)
                if entry is None or self._mention(entry, frozenset(names)):
                    return False  # unknown, or it names a file the variant adds or removes
        return True

    def _mention(self, entry: FileEntry, names: frozenset[str]) -> bool:
        key = (entry.digest, names)
        if key not in self._mentions:
            data = self.read(entry)
            self._mentions[key] = any(n.encode() in data for n in names)
        return self._mentions[key]


def _entry(mounts: dict[str, Tree], staged: str | None, path: str) -> FileEntry | None:
    """The file an action saw at an absolute sandbox path (a staged mount also at /bgraph/out)."""
    for mount in sorted(mounts, key=len, reverse=True):
        for root in (mount, OUT) if mount == staged else (mount,):
            if path.startswith(root + "/"):
                found = mounts[mount].entries.get(path[len(root) + 1:])
                if isinstance(found, FileEntry):
                    return found
    return None


def run_samples(engine, cutoff: Cutoff) -> list[dict[str, Any]]:
    """Runs each sample for real (a cached result of an earlier audit serves) and says whether
    it gave the baseline's output."""
    out = []
    for action, hit, pure in cutoff.samples():
        decision = cutoff.inner.check(action, lambda: None)
        cpu_s = 0.0
        if isinstance(decision, Hit):
            tree = decision.tree
        else:
            tree, result = engine.execute(action)
            cutoff.inner.record(action, tree, result)
            cpu_s = result.cpu_s
        out.append({"action": action.name, "mnemonic": action.mnemonic, "same": tree == hit.tree,
                    "inputs": "toolkit" if pure else "toolkit, moved lines", "ran": not isinstance(decision, Hit),
                    "cpu_s": round(cpu_s, 1)})
    return out
