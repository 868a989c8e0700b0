#!/usr/bin/env python3
"""Benchmark: the remote cache (nginx with WebDAV PUT, started here on 127.0.0.1).

1. //wheels:fp4-kernels-sm121 cold into an empty cache A, uploading (`--remote-upload`); then a
   fresh cache B in another workspace directory against the warm remote: actions executed (goal
   0), remote hits, and B's wall time as a ratio of A's.
2. Throughput for one 256 MiB output: bgraph's client (put and verified get of the blob) against
   curl on the same server and file in the same run (the server's own limit); and end to end, a
   fresh cache building a target whose output is that file, from the remote.

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
from remote_servers import Nginx  # noqa: E402  (the same server setup as the tests)

WHEEL = "//wheels:fp4-kernels-sm121"
SIZE = 256 << 20


def snapshot(dest: Path) -> Path:
    archive = subprocess.run(["git", "-C", REPO, "archive", "HEAD"], capture_output=True, check=True).stdout
    with tarfile.open(fileobj=__import__("io").BytesIO(archive)) as tar:
        tar.extractall(dest, filter="data")
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json-out")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="remote-bench-"))
    nginx = Nginx(work / "nginx")
    result: dict = {"server": "nginx " + subprocess.run(["nginx", "-v"], capture_output=True, text=True)
                    .stderr.strip().split("/")[-1]}
    try:
        a, b = snapshot(work / "a"), snapshot(work / "elsewhere" / "b")
        cold, s_a = bgraph(a, work / "cache-a", "--remote-cache", nginx.url, "--remote-upload", WHEEL)
        warm, s_b = bgraph(b, work / "cache-b", "--remote-cache", nginx.url, WHEEL)
        result["fp4_wheel"] = {
            "cold_s": round(cold, 2), "cold_executed": s_a["executed"], "uploaded": s_a["remote"]["uploaded"],
            "uploaded_mib": round(s_a["remote"]["uploaded_bytes"] / 2**20, 1),
            "fresh_cache_s": round(warm, 2), "fresh_executed": s_b["executed"], "remote_hits": s_b["remote"]["hits"],
            "downloaded_mib": round(s_b["remote"]["downloaded_bytes"] / 2**20, 1),
            "ratio": round(warm / cold, 3),
            "same_outputs": {x["key"] for x in s_a["actions"]} == {x["key"] for x in s_b["actions"]}}
        print(json.dumps(result["fp4_wheel"]), flush=True)

        # 2. 256 MiB: bgraph's client against curl, same server, same bytes.
        from build_graph.model import Digester
        from build_graph.store.remote import HttpRemote
        blob = work / "big.bin"
        with open(blob, "wb") as f:
            f.write(os.urandom(SIZE))
        data = blob.read_bytes()
        digest = Digester("blake3").of(data)
        client = HttpRemote(nginx.url, timeout_s=120)
        put_s = timed(lambda: client.put_blob(digest, data))
        get_s = timed(lambda: Digester("blake3").of(client.get_blob(digest)) == digest or sys.exit("bad get"))
        curl = shutil.which("curl")
        row = {"bgraph_put_mib_s": round(256 / put_s), "bgraph_get_verified_mib_s": round(256 / get_s)}
        if curl:
            url = f"{nginx.url}/bench/curl.bin"
            row["curl_put_mib_s"] = round(256 / timed(lambda: subprocess.run(
                [curl, "-sf", "-T", str(blob), url], check=True)))
            row["curl_get_mib_s"] = round(256 / timed(lambda: subprocess.run(
                [curl, "-sf", "-o", os.devnull, url], check=True)))
        # End to end: a target whose output is those bytes, built on A (upload), then on a fresh cache.
        for ws in (a, b):
            (ws / "big.bin").write_bytes(data)
            (ws / "targets" / "bench.toml").write_text(
                '[big]\nkind = "genrule"\nsrcs = ["big.bin"]\nouts = ["big.out"]\n'
                'cmd = "cp $SRC/big.bin $OUT/big.out"\n')
        up_s, _ = bgraph(a, work / "cache-a", "--remote-cache", nginx.url, "--remote-upload", "//bench:big")
        down_s, s = bgraph(b, work / "cache-c", "--remote-cache", nginx.url, "//bench:big")
        row.update(build_upload_s=round(up_s, 2), fresh_build_from_remote_s=round(down_s, 2),
                   fresh_build_executed=s["executed"])
        result["256mib"] = row
        print(json.dumps(row), flush=True)
    finally:
        nginx.stop()
        shutil.rmtree(work, ignore_errors=True)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
