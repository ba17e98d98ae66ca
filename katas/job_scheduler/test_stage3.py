"""Stage 3 suite, the queue on Redis: core calls, each one script on the server's clock,
and the exact model replayed in the order Redis ran the calls (see
katas/job_scheduler/README.md, "Stage 3").

Runs on fakeredis by default; ``KATA_REDIS_SERVER=redis-server`` runs it on private real
servers, ``KATA_REDIS_URL=redis://…`` on an external one (see katas/_harness/redis.py).

How exactness is checked: every call returns an ``OpStamp`` (``queue.last_op()``): the
queue's operation counter and the server time its script ran at. Sorting any run's
calls by ``op`` — one thread's or many threads' — recovers the order Redis ran them in,
and the stage-1 suite's exact ``Model`` (written from the rules, never reading an
implementation) replayed in that order at those server times must give every result the
queue gave (:mod:`katas.job_scheduler._testing.replay`). On fakeredis the server clock is
frozen and moved by the test; on a real server it moves by itself, tests that need time
to pass are marked ``realtime``, and the replay still holds.

The stage's other suites: ``test_stage3_extended.py`` (heartbeats, release, cancel, dead
letters, idempotency keys, retention by TTL, the reaper, outages) and
``test_stage3_workers.py`` (``RedisWorker`` in process, and as OS processes the tests
SIGKILL, SIGSTOP and SIGTERM).

Map: a job's life (redis-attempts, server-time, redis-stale) · order (redis-order) ·
never early (redis-never-early, redis-next-due, run-at-server) · backoff, the tokens run
ahead of the attempts by a release or a redrive too (redis-backoff) · effects
(redis-fenced, redis-effect-by-job, restart-fence) · the client (client-contract) ·
unknown ids (redis-unknown-id) · the op counter (op-counter) · JSON and key prefix
(json, key-prefix) · bad input (a bool for every int too), one past each bound, and
every bound itself accepted and exact (redis-bad-input, whole-us, lua-bounds) · one
script (one-script) · the model replayed: state machines and racing clients (op-order,
redis-settle-first, redis-extended, redis-idempotency, redis-dedup-ttl, reap).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from katas._harness import marks
from katas._harness.marks import core, extended
from katas._harness.redis import RedisEnv
from katas._harness.story import expect, not_refused
from katas._harness.waiting import spawn
from katas.job_scheduler._testing.clients import WORKERS
from katas.job_scheduler._testing.queues import rejects
from katas.job_scheduler._testing.redis_queues import (
    LEASE,
    LUA_BOUND,
    MS,
    BadCall,
    bad_calls,
    claim,
    effect_store,
    fail_fast_on_redis_stubs,  # noqa: F401 (autouse)
    heavy,
    new_queue,
    stamp,
    text,
)
from katas.job_scheduler._testing.replay import Call, Replay, model_for, perform
from katas.job_scheduler._testing.states import DEAD, LEASED, SCHEDULED, SUCCEEDED
from katas.job_scheduler.api import (
    JobNotFound,
    Lease,
    OpStamp,
    RetryPolicy,
    StaleLease,
)

pytestmark = [pytest.mark.stage(3)]


@marks.rule("redis-attempts", "server-time", "redis-stale")
@core
def test_stage3_enqueue_claim_ack_runs_a_job_once(redis_env: RedisEnv) -> None:
    redis_env.freeze_time()
    node = redis_env.server()
    queue = new_queue(redis_env)
    before = node.time_us() * 1000
    job_id = queue.enqueue({"prompt": "hello"})
    lease = claim(queue, "w1")
    after = node.time_us() * 1000
    assert lease.job_id == job_id and (lease.token, lease.attempt) == (1, 1), (
        f"the first claim of {job_id!r} should carry token 1, attempt 1; got {lease}"
    )
    assert queue.lease_ns == LEASE, (
        f"queue.lease_ns is the lease_ns the queue was built with ({LEASE}); got {queue.lease_ns}"
    )
    assert before <= lease.expires_at_ns - queue.lease_ns <= after, (
        f"the lease must expire lease_ns after the claim on the SERVER's clock "
        f"(between {before} and {after} + lease_ns); got {lease.expires_at_ns}"
    )
    assert queue.claim("w2") is None, "a leased job was claimed a second time"
    queue.ack(lease, {"tokens": 12})
    job = queue.get(job_id)
    assert (job.state, job.result, job.attempts, job.payload) == (
        SUCCEEDED, {"tokens": 12}, 1, {"prompt": "hello"}
    ), f"after ack, get() should show SUCCEEDED with the result; got {job}"  # fmt: skip
    with pytest.raises(StaleLease):
        queue.ack(lease)
        raise AssertionError("a second ack of a finished job was accepted")


@marks.rule("server-time")
@core
def test_stage3_every_time_is_the_servers_not_the_clients(redis_env: RedisEnv) -> None:
    """Worker clocks disagree by seconds; only the server's TIME may count. (On fakeredis
    the server clock is frozen in 2023, so a client clock anywhere shows at once.)"""
    redis_env.freeze_time()
    node = redis_env.server()
    queue = new_queue(redis_env)
    job_id = queue.enqueue("x", delay_ns=0)
    now = node.time_us() * 1000
    job = queue.get(job_id)
    stamp_now = stamp(queue, "get").server_now_ns
    assert abs(job.enqueued_at_ns - now) < 5_000 * MS and abs(stamp_now - now) < 5_000 * MS, (
        f"enqueued_at_ns {job.enqueued_at_ns} and last_op().server_now_ns "
        f"{stamp_now} must be the server's TIME ({now}); this process's clock says "
        f"{time.time_ns()}"
    )
    lease = claim(queue)
    assert lease.expires_at_ns == stamp(queue, "claim").server_now_ns + LEASE, (
        f"expires_at_ns must be the claim's server time + lease_ns; got {lease}"
    )


@marks.rule("redis-order")
@core
def test_stage3_claim_takes_highest_priority_then_earliest_due_then_oldest(
    redis_env: RedisEnv,
) -> None:
    redis_env.freeze_time()
    queue = new_queue(redis_env)
    now = redis_env.server().time_us() * 1000
    ids = {
        "low": queue.enqueue("low", priority=-5),
        "normal-1": queue.enqueue("normal-1"),
        "urgent": queue.enqueue("urgent", priority=10),
        "normal-2": queue.enqueue("normal-2"),
        "normal-early": queue.enqueue("normal-early", run_at_ns=now - 1000 * MS),
        "urgent-2": queue.enqueue("urgent-2", priority=10),
    }
    order = [queue.get(claim(queue).job_id).payload for _ in ids]
    expected = ["urgent", "urgent-2", "normal-early", "normal-1", "normal-2", "low"]
    assert order == expected, (
        f"claims must take the highest priority first, then the earliest due "
        f"time, then enqueue order (never comparing payloads or ids); expected {expected}, "
        f"got {order}"
    )


@marks.rule("redis-order")
@core
def test_stage3_equal_jobs_come_out_in_enqueue_order_past_the_ninth(redis_env: RedisEnv) -> None:
    redis_env.freeze_time()  # one instant: every job has the same priority and due time
    queue = new_queue(redis_env)
    ids = [queue.enqueue({"n": n}) for n in range(12)]
    got = [claim(queue).job_id for _ in ids]
    assert got == ids, (
        f"12 equal jobs enqueued at one instant must be claimed in enqueue order "
        f"(ties broken by the sequence number, never by the id: 'job-10' < 'job-9' as "
        f"text); expected {ids}, got {got}"
    )


@marks.rule("redis-never-early", "redis-next-due", "run-at-server")
@core
@pytest.mark.realtime
def test_stage3_job_is_not_claimed_before_its_run_at(redis_env: RedisEnv) -> None:
    redis_env.freeze_time()
    queue = new_queue(redis_env)
    later = queue.enqueue("later", delay_ns=200 * MS)
    due = queue.get(later).run_at_ns
    enqueued = stamp(queue, "get").server_now_ns
    assert queue.claim("w") is None, "a job was claimed before its delay_ns passed"
    assert queue.next_due_ns() == due, (
        f"next_due_ns() should be the delayed job's run time {due}, got {queue.next_due_ns()}"
    )
    redis_env.pass_time(due - stamp(queue, "next_due_ns").server_now_ns + 1000)
    lease = claim(queue)
    assert lease.job_id == later and stamp(queue, "claim").server_now_ns >= due, (
        f"the job was due at {due} (enqueued at {enqueued}); got {lease}"
    )


@marks.rule("redis-next-due")
@core
def test_stage3_next_due_is_the_earliest_lease_expiry_when_nothing_else_is_due(
    redis_env: RedisEnv,
) -> None:
    """Every job leased, one scheduled later than the leases run out: the next thing due
    is a lease's expiry (it may bring a job back), not the scheduled job."""
    redis_env.freeze_time()
    queue = new_queue(redis_env, lease_ns=100 * MS)
    queue.enqueue("leased")
    lease = claim(queue)
    expect(queue.next_due_ns(), lease.expires_at_ns, "next_due_ns() with one job, leased")
    queue.enqueue("later", delay_ns=10**12)
    expect(
        queue.next_due_ns(), lease.expires_at_ns,
        "next_due_ns() with the lease expiring before the scheduled job's run time",
    )  # fmt: skip


