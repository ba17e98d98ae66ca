"""The red loop, measured: each catalogue entry's full-suite run against the green run.

A learner with one bug runs ``pytest katas/<kata> -k stageN`` and waits for the verdict;
under the default (``dev``) profile, shrinking included, that wait must stay within
:data:`MAX_RATIO` × the same suite's green run, and no test may run past
:data:`MAX_TEST_S`. This tool runs every entry (or those matching ``--only``) the way the
learner would — the whole stage suite, the default profile — and prints one row per entry
with its red time, the green time, their ratio and its slowest test. It exits 1 if any
entry breaks a bound. It is too slow for CI (one suite run per entry, with shrinking):

    python tests/red_loop.py                     # every entry, one run at a time
    python tests/red_loop.py --only job_scheduler/stage1 --jobs 2
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _support import learners_env

from katas._registry import mutants
from katas._registry.suites import SuiteRun, run_suite, suite_files

MAX_RATIO = 3.0
MAX_TEST_S = 30.0
#: ``12.34s call     katas/x/test_stage1.py::test_y``: pytest's --durations line.
_DURATION = re.compile(r"^(?P<s>[\d.]+)s (?:call|setup|teardown)\s+(?P<test>\S+)", re.M)


@dataclass(frozen=True)
class Timed:
    seconds: float
    slowest_s: float
    slowest: str
    failed: int


def timed_run(kata: str, stage: int, impl: str) -> Timed:
    """One run of the stage suite under the default profile, as a learner's first run:
    with an empty example database, so nothing found earlier is replayed."""
    with tempfile.TemporaryDirectory(prefix="kata-red-db-") as db:
        env = learners_env()
        env["HYPOTHESIS_STORAGE_DIRECTORY"] = db
        run: SuiteRun = run_suite(
            suite_files(kata, stage),
            impl=impl,
            env=env,
            pytest_args=["--durations=1", "--durations-min=0"],
            timeout_s=1800,
        )
    match = _DURATION.search(run.output)
    slowest_s, slowest = (float(match["s"]), match["test"]) if match else (0.0, "?")
    return Timed(run.seconds, slowest_s, slowest.split("::", 1)[-1], len(run.failures()))


def red(mutant: mutants.Mutant) -> Timed:
    with tempfile.TemporaryDirectory(prefix="kata-red-") as tmp:
        impl = str(mutants.materialise(mutant, Path(tmp) / "impl"))
        return timed_run(mutant.kata, mutant.stage, impl)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="entries whose name contains this")
    parser.add_argument("--jobs", type=int, default=1, help="runs at once (timings interfere)")
    args = parser.parse_args(argv)
    chosen = [m for m in mutants.load() if args.only in m.name]
    stages = sorted({(m.kata, m.stage) for m in chosen})
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        greens = pool.map(lambda ks: timed_run(ks[0], ks[1], "solutions"), stages)
        green = dict(zip(stages, greens, strict=True))
        for (kata, stage), g in green.items():
            print(
                f"green {kata} stage {stage}: {g.seconds:.1f}s "
                f"(slowest {g.slowest_s:.1f}s {g.slowest})",
                flush=True,
            )
        bad = 0
        for mutant, r in zip(chosen, pool.map(red, chosen), strict=True):
            g = green[mutant.kata, mutant.stage]
            ratio = r.seconds / g.seconds
            broken = ratio > MAX_RATIO or r.slowest_s > MAX_TEST_S
            bad += broken
            print(
                f"{'✗' if broken else ' '} {ratio:4.1f}× {r.seconds:6.1f}s "
                f"(green {g.seconds:5.1f}s) slowest {r.slowest_s:5.1f}s {r.slowest:<60.60} "
                f"{r.failed:3d} failed  {mutant.name}",
                flush=True,
            )
    print(
        f"{bad} of {len(chosen)} entries break the red-loop bounds "
        f"(ratio ≤ {MAX_RATIO}×, no test past {MAX_TEST_S:.0f}s)"
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
