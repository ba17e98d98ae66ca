"""Stage 2 suite: worker pools around the stage-1 queue (see katas/job_scheduler/README.md).

Core: ``ThreadWorkerPool`` — concurrent handlers outside the queue's lock, heartbeats
while a handler runs, bounded in-flight work, ack/nack, ``shutdown(grace_ns)`` and
``statistics()``. Extended: ``AsyncWorkerPool`` on anyio (asyncio and trio), with
per-job timeouts by cancellation.

How these tests stay deterministic: the clock is a ``ManualClock`` that moves only when
a test advances it; handlers block on events the test sets; progress is sequenced
through ``pool.statistics()`` instead of sleeps; every wait has a hard real-time
deadline, and every thread is a daemon. Races are provoked with many workers under a
tiny ``sys.setswitchinterval``, with exact-count assertions. The pools are built by
:mod:`katas.job_scheduler._testing.pools`; the clock that knows who sleeps on it is
:mod:`katas.job_scheduler._testing.clocks`'s.

The stage's other files: ``test_stage2_heartbeats.py`` (the heartbeat rules at their
boundaries) and ``test_stage2_shutdown.py`` (waking, timeouts, idle workers, a lease
already stale at shutdown).

Map: examples (handler-acked, handler-error-nacked, outside-the-lock, bounded-in-flight,
no-busy-waiting, heartbeats, heartbeat-default, heartbeat-lost, late-result-dropped,
shutdown-stops-claiming, shutdown-grace, start-once, pool-bad-input) · a property over
drawn workloads (one-worker-per-job) · the async pool (async-pool, async-timeout,
async-shutdown-cancels) · a state machine of the pool's bookkeeping (pool-statistics,
bounded-in-flight, shutdown-grace).
"""

from __future__ import annotations

import sys
import threading
import time
from functools import partial
from typing import Any

import anyio
import anyio.lowlevel
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from katas._harness import marks
from katas._harness.interleave import Gate as InterleaveGate
from katas._harness.interleave import announce_waits, pause_after_unlocks, pause_in_updates
from katas._harness.marks import anyio_test, core, extended
from katas._harness.profiles import heavy_examples
from katas._harness.resting import WatchedClock, rest_on, wait_at
from katas._harness.story import check, expect, not_refused
from katas._harness.under_test import stage
from katas._harness.virtual_time import settle
from katas._harness.waiting import (
    DEADLINE_S,
    QUIET_S,
    eventually,
    eventually_async,
    spawn,
    stays,
    stays_async,
    tiny_switch_interval,
)
from katas.job_scheduler._testing.clocks import LONG_LEASE, beats_at_a_third
from katas.job_scheduler._testing.pools import (
    AsyncGate,
    Gate,
    fail_fast_on_pool_stubs,  # noqa: F401 (autouse)
    idle_handler,
    lock_watched_queue,
    new_async_pool,
    new_pool,
    pool_queue,
    running,
    running_async,
    stat,
)
from katas.job_scheduler._testing.queues import LEASE, START, rel
from katas.job_scheduler.api import (
    TIMED_OUT,
    JobQueue,
    JobState,
    Lease,
    MonotonicClock,
    RetryPolicy,
    WorkerPool,
)

pytestmark = [pytest.mark.stage(2)]


# --- examples --------------------------------------------------------------------------


@marks.rule("handler-acked", "pool-statistics")
@core
def test_stage2_pool_runs_every_job_and_acks_its_result() -> None:
    _clock, queue, pool = new_pool(lambda lease, payload: payload * 2, workers=3)
    expect(pool.statistics().workers, 3, "statistics().workers of a pool of 3 not started")
    with running(pool):
        expect(pool.statistics().workers, 3, "statistics().workers of a pool of 3 running")
        ids = [pool.submit(i) for i in range(10)]
        eventually(lambda: pool.statistics().succeeded == 10, "10 jobs succeeded")
        pool.shutdown(0)
    for i, job_id in enumerate(ids):
        job = queue.get(job_id)
        assert (job.state, job.result) == (JobState.SUCCEEDED, 2 * i), (
            f"job of payload {i} ended {job.state} with result {job.result!r}; "
            f"the handler returned {2 * i}, which the pool must ack"
        )
    stats = pool.statistics()
    assert (stats.claimed, stats.failed, stats.in_flight) == (10, 0, 0), f"{stats}"


@marks.rule("handler-error-nacked")
@core
def test_stage2_handler_exception_nacks_the_job_with_the_error() -> None:
    def handler(lease: Lease, payload: Any) -> None:
        raise ValueError(f"boom {payload}") if payload else RuntimeError()

    _clock, queue, pool = new_pool(handler, workers=2, max_attempts=2)
    with running(pool):
        job_id, silent = pool.submit(7), pool.submit(0)
        eventually(  # an ack instead is off course at once: judge it then
            lambda: pool.statistics().failed == 4 or pool.statistics().succeeded > 0,
            "both attempts of both jobs nacked",
        )
        pool.shutdown(0)
    assert queue.get(silent).last_error == "RuntimeError: ", (
        f"RuntimeError() has an empty message: '<ExceptionType>: <message>' is "
        f"'RuntimeError: '; last_error is {queue.get(silent).last_error!r}"
    )
    job = queue.get(job_id)
    assert job.state is JobState.DEAD and job.attempts == 2, (
        f"a handler raising on every attempt (max_attempts 2) left the job "
        f"{job.state} after {job.attempts} attempts; expected DEAD after 2 (nacked each time)"
    )
    assert job.last_error == "ValueError: boom 7", (
        f"the nack carries the handler's error as '<ExceptionType>: <message>' — "
        f"ValueError('boom 7') gives 'ValueError: boom 7'; last_error is {job.last_error!r}"
    )
    assert pool.statistics().succeeded == 0


@marks.rule("outside-the-lock")
@core
def test_stage2_handlers_run_concurrently_outside_the_lock() -> None:
    barrier = threading.Barrier(3, timeout=1.0)
    met: list[bool] = []

    def handler(lease: Lease, payload: Any) -> None:
        try:
            barrier.wait()
            met.append(True)
        except threading.BrokenBarrierError:
            met.append(False)

    _clock, _queue, pool = new_pool(handler, workers=3)
    with running(pool):
        for i in range(3):
            pool.submit(i)
        eventually(lambda: len(met) == 3, "3 handlers to return")
    assert met == [True] * 3, (
        "3 workers with 3 jobs must run the 3 handlers at the same time (they "
        f"meet at a barrier); got {met.count(True)} of 3 meeting — is the handler run "
        "under the pool's lock?"
    )


