"""oci_image: a reproducible OCI image from trees bgraph already has.

The layers are declared as data, bottom to top: `system` (a `deb_packages` set of the *target*
platform, `sysroot = true`) is the first layer, then one layer per entry of `layers`, each made of
parts (another target's output tree placed at a path, or a `py_wheel`'s wheel unpacked into
site-packages, both optionally narrowed by include/exclude globs) and small inline files. Put big,
stable layers (the system, torch and its CUDA libraries) at the bottom and what changes often (the
app) on top: a daemon keys a layer by its chain (it and all below it), so a change reloads its
layer and every one above.

Each layer is one sandboxed action: the pinned CPython of `tools` (//toolchains:host) runs
build_graph/oci/tarball.py over the layer's tree, mounted read-only, and writes an uncompressed
tar (digest = diff_id, written deterministically: see tarball.py) and its sha256. The config,
manifest and index are JSON written here, in the plan, from those digests (oci/image.py); one
last action writes the image archive, `image.tar`: an OCI image layout (oci-layout, index.json,
blobs/sha256/...) that also carries Docker's manifest.json, named `localhost/bgraph/<name>:<tag>`;
`image.json` beside it lists the digests. `bgraph load LABEL` puts it into a Docker daemon.

What maintainer scripts would make is written by the rule into the bottom layer: /etc/passwd and
/etc/group (root and nobody) unless the system has them, /tmp and /var/tmp (1777) and /root (0700), whatever
the system's tree holds there. No script runs. An upper layer that holds something below a directory
a lower layer wrote with another mode (/tmp) writes that directory with the same mode, not 0755.
Wheels are unpacked as pip would place them (purelib/platlib into site-packages, a console script
per `console_scripts` entry point); their `.data/scripts`, headers and data are left out.
"""

from __future__ import annotations

import configparser
import fnmatch
import hashlib
import json
import posixpath
import re
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from build_graph.debian import DEB_ARCH
from build_graph.model import DirEntry, FileEntry, SymlinkEntry, TargetOutput, Tree, check_relpath
from build_graph.labels import parse_label
from build_graph.oci import image, sbom
from build_graph.rules.base import BASE_ENV, Attrs, PlanGen, RuleContext
from build_graph.rules.python_env import site_packages

EPOCH = int(BASE_ENV["SOURCE_DATE_EPOCH"])
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]*$")
_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
# A repository as Docker's reference grammar takes it, without a tag: [domain[:port]/]path, where a
# port needs a path after it ("localhost:5000" alone would read as name "localhost", tag "5000").
_PATH_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_DOMAIN = r"[a-z0-9](?:[a-z0-9-]*[a-z0-9])?(?:\.[a-z0-9](?:[a-z0-9-]*[a-z0-9])?)*(?::[0-9]+)?"
_REPO = re.compile(rf"^(?:{_DOMAIN}/)?{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*$")
_REPO_MAX = 255  # Docker's limit on a repository name
_USER = re.compile(r"^(root|nobody|\d+)(:(root|nogroup|\d+))?$")
PASSWD = "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
GROUP = "root:x:0:\nnogroup:x:65534:\n"
SYSTEM_DIRS = {"tmp": 0o1777, "var/tmp": 0o1777, "root": 0o700}
# Writes the SBOM (made in the plan) from its argv chunks: one argument may hold at most 128 KiB.
SBOM_SCRIPT = "import sys\nopen(sys.argv[1], 'w').write(''.join(sys.argv[2:]))\n"
SBOM_CHUNK = 64 << 10
# What the plan hands an action (a spec, the SBOM) goes on its command line, the only way bytes made
# in the plan reach a sandbox (a file input would be written by an action from its argv all the
# same): in 64 KiB arguments (ASCII JSON; Linux takes at most 128 KiB in one), and at most this much
# in all (the kernel's whole argv and environment is 2 MiB with an 8 MiB stack). More is refused
# at planning, naming the layer or keys, rather than failing as "Argument list too long".
ARGV_BUDGET = 1 << 20
CONFIG_WHAT = "the image config (labels, env, cmd) and summary"
CA_DIR = "usr/share/ca-certificates"
CA_BUNDLE = "etc/ssl/certs/ca-certificates.crt"
# What ca-certificates' postinst (update-ca-certificates) writes, with the same bytes: every
# certificate the package ships, in byte order of its path, each ending in a newline.
CA_SCRIPT = """import os, sys
root, out = sys.argv[1], sys.argv[2]
names = [os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs if f.endswith('.crt')]
with open(out, 'wb') as o:
    for name in sorted(names, key=os.fsencode):
        with open(os.path.join(root, name), 'rb') as f:
            data = f.read()
        o.write(data if not data or data.endswith(b'\\n') else data + b'\\n')
"""


