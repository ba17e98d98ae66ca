"""Stage 1 suite, extended: heartbeats, release, cancel, dead letters and redrive,
idempotency keys, retention, ``max_pending``, statistics, ``is_current`` and the
``MemoryEffectStore`` — each by examples that read like the prompt, then by properties
over drawn runs (see katas/job_scheduler/README.md, "Stage 1").

The core examples are in ``test_stage1.py``; the exact model and its state machines in
``test_stage1_properties.py``. Time is a ``ManualClock``; a drawn workload runs through
the client of :mod:`katas.job_scheduler._testing.clients`, which knows from its own calls
what the queue must do.

Map: heartbeats (heartbeat, heartbeat-never-revives) · release (release; the backoff
counts attempts, not the claims a release or a redrive left behind: backoff-formula) · cancel
(cancel, cancel-finished) · dead letters and redrive (dead-letters, redrive,
redrive-keeps-token, decorrelated, unfinished-kept) · idempotency keys (idempotency,
dedup-ttl-from-first) · retention (retention, unfinished-kept; a death noticed by the
call that forgets it: settle-first) · bounds (max-pending, full-queue-dedups, cancel) · statistics
(statistics) · is_current (is-current) · the effect store (effect-once, effect-fenced).
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from katas._harness.marks import extended, rule
from katas._harness.story import Story, check
from katas.job_scheduler._testing.bounds import max_pending_walk
from katas.job_scheduler._testing.clients import (
    Client,
    Op,
    ran,
    workloads,
)
from katas.job_scheduler._testing.queues import (
    BASE,
    CAP,
    LEASE,
    SEED,
    START,
    claim,
    drawn_delays,
    due_claims,
    fail_fast_on_stubs,  # noqa: F401 (autouse)
    held,
    memory_store,
    new_queue,
    refusal,
    rejects,
    rel,
)
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
    LEASE_EXPIRED,
    Jitter,
    JobNotFound,
    JobQueue,
    Lease,
    QueueFull,
    QueueStatistics,
    RetryPolicy,
    StaleLease,
)

pytestmark = [pytest.mark.stage(1)]


@rule("heartbeat")
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


@rule("heartbeat-never-revives")
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
        story.check(
            got == want and (after.state is LEASED) == reclaimed,
            "the expiry stands: its attempt counted, its retry due at expires_at + backoff",
            f"(attempts, last_error, run_at_ns) expected {want}, got {got}; {after.state}",
        )
        return


@rule("release")
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
    assert (job.lease_expires_at_ns, job.worker_id) == (None, None), (
        f"a snapshot shows lease_expires_at_ns and worker_id only while LEASED: the "
        f"released job is READY, got {job}"
    )
    rejects(StaleLease, lambda: queue.ack(lease), "ack of a released lease was accepted")
    again = queue.claim("w")
    assert again is not None and (again.job_id, again.attempt, again.token) == (first, 1, 2), (
        f"the released job keeps its place before {second!r}; its next claim is "
        f"attempt 1 again (max_attempts=1 is not used up) with token 2; got {again}"
    )


@rule("release")
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
        story.check(
            lease.attempt == failures + 1 and lease.token == claims,
            "a release refunds its attempt; tokens still grow on every claim",
            f"after {failures} failures and {claims - 1} claims got {lease}",
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
    story.check(
        (state is DEAD) == (failures >= 3),
        "a job dies after max_attempts failures; releases do not count",
        f"{failures} failures, state {state}",
    )


#: Claims between two failures: ``release`` hands a claim back, ``fail`` fails it (the
#: attempt counted), ``redrive`` brings the DEAD job back. Tokens run ahead of attempts.
_CLAIMS_AHEAD = ["release", "fail", "release", "release", "fail", "fail", "redrive"]
_CLAIMS_AHEAD += ["release", "fail", "release", "fail"]


@rule("backoff-formula", "release", "redrive")
@extended
@pytest.mark.parametrize("fails_by", ["nack", "expiry"])
@pytest.mark.parametrize("jitter", ["none", "full", "equal"])
def test_stage1_backoff_counts_the_failed_attempt_not_the_claims(
    jitter: Jitter, fails_by: str
) -> None:
    """``n`` in the backoff is the attempt that failed: a release refunds its attempt and
    a redrive zeroes them, while the fencing token counts every claim. Each failure (a
    nack, or an expiry noticed at its instant) is due at its time + the delay drawn for
    its attempt, never for its token."""
    policy = RetryPolicy(BASE, CAP, jitter)
    clock, queue = new_queue(jitter=jitter, max_attempts=3)
    job_id, twin = queue.enqueue("x"), random.Random(SEED)
    story = Story(f"{policy}, max_attempts=3, rng=Random({SEED}):", clock.now_ns, START)
    attempt = claims = 0
    for step in _CLAIMS_AHEAD:
        if step == "redrive":
            story.check(queue.redrive(job_id) is True, "a DEAD job can be redriven", "")
            story.add("redrive")
            attempt = 0
            continue
        clock.set(max(clock.now_ns(), queue.next_due_ns() or clock.now_ns()))
        lease, claims, attempt = claim(queue), claims + 1, attempt + 1
        story.check(
            (lease.attempt, lease.token) == (attempt, claims),
            "a claim counts an attempt (refunded by a release, zeroed by a redrive) and "
            "issues the next token",
            f"expected attempt {attempt}, token {claims}; got {lease}",
        )
        if step == "release":
            queue.release(lease)
            story.add(f"claim -> attempt {attempt}, token {claims}; release")
            attempt -= 1
            continue
        if fails_by == "nack":
            clock.advance(7)
            queue.nack(lease, "boom")
        else:
            clock.set(lease.expires_at_ns)
        failed_at = clock.now_ns()
        job = queue.get(job_id)
        story.add(f"claim -> attempt {attempt}, token {claims}; {fails_by}")
        if attempt == 3:
            story.check(job.state is DEAD, "the last attempt's failure is DEAD", f"{job}")
            continue
        delay = drawn_delays(policy, twin, [attempt])[0]
        want = (SCHEDULED if delay else READY, failed_at + delay)
        story.check(
            (job.state, job.run_at_ns) == want,
            f"the backoff after failed attempt n is drawn from min(cap, base·2^(n-1)), n = "
            f"{attempt} here (the token, {claims}, counts claims, not attempts)",
            f"expected due at failure + {delay}, got {job.state} due at failure + "
            f"{job.run_at_ns - failed_at}",
        )


@rule("cancel", "cancel-finished")
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


@rule("cancel", "next-due", "never-early")
@extended
def test_stage1_many_cancelled_scheduled_jobs_leave_the_others_on_time() -> None:
    """Two hundred SCHEDULED jobs, most cancelled: next_due_ns skips the cancelled ones,
    and every job kept becomes READY at its run_at_ns, however many cancels came first."""
    clock, queue = new_queue()
    jobs = [queue.enqueue(f"job-{i}", run_at_ns=START + 100 + i) for i in range(200)]
    kept = jobs[150:]
    for job_id in jobs[:150]:
        queue.cancel(job_id)
    check(
        queue.next_due_ns() == START + 250,
        f"200 jobs due at 100, 101, … 299, the first 150 cancelled: next_due_ns is the "
        f"earliest run time of a job still SCHEDULED, 250; got {rel(queue.next_due_ns())}",
    )
    clock.advance(299)
    got = [lease.job_id for lease in iter(lambda: queue.claim("w"), None)]
    check(
        got == kept,
        f"at 299 every kept job is due: all 50 come out, by due time; got {len(got)} "
        f"of them ({[queue.get(j).payload for j in got[:3]]}…)",
    )


@rule("cancel", "cancel-finished")
@extended
@given(ops=workloads(max_size=30), victim=st.integers(0, 30), seed=st.integers(0, 9))
def test_stage1_cancel_at_any_point_stales_every_lease_and_ends_the_job(
    ops: list[Op], victim: int, seed: int
) -> None:
    client = ran(ops)
    queue, clock = client.queue, client.clock
    if not client.jobs:
        return
    job_id = list(client.jobs)[victim % len(client.jobs)]
    before = queue.get(job_id)
    cancelled = queue.cancel(job_id)
    client.story.add(f"cancel({job_id!r}) -> {cancelled}")
    client.story.check(
        cancelled == (before.state not in FINISHED),
        "cancel returns True exactly for unfinished jobs",
        f"{before.state}: {cancelled}",
    )
    for old in client.jobs[job_id].leases:
        rejects(
            StaleLease,
            lambda: queue.ack(old, "late"),  # noqa: B023 - called at once
            client.story.tell("cancel stales every lease", f"ack of {old} was accepted"),
        )
    clock.advance(20 * CAP)
    for _ in range(4 * len(client.jobs)):
        lease = queue.claim("w")
        if lease is None:
            break
        client.story.check(lease.job_id != job_id, "a cancelled job is never claimed", "")
        queue.ack(lease)
    assert queue.get(job_id).state is (CANCELLED if cancelled else before.state)


@rule("dead-letters", "redrive", "redrive-keeps-token")
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


@rule("redrive", "redrive-keeps-token")
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
            story.check(queue.redrive(job_id) is True, "a DEAD job can be redriven", "")
            story.add("redrive")
            lease = queue.claim("w")
            assert lease is not None and lease.attempt == 1, story.tell(
                "a redriven job starts again at attempt 1", f"got {lease}"
            )
        tokens.append(lease.token)
        old.append(lease)
        if how == "nack":
            queue.nack(lease, "x")
        else:
            clock.advance(LEASE)
        story.add(f"claim -> token {lease.token}, attempt {lease.attempt}; {how}")
    story.check(
        tokens == sorted(set(tokens)),
        "fencing tokens grow on every claim and never reset, not even on redrive",
        f"{tokens}",
    )
    for lease in old:
        rejects(
            StaleLease,
            lambda: queue.ack(lease),  # noqa: B023 - called at once
            story.tell("every lease before the last is stale", f"ack of {lease} was accepted"),
        )


@rule("dead-letters", "redrive")
@extended
def test_stage1_a_job_that_dies_again_after_a_redrive_is_listed_at_its_latest_death() -> None:
    clock, queue = new_queue(max_attempts=1)
    a, b = queue.enqueue("a"), queue.enqueue("b")
    story = Story("max_attempts=1:", clock.now_ns, START)
    queue.nack(claim(queue), "a broke")
    clock.advance(10)
    queue.nack(claim(queue), "b broke")
    story.add("a dies (nack), then b dies (nack)")
    clock.advance(10)
    assert queue.redrive(a) is True
    queue.nack(claim(queue), "a broke again")
    story.add("redrive(a), claim -> a, nack: a dies again")
    story.expect(
        [(j.id, j.finished_at_ns) for j in queue.dead_letters()],
        [(b, START + 10), (a, START + 20)],
        "dead_letters() lists the DEAD jobs in the order they died, a job redriven and "
        "dead again at its latest death: [b, a]",
    )


@rule("redrive", "decorrelated")
@extended
def test_stage1_redrive_starts_decorrelated_jitter_again_from_base() -> None:
    base, cap, seed = 100, 100_000, SEED
    policy = RetryPolicy(base, cap, "decorrelated")
    clock, queue = new_queue(jitter="decorrelated", base=base, cap=cap, max_attempts=4)
    job_id = queue.enqueue("flaky")
    twin = random.Random(seed)
    grown = drawn_delays(policy, twin, [1, 2, 3])  # the 4th failure dies: no draw
    want = drawn_delays(policy, twin, [1])[0]  # after the redrive: prev is base again
    story = Story(f"{policy}, max_attempts=4, rng=Random({seed}):", clock.now_ns, START)
    for n in range(1, 5):
        queue.nack(claim(queue), "503")
        story.add(f"claim, nack attempt {n}")
        if n < 4:
            clock.advance(queue.get(job_id).run_at_ns - clock.now_ns())
    story.add(f"the job is DEAD; its delays grew {grown}")
    assert queue.redrive(job_id) is True
    queue.nack(claim(queue), "503")
    story.add("redrive, claim, nack attempt 1")
    got = queue.get(job_id).run_at_ns - clock.now_ns()
    story.check(
        got == want,
        "redrive puts the decorrelated jitter's prev back to base_ns: the first retry after it "
        f"draws rng.randrange(base, 3·base + 1), within [{base}, {3 * base}]",
        f"expected a delay of {want}, got {got}"
        + (" — drawn from the delays before the death" if got > 3 * base else ""),
    )


@rule("redrive", "unfinished-kept", "retention")
@extended
def test_stage1_a_redriven_job_is_kept_past_its_old_retention() -> None:
    clock, queue = new_queue(retention_ns=500, max_attempts=1)
    job_id = queue.enqueue("x")
    queue.nack(claim(queue), "boom")  # DEAD at 0: forgotten at 500, unless redriven
    clock.advance(200)
    assert queue.redrive(job_id) is True
    clock.advance(300)  # the old death's finished_at + retention_ns
    job = held(queue, job_id)
    check(
        job is not None and job.state is READY,
        "a redriven job is unfinished again, and unfinished jobs are never forgotten: at "
        f"its old death + retention_ns it must still be READY; got {job}",
    )
    clock.advance(100)
    queue.nack(claim(queue), "boom again")  # DEAD again at 600: forgotten at 1100
    clock.advance(499)
    check(
        held(queue, job_id) is not None,
        "a job that dies again after a redrive is kept for retention_ns from its latest "
        "death (600): at 1099 it was already forgotten",
    )
    clock.advance(1)
    rejects(JobNotFound, lambda: queue.get(job_id), "the job at its latest death + retention_ns")


@rule("redrive", "retention")
@extended
@pytest.mark.parametrize("finish", ["nack", "ack"])
def test_stage1_a_job_redriven_and_finished_again_before_its_old_retention_ended(
    finish: str,
) -> None:
    clock, queue = new_queue(retention_ns=500, max_attempts=1)
    job_id = queue.enqueue("x")
    queue.nack(claim(queue), "boom")  # DEAD at 0: its retention would end at 500
    clock.advance(100)
    assert queue.redrive(job_id) is True
    clock.advance(100)
    lease = claim(queue)
    queue.nack(lease, "boom again") if finish == "nack" else queue.ack(lease)  # at 200
    state = queue.get(job_id).state
    clock.advance(300)  # 500: the first death's retention would end now
    check(
        held(queue, job_id) is not None,
        f"steps: the job dies at 0 (retention_ns=500), is redriven at 100 and finishes "
        f"again at 200 ({finish}: {state.name}). Its retention counts from its latest "
        f"finish, so it is held until 700; at 500 (the first death + 500) it was forgotten",
    )
    clock.advance(199)
    check(held(queue, job_id) is not None, "the job must still be held at 699")
    clock.advance(1)
    rejects(JobNotFound, lambda: queue.get(job_id), "the job at its latest finish + retention_ns")


@rule("idempotency", "dedup-ttl-from-first")
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


@rule("idempotency", "dedup-ttl-from-first", "bad-input")
@extended
def test_stage1_a_key_counts_from_its_first_enqueue_and_never_skips_validation() -> None:
    """The TTL runs from the first enqueue, whenever its job is due; a retried enqueue is
    still validated whole: a bad priority or run_at_ns raises even for a known key."""
    clock, queue = new_queue(dedup_ttl_ns=500)
    first = queue.enqueue("later", run_at_ns=START + 2_000, idempotency_key="k")
    past = queue.enqueue("past", run_at_ns=START - 1_000, idempotency_key="p")
    bad_values = ({"priority": "high"}, {"priority": True}, {"run_at_ns": 1.5})
    for bad in (*bad_values, {"run_at_ns": True}, {"run_at_ns": False}):
        word = next(iter(bad))
        with pytest.raises(TypeError, match=word):
            queue.enqueue("again", idempotency_key="k", **bad)
            raise AssertionError(f"enqueue(idempotency_key='k', {bad}) was accepted")
    clock.advance(499)
    check(
        queue.enqueue("again", idempotency_key="p") == past,
        "a key whose job was due 1 000 ns before it was enqueued still dedups 499 ns "
        "after its first enqueue: the TTL counts from the enqueue, not from the due time",
    )
    clock.advance(1)
    fresh = queue.enqueue("again", idempotency_key="k")
    check(
        fresh != first,
        "enqueued at 0 with run_at_ns 2 000 and dedup_ttl_ns 500: at 500 the key is "
        "forgotten (the TTL counts from the first enqueue, not from when the job is due), "
        f"so a new job is created; got the first id {first!r}",
    )


@rule("idempotency", "dedup-ttl-from-first")
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
            story.check(
                got == first[key][0],
                "within its TTL (counted from the first enqueue) a key returns the first id",
                f"expected {first[key][0]!r}",
            )
        else:
            story.check(
                got not in {v[0] for v in first.values()},
                "a key past its TTL (or new) creates a new job",
                f"got an old id {got!r}",
            )
            first[key] = (got, now)


@rule("retention", "unfinished-kept")
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


@rule("retention", "unfinished-kept")
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

    def judge() -> None:
        now = clock.now_ns()
        for seen in client.jobs.values():
            job = held(queue, seen.id)
            if job is None:
                continue
            client.story.check(
                job.finished_at_ns is None or now < job.finished_at_ns + retention,
                f"a finished job is forgotten at finished_at + retention_ns ({retention})",
                f"{job.id!r} finished at {rel(job.finished_at_ns)} is still held",
            )
            client_state, _ = client.state(seen, now)
            assert job.state is client_state or client_state in FINISHED

    client.run(ops, judge)
    finished_at: dict[str, int] = {}
    for seen in client.jobs.values():
        job = held(queue, seen.id)
        if job is not None and job.finished_at_ns is not None:
            finished_at[seen.id] = job.finished_at_ns
    if finished_at:
        clock.set(max(finished_at.values()) + retention - 1)
        for job_id, at in finished_at.items():
            client.story.check(
                (held(queue, job_id) is None) == (at + retention <= clock.now_ns()),
                "a finished job is held until exactly finished_at + retention_ns",
                f"{job_id!r} (finished at {rel(at)}) at t={rel(clock.now_ns())}",
            )
    clock.advance(retention + 10 * CAP + 10 * LEASE)
    stats = queue.statistics()
    client.story.check(
        stats.succeeded + stats.dead + stats.cancelled == 0,
        "memory is bounded by recent work: every finished job is forgotten in time",
        f"{stats}",
    )


#: What each call shows of a job forgotten after its retention: the call, and whether it
#: tells that the job is gone.
FORGOTTEN_SEEN_BY: dict[str, Callable[[JobQueue, str], bool]] = {
    "get": lambda q, j: refusal(JobNotFound, lambda: q.get(j)) is True,
    "cancel": lambda q, j: refusal(JobNotFound, lambda: q.cancel(j)) is True,
    "redrive": lambda q, j: refusal(JobNotFound, lambda: q.redrive(j)) is True,
    "dead_letters": lambda q, j: q.dead_letters() == [],
    "statistics": lambda q, j: q.statistics().dead == 0,
}


@rule("settle-first", "retention", "dead-at-max")
@extended
@pytest.mark.parametrize("call", sorted(FORGOTTEN_SEEN_BY))
def test_stage1_a_job_dead_by_expiry_is_forgotten_by_the_first_call_past_its_retention(
    call: str,
) -> None:
    """Nobody calls between the claim and expiry + retention_ns: that one call must settle
    the expiry (the job dies at the expiry instant), then forget what is past its time."""
    for offset in (-1, 0):
        clock, queue = new_queue(retention_ns=500, max_attempts=1)
        job_id = queue.enqueue("crashes")
        lease = claim(queue)
        clock.set(lease.expires_at_ns + 500 + offset)
        gone = FORGOTTEN_SEEN_BY[call](queue, job_id)
        check(
            gone == (offset == 0),
            f"max_attempts=1, retention_ns=500: the job's only lease expires at "
            f"{rel(lease.expires_at_ns)}, so it is DEAD from then and forgotten at "
            f"{rel(lease.expires_at_ns + 500)}. With no call in between, {call}() at "
            f"{rel(clock.now_ns())} — the first call since the claim — "
            + (
                "must still see it"
                if offset < 0
                else "must not see it: every call settles expiries first, then forgets "
                "what is past its retention"
            ),
        )


@rule("max-pending", "full-queue-dedups")
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


@rule("max-pending", "cancel", "full-queue-dedups")
@extended
def test_stage1_max_pending_counts_exactly_the_unfinished_jobs() -> None:
    clock, queue = new_queue(max_pending=1, max_attempts=1)
    max_pending_walk(queue, clock.now_ns, clock.advance, LEASE)


@rule("statistics")
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


@rule("is-current")
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


@rule("effect-once", "effect-fenced")
@extended
def test_stage1_effect_store_applies_each_effect_once_despite_crashes_and_zombies() -> None:
    clock, queue = new_queue(max_attempts=5)
    store = memory_store(queue)
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


@rule("effect-once", "effect-fenced")
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
    store = memory_store(queue)
    ids = [queue.enqueue(i) for i in range(len(plans))]
    turn = dict.fromkeys(ids, 0)
    zombies: list[tuple[Lease, str]] = []
    story = Story(
        "workers running jobs with crashes between claim, effect and ack:", clock.now_ns, START
    )
    for _, lease in due_claims(queue, clock, "w", 8 * len(plans) * 6):
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
    story.check(
        effects == {j: f"effect of {j}" for j in ids},
        "each job's effect is applied exactly once, by a live lease, whatever crashes",
        f"effects: {effects}",
    )
    story.check(
        all(queue.get(j).state is SUCCEEDED for j in ids),
        "every job finishes",
        f"{[queue.get(j).state for j in ids]}",
    )
