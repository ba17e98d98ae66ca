"""Stage 2 benchmarks: striped locks against one global lock, under thread contention.

``pytest katas/rate_limiter/bench_stage2.py --impl=solutions --benchmark-only -q``
(collected only when named). Four threads hammer 1 000 keys through
``ThreadSafeLimiter`` (64 stripes, and 1), through the design it replaces — one
``threading.Lock`` around the same stage-1 bucket — and, as the floor, the bare bucket
on one thread. The variants run in turn within every round (each round starting with
the next one), so that drift on a shared machine hits them alike; each one's best round
is reported against the global lock in ``extra_info`` (``--benchmark-json``, which
``kata bench`` reads) and on stdout (printed even without ``-s``). No spec target:
under the GIL, striping buys little throughput — what it buys is that a slow or blocked
key does not stall the others. The numbers show what the wrapper costs. Benchmarks
report, they never fail.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from katas._harness.bench import Contender, interleaved, report, say
from katas.rate_limiter.api import Decision, MonotonicClock

pytestmark = [pytest.mark.stage(2), pytest.mark.extended]

THREADS, PER_THREAD, ROUNDS = 4, 5_000, 7
KEYS = [f"user-{i}" for i in range(1_000)]
#: A thread still running after this long fails the benchmark instead of hanging it.
DEADLINE_S = 60.0


class GlobalLock:
    """The baseline a first attempt writes: every key behind one lock."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._lock = threading.Lock()

    def try_acquire(self, key: str, cost: int = 1) -> Decision:
        with self._lock:
            decision: Decision = self._inner.try_acquire(key, cost)
            return decision


def _bucket(kata: Any) -> Any:
    # A large capacity keeps every decision on the same (admitting) path.
    return kata.stage(1).TokenBucket(
        capacity=10**9, refill_per_s=10**9, clock=MonotonicClock(), auto_sweep=False
    )


def _hammer(call: Callable[[str], object], threads: int) -> Contender:
    """``threads`` threads started together, each making PER_THREAD decisions: a round
    timed from their release (their start is not timed) to the last one's end."""

    def run() -> float:
        barrier = threading.Barrier(threads + 1)

        def work(offset: int) -> None:
            barrier.wait()
            for i in range(PER_THREAD):
                call(KEYS[(offset + i * 7) % len(KEYS)])

        workers = [
            threading.Thread(target=work, args=(n * 13,), daemon=True) for n in range(threads)
        ]
        for w in workers:
            w.start()
        barrier.wait()
        start = time.perf_counter()
        for w in workers:
            w.join(DEADLINE_S)
        took = time.perf_counter() - start
        if any(w.is_alive() for w in workers):
            raise AssertionError(f"a thread is still running after {DEADLINE_S:.0f} s")
        return took

    return Contender(run, threads * PER_THREAD, self_timed=True)


def test_bench_stage2_striped_contention(
    benchmark: Any, kata: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    benchmark.group = f"rate_limiter stage 2, {THREADS} threads on 1 000 keys (interleaved)"
    clock = MonotonicClock()
    striped = kata.stage(2).ThreadSafeLimiter(_bucket(kata), clock=clock, stripes=64)
    one_stripe = kata.stage(2).ThreadSafeLimiter(_bucket(kata), clock=clock, stripes=1)
    per_decision = interleaved(
        benchmark,
        {
            "striped (64)": _hammer(striped.try_acquire, THREADS),
            "one stripe": _hammer(one_stripe.try_acquire, THREADS),
            "global lock": _hammer(GlobalLock(_bucket(kata)).try_acquire, THREADS),
            "bare, 1 thread": _hammer(_bucket(kata).try_acquire, 1),
        },
        rounds=ROUNDS,
    )
    base = per_decision["global lock"]
    if math.isnan(base):  # --benchmark-disable: nothing was measured
        return
    say(
        capsys,
        "decisions/s: " + ", ".join(f"{name} {1 / s:,.0f}" for name, s in per_decision.items()),
    )
    for label, name in (
        ("striped_speed_vs_global_lock", "striped (64)"),
        ("one_stripe_speed_vs_global_lock", "one stripe"),
        ("bare_1_thread_speed_vs_global_lock", "bare, 1 thread"),
    ):
        report(benchmark, capsys, label, base / per_decision[name], "informational")
