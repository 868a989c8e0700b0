"""genrule: a declared shell command over declared inputs and outputs, sandboxed like every action."""

from __future__ import annotations

import re

from pydantic import Field, field_validator

from build_graph.model import check_relpath

from build_graph.model import TargetOutput
from build_graph.rules.base import SRC, Attrs, PlanGen, RuleContext, labels_in


class GenruleAttrs(Attrs):
    cmd: str = Field(description="shell command; $SRC, $OUT and $IN_<name> point into the sandbox")
    outs: list[str] = Field(description="output paths relative to $OUT")
    srcs: list[str] = Field(default_factory=list, description="workspace paths or globs, visible under $SRC")
    deps: dict[str, str] = Field(default_factory=dict, description="name -> label, mounted at /bgraph/in/<name>")
    toolchain: str | None = Field(None, description="optional cuda_toolchain at /bgraph/toolchain")
    tools: str = Field("//toolchains:host", description="host_tools target providing the shell")
    memory_mb: int = Field(512, ge=1, description="peak memory, for the scheduler")

    @field_validator("outs")
    @classmethod
    def _outs_inside(cls, v: list[str]) -> list[str]:
        for o in v:
            try:
                check_relpath(o)
            except ValueError:
                raise ValueError(f"output {o!r} must be a relative path inside $OUT") from None
        return v

    @field_validator("deps")
    @classmethod
    def _dep_names(cls, v: dict[str, str]) -> dict[str, str]:
        env_names: dict[str, str] = {}
        for name in v:
            if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", name):
                raise ValueError(f"dep name {name!r} must be letters, digits and '_' (it names /bgraph/in/<name>)")
            if name.upper() in env_names:
                raise ValueError(f"dep names {env_names[name.upper()]!r} and {name!r} both give $IN_{name.upper()}")
            env_names[name.upper()] = name
        return v


def genrule_deps(attrs: GenruleAttrs):
    return labels_in(attrs, "deps", "toolchain", "tools")


def genrule_sources(attrs: GenruleAttrs):
    return [("srcs", p) for p in attrs.srcs]


def plan_genrule(ctx: RuleContext) -> PlanGen:
    inputs = {SRC: ctx.sources}
    env = {"SRC": SRC, "OUT": "/bgraph/out"}
    for name, label in ctx.attrs.deps.items():
        inputs[f"/bgraph/in/{name}"] = ctx.dep(label, "deps").tree
        env[f"IN_{name.upper()}"] = f"/bgraph/in/{name}"
    toolchain = ctx.dep(ctx.attrs.toolchain, "toolchain") if ctx.attrs.toolchain else None
    [out] = yield [ctx.exec_action(
        "genrule", "Genrule", ["/bin/sh", "-c", ctx.attrs.cmd], inputs=inputs, outputs=ctx.attrs.outs,
        env=env, toolchain=toolchain, host=ctx.dep(ctx.attrs.tools, "tools"), memory_mb=ctx.attrs.memory_mb)]
    return TargetOutput(out.tree, {})
