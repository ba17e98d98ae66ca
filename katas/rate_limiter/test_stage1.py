"""Stage 1 suite: exact single-threaded rate limiters (see katas/rate_limiter/README.md).

Core: TokenBucket and SlidingLog. Extended: GCRA, FixedWindow, SlidingWindowCounter,
MultiLimiter and retry_after_header. Run ``pytest katas/rate_limiter -k "stage1 and core"``.

The exact models (:mod:`katas.rate_limiter._testing.models`) are written from the
definitions, slowly and obviously (Fractions, whole lists, searches), and never look at an
implementation: a differential test (:mod:`katas.rate_limiter._testing.limiters` drives
it) runs the same operations on the implementation and on its model and compares whole
Decisions step by step — that catches over-denial too, which an envelope cannot.
"""

from __future__ import annotations

import itertools
from fractions import Fraction
from types import ModuleType
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from katas._harness.marks import core, extended, rule
from katas._harness.story import check, expect, not_refused
from katas.rate_limiter._testing.limiters import (
    DECISION_RULES,
    S_,
    START_NS,
    Algo,
    D,
    Setup,
    StepsBackAfterPeek,
    by_algo,
    needs,
    state_of,
)
from katas.rate_limiter.api import (
    NS_PER_S,
    ManualClock,
    MultiDecision,
    MultiRateLimiter,
    RateLimiter,
    SweepableLimiter,
)

pytestmark = [pytest.mark.stage(1)]


# --------------------------------------------------------------------------------------
# Examples that read like the prompt — core: token bucket
# --------------------------------------------------------------------------------------


@rule(*DECISION_RULES, "exact-retry", "reset-after", "keys-isolated", "tracked-keys")
@core
def test_stage1_token_bucket_example_from_the_prompt(stage_module: ModuleType) -> None:
    clock = ManualClock(START_NS)
    bucket: SweepableLimiter = stage_module.TokenBucket(capacity=3, refill_per_s=1, clock=clock)
    expect(bucket.try_acquire("alice"), D(True, 3, 2, 0, 1 * S_), "a new key starts full")
    expect(bucket.try_acquire("alice"), D(True, 3, 1, 0, 2 * S_), "second unit of a burst")
    expect(bucket.try_acquire("alice"), D(True, 3, 0, 0, 3 * S_), "third unit empties it")
    expect(
        bucket.try_acquire("alice"),
        D(False, 3, 0, 1 * S_, 3 * S_),
        "an empty bucket denies; one unit refills in exactly 1 s",
    )
    expect(bucket.try_acquire("bob"), D(True, 3, 2, 0, 1 * S_), "bob has his own bucket")
    expect(
        bucket.try_acquire("alice", 4),
        D(False, 3, 0, None, 3 * S_),
        "4 units never fit in a bucket of 3: retry_after_ns None, nothing changes",
    )
    clock.advance(S_ - 1)
    expect(
        bucket.peek("alice"),
        D(False, 3, 0, 1, 2 * S_ + 1),
        "1 ns before retry_after the request is still denied (retry_after is exact)",
    )
    clock.advance(1)
    expect(bucket.try_acquire("alice"), D(True, 3, 0, 0, 3 * S_), "admitted at retry_after")
    expect(bucket.tracked_keys(), 1, "bob's unit is back after 1 s: only alice is tracked")
    clock.advance(3 * S_)
    expect(bucket.tracked_keys(), 0, "after reset_after_ns every bucket is full again")
    expect(bucket.try_acquire("alice", 3), D(True, 3, 0, 0, 3 * S_), "a full burst fits again")


@rule("refill-capped")
@core
def test_stage1_token_bucket_refill_is_capped_at_capacity(stage_module: ModuleType) -> None:
    clock = ManualClock(START_NS)
    bucket: SweepableLimiter = stage_module.TokenBucket(capacity=2, refill_per_s=1, clock=clock)
    expect(bucket.try_acquire("alice", 2), D(True, 2, 0, 0, 2 * S_), "burst of 2")
    clock.advance(3600 * S_)  # an hour idle refills 3600 units — but the bucket holds 2
    expect(bucket.try_acquire("alice"), D(True, 2, 1, 0, 1 * S_), "idle bucket is full, no more")
    expect(bucket.try_acquire("alice"), D(True, 2, 0, 0, 2 * S_), "second unit of capacity")
    expect(
        bucket.try_acquire("alice"),
        D(False, 2, 0, 1 * S_, 2 * S_),
        "refill stops at capacity: an idle hour does not bank 3600 units",
    )


