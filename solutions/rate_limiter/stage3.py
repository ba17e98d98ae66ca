"""Stage 3 reference: rate limiting shared by many nodes through Redis.

Design (see katas/rate_limiter/README.md):

- One Lua script per algorithm, one EVALSHA per decision or refund
  (``redis.commands.core.Script`` reloads it after NOSCRIPT — a restart or SCRIPT
  FLUSH). Reading and writing in one script is what makes K nodes decide as one: Redis
  runs scripts one at a time.
- A key's Redis keys share a hash tag, ``rl:{k:user42}:m`` and ``rl:{k:user42}:l``: in
  Redis Cluster every key a script touches must live in one slot, and the ``k:`` keeps
  the tag whole for any user key (``""``, ``"}x"``).
- Time comes from the server's ``TIME``. Node clocks disagree by seconds; the injected
  ``clock`` only paces client-side concerns: when to probe a failed Redis again, and
  the local fallback limiter.
- When Redis cannot be reached (connection refused/reset, socket timeout) the decision
  follows ``failure_mode`` — "open": admit; "closed": deny; "local": a stage-1 limiter
  in this process at ``limit // expected_nodes``. After a failure Redis is skipped for
  ``probe_interval_ns`` (a dead server must not cost every request a socket timeout),
  then tried again: recovery needs no restart. On a cluster each master has its own
  interval: one dead master sends only its own keys to the failure mode. Every fallback
  is counted in statistics().
  A refund Redis does not get is counted and dropped ("local": the local limiter gets it).
- Validation, key names, reply parsing and failure bookkeeping are shared by the sync
  and async limiters (``_redis_core.py``); they differ only in awaiting the script.
- No ``tracked_keys``/``sweep``: every key expires by its TTL once it is fresh, so
  Redis forgets idle keys by itself; counting them would take a SCAN of the keyspace.
"""

from __future__ import annotations

import secrets

import redis
import redis.asyncio

from katas._runtime.redis_errors import REDIS_FAILURES
from katas.rate_limiter.api import (
    NS_PER_S,
    Clock,
    Decision,
    FailureMode,
    Lease,
    RedisAlgorithm,
    RedisLimiterStats,
    check_client,
    unavailable,
)

from . import _redis_scripts as lua
from ._redis_core import RedisCore, positive_int


class RedisRateLimiter(RedisCore):
    """A rate limiter whose state lives in Redis, so many nodes share one limit per key."""

    def __init__(
        self,
        client: redis.Redis | redis.RedisCluster,
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
        keys, args, server = self._call_args(key, cost, mode)
        if self._should_try(server):
            try:
                reply = self._script(keys=keys, args=args, client=self._client)
                return self._decided(reply, server)
            except REDIS_FAILURES as error:
                if not unavailable(error):  # a bug (a script error) is raised
                    raise
                self._failed(server)
        return self._fallback(key, cost, acquire=mode == b"a", server=server)

    def try_acquire(self, key: str, cost: int = 1) -> Decision:
        """Admit and consume ``cost`` now, or deny and consume nothing (one round trip)."""
        return self._decide(key, cost, b"a")

    def peek(self, key: str, cost: int = 1) -> Decision:
        """The decision ``try_acquire`` would return now, changing nothing."""
        return self._decide(key, cost, b"p")

    def refund(self, key: str, cost: int) -> None:
        """Give back ``cost`` units, capped, in one script call (Redis down: failure mode)."""
        keys, args, server = self._call_args(key, cost, b"r")
        if self._should_try(server):
            try:
                self._decided(self._script(keys=keys, args=args, client=self._client), server)
                return
            except REDIS_FAILURES as error:
                if not unavailable(error):  # a bug (a script error) is raised
                    raise
                self._failed(server)
        self._refund_fallback(key, cost)

    def reset(self, key: str) -> None:
        """Return ``key`` to fresh (best effort: a Redis failure is counted, not raised)."""
        keys = self._keys(key)
        try:
            # one DEL, not delete(): a cluster client splits that into a pipeline, whose
            # errors come back as text ("Command # 1 ... caused error: BUSY ...")
            self._client.execute_command("DEL", *keys)
        except REDIS_FAILURES as error:
            if not unavailable(error):  # a bug (a script error) is raised
                raise
            self._failed(self._server_of(keys[0]))
        if self._local is not None:
            with self._lock:
                self._local.reset(key)

    def statistics(self) -> RedisLimiterStats:
        """How decisions were made so far: by Redis, by the failure mode; Redis errors."""
        return self._stats()


class AsyncRedisRateLimiter(RedisCore):
    """:class:`RedisRateLimiter` for ``redis.asyncio`` clients (asyncio only)."""

    def __init__(
        self,
        client: redis.asyncio.Redis | redis.asyncio.RedisCluster,
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
        keys, args, server = self._call_args(key, cost, mode)
        if self._should_try(server):
            try:
                reply = await self._script(keys=keys, args=args, client=self._client)
                return self._decided(reply, server)
            except REDIS_FAILURES as error:
                if not unavailable(error):  # a bug (a script error) is raised
                    raise
                self._failed(server)
        return self._fallback(key, cost, acquire=mode == b"a", server=server)

    async def try_acquire(self, key: str, cost: int = 1) -> Decision:
        """Admit and consume ``cost`` now, or deny and consume nothing (one round trip)."""
        return await self._decide(key, cost, b"a")

    async def peek(self, key: str, cost: int = 1) -> Decision:
        """The decision ``try_acquire`` would return now, changing nothing."""
        return await self._decide(key, cost, b"p")

    async def refund(self, key: str, cost: int) -> None:
        """Give back ``cost`` units, capped, in one script call (Redis down: failure mode)."""
        keys, args, server = self._call_args(key, cost, b"r")
        if self._should_try(server):
            try:
                self._decided(await self._script(keys=keys, args=args, client=self._client), server)
                return
            except REDIS_FAILURES as error:
                if not unavailable(error):  # a bug (a script error) is raised
                    raise
                self._failed(server)
        self._refund_fallback(key, cost)

    async def reset(self, key: str) -> None:
        """Return ``key`` to fresh (best effort: a Redis failure is counted, not raised)."""
        keys = self._keys(key)
        try:
            await self._client.execute_command("DEL", *keys)  # one DEL (see the sync reset)
        except REDIS_FAILURES as error:
            if not unavailable(error):  # a bug (a script error) is raised
                raise
            self._failed(self._server_of(keys[0]))
        if self._local is not None:
            self._local.reset(key)

    def statistics(self) -> RedisLimiterStats:
        """How decisions were made so far: by Redis, by the failure mode; Redis errors."""
        return self._stats()


class RedisConcurrencyLimiter:
    """At most ``max_in_flight`` leases per key across every node; unreleased leases expire."""

    def __init__(
        self,
        client: redis.Redis | redis.RedisCluster,
        *,
        max_in_flight: int,
        lease_ns: int,
        key_prefix: str = "cl:",
    ) -> None:
        self._max = positive_int("max_in_flight", max_in_flight)
        if positive_int("lease_ns", lease_ns) % 1000:
            raise ValueError(f"lease_ns must be a whole number of µs (Redis TIME), got {lease_ns}")
        if not isinstance(key_prefix, str) or not key_prefix:
            raise ValueError(f"key_prefix must be a non-empty str, got {key_prefix!r}")
        check_client(client)
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
