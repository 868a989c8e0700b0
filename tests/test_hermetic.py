"""The shipped targets run on pinned systems: no action reads the host's /usr.

Item 3 of the hermetic-toolchain work, read from the plan and the recorded actions (data), not
from logs: the closure of each shipped wheel holds no host_tools target, and every action of the
fast ones, once built, mounts no host path and has a pinned /usr."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from bgraph_testlib import WS, workspace_copy
from build_graph import configs
from build_graph.graph import dependency_map, deps_in_order
from build_graph.labels import parse_label

SHIPPED = ["//wheels:vllm-sm121", "//wheels:vllm-sm120", "//wheels:vllm-sm12x", "//wheels:fp4-kernels-sm121",
           "//examples:cmake-demo", "//vllm:smoke-fp4-sm121"]
BUILT_HERE = ["//wheels:fp4-kernels-sm121", "//examples:cmake-demo"]


@pytest.fixture(scope="module")
def ws(module_tmp) -> WS:
    return WS(workspace_copy(module_tmp / "ws"), module_tmp / "cache")


def test_no_shipped_target_depends_on_the_hosts_usr(ws):
    loaded = ws.load()
    closure = deps_in_order(dependency_map(loaded), [parse_label(x) for x in SHIPPED])
    kinds = {str(label): loaded.targets[label].kind for label in closure}
    assert not [label for label, kind in kinds.items() if kind == "host_tools"], kinds
    assert kinds["//toolchains:host-cc"] == "deb_packages" and kinds["//toolchains:host"] == "deb_packages"


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")
def test_every_action_runs_on_a_pinned_usr_and_mounts_no_host_path(ws):
    run = ws.build(*BUILT_HERE, args=("-j2",))
    assert run.rc == 0, run.stderr[-3000:]
    engine = ws.engine()
    loaded = engine.ws
    # the configured targets (the FP4 wheel is built for aarch64: its closure holds the cross compiler)
    closure = configs.configure(loaded, configs.requested(loaded, [parse_label(x) for x in BUILT_HERE])).order
    assert any(c.label == parse_label("//toolchains:cross-cc-aarch64") for c in closure)
    exec_actions = 0
    for label in closure:
        actions = engine.trace.load(str(label)).get("actions", {})
        for name, recorded in actions.items():
            described = recorded["description"]
            assert described["host_paths"] == [] and described["host_tools"] == {}, (label, name, described)
            if described["kind"] == "exec":
                exec_actions += 1
                assert "/usr" in described["inputs"], (label, name)  # the pinned system, by digest
    assert exec_actions > 50  # the compiles, the configure, the links and the wheel were all seen


def test_the_pinned_usr_is_the_lock_and_not_the_host(ws):
    """The /usr an action sees is the locked packages: its python3 is Debian 12's 3.11.2 whatever
    the host has, and a file that only the host's /usr holds is absent."""
    import json
    lock = json.loads((Path(ws.root) / "toolchains" / "host.lock.json").read_text())
    versions = {p["package"]: p["version"] for p in lock["platforms"]["x86_64"]["packages"]}
    assert versions["python3.11"].startswith("3.11.2")
    ws.write({"targets/probe.toml": '[p]\nkind = "genrule"\nouts = ["o"]\n'
                                    'cmd = "python3 --version > $OUT/o; test -e /usr/bin/bwrap && echo host >> $OUT/o || true"\n'})
    run = ws.build("//probe:p")
    assert run.rc == 0, run.stderr
    assert ws.read_output("//probe:p", "o") == "Python 3.11.2\n"
