"""Results made elsewhere (store/origins.py): a result that a remote executor or a remote cache gave
one build is taken by a later build only where that build trusts the same origin, whichever
workspace filed it in the shared cache; a result built here is this machine's own (red team R4)."""

import orjson
import pytest

from bgraph_testlib import WS, copy_toolchains, write_files
from build_graph.model import ActionResult
from build_graph.store.origins import EXECUTED, EXECUTOR_CACHE, UNSIGNED, USER, BuildTrust, Origins
from build_graph.workspace import RemoteSection
from test_remote_cache import FILES  # genrules //p:a (a.txt) and //p:b (wc -l of it)
from test_remote_client_results import HostileServer, pb

KEY = "ab" * 32


def test_each_origin_is_taken_only_under_the_trust_that_vouches_for_it():
    trust = BuildTrust.of(RemoteSection(url="http://cache", trusted_keys=[KEY.upper()], executor="grpc://ex:1"))
    assert trust.accepts(KEY, "http://elsewhere")  # a trusted signer, from any remote
    assert not trust.accepts("cd" * 32, "http://cache")
    assert not trust.accepts(UNSIGNED, "http://cache")  # keys win over allow_unsigned
    assert trust.accepts(EXECUTED, "grpc://ex:1/") and not trust.accepts(EXECUTED, "grpc://other:1")
    assert not trust.accepts(EXECUTOR_CACHE, "grpc://ex:1")  # its cache's answers: only with accept_cached
    open_cache = BuildTrust.of(RemoteSection(url="http://cache/", allow_unsigned=True))
    assert open_cache.accepts(UNSIGNED, "http://cache") and open_cache.accepts("cd" * 32, "http://cache")
    assert not open_cache.accepts(UNSIGNED, "http://other-open-cache")
    nothing = BuildTrust.of(None)
    assert not any(nothing.accepts(s, "http://cache") for s in (UNSIGNED, EXECUTED, KEY))


def test_an_entry_says_who_vouched_for_it_and_only_they_take_it():
    said = []
    executor = BuildTrust(executor="grpc://ex:1")

    def origins(workspace: str, trust: BuildTrust = BuildTrust(), user: BuildTrust = BuildTrust()) -> Origins:
        return Origins(trust, user, workspace, said.append)

    built = ActionResult(output_tree="t" * 64, exit_code=0, stdout="", stderr="", duration_s=1.0)
    key = "k" * 64
    assert origins("/b").accepts(key, built) and "origin" not in built.to_json()  # built here
    pulled = origins("/a", trust=executor).stamp(built, EXECUTED, "grpc://ex:1/")  # only /a's WORKSPACE.toml
    assert pulled.origin == (EXECUTED, "grpc://ex:1", "workspace:/a")
    assert ActionResult.from_json(orjson.loads(orjson.dumps(pulled.to_json()))) == pulled  # filed with it
    assert origins("/a").accepts(key, pulled)  # the workspace that vouched for it
    assert origins("/b", trust=executor).accepts(key, pulled)  # a build that uses the same executor
    other = origins("/b")
    assert not other.accepts(key, pulled) and not other.accepts(key, pulled) and len(said) == 1
    assert "only /a trusts it" in said[0]
    by_user = origins("/a", trust=executor, user=executor).stamp(built, EXECUTED, "grpc://ex:1")  # a flag
    assert by_user.origin[2] == USER and origins("/b").accepts(key, by_user)
    cached = origins("/a", trust=executor, user=executor).stamp(built, EXECUTOR_CACHE, "grpc://ex:1")
    assert cached.origin[2] == "workspace:/a"  # the user never said --remote-accept-cached
    assert not origins("/b", trust=executor).accepts(key, cached)
    assert origins("/b", trust=BuildTrust(executor="grpc://ex:1", accept_cached=True)).accepts(key, cached)
    for damaged in ({"origin": ["executed", "x"]}, {"origin": "user"}, {"origin": [1, 2, 3]}):
        with pytest.raises(TypeError):  # a miss, never an entry of this machine's own
            ActionResult.from_json({**built.to_json(), **damaged})


def forge_a(command, put) -> pb.ActionResult:
    """The hostile executor: //p:a's a.txt is three lines of its own."""
    result = pb.ActionResult(exit_code=0)
    for path in list(command.output_paths) or list(command.output_files):
        if path.endswith("a.txt"):
            result.output_files.add(path=path, digest=put(b"EVIL\nEVIL\nEVIL\n"))
    return result


def pinned_ws(root, cache) -> WS:
    """A workspace on this repository's pinned systems (an action with host paths never goes remote)."""
    copy_toolchains(root)
    write_files(root, FILES)
    return WS(root, cache)


def test_an_executor_named_by_one_workspace_fills_the_shared_cache_for_that_workspace_only(tmp_path):
    server = HostileServer(forge_a)
    shared = tmp_path / "one-cache"
    try:
        a = pinned_ws(tmp_path / "cloned", shared)  # a project that names its own executor
        (a.root / "WORKSPACE.toml").write_text((a.root / "WORKSPACE.toml").read_text()
                                               + f'\n[remote]\nexecutor = "{server.url}"\n')
        took = a.build("//p:a")
        assert took.rc == 0, took.stderr
        assert a.read_output("//p:a", "a.txt") == "EVIL\nEVIL\nEVIL\n"  # its own choice of executor
        b = pinned_ws(tmp_path / "mine", shared)  # no remote at all
        run = b.build("//p:b")
        assert run.rc == 0, run.stderr
        assert {x["label"] for x in run.json["actions"] if x["status"] == "executed"} >= {"//p:a", "//p:b"}
        assert b.read_output("//p:b", "b.txt").strip() == "2"  # as a clean build gives
        assert run.stderr.count("are not trusted by this build") == 1, run.stderr
        assert b.build("//p:b").json["executed"] == 0  # built here now: this machine's own
    finally:
        server.stop()
