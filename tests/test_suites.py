"""Checks 1 and 2: every stage suite passes on the reference and fails on the stubs; and
the reference's run calls every public name of its stage (:mod:`katas._registry.reach`).

Every run starts at once on a pool as wide as the machine; each test waits for its own.
"""

from __future__ import annotations

import functools
import importlib
import os
import tempfile
from collections.abc import Callable, Hashable, Iterator, Mapping
from pathlib import Path

import pytest
from _support import (
    Pool,
    cluster_configured,
    committed_stubs,
    embedded_env,
    module_pool,
    real_redis_configured,
    selected,
    stage_suites,
    uses_cluster,
    uses_redis,
)

from katas._harness.redis_fixture import CLUSTER_SKIP
from katas._registry import reach
from katas._registry.catalog import Catalog
from katas._registry.impl import REPO_ROOT
from katas._registry.suites import SuiteRun, run_suite, suite_files
from katas._registry.warm import WarmStart

SUITES = stage_suites()
#: A test here waits for a whole suite run that shares the machine with others.
WAIT_S = 1200
#: Every run forked from one process that has imported pytest, hypothesis, anyio, trio
#: and the Redis clients already (tests/test_catalogue.py's, for the same reason).
_WARM = WarmStart()


def _modes(kata: str, stage: int) -> list[str]:
    """Where the stage's reference runs: in memory, or on the embedded fakeredis — or, with
    a real server configured, on that server instead (every plain ``pytest`` runs the
    embedded default already; CI's run with servers spends its time on the real ones) —
    and on a real Redis Cluster too where the prompt promises one."""
    if not uses_redis(kata, stage):
        return ["memory"]
    modes = ["real-redis" if real_redis_configured() else "fakeredis"]
    if uses_cluster(kata, stage) and cluster_configured():
        modes.append("cluster")
    return modes


RUNS = [(kata, stage, mode) for kata, stage in SUITES for mode in _modes(kata, stage)]
CASES = [pytest.param(k, s, m, id=f"{k}-stage{s}-{m}") for k, s, m in RUNS]


def _summary(run: SuiteRun, limit: int = 15) -> str:
    bad = [r for r in run.results if r.outcome != "passed"]
    lines = [f"  {r.nodeid}: {r.outcome} ({r.kind}) {r.message}" for r in bad[:limit]]
    if len(bad) > limit:
        lines.append(f"  … and {len(bad) - limit} more")
    return "\n".join(lines) or run.output[-3000:]


#: (kata, stage) -> the public names of the stage its embedded reference run called.
_REACHED: dict[tuple[str, int], set[str]] = {}


def _reference(kata: str, stage: int, mode: str, base: Mapping[str, str]) -> SuiteRun:
    """The stage's suite on the reference, in ``mode``, from the environment ``base``; the
    stage's first mode also records the public names its run called."""
    if mode == "cluster":  # every test on the shared cluster, faults on private servers
        env = {**embedded_env(base), "KATA_REDIS_CLUSTER": base["KATA_REDIS_CLUSTER"]}
        return run_suite(suite_files(kata, stage), impl="solutions", env=env, warm=_WARM)
    if mode == "real-redis":  # a real server, or an external one: not the cluster
        env = {k: v for k, v in base.items() if k != "KATA_REDIS_CLUSTER"}
    else:
        env = embedded_env(base)
    with tempfile.TemporaryDirectory(prefix="kata-reached-") as tmp:
        names = Path(tmp) / "reached"
        env[reach.ENV_REACHED] = str(names)
        run = run_suite(suite_files(kata, stage), impl="solutions", env=env, warm=_WARM)
        _REACHED[kata, stage] = set(names.read_text().split()) if names.exists() else set()
    return run


def _stubs(kata: str, stage: int, base: Mapping[str, str]) -> SuiteRun:
    with tempfile.TemporaryDirectory(prefix="kata-stubs-") as tmp:
        stubs = committed_stubs(Path(tmp) / "stubs")
        return run_suite(
            suite_files(kata, stage), impl=str(stubs), env=embedded_env(base), warm=_WARM
        )


#: Whole stage suites, the longest runs of the session: started first.
POOL_ORDER = 0


