"""Stage 1 benchmarks: collected only when this file is named on the command line.

    python -m pytest katas/job_scheduler/bench_stage1.py --impl=solutions --benchmark-only -q

Each group runs its contenders — the implementation under test (``--impl``), the
reference, and the floor a user would compare against: bare ``heapq`` push+pop of
``(priority, run_at, seq, id)`` tuples — in turn within every round (each round starting
with the next one), so that drift on a shared machine hits them alike, and reports the
ratios of each one's best round in ``extra_info`` (``--benchmark-json``, which ``kata
bench`` reads) and on stdout (printed even without ``-s``). The spec's targets —
informational, benchmarks never fail CI:

- enqueue + claim + ack with 100 000 jobs queued: >= 0.15x the pairs/s of the bare heap
  (lean mutable records reach about 0.2x; frozen dataclasses rebuilt with ``replace``
  and uuid4 ids about 0.07x).
- growth: the cost of enqueue + claim + ack with 64 000 jobs queued <= 3x its cost with
  1 000 (every step is O(log n), no scans).
"""

from __future__ import annotations

import heapq
import math
import random
from types import ModuleType
from typing import Any

import pytest

from katas._harness.bench import Contender, interleaved, report
from katas._registry import impl as _impl
from katas.job_scheduler.api import NS_PER_S, RetryPolicy

pytestmark = [pytest.mark.stage(1), pytest.mark.core]

QUEUED = 100_000
OPS = 5_000  # enqueue + claim + ack triples per round
ROUNDS = 15


@pytest.fixture(scope="module")
def reference() -> ModuleType:
    """The reference stage 1, whatever ``--impl`` says."""
    return _impl.resolve("solutions").stage("job_scheduler", 1)


class FrozenClock:
    """A clock that costs nothing to read and never moves: no lease ever expires."""

    def __init__(self) -> None:
        self.t = 1_000 * NS_PER_S

    def now_ns(self) -> int:
        return self.t


def priorities(n: int) -> list[int]:
    return [random.Random(7 + i).randrange(10) for i in range(n)]


def queue_run(stage: ModuleType, queued: int) -> Contender:
    """A queue holding ``queued`` READY jobs; each round enqueues, claims and acks OPS jobs,
    so the queue keeps its size. Finished jobs are forgotten at once (retention 0)."""
    queue = stage.JobQueue(
        clock=FrozenClock(),
        lease_ns=3_600 * NS_PER_S,
        retry=RetryPolicy(NS_PER_S, 60 * NS_PER_S),
        max_attempts=3,
        rng=random.Random(1),
        retention_ns=0,
    )
    for i, p in enumerate(priorities(queued)):
        queue.enqueue(i, priority=p)
    work = priorities(OPS)
    enqueue, claim, ack = queue.enqueue, queue.claim, queue.ack

    def run() -> None:
        for p in work:
            enqueue(p, priority=p)
            ack(claim("w"))

    return Contender(run, OPS)


def heap_run(queued: int) -> Contender:
    """The floor: a bare heap of ``(priority, run_at, seq, id)`` tuples, push then pop."""
    now = 1_000 * NS_PER_S
    heap = [(-p, now, i, f"job-{i}") for i, p in enumerate(priorities(queued))]
    heapq.heapify(heap)
    work = priorities(OPS)
    seq = [queued]
    push, pop = heapq.heappush, heapq.heappop

    def run() -> None:
        n = seq[0]
        for p in work:
            n += 1
            push(heap, (-p, now, n, f"job-{n}"))
            pop(heap)
        seq[0] = n

    return Contender(run, OPS)


# --- enqueue + claim + ack at 100 000 queued jobs, against the bare heap ----------------


def test_bench_stage1_enqueue_claim_ack_100k_queued(
    benchmark: Any,
    stage_module: ModuleType,
    reference: ModuleType,
    capsys: pytest.CaptureFixture[str],
) -> None:
    benchmark.group = "stage1 enqueue+claim+ack, 100 000 queued (interleaved)"
    per_op = interleaved(
        benchmark,
        {
            "JobQueue": queue_run(stage_module, QUEUED),
            "reference": queue_run(reference, QUEUED),
            "heapq": heap_run(QUEUED),
        },
        rounds=ROUNDS,
    )
    ours = per_op["JobQueue"]
    if math.isnan(ours):  # --benchmark-disable: nothing was measured
        return
    report(benchmark, capsys, "rate_vs_heapq", per_op["heapq"] / ours, ">= 0.15")
    report(benchmark, capsys, "speed_vs_reference", per_op["reference"] / ours, "~1")


# --- growth: cost per operation as the queue grows ----------------------------------------


def test_bench_stage1_cost_as_the_queue_grows(
    benchmark: Any, stage_module: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    benchmark.group = "stage1 enqueue+claim+ack, 1 000 and 64 000 queued (interleaved)"
    per_op = interleaved(
        benchmark,
        {
            "JobQueue 1k": queue_run(stage_module, 1_000),
            "JobQueue 64k": queue_run(stage_module, 64_000),
        },
        rounds=ROUNDS,
    )
    if math.isnan(per_op["JobQueue 1k"]):
        return
    report(
        benchmark,
        capsys,
        "cost_64k_over_1k",
        per_op["JobQueue 64k"] / per_op["JobQueue 1k"],
        "<= 3",
    )
