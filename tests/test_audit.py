"""`bgraph audit` (audit.py, variants.py) and `bgraph why LABEL FILE` (provenance.py), with the real
nvcc 13.0, bubblewrap and GNU patch, on a small patched project: a header patched by two patches,
compiled by a cuda_library for 12.0a and 12.1a. The first patch's hunks are one of each kind:

  #1  K_SCALE 1 -> 2                        live for both archs and the host side
  #2  two comment lines                     dead (the preprocessed text moves lines only)
  #3  inside `#if __CUDA_ARCH__ == 1210`    live for 12.1a only
  #4  #define K_BIAS (the kernel uses it)   breaks the build without it

and the second patch edits #4's line (it applies only on top of #4: the two are left out together).

Also the legacy DGX Spark targets: their closure, the patches applying to vLLM 0.33.0 and CCCL,
the FP4 shim defining nothing with CUDA 13.0. The audit of the real vLLM wheel (hours) is slow.
"""

from __future__ import annotations

import difflib
import shutil

import pytest

from bgraph_testlib import WS, workspace_copy

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")

FILLER = "".join(f"// {i}\n" for i in range(1, 9))
HEADER = f"""#pragma once
// k.cuh: the constants and helpers of the kernels in k/
#define K_SCALE 1.0f
{FILLER}// Notes for the kernels' authors.
{FILLER}__device__ inline float k_tune(float x) {{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 1210
  return x;
#else
  return x;
#endif
}}
{FILLER}// end of k.cuh
"""
PATCHED = (HEADER.replace("#define K_SCALE 1.0f", "#define K_SCALE 2.0f")
           .replace("// Notes for the kernels' authors.\n",
                    "// Notes for the kernels' authors.\n// (the sm_121 notes moved to k/README)\n// keep it short\n")
           .replace("  return x;\n#else", "  return x * 0.5f;\n#else")
           .replace("// end of k.cuh", "#define K_BIAS 3.0f\n// end of k.cuh"))
BIASED = PATCHED.replace("#define K_BIAS 3.0f", "#define K_BIAS 4.0f")
KERNEL = """#include "k.cuh"
__global__ void scale(float* x) { x[0] = k_tune(x[0] * K_SCALE) + K_BIAS; }
#ifndef __CUDA_ARCH__
float host_scale() { return K_SCALE; }
#endif
"""
TARGETS = """# The header as a tree, patched, and compiled into a library through an ext mount.
[hdrs-orig]
kind = "genrule"
srcs = ["inc/k.cuh"]
outs = ["k.cuh"]
cmd = "cp $SRC/inc/k.cuh $OUT/k.cuh"

[hdrs]
kind = "patched_tree"
src = ":hdrs-orig"
patches = ["patches/t/*.patch"]

[lib]
kind = "cuda_library"
srcs = ["k/a.cu"]
ext = { hdr = ":hdrs" }
archs = ["12.0a", "12.1a"]
copts = ["-I/bgraph/ext/hdr"]

# The legacy toolchain's CCCL and FP4 shim at work on a TU that uses FP4 types.
[fp4]
kind = "cuda_library"
srcs = ["k/fp4.cu"]
archs = ["12.1a"]
toolchain = "//toolchains:cuda-13.0-legacy"

# A toolkit of its own: the toolchain's CCCL with a test patch and a shim header laid over it;
# b.cu and c.cu read the patched header (through <cuda/std/limits>), only b.cu uses what the
# second hunk defines, only c.cu asks for the shim (__has_include), d.cu reads no CCCL header.
[tk-shim]
kind = "genrule"
outs = ["tk_shim.h"]
cmd = "echo '#define TK_SHIM 1' > $OUT/tk_shim.h"

[cccl-t]
kind = "patched_tree"
src = "//toolchains:cccl"
patches = ["patches/tc/*.patch"]
add = { include = ":tk-shim" }

[tk]
kind = "cuda_toolchain"
version = "13.0.88"
wheels = ["cuda-nvcc-13-0", "cuda-nvvm-13-0", "cuda-crt-13-0", "cuda-cccl-13-0", "cuda-runtime-13-0"]
overlay = ":cccl-t"

[tk-user]
kind = "cuda_library"
srcs = ["k/b.cu", "k/c.cu", "k/d.cu"]
archs = ["12.1a"]
toolchain = ":tk"
"""
FP4_TU = """#include <nv_fp4_dummy.h>
#include <cuda/std/limits>
#if defined(NV_FP4_DUMMY)
#error "the shim defined FP4 types of its own although CUDA 13.0 has cuda_fp4.h"
#endif
__global__ void to_fp4(__nv_fp4_e2m1* out, const float* in) { out[0] = __nv_fp4_e2m1(in[0]); }
"""
P1, P2 = "patches/t/0001-k.patch", "patches/t/0002-bias.patch"
TK = "patches/tc/0001-version.patch"
VERSION_H = "include/cccl/cuda/std/__cccl/version.h"
TK_B = """#include <cuda/std/limits>
__global__ void b(float* x) {
#ifdef BGRAPH_TK_TUNE
  x[0] *= BGRAPH_TK_TUNE;
#endif
  x[0] += cuda::std::numeric_limits<float>::epsilon();
}
"""
TK_C = """#include <cuda/std/limits>
#if __has_include(<tk_shim.h>)
#define C_VAL 2
#else
#define C_VAL 1
#endif
__global__ void c(int* x) { x[0] = cuda::std::numeric_limits<int>::max() / C_VAL; }
"""
TK_D = """__global__ void d(int* x) { x[0] = 1; }
"""


