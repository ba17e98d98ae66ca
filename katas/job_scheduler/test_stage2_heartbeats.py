"""Stage 2 suite, heartbeats: which leases a pool keeps alive, and when (see
katas/job_scheduler/README.md, "Stage 2").

The stage's first file, ``test_stage2.py``, has the examples of every rule; here the
boundaries of the heartbeat rules, in both pools: a job claimed when its time comes (no
submit wakes anyone), heartbeats after a clock jump, a job re-claimed by a second worker
of the same pool while its first run still holds a thread, and heartbeats that go on
through shutdown's grace period.

How these tests stay deterministic: the clock is a ``WatchedClock`` that knows which
threads sleep on it, so a test moves it and then waits until every thread of the pool is
parked again — nothing more can happen before the clock moves — and judges at once (the
async pool: the harness's ``settle()``). Handlers block on events the test sets.

Map: a job claimed at its run time is heartbeaten (heartbeats, async-pool) · two jobs
whose beats alternate, each at its own instants (heartbeats) · the next
heartbeat counts from the last one made (heartbeats, heartbeat-default, async-pool) ·
one job, two runs (heartbeats, pool-statistics, bounded-in-flight) · heartbeats through
the grace period (heartbeats, shutdown-grace, async-pool) · a job the queue forgot in a
stall (heartbeat-lost, shutdown-grace, pool-statistics, async-pool).
"""

from __future__ import annotations

import threading
from functools import partial
from typing import Any

import anyio
import pytest

from katas._harness import marks
from katas._harness.marks import anyio_test, core, extended
from katas._harness.resting import SelfWakingClock, WatchedClock, wait_at
from katas._harness.story import Story, check
from katas._harness.virtual_time import settle
from katas._harness.waiting import DEADLINE_S, eventually, spawn
from katas._runtime.todo import Todo
from katas.job_scheduler._testing.clocks import AFTER_A_JUMP, JUMP_EVERY, judge_beats_after_a_jump
from katas.job_scheduler._testing.pools import (
    AsyncGate,
    CountedBeats,
    Gate,
    Stalls,
    fail_fast_on_pool_stubs,  # noqa: F401 (autouse)
    new_async_pool,
    new_pool,
    running,
    running_async,
    stat,
)
from katas.job_scheduler._testing.queues import LEASE, START, rel
from katas.job_scheduler.api import (
    DEFAULT_RETENTION_NS,
    JobQueue,
    JobState,
    Lease,
    PoolStatistics,
)

pytestmark = [pytest.mark.stage(2)]

#: The heartbeat interval of these tests: three beats a lease (LEASE = 1 000 ns).
EVERY = JUMP_EVERY


def _running(gate: Gate, handlers: int) -> bool:
    return len(gate.busy) == handlers


def _lease_ends(queue: JobQueue, job_id: str) -> int | None:
    """When the job's lease expires (read while every pool thread is parked)."""
    return queue.get(job_id).lease_expires_at_ns


# --- a job claimed when its time comes ------------------------------------------------


@marks.rule("heartbeats")
@core
def test_stage2_a_job_claimed_at_its_run_time_is_heartbeaten() -> None:
    """Nothing is running and nothing is submitted: the heartbeat thread has nothing to
    wait for. The job falls due, a worker claims it — and its lease must be kept."""
    gate = Gate()
    clock = WatchedClock(START)
    _, queue, pool = new_pool(gate.handler, workers=1, clock=clock, heartbeat_every_ns=EVERY)
    job_id = queue.enqueue("due later", run_at_ns=START + 1_000)
    others = set(threading.enumerate())
    with running(pool):
        clock.settle(others, gate.busy)
        clock.set(START + 1_000)  # the job is due: the idle worker wakes and claims it
        eventually(lambda: len(gate.busy) == 1, "the job's handler running")
        for beat in (1, 2, 3, 4):
            clock.advance(EVERY)
            clock.settle(others, gate.busy)
            now = clock.now_ns()
            check(
                pool.statistics().heartbeats == beat and _lease_ends(queue, job_id) == now + LEASE,
                f"a job claimed at its run time (1000 ns, no submit since the pool started) "
                f"must be heartbeaten every heartbeat_every_ns={EVERY} from its claim: by "
                f"{rel(now)} expected {beat} heartbeat(s) and the lease extended to "
                f"{rel(now + LEASE)}; got {pool.statistics().heartbeats}, lease ends "
                f"{rel(_lease_ends(queue, job_id))} — was the heartbeat thread told about "
                "the claim?",
            )
        gate.event.set()
        eventually(lambda: pool.statistics().succeeded == 1, "the job acked")


