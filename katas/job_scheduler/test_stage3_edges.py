"""Stage 3 suite, the queue on Redis, at the edges of its rules: a lease on a job the
queue does not hold, an effect held however its job comes back, a death the settle
notices only once its retention is over, a cancel meeting a finished job, and idempotency
records of different ages, and more leases or finished jobs passing their end at once than a
script settles (see katas/job_scheduler/README.md, "Stage 3").

Runs on fakeredis by default, like the rest of the stage (``test_stage3.py`` tells how
time is placed): the server clock is frozen and moved by the test; tests marked
``realtime`` wait for server time on a real server, and those that need the clock
stopped at an exact µs skip there.

Map: a lease on a job never enqueued, forgotten after its retention, or of a store lost
since — ``is_current`` False, every other lease call refused (redis-unknown-id,
redis-extended) · an effect committed by an attempt that never acked, held through the
job's retry after an expiry or a nack, its release, and its redrive after a death
(redis-fenced, redis-effect-by-job, redis-extended) · a death by expiry first noticed at
its retention's end, or 1 µs before, by each kind of read (redis-settle-first,
ttl-retention) · cancel of a job SUCCEEDED, CANCELLED, DEAD by a nack, or DEAD by the
expiry its own settle applies: False, and the job left as it was (redis-extended,
redis-settle-first) · a key enqueued after another outliving the other's TTL, held to its
own last µs (redis-idempotency, redis-dedup-ttl, ttl-retention) · 1 001 leases ending at
one µs, the last one's zombie calling first: stale at once (redis-attempts, redis-stale,
redis-fenced) · 1 005 finished jobs passing their retention at one µs: statistics() counts
none of them (ttl-retention) · a finished job's fields gone at its retention's end, on a
busy queue or at the first call after a crash (bounded-memory).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from katas._harness.marks import extended, rule
from katas._harness.redis import RedisEnv
from katas._harness.story import Story, expect, not_refused
from katas.job_scheduler._testing.queues import refusal
from katas.job_scheduler._testing.redis_queues import (
    MS,
    claim,
    effect_store,
    fail_fast_on_redis_stubs,  # noqa: F401 (autouse)
    finish,
    key_sizes,
    new_queue,
    state_or_none,
)
from katas.job_scheduler._testing.states import CANCELLED, DEAD, SUCCEEDED
from katas.job_scheduler.api import (
    EffectStore,
    JobNotFound,
    Lease,
    QueueStatistics,
    SharedJobQueue,
    StaleLease,
)

pytestmark = [pytest.mark.stage(3)]


@rule("redis-unknown-id", "redis-extended")
@extended
@pytest.mark.realtime
@pytest.mark.parametrize("gone", ["never_enqueued", "forgotten", "store_lost"])
def test_stage3_a_lease_on_a_job_the_queue_does_not_hold_is_not_current(
    redis_env: RedisEnv, gone: str
) -> None:
    """``is_current`` answers False for a lease that is not live — one whose job the queue
    does not hold included (stage 1: False for a forgotten job) — where ``ack``, ``nack``,
    ``heartbeat`` and ``release`` raise JobNotFound and the effect store's ``commit``
    StaleLease. A lost store may answer the lease calls either way (restart-fence)."""
    redis_env.freeze_time()
    retention = 100 * MS
    queue = new_queue(redis_env, retention_ns=retention)
    held = queue.enqueue("held")
    if gone == "never_enqueued":
        lease, story = Lease("job-404", 1, 1, 0, "w"), "a lease on job-404, never enqueued"
    elif gone == "forgotten":
        lease = claim(queue)
        queue.ack(lease)
        redis_env.pass_time(retention)
        story = f"a lease on {held}, acked, then forgotten {retention} ns later (its retention)"
    else:
        lease = claim(queue)
        redis_env.pass_time(MS)  # the store lived a while: a new one is a new generation
        redis_env.lose_keys()
        queue.enqueue("after the loss")
        story = f"a lease on {held}; then the store was lost, and a job enqueued in a new one"
    with not_refused(f"{story}: is_current answers, never raises", JobNotFound, StaleLease):
        current = queue.is_current(lease)
    expect(current, False, f"{story}: is_current(lease)")
    lost = (JobNotFound, StaleLease) if gone == "store_lost" else (JobNotFound,)
    calls: list[tuple[str, tuple[type[Exception], ...], Callable[[], object]]] = [
        ("ack", lost, lambda: queue.ack(lease)),
        ("nack", lost, lambda: queue.nack(lease, "late")),
        ("heartbeat", lost, lambda: queue.heartbeat(lease)),
        ("release", lost, lambda: queue.release(lease)),
        ("commit", (StaleLease,), lambda: effect_store(queue).commit(lease, "late")),
    ]
    for name, refusals, call in calls:
        got = refusal(refusals[0], call)
        if isinstance(got, refusals):
            got = True
        expect(
            got, True,
            f"{story}: {name}(lease) must raise {' or '.join(r.__name__ for r in refusals)} "
            "(True: it did; False: it was accepted)",
        )  # fmt: skip


#: How the attempt that committed the job's effect ends without an ack, and how the job
#: comes back for another attempt.
COME_BACK = ["expired", "nacked", "released", "died_and_redriven"]


@rule("redis-fenced", "redis-effect-by-job", "redis-extended")
@extended
@pytest.mark.realtime
@pytest.mark.parametrize("how", COME_BACK)
def test_stage3_an_effect_committed_is_held_however_its_job_comes_back(
    redis_env: RedisEnv, how: str
) -> None:
    """An attempt commits the job's effect and never acks: its lease expires, it nacks, it
    is released — or, at its last attempt, its lease expires and the job, DEAD, is
    redriven. The job is the same job: ``effects()`` holds the first effect all along, and
    the next attempt's ``commit`` finds it committed (False), so the effect lands once."""
    redis_env.freeze_time()
    lease_ns = 100 * MS
    queue = new_queue(
        redis_env, lease_ns=lease_ns, max_attempts=1 if how == "died_and_redriven" else 2
    )
    store = effect_store(queue)
    job_id = queue.enqueue("charge $5")
    story = Story(
        f"{job_id} enqueued (max_attempts {queue.get(job_id).max_attempts}):",
        lambda: redis_env.server().time_us() * 1000, redis_env.server().time_us() * 1000,
    )  # fmt: skip
    invariant = (
        "an effect is committed once per job, keyed by the job: it is held while the queue "
        "holds the job, and every later attempt's commit returns False"
    )

    def holds(when: str) -> None:
        story.add(when)
        story.expect(store.effects(), {job_id: "charged"}, f"{invariant}; effects()")

    first = claim(queue, "w1")
    fresh = store.commit(first, "charged")
    story.check(fresh is True, invariant, f"the first commit returned {fresh!r}, not True")
    holds("w1 claimed it and committed 'charged'")
    if how == "nacked":
        queue.nack(first, "503")
    elif how == "released":
        queue.release(first)
    else:
        redis_env.pass_time(lease_ns)
        queue.reap()
    holds(f"w1's attempt ended: {how.replace('_', ' ')}")
    if how == "died_and_redriven":
        story.expect(queue.get(job_id).state, DEAD, f"{invariant}; at its last attempt: state")
        story.check(queue.redrive(job_id) is True, invariant, "redrive() returned False")
        holds("the DEAD job redriven")
    again = claim(queue, "w2")
    committed = store.commit(again, "charged again")
    story.add(f"w2 claimed it (token {again.token}) and committed: {committed}")
    story.expect(committed, False, f"{invariant}; w2's commit")
    queue.ack(again, "done")
    holds("w2 acked")


