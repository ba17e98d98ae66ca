"""Stage 3, faults: what a Redis limiter decides when Redis cannot (see
katas/rate_limiter/README.md, and the map in ``test_stage3.py``).

Redis is made unavailable through the harness's fault proxy, between one limiter's
client and the server: an outage (connections refused), ``BUSY`` replies, a blackhole
(the connection accepted, never answered); and, on a private server, ``SCRIPT FLUSH``
and a restart. Node time is a ``ManualClock`` the test sets, so "the next probe is due"
is exact to the nanosecond.

Map: refunds during an outage (refund-outage, fallback-counted) · failure modes and
recovery (failure-modes, fallback-counted, probe-interval, busy-unavailable) · a
blackholed Redis (socket-timeout) · probes that fail (probe-interval) · script errors
(script-error-raised) · SCRIPT FLUSH and restarts (noscript-reload).
"""

from __future__ import annotations

import threading
from types import ModuleType

import pytest
import redis

from katas._harness.faultproxy import FaultProxy
from katas._harness.marks import core, rule
from katas._harness.redis import RedisEnv, RedisNode
from katas._harness.story import Story
from katas.rate_limiter._testing.nodes import make_limiter
from katas.rate_limiter.api import (
    NS_PER_S,
    Decision,
    ManualClock,
    RedisLimiter,
    RedisLimiterStats,
    StampedDecision,
)

pytestmark = [pytest.mark.stage(3)]


def bucket_behind_a_proxy(
    stage: ModuleType, env: RedisEnv, failure_mode: str, *, expected_nodes: int = 1
) -> tuple[FaultProxy, ManualClock, RedisLimiter]:
    """A token bucket of 4 a minute whose client reaches Redis through a fault proxy, on a
    clock the test sets; after a failure it probes Redis again every second."""
    proxy = env.proxy()
    clock = ManualClock()
    limiter = make_limiter(
        stage,
        env.server().proxied_client(proxy, socket_timeout=2),
        "token_bucket",
        4,
        60_000_000,
        key_prefix=env.prefix,
        failure_mode=failure_mode,
        probe_interval_ns=NS_PER_S,
        clock=clock,
        expected_nodes=expected_nodes,
    )
    return proxy, clock, limiter


@rule("refund-outage", "fallback-counted")
@core
@pytest.mark.parametrize("mode", ["open", "closed", "local"])
def test_stage3_refund_during_an_outage_is_counted_and_dropped_or_local(
    stage_module: ModuleType, redis_env: RedisEnv, mode: str
) -> None:
    proxy, clock, limiter = bucket_behind_a_proxy(stage_module, redis_env, mode, expected_nodes=2)
    assert limiter.try_acquire("alice", 3).allowed, "Redis is up: 3 of 4"
    proxy.outage()
    limiter.refund("alice", 3)  # must not raise
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


@rule("failure-modes", "fallback-counted", "probe-interval", "busy-unavailable")
@core
@pytest.mark.parametrize("fault", ["outage", "busy"])
@pytest.mark.parametrize("mode", ["open", "closed", "local"])
def test_stage3_outage_honours_failure_mode_and_recovers(
    stage_module: ModuleType, redis_env: RedisEnv, mode: str, fault: str
) -> None:
    """``outage``: connections refused; ``busy``: every command answered ``BUSY`` (a long
    script runs on the server) — both an unavailability, for the failure mode."""
    proxy, clock, limiter = bucket_behind_a_proxy(stage_module, redis_env, mode, expected_nodes=2)
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
    proxy, clock, limiter = bucket_behind_a_proxy(stage_module, redis_env, "closed")
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
@rule("script-error-raised")
def test_stage3_a_script_error_is_raised_not_sent_to_the_failure_mode(
    stage_module: ModuleType, redis_env: RedisEnv
) -> None:
    admin = redis_env.client()
    for mode in ("open", "closed", "local"):
        prefix = redis_env.fresh_prefix()
        limiter = make_limiter(
            stage_module,
            redis_env.client(),
            "token_bucket",
            4,
            60_000_000,
            key_prefix=prefix,
            failure_mode=mode,
        )
        assert limiter.try_acquire("alice").allowed
        for name in redis_env.keys(prefix):  # a key of the wrong type: every script fails
            admin.delete(name)
            admin.rpush(name, "not a limiter's state")
        with pytest.raises(redis.ResponseError):
            limiter.try_acquire("alice")
        with pytest.raises(redis.ResponseError):
            limiter.peek("alice")
        with pytest.raises(redis.ResponseError):
            limiter.refund("alice", 1)
        stats = limiter.statistics()
        assert (stats.fallback_decisions, stats.redis_errors) == (0, 0), (
            f"failure_mode={mode!r}: a script error (here WRONGTYPE) is a bug, not "
            f"an outage: it is raised, and neither a fallback nor a Redis error; {stats}"
        )
        d = limiter.try_acquire("bob")
        assert isinstance(d, StampedDecision), (
            f"failure_mode={mode!r}: after a script error Redis is not skipped: the "
            f"next decision is Redis's, got {d}"
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
