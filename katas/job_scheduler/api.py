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
    - ``idle``: workers waiting for a job to become due.
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


#: The error a timed-out job is nacked with (async pool).
TIMED_OUT = "timed out"

__all__ += ["TIMED_OUT", "PoolStatistics"]


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


__all__ += ["OpStamp"]
