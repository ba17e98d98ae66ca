"""Stage 2 reference: a thread pool of workers around the stage-1 JobQueue.

- The stage-1 queue is not thread-safe, so every call on it happens under the pool's one
  lock (a ``Condition``). Handlers run *outside* it: a lock held across user code
  serialises the pool and deadlocks a handler that submits work.
- Workers wait for work through the injected clock, until the queue's ``next_due_ns()``
  (a scheduled job's time or a lease's expiry) or until ``submit`` notifies them; tests
  move time with ``ManualClock`` and nothing sleeps for real.
- One heartbeat thread extends the lease of every running job each
  ``heartbeat_every_ns``, so a job longer than its lease keeps it.
- ``shutdown(grace_ns)`` stops claiming, lets running jobs finish until the grace
  deadline, then releases what is still running (attempt refunded): no lease is left.
- :class:`AsyncWorkerPool` does the same with anyio tasks on one event loop (no lock
  needed: nothing awaits between queue calls), and enforces ``timeout_ns`` per job by
  cancelling the handler, timed by the injected clock.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from katas._runtime.checks import positive_int
from katas.job_scheduler.api import (
    TIMED_OUT,
    JobNotFound,
    Lease,
    MonotonicClock,
    PoolStatistics,
    StaleLease,
    WaitingClock,
)

from .stage1 import JobQueue

Handler = Callable[[Lease, Any], Any]
AsyncHandler = Callable[[Lease, Any], Awaitable[Any]]

#: What the queue raises for a lease that is no longer live: StaleLease, or JobNotFound
#: once the job has finished and been forgotten after its retention (a long stall).
_LOST = (StaleLease, JobNotFound)


class _Running:
    """A claimed job whose handler runs: its current lease and when to heartbeat next."""

    __slots__ = ("every", "lease", "next_beat", "payload", "released", "scope")

    def __init__(self, lease: Lease, payload: Any, now: int, every: int | None) -> None:
        self.lease = lease
        self.payload = payload
        # Default: three heartbeats per lease, so one late beat still keeps it.
        self.every = every if every is not None else max(1, (lease.expires_at_ns - now) // 3)
        self.next_beat = now + self.every
        self.released = False
        self.scope: anyio.CancelScope | None = None  # async pool: the handler's scope


class _PoolConfig:
    """The arguments both pools take, validated once: nothing starts on bad input."""

    _queue: JobQueue
    _clock: WaitingClock
    _every: int | None
    _workers: int
    _max_in_flight: int

    def _configure(
        self,
        queue: JobQueue,
        handler: object,
        workers: int,
        clock: WaitingClock | None,
        heartbeat_every_ns: int | None,
        max_in_flight: int | None,
    ) -> None:
        if not isinstance(queue, JobQueue):
            raise TypeError(f"queue must be a JobQueue, got {queue!r}")
        if not callable(handler):
            raise TypeError(f"handler must be callable, got {handler!r}")
        self._workers = positive_int("workers", workers)
        if heartbeat_every_ns is not None:
            positive_int("heartbeat_every_ns", heartbeat_every_ns)
        self._max_in_flight = (
            self._workers if max_in_flight is None else positive_int("max_in_flight", max_in_flight)
        )
        if clock is not None and not isinstance(clock, WaitingClock):
            raise TypeError(f"clock must be a WaitingClock, got {clock!r}")
        self._queue = queue
        self._clock = clock if clock is not None else MonotonicClock()
        self._every = heartbeat_every_ns


class ThreadWorkerPool(_PoolConfig):
    """``workers`` threads claiming jobs from ``queue`` and running ``handler(lease, payload)``."""

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
        self._configure(queue, handler, workers, clock, heartbeat_every_ns, max_in_flight)
        self._handler = handler
        self._cond = threading.Condition(threading.Lock())
        self._running: dict[tuple[str, int], _Running] = {}  # by (job id, first token)
        self._threads: list[threading.Thread] = []
        self._started = self._stopping = self._stopped = False
        self._idle = 0
        self._counts = dict.fromkeys(
            ("claimed", "succeeded", "failed", "released", "lost", "heartbeats"), 0
        )

    def start(self) -> None:
        """Start the worker threads and the heartbeat thread (once)."""
        with self._cond:
            if self._started:
                raise RuntimeError("the pool has already been started")
            self._started = True
        names = (f"worker-{i}" for i in itertools.count(1))
        for name in itertools.islice(names, self._workers):
            self._threads.append(threading.Thread(target=self._work, args=(name,), name=name))
        self._threads.append(threading.Thread(target=self._beat, name="heartbeats"))
        for thread in self._threads:
            thread.daemon = True
            thread.start()

    def submit(self, payload: Any, **options: Any) -> str:
        """Enqueue a job (``options`` as for ``JobQueue.enqueue``) and wake a worker."""
        with self._cond:
            job_id = self._queue.enqueue(payload, **options)
            self._cond.notify_all()
        return job_id

    def shutdown(self, grace_ns: int) -> None:
        """Stop claiming; wait up to ``grace_ns`` for running jobs, then release the rest."""
        if type(grace_ns) is not int:
            raise TypeError(f"grace_ns must be an int, got {grace_ns!r}")
        if grace_ns < 0:
            raise ValueError(f"grace_ns must be >= 0, got {grace_ns}")
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            deadline = self._clock.now_ns() + grace_ns
            while self._running and self._clock.now_ns() < deadline:
                self._clock.wait_until_ns(self._cond, deadline)
            for run in self._running.values():
                # The handler cannot be interrupted; it will find ``released`` and drop
                # its result. Releasing refunds the attempt and leaves no lease.
                run.released = True
                try:
                    self._queue.release(run.lease)
                    self._counts["released"] += 1
                except _LOST:
                    self._counts["lost"] += 1
            self._running.clear()
            self._stopped = True
            self._cond.notify_all()

    def statistics(self) -> PoolStatistics:
        """A snapshot of the pool's counters."""
        with self._cond:
            c = self._counts
            return PoolStatistics(
                workers=self._workers,
                in_flight=len(self._running),
                idle=self._idle,
                claimed=c["claimed"],
                succeeded=c["succeeded"],
                failed=c["failed"],
                released=c["released"],
                lost=c["lost"],
                heartbeats=c["heartbeats"],
                timed_out=0,
                stopping=self._stopping,
            )

    # --- threads ----------------------------------------------------------------------

    def _claim(self, worker_id: str) -> _Running | None:
        """Under the lock: wait for a free slot and a due job; None once stopping."""
        while not self._stopping:
            deadline: int | None = None
            if len(self._running) < self._max_in_flight:
                lease = self._queue.claim(worker_id)
                if lease is not None:
                    # The payload is read in the claim's lock section: no release between.
                    payload = self._queue.get(lease.job_id).payload
                    run = _Running(lease, payload, self._clock.now_ns(), self._every)
                    self._running[lease.job_id, lease.token] = run
                    self._counts["claimed"] += 1
                    self._cond.notify_all()  # the heartbeat thread has a new deadline
                    return run
                deadline = self._queue.next_due_ns()
            self._idle += 1
            try:
                self._clock.wait_until_ns(self._cond, deadline)
            finally:
                self._idle -= 1
        return None

    def _work(self, worker_id: str) -> None:
        while True:
            with self._cond:
                run = self._claim(worker_id)
            if run is None:
                return
            if run.released:
                continue  # shutdown handed the job back before its handler began
            error: str | None = None
            result: Any = None
            try:
                result = self._handler(run.lease, run.payload)  # never under the lock
            except Exception as e:  # a job's failure is data: nack it
                error = f"{type(e).__name__}: {e}"
            with self._cond:
                self._finish(run, result, error)
                self._cond.notify_all()

    def _finish(self, run: _Running, result: Any, error: str | None) -> None:
        if run.released:
            return  # shutdown handed the job back already
        del self._running[run.lease.job_id, run.lease.token]
        try:
            if error is None:
                self._queue.ack(run.lease, result)
                self._counts["succeeded"] += 1
            else:
                self._queue.nack(run.lease, error)
                self._counts["failed"] += 1
        except _LOST:
            self._counts["lost"] += 1  # expired (or cancelled) while running

    def _beat(self) -> None:
        with self._cond:
            while not self._stopped:
                now = self._clock.now_ns()
                for run in self._running.values():
                    if run.next_beat > now:
                        continue
                    try:
                        run.lease = self._queue.heartbeat(run.lease)
                        run.next_beat = now + run.every
                        self._counts["heartbeats"] += 1
                    except _LOST:
                        # Too late: the lease expired. Stop beating; the handler's
                        # ack will be refused and the job is retried elsewhere.
                        run.next_beat = 2**63
                beats = [r.next_beat for r in self._running.values() if r.next_beat < 2**63]
                self._clock.wait_until_ns(self._cond, min(beats) if beats else None)