@marks.rule("outside-the-lock")
@core
@pytest.mark.parametrize("at", ["claim", "get", "heartbeat", "ack", "nack"])
def test_stage2_every_call_on_the_queue_is_made_under_the_one_lock(at: str) -> None:
    """A pool thread is parked inside ``queue.<at>(...)``; meanwhile a producer submits.
    The queue is not thread-safe: the producer's enqueue must wait for the lock the
    parked call was made under, not run beside it."""
    parked = InterleaveGate(f"inside queue.{at}()", limit=1)
    clock, queue, calls = lock_watched_queue(parked, at)
    proceed = threading.Event()

    def handler(lease: Lease, payload: str) -> str:
        if payload == "job" and at == "heartbeat":
            wait_at(proceed, "the job's handler")
        if payload == "job" and at == "nack":
            raise RuntimeError("the job fails")
        return payload

    pool: WorkerPool = stage(2).ThreadWorkerPool(
        queue, handler, workers=2, clock=clock, heartbeat_every_ns=300
    )
    queue.enqueue("job")  # before the threads start: the first claim may be parked
    with running(pool):
        if at == "heartbeat":
            eventually(lambda: pool.statistics().in_flight == 1, "the job in flight")
            clock.advance(300)  # its first heartbeat is due
        parked.wait_arrived()
        producer = spawn(lambda: pool.submit("probe"), "producer")
        calls.wait_overlap(4 * QUIET_S)
        overlaps = list(calls.overlaps)
        parked.open()
        proceed.set()
        producer.outcome(f"submit, once the parked queue.{at}() has returned")
        eventually(
            lambda: pool.statistics().succeeded + pool.statistics().failed == 2, "both jobs done"
        )
    check(
        not overlaps,
        f"one lock guards every call on the queue (submit's enqueue included): while a pool "
        f"thread was inside queue.{at}(...), another thread called the queue too — "
        f"{overlaps[0] if overlaps else ''}. The stage-1 queue is not thread-safe",
    )


@marks.rule("bounded-in-flight")
@core
def test_stage2_in_flight_work_is_bounded() -> None:
    gate = Gate()
    _clock, _queue, pool = new_pool(gate.handler, workers=4, max_in_flight=2)
    with running(pool):
        for i in range(5):
            pool.submit(i)
        eventually(lambda: len(gate.entered) == 2, "2 handlers running")
        stays(
            lambda: len(gate.entered) == 2 and pool.statistics().in_flight == 2,
            "2 jobs in flight (max_in_flight=2, 4 workers, 5 jobs)",
        )
        gate.event.set()
        eventually(lambda: pool.statistics().succeeded == 5, "all 5 jobs succeeded")
    assert sorted(gate.entered) == list(range(5))


@marks.rule("bounded-in-flight", "one-worker-per-job")
@core
def test_stage2_a_claimed_job_takes_its_slot_in_the_claims_own_lock_section() -> None:
    """Two jobs, two workers, max_in_flight=1. Once its claim returned, the first worker
    stops right after each lock section it leaves (until its handler starts): the other
    worker runs through every gap, and must find the one slot taken."""
    claimed: list[str] = []
    gate = Gate()
    module = stage(2).ThreadWorkerPool.__module__
    base: type[Any] = stage(1).JobQueue

    class Claims(base):  # type: ignore[misc]
        def claim(self, worker_id: str) -> Lease | None:
            lease: Lease | None = super().claim(worker_id)
            if lease is not None:
                claimed.append(lease.job_id)
                if len(claimed) == 1:  # this worker stops in each gap it leaves, long
                    # enough for the other to be scheduled even on a busy machine
                    pause_after_unlocks(
                        module, lambda: len(claimed) > 1, lambda: bool(gate.entered), 0.2
                    )
            return lease

    clock = WatchedClock(START)
    rest_on(clock)
    queue = Claims(clock=clock, lease_ns=LEASE, retry=RetryPolicy(0, 0, "none"), max_attempts=1)
    pool: WorkerPool = stage(2).ThreadWorkerPool(
        queue, gate.handler, workers=2, clock=clock, max_in_flight=1
    )
    queue.enqueue("a")
    queue.enqueue("b")
    with running(pool):
        eventually(lambda: len(gate.entered) == 1, "the first job's handler running")
        stays(
            lambda: len(claimed) == 1,
            "a single claim while the first job runs (max_in_flight=1: a claimed job takes "
            "its slot in its claim's own lock section; taken in a later one, the other "
            "worker finds the slot free in between and claims a second job)",
        )
        gate.event.set()
        eventually(lambda: pool.statistics().succeeded == 2, "both jobs succeeded")


@marks.rule("pool-statistics", "handler-acked", "handler-error-nacked")
@core
@pytest.mark.parametrize("outcome", ["succeeded", "failed"])
def test_stage2_two_workers_finishing_at_once_are_both_counted(outcome: str) -> None:
    """Two workers, two jobs, both handlers return (or raise) together. Once its handler
    is done, the first worker stops between reading any count and writing it back,
    while the second finishes and goes back to sleep: both are counted (a count updated
    outside the lock would write the second's over with the first's)."""
    paused, asleep = threading.Event(), threading.Event()
    module = stage(2).ThreadWorkerPool.__module__

    def woken() -> bool:  # asked by the first worker before each write-back
        paused.set()
        return asleep.is_set()

    def handler(lease: Lease, payload: object) -> object:
        if payload == "first":
            pause_in_updates(module, woken, asleep.is_set, 0.2)
        else:
            paused.wait(DEADLINE_S)  # the first worker stands in its first write-back
            announce_waits(asleep)  # from here: this worker's next sleep is its idle wait
        if outcome == "failed":
            raise RuntimeError(f"{payload} failed")
        return payload

    _, queue, pool = new_pool(handler, workers=2)
    queue.enqueue("first")
    queue.enqueue("second")
    with running(pool):
        eventually(lambda: pool.statistics().idle == 2, "both workers idle again")
        stats = pool.statistics()
    check(
        (stats.claimed, getattr(stats, outcome)) == (2, 2),
        f"two workers finish their jobs at once, the first stopped between reading each "
        f"count and writing it back while the second finishes: pool-statistics counts "
        f"exactly, 2 claimed and 2 {outcome}; got {stats}",
    )