@rule("exact-arithmetic", "exact-retry", "remaining-floored")
@core
def test_stage1_token_bucket_fractional_rate_is_exact(stage_module: ModuleType) -> None:
    clock = ManualClock(START_NS)
    slow: SweepableLimiter = stage_module.TokenBucket(
        capacity=1, refill_per_s=Fraction(1, 3), clock=clock
    )
    expect(slow.try_acquire("alice"), D(True, 1, 0, 0, 3 * S_), "1/3 unit per second")
    expect(slow.try_acquire("alice"), D(False, 1, 0, 3 * S_, 3 * S_), "one unit takes 3 s")

    fast: SweepableLimiter = stage_module.TokenBucket(capacity=1, refill_per_s=3, clock=clock)
    third = 333_333_334  # ceil(10⁹ / 3): the first whole ns at which a unit is back
    expect(fast.try_acquire("alice"), D(True, 1, 0, 0, third), "3 units/s")
    expect(fast.try_acquire("alice"), D(False, 1, 0, third, third), "retry_after is a ceiling")
    clock.advance(third - 1)
    expect(fast.peek("alice"), D(False, 1, 0, 1, 1), "at 333 333 333 ns 0.999999999 units")
    clock.advance(1)
    expect(fast.try_acquire("alice"), D(True, 1, 0, 0, third), "admitted at exactly retry_after")

    odd: SweepableLimiter = stage_module.TokenBucket(
        capacity=2, refill_per_s=Fraction(2, 3), clock=clock
    )
    expect(odd.try_acquire("bob", 2), D(True, 2, 0, 0, 3 * S_), "2 units at 2/3 per s: 3 s")
    expect(odd.try_acquire("bob"), D(False, 2, 0, 1_500_000_000, 3 * S_), "1 unit: 1.5 s")


@rule("impossible-cost")
@core
def test_stage1_token_bucket_cost_above_capacity_never_fits(stage_module: ModuleType) -> None:
    clock = ManualClock(START_NS)
    bucket: SweepableLimiter = stage_module.TokenBucket(capacity=3, refill_per_s=1, clock=clock)
    impossible = D(False, 3, 3, None, 0)
    expect(bucket.try_acquire("alice", 4), impossible, "cost 4 > capacity 3: denied forever")
    expect(bucket.tracked_keys(), 0, "an impossible request changes nothing")
    expect(bucket.try_acquire("alice"), D(True, 3, 2, 0, 1 * S_), "the bucket is still full")
    clock.advance(365 * 24 * 3600 * S_)
    expect(
        bucket.try_acquire("alice", 4),
        impossible,
        "no amount of waiting makes 4 units fit in a bucket of 3: retry_after_ns is None",
    )
    expect(bucket.try_acquire("alice", 3), D(True, 3, 0, 0, 3 * S_), "cost == capacity fits")


@rule("denial-consumes-nothing")
@core
def test_stage1_token_bucket_denial_consumes_nothing(stage_module: ModuleType) -> None:
    clock = ManualClock(START_NS)
    bucket: SweepableLimiter = stage_module.TokenBucket(capacity=5, refill_per_s=1, clock=clock)
    expect(bucket.try_acquire("alice", 4), D(True, 5, 1, 0, 4 * S_), "4 of 5 units")
    denied = D(False, 5, 1, 2 * S_, 4 * S_)
    expect(bucket.try_acquire("alice", 3), denied, "3 units do not fit in 1")
    expect(bucket.try_acquire("alice", 3), denied, "a denial consumed nothing: same answer")
    expect(bucket.try_acquire("alice", 1), D(True, 5, 0, 0, 5 * S_), "the last unit is there")


@rule("clock-step-back")
@core
def test_stage1_token_bucket_clock_step_back_example(stage_module: ModuleType) -> None:
    clock = ManualClock(START_NS)
    bucket: SweepableLimiter = stage_module.TokenBucket(capacity=2, refill_per_s=1, clock=clock)
    expect(bucket.try_acquire("alice"), D(True, 2, 1, 0, 1 * S_), "one of two units")
    clock.set(START_NS - 10 * S_)  # an NTP step: the clock jumps 10 s back
    expect(
        bucket.peek("alice"),
        D(True, 2, 0, 0, 12 * S_),
        "a clock step back burns nothing: the unit left is still there (the key waits "
        "10 s for the clock to catch up, then 2 s to refill)",
    )
    expect(bucket.try_acquire("alice"), D(True, 2, 0, 0, 12 * S_), "the last unit")
    expect(bucket.try_acquire("alice"), D(False, 2, 0, 11 * S_, 12 * S_), "and then empty")
    clock.set(START_NS)
    expect(
        bucket.try_acquire("alice"),
        D(False, 2, 0, 1 * S_, 2 * S_),
        "a clock step back mints nothing: replaying the same 10 s refills nothing twice",
    )
    clock.advance(S_)
    expect(bucket.try_acquire("alice"), D(True, 2, 0, 0, 2 * S_), "refill resumes from START")


# --------------------------------------------------------------------------------------
# Examples — core: sliding log
# --------------------------------------------------------------------------------------


@rule("fresh", "half-open-window", "exact-retry", "reset-after")
@core
def test_stage1_sliding_log_example_from_the_prompt(stage_module: ModuleType) -> None:
    clock = ManualClock(START_NS)
    log: SweepableLimiter = stage_module.SlidingLog(limit=3, window_ns=10 * S_, clock=clock)
    expect(log.try_acquire("alice"), D(True, 3, 2, 0, 10 * S_), "t=0: 1 of 3")
    clock.advance(2 * S_)
    expect(log.try_acquire("alice", 2), D(True, 3, 0, 0, 10 * S_), "t=2 s: 3 of 3")
    clock.advance(1 * S_)
    expect(
        log.try_acquire("alice"),
        D(False, 3, 0, 7 * S_, 9 * S_),
        "t=3 s: full; the oldest unit (t=0) leaves the window at t=10 s",
    )
    expect(
        log.try_acquire("alice", 2),
        D(False, 3, 0, 9 * S_, 9 * S_),
        "2 units need both the t=0 and the t=2 s entries gone: t=12 s",
    )
    clock.set(START_NS + 10 * S_ - 1)
    expect(log.peek("alice"), D(False, 3, 0, 1, 2 * S_ + 1), "t=10 s - 1 ns: t=0 still counts")
    clock.advance(1)
    expect(
        log.try_acquire("alice"),
        D(True, 3, 0, 0, 10 * S_),
        "t=10 s: the window (now - 10 s, now] is half-open, so the unit of t=0 is out",
    )


