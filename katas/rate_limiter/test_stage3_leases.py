"""Stage 3, leases: ``RedisConcurrencyLimiter`` — at most N requests in flight per key
across every node, one sorted set of leases per key on Redis (see
katas/rate_limiter/README.md; extended).

Runs on fakeredis by default, its server clock frozen and moved by ``redis_env.pass_time``,
so "expired at this microsecond" is exact; tests that need that skip on a real server.

Map: leases capped across nodes against a model (redis-leases) · one round trip a call
(redis-leases) · expiry, by time passing and at the exact microsecond, for try_acquire
and in_flight alike (redis-lease-expiry) · the set's TTL after every call covering its
latest live lease, rounded up to whole ms — leases of different expiries, time left not
a whole ms, server time stepping back between acquires — and each held lease counted up
to its own expiry (redis-lease-expiry, ttl-bound; exact on fakeredis, within a few ms
on a real server, where the step back skips).
"""

from __future__ import annotations

from types import ModuleType

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from katas._harness.marks import extended
from katas._harness.profiles import heavy_examples
from katas._harness.redis import RedisEnv
from katas._harness.story import Story, expect
from katas._runtime.clock import NS_PER_MS, NS_PER_US
from katas.rate_limiter._testing.nodes import KEYS, NODES, LeaseModel, check_lease_set_ttl
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
    stage_module: ModuleType,
    redis_env: RedisEnv,
    max_in_flight: int,
    lease_ns: int = 100 * NS_PER_MS,
) -> LeaseLimiter:
    """Leases (of 100 ms unless told) on a server clock that stands still until the test
    moves it."""
    if not redis_env.time_is_controlled:
        pytest.skip("needs the server clock under the test's control (fakeredis)")
    redis_env.freeze_time()
    limiter: LeaseLimiter = stage_module.RedisConcurrencyLimiter(
        redis_env.client(),
        max_in_flight=max_in_flight,
        lease_ns=lease_ns,
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


#: A lease of 300.25 ms: at the whole-ms instants these tests act at, no lease has a whole
#: number of ms left, so a TTL rounded to whole ms the wrong way shows.
ODD_LEASE_NS = 300_250 * NS_PER_US


def _lease_story(redis_env: RedisEnv, title: str) -> Story:
    """A story stamped with the server's TIME since now."""
    return Story(
        title,
        lambda: redis_env.server().time_us() * NS_PER_US,
        redis_env.server().time_us() * NS_PER_US,
    )


@pytest.mark.rule("redis-lease-expiry", "ttl-bound")
@extended
@pytest.mark.realtime
def test_stage3_lease_set_outlives_its_latest_lease_after_every_call(
    stage_module: ModuleType, redis_env: RedisEnv
) -> None:
    """Leases of different expiries, none with a whole number of ms left: after every
    call — try_acquire granted and denied, in_flight, release of the earliest lease, of
    the latest, and again — the set's TTL covers the latest lease still held, rounded up;
    and each held lease is still counted 1 µs before its own expiry (fakeredis)."""
    redis_env.freeze_time()
    prefix = redis_env.fresh_prefix()
    limiter: LeaseLimiter = stage_module.RedisConcurrencyLimiter(
        redis_env.client(), max_in_flight=3, lease_ns=ODD_LEASE_NS, key_prefix=prefix
    )
    story = _lease_story(redis_env, "max_in_flight=3, leases of 300.25 ms, on 'alice':")
    held: list[Lease] = []

    def late(*also: Lease) -> bool:
        """A real server's clock ran past a held lease's expiry: the outcome proves nothing."""
        now_ns = redis_env.server().time_us() * NS_PER_US
        expired = any(now_ns >= lease.expires_at_ns for lease in (*held, *also))
        return not redis_env.time_is_controlled and expired

    slowest_us = 0

    def judge(start_us: int) -> None:
        """The set's TTL after a call made from ``start_us`` (server TIME) on."""
        __tracebackhide__ = True
        nonlocal slowest_us
        slowest_us = max(slowest_us, redis_env.server().time_us() - start_us)
        check_lease_set_ttl(redis_env, story, prefix, held, slowest_us)

    def acquire(want: bool) -> Lease | None:
        __tracebackhide__ = True
        start_us = redis_env.server().time_us()
        lease = limiter.try_acquire("alice")
        story.add(f"try_acquire('alice') -> {lease}")
        story.check(
            (lease is not None) == want or late(),
            "redis-leases: at most 3 leases in flight",
            f"{len(held)} held: expected {'a lease' if want else 'None'}, got {lease}",
        )
        if lease is not None:
            held.append(lease)
        judge(start_us)
        return lease

    def release(lease: Lease, want: bool) -> None:
        __tracebackhide__ = True
        start_us = redis_env.server().time_us()
        got = limiter.release(lease)
        story.add(f"release({lease}) -> {got}")
        story.check(
            got is want or late(lease),
            "redis-leases: release is True only the first time, for a lease still held",
            f"expected {want}, got {got}",
        )
        if lease in held:
            held.remove(lease)
        judge(start_us)

    def count(want: int) -> None:
        __tracebackhide__ = True
        start_us = redis_env.server().time_us()
        got = limiter.in_flight("alice")
        story.add(f"in_flight('alice') -> {got}")
        story.check(
            got == want or late(),
            "redis-lease-expiry: a lease is counted until its own expiry",
            f"expected {want}, got {got}",
        )
        judge(start_us)

    first = acquire(True)
    redis_env.pass_time(20 * NS_PER_MS)
    acquire(True)
    redis_env.pass_time(20 * NS_PER_MS)
    acquire(True)
    acquire(False)  # full: denied
    redis_env.pass_time(20 * NS_PER_MS)
    count(3)
    assert first is not None
    release(first, True)  # the earliest: the two later ones still held
    redis_env.pass_time(20 * NS_PER_MS)
    last = acquire(True)
    assert last is not None
    redis_env.pass_time(20 * NS_PER_MS)
    release(last, True)  # the latest: the two earlier ones still held
    release(last, False)
    redis_env.pass_time(20 * NS_PER_MS)
    count(2)
    if not redis_env.time_is_controlled:
        return  # a real server's clock cannot be stopped 1 µs before an expiry
    for lease in list(held):  # expiring one after the other, with no call in between
        now_ns = redis_env.server().time_us() * NS_PER_US
        redis_env.pass_time(lease.expires_at_ns - now_ns - 1000)
        count(len(held))  # 1 µs before its expiry: still counted
        redis_env.pass_time(1000)
        held.remove(lease)
        count(len(held))


@pytest.mark.rule("redis-lease-expiry", "ttl-bound", "server-time")
@extended
def test_stage3_lease_set_outlives_its_leases_when_server_time_steps_back(
    stage_module: ModuleType, redis_env: RedisEnv
) -> None:
    """Server time steps back 50 ms between two acquires (a failover to a replica whose
    clock lags): the leases granted after it end before those granted before it, and the
    set's TTL must still cover the latest one, after every call."""
    limiter = _frozen_leases(stage_module, redis_env, max_in_flight=3, lease_ns=ODD_LEASE_NS)
    story = _lease_story(redis_env, "max_in_flight=3, leases of 300.25 ms, on 'alice':")
    held: list[Lease] = []

    def acquire() -> Lease:
        __tracebackhide__ = True
        lease = limiter.try_acquire("alice")
        story.add(f"try_acquire('alice') -> {lease}")
        story.check(lease is not None, "redis-leases: fewer than 3 held", f"got {lease}")
        assert lease is not None
        held.append(lease)
        check_lease_set_ttl(redis_env, story, redis_env.prefix, held)
        return lease

    def count() -> None:
        __tracebackhide__ = True
        got = limiter.in_flight("alice")
        now_ns = redis_env.server().time_us() * NS_PER_US
        live = sum(lease.expires_at_ns > now_ns for lease in held)
        story.add(f"in_flight('alice') -> {got}")
        story.expect(got, live, "redis-lease-expiry: a lease is counted until its own expiry")
        check_lease_set_ttl(redis_env, story, redis_env.prefix, held)

    first = acquire()
    redis_env.pass_time(20 * NS_PER_MS)
    second = acquire()  # the latest lease from here on
    redis_env.step_time_back(50 * NS_PER_MS)
    story.add("server time steps back 50 ms")
    count()
    acquire()  # ends 50 ms before the one before it
    released = limiter.release(first)  # neither the earliest nor the latest lease
    story.add(f"release({first}) -> {released}")
    story.expect(released, True, "redis-leases: release of a lease still held is True")
    held.remove(first)
    check_lease_set_ttl(redis_env, story, redis_env.prefix, held)
    redis_env.pass_time(20 * NS_PER_MS)
    acquire()
    now_ns = redis_env.server().time_us() * NS_PER_US
    redis_env.pass_time(second.expires_at_ns - now_ns - 1000)
    count()  # 1 µs before the latest lease's expiry: still counted
    redis_env.pass_time(1000)
    count()
