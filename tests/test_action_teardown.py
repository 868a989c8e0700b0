"""What is left of an action once it ends (red-team R2): a process still in its cgroups is killed
(when the action ends, and when the runner stops), an action that ran while the cache disk was
full fails and stores nothing, and the sandbox's PID 1 shows no host path in its environment."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest
from bgraph_testlib import requires_bwrap

from build_graph.errors import ActionFailed
from build_graph.model import Action, Digester

SH_ENV = (("PATH", "/usr/bin:/bin"),)


def sh_action(name: str, script: str, outputs: tuple[str, ...] = ()) -> Action:
    return Action(name=name, mnemonic="Genrule", argv=("/bin/sh", "-c", script), env=SH_ENV, outputs=outputs,
                  host_paths=("/usr",))


def runner_at(cache: Path, jobs: int = 1):
    from build_graph.sandbox import BwrapRunner
    from build_graph.store.cas import LocalCas

    return BwrapRunner(LocalCas(cache, Digester("blake3")), jobs=jobs)


def grouped_runner(tmp_path: Path):
    """A runner whose actions get cgroups that this test can move a process into (root)."""
    runner = runner_at(tmp_path / "cache")
    if not any((runner.accounting.cpu, runner.accounting.memory, runner.accounting.pids)) or os.geteuid() != 0:
        pytest.skip("no cgroups for actions here (or not root): nothing to kill an action by but its process group")
    return runner


def in_background(runner, action: Action) -> tuple[threading.Thread, dict]:
    got: dict = {}

    def run():
        try:
            got["result"] = runner.run(action)
        except BaseException as e:  # noqa: BLE001 - the test looks at it
            got["error"] = e
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, got


def running_groups(runner, timeout_s: float = 10) -> dict[str, Path]:
    """The action groups (what /proc/<pid>/cgroup says, below bgraph's groups) of the one action
    running: those of this process's child that is bwrap."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for task in Path("/proc/self/task").iterdir():
            try:
                children = (task / "children").read_text().split()
            except OSError:
                continue
            for pid in children:
                try:
                    if Path(f"/proc/{pid}/comm").read_text().strip() != "bwrap":
                        continue
                    lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
                except OSError:
                    continue
                groups = {}
                for line in lines:
                    _n, controllers, path = line.split(":", 2)
                    group = Path("/sys/fs/cgroup", controllers, path.lstrip("/")) if controllers else \
                        Path("/sys/fs/cgroup", path.lstrip("/"))
                    if "/bgraph" in path and (group / "cgroup.procs").exists():
                        groups[controllers or "v2"] = group
                if groups:
                    return groups
        time.sleep(0.02)
    raise AssertionError("the action never started in its groups")


def stray_in(groups: dict[str, Path]) -> subprocess.Popen:
    """A host process (its own session, so no process group of bgraph's reaches it) moved into
    every one of the action's groups: it stands for one that left the sandbox's PID namespace."""
    stray = subprocess.Popen(["/bin/sleep", "600"], start_new_session=True)
    for group in sorted(set(groups.values())):
        (group / "cgroup.procs").write_text(str(stray.pid))
    return stray


def ended(proc: subprocess.Popen, timeout_s: float = 10) -> bool:
    try:
        proc.wait(timeout=timeout_s)
        return True
    except subprocess.TimeoutExpired:
        return False


@requires_bwrap
def test_a_process_left_in_an_actions_groups_is_killed_when_it_ends_and_the_action_fails(tmp_path):
    runner = grouped_runner(tmp_path)
    stray = None
    try:
        thread, got = in_background(runner, sh_action("a", "sleep 1; echo ok > /bgraph/out/o", ("o",)))
        groups = running_groups(runner)
        stray = stray_in(groups)
        thread.join(30)
        assert not thread.is_alive()
        assert ended(stray, 10), "the process left in the action's groups still runs"
        assert stray.returncode == -9
        error = got.get("error")
        assert isinstance(error, ActionFailed), got
        assert "1 process of the action outlived its sandbox (still running after bwrap ended); killed" in str(error)
        # Its groups go (removed off the action's path), and the next action runs as ever.
        deadline = time.monotonic() + 10
        while any(g.exists() for g in groups.values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(g.exists() for g in groups.values())
        _tree, result = runner.run(sh_action("b", "echo ok > /bgraph/out/o", ("o",)))
        assert result.exit_code == 0
    finally:
        if stray is not None and stray.poll() is None:
            stray.kill()
            stray.wait()
        runner.close()


@requires_bwrap
def test_a_process_that_ends_just_after_bwrap_is_no_survivor(tmp_path):
    """One snapshot of the groups right after bwrap ends is not enough: its init may have taken
    its SIGKILL and not yet shown its exit (a build failed so, under load). A process gone within
    SETTLE_S of bwrap's end fails nothing (standing for that init: a host process that ends by
    itself ~0.1 s later)."""
    runner = grouped_runner(tmp_path)
    stray = None
    try:
        thread, got = in_background(runner, sh_action("a", "sleep 1; echo ok > /bgraph/out/o", ("o",)))
        groups = running_groups(runner)
        stray = subprocess.Popen(["/bin/sleep", "1.1"], start_new_session=True)
        for group in sorted(set(groups.values())):
            (group / "cgroup.procs").write_text(str(stray.pid))
        thread.join(30)
        assert not thread.is_alive()
        assert "error" not in got, got
        assert stray.wait(10) == 0  # it ended by itself: not killed
    finally:
        if stray is not None and stray.poll() is None:
            stray.kill()


@requires_bwrap
def test_stop_kills_every_process_in_the_running_actions_groups(tmp_path):
    runner = grouped_runner(tmp_path)
    stray = None
    try:
        thread, got = in_background(runner, sh_action("a", "sleep 600"))
        stray = stray_in(running_groups(runner))
        start = time.monotonic()
        runner.stop()  # Ctrl-C
        assert ended(stray, 5), "stop() left a process of the action's groups running"
        assert time.monotonic() - start < 5
        thread.join(30)
        assert "interrupted" in str(got.get("error")), got
    finally:
        if stray is not None and stray.poll() is None:
            stray.kill()
            stray.wait()
        runner.close()


@pytest.fixture
def small_cache(tmp_path):
    """A cache on a 48 MiB tmpfs of 6,000 inodes, unmounted after."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs for the cache needs root")
    cache = tmp_path / "cache"
    cache.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m,nr_inodes=6000", "tmpfs", str(cache)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield cache
    finally:
        subprocess.run(["umount", "-l", str(cache)], check=False)


# Fills the cache's disk from its output directory (an undeclared file), holds it full, frees it
# again and exits 0: by the time the victim ends there is room again.
FILL = ("echo ok > /bgraph/out/o; head -c 200M /dev/zero > /bgraph/out/junk 2>/dev/null; "
        "sleep 1.5; rm -f /bgraph/out/junk; sleep 0.5")
# An ordinary command without `set -e`: its write fails while the disk is full, it exits 0.
VICTIM = "sleep 0.5; seq 1 300000 > /bgraph/out/big.txt; sleep 2; echo victim-done"


@requires_bwrap
def test_an_action_that_ran_while_the_cache_disk_was_full_fails_and_stores_nothing(small_cache):
    runner = runner_at(small_cache, jobs=2)
    try:
        fill_thread, fill = in_background(runner, sh_action("fill", FILL, ("o",)))
        victim_thread, victim = in_background(runner, sh_action("victim", VICTIM, ("big.txt",)))
        for thread in (fill_thread, victim_thread):
            thread.join(60)
            assert not thread.is_alive()
        # The disk has room again: the victim's own exit and its outputs would pass every check.
        assert shutil.disk_usage(small_cache).free > 30 << 20
        for got, name in ((victim, "victim"), (fill, "fill")):
            error = got.get("error")
            assert isinstance(error, ActionFailed), (name, got)
            text = str(error)
            assert "ran while the cache disk was full" in text and "its outputs may be truncated" in text, text
            assert "the largest writer of the actions running then: the fill with outputs o (" in text, text
            assert f"free on {small_cache})" in text, text
            assert len(error.message.splitlines()) == 1
        # Neither was stored (run raises before its outputs are taken in); the same victim on a
        # disk with room is whole.
        tree, result = runner.run(sh_action("victim", VICTIM, ("big.txt",)))
        big = runner.cas.blob_path(tree.entries["big.txt"].digest).read_text()
        assert len(big.splitlines()) == 300000
    finally:
        runner.close()


@requires_bwrap
def test_the_sandboxs_pid_1_environment_holds_no_host_path(tmp_path, monkeypatch):
    """bwrap's own environment (the sandbox's /proc/1/environ) had PWD=<where bgraph runs>, which
    the cgroup-joining shell (or the spare's) exported: on the direct and the spare path alike."""
    here = tmp_path / "workspace-dir"
    here.mkdir()
    monkeypatch.chdir(here)
    runner = runner_at(tmp_path / "cache", jobs=1)
    try:
        seen = []
        for i in range(5):  # the first action starts the direct way, later ones through a spare
            taken = runner.spares.taken if runner.spares is not None else 0
            _tree, result = runner.run(sh_action(f"e{i}", "cat /proc/1/environ"))
            way = "spare" if runner.spares is not None and runner.spares.taken > taken else "direct"
            environ = runner.cas.blob_path(result.stdout).read_bytes().decode()
            seen.append((way, environ))
        assert "direct" in {way for way, _ in seen}
        if runner.spares is not None:
            assert "spare" in {way for way, _ in seen}
        for way, environ in seen:
            assert str(here) not in environ and str(tmp_path) not in environ, (way, environ)
            pwd = [v for v in environ.split("\0") if v.startswith("PWD=")]
            assert pwd in ([], ["PWD=/"]), (way, environ)  # none, or the root (the spare's shell)
            if way == "direct":
                assert pwd == [], environ
    finally:
        runner.close()
