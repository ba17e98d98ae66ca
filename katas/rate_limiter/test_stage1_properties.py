"""Stage 1 suite, properties: exact single-threaded rate limiters against their exact
models, step by step, whole Decisions compared (see katas/rate_limiter/README.md).

The examples that read like the prompt are in ``test_stage1.py``. Here: the differential
runs (:mod:`katas.rate_limiter._testing.limiters` drives an implementation beside its
model from :mod:`katas.rate_limiter._testing.models`), envelopes of what any admitted
traffic adds up to, properties every algorithm shares, MultiLimiter against a model made
of the exact models, state machines, and boundaries reached on every run.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from fractions import Fraction
from types import ModuleType
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize

from katas._harness.marks import core, extended, rule
from katas._harness.story import Story, check, expect
from katas._harness.under_test import stage
from katas._harness.walks import Drawn, Step, Walk, walked
from katas.rate_limiter._testing.limiters import (
    ALGOS,
    BOUNDARY_RUNS,
    DECISION_RULES,
    KEYS,
    OPERATIONS,
    S_,
    START_NS,
    Algo,
    D,
    Op,
    Setup,
    Traffic,
    admit_all,
    by_algo,
    check_against_model,
    durations,
    needs,
    operations,
    run_against_model,
    setups,
    smoke_needs,
    state_of,
)
from katas.rate_limiter._testing.models import Model
from katas.rate_limiter.api import (
    NS_PER_S,
    Decision,
    ManualClock,
    MultiDecision,
    MultiRateLimiter,
    RateLimiter,
    SweepableLimiter,
)

pytestmark = [pytest.mark.stage(1)]


#: Before hypothesis searches, every test calls what it drives once (see smoke_needs).
_fail_fast_on_stubs = pytest.fixture(autouse=True, name="_fail_fast_on_stubs")(smoke_needs)


# --------------------------------------------------------------------------------------
# Differential: whole Decisions equal an exact model, step by step
# --------------------------------------------------------------------------------------

#: What a run against the exact model checks of any algorithm that has one: every field
#: of every Decision, and which keys are tracked, swept, and swept by themselves.
MODEL_RULES = (*DECISION_RULES, "reset-after", "exact-retry", "tracked-keys", "sweep", "auto-sweep")


@rule(*MODEL_RULES, "refill-capped", "refund-capped")
@needs("token_bucket")
@core
@given(data=st.data())
def test_stage1_token_bucket_matches_exact_model(
    stage_module: ModuleType, data: st.DataObject
) -> None:
    check_against_model(stage_module, data, "token_bucket", steps_back=False)


@rule("clock-step-back", "exact-retry", "reset-after", "refund-capped")
@needs("token_bucket")
@core
@given(data=st.data())
def test_stage1_token_bucket_matches_model_across_clock_steps(
    stage_module: ModuleType, data: st.DataObject
) -> None:
    check_against_model(stage_module, data, "token_bucket", steps_back=True)


@rule(*MODEL_RULES, "half-open-window", "refund-capped", "refund-newest")
@needs("sliding_log")
@core
@given(data=st.data())
def test_stage1_sliding_log_matches_exact_model(
    stage_module: ModuleType, data: st.DataObject
) -> None:
    check_against_model(stage_module, data, "sliding_log", steps_back=False)


@rule("clock-step-back", "exact-retry", "reset-after", "refund-newest")
@needs("sliding_log")
@core
@given(data=st.data())
def test_stage1_sliding_log_matches_model_across_clock_steps(
    stage_module: ModuleType, data: st.DataObject
) -> None:
    check_against_model(stage_module, data, "sliding_log", steps_back=True)


@rule("gcra-equals-bucket")
@needs("gcra")
@extended
@given(data=st.data(), steps_back=st.booleans())
def test_stage1_gcra_decides_exactly_like_a_token_bucket(
    stage_module: ModuleType, data: st.DataObject, steps_back: bool
) -> None:
    # The model is the token bucket's: GCRA(rate_per_s=r, burst=b) must return the very
    # Decisions of TokenBucket(capacity=b, refill_per_s=r), every field, every call.
    check_against_model(stage_module, data, "gcra", steps_back=steps_back)


@rule("fixed-window-limit", "fixed-epoch", "fixed-first-hit", "fixed-refund-rolled")
@needs("fixed_window")
@extended
@given(data=st.data(), steps_back=st.booleans())
def test_stage1_fixed_window_matches_exact_model(
    stage_module: ModuleType, data: st.DataObject, steps_back: bool
) -> None:
    check_against_model(stage_module, data, "fixed_window", steps_back=steps_back)


@rule("swc-admit", "swc-remaining", "swc-retry")
@needs("sliding_window_counter")
@extended
@given(data=st.data(), steps_back=st.booleans())
def test_stage1_sliding_window_counter_matches_exact_model(
    stage_module: ModuleType, data: st.DataObject, steps_back: bool
) -> None:
    check_against_model(stage_module, data, "sliding_window_counter", steps_back=steps_back)


@rule("auto-sweep", "fresh-again")
@pytest.mark.parametrize("algo", by_algo())
def test_stage1_auto_sweep_forgets_only_fresh_keys(stage_module: ModuleType, algo: Algo) -> None:
    # Hundreds of keys, so that a limiter sweeping by itself does so several times;
    # every decision must still be the model's (which never forgets anything).
    rng = random.Random(20240601)
    setup = Setup(algo, limit=3, rate=Fraction(5, 2), window_ns=S_)
    clock = ManualClock(START_NS)
    limiter = setup.build(stage_module, clock, auto_sweep=True)
    keys = [f"user-{i}" for i in range(300)]
    ops: list[Op] = []
    for i in range(1_200):
        active = keys[max(0, i // 4 - 20) : i // 4 + 1]  # a moving crowd of users
        roll = rng.random()
        if roll < 0.6:
            ops.append(Op("acquire", rng.choice(active), rng.randint(1, 3)))
        elif roll < 0.7:
            ops.append(Op("peek", rng.choice(keys), rng.randint(1, 3)))
        else:
            ops.append(Op("advance", n=rng.randint(0, setup.scale_ns // 4)))
    ops.append(Op("tracked"))
    run_against_model(limiter, setup.model(), clock, ops, f"{setup} (auto_sweep=True), 300 keys:")


# --------------------------------------------------------------------------------------
# Envelopes: how much any admitted traffic can add up to
# --------------------------------------------------------------------------------------


def admitted_schedule(
    stage: ModuleType, data: st.DataObject, algo: Algo
) -> tuple[Setup, list[tuple[int, int]]]:
    """A drawn limiter of ``algo`` under greedy random traffic on one key: its setup and
    the (time, cost) of every request it admitted."""
    setup = data.draw(setups(algo), label="setup")
    clock = ManualClock(START_NS)
    limiter = setup.build(stage, clock)
    attempts = data.draw(
        st.lists(
            st.tuples(durations(setup), st.integers(1, setup.limit)), min_size=10, max_size=60
        ),
        label="attempts (wait, cost)",
    )
    admitted = []
    for wait, cost in attempts:
        clock.advance(wait)
        if limiter.try_acquire("alice", cost).allowed:
            admitted.append((clock.now_ns(), cost))
    return setup, admitted


def check_bucket_envelope(stage: ModuleType, data: st.DataObject, algo: Algo) -> None:
    __tracebackhide__ = True  # the assertion message tells the story
    setup, admitted = admitted_schedule(stage, data, algo)
    for i, (start, _) in enumerate(admitted):
        total = 0
        for end, cost in admitted[i:]:
            total += cost
            bound = setup.limit + setup.rate * Fraction(end - start, NS_PER_S)
            assert total <= bound, (
                f"{setup} admitted {total} units in [{start - START_NS}, "
                f"{end - START_NS}] ns, more than capacity + rate·d = {float(bound):.3f}\n"
                f"  admitted (t, cost): {[(t - START_NS, c) for t, c in admitted]}"
            )


@rule("refill-capped")
@needs("token_bucket")
@core
@given(data=st.data())
def test_stage1_token_bucket_admits_at_most_capacity_plus_rate_times_d(
    stage_module: ModuleType, data: st.DataObject
) -> None:
    check_bucket_envelope(stage_module, data, "token_bucket")


@rule("gcra-equals-bucket")
@needs("gcra")
@extended
@given(data=st.data())
def test_stage1_gcra_admits_at_most_burst_plus_rate_times_d(
    stage_module: ModuleType, data: st.DataObject
) -> None:
    check_bucket_envelope(stage_module, data, "gcra")


@rule("half-open-window")
@needs("sliding_log")
@core
@given(data=st.data())
def test_stage1_sliding_log_admits_at_most_limit_in_every_window(
    stage_module: ModuleType, data: st.DataObject
) -> None:
    setup, admitted = admitted_schedule(stage_module, data, "sliding_log")
    for end, _ in admitted:
        inside = [(t, c) for t, c in admitted if end - setup.window_ns < t <= end]
        assert sum(c for _, c in inside) <= setup.limit, (
            f"{setup} admitted {sum(c for _, c in inside)} units in the window "
            f"({end - setup.window_ns - START_NS}, {end - START_NS}] ns: "
            f"{[(t - START_NS, c) for t, c in inside]}"
        )


@rule("fixed-window-limit")
@needs("fixed_window")
@extended
@given(data=st.data())
def test_stage1_fixed_window_admits_at_most_limit_per_window(
    stage_module: ModuleType, data: st.DataObject
) -> None:
    setup, admitted = admitted_schedule(stage_module, data, "fixed_window")
    per_window: dict[int, int] = {}
    opened: int | None = None
    for t, cost in admitted:
        if setup.align == "epoch":
            start = t // setup.window_ns * setup.window_ns
        else:  # a window opens at the first admission after the previous one ended
            if opened is None or t >= opened + setup.window_ns:
                opened = t
            start = opened
        per_window[start] = per_window.get(start, 0) + cost
        assert per_window[start] <= setup.limit, (
            f"{setup} admitted {per_window[start]} units in the window starting "
            f"at {start - START_NS} ns (2x the limit across a boundary is by design, "
            f"within one window it is a bug): {[(a - START_NS, c) for a, c in admitted]}"
        )


@rule("swc-admit")
@needs("sliding_window_counter")
@extended
@given(data=st.data())
def test_stage1_sliding_window_counter_estimate_never_exceeds_limit(
    stage_module: ModuleType, data: st.DataObject
) -> None:
    setup, admitted = admitted_schedule(stage_module, data, "sliding_window_counter")
    w = setup.window_ns
    for t, _ in admitted:
        index, into = divmod(t, w)
        prev = sum(c for a, c in admitted if a // w == index - 1)
        curr = sum(c for a, c in admitted if a // w == index and a <= t)
        estimate = Fraction(prev * (w - into), w) + curr
        assert estimate <= setup.limit, (
            f"{setup} admitted a request at {t - START_NS} ns that brought the "
            f"estimate prev·(W - e)/W + curr to {estimate} > limit: "
            f"{[(a - START_NS, c) for a, c in admitted]}"
        )


# --------------------------------------------------------------------------------------
# Properties every algorithm shares
# --------------------------------------------------------------------------------------


def after_history(
    stage: ModuleType, data: st.DataObject, algo: Algo
) -> tuple[Setup, RateLimiter, ManualClock]:
    """A drawn limiter of ``algo`` that has admitted what it could of a drawn history."""
    setup = data.draw(setups(algo), label="setup")
    clock = ManualClock(START_NS)
    limiter = setup.build(stage, clock)
    admit_all(limiter, clock, data.draw(operations(setup), label="history"))
    return setup, limiter, clock


@rule("exact-retry", "retry-field")
@pytest.mark.parametrize("algo", by_algo())
@given(data=st.data())
def test_stage1_retry_after_is_exact(
    stage_module: ModuleType, algo: Algo, data: st.DataObject
) -> None:
    setup, limiter, clock = after_history(stage_module, data, algo)
    key = data.draw(st.sampled_from(KEYS), label="key")
    cost = data.draw(st.integers(1, setup.limit), label="cost")
    for _ in range(setup.limit + 1):  # drain at a frozen instant until denied
        denied = limiter.try_acquire(key, cost)
        if not denied.allowed:
            break
        assert denied.retry_after_ns == 0, f"an admitted request has retry 0: {denied}"
    assert not denied.allowed, f"{setup} admitted {setup.limit + 1} x {cost} at once"
    wait = denied.retry_after_ns
    assert wait is not None and wait > 0, f"a cost <= limit always fits later: {denied}"
    clock.advance(wait - 1)
    early = limiter.peek(key, cost)
    assert not early.allowed and early.retry_after_ns == 1, (
        f"{setup}: try_acquire({key!r}, {cost}) was denied with retry_after_ns="
        f"{wait}; 1 ns before that it must still be denied with 1 ns to go, got {early}"
    )
    clock.advance(1)
    on_time = limiter.try_acquire(key, cost)
    assert on_time.allowed, (
        f"{setup}: denied with retry_after_ns={wait}, the same request must be "
        f"admitted exactly then (no other traffic), got {on_time}"
    )


def twins(
    stage: ModuleType, setup: Setup
) -> tuple[RateLimiter, ManualClock, RateLimiter, ManualClock]:
    ca, cb = ManualClock(START_NS), ManualClock(START_NS)
    return setup.build(stage, ca), ca, setup.build(stage, cb), cb


def twins_after_history(
    stage: ModuleType, data: st.DataObject, algo: Algo
) -> tuple[Setup, RateLimiter, ManualClock, RateLimiter, ManualClock]:
    """Two limiters of one drawn setup, each with its own clock, both through the same
    drawn history: from here on they must decide alike."""
    setup = data.draw(setups(algo), label="setup")
    a, ca, b, cb = twins(stage, setup)
    history = data.draw(operations(setup), label="history")
    admit_all(a, ca, history)
    admit_all(b, cb, history)
    return setup, a, ca, b, cb


def step_twins(
    a: RateLimiter,
    ca: ManualClock,
    b: RateLimiter,
    cb: ManualClock,
    op: Op,
    story: Story,
    invariant: str,
    b_decided: str,
) -> None:
    """Run ``op`` on both twins and tell it; a decision of A must be B's (said ``b_decided``)."""
    __tracebackhide__ = True  # the assertion message tells the story
    if op.kind in ("acquire", "peek"):
        da = a.try_acquire(op.key, op.n) if op.kind == "acquire" else a.peek(op.key, op.n)
        db = b.try_acquire(op.key, op.n) if op.kind == "acquire" else b.peek(op.key, op.n)
        story.add(f"{op} -> {da}")
        story.check(da == db, invariant, f"{b_decided} {db}")
    else:
        admit_all(a, ca, [op])
        admit_all(b, cb, [op])
        story.add(str(op))


