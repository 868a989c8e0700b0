"""What a C preprocessor run cannot see of a file: the conditional groups that the command
line's macros provably skip.

An edit inside `#if __CUDA_ARCH__ == 1210 … #endif` changes the header's digest, but not what
`gcc -E -D__CUDA_ARCH__=1200` (nor the host pass, where `__CUDA_ARCH__` is undefined) makes of
it: the preprocessor writes a skipped line as an empty line. `view(data, macros)` is the file
with the lines of every group such a run skips made empty (the directives that open and close
groups kept, the line count kept). Two versions of a file with equal views give the same
preprocessed output, the same depfile and so the same compile; the rebuilder then takes the
earlier result (rebuilder.py, `incremental/discovery.Preprocessed`).

A group is skipped only when that is certain: its condition is built from integers, `defined`
and macros whose values the command line fixes (`-D`, `-U`; a `__CUDA_ARCH*` name it does not
mention is undefined: no compiler predefines one), and no file the run read redefines those
macros (`defined_names`). Anything this module does not model makes it answer None ("cannot
tell"), which the rebuilder treats as a change:
- an identifier of unknown value anywhere in a condition (it could expand to any tokens);
- raw strings, trigraphs, digraphs, digit separators, carriage returns, a byte-order mark;
- a line that starts inside a block comment and has more on it than the comment's end, and a
  directive whose block comment runs on past its line;
- a NUL byte (GCC reads it as a blank: `#<NUL>endif` is a directive), an integer literal above
  INT64_MAX (unsigned in GCC), a `__has_include(<…>)` whose name holds a quote or a comment;
- a `#include <…/*…>` (GCC lexes it differently in skipped groups);
- unbalanced conditionals, or a redefinition, anywhere in the file, of a macro it relies on.
Skipped text is lexed as GCC lexes it (comments, literals that end at the line's end) so that
the groups found are GCC's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable

# A name of this prefix is undefined unless the command line defines it: GCC and Clang predefine
# none (nvcc passes __CUDA_ARCH__ and its relatives as -D to each preprocessing step).
NEVER_PREDEFINED = "__CUDA_ARCH"

_UNDEFINED = object()  # lookup(): known to be undefined

# Options after which the preprocessor's macros or lexing are not what argv's -D/-U say.
_UNMODELLED_OPTIONS = ("-traditional", "-traditional-cpp", "-trigraphs", "-imacros", "-Xpreprocessor",
                       "--define-macro", "--undefine-macro", "-undef", "-fext-numeric-literals")
_UNMODELLED_PREFIXES = ("-Wp,", "@", "--define-macro=", "--undefine-macro=", "-std=c89", "-std=c90",
                        "-std=gnu89", "-std=gnu90", "-std=iso9899", "-ansi")

# Between `#` and `define NAME`: blanks, block comments (line splices are removed first).
_GAP = rb"(?:[ \t\f\v]|/\*(?:[^*]|\*+[^*/])*\*+/)"
_DEFINES = re.compile(rb"(?:#|%:)" + _GAP + rb"*(?:define|undef)" + _GAP + rb"+([A-Za-z_][A-Za-z0-9_$]*)")
_SPLICE = re.compile(rb"\\[ \t\f\v]*\n")
_TRIGRAPH = re.compile(rb"\?\?[=(/)'<!>-]")
_RAW_STRING = re.compile(rb"(?:^|[^A-Za-z0-9_$])(?:u8|[uUL])?R\"")
_ANGLED_COMMENT = re.compile(rb"(?:#|%:)[ \t]*(?:include|include_next|import)[ \t]*<[^>\n]*/[*/]")
# `__has_include(<x".h>) /*`: GCC reads `<…>` as a header name, so a quote in it opens nothing
# and the `/*` after it opens a comment; the lexer here would read a string.
_ANGLED_HAS_INCLUDE = re.compile(rb"__has_include(?:_next)?[ \t]*\([ \t]*<[^>\n]*(?:[\"']|/[*/])")
_CONDITIONAL = {"if", "ifdef", "ifndef", "elif", "elifdef", "elifndef", "else", "endif"}
_INT = re.compile(r"(0[xX][0-9a-fA-F]+|0[0-7]*|[1-9][0-9]*)[lL]{0,2}$")
_EXPR_TOKEN = re.compile(r"\s*(?:(\d[\w.]*)|([A-Za-z_$][\w$]*)|(&&|\|\||==|!=|<=|>=|<<|>>|[-+*/%<>!()~&|^?:,])|(\S))")
_INT64 = range(-(1 << 63), 1 << 63)


@dataclass(frozen=True)
class Macros:
    """Macros a preprocessing run is known to see throughout: name -> integer value, and names
    known to be undefined (besides the NEVER_PREDEFINED ones the command line leaves alone)."""

    values: dict[str, int] = field(default_factory=dict)
    undefined: frozenset[str] = frozenset()
    mentioned: frozenset[str] = frozenset()  # every name the command line defines or undefines
    unknown: frozenset[str] = frozenset()    # defined or undefined by a file the run read

    def lookup(self, name: str):
        """The macro's integer value, _UNDEFINED, or None when it is not known."""
        if name in self.unknown:
            return None
        if name in self.values:
            return self.values[name]
        if name in self.undefined or (name.startswith(NEVER_PREDEFINED) and name not in self.mentioned):
            return _UNDEFINED
        return None

    def identity(self) -> tuple:
        """A hashable form (for memos)."""
        return tuple(sorted(self.values.items())), self.undefined, self.mentioned, self.unknown

    def without(self, names: Iterable[str]) -> Macros:
        """These macros, less what a file of the run redefines (its value is then not known)."""
        return Macros(self.values, self.undefined, self.mentioned, self.unknown | frozenset(names))

    def describe(self) -> str:
        """What decided, for a person: `__CUDA_ARCH__=1200`, or that it is undefined."""
        arch = self.lookup("__CUDA_ARCH__")
        if arch is None:
            return "the command line's macros"
        return "__CUDA_ARCH__ undefined" if arch is _UNDEFINED else f"__CUDA_ARCH__={arch}"


