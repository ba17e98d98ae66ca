"""The rate_limiter kata's conformances: each ``conform_*`` function returns an instance of a
stage class as the Protocol of ``katas/rate_limiter/api.py`` it implements (see
tests/test_conformance.py)."""

from __future__ import annotations

import katas.rate_limiter.stage1 as rl_stub1
import katas.rate_limiter.stage2 as rl_stub2
import katas.rate_limiter.stage3 as rl_stub3
import solutions.rate_limiter.stage1 as rl_ref1
import solutions.rate_limiter.stage2 as rl_ref2
import solutions.rate_limiter.stage3 as rl_ref3
from katas.rate_limiter import api as rl

# --- stage 1: the limiters are sweepable; MultiLimiter charges several limits ------------


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


def conform_stub_multi_limiter(x: rl_stub1.MultiLimiter) -> rl.MultiRateLimiter:
    return x


def conform_ref_multi_limiter(x: rl_ref1.MultiLimiter) -> rl.MultiRateLimiter:
    return x


# --- stage 2: the wrapper is a limiter that can also block; async tasks; leases ------------


def conform_stub_thread_safe_limiter(x: rl_stub2.ThreadSafeLimiter) -> rl.RateLimiter:
    return x


def conform_ref_thread_safe_limiter(x: rl_ref2.ThreadSafeLimiter) -> rl.RateLimiter:
    return x


def conform_stub_blocking_thread_safe_limiter(
    x: rl_stub2.ThreadSafeLimiter,
) -> rl.BlockingLimiter:
    return x


def conform_ref_blocking_thread_safe_limiter(x: rl_ref2.ThreadSafeLimiter) -> rl.BlockingLimiter:
    return x


def conform_stub_async_limiter(x: rl_stub2.AsyncLimiter) -> rl.AsyncRateLimiter:
    return x


def conform_ref_async_limiter(x: rl_ref2.AsyncLimiter) -> rl.AsyncRateLimiter:
    return x


def conform_stub_concurrency_limiter(x: rl_stub2.ConcurrencyLimiter) -> rl.InProcessLeaseLimiter:
    return x


def conform_ref_concurrency_limiter(x: rl_ref2.ConcurrencyLimiter) -> rl.InProcessLeaseLimiter:
    return x


# --- stage 3: on Redis, sync and async; leases across nodes --------------------------------


def conform_stub_redis_rate_limiter(x: rl_stub3.RedisRateLimiter) -> rl.RedisLimiter:
    return x


def conform_ref_redis_rate_limiter(x: rl_ref3.RedisRateLimiter) -> rl.RedisLimiter:
    return x


def conform_stub_async_redis_rate_limiter(
    x: rl_stub3.AsyncRedisRateLimiter,
) -> rl.AsyncRedisLimiter:
    return x


def conform_ref_async_redis_rate_limiter(
    x: rl_ref3.AsyncRedisRateLimiter,
) -> rl.AsyncRedisLimiter:
    return x


def conform_stub_redis_concurrency_limiter(
    x: rl_stub3.RedisConcurrencyLimiter,
) -> rl.LeaseLimiter:
    return x


def conform_ref_redis_concurrency_limiter(
    x: rl_ref3.RedisConcurrencyLimiter,
) -> rl.LeaseLimiter:
    return x
