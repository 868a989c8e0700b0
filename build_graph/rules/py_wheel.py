"""py_wheel: a PEP 427 wheel from Python sources, built shared libraries and data.

Deterministic: entries sorted, timestamps fixed at 1980-01-01, fixed permissions,
RECORD with sha256 (as CSV, PEP 376). Built in the sandbox by the pinned system's python3
(zipfile), so the interpreter's identity is part of the key.

Tags: `{python_tag}-{abi_tag}-{platform tag}`. `cp38-abi3` says the extensions use the limited
API (they must be named *.abi3.so). The platform tag is `linux_<platform>` unless `audit` names
an auditwheel environment: then `auditwheel show --json` (its policy data: the glibc and
libstdc++ symbol versions and libraries each manylinux policy allows) judges the wheel's shared
libraries, in the sandbox, and the wheel takes the most compatible manylinux tag it allows,
counting the libraries named in `external_libs` (provided at run time by other wheels, like
torch, or by the driver) as allowed, as `auditwheel repair --exclude` would. Nothing is looked
up on the build machine (`--ldpaths ''`): libraries are judged by name and by the symbol
versions the wheel's own files require, which is what holds on the target's system too.
"""

from __future__ import annotations

import fnmatch
import json
import re
from typing import Literal
from email.parser import HeaderParser

from pydantic import Field, field_validator

from build_graph.model import SymlinkEntry, TargetOutput, Tree, check_relpath
from build_graph.rules.base import Attrs, PlanGen, RuleContext, labels_in
from build_graph.rules.wheel_content import HERE, LinkError, Placer, resolve

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
    entry_points_from: str | None = Field(None, description="with tree: an entry_points.txt (a setuptools sdist's "
                                                             "<name>.egg-info/entry_points.txt) shipped as the wheel's "
                                                             "dist-info/entry_points.txt: pip writes its console "
                                                             "scripts, and plugin groups are found")
    files: dict[str, list[str]] = Field(default_factory=dict,
                                        description="path inside the wheel -> [label, path in that label's output]")
    dirs: dict[str, str] = Field(default_factory=dict,
                                 description="directory inside the wheel -> label whose whole output goes there "
                                             "(e.g. FlashInfer's AOT modules under flashinfer/data/aot)")
    tree_dirs: dict[str, str] = Field(default_factory=dict,
                                      description="with tree: directory inside the wheel -> directory of the tree "
                                                  "whose files go there, less `exclude` (a setuptools package-dir "
                                                  "mapping: FlashInfer's csrc/ as flashinfer/data/csrc)")
    pure: bool = Field(False, description="py3-none-any instead of a platform tag")
    python_tag: str = Field("py3", pattern=r"^(py|cp)\d+$", description="e.g. cp38 (with abi_tag abi3)")
    abi_tag: Literal["none", "abi3"] = Field("none", description="abi3: limited-API extensions (*.abi3.so)")
    audit: str | None = Field(None, description="python_env with auditwheel: the platform tag becomes the "
                                                 "manylinux one its policy data allows (else linux_<platform>)")
    external_libs: list[str] = Field(default_factory=list,
                                     description="with audit: sonames (globs) the wheel may need from outside it "
                                                 "(torch's libraries, the driver's libcuda.so.1)")
    platform: Literal["x86_64", "aarch64"] | None = Field(
        None, description="the platform this wheel is built for, with all it needs (a transition; "
                          "`--platform` overrides it); default: the host's")
    tools: str = Field("//toolchains:host", description="host_tools target providing python3")

    @field_validator("distribution")
    @classmethod
    def _dist(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9_.]+", v):
            raise ValueError("distribution must be letters, digits, '_' or '.' (PEP 427 escaping)")
        return v


def py_wheel_deps(attrs: PyWheelAttrs):
    return (labels_in(attrs, "libs", "tools", "tree", "audit", "dirs")
            + [("files", v[0]) for v in attrs.files.values() if v])


def py_wheel_transition(attrs: PyWheelAttrs, key: str, label: str, config):
    """auditwheel runs on the exec machine, whatever the wheel is for."""
    return config.exec_config() if key == "audit" else config


def py_wheel_sources(attrs: PyWheelAttrs):
    return [("srcs", p) for p in attrs.srcs]


def wheel_tag(pure: bool, platform: str) -> str:
    """Without an audit, not manylinux: nothing has checked which glibc the libraries need."""
    return "py3-none-any" if pure else f"py3-none-linux_{platform}"


