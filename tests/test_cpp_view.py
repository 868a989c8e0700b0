"""cpp_view: which edits a preprocessing run cannot see, checked against GCC itself."""

from __future__ import annotations

import random
import shutil
import subprocess
from pathlib import Path

import pytest

from build_graph.cpp_view import command_macros, defined_names, view

DEVICE_1200 = ["gcc", "-std=c++17", "-D__CUDA_ARCH__=1200", "-D__CUDA_ARCH_FEAT_SM120_ALL",
               "-D__CUDA_ARCH_LIST__=1200,1210", "-E", "-x", "c++", "-D__CUDACC_VER_MAJOR__=13"]
HOST = ["gcc", "-std=c++17", "-D__CUDA_ARCH_LIST__=1200,1210", "-E", "-x", "c++", "-D__CUDACC__"]

HEADER = b"""#pragma once
namespace bench {
#if __CUDA_ARCH__ == 1210
// sm_121a tuning
constexpr float kArchScale = 2.0f;
#else
constexpr float kArchScale = 1.0f;
#endif
}
"""


def _edited(text: bytes, old: bytes, new: bytes) -> bytes:
    assert old in text
    return text.replace(old, new)


def test_an_edit_in_a_group_the_arch_skips_is_unseen():
    edited = _edited(HEADER, b"2.0f", b"3.0f")
    for argv in (DEVICE_1200, HOST):
        macros = command_macros(argv)
        assert view(HEADER, macros) is not None
        assert view(HEADER, macros) == view(edited, macros)
    sm121 = command_macros(["gcc", "-D__CUDA_ARCH__=1210", "-E"])
    assert view(HEADER, sm121) != view(edited, sm121)


def test_an_edit_in_the_taken_group_is_seen():
    edited = _edited(HEADER, b"1.0f", b"1.5f")
    macros = command_macros(DEVICE_1200)
    assert view(HEADER, macros) != view(edited, macros)


def test_a_changed_line_count_is_seen():
    edited = _edited(HEADER, b"2.0f;\n", b"2.0f;\nconstexpr int kExtra = 1;\n")
    macros = command_macros(DEVICE_1200)
    assert view(HEADER, macros) != view(edited, macros)


@pytest.mark.parametrize("condition, skipped_at_1200", [
    ("__CUDA_ARCH__ >= 1000 && __CUDA_ARCH__ < 1200", True),
    ("defined(__CUDA_ARCH__) && (__CUDA_ARCH__ / 10) % 10 == 1", True),
    ("!defined(__CUDA_ARCH__)", True),
    ("0", True),
    ("defined(SOME_FLAG) && __CUDA_ARCH__ == 900", True),  # false whatever SOME_FLAG is
    ("SOME_FLAG && __CUDA_ARCH__ == 900", None),  # SOME_FLAG could expand to `1 ||`
    ("__CUDACC_VER_MAJOR__ >= 13", False),
    ("defined(__CUDA_ARCH_FEAT_SM121_ALL)", True),  # a __CUDA_ARCH* name the command line leaves out
    ("__CUDA_ARCH_LIST__ > 0", None),  # not an integer on the command line
    ("__has_include(<cuda.h>)", None),
])
def test_conditions(condition, skipped_at_1200):
    text = f"#if {condition}\nint x = 1;\n#endif\n".encode()
    edited = text.replace(b"1;", b"2;")
    macros = command_macros(DEVICE_1200)
    assert view(text, macros) is not None
    assert (view(text, macros) == view(edited, macros)) is bool(skipped_at_1200)


