"""Hit or Miss(reason) for one action, against the action cache and the last recorded description."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from build_graph import macro_use
from build_graph.cpp_view import Macros, command_macros, defined_names, view
from build_graph.depfile import absolute, parse_depfile, stepped_out_of
from build_graph.model import Action, ActionCache, ActionResult, Digester, DirEntry, FileEntry, Tree
from build_graph.store.cas import CorruptBlob, LocalCas, StoreError
from build_graph.store.state import BuildState


@dataclass(frozen=True)
class Hit:
    result: ActionResult
    tree: Tree
    key: str = ""  # the key it was filed under (a narrowed key for depfile-narrowed actions)
    why: str = ""  # said of a hit that needed more than equal inputs (an edit the preprocessor skips)


@dataclass(frozen=True)
class Miss:
    reason: str


def _short(d: Any) -> str:
    return str(d)[:12] + "…" if d else "none"


def explain_change(old: dict[str, Any] | None, new: dict[str, Any], cas: LocalCas) -> str:
    """A human reason for why `new` differs from the recorded `old` description."""
    if not old:
        return "new action (never built)"
    reasons: list[str] = []
    if old.get("toolchain") != new.get("toolchain"):
        reasons.append(f"toolchain changed {_short(old.get('toolchain'))} -> {_short(new.get('toolchain'))}")
    old_in, new_in = old.get("inputs", {}), new.get("inputs", {})
    for mount in sorted(set(old_in) | set(new_in)):
        if mount == "/bgraph/toolchain" or old_in.get(mount) == new_in.get(mount):
            continue
        if mount not in old_in or mount not in new_in:
            reasons.append(f"input {mount} {'added' if mount in new_in else 'removed'}")
            continue
        reasons.extend(_tree_diff(mount, old_in[mount], new_in[mount], cas))
    if old.get("argv") != new.get("argv"):
        a, b = old.get("argv", []), new.get("argv", [])
        diff = [i for i in range(max(len(a), len(b))) if (a[i:i + 1] != b[i:i + 1])]
        i = diff[0]
        reasons.append(f"argv[{i}] {a[i] if i < len(a) else '(none)'!r} -> {b[i] if i < len(b) else '(none)'!r}")
    for key in sorted(set(old.get("env", {})) | set(new.get("env", {}))):
        if old.get("env", {}).get(key) != new.get("env", {}).get(key):
            reasons.append(f"env {key} {old.get('env', {}).get(key)!r} -> {new.get('env', {}).get(key)!r}")
    if old.get("host_tools") != new.get("host_tools"):
        changed = [p for p in set(old.get("host_tools", {})) | set(new.get("host_tools", {}))
                   if old.get("host_tools", {}).get(p) != new.get("host_tools", {}).get(p)]
        reasons.append(f"host tool changed: {', '.join(sorted(changed))}")
    for field in ("outputs", "platform", "exec_platform", "rule_version", "spec", "cwd", "host_paths", "kind",
                  "mnemonic"):
        if old.get(field) != new.get(field):
            reasons.append(f"{field} changed {old.get(field)!r} -> {new.get(field)!r}")
    return "; ".join(reasons) if reasons else "not in the cache (evicted or corrupted)"


def _tree_diff(mount: str, old: str, new: str, cas: LocalCas, limit: int = 5) -> list[str]:
    try:
        a, b = cas.get_tree(old).entries, cas.get_tree(new).entries
    except StoreError:
        return [f"input {mount} {_short(old)} -> {_short(new)}"]
    out = []
    for path in sorted(set(a) | set(b)):
        ea, eb = a.get(path), b.get(path)
        if ea == eb:
            continue
        da = getattr(ea, "digest", "absent" if ea is None else "link")
        db = getattr(eb, "digest", "absent" if eb is None else "link")
        out.append(f"input {mount}/{path} {_short(da)} -> {_short(db)}")
    if len(out) > limit:
        out = out[:limit] + [f"… and {len(out) - limit} more inputs"]
    return out


def _through_link(dep: str, cwd: str, root: str, tree: Tree) -> bool:
    """Whether a `..` of the depfile path `dep` steps out of a symbolic link of `tree` (at `root`)
    or of a directory below one: the file read is then not the one its normalised path names."""
    for directory in stepped_out_of(dep, cwd):
        if not directory.startswith(root + "/"):
            continue
        parts = directory[len(root) + 1:].split("/")
        if any(not isinstance(tree.entries.get("/".join(parts[:i])), (type(None), DirEntry))
               for i in range(1, len(parts) + 1)):
            return True
    return False


class Rebuilder:
    """Decides Hit / Miss(reason). Knows nothing of scheduling."""

    def __init__(self, cas: LocalCas, ac: ActionCache, digester: Digester, state: BuildState | None = None):
        self.cas, self.ac, self.digester = cas, ac, digester
        self.state = state  # the build state's memo of results (state.py): one file, not two per hit
        self._defines: dict[str, frozenset[str]] = {}  # digest or host path -> defined_names
        self._views: dict[tuple, str | None] = {}  # (content digest, macros) -> digest of its view

    def _lookup(self, key: str) -> tuple[ActionResult, Tree | None, bool] | None:
        """(result, its tree if the memo holds it, whether it came from the memo) under `key`."""
        memo = self.state.result(key, self.digester) if self.state is not None else None
        if memo is not None:
            return memo[0], memo[1], True
        result = self.ac.get(key)
        return (result, None, False) if result is not None else None

    def _verified(self, key: str, result: ActionResult, tree: Tree | None = None, memo: bool = False) -> Hit | Miss:
        """A hit if every blob of the cached output is present and sound; else the entry goes."""
        # Held before the blobs are checked: a collection either keeps them or ran first.
        self.cas.holds.hold("key", key)
        self.ac.touch(key)  # its last use, for least-recently-used collection
        try:
            if tree is None:
                tree = self.cas.get_tree(result.output_tree)
            bad = self.cas.verify_tree(tree)
        except (CorruptBlob, StoreError):
            bad = ["(directory node)"]
        if not bad:
            if self.state is not None and not memo:
                self.state.put_result(key, result, tree)
            return Hit(result, tree, key)
        self.ac.remove(key)
        if self.state is not None:
            self.state.drop_results([key])
        return Miss(f"cached output corrupted or missing ({bad[0]}); rebuilding")

    def check(self, action: Action, recorded: Callable[[], dict[str, Any] | None]) -> Hit | Miss:
        """Hit or Miss(reason); `recorded()` gives what the last build recorded for this action
        (read only to explain a miss)."""
        if action.manifested:
            return self._check_narrowed(action, recorded)
        key = action.key(self.digester)
        description = action.description(self.digester)
        found = self._lookup(key) if action.cacheable else None
        if found is not None:
            return self._verified(key, *found)
        previous = recorded()
        if previous and previous.get("key") == key:
            return Miss("not in the cache (evicted or corrupted)")
        old = previous.get("description") if previous else None
        self._store_changed_inputs(action, old, description)
        return Miss(explain_change(old, description, self.cas))

    def _store_changed_inputs(self, action: Action, old: dict[str, Any] | None, new: dict[str, Any]) -> None:
        """Store the directory nodes of each input tree that differs from the recorded one, so
        that explain_change can name the changed files (record() stores every input tree once
        the action has run). A new action has no recorded tree to compare with: nothing is
        written for it (a dry run of 100,000 new actions wrote 200,000 nodes, one file each)."""
        if not old:
            return
        before, now = old.get("inputs", {}), new["inputs"]
        for mount, t in action.inputs:
            if mount in before and before[mount] != now[mount]:
                self.cas.put_tree(t)

    def record(self, action: Action, tree: Tree, result: ActionResult) -> str:
        """Remember the inputs (for later reasons) and the result (for later hits); returns
        the key the result is filed under."""
        for _mount, t in action.inputs:
            self.cas.put_tree(t)
        if action.manifested:
            prekey = action.prekey(self.digester)
            reads, names = self._reads(action, tree)
            entry: dict[str, Any] = {"reads": reads, "names": self._names(action, names)}
            ops = action.macro_ops()
            if ops is not None:
                record = self._macro_record(action, tree)
                entry.update(macros=ops, record=record.to_json() if record else None)
            key = entry["key"] = self.digester.of_json({"prekey": prekey, **entry})
            self.ac.put(key, result)
            self.ac.add_manifest(prekey, entry)
        else:
            key = action.key(self.digester)
            if not action.cacheable:
                return key
            self.ac.put(key, result)
        if self.state is not None:
            self.state.put_result(key, result, tree)
        return key

    # -- depfile narrowing ---------------------------------------------------------------
    # An action with `narrow` mounts (a compile over a whole source tree) is filed under a
    # narrowed key: its key without those mounts (the prekey) plus the digests of the files its
    # depfiles say it read. The prekey's manifest lists the read sets of earlier runs; a build
    # checks them by digest before running anything, so an edit to a file the compile did not
    # read is a hit. A new file could change what an #include finds (an earlier directory on
    # the include path, #include_next): every entry also records, for the name of each file
    # read anywhere, every path with that name in each narrowed mount; a file added or removed
    # under such a name makes the entry stale. (`__has_include` of a file that did not exist
    # leaves no trace in a depfile; such a header appearing later is not noticed.)
    # An action with a `macro_record` (nvcc's gcc steps, with the gcc_macro_use plugin) also
    # leaves its -D/-U out of the prekey: each entry keeps them and the plugin's record of which
    # it used, and fits a command line differing only in macros that run never consulted
    # (macro_use.compare). Such an action may have no narrowed mount at all (the host compile).

    def _reads(self, action: Action, tree: Tree) -> tuple[dict[str, dict[str, str]], list[str]]:
        """What a finished action read in each narrowed mount (path -> digest), from its
        depfiles, and the names of every file it read anywhere. A mount whose reads cannot be
        told (no depfile; a path through a symlink) is recorded whole: {"*": tree digest}."""
        mounts = {m: action.input_tree(m) for m in action.narrow}
        reads: dict[str, dict[str, str]] = {m: {} for m in mounts}
        names: set[str] = set()
        whole: set[str] = set()
        for depfile in action.depfiles:
            entry = tree.entries.get(depfile)
            deps = parse_depfile(self.cas.read_bytes(entry).decode(errors="replace")) \
                if isinstance(entry, FileEntry) else []
            if not deps:  # missing, not a file, or naming no file: it proves nothing (depfile.py, point 5)
                whole.update(mounts)
                continue
            for dep in deps:
                path = absolute(dep, action.cwd)
                names.add(path.rpartition("/")[2])
                for mount, mtree in mounts.items():
                    # A staged mount is also seen at /bgraph/out, through symlinks.
                    for root in (mount, "/bgraph/out") if mount == action.staged else (mount,):
                        if not path.startswith(root + "/"):
                            continue
                        found = mtree.entries.get(path[len(root) + 1:])
                        if isinstance(found, FileEntry) and not _through_link(dep, action.cwd, root, mtree):
                            reads[mount][path[len(root) + 1:]] = found.digest
                        elif root == mount or isinstance(found, FileEntry):
                            whole.add(mount)
        for mount in whole:
            reads[mount] = {"*": mounts[mount].digest(self.digester)}
        return reads, sorted(names)

    def _macro_record(self, action: Action, tree: Tree) -> macro_use.Record | None:
        """What the gcc-macro-use plugin wrote for this run (None: missing or incomplete)."""
        entry = tree.entries.get(action.macro_record)
        if not isinstance(entry, FileEntry):
            return None
        try:
            return macro_use.parse_record(self.cas.read_bytes(entry).decode(errors="replace"))
        except (CorruptBlob, StoreError, OSError):
            return None

    @staticmethod
    def _names(action: Action, names: list[str]) -> dict[str, dict[str, list[str]]]:
        """For each narrowed mount: name -> every path with that name (the shadowing check)."""
        out = {}
        for mount in action.narrow:
            index = action.input_tree(mount).by_name()
            out[mount] = {n: list(index[n]) for n in names if n in index}
        return out

    def _stale(self, action: Action, entry: dict[str, Any], limit: int = 5) -> list[str]:
        """Why a manifest entry does not fit the action's current inputs (empty: it fits)."""
        changed, other = self._differences(action, entry, limit)
        why = [f"input {mount}/{path} {_short(digest)} -> {_short(now.digest if now else 'absent')}"
               for mount, path, digest, now in changed]
        return (why + other)[:limit]

    def _differences(self, action: Action, entry: dict[str, Any], limit: int | None = None
                     ) -> tuple[list[tuple[str, str, str, FileEntry | None]], list[str]]:
        """(each file it read whose content is not what it read: mount, path, digest read, entry
        now; every other reason the entry does not fit). Stops after `limit` of either."""
        changed: list[tuple[str, str, str, FileEntry | None]] = []
        other: list[str] = []
        for mount, files in entry.get("reads", {}).items():
            tree = action.input_tree(mount) if mount in action.narrow else None
            if tree is None:
                return changed, [f"input {mount} is no longer narrowed"]
            if "*" in files:
                if files["*"] != tree.digest(self.digester):
                    other.append(f"input {mount} {_short(files['*'])} -> {_short(tree.digest(self.digester))}")
                continue
            if files.items() <= tree.file_digests().items():
                continue  # every file it read is unchanged (one set comparison, in C)
            for path, digest in files.items():
                now = tree.entries.get(path)
                if not isinstance(now, FileEntry) or now.digest != digest:
                    changed.append((mount, path, digest, now if isinstance(now, FileEntry) else None))
                    if limit and len(changed) >= limit:
                        return changed, other
        other.extend(self._macro_fit(action, entry)[1])
        for mount, recorded in entry.get("names", {}).items():
            index = action.input_tree(mount).by_name() if mount in action.narrow else {}
            for name, paths in recorded.items():
                now = list(index.get(name, ()))
                if now != paths:
                    added = sorted(set(now) - set(paths))
                    other.append(f"new file {mount}/{added[0]} may shadow an included {name}" if added
                                 else f"{name} removed from {mount}: {', '.join(sorted(set(paths) - set(now)))}")
                    if limit and len(changed) + len(other) >= limit:
                        return changed, other
        return changed, other

    # -- edits the preprocessor cannot see (cpp_view.py) ----------------------------------
    # A preprocessing step (Action.cpp_input) whose only changed inputs are files whose views
    # under its command line's macros are unchanged would write what it wrote before: the
    # earlier result is taken. The macros count only if no file it read (its earlier depfile,
    # the toolchain's headers included) redefines them.

    def _unseen_edit(self, action: Action, entry: dict[str, Any]) -> Hit | None:
        """The entry's result, if every file that changed since changed only where this
        preprocessing run does not look; else None."""
        changed, other = self._differences(action, entry)
        if other or not changed or any(now is None for *_, now in changed):
            return None
        command = command_macros(action.argv)
        pairs = [(digest, now) for _m, _p, digest, now in changed]
        # First with every command-line macro taken as known (no file read): views that differ
        # then differ with fewer known macros too, and most edits stop here.
        if command is None or not self._same_views(pairs, command):
            return None
        found = self._lookup(entry["key"])
        if found is None:
            return None
        result, tree, memo = found
        try:
            if tree is None:
                tree = self.cas.get_tree(result.output_tree)
            macros = self._run_macros(action, tree, command, pairs)
        except (CorruptBlob, StoreError, OSError):
            return None
        if macros is None or not self._same_views(pairs, macros):
            return None
        decision = self._verified(entry["key"], result, tree, memo)
        if not isinstance(decision, Hit):
            return None
        paths = ", ".join(f"{m}/{p}".removeprefix("/bgraph/") for m, p, _d, _n in changed[:3])
        return Hit(decision.result, decision.tree, decision.key,
                   why=f"{paths} changed only in #if groups skipped with {macros.describe()}")

    def _same_views(self, pairs: list[tuple[str, FileEntry]], macros: Macros) -> bool:
        """Whether each (digest read, file now) pair has one view under `macros`."""
        for before, now in pairs:
            seen = self._view(before, macros)
            if seen is None or seen != self._view(now.digest, macros, now):
                return False
        return True

    def _view(self, digest: str, macros: Macros, entry: FileEntry | None = None) -> str | None:
        """The digest of view(content, macros), memoized (one header, many TUs and archs)."""
        memo_key = (digest, macros.identity())
        if memo_key not in self._views:
            data = self._content(digest, entry)
            seen = view(data, macros) if data is not None else None
            self._views[memo_key] = self.digester.of(seen) if seen is not None else None
        return self._views[memo_key]

    def _content(self, digest: str, entry: FileEntry | None = None) -> bytes | None:
        """A file's bytes, checked against its digest (`entry`: a source maybe hashed but not
        yet stored); None if gone or damaged."""
        try:
            if entry is not None:
                return self.cas.read_bytes(entry)
            data = self.cas.blob_path(digest).read_bytes()
        except (CorruptBlob, StoreError, OSError):
            return None
        return data if self.digester.of(data) == digest else None

    def _run_macros(self, action: Action, tree: Tree, command: Macros, pairs: list[tuple[str, FileEntry]]
                    ) -> Macros | None:
        """The command line's macros, less any that a file the earlier run read (as it read it,
        or as it is now) defines or undefines; None if a file it read cannot be found."""
        names: set[str] = set()
        for before, now in pairs:
            for found in (self._defined(before), self._defined(now.digest, now)):
                if found is None:
                    return None
                names |= found
        for depfile in action.depfiles:
            entry = tree.entries.get(depfile)
            if not isinstance(entry, FileEntry):
                return None
            for dep in parse_depfile(self.cas.read_bytes(entry).decode(errors="replace")):
                found = self._defined_in(action, absolute(dep, action.cwd))
                if found is None:
                    return None
                names |= found
        return command.without(names)

    def _defined(self, digest: str, entry: FileEntry | None = None) -> frozenset[str] | None:
        """defined_names of a stored file (memoized by digest), or None if it is gone or damaged."""
        names = self._defines.get(digest)
        if names is None:
            data = self._content(digest, entry)
            if data is None:
                return None
            names = self._defines[digest] = defined_names(data)
        return names

    def _defined_in(self, action: Action, path: str) -> frozenset[str] | None:
        """defined_names of the file at sandbox `path`, from the action's inputs or its host
        paths (memoized by digest or host path); None if it is not there."""
        for mount, tree in action.inputs:
            for root in (mount, "/bgraph/out") if mount == action.staged else (mount,):
                if path.startswith(root + "/"):
                    entry = tree.entries.get(path[len(root) + 1:])
                    return self._defined(entry.digest, entry) if isinstance(entry, FileEntry) else None
        if any(path.startswith(h.rstrip("/") + "/") for h in action.host_paths):
            names = self._defines.get(path)
            if names is None:
                try:
                    with open(path, "rb") as f:
                        names = self._defines[path] = defined_names(f.read())
                except OSError:
                    return None
            return names
        return None

    @staticmethod
    def _macro_fit(action: Action, entry: dict[str, Any]) -> tuple[list[str], list[str]]:
        """macro_use.compare of the entry's run and this action: (differing names it never used,
        why it cannot stand for this action); both empty where neither records macros."""
        ops = action.macro_ops()
        if ops is None and "macros" not in entry:
            return [], []
        return macro_use.compare(entry.get("macros", {}), ops or {}, macro_use.Record.from_json(entry.get("record")))

    @classmethod
    def _unused_macros(cls, action: Action, entry: dict[str, Any], decision: Hit | Miss) -> Hit | Miss:
        """A hit from a run with other -D/-U values says which ones it never used."""
        if not isinstance(decision, Hit):
            return decision
        unused = cls._macro_fit(action, entry)[0]
        if not unused:
            return decision
        names = ", ".join(unused[:3]) + (f" and {len(unused) - 3} more" if len(unused) > 3 else "")
        return Hit(decision.result, decision.tree, decision.key,
                   why=f"-D/-U of {names} changed; the recorded run never used {'it' if len(unused) == 1 else 'them'}")

    def _check_narrowed(self, action: Action, recorded: Callable[[], dict[str, Any] | None]) -> Hit | Miss:
        entries = self.ac.get_manifest(action.prekey(self.digester))
        for entry in entries:
            if self._stale(action, entry):
                continue
            found = self._lookup(entry["key"])
            if found is not None:
                return self._unused_macros(action, entry, self._verified(entry["key"], *found))
        if action.cpp_input:
            for entry in entries:
                unseen = self._unseen_edit(action, entry)
                if unseen is not None:
                    return unseen
        if entries:  # same command and other inputs: name the files it read that changed
            return Miss("; ".join(self._stale(action, entries[0])))
        previous = recorded()
        old, described = previous.get("description") if previous else None, action.prekey_description(self.digester)
        self._store_changed_inputs(action, old, described)
        return Miss(explain_change(old, described, self.cas))
