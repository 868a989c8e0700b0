"""cc_shared_library: link static libraries (e.g. from cuda_library) into a .so with the host compiler."""

from __future__ import annotations

from pydantic import Field

from build_graph.model import TargetOutput, Tree
from build_graph.rules.base import TOOLCHAIN, Attrs, PlanGen, RuleContext, labels_in


class CcSharedLibraryAttrs(Attrs):
    deps: list[str] = Field(description="cuda_library targets whose archives are linked whole")
    soname: str | None = Field(None, description="output file name (default lib<name>.so)")
    linkopts: list[str] = Field(default_factory=list, description="extra linker options")
    toolchain: str = Field("//toolchains:cuda-13.0", description="cuda_toolchain providing static cudart")


def cc_shared_library_deps(attrs: CcSharedLibraryAttrs):
    return labels_in(attrs, "deps", "toolchain")


def plan_cc_shared_library(ctx: RuleContext) -> PlanGen:
    toolchain = ctx.dep(ctx.attrs.toolchain, "toolchain")
    archives = {}
    for d in ctx.attrs.deps:
        out = ctx.dep(d, "deps")
        name = out.info.get("archive")
        if not name:
            raise ctx.fail(f"{d} provides no static archive", "deps")
        archives[f"{len(archives):02d}_{name}"] = out.tree.entries[name]
    so = ctx.attrs.soname or f"lib{ctx.label.name}.so"
    argv = ["/usr/bin/g++", "-shared", "-o", so, f"-Wl,-soname,{so}", "-Wl,--build-id=none",
            "-Wl,--whole-archive", *(f"/bgraph/in/{a}" for a in sorted(archives)), "-Wl,--no-whole-archive",
            f"-L{TOOLCHAIN}/lib", "-l:libcudart_static.a", "-lpthread", "-ldl", "-lrt", *ctx.attrs.linkopts]
    [linked] = yield [ctx.exec_action("link " + so, "CcLink", argv, inputs={"/bgraph/in": Tree(archives)},
                                      outputs=[so], toolchain=toolchain, memory_mb=1024)]
    return TargetOutput(linked.tree, {"shared_library": so})
