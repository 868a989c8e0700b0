"""Hit or Miss(reason) for one action, against the action cache and the last recorded description."""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from typing import Any, Callable

from build_graph.incremental.discovery import Contents, short as _short
from build_graph.model import Action, ActionCache, ActionResult, Digester, Tree
from build_graph.store.cas import CorruptBlob, LocalCas, StoreError
from build_graph.store.origins import BuildTrust, Origins
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


def undeclared(tree: Tree, outputs: tuple[str, ...]) -> str | None:
    """A path of `tree` that is neither one of `outputs` nor below one (None: all are): a local
    run keeps only what the action declared."""
    declared = {posixpath.normpath(o) for o in outputs}
    for path in tree.entries:
        up = path
        while up not in declared:
            up = up.rpartition("/")[0]
            if not up:
                return path
    return None


def _declared(action: Action) -> tuple[str, ...] | None:
    """The outputs a cached result of `action` must stay within (None: any, as a fetch's or a whole
    output directory's)."""
    return action.outputs if action.kind == "exec" and action.outputs != (".",) else None


class Rebuilder:
    """Decides Hit / Miss(reason). Knows nothing of scheduling."""

    def __init__(self, cas: LocalCas, ac: ActionCache, digester: Digester, state: BuildState | None = None,
                 origins: Origins | None = None):
        self.cas, self.ac, self.digester = cas, ac, digester
        self.state = state  # the build state's memo of results (state.py): one file, not two per hit
        self.files = Contents(cas, digester, state)  # what input discovery reads of stored files
        # where results made elsewhere came from, and whether this build takes them (store/origins.py)
        self.origins = origins or Origins(BuildTrust())

    def _lookup(self, key: str) -> tuple[ActionResult, Tree | None, bool] | None:
        """(result, its tree if the memo holds it, whether it came from the memo) under `key`; a
        result from elsewhere that this build does not trust is dropped (memo row and entry)."""
        memo = self.state.result(key, self.digester) if self.state is not None else None
        found = (memo[0], memo[1], True) if memo is not None else None
        if found is None:
            result = self.ac.get(key)
            found = (result, None, False) if result is not None else None
        if found is not None and not self.origins.accepts(key, found[0]):
            if self.state is not None:
                self.state.drop_results([key])
            self.ac.remove(key)
            return None
        return found

    def _verified(self, key: str, result: ActionResult, tree: Tree | None = None, memo: bool = False,
                  outputs: tuple[str, ...] | None = None) -> Hit | Miss:
        """A hit if every blob of the cached output is present and sound (and, with `outputs`,
        the action's declared outputs, every path of it within one: an entry pulled from a
        remote cache is another machine's word); else the entry goes."""
        # Held before the blobs are checked: a collection either keeps them or ran first.
        self.cas.holds.hold("key", key)
        self.ac.touch(key)  # its last use, for least-recently-used collection
        try:
            if tree is None:
                tree = self.cas.get_tree(result.output_tree)
            stray = undeclared(tree, outputs) if outputs is not None and not memo else None
            bad = [f"{stray} (not a declared output)"] if stray else self.cas.damaged(tree)
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
            return self._verified(key, *found, outputs=_declared(action))
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

    def record(self, action: Action, tree: Tree, result: ActionResult,
               made_by: tuple[str, str] | None = None) -> str:
        """Remember the inputs (for later reasons) and the result (for later hits); returns
        the key the result is filed under. `made_by`: (EXECUTED or EXECUTOR_CACHE, the executor's
        URL) of a remote executor's result, filed with it as its origin; None: built here."""
        if made_by is not None:
            result = self.origins.stamp(result, *made_by)
        for _mount, t in action.inputs:
            self.cas.put_tree(t)
        if action.manifested:
            prekey = action.prekey(self.digester)
            entry = action.discovery.reads(self.files, action, tree)
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

    # -- input discovery (incremental/discovery.py) --------------------------------------
    # An action whose strategy narrows something is filed under a narrowed key: its prekey plus
    # what the run read (and the -D/-U it used). The strategy answers, one method each, what an
    # entry of the prekey's manifest records, whether it fits, and which of its reads may change.

    def _stale(self, action: Action, entry: dict[str, Any], limit: int = 5) -> list[str]:
        """Why a manifest entry does not fit the action's current inputs (empty: it fits)."""
        changed, other = action.discovery.differences(self.files, action, entry, limit)
        why = [f"input {mount}/{path} {_short(digest)} -> {_short(now.digest if now else 'absent')}"
               for mount, path, digest, now in changed]
        return (why + other)[:limit]

    def _entry_key_holds(self, prekey: str, entry: Any) -> bool:
        """Whether a manifest entry's key is the digest of what it records (as record() files it):
        an entry a remote sent is another machine's word, and a key that is not its own would pass
        off another result as what these reads make."""
        if not isinstance(entry, dict) or not isinstance(entry.get("key"), str):
            return False
        try:
            return entry["key"] == self.digester.of_json({"prekey": prekey, **{k: v for k, v in entry.items()
                                                                               if k != "key"}})
        except (TypeError, ValueError):
            return False

    def _unseen_edit(self, action: Action, entry: dict[str, Any]) -> Hit | None:
        """The entry's result, if its strategy says every file that changed since changed only
        where this run does not look; else None."""
        check = action.discovery.unseen_edit(self.files, action, entry)
        found = self._lookup(entry["key"]) if check is not None else None
        if found is None:
            return None
        result, tree, memo = found
        try:
            if tree is None:
                tree = self.cas.get_tree(result.output_tree)
            why = check(tree)
        except (CorruptBlob, StoreError, OSError):
            return None
        decision = self._verified(entry["key"], result, tree, memo) if why else None
        return Hit(decision.result, decision.tree, decision.key, why=why) if isinstance(decision, Hit) else None

    @staticmethod
    def _unused_macros(action: Action, entry: dict[str, Any], decision: Hit | Miss) -> Hit | Miss:
        """A hit from a run with other -D/-U values says which ones it never used."""
        if not isinstance(decision, Hit):
            return decision
        unused = action.discovery.macro_fit(action, entry)[0]
        if not unused:
            return decision
        names = ", ".join(unused[:3]) + (f" and {len(unused) - 3} more" if len(unused) > 3 else "")
        return Hit(decision.result, decision.tree, decision.key,
                   why=f"-D/-U of {names} changed; the recorded run never used {'it' if len(unused) == 1 else 'them'}")

    def _check_narrowed(self, action: Action, recorded: Callable[[], dict[str, Any] | None]) -> Hit | Miss:
        prekey = action.prekey(self.digester)
        entries = [e for e in self.ac.get_manifest(prekey) if self._entry_key_holds(prekey, e)]
        declared = _declared(action)
        for entry in entries:
            if self._stale(action, entry):
                continue
            found = self._lookup(entry["key"])
            if found is not None:
                return self._unused_macros(action, entry, self._verified(entry["key"], *found, outputs=declared))
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
