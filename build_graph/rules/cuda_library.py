"""cuda_library: CUDA sources compiled per (translation unit, arch), archived into a static library.

Plan, per TU: `nvcc --dryrun` (keyed on toolchain and flags, not on the source) lists nvcc's
steps; each becomes its own sandboxed action keyed on exactly what it reads. Preprocessing runs
whenever sources change (it is how header dependencies are discovered: gcc follows #include);
cicc/ptxas for an arch run only when that arch's preprocessed text changes; fatbinary and the
host compile are the cheap combining steps.
"""

from __future__ import annotations

import re

from pydantic import Field

from build_graph.model import TargetOutput, Tree
from build_graph.nvcc import DryrunError, parse_dryrun
from build_graph.model import FileEntry
from build_graph.rules.base import SRC, TOOLCHAIN, Attrs, Parallel, PlanGen, RuleContext, labels_in
from build_graph.rules.cuda_toolchain import gencode_flags

STEP_MNEMONIC = {"hostpp": "CudaHostPreprocess", "cudafe": "CudaFrontend", "devpp": "CudaDevicePreprocess",
                 "cicc": "CudaCicc", "ptxas": "CudaPtxas", "fatbin": "CudaFatbinary", "hostcc": "CudaHostCompile",
                 "fatbinobj": "CudaFatbinObject", "link": "CudaObjectLink"}


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


def object_name(src: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", src) + ".o"


def plan_cuda_library(ctx: RuleContext) -> PlanGen:
    a = ctx.attrs
    archs = ctx.arch_sets(a.archs, ctx.where("archs"))
    toolchain = ctx.dep(a.toolchain, "toolchain")
    srcs = ctx.extra["expanded"].get("srcs", [])
    hdrs = ctx.extra["expanded"].get("hdrs", [])
    visible = ctx.sources
    for d in a.deps:
        visible = visible.merged(ctx.dep(d, "deps").tree.subtree("src"))
    ext = {f"/bgraph/ext/{name}": ctx.dep(label, "ext").tree for name, label in a.ext.items()}
    flags = [*gencode_flags(archs), *(["-Xcompiler=-fPIC"] if a.pic else []), *a.copts, *(f"-D{d}" for d in a.defines),
             *(f"-I{SRC}/{i}" for i in a.includes), f"-I{SRC}"]

    # Each TU is its own sub-plan (dryrun, then its steps), so TUs never wait at each other's barriers.
    objects_list = yield Parallel(_compile_tu(ctx, src, flags, visible, ext, toolchain) for src in srcs)
    objects = {object_name(src): obj for src, obj in zip(srcs, objects_list, strict=True)}

    # Archive the objects (deterministic: ar D).
    lib = f"lib{ctx.label.name}.a"
    [archived] = yield [ctx.exec_action(
        "archive", "CudaArchive", ["/usr/bin/ar", "rcsD", lib, *(f"/bgraph/in/{o}" for o in sorted(objects))],
        inputs={"/bgraph/in": Tree(objects)}, outputs=[lib], toolchain=toolchain, memory_mb=128)]
    header_tree = ctx.sources.select(hdrs).prefixed("src")
    return TargetOutput(archived.tree.merged(Tree(objects).prefixed("obj"), header_tree),
                        {"archive": lib, "archs": archs, "objects": sorted(objects)})


def _compile_tu(ctx: RuleContext, src: str, flags: list[str], visible: Tree, ext: dict[str, Tree],
                toolchain: TargetOutput):
    """One TU: `nvcc --dryrun` (keyed on flags and toolchain only, not the source), then its
    steps, each launched once the files it reads exist. Returns the object file."""
    [dry] = yield [ctx.exec_action(
        f"dryrun {src}", "CudaDryrun",
        ["/bin/sh", "-c", '"$@" 2> dryrun.txt || { cat dryrun.txt >&2; exit 1; }', "nvcc",
         f"{TOOLCHAIN}/bin/nvcc", "--dryrun", *flags, "-c", f"{SRC}/{src}", "-o", object_name(src)],
        inputs={}, outputs=["dryrun.txt"], toolchain=toolchain, memory_mb=128)]
    try:
        symbol = "__bgraph_fatbin_" + ctx.digester.of(f"{ctx.label}:{src}".encode())[:16]
        env, steps = parse_dryrun(ctx.read(dry.tree.entries["dryrun.txt"]).decode(), object_name(src), symbol)
    except DryrunError as e:
        raise ctx.fail(f"{src}: {e}", "srcs") from None
    produced: dict[str, FileEntry] = {}
    pending = list(steps)
    while pending:
        ready = [s for s in pending if all(i in produced for i in s.needs())]
        if not ready:
            raise ctx.fail(f"{src}: nvcc steps form a cycle; cannot schedule", "srcs")
        batch = []
        for s in ready:
            pending.remove(s)
            files = {i: produced[i] for i in s.inputs}
            files.update({alias: produced[orig] for alias, orig in s.aliases.items()})
            inputs = {"/bgraph/in": Tree(files)}
            if s.reads_source:
                inputs[SRC] = visible
                inputs.update(ext)
            heavy = s.kind in ("cicc", "ptxas", "hostcc")
            batch.append(ctx.exec_action(
                f"{s.kind} {src}" + (f" {s.arch}" if s.arch else ""), STEP_MNEMONIC[s.kind], s.argv, inputs=inputs,
                outputs=[s.output_path(n) for n in s.outputs], env=env, toolchain=toolchain, memory_mb=ctx.attrs.memory_mb if heavy else 256))
        for s, outcome in zip(ready, (yield batch), strict=True):
            for name in s.outputs:
                produced[name] = outcome.tree.entries[s.output_path(name)]
    return produced[steps[-1].outputs[0]]
