"""The ``max_pending`` bound walked through every way a job enters and leaves the
unfinished states, the same walk for stage 1's queue and stage 3's: which jobs count
(SCHEDULED, READY, LEASED) and which do not (SUCCEEDED, DEAD, CANCELLED), for ``enqueue``
and ``redrive`` alike."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from katas._harness.story import Story
from katas.job_scheduler._testing.queues import refusal
from katas.job_scheduler.api import JobQueue, Lease, QueueFull

#: How far in the future the walk's scheduled job is due.
LATER_NS = 3_600 * 10**9


def max_pending_walk(
    queue: JobQueue, now_ns: Callable[[], int], pass_time: Callable[[int], None], lease_ns: int
) -> None:
    """Walk a queue built with ``max_pending=1``, ``max_attempts=1`` and retries due at
    once, a full queue's deduplicated enqueue included (full-queue-dedups). ``now_ns``
    reads the queue's clock (the server's, in stage 3); ``pass_time`` moves it. Fails,
    telling the steps so far, at the first call that breaks the bound."""
    story = Story("max_pending=1, max_attempts=1:", now_ns, now_ns())
    rule = (
        "max_pending counts the unfinished jobs — SCHEDULED, READY and LEASED — and only "
        "them: enqueue and redrive past it raise QueueFull and change nothing"
    )

    def fits(what: str, call: Callable[[], Any], why: str) -> Any:
        try:
            got = call()
        except QueueFull:
            raise AssertionError(story.tell(rule, f"{what} raised QueueFull, but {why}")) from None
        story.add(f"{what} -> {got!r}")
        return got

    def full(what: str, call: Callable[[], Any], why: str) -> None:
        got = refusal(QueueFull, call)
        story.check(
            got is True,
            rule,
            f"{what} was accepted, but {why}"
            if got is False
            else f"{what}: expected QueueFull ({why}), got {type(got).__name__}: {got}",
        )
        story.add(f"{what} -> QueueFull")

    def claimed(what: str) -> Lease:
        lease = fits(f"claim() [{what}]", lambda: queue.claim("w"), "a claim never counts")
        story.check(isinstance(lease, Lease), rule, f"claim() returned {lease!r}: {what} is due")
        assert isinstance(lease, Lease)
        return lease

    a = fits("enqueue('a', key 'a')", lambda: queue.enqueue("a", idempotency_key="a"), "empty")
    full("enqueue('b')", lambda: queue.enqueue("b"), "a is READY: one unfinished job")
    again = fits(
        "enqueue('a again', key 'a')",
        lambda: queue.enqueue("a again", idempotency_key="a"),
        "a full queue still answers a deduplicated enqueue: it creates nothing",
    )
    story.check(again == a, rule, f"the deduplicated enqueue returned {again!r}, not a's id")
    lease_a = claimed("a")
    full("enqueue('b')", lambda: queue.enqueue("b"), "a is LEASED, unfinished: it still counts")
    fits(f"cancel({a!r})", lambda: queue.cancel(a), "cancel never adds a job")
    b = fits(
        "enqueue('b')",
        lambda: queue.enqueue("b"),
        "a was cancelled while LEASED: CANCELLED is finished, its place is free",
    )
    story.check(
        b != a and lease_a.job_id == a, rule, f"enqueue returned {b!r}, the id of a finished job"
    )
    fits("nack(b's lease)", lambda: queue.nack(claimed("b"), "boom"), "nack never adds a job")
    fits("enqueue('c')", lambda: queue.enqueue("c"), "b is DEAD (max_attempts=1): finished")
    lease_c = claimed("c")
    full(f"redrive({b!r})", lambda: queue.redrive(b), "c is LEASED: one unfinished job")
    dead = [job.id for job in queue.dead_letters()]
    story.check(dead == [b], rule, f"a refused redrive changed the dead letters: {dead}")
    fits("release(c's lease)", lambda: queue.release(lease_c), "release never adds a job")
    full(f"redrive({b!r})", lambda: queue.redrive(b), "c is READY again: one unfinished job")
    claimed("c again")
    pass_time(lease_ns)
    story.add(f"the clock moves by lease_ns ({lease_ns}): c's lease expires, c is DEAD")
    fits(f"redrive({b!r})", lambda: queue.redrive(b), "c died by expiry: nothing is unfinished")
    full("enqueue('d')", lambda: queue.enqueue("d"), "the redriven b is READY: it counts again")
    fits(f"cancel({b!r})", lambda: queue.cancel(b), "cancel never adds a job")
    d = fits(
        "enqueue('d', due in an hour)",
        lambda: queue.enqueue("d", run_at_ns=now_ns() + LATER_NS),
        "b was cancelled while READY: nothing is unfinished",
    )
    full("enqueue('e')", lambda: queue.enqueue("e"), "d is SCHEDULED: one unfinished job")
    fits(f"cancel({d!r})", lambda: queue.cancel(d), "cancel never adds a job")
    fits("enqueue('e')", lambda: queue.enqueue("e"), "d was cancelled while SCHEDULED")
    fits("ack(e's lease)", lambda: queue.ack(claimed("e")), "ack never adds a job")
    fits("enqueue('f')", lambda: queue.enqueue("f"), "e SUCCEEDED: nothing is unfinished")