@marks.rule("redis-attempts", "redis-stale")
@core
@pytest.mark.realtime
def test_stage3_expired_lease_costs_an_attempt_and_fences_the_zombie(
    redis_env: RedisEnv,
) -> None:
    redis_env.freeze_time()
    queue = new_queue(redis_env, lease_ns=100 * MS)
    job_id = queue.enqueue({"n": 1})
    zombie = claim(queue, "w1")
    expect(queue.is_current(zombie), True, "is_current of the lease just granted")
    redis_env.pass_time(100 * MS)  # the lease's expiry: no longer live
    expect(queue.is_current(zombie), False, "is_current of a lease at its expires_at_ns")
    second = claim(queue, "w2")
    expect(queue.is_current(second), True, "is_current of the job's new lease")
    expect(
        queue.is_current(zombie),
        False,
        "is_current of w1's expired lease once w2 holds the job (LEASED again, but with "
        "token 2: a lease is live only with the job's current token)",
    )
    assert (second.job_id, second.token, second.attempt) == (job_id, 2, 2), (
        f"after w1's lease expired, the job must come back with token 2 and "
        f"attempt 2 (the crash cost an attempt); got {second}"
    )
    for call in (queue.ack, queue.nack):
        args = (zombie, "late") if call == queue.nack else (zombie,)
        with pytest.raises(StaleLease):
            call(*args)
            raise AssertionError(f"the zombie's {call.__name__} was accepted")
    assert queue.get(job_id).state is LEASED and queue.get(job_id).worker_id == "w2"
    queue.ack(second, "w2's result")
    assert queue.get(job_id).result == "w2's result"
    expect(queue.is_current(second), False, "is_current of the lease of a job acked")


