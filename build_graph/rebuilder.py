"""Hit or Miss(reason) for one action, against the action cache and the last recorded description."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from build_graph.model import Action, ActionResult, Digester, Tree
from build_graph.store.action_cache import LocalActionCache
from build_graph.store.cas import CorruptBlob, LocalCas, StoreError


@dataclass(frozen=True)
class Hit:
    result: ActionResult
    tree: Tree


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
    for field in ("outputs", "platform", "rule_version", "spec", "cwd", "host_paths", "kind", "mnemonic"):
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


class Rebuilder:
    """Decides Hit / Miss(reason). Knows nothing of scheduling."""

    def __init__(self, cas: LocalCas, ac: LocalActionCache, digester: Digester):
        self.cas, self.ac, self.digester = cas, ac, digester

    def check(self, action: Action, previous: dict[str, Any] | None) -> Hit | Miss:
        key = action.key(self.digester)
        description = action.description(self.digester)
        result = self.ac.get(key) if action.cacheable else None
        if result is not None:
            try:
                tree = self.cas.get_tree(result.output_tree)
                bad = self.cas.verify_tree(tree)
            except (CorruptBlob, StoreError):
                bad = ["(directory node)"]
            if not bad:
                return Hit(result, tree)
            self.ac.remove(key)
            return Miss(f"cached output corrupted or missing ({bad[0]}); rebuilding")
        if previous and previous.get("key") == key:
            return Miss("not in the cache (evicted or corrupted)")
        for _mount, t in action.inputs:  # so the next miss can name the changed files
            self.cas.put_tree(t)
        return Miss(explain_change(previous.get("description") if previous else None, description, self.cas))

    def record(self, action: Action, tree: Tree, result: ActionResult) -> None:
        """Remember the inputs (for later reasons) and the result (for later hits)."""
        for _mount, t in action.inputs:
            self.cas.put_tree(t)
        if action.cacheable:
            self.ac.put(action.key(self.digester), result)
