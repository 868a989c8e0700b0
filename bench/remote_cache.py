#!/usr/bin/env python3
"""Benchmark: the remote cache, against nginx (WebDAV PUT; the workspace in blake3) and BuildGrid
0.9.1 (REAPI v2 over gRPC; the workspace in sha256, which BuildGrid requires), both started here
on 127.0.0.1.

1. //wheels:fp4-kernels-sm121 cold into an empty cache A, uploading (`--remote-upload`); then a
   fresh cache B in another workspace directory against the warm remote: actions executed (goal
   0), remote hits, and B's wall time as a ratio of A's.
2. Throughput for one 256 MiB output: bgraph's client (put and verified get of the blob), with
   curl against nginx on the same file in the same run (the server's own limit); and end to end,
   a fresh cache building a target whose output is that file, from the remote.

Usage: python3 bench/remote_cache.py [--json-out FILE]
"""

from __future__ import annotations

import argparse
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
sys.path.insert(0, str(REPO / "tests"))
from remote_servers import BuildGrid, Nginx, buildgrid_bgd  # noqa: E402  (the tests' server setups)

WHEEL = "//wheels:fp4-kernels-sm121"
SIZE = 256 << 20


def snapshot(dest: Path, digest_function: str) -> Path:
    archive = subprocess.run(["git", "-C", REPO, "archive", "HEAD"], capture_output=True, check=True).stdout
    with tarfile.open(fileobj=__import__("io").BytesIO(archive)) as tar:
        tar.extractall(dest, filter="data")
    ws = dest / "WORKSPACE.toml"
    ws.write_text(ws.read_text().replace('digest_function = "blake3"', f'digest_function = "{digest_function}"'))
    return dest


def bgraph(ws: Path, cache: Path, *args: str) -> tuple[float, dict]:
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "build_graph", "-C", ws, "--cache-dir", cache, "build", "-j2",
                           "--json", *args], capture_output=True, text=True)
    wall = time.monotonic() - start
    if proc.returncode != 0:
        sys.exit(f"build failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return wall, json.loads(proc.stdout)


def timed(fn) -> float:
    start = time.monotonic()
    fn()
    return time.monotonic() - start


def run_server(name: str, url: str, digest_function: str, work: Path, client) -> dict:
    out: dict = {}
    a, b = snapshot(work / name / "a", digest_function), snapshot(work / name / "elsewhere" / "b", digest_function)
    cold, s_a = bgraph(a, work / name / "cache-a", "--remote-cache", url, "--remote-allow-unsigned", "--remote-upload",
                       WHEEL)
    warm, s_b = bgraph(b, work / name / "cache-b", "--remote-cache", url, "--remote-allow-unsigned", WHEEL)
    out["fp4_wheel"] = {
        "cold_s": round(cold, 2), "cold_executed": s_a["executed"], "uploaded": s_a["remote"]["uploaded"],
        "uploaded_mib": round(s_a["remote"]["uploaded_bytes"] / 2**20, 1),
        "fresh_cache_s": round(warm, 2), "fresh_executed": s_b["executed"], "remote_hits": s_b["remote"]["hits"],
        "downloaded_mib": round(s_b["remote"]["downloaded_bytes"] / 2**20, 1),
        "ratio": round(warm / cold, 3),
        "same_outputs": {x["key"] for x in s_a["actions"]} == {x["key"] for x in s_b["actions"]}}
    print(name, json.dumps(out["fp4_wheel"]), flush=True)

    from build_graph.model import Digester
    data = (work / "big.bin").read_bytes()
    digest = Digester(digest_function).of(data)
    put_s = timed(lambda: client.put_blob(digest, data))
    get_s = timed(lambda: Digester(digest_function).of(client.get_blob(digest, len(data))) == digest
                  or sys.exit("bad get"))
    row = {"bgraph_put_mib_s": round(256 / put_s), "bgraph_get_verified_mib_s": round(256 / get_s)}
    for ws in (a, b):
        (ws / "big.bin").write_bytes(data)
        (ws / "targets" / "bench.toml").write_text(
            '[big]\nkind = "genrule"\nsrcs = ["big.bin"]\nouts = ["big.out"]\n'
            'cmd = "cp $SRC/big.bin $OUT/big.out"\n')
    up_s, _ = bgraph(a, work / name / "cache-a", "--remote-cache", url, "--remote-allow-unsigned", "--remote-upload",
                     "//bench:big")
    down_s, s = bgraph(b, work / name / "cache-c", "--remote-cache", url, "--remote-allow-unsigned", "//bench:big")
    row.update(build_upload_s=round(up_s, 2), fresh_build_from_remote_s=round(down_s, 2),
               fresh_build_executed=s["executed"])
    out["256mib"] = row
    print(name, json.dumps(row), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json-out")
    ap.add_argument("--servers", default="nginx,buildgrid")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="remote-bench-"))
    with open(work / "big.bin", "wb") as f:
        f.write(os.urandom(SIZE))
    result: dict = {}
    try:
        if "nginx" in args.servers:
            from build_graph.store.remote import HttpRemote
            nginx = Nginx(work / "nginx-server")
            try:
                result["nginx"] = run_server("nginx", nginx.url, "blake3", work, HttpRemote(nginx.url, timeout_s=120))
                curl = shutil.which("curl")
                if curl:
                    url, blob = f"{nginx.url}/bench/curl.bin", str(work / "big.bin")
                    result["nginx"]["256mib"]["curl_put_mib_s"] = round(256 / timed(lambda: subprocess.run(
                        [curl, "-sf", "-T", blob, url], check=True)))
                    result["nginx"]["256mib"]["curl_get_mib_s"] = round(256 / timed(lambda: subprocess.run(
                        [curl, "-sf", "-o", os.devnull, url], check=True)))
                    print("nginx curl", json.dumps(result["nginx"]["256mib"]), flush=True)
            finally:
                nginx.stop()
        if "buildgrid" in args.servers:
            from build_graph.store.reapi_remote import ReapiRemote
            server = BuildGrid(work / "buildgrid-server", buildgrid_bgd())
            try:
                client = ReapiRemote(server.url, "sha256", timeout_s=120)
                client.check_capabilities()
                result["buildgrid"] = run_server("buildgrid", server.url, "sha256", work, client)
            finally:
                server.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
