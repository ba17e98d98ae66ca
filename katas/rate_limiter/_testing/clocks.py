"""A test clock that orders the threads one wake-up sets running.

:class:`HeldWakeClock` is a ``ManualClock`` on which a chosen thread, once woken, lets go
of its condition's lock and parks at a :class:`~katas._harness.interleave.Gate` before it
takes the lock back: the threads woken with it look at the shared state first, on every
run, as they would if the scheduler ran them first. For tasks, a sleep until a chosen
instant ends only once the test sets an event: the task whose alarm that is comes last.
"""

from __future__ import annotations

import threading

import anyio

from katas._harness.interleave import Gate
from katas.rate_limiter.api import ManualClock


class HeldWakeClock(ManualClock):
    """A :class:`ManualClock` whose :meth:`hold_my_wakes` threads come last after a wake-up."""

    def __init__(self) -> None:
        super().__init__()
        self._held: dict[int, Gate] = {}
        self._held_sleeps: dict[int, anyio.Event] = {}

    def hold_my_wakes(self, gate: Gate) -> None:
        """From now on, each wake-up of the calling thread parks at ``gate`` (not holding
        the condition's lock) until the test opens it."""
        self._held[threading.get_ident()] = gate

    def _block(self, cond: threading.Condition, deadline_ns: int | None) -> bool:
        woken = super()._block(cond, deadline_ns)
        gate = self._held.get(threading.get_ident())
        if woken and gate is not None and not gate.is_open:
            cond.release()
            try:
                gate.pass_through()
            finally:
                cond.acquire()
        return woken

    def hold_sleeps_until(self, deadline_ns: int, until: anyio.Event) -> None:
        """From now on, a task's sleep until ``deadline_ns`` ends only once ``until`` is set."""
        self._held_sleeps[deadline_ns] = until

    async def sleep_until_ns_async(self, deadline_ns: int) -> None:
        await super().sleep_until_ns_async(deadline_ns)
        until = self._held_sleeps.get(deadline_ns)
        if until is not None:
            await until.wait()