# Runs in the sandbox: $1 = the libraries (a tree), $2 = the platform, $3 = auditwheel's
# site-packages. The libraries go into a stand-in wheel named for the platform (auditwheel reads
# the architecture from the name); `auditwheel show --json` writes its verdict to audit.json.
AUDIT_SCRIPT = r'''
import contextlib, os, sys, zipfile
libs, platform, site = sys.argv[1:4]
sys.path.insert(0, site)
wheel = f"/tmp/bgraph_audit-0-py3-none-linux_{platform}.whl"
info = "bgraph_audit-0.dist-info"
record = []  # auditwheel reads the files to judge from RECORD
with zipfile.ZipFile(wheel, "w") as zf:
    for root, _dirs, names in sorted(os.walk(libs)):
        for n in sorted(names):
            record.append(os.path.relpath(os.path.join(root, n), libs))
            zf.write(os.path.join(root, n), record[-1])
    zf.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: bgraph_audit\nVersion: 0\n")
    zf.writestr(f"{info}/WHEEL", f"Wheel-Version: 1.0\nRoot-Is-Purelib: false\nTag: py3-none-linux_{platform}\n")
    zf.writestr(f"{info}/RECORD", "".join(f"{name},,\n" for name in record))
from auditwheel.main import main
sys.argv = ["auditwheel", "show", "--json", "--ldpaths", "", wheel]
with open("audit.json", "w") as out, contextlib.redirect_stdout(out):
    rc = main()
sys.exit(rc or 0)
'''
_MANYLINUX = re.compile(r"^manylinux_(\d+)_(\d+)_")


def _glibc(tag: str) -> tuple[int, int] | None:
    m = _MANYLINUX.match(tag)
    return (int(m.group(1)), int(m.group(2))) if m else None


def audited_tag(report: dict, allowed: list[str]) -> tuple[str, str]:
    """(platform tag, why) from `auditwheel show --json`: the most compatible manylinux policy
    whose glibc is at least what the symbol versions need (sym_tag), none of whose
    libraries to eliminate is outside `allowed` (globs), and with no blacklisted symbol."""
    if "error" in report:
        raise ValueError(f"auditwheel: {report['error']}")
    overall, floor = report["overall_tag"], _glibc(report["sym_tag"])
    for flag in ("pyfpe", "ucs2", "unsupported_isa"):
        if report.get(flag):
            return overall, f"auditwheel: {flag}"
    best, why = overall, "auditwheel's overall tag"
    for policy, needs in report.get("policy_upgrades", {}).items():
        glibc = _glibc(policy)
        if glibc is None or floor is None or glibc < floor or needs.get("blacklisted_symbols"):
            continue
        outside = [lib for lib in needs.get("libs_to_eliminate", [])
                   if not any(fnmatch.fnmatchcase(lib, g) for g in allowed)]
        if not outside and (_glibc(best) is None or glibc < _glibc(best)):
            kept = needs.get("libs_to_eliminate", [])
            best, why = policy, ("allowed by external_libs: " + ", ".join(kept)) if kept else "auditwheel's policy"
    return best, why


def _shared_library(path: str) -> bool:
    name = path.rpartition("/")[2]
    return name.endswith(".so") or ".so." in name


def _check_abi(ctx: RuleContext, content: Tree) -> None:
    """abi3 wheels hold only limited-API extensions; an audited untagged one holds none."""
    a = ctx.attrs
    names = [p.rpartition("/")[2] for p in content.entries]
    versioned = [n for n in names if re.search(r"\.cpython-[^.]+\.so$", n)]
    abi3 = [n for n in names if n.endswith(".abi3.so")]
    if a.abi_tag == "abi3" and versioned:
        raise ctx.fail(f"abi_tag abi3, but {versioned[0]} is built for one CPython version", "abi_tag")
    if a.abi_tag == "none" and a.audit and (versioned or abi3):
        raise ctx.fail(f"the wheel holds the Python extension {(versioned or abi3)[0]}: tag its ABI", "abi_tag",
                       hint='python_tag = "cp38" and abi_tag = "abi3" for limited-API (*.abi3.so) extensions')


def _tree_file(ctx: RuleContext, tree: Tree, path: str, key: str):
    """The file at `path` of the tree (a link there: the file it names in the tree)."""
    entry = tree.entries.get(path)
    if entry is None:
        raise ctx.fail(f"{path} is not in {ctx.attrs.tree}", key)
    if isinstance(entry, SymlinkEntry):
        try:
            entry = resolve(tree, path)[1]
        except LinkError as e:
            raise ctx.fail(f"the link {path} -> {entry.target} in {ctx.attrs.tree} {e}", key,
                           hint="name the file itself") from None
    return entry


_FOLD = re.compile(r"\r?\n")  # a folded header line: unfold by dropping the line break (RFC 5322)


