"""Stage 2, the edges of its rules (see katas/rate_limiter/README.md, "Stage 2"): a head
waiter with a timeout still wakes when its units are due, a task whose units come exactly
at its deadline is admitted, a head woken past its deadline is admitted only if its units
came by then, a waiter behind the head whose units come at its deadline is admitted, a
cost that can never fit behind waiters is denied with nothing remaining, an async key
with no waiters left is gone from the statistics, ``reset`` and ``tracked_keys`` do only
what they say under the stripe, and a bad argument of the right type is a
``ValueError``, of the wrong type a ``TypeError``.

Deterministic as ``test_stage2.py`` is (its docstring): a ``ManualClock``, waiters
sequenced through ``statistics()``, hard deadlines, a thread parked inside the inner
limiter, a woken thread or task held back by the test clock so that another looks first
(:mod:`katas.rate_limiter._testing.clocks`).

Map: head wake-ups (acquire-blocks, async-fifo) · late wake-ups and a deadline behind the
head (acquire-blocks, fifo, async-fifo, async-cancel) · a never-fitting cost behind
waiters (no-overtaking) · the async queue's end (async-cancel,
statistics) · ``reset`` under its stripe (striped-locks) · ``tracked_keys`` changes nothing
(tracked-keys-inner, sweeping) · the kind of a bad argument (bad-arguments,
async-bad-arguments).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import partial
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from katas._harness.interleave import Gate, announce_waits, pause_before_locks, pause_in_loops
from katas._harness.marks import anyio_test, core, extended
from katas._harness.story import check, expect
from katas._harness.under_test import stage
from katas._harness.waiting import eventually_async, stays
from katas.rate_limiter._testing.clocks import HeldWakeClock
from katas.rate_limiter._testing.threads import (
    Worker,
    async_limiter,
    bucket_limiter,
    emptied_async_limiter,
    enqueue,
    enqueue_async,
    eventually,
    spied_limiter,
    start,
    units_left,
)
from katas.rate_limiter.api import NS_PER_S, Decision, LimiterStatistics, ManualClock

pytestmark = [pytest.mark.stage(2)]


@pytest.mark.rule("no-overtaking", "striped-locks")
@core
@pytest.mark.parametrize("call", ["try_acquire", "peek"])
def test_stage2_a_newcomer_sees_a_waiter_that_queued_before_it_took_the_stripe(
    call: str,
) -> None:
    """The newcomer stops right before it takes the stripe's lock; meanwhile a caller
    queues on the key for more than is on hand and goes to sleep. Once inside, the
    newcomer must see that waiter: the unit on hand is the queue's."""
    clock, limiter = bucket_limiter(3, refill_per_s=1)
    assert limiter.try_acquire("k", 2).allowed  # 1 unit left: a cost of 3 must wait
    waiters: list[Worker] = []
    asleep = threading.Event()

    def wait_for_three() -> bool:
        announce_waits(asleep)
        return limiter.acquire("k", 3)

    def woken() -> bool:
        if not waiters:
            waiters.append(start(wait_for_three, "a waiter for 3 units of 'k'"))
        return asleep.is_set()

    def newcomer() -> Decision:
        pause_before_locks(type(limiter).__module__, woken, lambda: asleep.is_set())
        decision: Decision = getattr(limiter, call)("k")
        return decision

    got = start(newcomer, f"a newcomer's {call}").outcome(f"{call}('k') returns")
    check(
        asleep.is_set() and not got.allowed,
        f"no-overtaking: a caller queued on 'k' for 3 units while {call}('k') was on its way "
        f"to the stripe's lock; the queue's state must be read under that lock, so {call} "
        f"is denied (the unit on hand belongs to the queue) — got {got}",
    )
    clock.advance(2 * NS_PER_S)  # 3 units on hand: the waiter is admitted
    check(waiters[0].outcome("the waiter for 3 units") is True, "the waiter is admitted")


