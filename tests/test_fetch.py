"""Pinned downloads: pip's configured index (never hard-coded), sha256 verification."""

from __future__ import annotations

import hashlib
import io
import os
import zipfile
from pathlib import Path

import pytest

from pypi_simple import PYPI_SIMPLE_ENDPOINT

from bgraph_testlib import action, requires_bwrap
from build_graph.fetcher import http_session, pip_indexes

PYPI = PYPI_SIMPLE_ENDPOINT.rstrip("/")  # pip's default index, named by a maintained library


@pytest.fixture
def no_pip_config(monkeypatch):
    for k in list(os.environ):
        if k.startswith("PIP_"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)


def test_default_is_pypi(no_pip_config):
    assert pip_indexes() == [PYPI]


def test_index_url_from_environment(no_pip_config, monkeypatch):
    monkeypatch.setenv("PIP_INDEX_URL", "https://mirror.example/simple")
    assert pip_indexes() == ["https://mirror.example/simple"]
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "https://a.example/simple  file:///srv/b/simple")
    assert pip_indexes() == ["https://mirror.example/simple", "https://a.example/simple", "file:///srv/b/simple"]


def test_extra_index_alone_keeps_pypi_first(no_pip_config, monkeypatch):
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "https://extra.example/simple")
    assert pip_indexes() == [PYPI, "https://extra.example/simple"]


def test_never_empty(no_pip_config, monkeypatch):
    monkeypatch.setenv("PIP_INDEX_URL", "")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "")
    result = pip_indexes()
    assert result == [PYPI]
    assert all(result)


def test_index_from_pip_config_file(no_pip_config, monkeypatch, tmp_path):
    conf = tmp_path / "pip.conf"
    conf.write_text("[global]\nindex_url = https://conf.example/simple\n"
                    "extra-index-url =\n    https://one.example/simple\n    https://two.example/simple\n")
    monkeypatch.setenv("PIP_CONFIG_FILE", str(conf))
    assert pip_indexes() == ["https://conf.example/simple", "https://one.example/simple",
                             "https://two.example/simple"]
    # The environment wins over the file, as in pip.
    monkeypatch.setenv("PIP_INDEX_URL", "https://env.example/simple")
    assert pip_indexes()[0] == "https://env.example/simple"


