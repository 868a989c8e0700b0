"""ninja_generator + ninja_import: a small generator (a Python script in the workspace) writes a
module's sources and a build.ninja with absolute paths, as FlashInfer's AOT generator does
(nvcc with --generate-dependencies-with-compile, a g++ compile, a link, a `subninja` top file),
and bgraph builds its edges for real: nvcc per TU and arch (pinned nvcc 13.0, bubblewrap), early
cutoff, clear errors."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest

from bgraph_testlib import WS, copy_toolchains

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")

LABEL = "//gen:mod"
GENERATOR = r'''
import os, sys
src, out = os.environ["SRC"], os.environ["OUT"]
archs = os.environ["ARCHS"].split()
os.makedirs(f"{out}/generated/mod", exist_ok=True)
os.makedirs(f"{out}/ops/mod", exist_ok=True)
# A generated TU that includes a header of the source tree.
with open(f"{out}/generated/mod/kernel.cu", "w") as f:
    f.write('#include "scale.h"\n__global__ void k(float* x) { x[threadIdx.x] *= SCALE; }\n'
            'void launch(float* x) { k<<<1, 32>>>(x); }\n')
gencode = " ".join(f"-gencode=arch=compute_{a.replace('.', '')},code=sm_{a.replace('.', '')}" for a in archs)
ninja = f"""ninja_required_version = 1.3
nvcc = /bgraph/toolchain/bin/nvcc
cflags = -I{src} -isystem {src}/sys -O2 -fPIC
cuda_cflags = -I{src} --compiler-options=-fPIC {gencode}
rule compile
  command = /usr/bin/g++ -MMD -MF $out.d $cflags -c $in -o $out
  depfile = $out.d
rule cuda_compile
  command = $nvcc --generate-dependencies-with-compile -MF $out.d $cuda_cflags -c $in -o $out
  depfile = $out.d
rule link
  command = /usr/bin/g++ $in -shared -o $out
build {out}/ops/mod/kernel.cuda.o: cuda_compile {out}/generated/mod/kernel.cu
build {out}/ops/mod/host.o: compile {src}/host.cc
build {out}/ops/mod/mod.so: link {out}/ops/mod/kernel.cuda.o {out}/ops/mod/host.o
default {out}/ops/mod/mod.so
"""
open(f"{out}/ops/mod/build.ninja", "w").write(ninja)
open(f"{out}/build.ninja", "w").write(f"subninja {out}/ops/mod/build.ninja\n")
'''
TARGET = """\
[mod]
kind = "ninja_generator"
src = ":src"
srcs = ["gen.py"]
cmd = "python3 -S $WS/gen.py"
archs = ["12.0a", "12.1a"]
arch_env = "ARCHS"
outputs = ["ops/*/*.so"]
strip_prefix = "ops"
toolchain = "//toolchains:cuda-13.0"

