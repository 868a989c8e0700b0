"""Figures of `bgraph worker` on the real stack (PostgreSQL + BuildGrid 0.9.1, tuned, 2 workers):
end-to-end latency of a trivial action, the worker's own share from ExecutedActionMetadata, and
the throughput of 50 actions with up to 16 in flight. Run: python3 bench/remote_worker.py"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests"), str(REPO)]  # the tests' real stack and client

from remote_exec_servers import ExecStack, missing_reason
from test_remote_worker import Client, sh


def _s(ts) -> float:
    return ts.seconds + ts.nanos / 1e9


def main() -> int:
    """Start the stack, measure, print one JSON object."""
    reason = missing_reason()
    if reason:
        print(reason)
        return 1
    root = Path(tempfile.mkdtemp(prefix="bgraph-bench-"))
    stack = ExecStack(root, workers=int(os.environ.get("WORKERS", "2")))
    try:
        c = Client(stack.url)
        c.execute(c.action(sh("echo warm > bgraph/out/x"), ["bgraph/out/x"]))  # trees laid out once
        walls, to_exec, worker_own, fetch, upload = [], [], [], [], []
        for _ in range(int(os.environ.get("N", "20"))):
            digest = c.action(sh(f"echo {uuid.uuid4()} > bgraph/out/x"), ["bgraph/out/x"])
            start = time.time()
            seen: dict = {}
            response, _, _ = c.execute(digest, on_stage=lambda _n, st, seen=seen: seen.setdefault(st, time.time()))
            walls.append(time.time() - start)
            to_exec.append(seen.get(c.pb.ExecutionStage.EXECUTING, start) - start)
            m = response.result.execution_metadata
            total = _s(m.worker_completed_timestamp) - _s(m.worker_start_timestamp)
            run = _s(m.execution_completed_timestamp) - _s(m.execution_start_timestamp)
            worker_own.append(total - run)
            fetch.append(_s(m.input_fetch_completed_timestamp) - _s(m.input_fetch_start_timestamp))
            upload.append(_s(m.output_upload_completed_timestamp) - _s(m.output_upload_start_timestamp))
        digests = [c.action(sh(f"echo {uuid.uuid4()} > bgraph/out/x"), ["bgraph/out/x"]) for _ in range(50)]
        start = time.time()
        with ThreadPoolExecutor(16) as pool:
            codes = list(pool.map(lambda d: Client(stack.url).execute(d)[0].status.code, digests))
        rate = 50 / (time.time() - start)

        def ms(xs):
            xs = sorted(xs)
            return {"median": round(statistics.median(xs) * 1000, 1), "p90": round(xs[int(len(xs) * 0.9)] * 1000, 1),
                    "min": round(xs[0] * 1000, 1), "max": round(xs[-1] * 1000, 1)}
        print(json.dumps({"load_avg": os.getloadavg(), "workers": len(stack.workers),
                          "latency_ms": ms(walls), "to_executing_ms": ms(to_exec),
                          "worker_own_ms": ms(worker_own), "input_fetch_ms": ms(fetch), "upload_ms": ms(upload),
                          "throughput_50_at_16_per_s": round(rate, 1), "all_ok": set(codes) == {0}}, indent=1))
    finally:
        stack.stop()
        if not os.environ.get("KEEP"):
            shutil.rmtree(root, ignore_errors=True)
        else:
            print(f"kept {root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
