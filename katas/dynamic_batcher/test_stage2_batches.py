"""Stage 2: the request batcher, ``DynamicBatcher`` (see katas/dynamic_batcher/README.md,
"Stage 2"; ``-k batches``).

Full and due batches, order, result routing, errors, cancellation, concurrent batches
and closing. ``fn`` is a model the test controls
(:mod:`katas.dynamic_batcher._testing.batches`: it records every batch and the instant it
was called, and can hold a batch until the test releases it); the test lets every task
run until all of them wait before it looks, and reads ``statistics()`` instead of
guessing from timing. Every async test runs on asyncio and on trio.

Map: batch-full · batch-delay · batch-order · batch-routing · batch-errors ·
batch-cancel · batch-concurrent · batch-statistics · batch-close · batch-bad-input.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from typing import Any

import anyio
import pytest
from hypothesis import given
from hypothesis import strategies as st

from katas._harness.marks import core, extended, rule
from katas._harness.story import Story
from katas._harness.under_test import stage
from katas._harness.virtual_time import SETTLE_S, settle
from katas._harness.waiting import bounded
from katas._runtime.clock import ManualClock
from katas._runtime.todo import Todo
from katas.dynamic_batcher._testing.batches import (
    DELAY,
    Caller,
    Model,
    answer,
    expect_capped_and_in_order,
    expect_nothing_sent,
    expect_results,
    expect_sent,
    new_batcher,
    outcomes,
    serving,
    settled,
    stats,
    submit,
)
from katas.dynamic_batcher._testing.edges import Handout
from katas.dynamic_batcher._testing.engine import ReadOnlyClock
from katas.dynamic_batcher.api import (
    BatchStatistics,
    EngineClosed,
)

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

pytestmark = [pytest.mark.stage(2), pytest.mark.anyio]


# -- the request batcher: a full batch is sent at once ------------------------------


@core
@rule("batch-full", "batch-statistics")
@pytest.mark.parametrize("size", [1, 4])
async def test_stage2_batches_a_full_batch_is_sent_at_once(size: int) -> None:
    clock = ManualClock()
    model = Model(clock)
    t0 = clock.now_ns()
    with bounded(f"a batch of {size} to fill and be sent"):
        async with (
            anyio.create_task_group() as tg,
            serving(new_batcher(model, max_batch_size=size), model) as b,
        ):
            assert stats(b) == BatchStatistics(0, 0, 0, ()), (
                f"batch-statistics: a new batcher: expected {BatchStatistics(0, 0, 0, ())}, "
                f"got {stats(b)}"
            )
            callers = []
            for n in range(size - 1):
                callers.append(await submit(tg, b, f"x{n}"))
                expect_nothing_sent(model, b, f"batch-full: {n + 1} of max_batch_size={size}")
                assert stats(b) == BatchStatistics(n + 1, 0, 0, ()), (
                    f"batch-statistics: {n + 1} item(s) queued, nothing sent: expected "
                    f"{BatchStatistics(n + 1, 0, 0, ())}, got {stats(b)}"
                )
            callers.append(await submit(tg, b, "last"))
            items = [c.item for c in callers]
            await expect_sent(
                model,
                [items],
                t0,
                f"batch-full: the item that makes max_batch_size={size} is queued sends the "
                "batch at once, the clock not moved",
            )
            await outcomes(callers, "a full batch")
            expect_results(callers, "batch-full")
            assert stats(b) == BatchStatistics(0, 0, 1, (size,)), (
                f"batch-statistics: one batch of {size} sent and done: expected "
                f"{BatchStatistics(0, 0, 1, (size,))}, got {stats(b)}"
            )
            extra = await submit(tg, b, "next")
            if size > 1:
                assert len(model.batches) == 1 and stats(b).queued == 1, (
                    f"batch-full: the item after a full batch waits for the next one: "
                    f"{model.describe()}, statistics() {stats(b)}"
                )
                clock.advance(DELAY)
            await outcomes([extra], "the item after a full batch")
            expect_results([extra], "batch-full: the item after a full batch")


# -- the delay, from the oldest item's own submit --------------------------------------


@core
@rule("batch-delay")
async def test_stage2_batches_a_lone_item_is_sent_exactly_when_its_delay_is_up() -> None:
    clock = ManualClock()
    model = Model(clock)
    with bounded("a lone item to be sent at its delay"):
        async with (
            anyio.create_task_group() as tg,
            serving(new_batcher(model, max_batch_size=8), model) as b,
        ):
            clock.advance(3)
            t0 = clock.now_ns()
            caller = await submit(tg, b, "a")
            clock.advance(DELAY - 1)
            await settle()
            expect_nothing_sent(
                model,
                b,
                f"batch-delay: 1 ns before the item's delay (submitted at {t0}, "
                f"max_queue_delay_ns={DELAY}, now {clock.now_ns()})",
            )
            clock.advance(1)
            await expect_sent(
                model,
                [["a"]],
                t0 + DELAY,
                f"batch-delay: at the instant the item has waited max_queue_delay_ns "
                f"(submitted at {t0}, now {t0 + DELAY})",
            )
            await outcomes([caller], "the lone item")
            expect_results([caller], "batch-delay")
            clock.advance(1)
            await settle()
            assert stats(b).sizes == (1,), f"batch-delay: sent once, got {stats(b)}"


@core
@rule("batch-delay")
async def test_stage2_batches_the_delay_counts_from_the_oldest_items_own_submit() -> None:
    clock = ManualClock()
    model = Model(clock)
    with bounded("two items to be sent at the oldest one's delay"):
        async with (
            anyio.create_task_group() as tg,
            serving(new_batcher(model, max_batch_size=8), model) as b,
        ):
            start = clock.now_ns()
            clock.advance(10 * DELAY)  # long after the batcher started
            t1 = clock.now_ns()
            first = await submit(tg, b, "first")
            expect_nothing_sent(
                model,
                b,
                f"batch-delay: an item submitted at {t1}, {10 * DELAY} ns after the "
                f"batcher started (at {start}); its delay counts from its own submit",
            )
            clock.advance(DELAY // 2)
            second = await submit(tg, b, "second")
            clock.advance(DELAY // 2 - 1)
            await settle()
            expect_nothing_sent(
                model, b, f"batch-delay: 1 ns before the oldest item's delay ({t1} + {DELAY})"
            )
            clock.advance(1)
            await expect_sent(
                model,
                [["first", "second"]],
                t1 + DELAY,
                f"batch-delay: the batch goes when its OLDEST item has waited "
                f"max_queue_delay_ns (submitted at {t1}); a later item (at {t1 + DELAY // 2}) "
                "does not restart the timer",
            )
            await outcomes([first, second], "the two items")
            expect_results([first, second], "batch-delay")


@core
@rule("batch-delay")
async def test_stage2_batches_the_delay_does_not_count_from_the_last_dispatch() -> None:
    clock = ManualClock()
    model = Model(clock)
    with bounded("items to be sent at their own delays after earlier batches"):
        async with (
            anyio.create_task_group() as tg,
            serving(new_batcher(model, max_batch_size=2), model) as b,
        ):
            t0 = clock.now_ns()
            callers = [await submit(tg, b, "a")]
            clock.advance(1)
            callers.append(await submit(tg, b, "b"))  # full: sent at t0 + 1
            clock.advance(1)
            callers.append(await submit(tg, b, "c"))  # the remainder, submitted at t0 + 2
            await expect_sent(model, [["a", "b"]], t0 + 1, "batch-full: a and b fill a batch")
            clock.advance(DELAY - 2)  # t0 + DELAY: the full batch's instant + DELAY - 1
            await settle()
            assert len(model.batches) == 1, (
                f"batch-delay: item c was submitted at {t0 + 2}; its delay ends at "
                f"{t0 + 2 + DELAY}, not {DELAY} after the last batch was sent ({t0 + 1}); "
                f"now {clock.now_ns()}: {model.describe()}"
            )
            clock.advance(1)
            await settle()
            assert len(model.batches) == 1, (
                f"batch-delay: 1 ns before item c's delay (now {clock.now_ns()}), nothing may be "
                f"sent: {model.describe()}"
            )
            clock.advance(1)
            t_c = t0 + 2 + DELAY
            await expect_sent(model, [["a", "b"], ["c"]], t_c, "batch-delay: c at its own delay")
            # A batch sent by the delay: the next item's delay is its own too.
            clock.advance(DELAY // 2)
            callers.append(await submit(tg, b, "d"))
            clock.advance(DELAY // 2)  # t_c + DELAY: the last dispatch + DELAY
            await settle()
            assert len(model.batches) == 2, (
                f"batch-delay: item d was submitted at {t_c + DELAY // 2}: {DELAY} ns after the "
                f"last dispatch ({t_c}) is not its delay; {model.describe()}"
            )
            clock.advance(DELAY // 2)
            await expect_sent(
                model,
                [["a", "b"], ["c"], ["d"]],
                t_c + DELAY // 2 + DELAY,
                "batch-delay: d at its delay",
            )
            await outcomes(callers, "four items")
            expect_results(callers, "batch-delay")


@extended
@rule("batch-delay")
async def test_stage2_batches_a_zero_delay_sends_each_item_without_waiting() -> None:
    clock = ManualClock()
    model = Model(clock)
    with bounded("items sent with max_queue_delay_ns=0"):
        async with (
            anyio.create_task_group() as tg,
            serving(new_batcher(model, max_batch_size=8, delay=0), model) as b,
        ):
            callers = [await submit(tg, b, "a")]
            await expect_sent(
                model,
                [["a"]],
                clock.now_ns(),
                "batch-delay: max_queue_delay_ns=0 waits for nothing",
            )
            callers.append(await submit(tg, b, "b"))
            await expect_sent(
                model, [["a"], ["b"]], clock.now_ns(), "batch-delay: max_queue_delay_ns=0"
            )
            await outcomes(callers, "two items, no delay")
            expect_results(callers, "batch-delay")


@extended
@rule("batch-delay", "batch-order", "batch-statistics")
@pytest.mark.parametrize("size", [8, 2])
async def test_stage2_batches_a_zero_delay_sends_whatever_is_queued_together(size: int) -> None:
    """Five callers submit at one instant, before the batcher's task runs: with
    max_queue_delay_ns=0 they are sent together when it runs (capped at max_batch_size),
    not one batch per submit()."""
    clock = ManualClock()
    model = Model(clock)
    b = new_batcher(model, max_batch_size=size, delay=0)
    order: list[str] = []
    callers = [Caller(b, item, order) for item in ("a", "b", "c", "d", "e")]
    with bounded("five items queued at one instant, no delay"):
        async with anyio.create_task_group() as tg, serving(b, model):
            await settle()  # the batcher's task waits for an item
            for caller in callers:  # all queued before the batcher's task runs again
                tg.start_soon(caller.run)
            await outcomes(callers, "five items, no delay")
            want = (size,) * (5 // size) + ((5 % size,) if 5 % size else ())
            assert stats(b).sizes == want, (
                f"batch-delay: max_queue_delay_ns=0 and max_batch_size={size}; five callers "
                "queued their items at one instant, before the batcher ran: whatever is "
                f"queued is sent as soon as it runs, so batches of sizes {want}; got "
                f"statistics() {stats(b)}, {model.describe()}"
            )
    expect_capped_and_in_order(model, callers, order, size, "batch-delay: no delay")


# -- order, and each caller its own result ---------------------------------------------


@core
@rule("batch-order", "batch-routing")
async def test_stage2_batches_hold_the_oldest_items_in_submission_order() -> None:
    clock = ManualClock()
    model = Model(clock)
    items = ["a", "b", "c", "d", "e", "f", "g"]
    with bounded("seven items in batches of three"):
        async with (
            anyio.create_task_group() as tg,
            serving(new_batcher(model, max_batch_size=3), model) as b,
        ):
            callers = [await submit(tg, b, item) for item in items]
            clock.advance(DELAY)
            want = [["a", "b", "c"], ["d", "e", "f"], ["g"]]
            await expect_sent(
                model,
                want,
                clock.now_ns(),
                "batch-order: seven items submitted one after the other, max_batch_size=3: "
                "the oldest first, each batch in submission order",
            )
            await outcomes(callers, "seven items")
            expect_results(callers, "batch-routing")


class _Rule:
    """The rule, as the test's own model: at every instant, each full batch is sent, and
    each batch whose oldest item has waited ``delay``; the oldest items first, at most
    ``max_batch`` a batch."""

    def __init__(self, max_batch: int, delay: int) -> None:
        self.max_batch = max_batch
        self.delay = delay
        self.now = 0
        self.queue: list[tuple[int, int]] = []  # (submitted at, item)
        self.batches: list[list[int]] = []

    def at(self, now: int) -> None:
        self.now = now
        self._flush()

    def submit(self, item: int) -> None:
        self.queue.append((self.now, item))
        self._flush()

    def next_deadline(self) -> int:
        return self.queue[0][0] + self.delay

    def _flush(self) -> None:
        while self.queue and (
            len(self.queue) >= self.max_batch or self.next_deadline() <= self.now
        ):
            self.batches.append([item for _, item in self.queue[: self.max_batch]])
            del self.queue[: self.max_batch]


@st.composite
def _workloads(draw: st.DrawFn) -> tuple[int, int, list[int], list[int], frozenset[int]]:
    """max_batch_size, max_queue_delay_ns, the time before each submit, the items (distinct,
    so a result routed to the wrong caller shows) and the poison items."""
    max_batch = draw(st.integers(1, 6), label="max_batch_size")
    delay = draw(st.sampled_from([0, 1, 5, DELAY]), label="max_queue_delay_ns")
    items = draw(
        st.lists(st.integers(-999, 999), min_size=1, max_size=20, unique=True), label="items"
    )
    near = sorted({0, 1, max(delay - 1, 0), delay, delay + 1, delay // 2})
    gap = st.one_of(st.sampled_from(near), st.integers(0, 2 * delay + 1))
    gaps = draw(st.lists(gap, min_size=len(items), max_size=len(items)), label="gaps")
    poison = draw(st.sets(st.sampled_from(items), max_size=2), label="poison")
    return max_batch, delay, gaps, items, frozenset(poison)


@core
@rule("batch-full", "batch-delay", "batch-order", "batch-routing", "batch-errors")
@given(case=_workloads())
async def test_stage2_batches_every_caller_gets_its_own_result_under_random_workloads(
    case: tuple[int, int, list[int], list[int], frozenset[int]],
) -> None:
    max_batch, delay, gaps, items, poison = case
    clock = ManualClock(start_ns=0)
    model = Model(clock)
    model.poison = poison
    expected = _Rule(max_batch, delay)
    callers: list[Caller] = []
    setup = f"max_batch_size={max_batch}, max_queue_delay_ns={delay}, poison items {sorted(poison)}"
    done: list[str] = []

    async def check(event: str) -> None:
        done.append(event)
        await settle()
        assert model.batches == expected.batches, (
            f"batch-full, batch-delay, batch-order: {setup}; after\n    "
            + "\n    ".join(done)
            + f"\n  expected fn called with {expected.batches}\n  got {model.describe()}"
        )

    with bounded(f"every caller's outcome ({setup}, items {items}, gaps {gaps})"):
        async with (
            anyio.create_task_group() as tg,
            serving(new_batcher(model, max_batch_size=max_batch, delay=delay), model) as b,
        ):
            for gap, item in zip(gaps, items, strict=True):
                if gap:
                    clock.advance(gap)
                    expected.at(clock.now_ns())
                    await check(f"the clock moved to {clock.now_ns()}")
                callers.append(await submit(tg, b, item))
                expected.submit(item)
                await check(f"submit({item}) at {clock.now_ns()}")
            while expected.queue:  # each remaining batch, at its oldest item's deadline
                clock.advance(expected.next_deadline() - clock.now_ns())
                expected.at(clock.now_ns())
                await check(f"the clock moved to {clock.now_ns()}")
            await outcomes(callers, setup)
    batch_of = {item: n for n, batch in enumerate(model.batches) for item in batch}
    for c in callers:
        n = batch_of[c.item]
        if n in model.raised:
            assert c.error is model.raised[n], (
                f"batch-errors: {setup}: fn raised {model.raised[n]!r} for batch {n} "
                f"{model.batches[n]}; every caller of that batch gets that exception; "
                f"submit({c.item!r}) {c.outcome()}"
            )
        else:
            assert c.result == answer(c.item) and c.error is None, (
                f"batch-routing: {setup}: submit({c.item!r}) (batch {n}: {model.batches[n]}) "
                f"must return {answer(c.item)!r}; it {c.outcome()}"
            )


@core
@rule("batch-full", "batch-routing", "batch-statistics")
@pytest.mark.parametrize("size", [8, 5])
async def test_stage2_batches_64_concurrent_callers_each_get_their_own_result(size: int) -> None:
    clock = ManualClock()
    model = Model(clock)
    items = [f"req-{n}" for n in range(64)]
    full, rest = divmod(64, size)
    with bounded(f"64 concurrent callers, max_batch_size={size}"):
        async with (
            anyio.create_task_group() as tg,
            serving(new_batcher(model, max_batch_size=size), model) as b,
        ):
            callers = [Caller(b, item) for item in items]
            for c in callers:
                tg.start_soon(c.run)  # all at once: no caller waits for another
            await settle()
            assert stats(b).sizes == (size,) * full and stats(b).queued == rest, (
                f"batch-full: 64 callers at one instant, max_batch_size={size}: {full} full "
                f"batches at once and {rest} item(s) left waiting for the delay; got "
                f"statistics() {stats(b)}"
            )
            clock.advance(DELAY)
            await outcomes(callers, "64 concurrent callers")
            expect_results(callers, "batch-routing: 64 concurrent callers")
            sent = sorted(item for batch in model.batches for item in batch)
            assert sent == sorted(items), f"batch-routing: each item sent once, got {sent}"
            want = BatchStatistics(
                0, 0, full + (rest > 0), (size,) * full + ((rest,) if rest else ())
            )
            assert stats(b) == want, f"batch-statistics: expected {want}, got {stats(b)}"


@extended
@rule("batch-routing")
@pytest.mark.parametrize("returned", [2, 4, 0], ids=["fewer", "more", "none"])
async def test_stage2_batches_a_wrong_number_of_results_fails_every_caller_of_the_batch(
    returned: int,
) -> None:
    clock = ManualClock()
    model = Model(clock)
    model.counts[0] = returned
    with bounded(f"a batch of 3 whose fn returned {returned} results"):
        async with (
            anyio.create_task_group() as tg,
            serving(new_batcher(model, max_batch_size=3), model) as b,
        ):
            callers = [await submit(tg, b, item) for item in ("a", "b", "c")]
            await outcomes(callers, f"fn returned {returned} results for 3 items")
            for c in callers:
                err = c.error
                assert isinstance(err, RuntimeError) and all(
                    re.search(rf"\b{n}\b", str(err)) for n in (3, returned)
                ), (
                    f"batch-routing: fn returned {returned} results for a batch of 3 items: "
                    f"every caller of the batch gets a RuntimeError naming both counts; "
                    f"submit({c.item!r}) {c.outcome()}"
                )
            after = [await submit(tg, b, item) for item in ("d", "e", "f")]
            await outcomes(after, "the next batch")
            expect_results(after, "batch-routing: the batcher keeps serving after a bad batch")


@extended
@rule("batch-routing")
async def test_stage2_batches_a_result_of_none_or_zero_is_the_callers_own() -> None:
    """fn may answer None, 0, "" or False for an item: each is that item's result, handed
    to its caller like any other, in a full batch and in a batch sent by its delay."""
    clock = ManualClock()
    model = Model(clock)
    model.answers = {"none": None, "zero": 0, "empty": "", "false": False, "late": None}
    with bounded("falsy results"):
        async with (
            anyio.create_task_group() as tg,
            serving(new_batcher(model, max_batch_size=5), model) as b,
        ):
            callers = [await submit(tg, b, item) for item in ("none", "zero", "empty", "false")]
            callers.append(await submit(tg, b, "x"))  # the batch is full
            await outcomes(callers, "a full batch of falsy results")
            callers.append(await submit(tg, b, "late"))
            clock.advance(DELAY)
            await outcomes(callers, "a lone item answered None")
    want = {**{c.item: answer(c.item) for c in callers}, **model.answers}
    wrong = [
        c for c in callers
        if c.error is not None or type(c.result) is not type(want[c.item])
        or c.result != want[c.item]
    ]  # fmt: skip
    assert not wrong, (
        "batch-routing: each caller's submit returns fn's result at its item's index, "
        "whatever the value (None, 0, '' and False are results too):\n"
        + "\n".join(f"  submit({c.item!r}) {c.outcome()}; expected {want[c.item]!r}" for c in wrong)
    )


# -- errors ----------------------------------------------------------------------------


class Boom(Exception):
    """fn's own error."""


