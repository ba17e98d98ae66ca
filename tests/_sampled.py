"""A pytest plugin for the catalogue's suite runs (``-p _sampled``): the named tests, and a
seeded sample of the others.

An entry is proved by its named tests, which always run. The others only show that the
entry is a realistic bug rather than a crash (most of them still pass), and a sample of
them shows that as well as all of them would, at a fraction of a whole suite's run.

Tests marked ``processes`` (they start OS processes: seconds each) are never drawn.

``KATA_SAMPLE_KEEP``: the names to keep (test functions or stateful classes, or one
parametrization as ``test_x[id]``; space separated); ``KATA_SAMPLE_OTHERS``: how many
others; ``KATA_SAMPLE_SEED``: the seed (the entry's name, so one entry always meets the
same sample); ``KATA_SAMPLE_OTHERS_ONLY``: set (to anything), the named tests are left out
too, for a second look at the others alone.
"""

from __future__ import annotations

import os
import random

import pytest

KEEP, OTHERS, SEED = "KATA_SAMPLE_KEEP", "KATA_SAMPLE_OTHERS", "KATA_SAMPLE_SEED"
OTHERS_ONLY = "KATA_SAMPLE_OTHERS_ONLY"


def _names(item: pytest.Item) -> set[str]:
    """What a catalogue entry may name: the test function (or the stateful test's class),
    or one of its parametrizations (``test_x[full]``)."""
    test_id = item.nodeid.split("::", 1)[1]
    return {test_id, test_id.split("::")[0].split("[")[0]}


@pytest.hookimpl(trylast=True)  # after every other selection (-k, -m)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if OTHERS not in os.environ:
        return
    keep = set(os.environ.get(KEEP, "").split())
    others = [item for item in items if not _names(item) & keep]
    # A test that starts processes costs seconds and tells a crash from a bug no better.
    sampled = [item for item in others if item.get_closest_marker("processes") is None]
    sample = random.Random(os.environ.get(SEED, "")).sample(
        sampled, min(len(sampled), int(os.environ[OTHERS]))
    )
    chosen = {id(item) for item in sample}
    if OTHERS_ONLY not in os.environ:
        chosen |= {id(item) for item in items if _names(item) & keep}
    dropped = [item for item in items if id(item) not in chosen]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if id(item) in chosen]
