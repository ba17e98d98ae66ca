"""Building a stage-3 queue on the test's Redis, and the small tools its tests share:
a claim that must succeed, a call's stamp, what the test's keys hold, racing threads,
and the calls a queue must refuse."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

import fakeredis
import pytest
import redis
from hypothesis import HealthCheck, settings

from katas._harness.profiles import heavy_examples
from katas._harness.redis import RedisEnv
from katas._harness.under_test import stage
from katas.job_scheduler.api import (
    EffectStore,
    JobNotFound,
    JobState,
    Lease,
    OpStamp,
    RetryPolicy,
    SharedJobQueue,
)

MS = 1_000_000  # ns
#: A lease long enough never to expire by accident on a loaded machine, yet short
#: enough to wait out for real (≤ 500 ms) on a real server.
LEASE = 300 * MS
NO_RETRY_DELAY = RetryPolicy(0, 0, "none")
#: The most a script may be given (lua-bounds): durations and times up to this many µs,
#: counts up to this number — the bound included. One µs (or one more) past it is refused.
LUA_BOUND = 2**52
#: One µs past the bound, in ns: a whole number of µs, so only the bound refuses it.
PAST_THE_BOUND_NS = (LUA_BOUND + 1) * 1000

#: Tests that start servers or processes run few examples; they take function fixtures.
heavy = settings(
    max_examples=heavy_examples(),
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    deadline=None,
)


@pytest.fixture(autouse=True)
def fail_fast_on_redis_stubs(stage_module: ModuleType) -> None:
    """Build one queue before anything else: on a stub this fails at once with "not
    implemented yet: ..." (state machines also find the stage module here). A stage-3
    suite file imports it, which makes it autouse there."""
    stage_module.RedisJobQueue(
        fakeredis.FakeRedis(), lease_ns=LEASE, retry=NO_RETRY_DELAY, max_attempts=1
    )


def new_queue(
    env: RedisEnv,
    client: redis.Redis | redis.RedisCluster | None = None,
    *,
    prefix: str | None = None,
    lease_ns: int = LEASE,
    retry: RetryPolicy = NO_RETRY_DELAY,
    max_attempts: int = 3,
    **options: Any,
) -> SharedJobQueue:
    """A queue under the test's key prefix (every key it writes must start with it)."""
    queue: SharedJobQueue = stage().RedisJobQueue(
        env.client() if client is None else client,
        lease_ns=lease_ns,
        retry=retry,
        max_attempts=max_attempts,
        key_prefix=env.prefix if prefix is None else prefix,
        **options,
    )
    return queue


def stamp(queue: SharedJobQueue, what: str) -> OpStamp:
    """``queue.last_op()``, which must be the stamp of the call ``what`` just made."""
    got = queue.last_op()
    assert isinstance(got, OpStamp), (
        f"after {what}, last_op() returned {got!r}; expected the OpStamp of that call"
    )
    return got


def claim(queue: SharedJobQueue, worker: str = "w") -> Lease:
    """``queue.claim(worker)``, which must return a lease here."""
    lease = queue.claim(worker)
    assert isinstance(lease, Lease), f"claim() returned {lease!r}, but a job was due"
    return lease


def state_or_none(queue: SharedJobQueue, job_id: str) -> JobState | None:
    """The state ``queue.get(job_id)`` shows, or None if it raises JobNotFound."""
    try:
        return queue.get(job_id).state
    except JobNotFound:
        return None


def finish(queue: SharedJobQueue, lease: Lease, turn: int) -> None:
    """End a leased job in one of the three ways, by ``turn``: ack, nack, cancel."""
    if turn % 3 == 0:
        queue.ack(lease)
    elif turn % 3 == 1:
        queue.nack(lease, "x")
    else:
        queue.cancel(lease.job_id)


def key_sizes(env: RedisEnv, prefix: str | None = None) -> dict[str, int]:
    """Every key under ``prefix`` (default: the test's) and how much it holds: its members
    or fields (a string holds 1)."""
    admin = env.admin()
    sizes: dict[str, Callable[[str], int]] = {
        "hash": admin.hlen, "set": admin.scard, "zset": admin.zcard, "list": admin.llen,
    }  # fmt: skip
    out: dict[str, int] = {}
    for key in env.keys(prefix):
        size = sizes.get(text(admin.type(key)))
        out[key] = 1 if size is None else int(size(key))
    return out


