"""Golden action keys: a change of a key must be a deliberate, reviewed event (as BuildStream's
`*.expected` files make it). The rules' pure planners run on fixed inputs (no sandbox, no host
probe) and the keys of a genrule, a cuda_library per-arch step (from a recorded nvcc --dryrun)
and a wheel are compared with tests/data/golden_keys.json.

Regenerate after an intended change: BGRAPH_UPDATE_GOLDEN=1 python3 -m pytest tests/test_golden_keys.py
That run rewrites the file and still fails, naming the keys it changed (review `git diff
tests/data/golden_keys.json`); the next run, without the variable, passes. So a run with the
variable set never passes while the keys differ from the committed file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

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
    parallel = next(cuda)
    tu = parallel.plans[0]
    [dryrun] = next(tu)
    keys["cuda_library dryrun"] = dryrun.key(B3)
    steps = tu.send([Outcome(dryrun, Tree({"dryrun.txt": FileEntry("5" * 64, 1)}), "executed")])
    for action in steps:
        keys[f"cuda_library {action.name}"] = action.key(B3)

    wheel = RULES["py_wheel"].plan(_ctx("py_wheel", {"distribution": "golden", "version": "1.0",
                                                     "srcs": ["py/pkg/__init__.py"], "strip_prefix": "py"},
                                        {"//toolchains:host": HOST}, {}))
    keys["py_wheel"] = next(wheel)[0].key(B3)
    return keys


UPDATE_ENV = "BGRAPH_UPDATE_GOLDEN"


def key_changes(expected: dict[str, str], keys: dict[str, str]) -> dict[str, list[str | None]]:
    """name -> [golden, planned] for every key that differs, is new, or is gone."""
    return {k: [expected.get(k), keys.get(k)] for k in sorted(set(expected) | set(keys))
            if expected.get(k) != keys.get(k)}


def test_action_keys_match_the_golden_file():
    keys = planned_keys()
    expected = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
    changed = key_changes(expected, keys)
    if changed and os.environ.get(UPDATE_ENV):
        GOLDEN.write_text(json.dumps(keys, indent=1, sort_keys=True) + "\n")
        pytest.fail(f"{UPDATE_ENV} is set: rewrote {GOLDEN.relative_to(DATA.parent.parent)} with "
                    f"{len(changed)} changed key(s); review the diff, then run again without {UPDATE_ENV}: "
                    + json.dumps(changed, indent=1), pytrace=False)
    assert not changed, (f"action keys changed (if intended, regenerate with {UPDATE_ENV}=1, "
                         "review the diff, run again): " + json.dumps(changed, indent=1))
    assert keys == expected


def test_golden_file_covers_every_planned_step():
    """The golden file holds what the docstring promises (a regeneration from a planner that
    planned less would otherwise shrink it unnoticed): a genrule, the cuda_library dryrun, its
    host preprocessing and the device preprocessing of each of both archs, and a wheel."""
    golden = json.loads(GOLDEN.read_text())
    assert set(golden) == {"genrule", "cuda_library dryrun", "cuda_library hostpp k/k.cu",
                           "cuda_library devpp k/k.cu 1200", "cuda_library devpp k/k.cu 1210", "py_wheel"}
    assert len(set(golden.values())) == len(golden)
    assert all(len(v) == 64 and int(v, 16) >= 0 for v in golden.values())
