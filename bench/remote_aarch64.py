#!/usr/bin/env python3
"""A Spark's build of a target run here through BuildGrid on an emulating aarch64 worker (issue 36,
item 4): `bgraph worker --isa aarch64 --qemu <//toolchains:qemu-user's aarch64-binfmt-P>` beside
the tests' PostgreSQL + bgd stack (tests/remote_exec_servers.py), then `bgraph build --host-platform
aarch64 --remote-executor` of LABEL (default //toolchains:cuda-13.0) in CACHE, from a copy of this
repository's workspace (bgraph-out/ goes there, never into the checkout). Prints one JSON
report: wall, actions run on the worker with their durations, and the ELF machine of every
executable file of the output (all aarch64 for a native toolchain).

Usage: python3 bench/remote_aarch64.py --cache /var/tmp/arm-cache [--label L] [--slots 2]
"""

from __future__ import annotations

import argparse
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
from remote_exec_servers import ExecStack, missing_reason  # noqa: E402

ELF_MACHINES = {0x3E: "x86-64", 0xB7: "aarch64"}


def bgraph(ws: Path, cache: Path, *args: str) -> dict:
    """`bgraph build --json` in the workspace `ws` with `cache`; its summary."""
    p = subprocess.run([sys.executable, "-m", "build_graph", "-C", str(ws), "--cache-dir", str(cache), "build",
                        "--json", *args], capture_output=True, text=True, cwd=REPO)
    if p.returncode != 0:
        sys.exit(f"bgraph build {' '.join(args)} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return json.loads(p.stdout)


def elf_machines(root: Path) -> dict[str, int]:
    """How many ELF files of each machine lie below `root` (symlinks not followed)."""
    counts: dict[str, int] = {}
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            if os.path.islink(path):
                continue
            with open(path, "rb") as f:
                head = f.read(20)
            if head[:4] == b"\x7fELF":
                machine = ELF_MACHINES.get(int.from_bytes(head[18:20], "little"), hex(head[18]))
                counts[machine] = counts.get(machine, 0) + 1
    return counts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", required=True, help="bgraph cache for this run")
    ap.add_argument("--label", default="//toolchains:cuda-13.0")
    ap.add_argument("--slots", type=int, default=2)
    args = ap.parse_args()
    if missing_reason():
        sys.exit(missing_reason())
    cache = Path(args.cache)
    scratch = Path(tempfile.mkdtemp(prefix="remote-aarch64-"))
    ws = workspace_copy(scratch / "ws")
    qemu_tree = Path(bgraph(ws, cache, "//toolchains:qemu-user")["outputs"]["//toolchains:qemu-user"])
    qemu = str(qemu_tree / "usr/libexec/qemu-binfmt/aarch64-binfmt-P")
    (scratch / "stack").mkdir()
    stack = ExecStack(scratch / "stack", workers=0)
    try:
        stack.add_worker("spark", slots=args.slots, extra=("--isa", "aarch64", "--qemu", qemu))
        t0 = time.monotonic()
        summary = bgraph(ws, cache, "--host-platform", "aarch64", "--remote-executor", stack.url, args.label)
        wall = time.monotonic() - t0
    finally:
        stack.stop()
    ran = [a for a in summary["actions"] if a["status"] == "executed" and a.get("mnemonic") not in ("Fetch", "Extract")]
    [out] = [Path(p) for label, p in summary["outputs"].items() if label.startswith(args.label)]
    report = {
        "label": args.label, "wall_s": round(wall, 1), "remote": summary.get("remote_execution"),
        "executed": summary["executed"], "hits": summary["hits"],
        "exec_actions": [{"name": a["name"], "mnemonic": a.get("mnemonic"), "duration_s": a.get("duration_s")}
                         for a in ran],
        "elf_machines": elf_machines(out.resolve()),
        "version_txt": (out / "bgraph" / "version.txt").read_text().strip().splitlines()[-1]
        if (out / "bgraph" / "version.txt").exists() else None,
    }
    print(json.dumps(report, indent=1))
    shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
