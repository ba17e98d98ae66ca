"""Driving stage-3 nodes that share one Redis, and replaying what Redis decided.

Every decision Redis makes is a ``StampedDecision`` carrying the server time (µs) and the
key's operation counter. Sorting one key's decisions by ``(server_time_us, op)`` recovers
the order Redis made them in, whichever node asked; :class:`ServerModel` (stage 1's exact
models, run on the server's clock) replays them and must produce the very same
``Decision``s. On fakeredis the server clock is frozen and moved by the test; on a real
server it moves by itself and the replay still holds.

A refund returns nothing to stamp, so the replay applies it just before the next
decision on its key, at that decision's server time: for every algorithm the outcome is
the same as at the refund's own time (see :meth:`ServerModel.refund`).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from fractions import Fraction
from types import ModuleType
from typing import Any, Literal, TypeVar, assert_never, get_args

import redis
import redis.asyncio
from hypothesis import strategies as st

from katas._harness.faultproxy import FaultProxy
from katas._harness.machines import Operations
from katas._harness.redis import RedisEnv
from katas._harness.story import Story, expect
from katas._runtime.clock import NS_PER_US
from katas.rate_limiter._testing.models import (
    FixedWindowModel,
    Model,
    SlidingLogModel,
    TokenBucketModel,
)
from katas.rate_limiter.api import (
    NS_PER_S,
    AsyncRedisLimiter,
    Decision,
    Lease,
    ManualClock,
    RedisLimiter,
    RedisLimiterStats,
    StampedDecision,
)

ALGORITHMS = ("token_bucket", "sliding_log", "fixed_window")
KEYS = ("alice", "bob")
NODES = 3
_T = TypeVar("_T")


# --- the model: one ideal limiter on the server's clock ---------------------------------


class ServerModel:
    """What one ideal limiter decides for ``(key, cost)`` at server time ``now`` (µs).

    Stage 1's exact models with µs as their unit of time: a token bucket refilling
    ``limit`` per window, a sliding log, a fixed window aligned to the server's epoch.
    Decisions come back in ns, as the limiters report them (whole µs).
    """

    def __init__(self, algorithm: str, limit: int, window_us: int) -> None:
        self.algorithm, self.limit, self.window = algorithm, limit, window_us
        self.model: Model[Any]
        if algorithm == "token_bucket":
            # The model refills ``rate`` per 10⁹ units of its time: here, per 10⁹ µs.
            self.model = TokenBucketModel(limit, Fraction(limit * NS_PER_S, window_us))
        elif algorithm == "sliding_log":
            self.model = SlidingLogModel(limit, window_us)
        else:
            self.model = FixedWindowModel(limit, window_us, "epoch")

    def decide(self, key: str, cost: int, now: int, commit: bool) -> Decision:
        d = self.model.decide(key, cost, now, commit=commit)
        retry = d.retry_after_ns
        return Decision(
            allowed=d.allowed,
            limit=d.limit,
            remaining=d.remaining,
            retry_after_ns=None if retry is None else retry * NS_PER_US,
            reset_after_ns=d.reset_after_ns * NS_PER_US,
        )

    def refund(self, key: str, cost: int, now: int) -> None:
        """Give back ``cost`` units at ``now``: capped, this window's only, newest first.

        Applying it later, at the next decision on ``key``, changes no decision: the
        bucket's cap binds the same either way (refill is linear and capped); units that
        leave a log or a window in between would have left anyway.
        """
        self.model.refund(key, cost, now)

    def time_to_fresh_us(self, key: str, now: int) -> int:
        """How long until ``key`` is fresh again, seen at ``now`` (0 if it is)."""
        return self.model.decide(key, self.limit + 1, now, commit=False).reset_after_ns


def plain(d: Decision) -> Decision:
    """The Decision fields only (a StampedDecision also carries its stamp)."""
    return Decision(d.allowed, d.limit, d.remaining, d.retry_after_ns, d.reset_after_ns)


@dataclass
class LeaseModel:
    """The leases held per key, across every node."""

    held: dict[str, set[int]] = field(default_factory=dict)


#: What a lease set's TTL must be after every call, whatever the call: the set outlives
#: its latest live lease, and not by more than a second.
LEASE_SET_TTL = (
    "redis-lease-expiry, ttl-bound: a lease set must never expire while it holds a live "
    "lease — after every call (try_acquire, release, in_flight), server time stepped back "
    "or not, time to its latest live lease's expires_at_ns (server TIME, whole ms rounded "
    "up) <= PTTL <= that + 1 s"
)


def check_lease_set_ttl(
    env: RedisEnv, story: Story, prefix: str, held: Sequence[Lease], slowest_call_us: int = 0
) -> None:
    """Every key under ``prefix`` (one user key's) outlives the latest of ``held`` (the
    leases granted and not released) still live by the server's TIME: exact on fakeredis,
    whose clock stands still while the test reads. A real server's clock runs on: its
    PTTLs are read between two TIMEs, with 2 ms of slack (Redis expires keys by whole ms)
    and ``slowest_call_us`` more (the slowest call so far: a relative TTL may count from
    the instant its script started, TIME inside it from later), and nothing is judged
    while a lease's expiry falls among the readings."""
    __tracebackhide__ = True
    before_us = env.server().time_us()
    ttls = {name: env.admin().pttl(name) for name in env.keys(prefix)}
    after_us = env.server().time_us()
    slack_ms = 0 if env.time_is_controlled else 2 + -(-slowest_call_us // 1000)
    expiries = [lease.expires_at_ns // NS_PER_US for lease in held]
    if not env.time_is_controlled and any(
        before_us - slack_ms * 1000 <= e <= after_us + slack_ms * 1000 for e in expiries
    ):
        return  # a real server's clock ran past a lease's expiry while the test read
    live = [e for e in expiries if e > after_us]
    if not live:
        for name, ttl in ttls.items():
            story.check(
                ttl == -2 or 0 <= ttl <= 1000 + slack_ms,
                LEASE_SET_TTL,
                f"no lease is live, and key {name!r} has PTTL {ttl} ms (-1: no TTL at all)",
            )
        return
    latest_us = max(live)
    low = -(-(latest_us - after_us) // 1000) - slack_ms
    high = -(-(latest_us - before_us) // 1000) + 1000 + slack_ms
    story.check(
        ttls,
        LEASE_SET_TTL,
        f"{len(live)} lease(s) live, the latest for {latest_us - after_us} µs more, and no "
        f"key under {prefix!r} left: the set expired with them",
    )
    for name, ttl in ttls.items():
        story.check(
            low <= ttl <= high,
            LEASE_SET_TTL,
            f"key {name!r} has PTTL {ttl} ms, expected {low}..{high} ms: {len(live)} "
            f"lease(s) live, the latest expiring {latest_us - after_us} µs from now "
            "(below: the set expires, and takes live leases with it, before that lease ends; "
            "-1: no TTL at all)",
        )


# --- building nodes ---------------------------------------------------------------------


def make_limiter(
    stage: ModuleType,
    client: redis.Redis | redis.RedisCluster,
    algorithm: str,
    limit: int,
    window_us: int,
    **kw: Any,
) -> RedisLimiter:
    """A RedisRateLimiter over ``client``; its own ManualClock unless ``clock`` is given."""
    kw.setdefault("clock", ManualClock())
    limiter: RedisLimiter = stage.RedisRateLimiter(
        client, algorithm=algorithm, limit=limit, window_ns=window_us * NS_PER_US, **kw
    )
    return limiter


def make_nodes(
    stage: ModuleType,
    env: RedisEnv,
    algorithm: str,
    limit: int,
    window_us: int,
    *,
    prefix: str,
    clocks: Sequence[ManualClock] | None = None,
) -> list[RedisLimiter]:
    """NODES limiters, each with its own client (connection pool) and clock."""
    clocks = clocks or [ManualClock() for _ in range(NODES)]
    return [
        make_limiter(stage, client, algorithm, limit, window_us, key_prefix=prefix, clock=c)
        for client, c in zip(env.clients(NODES), clocks, strict=True)
    ]


def behind_a_proxy(
    stage: ModuleType,
    env: RedisEnv,
    failure_mode: str,
    *,
    algorithm: str = "token_bucket",
    limit: int = 4,
    window_us: int = 60_000_000,
    expected_nodes: int = 1,
    probe_interval_ns: int = NS_PER_S,
) -> tuple[FaultProxy, ManualClock, RedisLimiter]:
    """A limiter (by default a token bucket of 4 a minute) whose client reaches Redis
    through a fault proxy, on a clock the test sets; after a failure it probes Redis again
    every second (by default)."""
    proxy = env.proxy()
    clock = ManualClock()
    limiter = make_limiter(
        stage,
        env.server().proxied_client(proxy, socket_timeout=2),
        algorithm,
        limit,
        window_us,
        key_prefix=env.prefix,
        failure_mode=failure_mode,
        probe_interval_ns=probe_interval_ns,
        clock=clock,
        expected_nodes=expected_nodes,
    )
    return proxy, clock, limiter


def async_behind_a_proxy(
    stage: ModuleType, env: RedisEnv, proxy: FaultProxy, clock: ManualClock, failure_mode: str
) -> tuple[redis.asyncio.Redis, AsyncRedisLimiter]:
    """:func:`behind_a_proxy`'s token bucket (4 a minute, local share 4 // 2), async: its
    client (to aclose) and the limiter. Build it inside the event loop that uses it."""
    client = env.server().proxied_async_client(proxy, socket_timeout=2)
    limiter: AsyncRedisLimiter = stage.AsyncRedisRateLimiter(
        client,
        algorithm="token_bucket",
        limit=4,
        window_ns=60 * NS_PER_S,
        clock=clock,
        key_prefix=env.prefix,
        failure_mode=failure_mode,
        expected_nodes=2,
        probe_interval_ns=NS_PER_S,
    )
    return client, limiter


class Blocking:
    """An async limiter called from plain test code: each call runs to its end on the
    limiter's own event loop (a hard 10 s deadline), so one check serves both flavours."""

    def __init__(self, limiter: AsyncRedisLimiter, loop: asyncio.AbstractEventLoop) -> None:
        self._limiter, self._loop = limiter, loop

    def _run(self, call: Coroutine[Any, Any, _T]) -> _T:
        return self._loop.run_until_complete(asyncio.wait_for(call, 10))

    def try_acquire(self, key: str, cost: int = 1) -> Decision:
        return self._run(self._limiter.try_acquire(key, cost))

    def peek(self, key: str, cost: int = 1) -> Decision:
        return self._run(self._limiter.peek(key, cost))

    def refund(self, key: str, cost: int) -> None:
        self._run(self._limiter.refund(key, cost))

    def reset(self, key: str) -> None:
        self._run(self._limiter.reset(key))

    def statistics(self) -> RedisLimiterStats:
        return self._limiter.statistics()


FaultTolerant = RedisLimiter | Blocking  # a sync limiter, or an async one called to its end


@contextmanager
def async_behind_a_proxy_blocking(
    stage: ModuleType, env: RedisEnv, failure_mode: str
) -> Iterator[tuple[FaultProxy, ManualClock, Blocking]]:
    """:func:`async_behind_a_proxy`'s limiter, called through :class:`Blocking`: the
    proxy, the clock and the limiter; its client and event loop closed on leaving."""
    proxy, clock, loop = env.proxy(), ManualClock(), asyncio.new_event_loop()
    try:
        client, limiter = async_behind_a_proxy(stage, env, proxy, clock, failure_mode)
        try:
            yield proxy, clock, Blocking(limiter, loop)
        finally:
            loop.run_until_complete(client.aclose())
    finally:
        loop.close()


@contextmanager
def flavour_behind_a_proxy(
    stage: ModuleType, env: RedisEnv, flavour: str, failure_mode: str
) -> Iterator[tuple[FaultProxy, ManualClock, FaultTolerant]]:
    """:func:`behind_a_proxy` (``flavour="sync"``, ``expected_nodes=2``) or
    :func:`async_behind_a_proxy_blocking` (``"async"``): one check for both limiters."""
    if flavour == "sync":
        yield behind_a_proxy(stage, env, failure_mode, expected_nodes=2)
    else:
        with async_behind_a_proxy_blocking(stage, env, failure_mode) as made:
            yield made


# --- operations, streams of them, and their replay ---------------------------------------


Call = Literal["try_acquire", "peek", "refund"]  # the kinds of OPERATIONS, below


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


def call(limiter: RedisLimiter, op: Op) -> Decision | None:
    """Make ``op``'s call on ``limiter``; a refund returns None."""
    if op.call == "refund":
        limiter.refund(op.key, op.cost)
        return None
    if op.call == "try_acquire":
        return limiter.try_acquire(op.key, op.cost)
    if op.call == "peek":
        return limiter.peek(op.key, op.cost)
    assert_never(op.call)


def run_stream(
    env: RedisEnv, nodes: Sequence[RedisLimiter], ops: Sequence[Op], *, bracket: bool = False
) -> list[Record]:
    """Run ``ops``; with ``bracket``, check each stamp lies between two server TIME reads."""
    server = env.server()
    records = []
    for op in ops:
        if op.gap_us and env.time_is_controlled:
            env.pass_time(op.gap_us * NS_PER_US)
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
    __tracebackhide__ = True
    model = ServerModel(algorithm, limit, window_us)
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
            expect(
                plain(d),
                want,
                f"{algorithm}, limit={limit}, window={window_us} µs: the nodes must "
                f"decide exactly as one limiter would. Replaying key {key!r} in Redis order "
                f"(server time, op):\n" + "\n".join(history[-12:]),
            )


def burst_from_threads(
    nodes: Sequence[RedisLimiter], *, threads_per_node: int, each: int
) -> list[Record]:
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


@dataclass(frozen=True)
class Limits:
    """What the operations drawn for the nodes depend on: the limit and window they share."""

    limit: int
    window_us: int

    def op(self, call: Call) -> st.SearchStrategy[Op]:
        return st.builds(
            Op,
            node=st.integers(0, NODES - 1),
            key=st.sampled_from(KEYS),
            cost=st.integers(1, self.limit + 1),
            call=st.just(call),
            gap_us=st.one_of(st.just(0), st.integers(0, self.window_us * 3 // 2)),
        )


#: Every call a node makes, declared once, with how to draw one (server time passing
#: before it, as its ``gap_us``): the scenarios' lists (:func:`scenarios`) and
#: ``RedisLimiterMachine``'s rules (one a call) are both drawn from it. A draw of n
#: branches weighs n: try_acquire comes thrice as often as a peek or a refund.
OPERATIONS: Operations[Limits, Op] = Operations(
    get_args(Call),
    {
        "try_acquire": lambda d: st.one_of(*(d.op("try_acquire") for _ in range(3))),
        "peek": lambda d: d.op("peek"),
        "refund": lambda d: d.op("refund"),
    },
    kind_of=lambda op: op.call,
)


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[str, int, int, list[Op]]:
    """An algorithm, a limit, a window (µs) and the operations of several nodes."""
    algorithm = draw(st.sampled_from(ALGORITHMS))
    limit = draw(st.integers(1, 4))
    window_us = draw(st.sampled_from([2_000, 50_000, 2_000_000]))
    ops = OPERATIONS.lists(Limits(limit, window_us), min_size=1, max_size=25)
    return algorithm, limit, window_us, draw(ops)


# --- keys on Redis ----------------------------------------------------------------------


def hash_tag(name: str) -> str:
    """What Redis Cluster hashes: the text inside the first ``{…}`` if non-empty, else all."""
    start = name.find("{")
    end = name.find("}", start + 1)
    return name[start + 1 : end] if 0 <= start < end - 1 else name