class AsyncWorkerPool(_PoolConfig):
    """``workers`` anyio tasks claiming jobs and awaiting ``handler(lease, payload)``."""

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
        self._configure(queue, handler, workers, clock, heartbeat_every_ns, max_in_flight)
        self._handler = handler
        self._timeout = None if timeout_ns is None else positive_int("timeout_ns", timeout_ns)
        self._running: dict[tuple[str, int], _Running] = {}
        self._wake: anyio.Event | None = None  # made in run(): events need a running loop
        self._stopping = self._stopped = False
        self._idle = 0
        self._counts = dict.fromkeys(
            ("claimed", "succeeded", "failed", "released", "lost", "heartbeats", "timed_out"), 0
        )

    async def run(self) -> None:
        """Run the workers and the heartbeat task until ``shutdown`` has finished."""
        if self._wake is not None:
            raise RuntimeError("the pool is already running")
        self._wake = anyio.Event()
        async with anyio.create_task_group() as tg:
            for i in range(1, self._workers + 1):
                tg.start_soon(self._work, f"worker-{i}")
            tg.start_soon(self._beat)

    def submit(self, payload: Any, **options: Any) -> str:
        """Enqueue a job (``options`` as for ``JobQueue.enqueue``) and wake the workers."""
        job_id = self._queue.enqueue(payload, **options)
        self._notify()
        return job_id

    async def shutdown(self, grace_ns: int) -> None:
        """Stop claiming; wait up to ``grace_ns`` for running jobs, then cancel and
        release the rest (attempts refunded)."""
        if type(grace_ns) is not int:
            raise TypeError(f"grace_ns must be an int, got {grace_ns!r}")
        if grace_ns < 0:
            raise ValueError(f"grace_ns must be >= 0, got {grace_ns}")
        self._stopping = True
        self._notify()
        deadline = self._clock.now_ns() + grace_ns
        while self._running and self._clock.now_ns() < deadline:
            await self._wait(deadline)
        for run in self._running.values():
            run.released = True
            if run.scope is not None:
                run.scope.cancel()
            try:
                self._queue.release(run.lease)
                self._counts["released"] += 1
            except _LOST:
                self._counts["lost"] += 1
        self._running.clear()
        self._stopped = True
        self._notify()

    def statistics(self) -> PoolStatistics:
        """A snapshot of the pool's counters."""
        c = self._counts
        return PoolStatistics(
            workers=self._workers,
            in_flight=len(self._running),
            idle=self._idle,
            claimed=c["claimed"],
            succeeded=c["succeeded"],
            failed=c["failed"],
            released=c["released"],
            lost=c["lost"],
            heartbeats=c["heartbeats"],
            timed_out=c["timed_out"],
            stopping=self._stopping,
        )

    # --- tasks ------------------------------------------------------------------------

    def _notify(self) -> None:
        if self._wake is not None:
            self._wake.set()
            self._wake = anyio.Event()

    async def _wait(self, deadline: int | None) -> None:
        """Until notified, or until ``deadline`` on the clock (None: notified only)."""
        assert self._wake is not None
        event = self._wake
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                if deadline is not None:

                    async def ring(at: int) -> None:
                        await self._clock.sleep_until_ns_async(at)
                        scope.cancel()

                    tg.start_soon(ring, deadline)
                await event.wait()
                scope.cancel()

    async def _work(self, worker_id: str) -> None:
        while not self._stopping:
            lease = None
            if len(self._running) < self._max_in_flight:
                lease = self._queue.claim(worker_id)
            if lease is None:
                self._idle += 1
                try:
                    full = len(self._running) >= self._max_in_flight
                    await self._wait(None if full else self._queue.next_due_ns())
                finally:
                    self._idle -= 1
                continue
            payload = self._queue.get(lease.job_id).payload
            run = _Running(lease, payload, self._clock.now_ns(), self._every)
            self._running[lease.job_id, lease.token] = run
            self._counts["claimed"] += 1
            self._notify()  # the heartbeat task has a new deadline
            await self._execute(run)

    async def _execute(self, run: _Running) -> None:
        result: Any = None
        error: str | None = TIMED_OUT  # unless the handler returns or raises
        run.scope = anyio.CancelScope()
        async with anyio.create_task_group() as tg:
            if self._timeout is not None:
                tg.start_soon(self._timer, run, self._clock.now_ns() + self._timeout)
            with run.scope:
                try:
                    result, error = await self._handler(run.lease, run.payload), None
                except Exception as e:  # a job's failure is data: nack it
                    error = f"{type(e).__name__}: {e}"
            tg.cancel_scope.cancel()  # the timer, if still waiting
        if run.released:
            return  # shutdown cancelled it and handed the job back
        del self._running[run.lease.job_id, run.lease.token]
        try:
            if error is None:
                self._queue.ack(run.lease, result)
                self._counts["succeeded"] += 1
            else:
                self._queue.nack(run.lease, error)
                self._counts["failed"] += 1
                if error == TIMED_OUT:
                    self._counts["timed_out"] += 1
        except _LOST:
            self._counts["lost"] += 1
        self._notify()

    async def _timer(self, run: _Running, at: int) -> None:
        await self._clock.sleep_until_ns_async(at)
        if run.scope is not None:
            run.scope.cancel()  # cancellation is how a timeout reaches the handler

    async def _beat(self) -> None:
        while not self._stopped:
            now = self._clock.now_ns()
            for run in self._running.values():
                if run.next_beat > now:
                    continue
                try:
                    run.lease = self._queue.heartbeat(run.lease)
                    run.next_beat = now + run.every
                    self._counts["heartbeats"] += 1
                except _LOST:
                    run.next_beat = 2**63  # expired already: the ack will be refused
            beats = [r.next_beat for r in self._running.values() if r.next_beat < 2**63]
            await self._wait(min(beats) if beats else None)
