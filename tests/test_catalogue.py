"""Check 3: every entry of the classic-bug catalogue is caught by the tests it names.

An entry counts only if each named test fails *by assertion* on the mutant and the
mutant still passes at least 80% of the stage's other tests (a realistic bug, not a
crash) — or, for a bug in a rule nearly every workload reaches (no backoff at all), at
least half of them with every other failure an assertion too: a crash fails nearly
everything, and by error. Both are judged on a seeded sample of the others
(:mod:`_sampled`), which tells a crash from a bug as well as all of them would, in a
fraction of the time: a small sample first, and a larger one only for an entry that
fails one of the small sample's tests. Runs use the ``mutant`` hypothesis profile: derandomized, no
shrinking. All entries start at once on a pool as wide as the machine; each test waits
for its own.
The sweep runs with ``pytest --catalogue`` (CI always adds it).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

import _sampled
import pytest
from _support import Pool, embedded_env, module_pool, selected

from katas._harness.redis_fixture import CLUSTER_SKIP, ENV_CLUSTER, ENV_SERVER
from katas._harness.waiting import ENV_PATIENCE
from katas._registry import mutants
from katas._registry.impl import REPO_ROOT
from katas._registry.suites import SuiteRun, run_suite, suite_files
from katas._registry.warm import WarmStart

CATALOGUE = mutants.load()
OTHERS_MUST_PASS = 0.8
#: What a bug in a pervasive rule must still pass, when its every failure is by assertion.
OTHERS_MUST_PASS_BY_ASSERTION = 0.5
#: How many of the stage's other tests a run samples (a crash fails nearly all of them).
#: Few, since the sweep is most of CI's time and most entries pass every one of them
#: (4 instead of 6 took a tenth off the sweep). An entry that fails any of them gets a
#: second look at a larger sample, which alone judges it: once, at 10, an entry that
#: fails many tests fell under the floor by chance. The sample is seeded by the entry's
#: name, so a verdict never changes from run to run; what 4 give up is a new entry that
#: fails half its suite passing all 4 (1 in 16) and being let in as realistic.
OTHERS_SAMPLED = 4
OTHERS_SECOND_LOOK = 20
#: A test here waits for a suite run that shares the machine with others.
WAIT_S = 1200

Runs = tuple[SuiteRun, SuiteRun]  # the named tests, then all the others (of one run)
#: Hundreds of runs: each forked from one process that has imported pytest, hypothesis,
#: anyio, trio and the Redis clients already (about 0.6 s a run saved).
_WARM = WarmStart()


def _cluster_server(base: Mapping[str, str] = os.environ) -> str | None:
    """The ``redis-server`` a cluster entry's tests build their clusters of, if any."""
    return base.get(ENV_CLUSTER) or base.get(ENV_SERVER) or None


def _judged(mutant: mutants.Mutant, base: Mapping[str, str]) -> Runs:
    """The named tests of a run of the suite on the mutant, and the others of that run, or
    of a second one with a larger sample where any of the first's failed."""
    named, others = _run(mutant, base, OTHERS_SAMPLED)
    if others.failures():  # the named tests' verdict stands: the second look runs only others
        _, others = _run(mutant, base, OTHERS_SECOND_LOOK, others_only=True)
    return named, others


def _not_realistic(others: SuiteRun) -> str:
    """Why the other tests' results say crash rather than bug (empty: they do not)."""
    passed = len(others.by_outcome("passed"))
    total = len(others.results)
    crashed = [r for r in others.failures() if r.kind != "assertion"]
    floor = OTHERS_MUST_PASS_BY_ASSERTION if not crashed else OTHERS_MUST_PASS
    if total == 0 or passed >= floor * total:
        return ""
    return f"passes only {passed}/{total} of the other tests" + (
        f", and {len(crashed)} of them end by error or timeout" if crashed else ""
    )


def _run(
    mutant: mutants.Mutant, base: Mapping[str, str], sampled: int, *, others_only: bool = False
) -> Runs:
    """One run of the whole suite on the mutant with ``sampled`` of its other tests (and
    its named tests, unless ``others_only``), split into the named tests and the rest,
    from the environment ``base``."""
    with tempfile.TemporaryDirectory(prefix="kata-mutant-") as tmp:
        impl = str(mutants.materialise(mutant, Path(tmp) / "impl"))
        server = _cluster_server(base) if "cluster" in mutant.needs else None
        env = {
            **embedded_env(base),
            **({ENV_SERVER: server} if server else {}),
            "KATA_PROFILE": "mutant",
            # The sweep's load is its own pool, two runs a core, under which its tests'
            # deadlines were sized: stretching them would only slow the red runs.
            ENV_PATIENCE: "1",
            "PYTHONPATH": str(Path(__file__).parent),  # where -p _sampled is found
            _sampled.KEEP: " ".join(mutant.catches),
            _sampled.OTHERS: str(sampled),
            _sampled.SEED: mutant.name,
            **({_sampled.OTHERS_ONLY: "1"} if others_only else {}),
        }
        suite = suite_files(mutant.kata, mutant.stage)
        run = run_suite(suite, impl=impl, env=env, pytest_args=["-p", "_sampled"], warm=_WARM)
    named = set(mutant.catches)

    def part(keep: bool) -> SuiteRun:
        results = tuple(r for r in run.results if bool({r.name, r.test_id} & named) == keep)
        return dataclasses.replace(run, results=results)

    return part(True), part(False)


