"""python_env's wheel layout and the toolkit prefix links (pure tree functions)."""

import hashlib
import zipfile

import pytest

from bgraph_testlib import requires_bwrap
from build_graph.model import DirEntry, FileEntry, SymlinkEntry, Tree
from build_graph.rules.cuda_toolchain import toolkit_links
from build_graph.rules.python_env import below_a_file, site_packages
from build_graph.store.peaks import Peaks

F = FileEntry("d" * 64, 1)


def test_wheel_data_dirs_map_to_site_packages():
    wheel = Tree({"pkg/__init__.py": F, "pkg-1.0.data/purelib/extra.py": F,
                  "pkg-1.0.data/platlib/native/x.so": F, "pkg-1.0.data/scripts/tool": F,
                  "pkg-1.0.data/headers/h.h": F, "pkg-1.0.dist-info/METADATA": F})
    assert sorted(site_packages(wheel).entries) == ["extra.py", "native/x.so", "pkg-1.0.dist-info/METADATA",
                                                    "pkg/__init__.py"]


def test_a_wheel_putting_a_file_below_its_own_file_or_one_path_twice_is_refused_naming_both():
    G = FileEntry("e" * 64, 2)
    with pytest.raises(ValueError, match="w.whl installs 'a/b' below 'w.data/purelib/a', a file at 'a'"):
        site_packages(Tree({"a/b": F, "w.data/purelib/a": G}), "w.whl")
    with pytest.raises(ValueError, match="installs 'x.py' twice, as 'w.data/platlib/x.py' and as 'x.py'"):
        site_packages(Tree({"x.py": F, "w.data/platlib/x.py": G}), "w.whl")
    assert sorted(site_packages(Tree({"x.py": F, "w.data/purelib/x.py": F})).entries) == ["x.py"]  # the same: fine
    assert below_a_file({"a": DirEntry(), "a/b": F}) is None
    assert below_a_file({"l": SymlinkEntry("."), "l/x/y": F}) == ("l/x/y", "l")


@requires_bwrap
def test_building_a_hostile_wheel_names_the_wheel_and_pin(make_ws, tmp_path):
    """A file a/b and a file w.data/purelib/a: the env was 'cannot materialize: 'a/b' lies below
    non-directory 'a'', naming no target, pin or wheel."""
    whl = tmp_path / "w-1.0-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as zf:
        zf.writestr("a/b", "inner\n")
        zf.writestr("w.data/purelib/a", "outer\n")
        zf.writestr("w-1.0.dist-info/RECORD", "")
    sha = hashlib.sha256(whl.read_bytes()).hexdigest()
    ws = make_ws({"WORKSPACE.toml": f'[workspace]\nname = "t"\n\n[pins.w]\nkind = "url"\nurl = "file://{whl}"\n'
                                    f'sha256 = "{sha}"\n',
                  "targets/p.toml": '[env]\nkind = "python_env"\nwheels = ["w"]\n'})
    ws.env["BGRAPH_FILE_URL_DIRS"] = str(tmp_path)  # outside the workspace: the user allows it
    run = ws.cli("build", "//p:env")
    errors = [line for line in run.stderr.splitlines() if "error:" in line]
    assert run.rc != 0 and "Traceback" not in run.output, run.output
    assert len(errors) == 1 and "//p:env" in errors[0] and "w-1.0-py3-none-any.whl (pin w)" in errors[0], run.output
    assert "'a/b' below 'w.data/purelib/a'" in errors[0] and "hint:" in run.stderr


def test_toolkit_links_add_lib64_and_unversioned_names():
    tree = Tree({"lib/libcublas.so.13": F, "lib/libcudart.so.13": F, "lib/libcudart.so": F, "lib/x.a": F})
    assert toolkit_links(tree).entries == {"lib/libcublas.so": SymlinkEntry("libcublas.so.13"),
                                           "lib64": SymlinkEntry("lib")}


def test_peaks_budget_learns_from_the_last_run(tmp_path):
    peaks = Peaks(tmp_path, tmp_path)
    assert peaks.budget("//a:b cicc x", 4096) == 4096  # nothing learned: the declaration
    peaks.record("//a:b cicc x", 1000)
    peaks.save()
    assert Peaks(tmp_path, tmp_path).budget("//a:b cicc x", 4096) == 1250  # learned, with headroom


def test_peaks_budget_of_a_new_arch_starts_from_another_arch(tmp_path):
    """A first run of 12.0a's cicc for a TU is budgeted like its 12.1a run, not by the default:
    on 2 cores two 9 GB cicc steps budgeted at 4 GB each would overcommit memory."""
    peaks = Peaks(tmp_path, tmp_path)
    peaks.record("//v:b121 cicc big.cu.o 121a", 9000)
    peaks.record("//v:b121 devpp big.cu.o 1210", 200)
    peaks.record("//v:b121 hostcc big.cu.o", 900)
    peaks.record("//v:gen genrule", 5000)
    peaks.save()
    peaks = Peaks(tmp_path, tmp_path)
    assert peaks.budget("//v:b121 cicc big.cu.o 120a", 4096) == 11250  # same target, other arch
    assert peaks.budget("//v:b120 cicc big.cu.o 120a", 4096) == 11250  # another target's step
    assert peaks.budget("//v:b121 devpp big.cu.o 1200", 4096) == 250
    assert peaks.budget("//v:b121 cicc small.cu.o 120a", 4096) == 4096  # no sibling: the declaration
    assert peaks.budget("//v:b120 hostcc big.cu.o", 4096) == 1125  # the same step in another target
    assert peaks.budget("//v:b120 hostcc other.cu.o", 4096) == 4096
    assert peaks.budget("//v:other genrule", 512) == 512  # a bare kind is no sibling
