"""Stage 3 suite: the queue on Redis, with real crashes (see katas/job_scheduler/README.md).

Runs on fakeredis by default; ``KATA_REDIS_SERVER=redis-server`` runs it on private real
servers, ``KATA_REDIS_URL=redis://…`` on an external one (see katas/_harness/redis.py).

Core: ``RedisJobQueue`` (enqueue, claim, ack, nack, get, next_due_ns, last_op) and
``RedisEffectStore``. Extended: heartbeats, release, cancel, dead letters, redrive,
idempotency keys, retention by TTL, the reaper, and ``RedisWorker`` run as separate OS
processes (``python -m katas._harness.worker``) that the tests SIGKILL, SIGSTOP and SIGTERM.

How exactness is checked: every call returns an ``OpStamp`` (``queue.last_op()``): the
queue's operation counter and the server time its script ran at. Sorting any run's
calls by ``op`` — one thread's or many threads' — recovers the order Redis ran them in,
and the stage-1 suite's exact ``Model`` (written from the rules, never reading an
implementation) replayed in that order at those server times must give every result the
queue gave. On fakeredis the server clock is frozen and moved by the test; on a real
server it moves by itself, tests that need time to pass are marked ``realtime``, and the
replay still holds.
"""

from __future__ import annotations

import random
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from types import ModuleType
from typing import Any

import fakeredis
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from katas._harness.child import ChildProcess
from katas._harness.profiles import heavy_examples
from katas._harness.redis import RedisEnv, RedisNode
from katas._harness.under_test import stage
from katas._harness.waiting import DEADLINE_S, eventually, spawn, stays
from katas._registry import impl
from katas.job_scheduler._testing.clocks import WatchedClock, beats_at_a_third
from katas.job_scheduler._testing.model import Model
from katas.job_scheduler._testing.worker import DUE_IDLE_POLLS as DUE
from katas.job_scheduler._testing.worker import IDLE, TARGET
from katas.job_scheduler.api import (
    LEASE_EXPIRED,
    JobNotFound,
    JobState,
    Lease,
    ManualClock,
    MonotonicClock,
    OpStamp,
    QueueFull,
    QueueStatistics,
    RetryPolicy,
    StaleLease,
)

pytestmark = [pytest.mark.stage(3)]

core = pytest.mark.core
extended = pytest.mark.extended

SCHEDULED, READY, LEASED = JobState.SCHEDULED, JobState.READY, JobState.LEASED
SUCCEEDED, DEAD, CANCELLED = JobState.SUCCEEDED, JobState.DEAD, JobState.CANCELLED

MS = 1_000_000  # ns
#: A lease long enough never to expire by accident on a loaded machine, yet short
#: enough to wait out for real (≤ 500 ms) on a real server.
LEASE = 300 * MS
NO_RETRY_DELAY = RetryPolicy(0, 0, "none")

# Tests that start servers or processes run few examples; they take function fixtures.
heavy = settings(
    max_examples=heavy_examples(),
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    deadline=None,
)


@pytest.fixture(autouse=True)
def _fail_fast_on_stubs(stage_module: ModuleType) -> None:
    """Build one queue before anything else: on a stub this fails at once with "not
    implemented yet: ..." (state machines also find the stage module here)."""
    stage_module.RedisJobQueue(
        fakeredis.FakeRedis(), lease_ns=LEASE, retry=NO_RETRY_DELAY, max_attempts=1
    )


def new_queue(
    env: RedisEnv,
    client: redis.Redis | None = None,
    *,
    prefix: str | None = None,
    lease_ns: int = LEASE,
    retry: RetryPolicy = NO_RETRY_DELAY,
    max_attempts: int = 3,
    **options: Any,
) -> Any:
    """A queue under the test's key prefix (every key it writes must start with it)."""
    return stage().RedisJobQueue(
        env.client() if client is None else client,
        lease_ns=lease_ns,
        retry=retry,
        max_attempts=max_attempts,
        key_prefix=env.prefix if prefix is None else prefix,
        **options,
    )


def stamp(queue: Any, what: str) -> OpStamp:
    got = queue.last_op()
    assert isinstance(got, OpStamp), (
        f"after {what}, last_op() returned {got!r}; expected the OpStamp of that call"
    )
    return got


def claim(queue: Any, worker: str = "w") -> Lease:
    lease = queue.claim(worker)
    assert isinstance(lease, Lease), f"claim() returned {lease!r}, but a job was due"
    return lease


def key_contents(env: RedisEnv, node: RedisNode | None = None) -> dict[str, Any]:
    """Every key under the test's prefix and what it holds (to prove nothing changed)."""
    admin = (node or env.server()).client()
    out: dict[str, Any] = {}
    for key in env.keys(node=node):
        kind = _text(admin.type(key))
        read: dict[str, Callable[[str], Any]] = {
            "string": lambda k: admin.get(k),
            "hash": lambda k: admin.hgetall(k),
            "set": lambda k: sorted(admin.smembers(k)),
            "zset": lambda k: admin.zrange(k, 0, -1, withscores=True),
            "list": lambda k: admin.lrange(k, 0, -1),
        }
        out[key] = (kind, read[kind](key) if kind in read else None)
    return out


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


