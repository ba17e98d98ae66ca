"""Stage 3 — distributed: one limit per key, shared by many nodes through Redis.

Read katas/rate_limiter/README.md (stage 3) first. Three classes:

- ``RedisRateLimiter`` (redis-py): token bucket, sliding log or fixed window, decided
  by a Lua script on Redis so that K nodes behave exactly like one limiter.
- ``AsyncRedisRateLimiter``: the same for ``redis.asyncio`` clients.
- ``RedisConcurrencyLimiter``: at most N requests in flight per key, as a sorted set
  of leases scored by their expiry.

The rules the tests hold you to:

- **One script call per decision** (read, decide, write, expire together: Redis runs a
  script atomically). Use redis-py's ``client.register_script(lua)``: it sends EVALSHA
  and reloads the script on NOSCRIPT (after a restart or ``SCRIPT FLUSH``).
- **Server time**: the script reads ``redis.call('TIME')`` → integer µs. Never send a
  node's clock — node clocks are seconds apart. Windows are whole µs
  (``window_ns % 1000 == 0``, else ValueError).
- Lua 5.1 numbers are doubles: integers are exact below 2^53 (µs epochs fit;
  nanoseconds do not). Pass numbers to ``redis.call`` as ``string.format('%d', x)`` —
  ``tostring`` prints 1.79e+15.
- **Every key written with a TTL in the same script**: 0 < TTL ≤ time-to-fresh + 1 s
  (an expired key must be indistinguishable from a fresh one). Not INCR then EXPIRE as
  two calls; not a TTL refreshed to a whole window on every hit.
- Same semantics as stage 1: a denial consumes nothing; ``retry_after_ns`` exact (in µs
  steps); a cost above the limit never fits (``retry_after_ns is None``, nothing
  written); stored time never decreases.
- Sliding log members must be unique per request (and per unit of cost): a bare
  timestamp as member collapses requests admitted in the same µs.
- Return a ``StampedDecision``: the key's operation counter (bumped by every
  try_acquire whose cost can fit, denied ones included, and by every refund that finds
  the key's state; stored with it) and the server time. Sorting by
  ``(server_time_us, op)`` replays Redis's order.
- ``refund(key, cost)`` gives back unused units (a tokens-per-minute limit charges an
  estimate, then refunds what the call did not use): one script call on server time,
  with stage 1's rules — capped (never above a fresh key's allowance), a fixed window's
  refund for a window that has rolled is dropped, the sliding log removes its newest
  ``cost`` units still inside the window. A key with no state has nothing to give back:
  write nothing. The TTL rule holds after a refund too (it shortens time-to-fresh).
- **Redis Cluster**: a script's keys must all hash to one slot, so put the user key in a
  hash tag no key can break — ``f"{key_prefix}{{k:{key}}}:m"`` gives ``rl:{k:user42}:m``
  and ``rl:{k:user42}:l`` (a bare ``{key}`` is an empty tag for ``""`` or ``"}x"``). A
  ``redis.RedisCluster`` client is accepted; keep the probe interval per master (the
  server a key goes to: ``client.get_node_from_key(name)`` on a cluster client), so one
  dead master sends only its own keys to the failure mode. While a slot migrates, a
  script that touches a key it emptied itself fails halfway, writes kept: the sliding log
  (which can empty its log) must not run then — declare a third key it never writes.
- ``failure_mode`` when Redis is unreachable (``redis.ConnectionError``,
  ``redis.TimeoutError``): "open" admits, "closed" denies (a ``Decision``, never an
  exception), "local" asks an in-process stage-1 limiter allowing
  ``max(1, limit // expected_nodes)``. After a failure skip Redis until
  ``clock.now_ns() >= failure + probe_interval_ns``, then try again (recovery without a
  restart). Count everything in ``statistics()``. A refund that cannot reach Redis is counted
  as a fallback and dropped — in "local" mode it is refunded to the local limiter.
- No ``tracked_keys()``/``sweep()`` (a design decision, unlike stage 1): every key
  expires by its own TTL once it is fresh, so Redis forgets idle keys by itself, and
  counting live keys would need a SCAN of the whole keyspace (of every Cluster node).
- The client must have a ``socket_timeout`` (ValueError otherwise): a blackholed Redis
  would hang every decision.
"""

# TODO(stage3): implement every method below; the docstrings are the contract.

from __future__ import annotations

import redis
import redis.asyncio

