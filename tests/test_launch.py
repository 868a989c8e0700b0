"""The `bgraph` entry point keeps its bytecode where PYTHONDONTWRITEBYTECODE forbids writing it
beside the sources (launch.py)."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHONDONTWRITE", "PYTHONPYCACHE"))}
    full.update(PYTHONPATH=str(REPO), XDG_CACHE_HOME=str(tmp_path / "xdg"), **env)
    return subprocess.run([sys.executable, "-m", "build_graph", "--help"], env=full, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)


def _kept(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "xdg" / "bgraph-bytecode").rglob("*.pyc"))


def test_bytecode_kept_under_the_cache_when_the_variable_forbids_it_beside_sources(tmp_path):
    p = _run(tmp_path, PYTHONDONTWRITEBYTECODE="1")
    assert p.returncode == 0, p.stderr
    kept = _kept(tmp_path)
    assert any(n.startswith("cli.") for n in kept), kept  # bgraph's own modules
    # and nothing beside a source of this checkout that the run wrote
    prefix = tmp_path / "xdg" / "bgraph-bytecode"
    assert (prefix / REPO.relative_to("/") / "build_graph").is_dir()


def test_a_chosen_prefix_is_used_and_the_default_behaviour_left_alone(tmp_path):
    chosen = tmp_path / "mine"
    p = _run(tmp_path, PYTHONDONTWRITEBYTECODE="1", PYTHONPYCACHEPREFIX=str(chosen))
    assert p.returncode == 0, p.stderr
    assert _kept(tmp_path) == []
    assert any(p.name.startswith("cli.") for p in (chosen / REPO.relative_to("/") / "build_graph").glob("*.pyc"))
    p = _run(tmp_path)  # bytecode may be written beside the sources, as Python does
    assert p.returncode == 0, p.stderr
    assert _kept(tmp_path) == []
