"""Stage 3, leases: ``RedisConcurrencyLimiter`` — at most N requests in flight per key
across every node, one sorted set of leases per key on Redis (see
katas/rate_limiter/README.md; extended).

Runs on fakeredis by default, its server clock frozen and moved by ``redis_env.pass_time``,
so "expired at this microsecond" is exact; tests that need that skip on a real server.

Map: leases capped across nodes against a model (redis-leases) · one round trip a call
(redis-leases) · expiry, by time passing and at the exact microsecond, for try_acquire
and in_flight alike (redis-lease-expiry).
"""

from __future__ import annotations

from types import ModuleType

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from katas._harness.marks import extended
from katas._harness.profiles import heavy_examples
from katas._harness.redis import RedisEnv
from katas._harness.story import expect
from katas._runtime.clock import NS_PER_MS
from katas.rate_limiter._testing.nodes import KEYS, NODES, LeaseModel
from katas.rate_limiter.api import NS_PER_S, Lease, LeaseLimiter

pytestmark = [pytest.mark.stage(3)]

# Tests that start servers run few examples; every test takes the redis_env fixture.
heavy = settings(
    max_examples=heavy_examples(),
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    deadline=None,
)


@pytest.mark.rule("redis-leases")
@extended
@heavy
@example(
    steps=[
        (0, "alice", True, 0),
        (1, "alice", True, 0),
        (2, "alice", True, 0),
        (0, "alice", False, 0),
    ]
)
@given(
    steps=st.lists(
        st.tuples(
            st.integers(0, NODES - 1), st.sampled_from(KEYS), st.booleans(), st.integers(0, 10)
        ),
        min_size=1,
        max_size=30,
    )
)
def test_stage3_concurrency_limiter_caps_leases_across_nodes(
    stage_module: ModuleType, redis_env: RedisEnv, steps: list[tuple[int, str, bool, int]]
) -> None:
    prefix = redis_env.fresh_prefix()
    nodes: list[LeaseLimiter] = [
        stage_module.RedisConcurrencyLimiter(
            client, max_in_flight=2, lease_ns=60 * NS_PER_S, key_prefix=prefix
        )
        for client in redis_env.clients(NODES)
    ]
    model = LeaseModel()
    leases: list[Lease] = []
    for node, key, acquire, pick in steps:
        held = model.held.setdefault(key, set())
        if acquire or not leases:
            lease = nodes[node].try_acquire(key)
            assert (lease is not None) == (len(held) < 2), (
                f"at most 2 leases on {key!r} across all nodes; held {len(held)}, got {lease}"
            )
            if lease is not None:
                assert lease.key == key and lease.id not in held, lease
                held.add(lease.id)
                leases.append(lease)
        else:
            lease = leases[pick % len(leases)]
            was_held = lease.id in model.held[lease.key]
            assert nodes[node].release(lease) is was_held, (
                f"release is idempotent: True the first time, then False ({lease})"
            )
            model.held[lease.key].discard(lease.id)
        for k in KEYS:
            assert nodes[node].in_flight(k) == len(model.held.get(k, ())), k


@pytest.mark.rule("redis-leases", "one-script-call")
@extended
def test_stage3_each_lease_call_is_one_round_trip(
    stage_module: ModuleType, redis_env: RedisEnv
) -> None:
    proxy = redis_env.proxy()
    limiter: LeaseLimiter = stage_module.RedisConcurrencyLimiter(
        redis_env.server().proxied_client(proxy),
        max_in_flight=1,
        lease_ns=60 * NS_PER_S,
        key_prefix=redis_env.prefix,
    )
    # connects (to alice's master, on a cluster) and loads each script once
    warm = limiter.try_acquire("alice")
    assert warm is not None
    limiter.in_flight("alice")
    limiter.release(warm)
    proxy.reset_counts()
    lease = limiter.try_acquire("alice")
    assert lease is not None
    limiter.try_acquire("alice")  # denied: the key is full
    limiter.in_flight("alice")
    limiter.release(lease)
    limiter.release(lease)  # again: False
    limiter.in_flight("alice")
    counts = proxy.counts()
    made = ["try_acquire", "try_acquire (denied)", "in_flight", "release", "release", "in_flight"]
    expect(
        counts.round_trips,
        len(made),
        f"one round trip per call, as a decision is: {made} must take {len(made)} round trips "
        f"(one script each: count, decide and write together); took {counts.commands}",
    )
    assert set(counts.commands) <= {"EVALSHA", "EVAL", "FCALL"}, counts.commands


