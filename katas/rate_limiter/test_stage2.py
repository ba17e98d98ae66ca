"""Stage 2 — the limiters under threads and tasks (see katas/rate_limiter/README.md).

Core: ``ThreadSafeLimiter`` (striped locks, blocking FIFO ``acquire``). Extended:
``AsyncLimiter`` (anyio: asyncio and trio) and ``ConcurrencyLimiter`` (leases).

How these tests stay deterministic: the clock is a ``ManualClock`` that moves only
when a test advances it, so "admitted at this instant" is exact; waiters are sequenced
through ``statistics()`` instead of sleeps; every wait has a hard real-time deadline,
and every thread is a daemon. Races are provoked with barrier-started bursts under a
tiny ``sys.setswitchinterval``, round after round, with exact-count assertions, and
forced by parking a thread inside the inner limiter (:mod:`katas._harness.interleave`).
The builders and thread drivers are in :mod:`katas.rate_limiter._testing.threads`; the
model-based tests compare the wrapper with stage 1's exact token bucket
(:mod:`katas.rate_limiter._testing.models`).

Map: ThreadSafeLimiter — over-admission under threads (atomic-decision), FIFO waiters
(fifo, acquire-blocks, no-overtaking), timeouts (timeout-consumes-nothing), refund and
reset wake-ups (refund-reset-wake), bad arguments (bad-arguments), sweeping (sweeping,
tracked-keys-inner), deadlocks (no-deadlock), the stripe lock held around the inner
limiter and by every sweep (striped-locks, sweeping), a denial made while the head
waiter has not yet taken its units (no-overtaking), a timeout counted from the call
(acquire-blocks), the model test (same-decisions, statistics) · AsyncLimiter — bursts
(async-exact), FIFO (async-fifo), cancellation and timeouts (async-cancel), ``limit()``
(async-limit), refunds (async-refund-wakes), bad arguments (async-bad-arguments).

The stage's other suite: ``test_stage2_leases.py`` (``ConcurrencyLimiter``).
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable
from fractions import Fraction
from functools import partial
from typing import Any

import anyio
import anyio.lowlevel
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from katas._harness.interleave import Gate
from katas._harness.marks import anyio_test, core, extended
from katas._harness.resting import SelfWakingClock, rest_on
from katas._harness.story import check, expect
from katas._harness.under_test import stage
from katas._harness.waiting import (
    DEADLINE_S,
    eventually_async,
    stays,
    stays_async,
    tiny_switch_interval,
)
from katas._runtime.clock import NS_PER_MS
from katas.rate_limiter._testing.models import TokenBucketModel
from katas.rate_limiter._testing.threads import (
    LateWakeClock,
    acquire_into,
    async_limiter,
    bucket_limiter,
    emptied_async_limiter,
    enqueue,
    enqueue_async,
    eventually,
    parked_limiter,
    reaches,
    run_together,
    spied_limiter,
    start,
    stays_at,
    units_left,
    waiters_on,
)
from katas.rate_limiter.api import (
    NS_PER_S,
    BlockingLimiter,
    ManualClock,
)

pytestmark = [pytest.mark.stage(2)]

# --- ThreadSafeLimiter (core) ---------------------------------------------------------


@pytest.mark.rule("atomic-decision")
@core
def test_stage2_no_over_admission_under_threads() -> None:
    # Every key is a burst of `threads` × `attempts` requests at one frozen instant. Keys
    # are fresh, because a key's first requests race hardest: each may see "no state yet".
    threads, attempts, keys, rounds = 8, 2, 50, 200
    capacity = threads * attempts // 2
    with tiny_switch_interval():
        for round_no in range(rounds):
            _, limiter = bucket_limiter(capacity, stripes=4)

            def burst(_: int, limiter: BlockingLimiter = limiter) -> list[int]:
                return [
                    sum(limiter.try_acquire(f"k{k}").allowed for _ in range(attempts))
                    for k in range(keys)
                ]

            per_thread = run_together(threads, burst)
            for k in range(keys):
                admitted = sum(counts[k] for counts in per_thread)
                assert admitted == capacity, (
                    f"{threads} threads × {attempts} try_acquire('k{k}') at one frozen "
                    f"instant on a bucket of capacity {capacity} admitted {admitted} (round "
                    f"{round_no}); exactly {capacity} must be. Check-then-act on a key must be "
                    "atomic: hold the key's stripe lock around the inner limiter's decision"
                )


@pytest.mark.rule("atomic-decision", "acquire-blocks")
@core
@given(
    capacity=st.integers(1, 30),
    plans=st.lists(st.lists(st.integers(1, 8), min_size=1, max_size=12), min_size=2, max_size=6),
)
def test_stage2_burst_conserves_units_and_never_denies_what_fits(
    capacity: int, plans: list[list[int]]
) -> None:
    _, limiter = bucket_limiter(capacity, stripes=2)

    def burst(i: int) -> list[tuple[int, bool]]:
        out = []
        for n, cost in enumerate(plans[i]):
            if (i + n) % 2:
                out.append((cost, bool(limiter.acquire("k", cost, timeout_ns=0))))
            else:
                out.append((cost, limiter.try_acquire("k", cost).allowed))
        return out

    with tiny_switch_interval():
        decided = [d for thread in run_together(len(plans), burst) for d in thread]
    spent = sum(cost for cost, ok in decided if ok)
    left = units_left(limiter, "k")
    assert spent + left == capacity, (
        f"a frozen-instant burst of {plans} (cost lists per thread) on capacity "
        f"{capacity}: admitted {spent} units and {left} remain — they must add up to {capacity}"
    )
    wrongly_denied = [cost for cost, ok in decided if not ok and cost <= left]
    assert not wrongly_denied, (
        f"costs {wrongly_denied} were denied although {left} units were still left "
        f"at the end of the burst {plans} (units only decrease at a frozen instant)"
    )


@pytest.mark.rule("fifo", "acquire-blocks", "statistics", "wait-through-clock")
@core
def test_stage2_waiters_are_admitted_in_fifo_order() -> None:
    clock, limiter = bucket_limiter(2, refill_per_s=1)
    assert limiter.try_acquire("k", 2).allowed
    admitted: list[int] = []
    costs = [2, 1, 1]

    def waiter(i: int) -> None:
        assert limiter.acquire("k", costs[i]) is True
        admitted.append(i)

    workers = [enqueue(limiter, "k", partial(waiter, i), f"waiter {i}") for i in range(3)]
    clock.advance(NS_PER_S)  # 1 unit: the head needs 2; the cost-1 waiters must not overtake
    stays(
        lambda: waiters_on(limiter, "k") == 3 and not admitted,
        "3 waiters and nobody admitted after 1 unit refilled (head costs 2, FIFO: no overtaking)",
    )
    for step, expected in enumerate(([0], [0, 1], [0, 1, 2])):
        clock.advance(NS_PER_S)
        eventually(
            reaches(admitted.__len__, len(expected)),
            f"{len(expected)} waiter(s) admitted after advancing {step + 2} s",
            tuple(workers),
        )
        assert admitted == expected, (
            f"waiters queued on one key in order 0, 1, 2 (costs {costs}) were "
            f"admitted as {admitted}; FIFO means {expected} at this point"
        )
    for w in workers:
        w.outcome("a FIFO waiter")
    assert limiter.statistics().waiters == 0


@pytest.mark.rule("no-overtaking")
@core
def test_stage2_try_acquire_does_not_overtake_a_waiter() -> None:
    clock, limiter = bucket_limiter(2, refill_per_s=1)
    assert limiter.try_acquire("k", 2).allowed
    head = enqueue(limiter, "k", lambda: limiter.acquire("k", 2), "waiter (cost 2)")
    clock.advance(NS_PER_S)  # 1 unit on hand, the waiter needs 2
    decision = limiter.try_acquire("k", 1)
    assert not decision.allowed, (
        "try_acquire('k', 1) was admitted while a waiter (cost 2) was queued on 'k': "
        "while a key has waiters, try_acquire on it must be denied (no overtaking)"
    )
    assert decision.retry_after_ns is not None and decision.retry_after_ns > 0, (
        f"a denied decision needs a positive retry_after_ns, got {decision}"
    )
    assert not limiter.peek("k", 1).allowed, "peek must agree with try_acquire"
    assert limiter.try_acquire("other").allowed, "a queue on 'k' must not block 'other'"
    clock.advance(NS_PER_S)
    assert head.outcome("the waiter, once 2 units refilled") is True
    after = limiter.peek("k", 1)
    assert after.retry_after_ns == NS_PER_S, (
        f"after the waiter took both units the bucket must be empty (retry 1 s), "
        f"got {after}: the denied try_acquire consumed something"
    )


@pytest.mark.rule("timeout-consumes-nothing")
@core
def test_stage2_timed_out_waiter_consumes_nothing_and_unblocks_the_queue() -> None:
    clock, limiter = bucket_limiter(2, refill_per_s=1)
    assert limiter.try_acquire("k", 2).allowed
    impatient = enqueue(
        limiter, "k", lambda: limiter.acquire("k", 2, timeout_ns=NS_PER_S), "impatient (cost 2)"
    )
    patient = enqueue(limiter, "k", lambda: limiter.acquire("k", 1), "patient (cost 1)")
    clock.advance(NS_PER_S)  # the impatient head times out; 1 unit is there for the next
    assert impatient.outcome("the waiter whose timeout passed") is False, (
        "acquire('k', 2, timeout_ns=1 s) needed 2 s and must return False"
    )
    assert patient.outcome("the waiter behind the one that timed out") is True, (
        "the waiter behind a timed-out one must be admitted with the unit on hand"
    )
    assert limiter.statistics().waiters == 0
    after = limiter.peek("k", 1)
    assert after.retry_after_ns == NS_PER_S, (
        f"after the patient waiter took the one unit, the next unit is 1 s away; got "
        f"{after}: the timed-out waiter must consume nothing"
    )


@pytest.mark.rule("timeout-consumes-nothing", "fifo")
@core
def test_stage2_a_waiter_timing_out_behind_the_head_leaves_the_head_in_place() -> None:
    clock, limiter = bucket_limiter(2, refill_per_s=1)
    assert limiter.try_acquire("k", 2).allowed
    head = enqueue(limiter, "k", lambda: limiter.acquire("k", 2), "head (cost 2)")
    middle = enqueue(
        limiter, "k", lambda: limiter.acquire("k", 1, timeout_ns=NS_PER_S), "middle (cost 1, 1 s)"
    )
    tail = enqueue(limiter, "k", lambda: limiter.acquire("k", 1), "tail (cost 1)")
    clock.advance(NS_PER_S)  # 1 unit: the head needs 2, and the middle one's time is up
    assert middle.outcome("the waiter behind the head whose timeout passed") is False, (
        "acquire('k', 1, timeout_ns=1 s) queued behind a head that needs 2 units must "
        "time out at 1 s and return False"
    )
    stays(
        lambda: waiters_on(limiter, "k") == 2 and head.is_alive() and tail.is_alive(),
        "the head (cost 2) and the tail still queued on 'k' after the middle waiter timed "
        "out: a caller that times out leaves the queue, and only itself",
    )
    clock.advance(NS_PER_S)  # 2 units: the head's
    assert head.outcome("the head, once its 2 units are there") is True
    check(tail.is_alive(), "the tail must wait for its unit after the head took both")
    clock.advance(NS_PER_S)
    assert tail.outcome("the tail, once its unit is there") is True
    assert limiter.statistics().waiters == 0


@pytest.mark.rule("no-deadlock", "timeout-consumes-nothing", "fifo")
@core
def test_stage2_a_head_that_times_out_wakes_the_waiter_behind_it() -> None:
    clock = SelfWakingClock()  # a timeout wakes its own thread only, as a real one does
    rest_on(clock)
    _, limiter = bucket_limiter(2, refill_per_s=1, stripes=1, clock=clock)
    assert limiter.try_acquire("b", 2).allowed and limiter.try_acquire("k", 2).allowed
    b_head = enqueue(limiter, "b", lambda: limiter.acquire("b", 2), "head on 'b' (cost 2)")
    b_next = enqueue(limiter, "b", lambda: limiter.acquire("b", 1), "next on 'b' (cost 1)")
    k_head = enqueue(
        limiter, "k", lambda: limiter.acquire("k", 2, timeout_ns=NS_PER_S), "head on 'k' (1 s)"
    )
    k_next = enqueue(limiter, "k", lambda: limiter.acquire("k", 1), "next on 'k' (cost 1)")
    clock.advance(NS_PER_S)  # k's head times out, by itself; k's 1 unit is k_next's
    assert k_head.outcome("the head on 'k' whose timeout passed") is False
    assert k_next.outcome(
        "the waiter behind a head that timed out, on a clock whose timeouts wake no one "
        "else: with four waiters on one stripe, the leaving head must wake every waiter "
        "there (one notify can go to a waiter of 'b', which sleeps again: a lost wake-up)"
    ), "the waiter on 'k' must be admitted with the unit on hand once the head left"
    clock.advance(NS_PER_S)
    assert b_head.outcome("the head on 'b' at 2 s") is True
    clock.advance(NS_PER_S)
    assert b_next.outcome("the next on 'b' at 3 s") is True


@pytest.mark.rule("acquire-blocks", "timeout-consumes-nothing", "wait-through-clock")
@core
def test_stage2_acquire_deadline_is_exact() -> None:
    clock, limiter = bucket_limiter(1, refill_per_s=1)
    assert limiter.try_acquire("k").allowed
    late = start(lambda: limiter.acquire("k", timeout_ns=NS_PER_S - 1), "timeout 1 s - 1 ns")
    eventually(lambda: waiters_on(limiter, "k") == 1, "one waiter", (late,))
    clock.advance(NS_PER_S - 1)
    assert late.outcome("a waiter whose deadline passed") is False, (
        "the unit comes back after exactly 1 s; a 1 s - 1 ns timeout must fail"
    )
    assert limiter.peek("k").retry_after_ns == 1, "the timed-out waiter consumed units"
    on_time = start(lambda: limiter.acquire("k", timeout_ns=1), "timeout 1 ns")
    eventually(lambda: waiters_on(limiter, "k") == 1, "one waiter", (on_time,))
    clock.advance(1)
    assert on_time.outcome("a waiter whose unit arrives at its deadline") is True, (
        "a request that fits exactly at now + timeout_ns must be admitted"
    )


@pytest.mark.rule("refund-reset-wake", "statistics")
@core
@pytest.mark.parametrize("wake", ["refund", "reset"])
def test_stage2_refund_and_reset_wake_waiters_sharing_a_stripe(wake: str) -> None:
    clock, limiter = bucket_limiter(2, refill_per_s=1, stripes=1)
    assert limiter.try_acquire("a", 2).allowed and limiter.try_acquire("b", 2).allowed
    other = enqueue(limiter, "b", lambda: limiter.acquire("b", 2), "waiter on 'b'")
    first = enqueue(limiter, "a", lambda: limiter.acquire("a", 1), "first waiter on 'a'")
    second = enqueue(limiter, "a", lambda: limiter.acquire("a", 1), "second waiter on 'a'")
    # No time passes: only the refund (2 units back) or the reset (a fresh, full key) can
    # let them in — and only if it wakes the waiters, which then look again.
    did = "refund('a', 2)" if wake == "refund" else "reset('a')"
    if wake == "refund":
        limiter.refund("a", 2)
    else:
        limiter.reset("a")
    for w in (first, second):
        assert w.outcome(f"a waiter on 'a' after {did}, time frozen — wake every waiter") is True
    assert limiter.statistics().waiters_by_key == {"b": 1}
    clock.advance(2 * NS_PER_S)
    assert other.outcome("the waiter on 'b' after 2 s") is True


@pytest.mark.rule("acquire-impossible", "acquire-blocks")
@core
def test_stage2_impossible_cost_and_zero_timeout_return_at_once() -> None:
    _, limiter = bucket_limiter(2, refill_per_s=1)
    never = start(lambda: limiter.acquire("k", 3), "acquire(cost > capacity)")
    assert never.outcome("acquire of a cost above capacity, which can never fit") is False
    assert units_left(limiter, "k") == 2, "an impossible cost must change nothing"
    assert limiter.try_acquire("k", 2).allowed
    zero = start(lambda: limiter.acquire("k", timeout_ns=0), "acquire(timeout_ns=0)")
    assert zero.outcome("acquire(timeout_ns=0) on an empty bucket") is False
    assert limiter.statistics().waiters == 0
    assert limiter.peek("k").retry_after_ns == NS_PER_S, "a failed acquire consumed"


@pytest.mark.rule("acquire-impossible")
@core
def test_stage2_an_impossible_cost_returns_at_once_even_behind_waiters() -> None:
    """A waiter is queued on the key: a cost above capacity does not join the queue to
    find out at its head — it can never fit, so it returns False at once."""
    clock, limiter = bucket_limiter(2, refill_per_s=1)
    assert limiter.try_acquire("k", 2).allowed
    head = enqueue(limiter, "k", lambda: limiter.acquire("k", 2), "waiter (cost 2)")
    never = start(lambda: limiter.acquire("k", 3), "acquire(cost 3) behind the waiter")
    assert never.outcome("acquire('k', 3) on a bucket of 2, with a waiter queued") is False
    check(
        limiter.statistics().waiters_by_key == {"k": 1},
        f"bucket of 2, emptied; a waiter (cost 2) queued on 'k'; acquire('k', 3) can never "
        f"fit: False at once, and nothing changes — only the first waiter is queued; got "
        f"{limiter.statistics()}",
    )
    clock.advance(2 * NS_PER_S)
    assert head.outcome("the waiter, once 2 units refilled") is True


@pytest.mark.rule("statistics")
@core
def test_stage2_statistics_count_callers_not_keys() -> None:
    clock, limiter = bucket_limiter(1, refill_per_s=1)
    assert limiter.try_acquire("a").allowed and limiter.try_acquire("b").allowed
    waiters = [
        enqueue(limiter, "a", lambda: limiter.acquire("a"), f"waiter {i} on 'a'") for i in (1, 2)
    ]
    waiters.append(enqueue(limiter, "b", lambda: limiter.acquire("b"), "waiter on 'b'"))
    got = limiter.statistics()
    check(
        (got.waiters, got.waiters_by_key) == (3, {"a": 2, "b": 1}),
        f"two callers blocked on 'a' and one on 'b': statistics() counts callers, in total "
        f"and per key — expected waiters 3, {{'a': 2, 'b': 1}}; got {got}",
    )
    clock.advance(NS_PER_S)  # a unit for the first waiter on each key
    assert waiters[0].outcome("the first waiter on 'a', a unit refilled") is True
    clock.advance(NS_PER_S)  # ... and one for the second on 'a'
    assert [w.outcome("a waiter, its unit refilled") for w in waiters] == [True] * 3


@pytest.mark.rule("striped-locks", "no-overtaking")
@core
@pytest.mark.parametrize("stripes", [3, 10, 64])
def test_stage2_every_method_finds_a_key_on_the_same_stripe(stripes: int) -> None:
    """Whatever the number of stripes (a power of two or not), try_acquire and peek look
    for a key's waiters on the stripe acquire queued them on: ``hash(key) % stripes``."""
    clock, limiter = bucket_limiter(2, refill_per_s=1, stripes=stripes)
    keys = [f"key-{i}" for i in range(24)]
    heads = []
    for key in keys:
        assert limiter.try_acquire(key, 2).allowed
        waiter = partial(limiter.acquire, key, 2)
        heads.append(enqueue(limiter, key, waiter, f"waiter (cost 2) on {key!r}"))
    clock.advance(NS_PER_S)  # 1 unit on hand on each key; its waiter needs 2
    overtook = [k for k in keys if limiter.peek(k, 1).allowed or limiter.try_acquire(k, 1).allowed]
    check(
        not overtook,
        f"stripes={stripes}: a waiter (cost 2) queued on each of 24 keys, then 1 unit "
        f"refilled on each: try_acquire and peek of 1 must be denied on every key (no "
        f"overtaking); admitted on {overtook[:5]} — a method that picks a key's stripe "
        f"otherwise than acquire does (hash(key) & (stripes - 1) is not hash(key) % "
        f"stripes) misses the key's queue",
    )
    clock.advance(NS_PER_S)
    assert all(h.outcome("a waiter, its 2 units refilled") is True for h in heads)


