"""The native Spark build of one FP4 TU, run on this x86_64 machine under qemu-aarch64-static.

bgraph plans a native aarch64 build (exec platform aarch64: the aarch64 nvcc wheels, Debian's
arm64 GCC) with the real keys a Spark would compute; its fetches and unpacks run here as they
are. What executes aarch64 code (every exec action) runs in the ordinary bubblewrap sandbox
with the same mounts, under the pinned qemu-aarch64-static (//toolchains:qemu-user) mounted at
/bgraph/qemu. There is no binfmt_misc here, so a child an emulated program starts would run
natively and fail: each program is started through qemu explicitly (gcc with `-wrapper`, a
static x86_64 shim that starts cc1plus and as through qemu; the shell of a script step defines
its external tools as functions that call them through qemu; nvcc's own gcc is the shim too). The results are filed under the native keys in the
cache this helper is given (never the user's): a second run is all hits.

The helper knows the steps a cuda_library TU plans (rules/nvcc_compile.py) and the toolchain's
`nvcc --version` probe; any other script is refused (EmulationError), not guessed at.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import re
import struct
import subprocess
import sys
import time
from fractions import Fraction
from pathlib import Path

from bgraph_testlib import REPO, hermetic_env, workspace_copy
from build_graph.model import Tree

QEMU_MOUNT = "/bgraph/qemu"
QEMU = f"{QEMU_MOUNT}/usr/bin/qemu-aarch64-static"
SHIM_MOUNT = "/bgraph/qemu-shim"
WRAP = f"{SHIM_MOUNT}/qemu-wrap"  # gcc's -wrapper: starts cc1plus, as (found along PATH) through qemu
GCC_NAMES = ("gcc", "g++", "cc", "c++")
# The external commands bgraph's step scripts call (rules/nvcc_compile.py, nvcc.py, cuda_toolchain.py).
SCRIPT_TOOLS = ("mkdir", "cat", "sed", "grep")
# The test target: the FP4 conversion TU of //kernels:fp4 on its own (one TU, both Spark archs, the same copts).
TARGETS_TOML = """package = "//native"

# kernels/fp4/convert.cu alone, as //kernels:fp4 compiles it: built --platform aarch64 here
# (the cross build) and natively for an aarch64 host under qemu (tests/native_aarch64.py).
[fp4-convert]
kind = "cuda_library"
srcs = ["kernels/fp4/convert.cu"]
hdrs = ["kernels/fp4/*.cuh", "kernels/fp4/*.h"]
archs = "spark"
copts = ["-std=c++17", "-O2", "-lineinfo"]