@marks.rule("no-busy-waiting")
@core
@pytest.mark.parametrize("arrival", ["enqueued", "submitted"])
def test_stage2_idle_workers_wake_when_a_scheduled_job_falls_due(arrival: str) -> None:
    """A job due at START + 1 000: enqueued before the pool starts, so that nothing but
    the clock can wake a worker; or submitted to a pool whose workers all wait with no
    deadline (an empty queue), so that only submit tells them of it. Once every thread
    sleeps on the clock, nothing happens until it moves."""
    clock = WatchedClock(START)
    _, queue, pool = new_pool(lambda lease, payload: payload, workers=2, clock=clock)
    if arrival == "enqueued":
        queue.enqueue("later", run_at_ns=START + 1_000)
    others = set(threading.enumerate())
    with running(pool):
        if arrival == "submitted":
            clock.settle(others, set())  # the queue is empty: every worker waits, no deadline
            waits = clock.deadlines()
            check(
                all(deadline is None for deadline in waits.values()),
                "no-busy-waiting: with the queue empty there is nothing to wait for but a "
                "submit, so every thread sleeps with no deadline (a timer of its own is "
                f"polling); the deadlines they sleep until: {waits}",
            )
            pool.submit("later", run_at_ns=START + 1_000)
        clock.advance(999)
        clock.settle(others, set())
        check(pool.statistics().claimed == 0, "a job was claimed 1 ns before its run_at_ns")
        clock.advance(1)
        clock.settle(others, set())  # every thread asleep on the clock again: judge now
        check(
            pool.statistics().succeeded == 1,
            f"a job {arrival} with run_at_ns: at that instant every worker went back to "
            f"sleep without running it. Idle workers wait until the queue's next_due_ns "
            f"(through the clock), and submit wakes them whenever it enqueues, so that they "
            f"wait again until the new one; {pool.statistics()}",
        )


@marks.rule("shutdown-grace", "async-pool")
@extended
@anyio_test
async def test_stage2_async_shutdown_returns_when_the_last_handler_finishes() -> None:
    gate = AsyncGate()
    clock, _, pool = new_async_pool(gate.handler, workers=1)
    t0, stopped = clock.now_ns(), []

    async def stop() -> None:
        await pool.shutdown(1_000)
        stopped.append(clock.now_ns() - t0)

    async with running_async(pool, grace_ns=None), anyio.create_task_group() as tg:
        pool.submit("job")
        await eventually_async(lambda: pool.statistics().in_flight == 1, "the job running")
        tg.start_soon(stop)
        await eventually_async(lambda: pool.statistics().stopping, "shutdown begun")
        clock.advance(10)
        gate.event.set()  # the only handler returns at +10, well within the grace
        await settle()
        done_at = list(stopped)
        clock.advance(990)  # whatever happens, the grace ends
    check(
        done_at == [10],
        "shutdown-grace: shutdown(grace_ns=1000) with one job running; its handler returns "
        "at +10. Shutdown waits until the running handlers have finished or the grace "
        f"deadline has come, whichever first: expected it to return at +10; it had "
        f"returned at {done_at or 'no time yet (still waiting)'}",
    )


@marks.rule("no-busy-waiting", "shutdown-grace")
@core
def test_stage2_a_job_due_in_the_far_future_leaves_the_workers_alive() -> None:
    """On the real clock, a job due at now + 2**200 ns: idle workers wait for it without
    an OverflowError (the platform's longest wait is ~292 years), a due job still runs,
    and shutdown(grace_ns=2**200) returns at once with nothing running."""
    clock = MonotonicClock()
    queue: JobQueue = stage(1).JobQueue(
        clock=clock, lease_ns=60 * 10**9, retry=RetryPolicy(0, 0, "none"), max_attempts=1
    )
    queue.enqueue("far", run_at_ns=clock.now_ns() + 2**200)
    pool: WorkerPool = stage(2).ThreadWorkerPool(
        queue, lambda lease, payload: payload, workers=2, clock=clock
    )
    with running(pool):
        pool.submit("now")
        eventually(lambda: pool.statistics().succeeded == 1, "the due job to run")
        pool.submit("and another")
        eventually(
            lambda: pool.statistics().succeeded == 2,
            "the workers to be alive after waiting for a job 2**200 ns away",
        )
        done = spawn(lambda: pool.shutdown(2**200), "shutdown")
        done.outcome("shutdown(grace_ns=2**200) with nothing running returns at once")


@marks.rule("heartbeats")
@core
def test_stage2_heartbeats_keep_a_long_job_leased() -> None:
    gate = Gate()
    clock, _queue, pool = new_pool(gate.handler, workers=2, heartbeat_every_ns=300)
    with running(pool):
        pool.submit("long")
        eventually(lambda: pool.statistics().in_flight == 1, "the job in flight")
        for beat in range(1, 11):  # 3000 ns: three times the lease
            clock.advance(300)
            eventually(
                partial(lambda n: pool.statistics().heartbeats == n, beat),
                f"{beat} heartbeat(s) after {300 * beat} ns (heartbeat_every_ns=300)",
            )
        gate.event.set()
        eventually(lambda: pool.statistics().in_flight == 0, "the long job's handler to return")
    stats = pool.statistics()
    assert (stats.claimed, stats.lost, stats.succeeded) == (1, 0, 1), (
        f"a job running 3x its lease (heartbeat_every_ns=300, lease {LEASE}) must "
        f"keep its one lease and be acked; got claimed={stats.claimed}, lost={stats.lost}, "
        f"succeeded={stats.succeeded} (were its leases really extended?)"
    )


@marks.rule("heartbeats", "no-busy-waiting", "late-result-dropped")
@core
def test_stage2_without_timely_heartbeats_the_lease_expires_and_the_job_is_retried() -> None:
    first = threading.Event()
    runs: list[int] = []

    def handler(lease: Lease, payload: Any) -> int:
        runs.append(lease.attempt)
        if lease.attempt == 1:
            wait_at(first, "attempt 1's handler")
        return lease.attempt

    clock, queue, pool = new_pool(handler, workers=2, max_attempts=3, heartbeat_every_ns=5_000)
    with running(pool):
        job_id = pool.submit("slow")
        eventually(lambda: pool.statistics().in_flight == 1, "the job in flight")
        clock.advance(LEASE)
        eventually(
            lambda: pool.statistics().succeeded == 1,
            "the retry (attempt 2) acked: an idle worker wakes when the expired lease's "
            "job falls due again",
        )
        first.set()
        eventually(lambda: pool.statistics().lost == 1, "the first run's ack refused")
        pool.shutdown(0)
    job = queue.get(job_id)
    assert (job.state, job.result, runs) == (JobState.SUCCEEDED, 2, [1, 2]), (
        f"a lease that expired must be retried and the stale ack refused; "
        f"got {job.state}, result {job.result}, runs {runs}"
    )