[src]
kind = "genrule"
srcs = ["proj/**"]
outs = ["scale.h", "host.cc", "notes.txt", "sys/host_value.h"]
cmd = "cp -R $SRC/proj/. $OUT/"
"""
# host.cc reads sys/host_value.h through -isystem, and its rule writes a -MMD depfile (PyTorch's
# cpp_extension rule), which leaves that header out.
SOURCES = {"scale.h": "#define SCALE 2.0f\n",
           "host.cc": "#include <host_value.h>\nint host_answer() { return HOST_VALUE; }\n",
           "sys/host_value.h": "#define HOST_VALUE 42\n", "notes.txt": "not read by any compile\n"}
COMPILES = ("CudaHostPreprocess", "CudaDevicePreprocess", "CudaFrontend", "CudaCicc", "CudaPtxas",
            "CudaHostCompile", "NinjaCompile", "NinjaEdge")


def new_ws(root: Path, cache: Path, target: str = TARGET) -> WS:
    copy_toolchains(root)
    (root / "targets" / "gen.toml").write_text(target)
    (root / "gen.py").write_text(GENERATOR)
    for name, text in SOURCES.items():
        (root / "proj" / name).parent.mkdir(parents=True, exist_ok=True)
        (root / "proj" / name).write_text(text)
    return WS(root, cache)


@pytest.fixture(scope="module")
def cache(module_tmp):
    return module_tmp / "ninja-import-cache"


@pytest.fixture
def ws(tmp_path, cache) -> WS:
    return new_ws(tmp_path / "ws", cache)


def ran(summary: dict, mnemonics=COMPILES) -> list[str]:
    return sorted(a["name"] for a in summary["actions"] if a["status"] == "executed" and a["mnemonic"] in mnemonics)


def test_generated_graph_builds_per_tu_and_arch(ws):
    run = ws.build(LABEL, args=("-j", "2"))
    assert run.rc == 0, run.output[-3000:]
    names = {a["name"] for a in run.json["actions"]}
    assert "generate" in names
    # The nvcc edge became nvcc's own steps, one cicc/ptxas per arch; the g++ edge and the link ran verbatim.
    for arch in ("120a", "121a"):
        assert {f"cicc ops/mod/kernel.cuda.o {arch}", f"ptxas ops/mod/kernel.cuda.o {arch}"} <= names, names
    assert "compile ops/mod/host.o" in names and "link ops/mod/mod.so" in names
    lib = ws.root / "bgraph-out" / "gen" / "mod" / "mod" / "mod.so"
    data = lib.read_bytes()
    assert data[:4] == b"\x7fELF" and b"host_answer" in data
    # Another build: nothing runs, the generator included.
    again = ws.build(LABEL)
    assert again.json["executed"] == 0, ran(again.json)


def test_edits_rerun_only_what_reads_them(ws):
    assert ws.build(LABEL).rc == 0
    # A source file no compile reads: the generator runs again (it sees the whole tree), no compile does.
    (ws.root / "proj" / "notes.txt").write_text("edited\n")
    run = ws.build(LABEL)
    assert run.rc == 0, run.output[-3000:]
    assert ran(run.json) == [], ran(run.json)
    # A comment in the header the TU includes: it is preprocessed again, and cut off before cicc.
    (ws.root / "proj" / "scale.h").write_text("// a comment\n#define SCALE 2.0f\n")
    run = ws.build(LABEL)
    assert run.rc == 0, run.output[-3000:]
    redone = ran(run.json)
    assert any(n.startswith("devpp ops/mod/kernel.cuda.o") for n in redone), redone
    assert not any(n.startswith(("cicc", "ptxas", "link", "compile ops/mod/host.o")) for n in redone), redone


def test_isystem_header_under_mmd_recompiles_the_host_object(ws, tmp_path):
    """`g++ -MMD` leaves out host_value.h (found through -isystem): bgraph runs the edge with
    -MD, so an edit to the header recompiles host.o, and the module equals a clean build's."""
    assert ws.build(LABEL).rc == 0
    lib = ws.root / "bgraph-out" / "gen" / "mod" / "mod" / "mod.so"
    before = lib.read_bytes()
    (ws.root / "proj" / "sys" / "host_value.h").write_text("#define HOST_VALUE 43\n")
    run = ws.build(LABEL)
    assert run.rc == 0, run.output[-3000:]
    assert ran(run.json, ("NinjaCompile",)) == ["compile ops/mod/host.o"], ran(run.json)
    assert lib.read_bytes() != before
    clean = new_ws(tmp_path / "clean", tmp_path / "clean-cache")
    (clean.root / "proj" / "sys" / "host_value.h").write_text("#define HOST_VALUE 43\n")
    assert clean.build(LABEL, args=("-j", "2")).rc == 0
    assert (clean.root / "bgraph-out" / "gen" / "mod" / "mod" / "mod.so").read_bytes() == lib.read_bytes()


def test_a_generated_tu_with_no_external_name_gets_one_module_id(tmp_path, cache):
    """cudafe++ names a TU that defines nothing external by the time of its source file (a stat
    of --orig_src_path_name), or by the clock where it cannot see the file: the generated .cu
    lives in the staged build directory, and the step is given it there. A rerun a second later
    (`--check`) gives the same bytes."""
    ws = new_ws(tmp_path / "ws", cache)
    internal = GENERATOR.replace(
        "'#include \"scale.h\"\\n__global__ void k(float* x) { x[threadIdx.x] *= SCALE; }\\n'\n"
        "            'void launch(float* x) { k<<<1, 32>>>(x); }\\n'",
        "'#include \"scale.h\"\\nnamespace { __global__ void k(float* x) { x[threadIdx.x] *= SCALE; } }\\n'\n"
        "            'static void launch(float* x) { k<<<1, 32>>>(x); }\\n'")
    assert internal != GENERATOR
    (ws.root / "gen.py").write_text(internal)
    first = ws.build(LABEL)
    assert first.rc == 0, first.output[-3000:]
    time.sleep(1.2)  # the clock cudafe++ falls back to counts seconds
    check = ws.build(LABEL, args=("--check",))
    assert check.rc == 0 and check.json["differing"] == [], check.output[-3000:]


