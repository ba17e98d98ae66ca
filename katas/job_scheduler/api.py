"""The job-scheduler contract: types shared by stubs, solutions and tests. Do not edit.

Every time and duration is an integer number of nanoseconds from an injected
:class:`Clock`. Job ids are strings chosen by the queue, unique within it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from katas._runtime.clients import check_client, to_json, unavailable
from katas._runtime.clock import (
    NS_PER_MS,
    NS_PER_S,
    Clock,
    ManualClock,
    MonotonicClock,
    WaitingClock,
)


class JobState(enum.Enum):
    """Where a job is in its life.

    ``SCHEDULED → READY → LEASED → SUCCEEDED | DEAD``, and ``CANCELLED`` from any state
    that is not finished. A failed attempt sends a LEASED job back to SCHEDULED (or
    READY, when its backoff is already over). SUCCEEDED, DEAD and CANCELLED are
    *finished*: final, except that ``redrive`` returns a DEAD job to READY.
    """

    SCHEDULED = "scheduled"  # waiting for its run time
    READY = "ready"  # due: the next claim may take it
    LEASED = "leased"  # a worker holds a live lease on it
    SUCCEEDED = "succeeded"
    DEAD = "dead"  # failed max_attempts times: a dead letter
    CANCELLED = "cancelled"


#: The finished states: a job in one of them is never claimed again (short of redrive).
FINISHED_STATES = frozenset({JobState.SUCCEEDED, JobState.DEAD, JobState.CANCELLED})

#: The ``last_error`` of a job whose lease expired (its worker crashed or hung).
LEASE_EXPIRED = "lease expired"


@dataclass(frozen=True)
class Job:
    """A snapshot of one job, as ``get`` saw it.

    - ``run_at_ns``: when the job is (or last was) due — its ``run_at_ns`` at enqueue
      (the enqueue time if none was given), then each retry's time; a release keeps it.
    - ``seq``: the enqueue sequence number (1, 2, 3 … per queue); a retry keeps it.
    - ``attempts``: attempts counted so far (a claim counts one, a release refunds it).
    - ``token``: the latest fencing token issued for this job (0: never claimed).
    - ``lease_expires_at_ns`` and ``worker_id``: the live lease's, while LEASED; else None.
    - ``finished_at_ns``: when it reached a finished state, while it is in one; else None.
    """

    id: str
    payload: Any
    state: JobState
    priority: int
    run_at_ns: int
    seq: int
    attempts: int
    max_attempts: int
    token: int
    last_error: str | None
    result: Any
    enqueued_at_ns: int
    lease_expires_at_ns: int | None
    worker_id: str | None
    finished_at_ns: int | None


@dataclass(frozen=True)
class Lease:
    """The right to work on one job until ``expires_at_ns``.

    ``token`` is the job's fencing token: it increases on every claim of the job and
    never resets, so the queue tells this lease from every earlier or later one.
    ``attempt`` is the attempt this claim counted (1 for the first). The lease is live
    while ``now < expires_at_ns`` and the job is still leased with this token.
    """

    job_id: str
    token: int
    attempt: int
    expires_at_ns: int
    worker_id: str


Jitter = Literal["none", "full", "equal", "decorrelated"]
JITTERS: tuple[Jitter, ...] = ("none", "full", "equal", "decorrelated")


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with jitter, after a failed attempt.

    With ``n`` the attempt that just failed, ``d = min(cap_ns, base_ns * 2**(n-1))``:

    - ``"none"``: ``d``;
    - ``"full"``: ``rng.randrange(d + 1)``;
    - ``"equal"``: ``d // 2 + rng.randrange(d // 2 + 1)``;
    - ``"decorrelated"``: ``min(cap_ns, rng.randrange(base_ns, 3 * prev + 1))``, with
      ``prev`` the job's previous delay (``base_ns`` before its first retry).

    Each jittered retry makes exactly one call on the queue's ``rng``; ``"none"`` makes
    none. Invalid values raise ``TypeError``/``ValueError`` naming the field.
    """

    base_ns: int
    cap_ns: int
    jitter: Jitter = "full"

    def __post_init__(self) -> None:
        for name in ("base_ns", "cap_ns"):
            value = getattr(self, name)
            if type(value) is not int:
                raise TypeError(f"{name} must be an int of nanoseconds, got {value!r}")
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if self.cap_ns < self.base_ns:
            raise ValueError(f"cap_ns must be >= base_ns ({self.base_ns}), got {self.cap_ns}")
        if self.jitter not in JITTERS:
            raise ValueError(f"jitter must be one of {JITTERS}, got {self.jitter!r}")


