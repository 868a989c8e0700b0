"""Parse and match labels (`//pkg:name`) and patterns (`//pkg:all`, `//pkg/...`, `//...`)."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import re
from dataclasses import dataclass
from typing import Iterable

from build_graph.errors import LabelError

# A segment of dots alone ('.', '..') is no name: bgraph-out/<package>/<name> would leave bgraph-out.
# A segment is a file name under bgraph-out/ (a package's directory, a target's link): at most
# MAX_SEGMENT bytes, which leaves room below the file system's 255 for the link's temporary names.
MAX_SEGMENT = 200
_SEGMENT = rf"(?!\.+(?![A-Za-z0-9_.+-]))[A-Za-z0-9_.+-]{{1,{MAX_SEGMENT}}}"
_PKG = rf"{_SEGMENT}(?:/{_SEGMENT})*"
_NAME = _SEGMENT
# Matched whole (fullmatch): `$` would also match before a final newline, and a table named
# "ok\n" would be the label //p:ok.
_PKG_RE = re.compile(rf"(?:{_PKG})?")
_LABEL_RE = re.compile(rf"//(?P<pkg>{_PKG})?:(?P<name>{_NAME})")
_RELATIVE_RE = re.compile(rf":(?P<name>{_NAME})")
_RECURSIVE_RE = re.compile(rf"//(?:(?P<pkg>{_PKG})/)?\.\.\.")


def hashed_once(*fields: str):
    """For a frozen dataclass (put below @dataclass): the hash dataclass would compute from
    `fields`, computed once at construction, and a pickle of the constructor's arguments.

    Labels and configured targets key every table of a build (a plan of 100,000 targets looks
    them up millions of times, and dataclass's hash is a Python call building a tuple each time).
    A pickle carries the fields alone (a str's hash differs from one process to the next); one
    written before this was kept computes the hash on first use."""
    def apply(cls):
        def __post_init__(self) -> None:
            object.__setattr__(self, "_hash", hash(tuple(getattr(self, f) for f in fields)))

        def __hash__(self) -> int:
            try:
                return self._hash
            except AttributeError:
                __post_init__(self)
                return self._hash

        def __reduce__(self):
            return (cls, tuple(getattr(self, f.name) for f in dataclasses.fields(self)))

        cls.__post_init__, cls.__hash__, cls.__reduce__ = __post_init__, __hash__, __reduce__
        return cls
    return apply


@dataclass(frozen=True, order=True)
@hashed_once("package", "name")
class Label:
    package: str
    name: str

    def __str__(self) -> str:
        return f"//{self.package}:{self.name}"


def parse_label(text: str, *, package: str | None = None, where: str | None = None) -> Label:
    """Parse `//pkg:name` (or `:name` relative to `package`)."""
    label = _parsed(text, package)
    if label is not None:
        return label
    long = too_long(text)
    if long:
        shown = text if len(text) <= 60 else text[:60] + "…"
        raise LabelError(f"bad label {shown!r}: {long}", where=where,
                         hint=f"each package segment and the name become a file name under bgraph-out/: "
                              f"shorten it to {MAX_SEGMENT} characters or fewer")
    raise LabelError(
        f"bad label {text!r}",
        where=where,
        hint="labels look like //package:name (letters, digits, '_.+-', not '.' or '..' alone; packages separated by '/')",
    )


def too_long(text: str) -> str | None:
    """What makes `text` (a label or package) too long for bgraph-out, if that is its fault."""
    for segment in re.split(r"[/:]", text):
        if len(segment.encode()) > MAX_SEGMENT:
            return f"the segment {segment[:12] + '…'!r} is {len(segment.encode())} bytes, more than {MAX_SEGMENT}"
    return None


def valid_package(package: str) -> bool:
    """Whether `package` (without the leading //) may name a package."""
    return bool(_PKG_RE.fullmatch(package))


@functools.lru_cache(maxsize=1 << 18)
def _parsed(text: str, package: str | None) -> Label | None:
    """The label `text` names (None: not a label), memoized: planning parses each dependency
    text three times (configure, the cycle check, the rule's plan)."""
    m = _LABEL_RE.fullmatch(text)
    if m:
        return Label(m.group("pkg") or "", m.group("name"))
    m = _RELATIVE_RE.fullmatch(text)
    if m and package is not None:
        return Label(package, m.group("name"))
    return None


@dataclass(frozen=True)
class Pattern:
    """A label, `//pkg:all`, `//pkg/...` or `//...`."""

    package: str
    name: str | None  # None: every target in the package
    recursive: bool = False

    def matches(self, label: Label) -> bool:
        if self.recursive:
            return not self.package or label.package == self.package or label.package.startswith(self.package + "/")
        return label.package == self.package and (self.name is None or label.name == self.name)


def parse_pattern(text: str) -> Pattern:
    m = _RECURSIVE_RE.fullmatch(text)
    if m:
        return Pattern(m.group("pkg") or "", None, recursive=True)
    label = parse_label(text)
    if label.name == "all":
        return Pattern(label.package, None)
    return Pattern(label.package, label.name)


def expand(patterns: Iterable[str], known: Iterable[Label]) -> list[Label]:
    """Expand patterns against the known labels; an unknown label suggests close matches."""
    known = sorted(known)
    out: list[Label] = []
    for text in patterns:
        pattern = parse_pattern(text)
        hits = [lab for lab in known if pattern.matches(lab)]
        if not hits:
            raise unknown_label(text, known)
        out.extend(h for h in hits if h not in out)
    return out


def unknown_label(text: str, known: Iterable[Label], where: str | None = None) -> LabelError:
    names = [str(k) for k in known]
    close = difflib.get_close_matches(text, names, n=3, cutoff=0.6)
    hint = f"did you mean {', '.join(close)}?" if close else "run `bgraph query //...` to list targets"
    return LabelError(f"no target matches {text!r}", where=where, hint=hint)
