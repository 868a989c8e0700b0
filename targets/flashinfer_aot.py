"""FlashInfer's own AOT generator, stopped before it builds: `python -m flashinfer.aot` with its
build step replaced by writing each module's build.ninja (and sources) and one top build.ninja of
`subninja` lines. bgraph imports that graph (rules/ninja_generator.py); nothing here compiles.

    python3 flashinfer_aot.py --src ROOT [--modules GLOB,GLOB] [--extra FUNC,FUNC] [--skip FUNC,FUNC]
                              [--manifest FILE] -- AOT_ARGS...

ROOT is the FlashInfer source tree (its `flashinfer` package is imported from there without
running `flashinfer/__init__.py`, which imports the whole runtime); AOT_ARGS are
`python -m flashinfer.aot`'s own flags (`--build-dir` is where the ninja files go). --modules
keeps the modules whose names match one of the globs (default: all); --manifest writes every
module FlashInfer's enumeration gave, with its source count and whether it was kept. --extra adds
modules the enumeration does not offer for this arch list, by generator function (e.g.
gen_fp4_quantization_sm120f_module: on SM121 with CUDA >= 12.9 FlashInfer's FP4 quantization asks for
fp4_quantization_120f, which the enumeration offers only when the list holds 12.0f). --skip
replaces generator functions of the enumeration by a stub whose module is never kept (one that runs
a host program it builds, which a cross build cannot run).
"""

import argparse
import fnmatch
import sys
import types
from pathlib import Path


def main() -> None:
    """Run flashinfer.aot.main with its build step replaced by writing ninja files."""
    own = argparse.ArgumentParser()
    own.add_argument("--src", required=True, type=Path)
    own.add_argument("--modules", default="*")
    own.add_argument("--manifest", type=Path)
    own.add_argument("--extra", default="", help="generator functions of flashinfer.aot (comma-separated) "
                                                 "whose modules join the enumeration's, kept whatever --modules says")
    own.add_argument("--skip", default="", help="generator functions of flashinfer.aot (comma-separated) not "
                                                "to call: their modules are never kept (listed as 'skipped')")
    args, aot_args = own.parse_known_args()
    if aot_args[:1] == ["--"]:
        aot_args = aot_args[1:]
    # The package without its __init__ (which imports the runtime: cuDNN, CUTLASS DSL, ...).
    package = types.ModuleType("flashinfer")
    package.__path__ = [str(args.src / "flashinfer")]
    sys.modules["flashinfer"] = package
    from flashinfer import aot
    from flashinfer.jit import core

    # flashinfer.aot points csrc, include, CUTLASS and spdlog at the source tree but leaves CCCL
    # at flashinfer/data/cccl, which only a wheel build fills (FlashInfer issue #3159); without
    # it the toolkit's older CCCL is used, and CUDA 13.0's lacks cuda/__execution/determinism.h
    # (csrc/cub_topk.cu). The sdist's own 3rdparty/cccl, as the wheel would hold it:
    cccl = args.src / "3rdparty" / "cccl"
    core.jit_env.CCCL_INCLUDE_DIRS = [cccl / "cub", cccl / "libcudacxx" / "include", cccl / "thrust"]
    patterns = [p for p in args.modules.split(",") if p]

    # A generator that runs a host program (gen_trtllm_fmha_v2_sm120_module compiles and runs
    # print_traits with the build's nvcc) cannot run in a cross build, where that program is the
    # target CPU's: skipping it is the only way to enumerate the rest there, and saves its time here.
    skipped = set()
    for name in (n for n in args.skip.split(",") if n):
        if not callable(getattr(aot, name, None)):
            sys.exit(f"flashinfer_aot: flashinfer.aot has no generator function {name}")
        stub = types.SimpleNamespace(name=f"{name}()", sources=[])
        setattr(aot, name, lambda *a, _stub=stub, **k: _stub)
        skipped.add(stub.name)

    def write_ninja_files(specs, verbose=False, skip_prebuilt=True):
        extra = []
        for name in (n for n in args.extra.split(",") if n):
            if not callable(getattr(aot, name, None)):
                sys.exit(f"flashinfer_aot: flashinfer.aot has no generator function {name}")
            extra.append(getattr(aot, name)())
        specs = list(specs) + [e for e in extra if e.name not in {s.name for s in specs}]
        kept = [s for s in specs if s.name not in skipped and (any(fnmatch.fnmatchcase(s.name, p) for p in patterns)
                or s.name in {e.name for e in extra})]
        missing = [p for p in patterns if not any(fnmatch.fnmatchcase(s.name, p) for s in specs)]
        if missing:
            sys.exit(f"flashinfer_aot: no module matches {', '.join(missing)} "
                     f"(FlashInfer's enumeration for this arch list gave {len(specs)} modules)")
        if args.manifest:
            args.manifest.parent.mkdir(parents=True, exist_ok=True)
            args.manifest.write_text("".join(
                f"{s.name}\t{len(s.sources)}\t{'kept' if s in kept else 'skipped' if s.name in skipped else 'left'}\n"
                for s in sorted(specs, key=lambda s: s.name)))
        lines = ["ninja_required_version = 1.3"]
        for spec in sorted(kept, key=lambda s: s.name):
            if not isinstance(spec, core.JitSpecNvcc):
                sys.exit(f"flashinfer_aot: module {spec.name} is a {type(spec).__name__}, not an nvcc module")
            spec.write_ninja()
            lines.append(f"subninja {spec.ninja_path}")
        top = core.jit_env.FLASHINFER_WORKSPACE_DIR / "build.ninja"
        top.write_text("\n".join(lines) + "\n")

    aot.build_jit_specs = write_ninja_files
    aot.copy_built_kernels = lambda specs, out_dir: None
    sys.argv = ["flashinfer.aot", *aot_args]
    aot.main()


if __name__ == "__main__":
    main()