# --------------------------------------------------------------------------- replay


@dataclass
class Call:
    """One call on a queue as a client saw it, stamped by the script that ran it."""

    what: str  # "enqueue", "claim", "ack", …
    args: tuple[Any, ...]
    outcome: tuple[Any, ...]  # ("ok", value) or (exception name,)
    stamp: OpStamp
    who: str = "client"
    invoked_s: float = 0.0  # real monotonic time: for the real-time order check
    returned_s: float = 0.0

    def __str__(self) -> str:
        args = ", ".join(_show(a) for a in self.args)
        return f"op {self.stamp.op}: {self.who}.{self.what}({args}) -> {_show(self.outcome)}"


def _show(value: Any) -> str:
    if isinstance(value, Lease):
        return f"Lease({value.job_id}, token={value.token})"
    return repr(value)


def perform(queue: Any, what: str, *args: Any, who: str = "client") -> Call:
    """Make one call on the real queue and record what it returned or raised."""
    invoked = time.monotonic()
    try:
        if what == "commit":
            value = stage().RedisEffectStore(queue).commit(*args)
        elif what == "enqueue":
            payload, priority, run_at, key = args
            value = queue.enqueue(payload, priority=priority, run_at_ns=run_at, idempotency_key=key)
        else:
            value = getattr(queue, what)(*args)
        outcome: tuple[Any, ...] = ("ok", value)
    except (StaleLease, JobNotFound, QueueFull) as e:
        outcome = (type(e).__name__,)
    returned = time.monotonic()
    return Call(what, args, outcome, stamp(queue, what), who, invoked, returned)


class Replay:
    """The stage-1 model, fed calls in op order at their server times; judges each."""

    def __init__(self, model: Model, header: str) -> None:
        self.model = model
        self.header = header
        self.ids: dict[int, str] = {}  # model seq -> the queue's job id
        self.seqs: dict[str, int] = {}
        self.effects: dict[int, Any] = {}
        self.history: list[Call] = []

    def fail(self, invariant: str, detail: str) -> str:
        lines = "\n".join(f"    {c}" for c in self.history[-14:])
        return (
            f"{invariant}.\n  {self.header}\n  calls in the order Redis ran them "
            f"(last {min(14, len(self.history))}):\n{lines}\n  {detail}"
        )

    def check(self, call: Call) -> None:
        self.history.append(call)
        expected = self.expect(call)
        if not (call.outcome == expected):
            raise AssertionError(
                self.fail(
                    "the queue and the exact stage-1 model disagree",
                    f"at op {call.stamp.op}, server time {call.stamp.server_now_ns} ns: expected "
                    f"{_show(expected)}, got {_show(call.outcome)}",
                )
            )

    def expect(self, call: Call) -> tuple[Any, ...]:
        m, now = self.model, call.stamp.server_now_ns
        if call.what == "enqueue":
            payload, priority, run_at, key = call.args
            seq = m.enqueue(payload, priority, run_at, key, now)
            if seq is None:
                return ("QueueFull",)
            if seq not in self.ids and call.outcome[0] == "ok":
                got = call.outcome[1]
                if not (got not in self.seqs):
                    raise AssertionError(self.fail("job ids are unique", f"{got!r} reused"))
                self.ids[seq], self.seqs[got] = got, seq
            return ("ok", self.ids.get(seq))
        if call.what == "claim":
            job = m.claim(call.args[0], now)
            if job is None:
                return ("ok", None)
            assert job.expires is not None
            lease = Lease(self.ids[job.seq], job.token, job.attempts, job.expires, call.args[0])
            return ("ok", lease)
        if call.what in ("ack", "nack", "heartbeat", "release", "commit", "is_current"):
            lease = call.args[0]
            seq = self.seqs[lease.job_id]
            verdict = m.live(seq, lease.token, now)
            if call.what == "is_current":
                return ("ok", verdict == "ok")
            if verdict != "ok":
                # A forgotten job's lease: JobNotFound, except from commit (a zombie's
                # effect is refused as stale either way).
                gone = verdict != "stale" and call.what != "commit"
                return ("JobNotFound",) if gone else ("StaleLease",)
            if call.what == "ack":
                m.ack(seq, call.args[1], now)
            elif call.what == "nack":
                m.nack(seq, call.args[1], now)
            elif call.what == "release":
                m.release(seq, now)
            elif call.what == "heartbeat":
                expires = m.heartbeat(seq, now)
                return ("ok", replace(lease, attempt=m.jobs[seq].attempts, expires_at_ns=expires))
            else:
                fresh = seq not in self.effects
                self.effects.setdefault(seq, call.args[1])
                return ("ok", fresh)
            return ("ok", None)
        if call.what in ("cancel", "redrive", "get"):
            seq = self.seqs[call.args[0]]
            if call.what == "get":
                m.settle(now)
                job = m.jobs.get(seq)
                return ("JobNotFound",) if job is None else ("ok", m.snapshot(job, self.ids[seq]))
            answer = m.cancel(seq, now) if call.what == "cancel" else m.redrive(seq, now)
            if answer is None:
                return ("JobNotFound",)
            return ("QueueFull",) if answer == "full" else ("ok", answer)
        if call.what == "next_due_ns":
            return ("ok", m.next_due(now))
        if call.what == "statistics":
            return ("ok", m.statistics(now))
        if call.what == "reap":
            before = sum(j.state is LEASED for j in m.jobs.values())
            m.settle(now)
            after = sum(j.state is LEASED for j in m.jobs.values())
            return ("ok", before - after)
        raise AssertionError(f"unknown call {call.what}")

    def check_real_time_order(self, calls: list[Call]) -> None:
        """Every call that returned before another was invoked must come first in op order."""
        ops = [c.stamp.op for c in calls]
        if not (len(set(ops)) == len(ops)):
            raise AssertionError(self.fail("op numbers are unique", f"ops {sorted(ops)}"))
        returned = sorted(calls, key=lambda c: c.returned_s)
        done = 0
        latest: Call | None = None  # the highest-op call among those returned so far
        for c in sorted(calls, key=lambda c: c.invoked_s):
            while done < len(returned) and returned[done].returned_s < c.invoked_s:
                if latest is None or returned[done].stamp.op > latest.stamp.op:
                    latest = returned[done]
                done += 1
            if latest is not None and latest.stamp.op >= c.stamp.op:
                raise AssertionError(
                    self.fail(
                        "op order contradicts real time",
                        f"{latest} returned before {c} was invoked",
                    )
                )


