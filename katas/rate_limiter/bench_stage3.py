"""Stage 3 benchmarks: a Redis decision against the floor a script call can reach.

Run on a real server (never fakeredis, whose cost is Python, not the network):
``KATA_REDIS_SERVER=redis-server pytest katas/rate_limiter/bench_stage3.py -s`` starts
a private one (``redis-server`` on PATH is used by default); ``KATA_REDIS_URL`` points
at an external one. Target: ≥ 0.8× the decisions/s of a bare ``EVALSHA`` of a one-line
script touching one key, and exactly one round trip per decision. Benchmarks report,
they never fail.
"""

from __future__ import annotations

import os
import shlex
import shutil
import time
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import pytest

from katas._harness.redis import RedisEnv
from katas.rate_limiter.api import NS_PER_S, ManualClock

pytestmark = [pytest.mark.stage(3), pytest.mark.extended]  # collected only when named

ONE_LINE = "return redis.call('INCR', KEYS[1])"
#: The least any limiter deciding on server time does: read the clock, read, write + TTL.
SKELETON = (
    "local t = redis.call('TIME') local v = redis.call('GET', KEYS[1]) "
    "redis.call('SET', KEYS[1], t[1], 'PX', 60000) return t[1]"
)
KEYS = [f"user-{i}" for i in range(1_000)]
ROUNDS, PER_ROUND = 12, 500


@pytest.fixture(scope="module")
def bench_env() -> Iterator[RedisEnv]:
    command = os.environ.get("KATA_REDIS_SERVER") or (
        "redis-server" if shutil.which("redis-server") else None
    )
    url = None if command else os.environ.get("KATA_REDIS_URL")
    if command is None and url is None:
        pytest.skip("benchmarks need a real Redis: redis-server on PATH or KATA_REDIS_URL")
    with RedisEnv(server_command=shlex.split(command) if command else None, url=url) as env:
        yield env


def _limiter(stage: ModuleType, env: RedisEnv, client: Any) -> Any:
    return stage.RedisRateLimiter(
        client,
        algorithm="token_bucket",
        limit=1_000_000,
        window_ns=60 * NS_PER_S,
        clock=ManualClock(),
        key_prefix=env.fresh_prefix(),
    )


def _cycle(call: Callable[[str], object]) -> Callable[[], None]:
    state = {"i": 0}

    def one() -> None:
        state["i"] = (state["i"] + 1) % len(KEYS)
        call(KEYS[state["i"]])

    return one


def _rate(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    for _ in range(PER_ROUND):
        fn()
    return PER_ROUND / (time.perf_counter() - start)


def test_stage3_bench_decision(
    benchmark: Any, stage_module: ModuleType, bench_env: RedisEnv
) -> None:
    limiter = _limiter(stage_module, bench_env, bench_env.client())
    benchmark.group = "rate_limiter stage 3 (real Redis)"
    benchmark(_cycle(limiter.try_acquire))


def test_stage3_bench_bare_evalsha(benchmark: Any, bench_env: RedisEnv) -> None:
    client = bench_env.client()
    script = client.register_script(ONE_LINE)
    prefix = bench_env.fresh_prefix()
    benchmark.group = "rate_limiter stage 3 (real Redis)"
    benchmark(_cycle(lambda key: script(keys=[prefix + key], client=client)))


def test_stage3_bench_ratio_and_round_trips(
    stage_module: ModuleType, bench_env: RedisEnv, capsys: pytest.CaptureFixture[str]
) -> None:
    """Interleaved rounds (so drift on a shared machine hits both alike); best of each."""
    client = bench_env.client()
    limiter = _limiter(stage_module, bench_env, client)
    prefix = bench_env.fresh_prefix()
    one_line, skeleton = client.register_script(ONE_LINE), client.register_script(SKELETON)
    calls = {
        "decision": _cycle(limiter.try_acquire),
        "one_line": _cycle(lambda key: one_line(keys=[prefix + key], client=client)),
        "skeleton": _cycle(lambda key: skeleton(keys=[prefix + "s" + key], client=client)),
    }
    best = dict.fromkeys(calls, 0.0)
    for fn in calls.values():
        fn()  # load every script
    for _ in range(ROUNDS):
        for name, fn in calls.items():
            best[name] = max(best[name], _rate(fn))
    ours, floor = best["decision"], best["one_line"]

    proxy = bench_env.proxy()
    through = _limiter(stage_module, bench_env, bench_env.server().proxied_client(proxy))
    through.try_acquire("warm-up")
    proxy.reset_counts()
    for key in KEYS[:200]:
        through.try_acquire(key)
    trips = proxy.counts().round_trips / 200
    with capsys.disabled():
        print(
            f"\nstage 3 on {bench_env.mode}: {ours:,.0f} decisions/s vs bare EVALSHA "
            f"{floor:,.0f}/s = {ours / floor:.2f}× (target ≥ 0.80×); "
            f"{trips:.2f} round trips per decision (target 1); a TIME+GET+SET script alone "
            f"reaches {best['skeleton'] / floor:.2f}×"
        )