def start_runs(items: list[pytest.Item]) -> Pool[SuiteRun]:
    jobs: dict[Hashable, Callable[[], SuiteRun]] = {}
    base = dict(os.environ)
    for p in selected(items, "test_reference_passes_every_stage_suite"):
        k, s, m = p["kata"], p["stage"], p["mode"]
        jobs["reference", k, s, m] = functools.partial(_reference, k, s, m, base)
    for p in selected(items, "test_every_public_name_of_a_stage_is_called_by_its_suite"):
        k, s = p["kata"], p["stage"]
        m = _modes(k, s)[0]
        jobs["reference", k, s, m] = functools.partial(_reference, k, s, m, base)
    for p in selected(items, "test_every_test_fails_on_the_committed_stubs"):
        k, s = p["kata"], p["stage"]
        jobs["stubs", k, s] = functools.partial(_stubs, k, s, base)
    return Pool(jobs)


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest) -> Iterator[Pool[SuiteRun]]:
    pool = module_pool(request, start_runs)
    yield pool
    pool.shutdown()
    _WARM.close()


@pytest.mark.timeout(WAIT_S)
@pytest.mark.parametrize(("kata", "stage", "mode"), CASES)
def test_reference_passes_every_stage_suite(
    kata: str, stage: int, mode: str, runs: Pool[SuiteRun]
) -> None:
    run = runs.result(("reference", kata, stage, mode))
    assert run.results, f"{kata} stage {stage}: no test ran\n{run.output[-3000:]}"
    assert run.returncode == 0 and not run.by_outcome("failed"), (
        f"{kata} stage {stage} ({mode}): the reference fails its own suite:\n{_summary(run)}"
    )
    # the one skip the embedded default may have: a test that needs a real Redis Cluster
    skipped = [r for r in run.by_outcome("skipped") if not r.message.startswith(CLUSTER_SKIP)]
    assert mode in ("real-redis", "cluster") or not skipped, (
        f"{kata} stage {stage} ({mode}): tests skipped on the embedded default:\n"
        + "\n".join(f"  {r.nodeid}: {r.message}" for r in skipped)
    )


@pytest.mark.timeout(WAIT_S)
@pytest.mark.parametrize(
    ("kata", "stage"), [pytest.param(k, s, id=f"{k}-stage{s}") for k, s in SUITES]
)
def test_every_test_fails_on_the_committed_stubs(
    kata: str, stage: int, runs: Pool[SuiteRun]
) -> None:
    run = runs.result(("stubs", kata, stage))
    assert run.results, f"{kata} stage {stage}: no test ran on the stubs\n{run.output[-3000:]}"
    wrong = [r for r in run.results if r.outcome != "failed" or r.kind != "not_implemented"]
    assert not wrong, (
        f"{kata} stage {stage}: every test must fail on the untouched stub with "
        "'not implemented yet' (a test that passes on a stub asserts nothing; an import or "
        "fixture error hides the learner's task):\n"
        + "\n".join(f"  {r.nodeid}: {r.outcome} ({r.kind}) {r.message}" for r in wrong)
    )


@pytest.mark.timeout(WAIT_S)
@pytest.mark.parametrize(
    ("kata", "stage"), [pytest.param(k, s, id=f"{k}-stage{s}") for k, s in SUITES]
)
def test_every_public_name_of_a_stage_is_called_by_its_suite(
    kata: str, stage: int, runs: Pool[SuiteRun]
) -> None:
    """A stub function no test calls could stay unimplemented while its stage goes green:
    every public function, method and property of the stage module (the stub's surface is
    the reference's: test_surface) is called by the suite itself, not only from inside the
    reference."""
    runs.result(("reference", kata, stage, _modes(kata, stage)[0]))
    name = Catalog(REPO_ROOT / "katas").get(kata).stage(stage).module
    module = importlib.import_module(f"solutions.{kata}.{name}")
    missing = reach.expected(module, f"{kata}/stage{stage}") - _REACHED[kata, stage]
    assert not missing, (
        f"{kata} stage {stage}: no test of the stage calls these public names of "
        f"{kata}/{name}.py (a stub could leave them unimplemented and pass):\n"
        + "\n".join(f"  {m.partition(':')[2]}" for m in sorted(missing))
    )
