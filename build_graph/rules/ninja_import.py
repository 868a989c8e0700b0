"""A Ninja graph written inside the sandbox, planned edge by edge as bgraph actions: what
`cmake_project` (CMake's build.ninja) and `ninja_generator` (a generator's build.ninja files)
share. Pure planning; the graph itself comes from Ninja's own tools (ninja_graph.py).

- nvcc compiles go through `nvcc_compile.compile_tu` (per TU and arch, early cutoff), each
  with its own flags and -gencode list;
- other compiles (a `-MF` depfile in the command) run as one action narrowed by that depfile;
- link and archive edges see exactly the inputs Ninja lists; custom commands see the whole
  build directory.

Every edge runs with the build directory staged into /bgraph/out (symlinks into a read-only
mount), so its command runs verbatim, as Ninja would run it.
"""

from __future__ import annotations

import fnmatch
import hashlib
import re
from dataclasses import dataclass

from build_graph.model import TargetOutput, Tree
from build_graph.ninja_graph import Edge, NinjaGraph, relative
from build_graph.nvcc import split_command
from build_graph.rules.base import OUT, SRC, Parallel, RuleContext
from build_graph.rules.nvcc_compile import SourceView, compile_tu

STAGE = "/bgraph/stage"
NVCC = "/bgraph/toolchain/bin/nvcc"
# Dependency-file options of nvcc's command line: compile_tu writes its own depfiles per step.
_DEP_FLAGS_WITH_VALUE = ("-o", "-MT", "-MF", "--dependency-output")
_MAX_FLAT = 200  # of 255 bytes a file name may have: compile_tu adds suffixes such as .devpp.1210.d
_DEP_FLAGS = ("-MD", "-MMD", "--generate-dependencies-with-compile", "--generate-nonsystem-dependencies-with-compile")


@dataclass(frozen=True)
class EdgeSetting:
    """How one importing rule runs the edges: what every edge sees and how its actions are named."""

    mounts: dict[str, Tree]  # source tree at /bgraph/src and external trees
    env: dict[str, str]
    toolchain: TargetOutput
    host: TargetOutput
    memory_mb: int
    link_rules: tuple[str, ...]  # globs of the Ninja rules that link or archive
    mnemonic: str  # prefix of the non-nvcc actions' mnemonics ("Cmake": CmakeCompile, CmakeEdge)


def import_edges(ctx: RuleContext, graph: NinjaGraph, edges: list[Edge], build_tree: Tree, setting: EdgeSetting):
    """Sub-plan: `edges` (dependencies first) as actions, in waves of edges whose inputs are
    all built. Returns {build-dir path: FileEntry} of everything built."""
    built: dict[str, object] = {}
    depth: dict[int, int] = {}
    for edge in edges:
        depth[id(edge)] = 1 + max((depth[id(d)] for d in graph.deps(edge)), default=-1)
    for wave in range(max(depth.values(), default=-1) + 1):
        batch = [e for e in edges if depth[id(e)] == wave]
        results = yield Parallel(_plan_edge(ctx, graph, e, build_tree, built, setting) for e in batch)
        for e, tree in zip(batch, results, strict=True):
            built.update(tree.entries)
    return built


def _edge_inputs(graph: NinjaGraph, edge: Edge, built: dict) -> Tree:
    """The built files an edge reads, transitively through phony aliases (build-dir paths)."""
    files = {}
    for i in edge.inputs():
        for f in graph.resolve(i):
            if f in built:
                files[f] = built[f]
    return Tree(files)


def _without(argv: list[str], flags_with_value: tuple[str, ...], flags: tuple[str, ...]) -> list[str]:
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in flags_with_value:
            skip = True
        elif arg not in flags:
            out.append(arg)
    return out


def _plan_edge(ctx: RuleContext, graph: NinjaGraph, edge: Edge, build_tree: Tree, built: dict, s: EdgeSetting):
    """Sub-plan for one edge; returns the tree of its outputs (build-dir paths)."""
    name = edge.outputs[0]
    inputs = _edge_inputs(graph, edge, built)
    argv = split_command(edge.command)  # shlex's rules, without its pure-Python cost per edge
    is_compile = "-c" in argv and "-o" in argv and "&&" not in argv
    narrow = (SRC, STAGE, *_ext(s.mounts))
    if is_compile and argv[0] == NVCC:
        obj = argv[argv.index("-o") + 1]
        nvcc_args = _without(argv[1:], _DEP_FLAGS_WITH_VALUE, _DEP_FLAGS)
        view = SourceView({**s.mounts, STAGE: build_tree.overlaid(inputs)}, narrow=narrow,
                          staged=STAGE, memory_mb=s.memory_mb)
        flat = _flat_name(obj.removeprefix(OUT + "/"))
        entry = yield from compile_tu(ctx, name, nvcc_args, flat, view, s.toolchain)
        return Tree({name: entry})
    if is_compile and "-MF" in argv:
        depfile = relative(argv[argv.index("-MF") + 1], OUT)
        [done] = yield [ctx.exec_action(
            f"compile {name}", f"{s.mnemonic}Compile", ["/bin/sh", "-c", edge.command],
            inputs={**s.mounts, STAGE: build_tree.overlaid(inputs)}, outputs=[*edge.outputs, depfile], env=s.env,
            toolchain=s.toolchain, host=s.host, memory_mb=s.memory_mb, staged=STAGE,
            narrow=narrow, depfiles=(depfile,))]
        return done.tree.select(edge.outputs)
    if any(fnmatch.fnmatchcase(edge.rule, g) for g in s.link_rules):
        # A link or archive reads what Ninja lists (objects, libraries) and the external trees
        # (torch's libraries), never the source tree: an edit to the sources reaches it only
        # through an object that changed.
        seen = {m: t for m, t in s.mounts.items() if m != SRC}  # external trees hold libraries it links
        seen[STAGE] = inputs
    else:
        # A custom command may read anything in the sources and the build tree (it has no depfile).
        seen = {**s.mounts, STAGE: build_tree.overlaid(inputs)}
    [done] = yield [ctx.exec_action(
        f"{edge.rule.split('__')[0].lower()} {name}", f"{s.mnemonic}Edge", ["/bin/sh", "-c", edge.command],
        inputs=seen, outputs=edge.outputs, env=s.env, toolchain=s.toolchain, host=s.host,
        memory_mb=s.memory_mb, staged=STAGE)]
    return done.tree


def _flat_name(path: str) -> str:
    """A build path as one file name for compile_tu's object and depfiles: `/` and the like become
    `_`; a name too long for the file system (FlashInfer's module names run to 200 characters,
    twice in an object's path) keeps its ends and a hash of the whole."""
    flat = re.sub(r"[^A-Za-z0-9_.-]", "_", path)
    if len(flat) <= _MAX_FLAT:
        return flat
    return f"{flat[:60]}_{hashlib.sha256(path.encode()).hexdigest()[:16]}_{flat[-100:]}"


def _ext(mounts: dict[str, Tree]) -> tuple[str, ...]:
    return tuple(m for m in mounts if m.startswith(("/bgraph/ext/", "/bgraph/exec/")))