def same_future(
    a: RateLimiter, ca: ManualClock, b: RateLimiter, cb: ManualClock, ops: list[Op], why: str
) -> None:
    """Replay ``ops`` on both twins: every decision and tracked_keys() must agree."""
    __tracebackhide__ = True  # the assertion message tells the story
    story = Story(f"the same operations on both twins ({why}):", ca.now_ns, START_NS)
    for op in ops:
        step_twins(a, ca, b, cb, op, story, why, "the other twin decided")
    for key in KEYS:
        expect(state_of(a, key, 10**6), state_of(b, key, 10**6), f"{why}: state of {key}")
    expect(a.tracked_keys(), b.tracked_keys(), f"{why}: tracked_keys()")


@rule("impossible-cost")
@pytest.mark.parametrize("algo", by_algo())
@given(data=st.data())
def test_stage1_impossible_cost_is_denied_forever_and_changes_nothing(
    stage_module: ModuleType, algo: Algo, data: st.DataObject
) -> None:
    setup, a, ca, b, cb = twins_after_history(stage_module, data, algo)
    key = data.draw(st.sampled_from(KEYS), label="key")
    cost = setup.limit + data.draw(st.integers(1, 100), label="cost above limit")
    for call in (a.try_acquire, a.peek):
        got = call(key, cost)
        want = state_of(b, key, setup.limit)
        check(
            got == want and not got.allowed and got.retry_after_ns is None,
            f"{setup}: cost {cost} > limit {setup.limit} can never fit: denied, "
            f"retry_after_ns None, remaining/reset as they stand ({want}), got {got}",
        )
    ca.advance(100 * setup.recovery_ns)
    cb.advance(100 * setup.recovery_ns)
    expect(a.try_acquire(key, cost).retry_after_ns, None, "still impossible after any wait")
    same_future(a, ca, b, cb, data.draw(operations(setup), label="then"), "impossible cost")


