"""Stage 2 — worker pools around the stage-1 queue.

Core: :class:`ThreadWorkerPool` — ``workers`` threads claim jobs from a stage-1
``JobQueue`` and run ``handler(lease, payload)`` concurrently. Extended:
:class:`AsyncWorkerPool` — the same with anyio tasks (asyncio and trio), plus a per-job
``timeout_ns`` enforced by cancelling the handler. The prompt is
katas/job_scheduler/README.md; run the suite with ``pytest katas/job_scheduler -k stage2``
(``-k "stage2 and core"`` for the core).

Rules the pool follows (the suite checks each one):

- The stage-1 queue is not thread-safe: the pool guards every call on it with one
  lock. The handler never runs under that lock — handlers run at the same time.
- Waiting goes through the injected clock only (``clock.wait_until_ns``): an idle
  worker waits until the queue's ``next_due_ns()`` (a scheduled job's run time, or a
  lease's expiry) or until ``submit`` wakes it. Nothing sleeps for real.
- A job is leased to one worker at a time; at most ``max_in_flight`` (default:
  ``workers``) handlers run at once.
- The handler's return value is acked as the job's result; an exception nacks the job
  with ``"<ExceptionType>: <message>"`` (so the queue retries it, or it dies). An
  ack/nack refused with ``StaleLease`` (the lease expired meanwhile) counts as ``lost``.
- While a handler runs, its lease is heartbeaten every ``heartbeat_every_ns`` (default:
  a third of the lease), so a job longer than its lease keeps it.
- ``shutdown(grace_ns)``: stop claiming at once; wait (through the clock) until the
  running handlers finish or ``grace_ns`` has passed; then release every job still
  running (its attempt refunded; that handler's result is dropped when it returns).
  No lease is left behind.
- Async pool: all of the above on one event loop; ``run()`` runs the workers until
  ``shutdown`` has finished. A handler still running ``timeout_ns`` after its claim
  (measured on the clock: ``clock.sleep_until_ns_async``) is cancelled and its job
  nacked with ``TIMED_OUT``; at the grace deadline ``shutdown`` cancels the handlers
  still running and releases their jobs.
- Bad input: ``workers``, ``max_in_flight``, ``heartbeat_every_ns``, ``timeout_ns`` < 1
  or ``grace_ns`` < 0 raise ``ValueError`` naming the parameter (``TypeError`` for
  non-ints), and change nothing.
"""

from __future__ import annotations

# TODO(stage2): implement every class and method below; delete each
# `raise Todo()` as you go.
from collections.abc import Awaitable, Callable
from typing import Any

from katas._runtime.todo import Todo
from katas.job_scheduler.api import Lease, PoolStatistics, WaitingClock

from .stage1 import JobQueue

Handler = Callable[[Lease, Any], Any]
AsyncHandler = Callable[[Lease, Any], Awaitable[Any]]


class ThreadWorkerPool:
    """``workers`` threads claiming jobs from ``queue`` and running ``handler(lease, payload)``.

    ``clock`` (default: the OS monotonic clock) is what every wait goes through;
    ``heartbeat_every_ns`` (>= 1; default a third of each lease) how often a running
    job's lease is extended; ``max_in_flight`` (>= 1; default ``workers``) how many
    handlers may run at once. Nothing runs before :meth:`start`.
    """

    def __init__(
        self,
        queue: JobQueue,
        handler: Handler,
        *,
        workers: int,
        clock: WaitingClock | None = None,
        heartbeat_every_ns: int | None = None,
        max_in_flight: int | None = None,
    ) -> None:
        raise Todo()

    def start(self) -> None:
        """Start the worker threads and the heartbeat thread (daemons); RuntimeError if
        already started."""
        raise Todo()

    def submit(self, payload: Any, **options: Any) -> str:
        """Enqueue a job (``options`` as for ``JobQueue.enqueue``) under the pool's lock
        and wake the idle workers; return the job id."""
        raise Todo()

    def shutdown(self, grace_ns: int) -> None:
        """Stop claiming; wait up to ``grace_ns`` for running jobs, then release the rest.

        Returns once no job of this pool holds a lease."""
        raise Todo()

    def statistics(self) -> PoolStatistics:
        """A snapshot of the pool's counters (see ``PoolStatistics``); ``timed_out`` is 0."""
        raise Todo()


class AsyncWorkerPool:
    """``workers`` anyio tasks claiming jobs from ``queue`` and awaiting
    ``handler(lease, payload)``.

    Parameters as for :class:`ThreadWorkerPool`, plus ``timeout_ns`` (>= 1; None: no
    timeout): a handler still running that long after its claim is cancelled and the
    job nacked with ``TIMED_OUT``. Use it from a single event loop.
    """

    def __init__(
        self,
        queue: JobQueue,
        handler: AsyncHandler,
        *,
        workers: int,
        clock: WaitingClock | None = None,
        heartbeat_every_ns: int | None = None,
        max_in_flight: int | None = None,
        timeout_ns: int | None = None,
    ) -> None:
        raise Todo()

    async def run(self) -> None:
        """Run the worker tasks and the heartbeat task; return once ``shutdown`` has
        finished. RuntimeError if already running."""
        raise Todo()

    def submit(self, payload: Any, **options: Any) -> str:
        """Enqueue a job (``options`` as for ``JobQueue.enqueue``) and wake idle workers."""
        raise Todo()

    async def shutdown(self, grace_ns: int) -> None:
        """Stop claiming; wait up to ``grace_ns`` for running jobs, then cancel the
        handlers still running and release their jobs (attempts refunded)."""
        raise Todo()

    def statistics(self) -> PoolStatistics:
        """A snapshot of the pool's counters (see ``PoolStatistics``)."""
        raise Todo()
