"""Stage 3, faults: what a Redis limiter decides when Redis cannot (see
katas/rate_limiter/README.md, and the map in ``test_stage3.py``).

Redis is made unavailable through the harness's fault proxy, between one limiter's
client and the server: an outage (connections refused), ``BUSY`` replies, a blackhole
(the connection accepted, never answered); and, on a private server, ``SCRIPT FLUSH``
and a restart. Node time is a ``ManualClock`` the test sets, so "the next probe is due"
is exact to the nanosecond.

Map: refunds during an outage or a BUSY server (refund-outage, fallback-counted,
busy-unavailable) · failure modes and recovery (failure-modes, fallback-counted,
probe-interval, busy-unavailable) · peeks and impossible costs in every failure mode
(redis-peek, fallback-counted) · a closed denial's fields (failure-modes) · every call
skipping Redis until the probe a failure set is due (probe-interval) · the local share
and its refill (failure-modes) · resets Redis cannot take (redis-reset, probe-interval)
· what statistics() counts (fallback-counted) · a blackholed Redis (socket-timeout) ·
probes that fail, and a reply in flight across another call's failure (probe-interval) ·
script errors (script-error-raised) · SCRIPT FLUSH and restarts
(noscript-reload) · extended: the async limiter's unavailable replies, local resets,
and refunds and resets during an outage (async-redis, busy-unavailable, refund-outage,
redis-reset).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from types import ModuleType

import pytest
import redis

from katas._harness.faultproxy import UNAVAILABLE_REPLIES, FaultProxy
from katas._harness.interleave import Gate
from katas._harness.marks import core, extended, rule
from katas._harness.redis import RedisEnv, RedisNode
from katas._harness.story import Story, check, expect
from katas._harness.under_test import stage
from katas._harness.waiting import spawn
from katas.rate_limiter._testing.nodes import (
    ALGORITHMS,
    FaultTolerant,
    async_behind_a_proxy,
    async_behind_a_proxy_blocking,
    behind_a_proxy,
    flavour_behind_a_proxy,
    make_limiter,
)
from katas.rate_limiter._testing.replies import hold_after_reply
from katas.rate_limiter.api import (
    NS_PER_S,
    Decision,
    ManualClock,
    RedisLimiter,
    RedisLimiterStats,
    StampedDecision,
)

pytestmark = [pytest.mark.stage(3)]


@rule("busy-unavailable", "redis-reset", "fallback-counted", "cluster-down")
@core
@pytest.mark.parametrize("code", sorted(UNAVAILABLE_REPLIES))
def test_stage3_every_unavailable_reply_goes_to_the_failure_mode(
    stage_module: ModuleType, redis_env: RedisEnv, code: str
) -> None:
    """BUSY, LOADING, MASTERDOWN, TRYAGAIN, CLUSTERDOWN: a server that is up but cannot
    serve now (redis-py raises most as types of their own, the code cut from the text).
    A decision, a peek, a refund and a reset each go to the failure mode, counted."""
    skip_unless_a_proxy_can_answer(redis_env, code)
    check_every_call_takes_the_reply_as_unavailable(
        *behind_a_proxy(stage_module, redis_env, "closed"), code
    )


@rule("async-redis", "busy-unavailable", "redis-reset", "fallback-counted")
@extended
@pytest.mark.parametrize("code", sorted(UNAVAILABLE_REPLIES))
def test_stage3_async_every_unavailable_reply_goes_to_the_failure_mode(
    stage_module: ModuleType, redis_env: RedisEnv, code: str
) -> None:
    skip_unless_a_proxy_can_answer(redis_env, code)
    with async_behind_a_proxy_blocking(stage_module, redis_env, "closed") as (proxy, clock, lim):
        check_every_call_takes_the_reply_as_unavailable(proxy, clock, lim, code)


def skip_unless_a_proxy_can_answer(redis_env: RedisEnv, code: str) -> None:
    if code not in redis_env.refusals:
        pytest.skip(
            f"a cluster never answers its CLUSTER SLOTS with {code}, which a proxy refusing "
            "every command would; the real CLUSTERDOWN and TRYAGAIN are in -k cluster"
        )


def check_every_call_takes_the_reply_as_unavailable(
    proxy: FaultProxy, clock: ManualClock, limiter: FaultTolerant, code: str
) -> None:
    __tracebackhide__ = True
    assert limiter.try_acquire("alice").allowed, "Redis is up: 1 of 4"
    proxy.refuse(code)
    calls: list[tuple[str, Callable[[], object]]] = [
        ("try_acquire('alice')", lambda: limiter.try_acquire("alice")),
        ("try_acquire('alice') at once", lambda: limiter.try_acquire("alice")),
        ("peek('alice')", lambda: limiter.peek("alice")),
        ("refund('alice', 1)", lambda: limiter.refund("alice", 1)),
        ("reset('alice')", lambda: limiter.reset("alice")),
    ]
    for name, make in calls:
        if not name.endswith("at once"):  # else within the probe interval: Redis is skipped
            clock.advance(NS_PER_S)  # the probe is due: the call tries Redis
        try:
            make()
        except redis.RedisError as error:
            raise AssertionError(
                f"every command answered {code}: {name} raised {type(error).__name__}: "
                f"{error}. That reply is an unavailability (api.unavailable says so): the "
                "failure mode's, counted, never raised"
            ) from error
    expect(
        limiter.statistics(),
        RedisLimiterStats(1, 4, 4),
        f"every command answered {code}: try_acquire, then at once try_acquire again "
        "(within the probe interval the failure started: Redis skipped), then one probe "
        "interval apart peek, refund and reset. The two try_acquire, peek and refund fall "
        "back (4); every call that tried Redis, reset included, counts a Redis error (4)",
    )


@rule("refund-outage", "fallback-counted", "busy-unavailable")
@core
@pytest.mark.parametrize("fault", ["outage", "busy"])
@pytest.mark.parametrize("mode", ["open", "closed", "local"])
def test_stage3_refund_during_an_outage_is_counted_and_dropped_or_local(
    stage_module: ModuleType, redis_env: RedisEnv, mode: str, fault: str
) -> None:
    """``outage``: connections refused; ``busy``: every command answered ``BUSY``."""
    proxy, clock, limiter = behind_a_proxy(stage_module, redis_env, mode, expected_nodes=2)
    assert limiter.try_acquire("alice", 3).allowed, "Redis is up: 3 of 4"
    getattr(proxy, fault)()
    try:
        limiter.refund("alice", 3)
    except redis.RedisError as error:
        check(
            False,
            f"refund('alice', 3) with Redis unavailable ({fault}) raised {error!r}: a refund "
            "Redis cannot take is the failure mode's, like a decision — counted and dropped "
            "(or given to the local limiter), never raised (BUSY is an unavailability too)",
        )
    fallbacks = 1
    if mode == "local":
        local = [limiter.try_acquire("bob", 2), limiter.try_acquire("bob")]
        limiter.refund("bob", 1)
        local.append(limiter.try_acquire("bob"))
        fallbacks += 4
        assert [d.allowed for d in local] == [True, False, True], (
            f"in 'local' mode a refund Redis cannot take goes to the local limiter "
            f"(share 4 // 2 = 2): take 2, deny 1, refund 1, then 1 fits; got {local}"
        )
    stats = limiter.statistics()
    assert stats.fallback_decisions == fallbacks and stats.redis_errors >= 1, (
        f"a refund that cannot reach Redis is counted as a fallback: {stats}"
    )
    proxy.heal()
    clock.advance(NS_PER_S)  # the next probe is due
    back = limiter.peek("alice")
    assert isinstance(back, StampedDecision) and back.remaining == 0, (
        f"the refund made while Redis was down was dropped, not replayed: Redis "
        f"still holds 1 of 4, so peek(1) leaves 0; got {back}"
    )
    proxy.reset_counts()
    limiter.refund("alice", 1)  # Redis takes this refund, and nothing else
    trips = proxy.counts().round_trips
    later = limiter.peek("alice", 2)
    check(
        (trips, isinstance(later, StampedDecision), later.allowed, later.remaining)
        == (1, True, True, 0),
        f"failure_mode={mode!r}: 'alice' took 3 of 4; Redis down, refund('alice', 3) "
        "(dropped); Redis back, refund('alice', 1) — one round trip, and only that refund "
        "reaches Redis (the dropped one is never replayed later): 2 of 4 free, so "
        f"peek('alice', 2) fits with 0 left; got {trips} round trip(s) and {later}",
    )


@rule("failure-modes", "fallback-counted", "probe-interval", "busy-unavailable")
@core
@pytest.mark.parametrize("fault", ["outage", "busy"])
@pytest.mark.parametrize("mode", ["open", "closed", "local"])
def test_stage3_outage_honours_failure_mode_and_recovers(
    stage_module: ModuleType, redis_env: RedisEnv, mode: str, fault: str
) -> None:
    """``outage``: connections refused; ``busy``: every command answered ``BUSY`` (a long
    script runs on the server) — both an unavailability, for the failure mode."""
    proxy, clock, limiter = behind_a_proxy(stage_module, redis_env, mode, expected_nodes=2)
    assert isinstance(limiter.try_acquire("alice"), StampedDecision), "Redis is up"
    getattr(proxy, fault)()
    burst = [limiter.try_acquire("bob") for _ in range(5)]  # must not raise
    allowed = [d.allowed for d in burst]
    want = {"open": [True] * 5, "closed": [False] * 5, "local": [True, True, False, False, False]}
    assert allowed == want[mode], (
        f"with Redis unavailable ({fault}), failure_mode={mode!r} must decide {want[mode]} "
        f"for a burst of 5 (local: limit 4 // expected_nodes 2 = 2 on this node); got {allowed}"
    )
    assert not any(isinstance(d, StampedDecision) for d in burst), "Redis did not decide these"
    if mode == "closed":
        assert all(d.retry_after_ns is not None and d.retry_after_ns > 0 for d in burst), burst
    stats = limiter.statistics()
    assert isinstance(stats, RedisLimiterStats)
    assert (
        stats.fallback_decisions == 5 and stats.redis_decisions == 1 and stats.redis_errors >= 1
    ), f"every fallback decision is counted: {stats}"
    proxy.heal()
    clock.advance(NS_PER_S)  # the next probe is due
    back = limiter.try_acquire("alice")
    assert isinstance(back, StampedDecision) and back.allowed and back.remaining == 2, (
        f"once Redis answers again the limiter must use it, without a restart, and "
        f"with the state Redis kept (1 of 4 used before the outage); got {back}"
    )
    assert limiter.statistics().redis_decisions == 2, limiter.statistics()


@rule("failure-modes", "fallback-counted", "redis-peek", "async-redis")
@core
@pytest.mark.parametrize("flavour", ["sync", "async"])
@pytest.mark.parametrize("mode", ["open", "closed", "local"])
def test_stage3_a_peek_during_an_outage_changes_nothing_and_is_counted(
    stage_module: ModuleType, redis_env: RedisEnv, mode: str, flavour: str
) -> None:
    with flavour_behind_a_proxy(stage_module, redis_env, flavour, mode) as (proxy, _, limiter):
        check_a_peek_during_an_outage_changes_nothing(proxy, limiter, mode)


@rule("failure-modes", "async-redis")
@extended
@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_stage3_fail_open_admits_with_the_limit_minus_the_cost(
    stage_module: ModuleType, redis_env: RedisEnv, flavour: str
) -> None:
    with flavour_behind_a_proxy(stage_module, redis_env, flavour, "open") as (proxy, _, limiter):
        proxy.outage()
        got = [
            (d.allowed, d.remaining, d.reset_after_ns)
            for cost in (1, 3, 4)
            for d in (limiter.try_acquire("carol", cost), limiter.peek("carol", cost))
        ]
    want = [(True, 4 - cost, 0) for cost in (1, 3, 4) for _ in range(2)]
    expect(
        got, want,
        "failure_mode='open', limit 4, Redis down: try_acquire and peek of cost 1, 3 and 4 "
        "each admit with remaining = limit - cost and reset_after_ns 0 ((allowed, remaining, "
        "reset_after_ns) of each)",
    )  # fmt: skip


@rule("failure-modes", "probe-interval", "redis-peek", "async-redis")
@core
@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_stage3_fail_closed_denies_with_nothing_remaining_and_no_reset(
    stage_module: ModuleType, redis_env: RedisEnv, flavour: str
) -> None:
    """A closed denial says only when to come back: the time to the next probe. It tells
    of no quota (remaining 0) and of no state to wait out (reset_after_ns 0)."""
    with flavour_behind_a_proxy(stage_module, redis_env, flavour, "closed") as made:
        proxy, clock, limiter = made
        proxy.outage()
        story = Story(
            "failure_mode='closed', limit 4, probe_interval_ns 1 s, Redis down from t=+0:",
            clock.now_ns,
            clock.now_ns(),
        )
        rule_text = (
            "a 'closed' denial has remaining 0, retry_after_ns the time until Redis is next "
            "tried, reset_after_ns 0 — for try_acquire and peek, whatever the cost (a cost "
            "above the limit: retry_after_ns None)"
        )
        for at in (0, NS_PER_S // 4, NS_PER_S - 1):
            clock.set(story.origin_ns + at)
            for name in ("try_acquire", "peek"):
                for cost in (1, 3, 4, 5):
                    d: Decision = getattr(limiter, name)("carol", cost)
                    story.add(f"{name}('carol', {cost}) -> {d}")
                    retry = None if cost > 4 else NS_PER_S - at
                    story.check(
                        (d.allowed, d.limit, d.remaining, d.retry_after_ns, d.reset_after_ns)
                        == (False, 4, 0, retry, 0),
                        rule_text,
                        f"expected Decision(allowed=False, limit=4, remaining=0, "
                        f"retry_after_ns={retry}, reset_after_ns=0)",
                    )


def check_a_peek_during_an_outage_changes_nothing(
    proxy: FaultProxy, limiter: FaultTolerant, mode: str
) -> None:
    __tracebackhide__ = True
    assert isinstance(limiter.try_acquire("alice"), StampedDecision), "Redis is up"
    proxy.outage()
    peeks = [limiter.peek("bob").allowed for _ in range(3)]
    takes = [limiter.try_acquire("bob").allowed for _ in range(3)]
    want = {
        "open": ([True] * 3, [True] * 3),
        "closed": ([False] * 3, [False] * 3),
        "local": ([True] * 3, [True, True, False]),
    }
    expect(
        (peeks, takes),
        want[mode],
        f"failure_mode={mode!r}, Redis down: 3 peeks, then 3 try_acquire on 'bob' (local: "
        "share 4 // 2 = 2). A peek decides as try_acquire would and changes nothing, in the "
        "local limiter too: the peeks take nothing from the share",
    )
    stats = limiter.statistics()
    expect(
        (stats.redis_decisions, stats.fallback_decisions),
        (1, 6),
        f"failure_mode={mode!r}: every decision the failure mode makes is counted as a "
        f"fallback, a peek's as a try_acquire's (Redis decided 1, the failure mode 6); {stats}",
    )


@rule("redis-peek", "failure-modes", "fallback-counted")
@core
@pytest.mark.parametrize("mode", ["open", "closed", "local"])
def test_stage3_a_cost_above_the_limit_never_fits_in_any_failure_mode(
    stage_module: ModuleType, redis_env: RedisEnv, mode: str
) -> None:
    proxy, clock, limiter = behind_a_proxy(stage_module, redis_env, mode, expected_nodes=2)
    proxy.outage()
    # The first call tries Redis and fails; the next ones are made while Redis is skipped,
    # the last once the probe is due again (tried, and fails).
    for later_ns, name in ((0, "try_acquire"), (0, "peek"), (0, "try_acquire"), (NS_PER_S, "peek")):
        clock.advance(later_ns)
        d: Decision = getattr(limiter, name)("alice", 5)
        check(
            not d.allowed and d.retry_after_ns is None,
            f"failure_mode={mode!r}, Redis down: {name}('alice', 5) on a limit of 4 can never "
            f"fit, whatever decides it — denied with retry_after_ns None; got {d}",
        )
    expect(
        limiter.statistics(),
        RedisLimiterStats(0, 4, 2),
        f"failure_mode={mode!r}, Redis down: try_acquire('alice', 5) (Redis tried, fails), "
        "peek and try_acquire (Redis skipped), 1 s later peek (tried again, fails) — each on "
        "a limit of 4. The failure mode decided all four, impossible costs included: every "
        "fallback decision is counted",
    )


@rule("failure-modes")
@core
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_stage3_local_mode_allows_the_share_rounded_down_refilled_per_window(
    stage_module: ModuleType, redis_env: RedisEnv, algorithm: str
) -> None:
    window_s = 60
    for limit, nodes, share in ((10, 3, 3), (2, 3, 1)):
        proxy, clock, limiter = behind_a_proxy(
            stage_module,
            redis_env,
            "local",
            algorithm=algorithm,
            limit=limit,
            window_us=window_s * 1_000_000,
            expected_nodes=nodes,
        )
        proxy.outage()
        setting = (
            f"{algorithm}, limit {limit} per {window_s} s, expected_nodes={nodes}, Redis down, "
            f"failure_mode='local' (the node's share: max(1, {limit} // {nodes}) = {share})"
        )
        burst = [limiter.try_acquire("bob") for _ in range(share + 1)]
        expect(
            [d.allowed for d in burst],
            [True] * share + [False],
            f"{setting}: a burst of {share + 1} admits the share, rounded down — rounded up, "
            f"{nodes} nodes would admit more than {limit} between them",
        )
        # The share comes back as the algorithm gives it back, per window_ns, on the node's
        # clock: a unit every window/share (bucket), the window after the oldest unit
        # (log), the end of the clock's window (fixed window).
        window = window_s * NS_PER_S
        wait = {
            "token_bucket": window // share,
            "sliding_log": window,
            "fixed_window": window - clock.now_ns() % window,
        }[algorithm]
        expect(
            burst[-1].retry_after_ns,
            wait,
            f"{setting}: the local limiter runs {algorithm} at the share per window_ns, so the "
            f"denial's retry_after_ns is {wait / NS_PER_S:g} s",
        )
        clock.advance(wait - 1)
        expect(limiter.peek("bob").allowed, False, f"{setting}: 1 ns before the retry")
        clock.advance(1)
        expect(limiter.try_acquire("bob").allowed, True, f"{setting}: at the retry")


@rule("redis-reset", "probe-interval", "fallback-counted")
@core
def test_stage3_a_reset_redis_cannot_take_is_counted_and_starts_the_probe_interval(
    stage_module: ModuleType, redis_env: RedisEnv
) -> None:
    proxy, clock, limiter = behind_a_proxy(stage_module, redis_env, "closed")
    assert isinstance(limiter.try_acquire("alice", 4), StampedDecision), "Redis is up: 4 of 4"
    proxy.outage()
    try:
        limiter.reset("alice")
    except redis.RedisError as error:
        check(False, f"reset('alice') with Redis down raised {error!r}: it is best effort")
    expect(
        limiter.statistics(),
        RedisLimiterStats(1, 0, 1),
        "Redis up: try_acquire('alice', 4); Redis down: reset('alice'). The failed reset is "
        "counted as a Redis error, and not as a fallback decision (it decides nothing)",
    )
    skipped = limiter.try_acquire("alice")
    expect(
        (limiter.statistics().redis_errors, skipped.allowed, skipped.retry_after_ns),
        (1, False, NS_PER_S),
        "right after the failed reset, try_acquire('alice') in 'closed' mode: the reset's "
        "failure started the probe interval (1 s), so Redis is not tried (still 1 error) and "
        "the denial's retry_after_ns is the time to the next probe, 1 s",
    )
    proxy.heal()
    clock.advance(NS_PER_S)
    back = limiter.try_acquire("alice")
    check(
        isinstance(back, StampedDecision) and not back.allowed,
        "1 s after the failed reset Redis is probed and answers: the reset never reached it, "
        f"so 'alice' still holds 4 of 4 and is denied; got {back}",
    )


@rule("redis-reset", "failure-modes")
@core
def test_stage3_reset_in_local_mode_resets_the_local_limiter_too(
    stage_module: ModuleType, redis_env: RedisEnv
) -> None:
    proxy, clock, limiter = behind_a_proxy(stage_module, redis_env, "local", expected_nodes=2)
    check_a_reset_in_local_mode_resets_the_local_limiter(proxy, clock, limiter)


@rule("async-redis", "redis-reset", "failure-modes")
@extended
def test_stage3_async_reset_in_local_mode_resets_the_local_limiter_too(
    stage_module: ModuleType, redis_env: RedisEnv
) -> None:
    with async_behind_a_proxy_blocking(stage_module, redis_env, "local") as made:
        check_a_reset_in_local_mode_resets_the_local_limiter(*made)


def check_a_reset_in_local_mode_resets_the_local_limiter(
    proxy: FaultProxy, clock: ManualClock, limiter: FaultTolerant
) -> None:
    __tracebackhide__ = True
    proxy.outage()
    before = [limiter.try_acquire("bob").allowed for _ in range(3)]
    limiter.reset("bob")
    after = [limiter.try_acquire("bob").allowed for _ in range(3)]
    expect(
        (before, after),
        ([True, True, False], [True, True, False]),
        "Redis down, failure_mode='local' (share 4 // 2 = 2): a burst of 3 on 'bob', "
        "reset('bob'), another burst of 3 — the reset makes 'bob' fresh in the local "
        "limiter too, so the second burst admits the share again",
    )
    # Redis back: a reset it carries out resets the local limiter as well, so the local
    # usage left from this outage does not deny 'bob' in the next one.
    proxy.heal()
    clock.advance(NS_PER_S)  # the probe is due (the local share refills 1/30 unit meanwhile)
    errors = limiter.statistics().redis_errors
    limiter.reset("bob")
    expect(limiter.statistics().redis_errors, errors, "Redis is back: it takes reset('bob')")
    proxy.outage()
    again = [limiter.try_acquire("bob").allowed for _ in range(3)]
    expect(
        again,
        [True, True, False],
        "failure_mode='local' (share 4 // 2 = 2): Redis down, a burst of 3 on 'bob' left the "
        "local limiter denying it; Redis back, reset('bob') (Redis took it); Redis down again, "
        "a burst of 3 on 'bob' — a reset resets the key in the local limiter whether Redis "
        "takes it or not, so this burst admits the share again",
    )


@rule("fallback-counted")
@core
def test_stage3_statistics_count_every_decision_and_refund_redis_takes(
    stage_module: ModuleType, redis_env: RedisEnv
) -> None:
    limiter = make_limiter(
        stage_module, redis_env.client(), "token_bucket", 2, 60_000_000, key_prefix=redis_env.prefix
    )
    limiter.try_acquire("alice", 2)  # admitted
    limiter.try_acquire("alice")  # denied
    limiter.peek("alice")
    limiter.try_acquire("alice", 3)  # can never fit
    limiter.refund("alice", 1)
    limiter.refund("bob", 1)  # nothing to give back, but Redis took the call
    limiter.reset("alice")  # neither a decision nor a refund
    expect(
        limiter.statistics(),
        RedisLimiterStats(6, 0, 0),
        "Redis up: try_acquire (admitted), try_acquire (denied), peek, try_acquire (cost "
        "above the limit), refund, refund (a key with no state), reset: Redis took all 7 — "
        "a decision or a refund Redis takes counts as a Redis decision (6); a reset is "
        "neither, and counts nothing when Redis takes it",
    )


@rule("socket-timeout", "failure-modes")
@core
@pytest.mark.realtime
def test_stage3_blackholed_redis_does_not_hang_a_decision(
    stage_module: ModuleType, redis_env: RedisEnv
) -> None:
    proxy = redis_env.proxy()
    client = redis_env.server().proxied_client(proxy, socket_timeout=0.2)
    limiter = make_limiter(
        stage_module,
        client,
        "sliding_log",
        4,
        1_000_000,
        key_prefix=redis_env.prefix,
        failure_mode="open",
    )
    assert isinstance(limiter.try_acquire("alice"), StampedDecision)
    proxy.blackhole()
    got: list[Decision] = []
    t = threading.Thread(target=lambda: got.append(limiter.try_acquire("alice")), daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), (
        "Redis accepted the connection and never answered, and the decision hung: "
        "the client needs a socket timeout"
    )
    assert got and got[0].allowed and not isinstance(got[0], StampedDecision), got
    assert limiter.statistics().redis_errors == 1, limiter.statistics()


@core
@rule("probe-interval", "failure-modes", "fallback-counted")
def test_stage3_a_failed_probe_skips_redis_for_another_interval(
    stage_module: ModuleType, redis_env: RedisEnv
) -> None:
    proxy, clock, limiter = behind_a_proxy(stage_module, redis_env, "closed")
    assert isinstance(limiter.try_acquire("alice"), StampedDecision), "Redis is up"
    proxy.outage()
    story = Story("Redis went down at t=+0 (failure_mode='closed'):", clock.now_ns, clock.now_ns())
    probing = (
        "after a failure Redis is skipped for probe_interval_ns (1 s) from that failure, "
        "then probed; a probe that fails starts a new interval, and a 'closed' denial's "
        "retry_after_ns is the time until the next probe"
    )

    def step(at: int, *, tried: bool, retry: int | None) -> Decision:
        clock.set(story.origin_ns + at)
        errors = limiter.statistics().redis_errors
        d = limiter.try_acquire("alice")
        story.add(f"try_acquire('alice') -> {d}, {limiter.statistics()}")
        did_try = limiter.statistics().redis_errors > errors
        story.check(
            did_try == tried and (retry is None or d.retry_after_ns == retry),
            probing,
            f"at the last step Redis must{'' if tried else ' not'} be tried"
            + ("" if retry is None else f", with retry_after_ns={retry}"),
        )
        return d

    step(0, tried=True, retry=NS_PER_S)  # fails: the next probe is due at +1 s
    step(NS_PER_S - 1, tried=False, retry=1)
    step(NS_PER_S, tried=True, retry=NS_PER_S)  # the probe fails: next one at +2 s
    step(NS_PER_S + 1, tried=False, retry=NS_PER_S - 1)
    proxy.heal()
    d = step(2 * NS_PER_S - 1, tried=False, retry=1)  # healed, but not due yet
    assert not isinstance(d, StampedDecision), f"Redis was not due yet: {d}"
    clock.set(story.origin_ns + 2 * NS_PER_S)
    back = limiter.try_acquire("alice")
    story.check(
        isinstance(back, StampedDecision),
        probing,
        f"at +2 s the next probe is due and Redis answers: {back}",
    )
    stats = limiter.statistics()
    assert (stats.redis_decisions, stats.fallback_decisions, stats.redis_errors) == (2, 5, 2), (
        f"2 Redis decisions, 5 fallbacks, 2 Redis errors (two failed tries): {stats}"
    )


@core
@rule("probe-interval", "failure-modes")
def test_stage3_a_reply_in_flight_does_not_cut_short_a_later_failures_interval(
    stage_module: ModuleType, redis_env: RedisEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis answers one call, and before that call has its reply another call fails: the
    failure is the later news, so Redis is skipped for the full interval from it."""
    proxy, clock, limiter = behind_a_proxy(stage_module, redis_env, "closed")
    assert isinstance(limiter.try_acquire("alice"), StampedDecision), "Redis is up"
    gate = Gate("Redis has answered, the reply not yet handed back", limit=1)
    hold_after_reply(monkeypatch, gate, "in flight")
    first = spawn(lambda: limiter.try_acquire("alice"), "in flight")
    gate.wait_arrived()
    story = Story("failure_mode='closed', probe_interval_ns 1 s:", clock.now_ns, clock.now_ns())
    story.add("try_acquire('alice') in a thread: Redis has answered, the reply not yet returned")
    proxy.outage()
    failed = limiter.try_acquire("bob")
    story.add(f"Redis goes down; try_acquire('bob') -> {failed}, {limiter.statistics()}")
    gate.open()
    story.add(f"the reply returns: try_acquire('alice') -> {first.outcome('the held reply')}")
    probing = (
        "Redis is not tried again before failure + probe_interval_ns, and is tried at that "
        "instant: a reply to a call sent before the failure says nothing about Redis since"
    )
    for at in (0, NS_PER_S - 1, NS_PER_S):
        clock.set(story.origin_ns + at)
        before = limiter.statistics()
        d = limiter.try_acquire("carol")
        after = limiter.statistics()
        story.add(f"try_acquire('carol') -> {d}, {after}")
        tried = after.redis_errors > before.redis_errors or isinstance(d, StampedDecision)
        story.check(
            tried == (at == NS_PER_S),
            probing,
            f"at the last step Redis must{'' if at == NS_PER_S else ' not'} be tried "
            "(the failure's interval ends at +1 s)",
        )


