"""Depfiles: reading them, and deciding when one may narrow an action's inputs.

Reading: Make-syntax dependency files (`gcc -MD -MF`, `nvcc -MD -MF`, GNU `as --MD`): the files
a compile read. No maintained Python package reads this format, and it is small: rules
`target: dep dep \\` with backslash-newline continuations, `\\ ` for a space in a name (the
backslashes right before it doubled), `\\#` for `#` (GCC only) and `$$` for `$`; every other
backslash is part of the name, as GCC writes it (mkdeps.cc) and Ninja reads it.

Deciding (input discovery for imported commands, ARCHITECTURE.md invariant 7). The rebuilder
files an action whose strategy is `incremental/discovery.Depfile` under the files its depfile
names in the narrowed mounts: an edit to any other file of those mounts is a hit. That is sound
only if the depfile names **every** file of the narrowed mounts that the run could have read.
bgraph's own preprocessing steps (nvcc_compile.py) append `-MD -MF` themselves. A command a
project wrote (an imported Ninja edge: CMake's, PyTorch's cpp_extension's, FlashInfer's JIT
build.ninja) is not trusted as written: `-MMD` (and `-MM`, nvcc's
`--generate-nonsystem-dependencies[-with-compile]`) leaves out every header found in a system
directory, and a header reached through `-isystem /bgraph/ext/torch/include` (or `-idirafter`,
`--sysroot`, `-isysroot`, `-iprefix`/`-iwithprefix`) is such a header: an edit to it was a cache
hit.

The decision, `complete_compile(command)`, either returns the command rewritten to a form whose
depfile is complete (rules/ninja_import.py then plans it with a `Depfile` strategy), or says why
it cannot (`Whole`): that edge is then keyed on every input it can read (its whole mounts),
never narrowed. Its soundness contract:

1. The command is one simple shell command (no operator, redirection, expansion, glob, comment
   or assignment): what runs is exactly the words it names, and nothing else.
2. Its first word is a GCC driver (gcc, g++, cc, c++, with a target prefix or version suffix;
   not clang, whose integrated assembler writes no depfile; a `cc` that is clang fails on
   `-Wa,--MD`, loudly) that lies outside every narrowed mount (found by PATH: every PATH
   entry outside them too), and no environment variable redirects the driver's programs or its
   dependency output (GCC_EXEC_PREFIX, COMPILER_PATH, DEPENDENCIES_OUTPUT, SUNPRO_DEPENDENCIES,
   CCC_OVERRIDE_OPTIONS, GCC_COMPARE_DEBUG).
3. Every argument is one the allowlist below knows, and none of them makes the compiler read a
   file its depfile leaves out: no response file (`@file`), `-specs`, `-B`, `-wrapper`, plugin,
   profile, sanitizer list or module file, no `-Wp,`/`-Xpreprocessor` (they reach the
   preprocessor's own -M options), no assembler source, no `-Wa,` of its own, no -D value that
   could spell `__has_include` (`-DHI=__has_include`). Exactly one `-c`, one `-o`, one source,
   one `-MF`, and `-MD` or `-MMD`.
4. Every `-MMD` becomes `-MD` (with GCC 12, when both are given, -MMD wins, whatever the
   order). With -MD the depfile names every file the preprocessor opened: the source, every
   header (system ones too), `-include` and `-imacros` files. -MD and -MMD change only the
   depfile: the object is the same bytes (GCC 12's DWARF producer string leaves -M options out;
   `tests/test_depfile.py` compiles both ways and compares).
5. The depfile is the `-MF` file, inside the build directory and not one of the edge's outputs.
   The assembler's is `<-MF file>.as.d`: `-pipe -Wa,--MD,<it>` is added to the command, so GNU
   as (the driver's assembler) names every file it read, `.include`s and `.incbin`s of inline asm
   too, which GCC's depfile never names (a name it lists that no mount holds is a `.file`
   directive's: not read; -pipe leaves out the temporary .s, whose random name would make the
   output differ between runs). Neither changes the object's bytes (tests/test_depfile.py).
   After the run the rebuilder refuses to narrow by a depfile (either) that is missing, not a
   regular file, or names no file, and by a path that steps out (`..`) of a symbolic link.
6. No narrowed input holds a precompiled header (`*.gch`, `*.pch`): GCC reads `x.h.gch` in
   place of `x.h` when it finds one, and its depfile then names neither (`precompiled`,
   checked by the importer, which knows the trees).

What a depfile cannot name is looked after by the rebuilder (incremental/discovery.py), as for
bgraph's own `-MD` steps: every name on a path read, and every name `__has_include` asks for
(directly or through a wrapper macro), is recorded for each narrowed mount, present or not, so a
file, directory or link of that name appearing anywhere there makes the entry stale; a file read
with a `__has_include` of a computed name, or one that is no plain probe (an alias
`#define HI __has_include`, a paste), keeps the mount whole. Three things the preprocessor needs
and no depfile names are kept too (red team R7): a file with the bytes of a header it read
(GCC skips a header whose size, time and bytes equal a once-only header's, `#pragma once` or
`#import`, without naming it; in the sandbox every input has one time), the operand of
`#pragma GCC dependency` (a name looked for), and whether each -I/-isystem/-iquote/-idirafter
directory of the command is a directory (one missing or a file is a warning, an error under
-Werror).

nvcc compiles are not run as written: `compile_tu` decomposes them into nvcc's own steps and
appends its own `-MD` to each preprocessing step. `nvcc_dependency_free(args)` removes nvcc's
dependency options, and says why the steps' depfiles could still be incomplete (a host compiler
inside a narrowed mount; `-Xcompiler` flags from the list of point 3, `-MMD` among them): such a
compile is decomposed all the same, with no mount narrowed.
"""

