#!/usr/bin/env python3
"""Check an aarch64 image built by bgraph (issue 35: `//images:vllm-sm121`, the Spark's) on a machine
of another CPU, without loading it into a daemon, and print the figures BENCHMARKS.md records.

1. each layer blob's sha256 is its digest (uncompressed: digest = diff_id) and its size the
   manifest's;
2. every ELF file in every layer is AArch64 (pyelftools reads each header's e_machine; a file that
   starts with the ELF magic but that pyelftools cannot parse counts as a failure);
3. the layers are unpacked in order into a scratch root filesystem (none holds a whiteout), and
   the image's own CPython runs there under the pinned qemu-user (//toolchains:qemu-user's
   `qemu-aarch64-static -L ROOT -0 /usr/bin/python3.11 ROOT/usr/bin/python3.11`, no binfmt
   registration: its sys.path is the image's): `import vllm,
   flashinfer, torch`, every extension library of vLLM loaded into torch, every AOT module of
   FlashInfer loaded through tvm_ffi, and `vllm --version` (0.33.0, or, with no GPU, vLLM's own
   "Failed to infer device type": it builds its parsers' defaults before --version). qemu opens a path the root lacks on
   the host instead: every module file and mapped library the probe used must be in the root.

There is no GPU and so no driver here, and the image ships none (the NVIDIA container toolkit
injects the host's): vLLM's and FlashInfer's libraries link libcuda.so.1, so the aarch64 driver
stub bgraph builds for vLLM's link (//vllm:cuda-driver-stub) is put on LD_LIBRARY_PATH; nothing
calls it. qemu 7.2 passes the host's x86 /proc/cpuinfo through, which torch's cpuinfo library
cannot parse (it crashes at `import torch`): an aarch64 one is bound over it with bubblewrap.

Usage: python3 bench/image_aarch64_check.py [-C WS] [--cache-dir DIR] [--label //images:vllm-sm121]
       [--root DIR (default: a scratch dir, removed after)] [--keep-root] [--skip-run] [--link-store CACHE]
Exit 0 only if every check passed; the report is JSON on stdout.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import blake3

REPO = Path(__file__).resolve().parents[1]
ELF_MAGIC = b"\x7fELF"
# The cpuinfo qemu is told to show (two Neoverse-N1 cores): the wheel check's, one copy.
from vllm_wheel_check import NEOVERSE_N1  # noqa: E402 (bench/ is the script's directory)
from image_probe import probe_script  # noqa: E402
# What `vllm --version` stops with where no GPU platform is found (see main).
NO_DEVICE = "RuntimeError: Failed to infer device type"
PROBE = probe_script("_*.so")  # run under qemu


def fail(msg: str) -> None:
    sys.exit(f"image_aarch64_check: {msg}")


def bgraph_outputs(ws: str, cache: str | None, *args: str) -> dict[str, Path]:
    """Build (normally: hit) the labels and return their output trees."""
    cmd = [sys.executable, "-m", "build_graph", "-C", ws] + (["--cache-dir", cache] if cache else [])
    proc = subprocess.run([*cmd, "build", "--json", *args], capture_output=True, text=True, cwd=REPO, check=False)
    if proc.returncode != 0:
        fail(f"bgraph build {' '.join(args)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return {k: Path(v) for k, v in json.loads(proc.stdout)["outputs"].items()}


def blob_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def scan_layer(path: Path) -> dict:
    """Count a layer's files and ELF files by machine; list whiteouts and what is not AArch64."""
    # pyelftools: bgraph's pinned copy, put on sys.path by main.
    from elftools.common.exceptions import ELFError
    from elftools.elf.elffile import ELFFile

    machines: dict[str, int] = {}
    foreign: list[str] = []
    files = whiteouts = 0
    with tarfile.open(path, "r:") as tar:
        for member in tar:
            if os.path.basename(member.name).startswith(".wh."):
                whiteouts += 1
            if not member.isfile():
                continue
            files += 1
            f = tar.extractfile(member)
            if f.read(4) != ELF_MAGIC:
                continue
            f.seek(0)
            try:
                machine = ELFFile(f).header["e_machine"]
            except ELFError as e:
                machine = f"unreadable ({e})"
            machines[machine] = machines.get(machine, 0) + 1
            if machine != "EM_AARCH64":
                foreign.append(f"{member.name}: {machine}")
    return {"files": files, "elf": machines, "not_aarch64": foreign[:20], "not_aarch64_count": len(foreign),
            "whiteouts": whiteouts}


