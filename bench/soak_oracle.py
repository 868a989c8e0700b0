"""Soak the oracle: run tests/test_oracle.py's state machine (incremental build == fresh-cache
build after random edits) for N minutes, and print the seed and the number of steps run.

    python3 bench/soak_oracle.py --minutes 30 --seed 1000 [--steps 40] [--skip rule,rule:value]

One Hypothesis run of unbounded examples with the given seed; no example starts after the time
is up. A failure prints Hypothesis's shrunk sequence, its @reproduce_failure blob and the shell
recipe; the soak stops there (--keep-going: a new run with the next seed).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1] / "tests"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=int(time.time()) % 100000)
    p.add_argument("--steps", type=int, default=40, help="steps per example (stateful_step_count)")
    p.add_argument("--skip", default="", help="BGRAPH_ORACLE_SKIP: rules (or rule:value) left out")
    p.add_argument("--no-shrink", action="store_true", help="report a failure as found, unshrunk")
    p.add_argument("--keep-going", action="store_true", help="after a failure, go on with the next seed")
    p.add_argument("--now", action="store_true",
                   help="edits may also keep the mtime they were written with (racy by timing: not reproducible)")
    args = p.parse_args()
    os.environ["BGRAPH_ORACLE_SKIP"] = args.skip
    os.environ["BGRAPH_ORACLE_NOW"] = "1" if args.now else ""
    scratch = Path(tempfile.mkdtemp(prefix="bgraph-soak-oracle-"))
    os.environ["HYPOTHESIS_STORAGE_DIRECTORY"] = str(scratch / "hypothesis")  # not <cwd>/.hypothesis
    sys.path[:0] = [str(TESTS), str(TESTS.parent)]
    import test_oracle  # noqa: E402  (reads BGRAPH_ORACLE_SKIP)

    end = time.monotonic() + args.minutes * 60
    steps = failures = 0
    seed = last = args.seed
    print(f"soak: seed {seed}, {args.minutes} min, up to {args.steps} steps per example"
          + (f", skipping {args.skip}" if args.skip else ""), flush=True)
    try:
        while time.monotonic() < end:
            box: list = []
            place = scratch / f"seed-{seed}"
            failure = None
            try:
                test_oracle.run_machine(place, seed, examples=10**9, steps=args.steps, shrink=not args.no_shrink,
                                        deadline=end, machine_box=box, progress=True)
            except test_oracle.TimeUp:
                pass
            except Exception as e:  # noqa: BLE001 - the failure is the report
                # Past the deadline with no failure seen, Hypothesis only saw TimeUp stop an example
                # it was replaying (it calls that flaky): that is the time being up.
                if not box or box[0].failed or time.monotonic() < end:
                    failure = e
            if failure is not None:
                failures += 1
                print(f"\nsoak: FAILED with seed {seed} after {box[0].steps_run if box else '?'} steps "
                      f"(shrinking included):\n{failure}\n", flush=True)
                if box and box[0].first_failure and box[0].first_failure not in str(failure):
                    print(f"soak: the first failure seen (before shrinking):\n{box[0].first_failure}\n", flush=True)
                print("again: BGRAPH_ORACLE_SEED={} BGRAPH_ORACLE_EXAMPLES=1000000000 BGRAPH_ORACLE_STEPS={}{} "
                      "python3 -m pytest -q -s tests/test_oracle.py -k incremental_builds   (or Hypothesis's "
                      "@reproduce_failure blob above)".format(
                          seed, args.steps, f" BGRAPH_ORACLE_SKIP={args.skip}" if args.skip else ""), flush=True)
            shutil.rmtree(place, ignore_errors=True)
            if box:
                steps += box[0].steps_run
                print(f"soak: seed {seed}: {box[0].steps_run} steps, {box[0].fresh.builds} fresh builds; "
                      + ", ".join(f"{k} {v}" for k, v in sorted(box[0].rules_run.items())), flush=True)
            last = seed
            if failure is not None and not args.keep_going:
                break
            seed += 1
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"soak: seeds {args.seed}..{last}, {steps} steps in {args.minutes} min, {failures} failure(s)", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
