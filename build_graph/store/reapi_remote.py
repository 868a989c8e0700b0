"""A remote cache over gRPC: the Remote Execution API v2 cache services (Capabilities,
ContentAddressableStorage, ActionCache) and google.bytestream for blobs beyond the batch limit,
as BuildGrid, Buildbarn or bazel-remote serve them.

bgraph's entries (signed JSON envelopes, see layered.py) are stored the REAPI way: the envelope
is a CAS blob, and the action cache maps the entry's key to an ActionResult whose one output
file, `bgraph-entry.json`, is that blob. Blobs and directory nodes are plain CAS blobs.

Blobs are read up to the size their digest names, never more (a ByteStream read that passes
it is cancelled: BodyTooLarge), and an entry's blob only if the server's ActionResult names no
more than MAX_ENTRY_BYTES for it.
"""

from __future__ import annotations

import threading
import uuid

from build_graph.errors import LoadError
from build_graph.store.remote import MAX_ENTRY_BYTES, BodyTooLarge, CircuitBreaker, RemoteUnavailable

ENTRY_FILE = "bgraph-entry.json"
CHUNK = 1 << 20
DIGEST_FUNCTIONS = {"sha256": 1, "blake3": 9}  # DigestFunction.Value
_CAS = "/build.bazel.remote.execution.v2.ContentAddressableStorage/"
_AC = "/build.bazel.remote.execution.v2.ActionCache/"


