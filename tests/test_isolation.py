"""The test suite itself: it must not read the user's configuration nor change the checkout."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import bgraph_testlib
from bgraph_testlib import REPO, checkout_state, hermetic_env, workspace_copy


def _config_path(env: dict[str, str] | None = None) -> Path:
    """Where a bgraph process started by a test looks for the user's config.toml."""
    out = subprocess.run([sys.executable, "-c", "from build_graph.workspace import user_config_path; "
                                               "print(user_config_path())"],
                         capture_output=True, text=True, check=True, env=env, cwd=REPO)
    return Path(out.stdout.strip())


def test_bgraph_processes_started_by_tests_never_read_the_users_config():
    home = bgraph_testlib.USER_HOME
    assert home is not None
    for env in (None, hermetic_env()):  # a plain subprocess inherits; ws.cli passes hermetic_env()
        path = _config_path(env)
        assert not path.is_relative_to(home), f"tests would read {path} (the user's config)"
    assert not any(k.startswith("BGRAPH_") for k in os.environ)
    assert Path(os.environ["HOME"]) != home and not Path(os.environ["XDG_CONFIG_HOME"]).is_relative_to(home)


def test_a_config_the_test_writes_is_private_to_the_session(make_ws):
    """A remote in the (private) user config is honoured: the isolation is of the home, not of
    the feature. The build warns about the dead remote and builds locally."""
    path = _config_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('[remote]\nurl = "http://127.0.0.1:9/nothing-listens"\ntimeout_s = 1\nallow_unsigned = true\n')
    try:
        ws = make_ws({"targets/p.toml": '[a]\nkind = "genrule"\nouts = ["o"]\ncmd = "echo a > $OUT/o"\n'})
        run = ws.build("//p:a")
        assert run.json["remote"] is not None, run.output
    finally:
        path.unlink()


def test_checkout_state_sees_an_output_link_and_a_repointed_one(tmp_path):
    root = workspace_copy(tmp_path / "ws")
    before = checkout_state(root)
    (root / "bgraph-out" / "p").mkdir(parents=True)
    (root / "bgraph-out" / "p" / "a").symlink_to("/somewhere")
    after = checkout_state(root)
    assert set(after) - set(before) == {"bgraph-out/p/a"}
    (root / "bgraph-out" / "p" / "a").unlink()
    (root / "bgraph-out" / "p" / "a").symlink_to("/elsewhere")
    assert checkout_state(root)["bgraph-out/p/a"] == "link -> /elsewhere"


def test_workspace_copy_holds_the_workspace_and_no_outputs(tmp_path):
    root = workspace_copy(tmp_path / "ws")
    assert (root / "WORKSPACE.toml").read_bytes() == (REPO / "WORKSPACE.toml").read_bytes()
    assert (root / "targets" / "vllm.toml").is_file() and (root / "patches").is_dir()
    assert not (root / ".git").exists() and not (root / "bgraph-out").exists()


def test_the_run_left_the_checkout_as_it_found_it():
    """Runs last (conftest orders it): no test wrote bgraph-out/ links, caches or files into the
    checkout, nor re-pointed a user's own output link."""
    before, after = bgraph_testlib.CHECKOUT_AT_START, checkout_state()
    assert before is not None
    changed = sorted(p for p in before.keys() | after.keys() if before.get(p) != after.get(p))
    assert not changed, "the test run changed the checkout (tests must build in their own copies):\n" + "\n".join(
        f"  {p}: {before.get(p, 'absent')} -> {after.get(p, 'absent')}" for p in changed[:20])
