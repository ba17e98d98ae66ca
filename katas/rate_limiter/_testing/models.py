"""Exact models of the stage-1 rate limiters, written from the definitions, slowly and
obviously (Fractions, whole lists, searches), never from an implementation: a suite runs
the same operations on an implementation and on its model and compares whole Decisions."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Generic, TypeVar

from katas.rate_limiter.api import NS_PER_S, Decision

# --------------------------------------------------------------------------------------
# Exact models, written from the definitions
# --------------------------------------------------------------------------------------

NEVER = -(10**30)  # the stored time of a key never written: any clock is past it


@dataclass
class KeyState:
    last: int = NEVER  # latest time this key's state was written


S = TypeVar("S", bound=KeyState)


class Model(Generic[S]):
    """One limiter's exact behaviour. Subclasses say what a key holds and frees."""

    limit: int

    def __init__(self) -> None:
        self.keys: dict[str, S] = {}

    # --- what each algorithm defines -----------------------------------------------
    def new(self) -> S:
        raise NotImplementedError

    def free(self, ks: S, at: int) -> Fraction:
        """Units available at ``at`` (>= ks.last), before flooring."""
        raise NotImplementedError

    def record(self, ks: S, at: int, cost: int) -> None:
        """Consume ``cost`` at ``at``."""
        raise NotImplementedError

    def give_back(self, ks: S, at: int, cost: int) -> None:
        """Refund ``cost`` at ``at``, capped."""
        raise NotImplementedError

    def wait(self, ks: S, now: int, cost: int) -> int:
        """First clock time >= now at which ``cost`` fits (no other traffic)."""
        eff = max(now, ks.last)
        return first_true(lambda t: self.free(ks, max(t, eff)) >= cost, now)

    def idle_from(self, ks: S, now: int) -> int:
        """First clock time >= now from which the key is fresh."""
        full = Fraction(self.limit)
        eff = max(now, ks.last)
        return first_true(lambda t: t >= ks.last and self.free(ks, max(t, eff)) == full, now)

    # --- shared semantics ------------------------------------------------------------
    def decide(self, key: str, cost: int, now: int, *, commit: bool) -> Decision:
        stored = self.keys.get(key)
        ks = copy.deepcopy(stored) if stored is not None else self.new()
        eff = max(now, ks.last)  # a key's time never goes back
        retry: int | None
        if cost > self.limit:
            retry = None
        elif self.free(ks, eff) >= cost:
            retry = 0
            self.record(ks, eff, cost)
            ks.last = eff
            if commit:
                self.keys[key] = ks
        else:
            retry = self.wait(ks, now, cost) - now
        remaining = math.floor(self.free(ks, eff))
        return Decision(retry == 0, self.limit, remaining, retry, self.idle_from(ks, now) - now)

    def refund(self, key: str, cost: int, now: int) -> None:
        ks = self.keys.get(key)
        if ks is not None:  # a key holding nothing has nothing to give back
            eff = max(now, ks.last)
            self.give_back(ks, eff, cost)
            ks.last = eff

    def reset(self, key: str) -> None:
        self.keys.pop(key, None)

    def tracked(self, now: int) -> int:
        return sum(1 for ks in self.keys.values() if self.idle_from(ks, now) > now)


def first_true(pred: Callable[[int], bool], lo: int) -> int:
    """The least t >= lo with pred(t), for a predicate that stays true once true."""
    if pred(lo):
        return lo
    step = 1
    while not pred(lo + step):
        step *= 2
        assert step < 10**16, "model bug: predicate never becomes true"
    bad, good = lo + step // 2, lo + step
    while good - bad > 1:
        mid = (bad + good) // 2
        bad, good = (bad, mid) if pred(mid) else (mid, good)
    return good


@dataclass
class Bucket(KeyState):
    tokens: Fraction = Fraction(0)