def model_for(queue_options: dict[str, Any], **kw: Any) -> Model:
    return Model(seed=0, **queue_options, **kw)


# --------------------------------------------------------------------------- core


@pytest.mark.rule("redis-attempts", "server-time", "redis-stale")
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
    assert before <= lease.expires_at_ns - LEASE <= after, (
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


@pytest.mark.rule("server-time")
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


@pytest.mark.rule("redis-order")
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


@pytest.mark.rule("redis-order")
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


@pytest.mark.rule("redis-never-early", "redis-next-due", "run-at-server")
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


@pytest.mark.rule("redis-attempts", "redis-stale")
@core
@pytest.mark.realtime
def test_stage3_expired_lease_costs_an_attempt_and_fences_the_zombie(
    redis_env: RedisEnv,
) -> None:
    redis_env.freeze_time()
    queue = new_queue(redis_env, lease_ns=100 * MS)
    job_id = queue.enqueue({"n": 1})
    zombie = claim(queue, "w1")
    redis_env.pass_time(100 * MS)  # the lease's expiry: no longer live
    second = claim(queue, "w2")
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


@pytest.mark.rule("redis-backoff")
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


@pytest.mark.rule("redis-fenced", "redis-effect-by-job")
@core
@pytest.mark.realtime
def test_stage3_effect_store_commits_once_per_job_and_refuses_stale_leases(
    redis_env: RedisEnv,
) -> None:
    redis_env.freeze_time()
    queue = new_queue(redis_env, lease_ns=100 * MS)
    store = stage().RedisEffectStore(queue)
    job_id = queue.enqueue("charge $5")
    first = claim(queue, "w1")
    assert store.commit(first, "charged") is True, "the first commit must commit"
    redis_env.pass_time(100 * MS)  # w1 dies between effect and ack: its lease expires
    with pytest.raises(StaleLease):
        store.commit(first, "charged again")
        raise AssertionError("the expired lease's commit was accepted")
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


@pytest.mark.rule("restart-fence", "redis-fenced")
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
    store = stage().RedisEffectStore(queue)
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


@pytest.mark.rule("client-contract")
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


@pytest.mark.rule("redis-unknown-id")
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
        try:
            call()
        except JobNotFound:
            continue
        except StaleLease as e:
            raise AssertionError(
                f"{name} on an unknown job id must raise JobNotFound, got StaleLease: {e}"
            ) from None
        raise AssertionError(f"{name} on an unknown job id did not raise JobNotFound")
    try:
        stage().RedisEffectStore(queue).commit(ghost, "effect")
    except StaleLease:
        return
    except JobNotFound as e:
        raise AssertionError(
            f"commit with a lease of a job the queue does not hold must raise "
            f"StaleLease (a zombie must stop, as in stage 1), got JobNotFound: {e}"
        ) from None
    raise AssertionError("commit with a lease of an unknown job was accepted")


@pytest.mark.rule("run-at-server", "redis-never-early")
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
    if not redis_env.time_is_controlled:  # a real server's clock has moved on meanwhile
        return
    assert queue.claim("w") is None, "a job due 1 ns from now was claimed now"
    redis_env.pass_time(1000)
    assert claim(queue).job_id == job_id, "at its rounded run time the job is READY"


@pytest.mark.rule("op-counter")
@core
def test_stage3_last_op_is_the_calling_threads_own(redis_env: RedisEnv) -> None:
    queue = new_queue(redis_env)
    assert queue.last_op() is None, "last_op() before any call must be None"
    queue.enqueue("a")
    mine = stamp(queue, "enqueue")
    seen: list[Any] = []

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


@pytest.mark.rule("json", "key-prefix")
@core
def test_stage3_values_travel_as_json_under_the_key_prefix(redis_env: RedisEnv) -> None:
    redis_env.freeze_time()
    queue = new_queue(redis_env)
    store = stage().RedisEffectStore(queue)
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
        outside = [_text(k) for k in admin.keys("*") if not _text(k).startswith(redis_env.prefix)]
        assert not outside, (
            f"every key of the queue must start with key_prefix "
            f"{redis_env.prefix!r}; these do not: {outside}"
        )


def _nested(levels: int) -> Any:
    value: Any = "leaf"
    for _ in range(levels):
        value = [value]
    return value


def _bad_calls() -> list[Any]:
    def ctor(**kw: Any) -> Callable[[RedisEnv, Any, Lease], Any]:
        options = {"lease_ns": LEASE, "retry": NO_RETRY_DELAY, "max_attempts": 3, **kw}
        return lambda env, q, lease: stage().RedisJobQueue(
            env.client(), key_prefix=env.prefix, **options
        )

    cases: list[tuple[str, Callable[[RedisEnv, Any, Lease], Any], str]] = [
        ("lease_ns not whole µs", ctor(lease_ns=1_500), "lease_ns"),
        ("lease_ns zero", ctor(lease_ns=0), "lease_ns"),
        ("max_attempts zero", ctor(max_attempts=0), "max_attempts"),
        ("backoff not whole µs", ctor(retry=RetryPolicy(1_500, 3_000, "none")), "base_ns"),
        ("negative retention", ctor(retention_ns=-1000), "retention_ns"),
        ("negative dedup TTL", ctor(dedup_ttl_ns=-1000), "dedup_ttl_ns"),
        # Beyond what a Lua double holds exactly once added to the server's time (2^52 µs):
        ("max_attempts 2^63 - 1", ctor(max_attempts=2**63 - 1), "max_attempts"),
        ("max_pending 2^63", ctor(max_pending=2**63), "max_pending"),
        ("lease_ns 10^22", ctor(lease_ns=10**22), "lease_ns"),
        ("retention_ns 10^25", ctor(retention_ns=10**25), "retention_ns"),
        ("dedup_ttl_ns 10^22", ctor(dedup_ttl_ns=10**22), "dedup_ttl_ns"),
        ("backoff cap 10^22", ctor(retry=RetryPolicy(1000, 10**22, "none")), "cap_ns"),
        ("delay_ns 10^22", lambda env, q, le: q.enqueue(1, delay_ns=10**22), "delay_ns"),
        ("run_at_ns 10^22", lambda env, q, le: q.enqueue(1, run_at_ns=10**22), "run_at_ns"),
        ("a set as payload", lambda env, q, le: q.enqueue({1, 2}), "payload"),
        ("NaN as payload", lambda env, q, le: q.enqueue(float("nan")), "payload"),
        ("an object as payload", lambda env, q, le: q.enqueue(object()), "payload"),
        ("int and str keys", lambda env, q, le: q.enqueue({1: "a", "1": "b"}), "payload"),
        ("5 000 levels deep", lambda env, q, le: q.enqueue(_nested(5000)), "payload"),
        ("negative delay", lambda env, q, le: q.enqueue(1, delay_ns=-MS), "delay_ns"),
        (
            "run_at and delay",
            lambda env, q, le: q.enqueue(1, run_at_ns=10**15, delay_ns=MS),
            "delay_ns",
        ),
        ("negative run_at", lambda env, q, le: q.enqueue(1, run_at_ns=-5), "run_at_ns"),
        ("float priority", lambda env, q, le: q.enqueue(1, priority=1.5), "priority"),
        ("empty key", lambda env, q, le: q.enqueue(1, idempotency_key=""), "idempotency_key"),
        ("empty worker id", lambda env, q, le: q.claim(""), "worker_id"),
        ("unserialisable result", lambda env, q, le: q.ack(le, object()), "result"),
        ("non-str error", lambda env, q, le: q.nack(le, 503), "error"),
        ("not a lease", lambda env, q, le: q.ack(("job-1", 1)), "lease"),
        (
            "unserialisable effect",
            lambda env, q, le: stage().RedisEffectStore(q).commit(le, {1, 2}),
            "effect",
        ),
    ]
    return [pytest.param(call, name, id=case) for case, call, name in cases]


@pytest.mark.rule("redis-bad-input", "whole-us", "json", "lua-bounds")
@core
@pytest.mark.parametrize(("call", "parameter"), _bad_calls())
def test_stage3_bad_input_raises_naming_the_parameter_and_writes_nothing(
    redis_env: RedisEnv, call: Callable[[RedisEnv, Any, Lease], Any], parameter: str
) -> None:
    redis_env.freeze_time()
    queue = new_queue(redis_env)
    queue.enqueue({"n": 1})
    lease = claim(queue)
    before = key_contents(redis_env)
    with pytest.raises((TypeError, ValueError)) as raised:
        call(redis_env, queue, lease)
        raise AssertionError(f"bad {parameter} was accepted")
    assert parameter in str(raised.value), (
        f"the error for a bad {parameter} must name it; got {raised.value!r}"
    )
    after = key_contents(redis_env)
    assert after == before, (
        f"a call refused for its {parameter} must write nothing to Redis (validate "
        f"before the script runs); keys changed: "
        f"{sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))}"
    )


@pytest.mark.rule("one-script")
@core
def test_stage3_each_transition_is_one_round_trip(redis_env: RedisEnv) -> None:
    proxy = redis_env.proxy()
    queue = new_queue(redis_env, redis_env.server().proxied_client(proxy))
    store = stage().RedisEffectStore(queue)

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


# The replay: one client, random calls, every result judged by the exact model.


WORKERS = ("w1", "w2")


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
        self.replay.history.append(
            Call("pass_time", (f"{ms} ms",), ("ok", None), OpStamp(-1, -1), "test")
        )


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


TestStage3QueueMatchesTheModel = pytest.mark.rule(
    "redis-order", "redis-never-early", "redis-attempts", "redis-stale", "redis-backoff",
    "redis-next-due", "redis-settle-first", "redis-fenced", "redis-effect-by-job", "op-counter",
)(pytest.mark.realtime(core(RedisQueueMachine.TestCase)))  # fmt: skip
TestStage3QueueMatchesTheModel.settings = settings(heavy, stateful_step_count=30)
TestStage3ExtendedQueueMatchesTheModel = pytest.mark.rule(
    "redis-extended", "redis-unknown-id", "redis-idempotency", "redis-dedup-ttl", "reap",
)(pytest.mark.realtime(extended(ExtendedRedisQueueMachine.TestCase)))  # fmt: skip
TestStage3ExtendedQueueMatchesTheModel.settings = settings(heavy, stateful_step_count=30)


@pytest.mark.rule("op-order", "op-counter", "redis-fenced")
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


# --------------------------------------------------------------------------- extended


@pytest.mark.rule("redis-extended", "redis-settle-first")
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


@pytest.mark.rule("redis-jitter")
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
        """(job id, attempt, delay) of 12 jobs failing twice each, in the order they failed;
        ``noisy``: with reads and refused calls between the failures."""
        queue = new_queue(
            redis_env, prefix=redis_env.fresh_prefix(), retry=policy, max_attempts=3,
            rng=random.Random(seed),
        )  # fmt: skip
        for n in range(12):
            queue.enqueue(n)
        out: list[tuple[str, int, int]] = []
        while len(out) < 24:
            lease = queue.claim("w")
            if lease is None:  # the retries are not due yet
                redis_env.pass_time(cap)
                continue
            if lease.attempt > 2:  # measured twice already (real time runs on)
                queue.ack(lease)
                continue
            if noisy:
                queue.get(lease.job_id), queue.statistics(), queue.next_due_ns()
                with pytest.raises(StaleLease):
                    queue.nack(replace(lease, token=lease.token + 1), "stale")
            queue.nack(lease, "503")
            failed_at = stamp(queue, "nack").server_now_ns
            delay = queue.get(lease.job_id).run_at_ns - failed_at
            out.append((lease.job_id, lease.attempt, delay))
        return out

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


@pytest.mark.rule("redis-extended")
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


@pytest.mark.rule("redis-extended")
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


@pytest.mark.rule("redis-extended")
@extended
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
    assert queue.redrive(a) is True and queue.redrive(a) is False
    again = claim(queue)
    assert (again.job_id, again.attempt, again.token) == (a, 1, 2), (
        f"redrive zeroes the attempts but never the token: expected attempt 1, token 2; got {again}"
    )
    with pytest.raises(StaleLease):
        queue.ack(la)
        raise AssertionError("a lease from before the death passed the fence")
    assert [job.id for job in queue.dead_letters()] == [b]


@pytest.mark.rule("redis-dedup-ttl")
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


def race(queues: list[Any], act: Callable[[Any, int], list[Any]]) -> list[Any]:
    """Run ``act(queue, i)`` in one thread per queue, released together by a barrier, with
    a tiny switch interval; every thread's results, concatenated."""
    barrier = threading.Barrier(len(queues))
    results: list[list[Any]] = [[] for _ in queues]

    def run(i: int) -> None:
        barrier.wait(10)
        results[i] = act(queues[i], i)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(queues))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
            assert not t.is_alive(), "a racing thread did not finish within 30 s"
    finally:
        sys.setswitchinterval(old)
    return [r for rs in results for r in rs]


