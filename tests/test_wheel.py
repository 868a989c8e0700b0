"""//wheels:fp4-kernels-sm121 built for this machine (`--platform x86_64` here: the target itself
is fixed to the Spark's aarch64, see test_cross_build.py) installs with pip into a fresh venv, and its
library holds sm_120a and sm_121a cubins; two independent builds (two workspace directories, two
caches) give the same wheel byte for byte; `--check` finds every action reproducible.

Each build runs in its own copy of the workspace under the test's tmp dir: nothing is written
into the checkout."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

from bgraph_testlib import hermetic_env, workspace_copy
from build_graph.workspace import host_platform

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")

WHEEL = "//wheels:fp4-kernels-sm121"
HOST = host_platform()


def bgraph(ws: Path, cache: Path, *args: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "build_graph", "-C", str(ws), "--cache-dir", str(cache),
                           "build", "--json", "--platform", HOST, *args], capture_output=True, text=True,
                          env=hermetic_env(), cwd=ws)
    assert proc.returncode in (0, 3), proc.stderr
    return json.loads(proc.stdout)


def build_wheel(ws: Path, cache: Path, *more: str) -> tuple[dict, Path]:
    summary = bgraph(ws, cache, WHEEL, *more)
    assert summary["ok"], summary["errors"]
    [wheel] = Path(summary["outputs"][WHEEL]).glob("*.whl")
    return summary, wheel


@pytest.fixture(scope="module")
def built(module_tmp):
    ws, cache = workspace_copy(module_tmp / "ws-a"), module_tmp / "cache-a"
    summary = bgraph(ws, cache, WHEEL, "//toolchains:cuobjdump")
    assert summary["ok"], summary["errors"]
    return ws, cache, Path(summary["outputs"][WHEEL]), Path(summary["outputs"]["//toolchains:cuobjdump"])


def test_wheel_installs_and_carries_both_spark_cubins(built, tmp_path):
    _ws, _cache, wheel_dir, cuobjdump = built
    [wheel] = wheel_dir.glob("*.whl")
    assert wheel.name == f"bgraph_fp4-0.1.0-py3-none-manylinux_2_34_{HOST}.whl"  # auditwheel's verdict
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    subprocess.run([env_dir / "bin" / "pip", "install", "-q", "--no-index", "--no-deps", str(wheel)], check=True)
    [lib] = env_dir.glob("lib/python*/site-packages/bgraph_fp4/libbgraph_fp4.so")
    listing = subprocess.run([cuobjdump / "bin" / "cuobjdump", "--list-elf", str(lib)],
                             capture_output=True, text=True, check=True).stdout
    assert "sm_120a.cubin" in listing and "sm_121a.cubin" in listing
    # The package imports (numpy-facing API) even where no GPU exists.
    code = "import bgraph_fp4, bgraph_fp4.reference; print('ok')"
    subprocess.run([env_dir / "bin" / "pip", "install", "-q", "numpy"], check=True)
    proc = subprocess.run([env_dir / "bin" / "python", "-c", code], capture_output=True, text=True)
    assert proc.stdout.strip() == "ok", proc.stderr


def test_wheel_is_pep427_with_fixed_timestamps(built):
    _ws, _cache, wheel_dir, _ = built
    [wheel] = wheel_dir.glob("*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        assert all(i.date_time == (1980, 1, 1, 0, 0, 0) for i in zf.infolist())
        record = zf.read("bgraph_fp4-0.1.0.dist-info/RECORD").decode().splitlines()
        assert {line.split(",")[0] for line in record} == set(names)
        assert f"Tag: py3-none-manylinux_2_34_{HOST}" in zf.read("bgraph_fp4-0.1.0.dist-info/WHEEL").decode()
    assert names[:-1] == sorted(n for n in names[:-3]) + names[-3:-1]


def test_two_independent_builds_give_the_same_wheel_bytes(built, module_tmp):
    """A second build from nothing: another workspace directory (another path, deeper), another
    cache, so every action runs again. The wheels and every action key must be the same."""
    ws_a, cache_a, wheel_dir, _ = built
    [wheel_a] = wheel_dir.glob("*.whl")
    ws_b, cache_b = workspace_copy(module_tmp / "elsewhere" / "ws-b"), module_tmp / "cache-b"
    summary_b, wheel_b = build_wheel(ws_b, cache_b)
    executed = {a["name"] for a in summary_b["actions"] if a["status"] == "executed"}
    assert any(n.startswith("cicc ") for n in executed) and any("wheel" in n for n in executed), executed
    assert wheel_b.name == wheel_a.name
    assert ws_a.resolve() not in wheel_b.resolve().parents and cache_a.resolve() not in wheel_b.resolve().parents
    digest_a, digest_b = (hashlib.sha256(w.read_bytes()).hexdigest() for w in (wheel_a, wheel_b))
    if digest_a != digest_b:  # name what differs
        with zipfile.ZipFile(wheel_a) as za, zipfile.ZipFile(wheel_b) as zb:
            differ = [n for n in za.namelist() if n not in zb.namelist() or za.read(n) != zb.read(n)]
        pytest.fail(f"wheels differ: {wheel_a} {digest_a} vs {wheel_b} {digest_b}; members: {differ}")
    summary_a = bgraph(ws_a, cache_a, WHEEL)  # all hits: the keys the first build filed its results under
    keys = lambda s: {(a["label"], a["name"]): a["key"] for a in s["actions"]}  # noqa: E731
    assert keys(summary_a) == keys(summary_b)


def test_check_reexecutes_fp4_with_zero_differences(built):
    ws, cache, _, _ = built
    summary = bgraph(ws, cache, "--check", "//kernels:fp4")
    assert summary["executed"] > 0
    assert summary["differing"] == []