@lru_cache(maxsize=1)
def tar_script() -> str:
    """The layer and archive writer the actions run: its text is part of their keys."""
    return (Path(__file__).resolve().parent.parent / "oci" / "tarball.py").read_text()


def _script_name(name: str) -> bool:
    """A console script's file name in usr/local/bin: one path component, not '.' or '..'."""
    return bool(re.fullmatch(r"[\w.-]+", name)) and name not in (".", "..")


def _relpath(v: str) -> str:
    stripped = v.strip("/")
    if not stripped:
        return ""
    return check_relpath(stripped)


class Part(Attrs):
    tree: str | None = Field(None, description="label whose output tree is placed at `at`")
    wheel: str | None = Field(None, description="label of a py_wheel: its wheel unpacked into site-packages")
    at: str | None = Field(None, description="path in the image (default: / for a tree, `site_packages` for a wheel)")
    include: list[str] = Field(default_factory=list, description="globs of the paths to take (default: all)")
    exclude: list[str] = Field(default_factory=list, description="globs of the paths to leave out")
    scripts: dict[str, str] = Field(default_factory=dict, description="console scripts (name -> module:function) "
                                    "a wheel's entry points lack, written to usr/local/bin as pip writes its own")

    @model_validator(mode="after")
    def _one_source(self) -> "Part":
        if (self.tree is None) == (self.wheel is None):
            raise ValueError("a part names exactly one of tree or wheel")
        if self.scripts and not self.wheel:
            raise ValueError("scripts are a wheel part's (a tree part places its own files)")
        for name, ref in self.scripts.items():
            if _launcher(ref, "/") is None or not _script_name(name):
                raise ValueError(f"script {name} = {ref!r} is not a name and module:function")
        if self.at is not None:
            try:
                _relpath(self.at)
            except ValueError:
                raise ValueError(f"at = {self.at!r} is not a path inside the image") from None
        return self


class LayerGroup(Attrs):
    name: str = Field(description="the layer's name (history, messages)")
    parts: list[Part] = Field(default_factory=list, alias="from", description="what the layer holds")
    files: dict[str, str] = Field(default_factory=dict, description="path -> text of a small file")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME.match(v):
            raise ValueError(f"layer name {v!r}: lowercase letters, digits, '.', '_' and '-'")
        return v

    @field_validator("files")
    @classmethod
    def _files(cls, v: dict[str, str]) -> dict[str, str]:
        for path in v:
            try:
                if not _relpath(path):
                    raise ValueError
            except ValueError:
                raise ValueError(f"file {path!r} is not a path inside the image") from None
        return v


