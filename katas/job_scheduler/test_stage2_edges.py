"""Stage 2 suite, the edges of its rules (see katas/job_scheduler/README.md, "Stage 2"): a
job lost while its async handler runs, a handler's own exception types and the text each
pool nacks them with, the default heartbeat interval's rounding, a submit of a job due
sooner than the async workers' next deadline, ``in_flight`` once an async shutdown has
released its jobs, and a timeout that comes after the job was lost.

Deterministic as the stage's other files are: a ``WatchedClock`` moved by the test, the
harness's ``settle()`` for the async pool, handlers that wait for the test.

Map: a job lost mid-run, async (heartbeat-lost, pool-statistics, async-pool) · any
exception a handler raises (handler-error-nacked) · the nack's text in the async pool, an
empty message included (handler-error-nacked, async-pool) · the default interval
(heartbeat-default) · a sooner job submitted (no-busy-waiting, async-pool) · in flight
after shutdown (pool-statistics, async-shutdown-cancels) · a lost job's timeout
(async-timeout, heartbeat-lost, pool-statistics).
"""

from __future__ import annotations

from typing import Any

import anyio
import anyio.lowlevel
import pytest

from katas._harness import marks
from katas._harness.marks import anyio_test, core, extended
from katas._harness.resting import WatchedClock
from katas._harness.story import check, expect
from katas._harness.virtual_time import settle
from katas._harness.waiting import eventually
from katas._runtime.todo import Todo
from katas.job_scheduler._testing.pools import (
    AsyncGate,
    CountedBeats,
    Gate,
    fail_fast_on_pool_stubs,  # noqa: F401 (autouse)
    new_async_pool,
    new_pool,
    running,
    running_async,
)
from katas.job_scheduler._testing.queues import START
from katas.job_scheduler.api import JobState, Lease

pytestmark = [pytest.mark.stage(2)]

EVERY = 300


@marks.rule("heartbeat-lost", "pool-statistics", "async-pool")
@extended
@anyio_test
@pytest.mark.parametrize("ending", ["returns", "raises"])
async def test_stage2_async_a_job_lost_while_it_runs_is_given_up_and_counted_lost(
    ending: str,
) -> None:
    """The job is cancelled while its async handler runs. Its next heartbeat is refused:
    not counted, and the last one tried. The handler runs on (a refused heartbeat is not
    a timeout); when it returns or raises, the ack or nack is refused, so the job is
    lost — neither succeeded nor failed — and run() goes on."""
    release = anyio.Event()

    async def handler(lease: Lease, payload: Any) -> Any:
        await release.wait()
        if ending == "raises":
            raise ValueError("too late")
        return "too late"

    clock = WatchedClock(START)
    _, queue, pool = new_async_pool(handler, workers=1, clock=clock, heartbeat_every_ns=EVERY)
    beats = CountedBeats(queue)
    try:
        async with running_async(pool):
            job_id = pool.submit("cancelled while it runs")
            await settle()
            clock.advance(EVERY)
            await settle()
            check(pool.statistics().heartbeats == 1, "async pool: a heartbeat at 300 ns")
            assert queue.cancel(job_id) is True
            for _ in range(4):
                clock.advance(EVERY)
                await settle()
            stats = pool.statistics()
            check(
                (beats.calls, stats.heartbeats, stats.timed_out, stats.in_flight) == (2, 1, 0, 1),
                "async pool, heartbeat_every_ns=300: a heartbeat at 300 ns; the job cancelled; "
                "the one at 600 ns refused (StaleLease), so not counted and the last tried, and "
                "the handler still running (a refused heartbeat is no timeout): expected 2 "
                f"heartbeat calls, 1 counted, 0 timed out, 1 in flight; got {beats.calls} "
                f"calls, {stats}",
            )
            release.set()
            await settle()
    except Todo:
        raise
    except Exception as exc:
        raise AssertionError(
            f"async pool: a job lost while its handler ran; the handler {ending}, and its "
            f"{'ack' if ending == 'returns' else 'nack'} is refused (StaleLease): the pool "
            f"counts it lost and runs on, yet leaving it raised {exc!r}"
        ) from exc
    stats = pool.statistics()
    check(
        (stats.lost, stats.succeeded, stats.failed, stats.in_flight) == (1, 0, 0, 0),
        f"async pool: the lost job's handler {ending}: lost 1, neither succeeded nor failed, "
        f"nothing in flight; got {stats}",
    )