@pytest.mark.parametrize("text", [
    b"#define __CUDA_ARCH__ 1210\n#if __CUDA_ARCH__ == 1210\nint x;\n#endif\n",
    b"# /* c */ undef __CUDA_ARCH__\n",
    b"#def\\\nine __CUDA_ARCH__ 1\n",  # a splice inside the directive's name
    b"const char *s = R\"(\n#endif\n)\";\n",
    b"#if 0\n??/\n#endif\n",
    b"%:if 0\nint x;\n%:endif\n",
    b"\xef\xbb\xbf#if 0\n#endif\n",
    b"#if 0\r\n#endif\r\n",
    b"#if 0\nint x = 1'000;\n#endif\n",
    b"#if 0\n#else\n#else\n#endif\n",
    b"#if 0\n",
    b"#endif\n",
    b"/* a\n*/ #if 0\nint x;\n#endif\n",
    b"#include <a/*b.h>\n",
    # red-team read K8: each of these made an edit GCC compiles look skipped
    b"#if __CUDA_ARCH__ == 1210 /* c\n */ || 1\nint x;\n#endif\n",  # the comment joins the next line
    b"# /*\n*/ endif\n",
    b"#if __has_include(<x\".h>) /*\n*/\n#endif\n",
    b"#if 0\n#\0endif\nint x;\n#endif\n",  # GCC reads NUL as a blank
])
def test_what_is_not_modelled_is_refused(text):
    assert view(text, command_macros(DEVICE_1200)) is None


def test_command_lines_it_does_not_model():
    assert command_macros(["gcc", "-E", "-traditional-cpp"]) is None
    assert command_macros(["gcc", "-E", "@args.rsp"]) is None
    assert command_macros(["gcc", "-E", "-Wp,-DX=1"]) is None
    assert command_macros(["gcc", "-E", "-x", "assembler-with-cpp"]) is None
    m = command_macros(["gcc", "-D", "A=3", "-DB", "-DC=0x10", "-UA", "-DD=x", "-DE=1", "-UE", "-DE=2"])
    assert m.lookup("B") == 1 and m.lookup("C") == 16 and m.lookup("E") == 2
    assert m.lookup("D") is None and m.lookup("A") is not None and m.lookup("__CUDA_ARCH__") is not None
    assert m.without({"B"}).lookup("B") is None


def test_a_literal_above_int64_is_of_unknown_value():
    """0xFFFFFFFFFFFFFFFF is unsigned in GCC (== -1 holds): its group is never taken as skipped."""
    text = b"#if 0xFFFFFFFFFFFFFFFF == -1\nint x;\n#endif\n"
    assert view(text, command_macros(DEVICE_1200)) == text


def test_a_function_like_define_defines_its_name():
    """-D'__CUDA_ARCH_CHECK(v)=v' defines __CUDA_ARCH_CHECK: `#ifdef` takes that group (it was
    taken as a never-predefined, so undefined, name and its group as skipped)."""
    macros = command_macros([*DEVICE_1200, "-D__CUDA_ARCH_CHECK(v)=v"])
    text = b"#ifdef __CUDA_ARCH_CHECK\nint x;\n#endif\n"
    assert macros.lookup("__CUDA_ARCH_CHECK") is None
    assert view(text, macros) is None or view(text, macros) == text


def test_defined_names_is_a_superset():
    text = b"#define A 1\n# /**/ undef B\n#if 0\n#define C\n#endif\n// #define D\n#def\\\nine E\n#ifdef F\n"
    assert defined_names(text) == {"A", "B", "C", "D", "E"}


# -- against GCC ---------------------------------------------------------------------------------
# Random headers and random edits: whenever two versions have equal views, GCC's preprocessed
# output and depfile must be equal too (the converse need not hold: refusing is always allowed).

CONDITIONS = ["__CUDA_ARCH__ == 1210", "__CUDA_ARCH__ == 1200", "__CUDA_ARCH__ >= 1000", "!defined(__CUDA_ARCH__)",
              "defined(__CUDA_ARCH__)", "0", "1", "FLAG", "defined(FLAG)", "FLAG && __CUDA_ARCH__ == 1210",
              "defined(FLAG) || __CUDA_ARCH__ < 1200", "__CUDACC_VER_MAJOR__ > 12", "ZERO_OR_ONE",
              "(__CUDA_ARCH__ - 1000) / 100 == 2", "__CUDA_ARCH__ == 1210 ? 1 : 0"]
