"""A thread pool whose worker stops in the gap between its claim and its handler: the
worker's first claim leaves it paused right after the pool's lock section ends, until
the test lets it go, so the test can run ``shutdown`` exactly there."""

from __future__ import annotations

import threading
from typing import Any

from katas._harness.interleave import pause_after_unlocks
from katas._harness.resting import WatchedClock, rest_on
from katas._harness.under_test import stage
from katas._harness.waiting import DEADLINE_S
from katas.job_scheduler._testing.pools import Handler
from katas.job_scheduler._testing.queues import LEASE, START
from katas.job_scheduler.api import JobQueue, Lease, RetryPolicy, WorkerPool


def pool_paused_after_a_claim(
    handler: Handler, resume: threading.Event
) -> tuple[WatchedClock, JobQueue, WorkerPool, threading.Event]:
    """A one-worker thread pool (lease 1000 ns, one attempt) on a queue whose first
    successful claim pauses the claiming worker after each lock section of the pool it
    leaves, until ``resume`` is set. Returns the clock, the queue, the pool (not started)
    and an event set once that claim has been made."""
    claimed = threading.Event()
    base: type[Any] = stage(1).JobQueue
    module = stage(2).ThreadWorkerPool.__module__

    def claim(self: Any, worker_id: str) -> Lease | None:
        lease: Lease | None = base.claim(self, worker_id)
        if lease is not None and not claimed.is_set():
            claimed.set()
            pause_after_unlocks(module, resume.is_set, resume.is_set, DEADLINE_S)
        return lease

    cls = type("PausedClaimJobQueue", (base,), {"claim": claim})
    clock = WatchedClock(START)
    rest_on(clock)
    queue: JobQueue = cls(
        clock=clock, lease_ns=LEASE, retry=RetryPolicy(0, 0, "none"), max_attempts=1
    )
    pool: WorkerPool = stage(2).ThreadWorkerPool(queue, handler, workers=1, clock=clock)
    return clock, queue, pool, claimed
