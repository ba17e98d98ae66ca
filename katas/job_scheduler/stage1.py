"""Stage 1 — a single-threaded job queue: leases, fencing tokens, retries.

Core: :class:`JobQueue` — ``enqueue``, ``claim``, ``ack``, ``nack``, ``get``,
``next_due_ns``. Extended: ``heartbeat``, ``release``, ``cancel``, ``dead_letters``,
``redrive``, idempotency keys, retention, ``max_pending``, ``statistics``,
``is_current`` and :class:`MemoryEffectStore`. The prompt is
katas/job_scheduler/README.md; run the suite with ``pytest katas/job_scheduler -k stage1``
(``-k "stage1 and core"`` for the core).

Rules the queue follows (the suite checks each one):

- Time comes only from ``clock.now_ns()``: integer nanoseconds, exact arithmetic.
- States: ``SCHEDULED → READY → LEASED → SUCCEEDED | DEAD``, plus ``CANCELLED``
  (see :class:`~katas.job_scheduler.api.JobState`). A job is READY from its due time
  on and is never claimed before it.
- Order: among READY jobs, larger ``priority`` first; ties by due time, then by enqueue
  sequence number (a retry keeps its number). Payloads and ids are never compared.
- **Every public call first settles what is due at now**, in this order: expired
  leases in (expires_at, seq) order; then SCHEDULED jobs whose time has come become
  READY; then finished jobs and idempotency records past their retention are
  forgotten. A lease is live while ``now < expires_at_ns``.
- An attempt is counted when a job is claimed, so a lease expiry costs an attempt;
  ``release`` refunds it. A failed attempt (``nack``, or a lease expiring) is retried
  after the :class:`~katas.job_scheduler.api.RetryPolicy` backoff, counted from the
  ``nack`` or from the expiry time — unless it was attempt ``max_attempts``: then the
  job is DEAD, at once, with no backoff drawn. A job dying by expiry finishes at the
  expiry time. Its ``last_error`` is the nack's error, or ``LEASE_EXPIRED``.
- Backoff with ``n`` the attempt that failed: ``d = min(cap_ns, base_ns·2^(n-1))``;
  ``none``: d; ``full``: ``rng.randrange(d + 1)``; ``equal``:
  ``d//2 + rng.randrange(d//2 + 1)``; ``decorrelated``:
  ``min(cap_ns, rng.randrange(base_ns, 3·prev + 1))``, prev the job's previous delay
  (``base_ns`` at first, and again after a redrive). Exactly one ``rng`` call per
  jittered retry, none for ``none``.
- Fencing: each claim of a job issues a token one above the job's previous token
  (the first is 1); tokens never reset, not even on ``redrive``. A lease is identified
  by (job id, token). ``ack``/``nack``/``heartbeat``/``release`` with a lease that is
  not live raise ``StaleLease`` and change nothing; an unknown job id raises
  ``JobNotFound``.
- Bad input raises ``TypeError``/``ValueError`` naming the parameter (``bool`` is not an
  int here) and changes nothing.
- Finished jobs (SUCCEEDED, DEAD, CANCELLED) are forgotten at
  ``finished_at + retention_ns`` (``get`` then raises ``JobNotFound``); an idempotency
  record at ``first enqueue + dedup_ttl_ns``. Memory stays bounded by recent work.
"""

from __future__ import annotations

# TODO(stage1): implement every class and method below; delete each
# `raise Todo()` as you go.
import random
from typing import Any

from katas._runtime.todo import Todo
from katas.job_scheduler.api import (
    DEFAULT_DEDUP_TTL_NS,
    DEFAULT_RETENTION_NS,
    Clock,
    Job,
    Lease,
    QueueStatistics,
    RetryPolicy,
)


