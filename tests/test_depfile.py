"""Make-syntax depfiles as gcc and nvcc write them."""

from build_graph.depfile import absolute, parse_depfile, steered


def test_rules_continuations_escapes_and_phony_targets():
    text = ("obj.o: /bgraph/src/a.cu /bgraph/src/my\\ dir/b.h \\\n /bgraph/toolchain/include/c.h \\\n"
            "  rel/d.h\n/bgraph/src/my\\ dir/b.h:\nrel/d.h:\n")
    assert parse_depfile(text) == ["/bgraph/src/a.cu", "/bgraph/src/my dir/b.h",
                                   "/bgraph/toolchain/include/c.h", "rel/d.h"]


def test_dollar_and_empty():
    assert parse_depfile("x.o: a$$b.h\n") == ["a$b.h"]
    assert parse_depfile("") == []


def test_only_a_blank_a_hash_and_a_dollar_are_escaped():
    """GCC (mkdeps.cc) escapes a blank (doubling the backslashes right before it), `#` and `$`:
    any other backslash is the name's (red team R3: `a\\b.h` was read as ab.h). GNU as leaves `#`."""
    assert parse_depfile("x.o: a\\b.h ab.h\n") == ["a\\b.h", "ab.h"]
    assert parse_depfile("x.o: bs\\\\\\ sp.h two\\\\\\\\\\ sp.h\n") == ["bs\\ sp.h", "two\\\\ sp.h"]
    assert parse_depfile("x.o: ha\\#sh.h bs\\\\#h.h\n") == ["ha#sh.h", "bs\\#h.h"]
    assert parse_depfile("x.o: ha#sh.h bs\\#h.h\n", hash_escaped=False) == ["ha#sh.h", "bs\\#h.h"]
    assert parse_depfile("x.o: tab\\\tname.h end\\\\ next.h\n") == ["tab\tname.h", "end\\", "next.h"]


def test_a_line_ends_only_at_a_newline_and_names_at_blanks():
    """U+2028, form feeds and \\x1c-\\x1e may be in a file name (red team R10: str.splitlines cut
    the rule there, and every name after it was lost)."""
    text = "x.o: a\u2028b.h c\x0cd.h \\\r\n e\x1cf.h g.h\r\n"
    assert parse_depfile(text) == ["a\u2028b.h", "c\x0cd.h", "e\x1cf.h", "g.h"]


def test_relative_paths_resolve_against_cwd():
    assert absolute("rel/../d.h", "/bgraph/out") == "/bgraph/out/d.h"
    assert absolute("//bgraph/src/a.h", "/bgraph/out") == "/bgraph/src/a.h"  # Linux reads `//` as `/`
    assert absolute("///bgraph/src/a.h", "/") == "/bgraph/src/a.h"
    assert absolute("/bgraph/src/./a.h", "/bgraph/out") == "/bgraph/src/a.h"


# -- which imported compiles a depfile may narrow (depfile.py's contract) ----------------------

import shlex  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402

import pytest  # noqa: E402

from build_graph.depfile import (  # noqa: E402
    CompleteDepfile, Whole, complete_compile, nvcc_dependency_free, precompiled, shell_words, stepped_out_of)

OUT = "/bgraph/out"
NARROWED = ("/bgraph/src", "/bgraph/stage", "/bgraph/ext/torch")
ENV = {"PATH": "/bgraph/toolchain/bin:/usr/bin:/bin"}
# PyTorch's cpp_extension and FlashInfer's JIT write this rule: -MMD, torch's headers through -isystem.
TORCH = ("c++ -MMD -MF ops/m/host.o.d -DTORCH_EXTENSION_NAME=m -isystem /bgraph/ext/torch/include -fPIC "
         "-std=c++17 -O3 -c /bgraph/src/csrc/host.cpp -o ops/m/host.o")
# CMake's Ninja generator, with a quoted define.
CMAKE = ('/usr/bin/g++ -DDEMO_GREETING="\\"hello from demo\\"" -I/bgraph/src/include -isystem /bgraph/src/sys '
         "-O3 -DNDEBUG -std=gnu++17 -fPIC -MD -MT CMakeFiles/d.dir/a.cpp.o -MF CMakeFiles/d.dir/a.cpp.o.d "
         "-o CMakeFiles/d.dir/a.cpp.o -c /bgraph/src/cpp/a.cpp")


def decide(command: str, env=ENV, outputs=("ops/m/host.o",)):
    return complete_compile(command, env, NARROWED, OUT, outputs)


