"""One CUDA translation unit compiled through nvcc's own steps: the sub-plan that both
`cuda_library` and the CMake import (`cmake_project`) use for every nvcc compile.

`nvcc --dryrun` (keyed on the flags and the toolchain, not on the source: run with placeholder
names, one serves all the TUs of a directory with one flag set) lists the steps;
each becomes a sandboxed action keyed on exactly what it reads. The preprocessing steps (host
and per arch) read the source tree: each writes a depfile, and the rebuilder narrows their
inputs to the files it names, so an edit to a file the TU does not include runs nothing.
cicc/ptxas for an arch run only when that arch's preprocessed text changes; the host compile
sees no device code, and fatbinary's step (cheap) embeds the cubins and joins the TU's object.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from build_graph import macro_use
from build_graph.depfile import steered
from build_graph.incremental.discovery import Preprocessed, RecordedMacros
from build_graph.model import Action, TargetOutput, Tree
from build_graph.nvcc import DryrunError, parse_dryrun
from build_graph.rules.base import OUT, TOOLCHAIN, Dataflow, RuleContext

STEP_MNEMONIC = {"hostpp": "CudaHostPreprocess", "cudafe": "CudaFrontend", "devpp": "CudaDevicePreprocess",
                 "cicc": "CudaCicc", "ptxas": "CudaPtxas", "fatbin": "CudaFatbinary", "hostcc": "CudaHostCompile"}


@dataclass(frozen=True)
class SourceView:
    """What the preprocessing steps of a TU see: mounts (source tree, external trees, a build
    directory staged into /bgraph/out), which of them are narrowed by depfile, and the cwd."""

    mounts: dict[str, Tree]
    narrow: tuple[str, ...]
    staged: str | None = None
    cwd: str = OUT
    memory_mb: int = 1024


# A dryrun names the source and the object only to print them: run with these names in their
# place, one serves every TU of one directory, extension and flag set (`shared_dryrun`).
TU_STEM, OBJECT = "__bgraph_tu__", "__bgraph_obj__.o"
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_+-]+(?:\.[A-Za-z0-9_+-]+)*")


def dryrun_action(ctx: RuleContext, name: str, nvcc_args: list[str], object_name: str,
                  toolchain: TargetOutput) -> Action:
    """`nvcc --dryrun` of one compile: it reads no file (the sandbox holds only the toolchain), so
    its output is a function of the toolchain and the arguments alone."""
    return ctx.exec_action(
        f"dryrun {name}", "CudaDryrun",
        ["/bin/sh", "-c", '"$@" 2> dryrun.txt || { cat dryrun.txt >&2; exit 1; }', "nvcc",
         f"{TOOLCHAIN}/bin/nvcc", "--dryrun", *nvcc_args, "-o", object_name],
        inputs={}, outputs=["dryrun.txt"], toolchain=toolchain, memory_mb=128)


def shared_dryrun(nvcc_args: list[str], object_name: str) -> list[str] | None:
    """`nvcc_args` with the source's stem replaced by TU_STEM (its directory and extension kept),
    for a dryrun (object OBJECT) that `for_tu` turns into this TU's; None where a name is not
    plain enough to substitute into nvcc's quoted command lines (that TU runs its own)."""
    if nvcc_args.count("-c") != 1 or nvcc_args[-1] == "-c":
        return None
    i = nvcc_args.index("-c") + 1
    directory, _, base = nvcc_args[i].rpartition("/")
    stem, dot, ext = base.rpartition(".")
    if not (dot and stem and _PLAIN_NAME.fullmatch(base) and _PLAIN_NAME.fullmatch(object_name)
            and object_name.endswith(".o")) or any(TU_STEM in a or OBJECT in a for a in (*nvcc_args, object_name)):
        return None
    return [*nvcc_args[:i], f"{directory}/{TU_STEM}.{ext}" if directory else f"{TU_STEM}.{ext}", *nvcc_args[i + 1:]]


def for_tu(text: str, nvcc_args: list[str], object_name: str) -> str:
    """A shared dryrun's output as the dryrun of this TU (see shared_dryrun)."""
    base = nvcc_args[nvcc_args.index("-c") + 1].rpartition("/")[2]
    return text.replace(OBJECT, object_name).replace(TU_STEM, base.rpartition(".")[0])


