"""Stage 3 — distributed: many limiter nodes sharing one Redis, with faults.

Runs on fakeredis by default; ``KATA_REDIS_SERVER=redis-server`` runs it on private
real servers, ``KATA_REDIS_URL=redis://…`` on an external one (see katas/_harness/redis.py).

How exactness is checked: every decision Redis makes is a ``StampedDecision`` carrying
the server time (µs) and the key's operation counter. Sorting one key's decisions by
``(server_time_us, op)`` recovers the order Redis made them in, whichever node asked;
the exact models below (written here, independent of any implementation) replay them
and must produce the very same ``Decision``s. On fakeredis the server clock is frozen
and moved by the test; on a real server it moves by itself and the replay still holds.

A refund returns nothing to stamp, so the replay applies it just before the next
decision on its key, at that decision's server time: for every algorithm the outcome is
the same as at the refund's own time (see ``Model.refund``).
"""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from types import ModuleType
from typing import Any, Literal

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

from katas._harness.profiles import heavy_examples
from katas._harness.redis import RedisEnv, RedisNode
from katas._harness.walks import Walk, walked
from katas.rate_limiter.api import (
    NS_PER_S,
    Decision,
    ManualClock,
    RedisLimiterStats,
    StampedDecision,
)

pytestmark = [pytest.mark.stage(3)]

ALGORITHMS = ("token_bucket", "sliding_log", "fixed_window")
KEYS = ("alice", "bob")
NS_PER_MS = 1_000_000
NODES = 3

# Tests that start servers run few examples; every test takes the redis_env fixture.
heavy = settings(
    max_examples=heavy_examples(),
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    deadline=None,
)


# --------------------------------------------------------------------------- models


def _ceil(x: Fraction) -> int:
    return math.ceil(x)


@dataclass
class KeyModel:
    """One key's exact state, in µs. Which fields matter depends on the algorithm."""

    tokens: Fraction | None = None  # token bucket: None = full
    last: int = 0
    log: list[tuple[int, int]] = field(default_factory=list)  # sliding log: (time, units)
    window_start: int | None = None  # fixed window
    used: int = 0