#: When the first call after a crashed job's death comes: at the end of that death's
#: retention exactly, or 1 µs before it.
NOTICED = {"at_the_end": 0, "1_us_before": 1000}


@rule("redis-settle-first", "ttl-retention")
@extended
@pytest.mark.parametrize("first", ["statistics", "dead_letters", "get", "effects"])
@pytest.mark.parametrize("noticed", list(NOTICED))
def test_stage3_a_death_noticed_only_at_its_retention_end_is_never_shown(
    redis_env: RedisEnv, noticed: str, first: str
) -> None:
    """max_attempts=1: the worker commits its effect and crashes; nobody calls until the
    death's retention is over (its lease's expiry + retention_ns), or 1 µs short of it.
    That first call's settle applies the expiry — the job dies at the expiry instant — and
    only then forgets what is past its retention, the job it just killed included: at the
    end, no call shows the job, the first one neither; 1 µs before, every one does."""
    if not redis_env.time_is_controlled:
        pytest.skip("a real server's clock cannot be stopped at the retention's very µs")
    redis_env.freeze_time()
    lease_ns, retention = 100 * MS, 200 * MS
    queue = new_queue(redis_env, lease_ns=lease_ns, retention_ns=retention, max_attempts=1)
    store = effect_store(queue)
    job_id = queue.enqueue("crashes")
    lease = claim(queue)
    store.commit(lease, "charged")
    now = redis_env.server().time_us() * 1000
    redis_env.pass_time(lease.expires_at_ns + retention - NOTICED[noticed] - now)
    gone = noticed == "at_the_end"
    reads: dict[str, tuple[Callable[[], object], object, object]] = {
        "statistics": (queue.statistics, QueueStatistics(0, 0, 0, 0, 0, 0, 0),
                       QueueStatistics(0, 0, 0, 0, 1, 0, 0)),
        "dead_letters": (lambda: [j.id for j in queue.dead_letters()], [], [job_id]),
        "get": (lambda: state_or_none(queue, job_id), None, DEAD),
        "effects": (store.effects, {}, {job_id: "charged"}),
    }  # fmt: skip
    for name in [first, *(n for n in reads if n != first)]:
        read, forgotten, shown = reads[name]
        expect(
            read(), forgotten if gone else shown,
            f"max_attempts=1, retention_ns={retention}: {job_id} committed its effect and its "
            f"lease expired, nothing called since; {NOTICED[noticed]} ns before the expiry + "
            f"retention_ns, {name}() — the {'first' if name == first else 'next'} call, its "
            "settle applying the expiry, then the retention (get: the state, None if gone)",
        )  # fmt: skip


