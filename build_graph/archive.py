"""Unpack tar, zip and Debian (.deb) archives into the CAS as a Tree, refusing entries that escape the root.

Runs in-process (no sandbox): it reads one verified blob and writes blobs, and never runs
anything the archive holds. Refused, with one line naming the archive and the member:
absolute names, `..` components, names that are not UTF-8 or hold a component over 255 bytes
(no tree or file system could hold them), entries below a symlink (or a file), device, fifo and
socket entries, and links that could lead out of the tree it makes (a member Python's readers
fail on, corrupt, truncated, encrypted or of an unsupported method, is one such line too):

- a symlink whose target, walked one component at a time from the link's directory against
  the whole tree (every member, whatever its order in the archive, after strip_prefix), climbs
  above the root, or goes *through* another symlink of the tree (`x/l0 -> ..` is kept, but not
  `x/u1 -> l0/..`: resolving it depends on where l0 leads, and chains of such links reach the
  host's files; as Python's tarfile data filter refuses them). A link to a link (`libfoo.so ->
  libfoo.so.1 -> libfoo.so.1.2`) is fine: each is checked in turn. Targets naming paths the
  tree lacks are kept (a package's links into other packages), and walked as directories;
- an absolute symlink target (except in a .deb, see below), an empty one;
- a hard link to anything but a regular file earlier in the archive, inside the root.

A .deb is an ar archive; only its data.tar.{xz,gz,bz2} member is read, through the same
checks as a tar (control.tar and its maintainer scripts are never read). In a .deb an absolute
symlink target means the package's root (dpkg installs it so), so it is made relative to the
link's directory.

Nothing is stored until the whole archive has passed: a tar's and a .deb's blobs are staged
(small ones in memory, big ones in this process's staging directory) and stored at the end;
a zip's members are all checked from its central directory before any is read. A refused
archive stores nothing, and members outside strip_prefix are never stored.
"""

from __future__ import annotations

import itertools
import lzma
import os
import posixpath
import stat
import tarfile
import tempfile
import time
import zipfile
import zlib
from typing import Iterator

from debian.arfile import ArError, ArFile

from build_graph.errors import ArchiveError
from build_graph.model import Action, ActionResult, DirEntry, FileEntry, SymlinkEntry, Tree
from build_graph.store.cas import CHUNK, LocalCas

AR_MAGIC = b"!<arch>\n"
MAX_LINK_TARGET = 4096  # PATH_MAX: a zip symlink's target is its member's bytes
HOLD_BYTES = 64 << 20  # staged blobs kept in memory up to this much; the rest go to staging files
NAME_MAX = 255  # bytes in one path component: a longer one cannot be materialized (ENAMETOOLONG)
# What Python's readers raise for a damaged, truncated or unsupported archive: bz2's and gzip's
# bad data is an OSError with no errno, an encrypted zip member a RuntimeError, a compression
# method zipfile lacks NotImplementedError, a zip name flagged UTF-8 that is not a ValueError.
_READ_ERRORS = (tarfile.TarError, zipfile.BadZipFile, lzma.LZMAError, zlib.error, EOFError, OSError,
                RuntimeError, NotImplementedError, ValueError)
UNREADABLE_HINT = ("the archive is corrupt, truncated, encrypted or uses a compression method Python's "
                   "tarfile/zipfile do not read: check the pin's URL and sha256, or repack it (tar.gz/xz, or a "
                   "zip stored or deflated)")
NAME_HINT = "repack the archive with that member renamed, or strip_prefix past it if it is not needed"


class _At:
    """What an archive reader is reading now, for the message when Python's reader fails."""

    __slots__ = ("reading",)

    def __init__(self) -> None:
        self.reading = "its first entry"


def _shown(name: str) -> str:
    """A member name as read (bytes that are not UTF-8 arrive as surrogates) printable: \\xe9."""
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def _unreadable(err: BaseException, archive: str, at: _At) -> BaseException:
    """Python's reader failing on the archive's bytes as one ArchiveError naming the member; an
    OSError with an errno is the disk's (no space, no permission), not the archive's: kept."""
    if isinstance(err, OSError) and err.errno is not None:
        return err
    if isinstance(err, RuntimeError) and "encrypted" in str(err):
        why = "it is encrypted (a password is needed)"
    elif isinstance(err, NotImplementedError):
        why = "its compression method is not supported" if "compression method" in str(err) else \
            f"it uses what Python's reader does not support ({err})"
    else:
        why = f"corrupt or truncated data ({err})"
    return ArchiveError(f"cannot read {at.reading}: {why}", where=archive, hint=UNREADABLE_HINT)


