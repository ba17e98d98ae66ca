"""Stage 1, the C hot path: one step's token budget, through the CPython binding.

Every test calls the ``_hotpath`` module of the implementation under test, built from
its own ``csrc/`` when first imported. Run with ``pytest katas/dynamic_batcher -k
hotpath``; the C unit test of the same contract runs under ``ctest -C kata``.
"""

from __future__ import annotations

from array import array

import pytest
from hypothesis import given
from hypothesis import strategies as st

from katas._harness.under_test import stage

pytestmark = [pytest.mark.stage(1), pytest.mark.core]

INT_MAX = 2**31 - 1
#: What an output column holds before a call: a value no correct call leaves behind.
UNWRITTEN = -7


def fill(need: list[int], token_budget: int, max_seqs: int) -> tuple[list[int], int, int]:
    """Call the implementation; return (chunks, requests scheduled, tokens scheduled)."""
    chunk = array("i", [UNWRITTEN] * len(need))
    seqs, tokens = stage().fill_token_budget(
        array("i", need), chunk, token_budget=token_budget, max_seqs=max_seqs
    )
    return chunk.tolist(), seqs, tokens


def model(need: list[int], token_budget: int, max_seqs: int) -> tuple[list[int], int, int]:
    """The rules in plain Python: in order, each request clamped to the budget left."""
    chunks = [0] * len(need)
    left = token_budget
    seqs = 0
    for i, tokens in enumerate(need):
        if seqs == max_seqs or left == 0:
            break
        chunks[i] = min(tokens, left)
        left -= chunks[i]
        seqs += 1
    return chunks, seqs, token_budget - left


def check(need: list[int], token_budget: int, max_seqs: int, expected: object) -> None:
    got = fill(need, token_budget, max_seqs)
    assert got == expected, (
        f"fill_token_budget(need={need}, token_budget={token_budget}, max_seqs={max_seqs}): "
        f"expected (chunk, seqs, tokens) = {expected}, got {got}"
    )


# --- the rules, each at its boundary ------------------------------------------------------


@pytest.mark.rule("in-order", "totals")
@pytest.mark.parametrize(
    ("need", "token_budget", "expected"),
    [
        pytest.param([3, 2], 5, ([3, 2], 2, 5), id="exact-fit"),
        pytest.param([3, 2], 6, ([3, 2], 2, 5), id="one-to-spare"),
        pytest.param([3, 2], 4, ([3, 1], 2, 4), id="one-short"),
        pytest.param([1, 1, 100, 7], 10, ([1, 1, 8, 0], 3, 10), id="worked-example"),
    ],
)
def test_hotpath_serves_in_order_clamped_to_the_budget_left(
    need: list[int], token_budget: int, expected: tuple[list[int], int, int]
) -> None:
    check(need, token_budget, 8, expected)


@pytest.mark.rule("no-skipping")
def test_hotpath_a_smaller_request_never_jumps_the_queue() -> None:
    # The budget is spent exactly on the first request: the 1 behind it waits.
    check([8, 1], 8, 4, ([8, 0], 1, 8))
    # One token short of the first request: it takes all of it, nothing is left.
    check([9, 1, 1], 8, 4, ([8, 0, 0], 1, 8))


@pytest.mark.rule("partial-chunk")
def test_hotpath_only_the_last_scheduled_request_gets_a_partial_chunk() -> None:
    check([5, 1, 1], 4, 8, ([4, 0, 0], 1, 4))
    check([2, 5, 1], 4, 8, ([2, 2, 0], 2, 4))


@pytest.mark.rule("seq-cap")
@pytest.mark.parametrize(
    ("max_seqs", "expected"),
    [
        pytest.param(0, ([0, 0, 0, 0], 0, 0), id="zero"),
        pytest.param(1, ([1, 0, 0, 0], 1, 1), id="one"),
        pytest.param(3, ([1, 1, 1, 0], 3, 3), id="one-under-the-count"),
        pytest.param(4, ([1, 1, 1, 1], 4, 4), id="the-count"),
    ],
)
def test_hotpath_caps_the_requests_even_with_budget_to_spare(
    max_seqs: int, expected: tuple[list[int], int, int]
) -> None:
    check([1, 1, 1, 1], 10, max_seqs, expected)


@pytest.mark.rule("prefix")
def test_hotpath_writes_zero_after_the_scheduled_prefix() -> None:
    # Every output entry starts as UNWRITTEN: each one must be overwritten.
    check([1, 1, 100, 7], 0, 4, ([0, 0, 0, 0], 0, 0))
    check([4, 4, 4], 4, 3, ([4, 0, 0], 1, 4))
    check([4, 4, 4], 12, 1, ([4, 0, 0], 1, 4))


@pytest.mark.rule("totals")
def test_hotpath_schedules_nothing_for_no_requests() -> None:
    check([], 10, 4, ([], 0, 0))


@pytest.mark.rule("int32-range")
@pytest.mark.parametrize(
    ("need", "token_budget", "max_seqs", "expected"),
    [
        pytest.param([INT_MAX, 1], INT_MAX, INT_MAX, ([INT_MAX, 0], 1, INT_MAX), id="max-need"),
        pytest.param([INT_MAX - 1, 1], INT_MAX, 2, ([INT_MAX - 1, 1], 2, INT_MAX), id="sum"),
        pytest.param([1, INT_MAX], INT_MAX, 4, ([1, INT_MAX - 1], 2, INT_MAX), id="clamp"),
    ],
)
def test_hotpath_handles_the_whole_int32_range(
    need: list[int], token_budget: int, max_seqs: int, expected: tuple[list[int], int, int]
) -> None:
    check(need, token_budget, max_seqs, expected)


@pytest.mark.rule("invalid")
@pytest.mark.parametrize(
    ("need", "bad"),
    [
        pytest.param([1, 0, 3], 1, id="zero-in-the-middle"),
        pytest.param([1, 2, -5], 2, id="negative-last"),
        pytest.param([0], 0, id="zero-first"),
    ],
)
def test_hotpath_refuses_a_need_below_one_and_writes_nothing(need: list[int], bad: int) -> None:
    chunk = array("i", [UNWRITTEN] * len(need))
    with pytest.raises(ValueError, match=rf"need\[{bad}\] must be >= 1"):
        stage().fill_token_budget(array("i", need), chunk, token_budget=4, max_seqs=4)
    assert chunk.tolist() == [UNWRITTEN] * len(need), (
        f"need={need} is refused, so chunk must be untouched; got {chunk.tolist()}"
    )


# --- every rule at once, on random columns ------------------------------------------------

token_counts = st.one_of(st.integers(1, 3), st.integers(1, 600), st.integers(1, INT_MAX))
budgets = st.one_of(st.integers(0, 3), st.integers(0, 2_000), st.integers(0, INT_MAX))


@st.composite
def steps(draw: st.DrawFn) -> tuple[list[int], int, int]:
    """A step: the columns, a budget, and a cap drawn around the number of requests (so
    the cap, the budget and the end of the array each end some steps)."""
    need = draw(st.lists(token_counts, max_size=64))
    cap = draw(st.one_of(st.integers(0, len(need) + 1), st.integers(0, 80)))
    return need, draw(budgets), cap


@pytest.mark.rule("in-order", "no-skipping", "partial-chunk", "seq-cap", "prefix", "totals")
@given(steps())
def test_hotpath_matches_the_model_on_random_columns(step: tuple[list[int], int, int]) -> None:
    need, token_budget, max_seqs = step
    check(need, token_budget, max_seqs, model(need, token_budget, max_seqs))
