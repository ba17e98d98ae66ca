"""Stage 3 — distributed: many limiter nodes sharing one Redis, with faults (see
katas/rate_limiter/README.md).

Core: ``RedisRateLimiter`` (one script call per decision, failure modes). Extended:
``AsyncRedisRateLimiter`` and ``RedisConcurrencyLimiter`` (leases across nodes).

Runs on fakeredis by default; ``KATA_REDIS_SERVER=redis-server`` runs it on private
real servers, ``KATA_REDIS_URL=redis://…`` on an external one (see katas/_harness/redis.py).

How exactness is checked: every decision Redis makes is stamped with the server time
(µs) and the key's operation counter, so one key's decisions sorted by
``(server_time_us, op)`` replay, in Redis's order, through one ideal limiter (stage 1's
exact models on the server's clock) and must come out the very same ``Decision``s. The
nodes, their operations and the replay are in :mod:`katas.rate_limiter._testing.nodes`.
Server time moves through ``redis_env.pass_time`` on fakeredis.

The stage's other suites: ``test_stage3_faults.py`` (``-k faults``): failure modes,
probes, socket timeouts, script errors, SCRIPT FLUSH and restarts, refunds, peeks and
resets during an outage (refund-outage, failure-modes, fallback-counted, probe-interval,
busy-unavailable, socket-timeout, script-error-raised, noscript-reload, redis-reset);
``test_stage3_leases.py`` (``-k leases``): ``RedisConcurrencyLimiter`` (redis-leases,
redis-lease-expiry).

Map of this file: examples — nodes sharing one bucket and one log (nodes-as-one,
unique-members), every unit of every request counted, requests of thousands of units
(unique-members, redis-algorithms), denials and impossible costs (redis-denial, redis-peek), the op
counter (stamped), refunds (redis-refund, refund-no-state), resets (redis-reset), the
Cluster hash tag (hash-tag), bad parameters (redis-bad-input, whole-us, lua-exact), a
key that holds its usage until the microsecond it is fresh (ttl-bound), server time
stepping back, after a denial too, and a key emptied while time is behind it (server-time,
redis-denial, ttl-bound) · properties — nodes decide as one (nodes-as-one,
stamped), node clocks skewed (server-time), TTLs (ttl-bound), one round trip a decision
(one-script-call) · the model test (namespaced) · extended — async nodes (async-redis),
clients refused without a socket timeout or with retries (socket-timeout,
no-client-retries).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace
from types import ModuleType

import pytest
import redis
import redis.asyncio
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from redis.crc import key_slot

from katas._harness.machines import machine_only
from katas._harness.marks import core, extended
from katas._harness.profiles import heavy_examples
from katas._harness.redis import RedisEnv
from katas._harness.story import check, expect
from katas._harness.walks import Walk, walked
from katas._runtime.clock import NS_PER_MS
from katas.rate_limiter._testing.nodes import (
    ALGORITHMS,
    KEYS,
    NODES,
    OPERATIONS,
    Call,
    Limits,
    Op,
    Record,
    ServerModel,
    burst_from_threads,
    call,
    hash_tag,
    make_limiter,
    make_nodes,
    plain,
    replay,
    run_stream,
    scenarios,
)
from katas.rate_limiter._testing.server_steps import Step, walk_server_steps
from katas.rate_limiter.api import (
    NS_PER_S,
    AsyncRedisLimiter,
    Decision,
    ManualClock,
    RedisLimiter,
    RedisLimiterStats,
    StampedDecision,
)

pytestmark = [pytest.mark.stage(3)]

# Tests that start servers run few examples; every test takes the redis_env fixture.
heavy = settings(
    max_examples=heavy_examples(),
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    deadline=None,
)


# --------------------------------------------------------------------------- examples


def fresh_node(
    stage: ModuleType, env: RedisEnv, algorithm: str, limit: int, window_us: int
) -> RedisLimiter:
    """One limiter on the shared server, under a key prefix no other test uses."""
    return make_limiter(
        stage, env.client(), algorithm, limit, window_us, key_prefix=env.fresh_prefix()
    )


@pytest.mark.rule("nodes-as-one", "redis-algorithms", "server-time")
@core
@pytest.mark.realtime
def test_stage3_two_nodes_share_one_token_bucket(
    stage_module: ModuleType, redis_env: RedisEnv
) -> None:
    """4 per second, shared: what node A takes, node B cannot; retry_after is exact."""
    redis_env.freeze_time()
    a, b = make_nodes(
        stage_module, redis_env, "token_bucket", 4, 1_000_000, prefix=redis_env.prefix
    )[:2]
    first = a.try_acquire("alice", 3)
    assert first.allowed and first.remaining == 1, f"a fresh bucket of 4 admits 3: {first}"
    assert b.try_acquire("alice").allowed, "node B sees the 1 token node A left"
    denied = b.try_acquire("alice")
    assert isinstance(first, StampedDecision) and isinstance(denied, StampedDecision)
    elapsed_us = denied.server_time_us - first.server_time_us
    # A token takes 250 ms to refill, and refilling began when node A left 1 of 4.
    assert not denied.allowed and denied.retry_after_ns == (250_000 - elapsed_us) * 1000, (
        f"the bucket is empty; one token refills 250 ms after node A's request, "
        f"{elapsed_us} µs of server time ago, so retry_after_ns must be "
        f"{(250_000 - elapsed_us) * 1000}; got {denied}"
    )
    redis_env.pass_time(denied.retry_after_ns)
    again = a.try_acquire("alice")
    assert again.allowed, (
        f"after waiting retry_after_ns={denied.retry_after_ns} the request must be "
        f"admitted (by any node), got {again}"
    )


@pytest.mark.rule("unique-members", "nodes-as-one")
@core
def test_stage3_same_instant_requests_all_count_in_the_sliding_log(
    stage_module: ModuleType, redis_env: RedisEnv
) -> None:
    """Three nodes, one instant: each request is its own log entry, so the 4th is denied."""
    redis_env.freeze_time()
    nodes = make_nodes(
        stage_module, redis_env, "sliding_log", 3, 10_000_000, prefix=redis_env.prefix
    )
    records = run_stream(redis_env, nodes, [Op(i % NODES, "alice", 1) for i in range(5)])
    allowed = [r.decision is not None and r.decision.allowed for r in records]
    if redis_env.time_is_controlled:
        assert allowed == [True, True, True, False, False], (
            "a sliding log of 3 must admit exactly 3 same-instant requests from 3 "
            f"nodes; got {allowed}. Are log members unique per request (not the timestamp)?"
        )
    replay(records, "sliding_log", 3, 10_000_000)


@pytest.mark.rule("unique-members", "nodes-as-one")
@core
def test_stage3_every_unit_of_every_request_counts_in_the_sliding_log(
    stage_module: ModuleType, redis_env: RedisEnv
) -> None:
    """A member per admitted unit, unique whatever the request's number and the unit's:
    request 1's 11th unit and request 11's 1st are two units (so are 1's 12th and 11's
    2nd). Fourteen requests, 38 units in one instant, then requests at the limit of 40."""
    redis_env.freeze_time()
    limit, window_us = 40, 60_000_000
    nodes = make_nodes(
        stage_module, redis_env, "sliding_log", limit, window_us, prefix=redis_env.fresh_prefix()
    )
    ops = [Op(0, "alice", 12), *(Op(i % NODES, "alice", 2) for i in range(1, 14))]
    ops += [Op(1, "alice", 3), Op(2, "alice", 2), Op(0, "alice", 1)]
    records = run_stream(redis_env, nodes, ops)
    if redis_env.time_is_controlled:
        expect(
            [r.decision is not None and r.decision.allowed for r in records[-3:]],
            [False, True, False],
            f"a sliding log of {limit}: one request of 12 units, then 13 of 2, all in one "
            "instant (38 units), then requests of 3, 2 and 1 — every unit of every request "
            "counts, so only the 2 fit. Is each log member unique per request and unit?",
        )
    replay(records, "sliding_log", limit, window_us)


@pytest.mark.rule("redis-algorithms", "redis-refund")
@core
def test_stage3_a_request_of_thousands_of_units_is_decided_like_any_other(
    stage_module: ModuleType, redis_env: RedisEnv
) -> None:
    """A tokens-per-hour limit charges thousands of units in one request. On a real
    Redis one Lua call can take only so many arguments: a sliding log that adds every
    unit in one command fails there. (On a real server the calls are not one instant: at
    12 000 an hour a token bucket refills a unit every 300 ms, more than a slow machine
    spends between them.)"""
    redis_env.freeze_time()
    limit, window_us = 12_000, 3_600_000_000
    for algorithm in ALGORITHMS:
        node = fresh_node(stage_module, redis_env, algorithm, limit, window_us)
        try:
            got = [node.try_acquire("alice", 5_000), node.try_acquire("alice", 5_000)]
            node.refund("alice", 4_000)
            got += [node.try_acquire("alice", 6_001), node.try_acquire("alice", 6_000)]
        except redis.ResponseError as error:
            check(
                False,
                f"{algorithm}, limit {limit} an hour: try_acquire('alice', 5000) twice, "
                f"refund('alice', 4000), try_acquire of 6001 then 6000 — each fits the limit, "
                f"and must be decided, not raise: {error!r}",
            )
        expect(
            [(d.allowed, d.remaining) for d in got],
            [(True, 7_000), (True, 2_000), (False, 6_000), (True, 0)],
            f"{algorithm}, limit {limit} an hour, one instant: take 5000 twice, refund 4000, "
            "then 6001 (denied) and 6000 (fits): (allowed, remaining) of each decision",
        )


@pytest.mark.rule("redis-denial")
@core
def test_stage3_denial_consumes_nothing(stage_module: ModuleType, redis_env: RedisEnv) -> None:
    """Denied requests leave the quota alone: retry_after counts down with server time."""
    for algorithm in ALGORITHMS:
        prefix = redis_env.fresh_prefix()
        nodes = make_nodes(stage_module, redis_env, algorithm, 2, 4_000_000, prefix=prefix)
        assert nodes[0].try_acquire("alice", 2).allowed, f"{algorithm}: a fresh key admits 2 of 2"
        denials = [nodes[i % NODES].try_acquire("alice") for i in range(6)]
        due = set()
        for d in denials:
            assert isinstance(d, StampedDecision) and d.retry_after_ns is not None, d
            assert not d.allowed, f"{algorithm}: the limit is used up, got {d}"
            due.add(d.server_time_us * 1000 + d.retry_after_ns)
        assert len(due) == 1, (
            f"{algorithm}: a denial must consume nothing, so every denial names the "
            f"same moment (server time + retry_after); got {sorted(due)}"
        )


@pytest.mark.rule("redis-peek")
@core
def test_stage3_cost_above_limit_never_fits(stage_module: ModuleType, redis_env: RedisEnv) -> None:
    for algorithm in ALGORITHMS:
        node = fresh_node(stage_module, redis_env, algorithm, 3, 1_000_000)
        d = node.try_acquire("alice", 4)
        assert not d.allowed and d.retry_after_ns is None, (
            f"{algorithm}: cost 4 > limit 3 can never fit: retry_after_ns is None, got {d}"
        )
        full = node.try_acquire("alice", 3)
        assert full.allowed, f"{algorithm}: the impossible request consumed quota: {full}"


@pytest.mark.rule("redis-refund", "refund-no-state")
@core
def test_stage3_refund_gives_back_unused_units_capped(
    stage_module: ModuleType, redis_env: RedisEnv
) -> None:
    """Tokens per hour: charge the estimate, refund what the call did not use — capped."""
    redis_env.freeze_time()
    for algorithm in ALGORITHMS:
        prefix = redis_env.fresh_prefix()
        a, b = make_nodes(stage_module, redis_env, algorithm, 10, 3_600_000_000, prefix=prefix)[:2]
        estimate = a.try_acquire("alice", 8)
        assert estimate.allowed and estimate.remaining == 2, f"{algorithm}: 8 of 10: {estimate}"
        b.refund("alice", 5)  # the call used 3 of the 8 estimated; any node may refund
        fits, too_many = a.peek("alice", 7), a.peek("alice", 8)
        assert fits.allowed and fits.remaining == 0 and not too_many.allowed, (
            f"{algorithm}, 10 per hour: 8 taken, 5 refunded, so exactly 7 are "
            f"available: peek(7) must be allowed with 0 remaining ({fits}), peek(8) denied "
            f"({too_many})"
        )
        b.refund("alice", 100)  # far more than was ever taken
        whole = a.peek("alice", 10)
        assert whole.allowed and whole.remaining == 0, (
            f"{algorithm}: a refund is capped at a fresh key's allowance — after "
            f"refunding 100 the key holds 10 of 10, no more; peek(10) gave {whole}"
        )
        assert a.try_acquire("alice", 10).allowed
        burst = a.try_acquire("alice")
        assert not burst.allowed, (
            f"{algorithm}: 10 of 10 were just taken, yet the 11th was admitted: "
            f"the over-refund lifted the key above its limit ({burst})"
        )
        b.refund("bob", 3)
        assert not [name for name in redis_env.keys(prefix) if "bob" in name], (
            f"{algorithm}: a refund for a key with no state (never seen, or "
            "expired) has nothing to give back and must write nothing"
        )
        assert a.peek("bob", 10).allowed


@pytest.mark.rule("redis-refund")
@core
@pytest.mark.realtime
def test_stage3_refund_takes_the_newest_units_out_of_the_sliding_log(
    stage_module: ModuleType, redis_env: RedisEnv
) -> None:
    redis_env.freeze_time()
    node = fresh_node(stage_module, redis_env, "sliding_log", 3, 1_000_000)
    old = node.try_acquire("alice")
    redis_env.pass_time(400 * NS_PER_MS)
    new = node.try_acquire("alice", 2)
    assert old.allowed and new.allowed and new.remaining == 0, (old, new)
    node.refund("alice", 2)  # the request that cost 2 used nothing
    d = node.peek("alice", 3)
    assert isinstance(old, StampedDecision) and isinstance(d, StampedDecision)
    leaves_us = old.server_time_us + 1_000_000 - d.server_time_us  # when the 1st unit leaves
    assert (d.allowed, d.remaining, d.retry_after_ns, d.reset_after_ns) == (
        False,
        2,
        leaves_us * 1000,
        leaves_us * 1000,
    ), (
        f"a sliding-log refund removes the newest units still in the window, as if "
        f"the request had cost less: only the unit from 400 ms earlier is left, so peek(3) "
        f"waits for it to leave in {leaves_us} µs (retry and reset); got {d}"
    )


@pytest.mark.rule("redis-refund")
@core
@pytest.mark.realtime
def test_stage3_refund_for_a_window_that_has_rolled_is_dropped(
    stage_module: ModuleType, redis_env: RedisEnv
) -> None:
    redis_env.freeze_time()
    node = fresh_node(stage_module, redis_env, "fixed_window", 3, 400_000)
    first = node.try_acquire("alice", 3)
    assert first.allowed and first.remaining == 0, first
    redis_env.pass_time(first.reset_after_ns)  # into the next window
    d = node.try_acquire("alice")
    assert d.allowed and d.remaining == 2, f"a new window starts empty: {d}"
    node.refund("alice", 3)  # for the previous window's request: its window is gone
    after = node.peek("alice", 3)
    assert after.allowed and after.remaining == 0, (
        f"the current window holds 1 unit, so a refund gives back at most that one "
        f"(the previous window's units left with it): 3 of 3 available, not more; got {after}"
    )
    assert node.try_acquire("bob", 3).allowed
    redis_env.pass_time(after.reset_after_ns)  # into the next window, with no call since
    node.refund("bob", 1)  # the first call of bob's new window: a refund for the old one
    fresh = node.peek("bob", 3)
    assert fresh.allowed and fresh.remaining == 0, (
        "bob took 3 of 3, then a new window began, and the first call in it was refund('bob', "
        "1) for the old window's request: the new window holds nothing, so nothing is given "
        f"back and nothing carried over — peek('bob', 3) must fit with 0 left; got {fresh}"
    )


@pytest.mark.rule("redis-peek")
@core
@pytest.mark.realtime
def test_stage3_peek_and_an_impossible_cost_write_nothing_with_units_to_tidy(
    stage_module: ModuleType, redis_env: RedisEnv
) -> None:
    """A unit has left the window but is still stored (the key lives on for a later one):
    peek and a cost above the limit still write nothing — a peek that tidied it away would
    lose it for good, though a server clock stepping back brings it into the window again."""
    redis_env.freeze_time()
    # On a real server the waits are slept: the second one is short, so a busy machine
    # that oversleeps it still finds the second unit in the window and its keys alive
    # (240 ms to spare), while oversleeping only takes the first unit further out.
    window_ms = 300
    first_wait_ms, second_wait_ms = window_ms * 9 // 10, window_ms * 2 // 10
    for algorithm in ALGORITHMS:
        prefix = redis_env.fresh_prefix()
        node = make_limiter(
            stage_module, redis_env.client(), algorithm, 3, window_ms * 1000, key_prefix=prefix
        )
        assert node.try_acquire("alice").allowed
        redis_env.pass_time(first_wait_ms * NS_PER_MS)
        assert node.try_acquire("alice").allowed  # keeps the keys alive a window more
        redis_env.pass_time(second_wait_ms * NS_PER_MS)  # the first unit has left
        before = redis_env.contents(prefix)
        calls = [node.peek("alice"), node.peek("alice", 3), node.try_acquire("alice", 4)]
        after = redis_env.contents(prefix)
        assert after == before, (
            f"{algorithm}: one unit left the window "
            f"{first_wait_ms + second_wait_ms - window_ms} ms ago, one is inside it; "
            f"peek('alice'), peek('alice', 3) and try_acquire('alice', 4) (a cost above the "
            f"limit of 3) must write nothing.\n  before {before}\n  after  {after}\n  ({calls})"
        )


@pytest.mark.rule("hash-tag")
@core
def test_stage3_keys_of_one_user_share_a_cluster_hash_slot(
    stage_module: ModuleType, redis_env: RedisEnv
) -> None:
    """Redis Cluster runs a script only if all its keys hash to one slot: use a hash tag."""
    prefix = redis_env.fresh_prefix()
    node = make_limiter(
        stage_module, redis_env.client(), "sliding_log", 3, 10_000_000, key_prefix=prefix
    )
    assert node.try_acquire("user42", 2).allowed
    names = redis_env.keys(prefix)
    assert len(names) == 2, f"a sliding log keeps a state key and a log key: {names}"
    tags = {name: hash_tag(name) for name in names}
    check(
        len(set(tags.values())) == 1 and "user42" in next(iter(tags.values())),
        f"both keys of user 'user42' must carry one hash tag holding the user key (e.g. "
        f"'rl:{{k:user42}}:m' and 'rl:{{k:user42}}:l') so Redis Cluster puts them in one slot, "
        f"and different users in different slots; the tags Cluster would hash are {tags}",
    )
    assert len({key_slot(name.encode()) for name in names}) == 1, names


@pytest.mark.rule("redis-bad-input", "whole-us", "lua-exact")
@core
def test_stage3_rejects_bad_parameters(stage_module: ModuleType, redis_env: RedisEnv) -> None:
    client = redis_env.client()
    good: dict[str, object] = {
        "algorithm": "token_bucket",
        "limit": 5,
        "window_ns": NS_PER_S,
        "clock": ManualClock(),
    }
    for name, bad in [
        ("limit", 0),
        ("window_ns", -1),
        ("window_ns", 1_500),
        ("algorithm", "leaky"),
        ("failure_mode", "maybe"),
        ("expected_nodes", 0),
        ("key_prefix", ""),
        ("probe_interval_ns", -1),
    ]:
        with pytest.raises(ValueError, match=name):
            stage_module.RedisRateLimiter(client, **{**good, name: bad})
            raise AssertionError(f"RedisRateLimiter({name}={bad!r}) was accepted")
    stage_module.RedisRateLimiter(client, **{**good, "probe_interval_ns": 0})  # Redis every call
    with pytest.raises(TypeError, match="limit"):
        stage_module.RedisRateLimiter(client, **{**good, "limit": True})
    leases: dict[str, object] = {"max_in_flight": 2, "lease_ns": NS_PER_S}
    for name, bad in [
        ("max_in_flight", 0),
        ("lease_ns", 0),
        ("lease_ns", 1_500_500),  # 1 500.5 µs: Redis TIME counts whole µs
        ("key_prefix", ""),
    ]:
        with pytest.raises(ValueError, match=name):
            stage_module.RedisConcurrencyLimiter(client, **{**leases, name: bad})
            raise AssertionError(f"RedisConcurrencyLimiter({name}={bad!r}) was accepted")
    # Lua's doubles: limit × window in µs must stay below 2^51 — at 2^51 it is refused.
    with pytest.raises(ValueError):
        stage_module.RedisRateLimiter(client, **{**good, "limit": 2**31, "window_ns": 2**20 * 1000})
    stage_module.RedisRateLimiter(client, **{**good, "limit": 1, "window_ns": (2**51 - 1) * 1000})
    limiter: RedisLimiter = stage_module.RedisRateLimiter(client, **good)
    calls: dict[str, Callable[[int], object]] = {
        "try_acquire": lambda cost: limiter.try_acquire("alice", cost),
        "peek": lambda cost: limiter.peek("alice", cost),
        "refund": lambda cost: limiter.refund("alice", cost),
    }
    for call_name, make in calls.items():
        for cost, error in ((0, ValueError), (-3, ValueError), (True, TypeError)):
            with pytest.raises(error, match="cost"):
                make(cost)
                raise AssertionError(f"{call_name}('alice', {cost!r}) was answered")


#: (call, key, cost, the key's op after it): a cost above the limit (2) and a peek count
#: nothing and write nothing; every try_acquire that can fit counts, denied or not; so
#: does a refund that finds the key's state (it returns no op: the next call shows it).
OP_STEPS: list[tuple[Call, str, int, int | None]] = [
    ("try_acquire", "bob", 3, 0),
    ("peek", "bob", 1, 0),
    ("try_acquire", "bob", 1, 1),
    ("try_acquire", "alice", 2, 1),
    ("try_acquire", "alice", 1, 2),
    ("try_acquire", "alice", 1, 3),
    ("peek", "alice", 1, 3),
    ("try_acquire", "alice", 3, 3),
    ("refund", "alice", 1, None),
    ("try_acquire", "alice", 1, 5),
]

#: Then, the server clock frozen: a refund of all 'alice' holds (her state stays until its
#: TTL runs out, 1 ms on), and one that finds her state with nothing left to give back —
#: it finds the state, so it bumps op all the same.
OP_STEPS_EMPTIED: list[tuple[Call, str, int, int | None]] = [
    ("refund", "alice", 2, None),
    ("refund", "alice", 1, None),
    ("try_acquire", "alice", 1, 8),
]


@pytest.mark.rule("stamped", "redis-peek", "redis-denial")
@core
def test_stage3_op_counts_each_try_acquire_that_can_fit_and_nothing_else(
    stage_module: ModuleType, redis_env: RedisEnv
) -> None:
    redis_env.freeze_time()
    for algorithm in ALGORITHMS:
        prefix = redis_env.fresh_prefix()
        node = make_limiter(
            stage_module, redis_env.client(), algorithm, 2, 10_000_000, key_prefix=prefix
        )
        done: list[str] = []
        frozen = redis_env.time_is_controlled  # a real server's 1 ms TTL may run out
        for what, key, cost, op in [*OP_STEPS, *(OP_STEPS_EMPTIED if frozen else [])]:
            d = call(node, Op(0, key, cost, what))
            done.append(f"{what}({key!r}, {cost})" + ("" if d is None else f" -> op {op}"))
            if d is None:
                continue
            check(
                isinstance(d, StampedDecision) and d.op == op,
                f"{algorithm}, limit 2: the op of each decision is the key's counter after it "
                "— bumped by every try_acquire whose cost can fit (denied ones too) and by a "
                "refund that finds the key's state; left alone by a peek and by a cost above "
                f"the limit. Expected:\n  " + "\n  ".join(done) + f"\ngot {d}",
            )
            if key == "bob" and op == 0:
                check(
                    not [name for name in redis_env.keys(prefix) if "bob" in name],
                    f"{algorithm}: {what}('bob', {cost}) on a key never seen wrote "
                    f"{redis_env.keys(prefix)}: a peek and a cost above the limit write nothing",
                )
        if redis_env.time_is_controlled:  # let the key expire: TTL <= time-to-fresh + 1 s
            redis_env.pass_time(node.peek("alice", 3).reset_after_ns + NS_PER_S + NS_PER_MS)
            again = node.try_acquire("alice")
            check(
                isinstance(again, StampedDecision) and again.op == 1,
                f"{algorithm}: once 'alice' has expired, op starts again at 1; got {again}",
            )


@pytest.mark.rule("redis-reset")
@core
def test_stage3_a_reset_key_decides_as_a_fresh_one(
    stage_module: ModuleType, redis_env: RedisEnv
) -> None:
    redis_env.freeze_time()
    for algorithm in ALGORITHMS:
        prefix = redis_env.fresh_prefix()
        node = make_limiter(
            stage_module, redis_env.client(), algorithm, 2, 10_000_000, key_prefix=prefix
        )
        assert node.try_acquire("alice", 2).allowed, f"{algorithm}: 2 of 2"
        assert not node.try_acquire("alice").allowed, f"{algorithm}: full"
        node.reset("alice")
        expect(
            redis_env.keys(prefix),
            [],
            f"{algorithm}: 'alice' took 2 of 2, then reset('alice'): every key the limiter "
            "wrote for 'alice' is deleted",
        )
        after, never = node.try_acquire("alice"), node.try_acquire("bob")
        if not redis_env.time_is_controlled:  # a real server's clock moves between the two
            after, never = (replace(d, reset_after_ns=0) for d in (after, never))
        check(
            isinstance(after, StampedDecision)
            and isinstance(never, StampedDecision)
            and (plain(after), after.op) == (plain(never), 1),
            f"{algorithm}: after reset('alice'), try_acquire('alice') decides as for 'bob', a "
            f"key never seen ({never}), its op starting again at 1; got {after}",
        )
        expect(node.statistics().fallback_decisions, 0, f"{algorithm}: Redis decided all")


@pytest.mark.rule("ttl-bound", "redis-algorithms")
@core
def test_stage3_a_key_holds_its_usage_until_the_microsecond_it_is_fresh(
    stage_module: ModuleType, redis_env: RedisEnv
) -> None:
    """Each key's time to fresh falls between two whole ms: its TTL, in whole ms, must be
    rounded up — rounded down, the key expires (and comes back fresh) while it still holds
    usage."""
    if not redis_env.time_is_controlled:
        pytest.skip("needs the server clock under the test's control (fakeredis)")
    redis_env.freeze_time()
    cases: dict[str, tuple[int, list[Op], str]] = {
        "token_bucket": (3, [Op(0, "alice", 1)], "take 1 (fresh in 16 666.7 µs)"),
        "fixed_window": (1, [Op(0, "alice", 1, gap_us=1_500)], "take 1, 1.5 ms into a window"),
        "sliding_log": (
            2,
            [Op(0, "alice", 1), Op(0, "alice", 1, gap_us=1_500), Op(0, "alice", 1, "refund")],
            "take 1, 1.5 ms later take 1 and refund 1",
        ),
    }
    window_us = 50_000
    for algorithm, (limit, ops, what) in cases.items():
        node = fresh_node(stage_module, redis_env, algorithm, limit, window_us)
        now_us = redis_env.server().time_us()
        redis_env.pass_time((window_us - now_us % window_us) * 1000)  # to a window's start
        run_stream(redis_env, [node], ops)
        fresh_ns = node.peek("alice", limit).reset_after_ns
        assert fresh_ns % NS_PER_MS, f"{algorithm}: the case must end between two whole ms"
        setting = f"{algorithm}, limit {limit} per 50 ms: {what}; fresh in {fresh_ns} ns"
        redis_env.pass_time(fresh_ns - 1000)
        early = node.peek("alice", limit)
        expect(
            (early.allowed, early.retry_after_ns),
            (False, 1000),
            f"{setting}. 1 µs before that the key still holds usage: peek('alice', {limit}) is "
            "denied, 1 µs to go — unless the key already expired: a TTL rounded down to whole "
            "ms (a key must never expire while it holds usage: TTL >= time-to-fresh)",
        )
        redis_env.pass_time(1000)
        expect(node.peek("alice", limit).allowed, True, f"{setting}: fresh at that instant")


#: (what, server time moved by, call, cost): the server clock steps back twice, as a
#: failover to a replica whose clock lags would step it.
STEPS_BACK: list[tuple[str, int, Call, int]] = [
    ("", 0, "try_acquire", 2),
    ("back 10 s", -10_000_000, "peek", 1),
    ("", 0, "try_acquire", 1),
    ("on 10.25 s", 10_250_000, "try_acquire", 1),
    ("on 0.25 s", 250_000, "try_acquire", 1),
    ("back 3 s", -3_000_000, "try_acquire", 2),
    ("on 4 s", 4_000_000, "try_acquire", 2),
]

#: Then, from 0.15 s into a window, two more steps back, each followed by several calls at
#: the earlier instant, then time moving on less than it stepped back: every write (a
#: refund's too) must keep the key's later time, or the next call is evaluated in the
#: past — an earlier window, units that have left the log, a refill for time not seen.
STEPS_BACK_AFTER_WRITES: list[tuple[str, int, Call, int]] = [
    ("", 0, "try_acquire", 1),
    ("on 0.9 s", 900_000, "try_acquire", 1),
    ("on 0.3 s", 300_000, "refund", 1),  # the log keeps a unit that has left the window
    ("back 1 s", -1_000_000, "refund", 1),
    ("", 0, "peek", 2),
    ("on 1 s", 1_000_000, "try_acquire", 1),
    ("back 1 s", -1_000_000, "try_acquire", 1),
    ("", 0, "try_acquire", 1),
    ("on 0.5 s", 500_000, "peek", 2),
]


@pytest.mark.rule("server-time", "redis-algorithms")
@core
def test_stage3_server_time_stepping_back_neither_mints_nor_burns(
    stage_module: ModuleType, redis_env: RedisEnv
) -> None:
    if not redis_env.time_is_controlled:
        pytest.skip("needs the server clock under the test's control (fakeredis)")
    redis_env.freeze_time()
    server = redis_env.server()
    for algorithm in ALGORITHMS:
        node = fresh_node(stage_module, redis_env, algorithm, 2, 1_000_000)
        model = ServerModel(algorithm, 2, 1_000_000)
        done: list[str] = []
        for steps in (STEPS_BACK, STEPS_BACK_AFTER_WRITES):
            if steps is STEPS_BACK_AFTER_WRITES:  # over 2 s on, to 0.15 s into a window
                redis_env.pass_time((3_150_000 - server.time_us() % 1_000_000) * 1000)
                done.append("[server time on to 0.15 s into a window, over 2 s later]")
            for moved, by_us, what, cost in steps:
                if by_us > 0:
                    redis_env.pass_time(by_us * 1000)
                elif by_us < 0:
                    redis_env.step_time_back(-by_us * 1000)
                d = call(node, Op(0, "alice", cost, what))
                stepped = f"[server time {moved}] " if moved else ""
                if d is None:  # a refund
                    model.refund("alice", cost, server.time_us())
                    done.append(f"{stepped}{what}('alice', {cost})")
                    continue
                assert isinstance(d, StampedDecision), d
                want = model.decide("alice", cost, server.time_us(), commit=what == "try_acquire")
                done.append(f"{stepped}{what}('alice', {cost}) -> {d}")
                expect(
                    plain(d),
                    want,
                    f"{algorithm}, limit 2 per 1 s, server TIME stepping back: each key is "
                    "evaluated at the later of TIME and its stored time, as in stage 1 — a "
                    "step back neither mints nor burns quota, and waits include the catch-up "
                    "(every write, a refund's too, keeps the later time):\n  "
                    + "\n  ".join(done[-12:]),
                )


#: Limit 3 per 1 s: a denial 0.5 s after the key was used, then TIME 0.4 s back.
DENIAL_THEN_STEP_BACK: list[Step] = [
    ("", 0, "try_acquire", 2),
    ("on 0.5 s", 500_000, "try_acquire", 3),  # denied
    ("back 0.4 s", -400_000, "try_acquire", 2),
    ("", 0, "try_acquire", 1),
    ("on 1 s", 1_000_000, "peek", 3),
]


@pytest.mark.rule("redis-denial", "server-time")
@core
def test_stage3_a_denial_leaves_the_key_time_where_it_was(
    stage_module: ModuleType, redis_env: RedisEnv
) -> None:
    """A denied try_acquire changes nothing but the op counter: the server clock stepping
    back afterwards finds the key as a peek would have left it."""
    if not redis_env.time_is_controlled:
        pytest.skip("steps the server clock back: only fakeredis's clock can be moved")
    redis_env.freeze_time()
    for algorithm in ALGORITHMS:
        node = fresh_node(stage_module, redis_env, algorithm, 3, 1_000_000)
        model = ServerModel(algorithm, 3, 1_000_000)
        walk = walk_server_steps(redis_env, node, model, DENIAL_THEN_STEP_BACK, "alice")
        for got, want, done in walk:
            expect(
                got,
                want,
                f"{algorithm}, limit 3 per 1 s: a denial consumes nothing, as in stage 1, "
                "where it changes nothing at all — not the key's stored time either. Evaluated "
                "at the denial's instant after TIME steps back, the key would refill (or stamp "
                "its next units) from a time it never reached:\n  " + "\n  ".join(done),
            )


#: Limit 2 per 1 s, from 0.1 s into a window: TIME 0.3 s back, the key emptied by a
#: refund while the clock is behind it, then on less than the catch-up.
EMPTIED_WHILE_BEHIND: list[Step] = [
    ("", 0, "try_acquire", 1),
    ("back 0.3 s", -300_000, "refund", 1),
    ("", 0, "peek", 3),  # above the limit: the key as it stands
    ("on 0.15 s", 150_000, "try_acquire", 2),
    ("on 1 s", 1_000_000, "peek", 2),
]


@pytest.mark.rule("ttl-bound", "server-time")
@core
def test_stage3_a_key_emptied_while_time_is_behind_it_waits_for_the_catch_up(
    stage_module: ModuleType, redis_env: RedisEnv
) -> None:
    """A key with no usage left is fresh only once TIME is back at its stored time: its
    reset_after includes the catch-up, and its TTL (the time to fresh) outlasts it."""
    if not redis_env.time_is_controlled:
        pytest.skip("steps the server clock back: only fakeredis's clock can be moved")
    redis_env.freeze_time()
    server = redis_env.server()
    for algorithm in ALGORITHMS:
        node = fresh_node(stage_module, redis_env, algorithm, 2, 1_000_000)
        model = ServerModel(algorithm, 2, 1_000_000)
        redis_env.pass_time((1_100_000 - server.time_us() % 1_000_000) * 1000)
        for got, want, done in walk_server_steps(
            redis_env, node, model, EMPTIED_WHILE_BEHIND, "alice"
        ):
            expect(
                got,
                want,
                f"{algorithm}, limit 2 per 1 s, 0.1 s into a window: a key is evaluated at the "
                "later of TIME and its stored time, so one left with no usage is not fresh "
                "before TIME catches up: reset_after includes the catch-up, and the key must "
                "not expire before then (TTL >= time to fresh) — expired, it is evaluated at "
                "the earlier TIME:\n  " + "\n  ".join(done),
            )


# --------------------------------------------------------------------------- properties


@pytest.mark.rule(
    "nodes-as-one", "redis-algorithms", "stamped", "redis-denial", "redis-peek", "redis-refund"
)
@core
@heavy
@example(
    scenario=("sliding_log", 2, 50_000, [Op(0, "alice", 1), Op(1, "alice", 2), Op(2, "alice", 1)])
)
@example(  # a denial, then a wait: was the denial charged?
    scenario=(
        "token_bucket",
        2,
        2_000_000,
        [Op(0, "alice", 2), Op(1, "alice", 1), Op(2, "alice", 1, gap_us=1_000_000)],
    )
)
@example(  # a refund larger than what the window holds
    scenario=(
        "fixed_window",
        3,
        2_000_000,
        [Op(0, "alice", 2), Op(1, "alice", 3, "refund"), Op(2, "alice", 3), Op(0, "alice", 1)],
    )
)
@example(  # the sliding log at the very instant a unit leaves its window (now - W, now]
    scenario=(
        "sliding_log",
        3,
        1_000_000,
        [
            Op(0, "alice", 1),
            Op(1, "alice", 1, gap_us=500_000),
            Op(2, "alice", 2, "peek", gap_us=499_999),
            Op(0, "alice", 2, "peek", gap_us=1),
            Op(1, "alice", 3),
        ],
    )
)
@example(  # a token-bucket refund after time passed: the refill up to it first
    scenario=(
        "token_bucket",
        4,
        4_000_000,
        [
            Op(0, "alice", 4),
            Op(1, "alice", 1, "refund", gap_us=1_500_000),
            Op(2, "alice", 3, "peek"),
            Op(0, "alice", 3, gap_us=500_000),
        ],
    )
)
@example(  # which units does a sliding-log refund take back?
    scenario=(
        "sliding_log",
        3,
        2_000_000,
        [
            Op(0, "alice", 1),
            Op(1, "alice", 2, gap_us=500_000),
            Op(2, "alice", 2, "refund"),
            Op(0, "alice", 3),
        ],
    )
)
@given(scenario=scenarios())
def test_stage3_nodes_sharing_redis_decide_as_one_node(
    stage_module: ModuleType, redis_env: RedisEnv, scenario: tuple[str, int, int, list[Op]]
) -> None:
    algorithm, limit, window_us, ops = scenario
    redis_env.freeze_time()
    nodes = make_nodes(
        stage_module, redis_env, algorithm, limit, window_us, prefix=redis_env.fresh_prefix()
    )
    replay(run_stream(redis_env, nodes, ops), algorithm, limit, window_us)


@pytest.mark.rule("server-time", "stamped")
@core
@heavy
@example(
    scenario=(
        "token_bucket",
        2,
        2_000_000,
        [Op(0, "alice", 1), Op(1, "alice", 1), Op(2, "alice", 1)],
    ),
    skews=[-10 * NS_PER_S, 0, 10 * NS_PER_S],
    steps=[NS_PER_S, -2 * NS_PER_S],
)
@example(  # the sliding log at its limit in one server instant, a cost above 1 included
    scenario=(
        "sliding_log",
        3,
        2_000_000,
        [Op(0, "alice", 2), Op(1, "alice", 1), Op(2, "alice", 1)],
    ),
    skews=[10 * NS_PER_S, -10 * NS_PER_S, 0],
    steps=[-NS_PER_S, 2 * NS_PER_S],
)
@given(
    scenario=scenarios(),
    skews=st.lists(
        st.sampled_from([-10 * NS_PER_S, 0, 10 * NS_PER_S]), min_size=NODES, max_size=NODES
    ),
    steps=st.lists(st.integers(-3 * NS_PER_S, 3 * NS_PER_S), min_size=1, max_size=5),
)
def test_stage3_node_clock_skew_changes_nothing(
    stage_module: ModuleType,
    redis_env: RedisEnv,
    scenario: tuple[str, int, int, list[Op]],
    skews: list[int],
    steps: list[int],
) -> None:
    """Node clocks ±10 s apart (and stepping about) must not move any decision."""
    algorithm, limit, window_us, ops = scenario
    redis_env.freeze_time()
    clocks = [ManualClock(100 * NS_PER_S + skew) for skew in skews]
    nodes = make_nodes(
        stage_module,
        redis_env,
        algorithm,
        limit,
        window_us,
        prefix=redis_env.fresh_prefix(),
        clocks=clocks,
    )
    records: list[Record] = []
    for i, op in enumerate(ops):
        clock = clocks[op.node]
        clock.set(clock.now_ns() + steps[i % len(steps)])  # forwards or backwards
        records += run_stream(redis_env, nodes, [op], bracket=True)
    replay(records, algorithm, limit, window_us)


@pytest.mark.rule("nodes-as-one")
@core
def test_stage3_concurrent_nodes_admit_exactly_as_one(
    stage_module: ModuleType, redis_env: RedisEnv
) -> None:
    """Threads on several nodes hammer one key; Redis order replays exactly."""
    redis_env.freeze_time()
    for algorithm in ALGORITHMS:
        nodes = make_nodes(
            stage_module, redis_env, algorithm, 10, 10_000_000, prefix=redis_env.fresh_prefix()
        )
        records = burst_from_threads(nodes, threads_per_node=2, each=15)
        admitted = sum(r.decision is not None and r.decision.allowed for r in records)
        if redis_env.time_is_controlled:
            assert admitted == 10, (
                f"{algorithm}: 90 concurrent requests from {NODES} nodes at one "
                f"instant on a limit of 10 must admit exactly 10, admitted {admitted}"
            )
        replay(records, algorithm, 10, 10_000_000)


@pytest.mark.rule("ttl-bound")
@core
@heavy
@example(scenario=("token_bucket", 4, 2_000_000, [Op(0, "alice", 1)]))
@example(
    scenario=("sliding_log", 2, 2_000_000, [Op(0, "alice", 2), Op(1, "alice", 1, gap_us=1_500_000)])
)
@example(scenario=("fixed_window", 2, 2_000_000, [Op(0, "alice", 1)]))
@example(
    scenario=(
        "sliding_log",
        2,
        2_000_000,
        [Op(0, "alice", 1), Op(1, "alice", 1, gap_us=1_500_000), Op(2, "alice", 1, "refund")],
    )
)
@example(scenario=("token_bucket", 1, 2_000_000, [Op(0, "alice", 1), Op(1, "alice", 1, "refund")]))
@example(scenario=("token_bucket", 2, 2_000_000, [Op(0, "alice", 1), Op(1, "alice", 1)]))
@example(scenario=("token_bucket", 3, 50_000, [Op(0, "alice", 1)]))
@example(
    scenario=("sliding_log", 2, 2_000_000, [Op(0, "alice", 1), Op(1, "alice", 1, gap_us=500_000)])
)
@given(scenario=scenarios())
def test_stage3_every_key_has_a_ttl_within_the_bound(
    stage_module: ModuleType, redis_env: RedisEnv, scenario: tuple[str, int, int, list[Op]]
) -> None:
    """0 < TTL ≤ time-to-fresh + 1 s for every key the limiter wrote, after every call.

    A refund shortens the time to fresh, so it must shorten the TTL too.
    """
    algorithm, limit, window_us, ops = scenario
    redis_env.freeze_time()
    prefix = redis_env.fresh_prefix()
    nodes = make_nodes(stage_module, redis_env, algorithm, limit, window_us, prefix=prefix)
    model = ServerModel(algorithm, limit, window_us)
    admin = redis_env.clients(1)[0]
    done: list[Op] = []
    for op in ops:
        (rec,) = run_stream(redis_env, nodes, [op])
        d = rec.decision
        if d is None:  # a refund: its time is read right after it (exact on fakeredis)
            now_us = redis_env.server().time_us()
            model.refund(op.key, op.cost, now_us)
        else:
            assert isinstance(d, StampedDecision), d
            now_us = d.server_time_us
            model.decide(op.key, op.cost, now_us, commit=op.call == "try_acquire")
        done.append(op)
        for name in redis_env.keys(prefix):
            owner = [k for k in KEYS if k in name[len(prefix) :]]
            assert owner, f"key {name!r} does not name the user key it limits"
            ttl_ms = admin.pttl(name)
            if ttl_ms == -2 and not redis_env.time_is_controlled:
                continue  # a real server's clock moved on and the key expired meanwhile
            fresh_us = model.time_to_fresh_us(owner[0], now_us)
            fresh_ms = -(-fresh_us // 1000)
            # PTTL -1: no TTL at all; 0: under 1 ms left (PTTL rounds down). With the
            # server clock frozen the TTL is exact: never below the time to fresh (which
            # PTTL, rounding down, shows as its whole ms).
            low = fresh_us // 1000 if redis_env.time_is_controlled else 0
            check(
                low <= ttl_ms <= fresh_ms + 1000,
                f"{algorithm}, limit={limit}, window={window_us} µs: every key "
                f"must expire once its state is fresh again, and not before: time-to-fresh "
                f"<= TTL <= time-to-fresh + 1 s. Key {name!r} has PTTL {ttl_ms} ms, "
                f"time-to-fresh {fresh_ms} ms, after {done} (-1 = no TTL: was it set in "
                "the same script? refreshed to a whole window? below: the key expires "
                "while it still holds usage, and comes back fresh)",
            )


@pytest.mark.rule("one-script-call")
@core
def test_stage3_each_decision_is_one_round_trip(
    stage_module: ModuleType, redis_env: RedisEnv
) -> None:
    proxy = redis_env.proxy()
    client = redis_env.server().proxied_client(proxy)
    for algorithm in ALGORITHMS:
        limiter = make_limiter(
            stage_module, client, algorithm, 2, 1_000_000, key_prefix=redis_env.fresh_prefix()
        )
        for key in KEYS[:2]:  # connects (to each key's node, on a cluster), loads the script
            limiter.peek(key)
        proxy.reset_counts()
        calls = ["try_acquire", "try_acquire", "try_acquire", "peek", "refund", "try_acquire"]
        for i, name in enumerate(calls):
            getattr(limiter, name)(KEYS[i % 2], 1)
        counts = proxy.counts()
        assert counts.round_trips == len(calls), (
            f"{algorithm}: each decision and each refund must be exactly one round "
            f"trip (one script call: read, decide, write and expire together); {calls} took "
            f"{counts.round_trips} round trips: {counts.commands}"
        )
        assert set(counts.commands) <= {"EVALSHA", "EVAL", "FCALL"}, counts.commands


# --------------------------------------------------------------------------- stateful


@OPERATIONS.machine()
class RedisLimiterMachine(RuleBasedStateMachine):
    """Several nodes, keys, peeks, time passing and script flushes against one model.

    Its rules are derived from :data:`OPERATIONS`, one a call, each drawing its operation
    (server time passing first) as the scenarios' lists do; ``script_flush`` is its own
    (``tests/test_model_drivers.py`` checks that no call goes unwalked)."""

    stage: ModuleType  # bound by the _bind_stage fixture

    def __init__(self) -> None:
        super().__init__()
        self.env = RedisEnv.from_environment(name="stage3-machine")
        self.env.freeze_time()
        self.log: list[str] = []
        self.refunds: dict[str, list[int]] = {}  # made since the key's last decision

    @initialize(algorithm=st.sampled_from(ALGORITHMS))
    def start(self, algorithm: str) -> None:
        self.algorithm, self.limit, self.window_us = algorithm, 3, 40_000
        self.model = ServerModel(algorithm, self.limit, self.window_us)
        self.nodes = make_nodes(
            self.stage, self.env, algorithm, self.limit, self.window_us, prefix=self.env.prefix
        )

    def teardown(self) -> None:
        self.env.close()

    def draws(self) -> Limits:
        """The scenarios' operations, on this machine's limit and window."""
        return Limits(self.limit, self.window_us)

    def apply(self, op: Op) -> None:
        """Run one operation as a scenario runs it; a decision must be the model's at once,
        a refund is given to the model just before the key's next decision."""
        if op.gap_us and self.env.time_is_controlled:
            self.log.append(f"pass {op.gap_us} µs")
        (record,) = run_stream(self.env, self.nodes, [op])
        self.log.append(f"node{op.node}.{op.call}({op.key!r}, {op.cost})")
        d = record.decision
        if d is None:
            self.refunds.setdefault(op.key, []).append(op.cost)
            return
        assert isinstance(d, StampedDecision), d
        for back in self.refunds.pop(op.key, []):  # at this decision's time: the same outcome
            self.model.refund(op.key, back, d.server_time_us)
        want = self.model.decide(op.key, op.cost, d.server_time_us, commit=op.call == "try_acquire")
        expect(
            plain(d),
            want,
            f"{self.algorithm}, limit 3 per {self.window_us} µs: the nodes decide as one "
            f"limiter would, after {self.log[-10:]}",
        )

    @machine_only("a fault: the scenarios run with Redis up and its scripts loaded")
    @precondition(lambda self: self.env.server().can_fault)
    @rule()
    def script_flush(self) -> None:
        self.env.server().script_flush()
        self.log.append("SCRIPT FLUSH")

    @invariant()
    def keys_are_namespaced(self) -> None:
        for name in self.env.keys(""):
            if not self.env.server().shared:  # a private server holds only this limiter's keys
                assert name.startswith(self.env.prefix), f"key {name!r} outside key_prefix"


