"""Where a result that this machine's sandbox did not make came from, and who vouched for it.

A result pulled from a remote cache, or run by a remote executor, carries its origin in the very
entry that holds it (`ActionResult.origin`, in the `ac/` file and in the state file's row alike,
each written whole at once): who signed it (a public key, "unsigned"), or "executed" / "executor
cache" (an executor's run, or its answer from its own action cache); the remote's URL; and who
vouched for taking it: "user" where the user's own settings (the user config, the command line)
trust that origin, else the workspace whose WORKSPACE.toml [remote] did ("workspace:<root>"). An
entry with no origin was filed by this machine's sandbox; one whose origin is damaged is no entry.

Every lookup of a result, whichever way it is found (the action cache, the state file's memo, a
build with or without a remote), takes a foreign result only where the user vouched for it, or the
same workspace did, or this build's own settings trust its origin (a signer among its trusted keys;
anything from the one remote it allows unsigned; an executed result from the executor it uses, and
an executor-cache answer only where it also accepts those). Otherwise the entry is dropped and the
action runs here. So a `[remote]` in a project's WORKSPACE.toml (one cloned) fills the shared cache
for that workspace and for builds that trust the same remote only, and a CI build never backfills
and signs such a result (red teams R4, R5). Since the origin is part of the entry, no later write
of another file (a concurrent build, a stale memo row, a damaged record) can make a foreign result
read as local.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from typing import Any, Callable

from build_graph.model import ActionResult

UNSIGNED = "unsigned"  # as store/signing.py names an unsigned pull
EXECUTED = "executed"  # a remote executor ran it
EXECUTOR_CACHE = "executor cache"  # a remote executor answered from its own action cache
USER = "user"  # vouched for by the user's own settings, in every workspace


def same_remote(url: str | None) -> str | None:
    """A remote's URL as compared here (a trailing slash names the same remote)."""
    return url.rstrip("/") if url else None


@dataclass(frozen=True)
class BuildTrust:
    """The origins one build's settings accept (from a merged [remote] section)."""

    keys: frozenset[str] = frozenset()  # ed25519 public keys, hex, lower case
    unsigned_from: str | None = None  # the remote cache whose results this build allows unsigned
    executor: str | None = None  # the remote executor this build runs actions on
    accept_cached: bool = False  # and takes its action cache's answers

    @classmethod
    def of(cls, settings: Any) -> "BuildTrust":
        """From a workspace.RemoteSection (None: a build that trusts no remote)."""
        if settings is None:
            return cls()
        keys = frozenset(k.lower() for k in settings.trusted_keys)
        # as signing.Trust: trusted keys win over allow_unsigned
        unsigned = same_remote(settings.url) if settings.allow_unsigned and not keys else None
        return cls(keys, unsigned, same_remote(settings.executor), bool(settings.accept_cached))

    def accepts(self, signer: str, source: str) -> bool:
        source = same_remote(source) or ""
        if signer in (EXECUTED, EXECUTOR_CACHE):
            return (self.executor is not None and source == self.executor
                    and (signer == EXECUTED or self.accept_cached))
        # allow_unsigned takes whatever that one remote serves, signed or not (as signing.Trust)
        if self.unsigned_from is not None and source == self.unsigned_from:
            return True
        return signer != UNSIGNED and signer.lower() in self.keys


class Origins:
    """This build's trust in results made elsewhere, and the user's."""

    def __init__(self, trust: BuildTrust, user: BuildTrust | None = None, workspace: str = "",
                 warn: Callable[[str], None] = lambda message: None):
        self.trust = trust
        self.user = user or BuildTrust()  # what the user config and the command line alone trust
        self.workspace = f"workspace:{workspace}"  # who vouches for what only WORKSPACE.toml trusts
        self._warn = warn
        self._warned = False
        self._lock = threading.Lock()

    def stamp(self, result: ActionResult, signer: str, source: str) -> ActionResult:
        """`result` as it is filed: with its origin and who vouches for taking it."""
        vouched = USER if self.user.accepts(signer, source) else self.workspace
        return replace(result, origin=(signer, same_remote(source) or "", vouched))

    def vouched(self, origin: tuple[str, str, str]) -> bool:
        """Whether this build may take a result of `origin` (see the module's docstring)."""
        signer, source, vouched = origin
        return vouched in (USER, self.workspace) or self.trust.accepts(signer, source)

    def accepts(self, key: str, result: ActionResult) -> bool:
        """Whether this build takes `result`, filed under `key` (one warning line per build where not)."""
        if result.origin is None or self.vouched(result.origin):
            return True
        with self._lock:
            first, self._warned = not self._warned, True
        if first:
            signer, source, vouched = result.origin
            who = ("run by the remote executor " if signer == EXECUTED else
                   "answered from the action cache of the remote executor " if signer == EXECUTOR_CACHE else
                   "pulled unsigned from " if signer == UNSIGNED else f"signed by {signer[:16]}… and pulled from ")
            by = f"; only {vouched.removeprefix('workspace:')} trusts it" if vouched.startswith("workspace:") else ""
            self._warn(f"cache: results {who}{source or 'an unknown remote'} are not trusted by this build{by} "
                       f"(the first: action {key[:12]}…); building them here")
        return False
