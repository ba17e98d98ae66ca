"""Stage 1 benchmarks: collected only when this file is named on the command line.

    python -m pytest katas/rate_limiter/bench_stage1.py --impl=solutions --benchmark-only -q

Each group measures the implementation under test (``--impl``), the reference, and the
library a user would otherwise reach for (``limits``, from the ``[bench]`` extra), and
records the ratios in ``extra_info`` (shown with ``--benchmark-json``) and on stdout
(``-s``). The spec's targets — informational, benchmarks never fail CI:

- TokenBucket on 10 000 keys: >= 5x the decisions/s of limits' MovingWindowRateLimiter
  on MemoryStorage.
- SlidingLog: cost per decision with 64 000 entries in the window <= 1.5x its cost with
  1 000 (limits' moving window inserts at the front of a list and degrades).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest

from katas._harness.bench import report
from katas._registry import impl as _impl
from katas.rate_limiter.api import NS_PER_S, MonotonicClock

pytestmark = [pytest.mark.stage(1), pytest.mark.core]

limits = pytest.importorskip("limits", reason="the anchors come with `pip install -e .[bench]`")
from limits.storage import MemoryStorage  # noqa: E402
from limits.strategies import MovingWindowRateLimiter  # noqa: E402

KEYS = [f"user-{i}" for i in range(10_000)]
ROUNDS = 15
#: Per-decision seconds of each finished benchmark, so later ones can report ratios.
RESULTS: dict[str, float] = {}


@pytest.fixture(scope="module")
def reference() -> ModuleType:
    """The reference stage 1, whatever ``--impl`` says."""
    return _impl.resolve("solutions").stage("rate_limiter", 1)


class TickClock:
    """A clock that costs nothing to read; the benchmark moves it by hand."""

    def __init__(self) -> None:
        self.t = 1_000 * NS_PER_S

    def now_ns(self) -> int:
        return self.t


def measure(benchmark: Any, name: str, run: Callable[[], object], decisions: int) -> float:
    """Benchmark ``run`` (``decisions`` decisions per call); return seconds per decision."""
    benchmark.pedantic(run, rounds=ROUNDS, iterations=1, warmup_rounds=1)
    if benchmark.stats is None:  # --benchmark-disable: nothing was measured
        return float("nan")
    per_decision = float(benchmark.stats.stats.min) / decisions
    RESULTS[name] = per_decision
    benchmark.extra_info["decisions_per_s"] = round(1 / per_decision)
    return per_decision


# --- TokenBucket on 10 000 keys -------------------------------------------------------


def bucket_run(stage: ModuleType) -> Callable[[], object]:
    bucket = stage.TokenBucket(capacity=100, refill_per_s=100, clock=MonotonicClock())
    acquire = bucket.try_acquire

    def run() -> None:
        for key in KEYS:
            acquire(key)

    return run


def test_bench_stage1_token_bucket_10k_keys_limits_anchor(benchmark: Any) -> None:
    benchmark.group = "stage1 token bucket, 10 000 keys"
    limiter = MovingWindowRateLimiter(MemoryStorage())
    item = limits.RateLimitItemPerSecond(100)
    hit = limiter.hit

    def run() -> None:
        for key in KEYS:
            hit(item, key)

    measure(benchmark, "limits_moving_window", run, len(KEYS))


def test_bench_stage1_token_bucket_10k_keys_reference(
    benchmark: Any, reference: ModuleType
) -> None:
    benchmark.group = "stage1 token bucket, 10 000 keys"
    measure(benchmark, "reference_token_bucket", bucket_run(reference), len(KEYS))


def test_bench_stage1_token_bucket_10k_keys(
    benchmark: Any, stage_module: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    benchmark.group = "stage1 token bucket, 10 000 keys"
    ours = measure(benchmark, "token_bucket", bucket_run(stage_module), len(KEYS))
    if "limits_moving_window" in RESULTS:
        report(
            benchmark, capsys, "speedup_vs_limits", RESULTS["limits_moving_window"] / ours, ">= 5"
        )
    if "reference_token_bucket" in RESULTS:
        report(
            benchmark, capsys, "speed_vs_reference", RESULTS["reference_token_bucket"] / ours, "~1"
        )


# --- SlidingLog: cost per decision as the window fills ----------------------------------


def steady_log(stage: ModuleType, entries: int, decisions: int) -> Callable[[], object]:
    """A key whose window always holds ``entries`` entries: each decision adds one as
    the oldest leaves (one entry every ``step`` ns, window ``entries * step``)."""
    clock, step = TickClock(), 1_000
    log = stage.SlidingLog(limit=entries, window_ns=entries * step, clock=clock)
    for _ in range(entries):
        clock.t += step
        assert log.try_acquire("alice").allowed
    acquire = log.try_acquire

    def run() -> None:
        for _ in range(decisions):
            clock.t += step
            acquire("alice")

    return run


@pytest.mark.parametrize("entries", [1_000, 64_000])
def test_bench_stage1_sliding_log_entries_in_window(
    benchmark: Any, stage_module: ModuleType, entries: int, capsys: pytest.CaptureFixture[str]
) -> None:
    benchmark.group = "stage1 sliding log, cost per decision"
    ours = measure(
        benchmark, f"sliding_log_{entries}", steady_log(stage_module, entries, 2_000), 2_000
    )
    if entries == 64_000 and "sliding_log_1000" in RESULTS:
        report(benchmark, capsys, "cost_64k_over_1k", ours / RESULTS["sliding_log_1000"], "<= 1.5")


@pytest.mark.parametrize("entries", [1_000, 64_000])
def test_bench_stage1_sliding_log_limits_anchor(
    benchmark: Any, entries: int, capsys: pytest.CaptureFixture[str]
) -> None:
    benchmark.group = "stage1 sliding log, cost per decision"
    item = limits.RateLimitItemPerHour(10 * entries)
    state: dict[str, Any] = {}

    def fill() -> None:  # a fresh window holding `entries` entries, not timed
        limiter = MovingWindowRateLimiter(MemoryStorage())
        for _ in range(entries):
            limiter.hit(item, "alice")
        state["hit"] = limiter.hit

    def run() -> None:
        hit = state["hit"]
        for _ in range(2_000):
            hit(item, "alice")

    benchmark.pedantic(run, setup=fill, rounds=5, iterations=1)
    if benchmark.stats is None:
        return
    per = float(benchmark.stats.stats.min) / 2_000
    RESULTS[f"limits_moving_window_{entries}"] = per
    if entries == 64_000 and "limits_moving_window_1000" in RESULTS:
        report(
            benchmark,
            capsys,
            "limits_cost_64k_over_1k",
            per / RESULTS["limits_moving_window_1000"],
            "informational",
        )