def test_mmd_is_run_as_md_and_nothing_else_changes():
    found = decide(TORCH)
    assert isinstance(found, CompleteDepfile) and found.rewritten and found.depfile == "ops/m/host.o.d"
    assert shlex.split(found.command) == [("-MD" if w == "-MMD" else w) for w in shlex.split(TORCH)] + [
        "-pipe", "-Wa,--MD,ops/m/host.o.d.as.d"]
    assert found.assembler == "ops/m/host.o.d.as.d"
    # Both given: GCC lets -MMD win, whatever the order, so every -MMD goes.
    both = decide(TORCH.replace("-MMD", "-MD -MMD"))
    assert isinstance(both, CompleteDepfile) and "-MMD" not in shlex.split(both.command)


def test_a_complete_command_runs_as_written():
    found = decide(CMAKE, outputs=("CMakeFiles/d.dir/a.cpp.o",))
    # As written, with GNU as asked for its own depfile.
    assembler = "CMakeFiles/d.dir/a.cpp.o.d.as.d"
    assert found == CompleteDepfile(f"{CMAKE} -pipe -Wa,--MD,{assembler}", "CMakeFiles/d.dir/a.cpp.o.d", False,
                                    assembler)
    for extra in ("-include /bgraph/src/pre.h", "-imacros /bgraph/src/m.h", "-idirafter /bgraph/ext/torch/x",
                  "--sysroot=/bgraph/ext/torch", "-iprefix /bgraph/src/ -iwithprefix inc", "-MP", "-Wall -Werror",
                  "-x c++", "-g -gsplit-dwarf", "-march=native"):
        assert isinstance(decide(CMAKE.replace(" -c ", f" {extra} -c "), outputs=()), CompleteDepfile), extra


@pytest.mark.parametrize("command, reason", [
    (TORCH.replace("-MMD ", ""), "no -MD or -MMD"),  # -MF alone: nothing writes it (Ninja's deps = gcc)
    (TORCH.replace("-MMD -MF ops/m/host.o.d ", ""), "0 -MF"),
    (TORCH.replace("-MMD", "-MMD -MF other.d"), "2 -MF"),
    (TORCH.replace("ops/m/host.o.d", "/tmp/host.o.d"), "outside the build directory"),
    (TORCH.replace("ops/m/host.o.d", "../host.o.d"), "outside the build directory"),
    (TORCH.replace("ops/m/host.o.d", "ops/m/host.o"), "one of its outputs"),
    (TORCH.replace("-MMD", "-MM"), "steers"),
    (TORCH.replace("-MMD", "-MMD -Wp,-MMD,x.d"), "steers"),
    (TORCH.replace("-fPIC", "-Xpreprocessor -MMD"), "steers"),
    (TORCH.replace("-fPIC", "@/bgraph/src/flags.rsp"), "response file"),
    (TORCH.replace("-fPIC", "-specs=/bgraph/src/x.specs"), "may read"),
    (TORCH.replace("-fPIC", "-B/bgraph/src/bin"), "may read"),
    (TORCH.replace("-fPIC", "-fplugin=/bgraph/src/p.so"), "may read"),
    (TORCH.replace("-fPIC", "-fprofile-use=/bgraph/src/prof"), "may read"),
    # Profile feedback read from elsewhere than the depfile says (red team R3: a .gcda under -fprofile-dir).
    (TORCH.replace("-fPIC", "-fbranch-probabilities -fprofile-dir=/bgraph/src/prof"), "may read"),
    (TORCH.replace("-fPIC", "-fprofile-dir=/bgraph/src/prof"), "may read"),
    (TORCH.replace("-fPIC", "-fprofile-partial-training"), "may read"),
    (TORCH.replace("-fPIC", "-fauto-profile=/bgraph/src/p.afdo"), "may read"),
    (TORCH.replace("-fPIC", "-fprofile-values"), "may read"),
    # __has_include spelled on the command line: no file read shows the probe.
    (TORCH.replace("-fPIC", "-DHI=__has_include"), "__has_include"),
    (TORCH.replace("-fPIC", "-D P=__has_"), "__has_include"),
    # Clang's integrated assembler names no file inline asm reads.
    (TORCH.replace("c++", "clang++", 1), "integrated assembler"),
    (TORCH.replace("c++", "/usr/bin/clang-17", 1), "integrated assembler"),
    (TORCH.replace("ops/m/host.o.d", "ops/m,x.d"), "comma"),
    (TORCH.replace("-fPIC", "-Wa,-I/bgraph/src"), "may read"),
    (TORCH.replace("-fPIC", "-wrapper /bgraph/src/w"), "may read"),
    (TORCH.replace("-fPIC", "-Q"), "unknown option"),
    (TORCH.replace("csrc/host.cpp", "csrc/host.S"), "not a C or C++ source"),
    (TORCH.replace("-fPIC", "-x assembler-with-cpp"), "not a C or C++ compile"),
    (TORCH + " /bgraph/src/csrc/other.cpp", "2 source"),
    (TORCH.replace("c++", "/bgraph/src/tools/c++", 1), "inside a narrowed input"),
    (TORCH.replace("c++", "/bgraph/out/c++", 1), "inside a narrowed input"),
    (TORCH.replace("c++", "tools/c++", 1), "relative path"),
    (TORCH.replace("c++", "ccache c++", 1), "not a GCC-compatible compiler driver"),
])
def test_commands_not_proven_complete_are_not_narrowed(command, reason):
    found = decide(command)
    assert isinstance(found, Whole) and reason in found.reason, found