def test_output_glob_matching_nothing_is_one_error_line(tmp_path, cache):
    ws = new_ws(tmp_path / "ws", cache, TARGET.replace('outputs = ["ops/*/*.so"]', 'outputs = ["ops/*/*.dll"]'))
    run = ws.build(LABEL)
    assert run.rc != 0 and "Traceback" not in run.output
    assert "no build edge produces a path matching 'ops/*/*.dll'" in run.output and "gen.toml" in run.output


def test_generator_failure_shows_its_output(tmp_path, cache):
    ws = new_ws(tmp_path / "ws", cache, TARGET.replace("python3 -S $WS/gen.py", "echo bad flag >&2; exit 3"))
    run = ws.build(LABEL)
    assert run.rc != 0 and "Traceback" not in run.output
    assert "the generator failed" in run.output and "bad flag" in run.output


def test_a_cross_build_is_refused_in_one_line(tmp_path, cache):
    """For another CPU the generator would run the target's packages on this machine (FlashInfer's
    imports the aarch64 torch): refused when planned, naming the target, never run."""
    from build_graph.workspace import host_platform
    ws = new_ws(tmp_path / "ws", cache)
    other = "aarch64" if host_platform() == "x86_64" else "x86_64"
    run = ws.cli("build", "--json", "--platform", other, LABEL, timeout=900)
    assert run.rc != 0 and "Traceback" not in run.output, run.output[-3000:]
    assert f"a ninja_generator without cross.exec_ext cannot build for {other} on " in run.output
    assert "gen.toml" in run.output
    assert not [a for a in run.json["actions"] if a["mnemonic"] == "NinjaGenerate"]


CROSS = TARGET.replace('cmd = "python3 -S $WS/gen.py"',
                       'cmd = "test -f $GEN_TOOL/tool.txt && python3 -S $WS/gen.py"') + """
[mod.cross]
exec_ext = { tool = ":tool" }
env = { GEN_TOOL = "/bgraph/exec/tool" }

[tool]
kind = "genrule"
srcs = ["gen.py"]
outs = ["tool.txt"]
cmd = "uname -m > $OUT/tool.txt"
"""


@pytest.mark.slow
def test_a_cross_build_runs_the_generator_with_exec_trees_and_links_for_the_target(tmp_path, cache):
    """With cross.exec_ext the generator runs here (what it needs built for this machine, at
    /bgraph/exec/<name>), and the edges compile and link with the target's cross compiler."""
    from build_graph.workspace import host_platform
    if host_platform() != "x86_64":
        pytest.skip("the pinned cross compiler runs on x86_64")
    ws = new_ws(tmp_path / "ws", cache, CROSS)
    run = ws.cli("build", "--json", "-j", "2", "--platform", "aarch64", LABEL, timeout=3600)
    assert run.rc == 0, run.output[-3000:]
    lib = ws.root / "bgraph-out" / "aarch64" / "gen" / "mod" / "mod" / "mod.so"
    header = lib.read_bytes()[:20]
    assert header[:4] == b"\x7fELF" and int.from_bytes(header[18:20], "little") == 183  # EM_AARCH64
    names = {a["name"] for a in run.json["actions"]}
    assert {"cicc ops/mod/kernel.cuda.o 120a", "ptxas ops/mod/kernel.cuda.o 121a"} <= names, names


# -- what GCC's depfile leaves out, with the host's gcc and GNU as (red team R3, class 1) --------