class ReapiRemote:
    """One channel to a REAPI server; `url` is grpc://host:port[/instance]."""

    def __init__(self, url: str, digest_function: str, timeout_s: float = 10.0,
                 breaker: CircuitBreaker | None = None):
        import grpc

        from build_graph.store.reapi import reapi_pb2 as pb

        self.url, self.pb, self.grpc = url, pb, grpc
        target, _, self.instance = url.split("://", 1)[1].partition("/")
        self.timeout = timeout_s
        self.breaker = breaker or CircuitBreaker()
        self.function = DIGEST_FUNCTIONS[digest_function]
        self.digest_function_name = digest_function
        secure = url.startswith("grpcs://")
        self.channel = (grpc.secure_channel(target, grpc.ssl_channel_credentials()) if secure
                        else grpc.insecure_channel(target))
        self._calls: dict[str, object] = {}
        self._lock = threading.Lock()
        self.max_batch = 4 << 20
        self._capabilities_checked = False

    def _method(self, path: str, request_type, response_type, kind: str = "unary"):
        with self._lock:
            call = self._calls.get(path)
            if call is None:
                make = {"unary": self.channel.unary_unary, "read": self.channel.unary_stream,
                        "write": self.channel.stream_unary}[kind]
                call = self._calls[path] = make(path, request_serializer=request_type.SerializeToString,
                                                response_deserializer=response_type.FromString)
        return call

    def _guarded(self, call, not_found_is_none: bool = False):
        """Run `call()` (one RPC, streams drained) under the circuit breaker: transport faults
        become RemoteUnavailable; NOT_FOUND is None where asked."""
        self.breaker.check()
        try:
            response = call()
        except self.grpc.RpcError as e:
            code = e.code() if hasattr(e, "code") else None
            if not_found_is_none and code == self.grpc.StatusCode.NOT_FOUND:
                self.breaker.success()
                return None
            self.breaker.failure()
            name = code.name if code is not None else "error"
            raise RemoteUnavailable(f"{name}: {(e.details() if hasattr(e, 'details') else '') or ''}"[:200]) from None
        self.breaker.success()
        return response

    def _rpc(self, fn, request, not_found_is_none: bool = False):
        return self._guarded(lambda: fn(request, timeout=self.timeout), not_found_is_none)

    # -- capabilities ----------------------------------------------------------------------
    def check_capabilities(self) -> None:
        """Fail clearly when the server cannot use this workspace's digest function."""
        pb = self.pb
        caps = self._rpc(self._method("/build.bazel.remote.execution.v2.Capabilities/GetCapabilities",
                                      pb.GetCapabilitiesRequest, pb.ServerCapabilities),
                         pb.GetCapabilitiesRequest(instance_name=self.instance))
        cache = caps.cache_capabilities
        offered = list(cache.digest_functions)
        if self.function not in offered:
            names = {v: k for k, v in DIGEST_FUNCTIONS.items()}
            have = ", ".join(names.get(f, str(f)) for f in offered) or "none"
            raise LoadError(f"remote cache {self.url} offers digest functions {have}, not "
                            f"{self.digest_function_name} (this workspace's)",
                            hint=f'set digest_function = "{names.get(offered[0], "sha256") if offered else "sha256"}" '
                                 "in WORKSPACE.toml [workspace] to use this server (a separate local cache results)")
        if cache.max_batch_total_size_bytes:
            self.max_batch = cache.max_batch_total_size_bytes
        self._capabilities_checked = True

    def server_capabilities(self):
        """The server's ServerCapabilities message (remote execution picks its digest function)."""
        pb = self.pb
        return self._rpc(self._method("/build.bazel.remote.execution.v2.Capabilities/GetCapabilities",
                                      pb.GetCapabilitiesRequest, pb.ServerCapabilities),
                         pb.GetCapabilitiesRequest(instance_name=self.instance))

    # -- blobs -----------------------------------------------------------------------------
    def _digest(self, digest: str, size: int):
        return self.pb.Digest(hash=digest, size_bytes=size)

    def find_missing(self, sizes: dict[str, int]) -> set[str]:
        pb = self.pb
        if not sizes:
            return set()
        response = self._rpc(self._method(_CAS + "FindMissingBlobs", pb.FindMissingBlobsRequest,
                                          pb.FindMissingBlobsResponse),
                             pb.FindMissingBlobsRequest(instance_name=self.instance, digest_function=self.function,
                                                        blob_digests=[self._digest(d, s) for d, s in sizes.items()]))
        return {d.hash for d in response.missing_blob_digests}

    def get_blob(self, digest: str, size: int | None = None) -> bytes | None:
        pb = self.pb
        if size is None:
            raise RemoteUnavailable(f"blob {digest[:12]}… asked for without its size")
        if size + 1024 <= self.max_batch:
            response = self._rpc(self._method(_CAS + "BatchReadBlobs", pb.BatchReadBlobsRequest,
                                              pb.BatchReadBlobsResponse),
                                 pb.BatchReadBlobsRequest(instance_name=self.instance, digest_function=self.function,
                                                          digests=[self._digest(digest, size)]))
            for r in response.responses:
                if r.status.code == 5:  # NOT_FOUND
                    return None
                if r.status.code != 0:
                    raise RemoteUnavailable(f"BatchReadBlobs: status {r.status.code} {r.status.message}"[:200])
                if len(r.data) > size:
                    raise BodyTooLarge(f"blob {digest[:12]}… is {len(r.data)} bytes, over the {size} it can have")
                return r.data
            return None
        return self._bytestream_read(digest, size)

    def _resource(self, digest: str, size: int, upload: bool = False) -> str:
        # SHA256 keeps the original layout; other functions name themselves (REAPI 2.3).
        fn = "" if self.function == 1 else f"{self.digest_function_name}/"
        prefix = f"{self.instance}/" if self.instance else ""
        session = f"uploads/{uuid.uuid4()}/" if upload else ""
        return f"{prefix}{session}blobs/{fn}{digest}/{size}"

    def _bytestream_read(self, digest: str, size: int) -> bytes | None:
        pb = self.pb
        read = self._method("/google.bytestream.ByteStream/Read", pb.ReadRequest, pb.ReadResponse, "read")
        request = pb.ReadRequest(resource_name=self._resource(digest, size))

        def drain() -> bytes:
            stream = read(request, timeout=self.timeout + size / (20 << 20))
            body = bytearray()
            for r in stream:
                body += r.data
                if len(body) > size:
                    stream.cancel()
                    raise BodyTooLarge(f"blob {digest[:12]}… is over the {size} bytes it can have (stopped reading)")
            return bytes(body)
        return self._guarded(drain, not_found_is_none=True)

    def put_blob(self, digest: str, data: bytes) -> None:
        pb = self.pb
        if len(data) + 1024 <= self.max_batch:
            response = self._rpc(self._method(_CAS + "BatchUpdateBlobs", pb.BatchUpdateBlobsRequest,
                                              pb.BatchUpdateBlobsResponse),
                                 pb.BatchUpdateBlobsRequest(
                                     instance_name=self.instance, digest_function=self.function,
                                     requests=[pb.BatchUpdateBlobsRequest.Request(
                                         digest=self._digest(digest, len(data)), data=data)]))
            for r in response.responses:
                if r.status.code != 0:
                    raise RemoteUnavailable(f"BatchUpdateBlobs: status {r.status.code} {r.status.message}"[:200])
            return
        name = self._resource(digest, len(data), upload=True)

        def requests():
            for offset in range(0, len(data), CHUNK):
                last = offset + CHUNK >= len(data)
                yield pb.WriteRequest(resource_name=name if offset == 0 else "", write_offset=offset,
                                      finish_write=last, data=data[offset:offset + CHUNK])
        write = self._method("/google.bytestream.ByteStream/Write", pb.WriteRequest, pb.WriteResponse, "write")
        response = self._guarded(lambda: write(requests(), timeout=self.timeout + len(data) / (20 << 20)))
        if response.committed_size not in (len(data), -1):
            raise RemoteUnavailable(f"ByteStream.Write committed {response.committed_size} of {len(data)} bytes")

    def put_blobs(self, blobs: dict[str, bytes]) -> None:
        """Upload several blobs: the small ones in BatchUpdateBlobs requests of up to the
        server's batch size, each larger one by ByteStream (remote execution's inputs)."""
        pb = self.pb
        batch: list = []
        size = 0

        def flush() -> None:
            if not batch:
                return
            response = self._rpc(self._method(_CAS + "BatchUpdateBlobs", pb.BatchUpdateBlobsRequest,
                                              pb.BatchUpdateBlobsResponse),
                                 pb.BatchUpdateBlobsRequest(instance_name=self.instance,
                                                            digest_function=self.function, requests=batch))
            for r in response.responses:
                if r.status.code != 0:
                    raise RemoteUnavailable(f"BatchUpdateBlobs: status {r.status.code} {r.status.message}"[:200])
            batch.clear()
        for digest, data in blobs.items():
            if len(data) + 1024 > self.max_batch:
                self.put_blob(digest, data)
                continue
            if size + len(data) + 1024 > self.max_batch:
                flush()
                size = 0
            batch.append(pb.BatchUpdateBlobsRequest.Request(digest=self._digest(digest, len(data)), data=data))
            size += len(data) + 100
        flush()

    def get_blobs(self, sizes: dict[str, int]) -> dict[str, bytes]:
        """Download several blobs (BatchReadBlobs up to the batch size, ByteStream above it);
        a blob the server lacks is left out of the answer. Each is at most its digest's size."""
        pb = self.pb
        out: dict[str, bytes] = {}
        batch: list = []
        total = 0

        def flush() -> None:
            if not batch:
                return
            response = self._rpc(self._method(_CAS + "BatchReadBlobs", pb.BatchReadBlobsRequest,
                                              pb.BatchReadBlobsResponse),
                                 pb.BatchReadBlobsRequest(instance_name=self.instance, digest_function=self.function,
                                                          digests=batch))
            for r in response.responses:
                if r.status.code == 5:  # NOT_FOUND
                    continue
                if r.status.code != 0:
                    raise RemoteUnavailable(f"BatchReadBlobs: status {r.status.code} {r.status.message}"[:200])
                if len(r.data) > sizes.get(r.digest.hash, -1):
                    raise BodyTooLarge(f"blob {r.digest.hash[:12]}… is {len(r.data)} bytes, over its size")
                out[r.digest.hash] = r.data
            batch.clear()
        for digest, size in sizes.items():
            if size + 1024 > self.max_batch:
                data = self._bytestream_read(digest, size)
                if data is not None:
                    out[digest] = data
                continue
            if total + size + 1024 > self.max_batch:
                flush()
                total = 0
            batch.append(self._digest(digest, size))
            total += size + 100
        flush()
        return out

    # -- entries ---------------------------------------------------------------------------
    def get_entry(self, key: str) -> bytes | None:
        pb = self.pb
        result = self._rpc(self._method(_AC + "GetActionResult", pb.GetActionResultRequest, pb.ActionResult),
                           pb.GetActionResultRequest(instance_name=self.instance, digest_function=self.function,
                                                     action_digest=self._digest(key, 0)),
                           not_found_is_none=True)
        if result is None:
            return None
        for f in result.output_files:
            if f.path == ENTRY_FILE:
                if f.digest.size_bytes > MAX_ENTRY_BYTES:
                    raise BodyTooLarge(f"the entry's blob is {f.digest.size_bytes} bytes, over the {MAX_ENTRY_BYTES} "
                                       "an entry can have")
                return self.get_blob(f.digest.hash, f.digest.size_bytes)
        return None

    def put_entry(self, key: str, data: bytes) -> None:
        from build_graph.model import Digester

        pb = self.pb
        digest = Digester(self.digest_function_name).of(data)
        self.put_blob(digest, data)  # the blob first: the entry must never name a missing one
        self._rpc(self._method(_AC + "UpdateActionResult", pb.UpdateActionResultRequest, pb.ActionResult),
                  pb.UpdateActionResultRequest(
                      instance_name=self.instance, digest_function=self.function,
                      action_digest=self._digest(key, 0),
                      action_result=pb.ActionResult(exit_code=0, output_files=[
                          pb.OutputFile(path=ENTRY_FILE, digest=self._digest(digest, len(data)))])))
