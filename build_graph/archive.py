"""Unpack tar and zip archives into the CAS as a Tree, refusing entries that escape the root.

Runs in-process (no sandbox): it reads one verified blob and writes blobs, and never runs
anything the archive holds. Refused: absolute names, `..` components, symlinks or hard links
pointing outside the root, entries below a symlink, device and fifo entries.
"""

from __future__ import annotations

import posixpath
import stat
import tarfile
import time
import zipfile
from typing import Iterator

from build_graph.errors import ArchiveError
from build_graph.model import Action, ActionResult, DirEntry, SymlinkEntry, Tree
from build_graph.store.cas import LocalCas


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
    seen: dict[str, object] = {}
    with tf:
        for m in tf:
            name = _safe_name(m.name, archive)
            if not name:
                continue
            if m.isdir():
                entry: object = DirEntry()
            elif m.issym():
                _check_link(name, m.linkname, archive)
                entry = SymlinkEntry(m.linkname)
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
                data = f.read() if f else b""
                entry = cas.put_bytes(data, executable=bool(m.mode & 0o100))
            else:
                raise ArchiveError(f"entry {m.name!r} is a device or fifo; refused", where=archive)
            seen[name] = entry
            yield name, entry


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
                yield name, cas.put_bytes(zf.read(info), executable=bool(mode & 0o100))


def extract(cas: LocalCas, action: Action) -> tuple[Tree, ActionResult]:
    """Run an extract action: its one input file -> a tree of the archive's entries."""
    spec = dict(action.spec)
    archive_tree = action.input_tree("archive")
    [(filename, blob)] = archive_tree.files().items()
    if not cas.verify(blob):
        raise ArchiveError("archive blob missing or corrupted in the store", where=filename)
    start = time.monotonic()
    path = str(cas.blob_path(blob.digest))
    reader = _zip_entries if zipfile.is_zipfile(path) else _tar_entries
    entries: dict[str, object] = {}
    prefix = spec.get("strip_prefix", "").strip("/")
    leaves: dict[str, object] = {}
    parents: dict[str, str] = {}
    for name, entry in reader(path, filename, cas):
        _check_nesting(name, entry, leaves, parents, filename)
        rel = _strip(name, prefix)
        if rel:
            entries[rel] = entry
    # Directories are implied by their contents; keep only the empty ones.
    parents = {p.rsplit("/", i)[0] for p in entries for i in range(1, p.count("/") + 1)}
    entries = {p: e for p, e in entries.items() if not (isinstance(e, DirEntry) and p in parents)}
    if not entries:
        raise ArchiveError(f"nothing left after strip_prefix {prefix!r}", where=filename)
    tree = Tree(entries)
    empty = cas.put_bytes(b"").digest
    return tree, ActionResult(cas.put_tree(tree), 0, empty, empty, round(time.monotonic() - start, 3), len(tree))
