"""The rate-limiter contract: types shared by stubs, solutions and tests. Do not edit.

Every duration is an integer number of nanoseconds; every cost a positive ``int``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

from katas._kit.clock import NS_PER_S, Clock, ManualClock, MonotonicClock, WaitingClock


@dataclass(frozen=True)
class Decision:
    """What a limiter decided for one request.

    - ``allowed``: the request was admitted (and its cost consumed).
    - ``limit``: the limiter's capacity (bucket size, or requests per window).
    - ``remaining``: whole units available right after this decision (floored).
    - ``retry_after_ns``: 0 when allowed; ``None`` when the cost can never fit; otherwise
      the exact wait after which the same request is admitted (with no other traffic),
      one nanosecond less being too early.
    - ``reset_after_ns``: time until the key is back to its fresh (full/empty) state.
    """

    allowed: bool
    limit: int
    remaining: int
    retry_after_ns: int | None
    reset_after_ns: int


class RateLimiter(Protocol):
    """Anything that decides requests per key. Keys are independent of one another."""

    def try_acquire(self, key: str, cost: int = 1) -> Decision:
        """Admit and consume ``cost`` units now, or deny and consume nothing."""
        ...

    def peek(self, key: str, cost: int = 1) -> Decision:
        """The decision ``try_acquire`` would return now, changing nothing."""
        ...

    def refund(self, key: str, cost: int) -> None:
        """Give back ``cost`` units (capped: never above a fresh key's allowance)."""
        ...

    def reset(self, key: str) -> None:
        """Return ``key`` to its fresh state."""
        ...

    def tracked_keys(self) -> int:
        """How many keys hold state that differs from fresh (idle keys are forgotten)."""
        ...


FixedWindowAlign = Literal["epoch", "first_hit"]

__all__ = [
    "NS_PER_S",
    "Clock",
    "Decision",
    "FixedWindowAlign",
    "ManualClock",
    "MonotonicClock",
    "RateLimiter",
    "WaitingClock",
]