class Model:
    """What one ideal limiter decides for ``(key, cost)`` at server time ``now`` (µs)."""

    def __init__(self, algorithm: str, limit: int, window_us: int) -> None:
        self.algorithm, self.limit, self.window = algorithm, limit, window_us
        self.keys: dict[str, KeyModel] = {}

    def decide(self, key: str, cost: int, now: int, commit: bool) -> Decision:
        state = self.keys.setdefault(key, KeyModel(last=now))
        eff = max(now, state.last)  # stored time never decreases
        if self.algorithm == "token_bucket":
            return self._bucket(state, cost, now, eff, commit)
        if self.algorithm == "sliding_log":
            return self._log(state, cost, now, eff, commit)
        return self._fixed(state, cost, now, eff, commit)

    def refund(self, key: str, cost: int, now: int) -> None:
        """Give back ``cost`` units at ``now``: capped, this window's only, newest first.

        Applying it later, at the next decision on ``key``, changes no decision: the
        bucket's cap binds the same either way (refill is linear and capped); units that
        leave a log or a window in between would have left anyway.
        """
        s = self.keys.get(key)
        if s is None:
            return  # never charged: nothing to give back
        eff = max(now, s.last)
        if self.algorithm == "token_bucket":
            s.tokens = min(Fraction(self.limit), self._level(s, eff) + cost)
        elif self.algorithm == "sliding_log":
            log = [(t, u) for t, u in s.log if t > eff - self.window]
            back = cost
            while back and log:
                t, u = log.pop()  # the newest units go back first
                if u > back:
                    log.append((t, u - back))
                back -= min(u, back)
            s.log = log
        elif s.window_start == eff // self.window * self.window:
            s.used -= min(cost, s.used)  # a window that has rolled keeps nothing to refund
        s.last = eff

    def _level(self, s: KeyModel, eff: int) -> Fraction:
        rate = Fraction(self.limit, self.window)  # tokens per µs
        level = Fraction(self.limit) if s.tokens is None else s.tokens
        return min(Fraction(self.limit), level + (eff - s.last) * rate)

    def _bucket(self, s: KeyModel, cost: int, now: int, eff: int, commit: bool) -> Decision:
        rate = Fraction(self.limit, self.window)  # tokens per µs
        level = self._level(s, eff)
        catch = eff - now
        retry: int | None = 0
        if cost > self.limit:
            retry = None
        elif level < cost:
            retry = catch + _ceil((cost - level) / rate)
        else:
            level -= cost
            if commit:
                s.tokens, s.last = level, eff
        reset = catch + _ceil((self.limit - level) / rate)
        return _decision(retry, self.limit, math.floor(level), reset)

    def _log(self, s: KeyModel, cost: int, now: int, eff: int, commit: bool) -> Decision:
        inside = [(t, u) for t, u in s.log if t > eff - self.window]  # (eff - W, eff]
        used = sum(u for _, u in inside)
        retry: int | None = 0
        if cost > self.limit:
            retry = None
        elif used + cost > self.limit:
            to_free = used + cost - self.limit
            for t, u in inside:  # oldest first: when has enough left the window?
                to_free -= u
                if to_free <= 0:
                    retry = t + self.window - now
                    break
        else:
            used += cost
            if commit:
                s.log, s.last = [*inside, (eff, cost)], eff
        newest = eff if retry == 0 else (inside[-1][0] if inside else eff)
        reset = newest + self.window - now if used else 0
        return _decision(retry, self.limit, self.limit - used, reset)

    def _fixed(self, s: KeyModel, cost: int, now: int, eff: int, commit: bool) -> Decision:
        start = eff // self.window * self.window  # aligned to the server's epoch
        used = s.used if s.window_start == start else 0
        left = start + self.window - now
        retry: int | None = 0
        if cost > self.limit:
            retry = None
        elif used + cost > self.limit:
            retry = left
        else:
            used += cost
            if commit:
                s.window_start, s.used, s.last = start, used, eff
        return _decision(retry, self.limit, self.limit - used, left if used else 0)

    def time_to_fresh_us(self, key: str, now: int) -> int:
        """How long until ``key`` is fresh again, seen at ``now`` (0 if it is)."""
        return (self.decide(key, self.limit + 1, now, commit=False).reset_after_ns) // 1000


def _decision(retry_us: int | None, limit: int, remaining: int, reset_us: int) -> Decision:
    return Decision(
        allowed=retry_us == 0,
        limit=limit,
        remaining=remaining,
        retry_after_ns=None if retry_us is None else retry_us * 1000,
        reset_after_ns=reset_us * 1000,
    )


def plain(d: Decision) -> Decision:
    """The Decision fields only (a StampedDecision also carries its stamp)."""
    return Decision(d.allowed, d.limit, d.remaining, d.retry_after_ns, d.reset_after_ns)


# --------------------------------------------------------------------------- helpers


Call = Literal["try_acquire", "peek", "refund"]


@dataclass(frozen=True)
class Op:
    node: int
    key: str
    cost: int
    call: Call = "try_acquire"
    gap_us: int = 0  # server time passing before it (fakeredis; real servers move alone)


@dataclass(frozen=True)
class Record:
    node: int
    key: str
    cost: int
    call: Call
    decision: Decision | None  # None: a refund


def call(limiter: Any, op: Op) -> Decision | None:
    """Make ``op``'s call on ``limiter``; a refund returns None."""
    if op.call == "refund":
        limiter.refund(op.key, op.cost)
        return None
    method = limiter.try_acquire if op.call == "try_acquire" else limiter.peek
    return method(op.key, op.cost)  # type: ignore[no-any-return]


def make_limiter(
    stage: ModuleType, client: Any, algorithm: str, limit: int, window_us: int, **kw: Any
) -> Any:
    kw.setdefault("clock", ManualClock())
    return stage.RedisRateLimiter(
        client, algorithm=algorithm, limit=limit, window_ns=window_us * 1000, **kw
    )