class _NotABuiltin(Exception):
    """An application's own error type."""


@marks.rule("handler-error-nacked")
@core
@pytest.mark.parametrize("error", [_NotABuiltin, KeyError, OSError, ArithmeticError])
def test_stage2_any_exception_a_handler_raises_is_its_jobs_failure(error: type[Exception]) -> None:
    def handler(lease: Lease, payload: Any) -> Any:
        if payload == "fails":
            raise error("no")
        return payload

    _, queue, pool = new_pool(handler, workers=1)
    with running(pool):
        failing = pool.submit("fails")
        pool.submit("after it")
        eventually(
            lambda: pool.statistics().failed + pool.statistics().succeeded == 2,
            f"the job whose handler raises {error.__name__}, then the next one",
        )
    check(
        (pool.statistics().failed, queue.get(failing).last_error is not None) == (1, True),
        f"handler-error-nacked: a handler raising {error.__name__} (any Exception) fails its "
        f"job — nacked, the error recorded — and the worker goes on to the next; got "
        f"{pool.statistics()}, the job: {queue.get(failing)}",
    )
    expect(
        queue.get(failing).last_error,
        f"{error.__name__}: {error('no')}",
        f"handler-error-nacked: the nack of a handler raising {error.__name__}('no') is "
        "'<ExceptionType>: <message>' (the type's own name, the exception's str)",
    )


#: What a handler raises, and the error its job is nacked with: "<ExceptionType>: <message>",
#: the message being the exception's str — empty too, the ": " kept.
NACKED = [
    pytest.param(RuntimeError, (), "RuntimeError: ", id="no-message"),
    pytest.param(ValueError, ("",), "ValueError: ", id="empty-message"),
    pytest.param(ValueError, ("boom",), "ValueError: boom", id="message"),
    pytest.param(_NotABuiltin, ("no",), "_NotABuiltin: no", id="own-type"),
    pytest.param(KeyError, ("no",), "KeyError: 'no'", id="key-error"),
    pytest.param(ValueError, ("a", 1), "ValueError: ('a', 1)", id="two-args"),
]


@marks.rule("handler-error-nacked", "async-pool")
@extended
@anyio_test
@pytest.mark.parametrize(("error", "args", "want"), NACKED)
async def test_stage2_async_a_handlers_exception_is_nacked_as_its_type_and_message(
    error: type[Exception], args: tuple[Any, ...], want: str
) -> None:
    """The async pool nacks as the thread pool does: ``f"{type}: {message}"`` whatever the
    message — none, empty, the repr-like str of a KeyError, several arguments."""

    async def handler(lease: Lease, payload: Any) -> Any:
        await anyio.lowlevel.checkpoint()
        if payload == "fails":
            raise error(*args)
        return payload

    _, queue, pool = new_async_pool(handler, workers=1)
    async with running_async(pool):
        failing = pool.submit("fails")
        pool.submit("after it")
        await settle()  # both jobs handled: nothing more happens until the test acts
    shown = ", ".join(map(repr, args))
    job, stats = queue.get(failing), pool.statistics()
    check(
        (job.state, stats.failed, stats.succeeded) == (JobState.DEAD, 1, 1),
        f"async pool, max_attempts 1: a handler raising {error.__name__}({shown}) fails its "
        f"job (nacked: DEAD) and the worker goes on to the next; got {job.state}, {stats}",
    )
    expect(
        job.last_error,
        want,
        f"handler-error-nacked, async pool: a handler raising {error.__name__}({shown}) "
        "nacks its job with '<ExceptionType>: <message>' — the ': ' kept when the "
        "message is empty",
    )


