"""Stage 1 — single-threaded rate limiters, exact, driven by an injected clock.

Core: :class:`TokenBucket` and :class:`SlidingLog`. Extended: :class:`GCRA`,
:class:`FixedWindow`, :class:`SlidingWindowCounter`, :class:`MultiLimiter` and
:func:`retry_after_header`. The prompt is katas/rate_limiter/README.md; run the suite
with ``pytest katas/rate_limiter -k stage1`` (``-k "stage1 and core"`` for the core).

Rules every limiter here follows (the suite checks each one):

- Time comes only from ``clock.now_ns()``: integer nanoseconds. Token and time
  arithmetic is exact — integers (scaled by the rate's denominator) or Fractions, never
  floats — and a hot path keeps Fractions out.
- A key never seen is *fresh*: a full bucket, an empty window.
- ``try_acquire`` admits and consumes ``cost`` units, or denies and consumes nothing.
  ``peek`` returns the decision ``try_acquire`` would return, changing nothing.
- :class:`~katas.rate_limiter.api.Decision`: ``limit`` is the capacity; ``remaining``
  the whole units left after this decision (floored); ``retry_after_ns`` is 0 when
  allowed, ``None`` when ``cost`` can never fit (``cost > limit``: denied, nothing
  changes), otherwise exact — the same request is admitted at ``now + retry_after_ns``
  and denied one nanosecond earlier, with no other traffic; ``reset_after_ns`` is the
  time until the key is fresh again (0 for a fresh key).
- ``cost`` (and a refund's ``cost``) must be an ``int`` >= 1 (``bool`` is rejected):
  otherwise ``TypeError``/``ValueError`` naming ``cost``, and nothing changes. Bad
  configuration raises ``ValueError``/``TypeError`` naming the parameter.
- Each key remembers the latest time its state was written (an admission, a refund)
  and is evaluated at ``max(now, that time)``: ``elapsed = max(0, now - last)``. A clock
  that steps backwards pauses the key — it neither mints nor burns quota — and the
  waits in a decision include the time the clock needs to catch up. Denials and peeks
  write nothing.
- ``refund(key, cost)`` gives units back, capped: never above a fresh key's allowance;
  window limiters only give back units counted in the current window (a refund for a
  window that has rolled is dropped). A refund for a key holding nothing does nothing.
- A key is fresh again once it holds no usage and the clock has caught up with its
  stored time; ``tracked_keys()`` counts the keys that are not fresh. ``sweep()``
  forgets every fresh key and returns how many it forgot. With ``auto_sweep=True``
  (the default) a limiter also sweeps by itself, amortised O(1) per operation (e.g.
  whenever its number of stored keys has doubled since the previous sweep), so memory
  is bounded by recently active keys; with ``auto_sweep=False`` it never forgets a key
  on its own (the stage-2 wrapper then sweeps under all its locks).
"""

from __future__ import annotations

# TODO(stage1): implement every class and function below; delete each
# `raise Todo()` as you go.
from collections.abc import Mapping
from fractions import Fraction

from katas._runtime.todo import Todo
from katas.rate_limiter.api import (
    Clock,
    Decision,
    FixedWindowAlign,
    MultiDecision,
    RateLimiter,
)


class TokenBucket:
    """``capacity`` units in a burst, refilled continuously at ``refill_per_s`` units/s.

    ``refill_per_s`` is a positive ``int`` or ``Fraction`` (``Fraction(1, 3)``: one unit
    every 3 s); ``capacity`` a positive ``int``. Over any interval of length d at most
    ``capacity + refill_per_s·d`` units are admitted. ``retry_after_ns`` is the exact
    ceiling of the time the missing units take to refill.
    """

    def __init__(
        self,
        *,
        capacity: int,
        refill_per_s: int | Fraction,
        clock: Clock,
        auto_sweep: bool = True,
    ) -> None:
        raise Todo()

    def try_acquire(self, key: str, cost: int = 1) -> Decision:
        """Admit and consume ``cost`` units now, or deny and consume nothing."""
        raise Todo()

    def peek(self, key: str, cost: int = 1) -> Decision:
        """The decision ``try_acquire`` would return now, changing nothing."""
        raise Todo()

    def refund(self, key: str, cost: int) -> None:
        """Put ``cost`` units back into the bucket, never above ``capacity``."""
        raise Todo()

    def reset(self, key: str) -> None:
        """Make ``key`` fresh: a full bucket."""
        raise Todo()

    def tracked_keys(self) -> int:
        """How many keys are not fresh now (a bucket below capacity, or a paused clock)."""
        raise Todo()

    def sweep(self) -> int:
        """Forget every key that is fresh now; return how many were forgotten."""
        raise Todo()


