"""What a wheel holds, gathered from several trees: each path placed once."""

from __future__ import annotations

from build_graph.model import DirEntry, Entry, Tree

class Placer:
    """The wheel's paths, each with the file it holds and where that came from: a path placed
    twice with different content, or a file where another entry needs a directory, is refused
    naming both places (`fail(message, key)` makes the error)."""

    def __init__(self, fail, reserved: dict[str, str]):
        self.fail = fail
        self.entries: dict[str, Entry] = {}
        self.origins: dict[str, tuple[str, str]] = {}  # path -> (what placed it, its attribute)
        self.reserved = reserved  # paths the wheel script writes itself -> why

    def place(self, path: str, entry: Entry, origin: str, key: str, source: Tree, source_path: str) -> None:
        """Put `entry` (`source_path` of the tree `source`) at `path`."""
        if path in self.reserved:
            raise self.fail(f"{origin}: {path} is {self.reserved[path]}", key,
                            hint="leave it out: the wheel writes its own dist-info files")
        old = self.entries.get(path)
        if old is not None and old != entry:
            raise self.fail(f"{path} in the wheel comes from both {self.origins[path][0]} and {origin}", key,
                            hint="give each path of the wheel one file: drop one of them, or place it elsewhere")
        self.entries[path] = entry
        self.origins.setdefault(path, (origin, key))

    def tree(self) -> Tree:
        """The wheel's content, after checking that no file stands where a directory must be."""
        for path in self.entries:
            cut = path.rfind("/")
            while cut > 0:
                above = self.entries.get(path[:cut])
                if above is not None and not isinstance(above, DirEntry):
                    origin, key = self.origins[path[:cut]]
                    raise self.fail(f"{path[:cut]} in the wheel is a file from {origin}, and a directory "
                                    f"for {path} from {self.origins[path][0]}", key,
                                    hint="give the file and the directory different paths")
                cut = path.rfind("/", 0, cut)
        return Tree.from_checked(self.entries)