@rule("denial-consumes-nothing", "peek-changes-nothing")
@pytest.mark.parametrize("algo", by_algo())
@given(data=st.data())
def test_stage1_denials_and_peeks_change_nothing(
    stage_module: ModuleType, algo: Algo, data: st.DataObject
) -> None:
    setup = data.draw(setups(algo), label="setup")
    a, ca, b, cb = twins(stage_module, setup)
    ops = data.draw(operations(setup), label="ops")
    probes = data.draw(st.lists(st.booleans(), min_size=len(ops), max_size=len(ops)))
    story = Story(
        f"{setup}: twin A also gets peeks and denied requests, twin B not:", ca.now_ns, START_NS
    )
    for op, probe in zip(ops, probes, strict=True):
        if probe:
            for key in KEYS:
                for cost in range(1, setup.limit + 2):
                    peeked = a.peek(key, cost)
                    if not peeked.allowed:
                        denied = a.try_acquire(key, cost)
                        story.check(
                            denied == peeked,
                            "peek returns what try_acquire would",
                            f"{peeked} vs {denied}",
                        )
            story.add("A: peek every key and cost, try_acquire those denied")
        invariant = "a denial or a peek changed the limiter's state"
        step_twins(a, ca, b, cb, op, story, invariant, "twin B decided")
    expect(a.tracked_keys(), b.tracked_keys(), "denials and peeks add no tracked keys")