def compile_tu(ctx: RuleContext, name: str, nvcc_args: list[str], object_name: str, view: SourceView,
               toolchain: TargetOutput, dryrun: str | None = None):
    """Sub-plan: `nvcc_args` (flags, `-c SRC`; no `-o`, no -M options) compiled to
    `object_name` under /bgraph/out. Returns the object's FileEntry. `dryrun`: this TU's `nvcc
    --dryrun` output, where the caller ran one for several TUs (for_tu); else it runs its own."""
    src = _source(nvcc_args)
    if re.search(r"""[\s"'\\$`]""", src):
        # nvcc --dryrun prints its steps' commands with such names unquoted: they cannot be read back
        raise ctx.fail(f"{name}: the source name {src.rpartition('/')[2]!r} holds a space, quote or shell character, "
                       "which nvcc's step list cannot carry", hint="rename the file (letters, digits, '.', '_', '-', '+')")
    if dryrun is None:  # with placeholder names where it can: TUs of one flag set share its key
        shared = shared_dryrun(nvcc_args, object_name)
        [dry] = yield [dryrun_action(ctx, name, shared or nvcc_args, OBJECT if shared else object_name, toolchain)]
        dryrun = ctx.read(dry.tree.entries["dryrun.txt"]).decode()
        if shared:
            dryrun = for_tu(dryrun, nvcc_args, object_name)
    try:
        symbol = "__bgraph_fatbin_" + ctx.digester.of(f"{ctx.label}:{name}".encode())[:16]
        env, steps = parse_dryrun(dryrun, object_name, symbol)
    except DryrunError as e:
        raise ctx.fail(f"{name}: {e}") from None
    producer = {out: str(i) for i, s in enumerate(steps) for out in s.outputs}
    # A device preprocessing step is named after the arch of the cicc that reads it (121a, 120f):
    # its own -D__CUDA_ARCH__ is one number for 12.0a and 12.0f, and two steps of one name made
    # traces and `bgraph audit` take one for the other (names are not keyed: no key changes).
    shown = {producer[n]: s.arch for s in steps if s.kind == "cicc" for n in s.inputs if n in producer}
    plugin = toolchain.info.get("macro_use")  # the gcc-macro-use plugin in the toolchain's tree, if it has one
    missing = sorted({n for s in steps for n in s.needs() if n not in producer})
    if missing:
        raise ctx.fail(f"{name}: nvcc steps read {missing[0]}, which no step writes; cannot schedule")

    def make(index: str, s):
        def action(done):  # the step's action, from the Outcomes of the steps it reads from
            produced = {n: done[producer[n]].tree.entries[steps[int(producer[n])].output_path(n)]
                        for n in s.needs()}
            files = {i: produced[i] for i in s.inputs}
            files.update({alias: produced[orig] for alias, orig in s.aliases.items()})
            inputs = {"/bgraph/in": Tree(files)}
            argv, outputs = list(s.argv), [s.output_path(n) for n in s.outputs]
            record = ""
            stem = f"{object_name.removesuffix('.o')}.{s.kind}{'.' + s.arch if s.arch else ''}"
            staged = view.staged if s.reads_source else None
            if s.kind == "cudafe":
                # cudafe++ derives the module id from the source file it names (stat of
                # --orig_src_path_name); when it cannot see the file it uses the clock, and the
                # id reaches the host code. It gets that one file, nothing else of the tree: at
                # its mount, or staged into /bgraph/out where the TU is a file of a staged build
                # directory (a generated source: two builds gave two ids before).
                found, staged = _source_file(nvcc_args, view)
                inputs.update(found)
            if s.reads_source:
                inputs.update(view.mounts)
                argv += ["-MD", "-MF", f"{OUT}/{stem}.d"]
                outputs.append(f"{stem}.d")
            if plugin and s.kind in ("hostpp", "devpp", "hostcc"):
                # GCC writes down the -D/-U it used: an added arch re-runs no step that never read the list.
                argv += macro_use.plugin_args(f"{TOOLCHAIN}/{plugin}", f"{OUT}/{stem}.macros")
                outputs.append(f"{stem}.macros")
                record = f"{stem}.macros"
            heavy = s.kind in ("cicc", "ptxas", "hostcc")
            # gcc -E with its full -MD depfile: an edit it skips (another arch's #if group) is a hit.
            # Narrowed only where the step's own arguments cannot hide a read from its depfile.
            narrow = view.narrow if s.reads_source and not steered(s.argv) else ()
            discovery = (Preprocessed(narrow, (f"{stem}.d",), record) if s.reads_source
                         else RecordedMacros(record=record) if record else None)
            return ctx.exec_action(
                f"{s.kind} {name}" + (f" {arch}" if (arch := shown.get(index, s.arch) if s.kind == "devpp" else s.arch)
                                      else ""), STEP_MNEMONIC[s.kind], argv, inputs=inputs,
                outputs=outputs, env=env, toolchain=toolchain, memory_mb=view.memory_mb if heavy else 256,
                cwd=view.cwd if s.reads_source else OUT, staged=staged,
                discovery=discovery)
        return action

    # Each step runs once the steps it reads from are done: ptxas 121a never waits for cicc 120a.
    done = yield Dataflow({str(i): (tuple(dict.fromkeys(producer[n] for n in s.needs())), make(str(i), s))
                           for i, s in enumerate(steps)})
    last = steps[-1]
    return done[str(len(steps) - 1)].tree.entries[last.output_path(last.outputs[0])]


def _source_file(nvcc_args: list[str], view: SourceView) -> tuple[dict[str, Tree], str | None]:
    """The TU's source file alone, at its mount: ({mount: Tree({path: entry})}, the mount where
    the file is seen through the staged build directory at /bgraph/out, else None); ({}, None)
    if unknown."""
    src = _source(nvcc_args)
    for mount, tree in view.mounts.items():
        for root in (mount, OUT) if mount == view.staged else (mount,):
            rel = src[len(root) + 1:] if src.startswith(root + "/") else None
            if rel and rel in tree.entries:
                return {mount: Tree({rel: tree.entries[rel]})}, mount if root == OUT else None
    return {}, None


def _source(nvcc_args: list[str]) -> str:
    """The source `-c` names ("" if none)."""
    return nvcc_args[nvcc_args.index("-c") + 1] if "-c" in nvcc_args[:-1] else ""
