"""Across distributions, for real: a Debian 13 (trixie) root, whose python3 is 3.13 and whose
compiler is GCC 14, runs bgraph with its own Python against a remote cache (nginx on 127.0.0.1)
that a build on this Debian 12 host filled. Because every action runs on the pinned Debian 12
toolchains (no host /usr in any key), the root executes 0 actions and gets byte-identical outputs.

Slow (the vLLM smoke subset is built on the host first, and debootstrap downloads a root):
`pytest -m slow tests/test_cross_distro.py`. bench/cross_distro.py measures the whole vLLM wheel."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bgraph_testlib import hermetic_env, workspace_copy
from foreign_root import bgraph_in, can_make_roots, install_bgraph, make_root, python_version, run_in
from remote_servers import Nginx, requires_nginx

LABELS = ["//wheels:fp4-kernels-sm121", "//examples:cmake-demo", "//vllm:smoke-fp4-sm121"]
pytestmark = [pytest.mark.slow, requires_nginx,
              pytest.mark.skipif(can_make_roots() is not None, reason=f"no foreign root: {can_make_roots()}")]


def tree_digests(summary: dict, root: Path = Path("/")) -> dict[str, str]:
    """label -> the digest of its output tree (the store directory its bgraph-out link names)."""
    out = {}
    for label, link in summary["outputs"].items():
        out[label] = os.path.basename(os.readlink(root / link.lstrip("/")))
    return out


def test_a_debian_13_root_runs_nothing_and_gets_identical_outputs(tmp_path):
    nginx = Nginx(tmp_path / "nginx")
    try:
        host_ws = workspace_copy(tmp_path / "ws")
        host = subprocess.run([sys.executable, "-m", "build_graph", "-C", str(host_ws), "--cache-dir",
                               str(tmp_path / "cache"), "build", "--json", "-j2", "--remote-cache", nginx.url,
                               "--remote-allow-unsigned", "--remote-upload", *LABELS], capture_output=True, text=True, env=hermetic_env())
        assert host.returncode == 0, host.stderr[-3000:]
        host_summary = json.loads(host.stdout)

        root = make_root(tmp_path / "trixie")
        assert python_version(root) == "3.13"
        gcc = run_in(root, ["sh", "-c", "command -v gcc || echo none"]).stdout.strip()
        assert gcc == "none"  # nothing to compile with there but what the graph brings
        install_bgraph(root)
        run = bgraph_in(root, "build", "--json", "--remote-cache", nginx.url, "--remote-allow-unsigned", *LABELS,
                        timeout=1800)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
        summary = json.loads(run.stdout)
        assert summary["executed"] == 0, [a["name"] for a in summary["actions"] if a["status"] == "executed"][:20]
        assert summary["remote"]["hits"] > 0 and summary["remote"]["ignored"] == 0
        assert tree_digests(summary, root) == tree_digests(host_summary)
    finally:
        nginx.stop()
        shutil.rmtree(tmp_path / "trixie", ignore_errors=True)