class OciImageAttrs(Attrs):
    system: str | None = Field(None, description="a deb_packages set of the target platform (sysroot = true): "
                                                 "the bottom layer, named system")
    layers: list[LayerGroup] = Field(default_factory=list, description="the layers above the system, bottom to top")
    entrypoint: list[str] = Field(default_factory=list)
    cmd: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict, description="environment (PATH defaults to Debian's)")
    workdir: str = Field("", description="working directory (absolute)")
    user: str = Field("", description="uid[:gid], or root / nobody (the passwd the rule writes)")
    labels: dict[str, str] = Field(default_factory=dict, description="image labels (org.opencontainers.image.*)")
    repository: str | None = Field(None, description="image name (default: localhost/bgraph/<target name>)")
    tag: str = Field("latest")
    site_packages: str = Field("usr/local/lib/python3.11/dist-packages",
                               description="where wheels are unpacked (Debian's python3.11 searches it)")
    python: str = Field("/usr/bin/python3", description="the interpreter of the wheels' console scripts")
    modes: dict[str, str] = Field(default_factory=dict, description="path -> octal mode (e.g. \"4755\")")
    forbid: list[str] = Field(default_factory=list, description="globs of paths no layer may hold "
                                                                "(e.g. the driver's **/libcuda.so*)")
    platform: Literal["x86_64", "aarch64"] | None = Field(
        None, description="the platform the image is for (a transition; `--platform` overrides it)")
    tools: str = Field("//toolchains:host", description="the system whose python3 writes the tars")
    archive: bool = Field(True, description="write image.tar; false: the OCI layout as a directory whose blobs "
                                            "are the layer actions' own files (no second copy of GBs of layers "
                                            "in the store); `bgraph load` writes the same tar as it sends it")

    @field_validator("tag")
    @classmethod
    def _tag(cls, v: str) -> str:
        if not _TAG.match(v):
            raise ValueError(f"tag {v!r}: letters, digits, '_', '.', '-' (at most 128)")
        return v

    @field_validator("repository")
    @classmethod
    def _repository(cls, v: str | None) -> str | None:
        if v is not None and (not _REPO.match(v) or len(v) > _REPO_MAX):
            raise ValueError(f"repository {v!r} is not an image name without a tag (lowercase, at most "
                             f"{_REPO_MAX} characters; a port needs a path: localhost:5000/app)")
        return v

    @field_validator("user")
    @classmethod
    def _user(cls, v: str) -> str:
        if v and not _USER.match(v):
            raise ValueError(f"user {v!r}: uid[:gid] or root/nobody (the image's passwd holds only those)")
        return v

    @field_validator("workdir")
    @classmethod
    def _workdir(cls, v: str) -> str:
        if v and not v.startswith("/"):
            raise ValueError("workdir must be absolute")
        if "\0" in v:
            raise ValueError(f"workdir {v!r} holds a NUL byte")
        return v

    @field_validator("python")
    @classmethod
    def _python(cls, v: str) -> str:
        # the launchers' #! line: a space, newline or NUL would change what runs
        if not re.fullmatch(r"/[^\s\0]+", v):
            raise ValueError(f"python {v!r}: an absolute path without spaces (the launchers' #! line)")
        return v

    @field_validator("entrypoint", "cmd")
    @classmethod
    def _argv(cls, v: list[str]) -> list[str]:
        if any("\0" in a for a in v):
            raise ValueError("an argument holds a NUL byte (no process can be given one)")
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        for key, value in v.items():
            # NAME=value is one string in the config: a key with '=' would be read back split elsewhere
            if not key or "=" in key or "\0" in key:
                raise ValueError(f"env key {key!r}: a non-empty name without '=' or NUL")
            if "\0" in value:
                raise ValueError(f"env {key}: the value holds a NUL byte")
        return v

    @field_validator("modes")
    @classmethod
    def _modes(cls, v: dict[str, str]) -> dict[str, str]:
        for path, mode in v.items():
            if not re.fullmatch(r"[0-7]{3,4}", mode):
                raise ValueError(f"mode {mode!r} of {path!r}: 3 or 4 octal digits")
            try:  # checked here, not at plan time, where it read as a bug in the rule
                if not _relpath(path):
                    raise ValueError
            except ValueError:
                raise ValueError(f"{path!r} is not a path inside the image (no '..')") from None
        return v

    @field_validator("site_packages")
    @classmethod
    def _site_packages(cls, v: str) -> str:
        try:
            _relpath(v)
        except ValueError:
            raise ValueError(f"{v!r} is not a directory inside the image (no '..')") from None
        return v

    @model_validator(mode="after")
    def _names(self) -> "OciImageAttrs":
        names = [g.name for g in self.layers] + (["system"] if self.system else [])
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"layer name {dup[0]!r} given twice")
        if not self.system and not self.layers:
            raise ValueError("an image needs a system or at least one layer")
        return self


def oci_image_deps(attrs: OciImageAttrs):
    out = [("system", attrs.system)] if attrs.system else []
    for group in attrs.layers:
        out += [("layers", p.tree or p.wheel) for p in group.parts]
    return out + [("tools", attrs.tools)]


def _select(tree: Tree, include: list[str], exclude: list[str]) -> Tree:
    if not include and not exclude:
        return tree
    return Tree.from_checked({p: e for p, e in tree.entries.items()
                              if (not include or any(fnmatch.fnmatchcase(p, g) for g in include))
                              and not any(fnmatch.fnmatchcase(p, g) for g in exclude)})