def _metadata(ctx: RuleContext, tree: Tree, path: str, version: str) -> list[str]:
    """Requires-Dist / Requires-Python lines of a PKG-INFO, after checking its Version."""
    entry = _tree_file(ctx, tree, path, "metadata_from")
    # PKG-INFO is RFC 822 headers (core metadata): the standard library's parser unfolds them.
    headers = HeaderParser().parsestr(  # compat32, its default (email.policy costs 15 ms to import)
        ctx.read(entry).decode(errors="replace"), headersonly=True)
    found = headers.get("Version")
    if found != version:
        raise ctx.fail(f"{path} says version {found}, the target says {version}", "version")
    return [f"{k}: {_FOLD.sub('', v)}" for k, v in headers.items() if k in ("Requires-Dist", "Requires-Python")]


def _entry_points(ctx: RuleContext, tree: Tree, path: str):
    """The tree's entry_points.txt, checked to be what pip reads (INI sections of name = object
    reference): a file it cannot parse would make the installed wheel's scripts silently missing."""
    import configparser

    entry = _tree_file(ctx, tree, path, "entry_points_from")
    parser = configparser.ConfigParser(delimiters=("=",), interpolation=None)
    try:
        parser.read_string(ctx.read(entry).decode())
    except (configparser.Error, UnicodeDecodeError) as e:
        raise ctx.fail(f"{path} is not an entry_points.txt pip can read: {str(e).splitlines()[0]}",
                       "entry_points_from") from None
    return entry


def _relocations(ctx, tree: Tree, tree_dirs: dict[str, str], exclude: list[str]):
    """(wheel path, entry, its tree_dirs key, its path in the tree) for the files below each
    source directory of `tree_dirs` (wheel directory -> tree directory), less `exclude`."""
    placed: set[str] = set()
    for dest, src in tree_dirs.items():
        clean = []
        for what, path in (("wheel directory", dest), ("tree directory", src)):
            try:
                clean.append(check_relpath(path.rstrip("/")) if path.rstrip("/") else "")
            except ValueError:
                raise ctx.fail(f"tree_dirs[{dest!r}]: the {what} {path!r} is not a relative path inside it",
                               "tree_dirs") from None
        to, under = clean
        if not to:
            raise ctx.fail(f"tree_dirs[{dest!r}]: the wheel directory is empty", "tree_dirs")
        below = tree.subtree(under) if under else tree
        moved = [(f"{to}/{p}", e, f"{under}/{p}" if under else p) for p, e in below.entries.items()]
        moved = [m for m in moved if not any(fnmatch.fnmatchcase(m[2], g) for g in exclude)]
        if not moved:
            raise ctx.fail(f"tree_dirs[{dest!r}]: {src!r} holds no files in {ctx.attrs.tree}", "tree_dirs")
        for to_path, entry, from_path in moved:
            if to_path in placed:
                raise ctx.fail(f"tree_dirs[{dest!r}]: {to_path} is placed twice", "tree_dirs")
            placed.add(to_path)
            yield to_path, entry, dest, from_path


def relocated(ctx, tree: Tree, tree_dirs: dict[str, str], exclude: list[str]) -> Tree:
    """The files below each source directory of `tree_dirs` (wheel directory -> tree directory),
    placed below its wheel directory, less the paths `exclude` matches (as the tree names them);
    a link is shipped as the file of `tree` it names (wheel_content.resolve)."""
    content = Placer(ctx.fail, {})
    for to_path, entry, dest, from_path in _relocations(ctx, tree, tree_dirs, exclude):
        content.place(to_path, entry, f"tree_dirs[{dest!r}]", "tree_dirs", tree, from_path)
    return content.tree()


def _wheel_path(ctx: RuleContext, attr: str, dest: str) -> str:
    """A path inside the wheel named by a key of `attr` (files, libs, dirs), normalised."""
    try:
        return check_relpath(dest.rstrip("/"))
    except ValueError:
        raise ctx.fail(f"{attr}[{dest!r}]: {dest!r} is not a path inside the wheel", attr,
                       hint="name a relative path inside the wheel, such as pkg/data/x (no leading '/', "
                            "no '..')") from None


