"""ninja_generator: a project's own generator writes Ninja files inside the sandbox; bgraph
imports their edges (ninja_import.py), as cmake_project does with CMake's build.ninja.

Round 1 runs `cmd` once, as a cached action: source tree at /bgraph/src (read-only), the
target's workspace files (srcs, e.g. a driver script) at /bgraph/ws, external trees at
/bgraph/ext/<name>, nvcc at /bgraph/toolchain; it must write /bgraph/out/build.ninja (which
may `subninja` others) and whatever sources it generates, all under /bgraph/out. Fixed paths:
nothing it writes holds a host path or a scratch directory. The same action asks Ninja for
the graph (`-t compdb -x`, `-t query`; see ninja_graph.py). Round 2 plans the edges that the
wanted outputs need: nvcc compiles per (TU, arch) through compile_tu, with early cutoff; other
compiles narrowed by their depfile only where depfile.py proves it complete (PyTorch's and
FlashInfer's `-MMD` rules run as `-MD`: the headers they reach through -isystem count).
The generator itself is keyed on every file it can read (the whole source tree and srcs).

A cross build (another target CPU) runs the generator here, so what it imports comes from
`cross.exec_ext` (built for the exec machine, at /bgraph/exec/<name>); the edges then compile and
link with the build's own systems (the cross compiler, the target's libraries). Without it a
cross build is refused when planned.

Used for FlashInfer's AOT modules (targets/flashinfer.toml): `python -m flashinfer.aot`'s
module enumeration writes one build.ninja per module.
"""

from __future__ import annotations

import fnmatch

from pydantic import Field

from build_graph.model import TargetOutput, Tree
from build_graph.ninja_graph import NinjaGraphError, load_graph
from build_graph.rules.base import (
    OUT,
    SRC,
    ActionEnv,
    Attrs,
    EnvName,
    PlanGen,
    RuleContext,
    labels_in,
)
from build_graph.rules.ninja_import import EdgeSetting, import_edges

NINJA, WS = "/bgraph/ninja", "/bgraph/ws"
META = ".bgraph"  # the generator action's own files inside its output (the graph)

# Runs in the sandbox: $1 = ninja, $2 = the generator's command. Its output is shown only when
# it fails (it may print times); the graph is read with Ninja's own tools.
_GENERATE = r"""set -e
ninja=$1
mkdir -p /bgraph/out
if ! /bin/sh -c "$2" > /tmp/generate.log 2>&1; then
  echo "the generator failed; its output:"; tail -n 60 /tmp/generate.log; exit 1
fi >&2
cd /bgraph/out
[ -f build.ninja ] || { echo "the generator wrote no /bgraph/out/build.ninja" >&2; exit 1; }
mkdir -p .bgraph
"$ninja" -t compdb -x > .bgraph/compdb.json
"$ninja" -t targets all | sed 's/: [^:]*$//' | tr '\n' '\0' | xargs -0 "$ninja" -t query > .bgraph/query.txt
rm -f .ninja_log .ninja_deps
"""


class NinjaGeneratorCrossAttrs(Attrs):
    """What a cross build adds (its target platform is not the exec machine's): the generator runs
    here, so what it imports must be built for this machine."""

    env: ActionEnv = Field(default_factory=dict, description="environment of the generator and the edges, "
                                                                  "over env (e.g. PYTHONPATH=/bgraph/exec/...)")
    ext: dict[str, str] = Field(default_factory=dict, description="name -> label of a target-platform tree "
                                                                  "mounted at /bgraph/ext/<name>")
    exec_ext: dict[str, str] = Field(default_factory=dict,
                                     description="name -> label built for the exec machine, mounted at "
                                                 "/bgraph/exec/<name> (the packages the generator imports)")


class NinjaGeneratorAttrs(Attrs):
    cmd: str = Field(description="shell command writing /bgraph/out/build.ninja; $SRC, $WS, $OUT are set")
    src: str = Field(description="label of the source tree, at /bgraph/src")
    srcs: list[str] = Field(default_factory=list, description="workspace paths or globs, at /bgraph/ws")
    ext: dict[str, str] = Field(default_factory=dict, description="name -> label mounted at /bgraph/ext/<name>")
    env: ActionEnv = Field(default_factory=dict, description="environment of the generator and of the edges")
    archs: str | list[str] | None = Field(None, description="arch set name or list, given to the generator")
    arch_env: EnvName = Field("CUDA_ARCH_LIST", description="environment variable that receives the archs")
    arch_separator: str = Field(" ", description="between the archs in arch_env")
    outputs: list[str] = Field(description="globs of build-directory paths wanted (e.g. cached_ops/*/*.so)")
    strip_prefix: str = Field("", description="leading directory removed from the wanted paths in the output")
    link_rules: list[str] = Field(["*link*", "*LINKER*"], description="globs of the Ninja rules that link")
    toolchain: str = Field("//toolchains:cuda-13.0", description="cuda_toolchain (nvcc, CUDA headers)")
    ninja: str = Field("//toolchains:ninja", description="Ninja tree (ninja or bin/ninja)")
    host: str = Field("//toolchains:host-cc", description="host_tools or deb_packages target: compilers, python3")
    memory_mb: int = Field(1024, ge=1, description="peak memory of one compile step, for the scheduler")
    cross: NinjaGeneratorCrossAttrs = Field(default_factory=NinjaGeneratorCrossAttrs,
                                            description="environment and trees a cross build adds")