def toolkit_patch(version_h: str) -> str:
    """Two hunks on CCCL's version.h: #1 a comment line (moves lines only), #2 a macro b.cu uses."""
    patched = (version_h.replace("// clang-format off\n", "// clang-format off\n// (patched for a test)\n")
               .replace("#define CCCL_PATCH_VERSION (CCCL_VERSION % 1000)\n",
                        "#define CCCL_PATCH_VERSION (CCCL_VERSION % 1000)\n#define BGRAPH_TK_TUNE 3\n"))
    assert patched.count("\n") == version_h.count("\n") + 2
    return "".join(difflib.unified_diff(version_h.splitlines(True), patched.splitlines(True),
                                        f"a/{VERSION_H}", f"b/{VERSION_H}"))


def diff(a: str, b: str) -> str:
    return "".join(difflib.unified_diff(a.splitlines(True), b.splitlines(True), "a/k.cuh", "b/k.cuh"))


@pytest.fixture(scope="module")
def ws(module_tmp) -> WS:
    ws = WS(workspace_copy(module_tmp / "ws"), module_tmp / "cache")
    ws.write({"inc/k.cuh": HEADER, "k/a.cu": KERNEL, "k/fp4.cu": FP4_TU, "targets/t.toml": TARGETS,
              P1: "The header's patch: one hunk of each kind.\n\n" + diff(HEADER, PATCHED), P2: diff(PATCHED, BIASED)})
    return ws


@pytest.fixture(scope="module")
def toolkit_report(ws) -> dict:
    built = ws.build("//toolchains:cccl")
    assert built.rc == 0, built.output
    version_h = (ws.root / "bgraph-out/toolchains/cccl" / VERSION_H).read_text()
    ws.write({"k/b.cu": TK_B, "k/c.cu": TK_C, "k/d.cu": TK_D, TK: toolkit_patch(version_h)})
    run = ws.cli("audit", "--json", "//t:tk-user", timeout=900)
    assert run.rc == 0, run.output
    return run.json


@pytest.fixture(scope="module")
def report(ws) -> dict:
    run = ws.cli("audit", "--json", "//t:lib", timeout=900)
    assert run.rc == 0, run.output
    return run.json


def hunk(report: dict, unit_id: str) -> dict:
    [found] = [u for p in report["patches"] for u in p["units"] if u["id"] == unit_id]
    return found


def test_what_moves_lines_only_and_the_verdicts():
    from build_graph.audit import code_lines, verdict

    a = b'# 1 "k.cuh"\n#pragma once\nint x;\n\n# 7 "k.cuh" 2\nint y;\n'
    b = b'# 1 "k.cuh"\n#pragma once\nint x;\n\n\n\n# 9 "k.cuh" 2\n#line 12\nint y;\n'
    assert code_lines(a) == code_lines(b) == [b"#pragma once", b"int x;", b"int y;"]
    assert code_lines(a) != code_lines(a.replace(b"int y", b"int z"))
    moved = {"change": "positions"}
    assert verdict([moved], [moved]) == "dead" and verdict([], []) == "dead"
    assert verdict([moved, {"change": "code"}], []) == "live" and verdict([], [{"change": "code"}]) == "live"
    assert verdict([{"change": "only without"}], []) == "live"


