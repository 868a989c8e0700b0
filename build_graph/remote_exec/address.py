"""A grpc:// or grpcs:// address (remote executor, REAPI remote cache) checked before any channel
is made: gRPC's own parser takes a port modulo 65536 (grpc://h:73000 talks to port 7464) and
fails an unterminated IPv6 literal only at the first call, with a C-core log line.

Also where gRPC's C-core logging is kept quiet: bgraph says what failed in one line of its own.
"""

from __future__ import annotations

import os
import re

from build_graph.errors import UsageError

_HOST = re.compile(r"^(\[[0-9A-Fa-f:.]+(%[A-Za-z0-9_.-]+)?\]|[A-Za-z0-9_.-]+)$")


def quiet_grpc() -> None:
    """Silence gRPC's C-core log lines (a TLS handshake with a plaintext server printed one before
    bgraph's own error) unless the user set GRPC_VERBOSITY; takes effect where grpc is not yet
    imported."""
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")


def check_grpc_url(url: str, what: str, hint: str) -> tuple[str, int, str]:
    """(host, port, instance) of `url` = grpc[s]://HOST:PORT[/instance]; anything else is one
    UsageError naming `what` (the flag or setting) with `hint`."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in ("grpc", "grpcs"):
        raise UsageError(f"{what} {url!r} is not a grpc:// or grpcs:// address", hint=hint)
    target, _, instance = rest.partition("/")
    host, colon, port = target.rpartition(":")
    if not colon or not host:
        raise UsageError(f"{what} {url!r} has no HOST:PORT", hint=hint)
    if not _HOST.match(host) or (host.startswith("[") != host.endswith("]")):
        raise UsageError(f"{what} {url!r}: {host!r} is not a host name or address", hint=hint)
    if not port.isascii() or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise UsageError(f"{what} {url!r}: port {port!r} is not a number from 1 to 65535", hint=hint)
    return host, int(port), instance
