"""The blind bug hunt: run bugs written without seeing the suites, and say which survive.

A suite is measured against realistic bugs nobody wrote it for. Before a stage's suite
is called done, someone who has read only the stage's prompt (``README.md``), ``api.py``,
the stub and the reference — never the suites, never ``tests/mutants/`` — writes at
least ten bugs into a folder of their own, one diff per bug, in the catalogue's format
without the ``catches`` line::

    HUNT/<kata>/stageN_<bug>.diff
        # bug: the mistake, as a learner would make it
        # why: what goes wrong, and when
        # rule: the prompt's sentence it breaks
        --- a/<kata>/stageN.py
        +++ b/<kata>/stageN.py
        ...

and runs them all, as a learner would run a stage (the whole stage suite, the default
hypothesis profile, an empty example database, the embedded fakeredis)::

    python tests/hunt.py HUNT                       # every bug, one run at a time
    python tests/hunt.py HUNT --only kv_cache/stage2 --jobs 2
    python tests/hunt.py HUNT --first               # each run up to its first failure

Each bug gets one line (caught, with the tests that failed; or SURVIVED) and each stage
a tally. Bugs are written down before the first run, so none is tuned to slip past.
Every survivor becomes a catalogue entry (``tests/mutants/``, with its ``catches``) and
a test at its rule's boundary; CONTRIBUTING.md ("The blind bug hunt") says how. Exit
status: 1 if any bug survived or did not apply, else 0.
"""

from __future__ import annotations

import argparse
import functools
import sys
import tempfile
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _support import learners_env

from katas._registry import mutants
from katas._registry.suites import SuiteRun, run_suite, suite_files


@dataclass(frozen=True)
class Verdict:
    bug: mutants.Mutant
    failed: tuple[str, ...]  # the tests that failed: empty if it survived
    problem: str = ""  # why it could not be run (a diff that does not apply)

    @property
    def caught(self) -> bool:
        return bool(self.failed) and not self.problem


def load(folder: Path) -> list[mutants.Mutant]:
    """Every ``<kata>/stageN_<bug>.diff`` under ``folder``, sorted as the catalogue."""
    found = (mutants.parse(p, required=("bug", "why")) for p in folder.glob("*/*.diff"))
    return sorted(found, key=lambda m: (m.kata, m.stage, m.slug))


def judge(bug: mutants.Mutant, cluster: str | None = None, first: bool = False) -> Verdict:
    """One run of the bug's stage suite; with ``cluster`` (a ``redis-server``) on a real
    Redis Cluster, as ``KATA_REDIS_CLUSTER`` runs it; with ``first``, up to its first
    failure (the verdict is the same, the failed tests are one)."""
    with tempfile.TemporaryDirectory(prefix="kata-hunt-") as tmp:
        try:
            impl = mutants.materialise(bug, Path(tmp) / "impl")
        except ValueError as exc:
            return Verdict(bug, (), str(exc).splitlines()[0])
        env = learners_env()
        env["HYPOTHESIS_STORAGE_DIRECTORY"] = str(Path(tmp) / "db")
        if cluster:
            env["KATA_REDIS_CLUSTER"] = cluster
        run: SuiteRun = run_suite(
            suite_files(bug.kata, bug.stage),
            impl=str(impl),
            env=env,
            timeout_s=1800,
            pytest_args=("-x",) if first else (),
        )
    failed = tuple(r.nodeid.split("::", 1)[-1] for r in run.failures())
    problem = "" if failed or run.ok else (run.collection_error or run.run_error or "no verdict")
    return Verdict(bug, failed, problem)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="the hunt's folder: <kata>/stageN_<bug>.diff")
    parser.add_argument("--only", default="", help="bugs whose name contains this")
    parser.add_argument("--jobs", type=int, default=1, help="runs at once")
    parser.add_argument(
        "--cluster",
        metavar="REDIS_SERVER",
        help="run on a real Redis Cluster of this redis-server (bugs only a cluster shows)",
    )
    parser.add_argument(
        "--first",
        action="store_true",
        help="stop each run at its first failure: same verdicts, a caught bug's run is shorter",
    )
    args = parser.parse_args(argv)
    chosen = [m for m in load(args.folder) if args.only in m.name]
    written: Counter[tuple[str, int]] = Counter((m.kata, m.stage) for m in chosen)
    caught: Counter[tuple[str, int]] = Counter()
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for verdict in pool.map(
            functools.partial(judge, cluster=args.cluster, first=args.first), chosen
        ):
            bug = verdict.bug
            if verdict.caught:
                caught[bug.kata, bug.stage] += 1
                shown = " ".join(verdict.failed[:4]) + (" …" if len(verdict.failed) > 4 else "")
                line = f"  caught    {bug.name}: {len(verdict.failed)} failed ({shown})"
            elif verdict.problem:
                line = f"! not run   {bug.name}: {verdict.problem}"
            else:
                line = f"✗ SURVIVED  {bug.name}: {bug.bug}"
            print(line, flush=True)
    for kata, stage in sorted(written):
        n, c = written[kata, stage], caught[kata, stage]
        print(f"{kata} stage {stage}: {n} written, {c} caught, {n - c} not caught")
    return 0 if sum(caught.values()) == len(chosen) else 1


if __name__ == "__main__":
    sys.exit(main())
