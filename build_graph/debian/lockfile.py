"""The lock file of a deb_packages target: which .deb files, per platform, pinned by sha256.

    {
     "lock_version": 1,
     "platforms": {
      "aarch64": {
       "roots": ["gcc-12", ...],
       "exclude": ["debconf"],
       "packages": [
        {"package": "binutils", "version": "2.40-2", "architecture": "arm64", "suite": "bookworm", "filename": "pool/main/b/binutils/binutils_2.40-2_arm64.deb", "sha256": "…", "size": 2997560},
        …
       ]
      },
      "x86_64": { … }
     }
    }

Written deterministically (platforms and packages sorted, one line per package), so a package
whose pin did not change keeps its line byte for byte and a bump is a one-line diff. `filename`
is the pool path, relative to whichever mirror serves it: the lock names no host.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING

from build_graph.debian import LockError

if TYPE_CHECKING:  # the rule reads locks at load time: keep requests and the index parser out
    from build_graph.debian.index import Candidate

LOCK_VERSION = 1
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class LockEntry:
    package: str
    version: str
    architecture: str
    suite: str
    filename: str
    sha256: str
    size: int

    @classmethod
    def of(cls, c: "Candidate") -> "LockEntry":
        return cls(c.package, c.version, c.architecture, c.suite, c.filename, c.sha256, c.size)

    @property
    def basename(self) -> str:
        return self.filename.rsplit("/", 1)[-1]


@dataclass(frozen=True)
class PlatformLock:
    roots: tuple[str, ...]
    exclude: tuple[str, ...]
    packages: tuple[LockEntry, ...]


def render(platforms: dict[str, PlatformLock]) -> str:
    """The lock file's text: sorted, one line per package."""
    out = ['{', f' "lock_version": {LOCK_VERSION},', ' "platforms": {']
    names = sorted(platforms)
    for i, name in enumerate(names):
        p = platforms[name]
        out.append(f'  {json.dumps(name)}: {{')
        out.append(f'   "roots": {json.dumps(sorted(p.roots))},')
        out.append(f'   "exclude": {json.dumps(sorted(p.exclude))},')
        out.append('   "packages": [')
        entries = sorted(p.packages, key=lambda e: e.package)
        for j, e in enumerate(entries):
            out.append("    " + json.dumps(asdict(e), ensure_ascii=False) + ("," if j < len(entries) - 1 else ""))
        out.append('   ]')
        out.append('  }' + ("," if i < len(names) - 1 else ""))
    out += [' }', '}', '']
    return "\n".join(out)


def parse(text: str, where: str) -> dict[str, PlatformLock]:
    """Read a lock file; anything malformed is a LockError naming the file (and the package)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise LockError(f"not a lock file: {e}", where=where) from None
    if not isinstance(data, dict) or data.get("lock_version") != LOCK_VERSION:
        raise LockError(f"unknown lock_version {data.get('lock_version') if isinstance(data, dict) else None!r} "
                        f"(this bgraph reads {LOCK_VERSION})", where=where, hint="re-lock with `bgraph deb lock`")
    out: dict[str, PlatformLock] = {}
    want = {f.name: f.type for f in fields(LockEntry)}
    platforms = data.get("platforms") or {}
    if not isinstance(platforms, dict):
        raise LockError("'platforms' must be a table of platform -> lock", where=where,
                        hint="re-lock with `bgraph deb lock`")
    for platform, p in platforms.items():
        if not isinstance(p, dict) or not isinstance(p.get("packages", []), list) or not all(
                isinstance(x, list) and all(isinstance(v, str) for v in x)
                for x in (p.get("roots", []), p.get("exclude", []))):
            raise LockError(f"{platform}: malformed platform entry (packages, roots and exclude must be lists)",
                            where=where, hint="re-lock with `bgraph deb lock`")
        entries = []
        for raw in p.get("packages", []):
            if not isinstance(raw, dict) or set(raw) != set(want) or not all(
                    isinstance(raw[k], int if t in (int, "int") else str) and not isinstance(raw[k], bool)
                    for k, t in want.items()):
                raise LockError(f"{platform}: malformed package entry {raw!r}", where=where,
                                hint="re-lock with `bgraph deb lock`")
            e = LockEntry(**raw)
            if not _SHA256.match(str(e.sha256)) or not e.filename.endswith(".deb") or e.filename.startswith("/") \
                    or ".." in e.filename.split("/"):
                raise LockError(f"{platform}: package {e.package}: bad sha256 or filename", where=where)
            entries.append(e)
        out[platform] = PlatformLock(tuple(p.get("roots", ())), tuple(p.get("exclude", ())), tuple(entries))
    return out


def diff(old: dict[str, PlatformLock], new: dict[str, PlatformLock]) -> list[str]:
    """Lines for what changed: '+ pkg version', '- pkg version', '~ pkg old -> new', per platform."""
    lines = []
    for platform in sorted(set(old) | set(new)):
        before = {e.package: e for e in (old[platform].packages if platform in old else ())}
        after = {e.package: e for e in (new[platform].packages if platform in new else ())}
        for name in sorted(set(before) | set(after)):
            a, b = before.get(name), after.get(name)
            if a is None:
                lines.append(f"{platform}: + {name} {b.version}")
            elif b is None:
                lines.append(f"{platform}: - {name} {a.version}")
            elif a != b:
                change = f"{a.version} -> {b.version}" if a.version != b.version else f"{a.version} (file changed)"
                lines.append(f"{platform}: ~ {name} {change}")
    return lines
