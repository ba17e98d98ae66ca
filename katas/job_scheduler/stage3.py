"""Stage 3 — the stage-1 queue on Redis, for workers on many machines.

Core: :class:`RedisJobQueue` — stage 1's semantics with the state in Redis, every
transition one atomic Lua script (one round trip) on the server's clock — and
:class:`RedisEffectStore`, where workers apply effects once, fenced by the live token.
Extended: :class:`RedisWorker`, one worker's loop, which ``python -m katas._harness.worker``
runs as a separate OS process so that the suite can SIGKILL, SIGSTOP and SIGTERM it for
real. The prompt is katas/job_scheduler/README.md; run the suite with
``pytest katas/job_scheduler -k stage3`` (``-k "stage3 and core"`` for the core).

Rules the suite checks:

- Every transition — enqueue, claim, ack, nack, heartbeat, release, cancel, redrive,
  commit — is **one script**: one round trip (the test proxy counts them), atomic
  because Redis runs one script at a time. Reads (get, next_due_ns, statistics,
  dead_letters, is_current, effects) are one script too, and settle first like every
  call. No read-then-write from Python, no MULTI/WATCH.
- **Server time**: each script reads ``TIME`` (integer µs). Every time in the API is
  nanoseconds on the server's clock (µs × 1000); ``run_at_ns`` is rounded up to a whole
  µs, ``delay_ns`` counts from the server's now. This process reads no clock for a job.
- Every script first applies due lease expiries in ``(expires_at, seq)`` order, then
  moves due delayed jobs to ready — stage 1's settle; :meth:`RedisJobQueue.reap` does
  only that, so a queue nobody calls still retries its crashed jobs.
- Every script increments the queue's operation counter and returns it with ``TIME``;
  :meth:`RedisJobQueue.last_op` reports both for the calling thread's last call. The
  suite sorts a run's calls by ``op`` and replays them through an exact model.
- Order, attempts, backoff (jitter from one ``rng`` draw per call, expanded in the
  script), fencing tokens, dead letters, redrive and idempotency keys exactly as in
  stage 1. Durations (``lease_ns``, the retry policy, ``dedup_ttl_ns``,
  ``retention_ns``) must be whole µs.
- Retention: a finished job is forgotten at finish + ``retention_ns`` (an idempotency
  key at its first enqueue + ``dedup_ttl_ns``); whatever holds finished jobs or records
  carries a TTL that ends with its newest member's, set by the script that adds to it.
  Pending jobs have none.
- On a Redis Cluster: a queue is a fixed set of keys under the hash tag ``{<name>}``,
  and every script declares every key it touches in ``KEYS`` (no key per job: a job is
  fields of a few hashes). While the queue's slot moves, a call either runs whole or
  raises the cluster's refusal (``TRYAGAIN``), an unavailability like an outage.
- Payloads, results and effects are JSON: anything else raises ``TypeError`` naming it
  before anything is sent. Bad arguments raise as in stage 1 and change nothing.
"""

from __future__ import annotations

# TODO(stage3): implement every class and method below; delete each
# `raise Todo()` as you go.
import random
from collections.abc import Callable
from typing import Any

import redis

from katas._runtime.todo import Todo
from katas.job_scheduler.api import (
    DEFAULT_DEDUP_TTL_NS,
    DEFAULT_RETENTION_NS,
    NS_PER_MS,
    Job,
    Lease,
    OpStamp,
    PoolStatistics,
    QueueStatistics,
    RetryPolicy,
    WaitingClock,
)

Handler = Callable[[Lease, Any], Any]
EventHook = Callable[[str, Lease | None], None]


