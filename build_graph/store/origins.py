"""Where a result that this machine's sandbox did not make came from, and whether a build takes it.

A result pulled from a remote cache, or run by a remote executor, is filed with its origin
(`pulled/<key>`, written before the entry itself: a build killed between the two leaves a record of
a foreign result, never an unrecorded one): who vouched for it (the public key that signed it,
"unsigned", or "executed"), the remote's URL, and the digest of the result it came with.

Every lookup of a result, whichever way it is found (the action cache, the state file's memo, a
build with or without a remote), takes a result with an origin only where this build's trust
accepts that origin: a signer among this build's trusted keys; any result of the remote cache this
build itself allows unsigned (and an unsigned one only from there); an executed one only from the
executor this build sends its actions to. Otherwise the entry is dropped and the action runs here. So a workspace that
names a remote (a WORKSPACE.toml one clones) fills the shared cache only for builds that trust the
same remote, never for another workspace's, and a CI build never backfills and signs another
build's foreign result (red team R4). A result built here since (its digest no longer the
record's) is this machine's own.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import orjson

from build_graph.model import ActionResult, Digester
from build_graph.store.atomic import write_json

UNSIGNED = "unsigned"  # as store/signing.py files an unsigned pull
EXECUTED = "executed"  # a remote executor's result


@dataclass(frozen=True)
class BuildTrust:
    """The origins one build accepts (from its merged [remote] settings)."""

    keys: frozenset[str] = frozenset()  # ed25519 public keys, hex, lower case
    unsigned_from: str | None = None  # the remote cache whose unsigned results this build allows
    executor: str | None = None  # the remote executor this build runs actions on

    @classmethod
    def of(cls, settings: Any) -> "BuildTrust":
        """From a workspace.RemoteSection (None: a build that trusts no remote)."""
        if settings is None:
            return cls()
        keys = frozenset(k.lower() for k in settings.trusted_keys)
        # as signing.Trust: trusted keys win over allow_unsigned
        unsigned = settings.url if settings.url and settings.allow_unsigned and not keys else None
        return cls(keys, unsigned, settings.executor or None)

    def accepts(self, signer: str, source: str) -> bool:
        if signer == EXECUTED:
            return self.executor is not None and source == self.executor
        # allow_unsigned takes whatever that one remote serves, signed or not (as signing.Trust)
        if self.unsigned_from is not None and source == self.unsigned_from:
            return True
        return signer != UNSIGNED and signer.lower() in self.keys


class Origins:
    """The origin records of one cache and this build's trust in them."""

    def __init__(self, base: Path, tmp: Path, digester: Digester, trust: BuildTrust,
                 warn: Callable[[str], None] = lambda message: None):
        self.root, self.tmp, self.digester, self.trust = base / "pulled", tmp, digester, trust
        self._root = os.fspath(self.root)
        self._warn = warn
        self._warned = False
        self._lock = threading.Lock()
        self.dropped = 0  # results this build did not take for their origin

    def _path(self, key: str) -> str:
        return f"{self._root}/{key[:2]}/{key[2:]}.json"

    def _digest(self, result: ActionResult) -> str:
        return self.digester.of(orjson.dumps(result.to_json(), option=orjson.OPT_SORT_KEYS))

    def record(self, key: str, result: ActionResult, signer: str, source: str) -> None:
        """File where the result for `key` came from: call before filing the result itself."""
        dest = self.root / key[:2] / f"{key[2:]}.json"
        dest.parent.mkdir(parents=True, exist_ok=True)
        write_json(dest, {"signer": signer, "result": self._digest(result), "remote": source}, self.tmp,
                   sort_keys=True)

    def clear(self, key: str) -> None:
        """The result for `key` was built here: forget an earlier origin (after filing it)."""
        try:
            os.unlink(self._path(key))
        except FileNotFoundError:
            pass

    def origin(self, key: str, result: ActionResult) -> tuple[str, str] | None:
        """(signer, source) of `result` if it came from elsewhere; None if this machine built it."""
        try:
            with open(self._path(key), "rb") as f:
                record = orjson.loads(f.read())
            signer, pulled, source = record["signer"], record["result"], record.get("remote", "")
            if not (isinstance(signer, str) and isinstance(pulled, str) and isinstance(source, str)):
                raise TypeError("not strings")
        except FileNotFoundError:
            return None
        except (ValueError, KeyError, TypeError, AttributeError):
            return UNSIGNED, ""  # a damaged record: the worst, an unsigned result of unknown source
        if pulled != self._digest(result):
            return None  # the entry was built here since (the record is of an earlier one)
        return signer, source

    def accepts(self, key: str, result: ActionResult) -> bool:
        """Whether this build takes `result`, filed under `key` (one warning line per build where not)."""
        origin = self.origin(key, result)
        if origin is None or self.trust.accepts(*origin):
            return True
        with self._lock:
            self.dropped += 1
            first, self._warned = not self._warned, True
        if first:
            signer, source = origin
            who = ("run by the remote executor " if signer == EXECUTED else
                   "pulled unsigned from " if signer == UNSIGNED else f"signed by {signer[:16]}… and pulled from ")
            self._warn(f"cache: results {who}{source or 'an unknown remote'} are not trusted by this build "
                       f"(the first: action {key[:12]}…); building them here")
        return False
