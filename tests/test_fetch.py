"""Pinned downloads: pip's configured index (never hard-coded), sha256 verification."""

from __future__ import annotations

import hashlib
import io
import os
import signal
import subprocess
import sys
import threading
import time
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from pypi_simple import PYPI_SIMPLE_ENDPOINT

from bgraph_testlib import action, hermetic_env, requires_bwrap
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


# -- what a download may read and write (red-team K15 holes 4-6; build_graph/fetch_guard.py) -----------
# No test here writes a big file: the large sources are sparse files, FIFOs, devices and servers that
# stream, and every build runs under `ulimit -f` so that a bound that does not hold fails the test
# (File too large) instead of filling the disk.
SHA_F = "f" * 64
FSIZE_KIB = 64 << 10  # 64 MiB: the most a build here may write into one file


def url_ws(make_ws, url: str, sha: str = SHA_F):
    return make_ws({"targets/p.toml": f'[a]\nkind = "http_archive"\nurl = "{url}"\nsha256 = "{sha}"\n'})


def capped(ws, *args: str, env: dict[str, str] | None = None, timeout: float = 60):
    """`bgraph build ARGS` with RLIMIT_FSIZE at 64 MiB: (rc, stdout + stderr)."""
    cmd = [sys.executable, "-m", "build_graph", "-C", str(ws.root), "--cache-dir", str(ws.cache), "build", *args]
    proc = subprocess.run(["sh", "-c", f'ulimit -f {FSIZE_KIB}; exec "$@"', "sh", *cmd], capture_output=True,
                          check=False, text=True, timeout=timeout, env=hermetic_env({**ws.env, **(env or {})}), cwd=ws.root)
    return proc.returncode, proc.stdout + proc.stderr


def one_error(output: str) -> str:
    assert "Traceback" not in output, output
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, output
    return errors[0]


def left_in_tmp(ws) -> list[str]:
    tmp = ws.cache / "v1" / "tmp"
    return [n for n in os.listdir(tmp) if n.startswith("fetch-")] if tmp.exists() else []


def test_a_file_url_outside_the_workspace_is_refused_and_its_digest_never_shown(make_ws, tmp_path):
    """K15 hole 4: a url naming any host file printed its sha256 on a mismatch (an oracle for a
    secret), and with the right sha256 the file went into the cache and the sandboxes."""
    secret = tmp_path / "host" / "secret.txt"
    secret.parent.mkdir()
    secret.write_text("hunter2\n")
    digest = hashlib.sha256(secret.read_bytes()).hexdigest()
    for sha in (SHA_F, digest):
        ws = url_ws(make_ws, f"file://{secret}", sha)
        rc, out = capped(ws, "//p:a")
        line = one_error(out)
        assert rc == 1 and "outside the workspace" in line and digest not in out, out
        assert "BGRAPH_FILE_URL_DIRS" in out and not left_in_tmp(ws)
    # Nor does a link inside the workspace lead there.
    ws = make_ws({"targets/p.toml": "", "vendor/s.txt": ""})
    (ws.root / "vendor" / "s.txt").unlink()
    (ws.root / "vendor" / "s.txt").symlink_to(secret)
    (ws.root / "vendor2").symlink_to(secret.parent)
    for path in ("vendor/s.txt", "vendor2/secret.txt"):
        ws.write({"targets/p.toml": f'[a]\nkind = "http_archive"\nurl = "file://{ws.root}/{path}"\n'
                                    f'sha256 = "{digest}"\n'})
        rc, out = capped(ws, "//p:a")
        assert rc == 1 and "outside the workspace" in one_error(out), out


def test_a_mismatch_of_a_workspace_file_url_says_only_that_it_differs(make_ws):
    ws = make_ws({"vendor/src.tar.gz": "not what was pinned\n"})
    digest = hashlib.sha256(b"not what was pinned\n").hexdigest()
    ws.write({"targets/p.toml": f'[a]\nkind = "http_archive"\nurl = "file://{ws.root}/vendor/src.tar.gz"\n'
                                f'sha256 = "{SHA_F}"\n'})
    rc, out = capped(ws, "//p:a")
    line = one_error(out)
    assert rc == 1 and "sha256 mismatch" in line and "bytes differ" in line and digest not in out, out
    ws.write({"targets/p.toml": f'[a]\nkind = "http_archive"\nurl = "file://{ws.root}/vendor/src.tar.gz"\n'
                                f'sha256 = "{digest}"\n'})
    rc, out = capped(ws, "//p:a")
    assert rc == 0, out