HOST_NINJA = """ninja_required_version = 1.3
rule cc
  command = /usr/bin/gcc -MMD -MF $out.d -O1 -c $in -o $out
  depfile = $out.d
  deps = gcc
build /bgraph/out/lib/main.o: cc /bgraph/src/tree/main.c
default /bgraph/out/lib/main.o
"""
_PROBE = '#if {}("new.h")\n#include "new.h"\n#else\n#define NEWV 0\n#endif\nint f(void){{return NEWV;}}\n'
_TWINS = '#{0} "a.h"\n#{0} "b.h"\n#ifdef BV\nint f(void){{return AV + BV;}}\n#else\nint f(void){{return AV;}}\n#endif\n'
_ASM = '__asm__(".section .rodata\\n{}\\n.text\\n");\nint f(void){{return 1;}}\n'
# (files of proj/, then the edit): each read is one GCC's -MD depfile does not name, or names in a
# form the parser must read right.
READS_OUTSIDE_GCC_DEPFILE = {
    "asm .include": ({"main.c": _ASM.format('.include \\"/bgraph/src/tree/data.s\\"'), "data.s": ".byte 42\n"},
                     {"data.s": ".byte 43\n"}),
    ".INCBIN": ({"main.c": _ASM.format('.INCBIN \\"/bgraph/src/tree/blob.bin\\"'), "blob.bin": "AAAA"},
                {"blob.bin": "BBBB"}),
    ".incbin split in two strings": ({"main.c": _ASM.format('.inc" "bin \\"/bgraph/src/tree/blob.bin\\"'),
                                      "blob.bin": "AAAA"}, {"blob.bin": "BBBB"}),
    "__has_include with a comment": ({"main.c": _PROBE.format("__has_include /* c */ ")},
                                     {"new.h": "#define NEWV 7\n"}),
    "__has_include with a splice": ({"main.c": _PROBE.format("__has_inc\\\nlude")}, {"new.h": "#define NEWV 7\n"}),
    "__has_include through an alias": ({"main.c": "#define HI __has_include\n" + _PROBE.format("HI")},
                                       {"new.h": "#define NEWV 7\n"}),
    # GCC skips a header whose bytes equal a once-only one's it read, and names it in no depfile
    "#pragma once copy": ({"main.c": _TWINS.format("include"), "a.h": "#pragma once\n#define AV 1\n",
                           "b.h": "#pragma once\n#define AV 1\n"}, {"b.h": "#pragma once\n#define BV 7\n"}),
    "_Pragma(once) copy": ({"main.c": _TWINS.format("include"), "a.h": '_Pragma("once")\n#define AV 1\n',
                            "b.h": '_Pragma("once")\n#define AV 1\n'}, {"b.h": '_Pragma("once")\n#define BV 7\n'}),
    "#import copy": ({"main.c": _TWINS.format("import"), "a.h": "#define AV 1\n", "b.h": "#define AV 1\n"},
                     {"b.h": "#define BV 7\n"}),
    "#import of a copy of a header only probed": (
        {"main.c": '#if __has_include("h.h")\n#endif\n#import "x.h"\n#ifndef XV\n#define XV 0\n#endif\n'
                   'int f(void){return XV;}\n',
         "h.h": "#define XV 5\n", "x.h": "#define XV 5\n"}, {"x.h": "#define XV 6\n"}),
    "a backslash in a header's name": ({"main.c": '#include "a\\b.h"\n#include "ab.h"\nint f(void){return V + W;}\n',
                                        "a\\b.h": "#define V 1\n", "ab.h": "#define W 1\n"},
                                       {"a\\b.h": "#define V 2\n"}),
}


def host_c_ws(root: Path, cache: Path, files: dict[str, str], flags: str = "-O1") -> WS:
    import oracle_lib as ol
    ws = WS(root, cache)
    ws.write({"WORKSPACE.toml": '[workspace]\nname = "depfiles"\n', "targets/toolchains.toml": ol.TOOLCHAINS,
              "targets/c.toml": ol.C_TARGETS, "gen/build.ninja": HOST_NINJA.replace("-O1", flags),
              **{f"proj/{name}": text for name, text in files.items()}})
    return ws


