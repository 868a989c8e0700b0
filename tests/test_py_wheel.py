"""py_wheel's pieces that need no sandbox: its RECORD (PEP 376 CSV), reading a PKG-INFO, the ABI
check of limited-API wheels and the platform tag taken from `auditwheel show --json` (its real
output for a wheel is checked in test_cross_build.py and test_wheel.py)."""

from __future__ import annotations

import csv
import io
import subprocess
import sys
import zipfile
from types import SimpleNamespace

import pytest

from bgraph_testlib import requires_bwrap
from build_graph.errors import PlanError
from build_graph.model import FileEntry, Tree
from build_graph.rules.py_wheel import WHEEL_SCRIPT, _check_abi, _entry_points, _metadata, audited_tag


def test_record_quotes_names_with_commas_and_quotes(tmp_path):
    pkg = tmp_path / "pkg" / "demo"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("x = 1\n")
    (pkg / 'odd, name "q".txt').write_text("data\n")
    wheel = tmp_path / "demo-1.0-py3-none-any.whl"
    subprocess.run([sys.executable, "-I", "-S", "-c", WHEEL_SCRIPT, str(tmp_path / "pkg"), str(wheel), "demo", "1.0",
                    "py3-none-any", "Requires-Dist: numpy"], check=True)
    with zipfile.ZipFile(wheel) as zf:
        rows = list(csv.reader(io.StringIO(zf.read("demo-1.0.dist-info/RECORD").decode())))
        names = set(zf.namelist())
    assert all(len(r) == 3 for r in rows), rows
    recorded = {r[0] for r in rows}
    assert 'demo/odd, name "q".txt' in recorded and recorded == names
    assert rows[-1] == ["demo-1.0.dist-info/RECORD", "", ""]


def _ctx(text: str):
    blob = FileEntry("d" * 64, len(text))
    fail = lambda message, key=None, hint=None: PlanError(message, where=key)  # noqa: E731
    return SimpleNamespace(read=lambda entry: text.encode(), fail=fail, attrs=SimpleNamespace(tree="//s:sdist")), \
        Tree({"PKG-INFO": blob})


PKG_INFO = """Metadata-Version: 2.4
Name: demo
Version: 1.2.3
Requires-Python: >=3.10
Requires-Dist: numpy>=1.26
Requires-Dist: torch==2.14.0;
 platform_machine == "x86_64"
Description-Content-Type: text/markdown

Version: 9.9.9 (a line of the description, not a header)
Requires-Dist: not-a-dependency
"""


def test_pkg_info_headers_are_read_by_the_email_parser():
    ctx, tree = _ctx(PKG_INFO)
    assert _metadata(ctx, tree, "PKG-INFO", "1.2.3") == [
        "Requires-Python: >=3.10", "Requires-Dist: numpy>=1.26",
        'Requires-Dist: torch==2.14.0; platform_machine == "x86_64"']


def test_pkg_info_version_must_match():
    ctx, tree = _ctx(PKG_INFO)
    with pytest.raises(PlanError, match="says version 1.2.3, the target says 2.0"):
        _metadata(ctx, tree, "PKG-INFO", "2.0")


ENTRY_POINTS = """[console_scripts]
demo = demo.cli:main

[demo.plugins]
extra = demo.extra:register
"""


def test_entry_points_make_pip_write_the_console_script(tmp_path):
    """What entry_points_from ships (dist-info/entry_points.txt) is what pip reads: installed, the
    wheel gives its command (bgraph's vLLM wheel had none: no `vllm`)."""
    pkg = tmp_path / "pkg"
    (pkg / "demo").mkdir(parents=True)
    (pkg / "demo" / "__init__.py").write_text("")
    (pkg / "demo" / "cli.py").write_text("def main():\n    print('demo ran')\n")
    (pkg / "demo-1.0.dist-info").mkdir()
    (pkg / "demo-1.0.dist-info" / "entry_points.txt").write_text(ENTRY_POINTS)
    wheel = tmp_path / "demo-1.0-py3-none-any.whl"
    subprocess.run([sys.executable, "-I", "-S", "-c", WHEEL_SCRIPT, str(pkg), str(wheel), "demo", "1.0",
                    "py3-none-any", ""], check=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target",
                    str(tmp_path / "site"), str(wheel)], check=True)
    script = tmp_path / "site" / "bin" / "demo"
    assert script.exists()
    out = subprocess.run([sys.executable, str(script)], env={"PYTHONPATH": str(tmp_path / "site")},
                         capture_output=True, text=True, check=True).stdout
    assert out == "demo ran\n"