def test_the_user_allows_directories_outside_the_workspace(make_ws, tmp_path):
    """$BGRAPH_FILE_URL_DIRS or the user config's [fetch] file_url_dirs; a relative entry is one line."""
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    (mirror / "a.tar.gz").write_bytes(b"archive\n")
    ws = url_ws(make_ws, f"file://{mirror}/a.tar.gz", hashlib.sha256(b"archive\n").hexdigest())
    rc, out = capped(ws, "//p:a", env={"BGRAPH_FILE_URL_DIRS": f"/nonexistent:{mirror}"})
    assert rc == 0, out
    config = tmp_path / "config.toml"
    config.write_text(f'[fetch]\nfile_url_dirs = ["{mirror}"]\n')
    ws2 = url_ws(make_ws, f"file://{mirror}/a.tar.gz", hashlib.sha256(b"archive\n").hexdigest())
    rc, out = capped(ws2, "//p:a", env={"BGRAPH_CONFIG": str(config)})
    assert rc == 0, out
    ws3 = url_ws(make_ws, f"file://{mirror}/a.tar.gz", hashlib.sha256(b"archive\n").hexdigest())
    rc, out = capped(ws3, "//p:a", env={"BGRAPH_FILE_URL_DIRS": "relative/dir"})
    assert rc == 1 and "not an absolute path" in one_error(out), out
    config.write_text('[fetch]\nfile_url_dir = ["/x"]\n')
    rc, out = capped(ws3, "//p:a", env={"BGRAPH_CONFIG": str(config)})
    assert rc == 2 and "[fetch]" in one_error(out) and "file_url_dir" in one_error(out), out  # before any action


def test_a_device_is_refused_even_where_allowed(make_ws):
    """K15 hole 5: file:///dev/zero was copied without bound into the cache's tmp."""
    ws = url_ws(make_ws, "file:///dev/zero")
    rc, out = capped(ws, "//p:a", timeout=60)
    assert rc == 1 and "outside the workspace" in one_error(out), out
    rc, out = capped(ws, "//p:a", env={"BGRAPH_FILE_URL_DIRS": "/dev"}, timeout=60)
    assert rc == 1 and "is a character device, not a regular file" in one_error(out), out
    (ws.root / "zero").symlink_to("/dev/zero")
    ws.write({"targets/p.toml": f'[a]\nkind = "http_archive"\nurl = "file://{ws.root}/zero"\nsha256 = "{SHA_F}"\n'})
    rc, out = capped(ws, "//p:a", env={"BGRAPH_FILE_URL_DIRS": "/dev"}, timeout=60)
    assert rc == 1 and "is a symbolic link" in one_error(out) and not left_in_tmp(ws), out


def test_a_fifo_is_refused_at_once(make_ws):
    """K15 hole 6: a FIFO's open blocked the build forever (and SIGTERM with it)."""
    ws = make_ws()
    os.mkfifo(ws.root / "pipe")
    ws.write({"targets/p.toml": f'[a]\nkind = "http_archive"\nurl = "file://{ws.root}/pipe"\nsha256 = "{SHA_F}"\n'})
    start = time.monotonic()
    rc, out = capped(ws, "//p:a", timeout=60)
    assert rc == 1 and "is a FIFO, not a regular file" in one_error(out), out
    assert time.monotonic() - start < 30


def test_a_file_without_a_pinned_size_stops_at_the_bound(make_ws):
    """A 1 TiB (sparse) file is refused by its size before a byte is copied."""
    ws = make_ws()
    with open(ws.root / "huge.tar", "wb") as f:
        f.truncate(1 << 40)
    ws.write({"targets/p.toml": f'[a]\nkind = "http_archive"\nurl = "file://{ws.root}/huge.tar"\n'
                                f'sha256 = "{SHA_F}"\n'})
    start = time.monotonic()
    rc, out = capped(ws, "//p:a", timeout=120)
    assert rc == 1 and "larger than 16384 MiB" in one_error(out) and "BGRAPH_FETCH_MAX_MB" in out, out
    assert time.monotonic() - start < 30 and not left_in_tmp(ws)


def test_a_download_stops_before_the_disk_falls_under_the_floor(make_ws):
    ws = make_ws({"vendor/a.tar": "a\n"})
    ws.write({"targets/p.toml": f'[a]\nkind = "http_archive"\nurl = "file://{ws.root}/vendor/a.tar"\n'
                                f'sha256 = "{hashlib.sha256(b"a" + bytes([10])).hexdigest()}"\n'})
    rc, out = capped(ws, "//p:a", env={"BGRAPH_FETCH_MIN_FREE_MB": str(1 << 40)})
    assert rc == 1 and "would leave less than" in one_error(out) and not left_in_tmp(ws), out


