"""cmake_project: a CMake/Ninja project imported as bgraph actions.

Round 1 runs the project's own configure once, in the sandbox, as a cached action (no
network): source at /bgraph/src (a writable copy: configures may generate sources into it),
build directory /bgraph/out, toolchains at fixed paths, so nothing it writes holds a host
path. The same action asks Ninja for its graph (see ninja_graph.py). Round 2 plans every
edge the wanted outputs need as actions (ninja_import.py: nvcc compiles per TU and arch
through `nvcc_compile.compile_tu`, other compiles narrowed by their depfile where it is proven
complete, depfile.py).

The configure is keyed on its whole source tree, never narrowed (ARCHITECTURE.md invariant 7).
CMake's own list of what it read (the inputs of build.ninja's re-run edge) leaves out what
`file(GLOB)` without CONFIGURE_DEPENDS matched (a file added or removed there), and every file
`file(READ)`, `file(STRINGS)` or a program run by `execute_process` read: a configure
narrowed to that list served a stale graph. So an edit anywhere in the tree re-runs it; when
its outputs come out byte-identical (the build directory, Ninja's view of the graph, the
sources it generated), no edge's key changes through it (early cutoff): compiles, archives and
links are hits, and an edit to an unrelated file costs one configure, not a rebuild (custom
commands, keyed on the whole source tree themselves, run again and are cut off in turn). Only
a sandbox that records the configure's actual reads could narrow it soundly (not built).

What the configure did to its writable source copy is told by content (each file or link it
wrote, changed or made; each it removed), never by time: a copy keeping an old time (cp -p, tar)
was lost, and so was a removal (red team R7). Every input has one time in the sandbox, so CMake's
own file(COPY) onto an existing source does nothing (it skips a destination of the same time).

The CMake file API is not queried: its replies list a target's dependencies in an order that
varies from run to run (the configure would not be reproducible), and Ninja's tools already
give every edge with its command.
"""

from __future__ import annotations

from pydantic import Field

from build_graph.model import FileEntry, TargetOutput, Tree
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
from build_graph.rules.ninja_import import NVCC, EdgeSetting, import_edges

CMAKE, NINJA, ORIG = "/bgraph/cmake", "/bgraph/ninja", "/bgraph/in/src"
META = ".bgraph"  # the configure's own files inside its output (graph, log, generated sources)

