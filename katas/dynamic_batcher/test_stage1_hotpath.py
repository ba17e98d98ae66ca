"""Stage 1, the C hot path (``-k hotpath``): csrc/hotpath.c's ``hp_fill_token_budget``,
``hp_schedule`` and ``hp_apply`` over int32 columns, through the binding (see
katas/dynamic_batcher/README.md, "Stage 1", the C hot path).

Every rule at its boundary, then every rule at once on random columns, states and steps,
compared with the same rules written in plain Python
(:mod:`katas.dynamic_batcher._testing.hotpath`: every output column starts as
``UNWRITTEN``, so an entry a call forgets to write shows). A refused call must write
nothing, and the same call made valid must not be refused.

Map: fill_token_budget (in-order, no-skipping, partial-chunk, seq-cap, prefix, totals,
int32-range, invalid) · schedule (schedule-blocks, schedule-preempt, schedule-invalid) ·
apply (apply-compute, apply-release, apply-invalid) · the int32 edge (int32-range).
"""

from __future__ import annotations

from array import array
from typing import Any

import pytest
from hypothesis import example, given

from katas._harness.marks import core, rule
from katas._harness.story import expect
from katas._harness.under_test import module
from katas.dynamic_batcher._testing.hotpath import (
    APPLY_STEP,
    EDGE,
    INT_MAX,
    OWN_VICTIM,
    RELEASE_ORDER,
    UNWRITTEN,
    HotState,
    apply_is_accepted,
    apply_model,
    c_apply,
    c_columns,
    c_schedule,
    c_state,
    check_fill,
    fill_model,
    hot_states,
    hot_steps,
    hot_steps_done,
    live,
    schedule_is_accepted,
    schedule_model,
)

pytestmark = pytest.mark.stage(1)


# --- the C hot path (`-k hotpath`): the rules, each at its boundary ---------------------------


@core
@rule("in-order", "totals")
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
    check_fill(need, token_budget, 8, expected)


@core
@rule("no-skipping")
def test_hotpath_a_smaller_request_never_jumps_the_queue() -> None:
    # The budget is spent exactly on the first request: the 1 behind it waits.
    check_fill([8, 1], 8, 4, ([8, 0], 1, 8))
    # One token short of the first request: it takes all of it, nothing is left.
    check_fill([9, 1, 1], 8, 4, ([8, 0, 0], 1, 8))


@core
@rule("partial-chunk")
def test_hotpath_only_the_last_scheduled_request_gets_a_partial_chunk() -> None:
    check_fill([5, 1, 1], 4, 8, ([4, 0, 0], 1, 4))
    check_fill([2, 5, 1], 4, 8, ([2, 2, 0], 2, 4))


@core
@rule("seq-cap")
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
    check_fill([1, 1, 1, 1], 10, max_seqs, expected)


@core
@rule("prefix")
def test_hotpath_writes_zero_after_the_scheduled_prefix() -> None:
    # Every output entry starts as UNWRITTEN: each one must be overwritten.
    check_fill([1, 1, 100, 7], 0, 4, ([0, 0, 0, 0], 0, 0))
    check_fill([4, 4, 4], 4, 3, ([4, 0, 0], 1, 4))
    check_fill([4, 4, 4], 12, 1, ([4, 0, 0], 1, 4))


@core
@rule("totals")
def test_hotpath_schedules_nothing_for_no_requests() -> None:
    check_fill([], 10, 4, ([], 0, 0))


@core
@rule("int32-range")
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
    check_fill(need, token_budget, max_seqs, expected)


@core
@rule("invalid")
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
        module("_hotpath").fill_token_budget(array("i", need), chunk, token_budget=4, max_seqs=4)
    assert chunk.tolist() == [UNWRITTEN] * len(need), (
        f"need={need} is refused, so chunk must be untouched; got {chunk.tolist()}"
    )


@core
@rule("in-order", "no-skipping", "partial-chunk", "seq-cap", "prefix", "totals")
@given(hot_steps())
@example(([1, 1, 1], 10, 2))  # the cap ends the step, with budget and requests to spare
@example(([3, 3], 4, 0))  # a cap of 0
@example(([2, 2], 4, 2))  # the budget, the cap and the array end together
def test_hotpath_matches_the_model_on_random_columns(step: tuple[list[int], int, int]) -> None:
    need, token_budget, max_seqs = step
    check_fill(need, token_budget, max_seqs, fill_model(need, token_budget, max_seqs))


@core
@rule("schedule-blocks", "schedule-preempt")
@given(hot_states())
@example((OWN_VICTIM, 10, 4))
@example((RELEASE_ORDER, 10, 2))
def test_hotpath_schedule_matches_the_model_on_random_states(
    step: tuple[HotState, int, int],
) -> None:
    state, token_budget, max_seqs = step
    expected = schedule_model(state, token_budget, max_seqs)
    expect(
        c_schedule(state, token_budget, max_seqs),
        expected,
        f"schedule({state}, token_budget={token_budget}, max_seqs={max_seqs}), as "
        "(chunk, seqs, tokens, preempted), state",
    )


