"""The remote cache against a real nginx (WebDAV PUT) started on 127.0.0.1: sharing between
caches and workspace directories, read-only by default, faults, poisoning and signatures."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from bgraph_testlib import WORKSPACE_TOML, requires_bwrap, statuses
from remote_servers import Nginx, SilentServer, free_port, requires_nginx

pytestmark = [requires_bwrap, requires_nginx]

OPEN = ("--remote-allow-unsigned",)  # a remote without trusted keys, allowed (one warning line)


def _public_key() -> str:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    return Ed25519PrivateKey.generate().public_key().public_bytes(serialization.Encoding.Raw,
                                                                  serialization.PublicFormat.Raw).hex()


KEYED = ("--remote-trusted-key", _public_key())  # trusts a key that signed nothing: no warning about trust


def signing(tmp_path) -> tuple[str, str]:
    """The option of an uploader's signing key (made once per test): uploads where keys are
    trusted must be signed."""
    from build_graph.store.signing import generate_key

    key = tmp_path / "uploader.key"
    if not key.exists():
        generate_key(key)
    return ("--remote-signing-key", str(key))

FILES = {
    "in.txt": "alpha\nbeta\n",
    "targets/p.toml": '''[a]
kind = "genrule"
srcs = ["in.txt"]
outs = ["a.txt"]
cmd = "sort -r $SRC/in.txt > $OUT/a.txt"

[b]
kind = "genrule"
outs = ["b.txt", "sub/c.txt"]
deps = { a = ":a" }
cmd = "wc -l < $IN_A/a.txt > $OUT/b.txt; echo nested > $OUT/sub/c.txt"
''',
}


@pytest.fixture
def nginx(tmp_path):
    server = Nginx(tmp_path / "nginx")
    yield server
    server.stop()


def build(ws, *args):
    run = ws.build("//p:b", args=args)
    assert run.rc == 0, run.stderr
    return run


def outputs(summary) -> dict[str, str]:
    return {f"{a['label']} {a['name']}": a["key"] for a in summary["actions"]}


def test_a_fresh_cache_in_another_directory_runs_nothing(make_ws, nginx):
    first = make_ws(FILES, name="one")
    up = build(first, "--remote-cache", nginx.url, *OPEN, "--remote-upload")
    assert up.json["executed"] == 2 and up.json["remote"]["uploaded"] == 2
    assert len(nginx.files("ac")) == 2 and nginx.files("cas")
    second = make_ws(FILES, name="elsewhere")  # another workspace dir, another (empty) cache
    down = build(second, "--remote-cache", nginx.url, *OPEN)
    assert down.json["executed"] == 0 and down.json["remote"]["hits"] == 2
    assert outputs(down.json) == outputs(up.json)
    for path in ("b.txt", "sub/c.txt"):
        assert second.read_output("//p:b", path) == first.read_output("//p:b", path)
    assert second.cli("cache", "verify").rc == 0
    # The hits were filed locally: the remote is not needed any more (the user vouched for it on
    # the command line, so every later build takes them, with another remote or none).
    assert build(second, "--remote-cache", "http://127.0.0.1:9/none", *OPEN).json["executed"] == 0
    assert build(second).json["executed"] == 0


def test_a_remote_only_a_workspace_trusts_fills_the_shared_cache_for_that_workspace_only(make_ws, nginx, tmp_path):
    """A [remote] that a project's WORKSPACE.toml allows unsigned (a project one cloned) vouches
    for its results in that workspace only: another workspace on the same cache, with no remote or
    its own, builds them here (red team R4)."""
    build(make_ws(FILES, name="writer"), "--remote-cache", nginx.url, *OPEN, "--remote-upload")
    shared = tmp_path / "one-cache"
    cloned = make_ws({**FILES, "WORKSPACE.toml": WORKSPACE_TOML + f'\n[remote]\nurl = "{nginx.url}"\n'
                                                                  'allow_unsigned = true\n'},
                     name="cloned", cache=shared)
    pulled = build(cloned)
    assert pulled.json["executed"] == 0 and pulled.json["remote"]["hits"] == 2
    assert build(cloned).json["executed"] == 0  # the same workspace keeps taking them
    mine = make_ws(FILES, name="mine", cache=shared)
    run = build(mine)
    assert run.json["executed"] == 2 and run.stderr.count("are not trusted by this build") == 1, run.stderr
    other = make_ws(FILES, name="other", cache=shared)
    assert build(other, "--remote-cache", "http://127.0.0.1:9/none", *OPEN).json["executed"] == 0  # built by mine


def test_builds_only_read_unless_told_to_upload(make_ws, nginx):
    ws = make_ws(FILES)
    run = build(ws, "--remote-cache", nginx.url, *OPEN)
    assert run.json["remote"]["misses"] == 2 and run.json["remote"]["uploaded"] == 0
    assert nginx.files("ac") == [] and nginx.files("cas") == []


def test_the_remote_can_come_from_workspace_toml_and_user_config(make_ws, nginx, tmp_path):
    ws = make_ws(FILES)
    ws.write({"WORKSPACE.toml": (ws.root / "WORKSPACE.toml").read_text() + f'\n[remote]\nurl = "{nginx.url}"\n'
                                                                             'allow_unsigned = true\n'})
    config = tmp_path / "config.toml"
    config.write_text("[remote]\nupload = true\n")
    run = ws.build("//p:b", env={"BGRAPH_CONFIG": str(config)})
    assert run.rc == 0 and run.json["remote"]["uploaded"] == 2
    config.write_text("[remote]\nupload = true\nbogus = 1\n")
    bad = ws.build("//p:b", env={"BGRAPH_CONFIG": str(config)})
    assert bad.rc == 2 and "config.toml" in bad.stderr and "unknown key 'bogus'" in bad.stderr


@pytest.mark.parametrize("fault", ["refused", "503", "hung"])
def test_an_unusable_remote_costs_one_warning_and_the_build_succeeds(make_ws, nginx, fault, tmp_path):
    ws = make_ws(FILES)
    silent = SilentServer() if fault == "hung" else None
    url = {"refused": f"http://127.0.0.1:{free_port()}/cache", "503": nginx.broken_url,
           "hung": silent.url if silent else ""}[fault]
    if fault == "hung":  # a short timeout, from WORKSPACE.toml
        ws.write({"WORKSPACE.toml": (ws.root / "WORKSPACE.toml").read_text() + "\n[remote]\ntimeout_s = 1\n"})
    start = time.monotonic()
    run = ws.build("//p:b", args=("--remote-cache", url, "--remote-upload", *KEYED, *signing(tmp_path)))
    took = time.monotonic() - start
    if silent:
        assert silent.accepted <= 4  # the circuit breaker stopped calling it (3 failures, 2 threads)
        silent.stop()
    assert run.rc == 0, run.stderr
    assert statuses(run.json) == {"//p:a": "executed", "//p:b": "executed"}
    assert run.stderr.count("remote cache") == 1 and "unavailable" in run.stderr
    assert "Traceback" not in run.stderr
    assert took < 30
    assert ws.read_output("//p:b", "sub/c.txt") == "nested\n"


def corrupt_remote(nginx, how: str) -> None:
    blobs = [p for p in nginx.files("cas") if p.stat().st_size > 0]
    for p in blobs:  # every blob: whichever the entries name
        data = p.read_bytes()
        p.write_bytes(data[: len(data) // 2] if how == "truncated" else b"X" + data[1:])


@pytest.mark.parametrize("how", ["truncated", "flipped"])
def test_wrong_remote_bytes_never_enter_the_local_store(make_ws, nginx, how):
    build(make_ws(FILES, name="writer"), "--remote-cache", nginx.url, *OPEN, "--remote-upload")
    corrupt_remote(nginx, how)
    reader = make_ws(FILES, name="reader")
    run = build(reader, "--remote-cache", nginx.url, *OPEN)
    assert run.json["executed"] == 2 and run.json["remote"]["ignored"] >= 1
    assert "ignored the entry" in run.stderr and "building it here" in run.stderr
    assert reader.read_output("//p:b", "b.txt").strip() == "2"
    assert reader.cli("cache", "verify").rc == 0


def forge(nginx, change) -> None:
    """Rewrite every action-cache envelope on the server with `change(envelope)`."""
    for p in nginx.files("ac"):
        env = json.loads(p.read_bytes())
        change(env)
        p.write_text(json.dumps(env))


def test_an_entry_naming_outputs_the_remote_lacks_is_a_miss(make_ws, nginx):
    build(make_ws(FILES, name="writer"), "--remote-cache", nginx.url, *OPEN, "--remote-upload")
    forge(nginx, lambda env: env["body"].update(output_tree="0" * 64))
    run = build(make_ws(FILES, name="reader"), "--remote-cache", nginx.url, *OPEN)
    assert run.json["executed"] == 2 and "missing from the remote" in run.stderr


def test_signed_results_are_used_and_forged_ones_are_ignored(make_ws, nginx, tmp_path):
    from build_graph.store.signing import generate_key

    ci_key, other_key = tmp_path / "ci.key", tmp_path / "other.key"
    keygen = make_ws({}, name="keys").cli("cache", "keygen", str(ci_key))
    assert keygen.rc == 0 and oct(ci_key.stat().st_mode & 0o777) == "0o600"
    ci_pub, other_pub = keygen.stdout.strip(), generate_key(other_key)
    assert len(ci_pub) == 64
    again = make_ws({}, name="keys2").cli("cache", "keygen", str(ci_key))
    assert again.rc == 2 and "not overwriting" in again.stderr
    writer = make_ws(FILES, name="writer")
    build(writer, "--remote-cache", nginx.url, *OPEN, "--remote-upload", "--remote-signing-key", str(ci_key))
    trusted = ("--remote-cache", nginx.url, "--remote-trusted-key", ci_pub)
    ok = build(make_ws(FILES, name="reader1"), *trusted)
    assert ok.json["executed"] == 0 and ok.json["remote"]["hits"] == 2
    # Not signed by a trusted key: ignored, rebuilt here.
    untrusted = build(make_ws(FILES, name="reader2"), "--remote-cache", nginx.url, "--remote-trusted-key", other_pub)
    assert untrusted.json["executed"] == 2 and "signed by an untrusted key" in untrusted.stderr
    # A machine without the key rewrites a result: the signature no longer matches.
    saved = {p: p.read_bytes() for p in nginx.files("ac")}
    forge(nginx, lambda env: env["body"].update(exit_code=1))
    tampered = build(make_ws(FILES, name="reader3"), *trusted)
    assert tampered.json["executed"] >= 1 and "wrong signature" in tampered.stderr
    # Unsigned uploads (any machine can write to an open cache) are ignored too.
    for p, data in saved.items():
        p.write_bytes(data)
    forge(nginx, lambda env: env.update(sig=None, pub=None))
    unsigned = build(make_ws(FILES, name="reader4"), *trusted)
    assert unsigned.json["executed"] == 2 and "unsigned" in unsigned.stderr


def test_cuda_kernels_come_from_the_remote_with_no_compile(tmp_path, nginx):
    """Real nvcc steps (depfile-narrowed preprocessing included) through the remote."""
    from test_cuda_library import archive_bytes, build as cuda_build, write_workspace

    one = write_workspace(tmp_path / "one" / "ws", archs='["12.1a"]')
    two = write_workspace(tmp_path / "two" / "other", archs='["12.1a"]')
    up = cuda_build(one, tmp_path / "cache1", "--remote-cache", nginx.url, *OPEN, "--remote-upload")
    assert up["executed"] > 10
    down = cuda_build(two, tmp_path / "cache2", "--remote-cache", nginx.url, *OPEN)
    assert down["executed"] == 0, [a["name"] for a in down["actions"] if a["status"] == "executed"]
    assert archive_bytes(one) == archive_bytes(two)
    shutil.rmtree(tmp_path / "cache2")


# -- trust: a remote with no trusted keys only when allowed; who signed a pulled result ---------------
def test_a_remote_without_trusted_keys_is_refused_unless_allowed(make_ws, nginx, tmp_path):
    ws = make_ws(FILES)
    refused = ws.build("//p:b", args=("--remote-cache", nginx.url))
    assert refused.rc == 2 and "Traceback" not in refused.stderr
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: remote cache {nginx.url} has no trusted_keys: its results would be used whoever "
                      "wrote them"], refused.stderr
    assert "hint:" in refused.stderr and "trusted_keys" in refused.stderr
    assert "allow_unsigned = true" in refused.stderr and "--remote-allow-unsigned" in refused.stderr
    assert not (ws.root / "bgraph-out").exists()
    # Allowed by the flag: one warning line for the whole build, however many results it reads or writes.
    up = build(ws, "--remote-cache", nginx.url, *OPEN, "--remote-upload")
    assert up.json["remote"]["uploaded"] == 2
    assert up.stderr.count("allow_unsigned is on") == 1, up.stderr
    down = build(make_ws(FILES, name="reader"), "--remote-cache", nginx.url, *OPEN)
    assert down.json["remote"]["hits"] == 2 and down.stderr.count("allow_unsigned is on") == 1, down.stderr
    # Allowed by the user's config ([remote] allow_unsigned = true).
    config = tmp_path / "config.toml"
    config.write_text(f'[remote]\nurl = "{nginx.url}"\nallow_unsigned = true\n')
    third = make_ws(FILES, name="third")
    run = third.build("//p:b", env={"BGRAPH_CONFIG": str(config)})
    assert run.rc == 0 and run.json["remote"]["hits"] == 2 and run.stderr.count("allow_unsigned is on") == 1
    # Trusted keys win: allow_unsigned then changes nothing, and there is nothing to warn about.
    keyed = make_ws(FILES, name="keyed").build("//p:b", args=(*KEYED,), env={"BGRAPH_CONFIG": str(config)})
    assert keyed.rc == 0 and keyed.json["executed"] == 2 and "allow_unsigned is on" not in keyed.stderr
    assert "unsigned" in keyed.stderr  # the unsigned entries were ignored (one warning line)


def pulled_records(ws) -> dict[str, dict]:
    """key -> the origin its local entry carries (store/origins.py), for the entries that have one."""
    root = ws.store / "ac"
    entries = {p.parent.name + p.stem: json.loads(p.read_text()) for p in root.rglob("*.json")
               if not p.name.endswith(".reads.json")} if root.exists() else {}
    return {k: dict(zip(("signer", "remote", "vouched"), e["origin"])) for k, e in entries.items() if "origin" in e}


def test_trusting_keys_later_drops_unsigned_pulled_results(make_ws, nginx):
    build(make_ws(FILES, name="writer"), "--remote-cache", nginx.url, *OPEN, "--remote-upload")
    reader = make_ws(FILES, name="reader")
    pulled = build(reader, "--remote-cache", nginx.url, *OPEN)
    assert pulled.json["executed"] == 0 and pulled.json["remote"]["hits"] == 2
    records = pulled_records(reader)
    assert set(records) == {a["key"] for a in pulled.json["actions"]}
    assert {r["signer"] for r in records.values()} == {"unsigned"}
    # Keys trusted now: the unsigned results pulled before are dropped (one warning line), the
    # remote's copies are ignored (unsigned), and both actions run here.
    trusted = reader.build("//p:b", args=("--remote-cache", nginx.url, *KEYED))
    assert trusted.rc == 0, trusted.stderr
    assert trusted.json["executed"] == 2 and trusted.json["remote"]["dropped"] == 2
    assert trusted.stderr.count("dropped results pulled earlier") == 1, trusted.stderr
    assert "unsigned" in trusted.stderr
    assert reader.read_output("//p:b", "b.txt").strip() == "2"
    # What was built here stays: the next build under the same trust runs nothing and drops nothing.
    again = reader.build("//p:b", args=("--remote-cache", nginx.url, *KEYED))
    assert again.json["executed"] == 0 and again.json["remote"]["dropped"] == 0
    # And without a remote, the local cache is used as it is.
    assert reader.build("//p:b").json["executed"] == 0


def test_a_pulled_result_keeps_who_signed_it(make_ws, nginx, tmp_path):
    from build_graph.store.signing import generate_key

    ci_pub, other_pub = generate_key(tmp_path / "ci.key"), generate_key(tmp_path / "other.key")
    build(make_ws(FILES, name="writer"), "--remote-cache", nginx.url, "--remote-trusted-key", ci_pub,
          "--remote-upload", "--remote-signing-key", str(tmp_path / "ci.key"))
    # Pulled while unsigned results were allowed: still recorded as signed by CI's key (the
    # signature was checked against the key it names), so trusting that key later keeps them.
    reader = make_ws(FILES, name="reader")
    assert build(reader, "--remote-cache", nginx.url, *OPEN).json["remote"]["hits"] == 2
    assert {r["signer"] for r in pulled_records(reader).values()} == {ci_pub}
    kept = build(reader, "--remote-cache", nginx.url, "--remote-trusted-key", ci_pub)
    assert kept.json["executed"] == 0 and kept.json["remote"]["dropped"] == 0
    # CI's key taken out of the trusted ones: what it signed is dropped, and built here.
    dropped = build(reader, "--remote-cache", nginx.url, "--remote-trusted-key", other_pub)
    assert dropped.json["executed"] == 2 and dropped.json["remote"]["dropped"] == 2
    assert f"signed by {ci_pub[:16]}…, a key not trusted now" in dropped.stderr


# -- bodies are read with a limit -------------------------------------------------------------------------
def local_blobs(ws) -> set[bytes]:
    return {p.read_bytes() for p in (ws.store / "cas").rglob("*") if p.is_file()}


def test_an_oversized_blob_is_refused_and_nothing_is_stored(make_ws, nginx):
    build(make_ws(FILES, name="writer"), "--remote-cache", nginx.url, *OPEN, "--remote-upload")
    tail = b"OVERSIZED" * 200_000  # 1.8 MB past the size each blob's digest names
    for p in nginx.files("cas"):
        p.write_bytes(p.read_bytes() + tail)
    reader = make_ws(FILES, name="reader")
    run = build(reader, "--remote-cache", nginx.url, *OPEN)
    assert run.json["executed"] == 2 and run.json["remote"]["hits"] == 0 and run.json["remote"]["ignored"] >= 1
    assert "bytes its digest names; not read further" in run.stderr, run.stderr
    assert "ignored the entry" in run.stderr and "Traceback" not in run.stderr
    assert pulled_records(reader) == {}
    assert not any(tail[:4096] in data for data in local_blobs(reader))
    assert reader.cli("cache", "verify").rc == 0


def test_an_oversized_entry_is_refused(make_ws, nginx):
    from build_graph.store.remote import MAX_ENTRY_BYTES

    build(make_ws(FILES, name="writer"), "--remote-cache", nginx.url, *OPEN, "--remote-upload")
    for p in nginx.files("ac"):
        p.write_bytes(p.read_bytes()[:-1] + b" " * MAX_ENTRY_BYTES + b"}")  # still valid JSON, too big
    reader = make_ws(FILES, name="reader")
    run = build(reader, "--remote-cache", nginx.url, *OPEN)
    assert run.json["executed"] == 2 and run.json["remote"]["hits"] == 0
    assert f"its entry is larger than the {MAX_ENTRY_BYTES >> 20} MiB an entry can have" in run.stderr, run.stderr
    assert pulled_records(reader) == {}


class EndlessServer:
    """Answers every GET with 200 and a body that never ends (chunked, no Content-Length), or
    with a Content-Length far over any limit; counts what it sent."""

    def __init__(self, announce: bool):
        import socketserver
        import threading

        server = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self):
                self.rfile.readline()
                while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass
                head = "Content-Length: 10000000000\r\n" if announce else "Transfer-Encoding: chunked\r\n"
                self.wfile.write(f"HTTP/1.1 200 OK\r\n{head}\r\n".encode())
                chunk = b"x" * 65536
                try:
                    while server.sent < 1 << 30:
                        self.wfile.write(chunk if announce else b"%x\r\n%s\r\n" % (len(chunk), chunk))
                        server.sent += len(chunk)
                except OSError:
                    pass

        self.sent = 0
        self.httpd = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/cache"

    def stop(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.mark.parametrize("announce", [False, True])
def test_an_endless_body_is_cut_at_its_limit(announce):
    from build_graph.store.remote import MAX_ENTRY_BYTES, BodyTooLarge, HttpRemote

    server = EndlessServer(announce)
    try:
        remote = HttpRemote(server.url, timeout_s=5)
        start = time.monotonic()
        with pytest.raises(BodyTooLarge, match=r"/cas/abc is (over the 1000 bytes|10000000000 bytes, over the 1000)"):
            remote.get_blob("abc", 1000)
        with pytest.raises(BodyTooLarge):
            remote.get_entry("k" * 64)
        assert time.monotonic() - start < 20
        assert server.sent < MAX_ENTRY_BYTES + (48 << 20)  # it stopped reading (less socket buffers): not 1 GiB
        assert not remote.breaker.open
    finally:
        server.stop()


# -- REAPI v2 against a real BuildGrid 0.9.1 ---------------------------------------------------------
SHA256_WORKSPACE = '[workspace]\nname = "test"\ndigest_function = "sha256"\n'


@pytest.fixture(scope="module")
def buildgrid(tmp_path_factory):
    from remote_servers import BuildGrid, buildgrid_bgd, buildgrid_missing_reason

    bgd = buildgrid_bgd()
    if bgd is None:
        pytest.skip(buildgrid_missing_reason())
    server = BuildGrid(tmp_path_factory.mktemp("buildgrid") / "server", bgd)
    yield server
    server.stop()


def test_buildgrid_skip_reason_names_what_is_missing(tmp_path):
    """Where neither BuildGrid nor a Python 3.13 to install it is found, the REAPI tests skip with
    a reason (shown by pytest -rs, as CI runs it) that names the tool and how to get it."""
    from remote_servers import buildgrid_bgd, buildgrid_missing_reason

    home = tmp_path / "home"
    roots = [home / ".pyenv"]
    assert buildgrid_bgd(homes=[home], roots=roots, path=str(tmp_path / "empty-bin")) is None
    reason = buildgrid_missing_reason(roots, [home])
    assert reason.startswith("BuildGrid 0.9.1 unavailable, so the REAPI remote cache is untested")
    assert f"looked for {home}/.pyenv/versions/3.13*/bin/python3.13 and python3.13 on PATH" in reason
    assert f"no ready venv at {home}/.cache/bgraph-tests/buildgrid-0.9.1" in reason
    assert "Install: pyenv install 3.13" in reason and "buildgrid==0.9.1" in reason
    # A python3.13 on PATH that does not run (pyenv's shim where 3.13 is not selected) is not one.
    shim = tmp_path / "bin" / "python3.13"
    shim.parent.mkdir()
    shim.write_text("#!/bin/sh\nexit 127\n")
    shim.chmod(0o755)
    assert buildgrid_bgd(homes=[home], roots=roots, path=str(shim.parent)) is None
    assert not home.exists()  # looking made nothing


def test_buildgrid_python_is_found_under_the_users_pyenv_though_home_is_private(tmp_path, monkeypatch):
    """The session's HOME is private (conftest): Python 3.13 is still looked for in the user's
    real ~/.pyenv (else the REAPI tests skip on a machine that has it, as they did)."""
    import bgraph_testlib
    from remote_servers import python313, pyenv_roots

    assert Path.home() != bgraph_testlib.USER_HOME
    user = tmp_path / "user"
    python = user / ".pyenv" / "versions" / "3.13.1" / "bin" / "python3.13"
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\necho Python 3.13.1\n")
    python.chmod(0o755)
    monkeypatch.delenv("PYENV_ROOT", raising=False)
    monkeypatch.setattr(bgraph_testlib, "USER_HOME", user)
    assert pyenv_roots() == [user / ".pyenv"]
    assert python313(path=str(tmp_path / "empty-bin")) == str(python)


def sha256_ws(make_ws, name, extra=None):
    return make_ws({**FILES, "WORKSPACE.toml": SHA256_WORKSPACE, **(extra or {})}, name=name)


BIG = {"targets/big.toml": '''[big]
kind = "genrule"
outs = ["big.bin"]
cmd = "head -c 6000000 /dev/zero | tr '\\\\0' b > $OUT/big.bin"
'''}


def test_reapi_a_fresh_cache_in_another_directory_runs_nothing(make_ws, buildgrid):
    first = sha256_ws(make_ws, "one", BIG)
    up = first.build("//p:b", "//big:big", args=("--remote-cache", buildgrid.url, *OPEN, "--remote-upload"))
    assert up.rc == 0, up.stderr
    assert up.json["executed"] == 3 and up.json["remote"]["uploaded"] == 3
    second = sha256_ws(make_ws, "elsewhere", BIG)
    down = second.build("//p:b", "//big:big", args=("--remote-cache", buildgrid.url, *OPEN))
    assert down.rc == 0, down.stderr
    assert down.json["executed"] == 0 and down.json["remote"]["hits"] == 3
    assert outputs(down.json) == outputs(up.json)
    # 6 MB is over BuildGrid's 4 MiB batch limit: it went through ByteStream both ways.
    assert second.read_output("//big:big", "big.bin") == "b" * 6000000
    assert second.cli("cache", "verify").rc == 0


def test_reapi_needs_the_servers_digest_function(make_ws, buildgrid):
    ws = make_ws(FILES)  # blake3, which BuildGrid does not offer
    run = ws.build("//p:b", args=("--remote-cache", buildgrid.url, *OPEN))
    assert run.rc == 2 and "offers digest functions sha256, not blake3" in run.stderr
    assert 'digest_function = "sha256"' in run.stderr and "Traceback" not in run.stderr


def test_reapi_server_down_costs_one_warning(make_ws, tmp_path):
    ws = sha256_ws(make_ws, "alone")
    run = ws.build("//p:b", args=("--remote-cache", f"grpc://127.0.0.1:{free_port()}", "--remote-upload", *KEYED,
                                  *signing(tmp_path)))
    assert run.rc == 0, run.stderr
    assert run.json["executed"] == 2
    assert run.stderr.count("remote cache") == 1 and "unavailable" in run.stderr


def test_reapi_signed_entries_and_poisoned_ones(make_ws, buildgrid, tmp_path):
    import json as _json

    from build_graph.store.reapi_remote import ReapiRemote
    from build_graph.store.signing import generate_key

    key = tmp_path / "ci.key"
    pub = generate_key(key)
    signed_input = {"in.txt": "signed\nentries\n"}
    writer = sha256_ws(make_ws, "writer", signed_input)
    up = writer.build("//p:b", args=("--remote-cache", buildgrid.url, *OPEN, "--remote-upload",
                                     "--remote-signing-key", str(key)))
    assert up.rc == 0 and up.json["remote"]["uploaded"] == 2
    trusted = ("--remote-cache", buildgrid.url, "--remote-trusted-key", pub)
    ok = sha256_ws(make_ws, "reader", signed_input).build("//p:b", args=trusted)
    assert ok.json["executed"] == 0
    # A writer without the key replaces b's entry with an unsigned one naming a's output.
    remote = ReapiRemote(buildgrid.url, "sha256")
    keys = {a["label"]: a["key"] for a in up.json["actions"]}
    env = _json.loads(remote.get_entry(keys["//p:a"]))
    env.update(key=keys["//p:b"], sig=None, pub=None)
    remote.put_entry(keys["//p:b"], _json.dumps(env).encode())
    victim = sha256_ws(make_ws, "victim", signed_input)
    run = victim.build("//p:b", args=trusted)
    assert statuses(run.json) == {"//p:a": "hit", "//p:b": "executed"} and "unsigned" in run.stderr
    assert victim.read_output("//p:b", "b.txt").strip() == "2"


# -- a warm local cache fills an empty remote without rebuilding (backfill) ----------------------
def test_a_warm_local_cache_fills_the_remote_without_running_anything(make_ws, nginx):
    warm = make_ws(FILES, name="laptop")
    first = warm.build("//p:b")
    assert first.rc == 0 and first.json["executed"] == 2
    pushed = warm.build("//p:b", args=("--remote-cache", nginx.url, *OPEN, "--remote-upload"))
    assert pushed.rc == 0, pushed.stderr
    assert pushed.json["executed"] == 0 and pushed.json["remote"]["backfilled"] == 2
    assert len(nginx.files("ac")) == 2
    again = warm.build("//p:b", args=("--remote-cache", nginx.url, *OPEN, "--remote-upload"))
    assert again.json["remote"]["backfilled"] == 0  # the remote has them now: nothing sent twice
    fresh = make_ws(FILES, name="ci")
    pulled = fresh.build("//p:b", args=("--remote-cache", nginx.url, *OPEN))
    assert pulled.json["executed"] == 0 and pulled.json["remote"]["hits"] == 2
    assert fresh.read_output("//p:b", "b.txt") == warm.read_output("//p:b", "b.txt")


def test_reading_builds_never_backfill(make_ws, nginx):
    warm = make_ws(FILES)
    assert warm.build("//p:b").rc == 0
    read_only = warm.build("//p:b", args=("--remote-cache", nginx.url, *OPEN))
    assert read_only.json["remote"]["backfilled"] == 0 and nginx.files("ac") == []


def test_envelopes_nobody_signed_that_cannot_be_read_are_ignored(make_ws, nginx):
    """Body text that cannot be encoded (a lone surrogate) or that nests past the parser's depth
    failed the build for every reader (red team K12): both are entries to ignore."""
    build(make_ws(FILES, name="writer"), "--remote-cache", nginx.url, *OPEN, "--remote-upload")
    saved = {p: p.read_bytes() for p in nginx.files("ac")}
    forge(nginx, lambda env: env["body"].update(note="\ud800"))
    run = build(make_ws(FILES, name="reader1"), "--remote-cache", nginx.url, *OPEN)
    assert run.json["executed"] == 2 and "not a bgraph cache entry" in run.stderr
    for p, data in saved.items():
        env = json.loads(data)
        p.write_text(json.dumps(env)[:-1] + ', "deep": ' + "[" * 100_000 + "]" * 100_000 + "}")
    run = build(make_ws(FILES, name="reader2"), "--remote-cache", nginx.url, *OPEN)
    assert run.json["executed"] == 2 and "not a bgraph cache entry" in run.stderr


def test_uploading_without_a_signing_key_where_keys_are_trusted_is_refused(make_ws, nginx):
    """Its unsigned entries would replace the signed ones its readers trust (red team K12)."""
    ws = make_ws(FILES)
    run = ws.build("//p:b", args=("--remote-cache", nginx.url, *KEYED, "--remote-upload"))
    assert run.rc == 2 and "no signing_key" in run.stderr and "hint:" in run.stderr
    assert "Traceback" not in run.stderr and not list(nginx.files("ac"))


def test_a_narrowed_remote_result_with_an_undeclared_output_is_refused(make_ws, nginx, tmp_path):
    """A depfile-narrowed compile (a ninja edge, gcc -MMD) found through its manifest is held to
    its declared outputs as every other action is: a signed entry whose tree has one more file
    (a CI that misfiled, a stale writer) is refused and the compile runs here."""
    import oracle_lib
    from build_graph.model import Digester, Tree
    from build_graph.store.cas import LocalCas
    from build_graph.store.signing import Signer, generate_key, signed_message

    ninja = ("ninja_required_version = 1.3\nrule cc\n  command = /usr/bin/gcc -MMD -MF $out.d -O1 -c $in -o $out\n"
             "  depfile = $out.d\n  deps = gcc\nrule cp\n  command = /usr/bin/cp $in $out\n"
             "build /bgraph/out/obj/main.o: cc /bgraph/src/tree/main.c\n"
             "build /bgraph/out/lib/main.o: cp /bgraph/out/obj/main.o\ndefault /bgraph/out/lib/main.o\n")
    files = {"targets/toolchains.toml": oracle_lib.TOOLCHAINS, "targets/c.toml": oracle_lib.C_TARGETS,
             "gen/build.ninja": ninja, "proj/main.c": '#include "h.h"\nint f(void){return H;}\n',
             "proj/h.h": "#define H 1\n"}
    public = generate_key(tmp_path / "ci.key")
    writer = make_ws(files, name="writer", toolchains=False)
    up = writer.build("//c:obj", args=("--remote-cache", nginx.url, "--remote-trusted-key", public,
                                       "--remote-signing-key", str(tmp_path / "ci.key"), "--remote-upload"))
    assert up.rc == 0, up.stderr
    [key] = [a["key"] for a in up.json["actions"] if a["label"] == "//c:obj" and "obj/main.o" in a["name"]
             and "lib/" not in a["name"]]
    entry = json.loads((nginx.store / "cache/ac" / key).read_text())
    cas = LocalCas(writer.cache, Digester("blake3"))
    try:  # the entry's tree, one file more, signed again by the trusted key
        evil = cas.put_bytes(b"\x7fELF evil\n")
        forged = cas.put_tree(Tree({**cas.get_tree(entry["body"]["output_tree"]).entries, "lib/evil.so": evil}))
        (nginx.store / "cache/cas" / evil.digest).write_bytes(b"\x7fELF evil\n")
        nodes = [forged]
        while nodes:
            node = nodes.pop()
            raw = cas.node_bytes(node)
            (nginx.store / "cache/cas" / node).write_bytes(raw)
            entry["sizes"][node] = len(raw)
            nodes += [sub for _name, sub in json.loads(raw)["dirs"]]
    finally:
        cas.close()
    entry["body"]["output_tree"] = forged
    entry["sig"] = Signer(tmp_path / "ci.key").sign(signed_message(entry["key"], entry["kind"], entry["body"]))
    (nginx.store / "cache/ac" / key).write_text(json.dumps(entry, sort_keys=True))
    reader = make_ws(files, name="reader", toolchains=False)
    run = reader.build("//c:obj", args=("--remote-cache", nginx.url, "--remote-trusted-key", public))
    assert run.rc == 0, run.stderr
    [compile_step] = [a for a in run.json["actions"] if a["label"] == "//c:obj" and "obj/main.o" in a["name"]
                      and "lib/" not in a["name"]]
    assert compile_step["status"] == "executed", compile_step
    assert "not a declared output" in compile_step["reason"], compile_step


def test_a_manifest_entry_whose_key_is_not_its_own_is_never_followed(tmp_path):
    """An entry of a depfile manifest (a remote's is another machine's word) is followed only if its
    key is the digest of what it records, as record() files it: else it could pass off another
    result as what these reads make."""
    from build_graph.model import Digester
    from build_graph.rebuilder import Rebuilder
    from build_graph.store.action_cache import LocalActionCache
    from build_graph.store.cas import LocalCas

    digester = Digester("blake3")
    cas = LocalCas(tmp_path / "cache", digester)
    try:
        rebuilder = Rebuilder(cas, LocalActionCache(cas.base, cas.tmp), digester)
        entry = {"reads": {"/bgraph/src": {"a.h": "d" * 64}}, "v": 4}
        entry["key"] = digester.of_json({"prekey": "p" * 64, **entry})
        assert rebuilder._entry_key_holds("p" * 64, entry)
        assert not rebuilder._entry_key_holds("q" * 64, entry)  # another action's manifest
        assert not rebuilder._entry_key_holds("p" * 64, {**entry, "key": "e" * 64})
        assert not rebuilder._entry_key_holds("p" * 64, {**entry, "reads": {}})
        assert not rebuilder._entry_key_holds("p" * 64, ["not", "an", "entry"])
    finally:
        cas.close()