@dataclass(frozen=True)
class QueueStatistics:
    """A snapshot of what a queue holds: jobs per state, and idempotency records."""

    scheduled: int
    ready: int
    leased: int
    succeeded: int
    dead: int
    cancelled: int
    idempotency_keys: int

    @property
    def pending(self) -> int:
        """Jobs not finished yet: scheduled, ready or leased."""
        return self.scheduled + self.ready + self.leased


class JobQueueError(Exception):
    """Base class of the queue's own errors."""


class StaleLease(JobQueueError):
    """The lease is not the job's live lease: expired, superseded, or its job finished."""


class JobNotFound(JobQueueError, LookupError):
    """No such job: never enqueued here, or forgotten after its retention."""


class QueueFull(JobQueueError):
    """The queue holds its maximum of pending (unfinished) jobs."""


class EffectStore(Protocol):
    """Where workers apply job effects exactly once, fenced by lease tokens.

    ``commit`` records ``effect`` for ``lease.job_id`` atomically iff that job has no
    committed effect yet and ``lease`` is the job's live lease: returns True when it
    committed, False when the job's effect was already committed (the caller just
    acks); raises :class:`StaleLease` when the lease is not live (the caller is a
    zombie: it must stop). Effects are keyed by job id, never by (job, token), so a
    worker killed between effect and ack and the worker that re-runs the job apply it
    once between them.
    """

    def commit(self, lease: Lease, effect: Any) -> bool: ...

    def effects(self) -> dict[str, Any]:
        """Every committed effect, by job id (a copy)."""
        ...


class JobQueue(Protocol):
    """A job queue, as its producers and workers call it: stage 1's ``JobQueue``, and the
    queue every later stage builds on (stage 2's pools around it; stage 3's queue on Redis,
    a :class:`SharedJobQueue`).

    A producer ``enqueue``s and may ``cancel``; a worker ``claim``s a :class:`Lease`, and
    answers it once with ``ack`` (done) or ``nack`` (this attempt failed), extending it
    meanwhile with ``heartbeat`` or handing it back unfinished with ``release``. Every
    answer with a lease that is not the job's live lease raises :class:`StaleLease` and
    changes nothing (the fence against zombies); an id the queue does not hold raises
    :class:`JobNotFound`. Every call first settles what is due at now, so what a call
    returns never depends on whether anyone called before it.
    """

    def enqueue(
        self,
        payload: Any,
        *,
        priority: int = 0,
        run_at_ns: int | None = None,
        idempotency_key: str | None = None,
    ) -> str:
        """Add a job due at ``run_at_ns`` (None: now); its id — the first job's for an
        idempotency key seen within its TTL. :class:`QueueFull` past ``max_pending``."""
        ...

    def claim(self, worker_id: str) -> Lease | None:
        """Lease the best READY job to ``worker_id`` (an attempt counted, the next token
        issued), or None when none is READY."""
        ...

    def ack(self, lease: Lease, result: Any = None) -> None:
        """Finish the leased job as SUCCEEDED with ``result``."""
        ...

    def nack(self, lease: Lease, error: str) -> None:
        """Fail this attempt: a retry after the backoff, or DEAD at ``max_attempts``."""
        ...

    def get(self, job_id: str) -> Job:
        """A snapshot of the job now."""
        ...

    def next_due_ns(self) -> int | None:
        """When the next claim can succeed: now if a job is READY, else the earliest run
        time or lease expiry, else None."""
        ...

    def heartbeat(self, lease: Lease) -> Lease:
        """Extend a live lease to now + ``lease_ns`` (an expired one is never revived)."""
        ...

    def release(self, lease: Lease) -> None:
        """Hand the job back unfinished: READY in its old place, its attempt refunded."""
        ...

    def cancel(self, job_id: str) -> bool:
        """Cancel an unfinished job (its lease goes stale); False if it was finished."""
        ...

    def dead_letters(self) -> list[Job]:
        """The DEAD jobs held, in the order they died."""
        ...

    def redrive(self, job_id: str) -> bool:
        """Return a DEAD job to READY, attempts zeroed, token kept; False if not DEAD."""
        ...

    def is_current(self, lease: Lease) -> bool:
        """Whether ``lease`` is its job's live lease now."""
        ...

    def statistics(self) -> QueueStatistics:
        """Jobs held per state, and idempotency records held."""
        ...


