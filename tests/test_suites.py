"""Checks 1 and 2: every stage suite passes on the reference and fails on the stubs."""

from __future__ import annotations

from pathlib import Path

import pytest
from _support import committed_stubs, embedded_env, real_redis_configured, stage_suites, uses_redis

from katas._kit.suites import SuiteRun, run_suite, suite_file

SUITES = stage_suites()


def _modes(kata: str, stage: int) -> list[str]:
    if uses_redis(kata, stage) and real_redis_configured():
        return ["fakeredis", "real-redis"]
    return ["fakeredis"] if uses_redis(kata, stage) else ["memory"]


CASES = [
    pytest.param(kata, stage, mode, id=f"{kata}-stage{stage}-{mode}")
    for kata, stage in SUITES
    for mode in _modes(kata, stage)
]


def _summary(run: SuiteRun, limit: int = 15) -> str:
    bad = [r for r in run.results if r.outcome != "passed"]
    lines = [f"  {r.nodeid}: {r.outcome} ({r.kind}) {r.message}" for r in bad[:limit]]
    if len(bad) > limit:
        lines.append(f"  … and {len(bad) - limit} more")
    return "\n".join(lines) or run.output[-3000:]


@pytest.mark.parametrize(("kata", "stage", "mode"), CASES)
def test_reference_passes_every_stage_suite(kata: str, stage: int, mode: str) -> None:
    env = None if mode == "real-redis" else embedded_env()
    run = run_suite(suite_file(kata, stage), impl="solutions", env=env)
    assert run.results, f"{kata} stage {stage}: no test ran\n{run.output[-3000:]}"
    assert run.returncode == 0 and not run.by_outcome("failed"), (
        f"{kata} stage {stage} ({mode}): the reference fails its own suite:\n{_summary(run)}"
    )
    skipped = run.by_outcome("skipped")
    assert mode == "real-redis" or not skipped, (
        f"{kata} stage {stage} ({mode}): tests skipped on the embedded default:\n"
        + "\n".join(f"  {r.nodeid}: {r.message}" for r in skipped)
    )


@pytest.mark.parametrize(
    ("kata", "stage"), [pytest.param(k, s, id=f"{k}-stage{s}") for k, s in SUITES]
)
def test_every_test_fails_on_the_committed_stubs(kata: str, stage: int, tmp_path: Path) -> None:
    stubs = committed_stubs(tmp_path / "stubs")
    run = run_suite(suite_file(kata, stage), impl=str(stubs), env=embedded_env())
    assert run.results, f"{kata} stage {stage}: no test ran on the stubs\n{run.output[-3000:]}"
    wrong = [r for r in run.results if r.outcome != "failed" or r.kind != "not_implemented"]
    assert not wrong, (
        f"{kata} stage {stage}: every test must fail on the untouched stub with "
        "'not implemented yet' (a test that passes on a stub asserts nothing; an import or "
        "fixture error hides the learner's task):\n"
        + "\n".join(f"  {r.nodeid}: {r.outcome} ({r.kind}) {r.message}" for r in wrong)
    )
