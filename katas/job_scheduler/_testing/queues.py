"""Building a stage-1 job queue on a test clock, and the small checks the suites share:
claiming, refusals, reading a job back, due times with no jitter."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import pytest

from katas._harness.under_test import stage
from katas.job_scheduler.api import (
    EffectStore,
    Jitter,
    Job,
    JobNotFound,
    JobQueue,
    Lease,
    ManualClock,
    QueueFull,
    RetryPolicy,
    StaleLease,
)

START = 1_000_000  # the clock's start; messages show times relative to it
LEASE = 1_000
BASE = 100
CAP = 1_600
SEED = 20240601


@pytest.fixture(autouse=True)
def fail_fast_on_stubs(stage_module: ModuleType) -> None:
    """Build one queue before anything else: on a stub this fails at once with "not
    implemented yet: ..." instead of letting hypothesis shrink a Todo. A stage-1 suite
    file imports it, which makes it autouse there. (State machines, being unittest
    classes, also find the stage module here.)"""
    stage_module.JobQueue(
        clock=ManualClock(START), lease_ns=LEASE, retry=RetryPolicy(BASE, CAP), max_attempts=1
    )


def rel(t: int | None) -> int | None:
    """A time as messages show it: since the clock's start."""
    return None if t is None else t - START


def new_queue(
    *,
    jitter: Jitter = "none",
    base: int = BASE,
    cap: int = CAP,
    seed: int = SEED,
    **overrides: Any,
) -> tuple[ManualClock, JobQueue]:
    """A queue on a frozen ManualClock: lease 1000, backoff 100·2^(n-1) capped at 1600."""
    clock = ManualClock(START)
    kwargs: dict[str, Any] = {
        "clock": clock,
        "lease_ns": LEASE,
        "retry": RetryPolicy(base, cap, jitter),
        "max_attempts": 3,
        "rng": random.Random(seed),
    }
    kwargs.update(overrides)
    queue: JobQueue = stage().JobQueue(**kwargs)
    return clock, queue


def memory_store(queue: JobQueue) -> EffectStore:
    """The implementation's ``MemoryEffectStore`` over ``queue``."""
    store: EffectStore = stage().MemoryEffectStore(queue)
    return store


def delay_none(n: int, base: int = BASE, cap: int = CAP) -> int:
    """The un-jittered backoff after failed attempt n, straight from the formula."""
    return min(cap, base * int(2 ** (n - 1)))


def drawn_delays(
    policy: RetryPolicy, seed: int | random.Random, failed_attempts: list[int]
) -> list[int]:
    """The delays the rules prescribe for one job failing attempts n1, n2, … in turn,
    drawn from ``Random(seed)`` (or from the Random given)."""
    rng = seed if isinstance(seed, random.Random) else random.Random(seed)
    out, prev = [], policy.base_ns
    for n in failed_attempts:
        d = min(policy.cap_ns, policy.base_ns * int(2 ** (n - 1)))
        if policy.jitter == "none":
            out.append(d)
        elif policy.jitter == "full":
            out.append(rng.randrange(d + 1))
        elif policy.jitter == "equal":
            out.append(d // 2 + rng.randrange(d // 2 + 1))
        else:
            prev = min(policy.cap_ns, rng.randrange(policy.base_ns, 3 * prev + 1))
            out.append(prev)
    return out


def claim(queue: JobQueue, worker: str = "w") -> Lease:
    """``queue.claim(worker)``, which must return a lease here."""
    lease = queue.claim(worker)
    assert isinstance(lease, Lease), (
        f"claim({worker!r}) returned {lease!r}, but a job is READY here"
    )
    return lease


def due_claims(
    queue: JobQueue, clock: ManualClock, worker: str, rounds: int
) -> Iterator[tuple[int, Lease]]:
    """A worker that keeps claiming at ``next_due_ns()``: up to ``rounds`` times, move the
    clock to the next due time (never back) and claim there, yielding ``(round, lease)``
    for each job it gets; it stops as soon as nothing is due any more."""
    for round_ in range(rounds):
        due = queue.next_due_ns()
        if due is None:
            return
        clock.set(max(due, clock.now_ns()))
        lease = queue.claim(worker)
        if lease is not None:
            yield round_, lease


def refusal(error: type[Exception], call: Callable[[], Any]) -> Exception | bool:
    """Run ``call()``, which must raise ``error``: True when it does, the queue's other
    refusal when it raises that instead, False when it is accepted."""
    try:
        call()
    except error:
        return True
    except (StaleLease, JobNotFound, QueueFull) as other:
        return other
    return False


def rejects(error: type[Exception], call: Callable[[], Any], message: str) -> None:
    """``call()`` must raise ``error``; if it returns, fail with ``message``."""
    got = refusal(error, call)
    if isinstance(got, Exception):
        raise AssertionError(
            f"{message.replace(' was accepted', '')}: expected {error.__name__}, got "
            f"{type(got).__name__}: {got}"
        )
    if not got:
        raise AssertionError(f"{message} (expected {error.__name__})")


def held(queue: JobQueue, job_id: str) -> Job | None:
    """``queue.get(job_id)``, or None if the queue says JobNotFound."""
    try:
        job: Job = queue.get(job_id)
    except JobNotFound:
        return None
    return job