def test_entry_points_from_is_read_or_refused_with_its_key():
    ctx, _ = _ctx(ENTRY_POINTS)
    tree = Tree({"demo.egg-info/entry_points.txt": FileEntry("e" * 64, len(ENTRY_POINTS))})
    assert _entry_points(ctx, tree, "demo.egg-info/entry_points.txt") == tree.entries["demo.egg-info/entry_points.txt"]
    with pytest.raises(PlanError, match="demo.egg-info/missing.txt is not in //s:sdist"):
        _entry_points(ctx, tree, "demo.egg-info/missing.txt")
    bad, _ = _ctx("demo = demo.cli:main\n")  # no section header
    with pytest.raises(PlanError, match="not an entry_points.txt pip can read"):
        _entry_points(bad, tree, "demo.egg-info/entry_points.txt")


def _report(**kw):
    """`auditwheel show --json` (schema version 1) for an aarch64 wheel."""
    return {"version": 1, "wheel": "x-1-cp38-abi3-linux_aarch64.whl", "pure": False, "pyfpe": False, "ucs2": False,
            "unsupported_isa": False, "versioned_symbols": {}, "external_libs": {}, "policy_upgrades": {}, **kw}


def test_the_tag_is_auditwheels_overall_one_when_nothing_is_external():
    report = _report(overall_tag="manylinux_2_34_aarch64", sym_tag="manylinux_2_34_aarch64")
    assert audited_tag(report, []) == ("manylinux_2_34_aarch64", "auditwheel's overall tag")


def test_declared_external_libraries_allow_the_policy_the_symbols_allow():
    """torch's libraries and the driver are not in any manylinux whitelist: auditwheel says
    linux_aarch64; declared as external (as `auditwheel repair --exclude` would leave them), the
    most compatible policy that the symbol versions allow and that needs nothing else removed wins."""
    upgrades = {p: {"libs_to_eliminate": ["libc10.so", "libcuda.so.1", "libtorch.so"]}
                for p in ("manylinux_2_17_aarch64", "manylinux_2_28_aarch64", "manylinux_2_31_aarch64",
                          "manylinux_2_34_aarch64", "manylinux_2_35_aarch64")}
    upgrades["manylinux_2_35_aarch64"]["blacklisted_symbols"] = {"libc.so.6": ["x"]}
    report = _report(overall_tag="linux_aarch64", sym_tag="manylinux_2_28_aarch64", policy_upgrades=upgrades)
    assert audited_tag(report, [])[0] == "linux_aarch64"
    assert audited_tag(report, ["libtorch*.so", "libc10*.so"])[0] == "linux_aarch64"  # libcuda.so.1 is not allowed
    tag, why = audited_tag(report, ["libtorch*.so", "libc10*.so", "libcuda.so.1"])
    assert tag == "manylinux_2_28_aarch64" and "libcuda.so.1" in why  # 2_17 is below what the symbols need


def test_a_wheel_auditwheel_rejects_keeps_the_linux_tag():
    report = _report(overall_tag="linux_x86_64", sym_tag="manylinux_2_17_x86_64", unsupported_isa=True,
                     policy_upgrades={"manylinux_2_17_x86_64": {}})
    assert audited_tag(report, ["*"]) == ("linux_x86_64", "auditwheel: unsupported_isa")
    with pytest.raises(ValueError, match="auditwheel: not a platform wheel"):
        audited_tag({"version": 1, "wheel": "w", "error": "not a platform wheel"}, [])


@pytest.mark.parametrize("abi, names, error", [
    ("abi3", ["vllm/_C.abi3.so", "vllm/x.py"], None),
    ("abi3", ["vllm/_C.cpython-311-x86_64-linux-gnu.so"], "built for one CPython version"),
    ("none", ["p/libbgraph_fp4.so"], None),
    ("none", ["vllm/_C.abi3.so"], "tag its ABI"),  # (only checked in an audited wheel)
])
def test_abi3_wheels_hold_only_limited_api_extensions(abi, names, error):
    ctx, _ = _ctx("")
    ctx.attrs = SimpleNamespace(abi_tag=abi, audit="//toolchains:auditwheel")
    content = Tree({n: FileEntry("d" * 64, 1) for n in names})
    if error is None:
        _check_abi(ctx, content)
    else:
        with pytest.raises(PlanError, match=error):
            _check_abi(ctx, content)


def _tree_ctx(tree_label="//s:sdist"):
    fail = lambda message, key=None, hint=None: PlanError(message, where=key)  # noqa: E731
    return SimpleNamespace(fail=fail, attrs=SimpleNamespace(tree=tree_label))


