"""host_tools: host binaries an action may use, identified by path, version and digest.

Only the listed tools are keyed (path, `--version` line, content digest), as Bazel keys its host
toolchains. The directories in `paths` are mounted read-only, and their content is part of no key
beyond the probed tools' path, version and digest: changing a file there that no listed tool is
(a shared library, a script's helper, a Python module) does not rebuild anything. List every file
an action needs that can change as a tool, or make it a pinned input. So `paths` may only name
the system's installation directories (SYSTEM_DIRS, SYSTEM_TOP), where tools and their libraries
live; data an action reads is a source or a pinned input, whose content is keyed, and a tool
elsewhere (a script in a home or scratch directory) is listed in `tools` alone: it is mounted by
itself, at its path.

A tool's `--version` line is probed again only when the tool's own file changes (its stat stamp):
a wrapper script whose version and behaviour come from another file (a `.ver` file it reads, the
compiler a ccache link runs) keeps the line it had until the wrapper itself changes. List what it
runs as a tool too, or make it a pinned input.
"""

from __future__ import annotations

import os

from pydantic import Field, field_validator

from build_graph.model import EMPTY_TREE, TargetOutput
from build_graph.rules.base import Attrs, PlanGen, RuleContext


_LIVE_DIRS = ("/run", "/var/run", "/dev", "/proc", "/sys")  # and below them
_SHARED_DIRS = ("/", "/tmp", "/var/tmp", "/var")  # themselves (every user's sockets lie there)
# Where a system installs its programs and their libraries: all that `paths` may mount (hashing
# them is out of the question: /usr alone is ~140,000 files, ~2 CPU-s of lstat per build).
SYSTEM_DIRS = ("/usr", "/etc", "/opt")  # and below them
SYSTEM_TOP = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")  # themselves (merged-/usr links)


def system_dir(path: str) -> bool:
    """Whether `path` (normalised) is a system installation directory that `paths` may mount."""
    return path in SYSTEM_TOP or any(path == d or path.startswith(d + "/") for d in SYSTEM_DIRS)


# A tool is a host binary: none lies under the host's live state (/proc/self/cwd/... is whatever
# directory bgraph runs in, /proc/PID/root/... another process's files).
_NO_TOOL_DIRS = ("/proc", "/dev", "/sys")
CACHE_MARK = ("v1", "tmp")  # what a bgraph cache directory holds (store/cas.py: LAYOUT_VERSION/tmp)


def _under(path: str, dirs: tuple[str, ...]) -> bool:
    return any(path == d or path.startswith(d + "/") for d in dirs)


def _bgraph_dir(real: str) -> str | None:
    """The workspace (a directory holding WORKSPACE.toml) or bgraph cache that `real` (a resolved
    path) lies in, else None."""
    d = os.path.dirname(real)
    while True:
        if os.path.isfile(os.path.join(d, "WORKSPACE.toml")):
            return f"the workspace {d}"
        if os.path.isdir(os.path.join(d, *CACHE_MARK)):
            return f"the bgraph cache {d}"
        parent = os.path.dirname(d)
        if parent == d:
            return None
        d = parent


def refused_tool(path: str) -> str | None:
    """Why `path` may not be a tool (one line that names it), else None: it lies under /proc,
    /dev or /sys, or its real path does, or lies in a workspace or a bgraph cache. bgraph probes
    and mounts a tool as a host binary; a workspace's files are sources (keyed as such), and a
    script shipped with one must never pass for the host's."""
    norm = os.path.normpath(path)
    if _under(norm, _NO_TOOL_DIRS):
        return f"{path!r} lies under /proc, /dev or /sys, the host's live state, not a binary"
    try:
        real = os.path.realpath(path)
    except OSError as e:  # a directory on the way that may not be searched
        return f"{path!r} cannot be resolved ({e.strerror})"
    if _under(real, _NO_TOOL_DIRS):
        return f"{path!r} lies under /proc, /dev or /sys, the host's live state, not a binary"
    inside = _bgraph_dir(real)
    if inside is not None:
        return f"{path!r} lies in {inside}" + (f" (it is {real})" if real != path else "") + \
            ": a workspace's or cache's file is no host binary"
    return None


class HostToolsAttrs(Attrs):
    """Host tools: `tools` keyed by path, version and digest; `paths` (system directories only)
    mounted, their other content keyed nowhere (see the module's docstring)."""

    paths: list[str] = Field(["/usr"], description="system directories (/usr, /etc, /opt and below; /bin, /sbin, "
                                                   "/lib*) mounted read-only into the sandbox; their content joins "
                                                   "no key beyond the listed tools")
    tools: list[str] = Field(description="absolute paths of the binaries used; their identity joins the key (one "
                                         "outside the system directories is mounted by itself)")

    @field_validator("paths", "tools")
    @classmethod
    def _absolute(cls, v: list[str]) -> list[str]:
        for p in v:
            if not p.startswith("/"):
                raise ValueError(f"{p!r} must be an absolute path")
        return v

    @field_validator("tools")
    @classmethod
    def _host_binaries(cls, v: list[str]) -> list[str]:
        # Checked at load; probe_host_tools checks again before it reads or runs anything.
        from build_graph.workspace import HINT  # (workspace imports the rules)

        for p in v:
            why = refused_tool(p)
            if why is not None:
                raise ValueError(why + HINT + "list host binaries (such as /usr/bin/gcc) in `tools`; a script "
                                 "the workspace ships is a source: list it in srcs and run it from $SRC")
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

    @field_validator("paths")
    @classmethod
    def _system_only(cls, v: list[str]) -> list[str]:
        # What is under a mounted path is read unkeyed (only `tools` are probed): a data file there
        # edited would be served from the cache as up to date. A link (/opt/x -> /home/...) is
        # judged by where it leads, which is what the mount shows.
        from build_graph.workspace import HINT  # (workspace imports the rules)

        for p in v:
            norm = os.path.normpath(p)
            if not (system_dir(norm) and system_dir(os.path.realpath(norm))):
                raise ValueError(
                    f"{p!r} is not a system installation directory (/usr, /etc, /opt or below them; /bin, /sbin, "
                    "/lib*): what an action reads under it joins no key, so an edit there would not rebuild"
                    + HINT + "list a program from there in `tools` (it is keyed, and mounted by itself); make "
                    "data a source or a pinned input")
        return v


def plan_host_tools(ctx: RuleContext) -> PlanGen:
    """Probe the declared tools (path, version line, content digest); run no action. A tool
    outside the system directories (which `paths` may mount) is mounted as itself, a file: it is
    keyed, and the rest of its directory stays out of the sandbox."""
    tools = ctx.probe_host(tuple(ctx.attrs.tools))
    alone = [t for t in ctx.attrs.tools if not system_dir(os.path.dirname(os.path.normpath(t)))]
    return TargetOutput(EMPTY_TREE, {"host_paths": list(ctx.attrs.paths) + alone,
                                     "host_tools": [[t.path, t.version, t.digest] for t in tools]})
    yield  # pragma: no cover - makes this a generator
