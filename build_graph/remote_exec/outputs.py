"""A lease's outputs: read from its writable directories after the run, stored in the worker's
local CAS, described as REAPI OutputFile / OutputSymlink / OutputDirectory (a Tree), and the
blobs the server lacks uploaded (FindMissingBlobs, then BatchUpdateBlobs or ByteStream)."""

from __future__ import annotations

import os
import posixpath
import stat
from pathlib import Path

from build_graph.model import FileEntry
from build_graph.store.cas import LocalCas


class Collected:
    """The outputs found and the blobs (hash -> (size, local path or bytes)) they need uploaded."""

    def __init__(self):
        self.files: list = []
        self.symlinks: list = []
        self.directories: list = []
        self.blobs: dict[str, tuple[int, object]] = {}

    def blob(self, entry: FileEntry, source) -> None:
        """Name a blob to upload: `source` is a local path or the bytes themselves."""
        self.blobs.setdefault(entry.digest, (entry.size, source))


def collect(pb, cas: LocalCas, host_of, outputs: list[str], working_directory: str) -> Collected:
    """Every output that exists: `host_of(path)` maps an input-root path to the host path that
    holds it (in a writable directory). Paths in the result are relative to the working directory."""
    got = Collected()
    for path in outputs:
        host = host_of(path)
        rel = posixpath.relpath(path, working_directory) if working_directory else path
        try:
            st = os.lstat(host)
        except FileNotFoundError:
            continue  # a declared output the action did not make is absent (REAPI)
        if stat.S_ISLNK(st.st_mode):
            got.symlinks.append(pb.OutputSymlink(path=rel, target=os.readlink(host)))
        elif stat.S_ISREG(st.st_mode):
            entry = _store(cas, host, st)
            got.blob(entry, cas.blob_path(entry.digest))
            got.files.append(pb.OutputFile(path=rel, digest=pb.Digest(hash=entry.digest, size_bytes=entry.size),
                                           is_executable=entry.executable))
        elif stat.S_ISDIR(st.st_mode):
            tree, root = _tree(pb, cas, Path(host), got)
            data = tree.SerializeToString()
            tree_entry = cas.put_bytes(data)
            got.blob(tree_entry, data)
            got.directories.append(pb.OutputDirectory(
                path=rel, tree_digest=pb.Digest(hash=tree_entry.digest, size_bytes=tree_entry.size),
                root_directory_digest=root, is_topologically_sorted=False))
    return got


def _store(cas: LocalCas, host: str, st: os.stat_result) -> FileEntry:
    return cas.put_file(host, executable=bool(st.st_mode & 0o111))


def _tree(pb, cas: LocalCas, top: Path, got: Collected):
    """The REAPI Tree of directory `top` (its root and every directory below, once each by
    digest) and its root Directory's digest; every file is stored and named for upload."""
    children: dict[str, object] = {}

    def directory(d: Path, depth: int):
        if depth > 256:
            raise OSError(f"output directory {top} nests more than 256 deep")
        msg = pb.Directory()
        with os.scandir(d) as it:
            names = sorted(it, key=lambda e: e.name)
        for e in names:
            st = e.stat(follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                msg.symlinks.add(name=e.name, target=os.readlink(e.path))
            elif stat.S_ISREG(st.st_mode):
                entry = _store(cas, e.path, st)
                got.blob(entry, cas.blob_path(entry.digest))
                msg.files.add(name=e.name, digest=pb.Digest(hash=entry.digest, size_bytes=entry.size),
                              is_executable=entry.executable)
            elif stat.S_ISDIR(st.st_mode):
                sub = directory(Path(e.path), depth + 1)
                data = sub.SerializeToString()
                entry = cas.put_bytes(data)
                children.setdefault(entry.digest, sub)
                got.blob(entry, data)
                msg.directories.add(name=e.name, digest=pb.Digest(hash=entry.digest, size_bytes=entry.size))
            # sockets, fifos, devices: not content, left out (as local builds do)
        return msg

    root = directory(top, 0)
    data = root.SerializeToString()
    entry = cas.put_bytes(data)
    got.blob(entry, data)
    return pb.Tree(root=root, children=list(children.values())), pb.Digest(hash=entry.digest, size_bytes=entry.size)


def upload(remote, blobs: dict[str, tuple[int, object]]) -> None:
    """Upload the blobs the server lacks; each read from its local path only then."""
    if not blobs:
        return
    missing = remote.find_missing({h: size for h, (size, _src) in blobs.items()})
    batch: dict[str, bytes] = {}
    held = 0
    for h in missing:
        size, source = blobs[h]
        batch[h] = source if isinstance(source, bytes) else Path(source).read_bytes()
        held += size
        if held > 64 << 20:  # bounded memory: upload what is gathered
            remote.put_blobs(batch)
            batch, held = {}, 0
    remote.put_blobs(batch)
