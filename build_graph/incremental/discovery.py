"""Input discovery: how an action keyed on less than all it can read is matched to a recorded run
(ARCHITECTURE.md invariant 7). A strategy is `Action.discovery`; None keys an action on every
input it can read. Each strategy states its soundness contract and the invocations it is allowed
for; a rule that cannot prove its command is one of them plans no strategy.

An action whose strategy narrows something (`narrows`) is filed under a prekey: its key with the
narrowed mounts, and any recorded -D/-U, left out (model.py). The prekey's manifest lists earlier
runs: the digests of the files each read, by its depfiles, in the narrowed mounts; for the name of
each file it read anywhere, every path with that name in each narrowed mount (a file added or
removed under such a name could change what an #include finds, so the entry is stale); and, where
recorded, its -D/-U with the record of which it used (macro_use.py). A build checks the entries by
digest before running anything, so an edit to a file the run did not read is a hit. The rebuilder
(rebuilder.py) asks the strategy, one method each: `reads` (the entry of a finished run),
`differences` (why an entry does not fit now), `macro_fit` (which differing -D/-U the run never
used) and `unseen_edit` (whether what changed changed only where the run does not look).
`described()` is what joins the key, spelled as these fields were on Action ("narrow", "depfiles",
"macro_record": tests/test_golden_keys.py), so no key moved.

This module knows keys, stored blobs and traces, never rules.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
import stat
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable

from build_graph import macro_use
from build_graph.cpp_view import Macros, command_macros, defined_names, view
from build_graph.depfile import absolute, parse_depfile, stepped_out_of
from build_graph.model import Action, Digester, DirEntry, FileEntry, SymlinkEntry, Tree
from build_graph.sandbox import MERGED_USR_LINKS, OUT_MOUNT
from build_graph.store.cas import CorruptBlob, LocalCas, StoreError


def short(d: Any) -> str:
    return str(d)[:12] + "…" if d else "none"


@lru_cache(maxsize=8192)
def _split(argv: tuple[str, ...]) -> tuple[list[str], dict[str, list[str]]] | None:
    return macro_use.split(argv)  # argv never changes: one split per command line (do not mutate it)


def _roots(action: Action, mount: str) -> tuple[str, ...]:
    """Where a mount is seen in the sandbox: a staged mount also at /bgraph/out, through symlinks."""
    return (mount, "/bgraph/out") if mount == action.staged else (mount,)


def _through_link(dep: str, cwd: str, root: str, tree: Tree) -> bool:
    """Whether a `..` of the depfile path `dep` steps out of a symbolic link of `tree` (at `root`)
    or of a directory below one: the file read is then not the one its normalised path names."""
    for directory in stepped_out_of(dep, cwd):
        if not directory.startswith(root + "/"):
            continue
        parts = directory[len(root) + 1:].split("/")
        if any(not isinstance(tree.entries.get("/".join(parts[:i])), (type(None), DirEntry))
               for i in range(1, len(parts) + 1)):
            return True
    return False


# What a file read can make the preprocessor or the assembler look for beyond its depfile:
# `__has_include("x.h")` of a file that is absent names nothing in the depfile, and an assembler
# `.incbin` (or `.include`) reads a file GCC's depfile never names (only GNU as's own, `--MD`,
# does: depfile.py). Headers wrap __has_include in a macro of their own (CCCL:
# `#define _CCCL_HAS_INCLUDE(_X) __has_include(_X)`): such a definition names the wrapper, whose
# uses (in any file the step read) are then looked up as __has_include's are. The patterns are
# matched after line splices are removed and comments made blanks (`_code`); any other
# occurrence of the operator (an alias `#define HI __has_include`, a use the patterns do not
# parse) or pieces of its name a paste could join (`_pasted`) makes the file opaque.
_HAS_INCLUDE = re.compile(rb"__has_include(?:_next)?\s*\(\s*(?:[\"<]([^\">\n]+)[\">]|([^)\s]*))")
_WRAPPER = re.compile(rb"#[ \t]*define[ \t]+(\w+)[ \t]*\(([^)\n]*)\)[^\n]*?__has_include(?:_next)?\s*\(\s*(\w+)\s*\)")
_OPERATOR = re.compile(rb"(?<![A-Za-z0-9_$])__has_include(?:_next)?(?![A-Za-z0-9_$])")
# Where the operator is only tested for (`#ifdef __has_include`, `defined(__has_include)`).
_TESTED = re.compile(rb"(?:(?<![A-Za-z0-9_$])defined[ \t]*\(?|#[ \t]*(?:ifn?def|elifn?def)[ \t]+)[ \t]*\Z")
# Pieces that a paste (`##`, `%:%:`; in this file or in a macro another file defines) could join
# into __has_include(_next), two at a time: a piece that is no common identifier is enough
# (`_has_include`, `__has_inc`); a short prefix (`__h`, `__has_`: libstdc++'s type_traits pastes
# `__has_##_NTYPE`) only with its own tail outside #include lines. (Three pieces or more, or
# pieces from the command line's -D, are not looked for: depfile.py refuses -D values that name
# `has_include` or `__h`.)
_RARE_PIECES = frozenset(
    {p.encode() for p in ["__has_include_next"[:k] for k in range(7, 18)]} - {b"__has_include"}
    | {b"has_include", b"_has_include", b"has_include_next", b"_has_include_next", b"as_include",
       b"s_include", b"as_include_next", b"s_include_next"})
_IDENT_BYTES = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_$")


def _identifiers_at(data: bytes, literal: bytes):
    """Each identifier (a longest run of identifier characters) of `data` that holds `literal`,
    once. Found from the literal's occurrences (bytes.find): a pattern that starts with a
    look-behind makes `re` try every position of the file."""
    at, last = data.find(literal), -1
    while at >= 0:
        start, end = at, at + len(literal)
        while start and data[start - 1] in _IDENT_BYTES:
            start -= 1
        while end < len(data) and data[end] in _IDENT_BYTES:
            end += 1
        if start != last:
            last = start
            yield start, data[start:end]
        at = data.find(literal, end)


def _rare_piece(data: bytes) -> bool:
    """Whether an identifier of `data` is one of _RARE_PIECES (each holds `has_i` or `s_include`)."""
    return any(word in _RARE_PIECES for literal in (b"has_i", b"s_include")
               for _start, word in _identifiers_at(data, literal))


# A head piece: `__h`, `__ha`, `__has`, `__has_` as a whole identifier. The pattern starts with its
# literal (a leading look-behind made `re` try every position: 0.39 ms per CUDA header, whose
# `__host__` sends each here); the character before is checked by `_heads`.
_HEADS = re.compile(rb"__h(?:a(?:s_?)?)?(?![A-Za-z0-9_$])")


def _heads(data: bytes) -> set[bytes]:
    """The head pieces in `data` (see _HEADS): no identifier character right before one."""
    return {m.group(0) for m in _HEADS.finditer(data) if not m.start() or data[m.start() - 1] not in _IDENT_BYTES}
# A tail piece: an identifier `include`, `_include`, `s_include`, `as_include`, each maybe `_next`.
_TAILS = frozenset(head + b"include" + tail for head in (b"", b"_", b"s_", b"as_") for tail in (b"", b"_next"))
_DIRECTIVE_START = re.compile(rb"[ \t]*(?:#|%:)[ \t]*\Z")


def _pasted(data: bytes, commented: bool = False) -> bool:
    """Whether `data` holds pieces a paste could join into __has_include (see _RARE_PIECES)."""
    if _rare_piece(data):
        return True
    if b"__h" not in data:
        return False
    heads = _heads(data)
    if not heads:
        return False
    for start, word in _identifiers_at(data, b"include"):  # a few: most are #include directives
        if word not in _TAILS:
            continue
        line = data.rfind(b"\n", 0, start) + 1
        if word == b"include" and _DIRECTIVE_START.match(data, line, start):
            continue
        head = b"__has_include"[:len(b"__has_include") - len(word.removesuffix(b"_next"))]
        if head in heads:
            return commented or _pasted(_code(data), True)  # not in a comment either
    return False


_SPLICE = rb"(?:(?:\\|\?\?/)[ \t\f\v]*\r?\n)"  # a trigraph `??/` is a backslash where trigraphs are on
_SPLICES = re.compile(_SPLICE)
_BACKSLASH_SPLICES = re.compile(rb"\\[ \t\f\v]*\r?\n")  # the same without trigraphs: a literal first, ten times faster
_COMMENT = re.compile(rb"/\*.*?\*/|//[^\n]*|(\"(?:\\.|[^\"\\\n])*\"?|'(?:\\.|[^'\\\n])*'?)", re.S)
# Where the comment pattern could take a literal for a comment's start: a raw string, a quote in
# a header name (`<a".h>`). Such a file is matched with its comments in it.
_UNLEXED = re.compile(rb"(?:^|[^A-Za-z0-9_$])(?:u8|[uUL])?R\"|(?:include|include_next|import|__has_include(?:_next)?"
                      rb"[ \t]*\()[ \t]*<[^>\n]*[\"']")
_INCBIN = re.compile(rb"\.incbin\b", re.I)  # GAS directives ignore case


def _split_word(word: bytes) -> bytes:
    """A pattern of `word` with line splices anywhere in it: found before the splices are taken
    out, which costs a pass over the file."""
    return (_SPLICE + b"*").join(bytes([c]) for c in word)


_SPLIT_DEPENDENCY = re.compile(_split_word(b"dependency"))
# The word before an operand (a quoted or <> name), blanks, comments and line breaks between.
# (The word's literal first: a leading look-behind made `re` try every position; the character
# before is checked by _dependencies.)
_DEPENDENCY_OPERAND = re.compile(rb"dependency(?:[ \t\r\n\f\v]|/\*.*?\*/|//[^\n]*)*(?:\\?[\"<])", re.S)
# `#pragma GCC dependency "f"` (or `_Pragma("GCC dependency \"f\"")`) reads f's time and stops the
# compile where f is missing, and no depfile names f (R7 pragma_dependency): its operand is a name
# looked for, as __has_include's is. The word before an operand in any other form (a macro-made
# pragma, `_Pragma(#x)`) makes the file opaque (_dependencies).
_DEPENDENCY = re.compile(rb"(?:#|%:)[ \t]*pragma[ \t]+GCC[ \t]+dependency[ \t]+(?:\"([^\"\n]+)\"|<([^>\n]+)>)"
                         rb"|_Pragma[ \t]*\([ \t]*\"GCC[ \t]+dependency[ \t]+(?:\\\"((?:[^\"\\\n])+)\\\"|<([^>\n]+)>)")


def _spliced(data: bytes) -> bytes:
    """`data` with its line splices taken out."""
    if b"??/" in data:
        return _SPLICES.sub(b"", data)
    return _BACKSLASH_SPLICES.sub(b"", data) if b"\\" in data else data


@lru_cache(maxsize=4)  # a file's scan asks for it up to three times (_pasted, _lookups, _imports)
def _code(data: bytes) -> bytes:
    """`data` (its line splices removed) as the preprocessor sees its tokens: each comment one
    blank (string and character literals kept whole)."""
    if b"/" not in data or _UNLEXED.search(data):
        return data
    return _COMMENT.sub(lambda m: m.group(0) if m.group(1) else b" ", data)


@dataclass(frozen=True)
class Lookups:
    """What one file read makes a compile look for that no depfile names (Contents.lookups)."""

    names: frozenset[str]  # components of the literal operands of __has_include (and of wrappers' uses)
    wrappers: frozenset[str]  # macros this file defines as __has_include of a parameter
    opaque: bool  # an operand that is no literal (a macro), or a use not parsed: nothing can be told
    assembles: bool = False  # an `.incbin`: a file only the assembler's own depfile names


NOTHING = Lookups(frozenset(), frozenset(), False)


def _followed(tree: Tree, rel: str, hops: int = 40):
    """The entry at `rel` in `tree`, symbolic links inside the tree followed (None: absent, or a
    link leaving the tree or looping)."""
    parts = rel.split("/")
    i = 0
    while i < len(parts):
        here = "/".join(parts[:i + 1])
        entry = tree.entries.get(here)
        if isinstance(entry, SymlinkEntry):
            hops -= 1
            if hops < 0 or entry.target.startswith("/"):
                return None
            joined = posixpath.normpath(posixpath.join(posixpath.dirname(here), entry.target))
            if joined == ".." or joined.startswith("../"):
                return None
            parts = (joined.split("/") if joined != "." else []) + parts[i + 1:]
            i = 0
            continue
        i += 1  # a file, a directory entry, or a directory the tree holds only by its files
    return tree.entries.get("/".join(parts))


def _followed_in(tree: Tree, rel: str):
    """_followed, memoized on the tree (one tree, e.g. the toolkit's, serves every action of a build)."""
    memo = tree.__dict__.get("_followed")
    if memo is None:
        memo = tree.__dict__["_followed"] = {}
    if rel not in memo:
        memo[rel] = _followed(tree, rel)
    return memo[rel]


@lru_cache(maxsize=64)
def _uses(macro: str) -> re.Pattern:
    """A use of the __has_include wrapper `macro`, its operand as _HAS_INCLUDE's groups take it."""
    return re.compile(rb"\b" + re.escape(macro.encode()) + rb"\s*\(\s*(?:[\"<]([^\">\n]+)[\">]|([^)\s]*))")


def _visible(action: Action, path: str) -> bool:
    """Whether the sandbox shows `path` from a mount or a host path."""
    return any(path.startswith(r + "/") for mount, _t in action.inputs for r in _roots(action, mount)) or any(
        path.startswith(h.rstrip("/") + "/") for h in action.host_paths)


def _made(tree: Tree, path: str) -> bool:
    """Whether `path` is a file the action wrote: a regular file of its output tree (at
    /bgraph/out), reached through no link."""
    rel = path[len(OUT_MOUNT) + 1:] if path.startswith(OUT_MOUNT + "/") else None
    return rel is not None and isinstance(tree.entries.get(rel), FileEntry) and not _linked(tree, rel)


def _linked(tree: Tree, rel: str) -> bool:
    """Whether a directory on `rel` is something other than a directory of `tree` (a link)."""
    parts = rel.split("/")
    return any(not isinstance(tree.entries.get("/".join(parts[:i])), (type(None), DirEntry))
               for i in range(1, len(parts)))


def _components(path: str) -> list[str]:
    """Every name on a path: a file, directory or link of one of these names appearing elsewhere
    in a narrowed mount could redirect the lookup that found it (-I order, a directory link)."""
    return [c for c in path.split("/") if c not in ("", ".", "..")]


def _by_digest(tree: Tree) -> dict[str, tuple[str, ...]]:
    """Digest -> every file of `tree` with those bytes (memoized on the tree)."""
    index = tree.__dict__.get("_by_digest")
    if index is None:
        grouped: dict[str, list[str]] = {}
        for p, d in tree.file_digests().items():
            grouped.setdefault(d, []).append(p)
        index = tree.__dict__["_by_digest"] = {d: tuple(ps) for d, ps in grouped.items()}
    return index


# Options naming a directory the preprocessor looks in (joined, `-Idir`, or the next argument);
# -iwithprefix(before) name one below the last -iprefix.
_DIR_OPTIONS = ("-iwithprefixbefore", "-iwithprefix", "-iprefix", "-isystem", "-iquote", "-idirafter", "-isysroot",
                "--sysroot", "-I")
_PATH_VARIABLES = ("CPATH", "C_INCLUDE_PATH", "CPLUS_INCLUDE_PATH", "OBJC_INCLUDE_PATH")


def _include_dirs(argv: tuple[str, ...], env: Any = ()) -> list[str]:
    """The directories a compile's command line names for header lookups (also inside a shell
    command it runs: `sh -c "gcc -Idir ..."`, as imported Ninja edges do), and those of its
    environment's CPATH and the like."""
    from build_graph.nvcc import split_command

    words: list[str] = []
    for arg in argv:
        words.append(arg)
        if " " in arg or "\t" in arg:
            try:
                words.extend(split_command(arg))
            except ValueError:
                pass  # an unbalanced quote: not a command this runs
    dirs: list[str] = []
    prefix = ""
    args = iter(words)
    for arg in args:
        for option in _DIR_OPTIONS:
            if arg == option:
                value = next(args, None)
            elif option == "--sysroot" and arg.startswith("--sysroot="):
                value = arg[len("--sysroot="):]
            elif option != "--sysroot" and arg.startswith(option) and len(arg) > len(option):
                value = arg[len(option):]
            else:
                continue
            if value is not None:
                if option == "-iprefix":
                    prefix = value
                else:
                    dirs.append(prefix + value if option.startswith("-iwithprefix") else value)
            break
    for name, value in dict(env).items():
        if name in _PATH_VARIABLES:
            dirs.extend(d for d in value.split(":") if d)
    return dirs


def _directories(tree: Tree) -> frozenset[str]:
    """Every directory `tree` holds, listed or implied by what lies below it (memoized)."""
    found = tree.__dict__.get("_directories")
    if found is None:
        dirs = {p for p, e in tree.entries.items() if isinstance(e, DirEntry)}
        for p in tree.entries:
            parent = p.rpartition("/")[0]
            while parent and parent not in dirs:
                dirs.add(parent)
                parent = parent.rpartition("/")[0]
        found = tree.__dict__["_directories"] = frozenset(dirs)
    return found


def _links(tree: Tree) -> dict[str, str]:
    """Path -> target of every symbolic link of `tree` (memoized)."""
    found = tree.__dict__.get("_links")
    if found is None:
        found = tree.__dict__["_links"] = {p: e.target for p, e in tree.entries.items() if isinstance(e, SymlinkEntry)}
    return found


def _odd_kinds(action: Action, mount: str, tree: Tree, names) -> dict[str, str]:
    """Path -> what it is, for each path of `tree` with one of `names` that is no file: "dir" (an
    empty directory), "link to <kind>" (_kind_at of where it leads in the sandbox). GCC skips such a
    path in a lookup, and what it is can change while every name and link text stays."""
    index, root = tree.by_name(), _roots(action, mount)[0]
    odd: dict[str, str] = {}
    for name in names:
        for path in index.get(name, ()):
            entry = tree.entries[path]
            if isinstance(entry, DirEntry):
                odd[path] = "dir"
            elif isinstance(entry, SymlinkEntry):
                odd[path] = f"link to {_kind_at(action, f'{root}/{path}')}"
    return odd


def _entry_at(action: Action, path: str):
    """What the sandbox has at absolute, resolved-so-far `path`: an entry of a mount, "dir" (a
    directory of one, or one that mounts lie below), None (nothing), or "outside" (no mount holds
    it: a host path, which is not content)."""
    best = None
    for mount, tree in action.inputs:
        for root in _roots(action, mount):
            if (path == root or path.startswith(root + "/")) and (best is None or len(root) > len(best[0])):
                best = (root, tree)
    if best is None:
        if path[1:] in MERGED_USR_LINKS and any(m == "/usr" for m, _t in action.inputs):
            return SymlinkEntry(f"usr{path}")  # a pinned system root's merged-/usr links (sandbox_layout)
        return "dir" if any(r.startswith(path.rstrip("/") + "/") for m, _t in action.inputs
                            for r in _roots(action, m)) else "outside"
    root, tree = best
    rel = path[len(root) + 1:] if path != root else ""
    if rel == "" or rel in _directories(tree):
        return "dir"
    return tree.entries.get(rel)


def _kind_at(action: Action, path: str) -> str:
    """What the directory a command names is, as the kernel resolves it in the sandbox (links
    followed across mounts, `..` after a link taken from where the link leads): "dir", "file",
    "notdir" (a file on the way: a hard error), "absent", "loop", "outside" (a host path), or
    "unknown" (`..` after a host path)."""
    return _resolved(action, path)[0]


def _resolved(action: Action, path: str) -> tuple[str, str]:
    """_kind_at's kind of absolute `path`, and the path it resolves to: for a "file", the file's
    own path in its mount; for "outside", the path from where the walk left every mount ("unknown"
    where a `..` follows that point: R11 `-I/usr/../proc/self/cwd/...`)."""
    comps = [c for c in path.split("/") if c not in ("", ".")]
    cur: list[str] = []
    hops = 40
    while comps:
        c = comps.pop(0)
        if c == "..":
            if cur:
                cur.pop()
            continue
        here = "/" + "/".join([*cur, c])
        found = _entry_at(action, here)
        if found == "outside":
            if ".." in comps:  # where `..` leads from a host path (through its links) is not known here
                return "unknown", posixpath.join(here, *comps)
            return "outside", posixpath.join(here, *comps)
        if isinstance(found, SymlinkEntry):
            hops -= 1
            if hops < 0:
                return "loop", here
            if found.target.startswith("/"):
                cur = []
            comps = [x for x in found.target.split("/") if x not in ("", ".")] + comps
            continue
        if found is None:
            return "absent", here
        if isinstance(found, FileEntry):
            return ("notdir", here) if comps else ("file", here)
        cur.append(c)
    return "dir", "/" + "/".join(cur)


def _lookups(data: bytes, wrappers: frozenset[str]) -> Lookups:
    """Lookups of one file's bytes. An operand that names no file is opaque, unless it is the
    parameter of a wrapper this file defines (`#define W(_X) __has_include(_X)`, and W's own uses
    of another wrapper's parameter); so is any other use of the operator, or pieces of its name
    a paste could join (`_pasted`)."""
    names: set[str] = set()
    spliced = _spliced(data)  # once: most headers need it below too
    opaque = _imports(spliced)  # GCC skips any later file with the bytes of one #imported (R8)
    if b"dependency" in data or ((b"\\" in data or b"??/" in data) and _SPLIT_DEPENDENCY.search(data)):
        found_names, opaque_pragma = _dependencies(spliced)
        names.update(found_names)
        opaque = opaque or opaque_pragma
    # A splice may split `__has_include` anywhere: one side holds `__h` or `has_`/`s_include`.
    # (A wrapper's name split by one is not looked for.)
    if b"__h" not in data and b"has_" not in data and b"s_include" not in data and not any(
            macro.encode() in data for macro in wrappers):
        return Lookups(frozenset(names), frozenset(), opaque, bool(_INCBIN.search(data)))
    data = spliced
    assembles = bool(_INCBIN.search(data))
    used = [macro for macro in wrappers if macro.encode() in data]
    opaque = _pasted(data) or opaque  # comments kept: only more pieces
    if b"__has_include" not in data and not used:
        return Lookups(frozenset(names), frozenset(), opaque, assembles)  # most files: nothing to look for
    code = _code(data)
    has = b"__has_include" in code
    definitions = list(_WRAPPER.finditer(code)) if has else []
    own = [(d, {p.strip() for p in d.group(2).split(b",")}) for d in definitions]
    params = set().union(*(ps for _d, ps in own))
    wrapped = {d.start(3): d.group(1).decode() for d, ps in own if d.group(3) in ps}  # of its own parameter
    uses = [_HAS_INCLUDE] if has else []
    uses += [_uses(macro) for macro in used]
    parsed: set[int] = set()
    for pattern in uses:
        for m in pattern.finditer(code):
            if pattern is _HAS_INCLUDE:
                parsed.add(m.start())
            if m.group(1):
                names.update(_components(m.group(1).decode(errors="replace")))
            elif m.start(2) not in wrapped and (pattern is _HAS_INCLUDE or m.group(2) not in params):
                opaque = True  # a computed operand: nothing can be told of what it looks for
    if has and not opaque:
        for m in _OPERATOR.finditer(code):
            if m.start() not in parsed and not _TESTED.search(code, max(0, m.start() - 40), m.start()):
                opaque = True  # an alias, or a use the pattern does not parse
                break
    return Lookups(frozenset(names), frozenset(wrapped.values()), opaque, assembles)


def _dependencies(spliced: bytes) -> tuple[set[str], bool]:
    """(the path components of every `#pragma GCC dependency` operand in `spliced` (line splices
    removed), whether the word stands before a name in another form: a macro may make the pragma
    of it (`_Pragma(#x)` with a comment or a line break before the operand: R8), so nothing can be
    told). Looked at where the word is, never by taking every comment out of the file."""
    names: set[str] = set()
    for m in _DEPENDENCY_OPERAND.finditer(spliced):
        if m.start() and spliced[m.start() - 1] in _IDENT_BYTES:
            continue
        line = spliced.rfind(b"\n", 0, m.start()) + 1
        end = spliced.find(b"\n", m.start())
        parsed = next((p for p in _DEPENDENCY.finditer(spliced, line, end if end >= 0 else len(spliced))
                       if p.start() <= m.start() < p.end()), None)
        if parsed is None:
            return names, True
        operand = next(g for g in parsed.groups() if g is not None)
        names.update(_components(operand.decode(errors="replace")))
    return names, False


_IMPORT = re.compile(rb"(?:#|%:|\?\?=)[ \t]*import(?![A-Za-z0-9_$])")
# The same with comments allowed between the `#` and the word, on bytes whose comments are still in:
# it finds every directive _IMPORT finds once comments are blanks (and a few more), so a file it
# finds nothing in needs no pass that takes comments out (the word `import` is common in prose).
_IMPORT_COMMENTED = re.compile(rb"(?:#|%:|\?\?=)(?:[ \t]|/\*.*?\*/)*import(?![A-Za-z0-9_$])", re.S)


def _imports(spliced: bytes) -> bool:
    """Whether `spliced` (a file's bytes, line splices taken out) has an `#import` directive
    (comments taken out). Comments may stand between `#` and the word, never inside it: a file
    whose spliced bytes lack the word has none (most files: one search)."""
    return (b"import" in spliced and _IMPORT_COMMENTED.search(spliced) is not None
            and _IMPORT.search(_code(spliced)) is not None)


def _encode_lookups(found: Lookups) -> bytes:
    return json.dumps([sorted(found.names), sorted(found.wrappers), found.opaque, found.assembles]).encode()


def _decode_lookups(raw: bytes) -> Lookups | None:
    """A row of the state file's probes as written by _encode_lookups (None: not one)."""
    try:
        names, wrappers, opaque, assembles = json.loads(raw)
    except (ValueError, TypeError):
        return None
    if not (isinstance(names, list) and isinstance(wrappers, list) and all(isinstance(n, str) for n in names)
            and all(isinstance(w, str) for w in wrappers) and isinstance(opaque, bool) and isinstance(assembles, bool)):
        return None
    return Lookups(frozenset(names), frozenset(wrappers), opaque, assembles)


@lru_cache(maxsize=1)
def _probe_code(digester: Digester) -> str:
    """The digest of the code that finds lookups: this module's source, where all of _lookups is.
    A kept probe is keyed on it, so an edit to this file never reads a probe the old code made."""
    with open(__file__, "rb") as f:
        return digester.of(f.read())[:32]


class Contents:
    """What strategies read of stored files: an output tree's depfiles and macro record, blobs
    checked against their digests, and memos of views and defined names (one header, many TUs
    and archs). One per rebuilder. With `state`, a stored file's lookups are kept in the state
    file between builds (by its content digest: _lookups is a function of the bytes alone), so a
    cold build does not scan the toolkit's headers again (0.4 ms each, ~250 per CUDA build)."""

    def __init__(self, cas: LocalCas, digester: Digester, state: Any = None):
        self.cas, self.digester, self.state = cas, digester, state
        self._defines: dict[str, frozenset[str]] = {}  # digest or host path -> defined_names
        self._views: dict[tuple, str | None] = {}  # (content digest, macros) -> digest of its view
        self._probes: dict[tuple, Lookups | None] = {}  # (digest or host path, wrappers) -> lookups
        self.wrappers: frozenset[str] = frozenset()  # __has_include wrapper macros met so far (reads)

    def depfile(self, tree: Tree, path: str, hash_escaped: bool = True) -> list[str] | None:
        """What the depfile at `path` of an output tree names (None: not a file there);
        `hash_escaped`: False for GNU as's (depfile.parse_depfile)."""
        entry = tree.entries.get(path)
        if not isinstance(entry, FileEntry):
            return None
        return parse_depfile(self.cas.read_bytes(entry).decode(errors="replace"), hash_escaped)

    def macro_record(self, tree: Tree, path: str) -> macro_use.Record | None:
        """What the gcc-macro-use plugin wrote at `path` (None: missing or incomplete)."""
        entry = tree.entries.get(path)
        if not isinstance(entry, FileEntry):
            return None
        try:
            return macro_use.parse_record(self.cas.read_bytes(entry).decode(errors="replace"))
        except (CorruptBlob, StoreError, OSError):
            return None

    def same_views(self, pairs: list[tuple[str, FileEntry]], macros: Macros) -> bool:
        """Whether each (digest read, file now) pair has one view under `macros`."""
        for before, now in pairs:
            seen = self._view(before, macros)
            if seen is None or seen != self._view(now.digest, macros, now):
                return False
        return True

    def _view(self, digest: str, macros: Macros, entry: FileEntry | None = None) -> str | None:
        """The digest of view(content, macros), memoized."""
        memo_key = (digest, macros.identity())
        if memo_key not in self._views:
            data = self._content(digest, entry)
            seen = view(data, macros) if data is not None else None
            self._views[memo_key] = self.digester.of(seen) if seen is not None else None
        return self._views[memo_key]

    def _content(self, digest: str, entry: FileEntry | None = None) -> bytes | None:
        """A file's bytes, checked against its digest (`entry`: a source maybe hashed but not
        yet stored); None if gone or damaged."""
        try:
            if entry is not None:
                return self.cas.read_bytes(entry)
            data = self.cas.blob_path(digest).read_bytes()
        except (CorruptBlob, StoreError, OSError):
            return None
        return data if self.digester.of(data) == digest else None

    def defined(self, digest: str, entry: FileEntry | None = None) -> frozenset[str] | None:
        """defined_names of a stored file (memoized by digest), or None if it is gone or damaged."""
        names = self._defines.get(digest)
        if names is None:
            data = self._content(digest, entry)
            if data is None:
                return None
            names = self._defines[digest] = defined_names(data)
        return names

    def lookups(self, action: Action, path: str, wrappers: frozenset[str] = frozenset()) -> Lookups | None:
        """What the file at sandbox `path` makes a compile look for that no depfile names, with the
        uses of `wrappers` (macros other files define as __has_include) looked up too (memoized by
        digest or host path); None if the file cannot be read (the caller takes the worst)."""
        key, read = self._locate(action, path)
        if key is None:
            return None
        if read is None:
            return NOTHING
        memo_key = (key, wrappers)
        if memo_key not in self._probes:
            self._probes[memo_key] = self._kept_lookups(key, wrappers, read)
        return self._probes[memo_key]

    def _kept_lookups(self, key: str, wrappers: frozenset[str], read: Callable[[], bytes | None]) -> Lookups | None:
        """_lookups of the bytes `read` gives, through the state file's probes where `key` is a
        content digest (a host path's file may change under the same key: never kept)."""
        kept = None
        if self.state is not None and not key.startswith("/"):
            kept = f"{_probe_code(self.digester)}:{key}:{','.join(sorted(wrappers))}"
            raw = self.state.probe(kept)
            found = _decode_lookups(raw) if raw is not None else None
            if found is not None:
                return found
        data = read()  # checked against its digest (_content): a damaged blob is never scanned
        if data is None:
            return None
        found = _lookups(data, wrappers)
        if kept is not None:
            self.state.put_probe(kept, _encode_lookups(found))
        return found

    def _locate(self, action: Action, path: str):
        """(memo key, reader of the bytes) of the file at sandbox `path`: an input's blob (links
        inside the tree followed) or a host path; ("", None) where no mount holds `path` (the
        sandbox has no such file to read); (None, None) where it cannot be told."""
        for mount, tree in action.inputs:
            for root in _roots(action, mount):
                if path.startswith(root + "/"):
                    entry = _followed_in(tree, path[len(root) + 1:])
                    if not isinstance(entry, FileEntry):
                        return None, None
                    return entry.digest, lambda e=entry: self._content(e.digest, e)
        if any(path.startswith(h.rstrip("/") + "/") for h in action.host_paths):
            def read_host() -> bytes | None:
                # Only what the sandbox shows: a host link under a mounted path may lead out of
                # every mount (/usr/lib/ssl/private -> /etc/ssl/private), and a depfile an action
                # writes may name it; nor a FIFO or device, which would block or never end.
                real = os.path.realpath(path)
                if not any(real.startswith(h.rstrip("/") + "/") for h in action.host_paths):
                    return None
                try:
                    fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
                except OSError:
                    return None
                try:
                    if not stat.S_ISREG(os.fstat(fd).st_mode):
                        return None
                    with os.fdopen(fd, "rb", closefd=False) as f:
                        return f.read()
                except OSError:
                    return None
                finally:
                    os.close(fd)
            return path, read_host
        return "", None

    def defined_in(self, action: Action, path: str) -> frozenset[str] | None:
        """defined_names of the file at sandbox `path`, from the action's inputs or its host
        paths (memoized by digest or host path); None if it is not there."""
        key, read = self._locate(action, path)
        if not key or read is None:
            return None
        names = self._defines.get(key)
        if names is None:
            data = read()
            if data is None:
                return None
            names = self._defines[key] = defined_names(data)
        return names


# Since 2, every name on a path read (directories included) and every name __has_include asks
# for is recorded for each narrowed mount, present or not ("names" with their paths, "absent"); an
# .incbin or a computed __has_include takes the mount whole. Entries of 1 recorded only the file
# names a mount held: never trusted now. Since 4, probes split by comments or line splices are
# read, and any other use of __has_include (an alias, a paste) takes the mount whole: entries
# of 3 may lack such a name.
# Since 6, a file with the bytes of one read is taken as read (GCC's once-only skip names no
# file: "copies"), each -I (-isystem, CPATH, ...) directory's kind is kept ("dirs"), and so is
# every link of a narrowed mount ("links"); a file with `#import` keeps the mount whole:
# entries of 4 lack all of them. Since 7, each path is resolved in the sandbox (`//`, a link of
# another mount into a narrowed one) and one that resolves to no input, output or host path keeps
# the mounts whole: entries of 6 may have missed a file read through such a spelling.
# Since 8, each path of a recorded name that is no file (an empty directory, a link) is kept with
# what it is, a link with what it resolves to in the sandbox ("kinds"), and a narrowed mount's links
# must be those of the run, none added: GCC skips a dangling link or a directory of a header's name,
# and a file appearing where one leads (or a link added on its way) left every name and link text
# as it was (R13 dangling_link, dir_becomes_file).
ENTRY_VERSION = 8
Changed = list[tuple[str, str, str, FileEntry | None]]  # (mount, path, digest read, entry now)
Check = Callable[[Tree], str | None]  # given the earlier run's output tree: why it stands (None: it does not)


@dataclass(frozen=True)
class Discovery:
    """What the strategies share. `mounts`: input mounts narrowed to the files the depfiles name;
    `depfiles`: files of the output tree naming what the run read (a depfile of an action with no
    narrowed mount narrows nothing: it is described all the same); `record`: the output file where
    the gcc_macro_use plugin writes which -D/-U the run used (macro_use.py)."""

    mounts: tuple[str, ...] = ()
    depfiles: tuple[str, ...] = ()
    record: str = ""
    assembler: tuple[str, ...] = ()  # depfiles GNU as wrote (`--MD`): every .include and .incbin it read

    def __post_init__(self) -> None:
        object.__setattr__(self, "mounts", tuple(sorted(self.mounts)))  # as the key spells them

    @property
    def narrows(self) -> bool:
        """Whether the action is filed under a prekey's manifest: a mount narrowed, or -D/-U recorded."""
        return bool(self.mounts or self.record)

    def described(self) -> dict[str, Any]:
        """What joins the key: each field that is set."""
        fields = {"narrow": list(self.mounts), "depfiles": list(self.depfiles), "macro_record": self.record,
                  "assembler_depfiles": list(self.assembler)}
        return {k: v for k, v in fields.items() if v}

    def prekey_argv(self, argv: tuple[str, ...]) -> list[str]:
        """argv as the prekey has it: without the recorded -D/-U."""
        split = _split(tuple(argv)) if self.record else None
        return [*split[0], "(-D/-U left out: recorded per run)"] if split is not None else list(argv)

    def macro_ops(self, argv: tuple[str, ...]) -> dict[str, list[str]] | None:
        """The -D/-U arguments by name, where the prekey leaves them out; else None."""
        split = _split(tuple(argv)) if self.record else None
        return split[1] if split is not None else None

    def reads(self, files: Contents, action: Action, tree: Tree) -> dict[str, Any]:
        """The manifest entry of a finished run (the rebuilder adds its key): what it read in each
        narrowed mount (path -> digest), by its depfiles; a mount whose reads cannot be told (a
        depfile missing or naming nothing, a path through a symlink) recorded whole: {"*": tree
        digest}; the shadowing names; its -D/-U and the plugin's record, where recorded."""
        mounts = {m: action.input_tree(m) for m in self.mounts}
        reads: dict[str, dict[str, str]] = {m: {} for m in mounts}
        names: set[str] = set()
        whole: set[str] = set()
        read_paths: set[str] = set()
        for depfile, by_as in [*((d, False) for d in self.depfiles), *((d, True) for d in self.assembler)]:
            deps = files.depfile(tree, depfile, hash_escaped=not by_as)
            if not deps:  # missing, not a file, or naming no file: it proves nothing (depfile.py, point 5)
                whole.update(mounts)
                continue
            paths = [absolute(dep, action.cwd) for dep in deps]
            # Each path as the kernel resolved it in the sandbox: a spelling no mount's (`//x`,
            # /proc/self/root/..., a link made in /tmp, a link of another mount into a narrowed
            # one) read a file all the same (red team R10). A file of no input is either one this
            # run wrote (its output tree's, no link on the way) or a host path; anything else
            # (/proc, /tmp, a name no mount holds) cannot be told: the mounts are kept whole.
            resolved = [_resolved(action, dep if dep.startswith("/") else f"{action.cwd}/{dep}") for dep in deps]
            if by_as:
                # A name that leads to nothing in a mount, or plainly to the build directory or
                # /tmp, is a `.file` directive's (GCC writes the source's name as given) or a
                # temporary .s: read by nobody. Resolved first (R11: an `.incbin` through /proc,
                # or through a link and `..`, was dropped as no mount's).
                kept = [i for i, ((kind, real), dep) in enumerate(zip(resolved, deps)) if not (
                    kind == "absent" or kind == "outside" and ".." not in dep.split("/")
                    and real.startswith(("/tmp/", OUT_MOUNT + "/")))]
                deps, paths, resolved = [deps[i] for i in kept], [paths[i] for i in kept], [resolved[i] for i in kept]
            for (kind, real), path in zip(resolved, paths):
                names.update(_components(path))
                if kind == "file":
                    names.update(_components(real))
                elif not (kind in ("outside", "absent") and (_visible(action, real) or _made(tree, real))):
                    whole.update(mounts)
            paths = [real if kind == "file" else path for (kind, real), path in zip(resolved, paths)]
            # With every __has_include wrapper seen so far in this build (one more pass where these
            # files define a new one): extra wrappers only add names, never take one away.
            looked = [files.lookups(action, path, files.wrappers) for path in paths]
            new = frozenset(w for found in looked if found is not None for w in found.wrappers) - files.wrappers
            if new:
                files.wrappers |= new
                looked = [files.lookups(action, path, files.wrappers) for path in paths]
            for found in looked:  # what no depfile names: __has_include's names; else the mounts whole
                if found is None or found.opaque or (found.assembles and not self.assembler):
                    whole.update(mounts)
                else:
                    names.update(found.names)
            read_paths.update(paths)
            for dep, path in zip(deps, paths):
                for mount, mtree in mounts.items():
                    for root in _roots(action, mount):
                        if not path.startswith(root + "/"):
                            continue
                        rel = path[len(root) + 1:]
                        found = mtree.entries.get(rel)
                        if isinstance(found, FileEntry) and not _through_link(dep, action.cwd, root, mtree):
                            reads[mount][rel] = found.digest
                        elif root == mount or isinstance(found, FileEntry):
                            whole.add(mount)
        # GCC skips a header whose size, time and bytes equal those of a once-only header it read
        # before (`#pragma once`, `_Pragma("once")`, any file under `#import`), and no depfile
        # names the file skipped (R7 pragma_once_*): every file of a narrowed mount with the bytes
        # of a file the run read is taken as read too (in the sandbox every input has one time).
        # Kept apart from "reads": an edit to such a copy is never one the run did not look at
        # (unseen_edit), since GCC now reads the whole of it.
        read_digests = {d for r in reads.values() for d in r.values()} | {
            key for key in (files._locate(action, p)[0] for p in read_paths) if key and not key.startswith("/")}
        copies: dict[str, dict[str, str]] = {}
        for mount, mtree in mounts.items():
            if mount in whole:
                continue
            twins = _by_digest(mtree)
            root = _roots(action, mount)[0]
            for digest in read_digests & twins.keys():
                for rel in twins[digest]:
                    if rel not in reads[mount]:
                        copies.setdefault(mount, {})[rel] = digest
                        names.update(_components(f"{root}/{rel}"))
        # Whether each directory the command line (or CPATH) names for lookups is one: GCC warns
        # of one that is missing or a file (an error under -Werror), fails where a file lies on
        # its way, and reads nothing from it (R7, R8): kept by its path as given against the cwd
        # (never normalised: `lnk/../x` leaves where lnk leads), resolved in the sandbox.
        dirs = {path: _kind_at(action, path) for path in sorted(
            {named if named.startswith("/") else posixpath.join(action.cwd, named)
             for named in _include_dirs(action.argv, action.env)})}
        # Every link of each narrowed mount: a lookup that went through one to a file GCC then
        # skipped (a once-only copy) left no name of the link in the depfile (R8 mount_link_twin).
        links = {m: dict(_links(t)) for m, t in mounts.items() if m not in whole and _links(t)}
        kinds = {m: k for m, t in mounts.items() if m not in whole
                 for k in [_odd_kinds(action, m, t, names)] if k}
        for mount in whole:
            reads[mount] = {"*": mounts[mount].digest(files.digester)}
        indexes = {m: t.by_name() for m, t in mounts.items()}
        # Every name, held by the mount or not: an entry of that name that appears later (a file,
        # a directory, a link) may shadow what the run found elsewhere, in another mount too.
        # (The names a mount does not hold are kept apart, as one list: checked with one set
        # intersection, most of a TU's names being those of the toolkit's and the system's headers.)
        ordered = sorted(names)
        entry: dict[str, Any] = {"reads": reads, "names": {m: {n: list(index[n]) for n in ordered if n in index}
                                                           for m, index in indexes.items()},
                                 "absent": {m: [n for n in ordered if n not in index] for m, index in indexes.items()},
                                 "copies": copies, "dirs": dirs, "links": links, "kinds": kinds,
                                 "version": ENTRY_VERSION}
        ops = self.macro_ops(action.argv)
        if ops is not None:
            record = files.macro_record(tree, self.record)
            entry.update(macros=ops, record=record.to_json() if record else None)
        return entry

    def differences(self, files: Contents, action: Action, entry: dict[str, Any], limit: int | None = None
                    ) -> tuple[Changed, list[str]]:
        """(each file it read whose content is not what it read; every other reason the entry
        does not fit the action). Stops after `limit` of either."""
        changed: Changed = []
        other: list[str] = []
        if entry.get("reads") and entry.get("version") != ENTRY_VERSION:
            return changed, ["recorded by an older bgraph (names of absent files not kept)"]
        for mount, read in entry.get("reads", {}).items():
            tree = action.input_tree(mount) if mount in self.mounts else None
            if tree is None:
                return changed, [f"input {mount} is no longer narrowed"]
            if "*" in read:
                if read["*"] != tree.digest(files.digester):
                    other.append(f"input {mount} {short(read['*'])} -> {short(tree.digest(files.digester))}")
                continue
            if read.items() <= tree.file_digests().items():
                continue  # every file it read is unchanged (one set comparison, in C)
            for path, digest in read.items():
                now = tree.entries.get(path)
                if not isinstance(now, FileEntry) or now.digest != digest:
                    changed.append((mount, path, digest, now if isinstance(now, FileEntry) else None))
                    if limit and len(changed) >= limit:
                        return changed, other
        other.extend(self.macro_fit(action, entry)[1])
        for mount, recorded in entry.get("names", {}).items():
            index = action.input_tree(mount).by_name() if mount in self.mounts else {}
            for name, paths in recorded.items():
                now = list(index.get(name, ()))
                if now != paths:
                    added = sorted(set(now) - set(paths))
                    other.append(f"new file {mount}/{added[0]} may shadow an included {name}" if added
                                 else f"{name} removed from {mount}: {', '.join(sorted(set(paths) - set(now)))}")
                    if limit and len(changed) + len(other) >= limit:
                        return changed, other
        for mount, recorded_copies in entry.get("copies", {}).items():
            tree = action.input_tree(mount) if mount in self.mounts else None
            digests = tree.file_digests() if tree is not None else {}
            for rel, digest in recorded_copies.items():
                if digests.get(rel) != digest:
                    other.append(f"{mount}/{rel} (the bytes of a header the run read, which GCC skipped) changed")
                    if limit and len(changed) + len(other) >= limit:
                        return changed, other
        for path, kind in entry.get("dirs", {}).items():
            now = _kind_at(action, path)
            if now != kind:
                other.append(f"include directory {path} was {kind}, is {now}")
                if limit and len(changed) + len(other) >= limit:
                    return changed, other
        for mount, read in entry.get("reads", {}).items():
            if "*" in read:
                continue  # taken whole: its digest was compared
            recorded_links, now_links = entry.get("links", {}).get(mount, {}), _links(action.input_tree(mount))
            if recorded_links != now_links:  # one added may change where another leads (R13 dirlink)
                moved = sorted(p for p in recorded_links.keys() | now_links.keys()
                               if recorded_links.get(p) != now_links.get(p))
                other.append(f"link {mount}/{moved[0]} " + ("changed" if moved[0] in recorded_links else "added"))
                if limit and len(changed) + len(other) >= limit:
                    return changed, other
        for mount, recorded in entry.get("names", {}).items():
            if mount not in self.mounts or "*" in entry["reads"].get(mount, {}):
                continue
            now_kinds = _odd_kinds(action, mount, action.input_tree(mount), recorded)
            was = entry.get("kinds", {}).get(mount, {})
            if now_kinds != was:
                path = sorted(p for p in now_kinds.keys() | was.keys() if now_kinds.get(p) != was.get(p))[0]
                other.append(f"{mount}/{path} was {was.get(path, 'a file')}, is {now_kinds.get(path, 'a file')}")
                if limit and len(changed) + len(other) >= limit:
                    return changed, other
        for mount, absent in entry.get("absent", {}).items():
            index = action.input_tree(mount).by_name() if mount in self.mounts else {}
            for name in sorted(index.keys() & set(absent)):
                other.append(f"new file {mount}/{index[name][0]} may shadow an included {name}")
                if limit and len(changed) + len(other) >= limit:
                    return changed, other
        return changed, other

    def macro_fit(self, action: Action, entry: dict[str, Any]) -> tuple[list[str], list[str]]:
        """macro_use.compare of the entry's run and this action: (differing names it never used,
        why it cannot stand for this action); both empty where neither records macros."""
        ops = self.macro_ops(action.argv)
        if ops is None and "macros" not in entry:
            return [], []
        return macro_use.compare(entry.get("macros", {}), ops or {}, macro_use.Record.from_json(entry.get("record")))

    def unseen_edit(self, files: Contents, action: Action, entry: dict[str, Any]) -> Check | None:
        """Where files the entry's run read changed, whether that run may stand all the same: None
        if not (this strategy never allows it); else a check of that run's output tree, which
        says why it may (None: it may not)."""
        return None


@dataclass(frozen=True)
class Depfile(Discovery):
    """An imported compile narrowed by its depfile. Sound where the depfile names every file of the
    narrowed mounts the run could read: the contract of depfile.py (one simple command, a GCC
    driver outside the narrowed mounts, allowlisted flags, -MD, one -MF in the build directory, GNU
    as's own depfile in `assembler` for what inline asm reads, no precompiled header). Allowed only for a command `depfile.complete_compile` accepted, with no
    precompiled header in its inputs (rules/ninja_import.py); never with a macro record."""


@dataclass(frozen=True)
class Preprocessed(Discovery):
    """bgraph's own GCC preprocessing (nvcc_compile.compile_tu: nvcc's host and per-arch `gcc -E`,
    with the `-MD -MF` it appends, whose depfile names every file the preprocessor opened). Also:
    files read that changed only in #if groups this command line's macros skip leave its output
    the same (cpp_view.py), unless a file it read redefines those macros. With `record`, the
    step runs the gcc_macro_use plugin (macro_use.py's contract: the pinned GCC with the plugin,
    a command line macro_use.split accepts). Allowed only for those steps."""

    def unseen_edit(self, files: Contents, action: Action, entry: dict[str, Any]) -> Check | None:
        changed, other = self.differences(files, action, entry)
        if other or not changed or any(now is None for *_, now in changed):
            return None
        command = command_macros(action.argv)
        pairs = [(digest, now) for _m, _p, digest, now in changed]
        # First with every command-line macro taken as known (no file read): views that differ
        # then differ with fewer known macros too, and most edits stop here.
        if command is None or not files.same_views(pairs, command):
            return None

        def check(tree: Tree) -> str | None:
            macros = self._run_macros(files, action, tree, command, pairs)
            if macros is None or not files.same_views(pairs, macros):
                return None
            paths = ", ".join(f"{m}/{p}".removeprefix("/bgraph/") for m, p, _d, _n in changed[:3])
            return f"{paths} changed only in #if groups skipped with {macros.describe()}"
        return check

    def _run_macros(self, files: Contents, action: Action, tree: Tree, command: Macros,
                    pairs: list[tuple[str, FileEntry]]) -> Macros | None:
        """The command line's macros, less any that a file the earlier run read (as it read it,
        or as it is now; its depfiles name the toolchain's headers too) defines or undefines;
        None if a file it read cannot be found."""
        names: set[str] = set()
        for before, now in pairs:
            for found in (files.defined(before), files.defined(now.digest, now)):
                if found is None:
                    return None
                names |= found
        for depfile in self.depfiles:
            deps = files.depfile(tree, depfile)
            if deps is None:
                return None
            for dep in deps:
                found = files.defined_in(action, absolute(dep, action.cwd))
                if found is None:
                    return None
                names |= found
        return command.without(names)


@dataclass(frozen=True)
class RecordedMacros(Discovery):
    """A GCC step of bgraph's own run with the gcc_macro_use plugin and no narrowed mount (nvcc's
    host compile): it fits a command line differing only in -D/-U of __CUDA_ARCH names the run
    never used (macro_use.py's contract). Allowed only for compile_tu's gcc steps."""
