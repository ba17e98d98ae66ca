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
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from katas._harness.story import Story, differences
from katas._harness.under_test import stage
from katas.job_scheduler._testing.clients import (
    Client,
    Op,
    client_for,
    workloads,
)
from katas.job_scheduler._testing.queues import (
    BASE,
    CANCELLED,
    CAP,
    DEAD,
    FINISHED,
    LEASE,
    LEASED,
    READY,
    SCHEDULED,
    SEED,
    START,
    SUCCEEDED,
    claim,
    delay_none,
    drawn_delays,
    fail_fast_on_stubs,  # noqa: F401 (autouse)
    held,
    new_queue,
    rejects,
    rel,
)
from katas.job_scheduler.api import (
    LEASE_EXPIRED,
    JobNotFound,
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
    story = Story("enqueue('flaky') with backoff 100·2^(n-1) capped at 1600:", clock.now_ns, START)
    for n in range(1, 7):  # 100, 200, 400, 800, 1600 (= the cap), then 1600 (capped)
        lease = queue.claim("w")
        if not (lease is not None and lease.attempt == n):
            raise AssertionError(
                story.tell(
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
                story.tell(
                    "after nack of attempt n the job waits min(cap, base·2^(n-1)) and keeps the "
                    "error",
                    f"expected SCHEDULED at now + {want}, got {job.state} at now + "
                    f"{job.run_at_ns - clock.now_ns()} (last_error {job.last_error!r})",
                )
            )
        clock.advance(want - 1)
        if queue.claim("w") is not None:
            raise AssertionError(
                story.tell(
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
            f"{fresh.token}) must raise StaleLease and change nothing: {differences(before, after)}"
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
        f"next_due_ns is 700, got {rel(queue.next_due_ns())}"
    )
    clock.advance(400)
    assert claim(queue, "w").job_id == later
    assert queue.next_due_ns() == lease.expires_at_ns, (
        "with only leases out, next_due_ns is the earliest lease expiry (the job may "
        f"come back then): expected {lease.expires_at_ns - START}, got {rel(queue.next_due_ns())}"
    )


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
    assert after == before, f"{what} raised but changed the job: {differences(before, after)}"
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
            f"once ({rel(died_at)}) with no backoff drawn; got {job.state.value} at "
            f"{rel(job.finished_at_ns)}, rng "
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
    story = Story("enqueue, claim:", clock.now_ns, START)
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
            story.tell(
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
                story.tell(
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
    story, failures = Story("max_attempts=3:", clock.now_ns, START), 0
    for claims, how in enumerate(pattern, start=1):
        clock.advance(2 * CAP)
        lease = queue.claim("w")
        if lease is None:
            break
        if not (lease.attempt == failures + 1 and lease.token == claims):
            raise AssertionError(
                story.tell(
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
            story.tell(
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
            client.story.tell(
                "cancel returns True exactly for unfinished jobs", f"{before.state}: {cancelled}"
            )
        )
    for lease in client.jobs[job_id].leases:
        rejects(
            StaleLease,
            lambda: queue.ack(lease, "late"),  # noqa: B023 - called at once
            client.story.tell("cancel stales every lease", f"ack of {lease} was accepted"),
        )
    clock.advance(20 * CAP)
    for _ in range(4 * len(client.jobs)):
        lease = queue.claim("w")
        if lease is None:
            break
        if not (lease.job_id != job_id):
            raise AssertionError(client.story.tell("a cancelled job is never claimed", ""))
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
    story, tokens, old = Story(f"max_attempts={max_attempts}:", clock.now_ns, START), [], []
    for how in rounds:
        clock.advance(2 * CAP)
        lease = queue.claim("w")
        if lease is None:
            if queue.redrive(job_id) is not True:
                raise AssertionError(story.tell("a DEAD job can be redriven", ""))
            story.add("redrive")
            lease = queue.claim("w")
            if not (lease is not None and lease.attempt == 1):
                raise AssertionError(
                    story.tell("a redriven job starts again at attempt 1", f"got {lease}")
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
            story.tell(
                "fencing tokens grow on every claim and never reset, not even on redrive",
                f"{tokens}",
            )
        )
    for lease in old:
        rejects(
            StaleLease,
            lambda: queue.ack(lease),  # noqa: B023 - called at once
            story.tell("every lease before the last is stale", f"ack of {lease} was accepted"),
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
    story = Story(f"dedup_ttl_ns={ttl}:", clock.now_ns, START)
    for key, gap in calls:
        clock.advance(gap)
        now = clock.now_ns()
        got = queue.enqueue(key, idempotency_key=key)
        story.add(f"advance({gap}), enqueue(key={key!r}) -> {got!r}")
        if key in first and now < first[key][1] + ttl:
            if not (got == first[key][0]):
                raise AssertionError(
                    story.tell(
                        "within its TTL (counted from the first enqueue) a key returns the first "
                        "id",
                        f"expected {first[key][0]!r}",
                    )
                )
        else:
            if not (got not in {v[0] for v in first.values()}):
                raise AssertionError(
                    story.tell(
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
                    client.story.tell(
                        f"a finished job is forgotten at finished_at + retention_ns ({retention})",
                        f"{job.id!r} finished at {rel(job.finished_at_ns)} is still held",
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
                    client.story.tell(
                        "a finished job is held until exactly finished_at + retention_ns",
                        f"{job_id!r} (finished at {rel(at)}) at t={rel(clock.now_ns())}",
                    )
                )
    clock.advance(retention + 10 * CAP + 10 * LEASE)
    stats = queue.statistics()
    if not (stats.succeeded + stats.dead + stats.cancelled == 0):
        raise AssertionError(
            client.story.tell(
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
    story = Story(
        "workers running jobs with crashes between claim, effect and ack:", clock.now_ns, START
    )
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
                    story.tell("a zombie commits no effect", f"{old} committed {effect!r}"),
                )
    effects = store.effects()
    if not (effects == {j: f"effect of {j}" for j in ids}):
        raise AssertionError(
            story.tell(
                "each job's effect is applied exactly once, by a live lease, whatever crashes",
                f"effects: {effects}",
            )
        )
    if not (all(queue.get(j).state is SUCCEEDED for j in ids)):
        raise AssertionError(
            story.tell("every job finishes", f"{[queue.get(j).state for j in ids]}")
        )
