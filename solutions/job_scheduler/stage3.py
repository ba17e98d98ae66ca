"""Stage 3 reference: the stage-1 queue on Redis, for workers on many machines.

Design (see katas/job_scheduler/README.md and ``_redis_scripts.py``):

- Every transition — enqueue, claim, ack, nack, heartbeat, release, cancel, redrive,
  and the effect store's commit — is one Lua script, so one round trip, atomic because
  Redis runs one script at a time. No read-then-write from the client, no WATCH loops.
- Time is the server's ``TIME`` in µs; this process reads no clock for a job's times.
  Times in the API stay nanoseconds (µs × 1000), so they compare with stage 1's.
- Lease expiry is applied by every script before its own work (stage 1's settle), and
  by :meth:`RedisJobQueue.reap` — the same settle with nothing after it — so a queue
  nobody calls still retries its crashed jobs. Running the reaper on every machine at
  once is safe: settling twice changes nothing.
- The effect store commits in the script that checks the live token, keyed by job id:
  a zombie's effect is refused, and a re-run after a crash between effect and ack
  finds the effect committed and just acks.
- Payloads, results and effects travel as JSON: what cannot be encoded is refused
  before anything is sent.
- :class:`RedisWorker` is one worker's loop (claim, handler, commit, ack; heartbeats;
  graceful stop), what ``python -m katas._harness.worker`` runs as a separate OS process.
- On a Redis Cluster (a ``RedisCluster`` client) nothing changes: a queue's keys share a
  hash tag, so they live in one slot, and every script declares every key it touches, so
  the cluster routes it whole — or, while the slot moves, refuses it (``TRYAGAIN``), an
  outage like any other.
"""

from __future__ import annotations

import json
import random
import threading
from collections.abc import Callable
from typing import Any

import redis

from katas._runtime.redis_errors import REDIS_FAILURES
from katas.job_scheduler.api import (
    DEFAULT_DEDUP_TTL_NS,
    DEFAULT_RETENTION_NS,
    FINISHED_STATES,
    NS_PER_MS,
    Job,
    JobNotFound,
    JobState,
    Lease,
    MonotonicClock,
    OpStamp,
    PoolStatistics,
    QueueFull,
    QueueStatistics,
    RetryPolicy,
    StaleLease,
    WaitingClock,
    check_client,
    to_json,
    unavailable,
)

from . import _redis_scripts as lua
from .stage1 import _check_int, _check_str

#: The largest number a script is given. Lua numbers are doubles, exact below 2^53, and a
#: duration is added to the server's time (about 2^50.6 µs since 1970): with every duration,
#: time and count at most 2^52 (µs: 142 years) every sum a script makes stays exact — and a
#: due time fits the ready set's 16-digit member.
LUA_MAX = 2**52


def _bounded(name: str, value: object, minimum: int, maximum: int = LUA_MAX) -> int:
    """An int in ``[minimum, maximum]``: the bound a Lua double holds exactly."""
    n = _check_int(name, value, minimum)
    if n > maximum:
        raise ValueError(f"{name} must be at most {maximum} (exact in a Lua double), got {n}")
    return n


