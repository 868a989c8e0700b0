"""A remote result's blobs brought into the local CAS, never held whole in memory.

Blobs up to the server's batch size are read in BatchReadBlobs requests (a batch at a time);
larger ones by ByteStream.Read, a chunk at a time, into a file of the cache's staging area
whose runs of zeros stay holes (a sparse output stays sparse, as a local ingest keeps it), then
renamed into the store. Every blob is hashed with the server's digest function as it arrives
and refused unless it has exactly its digest's size and hash: nothing unchecked is stored.
stdout and stderr keep their last LOG_CAP bytes only, as the worker's logs do (outputs.cap_log).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading
import time

from build_graph.model import FileEntry
from build_graph.remote_exec.outputs import LOG_CAP
from build_graph.store.remote import BodyTooLarge, RemoteUnavailable

HOLE = 64 << 10  # all-zero slices this long of what arrives become holes of the stored file
_ZEROS = bytes(HOLE)
READ_ATTEMPTS = 3  # a ByteStream read broken by UNAVAILABLE is started again this often


class FetchError(Exception):
    """A blob the server did not give as its digest says (missing, wrong bytes, unreachable)."""


class Fetcher:
    """Reads blobs of `remote` (a ReapiRemote whose digest function is set) into `cas`;
    `function` is the remote's hash name; `transient(call)` retries a busy server's answer."""

    def __init__(self, remote, cas, function: str, transient=lambda call: call()):
        self.remote, self.cas, self.function, self.transient = remote, cas, function, transient
        self._downloaded = 0  # bytes read since taken (several actions' fetches run at once)
        self._lock = threading.Lock()

    def _count(self, n: int) -> None:
        with self._lock:
            self._downloaded += n

    def take_downloaded(self) -> int:
        """The bytes fetched since the last call."""
        with self._lock:
            n, self._downloaded = self._downloaded, 0
        return n

    def _batched(self, size: int) -> bool:
        return size + 1024 <= self.remote.max_batch

    def _check(self, h: str, size: int, data: bytes) -> bytes:
        if len(data) != size or hashlib.new(self.function, data).hexdigest() != h:
            raise FetchError(f"blob {h[:16]}… from the server does not hash to its digest")
        return data

    def small(self, sizes: dict[str, int]) -> dict[str, bytes]:
        """Blobs of at most the batch size, each checked against its digest."""
        try:
            got = self.transient(lambda: self.remote.get_blobs(sizes)) if sizes else {}
        except (RemoteUnavailable, BodyTooLarge) as e:
            raise FetchError(f"fetching outputs: {e}") from None
        for h, size in sizes.items():
            if h not in got:
                raise FetchError(f"the server's result names blob {h[:16]}…, which it does not hold")
            self._check(h, size, got[h])
        self._count(sum(sizes.values()))
        return got

    def message_bytes(self, h: str, size: int, cap: int) -> bytes:
        """One blob read into memory (a Tree or Directory message), refused above `cap` bytes."""
        if size > cap:
            raise FetchError(f"blob {h[:16]}… is {size} bytes, over the {cap} a tree may have")
        if self._batched(size):
            return self.small({h: size})[h]
        data = bytearray()
        for chunk in self._chunks(h, size):
            data += chunk
        return self._check(h, size, bytes(data))

    def files(self, wanted: dict[tuple[str, bool], int]) -> dict[tuple[str, bool], FileEntry]:
        """Blobs (hash, executable) -> size stored in the local CAS: (hash, executable) -> entry."""
        out: dict[tuple[str, bool], FileEntry] = {}
        batch: dict[tuple[str, bool], int] = {}
        total = 0

        def flush() -> None:
            got = self.small({h: size for (h, _x), size in batch.items()})
            for (h, executable) in batch:
                out[(h, executable)] = self.cas.put_bytes(got[h], executable)
            batch.clear()

        for (h, executable), size in wanted.items():
            if not self._batched(size):
                out[(h, executable)] = self._stream_to_cas(h, size, executable)
                continue
            if total + size + 1024 > self.remote.max_batch:
                flush()
                total = 0
            batch[(h, executable)] = size
            total += size + 100
        flush()
        return out

    def _stream_to_cas(self, h: str, size: int, executable: bool) -> FileEntry:
        """A large blob read by ByteStream into a staging file (zeros as holes), checked, moved in."""
        for attempt in range(READ_ATTEMPTS):
            fd, tmp = tempfile.mkstemp(dir=self.cas.tmp)
            try:
                try:
                    digest, written = hashlib.new(self.function), 0
                    for chunk in self._chunks(h, size):
                        digest.update(chunk)
                        _write_sparse(fd, chunk)
                        written += len(chunk)
                    os.ftruncate(fd, written)
                finally:
                    os.close(fd)
                if written != size or digest.hexdigest() != h:
                    raise FetchError(f"blob {h[:16]}… from the server does not hash to its digest")
                self._count(size)
                return self.cas.put_file(tmp, executable=executable, move=True)  # renamed in: holes kept
            except _Retry:
                os.unlink(tmp)
                if attempt == READ_ATTEMPTS - 1:
                    raise FetchError(f"reading blob {h[:16]}… failed {READ_ATTEMPTS} times (UNAVAILABLE)") from None
                time.sleep(0.5 * (attempt + 1))
            except BaseException:
                if os.path.exists(tmp):
                    os.unlink(tmp)
                raise
        raise AssertionError("unreachable")

    def _chunks(self, h: str, size: int):
        """The blob's bytes by ByteStream.Read, a message at a time, never past `size`."""
        remote, grpc = self.remote, self.remote.grpc
        read = remote._method("/google.bytestream.ByteStream/Read", remote.pb.ReadRequest, remote.pb.ReadResponse,
                              "read")
        stream = read(remote.pb.ReadRequest(resource_name=remote._resource(h, size)),
                      timeout=remote.timeout + size / (20 << 20))
        got = 0
        try:
            for response in stream:
                got += len(response.data)
                if got > size:
                    stream.cancel()
                    raise FetchError(f"blob {h[:16]}… is over the {size} bytes its digest names (stopped reading)")
                yield response.data
        except grpc.RpcError as e:
            code = e.code()
            if code == grpc.StatusCode.NOT_FOUND:
                raise FetchError(f"the server's result names blob {h[:16]}…, which it does not hold") from None
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED):
                raise _Retry() from None
            raise FetchError(f"reading blob {h[:16]}…: {code.name}: {(e.details() or '')[:200]}") from None
        finally:
            stream.cancel()  # a read left early (refused, or a consumer's error) holds no call open

    def log(self, raw: bytes, digest) -> bytes:
        """stdout or stderr: inline, else read; above LOG_CAP bytes only its tail, after a line
        saying how much was dropped (outputs.cap_log's form)."""
        if raw or not digest.hash:
            return _capped(raw, len(raw))
        h, size = digest.hash, digest.size_bytes
        if self._batched(size):
            return _capped(self.small({h: size})[h], size)
        for attempt in range(READ_ATTEMPTS):
            hasher, tail, total = hashlib.new(self.function), bytearray(), 0
            try:
                for chunk in self._chunks(h, size):
                    hasher.update(chunk)
                    total += len(chunk)
                    tail += chunk
                    if len(tail) > 2 * LOG_CAP:  # trimmed now and then: at most 2 caps held
                        del tail[:len(tail) - LOG_CAP]
            except _Retry:
                if attempt == READ_ATTEMPTS - 1:
                    raise FetchError(f"reading blob {h[:16]}… failed {READ_ATTEMPTS} times (UNAVAILABLE)") from None
                time.sleep(0.5 * (attempt + 1))
                continue
            if total != size or hasher.hexdigest() != h:
                raise FetchError(f"blob {h[:16]}… from the server does not hash to its digest")
            self._count(size)
            return _capped(bytes(tail[-LOG_CAP:]), total)
        raise AssertionError("unreachable")


class _Retry(Exception):
    """A read the server broke off for a passing reason (UNAVAILABLE, RESOURCE_EXHAUSTED)."""


def _capped(data: bytes, total: int) -> bytes:
    """A log's last LOG_CAP bytes (`data` ends the log of `total` bytes), with a first line
    saying how many were dropped, where any were."""
    if total <= LOG_CAP:
        return data
    kept = data[-LOG_CAP:]
    return (f"[bgraph: the first {total - len(kept)} of {total} bytes of this log were dropped; the last "
            f"{len(kept)} follow]\n").encode() + kept


def _write_sparse(fd: int, chunk: bytes) -> None:
    """Append `chunk` to the file at `fd`, skipping (leaving a hole for) each all-zero HOLE slice."""
    view = memoryview(chunk)
    for i in range(0, len(view), HOLE):
        piece = view[i:i + HOLE]
        if piece == _ZEROS[:len(piece)]:
            os.lseek(fd, len(piece), os.SEEK_CUR)
        else:
            while piece:
                piece = piece[os.write(fd, piece):]
