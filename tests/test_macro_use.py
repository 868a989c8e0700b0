"""macro_use: the command-line macros a GCC run did not depend on, and the gcc_macro_use plugin
that records them, checked against GCC itself (the pinned GCC 12, in the sandbox)."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bgraph_testlib import copy_toolchains
from build_graph import macro_use
from build_graph.macro_use import Record, compare, parse_record, split


def test_split_takes_out_the_arch_macros_only():
    rest, ops = split(["gcc", "-D__CUDA_ARCH__=1200", "-E", "-D__CUDA_ARCH_LIST__=1000,1200", "-UA",
                       "-D__CUDA_ARCH_FEAT_SM120_ALL", "-DT=half", "-D__CUDA_ARCH__=1210", "x.c", "-o", "x.ii"])
    assert rest == ["gcc", "-E", "-UA", "-DT=half", "x.c", "-o", "x.ii"]  # a user's define is matched exactly
    assert ops == {"__CUDA_ARCH__": ["-D__CUDA_ARCH__=1200", "-D__CUDA_ARCH__=1210"],
                   "__CUDA_ARCH_LIST__": ["-D__CUDA_ARCH_LIST__=1000,1200"],
                   "__CUDA_ARCH_FEAT_SM120_ALL": ["-D__CUDA_ARCH_FEAT_SM120_ALL"]}


@pytest.mark.parametrize("arg", ["-D", "-U", "-DF(x)=x", "-D1A", "@args.rsp", "-Wp,-DA", "-Xpreprocessor",
                                 "-dM", "-dD", "-dU", "-dMI", "-g3", "-ggdb3", "-fdirectives-only", "-traditional-cpp",
                                 "--define-macro=A", "-save-temps", "-save-temps=obj", "-no-integrated-cpp",
                                 "-D__CUDA_ARCH_LIST__=/*", "-D__CUDA_ARCH__=##x"])
def test_split_refuses_command_lines_that_carry_or_print_macros_elsewhere(arg):
    assert split(["gcc", "-DA=1", arg, "x.c"]) is None


def test_parse_record_and_its_refusals():
    rec = parse_record("bgraph-macro-use 1\nwatch __CUDA_ARCH\nused A\nseen __CUDA_ARCH_X\n")
    assert rec == Record(frozenset({"A"}), frozenset({"__CUDA_ARCH_X"}), "__CUDA_ARCH")
    assert Record.from_json(rec.to_json()) == rec
    assert parse_record("bgraph-macro-use 1\nincomplete\n") is None
    assert parse_record("bgraph-macro-use 1\nused A\n") is None  # no watch line: cut short
    assert parse_record("bgraph-macro-use 2\nwatch X\n") is None
    assert parse_record("bgraph-macro-use 1\nwatch X\nbgraph-macro-use 1\nwatch X\n") is None  # two cc1 runs
    assert parse_record("") is None


REC = Record(used=frozenset({"USED"}), seen=frozenset({"__CUDA_ARCH_SEEN"}), watch="__CUDA_ARCH")


@pytest.mark.parametrize("before, now, unused", [
    ({"N": ["-DN=1"]}, {"N": ["-DN=2"]}, ["N"]),                        # a value the run never read
    ({"N": ["-DN=1"]}, {}, ["N"]),                                      # gone
    ({"N": ["-DN"]}, {"N": ["-UN"]}, ["N"]),
    ({}, {"__CUDA_ARCH_NEW": ["-D__CUDA_ARCH_NEW"]}, ["__CUDA_ARCH_NEW"]),  # a watched name never met
])
def test_compare_accepts_only_what_the_run_provably_ignored(before, now, unused):
    assert compare(before, now, REC) == (unused, [])


@pytest.mark.parametrize("before, now, why", [
    ({"USED": ["-DUSED=1"]}, {"USED": ["-DUSED=2"]}, "that run used USED"),
    ({}, {"__CUDA_ARCH_SEEN": ["-D__CUDA_ARCH_SEEN"]}, "may have met it"),  # the run met the identifier
    ({}, {"OTHER": ["-DOTHER"]}, "may have met it"),                        # not watched: unknown
    ({"N": ["-UN"]}, {"N": ["-DN"]}, "may have met it"),
    ({"N": ["-DN=1"]}, {"N": ["-DN=1", "-DN=2"]}, "more than once"),
])
def test_compare_refuses_the_rest(before, now, why):
    unused, blocking = compare(before, now, REC)
    assert unused == [] and len(blocking) == 1 and why in blocking[0]
    assert compare({"N": ["-DN=1"]}, {"N": ["-DN=2"]}, None)[1]  # no record: only equal macros fit


# -- the plugin in the pinned GCC, against GCC's own output --------------------------------

# Four arch macros (their -D/-U leave the prekey) and one user macro (it stays in it).
NAMES = ["__CUDA_ARCH__", "__CUDA_ARCH_LIST__", "__CUDA_ARCH_FEAT_SM100_ALL", "__CUDA_ARCH_SPECIFIC__", "A"]
OPS = [None, "-D{}", "-D{}=0", "-D{}=1", "-D{}=2", "-U{}"]


def _source(rng: random.Random, names: list[str]) -> str:
    """A random C file reading `names` every way the preprocessor can (and some it cannot)."""
    lines = ["#define PASTE(x) __CUDA_ARCH_##x", "#define STR(x) #x", "#define DROP(x) 0", "#define ID(x) x"]
    for k in range(rng.randint(3, 9)):
        n = rng.choice(names)
        form = rng.randrange(13)
        if form == 0:
            lines += [f"#if {n}", f"int v{k} = 1;", "#endif"]
        elif form == 1:
            lines += [f"#ifdef {n}", f"int v{k} = 2;", "#else", f"int v{k} = 3;", "#endif"]
        elif form == 2:
            lines += [f"#if defined({n}) && {n} > 1", f"int v{k};", "#endif"]
        elif form == 3:
            lines.append(f"int v{k} = {n};")  # expanded, or an identifier left as it is
        elif form == 4:
            lines.append(f'const char *v{k} = STR({n});')  # stringized: never expanded
        elif form == 5:
            lines.append(f"int v{k} = DROP({n});")  # an argument never used
        elif form == 6:
            lines.append(f"int v{k} = ID({n});")  # an argument expanded
        elif form == 7:
            lines += [f"#define {n} 7", f"int v{k} = {n};"]  # redefined in the file
        elif form == 8:
            lines.append(f"#undef {n}")
        elif form == 9:
            lines += ["#if 0", f"int v{k} = {n};", "#endif"]  # skipped
        elif form == 10:
            lines.append(f"int v{k} = PASTE({rng.choice(['LIST__', 'FEAT_SM100_ALL', '_'])});")  # pasted
        elif form == 11:
            lines += ["#if PASTE(FEAT_SM100_ALL) || 0", f"int v{k};", "#endif"]
        else:
            lines += [f"#define INDIRECT{k} {n}", f"int v{k} = INDIRECT{k};"]
    return "\n".join(lines) + "\n"


def _commands(rng: random.Random, count: int) -> list[list[str]]:
    """A random -D/-U set over every name, and variants of it with one or two names redrawn."""
    base = {n: rng.choice(OPS) for n in NAMES}
    out = []
    for _ in range(count):
        ops = dict(base)
        for n in rng.sample(NAMES, rng.randint(1, 2)):
            ops[n] = rng.choice(OPS)
        line = [op.format(n) for n, op in ops.items() if op]
        rng.shuffle(line)
        out.append(line)
    return out


@pytest.fixture(scope="module")
def gcc_runs(module_tmp) -> tuple[dict, Path]:
    """60 random files, 8 random command lines each, run through the pinned GCC with the plugin
    in one sandboxed genrule: (the cases, the directory of outputs and records)."""
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap not installed")
    ws = module_tmp / "ws"
    copy_toolchains(ws)
    rng = random.Random(20261126)
    cases, script = {}, ["set -e"]
    plugin = "$IN_PLUGIN/gcc_macro_use.so"
    for i in range(60):
        (ws / "cases").mkdir(parents=True, exist_ok=True)
        (ws / "cases" / f"c{i}.c").write_text(_source(rng, rng.sample(NAMES, rng.randint(1, 3))))
        cases[i] = _commands(rng, 8)
        for j, ops in enumerate(cases[i]):
            args = " ".join([*ops, *macro_use.plugin_args(plugin, f"$OUT/c{i}.{j}.rec")])  # no shell characters
            script.append(f"gcc -E -x c {args} $SRC/cases/c{i}.c -o $OUT/c{i}.{j}.i 2>/dev/null")
    # -dD takes over the define callback: the record must say it is incomplete.
    script.append(f"gcc -E -dD -DA=1 {' '.join(macro_use.plugin_args(plugin, '$OUT/dD.rec'))} "
                  "$SRC/cases/c0.c -o /dev/null")
    (ws / "cases" / "run.sh").write_text("\n".join(script) + "\n")
    outs = [f"c{i}.{j}.{ext}" for i in cases for j in range(8) for ext in ("i", "rec")] + ["dD.rec"]
    (ws / "targets" / "cases.toml").write_text(
        '[runs]\nkind = "genrule"\nsrcs = ["cases/*"]\ntools = "//toolchains:host-cc"\n'
        'deps = { plugin = "//toolchains:gcc-macro-use" }\n'
        f"outs = {json.dumps(outs)}\ncmd = \"sh $SRC/cases/run.sh\"\n")
    proc = subprocess.run([sys.executable, "-m", "build_graph", "-C", str(ws), "--cache-dir", str(module_tmp / "cache"),
                           "build", "--json", "//cases:runs"], capture_output=True, text=True)
    summary = json.loads(proc.stdout)
    assert summary["ok"], summary["errors"]
    return cases, Path(summary["outputs"]["//cases:runs"])


def test_a_run_fits_every_command_line_the_record_allows(gcc_runs):
    """For every two command lines of one file: where the first run's record says the macros
    that differ were never consulted, GCC's output is byte-identical."""
    cases, out = gcc_runs
    fitting = differing_outputs = 0
    for i, commands in cases.items():
        for j, before in enumerate(commands):
            record = parse_record((out / f"c{i}.{j}.rec").read_text())
            assert record is not None
            rest_before, ops_before = split(before)
            for k, now in enumerate(commands):
                rest_now, ops_now = split(now)
                unused, blocking = compare(ops_before, ops_now, record)
                if rest_now != rest_before:  # another prekey: never compared
                    unused, blocking = [], ["other arguments"]
                same = (out / f"c{i}.{j}.i").read_bytes() == (out / f"c{i}.{k}.i").read_bytes()
                if unused and not blocking:
                    fitting += 1
                    assert same, (f"c{i}.c: {before} -> {now}: the record says {unused} were not used",
                                  (out / f"c{i}.{j}.rec").read_text())
                differing_outputs += not same
    # The check is not empty: many pairs fit, and the files do depend on their macros.
    assert fitting >= 400 and differing_outputs >= 800, (fitting, differing_outputs)


def test_the_plugin_names_each_way_a_macro_is_read(gcc_runs):
    cases, out = gcc_runs
    assert parse_record((out / "dD.rec").read_text()) is None  # -dD took a callback over
    records = [parse_record((out / f"c{i}.{j}.rec").read_text()) for i in cases for j in range(8)]
    assert all(r is not None and r.watch == macro_use.WATCH for r in records)
    assert any("__CUDA_ARCH_FEAT_SM100_ALL" in r.seen for r in records)  # pasted together by PASTE()
    assert any(r.used for r in records) and any(not r.used for r in records)