@rule("reset-after", "fresh-again")
@pytest.mark.parametrize("algo", by_algo())
@given(data=st.data())
def test_stage1_idle_keys_recover_at_reset_after(
    stage_module: ModuleType, algo: Algo, data: st.DataObject
) -> None:
    setup, limiter, clock = after_history(stage_module, data, algo)
    t0 = clock.now_ns()
    resets = sorted((state_of(limiter, k, setup.limit).reset_after_ns, k) for k in KEYS)
    for reset, key in resets:
        if t0 + reset - 1 >= clock.now_ns() and reset > 0:
            clock.set(t0 + reset - 1)
            early = limiter.peek(key, setup.limit)
            assert not early.allowed, (
                f"{setup}: {key} reported reset_after_ns={reset}; 1 ns before, it "
                f"is not fresh yet, so a full-limit request is denied, got {early}"
            )
        clock.set(max(clock.now_ns(), t0 + reset))
        fresh = setup.build(stage_module, clock)
        for cost in range(1, setup.limit + 2):
            expect(
                limiter.peek(key, cost),
                fresh.peek(key, cost),
                f"{setup}: at reset_after_ns={reset} {key} decides like a fresh key",
            )
    expect(limiter.tracked_keys(), 0, "every key has recovered: none is tracked")


def drain(limiter: RateLimiter, setup: Setup) -> int:
    """Acquire single units at a frozen instant until denied; return how many fit."""
    __tracebackhide__ = True  # the assertion message tells the story
    admitted = 0
    while limiter.try_acquire("alice", 1).allowed:
        admitted += 1
        check(admitted <= setup.limit, f"{setup} admitted more than its limit at one instant")
    return admitted


@rule("clock-step-back")
@pytest.mark.parametrize("algo", by_algo())
@given(data=st.data())
def test_stage1_clock_step_back_neither_mints_nor_burns(
    stage_module: ModuleType, algo: Algo, data: st.DataObject
) -> None:
    setup, a, ca, b, cb = twins_after_history(stage_module, data, algo)
    for limiter, clock in ((a, ca), (b, cb)):  # end with an admission, at time T
        decision = limiter.try_acquire("alice", 1)
        if not decision.allowed:
            assert decision.retry_after_ns is not None
            clock.advance(decision.retry_after_ns)
            assert limiter.try_acquire("alice", 1).allowed, "retry_after is exact"
    costs = range(1, setup.limit + 2)
    before = [a.peek("alice", c) for c in costs]
    back = data.draw(st.integers(1, 3 * setup.scale_ns), label="step back (ns)")
    ca.set(ca.now_ns() - back)
    for cost, was in zip(costs, before, strict=True):
        now = a.peek("alice", cost)
        shifted = Decision(
            was.allowed,
            was.limit,
            was.remaining,
            was.retry_after_ns + back if was.retry_after_ns else was.retry_after_ns,
            was.reset_after_ns + back,
        )
        expect(
            now,
            shifted,
            f"{setup}: right after an admission at T the clock steps back {back} ns: the "
            "key is paused — same units (nothing burnt), waits longer by the step",
        )
    drained_a, drained_b = drain(a, setup), drain(b, setup)
    expect(drained_a, drained_b, f"{setup}: units available at T - {back} ns vs at T")
    ca.advance(back)  # the clock is back at T: the replayed interval must refill nothing
    expect(a.peek("alice", 1), b.peek("alice", 1), f"{setup}: nothing minted by the replay")
    same_future(a, ca, b, cb, data.draw(operations(setup), label="then"), "after a step back")


@rule("keys-isolated")
@pytest.mark.parametrize("algo", by_algo())
@given(data=st.data())
def test_stage1_keys_are_isolated(
    stage_module: ModuleType, algo: Algo, data: st.DataObject
) -> None:
    setup = data.draw(setups(algo), label="setup")
    a, ca, b, cb = twins(stage_module, setup)
    mine = data.draw(operations(setup, keys=("alice",)), label="alice's ops")
    other_op = st.one_of(
        st.builds(Op, st.just("acquire"), st.sampled_from(["bob", "carol"]), st.integers(1, 7)),
        st.builds(Op, st.just("refund"), st.sampled_from(["bob", "carol"]), st.integers(1, 7)),
        st.builds(Op, st.just("reset"), st.sampled_from(["bob", "carol"])),
        st.builds(Op, st.just("sweep")),
    )
    others = data.draw(
        st.lists(st.lists(other_op, max_size=3), min_size=len(mine), max_size=len(mine)),
        label="others' ops",
    )
    story = Story(f"{setup}: twin B also serves bob and carol:", ca.now_ns, START_NS)
    for op, extra in zip(mine, others, strict=True):
        admit_all(b, cb, extra)
        invariant = "other keys' traffic changed alice's decisions"
        step_twins(a, ca, b, cb, op, story, invariant, "with it:")


@rule("refund-capped", "refund-empty-key")
@pytest.mark.parametrize("algo", by_algo())
@given(data=st.data())
def test_stage1_refund_is_capped_and_undoes_an_admission(
    stage_module: ModuleType, algo: Algo, data: st.DataObject
) -> None:
    setup, a, ca, b, cb = twins_after_history(stage_module, data, algo)
    key = data.draw(st.sampled_from(KEYS), label="key")
    cost = data.draw(st.integers(1, setup.limit), label="cost")
    if a.try_acquire(key, cost).allowed:  # admitted and refunded at once: as if never
        a.refund(key, cost)
    same_future(a, ca, b, cb, data.draw(operations(setup), label="then"), "acquire+refund")
    for limiter in (a, b):
        limiter.refund(key, 10**9)
        after = state_of(limiter, key, setup.limit)
        assert after.remaining <= setup.limit, (
            f"{setup}: a refund never lifts a key above a fresh key's allowance "
            f"({setup.limit}), got remaining={after.remaining}"
        )
    fresh = setup.build(stage_module, ca)
    fresh.refund("dave", setup.limit)
    expect(fresh.tracked_keys(), 0, "a refund to a key holding nothing does nothing")
    expect(fresh.peek("dave", setup.limit).remaining, 0, "and adds nothing above the limit")