def _console_scripts(ctx: RuleContext, tree: Tree, python: str) -> dict[str, str]:
    """bin name -> launcher text, for each console_scripts entry point of the unpacked wheel."""
    out: dict[str, str] = {}
    for path, entry in tree.entries.items():
        if not (path.endswith(".dist-info/entry_points.txt") and path.count("/") == 1
                and isinstance(entry, FileEntry)):
            continue
        parser = configparser.ConfigParser(delimiters=("=",), interpolation=None)
        parser.optionxform = str  # keep the scripts' case
        try:
            parser.read_string(ctx.read(entry).decode())
        except (configparser.Error, UnicodeDecodeError) as e:
            raise ctx.fail(f"{path}: not an entry-points file ({e})", "layers") from None
        if not parser.has_section("console_scripts"):
            continue
        for name, value in parser.items("console_scripts"):
            text = _launcher(value, python)
            if text is None or not _script_name(name):
                raise ctx.fail(f"{path}: console script {name} = {value!r} is not module:function", "layers")
            out[name] = text
    return out


def _launcher(value: str, python: str) -> str | None:
    """The launcher pip writes for a console script `module:function [extras]`; None if it is not one."""
    ref = value.split("[", 1)[0].strip()
    module, _, qualname = ref.partition(":")
    if not re.fullmatch(r"[\w.]+", module) or not re.fullmatch(r"[\w.]*", qualname):
        return None
    head = qualname.split(".")[0] if qualname else None
    call = f"from {module} import {head}\nsys.exit({qualname}())" if head else f"import {module}"
    return f"#!{python}\nimport sys\n{call}\n"


class _Layer:
    """A layer as planned: its tree (mounted for the writer) and what the rule writes into it."""

    def __init__(self, name: str):
        self.name = name
        self.tree = Tree()
        self.files: dict[str, dict] = {}
        self.dirs: dict[str, int] = {}
        self.sources: list[tuple[str, Tree]] = []  # (label, the part's tree as placed) of each part

    def paths(self) -> set[str]:
        """Every path the layer's tar holds, directories above its entries included."""
        out = set(self.tree.entries) | set(self.files) | set(self.dirs)
        for p in list(out):
            up = p.rpartition("/")[0]
            while up and up not in out:
                out.add(up)
                up = up.rpartition("/")[0]
        return out

    def placed(self) -> dict[str, list[str]]:
        """Which target placed each of the layer's files, as few path prefixes per target as cover
        exactly its files (a directory all of whose entries one target placed stands for them;
        "" is the whole layer). What the rule adds (the CA bundle, scripts, passwd) is in none."""
        owner: dict[str, str | None] = {p: None for p in (*self.tree.entries, *self.files)}
        for label, tree in self.sources:
            owner.update((p, label) for p in tree.entries if p in self.tree.entries)
        under: dict[str, set[str | None]] = {}
        for path, label in owner.items():
            parts = path.split("/")
            for i in range(len(parts)):  # the directories above it, "" the root
                under.setdefault("/".join(parts[:i]), set()).add(label)
        cover: dict[str, set[str]] = {}
        for path, label in owner.items():
            if label is not None:
                parts = path.split("/")
                top = next(("/".join(parts[:i]) for i in range(len(parts)) if under["/".join(parts[:i])] == {label}),
                           path)
                cover.setdefault(label, set()).add(top)
        return {label: sorted(prefixes) for label, prefixes in sorted(cover.items())}

    def content_bytes(self) -> int:
        return (sum(e.size for e in self.tree.entries.values() if isinstance(e, FileEntry))
                + sum(len(f["text"].encode()) for f in self.files.values()))