@marks.rule("shutdown-stops-claiming", "shutdown-grace")
@core
def test_stage2_shutdown_lets_running_jobs_finish_within_the_grace_period() -> None:
    gate = Gate()
    clock, queue, pool = new_pool(gate.handler, workers=2)
    with running(pool):
        ids = [pool.submit(i) for i in range(3)]
        eventually(lambda: len(gate.entered) == 2, "2 handlers running")
        stopper = spawn(lambda: pool.shutdown(500), "shutdown")
        eventually(lambda: pool.statistics().stopping, "shutdown begun")
        clock.advance(499)
        stays(lambda: stopper.is_alive(), "shutdown waiting within its grace period")
        gate.event.set()
        stopper.outcome("shutdown with both running jobs finished")
    states = [queue.get(i).state for i in ids]
    assert states == [JobState.SUCCEEDED, JobState.SUCCEEDED, JobState.READY], (
        f"shutdown must let the 2 running jobs finish within the grace period and "
        f"claim nothing more; states {states}"
    )
    assert queue.statistics().leased == 0 and pool.statistics().released == 0


@marks.rule("shutdown-grace", "late-result-dropped")
@core
def test_stage2_shutdown_releases_jobs_still_running_at_the_deadline() -> None:
    gate = Gate()
    clock, queue, pool = new_pool(gate.handler, workers=1, max_attempts=2)
    with running(pool):
        job_id = pool.submit("stuck")
        eventually(lambda: pool.statistics().in_flight == 1, "the job in flight")
        stopper = spawn(lambda: pool.shutdown(500), "shutdown")
        eventually(lambda: pool.statistics().stopping, "shutdown begun")
        clock.advance(499)
        stays(lambda: stopper.is_alive(), "shutdown waiting within its grace period")
        clock.advance(1)
        stopper.outcome("shutdown at its grace deadline")
        job = queue.get(job_id)
        assert (job.state, job.attempts, queue.statistics().leased) == (JobState.READY, 0, 0), (
            f"a job still running at the grace deadline must be released (READY, "
            f"attempt refunded, no lease left); got {job.state}, attempts {job.attempts}, "
            f"leased {queue.statistics().leased}"
        )
        gate.event.set()
        eventually(lambda: pool.statistics().in_flight == 0, "nothing in flight")
        stays(lambda: queue.get(job_id).state is JobState.READY, "the released job READY")
    assert pool.statistics().released == 1


@marks.rule("pool-bad-input")
@core
@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"workers": 0}, "workers"),
        ({"workers": -2}, "workers"),
        ({"workers": 2, "max_in_flight": 0}, "max_in_flight"),
        ({"workers": 2, "heartbeat_every_ns": 0}, "heartbeat_every_ns"),
    ],
)
def test_stage2_bad_arguments_name_the_parameter(kwargs: dict[str, Any], param: str) -> None:
    _, queue = pool_queue()
    with pytest.raises(ValueError, match=param):
        stage(2).ThreadWorkerPool(queue, lambda lease, payload: None, **kwargs)


@marks.rule("pool-bad-input")
@core
def test_stage2_negative_grace_is_rejected_and_changes_nothing() -> None:
    _clock, _queue, pool = new_pool(lambda lease, payload: None, workers=1)
    with running(pool):
        with pytest.raises(ValueError, match="grace_ns"):
            pool.shutdown(-1)
        assert not pool.statistics().stopping, "a rejected shutdown must stop nothing"
        pool.submit(1)
        eventually(lambda: pool.statistics().succeeded == 1, "the pool still working")


#: Values of each int parameter that are no int (a bool is none either): TypeError.
NOT_INTS = [True, 2.0, "2"]


@marks.rule("pool-bad-input")
@core
@pytest.mark.parametrize("value", NOT_INTS, ids=repr)
@pytest.mark.parametrize("param", ["workers", "max_in_flight", "heartbeat_every_ns", "grace_ns"])
def test_stage2_a_parameter_that_is_not_an_int_is_a_type_error(param: str, value: Any) -> None:
    _clock, queue, pool = new_pool(lambda lease, payload: payload, workers=1)
    with pytest.raises(TypeError, match=param):
        if param == "grace_ns":
            pool.shutdown(value)
        else:
            stage(2).ThreadWorkerPool(
                queue, lambda lease, payload: None, **{"workers": 1, param: value}
            )
    assert not pool.statistics().stopping, f"shutdown({value!r}) refused must stop nothing"


@marks.rule("pool-bad-input", "async-pool")
@extended
@pytest.mark.parametrize("value", NOT_INTS, ids=repr)
@pytest.mark.parametrize(
    "param", ["workers", "max_in_flight", "heartbeat_every_ns", "timeout_ns", "grace_ns"]
)
@anyio_test
async def test_stage2_async_a_parameter_that_is_not_an_int_is_a_type_error(
    param: str, value: Any
) -> None:
    _, queue, pool = new_async_pool(idle_handler, workers=1)
    with pytest.raises(TypeError, match=param):
        if param == "grace_ns":
            await pool.shutdown(value)
        else:
            stage(2).AsyncWorkerPool(queue, idle_handler, **{"workers": 1, param: value})
    assert not pool.statistics().stopping, f"shutdown({value!r}) refused must stop nothing"


#: A lease a third of which is whole, and one a third of which is not (lease_ns // 3).
LEASES = [pytest.param(LONG_LEASE, id="thirds"), pytest.param(LONG_LEASE + 1, id="no-thirds")]


@marks.rule("heartbeat-default", "heartbeats")
@core
@pytest.mark.parametrize("lease", LEASES)
def test_stage2_default_heartbeat_is_every_third_of_the_lease(lease: int) -> None:
    gate = Gate()
    clock = WatchedClock(START)
    _, queue, pool = new_pool(gate.handler, workers=1, clock=clock, lease_ns=lease)
    others = set(threading.enumerate())
    with running(pool):
        job_id = pool.submit("long")
        eventually(lambda: len(gate.busy) == 1, "the job's handler running")
        beats_at_a_third(
            stat(pool, "heartbeats"),
            lambda: queue.get(job_id).lease_expires_at_ns,
            clock,
            lambda: clock.settle(others, gate.busy),
            lease=lease,
        )
        gate.event.set()
        eventually(lambda: pool.statistics().succeeded == 1, "the job acked")


