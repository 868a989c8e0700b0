"""nvcc --dryrun decomposition: pure text in, per-(TU, arch) steps out (no nvcc needed)."""

from pathlib import Path

import pytest

from build_graph.nvcc import DryrunError, parse_dryrun

DATA = Path(__file__).parent / "data"


def steps_of(name: str):
    return parse_dryrun((DATA / name).read_text(), "k.o")


def test_two_arch_dryrun_becomes_per_arch_steps():
    env, steps = steps_of("nvcc13.0-dryrun-120a-121a.txt")
    assert [(s.kind, s.arch) for s in steps] == [
        ("hostpp", None), ("cudafe", None),
        ("devpp", "1200"), ("cicc", "120a"), ("ptxas", "120a"),
        ("devpp", "1210"), ("cicc", "121a"), ("ptxas", "121a"),
        ("hostcc", None), ("fatbin", None)]
    assert env["NVVMIR_LIBRARY_DIR"].startswith("/bgraph/toolchain")
    cicc121 = steps[6]
    assert cicc121.inputs == ["k.module_id", "k.compute_121a.cpp1.ii"]
    assert "k.compute_121a.ptx" in cicc121.outputs
    # No temp name, PID or host path survives (the fatbinary's image is written to the sandbox's /tmp).
    for s in steps:
        assert not any("tmpxft" in a or a.startswith("/tmp") and a != "/tmp/k.fatbin" for a in s.argv), s.argv
    # Only preprocessing reads the source: the compile steps are keyed on their inputs alone.
    assert [s.kind for s in steps if s.reads_source] == ["hostpp", "devpp", "devpp"]
    # The host compile never reads the fatbinary (a stand-in declares its wrapper); fatbinary's
    # action, last, embeds its image and joins it to the host object (`ld -r`) into the TU's object.
    host, fatbin = steps[-2:]
    assert host.outputs == ["k.host.o"] and "k.fatbin.c" not in host.needs()
    assert host.aliases == {"k.cudafe1.stub.c": "k.compute_121a.cudafe1.stub.c"}
    assert fatbin.argv[:2] == ["/bin/sh", "-c"] and "--create=/tmp/k.fatbin" in fatbin.argv
    assert not any(a.startswith("--embedded-fatbin") for a in fatbin.argv)
    assert fatbin.inputs == ["k.compute_120a.cubin", "k.compute_121a.cubin", "k.host.o"]
    assert fatbin.outputs == ["k.o"]


def test_single_arch_names_match_the_multi_arch_ones():
    """Adding an arch must leave the first arch's steps byte-identical (same keys)."""
    _, one = steps_of("nvcc13.0-dryrun-120a.txt")
    _, two = steps_of("nvcc13.0-dryrun-120a-121a.txt")
    for kind in ("cicc", "ptxas", "cudafe"):
        a = next(s for s in one if s.kind == kind)
        b = next(s for s in two if s.kind == kind and s.arch in ("120a", None))
        assert a.argv == b.argv and a.inputs == b.inputs and a.outputs == b.outputs
        assert [a.output_path(n) for n in a.outputs] == [b.output_path(n) for n in b.outputs]


def test_unknown_step_is_refused():
    with pytest.raises(DryrunError, match="unsupported nvcc step"):
        parse_dryrun('#$ nvlink --arch=sm_90 "a.o" -o "b.o"\n', "k.o")


@pytest.mark.parametrize("line", [
    'a "b c" d', 'x"y z"w', 'a  "" b', '"-I/x y/z"', "", "  ", 'a\\ b', '"unbalanced', "it's",
    'gcc "-I/bgraph/toolchain/bin/../targets/x86_64-linux/include" -D__CUDACC__ -E "x.cu"',
    # Ninja commands as CMake writes them
    'cd /bgraph/out && /usr/bin/cmake -E cmake_symlink_library libx.so.1 libx.so.1 libx.so',
    '/usr/bin/g++ -DTORCH_EXTENSION_NAME=_C "-DFLAG=\\"v\\"" -O3 -MD -MT a.o -MF a.o.d -o a.o -c /s/a.cpp',
    ': && /usr/bin/g++ -fPIC -shared -Wl,-soname,_C.so -o _C.so a.o -Wl,-rpath,/x:/y && :',
])
def test_split_command_is_shlex(line):
    import shlex

    from build_graph.nvcc import split_command
    try:
        expected = shlex.split(line)
    except ValueError:
        with pytest.raises(ValueError):
            split_command(line)
        return
    assert split_command(line) == expected


def test_split_command_matches_shlex_on_recorded_dryruns():
    import shlex

    from build_graph.nvcc import split_command
    lines = [line[3:].strip() for name in ("nvcc13.0-dryrun-120a-121a.txt", "nvcc13.0-dryrun-120a.txt")
             for line in (DATA / name).read_text().splitlines() if line.startswith("#$ ")]
    assert len(lines) > 40
    assert all(split_command(line) == shlex.split(line) for line in lines)
