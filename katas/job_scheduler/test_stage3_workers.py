"""Stage 3 suite, the worker: ``RedisWorker`` in this process on a test clock, then as
OS processes (``python -m katas._harness.child katas.job_scheduler._testing.worker:run``)
that the tests SIGKILL, SIGSTOP and SIGTERM for real (see katas/job_scheduler/README.md,
"Stage 3").

In process, the worker's ``ManualClock`` paces its heartbeats and polls, so a test
decides exactly when each one is due (server time plays no part there, but where a test
sets the worker's clock an hour off the server's ``TIME`` and moves both); a
``LateWakes`` clock holds the wake-up of the worker's other threads, so that the clock
moves between a claim and the heartbeat thread noticing it. As processes, each worker
prints its events as it goes (:mod:`katas.job_scheduler._testing.worker`), holds at a
named point when told, and the test strikes there; the workers' transcripts come with
every failure (:mod:`katas.job_scheduler._testing.fleets`). Every effect must land
exactly once, whatever was killed when.

Map: in process (worker-heartbeat-default on leases whose third is whole or not,
worker-heartbeats; the first heartbeat however late the heartbeat thread wakes:
worker-heartbeat-default; a clock an hour off the server's either way: worker-clock,
fault-skew; worker-nack, worker-events, worker-run, worker-poll, worker-loop; held at an
exact point of its loop: worker-stale-drops, worker-outage, worker-stop; a release at
the grace deadline meeting a stale lease: worker-stale-drops; or an outage, waited out:
worker-outage, worker-stop; a release between commit and ack: worker-events; the
heartbeat thread through every refusal and a lost job: worker-heartbeats,
busy-unavailable) · SIGKILL
mid-job (fault-sigkill) · SIGSTOP past the lease (fault-sigstop, worker-stale-drops) · a
poison job (fault-poison) · a job three leases long (fault-long-job) · SIGTERM during a
burst (fault-sigterm, worker-stop) · an outage and a restart (fault-outage,
worker-outage, fault-restart, scripts-reload) · random crashes (fault-random-crashes) ·
skewed clocks (fault-skew, worker-clock).
"""

from __future__ import annotations

import functools
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from hypothesis import given
from hypothesis import strategies as st

from katas._harness.interleave import Gate as InterleaveGate
from katas._harness.marks import extended, processes, rule
from katas._harness.redis import RedisEnv
from katas._harness.resting import WatchedClock
from katas._harness.story import Story
from katas._harness.under_test import stage
from katas._harness.waiting import eventually, patience, stays
from katas._registry import impl
from katas.job_scheduler._testing.clocks import (
    AFTER_A_JUMP,
    JUMP_EVERY,
    LateWakes,
    beats_at_a_third,
    judge_beats_after_a_jump,
)
from katas.job_scheduler._testing.fleets import (
    DUE,
    WORKER_LEASE,
    Skewed,
    Workers,
    applied_once,
    in_process_worker,
    long_job,
    pass_lease,
    run_in_thread,
    sigkill_mid_job,
    wait_until,
)
from katas.job_scheduler._testing.pools import Gate
from katas.job_scheduler._testing.redis_queues import (
    MS,
    effect_store,
    fail_fast_on_redis_stubs,  # noqa: F401 (autouse)
    heavy,
    new_queue,
)
from katas.job_scheduler._testing.states import DEAD, LEASED, READY, SUCCEEDED
from katas.job_scheduler.api import LEASE_EXPIRED, JobNotFound, Lease, StaleLease, Worker

pytestmark = [pytest.mark.stage(3)]


@pytest.fixture
def workers(redis_env: RedisEnv, impl_selection: impl.Selection) -> Iterator[Workers]:
    """This test's worker processes, every one stopped on the way out."""
    fleet = Workers.on(redis_env, impl_selection)
    try:
        yield fleet
    finally:
        fleet.close()


# --- in process, on a test clock ------------------------------------------------------


#: Leases (whole µs) a third of which is whole, or leaves 1 ns or 2 ns over: the default
#: interval is lease_ns // 3 exactly — never rounded to the nearest ns, nor up.
DEFAULT_BEAT_LEASES = [
    pytest.param(WORKER_LEASE, id="thirds"),
    pytest.param(WORKER_LEASE + 1_000, id="one-over"),
    pytest.param(WORKER_LEASE + 2_000, id="two-over"),
]


@rule("worker-heartbeat-default", "worker-heartbeats")
@extended
@pytest.mark.parametrize("lease_ns", DEFAULT_BEAT_LEASES)
def test_stage3_worker_default_heartbeat_is_every_third_of_the_lease(
    redis_env: RedisEnv, lease_ns: int
) -> None:
    gate = Gate()
    clock = WatchedClock(10**12)
    queue, worker, _, _ = in_process_worker(redis_env, gate.handler, clock=clock, lease_ns=lease_ns)
    queue.enqueue("long")
    others = set(threading.enumerate())
    thread = run_in_thread(worker, 1)
    eventually(lambda: len(gate.busy) == 1, "the job's handler running")
    beats_at_a_third(
        lambda: worker.statistics().heartbeats,
        lambda: None,  # the lease's expiry is on the server's clock, not this one
        clock,
        lambda: clock.settle(others | {thread}, gate.busy),
        who="RedisWorker",
        lease=lease_ns,
    )
    gate.event.set()
    thread.outcome("the worker to finish its one job")
    stats = worker.statistics()
    assert (stats.succeeded, stats.lost) == (1, 0), f"{stats}"


@rule("worker-heartbeats", "worker-heartbeat-default")
@extended
def test_stage3_worker_after_a_clock_jump_the_next_heartbeat_counts_from_the_last(
    redis_env: RedisEnv,
) -> None:
    gate = Gate()
    clock = WatchedClock(10**12)
    queue, worker, _, _ = in_process_worker(
        redis_env, gate.handler, clock=clock, heartbeat_every_ns=JUMP_EVERY
    )
    queue.enqueue("long")
    others = set(threading.enumerate())
    thread = run_in_thread(worker, 1)
    eventually(lambda: len(gate.busy) == 1, "the job's handler running")
    story = Story(f"RedisWorker, heartbeat_every_ns={JUMP_EVERY}, claimed at 0:", clock.now_ns)
    start = clock.now_ns()
    for at, want in AFTER_A_JUMP:
        clock.set(start + at)
        clock.settle(others | {thread}, gate.busy)
        beats = worker.statistics().heartbeats
        judge_beats_after_a_jump(story, "RedisWorker", at, beats, want)
    gate.event.set()
    thread.outcome("the worker to finish its one job")


