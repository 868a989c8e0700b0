"""The in-image probe both image checks run (bench/image_x86_check.py, bench/image_aarch64_check.py),
in the image's own CPython: the imports, vLLM's extension libraries into torch, FlashInfer's AOT
modules through tvm_ffi (FlashInfer's own loader), and what was found, as one JSON line."""

from __future__ import annotations

_PROBE = r'''
import json, os, pathlib, platform, sys, time
t = time.monotonic()
import torch, flashinfer, vllm, tvm_ffi
imported = round(time.monotonic() - t, 1)
vdir = pathlib.Path(vllm.__file__).parent
vlibs = sorted(p.name for p in vdir.glob(VLLM_GLOB))
for name in vlibs:
    torch.ops.load_library(str(vdir / name))
aot = pathlib.Path(flashinfer.__file__).parent / "data" / "aot"
fmods = sorted(d.name for d in aot.iterdir() if (d / f"{d.name}.so").exists()) if aot.is_dir() else []
for name in fmods:
    tvm_ffi.load_module(str(aot / name / f"{name}.so"))
print(json.dumps({"python": sys.version.split()[0], "machine": platform.machine(),
                  "torch": torch.__version__, "cuda_available": torch.cuda.is_available(),
                  "flashinfer": flashinfer.__version__, "flashinfer_jit_disabled": os.environ.get("FLASHINFER_DISABLE_JIT"),
                  "vllm": vllm.__version__, "vllm_libraries": vlibs,
                  "scaled_fp4_quant": hasattr(torch.ops._C, "scaled_fp4_quant"),
                  "flashinfer_aot_modules": len(fmods), "import_s": imported,
                  "site": str(pathlib.Path(torch.__file__).parent.parent),
                  "module_files": sorted({m.__file__ for m in list(sys.modules.values())
                                          if isinstance(getattr(m, "__file__", None), str)}),
                  "mapped": sorted({line.split(None, 5)[5].strip() for line in open("/proc/self/maps")
                                    if len(line.split(None, 5)) == 6 and ".so" in line})}))
'''


def probe_script(vllm_glob: str) -> str:
    """The probe's Python source; `vllm_glob` picks vLLM's libraries to load (in vLLM's package)."""
    return _PROBE.replace("VLLM_GLOB", repr(vllm_glob))