@core
@rule("batch-errors", "batch-concurrent")
@pytest.mark.parametrize("failing", [0, 1], ids=["first-fails", "second-fails"])
async def test_stage2_batches_an_exception_fails_exactly_the_callers_of_its_batch(
    failing: int,
) -> None:
    clock = ManualClock()
    model = Model(clock, held=True)
    boom = Boom(f"the model failed on batch {failing}")
    model.failures[failing] = boom
    with bounded("two batches in flight, one of which fails"):
        async with (
            anyio.create_task_group() as tg,
            serving(new_batcher(model, max_batch_size=2), model) as b,
        ):
            batches = [[await submit(tg, b, f"{n}.{k}") for k in range(2)] for n in range(2)]
            await settled(lambda: len(model.batches) == 2, "two full batches, both in flight")
            for n in (1, 0):
                model.release(n)
                await outcomes(batches[n], f"batch {n}")
            for c in batches[failing]:
                assert c.error is boom, (
                    f"batch-errors: fn raised {boom!r} for batch {failing} "
                    f"{model.batches[failing]}: EVERY caller of that batch gets that exception; "
                    f"submit({c.item!r}) {c.outcome()}"
                )
            expect_results(
                batches[1 - failing],
                f"batch-errors: batch {failing} failed; batch {1 - failing} is not its business",
            )
            after = [await submit(tg, b, item) for item in ("x", "y")]
            model.release(2)
            await outcomes(after, "a batch after the failed one")
            expect_results(after, "batch-errors: the batcher keeps serving after fn raised")
            assert stats(b) == BatchStatistics(0, 0, 3, (2, 2, 2)), (
                f"batch-statistics: three batches of 2 ended, one by an exception: expected "
                f"{BatchStatistics(0, 0, 3, (2, 2, 2))}, got {stats(b)}"
            )


