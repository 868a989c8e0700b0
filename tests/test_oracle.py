"""The oracle (ARCHITECTURE.md invariant 6; issue 33, deliverable 6): after any sequence of edits
a user can make, an incremental build's outputs equal those of a build of the same workspace with
a fresh, empty cache (*Build systems à la carte*'s correctBuild).

`test_incremental_builds_equal_fresh_builds` is a Hypothesis state machine over the workspace of
tests/oracle_lib.py: edits of contents, modes, same-size rewrites with the mtime put back, files
added to and removed from globs, a symlink retargeted, headers behind -I/-isystem/-idirafter/
-include (and shadowing ones added), target files, WORKSPACE.toml and build.ninja flags; outputs
tampered with through bgraph-out, blobs deleted from the CAS, bgraph-out removed, `cache gc`; and
builds plain, `--check`, `--profile`, `-j 1`, the cache named by flag, environment or
WORKSPACE.toml. After every build, bgraph-out/ (links followed; bytes and permission bits) must
equal a fresh cache's build of a copy of the workspace. Everything runs through the CLI.

Environment (read from the process's own environment even though conftest clears BGRAPH_*):
BGRAPH_ORACLE_SEED (default 33), BGRAPH_ORACLE_EXAMPLES and BGRAPH_ORACLE_STEPS (the CI bound:
10 examples of up to 20 steps, about 130 steps: 1.5 to 3.7 minutes on a shared 2-core machine
when nothing fails; a failure adds up to 5 minutes of shrinking); BGRAPH_ORACLE_SKIP (comma-separated rule names, or rule:value, left
out, to hunt a second bug while a first is open; never set in CI); BGRAPH_ORACLE_VERBOSE=1 (every
example's recipe, with -s); BGRAPH_ORACLE_NOW=1 (edits may also keep the mtime they were written
with: racy or not by timing, so not reproducible; for the soak). A failure prints the seed,
Hypothesis's shrunk sequence of rule calls and the same sequence as a shell recipe. The long run
is bench/soak_oracle.py.

The named tests below are the issue's cases as fixed, deterministic sequences of the same steps.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import hypothesis
import hypothesis.configuration
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule, run_state_machine_as_test

import oracle_lib as ol
from bgraph_testlib import requires_bwrap

# Hypothesis keeps a cache of the constants it finds in our code in <cwd>/.hypothesis: not in the
# checkout (the suite's last test checks that it leaves that as it found it). Under pytest HOME is
# conftest's private one, removed after the session; the soak names its own directory.
if not os.environ.get("HYPOTHESIS_STORAGE_DIRECTORY"):
    hypothesis.configuration.set_hypothesis_home_dir(Path(os.path.expanduser("~")) / ".hypothesis")

pytestmark = [requires_bwrap,
              pytest.mark.skipif(not all(shutil.which(t) for t in ("gcc", "ninja", "cmake")),
                                 reason="the oracle's workspace uses the host's gcc, ninja and cmake")]


def _setting(name: str) -> str | None:
    """An environment variable as the process started with it: conftest removes BGRAPH_* from
    os.environ (so no bgraph a test starts sees the user's), but /proc keeps the original."""
    if name in os.environ:
        return os.environ[name]
    try:
        raw = Path("/proc/self/environ").read_bytes()
    except OSError:
        return None
    for item in raw.split(b"\0"):
        key, _, value = item.partition(b"=")
        if key.decode(errors="replace") == name:
            return value.decode(errors="replace")
    return None


SEED = int(_setting("BGRAPH_ORACLE_SEED") or 33)
EXAMPLES = int(_setting("BGRAPH_ORACLE_EXAMPLES") or 10)
STEPS = int(_setting("BGRAPH_ORACLE_STEPS") or 20)
VERBOSE = _setting("BGRAPH_ORACLE_VERBOSE") == "1"  # print every example's recipe (with -s)
SKIP = frozenset(filter(None, (_setting("BGRAPH_ORACLE_SKIP") or "").split(",")))

def choices(rule: str, values) -> tuple:
    """`values` less those BGRAPH_ORACLE_SKIP names as `rule:value`."""
    return tuple(v for v in values if f"{rule}:{v}" not in SKIP)


# What follows an edit: a build in one of the modes, or nothing (the next rule's edit joins it).
THEN = st.sampled_from((*ol.BUILD_MODES, "none"))
# The edited file's mtime: well in the past (trusted by its stamp), or an hour ahead (racily clean
# for every build: what a file written within 2 s of a build is, without the timing that makes
# "now" irreproducible; see Incremental._date).
WHEN = st.sampled_from(("past", "future", "now") if _setting("BGRAPH_ORACLE_NOW") == "1" else ("past", "future"))
# Contents are versions 100..104 (few: an edit may restore earlier contents). An edit draws how
# far to move: 1..4 versions on (other contents), or 5: the same version (a rewrite of the same
# text; only the mtime moves, and the size where the extra lines change).
CHANGE = st.integers(1, 5)
EXTRA = st.integers(0, 2)
# A rendered file (target file, WORKSPACE.toml, build.ninja) may also be rewritten with its mtime
# put back, where the new text has the old size.
RENDER_WHEN = st.sampled_from(("past", "future", "put-back"))
SOURCES = ("in/a.txt", "in/b.txt", "data/one.txt", "data/two.txt", ol.TOOL)
CMAKE_INPUTS = ("cm/version.txt", "cm/parts/p1.txt", "cm/parts/p2.txt", "cm/parts/p3.txt")
EDITABLE = (*ol.TEXTS, *ol.HEADERS, ol.TOOL, *ol.GLOB_FILES)
REMOVABLE = (*ol.GLOB_FILES, *ol.SHADOWS)
TAMPERS = ("append", "same-size", "chmod")


class TimeUp(BaseException):
    """The soak's time is up (not an Exception: Hypothesis lets it through, as a Ctrl-C)."""


def enabled(name: str):
    return precondition(lambda self: name not in SKIP)


class OracleMachine(RuleBasedStateMachine):
    """One workspace and cache per example; the Fresh oracle (and its memo) is shared."""

    scratch: Path
    fresh: ol.Fresh
    home: Path
    seed_text = ""
    steps_run = 0  # over all examples (bench/soak_oracle.py prints it)
    deadline: float | None = None  # time.monotonic() after which no example starts (the soak)
    failed = False  # a failure was seen: Hypothesis is shrinking it, the deadline waits
    first_failure = ""  # the first failure's text (a flaky one may end as Hypothesis's own error)
    examples_run = 0
    progress = False  # a line per example (the soak)
    rules_run: dict[str, int] = {}

    def __init__(self):
        super().__init__()
        self.ws: ol.Incremental | None = None
        self.files: dict[str, tuple[int, int]] = {}  # path -> (version, extra lines)
        self.unbuilt = False

    @initialize(mode=st.sampled_from(ol.BUILD_MODES))
    def first_build(self, mode):
        if self.deadline is not None and not self.failed and time.monotonic() > self.deadline:
            raise TimeUp
        base = Path(tempfile.mkdtemp(prefix="example-", dir=self.scratch))
        self.ws = ol.Incremental(base, self.fresh, self.home, seed=self.seed_text)
        for path in EDITABLE:
            if self.ws.path(path).exists():
                self.files[path] = (100 if path != "data/two.txt" else 200, 0)
        self._build(mode)

    def then(self, mode: str) -> None:
        type(self).steps_run += 1
        caller = sys._getframe(1).f_code.co_name
        rule_name = sys._getframe(2).f_code.co_name if caller == "_write" else caller
        type(self).rules_run[rule_name] = type(self).rules_run.get(rule_name, 0) + 1
        if mode == "none":
            self.unbuilt = True
            return
        self.unbuilt = False
        self._build(mode)

    def _build(self, mode: str) -> None:
        try:
            self.ws.build(mode)
        except ol.OracleFailure as e:
            if not type(self).failed:
                type(self).first_failure = str(e)
            type(self).failed = True
            raise

    # -- edits of the workspace ----------------------------------------------------------------
    def version(self, path: str, change: int) -> int:
        old = self.files.get(path, (100, 0))[0]
        return old if change == 5 else 100 + (old - 100 + change) % 5

    def _write(self, path, change, extra, when, then):
        version = self.version(path, change)
        self.ws.write(path, ol.text_of(path, version, extra), when)
        self.files[path] = (version, extra)
        self.then(then)

    @enabled("edit_source")
    @rule(path=st.sampled_from(choices("edit_source", SOURCES)), change=CHANGE, extra=EXTRA, when=WHEN, then=THEN)
    def edit_source(self, path, change, extra, when, then):
        """New contents (maybe a new size) of a genrule's source, the symlink's targets included."""
        self._write(path, change, extra, when, then)

    @enabled("edit_header")
    @rule(path=st.sampled_from(choices("edit_header", tuple(ol.HEADERS))), change=CHANGE, extra=EXTRA, when=WHEN,
          then=THEN)
    def edit_header(self, path, change, extra, when, then):
        """A header behind -I, -isystem, -idirafter or -include; inc/s.h and inc/d.h are created
        where absent (they shadow sys/s.h and after/d.h)."""
        self._write(path, change, extra, when, then)

    @enabled("edit_cmake_input")
    @rule(path=st.sampled_from(choices("edit_cmake_input", CMAKE_INPUTS)), change=CHANGE, extra=EXTRA, when=WHEN,
          then=THEN)
    def edit_cmake_input(self, path, change, extra, when, then):
        """version.txt (file(READ)) or a part (file(GLOB); created where absent)."""
        self._write(path, change, extra, when, then)

    @enabled("add_or_remove_file")
    @rule(path=st.sampled_from(choices("add_or_remove_file", REMOVABLE)), change=CHANGE, when=WHEN, then=THEN)
    def add_or_remove_file(self, path, change, when, then):
        """A file of a glob (in/*, cm/parts/*.txt) or a shadowing header: removed if present, else added."""
        if path in self.files:
            self.ws.remove(path)
            del self.files[path]
            self.then(then)
        else:
            self._write(path, change, 0, when, then)

    @enabled("rewrite_keeping_mtime")
    @rule(path=st.sampled_from(choices("rewrite_keeping_mtime", EDITABLE)), change=CHANGE, rename=st.booleans(),
          then=THEN)
    def rewrite_keeping_mtime(self, path, change, rename, then):
        """Same size, other bytes, the old mtime put back."""
        if path in self.files:
            extra = self.files[path][1]
            version = self.version(path, min(change, 4))  # other contents
            self.ws.rewrite_keeping_mtime(path, ol.text_of(path, version, extra), rename)
            self.files[path] = (version, extra)
        self.then(then)

    @enabled("chmod")
    @rule(path=st.sampled_from(choices("chmod", ol.MODE_FILES)), executable=st.booleans(), then=THEN)
    def chmod(self, path, executable, then):
        self.ws.chmod(path, executable)
        self.then(then)

    @enabled("retarget_link")
    @rule(to=st.sampled_from(ol.LINK_TARGETS), when=WHEN, then=THEN)
    def retarget_link(self, to, when, then):
        self.ws.retarget(ol.LINK, to, when)
        self.then(then)

    @enabled("edit_target_file")
    @rule(files_glob=st.sampled_from(("in/*", "in/*.txt")), files_sorted=st.booleans(), count_lines=st.booleans(),
          count_tool_dep=st.booleans(), reversed_tables=st.booleans(), when=RENDER_WHEN, then=THEN)
    def edit_target_file(self, files_glob, files_sorted, count_lines, count_tool_dep, reversed_tables, when, then):
        """targets/p.toml: another glob, command or dependency; or its tables reordered."""
        m = self.ws.model
        m.files_glob, m.files_sorted, m.count_lines = files_glob, files_sorted, count_lines
        m.count_tool_dep, m.reversed_tables = count_tool_dep, reversed_tables
        self.ws.render(when)
        self.then(then)

    @enabled("edit_workspace_toml")
    @rule(jobs=st.sampled_from((None, 1, 2)), when=RENDER_WHEN, then=THEN)
    def edit_workspace_toml(self, jobs, when, then):
        self.ws.model.jobs = jobs
        self.ws.render(when)
        self.then(then)

    @enabled("edit_build_ninja")
    @rule(opt=st.sampled_from(ol.OPTS), extra_define=st.sampled_from((None, 1, 2)), when=RENDER_WHEN, then=THEN)
    def edit_build_ninja(self, opt, extra_define, when, then):
        """The compile's flags in the generator's build.ninja (a source of //c:obj)."""
        self.ws.model.opt, self.ws.model.extra_define = opt, extra_define
        self.ws.render(when)
        self.then(then)

    # -- the outputs and the store -------------------------------------------------------------
    @enabled("tamper_output")
    @rule(index=st.integers(0, 1000), how=st.sampled_from(choices("tamper_output", TAMPERS)), then=THEN)
    def tamper_output(self, index, how, then):
        files = ol.output_files(ol.snapshot(self.ws.root))
        if files:
            self.ws.tamper(files[index % len(files)], how)
        self.then(then)

    @enabled("delete_blob")
    @rule(of_output=st.booleans(), index=st.integers(0, 1000), then=THEN)
    def delete_blob(self, of_output, index, then):
        files = ol.output_files(ol.snapshot(self.ws.root))
        if of_output and files:
            self.ws.delete_blob_of(files[index % len(files)])
        else:
            self.ws.delete_blob(index)
        self.then(then)

    @enabled("remove_outputs")
    @rule(then=THEN)
    def remove_outputs(self, then):
        self.ws.remove_outputs()
        self.then(then)

    @enabled("gc")
    @rule(then=THEN)
    def gc(self, then):
        self.ws.gc()
        self.then(then)

    @rule(mode=st.sampled_from(ol.BUILD_MODES))
    def build(self, mode):
        type(self).steps_run += 1
        type(self).rules_run["build"] = type(self).rules_run.get("build", 0) + 1
        self.unbuilt = False
        self._build(mode)

    def teardown(self):
        if self.ws is None:
            return
        try:
            if self.unbuilt:
                self._build("plain")  # the last edits are checked too
        finally:
            shutil.rmtree(self.ws.base, ignore_errors=True)
            type(self).examples_run += 1
            if self.progress or VERBOSE:
                print(f"  example {self.examples_run}: {len(self.ws.recipe) - 1} steps, "
                      f"{self.steps_run} in all", flush=True)
            if VERBOSE:
                print("    " + "\n    ".join(self.ws.recipe), flush=True)


def run_machine(scratch: Path, seed: int, examples: int, steps: int, shrink: bool = True,
                deadline: float | None = None, machine_box: list | None = None,
                progress: bool = False) -> type[OracleMachine]:
    """Run the state machine with this seed; returns the machine class (its steps_run counts).
    With a deadline (time.monotonic()), no example starts after it: TimeUp is raised (the class
    is in machine_box[0] then)."""
    (scratch / "home").mkdir(parents=True, exist_ok=True)
    machine = type("OracleMachine", (OracleMachine,), {
        "scratch": scratch, "home": scratch / "home", "fresh": ol.Fresh(scratch, scratch / "home"),
        "seed_text": f"BGRAPH_ORACLE_SEED={seed} BGRAPH_ORACLE_EXAMPLES={examples} BGRAPH_ORACLE_STEPS={steps}"
                     + (f" BGRAPH_ORACLE_SKIP={','.join(sorted(SKIP))}" if SKIP else ""),
        "steps_run": 0, "rules_run": {}, "deadline": deadline, "failed": False, "first_failure": "",
        "examples_run": 0, "progress": progress})
    if machine_box is not None:
        machine_box.append(machine)
    phases = tuple(p for p in hypothesis.Phase if shrink or p is not hypothesis.Phase.shrink)
    run_state_machine_as_test(
        hypothesis.seed(seed)(machine),
        settings=settings(max_examples=examples, stateful_step_count=steps, deadline=None, database=None,
                          derandomize=False, print_blob=True, phases=phases,
                          suppress_health_check=list(HealthCheck)))
    return machine


def test_incremental_builds_equal_fresh_builds(tmp_path):
    print(f"oracle: BGRAPH_ORACLE_SEED={SEED}, {EXAMPLES} examples of up to {STEPS} steps")
    box: list = []
    try:
        machine = run_machine(tmp_path, SEED, EXAMPLES, STEPS, machine_box=box)
    except hypothesis.errors.FlakyStrategyDefinition as e:
        # A failure that did not repeat (a race, or bgraph's code changed under the run) ends as
        # Hypothesis's complaint about the draws alone: say what failed first.
        first = box[0].first_failure if box else ""
        raise AssertionError(f"{type(e).__name__}: {e}\n\nthe first failure seen:\n{first}") from e
    print(f"oracle: {machine.steps_run} steps, {machine.fresh.builds} fresh builds; rules run: "
          + ", ".join(f"{k} {v}" for k, v in sorted(machine.rules_run.items())))


# -- the cases, one deterministic sequence each ---------------------------------------------

@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    """One Fresh oracle for the module's named tests (its memo: the initial workspace is built
    with a fresh cache once)."""
    scratch = tmp_path_factory.mktemp("oracle")
    (scratch / "home").mkdir()
    yield ol.Fresh(scratch, scratch / "home")
    shutil.rmtree(scratch, ignore_errors=True)


@pytest.fixture
def ws(oracle, tmp_path) -> ol.Incremental:
    """The oracle's workspace, built once (and checked)."""
    ws = ol.Incremental(tmp_path / "example", oracle, oracle.home)
    ws.build()
    return ws


def test_mode_change_rebuilds(ws):
    """chmod +x of a source changes what the genrule sees (`test -x`), and chmod -x of the
    executable a genrule copies changes the output's mode; no content or mtime moves."""
    ws.chmod("in/b.txt", True)
    ws.build()
    ws.chmod(ol.TOOL, False)
    ws.build()


def test_mtime_put_back_rewrite_rebuilds(ws):
    """Other bytes of the same size, the old mtime put back (only ctime tells)."""
    ws.rewrite_keeping_mtime("in/b.txt", ol.text_of("in/b.txt", 555))
    ws.build()


def test_check_build_keeps_record_sound(ws):
    """A `--check` build of an edit, then the edit undone and a plain build: the plain build must
    not answer from the record of the build before the --check one, nor relink its outputs."""
    ws.write("in/b.txt", ol.text_of("in/b.txt", 101))
    ws.build("check")
    ws.write("in/b.txt", ol.text_of("in/b.txt", 100))
    ws.build()
    ws.write("in/b.txt", ol.text_of("in/b.txt", 102))
    ws.build("check")
    ws.build()


def test_tampered_output_not_relinked(ws):
    """An output written in place through bgraph-out/ (a hard link of the CAS blob, writable by
    root): the next build must give the right bytes again, not the damaged blob."""
    ws.tamper("p/files/cat.txt", "append")
    ws.build()
    ws.tamper("p/count/n.txt", "same-size")
    ws.build()


def test_tampered_output_mode_not_relinked(ws):
    """chmod of an output through bgraph-out/ changes the blob's mode. //p:tool's tool.sh is a
    copy of data/tool.sh, so its blob is also the source's: the next build must neither keep the
    wrong mode nor fail with "cannot materialize" (the source is there to store again)."""
    ws.tamper("p/tool/tool.sh", "chmod")
    ws.build()


def test_chmod_of_an_output_sharing_a_source_blob(ws):
    """//c:src copies proj/ verbatim, so its output after/d.h is the very blob the source
    proj/after/d.h was stored as. chmod through bgraph-out/ changes that blob's mode; a build on
    the full path (--check here; a plain build after a racy WORKSPACE.toml does the same) removes
    it as corrupted and must store the source again, not fail with "cannot materialize"."""
    ws.tamper("c/src/tree/after/d.h", "chmod")
    ws.build("check")


def test_damaged_tree_shared_by_parallel_actions(ws):
    """Both CMake custom commands mount the configure's output tree. With a blob of it deleted,
    each finds the materialized tree damaged ("materialized tree ... was changed; made again")
    and they remake it at once: one fails with FileNotFoundError or "Directory not empty". A
    race (about one build in three at -j 4 here), so six rounds."""
    for round_ in range(6):
        [tree] = [p.parent for p in (ws.cache / "v1" / "blake3" / "trees").glob("*/CMakeCache.txt")]
        ws.delete_blob_of_file(tree / "CMakeCache.txt", f"CMakeCache.txt in the configure's tree (round {round_})")
        ws.write("cm/parts/p1.txt", ol.text_of("cm/parts/p1.txt", 101 + round_ % 2))
        ws.build("j4")


def test_isystem_header_edit_mmd(ws):
    """-MMD leaves headers found through -isystem (system headers) out of the depfile: an edit of
    one must still recompile."""
    ws.write("proj/sys/s.h", ol.text_of("proj/sys/s.h", 321))
    ws.build()


def test_idirafter_header_edit_mmd(ws):
    """Likewise a header found through -idirafter (a system directory too)."""
    ws.write("proj/after/d.h", ol.text_of("proj/after/d.h", 321))
    ws.build()


def test_added_header_shadowing_an_isystem_one(ws):
    """A header added to an -I directory shadows the -isystem one of the same name."""
    ws.write("proj/inc/s.h", ol.text_of("proj/inc/s.h", 777))
    ws.build()


def test_cmake_file_glob_and_read(ws):
    """A file added to a configure-time file(GLOB), and an edit of a file(READ) input."""
    ws.write("cm/parts/p3.txt", ol.text_of("cm/parts/p3.txt", 100))
    ws.build()
    ws.write("cm/version.txt", ol.text_of("cm/version.txt", 200))
    ws.build()


def test_symlinked_source_edit(ws):
    """A source reached through a symlink in a glob: editing the file it points to, then
    pointing it elsewhere."""
    ws.write("data/one.txt", ol.text_of("data/one.txt", 101))
    ws.build()
    ws.retarget(ol.LINK, ol.LINK_TARGETS[1])
    ws.build()