@pytest.fixture
def _bind_stage(stage_module: ModuleType) -> None:
    RedisLimiterMachine.stage = stage_module


#: Before its random steps, the model test walks each algorithm to its limit at one
#: instant, from two nodes and with a cost above 1, then past it: every unit counts.
SAME_INSTANT_WALKS: dict[str, Walk] = {
    algorithm: [
        ("start", {"algorithm": algorithm}),
        *OPERATIONS.walk(
            RedisLimiterMachine,
            [
                Op(0, KEYS[0], 2),
                Op(1, KEYS[0], 1),
                Op(1, KEYS[0], 1, "peek"),
                Op(0, KEYS[0], 1),
                Op(1, KEYS[0], 1, "refund"),
                Op(0, KEYS[0], 1),
                Op(1, KEYS[0], 1),
            ],
        ),
    ]
    for algorithm in ALGORITHMS
}

TestStage3RedisLimiterModel = core(
    pytest.mark.rule("nodes-as-one", "redis-refund", "noscript-reload", "namespaced")(
        pytest.mark.usefixtures("_bind_stage")(walked(RedisLimiterMachine, SAME_INSTANT_WALKS))
    )
)
TestStage3RedisLimiterModel.settings = settings(heavy, stateful_step_count=30)


# --------------------------------------------------------------------------- extended


