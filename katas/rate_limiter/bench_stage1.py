"""Stage 1 benchmarks: collected only when this file is named on the command line.

    python -m pytest katas/rate_limiter/bench_stage1.py --impl=solutions --benchmark-only -q

Each group runs its contenders — the implementation under test (``--impl``), the
reference, and the library a user would otherwise reach for (``limits``, from the
``[bench]`` extra) — in turn within every round (each round starting with the next
one), so that drift on a shared machine hits them alike, and reports the ratios of each
one's best round in ``extra_info`` (``--benchmark-json``, which ``kata bench`` reads)
and on stdout (printed even without ``-s``). The spec's targets — informational,
benchmarks never fail CI:

- TokenBucket on 10 000 keys: >= 5x the decisions/s of limits' MovingWindowRateLimiter
  on MemoryStorage.
- SlidingLog: cost per decision with 64 000 entries in the window <= 1.5x its cost with
  1 000 (limits' moving window inserts at the front of a list and degrades).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest

from katas._harness.bench import Contender, interleaved, report
from katas._registry import impl as _impl
from katas.rate_limiter.api import NS_PER_S, MonotonicClock

pytestmark = [pytest.mark.stage(1), pytest.mark.core]

limits = pytest.importorskip("limits", reason="the anchors come with `pip install -e .[bench]`")
from limits.storage import MemoryStorage  # noqa: E402
from limits.strategies import MovingWindowRateLimiter  # noqa: E402

KEYS = [f"user-{i}" for i in range(10_000)]
DECISIONS = 2_000  # decisions per sliding-log round
ROUNDS = 15
LIMITS_ROUNDS = 5  # limits' growth rounds (each refills a window of up to 64 000 entries)


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


# --- TokenBucket on 10 000 keys, against limits' moving window --------------------------


def bucket(stage: ModuleType) -> Contender:
    """One decision on each of the 10 000 keys a round."""
    acquire = stage.TokenBucket(capacity=100, refill_per_s=100, clock=MonotonicClock()).try_acquire

    def run() -> None:
        for key in KEYS:
            acquire(key)

    return Contender(run, len(KEYS))


def limits_moving_window() -> Contender:
    limiter = MovingWindowRateLimiter(MemoryStorage())
    item = limits.RateLimitItemPerSecond(100)
    hit = limiter.hit

    def run() -> None:
        for key in KEYS:
            hit(item, key)

    return Contender(run, len(KEYS))


def test_bench_stage1_token_bucket_10k_keys(
    benchmark: Any,
    stage_module: ModuleType,
    reference: ModuleType,
    capsys: pytest.CaptureFixture[str],
) -> None:
    benchmark.group = "stage1 token bucket, 10 000 keys (interleaved)"
    per_decision = interleaved(
        benchmark,
        {
            "TokenBucket": bucket(stage_module),
            "reference": bucket(reference),
            "limits MovingWindow": limits_moving_window(),
        },
        rounds=ROUNDS,
    )
    ours = per_decision["TokenBucket"]
    if math.isnan(ours):  # --benchmark-disable: nothing was measured
        return
    report(
        benchmark, capsys, "speedup_vs_limits", per_decision["limits MovingWindow"] / ours, ">= 5"
    )
    report(benchmark, capsys, "speed_vs_reference", per_decision["reference"] / ours, "~1")


# --- SlidingLog: cost per decision as the window fills ----------------------------------


def steady_log(stage: ModuleType, entries: int) -> Contender:
    """A key whose window always holds ``entries`` entries: each decision adds one as
    the oldest leaves (one entry every ``step`` ns, window ``entries * step``)."""
    clock, step = TickClock(), 1_000
    log = stage.SlidingLog(limit=entries, window_ns=entries * step, clock=clock)
    for _ in range(entries):
        clock.t += step
        assert log.try_acquire("alice").allowed
    acquire = log.try_acquire

    def run() -> None:
        for _ in range(DECISIONS):
            clock.t += step
            acquire("alice")

    return Contender(run, DECISIONS)


def test_bench_stage1_sliding_log_cost_as_the_window_fills(
    benchmark: Any, stage_module: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    benchmark.group = "stage1 sliding log, 1 000 and 64 000 entries in the window (interleaved)"
    per_decision = interleaved(
        benchmark,
        {
            "SlidingLog 1k": steady_log(stage_module, 1_000),
            "SlidingLog 64k": steady_log(stage_module, 64_000),
        },
        rounds=ROUNDS,
    )
    if math.isnan(per_decision["SlidingLog 1k"]):
        return
    report(
        benchmark,
        capsys,
        "cost_64k_over_1k",
        per_decision["SlidingLog 64k"] / per_decision["SlidingLog 1k"],
        "<= 1.5",
    )


def limits_window(entries: int) -> Contender:
    """limits' moving window holding ``entries`` entries of one key, refilled (untimed)
    before every round: its hits never expire within the hour, so a round would
    otherwise leave the window bigger for the next."""
    item = limits.RateLimitItemPerHour(10 * entries)
    state: dict[str, Callable[..., Any]] = {}

    def fill() -> None:
        limiter = MovingWindowRateLimiter(MemoryStorage())
        for _ in range(entries):
            limiter.hit(item, "alice")
        state["hit"] = limiter.hit

    def run() -> None:
        hit = state["hit"]
        for _ in range(DECISIONS):
            hit(item, "alice")

    return Contender(run, DECISIONS, setup=fill)


def test_bench_stage1_sliding_log_limits_anchor(
    benchmark: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    benchmark.group = "stage1 limits' moving window, 1 000 and 64 000 entries (interleaved)"
    per_decision = interleaved(
        benchmark,
        {"limits 1k": limits_window(1_000), "limits 64k": limits_window(64_000)},
        rounds=LIMITS_ROUNDS,
    )
    if math.isnan(per_decision["limits 1k"]):
        return
    report(
        benchmark,
        capsys,
        "limits_cost_64k_over_1k",
        per_decision["limits 64k"] / per_decision["limits 1k"],
        "informational",
    )