BAD_CALLS: dict[str, tuple[Callable[[object, ManualClock, BlockingLimiter], object], str]] = {
    "stripes0": (
        lambda inner, clock, lim: stage(2).ThreadSafeLimiter(inner, clock=clock, stripes=0),
        "stripes",
    ),
    "stripes2**63": (  # would allocate locks until the process dies
        lambda inner, clock, lim: stage(2).ThreadSafeLimiter(inner, clock=clock, stripes=2**63),
        "stripes",
    ),
    "stripesTrue": (
        lambda inner, clock, lim: stage(2).ThreadSafeLimiter(inner, clock=clock, stripes=True),
        "stripes",
    ),
    "stripes65537": (  # one past the bound: 65 536 is still allowed
        lambda inner, clock, lim: stage(2).ThreadSafeLimiter(inner, clock=clock, stripes=65537),
        "stripes",
    ),
    "cost0": (lambda inner, clock, lim: lim.try_acquire("k", 0), "cost"),
    "costTrue": (lambda inner, clock, lim: lim.try_acquire("k", True), "cost"),
    "costFloat": (lambda inner, clock, lim: lim.acquire("k", 1.5), "cost"),  # type: ignore[arg-type]
    "peekCost0": (lambda inner, clock, lim: lim.peek("k", 0), "cost"),
    "timeoutNegative": (lambda inner, clock, lim: lim.acquire("k", 1, timeout_ns=-1), "timeout_ns"),
    "refundNegative": (lambda inner, clock, lim: lim.refund("k", -1), "cost"),
}


