"""host_tools: `paths` mounts only the system's installation directories, whose content joins no
key beyond the listed tools (red-team K13, hole 2: a data file under a mounted /tmp directory was
read by an action, and its edit served from the cache as up to date); a tool elsewhere is listed
in `tools` alone, keyed by its digest and mounted by itself."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from bgraph_testlib import requires_bwrap
from build_graph.rules.host_tools import HostToolsAttrs


@pytest.mark.parametrize("path", ["/usr", "/usr/local", "/usr/lib/x86_64-linux-gnu", "/bin", "/sbin", "/lib",
                                  "/lib32", "/lib64", "/libx32", "/etc", "/etc/alternatives", "/opt", "/opt/rocm",
                                  "/usr/"])
def test_a_system_directory_may_be_mounted(path):
    assert HostToolsAttrs(paths=[path], tools=["/usr/bin/sh"]).paths == [path]


@pytest.mark.parametrize("path", ["/home", "/home/me/data", "/root", "/srv", "/mnt/x", "/media", "/var/lib",
                                  "/var/cache/bgraph", "/tmp/x", "/var/tmp/data", "/usr/../home", "/boot",
                                  "/bin/x", "/usrx", "/optical"])
def test_any_other_host_path_is_refused_with_a_hint(path):
    with pytest.raises(ValidationError, match=f"'{path}' is not a system installation directory .* -- hint: "
                                              "list a program from there in `tools`"):
        HostToolsAttrs(paths=["/usr", path], tools=["/usr/bin/sh"])


def test_a_system_path_that_is_a_link_elsewhere_is_judged_by_where_it_leads(monkeypatch):
    """The mount shows what the link leads to: /opt/data -> /home/me/data is /home/me/data."""
    import os.path

    real = os.path.realpath
    monkeypatch.setattr(os.path, "realpath", lambda p: "/home/me/data" if p == "/opt/data" else real(p))
    with pytest.raises(ValidationError, match="'/opt/data' is not a system installation directory"):
        HostToolsAttrs(paths=["/opt/data"], tools=["/usr/bin/sh"])


@requires_bwrap
def test_a_data_directory_in_paths_is_refused_at_load(make_ws, tmp_path):
    """The red team's case: `paths = ["/usr", H]` with a genrule reading H/data."""
    data = tmp_path / "hostdir"
    data.mkdir()
    (data / "data").write_text("v1\n")
    ws = make_ws({"targets/toolchains.toml": f'[hx]\nkind = "host_tools"\npaths = ["/usr", "{data}"]\n'
                                             'tools = ["/usr/bin/sh", "/usr/bin/cat"]\n',
                  "targets/p.toml": f'[g]\nkind = "genrule"\nouts = ["o"]\ncmd = "cat {data}/data > $OUT/o"\n'
                                    'tools = "//toolchains:hx"\n'})
    run = ws.cli("build", "//p:g")
    errors = [line for line in run.stderr.splitlines() if "error:" in line]
    assert run.rc != 0 and "Traceback" not in run.output and len(errors) == 1, run.output
    assert errors[0].startswith("error: targets/toolchains.toml:3 [hx] key 'paths': ") and \
        f"'{data}' is not a system installation directory" in errors[0], errors[0]
    assert "hint: list a program from there in `tools`" in run.stderr, run.output


@requires_bwrap
def test_a_tool_outside_the_system_is_mounted_alone_and_keyed(make_ws, tmp_path):
    """A script in a scratch directory, listed in `tools` only: it runs, an edit to it rebuilds, and
    its directory's other files are not in the sandbox (nothing there is keyed)."""
    tools = tmp_path / "tools"
    tools.mkdir()
    tool = tools / "mytool"
    tool.write_text("#!/bin/sh\necho tool-v1\n")
    tool.chmod(0o755)
    (tools / "data").write_text("unkeyed\n")
    ws = make_ws({"targets/toolchains.toml": f'[hx]\nkind = "host_tools"\npaths = ["/usr"]\n'
                                             f'tools = ["/usr/bin/sh", "/usr/bin/cat", "{tool}"]\n',
                  "targets/p.toml": f'[g]\nkind = "genrule"\nouts = ["o"]\ncmd = "{tool} > $OUT/o; '
                                    f'cat {tools}/data >> $OUT/o 2>/dev/null || echo no-data >> $OUT/o"\n'
                                    'tools = "//toolchains:hx"\n'})
    assert ws.cli("build", "//p:g").rc == 0
    assert ws.read_output("//p:g", "o") == "tool-v1\nno-data\n"
    tool.write_text("#!/bin/sh\necho tool-v2\n")
    assert ws.cli("build", "//p:g").rc == 0
    assert ws.read_output("//p:g", "o") == "tool-v2\nno-data\n"
