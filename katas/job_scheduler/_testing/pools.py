"""Building a stage-2 worker pool around a stage-1 queue on a test clock, and the small
tools its tests pace it with: a gate the handlers wait at, a pool that is always shut
down on the way out, a counter to wait for."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import anyio
import pytest

from katas._harness.interleave import Gate as InterleaveGate
from katas._harness.resting import WatchedClock, rest_on, wait_at
from katas._harness.under_test import stage
from katas._harness.virtual_time import settle
from katas._harness.waiting import DEADLINE_S
from katas.job_scheduler._testing.queues import LEASE, START
from katas.job_scheduler.api import (
    AsyncWorkerPool,
    JobQueue,
    Lease,
    ManualClock,
    RetryPolicy,
    WorkerPool,
)

#: Real seconds run() may take to return once shutdown has finished and every task
#: is blocked (the red run of a pool that never returns waits this long, not DEADLINE_S).
RUN_RETURNS_S = 1.0

#: What a pool's handler is: the job's lease and payload in, the job's result out.
Handler = Callable[[Lease, Any], Any]
AsyncHandler = Callable[[Lease, Any], Awaitable[Any]]


def pool_queue(
    max_attempts: int = 1, clock: ManualClock | None = None, lease_ns: int = LEASE
) -> tuple[ManualClock, JobQueue]:
    """A stage-1 queue on a frozen clock: lease 1000 ns, retries due at once. Made here,
    the clock is a :class:`WatchedClock`; on one, the test's waits end once the pool is
    at rest (:func:`rest_on`)."""
    clock = WatchedClock(START) if clock is None else clock
    if isinstance(clock, WatchedClock):
        rest_on(clock)
    queue: JobQueue = stage(1).JobQueue(
        clock=clock, lease_ns=lease_ns, retry=RetryPolicy(0, 0, "none"), max_attempts=max_attempts
    )
    return clock, queue


@pytest.fixture(autouse=True)
def fail_fast_on_pool_stubs() -> None:
    """Build a pool first: on a stub this fails at once with "not implemented yet". The
    stage-2 suite imports it, which makes it autouse there."""
    _, queue = pool_queue()
    stage(2).ThreadWorkerPool(queue, lambda lease, payload: None, workers=1)


def new_pool(
    handler: Handler,
    *,
    workers: int,
    max_attempts: int = 1,
    clock: ManualClock | None = None,
    lease_ns: int = LEASE,
    **kw: Any,
) -> tuple[ManualClock, JobQueue, WorkerPool]:
    """A thread pool of ``workers`` around a fresh :func:`pool_queue` (its arguments as
    there), on the queue's clock; ``kw`` go to the pool."""
    clock, queue = pool_queue(max_attempts, clock, lease_ns)
    pool: WorkerPool = stage(2).ThreadWorkerPool(queue, handler, workers=workers, clock=clock, **kw)
    return clock, queue, pool


def new_async_pool(
    handler: AsyncHandler,
    *,
    workers: int,
    max_attempts: int = 1,
    clock: ManualClock | None = None,
    lease_ns: int = LEASE,
    **kw: Any,
) -> tuple[ManualClock, JobQueue, AsyncWorkerPool]:
    """An async pool, as :func:`new_pool` makes a thread pool."""
    clock, queue = pool_queue(max_attempts, clock, lease_ns)
    pool: AsyncWorkerPool = stage(2).AsyncWorkerPool(
        queue, handler, workers=workers, clock=clock, **kw
    )
    return clock, queue, pool


@contextmanager
def running(pool: WorkerPool) -> Iterator[WorkerPool]:
    """Start ``pool``; on the way out shut it down (grace 0) so no thread waits forever."""
    pool.start()
    try:
        yield pool
    finally:
        if not pool.statistics().stopping:
            pool.shutdown(0)


@asynccontextmanager
async def running_async(pool: AsyncWorkerPool, grace_ns: int | None = 0) -> AsyncIterator[None]:
    """Run ``pool`` in a task group for the body, then shut it down (``grace_ns``; None:
    the body did): on the way out no handler is still running, so what follows checks a
    settled queue. A ``run()`` that does not return once shutdown has finished fails the
    test (and is cancelled) instead of keeping it waiting forever."""
    returned = anyio.Event()

    async def run() -> None:
        await pool.run()
        returned.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        yield
        if grace_ns is not None:
            await pool.shutdown(grace_ns)
        # Nothing is left for run() to wait for: once every task is blocked it has
        # returned, or (a handler of its own in a thread) does so within a real second.
        await settle()
        with anyio.move_on_after(RUN_RETURNS_S):
            await returned.wait()
        if not returned.is_set():
            tg.cancel_scope.cancel()
            raise AssertionError(
                f"run() had not returned {RUN_RETURNS_S:.0f} real second after shutdown "
                "finished: it returns once shutdown has finished, and at the grace deadline "
                "shutdown cancels the handlers still running"
            )