#: The heartbeat thread wakes late to a claim (the test holds its wake-up): when it wakes,
#: in ns after the claim, then (ns after the claim, heartbeats made by then), with the
#: default interval (a third of WORKER_LEASE). Before the first beat is due it makes none
#: until claim + interval exactly; after, one at once, the next an interval after it.
EVERY_THIRD = WORKER_LEASE // 3
LATE_WAKES = {
    "before_the_first_beat_is_due": (
        EVERY_THIRD // 2,
        [(EVERY_THIRD - 1, 0), (EVERY_THIRD, 1), (2 * EVERY_THIRD - 1, 1), (2 * EVERY_THIRD, 2)],
    ),
    "after_the_first_beat_is_due": (
        EVERY_THIRD + EVERY_THIRD // 2,
        [(5 * EVERY_THIRD // 2 - 1, 1), (5 * EVERY_THIRD // 2, 2)],
    ),
}


@rule("worker-heartbeat-default", "worker-heartbeats")
@extended
@pytest.mark.parametrize("woken", list(LATE_WAKES))
def test_stage3_worker_first_heartbeat_counts_from_the_claim_however_late_the_thread_wakes(
    redis_env: RedisEnv, woken: str
) -> None:
    """The idle worker's poll claims a job while its heartbeat thread sleeps; that thread
    is woken late (the test holds its wake-up while the clock moves on). The first beat is
    due at claim + lease_ns // 3 all the same — not an interval after the thread noticed
    the job, and not at once when it notices it."""
    wake_at, steps = LATE_WAKES[woken]
    poll = 1_000
    gate = Gate()
    clock = LateWakes(10**12)
    queue, worker, _, _ = in_process_worker(redis_env, gate.handler, clock=clock, poll_ns=poll)
    others = set(threading.enumerate())
    thread = run_in_thread(worker, 1)
    clock.settle(others, set())  # idle: the worker polling, its heartbeat thread jobless
    clock.hold_wakes(but={thread})  # every thread of the worker's but the one that claims
    queue.enqueue("long")
    clock.advance(poll)  # the worker's next poll claims the job
    eventually(lambda: len(gate.busy) == 1, "the job's handler running")
    start = clock.now_ns()
    story = Story(
        f"RedisWorker, heartbeat_every_ns=None on a {WORKER_LEASE} ns lease (a beat every "
        f"{EVERY_THIRD} ns), claimed at t=+0 by its poll:", clock.now_ns, start,
    )  # fmt: skip
    clock.set(start + wake_at)
    story.add(f"the clock moved on while {clock.held()} other thread(s) of the worker slept")
    clock.let_wake()
    clock.settle(others | {thread}, gate.busy)
    beats = worker.statistics().heartbeats
    story.add(f"those threads woken only now: {beats} heartbeat(s)")
    want = int(wake_at >= EVERY_THIRD)
    rule_text = (
        "the first heartbeat is due at claim + lease_ns // 3 on the worker's clock exactly, "
        "not before, however late the heartbeat thread wakes to notice the job (one due "
        "already is made at once); each next one an interval after the last one made"
    )
    story.check(beats == want, rule_text, f"expected {want} heartbeat(s), got {beats}")
    for at, want in steps:
        clock.set(start + at)
        clock.settle(others | {thread}, gate.busy)
        beats = worker.statistics().heartbeats
        story.add(f"clock at claim + {at}: {beats} heartbeat(s)")
        story.check(beats == want, rule_text, f"expected {want} heartbeat(s), got {beats}")
    gate.event.set()
    thread.outcome("the worker to finish its one job")


HOUR = 3_600 * 10**9


@rule("worker-clock", "fault-skew", "worker-heartbeats")
@extended
@pytest.mark.parametrize("off", ["ahead", "behind"])
def test_stage3_a_worker_clock_an_hour_off_the_servers_keeps_a_long_job_by_heartbeats(
    redis_env: RedisEnv, off: str
) -> None:
    """The worker's clock an hour ahead of the server's ``TIME`` — by it, every lease the
    server grants has expired before it was granted — or an hour behind. It only paces
    the heartbeats: a beat every lease_ns // 3 of it keeps a job running three leases of
    server time on its one lease. (On fakeredis server time moves with the worker's clock;
    a real server's moves by itself, and the lease outlasts the test.)"""
    redis_env.freeze_time()
    skew = HOUR if off == "ahead" else -HOUR
    gate = Gate()
    clock = WatchedClock(redis_env.server().time_us() * 1000 + skew)
    queue, worker, _, events = in_process_worker(redis_env, gate.handler, clock=clock)
    job_id = queue.enqueue("three leases long")
    others = set(threading.enumerate())
    thread = run_in_thread(worker, 1)
    eventually(lambda: len(gate.busy) == 1, "the job's handler running")
    start, expires = clock.now_ns(), queue.get(job_id).lease_expires_at_ns
    server_now = redis_env.server().time_us() * 1000
    assert abs(start - server_now - skew) < WORKER_LEASE, "the worker's clock is not skewed"
    story = Story(
        f"RedisWorker, its clock an hour {off} (claimed at {start} on it, at {server_now} on "
        f"the server's TIME; the lease expires at {expires} on the server's), "
        f"heartbeat_every_ns=None on a {WORKER_LEASE} ns lease:", clock.now_ns, start,
    )  # fmt: skip
    invariant = (
        "the worker's clock paces heartbeats only, never compared with a server time "
        "(Lease.expires_at_ns): a worker whose clock is an hour off either way heartbeats "
        "every lease_ns // 3 of it and keeps its lease"
    )
    for beat in range(1, 10):  # three leases
        if redis_env.time_is_controlled:
            redis_env.pass_time(EVERY_THIRD)
        clock.set(start + beat * EVERY_THIRD)
        clock.settle(others | {thread}, gate.busy)
        beats, job = worker.statistics().heartbeats, queue.get(job_id)
        story.add(
            f"worker and server clocks lease/3 on: {beats} heartbeat(s), job "
            f"{job.state.value} (token {job.token}), its lease until {job.lease_expires_at_ns}"
        )
        story.check(
            (beats, job.state, job.token) == (beat, LEASED, 1),
            invariant,
            f"expected {beat} heartbeat(s) and the job still leased by this worker (token 1); "
            f"got {beats}, {job.state.value} (token {job.token})",
        )
    gate.event.set()
    thread.outcome("the worker to finish its one job")
    job, stats = queue.get(job_id), worker.statistics()
    seen = [e for e, _ in events]
    story.add(f"the handler returned: events {seen}")
    story.check(
        (job.state, job.attempts, stats.lost, effect_store(queue).effects())
        == (SUCCEEDED, 1, 0, {job_id: job.payload}),
        invariant,
        f"expected the job SUCCEEDED in 1 attempt, its effect committed, nothing lost; got "
        f"{job.state.value} in {job.attempts}, lost {stats.lost}, effects "
        f"{effect_store(queue).effects()}",
    )


@rule("worker-nack", "worker-events", "worker-run")
@extended
def test_stage3_worker_nacks_a_failing_handler_with_its_error(redis_env: RedisEnv) -> None:
    def handler(lease: Lease, payload: Any) -> Any:
        raise ValueError(f"bad payload {payload}")

    queue, worker, _clock, events = in_process_worker(redis_env, handler)
    job_id = queue.enqueue(7)
    run_in_thread(worker, 1).outcome("the worker to handle its one job")
    job = queue.get(job_id)
    assert (job.state, job.last_error) == (DEAD, "ValueError: bad payload 7"), (
        f"a handler's exception nacks the job with '<ExceptionType>: <message>' "
        f"(max_attempts=1: DEAD); got {job.state.value}, last_error {job.last_error!r}"
    )
    stats = worker.statistics()
    assert (stats.workers, stats.claimed, stats.failed, stats.succeeded) == (1, 1, 1, 0), (
        f"the worker's statistics after one failed job: {stats}"
    )
    assert [e for e, _ in events] == ["claimed", "failed"], (
        f"a failed job reports 'claimed' then 'failed'; got {events}"
    )
    assert effect_store(queue).effects() == {}, "a failed handler committed"


@rule("worker-poll", "worker-loop")
@extended
def test_stage3_idle_worker_polls_claim_every_poll_ns(redis_env: RedisEnv) -> None:
    queue, worker, clock, events = in_process_worker(
        redis_env, lambda lease, payload: {"done": payload}, poll_ns=1_000
    )
    thread = run_in_thread(worker, 1)
    eventually(lambda: worker.statistics().idle == 1, "the worker idle")
    job_id = queue.enqueue("arrives while the worker sleeps")
    clock.advance(999)
    stays(
        lambda: worker.statistics().claimed == 0,
        "no claim 1 ns before the next poll (poll_ns=1000 on the worker's clock)",
    )
    clock.advance(1)
    thread.outcome("the worker to claim at its next poll and finish the job")
    job = queue.get(job_id)
    assert (job.state, job.result) == (SUCCEEDED, {"done": job.payload}), (
        f"the worker commits the handler's return value and acks with it; got {job}"
    )
    assert effect_store(queue).effects() == {job_id: {"done": job.payload}}
    assert [e for e, _ in events] == ["claimed", "committed", "after_effect", "acked"], events


@rule("worker-stale-drops", "worker-events")
@extended
@pytest.mark.realtime
def test_stage3_a_worker_whose_job_another_worker_finished_reports_it_lost(
    redis_env: RedisEnv,
) -> None:
    """w1 commits the effect, then stalls before its ack (its clock stands still: no
    heartbeat) past its lease; a rescuer claims the job, finds the effect committed and
    acks. When w1 wakes, its ack is refused: the job is someone else's — "lost", not
    "acked", even though the job it holds a stale lease on has SUCCEEDED."""
    redis_env.freeze_time()
    lease_ns = 200 * MS
    stalled = InterleaveGate("w1 after its effect", limit=1)
    queue, worker, _clock, events = in_process_worker(
        redis_env, lambda lease, payload: payload, lease_ns=lease_ns, max_attempts=2,
        hold=("after_effect", stalled),
    )  # fmt: skip
    job_id = queue.enqueue("charge $5")
    thread = run_in_thread(worker, 1)
    stalled.wait_arrived()
    redis_env.pass_time(lease_ns)  # w1's lease expires while it stalls
    rescue = queue.claim("rescuer")
    assert rescue is not None and (rescue.job_id, rescue.token) == (job_id, 2), rescue
    assert effect_store(queue).commit(rescue, "charge $5") is False, "committed once, by w1"
    queue.ack(rescue, "charged by the rescuer")
    stalled.open()
    thread.outcome("w1 to finish its one job")
    seen = [e for e, _ in events]
    stats = worker.statistics()
    assert seen[-1] == "lost" and (stats.succeeded, stats.lost) == (0, 1), (
        f"w1's lease (token 1) expired and the rescuer (token 2) acked the job: w1's ack is "
        f"refused, so it drops the job and reports 'lost' — the job SUCCEEDED under another "
        f"worker's token, not its own. Events {seen}, {stats}"
    )
    assert queue.get(job_id).result == "charged by the rescuer"


#: Where a Redis outage meets a worker that was told to stop while it runs a job: the
#: payload's get (held right after the claim), the commit and ack (the handler returns
#: during the outage), the nack (the handler raises during it).
OUTAGE_AT = ["get", "commit", "nack"]


@rule("worker-outage", "worker-stop")
@extended
@pytest.mark.parametrize("at", OUTAGE_AT)
def test_stage3_a_worker_stopped_during_an_outage_still_finishes_its_job(
    redis_env: RedisEnv, at: str
) -> None:
    """stop(grace of an hour) comes during an outage, with a job in hand: the worker waits
    the outage out, step by step, and finishes the job — it never reports a step it could
    not take, and never crashes."""
    proxy = redis_env.proxy()
    client = redis_env.server().proxied_client(proxy)
    held = InterleaveGate(f"the worker before its {at}", limit=1)
    gate = Gate()

    def handler(lease: Lease, payload: Any) -> Any:
        gate.handler(lease, payload)
        if at == "nack":
            raise RuntimeError("the job fails")
        return payload

    clock = WatchedClock(10**12)
    queue, worker, _, events = in_process_worker(
        redis_env, handler, clock, client, poll_ns=1_000,
        hold=("claimed", held) if at == "get" else None,
    )  # fmt: skip
    job_id = queue.enqueue({"charge": 5})
    thread = run_in_thread(worker, 1)
    tries = functools.partial(events.count, ("unavailable", None))
    if at == "get":
        held.wait_arrived()
    else:
        eventually(lambda: len(gate.busy) == 1, "the job's handler running")
    proxy.outage()
    worker.stop(3_600 * 10**9)
    held.open()
    gate.event.set()
    eventually(lambda: tries() > 0, f"the worker to meet the outage at {at}")
    # Until it sleeps on the clock (poll_ns) or has met the outage again: never judged
    # before a worker in a tight loop of retries had the time to try twice.
    eventually(
        lambda: clock.asleep(thread) or tries() > 1,
        f"the worker, after meeting the outage at its {at}, asleep on the clock for poll_ns",
    )
    proxy.heal()
    clock.advance(1_000)  # its next try, poll_ns later
    try:
        thread.outcome(f"the worker to finish its job once Redis is back (outage at its {at})")
    except (AttributeError, TypeError, redis.RedisError) as crash:
        raise AssertionError(
            f"the worker crashed on an outage at its {at} after stop(): "
            f"{type(crash).__name__}: {crash} — it must wait the outage out and finish the job"
        ) from None
    assert tries() == 1, (
        f"stop() during an outage at the worker's {at}, the clock frozen until Redis is back: "
        f"with a job in hand the worker still waits poll_ns between tries, so it meets the "
        f"outage once; it met it {tries()} times (a tight loop of retries once stopping?)"
    )
    job = queue.get(job_id)
    steps = [e for e, _ in events if e != "unavailable"]
    acked = ["claimed", "committed", "after_effect", "acked"]
    want = ["claimed", "failed"] if at == "nack" else acked
    state = DEAD if at == "nack" else SUCCEEDED
    effects = {} if at == "nack" else {job_id: {"charge": 5}}
    assert (job.state, steps, effect_store(queue).effects()) == (state, want, effects), (
        f"stop(grace of an hour) during an outage at the worker's {at}: it waits the outage "
        f"out and finishes the job ({state.value}, effects {effects}, events {want}); got "
        f"{job.state.value}, effects {effect_store(queue).effects()}, events {steps}"
    )


#: Where a worker meets the loss of its store (a master back empty) with a job in hand:
#: the payload's get (held right after the claim), the commit (the handler returns), the
#: nack (the handler raises), the ack (held right after the commit).
LOST_AT = ["get", "commit", "nack", "ack"]


@rule("worker-stale-drops", "dead-master", "worker-events")
@extended
@pytest.mark.parametrize("at", LOST_AT)
def test_stage3_a_worker_whose_store_is_lost_drops_the_job_and_goes_on(
    redis_env: RedisEnv, at: str
) -> None:
    """The queue's keys are lost while the worker holds a job, just before one of its
    steps: the job is gone (``JobNotFound`` or ``StaleLease``, whichever the step meets)
    — the worker reports it lost and runs the next job, enqueued into the new store."""
    held = InterleaveGate(f"the worker before its {at}", limit=1)
    in_handler = threading.Event()
    go_on = threading.Event()

    def handler(lease: Lease, payload: Any) -> Any:
        if payload == "first" and at in ("commit", "nack"):
            in_handler.set()
            assert go_on.wait(30), "the handler was never let go on"
            if at == "nack":
                raise RuntimeError("the job fails")
        return payload

    hold = {"get": ("claimed", held), "ack": ("after_effect", held)}.get(at)
    queue, worker, _, events = in_process_worker(redis_env, handler, hold=hold)
    first = queue.enqueue("first")
    thread = run_in_thread(worker, 2)
    if hold is not None:
        held.wait_arrived()
    else:
        eventually(in_handler.is_set, "the first job's handler running")
    redis_env.lose_keys()
    second = queue.enqueue("second")
    held.open()
    go_on.set()
    try:
        thread.outcome(f"the worker to finish two jobs, the first lost before its {at}")
    except (StaleLease, JobNotFound) as crash:
        raise AssertionError(
            f"the store was lost before the worker's {at}: {type(crash).__name__} escaped "
            f"run() ({crash}) — a stale lease at any step drops the job as lost, whichever "
            f"of the two the step meets. Events: {events}"
        ) from None
    seen = [(e, job) for e, job in events if e in ("lost", "acked", "failed")]
    assert seen == [("lost", first), ("acked", second)], (
        f"the store lost before the worker's {at}: the first job is dropped as lost, then "
        f"the second, enqueued into the new store, runs and is acked; events {events}"
    )


@rule("worker-heartbeats", "worker-outage", "busy-unavailable", "worker-stale-drops")
@extended
def test_stage3_the_heartbeat_thread_outlives_every_refusal_and_a_lost_job(
    redis_env: RedisEnv,
) -> None:
    """A job in its handler: one heartbeat meets an outage, the next each refusal a server
    or a cluster answers (BUSY, LOADING, MASTERDOWN, TRYAGAIN, CLUSTERDOWN) — each is
    waited out, the beat tried again ``poll_ns`` later. Then the store is lost under the
    job (a master back empty): its heartbeat finds no job, the job is dropped as lost, and
    the next job's lease is kept by heartbeats as the first one's was."""
    proxy = redis_env.proxy()
    client = redis_env.server().proxied_client(proxy)
    release = {"first": threading.Event(), "second": threading.Event()}
    running = {"first": threading.Event(), "second": threading.Event()}

    def handler(lease: Lease, payload: Any) -> Any:
        running[payload].set()  # from now on, only the heartbeat thread sleeps on the clock
        assert release[payload].wait(30), f"the handler of {payload!r} was never released"
        return payload

    poll, every = 1_000, WORKER_LEASE // 3
    queue, worker, clock, events = in_process_worker(
        redis_env, handler, client=client, poll_ns=poll
    )
    first = queue.enqueue("first")
    thread = run_in_thread(worker, 2)
    eventually(running["first"].is_set, "the first job's handler running")
    start = clock.now_ns()
    story = Story(
        f"RedisWorker(poll_ns={poll}), heartbeat_every_ns={every} (lease/3), its handler "
        "holding a job claimed at t=+0:", clock.now_ns, start,
    )  # fmt: skip

    def until(pred: Callable[[], bool], invariant: str, waited_for: str) -> None:
        try:
            eventually(pred, waited_for)
        except AssertionError as error:
            beats = worker.statistics().heartbeats
            raise AssertionError(story.tell(invariant, f"{error} (heartbeats: {beats})")) from None

    def beats_are(want: int) -> bool:
        return worker.statistics().heartbeats == want

    def beating(after: int) -> bool:  # the heartbeat thread asleep on the clock, not dead
        deadline = clock.next_deadline_ns()
        return clock.sleepers() >= 1 and (deadline is None or deadline > after)

    due, beats = start + every, 0
    for fault in ("outage", *redis_env.refusals):
        if fault == "outage":
            proxy.outage()
        else:
            proxy.refuse(fault)
        clock.set(due)
        story.add(f"a beat due, Redis {'unreachable' if fault == 'outage' else fault}")
        until(
            functools.partial(beating, due),
            f"a heartbeat refused by {fault} is an unavailability like any other — the "
            "thread waits poll_ns and beats again (a thread that died on it leaves the "
            "lease to run out under a live handler)",
            "the heartbeat thread asleep on the clock until its next try",
        )
        proxy.heal()
        clock.set(due + poll)
        story.add("Redis back, poll_ns later")
        until(
            functools.partial(beats_are, beats + 1),
            f"once {fault} is over, the refused beat is tried again poll_ns later, and made",
            f"heartbeats={beats + 1}",
        )
        beats, due = beats + 1, due + poll + every
    redis_env.lose_keys()
    clock.set(due)
    story.add("the store lost (every key of the queue gone, as a master back empty); a beat due")
    until(
        functools.partial(beating, due),
        "a heartbeat that finds its job gone (JobNotFound, like StaleLease) drops that job, "
        "and the thread lives on for the next one",
        "the heartbeat thread asleep on the clock",
    )
    queue.enqueue("second")
    release["first"].set()
    eventually(running["second"].is_set, "the second job's handler running")
    story.add(
        f"the first handler returned; the worker reported {[e for e, j in events if j == first]}"
        " for that job, then claimed the second"
    )
    clock.set(clock.now_ns() + every)
    story.add("lease/3 later")
    until(
        functools.partial(beats_are, beats + 1),
        "the second job's lease is kept by heartbeats like the first's",
        f"heartbeats={beats + 1}",
    )
    release["second"].set()
    thread.outcome("the worker to finish its two jobs")


@rule("worker-stop")
@extended
@pytest.mark.parametrize(("first", "second"), [(5_000, 10**9), (10**9, 5_000)])
def test_stage3_a_second_stop_never_extends_the_grace(
    redis_env: RedisEnv, first: int, second: int
) -> None:
    gate = Gate()
    clock = WatchedClock(10**12)
    queue, worker, _, _ = in_process_worker(redis_env, gate.handler, clock=clock)
    job_id = queue.enqueue("long")
    others = set(threading.enumerate())
    thread = run_in_thread(worker, 1)
    eventually(lambda: len(gate.busy) == 1, "the job's handler running")
    start = clock.now_ns()
    worker.stop(first)
    worker.stop(second)
    released = []
    for at in (4_999, 5_000):
        clock.set(start + at)
        clock.settle(others | {thread}, gate.busy)
        released.append(worker.statistics().released)
    gate.event.set()
    thread.outcome("the worker to return once its job was released")
    assert released == [0, 1] and queue.get(job_id).state is READY, (
        f"stop({first}) then stop({second}): the earlier deadline stands (a second stop "
        f"never extends the grace), so the running job is released at +5000 ns exactly; "
        f"released by +4999 and +5000: {released}, the job {queue.get(job_id).state.value}"
    )


class _NotTheWorkers(set[threading.Thread]):
    """Threads alive before the test, and those the proxy starts for each connection the
    worker opens through it (a cluster client opens more): none is the worker's."""

    def __contains__(self, thread: object) -> bool:
        return super().__contains__(thread) or getattr(thread, "name", "").startswith("faultproxy")


@rule("worker-stop")
@extended
@pytest.mark.parametrize("outcome", ["returns", "raises"])
def test_stage3_a_job_released_at_the_grace_deadline_drops_its_handlers_result(
    redis_env: RedisEnv, outcome: str
) -> None:
    """The grace runs out with the handler still running: the job is released. The
    handler then comes back, with an effect or an exception: either is dropped — no
    commit, no nack, no ack, not even an attempt at one (the job is someone else's)."""
    gate = Gate()

    def handler(lease: Lease, payload: Any) -> Any:
        effect = gate.handler(lease, payload)
        if outcome == "raises":
            raise RuntimeError("the handler failed after its grace ran out")
        return {"charge": effect}

    clock = WatchedClock(10**12)
    proxy = redis_env.proxy()  # counts what the worker sends
    client = redis_env.server().proxied_client(proxy)
    queue, worker, _, events = in_process_worker(redis_env, handler, clock, client, max_attempts=3)
    job_id = queue.enqueue(5)
    client.ping()  # the proxy's threads for the worker's connection, started before others
    others = set(threading.enumerate())
    thread = run_in_thread(worker, 1)
    eventually(lambda: len(gate.busy) == 1, "the job's handler running")
    worker.stop(1_000)
    clock.set(clock.now_ns() + 1_000)
    clock.settle(_NotTheWorkers(others | {thread}), gate.busy)
    proxy.reset_counts()
    gate.event.set()  # the handler comes back after the release
    thread.outcome("the worker to return once its job was released")
    job, stats = queue.get(job_id), worker.statistics()
    got = (
        proxy.counts().round_trips,
        [e for e, j in events if j == job_id],
        job.state,
        job.attempts,
        job.last_error,
        effect_store(queue).effects(),
        (stats.released, stats.lost, stats.failed, stats.succeeded),
    )
    want: tuple[Any, ...] = (0, ["claimed", "released"], READY, 0, None, {}, (1, 0, 0, 0))
    assert got == want, (
        f"stop(grace 1000 ns); the handler {outcome} after the job was released at the "
        "deadline: its result is dropped — no commit, nack or ack tried (each would meet "
        "a stale lease), the attempt refunded. (round trips after the release, events, "
        f"state, attempts, last_error, effects, (released, lost, failed, succeeded)):\n"
        f"  expected {want}\n  got      {got}"
    )


#: How the running job's lease went stale before stop's grace ran out: it expired (no
#: heartbeat came), the job was cancelled, or the store was lost (a master back empty).
STALE_BY = ["expired", "cancelled", "store_lost"]


@rule("worker-stop", "worker-stale-drops", "worker-events")
@extended
@pytest.mark.realtime
@pytest.mark.parametrize("stale", STALE_BY)
def test_stage3_a_release_at_the_grace_deadline_that_meets_a_stale_lease_reports_it_lost(
    redis_env: RedisEnv, stale: str
) -> None:
    """The grace runs out with the handler still running, but the job's lease went stale
    meanwhile: the release is refused (StaleLease or JobNotFound), nothing is handed back
    and no attempt refunded — the job is someone else's. It is "lost", never "released"."""
    redis_env.freeze_time()
    lease_ns = 200 * MS if stale == "expired" else WORKER_LEASE
    gate = Gate()
    clock = WatchedClock(10**12)  # frozen: no heartbeat is due while the test acts
    queue, worker, _, events = in_process_worker(
        redis_env, gate.handler, clock=clock, lease_ns=lease_ns
    )
    job_id = queue.enqueue("long")
    others = set(threading.enumerate())
    thread = run_in_thread(worker, 1)
    eventually(lambda: len(gate.busy) == 1, "the job's handler running")
    if stale == "expired":
        redis_env.pass_time(lease_ns)
    elif stale == "cancelled":
        assert queue.cancel(job_id) is True, f"the running job was cancelled: {queue.get(job_id)}"
    else:
        redis_env.lose_keys()
    worker.stop(1_000)
    clock.set(clock.now_ns() + 1_000)
    clock.settle(others | {thread}, gate.busy)
    gate.event.set()  # the handler comes back after the refused release
    thread.outcome("the worker to return once its grace ran out")
    stats = worker.statistics()
    got = ([e for e, j in events if j == job_id], (stats.released, stats.lost))
    assert got == (["claimed", "lost"], (0, 1)), (
        f"the running job's lease went stale ({stale.replace('_', ' ')}), then stop's grace "
        "ran out: the release is refused and the job dropped — reported 'lost', never "
        "'released' (nothing was handed back, no attempt refunded). (its events, "
        f"(released, lost)): expected {(['claimed', 'lost'], (0, 1))}, got {got}"
    )


@rule("worker-outage", "worker-stop")
@extended
def test_stage3_a_release_at_the_grace_deadline_waits_out_an_outage(redis_env: RedisEnv) -> None:
    """Redis is unreachable when stop's grace runs out: the release is a step like any
    other — tried again poll_ns later, until Redis answers. Once it is back the job is
    released (READY, attempt refunded), never left behind on its lease as "lost"."""
    proxy = redis_env.proxy()
    client = redis_env.server().proxied_client(proxy)
    gate = Gate()
    clock = WatchedClock(10**12)  # frozen: only the test moves the worker's time
    queue, worker, _, events = in_process_worker(
        redis_env, gate.handler, clock, client, poll_ns=1_000, max_attempts=3
    )
    job_id = queue.enqueue("long")
    others = set(threading.enumerate())
    thread = run_in_thread(worker, 1)
    eventually(lambda: len(gate.busy) == 1, "the job's handler running")
    story = Story(
        f"max_attempts=3, poll_ns=1000: {job_id} claimed, its handler running",
        clock.now_ns,
        clock.now_ns(),
    )
    proxy.outage()
    worker.stop(1_000)
    clock.set(clock.now_ns() + 1_000)
    clock.settle(others | {thread}, gate.busy)
    story.add("Redis unreachable; stop(1000), and the grace ran out: the release met the outage")
    mine = set(threading.enumerate()) - others - {thread}  # the worker's own, asleep
    proxy.heal()
    clock.advance(1_000)
    # the proxy starts threads of its own as the worker reconnects: judge the worker's
    eventually(
        lambda: clock.parked(set(threading.enumerate()) - mine, gate.busy),
        "the worker's threads asleep on the clock again, poll_ns after the outage",
    )
    story.add("Redis back; poll_ns later")
    gate.event.set()  # the handler comes back after the release
    thread.outcome("the worker to return once its job was released")
    story.add("the handler returned; the worker exited")
    job, stats = queue.get(job_id), worker.statistics()
    got = ([e for e, j in events if j == job_id], job.state, job.attempts, stats.released,
           stats.lost)  # fmt: skip
    story.expect(
        got, (["claimed", "released"], READY, 0, 1, 0),
        "an outage is waited out, step by step, and the job released at stop's deadline "
        "(attempt refunded), never dropped; (events, state, attempts, released, lost)",
    )  # fmt: skip


@rule("worker-stop", "worker-events")
@extended
def test_stage3_a_job_released_between_its_commit_and_ack_is_never_also_lost(
    redis_env: RedisEnv,
) -> None:
    """stop(0) lands after the effect's commit, before the ack (a SIGTERM there): the
    heartbeat thread releases the job at once, and the ack that follows is refused. The
    job was handed back, not lost: it is counted "released" once, never "lost" too."""
    held = InterleaveGate("the worker after its commit", limit=1)
    clock = WatchedClock(10**12)
    queue, worker, _, events = in_process_worker(
        redis_env, lambda lease, payload: payload, clock, max_attempts=3,
        hold=("after_effect", held),
    )  # fmt: skip
    job_id = queue.enqueue("charge")
    others = set(threading.enumerate())
    thread = run_in_thread(worker, 1)
    held.wait_arrived()
    worker.stop(0)
    clock.settle(others | {thread}, set())
    held.open()
    thread.outcome("the worker to return once its job was released")
    stats = worker.statistics()
    got = ([e for e, j in events if j == job_id], queue.get(job_id).state,
           (stats.succeeded, stats.released, stats.lost))  # fmt: skip
    want = (["claimed", "committed", "after_effect", "released"], READY, (0, 1, 0))
    assert got == want, (
        "stop(0) between the commit and the ack: the job is released, its ack refused — "
        "reported once, 'released', never 'lost' as well. (events, state, (succeeded, "
        f"released, lost)):\n  expected {want}\n  got      {got}"
    )


# --- as OS processes, under real signals ----------------------------------------------


@processes
@rule("fault-sigkill", "worker-loop")
@extended
@pytest.mark.realtime
def test_stage3_sigkill_after_the_claim_the_job_comes_back(workers: Workers) -> None:
    sigkill_mid_job(workers, "claimed")


@processes
@rule("fault-sigkill", "worker-events")
@extended
@pytest.mark.realtime
def test_stage3_sigkill_between_effect_and_ack_the_effect_lands_once(workers: Workers) -> None:
    sigkill_mid_job(workers, "after_effect")


@processes
@rule("fault-sigstop", "worker-stale-drops")
@extended
@pytest.mark.realtime
def test_stage3_sigstop_past_the_lease_then_sigcont_the_zombie_is_fenced(
    workers: Workers,
) -> None:
    queue = workers.frozen_queue()
    job_id = queue.enqueue({"effect": "the real one"})
    zombie = workers.start("--hold-at", "claimed", "--max-jobs", "1")
    zombie.wait_for(f"HOLD claimed {job_id} 1", idle_polls=DUE)
    zombie.send(signal.SIGSTOP)  # a GC pause, a VM migration: it does not know
    pass_lease(workers)
    other = workers.start("--max-jobs", "1")
    other.wait_for("EXIT", idle_polls=DUE)
    zombie.send(signal.SIGCONT)
    zombie.tell()
    zombie.wait_for("EXIT")
    assert workers.events("lost") == [f"{job_id} 1"], (
        "the zombie woke up after its lease was taken over: its commit must be "
        f"refused (StaleLease) and the job dropped.\n{workers.transcripts()}"
    )
    applied_once(workers, queue, [job_id])


@processes
@rule("fault-poison")
@extended
@pytest.mark.realtime
def test_stage3_poison_job_that_kills_every_worker_is_dead_lettered(workers: Workers) -> None:
    queue = workers.frozen_queue()
    job_id = queue.enqueue({"crash": True})
    for attempt in range(1, workers.max_attempts + 1):
        victim = workers.start("--max-jobs", "1")
        code = victim.wait(idle_polls=DUE)
        assert code == -signal.SIGKILL, f"attempt {attempt}: the poison job did not crash"
        pass_lease(workers)
        queue.reap()
    job = queue.get(job_id)
    assert (job.state, job.attempts, job.last_error) == (DEAD, 3, LEASE_EXPIRED), (
        f"a job that kills its worker every time must be DEAD after max_attempts=3 "
        f"crashes (each lease expiry counts an attempt); got {job}"
    )
    assert [j.id for j in queue.dead_letters()] == [job_id]


@processes
@rule("fault-long-job", "worker-heartbeats")
@extended
@pytest.mark.realtime
def test_stage3_a_job_three_leases_long_keeps_its_lease_by_heartbeats(workers: Workers) -> None:
    queue, job_id = long_job(workers)
    worker = workers.start("--heartbeat-every-ns", str(workers.lease_ns // 3), "--max-jobs", "2")
    worker.wait_for(f"EVENT acked {job_id} 1")
    applied_once(workers, queue, [job_id])
    assert queue.get(job_id).attempts == 1, (
        f"heartbeats every lease/3 must keep the lease of a job three leases long: "
        f"one attempt; got {queue.get(job_id)}\n{workers.transcripts()}"
    )


@processes
@rule("fault-long-job")
@extended
@pytest.mark.realtime
def test_stage3_a_job_three_leases_long_without_heartbeats_loses_every_attempt(
    workers: Workers,
) -> None:
    queue, job_id = long_job(workers)
    workers.start("--no-heartbeat", "--max-jobs", "2")
    # Each attempt outlives its lease: its commit is refused, and the job runs out of attempts.
    wait_until(lambda: len(workers.events("lost")) == 2, "both attempts lost", workers)
    job = queue.get(job_id)
    assert (job.state, job.last_error) == (DEAD, LEASE_EXPIRED), (
        f"without heartbeats a job 3 leases long loses its lease every attempt: "
        f"DEAD after 2, no effect; got {job}"
    )
    assert effect_store(queue).effects() == {}, "an expired attempt committed"


@processes
@rule("fault-sigterm", "worker-stop")
@extended
@pytest.mark.realtime
def test_stage3_sigterm_during_a_burst_finishes_or_releases_and_leaves_no_lease(
    workers: Workers,
) -> None:
    queue = workers.frozen_queue()
    burst = [workers.start("--grace-ns", str(250 * MS)) for _ in range(3)]
    # The long job goes first and outlives the grace period: it must be released. It
    # outlives it on a busy machine too, where the signal may come half a second late.
    long_job = queue.enqueue({"effect": "long", "work_ms": int(800 * patience())}, priority=1)
    ids = [long_job] + [queue.enqueue({"effect": i, "work_ms": 40}) for i in range(12)]
    wait_until(
        lambda: len(workers.events("acked")) >= 3 and f"{long_job} 1" in workers.events("claimed"),
        "a few jobs done while the long one runs",
        workers,
    )
    for w in burst:
        w.send(signal.SIGTERM)
    for w in burst:
        assert w.wait() == 0, f"SIGTERM must stop a worker cleanly:\n{w.transcript()}"
        assert w.lines("EXIT stopped"), w.transcript()
    stats = queue.statistics()
    assert stats.leased == 0, (
        f"after SIGTERM no lease may be left behind (finish within the grace, or "
        f"release): {stats}\n{workers.transcripts()}"
    )
    for job_id in ids:
        job = queue.get(job_id)
        assert job.state is SUCCEEDED or (job.state is READY and job.attempts == 0), (
            f"a job interrupted by SIGTERM must be finished, or back with its attempt "
            f"refunded: {job}"
        )
    assert queue.get(long_job).state is READY, (
        f"the job still running when the 250 ms grace ran out must be released "
        f"(READY again, attempt refunded): {queue.get(long_job)}\n{workers.transcripts()}"
    )
    left = sum(queue.get(j).state is READY for j in ids)
    # The sweep runs the long job whole, for real: on a lease long enough that no
    # heartbeat comes late for it on a busy machine (a lost lease would take a turn).
    workers.lease_ns = WORKER_LEASE
    workers.start("--max-jobs", str(left)).wait_for("EXIT", idle_polls=DUE)
    applied_once(workers, queue, ids)


@processes
@rule("fault-outage", "worker-outage")
@extended
@pytest.mark.realtime
def test_stage3_workers_ride_out_a_redis_outage(workers: Workers) -> None:
    # Server time runs: a claim whose reply the outage swallowed leaves a lease nobody
    # knows of, and only its expiry (lease_ns later) gives that job back.
    proxy = workers.env.proxy(workers.node)
    queue = workers.queue()
    ids = [queue.enqueue({"effect": i, "work_ms": 5}) for i in range(8)]
    workers.url = f"redis://{proxy.host}:{proxy.port}/0"  # the fleet reaches Redis via the proxy
    fleet = [workers.start("--socket-timeout", "0.2", name=f"w{i}") for i in range(2)]
    wait_until(lambda: len(workers.events("acked")) >= 2, "work under way", workers)
    proxy.outage()
    wait_until(lambda: len(workers.events("unavailable")) >= 2, "workers see the outage", workers)
    proxy.heal()
    wait_until(lambda: queue.statistics().succeeded == 8, "all 8 jobs succeeded", workers)
    applied_once(workers, queue, ids, lost_replies=True)
    crashed = [w.name for w in fleet if w.lines("<closed>")]
    assert not crashed, (
        f"a worker must wait out an outage, not crash: {crashed}\n{workers.transcripts()}"
    )


@processes
@rule("fault-restart", "scripts-reload")
@extended
@pytest.mark.realtime
@pytest.mark.redis_faults
def test_stage3_a_worker_survives_a_real_redis_restart(workers: Workers) -> None:
    queue = workers.queue()
    worker = workers.start("--socket-timeout", "0.2")
    first = queue.enqueue({"effect": "before"})
    worker.wait_for(f"EVENT acked {first}")
    workers.node.restart()  # data and the script cache are gone
    queue = workers.queue()
    after = queue.enqueue({"effect": "after"})
    wait_until(
        lambda: queue.get(after).state is SUCCEEDED, "the job enqueued after the restart", workers
    )
    assert not worker.lines("<closed>"), worker.transcript()


@processes
@rule("fault-random-crashes")
@extended
@pytest.mark.realtime
@heavy
@given(plan=st.lists(st.sampled_from(["claimed", "after_effect", None]), min_size=1, max_size=3))
def test_stage3_under_random_crashes_every_job_finishes_and_applies_its_effect_once(
    workers: Workers, plan: list[str | None]
) -> None:
    workers.env.freeze_time()  # fakeredis: leases run out only when the test says
    workers.env.prefix = workers.env.fresh_prefix()
    queue = workers.queue(max_attempts=len(plan) + 1)
    ids = [queue.enqueue({"effect": f"e{i}"}) for i in range(3)]
    for point in plan:
        if point is None:
            continue
        victim = workers.start("--hold-at", point)
        victim.wait_for(f"HOLD {point}", idle_polls=DUE)  # no job dies: one is always due
        victim.send(signal.SIGKILL)
        victim.wait()
        pass_lease(workers)
    drain = workers.start()
    # No job ran out of attempts, so the drain has a due job until all three succeeded: a
    # run of empty claims is a lost job, and fails the example at once (hypothesis then
    # shrinks it, one process fleet per example, within the suite's time).
    wait_until(
        lambda: queue.statistics().succeeded == 3, "all 3 jobs succeeded", workers, busy=drain
    )
    drain.send(signal.SIGTERM)
    drain.wait()
    applied_once(workers, queue, ids)
    workers.close()
    workers.started.clear()


@rule("fault-skew", "worker-clock", "worker-run")
@extended
@pytest.mark.realtime
def test_stage3_skewed_worker_clocks_change_nothing(redis_env: RedisEnv) -> None:
    """Two in-process workers whose clocks are an hour off either way: heartbeats are
    paced by intervals, never by comparing a local clock with a server time. (A real
    lease: on a busy machine, where a heartbeat can come late, it is longer.)"""
    lease_ns = 3 * int(40 * patience()) * MS  # whole ms (Redis TIME has µs), a third too
    queue = new_queue(redis_env, lease_ns=lease_ns)
    ids = [queue.enqueue(i) for i in range(4)]

    def handler(lease: Lease, payload: Any) -> Any:
        time.sleep(2.5 * lease_ns / 10**9)  # 2.5 leases: only heartbeats keep it
        return payload

    hour = 3600 * 10**9
    fleet: list[Worker] = [
        stage().RedisWorker(
            new_queue(redis_env, lease_ns=lease_ns), handler, worker_id=f"w{i}",
            clock=Skewed(offset), heartbeat_every_ns=lease_ns // 3,
        )
        for i, offset in enumerate((hour, -hour))
    ]  # fmt: skip
    threads = [threading.Thread(target=w.run, kwargs={"max_jobs": 2}, daemon=True) for w in fleet]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
        assert not t.is_alive(), "a worker with a skewed clock never finished"
    stats = [w.statistics() for w in fleet]
    assert [queue.get(j).state for j in ids] == [SUCCEEDED] * 4 and all(
        s.lost == 0 and s.heartbeats >= 2 for s in stats
    ), (
        f"with clocks skewed ±1 h, both workers must keep their leases by "
        f"heartbeats and finish every job once: {stats}, "
        f"{[queue.get(j) for j in ids]}"
    )
