"""A warm local cache fills an empty remote without rebuilding: a build with upload sends the
local hits the remote lacks (Bazel uploads only what it executes), depfile manifests included."""

from __future__ import annotations

import pytest

from bgraph_testlib import requires_bwrap
from remote_servers import Nginx, requires_nginx

pytestmark = [requires_bwrap, requires_nginx]

FILES = {
    "in.txt": "alpha\nbeta\n",
    "targets/p.toml": '''[a]
kind = "genrule"
srcs = ["in.txt"]
outs = ["a.txt"]
cmd = "sort -r $SRC/in.txt > $OUT/a.txt"

[b]
kind = "genrule"
outs = ["b.txt"]
deps = { a = ":a" }
cmd = "wc -l < $IN_A/a.txt > $OUT/b.txt"
''',
}


@pytest.fixture
def nginx(tmp_path):
    server = Nginx(tmp_path / "nginx")
    yield server
    server.stop()


def test_a_warm_local_cache_fills_the_remote_without_running_anything(make_ws, nginx):
    warm = make_ws(FILES, name="laptop")
    first = warm.build("//p:b")
    assert first.rc == 0 and first.json["executed"] == 2
    pushed = warm.build("//p:b", args=("--remote-cache", nginx.url, "--remote-upload"))
    assert pushed.rc == 0, pushed.stderr
    assert pushed.json["executed"] == 0 and pushed.json["remote"]["backfilled"] == 2
    assert len(nginx.files("ac")) == 2
    again = warm.build("//p:b", args=("--remote-cache", nginx.url, "--remote-upload"))
    assert again.json["remote"]["backfilled"] == 0  # the remote has them now: nothing sent twice
    fresh = make_ws(FILES, name="ci")
    pulled = fresh.build("//p:b", args=("--remote-cache", nginx.url))
    assert pulled.json["executed"] == 0 and pulled.json["remote"]["hits"] == 2
    assert fresh.read_output("//p:b", "b.txt") == warm.read_output("//p:b", "b.txt")


def test_reading_builds_never_backfill(make_ws, nginx):
    warm = make_ws(FILES)
    assert warm.build("//p:b").rc == 0
    read_only = warm.build("//p:b", args=("--remote-cache", nginx.url))
    assert read_only.json["remote"]["backfilled"] == 0 and nginx.files("ac") == []
