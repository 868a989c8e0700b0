"""Read Make-syntax dependency files (`gcc -MD -MF`, `nvcc -MD -MF`): the files a compile read.

No maintained Python package reads this format, and it is small: rules `target: dep dep \\`
with backslash-newline continuations, `\\ ` for a space in a name and `$$` for `$`.
"""

from __future__ import annotations

import posixpath
import re

_TOKEN = re.compile(r"(?:\\.|[^\s\\])+")
_UNESCAPE = re.compile(r"\\(.)")


def parse_depfile(text: str) -> list[str]:
    """The prerequisites of every rule in `text`, in order, without duplicates."""
    joined = re.sub(r"\\\r?\n", " ", text)
    deps: list[str] = []
    seen: set[str] = set()
    for line in joined.splitlines():
        # The target ends at the first unescaped ':' followed by whitespace or end of line.
        m = re.search(r"(?<!\\):(?:\s|$)", line)
        if not m:
            continue
        for raw in _TOKEN.findall(line[m.end():]):
            name = _UNESCAPE.sub(r"\1", raw) if "\\" in raw else raw  # most names have no escape
            if "$$" in name:
                name = name.replace("$$", "$")
            if name not in seen:
                seen.add(name)
                deps.append(name)
    return deps


def absolute(path: str, cwd: str) -> str:
    """A depfile path as an absolute, normalised sandbox path (relative ones are against cwd)."""
    return posixpath.normpath(path if path.startswith("/") else posixpath.join(cwd, path))