def _us(name: str, value: object, minimum: int = 0) -> int:
    """A duration in whole µs (what Redis TIME can express), from nanoseconds."""
    ns = _bounded(name, value, minimum, LUA_MAX * 1000)
    if ns % 1000:
        raise ValueError(f"{name} must be a whole number of µs (Redis TIME), got {ns}")
    return ns // 1000


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class RedisJobQueue:
    """Stage 1's JobQueue with its state in Redis, shared by every process that names it.

    Every client of one queue (``name`` and ``key_prefix``) must be built with the same
    settings. Times are the server's; ``run_at_ns`` is rounded up to a whole µs.
    """

    def __init__(
        self,
        client: redis.Redis | redis.RedisCluster,
        *,
        lease_ns: int,
        retry: RetryPolicy,
        max_attempts: int,
        rng: random.Random | None = None,
        dedup_ttl_ns: int = DEFAULT_DEDUP_TTL_NS,
        retention_ns: int = DEFAULT_RETENTION_NS,
        max_pending: int | None = None,
        name: str = "jobs",
        key_prefix: str = "q:",
    ) -> None:
        if not isinstance(client, redis.Redis | redis.RedisCluster):
            raise TypeError(f"client must be a redis.Redis or a RedisCluster, got {client!r}")
        check_client(client)  # a socket timeout, and no retry that runs a script twice
        if not isinstance(retry, RetryPolicy):
            raise TypeError(f"retry must be a RetryPolicy, got {retry!r}")
        if rng is not None and not isinstance(rng, random.Random):
            raise TypeError(f"rng must be a random.Random, got {rng!r}")
        _check_str("name", name)
        if any(c in name for c in "{}"):
            raise ValueError(f"name must not contain braces (it is the hash tag), got {name!r}")
        if not isinstance(key_prefix, str):
            raise TypeError(f"key_prefix must be a str, got {key_prefix!r}")
        self._lease_ns = _us("lease_ns", lease_ns, 1000) * 1000
        common = (
            self._lease_ns // 1000,
            _bounded("max_attempts", max_attempts, 1),
            _us("retry.base_ns", retry.base_ns),
            _us("retry.cap_ns", retry.cap_ns),
            retry.jitter,
            _us("retention_ns", retention_ns),
            _us("dedup_ttl_ns", dedup_ttl_ns),
        )
        self._settings = " ".join(str(v) for v in common).encode()  # ARGV[1], encoded once
        self._max_pending = (
            b"" if max_pending is None else b"%d" % _bounded("max_pending", max_pending, 1)
        )
        # The seed of the queue's generator, used if this client is the first to draw
        # (the generator's state lives in Redis): one draw per client, none if no jitter.
        jitters = retry.jitter != "none"
        rng = random.Random() if rng is None else rng
        self._seed = b"%d" % rng.randrange(1, 2**31 - 1) if jitters else b"1"
        self._client = client
        # Every key of the queue, declared by every script; {name} puts them in one slot.
        # Encoded once, as the settings are: 13 keys encoded per call cost 4-12% of a
        # claim + ack cycle on a real server.
        self._keys = [f"{key_prefix}{{{name}}}:{key}".encode() for key in lua.KEYS]
        self._scripts = {k: client.register_script(src) for k, src in lua.SCRIPTS.items()}
        self._local = threading.local()

    @property
    def lease_ns(self) -> int:
        """How long a claim or heartbeat leases a job for."""
        return self._lease_ns

    # --- core -------------------------------------------------------------------------

    def enqueue(
        self,
        payload: Any,
        *,
        priority: int = 0,
        run_at_ns: int | None = None,
        idempotency_key: str | None = None,
        delay_ns: int | None = None,
    ) -> str:
        """Add a job; return its id (the first job's id for a key seen within its TTL).

        ``run_at_ns`` is a time on the server's clock; ``delay_ns`` counts from the
        server's now instead (a producer's own clock may be off by seconds).
        """
        _check_int("priority", priority)
        if abs(priority) >= 2**53:
            raise ValueError(f"priority must be within ±2^53 (a sorted-set score), got {priority}")
        run_at = delay = b""
        if run_at_ns is not None:
            if delay_ns is not None:
                raise ValueError("give run_at_ns or delay_ns, not both")
            run_at = b"%d" % -(-_bounded("run_at_ns", run_at_ns, 0, LUA_MAX * 1000) // 1000)
        elif delay_ns is not None:
            delay = b"%d" % -(-_bounded("delay_ns", delay_ns, 0, LUA_MAX * 1000) // 1000)
        key = b"" if idempotency_key is None else _check_str("idempotency_key", idempotency_key)
        reply = self._call("enqueue", to_json("payload", payload), priority, run_at, delay, key,
                           self._max_pending)  # fmt: skip
        if reply[0] == "full":
            raise QueueFull(f"the queue holds max_pending={int(self._max_pending)} unfinished jobs")
        return _text(reply[1])

    def claim(self, worker_id: str) -> Lease | None:
        """Lease the best due job to ``worker_id`` (counting an attempt), or None."""
        reply = self._call("claim", _check_str("worker_id", worker_id))
        if reply[0] == "none":
            return None
        job_id, token, attempt, expires_us = reply[1:]
        return Lease(_text(job_id), int(token), int(attempt), int(expires_us) * 1000, worker_id)

    def ack(self, lease: Lease, result: Any = None) -> None:
        """Finish the leased job as SUCCEEDED with ``result``; StaleLease if not live."""
        self._leased("ack", lease, to_json("result", result))

    def nack(self, lease: Lease, error: str) -> None:
        """Fail this attempt: retry after backoff, or DEAD after max_attempts attempts."""
        if type(error) is not str:
            raise TypeError(f"error must be a str, got {error!r}")
        self._leased("nack", lease, error)

    def get(self, job_id: str) -> Job:
        """A snapshot of the job; JobNotFound if unknown or forgotten."""
        reply = self._found("get", job_id)
        return _snapshot(job_id, reply[1])

    def next_due_ns(self) -> int | None:
        """Now if a job is READY; else the next run time or lease expiry; else None."""
        reply = self._call("next_due")
        return None if reply[0] == "none" else int(reply[1]) * 1000

    # --- extended ---------------------------------------------------------------------

    def heartbeat(self, lease: Lease) -> Lease:
        """Extend a live lease to now + lease_ns; StaleLease if it has expired."""
        _, attempt, expires_us = self._leased("heartbeat", lease)
        return Lease(lease.job_id, lease.token, int(attempt), int(expires_us) * 1000,
                     lease.worker_id)  # fmt: skip

    def release(self, lease: Lease) -> None:
        """Hand the job back unfinished: READY again in its old place, attempt refunded."""
        self._leased("release", lease)

    def cancel(self, job_id: str) -> bool:
        """Cancel an unfinished job (its lease goes stale); False if already finished."""
        return bool(self._found("cancel", job_id)[0] == "true")

    def dead_letters(self) -> list[Job]:
        """Snapshots of the DEAD jobs still held, in the order they died."""
        rows = self._call("dead_letters")[1]
        return [_snapshot(None, fields) for fields in rows]

    def redrive(self, job_id: str) -> bool:
        """Return a DEAD job to READY with attempts zeroed; False if it is not DEAD."""
        reply = self._found("redrive", job_id, self._max_pending)
        if reply[0] == "full":
            raise QueueFull(f"the queue holds max_pending={int(self._max_pending)} unfinished jobs")
        return bool(reply[0] == "true")

    def is_current(self, lease: Lease) -> bool:
        """Whether ``lease`` is its job's live lease now."""
        _check_lease(lease)
        return bool(self._call("is_current", lease.job_id, lease.token)[0] == "ok")

    def statistics(self) -> QueueStatistics:
        """Jobs held per state, and idempotency records held (one round trip)."""
        return QueueStatistics(*(int(n) for n in self._call("statistics")[1:]))

    def reap(self) -> int:
        """Apply what is due (lease expiries first); return how many leases expired."""
        return int(self._call("reap")[1])

    def last_op(self) -> OpStamp | None:
        """This thread's last call on the queue: its place in the order Redis ran them."""
        stamp: OpStamp | None = getattr(self._local, "stamp", None)
        return stamp

    # --- internals --------------------------------------------------------------------

    def _call(self, script: str, *args: Any) -> list[Any]:
        """Run one script (one round trip); return its reply after ``op`` and ``now``."""
        reply = self._scripts[script](
            keys=self._keys, args=[self._settings, self._seed, *args], client=self._client
        )
        self._local.stamp = OpStamp(int(reply[0]), int(reply[1]) * 1000)
        return [_text(reply[2]), *reply[3:]]

    def _found(self, script: str, job_id: str, *args: Any) -> list[Any]:
        reply = self._call(script, _check_str("job_id", job_id), *args)
        if reply[0] == "notfound":
            raise JobNotFound(f"no job {job_id!r} (never enqueued, or forgotten after retention)")
        return reply

    def _leased(self, script: str, lease: Lease, *args: Any) -> list[Any]:
        """Run a script that acts on a live lease; StaleLease or JobNotFound if not live."""
        _check_lease(lease)
        reply = self._found(script, lease.job_id, lease.token, *args)
        if reply[0] == "stale":
            state, latest = _text(reply[1]), int(reply[2])
            raise StaleLease(
                f"lease token {lease.token} of job {lease.job_id!r} is not live: the job is "
                f"{state} and its latest token is {latest}"
            )
        return reply


def _check_lease(lease: object) -> None:
    if not isinstance(lease, Lease):
        raise TypeError(f"lease must be a Lease, got {lease!r}")


def _snapshot(job_id: str | None, flat: list[Any]) -> Job:
    f = {_text(flat[i]): _text(flat[i + 1]) for i in range(0, len(flat), 2)}

    state = JobState(f["st"])
    leased = state is JobState.LEASED  # a script leaves lease fields behind on leaving it

    def ns(field: str) -> int | None:
        return int(f[field]) * 1000 if field in f else None

    return Job(
        id=job_id or f["id"],
        payload=json.loads(f["p"]),
        state=state,
        priority=int(f["pr"]),
        run_at_ns=int(f["due"]) * 1000,
        seq=int(f["seq"]),
        attempts=int(f["att"]),
        max_attempts=int(f["max"]),
        token=int(f["tok"]),
        last_error=f.get("err"),
        result=json.loads(f["res"]) if "res" in f else None,
        enqueued_at_ns=int(f["enq"]) * 1000,
        lease_expires_at_ns=ns("exp") if leased else None,
        worker_id=f.get("wid") if leased else None,
        finished_at_ns=ns("fin") if state in FINISHED_STATES else None,
    )


class RedisEffectStore:
    """Effects by job id in Redis, committed at most once per job, fenced by the token."""

    def __init__(self, queue: RedisJobQueue) -> None:
        if not isinstance(queue, RedisJobQueue):
            raise TypeError(f"queue must be a RedisJobQueue, got {queue!r}")
        self._queue = queue

    def commit(self, lease: Lease, effect: Any) -> bool:
        """Record ``effect`` iff the job has none and ``lease`` is live (else StaleLease)."""
        try:
            reply = self._queue._leased("commit", lease, to_json("effect", effect))
        except JobNotFound:
            # A forgotten job's lease is not live either: the zombie must stop, as in stage 1.
            raise StaleLease(
                f"lease token {lease.token} of job {lease.job_id!r} is not live: the queue "
                "holds no such job (never enqueued, or forgotten after its retention)"
            ) from None
        return bool(reply[0] == "true")

    def effects(self) -> dict[str, Any]:
        """Every committed effect of a job the queue still holds, by job id."""
        flat = self._queue._call("effects")[1]
        return {_text(flat[i]): json.loads(flat[i + 1]) for i in range(0, len(flat), 2)}


Handler = Callable[[Lease, Any], Any]
#: ``on_event(event, lease)``: "claimed", "committed", "duplicate" (the effect was
#: committed by an earlier attempt), "after_effect", "acked", "failed" (nacked), "lost"
#: (the lease went stale), "released" (handed back at stop), "unavailable" (lease None).
EventHook = Callable[[str, Lease | None], None]
_NEVER = 2**63


class RedisWorker:
    """One worker: claim a job, run ``handler(lease, payload)``, commit its return value
    as the job's effect, then ack — with heartbeats, outages waited out, graceful stop.
    """

    def __init__(
        self,
        queue: RedisJobQueue,
        handler: Handler,
        *,
        worker_id: str,
        clock: WaitingClock | None = None,
        heartbeat_every_ns: int | None = None,
        poll_ns: int = 20 * NS_PER_MS,
        on_event: EventHook | None = None,
    ) -> None:
        if not isinstance(queue, RedisJobQueue):
            raise TypeError(f"queue must be a RedisJobQueue, got {queue!r}")
        if not callable(handler):
            raise TypeError(f"handler must be callable, got {handler!r}")
        self._queue = queue
        self._store = RedisEffectStore(queue)
        self._handler = handler
        self._id = _check_str("worker_id", worker_id)
        self._clock = MonotonicClock() if clock is None else clock
        every = queue.lease_ns // 3 if heartbeat_every_ns is None else heartbeat_every_ns
        self._every = _check_int("heartbeat_every_ns", every, 1)
        self._poll = _check_int("poll_ns", poll_ns, 1)
        self._on_event = on_event
        # Re-entrant: stop() may run in a signal handler while this thread holds it.
        self._cond = threading.Condition(threading.RLock())
        self._lease: Lease | None = None  # the running job's lease (heartbeaten)
        self._claimed_at = 0  # when it was claimed, on this worker's clock
        self._released = False
        self._stopping = False
        self._deadline = _NEVER  # stop's grace deadline, on the clock
        self._idle = False
        self._counts = dict.fromkeys(
            ("claimed", "succeeded", "failed", "released", "lost", "heartbeats"), 0
        )

    def run(self, *, max_jobs: int | None = None) -> None:
        """Work until :meth:`stop`, or until ``max_jobs`` jobs were handled."""
        if max_jobs is not None:
            _check_int("max_jobs", max_jobs, 1)
        beats = threading.Thread(target=self._beat, name=f"{self._id}-heartbeats", daemon=True)
        beats.start()
        handled = 0
        try:
            while not self._stopping and (max_jobs is None or handled < max_jobs):
                lease = self._patiently(lambda: self._queue.claim(self._id))
                if lease is None:
                    self._pause(self._poll)
                    continue
                handled += 1
                self._work(lease)
        finally:
            with self._cond:
                self._stopping = True
                self._cond.notify_all()
            beats.join()

    def stop(self, grace_ns: int = 0) -> None:
        """Stop claiming; the running job has ``grace_ns`` to finish, then it is released
        (attempt refunded). Safe to call from a signal handler."""
        _check_int("grace_ns", grace_ns, 0)
        with self._cond:
            self._stopping = True
            self._deadline = min(self._deadline, self._clock.now_ns() + grace_ns)
            self._cond.notify_all()

    def statistics(self) -> PoolStatistics:
        """This worker's counters (``workers`` is 1; ``timed_out`` is always 0)."""
        with self._cond:
            c = self._counts
            return PoolStatistics(
                workers=1, in_flight=int(self._lease is not None), idle=int(self._idle),
                claimed=c["claimed"], succeeded=c["succeeded"], failed=c["failed"],
                released=c["released"], lost=c["lost"], heartbeats=c["heartbeats"],
                timed_out=0, stopping=self._stopping,
            )  # fmt: skip

    # --- internals --------------------------------------------------------------------

    def _event(self, event: str, lease: Lease | None, counter: str | None = None) -> None:
        if counter is not None:
            with self._cond:
                self._counts[counter] += 1
        if self._on_event is not None:
            self._on_event(event, lease)

    def _pause(self, ns: int) -> None:
        with self._cond:
            self._idle = True
            deadline = self._clock.now_ns() + ns
            # stop() ends an idle wait at once; with a job in hand the worker keeps its
            # pace through an outage (no tight loop of retries) until the job is done
            while (self._lease is not None or not self._stopping) and (
                self._clock.now_ns() < deadline
            ):
                self._clock.wait_until_ns(self._cond, deadline)
            self._idle = False

    def _patiently(self, call: Callable[[], Any]) -> Any:
        """``call()``, retried while Redis is unreachable (None once stopping)."""
        while True:
            try:
                return call()
            except REDIS_FAILURES as error:
                if not unavailable(error):  # a bug (a script error) is raised
                    raise
                self._event("unavailable", None)
                if self._stopping and self._lease is None:
                    return None
                self._pause(self._poll)

    def _work(self, lease: Lease) -> None:
        with self._cond:
            self._lease, self._released = lease, False
            self._claimed_at = self._clock.now_ns()
            self._cond.notify_all()  # the heartbeat thread has a lease to keep
        self._event("claimed", lease, "claimed")
        try:
            job = self._patiently(lambda: self._queue.get(lease.job_id))
            error: str | None = None
            effect: Any = None
            try:
                effect = self._handler(lease, job.payload)
            except Exception as e:  # a job's failure is data: nack it
                error = f"{type(e).__name__}: {e}"
            if self._released:
                return  # stop's grace ran out and handed the job back
            if error is not None:
                self._patiently(lambda: self._queue.nack(lease, error))
                self._event("failed", lease, "failed")
                return
            # A retried commit after a lost reply finds its own effect: "duplicate".
            fresh = self._patiently(lambda: self._store.commit(lease, effect))
            self._event("committed" if fresh else "duplicate", lease)
            self._event("after_effect", lease)
            self._ack(lease, effect)
            self._event("acked", lease, "succeeded")
        except (StaleLease, JobNotFound):
            if not self._released:  # else stop's release reported it, "released" or "lost"
                self._event("lost", lease, "lost")  # expired or cancelled: someone else's now
        finally:
            with self._cond:
                self._lease = None

    def _ack(self, lease: Lease, effect: Any) -> None:
        try:
            self._patiently(lambda: self._queue.ack(lease, effect))
        except StaleLease:
            # An ack whose reply was lost, sent again, finds its own work done: the job
            # SUCCEEDED under this very token, which only this lease could have acked.
            job = self._patiently(lambda: self._queue.get(lease.job_id))
            if job.state is not JobState.SUCCEEDED or job.token != lease.token:
                raise

    def _beat(self) -> None:
        """Heartbeat the running job's lease; release it when stop's grace runs out."""
        with self._cond:
            beating: Lease | None = None
            next_beat = _NEVER
            releasing: Lease | None = None  # stop's release, tried until Redis answers it
            retry_at = _NEVER
            while not (self._stopping and self._lease is None and releasing is None):
                lease, now = self._lease, self._clock.now_ns()
                if lease is not beating:  # a new job: its first beat is one interval after
                    # its claim, however late this thread wakes to notice it
                    beating, next_beat = lease, self._claimed_at + self._every
                if lease is not None and not self._released and now >= self._deadline:
                    self._released = True  # the handler's result will be dropped
                    releasing, retry_at = lease, now
                if releasing is not None and now >= retry_at:
                    if self._release(releasing):
                        releasing = None
                    else:
                        retry_at = now + self._poll
                if lease is not None and not self._released and now >= next_beat:
                    try:
                        self._queue.heartbeat(lease)
                        self._counts["heartbeats"] += 1
                        next_beat = now + self._every
                    except REDIS_FAILURES as error:
                        if not unavailable(error):  # a bug (a script error) is raised
                            raise
                        next_beat = now + self._poll  # soon again: the lease runs out
                    except (StaleLease, JobNotFound):
                        next_beat = _NEVER  # too late; its commit will be refused
                wake = min(next_beat, self._deadline)
                if lease is None or self._released:
                    wake = retry_at if releasing is not None else _NEVER
                self._clock.wait_until_ns(self._cond, None if wake >= _NEVER else wake)

    def _release(self, lease: Lease) -> bool:
        """Stop's release of the running job; False if Redis was unreachable."""
        try:
            self._queue.release(lease)
            self._event("released", lease, "released")
        except (StaleLease, JobNotFound):
            self._event("lost", lease, "lost")
        except REDIS_FAILURES as error:
            if not unavailable(error):
                raise
            self._event("unavailable", None)
            return False
        return True