#: Defaults: idempotency keys dedupe for a day; finished jobs are kept for a day.
DEFAULT_DEDUP_TTL_NS = 24 * 3600 * NS_PER_S
DEFAULT_RETENTION_NS = 24 * 3600 * NS_PER_S

__all__ = [
    "DEFAULT_DEDUP_TTL_NS",
    "DEFAULT_RETENTION_NS",
    "FINISHED_STATES",
    "JITTERS",
    "LEASE_EXPIRED",
    "NS_PER_MS",
    "NS_PER_S",
    "Clock",
    "EffectStore",
    "Jitter",
    "Job",
    "JobNotFound",
    "JobQueue",
    "JobQueueError",
    "JobState",
    "Lease",
    "ManualClock",
    "MonotonicClock",
    "QueueFull",
    "QueueStatistics",
    "RetryPolicy",
    "StaleLease",
    "WaitingClock",
    "check_client",
    "to_json",
    "unavailable",
]


# --- Stage 2: worker pools -------------------------------------------------------------


@dataclass(frozen=True)
class PoolStatistics:
    """A snapshot of a worker pool's bookkeeping (counts since the pool was built).

    - ``in_flight``: jobs claimed whose handler has not finished (and not released).
    - ``idle``: workers waiting for a job to become due, or for a free ``max_in_flight`` slot.
    - ``claimed``: leases taken; ``succeeded``: acked; ``failed``: nacked (the handler
      raised, or timed out); ``released``: handed back at shutdown (attempt refunded);
      ``lost``: the lease went stale before the handler finished, so its ack/nack was
      refused; ``heartbeats``: leases extended; ``timed_out``: handlers cancelled at
      their timeout (async pool only; also counted in ``failed``).
    - ``stopping``: shutdown has begun: nothing more is claimed.
    """

    workers: int
    in_flight: int
    idle: int
    claimed: int
    succeeded: int
    failed: int
    released: int
    lost: int
    heartbeats: int
    timed_out: int
    stopping: bool


class WorkerPool(Protocol):
    """Worker threads around a :class:`JobQueue` (stage 2's ``ThreadWorkerPool``): what
    a service starts, feeds and stops.

    Handlers run outside the pool's lock, their leases heartbeaten while they run; a
    handler's return value acks its job, an exception nacks it. ``shutdown`` stops
    claiming at once and returns only when no job of the pool holds a lease: each one
    finished within ``grace_ns``, or released (its attempt refunded).
    """

    def start(self) -> None:
        """Start the workers (once: RuntimeError the second time)."""
        ...

    def submit(self, payload: Any, **options: Any) -> str:
        """Enqueue a job (``options`` as for :meth:`JobQueue.enqueue`) and wake an idle
        worker; its id."""
        ...

    def shutdown(self, grace_ns: int) -> None:
        """Stop claiming; wait up to ``grace_ns`` for running jobs; release the rest."""
        ...

    def statistics(self) -> PoolStatistics:
        """A snapshot of the pool's counters."""
        ...


