#!/usr/bin/env python3
"""Check a built vLLM wheel the way a user would use it (issue 9, item 6), and print the figures
BENCHMARKS.md records: the wheel's sha256, its extension libraries and their cubins.

1. a fresh venv with torch 2.14.0 (from the package index pip is configured with);
   `pip install --no-deps` of the wheel; `import vllm` and its version;
2. every extension library loads into torch and `torch.ops._C` holds `scaled_fp4_quant`. This
   machine has no GPU and so no driver: the libraries link libcuda.so.1, so a stand-in that
   defines the driver functions they import (each returning CUDA_ERROR_UNKNOWN) is put on
   LD_LIBRARY_PATH; nothing calls them;
3. `cuobjdump -elf` (bgraph's //toolchains:cuobjdump) of each library: the cubin archs, from the
   ELF headers (`--list-elf` names a 12.0f family cubin like a plain sm_120 one).

With `--platform aarch64` (the Spark's wheel, cross-built here) the same checks run under emulation,
all from bgraph's pinned targets: the aarch64 CPython 3.11 of //toolchains:target-python under
qemu-aarch64-static (//toolchains:qemu-user), its pip installing the wheel next to the aarch64 torch
environment (//vllm:torch-env for aarch64), the aarch64 driver stub (//vllm:cuda-driver-stub) on
LD_LIBRARY_PATH, and every ELF file in the wheel checked to be AArch64.

Usage: python3 bench/vllm_wheel_check.py [--wheel-label //wheels:vllm-sm121] [--platform aarch64]
       [--venv DIR] [--expect sm_121a] [--refuse sm_120a]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from vllm_own import bgraph_outputs  # noqa: E402  (builds in a copy of the workspace: no bgraph-out/ in the checkout)


def sh(argv, **kw) -> str:
    proc = subprocess.run([str(a) for a in argv], capture_output=True, text=True, **kw)
    if proc.returncode != 0:
        sys.exit(f"FAILED: {' '.join(map(str, argv))}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc.stdout


def fake_driver(libs: list[Path], work: Path) -> Path:
    """A libcuda.so.1 defining every cu* function the libraries import (returns 999)."""
    names = set()
    for lib in libs:
        for line in sh(["nm", "-D", "--undefined-only", lib]).splitlines():
            sym = line.split()[-1].split("@")[0]
            if re.fullmatch(r"cu[A-Z]\w*", sym):
                names.add(sym)
    src = work / "fakecuda.c"
    src.write_text("".join(f"int {n}(void) {{ return 999; }}\n" for n in sorted(names)))
    out = work / "fakecuda" / "libcuda.so.1"
    out.parent.mkdir()
    sh(["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", src, "-o", out])
    return out.parent


def cubin_archs(cuobjdump: Path, lib: Path) -> list[str]:
    """The archs of a library's cubins, from each ELF header's `arch = ` line: `--list-elf` names a
    12.0f family cubin `sm_120`, like a plain one; the header says `sm_120f`. The dump is large
    (about 600 MB of text for vLLM's _C), so it is streamed."""
    archs = set()
    with subprocess.Popen([cuobjdump, "-elf", lib], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL) as proc:
        for line in proc.stdout:
            if line.startswith(b"arch = "):
                archs.add(line.split()[2].decode())
    return sorted(archs)


EM_AARCH64 = 183  # ELF e_machine
NEOVERSE_N1 = """processor\t: {n}
BogoMIPS\t: 50.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp ssbs
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x3
CPU part\t: 0xd0c
CPU revision\t: 1

"""
PROBE = (
    "import json, torch, vllm, sys\n"
    "for lib in sys.argv[1:]: torch.ops.load_library(lib)\n"
    "print(json.dumps({'vllm': vllm.__version__, 'torch': torch.__version__,"
    " 'scaled_fp4_quant': hasattr(torch.ops._C, 'scaled_fp4_quant'),"
    "}))\n")


def check_aarch64(args, work: Path) -> tuple[dict, list[Path], Path]:
    """Install and load the aarch64 wheel under qemu; return the report, the libraries, cuobjdump."""
    # //toolchains:auditwheel's pure-Python tree brings the pinned `packaging`, the one module
    # beside torch that `import vllm` needs (vllm.utils.torch_version).
    host = bgraph_outputs("//toolchains:qemu-user", "//toolchains:cuobjdump", "//toolchains:auditwheel")
    target = bgraph_outputs("--platform", "aarch64", args.wheel_label, "//vllm:torch-env", "//toolchains:target-python",
                   "//vllm:cuda-driver-stub")
    [wheel] = list(target[f"{args.wheel_label} (aarch64)"].glob("*.whl"))
    report = {"wheel": wheel.name, "sha256": hashlib.sha256(wheel.read_bytes()).hexdigest(),
              "size_mb": round(wheel.stat().st_size / 2**20, 1)}
    import zipfile
    with zipfile.ZipFile(wheel) as zf:
        machines = {}
        for name in zf.namelist():
            with zf.open(name) as f:
                head = f.read(20)
            if head[:4] == b"\x7fELF":
                machines[name] = int.from_bytes(head[18:20], "little")
    report["elf_files"] = len(machines)
    report["all_elf_aarch64"] = bool(machines) and all(m == EM_AARCH64 for m in machines.values())
    qemu = host["//toolchains:qemu-user"] / "usr/bin/qemu-aarch64-static"
    root = target["//toolchains:target-python (aarch64)"]
    torch_env = target["//vllm:torch-env (aarch64)"]
    driver = work / "driver"
    driver.mkdir()
    (driver / "libcuda.so.1").symlink_to(target["//vllm:cuda-driver-stub (aarch64)"] / "libcuda.so")
    site = work / "site"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(work), "PIP_CONFIG_FILE": os.devnull, "PYTHONNOUSERSITE": "1",
           "LC_ALL": "C"}
    python = [qemu, "-L", root, root / "usr/bin/python3.11"]
    pip = subprocess.run([*map(str, python), "-m", "pip", "install", "--no-deps", "--no-index",
                          "--root-user-action=ignore", "--disable-pip-version-check", "--target", str(site),
                          str(wheel)], capture_output=True, text=True, env=env)
    if pip.returncode != 0:
        sys.exit(f"FAILED: pip install under qemu\n{pip.stdout[-3000:]}\n{pip.stderr[-3000:]}")
    report["pip_warnings"] = [line for line in (pip.stdout + pip.stderr).splitlines()
                              if "WARNING" in line or "RECORD" in line]
    libs = sorted((site / "vllm").glob("*.so"))
    report["libraries"] = [lib.name for lib in libs]
    # qemu 7.2's user mode passes the host's x86 /proc/cpuinfo through; torch's cpuinfo library
    # parses it the ARM way, finds no core and crashes at `import torch` (NULL dereference). An
    # aarch64 one (two Neoverse-N1 cores, the CPU qemu is told to be; 7.2 has no Neoverse-V2, the
    # Grace core) is bound over it in a bubblewrap namespace.
    cpuinfo = work / "cpuinfo"
    cpuinfo.write_text("".join(NEOVERSE_N1.format(n=n) for n in range(2)))
    env.update(PYTHONPATH=f"{site}:{torch_env}:{host['//toolchains:auditwheel']}", LD_LIBRARY_PATH=str(driver),
               QEMU_CPU="neoverse-n1")
    started = time.monotonic()
    emulated = ["bwrap", "--dev-bind", "/", "/", "--ro-bind", cpuinfo, "/proc/cpuinfo", *python]
    loaded = json.loads(sh([*emulated, "-c", PROBE, *[lib for lib in libs if lib.name.startswith("_")]], env=env,
                           cwd=work).strip().splitlines()[-1])
    report["emulated_import_s"] = round(time.monotonic() - started, 1)
    report["platform"] = "aarch64 (qemu-aarch64-static)"
    report.update(loaded)
    return report, libs, host["//toolchains:cuobjdump"] / "bin" / "cuobjdump"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--wheel-label", default="//wheels:vllm-sm121")
    ap.add_argument("--platform", choices=["x86_64", "aarch64"], default="x86_64",
                    help="aarch64: the Spark's wheel, checked under qemu")
    ap.add_argument("--venv", help="reuse this venv (created with torch 2.14.0 if missing)")
    ap.add_argument("--expect", default="sm_121a")
    ap.add_argument("--refuse", default="sm_120a")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="vllm-check-"))
    if args.platform == "aarch64":
        report, libs, cuobjdump = check_aarch64(args, work)
        return finish(args, report, libs, cuobjdump)
    out = bgraph_outputs("--platform", "x86_64", args.wheel_label, "//toolchains:cuobjdump")
    [wheel] = list(out[args.wheel_label].glob("*.whl"))
    cuobjdump = out["//toolchains:cuobjdump"] / "bin" / "cuobjdump"
    report = {"wheel": wheel.name, "sha256": hashlib.sha256(wheel.read_bytes()).hexdigest(),
              "size_mb": round(wheel.stat().st_size / 2**20, 1)}

    venv = Path(args.venv) if args.venv else work / "venv"
    if not (venv / "bin" / "python").exists():
        sh([sys.executable, "-m", "venv", venv])
        # torch, and packaging: the one other module `import vllm` needs (vllm.utils.torch_version).
        sh([venv / "bin" / "pip", "install", "-q", "torch==2.14.0", "packaging"])
    py = venv / "bin" / "python"
    sh([venv / "bin" / "pip", "install", "-q", "--no-deps", "--force-reinstall", wheel])
    site = Path(sh([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip())
    libs = sorted((site / "vllm").glob("*.so"))
    report["libraries"] = [lib.name for lib in libs]
    driver = fake_driver(libs, work)
    env = {"PATH": "/usr/bin:/bin", "LD_LIBRARY_PATH": str(driver), "HOME": str(work)}
    loaded = json.loads(sh([py, "-c", PROBE, *[lib for lib in libs if lib.name.startswith("_")]], env=env,
                           cwd=work).strip().splitlines()[-1])
    report.update(loaded)
    finish(args, report, libs, cuobjdump)


def finish(args, report: dict, libs: list[Path], cuobjdump: Path) -> None:
    """Add the cubin archs, decide, print the report and exit 0 only if every check passed."""
    cubins = {lib.name: cubin_archs(cuobjdump, lib) for lib in libs}
    report["cubin_archs"] = cubins
    ok = (report["scaled_fp4_quant"] and report["vllm"].startswith("0.33.0")
          and any(args.expect in c for c in cubins.values())
          and not any(args.refuse in c for c in cubins.values())
          and report.get("all_elf_aarch64", True) and not report.get("pip_warnings"))
    report["ok"] = bool(ok)
    print(json.dumps(report, indent=1))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