@pytest.mark.rule("redis-lease-expiry")
@extended
@pytest.mark.realtime
def test_stage3_unreleased_lease_expires(stage_module: ModuleType, redis_env: RedisEnv) -> None:
    redis_env.freeze_time()
    # A real server's clock runs on while the test reads: a longer lease there, and a
    # check made after the lease's own expiry proves nothing, so it is not held against it.
    lease_ms = 100 if redis_env.time_is_controlled else 300
    prefix = redis_env.fresh_prefix()
    limiter: LeaseLimiter = stage_module.RedisConcurrencyLimiter(
        redis_env.client(), max_in_flight=1, lease_ns=lease_ms * NS_PER_MS, key_prefix=prefix
    )
    lost = limiter.try_acquire("alice")
    assert lost is not None
    second = limiter.try_acquire("alice")
    ttls = {name: redis_env.client().pttl(name) for name in redis_env.keys(prefix)}
    late = (
        not redis_env.time_is_controlled
        and redis_env.server().time_us() * 1000 >= lost.expires_at_ns
    )
    assert second is None or late, "1 in flight at most"
    for name, ttl in ttls.items():
        assert 0 < ttl <= lease_ms + 1_000 or (ttl == -2 and late), (
            f"{name}: TTL within lease + 1 s, got {ttl} ms"
        )
    redis_env.pass_time(lease_ms * 3 // 2 * NS_PER_MS)
    again = limiter.try_acquire("alice")
    assert again is not None, (
        "a lease whose holder vanished must expire after lease_ns, freeing its slot"
    )
    assert limiter.release(lost) is False, "the expired lease is no longer held"
    assert limiter.release(again) is True


@extended
@pytest.mark.rule("redis-lease-expiry")
def test_stage3_in_flight_reclaims_a_lease_at_its_expiry(
    stage_module: ModuleType, redis_env: RedisEnv
) -> None:
    limiter = _frozen_leases(stage_module, redis_env, max_in_flight=2)
    lease = limiter.try_acquire("alice")
    assert lease is not None
    start_ns = redis_env.server().time_us() * 1000
    assert lease.expires_at_ns == start_ns + 100 * NS_PER_MS, (
        f"expires_at_ns is the server's now + lease_ns: {lease}, server at {start_ns}"
    )
    redis_env.pass_time(lease.expires_at_ns - start_ns - 1000)  # 1 µs before it expires
    assert limiter.in_flight("alice") == 1, "the lease still holds 1 µs before expiry"
    redis_env.pass_time(1000)
    held = limiter.in_flight("alice")
    assert held == 0, (
        f"at expires_at_ns the lease is reclaimed, and in_flight() (with no "
        f"try_acquire in between) must not count it; got {held}"
    )


def _frozen_leases(
    stage_module: ModuleType, redis_env: RedisEnv, max_in_flight: int
) -> LeaseLimiter:
    """Leases of 100 ms on a server clock that stands still until the test moves it."""
    if not redis_env.time_is_controlled:
        pytest.skip("needs the server clock under the test's control (fakeredis)")
    redis_env.freeze_time()
    limiter: LeaseLimiter = stage_module.RedisConcurrencyLimiter(
        redis_env.client(),
        max_in_flight=max_in_flight,
        lease_ns=100 * NS_PER_MS,
        key_prefix=redis_env.prefix,
    )
    return limiter


@extended
@pytest.mark.rule("redis-lease-expiry")
def test_stage3_release_at_its_expiry_finds_the_lease_expired(
    stage_module: ModuleType, redis_env: RedisEnv
) -> None:
    """No call drops the lease before its release: the release itself must."""
    limiter = _frozen_leases(stage_module, redis_env, max_in_flight=2)
    late, early = limiter.try_acquire("alice"), limiter.try_acquire("alice")
    assert late is not None and early is not None
    start_ns = redis_env.server().time_us() * 1000
    redis_env.pass_time(early.expires_at_ns - start_ns - 1000)  # 1 µs before: still held
    expect(limiter.release(early), True, "release 1 µs before the lease's expires_at_ns")
    redis_env.pass_time(1000)  # exactly at expires_at_ns of both (granted at one instant)
    expect(
        limiter.release(late),
        False,
        "release at the lease's expires_at_ns, no call in between: the lease expired then "
        "and was no longer held (as in stage 2)",
    )


@extended
@pytest.mark.rule("redis-lease-expiry")
def test_stage3_try_acquire_reclaims_a_lease_at_its_expiry(
    stage_module: ModuleType, redis_env: RedisEnv
) -> None:
    limiter = _frozen_leases(stage_module, redis_env, max_in_flight=1)
    lost = limiter.try_acquire("alice")  # its holder crashes: never released
    assert lost is not None
    start_ns = redis_env.server().time_us() * 1000
    redis_env.pass_time(lost.expires_at_ns - start_ns - 1000)  # 1 µs before it expires
    expect(limiter.try_acquire("alice"), None, "max_in_flight=1: held 1 µs before its expiry")
    redis_env.pass_time(1000)
    again = limiter.try_acquire("alice")
    assert again is not None, (
        "max_in_flight=1; a lease granted for 100 ms and never released: at its "
        "expires_at_ns (server time) the slot comes back by itself — for try_acquire as for "
        "in_flight, which already counts 0 then — so try_acquire must grant a lease"
    )
    expect(limiter.in_flight("alice"), 1, "the new lease holds the slot")
    expect(limiter.release(lost), False, "the expired lease is no longer held")
    expect(limiter.release(again), True, "the new one is")
