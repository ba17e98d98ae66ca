"""Stage 3 reference: rate limiting shared by many nodes through Redis.

Design (see katas/rate_limiter/README.md):

- One Lua script per algorithm, one EVALSHA per decision (``redis.commands.core.Script``
  reloads it after NOSCRIPT — a restart or SCRIPT FLUSH). Reading and writing in one
  script is what makes K nodes decide as one: Redis runs scripts one at a time.
- Time comes from the server's ``TIME``. Node clocks disagree by seconds; the injected
  ``clock`` only paces client-side concerns: when to probe a failed Redis again, and
  the local fallback limiter.
- When Redis cannot be reached (connection refused/reset, socket timeout) the decision
  follows ``failure_mode`` — "open": admit; "closed": deny; "local": a stage-1 limiter
  in this process at ``limit // expected_nodes``. After a failure Redis is skipped for
  ``probe_interval_ns`` (a dead server must not cost every request a socket timeout),
  then tried again: recovery needs no restart. Every fallback is counted in stats().
"""

from __future__ import annotations

import secrets
import threading
from fractions import Fraction
from typing import Any

import redis
import redis.asyncio

from katas.rate_limiter.api import (
    NS_PER_S,
    Clock,
    Decision,
    FailureMode,
    Lease,
    RateLimiter,
    RedisAlgorithm,
    RedisLimiterStats,
    StampedDecision,
)

from . import _redis_scripts as lua

_ALGORITHMS = ("token_bucket", "sliding_log", "fixed_window")
_FAILURE_MODES = ("open", "closed", "local")
_MAX_SCALED = 2**51  # limit × window_us: the scripts' doubles stay exact below 2^53
#: What "Redis is unavailable" means; a script error is a bug and is raised.
_UNAVAILABLE = (redis.ConnectionError, redis.TimeoutError)


def _positive_int(name: str, value: object) -> int:
    if type(value) is not int:  # bool is an int subclass, and never a count
        raise TypeError(f"{name} must be a positive int, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be a positive int, got {value}")
    return value


def _check_timeout(client: Any) -> None:
    kwargs = client.get_connection_kwargs() if hasattr(client, "get_connection_kwargs") else {}
    if kwargs.get("socket_timeout") is None:
        raise ValueError(
            "client must have a socket_timeout: without one a blackholed Redis hangs every "
            "decision (e.g. redis.Redis(..., socket_timeout=0.2))"
        )


