"""Stage 1 reference: exact single-threaded rate limiters driven by an injected clock.

Shared rules (see katas/rate_limiter/README.md):

- Time is integer ns and arithmetic is exact; no Fraction or float in a hot path.
- Each key stores the latest time its state was written (``last``) and is evaluated at
  ``eff = max(now, last)``: a clock stepping backwards pauses the key, never mints or
  burns. ``retry_after_ns``/``reset_after_ns`` add ``eff - now``, the catch-up time.
- Only an admission, a refund or a reset writes; a denial or a peek changes nothing.
- A key is *fresh* when it holds no usage at ``now`` and ``last <= now``: it then
  behaves exactly like a key never seen, so it can be forgotten. ``sweep`` does that;
  with ``auto_sweep`` it also runs by itself whenever the key count has doubled since
  the previous sweep (amortised O(1) per new key).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from fractions import Fraction
from itertools import islice
from typing import Generic, TypeVar

from katas.rate_limiter.api import (
    NS_PER_S,
    Clock,
    Decision,
    FixedWindowAlign,
    MultiDecision,
    RateLimiter,
)

#: Never auto-sweep below this many keys: tiny sweeps would cost more than the memory.
_MIN_SWEEP = 64

S = TypeVar("S")


def _check_count(name: str, value: object) -> int:
    # bool is an int subclass, but True as a capacity or a cost is always a mistake.
    if type(value) is not int:
        raise TypeError(f"{name} must be a positive int, got {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"{name} must be a positive int, got {value}")
    return value


def _check_key(key: object) -> str:
    # 1, True and 1.0 are equal dict keys: allowed, they would share one bucket.
    if type(key) is not str:
        raise TypeError(f"key must be a str, got {key!r} ({type(key).__name__})")
    return key


def _check_rate(name: str, value: object) -> Fraction:
    if type(value) is not int and not isinstance(value, Fraction):
        raise TypeError(
            f"{name} must be an int or a Fraction (floats drift), got {value!r} "
            f"({type(value).__name__})"
        )
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return Fraction(value)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class _Keys(Generic[S]):
    """Per-key state plus the sweeping every limiter shares."""

    def __init__(self, clock: Clock, auto_sweep: bool) -> None:
        self._clock = clock
        self._auto_sweep = auto_sweep
        self._keys: dict[str, S] = {}
        self._sweep_at = _MIN_SWEEP

    def _fresh(self, state: S, now: int) -> bool:
        raise NotImplementedError  # pragma: no cover - every limiter overrides it

    def _insert(self, key: str, state: S) -> None:
        if self._auto_sweep and len(self._keys) >= self._sweep_at:
            self.sweep()
        self._keys[key] = state

    def _decide(self, key: str, cost: int, commit: bool) -> Decision:
        raise NotImplementedError  # pragma: no cover - every limiter overrides it

    def try_acquire(self, key: str, cost: int = 1) -> Decision:
        """Admit and consume ``cost`` units now, or deny and consume nothing."""
        return self._decide(_check_key(key), cost, commit=True)

    def peek(self, key: str, cost: int = 1) -> Decision:
        """The decision ``try_acquire`` would return now, changing nothing."""
        return self._decide(_check_key(key), cost, commit=False)

    def reset(self, key: str) -> None:
        """Return ``key`` to its fresh state."""
        self._keys.pop(_check_key(key), None)

    def tracked_keys(self) -> int:
        """Keys whose state differs from fresh."""
        now = self._clock.now_ns()
        return sum(1 for state in self._keys.values() if not self._fresh(state, now))

    def sweep(self) -> int:
        """Forget every fresh key now; return how many were forgotten."""
        now = self._clock.now_ns()
        idle = [key for key, state in self._keys.items() if self._fresh(state, now)]
        for key in idle:
            del self._keys[key]
        # Next sweep once the survivors have doubled: each sweep is paid for by as many
        # insertions as it scans.
        self._sweep_at = max(_MIN_SWEEP, 2 * len(self._keys))
        return len(idle)


class TokenBucket(_Keys[list[int]]):
    """``capacity`` units in a burst, refilled continuously at ``refill_per_s`` units/s."""

    def __init__(
        self,
        *,
        capacity: int,
        refill_per_s: int | Fraction,
        clock: Clock,
        auto_sweep: bool = True,
    ) -> None:
        self._limit = _check_count("capacity", capacity)
        rate = _check_rate("refill_per_s", refill_per_s)
        super().__init__(clock, auto_sweep)
        # With rate = p/q tokens/s, one token is q·10⁹ sub-units and every nanosecond
        # refills exactly p of them: integers only, whatever the rate.
        self._per_ns = rate.numerator
        self._unit = rate.denominator * NS_PER_S
        self._full = capacity * self._unit

    def _fresh(self, state: list[int], now: int) -> bool:
        level, last = state
        return last <= now and level + (now - last) * self._per_ns >= self._full

    def _level(self, key: str, now: int) -> tuple[list[int] | None, int, int]:
        state = self._keys.get(key)
        if state is None:
            return None, self._full, now
        level, last = state
        eff = max(now, last)  # elapsed = max(0, now - last): a step back never burns
        return state, min(self._full, level + (eff - last) * self._per_ns), eff

    def _decide(self, key: str, cost: int, commit: bool) -> Decision:
        # The hot path: locals, no helper calls, no Fraction (the spec's benchmark).
        if type(cost) is not int or cost < 1:
            _check_count("cost", cost)
        now = self._clock.now_ns()
        full, per_ns, unit = self._full, self._per_ns, self._unit
        need = cost * unit
        state = self._keys.get(key)
        if state is None:
            level, eff = full, now
        else:
            level, last = state
            eff = now if now > last else last  # elapsed = max(0, now - last)
            level += (eff - last) * per_ns
            if level > full:  # refill stops at capacity
                level = full
        allowed = level >= need  # never when need > full: the level is capped at full
        retry: int | None = 0
        if allowed:
            level -= need
            if commit:
                if state is None:
                    self._insert(key, [level, eff])
                else:
                    state[0], state[1] = level, eff
        elif need > full:
            retry = None  # no amount of waiting makes it fit
        else:
            retry = eff - now - (level - need) // per_ns  # ceil((need - level) / per_ns)
        reset = eff - now - (level - full) // per_ns
        return Decision(allowed, self._limit, level // unit, retry, reset)

    def refund(self, key: str, cost: int) -> None:
        _check_key(key)
        back = _check_count("cost", cost) * self._unit
        state, level, eff = self._level(key, self._clock.now_ns())
        if state is not None:  # a key not stored is already full
            state[0], state[1] = min(self._full, level + back), eff


class GCRA(_Keys[list[int]]):
    """The generic cell rate algorithm: one theoretical arrival time (TAT) per key.

    Decides exactly like ``TokenBucket(capacity=burst, refill_per_s=rate_per_s)``:
    the bucket is full at the TAT and each unit pushes the TAT one emission interval
    ``T = 1/rate`` later; a request fits while the TAT stays within ``burst·T`` of now.
    """

    def __init__(
        self, *, rate_per_s: int | Fraction, burst: int, clock: Clock, auto_sweep: bool = True
    ) -> None:
        rate = _check_rate("rate_per_s", rate_per_s)
        self._limit = _check_count("burst", burst)
        super().__init__(clock, auto_sweep)
        # Times are kept in units of 1/p ns (rate = p/q per s), so the emission
        # interval q·10⁹/p ns is the integer q·10⁹.
        self._p = rate.numerator
        self._interval = rate.denominator * NS_PER_S
        self._tolerance = burst * self._interval

    def _fresh(self, state: list[int], now: int) -> bool:
        tat, last = state
        return last <= now and tat <= now * self._p

    def _tat(self, key: str, now: int) -> tuple[list[int] | None, int, int]:
        state = self._keys.get(key)
        if state is None:
            return None, now * self._p, now
        eff = max(now, state[1])  # a step back pauses the key
        return state, max(state[0], eff * self._p), eff  # a TAT in the past: full

    def _decide(self, key: str, cost: int, commit: bool) -> Decision:
        increment = _check_count("cost", cost) * self._interval
        now = self._clock.now_ns()
        state, tat, eff = self._tat(key, now)
        t = eff * self._p
        catch_up = eff - now
        allowed = tat + increment - t <= self._tolerance
        retry: int | None = 0
        if allowed:
            tat += increment
            if commit:
                if state is None:
                    self._insert(key, [tat, eff])
                else:
                    state[0], state[1] = tat, eff
        elif increment > self._tolerance:
            retry = None
        else:
            retry = catch_up + _ceil_div(tat + increment - t - self._tolerance, self._p)
        remaining = (self._tolerance - (tat - t)) // self._interval
        reset = catch_up + _ceil_div(tat - t, self._p)
        return Decision(allowed, self._limit, remaining, retry, reset)

    def refund(self, key: str, cost: int) -> None:
        _check_key(key)
        back = _check_count("cost", cost) * self._interval
        state, tat, eff = self._tat(key, self._clock.now_ns())
        if state is not None:  # the TAT never moves before now: that would overfill
            state[0], state[1] = max(tat - back, eff * self._p), eff


class _Log:
    """One key's admitted requests, oldest first: (time, cost), and their total."""

    __slots__ = ("count", "entries", "last")

    def __init__(self) -> None:
        self.entries: deque[tuple[int, int]] = deque()
        self.count = 0
        self.last = 0

    def gone(self, before: int) -> tuple[int, int]:
        """(entries, units) at the front admitted at or before ``before``, not dropped.

        Only a write may drop them: the key's time is then ``eff`` for good, whereas a
        read at a later ``now`` followed by a clock step back would count them again.
        """
        n = units = 0
        for at, cost in self.entries:
            if at > before:
                break
            n, units = n + 1, units + cost
        return n, units

    def drop(self, before: int) -> None:
        """Drop the entries at or before ``before``: each entry is dropped once."""
        entries = self.entries
        while entries and entries[0][0] <= before:
            self.count -= entries.popleft()[1]