from katas._runtime.todo import Todo
from katas.rate_limiter.api import (
    NS_PER_S,
    Clock,
    Decision,
    FailureMode,
    Lease,
    RedisAlgorithm,
    RedisLimiterStats,
)


class RedisRateLimiter:
    """A rate limiter whose state lives in Redis, so many nodes share one limit per key.

    ``algorithm``: "token_bucket" (capacity ``limit``, refilling ``limit`` per
    ``window_ns``), "sliding_log" (at most ``limit`` units in every window
    ``(now - window, now]``) or "fixed_window" (``limit`` per window aligned to the
    server's epoch). Keys live under ``key_prefix``, the user key in a hash tag.
    ``clock`` serves client-side concerns only: when to probe a failed Redis again, and
    the "local" fallback.

    Not a full ``RateLimiter``: no ``tracked_keys()``/``sweep()`` — keys expire by their
    TTL, and counting them would take a SCAN (see the module docstring).
    """

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
        """Validate everything (ValueError/TypeError naming the parameter); no I/O."""
        raise Todo()

    def try_acquire(self, key: str, cost: int = 1) -> Decision:
        """Admit and consume ``cost`` now, or deny and consume nothing: one script call.

        A ``StampedDecision`` when Redis decided; a plain ``Decision`` from the failure mode.
        """
        raise Todo()

    def peek(self, key: str, cost: int = 1) -> Decision:
        """The decision ``try_acquire`` would return now, writing nothing (one script call)."""
        raise Todo()

    def refund(self, key: str, cost: int) -> None:
        """Give back ``cost`` units, capped at a fresh key's allowance (one script call).

        Token bucket: back into the bucket, never above ``limit``. Fixed window: off the
        current window's count, never below 0 (a refund for a rolled window is dropped).
        Sliding log: the newest ``cost`` units still in the window leave the log. A key
        with no state is left alone. Redis unreachable: counted, dropped ("local": the
        local limiter gets the refund).
        """
        raise Todo()

    def reset(self, key: str) -> None:
        """Return ``key`` to fresh (best effort: a Redis failure is counted, not raised)."""
        raise Todo()

    def statistics(self) -> RedisLimiterStats:
        """How decisions were made so far: by Redis, by the failure mode; Redis errors."""
        raise Todo()


class AsyncRedisRateLimiter:
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
        """Validate everything exactly as :class:`RedisRateLimiter` does; no I/O."""
        raise Todo()

    async def try_acquire(self, key: str, cost: int = 1) -> Decision:
        """Admit and consume ``cost`` now, or deny and consume nothing (one round trip)."""
        raise Todo()

    async def peek(self, key: str, cost: int = 1) -> Decision:
        """The decision ``try_acquire`` would return now, changing nothing."""
        raise Todo()

    async def refund(self, key: str, cost: int) -> None:
        """Give back ``cost`` units, capped, exactly as :meth:`RedisRateLimiter.refund`."""
        raise Todo()

    async def reset(self, key: str) -> None:
        """Return ``key`` to fresh (best effort: a Redis failure is counted, not raised)."""
        raise Todo()

    def statistics(self) -> RedisLimiterStats:
        """How decisions were made so far: by Redis, by the failure mode; Redis errors."""
        raise Todo()


class RedisConcurrencyLimiter:
    """At most ``max_in_flight`` leases per key across every node; unreleased leases expire.

    One sorted set per key: members are lease ids, scores their expiry (server µs).
    Acquire drops expired leases, counts, adds — in one script, with the key's TTL set
    to its last lease's expiry. ``lease_ns`` is whole µs.
    """

    def __init__(
        self,
        client: redis.Redis | redis.RedisCluster,
        *,
        max_in_flight: int,
        lease_ns: int,
        key_prefix: str = "cl:",
    ) -> None:
        """Validate everything (ValueError/TypeError naming the parameter); no I/O."""
        raise Todo()

    def try_acquire(self, key: str) -> Lease | None:
        """A lease (unique id, expiry in server ns) if fewer than the cap are held, else None."""
        raise Todo()

    def release(self, lease: Lease) -> bool:
        """Give the slot back; False if it had already been released or had expired."""
        raise Todo()

    def in_flight(self, key: str) -> int:
        """Leases currently held on ``key`` (expired ones do not count)."""
        raise Todo()


__all__ = ["AsyncRedisRateLimiter", "RedisConcurrencyLimiter", "RedisRateLimiter"]
