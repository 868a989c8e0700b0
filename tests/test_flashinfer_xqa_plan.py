"""Issue 37's XQA slice for the GPU check (//wheels:flashinfer-xqa-sm90), the CI part: its dry run
plans on an empty cache, for 9.0a, and waits on FlashInfer's generator (nothing is built).

With FLASHINFER_TEST_BGRAPH_CACHE naming a cache where //flashinfer:aot-xqa-sm90's generate action
ran, the dry run also plans every module, and its counts are checked against the generator's own
manifest: 16 XQA modules of 5 TUs each (test_xqa_counts_match_the_generator).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from bgraph_testlib import workspace_copy
from test_flashinfer_plan import bgraph, generator_manifest, planned_tus

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")

WHEEL, MODULES = "//wheels:flashinfer-xqa-sm90", "//flashinfer:aot-xqa-sm90"


@pytest.fixture(scope="module")
def ws(module_tmp) -> Path:
    return workspace_copy(module_tmp / "ws")


def test_xqa_wheel_plans_on_an_empty_cache(ws, tmp_path):
    """The wheel and its module set wait on the generator; the generator's inputs would be fetched."""
    run = bgraph(ws, tmp_path / "cache", "build", "--dry-run", "--json", WHEEL)
    assert run.returncode == 0, run.stderr[-3000:]
    plan = json.loads(run.stdout)
    assert plan["ok"] and plan["errors"] == [] and plan["executed"] == 0
    assert {WHEEL, MODULES} <= set(plan["targets_unplanned"]), plan["targets_unplanned"]
    fetches = {f"{a['label']} {a['name']}" for a in plan["actions"] if a["mnemonic"] == "Fetch"}
    assert "//vllm:torch-env fetch py-torch" in fetches and "//sources:flashinfer-sdist fetch flashinfer-sdist" in fetches
    assert "//flashinfer:gen-env fetch py-apache-tvm-ffi" in fetches


def test_xqa_counts_match_the_generator(ws):
    """Where the generator ran: exactly the 16 modules it kept (head dim 128, group ratio 8, pages 16
    and 64, no speculative decoding), each planned with the 5 TUs it listed."""
    cache = os.environ.get("FLASHINFER_TEST_BGRAPH_CACHE")
    if not cache:
        pytest.skip("FLASHINFER_TEST_BGRAPH_CACHE names no cache where the XQA set's generator ran")
    run = bgraph(ws, Path(cache), "build", "--dry-run", "--json", WHEEL)
    assert run.returncode == 0, run.stderr[-3000:]
    plan = json.loads(run.stdout)
    kept = generator_manifest(Path(cache), plan, MODULES)
    if kept is None:
        pytest.skip(f"the generator of {MODULES} has not run in {cache}")
    assert planned_tus(plan, MODULES) == kept
    assert len(kept) == 16 and set(kept.values()) == {5}
    for name in kept:
        assert name.startswith("xqa_input_") and "_head_dim_128_head_group_ratio_8_" in name, name
        assert name.endswith("_use_spec_dec_False_spec_q_seq_len_1") and ("_page_size_16_" in name or "_page_size_64_" in name)
