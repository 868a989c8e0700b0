"""The main job: //wheels:fp4-kernels-sm121 builds, installs with pip into a fresh venv, and its
library holds sm_120a and sm_121a cubins; `--check` finds every action reproducible."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")


def bgraph(cache: Path, *args: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "build_graph", "-C", str(REPO), "--cache-dir", str(cache),
                           "build", "--json", *args], capture_output=True, text=True)
    assert proc.returncode in (0, 3), proc.stderr
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def built(module_tmp):
    cache = module_tmp / "cache"
    summary = bgraph(cache, "//wheels:fp4-kernels-sm121", "//toolchains:cuobjdump")
    assert summary["ok"], summary["errors"]
    return cache, Path(summary["outputs"]["//wheels:fp4-kernels-sm121"]), Path(summary["outputs"]["//toolchains:cuobjdump"])


def test_wheel_installs_and_carries_both_spark_cubins(built, tmp_path):
    _cache, wheel_dir, cuobjdump = built
    [wheel] = wheel_dir.glob("*.whl")
    assert wheel.name == "bgraph_fp4-0.1.0-py3-none-linux_x86_64.whl"
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


def test_wheel_is_deterministic_pep427(built):
    _cache, wheel_dir, _ = built
    [wheel] = wheel_dir.glob("*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        assert all(i.date_time == (1980, 1, 1, 0, 0, 0) for i in zf.infolist())
        record = zf.read("bgraph_fp4-0.1.0.dist-info/RECORD").decode().splitlines()
        assert {line.split(",")[0] for line in record} == set(names)
        assert "Tag: py3-none-linux_x86_64" in zf.read("bgraph_fp4-0.1.0.dist-info/WHEEL").decode()
    assert names[:-1] == sorted(n for n in names[:-3]) + names[-3:-1]


def test_check_reexecutes_fp4_with_zero_differences(built):
    cache, _, _ = built
    summary = bgraph(cache, "--check", "//kernels:fp4")
    assert summary["executed"] > 0
    assert summary["differing"] == []
