#!/usr/bin/env python3
"""Check the x86_64 vLLM image built by bgraph (issue 35: `//images:vllm-sm120`, the RTX PRO 6000's)
in a real Docker daemon, and print the figures BENCHMARKS.md records.

1. the image's layers: name, size, file count (tar headers read) and, with --verify, each blob's
   sha256 against its digest (uncompressed: digest = diff_id);
2. `bgraph load LABEL --json` into the daemon at DOCKER_HOST (the command a user runs: it builds,
   normally hits, then loads only the layers the daemon lacks); with --compare, `bgraph load
   --full` and the docker CLI's `docker load` of the same tar, every layer there;
3. the image run through the SDK with network_mode="none": its CPython imports torch, flashinfer,
   vllm and tvm_ffi; every extension library of vLLM (`vllm/*.so`) loads into torch
   (`torch.ops._C.scaled_fp4_quant` there); every AOT module of FlashInfer loads through tvm_ffi,
   with FlashInfer's JIT off (FLASHINFER_DISABLE_JIT=1);
4. `vllm --version` in the image, as its entrypoint runs it: with no GPU vLLM finds no platform
   and stops before it reads --version ("Failed to infer device type", as on the aarch64 image);
   then with VLLM_TARGET_DEVICE=cpu, vLLM's own variable (read at run time by its CPU platform
   plugin: vllm/platforms/__init__.py), which lets it print 0.33.0 with no GPU and no patch.

There is no GPU and so no driver here, and the image ships none (the NVIDIA container toolkit
injects the host's): vLLM's and FlashInfer's libraries link libcuda.so.1, so for step 3 the x86_64
driver stub bgraph builds for vLLM's link (//vllm:cuda-driver-stub, each function returns an error)
is bind-mounted read-only into the container and put on LD_LIBRARY_PATH, where the toolkit would
put the real one; nothing calls it.

Usage: DOCKER_HOST=unix:///... python3 bench/image_x86_check.py [-C WS] [--cache-dir DIR]
       [--label //images:vllm-sm120] [--verify] [--compare] [--staged] [--skip-load]
Exit 0 only if every check passed; the report is JSON on stdout (progress on stderr).
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from image_load import docker_cli_load  # noqa: E402 (bench/ is the script's directory)
from image_probe import probe_script  # noqa: E402

from build_graph.oci import image  # noqa: E402
from build_graph.oci.load import connect, load  # noqa: E402

NO_DEVICE = "Failed to infer device type"
STUB_DIR = "/opt/bgraph-driver-stub"  # where the container sees the driver stub (read-only)
PROBE = probe_script("*.so")


def fail(msg: str) -> None:
    sys.exit(f"image_x86_check: {msg}")


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def bgraph(ws: str, cache: str | None, *args: str) -> tuple[dict, float]:
    """Run bgraph (this checkout's) with --json; its parsed output and wall seconds."""
    cmd = [sys.executable, "-m", "build_graph", "-C", ws] + (["--cache-dir", cache] if cache else [])
    start = time.monotonic()
    proc = subprocess.run([*cmd, *args], capture_output=True, text=True, cwd=REPO, check=False)
    if proc.returncode != 0:
        fail(f"bgraph {' '.join(args)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout), time.monotonic() - start


def layer_stats(path: Path, verify: bool) -> dict:
    """A layer blob's file count (its tar headers) and, with verify, whether its sha256 matches."""
    files = 0
    with tarfile.open(path, "r:") as tar:
        for member in tar:
            files += member.isfile()
    out = {"files": files}
    if verify:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
        out["sha256"] = f"sha256:{h.hexdigest()}"
    return out


def prefix_image(layout: Path, meta: dict, config: dict, k: int, work: Path) -> tuple[Path, dict]:
    """An image of the bottom k layers (blobs hard-linked, documents written by bgraph's own
    image.documents with this image's settings), tagged <ref>-prefix<k>."""
    out = work / f"prefix{k}"
    (out / "blobs/sha256").mkdir(parents=True)
    layers = [image.Layer(l["name"], l["digest"], l["size"]) for l in meta["layers"][:k]]
    for layer in layers:
        os.link(layout / image.blob_path(layer.digest), out / image.blob_path(layer.digest))
    run_config = config["config"]
    ref = f"{meta['ref']}-prefix{k}"
    docs = image.documents(platform="x86_64", layers=layers, ref=ref, created=0, created_by="image_x86_check",
                           env=run_config.get("Env", []), entrypoint=run_config.get("Entrypoint") or [],
                           cmd=run_config.get("Cmd") or [], workdir=run_config.get("WorkingDir", ""),
                           user=run_config.get("User", ""), labels=run_config.get("Labels") or {})
    for path, data in ((image.blob_path(docs.config_digest), docs.config),
                       (image.blob_path(docs.manifest_digest), docs.manifest), ("index.json", docs.index),
                       ("manifest.json", docs.docker_manifest), ("oci-layout", docs.layout)):
        (out / path).write_bytes(data)
    return out, {"ref": ref, "config": docs.config_digest, "manifest": docs.manifest_digest,
                 "layers": [{"name": l.name, "digest": l.digest, "size": l.size} for l in layers]}


def staged_loads(layout: Path, meta: dict, config: dict) -> list[dict]:
    """Load the image's bottom layers one per load, as prefix images (each load sends one layer:
    the daemon has the chain below it), for a daemon whose staging directory (DOCKER_TMPDIR: Docker
    unpacks the whole tar there before it looks at the layers) cannot hold the whole image."""
    steps = []
    with tempfile.TemporaryDirectory(prefix="image-x86-prefix-", dir="/var/tmp") as tmp:
        for k in range(1, len(meta["layers"])):
            out, pmeta = prefix_image(layout, meta, config, k, Path(tmp))
            report = load(out, pmeta, timeout=3600)
            steps.append({"layer": meta["layers"][k - 1]["name"], **report.to_json()})
            say(f"staged load {k}: {report.line()}")
            shutil.rmtree(out)
    return steps


def run(client, ref: str, argv: list[str], entrypoint: list[str], env: dict, volumes: dict | None = None,
        timeout: int = 900) -> tuple[int, str, float]:
    """Run the image with no network (the SDK, as `docker run --network none`); exit, output, seconds."""
    start = time.monotonic()
    container = client.containers.run(ref, argv, entrypoint=entrypoint, environment=env, volumes=volumes or {},
                                      network_mode="none", detach=True, mem_limit="6g")
    try:
        status = container.wait(timeout=timeout)
        logs = container.logs().decode(errors="replace")
    finally:
        container.remove(force=True)
    return status["StatusCode"], logs, time.monotonic() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-C", dest="ws", default=str(REPO), help="the workspace to build in")
    ap.add_argument("--cache-dir", help="bgraph's cache (default: the workspace's)")
    ap.add_argument("--label", default="//images:vllm-sm120")
    ap.add_argument("--verify", action="store_true", help="hash every layer blob (reads the whole image)")
    ap.add_argument("--compare", action="store_true",
                    help="after the load: `bgraph load --full` and `docker load` of the same tar, every layer there")
    ap.add_argument("--skip-load", action="store_true", help="the image is loaded already: only run it")
    ap.add_argument("--staged", action="store_true",
                    help="before `bgraph load`, load the bottom layers one per load (prefix images), so the "
                         "daemon never stages more than one layer")
    args = ap.parse_args()
    if not os.environ.get("DOCKER_HOST"):
        fail("set DOCKER_HOST to the daemon to load into (e.g. unix:///var/tmp/d/docker.sock)")

    say(f"bgraph build {args.label} //vllm:cuda-driver-stub")
    built, secs = bgraph(args.ws, args.cache_dir, "build", "--json", args.label, "//vllm:cuda-driver-stub")
    # Keys carry " (x86_64)" where the host is another platform: match on the label.
    outputs = {k.split(" (")[0]: Path(v).resolve() for k, v in built["outputs"].items()}
    layout = outputs[args.label]
    meta = json.loads((layout / "image.json").read_text())
    if meta.get("platform", "x86_64") != "x86_64":
        fail(f"{args.label} is a {meta.get('platform')} image, not x86_64")
    report: dict = {"label": args.label, "ref": meta["ref"], "config": meta["config"], "manifest": meta["manifest"],
                    "build_s": round(secs, 1), "layers": []}
    start = time.monotonic()
    for layer in meta["layers"]:
        blob = layout / "blobs" / "sha256" / layer["digest"].split(":", 1)[1]
        stats = layer_stats(blob, args.verify)
        ok = blob.stat().st_size == layer["size"] and stats.pop("sha256", layer["digest"]) == layer["digest"]
        report["layers"].append({"name": layer["name"], "digest": layer["digest"], "size": layer["size"],
                                 "blob_ok": ok, **stats})
    report["layers_read_s"] = round(time.monotonic() - start, 1)
    report["bytes"] = sum(layer["size"] for layer in meta["layers"])
    ok = all(layer["blob_ok"] for layer in report["layers"])
    say(f"{len(meta['layers'])} layers, {report['bytes'] / 2**30:.2f} GiB, blobs ok: {ok}")

    client, daemon = connect(60)
    client.api.timeout = 900
    report["daemon"] = daemon
    config = json.loads((layout / image.blob_path(meta["config"])).read_text())
    if args.staged and not args.skip_load:
        report["staged_loads"] = staged_loads(layout, meta, config)
    if not args.skip_load:
        say("bgraph load")
        loaded, secs = bgraph(args.ws, args.cache_dir, "load", "--timeout", "3600", "--json", args.label)
        report["load"] = {**loaded, "command_s": round(secs, 1)}
        say(f"loaded: {loaded['layers_sent']} of {loaded['layers']} layers, {loaded['bytes_sent']} B, "
            f"{loaded['seconds']} s ({secs:.0f} s with the build's planning)")
        ok = ok and loaded["status"] in ("loaded", "present", "tagged")
    if args.compare:
        say("bgraph load --full")
        full, secs = bgraph(args.ws, args.cache_dir, "load", "--full", "--timeout", "3600", "--json", args.label)
        report["load_full"] = {**full, "command_s": round(secs, 1)}
        say("docker load (the CLI)")
        report["docker_load_s"] = round(docker_cli_load(layout), 2)

    scratch = Path(tempfile.mkdtemp(prefix="image-x86-check-", dir="/var/tmp"))
    try:
        shutil.copy(outputs["//vllm:cuda-driver-stub"] / "libcuda.so", scratch / "libcuda.so.1")
        os.chmod(scratch, 0o755)
        image_env = dict(e.split("=", 1) for e in config["config"].get("Env", []))
        report["entrypoint"] = config["config"].get("Entrypoint")
        ld_path = ":".join(p for p in (STUB_DIR, image_env.get("LD_LIBRARY_PATH")) if p)
        say("probe: imports, vLLM's libraries, FlashInfer's AOT modules")
        rc, logs, secs = run(client, meta["ref"], ["-c", PROBE], ["/usr/bin/python3"],
                             {"FLASHINFER_DISABLE_JIT": "1", "LD_LIBRARY_PATH": ld_path, "HOME": "/tmp"},
                             {str(scratch): {"bind": STUB_DIR, "mode": "ro"}})
        report["probe_s"] = round(secs, 1)
        probe = {}
        if rc == 0:
            probe = report["probe"] = json.loads(logs.strip().splitlines()[-1])
            mapped = probe.pop("mapped")
            probe["modules_loaded"] = len(probe.pop("module_files"))
            probe["libraries_mapped"], probe["libcuda"] = len(mapped), [m for m in mapped if "libcuda" in m]
        else:
            report["probe_error"] = logs[-3000:]
        say(f"probe exit {rc} in {secs:.0f} s")
        # As the image's entrypoint runs it (/usr/local/bin/vllm), nothing added: with no GPU it stops
        # before --version; then with vLLM's own VLLM_TARGET_DEVICE=cpu.
        for key, env in (("vllm_version", {}), ("vllm_version_cpu", {"VLLM_TARGET_DEVICE": "cpu"})):
            rc, logs, secs = run(client, meta["ref"], ["--version"], ["/usr/local/bin/vllm"], env)
            lines = logs.strip().splitlines()
            report[key] = {"env": env, "exit": rc, "seconds": round(secs, 1),
                           "printed": lines[-1] if lines else "",
                           "no_gpu": NO_DEVICE in logs}
            if rc != 0:
                report[key]["tail"] = logs[-1500:]
            say(f"vllm --version {env or ''}: exit {rc}, {lines[-1] if lines else ''!r} in {secs:.0f} s")
        ok = (ok and probe.get("vllm", "").startswith("0.33.0") and probe.get("machine") == "x86_64"
              and probe.get("scaled_fp4_quant") and probe.get("flashinfer_aot_modules", 0) > 0
              and len(probe.get("vllm_libraries", [])) >= 2
              and report["vllm_version_cpu"]["printed"] == "0.33.0"
              and (report["vllm_version"]["printed"] == "0.33.0" or report["vllm_version"]["no_gpu"]))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        client.close()
    report["ok"] = bool(ok)
    print(json.dumps(report, indent=1))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