def test_shell_commands_and_environments_that_change_what_runs():
    for command in (f"cd /bgraph/out && {TORCH}", f"{TORCH}; cat /bgraph/src/x", f"{TORCH} > log", f"{TORCH} | tee",
                    f"FOO=1 {TORCH}", TORCH.replace("-O3", "$CFLAGS"), TORCH.replace("-O3", "`cat f`"),
                    TORCH.replace("-O3", '"$X"'), TORCH.replace("-O3", "-O3 *.c"), TORCH.replace("-O3", "~/x"),
                    f"{TORCH} # comment", f"{TORCH}\ncat x", TORCH.replace("-O3", "'unterminated")):
        assert shell_words(command) is None, command
        assert isinstance(decide(command), Whole) and not decide(command).compiler
    assert shell_words("a 'b c' \"d\\\"e\" f\\ g x#y") == ["a", "b c", 'd"e', "f g", "x#y"]
    assert decide(TORCH, env={"PATH": "/bgraph/ext/torch/bin:/usr/bin"}).reason.startswith("PATH entry")
    assert "GCC_EXEC_PREFIX" in decide(TORCH, env={**ENV, "GCC_EXEC_PREFIX": "/bgraph/src/"}).reason
    assert isinstance(decide(TORCH.replace("c++", "x86_64-linux-gnu-g++-12", 1)), CompleteDepfile)
    # Red team R10: iconv's modules (-finput-charset), the loader's, a time zone file; GCC's and
    # glibc's documented variables are the whole set (a build's own, PYTHONPATH, are read by none).
    for name, value in (("GCONV_PATH", "/usr/lib/gconv"), ("LD_PRELOAD", "x.so"), ("LD_LIBRARY_PATH", "lib"),
                        ("LD_AUDIT", "a.so"), ("LOCPATH", "/bgraph/src/loc"), ("TZ", ":/bgraph/src/zone"),
                        ("TZDIR", "/bgraph/src/zi"), ("GCC_EXEC_PREFIX", "/bgraph/src/")):
        found = decide(TORCH, env={**ENV, name: value})
        assert isinstance(found, Whole) and name in found.reason, (name, found)
    assert isinstance(decide(TORCH, env={**ENV, "LANG": "C.UTF-8", "TZ": "UTC", "GCC_COLORS": "",
                                         "PYTHONPATH": "/bgraph/ext/torch", "CUDA_HOME": "/bgraph/toolchain"}),
                      CompleteDepfile)
    for driver in ("//bgraph/src/bin/g++", "/proc/self/root/bgraph/src/bin/g++", "/proc/self/cwd/../src/g++"):
        assert "narrowed" in decide(TORCH.replace("c++", driver, 1)).reason, driver
    for path in ("//bgraph/src/bin", "/proc/self/root/usr/bin"):
        assert decide(TORCH, env={"PATH": f"{path}:/usr/bin"}).reason.startswith("PATH entry"), path
    # R11: an absolute driver still finds `as` through PATH.
    absolute_driver = TORCH.replace("c++", "/usr/bin/c++", 1)
    assert isinstance(decide(absolute_driver), CompleteDepfile)
    assert decide(absolute_driver, env={"PATH": "/bgraph/src/bin:/usr/bin"}).reason.startswith("PATH entry")
    # R11: GCC's long spellings of -MMD and -B, and their abbreviations, are no known option.
    for long in ("--write-user-dependencies", "--write-user-dep", "--user-dependencies", "--prefix=/bgraph/src/",
                 "--for-assembler=--MD", "--save-temps"):
        assert isinstance(decide(TORCH.replace("-O3", long)), Whole), long
    assert "one of its outputs" in decide(TORCH, outputs=("ops/m/host.o", "ops/m/host.o.d.as.d")).reason
    assert decide("python3 gen.py -c cfg -o out").compiler is False


