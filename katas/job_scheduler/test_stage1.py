"""Stage 1 suite: a single-threaded job queue (see katas/job_scheduler/README.md).

Core: ``JobQueue`` — enqueue, claim, ack, nack, get, next_due_ns. Extended: heartbeat,
release, cancel, dead letters and redrive, idempotency keys, retention, max_pending,
statistics, is_current and ``MemoryEffectStore``. Run
``pytest katas/job_scheduler -k "stage1 and core"`` for the core.

Three kinds of tests: examples that read like the prompt; property tests, each judging
one invariant from what a client can see of its own calls (``Client`` below); and
state machines comparing every observable result with an exact ``Model`` written here
from the rules, slowly and obviously (lists and ``min``, never heaps), which never looks
at an implementation. Time is a ``ManualClock``; randomness a seeded ``random.Random``
whose twin replays the draws the rules prescribe.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from types import ModuleType
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from katas._harness.under_test import stage
from katas._harness.walks import Drawn, Step, Walk, walked
from katas.job_scheduler._testing.model import Model
from katas.job_scheduler.api import (
    JITTERS,
    LEASE_EXPIRED,
    Jitter,
    Job,
    JobNotFound,
    JobState,
    Lease,
    ManualClock,
    QueueFull,
    QueueStatistics,
    RetryPolicy,
    StaleLease,
)

pytestmark = [pytest.mark.stage(1)]

core = pytest.mark.core
extended = pytest.mark.extended

SCHEDULED, READY, LEASED = JobState.SCHEDULED, JobState.READY, JobState.LEASED
SUCCEEDED, DEAD, CANCELLED = JobState.SUCCEEDED, JobState.DEAD, JobState.CANCELLED
FINISHED = (SUCCEEDED, DEAD, CANCELLED)

START = 1_000_000  # the clock's start; messages show times relative to it
LEASE = 1_000
BASE = 100
CAP = 1_600
SEED = 20240601


@pytest.fixture(autouse=True)
def _fail_fast_on_stubs(stage_module: ModuleType) -> None:
    """Build one queue before anything else: on a stub this fails at once with "not
    implemented yet: ..." instead of letting hypothesis shrink a Todo.
    (State machines, being unittest classes, also find the stage module here.)"""
    stage_module.JobQueue(
        clock=ManualClock(START), lease_ns=LEASE, retry=RetryPolicy(BASE, CAP), max_attempts=1
    )


def new_queue(
    *,
    jitter: Jitter = "none",
    base: int = BASE,
    cap: int = CAP,
    seed: int = SEED,
    **overrides: Any,
) -> tuple[ManualClock, Any]:
    """A queue on a frozen ManualClock: lease 1000, backoff 100·2^(n-1) capped at 1600."""
    clock = ManualClock(START)
    kwargs: dict[str, Any] = {
        "clock": clock,
        "lease_ns": LEASE,
        "retry": RetryPolicy(base, cap, jitter),
        "max_attempts": 3,
        "rng": random.Random(seed),
    }
    kwargs.update(overrides)
    return clock, stage().JobQueue(**kwargs)


def delay_none(n: int, base: int = BASE, cap: int = CAP) -> int:
    """The un-jittered backoff after failed attempt n, straight from the formula."""
    return min(cap, base * int(2 ** (n - 1)))


def drawn_delays(
    policy: RetryPolicy, seed: int | random.Random, failed_attempts: list[int]
) -> list[int]:
    """The delays the rules prescribe for one job failing attempts n1, n2, … in turn,
    drawn from ``Random(seed)`` (or from the Random given)."""
    rng = seed if isinstance(seed, random.Random) else random.Random(seed)
    out, prev = [], policy.base_ns
    for n in failed_attempts:
        d = min(policy.cap_ns, policy.base_ns * int(2 ** (n - 1)))
        if policy.jitter == "none":
            out.append(d)
        elif policy.jitter == "full":
            out.append(rng.randrange(d + 1))
        elif policy.jitter == "equal":
            out.append(d // 2 + rng.randrange(d // 2 + 1))
        else:
            prev = min(policy.cap_ns, rng.randrange(policy.base_ns, 3 * prev + 1))
            out.append(prev)
    return out


def claim(queue: Any, worker: str = "w") -> Lease:
    """``queue.claim(worker)``, which must return a lease here."""
    lease = queue.claim(worker)
    assert isinstance(lease, Lease), (
        f"claim({worker!r}) returned {lease!r}, but a job is READY here"
    )
    return lease


def rejects(error: type[Exception], call: Callable[[], Any], message: str) -> None:
    """``call()`` must raise ``error``; if it returns, fail with ``message``."""
    try:
        call()
    except error:
        return
    except (StaleLease, JobNotFound, QueueFull) as other:
        raise AssertionError(
            f"{message.replace(' was accepted', '')}: expected {error.__name__}, got "
            f"{type(other).__name__}: {other}"
        ) from None
    raise AssertionError(f"{message} (expected {error.__name__})")


def held(queue: Any, job_id: str) -> Job | None:
    """``queue.get(job_id)``, or None if the queue says JobNotFound."""
    try:
        job: Job = queue.get(job_id)
    except JobNotFound:
        return None
    return job


def diff(expected: Any, got: Any) -> str:
    """The fields in which two dataclass snapshots differ."""
    if expected is None or got is None or type(expected) is not type(got):
        return f"expected {expected}, got {got}"
    parts = [
        f"{f.name}: expected {getattr(expected, f.name)!r}, got {getattr(got, f.name)!r}"
        for f in fields(expected)
        if getattr(expected, f.name) != getattr(got, f.name)
    ]
    return "; ".join(parts) or "equal"


class Story:
    """The operations a test ran, with their times, for failure messages."""

    def __init__(self, clock: ManualClock, header: str = "") -> None:
        self.clock = clock
        self.lines = [header] if header else []

    def add(self, text: str) -> None:
        self.lines.append(f"    t={self.clock.now_ns() - START:<6} {text}")

    def fail(self, invariant: str, detail: str) -> str:
        shown = self.lines if len(self.lines) <= 40 else ["    …", *self.lines[-40:]]
        return f"{invariant}\n  operations:\n" + "\n".join(shown) + f"\n  => {detail}"


# --------------------------------------------------------------------------------------
# Examples: the prompt, core
# --------------------------------------------------------------------------------------


@pytest.mark.rule("unique-ids", "claim-counts", "snapshot")
@core
def test_stage1_enqueue_claim_ack_runs_a_job_once() -> None:
    clock, queue = new_queue()
    job_id = queue.enqueue({"to": "ada"})
    assert isinstance(job_id, str), f"enqueue must return the job id (a str), got {job_id!r}"
    job = queue.get(job_id)
    assert (job.state, job.payload, job.attempts, job.seq, job.token) == (
        READY,
        {"to": "ada"},
        0,
        1,
        0,
    ), f"a job enqueued with no run_at is READY at once, untouched: got {job}"
    lease = queue.claim("worker-1")
    assert lease == Lease(job_id, 1, 1, START + LEASE, "worker-1"), (
        f"the first claim leases the job until now + lease_ns with token 1, attempt 1; got {lease}"
    )
    leased = queue.get(job_id)
    assert (leased.state, leased.attempts, leased.lease_expires_at_ns, leased.worker_id) == (
        LEASED,
        1,
        START + LEASE,
        "worker-1",
    ), f"after claim the job is LEASED to worker-1 with 1 attempt, got {leased}"
    assert queue.claim("worker-2") is None, "a leased job must not be claimed again"
    clock.advance(10)
    queue.ack(lease, result=42)
    done = queue.get(job_id)
    assert (done.state, done.result, done.finished_at_ns, done.lease_expires_at_ns) == (
        SUCCEEDED,
        42,
        START + 10,
        None,
    ), f"ack finishes the job as SUCCEEDED with its result, got {done}"
    clock.advance(10 * LEASE)
    assert queue.claim("worker-2") is None, "a finished job is never claimed again"


@pytest.mark.rule("claim-order", "next-due")
@core
def test_stage1_claim_on_an_empty_queue_returns_none() -> None:
    _, queue = new_queue()
    assert queue.claim("w") is None, "claim() on an empty queue must return None"
    assert queue.next_due_ns() is None, "next_due_ns() on an empty queue is None"


@pytest.mark.rule("claim-order", "never-compared")
@core
def test_stage1_equal_priority_jobs_come_out_in_enqueue_order() -> None:
    _, queue = new_queue()
    ids = [queue.enqueue(f"job {i}") for i in range(25)]
    got = [claim(queue, "w").job_id for _ in ids]
    assert got == ids, (
        "25 jobs enqueued at one instant with one priority must be claimed in "
        f"enqueue order (ties broken by the sequence number, never by id or payload):\n"
        f"  enqueued {ids}\n  claimed  {got}"
    )


@pytest.mark.rule("claim-order", "future-does-not-block")
@core
def test_stage1_higher_priority_first_then_due_time_then_enqueue_order() -> None:
    clock, queue = new_queue()
    low = queue.enqueue("low", priority=0)
    late_high = queue.enqueue("late high", priority=5, run_at_ns=START + 50)
    high = queue.enqueue("high", priority=5)
    early_high = queue.enqueue("early high", priority=5, run_at_ns=START - 50)
    future_top = queue.enqueue("future top", priority=9, run_at_ns=START + 10_000)
    clock.advance(100)
    got: list[str] = []
    while len(got) < 10 and (lease := queue.claim("w")) is not None:
        got.append(lease.job_id)
    names = {low: "low", late_high: "late high", high: "high", early_high: "early high"}
    names[future_top] = "future top"
    assert got == [early_high, high, late_high, low], (
        "among due jobs, larger priority first, then earlier due time, then enqueue "
        "order; a job not yet due (priority 9, due in 10 000) waits without blocking the "
        f"others. Expected early high, high, late high, low; got {[names.get(i, i) for i in got]}"
    )


@pytest.mark.rule("never-early")
@core
def test_stage1_job_is_not_claimed_before_its_run_at() -> None:
    clock, queue = new_queue()
    job_id = queue.enqueue("later", run_at_ns=START + 500)
    assert queue.get(job_id).state is SCHEDULED, "a job due in the future is SCHEDULED"
    clock.advance(499)
    assert queue.claim("w") is None, "claimed 1 ns before its run_at_ns"
    clock.advance(1)
    assert queue.get(job_id).state is READY, "at its run_at_ns a job is READY"
    lease = queue.claim("w")
    assert lease is not None and lease.job_id == job_id, (
        f"at run_at_ns exactly the job must be claimable, got {lease}"
    )


@pytest.mark.rule("failed-attempt", "backoff-formula", "backoff-from-failure")
@core
def test_stage1_nack_retries_after_exponential_backoff() -> None:
    clock, queue = new_queue(max_attempts=7)
    job_id = queue.enqueue("flaky")
    story = Story(clock, "enqueue('flaky') with backoff 100·2^(n-1) capped at 1600:")
    for n in range(1, 7):  # 100, 200, 400, 800, 1600 (= the cap), then 1600 (capped)
        lease = queue.claim("w")
        if not (lease is not None and lease.attempt == n):
            raise AssertionError(
                story.fail(
                    "a retried job is claimable once its backoff is over",
                    f"attempt {n}: claim() -> {lease}",
                )
            )
        queue.nack(lease, f"boom {n}")
        story.add(f"claim, nack(attempt {n})")
        job = queue.get(job_id)
        want = delay_none(n)
        if not (
            (job.state, job.run_at_ns, job.last_error)
            == (
                SCHEDULED,
                clock.now_ns() + want,
                f"boom {n}",
            )
        ):
            raise AssertionError(
                story.fail(
                    "after nack of attempt n the job waits min(cap, base·2^(n-1)) and keeps the "
                    "error",
                    f"expected SCHEDULED at now + {want}, got {job.state} at now + "
                    f"{job.run_at_ns - clock.now_ns()} (last_error {job.last_error!r})",
                )
            )
        clock.advance(want - 1)
        if queue.claim("w") is not None:
            raise AssertionError(
                story.fail(
                    "a retry is never claimed before its backoff is over",
                    f"claimed at now + {want - 1}",
                )
            )
        clock.advance(1)


@pytest.mark.rule("lease-live", "failed-attempt", "claim-counts")
@core
def test_stage1_expired_lease_costs_an_attempt_and_is_retried() -> None:
    clock, queue = new_queue()
    job_id = queue.enqueue("crashy")
    first = claim(queue, "w1")
    clock.advance(LEASE - 1)
    assert queue.get(job_id).state is LEASED, "a lease is live until expires_at_ns"
    clock.advance(1)
    job = queue.get(job_id)
    assert (job.state, job.attempts, job.last_error, job.run_at_ns) == (
        SCHEDULED,
        1,
        LEASE_EXPIRED,
        first.expires_at_ns + BASE,
    ), (
        "at expires_at_ns the lease expires: the attempt stays counted, last_error is "
        f"LEASE_EXPIRED and the retry is due at expires_at + backoff ({BASE}); got {job}"
    )
    rejects(StaleLease, lambda: queue.ack(first), "ack of an expired lease was accepted")
    clock.advance(BASE)
    second = queue.claim("w2")
    assert second is not None and (second.token, second.attempt) == (2, 2), (
        f"the retry is claimed with the next token and attempt 2, got {second}"
    )


@pytest.mark.rule("stale-changes-nothing")
@core
def test_stage1_ack_with_a_superseded_token_is_rejected_and_changes_nothing() -> None:
    clock, queue = new_queue(max_attempts=5)
    job_id = queue.enqueue("transfer")
    zombie = claim(queue, "w1")
    clock.advance(LEASE + BASE)  # w1 stalls past its lease; the retry is due
    fresh = claim(queue, "w2")
    assert fresh is not None and fresh.token > zombie.token, (
        f"a reclaim must issue a larger fencing token: {zombie} then {fresh}"
    )
    before = queue.get(job_id)
    for name, call in (
        ("ack", lambda: queue.ack(zombie, "late")),
        ("nack", lambda: queue.nack(zombie, "x")),
    ):
        rejects(StaleLease, call, f"{name} with the superseded token {zombie.token} was accepted")
        after = queue.get(job_id)
        assert after == before, (
            f"{name} with the superseded token {zombie.token} (live token "
            f"{fresh.token}) must raise StaleLease and change nothing: {diff(before, after)}"
        )
    queue.ack(fresh, "done")
    assert queue.get(job_id).result == "done"
    rejects(StaleLease, lambda: queue.ack(fresh, "twice"), "a second ack was accepted")
    assert queue.get(job_id).result == "done", "a second ack must change nothing"


@pytest.mark.rule("dead-at-max")
@core
def test_stage1_job_is_dead_after_exactly_max_attempts() -> None:
    clock, queue = new_queue(max_attempts=3)
    job_id = queue.enqueue("poison")
    for n in (1, 2):
        lease = queue.claim("w")
        assert lease is not None and lease.attempt == n
        if n == 1:
            queue.nack(lease, "fail 1")
        else:
            clock.advance(LEASE)  # the worker crashed: the lease expires
        assert queue.get(job_id).state is SCHEDULED, (
            f"after failed attempt {n} of max_attempts=3 the job is retried, "
            f"got {queue.get(job_id).state}"
        )
        clock.advance(delay_none(n))
    last = queue.claim("w")
    assert last is not None and last.attempt == 3
    queue.nack(last, "fail 3")
    job = queue.get(job_id)
    assert (job.state, job.attempts, job.last_error, job.finished_at_ns) == (
        DEAD,
        3,
        "fail 3",
        clock.now_ns(),
    ), f"the failure of attempt max_attempts=3 makes the job DEAD at once, got {job}"
    clock.advance(100 * CAP)
    assert queue.claim("w") is None, "a DEAD job is never claimed"


@pytest.mark.rule("dead-at-max", "failed-attempt")
@core
def test_stage1_poison_job_that_always_crashes_dies() -> None:
    clock, queue = new_queue(max_attempts=2)
    job_id = queue.enqueue("segfaults the worker")
    first = claim(queue, "w")
    clock.advance(LEASE + BASE)
    second = queue.claim("w")
    assert second is not None and second.attempt == 2, f"got {second}"
    clock.advance(LEASE)
    job = queue.get(job_id)
    assert (job.state, job.attempts, job.finished_at_ns) == (
        DEAD,
        2,
        second.expires_at_ns,
    ), (
        "a job whose worker crashes every time (two lease expiries, max_attempts=2) "
        f"must be DEAD at its last lease's expiry, not loop forever; got {job} "
        f"(first lease {first})"
    )


@pytest.mark.rule("retry-keeps-seq")
@core
def test_stage1_retry_keeps_its_sequence_number() -> None:
    clock, queue = new_queue()
    first = queue.enqueue("first")
    lease = claim(queue, "w")
    second = queue.enqueue("second", run_at_ns=START + BASE)
    queue.nack(lease, "again")  # the retry is due at now + 100 too
    clock.advance(BASE)
    got = [claim(queue, "w").job_id, claim(queue, "w").job_id]
    assert got == [first, second], (
        "a retried job due at t ties with a job first due at t: the earlier "
        f"enqueue (smaller seq) comes first — a retry keeps its number. Got {got}, "
        f"expected {[first, second]}"
    )
    seqs = (queue.get(first).seq, queue.get(second).seq)
    assert seqs == (1, 2), f"seq is the enqueue order and a retry keeps it, got {seqs}"


@pytest.mark.rule("backoff-from-failure")
@core
def test_stage1_backoff_of_an_expired_lease_runs_from_the_expiry() -> None:
    clock, queue = new_queue(jitter="full")
    twin = drawn_delays(RetryPolicy(BASE, CAP, "full"), SEED, [1])
    job_id = queue.enqueue("x")
    lease = claim(queue, "w")
    clock.advance(5 * LEASE)  # nobody calls the queue until well after the expiry
    job = queue.get(job_id)
    assert job.run_at_ns == lease.expires_at_ns + twin[0], (
        "the retry after a lease expiry is due at expires_at + backoff, however late "
        f"the queue notices: expected {lease.expires_at_ns + twin[0] - START}, got "
        f"{job.run_at_ns - START} (relative to start)"
    )


@pytest.mark.rule("expiry-order")
@core
def test_stage1_expiries_are_applied_in_expiry_then_sequence_order() -> None:
    policy = RetryPolicy(BASE, CAP, "full")
    clock, queue = new_queue(jitter="full", max_attempts=5)
    a = queue.enqueue("a")
    b = queue.enqueue("b", priority=1)  # claimed first, but seq 2
    c = queue.enqueue("c")
    claim(queue, "w")  # b
    claim(queue, "w")  # a
    clock.advance(10)
    claim(queue, "w")  # c, expires 10 later
    clock.advance(3 * LEASE)  # one call notices all three expiries
    rng = random.Random(SEED)
    want = {
        a: START + LEASE + rng.randrange(BASE + 1),  # (expires, seq) = (L, 1)
        b: START + LEASE + rng.randrange(BASE + 1),  # (L, 2)
        c: START + 10 + LEASE + rng.randrange(BASE + 1),  # (L + 10, 3)
    }
    got = {j: queue.get(j).run_at_ns for j in (a, b, c)}
    assert got == want, (
        f"expiries are applied in (expires_at, seq) order, one {policy.jitter}-jitter "
        "draw each: a (seq 1) and b (seq 2) expire together before c; b was claimed first but "
        f"a draws first. Expected retry times {want}, got {got}"
    )


@pytest.mark.rule("settle-first")
@core
def test_stage1_every_call_applies_due_expiries_before_its_own_work() -> None:
    clock, queue = new_queue(jitter="full", max_attempts=5)
    a = queue.enqueue("a")
    b = queue.enqueue("b")
    lease_a = claim(queue, "w")
    clock.advance(LEASE // 2)
    lease_b = claim(queue, "w")
    clock.advance(LEASE // 2)  # a's lease expires now; nobody has looked yet
    queue.nack(lease_b, "b failed")
    rng = random.Random(SEED)
    want_a = lease_a.expires_at_ns + rng.randrange(BASE + 1)  # the expiry draws first
    want_b = clock.now_ns() + rng.randrange(BASE + 1)
    got = (queue.get(a).run_at_ns, queue.get(b).run_at_ns)
    assert got == (want_a, want_b), (
        "nack(b) at the instant a's lease expires must first apply a's expiry (its "
        "backoff draw), then b's nack: every public call settles due expiries first. "
        f"Expected retry times (a, b) = {(want_a - START, want_b - START)}, got "
        f"{(got[0] - START, got[1] - START)} (relative to start)"
    )


@pytest.mark.rule("next-due")
@core
def test_stage1_next_due_ns_tells_when_to_claim_next() -> None:
    clock, queue = new_queue()
    later = queue.enqueue("later", run_at_ns=START + 700)
    queue.enqueue("sooner", run_at_ns=START + 300)
    assert queue.next_due_ns() == START + 300, "the earliest run_at of scheduled jobs"
    clock.advance(300)
    assert queue.next_due_ns() == clock.now_ns(), "now, when a job is READY"
    lease = claim(queue, "w")
    assert queue.next_due_ns() == START + 700, (
        f"with one job leased until {lease.expires_at_ns - START} and one due at 700, "
        f"next_due_ns is 700, got {_rel(queue.next_due_ns())}"
    )
    clock.advance(400)
    assert claim(queue, "w").job_id == later
    assert queue.next_due_ns() == lease.expires_at_ns, (
        "with only leases out, next_due_ns is the earliest lease expiry (the job may "
        f"come back then): expected {lease.expires_at_ns - START}, got {_rel(queue.next_due_ns())}"
    )


def _rel(t: int | None) -> int | None:
    return None if t is None else t - START


_LEASE, _JOB = object(), object()  # placeholders for the live lease and a job id


def _bad_calls() -> list[Any]:
    """(what, call(queue, lease, job_id), exception, word the message must name, part)."""

    def ctor(**kw: Any) -> Callable[[Any, Any, str], Any]:
        def call(queue: Any, lease: Any, job_id: str) -> Any:
            args: dict[str, Any] = {
                "clock": ManualClock(START),
                "lease_ns": LEASE,
                "retry": RetryPolicy(BASE, CAP),
                "max_attempts": 3,
            }
            return stage().JobQueue(**{**args, **kw})

        return call

    def op(method: str, *args: Any, **kw: Any) -> Callable[[Any, Any, str], Any]:
        def call(queue: Any, lease: Any, job_id: str) -> Any:
            real = [lease if a is _LEASE else job_id if a is _JOB else a for a in args]
            return getattr(queue, method)(*real, **kw)

        return call

    both = (TypeError, ValueError)
    cases: list[tuple[str, Callable[[Any, Any, str], Any], Any, str, Any]] = [
        ("lease_ns=0", ctor(lease_ns=0), ValueError, "lease_ns", core),
        ("lease_ns=-5", ctor(lease_ns=-5), ValueError, "lease_ns", core),
        ("lease_ns=1.5", ctor(lease_ns=1.5), TypeError, "lease_ns", core),
        ("max_attempts=0", ctor(max_attempts=0), ValueError, "max_attempts", core),
        ("max_attempts=True", ctor(max_attempts=True), TypeError, "max_attempts", core),
        ("retry=(1, 2)", ctor(retry=(1, 2)), TypeError, "retry", core),
        ("rng=7", ctor(rng=7), TypeError, "rng", core),
        ("dedup_ttl_ns=-1", ctor(dedup_ttl_ns=-1), ValueError, "dedup_ttl_ns", extended),
        ("retention_ns=-1", ctor(retention_ns=-1), ValueError, "retention_ns", extended),
        ("max_pending=0", ctor(max_pending=0), ValueError, "max_pending", extended),
        ("priority='high'", op("enqueue", "x", priority="high"), TypeError, "priority", core),
        ("priority=True", op("enqueue", "x", priority=True), TypeError, "priority", core),
        ("run_at_ns=1.0", op("enqueue", "x", run_at_ns=1.0), TypeError, "run_at_ns", core),
        ("claim(7)", op("claim", 7), TypeError, "worker_id", core),
        ("claim('')", op("claim", ""), both, "worker_id", core),
        ("ack(job_id)", op("ack", _JOB), TypeError, "lease", core),
        ("nack(lease, 3)", op("nack", _LEASE, 3), TypeError, "error", core),
        ("get(1)", op("get", 1), TypeError, "job_id", core),
        (
            "idempotency_key=5",
            op("enqueue", "x", idempotency_key=5),
            both,
            "idempotency_key",
            extended,
        ),
        (
            "idempotency_key=''",
            op("enqueue", "x", idempotency_key=""),
            both,
            "idempotency_key",
            extended,
        ),
        ("heartbeat(None)", op("heartbeat", None), TypeError, "lease", extended),
        ("release('x')", op("release", "x"), TypeError, "lease", extended),
        ("cancel(None)", op("cancel", None), TypeError, "job_id", extended),
        ("redrive(2)", op("redrive", 2), TypeError, "job_id", extended),
        ("is_current(job_id)", op("is_current", _JOB), TypeError, "lease", extended),
    ]
    return [pytest.param(*case[:4], marks=case[4], id=case[0]) for case in cases]


@pytest.mark.rule("bad-input")
@pytest.mark.parametrize(("what", "call", "exc", "word"), _bad_calls())
def test_stage1_bad_input_raises_naming_the_parameter_and_changes_nothing(
    what: str, call: Callable[[Any, Any, str], Any], exc: Any, word: str
) -> None:
    _, queue = new_queue()
    job_id = queue.enqueue("a")
    lease = claim(queue)
    before = queue.get(job_id)
    with pytest.raises(exc, match=word):
        call(queue, lease, job_id)
    after = queue.get(job_id)
    assert after == before, f"{what} raised but changed the job: {diff(before, after)}"
    assert queue.claim("w") is None, f"{what} must change nothing (no job created)"
    queue.ack(lease)  # the lease is still live


@pytest.mark.rule("get-unknown", "lease-unknown-job")
@core
def test_stage1_unknown_job_raises_job_not_found() -> None:
    _, queue = new_queue()
    rejects(JobNotFound, lambda: queue.get("no-such-job"), "get of an unknown id")
    queue.enqueue("a")
    forged = Lease("no-such-job", 1, 1, START + LEASE, "w")
    rejects(JobNotFound, lambda: queue.ack(forged), "ack of a lease on an unknown job")
    assert issubclass(JobNotFound, LookupError)


@pytest.mark.rule("decorrelated")
@core
def test_stage1_decorrelated_jitter_grows_from_the_capped_previous_delay() -> None:
    base, cap, seed = 100, 150, 5
    policy = RetryPolicy(base, cap, "decorrelated")
    clock, queue = new_queue(jitter="decorrelated", base=base, cap=cap, seed=seed, max_attempts=8)
    job_id = queue.enqueue("flaky")
    want = drawn_delays(policy, seed, list(range(1, 8)))
    raw, prev, rng = [], base, random.Random(seed)  # what an uncapped prev would give
    for _ in range(7):
        prev = rng.randrange(base, 3 * prev + 1)
        raw.append(min(cap, prev))
    assert raw != want, "the seed must tell a capped prev from a raw one"
    got = []
    for _ in range(7):
        lease = claim(queue)
        queue.nack(lease, "503")
        got.append(queue.get(job_id).run_at_ns - clock.now_ns())
        clock.advance(got[-1])
    if got != want:
        raise AssertionError(
            f"decorrelated jitter draws rng.randrange(base, 3·prev + 1) with prev the "
            f"previous delay as applied, after the cap (base {base}, cap {cap}, "
            f"Random({seed})): expected delays {want}, got {got}"
            + (" — that is what an uncapped prev gives" if got == raw else "")
        )


@pytest.mark.rule("dead-at-max", "one-draw")
@core
@pytest.mark.parametrize("how", ["nack", "expiry"])
def test_stage1_a_job_that_dies_draws_no_backoff(how: str) -> None:
    rng = random.Random(SEED)
    clock, queue = new_queue(jitter="full", rng=rng, max_attempts=2)
    job_id = queue.enqueue("doomed")
    queue.nack(claim(queue), "first")
    clock.advance(queue.get(job_id).run_at_ns - clock.now_ns())
    before = rng.getstate()
    last = claim(queue)
    if how == "nack":
        clock.advance(10)
        queue.nack(last, "second")
    else:
        clock.advance(LEASE)
    job = queue.get(job_id)
    died_at = clock.now_ns() if how == "nack" else last.expires_at_ns
    if (job.state, job.finished_at_ns) != (DEAD, died_at) or rng.getstate() != before:
        raise AssertionError(
            f"the failure ({how}) of attempt max_attempts=2 makes the job DEAD at "
            f"once ({_rel(died_at)}) with no backoff drawn; got {job.state.value} at "
            f"{_rel(job.finished_at_ns)}, rng "
            + ("untouched" if rng.getstate() == before else "drawn from")
        )


def _call_at(method: str, queue: Any, store: Any, lease: Lease) -> Any:
    if method == "commit":
        return store.commit(lease, "effect")
    if method == "nack":
        return queue.nack(lease, "late")
    return getattr(queue, method)(lease)


def live_until_its_expiry(method: str) -> None:
    """``method`` on a lease 1 ns before its expiry is accepted; at the expiry and 1 ns
    after it, called before anything else has settled the expiry, it is refused and the
    expiry stands."""
    for offset in (-1, 0, 1):
        clock, queue = new_queue()
        store = stage().MemoryEffectStore(queue) if method == "commit" else None
        job_id = queue.enqueue("x")
        lease = claim(queue)
        clock.set(lease.expires_at_ns + offset)  # straight to the call: nothing settled yet
        at = f"{method} at expires_at_ns {offset:+d}"
        if offset < 0:
            got = _call_at(method, queue, store, lease)
            if method == "is_current" and got is not True:
                raise AssertionError(f"{at}: the lease is live, is_current -> {got}")
            continue
        if method == "is_current":
            got = _call_at(method, queue, store, lease)
            if got is not False:
                raise AssertionError(f"{at}: the lease has expired, is_current -> {got}")
        else:
            rejects(
                StaleLease,
                lambda: _call_at(method, queue, store, lease),  # noqa: B023 - called at once
                f"{at} was accepted",
            )
        job = queue.get(job_id)
        if (job.state, job.attempts, job.last_error) != (SCHEDULED, 1, LEASE_EXPIRED):
            raise AssertionError(
                f"{at}: the lease expired at expires_at_ns, so the call settles the "
                f"expiry first (attempt counted, LEASE_EXPIRED, retry scheduled) and is refused; "
                f"the job is {job.state.value}, attempts {job.attempts}, last_error "
                f"{job.last_error!r}"
            )


@pytest.mark.rule("lease-live", "stale-changes-nothing", "settle-first")
@core
def test_stage1_ack_and_nack_need_a_lease_live_until_1_ns_before_its_expiry() -> None:
    for method in ("ack", "nack"):
        live_until_its_expiry(method)


@pytest.mark.rule("lease-live", "heartbeat-never-revives", "release", "is-current", "effect-fenced")
@extended
def test_stage1_heartbeat_release_is_current_and_commit_see_the_expiry_at_its_instant() -> None:
    for method in ("heartbeat", "release", "is_current", "commit"):
        live_until_its_expiry(method)


@pytest.mark.rule("lease-unknown-job", "is-current", "effect-fenced", "retention")
@extended
def test_stage1_calls_on_a_job_forgotten_after_its_retention() -> None:
    clock, queue = new_queue(retention_ns=100)
    store = stage().MemoryEffectStore(queue)
    job_id = queue.enqueue("x")
    lease = claim(queue)
    clock.advance(5)
    stale = Lease(lease.job_id, lease.token, lease.attempt, lease.expires_at_ns, "w")
    queue.ack(lease)
    clock.advance(99)  # finished 99 ago: still held, so a finished job's lease is stale
    rejects(
        StaleLease, lambda: queue.ack(stale), "ack of a finished job, 1 ns before it is forgotten"
    )
    clock.advance(1)  # finished_at + retention_ns: forgotten
    for name, act in (
        ("ack", lambda: queue.ack(stale)),
        ("nack", lambda: queue.nack(stale, "x")),
        ("heartbeat", lambda: queue.heartbeat(stale)),
        ("release", lambda: queue.release(stale)),
        ("get", lambda: queue.get(job_id)),
        ("cancel", lambda: queue.cancel(job_id)),
        ("redrive", lambda: queue.redrive(job_id)),
    ):
        rejects(JobNotFound, act, f"{name} on a job forgotten after its retention (not StaleLease)")
    if queue.is_current(stale) is not False:
        raise AssertionError("is_current of a forgotten job's lease must be False")
    rejects(
        StaleLease,
        lambda: store.commit(stale, "late effect"),
        "commit with a forgotten job's lease: a zombie must stop (StaleLease, not JobNotFound)",
    )


# --------------------------------------------------------------------------------------
# Properties, core: a client that knows from its own calls what the queue must do
# --------------------------------------------------------------------------------------


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

    def __init__(self, queue: Any, clock: ManualClock, max_attempts: int) -> None:
        self.queue, self.clock, self.max_attempts = queue, clock, max_attempts
        self.jobs: dict[str, Seen] = {}
        self.leases: list[Lease] = []
        self.claims: list[ClaimFact] = []
        self.answers: list[AnswerFact] = []
        self.duplicate_ids: list[str] = []
        self.story = Story(clock, f"JobQueue(lease_ns={LEASE}, max_attempts={max_attempts}):")

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
            self.story.add(f"enqueue(priority={op[1]}, run_at_ns={_rel(run_at)}) -> {job_id!r}")
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


@pytest.mark.rule("never-early")
@core
@given(ops=workloads(), max_attempts=st.integers(1, 3))
def test_stage1_never_claims_a_job_before_it_is_due(ops: list[Op], max_attempts: int) -> None:
    client = client_for(max_attempts)
    client.run(ops)
    for fact in client.claims:
        if fact.lease is None:
            continue
        job_id = fact.lease.job_id
        if fact.states.get(job_id) is not SCHEDULED:
            continue  # other properties judge unknown, leased or finished jobs
        raise AssertionError(
            client.story.fail(
                "a job is never claimed before it is due (run_at_ns, then each retry's backoff)",
                f"claim at t={fact.now - START} returned {job_id!r}, due at "
                f"t={_rel(fact.dues[job_id])}",
            )
        )


@pytest.mark.rule("claim-order", "future-does-not-block")
@core
@given(ops=workloads(), max_attempts=st.integers(1, 3))
def test_stage1_claim_takes_the_highest_priority_then_earliest_due_then_oldest(
    ops: list[Op], max_attempts: int
) -> None:
    client = client_for(max_attempts)
    client.run(ops)
    for fact in client.claims:
        got = None if fact.lease is None else fact.lease.job_id
        if got is not None and fact.states.get(got) is not READY:
            continue  # claimed something not READY: judged by the other properties
        if not (got == fact.expected):
            raise AssertionError(
                client.story.fail(
                    "claim leases the READY job with the largest priority, then the earliest due "
                    "time, then the smallest sequence number — and returns None only when none is "
                    "READY",
                    f"claim at t={fact.now - START} returned {got!r}, expected {fact.expected!r}",
                )
            )


@pytest.mark.rule("lease-live")
@core
@given(ops=workloads(), max_attempts=st.integers(1, 3))
def test_stage1_at_most_one_live_lease_per_job(ops: list[Op], max_attempts: int) -> None:
    client = client_for(max_attempts)
    client.run(ops)
    for fact in client.claims:
        if fact.lease is not None and fact.states.get(fact.lease.job_id) is LEASED:
            raise AssertionError(
                client.story.fail(
                    "a job has at most one live lease: it is not claimed again until its "
                    "lease is acked, nacked or expired",
                    f"claim at t={fact.now - START} leased {fact.lease.job_id!r} again while "
                    f"token {fact.tokens[fact.lease.job_id]} was still live",
                )
            )


#: Every kind of stale lease, each at its boundary: expired at the very instant of its
#: expiry, superseded by a newer claim of the same job (ack and nack), already answered.
STALE_LEASES = [
    ("enqueue", 0, None),
    ("claim", "w1"),
    ("advance", LEASE),
    ("ack", 0),  # token 1 at its expiry instant: expired
    ("advance", BASE),
    ("claim", "w2"),  # token 2: the retry, due BASE after the expiry
    ("ack", 1),  # token 1 again: superseded
    ("nack", 1),
    ("ack", 0),  # token 2: live, accepted
    ("ack", 0),  # token 2 again: already answered
]


@pytest.mark.rule("claim-counts", "stale-changes-nothing")
@core
@given(ops=workloads(), max_attempts=st.integers(1, 3))
@example(ops=STALE_LEASES, max_attempts=3)
def test_stage1_fencing_tokens_grow_and_stale_leases_change_nothing(
    ops: list[Op], max_attempts: int
) -> None:
    client = client_for(max_attempts)
    client.run(ops)
    for fact in client.claims:
        if fact.lease is not None and fact.lease.job_id in fact.tokens:
            previous = fact.tokens[fact.lease.job_id]
            if not (fact.lease.token > previous):
                raise AssertionError(
                    client.story.fail(
                        "every claim of a job issues a larger fencing token than the last",
                        f"claim at t={fact.now - START} issued token {fact.lease.token} for "
                        f"{fact.lease.job_id!r}, whose previous token was {previous}",
                    )
                )
    for answer in client.answers:
        where = f"{answer.kind} at t={answer.now - START} with token {answer.lease.token}"
        if answer.live:
            if answer.raised:
                raise AssertionError(
                    client.story.fail(
                        "a live lease (latest token, not expired, not yet answered) is accepted",
                        f"{where} raised StaleLease",
                    )
                )
        else:
            if not (answer.raised):
                raise AssertionError(
                    client.story.fail(
                        "a lease that is not live (superseded, expired or already answered) is "
                        "rejected with StaleLease",
                        f"{where} of {answer.lease.job_id!r} was accepted",
                    )
                )
            if not (answer.before == answer.after):
                raise AssertionError(
                    client.story.fail(
                        "a rejected lease changes nothing",
                        f"{where}: {diff(answer.before, answer.after)}",
                    )
                )


@pytest.mark.rule("claim-counts", "dead-at-max")
@core
@given(ops=workloads(), max_attempts=st.integers(1, 3))
def test_stage1_attempts_are_counted_at_claim_and_the_job_dies_at_max_attempts(
    ops: list[Op], max_attempts: int
) -> None:
    client = client_for(max_attempts)

    def check() -> None:
        now = client.clock.now_ns()
        for seen in client.jobs.values():
            state, _ = client.state(seen, now)
            job = held(client.queue, seen.id)
            got = None if job is None else (job.attempts, job.state is DEAD)
            want = (len(seen.leases), state is DEAD)
            if not (got == want):
                raise AssertionError(
                    client.story.fail(
                        "attempts count claims (a crash costs one), and a job is DEAD exactly "
                        f"when attempt max_attempts={max_attempts} has failed",
                        f"{seen.id!r}: (attempts, dead) expected {want}, got {got}",
                    )
                )

    client.run(ops, check)
    for fact in client.claims:
        if fact.lease is not None and fact.lease.job_id in client.jobs:
            earlier = [
                le for le in client.jobs[fact.lease.job_id].leases if le.token < fact.lease.token
            ]
            if not (fact.lease.attempt == len(earlier) + 1):
                raise AssertionError(
                    client.story.fail(
                        "a lease's attempt is the number of claims of its job so far",
                        f"{fact.lease} follows {len(earlier)} earlier claims",
                    )
                )


@pytest.mark.rule("unique-ids", "failed-attempt", "lease-live")
@core
@given(ops=workloads(), max_attempts=st.integers(1, 3))
def test_stage1_conservation_every_job_is_in_exactly_the_state_its_history_says(
    ops: list[Op], max_attempts: int
) -> None:
    client = client_for(max_attempts)

    def check() -> None:
        now = client.clock.now_ns()
        if client.duplicate_ids:
            raise AssertionError(
                client.story.fail(
                    "job ids are unique", f"enqueue returned {client.duplicate_ids[0]!r} twice"
                )
            )
        for fact in client.claims:
            if not (fact.lease is None or fact.lease.job_id in client.jobs):
                raise AssertionError(
                    client.story.fail("claim only returns enqueued jobs", f"got {fact.lease}")
                )
        for seen in client.jobs.values():
            want, _ = client.state(seen, now)
            job = held(client.queue, seen.id)
            if not (job is not None):
                raise AssertionError(
                    client.story.fail(
                        "nothing vanishes",
                        f"get({seen.id!r}) raised JobNotFound (state should be {want})",
                    )
                )
            if job.state is not want:
                raise AssertionError(
                    client.story.fail(
                        "every job is in exactly the state its history gives it",
                        f"{seen.id!r} is {job.state}, expected {want}",
                    )
                )

    client.run(ops, check)


@pytest.mark.rule("next-due")
@core
@given(ops=workloads(), max_attempts=st.integers(1, 3))
def test_stage1_next_due_ns_is_when_the_next_claim_can_succeed(
    ops: list[Op], max_attempts: int
) -> None:
    client = client_for(max_attempts)

    def check() -> None:
        now = client.clock.now_ns()
        want, got = client.expected_next_due(now), client.queue.next_due_ns()
        if not (got == want):
            raise AssertionError(
                client.story.fail(
                    "next_due_ns() is now if a job is READY, else the earliest run time of a "
                    "SCHEDULED job or expiry of a live lease, else None",
                    f"expected {_rel(want)}, got {_rel(got)} (relative to start)",
                )
            )

    client.run(ops, check)


@pytest.mark.rule("next-due", "dead-at-max")
@core
@given(
    ops=workloads(),
    max_attempts=st.integers(1, 4),
    outcomes=st.lists(st.sampled_from(["ack", "nack", "crash"]), min_size=1, max_size=8),
)
def test_stage1_liveness_every_job_finishes(
    ops: list[Op], max_attempts: int, outcomes: list[str]
) -> None:
    client = client_for(max_attempts)
    client.run(ops)
    queue, clock = client.queue, client.clock
    budget = 3 * max_attempts * (len(client.jobs) + 1) + 10
    for step in range(budget):
        due = queue.next_due_ns()
        if due is None:
            break
        clock.set(max(due, clock.now_ns()))
        lease = queue.claim("drainer")
        if lease is None:
            continue
        outcome = outcomes[step % len(outcomes)]
        if outcome == "ack":
            queue.ack(lease)
        elif outcome == "nack":
            queue.nack(lease, "failed again")
        client.story.add(f"drain: claim -> {lease.job_id!r} attempt {lease.attempt}, {outcome}")
    unfinished = {
        seen.id: job.state
        for seen in client.jobs.values()
        if (job := queue.get(seen.id)).state not in (SUCCEEDED, DEAD)
    }
    if unfinished:
        raise AssertionError(
            client.story.fail(
                "liveness: a worker that keeps claiming at next_due_ns() finishes every job "
                "(SUCCEEDED or DEAD within max_attempts)",
                f"still unfinished after {budget} drain steps: {unfinished}; next_due_ns() = "
                f"{_rel(queue.next_due_ns())}",
            )
        )


@pytest.mark.rule("backoff-formula", "decorrelated", "one-draw", "backoff-from-failure")
@core
@given(
    jitter=st.sampled_from(JITTERS),
    base=st.integers(0, 400),
    extra=st.integers(0, 3000),
    seed=st.integers(0, 2**32),
    failures=st.lists(st.sampled_from(["nack", "crash"]), min_size=1, max_size=7),
)
# Every mode on every run, each through both kinds of failure, up to the cap: a
# decorrelated delay grows from the one before, and caps before it is kept.
@example(jitter="decorrelated", base=100, extra=1_500, seed=7, failures=["nack", "crash"] * 3)
@example(jitter="full", base=100, extra=1_500, seed=7, failures=["nack", "crash"] * 3)
@example(jitter="equal", base=100, extra=1_500, seed=7, failures=["crash", "nack"] * 3)
@example(jitter="none", base=100, extra=1_500, seed=7, failures=["nack", "crash"] * 3)
def test_stage1_backoff_delays_follow_the_formula_for_each_jitter_mode(
    jitter: Jitter, base: int, extra: int, seed: int, failures: list[str]
) -> None:
    policy = RetryPolicy(base, base + extra, jitter)
    rng = random.Random(seed)
    clock, queue = new_queue(
        jitter=jitter, base=base, cap=base + extra, rng=rng, max_attempts=len(failures) + 1
    )
    job_id = queue.enqueue("flaky")
    twin = random.Random(seed)
    want = drawn_delays(policy, twin, list(range(1, len(failures) + 1)))
    story = Story(clock, f"{policy}, rng=Random({seed}):")
    for n, how in enumerate(failures, start=1):
        lease = queue.claim("w")
        if not (lease is not None):
            raise AssertionError(story.fail("a retry is claimable at its due time", "got None"))
        if how == "nack":
            clock.advance(7)
            queue.nack(lease, "boom")
            failed_at = clock.now_ns()
        else:
            clock.advance(LEASE)
            failed_at = lease.expires_at_ns
        story.add(f"claim, {how} attempt {n}")
        got = queue.get(job_id).run_at_ns - failed_at
        if not (got == want[n - 1]):
            raise AssertionError(
                story.fail(
                    f"the delay after failed attempt n is exactly the {jitter!r} formula with one "
                    "rng draw per retry",
                    f"after attempt {n}: expected delay {want[n - 1]}, got {got}",
                )
            )
        clock.set(max(clock.now_ns(), failed_at + got))
    if not (rng.getstate() == twin.getstate()):
        raise AssertionError(
            story.fail(
                "each jittered retry makes exactly one rng call ('none' makes none)",
                f"the queue's rng did not advance as {len(failures)} retries' draws do",
            )
        )


# --------------------------------------------------------------------------------------
# Examples and properties, extended
# --------------------------------------------------------------------------------------


@pytest.mark.rule("heartbeat")
@extended
def test_stage1_heartbeat_extends_a_live_lease() -> None:
    clock, queue = new_queue()
    job_id = queue.enqueue("long job")
    lease = claim(queue, "w")
    clock.advance(LEASE - 1)
    renewed = queue.heartbeat(lease)
    assert renewed == Lease(job_id, lease.token, 1, clock.now_ns() + LEASE, "w"), (
        f"heartbeat extends the lease to now + lease_ns, same token and attempt: {renewed}"
    )
    clock.advance(LEASE - 1)
    assert queue.get(job_id).state is LEASED, "a heartbeat must keep the job leased"
    queue.ack(lease)  # the original lease object: same job, same token
    assert queue.get(job_id).state is SUCCEEDED
    queue.enqueue("crashes")
    lost = claim(queue)
    clock.advance(LEASE)
    rejects(
        StaleLease, lambda: queue.heartbeat(lost), "a heartbeat at expires_at_ns revived the lease"
    )


@pytest.mark.rule("heartbeat-never-revives")
@extended
@given(
    beats=st.lists(st.integers(1, 2 * LEASE), min_size=1, max_size=6),
    reclaimed=st.booleans(),
)
def test_stage1_heartbeat_never_revives_an_expired_lease(beats: list[int], reclaimed: bool) -> None:
    clock, queue = new_queue(max_attempts=5)
    job_id = queue.enqueue("x")
    lease = claim(queue, "w")
    story = Story(clock, "enqueue, claim:")
    for gap in beats:
        clock.advance(gap)
        expires = lease.expires_at_ns
        if clock.now_ns() < expires:
            lease = queue.heartbeat(lease)
            story.add(f"advance({gap}), heartbeat -> expires at {lease.expires_at_ns - START}")
            continue
        if reclaimed:
            clock.advance(CAP)
            claim(queue, "other")
        # Straight to the heartbeat: nothing else has touched the queue since the expiry.
        rejects(
            StaleLease,
            lambda: queue.heartbeat(lease),  # noqa: B023 - called at once
            story.fail(
                "a heartbeat never revives an expired lease, even before anyone else calls",
                f"heartbeat at {clock.now_ns() - START} of a lease that expired at "
                f"{expires - START} was accepted",
            ),
        )
        after = queue.get(job_id)
        want = (1 + reclaimed, LEASE_EXPIRED, expires + BASE)
        got = (after.attempts, after.last_error, after.run_at_ns)
        if not (got == want and (after.state is LEASED) == reclaimed):
            raise AssertionError(
                story.fail(
                    "the expiry stands: its attempt counted, its retry due at expires_at + backoff",
                    f"(attempts, last_error, run_at_ns) expected {want}, got {got}; {after.state}",
                )
            )
        return


@pytest.mark.rule("release")
@extended
def test_stage1_release_refunds_the_attempt_and_keeps_the_place_in_line() -> None:
    clock, queue = new_queue(max_attempts=1)
    first = queue.enqueue("first")
    second = queue.enqueue("second")
    lease = claim(queue, "w")
    clock.advance(10)
    queue.release(lease)  # graceful shutdown: hand it back
    job = queue.get(first)
    assert (job.state, job.attempts, job.run_at_ns, job.token) == (READY, 0, START, 1), (
        f"release makes the job READY at its old due time with the attempt refunded "
        f"(the token stays issued), got {job}"
    )
    rejects(StaleLease, lambda: queue.ack(lease), "ack of a released lease was accepted")
    again = queue.claim("w")
    assert again is not None and (again.job_id, again.attempt, again.token) == (first, 1, 2), (
        f"the released job keeps its place before {second!r}; its next claim is "
        f"attempt 1 again (max_attempts=1 is not used up) with token 2; got {again}"
    )


@pytest.mark.rule("release")
@extended
@given(pattern=st.lists(st.sampled_from(["release", "nack", "crash"]), min_size=1, max_size=12))
def test_stage1_release_never_costs_an_attempt(pattern: list[str]) -> None:
    clock, queue = new_queue(max_attempts=3)
    job_id = queue.enqueue("x")
    story, failures = Story(clock, "max_attempts=3:"), 0
    for claims, how in enumerate(pattern, start=1):
        clock.advance(2 * CAP)
        lease = queue.claim("w")
        if lease is None:
            break
        if not (lease.attempt == failures + 1 and lease.token == claims):
            raise AssertionError(
                story.fail(
                    "a release refunds its attempt; tokens still grow on every claim",
                    f"after {failures} failures and {claims - 1} claims got {lease}",
                )
            )
        if how == "release":
            queue.release(lease)
        elif how == "nack":
            queue.nack(lease, "x")
            failures += 1
        else:
            clock.advance(LEASE)
            failures += 1
        story.add(f"claim -> attempt {lease.attempt}, {how}")
    clock.advance(2 * CAP)
    state = queue.get(job_id).state
    if not ((state is DEAD) == (failures >= 3)):
        raise AssertionError(
            story.fail(
                "a job dies after max_attempts failures; releases do not count",
                f"{failures} failures, state {state}",
            )
        )


@pytest.mark.rule("cancel", "cancel-finished")
@extended
def test_stage1_cancel_makes_the_lease_stale_and_the_job_final() -> None:
    clock, queue = new_queue()
    leased_id = queue.enqueue("leased")
    ready_id = queue.enqueue("ready")
    later_id = queue.enqueue("later", run_at_ns=START + 100)
    lease = claim(queue, "w")
    assert [queue.cancel(j) for j in (leased_id, ready_id, later_id)] == [True, True, True]
    for j in (leased_id, ready_id, later_id):
        job = queue.get(j)
        assert (job.state, job.finished_at_ns) == (CANCELLED, START), (
            f"cancel makes any unfinished job CANCELLED now, got {job}"
        )
    for name, call in (
        ("ack", lambda: queue.ack(lease)),
        ("nack", lambda: queue.nack(lease, "x")),
        ("heartbeat", lambda: queue.heartbeat(lease)),
        ("release", lambda: queue.release(lease)),
    ):
        rejects(StaleLease, call, f"{name} of a cancelled job's lease was accepted")
    assert queue.get(leased_id).state is CANCELLED, "a stale call changed the job"
    clock.advance(10 * LEASE)
    assert queue.claim("w") is None, "a cancelled job is never claimed"
    assert queue.cancel(leased_id) is False, "cancelling a finished job returns False"
    done = queue.enqueue("done")
    queue.ack(claim(queue, "w"))
    assert queue.cancel(done) is False and queue.get(done).state is SUCCEEDED
    rejects(JobNotFound, lambda: queue.cancel("no-such-job"), "cancel of an unknown id")


@pytest.mark.rule("cancel", "cancel-finished")
@extended
@given(ops=workloads(max_size=30), victim=st.integers(0, 30), seed=st.integers(0, 9))
def test_stage1_cancel_at_any_point_stales_every_lease_and_ends_the_job(
    ops: list[Op], victim: int, seed: int
) -> None:
    client = client_for(3)
    client.run(ops)
    queue, clock = client.queue, client.clock
    if not client.jobs:
        return
    job_id = list(client.jobs)[victim % len(client.jobs)]
    before = queue.get(job_id)
    cancelled = queue.cancel(job_id)
    client.story.add(f"cancel({job_id!r}) -> {cancelled}")
    if not (cancelled == (before.state not in FINISHED)):
        raise AssertionError(
            client.story.fail(
                "cancel returns True exactly for unfinished jobs", f"{before.state}: {cancelled}"
            )
        )
    for lease in client.jobs[job_id].leases:
        rejects(
            StaleLease,
            lambda: queue.ack(lease, "late"),  # noqa: B023 - called at once
            client.story.fail("cancel stales every lease", f"ack of {lease} was accepted"),
        )
    clock.advance(20 * CAP)
    for _ in range(4 * len(client.jobs)):
        lease = queue.claim("w")
        if lease is None:
            break
        if not (lease.job_id != job_id):
            raise AssertionError(client.story.fail("a cancelled job is never claimed", ""))
        queue.ack(lease)
    assert queue.get(job_id).state is (CANCELLED if cancelled else before.state)


@pytest.mark.rule("dead-letters", "redrive", "redrive-keeps-token")
@extended
def test_stage1_dead_letters_are_listed_in_order_of_death_and_can_be_redriven() -> None:
    clock, queue = new_queue(max_attempts=1)
    a = queue.enqueue("a")
    b = queue.enqueue("b")
    lease_a, lease_b = claim(queue, "w"), claim(queue, "w")
    queue.nack(lease_b, "b broke")
    clock.advance(LEASE)  # a's worker crashed
    assert [j.id for j in queue.dead_letters()] == [b, a], (
        "dead_letters() lists DEAD jobs in the order they died"
    )
    assert queue.dead_letters()[1].last_error == LEASE_EXPIRED
    assert queue.redrive(a) is True
    job = queue.get(a)
    assert (job.state, job.attempts, job.run_at_ns, job.finished_at_ns) == (
        READY,
        0,
        clock.now_ns(),
        None,
    ), f"redrive returns a DEAD job to READY now with attempts zeroed, got {job}"
    assert [j.id for j in queue.dead_letters()] == [b]
    again = queue.claim("w")
    assert again is not None and (again.job_id, again.attempt, again.token) == (a, 1, 2), (
        f"a redriven job's next claim is attempt 1 with token 2 — tokens never reset, "
        f"so the lease from before its death stays stale; got {again}"
    )
    rejects(StaleLease, lambda: queue.ack(lease_a), "the lease from before the death passed")
    assert queue.redrive(a) is False, "redrive of a job that is not DEAD returns False"
    rejects(JobNotFound, lambda: queue.redrive("no-such-job"), "redrive of an unknown id")


@pytest.mark.rule("redrive", "redrive-keeps-token")
@extended
@given(
    max_attempts=st.integers(1, 3),
    rounds=st.lists(st.sampled_from(["nack", "crash"]), min_size=1, max_size=10),
)
def test_stage1_redrive_zeroes_attempts_and_tokens_keep_growing(
    max_attempts: int, rounds: list[str]
) -> None:
    clock, queue = new_queue(max_attempts=max_attempts)
    job_id = queue.enqueue("x")
    story, tokens, old = Story(clock, f"max_attempts={max_attempts}:"), [], []
    for how in rounds:
        clock.advance(2 * CAP)
        lease = queue.claim("w")
        if lease is None:
            if queue.redrive(job_id) is not True:
                raise AssertionError(story.fail("a DEAD job can be redriven", ""))
            story.add("redrive")
            lease = queue.claim("w")
            if not (lease is not None and lease.attempt == 1):
                raise AssertionError(
                    story.fail("a redriven job starts again at attempt 1", f"got {lease}")
                )
        tokens.append(lease.token)
        old.append(lease)
        if how == "nack":
            queue.nack(lease, "x")
        else:
            clock.advance(LEASE)
        story.add(f"claim -> token {lease.token}, attempt {lease.attempt}; {how}")
    if not (tokens == sorted(set(tokens))):
        raise AssertionError(
            story.fail(
                "fencing tokens grow on every claim and never reset, not even on redrive",
                f"{tokens}",
            )
        )
    for lease in old:
        rejects(
            StaleLease,
            lambda: queue.ack(lease),  # noqa: B023 - called at once
            story.fail("every lease before the last is stale", f"ack of {lease} was accepted"),
        )


@pytest.mark.rule("idempotency", "dedup-ttl-from-first")
@extended
def test_stage1_idempotency_key_returns_the_first_job_within_its_ttl() -> None:
    clock, queue = new_queue(dedup_ttl_ns=500)
    first = queue.enqueue("charge", idempotency_key="order-7")
    clock.advance(499)
    again = queue.enqueue("charge (retried)", idempotency_key="order-7", priority=3)
    assert again == first, (
        f"the same idempotency key within its TTL returns the first job's id "
        f"{first!r}, got {again!r}"
    )
    assert queue.statistics().ready == 1, "a deduplicated enqueue creates nothing"
    queue.ack(claim(queue, "w"))
    assert queue.enqueue("charge", idempotency_key="order-7") == first, (
        "the key dedups even after the first job finished"
    )
    clock.advance(1)  # 500 after the first enqueue: the record has expired
    fresh = queue.enqueue("charge", idempotency_key="order-7")
    assert fresh != first and queue.get(fresh).state is READY, (
        "at first enqueue + dedup_ttl_ns the key is forgotten: a new job"
    )
    assert queue.enqueue("other", idempotency_key="order-8") not in (first, fresh)


@pytest.mark.rule("idempotency", "dedup-ttl-from-first")
@extended
@given(
    ttl=st.sampled_from([0, 1, 300, 1000]),
    calls=st.lists(
        st.tuples(st.sampled_from("abc"), st.sampled_from([0, 1, 150, 299, 300, 700])), max_size=20
    ),
)
def test_stage1_idempotent_enqueue_dedups_exactly_within_the_ttl_of_the_first(
    ttl: int, calls: list[tuple[str, int]]
) -> None:
    clock, queue = new_queue(dedup_ttl_ns=ttl)
    first: dict[str, tuple[str, int]] = {}  # key -> (id, first enqueue time)
    story = Story(clock, f"dedup_ttl_ns={ttl}:")
    for key, gap in calls:
        clock.advance(gap)
        now = clock.now_ns()
        got = queue.enqueue(key, idempotency_key=key)
        story.add(f"advance({gap}), enqueue(key={key!r}) -> {got!r}")
        if key in first and now < first[key][1] + ttl:
            if not (got == first[key][0]):
                raise AssertionError(
                    story.fail(
                        "within its TTL (counted from the first enqueue) a key returns the first "
                        "id",
                        f"expected {first[key][0]!r}",
                    )
                )
        else:
            if not (got not in {v[0] for v in first.values()}):
                raise AssertionError(
                    story.fail(
                        "a key past its TTL (or new) creates a new job", f"got an old id {got!r}"
                    )
                )
            first[key] = (got, now)


@pytest.mark.rule("retention", "unfinished-kept")
@extended
def test_stage1_finished_jobs_and_keys_are_forgotten_after_retention() -> None:
    clock, queue = new_queue(retention_ns=2_000, dedup_ttl_ns=3_000, max_attempts=1)
    ok = queue.enqueue("ok", idempotency_key="k")
    dead = queue.enqueue("dead")
    waiting = queue.enqueue("waits", run_at_ns=START + 100_000)
    queue.ack(claim(queue, "w"))
    queue.nack(claim(queue, "w"), "x")
    clock.advance(1_999)
    assert queue.get(ok).state is SUCCEEDED and len(queue.dead_letters()) == 1
    clock.advance(1)
    for j in (ok, dead):
        rejects(
            JobNotFound,
            lambda: queue.get(j),  # noqa: B023 - called at once
            f"{j!r} finished at 0 must be forgotten at retention_ns=2000",
        )
    assert queue.dead_letters() == [], "a forgotten dead letter is not listed"
    assert queue.get(waiting).state is SCHEDULED, "unfinished jobs are never forgotten"
    stats = queue.statistics()
    assert stats == QueueStatistics(1, 0, 0, 0, 0, 0, 1), f"got {stats}"
    assert queue.enqueue("again", idempotency_key="k") == ok, (
        "the key outlives its job (TTL 3000 from the first enqueue)"
    )
    clock.advance(1_000)
    assert queue.statistics().idempotency_keys == 0, "keys are forgotten after their TTL"


@pytest.mark.rule("retention", "unfinished-kept")
@extended
@given(
    retention=st.sampled_from([0, 1, 500, 2_000]),
    ops=workloads(max_size=40),
)
def test_stage1_retention_forgets_finished_jobs_exactly_on_time(
    retention: int, ops: list[Op]
) -> None:
    clock, queue = new_queue(retention_ns=retention)
    client = Client(queue, clock, 3)

    def check() -> None:
        now = clock.now_ns()
        for seen in client.jobs.values():
            job = held(queue, seen.id)
            if job is None:
                continue
            if not (job.finished_at_ns is None or now < job.finished_at_ns + retention):
                raise AssertionError(
                    client.story.fail(
                        f"a finished job is forgotten at finished_at + retention_ns ({retention})",
                        f"{job.id!r} finished at {_rel(job.finished_at_ns)} is still held",
                    )
                )
            client_state, _ = client.state(seen, now)
            assert job.state is client_state or client_state in FINISHED

    client.run(ops, check)
    finished_at: dict[str, int] = {}
    for seen in client.jobs.values():
        job = held(queue, seen.id)
        if job is not None and job.finished_at_ns is not None:
            finished_at[seen.id] = job.finished_at_ns
    if finished_at:
        clock.set(max(finished_at.values()) + retention - 1)
        for job_id, at in finished_at.items():
            if not ((held(queue, job_id) is None) == (at + retention <= clock.now_ns())):
                raise AssertionError(
                    client.story.fail(
                        "a finished job is held until exactly finished_at + retention_ns",
                        f"{job_id!r} (finished at {_rel(at)}) at t={_rel(clock.now_ns())}",
                    )
                )
    clock.advance(retention + 10 * CAP + 10 * LEASE)
    stats = queue.statistics()
    if not (stats.succeeded + stats.dead + stats.cancelled == 0):
        raise AssertionError(
            client.story.fail(
                "memory is bounded by recent work: every finished job is forgotten in time",
                f"{stats}",
            )
        )


@pytest.mark.rule("max-pending", "full-queue-dedups")
@extended
def test_stage1_max_pending_bounds_unfinished_jobs() -> None:
    _, queue = new_queue(max_pending=2, max_attempts=1)
    a = queue.enqueue("a", idempotency_key="a")
    queue.enqueue("b", run_at_ns=START + 50)
    before = queue.statistics()
    rejects(QueueFull, lambda: queue.enqueue("c"), "a 3rd pending job with max_pending=2")
    assert queue.statistics() == before, "a refused enqueue must change nothing"
    assert queue.enqueue("a again", idempotency_key="a") == a, (
        "a deduplicated enqueue creates nothing, so a full queue still answers it"
    )
    queue.nack(claim(queue, "w"), "x")
    assert queue.get(a).state is DEAD, "with max_attempts=1 a nacked job is DEAD"
    c = queue.enqueue("c")
    rejects(QueueFull, lambda: queue.redrive(a), "a redrive past max_pending=2")
    assert queue.get(a).state is DEAD, "a refused redrive must change nothing"
    queue.cancel(c)
    assert queue.redrive(a) is True


@pytest.mark.rule("statistics")
@extended
def test_stage1_statistics_count_jobs_per_state() -> None:
    clock, queue = new_queue(max_attempts=1)
    for i in range(6):
        queue.enqueue(
            i, run_at_ns=START + 100 if i == 5 else None, idempotency_key=f"k{i}" if i < 2 else None
        )
    queue.ack(claim(queue, "w"))
    queue.nack(claim(queue, "w"), "x")
    queue.cancel(claim(queue, "w").job_id)
    claim(queue, "w")
    assert queue.statistics() == QueueStatistics(
        scheduled=1, ready=1, leased=1, succeeded=1, dead=1, cancelled=1, idempotency_keys=2
    ), f"got {queue.statistics()}"
    assert queue.statistics().pending == 3
    clock.advance(100)
    assert (queue.statistics().scheduled, queue.statistics().ready) == (0, 2)


@pytest.mark.rule("is-current")
@extended
def test_stage1_is_current_tells_a_worker_whether_its_lease_is_live() -> None:
    clock, queue = new_queue()
    queue.enqueue("x")
    lease = claim(queue, "w")
    assert queue.is_current(lease) is True
    clock.advance(LEASE)
    assert queue.is_current(lease) is False, "an expired lease is not current"
    clock.advance(BASE)
    fresh = claim(queue, "w")
    assert (queue.is_current(lease), queue.is_current(fresh)) == (False, True)
    queue.ack(fresh)
    assert queue.is_current(fresh) is False, "an acked lease is not current"
    assert queue.is_current(Lease("no-such-job", 1, 1, START + LEASE, "w")) is False


@pytest.mark.rule("effect-once", "effect-fenced")
@extended
def test_stage1_effect_store_applies_each_effect_once_despite_crashes_and_zombies() -> None:
    clock, queue = new_queue(max_attempts=5)
    store = stage().MemoryEffectStore(queue)
    job_id = queue.enqueue({"credit": 10})
    crashed = claim(queue, "w1")
    assert store.commit(crashed, "credited 10") is True
    clock.advance(LEASE + BASE)  # w1 dies between effect and ack
    rerun = claim(queue, "w2")
    assert store.commit(rerun, "credited 10 again") is False, (
        "the re-run of a job whose effect is committed must not commit it again"
    )
    queue.ack(rerun)
    assert store.effects() == {job_id: "credited 10"}
    other = queue.enqueue({"credit": 5})
    zombie = claim(queue, "w3")
    clock.advance(LEASE + BASE)  # w3 stalls (GC pause) past its lease
    live = claim(queue, "w4")
    rejects(StaleLease, lambda: store.commit(zombie, "zombie credit"), "a zombie's effect")
    assert store.commit(live, "credited 5") is True
    assert store.effects() == {job_id: "credited 10", other: "credited 5"}, (
        "effects are keyed by job id and fenced by the live token"
    )
    store.effects().clear()
    assert len(store.effects()) == 2, "effects() returns a copy"


@pytest.mark.rule("effect-once", "effect-fenced")
@extended
@given(
    plans=st.lists(
        st.lists(
            st.sampled_from(["ok", "crash_before_effect", "crash_after_effect", "stall"]),
            min_size=1,
            max_size=5,
        ),
        min_size=1,
        max_size=6,
    ),
)
def test_stage1_each_jobs_effect_is_applied_exactly_once_under_crashes(
    plans: list[list[str]],
) -> None:
    clock, queue = new_queue(max_attempts=6)
    store = stage().MemoryEffectStore(queue)
    ids = [queue.enqueue(i) for i in range(len(plans))]
    turn = dict.fromkeys(ids, 0)
    zombies: list[tuple[Lease, str]] = []
    story = Story(clock, "workers running jobs with crashes between claim, effect and ack:")
    for _ in range(8 * len(plans) * 6):
        due = queue.next_due_ns()
        if due is None:
            break
        clock.set(max(due, clock.now_ns()))
        lease = queue.claim("w")
        if lease is None:
            continue
        plan = plans[ids.index(lease.job_id)]
        what = plan[turn[lease.job_id]] if turn[lease.job_id] < len(plan) else "ok"
        turn[lease.job_id] += 1
        story.add(f"claim -> {lease.job_id!r} token {lease.token}: {what}")
        if what in ("ok", "crash_after_effect"):
            store.commit(lease, f"effect of {lease.job_id}")
        if what == "ok":
            queue.ack(lease)
        elif what == "stall":
            zombies.append((lease, f"zombie effect of {lease.job_id}"))
        for old, effect in zombies:  # zombies wake up and try to finish what they started
            if not queue.is_current(old):
                rejects(
                    StaleLease,
                    lambda: store.commit(old, effect),  # noqa: B023 - called at once
                    story.fail("a zombie commits no effect", f"{old} committed {effect!r}"),
                )
    effects = store.effects()
    if not (effects == {j: f"effect of {j}" for j in ids}):
        raise AssertionError(
            story.fail(
                "each job's effect is applied exactly once, by a live lease, whatever crashes",
                f"effects: {effects}",
            )
        )
    if not (all(queue.get(j).state is SUCCEEDED for j in ids)):
        raise AssertionError(
            story.fail("every job finishes", f"{[queue.get(j).state for j in ids]}")
        )


# --------------------------------------------------------------------------------------
# The exact model, written from the rules, and the state machines that use it
# --------------------------------------------------------------------------------------


SETUPS: dict[str, st.SearchStrategy[Any]] = {
    "jitter": st.sampled_from(JITTERS),
    "base": st.sampled_from([0, 1, 100, 250]),
    "extra": st.sampled_from([0, 300, 5_000]),
    "max_attempts": st.integers(1, 4),
    "seed": st.integers(0, 2**16),
    "lease_ns": st.sampled_from([500, 1_000]),
    "data": st.data(),
}


class QueueMachine(RuleBasedStateMachine):
    """A queue and its exact model under random operations, compared at every step.

    Observation is a rule, not an invariant: ``get`` settles what is due, and observing
    after every step would hide an operation that forgets to settle first.
    """

    extended = False

    @initialize(
        jitter=SETUPS["jitter"],
        base=SETUPS["base"],
        extra=SETUPS["extra"],
        max_attempts=SETUPS["max_attempts"],
        seed=SETUPS["seed"],
        lease_ns=SETUPS["lease_ns"],
        data=SETUPS["data"],
    )
    def build(
        self, jitter: Jitter, base: int, extra: int, max_attempts: int, seed: int,
        lease_ns: int, data: st.DataObject,
    ) -> None:  # fmt: skip
        self.clock = ManualClock(START)
        retry = RetryPolicy(base, base + extra, jitter)
        options: dict[str, Any] = {}
        if self.extended:
            options = {
                "dedup_ttl_ns": data.draw(st.sampled_from([0, 700, 5_000]), label="dedup_ttl_ns"),
                "retention_ns": data.draw(st.sampled_from([0, 800, 4_000]), label="retention_ns"),
                "max_pending": data.draw(st.sampled_from([None, 2, 5]), label="max_pending"),
            }
        self.queue = stage().JobQueue(
            clock=self.clock, lease_ns=lease_ns, retry=retry, max_attempts=max_attempts,
            rng=random.Random(seed), **options,
        )  # fmt: skip
        self.model = Model(
            lease_ns=lease_ns, retry=retry, max_attempts=max_attempts, seed=seed, **options
        )
        self.ids: dict[int, str] = {}  # model seq -> the queue's job id
        self.leases: list[tuple[int, Lease]] = []  # (model seq, lease) ever issued
        self.story = Story(
            self.clock,
            f"JobQueue(lease_ns={lease_ns}, retry={retry}, max_attempts={max_attempts}, "
            f"rng=Random({seed}){''.join(f', {k}={v}' for k, v in options.items())}):",
        )
        first = st.tuples(st.integers(-1, 2), st.sampled_from([None, 0, 300]))
        for priority, when in data.draw(st.lists(first, min_size=1, max_size=4), label="jobs"):
            self.enqueue(priority, when, None)

    def now(self) -> int:
        return self.clock.now_ns()

    def accepted(self, what: str, call: Callable[[], Any]) -> Any:
        """``call()``, which the model says must succeed: a queue error fails the test."""
        try:
            return call()
        except (StaleLease, JobNotFound, QueueFull) as error:
            raise AssertionError(
                self.story.fail(
                    "the queue and its exact model disagree",
                    f"{what} raised {type(error).__name__}: {error}; the model accepts it",
                )
            ) from None

    def check(self, what: str, expected: Any, got: Any) -> None:
        if got != expected:
            raise AssertionError(
                self.story.fail(
                    "the queue and its exact model disagree", f"{what}: {diff(expected, got)}"
                )
            )

    def refused(self, error: type[Exception], what: str, call: Callable[[], Any], why: str) -> None:
        """``call()`` must raise ``error`` (the model says so, because ``why``)."""
        try:
            call()
        except error:
            return
        except (StaleLease, JobNotFound, QueueFull) as other:
            raise AssertionError(
                self.story.fail(
                    "the queue and its exact model disagree",
                    f"{what}: expected {error.__name__} ({why}), got {type(other).__name__}: "
                    f"{other}",
                )
            ) from None
        raise AssertionError(
            self.story.fail(
                "the queue and its exact model disagree",
                f"{what} was accepted; expected {error.__name__} ({why})",
            )
        )

    def why_refused(self, seq: int, lease: Lease) -> str:
        """Why the model refuses ``lease`` now, in words."""
        job = self.model.jobs.get(seq)
        if job is None:
            return "its job was forgotten after its retention"
        if job.token != lease.token:
            return f"superseded: the job's latest token is {job.token}"
        if job.state in FINISHED:
            return f"its job is {job.state.value} already"
        if self.now() >= lease.expires_at_ns:
            return f"it expired at {_rel(lease.expires_at_ns)}; the job is {job.state.value}"
        return f"it was answered already; the job is {job.state.value}"

    # --- core rules ---------------------------------------------------------------------
    @rule(
        priority=st.integers(-1, 2),
        when=st.one_of(st.none(), st.sampled_from([-200, 0, 1, 300, 1_200])),
        key=st.one_of(st.none(), st.sampled_from(["k1", "k2"])),
    )
    def enqueue(self, priority: int, when: int | None, key: str | None) -> None:
        key = key if self.extended else None
        run_at = None if when is None else self.now() + when
        payload = {"n": self.model.enqueued + 1}
        expected = self.model.enqueue(payload, priority, run_at, key, self.now())
        call = f"enqueue({payload}, priority={priority}, run_at_ns={_rel(run_at)}, key={key!r})"
        if expected is None:
            self.refused(
                QueueFull,
                call,
                lambda: self.queue.enqueue(
                    payload, priority=priority, run_at_ns=run_at, idempotency_key=key
                ),
                f"max_pending={self.model.max_pending} unfinished jobs are held",
            )
            self.story.add(f"{call} -> QueueFull")
            return
        got = self.accepted(
            call,
            lambda: self.queue.enqueue(
                payload, priority=priority, run_at_ns=run_at, idempotency_key=key
            ),
        )
        self.story.add(f"{call} -> {got!r}")
        if expected in self.ids:
            self.check(f"{call} (a key seen within its TTL)", self.ids[expected], got)
        else:
            if not (got not in self.ids.values()):
                raise AssertionError(self.story.fail("job ids are unique", f"{got!r} reused"))
            self.ids[expected] = got

    @rule(worker=st.sampled_from(WORKERS))
    def claim(self, worker: str) -> None:
        job = self.model.claim(worker, self.now())
        got = self.accepted(f"claim({worker!r})", lambda: self.queue.claim(worker))
        self.story.add(f"claim({worker!r}) -> {got}")
        if job is None:
            self.check(f"claim({worker!r})", None, got)
            return
        self.check(
            f"claim({worker!r})",
            Lease(self.ids[job.seq], job.token, job.attempts, job.expires, worker),  # type: ignore[arg-type]
            got,
        )
        self.leases.append((job.seq, got))

    def answer(
        self, name: str, i: int, call: Callable[[Lease], Any], apply: Callable[[int], Any]
    ) -> Any:
        """Present lease number ``i`` (from the newest) to ``call``; the model decides."""
        seq, lease = self.leases[-1 - i % len(self.leases)]
        verdict = self.model.live(seq, lease.token, self.now())
        text = f"{name}(token {lease.token} of {lease.job_id!r})"
        if verdict == "ok":
            got = self.accepted(text, lambda: call(lease))
            self.story.add(f"{text} -> {got}")
            return got, apply(seq)
        error = StaleLease if verdict == "stale" else JobNotFound
        self.refused(error, text, lambda: call(lease), self.why_refused(seq, lease))
        self.story.add(f"{text} -> {error.__name__}")
        return None

    @precondition(lambda self: self.leases)
    @rule(i=st.integers(0, 5), result=st.sampled_from([None, 7]))
    def ack(self, i: int, result: Any) -> None:
        self.answer(
            "ack",
            i,
            lambda le: self.queue.ack(le, result),
            lambda s: self.model.ack(s, result, self.now()),
        )

    @precondition(lambda self: self.leases)
    @rule(i=st.integers(0, 5), error=st.sampled_from(["boom", "timeout"]))
    def nack(self, i: int, error: str) -> None:
        self.answer(
            "nack",
            i,
            lambda le: self.queue.nack(le, error),
            lambda s: self.model.nack(s, error, self.now()),
        )

    @precondition(lambda self: self.leases)
    @rule(i=st.integers(0, 5), how=st.sampled_from(["ack", "nack", "heartbeat", "release"]))
    def answer_at_expiry(self, i: int, how: str) -> None:
        """Move the clock to a lease's expiry (if still ahead) and answer at once: the
        queue must settle the expiry before it looks at the lease."""
        expires = self.leases[-1 - i % len(self.leases)][1].expires_at_ns
        if expires > self.now():
            self.story.add(f"advance({expires - self.now()})")
            self.clock.set(expires)
        if how == "nack":
            self.nack(i, "late")
        elif how == "ack" or not self.extended:
            self.ack(i, None)
        else:
            getattr(self, how)(i)

    @rule(ns=st.sampled_from([1, 99, 100, 250, 499, 500, 1_000, 3_000]))
    def advance(self, ns: int) -> None:
        self.clock.advance(ns)
        self.story.add(f"advance({ns})")

    @rule()
    def observe(self) -> None:
        self.compare_all()

    def compare_all(self) -> None:
        now = self.now()
        self.model.settle(now)
        for seq, job_id in self.ids.items():
            job = self.model.jobs.get(seq)
            expected = None if job is None else self.model.snapshot(job, job_id)
            self.check(f"get({job_id!r})", expected, held(self.queue, job_id))
        self.check("next_due_ns()", _rel(self.model.next_due(now)), _rel(self.queue.next_due_ns()))
        if self.extended:
            self.check("statistics()", self.model.statistics(now), self.queue.statistics())
            expected_dead = [
                self.model.snapshot(self.model.jobs[s], self.ids[s]) for s in self.model.died
            ]
            self.check("dead_letters()", expected_dead, self.queue.dead_letters())
        self.story.add(
            "observe: every job, next_due_ns"
            + (", statistics, dead_letters" if self.extended else "")
        )

    def teardown(self) -> None:
        # A final comparison, unless a step already failed (its explanation stands alone).
        if hasattr(self, "queue") and sys.exc_info()[0] is None:
            self.compare_all()


class ExtendedQueueMachine(QueueMachine):
    """The core machine plus heartbeat, release, cancel, redrive, keys, retention, bounds."""

    extended = True

    @precondition(lambda self: self.leases)
    @rule(i=st.integers(0, 5))
    def heartbeat(self, i: int) -> None:
        got = self.answer(
            "heartbeat", i, self.queue.heartbeat, lambda s: self.model.heartbeat(s, self.now())
        )
        if got is not None:
            renewed, expires = got
            _, lease = next(
                (s, le)
                for s, le in self.leases
                if le.job_id == renewed.job_id and le.token == renewed.token
            )
            self.check(
                "heartbeat(...)",
                Lease(lease.job_id, lease.token, lease.attempt, expires, lease.worker_id),
                renewed,
            )

    @precondition(lambda self: self.leases)
    @rule(i=st.integers(0, 5))
    def release(self, i: int) -> None:
        self.answer("release", i, self.queue.release, lambda s: self.model.release(s, self.now()))

    @precondition(lambda self: self.leases)
    @rule(i=st.integers(0, 5))
    def is_current(self, i: int) -> None:
        seq, lease = self.leases[-1 - i % len(self.leases)]
        expected = self.model.live(seq, lease.token, self.now()) == "ok"
        self.check(
            f"is_current(token {lease.token} of {lease.job_id!r})",
            expected,
            self.queue.is_current(lease),
        )

    def pick(self, i: int) -> tuple[int, str]:
        seq = sorted(self.ids)[i % len(self.ids)]
        return seq, self.ids[seq]

    @precondition(lambda self: self.ids)
    @rule(i=st.integers(0, 20))
    def cancel(self, i: int) -> None:
        seq, job_id = self.pick(i)
        expected = self.model.cancel(seq, self.now())
        if expected is None:
            self.refused(
                JobNotFound,
                f"cancel({job_id!r})",
                lambda: self.queue.cancel(job_id),
                "the job was forgotten after its retention",
            )
            self.story.add(f"cancel({job_id!r}) -> JobNotFound")
            return
        got = self.accepted(f"cancel({job_id!r})", lambda: self.queue.cancel(job_id))
        self.story.add(f"cancel({job_id!r}) -> {got}")
        self.check(f"cancel({job_id!r})", expected, got)

    @precondition(lambda self: self.ids)
    @rule(i=st.integers(0, 20))
    def redrive(self, i: int) -> None:
        seq, job_id = self.pick(i)
        expected = self.model.redrive(seq, self.now())
        if expected is None or expected == "full":
            error = JobNotFound if expected is None else QueueFull
            why = (
                "the job was forgotten after its retention"
                if expected is None
                else f"max_pending={self.model.max_pending} unfinished jobs are held"
            )
            self.refused(error, f"redrive({job_id!r})", lambda: self.queue.redrive(job_id), why)
            self.story.add(f"redrive({job_id!r}) -> {error.__name__}")
            return
        got = self.accepted(f"redrive({job_id!r})", lambda: self.queue.redrive(job_id))
        self.story.add(f"redrive({job_id!r}) -> {got}")
        self.check(f"redrive({job_id!r})", expected, got)


#: What the machines check: every core rule a random run reaches, and the extended ones.
MODEL_RULES = (
    "claim-order", "never-early", "claim-counts", "lease-live", "stale-changes-nothing",
    "failed-attempt", "backoff-from-failure", "dead-at-max", "backoff-formula", "decorrelated",
    "one-draw", "settle-first", "expiry-order", "next-due", "snapshot",
)  # fmt: skip
EXTENDED_MODEL_RULES = (
    "heartbeat", "heartbeat-never-revives", "release", "cancel", "cancel-finished",
    "dead-letters", "redrive", "redrive-keeps-token", "idempotency", "dedup-ttl-from-first",
    "retention", "max-pending", "full-queue-dedups", "statistics", "is-current",
    "lease-unknown-job",
)  # fmt: skip


def _setup(extended: bool) -> Step:
    """Decorrelated jitter from 100 ns, three attempts, leases of 1 000 ns; a job due now
    and a more urgent one due in 300 ns (and, extended: keys live 700 ns, finished jobs
    800 ns, at most 2 unfinished)."""
    options = (700, 800, 2) if extended else ()
    jobs = [(0, None), (1, 300)]
    return ("build", {
        "jitter": "decorrelated", "base": 100, "extra": 5_000, "max_attempts": 3, "seed": 7,
        "lease_ns": 1_000, "data": Drawn(*options, jobs),
    })  # fmt: skip


def _answer(how: str, i: int = 0) -> Step:
    arguments: dict[str, Any] = {"i": i}
    if how == "ack":
        arguments["result"] = 7
    elif how == "nack":
        arguments["error"] = "boom"
    return (how, arguments)


_OBSERVE: Step = ("observe", {})


def life(extended: bool) -> Walk:
    """Two jobs' lives at their boundaries, on every run of the model tests: one answered
    at the very instant its lease expires (the expiry settles first), superseded by its
    retry and dead by expiry at its third attempt; the other, more urgent once due, nacked
    and then answered at its expiry instant."""
    return [
        _setup(extended), ("claim", {"worker": "w1"}),
        ("answer_at_expiry", {"i": 0, "how": "ack"}), _OBSERVE, ("advance", {"ns": 3_000}),
        ("claim", {"worker": "w2"}), ("claim", {"worker": "w1"}), _answer("ack", 2),
        _answer("nack", 1), _OBSERVE, ("advance", {"ns": 3_000}), ("claim", {"worker": "w2"}),
        ("claim", {"worker": "w1"}), ("advance", {"ns": 1_000}), _OBSERVE, _answer("ack", 0),
        _answer("nack", 1), _OBSERVE,
    ]  # fmt: skip


_SWEEP: list[Step] = [("claim", {"worker": "w1"}), ("claim", {"worker": "w2"}),
                      ("advance", {"ns": 1_000}), ("advance", {"ns": 5_000})]  # fmt: skip
#: The extended rules at theirs: a full queue refuses; a heartbeat 1 ns before the expiry
#: extends the lease; a release refunds its attempt; a key dedups for its TTL from its
#: first use, not from the duplicates; a finished job is forgotten exactly at its
#: retention; a job dead at max_attempts is listed and redriven with its token; a cancel.
EXTENDED: Walk = [
    _setup(True), ("enqueue", {"priority": 0, "when": None, "key": "k1"}),
    ("claim", {"worker": "w1"}), ("advance", {"ns": 999}), ("heartbeat", {"i": 0}),
    ("answer_at_expiry", {"i": 0, "how": "heartbeat"}), ("is_current", {"i": 0}), _OBSERVE,
    ("advance", {"ns": 3_000}), ("claim", {"worker": "w2"}), ("release", {"i": 0}),
    ("is_current", {"i": 0}), ("claim", {"worker": "w1"}), _answer("ack", 0),
    ("enqueue", {"priority": 2, "when": 0, "key": "k1"}), ("advance", {"ns": 350}),
    ("enqueue", {"priority": 2, "when": 0, "key": "k1"}), ("advance", {"ns": 350}),
    ("enqueue", {"priority": 2, "when": 0, "key": "k1"}), ("advance", {"ns": 100}), _OBSERVE,
    *_SWEEP, *_SWEEP[:3], _OBSERVE, ("redrive", {"i": 0}), ("cancel", {"i": 2}),
    ("advance", {"ns": 800}), _OBSERVE,
]  # fmt: skip

TestStage1JobQueueModel = pytest.mark.rule(*MODEL_RULES)(
    core(walked(QueueMachine, {"two jobs' lives": life(False)}))
)
TestStage1JobQueueExtendedModel = pytest.mark.rule(*EXTENDED_MODEL_RULES)(
    extended(walked(ExtendedQueueMachine, {"two jobs' lives": life(True), "extended": EXTENDED}))
)


def model_ops(extended: bool) -> st.SearchStrategy[list[Op]]:
    """Operations for ``QueueMachine`` rules, well mixed: (rule name, *arguments)."""
    i = st.integers(0, 5)
    ops = [
        st.tuples(
            st.just("enqueue"),
            st.integers(-1, 2),
            st.one_of(st.none(), st.sampled_from([-200, 0, 1, 300, 1_200])),
            st.one_of(st.none(), st.sampled_from(["k1", "k2"])),
        ),
        st.tuples(st.just("claim"), st.sampled_from(WORKERS)),
        st.tuples(st.just("ack"), i, st.sampled_from([None, 7])),
        st.tuples(st.just("nack"), i, st.sampled_from(["boom", "timeout"])),
        st.tuples(
            st.just("answer_at_expiry"), i, st.sampled_from(["ack", "nack", "heartbeat", "release"])
        ),
        st.tuples(st.just("advance"), st.sampled_from([1, 99, 100, 250, 499, 500, 1_000, 3_000])),
        st.tuples(st.just("observe")),
    ]
    if extended:
        ops += [
            st.tuples(st.sampled_from(["heartbeat", "release", "is_current"]), i),
            st.tuples(st.sampled_from(["cancel", "redrive"]), st.integers(0, 20)),
        ]
    return st.lists(st.one_of(*ops), min_size=10, max_size=60)


def run_model_ops(machine: QueueMachine, ops: list[Op], setup: dict[str, Any]) -> None:
    machine.build(**setup)
    for name, *args in ops:
        needs = {"ack", "nack", "answer_at_expiry", "heartbeat", "release", "is_current"}
        if (name in needs and not machine.leases) or (
            name in {"cancel", "redrive"} and not machine.ids
        ):
            continue  # the rule's precondition
        getattr(machine, name)(*args)
    machine.teardown()


@pytest.mark.rule(*MODEL_RULES)
@core
@given(ops=model_ops(extended=False), **SETUPS)
def test_stage1_queue_matches_its_exact_model_step_by_step(ops: list[Op], **setup: Any) -> None:
    run_model_ops(QueueMachine(), ops, setup)


@pytest.mark.rule(*EXTENDED_MODEL_RULES)
@extended
@given(ops=model_ops(extended=True), **SETUPS)
def test_stage1_extended_queue_matches_its_exact_model_step_by_step(
    ops: list[Op], **setup: Any
) -> None:
    run_model_ops(ExtendedQueueMachine(), ops, setup)