@rule("half-open-window")
@core
def test_stage1_sliding_log_window_is_half_open(stage_module: ModuleType) -> None:
    clock = ManualClock(START_NS)
    log: SweepableLimiter = stage_module.SlidingLog(limit=1, window_ns=100, clock=clock)
    expect(log.try_acquire("alice"), D(True, 1, 0, 0, 100), "t=0: the only unit")
    clock.advance(99)
    expect(log.try_acquire("alice"), D(False, 1, 0, 1, 1), "t=99: t=0 is in (t-100, t]")
    clock.advance(1)
    expect(log.try_acquire("alice"), D(True, 1, 0, 0, 100), "t=100: t=0 is not in (0, 100]")


@rule("denial-consumes-nothing")
@core
def test_stage1_sliding_log_denied_requests_are_not_logged(stage_module: ModuleType) -> None:
    clock = ManualClock(START_NS)
    log: SweepableLimiter = stage_module.SlidingLog(limit=2, window_ns=10 * S_, clock=clock)
    expect(log.try_acquire("alice", 2), D(True, 2, 0, 0, 10 * S_), "t=0: 2 of 2")
    for second in range(1, 10):
        clock.advance(S_)
        expect(
            log.try_acquire("alice"),
            D(False, 2, 0, (10 - second) * S_, (10 - second) * S_),
            f"t={second} s: denied, and a denial must not be logged",
        )
    clock.advance(S_)
    expect(
        log.try_acquire("alice", 2),
        D(True, 2, 0, 0, 10 * S_),
        "t=10 s: the window holds nothing — nine denials consumed nothing",
    )


# --------------------------------------------------------------------------------------
# Examples — extended
# --------------------------------------------------------------------------------------


@rule("gcra-equals-bucket")
@extended
def test_stage1_gcra_example_matches_the_token_bucket(stage_module: ModuleType) -> None:
    clock = ManualClock(START_NS)
    gcra: SweepableLimiter = stage_module.GCRA(rate_per_s=1, burst=3, clock=clock)
    expect(gcra.try_acquire("alice", 2), D(True, 3, 1, 0, 2 * S_), "burst of 2 of 3")
    expect(gcra.try_acquire("alice", 2), D(False, 3, 1, 1 * S_, 2 * S_), "2 more need 1 s")
    expect(gcra.try_acquire("alice", 4), D(False, 3, 1, None, 2 * S_), "4 > burst: never")
    clock.advance(S_)
    expect(gcra.try_acquire("alice", 2), D(True, 3, 0, 0, 3 * S_), "exactly 1 s later")


@rule("fixed-epoch", "fixed-first-hit", "fixed-window-limit")
@extended
def test_stage1_fixed_window_epoch_vs_first_hit_alignment(stage_module: ModuleType) -> None:
    clock = ManualClock(START_NS + 3 * S_)  # 3 s into the epoch window [START, START+10 s)
    epoch: SweepableLimiter = stage_module.FixedWindow(limit=2, window_ns=10 * S_, clock=clock)
    first: SweepableLimiter = stage_module.FixedWindow(
        limit=2, window_ns=10 * S_, clock=clock, align="first_hit"
    )
    expect(epoch.try_acquire("alice", 2), D(True, 2, 0, 0, 7 * S_), "epoch window ends at 10 s")
    expect(first.try_acquire("alice", 2), D(True, 2, 0, 0, 10 * S_), "first hit opens a window")
    expect(epoch.try_acquire("alice"), D(False, 2, 0, 7 * S_, 7 * S_), "epoch: wait for 10 s")
    expect(first.try_acquire("alice"), D(False, 2, 0, 10 * S_, 10 * S_), "first_hit: for 13 s")
    clock.advance(7 * S_)
    expect(epoch.try_acquire("alice"), D(True, 2, 1, 0, 10 * S_), "epoch: a new window at 10 s")
    expect(first.try_acquire("alice"), D(False, 2, 0, 3 * S_, 3 * S_), "first_hit: not yet")
    clock.advance(3 * S_)
    expect(first.try_acquire("alice"), D(True, 2, 1, 0, 10 * S_), "first_hit: new window")


