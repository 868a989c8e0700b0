"""cuda_library: CUDA sources compiled per (translation unit, arch), archived into a static library.

Each TU is one `nvcc_compile.compile_tu` sub-plan: nvcc's own steps as actions, the
preprocessing narrowed by depfile to the files the TU reads.
"""

from __future__ import annotations

import re

from pydantic import Field

from build_graph.model import TargetOutput, Tree
from build_graph.rules.base import SRC, Attrs, Parallel, PlanGen, RuleContext, labels_in
from build_graph.rules.cuda_toolchain import ARCH, gencode_flags
from build_graph.rules.nvcc_compile import OBJECT, TU_STEM, SourceView, compile_tu, dryrun_action, for_tu, shared_dryrun


class CudaLibraryAttrs(Attrs):
    srcs: list[str] = Field(description="CUDA sources (.cu), workspace paths or globs; one TU each")
    hdrs: list[str] = Field(default_factory=list, description="headers visible to srcs and to dependents")
    deps: list[str] = Field(default_factory=list, description="other cuda_library targets (their hdrs)")
    ext: dict[str, str] = Field(default_factory=dict,
                                description="name -> label of a tree mounted at /bgraph/ext/<name> (e.g. CUTLASS)")
    archs: str | list[str] = Field(description="an arch set name from WORKSPACE.toml or a list like ['12.1a']")
    copts: list[str] = Field(default_factory=list, description="extra nvcc options")
    defines: list[str] = Field(default_factory=list, description="preprocessor defines (NAME or NAME=VALUE)")
    includes: list[str] = Field(default_factory=list, description="include dirs, relative to the workspace")
    toolchain: str = Field("//toolchains:cuda-13.0", description="cuda_toolchain target")
    memory_mb: int = Field(1024, ge=1, description="peak memory of one compile step, for the scheduler")
    pic: bool = Field(True, description="position-independent host code, so the archive links into a .so")


def cuda_library_deps(attrs: CudaLibraryAttrs):
    return labels_in(attrs, "deps", "ext", "toolchain")


def cuda_library_sources(attrs: CudaLibraryAttrs):
    return [("srcs", p) for p in attrs.srcs] + [("hdrs", p) for p in attrs.hdrs]


def _arch_order(arch: str) -> tuple[int, int, str]:
    """'12.1a' -> (12, 1, 'a'); an arch gencode_flags would refuse sorts last, for it to name."""
    m = ARCH.fullmatch(arch)
    return (int(m.group(1)), int(m.group(2)), m.group(3)) if m else (1 << 30, 0, arch)


def object_name(src: str) -> str:
    """The object file of a source: its workspace path flattened to one name (k/a.cu -> k_a.cu.o)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", src) + ".o"


def object_names(ctx: RuleContext, srcs: list[str]) -> list[str]:
    """Each source's object name; two sources that flatten to one name are an error naming both
    (the archive would silently keep only one of them)."""
    seen: dict[str, str] = {}
    for src in srcs:
        name = object_name(src)
        if name in seen:
            raise ctx.fail(f"sources {seen[name]!r} and {src!r} would both compile to object {name!r}",
                           "srcs", hint="rename one of them: objects are named after their flattened path")
        seen[name] = src
    return list(seen)


def _include_dir(ctx: RuleContext, path: str, visible: Tree) -> str:
    """A workspace-relative include directory, checked against the sources the action sees."""
    norm = path.strip().rstrip("/")
    if not norm or norm.startswith("/") or ".." in norm.split("/"):
        raise ctx.fail(f"includes entry {path!r} must be a directory relative to the workspace root",
                       "includes", hint="for example includes = [\"kernels/x/inc\"]")
    if not any(p.startswith(norm + "/") for p in visible.entries):
        raise ctx.fail(f"includes entry {path!r}: no declared header or source lies under {norm}/",
                       "includes", hint=f"declare the headers there in hdrs (e.g. \"{norm}/*.h\"): "
                                        "an action sees only declared files")
    return norm


def plan_cuda_library(ctx: RuleContext) -> PlanGen:
    a = ctx.attrs
    # In ascending order, whatever the list's: nvcc gives the host compile the last -gencode's
    # __CUDA_ARCH__ macros (which it reads), so an arch added below the highest re-runs no host
    # compile, and one arch set written in two orders is one build.
    archs = sorted(dict.fromkeys(ctx.arch_sets(a.archs, ctx.where("archs"))), key=_arch_order)
    toolchain = ctx.dep(a.toolchain, "toolchain")
    srcs = ctx.extra["expanded"].get("srcs", [])
    hdrs = ctx.extra["expanded"].get("hdrs", [])
    visible = ctx.sources
    for d in a.deps:
        visible = visible.merged(ctx.dep(d, "deps").tree.subtree("src"))
    ext = {f"/bgraph/ext/{name}": ctx.dep(label, "ext").tree for name, label in a.ext.items()}
    includes = [_include_dir(ctx, i, visible) for i in a.includes]
    flags = [*gencode_flags(archs), *(["-Xcompiler=-fPIC"] if a.pic else []), *a.copts, *(f"-D{d}" for d in a.defines),
             *(f"-I{SRC}/{i}" for i in includes), f"-I{SRC}"]

    # One nvcc --dryrun per source directory and extension (the flags are the target's), then each
    # TU is its own sub-plan, so TUs never wait at each other's barriers.
    view = SourceView({SRC: visible, **ext}, narrow=(SRC, *ext), memory_mb=a.memory_mb)
    names = object_names(ctx, srcs)
    args = [[*flags, "-c", f"{SRC}/{src}"] for src in srcs]
    shared = [shared_dryrun(tu_args, name) for tu_args, name in zip(args, names, strict=True)]
    distinct = list(dict.fromkeys(tuple(s) for s in shared if s is not None))
    ran = (yield [dryrun_action(ctx, d[-1].removeprefix(f"{SRC}/").replace(TU_STEM, "*"), list(d), OBJECT, toolchain)
                  for d in distinct]) if distinct else []
    texts = {d: ctx.read(o.tree.entries["dryrun.txt"]).decode() for d, o in zip(distinct, ran, strict=True)}
    objects_list = yield Parallel(
        compile_tu(ctx, src, tu_args, name, view, toolchain,
                   for_tu(texts[tuple(sh)], tu_args, name) if sh is not None else None)
        for src, name, tu_args, sh in zip(srcs, names, args, shared, strict=True))
    objects = dict(zip(names, objects_list, strict=True))

    # Archive the objects (deterministic: ar D).
    lib = f"lib{ctx.label.name}.a"
    [archived] = yield [ctx.exec_action(
        "archive", "CudaArchive", ["/usr/bin/ar", "rcsD", lib, *(f"/bgraph/in/{o}" for o in sorted(objects))],
        inputs={"/bgraph/in": Tree(objects)}, outputs=[lib], toolchain=toolchain, memory_mb=128)]
    header_tree = ctx.sources.select(hdrs).prefixed("src")
    return TargetOutput(archived.tree.merged(Tree(objects).prefixed("obj"), header_tree),
                        {"archive": lib, "archs": archs, "objects": sorted(objects)})
