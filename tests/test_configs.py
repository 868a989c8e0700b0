"""Configurations (build_graph/configs.py): which platform each target is built for, how edges
and a target's own `platform` change it, and where outputs of two platforms land. The graph tests
are pure (no action runs); the build tests run genrules and a wheel under the real bubblewrap on
the host's /usr (host_tools), for two target platforms in one build."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest

from bgraph_testlib import WORKSPACE_TOML, requires_bwrap
from build_graph import configs
from build_graph.configs import Config, Configured
from build_graph.labels import parse_label
from build_graph.workspace import host_platform

HOST = host_platform()
OTHER = "aarch64" if HOST == "x86_64" else "x86_64"

# A wheel fixed to OTHER, over a genrule; a system with a cross stand-in; a CMake project.
GRAPH = {
    "WORKSPACE.toml": WORKSPACE_TOML,
    "targets/t.toml": f'''[sys]
kind = "deb_packages"
lock = "toolchains/sys.lock.json"
packages = ["dash"]
cross = {{ {OTHER} = ":cross" }}

[cross]
kind = "deb_packages"
lock = "toolchains/cross.lock.json"
locked_for = ["{HOST}"]
packages = ["dash"]

[root]
kind = "deb_packages"
lock = "toolchains/root.lock.json"
sysroot = true
packages = ["libc6"]

[aw]
kind = "python_env"
wheels = []

[cmake]
kind = "host_tools"
paths = ["/usr"]
tools = ["/usr/bin/sh"]

[ninja]
kind = "host_tools"
paths = ["/usr"]
tools = ["/usr/bin/sh"]

[nvcc]
kind = "host_tools"
paths = ["/usr"]
tools = ["/usr/bin/sh"]
''',
    "targets/g.toml": '''[gen]
kind = "genrule"
outs = ["x"]
cmd = "echo x > $OUT/x"
tools = "//t:sys"

[spark]
kind = "py_wheel"
distribution = "spark"
version = "1"
files = { "spark/x" = [":gen", "x"] }
tools = "//t:sys"
audit = "//t:aw"
platform = "%s"

[cm]
kind = "cmake_project"
srcs = ["targets/g.toml"]
outputs = ["all"]
cmake = "//t:cmake"
ninja = "//t:ninja"
toolchain = "//t:nvcc"
host = "//t:sys"
''' % OTHER,
}


def configured(ws, *labels: str, forced: str | None = None, exec_platform: str | None = None):
    loaded = ws.load()
    roots = configs.requested(loaded, [parse_label(x) for x in labels], exec_platform, forced)
    graph = configs.configure(loaded, roots, forced)
    return roots, {str(c): c for c in graph.order}, graph


def test_a_target_fixes_its_platform_and_its_dependencies_follow(make_ws):
    ws = make_ws(GRAPH, toolchains=False)
    [root], nodes, graph = configured(ws, "//g:spark")
    assert root.config == Config(HOST, OTHER) and str(root) == f"//g:spark ({OTHER})"
    assert root.out_path() == f"{OTHER}/g/spark"
    # the genrule it packs is built for the wheel's platform; its system is the stand-in for OTHER,
    # itself a system of the exec machine; auditwheel runs on the exec machine (an exec transition)
    assert nodes[f"//g:gen ({OTHER})"].config == Config(HOST, OTHER)
    assert nodes[f"//t:sys ({OTHER})"].config == Config(HOST, OTHER)
    assert nodes["//t:cross"].config == Config(HOST, HOST)
    assert nodes["//t:aw"].config == Config(HOST, HOST)
    assert set(nodes) == {f"//g:spark ({OTHER})", f"//g:gen ({OTHER})", f"//t:sys ({OTHER})", "//t:cross", "//t:aw"}
    assert graph.dep_labels[root][("files", parse_label("//g:gen"))] == nodes[f"//g:gen ({OTHER})"]


def test_platform_overrides_every_target_below(make_ws):
    ws = make_ws(GRAPH, toolchains=False)
    [root], nodes, _ = configured(ws, "//g:spark", forced=HOST)
    assert root.config == Config(HOST, HOST) and str(root) == "//g:spark" and root.out_path() == "g/spark"
    assert set(nodes) == {"//g:spark", "//g:gen", "//t:sys", "//t:aw"}  # no stand-in where nothing is cross


def test_a_system_is_the_exec_machines_unless_a_stand_in_serves_the_target(make_ws):
    ws = make_ws(GRAPH, toolchains=False)
    _, nodes, _ = configured(ws, "//g:gen", "//t:root", "//t:aw", forced=OTHER)
    assert "//t:sys" not in nodes and nodes[f"//t:sys ({OTHER})"].config == Config(HOST, OTHER)
    assert nodes[f"//t:root ({OTHER})"].config == Config(HOST, OTHER)  # a sysroot is the target's
    assert f"//t:aw ({OTHER})" in nodes  # requested for OTHER: no edge took it to the exec machine
    # //t:cross has no cross of its own: for any target it is the exec machine's system
    [cross] = configs.requested(ws.load(), [parse_label("//t:cross")], None, OTHER)
    assert cross.config == Config(HOST, HOST) and cross.out_path() == "t/cross"


def test_cmake_and_ninja_run_on_the_exec_machine(make_ws):
    ws = make_ws(GRAPH, toolchains=False)
    _, nodes, _ = configured(ws, "//g:cm", forced=OTHER)
    assert {"//t:cmake", "//t:ninja"} <= set(nodes)  # exec transition
    assert f"//t:nvcc ({OTHER})" in nodes and f"//t:sys ({OTHER})" in nodes  # the toolchain follows the target


def test_planning_for_another_host(make_ws):
    ws = make_ws(GRAPH, toolchains=False)
    [root], nodes, _ = configured(ws, "//g:gen", exec_platform=OTHER)
    assert root.config == Config(OTHER, OTHER) and str(root) == f"//g:gen ({OTHER} on {OTHER})"


def test_one_label_in_two_configurations_for_one_target(make_ws):
    """A target may need one label built for its platform and for the exec machine (vLLM's
    cross configure imports an exec-platform torch and links the target's): each edge keeps its
    configuration, and the rule's dep(label, key) gets that edge's output."""
    ws = make_ws({**GRAPH, "targets/h.toml": '''[both]
kind = "cmake_project"
srcs = ["targets/h.toml"]
outputs = ["all"]
cmake = "//t:cmake"
ninja = "//t:cmake"
toolchain = "//t:cmake"
host = "//t:sys"
'''}, toolchains=False)
    [root], nodes, graph = configured(ws, "//h:both", forced=OTHER)
    cmake = parse_label("//t:cmake")
    edges = graph.dep_labels[root]
    assert edges[("cmake", cmake)] == nodes["//t:cmake"] and edges[("ninja", cmake)] == nodes["//t:cmake"]
    assert edges[("toolchain", cmake)] == nodes[f"//t:cmake ({OTHER})"]
    seen = graph.inputs(root, configs.Outputs({nodes["//t:cmake"]: "exec", nodes[f"//t:cmake ({OTHER})"]: "target",
                                                nodes[f"//t:sys ({OTHER})"]: "sys"}))
    assert seen[("cmake", cmake)] == "exec" and seen[("toolchain", cmake)] == "target" and cmake not in seen
    assert seen[parse_label("//t:sys")] == "sys"  # one configuration: found by its label too


def test_outputs_find_a_plain_label():
    a, b = (Configured(parse_label("//p:a"), Config(HOST, p), p) for p in (HOST, OTHER))
    outputs = configs.Outputs({a: 1})
    assert outputs[parse_label("//p:a")] == 1
    outputs[b] = 2
    with pytest.raises(KeyError):  # two configurations: say which
        outputs[parse_label("//p:a")]


# -- real builds: one label for two platforms ------------------------------------------------------------
BUILD = {
    "targets/toolchains.toml": '''[host]
kind = "host_tools"
paths = ["/usr"]
tools = ["/usr/bin/sh", "/usr/bin/python3"]
''',
    "targets/p.toml": '''[gen]
kind = "genrule"
outs = ["x"]
cmd = "echo made-here > $OUT/x"

[wheel]
kind = "py_wheel"
distribution = "w"
version = "1"
files = { "w/x" = [":gen", "x"] }
platform = "%s"
''' % OTHER,
}


@requires_bwrap
def test_one_build_makes_a_target_for_two_platforms_side_by_side(make_ws):
    ws = make_ws(BUILD)
    run = ws.build("//p:wheel", "//p:gen")
    assert run.rc == 0, run.stderr
    out = run.json["outputs"]
    assert set(out) == {f"//p:wheel ({OTHER})", "//p:gen"}
    assert out["//p:gen"] == str(ws.root / "bgraph-out/p/gen")
    assert out[f"//p:wheel ({OTHER})"] == str(ws.root / f"bgraph-out/{OTHER}/p/wheel")
    [wheel] = Path(out[f"//p:wheel ({OTHER})"]).glob("*.whl")
    assert wheel.name == f"w-1-py3-none-linux_{OTHER}.whl"
    with zipfile.ZipFile(wheel) as zf:
        assert f"Tag: py3-none-linux_{OTHER}" in zf.read("w-1.dist-info/WHEEL").decode()
    gens = {a["label"]: a for a in run.json["actions"] if a["name"] == "genrule"}
    assert set(gens) == {"//p:gen", f"//p:gen ({OTHER})"}
    assert gens["//p:gen"]["key"] != gens[f"//p:gen ({OTHER})"]["key"]  # the platform is in the key
    # the cross action says where it ran; the native one carries no exec_platform (keys as before)
    trace = ws.engine().trace
    cross = trace.load(f"//p:gen ({OTHER})")["actions"]["genrule"]["description"]
    native = trace.load("//p:gen")["actions"]["genrule"]["description"]
    assert (cross["platform"], cross["exec_platform"]) == (OTHER, HOST)
    assert native["platform"] == HOST and "exec_platform" not in native
    # --platform HOST: the same wheel for this machine, beside the other one; nothing overwritten
    again = ws.build("//p:wheel", args=("--platform", HOST))
    assert again.rc == 0, again.stderr
    assert again.json["outputs"] == {"//p:wheel": str(ws.root / "bgraph-out/p/wheel")}
    assert [p.name for p in (ws.root / "bgraph-out/p/wheel").glob("*.whl")] == [f"w-1-py3-none-linux_{HOST}.whl"]
    assert wheel.exists() and again.json["executed"] == 1  # only the wheel: //p:gen was built for HOST
    # the human summary names each output's path
    plain = ws.cli("build", "//p:wheel")
    assert f"//p:wheel ({OTHER}): bgraph-out/{OTHER}/p/wheel" in plain.stderr, plain.stderr
