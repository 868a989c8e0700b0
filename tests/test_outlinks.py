"""bgraph-out/ links are made and read without following a link below bgraph-out/ (outlinks.py):
an older target's link where a directory goes now never leads into a stored output."""

import os

import pytest

from build_graph.errors import StoreError
from build_graph.store import outlinks


def _tree(path) -> dict[str, str]:
    return {os.path.relpath(os.path.join(d, n), path): "" for d, ds, ns in os.walk(path) for n in ds + ns}


def test_an_older_link_on_the_way_is_replaced_by_a_directory_never_followed(tmp_path):
    stored = tmp_path / "stored"  # another target's output in the cache
    stored.mkdir()
    (stored / "f").write_text("outer\n")
    out = tmp_path / "bgraph-out"
    outlinks.place(out, "p/w", str(stored))
    outlinks.place(out, "p/w/x", str(tmp_path / "inner"))
    assert _tree(stored) == {"f": ""}  # nothing made inside the stored tree
    assert (out / "p" / "w").is_dir() and not (out / "p" / "w").is_symlink()
    assert os.readlink(out / "p" / "w" / "x") == str(tmp_path / "inner")
    assert outlinks.read(out, "p/w/x") == str(tmp_path / "inner")


def test_a_directory_of_links_where_a_link_goes_is_replaced_and_anything_else_refused(tmp_path):
    out = tmp_path / "bgraph-out"
    outlinks.place(out, "p/w/x", "/nowhere/x")
    outlinks.place(out, "p/w/sub/y", "/nowhere/y")
    outlinks.place(out, "p/w", "/nowhere/w")
    assert os.readlink(out / "p" / "w") == "/nowhere/w"
    outlinks.place(out, "q/w/x", "/nowhere/x")
    (out / "q" / "w" / "mine.txt").write_text("a user's file\n")
    with pytest.raises(StoreError, match="not one of bgraph's links"):
        outlinks.place(out, "q/w", "/nowhere/w")
    assert (out / "q" / "w" / "mine.txt").read_text() == "a user's file\n"  # nothing removed
    assert os.readlink(out / "q" / "w" / "x") == "/nowhere/x"
    assert not [n for n in os.listdir(out / "q") if n.startswith(".")]  # no half-made link left


def test_read_does_not_follow_a_link_on_the_way(tmp_path):
    stored = tmp_path / "stored"
    stored.mkdir()
    os.symlink("/elsewhere", stored / "x")
    out = tmp_path / "bgraph-out"
    outlinks.place(out, "p/w", str(stored))
    assert os.readlink(out / "p" / "w" / "x") == "/elsewhere"  # what following would find
    assert outlinks.read(out, "p/w/x") is None
    assert outlinks.read(out, "p/w") == str(stored)


def test_overlap():
    assert outlinks.overlap(["p/w", "q", "p/w/x"]) == ("p/w", "p/w/x")
    assert outlinks.overlap(["p", "p/w"]) == ("p", "p/w")
    assert outlinks.overlap(["p/w", "p/wx", "p/v/w"]) is None


def _genrules(make_ws):
    return make_ws({"targets/p.toml": '[w]\nkind = "genrule"\nouts = ["f"]\ncmd = "echo outer > $OUT/f"\n',
                    "targets/p/w.toml": '[x]\nkind = "genrule"\nouts = ["g"]\ncmd = "echo inner > $OUT/g"\n'})


def test_a_target_below_an_older_targets_link_leaves_its_output_alone(make_ws):
    ws = _genrules(make_ws)
    first = ws.build("//p:w")
    assert first.rc == 0, first.stderr
    stored = os.readlink(ws.root / "bgraph-out" / "p" / "w")
    assert ws.build("//p/w:x").rc == 0
    assert sorted(os.listdir(stored)) == ["f"]  # was ["f", "x"]: a link made inside the stored tree
    assert ws.read_output("//p/w:x", "g").strip() == "inner"
    again = ws.build("//p:w")  # and back: the directory of links gives way to //p:w's link
    assert again.rc == 0, again.stderr
    assert sorted(os.listdir(ws.root / "bgraph-out" / "p" / "w")) == ["f"]


def test_two_requested_targets_whose_links_overlap_are_one_line(make_ws):
    ws = _genrules(make_ws)
    run = ws.cli("build", "//p:w", "//p/w:x")
    assert run.rc != 0 and "Traceback" not in run.stderr
    assert "//p:w (bgraph-out/p/w) and //p/w:x (bgraph-out/p/w/x) overlap" in run.stderr, run.stderr
    assert not (ws.root / "bgraph-out" / "p" / "w").exists()


def test_a_file_on_the_way_is_one_line_and_kept(tmp_path):
    """The descriptor of the directory above was closed twice there (EBADF instead of this line)."""
    out = tmp_path / "bgraph-out"
    out.mkdir()
    (out / "p").write_text("mine\n")
    for _ in range(3):
        with pytest.raises(StoreError, match="is in the way of an output link"):
            outlinks.place(out, "p/w", "/nowhere")
    assert (out / "p").read_text() == "mine\n"