def text(value: Any) -> str:
    """A key or a type name as Redis returned it (bytes or str), as text."""
    return value.decode() if isinstance(value, bytes) else str(value)


def effect_store(queue: SharedJobQueue) -> EffectStore:
    """The implementation's ``RedisEffectStore`` over ``queue``."""
    store: EffectStore = stage().RedisEffectStore(queue)
    return store


def race(
    queues: list[SharedJobQueue], act: Callable[[SharedJobQueue, int], list[Any]]
) -> list[Any]:
    """Run ``act(queue, i)`` in one thread per queue, released together by a barrier, with
    a tiny switch interval; every thread's results, concatenated."""
    barrier = threading.Barrier(len(queues))
    results: list[list[Any]] = [[] for _ in queues]

    def run(i: int) -> None:
        barrier.wait(10)
        results[i] = act(queues[i], i)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(queues))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
            assert not t.is_alive(), "a racing thread did not finish within 30 s"
    finally:
        sys.setswitchinterval(old)
    return [r for rs in results for r in rs]


def nested(levels: int) -> Any:
    """A value ``levels`` lists deep: deeper than a queue can carry as JSON."""
    value: Any = "leaf"
    for _ in range(levels):
        value = [value]
    return value


#: A call a queue must refuse: ``call(env, queue, lease)``. The queue is ``Any`` here:
#: these calls break its types on purpose.
BadCall = Callable[[RedisEnv, Any, Lease], Any]


