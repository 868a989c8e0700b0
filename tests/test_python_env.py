"""python_env's wheel layout and the toolkit prefix links (pure tree functions)."""

from build_graph.model import FileEntry, SymlinkEntry, Tree
from build_graph.rules.cuda_toolchain import toolkit_links
from build_graph.rules.python_env import site_packages
from build_graph.store.peaks import Peaks

F = FileEntry("d" * 64, 1)


def test_wheel_data_dirs_map_to_site_packages():
    wheel = Tree({"pkg/__init__.py": F, "pkg-1.0.data/purelib/extra.py": F,
                  "pkg-1.0.data/platlib/native/x.so": F, "pkg-1.0.data/scripts/tool": F,
                  "pkg-1.0.data/headers/h.h": F, "pkg-1.0.dist-info/METADATA": F})
    assert sorted(site_packages(wheel).entries) == ["extra.py", "native/x.so", "pkg-1.0.dist-info/METADATA",
                                                    "pkg/__init__.py"]


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
