"""The worker's materialized input trees, bounded: LocalCas.materialize lays each tree out once
(read-only hard links) and keeps it for reuse, which a long-running worker would do for every
action it ever ran. Here the trees no running lease uses are removed beyond the KEEP most
recently used ones: a pinned /usr that every lease mounts stays; one action's sources go."""

from __future__ import annotations

import itertools
import os
import threading
from collections import OrderedDict
from pathlib import Path

from build_graph.model import Tree
from build_graph.store.cas import LocalCas, rmtree

KEEP = 128


class TreeCache:
    """Materialized trees of `cas`, counted while leases use them, evicted least recently used."""

    def __init__(self, cas: LocalCas, keep: int = KEEP):
        self.cas, self.keep = cas, keep
        self._recent: OrderedDict[str, int] = OrderedDict()  # digest -> leases using it now
        self._lock = threading.Lock()
        self._aside = itertools.count()

    def take(self, tree: Tree) -> Path:
        """The read-only directory of `tree`, held until give_back()."""
        digest = tree.digest(self.cas.digester)
        with self._lock:  # counted before it is made: an eviction meanwhile cannot remove it
            self._recent[digest] = self._recent.get(digest, 0) + 1
            self._recent.move_to_end(digest)
        try:
            return self.cas.materialize(tree)
        except BaseException:
            self.give_back([digest])
            raise

    def give_back(self, digests) -> None:
        """The lease is done with these trees (names of the directories take() gave)."""
        drop = []
        with self._lock:
            for d in digests:
                if d in self._recent:
                    self._recent[d] = max(0, self._recent[d] - 1)
            idle = [d for d, n in self._recent.items() if n == 0]
            while len(self._recent) > self.keep and idle:
                d = idle.pop(0)  # oldest first
                del self._recent[d]
                # LocalCas remembers trees it checked whole: forget it, or it would hand out the
                # removed directory's path.
                self.cas._intact.discard(d)
                # Set aside under the lock, removed outside it: a take() of the same digest from
                # now on makes it afresh instead of meeting a directory half removed.
                aside = self.cas.tmp / f"gone-{d}-{next(self._aside)}"
                try:
                    os.chmod(self.cas.trees / d, 0o755)  # a directory moved to another parent must be writable
                    os.rename(self.cas.trees / d, aside)
                except FileNotFoundError:
                    continue
                drop.append(aside)
        for path in drop:
            rmtree(path)