@pytest.mark.rule("async-redis")
@extended
def test_stage3_async_nodes_decide_as_one_with_sync_nodes(
    stage_module: ModuleType, redis_env: RedisEnv
) -> None:
    redis_env.freeze_time()
    calls: list[Call] = ["try_acquire", "try_acquire", "peek", "try_acquire", "refund"]
    ops = [Op(i % NODES, KEYS[i % 2], 1 + i % 3, calls[i % 5]) for i in range(24)]
    sync_node = make_limiter(
        stage_module, redis_env.client(), "sliding_log", 4, 5_000_000, key_prefix=redis_env.prefix
    )

    async def main() -> list[Record]:
        clients = [redis_env.async_client() for _ in range(NODES - 1)]
        nodes: list[AsyncRedisLimiter] = [
            stage_module.AsyncRedisRateLimiter(
                c,
                algorithm="sliding_log",
                limit=4,
                window_ns=5 * NS_PER_S,
                clock=ManualClock(),
                key_prefix=redis_env.prefix,
            )
            for c in clients
        ]
        records = []
        try:
            for op in ops:
                d: Decision | None = None
                if op.node == 0:
                    d = call(sync_node, op)
                else:
                    node = nodes[op.node - 1]
                    method = getattr(node, op.call)
                    d = await asyncio.wait_for(method(op.key, op.cost), 10)
                records.append(Record(op.node, op.key, op.cost, op.call, d))
        finally:
            for c in clients:
                await c.aclose()
        return records

    replay(asyncio.run(main()), "sliding_log", 4, 5_000_000)


