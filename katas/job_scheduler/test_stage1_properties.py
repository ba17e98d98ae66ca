"""Stage 1 suite, properties: the job queue driven by drawn workloads (see
katas/job_scheduler/README.md).

The examples that read like the prompt are in ``test_stage1.py`` (core) and
``test_stage1_extended.py``. Here: a client that knows from its own calls what the
queue must do (:mod:`katas.job_scheduler._testing.clients`), every retry mode through
both kinds of failure, and state machines that compare the queue with the exact model
(:mod:`katas.job_scheduler._testing.model`), written from the rules. The machines'
rules are declared once: hypothesis runs them step by step (after fixed walks through
the boundaries, :mod:`katas._harness.walks`), and whole drawn lists of them run again
through drivers derived from the same rules (:mod:`katas._harness.machines`).

Map: properties over a client's workloads (never-early, claim-order,
future-does-not-block, lease-live, claim-counts, stale-changes-nothing, dead-at-max,
unique-ids, failed-attempt, next-due) · backoff in every jitter mode (backoff-formula,
decorrelated, one-draw, backoff-from-failure) · the exact model, core (``MODEL_RULES``)
and extended (``EXTENDED_MODEL_RULES``).
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from katas._harness import marks
from katas._harness.machines import Driver
from katas._harness.marks import core, extended
from katas._harness.story import Story, differences
from katas._harness.under_test import stage
from katas._harness.walks import Drawn, Step, Walk, walked
from katas.job_scheduler._testing.clients import (
    WORKERS,
    Client,
    Op,
    ran,
    workloads,
)
from katas.job_scheduler._testing.model import Model
from katas.job_scheduler._testing.queues import (
    BASE,
    LEASE,
    START,
    drawn_delays,
    due_claims,
    fail_fast_on_stubs,  # noqa: F401 (autouse)
    held,
    new_queue,
    refusal,
    rel,
)
from katas.job_scheduler._testing.states import DEAD, FINISHED, LEASED, READY, SCHEDULED, SUCCEEDED
from katas.job_scheduler.api import (
    JITTERS,
    Jitter,
    JobNotFound,
    JobQueue,
    Lease,
    ManualClock,
    QueueFull,
    RetryPolicy,
    StaleLease,
)

pytestmark = [pytest.mark.stage(1)]

#: What every core property below is judged on: a drawn workload, max_attempts 1 to 3.
drawn_runs = given(ops=workloads(), max_attempts=st.integers(1, 3))


# --------------------------------------------------------------------------------------
# Properties, core: a client that knows from its own calls what the queue must do
# --------------------------------------------------------------------------------------


@marks.rule("never-early")
@core
@drawn_runs
def test_stage1_never_claims_a_job_before_it_is_due(ops: list[Op], max_attempts: int) -> None:
    client = ran(ops, max_attempts)
    for fact, lease in client.granted():
        job_id = lease.job_id  # unknown, leased or finished: judged by other properties
        client.story.check(
            fact.states.get(job_id) is not SCHEDULED,
            "a job is never claimed before it is due (run_at_ns, then each retry's backoff)",
            f"claim at t={fact.now - START} returned {job_id!r}, due at "
            f"t={rel(fact.dues.get(job_id))}",
        )


@marks.rule("claim-order", "future-does-not-block")
@core
@drawn_runs
def test_stage1_claim_takes_the_highest_priority_then_earliest_due_then_oldest(
    ops: list[Op], max_attempts: int
) -> None:
    client = ran(ops, max_attempts)
    for fact in client.claims:
        got = None if fact.lease is None else fact.lease.job_id
        if got is not None and fact.states.get(got) is not READY:
            continue  # claimed something not READY: judged by the other properties
        client.story.check(
            got == fact.expected,
            "claim leases the READY job with the largest priority, then the earliest due "
            "time, then the smallest sequence number — and returns None only when none is "
            "READY",
            f"claim at t={fact.now - START} returned {got!r}, expected {fact.expected!r}",
        )


@marks.rule("lease-live")
@core
@drawn_runs
def test_stage1_at_most_one_live_lease_per_job(ops: list[Op], max_attempts: int) -> None:
    client = ran(ops, max_attempts)
    for fact, lease in client.granted():
        client.story.check(
            fact.states.get(lease.job_id) is not LEASED,
            "a job has at most one live lease: it is not claimed again until its "
            "lease is acked, nacked or expired",
            f"claim at t={fact.now - START} leased {lease.job_id!r} again while "
            f"token {fact.tokens.get(lease.job_id)} was still live",
        )


#: Every kind of stale lease, each at its boundary: expired at the very instant of its
#: expiry, superseded by a newer claim of the same job (ack and nack), already answered.
STALE_LEASES = [
    ("enqueue", 0, None),
    ("claim", "w1"),
    ("advance", LEASE),
    ("ack", 0),  # token 1 at its expiry instant: expired
    ("advance", BASE),
    ("claim", "w2"),  # token 2: the retry, due BASE after the expiry
    ("ack", 1),  # token 1 again: superseded
    ("nack", 1),
    ("ack", 0),  # token 2: live, accepted
    ("ack", 0),  # token 2 again: already answered
]


@marks.rule("claim-counts", "stale-changes-nothing")
@core
@drawn_runs
@example(ops=STALE_LEASES, max_attempts=3)
def test_stage1_fencing_tokens_grow_and_stale_leases_change_nothing(
    ops: list[Op], max_attempts: int
) -> None:
    client = ran(ops, max_attempts)
    for fact, lease in client.granted():
        if lease.job_id in fact.tokens:
            previous = fact.tokens[lease.job_id]
            client.story.check(
                lease.token > previous,
                "every claim of a job issues a larger fencing token than the last",
                f"claim at t={fact.now - START} issued token {lease.token} for "
                f"{lease.job_id!r}, whose previous token was {previous}",
            )
    for answer in client.answers:
        where = f"{answer.kind} at t={answer.now - START} with token {answer.lease.token}"
        if answer.live:
            client.story.check(
                not answer.raised,
                "a live lease (latest token, not expired, not yet answered) is accepted",
                f"{where} raised StaleLease",
            )
        else:
            client.story.check(
                answer.raised,
                "a lease that is not live (superseded, expired or already answered) is "
                "rejected with StaleLease",
                f"{where} of {answer.lease.job_id!r} was accepted",
            )
            client.story.check(
                answer.before == answer.after,
                "a rejected lease changes nothing",
                f"{where}: {differences(answer.before, answer.after)}",
            )


@marks.rule("claim-counts", "dead-at-max")
@core
@drawn_runs
def test_stage1_attempts_are_counted_at_claim_and_the_job_dies_at_max_attempts(
    ops: list[Op], max_attempts: int
) -> None:
    def judge(client: Client, now: int) -> None:
        for seen in client.jobs.values():
            state, _ = client.state(seen, now)
            job = held(client.queue, seen.id)
            got = None if job is None else (job.attempts, job.state is DEAD)
            want = (len(seen.leases), state is DEAD)
            client.story.check(
                got == want,
                "attempts count claims (a crash costs one), and a job is DEAD exactly "
                f"when attempt max_attempts={max_attempts} has failed",
                f"{seen.id!r}: (attempts, dead) expected {want}, got {got}",
            )

    client = ran(ops, max_attempts, judge)
    for _, lease in client.granted():
        if lease.job_id in client.jobs:
            earlier = [le for le in client.jobs[lease.job_id].leases if le.token < lease.token]
            client.story.check(
                lease.attempt == len(earlier) + 1,
                "a lease's attempt is the number of claims of its job so far",
                f"{lease} follows {len(earlier)} earlier claims",
            )


@marks.rule("unique-ids", "failed-attempt", "lease-live")
@core
@drawn_runs
def test_stage1_conservation_every_job_is_in_exactly_the_state_its_history_says(
    ops: list[Op], max_attempts: int
) -> None:
    def judge(client: Client, now: int) -> None:
        client.story.check(
            not client.duplicate_ids,
            "job ids are unique",
            f"enqueue returned {client.duplicate_ids[:1]} twice",
        )
        for fact in client.claims:
            client.story.check(
                fact.lease is None or fact.lease.job_id in client.jobs,
                "claim only returns enqueued jobs",
                f"got {fact.lease}",
            )
        for seen in client.jobs.values():
            want, _ = client.state(seen, now)
            job = held(client.queue, seen.id)
            assert job is not None, client.story.tell(
                "nothing vanishes", f"get({seen.id!r}) raised JobNotFound (state should be {want})"
            )
            client.story.check(
                job.state is want,
                "every job is in exactly the state its history gives it",
                f"{seen.id!r} is {job.state}, expected {want}",
            )

    ran(ops, max_attempts, judge)


@marks.rule("next-due")
@core
@drawn_runs
def test_stage1_next_due_ns_is_when_the_next_claim_can_succeed(
    ops: list[Op], max_attempts: int
) -> None:
    def judge(client: Client, now: int) -> None:
        want, got = client.expected_next_due(now), client.queue.next_due_ns()
        client.story.check(
            got == want,
            "next_due_ns() is now if a job is READY, else the earliest run time of a "
            "SCHEDULED job or expiry of a live lease, else None",
            f"expected {rel(want)}, got {rel(got)} (relative to start)",
        )

    ran(ops, max_attempts, judge)


@marks.rule("next-due", "dead-at-max")
@core
@given(
    ops=workloads(),
    max_attempts=st.integers(1, 4),
    outcomes=st.lists(st.sampled_from(["ack", "nack", "crash"]), min_size=1, max_size=8),
)
def test_stage1_liveness_every_job_finishes(
    ops: list[Op], max_attempts: int, outcomes: list[str]
) -> None:
    client = ran(ops, max_attempts)
    queue, clock = client.queue, client.clock
    budget = 3 * max_attempts * (len(client.jobs) + 1) + 10
    for step, lease in due_claims(queue, clock, "drainer", budget):
        outcome = outcomes[step % len(outcomes)]
        if outcome == "ack":
            queue.ack(lease)
        elif outcome == "nack":
            queue.nack(lease, "failed again")
        client.story.add(f"drain: claim -> {lease.job_id!r} attempt {lease.attempt}, {outcome}")
    unfinished = {
        seen.id: job.state
        for seen in client.jobs.values()
        if (job := queue.get(seen.id)).state not in (SUCCEEDED, DEAD)
    }
    assert not unfinished, client.story.tell(
        "liveness: a worker that keeps claiming at next_due_ns() finishes every job "
        "(SUCCEEDED or DEAD within max_attempts)",
        f"still unfinished after {budget} drain steps: {unfinished}; next_due_ns() = "
        f"{rel(queue.next_due_ns())}",
    )


@marks.rule("backoff-formula", "decorrelated", "one-draw", "backoff-from-failure")
@core
@given(
    jitter=st.sampled_from(JITTERS),
    base=st.integers(0, 400),
    extra=st.integers(0, 3000),
    seed=st.integers(0, 2**32),
    failures=st.lists(st.sampled_from(["nack", "crash"]), min_size=1, max_size=7),
)
# Every mode on every run, each through both kinds of failure, up to the cap: a
# decorrelated delay grows from the one before, and caps before it is kept.
@example(jitter="decorrelated", base=100, extra=1_500, seed=7, failures=["nack", "crash"] * 3)
@example(jitter="full", base=100, extra=1_500, seed=7, failures=["nack", "crash"] * 3)
@example(jitter="equal", base=100, extra=1_500, seed=7, failures=["crash", "nack"] * 3)
@example(jitter="none", base=100, extra=1_500, seed=7, failures=["nack", "crash"] * 3)
# An odd d (base 3, cap 7): equal jitter's halves are d // 2 and rng.randrange(d // 2 + 1),
# not the "other half" rounded up. Random(5) draws a different first delay for the two.
@example(jitter="equal", base=3, extra=4, seed=5, failures=["nack", "crash"] * 3)
def test_stage1_backoff_delays_follow_the_formula_for_each_jitter_mode(
    jitter: Jitter, base: int, extra: int, seed: int, failures: list[str]
) -> None:
    policy = RetryPolicy(base, base + extra, jitter)
    rng = random.Random(seed)
    clock, queue = new_queue(
        jitter=jitter, base=base, cap=base + extra, rng=rng, max_attempts=len(failures) + 1
    )
    job_id = queue.enqueue("flaky")
    twin = random.Random(seed)
    want = drawn_delays(policy, twin, list(range(1, len(failures) + 1)))
    story = Story(f"{policy}, rng=Random({seed}):", clock.now_ns, START)
    for n, how in enumerate(failures, start=1):
        lease = queue.claim("w")
        assert lease is not None, story.tell("a retry is claimable at its due time", "got None")
        if how == "nack":
            clock.advance(7)
            queue.nack(lease, "boom")
            failed_at = clock.now_ns()
        else:
            clock.advance(LEASE)
            failed_at = lease.expires_at_ns
        story.add(f"claim, {how} attempt {n}")
        got = queue.get(job_id).run_at_ns - failed_at
        story.check(
            got == want[n - 1],
            f"the delay after failed attempt n is exactly the {jitter!r} formula with one "
            "rng draw per retry",
            f"after attempt {n}: expected delay {want[n - 1]}, got {got}",
        )
        clock.set(max(clock.now_ns(), failed_at + got))
    story.check(
        rng.getstate() == twin.getstate(),
        "each jittered retry makes exactly one rng call ('none' makes none)",
        f"the queue's rng did not advance as {len(failures)} retries' draws do",
    )


# --------------------------------------------------------------------------------------
# The exact model, written from the rules, and the state machines that use it
# --------------------------------------------------------------------------------------


SETUPS: dict[str, st.SearchStrategy[Any]] = {
    "jitter": st.sampled_from(JITTERS),
    "base": st.sampled_from([0, 1, 100, 250]),
    "extra": st.sampled_from([0, 300, 5_000]),
    "max_attempts": st.integers(1, 4),
    "seed": st.integers(0, 2**16),
    "lease_ns": st.sampled_from([500, 1_000]),
    "data": st.data(),
}


class QueueMachine(RuleBasedStateMachine):
    """A queue and its exact model under random operations, compared at every step.

    Observation is a rule, not an invariant: ``get`` settles what is due, and observing
    after every step would hide an operation that forgets to settle first.
    """

    extended = False

    @initialize(
        jitter=SETUPS["jitter"],
        base=SETUPS["base"],
        extra=SETUPS["extra"],
        max_attempts=SETUPS["max_attempts"],
        seed=SETUPS["seed"],
        lease_ns=SETUPS["lease_ns"],
        data=SETUPS["data"],
    )
    def build(
        self, jitter: Jitter, base: int, extra: int, max_attempts: int, seed: int,
        lease_ns: int, data: st.DataObject,
    ) -> None:  # fmt: skip
        self.clock = ManualClock(START)
        retry = RetryPolicy(base, base + extra, jitter)
        options: dict[str, Any] = {}
        if self.extended:
            options = {
                "dedup_ttl_ns": data.draw(st.sampled_from([0, 700, 5_000]), label="dedup_ttl_ns"),
                "retention_ns": data.draw(st.sampled_from([0, 800, 4_000]), label="retention_ns"),
                "max_pending": data.draw(st.sampled_from([None, 2, 5]), label="max_pending"),
            }
        self.queue: JobQueue = stage().JobQueue(
            clock=self.clock, lease_ns=lease_ns, retry=retry, max_attempts=max_attempts,
            rng=random.Random(seed), **options,
        )  # fmt: skip
        self.model = Model(
            lease_ns=lease_ns, retry=retry, max_attempts=max_attempts, seed=seed, **options
        )
        self.ids: dict[int, str] = {}  # model seq -> the queue's job id
        self.leases: list[tuple[int, Lease]] = []  # (model seq, lease) ever issued
        self.story = Story(
            f"JobQueue(lease_ns={lease_ns}, retry={retry}, max_attempts={max_attempts}, "
            f"rng=Random({seed}){''.join(f', {k}={v}' for k, v in options.items())}):",
            self.clock.now_ns,
            START,
        )
        first = st.tuples(st.integers(-1, 2), st.sampled_from([None, 0, 300]))
        for priority, when in data.draw(st.lists(first, min_size=1, max_size=4), label="jobs"):
            self.enqueue(priority, when, None)

    def now(self) -> int:
        return self.clock.now_ns()

    def accepted(self, what: str, call: Callable[[], Any]) -> Any:
        """``call()``, which the model says must succeed: a queue error fails the test."""
        try:
            return call()
        except (StaleLease, JobNotFound, QueueFull) as error:
            raise AssertionError(
                self.story.tell(
                    "the queue and its exact model disagree",
                    f"{what} raised {type(error).__name__}: {error}; the model accepts it",
                )
            ) from None

    def check(self, what: str, expected: Any, got: Any) -> None:
        self.story.check(
            got == expected,
            "the queue and its exact model disagree",
            f"{what}: {differences(expected, got)}",
        )

    def refused(self, error: type[Exception], what: str, call: Callable[[], Any], why: str) -> None:
        """``call()`` must raise ``error`` (the model says so, because ``why``)."""
        got = refusal(error, call)
        if isinstance(got, Exception):
            raise AssertionError(
                self.story.tell(
                    "the queue and its exact model disagree",
                    f"{what}: expected {error.__name__} ({why}), got {type(got).__name__}: {got}",
                )
            )
        if not got:
            raise AssertionError(
                self.story.tell(
                    "the queue and its exact model disagree",
                    f"{what} was accepted; expected {error.__name__} ({why})",
                )
            )

    def why_refused(self, seq: int, lease: Lease) -> str:
        """Why the model refuses ``lease`` now, in words."""
        job = self.model.jobs.get(seq)
        if job is None:
            return "its job was forgotten after its retention"
        if job.token != lease.token:
            return f"superseded: the job's latest token is {job.token}"
        if job.state in FINISHED:
            return f"its job is {job.state.value} already"
        if self.now() >= lease.expires_at_ns:
            return f"it expired at {rel(lease.expires_at_ns)}; the job is {job.state.value}"
        return f"it was answered already; the job is {job.state.value}"

    # --- core rules ---------------------------------------------------------------------
    @rule(
        priority=st.integers(-1, 2),
        when=st.one_of(st.none(), st.sampled_from([-200, 0, 1, 300, 1_200])),
        key=st.one_of(st.none(), st.sampled_from(["k1", "k2"])),
    )
    def enqueue(self, priority: int, when: int | None, key: str | None) -> None:
        key = key if self.extended else None
        run_at = None if when is None else self.now() + when
        payload = {"n": self.model.enqueued + 1}
        expected = self.model.enqueue(payload, priority, run_at, key, self.now())
        call = f"enqueue({payload}, priority={priority}, run_at_ns={rel(run_at)}, key={key!r})"
        if expected is None:
            self.refused(
                QueueFull,
                call,
                lambda: self.queue.enqueue(
                    payload, priority=priority, run_at_ns=run_at, idempotency_key=key
                ),
                f"max_pending={self.model.max_pending} unfinished jobs are held",
            )
            self.story.add(f"{call} -> QueueFull")
            return
        got = self.accepted(
            call,
            lambda: self.queue.enqueue(
                payload, priority=priority, run_at_ns=run_at, idempotency_key=key
            ),
        )
        self.story.add(f"{call} -> {got!r}")
        if expected in self.ids:
            self.check(f"{call} (a key seen within its TTL)", self.ids[expected], got)
        else:
            self.story.check(got not in self.ids.values(), "job ids are unique", f"{got!r} reused")
            self.ids[expected] = got

    @rule(worker=st.sampled_from(WORKERS))
    def claim(self, worker: str) -> None:
        job = self.model.claim(worker, self.now())
        got = self.accepted(f"claim({worker!r})", lambda: self.queue.claim(worker))
        self.story.add(f"claim({worker!r}) -> {got}")
        if job is None:
            self.check(f"claim({worker!r})", None, got)
            return
        self.check(
            f"claim({worker!r})",
            Lease(self.ids[job.seq], job.token, job.attempts, job.expires, worker),  # type: ignore[arg-type]
            got,
        )
        self.leases.append((job.seq, got))

    def answer(
        self, name: str, i: int, call: Callable[[Lease], Any], apply: Callable[[int], Any]
    ) -> Any:
        """Present lease number ``i`` (from the newest) to ``call``; the model decides."""
        seq, lease = self.leases[-1 - i % len(self.leases)]
        verdict = self.model.live(seq, lease.token, self.now())
        text = f"{name}(token {lease.token} of {lease.job_id!r})"
        if verdict == "ok":
            got = self.accepted(text, lambda: call(lease))
            self.story.add(f"{text} -> {got}")
            return got, apply(seq)
        error = StaleLease if verdict == "stale" else JobNotFound
        self.refused(error, text, lambda: call(lease), self.why_refused(seq, lease))
        self.story.add(f"{text} -> {error.__name__}")
        return None

    @precondition(lambda self: self.leases)
    @rule(i=st.integers(0, 5), result=st.sampled_from([None, 7]))
    def ack(self, i: int, result: Any) -> None:
        self.answer(
            "ack",
            i,
            lambda le: self.queue.ack(le, result),
            lambda s: self.model.ack(s, result, self.now()),
        )

    @precondition(lambda self: self.leases)
    @rule(i=st.integers(0, 5), error=st.sampled_from(["boom", "timeout"]))
    def nack(self, i: int, error: str) -> None:
        self.answer(
            "nack",
            i,
            lambda le: self.queue.nack(le, error),
            lambda s: self.model.nack(s, error, self.now()),
        )

    @precondition(lambda self: self.leases)
    @rule(i=st.integers(0, 5), how=st.sampled_from(["ack", "nack", "heartbeat", "release"]))
    def answer_at_expiry(self, i: int, how: str) -> None:
        """Move the clock to a lease's expiry (if still ahead) and answer at once: the
        queue must settle the expiry before it looks at the lease."""
        expires = self.leases[-1 - i % len(self.leases)][1].expires_at_ns
        if expires > self.now():
            self.story.add(f"advance({expires - self.now()})")
            self.clock.set(expires)
        if how == "nack":
            self.nack(i, "late")
        elif how == "ack" or not self.extended:
            self.ack(i, None)
        else:
            getattr(self, how)(i)

    @rule(ns=st.sampled_from([1, 99, 100, 250, 499, 500, 1_000, 3_000]))
    def advance(self, ns: int) -> None:
        self.clock.advance(ns)
        self.story.add(f"advance({ns})")

    @rule()
    def observe(self) -> None:
        self.compare_all()

    def compare_all(self) -> None:
        now = self.now()
        self.model.settle(now)
        for seq, job_id in self.ids.items():
            job = self.model.jobs.get(seq)
            expected = None if job is None else self.model.snapshot(job, job_id)
            self.check(f"get({job_id!r})", expected, held(self.queue, job_id))
        self.check("next_due_ns()", rel(self.model.next_due(now)), rel(self.queue.next_due_ns()))
        if self.extended:
            self.check("statistics()", self.model.statistics(now), self.queue.statistics())
            expected_dead = [
                self.model.snapshot(self.model.jobs[s], self.ids[s]) for s in self.model.died
            ]
            self.check("dead_letters()", expected_dead, self.queue.dead_letters())
        self.story.add(
            "observe: every job, next_due_ns"
            + (", statistics, dead_letters" if self.extended else "")
        )

    def teardown(self) -> None:
        # A final comparison, unless a step already failed (its explanation stands alone).
        if hasattr(self, "queue") and sys.exc_info()[0] is None:
            self.compare_all()


class ExtendedQueueMachine(QueueMachine):
    """The core machine plus heartbeat, release, cancel, redrive, keys, retention, bounds."""

    extended = True

    @precondition(lambda self: self.leases)
    @rule(i=st.integers(0, 5))
    def heartbeat(self, i: int) -> None:
        got = self.answer(
            "heartbeat", i, self.queue.heartbeat, lambda s: self.model.heartbeat(s, self.now())
        )
        if got is not None:
            renewed, expires = got
            _, lease = next(
                (s, le)
                for s, le in self.leases
                if le.job_id == renewed.job_id and le.token == renewed.token
            )
            self.check(
                "heartbeat(...)",
                Lease(lease.job_id, lease.token, lease.attempt, expires, lease.worker_id),
                renewed,
            )

    @precondition(lambda self: self.leases)
    @rule(i=st.integers(0, 5))
    def release(self, i: int) -> None:
        self.answer("release", i, self.queue.release, lambda s: self.model.release(s, self.now()))

    @precondition(lambda self: self.leases)
    @rule(i=st.integers(0, 5))
    def is_current(self, i: int) -> None:
        seq, lease = self.leases[-1 - i % len(self.leases)]
        expected = self.model.live(seq, lease.token, self.now()) == "ok"
        self.check(
            f"is_current(token {lease.token} of {lease.job_id!r})",
            expected,
            self.queue.is_current(lease),
        )

    def pick(self, i: int) -> tuple[int, str]:
        seq = sorted(self.ids)[i % len(self.ids)]
        return seq, self.ids[seq]

    @precondition(lambda self: self.ids)
    @rule(i=st.integers(0, 20))
    def cancel(self, i: int) -> None:
        seq, job_id = self.pick(i)
        expected = self.model.cancel(seq, self.now())
        if expected is None:
            self.refused(
                JobNotFound,
                f"cancel({job_id!r})",
                lambda: self.queue.cancel(job_id),
                "the job was forgotten after its retention",
            )
            self.story.add(f"cancel({job_id!r}) -> JobNotFound")
            return
        got = self.accepted(f"cancel({job_id!r})", lambda: self.queue.cancel(job_id))
        self.story.add(f"cancel({job_id!r}) -> {got}")
        self.check(f"cancel({job_id!r})", expected, got)

    @precondition(lambda self: self.ids)
    @rule(i=st.integers(0, 20))
    def redrive(self, i: int) -> None:
        seq, job_id = self.pick(i)
        expected = self.model.redrive(seq, self.now())
        if expected is None or expected == "full":
            error = JobNotFound if expected is None else QueueFull
            why = (
                "the job was forgotten after its retention"
                if expected is None
                else f"max_pending={self.model.max_pending} unfinished jobs are held"
            )
            self.refused(error, f"redrive({job_id!r})", lambda: self.queue.redrive(job_id), why)
            self.story.add(f"redrive({job_id!r}) -> {error.__name__}")
            return
        got = self.accepted(f"redrive({job_id!r})", lambda: self.queue.redrive(job_id))
        self.story.add(f"redrive({job_id!r}) -> {got}")
        self.check(f"redrive({job_id!r})", expected, got)


#: What the machines check: every core rule a random run reaches, and the extended ones.
MODEL_RULES = (
    "claim-order", "never-early", "claim-counts", "lease-live", "stale-changes-nothing",
    "failed-attempt", "backoff-from-failure", "dead-at-max", "backoff-formula", "decorrelated",
    "one-draw", "settle-first", "expiry-order", "next-due", "snapshot",
)  # fmt: skip
EXTENDED_MODEL_RULES = (
    "heartbeat", "heartbeat-never-revives", "release", "cancel", "cancel-finished",
    "dead-letters", "redrive", "redrive-keeps-token", "idempotency", "dedup-ttl-from-first",
    "retention", "max-pending", "full-queue-dedups", "statistics", "is-current",
    "lease-unknown-job",
)  # fmt: skip


def _setup(extended: bool) -> Step:
    """Decorrelated jitter from 100 ns, three attempts, leases of 1 000 ns; a job due now
    and a more urgent one due in 300 ns (and, extended: keys live 700 ns, finished jobs
    800 ns, at most 2 unfinished)."""
    options = (700, 800, 2) if extended else ()
    jobs = [(0, None), (1, 300)]
    return ("build", {
        "jitter": "decorrelated", "base": 100, "extra": 5_000, "max_attempts": 3, "seed": 7,
        "lease_ns": 1_000, "data": Drawn(*options, jobs),
    })  # fmt: skip


def _answer(how: str, i: int = 0) -> Step:
    arguments: dict[str, Any] = {"i": i}
    if how == "ack":
        arguments["result"] = 7
    elif how == "nack":
        arguments["error"] = "boom"
    return (how, arguments)


_OBSERVE: Step = ("observe", {})


def life(extended: bool) -> Walk:
    """Two jobs' lives at their boundaries, on every run of the model tests: one answered
    at the very instant its lease expires (the expiry settles first), superseded by its
    retry and dead by expiry at its third attempt; the other, more urgent once due, nacked
    and then answered at its expiry instant."""
    return [
        _setup(extended), ("claim", {"worker": "w1"}),
        ("answer_at_expiry", {"i": 0, "how": "ack"}), _OBSERVE, ("advance", {"ns": 3_000}),
        ("claim", {"worker": "w2"}), ("claim", {"worker": "w1"}), _answer("ack", 2),
        _answer("nack", 1), _OBSERVE, ("advance", {"ns": 3_000}), ("claim", {"worker": "w2"}),
        ("claim", {"worker": "w1"}), ("advance", {"ns": 1_000}), _OBSERVE, _answer("ack", 0),
        _answer("nack", 1), _OBSERVE,
    ]  # fmt: skip


_SWEEP: list[Step] = [("claim", {"worker": "w1"}), ("claim", {"worker": "w2"}),
                      ("advance", {"ns": 1_000}), ("advance", {"ns": 5_000})]  # fmt: skip
#: The extended rules at theirs: a full queue refuses; a heartbeat 1 ns before the expiry
#: extends the lease; a release refunds its attempt; a key dedups for its TTL from its
#: first use, not from the duplicates; a finished job is forgotten exactly at its
#: retention; a job dead at max_attempts is listed and redriven with its token; a cancel.
EXTENDED: Walk = [
    _setup(True), ("enqueue", {"priority": 0, "when": None, "key": "k1"}),
    ("claim", {"worker": "w1"}), ("advance", {"ns": 999}), ("heartbeat", {"i": 0}),
    ("answer_at_expiry", {"i": 0, "how": "heartbeat"}), ("is_current", {"i": 0}), _OBSERVE,
    ("advance", {"ns": 3_000}), ("claim", {"worker": "w2"}), ("release", {"i": 0}),
    ("is_current", {"i": 0}), ("claim", {"worker": "w1"}), _answer("ack", 0),
    ("enqueue", {"priority": 2, "when": 0, "key": "k1"}), ("advance", {"ns": 350}),
    ("enqueue", {"priority": 2, "when": 0, "key": "k1"}), ("advance", {"ns": 350}),
    ("enqueue", {"priority": 2, "when": 0, "key": "k1"}), ("advance", {"ns": 100}), _OBSERVE,
    *_SWEEP, *_SWEEP[:3], _OBSERVE, ("redrive", {"i": 0}), ("cancel", {"i": 2}),
    ("advance", {"ns": 800}), _OBSERVE,
]  # fmt: skip

TestStage1JobQueueModel = marks.rule(*MODEL_RULES)(
    core(walked(QueueMachine, {"two jobs' lives": life(False)}))
)
TestStage1JobQueueExtendedModel = marks.rule(*EXTENDED_MODEL_RULES)(
    extended(walked(ExtendedQueueMachine, {"two jobs' lives": life(True), "extended": EXTENDED}))
)


#: The machines driven a second way: whole lists of steps drawn at once, from the
#: machines' own rules (see katas/_harness/machines.py), so that no rule goes unrun here.
QUEUE_STEPS = Driver(QueueMachine)
EXTENDED_QUEUE_STEPS = Driver(ExtendedQueueMachine)


@marks.rule(*MODEL_RULES)
@core
@given(steps=QUEUE_STEPS.steps(min_size=10, max_size=60), **SETUPS)
def test_stage1_queue_matches_its_exact_model_step_by_step(steps: list[Step], **setup: Any) -> None:
    QUEUE_STEPS.run(steps, **setup)


@marks.rule(*EXTENDED_MODEL_RULES)
@extended
@given(steps=EXTENDED_QUEUE_STEPS.steps(min_size=10, max_size=60), **SETUPS)
def test_stage1_extended_queue_matches_its_exact_model_step_by_step(
    steps: list[Step], **setup: Any
) -> None:
    EXTENDED_QUEUE_STEPS.run(steps, **setup)
