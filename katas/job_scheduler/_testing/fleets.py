"""Stage-3 workers under test: one ``RedisWorker`` in this process, on a test clock that
paces its heartbeats and polls; or a fleet of worker processes
(:mod:`katas.job_scheduler._testing.worker`) that the tests SIGKILL, SIGSTOP and
SIGTERM, and whose printed events tell what each one did."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis

from katas._harness.child import ChildProcess
from katas._harness.interleave import Gate
from katas._harness.redis import RedisEnv, RedisNode
from katas._harness.under_test import stage
from katas._harness.waiting import Thread, spawn
from katas._registry import impl
from katas.job_scheduler._testing.redis_queues import MS, effect_store, new_queue
from katas.job_scheduler._testing.states import SUCCEEDED
from katas.job_scheduler._testing.worker import DUE_IDLE_POLLS, IDLE, TARGET
from katas.job_scheduler.api import Lease, ManualClock, MonotonicClock, SharedJobQueue, Worker

#: Empty claims in a row after which a worker that should have found a due job failed.
DUE = DUE_IDLE_POLLS
WORKER_LEASE = 3_000 * MS  # long enough never to run out for real on a real server


def in_process_worker(
    redis_env: RedisEnv,
    handler: Callable[[Lease, Any], Any],
    clock: ManualClock | None = None,
    client: redis.Redis | None = None,
    *,
    lease_ns: int = WORKER_LEASE,
    max_attempts: int = 1,
    hold: tuple[str, Gate] | None = None,
    **options: Any,
) -> tuple[SharedJobQueue, Worker, ManualClock, list[tuple[str, str | None]]]:
    """(queue, worker, its clock, the events it reported) on a queue of this test; the
    worker reaches Redis through ``client`` if given (a proxied one). ``hold``: (event,
    gate) parks the worker's thread in its ``on_event`` call for the first such event,
    until the test opens the gate (a worker frozen at an exact point of its loop)."""
    queue = new_queue(redis_env, lease_ns=lease_ns, max_attempts=max_attempts)
    clock = ManualClock(10**12) if clock is None else clock
    events: list[tuple[str, str | None]] = []

    def on_event(event: str, lease: Lease | None) -> None:
        events.append((event, None if lease is None else lease.job_id))
        if hold is not None and event == hold[0]:
            hold[1].pass_through()

    worker: Worker = stage().RedisWorker(
        new_queue(redis_env, client, lease_ns=lease_ns, max_attempts=max_attempts), handler,
        worker_id="w1", clock=clock, on_event=on_event, **options,
    )  # fmt: skip
    return queue, worker, clock, events


def run_in_thread(worker: Worker, max_jobs: int) -> Thread:
    """``worker.run(max_jobs=max_jobs)`` on a daemon thread."""
    return spawn(lambda: worker.run(max_jobs=max_jobs), "redis-worker")


class Skewed(MonotonicClock):
    """A monotonic clock ``offset_ns`` off: a worker's clock that disagrees with every
    other machine's (its waits still last what they should)."""

    def __init__(self, offset_ns: int) -> None:
        self.offset = offset_ns

    def now_ns(self) -> int:
        return super().now_ns() + self.offset

    def wait_until_ns(self, cond: threading.Condition, deadline_ns: int | None) -> None:
        deadline = None if deadline_ns is None else deadline_ns - self.offset
        super().wait_until_ns(cond, deadline)


@dataclass
class Workers:
    """Worker processes of one test: started with the implementation under test."""

    env: RedisEnv
    selection: impl.Selection
    node: RedisNode
    url: str
    lease_ns: int
    max_attempts: int = 3
    started: list[ChildProcess] = field(default_factory=list)

    @classmethod
    def on(cls, env: RedisEnv, selection: impl.Selection) -> Workers:
        """The workers of one test: on a server of its own that the test may break, unless
        the suite runs on an external server (then that one), leases of 150 ms."""
        node = env.fault_server() if env.mode != "url" else env.server()
        return cls(env, selection, node, node.url, lease_ns=150 * MS)

    def start(self, *extra: str, name: str | None = None) -> ChildProcess:
        name = name or f"worker-{len(self.started) + 1}"
        argv = [
            "--url", self.url,
            "--key-prefix", self.env.prefix,
            "--worker-id", name,
            "--lease-ns", str(self.lease_ns),
            "--max-attempts", str(self.max_attempts),
            *extra,
        ]  # fmt: skip
        process = ChildProcess(TARGET, self.selection, argv, name=name, idle=IDLE)
        self.started.append(process)
        process.wait_for("READY")
        return process

    def queue(self, **options: Any) -> SharedJobQueue:
        """A queue of this test on the workers' server (its options as theirs)."""
        options = {"lease_ns": self.lease_ns, "max_attempts": self.max_attempts, **options}
        return new_queue(self.env, self.node.client(), **options)

    def frozen_queue(self) -> SharedJobQueue:
        """A queue of this test with the server clock stopped first: on fakeredis leases
        then run out only when the test passes time."""
        self.env.freeze_time()
        return self.queue()

    def events(self, event: str) -> list[str]:
        """``<job> <token>`` of every ``event`` any worker printed."""
        return [line.split(" ", 2)[2] for p in self.started for line in p.lines(f"EVENT {event} ")]

    def transcripts(self) -> str:
        """What every worker printed, for a failure's message."""
        return "\n".join(p.transcript() for p in self.started)

    def close(self) -> None:
        """Stop every worker still running (SIGKILL at worst)."""
        for p in self.started:
            p.close()