@pytest.mark.rule("statistics", "striped-locks")
@core
def test_stage2_statistics_reads_each_waiter_queue_under_its_stripe() -> None:
    """``statistics()`` walks the waiter queues: a caller joining a queue in the middle
    of that walk must wait for the stripe's lock, as every change to a queue does. The
    reader stops at each step of every loop of the code under test; at each stop one
    more caller tries to queue on a key of the same (only) stripe."""
    clock, limiter = bucket_limiter(1, refill_per_s=1, stripes=1)
    keys = ["a", "b", "c", "d"]
    assert all(limiter.try_acquire(key).allowed for key in keys)
    enqueue(limiter, "a", lambda: limiter.acquire("a"), "the waiter on 'a'")
    joiners: list[tuple[Worker, threading.Event]] = []

    def join(key: str, queued: threading.Event) -> bool:
        announce_waits(queued)
        return limiter.acquire(key)

    stop = {"new": True}  # the next call of woken() is the first of a stop

    def woken() -> bool:
        """At each stop one more caller tries to queue; the stop ends once it has (it
        sleeps on the clock), or at its deadline while it waits for the stripe."""
        if stop["new"] and len(joiners) < len(keys) - 1:
            queued = threading.Event()
            key = keys[len(joiners) + 1]
            joiner = start(partial(join, key, queued), f"a caller joining {key!r}")
            joiners.append((joiner, queued))
        stop["new"] = not joiners or joiners[-1][1].is_set()
        return stop["new"]

    def read() -> object:
        pause_in_loops(type(limiter).__module__, woken, lambda: False, deadline_s=0.1)
        try:
            return limiter.statistics()
        except RuntimeError as exc:  # "dictionary changed size during iteration"
            return exc

    got = start(read, "statistics").outcome("statistics() returns")
    check(
        not isinstance(got, Exception),
        f"striped-locks: a caller joined a waiter queue while statistics() was walking "
        f"the queues, and the walk raised {got!r}: read each stripe's queues under its "
        f"lock (joining a queue takes it)",
    )
    assert isinstance(got, LimiterStatistics)
    expect(got.waiters, sum(got.waiters_by_key.values()), "statistics().waiters, the sum")
    clock.advance(NS_PER_S)  # a unit for each key: every caller is admitted
    for worker, _ in joiners:
        check(worker.outcome("a caller queued on its key") is True, "a queued caller is admitted")


@pytest.mark.rule("acquire-blocks", "wait-through-clock")
@core
def test_stage2_a_head_with_a_long_timeout_is_admitted_when_its_units_are_due() -> None:
    clock, limiter = bucket_limiter(1, refill_per_s=1)
    assert limiter.try_acquire("k").allowed
    head = enqueue(
        limiter, "k", lambda: limiter.acquire("k", timeout_ns=10 * NS_PER_S), "timeout 10 s"
    )
    clock.advance(NS_PER_S)
    check(
        head.outcome("a head waiter whose unit is back after 1 s, its deadline at 10 s") is True,
        "acquire-blocks: the head sleeps until its units are due or its deadline, whichever "
        "comes first; its unit is back at 1 s, so it is admitted then",
    )


@pytest.mark.rule("acquire-blocks", "timeout-consumes-nothing")
@core
def test_stage2_a_late_waking_head_gets_only_units_due_by_its_deadline() -> None:
    """The clock jumps past the head's deadline in one step (a stalled process, a late
    scheduler): what counts is when its units came, not when it woke."""
    clock, limiter = bucket_limiter(1, refill_per_s=1)
    assert limiter.try_acquire("k").allowed  # the unit is back in exactly 1 s
    short = enqueue(
        limiter, "k", lambda: limiter.acquire("k", timeout_ns=NS_PER_S - 1), "timeout 1 s - 1 ns"
    )
    clock.advance(NS_PER_S)
    got = short.outcome("a head whose unit comes 1 ns after its deadline, woken at 1 s")
    left = units_left(limiter, "k")
    check(
        (got, left) == (False, 1),
        "acquire-blocks: bucket of 1, emptied, refilling 1 unit a second; acquire('k', "
        "timeout_ns=1 s - 1 ns); the clock moves 1 s in one step. The unit fits only 1 ns "
        "after the deadline: False, and the unit stays on hand (expected (False, 1 unit "
        f"left)); got ({got}, {left} left)",
    )
    assert limiter.try_acquire("k").allowed  # emptied again: the unit is back in 1 s
    exact = enqueue(limiter, "k", lambda: limiter.acquire("k", timeout_ns=NS_PER_S), "timeout 1 s")
    clock.advance(5 * NS_PER_S)
    got = exact.outcome("a head whose unit comes exactly at its deadline, woken 4 s later")
    check(
        got is True,
        "acquire-blocks: emptied again; acquire('k', timeout_ns=1 s); the clock moves 5 s in "
        "one step. The unit fitted exactly at the deadline (now + timeout_ns): admitted, "
        f"however late the waiter woke; got {got}",
    )


