"""Command-line macros a GCC run did not depend on (pure: argv and text in, answers out).

Adding an arch changes `-D__CUDA_ARCH_LIST__` on every nvcc preprocessing step and host compile,
though most never read it. Those steps load the `gcc_macro_use` plugin
(toolchains/gcc_macro_use.cc), which writes down which -D/-U names the run used (expanded,
tested, or changed again) and which identifiers starting with WATCH it met at all. Their
manifests (rebuilder.py) are filed under a prekey whose argv leaves out the -D/-U of WATCH names
(the arch macros nvcc writes, with plain values; every other -D stays in the prekey);
each entry keeps the run's -D/-U arguments and that record, and fits a command line that differs
only in macros the run provably never consulted:
- a name the run had defined (-DN or -DN=V) and never used may take any value, or go: no step
  of that run looked at it, so the same steps follow from any definition;
- a name the run did not define may be added only if it starts with WATCH and the run never met
  the identifier (not in a file, not pasted together): only then can no line have expanded it.
  (An undefined name in running text or in `#if` is not reported by libcpp, so without that
  record an added name is a change.)
A name given twice, or given beside a predefined macro, counts as used (GCC warns about it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

PLUGIN = "bgraph/gcc_macro_use.so"  # where a cuda_toolchain's tree holds the plugin
WATCH = "__CUDA_ARCH"  # the per-arch macros nvcc gives: __CUDA_ARCH__, _LIST__, _FEAT_SM<N>_ALL, ...
_NAME = "gcc_macro_use"  # the plugin file's base name: its -fplugin-arg- prefix (no dashes: GCC splits there)

_OP = re.compile(r"-[DU]([A-Za-z_][A-Za-z0-9_]*)(?:=(.*))?\Z", re.S)
# What nvcc writes as an arch macro's value: digits and commas. Another value (`/*`, `##x`) could
# make GCC fail as it defines the macro, used or not: that command line is matched exactly.
_PLAIN_VALUE = re.compile(r"[0-9A-Za-z_,.]*\Z")
# Options that take macros from elsewhere, write their values out, or run the preprocessor apart
# from the compile (a second cc1 run would overwrite the record): the command line is then
# matched exactly.
_REFUSE_EXACT = frozenset({"-D", "-U", "-Xpreprocessor", "-fdirectives-only", "-traditional", "-traditional-cpp",
                           "-fpch-preprocess", "-no-integrated-cpp", "-fpreprocessed"})
_REFUSE_PREFIX = ("@", "-Wp,", "--define-macro", "--undefine-macro", "-save-temps", "--save-temps")
_DUMP = re.compile(r"-d(?!ump)[A-Za-z]+\Z")  # -dM, -dD, -dN, -dU, -dI and letter runs like -dMI


def plugin_args(plugin: str, record: str) -> list[str]:
    """The GCC options that load the plugin and have it write its record to `record`."""
    return [f"-fplugin={plugin}", f"-fplugin-arg-{_NAME}-out={record}", f"-fplugin-arg-{_NAME}-watch={WATCH}"]


def split(argv: tuple[str, ...] | list[str]) -> tuple[list[str], dict[str, list[str]]] | None:
    """(argv without its -D/-U of WATCH names, name -> those arguments in order), or None where
    the command line may define macros another way or write their values out (matched exactly).
    Other -D/-U stay in argv: their values may be anything, and a user's define is usually read."""
    rest: list[str] = []
    ops: dict[str, list[str]] = {}
    for arg in argv:
        if (arg in _REFUSE_EXACT or arg.startswith(_REFUSE_PREFIX) or _DUMP.match(arg)
                or (arg.startswith("-g") and arg.endswith("3"))):
            return None
        m = _OP.match(arg)
        if m and m.group(1).startswith(WATCH):
            if not _PLAIN_VALUE.match(m.group(2) or ""):
                return None
            ops.setdefault(m.group(1), []).append(arg)
        elif arg.startswith(("-D", "-U")) and not m:
            return None  # a function-like -DF(x)=..., or a name GCC would reject
        else:
            rest.append(arg)
    return rest, ops


@dataclass(frozen=True)
class Record:
    """What one run's plugin wrote: the -D/-U names it used, the WATCH identifiers it met."""

    used: frozenset[str]
    seen: frozenset[str]
    watch: str

    def to_json(self) -> dict:
        return {"used": sorted(self.used), "seen": sorted(self.seen), "watch": self.watch}

    @classmethod
    def from_json(cls, data: dict | None) -> "Record | None":
        if not isinstance(data, dict):
            return None
        return cls(frozenset(data.get("used", ())), frozenset(data.get("seen", ())), str(data.get("watch", "")))


def parse_record(text: str) -> Record | None:
    """The plugin's file, or None if it is not a complete record (the plugin lost a callback)."""
    lines = text.splitlines()
    if not lines or lines[0] != "bgraph-macro-use 1":
        return None
    used, seen, watch, complete = set(), set(), "", False
    for line in lines[1:]:
        word, _, name = line.partition(" ")
        if word == "watch":
            watch, complete = name, True
        elif word == "used" and name:
            used.add(name)
        elif word == "seen" and name:
            seen.add(name)
        else:
            return None  # "incomplete", or a line this reader does not know
    return Record(frozenset(used), frozenset(seen), watch) if complete else None


def compare(before: dict[str, list[str]], now: dict[str, list[str]], record: Record | None
            ) -> tuple[list[str], list[str]]:
    """(names whose -D/-U differ and which the recorded run shows it never depended on, why the
    run cannot stand for `now`: one reason per other differing name)."""
    unused: list[str] = []
    blocking: list[str] = []
    for name in sorted(set(before) | set(now)):
        was, is_ = list(before.get(name, ())), list(now.get(name, ()))
        if was == is_:
            continue
        change = f"{' '.join(was) or f'no -D{name}'} -> {' '.join(is_) or f'no -D{name}'}"
        if record is None:
            blocking.append(f"{change} (no record of the macros that run used)")
        elif len(was) > 1 or len(is_) > 1:
            blocking.append(f"{change} (given more than once)")
        elif was and was[0].startswith("-D"):
            if name in record.used:
                blocking.append(f"{change} (that run used {name})")
            else:
                unused.append(name)
        elif record.watch and name.startswith(record.watch) and name not in record.seen and name not in record.used:
            unused.append(name)
        else:
            blocking.append(f"{change} (that run had it undefined and may have met it)")
    return unused, blocking