def plan_oci_image(ctx: RuleContext) -> PlanGen:
    a: OciImageAttrs = ctx.attrs
    count = len(a.layers) + (1 if a.system else 0)
    if count > image.MAX_LAYERS:
        raise ctx.fail(f"{count} layers: an image holds at most {image.MAX_LAYERS} (containerd's limit)", "layers",
                       hint="put several groups into one layer")
    if ctx.platform not in image.OCI_ARCH:
        raise ctx.fail(f"no OCI architecture for platform {ctx.platform}")
    name = ctx.label.name
    repository = a.repository or f"localhost/bgraph/{name}"
    if not _REPO.match(repository) or len(repository) > _REPO_MAX:
        raise ctx.fail(f"{name!r} is not an image name (lowercase letters, digits, '.', '_', '-')", "repository",
                       hint="give repository = \"localhost/bgraph/<lowercase name>\"")
    ref = f"{repository}:{a.tag}"

    layers: list[_Layer] = []
    if a.system:
        system = ctx.dep(a.system, "system")
        want = DEB_ARCH.get(ctx.platform)
        if system.info.get("architecture") != want or not system.info.get("sysroot"):
            raise ctx.fail(f"{a.system} is no {want} root of the image's platform ({ctx.platform}): "
                           f"{system.info.get('architecture') or 'no Debian'} packages"
                           + ("" if system.info.get("sysroot") else ", not a sysroot"), "system",
                           hint="give a deb_packages set with sysroot = true (the target platform's packages)")
        bottom = _Layer("system")
        bottom.tree = system.tree
        bottom.sources.append((_label(ctx, a.system), system.tree))
        layers.append(bottom)
        items = [sbom.Item("deb", n, v, "system", _label(ctx, a.system), arch=system.info.get("architecture"))
                 for n, v in sorted(system.info.get("packages", {}).items())]
    else:
        items = []
    tools = ctx.dep(a.tools, "tools")
    # No maintainer script runs: the CA bundle update-ca-certificates would write is made here.
    certs = Tree.from_checked({p: e for p, e in (layers[0].tree.subtree(CA_DIR).entries.items() if layers else ())
                               if p.endswith(".crt")})
    bundle = []
    if certs.entries and CA_BUNDLE not in layers[0].tree.entries:
        bundle = [ctx.exec_action("ca-certificates bundle", "CaBundle",
                                  ["/usr/bin/python3", "-I", "-S", "-c", CA_SCRIPT, "/bgraph/in/certs",
                                   "/bgraph/out/ca-certificates.crt"],
                                  inputs={"/bgraph/in/certs": certs}, outputs=["ca-certificates.crt"],
                                  host=tools, memory_mb=128)]

    # The wheels, unpacked (in-process, like any archive), all at once.
    wheel_parts = [(g, p) for g in a.layers for p in g.parts if p.wheel]
    unpacks = []
    for _g, p in wheel_parts:
        out = ctx.dep(p.wheel, "layers")
        wheel = out.info.get("wheel")
        if not wheel or wheel not in out.tree.entries:
            raise ctx.fail(f"{p.wheel} is no py_wheel (its output names no wheel)", "layers",
                           hint="a tree part places any target's output: tree = \"...\"")
        unpacks.append(ctx.extract_action(Tree({wheel: out.tree.entries[wheel]}), wheel))
    done = (yield unpacks + bundle) if unpacks or bundle else []
    unpacked = done[:len(unpacks)]
    if bundle:
        layers[0].tree = layers[0].tree.merged(Tree({CA_BUNDLE: done[-1].tree.entries["ca-certificates.crt"]}))
    wheel_trees = {}
    for (_g, p), o in zip(wheel_parts, unpacked):
        try:
            wheel_trees[id(p)] = site_packages(o.tree, f"the wheel of {p.wheel}")
        except ValueError as e:
            raise ctx.fail(str(e), "layers", hint="the wheel is malformed: fix the py_wheel's contents") from None

    site = _relpath(a.site_packages)
    for group in a.layers:
        layer = _Layer(group.name)
        trees = []
        for p in group.parts:
            tree = wheel_trees[id(p)] if p.wheel else ctx.dep(p.tree, "layers").tree
            items += _items(ctx, p, group.name)
            tree = _select(tree, p.include, p.exclude)
            if not tree.entries:
                raise ctx.fail(f"layer {group.name}: {p.tree or p.wheel} gives no files"
                               + (f" (include {p.include}, exclude {p.exclude})" if p.include or p.exclude else ""),
                               "layers")
            if p.wheel:
                scripts = _console_scripts(ctx, tree, a.python)
                # Scripts a wheel's entry points lack (a wheel built without entry_points.txt) are declared.
                scripts.update({n: _launcher(ref, a.python) for n, ref in p.scripts.items() if n not in scripts})
                for script, text in sorted(scripts.items()):
                    layer.files[f"usr/local/bin/{script}"] = {"text": text, "mode": 0o755}
            at = _relpath(p.at) if p.at is not None else (site if p.wheel else "")
            trees.append(tree.prefixed(at) if at else tree)
            layer.sources.append((_label(ctx, p.tree or p.wheel), trees[-1]))
        try:
            layer.tree = trees[0].merged(*trees[1:]) if trees else Tree()
        except ValueError as e:
            raise ctx.fail(f"layer {group.name}: {e}", "layers") from None
        for path, text in group.files.items():
            layer.files[_relpath(path)] = {"text": text, "mode": 0o644}
        layers.append(layer)

    # What maintainer scripts would have made, in the bottom layer.
    bottom = layers[0]
    for path, text in (("etc/passwd", PASSWD), ("etc/group", GROUP)):
        if path not in bottom.tree.entries:
            bottom.files.setdefault(path, {"text": text, "mode": 0o644})
    for path, mode in SYSTEM_DIRS.items():
        # always: the tree keeps no directory modes (base-files' empty tmp/ is a DirEntry, written 0755);
        # not below a link of the system's (var -> ...), which holds its own
        if not any(isinstance(bottom.tree.entries.get(up), SymlinkEntry) for up in _parents(path)):
            bottom.dirs[path] = mode
    for layer in layers:  # what the rule writes replaces the tree's entry at that path
        written = set(layer.files) | set(layer.dirs)
        if written & set(layer.tree.entries):
            layer.tree = Tree.from_checked({p: e for p, e in layer.tree.entries.items() if p not in written})

    _check(ctx, layers)
    _inherit_dir_modes(layers)
    modes = {_relpath(p): (p, m) for p, m in sorted(a.modes.items())}
    everywhere = set().union(*(layer.paths() for layer in layers))
    unmatched = sorted(given for path, (given, _m) in modes.items() if path not in everywhere)
    if unmatched:
        raise ctx.fail(f"modes names {', '.join(repr(p) for p in unmatched)}, a path no layer holds", "modes",
                       hint="give the path as it is in the image, without a leading / (e.g. usr/bin/app)")

    script = tar_script()
    actions = []
    for layer in layers:
        paths = layer.paths()
        spec = {"root": "/bgraph/in/root", "out": "/bgraph/out/layer.tar", "meta": "/bgraph/out/layer.json",
                "mtime": EPOCH, "files": layer.files, "dirs": layer.dirs,
                "modes": {p: int(m, 8) for p, (_given, m) in modes.items() if p in paths}}
        actions.append(ctx.exec_action(
            f"layer {layer.name}", "OciLayer",
            ["/usr/bin/python3", "-I", "-S", "-c", script, "layer",
             *_spec_args(ctx, spec, f"layer {layer.name}'s inline files")],
            inputs={"/bgraph/in/root": layer.tree} if layer.tree.entries else {},
            outputs=["layer.tar", "layer.json"], host=tools, memory_mb=256))
    written = yield actions
    described = []
    for layer, out in zip(layers, written):
        try:
            meta = json.loads(ctx.read(out.tree.entries["layer.json"]))
            described.append(image.Layer(layer.name, meta["digest"], int(meta["size"])))
        except (KeyError, ValueError) as e:
            raise ctx.fail(f"layer {layer.name}: the writer left no digest ({e})") from None

    env = {"PATH": DEFAULT_PATH, **a.env}
    env_list = [f"{k}={v}" for k, v in sorted(env.items())]  # sorted as labels are: TOML order is no input
    labels = {"org.opencontainers.image.title": name, **a.labels, "bgraph.target": str(ctx.label)}
    docs = image.documents(platform=ctx.platform, layers=described, ref=ref, created=EPOCH,
                           created_by=f"bgraph {ctx.label}", env=env_list, entrypoint=a.entrypoint, cmd=a.cmd,
                           workdir=a.workdir, user=a.user, labels=labels)
    summary = {"ref": ref, "platform": ctx.platform, "config": docs.config_digest, "manifest": docs.manifest_digest,
               "layers": [{"name": l.name, "digest": l.digest, "size": l.size, "placed": planned.placed()}
                          for l, planned in zip(described, layers)]}
    members: dict[str, dict] = {
        "oci-layout": {"text": docs.layout.decode()},
        "index.json": {"text": docs.index.decode()},
        "manifest.json": {"text": docs.docker_manifest.decode()},
        image.blob_path(docs.config_digest): {"text": docs.config.decode()},
        image.blob_path(docs.manifest_digest): {"text": docs.manifest.decode()},
    }
    inputs = {}
    for i, (layer, out) in enumerate(zip(described, written)):
        mount = f"/bgraph/in/layers/{i}"
        inputs[mount] = Tree({"layer.tar": out.tree.entries["layer.tar"]})
        members.setdefault(image.blob_path(layer.digest), {"file": f"{mount}/layer.tar"})
    text = sbom.render(ref=ref, tag=a.tag, config=docs.config_digest, manifest=docs.manifest_digest, epoch=EPOCH,
                       items=items)
    chunks = _chunks(text)
    sbom_action = ctx.exec_action("image sbom", "OciSbom",
                                  ["/usr/bin/python3", "-I", "-S", "-c", SBOM_SCRIPT, "/bgraph/out/sbom.cdx.json", *chunks],
                                  inputs={}, outputs=["sbom.cdx.json"], host=tools, memory_mb=64)
    summary["sbom"] = "sbom.cdx.json"
    meta_text = json.dumps(summary, indent=1, sort_keys=True) + "\n"
    if not a.archive:
        texts = {p: m for p, m in members.items() if "text" in m}
        spec = {"out": "/bgraph/out", "members": texts, "meta": "/bgraph/out/image.json", "meta_text": meta_text}
        [docs_out, bom] = yield [ctx.exec_action(
            f"image layout {ref}", "OciLayout",
            ["/usr/bin/python3", "-I", "-S", "-c", script, "layout", *_spec_args(ctx, spec, CONFIG_WHAT)],
            inputs={}, outputs=["image.json", *sorted(texts)], host=tools, memory_mb=128), sbom_action]
        blobs = Tree({image.blob_path(l.digest): out.tree.entries["layer.tar"] for l, out in zip(described, written)})
        return TargetOutput(docs_out.tree.merged(blobs, bom.tree), {**summary, "layout": True})
    spec = {"out": "/bgraph/out/image.tar", "mtime": EPOCH, "members": members, "meta": "/bgraph/out/image.json",
            "meta_text": meta_text}
    [archive, bom] = yield [ctx.exec_action(
        f"image {ref}", "OciImage",
        ["/usr/bin/python3", "-I", "-S", "-c", script, "image", *_spec_args(ctx, spec, CONFIG_WHAT)],
        inputs=inputs, outputs=["image.tar", "image.json"], host=tools, memory_mb=256), sbom_action]
    return TargetOutput(archive.tree.merged(bom.tree), {**summary, "image": "image.tar"})