def unpack(layers: list[Path], root: Path, store: Path | None) -> dict:
    """Unpack the layers bottom to top into root: GNU tar (owners, modes and links as stored), or,
    with `store` (a bgraph cache's v1/blake3/cas), each regular file whose bytes bgraph's store
    already holds (their blake3 read from the layer) hard-linked to that blob instead of written
    again: the 8.5 GB of the vLLM images cost no disk. A linked file keeps the store's mode (0444,
    or 0555 for an executable's copy): the checks only read and execute."""
    start = time.monotonic()
    linked = written = 0
    for blob in layers:
        if store is None:
            subprocess.run(["tar", "-xf", str(blob), "-C", str(root), "--same-owner", "--same-permissions"], check=True)
            continue
        with tarfile.open(blob, "r:") as tar:
            for member in tar:
                dest = root / member.name
                if member.isdir():
                    dest.mkdir(parents=True, exist_ok=True)
                    continue
                if dest.is_symlink() or dest.exists():
                    dest.unlink()
                if member.issym():
                    dest.symlink_to(member.linkname)
                elif member.islnk():
                    os.link(root / member.linkname, dest)
                elif member.isfile():
                    f = tar.extractfile(member)
                    digest = blake3.blake3(max_threads=1)
                    while chunk := f.read(1 << 20):
                        digest.update(chunk)
                    hexdigest = digest.hexdigest()
                    blob_file = store / hexdigest[:2] / hexdigest[2:]
                    if member.mode & 0o111 and Path(f"{blob_file}.x").exists():
                        blob_file = Path(f"{blob_file}.x")
                    if blob_file.exists():
                        os.link(blob_file, dest)
                        linked += 1
                    else:
                        f.seek(0)
                        with open(dest, "wb") as out:
                            shutil.copyfileobj(f, out, 1 << 20)
                        os.chmod(dest, member.mode)
                        written += 1
                else:
                    fail(f"{blob.name}: {member.name} is neither file, directory nor link")
    return {"unpack_s": round(time.monotonic() - start, 1), "files_linked": linked, "files_written": written}