@marks.rule("heartbeats")
@core
def test_stage2_each_running_job_is_heartbeaten_at_its_own_instants() -> None:
    """Two jobs claimed half an interval apart, so that their beats alternate: the one
    claimed first is not always the one due next. Each must be heartbeaten at its own
    instants — the heartbeat thread waits for the earliest beat due, whichever job's."""
    gate = Gate()
    clock = WatchedClock(START)
    _, queue, pool = new_pool(gate.handler, workers=2, clock=clock, heartbeat_every_ns=EVERY)
    half = EVERY // 2
    first = queue.enqueue("first", run_at_ns=START + 1_000)
    second = queue.enqueue("second", run_at_ns=START + 1_000 + half)
    claimed = {first: START + 1_000, second: START + 1_000 + half}
    beats = sorted((at + n * EVERY, job) for job, at in claimed.items() for n in (1, 2, 3))
    others = set(threading.enumerate())
    with running(pool):
        clock.settle(others, gate.busy)
        for count, at in enumerate(claimed.values(), start=1):
            clock.set(at)  # the job is due: an idle worker wakes and claims it
            eventually(partial(_running, gate, count), f"{count} handler(s) running")
            clock.settle(others, gate.busy)
        for n, (at, job) in enumerate(beats, start=1):
            clock.set(at)
            clock.settle(others, gate.busy)
            check(
                pool.statistics().heartbeats == n and _lease_ends(queue, job) == at + LEASE,
                f"two jobs claimed at {rel(START + 1_000)} and {rel(START + 1_000 + half)}, "
                f"heartbeat_every_ns={EVERY}: by {rel(at)} expected {n} heartbeat(s), the "
                f"last one {job}'s, its lease extended to {rel(at + LEASE)}; got "
                f"{pool.statistics().heartbeats}, its lease ends {rel(_lease_ends(queue, job))}",
            )
        gate.event.set()
        eventually(lambda: pool.statistics().succeeded == 2, "both jobs acked")


@marks.rule("heartbeats", "async-pool")
@extended
@anyio_test
async def test_stage2_async_a_job_claimed_at_its_run_time_is_heartbeaten() -> None:
    gate = AsyncGate()
    clock = WatchedClock(START)
    _, queue, pool = new_async_pool(gate.handler, workers=1, clock=clock, heartbeat_every_ns=EVERY)
    job_id = queue.enqueue("due later", run_at_ns=START + 1_000)
    async with anyio.create_task_group() as tg:
        tg.start_soon(pool.run)
        await settle()
        clock.set(START + 1_000)  # the job is due: the idle worker wakes and claims it
        await settle()
        for beat in (1, 2, 3, 4):
            clock.advance(EVERY)
            await settle()
            now = clock.now_ns()
            check(
                pool.statistics().heartbeats == beat and _lease_ends(queue, job_id) == now + LEASE,
                f"async pool: a job claimed at its run time (1000 ns, no submit since run() "
                f"began) must be heartbeaten every heartbeat_every_ns={EVERY} from its claim: "
                f"by {rel(now)} expected {beat} heartbeat(s), lease to {rel(now + LEASE)}; "
                f"got {pool.statistics().heartbeats}, lease ends "
                f"{rel(_lease_ends(queue, job_id))} — was the heartbeat task told of the claim?",
            )
        gate.event.set()
        await settle()
        await pool.shutdown(0)