def _server_now(redis_env: RedisEnv) -> Callable[[], int]:
    """The server's clock, in ns, as a story's clock."""
    return lambda: redis_env.server().time_us() * 1000


#: How a job finished before ``cancel`` meets it: acked, cancelled, dead after a nack, or
#: dead by its last lease's expiry — applied by the cancel's own settle, at that instant.
FINISHED = ["succeeded", "cancelled", "dead_by_nack", "dead_by_expiry"]


@rule("redis-extended", "redis-settle-first")
@extended
@pytest.mark.realtime
@pytest.mark.parametrize("how", FINISHED)
def test_stage3_cancel_of_a_finished_job_returns_false_and_changes_nothing(
    redis_env: RedisEnv, how: str
) -> None:
    """Every finished job — SUCCEEDED, CANCELLED or DEAD — is left alone by ``cancel``:
    False, the job as it was, a DEAD one still among the dead letters and still redriven
    by ``redrive``. A job whose last lease expires at the cancel's very instant is DEAD
    before the cancel looks at it: its script settles first."""
    redis_env.freeze_time()
    queue = new_queue(redis_env, lease_ns=100 * MS, max_attempts=1)
    job_id = queue.enqueue(how)
    lease = claim(queue)
    now = _server_now(redis_env)
    story = Story(f"max_attempts=1: {job_id} enqueued and claimed", now, now())
    state = SUCCEEDED if how == "succeeded" else CANCELLED if how == "cancelled" else DEAD
    if how == "succeeded":
        queue.ack(lease, "ok")
    elif how == "cancelled":
        story.check(queue.cancel(job_id) is True, "cancel of a LEASED job", "returned False")
    elif how == "dead_by_nack":
        queue.nack(lease, "boom")
    else:
        redis_env.pass_time(max(0, lease.expires_at_ns - now()))
    story.add("its lease expires now" if how == "dead_by_expiry" else how.replace("_", " "))
    before = None if how == "dead_by_expiry" else queue.get(job_id)
    invariant = "cancel leaves a finished job (SUCCEEDED, DEAD, CANCELLED) alone: False"
    with not_refused(story.tell(invariant, f"cancel({job_id!r})"), JobNotFound, StaleLease):
        got = queue.cancel(job_id)
    story.add(f"cancel({job_id!r}) -> {got!r}")
    story.expect(got, False, f"{invariant}; cancel() of the {state.name} job")
    job = queue.get(job_id)
    if before is not None:
        story.expect(job, before, f"{invariant}, changing nothing; get() after the cancel")
    else:
        story.expect(
            (job.state, job.finished_at_ns), (DEAD, lease.expires_at_ns),
            f"{invariant}; the settle first: (state, finished_at_ns) after the cancel",
        )  # fmt: skip
    dead = [job_id] if state is DEAD else []
    story.expect([j.id for j in queue.dead_letters()], dead, f"{invariant}; dead_letters()")
    counts = {s: int(s is state) for s in (SUCCEEDED, DEAD, CANCELLED)}
    want = QueueStatistics(0, 0, 0, counts[SUCCEEDED], counts[DEAD], counts[CANCELLED], 0)
    story.expect(queue.statistics(), want, f"{invariant}; statistics()")
    if state is DEAD:
        story.expect(queue.redrive(job_id), True, f"{invariant}; still DEAD: redrive()")