@pytest.mark.skipif(shutil.which("gcc") is None or shutil.which("as") is None, reason="no gcc or GNU as")
@pytest.mark.parametrize("case", sorted(READS_OUTSIDE_GCC_DEPFILE))
def test_an_edit_to_what_gccs_depfile_leaves_out_recompiles(case, tmp_path, cache):
    """The edit is seen (the compile runs again) and the object equals a clean build's: GNU as
    names what inline asm reads in its own depfile (`-Wa,--MD`), a `__has_include` split by a
    comment or a splice is read, an alias of it keeps the tree whole, and a backslash in a
    depfile name is the name's own."""
    files, edit = READS_OUTSIDE_GCC_DEPFILE[case]
    ws = host_c_ws(tmp_path / "ws", cache / "host-c", files)
    assert ws.build("//c:obj").rc == 0
    # Still narrowed (but where an alias of __has_include or an #import keeps the tree whole): a file it does
    # not read is no reason to compile again.
    ws.write({"proj/notes.txt": "read by no compile\n"})
    run = ws.build("//c:obj")
    whole = "alias" in case or "#import" in case  # an alias of __has_include, or #import: the tree whole
    assert run.rc == 0 and ran(run.json, ("NinjaCompile",)) == ([] if not whole else ["compile lib/main.o"])
    ws.write({f"proj/{name}": text for name, text in edit.items()})
    run = ws.build("//c:obj")
    assert run.rc == 0, run.output[-3000:]
    assert ran(run.json, ("NinjaCompile",)) == ["compile lib/main.o"], ran(run.json, ("NinjaCompile",))
    clean = host_c_ws(tmp_path / "clean", tmp_path / "clean-cache", {**files, **edit})
    assert clean.build("//c:obj").rc == 0
    obj, clean_obj = (w.root / "bgraph-out" / "c" / "obj" / "lib" / "main.o" for w in (ws, clean))
    assert obj.read_bytes() == clean_obj.read_bytes(), case


# What a compile needs but reads nothing of (no depfile names it): gone, the compile fails, and
# an incremental build must fail as a clean one does (red team R7).
NEEDS_WITHOUT_READING = {
    "#pragma GCC dependency": ("-O1", {"main.c": '#pragma GCC dependency "dep.txt"\nint f(void){return 1;}\n',
                                       "dep.txt": "x\n"}, "dep.txt", None),
    "-I directory removed": ("-O1 -Werror=missing-include-dirs -I/bgraph/src/tree/inc2",
                             {"main.c": "int f(void){return 1;}\n", "inc2/notes.h": "#define N 1\n"}, "inc2", None),
    "-I directory now a file": ("-O1 -Werror -I/bgraph/src/tree/inc2",
                                {"main.c": "int f(void){return 1;}\n", "inc2/notes.h": "#define N 1\n"}, "inc2",
                                "not a directory\n"),
    # (R8) a missing -I directory whose parent becomes a file is a hard error, -Werror or not
    "the parent of a missing -I directory now a file": (
        "-O1 -I/bgraph/src/tree/p/inc", {"main.c": "int f(void){return 1;}\n", "p/notes.txt": "x\n"}, "p",
        "not a directory\n"),
    "-iwithprefix directory now a file": (
        "-O1 -Werror -iprefix /bgraph/src/tree/ -iwithprefix inc2",
        {"main.c": "int f(void){return 1;}\n", "inc2/notes.h": "#define N 1\n"}, "inc2", "not a directory\n"),
    "#pragma GCC dependency made by _Pragma(#x), a comment before its operand": (
        "-O1", {"main.c": '#define P(x) _Pragma(#x)\nP(GCC dependency /* c */ "dep.txt")\nint f(void){return 1;}\n',
                "dep.txt": "x\n"}, "dep.txt", None),
}


@pytest.mark.skipif(shutil.which("gcc") is None, reason="no gcc")
@pytest.mark.parametrize("case", sorted(NEEDS_WITHOUT_READING))
def test_what_a_compile_needs_without_reading_fails_incrementally_as_cleanly(case, tmp_path, cache):
    """A `#pragma GCC dependency` operand removed, an -I directory removed under
    -Werror=missing-include-dirs or made a file under -Werror: the compile runs again (and fails)."""
    flags, files, removed, replacement = NEEDS_WITHOUT_READING[case]
    ws = host_c_ws(tmp_path / "ws", cache / "host-c", files, flags)
    run = ws.build("//c:obj")
    assert run.rc == 0, run.output[-3000:]
    shutil.rmtree(ws.root / "proj" / removed) if (ws.root / "proj" / removed).is_dir() else (
        ws.root / "proj" / removed).unlink()
    if replacement is not None:
        (ws.root / "proj" / removed).write_text(replacement)
    left = {k: v for k, v in files.items() if k != removed and not k.startswith(removed + "/")}
    if replacement is not None:
        left[removed] = replacement
    clean = host_c_ws(tmp_path / "clean", tmp_path / "clean-cache", left, flags)
    assert clean.build("//c:obj").rc != 0
    run = ws.build("//c:obj")
    assert run.rc != 0 and "compile lib/main.o" in run.output, run.output[-3000:]