class SlidingLog(_Keys[_Log]):
    """Exact: at most ``limit`` units admitted in every window ``(now - window_ns, now]``.

    Admission and expiry are amortised O(1) per unit; a read walks only the entries
    that left the window since the key's last write (fewer than ``cost`` on a denial).
    """

    def __init__(
        self, *, limit: int, window_ns: int, clock: Clock, auto_sweep: bool = True
    ) -> None:
        self._limit = _check_count("limit", limit)
        self._window = _check_count("window_ns", window_ns)
        super().__init__(clock, auto_sweep)

    def _fresh(self, state: _Log, now: int) -> bool:
        return state.last <= now and (
            not state.entries or state.entries[-1][0] <= now - self._window
        )

    def _decide(self, key: str, cost: int, commit: bool) -> Decision:
        _check_count("cost", cost)
        now = self._clock.now_ns()
        log = self._keys.get(key)
        eff = now if log is None else max(now, log.last)
        gone, gone_units = (0, 0) if log is None else log.gone(eff - self._window)
        count = 0 if log is None else log.count - gone_units
        allowed = count + cost <= self._limit
        retry: int | None = 0
        if allowed:
            count += cost
            if commit:
                if log is None:
                    log = _Log()
                    self._insert(key, log)
                log.drop(eff - self._window)
                if log.entries and log.entries[-1][0] == eff:  # same instant: one entry
                    log.entries[-1] = (eff, log.entries[-1][1] + cost)
                else:
                    log.entries.append((eff, cost))
                log.count, log.last = count, eff
        elif cost > self._limit:
            retry = None
        elif log is not None:  # always: count > 0 here
            # Walk on from the oldest entry still in the window until enough units
            # leave it: at most `cost` entries, since count <= limit.
            to_free = count + cost - self._limit
            for at, units in islice(log.entries, gone, None):
                to_free -= units
                if to_free <= 0:
                    retry = at + self._window - now  # at is out of (t - W, t] at t = at + W
                    break
        if allowed:
            reset = eff + self._window - now  # the newest unit is this request's
        elif log is not None and count:
            reset = log.entries[-1][0] + self._window - now
        else:
            reset = 0 if log is None else max(0, log.last - now)
        return Decision(allowed, self._limit, self._limit - count, retry, reset)

    def refund(self, key: str, cost: int) -> None:
        _check_key(key)
        back = _check_count("cost", cost)
        log = self._keys.get(key)
        if log is None:
            return
        eff = max(self._clock.now_ns(), log.last)
        log.drop(eff - self._window)
        # Newest units first, as if the request had cost less; entries that left the
        # window are gone, so a refund never exceeds what the window holds.
        while back and log.entries:
            at, units = log.entries.pop()
            if units > back:
                log.entries.append((at, units - back))
                units = back
            back -= units
            log.count -= units
        log.last = eff


