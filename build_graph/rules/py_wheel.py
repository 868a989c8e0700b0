"""py_wheel: a PEP 427 wheel from Python sources, built shared libraries and data.

Deterministic: entries sorted, timestamps fixed at 1980-01-01, fixed permissions,
RECORD with sha256. Built in the sandbox by the host's python3 (zipfile), so the
interpreter's identity is part of the key.
"""

from __future__ import annotations

import fnmatch
import re
from email.parser import HeaderParser
from email.policy import compat32

from pydantic import Field, field_validator

from build_graph.model import TargetOutput, Tree
from build_graph.rules.base import Attrs, PlanGen, RuleContext, labels_in

WHEEL_SCRIPT = r'''
import base64, csv, hashlib, io, os, sys, zipfile
src, out, dist, version, tag, requires = sys.argv[1:7]
info = f"{dist}-{version}.dist-info"
files = {}
for root, _dirs, names in os.walk(src):
    for n in names:
        p = os.path.join(root, n)
        files[os.path.relpath(p, src)] = p
meta = [f"Metadata-Version: 2.1", f"Name: {dist}", f"Version: {version}"]
meta += [line for line in requires.split("\n") if line]
generated = {
    f"{info}/METADATA": ("\n".join(meta) + "\n").encode(),
    f"{info}/WHEEL": ("Wheel-Version: 1.0\nGenerator: bgraph\nRoot-Is-Purelib: false\n"
                      + "".join(f"Tag: {t}\n" for t in [tag])).encode(),
}
def add(zf, name, data, mode):
    zi = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
    zi.external_attr = (0o100000 | mode) << 16
    zi.compress_type = zipfile.ZIP_DEFLATED
    zf.writestr(zi, data, compresslevel=6)
record = []
with zipfile.ZipFile(out, "w") as zf:
    for name in sorted(files):
        data = open(files[name], "rb").read()
        mode = 0o755 if os.access(files[name], os.X_OK) else 0o644
        add(zf, name, data, mode)
        record.append((name, data))
    for name in sorted(generated):
        add(zf, name, generated[name], 0o644)
        record.append((name, generated[name]))
    rows = io.StringIO()
    writer = csv.writer(rows, lineterminator="\n")  # PEP 376: a name with a comma or quote is quoted
    for name, data in record:
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        writer.writerow([name, f"sha256={digest}", len(data)])
    writer.writerow([f"{info}/RECORD", "", ""])
    add(zf, f"{info}/RECORD", rows.getvalue().encode(), 0o644)
'''


class PyWheelAttrs(Attrs):
    distribution: str = Field(description="distribution name, e.g. bgraph_fp4")
    version: str = Field(description="version string")
    srcs: list[str] = Field(default_factory=list, description="Python sources / data, workspace paths or globs")
    strip_prefix: str = Field("", description="leading workspace directory removed from srcs paths")
    libs: dict[str, str] = Field(default_factory=dict,
                                 description="path inside the wheel -> label of a cc_shared_library")
    requires: list[str] = Field(default_factory=list, description="Requires-Dist entries")
    tree: str | None = Field(None, description="label of a source tree (e.g. a patched sdist) to take files from")
    include: list[str] = Field(default_factory=list, description="with tree: globs of the paths to take ('vllm/**')")
    exclude: list[str] = Field(default_factory=list, description="with tree: globs of paths to leave out")
    metadata_from: str | None = Field(None, description="with tree: a PKG-INFO whose Requires-Dist and "
                                                        "Requires-Python lines join METADATA; its Version must match")
    files: dict[str, list[str]] = Field(default_factory=dict,
                                        description="path inside the wheel -> [label, path in that label's output]")
    pure: bool = Field(False, description="py3-none-any instead of a platform tag")
    tools: str = Field("//toolchains:host", description="host_tools target providing python3")

    @field_validator("distribution")
    @classmethod
    def _dist(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9_.]+", v):
            raise ValueError("distribution must be letters, digits, '_' or '.' (PEP 427 escaping)")
        return v


def py_wheel_deps(attrs: PyWheelAttrs):
    return labels_in(attrs, "libs", "tools", "tree") + [("files", v[0]) for v in attrs.files.values() if v]


def py_wheel_sources(attrs: PyWheelAttrs):
    return [("srcs", p) for p in attrs.srcs]


def wheel_tag(pure: bool, platform: str) -> str:
    """Not manylinux: the libraries link this host's glibc, which no audit has checked."""
    return "py3-none-any" if pure else f"py3-none-linux_{platform}"


_FOLD = re.compile(r"\r?\n")  # a folded header line: unfold by dropping the line break (RFC 5322)


def _metadata(ctx: RuleContext, tree: Tree, path: str, version: str) -> list[str]:
    """Requires-Dist / Requires-Python lines of a PKG-INFO, after checking its Version."""
    entry = tree.entries.get(path)
    if entry is None:
        raise ctx.fail(f"{path} is not in {ctx.attrs.tree}", "metadata_from")
    # PKG-INFO is RFC 822 headers (core metadata): the standard library's parser unfolds them.
    headers = HeaderParser(policy=compat32).parsestr(ctx.read(entry).decode(errors="replace"), headersonly=True)
    found = headers.get("Version")
    if found != version:
        raise ctx.fail(f"{path} says version {found}, the target says {version}", "version")
    return [f"{k}: {_FOLD.sub('', v)}" for k, v in headers.items() if k in ("Requires-Dist", "Requires-Python")]


def plan_py_wheel(ctx: RuleContext) -> PlanGen:
    a = ctx.attrs
    prefix = a.strip_prefix.strip("/")
    content = ctx.sources.subtree(prefix) if prefix else ctx.sources
    for dest, label in a.libs.items():
        lib = ctx.dep(label, "libs")
        so = lib.info.get("shared_library")
        if not so:
            raise ctx.fail(f"{label} provides no shared library", "libs")
        content = content.merged(Tree({dest: lib.tree.entries[so]}))
    requires = [f"Requires-Dist: {r}" for r in a.requires]
    if a.tree:
        tree = ctx.dep(a.tree, "tree").tree
        picked = Tree({p: e for p, e in tree.entries.items()
                       if any(fnmatch.fnmatchcase(p, g) for g in a.include)
                       and not any(fnmatch.fnmatchcase(p, g) for g in a.exclude)})
        if not picked.entries:
            raise ctx.fail(f"include {a.include} selects nothing from {a.tree}", "include")
        content = content.merged(picked)
        if a.metadata_from:
            requires += _metadata(ctx, tree, a.metadata_from, a.version)
    for dest, ref in a.files.items():
        if len(ref) != 2:
            raise ctx.fail(f"files[{dest!r}] must be [label, path]", "files")
        out = ctx.dep(ref[0], "files").tree
        if ref[1] not in out.entries:
            raise ctx.fail(f"{ref[0]} has no output {ref[1]!r}", "files")
        content = content.merged(Tree({dest: out.entries[ref[1]]}))
    tag = wheel_tag(a.pure, ctx.platform)
    wheel = f"{a.distribution}-{a.version}-{tag}.whl"
    [built] = yield [ctx.exec_action(
        "wheel " + wheel, "PyWheel",
        ["/usr/bin/python3", "-I", "-S", "-c", WHEEL_SCRIPT, "/bgraph/in/pkg", wheel, a.distribution, a.version,
         tag, "\n".join(requires)],
        inputs={"/bgraph/in/pkg": content}, outputs=[wheel], host=ctx.dep(a.tools, "tools"), memory_mb=256)]
    return TargetOutput(built.tree, {"wheel": wheel})