@marks.rule("redis-backoff")
@core
@pytest.mark.realtime
def test_stage3_nack_retries_after_backoff_then_dies_after_max_attempts(
    redis_env: RedisEnv,
) -> None:
    redis_env.freeze_time()
    queue = new_queue(redis_env, retry=RetryPolicy(100 * MS, 150 * MS, "none"), max_attempts=3)
    job_id = queue.enqueue("flaky")
    for attempt, delay in ((1, 100 * MS), (2, 150 * MS)):
        lease = claim(queue)
        queue.nack(lease, f"503 #{attempt}")
        failed_at = stamp(queue, "nack").server_now_ns
        job = queue.get(job_id)
        assert (job.state, job.run_at_ns, job.last_error) == (
            SCHEDULED, failed_at + delay, f"503 #{attempt}"
        ), (
            f"after attempt {attempt} failed at {failed_at}, the retry must wait "
            f"min(cap, base·2^(n-1)) = {delay} ns; got {job}"
        )  # fmt: skip
        assert queue.claim("w") is None, "a retry was claimed before its backoff"
        redis_env.pass_time(delay)
    lease = claim(queue)
    queue.nack(lease, "503 #3")
    job = queue.get(job_id)
    assert (job.state, job.attempts) == (DEAD, 3), (
        f"after max_attempts=3 failed attempts the job is DEAD; got {job}"
    )


@marks.rule("redis-backoff", "redis-extended")
@extended
@pytest.mark.realtime
@pytest.mark.parametrize("failure", ["nack", "expiry"])
@pytest.mark.parametrize("ahead", ["released", "redriven"])
def test_stage3_backoff_counts_the_failed_attempt_not_the_tokens_issued(
    redis_env: RedisEnv, ahead: str, failure: str
) -> None:
    """A job's tokens run ahead of its attempts — a release refunds the attempt and keeps
    the token, a redrive zeroes the attempts and never the tokens. Each retry after that
    waits min(cap, base·2^(n-1)) for n the attempt that failed (by ``nack``, or by its
    lease's ``expiry``, counted from the expiry), whatever token its lease carried."""
    redis_env.freeze_time()
    base, cap, lease_ns = 10 * MS, 1000 * MS, 100 * MS
    queue = new_queue(
        redis_env, lease_ns=lease_ns, retry=RetryPolicy(base, cap, "none"), max_attempts=3
    )
    job_id = queue.enqueue("flaky")
    history: list[str] = []

    def due(run_at_ns: int) -> None:  # server time passes up to the retry's run time
        redis_env.pass_time(max(0, run_at_ns - stamp(queue, "get").server_now_ns))

    if ahead == "released":
        queue.release(claim(queue))
        history.append("claimed (token 1) and released: the attempt refunded")
    else:
        for _ in range(3):
            queue.nack(claim(queue), "503")
            due(queue.get(job_id).run_at_ns)
        assert queue.redrive(job_id) is True, f"the job is DEAD: {queue.get(job_id)}"
        history.append("failed 3 times (tokens 1 to 3), DEAD, redriven: attempts zeroed")
    for attempt in (1, 2):
        lease = claim(queue)
        if failure == "nack":
            queue.nack(lease, "503")
            failed_at = stamp(queue, "nack").server_now_ns
        else:
            redis_env.pass_time(lease_ns)
            failed_at = lease.expires_at_ns
        job = queue.get(job_id)
        history.append(f"attempt {lease.attempt} (token {lease.token}) failed by {failure}")
        expect(
            (lease.attempt, job.run_at_ns - failed_at),
            (attempt, min(cap, base * 2 ** (attempt - 1))),
            f"base {base}, cap {cap}: " + "; ".join(history) + " — (the attempt that failed, "
            "its retry's run_at_ns less the failure's server time): the exponent is the "
            "attempt's, never the token's",
        )
        due(job.run_at_ns)