@pytest.mark.rule("redis-idempotency")
@extended
def test_stage3_racing_producers_with_one_key_create_one_job(redis_env: RedisEnv) -> None:
    """Idempotency inside the enqueue script: a GET then a SET lets racing retries through."""
    queues = [new_queue(redis_env, c) for c in redis_env.clients(8)]

    def produce(key: str) -> Callable[[Any, int], list[Any]]:
        def enqueue(q: Any, i: int) -> list[Any]:
            return [q.enqueue({"order": key}, idempotency_key=key)]

        return enqueue

    created = {key: set(race(queues, produce(key))) for key in (f"order-{n}" for n in range(15))}
    dup = {k: v for k, v in created.items() if len(v) != 1}
    assert not dup, (
        f"8 producers racing to enqueue one idempotency key must all get the same "
        f"job id; these keys created several jobs: {dup}"
    )
    assert queues[0].statistics().ready == 15


@pytest.mark.rule("one-script", "redis-attempts")
@extended
def test_stage3_racing_workers_never_claim_one_job_twice(redis_env: RedisEnv) -> None:
    # Server time stands still (fakeredis) and the lease is long (a real server): a lease
    # that ran out mid-race would give its job back for a legitimate second claim.
    redis_env.freeze_time()
    queues = [new_queue(redis_env, c, lease_ns=3600 * 1000 * MS) for c in redis_env.clients(6)]
    for i in range(60):
        queues[0].enqueue({"n": i})

    def drain(q: Any, i: int) -> list[str]:
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