def test_one_hunk_of_each_kind(report):
    assert report["baseline"]["ok"] and report["hunks"] == 5
    live = hunk(report, f"{P1}#1")
    assert live["verdict"] == "live"
    assert live["tus"] == ["k/a.cu"] and live["archs"] == ["120a", "121a"] and live["host"] == ["k/a.cu"]
    assert {(c["tu"], c["arch"], c["change"]) for c in live["device_preprocessed"]} == {
        ("k/a.cu", "120a", "code"), ("k/a.cu", "121a", "code")}
    assert [c["change"] for c in live["host_preprocessed"]] == ["code"]
    assert {c["arch"] for c in live["cubins"]} == {"120a", "121a"}
    assert [c["tu"] for c in live["objects"]] == ["k/a.cu"]
    assert {f["path"] for f in live["outputs"]} == {"//t:lib:liblib.a", "//t:lib:obj/k_a.cu.o"}

    dead = hunk(report, f"{P1}#2")
    assert dead["verdict"] == "dead" and dead["archs"] == [] and dead["tus"] == [] and dead["outputs"] == []
    # The comment lines move what follows them: the preprocessed text differs in positions only.
    assert dead["device_preprocessed"] and all(c["change"] == "positions" for c in dead["device_preprocessed"])

    one_arch = hunk(report, f"{P1}#3")
    assert one_arch["verdict"] == "live" and one_arch["archs"] == ["121a"] and one_arch["host"] == []
    assert [(c["arch"], c["change"]) for c in one_arch["device_preprocessed"]] == [("121a", "code")]
    assert [c["arch"] for c in one_arch["cubins"]] == ["121a"] and [c["arch"] for c in one_arch["ptx"]] == ["121a"]

    breaks = hunk(report, f"{P1}#4")
    assert breaks["verdict"] == "breaks the build"
    assert 'identifier "K_BIAS" is undefined' in breaks["error"]


def test_hunks_that_only_apply_together_are_left_out_together(report):
    breaks = hunk(report, f"{P1}#4")
    assert breaks["group"] == [f"{P1}#4", f"{P2}#1"]  # 0002 edits the line #4 adds
    assert "applies only together with" in breaks["note"]
    # Left out alone, the second patch's hunk is an ordinary live one.
    second = hunk(report, f"{P2}#1")
    assert second["group"] == [f"{P2}#1"] and second["verdict"] == "live" and second["archs"] == ["120a", "121a"]


def test_a_variant_costs_what_its_hunk_touches_and_a_second_audit_nothing(ws, report):
    # #3 (sm_121a only) re-runs 121a's device steps, never 120a's: the rest comes from the cache.
    assert 0 < hunk(report, f"{P1}#3")["cost"]["executed"] < hunk(report, f"{P1}#1")["cost"]["executed"]
    again = ws.cli("audit", "--json", "//t:lib", timeout=600)
    assert again.rc == 0, again.output
    assert again.json["cost"]["executed"] == 0 and again.json["baseline"]["executed"] == 0
    assert [u["verdict"] for p in again.json["patches"] for u in p["units"]] == \
        [u["verdict"] for p in report["patches"] for u in p["units"]]
    # The variants keep traces of their own: the ordinary build is still a no-op.
    build = ws.build("//t:lib")
    assert build.rc == 0 and build.json["executed"] == 0