@rule("fixed-boundary-burst")
@extended
def test_stage1_fixed_window_allows_twice_the_limit_across_a_boundary(
    stage_module: ModuleType,
) -> None:
    clock = ManualClock(START_NS + 10 * S_ - 1)  # 1 ns before an epoch boundary
    window: SweepableLimiter = stage_module.FixedWindow(limit=5, window_ns=10 * S_, clock=clock)
    expect(window.try_acquire("alice", 5), D(True, 5, 0, 0, 1), "5 units at the window's end")
    clock.advance(1)
    expect(
        window.try_acquire("alice", 5),
        D(True, 5, 0, 0, 10 * S_),
        "5 more 1 ns later, in the next window: a fixed window admits 2x its limit in a "
        "short burst across a boundary (by design; a sliding log would not)",
    )


@rule("denial-consumes-nothing", "fixed-window-limit")
@extended
def test_stage1_fixed_window_denial_consumes_nothing(stage_module: ModuleType) -> None:
    clock = ManualClock(START_NS)
    window: SweepableLimiter = stage_module.FixedWindow(limit=3, window_ns=10 * S_, clock=clock)
    expect(window.try_acquire("alice", 2), D(True, 3, 1, 0, 10 * S_), "2 of 3")
    expect(window.try_acquire("alice", 2), D(False, 3, 1, 10 * S_, 10 * S_), "2 > 1: denied")
    expect(
        window.try_acquire("alice", 1),
        D(True, 3, 0, 0, 10 * S_),
        "the denied request consumed nothing (counting it first, then checking, is the bug)",
    )


@rule("fixed-refund-rolled", "refund-capped")
@extended
def test_stage1_fixed_window_refund_after_the_window_rolled_is_dropped(
    stage_module: ModuleType,
) -> None:
    clock = ManualClock(START_NS)
    window: SweepableLimiter = stage_module.FixedWindow(limit=5, window_ns=10 * S_, clock=clock)
    expect(window.try_acquire("alice", 4), D(True, 5, 1, 0, 10 * S_), "4 of 5")
    window.refund("alice", 2)
    expect(state_of(window, "alice", 5), D(False, 5, 3, None, 10 * S_), "2 units came back")
    clock.advance(10 * S_)
    window.refund("alice", 2)  # those units were counted in a window that has ended
    expect(
        state_of(window, "alice", 5),
        D(False, 5, 5, None, 0),
        "a refund for a window that rolled is dropped: never more than the limit",
    )
    expect(window.try_acquire("alice", 5), D(True, 5, 0, 0, 10 * S_), "the new window: 5")


@rule("fixed-refund-rolled", "refund-capped", "fixed-epoch", "fixed-first-hit")
@extended
@pytest.mark.parametrize("align", ["epoch", "first_hit"])
def test_stage1_fixed_window_refund_at_the_windows_end_carries_no_old_count(
    stage_module: ModuleType, align: str
) -> None:
    """A refund smaller than what the rolled window counted: 1 ns before the window ends
    it gives back; at the very instant it ends, the new window holds nothing to give back,
    and must not inherit what is left of the old count either."""
    clock = ManualClock(START_NS + 3 * S_)  # epoch: in [0, 10 s); first_hit: opens [3 s, 13 s)
    window: SweepableLimiter = stage_module.FixedWindow(
        limit=5, window_ns=10 * S_, clock=clock, align=align
    )
    ends = START_NS + (10 if align == "epoch" else 13) * S_
    story = f"FixedWindow(limit=5, window_ns=10 s, align={align!r}); try_acquire('alice', 4) at 3 s"
    expect(window.try_acquire("alice", 4), D(True, 5, 1, 0, ends - clock.now_ns()), story)
    clock.set(ends - 1)
    window.refund("alice", 1)
    story += f"; refund('alice', 1) 1 ns before the window ends at {(ends - START_NS) // S_} s"
    expect(state_of(window, "alice", 5), D(False, 5, 2, None, 1), f"{story}: 1 unit came back")
    clock.set(ends)
    window.refund("alice", 1)
    story += "; refund('alice', 1) at the instant it ends"
    expect(
        (state_of(window, "alice", 5), window.tracked_keys()),
        (D(False, 5, 5, None, 0), 0),
        f"{story}: the window that counted 3 has rolled, so the refund is dropped and the "
        "key is fresh — the new window counts nothing, not the old window's 3 less 1",
    )
    expect(
        window.try_acquire("alice", 5),
        D(True, 5, 0, 0, 10 * S_),
        f"{story}: the new window admits its whole limit",
    )


@rule("fixed-first-hit", "refund-capped", "fresh-again")
@extended
def test_stage1_fixed_window_first_hit_window_a_refund_empties_is_closed(
    stage_module: ModuleType,
) -> None:
    clock = ManualClock(START_NS)
    window: SweepableLimiter = stage_module.FixedWindow(
        limit=2, window_ns=10 * S_, clock=clock, align="first_hit"
    )
    expect(window.try_acquire("alice"), D(True, 2, 1, 0, 10 * S_), "t=0: opens [0, 10 s)")
    clock.advance(2 * S_)
    window.refund("alice", 1)
    expect(
        (state_of(window, "alice", 2), window.tracked_keys()),
        (D(False, 2, 2, None, 0), 0),
        "t=2 s: refund('alice', 1) brings the window's count back to 0: the window is closed "
        "and the key fresh (untracked)",
    )
    clock.advance(3 * S_)
    expect(
        window.try_acquire("alice"),
        D(True, 2, 1, 0, 10 * S_),
        "t=5 s: the next admission opens a new window, [5 s, 15 s) — not the one the refund "
        "emptied, [0, 10 s)",
    )
    clock.advance(5 * S_)
    expect(
        window.try_acquire("alice", 2),
        D(False, 2, 1, 5 * S_, 5 * S_),
        "t=10 s: still in [5 s, 15 s), which holds 1 of 2: 2 more wait for its end at 15 s",
    )