@pytest.mark.rule("bad-arguments")
@core
@pytest.mark.parametrize("case", sorted(BAD_CALLS))
def test_stage2_bad_arguments_name_the_parameter(case: str) -> None:
    call, param = BAD_CALLS[case]
    clock = ManualClock()
    inner = stage(1).TokenBucket(capacity=2, refill_per_s=1, clock=clock, auto_sweep=False)
    limiter = stage(2).ThreadSafeLimiter(inner, clock=clock)
    assert limiter.try_acquire("k").allowed
    with pytest.raises((ValueError, TypeError), match=param):
        call(inner, clock, limiter)
    assert units_left(limiter, "k") == 1, "a rejected call must change nothing"
    assert limiter.statistics().waiters == 0


@pytest.mark.rule("bad-arguments")
@core
@pytest.mark.parametrize("stripes", [1, 65536])
def test_stage2_stripes_at_either_end_of_their_range_are_allowed(stripes: int) -> None:
    clock = ManualClock()
    inner = stage(1).TokenBucket(capacity=2, refill_per_s=1, clock=clock, auto_sweep=False)
    try:
        limiter = stage(2).ThreadSafeLimiter(inner, clock=clock, stripes=stripes)
    except (ValueError, TypeError) as exc:
        raise AssertionError(
            f"stripes may be anything in [1, 65536], both ends included: stripes={stripes} "
            f"raised {exc!r}"
        ) from None
    assert limiter.try_acquire("k").allowed and units_left(limiter, "k") == 1


