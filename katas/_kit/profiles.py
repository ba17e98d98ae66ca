"""Hypothesis profiles, in one place: ``dev`` (default), ``ci`` and ``thorough``."""

from __future__ import annotations

from hypothesis import HealthCheck, Phase, settings

from katas._kit.impl import PROFILES, profile_name

settings.register_profile(
    "dev", max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "ci",
    max_examples=100,
    derandomize=True,
    deadline=None,
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
)


def load() -> str:
    """Load the profile named by ``KATA_PROFILE`` (default ``dev``); return its name."""
    name = profile_name()
    settings.load_profile(name)
    return name


for _name in PROFILES:  # impl.PROFILES (what the CLI validates against) names only these
    settings.get_profile(_name)

#: For tests that start processes or servers: at most this many examples.
HEAVY_EXAMPLES = 10