# -- cancellation ----------------------------------------------------------------------


@core
@rule("batch-cancel")
async def test_stage2_batches_a_caller_cancelled_before_its_batch_is_sent_sends_nothing() -> None:
    clock = ManualClock()
    model = Model(clock)
    with bounded("a batch of 3 without the cancelled caller's item"):
        async with (
            anyio.create_task_group() as tg,
            serving(new_batcher(model, max_batch_size=3), model) as b,
        ):
            a = await submit(tg, b, "a")
            gone = await submit(tg, b, "gone")
            gone.cancel()
            await settled(lambda: gone.done, "the cancelled caller to leave submit()")
            assert gone.cancelled and stats(b).queued == 1, (
                f"batch-cancel: a caller cancelled before its batch was sent takes its item "
                f"out of the queue: it {gone.outcome()}, statistics() {stats(b)}"
            )
            c = await submit(tg, b, "c")
            expect_nothing_sent(
                model,
                b,
                "batch-cancel: 'a' and 'c' queued, 'gone' cancelled: 2 of "
                "max_batch_size=3 (a cancelled item does not count towards full)",
            )
            d = await submit(tg, b, "d")
            await expect_sent(
                model,
                [["a", "c", "d"]],
                clock.now_ns(),
                "batch-cancel: the batch is a, c, d — the cancelled item is never sent",
            )
            await outcomes([a, c, d], "the batch without the cancelled item")
            expect_results([a, c, d], "batch-cancel: a cancelled caller blocks no one")


