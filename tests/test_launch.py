"""The `bgraph` entry point keeps its bytecode where PYTHONDONTWRITEBYTECODE forbids writing it
beside the sources (launch.py), in a directory per version of bgraph's code."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _run(tmp_path: Path, repo: Path = REPO, cwd: Path | None = None, **env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHONDONTWRITE", "PYTHONPYCACHE"))}
    full.update({"PYTHONPATH": str(repo), "XDG_CACHE_HOME": str(tmp_path / "xdg"), **env})
    return subprocess.run([sys.executable, "-m", "build_graph", "--help"], env=full, cwd=cwd or tmp_path,
                          capture_output=True, text=True, timeout=120)


def _versions(prefix: Path) -> list[Path]:
    return sorted(p for p in prefix.iterdir() if p.is_dir()) if prefix.is_dir() else []


def _kept(prefix: Path, package: Path = REPO / "build_graph") -> list[str]:
    return sorted(p.name for v in _versions(prefix) for p in (v / package.relative_to("/")).glob("*.pyc"))


def test_bytecode_kept_under_the_cache_when_the_variable_forbids_it_beside_sources(tmp_path):
    p = _run(tmp_path, PYTHONDONTWRITEBYTECODE="1")
    assert p.returncode == 0, p.stderr
    prefix = tmp_path / "xdg" / "bgraph-bytecode"
    assert len(_versions(prefix)) == 1 and any(n.startswith("cli.") for n in _kept(prefix))


def test_a_chosen_prefix_is_used_a_relative_xdg_ignored_and_the_default_left_alone(tmp_path):
    chosen = tmp_path / "mine"
    p = _run(tmp_path, PYTHONDONTWRITEBYTECODE="1", PYTHONPYCACHEPREFIX=str(chosen))
    assert p.returncode == 0, p.stderr
    assert not (tmp_path / "xdg").exists() and any(n.startswith("cli.") for n in _kept(chosen))
    work = tmp_path / "work"
    work.mkdir()
    p = _run(tmp_path, cwd=work, PYTHONDONTWRITEBYTECODE="1", XDG_CACHE_HOME="rel", HOME=str(tmp_path / "home"))
    assert p.returncode == 0, p.stderr
    assert not (work / "rel").exists()  # not below the working directory (a workspace, say)
    assert _kept(tmp_path / "home" / ".cache" / "bgraph-bytecode")
    p = _run(tmp_path)  # bytecode may be written beside the sources, as Python does
    assert p.returncode == 0, p.stderr
    assert not (tmp_path / "xdg").exists()


def test_an_edit_python_would_miss_runs_the_new_code(tmp_path):
    """Python takes a .pyc as current where the source's whole-second mtime and size match: an
    edit within the second, size kept, ran the old bytecode while the code stamp said new."""
    copy = tmp_path / "copy"
    shutil.copytree(REPO / "build_graph", copy / "build_graph", ignore=shutil.ignore_patterns("__pycache__"))
    cli = copy / "build_graph" / "cli.py"
    text = cli.read_text()
    before, after = "# launch-test: nothing here!\n", "raise SystemExit(7)  # here!\n"
    assert len(before) == len(after)
    cli.write_text(text + before)
    st = cli.stat()
    assert _run(tmp_path, repo=copy, PYTHONDONTWRITEBYTECODE="1").returncode == 0
    cli.write_text(text + after)
    os.utime(cli, ns=(st.st_atime_ns, st.st_mtime_ns))  # what Python's own check compares, as it was
    p = _run(tmp_path, repo=copy, PYTHONDONTWRITEBYTECODE="1")
    assert p.returncode == 7, (p.returncode, p.stderr)  # the new code ran
    assert len(_versions(tmp_path / "xdg" / "bgraph-bytecode")) == 2


def test_old_versions_are_pruned(tmp_path):
    prefix = tmp_path / "xdg" / "bgraph-bytecode"
    for i in range(5):
        old = prefix / f"{i:020x}"
        old.mkdir(parents=True)
        os.utime(old, (1000 + i, 1000 + i))
    (prefix / "not-a-version").mkdir()
    assert _run(tmp_path, PYTHONDONTWRITEBYTECODE="1").returncode == 0
    names = sorted(p.name for p in prefix.iterdir())
    assert "not-a-version" in names and f"{4:020x}" in names and f"{3:020x}" in names
    assert f"{0:020x}" not in names and len(names) == 4  # two old ones, the new one, the stranger
