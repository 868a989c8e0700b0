"""The oracle of ARCHITECTURE.md invariant 6 (issue 33, deliverable 6): an incremental build's
outputs equal those of a build of the same workspace with a fresh, empty cache.

This module holds what tests/test_oracle.py (the Hypothesis state machine and the named
regression tests) and bench/soak_oracle.py share:

- `Model`: the small real workspace, rendered from a handful of knobs. Genrules on the host's
  /usr (host_tools) with globs, a symlinked source and an executable; a `ninja_generator` whose
  tiny build.ninja compiles one C file with the host gcc under `-MMD` (`deps = gcc`) and
  `-I`/`-isystem`/`-idirafter`/`-include`, then links it; a `cmake_project` (LANGUAGES NONE, the
  host's cmake and ninja) that uses file(GLOB) and file(READ) at configure time.
- `Incremental`: that workspace and its one cache, driven only through the CLI
  (`python3 -m build_graph`), so the no-op record, the memo and the kept parse all take part, as
  they do for a user. Every step appends a shell line to `recipe`.
- `Fresh`: the same workspace copied elsewhere and built with an empty cache of its own
  (`--cache-dir` and $BGRAPH_CACHE both name it); answers memoised by the workspace's content.
- `snapshot`/`diff`: everything under bgraph-out/ (links into the store followed; links inside an
  output kept as links), bytes and permission bits.

By hand (the recipes the tests print use these):

    python3 tests/oracle_lib.py init DIR       # the initial workspace in DIR/ws, cache DIR/cache
    cd DIR/ws && python3 -m build_graph build //...
    python3 tests/oracle_lib.py compare DIR/ws  # a fresh build of a copy, compared with bgraph-out
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TARGETS = ("//...",)
PROFILE = "profile.json"  # where `--profile` builds write, inside the workspace as a user's would
# Paths of the workspace that are not its content: the outputs, and the profile a build writes.
NOT_CONTENT = ("bgraph-out", ".git", "__pycache__", PROFILE)
PAST = 1_600_000_000.0  # "an edit made a while ago": far outside the 2 s racy window of any build

# -- the workspace -------------------------------------------------------------------------------

TOOLCHAINS = """\
# The host's /usr (host_tools): sh and coreutils for the genrules, gcc for the Ninja edges, and
# the host's ninja and cmake behind two one-line wrappers (the rules want a tree with bin/<tool>).
[host]
kind = "host_tools"
paths = ["/usr"]
tools = ["/usr/bin/sh", "/usr/bin/cp", "/usr/bin/cat", "/usr/bin/gcc", "/usr/bin/ninja", "/usr/bin/cmake"]

[ninja]
kind = "genrule"
outs = ["bin/ninja"]
cmd = "mkdir -p $OUT/bin && printf '#!/bin/sh\\\\nexec /usr/bin/ninja \\"$@\\"\\\\n' > $OUT/bin/ninja && chmod +x $OUT/bin/ninja"

[cmake]
kind = "genrule"
outs = ["bin/cmake"]
cmd = "mkdir -p $OUT/bin && printf '#!/bin/sh\\\\nexec /usr/bin/cmake \\"$@\\"\\\\n' > $OUT/bin/cmake && chmod +x $OUT/bin/cmake"

# No CUDA here: the rules' `toolchain` is this empty stand-in.
[none]
kind = "genrule"
outs = ["README"]
cmd = "echo no toolchain > $OUT/README"
"""

C_TARGETS = """\
[src]
kind = "genrule"
srcs = ["proj/**"]
outs = ["tree"]
cmd = "cp -a $SRC/proj $OUT/tree"