@rule("swc-admit", "swc-remaining", "swc-retry")
@extended
def test_stage1_sliding_window_counter_weights_the_previous_window(
    stage_module: ModuleType,
) -> None:
    clock = ManualClock(START_NS + 5 * S_)  # START is a multiple of the 10 s window
    counter: SweepableLimiter = stage_module.SlidingWindowCounter(
        limit=10, window_ns=10 * S_, clock=clock
    )
    expect(counter.try_acquire("alice", 8), D(True, 10, 2, 0, 15 * S_), "8 in this window")
    clock.set(START_NS + 12_500_000_000)  # 2.5 s into the next window
    expect(
        counter.peek("alice", 5),
        D(False, 10, 4, 1_250_000_000, 7_500_000_000),
        "prev 8 weighted by (10 - 2.5)/10 counts 6: 4 remain; 5 fit once 8·(W-e)/W <= 5, "
        "at e = 3.75 s",
    )
    expect(counter.try_acquire("alice", 4), D(True, 10, 0, 0, 17_500_000_000), "6 + 4 = 10")
    clock.advance(500_000_000)  # e = 3 s: 8·0.7 + 4 = 9.6 counted
    expect(
        counter.try_acquire("alice"),
        D(False, 10, 0, 750_000_000, 17 * S_),
        "9.6 counted: remaining floors to 0; 1 unit fits at e = 3.75 s",
    )


@rule("multi-all-or-nothing", "multi-decision", "multi-refund")
@extended
def test_stage1_multi_limiter_denial_consumes_from_no_limit(stage_module: ModuleType) -> None:
    clock = ManualClock(START_NS)
    requests: SweepableLimiter = stage_module.TokenBucket(capacity=3, refill_per_s=1, clock=clock)
    tokens: SweepableLimiter = stage_module.SlidingLog(limit=1000, window_ns=60 * S_, clock=clock)
    multi: MultiRateLimiter = stage_module.MultiLimiter({"requests": requests, "tokens": tokens})
    first = multi.try_acquire("alice", {"requests": 1, "tokens": 700})
    expect(
        first,
        MultiDecision(
            True,
            0,
            {"requests": D(True, 3, 2, 0, S_), "tokens": D(True, 1000, 300, 0, 60 * S_)},
        ),
        "1 request and 700 tokens fit",
    )
    second = multi.try_acquire("alice", {"requests": 1, "tokens": 400})
    expect(
        second,
        MultiDecision(
            False,
            60 * S_,
            {"requests": D(True, 3, 1, 0, 2 * S_), "tokens": D(False, 1000, 300, 60 * S_, 60 * S_)},
        ),
        "400 tokens do not fit in 300: denied, and each limit says what it alone would do",
    )
    expect(
        state_of(requests, "alice", 3),
        D(False, 3, 2, None, S_),
        "the tokens limit denied, so the requests limit must not have been charged either",
    )
    multi.refund("alice", {"tokens": 500})  # the call used 200 of its 700 estimated tokens
    expect(state_of(tokens, "alice", 1000), D(False, 1000, 800, None, 60 * S_), "500 back")
    multi.refund("alice", {"tokens": 5000})
    expect(state_of(tokens, "alice", 1000), D(False, 1000, 1000, None, 0), "capped at 1000")


@rule("multi-retry", "multi-costs")
@extended
def test_stage1_multi_limiter_retry_after_is_the_longest_wait(stage_module: ModuleType) -> None:
    clock = ManualClock(START_NS)
    requests: SweepableLimiter = stage_module.TokenBucket(
        capacity=1, refill_per_s=Fraction(1, 2), clock=clock
    )
    tokens: SweepableLimiter = stage_module.FixedWindow(limit=10, window_ns=10 * S_, clock=clock)
    multi: MultiRateLimiter = stage_module.MultiLimiter({"requests": requests, "tokens": tokens})
    assert multi.try_acquire("alice", {"requests": 1, "tokens": 10}).allowed
    wait = multi.peek("alice", {"requests": 1, "tokens": 1})
    expect(wait.retry_after_ns, 10 * S_, "requests is back in 2 s, tokens in 10 s: 10 s")
    expect(
        multi.peek("alice", {"requests": 1, "tokens": 11}).retry_after_ns,
        None,
        "11 tokens never fit in a window of 10",
    )
    clock.advance(10 * S_ - 1)
    expect(multi.try_acquire("alice", {"requests": 1, "tokens": 1}).allowed, False, "1 ns early")
    clock.advance(1)
    expect(multi.try_acquire("alice", {"requests": 1, "tokens": 1}).allowed, True, "on time")
    expect(
        multi.try_acquire("alice", {"tokens": 1}).decisions,
        {"tokens": D(True, 10, 8, 0, 10 * S_)},
        "a limit a request does not name is not charged, and not in the decision",
    )


