"""Stage 1 suite: a single-threaded job queue (see katas/job_scheduler/README.md).

Core: ``JobQueue`` — enqueue, claim, ack, nack, get, next_due_ns. Extended: heartbeat,
release, cancel, dead letters and redrive, idempotency keys, retention, max_pending,
statistics, is_current and ``MemoryEffectStore``. Run
``pytest katas/job_scheduler -k "stage1 and core"`` for the core.

Three files, three kinds of tests: here, the core examples that read like the prompt;
in ``test_stage1_extended.py``, the extended ones and their properties; in
``test_stage1_properties.py``, properties each judging one invariant from what a client
can see of its own calls, and state machines comparing every observable result with an
exact model written from the rules, slowly and obviously (lists and ``min``, never
heaps), which never looks at an implementation. Time is a ``ManualClock``; randomness a
seeded ``random.Random`` whose twin replays the draws the rules prescribe. The queues
are built by :mod:`katas.job_scheduler._testing.queues`.

Map: a job's life (unique-ids, claim-counts, snapshot) · order (claim-order,
never-compared, future-does-not-block, retry-keeps-seq) · never early (never-early) ·
retries and backoff (failed-attempt, backoff-formula, backoff-from-failure,
decorrelated, one-draw, dead-at-max) · leases and fencing (lease-live,
stale-changes-nothing) · settling (expiry-order, settle-first) · next_due_ns (next-due)
· bad input and unknown ids (bad-input, get-unknown, lease-unknown-job) · every lease
call at its expiry instant, and a forgotten job's (heartbeat-never-revives, release,
is-current, effect-fenced, retention).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from typing import Any

import pytest

from katas._harness.marks import core, extended, rule
from katas._harness.story import Story, check, differences, not_refused
from katas._harness.under_test import stage
from katas.job_scheduler._testing.queues import (
    BASE,
    CAP,
    LEASE,
    SEED,
    START,
    claim,
    delay_none,
    drawn_delays,
    fail_fast_on_stubs,  # noqa: F401 (autouse)
    memory_store,
    new_queue,
    rejects,
    rel,
)
from katas.job_scheduler._testing.states import DEAD, LEASED, READY, SCHEDULED, SUCCEEDED
from katas.job_scheduler.api import (
    LEASE_EXPIRED,
    EffectStore,
    Jitter,
    JobNotFound,
    JobQueue,
    Lease,
    ManualClock,
    RetryPolicy,
    StaleLease,
)

pytestmark = [pytest.mark.stage(1)]


# --------------------------------------------------------------------------------------
# Examples: the prompt, core
# --------------------------------------------------------------------------------------


@rule("unique-ids", "claim-counts", "snapshot")
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


@rule("claim-order", "next-due")
@core
def test_stage1_claim_on_an_empty_queue_returns_none() -> None:
    _, queue = new_queue()
    assert queue.claim("w") is None, "claim() on an empty queue must return None"
    assert queue.next_due_ns() is None, "next_due_ns() on an empty queue is None"


@rule("claim-order", "never-compared")
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


@rule("claim-order", "future-does-not-block")
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


@rule("never-early")
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


@rule("failed-attempt", "backoff-formula", "backoff-from-failure")
@core
def test_stage1_nack_retries_after_exponential_backoff() -> None:
    clock, queue = new_queue(max_attempts=7)
    job_id = queue.enqueue("flaky")
    story = Story("enqueue('flaky') with backoff 100·2^(n-1) capped at 1600:", clock.now_ns, START)
    for n in range(1, 7):  # 100, 200, 400, 800, 1600 (= the cap), then 1600 (capped)
        lease = queue.claim("w")
        assert lease is not None and lease.attempt == n, story.tell(
            "a retried job is claimable once its backoff is over",
            f"attempt {n}: claim() -> {lease}",
        )
        queue.nack(lease, f"boom {n}")
        story.add(f"claim, nack(attempt {n})")
        job = queue.get(job_id)
        want = delay_none(n)
        story.check(
            (job.state, job.run_at_ns, job.last_error)
            == (SCHEDULED, clock.now_ns() + want, f"boom {n}"),
            "after nack of attempt n the job waits min(cap, base·2^(n-1)) and keeps the error",
            f"expected SCHEDULED at now + {want}, got {job.state} at now + "
            f"{job.run_at_ns - clock.now_ns()} (last_error {job.last_error!r})",
        )
        clock.advance(want - 1)
        story.check(
            queue.claim("w") is None,
            "a retry is never claimed before its backoff is over",
            f"claimed at now + {want - 1}",
        )
        clock.advance(1)


@rule("backoff-formula")
@core
def test_stage1_backoff_doubles_until_the_cap_however_many_attempts() -> None:
    base, cap, failures = 1, 2**50, 54  # the cap is reached at attempt 51
    clock, queue = new_queue(base=base, cap=cap, max_attempts=failures + 1)
    job_id = queue.enqueue("flaky")
    for n in range(1, failures + 1):
        queue.nack(claim(queue, "w"), "boom")
        delay = queue.get(job_id).run_at_ns - clock.now_ns()
        want = delay_none(n, base, cap)
        assert delay == want, (
            f"backoff base_ns=1, cap_ns=2**50; claim and nack, {n} times: after attempt {n} "
            f"the job waits min(cap_ns, base_ns·2^(n-1)) = 2**{want.bit_length() - 1}; got "
            f"{delay} — the doubling goes on until the cap, however many attempts it takes"
        )
        clock.advance(delay)


@rule("lease-live", "failed-attempt", "claim-counts")
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


def _superseded(
    calls: Callable[[JobQueue, Lease], dict[str, Callable[[], object]]],
) -> tuple[JobQueue, str, Lease]:
    """A job whose first lease (w1's) was superseded by w2's claim after it expired: each
    of ``calls`` with w1's lease raises StaleLease and changes nothing. Returns
    (queue, job id, w2's live lease)."""
    clock, queue = new_queue(max_attempts=5)
    job_id = queue.enqueue("transfer")
    zombie = claim(queue, "w1")
    clock.advance(LEASE + BASE)  # w1 stalls past its lease; the retry is due
    fresh = claim(queue, "w2")
    assert fresh is not None and fresh.token > zombie.token, (
        f"a reclaim must issue a larger fencing token: {zombie} then {fresh}"
    )
    before = queue.get(job_id)
    for name, call in calls(queue, zombie).items():
        rejects(StaleLease, call, f"{name} with the superseded token {zombie.token} was accepted")
        after = queue.get(job_id)
        assert after == before, (
            f"{name} with the superseded token {zombie.token} (live token "
            f"{fresh.token}) must raise StaleLease and change nothing: {differences(before, after)}"
        )
    return queue, job_id, fresh


@rule("stale-changes-nothing")
@core
def test_stage1_ack_with_a_superseded_token_is_rejected_and_changes_nothing() -> None:
    queue, job_id, fresh = _superseded(
        lambda queue, zombie: {
            "ack": lambda: queue.ack(zombie, "late"),
            "nack": lambda: queue.nack(zombie, "x"),
        }
    )
    queue.ack(fresh, "done")
    assert queue.get(job_id).result == "done"
    rejects(StaleLease, lambda: queue.ack(fresh, "twice"), "a second ack was accepted")
    assert queue.get(job_id).result == "done", "a second ack must change nothing"


@rule("dead-at-max")
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


@rule("dead-at-max", "failed-attempt")
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


@rule("retry-keeps-seq")
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


@rule("backoff-from-failure")
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


@rule("expiry-order")
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


@rule("expiry-order")
@core
def test_stage1_a_later_job_whose_lease_expires_first_settles_first() -> None:
    clock, queue = new_queue(jitter="full", max_attempts=5)
    a = queue.enqueue("a")  # seq 1
    b = queue.enqueue("b", priority=1)  # seq 2, claimed first
    claim(queue, "w")  # b, expires at L
    clock.advance(10)
    claim(queue, "w")  # a, expires at L + 10
    clock.advance(3 * LEASE)  # one call notices both expiries
    rng = random.Random(SEED)
    want = {
        b: START + LEASE + rng.randrange(BASE + 1),  # (L, 2): it expired first
        a: START + 10 + LEASE + rng.randrange(BASE + 1),  # (L + 10, 1)
    }
    got = {j: queue.get(j).run_at_ns for j in (a, b)}
    assert got == want, (
        "expiries settle in (expires_at, seq) order, one full-jitter draw each: b (seq 2) "
        "expired 10 ns before a (seq 1), so b draws first — the order of expiry, not of "
        f"sequence. Expected retry times {want}, got {got}"
    )


@rule("expiry-order")
@core
def test_stage1_expiries_at_one_instant_settle_by_sequence_not_by_token() -> None:
    clock, queue = new_queue(jitter="full", max_attempts=5)
    a = queue.enqueue("a")  # seq 1
    b = queue.enqueue("b")  # seq 2
    queue.nack(claim(queue), "503")  # a's attempt 1 fails: its retry draws once
    rng = random.Random(SEED)
    clock.advance(rng.randrange(BASE + 1))  # a is due again
    leases = {le.job_id: le for le in (claim(queue), claim(queue))}
    assert (leases[a].token, leases[b].token) == (2, 1), f"tokens: {leases}"
    clock.advance(LEASE)  # both leases expire at this instant: a (seq 1, token 2) first
    expired = clock.now_ns()
    want = {a: expired + rng.randrange(2 * BASE + 1), b: expired + rng.randrange(BASE + 1)}
    got = {j: queue.get(j).run_at_ns for j in (a, b)}
    check(
        got == want,
        "expiries at one instant settle in (expires_at, seq) order — not by fencing token: a "
        "(seq 1, on its 2nd claim: token 2) draws its backoff before b (seq 2, token 1). "
        f"Expected retry times {[rel(want[a]), rel(want[b])]}, got {[rel(got[a]), rel(got[b])]}",
    )


@rule("expiry-order")
@core
def test_stage1_expiries_at_one_instant_settle_by_sequence_not_by_id() -> None:
    clock, queue = new_queue(jitter="full", max_attempts=5)
    ids = [queue.enqueue(n) for n in range(12)]  # seq 1..12; "job-10" sorts before "job-9"
    for _ in ids:
        claim(queue)
    clock.advance(LEASE)  # the twelve leases expire at this one instant
    rng = random.Random(SEED)
    want = [clock.now_ns() + rng.randrange(BASE + 1) for _ in ids]
    got = [queue.get(j).run_at_ns for j in ids]
    check(
        got == want,
        "expiries at one instant settle in (expires_at, seq) order — not by job id: twelve "
        "jobs enqueued and claimed at one instant expire together, and each draws its "
        "backoff in enqueue order, whatever order their ids sort in. Expected retry times "
        f"(in enqueue order) {[rel(w) for w in want]}, got {[rel(g) for g in got]}",
    )


@rule("settle-first")
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


@rule("next-due")
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
        f"next_due_ns is 700, got {rel(queue.next_due_ns())}"
    )
    clock.advance(400)
    assert claim(queue, "w").job_id == later
    assert queue.next_due_ns() == lease.expires_at_ns, (
        "with only leases out, next_due_ns is the earliest lease expiry (the job may "
        f"come back then): expected {lease.expires_at_ns - START}, got {rel(queue.next_due_ns())}"
    )


@rule("never-early", "claim-order")
@core
def test_stage1_a_run_at_in_the_past_is_that_time_even_zero() -> None:
    """``run_at_ns`` is an absolute clock time and None means now: 0 (or any past time)
    is a due time in the past, READY at once and ahead of a job due now."""
    _, queue = new_queue()
    now_job = queue.enqueue("due now")
    zero = queue.enqueue("due at 0", run_at_ns=0)
    earlier = queue.enqueue("due 5 ns ago", run_at_ns=START - 5)
    got = [queue.get(j).run_at_ns for j in (now_job, zero, earlier)]
    assert got == [START, 0, START - 5], (
        f"enqueue at {START}: run_at_ns None, 0 and {START - 5} are due at {START}, 0 and "
        f"{START - 5} (0 is a time, not 'unset'); the snapshots say {got}"
    )
    order = [claim(queue, "w").job_id for _ in range(3)]
    assert order == [zero, earlier, now_job], (
        f"equal priorities come out by due time: 0, then {START - 5}, then now; got "
        f"{[queue.get(j).payload for j in order]}"
    )


@rule("stale-changes-nothing", "lease-live")
@core
def test_stage1_a_lease_with_a_token_never_issued_is_stale() -> None:
    """Only the job's latest token is live: a token above it (a forged lease, one from
    another queue whose job ids collide) is refused like an older one."""
    _, queue = new_queue()
    job_id = queue.enqueue("a")
    lease = claim(queue, "w")
    forged = dataclasses.replace(lease, token=lease.token + 1)
    before = queue.get(job_id)
    for name, call in {
        "ack": lambda: queue.ack(forged, "forged"),
        "nack": lambda: queue.nack(forged, "forged"),
    }.items():
        rejects(StaleLease, call, f"{name} with token {forged.token} (issued: {lease.token})")
    assert queue.get(job_id) == before, "a refused lease changes nothing"
    queue.ack(lease, "done")  # the real lease is still live


@rule("bad-input", "failed-attempt")
@core
def test_stage1_an_empty_error_is_a_valid_error() -> None:
    _, queue = new_queue()
    job_id = queue.enqueue("a")
    with not_refused("nack(lease, ''): error is a str, and an empty one is a str"):
        queue.nack(claim(queue, "w"), "")
    job = queue.get(job_id)
    assert (job.state, job.last_error) == (SCHEDULED, ""), (
        f"nack(lease, '') fails the attempt like any error: SCHEDULED for its retry, "
        f"with the error '' recorded; got {job}"
    )


_LEASE, _JOB = object(), object()  # placeholders for the live lease and a job id


#: A call a queue must refuse: ``call(queue, live lease, job id)``.
BadCall = Callable[[JobQueue, Lease, str], Any]


def _bad_calls() -> list[Any]:
    """(what, call(queue, lease, job_id), exception, word the message must name, part)."""

    def ctor(**kw: Any) -> BadCall:
        def call(queue: JobQueue, lease: Lease, job_id: str) -> Any:
            args: dict[str, Any] = {
                "clock": ManualClock(START),
                "lease_ns": LEASE,
                "retry": RetryPolicy(BASE, CAP),
                "max_attempts": 3,
            }
            return stage().JobQueue(**{**args, **kw})

        return call

    def op(method: str, *args: Any, **kw: Any) -> BadCall:
        def call(queue: JobQueue, lease: Lease, job_id: str) -> Any:
            real = [lease if a is _LEASE else job_id if a is _JOB else a for a in args]
            return getattr(queue, method)(*real, **kw)

        return call

    both = (TypeError, ValueError)
    cases: list[tuple[str, BadCall, Any, str, Any]] = [
        ("lease_ns=0", ctor(lease_ns=0), ValueError, "lease_ns", core),
        ("lease_ns=-5", ctor(lease_ns=-5), ValueError, "lease_ns", core),
        ("lease_ns=1.5", ctor(lease_ns=1.5), TypeError, "lease_ns", core),
        ("lease_ns=True", ctor(lease_ns=True), TypeError, "lease_ns", core),
        ("max_attempts=0", ctor(max_attempts=0), ValueError, "max_attempts", core),
        ("max_attempts=True", ctor(max_attempts=True), TypeError, "max_attempts", core),
        ("retry=(1, 2)", ctor(retry=(1, 2)), TypeError, "retry", core),
        ("rng=7", ctor(rng=7), TypeError, "rng", core),
        ("dedup_ttl_ns=-1", ctor(dedup_ttl_ns=-1), ValueError, "dedup_ttl_ns", extended),
        ("retention_ns=-1", ctor(retention_ns=-1), ValueError, "retention_ns", extended),
        ("max_pending=0", ctor(max_pending=0), ValueError, "max_pending", extended),
        ("dedup_ttl_ns=False", ctor(dedup_ttl_ns=False), TypeError, "dedup_ttl_ns", extended),
        ("retention_ns=False", ctor(retention_ns=False), TypeError, "retention_ns", extended),
        ("max_pending=True", ctor(max_pending=True), TypeError, "max_pending", extended),
        ("priority='high'", op("enqueue", "x", priority="high"), TypeError, "priority", core),
        ("priority=True", op("enqueue", "x", priority=True), TypeError, "priority", core),
        ("priority=False", op("enqueue", "x", priority=False), TypeError, "priority", core),
        ("run_at_ns=1.0", op("enqueue", "x", run_at_ns=1.0), TypeError, "run_at_ns", core),
        ("run_at_ns=True", op("enqueue", "x", run_at_ns=True), TypeError, "run_at_ns", core),
        ("run_at_ns=False", op("enqueue", "x", run_at_ns=False), TypeError, "run_at_ns", core),
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


@rule("bad-input")
@pytest.mark.parametrize(("what", "call", "exc", "word"), _bad_calls())
def test_stage1_bad_input_raises_naming_the_parameter_and_changes_nothing(
    what: str, call: BadCall, exc: Any, word: str
) -> None:
    _, queue = new_queue()
    job_id = queue.enqueue("a")
    lease = claim(queue)
    before = queue.get(job_id)
    with pytest.raises(exc, match=word):
        call(queue, lease, job_id)
    after = queue.get(job_id)
    assert after == before, f"{what} raised but changed the job: {differences(before, after)}"
    assert queue.claim("w") is None, f"{what} must change nothing (no job created)"
    queue.ack(lease)  # the lease is still live


@rule("get-unknown", "lease-unknown-job")
@core
def test_stage1_unknown_job_raises_job_not_found() -> None:
    _, queue = new_queue()
    rejects(JobNotFound, lambda: queue.get("no-such-job"), "get of an unknown id")
    queue.enqueue("a")
    forged = Lease("no-such-job", 1, 1, START + LEASE, "w")
    rejects(JobNotFound, lambda: queue.ack(forged), "ack of a lease on an unknown job")
    assert issubclass(JobNotFound, LookupError)


@rule("decorrelated")
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
    check(
        got == want,
        f"decorrelated jitter draws rng.randrange(base, 3·prev + 1) with prev the "
        f"previous delay as applied, after the cap (base {base}, cap {cap}, "
        f"Random({seed})): expected delays {want}, got {got}"
        + (" — that is what an uncapped prev gives" if got == raw else ""),
    )


@rule("dead-at-max", "one-draw")
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
    check(
        (job.state, job.finished_at_ns) == (DEAD, died_at) and rng.getstate() == before,
        f"the failure ({how}) of attempt max_attempts=2 makes the job DEAD at "
        f"once ({rel(died_at)}) with no backoff drawn; got {job.state.value} at "
        f"{rel(job.finished_at_ns)}, rng "
        + ("untouched" if rng.getstate() == before else "drawn from"),
    )


@rule("one-draw", "backoff-formula", "decorrelated")
@core
@pytest.mark.parametrize("jitter", ["full", "equal", "decorrelated"])
def test_stage1_a_zero_delay_is_still_drawn_once(jitter: Jitter) -> None:
    """base_ns=0: the formula's range is [0, 0], yet the retry makes its one rng call, or
    every later delay of the seeded generator is off by one draw."""
    policy = RetryPolicy(0, 100, jitter)
    rng, twin = random.Random(SEED), random.Random(SEED)
    clock, queue = new_queue(jitter=jitter, base=0, cap=100, rng=rng)
    job_id = queue.enqueue("flaky")
    want = drawn_delays(policy, twin, [1, 2])
    got = []
    for _ in range(2):
        queue.nack(claim(queue), "503")
        got.append(queue.get(job_id).run_at_ns - clock.now_ns())
        clock.advance(got[-1])
    check(
        got == want and rng.getstate() == twin.getstate(),
        f"{policy}, rng=Random({SEED}): each jittered retry makes exactly one rng call, "
        f"even when its range is [0, 0] (d = 0); two nacks must draw twice: expected delays "
        f"{want}, got {got}, and the rng "
        + ("advanced by two draws" if rng.getstate() == twin.getstate() else "did not advance so"),
    )


def _call_at(method: str, queue: JobQueue, store: EffectStore | None, lease: Lease) -> Any:
    """``method`` of the queue (or, for "commit", of the store) on ``lease``."""
    if method == "commit":
        assert store is not None
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
        store = memory_store(queue) if method == "commit" else None
        job_id = queue.enqueue("x")
        lease = claim(queue)
        clock.set(lease.expires_at_ns + offset)  # straight to the call: nothing settled yet
        at = f"{method} at expires_at_ns {offset:+d}"
        if offset < 0:
            got = _call_at(method, queue, store, lease)
            check(
                method != "is_current" or got is True,
                f"{at}: the lease is live, is_current -> {got}",
            )
            continue
        if method == "is_current":
            got = _call_at(method, queue, store, lease)
            check(got is False, f"{at}: the lease has expired, is_current -> {got}")
        else:
            rejects(
                StaleLease,
                lambda: _call_at(method, queue, store, lease),  # noqa: B023 - called at once
                f"{at} was accepted",
            )
        job = queue.get(job_id)
        check(
            (job.state, job.attempts, job.last_error) == (SCHEDULED, 1, LEASE_EXPIRED),
            f"{at}: the lease expired at expires_at_ns, so the call settles the "
            f"expiry first (attempt counted, LEASE_EXPIRED, retry scheduled) and is refused; "
            f"the job is {job.state.value}, attempts {job.attempts}, last_error "
            f"{job.last_error!r}",
        )


@rule("lease-live", "stale-changes-nothing", "settle-first")
@core
def test_stage1_ack_and_nack_need_a_lease_live_until_1_ns_before_its_expiry() -> None:
    for method in ("ack", "nack"):
        live_until_its_expiry(method)


@rule("stale-changes-nothing", "release", "heartbeat-never-revives")
@extended
def test_stage1_heartbeat_and_release_with_a_superseded_token_are_rejected() -> None:
    queue, job_id, fresh = _superseded(
        lambda queue, zombie: {
            "heartbeat": lambda: queue.heartbeat(zombie),
            "release": lambda: queue.release(zombie),
        }
    )
    assert queue.is_current(fresh), f"w2's lease must still be live: {queue.get(job_id)}"


@rule("lease-live", "heartbeat-never-revives", "release", "is-current", "effect-fenced")
@extended
def test_stage1_heartbeat_release_is_current_and_commit_see_the_expiry_at_its_instant() -> None:
    for method in ("heartbeat", "release", "is_current", "commit"):
        live_until_its_expiry(method)


@rule("lease-unknown-job", "is-current", "effect-fenced", "retention")
@extended
def test_stage1_calls_on_a_job_forgotten_after_its_retention() -> None:
    clock, queue = new_queue(retention_ns=100)
    store = memory_store(queue)
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
    check(queue.is_current(stale) is False, "is_current of a forgotten job's lease must be False")
    rejects(
        StaleLease,
        lambda: store.commit(stale, "late effect"),
        "commit with a forgotten job's lease: a zombie must stop (StaleLease, not JobNotFound)",
    )
