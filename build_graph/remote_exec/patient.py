"""The worker's CAS calls, made again while the server answers RESOURCE_EXHAUSTED.

BuildGrid serves `thread-pool-size` RPCs at once and every open Execute stream holds one, so a
busy server refuses a worker's uploads and fetches now and then. That is not the action's
failure: reported as UNAVAILABLE, BuildGrid retries the lease at most 5 times and then gives up
on the action. The worker backs off and makes the same call again instead."""

from __future__ import annotations

import threading

from build_graph.store.remote import RemoteUnavailable

CAS_CALLS = frozenset({"find_missing", "get_blob", "get_blobs", "put_blob", "put_blobs"})
MAX_WAIT_S = 120.0  # past this much backing off, the server is not busy but stuck: fail the lease


def is_busy(error: Exception) -> bool:
    """Whether a remote error is the server's RPC limit (gRPC status 8)."""
    text = str(error)
    return "RESOURCE_EXHAUSTED" in text or "status 8 " in text


class PatientRemote:
    """A ReapiRemote whose CAS calls back off (0.1 s doubling to 5 s) while the server is busy."""

    def __init__(self, remote, stopping: threading.Event):
        self._remote, self._stopping = remote, stopping

    def __getattr__(self, name: str):
        attr = getattr(self._remote, name)
        if name not in CAS_CALLS:
            return attr
        return self._patient(attr)

    def patiently(self, fn, *args, **kwargs):
        """`fn(*args, **kwargs)`, called again as a CAS call is while the server is busy (a
        streamed upload made outside ReapiRemote's own calls)."""
        return self._patient(fn)(*args, **kwargs)

    def _patient(self, attr):
        def patient(*args, **kwargs):
            backoff, waited = 0.1, 0.0
            while True:
                try:
                    return attr(*args, **kwargs)
                except RemoteUnavailable as e:
                    if not is_busy(e) or waited >= MAX_WAIT_S or self._stopping.wait(backoff):
                        raise
                    waited += backoff
                    backoff = min(backoff * 2, 5.0)
        return patient
