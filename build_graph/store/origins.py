"""Where a result that this machine's sandbox did not make came from, and who vouched for it.

A result pulled from a remote cache, or run by a remote executor, is filed with its origin
(`pulled/<key>`, written before the entry itself: a build killed between the two leaves a record of
a foreign result, never an unrecorded one): who signed it (a public key, "unsigned") or "executed";
the remote's URL; the digest of the result it came with; and who vouched for taking it: "user"
where the user's own settings (the user config, the command line) trust that origin, else the
workspace whose WORKSPACE.toml [remote] did ("workspace:<root>").

Every lookup of a result, whichever way it is found (the action cache, the state file's memo, a
build with or without a remote), takes a foreign result only where the user vouched for it, or the
same workspace did, or this build's own settings trust its origin (a signer among its trusted keys;
anything from the one remote it allows unsigned; an executed result from the executor it uses).
Otherwise the entry is dropped and the action runs here. So a `[remote]` in a project's
WORKSPACE.toml (one cloned) fills the shared cache only for that workspace and for builds that
trust the same remote, never for another workspace, and a CI build never backfills and signs such
a result (red team R4). A result built here since (its digest no longer the record's) is this
machine's own. A record is never removed: a concurrent build may have just written one for the
entry it is about to file.
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
USER = "user"  # vouched for by the user's own settings, in every workspace


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
    """The origin records of one cache, this build's trust in them, and the user's."""

    def __init__(self, base: Path, tmp: Path, digester: Digester, trust: BuildTrust,
                 user: BuildTrust | None = None, workspace: str = "", warn: Callable[[str], None] = lambda m: None):
        self.root, self.tmp, self.digester, self.trust = base / "pulled", tmp, digester, trust
        self.user = user or BuildTrust()  # what the user config and the command line alone trust
        self.workspace = f"workspace:{workspace}"  # who vouches for what only WORKSPACE.toml trusts
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
        """File where the result for `key` came from, and who vouches for it: call before filing
        the result itself."""
        dest = self.root / key[:2] / f"{key[2:]}.json"
        dest.parent.mkdir(parents=True, exist_ok=True)
        vouched = USER if self.user.accepts(signer, source) else self.workspace
        write_json(dest, {"signer": signer, "result": self._digest(result), "remote": source, "vouched": vouched},
                   self.tmp, sort_keys=True)

    def origin(self, key: str, result: ActionResult) -> tuple[str, str, str] | None:
        """(signer, source, who vouched) of `result` if it came from elsewhere; None if this
        machine built it. A record of a bgraph before "vouched" was kept counts as the user's."""
        try:
            with open(self._path(key), "rb") as f:
                record = orjson.loads(f.read())
            signer, pulled = record["signer"], record["result"]
            source, vouched = record.get("remote", ""), record.get("vouched", USER)
            if not all(isinstance(v, str) for v in (signer, pulled, source, vouched)):
                raise TypeError("not strings")
        except FileNotFoundError:
            return None
        except (ValueError, KeyError, TypeError, AttributeError):
            return UNSIGNED, "", ""  # a damaged record: the worst, an unsigned result nobody vouched for
        if pulled != self._digest(result):
            return None  # the entry was built here since (the record is of an earlier one)
        return signer, source, vouched

    def vouched(self, origin: tuple[str, str, str]) -> bool:
        """Whether this build may take a result of `origin` (see the module's docstring)."""
        signer, source, vouched = origin
        return vouched in (USER, self.workspace) or self.trust.accepts(signer, source)

    def accepts(self, key: str, result: ActionResult) -> bool:
        """Whether this build takes `result`, filed under `key` (one warning line per build where not)."""
        origin = self.origin(key, result)
        if origin is None or self.vouched(origin):
            return True
        with self._lock:
            self.dropped += 1
            first, self._warned = not self._warned, True
        if first:
            signer, source, vouched = origin
            who = ("run by the remote executor " if signer == EXECUTED else
                   "pulled unsigned from " if signer == UNSIGNED else f"signed by {signer[:16]}… and pulled from ")
            by = f"; only {vouched.removeprefix('workspace:')} trusts it" if vouched.startswith("workspace:") else ""
            self._warn(f"cache: results {who}{source or 'an unknown remote'} are not trusted by this build{by} "
                       f"(the first: action {key[:12]}…); building them here")
        return False