def test_nvcc_dependency_options_go_and_host_flags_are_checked():
    args = ["--generate-nonsystem-dependencies-with-compile", "--dependency-output", "k.o.d", "-MT", "k.o",
            "-MD", "-MMD", "-MF", "k.d", "--dependency-output=x.d", "-MP", "-isystem", "/bgraph/ext/torch/include",
            "-c", "/bgraph/out/k.cu", "-o", "k.o", "--compiler-options=-fPIC,-Wall"]
    out, why = nvcc_dependency_free(args, NARROWED)
    assert out == ["-isystem", "/bgraph/ext/torch/include", "-c", "/bgraph/out/k.cu", "--compiler-options=-fPIC,-Wall"]
    assert why is None
    # -MMD reaching the host preprocessor wins over compile_tu's own -MD: the steps are not narrowed.
    assert "-MMD" in nvcc_dependency_free(["-Xcompiler", "-MMD", "-c", "k.cu"], NARROWED)[1]
    assert "-Wp" in nvcc_dependency_free(["-Xcompiler=-fPIC,-Wp,-MD,x", "-c", "k.cu"], NARROWED)[1]
    assert "-MMD" in nvcc_dependency_free(["-Xcompiler", "-MMD -Wall", "-c", "k.cu"], NARROWED)[1]  # R10
    # bgraph's own gcc -E steps are screened as nvcc's dry run gives them (a cuda_library's copts too).
    step = ["gcc", "-D__CUDA_ARCH__=1200", "-E", "-x", "c++", "-D__CUDACC__", "-fPIC", "-O2", "-I/bgraph/src",
            "-isystem", "/bgraph/toolchain/include/cccl", "-include", "cuda_runtime.h", "-m64", "/bgraph/src/k.cu",
            "-o", "/tmp/k.cpp1.ii"]
    assert steered(step) is None
    for bad in ("-MMD", "-MM", "-Wp,-MMD,x.d", "@flags.rsp", "-specs=x", "-fplugin=/bgraph/src/p.so",
                "--write-user-dependencies", "--write-user-dep", "--prefix=/bgraph/src/", "--save-temps"):
        assert steered([*step[:-2], bad, *step[-2:]]), bad
        assert nvcc_dependency_free(["-Xcompiler", bad, "-c", "k.cu"], NARROWED)[1], bad
    assert "host compiler" in nvcc_dependency_free(["-ccbin", "/bgraph/src/bin/g++", "-c", "k.cu"], NARROWED)[1]
    for spelled in ("//bgraph/src/bin/g++", "/proc/self/root/bgraph/src/bin/g++"):  # as the driver's check
        assert "host compiler" in nvcc_dependency_free(["-ccbin", spelled, "-c", "k.cu"], NARROWED)[1], spelled
    assert nvcc_dependency_free(["-ccbin", "/usr/bin/g++", "-c", "k.cu"], NARROWED)[1] is None


def test_precompiled_headers_and_parent_steps():
    assert precompiled(["a.h", "include/x.h.gch"]) == "include/x.h.gch"
    assert precompiled(["pch/x.h.gch/a", "b"]) == "pch/x.h.gch/a"
    assert precompiled(["a.h", "b.cpp"]) is None
    assert stepped_out_of("/bgraph/src/a/b/../c.h", "/bgraph/out") == ["/bgraph/src/a/b"]
    assert stepped_out_of("../src/x.h", "/bgraph/out") == ["/bgraph/out"]
    assert stepped_out_of("/bgraph/src/x.h", "/bgraph/out") == []


@pytest.mark.skipif(shutil.which("gcc") is None, reason="no gcc on this machine")
def test_gcc_md_and_mmd_write_the_same_object_and_only_md_names_system_headers(tmp_path):
    """What the rewrite relies on, with the machine's GCC: -MMD leaves out headers found through
    -isystem and -idirafter (not -include or -imacros), -MD names them, and the objects (with
    debug info) are byte-identical."""
    for rel, text in {"sys/s.h": "#define S 1\n", "after/a.h": "#define A 2\n", "pre/p.h": "#define P 3\n",
                      "pre/m.h": "#define M 4\n",
                      "t.c": "#include <s.h>\n#include <a.h>\nint x = S + A + P + M;\n"}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    flags = ["-g", "-O2", "-isystem", "sys", "-idirafter", "after", "-include", "pre/p.h", "-imacros", "pre/m.h"]
    objects, deps = {}, {}
    for mode in ("-MMD", "-MD"):
        subprocess.run(["gcc", *flags, mode, "-MF", f"{mode}.d", "-c", "t.c", "-o", f"{mode}.o"], cwd=tmp_path,
                       check=True)
        objects[mode] = (tmp_path / f"{mode}.o").read_bytes()
        deps[mode] = parse_depfile((tmp_path / f"{mode}.d").read_text())
    assert objects["-MMD"] == objects["-MD"]
    assert {"pre/p.h", "pre/m.h"} <= set(deps["-MMD"]) and not {"sys/s.h", "after/a.h"} & set(deps["-MMD"])
    assert {"pre/p.h", "pre/m.h", "sys/s.h", "after/a.h"} <= set(deps["-MD"])


