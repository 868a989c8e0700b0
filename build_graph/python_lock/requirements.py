"""What a python_lock `requirements` line may be: a PEP 508 requirement by project name, nothing else.

The lines reach uv (`bgraph py lock`, on the host) through a requirements file, and uv reads pip's
option lines there: `-e DIR` builds a local project (its setup.py runs), `-r FILE` reads a host file,
`--extra-index-url URL` asks a server the workspace names. A requirement by URL or path
(`name @ file:///…`, `./proj`) names a source that is not an index, and `$VAR` is expanded by uv
from the environment. So each line must parse as packaging's PEP 508 Requirement with a name and no
URL; extras, version specifiers and markers are fine. uv is then handed the canonical text of the
parsed requirement, never the line itself.
"""

from __future__ import annotations

import re

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

_FILE_SYNTAX = re.compile(r"[#\\]|\s-")


def parse_requirement(line: str) -> Requirement:
    """The PEP 508 requirement `line` names; ValueError saying why where it is not one by name."""
    text = line.strip()
    if not text:
        raise ValueError("an empty requirement line")
    if "\n" in line or "\r" in line:
        raise ValueError(f"{line!r}: one requirement per line")
    if text.startswith("-"):
        raise ValueError(f"{line!r}: an option line (pip/uv options such as -e, -r, --index-url) is not a "
                         "requirement; indexes come from pip's configuration")
    if "$" in text:
        raise ValueError(f"{line!r}: environment-variable syntax ($) is not expanded here")
    if _FILE_SYNTAX.search(text):
        # even inside a marker's quoted string, as a requirements file's reader may not see the quotes
        raise ValueError(f"{line!r}: holds '#', '\\' or ' -', which a requirements file reads as a comment, "
                         "a continuation or an option")
    try:
        req = Requirement(text)
    except InvalidRequirement as e:
        first = str(e).splitlines()[0] if str(e) else "not PEP 508"
        raise ValueError(f"{line!r} is not a PEP 508 requirement by name ({first})") from None
    if req.url:
        raise ValueError(f"{line!r}: a requirement by URL or path ({req.url}) is not locked; name a project "
                         "the indexes serve")
    # A name like `jaraco.zip` (a real project) is fine: uv is given it in PEP 503 form (canonical),
    # without the dots that would make it an archive's file name to uv.
    return req


def canonical(line: str) -> str:
    """The text uv is given for `line`: packaging's rendering of the parsed requirement, its name in
    PEP 503 form (no dots: uv takes a name like `x.whl` or `x.tar.gz` for a file beside it)."""
    req = parse_requirement(line)
    req.name = canonicalize_name(req.name)
    text = str(req)
    if _FILE_SYNTAX.search(text) or text.startswith("-"):  # packaging's rendering, checked as the line was
        raise ValueError(f"{line!r} renders as {text!r}, which a requirements file would not read as one requirement")
    return text
