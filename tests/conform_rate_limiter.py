"""The rate_limiter kata's conformances: each ``conform_*`` function returns an instance of a
stage class as the Protocol of ``katas/rate_limiter/api.py`` it implements (see
tests/test_conformance.py)."""

from __future__ import annotations

import katas.rate_limiter.stage1 as rl_stub1
import katas.rate_limiter.stage2 as rl_stub2
import solutions.rate_limiter.stage1 as rl_ref1
import solutions.rate_limiter.stage2 as rl_ref2
from katas.rate_limiter import api as rl

# --- rate_limiter: stage-1 limiters are sweepable; the stage-2 wrapper is a limiter ----


def conform_stub_token_bucket(x: rl_stub1.TokenBucket) -> rl.SweepableLimiter:
    return x


def conform_ref_token_bucket(x: rl_ref1.TokenBucket) -> rl.SweepableLimiter:
    return x


def conform_stub_sliding_log(x: rl_stub1.SlidingLog) -> rl.SweepableLimiter:
    return x


def conform_ref_sliding_log(x: rl_ref1.SlidingLog) -> rl.SweepableLimiter:
    return x


def conform_stub_gcra(x: rl_stub1.GCRA) -> rl.SweepableLimiter:
    return x


def conform_ref_gcra(x: rl_ref1.GCRA) -> rl.SweepableLimiter:
    return x


def conform_stub_fixed_window(x: rl_stub1.FixedWindow) -> rl.SweepableLimiter:
    return x


def conform_ref_fixed_window(x: rl_ref1.FixedWindow) -> rl.SweepableLimiter:
    return x


def conform_stub_sliding_window_counter(x: rl_stub1.SlidingWindowCounter) -> rl.SweepableLimiter:
    return x


def conform_ref_sliding_window_counter(x: rl_ref1.SlidingWindowCounter) -> rl.SweepableLimiter:
    return x


def conform_stub_thread_safe_limiter(x: rl_stub2.ThreadSafeLimiter) -> rl.RateLimiter:
    return x


def conform_ref_thread_safe_limiter(x: rl_ref2.ThreadSafeLimiter) -> rl.RateLimiter:
    return x
