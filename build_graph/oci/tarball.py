"""Deterministic tar files: OCI layers and the image archive.

Standard library only: this module's text is also the script the `oci_image` rule's actions run
(`python3 -I -S -c <this file> layer|image|layout SPEC...`) under the pinned CPython of //toolchains:host,
so its text is part of every layer's key. Headers are written by hand (512-byte POSIX ustar,
with a PAX record only where ustar cannot hold a field), not by `tarfile`, whose bytes changed
between CPython versions (OCI.md: 3.7/3.8 wrote devmajor/devminor digits into every header).

Every entry: mtime SOURCE_DATE_EPOCH, uid/gid 0, empty user/group names; directories 0755,
executables 0755, other files 0644, symlinks 0777, unless the spec overrides a path's mode;
entries sorted by their UTF-8 path bytes, parents added before children; no hard links (a file
stored twice in the tree is written twice); the archive ends with two zero blocks. A tree is read
as the store materializes it: a file's exec bit, a link's target, a directory (nothing else).
"""

import hashlib
import json
import os
import stat
import sys

BLOCK = 512
CHUNK = 1 << 20
DIR_MODE, EXEC_MODE, FILE_MODE, LINK_MODE = 0o755, 0o755, 0o644, 0o777
PAX_NAME = b"././@PaxHeader"


def _number(value, width):
    """An octal field of `width` bytes (digits and a NUL), or None where it does not fit."""
    text = b"%0*o" % (width - 1, value)
    return text + b"\0" if len(text) == width - 1 else None


def _field(value, width):
    return value + b"\0" * (width - len(value))


def _split(name):
    """ustar's (prefix, name) for a path, or None where no '/' splits it into 155 + 100 bytes."""
    if len(name) <= 100:
        return b"", name
    cut = name.rfind(b"/", 0, 156)
    while cut > 0:
        if len(name) - cut - 1 <= 100 and cut <= 155:
            return name[:cut], name[cut + 1:]
        cut = name.rfind(b"/", 0, cut)
    return None


def _pax_records(records):
    out = b""
    for key, value in records:
        body = b" " + key + b"=" + value + b"\n"
        n = len(body) + 1
        while len(str(n).encode()) + len(body) != n:
            n += 1
        out += str(n).encode() + body
    return out


def _ustar(name, typeflag, size, mode, mtime, linkname):
    prefix, short = _split(name) or (b"", name[:100])
    head = (_field(short, 100) + _number(mode, 8) + _number(0, 8) + _number(0, 8) + _number(size, 12)
            + _number(mtime, 12) + b" " * 8 + typeflag + _field(linkname[:100], 100) + b"ustar\x0000"
            + b"\0" * 32 + b"\0" * 32 + b"\0" * 8 + b"\0" * 8 + _field(prefix, 155) + b"\0" * 12)
    checksum = b"%06o\0 " % sum(head)
    return head[:148] + checksum + head[156:]


def header(name, typeflag, size, mode, mtime, linkname=b""):
    """The header block(s) of one entry: a PAX header first where the path, the link target or
    the size does not fit ustar."""
    records = []
    if _split(name) is None:
        records.append((b"path", name))
    if len(linkname) > 100:
        records.append((b"linkpath", linkname))
    if _number(size, 12) is None:
        records.append((b"size", str(size).encode()))
    out = b""
    if records:
        data = _pax_records(records)
        out = _ustar(PAX_NAME, b"x", len(data), FILE_MODE, mtime, b"") + data + _padding(len(data))
        size = 0 if _number(size, 12) is None else size
    return out + _ustar(name, typeflag, size, mode, mtime, linkname)


def _padding(size):
    return b"\0" * (-size % BLOCK)


class Writer:
    """A tar stream into `out` (a binary file), hashed with sha256 as it is written."""

    def __init__(self, out, mtime):
        self.out, self.mtime = out, mtime
        self.sha256 = hashlib.sha256()
        self.size = 0

    def _write(self, data):
        self.out.write(data)
        self.sha256.update(data)
        self.size += len(data)

    def directory(self, name, mode=DIR_MODE):
        self._write(header(name.rstrip(b"/") + b"/", b"5", 0, mode, self.mtime))

    def symlink(self, name, target, mode=LINK_MODE):
        self._write(header(name, b"2", 0, mode, self.mtime, target))

    def data(self, name, data, mode=FILE_MODE):
        self._write(header(name, b"0", len(data), mode, self.mtime))
        self._write(data + _padding(len(data)))

    def file(self, name, path, size, mode=FILE_MODE):
        """A file copied from disk; it must still hold `size` bytes."""
        self._write(header(name, b"0", size, mode, self.mtime))
        left = size
        with open(path, "rb") as f:
            while left:
                chunk = f.read(min(CHUNK, left))
                if not chunk:
                    raise ValueError(f"{path}: shorter than its {size} bytes")
                self._write(chunk)
                left -= len(chunk)
            if f.read(1):
                raise ValueError(f"{path}: longer than its {size} bytes")
        self._write(_padding(size))

    def close(self):
        self._write(b"\0" * (2 * BLOCK))
        return "sha256:" + self.sha256.hexdigest(), self.size


