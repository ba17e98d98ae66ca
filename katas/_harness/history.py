"""Checking concurrent histories for linearizability (Wing & Gong, with memoization).

A test records every call its threads or tasks made — what was asked, what came back,
and when (invoked, returned) on one monotonic clock — and asks whether some order of
the calls, consistent with real time (a call that returned before another was invoked
comes first), explains every result under a sequential model. Linearizability is
local: a history of a key-value store is linearizable iff each key's sub-history is,
so :func:`check_per_key` searches each key on its own and stays small.

The search (Wing & Gong 1993; memoized on the set of calls placed and the model state,
as in Lowe's refinement) tries, at each step, every call that could take effect first:
one invoked before every remaining call returned.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

#: ``step(state, call) -> (new state, the result the call must have returned)``.
Step = Callable[[Any, Any], tuple[Any, Any]]


@dataclass(frozen=True)
class Call:
    """One call of a concurrent history."""

    who: str  # the thread or task
    key: Hashable
    op: Hashable  # e.g. ("put", 3), ("get",), ("delete",)
    result: Hashable
    invoked: int  # ns on one monotonic clock
    returned: int

    def __str__(self) -> str:
        args = ", ".join(repr(a) for a in (self.key, *self._args()))
        return f"{self.who}: {self._name()}({args}) -> {self.result!r}"

    def _name(self) -> str:
        return str(self.op[0]) if isinstance(self.op, tuple) else str(self.op)

    def _args(self) -> tuple[Any, ...]:
        return tuple(self.op[1:]) if isinstance(self.op, tuple) else ()


def linearization(calls: Sequence[Call], initial: Hashable, step: Step) -> list[Call] | None:
    """An order of ``calls`` legal under ``step`` and real time, or None if none is."""
    calls = sorted(calls, key=lambda c: c.invoked)
    n = len(calls)
    seen: set[tuple[int, Hashable]] = set()
    order: list[Call] = []

    def search(placed: int, state: Hashable) -> bool:
        if placed == (1 << n) - 1:
            return True
        if (placed, state) in seen:
            return False
        seen.add((placed, state))
        # A call may go next iff it was invoked before every remaining call returned.
        first_return = min(c.returned for i, c in enumerate(calls) if not placed >> i & 1)
        for i, c in enumerate(calls):
            if placed >> i & 1:
                continue
            if c.invoked > first_return:
                break  # sorted by invocation: no later call can go first either
            new_state, expected = step(state, c.op)
            if expected == c.result:
                order.append(c)
                if search(placed | 1 << i, new_state):
                    return True
                order.pop()
        return False

    return order if search(0, initial) else None


def check_per_key(calls: Iterable[Call], initial: Hashable, step: Step) -> None:
    """Assert that every key's sub-history is linearizable; explain the first that is not."""
    by_key: dict[Hashable, list[Call]] = {}
    for c in calls:
        by_key.setdefault(c.key, []).append(c)
    for key, sub in by_key.items():
        if linearization(sub, initial, step) is None:
            t0 = min(c.invoked for c in sub)
            lines = "\n".join(
                f"    [{(c.invoked - t0) / 1e3:9.1f} µs → {(c.returned - t0) / 1e3:9.1f} µs] {c}"
                for c in sorted(sub, key=lambda c: c.invoked)
            )
            raise AssertionError(
                f"the calls on key {key!r} are not linearizable — no order consistent "
                f"with real time explains every result (a lost update, a torn read, or a "
                f"stale value):\n{lines}"
            )
