"""Stage 3 suite, the queue on Redis, extended: heartbeats, jitter, release, cancel, dead
letters and redrive, idempotency keys, retention by TTL, the reaper, and outages (see
katas/job_scheduler/README.md, "Stage 3").

Runs on fakeredis by default, like the rest of the stage (see ``test_stage3.py``, whose
state machines replay these calls too through the exact model); tests marked
``redis_faults`` flush scripts and restart a server, those marked ``realtime`` wait for
server time to pass on a real server.

Map: heartbeats (redis-extended, redis-settle-first) · jitter (redis-jitter) · release
(its old due time and place in line), cancel, dead letters and redrive — of a job not
DEAD on a full queue too (redis-extended, redis-order, redis-jitter, ttl-retention) ·
idempotency keys (redis-dedup-ttl, redis-idempotency) · racing workers (one-script,
redis-attempts) · max_pending, jobs noticed late, a death by expiry (redis-extended,
redis-order, redis-backoff, redis-settle-first) · retention by TTL and bounded memory
idle and busy (ttl-retention, key-prefix, bounded-memory) · the reaper (reap) ·
scripts and outages, every refusal on every call (scripts-reload, outage-raises,
busy-unavailable, one-script, worker-outage, fault-lost-reply).
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import redis

from katas._harness.marks import core, extended, rule
from katas._harness.redis import RedisEnv
from katas._harness.story import check, expect, not_refused
from katas._harness.waiting import eventually
from katas.job_scheduler._testing.bounds import max_pending_walk
from katas.job_scheduler._testing.cluster import SCRIPT_COMMANDS, every_call
from katas.job_scheduler._testing.fleets import in_process_worker, run_in_thread
from katas.job_scheduler._testing.queues import rejects
from katas.job_scheduler._testing.redis_queues import (
    MS,
    claim,
    finish,
    key_sizes,
    new_queue,
    race,
    stamp,
    text,
)
from katas.job_scheduler._testing.states import CANCELLED, LEASED, READY, SUCCEEDED
from katas.job_scheduler.api import (
    LEASE_EXPIRED,
    JobNotFound,
    JobState,
    Lease,
    QueueFull,
    QueueStatistics,
    RetryPolicy,
    SharedJobQueue,
    StaleLease,
    unavailable,
)

pytestmark = [pytest.mark.stage(3)]


@rule("redis-extended", "redis-settle-first")
@extended
@pytest.mark.realtime
def test_stage3_heartbeat_extends_a_live_lease_and_never_revives_an_expired_one(
    redis_env: RedisEnv,
) -> None:
    redis_env.freeze_time()
    queue = new_queue(redis_env, lease_ns=100 * MS)
    job_id = queue.enqueue("long")
    lease = claim(queue)
    redis_env.pass_time(60 * MS)
    beat = queue.heartbeat(lease)
    assert beat.expires_at_ns == stamp(queue, "heartbeat").server_now_ns + 100 * MS, (
        f"a heartbeat extends the lease to the server's now + lease_ns; got {beat}"
    )
    expect(
        queue.get(job_id).lease_expires_at_ns,
        beat.expires_at_ns,
        "get() after a heartbeat: the snapshot's lease_expires_at_ns is the live lease's, "
        "the one the heartbeat returned",
    )
    redis_env.pass_time(60 * MS)  # past the first expiry, within the extended one
    assert queue.get(job_id).state is LEASED, "the heartbeaten lease expired early"
    redis_env.pass_time(100 * MS)
    with pytest.raises(StaleLease):
        queue.heartbeat(beat)
        raise AssertionError("a heartbeat revived an expired lease")
    job = queue.get(job_id)
    assert (job.state, job.last_error, job.attempts) == (READY, LEASE_EXPIRED, 1), (
        f"the expiry must have been applied (attempt counted, error {LEASE_EXPIRED!r})"
        f" before the heartbeat was refused; got {job}"
    )


def retry_delays(
    redis_env: RedisEnv,
    policy: RetryPolicy,
    jobs: int,
    failures: int,
    *,
    seed: int = 3,
    noisy: bool = False,
) -> list[tuple[str, int, int]]:
    """``(job id, attempt, delay)`` of every retry, in the order they were drawn: ``jobs``
    jobs on a fresh queue (``rng`` seeded ``seed``), each nacked at its first ``failures``
    attempts and acked at the next; ``noisy``: a read, the statistics, next_due_ns and a
    refused (stale) nack before each failure."""
    queue = new_queue(
        redis_env, prefix=redis_env.fresh_prefix(), retry=policy, max_attempts=failures + 1,
        rng=random.Random(seed),
    )  # fmt: skip
    for n in range(jobs):
        queue.enqueue(n)
    out: list[tuple[str, int, int]] = []
    while len(out) < jobs * failures:
        lease = queue.claim("w")
        if lease is None:  # the retries are not due yet
            redis_env.pass_time(policy.cap_ns)
            continue
        if lease.attempt > failures:  # measured enough (another job is behind)
            queue.ack(lease)
            continue
        if noisy:
            queue.get(lease.job_id), queue.statistics(), queue.next_due_ns()
            with pytest.raises(StaleLease):
                queue.nack(replace(lease, token=lease.token + 1), "stale")
        queue.nack(lease, "503")
        failed_at = stamp(queue, "nack").server_now_ns
        out.append((lease.job_id, lease.attempt, queue.get(lease.job_id).run_at_ns - failed_at))
    return out


@rule("redis-jitter")
@extended
@pytest.mark.realtime
@pytest.mark.parametrize("jitter", ["none", "full", "equal", "decorrelated"])
def test_stage3_backoff_follows_the_formula_for_each_jitter_mode(
    redis_env: RedisEnv, jitter: str
) -> None:
    """Jitter is drawn from the injected rng (expanded in the script): every delay within
    the formula's bounds, spread out, and the same again for the same seed."""
    redis_env.freeze_time()
    base, cap = 10 * MS, 60 * MS
    policy = RetryPolicy(base, cap, jitter)  # type: ignore[arg-type]

    def delays(seed: int, noisy: bool = False) -> list[tuple[str, int, int]]:
        """12 jobs failing twice each; ``noisy``: reads and refused calls in between."""
        return retry_delays(redis_env, policy, 12, 2, seed=seed, noisy=noisy)

    seen = delays(seed=7)
    prev: dict[str, int] = {}
    for job_id, attempt, delay in seen:
        d = min(cap, base * 2 ** (attempt - 1))
        low, high = {
            "none": (d, d), "full": (0, d), "equal": (d // 2, d),
            "decorrelated": (base, min(cap, 3 * prev.get(job_id, base))),
        }[jitter]  # fmt: skip
        assert low <= delay <= high, (
            f"{jitter} jitter, base {base}, cap {cap}: the retry of {job_id} after "
            f"attempt {attempt} must wait within [{low}, {high}] ns; it waited {delay}"
        )
        prev[job_id] = delay
    if jitter != "none":
        firsts = {delay for _, attempt, delay in seen if attempt == 1}
        assert len(firsts) >= 4, (
            f"{jitter} jitter: 12 first retries waited only {sorted(firsts)} — the "
            f"jitter is not drawn (12 jobs failing together retry together: a thundering herd)"
        )
    if redis_env.time_is_controlled:  # on a real server the order of claims varies

        def shape(run: list[tuple[str, int, int]]) -> list[tuple[int, int, int]]:
            """Each job by its order of first claim: the twin queue's ids are its own."""
            order: dict[str, int] = {}
            return [(order.setdefault(job, len(order)), a, d) for job, a, d in run]

        again = delays(seed=7)
        assert shape(again) == shape(seen), (
            f"{jitter} jitter: the same calls with rng Random(7) must give the same "
            f"delays: the randomness comes from the injected rng.\n  first:  {seen}\n  "
            f"second: {again}"
        )
        noisy = delays(seed=7, noisy=True)
        pairs = zip(shape(seen), shape(noisy), strict=False)
        first = next((i for i, (a, b) in enumerate(pairs) if a != b), 0)
        assert shape(noisy) == shape(seen), (
            f"{jitter} jitter: the same failures with rng Random(7), with a get(), "
            f"statistics(), next_due_ns() and a refused (stale) nack before each, must give "
            f"the same delays: only a retry draws (stage 1's one-draw rule). Failure "
            f"#{first + 1} (job, attempt, delay ns): expected {shape(seen)[first]}, "
            f"got {shape(noisy)[first]}"
        )


@rule("redis-extended")
@extended
def test_stage3_release_refunds_the_attempt_and_keeps_the_place_in_line(
    redis_env: RedisEnv,
) -> None:
    redis_env.freeze_time()
    queue = new_queue(redis_env)
    first, second = queue.enqueue("first"), queue.enqueue("second")
    lease = claim(queue)
    queue.release(lease)
    again = claim(queue)
    assert (again.job_id, again.attempt, again.token) == (first, 1, 2), (
        f"a released job is READY again in its old place with its attempt refunded "
        f"(and a new token); expected {first!r} attempt 1 token 2, got {again}"
    )
    assert claim(queue).job_id == second


@rule("redis-stale", "redis-fenced", "redis-extended")
@extended
@pytest.mark.realtime
@pytest.mark.parametrize("then", ["expired", "reclaimed"])
def test_stage3_every_call_on_a_stale_lease_is_refused_and_writes_nothing(
    redis_env: RedisEnv, then: str
) -> None:
    """A zombie's lease expired (``expired``), and the job was then claimed by w2
    (``reclaimed``): its heartbeat, release, ack and nack each raise StaleLease, and the
    job — and w2's lease — are exactly as they were."""
    redis_env.freeze_time()
    queue = new_queue(redis_env, lease_ns=100 * MS)
    job_id = queue.enqueue("work")
    zombie = claim(queue, "w1")
    redis_env.pass_time(100 * MS)  # the zombie's lease ends: at its expiry, not live
    live = claim(queue, "w2") if then == "reclaimed" else None
    story = "w1 claimed the job; its lease expired" + (", then w2 claimed it" * bool(live))
    before = queue.get(job_id)
    calls: list[tuple[str, Callable[[], object]]] = [
        ("heartbeat(zombie)", lambda: queue.heartbeat(zombie)),
        ("release(zombie)", lambda: queue.release(zombie)),
        ("ack(zombie)", lambda: queue.ack(zombie, "late")),
        ("nack(zombie)", lambda: queue.nack(zombie, "late")),
    ]
    for name, call in calls:
        with pytest.raises(StaleLease):
            call()
            raise AssertionError(f"{story}: {name} was accepted, it must raise StaleLease")
        check(
            queue.get(job_id) == before and (live is None or queue.is_current(live)),
            f"{story}: {name} raised StaleLease, and a refused call writes nothing — "
            f"expected the job as it was, {before}, got {queue.get(job_id)}"
            + (f"; w2's lease current: {queue.is_current(live)}" if live else ""),
        )


@rule("redis-extended", "redis-order")
@extended
def test_stage3_a_job_released_after_others_fell_due_keeps_its_due_time_and_place(
    redis_env: RedisEnv,
) -> None:
    """One priority, due times in the server's past: "later" (enqueued first, due 1 s ago),
    "early" and "twin" (both due 2 s ago, in that enqueue order). "early" is claimed and
    released now, after all three fell due: it is back at its old due time, ahead of
    both — not at the release's now, and not with a new sequence number."""
    redis_env.freeze_time()
    queue = new_queue(redis_env)
    now = _server_ns(redis_env)
    later = queue.enqueue("later", run_at_ns=now - 1000 * MS)
    early = queue.enqueue("early", run_at_ns=now - 2000 * MS)
    twin = queue.enqueue("twin", run_at_ns=now - 2000 * MS)
    before = queue.get(early)
    lease = claim(queue)
    assert lease.job_id == early, f"claim() leased {lease.job_id}, expected {early}"
    queue.release(lease)
    released_at = stamp(queue, "release").server_now_ns
    job = queue.get(early)
    assert (job.state, job.run_at_ns, job.seq) == (READY, before.run_at_ns, before.seq), (
        f"release (redis-extended): the job is READY again at its old due time, with its "
        f"sequence number; expected READY, run_at_ns {before.run_at_ns}, seq {before.seq}; "
        f"got {job.state}, run_at_ns {job.run_at_ns}, seq {job.seq} (released at "
        f"{released_at})"
    )
    names = {later: "later", early: "early", twin: "twin"}
    got = [claim(queue) for _ in names]
    order = [names.get(other.job_id, other.job_id) for other in got]
    assert order == ["early", "twin", "later"], (
        f"release (redis-extended): a released job keeps its old place in line (its due "
        f"time, then its enqueue order), however long the others have been due; expected "
        f"claims ['early', 'twin', 'later'], got {order}"
    )
    assert (got[0].attempt, got[0].token) == (1, 2), (
        f"release refunds the attempt and keeps the token issued: expected attempt 1, "
        f"token 2; got {got[0]}"
    )


@rule("redis-settle-first", "redis-extended", "redis-order")
@extended
@pytest.mark.realtime
def test_stage3_twelve_leases_expiring_at_one_instant_settle_in_sequence_order(
    redis_env: RedisEnv,
) -> None:
    """Twelve jobs claimed at one frozen server instant expire together, each at its last
    attempt: they die in (expires_at, seq) order — job 10 after job 9 — and the dead
    letters list them in that order of death."""
    redis_env.freeze_time()
    queue = new_queue(redis_env, lease_ns=100 * MS, max_attempts=1)
    ids = [queue.enqueue(n) for n in range(12)]
    for _ in ids:
        claim(queue)
    redis_env.pass_time(100 * MS)
    expect(queue.reap(), 12, "the twelve leases expire at this one instant: reap() expires 12")
    expect(
        [job.id for job in queue.dead_letters()],
        ids,
        "twelve jobs enqueued and claimed at one server instant, max_attempts=1, expire "
        "together: the settle applies expiries in (expires_at, seq) order, so they die — "
        "and are dead letters — in enqueue order, the tenth after the ninth (a sequence "
        "number is never compared as text)",
    )


@rule("redis-extended")
@extended
def test_stage3_cancel_stales_the_lease_and_the_job_stays_cancelled(
    redis_env: RedisEnv,
) -> None:
    redis_env.freeze_time()
    queue = new_queue(redis_env)
    leased, waiting = queue.enqueue("leased"), queue.enqueue("waiting", delay_ns=10**12)
    lease = claim(queue)
    assert queue.cancel(leased) is True and queue.cancel(waiting) is True
    assert queue.cancel(leased) is False, "cancelling a finished job returns False"
    with pytest.raises(StaleLease):
        queue.ack(lease)
        raise AssertionError("ack of a cancelled job's lease turned it SUCCEEDED")
    assert [queue.get(j).state for j in (leased, waiting)] == [CANCELLED, CANCELLED]
    assert queue.claim("w") is None and queue.next_due_ns() is None


@rule("redis-extended")
@extended
@pytest.mark.realtime
def test_stage3_dead_letters_in_order_of_death_and_redrive_keeps_tokens_growing(
    redis_env: RedisEnv,
) -> None:
    redis_env.freeze_time()
    queue = new_queue(redis_env, max_attempts=1)
    a, b = queue.enqueue("a"), queue.enqueue("b")
    la, lb = claim(queue), claim(queue)
    queue.nack(lb, "b failed")
    queue.nack(la, "a failed")
    dead = [job.id for job in queue.dead_letters()]
    assert dead == [b, a], f"dead letters in the order they died: {[b, a]}, got {dead}"
    redis_env.pass_time(50 * MS)  # a died 50 ms ago: it comes back now, not at its old time
    assert queue.redrive(a) is True
    redriven_at = stamp(queue, "redrive").server_now_ns
    assert queue.redrive(a) is False
    expect(queue.statistics().dead, 1, "statistics().dead once a, redriven, is READY again")
    job = queue.get(a)
    expect(
        (job.state, job.run_at_ns),
        (READY, redriven_at),
        "redrive puts a DEAD job back to READY now, 50 ms after its death: (state, run_at_ns)",
    )
    again = claim(queue)
    assert (again.job_id, again.attempt, again.token) == (a, 1, 2), (
        f"redrive zeroes the attempts but never the token: expected attempt 1, token 2; got {again}"
    )
    with pytest.raises(StaleLease):
        queue.ack(la)
        raise AssertionError("a lease from before the death passed the fence")
    assert [job.id for job in queue.dead_letters()] == [b]


@rule("redis-extended")
@extended
@pytest.mark.parametrize("room", ["room", "full"])
def test_stage3_redrive_of_a_job_that_is_not_dead_returns_false_and_changes_nothing(
    redis_env: RedisEnv, room: str
) -> None:
    """``full``: max_pending=3, and the three unfinished jobs fill it. A redrive of a job
    that is not DEAD would add no unfinished job, so it is not past the bound: False, as
    on a queue with room, never QueueFull (nor for an unknown id: JobNotFound)."""
    redis_env.freeze_time()
    queue = new_queue(redis_env, max_pending=3 if room == "full" else None)
    done, cancelled = queue.enqueue("done"), queue.enqueue("cancelled")
    queue.ack(claim(queue), "ok")
    queue.cancel(cancelled)
    leased, ready = queue.enqueue("leased"), queue.enqueue("ready")
    claim(queue)
    scheduled = queue.enqueue("scheduled", delay_ns=10**12)
    jobs = {"SUCCEEDED": done, "CANCELLED": cancelled, "LEASED": leased, "READY": ready,
            "SCHEDULED": scheduled}  # fmt: skip
    story = "a queue with room" if room == "room" else "max_pending=3, 3 jobs unfinished"
    if room == "full":
        rejects(QueueFull, lambda: queue.enqueue("one too many"), f"{story}: an enqueue")
        rejects(JobNotFound, lambda: queue.redrive("job-404"), f"{story}: redrive('job-404')")
    before = {state: queue.get(job_id) for state, job_id in jobs.items()}
    stats = queue.statistics()
    for state, job_id in jobs.items():
        with not_refused(f"{story}: redrive of a {state} job returns False", QueueFull):
            got = queue.redrive(job_id)
        expect(got, False, f"{story}: redrive of a {state} job (it is not DEAD)")
    after = {state: queue.get(job_id) for state, job_id in jobs.items()}
    changed = {s: (before[s], after[s]) for s in jobs if before[s] != after[s]}
    assert not changed and queue.statistics() == stats, (
        f"redrive of a job that is not DEAD changes nothing; changed: {changed}, "
        f"statistics before {stats}, after {queue.statistics()}"
    )


def _server_ns(redis_env: RedisEnv) -> int:
    return redis_env.server().time_us() * 1000


@rule("redis-extended", "redis-order")
@extended
@pytest.mark.realtime
def test_stage3_a_cancelled_job_is_never_claimed_however_it_became_ready(
    redis_env: RedisEnv,
) -> None:
    """Each job is READY when it is cancelled, some time after it became so: enqueued due,
    due after a delay (the settle made it READY), released, or retried after a nack."""
    redis_env.freeze_time()
    queue = new_queue(redis_env, max_attempts=3)
    ways: list[tuple[str, Callable[[], str]]] = [
        ("enqueued due", lambda: queue.enqueue("due")),
        ("due after its delay", lambda: queue.enqueue("delayed", delay_ns=10 * MS)),
        ("released", lambda: _leased_then(queue, "released", queue.release)),
        ("retried after a nack", lambda: _leased_then(queue, "retried", _nack(queue))),
    ]
    for how, make in ways:
        job_id = make()
        redis_env.pass_time(20 * MS)  # its due time is behind it now
        assert queue.get(job_id).state is READY, f"the job {how} is READY"
        assert queue.cancel(job_id) is True
        try:
            got = queue.claim("w")
        except redis.ResponseError as error:  # a script tripping on what cancel left behind
            raise AssertionError(
                f"a job {how}, then cancelled 20 ms later while READY: the next claim() must "
                f"find nothing due, but its script failed ({error}) — did cancel leave the "
                "job in line?"
            ) from None
        assert got is None, (
            f"a job {how}, then cancelled 20 ms later while READY, must never be claimed "
            f"(CANCELLED is final); claim() returned {got} — did cancel leave it in line?"
        )
    assert queue.next_due_ns() is None and queue.statistics().cancelled == len(ways)


def _leased_then(queue: SharedJobQueue, payload: str, act: Callable[[Lease], None]) -> str:
    """Enqueue ``payload``, claim it and ``act`` on its lease; the job's id."""
    job_id = queue.enqueue(payload)
    lease = claim(queue)
    assert lease.job_id == job_id, f"claim() leased {lease.job_id}, expected {job_id}"
    act(lease)
    return job_id


def _nack(queue: SharedJobQueue) -> Callable[[Lease], None]:
    return lambda lease: queue.nack(lease, "503")


@rule("redis-extended")
@extended
def test_stage3_a_job_that_dies_again_after_a_redrive_is_listed_at_its_latest_death(
    redis_env: RedisEnv,
) -> None:
    redis_env.freeze_time()
    queue = new_queue(redis_env, max_attempts=1)
    a, b = queue.enqueue("a"), queue.enqueue("b")
    queue.nack(claim(queue), "a broke")
    queue.nack(claim(queue), "b broke")
    assert queue.redrive(a) is True
    queue.nack(claim(queue), "a broke again")
    dead = [job.id for job in queue.dead_letters()]
    assert dead == [b, a], (
        f"a dies, b dies, a is redriven and dies again: dead_letters() lists the DEAD jobs "
        f"in the order they died, a at its latest death: expected {[b, a]}, got {dead}"
    )


@rule("redis-backoff", "redis-jitter")
@extended
@pytest.mark.realtime
def test_stage3_full_jitter_can_wait_the_whole_delay(redis_env: RedisEnv) -> None:
    """Full jitter draws from [0, d], both ends included: with d = 1 µs, a retry waits 0
    or 1 µs, and 24 of them wait both."""
    redis_env.freeze_time()
    waits = {d for _, _, d in retry_delays(redis_env, RetryPolicy(1000, 1000, "full"), 24, 1)}
    assert waits == {0, 1000}, (
        "full jitter with base_ns = cap_ns = 1 µs draws each delay from [0, 1 µs], both "
        f"ends included: 24 retries must wait both 0 and 1000 ns; they waited {sorted(waits)}"
    )


@rule("redis-backoff", "redis-jitter")
@extended
@pytest.mark.realtime
def test_stage3_decorrelated_jitter_draws_from_the_delay_as_applied(redis_env: RedisEnv) -> None:
    """Decorrelated jitter's ``prev`` is the previous delay as it was applied, after the
    cap. So a retry after a capped one is drawn from [base, 3·cap]: with base 10 µs and
    cap 100 µs, 9 in 29 of them fall below the cap. A ``prev`` kept before the cap (up to
    3× the cap, and growing) puts nearly every later retry on the cap. Seeded, 16 jobs ×
    32 retries: the share below the cap is about 0.31 (at least 0.21 in 4 000 seeded
    runs of a model of the rule, at most 0.17 for the raw ``prev``)."""
    redis_env.freeze_time()
    base, cap = 10_000, 100_000
    last: dict[str, int] = {}
    after_cap = below = 0
    policy = RetryPolicy(base, cap, "decorrelated")
    for job_id, _, delay in retry_delays(redis_env, policy, 16, 32):
        if last.get(job_id) == cap:
            after_cap += 1
            below += delay < cap
        last[job_id] = delay
    assert after_cap and below / after_cap >= 0.19, (
        f"decorrelated jitter, base {base} ns, cap {cap} ns: of the {after_cap} retries drawn "
        f"right after a capped one, {below} waited less than the cap (expected about 31%: "
        "each is drawn from [base, 3·cap], prev being the capped delay as applied; about 6% "
        "means prev kept the draw before the cap)"
    )


@rule("redis-extended", "redis-jitter")
@extended
@pytest.mark.realtime
def test_stage3_redrive_starts_decorrelated_jitter_again_from_base(redis_env: RedisEnv) -> None:
    redis_env.freeze_time()
    base, cap = 1 * MS, 100 * MS
    queue = new_queue(
        redis_env, retry=RetryPolicy(base, cap, "decorrelated"), max_attempts=5,
        rng=random.Random(11),
    )  # fmt: skip
    ids = [queue.enqueue(n) for n in range(3)]
    grown: dict[str, list[int]] = {job_id: [] for job_id in ids}
    while any(queue.get(j).state is not JobState.DEAD for j in ids):
        lease = queue.claim("w")
        if lease is None:
            redis_env.pass_time(cap)
            continue
        queue.nack(lease, "503")
        nacked = stamp(queue, "nack").server_now_ns  # (a real clock runs on before the get)
        job = queue.get(lease.job_id)
        if job.state is not JobState.DEAD:
            grown[lease.job_id].append(job.run_at_ns - nacked)
    for job_id in ids:
        assert queue.redrive(job_id) is True
        queue.nack(claim(queue), "503")
        nacked = stamp(queue, "nack").server_now_ns
        delay = queue.get(job_id).run_at_ns - nacked
        assert base <= delay <= 3 * base, (
            f"redrive puts the decorrelated jitter's prev back to base_ns: {job_id}'s first "
            f"retry after it must wait within [{base}, {3 * base}] ns (base {base}); it waited "
            f"{delay} — drawn from its delays before the death, {grown[job_id]}?"
        )
        queue.cancel(job_id)  # (on a real clock its retry would be due before the next one)


@rule("redis-extended", "ttl-retention")
@extended
@pytest.mark.realtime
def test_stage3_a_redriven_job_is_kept_past_its_old_retention(redis_env: RedisEnv) -> None:
    redis_env.freeze_time()
    retention = 200 * MS
    queue = new_queue(redis_env, retention_ns=retention, max_attempts=1)
    job_id = queue.enqueue("x")
    queue.nack(claim(queue), "boom")  # DEAD: its keys get a TTL of retention_ns
    redis_env.pass_time(retention // 2)
    assert queue.redrive(job_id) is True
    redis_env.pass_time(retention)  # past the old death + retention_ns, with no call
    try:
        job = queue.get(job_id)
    except JobNotFound:
        raise AssertionError(
            f"a redriven job is pending again, and pending jobs carry no TTL: {retention} ns "
            f"after its redrive (and {3 * retention // 2} after its death) get({job_id!r}) "
            "raised JobNotFound — did the redrive leave the death's TTL on its keys?"
        ) from None
    assert job.state is READY and queue.statistics().ready == 1, f"redriven: {job}"
    queue.ack(claim(queue), "done at last")
    assert queue.get(job_id).state is SUCCEEDED


@rule("redis-dedup-ttl")
@extended
@pytest.mark.realtime
def test_stage3_idempotency_key_dedups_within_its_ttl_from_the_first_enqueue(
    redis_env: RedisEnv,
) -> None:
    redis_env.freeze_time()
    queue = new_queue(redis_env, dedup_ttl_ns=200 * MS)
    first = queue.enqueue("req", idempotency_key="req-42")
    redis_env.pass_time(150 * MS)
    again = queue.enqueue("req (retry)", idempotency_key="req-42")
    assert again == first, f"a retry within the TTL returns {first!r}, got {again!r}"
    redis_env.pass_time(60 * MS)  # 210 ms after the FIRST enqueue: the key has expired
    fresh = queue.enqueue("req (new)", idempotency_key="req-42")
    assert fresh != first, (
        "the key's TTL counts from the first enqueue: 210 ms later a new job must "
        "be created (a duplicate must not refresh the TTL)"
    )
    assert queue.statistics().pending == 2


@rule("redis-dedup-ttl")
@extended
@pytest.mark.realtime
def test_stage3_a_delayed_jobs_key_dedups_from_its_enqueue_not_its_run_time(
    redis_env: RedisEnv,
) -> None:
    redis_env.freeze_time()
    queue = new_queue(redis_env, dedup_ttl_ns=200 * MS)
    first = queue.enqueue("report", idempotency_key="nightly", delay_ns=500 * MS)
    redis_env.pass_time(210 * MS)  # 210 ms after the enqueue, 290 ms before the job is due
    fresh = queue.enqueue("report (again)", idempotency_key="nightly")
    assert fresh != first, (
        "enqueue('report', key 'nightly', delay_ns=500 ms) with dedup_ttl_ns=200 ms; 210 ms "
        f"later the same key: the TTL counts from the first enqueue, not from when the job "
        f"is due, so a new job must be created; got the first one, {first!r}"
    )


@rule("redis-dedup-ttl")
@extended
def test_stage3_an_idempotency_key_is_forgotten_at_its_ttl_exactly(redis_env: RedisEnv) -> None:
    if not redis_env.time_is_controlled:
        pytest.skip("a real server's clock cannot be stopped at the TTL's very microsecond")
    redis_env.freeze_time()
    ttl = 200 * MS  # whole ms: Redis keeps a key through the last ms of its TTL
    queue = new_queue(redis_env, dedup_ttl_ns=ttl)
    first = queue.enqueue("req", idempotency_key="req-42")
    redis_env.pass_time(ttl - 1000)
    again = queue.enqueue("req (retry)", idempotency_key="req-42")
    assert again == first, f"1 µs before the key's TTL runs out it returns {first!r}: {again!r}"
    expect(queue.statistics().idempotency_keys, 1, "idempotency_keys 1 µs before the TTL")
    redis_env.pass_time(1000)
    expect(
        queue.statistics().idempotency_keys, 0,
        "idempotency_keys at the first enqueue + dedup_ttl_ns exactly (the record is gone)",
    )  # fmt: skip
    fresh = queue.enqueue("req (new)", idempotency_key="req-42")
    assert fresh != first, (
        f"at the first enqueue + dedup_ttl_ns exactly the key is forgotten and the next "
        f"enqueue with it creates a new job; it returned the first job's id {first!r}"
    )


@rule("redis-idempotency")
@extended
def test_stage3_racing_producers_with_one_key_create_one_job(redis_env: RedisEnv) -> None:
    """Idempotency inside the enqueue script: a GET then a SET lets racing retries through."""
    queues = [new_queue(redis_env, c) for c in redis_env.clients(8)]

    def produce(key: str) -> Callable[[SharedJobQueue, int], list[Any]]:
        def enqueue(q: SharedJobQueue, i: int) -> list[Any]:
            return [q.enqueue({"order": key}, idempotency_key=key)]

        return enqueue

    created = {key: set(race(queues, produce(key))) for key in (f"order-{n}" for n in range(15))}
    dup = {k: v for k, v in created.items() if len(v) != 1}
    assert not dup, (
        f"8 producers racing to enqueue one idempotency key must all get the same "
        f"job id; these keys created several jobs: {dup}"
    )
    assert queues[0].statistics().ready == 15


@rule("one-script", "redis-attempts")
@extended
def test_stage3_racing_workers_never_claim_one_job_twice(redis_env: RedisEnv) -> None:
    # Server time stands still (fakeredis) and the lease is long (a real server): a lease
    # that ran out mid-race would give its job back for a legitimate second claim.
    redis_env.freeze_time()
    queues = [new_queue(redis_env, c, lease_ns=3600 * 1000 * MS) for c in redis_env.clients(6)]
    for i in range(60):
        queues[0].enqueue({"n": i})

    def drain(q: SharedJobQueue, i: int) -> list[str]:
        mine: list[str] = []
        while (lease := q.claim(f"w{i}")) is not None:
            mine.append(lease.job_id)
        return mine

    claimed = race(queues, drain)
    twice = sorted({j for j in claimed if claimed.count(j) > 1})
    assert not twice and len(claimed) == 60, (
        f"6 workers racing must claim each of 60 jobs exactly once (claim is one "
        f"atomic script); claimed {len(claimed)}, twice: {twice}"
    )


@rule("redis-extended")
@extended
@pytest.mark.realtime
def test_stage3_max_pending_counts_exactly_the_unfinished_jobs(redis_env: RedisEnv) -> None:
    redis_env.freeze_time()
    lease = 200 * MS
    queue = new_queue(redis_env, lease_ns=lease, max_pending=1, max_attempts=1)
    max_pending_walk(queue, lambda: _server_ns(redis_env), redis_env.pass_time, lease)


@rule("redis-order", "redis-settle-first")
@core
@pytest.mark.realtime
def test_stage3_delayed_jobs_noticed_late_keep_the_order_of_their_due_times(
    redis_env: RedisEnv,
) -> None:
    redis_env.freeze_time()
    queue = new_queue(redis_env)
    # On a real server the clock runs between the two calls: the gap between the due
    # times (230 ms) keeps the second job due first on a busy machine too.
    later = queue.enqueue("due in 250 ms", delay_ns=250 * MS)
    sooner = queue.enqueue("due in 20 ms", delay_ns=20 * MS)
    redis_env.pass_time(300 * MS)  # both due, and no call has noticed either yet
    got = [claim(queue).job_id, claim(queue).job_id]
    assert got == [sooner, later], (
        "two jobs of one priority, both due by the time a call notices them: the one due "
        f"earlier comes first, whenever the queue noticed it (and only then enqueue order): "
        f"expected {[sooner, later]} (due at +20 ms, +250 ms), got {got}"
    )


@rule("redis-backoff", "redis-settle-first")
@core
@pytest.mark.realtime
def test_stage3_a_job_dying_by_expiry_finishes_at_the_expiry_instant(redis_env: RedisEnv) -> None:
    redis_env.freeze_time()
    retention = 300 * MS
    queue = new_queue(redis_env, lease_ns=100 * MS, max_attempts=1, retention_ns=retention)
    job_id = queue.enqueue("crashes")
    lease = claim(queue)
    redis_env.pass_time(150 * MS)  # the lease expired 50 ms ago; this call notices it
    job = queue.get(job_id)
    assert (job.state, job.finished_at_ns) == (JobState.DEAD, lease.expires_at_ns), (
        f"max_attempts=1: the job dies when its lease expires, at {lease.expires_at_ns}, "
        f"however late a call notices: finished_at_ns is the expiry time; got "
        f"{job.state.value} at {job.finished_at_ns} (the call ran at "
        f"{stamp(queue, 'get').server_now_ns})"
    )
    if not redis_env.time_is_controlled:
        return  # a real server's clock cannot be stopped at the retention's microsecond
    redis_env.pass_time(lease.expires_at_ns + retention - _server_ns(redis_env) - 1000)
    assert [j.id for j in queue.dead_letters()] == [job_id], "held until expiry + retention"
    redis_env.pass_time(1000)
    with pytest.raises(JobNotFound):
        queue.get(job_id)
        raise AssertionError(
            f"the job died at its lease's expiry, so it is forgotten at expiry + retention_ns "
            f"({lease.expires_at_ns + retention}); it is still held then"
        )


@rule("ttl-retention", "key-prefix")
@extended
@pytest.mark.realtime
def test_stage3_finished_jobs_and_keys_expire_with_a_ttl(redis_env: RedisEnv) -> None:
    redis_env.freeze_time()
    queue = new_queue(redis_env, retention_ns=200 * MS, dedup_ttl_ns=200 * MS, max_attempts=1)
    admin = redis_env.client()
    ids = [queue.enqueue({"n": i}, idempotency_key=f"k{i}") for i in range(12)]
    for i in range(12):
        lease = claim(queue)
        finish(queue, lease, i)
    sizes = key_sizes(redis_env)
    forever = {k: n for k, n in sizes.items() if admin.pttl(k) < 0}
    bounded = [k for k in sizes if admin.pttl(k) >= 0]
    assert len(forever) <= 16 and all(n <= 8 for n in forever.values()), (
        f"once 12 jobs have finished (and none is pending), whatever holds them and their "
        f"idempotency records must carry a TTL, set by the script that finishes or records "
        f"them: only a few small counters may have none. Keys without a TTL (and the fields "
        f"or members each holds): {dict(list(forever.items())[:20])}"
    )
    too_long = [k for k in bounded if admin.pttl(k) > 200 + 5]
    assert not too_long, f"TTLs must not exceed the retention (200 ms): {too_long}"
    redis_env.pass_time(201 * MS)
    assert queue.statistics() == QueueStatistics(0, 0, 0, 0, 0, 0, 0), queue.statistics()
    for job_id in ids:
        with pytest.raises(JobNotFound):
            queue.get(job_id)
            raise AssertionError(f"{job_id} outlived its retention")


@rule("ttl-retention", "redis-settle-first")
@extended
@pytest.mark.realtime
def test_stage3_statistics_stop_counting_a_finished_job_at_its_retention(
    redis_env: RedisEnv,
) -> None:
    """Two jobs finish 50 ms apart, with nothing else due: the first one's retention ends
    while the second is still held, so the queue must settle then, with no lease expiry
    or delayed job to prompt it."""
    redis_env.freeze_time()
    retention = 100 * MS
    queue = new_queue(redis_env, retention_ns=retention)
    first, second = queue.enqueue("first"), queue.enqueue("second")
    leases = [claim(queue), claim(queue)]
    queue.ack(leases[0])
    redis_env.pass_time(50 * MS)
    queue.ack(leases[1])
    redis_env.pass_time(60 * MS)  # 110 ms after the first ack, 60 ms after the second
    stats = queue.statistics()
    assert stats.succeeded == 1, (
        f"retention_ns=100 ms: {first} succeeded 110 ms ago and is forgotten, {second} 60 ms "
        f"ago and is held — statistics() must count 1 succeeded job, got {stats}"
    )
    with pytest.raises(JobNotFound):
        queue.get(first)
        raise AssertionError(f"{first} outlived its retention")
    assert queue.get(second).state is SUCCEEDED
    # After that settle, the next retention still ends on time: a third job finishes
    # (its writes keep the queue's keys alive), and the second's retention ends 40 ms on.
    third = queue.enqueue("third")
    queue.ack(claim(queue))
    redis_env.pass_time(40 * MS)  # 100 ms after the second ack, 40 ms after the third
    stats = queue.statistics()
    assert stats.succeeded == 1, (
        f"then {third} succeeded 40 ms ago, and {second} 100 ms ago: its retention ended "
        f"(the settle that forgot {first} must still wake for it) — statistics() must count "
        f"1 succeeded job, got {stats}"
    )
    with pytest.raises(JobNotFound):
        queue.get(second)
        raise AssertionError(f"{second} outlived its retention")


@rule("bounded-memory")
@extended
@pytest.mark.realtime
def test_stage3_an_idle_queue_shrinks_to_its_live_jobs(redis_env: RedisEnv) -> None:
    redis_env.freeze_time()
    queue = new_queue(redis_env, retention_ns=100 * MS, dedup_ttl_ns=100 * MS, max_attempts=1)
    for i in range(60):
        queue.enqueue({"n": i}, idempotency_key=f"k{i}")
        lease = claim(queue)
        finish(queue, lease, i)
    live = [
        queue.enqueue("ready"),
        queue.enqueue("ready"),
        queue.enqueue("later", delay_ns=3_600_000 * MS),
    ]
    redis_env.pass_time(101 * MS)  # and no call: nothing settles the history away
    admin = redis_env.client()
    held = key_sizes(redis_env)  # key -> its members or fields (1 for a string)
    members = sum(n for k, n in held.items() if text(admin.type(k)) in ("set", "zset", "list"))
    # What a queue that only ever held these three jobs holds, for comparison.
    fresh_prefix = redis_env.fresh_prefix()
    fresh = new_queue(redis_env, prefix=fresh_prefix)
    for payload, delay in [("ready", None), ("ready", None), ("later", 3_600_000 * MS)]:
        fresh.enqueue(payload, delay_ns=delay)
    fresh_held = key_sizes(redis_env, fresh_prefix)
    assert (
        len(held) <= 16
        and members <= 2 * len(live)
        and sum(held.values()) <= sum(fresh_held.values()) + 8
    ), (
        f"60 jobs finished and passed their retention (100 ms) with no call since; the queue "
        f"keeps {len(live)} live jobs: expected their keys and a few counters (at most 16 "
        f"keys, {2 * len(live)} index members, and about what a fresh queue holding just "
        f"those 3 jobs holds: {sum(fresh_held.values())} members and fields), got "
        f"{len(held)} keys, {members} index members and {sum(held.values())} members and "
        f"fields: "
        + ", ".join(
            f"{k.removeprefix(redis_env.prefix)} ({n})"
            for k, n in sorted(held.items(), key=lambda kv: -kv[1])[:6]
        )
        + " — whatever holds finished jobs or records (their fields, their indexes) needs "
        "a TTL of its own"
    )
    for job_id in live:
        assert queue.get(job_id).state in (JobState.READY, JobState.SCHEDULED), job_id


@rule("bounded-memory")
@extended
@pytest.mark.realtime
def test_stage3_a_queue_that_never_idles_holds_its_retention_not_its_history(
    redis_env: RedisEnv,
) -> None:
    """A job every 5 ms, each finished at once (acked, nacked to its death or cancelled)
    and kept 50 ms: no TTL of the queue's history ever runs out, since something new is
    always written. What it holds follows the ~10 jobs within their retention — after 200
    jobs, what it held after 40."""
    redis_env.freeze_time()
    queue = new_queue(redis_env, retention_ns=50 * MS, dedup_ttl_ns=50 * MS, max_attempts=1)
    held: dict[int, dict[str, int]] = {}
    for i in range(200):
        queue.enqueue({"n": i}, idempotency_key=f"k{i}")
        finish(queue, claim(queue), i)
        redis_env.pass_time(5 * MS)
        if i + 1 in (30, 35, 40, 190, 195, 200):
            held[i + 1] = key_sizes(redis_env)
    # The fullest of three looks (on a real server, a look that took longer than the
    # retention finds the queue idle, its history gone by TTL).
    early, late = (max((held[n] for n in at), key=lambda h: sum(h.values()))
                   for at in ((30, 35, 40), (190, 195, 200)))  # fmt: skip

    def top(sizes: dict[str, int]) -> str:
        return ", ".join(
            f"{k.removeprefix(redis_env.prefix)} ({n})"
            for k, n in sorted(sizes.items(), key=lambda kv: -kv[1])[:6]
        )

    # On a real server the jobs take real time too, so how many are within their
    # retention varies (a key may hold none, then 3); one that keeps history grows 5 times.
    grew = {k.removeprefix(redis_env.prefix): (early.get(k, 0), n)
            for k, n in late.items() if n > 2 * early.get(k, 0) + 10}  # fmt: skip
    check(
        sum(late.values()) <= 1.5 * sum(early.values()) + 10 and not grew,
        f"a job every 5 ms, each kept 50 ms past its end: the queue holds about 10 "
        f"finished jobs at any time, so after 200 jobs it holds about what it held after 40 "
        f"({sum(early.values())} members and fields: {top(early)}); it holds "
        f"{sum(late.values())}: {top(late)}. Grown (after 40 -> after 200): {grew} — a "
        "TTL alone never runs out on a queue that keeps busy: a finished job's fields and "
        "index entries go one by one when its retention ends",
    )


@rule("ttl-retention")
@extended
def test_stage3_a_retention_that_ends_between_two_ms_is_held_to_its_last_us(
    redis_env: RedisEnv,
) -> None:
    """Redis expires keys at whole ms; retention and idempotency TTLs end at whole µs. A
    key's TTL rounded down to a ms would forget what it holds up to 999 µs early."""
    if not redis_env.time_is_controlled:
        pytest.skip("a real server's clock cannot be stopped a µs before the retention ends")
    redis_env.freeze_time()
    retention = 1_500_000  # 1.5 ms
    queue = new_queue(redis_env, retention_ns=retention, dedup_ttl_ns=retention)
    redis_env.pass_time(-_server_ns(redis_env) % MS)  # now a whole ms: the ends fall on half ms
    job_id = queue.enqueue("done", idempotency_key="k")
    queue.ack(claim(queue))
    redis_env.pass_time(retention - 1000)
    try:
        state: object = queue.get(job_id).state
    except JobNotFound:
        state = None
    expect(state, SUCCEEDED, "1 µs before its retention of 1.5 ms ends, the job (None: gone)")
    again = queue.enqueue("again", idempotency_key="k")
    expect(again, job_id, "1 µs before the key's dedup TTL ends, an enqueue with it returns")
    redis_env.pass_time(1000)
    with pytest.raises(JobNotFound):
        queue.get(job_id)
        raise AssertionError(f"{job_id} outlived its retention of 1.5 ms")


@rule("ttl-retention", "redis-settle-first")
@extended
def test_stage3_a_death_settled_late_never_shortens_the_retention_of_a_later_finish(
    redis_env: RedisEnv,
) -> None:
    """1 005 leases expire at one instant (max_attempts=1: each job dies at its expiry),
    more than one call may settle; a job acked 1 ms later, by a call that settles only
    part of them, is held for its whole retention — the deaths settled after it must not
    shorten what holds it to their own finishing time + retention."""
    if not redis_env.time_is_controlled:
        pytest.skip("a real server's clock runs while 1 005 leases are made: they expire apart")
    redis_env.freeze_time()
    retention, lease_ns = 100 * MS, 10 * MS
    queue = new_queue(redis_env, retention_ns=retention, lease_ns=lease_ns, max_attempts=1)
    for i in range(1005):
        queue.enqueue(i)
        claim(queue)  # its worker crashes: the job dies when the lease expires
    redis_env.pass_time(lease_ns // 2)
    kept = queue.enqueue("kept")
    kept_lease = claim(queue)
    redis_env.pass_time(lease_ns // 2 + MS)  # 1 ms past the 1 005 expiries
    queue.ack(kept_lease)
    expect(len(queue.dead_letters()), 1005, "dead letters once every expiry is settled")
    redis_env.pass_time(retention - MS // 2)  # the deaths' retention is over, kept's is not
    try:
        state: object = queue.get(kept).state
    except JobNotFound:
        state = None
    expect(
        state, SUCCEEDED,
        f"{kept}, acked 1 ms after 1 005 jobs died at their lease expiry, 0.5 ms before its "
        f"retention of {retention} ns ends (None: it is gone)",
    )  # fmt: skip


@rule("ttl-retention", "redis-extended")
@extended
def test_stage3_dead_letters_after_a_thousand_deaths_pass_their_retention(
    redis_env: RedisEnv,
) -> None:
    """1 005 jobs die at one instant and pass their retention together: Redis expires
    their hashes at once, while a queue may settle its indexes a bounded number at a time.
    dead_letters() must still answer (with what is held), never trip on a job it lost."""
    if not redis_env.time_is_controlled:
        pytest.skip("a real server's clock runs while the deaths are made: they expire one by one")
    redis_env.freeze_time()
    retention = 100 * MS
    queue = new_queue(redis_env, retention_ns=retention, max_attempts=1)
    for i in range(1005):
        queue.enqueue(i)
        queue.nack(claim(queue), "boom")
    assert len(queue.dead_letters()) == 1005, "every death is held until its retention"
    redis_env.pass_time(retention // 2)
    last = queue.enqueue("the last")
    queue.nack(claim(queue), "boom")  # one more death keeps the dead index alive
    redis_env.pass_time(retention // 2 + MS)
    try:
        held = queue.dead_letters()
    except Exception as e:
        raise AssertionError(
            f"dead_letters() raised {type(e).__name__}: {e} — after 1 005 dead jobs passed "
            f"their retention at once (their hashes expired by TTL), it must return the "
            f"DEAD jobs still held: the one that died {retention // 2} ns later"
        ) from None
    got = [job.id for job in held]
    assert got == [last], (
        f"1 005 dead jobs are past their retention, one is not: expected dead_letters() to "
        f"give [{last!r}], got {len(got)} jobs {got[:3]}"
    )


@rule("reap")
@extended
@pytest.mark.realtime
def test_stage3_the_reaper_retries_crashed_jobs_when_nobody_else_calls(
    redis_env: RedisEnv,
) -> None:
    redis_env.freeze_time()
    queue = new_queue(redis_env, lease_ns=100 * MS)
    for n in range(3):
        queue.enqueue(n)
    for _ in range(3):
        claim(queue)  # three workers crash holding these
    redis_env.pass_time(100 * MS)
    reaped = queue.reap()
    assert reaped == 3, f"reap() must expire the 3 dead leases; it reported {reaped}"
    stats = queue.statistics()
    assert (stats.ready, stats.leased) == (3, 0), f"after reaping: {stats}"
    assert queue.reap() == 0, "reaping twice must change nothing the second time"


@rule("scripts-reload")
@extended
@pytest.mark.redis_faults
def test_stage3_script_flush_and_restart_are_survived(redis_env: RedisEnv) -> None:
    node = redis_env.fault_server()
    queue = new_queue(redis_env, node.client())
    job_id = queue.enqueue("before")
    node.script_flush()
    lease = claim(queue)  # NOSCRIPT: the script must be loaded again, transparently
    queue.ack(lease)
    assert queue.get(job_id).state is SUCCEEDED
    node.restart()  # without persistence: data and scripts are gone
    client = node.client()
    queue = new_queue(redis_env, client)
    after = queue.enqueue("after")
    queue.ack(claim(queue))
    assert queue.get(after).state is SUCCEEDED


@rule("outage-raises")
@extended
def test_stage3_outage_raises_and_loses_nothing(redis_env: RedisEnv) -> None:
    proxy = redis_env.proxy()
    queue = new_queue(redis_env, redis_env.server().proxied_client(proxy, socket_timeout=0.5))
    job_id = queue.enqueue("survives")
    proxy.outage()
    with pytest.raises(redis.ConnectionError):
        queue.claim("w")
        raise AssertionError("a claim during an outage must raise ConnectionError")
    proxy.heal()
    lease = claim(queue)
    assert lease.job_id == job_id and lease.attempt == 1, (
        f"the failed claim must have changed nothing; got {lease}"
    )


@rule("busy-unavailable", "worker-outage")
@extended
def test_stage3_a_busy_server_is_waited_out_by_the_worker(redis_env: RedisEnv) -> None:
    """A server answering ``BUSY`` (a long script) is unavailable: the queue raises it as
    it comes, the worker waits it out (``unavailable`` events) and goes on once it ends."""
    proxy = redis_env.proxy()
    client = redis_env.server().proxied_client(proxy)
    queue, worker, clock, events = in_process_worker(
        redis_env, lambda lease, payload: payload, poll_ns=1_000, client=client
    )
    job_id = queue.enqueue("after the script")
    proxy.busy()
    thread = run_in_thread(worker, 1)
    eventually(lambda: "unavailable" in [e for e, _ in events], "the worker to see BUSY")
    assert thread.is_alive(), "a BUSY reply must not end the worker (it is an outage)"
    proxy.heal()
    clock.advance(1_000)
    thread.outcome("the worker to run the job once the server answers again")
    assert queue.get(job_id).state is SUCCEEDED, queue.get(job_id)


@rule("busy-unavailable", "one-script")
@extended
def test_stage3_every_call_raises_each_refusal_as_it_comes(redis_env: RedisEnv) -> None:
    """The server (or the cluster) answers every command with one of the unavailable
    replies: each public call of the queue and its effect store sends its one script and
    raises what came back — it retries nothing itself, at once or later (the caller, and
    the worker, decide when to try again)."""
    proxy = redis_env.proxy()
    queue = new_queue(redis_env, redis_env.server().proxied_client(proxy))
    job_id = queue.enqueue("held")
    lease = claim(queue)
    calls = every_call(queue, lease, job_id)
    for _, call in calls:  # every script loaded: a refusal is the only reply to come
        with contextlib.suppress(StaleLease, JobNotFound, ValueError):
            call()
    for code in redis_env.refusals:
        proxy.refuse(code)
        for name, call in calls:
            proxy.reset_counts()
            try:
                got = call()
            except Exception as error:  # the test reports what escaped
                got = error
            sent = proxy.counts()
            scripts = [c for c in sent.commands if c in SCRIPT_COMMANDS]
            check(
                isinstance(got, Exception)
                and unavailable(got)
                and len(scripts) <= 1
                and (redis_env.mode == "cluster" or sent.connections <= 1),  # (a cluster
                # client asks for the slots again on a connection error, on connections of
                # its own)
                f"the server answering {code} to every command: {name} sends its one script "
                f"(none, if the connection's handshake was refused) and raises the reply as "
                f"it comes (an error api.unavailable accepts); it sent {len(scripts)} "
                f"script(s) on {sent.connections} new connection(s) and "
                + (f"raised {type(got).__name__}: {got}" if isinstance(got, Exception)
                   else f"returned {got!r}"),
            )  # fmt: skip
        proxy.heal()


@rule("redis-idempotency", "fault-lost-reply")
@extended
def test_stage3_producer_retry_after_a_lost_reply_creates_one_job(redis_env: RedisEnv) -> None:
    """The proxy forwards the enqueue, the server applies it, the reply is lost: the
    producer cannot know, retries with the same idempotency key, and gets the same job."""
    proxy = redis_env.proxy()
    client = redis_env.server().proxied_client(proxy, socket_timeout=0.3)
    queue = new_queue(redis_env, client)
    queue.statistics()  # load the scripts first
    queue.enqueue("warm-up")
    proxy.drop_replies()
    with pytest.raises(redis.TimeoutError):
        queue.enqueue({"order": 7}, idempotency_key="order-7")
    proxy.heal()
    job_id = queue.enqueue({"order": 7}, idempotency_key="order-7")
    stats = queue.statistics()
    assert stats.ready == 2, (
        f"the retried enqueue must find the first attempt's job by its key: "
        f"expected 2 jobs (warm-up and order 7), the queue holds {stats.ready}"
    )
    assert queue.get(job_id).payload == {"order": 7}