#: The catalogue's short runs start last, after the whole suites (test_suites and the
#: sound changes of test_reviews): the long runs first, the short ones fill the end.
POOL_ORDER = 2


def start_runs(items: list[pytest.Item]) -> Pool[Runs]:
    base = dict(os.environ)
    chosen = [
        m
        for m in (p["mutant"] for p in selected(items, "test_catalogue_entry_is_caught"))
        if mutants.shows_here(m, base)
    ]
    # The longest first (a cluster of its own, then stage 3's real servers and processes):
    # the short runs fill the machine at the end.
    chosen.sort(key=lambda m: ("cluster" not in m.needs, m.stage != 3))
    return Pool({m.name: functools.partial(_judged, m, base) for m in chosen})


@pytest.fixture(scope="module")
def catalogue_runs(request: pytest.FixtureRequest) -> Iterator[Pool[Runs]]:
    pool = module_pool(request, start_runs)
    yield pool
    pool.shutdown()
    _WARM.close()


def test_catalogue_is_not_empty() -> None:
    assert len(CATALOGUE) >= 10, f"only {len(CATALOGUE)} catalogue entries"


#: A name as code spells it: with an underscore, or camelCase.
_CODE_NAME = re.compile(r"\b(?=\w*(?:_|[a-z][A-Z]))[A-Za-z_]\w*\b")


@functools.cache
def _public_names(kata: str) -> frozenset[str]:
    """The names a learner's prompt and API give them: a symptom may use those."""
    folder = REPO_ROOT / "katas" / kata
    text = "".join((folder / f).read_text() for f in ("api.py", "README.md"))
    return frozenset(_CODE_NAME.findall(text))


def _names_the_cause(mutant: mutants.Mutant) -> list[str]:
    """Why the entry's symptom gives its cause away (empty: it does not)."""
    symptom = mutant.symptom
    if len(symptom) < 40:
        return [f"a symptom of {len(symptom)} characters (an incident report is a sentence)"]
    changed = {n for line in mutants.changed_lines(mutant) for n in _CODE_NAME.findall(line)}
    private = set(_CODE_NAME.findall(symptom)) & changed - _public_names(mutant.kata)
    reasons = [f"names {name!r}, which the diff changes" for name in sorted(private)]
    if "§" in symptom:
        reasons.append("cites a rule (§): the learner finds the rule")
    if symptom.lower() == mutant.bug.lower():
        reasons.append("repeats the bug line")
    return reasons


def test_every_entry_reports_a_symptom_that_does_not_name_its_cause() -> None:
    """The debugging round (kata debug) shows an entry's symptom instead of its name: a
    report as a user or an on-call engineer would give it. It must not name what the diff
    changes (a private name of the code), nor cite the rule."""
    bad = {m.name: reasons for m in CATALOGUE if (reasons := _names_the_cause(m))}
    assert not bad, (
        f"{len(bad)} of {len(CATALOGUE)} catalogue entries:\n"
        + "\n".join(f"  {name}: {'; '.join(reasons)}" for name, reasons in list(bad.items())[:20])
        + ("\n  …" if len(bad) > 20 else "")
    )


@pytest.mark.catalogue
@pytest.mark.timeout(WAIT_S)
@pytest.mark.parametrize("mutant", CATALOGUE, ids=[m.name for m in CATALOGUE])
def test_catalogue_entry_is_caught(mutant: mutants.Mutant, catalogue_runs: Pool[Runs]) -> None:
    if not mutants.shows_here(mutant):
        pytest.skip(f"{CLUSTER_SKIP}: set {ENV_SERVER}=redis-server to run this entry's tests")
    run, others = catalogue_runs.result(mutant.name)
    assert run.results or others.results, (
        f"{mutant.path.name}: the suite run gave no results (exit code {run.returncode}):\n"
        + run.output[-3000:]
    )
    for name in mutant.catches:
        results = run.named(name)
        assert results, f"{mutant.path.name}: names {name}, which is not a test of the suite"
        uncaught = [r for r in results if r.outcome != "failed" or r.kind != "assertion"]
        assert not uncaught, (
            f"{mutant.path.name} ({mutant.bug}): {name} must fail by assertion, got:\n"
            + "\n".join(f"  {r.nodeid}: {r.outcome} ({r.kind}) {r.message}" for r in uncaught)
        )
    crash = _not_realistic(others)
    assert not crash, (
        f"{mutant.path.name}: the mutant {crash} — a catalogue entry must be a realistic "
        "bug, not a crash"
    )
