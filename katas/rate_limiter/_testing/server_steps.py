"""Walking one stage-3 key and its exact model through steps of server time (fakeredis).

A step moves the server clock (forwards, or back as a failover to a replica whose clock
lags does), then makes one call on the key; the same call goes to a :class:`ServerModel`
at the same server instant. The walk yields each decision beside the model's, with the
steps so far, for the test to compare and to tell.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from katas._harness.redis import RedisEnv
from katas.rate_limiter._testing.nodes import Call, Op, ServerModel, call, plain
from katas.rate_limiter.api import Decision, RedisLimiter, StampedDecision

#: (what, server time moved by in µs, call, cost): "what" names the move in the story.
Step = tuple[str, int, Call, int]


def walk_server_steps(
    env: RedisEnv, node: RedisLimiter, model: ServerModel, steps: Sequence[Step], key: str
) -> Iterator[tuple[Decision, Decision, list[str]]]:
    """Run ``steps`` on ``key``; yield (got, want, the steps so far) for each decision."""
    server = env.server()
    done: list[str] = []
    for moved, by_us, what, cost in steps:
        if by_us > 0:
            env.pass_time(by_us * 1000)
        elif by_us < 0:
            env.step_time_back(-by_us * 1000)
        stepped = f"[server time {moved}] " if moved else ""
        d = call(node, Op(0, key, cost, what))
        if d is None:  # a refund
            model.refund(key, cost, server.time_us())
            done.append(f"{stepped}{what}({key!r}, {cost})")
            continue
        assert isinstance(d, StampedDecision), f"Redis was up, got unstamped {d}"
        want = model.decide(key, cost, server.time_us(), commit=what == "try_acquire")
        done.append(f"{stepped}{what}({key!r}, {cost}) -> {d}")
        yield plain(d), want, done