# Runs in the sandbox. $1 = cmake, $2 = ninja; the rest are cmake's arguments. The configure
# log is kept; on failure CMake's own error text goes to stderr, and a download or clone the
# configure tried (there is no network) is named. The source copy is made writable (a configure
# may write into it; the store's modes are read-only, and an action holds no capability).
_CONFIGURE = r"""set -e
cmake=$1; ninja=$2; shift 2
mkdir -p /bgraph/src /bgraph/out/.bgraph
cp -a /bgraph/in/src/. /bgraph/src/
chmod -R u+w /bgraph/src
log=/bgraph/out/.bgraph/configure.log
if ! "$cmake" -G Ninja -S /bgraph/src -B /bgraph/out "-DCMAKE_MAKE_PROGRAM=$ninja" "$@" > "$log" 2>&1; then
  url=$(grep -oE "(https?|git|ssh)://[^ '\";)]+" "$log" | head -n 1)
  if [ -z "$url" ] && grep -qiE "resolve|clone|download|connect" "$log"; then
    # CMake's error need not name the address: a traced re-run shows the command that asked for it.
    "$cmake" -G Ninja -S /bgraph/src -B /tmp/retrace "-DCMAKE_MAKE_PROGRAM=$ninja" "$@" --trace-expand \
      --trace-redirect=/tmp/trace.txt > /dev/null 2>&1 || true
    url=$(grep -iE "download|git_repository|url" /tmp/trace.txt 2>/dev/null | grep -oE "(https?|git|ssh)://[^ '\";)]+" | tail -n 1)
  fi
  if [ -n "$url" ]; then
    echo "bgraph: the configure tried to download $url, and actions have no network:"
    echo "  give it as a pinned input (a *_SRC_DIR cache variable pointing into an ext tree)"
  fi
  echo "cmake configure failed; CMake's output:"
  grep -v '^--' "$log" | tail -n 60
  exit 1
fi >&2
# Keep the outputs reproducible: the configure log's timestamps and durations go.
rm -f /bgraph/out/CMakeFiles/CMakeConfigureLog.yaml
sed -i -E 's/ \([0-9.]+s\)$//' "$log"
cd /bgraph/out
"$ninja" -t compdb -x > .bgraph/compdb.json
"$ninja" -t targets all | sed 's/: [^:]*$//' | tr '\n' '\0' | xargs -0 "$ninja" -t query > .bgraph/query.txt
# What the configure did to the source tree, told by content, never by time (file(COPY), cp -p
# and tar keep an old one: red team R7): each file or link it wrote, changed (bytes, link text,
# executable bit) or made goes to .bgraph/generated; each it removed is listed, NUL-separated,
# in .bgraph/removed.
cd /bgraph/src
find . \( -type f -o -type l \) -exec sh -c 'for f; do
  o="/bgraph/in/src/$f"
  if [ -L "$f" ]; then
    [ -L "$o" ] && [ "$(readlink -- "$f")" = "$(readlink -- "$o")" ] && continue
  elif [ -f "$o" ] && [ ! -L "$o" ] && { [ -x "$f" ] && [ -x "$o" ] || { [ ! -x "$f" ] && [ ! -x "$o" ]; }; } \
       && cmp -s -- "$f" "$o"; then
    continue
  fi
  mkdir -p "/bgraph/out/.bgraph/generated/${f%/*}"; cp -a -- "$f" "/bgraph/out/.bgraph/generated/$f"
done' sh {} +
find . -type d -empty -exec sh -c 'for d; do
  [ -d "/bgraph/in/src/$d" ] && [ ! -L "/bgraph/in/src/$d" ] || mkdir -p "/bgraph/out/.bgraph/generated/$d"
done' sh {} +
# Removed: every file or link of the original that is no file or link at its path now (a file made a
# directory, a directory made a link: `find` follows no link, so what lies below one is gone too).
(cd /bgraph/in/src && find . \( -type f -o -type l \) -print0 | LC_ALL=C sort -z) > /tmp/orig.list
(cd /bgraph/src && find . \( -type f -o -type l \) -print0 | LC_ALL=C sort -z) > /tmp/now.list
LC_ALL=C comm -z -23 /tmp/orig.list /tmp/now.list > /bgraph/out/.bgraph/removed
"""


class CmakeCrossAttrs(Attrs):
    """What a cross build of the project adds (its target platform is not the exec machine's)."""

    cache: dict[str, str] = Field(default_factory=dict, description="more cache variables (e.g. Torch_DIR)")
    env: ActionEnv = Field(default_factory=dict, description="environment of the configure, over env")
    ext: dict[str, str] = Field(default_factory=dict, description="name -> label of a target-platform tree "
                                                                  "mounted at /bgraph/ext/<name>")
    exec_ext: dict[str, str] = Field(default_factory=dict,
                                     description="name -> label built for the exec machine, mounted at "
                                                 "/bgraph/exec/<name> (e.g. the Python environment the "
                                                 "configure imports: it runs here)")