def test_the_rebuilder_narrows_only_by_a_depfile_that_proves_something(tmp_path):
    """After the run: a missing, empty or file-less depfile, a path stepping out (`..`) of a
    symbolic link, or one that resolves to no input, output or host path, keeps the whole mount
    in the key ({"*": tree digest})."""
    from build_graph.incremental.discovery import Depfile
    from build_graph.model import Action, Digester, SymlinkEntry, Tree
    from build_graph.rebuilder import Rebuilder
    from build_graph.store.action_cache import LocalActionCache
    from build_graph.store.cas import LocalCas

    digester = Digester()
    cas = LocalCas(tmp_path / "cache", digester)
    rebuilder = Rebuilder(cas, LocalActionCache(cas.base, cas.tmp), digester)
    src = Tree({"a.cpp": cas.put_bytes(b"int a;"), "inc/x.h": cas.put_bytes(b"x"), "other.h": cas.put_bytes(b"o"),
                "link": SymlinkEntry("inc"), "real/y.h": cas.put_bytes(b"y")})
    ext = Tree({"to-src": SymlinkEntry("/bgraph/src/inc")})
    action = Action("compile a.o", "CmakeCompile", argv=("/bin/true",),
                    inputs=(("/bgraph/ext", ext), ("/bgraph/src", src)), host_paths=("/usr",),
                    outputs=("a.o", "a.o.d"), discovery=Depfile(("/bgraph/src",), ("a.o.d",)))
    whole = {"/bgraph/src": {"*": src.digest(digester)}}

    def reads(depfile: str | None):
        out = Tree({"a.o": cas.put_bytes(b"obj"), "gen.h": cas.put_bytes(b"g"), "out-link": SymlinkEntry("/tmp"),
                    **({"a.o.d": cas.put_bytes(depfile.encode())} if depfile is not None else {})})
        return action.discovery.reads(rebuilder.files, action, out)["reads"]

    assert reads("a.o: /bgraph/src/a.cpp /bgraph/src/inc/x.h /usr/include/stdio.h\n") == {
        "/bgraph/src": {"a.cpp": src.entries["a.cpp"].digest, "inc/x.h": src.entries["inc/x.h"].digest}}
    assert reads("a.o: /bgraph/src/a.cpp /bgraph/src/real/../other.h\n")["/bgraph/src"]["other.h"]
    for proves_nothing in (None, "", "a.o:\n", "# nothing\n"):
        assert reads(proves_nothing) == whole, proves_nothing
    # /bgraph/src/link/../other.h is inc/../other.h: not /bgraph/src/other.h.
    assert reads("a.o: /bgraph/src/a.cpp /bgraph/src/link/../other.h\n") == whole
    # Red team R10: each path as the kernel resolves it. `//` is `/`; a link of another mount into
    # the narrowed one names the file it leads to; a file this run wrote (no link on the way) and
    # a host path are no input's; /proc's aliases, /tmp and names no mount holds cannot be told.
    x = {"inc/x.h": src.entries["inc/x.h"].digest}
    assert reads("a.o: //bgraph/src/inc/x.h\n") == {"/bgraph/src": x}
    assert reads("a.o: /bgraph/ext/to-src/x.h\n") == {"/bgraph/src": x}
    assert reads("a.o: /bgraph/src/inc/x.h /bgraph/out/gen.h /usr/include/stdio.h\n") == {"/bgraph/src": x}
    for alias in ("/proc/self/root/bgraph/src/inc/x.h", "/proc/self/cwd/../src/inc/x.h", "/tmp/l/x.h",
                  "/bgraph/out/out-link/x.h", "/bgraph/src/inc/missing.h", "/bgraph/nowhere/x.h",
                  "/usr/../proc/self/cwd/../src/inc/x.h", "/usr/lib/../../bgraph/src/inc/x.h"):
        assert reads(f"a.o: /bgraph/src/inc/x.h {alias}\n") == whole, alias


