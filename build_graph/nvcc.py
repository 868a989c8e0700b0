"""Turn `nvcc --dryrun` output into per-step, per-arch actions (pure text processing).

nvcc runs: host `gcc -E` -> cudafe++ (host .cudafe1.cpp + module id); per arch: `gcc -E
-D__CUDA_ARCH__=…` -> cicc (PTX + stub) -> ptxas (cubin); fatbinary; host `gcc -c`. Keying
each step on its own inputs (preprocessed text, PTX, cubins) gives per-arch early cutoff.
Temp names (`/tmp/tmpxft_<pid>_…-N_k.ext`) are renamed to `k.ext`: no PID, no host path.
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass, field

_TMP = re.compile(r"(?:/tmp/)?tmpxft_[0-9a-f]+_[0-9a-f]+-\d+_")
_ENV = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$")
# A word of plain characters and double-quoted runs (no backslash, no single quote inside).
_WORD = re.compile(r'(?:[^ \t\r\n"\'\\]+|"[^"\\]*")+')

# A file name nvcc's steps pass between them (no directory part), as a whole token of an
# argument: at its start or after '=', up to '=', ',', a space or the end.
_NAME_IN_ARG = re.compile(r"(?:^|(?<==))([^/\s=,]+\.(?:ii|cpp|c|gpu|ptx|cubin|module_id|fatbin|fatbin\.c|stub\.c))"
                          r"(?=[=,\s]|$)")
ENV_KEEP = ("CICC_PATH", "NVVMIR_LIBRARY_DIR", "LD_LIBRARY_PATH", "PATH")
_PER_ARCH = re.compile(r"^(?P<stem>.+?)\.(?P<ext>cpp1\.ii|ptx|cubin|cudafe1\.(?:c|gpu|stub\.c))$")
_HOST_FILE = re.compile(r"^(?P<stem>.+?)(?:\.compute_\w+)?\.cudafe1\.cpp$")


def split_command(line: str) -> list[str]:
    """shlex.split(line), fast for what nvcc --dryrun prints: without a backslash or a single
    quote, POSIX shell words are runs of plain characters and "..." parts taken literally.
    Anything else goes to shlex. (shlex, in pure Python, was a quarter of a no-op vLLM build.)"""
    if "\\" in line or "'" in line or line.count('"') % 2:
        return shlex.split(line)  # escapes, single quotes, or an unbalanced quote shlex names
    return [w.replace('"', "") for w in _WORD.findall(line)]


def _canonical(name: str, single_arch: str | None) -> str:
    """With one arch nvcc drops the `compute_XX.` infix; put it back so adding a second arch
    leaves the first arch's steps (and keys) unchanged."""
    host = _HOST_FILE.match(name)
    if host:
        # nvcc names the host file after the last arch; a fixed name keeps cudafe++'s key
        # (and its output) the same when an arch is added.
        return f"{host.group('stem')}.cudafe1.cpp"
    m = _PER_ARCH.match(name)
    if single_arch and m and ".compute_" not in name:
        return f"{m.group('stem')}.compute_{single_arch}.{m.group('ext')}"
    return name


class DryrunError(ValueError):
    pass


@dataclass
class Step:
    """One nvcc internal step with its argv rewritten to fixed sandbox paths."""

    kind: str  # hostpp | cudafe | devpp | cicc | ptxas | hostcc | fatbin (and the TU's object)
    arch: str | None
    argv: list[str]
    inputs: list[str] = field(default_factory=list)   # intermediate names read from /bgraph/in
    outputs: list[str] = field(default_factory=list)  # intermediate names written to /bgraph/out
    reads_source: bool = False
    aliases: dict[str, str] = field(default_factory=dict)  # input name -> produced file it shows (also needed)
    paths: dict[str, str] = field(default_factory=dict)  # output name -> file under /bgraph/out, where they differ

    def output_path(self, name: str) -> str:
        return self.paths.get(name, name)

    def needs(self) -> list[str]:
        """Every produced file this step waits for."""
        return self.inputs + list(self.aliases.values())