@marks.rule("start-once")
@core
def test_stage2_starting_a_pool_twice_raises() -> None:
    _clock, _queue, pool = new_pool(lambda lease, payload: payload, workers=1)
    with running(pool):
        with pytest.raises(RuntimeError):
            pool.start()
            raise AssertionError("a second start() must raise RuntimeError")
        pool.submit(1)
        eventually(lambda: pool.statistics().succeeded == 1, "the pool still working")


@marks.rule("start-once")
@core
def test_stage2_starting_a_pool_again_after_its_shutdown_raises() -> None:
    _clock, _queue, pool = new_pool(lambda lease, payload: payload, workers=1)
    with running(pool):
        pass
    with pytest.raises(RuntimeError):
        pool.start()
        raise AssertionError("start() after shutdown must raise RuntimeError: once only")


@marks.rule("start-once")
@core
def test_stage2_two_threads_starting_the_pool_at_once_start_it_once() -> None:
    """Two threads call ``start()`` at once; the first is held as it launches its first
    thread, until the second call has returned. One of the two raises RuntimeError, and
    the pool has one set of threads."""
    _clock, _queue, pool = new_pool(lambda lease, payload: payload, workers=2)
    before = set(threading.enumerate())
    launching, go = threading.Event(), threading.Event()
    launch = threading.Thread.start
    held: list[threading.Thread] = []

    def held_start(thread: threading.Thread) -> None:
        if not held and threading.current_thread() is first:
            held.append(thread)
            launching.set()
            go.wait(DEADLINE_S)
        launch(thread)

    outcomes: dict[str, str] = {}

    def start(who: str) -> None:
        try:
            pool.start()
            outcomes[who] = "started"
        except RuntimeError:
            outcomes[who] = "RuntimeError"

    first = threading.Thread(target=start, args=("first",), daemon=True)
    threading.Thread.start = held_start  # type: ignore[method-assign, assignment]
    try:
        launch(first)
        check(launching.wait(DEADLINE_S), "start() must launch threads")
        start("second")
    finally:
        go.set()
        threading.Thread.start = launch  # type: ignore[method-assign]
    first.join(DEADLINE_S)
    try:
        started = [t for t in threading.enumerate() if t not in before and t is not first]
        one_start = len(_threads_of_one_start(workers=2))
        check(
            sorted(outcomes.values()) == ["RuntimeError", "started"] and len(started) == one_start,
            f"two threads called start() at once (the first held while it launched its first "
            f"thread): one must start the pool and the other raise RuntimeError, and the "
            f"pool run the {one_start} threads one start() makes; got {outcomes}, and "
            f"{len(started)} pool threads running",
        )
    finally:
        pool.shutdown(0)


def _threads_of_one_start(workers: int) -> list[threading.Thread]:
    """The threads one ``start()`` of a new pool of ``workers`` runs (shut down since)."""
    _clock, _queue, pool = new_pool(lambda lease, payload: payload, workers=workers)
    before = set(threading.enumerate())
    with running(pool):
        return [t for t in threading.enumerate() if t not in before]


@marks.rule("start-once")
@core
def test_stage2_every_thread_of_the_pool_is_a_daemon() -> None:
    """A pool nobody shut down must not keep the process from exiting."""
    started = _threads_of_one_start(workers=3)
    check(
        len(started) >= 3 and all(t.daemon for t in started),
        f"start() starts the pool's threads as daemons (workers=3); got "
        f"{[(t.name, 'daemon' if t.daemon else 'NOT a daemon') for t in started]}",
    )


@marks.rule("heartbeat-lost", "pool-statistics")
@core
def test_stage2_a_refused_heartbeat_stops_the_beats_and_the_job_is_lost() -> None:
    gate = Gate()
    clock, queue, pool = new_pool(gate.handler, workers=1, heartbeat_every_ns=300)
    with running(pool):
        job_id = pool.submit("cancelled while it runs")
        eventually(lambda: len(gate.entered) == 1, "the job's handler running")
        clock.advance(300)
        eventually(lambda: pool.statistics().heartbeats == 1, "the first heartbeat at 300 ns")
        # Every pool thread is parked (the handler at its gate, the rest on the clock):
        # nobody else is calling the queue now.
        assert queue.cancel(job_id) is True
        clock.advance(300)  # the next heartbeat is refused: StaleLease
        clock.advance(300)
        stays(
            lambda: pool.statistics().heartbeats == 1,
            "no heartbeat counted after the job was cancelled (a refused heartbeat is not one)",
        )
        gate.event.set()
        eventually(lambda: pool.statistics().in_flight == 0, "the handler to return")
        eventually(lambda: pool.statistics().lost == 1, "the job counted as lost")
    stats = pool.statistics()
    job = queue.get(job_id)
    assert (job.state, stats.succeeded, stats.failed, stats.lost) == (
        JobState.CANCELLED,
        0,
        0,
        1,
    ), (
        f"a job whose heartbeat was refused (cancelled while running) is lost: its "
        f"ack refused, counted in lost; got {job.state}, {stats}"
    )


# --- properties ------------------------------------------------------------------------