def test_tree_dirs_place_a_directory_of_the_tree_where_the_package_expects_it():
    """FlashInfer's package-dir mapping: csrc/ and 3rdparty/cutlass/include/ of the sdist ship as
    flashinfer/data/csrc and flashinfer/data/cutlass/include (its JIT reads them there)."""
    from build_graph.rules.py_wheel import relocated

    f = lambda n: FileEntry(n * 64, 1)  # noqa: E731
    sdist = Tree({"csrc/a.cu": f("a"), "csrc/sub/b.cuh": f("b"), "csrc/x.pyc": f("c"),
                  "3rdparty/cutlass/include/c.h": f("d"), "3rdparty/cutlass/docs/d.md": f("e"),
                  "flashinfer/__init__.py": f("f")})
    got = relocated(_tree_ctx(), sdist, {"flashinfer/data/csrc": "csrc",
                                         "flashinfer/data/cutlass/include/": "3rdparty/cutlass/include"},
                    ["**/*.pyc"])
    assert got.entries == {"flashinfer/data/csrc/a.cu": f("a"), "flashinfer/data/csrc/sub/b.cuh": f("b"),
                           "flashinfer/data/cutlass/include/c.h": f("d")}


@pytest.mark.parametrize("tree_dirs, error", [
    ({"flashinfer/data/csrc": "nothing-here"}, r"tree_dirs\['flashinfer/data/csrc'\]: 'nothing-here' holds no files"),
    ({"../out": "csrc"}, r"the wheel directory '../out' is not a relative path"),
    ({"data": "/etc"}, r"the tree directory '/etc' is not a relative path"),
    ({"": "csrc"}, r"the wheel directory is empty"),
    ({"d": "csrc", "d/": "csrc"}, r"d/a.cu is placed twice"),
])
def test_tree_dirs_bad_input_names_the_key(tree_dirs, error):
    from build_graph.rules.py_wheel import relocated

    sdist = Tree({"csrc/a.cu": FileEntry("a" * 64, 1)})
    with pytest.raises(PlanError, match=error) as e:
        relocated(_tree_ctx(), sdist, tree_dirs, [])
    assert e.value.where == "tree_dirs"


def _linked_sdist() -> Tree:
    """An sdist with links: csrc/a.h -> ../include/a.h (out of the relocated directory), a chain,
    a link through a directory link, and links that name no file of the tree."""
    from build_graph.model import SymlinkEntry

    f = lambda n, x=False: FileEntry(n * 64, 1, x)  # noqa: E731
    return Tree({"include/a.h": f("a"), "other/a.h": f("b"), "csrc/sub/s.h": f("c"), "csrc/run.sh": f("d", True),
                 "csrc/a.h": SymlinkEntry("../include/a.h"), "csrc/alias": SymlinkEntry("sub"),
                 "csrc/chain.h": SymlinkEntry("a.h"), "csrc/via.h": SymlinkEntry("alias/s.h"),
                 "csrc/tool": SymlinkEntry("./run.sh"),
                 "bad/dir": SymlinkEntry("../csrc/sub"), "bad/root": SymlinkEntry(".."),
                 "bad/out": SymlinkEntry("../../etc/passwd"), "bad/abs": SymlinkEntry("/etc/passwd"),
                 "bad/dangling": SymlinkEntry("nothing.h"), "bad/through_file": SymlinkEntry("../include/a.h/x"),
                 "bad/loop1": SymlinkEntry("loop2"), "bad/loop2": SymlinkEntry("loop1")})


def test_a_link_is_resolved_in_its_own_tree_as_the_file_system_would():
    from build_graph.rules.wheel_content import resolve

    sdist = _linked_sdist()
    assert resolve(sdist, "csrc/a.h") == ("include/a.h", sdist.entries["include/a.h"])
    assert resolve(sdist, "csrc/chain.h")[0] == "include/a.h"
    assert resolve(sdist, "csrc/via.h")[0] == "csrc/sub/s.h"
    assert resolve(sdist, "csrc/tool")[1].executable


@pytest.mark.parametrize("link, error", [
    ("bad/dir", r"points to a directory \(csrc/sub\)"),
    ("bad/root", r"points to a directory \(the root of the tree\)"),
    ("bad/out", "points outside the tree"),
    ("bad/abs", "points outside the tree .*/etc/passwd"),
    ("bad/dangling", "dangles: bad/nothing.h is not in the tree"),
    ("bad/through_file", "dangles: include/a.h is a file, not a directory"),
    ("bad/loop1", "is a loop of links"),
])
def test_a_link_that_names_no_file_of_its_tree_is_refused(link, error):
    from build_graph.rules.wheel_content import LinkError, resolve

    with pytest.raises(LinkError, match=error):
        resolve(_linked_sdist(), link)