@rule("auto-sweep")
@pytest.mark.parametrize("algo", by_algo())
def test_stage1_auto_sweep_bounds_memory_by_recent_keys(
    stage_module: ModuleType, algo: Algo
) -> None:
    setup = Setup(algo, limit=2, rate=Fraction(1), window_ns=S_)
    clock = ManualClock(START_NS)
    limiter = setup.build(stage_module, clock)
    n = 4_096
    for i in range(n):
        assert limiter.try_acquire(f"user-{i}").allowed
        clock.advance(setup.recovery_ns)  # user-i is idle from now on
    expect(limiter.tracked_keys(), 0, "every one-off user is idle again")
    left = limiter.sweep()
    assert left <= n // 2, (
        f"{setup} with auto_sweep=True: after {n} one-off users, each idle since, "
        f"a sweep still found {left} stored keys — the limiter must forget idle keys by "
        "itself (say, each time the key count doubles), or memory grows with every key ever "
        "seen"
    )


@rule("no-auto-sweep", "sweep", "tracked-keys")
@pytest.mark.parametrize("algo", by_algo())
def test_stage1_without_auto_sweep_only_sweep_forgets(stage_module: ModuleType, algo: Algo) -> None:
    setup = Setup(algo, limit=2, rate=Fraction(1), window_ns=S_)
    clock = ManualClock(START_NS)
    limiter = setup.build(stage_module, clock, auto_sweep=False)
    n = 300
    for i in range(n):
        assert limiter.try_acquire(f"user-{i}").allowed
    expect(limiter.tracked_keys(), n, "every user holds state")
    expect(limiter.sweep(), 0, "nobody is idle yet: a sweep forgets nothing")
    clock.advance(setup.recovery_ns)
    expect(limiter.tracked_keys(), 0, "all idle now")
    for i in range(n, 5 * n):  # the stored keys more than double: when an auto-sweep would run
        assert limiter.try_acquire(f"user-{i}").allowed
    expect(limiter.tracked_keys(), 4 * n, f"{4 * n} new users hold state, the first {n} idle")
    expect(
        limiter.sweep(),
        n,
        f"{setup} with auto_sweep=False: {n} users went idle, then {4 * n} new users came; "
        f"nothing is forgotten until sweep(), which then forgets the {n} idle ones — a limiter "
        "that swept by itself on the way (when its keys doubled, say) forgot them already",
    )
    expect(limiter.sweep(), 0, "and then there is nothing left to forget")


# --------------------------------------------------------------------------------------
# MultiLimiter against a model made of the exact models
# --------------------------------------------------------------------------------------


class MultiModel:
    def __init__(self, models: Mapping[str, Model[Any]]) -> None:
        self.models = dict(models)

    def decide(
        self, key: str, costs: Mapping[str, int], now: int, *, commit: bool
    ) -> MultiDecision:
        charged = {name: cost for name, cost in costs.items() if cost}
        alone = {n: self.models[n].decide(key, c, now, commit=False) for n, c in charged.items()}
        if all(d.allowed for d in alone.values()):
            if commit:
                alone = {
                    n: self.models[n].decide(key, c, now, commit=True) for n, c in charged.items()
                }
            return MultiDecision(True, 0, alone)
        waits = [d.retry_after_ns for d in alone.values() if not d.allowed]
        retry = None if None in waits else max(w for w in waits if w is not None)
        return MultiDecision(False, retry, alone)


MultiStep = tuple[str, str, Mapping[str, int]]


def check_multi(
    stage_module: ModuleType, requests: Setup, tokens: Setup, steps: Sequence[MultiStep]
) -> None:
    """Run ``steps`` on a MultiLimiter of the two limits and on its model, compared."""
    __tracebackhide__ = True
    clock = ManualClock(START_NS)
    inner = {
        "requests": requests.build(stage_module, clock),
        "tokens": tokens.build(stage_module, clock),
    }
    multi: MultiRateLimiter = stage_module.MultiLimiter(inner)
    model = MultiModel({"requests": requests.model(), "tokens": tokens.model()})
    story = Story(f"MultiLimiter(requests={requests}, tokens={tokens}):", clock.now_ns, START_NS)
    for kind, key, arg in steps:
        now = clock.now_ns()
        if kind == "advance":
            clock.advance(arg["ns"])
            story.add(f"clock.advance({arg['ns']})")
        elif kind == "refund":
            multi.refund(key, arg)
            for name, cost in arg.items():
                if cost:
                    model.models[name].refund(key, cost, now)
            story.add(f"refund({key!r}, {arg})")
        else:
            commit = kind == "acquire"
            got = multi.try_acquire(key, arg) if commit else multi.peek(key, arg)
            want = model.decide(key, arg, now, commit=commit)
            story.add(f"{'try_acquire' if commit else 'peek'}({key!r}, {arg}) -> {got}")
            story.expect(
                got,
                want,
                "a multi-limit request is admitted by all its limits or consumes from none",
            )


#: The run every multi-limit check starts with: a request the first limit admits and the
#: second denies must consume from neither, for the acquire as for the peek after it.
MULTI_BOUNDARY: tuple[Setup, Setup, tuple[MultiStep, ...]] = (
    Setup("token_bucket", 3),
    Setup("sliding_log", 100, window_ns=1_000),
    (
        ("acquire", "alice", {"requests": 1, "tokens": 90}),
        ("acquire", "alice", {"requests": 1, "tokens": 20}),  # tokens deny: requests untouched
        ("peek", "alice", {"requests": 2, "tokens": 10}),
        ("acquire", "alice", {"requests": 2, "tokens": 10}),  # both still admit it
        ("acquire", "alice", {"requests": 1, "tokens": 1}),
    ),
)