@pytest.mark.rule("ttl-retention", "key-prefix")
@extended
@pytest.mark.realtime
def test_stage3_finished_jobs_and_keys_expire_with_a_ttl(redis_env: RedisEnv) -> None:
    redis_env.freeze_time()
    queue = new_queue(redis_env, retention_ns=200 * MS, dedup_ttl_ns=200 * MS, max_attempts=1)
    admin = redis_env.client()
    ids = [queue.enqueue({"n": i}, idempotency_key=f"k{i}") for i in range(12)]
    for i in range(12):
        lease = claim(queue)
        [queue.ack, lambda le: queue.nack(le, "x"), lambda le: queue.cancel(le.job_id)][i % 3](
            lease
        )
    keys = redis_env.keys()
    forever = [k for k in keys if admin.pttl(k) < 0]
    bounded = [k for k in keys if admin.pttl(k) >= 0]
    assert len(forever) <= 16, (
        f"once 12 jobs have finished, their keys and their idempotency records "
        f"must carry a TTL (set by the script that finishes or records them); "
        f"{len(forever)} keys have none: {forever[:20]}"
    )
    too_long = [k for k in bounded if admin.pttl(k) > 200 + 5]
    assert not too_long, f"TTLs must not exceed the retention (200 ms): {too_long}"
    redis_env.pass_time(201 * MS)
    assert queue.statistics() == QueueStatistics(0, 0, 0, 0, 0, 0, 0), queue.statistics()
    for job_id in ids:
        with pytest.raises(JobNotFound):
            queue.get(job_id)
            raise AssertionError(f"{job_id} outlived its retention")