@pytest.mark.rule("async-redis")
@extended
def test_stage3_async_outage_falls_back_and_recovers(
    stage_module: ModuleType, redis_env: RedisEnv
) -> None:
    proxy = redis_env.proxy()
    clock = ManualClock()

    async def main() -> tuple[list[Decision], RedisLimiterStats]:
        client = redis_env.server().proxied_async_client(proxy, socket_timeout=2)
        limiter: AsyncRedisLimiter = stage_module.AsyncRedisRateLimiter(
            client,
            algorithm="fixed_window",
            limit=2,
            window_ns=60 * NS_PER_S,
            clock=clock,
            key_prefix=redis_env.prefix,
            failure_mode="closed",
            probe_interval_ns=NS_PER_S,
        )
        try:
            out = [await asyncio.wait_for(limiter.try_acquire("alice"), 10)]
            proxy.outage()
            out.append(await asyncio.wait_for(limiter.try_acquire("alice"), 10))
            proxy.heal()
            clock.advance(NS_PER_S)
            out.append(await asyncio.wait_for(limiter.try_acquire("alice"), 10))
            return out, limiter.statistics()
        finally:
            await client.aclose()

    (up, down, back), stats = asyncio.run(main())
    assert isinstance(up, StampedDecision) and up.allowed, up
    assert not down.allowed and not isinstance(down, StampedDecision), (
        f"failure_mode='closed' denies while Redis is down (no exception); got {down}"
    )
    assert isinstance(back, StampedDecision) and back.allowed and back.remaining == 0, back
    assert (stats.redis_decisions, stats.fallback_decisions) == (2, 1), stats


