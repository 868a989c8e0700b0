"""A lease's outputs: read from its writable directories after the run, stored in the worker's
local CAS, described as REAPI OutputFile / OutputSymlink / OutputDirectory (a Tree), and the
blobs the server lacks uploaded (FindMissingBlobs, then BatchUpdateBlobs or ByteStream).

The action decides what lies there: directories are walked iteratively and by file descriptor
(any depth up to MAX_DEPTH, any path length), only regular files are opened, a sparse file is
stored sparse (its holes cost the cache no disk) and a big blob is uploaded a chunk at a time,
never held in memory whole. A file over the size bounds local builds keep (cas.MAX_OUTPUT_FILE,
MAX_OUTPUT_TOTAL) is refused by its size before it is read: hashing and uploading read every
byte, a sparse file's holes too."""

from __future__ import annotations

import os
import posixpath
import stat
import tempfile
from pathlib import Path

from build_graph.model import FileEntry
from build_graph.store.cas import LocalCas, copy_sparse, enter_dir, output_size_problem
from build_graph.store.remote import RemoteUnavailable

MAX_DEPTH = 256  # an output directory nested deeper is refused (as input roots are)
SMALL = 1 << 20  # files up to this size are read whole and stored (hashed first, written if new)
LOG_CAP = 16 << 20  # stdout/stderr above this keep their tail only (cap_log)
STREAM_CHUNK = 1 << 20  # ByteStream.Write message size


class BadOutput(Exception):
    """Outputs the worker will not take (the action's own doing: INVALID_ARGUMENT, no retry)."""


class Collected:
    """The outputs found and the blobs (hash -> (size, local path or bytes)) they need uploaded."""

    def __init__(self):
        self.files: list = []
        self.symlinks: list = []
        self.directories: list = []
        self.blobs: dict[str, tuple[int, object]] = {}
        self.size = 0  # bytes of the output files stored so far (cas.MAX_OUTPUT_TOTAL)

    def sized(self, rel: str, size: int) -> None:
        """Count an output file of `size` bytes before it is read: one over the bounds local
        builds keep (cas.output_size_problem) is BadOutput, never hashed nor uploaded."""
        problem = output_size_problem(rel, size, self.size)
        if problem:
            raise BadOutput(problem)
        self.size += size

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
            got.sized(rel, st.st_size)
            entry = _store(cas, host, st)
            got.blob(entry, cas.blob_path(entry.digest))
            got.files.append(pb.OutputFile(path=rel, digest=pb.Digest(hash=entry.digest, size_bytes=entry.size),
                                           is_executable=entry.executable))
        elif stat.S_ISDIR(st.st_mode):
            tree, root = _tree(pb, cas, Path(host), got, rel)
            data = tree.SerializeToString()
            tree_entry = cas.put_bytes(data)
            got.blob(tree_entry, data)
            got.directories.append(pb.OutputDirectory(
                path=rel, tree_digest=pb.Digest(hash=tree_entry.digest, size_bytes=tree_entry.size),
                root_directory_digest=root, is_topologically_sorted=False))
    return got


