"""Signed remote-cache entries: a hostile entry costs one warning, never a crashed build."""

from __future__ import annotations

import json

import pytest

from build_graph.model import EMPTY_TREE, ActionResult, Digester
from build_graph.store.action_cache import LocalActionCache
from build_graph.store.cas import LocalCas
from build_graph.store.layered import LayeredActionCache
from build_graph.store.signing import Signer, Trust, generate_key, signed_message


def unstamped(result):
    """A pulled result without the origin its reader filed it with (store/origins.py)."""
    from dataclasses import replace
    return replace(result, origin=None) if result is not None else None


class DictRemote:
    """The RemoteCache protocol over two dicts: what a cache server stores, nothing more."""

    url = "dict://"

    def __init__(self):
        self.blobs: dict[str, bytes] = {}
        self.entries: dict[str, bytes] = {}

    def get_blob(self, digest, size=None):
        return self.blobs.get(digest)

    def find_missing(self, sizes):
        return {d for d in sizes if d not in self.blobs}

    def put_blob(self, digest, data):
        self.blobs[digest] = data

    def get_entry(self, key):
        return self.entries.get(key)

    def put_entry(self, key, data):
        self.entries[key] = data


@pytest.fixture
def keypair(tmp_path):
    path = tmp_path / "ci.key"
    public = generate_key(path)
    return Signer(path), public


def layered(tmp_path, remote, trust, warnings, upload=False, signer=None):
    digester = Digester("blake3")
    cas = LocalCas(tmp_path / f"cache-{len(list(tmp_path.iterdir()))}", digester)
    return LayeredActionCache(LocalActionCache(cas.base, cas.tmp), cas, remote, digester, upload=upload,
                              signer=signer, trust=trust, warn=warnings.append)


@pytest.mark.parametrize("sig, pub", [(5, 7), ("ab", ["x"]), ({"a": 1}, "00" * 32), (1.5, True)])
def test_trust_check_rejects_non_string_signature_fields(keypair, sig, pub):
    _, public = keypair
    assert Trust([public]).check(b"message", sig, pub) is not None


@pytest.mark.parametrize("sig, pub", [(5, 7), ("ab", ["x"]), (["00"], "PUB")])
def test_hostile_signature_fields_cost_one_warning(tmp_path, keypair, sig, pub):
    signer, public = keypair
    remote, warnings = DictRemote(), []
    writer = layered(tmp_path, remote, Trust([]), warnings, upload=True, signer=signer)
    result = ActionResult(output_tree=writer.cas.put_tree(EMPTY_TREE),
                          exit_code=0, stdout=writer.cas.put_bytes(b"").digest,
                          stderr=writer.cas.put_bytes(b"").digest, duration_s=0.1)
    writer.put("k" * 64, result)
    env = json.loads(remote.entries["k" * 64])
    assert env["sig"] and env["pub"] == public  # a well-signed entry is there
    reader = layered(tmp_path, remote, Trust([public]), warnings)
    assert unstamped(reader.get("k" * 64)) == result  # accepted as signed
    env.update(sig=sig, pub=public if pub == "PUB" else pub)
    remote.entries["k" * 64] = json.dumps(env).encode()
    fresh_warnings: list[str] = []
    reader = layered(tmp_path, remote, Trust([public]), fresh_warnings)
    assert reader.get("k" * 64) is None  # ignored, not a crash
    assert len(fresh_warnings) == 1 and "ignored the entry" in fresh_warnings[0], fresh_warnings
    assert reader.stats.ignored == 1


def test_signed_message_binds_the_key():
    assert signed_message("a", "result", {}) != signed_message("b", "result", {})


