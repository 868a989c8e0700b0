"""What `bgraph deb lock` reads of a mirror is bounded (debian/index.py): an index unpacking to
more than MAX_INDEX_BYTES, or an endless body, is one error, not a MemoryError."""

import http.server
import lzma
import threading

import pytest

from build_graph.debian import index
from build_graph.errors import FetchError


@pytest.fixture
def endless():
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            try:
                while True:
                    self.wfile.write(b"\0" * 65536)
            except OSError:
                pass

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_an_endless_http_index_is_one_error(endless, monkeypatch):
    monkeypatch.setattr(index, "MAX_INDEX_BYTES", 4 << 20)
    with pytest.raises(FetchError, match="is larger than 4 MiB"):
        index.get(f"{endless}/dists/x/Packages", index.session(), timeout=30)


def test_an_index_that_unpacks_to_too_much_is_one_error(tmp_path, monkeypatch):
    monkeypatch.setattr(index, "MAX_INDEX_BYTES", 4 << 20)
    rel = "dists/x/main/binary-amd64/Packages"
    (tmp_path / rel).parent.mkdir(parents=True)
    (tmp_path / f"{rel}.xz").write_bytes(lzma.compress(b"\0" * (64 << 20)))  # 64 MiB of zeros in ~10 KB
    with pytest.raises(FetchError, match="unpacks to more than 4 MiB"):
        index._first_variant(f"file://{tmp_path}", rel, index.session(), [tmp_path])
    (tmp_path / f"{rel}.xz").write_bytes(lzma.compress(b"Package: a\n") + lzma.compress(b"Package: b\n"))
    with pytest.raises(FetchError, match="is damaged"):  # a second stream is not silently dropped
        index._first_variant(f"file://{tmp_path}", rel, index.session(), [tmp_path])
    (tmp_path / f"{rel}.xz").write_bytes(lzma.compress(b"Package: a\nVersion: 1\n"))
    assert index._first_variant(f"file://{tmp_path}", rel, index.session(), [tmp_path]) == (
        ".xz", b"Package: a\nVersion: 1\n")


def test_a_nul_in_a_file_url_is_one_error(tmp_path):
    with pytest.raises(FetchError, match="NUL byte"):
        index.get(f"file://{tmp_path}/a%00b", index.session(), file_roots=[tmp_path])
