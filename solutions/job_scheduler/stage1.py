"""Stage 1 reference: an in-memory job queue with leases, fencing tokens and retries.

Design (see katas/job_scheduler/README.md):

- One mutable record per job (``__slots__``) in a dict by id; snapshots (``Job``) are
  built only when asked for. This is a hot path: no ``dataclasses.replace``, no uuid4.
- Three heaps with lazy deletion, each entry led by the fields that order it and the
  job's enqueue ``seq`` before its id, so ties never compare payloads or ids:
  ``_ready`` (-priority, due, seq, id) for due jobs, ``_delayed`` (due, seq, id) for
  jobs waiting for their time, ``_leases`` (expires_at, seq, token, id) for leases.
  One heap cannot do: a high-priority job that is not due yet would sit on top of due
  ones. An entry is live iff its job is still in the state the heap stands for (and,
  for leases, still holds that token and expiry); stale entries are skipped when popped
  and dropped by a rebuild once they outnumber the live ones (amortised O(1)).
- Every public call first settles what time made due, in this order: lease expiries in
  (expires_at, seq) order (each costs its attempt, backoff counted from the expiry),
  then scheduled jobs becoming READY, then retention of finished jobs and idempotency
  records. So the rng is drawn in an order fixed by the calls and their times alone.
- Two more heaps order the forgetting: finished jobs (finished_at + retention) and
  idempotency records (first enqueue + TTL). Memory is bounded by recent work.
"""

from __future__ import annotations

import random
from heapq import heapify, heappop, heappush
from typing import Any

from katas.job_scheduler.api import (
    DEFAULT_DEDUP_TTL_NS,
    DEFAULT_RETENTION_NS,
    FINISHED_STATES,
    LEASE_EXPIRED,
    Clock,
    Job,
    JobNotFound,
    JobState,
    Lease,
    QueueFull,
    QueueStatistics,
    RetryPolicy,
    StaleLease,
)

SCHEDULED, READY, LEASED = JobState.SCHEDULED, JobState.READY, JobState.LEASED
SUCCEEDED, DEAD, CANCELLED = JobState.SUCCEEDED, JobState.DEAD, JobState.CANCELLED

#: Rebuild a heap once it holds this many more stale entries than live ones.
_SLACK = 64


def _check_int(name: str, value: object, minimum: int | None = None) -> int:
    # bool is an int subclass, but True as a priority or a duration is always a mistake.
    if type(value) is not int:
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _check_str(name: str, value: object) -> str:
    if type(value) is not str or not value:
        raise TypeError(f"{name} must be a non-empty str, got {value!r}")
    return value


class _Job:
    """A job's mutable record; ``due`` is when its current (or last) attempt is due."""

    __slots__ = (
        "attempts", "due", "enqueued_at", "expires_at", "finished_at", "id", "last_error",
        "payload", "prev_delay", "priority", "result", "seq", "state", "token", "worker_id",
    )  # fmt: skip

    def __init__(self, job_id: str, payload: Any, priority: int, seq: int, now: int) -> None:
        self.id = job_id
        self.payload = payload
        self.priority = priority
        self.seq = seq
        self.enqueued_at = now
        self.state = SCHEDULED
        self.due = now
        self.attempts = 0
        self.token = 0  # fencing token: bumped by every claim, never reset
        self.prev_delay: int | None = None  # decorrelated jitter's previous delay
        self.last_error: str | None = None
        self.result: Any = None
        self.expires_at: int | None = None
        self.worker_id: str | None = None
        self.finished_at: int | None = None