@pytest.mark.rule("socket-timeout")
@extended
def test_stage3_client_without_socket_timeout_is_refused(
    stage_module: ModuleType, redis_env: RedisEnv
) -> None:
    with pytest.raises(ValueError, match="socket_timeout"):
        make_limiter(
            stage_module, redis_env.client(socket_timeout=None), "token_bucket", 1, 1_000_000
        )


@pytest.mark.rule("no-client-retries")
@extended
def test_stage3_a_client_that_retries_is_refused(stage_module: ModuleType) -> None:
    # redis-py's defaults retry; nothing is sent (the port is closed), the check comes first
    made: dict[str, Callable[[], object]] = {
        "RedisRateLimiter": lambda: make_limiter(
            stage_module, redis.Redis(port=1, socket_timeout=0.2), "token_bucket", 1, 1000
        ),
        "RedisConcurrencyLimiter": lambda: stage_module.RedisConcurrencyLimiter(
            redis.Redis(port=1, socket_timeout=0.2), max_in_flight=1, lease_ns=1_000_000
        ),
        "AsyncRedisRateLimiter": lambda: stage_module.AsyncRedisRateLimiter(
            redis.asyncio.Redis(port=1, socket_timeout=0.2),
            algorithm="token_bucket",
            limit=1,
            window_ns=1_000_000,
            clock=ManualClock(),
        ),
    }
    for name, make in made.items():
        with pytest.raises(ValueError, match="client") as refused:
            make()
        assert "retr" in str(refused.value), (
            f"{name} over a client with redis-py's default retries: the ValueError must say "
            f"the client retries (a lost reply would run the script twice); got {refused.value}"
        )