# --- the next heartbeat counts from the last one made ---------------------------------


@marks.rule("heartbeats", "heartbeat-default")
@core
def test_stage2_after_a_clock_jump_the_next_heartbeat_counts_from_the_last() -> None:
    gate = Gate()
    clock = WatchedClock(START)
    _, _, pool = new_pool(gate.handler, workers=1, clock=clock, heartbeat_every_ns=EVERY)
    others = set(threading.enumerate())
    story = Story(f"lease {LEASE}, heartbeat_every_ns={EVERY}, claimed at 0:", clock.now_ns, START)
    with running(pool):
        pool.submit("long")
        eventually(lambda: len(gate.busy) == 1, "the job's handler running")
        for at, want in AFTER_A_JUMP:
            clock.set(START + at)
            clock.settle(others, gate.busy)
            beats = pool.statistics().heartbeats
            judge_beats_after_a_jump(story, "thread pool", at, beats, want)
        gate.event.set()
        eventually(lambda: pool.statistics().succeeded == 1, "the job acked")


@marks.rule("heartbeats", "async-pool")
@extended
@anyio_test
async def test_stage2_async_after_a_clock_jump_the_next_heartbeat_counts_from_the_last() -> None:
    gate = AsyncGate()
    clock = WatchedClock(START)
    _, _, pool = new_async_pool(gate.handler, workers=1, clock=clock, heartbeat_every_ns=EVERY)
    story = Story(f"async, lease {LEASE}, heartbeat_every_ns={EVERY}:", clock.now_ns, START)
    async with anyio.create_task_group() as tg:
        tg.start_soon(pool.run)
        pool.submit("long")
        await settle()
        for at, want in AFTER_A_JUMP:
            clock.set(START + at)
            await settle()
            beats = pool.statistics().heartbeats
            judge_beats_after_a_jump(story, "async pool", at, beats, want)
        gate.event.set()
        await settle()
        await pool.shutdown(0)


# --- one job, two runs ------------------------------------------------------------------


@marks.rule("heartbeats", "pool-statistics", "bounded-in-flight")
@core
def test_stage2_a_job_run_twice_by_one_pool_keeps_both_runs_apart() -> None:
    """Worker A's run stalls past its lease (the clock jumps: no heartbeat could help);
    worker B of the same pool claims the job again (attempt 2). When A's handler returns,
    its ack is refused — and B's run, the live one, must go on being heartbeaten and
    counted in flight."""
    stalls = Stalls()
    first, second = stalls.hold("job", 1), stalls.hold("job", 2)
    clock = WatchedClock(START)
    _, queue, pool = new_pool(
        stalls.handler, workers=2, max_attempts=2, clock=clock, heartbeat_every_ns=EVERY
    )
    others = set(threading.enumerate())
    story = Story(f"2 workers, lease {LEASE}, heartbeat_every_ns={EVERY}:", clock.now_ns, START)
    rule = (
        "each run of a job is its own: in_flight counts the handlers not finished, and the "
        "live lease is heartbeaten until its own handler returns"
    )
    with running(pool):
        job_id = pool.submit("job")
        eventually(lambda: stalls.entered == [("job", 1)], "attempt 1 running")
        clock.settle(others, stalls.busy)
        clock.advance(LEASE)  # a stall: the lease runs out before any heartbeat
        story.add("claim -> attempt 1 (worker A); the clock jumps by the lease")
        eventually(lambda: ("job", 2) in stalls.entered, "attempt 2 claimed by the other worker")
        clock.settle(others, stalls.busy)
        stats = pool.statistics()
        story.add(f"worker B claims attempt 2: {stats}")
        story.check(
            stats.in_flight == 2, rule, f"two handlers running, in_flight {stats.in_flight}"
        )
        first.set()
        eventually(lambda: pool.statistics().lost == 1, "attempt 1's ack refused (lost)")
        clock.settle(others, stalls.busy)
        story.add("attempt 1's handler returns: its ack is refused (lost)")
        stats = pool.statistics()
        story.check(
            stats.in_flight == 1, rule, f"attempt 2 still runs, in_flight {stats.in_flight}"
        )
        for beat in (1, 2, 3, 4):
            clock.advance(EVERY)
            clock.settle(others, stalls.busy)
            now, job = clock.now_ns(), queue.get(job_id)
            story.add(f"advance({EVERY}): {pool.statistics().heartbeats} heartbeat(s)")
            story.check(
                (pool.statistics().heartbeats, job.state, job.lease_expires_at_ns)
                == (beat, JobState.LEASED, now + LEASE),
                rule,
                f"expected attempt 2's lease heartbeaten {beat} time(s), to {rel(now + LEASE)}; "
                f"the job is {job.state.value}, its lease ends {rel(job.lease_expires_at_ns)}",
            )
        second.set()
        eventually(lambda: pool.statistics().succeeded == 1, "attempt 2 acked")
    job = queue.get(job_id)
    story.check(
        (job.state, job.attempts) == (JobState.SUCCEEDED, 2),
        rule,
        f"the job ends {job.state.value} after {job.attempts} attempts",
    )


