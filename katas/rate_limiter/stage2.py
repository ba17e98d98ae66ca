"""Stage 2 — concurrent: the stage-1 limiters shared by many threads and many tasks.

Read katas/rate_limiter/README.md (stage 2) first. Three classes:

- ``ThreadSafeLimiter`` wraps any stage-1 limiter (built with ``auto_sweep=False``) with
  per-key striped locks, and adds a blocking ``acquire`` that is FIFO per key.
- ``AsyncLimiter`` does the same for anyio tasks, on asyncio and on trio.
- ``ConcurrencyLimiter`` caps the requests *in flight* per key with expiring leases.

Time: every duration is an int of nanoseconds, from the injected clock. Never sleep
for real: wait with ``clock.wait_until_ns(cond, deadline_ns)`` (threads; ``cond`` held)
or ``await clock.sleep_until_ns_async(deadline_ns)`` (tasks), so that the tests'
``ManualClock.advance`` wakes your waiters.

Bad arguments (``stripes < 1``, a negative ``timeout_ns``, a cost that is not a
positive int — ``True`` is not an int here) raise ValueError/TypeError naming the
parameter.
"""

# TODO(stage2): implement every method below; the docstrings are the contract.

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from katas._runtime.todo import Todo
from katas.rate_limiter.api import (
    Clock,
    ConcurrencyStatistics,
    Decision,
    Lease,
    LimiterStatistics,
    RateLimiter,
    SweepableLimiter,
    WaitingClock,
)


class ThreadSafeLimiter:
    """Any stage-1 limiter, safe for many threads, with a blocking FIFO ``acquire``.

    - One lock per *stripe* (``hash(key) % stripes``), not one global lock: threads on
      different keys rarely contend. A stripe's lock guards both the inner limiter's
      state for its keys and the queue of callers waiting on those keys.
    - The inner limiter is built with ``auto_sweep=False`` and the same clock: sweeping
      walks every key, so it must hold every stripe. The wrapper sweeps on ``sweep()``
      and by itself every so many operations (amortised O(1) per operation).
    - While a key has waiters, ``try_acquire`` on it is denied: nobody overtakes them.
    """

    def __init__(self, inner: SweepableLimiter, *, clock: WaitingClock, stripes: int = 64) -> None:
        raise Todo()

    def try_acquire(self, key: str, cost: int = 1) -> Decision:
        """Admit now or deny (consuming nothing); always denied while ``key`` has waiters."""
        raise Todo()

    def peek(self, key: str, cost: int = 1) -> Decision:
        """What ``try_acquire`` would decide now, changing nothing."""
        raise Todo()

    def acquire(self, key: str, cost: int = 1, *, timeout_ns: int | None = None) -> bool:
        """Block until ``cost`` is admitted (True) or ``timeout_ns`` has passed (False).

        - FIFO per key: the waiters on one key are admitted in arrival order.
        - Admitted if the cost fits at or before ``now + timeout_ns``; ``None`` waits
          forever, ``0`` never waits.
        - A cost that can never fit returns False at once.
        - A caller that times out consumes nothing and does not hold up those behind it.
        """
        raise Todo()

    def refund(self, key: str, cost: int) -> None:
        """Give back ``cost`` units (capped); waiters that now fit are admitted."""
        raise Todo()

    def reset(self, key: str) -> None:
        """Return ``key`` to its fresh state; its waiters look again."""
        raise Todo()

    def tracked_keys(self) -> int:
        """The inner limiter's ``tracked_keys()``, read consistently under every stripe."""
        raise Todo()

    def sweep(self) -> int:
        """Holding every stripe, forget idle keys now; return how many were forgotten."""
        raise Todo()

    def statistics(self) -> LimiterStatistics:
        """Callers blocked in ``acquire``: in total and per key (keys with none absent)."""
        raise Todo()


class AsyncLimiter:
    """Any stage-1 limiter for the anyio tasks of one event loop (asyncio or trio).

    Code between two ``await``s runs alone on the loop, so no lock is needed; the
    hard parts are waiting (through the clock) and cancellation.
    """

    def __init__(self, inner: RateLimiter, *, clock: WaitingClock) -> None:
        raise Todo()

    def try_acquire(self, key: str, cost: int = 1) -> Decision:
        """Admit now or deny (consuming nothing); always denied while ``key`` has waiters."""
        raise Todo()

    async def acquire(self, key: str, cost: int = 1, *, timeout_ns: int | None = None) -> bool:
        """Wait until ``cost`` is admitted (True) or ``timeout_ns`` has passed (False).

        FIFO per key, like ``ThreadSafeLimiter.acquire``. A waiter that is cancelled or
        times out consumes nothing and lets those behind it go ahead. A cancellation
        point, like every blocking call in trio.
        """
        raise Todo()

    @asynccontextmanager
    async def limit(self, key: str, cost: int = 1) -> AsyncIterator[None]:
        """``async with limiter.limit(key, cost):`` — wait for admission, then run the body.

        The units are spent on entry (this limits a rate, not concurrency): leaving the
        block gives nothing back. A cost that can never fit raises ValueError naming
        ``cost`` instead of running the body unadmitted.
        """
        raise Todo()
        yield  # an async generator, so that @asynccontextmanager applies

    def refund(self, key: str, cost: int) -> None:
        """Give back ``cost`` units (capped); waiters that now fit are admitted."""
        raise Todo()

    def statistics(self) -> LimiterStatistics:
        """Tasks waiting in ``acquire``: in total and per key (keys with none absent)."""
        raise Todo()


class ConcurrencyLimiter:
    """At most ``max_in_flight`` requests in flight per key; thread-safe.

    ``try_acquire`` grants a :class:`Lease` (a unique ``id``; it expires at
    ``expires_at_ns = now + lease_ns``) or returns None when the key is full. A lease
    whose holder never releases it is reclaimed when it expires, so a crashed client
    cannot hold a slot forever. ``lease_ns`` and ``max_in_flight`` are positive ints.
    """

    def __init__(self, *, max_in_flight: int, lease_ns: int, clock: Clock) -> None:
        raise Todo()

    def try_acquire(self, key: str) -> Lease | None:
        """A lease for one request on ``key``, or None while ``max_in_flight`` are held.

        Never waits: like every non-blocking call here, its name says ``try_``.
        """
        raise Todo()

    def release(self, lease: Lease) -> bool:
        """End ``lease``; True if it was still held.

        Idempotent: releasing twice, or after the lease expired, changes nothing and
        returns False (that slot may belong to another request by now).
        """
        raise Todo()

    def in_flight(self, key: str) -> int:
        """Leases currently held on ``key`` (expired ones no longer count)."""
        raise Todo()

    def statistics(self) -> ConcurrencyStatistics:
        """Leases held in total and per key, and how many have expired so far."""
        raise Todo()