def emulated(qemu: Path, root: Path, cpuinfo: Path, env: dict, argv: list[str], timeout: int) -> tuple[int, str, str, float]:
    """Run the image's CPython under qemu-aarch64-static -L ROOT, the aarch64 cpuinfo bound in."""
    # argv[0] /usr/bin/python3.11: CPython finds its prefix (/usr) and so the image's own sys.path
    # (/usr/local/lib/python3.11/dist-packages); qemu opens every absolute path in ROOT first.
    cmd = ["bwrap", "--dev-bind", "/", "/", "--ro-bind", str(cpuinfo), "/proc/cpuinfo",
           str(qemu), "-L", str(root), "-0", "/usr/bin/python3.11", str(root / "usr/bin/python3.11"), *argv]
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=root / "tmp", check=False)
    return proc.returncode, proc.stdout, proc.stderr, time.monotonic() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-C", dest="ws", default=str(REPO), help="the workspace to build in")
    ap.add_argument("--cache-dir", help="bgraph's cache (default: the workspace's)")
    ap.add_argument("--label", default="//images:vllm-sm121")
    ap.add_argument("--root", help="where to unpack the layers (default: a scratch dir under /var/tmp)")
    ap.add_argument("--keep-root", action="store_true", help="leave the unpacked root filesystem")
    ap.add_argument("--skip-run", action="store_true", help="only the digests and the ELF check")
    ap.add_argument("--link-store", metavar="CACHE", help="hard-link the files bgraph's cache CACHE holds instead "
                                                          "of writing them (same filesystem as --root)")
    args = ap.parse_args()
    if shutil.which("bwrap") is None:
        fail("bubblewrap (bwrap) is not installed (apt-get install bubblewrap)")

    # pyelftools as bgraph pins it for auditwheel (//toolchains:auditwheel's pure-Python tree).
    host = bgraph_outputs(args.ws, args.cache_dir, "//toolchains:qemu-user", "//toolchains:auditwheel")
    sys.path.insert(0, str(host["//toolchains:auditwheel"]))
    out = bgraph_outputs(args.ws, args.cache_dir, "--platform", "aarch64", args.label, "//vllm:cuda-driver-stub")
    # The tree itself, not the bgraph-out link a later build of the label would repoint.
    [layout] = [p.resolve() for k, p in out.items() if k.startswith(args.label)]
    meta = json.loads((layout / "image.json").read_text())
    if meta.get("platform") != "aarch64":
        fail(f"{args.label} is a {meta.get('platform')} image, not aarch64")
    report: dict = {"label": args.label, "ref": meta["ref"], "config": meta["config"], "manifest": meta["manifest"],
                    "layers": []}
    blobs = []
    start = time.monotonic()
    for layer in meta["layers"]:
        blob = layout / "blobs" / "sha256" / layer["digest"].split(":", 1)[1]
        if not blob.is_file():
            fail(f"layer {layer['name']}: blob {blob} missing (build with archive = false gives a layout directory)")
        digest_ok = f"sha256:{blob_sha256(blob)}" == layer["digest"] and blob.stat().st_size == layer["size"]
        report["layers"].append({"name": layer["name"], "digest": layer["digest"], "size": layer["size"],
                                 "digest_ok": digest_ok, **scan_layer(blob)})
        blobs.append(blob)
    report["scan_s"] = round(time.monotonic() - start, 1)
    elf_total = sum(sum(layer["elf"].values()) for layer in report["layers"])
    report["elf_files"] = elf_total
    report["all_elf_aarch64"] = elf_total > 0 and not any(layer["not_aarch64_count"] for layer in report["layers"])
    ok = report["all_elf_aarch64"] and all(layer["digest_ok"] and not layer["whiteouts"] for layer in report["layers"])
    if args.skip_run:
        return finish(report, ok)

    qemu = host["//toolchains:qemu-user"] / "usr/bin/qemu-aarch64-static"
    stub = out["//vllm:cuda-driver-stub (aarch64)"] / "libcuda.so"
    root = Path(args.root) if args.root else Path(tempfile.mkdtemp(prefix="image-check-root-", dir="/var/tmp"))
    root.mkdir(parents=True, exist_ok=True)
    root = root.resolve()  # qemu's /proc/self/maps names the files it opened by their real paths
    scratch = Path(tempfile.mkdtemp(prefix="image-check-aux-", dir="/var/tmp"))
    try:
        store = Path(args.link_store) / "v1" / "blake3" / "cas" if args.link_store else None
        report.update(unpack(blobs, root, store))
        if (root / "usr/lib/aarch64-linux-gnu/libcuda.so.1").exists():
            fail("the image holds libcuda.so.1 (the container toolkit injects the host driver's)")
        (scratch / "driver").mkdir()
        (scratch / "driver" / "libcuda.so.1").symlink_to(stub)
        cpuinfo = scratch / "cpuinfo"
        cpuinfo.write_text("".join(NEOVERSE_N1.format(n=n) for n in range(2)))
        # The image's environment (its config's Env), then what this check needs: the stub, the CPU.
        config = json.loads((layout / "blobs" / "sha256" / meta["config"].split(":", 1)[1]).read_text())
        env = dict(e.split("=", 1) for e in config["config"].get("Env", []))
        # No .pyc written: the root's files may be hard links into bgraph's store (--link-store).
        env.update(HOME="/tmp", LC_ALL="C.UTF-8", LD_LIBRARY_PATH=str(scratch / "driver"), QEMU_CPU="neoverse-n1",
                   FLASHINFER_DISABLE_JIT="1", PYTHONDONTWRITEBYTECODE="1")
        rc, stdout, stderr, secs = emulated(qemu, root, cpuinfo, env, ["-c", PROBE], timeout=1800)
        report["probe_s"] = round(secs, 1)
        if rc == 0:
            probe = json.loads(stdout.strip().splitlines()[-1])
            # qemu falls back to the host's file where ROOT has none: every module and library the
            # probe loaded must be the image's (the driver stub aside).
            modules, mapped = probe.pop("module_files"), probe.pop("mapped")
            probe["modules_loaded"], probe["libraries_mapped"] = len(modules), len(mapped)
            # (torch names two module objects' __file__ '_classes.py' and '_ops.py': not paths)
            probe["not_from_image"] = ([m for m in modules if m.startswith("/") and not (root / m.lstrip("/")).exists()]
                                       + [m for m in mapped if not m.startswith((str(root) + "/", str(scratch) + "/"))
                                          and not Path(m).resolve().is_relative_to(stub.resolve().parent)])
            report["probe"] = probe
        else:
            report["probe_error"] = (stdout + stderr)[-3000:]
        rc, stdout, stderr, secs = emulated(qemu, root, cpuinfo, env, ["/usr/local/bin/vllm", "--version"],
                                            timeout=1800)
        report["vllm_version_s"] = round(secs, 1)
        report["vllm_version"] = stdout.strip().splitlines()[-1] if rc == 0 and stdout.strip() else None
        if rc != 0:
            report["vllm_version_error"] = (stdout + stderr)[-3000:]
            # With no GPU, vLLM's CUDA platform is not detected (no NVML: the image ships no driver),
            # and `vllm` builds every subcommand's parser, whose defaults construct a DeviceConfig,
            # before it reads --version: it stops there. Only that failure is told apart.
            report["vllm_version_no_gpu"] = NO_DEVICE in stderr
        probe = report.get("probe", {})
        ok = (ok and probe.get("vllm", "").startswith("0.33.0") and probe.get("machine") == "aarch64"
              and probe.get("scaled_fp4_quant") and probe.get("flashinfer_aot_modules", 0) > 0
              and not probe.get("not_from_image")
              and (report["vllm_version"] == "0.33.0" or report.get("vllm_version_no_gpu")))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if not args.keep_root:
            shutil.rmtree(root, ignore_errors=True)
        else:
            report["root"] = str(root)
    finish(report, ok)


def finish(report: dict, ok: bool) -> None:
    """Print the report and exit 0 only if every check passed."""
    report["ok"] = bool(ok)
    print(json.dumps(report, indent=1))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
