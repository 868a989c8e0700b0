"""Where Debian packages come from: WORKSPACE.toml [debian] mirrors, else apt's own sources.

apt's sources are read from its files, as apt reads them: /etc/apt/sources.list, then
sources.list.d/*.list (one-line format) and *.sources (deb822), in name order. Files with
other names (`x.list.disabled`) and stanzas with `Enabled: no` are skipped, as are deb-src
lines, and sources restricted to other architectures (`[arch=...]`, `Architectures:`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from debian.deb822 import Deb822

from build_graph.errors import LoadError

APT_ETC = Path("/etc/apt")
# apt ignores files in sources.list.d whose names hold other characters (see sources.list(5)).
_PART_NAME = re.compile(r"^[A-Za-z0-9_.-]+\.(list|sources)$")
_ONE_LINE = re.compile(r"^(deb|deb-src)\s+(?:\[([^\]]*)\]\s*)?(\S+)\s+(\S+)((?:\s+\S+)*)\s*$")


@dataclass(frozen=True)
class AptSource:
    """One archive base URL and the suites and components taken from it."""

    uri: str
    suites: tuple[str, ...]
    components: tuple[str, ...]
    architectures: tuple[str, ...] = ()  # empty: every architecture
    origin: str = ""  # the file it was read from, for messages

    def serves(self, arch: str) -> bool:
        return not self.architectures or arch in self.architectures


def _one_line(path: Path) -> list[AptSource]:
    out = []
    for n, raw in enumerate(path.read_text(errors="replace").splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = _ONE_LINE.match(line)
        if not m:
            raise LoadError(f"cannot read apt source line {raw.strip()!r}", where=f"{path}:{n}")
        kind, options, uri, suite, comps = m.groups()
        if kind != "deb":
            continue
        opts = dict(o.split("=", 1) for o in (options or "").split() if "=" in o)
        if suite.endswith("/"):  # a flat repository: no dists/ tree, not supported
            continue
        out.append(AptSource(uri, (suite,), tuple(comps.split()),
                             tuple(opts["arch"].split(",")) if "arch" in opts else (), f"{path}:{n}"))
    return out


def _deb822(path: Path) -> list[AptSource]:
    out = []
    with path.open(errors="replace") as f:
        for stanza in Deb822.iter_paragraphs(f, use_apt_pkg=False):
            if stanza.get("Enabled", "yes").strip().lower() == "no":
                continue
            if "deb" not in stanza.get("Types", "").split():
                continue
            suites = tuple(s for s in stanza.get("Suites", "").split() if not s.endswith("/"))
            if not suites:
                continue
            for uri in stanza.get("URIs", "").split():
                out.append(AptSource(uri, suites, tuple(stanza.get("Components", "").split()),
                                     tuple(stanza.get("Architectures", "").split()), str(path)))
    return out


def read_apt_sources(etc: Path = APT_ETC) -> list[AptSource]:
    """The enabled `deb` sources of apt's configuration under `etc`, in apt's order."""
    found: list[AptSource] = []
    main = etc / "sources.list"
    if main.is_file():
        found += _one_line(main)
    parts = etc / "sources.list.d"
    if parts.is_dir():
        for path in sorted(parts.iterdir()):
            if not path.is_file() or not _PART_NAME.match(path.name):
                continue
            found += _one_line(path) if path.suffix == ".list" else _deb822(path)
    return found


def configured_sources(mirrors: list[str], suites: list[str], components: list[str],
                       etc: Path = APT_ETC) -> list[AptSource]:
    """WORKSPACE.toml's [debian] mirrors (each serving every suite), else apt's sources (only the
    suites [debian] names, when it names some)."""
    if mirrors:
        return [AptSource(m, tuple(suites), tuple(components), (), "WORKSPACE.toml [debian]") for m in mirrors]
    found = read_apt_sources(etc)
    if suites:
        found = [AptSource(s.uri, tuple(x for x in s.suites if x in suites), s.components, s.architectures, s.origin)
                 for s in found]
        found = [s for s in found if s.suites]
    if not found:
        raise LoadError("no Debian mirror is configured", where=str(etc / "sources.list.d"),
                        hint="add [debian] mirrors and suites to WORKSPACE.toml, or a deb source to apt's configuration")
    return found


def suites_in_order(sources: list[AptSource]) -> list[str]:
    """Every suite the sources name, first appearance first."""
    seen: dict[str, None] = {}
    for s in sources:
        for suite in s.suites:
            seen.setdefault(suite)
    return list(seen)


def mirrors_for(sources: list[AptSource], suite: str, arch: str) -> list[str]:
    """Base URLs to try for a file of `suite`: those that name it first, then the others."""
    first = [s.uri for s in sources if suite in s.suites and s.serves(arch)]
    rest = [s.uri for s in sources if s.uri not in first]
    return list(dict.fromkeys(first + rest))
