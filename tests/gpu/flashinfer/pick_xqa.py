"""Picks a sample of FlashInfer's XQA tests: those whose module is in the installed wheel, and a few
whose module is not (to show them skipped as missing).

    python3 pick_xqa.py IDS_OUT N_BUILT N_MISSING TEST_FILE...

Run on the GPU machine from the tests' root (it collects them: test_xqa.py reads the GPU at import).
The module a test needs is named by FlashInfer's own gen_xqa_module from the test's parameters, so
the choice does not hand-copy FlashInfer's naming; "built" means flashinfer/data/aot/<name>/ exists
in the installed package. Writes the chosen node ids to IDS_OUT and, beside it, IDS_OUT.tsv (node id,
module, built or missing).
"""

import sys
from pathlib import Path

import pytest
import torch


def xqa_module(name, p):
    """The XQA module name a parametrized XQA test needs, or None if it is not a plain XQA decode."""
    from flashinfer.jit.xqa import gen_xqa_module
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float8_e4m3fn}
    try:
        if name == "test_xqa":
            q = p["input_type"]
            kv = torch.float8_e4m3fn if p["fp8_kv_cache"] else q
            out = torch.float8_e4m3fn if p["use_fp8_output"] else q
            return gen_xqa_module(q, kv, p["tokens_per_page"], p["valid_elems_per_head"], p["head_grp_size"],
                                  p["use_sliding_window"], out).name
        if name == "test_xqa_batch_decode":
            if p["q_len_per_req"] == 1 and p["spec_dec_mask_mode"] == "full":
                return None  # the test skips itself (no mask at one query token)
            xqa = gen_xqa_module(dtypes[p["q_dtype"]], dtypes[p["kv_dtype"]], p["page_size"], p["head_dim"],
                                 p["head_grp_size"], p["window_left"] >= 0, dtypes[p["o_dtype"]],
                                 p["q_len_per_req"]).name
            # Without sinks its reference is FlashInfer's own paged decode/prefill wrapper: a second
            # module, never in an XQA-only wheel.
            return xqa if p["enable_sink"] else f"{xqa} + the reference's paged attention module"
    except (ValueError, KeyError) as e:  # a configuration gen_xqa_module refuses: no module can exist
        return f"(none: {e})"
    return None


def spaced(items, n):
    """Up to n items, evenly spaced over the list (every kind of parameter gets its turn)."""
    if len(items) <= n:
        return list(items)
    return [items[round(i * (len(items) - 1) / (n - 1))] for i in range(n)] if n > 1 else items[:n]


class Collector:
    """A pytest plugin keeping the collected items."""

    def __init__(self):
        self.items = []

    def pytest_collection_modifyitems(self, items):
        self.items = list(items)


def main():
    """Collect, classify each XQA test by its module's presence, write the sample."""
    if len(sys.argv) < 5:
        sys.exit("usage: pick_xqa.py IDS_OUT N_BUILT N_MISSING TEST_FILE...")
    out, n_built, n_missing, files = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
    import flashinfer
    aot = Path(flashinfer.__file__).parent / "data" / "aot"
    built_names = {d.name for d in aot.iterdir()} if aot.is_dir() else set()
    collector = Collector()
    code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *files], plugins=[collector])
    if code not in (0, 5):
        sys.exit(f"pick_xqa: collection failed (pytest exit {code})")
    built, missing = {}, {}
    for item in collector.items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        module = xqa_module(item.originalname, params)
        if module is None:
            continue
        (built if module in built_names else missing).setdefault(item.originalname, []).append((item.nodeid, module))
    chosen = []
    for fn in sorted(set(built) | set(missing)):
        print(f"{fn}: {len(built.get(fn, []))} with a built module, {len(missing.get(fn, []))} without", flush=True)
        chosen += [(i, m, "built") for i, m in spaced(built.get(fn, []), n_built)]
        chosen += [(i, m, "missing") for i, m in spaced(missing.get(fn, []), n_missing)]
    out.write_text("".join(f"{i}\n" for i, _, _ in chosen))
    Path(f"{out}.tsv").write_text("".join(f"{i}\t{m}\t{k}\n" for i, m, k in chosen))
    print(f"picked {len(chosen)} tests into {out}")


if __name__ == "__main__":
    main()
