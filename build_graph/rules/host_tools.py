"""host_tools: host binaries an action may use, identified by path, version and digest."""

from __future__ import annotations

import os

from pydantic import Field, field_validator

from build_graph.model import EMPTY_TREE, TargetOutput
from build_graph.rules.base import Attrs, PlanGen, RuleContext


_LIVE_DIRS = ("/run", "/var/run", "/dev", "/proc", "/sys")  # and below them
_SHARED_DIRS = ("/", "/tmp", "/var/tmp", "/var")  # themselves (every user's sockets lie there)


class HostToolsAttrs(Attrs):
    paths: list[str] = Field(["/usr"], description="host directories mounted read-only into the sandbox")
    tools: list[str] = Field(description="absolute paths of the binaries used; their identity joins the key")

    @field_validator("paths", "tools")
    @classmethod
    def _absolute(cls, v: list[str]) -> list[str]:
        for p in v:
            if not p.startswith("/"):
                raise ValueError(f"{p!r} must be an absolute path")
        return v

    @field_validator("paths")
    @classmethod
    def _no_live_state(cls, v: list[str]) -> list[str]:
        # A read-only bind still lets an action connect to a Unix socket under it (docker.sock, a
        # database's), and /proc, /sys and /dev are the host's live state, not tools.
        for p in v:
            norm = os.path.normpath(p)
            if norm in _SHARED_DIRS or any(norm == d or norm.startswith(d + "/") for d in _LIVE_DIRS):
                raise ValueError(f"{p!r} holds the host's sockets or live state: mount the directories of the "
                                 "tools themselves (such as /usr)")
        return v


def plan_host_tools(ctx: RuleContext) -> PlanGen:
    """Probe the declared tools (path, version line, content digest); run no action."""
    tools = ctx.probe_host(tuple(ctx.attrs.tools))
    return TargetOutput(EMPTY_TREE, {"host_paths": list(ctx.attrs.paths),
                                     "host_tools": [[t.path, t.version, t.digest] for t in tools]})
    yield  # pragma: no cover - makes this a generator