@pytest.mark.rule("acquire-blocks", "fifo", "timeout-consumes-nothing")
@core
def test_stage2_a_waiter_behind_the_head_fitting_at_its_deadline_is_admitted() -> None:
    """Capacity 3, emptied, 1 unit a second. A (cost 2, no timeout) is the head; B (cost 1,
    timeout 3 s) waits behind it. At +3 s, in one step, 3 units are on hand: A takes 2
    and 1 is left for B — exactly at B's deadline. The clock wakes both; A is held after
    its wake-up, so B looks first, at its deadline, with A not yet served."""
    clock = HeldWakeClock()
    _, limiter = bucket_limiter(3, clock=clock)
    assert limiter.try_acquire("k", 3).allowed
    held = Gate("A woken, before it takes the stripe's lock again")
    b_asleep = threading.Event()

    def head() -> bool:
        clock.hold_my_wakes(held)
        return limiter.acquire("k", 2)

    def behind() -> bool:
        announce_waits(b_asleep)
        return limiter.acquire("k", 1, timeout_ns=3 * NS_PER_S)

    a = enqueue(limiter, "k", head, "A: acquire('k', 2)")
    b = enqueue(limiter, "k", behind, "B: acquire('k', 1, timeout_ns=3 s)")
    b_asleep.clear()  # queued means asleep: from now on, set when B waits again
    clock.advance(3 * NS_PER_S)
    held.wait_arrived()
    eventually(lambda: b_asleep.is_set() or not b.is_alive(), "B to look at the queue", (b,))
    held.open()
    got = (a.outcome("A, once let go"), b.outcome("B"), units_left(limiter, "k"))
    check(
        got == (True, True, 0),
        "acquire-blocks: capacity 3 emptied; A acquire('k', 2) at the head, B acquire('k', 1, "
        "timeout_ns=3 s) behind it; the clock moves 3 s in one step and B looks before A "
        "does. A's 2 and B's 1 both fit at B's deadline (now + timeout_ns): B must wait for "
        "A to take its share, then take its own, not give up. Expected (A True, B True, 0 "
        f"units left); got (A {got[0]}, B {got[1]}, {got[2]} left)",
    )


@pytest.mark.rule("no-overtaking")
@core
@pytest.mark.parametrize("call", ["try_acquire", "peek"])
def test_stage2_a_cost_that_can_never_fit_behind_waiters_sees_nothing_remaining(
    call: str,
) -> None:
    clock, limiter = bucket_limiter(3, refill_per_s=1)
    assert limiter.try_acquire("k", 1).allowed  # 2 units on hand
    waiter = enqueue(limiter, "k", lambda: limiter.acquire("k", 3), "a waiter for 3 units")
    got: Decision = getattr(limiter, call)("k", 4)
    check(
        (got.allowed, got.remaining, got.retry_after_ns) == (False, 0, None),
        f"no-overtaking: bucket of 3 with 2 units on hand and a waiter queued for 3; "
        f"{call}('k', 4) can never fit: denied, retry_after_ns None, and remaining 0 — the "
        f"units on hand are the queue's. Expected allowed False, remaining 0, retry_after_ns "
        f"None; got {got}",
    )
    clock.advance(NS_PER_S)
    check(waiter.outcome("the waiter for 3 units") is True, "the waiter is admitted at 1 s")


@pytest.mark.rule("async-fifo", "async-exact")
@extended
@anyio_test
async def test_stage2_async_a_head_is_admitted_when_its_units_are_due_or_at_its_deadline() -> None:
    clock, limiter = emptied_async_limiter()
    results: dict[str, bool] = {}

    async def wait(name: str, timeout_ns: int) -> None:
        results[name] = await limiter.acquire("k", 1, timeout_ns=timeout_ns)

    async with anyio.create_task_group() as tg:
        await enqueue_async(tg, limiter, "k", partial(wait, "timeout 10 s", 10 * NS_PER_S))
        clock.advance(NS_PER_S)
        await eventually_async(lambda: "timeout 10 s" in results, "the head admitted at 1 s")
        await enqueue_async(tg, limiter, "k", partial(wait, "timeout 1 s", NS_PER_S))
        clock.advance(NS_PER_S)
        await eventually_async(lambda: len(results) == 2, "the second admitted at its deadline")
    expect(
        results,
        {"timeout 10 s": True, "timeout 1 s": True},
        "async-fifo: a task whose unit is due at 1 s with a 10 s timeout is admitted at 1 s "
        "(its units are due before its deadline); a task whose unit is due exactly at its "
        "deadline is admitted (it fits at now + timeout_ns)",
    )