def _discovery_case(tmp_path, src: dict, ext: dict, depfile: str):
    """(rebuilder, an action narrowed by depfile over /bgraph/src, with /bgraph/ext/e whole, the
    manifest entry of its run whose depfile says `depfile`, a maker of the same action over new trees)."""
    from build_graph.incremental.discovery import Depfile
    from build_graph.model import Action, Digester, SymlinkEntry, Tree
    from build_graph.rebuilder import Rebuilder
    from build_graph.store.action_cache import LocalActionCache
    from build_graph.store.cas import LocalCas

    digester = Digester()
    cas = LocalCas(tmp_path / "cache", digester)
    rebuilder = Rebuilder(cas, LocalActionCache(cas.base, cas.tmp), digester)

    def tree(files: dict) -> Tree:
        return Tree({p: SymlinkEntry(v[1:]) if v.startswith("@") else cas.put_bytes(v.encode()) for p, v in files.items()})

    def action(src_files: dict, ext_files: dict = ext) -> Action:
        return Action("compile a.o", "CmakeCompile", argv=("/bin/true",),
                      inputs=(("/bgraph/ext/e", tree(ext_files)), ("/bgraph/src", tree(src_files))),
                      outputs=("a.o", "a.o.d"), discovery=Depfile(("/bgraph/src",), ("a.o.d",)))

    first = action(src)
    out = Tree({"a.o": cas.put_bytes(b"obj"), "a.o.d": cas.put_bytes(depfile.encode())})
    return rebuilder, first, first.discovery.reads(rebuilder.files, first, out), action


def test_a_new_file_shadowing_one_read_from_another_mount_makes_the_entry_stale(tmp_path):
    """x.h was found in a mount that is not narrowed (-I src/inc comes first but held no x.h): a
    file of that name appearing in the narrowed mount may be what the next run finds (red team)."""
    rebuilder, first, entry, action = _discovery_case(
        tmp_path, {"a.cpp": '#include "x.h"', "inc/keep.h": ""}, {"inc/x.h": "#define X 1"},
        "a.o: /bgraph/src/a.cpp /bgraph/ext/e/inc/x.h\n")
    assert first.discovery.differences(rebuilder.files, first, entry) == ([], [])
    unrelated = action({"a.cpp": '#include "x.h"', "inc/keep.h": "", "notes.txt": "x"})
    assert first.discovery.differences(rebuilder.files, unrelated, entry) == ([], [])
    shadow = action({"a.cpp": '#include "x.h"', "inc/keep.h": "", "inc/x.h": "#define X 2"})
    changed, other = first.discovery.differences(rebuilder.files, shadow, entry)
    assert any("may shadow an included x.h" in o for o in other), other


def test_a_directory_link_that_redirects_an_include_makes_the_entry_stale(tmp_path):
    """`#include "sub/y.h"` found at inc/sub/y.h; a link inc2/sub -> ../other (with -I inc2 first)
    would make the same #include read other/y.h: no file name changes, a directory's does."""
    rebuilder, first, entry, action = _discovery_case(
        tmp_path, {"a.cpp": '#include "sub/y.h"', "inc/sub/y.h": "1", "other/y.h": "2"}, {},
        "a.o: /bgraph/src/a.cpp /bgraph/src/inc/sub/y.h\n")
    linked = action({"a.cpp": '#include "sub/y.h"', "inc/sub/y.h": "1", "other/y.h": "2", "inc2/sub": "@../other"})
    changed, other = first.discovery.differences(rebuilder.files, linked, entry)
    assert any("inc2/sub" in o for o in other), other


def test_has_include_of_an_absent_file_and_incbin_are_looked_after(tmp_path):
    """A header read asks `__has_include("opt.h")` (directly, or through a wrapper macro another
    header defines, as CCCL's _CCCL_HAS_INCLUDE): opt.h appearing makes the entry stale. A file
    read that holds an assembler .incbin (whose file no depfile names) keeps the mount whole."""
    rebuilder, first, entry, action = _discovery_case(
        tmp_path, {"a.cpp": '#include "w.h"\n#if MY_HAS(<opt.h>)\n#endif\n', "w.h": ""},
        {"inc/def.h": "#define MY_HAS(_X) __has_include(_X)\n#if __has_include(\"cfg/lit.h\")\n#endif\n"},
        "a.o: /bgraph/src/a.cpp /bgraph/src/w.h /bgraph/ext/e/inc/def.h\n")
    assert entry["reads"]["/bgraph/src"].keys() == {"a.cpp", "w.h"}  # still narrowed
    for added in ("opt.h", "cfg/lit.h"):
        files = {"a.cpp": '#include "w.h"\n#if MY_HAS(<opt.h>)\n#endif\n', "w.h": "", added: ""}
        _changed, other = first.discovery.differences(rebuilder.files, action(files), entry)
        assert any("may shadow" in o for o in other), (added, other)
    _r, _f, incbin, _a = _discovery_case(tmp_path / "b", {"a.cpp": 'asm(".incbin \\"blob.bin\\"");', "blob.bin": "x"},
                                         {}, "a.o: /bgraph/src/a.cpp\n")
    assert list(incbin["reads"]["/bgraph/src"]) == ["*"]