@marks.rule("one-worker-per-job", "handler-acked", "handler-error-nacked")
@core
@settings(max_examples=heavy_examples())
@given(
    workers=st.integers(1, 6),
    jobs=st.integers(1, 25),
    max_attempts=st.integers(1, 3),
    failures=st.sets(st.tuples(st.integers(0, 24), st.integers(1, 3))),
)
def test_stage2_no_job_is_run_twice_at_once_and_every_job_finishes(
    workers: int, jobs: int, max_attempts: int, failures: set[tuple[int, int]]
) -> None:
    active: set[int] = set()
    doubles: list[int] = []
    lock = threading.Lock()

    def handler(lease: Lease, payload: int) -> int:
        with lock:
            if payload in active:
                doubles.append(payload)
            active.add(payload)
        for _ in range(3):
            time.sleep(0)  # let the others run while this job is "active"
        with lock:
            active.discard(payload)
        if (payload, lease.attempt) in failures:
            raise RuntimeError(f"fail {payload}/{lease.attempt}")
        return payload

    # The model: a job succeeds at its first attempt not in ``failures``, else dies.
    expected: dict[int, tuple[JobState, int]] = {}
    for p in range(jobs):
        ok = [a for a in range(1, max_attempts + 1) if (p, a) not in failures]
        expected[p] = (JobState.SUCCEEDED, ok[0]) if ok else (JobState.DEAD, max_attempts)
    _clock, queue, pool = new_pool(handler, workers=workers, max_attempts=max_attempts)
    with tiny_switch_interval(), running(pool):
        ids = [pool.submit(p) for p in range(jobs)]
        attempts = sum(n for _, n in expected.values())
        wins = sum(state is JobState.SUCCEEDED for state, _ in expected.values())

        def finished_or_off_course() -> bool:
            s = pool.statistics()  # more acks or nacks than the model allows: judge at once
            done = (s.claimed, s.in_flight) == (attempts, 0)
            # Every job claimed, nothing running, every worker waiting: with retries due at
            # once (frozen clock, no backoff) nothing more will happen — judge now. (A
            # worker that nacks claims the retry before it can be idle.)
            quiet = s.claimed >= jobs and s.in_flight == 0 and s.idle == s.workers
            return done or quiet or s.succeeded > wins or s.failed > attempts - wins

        eventually(finished_or_off_course, f"every job finished after {attempts} attempts in all")
        stats = pool.statistics()
        check(
            (stats.succeeded, stats.failed) == (wins, attempts - wins),
            f"{jobs} jobs, failing (payload, attempt) {sorted(failures)}, "
            f"max_attempts {max_attempts}: expected {wins} acks and {attempts - wins} nacks "
            f"(a handler that raises is nacked), got {stats.succeeded} and {stats.failed}",
        )
        pool.shutdown(0)
    assert not doubles, (
        f"jobs {doubles} were in two handlers at once with {workers} workers: "
        "a job must be leased to one worker at a time"
    )
    got = {p: (queue.get(i).state, queue.get(i).attempts) for p, i in enumerate(ids)}
    assert got == expected, (
        f"{jobs} jobs, {workers} workers, max_attempts {max_attempts}, failing "
        f"(payload, attempt) {sorted(failures)}: ended (state, attempts) {got}, expected {expected}"
    )
    assert queue.statistics().leased == 0


# --- AsyncWorkerPool (extended) --------------------------------------------------------


@marks.rule("async-pool", "handler-acked", "handler-error-nacked")
@extended
@anyio_test
async def test_stage2_async_pool_acks_results_and_nacks_errors() -> None:
    async def handler(lease: Lease, payload: int) -> int:
        await anyio.lowlevel.checkpoint()
        if payload % 3 == 0:
            raise ValueError(f"bad {payload}")
        return payload * 10

    _, queue, pool = new_async_pool(handler, workers=3)
    async with running_async(pool):
        ids = [pool.submit(i) for i in range(9)]
        await eventually_async(
            lambda: (pool.statistics().claimed, pool.statistics().in_flight) == (9, 0),
            "9 jobs handled",
        )
    for i, job_id in enumerate(ids):
        job = queue.get(job_id)
        want = (JobState.DEAD, None) if i % 3 == 0 else (JobState.SUCCEEDED, i * 10)
        assert (job.state, job.result) == want, (
            f"async job {i} ended ({job.state}, {job.result!r}); expected {want}"
        )
        if i % 3 == 0:
            assert job.last_error == f"ValueError: bad {i}", (
                f"the nack carries the handler's error as '<ExceptionType>: <message>' — "
                f"ValueError('bad {i}') gives 'ValueError: bad {i}'; got {job.last_error!r}"
            )
    stats = pool.statistics()
    assert (stats.succeeded, stats.failed) == (6, 3), f"{stats}"


@marks.rule("async-pool", "one-worker-per-job")
@extended
@anyio_test
async def test_stage2_async_no_job_is_run_twice_at_once() -> None:
    active: set[int] = set()
    doubles: list[int] = []

    async def handler(lease: Lease, payload: int) -> None:
        if payload in active:
            doubles.append(payload)
        active.add(payload)
        for _ in range(3):
            await anyio.lowlevel.checkpoint()
        active.discard(payload)
        if lease.attempt == 1 and payload % 2:
            raise RuntimeError("first attempt fails")

    _, queue, pool = new_async_pool(handler, workers=6, max_attempts=2)
    async with running_async(pool):
        ids = [pool.submit(i) for i in range(30)]
        await eventually_async(
            lambda: (pool.statistics().claimed, pool.statistics().in_flight) == (45, 0),
            "45 attempts (30 jobs, 15 of them retried once)",
        )
    assert not doubles, f"jobs {doubles} were in two handlers at once"
    states = {queue.get(i).state for i in ids}
    assert states == {JobState.SUCCEEDED}, f"every job must succeed; got {states}"


@marks.rule("async-timeout")
@extended
@anyio_test
async def test_stage2_async_timeout_cancels_the_handler_and_nacks_the_job() -> None:
    seen: list[str] = []

    async def handler(lease: Lease, payload: Any) -> None:
        try:
            await anyio.sleep_forever()
        finally:
            seen.append("cancelled")

    clock, queue, pool = new_async_pool(handler, workers=1, timeout_ns=500)
    async with running_async(pool):
        job_id = pool.submit("hangs")
        await eventually_async(lambda: pool.statistics().in_flight == 1, "the job in flight")
        clock.advance(499)
        await stays_async(lambda: pool.statistics().in_flight == 1, "the job running at 499 ns")
        clock.advance(1)
        await settle()  # nothing more happens until the clock moves
        check(
            pool.statistics().timed_out == 1,
            f"at timeout_ns=500 after its claim the handler must be cancelled "
            f"and its job nacked with {TIMED_OUT!r}; {pool.statistics()}",
        )
    job = queue.get(job_id)
    assert (job.state, job.last_error, seen) == (JobState.DEAD, TIMED_OUT, ["cancelled"]), (
        f"a handler past timeout_ns=500 must be cancelled and its job nacked with "
        f"{TIMED_OUT!r}; got {job.state}, last_error {job.last_error!r}, handler saw {seen}"
    )
    assert pool.statistics().failed == 1


@marks.rule("async-pool", "heartbeats")
@extended
@anyio_test
async def test_stage2_async_heartbeats_keep_a_long_job_leased() -> None:
    gate = AsyncGate()
    clock, _, pool = new_async_pool(gate.handler, workers=2, heartbeat_every_ns=300)
    async with running_async(pool):
        pool.submit("long")
        await eventually_async(lambda: pool.statistics().in_flight == 1, "the job in flight")
        for beat in range(1, 11):
            clock.advance(300)
            await eventually_async(
                partial(lambda n: pool.statistics().heartbeats == n, beat),
                f"{beat} heartbeat(s) after {300 * beat} ns",
            )
        gate.event.set()
        await eventually_async(
            lambda: pool.statistics().in_flight == 0, "the long job's handler to return"
        )
    stats = pool.statistics()
    assert (stats.claimed, stats.lost, stats.succeeded) == (1, 0, 1), (
        f"a job running 3x its lease with heartbeats must keep its lease; {stats}"
    )