def command_macros(argv: Iterable[str]) -> Macros | None:
    """The macros `argv` (a GCC-compatible preprocessing command) fixes, or None when it uses an
    option this module does not model."""
    values: dict[str, int] = {}
    undefined: set[str] = set()
    mentioned: set[str] = set()
    args = list(argv)
    i = 0
    while i < len(args):
        a = args[i]
        if a in _UNMODELLED_OPTIONS or a.startswith(_UNMODELLED_PREFIXES) or (a == "-x" and i + 1 < len(args)
                                                                                and "assembler" in args[i + 1]):
            return None
        if a in ("-D", "-U"):
            if i + 1 >= len(args):
                return None
            a, i = a + args[i + 1], i + 1
        if a.startswith(("-D", "-U")):
            name, eq, value = a[2:].partition("=")
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) or (a.startswith("-U") and eq):
                if "(" in name and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name.split("(")[0]):
                    # A function-like macro: its name is defined (`#ifdef` sees it), its value never known.
                    name = name.split("(")[0]
                    mentioned.add(name)
                    values.pop(name, None)
                    undefined.discard(name)
                    i += 1
                    continue
                return None
            mentioned.add(name)
            values.pop(name, None)
            undefined.discard(name)
            if a.startswith("-U"):
                undefined.add(name)
            else:
                number = _integer(value if eq else "1")
                if number is not None:
                    values[name] = number
        i += 1
    return Macros(values, frozenset(undefined), frozenset(mentioned))


def _integer(text: str) -> int | None:
    """A -D value that is one integer literal (the macro's expansion in #if), else None."""
    m = _INT.match(text.strip())
    if not m:
        return None
    digits = m.group(1)
    number = int(digits, 16) if digits[:2] in ("0x", "0X") else int(digits, 8 if digits[0] == "0" else 10)
    return number if number in _INT64 else None  # above INT64_MAX the literal is unsigned: not modelled


def defined_names(data: bytes) -> frozenset[str]:
    """Every macro name `data` may #define or #undef (a superset: text in comments and strings
    counts too)."""
    if b"\\" in data:
        data = _SPLICE.sub(b"", data)  # a splice may split the directive's name
    if b"define" not in data and b"undef" not in data:
        return frozenset()
    return frozenset(m.group(1).decode("latin-1") for m in _DEFINES.finditer(data))


