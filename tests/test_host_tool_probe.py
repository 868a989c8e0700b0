"""bgraph never runs a host tool on the host (red-team K15, hole 1: `tools =
["/proc/self/cwd/tools/evil"]`, a script the workspace ships, was run by the `--version` probe as
root with every capability, and again after the build). The probe runs in an action's sandbox,
and a tool under /proc, /dev or /sys, or whose real path lies in a workspace or a cache, is
refused at load with one line naming the entry."""

from __future__ import annotations

import os
import time

import pytest
from pydantic import ValidationError

from bgraph_testlib import requires_bwrap
from build_graph.model import Digester
from build_graph.rules.host_tools import HostToolsAttrs


def evil_script(path, marker) -> None:
    """A tool that, run on the host, leaves `marker` behind; its version line tells where it ran."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'#!/bin/sh\necho "ran: uid $(id -u)" > {marker}\n'
                    'echo "host $(cat /proc/sys/kernel/hostname) $(grep CapEff /proc/self/status)"\n')
    path.chmod(0o755)


@pytest.mark.parametrize("tool", ["/proc/self/cwd/tools/evil", "/proc/1/root/usr/bin/sh", "/dev/fd/3",
                                  "/sys/kernel/x", "/usr/../proc/self/exe"])
def test_a_tool_under_the_hosts_live_state_is_refused(tool):
    with pytest.raises(ValidationError, match=f"'{tool}' lies under /proc, /dev or /sys.* -- hint: list host "
                                              "binaries"):
        HostToolsAttrs(tools=["/usr/bin/sh", tool])


def test_a_tool_whose_real_path_is_in_a_workspace_or_cache_is_refused(tmp_path):
    ws, cache, elsewhere = tmp_path / "ws", tmp_path / "cache", tmp_path / "elsewhere"
    (ws / "tools").mkdir(parents=True)
    (ws / "WORKSPACE.toml").write_text('[workspace]\nname = "t"\n')
    (ws / "tools" / "evil").write_text("#!/bin/sh\n")
    (cache / "v1" / "tmp").mkdir(parents=True)
    (cache / "v1" / "blake3" / "trees").mkdir(parents=True)
    (cache / "v1" / "blake3" / "trees" / "tool").write_text("#!/bin/sh\n")
    elsewhere.mkdir()
    (elsewhere / "link").symlink_to(ws / "tools" / "evil")
    for tool, where in [(ws / "tools" / "evil", f"the workspace {ws}"), (elsewhere / "link", f"the workspace {ws}"),
                        (cache / "v1" / "blake3" / "trees" / "tool", f"the bgraph cache {cache}")]:
        with pytest.raises(ValidationError, match=f"'{tool}' lies in {where}"):
            HostToolsAttrs(tools=[str(tool)])
    (elsewhere / "tool").write_text("#!/bin/sh\n")  # outside any: a host script, allowed
    assert HostToolsAttrs(tools=[str(elsewhere / "tool")]).tools == [str(elsewhere / "tool")]


@requires_bwrap
def test_the_version_probe_runs_in_the_sandbox_not_on_the_host(tmp_path):
    """A host script outside any workspace (allowed): its `--version` runs with no capability, in
    the sandbox (its hostname, a tmpfs /tmp), and writes nothing on the host."""
    from build_graph.sandbox import probe_host_tools

    tool, marker = tmp_path / "bin" / "tool", tmp_path / "MARKER"
    evil_script(tool, marker)
    [probed] = probe_host_tools((str(tool),), Digester("blake3"))
    assert not marker.exists(), marker.read_text()
    assert probed.version == "host bgraph CapEff:\t0000000000000000", probed
    assert probed.digest == Digester("blake3").of(tool.read_bytes())


@requires_bwrap
def test_a_probe_that_hangs_or_floods_is_cut_short(tmp_path, monkeypatch):
    from build_graph import sandbox

    monkeypatch.setattr(sandbox, "PROBE_TIMEOUT_S", 2)
    hang, flood = tmp_path / "hang", tmp_path / "flood"
    hang.write_text("#!/bin/sh\nsleep 60 &\nexec sleep 60\n")
    flood.write_text("#!/bin/sh\nwhile :; do echo flood-$$; done\n")
    for t in (hang, flood):
        t.chmod(0o755)
    start = time.monotonic()
    assert sandbox._sandboxed_version(str(hang)) == ""
    assert time.monotonic() - start < 10
    start = time.monotonic()
    assert sandbox._sandboxed_version(str(flood)).startswith("flood-")
    assert time.monotonic() - start < 5


@requires_bwrap
@pytest.mark.parametrize("how", ["proc-cwd", "absolute", "link"])
def test_a_workspace_script_as_a_tool_never_runs_on_the_host(make_ws, tmp_path, how):
    """The red team's case, through the CLI run in the workspace: one error line naming the
    entry, and the script never ran (its marker file stays absent)."""
    marker = tmp_path / "PWNED"
    ws = make_ws({})
    evil_script(ws.root / "tools" / "evil", marker)
    tool = {"proc-cwd": "/proc/self/cwd/tools/evil", "absolute": f"{ws.root}/tools/evil",
            "link": f"{tmp_path}/link"}[how]
    if how == "link":
        os.symlink(ws.root / "tools" / "evil", tool)
    (ws.root / "targets" / "t.toml").write_text(f'[host]\nkind = "host_tools"\npaths = ["/usr"]\n'
                                                f'tools = ["/usr/bin/sh", "{tool}"]\n')
    run = ws.cli("build", "//t:host")
    errors = [line for line in run.stderr.splitlines() if "error:" in line]
    assert not marker.exists(), marker.read_text()
    assert run.rc != 0 and "Traceback" not in run.output and len(errors) == 1, run.output
    assert errors[0].startswith("error: targets/t.toml:4 [host] key 'tools': ") and f"'{tool}' lies " in errors[0]


@requires_bwrap
def test_a_host_script_tool_is_probed_and_rechecked_in_the_sandbox_only(make_ws, tmp_path):
    """A tool outside the workspace, used by an action: the plan's probe and the re-probe after
    the action (engine.moved_host_tool; a fresh tool's stamp is racy, so it is probed again) run
    it sandboxed, never on the host; the action itself runs it too, sandboxed."""
    marker = tmp_path / "PWNED"
    tool = tmp_path / "bin" / "tool"
    evil_script(tool, marker)
    ws = make_ws({"targets/t.toml": f'[host]\nkind = "host_tools"\npaths = ["/usr"]\n'
                                    f'tools = ["/usr/bin/sh", "/usr/bin/cat", "{tool}"]\n'
                                    f'[g]\nkind = "genrule"\nouts = ["o"]\ncmd = "{tool} > $OUT/o"\n'
                                    'tools = ":host"\n'})
    run = ws.cli("build", "//t:g")
    assert run.rc == 0, run.output
    assert not marker.exists(), marker.read_text()
    assert ws.read_output("//t:g", "o") == "host bgraph CapEff:\t0000000000000000\n"