def plan_py_wheel(ctx: RuleContext) -> PlanGen:
    a = ctx.attrs
    info = f"{a.distribution}-{a.version}.dist-info"
    content = Placer(ctx.fail, {f"{info}/{n}": "written by the wheel itself (its dist-info)"
                                for n in ("METADATA", "WHEEL", "RECORD")})
    prefix = a.strip_prefix.strip("/")
    for p, e in (ctx.sources.subtree(prefix) if prefix else ctx.sources).entries.items():
        content.place(p, e, f"srcs ({HERE})", "srcs", ctx.sources, f"{prefix}/{p}" if prefix else p)
    for dest, label in a.libs.items():
        where, lib = _wheel_path(ctx, "libs", dest), ctx.dep(label, "libs")
        so = lib.info.get("shared_library")
        if not so:
            raise ctx.fail(f"libs[{dest!r}]: {label} provides no shared library", "libs",
                           hint="name a cc_shared_library target (or ship another output with `files`)")
        content.place(where, lib.tree.entries[so], f"libs[{dest!r}] ({label})", "libs", lib.tree, so)
    requires = [f"Requires-Dist: {r}" for r in a.requires]
    if a.tree:
        tree = ctx.dep(a.tree, "tree").tree
        picked = {p: e for p, e in tree.entries.items()
                  if any(fnmatch.fnmatchcase(p, g) for g in a.include)
                  and not any(fnmatch.fnmatchcase(p, g) for g in a.exclude)}
        if not picked and (a.include or not a.tree_dirs):
            raise ctx.fail(f"include {a.include} selects nothing from {a.tree}", "include")
        origin = f"include ({HERE} of {a.tree})"
        for p, e in picked.items():
            content.place(p, e, origin, "include", tree, p)
        origins = {dest: f"tree_dirs[{dest!r}] ({HERE} of {a.tree})" for dest in a.tree_dirs}
        for to_path, entry, dest, from_path in _relocations(ctx, tree, a.tree_dirs, a.exclude):
            content.place(to_path, entry, origins[dest], "tree_dirs", tree, from_path)
        if a.metadata_from:
            requires += _metadata(ctx, tree, a.metadata_from, a.version)
        if a.entry_points_from:
            content.place(f"{info}/entry_points.txt", _entry_points(ctx, tree, a.entry_points_from),
                          f"entry_points_from ({a.entry_points_from})", "entry_points_from", tree,
                          a.entry_points_from)
    elif a.tree_dirs:
        raise ctx.fail("tree_dirs names directories of `tree`, and no tree is given", "tree_dirs")
    for dest, ref in a.files.items():
        if len(ref) != 2:
            raise ctx.fail(f"files[{dest!r}] must be [label, path]", "files")
        out = ctx.dep(ref[0], "files").tree
        if ref[1] not in out.entries:
            raise ctx.fail(f"files[{dest!r}]: {ref[0]} has no output {ref[1]!r}", "files")
        content.place(_wheel_path(ctx, "files", dest), out.entries[ref[1]], f"files[{dest!r}] ({ref[1]} of {ref[0]})",
                      "files", out, ref[1])
    for dest, label in a.dirs.items():
        out = ctx.dep(label, "dirs").tree
        if not out.entries:
            raise ctx.fail(f"{label} has no output files", "dirs")
        where = _wheel_path(ctx, "dirs", dest)
        origin = f"dirs[{dest!r}] ({HERE} of {label})"
        for p, e in out.entries.items():
            content.place(f"{where}/{p}", e, origin, "dirs", out, p)
    content = content.tree()
    _check_abi(ctx, content)
    platform_tag, why = ("any" if a.pure else f"linux_{ctx.platform}"), ""
    libs = Tree({p: e for p, e in content.entries.items() if _shared_library(p)})
    if a.audit and not a.pure and libs.entries:
        [audited] = yield [ctx.exec_action(
            "auditwheel show", "WheelAudit",
            ["/usr/bin/python3", "-I", "-S", "-c", AUDIT_SCRIPT, "/bgraph/in/libs", ctx.platform, "/bgraph/in/auditwheel"],
            inputs={"/bgraph/in/libs": libs, "/bgraph/in/auditwheel": ctx.dep(a.audit, "audit").tree},
            outputs=["audit.json"], host=ctx.dep(a.tools, "tools"), memory_mb=512)]
        try:
            platform_tag, why = audited_tag(json.loads(ctx.read(audited.tree.entries["audit.json"])), a.external_libs)
        except (ValueError, KeyError) as e:
            raise ctx.fail(f"cannot read auditwheel's verdict: {e}", "audit") from None
    tag = f"{a.python_tag}-{a.abi_tag}-{platform_tag}" if not a.pure else wheel_tag(True, ctx.platform)
    wheel = f"{a.distribution}-{a.version}-{tag}.whl"
    [built] = yield [ctx.exec_action(
        "wheel " + wheel, "PyWheel",
        ["/usr/bin/python3", "-I", "-S", "-c", WHEEL_SCRIPT, "/bgraph/in/pkg", wheel, a.distribution, a.version,
         tag, "\n".join(requires)],
        inputs={"/bgraph/in/pkg": content}, outputs=[wheel], host=ctx.dep(a.tools, "tools"), memory_mb=256)]
    return TargetOutput(built.tree, {"wheel": wheel, "tag": tag, **({"tag_reason": why} if why else {})})