def test_a_toolkit_hunk_costs_the_preprocessing_it_reaches(toolkit_report):
    """A hunk in a toolkit header re-runs the preprocessing of the TUs that read the header (b.cu,
    c.cu; not d.cu), not their compile steps where those would do the baseline's work again: cicc,
    ptxas, cudafe++, host compile come from the baseline, one of each kind runs as the check."""
    moved = hunk(toolkit_report, f"{TK}#1")
    assert moved["verdict"] == "dead" and moved["tus"] == [] and moved["outputs"] == []
    assert all(c["change"] == "positions" for c in moved["device_preprocessed"] + moved["host_preprocessed"])
    steps = moved["cost"]["steps"]
    assert steps.get("CudaDevicePreprocess") == 2 and steps.get("CudaHostPreprocess") == 2, steps
    for step in ("CudaCicc", "CudaPtxas", "CudaFrontend", "CudaHostCompile", "CudaFatbinary"):
        assert steps.get(step, 0) <= 1, steps  # at most the sample; before the cutoff: 2 of each
    assert moved["cost"]["substituted"] >= 5, moved["cost"]
    assert moved["cost"]["unread"] == 2, moved["cost"]  # d.cu's preprocessing: its depfiles name no CCCL file
    samples = moved["cost"]["samples"]  # one of each kind taken from the baseline ran, and agreed
    assert {s["mnemonic"] for s in samples} >= {"CudaCicc", "CudaPtxas", "CudaHostCompile"}
    assert all(s["same"] for s in samples), samples

    live = hunk(toolkit_report, f"{TK}#2")  # a live hunk in a header every TU reads is still built
    assert live["verdict"] == "live" and live["tus"] == ["k/b.cu"] and live["archs"] == ["121a"]
    assert [c["tu"] for c in live["cubins"]] == ["k/b.cu"] and [c["tu"] for c in live["objects"]] == ["k/b.cu"]
    assert {f["path"] for f in live["outputs"]} == {"//t:tk-user:libtk-user.a", "//t:tk-user:obj/k_b.cu.o"}
    assert live["cost"]["steps"].get("CudaCicc", 0) >= 1 and live["cost"]["substituted"] >= 1


def test_a_header_the_toolkit_adds_reaches_only_the_tus_that_name_it(toolkit_report):
    """No depfile names a header found by `__has_include`: a TU that mentions the added header's
    name is preprocessed again (c.cu, live), the others' preprocessing comes from the baseline."""
    shim = hunk(toolkit_report, "//t:cccl-t add include")
    assert shim["verdict"] == "live" and shim["tus"] == ["k/c.cu"], shim
    steps = shim["cost"]["steps"]
    assert steps.get("CudaDevicePreprocess") == 1 and steps.get("CudaHostPreprocess") == 1, steps
    assert shim["cost"]["unread"] == 4, shim["cost"]


def test_the_cutoff_agrees_with_building_every_step(ws, toolkit_report):
    """The same audit with every step built: the same verdicts, TUs, archs and output files."""
    from build_graph.audit import Audit, AuditOptions
    from build_graph.labels import parse_label

    full = Audit(ws.load(), ws.cache, parse_label("//t:tk-user"), AuditOptions(cutoff=False)).run()
    keys = ("verdict", "tus", "archs", "host", "outputs")
    assert [{k: u[k] for k in keys} for p in full["patches"] for u in p["units"]] == \
        [{k: u[k] for k in keys} for p in toolkit_report["patches"] for u in p["units"]]
    # Without it every TU's cicc runs (less the sample the first audit ran and filed).
    sampled = sum(s["ran"] for s in hunk(toolkit_report, f"{TK}#1")["cost"]["samples"] if s["mnemonic"] == "CudaCicc")
    assert hunk(full, f"{TK}#1")["cost"]["steps"]["CudaCicc"] == 3 - sampled
    assert full["cost"]["substituted"] == 0


def test_text_report_has_one_line_per_patch_then_its_hunks(ws, report):
    run = ws.cli("audit", "//t:lib", "--only", f"{P1}*", timeout=600)
    assert run.rc == 0, run.output
    lines = run.stdout.splitlines()
    assert lines[0].startswith("audit //t:lib: 4 hunk(s) in 1 patch(es)")
    assert lines[1] == f"{P1} (//t:hdrs): 2 live, 1 dead, 1 breaks the build"
    text = run.stdout
    assert "#1 k.cuh @@ -1,6 +1,6 @@ (+1 -1): live: TUs k/a.cu; archs 120a, 121a; host code of k/a.cu" in text
    assert "#2 k.cuh @@ -10,6 +10,8 @@ (+2 -0): dead (moves lines only" in text
    assert "#3 k.cuh @@ -20,7 +22,7 @@ (+1 -1): live: TUs k/a.cu; archs 121a\n" in text
    assert '#4 k.cuh @@ -33,4 +35,5 @@ (+1 -0): breaks the build: /bgraph/src/k/a.cu(2): error: identifier "K_BIAS"' in text