def _chunks(text: str) -> list[str]:
    """`text` in arguments of at most SBOM_CHUNK characters (one, the same as before, when it fits)."""
    return [text[i:i + SBOM_CHUNK] for i in range(0, len(text), SBOM_CHUNK)] or [""]


def _spec_args(ctx: RuleContext, spec: dict, what: str) -> list[str]:
    """The writer's JSON spec as argv chunks (tarball.main joins them); refused past ARGV_BUDGET."""
    text = json.dumps(spec, sort_keys=True)  # ASCII: a character is a byte
    if len(text) > ARGV_BUDGET:
        raise ctx.fail(f"{what} take {len(text) >> 10} KiB, more than the {ARGV_BUDGET >> 10} KiB an action's "
                       "command line may carry", "layers" if what.startswith("layer") else "labels",
                       hint="put big files in a tree (a genrule's output) placed with `from`, and keep labels, "
                            "env and inline files small")
    return _chunks(text)


def _label(ctx: RuleContext, text: str) -> str:
    return str(parse_label(text, package=ctx.label.package, where=ctx.where("layers")))


def _items(ctx: RuleContext, part: Part, layer: str) -> list[sbom.Item]:
    """What one part of a layer brings, for the SBOM: the locked wheels of a python_lock tree (with
    their sha256), a bgraph-built wheel (its sha256), or another target's tree."""
    label = _label(ctx, part.tree or part.wheel)
    out = ctx.dep(part.tree or part.wheel, "layers")
    if part.wheel:
        name = out.info["wheel"]
        dist, version = name.split("-")[:2]
        digest = hashlib.sha256(ctx.read(out.tree.entries[name])).hexdigest()
        return [sbom.Item("wheel", dist, version, layer, label, sha256=digest, extra=(("file", name),))]
    wheels = out.info.get("wheels")
    if isinstance(wheels, dict):  # a python_lock target: every wheel it unpacked
        return [sbom.Item("pypi", n, out.info["packages"][n], layer, label, sha256=w["sha256"],
                          extra=(("file", w["filename"]), ("lock", out.info["lock"])))
                for n, w in sorted(wheels.items())]
    return [sbom.Item("tree", label, None, layer, label)]