from __future__ import annotations

import posixpath
import re
import shlex
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

def _names(rest: str, hash_escaped: bool) -> list[str]:
    """The file names of one rule's prerequisite list (continuations already joined), unescaped
    as GCC's mkdeps.cc escapes them (`munge`): a space or tab is preceded by a backslash, and
    every backslash right before it is doubled; `#` is written `\\#` (only where `hash_escaped`:
    GNU as's `--MD` writes `#` as it is); `$` is written `$$`. Every other backslash is literal
    (`a\\b.h` names a\\b.h). Ninja's depfile parser reads them the same way."""
    if "\\" not in rest:
        # Blanks are spaces and tabs alone (str.split() would also split at U+2028, \x0c, ...).
        return [w.replace("$$", "$") if "$$" in w else w for w in rest.replace("\t", " ").split(" ") if w]
    names: list[str] = []
    cur: list[str] = []
    started = False
    i, n = 0, len(rest)
    while i < n:
        c = rest[i]
        if c == "\\":
            j = i
            while j < n and rest[j] == "\\":
                j += 1
            run, after = j - i, rest[j] if j < n else ""
            if after in (" ", "\t"):
                cur.append("\\" * (run // 2))
                if run % 2:  # 2N+1 backslashes and a blank: N backslashes and the blank, in the name
                    cur.append(after)
                else:  # 2N backslashes and a blank: N backslashes ending the name
                    names.append("".join(cur))
                    cur, started = [], False
                    i = j + 1
                    continue
                started, i = True, j + 1
                continue
            if after == "#" and hash_escaped:
                cur.append("\\" * (run - 1) + "#")
                started, i = True, j + 1
                continue
            cur.append("\\" * run)  # literal backslashes
            started, i = True, j
            continue
        if c in " \t":
            if started:
                names.append("".join(cur))
                cur, started = [], False
        elif c == "$" and rest.startswith("$$", i):
            cur.append("$")
            started, i = True, i + 1
        else:
            cur.append(c)
            started = True
        i += 1
    if started:
        names.append("".join(cur))
    return names


def parse_depfile(text: str, hash_escaped: bool = True) -> list[str]:
    """The prerequisites of every rule in `text`, in order, without duplicates. `hash_escaped`:
    GCC's depfiles (`#` written `\\#`); False for GNU as's `--MD` ones (`#` written as it is)."""
    joined = re.sub(r"\\\r?\n", " ", text)
    deps: list[str] = []
    seen: set[str] = set()
    # Lines end at "\n" alone (and its "\r"), as Make and Ninja read them: str.splitlines also
    # breaks at U+2028, form feeds and \x1c-\x1e, which a file name may hold (red team R10).
    for line in (raw.removesuffix("\r") for raw in joined.split("\n")):
        # The target ends at the first unescaped ':' followed by whitespace or end of line.
        m = re.search(r"(?<!\\):(?:\s|$)", line)
        if not m:
            continue
        for name in _names(line[m.end():], hash_escaped):
            if name not in seen:
                seen.add(name)
                deps.append(name)
    return deps


def absolute(path: str, cwd: str) -> str:
    """A depfile path as an absolute, normalised sandbox path (relative ones are against cwd)."""
    return sandbox_path(path if path.startswith("/") else posixpath.join(cwd, path))


def sandbox_path(path: str) -> str:
    """posixpath.normpath, and a leading `//` made `/` (POSIX leaves its meaning to the system:
    Linux reads it as `/`, and normpath keeps it, so `//bgraph/src/x.h` looked like no mount's;
    CMake writes one joining an empty variable, red team R10)."""
    norm = posixpath.normpath(path)
    return norm[1:] if norm.startswith("//") else norm


def _may_lie_in(path: str, roots: Iterable[str]) -> bool:
    """Whether the absolute `path` (a compiler, a PATH entry) lies in one of `roots` however it is
    spelled (`//root/...`), or reaches the sandbox's files through /proc (`/proc/self/root`,
    `/proc/self/cwd`, a descriptor), where what it names cannot be told from its spelling."""
    norm = sandbox_path(path)
    return _inside(norm, roots) or norm in ("/proc", "/dev/fd") or norm.startswith(("/proc/", "/dev/fd/"))


def stepped_out_of(path: str, cwd: str) -> list[str]:
    """The directories (absolute, normalised) that a `..` of `path` steps out of. Where one of
    them is, or lies below, a symbolic link, `absolute(path)` is not the file that was read."""
    if ".." not in path:
        return []
    parts = (path if path.startswith("/") else f"{cwd}/{path}").split("/")
    out, here = [], []
    for part in parts:
        if part == "..":
            if here:
                out.append("/" + "/".join(here))
                here.pop()
        elif part and part != ".":
            here.append(part)
    return out


# -- the strategy for imported compiles (see the module docstring) -------------------------------

@dataclass(frozen=True)
class CompleteDepfile:
    """An imported compile whose depfile is proven complete: run `command`, narrow by `depfile`."""

    command: str  # the shell command to run (the edge's own, or rewritten)
    depfile: str  # the -MF path as the command gives it (absolute, or relative to the cwd)
    rewritten: bool  # whether the edge's own words changed (-MMD made -MD); `-Wa,--MD,...` is always added
    assembler: str = ""  # the depfile GNU as writes (`-Wa,--MD,<depfile>.as.d`), as `depfile` is given


@dataclass(frozen=True)
class Whole:
    """An imported command whose reads are not proven: keyed on all its inputs."""

    reason: str
    compiler: bool  # whether it is a compile by a known driver (named and counted as one)


_DRIVER = re.compile(r"(?:[A-Za-z0-9_.]+-)*(?:gcc|g\+\+|cc|c\+\+|clang|clang\+\+)(?:-[0-9]+(?:\.[0-9]+)*)?")
_CLANG = re.compile(r"(?:[A-Za-z0-9_.]+-)*clang(?:\+\+)?(?:-[0-9]+(?:\.[0-9]+)*)?")
# What GNU as writes its own depfile to: the -MF file's name with this added.
ASSEMBLER_SUFFIX = ".as.d"
# A -D value that could spell __has_include (or a piece of it to be pasted): the probe it makes is
# in no file that discovery reads.
_HAS_INCLUDE_PIECE = re.compile(r"has_include|__h")
_BAD_ENV = ("GCC_EXEC_PREFIX", "COMPILER_PATH", "DEPENDENCIES_OUTPUT", "SUNPRO_DEPENDENCIES",
            "CCC_OVERRIDE_OPTIONS", "GCC_COMPARE_DEBUG",
            # The C library's own file reads, which no depfile names (red team R10: iconv in cc1
            # read $GCONV_PATH/gconv-modules under -finput-charset); TZ below, LD_* by prefix.
            "GCONV_PATH", "LOCPATH", "NLSPATH", "TZDIR", "GETCONF_DIR")


def _redirecting(name: str, value: str) -> bool:
    """Whether an environment variable can make the compiler's programs read (or write their
    dependency output to) a file its depfile does not name. The set is closed: GCC's manual
    ("Environment Variables Affecting GCC") and glibc's documented variables; any other name
    (PYTHONPATH, CUDA_HOME: a build's own) is read by nothing the driver runs."""
    return (name in _BAD_ENV or name.startswith("LD_") or (name.startswith("GCC_") and name not in _GCC_OUTPUT_ONLY)
            or (name == "TZ" and ("/" in value or value.startswith(":"))))


_GCC_OUTPUT_ONLY = ("GCC_COLORS", "GCC_URLS", "GCC_EXTRA_DIAGNOSTIC_OUTPUT")
# Options whose value is the next word, and those that may also be written joined (-Ifoo, -MFfoo).
_SEPARATE = frozenset(("-o", "-MF", "-MT", "-MQ", "-D", "-U", "-I", "-include", "-imacros", "-isystem", "-iquote",
                       "-idirafter", "-iprefix", "-iwithprefix", "-iwithprefixbefore", "-isysroot", "-imultilib",
                       "-x", "--param", "--sysroot"))
_JOINED = ("-o", "-MF", "-MT", "-MQ", "-D", "-U", "-I", "-isystem", "-iquote", "-idirafter", "-isysroot", "-x",
           "--sysroot=")
_PLAIN = frozenset(("-c", "-MD", "-MMD", "-MP", "-w", "-pipe", "-pthread", "-pedantic", "-pedantic-errors",
                    "-ansi", "-nostdinc", "-nostdinc++", "-undef", "-H", "-v"))
# -f options that read a file the depfile does not name. Made from GCC 12.2's own list of its
# options (`gcc -Q --help=common`, `--help=optimizers`, `--help=c`, `--help=c++`,
# `--help=undocumented`: every -f option that names a file, a directory, a profile or a module,
# kept where GCC reads what it names: profile feedback (-fprofile-use, -fbranch-probabilities,
# -fprofile-values, -fvpt, -fauto-profile, and -fprofile-dir/-fprofile-partial-training, which
# say where and how the .gcda is read), plugins, modules, precompiled headers, -fcompare-debug,
# -fself-test), and from Clang's documentation for the Clang spellings.
_READING_F = ("-fplugin", "-fpass-plugin", "-fprofile-use", "-fprofile-sample", "-fprofile-instr-use",
              "-fbranch-probabilities", "-fprofile-dir", "-fprofile-partial-training", "-fprofile-values",
              "-fvpt", "-fself-test",
              "-fprofile-remapping", "-fprofile-list", "-fauto-profile", "-fsanitize-blacklist",
              "-fsanitize-ignorelist", "-fsanitize-system", "-fsanitize-coverage-allow",
              "-fsanitize-coverage-block", "-fsanitize-coverage-white", "-fsanitize-coverage-black",
              "-fmodule", "-fprebuilt-module", "-fimplicit-module", "-fbasic-block-sections=list", "-fxray",
              "-fembed", "-fcuda-include", "-fopenmp-host-ir", "-fcompare-debug", "-fpch")
_SPECIAL = re.compile(r"[^ \tA-Za-z0-9_./=,:+@%^{}!-]")  # a command of only these is split on blanks
_SOURCE = re.compile(r".+\.(?:c|cc|cp|cxx|cpp|CPP|c\+\+|C|i|ii)")
_LANGS = ("c", "c++", "none")


def shell_words(command: str) -> list[str] | None:
    """The words of `command` if it is one simple command that /bin/sh runs as those words
    (quotes and backslashes removed), else None: an operator (`;`, `&&`, `|`, `&`), a
    redirection, an expansion (`$`, backquote, `~`), a glob, a comment, a leading assignment
    or a newline."""
    if not _SPECIAL.search(command):  # most commands: plain words between blanks
        words = command.split()
        return words if words and "=" not in words[0] else None
    words: list[str] = []
    cur: list[str] = []
    started = False
    i, n = 0, len(command)
    while i < n:
        c = command[i]
        if c in " \t":
            if started:
                words.append("".join(cur))
                cur, started = [], False
        elif c == "'":
            j = command.find("'", i + 1)
            if j < 0:
                return None
            cur.append(command[i + 1:j])
            started, i = True, j
        elif c == '"':
            i += 1
            while i < n and command[i] != '"':
                ch = command[i]
                if ch in "$`":
                    return None
                if ch == "\\" and i + 1 < n and command[i + 1] in '"\\$`\n':
                    if command[i + 1] != "\n":
                        cur.append(command[i + 1])
                    i += 2
                    continue
                cur.append(ch)
                i += 1
            if i >= n:
                return None
            started = True
        elif c == "\\":
            if i + 1 >= n:
                return None
            if command[i + 1] != "\n":
                cur.append(command[i + 1])
                started = True
            i += 1
        elif c in "|&;<>()$`\n*?[" or (c in "#~" and not started):
            return None
        else:
            cur.append(c)
            started = True
        i += 1
    if started:
        words.append("".join(cur))
    if not words or "=" in words[0]:
        return None
    return words


def _inside(path: str, roots: Iterable[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def _driver_problem(word: str, env: Mapping[str, str], roots: tuple[str, ...]) -> str | None:
    """Why `word` (a command's first word) is not a driver outside the narrowed mounts."""
    if not _DRIVER.fullmatch(word.rpartition("/")[2]):
        return f"{word.rpartition('/')[2]!r} is not a GCC-compatible compiler driver"
    if "/" in word:
        if not word.startswith("/"):
            return f"the compiler {word} is a relative path"
        if _may_lie_in(word, roots):
            return f"the compiler {word} lies inside a narrowed input"
    # Whatever names the driver, it finds `as` (and the programs its prefix lacks) through PATH
    # (red team R11: an assembler wrapper in the narrowed sources, driver /usr/bin/gcc).
    for entry in env.get("PATH", "").split(":"):
        if not entry.startswith("/") or _may_lie_in(entry, roots):
            return f"PATH entry {entry!r} could hold the compiler {word} or its assembler"
    return None


def _host_flag_problem(arg: str) -> str | None:
    """Why a compiler flag may read a file its depfile leaves out, or steer the depfile (None: it
    does neither). For flags handed on unparsed (nvcc's -Xcompiler)."""
    if arg.startswith("@"):
        return f"response file {arg}"
    if arg in ("-MMD", "-MM", "-M", "-MG", "-Wp") or arg.startswith(("-MF", "-Wp,", "-Xpreprocessor", "-Xclang")):
        return f"{arg} steers the preprocessor's dependency output"
    if arg.startswith(("-specs", "--specs", "-B", "-wrapper", "-iplugindir", "-save-temps", "-no-integrated-cpp",
                       "-Wa,", "-Xassembler")) or arg.startswith(_READING_F):
        return f"{arg} may read a file the depfile does not name"
    return None


def steered(argv: Iterable[str]) -> str | None:
    """Why a preprocessing step of bgraph's own (compile_tu's `gcc -E`, as nvcc's dry run gave it)
    could read a file its `-MD` depfile leaves out, or write a depfile that leaves some out (None:
    neither). nvcc hands -Xcompiler values (and a cuda_library's copts) to GCC as its own
    arguments: `-Xcompiler -MMD`, `-Xcompiler "-MMD -Wall"` (red team R10) and GCC's long
    spellings, `--write-user-dependencies` or any abbreviation of it (R11), reached the step. The
    allowlist of complete_compile: any other option narrows nothing."""
    args = list(argv)[1:]
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if not arg.startswith(("-", "@")):
            continue  # an operand: the source
        why = _unlisted(arg, step=True)
        if why:
            return why
        if arg in _SEPARATE:
            i += 1  # its value
    return None


def _unlisted(arg: str, step: bool = False) -> str | None:
    """Why a host compiler option is not one the allowlist of point 3 knows, or reads a file its
    depfile leaves out (None: it is known and reads none). `step`: also the `-E` of a
    preprocessing step."""
    problem = _host_flag_problem(arg)
    if problem:
        return problem
    if arg in _PLAIN or arg in _SEPARATE or (step and arg == "-E") or any(
            arg.startswith(o) and len(arg) > len(o) for o in _JOINED):
        return None
    if arg.startswith(("-O", "-g", "-f", "-m", "-std=", "--std=")) or (arg.startswith("-W") and not arg.startswith("-Wl,")):
        return None
    return f"unknown option {arg}"


def complete_compile(command: str, env: Mapping[str, str], narrowed: Iterable[str], cwd: str,
                     outputs: Iterable[str] = ()) -> CompleteDepfile | Whole:
    """The contract's decision for one imported command (module docstring): the command to run
    and its depfile, or why it is keyed on all its inputs. `narrowed`: the mounts it would be
    narrowed on (also where the compiler must not lie); `cwd`: where it runs (the build
    directory); `outputs`: the edge's outputs, as absolute paths or relative to `cwd`."""
    roots = tuple(narrowed) + (cwd,)
    words = shell_words(command)
    if words is None:
        return Whole("not one simple shell command", False)
    problem = _driver_problem(words[0], env, roots)
    if problem:
        return Whole(problem, False)
    if _CLANG.fullmatch(words[0].rpartition("/")[2]):
        # Its integrated assembler writes no depfile: what inline asm `.include`s or `.incbin`s
        # would be named nowhere.
        return Whole("clang's integrated assembler names no file that inline asm reads", True)
    bad_env = sorted(k for k, v in env.items() if _redirecting(k, v))
    if bad_env:
        return Whole(f"environment variable {bad_env[0]} redirects the compiler", True)
    counts = {"-c": 0, "-o": 0, "-MF": 0, "source": 0}
    depfile, lang, deps, rewritten = "", "", False, False
    out = [words[0]]
    i = 1
    while i < len(words):
        arg = words[i]
        i += 1
        if arg in _PLAIN:
            if arg in ("-MD", "-MMD"):
                deps, rewritten = True, rewritten or arg == "-MMD"
                arg = "-MD"
            counts["-c"] += arg == "-c"
            out.append(arg)
            continue
        if arg in _SEPARATE:
            if i >= len(words):
                return Whole(f"{arg} without a value", True)
            option, value = arg, words[i]
            out += [arg, value]
            i += 1
        else:
            option = next((o for o in _JOINED if arg.startswith(o) and len(arg) > len(o)), "")
            value = arg[len(option):]
            if option:
                out.append(arg)
        if option:
            if option in ("-o", "-MF"):
                counts[option] += 1
                depfile = value if option == "-MF" else depfile
            elif option == "-x":
                if value not in _LANGS:
                    return Whole(f"-x {value}: not a C or C++ compile", True)
                lang = value
            elif option == "-D" and _HAS_INCLUDE_PIECE.search(value):
                return Whole(f"-D{value} may spell a __has_include probe", True)
            continue
        if arg.startswith(("-", "@")):
            problem = _unlisted(arg)
            if problem:
                return Whole(problem, True)
        elif _SOURCE.fullmatch(arg) or lang in ("c", "c++"):
            counts["source"] += 1
        else:
            return Whole(f"input {arg} is not a C or C++ source", True)
        out.append(arg)
    for what, want in (("-c", 1), ("-o", 1), ("-MF", 1), ("source", 1)):
        if counts[what] != want:
            return Whole(f"{counts[what]} {what} arguments, not one", True)
    if not deps:
        return Whole("no -MD or -MMD: its -MF file is not written by this run", True)
    dep_path = absolute(depfile, cwd)
    if not dep_path.startswith(cwd.rstrip("/") + "/"):
        return Whole(f"its depfile {depfile} lies outside the build directory", True)
    assembler = depfile + ASSEMBLER_SUFFIX
    if {dep_path, dep_path + ASSEMBLER_SUFFIX} & {absolute(o, cwd) for o in outputs}:
        return Whole(f"its depfile {depfile} (or {assembler}) is one of its outputs", True)
    if "," in depfile:
        return Whole(f"its depfile {depfile} holds a comma, which -Wa, would split", True)
    # GNU as writes the files it read (every .include and .incbin, inline asm's too) to its own
    # depfile. -pipe: it reads the compiler's output from a pipe, so the depfile names no
    # temporary .s (a random name: the output would differ from run to run).
    flags = "-pipe " + shlex.quote(f"-Wa,--MD,{assembler}")
    return CompleteDepfile(f"{shlex.join(out) if rewritten else command} {flags}", depfile, rewritten, assembler)


def precompiled(paths: Iterable[str]) -> str | None:
    """The first path that is, or lies in, a precompiled header (point 6 of the contract)."""
    for p in paths:
        if p.endswith((".gch", ".pch")) or ".gch/" in p or ".pch/" in p:
            return p
    return None


# nvcc's dependency options: compile_tu writes its own depfile per step.
_NVCC_DEP_VALUE = ("-MF", "--dependency-output", "-MT", "--dependency-target-name")
_NVCC_DEP_FLAGS = ("-MD", "-MMD", "-MP", "--generate-dependencies-with-compile",
                   "--generate-nonsystem-dependencies-with-compile", "--generate-dependency-targets")
NVCC_DEPS_ONLY = ("-M", "-MM", "--generate-dependencies", "--generate-nonsystem-dependencies")
_NVCC_HOST = ("-Xcompiler", "--compiler-options")
_NVCC_BINDIR = ("-ccbin", "--compiler-bindir")


def nvcc_dependency_free(args: list[str], narrowed: Iterable[str]) -> tuple[list[str], str | None]:
    """nvcc's arguments (after `nvcc`) without its dependency options and `-o`, and why the
    depfiles of compile_tu's own steps could miss a file the run reads (None: they cannot)."""
    roots = tuple(narrowed)
    out: list[str] = []
    why: str | None = None
    skip = False
    for i, arg in enumerate(args):
        if skip:
            skip = False
            continue
        name, eq, value = arg.partition("=")
        if arg in ("-o", "--output-file", *_NVCC_DEP_VALUE):
            skip = True
            continue
        if (eq and name in ("--output-file", *_NVCC_DEP_VALUE)) or arg in _NVCC_DEP_FLAGS:
            continue
        out.append(arg)
        if name in _NVCC_HOST or name in _NVCC_BINDIR:
            value = value if eq else args[i + 1] if i + 1 < len(args) else ""
            if name in _NVCC_BINDIR:
                if not value.startswith("/") or _may_lie_in(value, roots):
                    why = why or f"host compiler {value} lies inside a narrowed input (or is relative)"
            else:
                # nvcc splits the value at commas, and the shell it runs the host compiler through
                # at blanks (`-Xcompiler "-MMD -Wall"` reaches GCC as two arguments).
                for flag in re.split(r"[,\s]+", value):
                    why = why or (_unlisted(flag) if flag.startswith(("-", "@")) else None)
        elif arg.startswith(("--options-file", "-optf")):
            why = why or f"{arg}: an options file"
    return out, why
