"""`bgraph why //images:X /path/in/the/image`: which layer holds a path, which target put it there,
and, for a file of a wheel, which package (version, wheel file, sha256, lock).

Read from the built image's output (image.json, sbom.cdx.json and the layer tars, found through its
bgraph-out link): the path is looked up as a container sees it, each directory on the way in the top
layer that provides it, through directory symlinks (/bin -> usr/bin) and whiteouts; a path below an
upper layer's file is hidden. The answer names the top layer holding the path and the lower ones it
hides. A layer tar is uncompressed, so only its 512-byte headers are read. A file of a wheel is matched by
the RECORD of the `.dist-info` in that layer that lists it; a file of the system layer names the
Debian set (its packages keep no file lists in the image: no dpkg database is written).
"""

from __future__ import annotations

import csv
import io
import json
import posixpath
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

from build_graph.errors import BgraphError
from build_graph.oci.image import blob_path


class ImageWhyError(BgraphError):
    layer = "why"


@dataclass
class PathOrigin:
    path: str
    layer: str
    index: int  # 1 = the bottom layer
    layers: int
    digest: str
    targets: list[str]
    package: dict = field(default_factory=dict)  # name, version, and for a locked wheel file/sha256/lock
    shadowed: list[str] = field(default_factory=list)  # lower layers holding the same path

    def lines(self) -> list[str]:
        """The answer as text, one fact a line."""
        out = [f"/{self.path}: layer {self.layer} ({self.index} of {self.layers}, {self.digest[:19]}…), "
               f"placed by {', '.join(self.targets) or 'the image rule (a file it writes)'}"]
        if self.package:
            p = self.package
            line = f"  package {p['name']} {p.get('version') or ''}".rstrip()
            if p.get("file"):
                line += f" ({p['file']}"
                line += f", sha256 {p['sha256']}" if p.get("sha256") else ""
                line += f", {p['lock']})" if p.get("lock") else ")"
            out.append(line)
        if self.shadowed:
            out.append(f"  also in lower layer(s) {', '.join(self.shadowed)}, which this one hides")
        return out


class _Layer:
    """One layer's tar, from the layout's blob or from inside image.tar (both seekable)."""

    def __init__(self, image_dir: Path, digest: str, name: str = ""):
        self.name = name
        blob = image_dir / blob_path(digest)
        self.outer = None
        if blob.exists():
            self.tar = tarfile.open(blob)
        elif (image_dir / "image.tar").exists():
            self.outer = tarfile.open(image_dir / "image.tar")
            self.tar = tarfile.open(fileobj=self.outer.extractfile(blob_path(digest)))
        else:
            raise ImageWhyError(f"{image_dir} holds neither the layer {digest[:19]}… nor image.tar",
                                hint="build the image again")
        self.members = {m.name.rstrip("/"): m for m in self.tar}

    def close(self) -> None:
        self.tar.close()
        if self.outer is not None:
            self.outer.close()


def _record_owner(layer: _Layer, path: str) -> tuple[str, str] | None:
    """(distribution, version) whose .dist-info RECORD, in this layer, lists `path`."""
    records = [n for n in layer.members if n.endswith(".dist-info/RECORD")]
    members, t = layer.members, layer.tar
    for name in records:
        site = posixpath.dirname(posixpath.dirname(name))
        if not path.startswith(site + "/"):
            continue
        rel = path[len(site) + 1:]
        data = t.extractfile(members[name]).read().decode(errors="replace")
        if any(row and row[0] == rel for row in csv.reader(io.StringIO(data))):
            dist, _, version = posixpath.basename(posixpath.dirname(name))[:-len(".dist-info")].partition("-")
            return dist, version
    return None


WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"
MAX_LINKS = 40  # symlinks followed on one lookup (Linux's limit)


