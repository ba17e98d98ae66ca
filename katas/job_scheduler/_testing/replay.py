"""Replaying a Redis run through the exact stage-1 model: every call a client made is
recorded with the stamp of the script that ran it (``perform``), and ``Replay`` feeds the
calls to :class:`~katas.job_scheduler._testing.model.Model` in the order Redis ran them,
at their server times, judging each result the queue gave."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

from katas._harness.story import Story
from katas.job_scheduler._testing.model import Model
from katas.job_scheduler._testing.redis_queues import effect_store, stamp
from katas.job_scheduler._testing.states import LEASED
from katas.job_scheduler.api import (
    JobNotFound,
    Lease,
    OpStamp,
    QueueFull,
    SharedJobQueue,
    StaleLease,
)


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
        args = ", ".join(show(a) for a in self.args)
        return f"op {self.stamp.op}: {self.who}.{self.what}({args}) -> {show(self.outcome)}"


def show(value: Any) -> str:
    """A value as a call's line shows it (a lease by its job and token)."""
    if isinstance(value, Lease):
        return f"Lease({value.job_id}, token={value.token})"
    return repr(value)


def perform(queue: SharedJobQueue, what: str, *args: Any, who: str = "client") -> Call:
    """Make one call on the real queue and record what it returned or raised."""
    invoked = time.monotonic()
    value: Any
    try:
        if what == "commit":
            value = effect_store(queue).commit(*args)
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
    """The stage-1 model, fed calls in op order at their server times; judges each.

    Its :class:`~katas._harness.story.Story` tells the calls in the order Redis ran them,
    each at its server time since the first call's."""

    def __init__(self, model: Model, header: str) -> None:
        self.model = model
        self.ids: dict[int, str] = {}  # model seq -> the queue's job id
        self.seqs: dict[str, int] = {}
        self.effects: dict[int, Any] = {}
        self.first_ns: int | None = None  # the first call's server time
        self.at_ns = 0  # the latest call's, since the first
        self.story = Story(f"{header}, the calls in the order Redis ran them:", self.now_ns)

    def now_ns(self) -> int:
        return self.at_ns

    def note(self, text: str) -> None:
        """Add a step that is not a call on the queue (the test passing time)."""
        self.story.add(text)

    def check(self, call: Call) -> None:
        """Judge ``call``, the next one in op order, by the model."""
        if self.first_ns is None:
            self.first_ns = call.stamp.server_now_ns
        self.at_ns = call.stamp.server_now_ns - self.first_ns
        self.story.add(str(call))
        expected = self.expect(call)
        self.story.check(
            call.outcome == expected,
            "the queue and the exact stage-1 model disagree",
            f"at op {call.stamp.op}, server time {call.stamp.server_now_ns} ns: expected "
            f"{show(expected)}, got {show(call.outcome)}",
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
                self.story.check(got not in self.seqs, "job ids are unique", f"{got!r} reused")
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
        self.story.check(len(set(ops)) == len(ops), "op numbers are unique", f"ops {sorted(ops)}")
        returned = sorted(calls, key=lambda c: c.returned_s)
        done = 0
        latest: Call | None = None  # the highest-op call among those returned so far
        for c in sorted(calls, key=lambda c: c.invoked_s):
            while done < len(returned) and returned[done].returned_s < c.invoked_s:
                if latest is None or returned[done].stamp.op > latest.stamp.op:
                    latest = returned[done]
                done += 1
            self.story.check(
                not (latest is not None and latest.stamp.op >= c.stamp.op),
                "op order contradicts real time",
                f"{latest} returned before {c} was invoked",
            )


def model_for(queue_options: dict[str, Any], **kw: Any) -> Model:
    """The exact model of a queue built with ``queue_options`` (jitter "none": no draws)."""
    return Model(seed=0, **queue_options, **kw)