def _safe_name(name: str, archive: str) -> str:
    """The entry's normalised relative path, or an ArchiveError naming it."""
    cleaned = name.replace("\\", "/")
    if "\0" in cleaned:
        raise ArchiveError(f"entry {name!r} has a NUL byte in its name; refused", where=archive)
    try:
        raw = cleaned.encode("utf-8")
    except UnicodeEncodeError:  # tarfile hands bytes that are not UTF-8 over as surrogates
        raise ArchiveError(f"entry '{_shown(name)}' has a name that is not UTF-8; refused", where=archive,
                           hint=NAME_HINT) from None
    longest = max(raw.split(b"/"), key=len)
    if len(longest) > NAME_MAX:
        raise ArchiveError(f"entry {name[:80]!r}... has a name component of {len(longest)} bytes (at most "
                           f"{NAME_MAX} can be a file's name); refused", where=archive, hint=NAME_HINT)
    if cleaned.startswith("/") or (len(cleaned) > 1 and cleaned[1] == ":"):
        raise ArchiveError(f"entry {name!r} has an absolute path; refused", where=archive)
    norm = posixpath.normpath(cleaned)
    if norm == ".." or norm.startswith("../") or "/../" in f"/{cleaned}/":
        raise ArchiveError(f"entry {name!r} escapes the archive root ('..'); refused", where=archive)
    return "" if norm == "." else norm


def _check_link(name: str, target: str, archive: str) -> None:
    """What one symlink's own name and target say (the whole tree is checked by _check_targets)."""
    if not target or "\0" in target:
        raise ArchiveError(f"symlink {name!r} -> {target!r} has an empty or NUL target; refused", where=archive)
    try:
        target.encode("utf-8")
    except UnicodeEncodeError:
        raise ArchiveError(f"symlink {name!r} -> '{_shown(target)}' has a target that is not UTF-8; refused",
                           where=archive, hint=NAME_HINT) from None
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


def _check_targets(entries: dict[str, object], prefix: str, archive: str) -> None:
    """Walk every symlink's target against the finished tree (`entries`, after strip_prefix):
    refuse one that climbs above the root or passes through another symlink (see the module's
    docstring). Names in messages are the archive's (the prefix put back)."""
    def member(path: str) -> str:
        return f"{prefix}/{path}" if prefix and path else prefix or path

    root = f" (the root is strip_prefix {prefix!r})" if prefix else ""
    for path, entry in entries.items():
        if not isinstance(entry, SymlinkEntry):
            continue
        at = path.split("/")[:-1]  # the link's directory: no symlink on it (_check_nesting)
        steps = entry.target.split("/")
        for i, step in enumerate(steps):
            if step in ("", "."):
                continue
            if step == "..":
                if not at:
                    raise ArchiveError(f"symlink {member(path)!r} -> {entry.target!r} points outside the "
                                       f"root{root}; refused", where=archive)
                at.pop()
                continue
            at.append(step)
            here = "/".join(at)
            if i < len(steps) - 1 and isinstance(entries.get(here), SymlinkEntry):
                raise ArchiveError(f"symlink {member(path)!r} -> {entry.target!r} passes through symlink "
                                   f"{member(here)!r}; refused", where=archive)


def _strip(path: str, prefix: str) -> str | None:
    if not prefix:
        return path
    if path == prefix:
        return ""
    return path[len(prefix) + 1:] if path.startswith(prefix + "/") else None


def _checked(members: Iterator[tuple[str, object]], prefix: str, archive: str) -> dict[str, object]:
    """The tree `members` (name, entry) make, under strip_prefix, once every check passed."""
    entries: dict[str, object] = {}
    leaves: dict[str, object] = {}
    parents: dict[str, str] = {}
    for name, entry in members:
        _check_nesting(name, entry, leaves, parents, archive)
        rel = _strip(name, prefix)
        if rel:
            entries[rel] = entry
    _check_targets(entries, prefix, archive)
    # Directories are implied by their contents; keep only the empty ones.
    implied = {p.rsplit("/", i)[0] for p in entries for i in range(1, p.count("/") + 1)}
    return {p: e for p, e in entries.items() if not (isinstance(e, DirEntry) and p in implied)}