@core
@rule("probe-interval", "refund-outage", "redis-reset", "failure-modes", "async-redis")
@pytest.mark.parametrize("failing", ["try_acquire", "peek", "refund", "reset"])
@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_stage3_any_failed_call_skips_redis_for_every_call_until_the_probe_is_due(
    stage_module: ModuleType, redis_env: RedisEnv, flavour: str, failing: str
) -> None:
    """Whichever call meets the failure — a decision, a peek, a refund or a reset — it
    starts the probe interval, and until the probe is due no call of any kind, on any
    key, tries Redis: a refund is skipped (and dropped) as a decision is."""
    with flavour_behind_a_proxy(stage_module, redis_env, flavour, "closed") as made:
        proxy, clock, limiter = made
        assert isinstance(limiter.try_acquire("alice"), StampedDecision), "Redis is up"
        proxy.outage()
        story = Story(
            f"{flavour}, failure_mode='closed', probe_interval_ns 1 s, Redis down from t=+0:",
            clock.now_ns,
            clock.now_ns(),
        )
        probing = (
            "any call that meets a failure (try_acquire, peek, refund, reset) starts the probe "
            "interval; within it Redis is tried by no call, refunds included, on any key; at "
            "failure + probe_interval_ns it is tried again, and a probe that fails starts "
            "another full interval"
        )
        calls: dict[str, Callable[[str], object]] = {
            "try_acquire": lambda key: limiter.try_acquire(key),
            "peek": lambda key: limiter.peek(key),
            "refund": lambda key: limiter.refund(key, 1),
            "reset": lambda key: limiter.reset(key),
        }

        def step(at: int, name: str, key: str, *, tried: bool) -> None:
            clock.set(story.origin_ns + at)
            errors = limiter.statistics().redis_errors
            got = calls[name](key)
            story.add(f"{name}({key!r}) -> {got}, {limiter.statistics()}")
            did_try = limiter.statistics().redis_errors > errors
            story.check(
                did_try == tried,
                probing,
                f"at the last step Redis must{'' if tried else ' not'} be tried",
            )
            if isinstance(got, Decision):
                due = NS_PER_S - at % NS_PER_S
                story.check(
                    got.retry_after_ns == due,
                    probing,
                    f"a 'closed' denial's retry_after_ns is the time to the next probe, {due}",
                )

        step(0, failing, "alice", tried=True)  # the failure: Redis skipped until +1 s
        for at, key in ((NS_PER_S // 2, "bob"), (NS_PER_S - 1, "alice")):
            for name in ("refund", "try_acquire", "peek", "refund"):
                step(at, name, key, tried=False)
        step(NS_PER_S, "refund", "bob", tried=True)  # the probe is due: tried, fails
        step(NS_PER_S + 1, "refund", "alice", tried=False)
        step(2 * NS_PER_S - 1, "try_acquire", "alice", tried=False)
        step(2 * NS_PER_S, "peek", "bob", tried=True)


@extended
@rule("failure-modes", "nodes-as-one")
@pytest.mark.parametrize("second", ["try_acquire", "peek", "refund"])
def test_stage3_threads_falling_back_locally_take_turns_in_the_local_limiter(
    stage_module: ModuleType, redis_env: RedisEnv, monkeypatch: pytest.MonkeyPatch, second: str
) -> None:
    # The local limiter is stage 1's TokenBucket, which is not thread-safe: one thread is
    # held inside it, and another thread's call must wait until it is out.
    bucket = stage(1).TokenBucket
    gate, inside, changed = Gate("inside the local limiter", limit=1), [0, 0], threading.Condition()

    def held(name: str) -> Callable[..., object]:
        original = getattr(bucket, name)

        def call(self: object, *args: object) -> object:
            with changed:
                inside[0] += 1
                inside[1] = max(inside[1], inside[0])
                changed.notify_all()
            try:
                gate.pass_through()
                return original(self, *args)
            finally:
                with changed:
                    inside[0] -= 1

        return call

    proxy, _, limiter = behind_a_proxy(stage_module, redis_env, "local", expected_nodes=2)
    proxy.outage()
    limiter.try_acquire("alice")  # Redis fails: from now on the local limiter decides
    for name in ("try_acquire", "peek", "refund"):
        monkeypatch.setattr(bucket, name, held(name))
    first = spawn(lambda: limiter.try_acquire("alice"), "first")
    gate.wait_arrived()
    other = spawn(lambda: getattr(limiter, second)("alice", 1), "second")
    with changed:
        changed.wait_for(lambda: inside[1] > 1, 0.2)
    gate.open()
    first.outcome("try_acquire, once let out of the local limiter")
    other.outcome(f"{second}, once the first call is out of the local limiter")
    check(
        inside[1] == 1,
        f"failure_mode='local', Redis down: one thread is inside the local (stage-1) limiter "
        f"in try_acquire('alice'), and another calls {second}('alice', 1). The stage-1 "
        f"limiter is not thread-safe, so calls into it take turns (under the limiter's lock): "
        f"expected at most 1 thread inside it at once; got {inside[1]}",
    )


@core
@rule("failure-modes", "probe-interval")
def test_stage3_a_closed_denial_says_retry_in_at_least_1_ns(
    stage_module: ModuleType, redis_env: RedisEnv
) -> None:
    proxy, _, limiter = behind_a_proxy(stage_module, redis_env, "closed", probe_interval_ns=0)
    proxy.outage()
    d = limiter.try_acquire("alice")
    check(
        (d.allowed, d.retry_after_ns) == (False, 1),
        "failure_mode='closed', probe_interval_ns=0, Redis down: try_acquire('alice') is "
        "denied, and its retry_after_ns is the time until Redis is next tried, at least 1 "
        f"ns (0 would read as 'go ahead'): expected a denial with retry_after_ns=1; got {d}",
    )


@core
@rule("script-error-raised")
@pytest.mark.parametrize("flavour", ["sync", "async"])
@pytest.mark.parametrize("mode", ["open", "closed", "local"])
def test_stage3_a_script_error_is_raised_not_sent_to_the_failure_mode(
    stage_module: ModuleType, redis_env: RedisEnv, mode: str, flavour: str
) -> None:
    admin = redis_env.client()
    with flavour_behind_a_proxy(stage_module, redis_env, flavour, mode) as (_, _, limiter):
        assert limiter.try_acquire("alice").allowed
        for name in redis_env.keys(redis_env.prefix):  # the wrong type: every script fails
            admin.delete(name)
            admin.rpush(name, "not a limiter's state")
        calls: list[tuple[str, Callable[[], object]]] = [
            ("try_acquire", lambda: limiter.try_acquire("alice")),
            ("peek", lambda: limiter.peek("alice")),
            ("refund", lambda: limiter.refund("alice", 1)),
        ]
        for name, make in calls:
            try:
                got = f"returned {make()!r}"
            except redis.ResponseError:
                continue
            except Exception as error:
                got = f"raised {type(error).__name__}: {error}"
            raise AssertionError(
                f"{flavour}, failure_mode={mode!r}: alice's key holds a list, so every script "
                f"fails with WRONGTYPE; {name} must raise that redis.ResponseError, it {got}"
            )
        stats = limiter.statistics()
        assert (stats.fallback_decisions, stats.redis_errors) == (0, 0), (
            f"{flavour}, failure_mode={mode!r}: a script error (here WRONGTYPE) is a bug, not "
            f"an outage: it is raised, and neither a fallback nor a Redis error; {stats}"
        )
        d = limiter.try_acquire("bob")
        assert isinstance(d, StampedDecision), (
            f"{flavour}, failure_mode={mode!r}: after a script error Redis is not skipped: "
            f"the next decision is Redis's, got {d}"
        )


def _decide_or_fail(limiter: RedisLimiter, key: str, what: str) -> Decision:
    try:
        return limiter.try_acquire(key)
    except redis.ResponseError as exc:
        pytest.fail(
            f"after {what} the limiter raised {exc!r}: a NOSCRIPT reply must "
            "reload the script (redis-py's Script does) and retry"
        )


@rule("noscript-reload")
@core
@pytest.mark.redis_faults
def test_stage3_script_flush_and_server_restart_are_survived(
    stage_module: ModuleType, redis_env: RedisEnv
) -> None:
    node: RedisNode = redis_env.fault_server()
    limiter = make_limiter(
        stage_module, node.client(), "token_bucket", 3, 10_000_000, key_prefix=redis_env.prefix
    )
    assert limiter.try_acquire("alice").allowed
    node.script_flush()
    d = _decide_or_fail(limiter, "alice", "SCRIPT FLUSH")
    assert isinstance(d, StampedDecision) and d.remaining == 1, (
        f"SCRIPT FLUSH loses the script, not the data: the 2nd of 3 leaves 1; got {d}"
    )
    node.restart()
    d = _decide_or_fail(limiter, "alice", "a server restart")
    assert isinstance(d, StampedDecision) and d.allowed and d.remaining == 2, (
        f"after a restart without persistence the key is fresh (3 of 3), and the "
        f"limiter reconnects and reloads its script by itself; got {d}"
    )
    assert limiter.statistics().fallback_decisions == 0, limiter.statistics()


@rule("async-redis", "refund-outage", "fallback-counted")
@extended
@pytest.mark.parametrize("mode", ["open", "closed", "local"])
def test_stage3_async_refund_redis_cannot_take_is_counted_and_dropped_or_local(
    stage_module: ModuleType, redis_env: RedisEnv, mode: str
) -> None:
    proxy, clock = redis_env.proxy(), ManualClock()

    async def main() -> tuple[list[Decision], RedisLimiterStats, Decision, Decision]:
        client, limiter = async_behind_a_proxy(stage_module, redis_env, proxy, clock, mode)
        try:
            assert (await limiter.try_acquire("alice", 3)).allowed, "Redis is up: 3 of 4"
            await limiter.refund("alice", 1)  # Redis takes it: 2 of 4 used
            proxy.outage()
            bob = [await limiter.try_acquire("bob", 2)]  # Redis tried, fails
            clock.advance(NS_PER_S)  # the next probe is due
            await limiter.refund("bob", 2)  # Redis tried again, fails
            bob.append(await limiter.try_acquire("bob", 2))  # Redis skipped
            await limiter.refund("alice", 2)  # Redis skipped: dropped
            stats = limiter.statistics()
            proxy.heal()
            clock.advance(NS_PER_S)
            if redis_env.mode == "cluster":
                # redis-py's async cluster client learns that the outage reset its idle
                # connection to alice's node only by using it: one more failure, and
                # one more probe interval, before that node answers again
                await limiter.peek("alice")
                clock.advance(NS_PER_S)
            alice = await limiter.peek("alice")
            await limiter.refund("alice", 1)  # Redis takes this one, and nothing else
            return bob, stats, alice, await limiter.peek("alice", 3)
        finally:
            await client.aclose()

    bob, stats, alice, later = asyncio.run(asyncio.wait_for(main(), 30))
    expect(
        stats,
        RedisLimiterStats(2, 4, 2),
        f"failure_mode={mode!r}: Redis up: try_acquire('alice', 3), refund('alice', 1); Redis "
        "down: try_acquire('bob', 2) (tried, fails); 1 s later refund('bob', 2) (tried, "
        "fails), try_acquire('bob', 2), refund('alice', 2) (both while Redis is skipped). A "
        "refund Redis cannot take — tried and failed, or skipped — is counted as a fallback",
    )
    if mode == "local":
        expect(
            [d.allowed for d in bob],
            [True, True],
            "in 'local' mode the refund Redis could not take goes to the local limiter (share "
            "4 // 2 = 2): take 2, refund 2, and 2 fit again",
        )
    check(
        isinstance(alice, StampedDecision) and alice.remaining == 1,
        "the refund('alice', 2) made while Redis was down was dropped, not replayed: Redis "
        f"still holds 2 of 4, so peek('alice') leaves 1; got {alice}",
    )
    check(
        isinstance(later, StampedDecision) and (later.allowed, later.remaining) == (True, 0),
        "then refund('alice', 1), which Redis takes: only that refund reaches Redis (those "
        "it missed are never replayed later), so 3 of 4 are free and peek('alice', 3) fits "
        f"with 0 left; got {later}",
    )


@rule("async-redis", "redis-reset", "probe-interval")
@extended
def test_stage3_async_reset_makes_the_key_fresh_or_counts_the_outage(
    stage_module: ModuleType, redis_env: RedisEnv
) -> None:
    proxy, clock = redis_env.proxy(), ManualClock()

    async def main() -> None:
        client, limiter = async_behind_a_proxy(stage_module, redis_env, proxy, clock, "closed")
        try:
            assert (await limiter.try_acquire("alice", 4)).allowed, "Redis is up: 4 of 4"
            await limiter.reset("alice")
            fresh = await limiter.try_acquire("alice")
            check(
                isinstance(fresh, StampedDecision)
                and (fresh.allowed, fresh.remaining, fresh.op) == (True, 3, 1),
                "Redis up: try_acquire('alice', 4), reset('alice'), try_acquire('alice'): the "
                "reset key decides as a fresh one — admitted, 3 of 4 left, op starting again "
                f"at 1; got {fresh}",
            )
            proxy.outage()
            await limiter.reset("alice")  # must not raise
            expect(
                limiter.statistics(),
                RedisLimiterStats(2, 0, 1),
                "then Redis down: reset('alice') is counted as a Redis error, not a fallback",
            )
            skipped = await limiter.try_acquire("alice")
            expect(
                (limiter.statistics().redis_errors, skipped.retry_after_ns),
                (1, NS_PER_S),
                "right after the failed reset Redis is skipped (the reset's failure started "
                "the probe interval): not tried, and 'closed' says retry in 1 s",
            )
        finally:
            await client.aclose()

    asyncio.run(asyncio.wait_for(main(), 30))
