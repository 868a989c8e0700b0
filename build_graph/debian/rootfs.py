"""Per-package trees -> one root-layout tree, made usable without maintainer scripts.

- usrmerge: Debian 12 packages may still ship /bin, /sbin, /lib, /lib64 (and /lib32, /libx32);
  those paths fold under usr/, and the tree gets the top-level links bin -> usr/bin, etc., for
  each such directory it has. Symlinks are re-aimed so they point where they pointed before
  the fold (a link's target is resolved in the package's own layout, then folded).
- Conflicts: a path two packages ship with different content is an error naming both, unless
  `prefer` names the package whose copy wins. An entry below another package's symlink or file
  is an error too (materializing it would write through the link).
- links: alternatives-style symlinks (what update-alternatives would make), path -> target;
  the target must exist in the tree.
"""

from __future__ import annotations

import posixpath

from build_graph.model import DirEntry, Entry, SymlinkEntry, Tree, check_relpath

MERGED_DIRS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")


class RootfsError(ValueError):
    def __init__(self, message: str, key: str | None = None, hint: str | None = None):
        super().__init__(message)
        self.key = key
        self.hint = hint


def fold(path: str) -> str:
    """lib/x86_64-linux-gnu/libc.so.6 -> usr/lib/x86_64-linux-gnu/libc.so.6 (other paths unchanged)."""
    return f"usr/{path}" if path.split("/", 1)[0] in MERGED_DIRS else path


def _aim(link_dir: str, resolved: str) -> str:
    return posixpath.relpath(resolved, link_dir or ".")


def folded(tree: Tree) -> dict[str, Entry]:
    """One package's tree with its paths folded under usr/ and its symlinks re-aimed."""
    out: dict[str, Entry] = {}
    for path, entry in tree.entries.items():
        new = fold(path)
        if isinstance(entry, SymlinkEntry):
            resolved = posixpath.normpath(posixpath.join(posixpath.dirname(path), entry.target))
            if path in MERGED_DIRS and fold(resolved) == new:
                continue  # the package ships the top-level usrmerge link itself: we add our own
            if new != path or fold(resolved) != resolved:
                entry = SymlinkEntry(_aim(posixpath.dirname(new), fold(resolved)))
        out[new] = entry
    return out


def assemble(packages: dict[str, Tree], prefer: dict[str, str] | None = None,
             links: dict[str, str] | None = None) -> Tree:
    """Merge folded package trees (name -> tree), add the usrmerge and alternatives links."""
    prefer = {fold(check_relpath(p)): pkg for p, pkg in (prefer or {}).items()}
    for path, pkg in prefer.items():
        if pkg not in packages:
            raise RootfsError(f"prefer: {path} names {pkg!r}, which is not in the lock", key="prefer")
    entries: dict[str, Entry] = {}
    owner: dict[str, str] = {}
    for name in sorted(packages):
        for path, entry in folded(packages[name]).items():
            have = entries.get(path)
            if have is not None and have != entry:
                win = prefer.get(path)
                if win not in (owner[path], name):
                    raise RootfsError(f"packages {owner[path]} and {name} both ship {path} with different content",
                                      key="prefer", hint=f'name the one that wins: prefer = {{ "{path}" = '
                                                         f'"{owner[path]}" }}')
                if win == owner[path]:
                    continue
            entries[path] = entry
            owner[path] = name
    _check_nesting(entries, owner)
    for path, target in sorted((links or {}).items()):
        _add_link(entries, owner, path, target)
    for d in MERGED_DIRS:
        if any(p.startswith(f"usr/{d}/") or p == f"usr/{d}" for p in entries):
            entries[d] = SymlinkEntry(f"usr/{d}")
    # Directories are implied by their contents: keep only empty ones.
    parents = _parents(entries)
    return Tree({p: e for p, e in entries.items() if not (isinstance(e, DirEntry) and p in parents)})


def _walk_up(paths):
    """(path, directory) for each directory above a path of `paths`, each directory once: a walk
    up stops at a directory already seen (a system's ~20,000 paths share few directories, and this
    runs on every plan of one)."""
    seen: set[str] = set()
    for path in paths:
        cut = path.rfind("/")
        while cut > 0:
            up = path[:cut]
            if up in seen:
                break
            seen.add(up)
            yield path, up
            cut = up.rfind("/")


def _parents(paths) -> set[str]:
    """Every directory above some path of `paths`."""
    return {up for _path, up in _walk_up(paths)}


def _check_nesting(entries: dict[str, Entry], owner: dict[str, str]) -> None:
    for path, up in _walk_up(entries):
        above = entries.get(up)
        if above is not None and not isinstance(above, DirEntry):
            what = "symlink" if isinstance(above, SymlinkEntry) else "file"
            raise RootfsError(f"{path} of package {owner[path]} lies below the {what} {up} of package "
                              f"{owner[up]}", key="packages")


def _add_link(entries: dict[str, Entry], owner: dict[str, str], path: str, target: str) -> None:
    try:
        where = fold(check_relpath(path))
    except ValueError:
        raise RootfsError(f"links: {path!r} must be a path inside the tree", key="links") from None
    if where in entries or any(p.startswith(where + "/") for p in entries):
        raise RootfsError(f"links: {where} is already shipped by package {owner.get(where, '?')}", key="links")
    base = posixpath.dirname(where)
    naive = posixpath.normpath(target.lstrip("/") if target.startswith("/") else posixpath.join(base, target))
    if naive == ".." or naive.startswith("../"):
        raise RootfsError(f"links: {path} -> {target} points outside the tree", key="links")
    resolved = fold(naive)
    if resolved not in entries and not any(p.startswith(resolved + "/") for p in entries):
        raise RootfsError(f"links: {path} -> {target}: {resolved} is not in the tree", key="links")
    # Relative targets stay as written unless the fold moved what they name.
    keep = not target.startswith("/") and resolved == naive
    entries[where] = SymlinkEntry(target if keep else _aim(base, resolved))
    owner[where] = "links"
