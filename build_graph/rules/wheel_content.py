"""What a wheel holds, gathered from several trees: each path placed once, and no symlinks.

A wheel (a zip) cannot hold a symlink, and the wheel script reads its input tree in the
sandbox, where a link taken out of its tree (tree_dirs, files, include) would be followed at
its new place: dangling there, or naming another file. So every link is resolved here, at plan
time, against the tree it came from, as the file system would follow it; a link to a file
ships that file's bytes and mode, and anything else (a directory, a path out of the tree, a
dangling link, a loop) is refused with its name.
"""

from __future__ import annotations

from build_graph.model import DirEntry, Entry, FileEntry, SymlinkEntry, Tree

MAX_HOPS = 40  # as Linux: more links than this on one path is ELOOP


class LinkError(ValueError):
    """A link that does not name a file of its own tree."""


def _directories(tree: Tree) -> set[str]:
    """Every directory of `tree`, its root ("") included (memoized on the tree: several links share it)."""
    dirs = tree.__dict__.get("_wheel_dirs")
    if dirs is None:
        dirs = {""}
        for path, entry in tree.entries.items():
            if isinstance(entry, DirEntry):
                dirs.add(path)
            cut = path.rfind("/")
            while cut > 0 and (parent := path[:cut]) not in dirs:
                dirs.add(parent)
                cut = path.rfind("/", 0, cut)
        tree.__dict__["_wheel_dirs"] = dirs
    return dirs


def resolve(tree: Tree, path: str) -> tuple[str, FileEntry]:
    """(path, entry) of the file that `path` names in `tree`, following links on the way as the
    file system would; LinkError says why there is none."""
    todo = path.split("/")[::-1]  # components still to walk, the next one last
    done: list[str] = []  # the directories walked so far, links already followed
    hops = 0
    while todo:
        part = todo.pop()
        if part in ("", "."):
            continue
        if part == "..":
            if not done:
                raise LinkError("points outside the tree")
            done.pop()
            continue
        here = "/".join((*done, part))
        entry = tree.entries.get(here)
        if isinstance(entry, SymlinkEntry):
            hops += 1
            if hops > MAX_HOPS:
                raise LinkError("is a loop of links")
            if entry.target.startswith("/"):
                raise LinkError(f"points outside the tree (to the absolute path {entry.target})")
            todo.extend(entry.target.split("/")[::-1])
            continue
        if isinstance(entry, FileEntry):
            if any(rest not in ("", ".") for rest in todo):
                raise LinkError(f"dangles: {here} is a file, not a directory")
        elif here not in _directories(tree):
            raise LinkError(f"dangles: {here} is not in the tree")
        done.append(part)
    found = "/".join(done)
    entry = tree.entries.get(found)
    if not isinstance(entry, FileEntry):
        raise LinkError(f"points to a directory ({found or 'the root of the tree'})")
    return found, entry


HERE = "\0"  # in an origin, stands for the path in the source tree (no path or label holds a NUL)


class Placer:
    """The wheel's paths, each with the file it holds and where that came from: a path placed
    twice with different content, or a file where another entry needs a directory, is refused
    naming both places (`fail(message, key)` makes the error). An origin is text, with HERE where
    the path in its source tree goes: formatted only for an error (a tree has thousands of paths)."""

    def __init__(self, fail, reserved: dict[str, str]):
        self.fail = fail
        self.entries: dict[str, Entry] = {}
        self.origins: dict[str, tuple[str, str, str]] = {}  # path -> (origin, attribute, path in the source)
        self.reserved = reserved  # paths the wheel script writes itself -> why

    def _origin(self, path: str) -> str:
        origin, _key, source_path = self.origins[path]
        return origin.replace(HERE, source_path)

    def place(self, path: str, entry: Entry, origin: str, key: str, source: Tree, source_path: str) -> None:
        """Put `entry` (`source_path` of the tree `source`) at `path`; a link is resolved in `source`."""
        if isinstance(entry, SymlinkEntry):
            try:
                _found, entry = resolve(source, source_path)
            except LinkError as e:
                raise self.fail(f"{origin.replace(HERE, source_path)}: the link {source_path} -> {entry.target} "
                                f"{e}; a wheel holds no links, so each ships the file it names in its own tree", key,
                                hint="point the link at a file of the same tree, or leave it out") from None
        if path in self.reserved:
            raise self.fail(f"{origin.replace(HERE, source_path)}: {path} is {self.reserved[path]}", key,
                            hint="leave it out: the wheel writes its own dist-info files")
        old = self.entries.get(path)
        if old is not None and old != entry:
            raise self.fail(f"{path} in the wheel comes from both {self._origin(path)} and "
                            f"{origin.replace(HERE, source_path)}", key,
                            hint="give each path of the wheel one file: drop one of them, or place it elsewhere")
        self.entries[path] = entry
        if old is None:
            self.origins[path] = (origin, key, source_path)

    def tree(self) -> Tree:
        """The wheel's content, after checking that no file stands where a directory must be."""
        parents: set[str] = set()
        for path in self.entries:
            cut = path.rfind("/")
            while cut > 0 and (parent := path[:cut]) not in parents:
                parents.add(parent)
                cut = path.rfind("/", 0, cut)
        for above in sorted(parents & self.entries.keys()):
            if not isinstance(self.entries[above], DirEntry):
                below = next(p for p in sorted(self.entries) if p.startswith(above + "/"))
                raise self.fail(f"{above} in the wheel is a file from {self._origin(above)}, and a directory "
                                f"for {below} from {self._origin(below)}", self.origins[above][1],
                                hint="give the file and the directory different paths")
        return Tree.from_checked(self.entries)