def wait_until(
    pred: Callable[[], bool],
    what: str,
    workers: Workers,
    deadline_s: float = 15.0,
    *,
    busy: ChildProcess | None = None,
) -> None:
    """Wait (hard deadline) until ``pred()``. ``busy``: a worker that has a due job until
    then, so a run of empty claims fails the wait at once (a lost job)."""
    deadline = time.monotonic() + deadline_s
    while not pred():
        why = f"{deadline_s:.0f} real seconds passed" if time.monotonic() >= deadline else ""
        if busy is not None and busy.idle_run() >= DUE:
            if pred():  # its empty claims came after everything it finished
                return
            why = f"{busy.name} found nothing to claim {DUE} times in a row"
        assert not why, (
            f"expected {what}, but {why}.\n  the workers' output:\n{workers.transcripts()}"
        )
        time.sleep(0.01)


def applied_once(
    workers: Workers, queue: SharedJobQueue, ids: list[str], *, lost_replies: bool = False
) -> None:
    """Every job SUCCEEDED, its effect committed by exactly one worker, and stored once.

    ``lost_replies``: the network dropped replies, so a worker whose commit was applied
    but unanswered retries it and is told "duplicate": then at most one worker saw
    "committed" — the store's one effect per job is what proves "once".
    """

    # A worker prints its commit before it acks, but this process reads the workers'
    # output on threads of its own: let the transcripts catch up with what Redis shows.
    def reported() -> set[str]:
        return {e.split()[0] for e in workers.events("committed") + workers.events("duplicate")}

    deadline = time.monotonic() + 5.0
    while not reported() >= set(ids) and time.monotonic() < deadline:
        time.sleep(0.01)
    committed = [e.split()[0] for e in workers.events("committed")]
    duplicate = [e.split()[0] for e in workers.events("duplicate")]
    effects = effect_store(queue).effects()
    for job_id in ids:
        job = queue.get(job_id)
        assert job.state is SUCCEEDED, (
            f"{job_id} ended {job.state.value}, expected succeeded: {job}\n{workers.transcripts()}"
        )
        seen = committed.count(job_id)
        assert seen == 1 or (lost_replies and seen == 0 and job_id in duplicate), (
            f"{job_id}'s effect was committed {committed.count(job_id)} times; "
            f"each job's effect must be applied exactly once.\n{workers.transcripts()}"
        )
        assert effects.get(job_id) == job.payload["effect"], (
            f"the effect store holds {effects.get(job_id)!r} for {job_id}, "
            f"expected {job.payload['effect']!r}"
        )


def pass_lease(workers: Workers) -> None:
    """Let the lease of a killed worker run out (real time on a real server)."""
    workers.env.pass_time(workers.lease_ns + 10 * MS)


def sigkill_mid_job(workers: Workers, point: str) -> None:
    """SIGKILL a worker held at ``point``; a second worker must finish the job once."""
    queue = workers.frozen_queue()
    job_id = queue.enqueue({"effect": "charged $5"})
    victim = workers.start("--hold-at", point)
    victim.wait_for(f"HOLD {point} {job_id}", idle_polls=DUE)
    victim.send(signal.SIGKILL)
    assert victim.wait() == -signal.SIGKILL
    pass_lease(workers)
    rescuer = workers.start("--max-jobs", "1")
    rescuer.wait_for("EXIT", idle_polls=DUE)  # the job is due again: it must take it
    applied_once(workers, queue, [job_id])
    job = queue.get(job_id)
    assert (job.attempts, job.token) == (2, 2), (
        f"the SIGKILLed attempt counts: expected attempts 2, token 2; got {job}"
    )
    if point == "after_effect":
        assert workers.events("duplicate") == [f"{job_id} 2"], (
            "the re-run must find the killed worker's effect committed "
            f"(commit returns False) and just ack.\n{workers.transcripts()}"
        )


#: The lease of a fleet running a job three leases long: heartbeats every lease/3 keep
#: it only if none comes more than 2/3 of a lease late, and on a busy machine a thread
#: (and the server) can wait 100 ms for a core.
LONG_JOB_LEASE = 500 * MS


def long_job(workers: Workers) -> tuple[SharedJobQueue, str]:
    """A queue (2 attempts) holding one job that runs three leases long, for real; the
    fleet's lease (for the workers it starts next) is :data:`LONG_JOB_LEASE`."""
    workers.lease_ns = LONG_JOB_LEASE
    queue = workers.queue(max_attempts=2)
    return queue, queue.enqueue({"effect": "slow", "work_ms": 3 * workers.lease_ns // MS})
