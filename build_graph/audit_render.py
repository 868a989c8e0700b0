"""Text for people from `bgraph audit`'s report (audit.py) and `bgraph why`'s action paths
(provenance.py): plain lines, one summary line per patch with its hunks below."""

from __future__ import annotations

from typing import Any, Iterable

ORDER = ("live", "dead", "breaks the build", "unknown")


def _some(items: Iterable[str], limit: int = 6) -> str:
    items = list(items)
    if len(items) <= limit:
        return ", ".join(items)
    return ", ".join(items[:limit]) + f", … ({len(items) - limit} more)"


def _pairs(entries: list[dict], per_arch: bool) -> list[str]:
    return [f"{e['tu']} {e['arch']}" if per_arch and e.get("arch") else str(e["tu"]) for e in entries]


def _first_line(text: str | None) -> str:
    lines = [line.strip().lstrip("| ").strip() for line in (text or "").splitlines() if line.strip().lstrip("| ")]
    for line in lines:  # the compiler's or patch's own error line, where there is one
        if "error" in line.lower() or "FAILED" in line:
            return line
    return lines[0] if lines else ""


def unit_summary(u: dict[str, Any]) -> str:
    """The verdict of one hunk (or added tree), in one line."""
    v = u["verdict"]
    if v == "live":
        parts = []
        if u["tus"]:
            parts.append("TUs " + _some(u["tus"]))
        if u["archs"]:
            parts.append("archs " + ", ".join(u["archs"]))
        if u["archs_only_with"] or u["archs_only_without"]:
            parts.append("device code for " + ", ".join(
                [f"{a} only with it" for a in u["archs_only_with"]] +
                [f"{a} only without it" for a in u["archs_only_without"]]))
        if u["host"]:
            parts.append("host code of " + _some(u["host"], 3))
        if u["configure"] == "code":
            parts.append("the configure")
        if not parts and u["outputs"]:
            parts.append("files " + _some(f["path"] for f in u["outputs"]))
        if not parts and u["other_actions"]:
            parts.append("actions " + _some(f"{a['label']} {a['action']}" for a in u["other_actions"]))
        return "live: " + "; ".join(parts)
    if v == "dead":
        moved = [c for c in u["device_preprocessed"] + u["host_preprocessed"] if c["change"] == "positions"]
        return "dead" + (f" (moves lines only: {len(moved)} preprocessed outputs)" if moved else "")
    if v == "breaks the build":
        return "breaks the build" + (f": {_first_line(u['error'])}" if u.get("error") else "")
    return "unknown" + (f": {_first_line(u['error'])}" if u.get("error") else "")


def unit_details(u: dict[str, Any]) -> list[str]:
    out = []
    code = [c for c in u["device_preprocessed"] if c["change"] != "positions"]
    if code:
        out.append("device preprocessed: " + _some(_pairs(code, True)))
    host = [c for c in u["host_preprocessed"] if c["change"] != "positions"]
    if host:
        out.append("host preprocessed: " + _some(_pairs(host, False)))
    for key, per_arch in (("ptx", True), ("cubins", True), ("objects", False)):
        changed = [c for c in u[key] if c["change"] != "positions"]
        if changed:
            out.append(f"{key}: " + _some(_pairs(changed, per_arch)))
    files = [f["path"] for f in u["outputs"] if f["change"] != "positions"]
    if files:
        out.append("outputs: " + _some(files))
    if len(u["group"]) > 1 or u.get("note"):
        out.append(u.get("note") or "")
    return [line for line in out if line]


def audit_lines(report: dict[str, Any]) -> list[str]:
    c, b = report["cost"], report["baseline"]
    lines = [f"audit {report['label']}: {report['hunks']} hunk(s) in {len(report['patches'])} patch(es); "
             f"baseline {'built' if b['ok'] else 'FAILS'} ({b['executed']} actions executed); "
             f"{c['builds']} variant builds, {c['executed']} actions executed"
             + (f", {c['substituted']} compile steps taken from the baseline" if c.get("substituted") else "")
             + f", {c['wall_s']} s"]
    for p in report["patches"]:
        counts = ", ".join(f"{p['verdicts'][v]} {v}" for v in ORDER if v in p["verdicts"])
        lines.append(f"{p['patch'] or 'added trees'} ({p['target']}): {counts}")
        if p.get("note"):
            lines.append(f"  note: {p['note']}")
        for u in p["units"]:
            where = (f"#{u['hunk']} {u['file']} {u['header']} (+{u['added']} -{u['removed']})" if "hunk" in u
                     else f"{u['file']}/ <- {u['added_tree']}")
            lines.append(f"  {where}: {unit_summary(u)}")
            lines += [f"      {d}" for d in unit_details(u)]
    return lines


def why_tree(prov, chains: dict[str, list[str]]):
    """`bgraph why LABEL FILE` as a tree: LABEL, the targets down to each one whose actions read
    the file, then TU, arch (or host side, or the configure) and the file with its patch."""
    from rich.markup import escape
    from rich.tree import Tree as RichTree

    root = RichTree(escape(str(prov.label)))
    nodes: dict[tuple, Any] = {(): root}

    def child(key: tuple, parent: tuple, text: str):
        if key not in nodes:
            nodes[key] = nodes[parent].add(escape(text))
        return key

    for r in prov.reads:
        key: tuple = ()
        for lab in chains.get(r.target, [str(prov.label), r.target])[1:]:
            key = child(key + (lab,), key, lab)
        step = r.action.split(" ", 1)[0]
        if r.tu is not None:
            key = child(key + ("tu", r.tu), key, f"TU {r.tu}")
            key = child(key + ("arch", r.arch), key, f"arch {r.arch} ({step})" if r.arch else f"host ({step})")
        else:
            key = child(key + ("action", r.action), key, r.action)
        via = r.provider.via()
        child(key + ("file", r.file, via), key, f"{r.file} <- {via}")
    return root