def view(data: bytes, macros: Macros) -> bytes | None:
    """`data` with the lines of every conditional group a run with `macros` skips made empty
    (same line count), or None when that cannot be told soundly."""
    if (b"\r" in data or b"\0" in data or data.startswith(b"\xef\xbb\xbf") or b"%:" in data
            or _TRIGRAPH.search(data) or _RAW_STRING.search(data) or _ANGLED_COMMENT.search(data)
            or _ANGLED_HAS_INCLUDE.search(data)):
        return None
    if any(macros.lookup(n) is not None for n in defined_names(data)):
        return None  # the file changes a macro its groups would be judged by
    lines = data.decode("latin-1").split("\n")
    out = list(lines)
    stack: list[_Frame] = []
    in_comment = False
    i = 0
    while i < len(lines):
        first, text = i, lines[i]
        while _continues(lines[i]):
            i += 1
            if i == len(lines):
                return None  # a splice at the end of the file
            text = text.rstrip(" \t\f\v")[:-1] + lines[i]
        lexed = _lex(text, in_comment)
        if lexed is None:
            return None
        code, started_in_comment, in_comment = lexed
        skipping = bool(stack) and stack[-1].skip
        stripped = code.lstrip(" \t\f\v")
        if stripped.startswith("#"):
            if started_in_comment or in_comment:
                # `*/ #if`, or a directive whose block comment runs on into the next line (GCC
                # reads what follows the comment's end there as part of the directive).
                return None
            m = re.match(r"#[ \t\f\v]*([A-Za-z_]\w*|\d*)(.*)", stripped, re.S)
            name, rest = m.group(1), m.group(2)
            if name in _CONDITIONAL:
                if not _conditional(stack, name, rest, macros, skipping):
                    return None
                i += 1
                continue
        if skipping:
            for k in range(first, i + 1):
                out[k] = ""
        i += 1
    if stack or in_comment:
        return None
    return "\n".join(out).encode("latin-1")


@dataclass
class _Frame:
    parent_skip: bool
    skip: bool
    taken: bool | None  # whether an earlier group of this #if was taken (None: not known)
    seen_else: bool = False


def _conditional(stack: list[_Frame], name: str, rest: str, macros: Macros, skipping: bool) -> bool:
    """Apply one conditional directive to the group stack; False when the nesting is broken."""
    if name in ("if", "ifdef", "ifndef"):
        if skipping:
            stack.append(_Frame(True, True, True))
            return True
        v = _condition(name, rest, macros)
        stack.append(_Frame(False, v is False, None if v is None else v))
        return True
    if not stack:
        return False
    if name == "endif":
        stack.pop()
        return True
    frame = stack[-1]
    if frame.seen_else:
        return False  # #elif or #else after #else
    if frame.parent_skip:
        frame.seen_else = name == "else"
        return True
    if name == "else":
        frame.seen_else, frame.skip = True, frame.taken is True
        return True
    # elif, elifdef, elifndef
    if frame.taken is True:
        frame.skip = True
        return True
    v = _condition(name.replace("el", "", 1), rest, macros)
    frame.skip = v is False
    frame.taken = True if v is True else (None if v is None or frame.taken is None else False)
    return True


def _condition(name: str, rest: str, macros: Macros) -> bool | None:
    """The truth of `#if rest` / `#ifdef rest` / `#ifndef rest`, or None when not known."""
    if name in ("ifdef", "ifndef"):
        m = re.match(r"\s*([A-Za-z_]\w*)", rest)
        if not m:
            return None
        value = macros.lookup(m.group(1))
        if value is None:
            return None
        return (value is not _UNDEFINED) == (name == "ifdef")
    result = _Expression(rest, macros).value()
    return None if result is None else result != 0


class _Expression:
    """A `#if` expression over integers, `defined` and known macros, in three-valued logic
    (None: not known). An identifier of unknown value makes the whole expression unknown: it
    could be a macro expanding to any tokens at all."""

    def __init__(self, text: str, macros: Macros):
        self.tokens: list[str] = []
        self.ok = True
        for m in _EXPR_TOKEN.finditer(text):
            if m.group(4):
                self.ok = False
            self.tokens.append(m.group(m.lastindex))
        self.macros = macros
        self.pos = 0

    def value(self) -> int | None:
        if not self.ok or not self.tokens:
            return None
        try:
            v = self._binary(0)
        except _Unknown:
            return None
        return v if self.pos == len(self.tokens) else None

    _LEVELS = [("||",), ("&&",), ("|",), ("^",), ("&",), ("==", "!="), ("<", ">", "<=", ">="), ("<<", ">>"),
               ("+", "-"), ("*", "/", "%")]

    def _peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def _take(self) -> str:
        if self.pos >= len(self.tokens):
            raise _Unknown
        self.pos += 1
        return self.tokens[self.pos - 1]

    def _binary(self, level: int) -> int | None:
        if level == len(self._LEVELS):
            return self._unary()
        left = self._binary(level + 1)
        while self._peek() in self._LEVELS[level]:
            op = self._take()
            right = self._binary(level + 1)
            left = _apply(op, left, right)
        if self._peek() in ("?", ":", ","):
            raise _Unknown
        return left

    def _unary(self) -> int | None:
        t = self._take()
        if t in ("!", "~", "-", "+"):
            v = self._unary()
            if v is None:
                return None
            return {"!": lambda: int(v == 0), "~": lambda: ~v, "-": lambda: -v, "+": lambda: v}[t]()
        if t == "(":
            v = self._binary(0)
            if self._take() != ")":
                raise _Unknown
            return v
        if t == "defined":
            paren = self._peek() == "("
            if paren:
                self._take()
            name = self._take()
            if paren and self._take() != ")":
                raise _Unknown
            if not re.fullmatch(r"[A-Za-z_]\w*", name):
                raise _Unknown
            value = self.macros.lookup(name)
            return None if value is None else int(value is not _UNDEFINED)
        if t[0].isdigit():
            number = _integer(t)
            if number is None:
                raise _Unknown  # a float, a u suffix (unsigned arithmetic), a malformed number
            return number
        if re.fullmatch(r"[A-Za-z_$][\w$]*", t):
            value = self.macros.lookup(t)
            if value is None:
                raise _Unknown
            return 0 if value is _UNDEFINED else value
        raise _Unknown


