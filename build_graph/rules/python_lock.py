"""python_lock: wheels pinned in a lock file (`bgraph py lock`), unpacked into one site-packages tree.

The lock (build_graph/python_lock/lockfile.py) holds one wheel per package and platform with its
sha256; this rule takes the packages whose names match `packages` and not `exclude` (globs over
PEP 503 names), fetches each as a fixed output (through pip's configured indexes, by project and
file name) and unpacks it as pip would place it (python_env.site_packages: purelib and platlib at
the root, scripts and data left out). No resolver, no index listing and no network beyond the
fixed-output fetches run at build time. Several targets may read one lock, each taking a group of
its packages: an image's layers (targets/python.toml).

Why unpack rather than `pip install --no-index --no-deps --target`: pip would add byte-compiled
files stamped with the unpack time and an INSTALLER record, and run nothing a wheel needs; an
unpack is a pure function of the wheel's bytes, done once per wheel and shared by every target.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from typing import Literal

from pydantic import Field, field_validator

from build_graph.errors import BgraphError
from build_graph.model import TargetOutput, Tree
from build_graph.python_lock.lockfile import LockInput, normalize, parse
from build_graph.python_lock.requirements import parse_requirement
from build_graph.rules.base import Attrs, Parallel, PlanGen, RuleContext, fetch
from build_graph.rules.python_env import below_a_file, site_packages


class PythonLockAttrs(Attrs):
    lock: str = Field(description="workspace path of the lock file `bgraph py lock` writes (home: locks/)")
    requirements: list[str] = Field(description="what the lock is resolved from (PEP 508 requirement lines)")
    python: str = Field("3.11", pattern=r"^3\.\d+$", description="the CPython the wheels are for")
    glibc: str = Field("2.36", pattern=r"^2\.\d+$", description="newest manylinux glibc allowed (Debian 12: 2.36)")
    platforms: list[Literal["x86_64", "aarch64"]] = Field(default_factory=lambda: ["aarch64", "x86_64"],
                                                          description="the platforms the lock is resolved for")
    packages: list[str] = Field(default_factory=lambda: ["*"], description="globs of package names this target installs")
    exclude: list[str] = Field(default_factory=list, description="globs of package names it leaves out")

    @field_validator("lock")
    @classmethod
    def _lock_path(cls, v: str) -> str:
        if v.startswith("/") or ".." in v.split("/") or not v.endswith(".json"):
            raise ValueError("must be a workspace-relative path ending in .json (e.g. locks/vllm-runtime.lock.json)")
        return v

    @field_validator("requirements")
    @classmethod
    def _some(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("give one or more requirement lines (e.g. \"vllm==0.33.0\")")
        # uv reads them from a requirements file, where an option line or a path would be obeyed
        for line in v:
            parse_requirement(line)
        return v

    def wants(self, name: str) -> bool:
        """Whether this target installs the locked package `name` (a normalized name)."""
        matched = any(fnmatch.fnmatchcase(name, normalize(g)) for g in self.packages)
        return matched and not any(fnmatch.fnmatchcase(name, normalize(g)) for g in self.exclude)


def python_lock_sources(attrs: PythonLockAttrs):
    return [("lock", attrs.lock)]


def plan_python_lock(ctx: RuleContext) -> PlanGen:
    """One fetch and one unpack per chosen wheel, merged into one site-packages tree."""
    attrs: PythonLockAttrs = ctx.attrs
    rerun = f"run `bgraph py lock {ctx.label}`"
    try:
        locked = parse(ctx.read(ctx.sources.entries[attrs.lock]).decode(), where=attrs.lock)
    except BgraphError as e:
        raise ctx.fail(e.message, "lock", hint=e.hint) from None
    want = LockInput(tuple(sorted(attrs.requirements)), attrs.python, attrs.glibc, tuple(sorted(attrs.platforms)))
    if locked.input != want:
        raise ctx.fail(f"{attrs.lock} is out of date: locked for {locked.input.to_json()}, the target asks for "
                       f"{want.to_json()}", "requirements", hint=rerun)
    if ctx.platform not in locked.platforms:
        raise ctx.fail(f"{attrs.lock} has no wheels for {ctx.platform}", "platforms",
                       hint=f"add {ctx.platform!r} to platforms and {rerun}")
    chosen = [w for w in locked.platforms[ctx.platform] if attrs.wants(w.name)]
    if not chosen:
        raise ctx.fail(f"no package of {attrs.lock} matches packages {attrs.packages} exclude {attrs.exclude}",
                       "packages", hint="globs match PEP 503 names (lower case, '-' for '_' and '.')")
    trees = yield Parallel(_unpacked(ctx, attrs.lock, w) for w in chosen)
    out = {}
    for wheel, tree in zip(chosen, trees):
        for path, entry in tree.entries.items():
            if path in out and out[path][1] != entry:
                raise ctx.fail(f"{wheel.name} and {out[path][0]} both install {path} with other contents",
                               "packages", hint="put them in two targets (layers), or exclude one")
            out[path] = (wheel.name, entry)
    nested = below_a_file({p: e for p, (_, e) in out.items()})
    if nested:
        raise ctx.fail(f"{out[nested[0]][0]} installs {nested[0]} below {nested[1]}, a file of {out[nested[1]][0]}",
                       "packages", hint="put them in two targets (layers), or exclude one")
    return TargetOutput(Tree({p: e for p, (_, e) in out.items()}),
                        {"lock": attrs.lock, "packages": {w.name: w.version for w in chosen},
                         "wheels": {w.name: {"filename": w.filename, "sha256": w.sha256} for w in chosen}})


def _unpacked(ctx: RuleContext, lock: str, wheel) -> PlanGen:
    """Fetch one locked wheel (fixed output), then unpack it in-process."""
    # The recorded size bounds the download (0: the index gave none); it is not in the key.
    [fetched] = yield [fetch(f"fetch {wheel.filename}", wheel.filename, wheel.sha256, "pypi",
                             project=wheel.name, pin=f"{lock}: {wheel.name}",
                             **({"size": str(wheel.size)} if wheel.size > 0 else {}))]
    # The unpack holds the wheel's files in memory until they pass the checks (archive.py).
    unpack = dataclasses.replace(ctx.extract_action(fetched.tree, wheel.filename),
                                 memory_mb=256 + 3 * wheel.size // (1 << 20))
    [out] = yield [unpack]
    try:
        return site_packages(out.tree, f"wheel {wheel.filename}")
    except ValueError as e:
        raise ctx.fail(f"{lock}: {e}", "lock", hint="the wheel is malformed: lock another version") from None