def test_no_trusted_keys_accepts_nothing_unless_unsigned_is_allowed(keypair):
    signer, public = keypair
    message = signed_message("k", "result", {})
    assert Trust([]).check(message, None, None) is not None
    assert not Trust([]).accepts("unsigned") and not Trust([]).accepts(public)
    allowed = Trust([], allow_unsigned=True)
    assert allowed.check(message, None, None) is None and allowed.accepts("unsigned") and allowed.accepts(public)
    # Keys win over allow_unsigned.
    keyed = Trust([public], allow_unsigned=True)
    assert not keyed.allow_unsigned and keyed.check(message, None, None) == "unsigned"
    assert keyed.accepts(public) and not keyed.accepts("unsigned")


def test_signer_is_the_key_whose_signature_verifies(keypair):
    signer, public = keypair
    message = signed_message("k", "result", {"x": 1})
    sig = signer.sign(message)
    for trust in (Trust([]), Trust([public]), Trust(["11" * 32])):  # trusted or not: it says who signed
        assert trust.signer(message, sig, public) == public
        assert trust.signer(message, sig, public.upper()) == public
        assert trust.signer(signed_message("other", "result", {"x": 1}), sig, public) == "unsigned"
        assert trust.signer(message, None, None) == "unsigned"
        assert trust.signer(message, 5, ["x"]) == "unsigned"
        assert trust.signer(message, sig, "zz") == "unsigned"


def result_in(cache: LayeredActionCache) -> ActionResult:
    return ActionResult(output_tree=cache.cas.put_tree(EMPTY_TREE), exit_code=0,
                        stdout=cache.cas.put_bytes(b"").digest, stderr=cache.cas.put_bytes(b"").digest,
                        duration_s=0.25)


def pulled_unsigned(tmp_path, remote):
    """A result uploaded unsigned by one cache and pulled by another while unsigned results are
    allowed: (the result, the reader)."""
    warnings: list[str] = []
    writer = layered(tmp_path, remote, Trust([], allow_unsigned=True), warnings, upload=True)
    result = result_in(writer)
    writer.put("k" * 64, result)
    reader = layered(tmp_path, remote, Trust([], allow_unsigned=True), warnings)
    assert unstamped(reader.get("k" * 64)) == result
    assert reader.get("k" * 64).origin[0] == "unsigned"  # filed with its origin
    return result, reader


def test_a_result_pulled_unsigned_is_dropped_once_keys_are_trusted(tmp_path, keypair):
    _, public = keypair
    remote = DictRemote()
    # A reader pulls it while unsigned results are allowed...
    result, reader = pulled_unsigned(tmp_path, remote)
    assert reader.stats.hits == 1
    assert unstamped(reader.local.get("k" * 64)) == result
    # ...and a later build of that cache trusts a key: the pulled copy goes, the remote's is ignored.
    later_warnings: list[str] = []
    later = LayeredActionCache(reader.local, reader.cas, remote, reader.digester, trust=Trust([public]),
                               warn=later_warnings.append)
    assert later.get("k" * 64) is None
    assert later.stats.dropped == 1 and later.local.get("k" * 64) is None
    assert len([w for w in later_warnings if "dropped results pulled earlier" in w]) == 1, later_warnings
    # Built here now: kept under that trust, by this build and the next.
    built = ActionResult(**{**result.to_json(), "duration_s": 0.5})
    later.put("k" * 64, built)
    assert later.get("k" * 64) == built
    assert LayeredActionCache(reader.local, reader.cas, remote, reader.digester, trust=Trust([public])).get("k" * 64) \
        == built


def test_a_result_built_here_with_the_same_key_as_an_earlier_pull_is_not_dropped(tmp_path, keypair):
    """A record of a pull is tied to the result it came with: a result built here since, under the
    plain local cache (no remote, so no record written), does not inherit it."""
    _, public = keypair
    remote = DictRemote()
    result, reader = pulled_unsigned(tmp_path, remote)
    rebuilt = ActionResult(**{**result.to_json(), "duration_s": 9.0})
    reader.local.put("k" * 64, rebuilt)  # e.g. evicted, then rebuilt by a build without the remote
    later = LayeredActionCache(reader.local, reader.cas, remote, reader.digester, trust=Trust([public]))
    assert later.get("k" * 64) == rebuilt and later.stats.dropped == 0