@pytest.mark.rule("bounded-memory")
@extended
@pytest.mark.realtime
def test_stage3_an_idle_queue_shrinks_to_its_live_jobs(redis_env: RedisEnv) -> None:
    redis_env.freeze_time()
    queue = new_queue(redis_env, retention_ns=100 * MS, dedup_ttl_ns=100 * MS, max_attempts=1)
    for i in range(60):
        queue.enqueue({"n": i}, idempotency_key=f"k{i}")
        lease = claim(queue)
        [queue.ack, lambda le: queue.nack(le, "x"), lambda le: queue.cancel(le.job_id)][i % 3](
            lease
        )
    live = [
        queue.enqueue("ready"),
        queue.enqueue("ready"),
        queue.enqueue("later", delay_ns=3_600_000 * MS),
    ]
    redis_env.pass_time(101 * MS)  # and no call: nothing settles the history away
    admin = redis_env.client()
    sizes: dict[str, Callable[[str], int]] = {
        "set": admin.scard, "zset": admin.zcard, "list": admin.llen,
    }  # fmt: skip
    held: dict[str, int] = {}  # key -> its members (1 for a string or a hash)
    members = 0
    for key in redis_env.keys(redis_env.prefix):
        size = sizes.get(_text(admin.type(key)))
        held[key] = 1 if size is None else size(key)
        members += 0 if size is None else held[key]
    assert len(held) <= 16 and members <= 2 * len(live), (
        f"60 jobs finished and passed their retention (100 ms) with no call since; the queue "
        f"keeps {len(live)} live jobs: expected their keys and a few counters (at most 16 "
        f"keys, {2 * len(live)} index members), got {len(held)} keys and {members} members: "
        + ", ".join(
            f"{k.removeprefix(redis_env.prefix)} ({n})"
            for k, n in sorted(held.items(), key=lambda kv: -kv[1])[:6]
        )
        + " — an index of finished jobs or records needs a TTL of its own"
    )
    for job_id in live:
        assert queue.get(job_id).state in (JobState.READY, JobState.SCHEDULED), job_id


