"""Benchmark: one image built from two workspace directories and two caches (issue 35, Done-when 1).

Each side is a (workspace, cache) pair: a clone of the repository at the same commit in its own
directory, with its own cache. The script builds LABEL on each side (a no-op where the side has
built it already), through the bgraph of that workspace's own tree (PYTHONPATH: a change to the
main checkout while a side builds cannot reach it), then compares what the two builds wrote:
the manifest and config digests, every layer's digest and size, the SBOM's bytes, and each
blob's sha256 read again from the layout (the digests are names, this checks the bytes).

Usage: python3 bench/image_twice.py --label //images:vllm-sm121 \\
           --side WS_A:CACHE_A --side WS_B:CACHE_B [--platform aarch64] [--no-build] [--json-out F]
The sides' builds are timed; run the cold one on a fresh cache to measure a cold build.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def build(ws: Path, cache: Path, label: str, platform: str | None) -> dict:
    """Build `label` on one side; its summary (--json) and the wall time."""
    argv = [sys.executable, "-P", "-m", "build_graph", "-C", str(ws), "--cache-dir", str(cache), "build", "-j2",
            "--json", label, *(["--platform", platform] if platform else [])]
    env = {**os.environ, "PYTHONPATH": str(ws)}
    t0 = time.monotonic()
    p = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ws)
    wall = time.monotonic() - t0
    if p.returncode != 0:
        raise SystemExit(f"bgraph build failed in {ws}:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    summary = json.JSONDecoder().raw_decode(p.stdout[p.stdout.index("{"):])[0]
    return {"wall_s": round(wall, 1), "executed": summary["executed"], "hits": summary["hits"],
            "cut_off": summary["cut_off"], "actions_cpu_s": summary.get("cpu_s"), "output": summary["outputs"][label]}


def sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def describe(out: Path, rehash: bool = True) -> dict:
    """Digests of the image in one build's output directory (a layout directory or image.tar's)."""
    meta = json.loads((out / "image.json").read_text())
    layout = out if rehash and (out / "index.json").exists() else None
    blobs = {}
    if layout is not None:  # every blob's bytes hashed again: the names are what is compared, this checks them
        for blob in sorted((layout / "blobs" / "sha256").iterdir()):
            blobs[blob.name] = sha256_file(blob) == blob.name
    sbom = out / "sbom.cdx.json"
    return {"image_json": meta, "sbom_sha256": sha256_file(sbom) if sbom.exists() else None,
            "blobs_checked": len(blobs), "blobs_bad": sorted(k for k, ok in blobs.items() if not ok),
            "image_tar_sha256": sha256_file(out / "image.tar") if (out / "image.tar").exists() else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", required=True)
    ap.add_argument("--side", action="append", required=True, help="WORKSPACE:CACHE (give two)")
    ap.add_argument("--platform")
    ap.add_argument("--no-build", action="store_true", help="compare the outputs the sides' last builds linked")
    ap.add_argument("--no-rehash", action="store_true", help="trust the blobs' names (no sha256 of each)")
    ap.add_argument("--json-out")
    args = ap.parse_args()
    if len(args.side) != 2:
        raise SystemExit("give --side twice")
    sides = []
    for spec in args.side:
        ws, _, cache = spec.partition(":")
        ws, cache = Path(ws).resolve(), Path(cache).resolve()
        commit = subprocess.run(["git", "-C", str(ws), "rev-parse", "HEAD"], capture_output=True, text=True,
                                check=True).stdout.strip()
        row = {"workspace": str(ws), "cache": str(cache), "commit": commit}
        if args.no_build:
            pkg, _, name = args.label.removeprefix("//").partition(":")
            plat = args.platform or ""
            row["output"] = str((ws / "bgraph-out" / plat / pkg / name).resolve())
        else:
            row.update(build(ws, cache, args.label, args.platform))
        row.update(describe(Path(row["output"]), not args.no_rehash))
        sides.append(row)
        print(f"{ws}: commit {commit[:12]}, {row.get('wall_s', '-')} s, executed {row.get('executed', '-')}; "
              f"{row['blobs_checked']} blobs re-hashed, {len(row['blobs_bad'])} bad", flush=True)
    a, b = (s["image_json"] for s in sides)
    same = {k: a.get(k) == b.get(k) for k in sorted(set(a) | set(b))}
    same["sbom"] = sides[0]["sbom_sha256"] == sides[1]["sbom_sha256"]
    if sides[0]["image_tar_sha256"] or sides[1]["image_tar_sha256"]:
        same["image.tar"] = sides[0]["image_tar_sha256"] == sides[1]["image_tar_sha256"]
    for k, ok in same.items():
        print(f"  {k:24s} {'same' if ok else 'DIFFERS'}")
    print(f"  config {a.get('config')}  /  {b.get('config')}")
    print(f"  manifest {a.get('manifest')}  /  {b.get('manifest')}")
    for la, lb in zip(a.get("layers", []), b.get("layers", [])):
        print(f"  layer {la['name']:12s} {la['size']:>14,d} B  {la['digest'][:19]}  "
              f"{'same' if la == lb else 'DIFFERS: ' + lb['digest'][:19]}")
    result = {"label": args.label, "platform": args.platform, "sides": sides, "same": same,
              "identical": all(same.values()) and not any(s["blobs_bad"] for s in sides)}
    print("identical" if result["identical"] else "NOT identical")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