class Zeros(BaseHTTPRequestHandler):
    """/endless: zeros without end (no Content-Length); /claims-1t: a 1 TiB Content-Length;
    /stall: 64 KiB of a 10 MiB body, then nothing until released; anything else 404."""

    started = threading.Event()
    release = threading.Event()

    def do_GET(self):
        try:
            if self.path.endswith("/endless"):
                self.send_response(200)
                self.end_headers()
                while not self.release.is_set():
                    self.wfile.write(bytes(1 << 16))
            elif self.path.endswith("/claims-1t"):
                self.send_response(200)
                self.send_header("Content-Length", str(1 << 40))
                self.end_headers()
                while not self.release.is_set():
                    self.wfile.write(bytes(1 << 16))
            elif self.path.endswith("/stall"):
                self.send_response(200)
                self.send_header("Content-Length", str(10 << 20))
                self.end_headers()
                self.wfile.write(bytes(1 << 16))
                self.wfile.flush()
                self.started.set()
                self.release.wait(60)
            else:
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()
        except OSError:
            pass  # the client went away

    def log_message(self, *args):
        pass


@pytest.fixture
def zeros():
    Zeros.started, Zeros.release = threading.Event(), threading.Event()
    server = ThreadingHTTPServer(("127.0.0.1", 0), Zeros)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    Zeros.release.set()
    server.shutdown()
    server.server_close()


def test_an_endless_http_download_stops_at_the_bound(make_ws, zeros):
    ws = url_ws(make_ws, f"{zeros}/endless")
    rc, out = capped(ws, "//p:a", env={"BGRAPH_FETCH_MAX_MB": "8"})
    assert rc == 1 and "larger than 8 MiB" in one_error(out) and not left_in_tmp(ws), out
    ws = url_ws(make_ws, f"{zeros}/claims-1t")
    start = time.monotonic()
    rc, out = capped(ws, "//p:a")
    assert rc == 1 and "larger than 16384 MiB" in one_error(out) and not left_in_tmp(ws), out
    assert time.monotonic() - start < 30


def test_a_download_stops_at_its_pinned_size(tmp_path, zeros):
    """Debian and Python locks record a file's size: the fetch takes no byte more."""
    from build_graph.errors import FetchError
    from build_graph.fetcher import Fetcher
    from build_graph.model import Action, Digester
    from build_graph.store.cas import LocalCas

    cas = LocalCas(tmp_path / "cache", Digester("sha256"))
    spec = {"sha256": SHA_F, "filename": "f", "source": "url", "url": f"{zeros}/endless", "size": "100000"}
    action = Action(name="fetch f", mnemonic="Fetch", kind="fetch", outputs=("f",), spec=tuple(sorted(spec.items())))
    with pytest.raises(FetchError, match=r"larger than its pinned size \(100000 bytes"):
        Fetcher(cas, tmp_path).run(action)
    assert not [n for n in os.listdir(cas.tmp) if n.startswith("fetch-")]
    cas.close()


@pytest.mark.parametrize("sig,rc", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_stalled_download_ends_on_a_signal(make_ws, zeros, sig, rc):
    """A read blocked on a server that stalls held Ctrl-C and SIGTERM up for its whole time-out."""
    ws = url_ws(make_ws, f"{zeros}/stall")
    cmd = [sys.executable, "-m", "build_graph", "-C", str(ws.root), "--cache-dir", str(ws.cache), "build", "//p:a"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ws.root,
                            env=hermetic_env())
    try:
        assert Zeros.started.wait(60), "the download did not start"
        time.sleep(0.5)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == rc and "Traceback" not in err, err
    assert not left_in_tmp(ws)


def test_credentials_in_a_url_are_never_shown(make_ws, zeros):
    port = zeros.rsplit(":", 1)[1]
    ws = url_ws(make_ws, f"http://builder:s3cretpw@127.0.0.1:{port}/missing.tar.gz")
    rc, out = capped(ws, "//p:a")
    line = one_error(out)
    assert rc == 1 and "HTTP 404" in line and "***@127.0.0.1" in line and "s3cretpw" not in out, out
    # An index with a token, from pip's configuration, in the hint of a pin that is on none.
    index, sha = f"http://builder:s3cretpw@127.0.0.1:{port}/simple", SHA_F
    ws = pypi_ws(make_ws, sha)
    ws.env = {"PIP_INDEX_URL": index}
    rc, out = capped(ws, "//deps:tiny-wheel")
    assert rc == 1 and "not on any configured index" in out and "s3cretpw" not in out, out


def test_a_file_url_naming_a_host_is_one_line(make_ws):
    ws = url_ws(make_ws, "file://otherhost/srv/a.tar.gz")
    rc, out = capped(ws, "//p:a")
    assert rc == 1 and "names host 'otherhost'" in one_error(out), out