@pytest.mark.rule("ttl-retention", "redis-extended")
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


@pytest.mark.rule("reap")
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


@pytest.mark.rule("scripts-reload")
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


@pytest.mark.rule("outage-raises")
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


@pytest.mark.rule("busy-unavailable", "worker-outage")
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


@pytest.mark.rule("redis-idempotency", "fault-lost-reply")
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


# --------------------------------------------------------------------------- RedisWorker
# In-process workers on a ManualClock: the worker's clock paces heartbeats and polls, so
# the test decides exactly when each one is due (server time plays no part here).

WORKER_LEASE = 3_000 * MS  # long enough never to run out for real on a real server


def in_process_worker(
    redis_env: RedisEnv,
    handler: Callable[[Lease, Any], Any],
    clock: ManualClock | None = None,
    client: redis.Redis | None = None,
    **options: Any,
) -> tuple[Any, Any, ManualClock, list[tuple[str, str | None]]]:
    """(queue, worker, its clock, the events it reported) on a queue of this test; the
    worker reaches Redis through ``client`` if given (a proxied one)."""
    queue = new_queue(redis_env, lease_ns=WORKER_LEASE, max_attempts=1)
    clock = ManualClock(10**12) if clock is None else clock
    events: list[tuple[str, str | None]] = []
    worker = stage().RedisWorker(
        new_queue(redis_env, client, lease_ns=WORKER_LEASE, max_attempts=1), handler,
        worker_id="w1",
        clock=clock, on_event=lambda e, lease: events.append((e, lease and lease.job_id)),
        **options,
    )  # fmt: skip
    return queue, worker, clock, events


def run_in_thread(worker: Any, max_jobs: int) -> Any:
    return spawn(lambda: worker.run(max_jobs=max_jobs), "redis-worker")


@pytest.mark.rule("worker-heartbeat-default", "worker-heartbeats")
@extended
def test_stage3_worker_default_heartbeat_is_every_third_of_the_lease(redis_env: RedisEnv) -> None:
    busy: set[int] = set()
    release = threading.Event()

    def handler(lease: Lease, payload: Any) -> Any:
        busy.add(threading.get_ident())
        assert release.wait(DEADLINE_S), "the handler waited for the test too long"
        return payload

    clock = WatchedClock(10**12)
    queue, worker, _, _ = in_process_worker(redis_env, handler, clock=clock)
    queue.enqueue("long")
    others = set(threading.enumerate())
    thread = run_in_thread(worker, 1)
    eventually(lambda: len(busy) == 1, "the job's handler running")
    beats_at_a_third(
        lambda: worker.statistics().heartbeats,
        lambda: None,  # the lease's expiry is on the server's clock, not this one
        clock,
        lambda: clock.settle(others | {thread}, busy),
        who="RedisWorker",
        lease=WORKER_LEASE,
    )
    release.set()
    thread.outcome("the worker to finish its one job")
    stats = worker.statistics()
    assert (stats.succeeded, stats.lost) == (1, 0), f"{stats}"


@pytest.mark.rule("worker-nack", "worker-events", "worker-run")
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
    assert stage().RedisEffectStore(queue).effects() == {}, "a failed handler committed"


@pytest.mark.rule("worker-poll", "worker-loop")
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
    assert stage().RedisEffectStore(queue).effects() == {job_id: {"done": job.payload}}
    assert [e for e, _ in events] == ["claimed", "committed", "after_effect", "acked"], events


# --------------------------------------------------------------------------- processes


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

    def queue(self, **options: Any) -> Any:
        options = {"lease_ns": self.lease_ns, "max_attempts": self.max_attempts, **options}
        return new_queue(self.env, self.node.client(), **options)

    def events(self, event: str) -> list[str]:
        """``<job> <token>`` of every ``event`` any worker printed."""
        return [line.split(" ", 2)[2] for p in self.started for line in p.lines(f"EVENT {event} ")]

    def transcripts(self) -> str:
        return "\n".join(p.transcript() for p in self.started)

    def close(self) -> None:
        for p in self.started:
            p.close()


