"""A Ninja graph written inside the sandbox, planned edge by edge as bgraph actions: what
`cmake_project` (CMake's build.ninja) and `ninja_generator` (a generator's build.ninja files)
share. Pure planning; the graph itself comes from Ninja's own tools (ninja_graph.py).

- nvcc compiles go through `nvcc_compile.compile_tu` (per TU and arch, early cutoff), each
  with its own flags and -gencode list, its dependency options replaced by compile_tu's own
  `-MD` per step (narrowed unless `depfile.nvcc_dependency_free` names a reason not to);
- other compiles run as one action, narrowed by their depfile only where
  `depfile.complete_compile` proves it complete (its soundness contract is in depfile.py; a
  project's `-MMD` is run as `-MD`, and GNU as is asked for its own depfile, `-Wa,--MD`: the
  same object); any other compile is keyed
  on everything it can read, like a custom command;
- link and archive edges see exactly the inputs Ninja lists, and the source files their command
  names by path (a version or linker script: red team R7); custom commands see the whole build
  directory and source tree.

Every edge runs with the build directory staged into /bgraph/out (symlinks into a read-only
mount), so its command runs verbatim, as Ninja would run it.
"""

from __future__ import annotations

import fnmatch
import hashlib
import re
from dataclasses import dataclass

from build_graph.depfile import (NVCC_DEPS_ONLY, CompleteDepfile, Whole, complete_compile, nvcc_dependency_free,
                                 precompiled)
from build_graph.incremental.discovery import Depfile
from build_graph.model import FileEntry, TargetOutput, Tree
from build_graph.ninja_graph import Edge, NinjaGraph, relative
from build_graph.nvcc import split_command
from build_graph.rules.base import BASE_ENV, OUT, SRC, Parallel, RuleContext
from build_graph.rules.nvcc_compile import SourceView, compile_tu

STAGE = "/bgraph/stage"
NVCC = "/bgraph/toolchain/bin/nvcc"
_MAX_FLAT = 200  # of 255 bytes a file name may have: compile_tu adds suffixes such as .devpp.1210.d


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
    # A precompiled header in a narrowed tree stands in for a header unnamed by any depfile
    # (depfile.py, point 6): looked for once per tree, not once per edge.
    pch = next(filter(None, (precompiled(t.entries) for m, t in [*setting.mounts.items(), (STAGE, build_tree)]
                             if m in (SRC, STAGE, *_ext(setting.mounts)))), None)
    depth: dict[int, int] = {}
    for edge in edges:
        depth[id(edge)] = 1 + max((depth[id(d)] for d in graph.deps(edge)), default=-1)
    for wave in range(max(depth.values(), default=-1) + 1):
        batch = [e for e in edges if depth[id(e)] == wave]
        results = yield Parallel(_plan_edge(ctx, graph, e, build_tree, built, setting, pch) for e in batch)
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


def _plan_edge(ctx: RuleContext, graph: NinjaGraph, edge: Edge, build_tree: Tree, built: dict, s: EdgeSetting,
               pch: str | None):
    """Sub-plan for one edge; returns the tree of its outputs (build-dir paths)."""
    name = edge.outputs[0]
    inputs = _edge_inputs(graph, edge, built)
    argv = split_command(edge.command)  # shlex's rules, without its pure-Python cost per edge
    is_compile = "-c" in argv and "-o" in argv and "&&" not in argv
    narrow = (SRC, STAGE, *_ext(s.mounts))
    linking = any(fnmatch.fnmatchcase(edge.rule, g) for g in s.link_rules)
    everything = {**s.mounts, STAGE: build_tree.overlaid(inputs)} if is_compile or not linking else {}
    if is_compile and argv[0] == NVCC and not any(a in NVCC_DEPS_ONLY for a in argv):
        obj = argv[argv.index("-o") + 1]
        nvcc_args, why = nvcc_dependency_free(argv[1:], (*narrow, OUT))
        view = SourceView(everything, narrow=narrow if why is None else (), staged=STAGE, memory_mb=s.memory_mb)
        flat = _flat_name(obj.removeprefix(OUT + "/"))
        entry = yield from compile_tu(ctx, name, nvcc_args, flat, view, s.toolchain)
        return Tree({name: entry})
    if is_compile:
        found = complete_compile(edge.command, {**BASE_ENV, **s.env}, narrow, OUT, edge.outputs)
        stand_in = pch or precompiled(inputs.entries)
        if isinstance(found, CompleteDepfile) and stand_in:
            found = Whole(f"precompiled header {stand_in} in its inputs", True)
        if isinstance(found, CompleteDepfile):
            depfile, assembler = relative(found.depfile, OUT), relative(found.assembler, OUT)
            [done] = yield [ctx.exec_action(
                f"compile {name}", f"{s.mnemonic}Compile", ["/bin/sh", "-c", found.command],
                inputs=everything, outputs=[*edge.outputs, depfile, assembler], env=s.env, toolchain=s.toolchain,
                host=s.host, memory_mb=s.memory_mb, staged=STAGE,
                discovery=Depfile(narrow, (depfile,), assembler=(assembler,)))]
            return done.tree.select(edge.outputs)
        if found.compiler:
            # Not proven complete (found.reason): keyed on every file it can read.
            [done] = yield [ctx.exec_action(
                f"compile {name}", f"{s.mnemonic}Compile", ["/bin/sh", "-c", edge.command], inputs=everything,
                outputs=edge.outputs, env=s.env, toolchain=s.toolchain, host=s.host, memory_mb=s.memory_mb,
                staged=STAGE)]
            return done.tree
    if linking:
        # A link or archive reads what Ninja lists (objects, libraries) and the external trees
        # (torch's libraries), and of the source tree only the files its command names: an edit
        # to the other sources reaches it only through an object that changed.
        seen = {m: t for m, t in s.mounts.items() if m != SRC}  # external trees hold libraries it links
        seen[STAGE] = inputs
        named = _named_sources(edge.command, s.mounts.get(SRC))
        if named is not None:  # a version script or linker script of the sources that Ninja does not list
            seen[SRC] = named
    else:
        # A custom command may read anything in the sources and the build tree (it has no depfile).
        seen = everything
    [done] = yield [ctx.exec_action(
        f"{edge.rule.split('__')[0].lower()} {name}", f"{s.mnemonic}Edge", ["/bin/sh", "-c", edge.command],
        inputs=seen, outputs=edge.outputs, env=s.env, toolchain=s.toolchain, host=s.host,
        memory_mb=s.memory_mb, staged=STAGE)]
    return done.tree


_SOURCE_PATH = re.compile(re.escape(SRC) + r"/([^\s'\"=,;:]+)")


def _named_sources(command: str, src: Tree | None) -> Tree | None:
    """The files of the source tree a link's command names by path (`-Wl,--version-script=...`,
    `-T script`: CMake lists them as the link's inputs only with LINK_DEPENDS), as a tree of just
    those; None where it names none."""
    if src is None:
        return None
    named = {p: src.entries[p] for p in (m.group(1) for m in _SOURCE_PATH.finditer(command))
             if isinstance(src.entries.get(p), FileEntry)}
    return Tree(named) if named else None


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