def _store(cas: LocalCas, host: str, st: os.stat_result, dir_fd: int | None = None) -> FileEntry:
    """Store regular file `host` (relative to `dir_fd` where given), opened without following a
    link or blocking on a FIFO swapped in; a sparse file stays sparse in the cache."""
    executable = bool(st.st_mode & 0o111)
    fd = os.open(host, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise BadOutput(f"output file {host} changed into something else while it was read")
        if st.st_size <= SMALL:
            data = os.pread(fd, st.st_size + 1, 0)
            if len(data) == st.st_size:
                return cas.put_bytes(data, executable)
        tmp_fd, tmp = tempfile.mkstemp(dir=cas.tmp)
        try:
            copy_sparse(fd, tmp_fd)
        except BaseException:
            os.close(tmp_fd)
            os.unlink(tmp)
            raise
        os.close(tmp_fd)
        return cas.put_file(tmp, executable=executable, move=True)  # renamed in: holes kept
    finally:
        os.close(fd)


def store_file(cas: LocalCas, path: Path | str) -> FileEntry:
    """Store regular file `path` as outputs are stored (sparse kept, never followed)."""
    return _store(cas, os.fspath(path), os.lstat(path))


def _name(name: str, where: str) -> str:
    try:
        name.encode()
    except UnicodeEncodeError:
        raise BadOutput(f"output {where} holds a name that is not UTF-8: {name!r}") from None
    return name


def _tree(pb, cas: LocalCas, top: Path, got: Collected, rel: str = ""):
    """The REAPI Tree of directory `top` (its root and every directory below, once each by
    digest) and its root Directory's digest; every file is stored and named for upload. Walked
    with a stack of open directories, not recursion; deeper than MAX_DEPTH is BadOutput."""
    children: dict[str, object] = {}
    stack: list[list] = []  # [fd, Directory, [(name, stat)], next index, name in parent]

    def enter(parent_fd: int | None, name: str) -> None:
        fd = enter_dir(name, parent_fd) if parent_fd is not None else \
            os.open(top, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        stack.append([fd, pb.Directory(), [], 0, name])
        with os.scandir(fd) as it:
            stack[-1][2] = sorted((e.name, e.stat(follow_symlinks=False)) for e in it)

    root = None
    try:
        enter(None, "")
        while stack:
            frame = stack[-1]
            fd, msg, items, i, _ = frame
            if i == len(items):
                stack.pop()
                os.close(fd)
                if not stack:
                    root = msg
                    break
                data = msg.SerializeToString()
                entry = cas.put_bytes(data)
                children.setdefault(entry.digest, msg)
                got.blob(entry, data)
                stack[-1][1].directories.add(name=frame[4], digest=pb.Digest(hash=entry.digest, size_bytes=entry.size))
                continue
            frame[3] = i + 1
            name, st = items[i]
            _name(name, str(top))
            if stat.S_ISLNK(st.st_mode):
                msg.symlinks.add(name=name, target=_name(os.readlink(name, dir_fd=fd), str(top)))
            elif stat.S_ISREG(st.st_mode):
                got.sized(posixpath.join(rel, *(f[4] for f in stack[1:]), name), st.st_size)
                entry = _store(cas, name, st, fd)
                got.blob(entry, cas.blob_path(entry.digest))
                msg.files.add(name=name, digest=pb.Digest(hash=entry.digest, size_bytes=entry.size),
                              is_executable=entry.executable)
            elif stat.S_ISDIR(st.st_mode):
                if len(stack) > MAX_DEPTH:
                    raise BadOutput(f"output directory {top} nests more than {MAX_DEPTH} directories deep")
                enter(fd, name)
            # sockets, fifos, devices: not content, left out (as local builds do)
    finally:
        for frame in stack:
            os.close(frame[0])
    data = root.SerializeToString()
    entry = cas.put_bytes(data)
    got.blob(entry, data)
    return pb.Tree(root=root, children=list(children.values())), pb.Digest(hash=entry.digest, size_bytes=entry.size)


def cap_log(path: Path, cap: int = LOG_CAP) -> Path:
    """`path` (a lease's stdout or stderr) where it is at most `cap` bytes; else a new file
    beside it holding a first line saying how many bytes were dropped, then the last `cap`."""
    size = os.stat(path).st_size
    if size <= cap:
        return path
    capped = path.with_name(path.name + ".tail")
    with open(path, "rb") as src, open(capped, "wb") as dst:
        dst.write(f"[bgraph worker: the first {size - cap} of {size} bytes were dropped; the last {cap} follow]\n"
                  .encode())
        src.seek(size - cap)
        zeros = bytes(STREAM_CHUNK)
        while chunk := src.read(STREAM_CHUNK):
            if chunk == zeros[:len(chunk)]:
                dst.seek(len(chunk), os.SEEK_CUR)  # a hole where the log had zeros (a sparse log's)
            else:
                dst.write(chunk)
        dst.truncate()
    return capped


def _stream(remote, digest: str, size: int, path) -> None:
    """Upload file `path` as blob `digest` by ByteStream.Write, a chunk read at a time."""
    pb = remote.pb
    name = remote._resource(digest, size, upload=True)
    write = remote._method("/google.bytestream.ByteStream/Write", pb.WriteRequest, pb.WriteResponse, "write")

    def requests():
        with open(path, "rb") as src:
            offset = 0
            while True:
                chunk = src.read(STREAM_CHUNK)
                last = offset + len(chunk) >= size or not chunk
                yield pb.WriteRequest(resource_name=name if offset == 0 else "", write_offset=offset,
                                      finish_write=last, data=chunk)
                offset += len(chunk)
                if last:
                    return
    response = remote._guarded(lambda: write(requests(), timeout=remote.timeout + size / (20 << 20)))
    if response.committed_size not in (size, -1):
        raise RemoteUnavailable(f"ByteStream.Write committed {response.committed_size} of {size} bytes")


def upload(remote, blobs: dict[str, tuple[int, object]]) -> None:
    """Upload the blobs the server lacks; each read from its local path only then, one over the
    server's batch size streamed by ByteStream (never read whole)."""
    if not blobs:
        return
    missing = remote.find_missing({h: size for h, (size, _src) in blobs.items()})
    batch: dict[str, bytes] = {}
    held = 0
    patiently = getattr(remote, "patiently", None) or (lambda fn, *args: fn(*args))
    for h in missing:
        size, source = blobs[h]
        if not isinstance(source, bytes) and size + 1024 > getattr(remote, "max_batch", 4 << 20):
            patiently(_stream, remote, h, size, source)
            continue
        batch[h] = source if isinstance(source, bytes) else Path(source).read_bytes()
        held += size
        if held > 64 << 20:  # bounded memory: upload what is gathered
            remote.put_blobs(batch)
            batch, held = {}, 0
    remote.put_blobs(batch)