class CmakeProjectAttrs(Attrs):
    src: str | None = Field(None, description="label of the source tree (e.g. a patched_tree); or give srcs")
    srcs: list[str] = Field(default_factory=list, description="workspace paths or globs forming the source tree")
    strip_prefix: str = Field("", description="with srcs: the directory that becomes the source root")
    cache: dict[str, str] = Field(default_factory=dict, description="CMake cache variables (-DNAME=VALUE)")
    archs: str | list[str] | None = Field(None, description="arch set name or list, e.g. ['12.0a', '12.1a']")
    arch_variable: str = Field("CMAKE_CUDA_ARCHITECTURES",
                               description="cache variable that receives the archs (CMake spells 12.1a as 121a; "
                                           "any other variable gets them as written, ';'-separated)")
    arch_env: EnvName | None = Field(None, description="environment variable that receives the archs instead, as "
                                                   "written and ';'-separated (e.g. TORCH_CUDA_ARCH_LIST)")
    build_type: str = Field("Release", description="CMAKE_BUILD_TYPE")
    outputs: list[str] = Field(description="build-directory paths wanted (libraries, executables)")
    ext: dict[str, str] = Field(default_factory=dict, description="name -> label mounted at /bgraph/ext/<name>")
    env: ActionEnv = Field(default_factory=dict, description="environment of the configure")
    toolchain: str = Field("//toolchains:cuda-13.0", description="cuda_toolchain (nvcc, CUDA headers)")
    cmake: str = Field("//toolchains:cmake", description="CMake tree (bin/cmake)")
    ninja: str = Field("//toolchains:ninja", description="Ninja tree (ninja or bin/ninja)")
    host: str = Field("//toolchains:host-cc", description="host_tools target: compilers and shell")
    memory_mb: int = Field(1024, ge=1, description="peak memory of one compile step, for the scheduler")
    cross: CmakeCrossAttrs = Field(default_factory=CmakeCrossAttrs,
                                   description="cache variables, environment and trees a cross build adds")


def cmake_project_deps(attrs: CmakeProjectAttrs):
    return (labels_in(attrs, "src", "ext", "toolchain", "cmake", "ninja", "host")
            + [("cross.ext", v) for v in attrs.cross.ext.values()]
            + [("cross.exec_ext", v) for v in attrs.cross.exec_ext.values()])


def cmake_project_transition(attrs: CmakeProjectAttrs, key: str, label: str, config):
    """CMake and Ninja run on the exec machine, whatever the project is built for; `cross` trees
    exist only in a cross build (exec_ext: built for the exec machine)."""
    if key.startswith("cross."):
        return None if not config.cross else config.exec_config() if key == "cross.exec_ext" else config
    return config.exec_config() if key in ("cmake", "ninja") else config


def cmake_project_sources(attrs: CmakeProjectAttrs):
    return [("srcs", p) for p in attrs.srcs]


def _arch_value(archs: list[str], variable: str) -> str:
    if variable == "CMAKE_CUDA_ARCHITECTURES":
        return ";".join(a.replace(".", "") for a in archs)
    return ";".join(archs)


def _tool(tree: Tree, mount: str, name: str) -> str:
    for path in (f"bin/{name}", name):
        if path in tree.entries:
            return f"{mount}/{path}"
    raise KeyError(name)


