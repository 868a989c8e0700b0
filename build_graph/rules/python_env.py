"""python_env: pinned wheels unpacked into one site-packages tree (what `pip install --target`
would give, without pip and without running anything from the wheels).

Each wheel's `<name>.data/purelib` and `platlib` join the root; its scripts, headers and data
are left out. Two wheels holding one path with different content is an error.
"""

from __future__ import annotations

import re

from pydantic import Field

from build_graph.model import DirEntry, TargetOutput, Tree
from build_graph.rules.base import Attrs, PlanGen, RuleContext

_DATA = re.compile(r"^[^/]+\.data/([^/]+)/(.*)$")


class PythonEnvAttrs(Attrs):
    wheels: list[str] = Field(description="pin names of the wheels (kind = \"pypi\", file = \"wheel\")")


def site_packages(wheel: Tree, name: str = "the wheel") -> Tree:
    """A wheel's entries as they lie in site-packages; a ValueError naming the entries where the
    wheel (`name` in the message) puts two things at one path, or something below a file."""
    out: dict = {}
    origin: dict[str, str] = {}
    for path, entry in wheel.entries.items():
        m = _DATA.match(path)
        if m is None:
            dest = path
        elif m.group(1) in ("purelib", "platlib") and m.group(2):
            dest = m.group(2)
        else:
            continue
        if dest in out and out[dest] != entry:
            raise ValueError(f"{name} installs {dest!r} twice, as {origin[dest]!r} and as {path!r}")
        out[dest], origin[dest] = entry, path
    nested = below_a_file(out)
    if nested:
        inner, outer = nested
        raise ValueError(f"{name} installs {origin[inner]!r} below {origin[outer]!r}, a file at {outer!r}")
    return Tree(out)


def below_a_file(entries) -> tuple[str, str] | None:
    """The first (path, parent) where `entries` (path -> entry) put something below a file or
    symlink: such a tree cannot be materialized (a file cannot hold a directory)."""
    leaves = {p for p, e in entries.items() if not isinstance(e, DirEntry)}
    for path in entries:
        parent = path
        while "/" in parent:
            parent = parent.rpartition("/")[0]
            if parent in leaves:
                return path, parent
    return None


def plan_python_env(ctx: RuleContext) -> PlanGen:
    fetched = yield [ctx.fetch_action(pin, "wheels") for pin in ctx.attrs.wheels]
    unpacked = yield [ctx.extract_action(f.tree, f.action.outputs[0]) for f in fetched]
    trees = []
    for pin, f, u in zip(ctx.attrs.wheels, fetched, unpacked):
        try:
            trees.append(site_packages(u.tree, f"wheel {f.action.outputs[0]} (pin {pin})"))
        except ValueError as e:
            raise ctx.fail(str(e), "wheels", hint="the wheel is malformed: rebuild it, or pin another one") from None
    try:
        env = trees[0].merged(*trees[1:]) if trees else Tree()
    except ValueError as e:
        raise ctx.fail(f"wheels overlap: {e}", "wheels") from None
    nested = below_a_file(env.entries)
    if nested:
        holders = [pin for pin, t in zip(ctx.attrs.wheels, trees) if any(p in t.entries for p in nested)]
        raise ctx.fail(f"wheels overlap: {nested[0]!r} lies below {nested[1]!r}, a file (pins {', '.join(holders)})",
                       "wheels", hint="install them in two environments, or pin versions that agree")
    return TargetOutput(env, {"wheels": list(ctx.attrs.wheels)})
