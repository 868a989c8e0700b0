"""patches.py: a unified diff split into one patch per hunk, each applying alone with GNU patch
as the hunk applies inside the whole patch."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from build_graph.errors import LoadError
from bgraph_testlib import requires_bwrap
from build_graph.patches import decode, encode, files_changed, inert, non_utf8_name, split

ORIGINAL = "".join(f"line {i}\n" for i in range(1, 31))
PATCH = """Two files: an edit with two hunks, and a new file.

--- a/src/x.h\t2024-01-01 00:00:00
+++ b/src/x.h
@@ -2,3 +2,3 @@ section one
 line 2
-line 3
+line three
 line 4
@@ -20,3 +20,4 @@
 line 20
 line 21
+line 21.5
 line 22
--- /dev/null
+++ b/src/new.h
@@ -0,0 +1,2 @@
+#pragma once
+#define NEW 1
"""


def test_split_gives_each_hunk_its_file_header_and_numbering():
    hunks = split("patches/p.patch", PATCH, strip=1)
    assert [h.id for h in hunks] == ["patches/p.patch#1", "patches/p.patch#2", "patches/p.patch#3"]
    assert [h.file for h in hunks] == ["src/x.h", "src/x.h", "src/new.h"]
    assert [(h.added, h.removed) for h in hunks] == [(1, 1), (1, 0), (2, 0)]
    assert hunks[0].header == "@@ -2,3 +2,3 @@ section one"
    assert hunks[1].text == "--- a/src/x.h\t2024-01-01 00:00:00\n+++ b/src/x.h\n" + \
        "@@ -20,3 +20,4 @@\n line 20\n line 21\n+line 21.5\n line 22\n"
    assert hunks[2].text.startswith("--- /dev/null\n+++ b/src/new.h\n@@ -0,0 +1,2 @@\n")
    # strip counts leading components as patch -p does
    assert [h.file for h in split("p", PATCH, strip=0)][0] == "b/src/x.h"
    assert files_changed("p", PATCH, 1) == ["src/x.h", "src/new.h"]


@pytest.mark.skipif(shutil.which("patch") is None, reason="GNU patch not installed")
def test_hunks_applied_one_by_one_give_the_whole_patch_and_apply_without_each_other(tmp_path):
    def tree(name: str):
        root = tmp_path / name
        (root / "src").mkdir(parents=True)
        (root / "src" / "x.h").write_text(ORIGINAL)
        return root

    def apply(root, text):
        subprocess.run(["patch", "-p1", "--batch", "--forward"], input=text, text=True, cwd=root, check=True,
                       capture_output=True)

    whole, apart, without_first = tree("whole"), tree("apart"), tree("without-first")
    apply(whole, PATCH)
    hunks = split("p", PATCH)
    for h in hunks:
        apply(apart, h.text)
    for h in hunks[1:]:
        apply(without_first, h.text)  # the second hunk applies at its place with the first left out
    for name in ("x.h", "new.h"):
        assert (apart / "src" / name).read_text() == (whole / "src" / name).read_text()
    text = (without_first / "src" / "x.h").read_text()
    assert "line 3\n" in text and "line three" not in text and "line 21.5\n" in text


def test_bytes_that_are_not_utf8_survive():
    data = PATCH.replace("line three", "line \xe9").encode("latin-1")
    [first, *_] = split("p", decode(data))
    assert b"+line \xe9\n" in encode(first.text)


@pytest.mark.parametrize("text, message", [
    ("just some words\n", "holds no hunk"),
    ("--- a/x\n+++ b/x\n@@ -1,2 +1,2 @@\n a\n", "not a unified diff"),
])
def test_bad_patches_are_load_errors_naming_the_patch(text, message):
    with pytest.raises(LoadError) as e:
        split("patches/bad.patch", text)
    assert message in str(e.value.render()) and "patches/bad.patch" in e.value.render()


@pytest.mark.parametrize("text, why", [
    ("", "holds no hunk"),
    ("Just a commit message, the diff cut off.\n", "holds no hunk"),
    ("diff --git a/b.bin b/b.bin\nnew file mode 100644\nindex 0000000..e69de29\n"
     "Binary files /dev/null and b/b.bin differ\n", "binary change to b/b.bin"),
])
def test_a_patch_that_changes_nothing_is_inert(text, why):
    assert why in inert(text)


@pytest.mark.parametrize("text", [
    PATCH,
    "*** a/x\n--- b/x\n***************\n*** 1 ****\n! a\n--- 1 ----\n! b\n",  # context diff
    "1c1\n< a\n---\n> b\n",  # normal diff
    "diff --git a/run.sh b/run.sh\nold mode 100644\nnew mode 100755\n",  # git: a mode change alone
    "diff --git a/e b/e\nnew file mode 100644\nindex 0000000..e69de29\n",  # git: an empty file created
])
def test_a_patch_holding_a_change_is_not_inert(text):
    assert inert(text) is None


PATCHED = ('[orig]\nkind = "genrule"\nouts = ["hello.txt"]\ncmd = "echo hi > $OUT/hello.txt"\n\n'
           '[patched]\nkind = "patched_tree"\nsrc = ":orig"\npatches = ["patches/p/*.patch"]\n')


@requires_bwrap
@pytest.mark.parametrize("text, said", [
    ("", "holds no hunk"),
    ("diff --git a/b.bin b/b.bin\nnew file mode 100644\nindex 0000000..e69de29\n"
     "Binary files /dev/null and b/b.bin differ\n", "binary change to b/b.bin"),
])
def test_building_with_a_patch_that_changes_nothing_is_refused_naming_it(make_ws, text, said):
    """GNU patch 'applies' an empty patch, or a git diff made without --binary, exiting 0 with
    the tree unchanged: the build said nothing while `bgraph audit` said 'no hunk'."""
    ws = make_ws({"targets/p.toml": PATCHED, "patches/p/0001-fix.patch": text})
    run = ws.cli("build", "//p:patched")
    errors = [line for line in run.stderr.splitlines() if "error:" in line]
    assert run.rc != 0 and "Traceback" not in run.output, run.output
    assert len(errors) == 1 and "patches/p/0001-fix.patch" in errors[0] and said in errors[0], run.output
    assert "hint:" in run.stderr


def test_a_file_name_that_is_not_utf8_is_found():
    text = decode(b"--- /dev/null\n+++ b/caf\xe9\n@@ -0,0 +1 @@\n+x\n")
    assert non_utf8_name(text) == "b/caf\\xe9"
    assert non_utf8_name(decode(PATCH.replace("line three", "line \xe9").encode("latin-1"))) is None  # content only


@requires_bwrap
def test_a_patch_creating_a_file_whose_name_is_not_utf8_is_refused_naming_both(make_ws):
    """It ended in 'apply patches: TypeError: str is not valid UTF-8' naming neither."""
    ws = make_ws({"targets/p.toml": PATCHED, "patches/p/0001.patch": b"--- /dev/null\n+++ b/caf\xe9\n@@ -0,0 +1 @@\n+x\n"})
    run = ws.cli("build", "//p:patched")
    errors = [line for line in run.stderr.splitlines() if "error:" in line]
    assert run.rc != 0 and "Traceback" not in run.output, run.output
    assert len(errors) == 1 and "patches/p/0001.patch" in errors[0] and "b/caf\\xe9" in errors[0], run.output
    assert "hint:" in run.stderr