@rule("multi-all-or-nothing", "multi-decision", "multi-retry", "multi-refund")
@needs("multi", *ALGOS)
@extended
@given(data=st.data())
def test_stage1_multi_limiter_is_all_or_nothing(
    stage_module: ModuleType, data: st.DataObject
) -> None:
    check_multi(stage_module, *MULTI_BOUNDARY)
    requests = data.draw(setups("token_bucket"), label="requests")
    tokens = data.draw(
        st.sampled_from(ALGOS)
        .flatmap(setups)
        .map(lambda s: Setup(s.algo, s.limit * 50, s.rate * 50, s.window_ns, s.align)),
        label="tokens",
    )
    costs = st.fixed_dictionaries(
        {"requests": st.integers(0, requests.limit + 1), "tokens": st.integers(1, tokens.limit + 1)}
    )
    steps = data.draw(
        st.lists(
            st.one_of(
                st.tuples(
                    st.sampled_from(["acquire", "acquire", "peek", "refund"]),
                    st.sampled_from(KEYS),
                    costs,
                ),
                st.tuples(
                    st.just("advance"),
                    st.just(""),
                    durations(requests).map(lambda n: {"ns": n}),
                ),
            ),
            max_size=30,
        ),
        label="steps",
    )
    check_multi(stage_module, requests, tokens, steps)


# --------------------------------------------------------------------------------------
# Stateful models
# --------------------------------------------------------------------------------------


@OPERATIONS.machine(every_step={"tracked": Op("tracked")})
class LimiterMachine(RuleBasedStateMachine):
    """A limiter and its exact model under random operations, compared at every step.

    Its rules are derived from :data:`OPERATIONS`, one a kind of ``Op``, each drawing
    its operation as the differential tests' lists do; ``tracked`` is checked after every
    step (``tests/test_model_drivers.py`` checks that no kind goes unwalked)."""

    algo: Algo = "token_bucket"

    def __init__(self) -> None:
        super().__init__()
        self.clock = ManualClock(START_NS)

    @initialize(data=st.data())
    def build(self, data: st.DataObject) -> None:
        self.setup = data.draw(setups(self.algo), label="setup")
        self.steps_back = data.draw(st.booleans(), label="clock may step back")
        self.limiter = self.setup.build(stage(), self.clock, auto_sweep=not self.steps_back)
        self.model = self.setup.model()
        self.story = Story(
            f"{self.setup} (auto_sweep={not self.steps_back}):", self.clock.now_ns, START_NS
        )

    def draws(self) -> Traffic:
        """This limiter's operations: a step back only if its clock may (else a sweep)."""
        return Traffic(self.setup, steps_back=self.steps_back)

    def apply(self, op: Op) -> None:
        """Run one operation on both; on a mismatch show the whole sequence so far."""
        run_against_model(self.limiter, self.model, self.clock, [op], story=self.story)


class TokenBucketMachine(LimiterMachine):
    algo = "token_bucket"


class SlidingLogMachine(LimiterMachine):
    algo = "sliding_log"


MACHINE_RULES = (
    "fresh",
    "exact-retry",
    "refund-capped",
    "tracked-keys",
    "sweep",
    "clock-step-back",
)


def boundary_walk(algo: Algo) -> Walk:
    """The limiter's :data:`BOUNDARY_RUNS` entry as the machine's steps (its ``tracked``
    left to the machine, which checks it after every step)."""
    setup, ops = BOUNDARY_RUNS[algo]
    build: Step = ("build", {"data": Drawn(setup, False)})  # the clock never steps back
    return [build, *OPERATIONS.walk(LimiterMachine, ops)]


def model_test(machine: type[LimiterMachine]) -> type[Any]:
    return walked(machine, {"boundaries": boundary_walk(machine.algo)})


TestStage1TokenBucketModel = core(
    rule(*MACHINE_RULES)(needs("token_bucket")(model_test(TokenBucketMachine)))
)
TestStage1SlidingLogModel = core(
    rule(*MACHINE_RULES, "refund-newest")(needs("sliding_log")(model_test(SlidingLogMachine)))
)


# --------------------------------------------------------------------------------------
# Boundaries, reached on every run
# --------------------------------------------------------------------------------------


def check_reads_drop_nothing(stage: ModuleType, algo: Algo) -> None:
    for read_at_s in (12, 40):  # partly expired, all expired
        check_reads_drop_nothing_at(stage, algo, read_at_s)


def check_reads_drop_nothing_at(stage_module: ModuleType, algo: Algo, read_at_s: int) -> None:
    __tracebackhide__ = True
    # Twin A is read (peeks, and requests that are denied) once usage has left the window
    # or refilled; then both clocks step back to just after the key's last write. A read
    # that tidied expired state away (or forgot the key) shows: A would mint quota.
    setup = Setup(algo, limit=2, rate=Fraction(1, 10), window_ns=10 * S_)
    a, ca, b, cb = twins(stage_module, setup)
    for limiter, clock in ((a, ca), (b, cb)):
        limiter.try_acquire("alice")
        clock.advance(5 * S_)
        limiter.try_acquire("alice")
        clock.set(START_NS + read_at_s * S_)
    reads = []
    for cost in range(1, setup.limit + 2):
        peeked = a.peek("alice", cost)
        reads.append(f"peek('alice', {cost}) -> {peeked}")
        if not peeked.allowed:
            reads.append(f"try_acquire('alice', {cost}) -> {a.try_acquire('alice', cost)}")
    for clock in (ca, cb):
        clock.set(START_NS + 6 * S_)  # back to 1 s after the last admission
    story = "".join(f"\n    {r}" for r in reads)
    for cost in range(1, setup.limit + 2):
        expect(
            a.peek("alice", cost),
            b.peek("alice", cost),
            f"{setup}: units taken at 0 and 5 s; at {read_at_s} s twin A only read:{story}\n  "
            f"then the clock stepped back to 6 s: peek('alice', {cost}) must be what the "
            "unread twin says — a peek or a denial changes nothing, not even expired entries",
        )
    for clock in (ca, cb):
        clock.set(START_NS + read_at_s * S_)
    expect(state_of(a, "alice", 2), state_of(b, "alice", 2), f"{setup}: back at {read_at_s} s")


@core
@rule("peek-changes-nothing", "denial-consumes-nothing", "clock-step-back")
def test_stage1_sliding_log_reads_drop_nothing_a_clock_step_back_would_find(
    stage_module: ModuleType,
) -> None:
    check_reads_drop_nothing(stage_module, "sliding_log")


