"""Stage 3 on a Redis Cluster (see katas/rate_limiter/README.md, "On a Redis Cluster").

Map: any user key keeps its Redis keys in one slot (hash-tag; on every Redis, fakeredis
included) · on a real cluster of the test's own (``redis_cluster``: skipped unless
``KATA_REDIS_CLUSTER`` or ``KATA_REDIS_SERVER`` names a ``redis-server``) — a cluster
client is accepted, a retrying one refused (cluster-client) · a key's slot moved, step
by step, between its decisions, and a refund that empties the sliding log while its
slot moves (cluster-reshard) · one master killed: only its keys go to the failure mode,
and each master's own probe interval behind a proxy of its own, sync and async
(node-outage) · a master answering BUSY: the interval of the master a key is sent to, and a
reset that meets it (node-outage, redis-reset) · the cluster in ``fail`` state: every
call goes to the failure mode, none raises (cluster-down).

The whole stage-3 suite runs on a shared cluster with ``KATA_REDIS_CLUSTER=redis-server``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from types import ModuleType

import pytest
import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.crc import key_slot

from katas._harness.marks import core, extended, rule
from katas._harness.redis import ProcessNode, RedisEnv
from katas._harness.redis_cluster import ClusterNode, LocalCluster
from katas._harness.redis_fixture import cluster_command
from katas._harness.story import check, expect
from katas.rate_limiter._testing.nodes import (
    ALGORITHMS,
    Blocking,
    FaultTolerant,
    Op,
    Record,
    call,
    make_limiter,
    replay,
)
from katas.rate_limiter.api import (
    NS_PER_S,
    Decision,
    ManualClock,
    RedisLimiter,
    RedisLimiterStats,
    StampedDecision,
)

pytestmark = [pytest.mark.stage(3)]

#: User keys that break a naive tag: ``rl:{<key>}`` hashes an empty tag for "" and "}…"
#: (then Cluster hashes each whole name, and a key's two Redis keys land apart).
TAG_BREAKERS = ["user42", "", "}", "}x", "a}b", "{", "{}", "{x}", "k:", "日本"]
LIMIT = 3
WINDOW_US = 60_000_000


@pytest.fixture(autouse=True)
def _implemented_first(stage_module: ModuleType) -> None:
    """A stub fails here as not implemented yet, before a test asks for a cluster (which
    a plain install does not have)."""
    with RedisEnv(name="smoke") as env:
        make_limiter(stage_module, env.client(), "token_bucket", 1, 1_000_000).peek("smoke")


def _slots(names: Sequence[str]) -> set[int]:
    return {key_slot(name.encode()) for name in names}


@rule("hash-tag")
@core
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_stage3_any_user_key_keeps_its_redis_keys_in_one_slot(
    stage_module: ModuleType, redis_env: RedisEnv, algorithm: str
) -> None:
    """Whatever the user key, every Redis key it is kept under hashes to one slot, so on a
    Cluster its script runs (no CROSSSLOT) and decides on Redis."""
    seen: dict[str, list[str]] = {}
    for user_key in TAG_BREAKERS:
        prefix = redis_env.fresh_prefix()
        limiter = make_limiter(
            stage_module, redis_env.client(), algorithm, LIMIT, WINDOW_US, key_prefix=prefix
        )
        decision = limiter.try_acquire(user_key, 2)
        check(
            isinstance(decision, StampedDecision) and decision.allowed,
            f"{algorithm}: try_acquire({user_key!r}, 2) on a fresh key is decided by Redis "
            f"(any str is a user key); got {decision}",
        )
        names = redis_env.keys(prefix)
        seen[user_key] = [name[len(prefix) :] for name in names]  # what follows the prefix
        check(
            len(_slots(names)) == 1,
            f"{algorithm}: user key {user_key!r} is kept under {names}, which Redis Cluster "
            f"hashes to slots {sorted(_slots(names))}: a script may only touch one slot. A hash "
            "tag the key cannot break (never empty, whatever the key holds) keeps them together",
        )
    layouts = {tuple(names) for names in seen.values()}
    check(
        len(layouts) == len(TAG_BREAKERS),
        f"{algorithm}: two user keys must never share a Redis key; their keys were {seen}",
    )


# --- on a real cluster of the test's own ---------------------------------------------------


@rule("cluster-client", "no-client-retries")
@core
def test_stage3_a_cluster_client_is_accepted_and_a_retrying_one_refused(
    stage_module: ModuleType, redis_cluster: LocalCluster
) -> None:
    host, port = redis_cluster.addresses()[0].split(":")
    retrying = RedisCluster(host=host, port=int(port), socket_timeout=2)  # redis-py retries 3x
    try:
        with pytest.raises(ValueError, match="client"):
            make_limiter(stage_module, retrying, "sliding_log", LIMIT, WINDOW_US)
    finally:
        retrying.close()
    limiter = make_limiter(stage_module, redis_cluster.client(), "sliding_log", LIMIT, WINDOW_US)
    decision = limiter.try_acquire("alice")
    check(
        isinstance(decision, StampedDecision) and decision.allowed,
        "a RedisCluster with a socket timeout and retry=Retry(NoBackoff(), 0) is accepted "
        f"where a redis.Redis is, and decides on Redis; got {decision}",
    )


@rule("cluster-client", "no-client-retries")
@extended
def test_stage3_the_lease_and_async_limiters_take_a_cluster_client_and_refuse_a_retrying_one(
    stage_module: ModuleType, redis_cluster: LocalCluster
) -> None:
    import redis.asyncio.cluster
    import redis.asyncio.retry

    host, port = redis_cluster.addresses()[0].split(":")
    retrying = RedisCluster(host=host, port=int(port), socket_timeout=2)
    try:
        with pytest.raises(ValueError, match="client"):
            stage_module.RedisConcurrencyLimiter(retrying, max_in_flight=1, lease_ns=NS_PER_S)
    finally:
        retrying.close()
    leases = stage_module.RedisConcurrencyLimiter(
        redis_cluster.client(), max_in_flight=1, lease_ns=NS_PER_S
    )
    lease = leases.try_acquire("")  # the empty key too
    check(lease is not None, "RedisConcurrencyLimiter on a cluster client grants a free lease")
    async_retrying = redis.asyncio.cluster.RedisCluster(host=host, port=int(port), socket_timeout=2)
    with pytest.raises(ValueError, match="client"):
        stage_module.AsyncRedisRateLimiter(
            async_retrying,
            algorithm="token_bucket",
            limit=LIMIT,
            window_ns=WINDOW_US * 1000,
            clock=ManualClock(),
        )
    async_ok = redis.asyncio.cluster.RedisCluster(
        host=host, port=int(port), socket_timeout=2, retry=redis.asyncio.retry.Retry(NoBackoff(), 0)
    )
    stage_module.AsyncRedisRateLimiter(
        async_ok, algorithm="token_bucket", limit=LIMIT, window_ns=WINDOW_US, clock=ManualClock()
    )


class Reshard:
    """A limiter on a cluster client and the calls made on it: which Redis took (its
    statistics say so) and which fell back; after a fallback the probe is due again."""

    def __init__(self, stage: ModuleType, cluster: LocalCluster, algorithm: str) -> None:
        self.clock, self.prefix, self.algorithm = ManualClock(), "rl-reshard:", algorithm
        self.limiter = make_limiter(
            stage,
            cluster.client(),
            algorithm,
            LIMIT,
            WINDOW_US,
            key_prefix=self.prefix,
            failure_mode="closed",
            probe_interval_ns=NS_PER_S,
            clock=self.clock,
        )
        self.records: list[Record] = []
        self.taken: list[bool] = []
        self.steps: list[str] = []

    def run(self, *ops: Op, probe: bool = True) -> bool:
        """Make ``ops``; whether Redis took the last one. After a fallback the clock moves
        to the next probe, unless ``probe`` is False."""
        took = False
        for op in ops:
            before = self.limiter.statistics().redis_decisions
            d = call(self.limiter, op)
            took = self.limiter.statistics().redis_decisions == before + 1
            self.steps.append(f"  {op.call}({op.key!r}, {op.cost}) -> {d or ''}")
            self.steps[-1] += "" if took else " (failure mode)"
            self.records.append(Record(0, op.key, op.cost, op.call, d))
            self.taken.append(took)
            check(
                op.call == "refund" or took == isinstance(d, StampedDecision),
                f"{self.algorithm}: a decision is stamped exactly when Redis made it; the "
                "calls:\n" + self.story(),
            )
            if not took and probe:
                self.clock.advance(NS_PER_S)  # the next call probes again
        return took

    def mark(self, text: str) -> None:
        self.steps.append(text)

    def story(self) -> str:
        return "\n".join(self.steps)

    def replay(self) -> None:
        """Every call Redis took, replayed through one ideal limiter."""
        taken = [r for r, took in zip(self.records, self.taken, strict=True) if took]
        replay(taken, self.algorithm, LIMIT, WINDOW_US)


@rule("cluster-reshard", "nodes-as-one")
@core
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_stage3_a_slot_moved_between_decisions_loses_and_repeats_none(
    stage_module: ModuleType, redis_cluster: LocalCluster, algorithm: str
) -> None:
    """The real MIGRATING/IMPORTING/MIGRATE/SETSLOT sequence, one step between calls,
    alice holding units throughout. While the slot moves a call may be an unavailability
    (the failure mode decides, counted) — and must be while her keys are split between
    the two masters; every call Redis takes replays exactly through one ideal limiter, and
    before and after the move Redis takes every call."""
    r = Reshard(stage_module, redis_cluster, algorithm)
    r.run(Op(0, "alice", 1))
    names = redis_cluster.keys(r.prefix)  # alice's Redis keys, whatever the layout
    slot = key_slot(names[0].encode())
    target = redis_cluster.other_master(redis_cluster.owner(slot))
    r.run(Op(0, "alice", 1, "refund"), Op(0, "bob", 2), Op(0, "alice", 1))
    before = list(r.taken)
    r.mark(f"slot {slot} (alice's keys {names}): target IMPORTING, owner MIGRATING")
    redis_cluster.begin_migration(slot, target)
    r.run(Op(0, "alice", 1), Op(0, "alice", 1, "peek"))
    moved = redis_cluster.move_keys(slot, target, count=1)
    r.mark(f"MIGRATE {moved} of alice's {len(names)} keys")
    skipped = 0  # calls made while Redis was being skipped: fallbacks, not errors
    if r.run(Op(0, "alice", 1), probe=False):
        if len(names) > moved:
            raise AssertionError(
                f"{algorithm}: with alice's keys split between two masters the cluster "
                "answers TRYAGAIN, an unavailability: the failure mode decides; Redis took "
                "the call. The calls:\n" + r.story()
            )
    else:  # an unavailability starts the probe interval, TRYAGAIN like any other
        errors, skipped = r.limiter.statistics().redis_errors, 1
        r.run(Op(0, "alice", 1))
        expect(
            r.limiter.statistics().redis_errors,
            errors,
            f"{algorithm}: the call right after an unavailability, within the probe "
            "interval, skips Redis (no new Redis error). The calls:\n" + r.story(),
        )
    redis_cluster.move_keys(slot, target)
    r.mark("MIGRATE the rest (the owner answers ASK)")
    r.run(Op(0, "alice", 1), Op(0, "alice", 1, "refund"))
    redis_cluster.finish_migration(slot, target)
    r.mark(f"SETSLOT {slot} NODE <target> on every master (MOVED)")
    after = len(r.taken)
    r.run(Op(0, "alice", 1), Op(0, "alice", 2), Op(0, "alice", 1, "peek"), Op(0, "bob", 1))
    check(
        all(before) and all(r.taken[after:]),
        f"{algorithm}: before the slot moves and once it has moved, Redis takes every "
        "call. The calls:\n" + r.story(),
    )
    fallbacks = r.taken.count(False)
    expect(
        r.limiter.statistics(),
        RedisLimiterStats(len(r.taken) - fallbacks, fallbacks, fallbacks - skipped),
        f"{algorithm}: each call is decided by Redis or, unavailable, by the failure mode, "
        "and counted once. The calls:\n" + r.story(),
    )
    r.replay()


@rule("cluster-reshard", "refund-outage")
@core
def test_stage3_a_refund_that_empties_the_log_while_its_slot_moves_is_all_or_nothing(
    stage_module: ModuleType, redis_cluster: LocalCluster
) -> None:
    """The sliding log's refund of every unit it holds empties the log mid-script. In a
    migrating slot Redis fails a script halfway at the next command on a key that is
    missing by then, keeping what it wrote: a refund reported as not taken (failure mode)
    must have changed nothing on Redis, one reported as taken must be whole."""
    r = Reshard(stage_module, redis_cluster, "sliding_log")
    r.run(Op(0, "alice", 2))
    names = redis_cluster.keys(r.prefix)
    slot = key_slot(names[0].encode())
    target = redis_cluster.other_master(redis_cluster.owner(slot))
    r.mark(f"slot {slot} (alice's keys {names}): target IMPORTING, owner MIGRATING")
    redis_cluster.begin_migration(slot, target)
    try:
        taken = r.run(Op(0, "alice", 2, "refund"))
    except redis.RedisError as error:
        raise AssertionError(
            f"refund('alice', 2) while alice's slot migrates raised {type(error).__name__}: "
            f"{error}. Redis either takes the refund or is unavailable (the failure mode): "
            "a script that fails halfway in a migrating slot has also written half. The "
            "calls:\n" + r.story()
        ) from error
    redis_cluster.migrate(slot, target)
    r.mark("the slot moved to its new master")
    r.run(Op(0, "alice", 1, "peek"))
    check(r.taken[-1], "once the slot has moved Redis takes the peek. The calls:\n" + r.story())
    peek = r.records[-1].decision
    left = LIMIT if taken else LIMIT - 2
    check(
        isinstance(peek, Decision) and peek.remaining == left - 1,
        f"alice held 2 of {LIMIT}; the refund of both was "
        + ("taken by Redis" if taken else "not taken (the failure mode: dropped)")
        + f", so peek('alice', 1) leaves {left - 1}; got {peek}. A script that ran halfway "
        "in the migrating slot would have removed her units and then failed. The calls:\n"
        + r.story(),
    )


def _user_key_on(
    cluster: LocalCluster, limiter: RedisLimiter, prefix: str, *, on: bool, master: object
) -> str:
    """A user key whose Redis keys live on ``master`` (``on``) or elsewhere (not ``on``)."""
    for i in range(200):
        owner = _owner_of(cluster, limiter, prefix, f"user{i}")
        if owner is not None and (owner is master) == on:
            return f"user{i}"
    raise AssertionError("no user key of 200 landed where the test needs it")


@rule("node-outage", "probe-interval", "failure-modes")
@core
def test_stage3_one_dead_master_sends_only_its_own_keys_to_the_failure_mode(
    stage_module: ModuleType,
) -> None:
    """A cluster that keeps serving without full coverage: one master of three is killed.
    Its keys fall back, once per probe interval; a key on a live master is decided by
    Redis at the same instant."""
    with LocalCluster(command=cluster_command(), full_coverage=False) as cluster:
        clock, prefix = ManualClock(), "rl-dead:"
        limiter = make_limiter(
            stage_module,
            cluster.client(),
            "token_bucket",
            LIMIT,
            WINDOW_US,
            key_prefix=prefix,
            failure_mode="closed",
            probe_interval_ns=NS_PER_S,
            clock=clock,
        )
        victim = cluster.nodes[0]
        dead_key = _user_key_on(cluster, limiter, prefix, on=True, master=victim)
        live_key = _user_key_on(cluster, limiter, prefix, on=False, master=victim)
        before = limiter.statistics()
        cluster.kill(victim)
        story = f"the master serving {dead_key!r} killed, {live_key!r} on a live one: "
        first = limiter.try_acquire(dead_key)
        live = limiter.try_acquire(live_key)
        check(
            not isinstance(first, StampedDecision) and isinstance(live, StampedDecision),
            story + f"try_acquire({dead_key!r}) falls back ({first}), and try_acquire("
            f"{live_key!r}) right after it is decided by Redis: the live master still "
            f"serves it, so its keys must not wait out the dead one's probe interval; got {live}",
        )
        clock.advance(NS_PER_S)
        again = limiter.try_acquire(dead_key)
        check(not isinstance(again, StampedDecision), story + f"1 s later it fails again: {again}")
        after = limiter.statistics()
        expect(
            RedisLimiterStats(
                after.redis_decisions - before.redis_decisions,
                after.fallback_decisions - before.fallback_decisions,
                after.redis_errors - before.redis_errors,
            ),
            RedisLimiterStats(1, 2, 2),
            story + f"try_acquire({dead_key!r}) (tried, fails), try_acquire({live_key!r}) "
            f"(Redis), 1 s later try_acquire({dead_key!r}) (tried again, fails)",
        )
        cluster.revive(victim)
        clock.advance(NS_PER_S)
        back = limiter.try_acquire(dead_key)
        check(
            isinstance(back, StampedDecision) and back.allowed and back.remaining == LIMIT - 1,
            story + "once it is back (empty: no persistence) and the probe is due, Redis "
            f"decides the key again, as a fresh one; got {back}",
        )


@rule("cluster-down", "failure-modes", "fallback-counted", "redis-reset")
@core
def test_stage3_a_failed_cluster_sends_every_call_to_the_failure_mode(
    stage_module: ModuleType, redis_cluster: LocalCluster
) -> None:
    """With full coverage (Redis's default) one dead master takes the cluster to ``fail``:
    every master answers CLUSTERDOWN. No call raises; each goes to the failure mode."""
    clock, prefix = ManualClock(), "rl-down:"
    limiter = make_limiter(
        stage_module,
        redis_cluster.client(),
        "sliding_log",
        LIMIT,
        WINDOW_US,
        key_prefix=prefix,
        failure_mode="closed",
        probe_interval_ns=0,  # every call tries Redis
        clock=clock,
    )
    victim = redis_cluster.nodes[0]
    live_key = _user_key_on(redis_cluster, limiter, prefix, on=False, master=victim)
    before = limiter.statistics()
    redis_cluster.kill(victim)
    redis_cluster.wait_state("fail")
    calls: list[tuple[str, Callable[[], object]]] = [
        ("try_acquire", lambda: limiter.try_acquire(live_key)),
        ("peek", lambda: limiter.peek(live_key)),
        ("refund", lambda: limiter.refund(live_key, 1)),
        ("reset", lambda: limiter.reset(live_key)),
    ]
    got = {}
    for name, make in calls:
        try:
            got[name] = make()
        except Exception as error:  # the test reports what escaped
            raise AssertionError(
                f"the cluster is in 'fail' state (CLUSTERDOWN on every master): "
                f"{name}({live_key!r}) must go to the failure mode, not raise; it raised "
                f"{type(error).__name__}: {error}"
            ) from error
    for name in ("try_acquire", "peek"):
        d = got[name]
        check(
            isinstance(d, Decision)
            and not isinstance(d, StampedDecision)
            and not d.allowed
            and d.retry_after_ns is not None,
            f"failure_mode='closed' with the cluster down: {name}({live_key!r}) denies with a "
            f"retry hint; got {d}",
        )
    after = limiter.statistics()
    expect(
        (
            after.fallback_decisions - before.fallback_decisions,
            after.redis_errors - before.redis_errors,
        ),
        (3, 4),
        "with the cluster down: try_acquire, peek and refund fall back (3 fallbacks), and "
        "all four calls, reset included, count a Redis error",
    )
    redis_cluster.revive(victim)
    back = limiter.try_acquire(live_key)
    check(
        isinstance(back, StampedDecision),
        f"the cluster is ok again: Redis decides {live_key!r} again; got {back}",
    )


@rule("busy-unavailable", "failure-modes", "fallback-counted", "refund-outage")
@extended
def test_stage3_a_limiter_whose_cluster_becomes_unreachable_never_raises(
    stage_module: ModuleType, redis_cluster: LocalCluster
) -> None:
    """Every node unreachable: the first call fails with a ConnectionError and asks for a
    topology refresh; the next runs it, reaches no node, and fails with
    RedisClusterUnreachableError — not a RedisError, an unavailability all the same. A
    refund meets it as a decision does: the failure mode's, counted, never raised."""
    node, clock = ClusterNode(redis_cluster), ManualClock()
    proxy = node.proxy()
    limiter = make_limiter(
        stage_module,
        node.proxied_client(proxy, socket_timeout=2, topology_refresh_min_interval=0),
        "token_bucket", LIMIT, WINDOW_US, key_prefix="rl-unreachable-sync:",
        failure_mode="closed", probe_interval_ns=0, clock=clock,  # every call tries Redis
    )  # fmt: skip
    assert limiter.try_acquire("alice").allowed, "the cluster is up"
    proxy.outage()
    calls: list[tuple[str, Callable[[], object]]] = [
        ("try_acquire", lambda: limiter.try_acquire("alice")),
        ("refund", lambda: limiter.refund("alice", 1)),
        ("peek", lambda: limiter.peek("alice")),
        ("reset", lambda: limiter.reset("alice")),
    ]
    for name, make in calls:
        try:
            make()
        except Exception as error:  # the test reports what escaped
            raise AssertionError(
                f"every node of the cluster unreachable: {name}('alice') raised "
                f"{type(error).__name__}: {error}. An unreachable cluster is an "
                "unavailability (api.unavailable says so): the failure mode's, counted, "
                "never raised"
            ) from error
    expect(
        limiter.statistics(),
        RedisLimiterStats(1, 3, 4),
        "the cluster up for one decision, then unreachable: try_acquire, refund, peek and "
        "reset each tried Redis (4 Redis errors); all but reset fell back (3)",
    )
    proxy.heal()


@rule("busy-unavailable", "failure-modes", "fallback-counted", "async-redis")
@extended
def test_stage3_an_async_limiter_whose_cluster_is_unreachable_from_the_start_falls_back(
    stage_module: ModuleType, redis_cluster: LocalCluster
) -> None:
    """An async cluster client finds its nodes at its first call. Every node unreachable
    then: the client raises RedisClusterUnreachableError, which is not a RedisError —
    an unavailability all the same, for the failure mode."""
    proxy = ClusterNode(redis_cluster).proxy()
    clock = ManualClock()

    async def main() -> tuple[Decision, RedisLimiterStats, Decision]:
        client = ClusterNode(redis_cluster).proxied_async_client(proxy, socket_timeout=2)
        limiter = stage_module.AsyncRedisRateLimiter(
            client, algorithm="token_bucket", limit=4, window_ns=WINDOW_US * 1000,
            clock=clock, key_prefix="rl-unreachable:", failure_mode="closed",
            probe_interval_ns=NS_PER_S,
        )  # fmt: skip
        try:
            proxy.outage()
            try:
                down = await limiter.try_acquire("alice")
            except Exception as error:  # the test reports what escaped
                raise AssertionError(
                    "every node of the cluster unreachable before the async client's first "
                    f"call: try_acquire('alice') raised {type(error).__name__}: {error}. An "
                    "unreachable cluster is an unavailability (api.unavailable says so): the "
                    "failure mode's, counted, never raised"
                ) from error
            stats = limiter.statistics()
            proxy.heal()
            clock.advance(NS_PER_S)  # the next probe is due
            return down, stats, await limiter.try_acquire("alice")
        finally:
            await client.aclose()

    down, stats, back = asyncio.run(asyncio.wait_for(main(), 60))
    expect(
        (type(down).__name__, down.allowed, stats),
        ("Decision", False, RedisLimiterStats(0, 1, 1)),
        "the cluster unreachable from the start, failure_mode='closed': try_acquire('alice') "
        "is denied by the failure mode (not Redis: no StampedDecision), one fallback and one "
        "Redis error counted",
    )
    check(
        isinstance(back, StampedDecision) and back.allowed,
        f"the cluster reachable again, 1 s later: Redis decides 'alice'; got {back}",
    )


@rule("node-outage", "probe-interval", "failure-modes", "async-redis")
@core
@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_stage3_each_master_has_its_own_probe_interval(
    stage_module: ModuleType, redis_cluster: LocalCluster, flavour: str
) -> None:
    """Each master behind a fault proxy of its own, as the client sees the cluster.
    Master A goes down: its keys fall back, A is tried once per probe interval whatever
    the key, a key on master B is decided by Redis meanwhile; then B goes down too, half
    an interval later: each keeps its own interval, and a closed denial's retry hint is
    the time to the probe of the key's own master."""
    if flavour == "async" and not hasattr(stage_module, "AsyncRedisRateLimiter"):
        pytest.skip("the async limiter is the extended part")
    node = ClusterNode(redis_cluster)
    proxy = node.proxy()
    prefix, clock = "rl-probe:", ManualClock()
    a_master, b_master = redis_cluster.nodes[0], redis_cluster.nodes[1]
    finder = make_limiter(stage_module, redis_cluster.client(), "token_bucket", 9, WINDOW_US,
                          key_prefix=prefix)  # fmt: skip
    a1 = _user_key_on(redis_cluster, finder, prefix, on=True, master=a_master)
    a2 = next(  # a second key of A's, on another slot
        k
        for k in (f"{a1}-{i}" for i in range(500))
        if _owner_of(redis_cluster, finder, prefix, k) is a_master
    )
    b = _user_key_on(redis_cluster, finder, prefix, on=True, master=b_master)
    pa = proxy.by_address[("127.0.0.1", a_master.port)]
    pb = proxy.by_address[("127.0.0.1", b_master.port)]
    kwargs = dict(
        algorithm="token_bucket", limit=9, window_ns=WINDOW_US * 1000, clock=clock,
        key_prefix=prefix, failure_mode="closed", probe_interval_ns=NS_PER_S,
    )  # fmt: skip
    story: list[str] = []

    async def scenario(
        acquire: Callable[[str], Awaitable[Decision]], stats: Callable[[], RedisLimiterStats]
    ) -> None:
        async def step(
            key: str, redis_decides: bool, errors: int, retry: int | None = None
        ) -> None:
            d = await acquire(key)
            story.append(f"  t={clock.now_ns() / NS_PER_S:.1f} s try_acquire({key!r}) -> {d}")
            got = stats().redis_errors - base.redis_errors
            check(
                isinstance(d, StampedDecision) == redis_decides
                and got == errors
                and (retry is None or d.retry_after_ns == retry),
                ("Redis decides" if redis_decides else "the failure mode decides")
                + f", {errors} Redis error(s) so far"
                + ("" if retry is None else f", retry_after_ns={retry}")
                + f"; got {got} error(s). The calls ({a1!r}, {a2!r} on master A, {b!r} on "
                "master B):\n" + "\n".join(story),
            )

        await acquire(b)  # connects to both masters
        await acquire(a1)
        base = stats()
        story.append("  -- master A unreachable")
        pa.outage()
        await step(a1, False, 1)  # tried: fails
        await step(a2, False, 1)  # A is skipped for any key, not tried once per key
        await step(b, True, 1)  # B is up
        await step(a1, False, 1)  # B answering does not end A's interval
        clock.advance(NS_PER_S // 2)
        story.append("  -- half an interval later, master B unreachable too")
        pb.outage()
        await step(b, False, 2)
        await step(a1, False, 2, retry=NS_PER_S // 2)  # A's probe is due in 0.5 s, B's in 1 s
        clock.advance(NS_PER_S // 2)
        story.append("  -- A's interval is over, and A is back")
        pa.heal()
        await step(a2, True, 2)
        await step(b, False, 2, retry=NS_PER_S // 2)

    if flavour == "sync":
        limiter = stage_module.RedisRateLimiter(
            node.proxied_client(proxy, socket_timeout=2), **kwargs
        )

        async def acquire(key: str) -> Decision:
            d: Decision = limiter.try_acquire(key)
            return d

        asyncio.run(scenario(acquire, limiter.statistics))
        return

    async def main() -> None:
        client = node.proxied_async_client(proxy, socket_timeout=2)
        limiter = stage_module.AsyncRedisRateLimiter(client, **kwargs)
        try:
            await scenario(limiter.try_acquire, limiter.statistics)
        finally:
            await client.aclose()

    asyncio.run(asyncio.wait_for(main(), 60))


def _owner_of(
    cluster: LocalCluster, limiter: RedisLimiter, prefix: str, user_key: str
) -> ProcessNode | None:
    """The master ``user_key``'s Redis keys live on, found by deciding once for it and
    seeing where its keys appear (None if none did)."""
    before = set(cluster.keys(prefix))
    limiter.try_acquire(user_key)
    names = sorted(set(cluster.keys(prefix)) - before)
    return cluster.owner_of(names[0]) if names else None


@rule("node-outage", "redis-reset", "busy-unavailable", "probe-interval", "async-redis")
@core
@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_stage3_a_busy_master_skips_only_the_master_its_keys_are_sent_to(
    stage_module: ModuleType, redis_cluster: LocalCluster, flavour: str
) -> None:
    """Master A answers BUSY. The user key chosen for A is one whose bare name hashes to
    another master, X: the probe interval belongs to the master the key's Redis keys are
    sent to (A), never to the one its name alone would hash to. A reset on A meets the
    BUSY too: best effort — counted, never raised, and it starts A's interval."""
    if flavour == "async" and not hasattr(stage_module, "AsyncRedisRateLimiter"):
        pytest.skip("the async limiter is the extended part")
    node = ClusterNode(redis_cluster)
    proxy = node.proxy()
    prefix, clock = "rl-busy:", ManualClock()
    a_master = redis_cluster.nodes[0]
    finder = make_limiter(stage_module, redis_cluster.client(), "token_bucket", 9, WINDOW_US,
                          key_prefix=prefix)  # fmt: skip
    a = next(
        k
        for k in (f"user{i}" for i in range(500))
        if redis_cluster.owner_of(k) is not a_master
        and _owner_of(redis_cluster, finder, prefix, k) is a_master
    )
    x_master = redis_cluster.owner_of(a)  # where the bare name 'a' would hash
    x = _user_key_on(redis_cluster, finder, prefix, on=True, master=x_master)
    kwargs = dict(
        algorithm="token_bucket", limit=9, window_ns=WINDOW_US * 1000, clock=clock,
        key_prefix=prefix, failure_mode="closed", probe_interval_ns=NS_PER_S,
    )  # fmt: skip
    loop = asyncio.new_event_loop()
    closing: list[Callable[[], object]] = [loop.close]
    limiter: FaultTolerant
    if flavour == "sync":
        limiter = stage_module.RedisRateLimiter(
            node.proxied_client(proxy, socket_timeout=2), **kwargs
        )
    else:
        client = node.proxied_async_client(proxy, socket_timeout=2)
        closing.insert(0, lambda: loop.run_until_complete(client.aclose()))
        limiter = Blocking(stage_module.AsyncRedisRateLimiter(client, **kwargs), loop)
    story = [f"  {a!r}: Redis keys on master A, bare name on X; {x!r}: Redis keys on X"]
    try:
        limiter.try_acquire(x)  # connects to both masters
        limiter.try_acquire(a)
        base = limiter.statistics()
        story.append("  -- master A answers BUSY to every command")
        proxy.by_address[("127.0.0.1", a_master.port)].busy()

        def step(name: str, key: str, redis_decides: bool | None, errors: int) -> None:
            d: Decision | None = None
            try:
                if name == "reset":
                    limiter.reset(key)
                else:
                    d = limiter.try_acquire(key)
            except redis.RedisError as error:
                raise AssertionError(
                    f"{name}({key!r}) on a master answering BUSY raised "
                    f"{type(error).__name__}: {error}. BUSY is an unavailability "
                    "(api.unavailable says so): counted, never raised. The calls:\n"
                    + "\n".join(story)
                ) from error
            story.append(f"  t={clock.now_ns() / NS_PER_S:.0f} s {name}({key!r}) -> {d}")
            got = limiter.statistics().redis_errors - base.redis_errors
            check(
                (redis_decides is None or isinstance(d, StampedDecision) == redis_decides)
                and got == errors,
                {None: "", True: "Redis decides", False: "the failure mode decides"}[redis_decides]
                + f", {errors} Redis error(s) so far; got {got}. The probe interval is kept "
                "per master a key is sent to; a reset's failure starts it too. The calls:\n"
                + "\n".join(story),
            )

        step("reset", a, None, 1)  # tried: BUSY, counted, not raised
        step("try_acquire", a, False, 1)  # A skipped: the reset's failure started its interval
        step("try_acquire", x, True, 1)  # X answers
        clock.advance(NS_PER_S)
        step("try_acquire", a, False, 2)  # A's probe is due: tried, BUSY again
        proxy.by_address[("127.0.0.1", a_master.port)].heal()
        clock.advance(NS_PER_S)
        step("try_acquire", a, True, 2)
    finally:
        for close in closing:
            close()
