"""The headline of the hermetic toolchains, measured: a fresh cache inside a Debian 13 root builds
the whole //wheels:vllm-sm121 from a remote cache that this Debian 12 host filled.

Steps (one run):
1. nginx (WebDAV) on 127.0.0.1 with an empty store;
2. this host's cache (default ~/.cache/bgraph, or --host-cache) already holds the wheel (build it
   first: it takes about half an hour); `bgraph build --remote-upload` fills the empty remote from
   it without running anything (the backfill), timed;
3. a Debian 13 root (debootstrap from apt's configured mirror; python3 3.13, no compiler) with
   bgraph installed for its Python; `bgraph build //wheels:vllm-sm121 --remote-cache` on a fresh
   cache there: wall time, actions executed, bytes fetched, and the wheel's sha256 against the
   host's.

Usage: python3 bench/cross_distro.py [--label //wheels:vllm-sm121] [--host-cache DIR] [--keep DIR]
Prints one JSON object (the figures BENCHMARKS.md records).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from bgraph_testlib import workspace_copy  # noqa: E402
from foreign_root import bgraph_in, install_bgraph, make_root, python_version, run_in  # noqa: E402
from remote_servers import Nginx  # noqa: E402


def wheel_sha(tree_dir: Path) -> str:
    [wheel] = list(tree_dir.glob("*.whl"))
    return hashlib.sha256(wheel.read_bytes()).hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", default="//wheels:vllm-sm121")
    ap.add_argument("--host-cache", default=os.path.expanduser("~/.cache/bgraph"))
    ap.add_argument("--rev", default="HEAD", help="the commit measured: both sides run its bgraph and workspace")
    ap.add_argument("--keep", help="work directory to keep (default: a temporary one, removed); a root "
                                   "already made there is reused, with a fresh cache")
    args = ap.parse_args()
    work = Path(args.keep or tempfile.mkdtemp(prefix="bgraph-cross-distro-"))
    work.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", args.rev], capture_output=True, text=True,
                            check=True).stdout.strip()
    report: dict = {"label": args.label, "commit": commit}
    snapshot = work / "snapshot"  # one commit for both sides, whatever the checkout does meanwhile
    shutil.rmtree(snapshot, ignore_errors=True)
    snapshot.mkdir()
    archive = subprocess.run(["git", "-C", REPO, "archive", args.rev], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", snapshot], input=archive, check=True)
    shutil.rmtree(work / "nginx", ignore_errors=True)
    nginx = Nginx(work / "nginx")
    try:
        ws = workspace_copy(work / "host-ws", snapshot)
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "build_graph", "-C", str(ws), "--cache-dir", args.host_cache,
                               "build", "--json", "-j2", "--remote-cache", nginx.url, "--remote-allow-unsigned",
                               "--remote-upload", args.label],
                              capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(snapshot)},
                              cwd=snapshot)
        if proc.returncode != 0:
            sys.exit(proc.stderr[-3000:])
        host = json.loads(proc.stdout)
        report["host_fill"] = {"wall_s": round(time.monotonic() - t0, 1), "executed": host["executed"],
                               "backfilled": host["remote"]["backfilled"], "uploaded": host["remote"]["uploaded"],
                               "uploaded_bytes": host["remote"]["uploaded_bytes"]}
        host_tree = Path(os.readlink(host["outputs"][args.label]))
        report["host_wheel_sha256"] = wheel_sha(host_tree)

        t0 = time.monotonic()
        root = work / "trixie"
        if not (root / "usr" / "bin" / "python3").exists():
            make_root(root)
        shutil.rmtree(root / "cache", ignore_errors=True)
        install_bgraph(root, source=snapshot)
        report["root"] = {"made_s": round(time.monotonic() - t0, 1), "python": python_version(root),
                          "gcc": run_in(root, ["sh", "-c", "command -v gcc || echo none"]).stdout.strip()}
        t0 = time.monotonic()
        run = bgraph_in(root, "build", "--json", "-j2", "--remote-cache", nginx.url, "--remote-allow-unsigned",
                        args.label)
        wall = time.monotonic() - t0
        if run.returncode != 0:
            sys.exit(run.stdout[-2000:] + run.stderr[-3000:])
        summary = json.loads(run.stdout)
        link = Path(summary["outputs"][args.label])
        tree = root / os.readlink(root / link.relative_to("/")).lstrip("/")
        compiles = [a for a in summary["actions"] if a["status"] == "executed" and a["mnemonic"].startswith("Cuda")]
        report["root_build"] = {"wall_s": round(wall, 1), "executed": summary["executed"],
                                "compiles_executed": len(compiles), "remote_hits": summary["remote"]["hits"],
                                "downloaded_bytes": summary["remote"]["downloaded_bytes"],
                                "ignored": summary["remote"]["ignored"], "actions": len(summary["actions"])}
        report["root_wheel_sha256"] = wheel_sha(tree)
        report["identical"] = report["root_wheel_sha256"] == report["host_wheel_sha256"]
    finally:
        nginx.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
