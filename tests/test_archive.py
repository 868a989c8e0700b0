"""Unpacking tar and zip archives into trees: escapes are refused, exec bits kept."""

from __future__ import annotations

import hashlib
import io
import os
import re
import shutil
import stat
import subprocess
import tarfile
import zipfile

import pytest

from bgraph_testlib import action, requires_bwrap
from build_graph import archive
from build_graph.errors import ArchiveError
from build_graph.model import Action, Digester, DirEntry, FileEntry, SymlinkEntry, Tree
from build_graph.store.cas import LocalCas

B3 = Digester("blake3")


@pytest.fixture
def cas(tmp_path):
    return LocalCas(tmp_path / "cache", B3)


def make_tar(members: list[tuple], fmt=tarfile.GNU_FORMAT, mode: str = "w:gz") -> bytes:
    """members: (name, kind, payload, mode) with kind in file|dir|sym|lnk|chr|fifo."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode=mode, format=fmt) as tf:
        for name, kind, payload, mode in members:
            info = tarfile.TarInfo(name)
            info.mode = mode
            info.mtime = 1
            data = None
            if kind == "file":
                data = io.BytesIO(payload)
                info.size = len(payload)
            elif kind == "dir":
                info.type = tarfile.DIRTYPE
            elif kind == "sym":
                info.type, info.linkname = tarfile.SYMTYPE, payload
            elif kind == "lnk":
                info.type, info.linkname = tarfile.LNKTYPE, payload
            elif kind == "chr":
                info.type, info.devmajor, info.devminor = tarfile.CHRTYPE, 1, 3
            elif kind == "fifo":
                info.type = tarfile.FIFOTYPE
            tf.addfile(info, data)
    return buf.getvalue()


def make_ar(members: list[tuple[str, bytes]]) -> bytes:
    """An ar archive (the container of a .deb), as dpkg-deb writes it."""
    out = [b"!<arch>\n"]
    for name, data in members:
        out.append(f"{name:<16}{0:<12}{0:<6}{0:<6}{'100644':<8}{len(data):<10}`\n".encode() + data
                   + (b"\n" if len(data) % 2 else b""))
    return b"".join(out)


def make_deb(members: list[tuple], control: str = "Package: t\nVersion: 1.0\nArchitecture: amd64\n",
             compression: str = "xz", scripts: dict[str, str] | None = None) -> bytes:
    """A .deb: debian-binary, control.tar.xz (control + maintainer scripts), data.tar.<compression>
    of `members` (make_tar's format, names as dpkg-deb writes them: ./usr/...)."""
    control_members = [("./control", "file", control.encode(), 0o644)]
    control_members += [(f"./{name}", "file", text.encode(), 0o755) for name, text in (scripts or {}).items()]
    return make_ar([("debian-binary", b"2.0\n"), ("control.tar.xz", make_tar(control_members, mode="w:xz")),
                    (f"data.tar.{compression}", make_tar(members, mode={"xz": "w:xz", "gz": "w:gz"}.get(
                        compression, "w:xz")))])


def make_zip(members: list[tuple[str, bytes, int]]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, payload, mode in members:
            info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = mode << 16
            zf.writestr(info, payload)
    return buf.getvalue()


def run_extract(cas: LocalCas, data: bytes, filename: str = "a.tar.gz", strip_prefix: str = "") -> Tree:
    blob = cas.put_bytes(data)
    act = Action(name=f"extract {filename}", mnemonic="Extract", kind="extract",
                 inputs=(("archive", Tree({filename: blob})),), outputs=(".",),
                 spec=(("filename", filename), ("strip_prefix", strip_prefix)))
    tree, result = archive.extract(cas, act)
    assert result.output_tree == tree.digest(B3)
    assert cas.get_tree(result.output_tree) == tree
    return tree


def file_in(cas: LocalCas, tree: Tree, path: str) -> bytes:
    entry = tree.entries[path]
    assert isinstance(entry, FileEntry)
    return cas.read_bytes(entry)


# -- good archives ---------------------------------------------------------------------------
GOOD = [
    ("pkg-1.0/", "dir", None, 0o755),
    ("pkg-1.0/README", "file", b"read me\n", 0o644),
    ("pkg-1.0/bin/run", "file", b"#!/bin/sh\necho run\n", 0o755),
    ("pkg-1.0/lib/", "dir", None, 0o755),
    ("pkg-1.0/lib/current", "sym", "../README", 0o777),
    ("pkg-1.0/lib/same", "lnk", "pkg-1.0/README", 0o644),
    ("pkg-1.0/empty/", "dir", None, 0o755),
]


def test_good_tar_keeps_exec_bits_links_and_empty_dirs(cas):
    tree = run_extract(cas, make_tar(GOOD))
    assert set(tree.entries) == {"pkg-1.0/README", "pkg-1.0/bin/run", "pkg-1.0/lib/current",
                                 "pkg-1.0/lib/same", "pkg-1.0/empty"}
    assert tree.entries["pkg-1.0/bin/run"].executable
    assert not tree.entries["pkg-1.0/README"].executable
    assert tree.entries["pkg-1.0/lib/current"] == SymlinkEntry("../README")
    assert tree.entries["pkg-1.0/lib/same"] == tree.entries["pkg-1.0/README"]
    assert tree.entries["pkg-1.0/empty"] == DirEntry()
    assert file_in(cas, tree, "pkg-1.0/bin/run") == b"#!/bin/sh\necho run\n"
    # And it materializes as such.
    root = cas.materialize(tree)
    assert os.access(root / "pkg-1.0/bin/run", os.X_OK)
    assert stat.S_IMODE((root / "pkg-1.0/README").stat().st_mode) == 0o444
    assert (root / "pkg-1.0/lib/current").read_bytes() == b"read me\n"


def test_strip_prefix(cas):
    tree = run_extract(cas, make_tar(GOOD), strip_prefix="pkg-1.0")
    assert set(tree.entries) == {"README", "bin/run", "lib/current", "lib/same", "empty"}
    assert tree.entries["bin/run"].executable
    # A trailing slash is the same prefix; entries outside it are dropped.
    assert run_extract(cas, make_tar(GOOD + [("other/x", "file", b"x", 0o644)]),
                       strip_prefix="pkg-1.0/") == tree


def test_strip_prefix_matching_nothing(cas):
    with pytest.raises(ArchiveError, match="nothing left after strip_prefix 'nope'"):
        run_extract(cas, make_tar(GOOD), strip_prefix="nope")


def test_zip_keeps_exec_bits(cas):
    data = make_zip([("w-1.0/", b"", 0o40755), ("w-1.0/tool", b"#!tool", 0o100755),
                     ("w-1.0/data.txt", b"data", 0o100644), ("w-1.0/nomode.txt", b"x", 0)])
    tree = run_extract(cas, data, "w-1.0-py3-none-any.whl", strip_prefix="w-1.0")
    assert set(tree.entries) == {"tool", "data.txt", "nomode.txt"}
    assert tree.entries["tool"].executable
    assert not tree.entries["data.txt"].executable and not tree.entries["nomode.txt"].executable
    assert file_in(cas, tree, "tool") == b"#!tool"


def test_zip_symlink(cas):
    tree = run_extract(cas, make_zip([("d/f", b"f", 0o100644), ("d/l", b"f", 0o120777)]), "x.zip")
    assert tree.entries["d/l"] == SymlinkEntry("f")
    with pytest.raises(ArchiveError, match="'d/l' -> '../../etc'"):
        run_extract(cas, make_zip([("d/l", b"../../etc", 0o120777)]), "y.zip")


def test_extract_is_deterministic(cas):
    a = run_extract(cas, make_tar(GOOD))
    # Another member order (a hard link still after its target) and another tar format.
    order = [GOOD[i] for i in (4, 6, 2, 1, 3, 5, 0)]
    b = run_extract(cas, make_tar(order, fmt=tarfile.PAX_FORMAT))
    assert a == b and a.digest(B3) == b.digest(B3)


# -- hostile archives --------------------------------------------------------------------------
@pytest.mark.parametrize("members, entry", [
    ([("../evil", "file", b"x", 0o644)], "../evil"),
    ([("ok/../../evil", "file", b"x", 0o644)], "ok/../../evil"),
    ([("/etc/x", "file", b"x", 0o644)], "/etc/x"),
    ([("a/link", "sym", "../../outside", 0o777)], "a/link"),
    ([("link", "sym", "/etc/passwd", 0o777)], "link"),
    ([("hard", "lnk", "etc/passwd", 0o644)], "hard"),
    ([("hard", "lnk", "../../etc/passwd", 0o644)], "hard"),
    ([("hard", "lnk", "/etc/passwd", 0o644)], "hard"),
    ([("dev/null", "chr", None, 0o666)], "dev/null"),
    ([("pipe", "fifo", None, 0o644)], "pipe"),
])
def test_hostile_tar_is_refused_naming_the_entry(cas, members, entry):
    data = make_tar([("pkg/ok.txt", "file", b"ok", 0o644), *members])
    with pytest.raises(ArchiveError) as info:
        run_extract(cas, data, "hostile.tar.gz")
    msg = str(info.value)
    assert repr(entry) in msg, msg
    assert "refused" in msg
    assert msg.startswith("hostile.tar.gz: ")


@pytest.mark.parametrize("members, entry", [
    # A symlink to a directory inside the root, then entries written through it: each link is
    # harmless alone, but x/l/y resolves to ../.. of the root once x/l points at the root.
    ([("x/l", "sym", "..", 0o777), ("x/l/y", "sym", "../..", 0o777),
      ("x/l/y/escaped", "file", b"boom", 0o644)], "x/l/y"),
    ([("d", "sym", ".", 0o777), ("d/f", "file", b"x", 0o644)], "d/f"),
    ([("d/f", "file", b"x", 0o644), ("d", "sym", "sub", 0o777)], "d/f"),
])
def test_entries_through_symlinks_are_refused(cas, tmp_path, members, entry):
    with pytest.raises(ArchiveError) as info:
        run_extract(cas, make_tar(members), "links.tar.gz")
    assert repr(entry) in str(info.value) and "symlink" in str(info.value)
    assert not list(tmp_path.rglob("escaped"))


# Chains of links each harmless alone: x/l0 is the root, so l0/.. is the root's parent, and
# u2/u3/... climb one more level each. A lexical check sees every target inside the root.
CHAIN = [("x/", "dir", None, 0o755), ("x/l0", "sym", "..", 0o777), ("x/u1", "sym", "l0/..", 0o777),
         ("x/u2", "sym", "u1/..", 0o777), ("x/u3", "sym", "u2/..", 0o777), ("x/ok", "file", b"ok", 0o644)]


def tar_modes():
    return ["w", "w:gz", "w:bz2", "w:xz"]


@pytest.mark.parametrize("mode", tar_modes())
def test_chained_links_out_of_the_root_are_refused(cas, mode):
    blobs_before = blobs(cas)
    with pytest.raises(ArchiveError) as info:
        run_extract(cas, make_tar(CHAIN, mode=mode), "chain.tar")
    msg = str(info.value)
    assert msg == "chain.tar: symlink 'x/u1' -> 'l0/..' passes through symlink 'x/l0'; refused"
    assert "\n" not in msg
    assert blobs(cas) - blobs_before <= {cas.put_bytes(make_tar(CHAIN, mode=mode)).digest[2:]}  # the archive only


def test_chained_links_in_a_zip_and_a_deb_are_refused(cas):
    data = make_zip([("x/l0", b"..", 0o120777), ("x/u1", b"l0/..", 0o120777), ("x/u2", b"u1/..", 0o120777)])
    with pytest.raises(ArchiveError, match=r"^c\.whl: symlink 'x/u1' -> 'l0/\.\.' passes through symlink 'x/l0'; "
                                           r"refused$"):
        run_extract(cas, data, "c.whl")
    deb = make_deb([("./usr/", "dir", None, 0o755), ("./usr/l0", "sym", "..", 0o777),
                    ("./usr/u1", "sym", "l0/../..", 0o777)])
    with pytest.raises(ArchiveError, match="symlink 'usr/u1' -> 'l0/../..' passes through symlink 'usr/l0'"):
        run_extract(cas, deb, "c_1_amd64.deb")


@pytest.mark.parametrize("members, message", [
    # Through a link to a directory, even one that stays inside: where it leads is the link's to say.
    ([("sub/f", "file", b"f", 0o644), ("a", "sym", "sub", 0o777), ("b", "sym", "a/f", 0o777)],
     "symlink 'b' -> 'a/f' passes through symlink 'a'"),
    # The order of the members does not matter: the link it passes through may come later.
    ([("b", "sym", "a/../f", 0o777), ("sub/f", "file", b"f", 0o644), ("a", "sym", "sub/deeper", 0o777)],
     "symlink 'b' -> 'a/../f' passes through symlink 'a'"),
    # A trailing slash or dot follows the link too.
    ([("a", "sym", ".", 0o777), ("b", "sym", "a/", 0o777)], "symlink 'b' -> 'a/' passes through symlink 'a'"),
    # Climbing out after going down into a directory that does not exist (another package's).
    ([("usr/lib/x", "sym", "../nowhere/../../..", 0o777)], "symlink 'usr/lib/x' -> '../nowhere/../../..' points "
                                                           "outside the root"),
    ([("l", "sym", "", 0o777)], "symlink 'l' -> '' has an empty or NUL target"),
])
def test_links_through_links_are_refused(cas, members, message):
    with pytest.raises(ArchiveError) as info:
        run_extract(cas, make_tar(members), "links.tar.gz")
    assert str(info.value) == f"links.tar.gz: {message}; refused"


@pytest.mark.parametrize("members, message", [
    ([("f", "file", b"f", 0o644), ("l", "sym", "../../etc/passwd", 0o777), ("h", "lnk", "l", 0o644)],
     "'l' -> '../../etc/passwd' points outside the root"),
    # Each alone is fine: the link climbs two levels from its own directory, the hard link copy of
    # it sits at the top, where `../..` is outside.
    ([("a/b/l", "sym", "../..", 0o777), ("h", "lnk", "a/b/l", 0o644)],
     "hard link 'h' -> 'a/b/l' names a symlink, not a regular file"),
    ([("d/", "dir", None, 0o755), ("h", "lnk", "d", 0o644)], "hard link 'h' -> 'd' names a directory, not a "
                                                             "regular file"),
    ([("h", "lnk", "later", 0o644), ("later", "file", b"x", 0o644)], "hard link 'h' -> 'later' points outside "
                                                                     "the archive"),
    ([("h", "lnk", "../outside", 0o644)], "hard link 'h' -> '../outside' points outside the archive"),
])
def test_hard_links_only_to_earlier_regular_files(cas, members, message):
    with pytest.raises(ArchiveError) as info:
        run_extract(cas, make_tar(members), "hard.tar.gz")
    assert message in str(info.value) and str(info.value).startswith("hard.tar.gz: ")


@pytest.mark.parametrize("make", ["tar", "zip", "deb"])
def test_members_under_a_symlinked_directory_are_refused(cas, make):
    if make == "tar":
        data, name, entry = make_tar([("d", "sym", "sub", 0o777), ("d/f", "file", b"x", 0o644)]), "t.tgz", "d/f"
    elif make == "zip":
        data, name, entry = make_zip([("d", b"sub", 0o120777), ("d/f", b"x", 0o100644)]), "t.whl", "d/f"
    else:
        data = make_deb([("./usr/lib64", "sym", "lib", 0o777), ("./usr/lib64/ld.so", "file", b"x", 0o755)])
        name, entry = "t_1_amd64.deb", "usr/lib64/ld.so"
    with pytest.raises(ArchiveError) as info:
        run_extract(cas, data, name)
    assert f"entry {entry!r} lies below symlink" in str(info.value)


def test_special_zip_members_are_refused(cas):
    with pytest.raises(ArchiveError, match="'p' is a device, fifo or other special file; refused"):
        run_extract(cas, make_zip([("ok", b"x", 0o100644), ("p", b"", 0o010644)]), "s.zip")
    with pytest.raises(ArchiveError, match="'l' has a 5000-byte target; refused"):
        run_extract(cas, make_zip([("l", b"a" * 5000, 0o120777)]), "s.zip")


def test_a_link_out_of_strip_prefix_is_refused(cas):
    members = [("pkg-1.0/f", "file", b"f", 0o644), ("other/secret", "file", b"s", 0o644),
               ("pkg-1.0/up", "sym", "../other/secret", 0o777)]
    assert "pkg-1.0/up" in run_extract(cas, make_tar(members)).entries  # inside the archive's root
    with pytest.raises(ArchiveError, match=r"symlink 'pkg-1.0/up' -> '../other/secret' points outside the root "
                                           r"\(the root is strip_prefix 'pkg-1.0'\); refused"):
        run_extract(cas, make_tar(members), strip_prefix="pkg-1.0")


# Links as packages ship them: a library's chain of names, links into the tree's other
# directories, links into other packages (not in this tree), a link to the root, a link to a link.
USUAL_LINKS = [
    ("./usr/lib/x86_64-linux-gnu/libfoo.so.1.2.3", "file", b"\x7fELF lib", 0o644),
    ("./usr/lib/x86_64-linux-gnu/libfoo.so.1", "sym", "libfoo.so.1.2.3", 0o777),
    ("./usr/lib/x86_64-linux-gnu/libfoo.so", "sym", "libfoo.so.1", 0o777),
    ("./usr/lib/gcc/x86_64-linux-gnu/12/libfoo.so", "sym", "../../../x86_64-linux-gnu/libfoo.so.1", 0o777),
    ("./usr/lib/gcc/x86_64-linux-gnu/12/libgcc_s.so", "sym", "/lib/x86_64-linux-gnu/libgcc_s.so.1", 0o777),
    ("./usr/bin/foo-12", "file", b"#!/bin/sh\n", 0o755),
    ("./usr/bin/foo", "sym", "foo-12", 0o777),
    ("./usr/bin/x86_64-linux-gnu-foo", "sym", "./foo", 0o777),
    ("./usr/share/doc/libfoo-dev", "sym", "libfoo1", 0o777),
    ("./usr/share/doc/libfoo1/copyright", "file", b"free\n", 0o644),
    ("./usr/share/foo/root", "sym", "../../..", 0o777),
]


def test_usual_relative_links_extract_and_materialize(cas):
    tree = run_extract(cas, make_deb(USUAL_LINKS), "libfoo_1.2.3_amd64.deb")
    assert tree.entries["usr/lib/x86_64-linux-gnu/libfoo.so"] == SymlinkEntry("libfoo.so.1")
    assert tree.entries["usr/lib/gcc/x86_64-linux-gnu/12/libgcc_s.so"] == \
        SymlinkEntry("../../../../../lib/x86_64-linux-gnu/libgcc_s.so.1")
    root = cas.materialize(tree)
    assert (root / "usr/lib/gcc/x86_64-linux-gnu/12/libfoo.so").read_bytes() == b"\x7fELF lib"
    assert (root / "usr/lib/x86_64-linux-gnu/libfoo.so").read_bytes() == b"\x7fELF lib"
    assert (root / "usr/bin/x86_64-linux-gnu-foo").read_bytes() == b"#!/bin/sh\n"
    assert (root / "usr/share/foo/root").resolve() == root.resolve()
    # The same links in a tar (an sdist) and a zip (a wheel).
    plain = [(n[2:], k, p if not (k == "sym" and p.startswith("/")) else "../../../x86_64-linux-gnu/libfoo.so", m)
             for n, k, p, m in USUAL_LINKS]
    sdist = run_extract(cas, make_tar(plain, mode="w:bz2"), "foo.tar.bz2")
    assert sdist.entries["usr/bin/foo"] == SymlinkEntry("foo-12")
    wheel = make_zip([(n, p if k == "file" else p.encode(), (0o100644 if k == "file" else 0o120777))
                      for n, k, p, _m in plain])
    unzipped = run_extract(cas, wheel, "foo.whl")
    assert unzipped.entries["usr/lib/x86_64-linux-gnu/libfoo.so"] == SymlinkEntry("libfoo.so.1")


def blobs(cas: LocalCas) -> set[str]:
    return {p.name for p in cas.blobs.rglob("*") if p.is_file()}


@pytest.mark.parametrize("fmt", ["tar", "zip"])
def test_a_refused_archive_stores_nothing(cas, fmt):
    big = os.urandom(3 << 20)  # over a chunk: staged in a file, not in memory
    if fmt == "tar":
        data = make_tar([("a/small", "file", b"SMALL-BEFORE", 0o644), ("a/big", "file", big, 0o644), *CHAIN,
                         ("a/after", "file", b"AFTER", 0o644)])
    else:
        data = make_zip([("a/small", b"SMALL-BEFORE", 0o100644), ("a/big", big, 0o100644),
                         ("x/l0", b"..", 0o120777), ("x/u1", b"l0/..", 0o120777)])
    archive_blob = cas.put_bytes(data)
    before = blobs(cas)
    act = Action(name="extract", mnemonic="Extract", kind="extract", inputs=(("archive", Tree({"bad": archive_blob})),),
                 spec=(("filename", "bad"), ("strip_prefix", "")))
    with pytest.raises(ArchiveError, match="passes through symlink"):
        archive.extract(cas, act)
    assert blobs(cas) == before
    assert not any(cas.tmp.iterdir())  # no staging file left behind


def test_members_outside_strip_prefix_are_not_stored(cas):
    tree = run_extract(cas, make_tar([("keep/f", "file", b"KEPT", 0o644), ("drop/g", "file", b"DROPPED", 0o644),
                                      ("drop/big", "file", b"D" * (3 << 20), 0o644)]), strip_prefix="keep")
    assert set(tree.entries) == {"f"}
    contents = {p.read_bytes()[:8] for p in cas.blobs.rglob("*") if p.is_file()}
    assert b"KEPT" in contents and b"DROPPED" not in contents and b"D" * 8 not in contents


def test_hostile_zip_is_refused(cas):
    with pytest.raises(ArchiveError, match="'../evil'"):
        run_extract(cas, make_zip([("../evil", b"x", 0o100644)]), "z.zip")
    with pytest.raises(ArchiveError, match="'/abs' has an absolute path"):
        run_extract(cas, make_zip([("/abs", b"x", 0o100644)]), "z.zip")


def test_not_an_archive(cas):
    with pytest.raises(ArchiveError, match="not a readable tar archive"):
        run_extract(cas, b"this is not an archive", "junk.tar.gz")


def test_corrupted_archive_blob(cas):
    blob = cas.put_bytes(make_tar(GOOD))
    path = cas.blob_path(blob.digest)
    path.chmod(0o644)
    path.write_bytes(b"\0" * blob.size)
    act = Action(name="extract", mnemonic="Extract", kind="extract", inputs=(("archive", Tree({"a.tgz": blob})),),
                 spec=(("filename", "a.tgz"), ("strip_prefix", "")))
    fresh = LocalCas(cas.base.parent.parent, B3)
    with pytest.raises(ArchiveError, match="missing or corrupted"):
        archive.extract(fresh, act)


# -- Debian packages (.deb: ar + data.tar) ---------------------------------------------------------
DEB_DATA = [
    ("./", "dir", None, 0o755),
    ("./usr/", "dir", None, 0o755),
    ("./usr/bin/", "dir", None, 0o755),
    ("./usr/bin/tool", "file", b"#!/bin/sh\necho tool\n", 0o755),
    ("./usr/bin/tool-again", "lnk", "./usr/bin/tool", 0o755),
    ("./lib64/", "dir", None, 0o755),
    ("./lib64/ld.so", "sym", "/lib/x86_64-linux-gnu/ld.so.2", 0o777),
    ("./usr/lib/", "dir", None, 0o755),
    ("./usr/lib/root-link", "sym", "/", 0o777),
    ("./usr/share/doc/t/copyright", "file", b"free\n", 0o644),
]


@pytest.mark.parametrize("compression", ["xz", "gz"])
def test_deb_unpacks_its_data_tar_only(cas, compression):
    postinst = "#!/bin/sh\ntouch /tmp/bgraph-postinst-ran\n"
    tree = run_extract(cas, make_deb(DEB_DATA, compression=compression, scripts={"postinst": postinst}), "t_1.0_amd64.deb")
    assert set(tree.entries) == {"usr/bin/tool", "usr/bin/tool-again", "lib64/ld.so", "usr/lib/root-link",
                                 "usr/share/doc/t/copyright"}
    assert tree.entries["usr/bin/tool"].executable
    assert tree.entries["usr/bin/tool-again"] == tree.entries["usr/bin/tool"]
    # An absolute link in a .deb means the package root: made relative to the link's directory.
    assert tree.entries["lib64/ld.so"] == SymlinkEntry("../lib/x86_64-linux-gnu/ld.so.2")
    assert tree.entries["usr/lib/root-link"] == SymlinkEntry("../..")
    # The control member (and its maintainer scripts) never reach the tree, nor run.
    assert not any("control" in p or "postinst" in p for p in tree.entries)
    assert not os.path.exists("/tmp/bgraph-postinst-ran")


def test_deb_made_by_dpkg_deb(cas, tmp_path):
    """A package built by the real dpkg-deb (root owner, its own tar layout) unpacks the same."""
    dpkg_deb = shutil.which("dpkg-deb")
    if dpkg_deb is None:
        pytest.skip("dpkg-deb is not installed")
    root = tmp_path / "pkg"
    (root / "DEBIAN").mkdir(parents=True)
    (root / "DEBIAN/control").write_text("Package: t\nVersion: 1.0\nArchitecture: amd64\nMaintainer: t <t@t>\n"
                                         "Description: t\n")
    (root / "bin").mkdir()
    (root / "bin/tool").write_text("#!/bin/sh\n")
    (root / "bin/tool").chmod(0o755)
    os.symlink("/bin/tool", root / "bin/alias")
    subprocess.run([dpkg_deb, "--build", "--root-owner-group", str(root), str(tmp_path / "t.deb")],
                   check=True, capture_output=True)
    tree = run_extract(cas, (tmp_path / "t.deb").read_bytes(), "t_1.0_amd64.deb")
    assert set(tree.entries) == {"bin/tool", "bin/alias"}
    assert tree.entries["bin/tool"].executable
    assert tree.entries["bin/alias"] == SymlinkEntry("tool")
    # And dpkg-deb reads what make_deb writes: the test's hand-made packages are real .deb files.
    (tmp_path / "mine.deb").write_bytes(make_deb(DEB_DATA))
    listed = subprocess.run([dpkg_deb, "--contents", str(tmp_path / "mine.deb")], check=True,
                            capture_output=True, text=True).stdout
    assert "./usr/bin/tool" in listed


@pytest.mark.parametrize("member, entry", [
    (("./../evil", "file", b"EVIL-PAYLOAD", 0o644), "./../evil"),
    (("/etc/evil", "file", b"EVIL-PAYLOAD", 0o644), "/etc/evil"),
    (("./usr/lib/out", "sym", "../../../etc/passwd", 0o777), "usr/lib/out"),
    (("./usr/lib/hard", "lnk", "../../etc/passwd", 0o644), "usr/lib/hard"),
    (("./usr/lib/hard", "lnk", "/etc/passwd", 0o644), "usr/lib/hard"),
    (("./dev/null", "chr", None, 0o666), "./dev/null"),
])
def test_hostile_deb_is_refused_and_stores_nothing(cas, member, entry):
    data = make_deb([("./usr/share/ok", "file", b"OK-PAYLOAD-BEFORE", 0o644), member,
                     ("./usr/share/after", "file", b"OK-PAYLOAD-AFTER", 0o644)])
    archive_blob = cas.put_bytes(data)
    before = blobs(cas)
    act = Action(name="extract", mnemonic="Extract", kind="extract", inputs=(("archive", Tree({"evil_1_amd64.deb": archive_blob})),),
                 spec=(("filename", "evil_1_amd64.deb"), ("strip_prefix", "")))
    with pytest.raises(ArchiveError) as info:
        archive.extract(cas, act)
    msg = str(info.value)
    assert msg.startswith("evil_1_amd64.deb: ") and "refused" in msg and repr(entry) in msg, msg
    # Not even the entries before the bad one were stored.
    assert blobs(cas) == before


@pytest.mark.parametrize("data, message", [
    (make_ar([("debian-binary", b"2.0\n"), ("control.tar.xz", b"")]), "no data.tar member"),
    (make_ar([("debian-binary", b"2.0\n"), ("data.tar.zst", b"(\xb5/\xfd")]), "zstd-compressed, which is not supported"),
    (make_ar([("debian-binary", b"2.0\n"), ("data.tar.xz", b"\xfd7zXZ\x00 damaged")]), "data.tar.xz is not a readable tar"),
    (b"!<arch>\nnot an ar header at all, far too short", "not a readable .deb (ar) archive"),
])
def test_broken_deb(cas, data, message):
    with pytest.raises(ArchiveError, match=re.escape(message)) as info:
        run_extract(cas, data, "broken_1_amd64.deb")
    assert str(info.value).startswith("broken_1_amd64.deb: ")


# -- end to end: http_archive (file:// URL) + extract ---------------------------------------------
def archive_ws(make_ws, tmp_path, sha256: str):
    data = make_tar(GOOD)
    src = tmp_path / "downloads" / "pkg-1.0.tar.gz"
    src.parent.mkdir(exist_ok=True)
    src.write_bytes(data)
    ws = make_ws({"targets/ext.toml": f'''[pkg-archive]
kind = "http_archive"
url = "file://{src}"
sha256 = "{sha256}"

[pkg]
kind = "extract"
src = ":pkg-archive"
strip_prefix = "pkg-1.0"
'''})
    ws.env["BGRAPH_FILE_URL_DIRS"] = str(src.parent)  # a file: URL outside the workspace needs the user's word
    return ws, hashlib.sha256(data).hexdigest()


def built_archive_ws(make_ws, tmp_path):
    """archive_ws with the right pin, built once: (the workspace, the sha256, its target file)."""
    ws, right = archive_ws(make_ws, tmp_path, "0" * 64)
    toml = ws.root / "targets" / "ext.toml"
    toml.write_text(toml.read_text().replace("0" * 64, right))
    assert ws.build("//ext:pkg").rc == 0
    return ws, right, toml


@requires_bwrap
def test_http_archive_sha256_mismatch_stores_nothing(make_ws, tmp_path):
    ws, right = archive_ws(make_ws, tmp_path, "0" * 64)
    run = ws.build("//ext:pkg")
    assert run.rc == 1
    assert not run.json["ok"]
    assert "sha256 mismatch" in run.stderr
    assert any("sha256 mismatch" in e and "bytes differ" in e for e in run.json["errors"])
    assert right not in run.stderr  # a workspace's file: URL: no digest of a host file (fetch_guard.py)
    assert action(run.json, "//ext:pkg-archive")["status"] == "failed"
    assert ws.ac_entries() == set()
    blobs = [p for p in (ws.store / "cas").rglob("*") if p.is_file()]
    sha_of_blobs = {hashlib.sha256(p.read_bytes()).hexdigest() for p in blobs}
    assert right not in sha_of_blobs  # the bad download is not in the CAS
    assert not os.listdir(ws.cache / "v1" / "tmp")

    ws.write({"targets/ext.toml": (ws.root / "targets/ext.toml").read_text().replace("0" * 64, right)})
    run = ws.build("//ext:pkg")
    assert run.rc == 0, run.stderr
    assert run.json["executed"] == 2
    out = ws.root / "bgraph-out/ext/pkg"
    assert (out / "README").read_text() == "read me\n"
    assert os.access(out / "bin/run", os.X_OK)
    assert os.readlink(out / "lib/current") == "../README"
    assert len(ws.ac_entries()) == 2
    assert ws.build("//ext:pkg").json["executed"] == 0


@requires_bwrap
def test_http_archive_missing_file(make_ws, tmp_path):
    ws, _ = archive_ws(make_ws, tmp_path, "0" * 64)
    (tmp_path / "downloads" / "pkg-1.0.tar.gz").unlink()
    run = ws.build("//ext:pkg")
    assert run.rc == 1
    assert "Traceback" not in run.stderr
    assert "download of file://" in run.stderr and "pkg-1.0.tar.gz failed: No such file or directory" in run.stderr
    assert ws.ac_entries() == set()


@requires_bwrap
def test_http_archive_moved_url_is_served_from_the_cas(make_ws, tmp_path):
    """A fetch is fixed-output: same sha256 at a new (even unreachable) URL downloads nothing."""
    ws, right, toml = built_archive_ws(make_ws, tmp_path)
    gone = tmp_path / "downloads" / "pkg-1.0.tar.gz"
    toml.write_text(toml.read_text().replace(f"file://{gone}", "file:///nonexistent/mirror/pkg-1.0.tar.gz"))
    gone.unlink()
    run = ws.build("//ext:pkg")
    assert run.rc == 0, run.stderr
    assert run.json["executed"] == 0


@requires_bwrap
def test_a_refused_archive_is_one_error_line_and_keeps_the_previous_outputs(make_ws, tmp_path):
    ws, right, toml = built_archive_ws(make_ws, tmp_path)
    entries_before = ws.ac_entries()
    hostile = make_tar(GOOD + [("pkg-1.0/x/", "dir", None, 0o755), ("pkg-1.0/x/l0", "sym", "..", 0o777),
                               ("pkg-1.0/x/u1", "sym", "l0/..", 0o777), ("pkg-1.0/x/u2", "sym", "u1/..", 0o777)])
    (tmp_path / "downloads" / "pkg-1.0.tar.gz").write_bytes(hostile)
    toml.write_text(toml.read_text().replace(right, hashlib.sha256(hostile).hexdigest()))
    run = ws.build("//ext:pkg")
    assert run.rc == 1 and "Traceback" not in run.stderr
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, run.stderr
    assert "pkg-1.0.tar.gz: symlink 'pkg-1.0/x/u1' -> 'l0/..' passes through symlink 'pkg-1.0/x/l0'; refused" \
        in errors[0], errors
    # The unpack filed nothing (the fetch of the new bytes is kept); the last good output is as it was.
    assert len(ws.ac_entries() - entries_before) == 1
    assert ws.read_output("//ext:pkg", "README") == "read me\n"
    assert not (ws.root / "bgraph-out/ext/pkg/x").exists()


# -- archives Python's readers fail on: one ArchiveError naming the archive and the member -------
def _damaged_zip(method: int) -> bytes:
    """A zip whose one member's compressed bytes are flipped (bzip2: OSError, LZMA: LZMAError)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        info = zipfile.ZipInfo("top/a.txt")
        info.external_attr, info.compress_type = 0o100644 << 16, method
        zf.writestr(info, b"a" * 1000)
    data = bytearray(buf.getvalue())
    start = data.find(b"top/a.txt") + 13
    for k in range(start, start + 20):
        data[k] ^= 0x55
    return bytes(data)


def _flagged_zip(encrypted: bool) -> bytes:
    """An encrypted member (RuntimeError), or a symlink member of an unknown method (NotImplementedError)."""
    import struct
    name, mode = ("top/a.txt", 0o100644) if encrypted else ("top/l", 0o120777)
    data = bytearray(make_zip([(name, b"a.txt", mode)]))
    cd = data.find(b"PK\x01\x02")
    if encrypted:
        data[6] |= 1
        data[cd + 8] |= 1
    else:
        data[8:10] = data[cd + 10:cd + 12] = struct.pack("<H", 99)
    return bytes(data)


def _truncated_tar() -> bytes:
    data = make_tar([("top/a.txt", "file", b"a\n", 0o644)])
    return data[: len(data) // 2]


@pytest.mark.parametrize("data, filename, said", [
    (_damaged_zip(zipfile.ZIP_BZIP2), "b.zip", "cannot read member 'top/a.txt': corrupt or truncated data"),
    (_damaged_zip(zipfile.ZIP_LZMA), "l.zip", "cannot read member 'top/a.txt': corrupt or truncated data"),
    (_flagged_zip(True), "e.zip", "cannot read member 'top/a.txt': it is encrypted"),
    (_flagged_zip(False), "s.zip", "cannot read member 'top/l': its compression method is not supported"),
    (_truncated_tar(), "t.tar.gz", "cannot read its first entry: corrupt or truncated data"),
    (make_tar([("top/ok", "file", b"x", 0o644), ("top/caf\udce9.txt", "file", b"x", 0o644)], mode="w"),
     "n.tar", "entry 'top/caf\\xe9.txt' has a name that is not UTF-8"),
    (make_tar([("top/" + "a" * 300, "file", b"x", 0o644)]), "long.tar.gz", "name component of 300 bytes"),
    (make_tar([("top/l", "sym", "caf\udce9", 0o777)], mode="w"), "t.tar", "has a target that is not UTF-8"),
])
def test_an_archive_python_cannot_read_is_one_error_naming_archive_and_member(cas, data, filename, said):
    """Before: OSError, LZMAError, RuntimeError, NotImplementedError, EOFError or TypeError
    ('surrogates not allowed') escaped, and a 300-byte name failed later naming a CAS blob."""
    cas.put_bytes(data)
    before = blobs(cas)
    with pytest.raises(ArchiveError) as info:
        run_extract(cas, data, filename)
    msg = info.value.render()
    assert msg.startswith(f"{filename}: ") and said in msg and "\n  hint: " in msg, msg
    assert blobs(cas) == before  # nothing of the refused archive was stored