class SlidingLog:
    """Exact: at most ``limit`` units admitted in every window ``(now - window_ns, now]``.

    The window is half-open: a unit admitted at t counts until ``t + window_ns - 1`` and
    no longer at ``t + window_ns``. Each admission, expiry and retry computation costs
    amortised O(1) per unit — no rescans of the whole log, no inserts at the front of a
    list. A refund takes back the newest units first.
    """

    def __init__(
        self, *, limit: int, window_ns: int, clock: Clock, auto_sweep: bool = True
    ) -> None:
        raise Todo()

    def try_acquire(self, key: str, cost: int = 1) -> Decision:
        """Admit and consume ``cost`` units now, or deny and consume nothing."""
        raise Todo()

    def peek(self, key: str, cost: int = 1) -> Decision:
        """The decision ``try_acquire`` would return now, changing nothing."""
        raise Todo()

    def refund(self, key: str, cost: int) -> None:
        """Remove up to ``cost`` of the newest units still in the window."""
        raise Todo()

    def reset(self, key: str) -> None:
        """Make ``key`` fresh: an empty log."""
        raise Todo()

    def tracked_keys(self) -> int:
        """How many keys are not fresh now (units in the window, or a paused clock)."""
        raise Todo()

    def sweep(self) -> int:
        """Forget every key that is fresh now; return how many were forgotten."""
        raise Todo()


class GCRA:
    """The generic cell rate algorithm: one theoretical arrival time (TAT) per key.

    Returns exactly the same :class:`Decision` s (every field, every call, clock steps
    and refunds included) as ``TokenBucket(capacity=burst, refill_per_s=rate_per_s)``:
    the bucket is full at the TAT, each unit pushes the TAT one emission interval
    ``1/rate_per_s`` later, and a request fits while the TAT stays within
    ``burst`` intervals of now.
    """

    def __init__(
        self, *, rate_per_s: int | Fraction, burst: int, clock: Clock, auto_sweep: bool = True
    ) -> None:
        raise Todo()

    def try_acquire(self, key: str, cost: int = 1) -> Decision:
        """Admit and consume ``cost`` units now, or deny and consume nothing."""
        raise Todo()

    def peek(self, key: str, cost: int = 1) -> Decision:
        """The decision ``try_acquire`` would return now, changing nothing."""
        raise Todo()

    def refund(self, key: str, cost: int) -> None:
        """Move the TAT back by ``cost`` intervals, never before now."""
        raise Todo()

    def reset(self, key: str) -> None:
        """Make ``key`` fresh."""
        raise Todo()

    def tracked_keys(self) -> int:
        """How many keys are not fresh now."""
        raise Todo()

    def sweep(self) -> int:
        """Forget every key that is fresh now; return how many were forgotten."""
        raise Todo()


