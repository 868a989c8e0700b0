"""Unpack tar, zip and Debian (.deb) archives into the CAS as a Tree, refusing entries that escape the root.

Runs in-process (no sandbox): it reads one verified blob and writes blobs, and never runs
anything the archive holds. Refused: absolute names, `..` components, symlinks or hard links
pointing outside the root, entries below a symlink, device and fifo entries.

A .deb is an ar archive; only its data.tar.{xz,gz,bz2} member is read, through the same
checks as a tar (control.tar and its maintainer scripts are never read). In a .deb an absolute
symlink target means the package's root (dpkg installs it so), so it is made relative to the
link's directory. Its blobs are held back until the whole member has passed the checks: a
refused package stores nothing.
"""

from __future__ import annotations

import lzma
import posixpath
import stat
import tarfile
import time
import zipfile
import zlib
from typing import Iterator

from debian.arfile import ArError, ArFile

from build_graph.errors import ArchiveError
from build_graph.model import Action, ActionResult, DirEntry, FileEntry, SymlinkEntry, Tree
from build_graph.store.cas import LocalCas

AR_MAGIC = b"!<arch>\n"


def _safe_name(name: str, archive: str) -> str:
    """The entry's normalised relative path, or an ArchiveError naming it."""
    cleaned = name.replace("\\", "/")
    if cleaned.startswith("/") or (len(cleaned) > 1 and cleaned[1] == ":"):
        raise ArchiveError(f"entry {name!r} has an absolute path; refused", where=archive)
    norm = posixpath.normpath(cleaned)
    if norm == ".." or norm.startswith("../") or "/../" in f"/{cleaned}/":
        raise ArchiveError(f"entry {name!r} escapes the archive root ('..'); refused", where=archive)
    return "" if norm == "." else norm


def _check_link(name: str, target: str, archive: str) -> None:
    if target.startswith("/"):
        raise ArchiveError(f"symlink {name!r} -> {target!r} points outside the root (absolute); refused",
                           where=archive)
    resolved = posixpath.normpath(posixpath.join(posixpath.dirname(name), target))
    if resolved == ".." or resolved.startswith("../"):
        raise ArchiveError(f"symlink {name!r} -> {target!r} points outside the root; refused", where=archive)


def _check_nesting(name: str, entry: object, leaves: dict[str, object], parents: dict[str, str],
                   archive: str) -> None:
    """Refuse entries below a symlink or file (materializing them would write through it,
    possibly outside the root), and a symlink or file where other entries need a directory."""
    parts = name.split("/")
    for i in range(1, len(parts)):
        parent = "/".join(parts[:i])
        if parent in leaves:
            what = "symlink" if isinstance(leaves[parent], SymlinkEntry) else "file"
            raise ArchiveError(f"entry {name!r} lies below {what} {parent!r}; refused", where=archive)
        parents.setdefault(parent, name)
    if isinstance(entry, DirEntry):
        leaves.pop(name, None)
        return
    if name in parents:
        what = "symlink" if isinstance(entry, SymlinkEntry) else "file"
        raise ArchiveError(f"{what} entry {name!r} would replace the directory holding {parents[name]!r}; refused",
                           where=archive)
    leaves[name] = entry


def _strip(path: str, prefix: str) -> str | None:
    if not prefix:
        return path
    if path == prefix:
        return ""
    return path[len(prefix) + 1:] if path.startswith(prefix + "/") else None


def _tar_entries(path: str, archive: str, cas: LocalCas) -> Iterator[tuple[str, object]]:
    try:
        tf = tarfile.open(path, "r:*")
    except tarfile.TarError as e:
        raise ArchiveError(f"not a readable tar archive: {e}", where=archive) from None
    with tf:
        yield from _tar_members(tf, archive, cas)


def _root_relative(name: str, target: str) -> str:
    """An absolute symlink target of a .deb (it means the package root) as a relative one."""
    inside = posixpath.normpath("/" + target).lstrip("/") or "."
    return posixpath.relpath(inside, posixpath.dirname(name) or ".")


def _tar_members(tf: tarfile.TarFile, archive: str, cas, root_links: bool = False) -> Iterator[tuple[str, object]]:
    """The checked entries of an open tar; with root_links, absolute symlinks mean the root (.deb)."""
    seen: dict[str, object] = {}
    for m in tf:
        name = _safe_name(m.name, archive)
        if not name:
            continue
        if m.isdir():
            entry: object = DirEntry()
        elif m.issym():
            link = _root_relative(name, m.linkname) if root_links and m.linkname.startswith("/") else m.linkname
            _check_link(name, link, archive)
            entry = SymlinkEntry(link)
        elif m.islnk():
            try:
                target: str | None = _safe_name(m.linkname, archive)
            except ArchiveError:
                target = None
            if target not in seen:
                raise ArchiveError(f"hard link {name!r} -> {m.linkname!r} points outside the archive; refused",
                                   where=archive)
            entry = seen[target]
        elif m.isreg():
            f = tf.extractfile(m)
            entry = cas.put_stream(f, executable=bool(m.mode & 0o100)) if f else cas.put_bytes(b"")
        else:
            raise ArchiveError(f"entry {m.name!r} is a device or fifo; refused", where=archive)
        seen[name] = entry
        yield name, entry


