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

from katas._harness.under_test import stage
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

#: What a pool's handler is: the job's lease and payload in, the job's result out.
Handler = Callable[[Lease, Any], Any]
AsyncHandler = Callable[[Lease, Any], Awaitable[Any]]


def pool_queue(
    max_attempts: int = 1, clock: ManualClock | None = None, lease_ns: int = LEASE
) -> tuple[ManualClock, JobQueue]:
    """A stage-1 queue on a frozen clock: lease 1000 ns, retries due at once."""
    clock = ManualClock(START) if clock is None else clock
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
    handler: Handler, *, workers: int, max_attempts: int = 1, **kw: Any
) -> tuple[ManualClock, JobQueue, WorkerPool]:
    """A thread pool of ``workers`` around a fresh :func:`pool_queue`, on its clock."""
    clock, queue = pool_queue(max_attempts)
    pool: WorkerPool = stage(2).ThreadWorkerPool(queue, handler, workers=workers, clock=clock, **kw)
    return clock, queue, pool


def new_async_pool(
    handler: AsyncHandler, *, workers: int, max_attempts: int = 1, **kw: Any
) -> tuple[ManualClock, JobQueue, AsyncWorkerPool]:
    """An async pool of ``workers`` around a fresh :func:`pool_queue`, on its clock."""
    clock, queue = pool_queue(max_attempts)
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
async def running_async(pool: AsyncWorkerPool) -> AsyncIterator[None]:
    """Run ``pool`` in a task group for the body, then shut it down (grace 0): on the way
    out no handler is still running, so what follows checks a settled queue."""
    async with anyio.create_task_group() as tg:
        tg.start_soon(pool.run)
        yield
        await pool.shutdown(0)


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
        with self._lock:
            self.entered.append(payload)
            self.busy.add(threading.get_ident())
        assert self.event.wait(DEADLINE_S), "a handler waited on its gate for too long"
        return payload


class AsyncGate:
    """Async handlers wait here until the test opens the gate; each then returns "done".
    Made inside the test's event loop (an ``anyio.Event``)."""

    def __init__(self) -> None:
        self.event = anyio.Event()

    async def handler(self, lease: Lease, payload: Any) -> str:
        await self.event.wait()
        return "done"
