"""The action cache: action key -> ActionResult, one JSON file each, written atomically."""

from __future__ import annotations

import contextlib
import itertools
import os
from pathlib import Path

import orjson

from build_graph.model import ActionResult
from build_graph.store.atomic import rename_into_shard, stage, write_json
from build_graph.store.listing import MissListing


class LocalActionCache:
    def __init__(self, base: Path, tmp: Path, create: bool = True):
        """`create=False` opens another cache read-only in spirit: nothing is made there."""
        self.root = base / "ac"
        self._root = os.fspath(self.root)
        self.tmp = tmp
        self._tmp = os.fspath(tmp)
        self._names = itertools.count()  # names in our own staging: see atomic.stage
        if create:
            self.root.mkdir(parents=True, exist_ok=True)
        self._listing = MissListing(self.keys)

    def keys(self) -> list[str]:
        """Every key with an entry (one walk of the shard directories)."""
        out = []
        with os.scandir(self._root) as shards:
            for shard in shards:
                if len(shard.name) == 2 and shard.is_dir():
                    with os.scandir(shard.path) as names:
                        out += [shard.name + n.name[:-5] for n in names
                                if n.name.endswith(".json") and not n.name.endswith(".reads.json")]
        return out

    def _path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key[2:]}.json"

    def get(self, key: str) -> ActionResult | None:
        if self._listing.absent(key):  # a plan of 100,000 new actions looks up 100,000 absent entries
            return None
        try:
            with open(f"{self._root}/{key[:2]}/{key[2:]}.json", "rb") as f:
                return ActionResult.from_json(orjson.loads(f.read()))
        except FileNotFoundError:
            self._listing.missed()
            return None
        except (ValueError, TypeError, KeyError):
            return None

    def put(self, key: str, result: ActionResult) -> None:
        """File `result` under `key`: written beside, renamed into place (atomic). Where it
        replaces another result (other outputs or exit code: a non-reproducible action run by two
        builds at once, or a result this build did not take), the cache's generation moves: a
        record or memo of any request may have taken the one replaced (red team R12)."""
        path = f"{self._root}/{key[:2]}/{key[2:]}.json"
        before = self._outcome(path)
        # A counter-named staging file and the shard made only when missing: mkstemp's random
        # name and a mkdir per entry were half of filing a small action's result.
        tmp = stage(self._tmp, "a", self._names, orjson.dumps(result.to_json(), option=orjson.OPT_SORT_KEYS))
        try:
            rename_into_shard(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        self._listing.added(key)
        if before is not None and before != (result.output_tree, result.exit_code):
            from build_graph.store.uptodate import bump_generation
            bump_generation(self.root.parent.parent)

    @staticmethod
    def _outcome(path: str) -> tuple[str | None, int] | None:
        """(output tree, exit code) of the entry at `path`; None where there is none (or none readable)."""
        try:
            with open(path, "rb") as f:
                found = orjson.loads(f.read())
            return found.get("output_tree"), found.get("exit_code")
        except (OSError, ValueError, AttributeError):
            return None

    def touch(self, key: str) -> None:
        """Record a use of the entry (its mtime orders `bgraph cache gc --max-size`)."""
        try:
            os.utime(self._path(key))
        except FileNotFoundError:
            pass

    def remove(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    # Depfile manifests: prekey -> the inputs each earlier run read (see rebuilder.py).
    def _manifest_path(self, prekey: str) -> Path:
        return self.root / prekey[:2] / f"{prekey[2:]}.reads.json"

    def get_manifest(self, prekey: str) -> list[dict]:
        try:
            entries = orjson.loads(self._manifest_path(prekey).read_bytes())
            return entries if isinstance(entries, list) else []
        except (FileNotFoundError, ValueError):
            return []

    def add_manifest(self, prekey: str, entry: dict, keep: int = 8) -> None:
        """File `entry` first under `prekey`, keeping the `keep` most recent distinct entries."""
        entries = [entry] + [e for e in self.get_manifest(prekey) if e.get("key") != entry["key"]]
        dest = self._manifest_path(prekey)
        dest.parent.mkdir(exist_ok=True)
        write_json(dest, entries[:keep], self.tmp, sort_keys=True)
