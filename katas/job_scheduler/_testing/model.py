"""The job queue's exact model, written from the prompt's rules (never from an
implementation): stage 1's suite runs it beside the queue under test, and stage 3's
replays a Redis run through it in the order the server ran the calls."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from katas.job_scheduler._testing.states import (
    CANCELLED,
    DEAD,
    FINISHED,
    LEASED,
    READY,
    SCHEDULED,
    SUCCEEDED,
)
from katas.job_scheduler.api import (
    DEFAULT_DEDUP_TTL_NS,
    DEFAULT_RETENTION_NS,
    LEASE_EXPIRED,
    Job,
    JobState,
    QueueStatistics,
    RetryPolicy,
)


@dataclass
class MJob:
    seq: int
    payload: Any
    priority: int
    enqueued_at: int
    due: int
    state: JobState
    attempts: int = 0
    token: int = 0
    prev: int | None = None  # decorrelated jitter's previous delay
    last_error: str | None = None
    result: Any = None
    expires: int | None = None
    worker: str | None = None
    finished: int | None = None


class Model:
    """One queue's exact behaviour: plain lists, ``min`` and a twin rng; no heaps."""

    def __init__(
        self,
        *,
        lease_ns: int,
        retry: RetryPolicy,
        max_attempts: int,
        seed: int,
        dedup_ttl_ns: int = DEFAULT_DEDUP_TTL_NS,
        retention_ns: int = DEFAULT_RETENTION_NS,
        max_pending: int | None = None,
    ) -> None:
        self.lease_ns, self.retry, self.max_attempts = lease_ns, retry, max_attempts
        self.rng = random.Random(seed)
        self.dedup_ttl_ns, self.retention_ns, self.max_pending = (
            dedup_ttl_ns,
            retention_ns,
            max_pending,
        )
        self.jobs: dict[int, MJob] = {}  # by seq; forgotten jobs are removed
        self.enqueued = 0
        self.died: list[int] = []  # seqs of DEAD jobs, in the order they died
        self.keys: dict[str, tuple[int, int]] = {}  # key -> (seq, expiry)

    # --- the rules ----------------------------------------------------------------------
    def settle(self, now: int) -> None:
        while True:
            expired = [j for j in self.jobs.values() if j.state is LEASED and j.expires <= now]  # type: ignore[operator]
            if not expired:
                break
            job = min(expired, key=lambda j: (j.expires, j.seq))
            self.fail(job, LEASE_EXPIRED, job.expires, now)  # type: ignore[arg-type]
        for job in self.jobs.values():
            if job.state is SCHEDULED and job.due <= now:
                job.state = READY
        for seq in [
            s
            for s, j in self.jobs.items()
            if j.finished is not None and j.finished + self.retention_ns <= now
        ]:
            del self.jobs[seq]
            if seq in self.died:
                self.died.remove(seq)
        self.keys = {k: v for k, v in self.keys.items() if v[1] > now}

    def delay(self, job: MJob) -> int:
        p = self.retry
        if p.jitter == "decorrelated":
            prev = p.base_ns if job.prev is None else job.prev
            job.prev = min(p.cap_ns, self.rng.randrange(p.base_ns, 3 * prev + 1))
            return job.prev
        d = min(p.cap_ns, p.base_ns * int(2 ** (job.attempts - 1)))
        if p.jitter == "none":
            return d
        if p.jitter == "full":
            return self.rng.randrange(d + 1)
        return d // 2 + self.rng.randrange(d // 2 + 1)

    def wait(self, job: MJob, due: int, now: int) -> None:
        job.due, job.expires, job.worker = due, None, None
        job.state = READY if due <= now else SCHEDULED

    def fail(self, job: MJob, error: str, at: int, now: int) -> None:
        job.last_error = error
        if job.attempts >= self.max_attempts:
            self.finish(job, DEAD, at)
        else:
            self.wait(job, at + self.delay(job), now)

    def finish(self, job: MJob, state: JobState, at: int) -> None:
        job.state, job.finished, job.expires, job.worker = state, at, None, None
        if state is DEAD:
            self.died.append(job.seq)

    def pending(self) -> int:
        return sum(j.state in (SCHEDULED, READY, LEASED) for j in self.jobs.values())

    def full(self) -> bool:
        return self.max_pending is not None and self.pending() >= self.max_pending

    # --- operations: each settles first, like the queue -----------------------------------
    def enqueue(
        self, payload: Any, priority: int, run_at: int | None, key: str | None, now: int
    ) -> int | None:
        """The job's seq (the first job's for a live key); None for QueueFull."""
        self.settle(now)
        if key is not None and key in self.keys:
            return self.keys[key][0]
        if self.full():
            return None
        self.enqueued += 1
        due = now if run_at is None else run_at
        job = MJob(self.enqueued, payload, priority, now, due, READY if due <= now else SCHEDULED)
        self.jobs[job.seq] = job
        if key is not None:
            self.keys[key] = (job.seq, now + self.dedup_ttl_ns)
        return job.seq

    def claim(self, worker: str, now: int) -> MJob | None:
        self.settle(now)
        ready = [j for j in self.jobs.values() if j.state is READY]
        if not ready:
            return None
        job = min(ready, key=lambda j: (-j.priority, j.due, j.seq))
        job.attempts += 1
        job.token += 1
        job.state, job.expires, job.worker = LEASED, now + self.lease_ns, worker
        return job

    def live(self, seq: int, token: int, now: int) -> str:
        """Whether a lease (job seq, token) is "ok", "stale" or "not_found", after settling."""
        self.settle(now)
        job = self.jobs.get(seq)
        if job is None:
            return "not_found"
        return "ok" if job.state is LEASED and job.token == token else "stale"

    def ack(self, seq: int, result: Any, now: int) -> None:
        self.jobs[seq].result = result
        self.finish(self.jobs[seq], SUCCEEDED, now)

    def nack(self, seq: int, error: str, now: int) -> None:
        self.fail(self.jobs[seq], error, now, now)

    def heartbeat(self, seq: int, now: int) -> int:
        self.jobs[seq].expires = now + self.lease_ns
        return now + self.lease_ns

    def release(self, seq: int, now: int) -> None:
        job = self.jobs[seq]
        job.attempts -= 1
        self.wait(job, job.due, now)

    def cancel(self, seq: int, now: int) -> bool | None:
        self.settle(now)
        job = self.jobs.get(seq)
        if job is None:
            return None
        if job.state in FINISHED:
            return False
        self.finish(job, CANCELLED, now)
        return True

    def redrive(self, seq: int, now: int) -> bool | str | None:
        self.settle(now)
        job = self.jobs.get(seq)
        if job is None:
            return None
        if job.state is not DEAD:
            return False
        if self.full():
            return "full"
        self.died.remove(seq)
        job.attempts, job.prev, job.finished = 0, None, None
        self.wait(job, now, now)
        return True

    def next_due(self, now: int) -> int | None:
        self.settle(now)
        if any(j.state is READY for j in self.jobs.values()):
            return now
        times = [j.due for j in self.jobs.values() if j.state is SCHEDULED]
        times += [j.expires for j in self.jobs.values() if j.state is LEASED]  # type: ignore[misc]
        return min(times) if times else None

    def statistics(self, now: int) -> QueueStatistics:
        self.settle(now)
        count = {s: sum(j.state is s for j in self.jobs.values()) for s in JobState}
        return QueueStatistics(
            count[SCHEDULED], count[READY], count[LEASED], count[SUCCEEDED], count[DEAD],
            count[CANCELLED], len(self.keys),
        )  # fmt: skip

    def snapshot(self, job: MJob, job_id: str) -> Job:
        return Job(
            id=job_id, payload=job.payload, state=job.state, priority=job.priority,
            run_at_ns=job.due, seq=job.seq, attempts=job.attempts,
            max_attempts=self.max_attempts, token=job.token, last_error=job.last_error,
            result=job.result, enqueued_at_ns=job.enqueued_at, lease_expires_at_ns=job.expires,
            worker_id=job.worker, finished_at_ns=job.finished,
        )  # fmt: skip