def test_pip_is_not_imported_for_its_configuration(no_pip_config):
    """pip's private modules are not an API: its configuration is read through `pip config list`."""
    import subprocess
    import sys
    code = "import sys; from build_graph.fetcher import pip_indexes; pip_indexes(); print('pip' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_download_retries_a_failing_server(tmp_path):
    """Two 503 answers, then the file: the download succeeds (urllib3's Retry with backoff)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    answers = [503, 503, 200]
    seen = []

    class Flaky(BaseHTTPRequestHandler):
        def do_GET(self):
            status = answers.pop(0) if answers else 200
            seen.append(status)
            body = b"payload" if status == 200 else b"busy"
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Flaky)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        r = http_session().get(f"http://127.0.0.1:{server.server_port}/f", timeout=10)
        assert r.status_code == 200 and r.content == b"payload" and seen == [503, 503, 200]
    finally:
        server.shutdown()


# -- a pypi_archive through a local file:// simple index -----------------------------------------------
WHEEL = "tiny_pkg-1.0-py3-none-any.whl"


def make_wheel() -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr(zipfile.ZipInfo("tiny_pkg/__init__.py", (1980, 1, 1, 0, 0, 0)), "VALUE = 42\n")
        info = zipfile.ZipInfo("tiny_pkg-1.0.data/scripts/tiny", (1980, 1, 1, 0, 0, 0))
        info.external_attr = 0o100755 << 16
        zf.writestr(info, "#!/bin/sh\necho tiny\n")
    return buf.getvalue()


def make_index(root: Path, project_dir: str = "tiny-pkg") -> tuple[str, str]:
    """root/simple/<project>/index.html linking ../../files/<wheel>; returns (index url, sha256)."""
    data = make_wheel()
    sha = hashlib.sha256(data).hexdigest()
    (root / "files").mkdir(parents=True)
    (root / "files" / WHEEL).write_bytes(data)
    page = root / "simple" / project_dir
    page.mkdir(parents=True)
    (page / "index.html").write_text(
        f'<!DOCTYPE html><html><body>\n<a href="../../files/{WHEEL}#sha256={sha}">{WHEEL}</a><br/>\n'
        f'<a href="../../files/tiny_pkg-0.9.tar.gz#sha256={"1" * 64}">tiny_pkg-0.9.tar.gz</a>\n</body></html>\n')
    return f"file://{root}/simple", sha


def pypi_ws(make_ws, sha: str, project: str = "tiny-pkg", filename: str = WHEEL):
    return make_ws({
        "WORKSPACE.toml": f'''[workspace]
name = "t"

[pins.tiny]
kind = "pypi"
project = "{project}"
version = "1.0"
file = "wheel"
filename = "{filename}"
sha256 = "{sha}"
''',
        "targets/deps.toml": '[tiny-wheel]\nkind = "pypi_archive"\npin = "tiny"\n\n'
                             '[tiny]\nkind = "extract"\nsrc = ":tiny-wheel"\n',
    })


@requires_bwrap
def test_pypi_archive_through_local_index(make_ws, tmp_path):
    index, sha = make_index(tmp_path / "index")
    ws = pypi_ws(make_ws, sha)
    ws.env = {"PIP_INDEX_URL": index}
    run = ws.build("//deps:tiny")
    assert run.rc == 0, run.stderr
    assert action(run.json, "//deps:tiny-wheel")["status"] == "executed"
    out = ws.root / "bgraph-out/deps"
    assert (out / "tiny" / "tiny_pkg/__init__.py").read_text() == "VALUE = 42\n"
    assert os.access(out / "tiny" / "tiny_pkg-1.0.data/scripts/tiny", os.X_OK)
    assert not os.access(out / "tiny" / "tiny_pkg/__init__.py", os.X_OK)
    # Fixed output: the fetch's key is the pinned sha256, so moving the index changes nothing.
    moved = tmp_path / "moved"
    (tmp_path / "index").rename(moved)
    ws.env = {"PIP_INDEX_URL": f"file://{moved}/simple"}
    again = ws.build("//deps:tiny")
    assert again.rc == 0 and again.json["executed"] == 0


@requires_bwrap
def test_pypi_archive_sha256_mismatch(make_ws, tmp_path):
    index, sha = make_index(tmp_path / "index")
    ws = pypi_ws(make_ws, "f" * 64)
    ws.env = {"PIP_INDEX_URL": index}
    run = ws.build("//deps:tiny")
    assert run.rc == 1
    assert "sha256 mismatch" in run.stderr
    assert f"got {sha}" in run.stderr and "nothing was stored" in run.stderr
    assert action(run.json, "//deps:tiny-wheel")["status"] == "failed"
    assert ws.ac_entries() == set()
    assert not any(p.is_file() and hashlib.sha256(p.read_bytes()).hexdigest() == sha
                   for p in (ws.store / "cas").rglob("*"))


@requires_bwrap
def test_pypi_project_name_is_normalized(make_ws, tmp_path):
    """PEP 503: runs of '-', '_', '.' become one '-', lowercase."""
    index, sha = make_index(tmp_path / "index")
    ws = pypi_ws(make_ws, sha, project="Tiny._Pkg")
    ws.env = {"PIP_INDEX_URL": index}
    run = ws.build("//deps:tiny-wheel")
    assert run.rc == 0, run.stderr


@requires_bwrap
def test_file_not_on_index(make_ws, tmp_path):
    index, sha = make_index(tmp_path / "index")
    ws = pypi_ws(make_ws, sha, filename="tiny_pkg-1.0-cp311-cp311-linux_x86_64.whl")
    ws.env = {"PIP_INDEX_URL": index, "PIP_EXTRA_INDEX_URL": f"file://{tmp_path}/nowhere/simple"}
    run = ws.build("//deps:tiny-wheel")
    assert run.rc == 1
    assert "tiny_pkg-1.0-cp311-cp311-linux_x86_64.whl is not on any configured index" in run.stderr
    assert index in run.stderr and f"file://{tmp_path}/nowhere/simple" in run.stderr
    assert "Traceback" not in run.stderr


@requires_bwrap
def test_second_index_is_used_when_the_first_lacks_the_file(make_ws, tmp_path):
    index, sha = make_index(tmp_path / "index")
    empty = tmp_path / "empty" / "simple"
    empty.mkdir(parents=True)
    ws = pypi_ws(make_ws, sha)
    ws.env = {"PIP_INDEX_URL": f"file://{empty}", "PIP_EXTRA_INDEX_URL": index}
    run = ws.build("//deps:tiny-wheel")
    assert run.rc == 0, run.stderr


def test_an_http_archive_url_naming_no_file_is_fetched_under_a_name_of_its_own(make_ws, tmp_path):
    """A url ending in '/..' or '/' named the file '..' (a path out of the tree) or nothing."""
    import hashlib
    data = b"payload\n"
    (tmp_path / "srv").mkdir()
    (tmp_path / "srv" / "f").write_bytes(data)
    sha = hashlib.sha256(data).hexdigest()
    ws = make_ws({"targets/p.toml": f'[x]\nkind = "http_archive"\nurl = "file://{tmp_path}/srv/f/.."\n'
                                    f'sha256 = "{sha}"\n'})
    run = ws.cli("build", "//p:x")
    assert "fetch download" in run.output and "Traceback" not in run.output and "escapes" not in run.output, run.output