class JobQueue:
    """Jobs by priority and due time, leased to workers, retried with backoff.

    ``lease_ns`` (>= 1) is how long a claim (or a heartbeat) keeps a job;
    ``max_attempts`` (>= 1) how many counted attempts a job gets before it is DEAD.
    ``rng`` draws the backoff jitter (default: a fresh ``random.Random()``).
    ``dedup_ttl_ns`` and ``retention_ns`` (>= 0) bound idempotency records and finished
    jobs in time; ``max_pending`` (None: unbounded, else >= 1) bounds the jobs not yet
    finished — ``enqueue`` and ``redrive`` beyond it raise ``QueueFull``.
    """

    def __init__(
        self,
        *,
        clock: Clock,
        lease_ns: int,
        retry: RetryPolicy,
        max_attempts: int,
        rng: random.Random | None = None,
        dedup_ttl_ns: int = DEFAULT_DEDUP_TTL_NS,
        retention_ns: int = DEFAULT_RETENTION_NS,
        max_pending: int | None = None,
    ) -> None:
        raise Todo()

    # --- core -------------------------------------------------------------------------

    def enqueue(
        self,
        payload: Any,
        *,
        priority: int = 0,
        run_at_ns: int | None = None,
        idempotency_key: str | None = None,
    ) -> str:
        """Add a job; return its id, unique within this queue.

        The job is due at ``run_at_ns`` (an absolute clock time; None: now): READY if
        that is not in the future, else SCHEDULED. With an ``idempotency_key`` seen
        within ``dedup_ttl_ns`` of its first enqueue, return the first job's id and
        create nothing (even if that job is finished or forgotten).
        """
        raise Todo()

    def claim(self, worker_id: str) -> Lease | None:
        """Lease the first READY job in order to ``worker_id``, or return None.

        Counts an attempt, issues the next fencing token, and leases the job until
        now + ``lease_ns``. ``worker_id`` is a non-empty str.
        """
        raise Todo()

    def ack(self, lease: Lease, result: Any = None) -> None:
        """Finish the job as SUCCEEDED, keeping ``result``. StaleLease unless live."""
        raise Todo()

    def nack(self, lease: Lease, error: str) -> None:
        """Fail this attempt with ``error`` (a str): retry after backoff, or DEAD.

        StaleLease unless ``lease`` is live.
        """
        raise Todo()

    def get(self, job_id: str) -> Job:
        """A snapshot of the job now. JobNotFound if unknown or forgotten."""
        raise Todo()

    def next_due_ns(self) -> int | None:
        """When the next claim can succeed, as far as the queue knows now.

        Now if a job is READY; else the earliest of the SCHEDULED jobs' run times and the
        live leases' expiry times (an expiry may bring its job back); None if there is
        neither. Before that time, ``claim`` returns None.
        """
        raise Todo()

    # --- extended ---------------------------------------------------------------------

    def heartbeat(self, lease: Lease) -> Lease:
        """Extend a live lease to now + ``lease_ns``; return it (same token and attempt).

        StaleLease if the lease is not live — an expired lease is never revived, even if
        no other worker has claimed the job since.
        """
        raise Todo()

    def release(self, lease: Lease) -> None:
        """Hand the job back unfinished: READY again, in its old place, attempt refunded.

        For graceful shutdown. StaleLease unless ``lease`` is live.
        """
        raise Todo()

    def cancel(self, job_id: str) -> bool:
        """Cancel a job that is not finished: CANCELLED now, its lease (if any) stale.

        Return True if cancelled, False if the job was already finished (nothing
        changes). JobNotFound if unknown.
        """
        raise Todo()

    def dead_letters(self) -> list[Job]:
        """Snapshots of the DEAD jobs held, in the order they died (oldest first)."""
        raise Todo()

    def redrive(self, job_id: str) -> bool:
        """Return a DEAD job to READY now, attempts zeroed (its token is not reset).

        Return True if redriven, False if the job is not DEAD (nothing changes).
        JobNotFound if unknown; QueueFull if ``max_pending`` jobs are pending.
        """
        raise Todo()

    def is_current(self, lease: Lease) -> bool:
        """Whether ``lease`` is its job's live lease now (False for a forgotten job)."""
        raise Todo()

    def statistics(self) -> QueueStatistics:
        """How many jobs are held in each state, and how many idempotency records."""
        raise Todo()


class MemoryEffectStore:
    """Job effects by job id, each committed at most once, fenced by ``queue``'s tokens.

    Implements :class:`~katas.job_scheduler.api.EffectStore`: a worker commits its
    job's effect here before it acks, so a job re-run after a crash between effect and
    ack does not apply the effect twice, and a worker whose lease expired (a zombie)
    applies nothing.
    """

    def __init__(self, queue: JobQueue) -> None:
        raise Todo()

    def commit(self, lease: Lease, effect: Any) -> bool:
        """Record ``effect`` for ``lease.job_id`` iff it has none and the lease is live.

        True: committed now. False: the job's effect was committed before (by an
        earlier attempt); nothing changes. StaleLease if the lease is not live (checked
        first: a zombie learns it is one).
        """
        raise Todo()

    def effects(self) -> dict[str, Any]:
        """Every committed effect, by job id (a copy)."""
        raise Todo()