# --- heartbeats through the grace period ------------------------------------------------

GRACE = 2_500  # two and a half leases: only heartbeats keep the running job's lease


@marks.rule("heartbeats", "shutdown-grace")
@core
def test_stage2_heartbeats_go_on_through_the_grace_period() -> None:
    gate = Gate()
    clock = WatchedClock(START)
    _, queue, pool = new_pool(gate.handler, workers=1, clock=clock, heartbeat_every_ns=EVERY)
    others = set(threading.enumerate())
    with running(pool):
        job_id = pool.submit("long")
        eventually(lambda: len(gate.busy) == 1, "the job's handler running")
        stopper = spawn(lambda: pool.shutdown(GRACE), "shutdown")
        eventually(lambda: pool.statistics().stopping, "shutdown begun")
        for beat in range(1, GRACE // EVERY + 1):
            clock.advance(EVERY)
            clock.settle(others, gate.busy)
            now = clock.now_ns()
            check(
                pool.statistics().heartbeats == beat and _lease_ends(queue, job_id) == now + LEASE,
                f"shutdown({GRACE}) began at 0 with a job running (lease {LEASE}, "
                f"heartbeat_every_ns={EVERY}): through the grace period its handler still "
                f"runs, so its lease is still heartbeaten; by {rel(now)} expected {beat} "
                f"heartbeat(s), lease to {rel(now + LEASE)}; got "
                f"{pool.statistics().heartbeats}, lease ends {rel(_lease_ends(queue, job_id))}",
            )
        clock.set(START + GRACE)
        stopper.outcome("shutdown at its grace deadline")
        job, stats = queue.get(job_id), pool.statistics()
        check(
            (job.state, job.attempts, stats.released, stats.lost) == (JobState.READY, 0, 1, 0),
            f"at the grace deadline the job still running is released (READY, attempt "
            f"refunded; released 1, lost 0) — its lease, kept by heartbeats, is live; got "
            f"{job.state.value}, attempts {job.attempts}, released {stats.released}, "
            f"lost {stats.lost}",
        )
        gate.event.set()


@marks.rule("heartbeats", "shutdown-grace", "async-pool")
@extended
@anyio_test
async def test_stage2_async_heartbeats_go_on_through_the_grace_period() -> None:
    gate = AsyncGate()
    clock = WatchedClock(START)
    _, queue, pool = new_async_pool(gate.handler, workers=1, clock=clock, heartbeat_every_ns=EVERY)
    async with running_async(pool, grace_ns=None), anyio.create_task_group() as tg:
        job_id = pool.submit("long")
        await settle()
        tg.start_soon(pool.shutdown, GRACE)
        await settle()
        for beat in range(1, GRACE // EVERY + 1):
            clock.advance(EVERY)
            await settle()
            now = clock.now_ns()
            check(
                pool.statistics().heartbeats == beat and _lease_ends(queue, job_id) == now + LEASE,
                f"async pool, shutdown({GRACE}) begun with a job running (lease {LEASE}, "
                f"heartbeat_every_ns={EVERY}): its lease is heartbeaten through the grace "
                f"period; by {rel(now)} expected {beat} heartbeat(s), got "
                f"{pool.statistics().heartbeats}, lease ends {rel(_lease_ends(queue, job_id))}",
            )
        clock.set(START + GRACE)
        await settle()
    job, stats = queue.get(job_id), pool.statistics()
    check(
        (job.state, job.attempts, stats.released, stats.lost) == (JobState.READY, 0, 1, 0),
        f"async pool: at the grace deadline the running job is cancelled and released (READY, "
        f"attempt refunded; released 1, lost 0); got {job.state.value}, attempts "
        f"{job.attempts}, released {stats.released}, lost {stats.lost}",
    )


@marks.rule("heartbeat-lost")
@core
def test_stage2_a_refused_heartbeat_is_the_last_one_tried() -> None:
    """A heartbeat that raised StaleLease ends the job's heartbeats: the pool does not
    try again at the next interval, as if the refusal were a blip."""
    gate = Gate()
    clock, queue, pool = new_pool(gate.handler, workers=1, heartbeat_every_ns=300)
    counted = CountedBeats(queue)
    assert isinstance(clock, WatchedClock)
    others = set(threading.enumerate())
    with running(pool):
        job_id = pool.submit("cancelled while it runs")
        eventually(lambda: len(gate.entered) == 1, "the job's handler running")
        clock.advance(300)
        eventually(lambda: pool.statistics().heartbeats == 1, "the first heartbeat at 300 ns")
        clock.settle(others, gate.busy)
        assert queue.cancel(job_id) is True  # every pool thread is parked: no race
        clock.advance(300)
        eventually(lambda: counted.calls == 2, "the second heartbeat tried, and refused")
        for _ in range(3):
            clock.settle(others, gate.busy)
            clock.advance(300)
        clock.settle(others, gate.busy)
        check(
            counted.calls == 2,
            f"heartbeat_every_ns=300: heartbeat at 300 ns; the job cancelled; the heartbeat at "
            f"600 ns refused (StaleLease): the job is lost, and the pool stops heartbeating "
            f"it. Three intervals later expected 2 heartbeat calls in all, got {counted.calls}",
        )
        gate.event.set()
        eventually(lambda: pool.statistics().lost == 1, "the job counted as lost")


@marks.rule("heartbeats")
@core
def test_stage2_a_job_claimed_when_it_falls_due_is_heartbeaten() -> None:
    """Nothing runs, so the heartbeats have nothing to wait for; a scheduled job falls due
    and a worker claims it on its own wake-up: its heartbeats come all the same. On a
    clock whose deadlines wake only the thread that waited for them, as a real timeout
    does, whoever heartbeats learns of the job only if the claim says so."""
    gate = Gate()
    clock = SelfWakingClock(START)
    _, _, pool = new_pool(gate.handler, workers=1, clock=clock, heartbeat_every_ns=300)
    others = set(threading.enumerate())
    with running(pool):
        pool.submit("later", run_at_ns=START + 1_000)
        clock.settle(others, gate.busy)  # every pool thread asleep: nothing runs yet
        clock.advance(1_000)
        eventually(lambda: len(gate.entered) == 1, "the job claimed when it fell due")
        clock.advance(300)
        eventually(
            lambda: stat(pool, "heartbeats")() >= 1,
            "a heartbeat 300 ns after the claim of a job that fell due while nothing ran "
            "(the claim gives the heartbeats a deadline)",
        )
        check(
            pool.statistics().heartbeats == 1,
            f"a job due at 1000 ns, claimed then; heartbeat_every_ns=300: one heartbeat at "
            f"1300 ns, got {pool.statistics().heartbeats}",
        )
        gate.event.set()
        eventually(lambda: pool.statistics().succeeded == 1, "the job acked")


@marks.rule("heartbeat-lost", "pool-statistics", "handler-error-nacked")
@core
def test_stage2_a_handler_that_raises_after_its_job_was_lost_counts_lost_not_failed() -> None:
    """The job is cancelled while its handler runs, and the handler then raises: its nack
    is refused, so the job is ``lost`` — and not ``failed`` as well."""
    entered, release = threading.Event(), threading.Event()

    def handler(lease: Lease, payload: Any) -> Any:
        entered.set()
        wait_at(release, "a handler that will raise")
        raise ValueError("too late")

    _clock, queue, pool = new_pool(handler, workers=1)
    with running(pool):
        job_id = pool.submit("cancelled while it runs")
        check(entered.wait(DEADLINE_S), "the job's handler must run")
        eventually(lambda: pool.statistics().in_flight == 1, "the job in flight")
        assert queue.cancel(job_id) is True  # the other threads are asleep on the clock
        release.set()
        eventually(lambda: pool.statistics().in_flight == 0, "the handler to return")
        stats = pool.statistics()
        check(
            (stats.failed, stats.lost) == (0, 1),
            f"the job was cancelled while its handler ran; the handler then raised, and its "
            f"nack was refused (StaleLease): the job counts as lost, not failed too; got "
            f"failed {stats.failed}, lost {stats.lost}",
        )


# --- a lost job the queue has forgotten --------------------------------------------------

#: A stall that outlasts a running job's lease and then its retention: the job dies (one
#: attempt) and the queue forgets it, so its lease is answered with JobNotFound.
FORGOTTEN = LEASE + DEFAULT_RETENTION_NS

FORGOTTEN_RULE = (
    "a lease the queue no longer honours — StaleLease, or JobNotFound once its job was "
    "forgotten after its retention — is a lost job: its heartbeats stop, its ack and its "
    "release are refused, it counts as lost, and the pool runs on"
)


def _judge_forgotten(
    story: Story,
    seen: list[tuple[int, int | None, int]],
    after_a: PoolStatistics,
    refused: list[Exception],
    stats: PoolStatistics,
) -> None:
    """Either pool, after a was forgotten in a stall and b after a second one: b kept its
    lease by each heartbeat (``seen``: heartbeats, lease end, when), a was lost once its
    handler returned with b still in flight, and shutdown(0) raised nothing (``refused``)
    and counted b lost."""
    for beat, (beats, ends, now) in enumerate(seen, start=1):
        story.check(
            (beats, ends) == (beat, now + LEASE),
            FORGOTTEN_RULE,
            f"expected b heartbeaten {beat} time(s), its lease to {rel(now + LEASE)}; its "
            f"lease ends {rel(ends)}",
        )
    story.check(
        (after_a.lost, after_a.succeeded, after_a.in_flight) == (1, 0, 1),
        FORGOTTEN_RULE,
        "expected a lost (its ack refused), nothing succeeded, b still in flight",
    )
    story.check(not refused, FORGOTTEN_RULE, f"shutdown(0) raised {refused[:1]!r}")
    story.check(
        (stats.lost, stats.released, stats.in_flight) == (2, 0, 0),
        FORGOTTEN_RULE,
        f"expected shutdown to count b lost (2 lost, none released, none in flight); {stats}",
    )


@marks.rule("heartbeat-lost", "shutdown-grace", "pool-statistics")
@core
def test_stage2_a_job_the_queue_forgot_in_a_stall_is_lost_and_the_pool_runs_on() -> None:
    stalls = Stalls()
    first, second = stalls.hold("a"), stalls.hold("b")
    clock = WatchedClock(START)
    _, queue, pool = new_pool(stalls.handler, workers=2, clock=clock, heartbeat_every_ns=EVERY)
    others = set(threading.enumerate())
    story = Story(
        f"2 workers, lease {LEASE}, 1 attempt, heartbeat_every_ns={EVERY}:", clock.now_ns, START
    )
    seen: list[tuple[int, int | None, int]] = []  # (heartbeats, b's lease end, now)
    refused: list[Exception] = []
    # Judged once the pool is shut down: a check failing inside would leave a shutdown to
    # the way out, and what it raised would hide the check's message.
    with running(pool):
        pool.submit("a")
        eventually(lambda: stalls.entered == [("a", 1)], "a's handler running")
        clock.settle(others, stalls.busy)
        clock.advance(FORGOTTEN)
        clock.settle(others, stalls.busy)
        story.add(f"a claimed; a stall of lease + retention ({FORGOTTEN} ns): a is forgotten")
        b = pool.submit("b")
        eventually(lambda: ("b", 1) in stalls.entered, "b's handler running")
        clock.settle(others, stalls.busy)
        story.add("b submitted and claimed by the other worker")
        for _ in range(3):
            clock.advance(EVERY)
            clock.settle(others, stalls.busy)
            seen.append((pool.statistics().heartbeats, _lease_ends(queue, b), clock.now_ns()))
            story.add(f"advance({EVERY}): {seen[-1][0]} heartbeat(s)")
        first.set()
        eventually(lambda: len(stalls.busy) == 1, "a's handler returning")
        clock.settle(others, stalls.busy)
        after_a = pool.statistics()
        story.add(f"a's handler returns: {after_a}")
        clock.advance(FORGOTTEN)
        clock.settle(others, stalls.busy)
        story.add(f"another stall of {FORGOTTEN} ns: b is forgotten too; shutdown(0)")
        try:
            pool.shutdown(0)
        except Exception as exc:
            refused.append(exc)
        second.set()
        eventually(lambda: not stalls.busy, "b's handler returning")
    _judge_forgotten(story, seen, after_a, refused, pool.statistics())


@marks.rule("heartbeat-lost", "async-shutdown-cancels", "pool-statistics", "async-pool")
@extended
@anyio_test
async def test_stage2_async_a_job_the_queue_forgot_in_a_stall_is_lost_and_the_pool_runs_on() -> (
    None
):
    events = {"a": anyio.Event(), "b": anyio.Event()}

    async def handler(lease: Lease, payload: Any) -> Any:
        await events[payload].wait()
        return payload

    clock = WatchedClock(START)
    _, queue, pool = new_async_pool(handler, workers=2, clock=clock, heartbeat_every_ns=EVERY)
    story = Story(
        f"async, 2 workers, lease {LEASE}, 1 attempt, heartbeat_every_ns={EVERY}:",
        clock.now_ns,
        START,
    )
    seen: list[tuple[int, int | None, int]] = []  # (heartbeats, b's lease end, now)
    after_a: list[PoolStatistics] = []
    try:
        async with running_async(pool):
            pool.submit("a")
            await settle()
            clock.advance(FORGOTTEN)
            story.add(f"a claimed; a stall of lease + retention ({FORGOTTEN} ns): a is forgotten")
            await settle()
            b = pool.submit("b")
            await settle()
            story.add("b submitted and claimed by the other worker")
            for _ in range(3):
                clock.advance(EVERY)
                await settle()
                seen.append((pool.statistics().heartbeats, _lease_ends(queue, b), clock.now_ns()))
                story.add(f"advance({EVERY}): {seen[-1][0]} heartbeat(s)")
            events["a"].set()
            await settle()
            after_a.append(pool.statistics())
            story.add(f"a's handler returns: {after_a[0]}")
            clock.advance(FORGOTTEN)
            await settle()
            story.add(f"another stall of {FORGOTTEN} ns: b is forgotten too; shutdown(0)")
    except Todo:
        raise
    except Exception as exc:
        story.check(False, FORGOTTEN_RULE, f"the pool raised {exc!r}")
    _judge_forgotten(story, seen, after_a[0], [], pool.statistics())