# nvcc runs the host compiler itself (its probe of the compiler's macros, even under --dryrun):
# for the dryrun step, /bgraph/toolchain/bin/gcc (first on the step's PATH, which nvcc copies into
# its output, so PATH stays as it is) is this static x86_64 program, which starts /usr/bin/gcc
# through qemu; it is gcc's -wrapper too. Built by the pinned x86_64 GCC (//toolchains:host-cc).
[qemu-shim]
kind = "genrule"
srcs = ["native/qemu_shim.c"]
outs = ["qemu-shim"]
tools = "//toolchains:host-cc"
cmd = "gcc -static -O2 -o $OUT/qemu-shim $SRC/native/qemu_shim.c"
"""
SHIM_C = r"""/* Named NAME: starts qemu-aarch64-static /usr/bin/NAME -wrapper WRAP ARGS (nvcc's gcc).
   Named qemu-wrap (gcc's -wrapper): starts qemu-aarch64-static PROGRAM ARGS, a bare PROGRAM
   (gcc finds `as` along PATH) taken from /usr/bin. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int main(int argc, char **argv) {
    static const char qemu[] = "%s", wrap[] = "%s";
    const char *base = strrchr(argv[0], '/');
    char prog[512];
    char **args = calloc(argc + 4, sizeof *args);
    int n = 0, first = 1;
    base = base ? base + 1 : argv[0];
    args[n++] = (char *)qemu;
    if (strcmp(base, "qemu-wrap") == 0) {
        if (argc < 2)
            return 127;
        snprintf(prog, sizeof prog, strchr(argv[1], '/') ? "%%s" : "/usr/bin/%%s", argv[1]);
        args[n++] = prog;
        first = 2;
    } else {
        snprintf(prog, sizeof prog, "/usr/bin/%%s", base);
        args[n++] = prog;
        args[n++] = "-wrapper";
        args[n++] = (char *)wrap;
    }
    for (int i = first; i < argc; i++)
        args[n++] = argv[i];
    execv(qemu, args);
    perror(qemu);
    return 127;
}
""" % (QEMU, WRAP)
LABEL = "//native:fp4-convert"
TU = "kernels/fp4/convert.cu"


class EmulationError(Exception):
    pass


def _resolve(program: str, action) -> str:
    """A program named bare, looked up along the action's PATH in its input mounts (qemu takes
    a path, it does not search PATH)."""
    if "/" in program:
        return program
    env = dict(action.env)
    for d in env.get("PATH", "/usr/bin:/bin").split(":"):
        d = "/usr/bin" if d == "/bin" else os.path.normpath(d)  # /bin is the merged /usr's link
        for mount, tree in action.inputs:
            if d == mount or d.startswith(mount + "/"):
                rel = f"{d[len(mount) + 1:]}/{program}".lstrip("/")
                if rel in tree.entries:
                    return f"{d}/{program}"
    raise EmulationError(f"{action.name}: {program} not found along PATH in the action's mounts")


def _program(argv: list[str], action) -> list[str]:
    """argv with its program started through qemu (gcc also starting its own tools through it)."""
    prog = _resolve(argv[0], action)
    extra = ["-wrapper", WRAP] if os.path.basename(prog) in GCC_NAMES else []
    return [QEMU, prog, *extra, *argv[1:]]


def _script(script: str) -> str:
    """A step script for an emulated /bin/sh: its external tools go through qemu."""
    prelude = "".join(f'{t}() {{ {QEMU} /usr/bin/{t} "$@"; }}\n' for t in SCRIPT_TOOLS)
    script = script.replace("exec /usr/bin/gcc ", f"exec {QEMU} /usr/bin/gcc -wrapper {WRAP} ")
    script = re.sub(r"(?<![\w/])(/bgraph/toolchain/bin/nvcc) --version", rf"{QEMU} \1 --version", script)
    return prelude + script


def emulated(action, qemu_tree, shim):
    """The action as it runs here: the same mounts plus qemu at /bgraph/qemu, its programs
    started through qemu. (The engine files the result under the original action's key.)"""
    argv = list(action.argv)
    if argv[:2] == ["/bin/sh", "-c"]:
        script, rest = argv[2], argv[3:]
        known = any(m in script for m in ('exec "$@"', '"$@" 2> dryrun.txt', "exec /usr/bin/gcc ",
                                          "/bgraph/toolchain/bin/nvcc --version"))
        if not known:
            raise EmulationError(f"{action.name}: a script this helper does not know how to emulate")
        # "$@" (the step's own program, after the script's own parameters) starts through qemu.
        at = next((i for i, a in enumerate(rest[1:], 1)
                   if a in GCC_NAMES or a.startswith(("/usr/bin/", "/bgraph/toolchain/"))), None)
        if at is not None:
            rest = rest[:at] + _program(rest[at:], action)
        argv = [QEMU, "/bin/sh", "-c", _script(script), *rest]
    else:
        argv = _program(argv, action)
    inputs = list(action.inputs)
    if action.mnemonic == "CudaDryrun":
        inputs = [(m, t.overlaid(Tree({"bin/gcc": shim})) if m == "/bgraph/toolchain" else t) for m, t in inputs]
    mounts = ((QEMU_MOUNT, qemu_tree), (SHIM_MOUNT, Tree({"qemu-wrap": shim})))
    return dataclasses.replace(action, argv=tuple(argv), inputs=(*inputs, *mounts))


def emulating_engine(ws_root: Path, cache: Path, qemu_tree, shim, jobs: int = 1):
    """An Engine that plans as on an aarch64 host and runs its exec actions under qemu here."""
    from build_graph.engine import BuildOptions, Engine
    from build_graph.sandbox import BwrapRunner
    from build_graph.workspace import load

    class QemuRunner(BwrapRunner):
        def run(self, action, stamps=None):
            return super().run(emulated(action, qemu_tree, shim), stamps)

    class EmulatingEngine(Engine):
        @property
        def sandbox(self):
            if self._sandbox is None:
                self._sandbox = QemuRunner(self.cas)
            return self._sandbox

    options = BuildOptions(jobs=jobs, max_mem_mb=8192, exec_platform="aarch64")
    return EmulatingEngine(load(ws_root), cache, options)


def bgraph(ws: Path, cache: Path, *args: str, timeout: int = 3600) -> dict:
    """`bgraph --json build ARGS` in `ws` (the real CLI); the summary."""
    run = subprocess.run([sys.executable, "-m", "build_graph", "-C", str(ws), "--cache-dir", str(cache),
                          "build", "--json", *args], capture_output=True, text=True, timeout=timeout,
                         env=hermetic_env(), cwd=ws)
    if run.returncode != 0:
        raise RuntimeError(f"bgraph build {' '.join(args)} failed:\n{run.stdout[-3000:]}{run.stderr[-3000:]}")
    return json.loads(run.stdout)


def workspace(root: Path) -> Path:
    """A copy of this workspace with the one-TU target added (no bgraph-out/ in the checkout)."""
    ws = root / "ws"
    if not (ws / "WORKSPACE.toml").exists():
        workspace_copy(ws, REPO)
        # Without the macro plugin (rules/cuda_toolchain.py `macro_use`): compiling it is a genrule
        # this helper cannot emulate, and loading it changes no output. A Spark builds and loads it.
        toolchains = ws / "targets" / "toolchains.toml"
        toolchains.write_text(toolchains.read_text().replace('macro_use = ":gcc-macro-use"\n', ""))
    (ws / "targets" / "native.toml").write_text(TARGETS_TOML)
    (ws / "native").mkdir(exist_ok=True)
    (ws / "native" / "qemu_shim.c").write_text(SHIM_C)
    return ws


def build_both(root: Path, jobs: int = 1) -> dict:
    """The cross build (x86_64 nvcc + Debian's aarch64 cross GCC, `--platform aarch64`, the real
    CLI) and the native one (aarch64 nvcc + arm64 GCC, under qemu) of the one-TU target, in one
    cache under `root`. Returns the records of both and the traces to compare."""
    from build_graph.labels import parse_label
    from build_graph.store.trace import Trace

    ws, cache = workspace(root), root / "cache"
    tools = bgraph(ws, cache, "//toolchains:qemu-user", "//toolchains:cuobjdump", "//native:qemu-shim")["outputs"]
    cross = bgraph(ws, cache, "-j", str(jobs), "--platform", "aarch64", LABEL)
    qemu_tree = _output_tree(cache, tools["//toolchains:qemu-user"])
    shim = _output_tree(cache, tools["//native:qemu-shim"]).entries["qemu-shim"]
    engine = emulating_engine(ws, cache, qemu_tree, shim, jobs)
    start = time.monotonic()
    native = engine.build([parse_label(LABEL)])
    wall = time.monotonic() - start
    if native.failures:
        raise RuntimeError("the native build under qemu failed:\n" + "\n".join(f.render() for f in native.failures))
    links = engine.link_outputs(native, ws / "bgraph-out")
    trace = Trace(cache / "v1" / "blake3", cache / "v1" / "tmp")
    return {"ws": ws, "cache": cache, "engine": engine,
            "cross": cross, "native": native.summary(), "native_wall_s": wall,
            "native_out": links[f"{LABEL} (aarch64 on aarch64)"],
            "cross_out": Path(cross["outputs"][f"{LABEL} (aarch64)"]),
            "cuobjdump": Path(tools["//toolchains:cuobjdump"]) / "bin" / "cuobjdump",
            "traces": {"cross": trace.load(f"{LABEL} (aarch64)"),
                       "native": trace.load(f"{LABEL} (aarch64 on aarch64)"),
                       "cross_toolkit": trace.load("//toolchains:cuda-13.0 (aarch64)"),
                       "native_toolkit": trace.load("//toolchains:cuda-13.0 (aarch64 on aarch64)")}}


def _output_tree(cache: Path, link: str):
    """The Tree of a materialized output (bgraph-out links into the cache's trees/<digest>)."""
    from build_graph.model import Digester
    from build_graph.store.cas import LocalCas
    digest = Path(os.path.realpath(link)).name
    return LocalCas(cache, Digester("blake3")).get_tree(digest)


# ---- the step-by-step comparison ------------------------------------------------------------

STEP_ORDER = ("dryrun", "hostpp", "cudafe", "devpp", "cicc", "ptxas", "hostcc", "fatbin", "link",
              "archive")  # link: traces from before fatbinary's action joined the TU's object


def _results(cache: Path, actions: list[dict], label: str) -> dict[str, dict]:
    """Action name -> {key, description, files (path -> blob digest), duration_s (when it ran)}
    for `label`'s actions of a build summary, read back from the cache."""
    from build_graph.model import Digester
    from build_graph.store.action_cache import LocalActionCache
    from build_graph.store.cas import LocalCas
    cas = LocalCas(cache, Digester("blake3"))
    ac = LocalActionCache(cas.base, cas.tmp)
    out = {}
    for a in actions:
        if a["label"] != label:
            continue
        result = ac.get(a["key"])
        tree = cas.get_tree(result.output_tree)
        out[a["name"]] = {"key": a["key"], "mnemonic": a["mnemonic"], "duration_s": result.duration_s,
                          "files": {p: e.digest for p, e in tree.entries.items() if hasattr(e, "digest")},
                          "read": lambda p, t=tree: cas.read_bytes(t.entries[p])}
    return out


def key_fields(cross: dict, native: dict) -> list[str]:
    """The fields of two actions' key descriptions that differ (input mounts by mount point)."""
    fields = []
    for k in sorted(set(cross) | set(native)):
        if k == "inputs":
            fields += [f"inputs[{m}]" for m in sorted(set(cross[k]) | set(native[k]))
                       if cross[k].get(m) != native[k].get(m)]
        elif cross.get(k) != native.get(k):
            fields.append(k)
    return fields


def elf_sections(data: bytes) -> dict[str, bytes]:
    """Section name -> contents of a little-endian ELF64 object (what differs between two objects)."""
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    heads = [struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize) for i in range(shnum)]
    strtab = heads[shstrndx]
    names = data[strtab[4]:strtab[4] + strtab[5]]
    out = {}
    for name, kind, _flags, _addr, offset, size in heads:
        label = names[name:names.index(b"\0", name)].decode()
        out[label] = b"" if kind == 8 else data[offset:offset + size]  # SHT_NOBITS holds nothing
    return out


def _code_lines(text: bytes) -> list[bytes]:
    """Preprocessed text without its line markers (# N "file") and blank lines: the code itself."""
    return [l for l in text.splitlines() if l.strip() and not l.startswith(b"# ")]


# nvcc's include directory for the toolkit is targets/<platform>/include when it drives another
# CPU's host compiler (cross), the flat include/ natively; the cross GCC's C library and libstdc++
# headers live under /usr/aarch64-linux-gnu/include (and .../include/c++ for libstdc++).
_TOOLKIT_INCLUDE = re.compile(rb"/bgraph/toolchain/bin/\.\./(?:targets/aarch64-linux/|/)include/")
_CROSS_SYSROOT = re.compile(rb"/usr/aarch64-linux-gnu/include/")
_GCC_INCLUDE = re.compile(rb"/usr/lib/gcc-cross/aarch64-linux-gnu/12/|/usr/lib/gcc/aarch64-linux-gnu/12/")


def _dirs_alike(text: bytes) -> bytes:
    """Text with the cross and native spellings of the same include directories made one."""
    text = _TOOLKIT_INCLUDE.sub(b"TOOLKIT/", text)
    text = re.sub(rb"/usr/aarch64-linux-gnu/include/c\+\+/12/aarch64-linux-gnu/", b"/usr/include/aarch64-linux-gnu/c++/12/", text)
    text = _CROSS_SYSROOT.sub(b"/usr/include/", text)
    text = text.replace(b"/usr/include/aarch64-linux-gnu/", b"/usr/include/")  # native multiarch headers
    text = re.sub(rb"tmpxft_[0-9a-f]+_[0-9a-f]+-", b"tmpxft-", text)  # nvcc's temp names (its PID)
    return _GCC_INCLUDE.sub(b"GCCLIB/", text)


def ar_members(data: bytes) -> dict[str, bytes]:
    """Member name -> contents of an ar archive (a static library)."""
    out, at = {}, 8
    while at + 60 <= len(data):
        head = data[at:at + 60]
        name, size = head[:16].decode().strip().rstrip("/"), int(head[48:58])
        out[name] = data[at + 60:at + 60 + size]
        at += 60 + size + (size & 1)
    return out


_LITERAL = re.compile(rb"(\d+\.\d+(?:[eE][-+]?\d+)?)([FL]?)")
# significand bits and least exponent of float, double and long double (binary128 on aarch64)
_FORMATS = {b"F": (24, -126), b"": (53, -1022), b"L": (113, -16382)}


def _rounded(text: bytes, suffix: bytes) -> tuple[int, int]:
    """The value a C literal names in its format: (significand, exponent), exactly."""
    bits, emin = _FORMATS[suffix]
    x = Fraction(text.decode())
    if x == 0:
        return (0, emin)
    e = x.numerator.bit_length() - x.denominator.bit_length()
    e += (Fraction(2) ** (e + 1) <= x) - (Fraction(2) ** e > x)
    e = max(e, emin)  # subnormals: the least exponent's quantum
    m = round(x / Fraction(2) ** (e - bits + 1))
    return (m // 2, e + 1) if m == 1 << bits else (m, e)  # rounded up to the next power of two


def literal_values(a: bytes, b: bytes) -> tuple[int, int]:
    """Of the float literals two texts spell otherwise, line by line: (same value, other value)."""
    same = other = 0
    for x, y in zip(a.splitlines(), b.splitlines()):
        if x == y:
            continue
        for (vx, sx), (vy, sy) in zip(_LITERAL.findall(x), _LITERAL.findall(y)):
            if vx != vy and sx == sy:
                if _rounded(vx, sx) == _rounded(vy, sy):
                    same += 1
                else:
                    other += 1
    return same, other


def _why(a: bytes, b: bytes) -> str:
    """A short account of how two outputs of one step differ."""
    if a == b:
        return ""
    if a[:8] == b[:8] == b"!<arch>\n":
        ma, mb = ar_members(a), ar_members(b)
        if set(ma) != set(mb):
            return f"archives of other members: {sorted(ma)} / {sorted(mb)}"
        return "; ".join(f"{m or '(symbol table)'}: {_why(ma[m], mb[m]) or 'identical'}" for m in sorted(ma))
    if a[:4] == b[:4] == b"\x7fELF":
        sa, sb = elf_sections(a), elf_sections(b)
        differ = sorted(n for n in set(sa) | set(sb) if sa.get(n) != sb.get(n))
        if differ == [".comment"]:
            ca, cb = (sorted(set(x[".comment"].strip(b"\0").split(b"\0"))) for x in (sa, sb))
            return f"only .comment differs: {b', '.join(ca).decode()} / {b', '.join(cb).decode()}"
        return f"sections differ: {', '.join(differ)}"
    if b"\0" in a[:4096] + b[:4096]:
        return f"binary, {len(a)} vs {len(b)} bytes"
    if _code_lines(a) == _code_lines(b):
        return "the same code; only line markers differ (include directories)"
    if _dirs_alike(a) == _dirs_alike(b):
        return ("the same text once include directories are named alike (toolkit: targets/aarch64-linux/include "
                "cross, include/ native; C library and libstdc++: /usr/aarch64-linux-gnu/include cross, /usr/include native)")
    if [_dirs_alike(l) for l in _code_lines(a)] == [_dirs_alike(l) for l in _code_lines(b)]:
        n = sum(x != y for x, y in zip(_code_lines(a), _code_lines(b)))
        return (f"the same code but {n} __FILE__ strings (assert) naming the toolkit's include directory; "
                "line markers differ (include directories)")
    names = [sorted(os.path.basename(t) for t in x.split() if t != b"\\") for x in (a, b)]
    if a.split(b":", 1)[0] == b.split(b":", 1)[0] and names[0] == names[1]:
        return f"the same {len(names[0]) - 1} files (a depfile), named in other directories"
    floats = re.compile(rb"\d+\.\d+(?:[eE][-+]?\d+)?[FL]?")
    if floats.sub(b"N", _dirs_alike(a)) == floats.sub(b"N", _dirs_alike(b)):
        n = sum(x != y for x, y in zip(_dirs_alike(a).splitlines(), _dirs_alike(b).splitlines()))
        same, other = literal_values(_dirs_alike(a), _dirs_alike(b))
        return (f"{n} lines spell floating-point literals otherwise (x86_64 cudafe++ with --arm_cross_compiler: "
                "1.1754944E-38F, 35-digit long doubles; aarch64 cudafe++: 1.175494351e-38F, 34 digits): "
                f"{same} name the same value, {other} another (1-2 units in the last place of a long double); the rest is "
                "the same once include directories are named alike")
    la, lb = _dirs_alike(a).decode(errors="replace").splitlines(), _dirs_alike(b).decode(errors="replace").splitlines()
    changed = [l for l in difflib.unified_diff(la, lb, lineterm="", n=0)
               if l[:1] in "+-" and not l.startswith(("+++", "---"))]
    return (f"{len(changed) // 2} lines differ once include directories and temp names are made alike, "
            f"e.g. {changed[0][:90]!r} / {changed[len(changed) // 2][:90]!r}")


def compare(built: dict) -> list[dict]:
    """One row per step of the TU (and the library's archive): each output file of the cross
    build beside the native build's, identical or how they differ, the wall time of each
    (native: under qemu here), and which key fields differ."""
    traces = built["traces"]
    label_c, label_n = f"{LABEL} (aarch64)", f"{LABEL} (aarch64 on aarch64)"
    cross = _results(built["cache"], built["cross"]["actions"], label_c)
    native = _results(built["cache"], built["native"]["actions"], label_n)
    rows = []
    for name in sorted(set(cross) & set(native), key=lambda n: (STEP_ORDER.index(n.split()[0])
                                                                  if n.split()[0] in STEP_ORDER else 99, n)):
        c, n = cross[name], native[name]
        desc_c = traces["cross"]["actions"][name]["description"]
        desc_n = traces["native"]["actions"][name]["description"]
        for path in sorted(set(c["files"]) | set(n["files"])):
            same = c["files"].get(path) == n["files"].get(path)
            why = "" if same else (_why(c["read"](path), n["read"](path))
                                   if path in c["files"] and path in n["files"] else "only in one")
            rows.append({"step": name, "file": path, "identical": same, "why": why,
                         "cross_s": c["duration_s"], "native_s": n["duration_s"],
                         "same_key": c["key"] == n["key"], "key_fields": key_fields(desc_c, desc_n)})
    return rows


def shared_keys(built: dict) -> dict[str, int]:
    """Mnemonic -> how many actions of the two builds have the same key (what a remote cache
    filled by one serves the other)."""
    cross = {a["key"]: a["mnemonic"] for a in built["cross"]["actions"]}
    native = {a["key"]: a["mnemonic"] for a in built["native"]["actions"]}
    both: dict[str, int] = {}
    for k in set(cross) & set(native):
        both[cross[k]] = both.get(cross[k], 0) + 1
    return both