[obj]
kind = "ninja_generator"
src = ":src"
srcs = ["gen/build.ninja"]
cmd = "cp $WS/gen/build.ninja $OUT/build.ninja"
outputs = ["lib/*"]
toolchain = "//toolchains:none"
ninja = "//toolchains:ninja"
host = "//toolchains:host"
"""

CM_TARGETS = """\
[proj]
kind = "cmake_project"
srcs = ["cm/**"]
strip_prefix = "cm"
outputs = ["info.txt", "all.txt"]
toolchain = "//toolchains:none"
cmake = "//toolchains:cmake"
ninja = "//toolchains:ninja"
host = "//toolchains:host"
"""

CMAKELISTS = """\
cmake_minimum_required(VERSION 3.20)
project(oracle NONE)
# Read at configure time: a glob of parts/ and the contents of version.txt.
file(GLOB PARTS ${CMAKE_SOURCE_DIR}/parts/*.txt)
list(SORT PARTS)
file(READ ${CMAKE_SOURCE_DIR}/version.txt VERSION)
string(STRIP "${VERSION}" VERSION)
set(NAMES "")
foreach(p IN LISTS PARTS)
  get_filename_component(n ${p} NAME)
  string(APPEND NAMES " ${n}")
endforeach()
file(WRITE ${CMAKE_BINARY_DIR}/cfg.txt "version ${VERSION} parts${NAMES}\\n")
add_custom_command(OUTPUT ${CMAKE_BINARY_DIR}/info.txt
  COMMAND cp ${CMAKE_BINARY_DIR}/cfg.txt ${CMAKE_BINARY_DIR}/info.txt
  DEPENDS ${CMAKE_BINARY_DIR}/cfg.txt)
add_custom_command(OUTPUT ${CMAKE_BINARY_DIR}/all.txt
  COMMAND cat ${PARTS} > ${CMAKE_BINARY_DIR}/all.txt
  DEPENDS ${PARTS})
add_custom_target(everything ALL DEPENDS ${CMAKE_BINARY_DIR}/info.txt ${CMAKE_BINARY_DIR}/all.txt)
"""

MAIN_C = """\
#include "a.h"
#include <s.h>
#include <d.h>
#ifndef EXTRA_VAL
#define EXTRA_VAL 0
#endif
int value(void) { return A_VAL + S_VAL + D_VAL + PRE_VAL + EXTRA_VAL; }
"""

# Headers: path -> the macro it defines. `-I inc`, `-isystem sys`, `-idirafter after`,
# `-include pre.h`. A header in inc/ shadows one of the same name in sys/ or after/ (-I dirs are
# searched first), so inc/s.h and inc/d.h are the "added header" edits.
HEADERS = {"proj/inc/a.h": "A_VAL", "proj/sys/s.h": "S_VAL", "proj/after/d.h": "D_VAL", "proj/pre.h": "PRE_VAL",
           "proj/inc/s.h": "S_VAL", "proj/inc/d.h": "D_VAL"}
SHADOWS = ("proj/inc/s.h", "proj/inc/d.h")
# Plain text sources and what reads them.
TEXTS = ("in/a.txt", "in/b.txt", "data/one.txt", "data/two.txt", "cm/version.txt", "cm/parts/p1.txt")
GLOB_FILES = ("in/c.txt", "in/d.dat", "cm/parts/p2.txt", "cm/parts/p3.txt")  # added and removed
LINK = "in/link.txt"  # a symlink in the glob of //p:files, to one of LINK_TARGETS
LINK_TARGETS = ("../data/one.txt", "../data/two.txt")
TOOL = "data/tool.sh"
MODE_FILES = ("in/a.txt", "in/b.txt", "data/one.txt", TOOL, "proj/inc/a.h", "cm/parts/p1.txt")
OPTS = ("-O0", "-O1", "-O2")


def text_of(path: str, version: int, extra: int = 0) -> str:
    """The content of an editable file at `version` (100..999: the same width, so a rewrite to
    another version keeps the size) with `extra` lines appended (a size-changing edit)."""
    if path in HEADERS:  # extra lines are comments: the preprocessed text does not change
        return f"#define {HEADERS[path]} {version}\n" + "".join(f"/* extra {i} */\n" for i in range(extra))
    if path == TOOL:
        return f"#!/bin/sh\necho tool {version}\n" + "".join(f"# extra {i}\n" for i in range(extra))
    body = f"{version}\n" if path == "cm/version.txt" else f"{Path(path).stem} {version}\n"
    return body + "".join(f"extra {i}\n" for i in range(extra))


@dataclass
class Model:
    """The knobs the workspace is rendered from (what the state machine changes through edits
    of target files, WORKSPACE.toml and build.ninja)."""

    files_glob: str = "in/*"         # //p:files srcs
    files_sorted: bool = False       # //p:files cmd: cat, or cat | sort -r
    count_lines: bool = False        # //p:count cmd: wc -c, or wc -l
    count_tool_dep: bool = False     # //p:count also depends on //p:tool (and reads its exec bit)
    reversed_tables: bool = False    # p.toml's tables in reverse order (no change of meaning)
    jobs: int | None = None          # WORKSPACE.toml [defaults] jobs
    opt: str = "-O1"                 # build.ninja's compile flags
    extra_define: int | None = None  # build.ninja's -DEXTRA_VAL=

    def p_toml(self) -> str:
        files_cmd = "cat $SRC/in/* > $OUT/cat.txt" if not self.files_sorted else \
            "cat $SRC/in/* | sort -r > $OUT/cat.txt"
        files = ("[files]\nkind = \"genrule\"\n"
                 f"srcs = [\"{self.files_glob}\"]\n"
                 "outs = [\"cat.txt\", \"modes.txt\", \"alias\"]\n"
                 f"cmd = \"{files_cmd}; for f in $SRC/in/*; do if test -x $f; then echo x ${{f##*/}}; "
                 "else echo - ${f##*/}; fi; done > $OUT/modes.txt; ln -s cat.txt $OUT/alias\"\n")
        tool = ("[tool]\nkind = \"genrule\"\nsrcs = [\"data/tool.sh\"]\nouts = [\"tool.sh\"]\n"
                "cmd = \"cp $SRC/data/tool.sh $OUT/tool.sh\"\n")
        wc = "wc -l" if self.count_lines else "wc -c"
        if self.count_tool_dep:
            count = ("[count]\nkind = \"genrule\"\nouts = [\"n.txt\"]\ndeps = { f = \":files\", t = \":tool\" }\n"
                     f"cmd = \"{wc} < $IN_F/cat.txt > $OUT/n.txt; if test -x $IN_T/tool.sh; "
                     "then echo tool-x >> $OUT/n.txt; fi\"\n")
        else:
            count = ("[count]\nkind = \"genrule\"\nouts = [\"n.txt\"]\ndeps = { f = \":files\" }\n"
                     f"cmd = \"{wc} < $IN_F/cat.txt > $OUT/n.txt\"\n")
        tables = [files, tool, count]
        if self.reversed_tables:
            tables.reverse()
        return "\n".join(tables)

    def workspace_toml(self) -> str:
        text = '[workspace]\nname = "oracle"\ndigest_function = "blake3"\n\n[defaults]\ncache_dir = "../cache"\n'
        if self.jobs is not None:
            text += f"jobs = {self.jobs}\n"
        return text

    def build_ninja(self) -> str:
        define = f" -DEXTRA_VAL={self.extra_define}" if self.extra_define is not None else ""
        return f"""\
ninja_required_version = 1.3
rule cc
  command = /usr/bin/gcc -MMD -MF $out.d {self.opt}{define} -fPIC -I/bgraph/src/tree/inc -isystem /bgraph/src/tree/sys -idirafter /bgraph/src/tree/after -include /bgraph/src/tree/pre.h -c $in -o $out
  depfile = $out.d
  deps = gcc
rule link
  command = /usr/bin/gcc -shared $in -o $out
build /bgraph/out/obj/main.o: cc /bgraph/src/tree/main.c
build /bgraph/out/lib/libvalue.so: link /bgraph/out/obj/main.o
default /bgraph/out/lib/libvalue.so
"""

    def rendered(self) -> dict[str, str]:
        """The files these knobs decide."""
        return {"WORKSPACE.toml": self.workspace_toml(), "targets/p.toml": self.p_toml(),
                "gen/build.ninja": self.build_ninja()}


def initial_files() -> dict[str, str]:
    files = {"targets/toolchains.toml": TOOLCHAINS, "targets/c.toml": C_TARGETS, "targets/cm.toml": CM_TARGETS,
             "cm/CMakeLists.txt": CMAKELISTS, "proj/main.c": MAIN_C, TOOL: text_of(TOOL, 100),
             "cm/parts/p2.txt": text_of("cm/parts/p2.txt", 100), **Model().rendered()}
    for path in TEXTS:
        files[path] = text_of(path, 100 if path != "data/two.txt" else 200)
    for path in HEADERS:
        if path not in SHADOWS:
            files[path] = text_of(path, 100)
    return files


def write_initial(root: Path) -> None:
    """The initial workspace at `root`, every file dated PAST (an old checkout)."""
    for rel, text in initial_files().items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    os.chmod(root / TOOL, 0o755)
    os.symlink(LINK_TARGETS[0], root / LINK)
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            os.utime(os.path.join(dirpath, name), (PAST, PAST), follow_symlinks=False)


# -- outputs -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Entry:
    kind: str  # "file" or "link"
    mode: int = 0  # permission bits (files)
    digest: str = ""  # sha256 (files)
    size: int = 0
    text: str | None = None  # small text files, for readable diffs
    target: str = ""  # links inside an output

    def show(self) -> str:
        if self.kind == "link":
            return f"link -> {self.target}"
        body = repr(self.text) if self.text is not None else f"{self.size} bytes sha256:{self.digest[:16]}"
        return f"file {self.mode:04o} {body}"


Snapshot = dict[str, Entry]


def snapshot(root: Path) -> Snapshot:
    """Everything under root/bgraph-out (but its dot-entries): a link to an absolute path (the
    output links into the store) is followed; a relative link (inside an output) is recorded."""
    out: Snapshot = {}
    top = root / "bgraph-out"
    if not top.is_dir():
        return out

    def walk(path: Path, rel: str) -> None:
        if path.is_symlink():
            target = os.readlink(path)
            if not os.path.isabs(target):
                out[rel] = Entry("link", target=target)
                return
            if not path.exists():
                out[rel] = Entry("link", target=f"{target} (dangling)")
                return
        if path.is_dir():
            for child in sorted(os.listdir(path)):
                if rel == "" and child.startswith("."):
                    continue
                walk(path / child, f"{rel}/{child}" if rel else child)
            return
        st = path.stat()
        data = path.read_bytes()
        try:
            text = data.decode() if len(data) <= 2048 else None
        except UnicodeDecodeError:
            text = None
        out[rel] = Entry("file", stat.S_IMODE(st.st_mode), hashlib.sha256(data).hexdigest(), len(data), text)

    walk(top, "")
    return out


def diff(incremental: Snapshot, fresh: Snapshot) -> list[str]:
    lines = []
    for rel in sorted(set(incremental) | set(fresh)):
        a, b = incremental.get(rel), fresh.get(rel)
        if a != b:
            lines.append(f"  bgraph-out/{rel}:\n    incremental: {a.show() if a else 'missing'}\n"
                         f"    fresh cache: {b.show() if b else 'missing'}")
    return lines


def output_files(snap: Snapshot) -> list[str]:
    return sorted(rel for rel, e in snap.items() if e.kind == "file")


# -- running bgraph ------------------------------------------------------------------------------

def bgraph_env(home: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The test process's environment without BGRAPH_* and with a private HOME (as conftest gives
    the suite), bgraph importable from this checkout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BGRAPH_", "PIP_"))}
    if "XDG_CACHE_HOME" in os.environ:  # the session's: a new home need not compile bgraph's bytecode again
        env.setdefault("PYTHONPYCACHEPREFIX", os.path.join(os.environ["XDG_CACHE_HOME"], "bgraph-bytecode"))
    env.update(HOME=str(home), XDG_CONFIG_HOME=str(home / ".config"), XDG_CACHE_HOME=str(home / ".cache"),
               XDG_DATA_HOME=str(home / ".local" / "share"), PIP_CONFIG_FILE=os.devnull, COLUMNS="2000")
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra or {})
    return env