def test_why_reaches_down_to_tu_and_arch(ws, report):
    run = ws.cli("why", "--json", "//t:lib", P1)
    assert run.rc == 0, run.output
    reads = {(r["target"], r["tu"], r["arch"], r["file"], r["provider"]) for r in run.json["reads"] if r["narrowed"]}
    assert reads == {("//t:lib", "k/a.cu", arch, "k.cuh", "//t:hdrs") for arch in ("120a", "121a", None)}
    # The patch application reads the patch (it mounts the patches whole: not narrowed).
    assert [(r["target"], r["action"], r["file"]) for r in run.json["reads"] if not r["narrowed"]] == \
        [("//t:hdrs", "apply patches", P1)]
    text = ws.cli("why", "//t:lib", P1).stdout
    assert ("//t:lib reaches patches/t/0001-k.patch (//t:hdrs) through 2 target(s), 1 TU(s), 4 action read(s) "
            "(1 not narrowed" in text), text
    for line in ("TU k/a.cu", "arch 121a (devpp)", "arch 120a (devpp)", "host (hostpp)",
                 "k.cuh <- patches/t/0001-k.patch, applied by //t:hdrs",
                 "//t:hdrs\n    └── apply patches\n        └── patches/t/0001-k.patch <- from //t:hdrs (reads all of "
                 "/bgraph/src, not narrowed)"):
        assert line in text, text
    # A workspace file read by the TU, and a label as before.
    assert "k/a.cu <- from //t:lib" in ws.cli("why", "//t:lib", "k/a.cu").stdout
    assert ws.cli("why", "//t:lib", "//t:hdrs").stdout.startswith("//t:lib depends on //t:hdrs through 1 path(s)")
    missing = ws.cli("why", "//t:lib", "inc/nothing.h")
    assert missing.rc == 1 and "reaches no action that read inc/nothing.h" in missing.stdout


def test_a_hunk_that_breaks_the_build_when_present(ws, report, module_tmp):
    """Where LABEL fails with every hunk, a hunk it builds without is the one that breaks it."""
    broken = WS(module_tmp / "broken", ws.cache)
    shutil.copytree(ws.root, broken.root, ignore=shutil.ignore_patterns("bgraph-out"))
    broken.write({"patches/t/0003-wip.patch": diff(BIASED, BIASED.replace("// end of k.cuh", "#error unfinished\n// end of k.cuh"))})
    run = broken.cli("audit", "--json", "//t:lib", "--only", "patches/t/0003*", timeout=600)
    assert run.rc == 1, run.output  # the baseline fails
    assert run.json["baseline"]["ok"] is False and "unfinished" in run.json["baseline"]["error"]
    [wip] = [u for p in run.json["patches"] for u in p["units"]]
    assert wip["verdict"] == "breaks the build" and wip["note"] == "//t:lib fails with it and builds without it"
    # The traces are the cache's (per label): the other workspace's last build of //t:hdrs is now
    # the one `why` would see; building this workspace's again makes it this one's.
    assert ws.build("//t:lib").rc == 0


def test_the_legacy_wheel_depends_on_the_shim_and_the_patched_cccl(ws):
    run = ws.cli("query", "deps(//wheels:vllm-sm121-legacy)")
    assert run.rc == 0, run.output
    labels = run.stdout.split()
    for label in ("//toolchains:fp4-shim", "//toolchains:cccl-patched", "//vllm:cuda-toolkit-legacy",
                  "//vllm:build-sm121-legacy", "//sources:vllm-legacy-patched"):
        assert label in labels
    path = ws.cli("why", "//wheels:vllm-sm121-legacy", "//toolchains:fp4-shim").stdout
    assert "//toolchains:cccl-patched" in path and "//vllm:cuda-toolkit-legacy" in path