class JobQueue:
    """Jobs by priority and due time, leased to workers, retried with backoff."""

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
        if not isinstance(clock, Clock):
            raise TypeError(f"clock must have now_ns(), got {clock!r}")
        if not isinstance(retry, RetryPolicy):
            raise TypeError(f"retry must be a RetryPolicy, got {retry!r}")
        if rng is not None and not isinstance(rng, random.Random):
            raise TypeError(f"rng must be a random.Random, got {rng!r}")
        self._clock = clock
        self._lease_ns = _check_int("lease_ns", lease_ns, 1)
        self._retry = retry
        self._max_attempts = _check_int("max_attempts", max_attempts, 1)
        self._rng = random.Random() if rng is None else rng
        self._dedup_ttl_ns = _check_int("dedup_ttl_ns", dedup_ttl_ns, 0)
        self._retention_ns = _check_int("retention_ns", retention_ns, 0)
        self._max_pending = (
            None if max_pending is None else _check_int("max_pending", max_pending, 1)
        )
        self._jobs: dict[str, _Job] = {}
        self._seq = 0
        self._ready: list[tuple[int, int, int, str]] = []
        self._delayed: list[tuple[int, int, str]] = []
        self._leases: list[tuple[int, int, int, str]] = []
        self._waiting = 0  # jobs SCHEDULED or READY: the live entries of _ready + _delayed
        self._leased = 0  # jobs LEASED: the live entries of _leases
        self._dead: dict[str, None] = {}  # dead letters, in the order they died
        self._forget: list[tuple[int, int, str]] = []  # (finished_at + retention, seq, id)
        self._keys: dict[str, tuple[str, int]] = {}  # idempotency key -> (job id, expiry)
        self._key_expiry: list[tuple[int, str]] = []

    # --- core -------------------------------------------------------------------------

    def enqueue(
        self,
        payload: Any,
        *,
        priority: int = 0,
        run_at_ns: int | None = None,
        idempotency_key: str | None = None,
    ) -> str:
        """Add a job; return its id (the first job's id for a key seen within its TTL)."""
        _check_int("priority", priority)
        if run_at_ns is not None:
            _check_int("run_at_ns", run_at_ns)
        if idempotency_key is not None:
            _check_str("idempotency_key", idempotency_key)
        now = self._settle()
        if idempotency_key is not None and (known := self._keys.get(idempotency_key)):
            return known[0]  # a retried enqueue: create nothing
        self._check_room()
        self._seq += 1
        job_id = f"job-{self._seq}"
        rec = _Job(job_id, payload, priority, self._seq, now)
        self._jobs[job_id] = rec
        self._waiting += 1
        self._schedule(rec, now if run_at_ns is None else run_at_ns, now)
        if idempotency_key is not None:
            expiry = now + self._dedup_ttl_ns  # counted from the first enqueue only
            self._keys[idempotency_key] = (job_id, expiry)
            heappush(self._key_expiry, (expiry, idempotency_key))
        return job_id

    def claim(self, worker_id: str) -> Lease | None:
        """Lease the best due job to ``worker_id`` (counting an attempt), or None."""
        _check_str("worker_id", worker_id)
        now = self._settle()
        ready, jobs = self._ready, self._jobs
        while ready:
            rec = jobs.get(heappop(ready)[-1])
            if rec is not None and rec.state is READY:  # else cancelled since: stale
                break
        else:
            return None
        rec.state = LEASED
        rec.attempts += 1
        rec.token += 1
        rec.expires_at = expires = now + self._lease_ns
        rec.worker_id = worker_id
        self._waiting -= 1
        self._leased += 1
        self._push_lease(rec, expires)
        return Lease(rec.id, rec.token, rec.attempts, expires, worker_id)

    def ack(self, lease: Lease, result: Any = None) -> None:
        """Finish the leased job as SUCCEEDED with ``result``; StaleLease if not live."""
        now = self._settle()
        rec = self._live(lease)
        rec.result = result
        self._leased -= 1
        self._finish(rec, SUCCEEDED, now)

    def nack(self, lease: Lease, error: str) -> None:
        """Fail this attempt: retry after backoff, or DEAD after max_attempts attempts."""
        if type(error) is not str:
            raise TypeError(f"error must be a str, got {error!r}")
        now = self._settle()
        rec = self._live(lease)
        self._leased -= 1
        self._fail(rec, error, now, now)

    def get(self, job_id: str) -> Job:
        """A snapshot of the job; JobNotFound if unknown or forgotten."""
        self._settle()
        return self._snapshot(self._record(job_id))

    def next_due_ns(self) -> int | None:
        """Now if a job is READY; else the next run time or lease expiry; else None."""
        now = self._settle()
        jobs = self._jobs
        ready, delayed, leases = self._ready, self._delayed, self._leases
        # Drop stale tops so they cannot pose as the next event.
        while ready and ((r := jobs.get(ready[0][-1])) is None or r.state is not READY):
            heappop(ready)
        if ready:
            return now
        while delayed and ((r := jobs.get(delayed[0][-1])) is None or r.state is not SCHEDULED):
            heappop(delayed)
        while leases and not self._lease_entry_live(leases[0]):
            heappop(leases)
        times = [heap[0][0] for heap in (delayed, leases) if heap]
        return min(times) if times else None

    # --- extended ---------------------------------------------------------------------

    def heartbeat(self, lease: Lease) -> Lease:
        """Extend a live lease to now + lease_ns; StaleLease if it has expired."""
        now = self._settle()  # an expired lease is settled first: never revived
        rec = self._live(lease)
        expires = now + self._lease_ns
        if expires != rec.expires_at:
            rec.expires_at = expires
            self._push_lease(rec, expires)
        return Lease(rec.id, rec.token, rec.attempts, expires, lease.worker_id)

    def release(self, lease: Lease) -> None:
        """Hand the job back unfinished: READY again in its old place, attempt refunded."""
        now = self._settle()
        rec = self._live(lease)
        rec.attempts -= 1
        self._leased -= 1
        self._waiting += 1
        self._schedule(rec, rec.due, now)

    def cancel(self, job_id: str) -> bool:
        """Cancel an unfinished job (its lease goes stale); False if already finished."""
        now = self._settle()
        rec = self._record(job_id)
        if rec.state in FINISHED_STATES:
            return False
        if rec.state is LEASED:
            self._leased -= 1
        else:
            self._waiting -= 1
        self._finish(rec, CANCELLED, now)
        if len(self._ready) + len(self._delayed) > 2 * self._waiting + _SLACK:
            jobs = self._jobs  # a stale entry's job may be forgotten already
            self._ready = [e for e in self._ready if (r := jobs.get(e[-1])) and r.state is READY]
            self._delayed = [
                e for e in self._delayed if (r := jobs.get(e[-1])) and r.state is SCHEDULED
            ]
            heapify(self._ready)
            heapify(self._delayed)
        return True

    def dead_letters(self) -> list[Job]:
        """Snapshots of the DEAD jobs still held, in the order they died."""
        self._settle()
        return [self._snapshot(self._jobs[job_id]) for job_id in self._dead]

    def redrive(self, job_id: str) -> bool:
        """Return a DEAD job to READY with attempts zeroed; False if it is not DEAD."""
        now = self._settle()
        rec = self._record(job_id)
        if rec.state is not DEAD:
            return False
        self._check_room()
        del self._dead[job_id]
        rec.attempts = 0
        rec.prev_delay = None
        rec.finished_at = None
        self._waiting += 1
        self._schedule(rec, now, now)
        return True

    def is_current(self, lease: Lease) -> bool:
        """Whether ``lease`` is its job's live lease now."""
        self._settle()
        try:
            self._live(lease)
        except (StaleLease, JobNotFound):
            return False
        return True

    def statistics(self) -> QueueStatistics:
        """Jobs held per state, and idempotency records held (O(jobs held))."""
        self._settle()
        counts = dict.fromkeys(JobState, 0)
        for rec in self._jobs.values():
            counts[rec.state] += 1
        return QueueStatistics(
            scheduled=counts[SCHEDULED],
            ready=counts[READY],
            leased=counts[LEASED],
            succeeded=counts[SUCCEEDED],
            dead=counts[DEAD],
            cancelled=counts[CANCELLED],
            idempotency_keys=len(self._keys),
        )

    # --- internals --------------------------------------------------------------------

    def _settle(self) -> int:
        """Apply what is due at now (see the module docstring); return now."""
        now = self._clock.now_ns()
        if self._leases and self._leases[0][0] <= now:
            self._expire_leases(now)
        delayed = self._delayed
        while delayed and delayed[0][0] <= now:
            rec = self._jobs.get(heappop(delayed)[-1])
            if rec is not None and rec.state is SCHEDULED:
                self._push_ready(rec)
        if self._forget and self._forget[0][0] <= now:
            self._forget_finished(now)
        key_expiry = self._key_expiry
        while key_expiry and key_expiry[0][0] <= now:
            expiry, key = heappop(key_expiry)
            if self._keys.get(key, ("", -1))[1] == expiry:
                del self._keys[key]
        return now

    def _expire_leases(self, now: int) -> None:
        leases = self._leases
        while leases and leases[0][0] <= now:
            entry = heappop(leases)
            if self._lease_entry_live(entry):
                self._leased -= 1
                # A crash costs the attempt it was counted at claim; the backoff runs
                # from the expiry, however late this call notices it.
                self._fail(self._jobs[entry[-1]], LEASE_EXPIRED, entry[0], now)

    def _forget_finished(self, now: int) -> None:
        forget, jobs = self._forget, self._jobs
        while forget and forget[0][0] <= now:
            deadline, _, job_id = heappop(forget)
            rec = jobs.get(job_id)
            # Stale if the job was redriven since (it finished again later, or not yet).
            if rec is not None and rec.finished_at == deadline - self._retention_ns:
                del jobs[job_id]
                self._dead.pop(job_id, None)

    def _lease_entry_live(self, entry: tuple[int, int, int, str]) -> bool:
        rec = self._jobs.get(entry[-1])
        return (
            rec is not None
            and rec.state is LEASED
            and rec.token == entry[2]
            and rec.expires_at == entry[0]
        )

    def _push_lease(self, rec: _Job, expires: int) -> None:
        heappush(self._leases, (expires, rec.seq, rec.token, rec.id))
        if len(self._leases) > 2 * self._leased + _SLACK:  # acked leases' entries linger
            self._leases = [e for e in self._leases if self._lease_entry_live(e)]
            heapify(self._leases)

    def _schedule(self, rec: _Job, due: int, now: int) -> None:
        """Make a job wait for ``due``: READY at once if due, else SCHEDULED."""
        rec.due = due
        rec.expires_at = rec.worker_id = None
        if due <= now:
            self._push_ready(rec)
        else:
            rec.state = SCHEDULED
            heappush(self._delayed, (due, rec.seq, rec.id))

    def _push_ready(self, rec: _Job) -> None:
        rec.state = READY
        # The seq breaks ties: FIFO among equals, and the id (last) is never compared.
        heappush(self._ready, (-rec.priority, rec.due, rec.seq, rec.id))

    def _fail(self, rec: _Job, error: str, at: int, now: int) -> None:
        """A leased attempt failed at ``at``: retry after backoff, or die."""
        rec.last_error = error
        if rec.attempts >= self._max_attempts:
            self._finish(rec, DEAD, at)
            return
        self._waiting += 1
        self._schedule(rec, at + self._backoff(rec), now)

    def _backoff(self, rec: _Job) -> int:
        policy, rng = self._retry, self._rng
        base, cap = policy.base_ns, policy.cap_ns
        if policy.jitter == "decorrelated":
            prev = base if rec.prev_delay is None else rec.prev_delay
            rec.prev_delay = delay = min(cap, rng.randrange(base, 3 * prev + 1))
            return delay
        # base · 2^(n-1), capped; the shift is bounded so a huge n costs nothing.
        d = min(cap, base << min(rec.attempts - 1, cap.bit_length()))
        if policy.jitter == "none":
            return d
        if policy.jitter == "full":
            return rng.randrange(d + 1)
        return d // 2 + rng.randrange(d // 2 + 1)  # equal

    def _finish(self, rec: _Job, state: JobState, at: int) -> None:
        rec.state = state
        rec.finished_at = at
        rec.expires_at = rec.worker_id = None
        if state is DEAD:
            self._dead[rec.id] = None
        heappush(self._forget, (at + self._retention_ns, rec.seq, rec.id))

    def _check_room(self) -> None:
        if self._max_pending is not None and self._waiting + self._leased >= self._max_pending:
            raise QueueFull(f"the queue holds max_pending={self._max_pending} unfinished jobs")

    def _record(self, job_id: str) -> _Job:
        _check_str("job_id", job_id)
        rec = self._jobs.get(job_id)
        if rec is None:
            raise JobNotFound(f"no job {job_id!r} (never enqueued, or forgotten after retention)")
        return rec

    def _live(self, lease: Lease) -> _Job:
        """The record of the job ``lease`` is live on; StaleLease (or JobNotFound) if not."""
        if not isinstance(lease, Lease):
            raise TypeError(f"lease must be a Lease, got {lease!r}")
        rec = self._record(lease.job_id)
        if rec.state is not LEASED or rec.token != lease.token:
            raise StaleLease(
                f"lease token {lease.token} of job {rec.id!r} is not live: the job is "
                f"{rec.state.value} and its latest token is {rec.token}"
            )
        return rec

    def _snapshot(self, rec: _Job) -> Job:
        return Job(
            id=rec.id,
            payload=rec.payload,
            state=rec.state,
            priority=rec.priority,
            run_at_ns=rec.due,
            seq=rec.seq,
            attempts=rec.attempts,
            max_attempts=self._max_attempts,
            token=rec.token,
            last_error=rec.last_error,
            result=rec.result,
            enqueued_at_ns=rec.enqueued_at,
            lease_expires_at_ns=rec.expires_at,
            worker_id=rec.worker_id,
            finished_at_ns=rec.finished_at,
        )


class MemoryEffectStore:
    """Effects by job id, committed at most once per job, fenced by the queue's tokens."""

    def __init__(self, queue: JobQueue) -> None:
        if not isinstance(queue, JobQueue):
            raise TypeError(f"queue must be a JobQueue, got {queue!r}")
        self._queue = queue
        self._effects: dict[str, Any] = {}

    def commit(self, lease: Lease, effect: Any) -> bool:
        """Record ``effect`` iff the job has none and ``lease`` is live (else StaleLease)."""
        if not self._queue.is_current(lease):
            raise StaleLease(f"lease token {lease.token} of job {lease.job_id!r} is not live")
        if lease.job_id in self._effects:
            return False  # applied by an earlier attempt that died before its ack
        self._effects[lease.job_id] = effect
        return True

    def effects(self) -> dict[str, Any]:
        """Every committed effect, by job id (a copy)."""
        return dict(self._effects)
