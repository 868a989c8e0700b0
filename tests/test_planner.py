"""The planner drives a rule's plan as dataflow: each action is ready as soon as the actions it
reads from are done (no waves), checked on a cuda_library TU planned from a recorded dryrun."""

from __future__ import annotations

from pathlib import Path

import pytest

from build_graph.errors import PlanError
from build_graph.labels import Label
from build_graph.model import Digester, FileEntry, Outcome, TargetOutput, Tree
from build_graph.planner import TargetPlan
from build_graph.rules.base import Dataflow, RuleContext
from build_graph.rules.registry import RULES
from build_graph.workspace import Target

DATA = Path(__file__).parent / "data"
B3 = Digester("blake3")
HOST = TargetOutput(Tree(), {"host_paths": ["/usr"], "host_tools": [["/usr/bin/sh", "sh", "0" * 64]]})
TOOLCHAIN = TargetOutput(Tree({"bin/nvcc": FileEntry("1" * 64, 10, True)}), {"host": HOST.info})
DRYRUN = (DATA / "nvcc13.0-dryrun-120a-121a.txt").read_bytes()


def _plan(kind: str, attrs: dict, plan_gen=None) -> TargetPlan:
    rule = RULES[kind]
    label = Label("p", "lib")
    ctx = RuleContext(
        label=label, attrs=rule.attrs(**attrs), file="targets/p.toml", table="lib", platform="x86_64",
        digester=B3, deps={Label("toolchains", "cuda-13.0"): TOOLCHAIN},
        sources=Tree({"k/k.cu": FileEntry("2" * 64, 100)}), pins=None, arch_sets=lambda v, _w: v,
        read=lambda e: DRYRUN, probe_host=lambda tools: (), rule_version=f"{kind}/{rule.version}",
        extra={"expanded": {"srcs": ["k/k.cu"]}})
    target = Target(label=label, kind=kind, attrs=ctx.attrs, file="targets/p.toml", table="lib")
    return TargetPlan(target, plan_gen(ctx) if plan_gen else rule.plan(ctx))


def _outcome(action, n: int) -> Outcome:
    """A made-up result holding every declared output (distinct digests per action)."""
    files = {o: FileEntry(f"{n:02d}{i:02d}".ljust(64, "a"), 1) for i, o in enumerate(action.outputs)}
    return Outcome(action, Tree(files), "executed")


def test_each_nvcc_step_runs_once_its_own_inputs_exist():
    plan = _plan("cuda_library", {"srcs": ["k/k.cu"], "archs": ["12.0a", "12.1a"]})
    ready = dict((a.name, (slot, a)) for slot, a in plan.start())
    slot, dryrun = ready.pop("dryrun k/*.cu")  # one dryrun for the directory's TUs
    ready.update((a.name, (s, a)) for s, a in plan.complete(slot, _outcome(dryrun, 0)))
    assert set(ready) == {"hostpp k/k.cu", "devpp k/k.cu 120a", "devpp k/k.cu 121a"}
    n = 1

    def finish(name):
        nonlocal n
        slot, action = ready.pop(name)
        n += 1
        new = plan.complete(slot, _outcome(action, n))
        ready.update((a.name, (s, a)) for s, a in new)
        return {a.name for _s, a in new}

    assert finish("hostpp k/k.cu") == {"cudafe k/k.cu"}
    assert finish("cudafe k/k.cu") == set()  # cicc also reads its arch's preprocessed text
    assert finish("devpp k/k.cu 121a") == {"cicc k/k.cu 121a"}
    # 12.1a's chain goes on while 12.0a's preprocessing and cicc are still running: no waves.
    assert finish("cicc k/k.cu 121a") == {"ptxas k/k.cu 121a", "hostcc k/k.cu"}
    assert finish("ptxas k/k.cu 121a") == set()
    assert finish("hostcc k/k.cu") == set()
    assert finish("devpp k/k.cu 120a") == {"cicc k/k.cu 120a"}
    assert finish("cicc k/k.cu 120a") == {"ptxas k/k.cu 120a"}
    assert finish("ptxas k/k.cu 120a") == {"fatbin k/k.cu"}
    assert finish("fatbin k/k.cu") == {"archive"}  # fatbinary's step ends in the TU's object
    slot, archive = ready.pop("archive")
    assert plan.complete(slot, _outcome(archive, 99)) == [] and plan.output is not None


def _flow_rule(steps):
    def gen(ctx):
        done = yield Dataflow(steps)
        return TargetOutput(Tree(), {"done": sorted(done)})
    return gen