LINK_NINJA = """ninja_required_version = 1.3
rule cc
  command = /usr/bin/gcc -MMD -MF $out.d -O1 -fPIC -c $in -o $out
  depfile = $out.d
  deps = gcc
rule link
  command = /usr/bin/gcc -shared -Wl,--version-script=/bgraph/src/tree/exports.map $in -o $out
build /bgraph/out/lib/main.o: cc /bgraph/src/tree/main.c
build /bgraph/out/lib/libm.so: link /bgraph/out/lib/main.o
default /bgraph/out/lib/libm.so
"""


@pytest.mark.skipif(shutil.which("gcc") is None, reason="no gcc")
def test_a_link_reads_the_version_script_its_command_names(tmp_path, cache):
    """R7 link_version_script: a link saw only what Ninja lists, so a version script of the
    sources (CMake lists it only with LINK_DEPENDS) was missing and every build failed to link.
    The file its command names is mounted, and an edit to it links again."""
    import oracle_lib as ol
    ws = WS(tmp_path / "ws", cache / "host-link")
    ws.write({"WORKSPACE.toml": '[workspace]\nname = "link"\n', "targets/toolchains.toml": ol.TOOLCHAINS,
              "targets/c.toml": ol.C_TARGETS, "gen/build.ninja": LINK_NINJA,
              "proj/main.c": "int shown(void){return 1;}\nint hidden(void){return 2;}\n",
              "proj/exports.map": "{ global: shown; local: *; };\n"})
    run = ws.build("//c:obj")
    assert run.rc == 0, run.output[-3000:]
    lib = ws.root / "bgraph-out" / "c" / "obj" / "lib" / "libm.so"
    symbols = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True).stdout
    assert " shown" in symbols and " hidden" not in symbols, symbols
    ws.write({"proj/exports.map": "{ global: shown; hidden; local: *; };\n"})
    run = ws.build("//c:obj")
    assert run.rc == 0 and ran(run.json, ("NinjaEdge",)) == ["link lib/libm.so"], ran(run.json, ("NinjaEdge",))
    symbols = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True).stdout
    assert " hidden" in symbols, symbols


@pytest.mark.skipif(shutil.which("gcc") is None, reason="no gcc")
def test_a_link_to_a_skipped_copy_retargeted_recompiles(tmp_path, cache):
    """R8 mount_link_twin: `#include "b.h"` finds b.h, a link (made by the source genrule) to a
    copy of the #pragma once header a.h read before; GCC skips it and names neither. The link
    retargeted to another header: the compile runs again and equals a clean build."""
    import oracle_lib as ol
    targets = ol.C_TARGETS.replace('cmd = "cp -a $SRC/proj $OUT/tree"',
                                   'cmd = "cp -a $SRC/proj $OUT/tree && chmod u+w $OUT/tree && ln -s $(cat $SRC/proj/target) $OUT/tree/b.h"')
    twins = '#include "a.h"\n#include "b.h"\n#ifdef BV\nint f(void){return AV + BV;}\n#else\nint f(void){return AV;}\n#endif\n'
    files = {"main.c": twins, "a.h": "#pragma once\n#define AV 1\n", "tw1.h": "#pragma once\n#define AV 1\n",
             "tw2.h": "#pragma once\n#define BV 7\n", "target": "tw1.h"}

    def ws_at(root: Path, cache_dir: Path, chosen: str) -> WS:
        ws = WS(root, cache_dir)
        ws.write({"WORKSPACE.toml": '[workspace]\nname = "links"\n', "targets/toolchains.toml": ol.TOOLCHAINS,
                  "targets/c.toml": targets, "gen/build.ninja": HOST_NINJA,
                  **{f"proj/{k}": v for k, v in {**files, "target": chosen}.items()}})
        return ws

    ws = ws_at(tmp_path / "ws", cache / "host-links", "tw1.h")
    assert ws.build("//c:obj").rc == 0
    ws.write({"proj/target": "tw2.h"})
    run = ws.build("//c:obj")
    assert run.rc == 0 and ran(run.json, ("NinjaCompile",)) == ["compile lib/main.o"], ran(run.json, ("NinjaCompile",))
    clean = ws_at(tmp_path / "clean", tmp_path / "clean-cache", "tw2.h")
    assert clean.build("//c:obj").rc == 0
    obj, clean_obj = (w.root / "bgraph-out" / "c" / "obj" / "lib" / "main.o" for w in (ws, clean))
    assert obj.read_bytes() == clean_obj.read_bytes()


