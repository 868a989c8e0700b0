"""The command line: bad arguments are one line and exit 2, before anything is built or written."""

from __future__ import annotations

import json

import pytest

from bgraph_testlib import requires_bwrap

GENRULE = {"targets/p.toml": '[a]\nkind = "genrule"\nouts = ["a.txt"]\ncmd = "echo a > $OUT/a.txt"\n'}


@pytest.mark.parametrize("size", ["inf", "nan", "-5G", "1e400", "20X", ""])
def test_gc_refuses_sizes_that_are_not_sizes(make_ws, size):
    run = make_ws({}).cli("cache", "gc", f"--max-size={size}")
    assert run.rc == 2 and f"not a size: {size!r}" in run.stderr, run.output
    assert "Traceback" not in run.output


def test_gc_sizes_are_powers_of_1024():
    from build_graph.cli import parse_size
    assert [parse_size(s) for s in ("0", "450K", "20G", "1.5T", "20GiB", "500mb")] == [
        0, 450 << 10, 20 << 30, int(1.5 * (1 << 40)), 20 << 30, 500 << 20]


def test_keygen_into_a_missing_directory_is_one_line(make_ws, tmp_path):
    run = make_ws({}).cli("cache", "keygen", str(tmp_path / "no" / "such" / "ci.key"))
    assert run.rc == 2 and "cannot write the key to" in run.stderr and "No such file" in run.stderr, run.output
    assert "Traceback" not in run.output


@requires_bwrap
def test_check_against_a_mistyped_directory_fails_before_building_and_makes_nothing(make_ws, tmp_path):
    ws = make_ws(GENRULE)
    typo = tmp_path / "cahce"
    run = ws.cli("build", "--check-against", str(typo), "//p:a")
    assert run.rc == 2 and "--check-against" in run.stderr and "no bgraph cache there" in run.stderr, run.output
    assert not typo.exists() and not ws.store.exists()  # nothing built, nothing made there
    assert ws.build("//p:a").rc == 0
    other = make_ws(GENRULE)
    assert other.build("//p:a", args=("--check-against", str(ws.cache))).json["compared_with_other_cache"] == 1


@requires_bwrap
def test_the_command_skips_teardown_but_finishes_its_work(make_ws):
    """`bgraph` leaves by os._exit after main (cli.run): its output is whole, its exit code is
    main's, and the exit handlers ran (no staging lease of the store is left behind)."""
    ws = make_ws(GENRULE)
    run = ws.cli("build", "--json", "//p:a")
    assert run.rc == 0 and json.loads(run.stdout)["executed"] == 1, run.output
    assert not list((ws.cache / "v1" / "tmp").glob("*.lock"))
    failed = ws.cli("build", "//p:nope")
    assert failed.rc == 2 and "no target" in failed.stderr, failed.output


@requires_bwrap
def test_keep_going_links_what_it_built_and_keeps_no_stale_output(make_ws):
    """`build -k` with one target failing: the targets it built are linked, so bgraph-out/ never
    shows an earlier build's output of a target this build rebuilt (a red-team read found the old
    link kept until the next successful build)."""
    ws = make_ws({"in.txt": "one\n",
                  "targets/p.toml": '[a]\nkind = "genrule"\nsrcs = ["in.txt"]\nouts = ["o"]\ncmd = "cat $SRC/in.txt > $OUT/o"\n'
                                    '[b]\nkind = "genrule"\nsrcs = ["in.txt"]\nouts = ["o"]\n'
                                    'cmd = "grep -q one $SRC/in.txt && echo b > $OUT/o"\n'})
    assert ws.build("//p:a", "//p:b").rc == 0
    ws.write({"in.txt": "two\n"})  # :b now fails
    run = ws.build("-k", "//p:a", "//p:b")
    assert run.rc != 0 and not run.json["ok"]
    assert ws.read_output("//p:a", "o") == "two\n"
    assert ws.read_output("//p:b", "o") == "b\n"  # the failed target keeps its last good output
    ws.write({"in.txt": "one\n"})
    again = ws.build("//p:a", "//p:b")
    assert again.rc == 0 and ws.read_output("//p:a", "o") == "one\n"