def _classify(argv: list[str]) -> tuple[str, str | None]:
    tool = os.path.basename(argv[0])
    if tool in ("gcc", "g++", "cc", "c++") or tool.endswith(("-gcc", "-g++")):
        arch = next((a.split("=", 1)[1] for a in argv if a.startswith("-D__CUDA_ARCH__=")), None)
        if "-E" in argv:
            return ("devpp" if arch else "hostpp"), arch
        if "-c" in argv:
            return "hostcc", None
    if tool == "cudafe++":
        return "cudafe", None
    if tool == "cicc":
        return "cicc", argv[argv.index("-arch") + 1].replace("compute_", "")
    if tool == "ptxas":
        return "ptxas", next(a.split("=", 1)[1] for a in argv if a.startswith("-arch=")).replace("sm_", "")
    if tool == "fatbinary":
        return "fatbin", None
    raise DryrunError(f"unsupported nvcc step {tool!r} (only whole-program -c compiles are decomposed)")


def _declared_outputs(kind: str, argv: list[str]) -> set[str]:
    """Which names a step really writes (nvcc passes some names only to be embedded)."""
    out = set()
    for i, a in enumerate(argv[:-1]):
        nxt = argv[i + 1]
        if a == "-o":
            out.add(nxt)
        elif kind == "cudafe" and a == "--gen_c_file_name":
            out.add(nxt)
        elif kind == "cudafe" and a == "--module_id_file_name" and "--gen_module_id_file" in argv:
            out.add(nxt)
        elif kind == "cicc" and a == "--stub_file_name":
            out.add(nxt)
    for a in argv:
        if a.startswith("--embedded-fatbin="):
            out.add(a.split("=", 1)[1])
    return out


def _names_in(arg: str) -> list[tuple[int, int]]:
    """Spans of intermediate file names inside one argument (bare, after '=' or ',file=')."""
    if "." not in arg:
        return []
    return [m.span(1) for m in _NAME_IN_ARG.finditer(arg)]


def _rename(arg: str, fn) -> str:
    for start, end in reversed(_names_in(arg)):
        arg = arg[:start] + fn(arg[start:end]) + arg[end:]
    return arg


# The host object would #include the fatbinary (via the stub), so every device change would
# recompile it. Instead the host compile sees a stand-in that declares the fatbin wrapper as an
# extern symbol (written by the shell's printf, no process; the sandbox's /tmp holds nothing
# else), and fatbinary's step defines that symbol and joins the TU's object (_FATBIN_SCRIPT).
_HOSTCC_SCRIPT = r"""set -e
name=$1; sym=$2; shift 2
printf '%s\n' '#ifndef __SKIP_INTERNAL_FATBINARY_HEADERS' '#include "fatbinary_section.h"' '#endif' \
  '#define __CUDAFATBINSECTION  ".nvFatBinSegment"' '#define __CUDAFATBINDATASECTION  ".nv_fatbin"' \
  '#ifdef __cplusplus' 'extern "C" {' '#endif' "extern const __fatBinC_Wrapper_t $sym;" '#ifdef __cplusplus' '}' \
  '#endif' "#define __fatDeviceText $sym" > "/tmp/$name"
exec "$@" -iquote /tmp
"""
# fatbinary and the joining of the TU's object in one action: the fatbinary's image is embedded by
# an assembler file (`.incbin`, the layout nvcc's fatbin.c gives: the image in `.nv_fatbin`, the
# wrapper {magic, version, image, 0} in `.nvFatBinSegment`) and `ld -r` joins it to the host object.
# Nothing else reads the fatbinary, and the host object is an input, so a device change reruns this
# action alone and a host change reruns it beside the host compile: one sandbox per TU fewer than a
# separate link, and no C compile of a hex array (issue 34). Arguments: the fatbinary image the
# command writes, the host object, the TU's object, the wrapper's symbol, then fatbinary's command.
_FATBIN_SCRIPT = r"""set -e
image=$1; host=$2; obj=$3; sym=$4; shift 4
"$@"
/usr/bin/as -o /tmp/bgraph-fatbin.o <<EOF
.section .nv_fatbin,"a"
.balign 8
.Lbgraph_fatbin_image:
.incbin "$image"
.balign 8
.section .nvFatBinSegment,"aw"
.balign 8
.globl $sym
.hidden $sym
.type $sym,%object
.size $sym,24
$sym:
.long 0x466243b1
.long 1
.quad .Lbgraph_fatbin_image
.quad 0
.section .note.GNU-stack,"",%progbits
EOF
exec /usr/bin/ld -r "$host" /tmp/bgraph-fatbin.o -o "$obj"
"""


