"""Stage 2 benchmarks: striped locks against one global lock, under thread contention.

``pytest katas/rate_limiter/bench_stage2.py --impl=solutions -s`` (collected only when
named). Four threads hammer 1 000 keys through ``ThreadSafeLimiter`` (64 stripes) and
through the design it replaces — one ``threading.Lock`` around the same stage-1 bucket.
Under the GIL, striping buys little throughput: what it buys is that a slow or blocked
key does not stall the others. The numbers show what the wrapper costs. Benchmarks
report, they never fail.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from katas.rate_limiter.api import Decision, MonotonicClock

pytestmark = [pytest.mark.stage(2), pytest.mark.extended]

THREADS, PER_THREAD, ROUNDS = 4, 5_000, 7
KEYS = [f"user-{i}" for i in range(1_000)]


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


def _variants(kata: Any) -> dict[str, Callable[[str], object]]:
    clock = MonotonicClock()
    striped = kata.stage(2).ThreadSafeLimiter(_bucket(kata), clock=clock, stripes=64)
    one_stripe = kata.stage(2).ThreadSafeLimiter(_bucket(kata), clock=clock, stripes=1)
    return {
        "striped (64)": striped.try_acquire,
        "one stripe": one_stripe.try_acquire,
        "global lock": GlobalLock(_bucket(kata)).try_acquire,
        "bare, 1 thread": _bucket(kata).try_acquire,
    }


def _hammer(call: Callable[[str], object], threads: int = THREADS) -> float:
    """Decisions per second with ``threads`` threads started together."""
    barrier = threading.Barrier(threads + 1)

    def work(offset: int) -> None:
        barrier.wait()
        for i in range(PER_THREAD):
            call(KEYS[(offset + i * 7) % len(KEYS)])

    workers = [threading.Thread(target=work, args=(n * 13,), daemon=True) for n in range(threads)]
    for w in workers:
        w.start()
    barrier.wait()
    start = time.perf_counter()
    for w in workers:
        w.join(60)
    return threads * PER_THREAD / (time.perf_counter() - start)


def test_stage2_bench_striped_contention(benchmark: Any, kata: Any) -> None:
    call = _variants(kata)["striped (64)"]
    benchmark.group = "rate_limiter stage 2 (4 threads)"
    benchmark.pedantic(_hammer, args=(call,), rounds=5, iterations=1)


def test_stage2_bench_global_lock_contention(benchmark: Any, kata: Any) -> None:
    call = _variants(kata)["global lock"]
    benchmark.group = "rate_limiter stage 2 (4 threads)"
    benchmark.pedantic(_hammer, args=(call,), rounds=5, iterations=1)


def test_stage2_bench_ratios(kata: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """Interleaved rounds (drift on a shared machine hits every variant alike); best of each."""
    calls = _variants(kata)
    best = dict.fromkeys(calls, 0.0)
    for _ in range(ROUNDS):
        for name, call in calls.items():
            best[name] = max(best[name], _hammer(call, 1 if name.startswith("bare") else THREADS))
    base = best["global lock"]
    with capsys.disabled():
        print(f"\nstage 2, {THREADS} threads on {len(KEYS)} keys (best of {ROUNDS}):")
        for name, rate in best.items():
            print(f"  {name:>15}: {rate:>10,.0f} decisions/s = {rate / base:.2f}× the global lock")