def test_the_legacy_patches_apply_and_the_shim_is_inert_with_cuda_13(ws):
    run = ws.build("//sources:vllm-legacy-patched", "//toolchains:cccl-patched", "//t:fp4")
    assert run.rc == 0, run.output
    cccl = ws.root / "bgraph-out" / "toolchains" / "cccl-patched"
    assert (cccl / "include" / "nv_fp4_dummy.h").read_text().startswith("// nv_fp4_dummy.h")
    assert "_CCCL_NVFP4_FROM_SHIM" in (cccl / "include/cccl/cuda/std/__floating_point/nvfp_types.h").read_text()
    vllm = ws.root / "bgraph-out" / "sources" / "vllm-legacy-patched"
    utils = (vllm / "csrc/quantization/fp4/nvfp4_utils.cuh").read_text()
    assert utils.count("#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 1210") == 4
    assert '"7.5;8.0;8.6;8.7;8.9;9.0;10.0;11.0;12.0;12.1"' in (vllm / "CMakeLists.txt").read_text()
    # `why` follows the CCCL patch into the toolkit the TU compiled with, and the shim to where it was added.
    why = ws.cli("why", "--json", "//t:fp4", "patches/legacy-dgx/cccl/0001-nvfp4-types-from-shim.patch")
    assert why.rc == 0, why.output
    reads = {(r["file"], r["arch"], r["provider"]) for r in why.json["reads"]}
    assert ("include/cccl/cuda/std/__floating_point/nvfp_types.h", "121a", "//toolchains:cccl-patched") in reads
    assert ("include/cccl/cuda/std/__cccl/extended_data_types.h", None, "//toolchains:cccl-patched") in reads
    shim = ws.cli("why", "//t:fp4", "include/nv_fp4_dummy.h").stdout
    assert "include/nv_fp4_dummy.h <- //toolchains:fp4-shim, added by //toolchains:cccl-patched" in shim


@pytest.mark.slow
def test_audit_of_the_legacy_vllm_wheel_agrees_with_domain(ws):
    """DOMAIN.md's verdicts, measured. About two hours on 2 cores: the baseline (a cold build of
    the legacy wheel, whose toolkit no other build shares) and legacy 0001's variant (every TU for
    12.0f) are each a whole vLLM build; the CCCL hunks and the shim cost their preprocessing."""
    run = ws.cli("audit", "--json", "//wheels:vllm-sm121-legacy", timeout=86400)
    assert run.rc == 0, run.output
    report = run.json
    e2m1 = "patches/legacy-dgx/vllm/0003-nvfp4-software-e2m1-sm121.patch"
    for i in (2, 3, 4):  # the functions' software paths: live for 12.1a, in vLLM's FP4 TUs
        u = hunk(report, f"{e2m1}#{i}")
        assert u["verdict"] == "live" and u["archs"] == ["121a"] and u["host"] == []
        assert any("nvfp4_quant_kernels.cu" in tu for tu in u["tus"])
    assert hunk(report, f"{e2m1}#1")["verdict"] == "breaks the build"  # the helper the others call
    archs = hunk(report, "patches/legacy-dgx/vllm/0001-cuda-supported-archs-add-12.1.patch#1")
    assert archs["verdict"] == "live"  # without 12.1 supported, every TU builds 12.0f instead of 12.1a
    # Measured on the whole wheel (BENCHMARKS.md): the generic kernels fall back to plain 12.0,
    # the family-gated ones to 12.0f.
    assert archs["archs_only_with"] == ["121a"] and archs["archs_only_without"] == ["120", "120f"]
    for u in [u for p in report["patches"] for u in p["units"]]:
        if "arch-lists" in u["id"] or "cccl" in u["id"] or u["id"].endswith(" add include"):
            assert u["verdict"] == "dead", u  # 12.1f beside 12.0f, the 12.8 branch, the CCCL patch, the shim
        if "cccl" in u["id"]:  # the compile steps come from the baseline (one sample of each kind runs)
            assert u["cost"]["steps"].get("CudaCicc", 0) <= 1 and all(s["same"] for s in u["cost"]["samples"]
                                                                      if s["inputs"] == "toolkit"), u["cost"]

    # For 12.0f the software E2M1 is dead: `__CUDA_ARCH__ == 1210` never holds.
    run = ws.cli("audit", "--json", "//vllm:smoke-fp4-sm12x-legacy", "--only", e2m1, timeout=86400)
    assert run.rc == 0, run.output
    assert [u["verdict"] for p in run.json["patches"] for u in p["units"]] == ["dead"] * 4