class AsyncWorkerPool(Protocol):
    """The same pool as tasks of one event loop (stage 2's ``AsyncWorkerPool``): ``run``
    is the pool's life, from the first claim until ``shutdown`` has finished.

    A handler still running ``timeout_ns`` after its claim is cancelled and its job
    nacked with ``TIMED_OUT``; at the grace deadline ``shutdown`` cancels the handlers
    still running and releases their jobs.
    """

    async def run(self) -> None:
        """Run the workers until ``shutdown`` has finished (once: RuntimeError after)."""
        ...

    def submit(self, payload: Any, **options: Any) -> str:
        """Enqueue a job (``options`` as for :meth:`JobQueue.enqueue`); its id."""
        ...

    async def shutdown(self, grace_ns: int) -> None:
        """Stop claiming; wait up to ``grace_ns``; cancel and release what still runs."""
        ...

    def statistics(self) -> PoolStatistics:
        """A snapshot of the pool's counters."""
        ...


#: The error a timed-out job is nacked with (async pool).
TIMED_OUT = "timed out"

__all__ += ["TIMED_OUT", "AsyncWorkerPool", "PoolStatistics", "WorkerPool"]


# --- Stage 3: the queue on Redis -------------------------------------------------------


@dataclass(frozen=True)
class OpStamp:
    """Where one call on a Redis queue stands in the order Redis ran every call.

    ``op`` is the queue's operation counter, incremented by every script; Redis runs
    scripts one at a time, so sorting calls by ``op`` recovers the order they took
    effect in, whichever process made them. ``server_now_ns`` is the server's ``TIME``
    in that script (whole µs, in ns) — the only clock a stage-3 queue reads.
    """

    op: int
    server_now_ns: int


class SharedJobQueue(JobQueue, Protocol):
    """A :class:`JobQueue` whose state lives on a server that many processes share
    (stage 3's ``RedisJobQueue``): each call one atomic script, on the server's clock.

    Besides stage 1's calls: ``delay_ns`` counts from the server's now; ``reap`` settles
    what is due (lease expiries first) for a queue nobody else calls; ``last_op`` tells
    where the calling thread's last call stands in the order the server ran every call.
    """

    @property
    def lease_ns(self) -> int:
        """How long a claim or a heartbeat leases a job for."""
        ...

    def enqueue(
        self,
        payload: Any,
        *,
        priority: int = 0,
        run_at_ns: int | None = None,
        idempotency_key: str | None = None,
        delay_ns: int | None = None,
    ) -> str:
        """As :meth:`JobQueue.enqueue`; ``run_at_ns`` on the server's clock, or
        ``delay_ns`` from the server's now (one or neither)."""
        ...

    def reap(self) -> int:
        """Apply what is due; how many leases expired."""
        ...

    def last_op(self) -> OpStamp | None:
        """This thread's last call: the operation counter and the server time of its
        script (None before the first call)."""
        ...


class Worker(Protocol):
    """One worker's loop over a :class:`SharedJobQueue` (stage 3's ``RedisWorker``), the
    body of a worker process: claim, run the handler, commit its effect, ack.

    ``stop`` is safe from a signal handler: the running job has ``grace_ns`` to finish,
    then it is released. An unreachable server is waited out, never a crash.
    """

    def run(self, *, max_jobs: int | None = None) -> None:
        """Work until :meth:`stop`, or until ``max_jobs`` jobs were handled."""
        ...

    def stop(self, grace_ns: int = 0) -> None:
        """Stop claiming; the running job has ``grace_ns`` to finish, then is released."""
        ...

    def statistics(self) -> PoolStatistics:
        """This worker's counters (``workers`` is 1)."""
        ...


__all__ += ["OpStamp", "SharedJobQueue", "Worker"]