@marks.rule("redis-fenced", "redis-effect-by-job")
@core
@pytest.mark.realtime
def test_stage3_effect_store_commits_once_per_job_and_refuses_stale_leases(
    redis_env: RedisEnv,
) -> None:
    redis_env.freeze_time()
    queue = new_queue(redis_env, lease_ns=100 * MS)
    store = effect_store(queue)
    job_id = queue.enqueue("charge $5")
    first = claim(queue, "w1")
    assert store.commit(first, "charged") is True, "the first commit must commit"
    assert store.effects() == {job_id: "charged"}, (
        f"{job_id} is LEASED, its effect committed and not yet acked: the queue holds it, so "
        f"effects() holds its effect; got {store.effects()}"
    )
    redis_env.pass_time(100 * MS)  # w1 dies between effect and ack: its lease expires
    with pytest.raises(StaleLease):
        store.commit(first, "charged again")
        raise AssertionError("the expired lease's commit was accepted")
    waiting = queue.get(job_id).state
    assert store.effects() == {job_id: "charged"}, (
        f"{job_id} is {waiting.name}, waiting for its retry after w1 died between commit and "
        f"ack: the queue still holds it, so effects() holds its effect; got {store.effects()}"
    )
    rerun = claim(queue, "w2")
    assert store.commit(rerun, "charged") is False, (
        "the re-run after a crash between effect and ack must find the effect "
        "committed (effects are keyed by job id, not by job and token), so commit returns "
        "False and the worker just acks"
    )
    queue.ack(rerun, "charged")
    assert store.effects() == {job_id: "charged"}, (
        f"exactly one effect per job; got {store.effects()}"
    )


@marks.rule("restart-fence", "redis-fenced")
@core
@pytest.mark.realtime
def test_stage3_a_store_lost_and_started_again_never_fences_a_zombie_onto_a_new_job(
    redis_env: RedisEnv,
) -> None:
    """alice's worker holds a lease; the store is lost (a restart without persistence);
    bob's job is enqueued into the empty store. alice's zombie must not commit or ack
    bob's job, however the ids are made."""
    redis_env.freeze_time()
    queue = new_queue(redis_env)
    store = effect_store(queue)
    alice = queue.enqueue("alice's job")
    zombie = claim(queue, "alice-worker")
    redis_env.pass_time(MS)  # the store lived a while (a real store lives far longer)
    admin = redis_env.server().client()
    lost = redis_env.keys()
    assert lost, "the queue keeps its state under the test's key prefix"
    admin.delete(*lost)  # the store is gone: a restart without persistence, for this queue
    bob = queue.enqueue("bob's job")
    rightful = claim(queue, "bob-worker")
    assert bob != alice, (
        f"the emptied store gave bob's job the id of alice's ({bob}): a zombie's lease on "
        "the old job would pass the fence on the new one"
    )
    zombie_calls: list[tuple[str, Callable[[], Any]]] = [
        ("commit", lambda: store.commit(zombie, "alice's effect")),
        ("ack", lambda: queue.ack(zombie, "alice's result")),
        ("heartbeat", lambda: queue.heartbeat(zombie)),
    ]
    for what, call in zombie_calls:
        with pytest.raises((StaleLease, JobNotFound)):
            call()
            raise AssertionError(
                f"alice's zombie {what} (lease {zombie}) was accepted after the store was "
                f"lost: it landed on bob's job {bob}"
            )
    assert store.commit(rightful, "bob's effect") is True
    queue.ack(rightful, "bob's result")
    job = queue.get(bob)
    assert (job.state, job.result, store.effects()) == (
        SUCCEEDED,
        "bob's result",
        {bob: "bob's effect"},
    ), f"bob's job carries bob's effect and result only: {job}, {store.effects()}"


@marks.rule("client-contract")
@core
def test_stage3_a_client_that_hangs_or_retries_is_refused(redis_env: RedisEnv) -> None:
    # Nothing is sent (the port is closed): the check comes before any command.
    for flaw, client, says in [
        ("has no socket_timeout", redis.Redis(port=1), "socket_timeout"),
        ("retries (redis-py's default)", redis.Redis(port=1, socket_timeout=0.2), "retr"),
    ]:
        with pytest.raises(ValueError, match="client") as refused:
            new_queue(redis_env, client)
        assert says in str(refused.value), (
            f"RedisJobQueue over a client that {flaw} must be refused, the ValueError saying "
            f"{says!r}: a lost reply must not run a script twice; got {refused.value}"
        )