class RedisJobQueue:
    """Stage 1's JobQueue with its state in Redis, shared by every process that names it.

    ``client`` is a ``redis.Redis`` or a ``redis.RedisCluster`` (a socket timeout, no
    retries: else ValueError); ``name`` the queue (the hash tag of every key, so one
    queue lives in one Redis Cluster slot: ``<key_prefix>{<name>}:…``). Every script
    declares every key it touches in ``KEYS``. Every client of one queue must be built
    with the same settings. ``lease_ns`` >= 1000.
    """

    def __init__(
        self,
        client: redis.Redis | redis.RedisCluster,
        *,
        lease_ns: int,
        retry: RetryPolicy,
        max_attempts: int,
        rng: random.Random | None = None,
        dedup_ttl_ns: int = DEFAULT_DEDUP_TTL_NS,
        retention_ns: int = DEFAULT_RETENTION_NS,
        max_pending: int | None = None,
        name: str = "jobs",
        key_prefix: str = "q:",
    ) -> None:
        raise Todo()

    @property
    def lease_ns(self) -> int:
        """How long a claim or heartbeat leases a job for."""
        raise Todo()

    def enqueue(
        self,
        payload: Any,
        *,
        priority: int = 0,
        run_at_ns: int | None = None,
        idempotency_key: str | None = None,
        delay_ns: int | None = None,
    ) -> str:
        """Add a job (one script); return its id — the first job's id for a key seen
        within its TTL. ``run_at_ns`` is on the server's clock; ``delay_ns`` counts
        from the server's now (give one or neither). QueueFull past ``max_pending``."""
        raise Todo()

    def claim(self, worker_id: str) -> Lease | None:
        """Lease the best due job to ``worker_id`` (counting an attempt, bumping the
        token), or None — one script."""
        raise Todo()

    def ack(self, lease: Lease, result: Any = None) -> None:
        """Finish the leased job as SUCCEEDED with ``result``; StaleLease if not live."""
        raise Todo()

    def nack(self, lease: Lease, error: str) -> None:
        """Fail this attempt: retry after backoff, or DEAD after max_attempts attempts."""
        raise Todo()

    def get(self, job_id: str) -> Job:
        """A snapshot of the job; JobNotFound if unknown or forgotten."""
        raise Todo()

    def next_due_ns(self) -> int | None:
        """The server's now if a job is READY; else the next run time or lease expiry
        (server time); else None."""
        raise Todo()

    def heartbeat(self, lease: Lease) -> Lease:
        """Extend a live lease to now + lease_ns; StaleLease if it has expired."""
        raise Todo()

    def release(self, lease: Lease) -> None:
        """Hand the job back unfinished: READY again in its old place, attempt refunded."""
        raise Todo()

    def cancel(self, job_id: str) -> bool:
        """Cancel an unfinished job (its lease goes stale); False if already finished."""
        raise Todo()

    def dead_letters(self) -> list[Job]:
        """Snapshots of the DEAD jobs still held, in the order they died."""
        raise Todo()

    def redrive(self, job_id: str) -> bool:
        """Return a DEAD job to READY with attempts zeroed; False if it is not DEAD."""
        raise Todo()

    def is_current(self, lease: Lease) -> bool:
        """Whether ``lease`` is its job's live lease now."""
        raise Todo()

    def statistics(self) -> QueueStatistics:
        """Jobs held per state, and idempotency records held (one script)."""
        raise Todo()

    def reap(self) -> int:
        """Apply what is due (lease expiries first); return how many leases expired."""
        raise Todo()

    def last_op(self) -> OpStamp | None:
        """This thread's last call on the queue: the operation counter and the server
        time its script returned (None before the first call)."""
        raise Todo()


class RedisEffectStore:
    """Effects by job id in Redis, committed at most once per job, fenced by the token.

    ``commit`` checks the live lease and writes the effect in one script: True when it
    committed, False when the job's effect was committed already (by an attempt that
    died before its ack), StaleLease when the lease is not live.
    """

    def __init__(self, queue: RedisJobQueue) -> None:
        raise Todo()

    def commit(self, lease: Lease, effect: Any) -> bool:
        """Record ``effect`` iff the job has none and ``lease`` is live (else StaleLease)."""
        raise Todo()

    def effects(self) -> dict[str, Any]:
        """Every committed effect of a job the queue still holds, by job id."""
        raise Todo()


class RedisWorker:
    """One worker: claim a job, run ``handler(lease, payload)``, commit its return value
    as the job's effect (``RedisEffectStore``), then ack it with that value as result.

    - A handler's exception nacks the job with ``"<ExceptionType>: <message>"``.
    - While a handler runs, a thread heartbeats its lease every ``heartbeat_every_ns``
      (default a third of ``queue.lease_ns``), timed by ``clock`` (default: monotonic).
    - Redis unreachable (``api.unavailable(error)``: a connection refused or timed out,
      BUSY, CLUSTERDOWN, TRYAGAIN, a dead master): wait ``poll_ns`` and try the same step
      again — never crash, never drop the job. A stale lease at any step
      (``StaleLease``/``JobNotFound``) drops the job: someone else has it.
    - An idle worker polls ``claim`` every ``poll_ns``.
    - ``on_event(event, lease)`` is called for "claimed", "committed", "duplicate"
      (already committed), "after_effect", "acked", "failed", "lost", "released", and
      "unavailable" (lease None); the process runner holds at some of them.
    """

    def __init__(
        self,
        queue: RedisJobQueue,
        handler: Handler,
        *,
        worker_id: str,
        clock: WaitingClock | None = None,
        heartbeat_every_ns: int | None = None,
        poll_ns: int = 20 * NS_PER_MS,
        on_event: EventHook | None = None,
    ) -> None:
        raise Todo()

    def run(self, *, max_jobs: int | None = None) -> None:
        """Work until :meth:`stop`, or until ``max_jobs`` jobs were handled."""
        raise Todo()

    def stop(self, grace_ns: int = 0) -> None:
        """Stop claiming; the running job has ``grace_ns`` to finish, then it is released
        (attempt refunded, its handler's result dropped). Safe from a signal handler."""
        raise Todo()

    def statistics(self) -> PoolStatistics:
        """This worker's counters (``workers`` is 1; ``timed_out`` is always 0)."""
        raise Todo()