# A path of a header's name that GCC skips in its lookup, whose meaning changes while every name
# and link text stays (red team R13): the source genrule makes it (`make`, after `cp -a`); the
# edit adds files to proj/. Each edit makes GCC read another header: the compile runs again.
_SKIPPED = "-O1 -I/bgraph/src/tree/inc1 -I/bgraph/src/tree/inc2"
SKIPPED_PATHS = {
    "a dangling link whose target appears": (
        "ln -s ../opt/real.h $OUT/tree/inc1/a.h", {"main.c": "#include <a.h>\nint f(void){return AV;}\n",
                                                  "inc1/keep": "", "inc2/a.h": "#define AV 2\n"},
        {"opt/real.h": "#define AV 77\n"}),
    "a link to a directory that becomes a file": (
        "ln -s ../opt/real $OUT/tree/inc1/a.h && (test ! -e $SRC/proj/flag || "
        "(rm -r $OUT/tree/opt/real && echo '#define AV 5' > $OUT/tree/opt/real))",
        {"main.c": "#include <a.h>\nint f(void){return AV;}\n", "inc1/keep": "", "inc2/a.h": "#define AV 2\n",
         "opt/real/x": ""}, {"flag": ""}),
    "an empty directory of the name that becomes a file": (
        "(test -e $SRC/proj/flag && echo '#define AV 9' > $OUT/tree/inc1/a.h || mkdir $OUT/tree/inc1/a.h)",
        {"main.c": "#include <a.h>\nint f(void){return AV;}\n", "inc1/keep": "", "inc2/a.h": "#define AV 2\n"},
        {"flag": ""}),
    "a link added on the way of a dangling one": (
        "ln -s ../x $OUT/tree/inc1/sub && (test ! -e $SRC/proj/flag || ln -s y $OUT/tree/x)",
        {"main.c": "#include <sub/a.h>\nint f(void){return AV;}\n", "inc1/keep": "", "inc2/sub/a.h": "#define AV 2\n",
         "y/a.h": "#define AV 5\n"}, {"flag": ""}),
}


@pytest.mark.skipif(shutil.which("gcc") is None, reason="no gcc")
@pytest.mark.parametrize("case", sorted(SKIPPED_PATHS))
def test_a_skipped_path_that_changes_meaning_recompiles(case, tmp_path, cache):
    import oracle_lib as ol
    make, files, edit = SKIPPED_PATHS[case]
    targets = ol.C_TARGETS.replace('cmd = "cp -a $SRC/proj $OUT/tree"',
                                   f'cmd = "cp -a $SRC/proj $OUT/tree && chmod -R u+w $OUT/tree && {make}"')
    assert targets != ol.C_TARGETS

    def ws_at(root: Path, cache_dir: Path, more: dict[str, str]) -> WS:
        ws = WS(root, cache_dir)
        ws.write({"WORKSPACE.toml": '[workspace]\nname = "skipped"\n', "targets/toolchains.toml": ol.TOOLCHAINS,
                  "targets/c.toml": targets, "gen/build.ninja": HOST_NINJA.replace("-O1", _SKIPPED),
                  **{f"proj/{k}": v for k, v in {**files, **more}.items()}})
        return ws

    ws = ws_at(tmp_path / "ws", cache / "host-skipped", {})
    first = ws.build("//c:obj")
    assert first.rc == 0, first.output[-3000:]
    ws.write({f"proj/{k}": v for k, v in edit.items()})
    run = ws.build("//c:obj")
    assert run.rc == 0, run.output[-3000:]
    assert ran(run.json, ("NinjaCompile",)) == ["compile lib/main.o"], ran(run.json, ("NinjaCompile",))
    clean = ws_at(tmp_path / "clean", tmp_path / "clean-cache", edit)
    assert clean.build("//c:obj").rc == 0
    obj, clean_obj = (w.root / "bgraph-out" / "c" / "obj" / "lib" / "main.o" for w in (ws, clean))
    assert obj.read_bytes() == clean_obj.read_bytes(), case