class _Unknown(Exception):
    pass


def _apply(op: str, a: int | None, b: int | None) -> int | None:
    if op == "&&":
        return 0 if (a == 0 or b == 0) else (None if a is None or b is None else 1)
    if op == "||":
        return 1 if (a not in (0, None) or b not in (0, None)) else (None if a is None or b is None else 0)
    if a is None or b is None:
        return None
    if op in ("/", "%"):
        if b == 0:
            raise _Unknown
        q = abs(a) // abs(b) * (1 if (a >= 0) == (b >= 0) else -1)  # C truncates toward zero
        return q if op == "/" else a - q * b
    if op in ("<<", ">>") and not 0 <= b < 64:
        raise _Unknown
    result = _OPERATORS[op](a, b)
    if result not in _INT64:
        raise _Unknown  # C would overflow or wrap: not modelled
    return result


_OPERATORS = {"|": lambda a, b: a | b, "^": lambda a, b: a ^ b, "&": lambda a, b: a & b,
              "==": lambda a, b: int(a == b), "!=": lambda a, b: int(a != b), "<": lambda a, b: int(a < b),
              ">": lambda a, b: int(a > b), "<=": lambda a, b: int(a <= b), ">=": lambda a, b: int(a >= b),
              "+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b,
              "<<": lambda a, b: a << b, ">>": lambda a, b: a >> b}


def _continues(line: str) -> bool:
    """Whether a physical line ends in a line splice (GCC allows blanks after the backslash)."""
    return line.rstrip(" \t\f\v").endswith("\\")


def _lex(text: str, in_comment: bool) -> tuple[str, bool, bool] | None:
    """One logical line as GCC's lexer splits it: (its code with comments blanked, whether it
    started inside a block comment, whether it ends inside one); None for what is not modelled
    (a digit separator)."""
    if not in_comment and "/" not in text and '"' not in text and "'" not in text:
        return text, False, False  # nothing that could start a comment or a literal
    started = in_comment
    code: list[str] = []
    i, n = 0, len(text)
    while i < n:
        if in_comment:
            end = text.find("*/", i)
            if end < 0:
                return "".join(code), started, True
            code.append(" ")
            i, in_comment = end + 2, False
            if started and text[i:].strip(" \t\f\v"):
                if text[i:].lstrip(" \t\f\v").startswith("#"):
                    return "".join(code) + text[i:].lstrip(" \t\f\v"), True, False  # caller refuses it
            continue
        c = text[i]
        if c == "/" and text.startswith("/*", i):
            in_comment, i = True, i + 2
            continue
        if c == "/" and text.startswith("//", i):
            return "".join(code), started, False
        if c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            # Unterminated: GCC takes the rest of the line as one token (CPP_OTHER).
            code.append(text[i:j + 1])
            i = j + 1
            continue
        if c.isdigit() or (c == "." and i + 1 < n and text[i + 1].isdigit()):
            j = i + 1
            while j < n and (text[j].isalnum() or text[j] in "_.$'" or
                             (text[j] in "+-" and text[j - 1] in "eEpP")):
                if text[j] == "'":
                    return None  # a digit separator (C++14): not modelled
                j += 1
            code.append(text[i:j])
            i = j
            continue
        if c.isalpha() or c in "_$":
            j = i + 1
            while j < n and (text[j].isalnum() or text[j] in "_$"):
                j += 1
            code.append(text[i:j])  # an encoding prefix (u8, L) is an identifier, then a literal
            i = j
            continue
        code.append(c)
        i += 1
    return "".join(code), started, in_comment