@marks.rule("redis-unknown-id")
@core
def test_stage3_unknown_job_raises_job_not_found(redis_env: RedisEnv) -> None:
    queue = new_queue(redis_env)
    ghost = Lease("job-404", 1, 1, 0, "w")
    calls: dict[str, Callable[[], Any]] = {
        "get": lambda: queue.get("job-404"),
        "ack": lambda: queue.ack(ghost),
        "nack": lambda: queue.nack(ghost, "x"),
        "heartbeat": lambda: queue.heartbeat(ghost),
        "release": lambda: queue.release(ghost),
        "cancel": lambda: queue.cancel("job-404"),
        "redrive": lambda: queue.redrive("job-404"),
    }
    for name, call in calls.items():
        rejects(JobNotFound, call, f"{name} on an unknown job id")
    rejects(
        StaleLease,
        lambda: effect_store(queue).commit(ghost, "effect"),
        "commit with a lease of a job the queue does not hold (a zombie must stop, as in "
        "stage 1) was accepted",
    )


@marks.rule("run-at-server", "redis-never-early")
@core
def test_stage3_run_at_is_rounded_up_to_a_whole_microsecond(redis_env: RedisEnv) -> None:
    redis_env.freeze_time()
    queue = new_queue(redis_env)
    now = redis_env.server().time_us() * 1000
    job_id = queue.enqueue("soon", run_at_ns=now + 1)  # 1 ns past a whole µs
    job = queue.get(job_id)
    assert job.run_at_ns == now + 1000, (
        f"run_at_ns = server now + 1 ns must be rounded UP to the next whole µs "
        f"({now + 1000}), never down to now (the job would run 1 ns early); got {job.run_at_ns}"
    )
    delayed = queue.enqueue("in 1 ns", delay_ns=1)
    enqueued = stamp(queue, "enqueue").server_now_ns
    assert queue.get(delayed).run_at_ns == enqueued + 1000, (
        f"delay_ns=1, enqueued at the server's {enqueued}: due at {enqueued} + 1 ns, rounded "
        f"UP to {enqueued + 1000}, never down to now; got {queue.get(delayed).run_at_ns}"
    )
    if not redis_env.time_is_controlled:  # a real server's clock has moved on meanwhile
        return
    assert queue.claim("w") is None, "a job due 1 ns from now was claimed now"
    redis_env.pass_time(1000)
    assert [claim(queue).job_id, claim(queue).job_id] == [job_id, delayed], (
        "at their rounded run time both jobs are READY, in enqueue order"
    )


@marks.rule("op-counter")
@core
def test_stage3_last_op_is_the_calling_threads_own(redis_env: RedisEnv) -> None:
    queue = new_queue(redis_env)
    assert queue.last_op() is None, "last_op() before any call must be None"
    queue.enqueue("a")
    mine = stamp(queue, "enqueue")
    seen: list[OpStamp | None] = []

    def other_thread() -> None:
        seen.append(queue.last_op())  # nothing called on this thread yet
        queue.next_due_ns()
        seen.append(queue.last_op())

    spawn(other_thread, "other").outcome("the other thread's two calls")
    assert seen[0] is None and isinstance(seen[1], OpStamp) and seen[1].op > mine.op, (
        f"last_op() is per thread: None on a thread that has made no call, then that "
        f"thread's own call's stamp (after {mine}); got {seen}"
    )
    assert queue.last_op() == mine, (
        f"another thread's call must not change this thread's last_op(): expected "
        f"{mine}, got {queue.last_op()}"
    )


@marks.rule("json", "key-prefix")
@core
def test_stage3_values_travel_as_json_under_the_key_prefix(redis_env: RedisEnv) -> None:
    redis_env.freeze_time()
    queue = new_queue(redis_env)
    store = effect_store(queue)
    job_id = queue.enqueue({"pair": (1, 2), "n": None})
    lease = claim(queue)
    assert store.commit(lease, ("charged", 5)) is True
    queue.ack(lease, (3, 4))
    job = queue.get(job_id)
    got = (job.payload, job.result, store.effects())
    want = ({"pair": [1, 2], "n": None}, [3, 4], {job_id: ["charged", 5]})
    assert got == want, (
        f"payloads, results and effects come back as JSON gives them back (a tuple "
        f"as a list): expected {want}, got {got}"
    )
    if redis_env.mode != "url":  # a private server holds only this test's keys
        admin = redis_env.server().client()
        outside = [text(k) for k in admin.keys("*") if not text(k).startswith(redis_env.prefix)]
        assert not outside, (
            f"every key of the queue must start with key_prefix "
            f"{redis_env.prefix!r}; these do not: {outside}"
        )