@rule("multi-decision", "multi-all-or-nothing", "clock-step-back")
@extended
def test_stage1_multi_limiter_charge_denied_after_its_peek_gives_back_what_it_took(
    stage_module: ModuleType,
) -> None:
    # The tokens limit has its own clock, which steps back 5 s right after the
    # MultiLimiter's peek at it: every limit admitted the request, then the tokens
    # limit's charge, decided 5 s earlier, is denied.
    denial = D(False, 10, 5, S_, 5 * S_)  # 5 of the 6 tokens there, the 6th 1 s away
    for order in (("requests", "tokens"), ("tokens", "requests")):
        requests: SweepableLimiter = stage_module.TokenBucket(
            capacity=3, refill_per_s=1, clock=ManualClock(START_NS)
        )
        tokens_clock = ManualClock(START_NS - 10 * S_)
        tokens: SweepableLimiter = stage_module.TokenBucket(
            capacity=10, refill_per_s=1, clock=tokens_clock
        )
        expect(tokens.try_acquire("alice", 10).allowed, True, "10 tokens taken at -10 s")
        tokens_clock.set(START_NS)  # refilled to 10 by now
        limits = {"requests": requests, "tokens": StepsBackAfterPeek(tokens, tokens_clock, 5 * S_)}
        multi: MultiRateLimiter = stage_module.MultiLimiter(limits)
        costs = {name: {"requests": 1, "tokens": 6}[name] for name in order}
        reached = (
            {"requests": D(True, 3, 2, 0, S_), "tokens": denial}
            if order[0] == "requests"
            else {"tokens": denial}
        )
        expect(
            multi.try_acquire("alice", costs),
            MultiDecision(False, S_, reached),
            f"try_acquire('alice', {costs}): both limits admit it, then the tokens limit's "
            "clock steps back 5 s before it is charged, and its charge is denied. The "
            "request is denied, and decisions holds the limits it reached, in the order "
            "costs names them (the requests limit, if charged first, with what it took)",
        )
        expect(
            state_of(requests, "alice", 3),
            D(False, 3, 3, None, 0),
            f"costs in the order {order}: the denied request consumes from no limit — the "
            "requests limit, if charged before the denial, gets its unit back",
        )
        expect(state_of(tokens, "alice", 10), D(False, 10, 5, None, 5 * S_), "tokens: untouched")


@rule("multi-decision", "multi-all-or-nothing", "clock-step-back")
@extended
def test_stage1_multi_limiter_rollback_gives_each_limit_back_exactly_its_own_charge(
    stage_module: ModuleType,
) -> None:
    """Three limits, each charged a different cost; the tokens limit's clock steps back
    5 s right after the MultiLimiter's peek at it, so its charge is denied after the
    limits named before it were charged. Each of those gets back exactly what it was
    charged: requests had 5 units in use before (too much back would show), images
    takes more than tokens asked (too little back would show). In every order."""
    denial = D(False, 10, 5, S_, 5 * S_)  # 5 of the 6 tokens there, the 6th 1 s away
    costs_of = {"requests": 1, "images": 8, "tokens": 6}
    for order in itertools.permutations(costs_of):
        clock = ManualClock(START_NS)
        requests: SweepableLimiter = stage_module.TokenBucket(
            capacity=10, refill_per_s=1, clock=clock
        )
        images: SweepableLimiter = stage_module.SlidingLog(limit=10, window_ns=60 * S_, clock=clock)
        tokens_clock = ManualClock(START_NS - 10 * S_)
        tokens: SweepableLimiter = stage_module.TokenBucket(
            capacity=10, refill_per_s=1, clock=tokens_clock
        )
        expect(requests.try_acquire("alice", 5).allowed, True, "5 requests in use before")
        expect(tokens.try_acquire("alice", 10).allowed, True, "10 tokens taken at -10 s")
        tokens_clock.set(START_NS)  # refilled to 10 by now
        limits: dict[str, RateLimiter] = {
            "requests": requests,
            "images": images,
            "tokens": StepsBackAfterPeek(tokens, tokens_clock, 5 * S_),
        }
        multi: MultiRateLimiter = stage_module.MultiLimiter(limits)
        costs = {name: costs_of[name] for name in order}
        charged = order[: order.index("tokens")]
        before = {name: state_of(limits[name], "alice", 10) for name in charged}
        reached = {name: limits[name].peek("alice", costs_of[name]) for name in charged}
        story = (
            f"requests (a bucket of 10, 5 in use), images (a log of 10, empty) and tokens; "
            f"try_acquire('alice', {costs}): tokens' clock steps back 5 s after its peek"
        )
        expect(
            multi.try_acquire("alice", costs),
            MultiDecision(False, S_, {**reached, "tokens": denial}),
            f"{story}: denied, decisions hold the limits it reached, in the order of costs",
        )
        expect(
            {name: state_of(limits[name], "alice", 10) for name in charged},
            before,
            f"{story}: each limit charged before the denial ({', '.join(charged) or 'none'}) "
            "gets back exactly its own charge — not the cost the denying limit was asked",
        )
        expect(state_of(tokens, "alice", 10), D(False, 10, 5, None, 5 * S_), "tokens: untouched")


