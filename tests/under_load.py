"""Green under load: every reference suite, run again and again on an oversubscribed CPU.

A learner's laptop is busy (a browser, an IDE, a build), and a suite whose deadlines
measure the machine's mood instead of what the test controls fails there on a correct
solution. This tool keeps ``--busy`` processes spinning (default: 4 per core) while it
runs each stage suite on the reference ``--runs`` times in a row, as a learner would (the
default profile, the embedded fakeredis), and prints every test that failed in any run,
with its message. It exits 1 if any did. Too slow for CI:

    python tests/under_load.py                          # every stage, 10 runs each
    python tests/under_load.py --only job_scheduler/3 kv_cache --runs 3
    python tests/under_load.py --together 3             # 3 stages at a time
    python tests/under_load.py --ci --only /3           # as CI's second pass runs them

``--ci`` runs the suites as CI's second pass does: the ``ci`` profile, on a real
``redis-server`` this tool starts (``KATA_REDIS_URL``) with private servers for the
fault tests (``KATA_REDIS_SERVER``) — where a real server's clock runs and a heartbeat
that comes late on a busy machine loses its lease for real.

Every spinner and every suite run is a session of its own. Linux's scheduler shares the
CPU between sessions first (autogroup), so spinners that shared one session would cost
a suite no more than one other busy program: with ``--busy 8`` on 2 cores each suite
gets at most 2/9 of the CPU, and with ``--together K`` 2/(8 + K), a heavier load still.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import sys
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _support import learners_env, stage_suites

from katas._harness.redis import ProcessNode
from katas._registry.suites import run_suite, suite_files


def _spin() -> None:  # a busy process in a session of its own, until it is terminated
    os.setsid()
    while True:
        pass


@contextlib.contextmanager
def _ci_env() -> Iterator[dict[str, str]]:
    """CI's second pass: the ci profile, a real server of this run, private ones too."""
    server = ProcessNode(["redis-server"])  # the harness's own: a free port, PING before use
    try:
        yield {
            **learners_env(),
            "KATA_PROFILE": "ci",
            "KATA_REDIS_URL": server.url,
            "KATA_REDIS_SERVER": "redis-server",
        }
    finally:
        server.close()


def _runs(kata: str, stage: int, runs: int, env: dict[str, str]) -> list[tuple[str, str]]:
    """Run one stage suite ``runs`` times in a row; (test, message) of every failure."""
    failed: list[tuple[str, str]] = []
    for n in range(1, runs + 1):
        run = run_suite(suite_files(kata, stage), impl="solutions", env=env, timeout_s=3600)
        bad = [(r.nodeid, r.message) for r in run.failures()]
        if not run.ok and not bad:
            bad = [("(no verdict)", run.output[-2000:])]
        failed += [(f"{kata}/{stage}: {test}", message) for test, message in bad]
        names = "".join(f"\n  {test}: {message[:300]}" for test, message in bad[:3])
        verdict = f"{len(bad)} failed:{names}" if bad else "green"
        print(f"{kata} stage {stage} run {n}: {verdict} ({run.seconds:.0f}s)", flush=True)
    return failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--only", nargs="+", default=[""], help="stages like kata/N containing any of these"
    )
    parser.add_argument("--runs", type=int, default=10, help="runs of each suite (10)")
    parser.add_argument("--busy", type=int, default=4 * (os.cpu_count() or 1))
    parser.add_argument("--together", type=int, default=1, help="stages run at once (1)")
    parser.add_argument("--ci", action="store_true", help="as CI's second pass: real Redis")
    args = parser.parse_args(argv)
    stages = [(k, s) for k, s in stage_suites() if any(o in f"{k}/{s}" for o in args.only)]
    spinners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(args.busy)]
    for spinner in spinners:
        spinner.start()
    try:
        with _ci_env() if args.ci else contextlib.nullcontext(learners_env()) as env, \
                ThreadPoolExecutor(args.together) as pool:  # fmt: skip
            done = pool.map(lambda ks: _runs(ks[0], ks[1], args.runs, env), stages)
            failed = [failure for failures in done for failure in failures]
    finally:
        for spinner in spinners:
            spinner.terminate()
    times = Counter(test for test, _ in failed)
    for test, message in dict(failed).items():
        print(f"✗ {times[test]}/{args.runs} runs  {test}\n    {message[:600]}")
    print(f"{len(times)} tests failed at least once under {args.busy} busy processes")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