@pytest.mark.rule("async-cancel", "async-fifo")
@extended
@anyio_test
async def test_stage2_async_a_late_waking_head_gets_only_units_due_by_its_deadline() -> None:
    clock, limiter = emptied_async_limiter()  # 1 unit back in exactly 1 s
    results: list[bool] = []

    async def wait(timeout_ns: int) -> None:
        results.append(await limiter.acquire("k", 1, timeout_ns=timeout_ns))

    async with anyio.create_task_group() as tg:
        await enqueue_async(tg, limiter, "k", partial(wait, NS_PER_S - 1))
        clock.advance(NS_PER_S)
        await eventually_async(lambda: len(results) == 1, "the first task to return")
    expect(
        results,
        [False],
        "async-cancel: a task's unit comes back 1 ns after its deadline (timeout 1 s - 1 ns) "
        "and the clock jumps 1 s in one step: False, however late it woke",
    )
    check(limiter.try_acquire("k").allowed, "the unit the timed-out task left is on hand")
    async with anyio.create_task_group() as tg:  # emptied again: 1 unit in exactly 1 s
        await enqueue_async(tg, limiter, "k", partial(wait, NS_PER_S))
        clock.advance(5 * NS_PER_S)
        await eventually_async(lambda: len(results) == 2, "the second task to return")
    expect(
        results,
        [False, True],
        "async-cancel: the next task's unit comes back exactly at its deadline (timeout 1 s) "
        "and the clock jumps 5 s in one step: admitted, however late it woke",
    )


@pytest.mark.rule("async-fifo", "async-cancel")
@extended
@anyio_test
async def test_stage2_async_a_waiter_behind_the_head_fitting_at_its_deadline_is_admitted() -> None:
    """Capacity 3, emptied. A (cost 2, no timeout) is the head, its units due at +2 s;
    B (cost 1, timeout 3 s) waits behind it. The clock jumps 3 s: A's 2 and B's 1 fit
    at B's deadline. A's alarm is held, so B looks first, with A not yet served."""
    clock = HeldWakeClock()
    _, limiter = async_limiter(3, clock=clock)
    assert limiter.try_acquire("k", 3).allowed
    let_go = anyio.Event()
    clock.hold_sleeps_until(clock.now_ns() + 2 * NS_PER_S, let_go)  # A's alarm
    results: dict[str, bool] = {}

    async def wait(name: str, cost: int, timeout_ns: int | None) -> None:
        results[name] = await limiter.acquire("k", cost, timeout_ns=timeout_ns)

    async with anyio.create_task_group() as tg:
        await enqueue_async(tg, limiter, "k", partial(wait, "A", 2, None))
        await enqueue_async(tg, limiter, "k", partial(wait, "B", 1, 3 * NS_PER_S))
        clock.advance(3 * NS_PER_S)
        for _ in range(50):  # scheduler passes: B's alarm fires and B looks at the queue
            await anyio.lowlevel.checkpoint()
        let_go.set()
        await eventually_async(lambda: len(results) == 2, "A and B to return")
    expect(
        results,
        {"A": True, "B": True},
        "async-fifo: capacity 3 emptied; A acquire('k', 2) at the head, B acquire('k', 1, "
        "timeout_ns=3 s) behind it; the clock jumps 3 s and B looks before A does. Both fit "
        "at B's deadline (now + timeout_ns): B waits for A to take its share, then takes "
        "its own",
    )


@pytest.mark.rule("async-cancel", "statistics")
@extended
@anyio_test
async def test_stage2_async_a_key_whose_last_waiter_left_has_no_queue() -> None:
    clock, limiter = emptied_async_limiter()
    results: list[bool] = []

    async def impatient() -> None:
        results.append(await limiter.acquire("k", 2, timeout_ns=NS_PER_S))

    async with anyio.create_task_group() as tg:
        await enqueue_async(tg, limiter, "k", impatient)
        clock.advance(NS_PER_S)
        await eventually_async(lambda: results == [False], "the only waiter times out")
    stats = limiter.statistics()
    check(
        (stats.waiters, stats.waiters_by_key) == (0, {}),
        f"async-cancel: the only waiter on 'k' timed out: no task waits, so 'k' is absent "
        f"from statistics (keys with none absent); got {stats}",
    )
    with anyio.fail_after(5):
        admitted = await limiter.acquire("k", 1, timeout_ns=0)
    check(
        admitted,
        "async-cancel: with its waiter gone and 1 unit back on hand, acquire('k', 1, "
        "timeout_ns=0) is admitted: no queue is left for it to wait behind",
    )