@rule("peek-changes-nothing", "denial-consumes-nothing", "clock-step-back")
@pytest.mark.parametrize("algo", by_algo(a for a in ALGOS if a != "sliding_log"))
def test_stage1_reads_drop_nothing_a_clock_step_back_would_find(
    stage_module: ModuleType, algo: Algo
) -> None:
    check_reads_drop_nothing(stage_module, algo)


@rule("clock-step-back", "refund-capped", "refund-newest")
@pytest.mark.parametrize("algo", by_algo())
def test_stage1_a_refund_is_a_write_a_clock_step_back_pauses_at(
    stage_module: ModuleType, algo: Algo
) -> None:
    # A refund writes the key's state, so it stamps the key's time like an admission:
    # after a step back to before the refund, the key waits at the refund's instant.
    # Twin A steps back, twin B does not; from the refund's instant on they must agree.
    setup = Setup(algo, limit=3, rate=Fraction(1, 10), window_ns=10 * S_)
    a, ca, b, cb = twins(stage_module, setup)
    for limiter, clock in ((a, ca), (b, cb)):
        for at_s in (0, 5, 6):
            clock.set(START_NS + at_s * S_)
            limiter.try_acquire("alice")
        clock.set(START_NS + 12 * S_)
        limiter.refund("alice", 1)
    ca.set(START_NS + 8 * S_)
    taken_a, taken_b = a.try_acquire("alice"), b.try_acquire("alice")
    story = (
        f"{setup}: units taken at 0, 5 and 6 s; refund('alice', 1) at 12 s; then twin A's "
        "clock stepped back to 8 s and twin B's stayed at 12 s; both took 1 unit"
    )
    expect(
        (taken_a.allowed, taken_a.remaining),
        (taken_b.allowed, taken_b.remaining),
        f"{story}: (allowed, remaining) — A's key is paused at the refund's instant",
    )
    for at_s in range(12, 27):
        for clock in (ca, cb):
            clock.set(START_NS + at_s * S_)
        expect(
            state_of(a, "alice", 3),
            state_of(b, "alice", 3),
            f"{story}. At {at_s} s the twins must agree: the refund is a write, so it "
            "stamps the key's time and A's unit counts from 12 s, not 8 s",
        )


