"""A client that knows, from its own calls alone, what the stage-1 queue must do: it runs
a drawn workload, records every job as it saw it and every claim and answer as facts
that the properties judge."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st

from katas._harness.story import Story
from katas.job_scheduler._testing.queues import (
    LEASE,
    START,
    delay_none,
    held,
    new_queue,
    rel,
)
from katas.job_scheduler._testing.states import DEAD, LEASED, READY, SCHEDULED, SUCCEEDED
from katas.job_scheduler.api import (
    Job,
    JobNotFound,
    JobQueue,
    JobState,
    Lease,
    ManualClock,
    StaleLease,
)


@dataclass
class Seen:
    """One job as its client saw it. With jitter "none" every due time is computable."""

    id: str
    priority: int
    seq: int
    run_at: int
    leases: list[Lease] = field(default_factory=list)
    nacked_at: int | None = None  # when the latest lease was nacked (None: not nacked)
    acked: bool = False


@dataclass(frozen=True)
class ClaimFact:
    now: int
    lease: Lease | None
    expected: str | None  # the best READY job by the client's reckoning
    states: dict[str, JobState]  # every known job's state just before the claim
    dues: dict[str, int | None]  # and its due time, while it waits
    tokens: dict[str, int]  # every known job's latest token just before the claim


@dataclass(frozen=True)
class AnswerFact:
    now: int
    kind: str  # "ack" or "nack"
    lease: Lease
    live: bool  # by the client's reckoning
    raised: bool  # StaleLease
    before: Job | None
    after: Job | None


WORKERS = ("w1", "w2")
ADVANCES = (1, 50, 99, 100, 200, 999, 1000, 1500, 4000)
Op = tuple[Any, ...]


def workloads(max_size: int = 40) -> st.SearchStrategy[list[Op]]:
    """A few jobs, then random operations: enqueue (priority, run_at offset), claim,
    ack/nack (of a recent lease, stale ones included), advance."""
    enqueue = st.tuples(
        st.just("enqueue"), st.integers(-1, 2), st.one_of(st.none(), st.integers(-300, 2500))
    )
    claim = st.tuples(st.just("claim"), st.sampled_from(WORKERS))
    answer = st.tuples(st.sampled_from(["ack", "nack", "nack"]), st.integers(0, 4))
    advance = st.tuples(st.just("advance"), st.sampled_from(ADVANCES))
    first = st.lists(enqueue, min_size=1, max_size=4)
    rest = st.lists(
        st.one_of(claim, answer, advance, enqueue), min_size=max_size // 4, max_size=max_size
    )
    return st.builds(lambda a, b: a + b, first, rest)


class Client:
    """Runs a workload on a queue (jitter "none") and records facts for tests to judge.

    It follows what actually happened (the lease it got, whether an ack raised), so one
    broken rule is reported where it happens and does not derail the rest.
    """

    def __init__(self, queue: JobQueue, clock: ManualClock, max_attempts: int) -> None:
        self.queue, self.clock, self.max_attempts = queue, clock, max_attempts
        self.jobs: dict[str, Seen] = {}
        self.leases: list[Lease] = []
        self.claims: list[ClaimFact] = []
        self.answers: list[AnswerFact] = []
        self.duplicate_ids: list[str] = []
        self.story = Story(
            f"JobQueue(lease_ns={LEASE}, max_attempts={max_attempts}):", clock.now_ns, START
        )

    def granted(self) -> Iterator[tuple[ClaimFact, Lease]]:
        """The claims that returned a lease, each with it."""
        for fact in self.claims:
            if fact.lease is not None:
                yield fact, fact.lease

    def state(self, seen: Seen, now: int) -> tuple[JobState, int | None]:
        """The job's state now and, while it waits, its due time."""
        if seen.acked:
            return SUCCEEDED, None
        if not seen.leases:
            return (READY if seen.run_at <= now else SCHEDULED), seen.run_at
        last = seen.leases[-1]
        if seen.nacked_at is None and now < last.expires_at_ns:
            return LEASED, None
        failed_at = last.expires_at_ns if seen.nacked_at is None else seen.nacked_at
        if len(seen.leases) >= self.max_attempts:
            return DEAD, None
        due = failed_at + delay_none(len(seen.leases))
        return (READY if due <= now else SCHEDULED), due

    def live(self, lease: Lease, now: int) -> bool:
        seen = self.jobs.get(lease.job_id)
        return (
            seen is not None
            and seen.leases[-1] == lease
            and seen.nacked_at is None
            and not seen.acked
            and now < lease.expires_at_ns
        )

    def best(self, now: int) -> str | None:
        ready = []
        for seen in self.jobs.values():
            state, due = self.state(seen, now)
            if state is READY:
                ready.append((-seen.priority, due, seen.seq, seen.id))
        return min(ready)[3] if ready else None

    def expected_next_due(self, now: int) -> int | None:
        times: list[int] = []
        for seen in self.jobs.values():
            state, due = self.state(seen, now)
            if state is READY:
                return now
            if state is SCHEDULED and due is not None:
                times.append(due)
            elif state is LEASED:
                times.append(seen.leases[-1].expires_at_ns)
        return min(times) if times else None

    def run(self, ops: list[Op], each_step: Callable[[], None] | None = None) -> None:
        for op in ops:
            self.step(op)
            if each_step is not None:
                each_step()

    def step(self, op: Op) -> None:
        queue, now = self.queue, self.clock.now_ns()
        if op[0] == "enqueue":
            run_at = None if op[2] is None else now + op[2]
            job_id = queue.enqueue(
                f"payload {len(self.jobs) + 1}", priority=op[1], run_at_ns=run_at
            )
            if job_id in self.jobs:
                self.duplicate_ids.append(job_id)
            seen = Seen(job_id, op[1], len(self.jobs) + 1, now if run_at is None else run_at)
            self.jobs[job_id] = seen
            self.story.add(f"enqueue(priority={op[1]}, run_at_ns={rel(run_at)}) -> {job_id!r}")
        elif op[0] == "claim":
            expected = self.best(now)
            reckoned = {j: self.state(s, now) for j, s in self.jobs.items()}
            states = {j: state for j, (state, _) in reckoned.items()}
            dues = {j: due for j, (_, due) in reckoned.items()}
            tokens = {j: s.leases[-1].token if s.leases else 0 for j, s in self.jobs.items()}
            lease = queue.claim(op[1])
            self.claims.append(ClaimFact(now, lease, expected, states, dues, tokens))
            self.story.add(f"claim({op[1]!r}) -> {lease}")
            if lease is not None:
                self.leases.append(lease)
                claimed = self.jobs.get(lease.job_id)
                if claimed is not None:
                    claimed.leases.append(lease)
                    claimed.nacked_at = None
        elif op[0] in ("ack", "nack") and self.leases:
            lease = self.leases[-1 - op[1] % len(self.leases)]
            live = self.live(lease, now)
            before = held(queue, lease.job_id)
            try:
                if op[0] == "ack":
                    queue.ack(lease, "ok")
                else:
                    queue.nack(lease, "failed")
                raised = False
            except (StaleLease, JobNotFound):  # JobNotFound: forgotten after retention
                raised = True
            after = held(queue, lease.job_id)
            self.answers.append(AnswerFact(now, op[0], lease, live, raised, before, after))
            self.story.add(
                f"{op[0]}(token {lease.token} of {lease.job_id!r})"
                + (" -> StaleLease" if raised else "")
            )
            answered = self.jobs.get(lease.job_id)
            if not raised and answered is not None:
                if op[0] == "ack":
                    answered.acked = True
                else:
                    answered.nacked_at = now
        elif op[0] == "advance":
            self.clock.advance(op[1])
            self.story.add(f"advance({op[1]})")


def client_for(max_attempts: int = 3) -> Client:
    clock, queue = new_queue(max_attempts=max_attempts)
    return Client(queue, clock, max_attempts)


def ran(
    ops: list[Op], max_attempts: int = 3, judge: Callable[[Client, int], None] | None = None
) -> Client:
    """A client that has run ``ops`` on a fresh queue, its facts ready to judge; with
    ``judge``, ``judge(client, now)`` after every step too (where a broken rule shows
    first)."""
    client = client_for(max_attempts)
    client.run(ops, None if judge is None else lambda: judge(client, client.clock.now_ns()))
    return client