@rule("redis-idempotency", "redis-dedup-ttl", "ttl-retention")
@extended
@pytest.mark.realtime
def test_stage3_a_later_idempotency_key_outlives_an_earlier_ones_ttl(redis_env: RedisEnv) -> None:
    """Each idempotency record lives ``dedup_ttl_ns`` from its own first enqueue, however
    many records share what holds them: key a at 0, key b 200 ms later, TTL 300 ms. At
    350 ms a is forgotten and b still dedups (``statistics()`` counts b alone); on a frozen
    clock b holds to its last µs, 500 ms − 1 µs, and is forgotten at 500 ms exactly."""
    redis_env.freeze_time()
    ttl = 300 * MS
    queue = new_queue(redis_env, dedup_ttl_ns=ttl)
    now = _server_now(redis_env)
    story = Story(f"dedup_ttl_ns={ttl}:", now, now())
    invariant = (
        "an idempotency record dedups until its own first enqueue + dedup_ttl_ns, and is "
        "counted by statistics() until then"
    )

    def dedups(key: str, first: str, live: int) -> None:
        story.expect(queue.statistics().idempotency_keys, live, f"{invariant}; idempotency_keys")
        again = queue.enqueue(f"{key} again", idempotency_key=key)
        story.add(f"enqueue(key {key!r}) -> {again}")
        story.expect(again, first, f"{invariant}; key {key!r} is live: the first job's id")

    a = queue.enqueue("a", idempotency_key="a")
    story.add(f"enqueue(key 'a') -> {a}")
    redis_env.pass_time(200 * MS)
    b = queue.enqueue("b", idempotency_key="b")
    b_ends = now() + ttl
    story.add(f"enqueue(key 'b') -> {b}")
    redis_env.pass_time(150 * MS)
    story.add("a's record is past its TTL; b's has 150 ms left")
    dedups("b", b, 1)
    fresh = queue.enqueue("a again", idempotency_key="a")
    story.add(f"enqueue(key 'a') -> {fresh}")
    story.check(fresh != a, invariant, f"key 'a' past its TTL returned its old job {a}")
    if not redis_env.time_is_controlled:
        return  # a real server's clock cannot be stopped at b's very last µs
    redis_env.pass_time(b_ends - 1000 - now())
    story.add("1 µs before b's record ends")
    dedups("b", b, 2)
    redis_env.pass_time(1000)
    story.add("b's record ends: its first enqueue + dedup_ttl_ns")
    story.expect(queue.statistics().idempotency_keys, 1, f"{invariant}; idempotency_keys")
    late = queue.enqueue("b late", idempotency_key="b")
    story.check(late != b, invariant, f"key 'b' at its TTL's end returned its old job {b}")


#: What a zombie sends first once its lease has expired with more than a script settles at
#: once: each must find the lease stale and write nothing.
ZOMBIE_CALLS: dict[str, Callable[[SharedJobQueue, EffectStore, Lease], object]] = {
    "heartbeat": lambda queue, store, lease: queue.heartbeat(lease),
    "ack": lambda queue, store, lease: queue.ack(lease, "the zombie's result"),
    "commit": lambda queue, store, lease: store.commit(lease, "charged"),
}


@rule("redis-attempts", "redis-stale", "redis-fenced", "redis-extended")
@extended
@pytest.mark.parametrize("call", list(ZOMBIE_CALLS))
def test_stage3_a_lease_expired_with_a_thousand_others_is_stale_at_once(
    redis_env: RedisEnv, call: str
) -> None:
    """max_attempts=1: 1 001 jobs claimed at one instant, their workers gone; at the very
    µs their leases end, the last one's zombie calls first. A lease is live only while
    now < expires_at_ns, however many expire together and however few of them a script's
    bounded settle reaches: the zombie's call is refused (StaleLease), and the job dies of
    its expiry, with no effect and no result."""
    if not redis_env.time_is_controlled:
        pytest.skip("a real server's clock runs while 1 001 leases are taken: they differ")
    redis_env.freeze_time()
    lease_ns, many = 100 * MS, 1001
    queue = new_queue(redis_env, lease_ns=lease_ns, max_attempts=1)
    store = effect_store(queue)
    for i in range(many):
        queue.enqueue(i)
    leases = [claim(queue, f"w{i}") for i in range(many)]
    zombie = leases[-1]
    now = _server_now(redis_env)
    story = Story(f"max_attempts=1, lease_ns={lease_ns}: {many} jobs claimed", now, now())
    redis_env.pass_time(zombie.expires_at_ns - now())
    story.add(f"every lease's expires_at_ns: {many} leases expire together")
    invariant = (
        "a lease is live only while now < expires_at_ns: an expired one is stale, "
        "whatever is left to settle"
    )
    got = refusal(StaleLease, lambda: ZOMBIE_CALLS[call](queue, store, zombie))
    story.add(f"{call}(lease of {zombie.job_id}, token {zombie.token}) -> {got!r}")
    story.expect(got, True, f"{invariant}; the zombie's {call} (True: StaleLease)")
    job = queue.get(zombie.job_id)
    story.expect(
        (job.state, job.finished_at_ns, job.result), (DEAD, zombie.expires_at_ns, None),
        f"{invariant}; its expiry killed the job, the refused {call} wrote nothing: "
        "(state, finished_at_ns, result)",
    )  # fmt: skip
    story.expect(store.effects().get(zombie.job_id), None, f"{invariant}; the job's effect")


