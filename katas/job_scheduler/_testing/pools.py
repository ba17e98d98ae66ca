"""Building a stage-2 worker pool around a stage-1 queue on a test clock, and the small
tools its tests pace it with: a gate the handlers wait at, a pool that is always shut
down on the way out, a counter to wait for."""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

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


def stat(pool: WorkerPool, name: str) -> Callable[[], int]:
    """A reader of one counter of ``pool.statistics()``, to wait for."""
    return lambda: int(getattr(pool.statistics(), name))


class Gate:
    """Handlers block here until the test opens the gate (with a hard deadline)."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.entered: list[Any] = []
        self._lock = threading.Lock()

    def handler(self, lease: Lease, payload: Any) -> Any:
        with self._lock:
            self.entered.append(payload)
        assert self.event.wait(DEADLINE_S), "a handler waited on its gate for too long"
        return payload