#: Keys held busy (none refills on a frozen clock), and requests made on them after.
BUSY_KEYS, LATER_OPS = 4_000, 20_000


@pytest.mark.rule("sweeping")
@core
def test_stage2_the_automatic_sweep_is_amortised_over_the_operations() -> None:
    """4 000 busy keys (a frozen clock: none becomes idle, so every sweep walks them
    all), then 20 000 more requests: the keys the automatic sweeps walk must be paid for
    by operations — at most two walked per operation, counted from the first."""
    clock = ManualClock()
    inner = stage(1).TokenBucket(capacity=1, refill_per_s=1, clock=clock, auto_sweep=False)
    walked = [0]  # keys held by the inner limiter at each of its sweeps
    sweep: Callable[[], int] = inner.sweep

    def counted_sweep() -> int:
        walked[0] += inner.tracked_keys()
        return sweep()

    inner.sweep = counted_sweep
    limiter = stage(2).ThreadSafeLimiter(inner, clock=clock, stripes=4)
    ops = 0
    for ops in range(1, BUSY_KEYS + LATER_OPS + 1):
        limiter.try_acquire(f"k{ops % BUSY_KEYS}")  # the first round admits, then denials
        if walked[0] > 2 * ops:
            break
    assert walked[0] <= 2 * ops, (
        f"by operation {ops} ({BUSY_KEYS} keys held, none idle) the automatic sweeps had "
        f"walked {walked[0]} keys: more than two per operation. Sweep every so many "
        f"operations — at least as many as there were keys left at the last sweep — so "
        f"that sweeping stays amortised O(1) per operation"
    )