@rule("clock-step-back", "refund-capped", "reset-after", "refund-newest")
@pytest.mark.parametrize("algo", by_algo())
def test_stage1_a_refund_while_the_clock_is_behind_neither_mints_nor_burns(
    stage_module: ModuleType, algo: Algo
) -> None:
    # Refunds made while the clock stands behind the key's last write (the key is
    # paused), down to an empty key, and what the key answers meanwhile: its reset and
    # retry still count the catch-up time, even once it holds nothing.
    setup = Setup(algo, limit=3, rate=Fraction(1, 10), window_ns=10 * S_)
    clock = ManualClock(START_NS)
    scale = setup.scale_ns
    ops = [
        Op("acquire", n=2),
        Op("advance", n=scale // 2),
        Op("acquire", n=1),
        Op("back", n=scale // 4),
        Op("refund", n=1),
        Op("peek", n=1),
        Op("peek", n=4),
        Op("refund", n=3),
        Op("peek", n=4),
        Op("peek", n=3),
        Op("acquire", n=3),
        Op("advance", n=scale),
        Op("peek", n=1),
    ]
    run_against_model(
        setup.build(stage_module, clock), setup.model(), clock, ops, f"{setup}, one key:"
    )


@rule("peek-changes-nothing", "denial-consumes-nothing", "bad-cost", "refund-empty-key", "sweep")
@pytest.mark.parametrize("algo", by_algo())
def test_stage1_reads_denials_and_refused_calls_store_no_key(
    stage_module: ModuleType, algo: Algo
) -> None:
    """A peek, a denial, a refund or reset of a key that holds nothing, and a call refused
    for its cost change nothing — memory included: a limiter that stored a key for each
    would grow with every key an attacker merely asks about. sweep() finds none to forget."""
    setup = Setup(algo, limit=3, rate=Fraction(1), window_ns=S_)
    limiter = setup.build(stage_module, ManualClock(START_NS), auto_sweep=False)
    limiter.peek("peeked", 1)
    limiter.try_acquire("too-big", 4)
    limiter.refund("refunded", 1)
    limiter.reset("reset")
    for name in ("try_acquire", "peek", "refund"):
        with pytest.raises((TypeError, ValueError)):
            getattr(limiter, name)(f"bad-{name}", 0)
    expect(
        limiter.sweep(),
        0,
        f"{setup} (auto_sweep=False): peek, a denied cost 4, a refund and a reset of keys "
        "never admitted, and calls with cost 0 (refused): none of them stores a key, so "
        "sweep() has nothing to forget",
    )


@rule("auto-sweep")
@pytest.mark.parametrize("algo", by_algo())
def test_stage1_auto_sweep_keeps_every_key_when_none_is_fresh(
    stage_module: ModuleType, algo: Algo
) -> None:
    setup = Setup(algo, limit=3, rate=Fraction(1), window_ns=S_)
    limiter = setup.build(stage_module, ManualClock(START_NS))
    n = 1_000  # the stored keys double several times: each time an auto-sweep may run
    for i in range(n):
        limiter.try_acquire(f"user-{i}", 2)
    first = state_of(limiter, "user-0", 3)
    expect(
        (limiter.tracked_keys(), first.remaining),
        (n, 1),
        f"{setup} with auto_sweep=True: {n} users each took 2 units at the same instant, so "
        "no key is fresh and an auto-sweep may forget none of them (not even the oldest, "
        "to bound memory): (tracked keys, user-0's remaining)",
    )


@core
@rule("refund-capped")
def test_stage1_token_bucket_refund_tops_up_a_partly_refilled_bucket(
    stage_module: ModuleType,
) -> None:
    check_refund_tops_up(stage_module, "token_bucket")


@extended
@rule("refund-capped", "gcra-equals-bucket")
def test_stage1_gcra_refund_tops_up_a_partly_refilled_bucket(stage_module: ModuleType) -> None:
    check_refund_tops_up(stage_module, "gcra")


def check_refund_tops_up(stage_module: ModuleType, algo: Algo) -> None:
    __tracebackhide__ = True
    clock = ManualClock(START_NS)
    setup = Setup(algo, limit=4, rate=Fraction(1))
    limiter = setup.build(stage_module, clock)
    expect(limiter.try_acquire("alice", 4), D(True, 4, 0, 0, 4 * S_), f"{setup}: 4 of 4")
    clock.advance(1_500_000_000)  # 1.5 units have refilled since
    limiter.refund("alice", 1)
    expect(
        state_of(limiter, "alice", 4),
        D(False, 4, 2, None, 1_500_000_000),
        f"{setup}: empty at 0, 1.5 units refilled by 1.5 s, then refund('alice', 1): 2.5 "
        "units (remaining floors to 2), full 1.5 s later — a refund adds to the refilled level",
    )
    expect(
        limiter.peek("alice", 3),
        D(False, 4, 2, 500_000_000, 1_500_000_000),
        f"{setup}: 3 units need 0.5 s more",
    )
    clock.advance(500_000_000)
    expect(limiter.try_acquire("alice", 3), D(True, 4, 0, 0, 4 * S_), f"{setup}: 3 at 2 s")
    clock.advance(3 * S_)  # 3 units again
    limiter.refund("alice", 2)
    expect(
        state_of(limiter, "alice", 4),
        D(False, 4, 4, None, 0),
        f"{setup}: 3 units refilled, refund 2: capped at a full bucket of 4, fresh again",
    )
    expect(limiter.tracked_keys(), 0, f"{setup}: a full bucket is fresh: not tracked")


@core
@rule("refund-newest")
def test_stage1_sliding_log_refund_takes_back_the_newest_units(stage_module: ModuleType) -> None:
    clock = ManualClock(START_NS)
    log: SweepableLimiter = stage_module.SlidingLog(limit=3, window_ns=10 * S_, clock=clock)
    expect(log.try_acquire("alice").allowed, True, "t=0: 1 of 3")
    clock.advance(4 * S_)
    expect(log.try_acquire("alice", 2).allowed, True, "t=4 s: 3 of 3")
    log.refund("alice", 2)  # the request that cost 2 used nothing
    expect(
        log.peek("alice", 3),
        D(False, 3, 2, 6 * S_, 6 * S_),
        "t=4 s: refund('alice', 2) takes back the newest units, the 2 of t=4 s, as if that "
        "request had cost nothing: the unit of t=0 is left, so 3 fit once it leaves, in 6 s",
    )


@core
@rule("refund-newest", "refund-capped")
def test_stage1_sliding_log_refund_after_units_left_the_window(stage_module: ModuleType) -> None:
    clock = ManualClock(START_NS)
    log: SweepableLimiter = stage_module.SlidingLog(limit=2, window_ns=10 * S_, clock=clock)
    expect(log.try_acquire("alice"), D(True, 2, 1, 0, 10 * S_), "t=0: 1 of 2")
    clock.advance(5 * S_)
    expect(log.try_acquire("alice"), D(True, 2, 0, 0, 10 * S_), "t=5 s: 2 of 2")
    clock.advance(7 * S_)  # t=12 s: the unit of t=0 has left the window
    log.refund("alice", 2)
    expect(
        state_of(log, "alice", 2),
        D(False, 2, 2, None, 0),
        "t=12 s: refund('alice', 2) takes back only the unit still in the window (t=5 s); "
        "the one that left is gone already, so the log is empty — 2 of 2, never 3",
    )
    expect(log.try_acquire("alice", 2), D(True, 2, 0, 0, 10 * S_), "t=12 s: 2 fit, no more")
    expect(log.try_acquire("alice").allowed, False, "t=12 s: and a third does not")


@core
@rule("refund-newest", "half-open-window", "exact-retry", "reset-after", "tracked-keys")
def test_stage1_sliding_log_refund_keeps_the_admission_time_of_what_it_leaves(
    stage_module: ModuleType,
) -> None:
    """2 units taken at 0 and 3 at 4 s, then at 6 s a refund of 1 to 4 units: a part of
    the newest request, all of it, or all of it and a part of the one before. The units
    left count from their admission, exactly as if the requests had cost less: a twin
    charged the reduced costs decides alike, for every cost, at the refund's instant and
    1 ns before and at each instant a request's units leave the window."""
    setup = Setup("sliding_log", limit=5, window_ns=10 * S_)
    charges = [(0, 2), (4, 3)]  # (seconds, cost), oldest first
    for back in range(1, 5):
        a, ca, b, cb = twins(stage_module, setup)
        kept: list[tuple[int, int]] = []
        left = back
        for at_s, cost in reversed(charges):  # newest units first
            taken = min(left, cost)
            kept.insert(0, (at_s, cost - taken))
            left -= taken
        for limiter, clock, costs in ((a, ca, charges), (b, cb, kept)):
            for at_s, cost in costs:
                clock.set(START_NS + at_s * S_)
                if cost:
                    limiter.try_acquire("alice", cost)
        ca.set(START_NS + 6 * S_)
        a.refund("alice", back)
        story = (
            f"{setup}: try_acquire('alice', 2) at 0, try_acquire('alice', 3) at 4 s, "
            f"refund('alice', {back}) at 6 s; its twin was charged {kept} (s, cost) instead"
        )
        for at_ns in (6 * S_, 10 * S_ - 1, 10 * S_, 14 * S_ - 1, 14 * S_, 16 * S_):
            for clock in (ca, cb):
                clock.set(START_NS + at_ns)
            expect(
                [a.peek("alice", cost) for cost in range(1, setup.limit + 2)] + [a.tracked_keys()],
                [b.peek("alice", cost) for cost in range(1, setup.limit + 2)] + [b.tracked_keys()],
                f"{story}. At {at_ns / S_:g} s, peek('alice', 1..6) and tracked_keys() must "
                "be the twin's: the units the refund left keep their admission time",
            )