class FixedWindow:
    """At most ``limit`` units per window of ``window_ns``; the count resets at its end.

    ``align="epoch"``: windows are ``[k·window_ns, (k+1)·window_ns)`` of the clock
    (Envoy). ``align="first_hit"``: a key's window opens at its first admitted request
    and lasts ``window_ns`` (limits); a window whose count a refund brought to 0 is
    closed. Anything else: ``ValueError`` naming ``align``. A denied request's
    ``retry_after_ns`` is the time until its window ends. Up to ``2·limit`` units fit
    in a short burst straddling a boundary.
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
        raise Todo()

    def try_acquire(self, key: str, cost: int = 1) -> Decision:
        """Admit and consume ``cost`` units now, or deny and consume nothing."""
        raise Todo()

    def peek(self, key: str, cost: int = 1) -> Decision:
        """The decision ``try_acquire`` would return now, changing nothing."""
        raise Todo()

    def refund(self, key: str, cost: int) -> None:
        """Give back up to ``cost`` units counted in the current window."""
        raise Todo()

    def reset(self, key: str) -> None:
        """Make ``key`` fresh."""
        raise Todo()

    def tracked_keys(self) -> int:
        """How many keys are not fresh now."""
        raise Todo()

    def sweep(self) -> int:
        """Forget every key that is fresh now; return how many were forgotten."""
        raise Todo()


class SlidingWindowCounter:
    """Two fixed-window counts, the previous one weighted by how much of it still overlaps.

    Windows of length W = ``window_ns`` are epoch-aligned. At ``now``, in the window
    that starts at ``start``, with ``prev`` units counted in the window before and
    ``curr`` in this one: admit iff ``prev·(W - (now - start))/W + curr + cost <= limit``,
    computed exactly (multiply through by W). ``remaining`` is
    ``floor(limit - prev·(W - (now - start))/W - curr)`` after the decision, and
    ``retry_after_ns`` the first instant at which the inequality holds.
    """

    def __init__(
        self, *, limit: int, window_ns: int, clock: Clock, auto_sweep: bool = True
    ) -> None:
        raise Todo()

    def try_acquire(self, key: str, cost: int = 1) -> Decision:
        """Admit and consume ``cost`` units now, or deny and consume nothing."""
        raise Todo()

    def peek(self, key: str, cost: int = 1) -> Decision:
        """The decision ``try_acquire`` would return now, changing nothing."""
        raise Todo()

    def refund(self, key: str, cost: int) -> None:
        """Give back up to ``cost`` units counted in the current window."""
        raise Todo()

    def reset(self, key: str) -> None:
        """Make ``key`` fresh."""
        raise Todo()

    def tracked_keys(self) -> int:
        """How many keys are not fresh now."""
        raise Todo()

    def sweep(self) -> int:
        """Forget every key that is fresh now; return how many were forgotten."""
        raise Todo()


class MultiLimiter:
    """Several limits on the same keys (say requests/min and tokens/min), all or nothing.

    ``limits`` maps a name to a limiter (at least one, else ``ValueError``). ``costs``
    maps limit names to ints >= 0; a limit it does not name (or names with 0) is not
    charged. An unknown name, a negative or non-int cost: ``ValueError``/``TypeError``
    naming ``costs``; ``try_acquire``/``peek`` must charge at least one limit.

    A request is admitted only if every charged limit admits it; a denial consumes
    nothing from any limit. The :class:`MultiDecision` carries each charged limit's
    decision (on a denial, what each would decide alone) and ``retry_after_ns``: 0 when
    allowed, ``None`` if some limit can never fit its cost, else the longest wait among
    the denying limits — exact, since every limit only gains room as time passes.
    """

    def __init__(self, limits: Mapping[str, RateLimiter]) -> None:
        raise Todo()

    def peek(self, key: str, costs: Mapping[str, int]) -> MultiDecision:
        """The decision ``try_acquire`` would return now, changing nothing."""
        raise Todo()

    def try_acquire(self, key: str, costs: Mapping[str, int]) -> MultiDecision:
        """Charge every named limit, or none of them."""
        raise Todo()

    def refund(self, key: str, costs: Mapping[str, int]) -> None:
        """Give units back to each named limit (say the tokens a call did not use)."""
        raise Todo()

    def reset(self, key: str) -> None:
        """Make ``key`` fresh in every limit."""
        raise Todo()

    def sweep(self) -> int:
        """Sweep every limit; return how many keys they forgot in total."""
        raise Todo()


def retry_after_header(decision: Decision | MultiDecision) -> str | None:
    """The HTTP ``Retry-After`` value for a denial: whole seconds, rounded **up**.

    RFC 9110 delay-seconds: ``retry_after_ns`` of 1 ns gives ``"1"``, of exactly 2 s
    gives ``"2"``, of 2 s + 1 ns gives ``"3"`` — a client that obeys a floored value
    comes back too early and eats another 429. Returns ``None`` for an admitted request
    (the header belongs on a 429, not on a success) and when ``retry_after_ns`` is
    ``None`` (the request can never fit: waiting would not help).
    """
    raise Todo()
