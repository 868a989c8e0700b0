"""Patch files as hunks: a unified diff split into one small patch per hunk (parsed by
unidiff), and the files a patch changes.

`bgraph audit` applies a patch set with one hunk left out through the ordinary patched_tree
rule, each remaining hunk as a patch file of its own; `bgraph why` follows a patch to the
files it changes. A hunk's patch file is its file's `---`/`+++` lines and the hunk itself, so
GNU patch applies it exactly as it applies that hunk inside the whole patch (at an offset
where an earlier hunk of the same file was left out).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import unidiff

from build_graph.errors import LoadError


@dataclass(frozen=True)
class Hunk:
    patch: str  # workspace path of the patch file
    index: int  # 1-based position in the patch, over all its files
    file: str  # the file it changes, as the patched tree names it (leading components stripped)
    header: str  # its @@ line
    added: int
    removed: int
    text: str  # a patch file holding this hunk alone

    @property
    def id(self) -> str:
        return f"{self.patch}#{self.index}"


def _stripped(name: str, strip: int) -> str:
    """A path from a ---/+++ line with `strip` leading components removed (patch -p)."""
    return "/".join(name.split("/")[strip:])


def _parse(patch: str, text: str) -> unidiff.PatchSet:
    try:
        patched = unidiff.PatchSet(text)
    except unidiff.UnidiffParseError as e:
        raise LoadError(f"not a unified diff: {e}", where=patch) from None
    if not any(len(pf) for pf in patched):
        raise LoadError("the patch holds no hunk", where=patch)
    for pf in patched:
        if pf.is_binary_file:
            raise LoadError(f"binary change to {pf.path} cannot be split into hunks", where=patch)
    return patched


def _changed_file(pf: unidiff.PatchedFile, strip: int) -> str:
    name = pf.source_file if pf.target_file == "/dev/null" else pf.target_file
    return _stripped(name, strip)


def split(patch: str, text: str, strip: int = 1) -> list[Hunk]:
    """Every hunk of the patch file `patch` (its content `text`), in order, each with a patch
    text of its own."""
    hunks: list[Hunk] = []
    for pf in _parse(patch, text):
        source = pf.source_file + (f"\t{pf.source_timestamp}" if pf.source_timestamp else "")
        target = pf.target_file + (f"\t{pf.target_timestamp}" if pf.target_timestamp else "")
        head = f"--- {source}\n+++ {target}\n"
        for h in pf:
            body = str(h)
            hunks.append(Hunk(patch, len(hunks) + 1, _changed_file(pf, strip), body.split("\n", 1)[0],
                              h.added, h.removed, head + body))
    return hunks


def files_changed(patch: str, text: str, strip: int = 1) -> list[str]:
    """The files the patch changes (creates, edits or deletes), in order."""
    return list(dict.fromkeys(_changed_file(pf, strip) for pf in _parse(patch, text)))


# What GNU patch acts on: a unified (`@@ -`), context (`***************`) or normal-diff
# (`12,14c12`) hunk, or a git header that changes a file without one (a mode change, a rename
# or copy, an empty file created or deleted).
_HUNK = re.compile(r"^(@@ -\d|\*{15}|\d+(,\d+)?[acd]\d+(,\d+)?$)", re.M)
_GIT_ONLY = re.compile(r"^(old mode|new mode|rename from|copy from|new file mode|deleted file mode) ", re.M)
# A git diff made without --binary: GNU patch skips such a file and still exits 0.
_BINARY = re.compile(r"^Binary files (.*) and (.*) differ$", re.M)


def inert(text: str) -> str | None:
    """Why applying the patch `text` would change nothing while GNU patch reports success (an
    empty file, a binary change git left out), or None where it holds a change."""
    binary = _BINARY.search(text)
    if binary:
        name = binary.group(2) if binary.group(2) != "/dev/null" else binary.group(1)
        return (f"it holds a binary change to {name} without its content (a git diff made without "
                "--binary), which patch skips while reporting success")
    if not _HUNK.search(text) and not _GIT_ONLY.search(text):
        return "it holds no hunk (an empty or truncated file?), so applying it would change nothing"
    return None


# The lines that name a file the patch writes (GNU patch takes a new file's name from them).
_NAMES = re.compile(r"^(?:\+\+\+ |--- |\*\*\* |rename to |copy to |diff --git )(.*)$", re.M)


def non_utf8_name(text: str) -> str | None:
    """The first file name in the patch `text` (decoded by `decode`) that is not UTF-8, shown with
    \\x escapes: a tree holds only UTF-8 names, so applying it could only fail later."""
    for m in _NAMES.finditer(text):
        try:
            m.group(1).encode("utf-8")
        except UnicodeEncodeError:
            return encode(m.group(1)).decode("utf-8", "backslashreplace")
    return None


def decode(data: bytes) -> str:
    """A patch file's bytes as text, any byte kept (encode with `encode` to get them back)."""
    return data.decode("utf-8", "surrogateescape")


def encode(text: str) -> bytes:
    return text.encode("utf-8", "surrogateescape")