@rule("ttl-retention")
@extended
def test_stage3_statistics_counts_no_job_past_its_retention_however_many_pass_it(
    redis_env: RedisEnv,
) -> None:
    """1 005 jobs finish at one instant — most cancelled, the last 15 in turn acked, dead
    by a nack and cancelled — and one of each kind half a retention later. At the end of
    the first ones' retention exactly, statistics() counts only the later three: however
    many pass their retention at once, none is counted past it."""
    if not redis_env.time_is_controlled:
        pytest.skip("a real server's clock runs while 1 005 jobs finish: they differ")
    redis_env.freeze_time()
    retention, many = 100 * MS, 1005
    queue = new_queue(redis_env, retention_ns=retention, max_attempts=1)
    for i in range(many - 15):
        queue.cancel(queue.enqueue(i))
    for i in range(many - 15, many):
        queue.enqueue(i)
        finish(queue, claim(queue), i % 3)  # ack, nack (dead: max_attempts=1), cancel
    now = _server_now(redis_env)
    story = Story(f"retention_ns={retention}: {many} jobs finished", now, now())
    redis_env.pass_time(retention // 2)
    for turn in range(3):
        queue.enqueue(f"late {turn}")
        finish(queue, claim(queue), turn)
    story.add("one more acked, one dead by a nack, one cancelled")
    redis_env.pass_time(retention // 2)
    story.add(f"the first {many} jobs' retention ends")
    story.expect(
        queue.statistics(), QueueStatistics(0, 0, 0, 1, 1, 1, 0),
        "a finished job is counted by statistics() until its retention ends, and not from "
        "then on, however many pass it at once; statistics()",
    )  # fmt: skip


@rule("bounded-memory", "ttl-retention")
@extended
@pytest.mark.parametrize("how", ["finished_one_after_another", "died_with_nobody_calling"])
def test_stage3_a_finished_jobs_fields_go_when_its_retention_ends(
    redis_env: RedisEnv, how: str
) -> None:
    """retention_ns=100 ms, leases 50 ms. Jobs cancelled at 0, 60 and 120 ms (the newest
    keeps every TTL of the history alive): the call at 160 ms must let the one cancelled
    at 60 ms go. Or a job claimed at 0 whose worker crashed, nobody calling until 150 ms:
    that call's settle kills it at 50 ms and lets it go at once. Either way the queue
    holds less after that call than before it: a finished job's fields and index members
    go when its own retention ends, not when some TTL or a later call reaches them."""
    if not redis_env.time_is_controlled:
        pytest.skip("a real server's clock cannot be stopped at the retention's very µs")
    redis_env.freeze_time()
    queue = new_queue(redis_env, retention_ns=100 * MS, lease_ns=50 * MS, max_attempts=1)
    now = _server_now(redis_env)
    story = Story("retention_ns=100 ms, lease_ns=50 ms, max_attempts=1:", now, now())
    if how == "died_with_nobody_calling":
        queue.enqueue("crashes")
        claim(queue)
        story.add("a job claimed; its worker crashes, and nobody calls")
        before = key_sizes(redis_env)
        redis_env.pass_time(150 * MS)
    else:
        for at in (0, 60, 120):
            redis_env.pass_time(at * MS - (now() - story.origin_ns))
            queue.cancel(queue.enqueue("cancelled"))
            story.add("a job enqueued and cancelled")
        before = key_sizes(redis_env)  # the jobs cancelled at 60 and 120 ms
        redis_env.pass_time(40 * MS)
    queue.statistics()
    story.add("statistics(): a job's retention ends now")
    after = key_sizes(redis_env)
    story.check(
        sum(after.values()) < sum(before.values()),
        "a finished job's fields and index members go when its own retention ends",
        f"the queue held {sum(before.values())} members and fields before, "
        f"{sum(after.values())} after: {after}",
    )