def test_tree_dirs_ship_what_a_link_names_in_the_tree_not_at_its_new_place():
    """csrc/a.h -> ../include/a.h moved to pkg/data/csrc/a.h would name pkg/data/include/a.h (another
    file, or none): it ships include/a.h's bytes and mode, as setuptools copies it (red-team K13, hole 4)."""
    from build_graph.rules.py_wheel import relocated

    sdist = _linked_sdist()
    got = relocated(_tree_ctx(), sdist, {"pkg/data/csrc": "csrc", "pkg/data/include": "other"}, ["csrc/alias"])
    assert got.entries["pkg/data/csrc/a.h"] == sdist.entries["include/a.h"]
    assert got.entries["pkg/data/csrc/chain.h"] == sdist.entries["include/a.h"]
    assert got.entries["pkg/data/csrc/via.h"] == sdist.entries["csrc/sub/s.h"]
    assert got.entries["pkg/data/csrc/tool"] == sdist.entries["csrc/run.sh"]
    assert got.entries["pkg/data/include/a.h"] == sdist.entries["other/a.h"]
    assert all(isinstance(e, FileEntry) for e in got.entries.values())
    with pytest.raises(PlanError, match=r"tree_dirs\['pkg/data/csrc'\]: the link csrc/alias -> sub points to a "
                                        r"directory") as e:
        relocated(_tree_ctx(), sdist, {"pkg/data/csrc": "csrc"}, [])
    assert e.value.where == "tree_dirs"


WHEEL_TOOLS = '[host]\nkind = "host_tools"\npaths = ["/usr"]\ntools = ["/usr/bin/sh", "/usr/bin/python3"]\n'
LINKED_SDIST = """[sdist]
kind = "genrule"
outs = ["csrc", "include", "other", "pkg"]
cmd = "mkdir -p $OUT/csrc/sub $OUT/include $OUT/other $OUT/pkg && echo REAL > $OUT/include/a.h && echo WRONG > $OUT/other/a.h && printf '#!/bin/sh\\\\n' > $OUT/include/run.sh && chmod +x $OUT/include/run.sh && ln -s ../include/a.h $OUT/csrc/a.h && ln -s ../include/run.sh $OUT/csrc/run.sh && echo s > $OUT/csrc/sub/s.h && ln -s sub $OUT/csrc/alias && echo x > $OUT/pkg/__init__.py && ln -s ../include/a.h $OUT/pkg/a.h"

[w]
kind = "py_wheel"
distribution = "demo"
version = "1.0"
tree = ":sdist"
include = ["pkg/**"]
exclude = ["csrc/alias"]
tree_dirs = { "pkg/data/csrc" = "csrc", "pkg/data/include" = "other" }
files = { "pkg/b.h" = [":sdist", "csrc/a.h"] }
"""


@requires_bwrap
def test_a_wheel_ships_what_its_links_name_in_their_trees(make_ws):
    """tree_dirs, include and files each take a link out of its place: the wheel holds the bytes and
    mode of the file the link names in its own tree (REAL, not the WRONG file at the new place; a
    traceback from the wheel script before), and a link to a directory is refused at planning."""
    ws = make_ws({"targets/toolchains.toml": WHEEL_TOOLS, "targets/p.toml": LINKED_SDIST})
    run = ws.cli("build", "//p:w")
    assert run.rc == 0, run.output
    [wheel] = (ws.root / "bgraph-out" / "p" / "w").glob("*.whl")
    with zipfile.ZipFile(wheel) as zf:
        got = {i.filename: (zf.read(i).decode(), i.external_attr >> 16) for i in zf.infolist()}
    for name in ("pkg/data/csrc/a.h", "pkg/a.h", "pkg/b.h"):
        assert got[name] == ("REAL\n", 0o100644), name
    assert got["pkg/data/csrc/run.sh"] == ("#!/bin/sh\n", 0o100755)
    assert got["pkg/data/include/a.h"][0] == "WRONG\n"  # other/a.h, mapped there on purpose
    assert got["pkg/data/csrc/sub/s.h"][0] == "s\n" and not any("alias" in n for n in got)
    ws.write({"targets/p.toml": LINKED_SDIST.replace('exclude = ["csrc/alias"]\n', "")})
    run = ws.cli("build", "//p:w")
    errors = [line for line in run.stderr.splitlines() if "error:" in line]
    assert run.rc != 0 and "Traceback" not in run.output and len(errors) == 1, run.output
    assert errors[0].startswith("error: //p:w (targets/p.toml [w] key 'tree_dirs'): ") and \
        "the link csrc/alias -> sub points to a directory (csrc/sub)" in errors[0], errors[0]
