"""A lock file is read and written inside the workspace only, never through a symlink (red-team K15
hole 3: a workspace shipping `locks -> /outside` had `bgraph py lock` / `bgraph deb lock` create or
replace a host file with the lock's text, and read the old lock through the link)."""

from __future__ import annotations

import os
import stat
import threading

import pytest

from build_graph.errors import UsageError
from build_graph.lock_files import check_writable, read_lock, write_lock


def test_a_lock_is_written_atomically_below_new_directories_and_read_back(tmp_path):
    assert read_lock(tmp_path, "locks/deep/x.lock.json") is None
    write_lock(tmp_path, "locks/deep/x.lock.json", "one\n")
    path = tmp_path / "locks/deep/x.lock.json"
    assert path.read_text() == "one\n" and stat.S_IMODE(path.stat().st_mode) == 0o644
    write_lock(tmp_path, "locks/deep/x.lock.json", "two\n")
    assert read_lock(tmp_path, "locks/deep/x.lock.json") == "two\n"
    assert sorted(p.name for p in path.parent.iterdir()) == ["x.lock.json"]  # no temporary left


def test_the_workspace_root_may_itself_be_a_link(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "ws").symlink_to(tmp_path / "real")
    write_lock(tmp_path / "ws", "locks/x.json", "x\n")
    assert (tmp_path / "real/locks/x.json").read_text() == "x\n"


@pytest.mark.parametrize("link", ["locks", "locks/sub"])
def test_a_directory_link_on_the_way_is_refused_for_reading_and_writing(tmp_path, link):
    outside = tmp_path / "outside"
    (outside / "sub").mkdir(parents=True)
    (outside / "x.json").write_text("host file\n")
    (outside / "sub/x.json").write_text("host file\n")
    ws = tmp_path / "ws"
    (ws / link).parent.mkdir(parents=True, exist_ok=True)
    (ws / link).symlink_to(outside)
    rel = f"{link}/x.json"
    for call in (lambda: read_lock(ws, rel), lambda: check_writable(ws, rel), lambda: write_lock(ws, rel, "lock\n")):
        with pytest.raises(UsageError) as e:
            call()
        assert e.value.message == f"lock path {rel}: {link} is a symlink; a lock is never read or written through one"
        assert e.value.hint
    assert (outside / "x.json").read_text() == "host file\n" and sorted(os.listdir(outside)) == ["sub", "x.json"]
    assert os.listdir(outside / "sub") == ["x.json"]


def test_a_lock_that_is_a_link_or_not_a_file_is_refused(tmp_path):
    host = tmp_path / "config.json"
    host.write_text("{}\n")
    (tmp_path / "ws/locks").mkdir(parents=True)
    (tmp_path / "ws/locks/a.json").symlink_to(host)
    (tmp_path / "ws/locks/dangling.json").symlink_to(tmp_path / "nowhere.json")
    os.mkfifo(tmp_path / "ws/locks/fifo.json")
    (tmp_path / "ws/file").write_text("")
    ws = tmp_path / "ws"
    for rel, said in [("locks/a.json", "is a symlink"), ("locks/dangling.json", "is a symlink"),
                      ("locks/fifo.json", "is not a regular file"), ("file/x.json", "file is not a directory")]:
        for call in (read_lock, check_writable, lambda root, r: write_lock(root, r, "lock\n")):
            done = threading.Event()  # a FIFO opened for reading would block: the call must not
            result = []

            def go():
                try:
                    call(ws, rel)
                except UsageError as e:
                    result.append(e.message)
                done.set()
            threading.Thread(target=go, daemon=True).start()
            assert done.wait(10), f"{rel} blocked"
            assert result and said in result[0], (rel, result)
    assert host.read_text() == "{}\n" and not (tmp_path / "nowhere.json").exists()
    assert (ws / "locks/a.json").is_symlink()


@pytest.mark.parametrize("rel", ["/etc/x.json", "../x.json", "locks/../../x.json", ""])
def test_a_path_out_of_the_workspace_is_refused(tmp_path, rel):
    with pytest.raises(UsageError):
        write_lock(tmp_path, rel, "x")