@marks.rule("async-shutdown-cancels", "shutdown-grace", "pool-statistics")
@extended
@anyio_test
async def test_stage2_async_shutdown_cancels_and_releases_jobs_past_the_grace_period() -> None:
    quick = anyio.Event()
    seen: list[str] = []

    async def handler(lease: Lease, payload: str) -> str:
        if payload == "quick":
            await quick.wait()
            return payload
        try:
            await anyio.sleep_forever()
        finally:
            seen.append(payload)
        return payload

    # A timeout far past the grace deadline: what ends the stuck handler is the shutdown.
    clock, queue, pool = new_async_pool(handler, workers=2, timeout_ns=10_000)
    stopped: list[bool] = []
    returned: list[bool] = []

    async def stop() -> None:
        await pool.shutdown(500)
        stopped.append(True)

    async def run() -> None:
        await pool.run()
        returned.append(True)

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        quick_id, stuck_id, waiting_id = (pool.submit(p) for p in ("quick", "stuck", "later"))
        await eventually_async(lambda: pool.statistics().in_flight == 2, "2 jobs in flight")
        tg.start_soon(stop)
        await eventually_async(lambda: pool.statistics().stopping, "shutdown begun")
        quick.set()
        clock.advance(499)
        await settle()  # every task waits again: judged now, not after a deadline
        check(
            pool.statistics().succeeded == 1,
            "a handler that returned before the grace deadline is acked at once, during "
            f"shutdown too; {pool.statistics()}",
        )
        await stays_async(lambda: not stopped, "shutdown waiting for the stuck job")
        clock.advance(1)
        await eventually_async(lambda: bool(stopped), "shutdown done at its grace deadline")
        await settle()  # whatever was cancelled has ended by now
        # Judged here, inside the task group: a handler left running would keep run()
        # (and this test) waiting forever; failing here cancels it.
        check(
            seen == ["stuck"] and bool(returned),
            "at the grace deadline the async shutdown cancels the handlers still running "
            "and releases their jobs; shutdown(500) returned, but the stuck handler "
            + ("was cancelled" if seen else "is still running (never cancelled)")
            + " and run() "
            + ("returned" if returned else "has not returned (it waits for that handler)"),
        )
    got = [queue.get(i).state for i in (quick_id, stuck_id, waiting_id)]
    stuck = queue.get(stuck_id)
    assert got == [JobState.SUCCEEDED, JobState.READY, JobState.READY] and stuck.attempts == 0, (
        f"shutdown(500) must let the quick job finish, cancel and release the stuck "
        f"one (attempt refunded) and claim nothing more; states {got}, "
        f"stuck attempts {stuck.attempts}"
    )
    stats = pool.statistics()
    counts = (stats.claimed, stats.succeeded, stats.failed, stats.released, stats.lost)
    check(
        queue.statistics().leased == 0 and counts == (2, 1, 0, 1, 0) and stats.timed_out == 0,
        "after shutdown(500): 2 claimed, 1 succeeded, 1 released (cancelled by the shutdown, "
        "not failed, not timed out: its timeout_ns was 10 000 ns away), 0 lost; got "
        f"(claimed, succeeded, failed, released, lost) = {counts}, timed_out "
        f"{stats.timed_out}, {queue.statistics().leased} lease(s) left",
    )


@marks.rule("pool-bad-input")
@extended
@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"workers": 0}, "workers"),
        ({"workers": 1, "timeout_ns": 0}, "timeout_ns"),
        ({"workers": 1, "max_in_flight": -1}, "max_in_flight"),
    ],
)
def test_stage2_async_bad_arguments_name_the_parameter(kwargs: dict[str, Any], param: str) -> None:
    _, queue = pool_queue()

    with pytest.raises(ValueError, match=param):
        stage(2).AsyncWorkerPool(queue, idle_handler, **kwargs)


@marks.rule("no-busy-waiting", "async-pool")
@extended
@anyio_test
async def test_stage2_async_shutdown_with_a_huge_grace_and_nothing_running_returns() -> None:
    _, _, pool = new_async_pool(idle_handler, workers=1)
    async with running_async(pool, grace_ns=None):
        with not_refused(
            "shutdown(grace_ns=2**200) with nothing running returns at once (a grace is any "
            "int >= 0)",
            ValueError,
        ):
            with anyio.fail_after(DEADLINE_S):
                await pool.shutdown(2**200)


@marks.rule("pool-bad-input")
@extended
@anyio_test
async def test_stage2_async_negative_grace_is_rejected() -> None:
    _, _, pool = new_async_pool(idle_handler, workers=1)
    with pytest.raises(ValueError, match="grace_ns"):
        await pool.shutdown(-1)
    assert not pool.statistics().stopping, "a rejected shutdown must stop nothing"


@marks.rule("heartbeat-default", "async-pool")
@extended
@anyio_test
@pytest.mark.parametrize("lease", LEASES)
async def test_stage2_async_default_heartbeat_is_every_third_of_the_lease(lease: int) -> None:
    gate = AsyncGate()
    clock = WatchedClock(START)
    third = lease // 3
    _, queue, pool = new_async_pool(gate.handler, workers=1, clock=clock, lease_ns=lease)
    async with running_async(pool):
        job_id = pool.submit("long")
        await eventually_async(lambda: pool.statistics().in_flight == 1, "the job in flight")
        beats: list[int] = []
        for beat in (1, 2):  # beats_at_a_third, with the event loop settling in between
            due = START + beat * third
            for at, want in ((due - 1, beat - 1), (due, beat)):
                clock.set(at)
                await settle()
                beats.append(pool.statistics().heartbeats)
                check(
                    beats[-1] == want,
                    f"async pool, {beats[-1]} heartbeat(s) by {at - START} ns "
                    f"after the claim, expected {want}: with heartbeat_every_ns=None the "
                    f"interval is a third of the lease ({lease} // 3 = {third} ns), "
                    f"so heartbeat {beat} comes at {due - START} ns exactly",
                )
            expires = queue.get(job_id).lease_expires_at_ns
            check(
                expires == due + lease,
                f"async heartbeat {beat} must extend the lease to "
                f"{due + lease - START}; it expires at {rel(expires)}",
            )
        gate.event.set()
        await eventually_async(lambda: pool.statistics().succeeded == 1, "the job acked")