@core
@rule("schedule-invalid")
@pytest.mark.parametrize(
    ("change", "message"),
    [
        pytest.param({"computed": [5, 2, 0]}, "rejected the state", id="computed-reaches-known"),
        pytest.param({"held": [1, 1, 0]}, "rejected the state", id="held-not-ceil"),
        pytest.param({"free_top": 3}, "rejected the state", id="more-blocks-than-the-pool"),
        pytest.param({"stride": 2}, "table must have rows", id="table-length"),
        pytest.param({"n": 4}, "n must be <= 3", id="n-past-the-rows"),
    ],
)
def test_hotpath_schedule_refuses_a_broken_state(change: dict[str, Any], message: str) -> None:
    state = HotState(**{**vars(OWN_VICTIM.copy()), **change})
    with pytest.raises(ValueError, match=message):
        c_schedule(state, 10, 4)
    schedule_is_accepted()


@core
@rule("schedule-invalid")
def test_hotpath_schedule_refuses_columns_that_share_memory() -> None:
    known = array("i", [5, 3, 1])
    with pytest.raises(ValueError, match="computed must not share memory with known"):
        module("_hotpath").schedule(
            known, known, array("i", [2, 1, 0]), array("i", [0] * 9), array("i", [3, 0, 0, 0]),
            array("i", [0] * 3), n=3, free_top=1, stride=3, block_size=2, token_budget=10,
            max_seqs=4,
        )  # fmt: skip
    schedule_is_accepted()


@core
@rule("apply-compute", "apply-release")
@given(hot_steps_done())
@example(APPLY_STEP)
# Row 2 goes on part-way through its prompt: a chunk that stops short of known samples
# nothing.
@example((APPLY_STEP[0], 3, [3, 1, 2, 0], [1, 0, 0, 0]))
def test_hotpath_apply_matches_the_model_on_random_steps(
    step: tuple[HotState, int, list[int], list[int]],
) -> None:
    state, seqs, chunk, finished = step
    expected = live(apply_model(state, seqs, chunk, finished))
    expect(
        live(c_apply(state, seqs, chunk, finished)),
        expected,
        f"apply({state}, seqs={seqs}, chunk={chunk}, finished={finished})",
    )


@core
@rule("apply-invalid")
@pytest.mark.parametrize(
    ("change", "message"),
    [
        pytest.param({"finished": [2, 0, 1, 0]}, "rejected the step", id="flag-not-0-or-1"),
        pytest.param({"chunk": [3, 0, 2, 0]}, "rejected the step", id="scheduled-chunk-zero"),
        pytest.param({"chunk": [3, 2, 2, 0]}, "rejected the step", id="chunk-past-known"),
        pytest.param({"chunk": [3, 1, 3, 0]}, "rejected the step", id="held-short-of-the-chunk"),
        pytest.param({"finished": [0, 0, 1, 0]}, "rejected the step", id="outgrows-its-row"),
        pytest.param({"seqs": 5}, "seqs must be <= n", id="seqs-past-n"),
        pytest.param({"chunk": [3, 1, 2]}, "chunk must have as many", id="chunk-length"),
    ],
)
def test_hotpath_apply_refuses_a_broken_step(change: dict[str, Any], message: str) -> None:
    state, seqs, chunk, finished = APPLY_STEP
    step = {"seqs": seqs, "chunk": chunk, "finished": finished, **change}
    before = state.copy()
    cols = c_columns(state)
    with pytest.raises(ValueError, match=message):
        module("_hotpath").apply(
            *cols, array("i", step["chunk"]), array("i", step["finished"]), n=state.n,
            free_top=state.free_top, stride=state.stride, block_size=state.block_size,
            seqs=step["seqs"],
        )  # fmt: skip
    after = c_state(cols, before, before.n, before.free_top)
    expect(after, before, "a refused step writes nothing")
    apply_is_accepted()


@core
@rule("int32-range")
def test_hotpath_schedule_and_apply_at_the_int32_edge() -> None:
    single = HotState([INT_MAX], [INT_MAX - 1], [1], [0], [0], n=1, free_top=0, stride=1,
                      block_size=INT_MAX)  # fmt: skip
    for state in (single, EDGE):
        got = c_schedule(state, INT_MAX, INT_MAX)
        expect(
            got, schedule_model(state, INT_MAX, INT_MAX), f"schedule({state}, INT32_MAX, INT32_MAX)"
        )
    (chunk, seqs, _, _), after = schedule_model(single, INT_MAX, INT_MAX)
    with pytest.raises(ValueError, match="rejected the step"):
        c_apply(after, seqs, chunk, [0])  # known would pass INT32_MAX: it must finish
    done = c_apply(after, seqs, chunk, [1])
    expected = live(apply_model(after, seqs, chunk, [1]))
    expect(live(done), expected, f"apply({after}, seqs={seqs}, chunk={chunk}, finished=[1])")
