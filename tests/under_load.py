"""Green under load: every reference suite, run again and again on an oversubscribed CPU.

A learner's laptop is busy (a browser, an IDE, a build), and a suite whose deadlines
measure the machine's mood instead of what the test controls fails there on a correct
solution. This tool keeps ``--busy`` processes spinning (default: 4 per core) while it
runs each stage suite on the reference ``--runs`` times in a row, one suite at a time,
as a learner would (the default profile, the embedded fakeredis), and prints every test
that failed in any run. It exits 1 if any did. Too slow for CI:

    python tests/under_load.py                          # every stage, 10 runs each
    python tests/under_load.py --only job_scheduler/3 --runs 3
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _support import learners_env, stage_suites

from katas._registry.suites import run_suite, suite_files


def _spin() -> None:  # a busy process: all the CPU it can get, until it is terminated
    while True:
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="stages like kata/N containing this")
    parser.add_argument("--runs", type=int, default=10, help="runs of each suite (10)")
    parser.add_argument("--busy", type=int, default=4 * (os.cpu_count() or 1))
    args = parser.parse_args(argv)
    stages = [(k, s) for k, s in stage_suites() if args.only in f"{k}/{s}"]
    spinners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(args.busy)]
    for spinner in spinners:
        spinner.start()
    failed: Counter[str] = Counter()
    try:
        for kata, stage in stages:
            for n in range(1, args.runs + 1):
                env = learners_env()
                run = run_suite(suite_files(kata, stage), impl="solutions", env=env, timeout_s=3600)
                bad = [r.nodeid for r in run.failures()] or ([] if run.ok else ["(no verdict)"])
                failed.update(f"{kata}/{stage}: {b}" for b in bad)
                verdict = "green" if run.ok else f"{len(bad)} failed: " + ", ".join(bad[:3])
                print(f"{kata} stage {stage} run {n}: {verdict} ({run.seconds:.0f}s)", flush=True)
    finally:
        for spinner in spinners:
            spinner.terminate()
    for test, times in failed.most_common():
        print(f"✗ {times}/{args.runs} runs  {test}")
    print(f"{len(failed)} tests failed at least once under {args.busy} busy processes")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