def scan(root):
    """path bytes -> ("dir",) | ("link", target) | ("file", disk path, size, executable), for
    everything below `root` (none if it does not exist); symlinks are never followed."""
    found = {}
    if not os.path.isdir(root):
        return found
    stack = [(os.fsencode(root), b"")]
    while stack:
        disk, rel = stack.pop()
        with os.scandir(disk) as it:
            for e in it:
                path = rel + e.name if not rel else rel + b"/" + e.name
                st = e.stat(follow_symlinks=False)
                if stat.S_ISLNK(st.st_mode):
                    found[path] = ("link", os.readlink(e.path))
                elif stat.S_ISDIR(st.st_mode):
                    found[path] = ("dir",)
                    stack.append((e.path, path))
                elif stat.S_ISREG(st.st_mode):
                    found[path] = ("file", e.path, st.st_size, bool(st.st_mode & 0o111))
                else:
                    raise ValueError(f"{e.path!r}: not a file, directory or symlink")
    return found


def write_layer(out, root, mtime, files=None, dirs=None, modes=None):
    """The layer tar of the tree at `root` plus `files` (path -> {"text", "mode"}) and `dirs`
    (path -> mode), the latter replacing tree entries at the same path; `modes` overrides the
    mode of any path. Returns ("sha256:<hex>", size)."""
    entries = scan(root)
    for path, mode in (dirs or {}).items():
        entries[os.fsencode(path)] = ("dir", mode)
    for path, spec in (files or {}).items():
        entries[os.fsencode(path)] = ("data", spec["text"].encode(), spec.get("mode", FILE_MODE))
    for path in list(entries):
        parent = path.rpartition(b"/")[0]
        while parent and parent not in entries:
            entries[parent] = ("dir",)
            parent = parent.rpartition(b"/")[0]
    overrides = {os.fsencode(p): m for p, m in (modes or {}).items()}
    w = Writer(out, mtime)
    for path in sorted(entries):
        kind = entries[path]
        if kind[0] == "dir":
            w.directory(path, overrides.get(path, kind[1] if len(kind) > 1 else DIR_MODE))
        elif kind[0] == "link":
            w.symlink(path, kind[1], overrides.get(path, LINK_MODE))
        elif kind[0] == "data":
            w.data(path, kind[1], overrides.get(path, kind[2]))
        else:
            w.file(path, kind[1], kind[2], overrides.get(path, EXEC_MODE if kind[3] else FILE_MODE))
    return w.close()


def write_archive(out, mtime, members):
    """An archive of `members`: path -> {"text": str} or {"file": disk path}; directories are
    added for their parents. Returns ("sha256:<hex>", size)."""
    entries = {}
    for path, spec in members.items():
        entries[os.fsencode(path)] = spec
        parent = os.fsencode(path).rpartition(b"/")[0]
        while parent and parent not in entries:
            entries[parent] = None
            parent = parent.rpartition(b"/")[0]
    w = Writer(out, mtime)
    for path in sorted(entries):
        spec = entries[path]
        if spec is None:
            w.directory(path)
        elif "text" in spec:
            w.data(path, spec["text"].encode())
        else:
            w.file(path, spec["file"], os.stat(spec["file"]).st_size)
    return w.close()


def write_layout(out_dir, members):
    """The documents of an image layout (`members`: path -> {"text": str}) under `out_dir`; its
    blobs are the layer actions' own files, placed by the rule (no copy)."""
    for path, spec in sorted(members.items()):
        target = os.path.join(out_dir, path)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "wb") as f:
            f.write(spec["text"].encode())


def main(argv):
    """`layer SPEC`, `image SPEC` or `layout SPEC` (SPEC: JSON in one or more arguments, joined: one
    argument holds at most 128 KiB; see the oci_image rule)."""
    what, spec = argv[0], json.loads("".join(argv[1:]))
    if what == "layout":
        write_layout(spec["out"], spec["members"])
        with open(spec["meta"], "w") as meta:
            meta.write(spec["meta_text"])
        return
    with open(spec["out"], "wb") as out:
        if what == "layer":
            digest, size = write_layer(out, spec["root"], spec["mtime"], spec.get("files"), spec.get("dirs"),
                                       spec.get("modes"))
        else:
            digest, size = write_archive(out, spec["mtime"], spec["members"])
    if what == "layer":
        with open(spec["meta"], "w") as meta:
            meta.write(json.dumps({"digest": digest, "size": size}, sort_keys=True, separators=(",", ":")))
    elif spec.get("meta"):
        with open(spec["meta"], "w") as meta:
            meta.write(spec["meta_text"])


if __name__ == "__main__":
    main(sys.argv[1:])