@extended
@rule("batch-cancel", "batch-delay")
async def test_stage2_batches_the_delay_counts_from_the_oldest_item_left_after_a_cancel() -> None:
    clock = ManualClock()
    model = Model(clock)
    with bounded("the item left after a cancellation, at its own delay"):
        async with (
            anyio.create_task_group() as tg,
            serving(new_batcher(model, max_batch_size=8), model) as b,
        ):
            lone = await submit(tg, b, "lone")
            lone.cancel()
            await settled(lambda: lone.done, "the lone caller to leave submit()")
            clock.advance(2 * DELAY)
            await settle()
            expect_nothing_sent(
                model, b, "batch-cancel: the only item was cancelled; past its delay"
            )
            t0 = clock.now_ns()
            oldest = await submit(tg, b, "oldest")
            clock.advance(DELAY // 4)
            kept = await submit(tg, b, "kept")
            oldest.cancel()
            await settled(lambda: oldest.done, "the oldest caller to leave submit()")
            clock.advance(DELAY - DELAY // 4)  # the cancelled item's delay
            await settle()
            expect_nothing_sent(
                model,
                b,
                f"batch-cancel: the oldest item (at {t0}) was cancelled: the delay "
                f"now counts from 'kept' (at {t0 + DELAY // 4}); now {clock.now_ns()}",
            )
            clock.advance(DELAY // 4 - 1)
            await settle()
            expect_nothing_sent(model, b, "batch-cancel: 1 ns before the delay of 'kept'")
            clock.advance(1)
            await expect_sent(
                model, [["kept"]], t0 + DELAY // 4 + DELAY, "batch-delay: 'kept' at its delay"
            )
            await outcomes([kept], "'kept'")
            expect_results([kept], "batch-cancel")


@extended
@rule("batch-cancel")
async def test_stage2_batches_a_caller_cancelled_after_its_batch_was_sent_blocks_no_one() -> None:
    clock = ManualClock()
    model = Model(clock, held=True)
    with bounded("a batch whose first caller was cancelled while fn ran"):
        async with (
            anyio.create_task_group() as tg,
            serving(new_batcher(model, max_batch_size=3), model) as b,
        ):
            callers = [await submit(tg, b, item) for item in ("a", "b", "c")]
            await settled(lambda: len(model.batches) == 1, "the full batch sent")
            callers[0].cancel()
            await settled(lambda: callers[0].done, "the cancelled caller to leave submit()")
            assert callers[0].cancelled, (
                "batch-cancel: a caller cancelled while its batch is in fn: its own submit "
                "ends with its cancellation, neither a result nor the batch's error; the "
                f"cancelled caller {callers[0].outcome()}"
            )
            assert stats(b).in_flight == 1, f"the batch is still in flight: {stats(b)}"
            model.release(0)
            await outcomes(callers[1:], "the callers left in the batch")
            expect_results(
                callers[1:],
                "batch-cancel: the first caller was cancelled after the batch was sent: its "
                "result is dropped, the others get theirs",
            )
            more = [await submit(tg, b, item) for item in ("d", "e", "f")]
            model.release(1)
            await outcomes(more, "the next batch")
            expect_results(more, "batch-cancel: the batcher keeps serving")
            assert stats(b) == BatchStatistics(0, 0, 2, (3, 3)), (
                f"batch-statistics: two batches of 3 sent and done, got {stats(b)}"
            )


@extended
@rule("batch-cancel", "batch-routing", "batch-errors")
@pytest.mark.parametrize("ends", ["returns", "raises", "miscounts"])
@pytest.mark.parametrize("gone", [0, 2])
async def test_stage2_batches_a_caller_cancelled_as_its_batch_ends_gets_no_outcome(
    ends: str, gone: int
) -> None:
    """The cancellation and the batch's outcome meet: ``fn`` cancels one caller and, with
    no await in between, returns (or raises, or miscounts), so the batch's outcome is
    handed out before the cancelled caller runs again. Its cancellation came first: its
    ``submit`` ends with it, neither the result nor the batch's error."""
    clock = ManualClock()
    model = Model(clock, held=True)
    if ends == "raises":
        model.failures[0] = RuntimeError("the model failed on this batch")
    elif ends == "miscounts":
        model.counts[0] = 2
    with bounded("a batch whose caller is cancelled as it ends"):
        async with (
            anyio.create_task_group() as tg,
            serving(new_batcher(model, max_batch_size=3), model) as b,
        ):
            story = Story(f"max_batch_size=3, fn {ends}", clock.now_ns)
            callers = [await submit(tg, b, item) for item in ("a", "b", "c")]
            await settled(lambda: len(model.batches) == 1, "the full batch sent")
            story.add("submit(a), submit(b), submit(c): the batch is sent, fn holds it")
            model.at_end[0] = callers[gone].cancel
            model.release(0)
            story.add(f"fn cancels the caller of {callers[gone].item!r}, then at once {ends}")
            await outcomes(callers, "a batch whose caller was cancelled as it ended")
            for c in callers:
                story.add(f"submit({c.item!r}) {c.outcome()}")
            story.expect(
                callers[gone].outcome(),
                "was cancelled",
                "batch-cancel: a caller cancelled after its batch was sent, before the "
                "batch's outcome reached it: its own submit ends with its cancellation, "
                "neither a result nor the batch's error",
            )
            others = [c for n, c in enumerate(callers) if n != gone]
            if ends == "returns":
                expect_results(others, "batch-cancel: the other callers get their results")
            else:
                want = model.raised.get(0)
                errors = [c.error for c in others]
                story.check(
                    all(isinstance(e, RuntimeError) for e in errors)
                    and (want is None or all(e is want for e in errors)),
                    "batch-errors: the other callers of the batch get its error",
                    f"expected {want or 'a RuntimeError naming 2 and 3'}, got {errors}",
                )
            more = [await submit(tg, b, item) for item in ("d", "e", "f")]
            model.release(1)
            await outcomes(more, "the next batch")
            expect_results(more, "batch-cancel: the batcher keeps serving")


@extended
@rule("batch-cancel", "batch-routing")
async def test_stage2_batches_a_caller_cancelled_once_its_result_is_handed_out_gets_none() -> None:
    """The cancellation comes after the batch's outcome: ``fn`` returns, the batcher hands
    the first caller its result and, while it hands out the last one, the first caller is
    cancelled, before it has run again. It was cancelled after its batch was sent: its
    ``submit`` ends with its cancellation, not with the result waiting for it."""
    clock = ManualClock()
    model = Model(clock)
    callers: list[Caller] = []
    handed: list[Handout[Any]] = []

    async def fn(items: Sequence[Any]) -> Sequence[Any]:
        results = Handout(await model(items), at=len(items) - 1, hook=lambda: callers[0].cancel())
        handed.append(results)
        return results

    batcher: Any = stage().DynamicBatcher(
        fn, max_batch_size=3, max_queue_delay_ns=DELAY, clock=clock
    )
    with bounded("a batch whose first caller is cancelled as the results are handed out"):
        async with anyio.create_task_group() as tg, serving(batcher, model) as b:
            story = Story("max_batch_size=3, fn returns at once", clock.now_ns)
            for item in ("a", "b", "c"):  # one after the other: the batch is a, b, c
                callers.append(await submit(tg, b, item))
            await outcomes(callers, "a batch whose first caller was cancelled as it ended")
            story.add("submit(a), submit(b), submit(c): the batch is sent, fn returns")
            story.add("as the batcher reads the result for 'c', the caller of 'a' is cancelled")
            for c in callers:
                story.add(f"submit({c.item!r}) {c.outcome()}")
            story.check(
                len(handed) == 1 and handed[0].fired,
                "batch-routing: the batch's results are read",
                f"fn called {len(handed)} times, the result for 'c' read: "
                f"{bool(handed) and handed[0].fired}",
            )
            story.expect(
                callers[0].outcome(),
                "was cancelled",
                "batch-cancel: a caller cancelled after its batch was sent, its result "
                "already handed out but before it ran again: its own submit ends with its "
                "cancellation, not with the result",
            )
            expect_results(callers[1:], "batch-cancel: the other callers get their results")


# -- batches overlap -------------------------------------------------------------------


@core
@rule("batch-concurrent", "batch-statistics")
async def test_stage2_batches_a_slow_batch_holds_back_neither_the_next_nor_its_callers() -> None:
    clock = ManualClock()
    model = Model(clock, held=True)
    with bounded("three batches in flight at once"):
        async with (
            anyio.create_task_group() as tg,
            serving(new_batcher(model, max_batch_size=2), model) as b,
        ):
            first = [await submit(tg, b, item) for item in ("a", "b")]
            await settled(lambda: len(model.batches) == 1, "the first batch sent")
            second = [await submit(tg, b, item) for item in ("c", "d")]
            await settled(
                lambda: len(model.batches) == 2,
                "batch-concurrent: the second batch (full) sent while the first is still in fn",
            )
            third = [await submit(tg, b, "e")]
            clock.advance(DELAY)
            await settled(
                lambda: len(model.batches) == 3,
                "batch-concurrent: the third batch (due) sent while two are still in fn",
            )
            await settle()
            assert stats(b) == BatchStatistics(0, 3, 3, (2, 2, 1)), (
                f"batch-statistics: three batches in flight: expected "
                f"{BatchStatistics(0, 3, 3, (2, 2, 1))}, got {stats(b)}"
            )
            for n, group in ((2, third), (1, second), (0, first)):
                model.release(n)
                await outcomes(group, f"batch {n}")
                expect_results(group, f"batch-concurrent: batch {n} released")
                waiting = [c.item for g in (first, second)[:n] for c in g if c.done]
                assert not waiting, (
                    f"batch-concurrent: only batch {n} was released, yet {waiting} got outcomes"
                )
            assert stats(b) == BatchStatistics(0, 0, 3, (2, 2, 1)), (
                f"batch-statistics: every batch done, got {stats(b)}"
            )


@extended
@rule("batch-statistics", "batch-concurrent")
async def test_stage2_batches_a_batch_is_in_flight_from_the_instant_it_is_sent() -> None:
    """Two batches sent in one go: each is in flight from its send, before its task has
    started. Seen from inside each ``fn`` call, ``in_flight`` is every batch sent whose
    ``fn`` has not ended — not only those whose task got to run."""
    clock = ManualClock()
    model = Model(clock)
    seen: list[tuple[BatchStatistics, int]] = []

    async def fn(items: Sequence[Any]) -> list[str]:
        seen.append((stats(b), sum(1 for how in model.ended if how)))
        return await model(items)

    b = stage().DynamicBatcher(fn, max_batch_size=2, max_queue_delay_ns=DELAY, clock=clock)
    with bounded("two full batches sent in one go"):
        async with anyio.create_task_group() as tg, serving(b, model):
            await settle()  # the batcher waits for its first item
            callers = [Caller(b, item) for item in "abcd"]
            for caller in callers:  # all four queued before the batcher looks
                tg.start_soon(caller.run)
            await outcomes(callers, "two full batches")
    wrong = [(s, ended) for s, ended in seen if s.in_flight != s.dispatched - ended]
    assert len(seen) == 2 and not wrong, (
        "batch-statistics: a b c d submitted at once, max_batch_size=2: two batches sent. "
        "in_flight counts every batch sent whose fn has not ended, from the instant it is "
        "sent; read from inside each fn call, expected in_flight == dispatched - ended, got "
        + "; ".join(f"{s} with {ended} ended" for s, ended in seen)
    )


# -- closing ---------------------------------------------------------------------------


@core
@rule("batch-close")
@pytest.mark.parametrize(
    "how", ["normally", "by an exception"], ids=["normally", "by-an-exception"]
)
async def test_stage2_batches_leaving_the_block_sends_what_is_queued_and_waits(how: str) -> None:
    clock = ManualClock()
    model = Model(clock, held=True)
    b = new_batcher(model, max_batch_size=3)
    exited = False
    late: list[Caller] = []

    async def closer(tg: anyio.abc.TaskGroup) -> None:
        """While __aexit__ drains: check it, try a late submit, then let fn finish."""
        await settled(
            lambda: len(model.batches) == 2,
            f"batch-close: leaving the block ({how}) sends the queued items at once, the "
            "clock not moved",
        )
        assert not exited, "batch-close: __aexit__ returned while batches were in flight"
        late.append(await submit(tg, b, "late"))
        model.release_all()

    with bounded(f"the block left {how} to drain"):
        async with anyio.create_task_group() as tg:
            try:
                async with b:
                    in_flight = [await submit(tg, b, item) for item in ("a", "b", "c")]
                    queued = [await submit(tg, b, item) for item in ("d", "e")]
                    assert len(model.batches) == 1 and stats(b).queued == 2, (
                        f"one full batch held in fn, two items queued: {model.describe()}, "
                        f"statistics() {stats(b)}"
                    )
                    tg.start_soon(closer, tg)
                    if how == "by an exception":
                        raise Boom("the block failed")
            except Boom:
                pass
            except BaseExceptionGroup as group:
                if group.subgroup(Todo) is not None:
                    raise
                raise AssertionError(
                    f"batch-close: the block's own exception propagates unchanged, not wrapped "
                    f"in a group: got {group!r}"
                ) from group
            else:
                assert how == "normally", "batch-close: the block's exception must propagate"
            exited = True
            assert (
                model.batches == [["a", "b", "c"], ["d", "e"]] and model.times[1] == model.times[0]
            ), (
                f"batch-close: the queued items are sent at once, when the block is left "
                f"(not at their delay); {model.describe()}"
            )
            assert all(e == "returned" for e in model.ended), (
                f"batch-close: __aexit__ returns once every batch has ended: {model.ended}"
            )
            await outcomes(in_flight + queued, "the drained batches")
            expect_results(in_flight + queued, f"batch-close: the block left {how}")
            assert late and isinstance(late[0].error, EngineClosed), (
                f"batch-close: submit() while the batcher closes raises EngineClosed; "
                f"it {late[0].outcome() if late else 'never ran'}"
            )
            assert stats(b) == BatchStatistics(0, 0, 2, (3, 2)), f"closed: {stats(b)}"


@extended
@rule("batch-close", "batch-order")
async def test_stage2_batches_a_drain_of_more_than_a_batch_sends_several() -> None:
    clock = ManualClock()
    model = Model(clock)
    b = new_batcher(model, max_batch_size=2)
    order: list[str] = []
    callers = [Caller(b, item, order) for item in ("a", "b", "c", "d", "e")]
    with bounded("the block left with five items queued to drain"):
        async with anyio.create_task_group() as tg, b:
            for caller in callers:  # queued before the batcher's task runs (asyncio)
                tg.start_soon(caller.run)
            await anyio.lowlevel.checkpoint()
    await outcomes(callers, "the drained batches")
    expect_capped_and_in_order(model, callers, order, 2, "batch-close: items queued at close")


@extended
@rule("batch-order", "batch-delay")
async def test_stage2_batches_items_queued_when_a_batch_falls_due_go_in_several() -> None:
    clock = ManualClock()
    model = Model(clock)
    b = new_batcher(model, max_batch_size=2)
    order: list[str] = []
    with bounded("a due batch with four items queued"):
        async with anyio.create_task_group() as tg, serving(b, model):
            first = await submit(tg, b, "a")
            order.append("a")
            callers = [first] + [Caller(b, item, order) for item in ("b", "c", "d")]
            for caller in callers[1:]:  # queued in the tick 'a' falls due
                tg.start_soon(caller.run)
            clock.advance(DELAY)
            await settle()
            clock.advance(DELAY)  # what was left (if 'a' went before the others queued)
            await outcomes(callers, "the due batches")
    expect_capped_and_in_order(
        model, callers, order, 2, "batch-order: items queued when 'a' fell due"
    )


@extended
@rule("batch-close")
async def test_stage2_batches_leaving_by_cancellation_cancels_fn_and_tells_every_caller() -> None:
    clock = ManualClock()
    model = Model(clock, held=True)
    b = new_batcher(model, max_batch_size=2)
    entered = anyio.Event()
    callers: list[Caller] = []

    async def block(tg: anyio.abc.TaskGroup) -> None:
        async with b:
            callers.extend([await submit(tg, b, item) for item in ("a", "b", "c")])
            entered.set()
            await anyio.sleep_forever()

    with bounded("the block, cancelled, to return"):
        async with anyio.create_task_group() as tg:
            async with anyio.create_task_group() as runner:
                runner.start_soon(block, tg)
                await entered.wait()
                runner.cancel_scope.cancel()
            await outcomes(callers, "a cancelled batcher's callers")
    assert model.batches == [["a", "b"]] and model.ended == ["cancelled"], (
        f"batch-close: the task running the block was cancelled: fn's call in flight is "
        f"cancelled and nothing more is sent; {model.describe()}, ended {model.ended}"
    )
    wrong = [c for c in callers if not isinstance(c.error, EngineClosed)]
    assert not wrong, "batch-close: every caller still waiting gets EngineClosed:\n" + "\n".join(
        f"  submit({c.item!r}) {c.outcome()}" for c in wrong
    )
    with bounded("submit() after the block to raise", SETTLE_S), pytest.raises(EngineClosed):
        await b.submit("late")
        raise AssertionError("batch-close: submit() after the block must raise EngineClosed")


@extended
@rule("batch-close")
async def test_stage2_batches_submit_outside_the_block_is_refused() -> None:
    clock = ManualClock()
    model = Model(clock)
    b = new_batcher(model, max_batch_size=2)
    with (
        bounded("submit() before the block to raise", SETTLE_S),
        pytest.raises(RuntimeError, match="async with"),
    ):
        await b.submit("early")
        raise AssertionError("batch-close: submit() before `async with` must raise RuntimeError")
    with bounded("a batcher entered twice to raise", SETTLE_S):
        async with b:
            with pytest.raises(RuntimeError):
                async with b:
                    raise AssertionError("batch-close: a batcher is entered once")
    with bounded("submit() after the block to raise", SETTLE_S), pytest.raises(EngineClosed):
        await b.submit("late")
        raise AssertionError("batch-close: submit() after the block must raise EngineClosed")
    assert not model.batches, f"nothing was submitted: {model.describe()}"


# -- bad input -------------------------------------------------------------------------


async def _fn(items: Sequence[Any]) -> list[Any]:
    return list(items)


@extended
@rule("batch-bad-input")
@pytest.mark.parametrize(
    ("name", "value", "kind"),
    [
        ("max_batch_size", 0, ValueError),
        ("max_batch_size", -1, ValueError),
        ("max_batch_size", 2.0, TypeError),
        ("max_batch_size", "8", TypeError),
        ("max_batch_size", True, TypeError),
        ("max_queue_delay_ns", -1, ValueError),
        ("max_queue_delay_ns", 0.5, TypeError),
        ("max_queue_delay_ns", 1e6, TypeError),
        ("max_queue_delay_ns", None, TypeError),
        ("max_queue_delay_ns", True, TypeError),
        ("fn", None, ValueError),
        ("fn", "embed", ValueError),
        ("clock", None, ValueError),
        ("clock", "monotonic", ValueError),
        pytest.param("clock", ReadOnlyClock(), ValueError, id="clock-that-cannot-wait"),
    ],
)
async def test_stage2_batches_bad_input_names_the_parameter(
    name: str, value: object, kind: type[Exception]
) -> None:
    cls = stage().DynamicBatcher
    good: dict[str, Any] = {"max_batch_size": 1, "max_queue_delay_ns": 0, "clock": ManualClock()}
    cls(_fn, **good)  # the smallest valid values are fine
    args: dict[str, Any] = {"fn": _fn, **good, name: value}
    fn = args.pop("fn")
    with pytest.raises(kind) as caught:
        cls(fn, **args)
        raise AssertionError(
            f"batch-bad-input: DynamicBatcher({name}={value!r}) must raise {kind.__name__}"
        )
    assert name in str(caught.value), (
        f"batch-bad-input: DynamicBatcher({name}={value!r}) raised {caught.value!r}: the "
        f"message must name {name}"
    )