@dataclass
class Result:
    rc: int
    output: str
    argv: list[str]

    @property
    def tail(self) -> str:
        """The end of the output, without the list of output links."""
        lines = [ln for ln in self.output.splitlines() if not re.match(r"//\S+: bgraph-out/", ln)]
        return "\n".join(lines)[-3000:]


def run_bgraph(root: Path, args: list[str], home: Path, env: dict[str, str] | None = None,
               timeout: float = 300) -> Result:
    argv = [sys.executable, "-m", "build_graph", *args]
    proc = subprocess.run(argv, cwd=root, capture_output=True, text=True, timeout=timeout,
                          env=bgraph_env(home, env))
    return Result(proc.returncode, proc.stdout + proc.stderr, argv)


# -- the fresh-cache oracle ----------------------------------------------------------------------

def content_digest(root: Path) -> str:
    """The workspace's content: every file's path, permission bits and bytes, every link's target."""
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        rel_dir = here.relative_to(root)
        if rel_dir == Path("."):
            dirnames[:] = [d for d in dirnames if d not in NOT_CONTENT]
        dirnames.sort()
        for name in sorted(filenames + [d for d in dirnames if (here / d).is_symlink()]):
            if rel_dir == Path(".") and name in NOT_CONTENT:
                continue
            path = here / name
            rel = (rel_dir / name).as_posix()
            st = path.lstat()
            if stat.S_ISLNK(st.st_mode):
                h.update(f"L {rel} {os.readlink(path)}\0".encode())
            else:
                h.update(f"F {rel} {stat.S_IMODE(st.st_mode):o} ".encode() + hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()


@dataclass
class FreshAnswer:
    rc: int
    snapshot: Snapshot
    output: str


class Fresh:
    """Builds of a copy of a workspace with a fresh, empty cache; answers kept by content digest
    (a tamper, a deleted blob or a --check build leaves the workspace as it was)."""

    def __init__(self, scratch: Path, home: Path):
        self.scratch, self.home = scratch, home
        self.memo: dict[str, FreshAnswer] = {}
        self.builds = 0
        self._lock = threading.Lock()

    def start(self, root: Path):
        """Begin the fresh build of `root` as it is now (copied before this returns); the
        returned callable waits for the answer."""
        key = content_digest(root)
        with self._lock:
            if key in self.memo:
                answer = self.memo[key]
                return lambda: answer
        place = Path(tempfile.mkdtemp(prefix="fresh-", dir=self.scratch))
        copy = place / "ws"
        shutil.copytree(root, copy, symlinks=True,
                        ignore=lambda d, names: [n for n in names if Path(d) == root and n in NOT_CONTENT])
        box: dict[str, FreshAnswer] = {}

        def work():
            cache = place / "fresh-cache"
            try:
                r = run_bgraph(copy, ["--cache-dir", str(cache), "build", *TARGETS], self.home,
                               env={"BGRAPH_CACHE": str(cache)})
                if not (cache / "v1").is_dir():
                    r = Result(99, f"the fresh build did not use its own cache {cache}:\n{r.output}", r.argv)
                box["answer"] = FreshAnswer(r.rc, snapshot(copy), r.output)
            except Exception as e:  # a timeout: reported as a failed fresh build
                box["answer"] = FreshAnswer(98, {}, repr(e))
            finally:
                shutil.rmtree(place, ignore_errors=True)

        thread = threading.Thread(target=work)
        thread.start()

        def wait() -> FreshAnswer:
            thread.join()
            answer = box["answer"]
            with self._lock:
                self.memo[key] = answer
                self.builds += 1
            return answer

        return wait

    def answer(self, root: Path) -> FreshAnswer:
        return self.start(root)()


# -- the incremental side ------------------------------------------------------------------------

BUILD_MODES = ("plain", "check", "profile", "j1", "env-cache", "workspace-cache")


class OracleFailure(AssertionError):
    pass


@dataclass
class Incremental:
    """One workspace and its cache, edited and built as a user would; `recipe` is every step as a
    shell line (run in the workspace; $CACHE is the cache directory)."""

    base: Path
    fresh: Fresh
    home: Path
    seed: str = ""
    model: Model = field(default_factory=Model)
    recipe: list[str] = field(default_factory=list)
    clock: float = PAST
    builds: int = 0
    steps: int = 0

    def __repr__(self) -> str:
        return f"Incremental({self.base})"

    def __post_init__(self):
        self.root = self.base / "ws"
        self.cache = self.base / "cache"  # WORKSPACE.toml's [defaults] cache_dir = "../cache"
        self.rendered_model = dataclasses.replace(self.model)
        self.root.mkdir(parents=True)
        write_initial(self.root)
        self.recipe.append(f"python3 tests/oracle_lib.py init DIR && cd DIR/ws && CACHE=DIR/cache")

    # -- file edits ----------------------------------------------------------------------------
    def path(self, rel: str) -> Path:
        return self.root / rel

    def _date(self, rel: str, when: str) -> str:
        """Set the mtime of an edited file, as the recipe's touch: "past", a distinct time well
        before the build (an edit made a while ago, or a checkout that keeps dates: its stamp is
        trusted); "future", an hour ahead (a clock ahead of this one: racily clean for every build
        of the test, as a file written within 2 s of a build is, but not by chance of timing);
        "now", as written (racy or not by the time the build scans it: not reproducible)."""
        if when == "now":
            return ""
        if when == "future":
            self.clock += 1.5
            t = time.time() + 3600 + (self.clock - PAST)
            os.utime(self.path(rel), (t, t), follow_symlinks=False)
            return f" && touch -h -d @$(( $(date +%s) + 3600 )) {rel}   # an hour ahead"
        self.clock += 1.5
        os.utime(self.path(rel), (self.clock, self.clock), follow_symlinks=False)
        return f" && touch -h -d @{self.clock} {rel}"

    def write(self, rel: str, text: str, when: str = "past") -> None:
        path = self.path(rel)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        self.recipe.append(f"printf {printf_quote(text)} > {rel}{self._date(rel, when)}")

    def remove(self, rel: str) -> None:
        self.path(rel).unlink()
        self.recipe.append(f"rm {rel}")

    def chmod(self, rel: str, executable: bool) -> None:
        path = self.path(rel)
        mode = stat.S_IMODE(path.stat().st_mode)
        os.chmod(path, mode | 0o111 if executable else mode & ~0o111)
        self.recipe.append(f"chmod {'+x' if executable else '-x'} {rel}")

    def rewrite_keeping_mtime(self, rel: str, text: str, rename: bool = False) -> None:
        """The same number of bytes, other bytes, and the old atime/mtime put back (os.utime with
        the nanoseconds): written in place, only ctime tells (as after a restore or with a bad
        clock); written beside and renamed over it (an editor's save, `sed -i`), the inode too."""
        path = self.path(rel)
        st = path.stat()
        old = path.read_bytes()
        assert len(old) == len(text.encode()) and old != text.encode(), (rel, old, text)
        if rename:
            tmp = path.with_name(path.name + ".new")
            tmp.write_text(text)
            os.chmod(tmp, stat.S_IMODE(st.st_mode))
            os.replace(tmp, path)
            write = (f"printf {printf_quote(text)} > {rel}.new; chmod {stat.S_IMODE(st.st_mode):o} {rel}.new; "
                     f"mv {rel}.new {rel}")
        else:
            path.write_text(text)
            write = f"printf {printf_quote(text)} > {rel}"
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        self.recipe.append(f"t=$(stat -c %y {rel}); {write}; touch -d \"$t\" {rel}   # same size, mtime put back"
                           + (" (a new inode)" if rename else ""))

    def retarget(self, rel: str, target: str, when: str = "past") -> None:
        path = self.path(rel)
        tmp = path.with_name(path.name + ".new")
        os.symlink(target, tmp)
        os.replace(tmp, path)
        self.recipe.append(f"ln -sfn {target} {rel}{self._date(rel, when)}")

    def render(self, when: str = "past") -> None:
        """Write the files the model decides, where they changed (the recipe line ends with the
        knobs that changed, in Model's terms)."""
        changed = [f"{f.name}={getattr(self.model, f.name)!r}" for f in dataclasses.fields(Model)
                   if getattr(self.model, f.name) != getattr(self.rendered_model, f.name)]
        self.rendered_model = dataclasses.replace(self.model)
        for rel, text in self.model.rendered().items():
            old = self.path(rel).read_text()
            if old == text:
                continue
            if when == "put-back" and len(old.encode()) == len(text.encode()):
                self.rewrite_keeping_mtime(rel, text)  # wc -c/-l, -O1/-O2, jobs = 1/2: the same size
            else:
                self.write(rel, text, "past" if when == "put-back" else when)
            self.recipe[-1] += f"   # Model: {', '.join(changed)}"

    # -- the store and the outputs ---------------------------------------------------------------
    def output(self, rel: str) -> Path:
        return self.root / "bgraph-out" / rel

    def tamper(self, rel: str, how: str) -> None:
        """Write an output in place through bgraph-out/ (as root, past the read-only mode): the
        file is a hard link of a blob of the cache, so the blob changes too."""
        path = self.output(rel)
        if how == "append":
            with open(path, "ab") as f:
                f.write(b"tampered\n")
            self.recipe.append(f"echo tampered >> bgraph-out/{rel}   # write in place (root), through the link")
        elif how == "same-size":
            st = path.stat()
            data = bytearray(path.read_bytes())
            if not data:
                data = bytearray(b"")
            else:
                data[0] ^= 0x01
            with open(path, "r+b") as f:
                f.write(data)
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
            self.recipe.append(f"t=$(stat -c %y bgraph-out/{rel}); python3 -c \"import sys; p=sys.argv[1]; "
                               f"b=bytearray(open(p,'rb').read()); b[0]^=1; open(p,'r+b').write(b)\" "
                               f"bgraph-out/{rel}; touch -d \"$t\" bgraph-out/{rel}   # same size, mtime put back")
        elif how == "chmod":
            mode = stat.S_IMODE(path.stat().st_mode)
            new = mode & ~0o111 if mode & 0o111 else mode | 0o111
            os.chmod(path, new)
            self.recipe.append(f"chmod {new:o} bgraph-out/{rel}   # through the link: the blob's mode")
        else:
            raise ValueError(how)

    def cas_files(self) -> list[Path]:
        cas = self.cache / "v1" / "blake3" / "cas"
        return sorted(p for p in cas.rglob("*") if p.is_file()) if cas.is_dir() else []

    def delete_blob_of(self, rel: str) -> None:
        """Remove the blob(s) an output file is a hard link of."""
        self.delete_blob_of_file(self.output(rel), f"bgraph-out/{rel}")

    def delete_blob_of_file(self, path: Path, shown: str) -> None:
        """Remove the blob(s) of the cache that `path` (a file of a materialized tree) is a hard link of."""
        ino = path.stat().st_ino
        gone = [p for p in self.cas_files() if p.stat().st_ino == ino]
        for p in gone:
            p.unlink()
        names = " ".join(f"$CACHE/{p.relative_to(self.cache)}" for p in gone) or "(none: not linked from the CAS)"
        self.recipe.append(f"rm -f {names}   # the blob of {shown}")

    def delete_blob(self, index: int) -> None:
        files = self.cas_files()
        if not files:
            return
        p = files[index % len(files)]
        p.unlink()
        self.recipe.append(f"rm $CACHE/{p.relative_to(self.cache)}   # blob {index % len(files)} of {len(files)}")

    def remove_outputs(self) -> None:
        shutil.rmtree(self.root / "bgraph-out", ignore_errors=True)
        self.recipe.append("rm -rf bgraph-out")

    def gc(self) -> None:
        r = run_bgraph(self.root, ["--cache-dir", str(self.cache), "cache", "gc"], self.home)
        self.recipe.append("bgraph --cache-dir $CACHE cache gc")
        if r.rc != 0:
            raise OracleFailure(self.report(f"`bgraph cache gc` failed (rc {r.rc}):\n{r.tail}"))

    # -- building and the oracle -----------------------------------------------------------------
    def build_args(self, mode: str) -> tuple[list[str], dict[str, str], str]:
        """argv, environment and the recipe's line of one build: the cache named by --cache-dir,
        by $BGRAPH_CACHE or by WORKSPACE.toml (all three name the same directory)."""
        flag = ["--cache-dir", str(self.cache)]
        args = {"plain": (flag, ["build"], "bgraph --cache-dir $CACHE build"),
                "check": (flag, ["build", "--check"], "bgraph --cache-dir $CACHE build --check"),
                "profile": (flag, ["build", "--profile", PROFILE],
                            f"bgraph --cache-dir $CACHE build --profile {PROFILE}"),
                "j1": (flag, ["build", "-j", "1"], "bgraph --cache-dir $CACHE build -j 1"),
                "j4": (flag, ["build", "-j", "4"], "bgraph --cache-dir $CACHE build -j 4"),
                "env-cache": ([], ["build"], "BGRAPH_CACHE=$CACHE bgraph build"),
                "workspace-cache": ([], ["build"], "bgraph build")}[mode]
        env = {"BGRAPH_CACHE": str(self.cache)} if mode == "env-cache" else {}
        note = "   # the cache: WORKSPACE.toml's cache_dir" if mode == "workspace-cache" else ""
        return [*args[0], *args[1], *TARGETS], env, f"{args[2]} {' '.join(TARGETS)}{note}"

    def build(self, mode: str = "plain") -> Result:
        argv, env, line = self.build_args(mode)
        pending = self.fresh.start(self.root)
        r = run_bgraph(self.root, argv, self.home, env)
        fresh = pending()
        self.builds += 1
        verdict = "up to date" if "up to date" in r.output else "built"
        self.recipe.append(f"{line}{'   #' if '#' not in line else ';'} -> {verdict}")
        if fresh.rc != 0:
            raise OracleFailure(self.report(f"the fresh-cache build failed (rc {fresh.rc}): an edit this "
                                            f"workspace cannot build (a bug of the test), or bgraph itself "
                                            f"broken:\n{Result(fresh.rc, fresh.output, []).tail}"))
        if r.rc != 0:
            raise OracleFailure(self.report(f"the incremental build failed (rc {r.rc}) where a fresh cache "
                                            f"builds:\n{r.tail}"))
        mine = snapshot(self.root)
        lines = diff(mine, fresh.snapshot)
        if lines:
            raise OracleFailure(self.report("the incremental build's outputs differ from a fresh cache's:\n"
                                            + "\n".join(lines)
                                            + f"\nincremental build said:\n{summary_lines(r.output)}"))
        return r

    def report(self, what: str) -> str:
        seed = f"seed {self.seed}; " if self.seed else ""
        return (f"{what}\n\n{seed}recipe ({len(self.recipe) - 1} steps; then "
                f"`python3 tests/oracle_lib.py compare DIR/ws`):\n  " + "\n  ".join(self.recipe))


def summary_lines(output: str) -> str:
    keep = [ln for ln in output.splitlines() if ln.startswith(("OK", "FAILED", "up to date", "[", "warning"))
            or "put back" in ln or "not replanned" in ln]
    return "\n".join(keep[-8:])


def shell_quote(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


def printf_quote(text: str) -> str:
    """`text` as printf's format argument, quoted for the shell (one line: newlines as \\n)."""
    return shell_quote(text.replace("\\", "\\\\").replace("%", "%%").replace("\n", "\\n"))


# -- by hand -------------------------------------------------------------------------------------

def _main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "init":
        base = Path(argv[1]).resolve()
        (base / "ws").mkdir(parents=True)
        write_initial(base / "ws")
        print(f"workspace {base / 'ws'}, cache {base / 'cache'} (WORKSPACE.toml's cache_dir)")
        return 0
    if len(argv) == 2 and argv[0] == "compare":
        root = Path(argv[1]).resolve()
        scratch = Path(tempfile.mkdtemp(prefix="oracle-compare-"))
        try:
            (scratch / "home").mkdir()
            fresh = Fresh(scratch, scratch / "home").answer(root)
            if fresh.rc != 0:
                print(f"the fresh build failed:\n{fresh.output[-3000:]}")
                return 2
            lines = diff(snapshot(root), fresh.snapshot)
            print("\n".join(lines) if lines else "bgraph-out equals a fresh cache's build")
            return 1 if lines else 0
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
