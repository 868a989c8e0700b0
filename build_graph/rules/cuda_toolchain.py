"""cuda_toolchain: nvcc assembled from pinned NVIDIA wheels into a tree that works in the sandbox."""

from __future__ import annotations

import re

from pydantic import Field

from build_graph import macro_use
from build_graph.rules.base import TOOLCHAIN, Attrs, PlanGen, RuleContext, labels_in
from build_graph.model import FileEntry, SymlinkEntry, TargetOutput, Tree



def _is_tool(path: str) -> bool:
    """Programs directly under bin/ or nvvm/bin/ (not nvcc.profile, not the crt link stubs)."""
    for d in ("bin/", "nvvm/bin/"):
        rest = path[len(d):] if path.startswith(d) else None
        if rest and "/" not in rest and not rest.endswith(".profile"):
            return True
    return False


class CudaToolchainAttrs(Attrs):
    version: str = Field(description="the nvcc release the wheels must add up to, e.g. 13.0.88")
    wheels: list[str] = Field(description="pin names: nvidia-cuda-nvcc, -nvvm, -crt, -cccl, -runtime wheels")
    strip_prefix: str = Field("nvidia/cu13", description="directory inside the wheels that becomes the root")
    host: str = Field("//toolchains:host-cc", description="host_tools target giving the host compiler")
    libraries: str | None = Field(None, description="python_env whose NVIDIA wheels add headers and libraries "
                                                    "(e.g. torch's CUDA wheels), under libraries_prefix")
    libraries_prefix: str = Field("nvidia/cu13", description="directory of those wheels holding include/ and lib/")
    driver_stub: bool = Field(False, description="add lib/stubs/libcuda.so, a link stub for the CUDA driver "
                                                 "(no PyPI wheel ships it; the real driver is loaded at run time)")
    overlay: str | None = Field(None, description="label of a tree laid over the assembled toolkit, its files "
                                                  "replacing the wheels' (e.g. a patched CCCL: //toolchains:cccl-patched)")
    macro_use: str | None = Field(None, description="label of a tree holding gcc_macro_use.so, the GCC plugin "
                                                    "built for `host`'s compiler (//toolchains:gcc-macro-use): "
                                                    "steps then record the -D/-U they used (not in a cross build)")


def cuda_toolchain_deps(attrs: CudaToolchainAttrs):
    return labels_in(attrs, "host", "libraries", "overlay", "macro_use")


def cuda_toolchain_transition(attrs: CudaToolchainAttrs, key: str, label: str, config):
    """The macro plugin is loaded by `host`'s GCC; a cross build's host compiler is another one
    (the cross stand-in), for which no plugin is built: that edge is not followed there."""
    return None if key == "macro_use" and config.cross else config


def _wheel_trees(ctx: RuleContext, pins: list[str], platform: str) -> PlanGen:
    """Sub-plan: each wheel's files for `platform`."""
    fetched = yield [ctx.fetch_action(pin, "wheels", platform) for pin in pins]
    unpacked = yield [ctx.extract_action(f.tree, f.action.outputs[0], ctx.attrs.strip_prefix) for f in fetched]
    return [u.tree for u in unpacked]


def _merged(ctx: RuleContext, trees: list[Tree]) -> Tree:
    try:
        return trees[0].merged(*trees[1:]) if trees else Tree()
    except ValueError as e:
        raise ctx.fail(f"wheels overlap: {e}", "wheels") from None