def plan_cmake_project(ctx: RuleContext) -> PlanGen:
    a = ctx.attrs
    if (a.src is None) == (not a.srcs):
        raise ctx.fail("give either src (a label) or srcs (workspace paths)", "src")
    source = ctx.dep(a.src, "src").tree if a.src else ctx.sources.subtree(a.strip_prefix)
    toolchain = ctx.dep(a.toolchain, "toolchain")
    host = ctx.dep(a.host, "host")
    cmake_tree, ninja_tree = ctx.dep(a.cmake, "cmake").tree, ctx.dep(a.ninja, "ninja").tree
    try:
        cmake, ninja = _tool(cmake_tree, CMAKE, "cmake"), _tool(ninja_tree, NINJA, "ninja")
    except KeyError as e:
        raise ctx.fail(f"no {e.args[0]} binary in the {e.args[0]} tree", e.args[0]) from None
    ext = {f"/bgraph/ext/{name}": ctx.dep(label, "ext").tree for name, label in a.ext.items()}
    cache = {"CMAKE_BUILD_TYPE": a.build_type, "CMAKE_C_COMPILER": "/usr/bin/gcc",
             "CMAKE_CXX_COMPILER": "/usr/bin/g++", "CMAKE_CUDA_COMPILER": NVCC,
             "CMAKE_CUDA_HOST_COMPILER": "/usr/bin/g++", "CUDAToolkit_ROOT": "/bgraph/toolchain",
             "CUDA_TOOLKIT_ROOT_DIR": "/bgraph/toolchain"}
    if ctx.platform != ctx.exec_platform:
        # A cross build: the host system's gcc is the target's cross compiler (deb_packages
        # `cross`); CMake must know it is cross-compiling (no try_run; CUDA looks for
        # targets/<platform>-linux in the toolkit) and for which processor.
        cache.update({"CMAKE_SYSTEM_NAME": "Linux", "CMAKE_SYSTEM_PROCESSOR": ctx.platform})
    cache.update(a.cache)
    cross = ctx.platform != ctx.exec_platform
    if cross:
        cache.update(a.cross.cache)
        ext.update({f"/bgraph/ext/{name}": ctx.dep(label, "cross.ext").tree for name, label in a.cross.ext.items()})
        ext.update({f"/bgraph/exec/{name}": ctx.dep(label, "cross.exec_ext").tree
                    for name, label in a.cross.exec_ext.items()})
    env = {"PATH": f"{CMAKE}/bin:{NINJA}/bin:{NINJA}:/bgraph/toolchain/bin:/usr/bin:/bin", **a.env,
           **(a.cross.env if cross else {})}
    if a.archs is not None:
        archs = ctx.arch_sets(a.archs, ctx.where("archs"))
        if a.arch_env:
            env[a.arch_env] = ";".join(archs)
        else:
            cache[a.arch_variable] = _arch_value(archs, a.arch_variable)

    # Round 1: configure, and Ninja's view of the graph.
    [configured] = yield [ctx.exec_action(
        "configure", "CmakeConfigure",
        ["/bin/sh", "-c", _CONFIGURE, "configure", cmake, ninja, *(f"-D{k}={v}" for k, v in sorted(cache.items()))],
        inputs={ORIG: source, CMAKE: cmake_tree, NINJA: ninja_tree, **ext}, outputs=["."], env=env,
        toolchain=toolchain, host=host, memory_mb=2048)]  # keyed on the whole tree (see the docstring)
    out = configured.tree
    try:
        graph = load_graph(ctx.read(out.entries[f"{META}/compdb.json"]).decode(),
                           ctx.read(out.entries[f"{META}/query.txt"]).decode(), OUT)
        edges = graph.needed(a.outputs)
    except NinjaGraphError as e:
        raise ctx.fail(f"Ninja graph: {e}", "outputs") from None
    removed = out.entries.get(f"{META}/removed")
    gone = {p.removeprefix("./") for p in ctx.read(removed).decode(errors="surrogateescape").split("\0") if p} \
        if removed is not None else set()
    generated = out.subtree(f"{META}/generated")
    # What the configure made a directory or a link now holds nothing of the original below it.
    replaced = tuple(p + "/" for p, e in generated.entries.items() if not isinstance(e, FileEntry))
    src_tree = Tree({p: e for p, e in source.entries.items()
                     if p not in gone and not p.startswith(replaced)}).overlaid(generated)
    build_tree = Tree({p: e for p, e in out.entries.items() if not p.startswith(f"{META}/")})

    # Round 2: every edge the wanted outputs need (ninja_import.py).
    setting = EdgeSetting({SRC: src_tree, CMAKE: cmake_tree, NINJA: ninja_tree, **ext}, env, toolchain, host,
                          a.memory_mb, link_rules=("*LINKER*",), mnemonic="Cmake")
    built = yield from import_edges(ctx, graph, edges, build_tree, setting)
    wanted = {}
    for w in a.outputs:
        for f in graph.resolve(w):
            wanted[f] = built[f]
    return TargetOutput(Tree(wanted), {"outputs": sorted(wanted), "configure": configured.action.key(ctx.digester)})

