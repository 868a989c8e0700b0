"""Signed remote-cache entries: a hostile entry costs one warning, never a crashed build."""

from __future__ import annotations

import json

import pytest

from build_graph.model import EMPTY_TREE, ActionResult, Digester
from build_graph.store.action_cache import LocalActionCache
from build_graph.store.cas import LocalCas
from build_graph.store.layered import LayeredActionCache
from build_graph.store.signing import Signer, Trust, generate_key, signed_message


class DictRemote:
    """The RemoteCache protocol over two dicts: what a cache server stores, nothing more."""

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
    assert reader.get("k" * 64) == result  # accepted as signed
    env.update(sig=sig, pub=public if pub == "PUB" else pub)
    remote.entries["k" * 64] = json.dumps(env).encode()
    fresh_warnings: list[str] = []
    reader = layered(tmp_path, remote, Trust([public]), fresh_warnings)
    assert reader.get("k" * 64) is None  # ignored, not a crash
    assert len(fresh_warnings) == 1 and "ignored the entry" in fresh_warnings[0], fresh_warnings
    assert reader.stats.ignored == 1


def test_signed_message_binds_the_key():
    assert signed_message("a", "result", {}) != signed_message("b", "result", {})