@rule("multi-costs", "multi-empty")
@extended
def test_stage1_multi_limiter_rejects_bad_costs(stage_module: ModuleType) -> None:
    clock = ManualClock(START_NS)
    requests: SweepableLimiter = stage_module.TokenBucket(capacity=3, refill_per_s=1, clock=clock)
    multi: MultiRateLimiter = stage_module.MultiLimiter({"requests": requests})
    bad: list[dict[str, Any]] = [
        {"tokens": 1},
        {"requests": -1},
        {"requests": True},
        {"requests": 1.0},
        {},
        {"requests": 0},
        {"requests": 1, "tokens": 0},  # an unknown name is refused whatever its cost
        {"tokens": 0, "requests": 1},
    ]
    for costs in bad:
        with pytest.raises((ValueError, TypeError), match="costs"):
            multi.try_acquire("alice", costs)
        with pytest.raises((ValueError, TypeError), match="costs"):
            multi.peek("alice", costs)
    expect(requests.tracked_keys(), 0, "rejected requests change nothing")
    with pytest.raises(ValueError, match="limits"):
        stage_module.MultiLimiter({})


@rule("multi-costs", "multi-refund", "bad-cost")
@extended
def test_stage1_multi_limiter_refund_and_sweep_act_on_every_limit(stage_module: ModuleType) -> None:
    """Two limits. A refund is validated whole before any limit gets units back (a bad
    entry after a good one changes nothing), may name a limit with 0 or name none (a
    completion that used all it reserved), and sweep() adds up what every limit forgot."""
    clock = ManualClock(START_NS)
    limits = {
        name: stage_module.TokenBucket(capacity=10, refill_per_s=1, clock=clock, auto_sweep=False)
        for name in ("requests", "tokens")
    }
    multi: MultiRateLimiter = stage_module.MultiLimiter(limits)
    multi.try_acquire("alice", {"requests": 4, "tokens": 4})
    before = {name: state_of(limit, "alice", 10) for name, limit in limits.items()}
    story = "requests and tokens, 10 each; try_acquire('alice', 4 of each)"
    bad: list[object] = [
        {"requests": 1, "tokens": -1},
        {"requests": 1, "nope": 1},
        {"requests": 1, "tokens": 1.0},
        {"requests": 1, "tokens": True},
        {"requests": 1, "nope": 0},  # unknown, though it would charge nothing
        {"nope": 0, "requests": 1},
        {"requests": 1, "tokens": False},  # falsy, but not an int 0
        {"requests": 1, "tokens": 0.0},
        [("requests", 1)],
    ]
    for costs in bad:
        for name in ("try_acquire", "peek", "refund"):
            with pytest.raises((ValueError, TypeError), match="costs"):
                getattr(multi, name)("alice", costs)
                check(False, f"{story}; {name}('alice', {costs!r}) was accepted")
    after = {name: state_of(limit, "alice", 10) for name, limit in limits.items()}
    expect(after, before, f"{story}; calls with bad costs (each refused) change no limit")
    for costs in ({"requests": 0}, {}, {"requests": 0, "tokens": 0}):
        with not_refused(f"{story}; refund('alice', {costs!r}): nothing to give back"):
            multi.refund("alice", costs)
    expect({n: state_of(limit, "alice", 10) for n, limit in limits.items()}, before, "no change")
    multi.refund("alice", {"tokens": 3})
    expect(
        (
            state_of(limits["requests"], "alice", 10).remaining,
            state_of(limits["tokens"], "alice", 10).remaining,
        ),
        (6, 9),
        f"{story}; refund('alice', {{'tokens': 3}}): only tokens gets its units back",
    )
    multi.try_acquire("bob", {"requests": 1})
    multi.try_acquire("carol", {"tokens": 1})
    clock.advance(100 * S_)  # everyone is fresh again
    expect(multi.sweep(), 4, "sweep() is the total over all limits: alice in both, bob, carol")
    expect(multi.sweep(), 0, "and a second sweep at the same instant forgets nothing")


# --------------------------------------------------------------------------------------
# The Retry-After header
# --------------------------------------------------------------------------------------


@rule("header-rounds-up", "header-none")
@extended
def test_stage1_retry_after_header_rounds_up_to_whole_seconds(stage_module: ModuleType) -> None:
    header = stage_module.retry_after_header
    cases = [
        (D(False, 1, 0, 1, 1), "1"),
        (D(False, 1, 0, S_, S_), "1"),
        (D(False, 1, 0, S_ + 1, S_ + 1), "2"),
        (D(False, 1, 0, 59_500_000_000, 60 * S_), "60"),
        (D(False, 1, 0, None, 0), None),
        (D(True, 1, 0, 0, S_), None),
        (MultiDecision(False, 2_500_000_000, {}), "3"),
        # Exact for any int: a float division loses the last nanoseconds past 2**53 ns.
        (D(False, 1, 0, 10**18 + 1, 10**18 + 1), "1000000001"),
        (D(False, 1, 0, 10**18, 10**18), "1000000000"),
    ]
    for decision, want in cases:
        expect(
            header(decision),
            want,
            f"retry_after_header({decision}): whole seconds rounded UP (RFC 9110) — a "
            "floored value sends an obedient client back too early, into another 429; "
            "None when allowed or when the request can never fit",
        )