def test_a_dependency_the_unit_removes_is_not_a_change_by_itself(tmp_path):
    """Leaving out an `add include` drops the added tree's target from the build: its own actions
    exist in one build only, which alone must not make the unit live (the FP4 shim came out live
    on vLLM's FP4 TUs although no TU changed); a TU that compiles differently still does."""
    from build_graph.audit import Comparer, Snapshot, verdict
    from build_graph.store.cas import LocalCas
    from build_graph.model import Digester

    cas = LocalCas(tmp_path / "cache", Digester("blake3"))
    compile_ = ("//t:lib", "cicc k/a.cu.o 121a")
    base = Snapshot(True, [], {("//toolchains:fp4-shim", "genrule"): ("Genrule", "d1"), compile_: ("CudaCicc", "p1")},
                    {})
    same = Snapshot(True, [], {compile_: ("CudaCicc", "p1")}, {})
    changes, files = Comparer(cas).compare(base, same, {"//toolchains:cccl-patched"})
    assert changes == [] and verdict(changes, files) == "dead"
    other = Snapshot(True, [], {compile_: ("CudaCicc", "p2")}, {})
    changes, files = Comparer(cas).compare(base, other, {"//toolchains:cccl-patched"})
    assert [c["label"] for c in changes] == ["//t:lib"] and verdict(changes, files) == "live"


def test_the_cutoff_matches_each_step_to_the_baseline_step_that_read_the_same_input():
    """vLLM has sm80_kernel_*.cu both in marlin/ and in moe/marlin_moe_wna16/: their ptxas steps
    have one command (file names, no directories), so one shape. Each variant step is matched to
    the baseline step with its own input (the first run kept one per shape: 21 ptxas re-ran)."""
    from build_graph.audit_cutoff import Cutoff, Recorder
    from build_graph.model import Action, ActionResult, Digester, FileEntry, Tree
    from build_graph.rebuilder import Hit, Miss
    from build_graph.rules.base import TOOLCHAIN

    digester = Digester("blake3")

    class Cache:  # the rebuilder the audit wraps: a hit for the baseline's keys only
        def __init__(self):
            self.hits = {}

        def check(self, action, recorded):
            return self.hits.get(action.key(digester), Miss("new"))

    def ptxas(ptx: str, toolkit: Tree) -> Action:
        return Action(name=f"ptxas {ptx}", mnemonic="CudaPtxas", argv=("ptxas", "/bgraph/in/k.ptx"),
                      inputs=(("/bgraph/in", Tree({"k.ptx": FileEntry(ptx, 1)})), (TOOLCHAIN, toolkit)),
                      outputs=("k.cubin",), toolchain=toolkit.digest(digester))

    toolkit = Tree({"bin/ptxas": FileEntry("p" * 64, 1), "include/cccl/a.h": FileEntry("a" * 64, 1)})
    patched = Tree({"bin/ptxas": FileEntry("p" * 64, 1), "include/cccl/a.h": FileEntry("b" * 64, 1)})
    cache, base = Cache(), Recorder(None, digester)
    base.inner = cache
    hits = {}
    for ptx in ("1" * 64, "2" * 64):
        action = ptxas(ptx, toolkit)
        hits[ptx] = cache.hits[action.key(digester)] = Hit(ActionResult(ptx, 0, "", "", 1.0), Tree(), action.name)
        assert base.check(action, lambda: None) is hits[ptx]
    cutoff = Cutoff(Cache(), digester, base.outcomes, lambda a, b: False, lambda e: b"")
    for ptx in ("1" * 64, "2" * 64):
        assert cutoff.check(ptxas(ptx, patched), lambda: None) is hits[ptx]
    assert isinstance(cutoff.check(ptxas("3" * 64, patched), lambda: None), Miss)  # other work: runs
    outside = Tree({**patched.entries, "bin/ptxas": FileEntry("q" * 64, 1)})  # not a header: runs
    assert isinstance(cutoff.check(ptxas("1" * 64, outside), lambda: None), Miss)
