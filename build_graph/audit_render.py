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


WHOLE_LISTED = 5  # more actions than this reading a file through one whole mount are counted, not listed


def why_lines(prov) -> list:
    """`bgraph why LABEL FILE` for people: notes, one summary line, then the tree (or why
    there is none)."""
    from rich.markup import escape

    root = str(prov.root or prov.label)
    lines: list = [f"note: {escape(prov.note)}"] if prov.note else []
    for target, other in prov.foreign.items():
        lines.append(f"note: the last build of {escape(target)} recorded in this cache ran in another workspace, "
                     f"{escape(other)} (the cache is shared): the answer is that build's")
    if not prov.recorded:
        lines.append(escape(f"{root} has no recorded build: run `{prov.build_command or 'bgraph build ' + root}` first")
                     + (escape(f" (its recorded builds: {', '.join(prov.other_configs)}; --platform chooses)")
                        if prov.other_configs else ""))
        return lines
    unchecked = (f"; {prov.unchecked} action(s) not checked: what they read is no longer in the cache"
                 if prov.unchecked else "")
    if not prov.reads:
        lines.append(escape(f"{root} reaches no action that read {prov.subject} "
                            f"(no action of its last build read it{unchecked})"))
        for p in prov.providers:
            if p.label is not None and str(p.label) != root:
                lines.append(escape(f"  {p.label} {'applies' if p.patch else 'holds'} it"
                                    + (f" (changes {', '.join(sorted(p.files))})" if p.patch else "")))
        return lines
    tus = {(r.target, r.tu) for r in prov.reads if r.tu and not r.whole}
    whole = sum(r.whole for r in prov.reads)
    targets = sorted({str(p.label) for p in prov.providers if p.label is not None})
    lines.append(escape(f"{root} reaches {prov.subject}" + (f" ({', '.join(targets)})" if targets else "")
                        + f" through {len({r.target for r in prov.reads})} target(s), {len(tus)} TU(s), "
                        f"{len(prov.reads)} action read(s)"
                        + (f" ({whole} not narrowed: the action can read every file of the mount)" if whole else "")
                        + f"{unchecked}:"))
    lines.append(why_tree(prov))
    return lines


def why_tree(prov):
    """`bgraph why LABEL FILE` as a tree: LABEL, the targets down to each one whose actions read
    the file, then TU, arch (or host side, or the configure) and the file with its patch. An
    action that is not narrowed (it mounts a tree whole: a custom command, the patch
    application) reads all of that mount; more than a few such actions through one mount are
    counted per step."""
    from collections import Counter

    from rich.markup import escape
    from rich.tree import Tree as RichTree

    root_name = str(prov.root or prov.label)
    root = RichTree(escape(root_name))
    nodes: dict[tuple, Any] = {(): root}

    def child(key: tuple, parent: tuple, text: str):
        if key not in nodes:
            nodes[key] = nodes[parent].add(escape(text))
        return key

    def down_to(target: str) -> tuple:
        key: tuple = ()
        for lab in prov.chains.get(target, [root_name, target])[1:]:
            key = child(key + (lab,), key, lab)
        return key

    whole: dict[tuple, list] = {}
    for r in prov.reads:
        if r.whole:
            whole.setdefault((r.target, r.mount, r.file, r.provider.via()), []).append(r)
            continue
        key = down_to(r.target)
        step = r.action.split(" ", 1)[0]
        if r.tu is not None:
            key = child(key + ("tu", r.tu), key, f"TU {r.tu}")
            key = child(key + ("arch", r.arch), key, f"arch {r.arch} ({step})" if r.arch else f"host ({step})")
        else:
            key = child(key + ("action", r.action), key, r.action)
        child(key + ("file", r.file, r.provider.via()), key, f"{r.file} <- {r.provider.via()}")
    for (target, mount, file, via), reads in whole.items():
        key = down_to(target)
        if len(reads) <= WHOLE_LISTED:
            for r in reads:
                at = child(key + ("action", r.action), key, r.action)
                child(at + ("whole", mount, file, via), at, f"{file} <- {via} (reads all of {mount}, not narrowed)")
        else:
            steps = Counter(r.action.split(" ", 1)[0] for r in reads)
            at = child(key + ("whole", mount), key,
                       f"{len(reads)} actions that read all of {mount} (not narrowed): "
                       + ", ".join(f"{step} x{n}" for step, n in sorted(steps.items())))
            child(at + ("file", file, via), at, f"{file} <- {via}")
    return root
