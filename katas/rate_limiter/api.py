"""The rate-limiter contract: types shared by stubs, solutions and tests. Do not edit.

Every duration is an integer number of nanoseconds; every cost a positive ``int``.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Literal, Protocol

from katas._runtime.clients import check_client, to_json, unavailable
from katas._runtime.clock import NS_PER_S, Clock, ManualClock, MonotonicClock, WaitingClock


@dataclass(slots=True)
class Decision:
    """What a limiter decided for one request.

    - ``allowed``: the request was admitted (and its cost consumed).
    - ``limit``: the limiter's capacity (bucket size, or requests per window).
    - ``remaining``: whole units available right after this decision (floored).
    - ``retry_after_ns``: 0 when allowed; ``None`` when the cost can never fit; otherwise
      the exact wait after which the same request is admitted (with no other traffic),
      one nanosecond less being too early.
    - ``reset_after_ns``: time until the key is back to its fresh (full/empty) state.

    A value: never change one after it is returned. It is not ``frozen``: a frozen
    dataclass sets each field through ``object.__setattr__``, and building one was nearly
    half of a whole stage-1 decision (a token bucket's); with ``slots`` it costs a quarter
    of that, five plain attribute stores. So it is not hashable either: key by its fields.
    """

    allowed: bool
    limit: int
    remaining: int
    retry_after_ns: int | None
    reset_after_ns: int


class RateLimiter(Protocol):
    """Anything that decides requests per key. Keys are independent of one another."""

    def try_acquire(self, key: str, cost: int = 1) -> Decision:
        """Admit and consume ``cost`` units now, or deny and consume nothing."""
        ...

    def peek(self, key: str, cost: int = 1) -> Decision:
        """The decision ``try_acquire`` would return now, changing nothing."""
        ...

    def refund(self, key: str, cost: int) -> None:
        """Give back ``cost`` units (capped: never above a fresh key's allowance)."""
        ...

    def reset(self, key: str) -> None:
        """Return ``key`` to its fresh state."""
        ...

    def tracked_keys(self) -> int:
        """How many keys hold state that differs from fresh (idle keys are forgotten)."""
        ...

    def sweep(self) -> int:
        """Forget every key that is back to its fresh state now; return how many.

        Limiters built with ``auto_sweep=True`` (the default) also sweep by themselves,
        amortised O(1) per new key, so memory stays bounded by recently active keys;
        with ``auto_sweep=False`` only this call forgets keys.
        """
        ...


FixedWindowAlign = Literal["epoch", "first_hit"]

__all__ = [
    "NS_PER_S",
    "Clock",
    "Decision",
    "FixedWindowAlign",
    "ManualClock",
    "MonotonicClock",
    "RateLimiter",
    "WaitingClock",
    "check_client",
    "to_json",
    "unavailable",
]


# --- Stage 2: concurrency ------------------------------------------------------------


class SweepableLimiter(RateLimiter, Protocol):
    """A stage-1 limiter: a :class:`RateLimiter` that forgets idle keys when told to.

    Built with ``auto_sweep=False`` it never sweeps on its own, so a wrapper that
    locks per key can run the sweep (which touches every key) under all its locks.
    """

    def sweep(self) -> int:
        """Forget every key that is back to its fresh state now; return how many."""
        ...


@dataclass(frozen=True)
class LimiterStatistics:
    """A snapshot of callers blocked in ``acquire``, for observation and tests.

    - ``waiters``: callers currently queued, over all keys.
    - ``waiters_by_key``: queued callers per key (keys without waiters are absent).
    """

    waiters: int
    waiters_by_key: dict[str, int]


@dataclass(frozen=True)
class Lease:
    """One admitted in-flight request of a :class:`ConcurrencyLimiter`.

    ``id`` is unique within its limiter; the lease is reclaimed at ``expires_at_ns``
    if its holder never releases it (the holder crashed or forgot).
    """

    key: str
    id: int
    expires_at_ns: int


@dataclass(frozen=True)
class ConcurrencyStatistics:
    """A snapshot of a :class:`ConcurrencyLimiter`.

    - ``in_flight``: leases currently held, over all keys.
    - ``in_flight_by_key``: leases held per key (keys holding none are absent).
    - ``expired``: leases reclaimed so far because their holder let them expire.
    """

    in_flight: int
    in_flight_by_key: dict[str, int]
    expired: int


class BlockingLimiter(RateLimiter, Protocol):
    """A :class:`RateLimiter` many threads share, whose callers can also wait their turn.

    Implemented by stage 2's ``ThreadSafeLimiter``.
    """

    def acquire(self, key: str, cost: int = 1, *, timeout_ns: int | None = None) -> bool:
        """Block until ``cost`` is admitted (True) or ``timeout_ns`` has passed (False);
        FIFO per key, ``None`` waits forever, ``0`` never waits."""
        ...

    def statistics(self) -> LimiterStatistics:
        """Callers blocked in ``acquire``: in total and per key."""
        ...


class AsyncRateLimiter(Protocol):
    """A limiter for the anyio tasks of one event loop: waiting is awaited and cancellable.

    Implemented by stage 2's ``AsyncLimiter``. Not a :class:`RateLimiter`: no ``peek``,
    ``reset``, ``tracked_keys`` or ``sweep``; ``acquire`` and ``limit`` wait instead.
    """

    def try_acquire(self, key: str, cost: int = 1) -> Decision:
        """Admit now or deny (consuming nothing); always denied while ``key`` has waiters."""
        ...

    async def acquire(self, key: str, cost: int = 1, *, timeout_ns: int | None = None) -> bool:
        """Wait until ``cost`` is admitted (True) or ``timeout_ns`` has passed (False);
        FIFO per key; a waiter cancelled or timed out consumes nothing."""
        ...

    def limit(self, key: str, cost: int = 1) -> AbstractAsyncContextManager[None]:
        """``async with limiter.limit(key, cost):`` — wait for admission, then run the body."""
        ...

    def refund(self, key: str, cost: int) -> None:
        """Give back ``cost`` units (capped); waiters that now fit are admitted."""
        ...

    def statistics(self) -> LimiterStatistics:
        """Tasks waiting in ``acquire``: in total and per key."""
        ...


class LeaseLimiter(Protocol):
    """At most N requests in flight per key, each holding a :class:`Lease` that expires.

    One surface for stage 2's ``ConcurrencyLimiter`` (in one process) and stage 3's
    ``RedisConcurrencyLimiter`` (across nodes, on Redis).
    """

    def try_acquire(self, key: str) -> Lease | None:
        """A lease for one request on ``key``, or None while the key is full; never waits."""
        ...

    def release(self, lease: Lease) -> bool:
        """End ``lease``; True if it was still held (idempotent: then False)."""
        ...

    def in_flight(self, key: str) -> int:
        """Leases currently held on ``key`` (expired ones do not count)."""
        ...


class InProcessLeaseLimiter(LeaseLimiter, Protocol):
    """A :class:`LeaseLimiter` in one process, which can also count what it holds.

    Implemented by stage 2's ``ConcurrencyLimiter``.
    """

    def statistics(self) -> ConcurrencyStatistics:
        """Leases held in total and per key, and how many have expired so far."""
        ...


__all__ += [
    "AsyncRateLimiter",
    "BlockingLimiter",
    "ConcurrencyStatistics",
    "InProcessLeaseLimiter",
    "Lease",
    "LeaseLimiter",
    "LimiterStatistics",
    "SweepableLimiter",
]


# --- Stage 1: several limits at once ---------------------------------------------------


@dataclass(frozen=True)
class MultiDecision:
    """What a ``MultiLimiter`` decided for one request charged to several limits.

    - ``allowed``: every charged limit admitted it and consumed its cost; when False,
      no limit consumed anything.
    - ``retry_after_ns``: 0 when allowed; ``None`` when some limit can never fit its
      cost; otherwise the exact wait after which every limit admits it (with no other
      traffic) — the longest wait among the denying limits.
    - ``decisions``: per charged limit (cost > 0), that limit's :class:`Decision`. On a
      denial each one is what that limit alone would decide (its ``peek``): a limit
      may say ``allowed`` there although nothing was consumed.
    """

    allowed: bool
    retry_after_ns: int | None
    decisions: Mapping[str, Decision]


class MultiRateLimiter(Protocol):
    """Several named limits charged together for one request: all of them, or none.

    Implemented by stage 1's ``MultiLimiter``. ``costs`` maps a limit's name to what the
    request costs there; a limit it does not name (or names with 0) is not charged.
    """

    def peek(self, key: str, costs: Mapping[str, int]) -> MultiDecision:
        """The decision ``try_acquire`` would return now, changing nothing."""
        ...

    def try_acquire(self, key: str, costs: Mapping[str, int]) -> MultiDecision:
        """Charge every named limit, or (when any denies) none of them."""
        ...

    def refund(self, key: str, costs: Mapping[str, int]) -> None:
        """Give back units to each named limit (each capped)."""
        ...

    def reset(self, key: str) -> None:
        """Return ``key`` to its fresh state in every limit."""
        ...

    def sweep(self) -> int:
        """Sweep every limit; return how many keys were forgotten in all."""
        ...


__all__ += ["MultiDecision", "MultiRateLimiter"]


# --- Stage 3: distributed (Redis) ----------------------------------------------------

#: The algorithms a Redis limiter runs server-side.
RedisAlgorithm = Literal["token_bucket", "sliding_log", "fixed_window"]

#: What a Redis limiter decides when Redis cannot be reached (refused, reset, timed out):
#: "open" admits; "closed" denies with a :class:`Decision` (``allowed=False``,
#: ``remaining=0``, ``retry_after_ns`` = time until Redis is next tried, ``reset_after_ns=0``)
#: — a connection error never reaches the caller, whatever the mode; "local" decides with
#: an in-process limiter allowing ``limit // expected_nodes`` (at least 1) on this node.
FailureMode = Literal["open", "closed", "local"]


@dataclass(slots=True)
class StampedDecision(Decision):
    """A :class:`Decision` made by the Redis script, stamped so decisions can be ordered.

    - ``op``: the key's operation counter after this decision. Every ``try_acquire``
      whose cost can fit bumps it (denied ones too); ``peek`` and a cost above the limit
      leave it. It starts again at 1 once the key has expired back to fresh.
    - ``server_time_us``: the server's ``TIME`` when it decided, integer microseconds.

    Ordered by ``(server_time_us, op)``, the decisions on one key replay exactly in the
    order Redis made them. A decision made by a failure mode is a plain ``Decision``.
    """

    op: int
    server_time_us: int


@dataclass(frozen=True)
class RedisLimiterStats:
    """How a Redis limiter's decisions were made, since it was created.

    - ``redis_decisions``: decided by the script on Redis.
    - ``fallback_decisions``: decided by the failure mode (Redis failed, or was being
      skipped until its next probe).
    - ``redis_errors``: calls to Redis that failed (connection refused/reset, timeout).
    """

    redis_decisions: int
    fallback_decisions: int
    redis_errors: int


__all__ += ["FailureMode", "RedisAlgorithm", "RedisLimiterStats", "StampedDecision"]


class RedisLimiter(Protocol):
    """A limit per key that many nodes share through Redis: one script call a decision.

    Implemented by stage 3's ``RedisRateLimiter``. Not a :class:`RateLimiter`: no
    ``tracked_keys``/``sweep``, as every key expires on Redis by its own TTL.
    """

    def try_acquire(self, key: str, cost: int = 1) -> Decision:
        """Admit and consume ``cost`` now, or deny and consume nothing; a
        :class:`StampedDecision` when Redis decided, a plain ``Decision`` from the failure
        mode."""
        ...

    def peek(self, key: str, cost: int = 1) -> Decision:
        """The decision ``try_acquire`` would return now, writing nothing."""
        ...

    def refund(self, key: str, cost: int) -> None:
        """Give back ``cost`` units, capped at a fresh key's allowance."""
        ...

    def reset(self, key: str) -> None:
        """Return ``key`` to fresh (best effort: a Redis failure is counted, not raised)."""
        ...

    def statistics(self) -> RedisLimiterStats:
        """How decisions were made so far: by Redis, by the failure mode; Redis errors."""
        ...


class AsyncRedisLimiter(Protocol):
    """:class:`RedisLimiter` for ``redis.asyncio`` clients: every call to Redis is awaited.

    Implemented by stage 3's ``AsyncRedisRateLimiter``.
    """

    async def try_acquire(self, key: str, cost: int = 1) -> Decision:
        """Admit and consume ``cost`` now, or deny and consume nothing (one round trip)."""
        ...

    async def peek(self, key: str, cost: int = 1) -> Decision:
        """The decision ``try_acquire`` would return now, changing nothing."""
        ...

    async def refund(self, key: str, cost: int) -> None:
        """Give back ``cost`` units, capped at a fresh key's allowance."""
        ...

    async def reset(self, key: str) -> None:
        """Return ``key`` to fresh (best effort: a Redis failure is counted, not raised)."""
        ...

    def statistics(self) -> RedisLimiterStats:
        """How decisions were made so far: by Redis, by the failure mode; Redis errors."""
        ...


__all__ += ["AsyncRedisLimiter", "RedisLimiter"]