@pytest.mark.skipif(shutil.which("gcc") is None or shutil.which("as") is None, reason="no gcc or GNU as")
def test_gcc_and_gnu_as_depfiles_name_every_file_read_as_it_is_named(tmp_path):
    """With the machine's gcc and GNU as, the command complete_compile returns: GCC's depfile
    names the headers, as's (`-Wa,--MD`) the files inline asm `.include`s and `.incbin`s (in any
    case, split over strings), and both parse to the names on disk, whatever the name holds (a
    blank, `#`, `$`, a backslash, one before a blank). The object is the bytes a run without
    `-pipe -Wa,--MD` writes (with debug info)."""
    odd = ["sp ace.h", "ha#sh.h", "dol$ar.h", "a\\b.h", "ab.h", "bs\\ sp.h", "bs\\\\ sp2.h", "co:lon.h", "bs\\#h.h"]
    for name in odd:
        (tmp_path / name).write_text("")
    (tmp_path / "data.s").write_text(".byte 1\n")
    (tmp_path / "blob.bin").write_text("AAAA")
    (tmp_path / "blob 2.bin").write_text("BBBB")
    c_string = lambda name: name.replace("\\", "\\\\").replace('"', '\\"')  # noqa: E731
    source = "".join(f'#include "{n}"\n' for n in odd) + (  # an #include's name has no escapes
        '__asm__(".section .rodata\\n.include \\"data.s\\"\\n.INCBIN \\"blob.bin\\"\\n'
        '.inc" "bin \\"blob 2.bin\\"\\n' + "".join(f'.incbin \\"{c_string(c_string(n))}\\"\\n' for n in odd) +
        '.text");\nint x;\n')
    (tmp_path / "t.c").write_text(source)
    found = complete_compile("gcc -MMD -MF t.o.d -g -O1 -c t.c -o t.o", {"PATH": "/usr/bin:/bin"}, (), str(tmp_path))
    assert isinstance(found, CompleteDepfile) and found.assembler == "t.o.d.as.d"
    subprocess.run(found.command, shell=True, cwd=tmp_path, check=True)
    on_disk = set(odd)
    assert on_disk <= set(parse_depfile((tmp_path / "t.o.d").read_text()))
    by_as = set(parse_depfile((tmp_path / found.assembler).read_text(), hash_escaped=False))
    assert on_disk | {"data.s", "blob.bin", "blob 2.bin"} <= by_as, by_as
    assert not any(name.startswith("/tmp/") for name in by_as)  # no temporary .s: the same bytes each run
    plain = (tmp_path / "t.o").read_bytes()
    subprocess.run(["gcc", "-MD", "-MF", "u.d", "-g", "-O1", "-c", "t.c", "-o", "t.o"], cwd=tmp_path, check=True)
    assert (tmp_path / "t.o").read_bytes() == plain


def test_has_include_probes_split_by_comments_or_splices_are_read_and_other_uses_are_opaque():
    """Red team R3: a comment before `(`, a backslash-newline inside the word, an alias
    (`#define HI __has_include`), a paste. Testing for the operator itself is no probe."""
    from build_graph.incremental.discovery import _lookups

    def probe(text: str):
        found = _lookups(text.encode(), frozenset())
        return "opaque" if found.opaque else sorted(found.names)

    assert probe('#if __has_include /* c */ ("new.h")\n#endif\n') == ["new.h"]
    assert probe('#if __has_include // c\n#endif\n') == "opaque"
    assert probe('#if __has_inc\\\nlude("new.h")\n#endif\n') == ["new.h"]
    assert probe('#if __has_include(\\\n"sub/new.h")\n#endif\n') == ["new.h", "sub"]
    assert probe('#define HI __has_include\n#if HI("new.h")\n#endif\n') == "opaque"
    assert probe('#define HI __has_include_next\n') == "opaque"
    assert probe('#if __has_include(H)\n#endif\n') == "opaque"  # a computed operand
    assert probe('#define C(a, b) a##b\n#if C(__has_, include)("new.h")\n#endif\n') == "opaque"
    assert probe('#define C(a, b) a##b\n#if C(_, _has_include)("new.h")\n#endif\n') == "opaque"
    assert probe('#define C(a, b) a##b\nint C(x, y);\n') == []
    assert probe('// __has_include(x) in a comment\n"/* in a string */"; __has_include("q.h")\n') == ["q.h"]
    assert probe('#ifdef __has_include\n#if defined(__has_include) && __has_include(<a.h>)\n#endif\n'
                 '#endif // __has_include\n') == ["a.h"]
    assert probe('const char* s = R"(/*)"; __has_include("q.h") /**/\n') == ["q.h"]  # a raw string: not lexed


