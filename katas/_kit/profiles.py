"""Hypothesis profiles, in one place: ``dev`` (default), ``ci`` and ``thorough``."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, Phase, settings

from katas._kit.impl import PROFILES, profile_name

#: What every profile but the catalogue's runs: no ``explain`` phase (it reruns a failing
#: example many more times only to comment which parts could vary).
_PHASES = [Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink]

settings.register_profile(
    "dev",
    max_examples=25,
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


#: Seconds hypothesis may spend shrinking one failing test, per profile: a learner's red
#: run must stay within a few times the green one, so ``dev`` shrinks for a moment (the
#: big deletions come first, so the sequence is short by then) and keeps what it found in
#: the example database, where the next run resumes shrinking.
SHRINK_SECONDS = {"dev": 1.0, "ci": 10.0, "thorough": 300.0, "mutant": 0.0}


def _bound_shrinking(profile: str) -> None:
    """Cap hypothesis's time for shrinking one failure at ``SHRINK_SECONDS[profile]``.

    Hypothesis has no setting for this, only an engine constant (five minutes); this sets
    it, and rewords the warning it prints when the cap is reached. Without that constant
    (another hypothesis version) shrinking is unbounded, as before.
    """
    from hypothesis.internal.conjecture import engine

    if not hasattr(engine, "MAX_SHRINKING_SECONDS"):  # pragma: no cover - other versions
        return
    seconds = SHRINK_SECONDS[profile]
    engine.MAX_SHRINKING_SECONDS = seconds  # type: ignore[assignment]
    current = engine.__dict__["report"]  # hypothesis.reporting.report, as engine imported it
    original = getattr(current, "__wrapped__", current)

    def report(text: object) -> None:
        if isinstance(text, str) and text.startswith("WARNING: Hypothesis has spent more"):
            text = (
                f"(shrinking stopped after {seconds:g} s under the {profile} profile; "
                "a rerun shrinks further from here, KATA_PROFILE=thorough shrinks in full)"
            )
        original(text)

    report.__wrapped__ = original  # type: ignore[attr-defined]
    engine.__dict__["report"] = report


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
    _bound_shrinking(name)
    return name


for _name in PROFILES:  # impl.PROFILES (what the CLI validates against) names only these
    settings.get_profile(_name)

#: For tests that start processes or servers: at most this many examples.
HEAVY_EXAMPLES = 10
