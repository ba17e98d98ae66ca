"""The harness's fixed walks: a stateful test replays them before it explores."""

from __future__ import annotations

import unittest

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from katas._harness.walks import Drawn, Walk, replay, walked

SEEN: list[str] = []


class Counter(RuleBasedStateMachine):
    """Counts to a limit; ``add`` is wrong at exactly 1_000 (random steps never get there)."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    @initialize(data=st.data())
    def start(self, data: st.DataObject) -> None:
        self.total = data.draw(st.integers(0, 3))
        SEEN.append(f"start {self.total}")

    @rule(n=st.integers(0, 2))
    def add(self, n: int) -> None:
        self.total += n
        SEEN.append(f"add {n}")

    @invariant()
    def below_the_boundary(self) -> None:
        assert self.total != 1_000, "the boundary: total reached 1000"

    def teardown(self) -> None:
        SEEN.append("teardown")


def test_replay_runs_the_steps_the_invariants_and_the_teardown() -> None:
    SEEN.clear()
    replay(Counter, [("start", {"data": Drawn(2)}), ("add", {"n": 1})])
    assert SEEN == ["start 2", "add 1", "teardown"]


def test_a_walk_can_be_replayed_again() -> None:
    SEEN.clear()
    walk = [("start", {"data": Drawn(1)})]
    replay(Counter, walk)
    replay(Counter, walk)
    assert SEEN == ["start 1", "teardown"] * 2


def test_drawn_names_a_draw_the_walk_did_not_give() -> None:
    with pytest.raises(LookupError, match="no value for a draw"):
        replay(Counter, [("start", {"data": Drawn()})])


def test_a_walked_test_case_meets_the_boundary_random_steps_miss() -> None:
    boundary: Walk = [("start", {"data": Drawn(0)}), ("add", {"n": 1_000})]
    case = walked(Counter, {"to 1000": boundary})
    case.settings = settings(max_examples=5, database=None)
    assert case.__name__ == Counter.TestCase.__name__
    result = unittest.TestResult()
    case("runTest").run(result)
    assert len(result.failures) == 1
    report = result.failures[0][1]
    assert "the boundary: total reached 1000" in report
    assert "(in the fixed walk 'to 1000', before any random steps)" in report


def test_a_walked_test_case_explores_after_its_walks() -> None:
    SEEN.clear()
    case = walked(Counter, {"short": [("start", {"data": Drawn(3)})]})
    case.settings = settings(max_examples=3, database=None)
    result = unittest.TestResult()
    case("runTest").run(result)
    assert result.wasSuccessful(), result.failures
    assert SEEN[:2] == ["start 3", "teardown"]
    assert len(SEEN) > 2  # then hypothesis's own runs