@marks.rule("key-prefix")
@core
def test_stage3_queues_with_other_names_under_one_prefix_share_nothing(
    redis_env: RedisEnv,
) -> None:
    redis_env.freeze_time()
    emails = new_queue(redis_env, name="emails")
    reports = new_queue(redis_env, name="reports")
    first = emails.enqueue("welcome")
    story = "queues 'emails' and 'reports' under one key_prefix; 'emails' enqueued one job"
    expect(reports.claim("w"), None, f"{story}: reports.claim() finds nothing of it")
    expect(reports.statistics().ready, 0, f"{story}: reports.statistics().ready")
    expect(
        reports.enqueue("weekly").split("@")[0],
        first.split("@")[0],
        f"{story}, then 'reports' enqueued one: each queue numbers its own jobs from 1",
    )
    keys = sorted(text(k) for k in redis_env.client().scan_iter(match=f"{redis_env.prefix}*"))
    tags = sorted({k[len(redis_env.prefix) :].split("}")[0] + "}" for k in keys})
    expect(
        tags,
        ["{emails}", "{reports}"],
        f"{story}: each queue's keys are <key_prefix>{{<name>}}:…, the name its hash tag; "
        f"the keys written were {keys}",
    )


@marks.rule("redis-bad-input", "whole-us", "json", "lua-bounds")
@core
@pytest.mark.parametrize(("call", "parameter", "case"), bad_calls())
def test_stage3_bad_input_raises_naming_the_parameter_and_writes_nothing(
    redis_env: RedisEnv, call: BadCall, parameter: str, case: str
) -> None:
    redis_env.freeze_time()
    queue = new_queue(redis_env)
    queue.enqueue({"n": 1})
    lease = claim(queue)
    before = redis_env.contents()
    with pytest.raises((TypeError, ValueError)) as raised:
        call(redis_env, queue, lease)
        raise AssertionError(
            f"a queue with one job leased, then the call '{case}': accepted, but a bad "
            f"{parameter} must raise TypeError or ValueError naming it (a bool is not an "
            "int here, even where its value would be valid)"
        )
    assert parameter in str(raised.value), (
        f"the error for a bad {parameter} must name it; got {raised.value!r}"
    )
    after = redis_env.contents()
    assert after == before, (
        f"a call refused for its {parameter} must write nothing to Redis (validate "
        f"before the script runs); keys changed: "
        f"{sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))}"
    )


@marks.rule("lua-bounds", "server-time", "redis-backoff")
@extended
def test_stage3_every_bound_of_exactly_2_to_the_52_is_accepted_and_held_exactly(
    redis_env: RedisEnv,
) -> None:
    """Durations and times at most 2^52 µs, counts at most 2^52: the bound itself is
    accepted — by the constructor and by enqueue — and every sum a script makes with it
    on the server's time (a due time, an expiry, a backoff, a TTL) is exact to the µs."""
    redis_env.freeze_time()
    most = LUA_BOUND * 1000  # 2^52 µs, in ns
    what = (
        "lease_ns, retry.base_ns, retry.cap_ns, dedup_ttl_ns and retention_ns of 2^52 µs, "
        "max_attempts and max_pending of 2^52"
    )
    with not_refused(f"RedisJobQueue with {what}: each is at most its bound", ValueError):
        queue = new_queue(
            redis_env, lease_ns=most, retry=RetryPolicy(most, most, "none"),
            max_attempts=LUA_BOUND, max_pending=LUA_BOUND, dedup_ttl_ns=most, retention_ns=most,
        )  # fmt: skip
    with not_refused("enqueue(delay_ns=2^52 µs): at most the bound", ValueError):
        later = queue.enqueue("in 2^52 µs", delay_ns=most)
    enqueued = stamp(queue, "enqueue").server_now_ns
    with not_refused("enqueue(run_at_ns=2^52 µs): at most the bound", ValueError):
        latest = queue.enqueue("at 2^52 µs", run_at_ns=most)
    now = queue.enqueue("now", idempotency_key="k")
    expect(
        (queue.get(later).run_at_ns, queue.get(latest).run_at_ns),
        (enqueued + most, most),
        f"a queue with {what}; run_at_ns of the job enqueued at {enqueued} with delay_ns=2^52 "
        "µs, and of the one with run_at_ns=2^52 µs (exact, to the µs)",
    )
    lease = claim(queue)
    expect(
        (lease.job_id, lease.expires_at_ns - stamp(queue, "claim").server_now_ns),
        (now, most),
        "the due job's claim, and its lease's expiry less the claim's server time (lease_ns)",
    )
    queue.nack(lease, "503")
    failed_at = stamp(queue, "nack").server_now_ns
    job = queue.get(now)
    expect(
        (job.state, job.max_attempts, job.run_at_ns - failed_at),
        (SCHEDULED, LUA_BOUND, most),
        "after its first failure, with max_attempts=2^52 and a backoff of base = cap = 2^52 "
        "µs: (state, max_attempts, its retry's run_at_ns less the nack's server time)",
    )
    expect(
        queue.enqueue("now again", idempotency_key="k"), now,
        "an enqueue with the same idempotency key, its record kept 2^52 µs",
    )  # fmt: skip