async def idle_handler(lease: Lease, payload: Any) -> None:
    """An async handler with nothing to do, for tests that never run a job."""
    return None


def stat(pool: WorkerPool, name: str) -> Callable[[], int]:
    """A reader of one counter of ``pool.statistics()``, to wait for."""
    return lambda: int(getattr(pool.statistics(), name))


class Gate:
    """Handlers block here until the test opens the gate (with a hard deadline).
    ``busy`` holds the threads that entered, for ``WatchedClock.settle`` to tell a
    handler parked at the gate from a thread still at work."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.entered: list[Any] = []
        self.busy: set[int] = set()
        self._lock = threading.Lock()

    def handler(self, lease: Lease, payload: Any) -> Any:
        me = threading.get_ident()
        with self._lock:
            self.entered.append(payload)
            self.busy.add(me)
        wait_at(self.event, "a handler at its gate")
        return payload


class AsyncGate:
    """Async handlers wait here until the test opens the gate; each then returns "done".
    Made inside the test's event loop (an ``anyio.Event``)."""

    def __init__(self) -> None:
        self.event = anyio.Event()

    async def handler(self, lease: Lease, payload: Any) -> str:
        await self.event.wait()
        return "done"


class Stalls:
    """A handler each of whose runs blocks until the test lets it go: by the job's payload
    and the lease's attempt (``hold(payload, attempt)``); runs not held return at once.
    ``busy`` holds the threads parked here, for ``WatchedClock.settle``."""

    def __init__(self) -> None:
        self._events: dict[tuple[Any, int], threading.Event] = {}
        self.entered: list[tuple[Any, int]] = []
        self.busy: set[int] = set()
        self._lock = threading.Lock()

    def hold(self, payload: Any, attempt: int = 1) -> threading.Event:
        """Runs of ``payload`` at ``attempt`` wait until the returned event is set."""
        return self._events.setdefault((payload, attempt), threading.Event())

    def handler(self, lease: Lease, payload: Any) -> Any:
        event = self._events.get((payload, lease.attempt))
        me = threading.get_ident()
        with self._lock:
            self.entered.append((payload, lease.attempt))
            self.busy.add(me)
        try:
            if event is not None:
                assert event.wait(DEADLINE_S), f"a handler of {payload!r} was held too long"
        finally:
            with self._lock:
                self.busy.discard(me)
        return payload


class QueueCalls:
    """What a lock-watched queue saw (:func:`lock_watched_queue`): which thread was inside
    which public call, and every call that began while another thread was inside one."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._inside: dict[int, list[str]] = {}  # thread -> its calls in progress (nested)
        self.overlaps: list[str] = []

    def enter(self, name: str) -> None:
        me = threading.get_ident()
        with self._changed:
            others = [calls[0] for t, calls in self._inside.items() if t != me and calls]
            if others and not self._inside.get(me):
                self.overlaps.append(f"{name}() began while another thread was in {others[0]}()")
                self._changed.notify_all()
            self._inside.setdefault(me, []).append(name)

    def leave(self) -> None:
        with self._changed:
            self._inside[threading.get_ident()].pop()

    def wait_overlap(self, timeout_s: float) -> None:
        """Wait at most ``timeout_s`` for an overlap (no failure: read :attr:`overlaps`)."""
        with self._changed:
            self._changed.wait_for(lambda: bool(self.overlaps), timeout_s)


#: The public calls of a stage-1 queue a pool may make.
QUEUE_CALLS = (
    "enqueue", "claim", "ack", "nack", "get", "next_due_ns", "heartbeat", "release",
    "cancel", "dead_letters", "redrive", "is_current", "statistics",
)  # fmt: skip


def lock_watched_queue(parked: InterleaveGate, at: str) -> tuple[ManualClock, JobQueue, QueueCalls]:
    """A stage-1 queue (a subclass of the one under test, so a pool takes it) that notes
    every public call made while another thread is inside one, and parks the first
    outermost call to ``at`` at ``parked``."""
    calls = QueueCalls()
    base: type[Any] = stage(1).JobQueue

    def watched(name: str) -> Callable[..., Any]:
        inner = getattr(base, name)

        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            calls.enter(name)
            try:
                if name == at:
                    parked.pass_through()
                return inner(self, *args, **kwargs)
            finally:
                calls.leave()

        return call

    cls = type("LockWatchedJobQueue", (base,), {n: watched(n) for n in QUEUE_CALLS})
    clock = WatchedClock(START)
    rest_on(clock)
    queue: JobQueue = cls(
        clock=clock, lease_ns=LEASE, retry=RetryPolicy(0, 0, "none"), max_attempts=1
    )
    return clock, queue, calls


class CountedBeats:
    """Counts the heartbeat calls ``queue`` receives (refused ones too)."""

    def __init__(self, queue: JobQueue) -> None:
        self._heartbeat: Callable[..., Any] = queue.heartbeat
        self.calls = 0
        queue.heartbeat = self._call  # type: ignore[method-assign]

    def _call(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self._heartbeat(*args, **kwargs)