def test_a_dataflow_cycle_or_unknown_need_is_a_plan_error():
    cyclic = {"a": (("b",), None), "b": (("a",), None)}
    with pytest.raises(PlanError, match="cycle"):
        _plan("genrule", {"cmd": "true", "outs": ["x"]}, _flow_rule(cyclic)).start()
    unknown = {"a": (("nothing",), None)}
    with pytest.raises(PlanError, match="no step makes"):
        _plan("genrule", {"cmd": "true", "outs": ["x"]}, _flow_rule(unknown)).start()


def test_an_empty_dataflow_resumes_at_once():
    plan = _plan("genrule", {"cmd": "true", "outs": ["x"]}, _flow_rule({}))
    assert plan.start() == [] and plan.output.info == {"done": []}


def test_a_source_is_a_file_exactly_when_pathlib_says_so(tmp_path):
    """expand_sources checks literal sources by string path (no Path per source): the same answer
    as `(root / path).is_file()` for a file, a directory, a missing path, a link, a link loop, a
    doubled or `.` component and a trailing slash (which pathlib drops)."""
    from build_graph.planner import _is_file

    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f.txt").write_text("x")
    (tmp_path / "link").symlink_to("d/f.txt")
    (tmp_path / "loop").symlink_to("loop")
    (tmp_path / "dangling").symlink_to("nowhere")
    for path in ["d/f.txt", "d", "d/", "d/f.txt/", "d//f.txt", "./d/f.txt", "d/./f.txt", "missing", "d/f.txt/x",
                 "link", "loop", "dangling", "", "."]:
        assert _is_file(str(tmp_path), path) == (tmp_path / path).is_file(), path


def test_a_listed_directory_answers_as_stat_does(tmp_path):
    """SourceFiles lists a directory asked about often and answers from the listing: the same
    answers as `_is_file` for every kind of entry, before and after the listing."""
    from build_graph.planner import SourceFiles, _is_file

    (tmp_path / "d" / "sub").mkdir(parents=True)
    for i in range(40):
        (tmp_path / "d" / f"f{i}.txt").write_text("x")
    (tmp_path / "d" / "link").symlink_to("f0.txt")
    (tmp_path / "d" / "dirlink").symlink_to("sub")
    (tmp_path / "d" / "dangling").symlink_to("nowhere")
    (tmp_path / "top.txt").write_text("x")
    paths = [f"d/f{i}.txt" for i in range(40)] + ["d/sub", "d/link", "d/dirlink", "d/dangling", "d/missing",
                                                  "d/", "d//f1.txt", "d/./f1.txt", "d/f1.txt/", "top.txt", "nope"]
    files = SourceFiles(tmp_path, None)
    for _ in range(2):  # the second round is answered from the listings
        for path in paths:
            assert files.is_file(path) == _is_file(str(tmp_path), path), path
    assert "d" in files._listed and "" not in files._listed  # the root was asked about twice only
    (tmp_path / "d" / "f1.txt").unlink()  # listed once per build: a build sees its start
    assert files.is_file("d/f1.txt") and not SourceFiles(tmp_path, None).is_file("d/f1.txt")


def test_a_glob_skips_the_cache_bgraph_out_and_pycache(make_ws):
    """What the no-op scan never stamps is never a globbed source: the build's cache where it lies
    in the workspace, bgraph-out/, __pycache__/ (a file named outright there is still read)."""
    from build_graph.planner import SourceFiles, expand_sources
    from build_graph.workspace import load

    ws = make_ws({"a/x.txt": "x\n", "a/__pycache__/y.txt": "y\n", "bgraph-out/p/z.txt": "z\n",
                  "cache/v1/state.txt": "s\n",
                  "targets/p.toml": '[g]\nkind = "genrule"\nsrcs = ["**/*.txt", "a/__pycache__/y.txt"]\n'
                                    'outs = ["o"]\ncmd = "true"\n'})
    loaded = load(ws.root)
    target = loaded.targets[Label("p", "g")]
    got = expand_sources(loaded, target, files=SourceFiles(loaded.root, loaded.root / "cache"))
    assert got == {"srcs": ["a/x.txt", "a/__pycache__/y.txt"]}
    # No cache named (a cache outside the workspace): only the fixed names are skipped.
    assert "cache/v1/state.txt" in expand_sources(loaded, target, SourceFiles(loaded.root, None))["srcs"]