@pytest.mark.rule("striped-locks", "refund-reset-wake")
@core
def test_stage2_reset_holds_its_stripe_around_the_inner_limiter() -> None:
    gate = Gate("inside the inner limiter's reset()", limit=1)
    _, spy, limiter = spied_limiter(gate, ("reset",))
    a = start(partial(limiter.reset, "k"), "A: reset('k')")
    gate.wait_arrived(1)
    b = start(partial(limiter.try_acquire, "k"), "B: try_acquire('k')")
    try:
        stays(
            lambda: not spy.overlaps,
            "thread B's try_acquire('k') outside the inner limiter while thread A's reset('k') "
            "is inside the inner reset (a stripe's lock guards the inner state of its keys: a "
            "reset outside it lands in the middle of another thread's check and update)",
        )
    finally:
        gate.open()
    a.outcome("A: reset('k'), once released")
    b.outcome("B, once the reset let go of the stripe")


@pytest.mark.rule("tracked-keys-inner", "sweeping")
@core
def test_stage2_tracked_keys_counts_and_forgets_nothing() -> None:
    clock, limiter = bucket_limiter(1, refill_per_s=1)
    for key in ("a", "b", "c"):
        assert limiter.try_acquire(key).allowed
    clock.advance(NS_PER_S)  # all three are fresh again
    counted = limiter.tracked_keys()
    swept = limiter.sweep()
    check(
        (counted, swept) == (0, 3),
        "tracked-keys-inner: three keys idle again; tracked_keys() counts them (0: none is "
        "in use) and forgets nothing, so the sweep after it forgets all three; got "
        f"tracked_keys() {counted}, then sweep() {swept}",
    )


def _stripes(stripes: Any) -> Callable[[], object]:
    clock = ManualClock()
    inner = stage(1).TokenBucket(capacity=2, refill_per_s=1, clock=clock, auto_sweep=False)
    return lambda: stage(2).ThreadSafeLimiter(inner, clock=clock, stripes=stripes)


def _timeout(timeout_ns: Any) -> Callable[[], object]:
    _, limiter = bucket_limiter(2, refill_per_s=1)
    return lambda: limiter.acquire("k", 1, timeout_ns=timeout_ns)


#: A bad argument: its call, the error it must raise (a wrong value: ValueError, a wrong
#: type: TypeError) and the parameter the message names.
BAD: dict[str, tuple[Callable[[], Callable[[], object]], type[Exception], str]] = {
    "stripes=0": (partial(_stripes, 0), ValueError, "stripes"),
    "stripes=65537": (partial(_stripes, 65537), ValueError, "stripes"),
    "stripes=1.5": (partial(_stripes, 1.5), TypeError, "stripes"),
    "timeout_ns=-1": (partial(_timeout, -1), ValueError, "timeout_ns"),
    "timeout_ns=1.5": (partial(_timeout, 1.5), TypeError, "timeout_ns"),
    "timeout_ns=True": (partial(_timeout, True), TypeError, "timeout_ns"),
}


@pytest.mark.rule("bad-arguments")
@core
@pytest.mark.parametrize("case", sorted(BAD))
def test_stage2_a_bad_argument_is_a_value_error_or_a_type_error_by_what_is_wrong(case: str) -> None:
    build, error, param = BAD[case]
    call = build()
    with pytest.raises((ValueError, TypeError)) as caught:
        call()
        raise AssertionError(f"{case} was accepted")
    check(
        type(caught.value) is error and param in str(caught.value),
        f"bad-arguments: {case} is a wrong {'value' if error is ValueError else 'type'}, so a "
        f"{error.__name__} naming {param}; got {caught.value!r}",
    )


@pytest.mark.rule("async-bad-arguments")
@extended
@anyio_test
async def test_stage2_async_a_timeout_that_is_not_an_int_is_a_type_error() -> None:
    _, limiter = async_limiter(2)  # units on hand: a timeout taken as valid admits at once
    for timeout in (1.5, True):
        with pytest.raises((ValueError, TypeError)) as caught:
            with anyio.fail_after(5):
                await limiter.acquire("k", 1, timeout_ns=timeout)  # type: ignore[arg-type]
            raise AssertionError(f"acquire('k', 1, timeout_ns={timeout!r}) was accepted")
        check(
            type(caught.value) is TypeError and "timeout_ns" in str(caught.value),
            f"async-bad-arguments: timeout_ns={timeout!r} is not an int: a TypeError naming "
            f"timeout_ns; got {caught.value!r}",
        )
