"""Hypothesis profiles, in one place: ``dev`` (default), ``ci`` and ``thorough``."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, Phase, settings

from katas._registry.impl import PROFILES, profile_name

#: What every profile but the catalogue's runs: no ``explain`` phase (it reruns a failing
#: example many more times only to comment which parts could vary).
_PHASES = [Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink]

settings.register_profile(
    "dev",
    max_examples=25,
    stateful_step_count=20,  # short runs shrink fast: a learner's red run stays short
    deadline=None,
    phases=_PHASES,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "ci",
    max_examples=100,
    derandomize=True,
    deadline=None,
    phases=_PHASES,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
# For the classic-bug catalogue: enough examples to meet a bug, no time spent shrinking.
settings.register_profile(
    "mutant",
    max_examples=15,
    derandomize=True,
    deadline=None,
    database=None,
    phases=[Phase.explicit, Phase.generate, Phase.target],
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "thorough", max_examples=1_000, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)  # every phase, explain included


#: Seconds hypothesis may spend shrinking one failing test, per profile: ``(the first
#: failures, every later one)``. A learner's red run must stay within a few times the
#: green one, so ``dev`` shrinks the first failures of a run — the ones read first — for a
#: second (the big deletions come first, so the sequence is short by then) and the rest
#: briefly. What was found stays in the example database, where a rerun resumes.
SHRINK_SECONDS = {"dev": (1.0, 0.1), "ci": (10.0, 10.0), "thorough": (300.0, 300.0)}
SHRINK_SECONDS["mutant"] = (0.0, 0.0)  # its phases leave shrinking out anyway
#: How many failing tests of a run get the first, longer shrinking time.
FIRST_FAILURES = 3


class ShrinkBudget:
    """Sets hypothesis's time for shrinking one failure before each test, by how many
    tests of the run have failed so far (see :data:`SHRINK_SECONDS`).

    Hypothesis has no setting for this, only an engine constant (five minutes); this sets
    it, and rewords the warning it prints when the time is up. Without that constant
    (another hypothesis version) shrinking is unbounded, as before.
    """

    def __init__(self, profile: str) -> None:
        from hypothesis.internal.conjecture import engine

        self.profile = profile
        self.failures = 0
        self._engine = engine if hasattr(engine, "MAX_SHRINKING_SECONDS") else None
        if self._engine is None:  # pragma: no cover - another hypothesis version
            return
        current = engine.__dict__["report"]  # hypothesis.reporting.report, as imported there
        original = getattr(current, "__wrapped__", current)

        def report(text: object) -> None:
            if isinstance(text, str) and text.startswith("WARNING: Hypothesis has spent more"):
                text = (
                    f"(shrinking stopped after {self.seconds:g} s under the {profile} "
                    "profile; a rerun shrinks further from here, KATA_PROFILE=thorough "
                    "shrinks in full)"
                )
            original(text)

        report.__wrapped__ = original  # type: ignore[attr-defined]
        engine.__dict__["report"] = report
        self.before_test()

    @property
    def seconds(self) -> float:
        first, later = SHRINK_SECONDS[self.profile]
        return first if self.failures < FIRST_FAILURES else later

    def before_test(self) -> None:
        if self._engine is not None:
            self._engine.MAX_SHRINKING_SECONDS = self.seconds

    def failed(self) -> None:
        self.failures += 1


#: Seconds one kata test may run, per profile (``ci`` shares its machine with a pool of
#: suites; ``thorough`` runs 40 times the examples).
TEST_SECONDS = {"dev": 30.0, "mutant": 30.0, "ci": 120.0, "thorough": 1800.0}


ENV_TEST_TIMEOUT = "KATA_TEST_TIMEOUT"


def test_seconds(profile: str) -> float:
    """How long one kata test may run: ``KATA_TEST_TIMEOUT`` (seconds), else the profile's.

    ValueError, one line, if the variable is not a positive number.
    """
    text = os.environ.get(ENV_TEST_TIMEOUT)
    if not text:
        return TEST_SECONDS[profile]
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < float("inf"):
        raise ValueError(f"{ENV_TEST_TIMEOUT} must be a number of seconds above 0, got {text!r}")
    return seconds


class TestTimedOut(BaseException):
    """A kata test ran past its profile's :data:`TEST_SECONDS`.

    A BaseException, so that hypothesis does not take it for a failure to shrink (and
    then report as flaky): it ends the test at once and is reported in one line.
    """

    __test__ = False  # an exception, not a pytest test class


def load() -> str:
    """Load the profile named by ``KATA_PROFILE`` (default ``dev``); return its name."""
    name = profile_name()
    settings.load_profile(name)
    return name


for _name in PROFILES:  # impl.PROFILES (what the CLI validates against) names only these
    settings.get_profile(_name)

#: For tests that start processes or servers: at most this many examples (dev and ci).
HEAVY_EXAMPLES = 10


def examples(at_ci: int) -> int:
    """Examples for a property test that needs more (or fewer) than a profile's own, under
    the loaded profile: ``at_ci`` under ``ci``, scaled like the profile's own count
    elsewhere (``dev`` a quarter, ``thorough`` ten times), never below one. So a test's
    count follows ``KATA_PROFILE`` as every other property's does."""
    at_profile = at_ci * settings().max_examples / settings.get_profile("ci").max_examples
    return max(1, round(at_profile))


def heavy_examples() -> int:
    """Examples for a test that starts processes or servers, under the loaded profile:
    :data:`HEAVY_EXAMPLES`, and a tenth of the profile's own under ``thorough`` (100)."""
    ordinary = settings().max_examples
    return min(ordinary, max(HEAVY_EXAMPLES, ordinary // 10))
