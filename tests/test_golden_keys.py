"""Golden action keys: a change of a key must be a deliberate, reviewed event (as BuildStream's
`*.expected` files make it). The rules' pure planners run on fixed inputs (no sandbox, no host
probe) and the keys of a genrule, a cuda_library per-arch step (from a recorded nvcc --dryrun)
and a wheel are compared with tests/data/golden_keys.json.

Regenerate after an intended change with one command, then review `git diff tests/data/golden_keys.json`:
    python3 tests/test_golden_keys.py
The test itself only compares: no setting makes it write the file, so it cannot pass while the
planned keys differ from the committed ones (an update variable would also be dropped: conftest
removes every BGRAPH_* variable from the session).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from build_graph.labels import Label
from build_graph.model import Digester, FileEntry, Outcome, TargetOutput, Tree
from build_graph.rules.base import RuleContext
from build_graph.rules.registry import RULES

DATA = Path(__file__).parent / "data"
GOLDEN = DATA / "golden_keys.json"
B3 = Digester("blake3")
HOST = TargetOutput(Tree(), {"host_paths": ["/usr"], "host_tools": [["/usr/bin/sh", "sh (golden)", "0" * 64]]})
TOOLCHAIN = TargetOutput(Tree({"bin/nvcc": FileEntry("1" * 64, 10, True)}), {"host": HOST.info})
SOURCES = Tree({"k/k.cu": FileEntry("2" * 64, 100), "k/k.cuh": FileEntry("3" * 64, 50),
                "py/pkg/__init__.py": FileEntry("4" * 64, 20)})
BLOBS = {"dryrun": (DATA / "nvcc13.0-dryrun-120a-121a.txt").read_bytes()}


def _ctx(kind: str, attrs: dict, deps: dict[str, TargetOutput], expanded: dict) -> RuleContext:
    rule = RULES[kind]
    return RuleContext(
        label=Label("golden", kind), attrs=rule.attrs(**attrs), file="targets/golden.toml", table=kind,
        platform="x86_64", digester=B3, deps={Label(*k[2:].split(":")): v for k, v in deps.items()},
        sources=SOURCES, pins=None, arch_sets=lambda value, _where: value, read=lambda e: BLOBS["dryrun"],
        probe_host=lambda tools: (), rule_version=f"{kind}/{rule.version}", extra={"expanded": expanded})


def planned_keys() -> dict[str, str]:
    keys = {}
    genrule = RULES["genrule"].plan(_ctx("genrule", {"cmd": "cp $SRC/k/k.cu $OUT/x", "outs": ["x"],
                                                     "srcs": ["k/k.cu"]}, {"//toolchains:host": HOST}, {}))
    keys["genrule"] = next(genrule)[0].key(B3)

    cuda = RULES["cuda_library"].plan(_ctx("cuda_library", {"srcs": ["k/k.cu"], "hdrs": ["k/k.cuh"],
                                                            "archs": ["12.0a", "12.1a"], "copts": ["-O2"]},
                                           {"//toolchains:cuda-13.0": TOOLCHAIN},
                                           {"srcs": ["k/k.cu"], "hdrs": ["k/k.cuh"]}))
    [dryrun] = next(cuda)  # one dryrun for the directory's TUs (placeholder names)
    keys["cuda_library dryrun"] = dryrun.key(B3)
    parallel = cuda.send([Outcome(dryrun, Tree({"dryrun.txt": FileEntry("5" * 64, 1)}), "executed")])
    tu = parallel.plans[0]
    flow = next(tu)
    # The steps that need no other step's output (the preprocessing ones): a Dataflow's first actions.
    steps = [make({}) for needs, make in flow.steps.values() if not needs]
    for action in steps:
        keys[f"cuda_library {action.name}"] = action.key(B3)

    wheel = RULES["py_wheel"].plan(_ctx("py_wheel", {"distribution": "golden", "version": "1.0",
                                                     "srcs": ["py/pkg/__init__.py"], "strip_prefix": "py"},
                                        {"//toolchains:host": HOST}, {}))
    keys["py_wheel"] = next(wheel)[0].key(B3)
    return keys


REGENERATE = "python3 tests/test_golden_keys.py"


def key_changes(expected: dict[str, str], keys: dict[str, str]) -> dict[str, list[str | None]]:
    """name -> [golden, planned] for every key that differs, is new, or is gone."""
    return {k: [expected.get(k), keys.get(k)] for k in sorted(set(expected) | set(keys))
            if expected.get(k) != keys.get(k)}


def golden_text(keys: dict[str, str]) -> str:
    return json.dumps(keys, indent=1, sort_keys=True) + "\n"


def test_action_keys_match_the_golden_file():
    keys = planned_keys()
    expected = json.loads(GOLDEN.read_text())
    changed = key_changes(expected, keys)
    assert not changed, (f"action keys changed (if intended, regenerate with `{REGENERATE}` and review the "
                         "diff): " + json.dumps(changed, indent=1))
    assert golden_text(keys) == GOLDEN.read_text()


def test_the_regeneration_command_writes_exactly_the_committed_file(tmp_path):
    out = tmp_path / "golden_keys.json"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}  # this checkout's bgraph
    proc = subprocess.run([sys.executable, str(Path(__file__)), str(out)], capture_output=True, text=True,
                          cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    assert out.read_text() == GOLDEN.read_text()
    assert "0 key(s) changed" in proc.stdout


def test_golden_file_covers_every_planned_step():
    """The golden file holds what the docstring promises (a regeneration from a planner that
    planned less would otherwise shrink it unnoticed): a genrule, the cuda_library dryrun, its
    host preprocessing and the device preprocessing of each of both archs, and a wheel."""
    golden = json.loads(GOLDEN.read_text())
    assert set(golden) == {"genrule", "cuda_library dryrun", "cuda_library hostpp k/k.cu",
                           "cuda_library devpp k/k.cu 120a", "cuda_library devpp k/k.cu 121a", "py_wheel"}
    assert len(set(golden.values())) == len(golden)
    assert all(len(v) == 64 and int(v, 16) >= 0 for v in golden.values())


def main(argv: list[str]) -> int:
    """Rewrite the golden file (or the path given) from the planners; print what changed."""
    out = Path(argv[0]) if argv else GOLDEN
    keys = planned_keys()
    changed = key_changes(json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}, keys)
    out.write_text(golden_text(keys))
    print(f"wrote {out}: {len(changed)} key(s) changed" + (":\n" + json.dumps(changed, indent=1) if changed else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
