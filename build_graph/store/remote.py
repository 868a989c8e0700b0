"""A remote cache over HTTP: the paths and methods of Bazel's HTTP cache protocol
(`GET/PUT/HEAD <base>/cas/<digest>`, `<base>/ac/<key>`), served by any WebDAV-capable server
(nginx with `dav_methods PUT`). The bodies under /ac are bgraph's own JSON envelopes (see
layered.py); under /cas, a blob's or directory node's bytes.

Transport faults (refused, timeouts, 5xx, short bodies) raise RemoteUnavailable; a circuit
breaker stops calling a remote that failed several times in a row, so a dead server costs one
warning and a few timeouts, not one per action.

Bodies are read as a stream with a limit, never whole and unbounded: a blob no larger than the
size its digest names (the directory node that names it was verified first), an entry (a signed
JSON envelope) no larger than MAX_ENTRY_BYTES, a blob of unknown size no larger than
MAX_UNSIZED_BYTES. A body past its limit raises BodyTooLarge as soon as it passes it.
"""

from __future__ import annotations

import threading
from typing import Protocol


MAX_ENTRY_BYTES = 16 << 20  # an envelope: a result (and its nodes' sizes) or up to 8 depfile manifests
MAX_UNSIZED_BYTES = 64 << 20  # a blob asked for without its size (an entry naming no size hint)
CHUNK = 1 << 20
_DRAIN_BYTES = 64 << 10  # an error page read to keep its connection, at most this much


class RemoteUnavailable(Exception):
    """The remote could not be reached or answered with a server error."""


class BodyTooLarge(Exception):
    """The remote sent (or announced) more bytes than the thing asked for can have."""


class RemoteCache(Protocol):
    """What the layered store needs of a remote: bytes by digest, envelopes by key."""

    url: str

    def get_blob(self, digest: str, size: int | None = None) -> bytes | None: ...
    def find_missing(self, sizes: dict[str, int]) -> set[str]: ...
    def put_blob(self, digest: str, data: bytes) -> None: ...
    def get_entry(self, key: str) -> bytes | None: ...
    def put_entry(self, key: str, data: bytes) -> None: ...


class CircuitBreaker:
    """Open after `limit` consecutive failures: then every call is refused at once."""

    def __init__(self, limit: int = 3):
        self.limit, self.failures, self.open = limit, 0, False
        self._lock = threading.Lock()

    def check(self) -> None:
        """Refuse at once when open."""
        if self.open:
            raise RemoteUnavailable("not used any more in this build (it failed repeatedly)")

    def success(self) -> None:
        with self._lock:
            self.failures = 0

    def failure(self) -> bool:
        """Count a failure; True when this one opened the breaker."""
        with self._lock:
            self.failures += 1
            if not self.open and self.failures >= self.limit:
                self.open = True
                return True
            return False