@marks.rule("start-once", "async-pool")
@extended
@anyio_test
async def test_stage2_async_running_a_pool_twice_raises() -> None:
    _, _, pool = new_async_pool(idle_handler, workers=1)
    async with running_async(pool):
        await eventually_async(lambda: pool.statistics().idle == 1, "the worker idle")
        with pytest.raises(RuntimeError):
            await pool.run()
            raise AssertionError("a second run() must raise RuntimeError")


@marks.rule("start-once", "async-pool")
@extended
@anyio_test
async def test_stage2_async_running_a_pool_again_after_its_shutdown_raises() -> None:
    _, _, pool = new_async_pool(idle_handler, workers=1)
    async with running_async(pool):
        await eventually_async(lambda: pool.statistics().idle == 1, "the worker idle")
    with pytest.raises(RuntimeError):
        with anyio.fail_after(DEADLINE_S):
            await pool.run()
        raise AssertionError("run() after shutdown must raise RuntimeError: once only")


# --- a model of the pool's bookkeeping, step by step ----------------------------------


class PoolMachine(RuleBasedStateMachine):
    """Jobs submitted and finished one by one against a model: FIFO claims into at most
    ``workers`` slots; each handler waits for the test to say how it ends.

    After each step the check waits until the pool has caught up with the model, or until
    it has come to rest short of it: every thread asleep on the (frozen) clock but those
    inside a handler. At rest nothing more can happen, so it judges then, not after a
    deadline: a wake-up that went to the wrong thread fails in milliseconds."""

    @initialize(workers=st.integers(1, 3))
    def build(self, workers: int) -> None:
        self.workers = workers
        self.gates: dict[int, tuple[threading.Event, list[bool]]] = {}
        self.started: list[int] = []
        self.in_handler: dict[int, int] = {}  # thread ident -> the payload it handles
        self.lock = threading.Lock()
        self.clock = WatchedClock(START)
        self.others = set(threading.enumerate())
        _, self.queue, self.pool = new_pool(self.handler, workers=workers, clock=self.clock)
        self.pool.start()
        self.pending: list[int] = []  # the model: submitted, not claimed, in order
        self.running: list[int] = []
        self.succeeded = self.failed = 0
        self.next_payload = 0

    def handler(self, lease: Lease, payload: int) -> int:
        event, outcome = self.gates[payload]
        with self.lock:
            self.started.append(payload)
            self.in_handler[threading.get_ident()] = payload
        try:
            assert event.wait(DEADLINE_S), f"job {payload} waited for the test too long"
        finally:
            with self.lock:
                del self.in_handler[threading.get_ident()]
        if not outcome[0]:
            raise RuntimeError(f"job {payload} failed")
        return payload

    def refill(self) -> None:
        while self.pending and len(self.running) < self.workers:
            self.running.append(self.pending.pop(0))

    @rule()
    def submit(self) -> None:
        payload = self.next_payload
        self.next_payload += 1
        self.gates[payload] = (threading.Event(), [])
        self.pool.submit(payload)
        self.pending.append(payload)
        self.refill()

    @precondition(lambda self: bool(getattr(self, "running", None)))
    @rule(data=st.data(), ok=st.booleans())
    def finish(self, data: st.DataObject, ok: bool) -> None:
        payload = data.draw(st.sampled_from(self.running))
        event, outcome = self.gates[payload]
        outcome.append(ok)
        self.running.remove(payload)
        if ok:
            self.succeeded += 1
        else:
            self.failed += 1
        event.set()
        self.refill()

    @invariant()
    def bookkeeping_matches(self) -> None:
        if not hasattr(self, "pool"):
            return
        expected = (len(self.running), self.succeeded, self.failed)

        def now() -> tuple[int, int, int]:
            s = self.pool.statistics()
            return (s.in_flight, s.succeeded, s.failed)

        # Wait for the progress (every finished handler counted one way or the other) or
        # for the pool to come to rest short of it, then judge at once: a wrong split, or
        # a job no worker was woken for, fails now, not after a deadline.
        done = self.succeeded + self.failed

        def caught_up() -> bool:
            got = now()
            return (got[0], got[1] + got[2]) == (expected[0], done) and len(self.started) == len(
                self.running
            ) + done

        def at_rest() -> bool:
            with self.lock:  # held by the test: in a handler the test has not yet ended
                busy = {t for t, p in self.in_handler.items() if not self.gates[p][0].is_set()}
            return self.clock.parked(self.others, busy)

        eventually(
            lambda: caught_up() or at_rest(),
            f"(in_flight, succeeded + failed) == {(expected[0], done)}, or every thread "
            "asleep on the clock but those in a handler",
        )
        check(
            caught_up(),
            f"the pool came to rest (every worker asleep on the clock, none due) with "
            f"(in_flight, succeeded + failed) {(now()[0], now()[1] + now()[2])} and "
            f"{len(self.started)} handler(s) started, where the model has "
            f"{(expected[0], done)} and {len(self.running) + done}: a job submitted while a "
            "worker is idle must wake one that can claim it",
        )
        got = now()
        check(
            got == expected,
            f"(in_flight, succeeded, failed) expected {expected}, got {got}: a "
            f"handler that returns is acked (succeeded), one that raises is nacked (failed)",
        )
        with self.lock:
            started = sorted(self.started)
        assert started == sorted(self.running + [p for p in self.gates if self.gates[p][1]]), (
            f"handlers started for {started}; the model runs {self.running} "
            "(FIFO into the free slots) besides those finished"
        )

    def teardown(self) -> None:
        if hasattr(self, "pool"):
            in_flight = len(self.running)
            self.pool.shutdown(0)
            for event, _ in self.gates.values():
                event.set()
            if sys.exc_info()[0] is not None:
                return  # a step failed already: its explanation stands alone
            stats = self.pool.statistics()
            assert stats.released == in_flight and self.queue.statistics().leased == 0, (
                f"shutdown(0) with {in_flight} running must release them all and "
                f"leave no lease; released {stats.released}, "
                f"leased {self.queue.statistics().leased}"
            )


PoolMachine.TestCase.settings = settings(max_examples=heavy_examples(), stateful_step_count=15)
TestStage2ThreadWorkerPoolModel = marks.rule(
    "bounded-in-flight", "pool-statistics", "shutdown-grace", "handler-acked"
)(core(PoolMachine.TestCase))