def _parents(path: str) -> list[str]:
    """The directories above `path`, nearest last ("a/b/c" -> ["a", "a/b"])."""
    parts = path.split("/")
    return ["/".join(parts[:i]) for i in range(1, len(parts))]


def _inherit_dir_modes(layers: list[_Layer]) -> None:
    """A directory a lower layer wrote with its own mode (/tmp 1777, /root 0700) keeps it in every
    layer above that holds it: the writer would add it as 0755, and the top layer's mode wins."""
    modes: dict[str, int] = {}
    for layer in layers:
        if modes:
            kept = set(layer.files) | {p for p, e in layer.tree.entries.items() if not isinstance(e, DirEntry)}
            for path in layer.paths() & set(modes):
                if path not in kept:
                    layer.dirs.setdefault(path, modes[path])
        modes.update(layer.dirs)


def _kinds(layer: _Layer) -> tuple[dict[str, str], set[str]]:
    """The layer's files and symlinks (path -> 'a file' | 'a symlink'), and its directories (those
    above its entries included)."""
    other = {p: ("a symlink" if isinstance(e, SymlinkEntry) else "a file")
             for p, e in layer.tree.entries.items() if not isinstance(e, DirEntry)}
    other.update((p, "a file") for p in layer.files)
    dirs = set(layer.dirs) | {p for p, e in layer.tree.entries.items() if isinstance(e, DirEntry)}
    for path in layer.paths():
        up = path.rpartition("/")[0]
        while up and up not in dirs:
            dirs.add(up)
            up = up.rpartition("/")[0]
    return other, dirs