class HttpRemote:
    """Bazel's HTTP cache protocol with one pooled, keep-alive session."""

    def __init__(self, url: str, timeout_s: float = 10.0, breaker: CircuitBreaker | None = None):
        import requests
        from requests.adapters import HTTPAdapter

        self.url = url.rstrip("/")
        self.timeout = (min(timeout_s, 5.0), timeout_s)  # (connect, read)
        self.breaker = breaker or CircuitBreaker()
        self._local = threading.local()
        self._requests = requests
        self._adapter = HTTPAdapter(pool_connections=4, pool_maxsize=16, max_retries=0)

    def _session(self):
        s = getattr(self._local, "session", None)
        if s is None:
            s = self._local.session = self._requests.Session()
            s.mount("http://", self._adapter)
            s.mount("https://", self._adapter)
        return s

    def _call(self, method: str, path: str, data: bytes | None = None, limit: int = 0):
        """(response, body): the body read as a stream, up to `limit` bytes (GET with 200), else
        None (an error page is read and dropped, at most _DRAIN_BYTES of it)."""
        self.breaker.check()
        try:
            with self._session().request(method, f"{self.url}/{path}", data=data, timeout=self.timeout, stream=True,
                                         headers={"Accept-Encoding": "identity"}) as r:
                if r.status_code >= 500:
                    raise RemoteUnavailable(f"HTTP {r.status_code} for {method} /{path}")
                body = (_read_limited(r, limit, f"/{path}") if method == "GET" and r.status_code == 200
                        else _drain(r))
        except self._requests.RequestException as e:
            self.breaker.failure()
            raise RemoteUnavailable(_short(e)) from None
        except RemoteUnavailable:
            self.breaker.failure()
            raise
        self.breaker.success()
        return r, body

    def _get(self, path: str, limit: int) -> bytes | None:
        r, body = self._call("GET", path, limit=limit)
        if r.status_code == 404:
            return None
        if r.status_code != 200:
            raise RemoteUnavailable(f"HTTP {r.status_code} for GET /{path}")
        return body

    def _put(self, path: str, data: bytes) -> None:
        r, _ = self._call("PUT", path, data)
        if r.status_code not in (200, 201, 204):
            raise RemoteUnavailable(f"HTTP {r.status_code} for PUT /{path}")

    def get_blob(self, digest: str, size: int | None = None) -> bytes | None:
        return self._get(f"cas/{digest}", MAX_UNSIZED_BYTES if size is None else size)

    def find_missing(self, sizes: dict[str, int]) -> set[str]:
        return {d for d in sizes if self._call("HEAD", f"cas/{d}")[0].status_code != 200}

    def put_blob(self, digest: str, data: bytes) -> None:
        self._put(f"cas/{digest}", data)

    def get_entry(self, key: str) -> bytes | None:
        return self._get(f"ac/{key}", MAX_ENTRY_BYTES)

    def put_entry(self, key: str, data: bytes) -> None:
        self._put(f"ac/{key}", data)


def _read_limited(r, limit: int, what: str) -> bytes:
    """A 200 response's body, read a chunk at a time; BodyTooLarge as soon as it passes `limit`
    (or when its Content-Length says it will), RemoteUnavailable when it is shorter than announced."""
    declared = r.headers.get("Content-Length")
    announced = int(declared) if declared is not None and declared.isdigit() else None
    if announced is not None and announced > limit:
        raise BodyTooLarge(f"{what} is {announced} bytes, over the {limit} it can have")
    body = bytearray()
    for chunk in r.iter_content(CHUNK):
        body += chunk
        if len(body) > limit:
            raise BodyTooLarge(f"{what} is over the {limit} bytes it can have (stopped reading)")
    if announced is not None and announced != len(body):
        raise RemoteUnavailable(f"short body for {what}: {len(body)} of {announced} bytes")
    return bytes(body)


def _drain(r) -> None:
    """Read and drop a small body (none for HEAD), so the connection serves the next request;
    a larger one is left unread (the connection is closed instead)."""
    declared = r.headers.get("Content-Length")
    if r.request.method == "HEAD" or (declared is not None and declared.isdigit() and int(declared) <= _DRAIN_BYTES):
        for _ in r.iter_content(CHUNK):
            pass
    return None


def _short(e: Exception) -> str:
    """One line for a transport error (requests nests the cause several levels deep)."""
    text = str(e)
    for marker in ("Connection refused", "timed out", "Name or service not known", "Connection reset"):
        if marker in text:
            return marker
    return text.splitlines()[0][:160] if text else type(e).__name__


def open_remote(url: str, digest_function: str, timeout_s: float = 10.0) -> RemoteCache:
    """The remote cache a URL names: http(s)://… (Bazel's HTTP protocol) or grpc(s)://host:port[/instance]
    (REAPI v2; its Capabilities must offer the workspace's digest function)."""
    from build_graph.errors import LoadError

    if url.startswith(("http://", "https://")):
        return HttpRemote(url, timeout_s)
    if url.startswith(("grpc://", "grpcs://")):
        from build_graph.remote_exec.address import check_grpc_url, quiet_grpc
        from build_graph.store.reapi_remote import ReapiRemote

        quiet_grpc()
        check_grpc_url(url, "remote cache", "give --remote-cache (or [remote] url) grpc://HOST:PORT[/instance]")
        remote = ReapiRemote(url, digest_function, timeout_s)
        try:
            remote.check_capabilities()
        except RemoteUnavailable:
            pass  # a dead server: the build warns and goes on locally
        return remote
    raise LoadError(f"remote cache {url!r}: not an http://, https://, grpc:// or grpcs:// URL")
