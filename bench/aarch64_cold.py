#!/usr/bin/env python3
"""Benchmark: the Spark's aarch64 vLLM wheel cross-built cold beside the x86_64 one, in one run
(issue 20, item 7). Each platform builds `//wheels:vllm-sm121` in its own fresh cache (wiped first)
from a copy of the workspace, -j2, downloads included; then its no-op. The two builds' action keys
are compared: the actions they share are what one remote cache serves to both.

Also the reproducibility check of issue 20: with --expect-sha256 (the aarch64 wheel's sha256 from
another workspace directory and cache, e.g. the user's), the fresh build must give the same bytes.

About an hour and a half of a 2-core machine for both platforms; --platforms aarch64 runs one.

Usage: python3 bench/aarch64_cold.py [--label //wheels:vllm-sm121] [--cache-root /tmp/bgraph-plat]
                                     [--platforms aarch64,x86_64] [--expect-sha256 HEX] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import shutil
import sys
import time
from pathlib import Path

from vllm_own import bgraph_json


def wheel_sha256(out_dir: str) -> tuple[str, str]:
    [wheel] = list(Path(out_dir).glob("*.whl"))
    return wheel.name, hashlib.sha256(wheel.read_bytes()).hexdigest()


def build(label: str, platform: str, cache: Path) -> tuple[dict, dict[str, tuple[str, str]]]:
    """Cold build, then no-op; the figures and the key -> 'label name' of every action."""
    shutil.rmtree(cache, ignore_errors=True)
    argv = ("--cache-dir", str(cache), "build", "-j2", "--json", "--platform", platform, label)
    start = time.monotonic()
    cold = bgraph_json(*argv)
    wall = time.monotonic() - start
    start = time.monotonic()
    noop = bgraph_json(*argv)
    noop_wall = time.monotonic() - start
    [out] = [v for k, v in cold["outputs"].items() if k.split(" (")[0] == label]
    name, sha = wheel_sha256(out)
    executed = [a for a in cold["actions"] if a["status"] == "executed"]
    by_kind = collections.Counter(a["mnemonic"] for a in executed)
    figures = {"wall_s": round(wall, 1), "cpu_s": cold.get("cpu_s"), "executed": len(executed),
               "hits": cold["hits"], "by_mnemonic": dict(by_kind.most_common()),
               "noop_wall_s": round(noop_wall, 2), "noop_executed": noop["executed"], "wheel": name, "sha256": sha}
    keys = {a["key"]: (a["mnemonic"], f"{a['label']} {a['name']}") for a in cold["actions"]}
    return figures, keys


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", default="//wheels:vllm-sm121")
    ap.add_argument("--cache-root", type=Path, default=Path("/tmp/bgraph-plat"))
    ap.add_argument("--platforms", default="aarch64,x86_64")
    ap.add_argument("--expect-sha256", help="the aarch64 wheel's sha256 from another workspace and cache")
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args()
    result: dict = {"label": args.label}
    keys: dict[str, dict[str, tuple[str, str]]] = {}
    for platform in args.platforms.split(","):
        result[platform], keys[platform] = build(args.label, platform, args.cache_root / platform)
        print(platform, json.dumps(result[platform]), flush=True)
        shutil.rmtree(args.cache_root / platform, ignore_errors=True)  # ~15 GB each
        if args.json_out:
            args.json_out.write_text(json.dumps(result, indent=1))
    if len(keys) == 2:
        a, b = keys.values()
        shared = sorted(a.keys() & b.keys())
        result["shared_actions"] = len(shared)
        result["shared_by_mnemonic"] = dict(collections.Counter(a[k][0] for k in shared).most_common())
        result["shared_non_fetch"] = sorted(a[k][1] for k in shared if a[k][0] != "Fetch")
    if args.expect_sha256 and "aarch64" in result:
        result["same_sha256_as_expected"] = result["aarch64"]["sha256"] == args.expect_sha256
    print(json.dumps(result, indent=1))
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=1))
    if result.get("same_sha256_as_expected") is False:
        sys.exit(1)


if __name__ == "__main__":
    main()
