"""Fixtures: `make_ws` writes a data workspace into tmp_path (see bgraph_testlib.WS)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from bgraph_testlib import TOOLCHAINS_TOML, WORKSPACE_TOML, WS, write_files


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