def parse_dryrun(text: str, object_name: str,
                 fatbin_symbol: str = "__bgraph_fatbin") -> tuple[dict[str, str], list[Step]]:
    """(environment for the steps, steps in order) from nvcc --dryrun output. `fatbin_symbol`
    names the fatbinary wrapper; it must be unique among objects linked together."""
    env: dict[str, str] = {}
    steps: list[Step] = []
    produced: set[str] = set()
    archs = re.findall(r"\s-arch\s+compute_(\S+)", text)
    single = archs[0] if len(set(archs)) == 1 else None
    for raw in text.splitlines():
        if not raw.startswith("#$ "):
            continue
        line = _TMP.sub("", raw[3:].strip())
        m = _ENV.match(line)
        if m:
            if m.group(1) in ENV_KEEP:
                env[m.group(1)] = m.group(2)
            continue
        argv = split_command(line)
        if not argv or argv[0] == "rm":
            continue
        argv[0] = argv[0].replace("$CICC_PATH", env.get("CICC_PATH", ""))
        argv = [_rename(a, lambda n: _canonical(n, single)) for a in argv]
        kind, arch = _classify(argv)
        if kind == "cudafe":
            # The host file #includes the last arch's stub by this name; give it a fixed one
            # and let the host compile see that stub under it (an alias).
            i = argv.index("--stub_file_name") + 1
            host_stub, stem = argv[i], argv[i].split(".compute_")[0].removesuffix(".cudafe1.stub.c")
            argv[i] = f"{stem}.cudafe1.stub.c"
        writes = _declared_outputs(kind, argv)
        step = Step(kind, arch, [], reads_source=kind in ("hostpp", "devpp"))
        for a in argv:
            spans = _names_in(a) if a != object_name else []
            for start, end in reversed(spans):
                name = a[start:end]
                if name in writes:
                    prefix = "/bgraph/out/"
                    if name not in step.outputs:
                        step.outputs.append(name)
                    if kind == "cicc" and name.endswith(".cudafe1.stub.c"):
                        # Every arch writes its stub under one name: the stub then embeds the same
                        # path for each arch, so the host compile keeps its key when archs change.
                        step.paths[name] = name.split(".compute_")[0].removesuffix(".cudafe1.stub.c") + ".cudafe1.stub.c"
                        a = a[:start] + prefix + step.paths[name] + a[end:]
                        continue
                elif name in produced:
                    prefix = "/bgraph/in/"
                    if name not in step.inputs:
                        step.inputs.append(name)
                else:
                    prefix = ""  # a name nvcc only embeds (include_file_name, cudafe's stub name)
                a = a[:start] + prefix + name + a[end:]
            step.argv.append(a)
        if kind == "hostcc":
            fatbin = next((n for n in sorted(produced) if n.endswith(".fatbin.c")), None)
            if fatbin is None:
                raise DryrunError("no fatbinary step before the host compile")
            host_obj = object_name.removesuffix(".o") + ".host.o"
            step.aliases = {f"{stem}.cudafe1.stub.c": host_stub}
            step.outputs = [host_obj]
            step.argv = ["/bin/sh", "-c", _HOSTCC_SCRIPT, "hostcc", fatbin, fatbin_symbol,
                         *(("/bgraph/out/" + host_obj) if a == object_name else a for a in step.argv)]
            steps.append(step)
            # fatbinary's action, moved after the host compile, writes the image to its /tmp and
            # ends in the TU's object (see _FATBIN_SCRIPT).
            maker = next(st for st in steps if fatbin in st.outputs)
            steps.remove(maker)
            image = "/tmp/" + fatbin.removesuffix(".c")
            argv = [f"--create={image}" if a == f"--embedded-fatbin=/bgraph/out/{fatbin}" else a for a in maker.argv]
            if argv == maker.argv:
                raise DryrunError(f"fatbinary does not write {fatbin} by --embedded-fatbin; cannot decompose")
            maker.argv = ["/bin/sh", "-c", _FATBIN_SCRIPT, "fatbin", image, f"/bgraph/in/{host_obj}",
                          f"/bgraph/out/{object_name}", fatbin_symbol, *argv]
            maker.inputs.append(host_obj)
            maker.outputs = [object_name]
            steps.append(maker)
            return env, steps
        produced.update(step.outputs)
        steps.append(step)
    raise DryrunError("nvcc --dryrun did not end in a host compile; cannot decompose")