def ninja_generator_deps(attrs: NinjaGeneratorAttrs):
    return (labels_in(attrs, "src", "ext", "toolchain", "ninja", "host")
            + [("cross.ext", v) for v in attrs.cross.ext.values()]
            + [("cross.exec_ext", v) for v in attrs.cross.exec_ext.values()])


def ninja_generator_transition(attrs: NinjaGeneratorAttrs, key: str, label: str, config):
    """Ninja runs on the exec machine, whatever the project is built for; `cross` trees exist
    only in a cross build (exec_ext: built for the exec machine)."""
    if key.startswith("cross."):
        return None if not config.cross else config.exec_config() if key == "cross.exec_ext" else config
    return config.exec_config() if key == "ninja" else config


def ninja_generator_sources(attrs: NinjaGeneratorAttrs):
    return [("srcs", p) for p in attrs.srcs]


def _ninja(tree: Tree) -> str:
    for path in ("bin/ninja", "ninja"):
        if path in tree.entries:
            return f"{NINJA}/{path}"
    raise KeyError("ninja")


def plan_ninja_generator(ctx: RuleContext) -> PlanGen:
    a = ctx.attrs
    cross = ctx.platform != ctx.exec_platform
    if cross and not a.cross.exec_ext:
        # The generator runs on this machine: with only the target's trees (FlashInfer's imports
        # torch) it would run the target platform's packages here, and fail inside the action or worse.
        raise ctx.fail(f"a ninja_generator without cross.exec_ext cannot build for {ctx.platform} on "
                       f"{ctx.exec_platform}: its generator would run the target platform's packages here",
                       "cross", hint="give cross.exec_ext (what the generator imports, built for this machine) "
                                     f"and cross.env, or build for this machine (--platform {ctx.exec_platform})")
    source = ctx.dep(a.src, "src").tree
    toolchain, host = ctx.dep(a.toolchain, "toolchain"), ctx.dep(a.host, "host")
    ninja_tree = ctx.dep(a.ninja, "ninja").tree
    try:
        ninja = _ninja(ninja_tree)
    except KeyError:
        raise ctx.fail("no ninja binary in the ninja tree", "ninja") from None
    ext = {f"/bgraph/ext/{name}": ctx.dep(label, "ext").tree for name, label in a.ext.items()}
    if cross:
        ext.update({f"/bgraph/ext/{name}": ctx.dep(label, "cross.ext").tree for name, label in a.cross.ext.items()})
        ext.update({f"/bgraph/exec/{name}": ctx.dep(label, "cross.exec_ext").tree
                    for name, label in a.cross.exec_ext.items()})
    env = {"PATH": f"{NINJA}/bin:{NINJA}:/bgraph/toolchain/bin:/usr/bin:/bin", "SRC": SRC, "WS": WS, "OUT": OUT,
           "PYTHONDONTWRITEBYTECODE": "1", **a.env, **(a.cross.env if cross else {})}
    if a.archs is not None:
        env[a.arch_env] = a.arch_separator.join(ctx.arch_sets(a.archs, ctx.where("archs")))

    # Round 1: the generator, and Ninja's view of what it wrote.
    [generated] = yield [ctx.exec_action(
        "generate", "NinjaGenerate", ["/bin/sh", "-c", _GENERATE, "generate", ninja, a.cmd],
        inputs={SRC: source, WS: ctx.sources, NINJA: ninja_tree, **ext}, outputs=["."], env=env,
        toolchain=toolchain, host=host, memory_mb=2048)]
    out = generated.tree
    try:
        graph = load_graph(ctx.read(out.entries[f"{META}/compdb.json"]).decode(),
                           ctx.read(out.entries[f"{META}/query.txt"]).decode(), OUT)
    except NinjaGraphError as e:
        raise ctx.fail(f"Ninja graph: {e}", "cmd") from None
    wanted = []
    for pattern in a.outputs:
        matched = sorted(p for p in graph.producer if fnmatch.fnmatchcase(p, pattern))
        if not matched:
            raise ctx.fail(f"no build edge produces a path matching {pattern!r} "
                           f"({len(graph.producer)} outputs in the graph)", "outputs")
        wanted += [p for p in matched if p not in wanted]
    try:
        edges = graph.needed(wanted)
    except NinjaGraphError as e:
        raise ctx.fail(f"Ninja graph: {e}", "outputs") from None
    build_tree = Tree({p: e for p, e in out.entries.items() if not p.startswith(f"{META}/")})

    # Round 2: every edge the wanted outputs need (ninja_import.py).
    setting = EdgeSetting({SRC: source, **ext}, env, toolchain, host, a.memory_mb,
                          link_rules=tuple(a.link_rules), mnemonic="Ninja")
    built = yield from import_edges(ctx, graph, edges, build_tree, setting)
    prefix = a.strip_prefix.strip("/") + "/" if a.strip_prefix.strip("/") else ""
    result = {}
    for p in wanted:
        if not p.startswith(prefix):
            raise ctx.fail(f"output {p} is not under strip_prefix {a.strip_prefix!r}", "strip_prefix")
        result[p[len(prefix):]] = built[p]
    return TargetOutput(Tree(result), {"outputs": sorted(result), "generate": generated.action.key(ctx.digester)})