def _tar_entries(path: str, archive: str, cas, at: _At) -> Iterator[tuple[str, object]]:
    try:
        tf = tarfile.open(path, "r:*")
    except tarfile.TarError as e:
        raise ArchiveError(f"not a readable tar archive: {e}", where=archive, hint=UNREADABLE_HINT) from None
    with tf:
        yield from _tar_members(tf, archive, cas, at)


def _root_relative(name: str, target: str) -> str:
    """An absolute symlink target of a .deb (it means the package root) as a relative one."""
    inside = posixpath.normpath("/" + target).lstrip("/") or "."
    return posixpath.relpath(inside, posixpath.dirname(name) or ".")


def _tar_members(tf: tarfile.TarFile, archive: str, cas, at: _At, root_links: bool = False,
                 within: str = "") -> Iterator[tuple[str, object]]:
    """The checked entries of an open tar; with root_links, absolute symlinks mean the root (.deb).
    `within`: the member of the outer archive this tar is (a .deb's data.tar), for messages."""
    seen: dict[str, object] = {}
    at.reading = f"{within}its first entry"
    for m in tf:
        at.reading = f"{within}member '{_shown(m.name)}'"
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
            if not isinstance(seen[target], FileEntry):
                what = "symlink" if isinstance(seen[target], SymlinkEntry) else "directory"
                raise ArchiveError(f"hard link {name!r} -> {m.linkname!r} names a {what}, not a regular file; "
                                   "refused", where=archive)
            entry = seen[target]
        elif m.isreg():
            f = tf.extractfile(m)
            entry = cas.put_stream(f, executable=bool(m.mode & 0o100)) if f else cas.put_bytes(b"")
        else:
            raise ArchiveError(f"entry {m.name!r} is a device, fifo or other special file; refused", where=archive)
        seen[name] = entry
        yield name, entry
        at.reading = f"{within}the entry after '{_shown(m.name)}'"


class _Staged:
    """Stands in for the CAS while a tar or a .deb is read: blobs are kept (in memory up to
    HOLD_BYTES, the rest in this process's staging directory, which a killed build's next
    run removes) and stored only once every entry has passed the checks."""

    def __init__(self, cas: LocalCas):
        self.cas = cas
        self.digester = cas.digester
        self.held: dict[str, bytes] = {}
        self.files: dict[str, str] = {}  # digest -> staging file
        self.held_bytes = 0

    def put_bytes(self, data: bytes, executable: bool = False) -> FileEntry:
        if self.held_bytes + len(data) > HOLD_BYTES:
            return self._to_file(iter((data,)), executable)
        digest = self.digester.of(data)
        if digest not in self.held:
            self.held[digest] = data
            self.held_bytes += len(data)
        return FileEntry(digest, len(data), executable)

    def put_stream(self, src, executable: bool = False) -> FileEntry:
        first = src.read(CHUNK)
        second = src.read(CHUNK) if first else b""
        if not second:  # a small member (most are)
            return self.put_bytes(first, executable)
        return self._to_file(itertools.chain((first, second), iter(lambda: src.read(CHUNK), b"")), executable)

    def _to_file(self, chunks, executable: bool) -> FileEntry:
        fd, tmp = tempfile.mkstemp(dir=self.cas.tmp, prefix="unpack-")
        h, size = self.digester.new(), 0
        try:
            with os.fdopen(fd, "wb") as dst:
                for chunk in chunks:
                    h.update(chunk)
                    dst.write(chunk)
                    size += len(chunk)
        except BaseException:
            os.unlink(tmp)
            raise
        digest = h.hexdigest()
        if digest in self.files:
            os.unlink(tmp)
        else:
            self.files[digest] = tmp
        return FileEntry(digest, size, executable)

    def commit(self, entries: dict[str, object]) -> None:
        """Store the blobs the finished tree names (not those of members outside strip_prefix)."""
        wanted = {e.digest for e in entries.values() if isinstance(e, FileEntry)}
        for digest, data in self.held.items():
            if digest in wanted:
                self.cas.put_bytes(data)
        for digest, tmp in list(self.files.items()):
            if digest in wanted:
                self.cas.put_file(tmp, executable=False, move=True)
                del self.files[digest]
        self.held.clear()

    def discard(self) -> None:
        for tmp in self.files.values():
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
        self.files.clear()
        self.held.clear()