@marks.rule("heartbeat-default")
@core
def test_stage2_the_default_interval_is_a_third_of_the_lease_rounded_down() -> None:
    """``lease_ns`` 1 001: the default interval is 1 001 // 3 = 333 ns, the first beat at
    333 ns after the claim — not 334 (a third of the lease rounded up)."""
    gate = Gate()
    clock = WatchedClock(START)
    _, _, pool = new_pool(gate.handler, workers=1, clock=clock, lease_ns=1_001)
    with running(pool):
        pool.submit("job")
        eventually(lambda: len(gate.entered) == 1, "the job's handler running")
        clock.advance(333)
        eventually(
            lambda: pool.statistics().heartbeats == 1,
            "lease_ns=1001, no heartbeat_every_ns: a heartbeat 333 ns (1001 // 3) after the claim",
        )
        gate.event.set()


@marks.rule("no-busy-waiting", "async-pool")
@extended
@anyio_test
async def test_stage2_async_a_job_submitted_due_sooner_wakes_the_idle_workers() -> None:
    """The async workers sleep until a job due at 1 000 ns; a job submitted due at 500 ns
    must be claimed at 500 ns, not when the sleepers' old deadline comes."""
    gate = AsyncGate()
    clock = WatchedClock(START)
    _, queue, pool = new_async_pool(gate.handler, workers=2, clock=clock)
    queue.enqueue("later", run_at_ns=START + 1_000)
    async with running_async(pool):
        await settle()
        sooner = pool.submit("sooner", run_at_ns=START + 500)
        await settle()
        clock.set(START + 500)
        await settle()
        check(
            pool.statistics().claimed == 1 and queue.get(sooner).worker_id is not None,
            "async pool: workers asleep until 1000 ns; a job submitted due at 500 ns is "
            f"claimed at 500 ns (submit wakes them to wait for it); got {pool.statistics()}",
        )
        gate.event.set()
        clock.set(START + 1_000)
        await settle()


@marks.rule("pool-statistics", "async-shutdown-cancels")
@extended
@anyio_test
async def test_stage2_async_nothing_is_in_flight_once_shutdown_released_its_jobs() -> None:
    gate = AsyncGate()
    _, _, pool = new_async_pool(gate.handler, workers=2)
    async with running_async(pool, grace_ns=None):
        pool.submit("a")
        pool.submit("b")
        await settle()
        await pool.shutdown(0)
    stats = pool.statistics()
    check(
        (stats.in_flight, stats.released) == (0, 2),
        "async pool: two handlers running at shutdown(0) are cancelled and their jobs "
        f"released: nothing is in flight after it; got {stats}",
    )


@marks.rule("async-timeout", "heartbeat-lost", "pool-statistics")
@extended
@anyio_test
async def test_stage2_async_a_lost_job_that_times_out_counts_lost_not_timed_out() -> None:
    """The job is cancelled while its async handler runs; then its timeout comes. The
    handler is cancelled, but the nack with TIMED_OUT is refused: the job is lost, and a
    refused nack counts neither in timed_out nor in failed."""

    async def handler(lease: Lease, payload: Any) -> Any:
        await anyio.sleep_forever()

    timeout = EVERY  # sooner than the first default heartbeat (lease // 3)
    clock = WatchedClock(START)
    _, queue, pool = new_async_pool(handler, workers=1, clock=clock, timeout_ns=timeout)
    async with running_async(pool):
        job_id = pool.submit("cancelled, then timed out")
        await settle()
        assert queue.cancel(job_id) is True
        clock.advance(timeout)
        await settle()
        stats = pool.statistics()
    check(
        (stats.timed_out, stats.failed, stats.lost, stats.in_flight) == (0, 0, 1, 0),
        f"async pool, timeout_ns={timeout}: the job cancelled while its handler ran; at "
        f"{timeout} ns the handler is cancelled and its nack with TIMED_OUT refused "
        "(StaleLease): the job counts as lost only — timed_out, like failed, counts a "
        f"nack made; expected timed_out 0, failed 0, lost 1, nothing in flight; got {stats}",
    )