@pytest.fixture
def workers(redis_env: RedisEnv, impl_selection: impl.Selection) -> Iterator[Workers]:
    node = redis_env.fault_server() if redis_env.mode != "url" else redis_env.server()
    w = Workers(redis_env, impl_selection, node, node.url, lease_ns=150 * MS)
    try:
        yield w
    finally:
        w.close()


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
    workers: Workers, queue: Any, ids: list[str], *, lost_replies: bool = False
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
    effects = stage().RedisEffectStore(queue).effects()
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
    workers.env.freeze_time()  # fakeredis: leases run out only when the test says
    queue = workers.queue()
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


@pytest.mark.rule("fault-sigkill", "worker-loop")
@extended
@pytest.mark.realtime
def test_stage3_sigkill_after_the_claim_the_job_comes_back(workers: Workers) -> None:
    sigkill_mid_job(workers, "claimed")


@pytest.mark.rule("fault-sigkill", "worker-events")
@extended
@pytest.mark.realtime
def test_stage3_sigkill_between_effect_and_ack_the_effect_lands_once(workers: Workers) -> None:
    sigkill_mid_job(workers, "after_effect")


@pytest.mark.rule("fault-sigstop", "worker-stale-drops")
@extended
@pytest.mark.realtime
def test_stage3_sigstop_past_the_lease_then_sigcont_the_zombie_is_fenced(
    workers: Workers,
) -> None:
    workers.env.freeze_time()  # fakeredis: leases run out only when the test says
    queue = workers.queue()
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


@pytest.mark.rule("fault-poison")
@extended
@pytest.mark.realtime
def test_stage3_poison_job_that_kills_every_worker_is_dead_lettered(workers: Workers) -> None:
    workers.env.freeze_time()  # fakeredis: leases run out only when the test says
    queue = workers.queue()
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


def long_job(workers: Workers) -> tuple[Any, str]:
    """A queue (2 attempts) holding one job that runs three leases long, for real."""
    queue = workers.queue(max_attempts=2)
    return queue, queue.enqueue({"effect": "slow", "work_ms": 3 * workers.lease_ns // MS})


@pytest.mark.rule("fault-long-job", "worker-heartbeats")
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


@pytest.mark.rule("fault-long-job")
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
    assert stage().RedisEffectStore(queue).effects() == {}, "an expired attempt committed"


@pytest.mark.rule("fault-sigterm", "worker-stop")
@extended
@pytest.mark.realtime
def test_stage3_sigterm_during_a_burst_finishes_or_releases_and_leaves_no_lease(
    workers: Workers,
) -> None:
    workers.env.freeze_time()  # fakeredis: leases run out only when the test says
    queue = workers.queue()
    burst = [workers.start("--grace-ns", str(250 * MS)) for _ in range(3)]
    # The long job goes first and outlives the grace period: it must be released.
    long_job = queue.enqueue({"effect": "long", "work_ms": 800}, priority=1)
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
    workers.start("--max-jobs", str(left)).wait_for("EXIT", idle_polls=DUE)
    applied_once(workers, queue, ids)


@pytest.mark.rule("fault-outage", "worker-outage")
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


@pytest.mark.rule("fault-restart", "scripts-reload")
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


@pytest.mark.rule("fault-random-crashes")
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


@pytest.mark.rule("fault-skew", "worker-clock", "worker-run")
@extended
@pytest.mark.realtime
def test_stage3_skewed_worker_clocks_change_nothing(redis_env: RedisEnv) -> None:
    """Two in-process workers whose clocks are an hour off either way: heartbeats are
    paced by intervals, never by comparing a local clock with a server time."""

    class Skewed(MonotonicClock):
        def __init__(self, offset_ns: int) -> None:
            self.offset = offset_ns

        def now_ns(self) -> int:
            return super().now_ns() + self.offset

        def wait_until_ns(self, cond: threading.Condition, deadline_ns: int | None) -> None:
            deadline = None if deadline_ns is None else deadline_ns - self.offset
            super().wait_until_ns(cond, deadline)

    queue = new_queue(redis_env, lease_ns=120 * MS)
    ids = [queue.enqueue(i) for i in range(4)]

    def handler(lease: Lease, payload: Any) -> Any:
        time.sleep(0.3)  # 2.5 leases: only heartbeats keep it
        return payload

    hour = 3600 * 10**9
    fleet = [
        stage().RedisWorker(
            new_queue(redis_env, lease_ns=120 * MS), handler, worker_id=f"w{i}",
            clock=Skewed(offset), heartbeat_every_ns=40 * MS,
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