def make_nodes(
    stage: ModuleType,
    env: RedisEnv,
    algorithm: str,
    limit: int,
    window_us: int,
    *,
    prefix: str,
    clocks: Sequence[ManualClock] | None = None,
) -> list[Any]:
    """NODES limiters, each with its own client (connection pool) and clock."""
    clocks = clocks or [ManualClock() for _ in range(NODES)]
    return [
        make_limiter(stage, client, algorithm, limit, window_us, key_prefix=prefix, clock=c)
        for client, c in zip(env.clients(NODES), clocks, strict=True)
    ]


def run_stream(
    env: RedisEnv, nodes: Sequence[Any], ops: Sequence[Op], *, bracket: bool = False
) -> list[Record]:
    """Run ``ops``; with ``bracket``, check each stamp lies between two server TIME reads."""
    server = env.server()
    records = []
    for op in ops:
        if op.gap_us and env.time_is_controlled:
            env.pass_time(op.gap_us * 1000)
        before = server.time_us() if bracket else 0
        d = call(nodes[op.node], op)
        if bracket and d is not None:
            after = server.time_us()
            assert isinstance(d, StampedDecision), f"{op}: Redis was up, got unstamped {d}"
            assert before <= d.server_time_us <= after, (
                f"decisions must use the server's clock (TIME), not a node's: {op} was "
                f"stamped {d.server_time_us} µs but the server read {before}..{after} µs around "
                f"it ({(d.server_time_us - before) / 1e6:+.3f} s off)"
            )
        records.append(Record(op.node, op.key, op.cost, op.call, d))
    return records


def replay(records: Sequence[Record], algorithm: str, limit: int, window_us: int) -> None:
    """Replay every key's decisions in Redis order through the model; all must match.

    Refunds are applied just before the next decision on their key in ``records``
    (which must then come from one thread, in call order).
    """
    model = Model(algorithm, limit, window_us)
    refunds_before: dict[int, list[Record]] = {}  # decision's index -> refunds just before it
    waiting: dict[str, list[Record]] = {}
    for i, r in enumerate(records):
        if r.call == "refund":
            waiting.setdefault(r.key, []).append(r)
            continue
        refunds_before[i] = waiting.pop(r.key, [])
        assert isinstance(r.decision, StampedDecision), (
            f"with Redis up every decision comes from the script, stamped with "
            f"op and server time; node {r.node} got {r.decision}"
        )

    def order(item: tuple[int, Record]) -> tuple[int, int, int]:
        r = item[1]
        d = r.decision
        assert isinstance(d, StampedDecision)
        bumps = r.call == "try_acquire" and r.cost <= limit  # peeks, impossible costs: no bump
        return d.server_time_us, d.op, 0 if bumps else 1

    for key in sorted({r.key for r in records}):
        history: list[str] = []
        decided = [(i, r) for i, r in enumerate(records) if r.key == key and i in refunds_before]
        for i, r in sorted(decided, key=order):
            d = r.decision
            assert isinstance(d, StampedDecision)
            for refund in refunds_before[i]:
                model.refund(key, refund.cost, d.server_time_us)
                history.append(f"  node{refund.node}.refund({key!r}, {refund.cost})")
            want = model.decide(key, r.cost, d.server_time_us, commit=r.call == "try_acquire")
            history.append(
                f"  t={d.server_time_us} op={d.op} node{r.node}.{r.call}({key!r}, {r.cost})"
                f" -> allowed={d.allowed} remaining={d.remaining} retry={d.retry_after_ns}"
            )
            assert plain(d) == want, (
                f"{algorithm}, limit={limit}, window={window_us} µs: the nodes must "
                f"decide exactly as one limiter would. Replaying key {key!r} in Redis order "
                f"(server time, op):\n" + "\n".join(history[-12:]) + f"\nexpected {want}\n"
                f"got      {plain(d)}"
            )


