"""Stage 2 suite, waking, timeouts, shutdown and the pool's bookkeeping at their
boundaries (see katas/job_scheduler/README.md, "Stage 2").

The stage's first file, ``test_stage2.py``, has the examples of every rule and
``test_stage2_heartbeats.py`` the heartbeats'; here: a submit that must wake an idle
worker whichever thread waits longest, a handler that returns long before its timeout,
who counts as idle, a job whose lease is already stale when shutdown comes to release
it, a lost job whose handler ends while shutdown waits for it, and a job released
before its handler began.

How these tests stay deterministic: the clock is a ``WatchedClock`` (an ``OrderedClock``,
where the order in which a condition's waiters wake matters), so a test waits until
every thread of the pool is parked on it and judges at once; the async pool is judged
after the harness's ``settle()`` (every task blocked, several scheduler passes in a
row). Handlers block on events the test sets.

Map: a submit wakes an idle worker (no-busy-waiting) · a handler done before its timeout
(handler-acked, async-timeout) · idle workers (pool-statistics, bounded-in-flight,
async-pool) · a lease already stale at shutdown (pool-statistics, shutdown-grace,
heartbeat-lost, async-shutdown-cancels) · a lost job's handler ending during the grace
period (shutdown-grace, heartbeat-lost, pool-statistics, async-pool) · a job released
between its claim and its handler (late-result-dropped, shutdown-grace, one-worker-per-job).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import partial
from typing import Any

import anyio
import pytest

from katas._harness import marks
from katas._harness.marks import anyio_test, core, extended
from katas._harness.resting import WatchedClock
from katas._harness.story import Story, check
from katas._harness.virtual_time import settle
from katas._harness.waiting import DEADLINE_S, eventually, spawn
from katas.job_scheduler._testing.clocks import WAKE_ORDERS, OrderedClock
from katas.job_scheduler._testing.gaps import pool_paused_after_a_claim
from katas.job_scheduler._testing.pools import (
    AsyncGate,
    Gate,
    Stalls,
    fail_fast_on_pool_stubs,  # noqa: F401 (autouse)
    new_async_pool,
    new_pool,
    running,
    running_async,
    stat,
)
from katas.job_scheduler._testing.queues import LEASE, START
from katas.job_scheduler.api import JobQueue, JobState, Lease, PoolStatistics

pytestmark = [pytest.mark.stage(2)]


# --- a submit wakes an idle worker -------------------------------------------------------


@marks.rule("no-busy-waiting")
@core
def test_stage2_every_submit_wakes_an_idle_worker_whoever_waits_longest() -> None:
    """Two workers and whatever else of the pool waits (a heartbeat thread): one worker
    runs a held job, the other is idle, and a second job is submitted. Whichever thread
    the pool's condition wakes first — its oldest waiter, its newest, or the one asleep
    until the soonest deadline (the heartbeat thread, while a job runs) — the idle worker
    must take the job."""
    stalls = Stalls()
    clock = OrderedClock(START)
    _, _, pool = new_pool(stalls.handler, workers=2, clock=clock)
    others = set(threading.enumerate())
    story = Story("2 workers, every job held by the test until it ends the round:", clock.now_ns)
    with running(pool):
        for i, order in enumerate(WAKE_ORDERS):
            clock.order = order
            held = [stalls.hold(f"x{i}"), stalls.hold(f"y{i}")]
            for n, payload in enumerate((f"x{i}", f"y{i}"), start=1):
                clock.settle(others, stalls.busy)
                pool.submit(payload)
                clock.settle(others, stalls.busy)  # every thread asleep: nothing more happens
                story.add(f"(notify() wakes the {order} waiter) submit({payload!r}): {n} running")
                story.check(
                    pool.statistics().claimed == 2 * i + n,
                    "an idle worker waits until the queue's next_due_ns() or until submit wakes "
                    "it: every submit must reach an idle worker, not only some other waiter "
                    "(a heartbeat thread, a worker with no free slot)",
                    f"{payload!r} is READY, a worker idle, and every thread of the pool "
                    f"asleep: {pool.statistics()}",
                )
            for event in held:
                event.set()
            eventually(
                partial(lambda n: stat(pool, "succeeded")() == n, 2 * i + 2),
                "the round's jobs acked",
            )


# --- a handler done before its timeout ---------------------------------------------------


@marks.rule("handler-acked", "async-timeout")
@extended
@anyio_test
async def test_stage2_async_a_handler_done_before_its_timeout_is_acked_at_once() -> None:
    async def handler(lease: Lease, payload: int) -> int:
        return payload * 10

    _, queue, pool = new_async_pool(handler, workers=1, timeout_ns=10 * LEASE)
    async with running_async(pool):
        ids = [pool.submit(i) for i in range(3)]
        await settle()  # the clock stands still: nothing more happens
        got = [(queue.get(j).state, queue.get(j).result) for j in ids]
        check(
            got == [(JobState.SUCCEEDED, i * 10) for i in range(3)],
            f"timeout_ns={10 * LEASE} only cancels a handler still running then: handlers "
            f"that return at once are acked at once, their worker free for the next job — "
            f"with the clock standing still, one worker and 3 jobs ended {got}",
        )


# --- idle workers ------------------------------------------------------------------------


@marks.rule("pool-statistics", "bounded-in-flight")
@core
def test_stage2_a_worker_waiting_for_a_free_slot_counts_as_idle() -> None:
    gate = Gate()
    clock = WatchedClock(START)
    _, _, pool = new_pool(gate.handler, workers=3, clock=clock, max_in_flight=1)
    others = set(threading.enumerate())
    with running(pool):
        clock.settle(others, gate.busy)
        idle = [pool.statistics().idle]
        pool.submit("runs")
        pool.submit("waits for the slot")
        eventually(lambda: len(gate.busy) >= 1, "a handler running")
        clock.settle(others, gate.busy)
        stats = pool.statistics()
        idle.append(stats.idle)
        gate.event.set()
        eventually(lambda: pool.statistics().succeeded == 2, "both jobs acked")
        clock.settle(others, gate.busy)
        idle.append(pool.statistics().idle)
    check(
        idle == [3, 2, 3] and stats.in_flight == 1,
        "idle counts the workers waiting — for a due job, or for a free max_in_flight slot: "
        "3 workers, max_in_flight=1; expected idle 3 with nothing to do, 2 while one job "
        f"runs and another waits for the slot, 3 again after; got {idle} "
        f"(in_flight {stats.in_flight})",
    )


@marks.rule("pool-statistics", "async-pool", "bounded-in-flight")
@extended
@anyio_test
async def test_stage2_async_a_worker_waiting_for_a_free_slot_counts_as_idle() -> None:
    gate = AsyncGate()
    _, _, pool = new_async_pool(gate.handler, workers=3, max_in_flight=1)
    async with running_async(pool):
        await settle()
        idle = [pool.statistics().idle]
        pool.submit("runs")
        pool.submit("waits for the slot")
        await settle()
        stats = pool.statistics()
        idle.append(stats.idle)
        gate.event.set()
        await settle()
        idle.append(pool.statistics().idle)
        succeeded = pool.statistics().succeeded
    check(
        idle == [3, 2, 3] and stats.in_flight == 1,
        "async pool: idle counts the workers waiting — for a due job, or for a free "
        "max_in_flight slot: 3 workers, max_in_flight=1; expected idle 3, then 2 while one "
        f"job runs and another waits for the slot, then 3; got {idle} (in_flight "
        f"{stats.in_flight})",
    )
    check(
        succeeded == 2,
        "bounded-in-flight: 3 workers, max_in_flight=1, 2 jobs; once the first handler "
        "returns, its slot is free and the worker waiting for it runs the second job at "
        f"once: expected 2 succeeded; got {succeeded}",
    )


# --- a lease already stale at shutdown ---------------------------------------------------

#: How a running job's lease goes stale before shutdown: its job cancelled, or the clock
#: jumping past its expiry (a stall: no heartbeat could run), which kills it (1 attempt).
STALE = ["cancelled", "expired in a stall"]


def _make_stale(how: str, queue: JobQueue, job_id: str, advance: Callable[[int], None]) -> None:
    if how == "cancelled":
        assert queue.cancel(job_id) is True
    else:
        advance(LEASE)


def _judge_stale_shutdown(
    pool: str, how: str, before: JobState, after: JobState, stats: PoolStatistics
) -> None:
    check(
        before == after and (stats.released, stats.lost) == (0, 1),
        f"{pool}: a job whose lease is already stale ({how}) when shutdown(0) comes to "
        "release it is lost, not released: the refused release changes nothing and counts "
        f"in lost only; the job went from {before.value} to {after.value}; {stats}",
    )


@marks.rule("pool-statistics", "shutdown-grace", "heartbeat-lost")
@core
@pytest.mark.parametrize("how", STALE)
def test_stage2_a_job_whose_lease_is_stale_at_shutdown_is_lost_not_released(how: str) -> None:
    stalls = Stalls()
    held = stalls.hold("job")
    clock = WatchedClock(START)
    _, queue, pool = new_pool(stalls.handler, workers=1, clock=clock, heartbeat_every_ns=300)
    others = set(threading.enumerate())
    with running(pool):
        job_id = pool.submit("job")
        eventually(lambda: len(stalls.busy) == 1, "the job's handler running")
        clock.settle(others, stalls.busy)
        _make_stale(how, queue, job_id, clock.advance)
        clock.settle(others, stalls.busy)
        before = queue.get(job_id).state
        pool.shutdown(0)
        _judge_stale_shutdown(
            "thread pool", how, before, queue.get(job_id).state, pool.statistics()
        )
        held.set()
        eventually(lambda: not stalls.busy, "the handler to return")
        eventually(lambda: pool.statistics().in_flight == 0, "nothing in flight")
    _judge_stale_shutdown("thread pool", how, before, queue.get(job_id).state, pool.statistics())


@marks.rule("pool-statistics", "async-shutdown-cancels")
@extended
@anyio_test
@pytest.mark.parametrize("how", STALE)
async def test_stage2_async_a_job_whose_lease_is_stale_at_shutdown_is_lost_not_released(
    how: str,
) -> None:
    gate = AsyncGate()
    clock, queue, pool = new_async_pool(gate.handler, workers=1, heartbeat_every_ns=300)
    async with running_async(pool, grace_ns=None):
        job_id = pool.submit("job")
        await settle()
        _make_stale(how, queue, job_id, clock.advance)
        await settle()
        before = queue.get(job_id).state
        await pool.shutdown(0)
    _judge_stale_shutdown("async pool", how, before, queue.get(job_id).state, pool.statistics())


@marks.rule("shutdown-stops-claiming")
@core
def test_stage2_a_worker_waiting_for_a_scheduled_job_claims_nothing_after_shutdown() -> None:
    """An idle worker waits for a job due later; shutdown wakes it — and it must not go
    back to waiting for that job, then claim it once it falls due."""
    clock, queue, pool = new_pool(lambda lease, payload: payload, workers=1)
    with running(pool):
        job_id = pool.submit("later", run_at_ns=START + 1_000)
        eventually(lambda: pool.statistics().idle == 1, "the worker waiting for the job's time")
        pool.shutdown(0)
        clock.advance(1_000)
        eventually(lambda: pool.statistics().idle == 0, "the worker gone")
        job = queue.get(job_id)
        check(
            (job.state, pool.statistics().claimed, queue.statistics().leased)
            == (JobState.READY, 0, 0),
            f"a job due at 1000 ns; the one worker idle, waiting for it; shutdown(0) at 0 ns; "
            f"the clock moves to 1000 ns: shutdown stops claiming at once, so the job stays "
            f"READY and unleased; got {job.state}, claimed {pool.statistics().claimed}, "
            f"{queue.statistics().leased} lease(s)",
        )


# --- a lost job's handler ends while shutdown waits ---------------------------------------

#: How a lost job's handler ends: its ack, or its nack, is then refused (StaleLease).
ENDINGS = ["returns", "raises"]
GRACE = 1_000
STALE_IDS = ["cancelled", "expired-in-a-stall"]


def _judge_lost_during_grace(
    pool: str,
    how: str,
    ending: str,
    waiting: bool,
    returned_at: int | None,
    at: int,
    stats: PoolStatistics,
) -> None:
    refused = "ack" if ending == "returns" else "nack"
    when = "not at all" if returned_at is None else f"at {returned_at} ns"
    steps = (
        f"{pool}: one job running; its lease goes stale ({how}); at {at} ns "
        f"shutdown(grace_ns={GRACE}) begins and waits for it; still at {at} ns its handler "
        f"{ending}, its {refused} refused (StaleLease): the job is lost"
    )
    check(
        waiting,
        f"shutdown-grace: {steps} — but shutdown had not waited while the handler still ran "
        f"(it waits until the running handlers have finished or the grace deadline); {stats}",
    )
    check(
        returned_at == at,
        f"shutdown-grace: {steps}. Shutdown waits until the running handlers have finished "
        f"or now + grace_ns, whichever comes first: a lost job's handler has finished too. "
        f"Expected shutdown to return at {at} ns, the clock unmoved; it returned {when} "
        f"(the grace deadline is {at + GRACE} ns)",
    )
    check(
        (stats.lost, stats.released, stats.succeeded, stats.failed, stats.in_flight)
        == (1, 0, 0, 0, 0),
        f"pool-statistics: {steps}; expected lost 1, nothing released, succeeded or failed, "
        f"nothing in flight; got {stats}",
    )


@marks.rule("shutdown-grace", "heartbeat-lost", "pool-statistics")
@core
@pytest.mark.parametrize("ending", ENDINGS)
@pytest.mark.parametrize("how", STALE, ids=STALE_IDS)
def test_stage2_shutdown_returns_when_a_lost_jobs_handler_finishes(how: str, ending: str) -> None:
    """A job's lease goes stale while its handler runs; shutdown(grace) begins. When the
    handler returns or raises, its ack or nack is refused — and shutdown, waiting for the
    running handlers, must return then, not at the grace deadline."""
    stalls = Stalls()
    held = stalls.hold("job")

    def handler(lease: Lease, payload: Any) -> Any:
        stalls.handler(lease, payload)
        if ending == "raises":
            raise ValueError("too late")
        return payload

    clock = WatchedClock(START)
    _, queue, pool = new_pool(handler, workers=1, clock=clock, heartbeat_every_ns=300)
    others = set(threading.enumerate())
    with running(pool):
        job_id = pool.submit("job")
        eventually(lambda: len(stalls.busy) == 1, "the job's handler running")
        clock.settle(others, stalls.busy)
        _make_stale(how, queue, job_id, clock.advance)
        clock.settle(others, stalls.busy)
        at = clock.now_ns()
        stopper = spawn(lambda: pool.shutdown(GRACE), "shutdown")
        eventually(lambda: pool.statistics().stopping, "shutdown begun")
        clock.settle(others, stalls.busy)  # shutdown asleep on the clock, waiting
        waiting = stopper.is_alive()
        held.set()
        eventually(lambda: not stalls.busy, "the handler to end")
        clock.settle(others, set())  # every thread of the pool gone or asleep
        returned_at = None if stopper.is_alive() else clock.now_ns()
        if returned_at is None:
            clock.advance(GRACE)  # whatever happens, the grace ends
            stopper.outcome("shutdown at its grace deadline")
            returned_at = clock.now_ns()
        stats = pool.statistics()
    _judge_lost_during_grace("thread pool", how, ending, waiting, returned_at, at, stats)


@marks.rule("shutdown-grace", "heartbeat-lost", "pool-statistics", "async-pool")
@extended
@anyio_test
@pytest.mark.parametrize("ending", ENDINGS)
@pytest.mark.parametrize("how", STALE, ids=STALE_IDS)
async def test_stage2_async_shutdown_returns_when_a_lost_jobs_handler_finishes(
    how: str, ending: str
) -> None:
    release = anyio.Event()

    async def handler(lease: Lease, payload: Any) -> Any:
        await release.wait()
        if ending == "raises":
            raise ValueError("too late")
        return payload

    clock = WatchedClock(START)
    _, queue, pool = new_async_pool(handler, workers=1, clock=clock, heartbeat_every_ns=300)
    stopped: list[int] = []

    async def stop() -> None:
        await pool.shutdown(GRACE)
        stopped.append(clock.now_ns())

    async with running_async(pool, grace_ns=None), anyio.create_task_group() as tg:
        job_id = pool.submit("job")
        await settle()
        _make_stale(how, queue, job_id, clock.advance)
        await settle()
        at = clock.now_ns()
        tg.start_soon(stop)
        await settle()
        waiting = pool.statistics().stopping and not stopped
        release.set()
        await settle()
        returned_at = stopped[0] if stopped else None
        stats = pool.statistics()
        clock.advance(GRACE)  # whatever happens, the grace ends
    if returned_at is None and stopped:
        returned_at = stopped[0]
    _judge_lost_during_grace("async pool", how, ending, waiting, returned_at, at, stats)


# --- a job released between its claim and its handler -------------------------------------


@marks.rule("late-result-dropped", "shutdown-grace", "one-worker-per-job")
@core
def test_stage2_a_job_released_before_its_handler_began_is_never_handed_to_it() -> None:
    """A worker has claimed a job and left the pool's lock, but not yet called its handler;
    shutdown(0) comes in that gap and releases the job (READY again, for another worker
    anywhere to claim). The worker must not start the handler then: once shutdown has
    returned, no handler of the pool begins."""
    began: list[Any] = []
    resume = threading.Event()

    def handler(lease: Lease, payload: Any) -> Any:
        began.append(payload)
        return payload

    others = set(threading.enumerate())
    _, queue, pool, claimed = pool_paused_after_a_claim(handler, resume)
    pool.start()
    try:
        job_id = pool.submit("job")
        check(claimed.wait(DEADLINE_S), "the worker must claim the submitted job")
        pool.shutdown(0)  # the worker stands after its claim's lock section
    finally:
        resume.set()
    threads = [t for t in threading.enumerate() if t not in others]
    eventually(lambda: not any(t.is_alive() for t in threads), "the pool's threads to exit")
    job, stats = queue.get(job_id), pool.statistics()
    check(
        not began and job.state is JobState.READY and stats.released == 1,
        "late-result-dropped: a worker claimed the job and left the pool's lock; before it "
        "called the handler, shutdown(0) released the job (READY again, attempt refunded) "
        "and returned; the worker then went on: expected the handler never called, the job "
        f"READY, 1 released; got the handler called with {began}, the job "
        f"{job.state.value}, {stats}",
    )