class FixedWindow(_Keys[list[int]]):
    """At most ``limit`` units per window of ``window_ns``; the count resets at its end.

    ``align="epoch"`` cuts time at multiples of ``window_ns`` (Envoy); ``"first_hit"``
    opens a key's window at its first admitted request (limits). Either way up to
    ``2·limit`` fit in a short burst straddling a boundary: that is the price of O(1).
    """

    def __init__(
        self,
        *,
        limit: int,
        window_ns: int,
        clock: Clock,
        align: FixedWindowAlign = "epoch",
        auto_sweep: bool = True,
    ) -> None:
        self._limit = _check_count("limit", limit)
        self._window = _check_count("window_ns", window_ns)
        if align not in ("epoch", "first_hit"):
            raise ValueError(f"align must be 'epoch' or 'first_hit', got {align!r}")
        self._epoch = align == "epoch"
        super().__init__(clock, auto_sweep)

    def _fresh(self, state: list[int], now: int) -> bool:
        start, count, last = state
        return last <= now and (count == 0 or now >= start + self._window)

    def _current(self, state: list[int] | None, now: int) -> tuple[int, int, int]:
        """(window start, units counted in it, eff) for a key evaluated at ``now``."""
        eff = now if state is None else max(now, state[2])
        if self._epoch:
            start = eff - eff % self._window
        elif state is not None and state[1] and eff < state[0] + self._window:
            start = state[0]
        else:
            start = eff  # first_hit: a window would open now
        count = state[1] if state is not None and state[0] == start else 0
        return start, count, eff

    def _decide(self, key: str, cost: int, commit: bool) -> Decision:
        _check_count("cost", cost)
        now = self._clock.now_ns()
        state = self._keys.get(key)
        start, count, eff = self._current(state, now)
        allowed = count + cost <= self._limit
        retry: int | None = 0
        if allowed:
            count += cost
            if commit:
                if state is None:
                    self._insert(key, [start, count, eff])
                else:
                    state[:] = [start, count, eff]
        elif cost > self._limit:
            retry = None
        else:
            retry = start + self._window - now  # a new window, a new count
        if count:
            reset = start + self._window - now
        else:
            reset = 0 if state is None else max(0, state[2] - now)
        return Decision(allowed, self._limit, self._limit - count, retry, reset)

    def refund(self, key: str, cost: int) -> None:
        _check_key(key)
        back = _check_count("cost", cost)
        state = self._keys.get(key)
        if state is not None:  # only the current window's units come back
            start, count, eff = self._current(state, self._clock.now_ns())
            state[:] = [start, count - min(back, count), eff]