@rule("header-rounds-up")
@needs("header")
@extended
@given(wait_ns=st.integers(1, 10**13))
def test_stage1_retry_after_header_is_the_ceiling_of_the_wait(
    stage_module: ModuleType, wait_ns: int
) -> None:
    got = stage_module.retry_after_header(D(False, 1, 0, wait_ns, wait_ns))
    assert isinstance(got, str) and got.isdigit(), f"header must be digits, got {got!r}"
    seconds = int(got)
    assert seconds * NS_PER_S >= wait_ns > (seconds - 1) * NS_PER_S, (
        f"Retry-After for a wait of {wait_ns} ns must be the least whole number of "
        f"seconds that is not shorter, got {got!r}"
    )


# --------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------

GOOD_CONFIG: dict[str, dict[str, object]] = {
    "TokenBucket": {"capacity": 3, "refill_per_s": 1},
    "SlidingLog": {"limit": 3, "window_ns": S_},
    "GCRA": {"rate_per_s": 1, "burst": 3},
    "FixedWindow": {"limit": 3, "window_ns": S_},
    "SlidingWindowCounter": {"limit": 3, "window_ns": S_},
}
BAD_CONFIG: list[tuple[str, str, object]] = [
    ("TokenBucket", "capacity", 0),
    ("TokenBucket", "capacity", -2),
    ("TokenBucket", "capacity", 2.5),
    ("TokenBucket", "capacity", True),
    ("TokenBucket", "refill_per_s", 0),
    ("TokenBucket", "refill_per_s", -1),
    ("TokenBucket", "refill_per_s", Fraction(-1, 3)),
    ("TokenBucket", "refill_per_s", 0.5),
    ("SlidingLog", "limit", 0),
    ("SlidingLog", "limit", True),
    ("SlidingLog", "window_ns", 0),
    ("SlidingLog", "window_ns", -5),
    ("SlidingLog", "window_ns", 1.5),
    ("GCRA", "burst", 0),
    ("GCRA", "rate_per_s", 0),
    ("GCRA", "rate_per_s", 2.0),
    ("FixedWindow", "limit", 0),
    ("FixedWindow", "window_ns", 0),
    ("FixedWindow", "align", "sliding"),
    ("FixedWindow", "align", "EPOCH"),
    ("FixedWindow", "align", "First_Hit"),
    ("FixedWindow", "align", None),
    ("SlidingWindowCounter", "limit", -1),
    ("SlidingWindowCounter", "window_ns", 0),
]


@rule("bad-config", "fixed-align")
@pytest.mark.parametrize(
    ("cls", "param", "value"),
    [
        pytest.param(
            c,
            p,
            v,
            marks=core if c in ("TokenBucket", "SlidingLog") else extended,
            id=f"{c}-{p}={v!r}",
        )
        for c, p, v in BAD_CONFIG
    ],
)
def test_stage1_bad_configuration_names_the_parameter(
    stage_module: ModuleType, cls: str, param: str, value: object
) -> None:
    kwargs = {**GOOD_CONFIG[cls], param: value, "clock": ManualClock(START_NS)}
    with pytest.raises((ValueError, TypeError), match=param):
        getattr(stage_module, cls)(**kwargs)


@rule("bad-cost")
@pytest.mark.parametrize("algo", by_algo())
def test_stage1_bad_cost_is_rejected_and_changes_nothing(
    stage_module: ModuleType, algo: Algo
) -> None:
    clock = ManualClock(START_NS)
    limiter = Setup(algo, limit=3).build(stage_module, clock)
    limiter.try_acquire("alice", 2)
    before = state_of(limiter, "alice", 3)
    for bad in (0, -1, True, False, 1.0, Fraction(1), "1", None):
        for name in ("try_acquire", "peek", "refund"):
            with pytest.raises((ValueError, TypeError), match="cost"):
                getattr(limiter, name)("alice", bad)
    expect(state_of(limiter, "alice", 3), before, "a rejected cost must change nothing")
    expect(limiter.tracked_keys(), 1, "only alice is tracked")


@core
@rule("bad-key")
@pytest.mark.parametrize("algo", by_algo())
def test_stage1_a_key_that_is_not_a_str_is_refused(stage_module: ModuleType, algo: Algo) -> None:
    clock = ManualClock(START_NS)
    limiter = Setup(algo, limit=3).build(stage_module, clock)
    for bad in (1, True, 1.0, None, b"alice", ("alice",)):
        for name, args in (("try_acquire", (1,)), ("peek", (1,)), ("refund", (1,)), ("reset", ())):
            with pytest.raises(TypeError, match="key"):
                getattr(limiter, name)(bad, *args)
                check(False, f"{name}({bad!r}) was accepted: a key must be a str")
    expect(limiter.tracked_keys(), 0, "refused keys change nothing")
    multi: MultiRateLimiter = stage_module.MultiLimiter({"requests": limiter})
    with pytest.raises(TypeError, match="costs"):
        multi.try_acquire("alice", None)  # type: ignore[arg-type]
        check(False, "MultiLimiter.try_acquire('alice', None) was accepted")