def plan_cuda_toolchain(ctx: RuleContext) -> PlanGen:
    """Fetch and unpack each wheel, merge them under one root, then run nvcc --version in the sandbox.

    For another target platform than the exec machine's (a cross toolkit): the programs
    (bin/, nvvm/) and headers are the exec platform's wheels, lib/ holds the target platform's
    libraries (the same wheels' lib/ for the target: cudart, libnvvm), and
    targets/<platform>-linux/{include,lib} point at them: nvcc with an aarch64 host compiler
    looks there, as does CMake's CUDA detection when cross-compiling."""
    wheels = yield from _wheel_trees(ctx, ctx.attrs.wheels, ctx.exec_platform)
    tree = _merged(ctx, wheels)
    if "bin/nvcc" not in tree.entries:
        raise ctx.fail(f"no bin/nvcc under {ctx.attrs.strip_prefix!r} in the wheels", "wheels")
    # Some wheels lose exec bits; the tools under bin/ must run.
    tree = tree.with_executable(_is_tool)
    if ctx.platform != ctx.exec_platform:
        with_libs = [pin for pin, t in zip(ctx.attrs.wheels, wheels) if t.subtree("lib").entries]
        target_libs = _merged(ctx, (yield from _wheel_trees(ctx, with_libs, ctx.platform))).select(["lib"])
        tree = cross_prefix(tree, target_libs, ctx.platform)
    if ctx.attrs.libraries:
        # One toolkit prefix, as CMake's (and torch's FindCUDA's) lookups expect; the
        # toolchain's own files win where both have a path.
        extra = ctx.dep(ctx.attrs.libraries, "libraries").tree.subtree(ctx.attrs.libraries_prefix)
        tree = extra.select(["include", "lib"]).overlaid(tree)
    if ctx.attrs.overlay:
        tree = tree.overlaid(ctx.dep(ctx.attrs.overlay, "overlay").tree)
    tree = tree.merged(toolkit_links(tree))
    host = ctx.dep(ctx.attrs.host, "host")
    probe_cmd = f"{TOOLCHAIN}/bin/nvcc --version > version.txt"
    macro_info = {}
    if ctx.attrs.macro_use and ctx.platform == ctx.exec_platform:
        plugin = ctx.dep(ctx.attrs.macro_use, "macro_use").tree.entries.get("gcc_macro_use.so")
        if not isinstance(plugin, FileEntry):
            raise ctx.fail(f"{ctx.attrs.macro_use} has no gcc_macro_use.so", "macro_use")
        tree = tree.merged(Tree({macro_use.PLUGIN: plugin}))
        macro_info = {"macro_use": macro_use.PLUGIN}
        # Loaded once here, so a plugin built for another GCC fails the toolchain, not each compile.
        probe_cmd += (" && gcc -E -x c /dev/null -o /dev/null " +
                      " ".join(macro_use.plugin_args(f"{TOOLCHAIN}/{macro_use.PLUGIN}", "/dev/null")))
    toolchain = TargetOutput(tree, {"host": host.info})
    [probe] = yield [ctx.exec_action(
        "nvcc --version", "ToolchainVersion", ["/bin/sh", "-c", probe_cmd],
        inputs={}, outputs=["version.txt"], toolchain=toolchain, host=host)]
    text = ctx.read(probe.tree.entries["version.txt"]).decode(errors="replace")
    m = re.search(r"release [\d.]+, V([\d.]+)", text)
    found = m.group(1) if m else "unknown"
    if found != ctx.attrs.version:
        raise ctx.fail(f"the wheels give nvcc {found}, not {ctx.attrs.version}", "version")
    if ctx.attrs.driver_stub:
        [stub] = yield [ctx.exec_action(
            "libcuda.so link stub", "CudaDriverStub",
            ["/usr/bin/gcc", "-shared", "-nostdlib", "-Wl,-soname,libcuda.so.1", "-Wl,--build-id=none",
             "-x", "c", "/dev/null", "-o", "lib/stubs/libcuda.so"],
            inputs={}, outputs=["lib/stubs/libcuda.so"], host=host)]
        tree = tree.overlaid(stub.tree)
    return TargetOutput(tree.merged(probe.tree.prefixed("bgraph")),
                        {"version": found, "host": host.info, "nvcc": "bin/nvcc", **macro_info})


def cross_prefix(tools: Tree, target_libs: Tree, platform: str) -> Tree:
    """The exec platform's toolkit with lib/ replaced by the target platform's, and the
    targets/<platform>-linux directory nvcc and CMake look for when cross-compiling. (Named
    aarch64-linux, not sbsa-linux: CMake 3.31 only looks for the former.)"""
    kept = Tree.from_checked({p: e for p, e in tools.entries.items() if not (p == "lib" or p.startswith("lib/"))})
    links = {f"targets/{platform}-linux/include": SymlinkEntry("../../include"),
             f"targets/{platform}-linux/lib": SymlinkEntry("../../lib")}
    return kept.merged(target_libs, Tree(links))


def toolkit_links(tree: Tree) -> Tree:
    """What CMake's CUDA lookup expects of a toolkit prefix and the wheels lack: `lib64 -> lib`
    (nvcc's profile links from lib64) and an unversioned name for every `lib/libX.so.N`."""
    links: dict[str, SymlinkEntry] = {}
    if "lib64" not in tree.entries:
        links["lib64"] = SymlinkEntry("lib")
    for path in tree.entries:
        m = re.fullmatch(r"lib/(lib[^/]+\.so)\.\d+", path)
        if m and f"lib/{m.group(1)}" not in tree.entries:
            links[f"lib/{m.group(1)}"] = SymlinkEntry(path.rpartition("/")[2])
    return Tree(links)


ARCH = re.compile(r"(\d+)\.(\d+)([af]?)")  # how an arch is written: major.minor, then a (specific) or f (family)


def gencode_flags(archs: list[str]) -> list[str]:
    """The toolchain spells archs as nvcc flags: '12.1a' -> -gencode arch=compute_121a,code=sm_121a."""
    flags = []
    for arch in archs:
        m = ARCH.fullmatch(arch)
        if not m:
            raise ValueError(f"bad arch {arch!r}")
        cc = f"{m.group(1)}{m.group(2)}{m.group(3)}"
        flags += ["-gencode", f"arch=compute_{cc},code=sm_{cc}"]
    return flags