class TokenBucketModel(Model[Bucket]):
    """Tokens refill continuously at ``rate`` per second up to ``capacity``."""

    def __init__(self, capacity: int, rate: Fraction) -> None:
        super().__init__()
        self.limit = capacity
        self.per_ns = Fraction(rate) / NS_PER_S

    def new(self) -> Bucket:
        return Bucket(tokens=Fraction(self.limit))

    def free(self, ks: Bucket, at: int) -> Fraction:
        return min(Fraction(self.limit), ks.tokens + (at - ks.last) * self.per_ns)

    def record(self, ks: Bucket, at: int, cost: int) -> None:
        ks.tokens = self.free(ks, at) - cost

    def give_back(self, ks: Bucket, at: int, cost: int) -> None:
        ks.tokens = min(Fraction(self.limit), self.free(ks, at) + cost)

    def wait(self, ks: Bucket, now: int, cost: int) -> int:
        eff = max(now, ks.last)
        return eff + math.ceil((cost - self.free(ks, eff)) / self.per_ns)

    def idle_from(self, ks: Bucket, now: int) -> int:
        eff = max(now, ks.last)
        return eff + math.ceil((self.limit - self.free(ks, eff)) / self.per_ns)


@dataclass
class Log(KeyState):
    admitted: list[list[int]] = field(default_factory=list)  # [time, units], oldest first


class SlidingLogModel(Model[Log]):
    """Units admitted at t count in every window (t' - W, t'] that contains t."""

    def __init__(self, limit: int, window_ns: int) -> None:
        super().__init__()
        self.limit, self.window = limit, window_ns

    def new(self) -> Log:
        return Log()

    def in_window(self, ks: Log, at: int) -> list[list[int]]:
        return [e for e in ks.admitted if at - self.window < e[0] <= at and e[1]]

    def free(self, ks: Log, at: int) -> Fraction:
        return Fraction(self.limit - sum(units for _, units in self.in_window(ks, at)))

    def record(self, ks: Log, at: int, cost: int) -> None:
        ks.admitted.append([at, cost])

    def give_back(self, ks: Log, at: int, cost: int) -> None:
        for entry in reversed(self.in_window(ks, at)):  # newest first
            taken = min(cost, entry[1])
            entry[1] -= taken
            cost -= taken

    def wait(self, ks: Log, now: int, cost: int) -> int:
        eff = max(now, ks.last)
        counted = self.limit - int(self.free(ks, eff))
        excess = counted + cost - self.limit  # units that must leave the window first
        for at, units in self.in_window(ks, eff):  # oldest first
            excess -= units
            if excess <= 0:
                return at + self.window  # no longer in (t - W, t] at t = at + W
        raise AssertionError("model bug")


@dataclass
class Window(KeyState):
    start: int | None = None
    count: int = 0


class FixedWindowModel(Model[Window]):
    """A count per window; windows cut at multiples of W, or opened by a first hit."""

    def __init__(self, limit: int, window_ns: int, align: str) -> None:
        super().__init__()
        self.limit, self.window, self.align = limit, window_ns, align

    def new(self) -> Window:
        return Window()

    def current(self, ks: Window, at: int) -> tuple[int, int]:
        if self.align == "epoch":
            start = at // self.window * self.window
        elif ks.start is not None and ks.count and at < ks.start + self.window:
            start = ks.start
        else:
            start = at  # first_hit: the next admission opens a window here
        return start, ks.count if ks.start == start else 0

    def free(self, ks: Window, at: int) -> Fraction:
        return Fraction(self.limit - self.current(ks, at)[1])

    def record(self, ks: Window, at: int, cost: int) -> None:
        ks.start, count = self.current(ks, at)
        ks.count = count + cost

    def give_back(self, ks: Window, at: int, cost: int) -> None:
        ks.start, count = self.current(ks, at)
        ks.count = count - min(cost, count)


@dataclass
class Counts(KeyState):
    per_window: dict[int, int] = field(default_factory=dict)  # window index -> units


class SlidingWindowCounterModel(Model[Counts]):
    """prev weighted by the part of the previous window still inside (now - W, now]."""

    def __init__(self, limit: int, window_ns: int) -> None:
        super().__init__()
        self.limit, self.window = limit, window_ns

    def new(self) -> Counts:
        return Counts()

    def free(self, ks: Counts, at: int) -> Fraction:
        index, into = divmod(at, self.window)
        prev = ks.per_window.get(index - 1, 0)
        curr = ks.per_window.get(index, 0)
        return self.limit - Fraction(prev * (self.window - into), self.window) - curr

    def record(self, ks: Counts, at: int, cost: int) -> None:
        index = at // self.window
        ks.per_window[index] = ks.per_window.get(index, 0) + cost

    def give_back(self, ks: Counts, at: int, cost: int) -> None:
        index = at // self.window
        curr = ks.per_window.get(index, 0)
        ks.per_window[index] = curr - min(cost, curr)
