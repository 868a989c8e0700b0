"""The lock file of `python_lock` targets: one wheel per package and platform, pinned by sha256.

    {
     "lock_version": 1,
     "input": {"glibc": "2.36", "platforms": ["aarch64", "x86_64"], "python": "3.11",
               "requirements": ["torch==2.14.0", "vllm==0.33.0"]},
     "resolver": "uv 0.13.9 pip compile (PEP 751 pylock.toml)",
     "platforms": {
      "aarch64": [
       {"name": "aiohttp", "version": "3.14.5", "filename": "aiohttp-3.14.5-cp311-….whl", "sha256": "…", "size": 1929915},
       …
      ],
      "x86_64": [ … ]
     }
    }

Why not the resolver's PEP 751 `pylock.toml` itself: its files carry the URL of the one index
the resolver used, while bgraph fetches a file by project and file name from whichever indexes
pip is configured with (a mirror, a local index), like every pin in WORKSPACE.toml; and a
pylock lists every wheel of a package, where a build needs the one for its platform. The lock
is made from the resolver's pylock (locking.py), keeping one file per platform, so it names no
host. Written deterministically (sorted, one line per package): a bump is a one-line diff.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, fields

from build_graph.errors import BgraphError

LOCK_VERSION = 1
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class PyLockError(BgraphError):
    """A lock file that cannot be read, or that does not fit its target."""

    layer = "lock"


def normalize(name: str) -> str:
    """A project name as PEP 503 compares it."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class LockedWheel:
    name: str
    version: str
    filename: str
    sha256: str
    size: int


@dataclass(frozen=True)
class LockInput:
    """What a lock was resolved from: a target whose input differs needs a new lock."""

    requirements: tuple[str, ...]
    python: str
    glibc: str
    platforms: tuple[str, ...]

    def to_json(self) -> dict:
        return {"glibc": self.glibc, "platforms": list(self.platforms), "python": self.python,
                "requirements": list(self.requirements)}


@dataclass(frozen=True)
class Lock:
    input: LockInput
    resolver: str
    platforms: dict[str, tuple[LockedWheel, ...]]


def render(lock: Lock) -> str:
    """The lock's text: keys sorted, one line per wheel, platforms and wheels sorted."""
    lines = ["{", f' "lock_version": {LOCK_VERSION},',
             f' "input": {json.dumps(lock.input.to_json(), sort_keys=True)},',
             f' "resolver": {json.dumps(lock.resolver)},', ' "platforms": {']
    plats = sorted(lock.platforms)
    for i, platform in enumerate(plats):
        lines.append(f'  {json.dumps(platform)}: [')
        wheels = sorted(lock.platforms[platform], key=lambda w: w.name)
        for j, w in enumerate(wheels):
            lines.append("   " + json.dumps(asdict(w)) + ("," if j < len(wheels) - 1 else ""))
        lines.append("  ]" + ("," if i < len(plats) - 1 else ""))
    lines += [" }", "}"]
    return "\n".join(lines) + "\n"


def parse(text: str, where: str) -> Lock:
    """Read a lock, checking every field; an error names the file and what is wrong."""
    hint = "write it again with `bgraph py lock`"
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise PyLockError(f"not JSON ({e.msg} at line {e.lineno})", where=where, hint=hint) from None
    if not isinstance(data, dict) or data.get("lock_version") != LOCK_VERSION:
        raise PyLockError(f"not a python lock of version {LOCK_VERSION}", where=where, hint=hint)
    try:
        inp = data["input"]
        lock_input = LockInput(tuple(inp["requirements"]), str(inp["python"]), str(inp["glibc"]),
                               tuple(inp["platforms"]))
        platforms = {}
        for platform, wheels in data["platforms"].items():
            entries = []
            for w in wheels:
                if set(w) != {f.name for f in fields(LockedWheel)}:
                    raise PyLockError(f"{platform}: entry {w.get('name')!r} has fields {sorted(w)}", where=where,
                                      hint=hint)
                entry = LockedWheel(str(w["name"]), str(w["version"]), str(w["filename"]), str(w["sha256"]),
                                    int(w["size"]))
                if not _SHA256.match(entry.sha256) or not entry.filename.endswith(".whl") or "/" in entry.filename:
                    raise PyLockError(f"{platform}: {entry.name} has no wheel file name or sha256", where=where,
                                      hint=hint)
                entries.append(entry)
            platforms[platform] = tuple(entries)
        return Lock(lock_input, str(data.get("resolver", "")), platforms)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise PyLockError(f"malformed lock ({type(e).__name__}: {e})", where=where, hint=hint) from None


def diff(old: Lock | None, new: Lock) -> list[str]:
    """Changes from `old` to `new`, one line each: `x86_64: + name 1.0`, `- …`, `name 1.0 -> 1.1`."""
    out = []
    for platform in sorted(set(new.platforms) | set(old.platforms if old else {})):
        before = {w.name: w for w in (old.platforms.get(platform, ()) if old else ())}
        after = {w.name: w for w in new.platforms.get(platform, ())}
        for name in sorted(set(before) | set(after)):
            a, b = before.get(name), after.get(name)
            if a is None:
                out.append(f"{platform}: + {name} {b.version}")
            elif b is None:
                out.append(f"{platform}: - {name} {a.version}")
            elif a.version != b.version:
                out.append(f"{platform}: {name} {a.version} -> {b.version}")
            elif a != b:
                out.append(f"{platform}: {name} {a.version}: {a.filename} -> {b.filename} (sha256 {b.sha256[:12]}…)")
    return out