LINES = ["int a{n} = {n};", "// comment {n}", "/* block {n} */ int b{n};", "/* open {n}\n  still {n}\nclose */ int c{n};",
         "const char *s{n} = \"/* not a comment\";", "char q{n} = '\"';", "don't {n}", "#define FLAG {n}",
         "#undef FLAG", "#include \"inc{k}.h\"", "#error stop {n}", "#pragma message(\"x{n}\")", "int d{n} = __LINE__;",
         "int e{n} = 1 + \\\n   2;", "", "#define ZERO_OR_ONE {k}", "x{n} // y \\\n z{n}", "int f{n} = '\\'';",
         "#warning w{n}", "#line {n}", "  # /* x */ define G{n}", "#if 0 /* {n} */\n#endif"]
# What a mutation may put in: any line, also ones that break the structure (they must be refused or seen).
NOISE = ["#endif", "#else", "/* open", "close */", "#if 0", "#elif __CUDA_ARCH__ == 1200", "x \\", "'", "\""]


def _random_file(rng: random.Random) -> list[str]:
    out, depth = [], 0
    for n in range(rng.randint(3, 25)):
        r = rng.random()
        if r < 0.2:
            out.append(f"#if {rng.choice(CONDITIONS)}")
            depth += 1
        elif r < 0.3 and depth:
            out.append(rng.choice(["#else", f"#elif {rng.choice(CONDITIONS)}"]))
            if out[-1] == "#else":
                out += [rng.choice(LINES).format(n=n, k=rng.randint(0, 1)), "#endif"]
                depth -= 1
        elif r < 0.4 and depth:
            out.append("#endif")
            depth -= 1
        else:
            out.append(rng.choice(LINES).format(n=n, k=rng.randint(0, 1)))
    return "\n".join(out + ["#endif"] * depth).split("\n")


def _mutate(rng: random.Random, lines: list[str]) -> list[str]:
    lines = list(lines)
    for _ in range(rng.randint(1, 2)):
        i = rng.randrange(len(lines))
        r = rng.random()
        if r < 0.6:
            lines[i] = rng.choice(LINES).format(n=rng.randint(0, 99), k=rng.randint(0, 1)).split("\n")[0]
        elif r < 0.7:
            lines[i] = rng.choice(NOISE)
        elif r < 0.8:
            lines[i] = lines[i] + rng.choice([" /* tail", " // tail", " \\", " 'x"])
        elif r < 0.9:
            lines.insert(i, rng.choice(LINES).format(n=7, k=0))
        else:
            lines[i] = lines[i].replace("1210", "1200").replace("==", "!=")
    return lines


def _gcc(argv: list[str], work: Path, text: bytes) -> tuple[int, bytes, bytes]:
    (work / "h.h").write_bytes(text)
    p = subprocess.run([*argv, "-DFLAG_CMDLINE", "-MD", "-MF", "d.d", "main.cc", "-o", "out.ii"],
                       cwd=work, capture_output=True)
    if p.returncode:
        return p.returncode, b"", b""
    return 0, (work / "out.ii").read_bytes(), (work / "d.d").read_bytes()


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
@pytest.mark.parametrize("seed", range(3))
def test_equal_views_mean_equal_gcc_output(tmp_path, seed):
    rng = random.Random(seed)
    (tmp_path / "main.cc").write_text('#include "h.h"\nint tail = __LINE__;\n')
    for k in (0, 1):
        (tmp_path / f"inc{k}.h").write_text(f"int included{k};\n")
    compared = 0
    for _ in range(400):
        before = "\n".join(_random_file(rng)).encode() + b"\n"
        after = "\n".join(_mutate(rng, before.decode().split("\n")[:-1])).encode() + b"\n"
        argv = rng.choice([DEVICE_1200, HOST, [*DEVICE_1200[:2], "-D__CUDA_ARCH__=1210", *DEVICE_1200[3:]]])
        macros = command_macros(argv)
        a, b = view(before, macros), view(after, macros)
        if a is None or b is None or a != b or before == after:
            continue
        compared += 1
        first, second = _gcc(argv, tmp_path, before), _gcc(argv, tmp_path, after)
        assert first == second, f"views equal, GCC output differs:\n--- before\n{before.decode()}\n--- after\n" \
                                f"{after.decode()}\n--- argv {argv}"
    assert compared >= 10  # the generator does reach edits that views hide