class _View:
    """The layers as a container sees them: the top one holding a path wins, a whiteout
    (`.wh.<name>`, or `.wh..wh..opq` in a directory) hides what the layers below hold there."""

    def __init__(self, opened: list[_Layer], ref: str):
        self.opened, self.ref = opened, ref  # bottom first

    def top(self, rel: str) -> tuple[int, tarfile.TarInfo] | None:
        """(index, member) of the top layer that provides `rel` itself (no link followed)."""
        parent, _, name = rel.rpartition("/")
        ups = [rel.rsplit("/", k)[0] for k in range(1, rel.count("/") + 1)]
        for i in range(len(self.opened) - 1, -1, -1):
            members = self.opened[i].members
            if rel in members:
                return i, members[rel]
            if (f"{parent}/" if parent else "") + WHITEOUT + name in members:
                return None
            if any(f"{up}/{OPAQUE}" in members for up in ups):
                return None
        return None

    def resolve(self, rel: str) -> tuple[str, int, tarfile.TarInfo]:
        """The path `rel` names once every directory symlink on the way is followed (the last
        component is not), with the layer that provides it; ImageWhyError where none does."""
        hops = 0
        parts = [p for p in rel.split("/") if p]
        done: list[str] = []
        while parts:
            part = parts.pop(0)
            if part == "..":
                done = done[:-1]
                continue
            here = "/".join(done + [part])
            found = self.top(here)
            if found is None:
                raise ImageWhyError(f"/{here} is in no layer of {self.ref}",
                                    hint="give the path as the container sees it, e.g. /usr/bin/python3.11")
            i, member = found
            if not parts:
                return here, i, member
            if member.issym():
                hops += 1
                if hops > MAX_LINKS:
                    raise ImageWhyError(f"/{rel}: more than {MAX_LINKS} symlinks on the way (a loop?)")
                target = member.linkname
                parts = [p for p in target.split("/") if p and p != "."] + parts
                if target.startswith("/"):
                    done = []
                continue
            if not member.isdir():
                raise ImageWhyError(f"/{rel} is hidden: layer {self.opened[i].name} holds /{here} as a file, "
                                    "not a directory", hint=f"ask for /{here} itself")
            done.append(part)
        raise ImageWhyError("the image's root is no file of a layer", hint="give a path below /")


def origin(image_dir: Path, path: str) -> PathOrigin:
    """Where `path` (absolute, in the image, through its directory symlinks) comes from."""
    meta = json.loads((image_dir / "image.json").read_text())
    try:
        bom = json.loads((image_dir / "sbom.cdx.json").read_text())
    except FileNotFoundError:
        bom = {"components": []}
    layers = meta["layers"]
    opened: list[_Layer] = []
    try:
        for layer in layers:
            opened.append(_Layer(image_dir, layer["digest"], layer["name"]))
        rel, top, _member = _View(opened, meta["ref"]).resolve(posixpath.normpath(path).lstrip("/"))
        found = _found(None, opened[top], layers[top], top, layers, bom, rel)
        for i in range(top - 1, -1, -1):  # lower layers holding the same path: hidden by this one
            if rel in opened[i].members:
                _found(found, opened[i], layers[i], i, layers, bom, rel)
        return found
    finally:
        for o in opened:
            o.close()


def _found(found: PathOrigin | None, opened: _Layer, layer: dict, i: int, layers: list, bom: dict,
           rel: str) -> PathOrigin:
    """The origin, from the top layer that holds the path; a lower one is noted as hidden."""
    if found is not None:
        found.shadowed.append(layer["name"])
        return found
    comps = [c for c in bom.get("components", [])
             if {"name": "bgraph:layer", "value": layer["name"]} in c.get("properties", [])]
    props = [{p["name"]: p["value"] for p in c.get("properties", [])} for c in comps]
    placed = layer.get("placed")
    if placed is not None:  # which target placed which files (oci_image's cover); none: the rule wrote it
        targets = [t for t, prefixes in placed.items()
                   if any(p == "" or rel == p or rel.startswith(p + "/") for p in prefixes)]
    else:  # an image built before the cover was kept: every target of the layer
        targets = sorted({p["bgraph:target"] for p in props if "bgraph:target" in p})
    found = PathOrigin(rel, layer["name"], i + 1, len(layers), layer["digest"], targets)
    owner = _record_owner(opened, rel)
    if owner:
        dist, version = owner
        norm = dist.replace("_", "-").lower()
        for c, p in zip(comps, props):
            if c["name"].replace("_", "-").lower() == norm and c.get("version") == version:
                sha = next((h["content"] for h in c.get("hashes", []) if h.get("alg") == "SHA-256"), None)
                found.package = {"name": c["name"], "version": version, "file": p.get("bgraph:file"),
                                 "sha256": sha, "lock": p.get("bgraph:lock")}
                found.targets = [p["bgraph:target"]]
                break
        else:
            found.package = {"name": dist, "version": version}
    return found
