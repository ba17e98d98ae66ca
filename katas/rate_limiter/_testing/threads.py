"""Driving the stage-2 limiters from threads and tasks: building them on a frozen clock,
starting waiters and knowing they are queued, releasing bursts at once.

Waiters are sequenced through ``statistics()`` (a waiter counts once it is queued), never
through sleeps; every wait has a hard real-time deadline and every thread is a daemon,
so a lost wake-up or a deadlock fails the test instead of hanging it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Coroutine
from fractions import Fraction
from functools import partial
from typing import Any, TypeVar

from anyio.abc import TaskGroup

from katas._harness import waiting
from katas._harness.interleave import Gate, Parked
from katas._harness.resting import WatchedClock, rest_on
from katas._harness.story import check
from katas._harness.under_test import stage
from katas._harness.waiting import DEADLINE_S, Thread, eventually_async
from katas.rate_limiter.api import (
    NS_PER_S,
    AsyncRateLimiter,
    BlockingLimiter,
    InProcessLeaseLimiter,
    ManualClock,
    RateLimiter,
)

T = TypeVar("T")


# --- building the limiters ------------------------------------------------------------


class LateWakeClock(ManualClock):
    """A :class:`ManualClock` whose :meth:`advance_unheard` moves time without waking anyone.

    The threads and tasks whose deadline it passes stay asleep until :meth:`wake`: the
    instant after time moved and before the scheduler ran the waiters it woke (their
    units are on hand, and they have not taken them yet).
    """

    def __init__(self) -> None:
        super().__init__()
        self._unheard = False

    def _wake_due(self) -> None:
        if not self._unheard:
            super()._wake_due()

    def advance_unheard(self, ns: int) -> None:
        self._unheard = True
        try:
            self.advance(ns)
        finally:
            self._unheard = False

    def wake(self) -> None:
        """Wake whoever :meth:`advance_unheard` left asleep."""
        self._wake_due()


def watched() -> WatchedClock:
    """A frozen clock for this test, on which its waits end once the limiter is at rest."""
    clock = WatchedClock()
    rest_on(clock)
    return clock


def bucket_limiter(
    capacity: int,
    refill_per_s: int | Fraction = 1,
    *,
    stripes: int = 64,
    clock: ManualClock | None = None,
) -> tuple[ManualClock, BlockingLimiter]:
    """A ThreadSafeLimiter around a stage-1 TokenBucket (auto_sweep off), on a frozen clock.
    Made here, the clock is a :class:`WatchedClock`: the test's waits end once every
    thread it started is asleep on it (:func:`rest_on`)."""
    clock = clock if clock is not None else watched()
    inner = stage(1).TokenBucket(
        capacity=capacity, refill_per_s=refill_per_s, clock=clock, auto_sweep=False
    )
    limiter: BlockingLimiter = stage(2).ThreadSafeLimiter(inner, clock=clock, stripes=stripes)
    return clock, limiter


def parked_limiter(
    gate: Gate, at: tuple[str, ...], capacity: int = 4, *, holding: tuple[str, ...] = ()
) -> tuple[ManualClock, BlockingLimiter]:
    """A ThreadSafeLimiter whose inner bucket parks at ``gate`` in the methods ``at``."""
    clock = ManualClock()
    inner = stage(1).TokenBucket(capacity=capacity, refill_per_s=1, clock=clock, auto_sweep=False)
    for key in holding:
        inner.try_acquire(key)  # state to refund to, before the gate is in the way
    limiter: BlockingLimiter = stage(2).ThreadSafeLimiter(Parked(inner, gate, at), clock=clock)
    return clock, limiter


def spied_limiter(gate: Gate, at: tuple[str, ...]) -> tuple[ManualClock, Parked, BlockingLimiter]:
    """A ThreadSafeLimiter whose inner bucket parks at ``gate`` in the methods ``at``, and
    the :class:`Parked` spy around that bucket, whose ``overlaps`` names every inner call
    that began while another one was inside."""
    clock = ManualClock()
    inner = stage(1).TokenBucket(capacity=2, refill_per_s=1, clock=clock, auto_sweep=False)
    spy = Parked(inner, gate, at)
    limiter: BlockingLimiter = stage(2).ThreadSafeLimiter(spy, clock=clock)
    return clock, spy, limiter


def async_limiter(
    capacity: int, refill_per_s: int | Fraction = 1, *, clock: ManualClock | None = None
) -> tuple[ManualClock, AsyncRateLimiter]:
    """An AsyncLimiter around a stage-1 TokenBucket, on a frozen clock."""
    clock = clock if clock is not None else ManualClock()
    inner = stage(1).TokenBucket(capacity=capacity, refill_per_s=refill_per_s, clock=clock)
    limiter: AsyncRateLimiter = stage(2).AsyncLimiter(inner, clock=clock)
    return clock, limiter


def emptied_async_limiter(
    clock: ManualClock | None = None,
) -> tuple[ManualClock, AsyncRateLimiter]:
    """An AsyncLimiter of 2 units refilling 1 a second whose key ``"k"`` has just spent
    both: the setting of every waiting test (1 unit on hand after 1 s, 2 after 2 s)."""
    clock, limiter = async_limiter(2, refill_per_s=1, clock=clock)
    check(limiter.try_acquire("k", 2).allowed, "a fresh key of capacity 2 admits 2 units")
    return clock, limiter


def concurrency(
    max_in_flight: int, lease_ns: int = 10 * NS_PER_S
) -> tuple[ManualClock, InProcessLeaseLimiter]:
    """A ConcurrencyLimiter on a frozen clock, a :class:`WatchedClock` (:func:`rest_on`)."""
    clock = watched()
    limiter: InProcessLeaseLimiter = stage(2).ConcurrencyLimiter(
        max_in_flight=max_in_flight, lease_ns=lease_ns, clock=clock
    )
    return clock, limiter


# --- reading them ---------------------------------------------------------------------


def units_left(limiter: RateLimiter, key: str) -> int:
    """Whole units on hand (peek's ``remaining`` is what would be left *after* one unit)."""
    probe = limiter.peek(key)
    return int(probe.remaining) + int(probe.allowed)


def waiters_on(limiter: BlockingLimiter | AsyncRateLimiter, key: str) -> int:
    """Callers queued on ``key``, as the limiter's ``statistics()`` counts them."""
    return int(limiter.statistics().waiters_by_key.get(key, 0))


def reaches(count: Callable[[], int], n: int) -> Callable[[], bool]:
    return lambda: count() >= n


def stays_at(count: Callable[[], int], n: int) -> Callable[[], bool]:
    return lambda: count() == n


# --- threads --------------------------------------------------------------------------


class Worker(Thread):
    """A daemon :class:`~katas._harness.waiting.Thread` whose failure :func:`eventually` can
    re-raise while it waits; ``outcome()`` joins it with a hard deadline."""

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise self.error

    def outcome(self, what: str) -> Any:
        return super().outcome(
            f"{what} (a lost wake-up, a waiter stuck behind one that left, or a deadlock)"
        )


def start(fn: Callable[[], object], name: str) -> Worker:
    worker = Worker(fn, name)
    worker.start()
    return worker


def eventually(pred: Callable[[], bool], what: str, workers: tuple[Worker, ...] = ()) -> None:
    """:func:`katas._harness.waiting.eventually`, re-raising at once what a ``workers`` thread
    raised while ``pred()`` does not hold yet (instead of waiting out the deadline)."""

    def ready() -> bool:
        if pred():
            return True
        for w in workers:
            w.raise_if_failed()
        return False

    waiting.eventually(ready, what)


def enqueue(limiter: BlockingLimiter, key: str, fn: Callable[[], object], name: str) -> Worker:
    """Start a thread that blocks in ``acquire`` on ``key``; return once it is queued."""
    before = waiters_on(limiter, key)
    worker = start(fn, name)
    eventually(
        lambda: waiters_on(limiter, key) == before + 1,
        f"{name} to be queued on {key!r} (statistics().waiters_by_key[{key!r}] == {before + 1})",
        (worker,),
    )
    return worker


def run_together(n: int, body: Callable[[int], T]) -> list[T]:
    """Run ``body(0..n-1)`` on n threads released at once by a barrier; their results."""
    barrier = threading.Barrier(n)

    def task(i: int) -> T:
        barrier.wait(DEADLINE_S)
        return body(i)

    workers = [start(partial(task, i), f"burst thread {i}") for i in range(n)]
    return [w.outcome("a burst thread") for w in workers]


# --- tasks ----------------------------------------------------------------------------


async def enqueue_async(
    tg: TaskGroup, limiter: AsyncRateLimiter, key: str, fn: Callable[[], Coroutine[Any, Any, Any]]
) -> None:
    """Start a task that waits in ``acquire`` on ``key``; return once it is queued."""
    before = waiters_on(limiter, key)
    tg.start_soon(fn)
    await eventually_async(
        lambda: waiters_on(limiter, key) == before + 1, f"a task queued on {key!r}"
    )


async def acquire_into(answers: list[bool], limiter: AsyncRateLimiter, key: str, cost: int) -> None:
    """A waiting task's body: ``acquire`` and note the answer."""
    answers.append(await limiter.acquire(key, cost))
