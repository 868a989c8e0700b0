"""Every bad input the project knows of, fed to the real CLI: each is one error line (plus a
hint), a non-zero exit, and never a traceback. The transcript of all of them is written to
`bad-inputs.log` in the test's directory, for a person (or `grep -n Traceback`) to read."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from bgraph_testlib import requires_bwrap

GENRULE = '[a]\nkind = "genrule"\nouts = ["o"]\ncmd = "echo a > $OUT/o"\n'
PATCH = "--- a/hello.txt\n+++ b/hello.txt\n@@ -1,1 +1,1 @@\n-nothing like it\n+x\n"
PATCHED = ('[orig]\nkind = "genrule"\nouts = ["hello.txt"]\ncmd = "echo hi > hello.txt"\n\n'
           '[patched]\nkind = "patched_tree"\nsrc = ":orig"\npatches = ["patches/p/*.patch"]\n')
PIN = ('[workspace]\nname = "t"\n\n[pins.x]\nkind = "url"\nurl = "file://{path}"\nsha256 = "' + "f" * 64 + '"\n')


def _tar_escaping(path: Path) -> str:
    import io
    import tarfile
    with tarfile.open(path, "w:gz") as tf:
        info = tarfile.TarInfo("../../escaped.txt")
        info.size = 2
        tf.addfile(info, io.BytesIO(b"x\n"))
    return hashlib.sha256(path.read_bytes()).hexdigest()


CASES = {
    "not UTF-8": ({"targets/p.toml": b'[a]\nkind = "genrule"\ncmd = "caf\xe9"\n'}, ["build", "//p:a"]),
    "malformed TOML": ({"targets/p.toml": '[a]\nkind = "genrule"\nouts = ["o"\n'}, ["build", "//p:a"]),
    "unknown key": ({"targets/p.toml": GENRULE + "bogus = 1\n"}, ["build", "//p:a"]),
    "unknown kind": ({"targets/p.toml": '[a]\nkind = "genrul"\n'}, ["build", "//p:a"]),
    "bad label": ({"targets/p.toml": GENRULE}, ["build", "//p:a:b"]),
    "unknown label": ({"targets/p.toml": GENRULE}, ["build", "//p:b"]),
    "cycle": ({"targets/p.toml": '[a]\nkind = "genrule"\nouts = ["o"]\ncmd = "true"\ndeps = { b = ":b" }\n'
                                 '[b]\nkind = "genrule"\nouts = ["o"]\ncmd = "true"\ndeps = { a = ":a" }\n'},
              ["build", "//p:a"]),
    "missing source": ({"targets/p.toml": '[a]\nkind = "genrule"\nsrcs = ["nope.txt"]\nouts = ["o"]\ncmd = "true"\n'},
                       ["build", "//p:a"]),
    "unreadable source": ({"targets/p.toml": '[a]\nkind = "genrule"\nsrcs = ["in.txt"]\nouts = ["o"]\ncmd = "true"\n',
                           "in.txt": Path("/proc/self/mem")}, ["build", "//p:a"]),
    "patch that does not apply": ({"targets/p.toml": PATCHED, "patches/p/0001.patch": PATCH},
                                  ["build", "//p:patched"]),
    "gc size inf": ({}, ["cache", "gc", "--max-size=inf"]),
    "gc size negative": ({}, ["cache", "gc", "--max-size=-5G"]),
    "keygen into a missing directory": ({}, ["cache", "keygen", "no/such/dir/ci.key"]),
    "check-against a mistyped cache": ({"targets/p.toml": GENRULE}, ["build", "--check-against", "/no/cahce", "//p:a"]),
    "bad query": ({"targets/p.toml": GENRULE}, ["query", "deps(//p:a"]),
    "pin filename that is a path": ({"WORKSPACE.toml": PIN.format(path="/tmp/f.txt") + 'filename = "../evil"\n',
                                     "targets/p.toml": '[x]\nkind = "http_archive"\npin = "x"\n'}, ["build", "//p:x"]),
    "target name of 300 characters": ({"targets/p.toml": GENRULE.replace("[a]", "[" + "a" * 300 + "]")},
                                      ["build", "//p:" + "a" * 300]),
    "exec with no command": ({"targets/p.toml": GENRULE}, ["exec", "//p:a"]),
    "exec with only --": ({"targets/p.toml": GENRULE}, ["exec", "//p:a", "--"]),
    "query kind with a bad regex": ({"targets/p.toml": GENRULE}, ["query", "kind([, //...)"]),
    "query nested 2,000 deep": ({"targets/p.toml": GENRULE}, ["query", "deps(" * 2000 + "//p:a" + ")" * 2000]),
    "unwritable profile": ({"targets/p.toml": GENRULE, "f.txt": "a file, not a directory\n"},
                           ["build", "--profile", "f.txt/p.json", "//p:a"]),
    "cache dir is a file": ({"targets/p.toml": GENRULE, "f.txt": "a file\n"}, ["--cache-dir", "f.txt", "build", "//p:a"]),
    "malformed Debian lock": ({"targets/d.toml": '[sys]\nkind = "deb_packages"\nlock = "d.lock.json"\n'
                                                 'packages = ["hello"]\n',
                               "d.lock.json": '{"lock_version": 1, "platforms": {"x86_64": 3, "aarch64": 3}}'},
                              ["build", "//d:sys"]),
    "Debian lock with a bad package entry": (
        {"targets/d.toml": '[sys]\nkind = "deb_packages"\nlock = "d.lock.json"\npackages = ["hello"]\n',
         "d.lock.json": '{"lock_version": 1, "platforms": {"x86_64": {"packages": [{"package": 1}]}, '
                        '"aarch64": {"packages": [{"package": 1}]}}}'}, ["build", "//d:sys"]),
    "TOML nested past the parser's recursion": ({"targets/p.toml": GENRULE + "z = " + "[" * 1000 + "]" * 1000 + "\n"},
                                                ["build", "//p:a"]),
    "WORKSPACE.toml nested deeply, for query": (
        {"WORKSPACE.toml": '[workspace]\nname = "t"\nx = ' + "{a=" * 1000 + "}" * 1000 + "\n",
         "targets/p.toml": GENRULE}, ["query", "//..."]),
    "TOML nested 100 deep": ({"targets/p.toml": GENRULE + "z = " + "[" * 100 + "]" * 100 + "\n"}, ["build", "//p:a"]),
    "tools naming a target that is no system": (
        {"targets/p.toml": GENRULE + '[b]\nkind = "genrule"\nouts = ["o"]\ncmd = "true"\ntools = ":a"\n'},
        ["build", "//p:b"]),
    "NUL byte in a command": ({"targets/p.toml": GENRULE.replace("echo a", "echo a\\u0000b")}, ["build", "//p:a"]),
    "empty arch set": ({"WORKSPACE.toml": '[workspace]\nname = "t"\n\n[arch_sets]\nnone = []\n',
                        "targets/p.toml": GENRULE}, ["build", "//p:a"]),
    "-j 0": ({"targets/p.toml": GENRULE}, ["build", "-j", "0", "//p:a"]),
    "-j negative": ({"targets/p.toml": GENRULE}, ["build", "-j", "-1", "//p:a"]),
    "--max-mem negative": ({"targets/p.toml": GENRULE}, ["build", "--max-mem", "-5", "//p:a"]),
    "--check-sample negative": ({"targets/p.toml": GENRULE}, ["build", "--check-sample", "-3", "//p:a"]),
    "table name ending in a newline": ({"targets/p.toml": GENRULE + GENRULE.replace("[a]", '["a\\n"]')},
                                       ["build", "//p:a"]),
    "label argument ending in a newline": ({"targets/p.toml": GENRULE}, ["build", "//p:a\n"]),
}


@requires_bwrap
@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_is_one_line_and_never_a_traceback(make_ws, case, tmp_path):
    files, argv = CASES[case]
    ws = make_ws({k: v for k, v in files.items() if not isinstance(v, Path)})
    for rel, target in ((k, v) for k, v in files.items() if isinstance(v, Path)):
        (ws.root / rel).symlink_to(target)
    run = ws.cli(*argv)
    with open(tmp_path.parent / "bad-inputs.log", "a") as log:
        log.write(f"== {case}: bgraph {' '.join(argv)} (exit {run.rc})\n{run.output}\n")
    assert run.rc != 0, run.output
    assert "Traceback" not in run.output and "File \"" not in run.output, run.output
    # One error line (bgraph's "error: …", or argparse's "bgraph …: error: …" for a bad option).
    errors = [line for line in run.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, run.output


@requires_bwrap
def test_a_download_whose_bytes_differ_from_the_pin(make_ws, tmp_path):
    wrong = tmp_path / "x.tar.gz"
    _tar_escaping(wrong)
    ws = make_ws({"WORKSPACE.toml": PIN.format(path=wrong),
                  "targets/p.toml": '[x]\nkind = "http_archive"\npin = "x"\n'})
    ws.env["BGRAPH_FILE_URL_DIRS"] = str(tmp_path)  # outside the workspace: the user allows it
    run = ws.cli("build", "//p:x")
    assert run.rc == 1 and "sha256 mismatch" in run.stderr and "Traceback" not in run.output


@requires_bwrap
def test_an_archive_entry_escaping_the_root(make_ws, tmp_path):
    bad = tmp_path / "x.tar.gz"
    sha = _tar_escaping(bad)
    ws = make_ws({"WORKSPACE.toml": PIN.format(path=bad).replace("f" * 64, sha),
                  "targets/p.toml": '[x]\nkind = "http_archive"\npin = "x"\n\n[u]\nkind = "extract"\nsrc = ":x"\n'})
    ws.env["BGRAPH_FILE_URL_DIRS"] = str(tmp_path)  # outside the workspace: the user allows it
    run = ws.cli("build", "//p:u")
    assert run.rc == 1 and "escapes the archive root" in run.stderr and "Traceback" not in run.output


@requires_bwrap
def test_a_file_name_that_is_not_utf8(make_ws):
    """A non-UTF-8 name a glob matches is one error naming it; elsewhere in the workspace it
    changes nothing (every build and query ended in a TypeError)."""
    ws = make_ws({"targets/p.toml": GENRULE + '\n[g]\nkind = "genrule"\nsrcs = ["d/*"]\nouts = ["o"]\n'
                                              'cmd = "ls $SRC/d > $OUT/o"\n', "d/ok.txt": "x\n"})
    (ws.root / "notes").mkdir()
    with open(bytes(ws.root / "notes") + b"/caf\xe9.md", "w") as f:
        f.write("latin-1 name\n")
    for argv in (["build", "//p:a"], ["build", "//p:a"], ["query", "deps(//p:a)"]):
        run = ws.cli(*argv)
        assert run.rc == 0 and "Traceback" not in run.output, run.output
    with open(bytes(ws.root / "d") + b"/caf\xe9.txt", "w") as f:
        f.write("x\n")
    run = ws.cli("build", "//p:g")
    assert run.rc != 0 and "Traceback" not in run.output
    errors = [line for line in run.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "not valid UTF-8" in errors[0] and "caf\\xe9" in errors[0], run.output


@requires_bwrap
def test_a_damaged_record_memo_or_kept_parse_is_ignored(make_ws):
    ws = make_ws({"targets/p.toml": GENRULE})
    assert ws.cli("build", "//p:a").rc == 0
    import sqlite3

    from build_graph.store.statefile import STATE_FILE
    with sqlite3.connect(ws.store / STATE_FILE) as db:  # the rows of the record, the memo and the kept parse
        db.execute("UPDATE records SET record = ?, memo = ?", (b"\x00garbage{", b"\x00garbage{"))
        db.execute("UPDATE parses SET parse = ?", (b"\x00garbage{",))
    run = ws.cli("build", "//p:a")
    assert run.rc == 0 and "Traceback" not in run.output, run.output


@pytest.mark.parametrize("path", ["/run", "/var/run/docker.sock", "/tmp", "/proc", "/"])
def test_a_host_path_holding_the_hosts_sockets_is_refused(make_ws, path):
    """A read-only bind still lets an action connect() to a Unix socket under it (red-team read K6)."""
    ws = make_ws({"targets/toolchains.toml": f'[host]\nkind = "host_tools"\npaths = ["/usr", "{path}"]\n'
                                             'tools = ["/usr/bin/sh"]\n',
                  "targets/p.toml": '[a]\nkind = "genrule"\nouts = ["a"]\ncmd = "true > $OUT/a"\n'})
    run = ws.cli("build", "//p:a")
    assert run.rc != 0 and "holds the host's sockets or live state" in run.stderr and "Traceback" not in run.output


def _one_error(run) -> str:
    """The one error line of a failed run, which must have no traceback."""
    assert run.rc != 0 and "Traceback" not in run.output, run.output
    errors = [line for line in run.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, run.output
    return errors[0]


@requires_bwrap
@pytest.mark.parametrize("rel", ["targets/f.toml", "WORKSPACE.toml"])
def test_a_fifo_where_a_toml_file_belongs(make_ws, rel):
    """A FIFO at targets/f.toml or WORKSPACE.toml hung every command (the read waits for a writer):
    it is refused without being opened, and the previous output stays a hit."""
    ws = make_ws({"targets/p.toml": GENRULE})
    assert ws.cli("build", "//p:a").rc == 0
    saved = (ws.root / "WORKSPACE.toml").read_bytes()
    (ws.root / rel).unlink(missing_ok=True)
    os.mkfifo(ws.root / rel)
    for argv in (["build", "//p:a"], ["query", "//..."]):
        assert _one_error(ws.cli(*argv, timeout=60)).endswith(f"{rel}: not a regular file: it is a FIFO")
    (ws.root / rel).unlink()
    (ws.root / "WORKSPACE.toml").write_bytes(saved)
    run = ws.build("//p:a")
    assert run.rc == 0 and run.json["executed"] == 0, run.output


@requires_bwrap
def test_an_empty_cache_dir_is_refused(make_ws, tmp_path):
    """`--cache-dir ''` (a script's unset variable) was no flag: the build went to
    ~/.cache/bgraph. Each command refuses it and writes no cache anywhere."""
    ws = make_ws({"targets/p.toml": GENRULE})
    home = tmp_path / "home"
    home.mkdir()
    for argv in (["build", "//p:a"], ["query", "//..."], ["cache", "gc"]):
        line = _one_error(ws.cli("--cache-dir", "", *argv, env={"HOME": str(home), "XDG_CACHE_HOME": str(home)}))
        assert line == "error: --cache-dir is empty", line
    # (Python's bytecode of bgraph may be kept there: launch.keep_bytecode; no cache)
    assert [p.name for p in home.iterdir()] in ([], ["bgraph-bytecode"]) and not ws.cache.exists()


@requires_bwrap
def test_peaks_json_of_the_wrong_shape_is_ignored(make_ws):
    """Valid JSON of the wrong shape in the cache's peaks.json ("x" or a list for a peak) failed the
    next build with 'TypeError … bug in bgraph's rule': its entries are dropped, as a damaged state
    file's rows are, and the next save writes the file without them."""
    import json
    ws = make_ws({"targets/p.toml": GENRULE})
    assert ws.cli("build", "//p:a").rc == 0
    bad = {"//p:b genrule": "x", "//p:a genrule": [1], "//p:c genrule": True, "//p:d genrule": {"a": 1}}
    (ws.store / "peaks.json").write_text(json.dumps(bad))
    (ws.root / "targets/p.toml").write_text(GENRULE + GENRULE.replace("[a]", "[b]").replace("echo a", "echo b"))
    run = ws.build("//p:a", "//p:b")
    assert run.rc == 0 and "Traceback" not in run.output and run.json["executed"] == 1, run.output
    peaks = json.loads((ws.store / "peaks.json").read_text())
    assert not set(bad) & {k for k, v in peaks.items() if not isinstance(v, int)}, peaks


@requires_bwrap
@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (a device that is always full)")
def test_a_profile_on_a_full_disk_names_the_profile(make_ws):
    """--profile on a full device blamed the cache directory and hinted at `cache gc`: the error
    names the profile file; the build itself is done and linked."""
    ws = make_ws({"targets/p.toml": GENRULE})
    run = ws.cli("build", "--profile", "/dev/full", "//p:a")
    line = _one_error(run)
    assert line == "error: cannot write the profile to /dev/full: No space left on device", run.output
    assert run.rc == 2 and "cache gc" not in run.output and "OK: executed 1" in run.output, run.output
    assert (ws.root / "bgraph-out/p/a/o").read_text() == "a\n"


def test_an_output_named_in_another_encoding_is_one_line(make_ws):
    """An action's output whose name is not UTF-8 (a tree path is text) was 'TypeError: str is not
    valid UTF-8' naming nothing."""
    ws = make_ws({"targets/p.toml": '[a]\nkind = "genrule"\nouts = ["d"]\n'
                                    'cmd = "mkdir $OUT/d && touch $OUT/d/$(printf \'caf\\\\351\')"\n'})
    run = ws.cli("build", "//p:a")
    assert run.rc != 0 and "output b'd/caf\\xe9' has a name that is not valid UTF-8" in run.stderr, run.output
    assert "Traceback" not in run.output and "TypeError" not in run.output


WHEEL_TOOLS = '[host]\nkind = "host_tools"\npaths = ["/usr"]\ntools = ["/usr/bin/sh", "/usr/bin/python3"]\n'
WHEEL_SDIST = ('[gen]\nkind = "genrule"\nouts = ["x", "w", "ep.txt"]\n'
               'cmd = "echo x > $OUT/x && mkdir $OUT/w && echo y > $OUT/w/x && printf \'[a]\\\\nb = c:d\\\\n\' > $OUT/ep.txt"\n')
WHEEL_MISTAKES = {  # target body -> (its attribute named in the error, words of the error)
    'files = { "../x" = [":gen", "x"] }': ("files", "files['../x']: '../x' is not a path inside the wheel"),
    'files = { "/abs/x" = [":gen", "x"] }': ("files", "files['/abs/x']: '/abs/x' is not a path inside the wheel"),
    'libs = { "../l.so" = ":gen" }': ("libs", "libs['../l.so']: '../l.so' is not a path inside the wheel"),
    'libs = { "w/l.so" = ":gen" }': ("libs", "libs['w/l.so']: :gen provides no shared library"),
    'dirs = { "/abs" = ":gen" }': ("dirs", "dirs['/abs']: '/abs' is not a path inside the wheel"),
    'srcs = ["w/x"]\nfiles = { "w/x" = [":gen", "x"] }': ("files", "w/x in the wheel comes from both srcs (w/x) and "
                                                                   "files['w/x'] (x of :gen)"),
    'srcs = ["w/x"]\nstrip_prefix = "w"\ntree = ":gen"\ninclude = ["x"]': (
        "include", "x in the wheel comes from both srcs (w/x) and include (x of :gen)"),
    'srcs = ["w/x"]\ntree = ":gen"\ntree_dirs = { "w" = "w" }': ("tree_dirs", "w/x in the wheel comes from both srcs "
                                                                          "(w/x) and tree_dirs['w'] (w/x of :gen)"),
    'tree = ":gen"\ninclude = ["x"]\nentry_points_from = "ep.txt"\nfiles = { "w-1.dist-info/entry_points.txt" = [":gen", "x"] }': (
        "files", "w-1.dist-info/entry_points.txt in the wheel comes from both entry_points_from (ep.txt) and files"),
    'files = { "w-1.dist-info/METADATA" = [":gen", "x"] }': ("files", "is written by the wheel itself"),
    'srcs = ["w/x"]\nfiles = { "w" = [":gen", "x"] }': ("files", "w in the wheel is a file from files['w'] (x of "
                                                                 ":gen), and a directory for w/x from srcs (w/x)"),
}


@requires_bwrap
@pytest.mark.parametrize("body", sorted(WHEEL_MISTAKES))
def test_a_py_wheel_mistake_names_the_target_and_its_attribute(make_ws, body):
    """A destination out of the wheel, or two files for one place, is the user's mistake: one line
    naming the target and the attribute, with a hint, never "a bug in bgraph's rule" (red-team K13, hole 3)."""
    key, words = WHEEL_MISTAKES[body]
    ws = make_ws({"targets/toolchains.toml": WHEEL_TOOLS, "w/x": "other\n",
                  "targets/p.toml": WHEEL_SDIST + f'\n[w]\nkind = "py_wheel"\ndistribution = "w"\nversion = "1"\n{body}\n'})
    run = ws.cli("build", "//p:w")
    error = _one_error(run)
    assert error.startswith(f"error: //p:w (targets/p.toml [w] key '{key}'): "), error
    assert words in error, error
    assert "bug in bgraph" not in run.output and "hint:" in run.stderr, run.output
