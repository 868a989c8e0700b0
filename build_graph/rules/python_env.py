"""python_env: pinned wheels unpacked into one site-packages tree (what `pip install --target`
would give, without pip and without running anything from the wheels).

Each wheel's `<name>.data/purelib` and `platlib` join the root; its scripts, headers and data
are left out. Two wheels holding one path with different content is an error.
"""

from __future__ import annotations

import re

from pydantic import Field

from build_graph.model import TargetOutput, Tree
from build_graph.rules.base import Attrs, PlanGen, RuleContext

_DATA = re.compile(r"^[^/]+\.data/([^/]+)/(.*)$")


class PythonEnvAttrs(Attrs):
    wheels: list[str] = Field(description="pin names of the wheels (kind = \"pypi\", file = \"wheel\")")


def site_packages(wheel: Tree) -> Tree:
    """A wheel's entries as they lie in site-packages."""
    out = {}
    for path, entry in wheel.entries.items():
        m = _DATA.match(path)
        if m is None:
            out[path] = entry
        elif m.group(1) in ("purelib", "platlib") and m.group(2):
            out[m.group(2)] = entry
    return Tree(out)


def plan_python_env(ctx: RuleContext) -> PlanGen:
    fetched = yield [ctx.fetch_action(pin, "wheels") for pin in ctx.attrs.wheels]
    unpacked = yield [ctx.extract_action(f.tree, f.action.outputs[0]) for f in fetched]
    trees = [site_packages(u.tree) for u in unpacked]
    try:
        env = trees[0].merged(*trees[1:]) if trees else Tree()
    except ValueError as e:
        raise ctx.fail(f"wheels overlap: {e}", "wheels") from None
    return TargetOutput(env, {"wheels": list(ctx.attrs.wheels)})