class _HeldBack:
    """Stands in for the CAS while a .deb is read: blobs are kept in memory and stored only
    once every entry has passed the checks (packages are small; a refused one stores nothing)."""

    def __init__(self, cas: LocalCas):
        self.cas = cas
        self.held: dict[str, bytes] = {}

    def put_bytes(self, data: bytes, executable: bool = False) -> FileEntry:
        digest = self.cas.digester.of(data)
        self.held[digest] = data
        return FileEntry(digest, len(data), executable)

    def put_stream(self, src, executable: bool = False) -> FileEntry:
        return self.put_bytes(src.read(), executable)

    def commit(self) -> None:
        for data in self.held.values():
            self.cas.put_bytes(data)
        self.held.clear()


def _is_deb(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(len(AR_MAGIC)) == AR_MAGIC


def _deb_entries(path: str, archive: str, cas) -> Iterator[tuple[str, object]]:
    """The entries of a .deb's data.tar member (maintainer scripts live in control.tar: never read)."""
    with open(path, "rb") as f:
        try:
            members = {m.name: m for m in ArFile(fileobj=f).getmembers()}
        except (ArError, OSError, ValueError) as e:
            raise ArchiveError(f"not a readable .deb (ar) archive: {e}", where=archive) from None
        data = sorted(n for n in members if n.startswith("data.tar"))
        if not data:
            raise ArchiveError(f"no data.tar member (members: {', '.join(members) or 'none'}); not a Debian package",
                               where=archive)
        if data[0].endswith(".zst"):
            raise ArchiveError(f"{data[0]} is zstd-compressed, which is not supported (Debian 12's packages use xz)",
                               where=archive)
        try:
            with tarfile.open(fileobj=members[data[0]], mode="r:*") as tf:
                yield from _tar_members(tf, archive, cas, root_links=True)
        except (tarfile.TarError, lzma.LZMAError, zlib.error, EOFError) as e:
            raise ArchiveError(f"{data[0]} is not a readable tar archive: {e}", where=archive) from None


def _zip_entries(path: str, archive: str, cas: LocalCas) -> Iterator[tuple[str, object]]:
    try:
        zf = zipfile.ZipFile(path)
    except zipfile.BadZipFile as e:
        raise ArchiveError(f"not a readable zip archive: {e}", where=archive) from None
    with zf:
        for info in zf.infolist():
            name = _safe_name(info.filename, archive)
            if not name:
                continue
            mode = info.external_attr >> 16
            if info.is_dir():
                yield name, DirEntry()
            elif stat.S_ISLNK(mode):
                target = zf.read(info).decode()
                _check_link(name, target, archive)
                yield name, SymlinkEntry(target)
            else:
                with zf.open(info) as member:  # a chunk at a time (see LocalCas.put_stream)
                    yield name, cas.put_stream(member, executable=bool(mode & 0o100))


def extract(cas: LocalCas, action: Action) -> tuple[Tree, ActionResult]:
    """Run an extract action: its one input file -> a tree of the archive's entries."""
    spec = dict(action.spec)
    archive_tree = action.input_tree("archive")
    [(filename, blob)] = archive_tree.files().items()
    if not cas.verify(blob):
        raise ArchiveError("archive blob missing or corrupted in the store", where=filename)
    start = time.monotonic()
    path = str(cas.blob_path(blob.digest))
    deb = _is_deb(path)
    store = _HeldBack(cas) if deb else cas
    reader = _deb_entries if deb else _zip_entries if zipfile.is_zipfile(path) else _tar_entries
    entries: dict[str, object] = {}
    prefix = spec.get("strip_prefix", "").strip("/")
    leaves: dict[str, object] = {}
    parents: dict[str, str] = {}
    for name, entry in reader(path, filename, store):
        _check_nesting(name, entry, leaves, parents, filename)
        rel = _strip(name, prefix)
        if rel:
            entries[rel] = entry
    # Directories are implied by their contents; keep only the empty ones.
    parents = {p.rsplit("/", i)[0] for p in entries for i in range(1, p.count("/") + 1)}
    entries = {p: e for p, e in entries.items() if not (isinstance(e, DirEntry) and p in parents)}
    if not entries and not deb:  # a package may ship nothing (a transitional one)
        raise ArchiveError(f"nothing left after strip_prefix {prefix!r}", where=filename)
    if isinstance(store, _HeldBack):
        store.commit()
    tree = Tree(entries)
    empty = cas.put_bytes(b"").digest
    return tree, ActionResult(cas.put_tree(tree), 0, empty, empty, round(time.monotonic() - start, 3), len(tree))