@marks.rule("one-script")
@core
def test_stage3_each_transition_is_one_round_trip(redis_env: RedisEnv) -> None:
    proxy = redis_env.proxy()
    queue = new_queue(redis_env, redis_env.server().proxied_client(proxy))
    store = effect_store(queue)

    def lifecycle() -> list[tuple[str, Callable[[], Any]]]:
        box: dict[str, Any] = {}
        return [
            ("enqueue", lambda: box.update(a=queue.enqueue("a"), b=queue.enqueue("b"))),
            ("claim", lambda: box.update(lease=queue.claim("w"))),
            ("get", lambda: queue.get(box["a"])),
            ("commit", lambda: store.commit(box["lease"], 1)),
            ("ack", lambda: queue.ack(box["lease"], 1)),
            ("claim", lambda: box.update(lease=queue.claim("w"))),
            ("nack", lambda: queue.nack(box["lease"], "boom")),
            ("next_due_ns", queue.next_due_ns),
        ]

    for _name, step in lifecycle():  # once to load the scripts (NOSCRIPT, then LOAD)
        step()
    for name, step in lifecycle():
        proxy.reset_counts()
        step()
        counts = proxy.counts()
        expected = 2 if name == "enqueue" else 1  # that step enqueues two jobs
        assert counts.round_trips == expected, (
            f"{name} must be ONE round trip (one EVALSHA of one script); it took "
            f"{counts.round_trips}: {list(counts.commands)}"
        )
        assert all(c == "EVALSHA" for c in counts.commands), (
            f"{name} must run as one script, not as separate commands: {list(counts.commands)}"
        )


# --- the exact model replayed: random calls, every result judged in op order -----------


class RedisQueueMachine(RuleBasedStateMachine):
    """Random calls on one queue, each judged at once by the stage-1 model in op order.

    Core calls only, or (``extended``) every call. Time passes by the test on fakeredis
    and by itself (plus short sleeps) on a real server: the stamps make it exact.
    """

    extended = False

    def __init__(self) -> None:
        super().__init__()
        self.env = RedisEnv.from_environment(name="stage3-machine", realtime=True)
        self.env.freeze_time()
        self.leases: list[Lease] = []

    @initialize(
        base=st.sampled_from([0, 20, 50]),
        extra=st.sampled_from([0, 40]),
        max_attempts=st.integers(1, 3),
        lease_ms=st.sampled_from([30, 80]),
        data=st.data(),
    )
    def build(
        self, base: int, extra: int, max_attempts: int, lease_ms: int, data: st.DataObject
    ) -> None:
        options: dict[str, Any] = {
            "lease_ns": lease_ms * MS,
            "retry": RetryPolicy(base * MS, (base + extra) * MS, "none"),
            "max_attempts": max_attempts,
        }
        if self.extended:
            options["dedup_ttl_ns"] = data.draw(st.sampled_from([0, 60 * MS]), label="dedup")
            options["retention_ns"] = data.draw(st.sampled_from([0, 70 * MS]), label="retention")
            options["max_pending"] = data.draw(st.sampled_from([None, 3]), label="max_pending")
        self.queue = new_queue(self.env, **options)
        self.replay = Replay(model_for(options), f"RedisJobQueue({options})")

    def teardown(self) -> None:
        self.env.close()

    def call(self, what: str, *args: Any) -> Call:
        c = perform(self.queue, what, *args)
        self.replay.check(c)
        if what == "claim" and c.outcome[1] is not None:
            self.leases.append(c.outcome[1])
        return c

    def lease(self, i: int) -> Lease:
        return self.leases[-1 - i % len(self.leases)]

    @rule(
        priority=st.integers(-1, 1),
        delay_ms=st.sampled_from([None, 0, 40]),
        key=st.sampled_from([None, "k1", "k2"]),
    )
    def enqueue(self, priority: int, delay_ms: int | None, key: str | None) -> None:
        now = self.env.server().time_us() * 1000
        run_at = None if delay_ms is None else now + delay_ms * MS
        key = key if self.extended else None
        self.call("enqueue", {"n": len(self.replay.ids) + 1}, priority, run_at, key)

    @rule(worker=st.sampled_from(WORKERS))
    def claim(self, worker: str) -> None:
        self.call("claim", worker)

    @precondition(lambda self: self.leases)
    @rule(i=st.integers(0, 4), result=st.sampled_from([None, 7, "ok"]))
    def ack(self, i: int, result: Any) -> None:
        self.call("ack", self.lease(i), result)

    @precondition(lambda self: self.leases)
    @rule(i=st.integers(0, 4))
    def nack(self, i: int) -> None:
        self.call("nack", self.lease(i), "boom")

    @precondition(lambda self: self.leases)
    @rule(i=st.integers(0, 4), effect=st.sampled_from([1, "x"]))
    def commit(self, i: int, effect: Any) -> None:
        self.call("commit", self.lease(i), effect)

    @precondition(lambda self: self.replay.ids)
    @rule(data=st.data())
    def get(self, data: st.DataObject) -> None:
        self.call("get", data.draw(st.sampled_from(sorted(self.replay.seqs)), label="job"))

    @rule()
    def next_due_ns(self) -> None:
        self.call("next_due_ns")

    @rule(ms=st.sampled_from([1, 20, 45, 90]))
    def pass_time(self, ms: int) -> None:
        self.env.pass_time(ms * MS)
        self.replay.note(f"test.pass_time({ms} ms)")