def _check_kinds(ctx: RuleContext, layers: list[_Layer]) -> None:
    """Refuse a path that is a file (or symlink) where an entry of the same layer or another one
    needs a directory, or a directory over a lower layer's file: in one layer the tar would hold a
    file `d` and entries `d/...` (a daemon refuses it); across layers the upper one would hide the
    lower one's whole tree (or file) without a word."""
    lower_dirs: dict[str, str] = {}
    lower_files: dict[str, str] = {}
    for layer in layers:
        other, dirs = _kinds(layer)
        for path in sorted(dirs & set(other)):
            below = min((p for p in layer.paths() if p.startswith(path + "/")), default=path)
            raise ctx.fail(f"layer {layer.name} holds {path} as {other[path]} and {below} below it", "layers",
                           hint=f"move one of them: {path} cannot be both a file and a directory")
        for path in sorted(set(other) & set(lower_dirs)):
            raise ctx.fail(f"layer {layer.name} puts {other[path]} at {path}, a directory in layer "
                           f"{lower_dirs[path]}: it would hide that directory's whole tree", "layers",
                           hint=f"leave {path} out of one of the layers (an exclude glob), or place it elsewhere")
        for path in sorted(dirs & set(lower_files)):
            raise ctx.fail(f"layer {layer.name} needs {path} as a directory, {lower_files[path]}", "layers",
                           hint=f"leave {path} out of one of the layers (an exclude glob), or place it elsewhere")
        dirs -= set(other)  # (none: refused above)
        for path in dirs:
            lower_dirs.setdefault(path, layer.name)
            lower_files.pop(path, None)
        for path, kind in other.items():
            lower_files[path] = f"{kind} in layer {layer.name}"
            lower_dirs.pop(path, None)


def _check(ctx: RuleContext, layers: list[_Layer]) -> None:
    """Refuse, before any layer is written, a layer over 10 GiB, an entry that a lower layer's
    (or its own) symlink would turn into a directory (`lib/x` over the system's `lib -> usr/lib`),
    and a file where a directory is (_check_kinds)."""
    links: dict[str, str] = {}
    for layer in layers:
        for path in sorted(set(layer.tree.entries) | set(layer.files)):
            hit = next((g for g in ctx.attrs.forbid if fnmatch.fnmatchcase(path, g)), None)
            if hit:
                raise ctx.fail(f"layer {layer.name} holds {path}, which forbid ({hit}) refuses",
                               "forbid", hint="leave it out with an exclude glob of the part that brings it")
        size = layer.content_bytes()
        if size > image.MAX_LAYER_BYTES:
            raise ctx.fail(f"layer {layer.name} holds {size / (1 << 30):.1f} GiB, over the "
                           f"{image.MAX_LAYER_BYTES >> 30} GiB a layer may hold", "layers",
                           hint="split it into several layers (include/exclude globs of one tree)")
        links.update({p: layer.name for p, e in layer.tree.entries.items() if isinstance(e, SymlinkEntry)})
        if not links:
            continue
        for path in sorted(layer.paths()):
            up = posixpath.dirname(path)
            while up:
                if up in links:
                    raise ctx.fail(f"layer {layer.name} puts {path} below {up}, a symlink in "
                                   f"layer {links[up]}: the directory would replace the link", "layers",
                                   hint=f"place it at the link's target ({up} is a link)")
                up = posixpath.dirname(up)
    _check_kinds(ctx, layers)