def _is_deb(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(len(AR_MAGIC)) == AR_MAGIC


def _deb_entries(path: str, archive: str, cas, at: _At) -> Iterator[tuple[str, object]]:
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
            tf = tarfile.open(fileobj=members[data[0]], mode="r:*")
        except (tarfile.TarError, lzma.LZMAError, zlib.error, EOFError) as e:
            raise ArchiveError(f"{data[0]} is not a readable tar archive: {e}", where=archive,
                               hint=UNREADABLE_HINT) from None
        with tf:
            yield from _tar_members(tf, archive, cas, at, root_links=True, within=f"{data[0]}'s ")


class _ZipMember:
    """A zip's regular file, read only once the whole archive has passed the checks."""

    __slots__ = ("info", "executable")

    def __init__(self, info: zipfile.ZipInfo, executable: bool):
        self.info, self.executable = info, executable


_SPECIAL = (stat.S_IFCHR, stat.S_IFBLK, stat.S_IFIFO, stat.S_IFSOCK)


def _zip_members(zf: zipfile.ZipFile, archive: str, at: _At) -> Iterator[tuple[str, object]]:
    for info in zf.infolist():
        at.reading = f"member {info.filename!r}"
        name = _safe_name(info.filename, archive)
        if not name:
            continue
        mode = info.external_attr >> 16
        if info.is_dir():
            yield name, DirEntry()
        elif stat.S_ISLNK(mode):
            if info.file_size > MAX_LINK_TARGET:
                raise ArchiveError(f"symlink {info.filename!r} has a {info.file_size}-byte target; refused",
                                   where=archive)
            try:
                target = zf.read(info).decode()
            except UnicodeDecodeError:
                raise ArchiveError(f"symlink {info.filename!r} has a target that is not UTF-8; refused",
                                   where=archive) from None
            _check_link(name, target, archive)
            yield name, SymlinkEntry(target)
        elif stat.S_IFMT(mode) in _SPECIAL:
            raise ArchiveError(f"entry {info.filename!r} is a device, fifo or other special file; refused",
                               where=archive)
        else:
            yield name, _ZipMember(info, bool(mode & 0o100))


def _unzip(path: str, archive: str, cas: LocalCas, prefix: str, at: _At) -> dict[str, object]:
    """A zip's tree: every member checked from the central directory first, then the files
    under strip_prefix read into the CAS, a chunk at a time (see LocalCas.put_stream)."""
    try:
        zf = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, ValueError) as e:  # ValueError: a name flagged UTF-8 that is not
        raise ArchiveError(f"not a readable zip archive: {e}", where=archive, hint=UNREADABLE_HINT) from None
    with zf:
        entries = _checked(_zip_members(zf, archive, at), prefix, archive)
        out: dict[str, object] = {}
        for p, e in entries.items():
            if isinstance(e, _ZipMember):
                at.reading = f"member {e.info.filename!r}"
                with zf.open(e.info) as member:
                    e = cas.put_stream(member, executable=e.executable)
            out[p] = e
        return out


def extract(cas: LocalCas, action: Action) -> tuple[Tree, ActionResult]:
    """Run an extract action: its one input file -> a tree of the archive's entries."""
    spec = dict(action.spec)
    archive_tree = action.input_tree("archive")
    [(filename, blob)] = archive_tree.files().items()
    if not cas.verify(blob):
        raise ArchiveError("archive blob missing or corrupted in the store", where=filename)
    start = time.monotonic()
    path = str(cas.blob_path(blob.digest))
    prefix = spec.get("strip_prefix", "").strip("/")
    deb = _is_deb(path)
    at = _At()
    try:
        if not deb and zipfile.is_zipfile(path):
            entries = _unzip(path, filename, cas, prefix, at)
        else:
            staged = _Staged(cas)
            try:
                entries = _checked((_deb_entries if deb else _tar_entries)(path, filename, staged, at), prefix,
                                   filename)
                if entries or deb:
                    staged.commit(entries)
            finally:
                staged.discard()
    except _READ_ERRORS as err:
        raise _unreadable(err, filename, at) from None
    if not entries and not deb:  # a package may ship nothing (a transitional one)
        raise ArchiveError(f"nothing left after strip_prefix {prefix!r}", where=filename)
    tree = Tree(entries)
    empty = cas.put_bytes(b"").digest
    return tree, ActionResult(cas.put_tree(tree), 0, empty, empty, round(time.monotonic() - start, 3), len(tree))