class ExtendedRedisQueueMachine(RedisQueueMachine):
    extended = True

    @precondition(lambda self: self.leases)
    @rule(i=st.integers(0, 4), how=st.sampled_from(["heartbeat", "release", "is_current"]))
    def lease_call(self, i: int, how: str) -> None:
        self.call(how, self.lease(i))

    @precondition(lambda self: self.replay.ids)
    @rule(data=st.data(), how=st.sampled_from(["cancel", "redrive"]))
    def job_call(self, data: st.DataObject, how: str) -> None:
        self.call(how, data.draw(st.sampled_from(sorted(self.replay.seqs)), label="job"))

    @rule(how=st.sampled_from(["statistics", "reap"]))
    def queue_call(self, how: str) -> None:
        self.call(how)


TestStage3QueueMatchesTheModel = marks.rule(
    "redis-order", "redis-never-early", "redis-attempts", "redis-stale", "redis-backoff",
    "redis-next-due", "redis-settle-first", "redis-fenced", "redis-effect-by-job", "op-counter",
)(pytest.mark.realtime(core(RedisQueueMachine.TestCase)))  # fmt: skip
TestStage3QueueMatchesTheModel.settings = settings(heavy, stateful_step_count=30)
TestStage3ExtendedQueueMatchesTheModel = marks.rule(
    "redis-extended", "redis-unknown-id", "redis-idempotency", "redis-dedup-ttl", "reap",
)(pytest.mark.realtime(extended(ExtendedRedisQueueMachine.TestCase)))  # fmt: skip
TestStage3ExtendedQueueMatchesTheModel.settings = settings(heavy, stateful_step_count=30)


@marks.rule("op-order", "op-counter", "redis-fenced")
@core
@pytest.mark.realtime
@pytest.mark.parametrize("seed", [1, 2])
def test_stage3_concurrent_clients_are_explained_by_the_model_in_op_order(
    redis_env: RedisEnv, seed: int
) -> None:
    """4 threads, each a machine of its own (own client, own queue object), race on one
    queue; sorted by op, the stage-1 model must explain every result they saw."""
    options: dict[str, Any] = {
        "lease_ns": 40 * MS, "retry": RetryPolicy(5 * MS, 20 * MS, "none"), "max_attempts": 2,
    }  # fmt: skip
    calls: list[Call] = []
    lock = threading.Lock()
    start = threading.Barrier(4)
    queues = [new_queue(redis_env, c, **options) for c in redis_env.clients(4)]

    def client(n: int) -> None:
        rng = random.Random(seed * 100 + n)
        queue = queues[n]
        leases: list[Lease] = []
        start.wait(10)
        for i in range(40):
            kind = rng.choice(["enqueue", "enqueue", "claim", "claim", "ack", "nack", "commit"])
            if kind in ("ack", "nack", "commit") and not leases:
                kind = "claim"
            if kind == "enqueue":
                args: tuple[Any, ...] = ({"t": n, "i": i}, rng.randint(0, 1), None, None)
            elif kind == "claim":
                args = (f"w{n}",)
            else:
                extra = {"ack": "done", "nack": "boom", "commit": i}[kind]
                args = (rng.choice(leases[-3:]), extra)
            c = perform(queue, kind, *args, who=f"t{n}")
            if kind == "claim" and c.outcome[1] is not None:
                leases.append(c.outcome[1])
            with lock:
                calls.append(c)

    threads = [threading.Thread(target=client, args=(n,), daemon=True) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
        assert not t.is_alive(), "a client thread did not finish within 60 s"
    assert len(calls) == 160, f"a client thread failed ({len(calls)} of 160 calls)"
    replay = Replay(model_for(options), f"4 threads on RedisJobQueue({options})")
    replay.check_real_time_order(calls)
    for c in sorted(calls, key=lambda c: c.stamp.op):
        replay.check(c)
