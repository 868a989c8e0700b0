"""A remote worker's lease is bounded as a local action is (runner.accounting: cgroups.py's task
and memory limits): over its task limit it fails, with the line in its stderr."""

import threading

import pytest

from bgraph_testlib import requires_bwrap


@requires_bwrap
def test_a_lease_over_its_task_limit_fails_with_the_line(tmp_path, monkeypatch):
    from build_graph.cgroups import Accounting
    from build_graph.remote_exec import runner
    from build_graph.sandbox import find_bwrap

    limited = Accounting.probe(environ={"BGRAPH_ACTION_TASKS": "16"})
    if limited.pids is None:
        pytest.skip("this host gives bgraph no pids cgroup")
    monkeypatch.setattr(runner, "_ACCOUNTING", limited)
    mounts = [("ro", "/usr", "usr"), *(("symlink", f"usr/{d}", d) for d in ("bin", "lib", "lib64"))]
    options = runner.bwrap_options(find_bwrap(), mounts, [], "")

    def run(script: str):
        proc = runner.Process(options, ["/bin/sh", "-c", script], {"PATH": "/usr/bin:/bin"},
                              tmp_path / "out", tmp_path / "err")
        return proc.wait(120, threading.Event()), (tmp_path / "err").read_text()

    ended, err = run("for i in $(seq 40); do sleep 30 & done; wait")
    assert ended.exit_code != 0 and "stopped at its task limit" in err, err
    assert ended.end - ended.start < 25  # killed at the limit, not left to its 30 s sleeps
    ended, err = run("for i in $(seq 4); do sleep 0.1 & done; wait")
    assert ended.exit_code == 0 and "limit" not in err, err
    assert not limited._live  # each lease's groups removed