def burst_from_threads(nodes: Sequence[Any], *, threads_per_node: int, each: int) -> list[Record]:
    """Every node's threads start together and call try_acquire("alice") ``each`` times."""
    records: list[Record] = []
    lock = threading.Lock()
    count = len(nodes) * threads_per_node
    start = threading.Barrier(count)

    def worker(i: int) -> None:
        start.wait(10)
        for _ in range(each):
            d = nodes[i].try_acquire("alice")
            with lock:
                records.append(Record(i, "alice", 1, "try_acquire", d))

    threads = [
        threading.Thread(target=worker, args=(i % len(nodes),), daemon=True) for i in range(count)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
        assert not t.is_alive(), "a node's decision hung (deadlock or no timeout?)"
    return records


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[str, int, int, list[Op]]:
    algorithm = draw(st.sampled_from(ALGORITHMS))
    limit = draw(st.integers(1, 4))
    window_us = draw(st.sampled_from([2_000, 50_000, 2_000_000]))
    op = st.builds(
        Op,
        node=st.integers(0, NODES - 1),
        key=st.sampled_from(KEYS),
        cost=st.integers(1, limit + 1),
        call=st.sampled_from(["try_acquire", "try_acquire", "try_acquire", "peek", "refund"]),
        gap_us=st.one_of(st.just(0), st.integers(0, window_us * 3 // 2)),
    )
    return algorithm, limit, window_us, draw(st.lists(op, min_size=1, max_size=25))


# --------------------------------------------------------------------------- examples


@pytest.mark.rule("nodes-as-one", "redis-algorithms", "server-time")
@pytest.mark.core
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
@pytest.mark.core
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


@pytest.mark.rule("redis-denial")
@pytest.mark.core
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
@pytest.mark.core
def test_stage3_cost_above_limit_never_fits(stage_module: ModuleType, redis_env: RedisEnv) -> None:
    for algorithm in ALGORITHMS:
        node = make_limiter(
            stage_module,
            redis_env.client(),
            algorithm,
            3,
            1_000_000,
            key_prefix=redis_env.fresh_prefix(),
        )
        d = node.try_acquire("alice", 4)
        assert not d.allowed and d.retry_after_ns is None, (
            f"{algorithm}: cost 4 > limit 3 can never fit: retry_after_ns is None, got {d}"
        )
        full = node.try_acquire("alice", 3)
        assert full.allowed, f"{algorithm}: the impossible request consumed quota: {full}"


@pytest.mark.rule("redis-refund", "refund-no-state")
@pytest.mark.core
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
@pytest.mark.core
@pytest.mark.realtime
def test_stage3_refund_takes_the_newest_units_out_of_the_sliding_log(
    stage_module: ModuleType, redis_env: RedisEnv
) -> None:
    redis_env.freeze_time()
    node = make_limiter(
        stage_module,
        redis_env.client(),
        "sliding_log",
        3,
        1_000_000,
        key_prefix=redis_env.fresh_prefix(),
    )
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
@pytest.mark.core
@pytest.mark.realtime
def test_stage3_refund_for_a_window_that_has_rolled_is_dropped(
    stage_module: ModuleType, redis_env: RedisEnv
) -> None:
    redis_env.freeze_time()
    node = make_limiter(
        stage_module,
        redis_env.client(),
        "fixed_window",
        3,
        400_000,
        key_prefix=redis_env.fresh_prefix(),
    )
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


@pytest.mark.rule("refund-outage", "fallback-counted")
@pytest.mark.core
@pytest.mark.parametrize("mode", ["open", "closed", "local"])
def test_stage3_refund_during_an_outage_is_counted_and_dropped_or_local(
    stage_module: ModuleType, redis_env: RedisEnv, mode: str
) -> None:
    proxy = redis_env.proxy()
    clock = ManualClock()
    limiter = make_limiter(
        stage_module,
        redis_env.server().proxied_client(proxy, socket_timeout=2),
        "token_bucket",
        4,
        60_000_000,
        key_prefix=redis_env.prefix,
        failure_mode=mode,
        expected_nodes=2,
        probe_interval_ns=NS_PER_S,
        clock=clock,
    )
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


def hash_tag(name: str) -> str:
    """What Redis Cluster hashes: the text inside the first ``{…}`` if non-empty, else all."""
    start = name.find("{")
    end = name.find("}", start + 1)
    return name[start + 1 : end] if 0 <= start < end - 1 else name


@pytest.mark.rule("hash-tag")
@pytest.mark.core
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
    assert set(tags.values()) == {"user42"}, (
        f"both keys of user 'user42' must carry the hash tag {{user42}} (e.g. "
        f"'rl:{{user42}}:m' and 'rl:{{user42}}:l') so Redis Cluster puts them in one slot; "
        f"the tags Cluster would hash are {tags}"
    )
    assert len({key_slot(name.encode()) for name in names}) == 1, names


@pytest.mark.rule("redis-bad-input", "whole-us", "lua-exact")
@pytest.mark.core
def test_stage3_rejects_bad_parameters(stage_module: ModuleType, redis_env: RedisEnv) -> None:
    client = redis_env.client()
    good: dict[str, Any] = {
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
    ]:
        with pytest.raises(ValueError, match=name):
            stage_module.RedisRateLimiter(client, **{**good, name: bad})
    with pytest.raises(TypeError, match="limit"):
        stage_module.RedisRateLimiter(client, **{**good, "limit": True})
    # Lua's doubles: limit × window in µs must stay below 2^51 — at 2^51 it is refused.
    with pytest.raises(ValueError):
        stage_module.RedisRateLimiter(client, **{**good, "limit": 2**31, "window_ns": 2**20 * 1000})
    stage_module.RedisRateLimiter(client, **{**good, "limit": 1, "window_ns": (2**51 - 1) * 1000})
    limiter = stage_module.RedisRateLimiter(client, **good)
    with pytest.raises(ValueError, match="cost"):
        limiter.try_acquire("alice", 0)
    with pytest.raises(TypeError, match="cost"):
        limiter.try_acquire("alice", True)
    with pytest.raises(ValueError, match="cost"):
        limiter.refund("alice", 0)
    with pytest.raises(TypeError, match="cost"):
        limiter.refund("alice", True)


# --------------------------------------------------------------------------- properties


@pytest.mark.rule(
    "nodes-as-one", "redis-algorithms", "stamped", "redis-denial", "redis-peek", "redis-refund"
)
@pytest.mark.core
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
@pytest.mark.core
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
@pytest.mark.core
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
@pytest.mark.core
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
    model = Model(algorithm, limit, window_us)
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
            if not low <= ttl_ms <= fresh_ms + 1000:
                raise AssertionError(
                    f"{algorithm}, limit={limit}, window={window_us} µs: every key "
                    f"must expire once its state is fresh again, and not before: time-to-fresh "
                    f"<= TTL <= time-to-fresh + 1 s. Key {name!r} has PTTL {ttl_ms} ms, "
                    f"time-to-fresh {fresh_ms} ms, after {done} (-1 = no TTL: was it set in "
                    "the same script? refreshed to a whole window? below: the key expires "
                    "while it still holds usage, and comes back fresh)"
                )


@pytest.mark.rule("one-script-call")
@pytest.mark.core
def test_stage3_each_decision_is_one_round_trip(
    stage_module: ModuleType, redis_env: RedisEnv
) -> None:
    proxy = redis_env.proxy()
    client = redis_env.server().proxied_client(proxy)
    for algorithm in ALGORITHMS:
        limiter = make_limiter(
            stage_module, client, algorithm, 2, 1_000_000, key_prefix=redis_env.fresh_prefix()
        )
        limiter.try_acquire("warm-up")  # connects and loads the script
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


# --------------------------------------------------------------------------- faults


@pytest.mark.rule("failure-modes", "fallback-counted", "probe-interval", "busy-unavailable")
@pytest.mark.core
@pytest.mark.parametrize("fault", ["outage", "busy"])
@pytest.mark.parametrize("mode", ["open", "closed", "local"])
def test_stage3_outage_honours_failure_mode_and_recovers(
    stage_module: ModuleType, redis_env: RedisEnv, mode: str, fault: str
) -> None:
    """``outage``: connections refused; ``busy``: every command answered ``BUSY`` (a long
    script runs on the server) — both an unavailability, for the failure mode."""
    proxy = redis_env.proxy()
    clock = ManualClock()
    limiter = make_limiter(
        stage_module,
        redis_env.server().proxied_client(proxy, socket_timeout=2),
        "token_bucket",
        4,
        60_000_000,
        key_prefix=redis_env.prefix,
        failure_mode=mode,
        expected_nodes=2,
        probe_interval_ns=NS_PER_S,
        clock=clock,
    )
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


@pytest.mark.rule("socket-timeout", "failure-modes")
@pytest.mark.core
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


@pytest.mark.core
@pytest.mark.rule("probe-interval", "failure-modes", "fallback-counted")
def test_stage3_a_failed_probe_skips_redis_for_another_interval(
    stage_module: ModuleType, redis_env: RedisEnv
) -> None:
    proxy = redis_env.proxy()
    clock = ManualClock()
    limiter = make_limiter(
        stage_module,
        redis_env.server().proxied_client(proxy, socket_timeout=2),
        "token_bucket",
        4,
        60_000_000,
        key_prefix=redis_env.prefix,
        failure_mode="closed",
        probe_interval_ns=NS_PER_S,
        clock=clock,
    )
    assert isinstance(limiter.try_acquire("alice"), StampedDecision), "Redis is up"
    proxy.outage()
    t0 = clock.now_ns()
    story: list[str] = []

    def step(at: int, *, tried: bool, retry: int | None) -> Decision:
        clock.set(t0 + at)
        errors = limiter.statistics().redis_errors
        d: Decision = limiter.try_acquire("alice")
        story.append(f"  t=+{at} ns: try_acquire('alice') -> {d}, {limiter.statistics()}")
        did_try = limiter.statistics().redis_errors > errors
        if did_try != tried or (retry is not None and d.retry_after_ns != retry):
            raise AssertionError(
                "after a failure Redis is skipped for probe_interval_ns (1 s) from that "
                "failure, then probed; a probe that fails starts a new interval, and a "
                "'closed' denial's retry_after_ns is the time until the next probe. Redis "
                f"went down at t=+0; at the last step Redis must{'' if tried else ' not'} be "
                f"tried"
                + ("" if retry is None else f", with retry_after_ns={retry}")
                + ":\n"
                + "\n".join(story)
            )
        return d

    step(0, tried=True, retry=NS_PER_S)  # fails: the next probe is due at +1 s
    step(NS_PER_S - 1, tried=False, retry=1)
    step(NS_PER_S, tried=True, retry=NS_PER_S)  # the probe fails: next one at +2 s
    step(NS_PER_S + 1, tried=False, retry=NS_PER_S - 1)
    proxy.heal()
    d = step(2 * NS_PER_S - 1, tried=False, retry=1)  # healed, but not due yet
    assert not isinstance(d, StampedDecision), f"Redis was not due yet: {d}"
    clock.set(t0 + 2 * NS_PER_S)
    back = limiter.try_acquire("alice")
    assert isinstance(back, StampedDecision), (
        f"at +2 s the next probe is due and Redis answers: {back}\n" + "\n".join(story)
    )
    stats = limiter.statistics()
    assert (stats.redis_decisions, stats.fallback_decisions, stats.redis_errors) == (2, 5, 2), (
        f"2 Redis decisions, 5 fallbacks, 2 Redis errors (two failed tries): {stats}"
    )


@pytest.mark.core
@pytest.mark.rule("script-error-raised")
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


def _decide_or_fail(limiter: Any, key: str, what: str) -> Decision:
    try:
        return limiter.try_acquire(key)  # type: ignore[no-any-return]
    except redis.ResponseError as exc:
        pytest.fail(
            f"after {what} the limiter raised {exc!r}: a NOSCRIPT reply must "
            "reload the script (redis-py's Script does) and retry"
        )


@pytest.mark.rule("noscript-reload")
@pytest.mark.core
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


# --------------------------------------------------------------------------- stateful


class RedisLimiterMachine(RuleBasedStateMachine):
    """Several nodes, keys, peeks, time passing and script flushes against one model."""

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
        self.model = Model(algorithm, self.limit, self.window_us)
        self.nodes = make_nodes(
            self.stage, self.env, algorithm, self.limit, self.window_us, prefix=self.env.prefix
        )

    def teardown(self) -> None:
        self.env.close()

    def _check(self, node: int, key: str, cost: int, acquire: bool) -> None:
        limiter = self.nodes[node]
        d = limiter.try_acquire(key, cost) if acquire else limiter.peek(key, cost)
        self.log.append(f"node{node}.{'try_acquire' if acquire else 'peek'}({key!r}, {cost})")
        assert isinstance(d, StampedDecision), d
        for back in self.refunds.pop(key, []):  # at this decision's time: the same outcome
            self.model.refund(key, back, d.server_time_us)
        want = self.model.decide(key, cost, d.server_time_us, commit=acquire)
        assert plain(d) == want, (
            f"{self.algorithm}, limit 3 per {self.window_us} µs: after "
            f"{self.log[-10:]} expected {want}, got {plain(d)}"
        )

    @rule(node=st.integers(0, NODES - 1), key=st.sampled_from(KEYS), cost=st.integers(1, 4))
    def try_acquire(self, node: int, key: str, cost: int) -> None:
        self._check(node, key, cost, True)

    @rule(node=st.integers(0, NODES - 1), key=st.sampled_from(KEYS), cost=st.integers(1, 4))
    def peek(self, node: int, key: str, cost: int) -> None:
        self._check(node, key, cost, False)

    @rule(node=st.integers(0, NODES - 1), key=st.sampled_from(KEYS), cost=st.integers(1, 4))
    def refund(self, node: int, key: str, cost: int) -> None:
        self.nodes[node].refund(key, cost)
        self.refunds.setdefault(key, []).append(cost)
        self.log.append(f"node{node}.refund({key!r}, {cost})")

    @precondition(lambda self: self.env.time_is_controlled)
    @rule(us=st.sampled_from([1, 999, 10_000, 13_333, 40_000, 100_000]))
    def pass_time(self, us: int) -> None:
        self.env.pass_time(us * 1000)
        self.log.append(f"pass {us} µs")

    @precondition(lambda self: self.env.server().can_fault)
    @rule()
    def script_flush(self) -> None:
        self.env.server().script_flush()
        self.log.append("SCRIPT FLUSH")

    @invariant()
    def keys_are_namespaced(self) -> None:
        for name in self.env.keys(""):
            if self.env.mode != "url":  # a private server holds only this limiter's keys
                assert name.startswith(self.env.prefix), f"key {name!r} outside key_prefix"


@pytest.fixture
def _bind_stage(stage_module: ModuleType) -> None:
    RedisLimiterMachine.stage = stage_module


#: Before its random steps, the model test walks each algorithm to its limit at one
#: instant, from two nodes and with a cost above 1, then past it: every unit counts.
SAME_INSTANT_WALKS: dict[str, Walk] = {
    algorithm: [
        ("start", {"algorithm": algorithm}),
        ("try_acquire", {"node": 0, "key": KEYS[0], "cost": 2}),
        ("try_acquire", {"node": 1, "key": KEYS[0], "cost": 1}),
        ("peek", {"node": 1, "key": KEYS[0], "cost": 1}),
        ("try_acquire", {"node": 0, "key": KEYS[0], "cost": 1}),
        ("refund", {"node": 1, "key": KEYS[0], "cost": 1}),
        ("try_acquire", {"node": 0, "key": KEYS[0], "cost": 1}),
        ("try_acquire", {"node": 1, "key": KEYS[0], "cost": 1}),
    ]
    for algorithm in ALGORITHMS
}

TestStage3RedisLimiterModel = pytest.mark.core(
    pytest.mark.rule("nodes-as-one", "redis-refund", "noscript-reload", "namespaced")(
        pytest.mark.usefixtures("_bind_stage")(walked(RedisLimiterMachine, SAME_INSTANT_WALKS))
    )
)
TestStage3RedisLimiterModel.settings = settings(heavy, stateful_step_count=30)


# --------------------------------------------------------------------------- extended


@pytest.mark.rule("async-redis")
@pytest.mark.extended
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
        nodes = [
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
@pytest.mark.extended
def test_stage3_async_outage_falls_back_and_recovers(
    stage_module: ModuleType, redis_env: RedisEnv
) -> None:
    proxy = redis_env.proxy()
    clock = ManualClock()

    async def main() -> tuple[list[Decision], RedisLimiterStats]:
        client = redis_env.server().proxied_async_client(proxy, socket_timeout=2)
        limiter = stage_module.AsyncRedisRateLimiter(
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
@pytest.mark.extended
def test_stage3_client_without_socket_timeout_is_refused(
    stage_module: ModuleType, redis_env: RedisEnv
) -> None:
    with pytest.raises(ValueError, match="socket_timeout"):
        make_limiter(
            stage_module, redis_env.client(socket_timeout=None), "token_bucket", 1, 1_000_000
        )


@pytest.mark.rule("no-client-retries")
@pytest.mark.extended
def test_stage3_a_client_that_retries_is_refused(stage_module: ModuleType) -> None:
    # redis-py's defaults retry; nothing is sent (the port is closed), the check comes first
    made: dict[str, Callable[[], Any]] = {
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


@dataclass
class LeaseModel:
    held: dict[str, set[int]] = field(default_factory=dict)


@pytest.mark.rule("redis-leases")
@pytest.mark.extended
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
    nodes = [
        stage_module.RedisConcurrencyLimiter(
            client, max_in_flight=2, lease_ns=60 * NS_PER_S, key_prefix=prefix
        )
        for client in redis_env.clients(NODES)
    ]
    model = LeaseModel()
    leases: list[Any] = []
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


@pytest.mark.rule("redis-lease-expiry")
@pytest.mark.extended
@pytest.mark.realtime
def test_stage3_unreleased_lease_expires(stage_module: ModuleType, redis_env: RedisEnv) -> None:
    redis_env.freeze_time()
    prefix = redis_env.fresh_prefix()
    limiter = stage_module.RedisConcurrencyLimiter(
        redis_env.client(), max_in_flight=1, lease_ns=100 * NS_PER_MS, key_prefix=prefix
    )
    lost = limiter.try_acquire("alice")
    assert lost is not None and limiter.try_acquire("alice") is None, "1 in flight at most"
    for name in redis_env.keys(prefix):
        assert 0 < redis_env.client().pttl(name) <= 1_100, f"{name}: TTL within lease + 1 s"
    redis_env.pass_time(150 * NS_PER_MS)
    again = limiter.try_acquire("alice")
    assert again is not None, (
        "a lease whose holder vanished must expire after lease_ns, freeing its slot"
    )
    assert limiter.release(lost) is False, "the expired lease is no longer held"
    assert limiter.release(again) is True


@pytest.mark.extended
@pytest.mark.rule("redis-lease-expiry")
def test_stage3_in_flight_reclaims_a_lease_at_its_expiry(
    stage_module: ModuleType, redis_env: RedisEnv
) -> None:
    if not redis_env.time_is_controlled:
        pytest.skip("needs the server clock under the test's control (fakeredis)")
    redis_env.freeze_time()
    limiter = stage_module.RedisConcurrencyLimiter(
        redis_env.client(), max_in_flight=2, lease_ns=100 * NS_PER_MS, key_prefix=redis_env.prefix
    )
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
