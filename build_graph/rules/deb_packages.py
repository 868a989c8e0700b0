"""deb_packages: a pinned set of Debian packages unpacked into one root-layout tree.

The lock file (written by `bgraph deb lock`, read here as a workspace source) pins each `.deb`
per platform by pool path and sha256. Each package is one fixed-output fetch (key: sha256 and
file name) and one in-process unpack of its data.tar (archive.py: entries that escape the root
are refused), so bumping one package re-runs only its two actions; the merge happens here, in
the plan, with no action.

Maintainer scripts (preinst, postinst, triggers) are never run, so what they would make is
missing: update-alternatives links (give them as `links`), ldconfig's /etc/ld.so.cache,
dpkg-divert diversions, users and groups (/etc/passwd from base-passwd), the dpkg database
(/var/lib/dpkg/status), debconf answers, generated caches and byte-compiled Python (.pyc),
setuid bits and file ownership. The tree is made usable in their place by:
- usrmerge: /bin, /sbin, /lib, /lib64 paths fold under usr/, with top-level links bin -> usr/bin
  etc., so the tree works mounted as / or with its usr/ mounted as /usr;
- `links`: alternatives-style symlinks, e.g. usr/bin/cc -> gcc-12;
- no ld.so cache: Debian's dynamic loader searches its multiarch directories
  (/lib/<triplet>, /usr/lib/<triplet>) by default, so programs find the libraries of these
  packages without /etc/ld.so.cache; only libraries in directories named solely by
  /etc/ld.so.conf.d files need the cache (or LD_LIBRARY_PATH).
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
from typing import Literal

from pydantic import Field, field_validator, model_validator

from build_graph.debian import DEB_ARCH, lockfile, rootfs
from build_graph.debian.lockfile import LockEntry
from build_graph.model import TargetOutput
from build_graph.rules.base import SYSTEM_ROOT, Attrs, Parallel, PlanGen, RuleContext, fetch
from build_graph.workspace import DebianSection

_NAME = re.compile(r"^[a-z0-9][a-z0-9+.-]+$")  # Debian policy 5.6.1


def _names(v: list[str]) -> list[str]:
    for name in v:
        if not _NAME.match(name):
            raise ValueError(f"{name!r} is not a Debian package name")
    return v


class DebPlatformAttrs(Attrs):
    packages: list[str] = Field(default_factory=list, description="more root packages on this platform")
    exclude: list[str] = Field(default_factory=list, description="more dependencies not to pull in on this platform")

    _check = field_validator("packages", "exclude")(_names)


class DebPackagesAttrs(Attrs):
    lock: str = Field(description="workspace path of the lock file `bgraph deb lock` writes (home: toolchains/)")
    packages: list[str] = Field(default_factory=list,
                                description="root packages; their Depends and Pre-Depends are locked with them")
    exclude: list[str] = Field(default_factory=list, description="dependencies not to pull in (e.g. debconf)")
    platforms: dict[Literal["x86_64", "aarch64"], DebPlatformAttrs] = Field(
        default_factory=dict, description="per-platform additions to packages and exclude")
    links: dict[str, str] = Field(default_factory=dict,
                                  description="alternatives-style symlinks: path -> target (e.g. usr/bin/cc = gcc-12)")
    prefer: dict[str, str] = Field(default_factory=dict,
                                   description="path -> package whose copy wins where two packages ship it differently")

    _check = field_validator("packages", "exclude")(_names)

    @field_validator("lock")
    @classmethod
    def _lock_path(cls, v: str) -> str:
        if v.startswith("/") or ".." in v.split("/") or not v.endswith(".json"):
            raise ValueError("must be a workspace-relative path ending in .json (e.g. toolchains/gcc-12.lock.json)")
        return v

    @model_validator(mode="after")
    def _some_roots(self) -> "DebPackagesAttrs":
        for platform in DEB_ARCH:
            if not self.roots(platform):
                raise ValueError(f"no root packages for {platform}: give packages (or platforms.{platform}.packages)")
        return self

    def roots(self, platform: str) -> list[str]:
        """The root packages locked for `platform`, sorted."""
        extra = self.platforms[platform].packages if platform in self.platforms else []
        return sorted(set(self.packages) | set(extra))

    def excluded(self, platform: str) -> list[str]:
        extra = self.platforms[platform].exclude if platform in self.platforms else []
        return sorted(set(self.exclude) | set(extra))


def deb_packages_sources(attrs: DebPackagesAttrs):
    # WORKSPACE.toml too: its [debian] mirrors tell the fetches where to look (they never reach a key).
    return [("lock", attrs.lock), ("lock", "WORKSPACE.toml")]


def workspace_mirrors(ctx: RuleContext) -> list[str]:
    """WORKSPACE.toml's [debian] mirrors (empty: the fetcher asks apt's sources)."""
    text = ctx.read(ctx.sources.entries["WORKSPACE.toml"]).decode()
    return DebianSection.model_validate(tomllib.loads(text).get("debian", {})).mirrors


def plan_deb_packages(ctx: RuleContext) -> PlanGen:
    """One fetch and one unpack per locked package, merged into one usrmerged tree."""
    attrs: DebPackagesAttrs = ctx.attrs
    if ctx.platform not in DEB_ARCH:
        raise ctx.fail(f"no Debian architecture for platform {ctx.platform}")
    arch = DEB_ARCH[ctx.platform]
    rerun = f"run `bgraph deb lock {ctx.label}`"
    locked = lockfile.parse(ctx.read(ctx.sources.entries[attrs.lock]).decode(), where=attrs.lock).get(ctx.platform)
    if locked is None:
        raise ctx.fail(f"{attrs.lock} has no packages for {ctx.platform}", "lock", hint=rerun)
    roots, exclude = attrs.roots(ctx.platform), attrs.excluded(ctx.platform)
    if list(locked.roots) != roots or list(locked.exclude) != exclude:
        raise ctx.fail(f"{attrs.lock} is out of date for {ctx.platform}: locked for packages {list(locked.roots)} "
                       f"exclude {list(locked.exclude)}, the target names {roots} exclude {exclude}", "lock",
                       hint=rerun)
    for e in locked.packages:
        if e.architecture not in (arch, "all"):
            raise ctx.fail(f"{attrs.lock}: package {e.package} is for {e.architecture}, not {arch}", "lock",
                           hint=rerun)
    mirrors = workspace_mirrors(ctx)
    trees = yield Parallel(_unpacked(ctx, e, mirrors) for e in locked.packages)
    try:
        tree = rootfs.assemble({e.package: t for e, t in zip(locked.packages, trees)}, attrs.prefer, attrs.links)
    except rootfs.RootfsError as e:
        raise ctx.fail(str(e), e.key, e.hint) from None
    # As a `tools`/`host` target, the tree is the system an action runs on (rules/base.py SYSTEM_ROOT).
    return TargetOutput(tree, {"architecture": arch, "packages": {e.package: e.version for e in locked.packages},
                               SYSTEM_ROOT: tree})


def _unpacked(ctx: RuleContext, entry: LockEntry, mirrors: list[str]) -> PlanGen:
    """Fetch one .deb (by its pin), then unpack its data.tar."""
    where_from = {"pool": entry.filename, "suite": entry.suite, "package": entry.package,
                  "architecture": entry.architecture}
    if mirrors:
        where_from["mirrors"] = " ".join(mirrors)
    [fetched] = yield [fetch(f"fetch {entry.basename}", entry.basename, entry.sha256, "debian", **where_from)]
    # The unpack holds the package's files in memory until they pass the checks (archive.py).
    unpack = dataclasses.replace(ctx.extract_action(fetched.tree, entry.basename),
                                 memory_mb=64 + 6 * entry.size // (1 << 20))
    [out] = yield [unpack]
    return out.tree