class SlidingWindowCounter(_Keys[list[int]]):
    """Two fixed-window counts, the previous one weighted by how much of it still overlaps.

    Windows of length W are epoch-aligned; at ``now`` in the window starting at
    ``start``: admit iff ``prev·(W - (now - start))/W + curr + cost <= limit``, computed
    in integers (multiplied through by W).
    """

    def __init__(
        self, *, limit: int, window_ns: int, clock: Clock, auto_sweep: bool = True
    ) -> None:
        self._limit = _check_count("limit", limit)
        self._window = _check_count("window_ns", window_ns)
        super().__init__(clock, auto_sweep)

    def _counts(self, state: list[int] | None, now: int) -> tuple[int, int, int, int]:
        """(window start, prev, curr, eff) for a key evaluated at ``now``."""
        eff = now if state is None else max(now, state[3])
        start = eff - eff % self._window
        if state is None or state[0] < start - self._window:
            return start, 0, 0, eff
        if state[0] < start:  # one window has passed: the current count becomes prev
            return start, state[2], 0, eff
        return start, state[1], state[2], eff

    def _fresh(self, state: list[int], now: int) -> bool:
        _, prev, curr, _ = self._counts(state, now)
        return state[3] <= now and prev == curr == 0

    def _admit_at(self, start: int, elapsed: int, prev: int, curr: int, cost: int) -> int:
        """The first instant from ``start + elapsed`` at which ``cost`` fits."""
        w = self._window
        while True:  # at most three windows: by then prev and curr are both 0
            room = (self._limit - curr - cost) * w
            if room >= 0:
                # prev·(w - e) <= room  <=>  e >= w - floor(room / prev)
                at = max(elapsed, w - room // prev if prev else 0)
                if at < w:
                    return start + at
            start, elapsed, prev, curr = start + w, 0, curr, 0

    def _decide(self, key: str, cost: int, commit: bool) -> Decision:
        _check_count("cost", cost)
        now = self._clock.now_ns()
        state = self._keys.get(key)
        start, prev, curr, eff = self._counts(state, now)
        w, elapsed = self._window, eff - start
        used = prev * (w - elapsed) + curr * w  # weighted units, times w
        allowed = used + cost * w <= self._limit * w
        retry: int | None = 0
        if allowed:
            curr += cost
            used += cost * w
            if commit:
                if state is None:
                    self._insert(key, [start, prev, curr, eff])
                else:
                    state[:] = [start, prev, curr, eff]
        elif cost > self._limit:
            retry = None
        else:
            retry = self._admit_at(start, elapsed, prev, curr, cost) - now
        if curr:
            reset = start + 2 * w - now
        elif prev:
            reset = start + w - now
        else:
            reset = 0 if state is None else max(0, state[3] - now)
        return Decision(allowed, self._limit, (self._limit * w - used) // w, retry, reset)

    def refund(self, key: str, cost: int) -> None:
        _check_key(key)
        back = _check_count("cost", cost)
        state = self._keys.get(key)
        if state is not None:  # only the current window's units come back
            start, prev, curr, eff = self._counts(state, self._clock.now_ns())
            state[:] = [start, prev, curr - min(back, curr), eff]


class MultiLimiter:
    """Several limits on the same keys (say requests/min and tokens/min), all or nothing.

    A request names its cost per limit (limits it does not name are not charged). It
    is admitted only if every charged limit admits it; a denial consumes nothing from
    any limit. Each inner limiter keeps (and sweeps) its own keys.
    """

    def __init__(self, limits: Mapping[str, RateLimiter]) -> None:
        if not limits:
            raise ValueError("limits must name at least one limit")
        self._limits = dict(limits)

    def _charges(self, costs: Mapping[str, int], *, at_least_one: bool) -> dict[str, int]:
        if not isinstance(costs, Mapping):
            raise TypeError(f"costs must be a mapping of limit name to cost, got {costs!r}")
        charges = {}
        for name, cost in costs.items():
            if name not in self._limits:
                raise ValueError(f"costs names an unknown limit {name!r}: {sorted(self._limits)}")
            if type(cost) is not int:
                raise TypeError(f"costs[{name!r}] must be an int, got {cost!r}")
            if cost < 0:
                raise ValueError(f"costs[{name!r}] must be >= 0, got {cost}")
            if cost:
                charges[name] = cost
        if at_least_one and not charges:
            raise ValueError(f"costs must charge at least one limit, got {dict(costs)!r}")
        return charges

    @staticmethod
    def _verdict(decisions: dict[str, Decision]) -> MultiDecision:
        waits = [d.retry_after_ns for d in decisions.values() if not d.allowed]
        if not waits:
            return MultiDecision(True, 0, decisions)
        # Every limit only gains room as time passes, so the request fits once the
        # slowest denying limit does; if one limit can never fit it, neither can the whole.
        retry = None if None in waits else max(w for w in waits if w is not None)
        return MultiDecision(False, retry, decisions)

    def peek(self, key: str, costs: Mapping[str, int]) -> MultiDecision:
        charges = self._charges(costs, at_least_one=True)
        return self._verdict({n: self._limits[n].peek(key, c) for n, c in charges.items()})

    def try_acquire(self, key: str, costs: Mapping[str, int]) -> MultiDecision:
        charges = self._charges(costs, at_least_one=True)
        verdict = self._verdict({n: self._limits[n].peek(key, c) for n, c in charges.items()})
        if not verdict.allowed:
            return verdict
        taken: dict[str, Decision] = {}
        for name, cost in charges.items():
            decision = self._limits[name].try_acquire(key, cost)
            if not decision.allowed:  # only if the clock stepped back since the peeks
                for undo in taken:
                    self._limits[undo].refund(key, charges[undo])
                return self._verdict({**taken, name: decision})
            taken[name] = decision
        return MultiDecision(True, 0, taken)

    def refund(self, key: str, costs: Mapping[str, int]) -> None:
        for name, cost in self._charges(costs, at_least_one=False).items():
            self._limits[name].refund(key, cost)

    def reset(self, key: str) -> None:
        for limiter in self._limits.values():
            limiter.reset(key)

    def sweep(self) -> int:
        return sum(limiter.sweep() for limiter in self._limits.values())


def retry_after_header(decision: Decision | MultiDecision) -> str | None:
    """The HTTP ``Retry-After`` value (whole seconds) for a denial, else ``None``.

    Rounded up (RFC 9110): a client that waits a floored value comes back too early and
    eats another 429. ``None`` for an admitted request (the header belongs on a 429)
    and when the request can never fit (waiting would not help).
    """
    if decision.allowed or decision.retry_after_ns is None:
        return None
    return str(_ceil_div(decision.retry_after_ns, NS_PER_S))