def bad_calls() -> list[Any]:
    """The calls a queue must refuse, each with the parameter its error must name, as
    ``pytest.param``s ``(call, name, case)``, ``case`` also their id."""

    def ctor(**kw: Any) -> BadCall:
        options = {"lease_ns": LEASE, "retry": NO_RETRY_DELAY, "max_attempts": 3, **kw}
        return lambda env, q, lease: stage().RedisJobQueue(
            env.client(), key_prefix=env.prefix, **options
        )

    def enqueue_with(**kw: Any) -> BadCall:
        return lambda env, q, lease: q.enqueue(1, **kw)

    cases: list[tuple[str, BadCall, str]] = [
        ("lease_ns not whole µs", ctor(lease_ns=1_500), "lease_ns"),
        ("lease_ns zero", ctor(lease_ns=0), "lease_ns"),
        ("max_attempts zero", ctor(max_attempts=0), "max_attempts"),
        ("backoff not whole µs", ctor(retry=RetryPolicy(1_500, 3_000, "none")), "base_ns"),
        ("backoff cap not whole µs", ctor(retry=RetryPolicy(1_000, 3_500, "none")), "cap_ns"),
        ("retention not whole µs", ctor(retention_ns=1_500), "retention_ns"),
        ("dedup-ttl-not-whole-us", ctor(dedup_ttl_ns=1_500), "dedup_ttl_ns"),
        ("negative retention", ctor(retention_ns=-1000), "retention_ns"),
        ("negative dedup TTL", ctor(dedup_ttl_ns=-1000), "dedup_ttl_ns"),
        # Beyond what a Lua double holds exactly once added to the server's time (2^52 µs):
        ("max_attempts 2^63 - 1", ctor(max_attempts=2**63 - 1), "max_attempts"),
        ("max_pending 2^63", ctor(max_pending=2**63), "max_pending"),
        ("lease_ns 10^22", ctor(lease_ns=10**22), "lease_ns"),
        ("retention_ns 10^25", ctor(retention_ns=10**25), "retention_ns"),
        ("dedup_ttl_ns 10^22", ctor(dedup_ttl_ns=10**22), "dedup_ttl_ns"),
        ("backoff cap 10^22", ctor(retry=RetryPolicy(1000, 10**22, "none")), "cap_ns"),
        ("delay_ns 10^22", lambda env, q, le: q.enqueue(1, delay_ns=10**22), "delay_ns"),
        # One past the bound (2^52 µs, 2^52), which itself is accepted: the edge exactly.
        ("lease_ns 2^52 us + 1 us", ctor(lease_ns=PAST_THE_BOUND_NS), "lease_ns"),
        ("retention_ns 2^52 us + 1 us", ctor(retention_ns=PAST_THE_BOUND_NS), "retention_ns"),
        ("dedup_ttl_ns 2^52 us + 1 us", ctor(dedup_ttl_ns=PAST_THE_BOUND_NS), "dedup_ttl_ns"),
        (
            "backoff base 2^52 us + 1 us",
            ctor(retry=RetryPolicy(PAST_THE_BOUND_NS, PAST_THE_BOUND_NS, "none")),
            "base_ns",
        ),
        (
            "backoff cap 2^52 us + 1 us",
            ctor(retry=RetryPolicy(1000, PAST_THE_BOUND_NS, "none")),
            "cap_ns",
        ),
        ("max_attempts 2^52 + 1", ctor(max_attempts=LUA_BOUND + 1), "max_attempts"),
        ("max_pending 2^52 + 1", ctor(max_pending=LUA_BOUND + 1), "max_pending"),
        (
            "delay_ns 2^52 us + 1 ns",
            lambda env, q, le: q.enqueue(1, delay_ns=LUA_BOUND * 1000 + 1),
            "delay_ns",
        ),
        (
            "run_at_ns 2^52 us + 1 ns",
            lambda env, q, le: q.enqueue(1, run_at_ns=LUA_BOUND * 1000 + 1),
            "run_at_ns",
        ),
        ("run_at_ns 10^22", lambda env, q, le: q.enqueue(1, run_at_ns=10**22), "run_at_ns"),
        ("a set as payload", lambda env, q, le: q.enqueue({1, 2}), "payload"),
        ("NaN as payload", lambda env, q, le: q.enqueue(float("nan")), "payload"),
        ("an object as payload", lambda env, q, le: q.enqueue(object()), "payload"),
        ("int and str keys", lambda env, q, le: q.enqueue({1: "a", "1": "b"}), "payload"),
        ("5 000 levels deep", lambda env, q, le: q.enqueue(nested(5000)), "payload"),
        ("negative delay", lambda env, q, le: q.enqueue(1, delay_ns=-MS), "delay_ns"),
        (
            "run_at and delay",
            lambda env, q, le: q.enqueue(1, run_at_ns=10**15, delay_ns=MS),
            "delay_ns",
        ),
        (
            "run-at-0-and-delay",
            lambda env, q, le: q.enqueue(1, run_at_ns=0, delay_ns=MS),
            "delay_ns",
        ),
        # Both given is refused whatever the values: a delay of 0 is given too.
        (
            "run-at-and-delay-0",
            lambda env, q, le: q.enqueue(1, run_at_ns=10**15, delay_ns=0),
            "delay_ns",
        ),
        (
            "run-at-0-and-delay-0",
            lambda env, q, le: q.enqueue(1, run_at_ns=0, delay_ns=0),
            "delay_ns",
        ),
        ("negative run_at", lambda env, q, le: q.enqueue(1, run_at_ns=-5), "run_at_ns"),
        # A bool is not an int here (redis-bad-input: as stage 1's bad-input), not even
        # where its value would be a valid one (max_pending=True is 1): every int parameter.
        *[
            (f"{name}={flag}", call_with(**{name: flag}), name)
            for call_with, names in (
                (ctor, ("lease_ns", "max_attempts", "max_pending", "retention_ns", "dedup_ttl_ns")),
                (enqueue_with, ("priority", "run_at_ns", "delay_ns")),
            )
            for name in names
            for flag in (True, False)
        ],
        ("float priority", lambda env, q, le: q.enqueue(1, priority=1.5), "priority"),
        ("empty key", lambda env, q, le: q.enqueue(1, idempotency_key=""), "idempotency_key"),
        ("empty worker id", lambda env, q, le: q.claim(""), "worker_id"),
        ("unserialisable result", lambda env, q, le: q.ack(le, object()), "result"),
        ("non-str error", lambda env, q, le: q.nack(le, 503), "error"),
        ("not a lease", lambda env, q, le: q.ack(("job-1", 1)), "lease"),
        (
            "unserialisable effect",
            lambda env, q, le: stage().RedisEffectStore(q).commit(le, {1, 2}),
            "effect",
        ),
    ]
    return [pytest.param(call, name, case, id=case) for case, call, name in cases]
