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

Platforms (configs.py). A set is one of two things:
- a system actions run on (the default; `tools`/`host` of other targets, mounted as /usr): its
  packages are the exec platform's, whatever the build's target, because its programs run on
  the machine that executes the actions. Where the target is another platform, `cross` may name
  a stand-in: a set of exec-platform packages holding a cross compiler under the native names
  (usr/bin/gcc -> aarch64-linux-gnu-gcc-12), so every rule, nvcc and an imported configure
  compile for the target unchanged. Without one, the set is simply the exec machine's.
- a `sysroot`: packages of the target platform, never run as the sandbox's /usr: libraries and
  headers to build against, or a root to run the target's programs in under emulation.
`locked_for` restricts the platforms a set is locked for (a cross compiler exists for one exec
platform; qemu only where it emulates another CPU).
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
from typing import Literal

from pydantic import Field, field_validator, model_validator

from build_graph.debian import DEB_ARCH, lockfile, rootfs
from build_graph.configs import Config
from build_graph.debian.lockfile import LockEntry
from build_graph.model import TargetOutput
from build_graph.rules.base import SYSTEM_ROOT, Attrs, Parallel, PlanGen, RuleContext, fetch, labels_in
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
    links: dict[str, str] = Field(default_factory=dict, description="more links on this platform (multiarch paths)")

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
    locked_for: list[Literal["x86_64", "aarch64"]] = Field(
        default_factory=lambda: list(DEB_ARCH), description="the platforms this set is locked for (default: all)")
    sysroot: bool = Field(False, description="packages of the target platform (libraries, headers, a root to "
                                             "emulate), never the /usr actions run on")
    cross: dict[Literal["x86_64", "aarch64"], str] = Field(
        default_factory=dict, description="target platform -> a deb_packages set of exec-platform packages that "
                                          "stands in for this one when actions build for that platform "
                                          "(a cross compiler under the native names)")

    _check = field_validator("packages", "exclude")(_names)

    @field_validator("lock")
    @classmethod
    def _lock_path(cls, v: str) -> str:
        if v.startswith("/") or ".." in v.split("/") or not v.endswith(".json"):
            raise ValueError("must be a workspace-relative path ending in .json (e.g. toolchains/gcc-12.lock.json)")
        return v

    @model_validator(mode="after")
    def _some_roots(self) -> "DebPackagesAttrs":
        if not self.locked_for:
            raise ValueError("locked_for names no platform")
        for platform in self.locked_for:
            if not self.roots(platform):
                raise ValueError(f"no root packages for {platform}: give packages (or platforms.{platform}.packages)")
        if self.sysroot and self.cross:
            raise ValueError("a sysroot holds the target's packages: it has no cross stand-in")
        return self

    def roots(self, platform: str) -> list[str]:
        """The root packages locked for `platform`, sorted."""
        extra = self.platforms[platform].packages if platform in self.platforms else []
        return sorted(set(self.packages) | set(extra))

    def excluded(self, platform: str) -> list[str]:
        extra = self.platforms[platform].exclude if platform in self.platforms else []
        return sorted(set(self.exclude) | set(extra))


def deb_packages_deps(attrs: DebPackagesAttrs):
    return labels_in(attrs, "cross")


def deb_packages_configure(attrs: DebPackagesAttrs, config: Config) -> Config:
    """A system to run on is the exec machine's (one configured target whatever the target
    platform), unless a cross stand-in serves this target; a sysroot is the target's."""
    if attrs.sysroot or (config.cross and config.target in attrs.cross):
        return config
    return config.exec_config()


def deb_packages_transition(attrs: DebPackagesAttrs, key: str, label: str, config: Config) -> Config | None:
    """The cross stand-in is followed only where it serves: built as an exec-machine system."""
    if key == "cross":
        return config.exec_config() if config.cross and attrs.cross.get(config.target) == label else None
    return config


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
    if ctx.platform != ctx.exec_platform and ctx.platform in attrs.cross:
        stand_in = ctx.dep(attrs.cross[ctx.platform], "cross")
        if SYSTEM_ROOT not in stand_in.info:
            raise ctx.fail(f"{attrs.cross[ctx.platform]} is no system to run actions on", "cross")
        return TargetOutput(stand_in.tree, {**stand_in.info, "cross_target": ctx.platform})
    platform = ctx.platform if attrs.sysroot else ctx.exec_platform
    if platform not in DEB_ARCH:
        raise ctx.fail(f"no Debian architecture for platform {platform}")
    if platform not in attrs.locked_for:
        raise ctx.fail(f"{ctx.label} is locked for {', '.join(attrs.locked_for)} only, not for {platform}",
                       "locked_for", hint=("a sysroot follows the target platform (--platform)" if attrs.sysroot
                                           else "a system to run actions on follows the exec platform"))
    arch = DEB_ARCH[platform]
    rerun = f"run `bgraph deb lock {ctx.label}`"
    locked = lockfile.parse(ctx.read(ctx.sources.entries[attrs.lock]).decode(), where=attrs.lock).get(platform)
    if locked is None:
        raise ctx.fail(f"{attrs.lock} has no packages for {platform}", "lock", hint=rerun)
    roots, exclude = attrs.roots(platform), attrs.excluded(platform)
    if list(locked.roots) != roots or list(locked.exclude) != exclude:
        raise ctx.fail(f"{attrs.lock} is out of date for {platform}: locked for packages {list(locked.roots)} "
                       f"exclude {list(locked.exclude)}, the target names {roots} exclude {exclude}", "lock",
                       hint=rerun)
    for e in locked.packages:
        if e.architecture not in (arch, "all"):
            raise ctx.fail(f"{attrs.lock}: package {e.package} is for {e.architecture}, not {arch}", "lock",
                           hint=rerun)
    mirrors = workspace_mirrors(ctx)
    trees = yield Parallel(_unpacked(ctx, e, mirrors) for e in locked.packages)
    try:
        links = {**attrs.links, **(attrs.platforms[platform].links if platform in attrs.platforms else {})}
        tree = rootfs.assemble({e.package: t for e, t in zip(locked.packages, trees)}, attrs.prefer, links)
    except rootfs.RootfsError as e:
        raise ctx.fail(str(e), e.key, e.hint) from None
    info = {"architecture": arch, "packages": {e.package: e.version for e in locked.packages}}
    if attrs.sysroot:
        return TargetOutput(tree, {**info, "sysroot": True})
    # As a `tools`/`host` target, the tree is the system an action runs on (rules/base.py SYSTEM_ROOT:
    # its usr/, made once here and shared by every action's /usr mount).
    return TargetOutput(tree, {**info, SYSTEM_ROOT: tree.subtree("usr")})


def _unpacked(ctx: RuleContext, entry: LockEntry, mirrors: list[str]) -> PlanGen:
    """Fetch one .deb (by its pin), then unpack its data.tar."""
    where_from = {"pool": entry.filename, "suite": entry.suite, "package": entry.package,
                  "architecture": entry.architecture}
    if mirrors:
        where_from["mirrors"] = " ".join(mirrors)
    if entry.size > 0:  # the fetch stops past it (not in the key: see rules/base.py fetch)
        where_from["size"] = str(entry.size)
    [fetched] = yield [fetch(f"fetch {entry.basename}", entry.basename, entry.sha256, "debian", **where_from)]
    # The unpack holds the package's files in memory until they pass the checks (archive.py).
    unpack = dataclasses.replace(ctx.extract_action(fetched.tree, entry.basename),
                                 memory_mb=64 + 6 * entry.size // (1 << 20))
    [out] = yield [unpack]
    return out.tree