class _Core:
    """Validation, key layout, reply parsing and failure handling shared by sync and async."""

    def __init__(
        self,
        client: Any,
        *,
        algorithm: RedisAlgorithm,
        limit: int,
        window_ns: int,
        clock: Clock,
        key_prefix: str,
        failure_mode: FailureMode,
        expected_nodes: int,
        probe_interval_ns: int,
    ) -> None:
        if algorithm not in _ALGORITHMS:
            raise ValueError(f"algorithm must be one of {_ALGORITHMS}, got {algorithm!r}")
        self._limit = _positive_int("limit", limit)
        window_ns = _positive_int("window_ns", window_ns)
        if window_ns % 1000:
            raise ValueError(f"window_ns must be a whole number of µs, got {window_ns}")
        if limit * (window_ns // 1000) >= _MAX_SCALED:
            raise ValueError(f"limit × window_ns/1000 must be below 2^51, got {limit}, {window_ns}")
        if failure_mode not in _FAILURE_MODES:
            raise ValueError(f"failure_mode must be one of {_FAILURE_MODES}, got {failure_mode!r}")
        self._nodes = _positive_int("expected_nodes", expected_nodes)
        if not isinstance(key_prefix, str) or not key_prefix:
            raise ValueError(f"key_prefix must be a non-empty str, got {key_prefix!r}")
        if type(probe_interval_ns) is not int or probe_interval_ns < 0:
            raise ValueError(f"probe_interval_ns must be an int >= 0, got {probe_interval_ns!r}")
        if not callable(getattr(clock, "now_ns", None)):
            raise TypeError(f"clock must have now_ns(), got {clock!r}")
        _check_timeout(client)
        self._client = client
        self._algorithm = algorithm
        self._window_ns = window_ns
        self._args = (b"%d" % limit, b"%d" % (window_ns // 1000))  # encoded once, not per call
        self._clock = clock
        self._prefix = key_prefix
        self._mode = failure_mode
        self._probe_ns = probe_interval_ns
        self._script = client.register_script(lua.SCRIPTS[algorithm])
        self._lock = threading.Lock()
        self._retry_at_ns: int | None = None  # skip Redis until then (client clock)
        self._counts = [0, 0, 0]  # redis decisions, fallback decisions, redis errors
        self._local = self._local_limiter() if failure_mode == "local" else None

    def _local_limiter(self) -> RateLimiter:
        from . import stage1  # the stage-1 limiters, at this node's share of the limit

        share = max(1, self._limit // self._nodes)
        if self._algorithm == "token_bucket":
            rate = Fraction(share * NS_PER_S, self._window_ns)
            return stage1.TokenBucket(capacity=share, refill_per_s=rate, clock=self._clock)
        if self._algorithm == "sliding_log":
            return stage1.SlidingLog(limit=share, window_ns=self._window_ns, clock=self._clock)
        return stage1.FixedWindow(limit=share, window_ns=self._window_ns, clock=self._clock)

    def _keys(self, key: str) -> list[str]:
        if not isinstance(key, str):
            raise TypeError(f"key must be a str, got {key!r}")
        meta = f"{self._prefix}m:{key}"
        return [meta, f"{self._prefix}l:{key}"] if self._algorithm == "sliding_log" else [meta]

    def _call_args(self, key: str, cost: int, mode: bytes) -> tuple[list[str], list[Any]]:
        return self._keys(key), [*self._args, _positive_int("cost", cost), mode]

    def _should_try(self) -> bool:
        retry_at = self._retry_at_ns  # one read: no lock needed on the hot path
        return retry_at is None or self._clock.now_ns() >= retry_at

    def _decided(self, reply: bytes | str) -> StampedDecision:
        allowed, remaining, retry_us, reset_us, op, now_us = map(int, reply.split())
        with self._lock:
            self._retry_at_ns = None  # Redis answers: stop skipping it
            self._counts[0] += 1
        retry_ns = None if retry_us < 0 else retry_us * 1000
        return StampedDecision(
            allowed == 1, self._limit, remaining, retry_ns, reset_us * 1000, op, now_us
        )

    def _failed(self) -> None:
        with self._lock:
            self._counts[2] += 1
            self._retry_at_ns = self._clock.now_ns() + self._probe_ns

    def _fallback(self, key: str, cost: int, acquire: bool) -> Decision:
        with self._lock:
            self._counts[1] += 1
            if self._local is not None:
                local = self._local
                return local.try_acquire(key, cost) if acquire else local.peek(key, cost)
            wait = max(1, (self._retry_at_ns or 0) - self._clock.now_ns())
        if cost > self._limit:
            return Decision(False, self._limit, 0, None, 0)
        if self._mode == "open":
            return Decision(True, self._limit, self._limit - cost, 0, 0)
        # closed: deny, and suggest retrying when Redis will next be asked
        return Decision(False, self._limit, 0, wait, 0)

    def _stats(self) -> RedisLimiterStats:
        with self._lock:
            return RedisLimiterStats(*self._counts)


class RedisRateLimiter(_Core):
    """A rate limiter whose state lives in Redis, so many nodes share one limit per key."""

    def __init__(
        self,
        client: redis.Redis,
        *,
        algorithm: RedisAlgorithm,
        limit: int,
        window_ns: int,
        clock: Clock,
        key_prefix: str = "rl:",
        failure_mode: FailureMode = "open",
        expected_nodes: int = 1,
        probe_interval_ns: int = NS_PER_S,
    ) -> None:
        super().__init__(
            client,
            algorithm=algorithm,
            limit=limit,
            window_ns=window_ns,
            clock=clock,
            key_prefix=key_prefix,
            failure_mode=failure_mode,
            expected_nodes=expected_nodes,
            probe_interval_ns=probe_interval_ns,
        )

    def _decide(self, key: str, cost: int, mode: bytes) -> Decision:
        keys, args = self._call_args(key, cost, mode)
        if self._should_try():
            try:
                return self._decided(self._script(keys=keys, args=args, client=self._client))
            except _UNAVAILABLE:
                self._failed()
        return self._fallback(key, cost, acquire=mode == b"a")

    def try_acquire(self, key: str, cost: int = 1) -> Decision:
        """Admit and consume ``cost`` now, or deny and consume nothing (one round trip)."""
        return self._decide(key, cost, b"a")

    def peek(self, key: str, cost: int = 1) -> Decision:
        """The decision ``try_acquire`` would return now, changing nothing."""
        return self._decide(key, cost, b"p")

    def reset(self, key: str) -> None:
        """Return ``key`` to fresh (best effort: a Redis failure is counted, not raised)."""
        keys = self._keys(key)
        try:
            self._client.delete(*keys)
        except _UNAVAILABLE:
            self._failed()
        if self._local is not None:
            with self._lock:
                self._local.reset(key)

    def stats(self) -> RedisLimiterStats:
        """How decisions were made so far: by Redis, by the failure mode; Redis errors."""
        return self._stats()


class AsyncRedisRateLimiter(_Core):
    """:class:`RedisRateLimiter` for ``redis.asyncio`` clients (asyncio only)."""

    def __init__(
        self,
        client: redis.asyncio.Redis,
        *,
        algorithm: RedisAlgorithm,
        limit: int,
        window_ns: int,
        clock: Clock,
        key_prefix: str = "rl:",
        failure_mode: FailureMode = "open",
        expected_nodes: int = 1,
        probe_interval_ns: int = NS_PER_S,
    ) -> None:
        super().__init__(
            client,
            algorithm=algorithm,
            limit=limit,
            window_ns=window_ns,
            clock=clock,
            key_prefix=key_prefix,
            failure_mode=failure_mode,
            expected_nodes=expected_nodes,
            probe_interval_ns=probe_interval_ns,
        )

    async def _decide(self, key: str, cost: int, mode: bytes) -> Decision:
        keys, args = self._call_args(key, cost, mode)
        if self._should_try():
            try:
                return self._decided(await self._script(keys=keys, args=args, client=self._client))
            except _UNAVAILABLE:
                self._failed()
        return self._fallback(key, cost, acquire=mode == b"a")

    async def try_acquire(self, key: str, cost: int = 1) -> Decision:
        """Admit and consume ``cost`` now, or deny and consume nothing (one round trip)."""
        return await self._decide(key, cost, b"a")

    async def peek(self, key: str, cost: int = 1) -> Decision:
        """The decision ``try_acquire`` would return now, changing nothing."""
        return await self._decide(key, cost, b"p")

    async def reset(self, key: str) -> None:
        """Return ``key`` to fresh (best effort: a Redis failure is counted, not raised)."""
        keys = self._keys(key)
        try:
            await self._client.delete(*keys)
        except _UNAVAILABLE:
            self._failed()
        if self._local is not None:
            self._local.reset(key)

    def stats(self) -> RedisLimiterStats:
        """How decisions were made so far: by Redis, by the failure mode; Redis errors."""
        return self._stats()


class RedisConcurrencyLimiter:
    """At most ``max_in_flight`` leases per key across every node; unreleased leases expire."""

    def __init__(
        self, client: redis.Redis, *, max_in_flight: int, lease_ns: int, key_prefix: str = "cl:"
    ) -> None:
        self._max = _positive_int("max_in_flight", max_in_flight)
        if _positive_int("lease_ns", lease_ns) % 1000:
            raise ValueError(f"lease_ns must be a whole number of µs (Redis TIME), got {lease_ns}")
        if not isinstance(key_prefix, str) or not key_prefix:
            raise ValueError(f"key_prefix must be a non-empty str, got {key_prefix!r}")
        _check_timeout(client)
        self._client = client
        self._lease_us = lease_ns // 1000
        self._prefix = key_prefix
        self._acquire = client.register_script(lua.LEASE_ACQUIRE)
        self._release = client.register_script(lua.LEASE_RELEASE)
        self._count = client.register_script(lua.LEASE_COUNT)

    def _key(self, key: str) -> str:
        if not isinstance(key, str):
            raise TypeError(f"key must be a str, got {key!r}")
        return f"{self._prefix}{key}"

    def try_acquire(self, key: str) -> Lease | None:
        """A lease if fewer than ``max_in_flight`` are held on ``key``, else None."""
        lease_id = secrets.randbits(62)  # unique without a counter that would need a TTL
        ok, _held, now_us = self._acquire(
            keys=[self._key(key)], args=[self._max, self._lease_us, lease_id], client=self._client
        )
        if not ok:
            return None
        return Lease(key, lease_id, (int(now_us) + self._lease_us) * 1000)

    def release(self, lease: Lease) -> bool:
        """Give the slot back; False if it had already been released or had expired."""
        removed = self._release(keys=[self._key(lease.key)], args=[lease.id], client=self._client)
        return bool(removed)

    def in_flight(self, key: str) -> int:
        """Leases currently held on ``key`` (expired ones do not count)."""
        return int(self._count(keys=[self._key(key)], client=self._client))


__all__ = ["AsyncRedisRateLimiter", "RedisConcurrencyLimiter", "RedisRateLimiter"]
