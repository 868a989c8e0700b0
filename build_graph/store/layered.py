"""The action cache, local first, then a remote one: the same interface as LocalActionCache, so
the rebuilder and engine never know which they have.

A remote hit is taken only whole and verified: the entry's envelope (checked against the
trusted keys; with none, used only where allow_unsigned says so), then every directory node and
blob of its outputs, each hashed against its digest before it enters the local store; then the
entry is filed locally. Anything missing, wrong, oversized or unsigned makes it a miss, said in
one warning line.

A pulled entry is filed with its origin inside it (store/origins.py: the signer's public key, or
"unsigned", the remote's URL, and who vouched for taking it). A later build whose trust
does not accept that origin (trusted_keys set after an unsigned remote was allowed, a key taken
out, another remote, another workspace's) drops the local copy and looks the key up again, before
anything is backfilled; a result built here, or pulled under a trust that still holds, is used as
it is. Every lookup makes the same check (rebuilder.py), builds without a remote included.
Uploads (only with upload=True, meant for CI) send the blobs and nodes first and the entry last,
so a reader never sees an entry whose outputs are not there yet.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field, replace
from typing import Callable

from build_graph.model import ActionResult, Digester, FileEntry
from build_graph.store.action_cache import LocalActionCache
from build_graph.store.cas import CorruptBlob, LocalCas, StoreError
from build_graph.store.origins import EXECUTED, EXECUTOR_CACHE, BuildTrust, Origins
from build_graph.store.remote import MAX_ENTRY_BYTES, MAX_UNSIZED_BYTES, BodyTooLarge, RemoteCache, RemoteUnavailable
from build_graph.store.signing import UNSIGNED, Signer, Trust, signed_message



@dataclass
class RemoteStats:
    hits: int = 0
    misses: int = 0
    ignored: int = 0
    uploaded: int = 0
    backfilled: int = 0  # local hits uploaded because the remote lacked them
    dropped: int = 0  # results pulled before under a trust that no longer accepts their signer
    downloaded_bytes: int = 0
    uploaded_bytes: int = 0
    ignored_why: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "ignored_why"} | {"ignored_why": self.ignored_why[:20]}


MANIFEST_KEEP = 8  # the depfile manifests kept per prekey, here as in the local action cache


class Ignored(Exception):
    """A remote entry that cannot be used (the message says why)."""


class LayeredActionCache:
    def __init__(self, local: LocalActionCache, cas: LocalCas, remote: RemoteCache, digester: Digester, *,
                 origins: Origins | None = None, upload: bool = False, signer: Signer | None = None,
                 trust: Trust | None = None, warn: Callable[[str], None] = lambda message: None):
        self.local, self.cas, self.remote, self.digester = local, cas, remote, digester
        self.upload, self.signer, self.trust = upload, signer, trust or Trust([])
        # where each result not built here came from, and this build's trust (the engine gives
        # one with its executor; alone, the trust above and this remote's URL)
        self.origins = origins or Origins(BuildTrust(frozenset(self.trust.keys),
                                                     remote.url if self.trust.allow_unsigned else None))
        self.stats = RemoteStats()
        self._warn = warn
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    # -- the LocalActionCache interface --------------------------------------------------
    def get(self, key: str) -> ActionResult | None:
        result = self.local.get(key)
        if result is not None and not self._still_trusted(key, result):
            result = None
        if result is not None:
            if self.upload:
                self._backfill(key, result)
            return result
        try:
            read = self._read_entry(key, "result")
            if read is None:
                self.stats.misses += 1
                return None
            body, sizes, signer = read
            try:
                result = ActionResult.from_json(body)
            except TypeError:
                raise Ignored("not an action result") from None
            self._pull(result, sizes)
            try:
                self.cas.get_tree(result.output_tree)  # names, link targets, node shapes checked
            except (CorruptBlob, StoreError) as e:
                raise Ignored(str(e)) from None
        except RemoteUnavailable as e:
            self._unavailable(e)
            return None
        except Ignored as e:
            self.stats.ignored += 1
            self.stats.ignored_why.append(f"{key[:12]}: {e}")
            self.warn_once(f"ignored:{e}", f"remote cache: ignored the entry for action {key[:12]}… ({e}); "
                                           "building it here")
            return None
        result = self.origins.stamp(result, signer, self.remote.url)  # whatever the remote's body said
        self.local.put(key, result)
        self.stats.hits += 1
        return result

    def put(self, key: str, result: ActionResult) -> None:
        self.local.put(key, result)  # built here: a record of an earlier pull no longer matches it
        if self.upload and self._upload(key, result):
            self.stats.uploaded += 1

    # -- where what was pulled came from --------------------------------------------------
    def _still_trusted(self, key: str, result: ActionResult) -> bool:
        """False (and the local copy dropped) where `result` came from elsewhere and this build
        may not take it (store/origins.py: the user or this workspace never vouched for its
        origin, nor does this build's trust), or this remote's trust does not accept whoever
        signed it (trusted_keys set after an unsigned remote was allowed, a key taken out)."""
        origin = result.origin
        if origin is None or (self.origins.vouched(origin)
                              and (origin[0] in (EXECUTED, EXECUTOR_CACHE) or self.trust.accepts(origin[0]))):
            return True
        self.local.remove(key)
        with self._lock:
            self.stats.dropped += 1
        signer, source, _vouched = origin
        who = ("unsigned" if signer == UNSIGNED
               else f"run by the remote executor {source}" if signer in (EXECUTED, EXECUTOR_CACHE)
               else f"signed by {signer[:16]}…, a key not trusted now")
        self.warn_once("dropped", f"remote cache: dropped results pulled earlier that this build does not trust "
                                  f"(the first: action {key[:12]}…, {who}); looking them up again")
        return False

    def _upload(self, key: str, result: ActionResult) -> bool:
        """Send the result's blobs and nodes the remote lacks, then its entry; False where the
        result is no longer whole here or the remote is unavailable."""
        try:
            sizes = self._push(result)
            if sizes is None:
                return False
            self._write_entry(key, "result", replace(result, origin=None).to_json(), sizes)  # its reader stamps its own
            return True
        except RemoteUnavailable as e:
            self._unavailable(e)
            return False

    def touch(self, key: str) -> None:
        self.local.touch(key)

    def remove(self, key: str) -> None:
        self.local.remove(key)

    def get_manifest(self, prekey: str) -> list[dict]:
        entries = self.local.get_manifest(prekey)
        try:
            remote = self._remote_manifest(prekey)
        except RemoteUnavailable as e:
            self._unavailable(e)
            return entries
        except Ignored as e:
            self.warn_once(f"ignored:{e}", f"remote cache: ignored a depfile manifest ({e})")
            return entries
        seen = {e.get("key") for e in entries}
        merged = entries + [e for e in remote if e.get("key") not in seen]
        if self.upload and seen - {e.get("key") for e in remote}:  # backfill what the remote lacks
            try:
                self._write_entry(self._manifest_key(prekey), "manifest", merged[:MANIFEST_KEEP])
            except RemoteUnavailable as e:
                self._unavailable(e)
        return merged

    def _backfill(self, key: str, result: ActionResult) -> None:
        """Upload a local hit the remote lacks (Bazel uploads only what it executes): a build with
        upload on a warm local cache fills an empty remote without rebuilding anything."""
        try:
            if self.remote.get_entry(key) is not None:
                return
        except RemoteUnavailable as e:
            self._unavailable(e)
            return
        if self._upload(key, result):
            self.stats.backfilled += 1

    def add_manifest(self, prekey: str, entry: dict, keep: int = MANIFEST_KEEP) -> None:
        self.local.add_manifest(prekey, entry, keep)
        if not self.upload:
            return
        try:
            try:
                remote = self._remote_manifest(prekey)
            except Ignored:
                remote = []
            merged = [entry] + [e for e in remote if e.get("key") != entry["key"]]
            self._write_entry(self._manifest_key(prekey), "manifest", merged[:keep])
        except RemoteUnavailable as e:
            self._unavailable(e)

    # -- envelopes -------------------------------------------------------------------------
    def _manifest_key(self, prekey: str) -> str:
        """Where a depfile manifest lives remotely (a digest, as REAPI's action cache wants)."""
        return self.digester.of(f"{prekey}.reads".encode())

    def _remote_manifest(self, prekey: str) -> list[dict]:
        """The entries of the remote's depfile manifest for `prekey` ([] if it has none)."""
        read = self._read_entry(self._manifest_key(prekey), "manifest")
        body = read[0] if read else []
        return [e for e in body if isinstance(e, dict)] if isinstance(body, list) else []

    def _read_entry(self, key: str, kind: str) -> tuple[object, dict[str, int], str] | None:
        """(body, size hints, who signed it) of the envelope filed under `key`, checked against
        the trust."""
        try:
            raw = self.remote.get_entry(key)
        except BodyTooLarge:
            raise Ignored(f"its entry is larger than the {MAX_ENTRY_BYTES >> 20} MiB an entry can have; "
                          "not read further") from None
        if raw is None:
            return None
        try:
            env = json.loads(raw)
            body = env["body"]
            if env.get("v") != 1 or env.get("key") != key or env.get("kind") != kind:
                raise Ignored("an entry filed under another key")
            sizes = env.get("sizes") or {}
            if not isinstance(sizes, dict):
                raise TypeError
            # Inside the guard: a body nobody signed may still hold what cannot be encoded (a
            # lone surrogate) or nest deeper than the parser's recursion.
            message = signed_message(key, kind, body)
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
            raise Ignored("not a bgraph cache entry") from None
        why = self.trust.check(message, env.get("sig"), env.get("pub"))
        if why:
            raise Ignored(why)
        return body, sizes, self.trust.signer(message, env.get("sig"), env.get("pub"))

    def _write_entry(self, key: str, kind: str, body, sizes: dict[str, int] | None = None) -> None:
        # `sizes` (of the nodes and logs the body names) are hints a REAPI server needs to serve
        # blobs; they are not signed: a wrong one can only make a fetch fail, never pass.
        message = signed_message(key, kind, body)
        env = {"v": 1, "key": key, "kind": kind, "body": body, "sizes": sizes or {},
               "sig": self.signer.sign(message) if self.signer else None,
               "pub": self.signer.public_hex if self.signer else None}
        self.remote.put_entry(key, json.dumps(env, sort_keys=True).encode())

    # -- blobs and nodes -------------------------------------------------------------------
    def _fetch_verified(self, digest: str, size: int | None, what: str) -> bytes:
        try:
            data = self.remote.get_blob(digest, size)
        except BodyTooLarge:
            limit = f"the {size} bytes its digest names" if size is not None else f"{MAX_UNSIZED_BYTES >> 20} MiB"
            raise Ignored(f"its {what} {digest[:12]}… is larger on the remote than {limit}; not read "
                          "further") from None
        if data is None:
            raise Ignored(f"its {what} {digest[:12]}… is missing from the remote")
        if (size is not None and len(data) != size) or self.digester.of(data) != digest:
            raise Ignored(f"its {what} {digest[:12]}… has wrong contents on the remote")
        self.stats.downloaded_bytes += len(data)
        return data

    def _closure(self, root: str, missing) -> tuple[dict[str, bytes], dict[str, int]] | None:
        """Every directory node under `root` (digest -> bytes) and every file blob they name
        (digest -> size). `missing(digest)` supplies a node not stored here, or None to give up."""
        nodes: dict[str, bytes] = {}
        files: dict[str, int] = {}
        stack = [root]
        while stack:
            d = stack.pop()
            if d in nodes:
                continue
            raw = self.cas.node_bytes(d)
            if raw is None:
                raw = missing(d)
                if raw is None:
                    return None
            try:
                node = json.loads(raw)
                files.update({fd: size for _name, fd, size, _ex in node["files"]})
                stack.extend(sub for _name, sub in node["dirs"])
            except (ValueError, KeyError, TypeError):
                raise Ignored(f"its directory node {d[:12]}… is not one") from None
            nodes[d] = raw
        return nodes, files

    def _pull(self, result: ActionResult, hints: dict[str, int]) -> None:
        """Bring every node and blob the result names into the local store, verified. The size
        hints are not signed: one above what an unsized fetch may read is dropped (a file's size
        comes from its verified node instead)."""
        hints = {d: s for d, s in hints.items()
                 if isinstance(s, int) and not isinstance(s, bool) and 0 <= s <= MAX_UNSIZED_BYTES}

        def fetch_node(d: str) -> bytes:
            raw = self._fetch_verified(d, hints.get(d), "directory node")
            self.cas.put_node(d, raw)
            return raw
        _nodes, files = self._closure(result.output_tree, fetch_node)
        wanted: dict[str, int | None] = dict(files)
        for d in (result.stdout, result.stderr):
            wanted.setdefault(d, hints.get(d))
        for d, size in wanted.items():
            if size is not None and self.cas.verify(FileEntry(d, size)):
                continue
            if size is None and self.cas.has_digest(d):
                continue
            self.cas.put_bytes(self._fetch_verified(d, size, "output blob"))

    def _push(self, result: ActionResult) -> dict[str, int] | None:
        """Upload what the remote lacks of the result: blobs, then directory nodes. Returns the
        sizes of the nodes and logs (hints for the entry), or None if the result is not whole here."""
        walked = self._closure(result.output_tree, lambda d: None)  # evicted meanwhile: upload nothing
        if walked is None:
            return None
        nodes, blobs = walked
        hints = {d: len(raw) for d, raw in nodes.items()}
        for d in (result.stdout, result.stderr):
            try:
                blobs[d] = hints[d] = self.cas.blob_path(d).stat().st_size
            except FileNotFoundError:
                return None
        missing = self.remote.find_missing({**blobs, **hints})
        for d in sorted(missing & blobs.keys()):
            if not self.cas.verify(FileEntry(d, blobs[d])):
                return None  # damaged here (and removed by verify): upload nothing of it
            data = self.cas.blob_path(d).read_bytes()
            self.remote.put_blob(d, data)
            self.stats.uploaded_bytes += len(data)
        for d in sorted(missing & nodes.keys()):  # nodes after the blobs they name, the entry last
            self.remote.put_blob(d, nodes[d])
        return hints

    # -- warnings --------------------------------------------------------------------------
    def warn_once(self, kind: str, message: str) -> None:
        with self._lock:
            if kind in self._warned:
                return
            self._warned.add(kind)
        self._warn(message)

    def _unavailable(self, e: RemoteUnavailable) -> None:
        self.warn_once("unavailable", f"remote cache {self.remote.url} unavailable ({e}); "
                                      "building locally")


def configured(local: LocalActionCache, cas: LocalCas, digester: Digester, settings, warn,
               origins: Origins) -> LayeredActionCache:
    """The action cache with the remote that `settings` (a workspace RemoteSection) names behind the local one.
    A remote without trusted keys is an error unless `allow_unsigned` says so (then one warning per build)."""
    from pathlib import Path

    from build_graph.errors import LoadError
    from build_graph.store.remote import open_remote

    if not settings.trusted_keys and not settings.allow_unsigned:
        raise LoadError(f"remote cache {settings.url} has no trusted_keys: its results would be used whoever wrote "
                        "them",
                        hint="put the public key of the machine that uploads (`bgraph cache keygen`) in [remote] "
                             "trusted_keys, or pass --remote-trusted-key HEX; to use it unsigned anyway (a cache "
                             "only your own machines can write), set allow_unsigned = true in [remote] or pass "
                             "--remote-allow-unsigned")
    if settings.upload and settings.trusted_keys and not settings.signing_key:
        raise LoadError(f"remote cache {settings.url}: upload is on but no signing_key is set: the entries this "
                        "machine wrote would be unsigned, and would replace signed ones that its readers trust",
                        hint="give [remote] signing_key (make one with `bgraph cache keygen`), or turn upload off")
    signer = Signer(Path(os.path.expanduser(settings.signing_key))) if settings.signing_key else None
    trust = Trust(settings.trusted_keys, allow_unsigned=settings.allow_unsigned)
    cache = LayeredActionCache(local, cas, open_remote(settings.url, digester.name, settings.timeout_s), digester,
                               origins=origins, upload=settings.upload, signer=signer, trust=trust, warn=warn)
    if trust.allow_unsigned:
        cache.warn_once("unsigned", f"remote cache {settings.url}: no trusted_keys and allow_unsigned is on: its "
                                    "results are used whoever wrote them")
    return cache