@pytest.mark.rule("sweeping", "tracked-keys-inner")
@core
def test_stage2_sweep_forgets_idle_keys_and_runs_by_itself() -> None:
    clock, limiter = bucket_limiter(1, refill_per_s=1, stripes=4)
    for i in range(100):
        assert limiter.try_acquire(f"k{i}").allowed
    assert limiter.tracked_keys() == 100
    clock.advance(NS_PER_S)  # every key is full again: idle
    assert limiter.sweep() == 100, "sweep() must forget the 100 idle keys"
    assert limiter.tracked_keys() == 0
    # Nobody calls sweep() now: the wrapper must sweep by itself (the inner cannot).
    for i in range(20_000):
        limiter.try_acquire(f"n{i}")
        clock.advance(NS_PER_S // 10)  # a key is idle again 1 s after its request
    assert limiter.tracked_keys() <= 10
    forgotten = limiter.sweep()
    assert forgotten <= 10_000, (
        f"after 20 000 requests on distinct keys, each idle 1 s later, sweep() still "
        f"found {forgotten} idle keys to forget: memory grows with every key ever seen. The "
        "inner limiter never sweeps (auto_sweep=False), so the wrapper must, amortised"
    )


@pytest.mark.rule("sweeping")
@core
def test_stage2_the_wrapper_sweeps_by_itself_when_only_acquire_is_called() -> None:
    """Every operation counts towards the automatic sweep: a workload of ``acquire``
    calls alone (here with ``timeout_ns=0``) keeps memory bounded too."""
    clock, limiter = bucket_limiter(1, refill_per_s=1, stripes=4)
    for i in range(20_000):
        assert limiter.acquire(f"n{i}", timeout_ns=0)
        clock.advance(NS_PER_S // 10)  # a key is idle again 1 s after its request
    forgotten = limiter.sweep()
    check(
        forgotten <= 10_000,
        f"20 000 acquire(timeout_ns=0) calls on distinct keys, each idle 1 s later, and "
        f"nothing else: sweep() then found {forgotten} idle keys to forget. The inner "
        f"limiter never sweeps (auto_sweep=False): the wrapper sweeps by itself every so "
        f"many operations, acquire's included",
    )


@pytest.mark.rule("no-deadlock", "atomic-decision")
@core
def test_stage2_mixed_operations_neither_deadlock_nor_over_admit() -> None:
    capacity, per_s = 4, 1000
    clock, limiter = bucket_limiter(capacity, refill_per_s=per_s, stripes=2)
    keys = ["a", "b", "c"]
    began = clock.now_ns()

    def work(seed: int) -> tuple[Counter[str], Counter[str]]:
        rng = random.Random(seed)
        spent: Counter[str] = Counter()
        refunded: Counter[str] = Counter()
        for _ in range(250):
            key, cost, op = rng.choice(keys), rng.randint(1, 3), rng.random()
            if op < 0.35:
                if limiter.try_acquire(key, cost).allowed:
                    spent[key] += cost
            elif op < 0.7:
                if limiter.acquire(key, cost, timeout_ns=rng.choice([0, NS_PER_MS, 4 * NS_PER_MS])):
                    spent[key] += cost
            elif op < 0.8:
                limiter.refund(key, 1)
                refunded[key] += 1
            elif op < 0.9:
                limiter.sweep()
            else:
                limiter.statistics()
                limiter.tracked_keys()
        return spent, refunded

    with tiny_switch_interval():
        workers = [start(partial(work, i), f"mixed worker {i}") for i in range(4)]
        deadline = time.monotonic() + 4 * DEADLINE_S
        while any(w.is_alive() for w in workers) and time.monotonic() < deadline:
            clock.advance(NS_PER_MS // 4)
            time.sleep(0)
        results = [w.outcome("mixed operations with clock advancing") for w in workers]
    elapsed = clock.now_ns() - began
    for key in keys:
        spent = sum(r[0][key] for r in results)
        refunded = sum(r[1][key] for r in results)
        bound = capacity + elapsed * per_s // NS_PER_S + refunded
        assert spent <= bound, (
            f"key {key!r} admitted {spent} units in {elapsed} ns of mixed traffic; "
            f"capacity {capacity} + refill {per_s}/s + {refunded} refunded allow at most {bound}"
        )
    assert limiter.statistics().waiters == 0


PATHS: dict[str, Callable[[BlockingLimiter], object]] = {
    "try_acquire('k')": lambda lim: lim.try_acquire("k"),
    "peek('k')": lambda lim: lim.peek("k"),
    "acquire('k', timeout_ns=0)": lambda lim: lim.acquire("k", timeout_ns=0),
    "refund('k', 1)": lambda lim: lim.refund("k", 1),
}


@core
@pytest.mark.rule("atomic-decision", "striped-locks")
def test_stage2_every_call_holds_the_stripe_lock_around_the_inner_limiter() -> None:
    # One thread is parked inside the inner limiter (by the wrapper's try_acquire, peek,
    # acquire or refund on 'k'); a second thread's try_acquire('k') must wait outside:
    # the stripe lock is held from the check to the act, on every path.
    for what, first in PATHS.items():
        gate = Gate(f"inside the inner limiter, called by {what}")
        _, limiter = parked_limiter(gate, ("try_acquire", "peek", "refund"), holding=("k",))
        a = start(partial(first, limiter), f"A: {what}")
        gate.wait_arrived(1)
        b = start(partial(limiter.try_acquire, "k"), "B: try_acquire('k')")
        try:
            stays(
                partial(lambda g: g.arrivals == 1, gate),
                f"thread B outside the inner limiter while thread A, in {what}, is inside it "
                "(the inner call must run under the key's stripe lock, or B reads state A is "
                "about to change)",
            )
        finally:
            gate.open()
        a.outcome(f"A, {what}, once released")
        b.outcome("B, once A left the stripe")


@core
@pytest.mark.rule("striped-locks")
def test_stage2_a_busy_key_does_not_hold_up_other_stripes() -> None:
    gate = Gate("inside the inner try_acquire of key 'busy'", limit=1)
    _, limiter = parked_limiter(gate, ("try_acquire",))
    busy = start(lambda: limiter.try_acquire("busy"), "a thread inside try_acquire('busy')")
    gate.wait_arrived(1)
    done: list[str] = []

    def other(key: str) -> None:
        if limiter.try_acquire(key).allowed:
            done.append(key)

    others = [start(partial(other, f"other-{i}"), f"other-{i}") for i in range(8)]
    try:
        eventually(
            lambda: bool(done),
            "a try_acquire on some other key to finish while 'busy' is held inside its stripe "
            "(8 other keys, 64 stripes: one global lock would hold up every one of them)",
        )
    finally:
        gate.open()
    busy.outcome("the thread on 'busy', once released")
    for w in others:
        w.outcome("a thread on another key")


@core
@pytest.mark.rule("fifo", "no-overtaking")
def test_stage2_a_newcomer_acquire_joins_the_back_of_the_queue() -> None:
    clock, limiter = bucket_limiter(2, refill_per_s=1)
    assert limiter.try_acquire("k", 2).allowed
    head = enqueue(limiter, "k", lambda: limiter.acquire("k", 2), "head waiter (cost 2)")
    clock.advance(NS_PER_S)  # 1 unit on hand: the head needs 2, a newcomer 1
    got = limiter.acquire("k", 1, timeout_ns=0)
    assert got is False, (
        "acquire('k', 1, timeout_ns=0) returned True while a waiter (cost 2) was "
        "queued on 'k' with 1 unit on hand: a newcomer joins the back of the queue, so with "
        "timeout_ns=0 it gives up at once — the unit belongs to the head"
    )
    late = enqueue(limiter, "k", lambda: limiter.acquire("k", 1), "newcomer (cost 1)")
    stays(
        lambda: waiters_on(limiter, "k") == 2 and late.is_alive(),
        "the newcomer (cost 1) queued behind the head, not admitted with the unit on hand",
    )
    clock.advance(NS_PER_S)  # 2 units: the head's
    assert head.outcome("the head, once 2 units refilled") is True
    stays(lambda: late.is_alive(), "the newcomer still waiting: the head took both units")
    clock.advance(NS_PER_S)
    assert late.outcome("the newcomer, 1 s after the head") is True
    assert limiter.peek("k").retry_after_ns == NS_PER_S, "the newcomer took 1 unit"


@core
@pytest.mark.rule("no-overtaking")
def test_stage2_a_denial_while_the_head_has_not_yet_taken_its_units() -> None:
    clock = LateWakeClock()
    _, limiter = bucket_limiter(2, refill_per_s=1, clock=clock)
    assert limiter.try_acquire("k", 2).allowed
    head = enqueue(limiter, "k", lambda: limiter.acquire("k", 2), "head waiter (cost 2)")
    eventually(lambda: clock.sleepers() == 1, "the head waiter asleep on the clock", (head,))
    # Both units are back at 2 s, but the head has not run yet to take them: the
    # scheduler has not woken it (the clock wakes it only when the test says).
    clock.advance_unheard(2 * NS_PER_S)
    steps = (
        "capacity 2, 1 unit/s; at 0 both units taken and a waiter queued for 2; at 2 s both "
        "units are back but the waiter has not run yet to take them"
    )
    for name, decide in (("try_acquire", limiter.try_acquire), ("peek", limiter.peek)):
        denied = decide("k", 1)
        check(
            not denied.allowed
            and denied.retry_after_ns is not None
            and denied.retry_after_ns > 0
            and (denied.remaining, denied.reset_after_ns) == (0, NS_PER_S),
            f"{steps}; then {name}('k', 1) must be denied — the units on hand are the "
            "queue's — with a positive retry_after_ns (a denial that says 'retry in 0 ns' "
            "sends the client straight back), remaining 0 (nothing is left for a newcomer) "
            "and the reset_after_ns the inner bucket's peek('k', 1) gives (1 s); got "
            f"{denied}",
        )
    never = limiter.try_acquire("k", 3)
    expect(never.retry_after_ns, None, f"{steps}; 3 units never fit in 2, queue or not")
    clock.wake()
    assert head.outcome("the head waiter, once woken") is True
    expect(limiter.peek("k").retry_after_ns, NS_PER_S, "the denials consumed nothing")


@core
@pytest.mark.rule("acquire-blocks", "fifo", "timeout-consumes-nothing")
def test_stage2_a_timeout_counts_from_the_call_not_from_reaching_the_head() -> None:
    clock, limiter = bucket_limiter(1, refill_per_s=Fraction(1, 3))
    assert limiter.try_acquire("k").allowed
    first = enqueue(limiter, "k", lambda: limiter.acquire("k"), "A (no timeout)")
    second = enqueue(
        limiter, "k", lambda: limiter.acquire("k", timeout_ns=5 * NS_PER_S), "B (timeout 5 s)"
    )
    eventually(lambda: clock.sleepers() == 2, "A and B asleep on the clock", (first, second))
    clock.advance(3 * NS_PER_S)
    assert first.outcome("A, at the head, once its unit is back at 3 s") is True
    clock.advance(2 * NS_PER_S - 1)
    stays(second.is_alive, "B still waiting at 5 s - 1 ns, within its timeout")
    clock.advance(1)
    assert second.outcome("B, whose timeout of 5 s ran out at 5 s") is False, (
        "1 unit per 3 s, emptied at 0; A queued (no timeout), then B with timeout_ns=5 s; A "
        "was admitted at 3 s and B became the head. B's unit comes at 6 s, after its timeout "
        "— counted from B's call, not from when B reached the head — so at 5 s B returns False"
    )
    expect(limiter.peek("k").retry_after_ns, NS_PER_S, "B consumed nothing: the unit is 1 s away")


@core
@pytest.mark.rule("sweeping", "tracked-keys-inner", "striped-locks", "atomic-decision")
@pytest.mark.parametrize(
    "sweeper",
    ["sweep()", "tracked_keys()", "by itself"],
    ids=["sweep", "tracked_keys", "automatic"],
)
def test_stage2_a_sweep_holds_every_stripe_while_it_walks_the_keys(sweeper: str) -> None:
    # Thread A's sweep is parked inside the inner limiter's sweep (or tracked_keys): it
    # walks every key, so it must hold every stripe, and thread B's try_acquire('k')
    # waits outside. "by itself": A makes requests on new keys until the wrapper sweeps.
    inner_call = "tracked_keys" if sweeper == "tracked_keys()" else "sweep"
    gate = Gate(f"inside the inner limiter's {inner_call}()", limit=1)
    _, spy, limiter = spied_limiter(gate, (inner_call,))

    def sweep() -> None:
        if sweeper == "sweep()":
            limiter.sweep()
        elif sweeper == "tracked_keys()":
            limiter.tracked_keys()
        else:
            for i in range(20_000):
                if gate.arrivals:
                    return
                limiter.try_acquire(f"user-{i}")

    a = start(sweep, f"A: {sweeper}")
    gate.wait_arrived(1)
    b = start(partial(limiter.try_acquire, "k"), "B: try_acquire('k')")
    try:
        stays(
            lambda: not spy.overlaps,
            f"thread B's try_acquire('k') outside the inner limiter while thread A's "
            f"{sweeper} is inside its {inner_call}() (a sweep walks every key, so it must hold "
            "every stripe — else it forgets a key another thread is deciding on, or the dict "
            "changes under its walk)",
        )
    finally:
        gate.open()
    a.outcome(f"A: {sweeper}, once released")
    b.outcome("B, once the sweep let go of the stripes")


KEYS = st.sampled_from(["a", "b", "c"])


class ThreadSafeLimiterMachine(RuleBasedStateMachine):
    """Single-threaded, the wrapper decides exactly like stage 1's exact token bucket."""

    @initialize(
        capacity=st.integers(1, 6),
        rate=st.sampled_from([Fraction(1), Fraction(3), Fraction(1, 3), Fraction(5, 2)]),
        stripes=st.integers(1, 3),
    )
    def build(self, capacity: int, rate: Fraction, stripes: int) -> None:
        self.clock = ManualClock()
        inner = stage(1).TokenBucket(
            capacity=capacity, refill_per_s=rate, clock=self.clock, auto_sweep=False
        )
        self.limiter: BlockingLimiter = stage(2).ThreadSafeLimiter(
            inner, clock=self.clock, stripes=stripes
        )
        self.model = TokenBucketModel(capacity, rate)

    def check(self, what: str, got: object, expected: object) -> None:
        expect(got, expected, f"{what} at t={self.clock.now_ns()}:")

    @rule(key=KEYS, cost=st.integers(1, 7))
    def try_acquire(self, key: str, cost: int) -> None:
        expected = self.model.decide(key, cost, self.clock.now_ns(), commit=True)
        self.check(f"try_acquire({key!r}, {cost})", self.limiter.try_acquire(key, cost), expected)

    @rule(key=KEYS, cost=st.integers(1, 7))
    def peek(self, key: str, cost: int) -> None:
        expected = self.model.decide(key, cost, self.clock.now_ns(), commit=False)
        self.check(f"peek({key!r}, {cost})", self.limiter.peek(key, cost), expected)

    @rule(key=KEYS, cost=st.integers(1, 7), wait_forever=st.booleans())
    def acquire_without_waiting(self, key: str, cost: int, wait_forever: bool) -> None:
        now = self.clock.now_ns()
        fits = self.model.decide(key, cost, now, commit=False).allowed
        if wait_forever and not fits:
            return  # would block this (only) thread for good
        self.model.decide(key, cost, now, commit=True)
        timeout = None if wait_forever else 0
        got = self.limiter.acquire(key, cost, timeout_ns=timeout)
        self.check(f"acquire({key!r}, {cost}, timeout_ns={timeout})", got, fits)

    @rule(key=KEYS, cost=st.integers(1, 7))
    def refund(self, key: str, cost: int) -> None:
        self.limiter.refund(key, cost)
        self.model.refund(key, cost, self.clock.now_ns())

    @rule(key=KEYS)
    def reset(self, key: str) -> None:
        self.limiter.reset(key)
        self.model.reset(key)

    @rule(ns=st.sampled_from([1, NS_PER_MS, 333_333_333, NS_PER_S, 7 * NS_PER_S]))
    def advance(self, ns: int) -> None:
        self.clock.advance(ns)

    @rule()
    def sweep(self) -> None:
        self.limiter.sweep()
        expected = self.model.tracked(self.clock.now_ns())
        self.check("tracked_keys() after sweep()", self.limiter.tracked_keys(), expected)

    @invariant()
    def nobody_waits(self) -> None:
        if hasattr(self, "limiter"):
            self.check("statistics().waiters", self.limiter.statistics().waiters, 0)


TestStage2ThreadSafeLimiterModel = pytest.mark.core(
    pytest.mark.rule("same-decisions", "sweeping", "statistics")(ThreadSafeLimiterMachine.TestCase)
)


# --- AsyncLimiter (extended) ----------------------------------------------------------


@pytest.mark.rule("async-exact")
@extended
@anyio_test
async def test_stage2_async_burst_admits_exactly_capacity() -> None:
    clock, limiter = async_limiter(10, refill_per_s=10)
    got: list[bool] = []

    async def one(i: int) -> None:
        if i % 3 == 0:
            await anyio.lowlevel.checkpoint()
            got.append(limiter.try_acquire("k").allowed)
        elif i % 3 == 1:
            got.append(await limiter.acquire("k", timeout_ns=0))
        else:
            got.append(await limiter.acquire("k"))  # may wait

    async with anyio.create_task_group() as tg:
        for i in range(45):
            tg.start_soon(one, i)
        await eventually_async(
            lambda: len(got) + limiter.statistics().waiters == 45,
            "every task decided or queued",
        )
        assert got.count(True) == 10, (
            f"45 tasks at one frozen instant on capacity 10 got {got.count(True)} "
            "admitted; exactly 10 must be"
        )
        for step in range(1, 3):
            waiting, before = limiter.statistics().waiters, got.count(True)
            clock.advance(NS_PER_S)  # 10 more units
            expected = before + min(10, waiting)
            await eventually_async(
                reaches(partial(got.count, True), expected), f"{expected} admitted after {step} s"
            )
            await stays_async(
                stays_at(partial(got.count, True), expected),
                f"exactly {expected} admitted after {step} s (10 units/s)",
            )
    assert limiter.statistics().waiters == 0


@pytest.mark.rule("async-fifo")
@extended
@anyio_test
async def test_stage2_async_waiters_are_admitted_in_fifo_order() -> None:
    clock, limiter = emptied_async_limiter()
    admitted: list[int] = []
    costs = [2, 1, 1]

    async def waiter(i: int) -> None:
        assert await limiter.acquire("k", costs[i]) is True
        admitted.append(i)

    async with anyio.create_task_group() as tg:
        for i in range(3):
            await enqueue_async(tg, limiter, "k", partial(waiter, i))
        clock.advance(NS_PER_S)
        await stays_async(
            lambda: waiters_on(limiter, "k") == 3 and not admitted,
            "3 waiting tasks, none admitted after 1 unit refilled (head costs 2: no overtaking)",
        )
        for step, expected in enumerate(([0], [0, 1], [0, 1, 2])):
            clock.advance(NS_PER_S)
            await eventually_async(
                reaches(admitted.__len__, len(expected)),
                f"{len(expected)} task(s) admitted after {step + 2} s",
            )
            assert admitted == expected, (
                f"tasks queued in order 0, 1, 2 (costs {costs}) were admitted as "
                f"{admitted}; FIFO means {expected}"
            )


@pytest.mark.rule("async-cancel")
@extended
@anyio_test
async def test_stage2_async_cancelled_waiter_consumes_nothing_and_unblocks_the_queue() -> None:
    clock, limiter = emptied_async_limiter()
    scope = anyio.CancelScope()
    outcome: list[str] = []

    async def cancelled() -> None:
        with scope:
            await limiter.acquire("k", 2)
            outcome.append("cancelled one admitted")

    async def behind() -> None:
        outcome.append(f"behind: {await limiter.acquire('k', 1)}")

    async with anyio.create_task_group() as tg:
        await enqueue_async(tg, limiter, "k", cancelled)
        await enqueue_async(tg, limiter, "k", behind)
        scope.cancel()
        await eventually_async(
            lambda: limiter.statistics().waiters_by_key == {"k": 1},
            "the cancelled task to leave the queue (statistics shows 1 waiter)",
        )
        clock.advance(NS_PER_S)
        await eventually_async(lambda: bool(outcome), "the task behind to be admitted")
    assert outcome == ["behind: True"], (
        f"after cancelling the head (cost 2) and 1 s, the task behind (cost 1) must be "
        f"admitted and nothing else; got {outcome}"
    )
    denied = limiter.try_acquire("k")
    assert denied.retry_after_ns == NS_PER_S, (
        f"the only unit went to the task behind; got {denied}: the cancelled waiter "
        "must consume nothing"
    )


@pytest.mark.rule("async-cancel")
@extended
@anyio_test
async def test_stage2_async_timed_out_waiter_consumes_nothing() -> None:
    clock, limiter = emptied_async_limiter()
    results: dict[str, bool] = {}

    async def impatient() -> None:
        results["impatient"] = await limiter.acquire("k", 2, timeout_ns=NS_PER_S)

    async def patient() -> None:
        results["patient"] = await limiter.acquire("k", 1)

    async with anyio.create_task_group() as tg:
        await enqueue_async(tg, limiter, "k", impatient)
        await enqueue_async(tg, limiter, "k", patient)
        clock.advance(NS_PER_S)
        await eventually_async(lambda: len(results) == 2, "both waiters to finish")
    assert results == {"impatient": False, "patient": True}, (
        f"the head timed out after 1 s (needed 2), the one behind fits the unit on "
        f"hand; got {results}"
    )
    assert limiter.try_acquire("k").retry_after_ns == NS_PER_S, "the timeout consumed"


@pytest.mark.rule("async-fifo")
@extended
@anyio_test
async def test_stage2_async_try_acquire_does_not_overtake_a_waiter() -> None:
    clock, limiter = emptied_async_limiter()
    done: list[bool] = []
    async with anyio.create_task_group() as tg:
        await enqueue_async(tg, limiter, "k", partial(acquire_into, done, limiter, "k", 2))
        clock.advance(NS_PER_S)
        assert not limiter.try_acquire("k", 1).allowed, (
            "try_acquire('k', 1) overtook a task waiting on 'k' for 2 units"
        )
        assert limiter.try_acquire("other").allowed
        clock.advance(NS_PER_S)
        await eventually_async(lambda: done == [True], "the waiting task to be admitted")


@pytest.mark.rule("async-limit")
@extended
@anyio_test
async def test_stage2_async_limit_spends_units_on_entry() -> None:
    clock, limiter = async_limiter(1, refill_per_s=1)
    entered: list[str] = []

    async def second() -> None:
        async with limiter.limit("k"):
            entered.append("second")

    with pytest.raises(KeyError):
        async with limiter.limit("k"):
            entered.append("first")
            assert not limiter.try_acquire("k").allowed, "limit() must spend on entry"
            raise KeyError("the body fails")
    assert not limiter.try_acquire("k").allowed, "leaving limit() gives nothing back"
    async with anyio.create_task_group() as tg:
        await enqueue_async(tg, limiter, "k", second)
        assert entered == ["first"]
        clock.advance(NS_PER_S)
        await eventually_async(lambda: entered == ["first", "second"], "the second entry")
    with pytest.raises(ValueError, match="cost"):
        async with limiter.limit("k", 2):  # capacity 1: can never be admitted
            entered.append("impossible")
    assert entered == ["first", "second"], "limit() ran its body unadmitted"


@pytest.mark.rule("async-refund-wakes")
@extended
@anyio_test
async def test_stage2_async_refund_admits_the_head_waiter() -> None:
    _, limiter = emptied_async_limiter()
    done: list[bool] = []
    async with anyio.create_task_group() as tg:
        await enqueue_async(tg, limiter, "k", partial(acquire_into, done, limiter, "k", 2))
        limiter.refund("k", 2)
        await eventually_async(lambda: done == [True], "the waiter admitted by the refund")


@pytest.mark.rule("async-bad-arguments")
@extended
@anyio_test
async def test_stage2_async_bad_arguments_name_the_parameter() -> None:
    _, limiter = async_limiter(2)
    with pytest.raises((ValueError, TypeError), match="cost"):
        await limiter.acquire("k", 0)
    with pytest.raises((ValueError, TypeError), match="cost"):
        limiter.try_acquire("k", True)
    with pytest.raises((ValueError, TypeError), match="timeout_ns"):
        await limiter.acquire("k", 1, timeout_ns=-5)
    assert limiter.try_acquire("k", 2).allowed, "rejected calls must change nothing"


@extended
@pytest.mark.rule("async-fifo")
@anyio_test
async def test_stage2_async_newcomer_acquire_joins_the_back_of_the_queue() -> None:
    clock, limiter = emptied_async_limiter()
    done: list[str] = []

    async def head() -> None:
        done.append(f"head {await limiter.acquire('k', 2)}")

    async def newcomer() -> None:
        done.append(f"newcomer {await limiter.acquire('k', 1)}")

    async with anyio.create_task_group() as tg:
        await enqueue_async(tg, limiter, "k", head)
        clock.advance(NS_PER_S)  # 1 unit on hand: the head needs 2
        now = await limiter.acquire("k", 1, timeout_ns=0)
        assert now is False, (
            "acquire('k', 1, timeout_ns=0) returned True while a task waited on 'k' "
            "for 2 units with 1 on hand: a newcomer joins the back of the queue"
        )
        await enqueue_async(tg, limiter, "k", newcomer)
        await stays_async(lambda: not done, "nobody admitted with 1 unit (the head needs 2)")
        clock.advance(NS_PER_S)
        await eventually_async(lambda: done == ["head True"], "the head admitted at 2 s")
        await stays_async(lambda: done == ["head True"], "the newcomer still waiting")
        clock.advance(NS_PER_S)
        await eventually_async(lambda: len(done) == 2, "the newcomer admitted at 3 s")
    assert done == ["head True", "newcomer True"], done


@extended
@pytest.mark.rule("async-cancel")
@anyio_test
async def test_stage2_async_acquire_in_a_cancelled_scope_consumes_nothing() -> None:
    _, limiter = async_limiter(2, refill_per_s=1)
    reached = []
    with anyio.CancelScope() as scope:
        scope.cancel()
        await limiter.acquire("k", 1)  # the units are on hand, but the caller is cancelled
        reached.append("after acquire")
    assert not reached, (
        "acquire() in a scope already cancelled must raise the cancellation (it is a "
        "cancellation point), not return"
    )
    assert limiter.try_acquire("k", 2).allowed, (
        "an acquire in an already-cancelled scope consumed units: check for "
        "cancellation before taking anything"
    )
    with anyio.CancelScope() as scope:
        scope.cancel()
        await limiter.acquire("k", 1)  # now it would have to wait
    assert limiter.statistics().waiters == 0, "the cancelled caller left no waiter"


@extended
@pytest.mark.rule("async-cancel")
@anyio_test
async def test_stage2_async_a_cancellation_as_the_units_are_taken_loses_nothing() -> None:
    """The caller's scope is cancelled in the instant its units are taken (from inside
    the inner limiter's ``try_acquire``): either ``acquire`` returns True and the units
    are spent, or it raises the cancellation and nothing was consumed — never both."""
    clock = ManualClock()
    inner = stage(1).TokenBucket(capacity=2, refill_per_s=1, clock=clock)
    limiter = stage(2).AsyncLimiter(inner, clock=clock)
    scope = anyio.CancelScope()
    take = inner.try_acquire

    def taken_then_cancelled(key: str, cost: int = 1) -> Any:
        decision = take(key, cost)
        scope.cancel()  # the caller's scope, cancelled as the units are taken
        return decision

    inner.try_acquire = taken_then_cancelled
    got: list[bool] = []
    with scope:
        got.append(await limiter.acquire("k", 1))
    inner.try_acquire = take
    left = units_left(inner, "k")
    check(
        (got, left) in (([True], 1), ([], 2)),
        f"bucket of 2; acquire('k', 1) whose scope is cancelled as its unit is taken: "
        f"either it returns True (1 unit left) or it raises the cancellation (2 left: it "
        f"consumed nothing); got {'True' if got else 'the cancellation'} with {left} left "
        f"— a cancellation point after the units were taken loses them",
    )


@extended
@pytest.mark.rule("async-fifo")
@anyio_test
async def test_stage2_async_denial_while_the_head_has_not_yet_taken_its_units() -> None:
    clock = LateWakeClock()
    _, limiter = emptied_async_limiter(clock)
    done: list[bool] = []
    async with anyio.create_task_group() as tg:
        await enqueue_async(tg, limiter, "k", partial(acquire_into, done, limiter, "k", 2))
        await eventually_async(lambda: clock.sleepers() == 1, "the head task asleep on the clock")
        clock.advance_unheard(2 * NS_PER_S)  # the units are back; the head has not run yet
        denied = limiter.try_acquire("k", 1)
        check(
            not denied.allowed
            and denied.retry_after_ns is not None
            and denied.retry_after_ns > 0
            and (denied.remaining, denied.reset_after_ns) == (0, NS_PER_S),
            "capacity 2, 1 unit/s; at 0 both units taken and a task queued for 2; at 2 s both "
            "are back but the task has not run yet: try_acquire('k', 1) must be denied with a "
            "positive retry_after_ns, remaining 0 and the reset_after_ns the inner bucket's "
            f"peek('k', 1) gives (1 s), as in the threaded wrapper; got {denied}",
        )
        clock.wake()
        await eventually_async(lambda: done == [True], "the head task admitted once woken")
    expect(limiter.try_acquire("k").retry_after_ns, NS_PER_S, "the denial consumed nothing")


@extended
@pytest.mark.rule("async-cancel", "async-fifo")
@anyio_test
async def test_stage2_async_timeout_counts_from_the_call_not_from_reaching_the_head() -> None:
    clock, limiter = async_limiter(1, refill_per_s=Fraction(1, 3))
    assert limiter.try_acquire("k").allowed
    done: dict[str, bool] = {}

    async def waiter(name: str, timeout_ns: int | None) -> None:
        done[name] = await limiter.acquire("k", timeout_ns=timeout_ns)

    async with anyio.create_task_group() as tg:
        await enqueue_async(tg, limiter, "k", partial(waiter, "A", None))
        await enqueue_async(tg, limiter, "k", partial(waiter, "B", 5 * NS_PER_S))
        await eventually_async(lambda: clock.sleepers() == 2, "A and B asleep on the clock")
        clock.advance(3 * NS_PER_S)
        await eventually_async(lambda: done == {"A": True}, "A admitted at 3 s")
        clock.advance(2 * NS_PER_S - 1)
        await stays_async(lambda: "B" not in done, "B still waiting at 5 s - 1 ns")
        clock.advance(1)
        await eventually_async(lambda: "B" in done, "B to give up at 5 s")
    expect(
        done,
        {"A": True, "B": False},
        "1 unit per 3 s, emptied at 0; task A queued (no timeout), then B with timeout_ns=5 s; "
        "A admitted at 3 s; B's unit comes at 6 s, after its timeout — counted from B's call, "
        "not from when B reached the head — so at 5 s B returns False",
    )
    expect(limiter.try_acquire("k").retry_after_ns, NS_PER_S, "B consumed nothing")