def test_an_assembler_depfile_names_what_inline_asm_reads(tmp_path):
    """With GNU as's depfile (`assembler`), a file read holding `.incbin` no longer takes the mount
    whole: the blob it names is a read (an edit to it is a change); a name no mount holds (a
    `.file` directive's) or its temporary .s is no read; a missing as depfile takes the mount whole."""
    from build_graph.incremental.discovery import Depfile
    from build_graph.model import Action, Digester, Tree
    from build_graph.rebuilder import Rebuilder
    from build_graph.store.action_cache import LocalActionCache
    from build_graph.store.cas import LocalCas

    digester = Digester()
    cas = LocalCas(tmp_path / "cache", digester)
    rebuilder = Rebuilder(cas, LocalActionCache(cas.base, cas.tmp), digester)
    src = Tree({"a.c": cas.put_bytes(b'asm(".incbin \\"/bgraph/src/blob.bin\\"");'), "blob.bin": cas.put_bytes(b"x"),
                "other.h": cas.put_bytes(b"o")})
    action = Action("compile a.o", "CmakeCompile", argv=("/bin/true",), inputs=(("/bgraph/src", src),),
                    outputs=("a.o", "a.o.d", "a.o.d.as.d"),
                    discovery=Depfile(("/bgraph/src",), ("a.o.d",), assembler=("a.o.d.as.d",)))
    assert action.discovery.described()["assembler_depfiles"] == ["a.o.d.as.d"]

    def reads(by_as: str | None):
        out = {"a.o": cas.put_bytes(b"obj"), "a.o.d": cas.put_bytes(b"a.o: /bgraph/src/a.c\n")}
        if by_as is not None:
            out["a.o.d.as.d"] = cas.put_bytes(by_as.encode())
        return action.discovery.reads(rebuilder.files, action, Tree(out))["reads"]["/bgraph/src"]

    assert reads("a.o: /bgraph/src/blob.bin a.c /bgraph/src/gen.y /tmp/ccX1.s\n") == {
        "a.c": src.entries["a.c"].digest, "blob.bin": src.entries["blob.bin"].digest}
    assert reads(None) == reads("") == {"*": src.digest(digester)}
    # R11: a name is resolved before it is taken for a `.file` one: through /proc it is no one's.
    assert reads("a.o: /proc/self/cwd/../src/blob.bin a.c\n") == {"*": src.digest(digester)}
    # Without an assembler depfile, the .incbin keeps the mount whole, as before.
    plain = Depfile(("/bgraph/src",), ("a.o.d",))
    out = Tree({"a.o": cas.put_bytes(b"obj"), "a.o.d": cas.put_bytes(b"a.o: /bgraph/src/a.c\n")})
    assert plain.reads(rebuilder.files, action, out)["reads"]["/bgraph/src"] == {"*": src.digest(digester)}


def test_an_import_directive_however_spelled_makes_the_file_opaque():
    """GCC skips a later file with the bytes of one `#import`ed and names no such file (R8): a file
    holding the directive keeps its mount whole, in every spelling the preprocessor reads as one
    (comments after `#`, line splices, `%:`, the `??=` trigraph under -trigraphs), never in a comment
    or as part of a longer word."""
    from build_graph.incremental.discovery import _lookups

    for text in (b"#import <a.h>\n", b"# /*x*/ import <a.h>\n", b"#im\\\nport <a.h>\n", b"%:import \"a.h\"\n",
                 b"#\\\n import <a.h>\n", b"??=import <a.h>\n", b"#i??/\nmport <a.h>\n"):
        assert _lookups(text, frozenset()).opaque, text
    for text in (b"// #import <a.h>\n", b"/* #import */\n", b"#importx\n", b"int important;\n"):
        assert not _lookups(text, frozenset()).opaque, text
