"""Fixtures: `make_ws` writes a data workspace into tmp_path (see bgraph_testlib.WS).

The whole session runs with a private HOME and XDG directories, and no BGRAPH_* variables,
so no test (nor any bgraph process a test starts) reads the user's ~/.config/bgraph/config.toml
(which may say `upload = true` to a team's real cache) or writes under the user's home; and the
last test checks that it left the checkout as it found it (bgraph-out links, caches)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

import bgraph_testlib
from bgraph_testlib import TOOLCHAINS_TOML, WORKSPACE_TOML, WS, checkout_state, write_files


def pytest_configure(config):
    """Before any test is collected: the private home, kept for the whole session."""
    real_home = Path(os.path.expanduser("~"))
    bgraph_testlib.USER_HOME = real_home
    private = Path(tempfile.mkdtemp(prefix="bgraph-tests-home-"))
    config._bgraph_private_home = private
    # pip's own configuration is the machine's (its index), not bgraph's: keep the user's file.
    if "PIP_CONFIG_FILE" not in os.environ:
        for user_pip in (real_home / ".config" / "pip" / "pip.conf", real_home / ".pip" / "pip.conf"):
            if user_pip.is_file():
                os.environ["PIP_CONFIG_FILE"] = str(user_pip)
                break
    os.environ.setdefault("PYENV_ROOT", str(real_home / ".pyenv"))  # BuildGrid's Python 3.13
    for name in [k for k in os.environ if k.startswith("BGRAPH_")]:
        del os.environ[name]
    os.environ.update(HOME=str(private), XDG_CONFIG_HOME=str(private / ".config"),
                      XDG_CACHE_HOME=str(private / ".cache"), XDG_DATA_HOME=str(private / ".local" / "share"))


def pytest_unconfigure(config):
    private = getattr(config, "_bgraph_private_home", None)
    if private is not None:
        shutil.rmtree(private, ignore_errors=True)


def pytest_sessionstart(session):
    bgraph_testlib.CHECKOUT_AT_START = checkout_state()


def pytest_collection_modifyitems(session, config, items):
    """The check that the run left the checkout as it found it runs last."""
    last = [i for i in items if i.name == "test_the_run_left_the_checkout_as_it_found_it"]
    items[:] = [i for i in items if i not in last] + last


@pytest.fixture
def make_ws(tmp_path):
    """make_ws(files, name="ws") -> WS: a workspace with WORKSPACE.toml and //toolchains:host
    (unless the files given replace them)."""
    counter = {"n": 0}

    def make(files: dict[str, str | bytes] | None = None, name: str | None = None,
             toolchains: bool = True, cache: Path | None = None) -> WS:
        counter["n"] += 1
        root = tmp_path / (name or f"ws{counter['n']}")
        base: dict[str, str | bytes] = {"WORKSPACE.toml": WORKSPACE_TOML}
        if toolchains:
            base["targets/toolchains.toml"] = TOOLCHAINS_TOML
        base.update(files or {})
        root.mkdir(parents=True)
        write_files(root, base)
        return WS(root, cache or tmp_path / f"cache-{root.name}")

    return make


@pytest.fixture(scope="module")
def module_tmp(tmp_path_factory):
    """A scratch directory for one test module, removed when the module is done: the caches the
    modules build hold GBs (CUDA toolchains, torch's wheels), and a CI machine's disk is finite."""
    path = tmp_path_factory.mktemp("module")
    yield path
    shutil.rmtree(path, ignore_errors=True)
