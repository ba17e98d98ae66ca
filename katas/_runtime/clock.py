"""Injected time: every duration in every kata is an integer number of nanoseconds.

Components read time only through a :class:`Clock`, and wait only through a
:class:`WaitingClock`, so tests drive them with :class:`ManualClock` and never sleep.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol, runtime_checkable

import anyio

NS_PER_S = 1_000_000_000
NS_PER_MS = 1_000_000
NS_PER_US = 1_000

#: The longest single wait the platform takes (``threading.TIMEOUT_MAX``, about 292 years
#: on 64-bit Linux), in ns. A deadline further off (a job due at ``now + 2**200``) is waited
#: for in waits of at most this, instead of an OverflowError in the waiting thread.
MAX_WAIT_NS = int(threading.TIMEOUT_MAX) * NS_PER_S

#: How many waits in a row for a deadline already past one thread may make while a
#: ManualClock stands still before the clock fails it as a busy loop.
SPIN_LIMIT = 10_000

#: How long (real seconds) a ManualClock waiter may wait for a test to move time
#: before the test is failed instead of hanging.
HARD_DEADLINE_S = 20.0


@runtime_checkable
class Clock(Protocol):
    """A source of integer-nanosecond time that never goes backwards on its own."""

    def now_ns(self) -> int: ...


@runtime_checkable
class WaitingClock(Clock, Protocol):
    """A clock that blocking and async components also wait on."""

    def wait_until_ns(self, cond: threading.Condition, deadline_ns: int | None) -> None:
        """With ``cond`` held: wait until notified or until ``deadline_ns`` (None: no deadline).

        May return early (like ``Condition.wait``); callers re-check their predicate.
        """
        ...

    async def sleep_until_ns_async(self, deadline_ns: int) -> None:
        """Sleep the current task until ``deadline_ns``; a cancellation point."""
        ...


class MonotonicClock:
    """The default clock: the OS monotonic clock."""

    def now_ns(self) -> int:
        return time.monotonic_ns()

    def wait_until_ns(self, cond: threading.Condition, deadline_ns: int | None) -> None:
        if deadline_ns is None:
            cond.wait()
        else:  # returning early is allowed: the caller re-checks
            cond.wait(min(max(0, deadline_ns - time.monotonic_ns()), MAX_WAIT_NS) / NS_PER_S)

    async def sleep_until_ns_async(self, deadline_ns: int) -> None:
        while True:  # each sleep a cancellation point, even when already due
            left = deadline_ns - time.monotonic_ns()
            await anyio.sleep(min(max(0, left), MAX_WAIT_NS) / NS_PER_S)
            if left <= MAX_WAIT_NS:
                return


class ManualClock:
    """A clock that moves only when a test says so.

    ``advance(ns)`` and ``set(ns)`` wake every thread or task whose deadline has been
    reached. ``set`` may move time backwards, to simulate an NTP step.
    """

    def __init__(self, start_ns: int = 1_000 * NS_PER_S) -> None:
        if not isinstance(start_ns, int):
            raise TypeError(f"start_ns must be an int of nanoseconds, got {start_ns!r}")
        self._now = start_ns
        self._lock = threading.Lock()
        self._thread_sleepers: dict[int, tuple[threading.Condition, int | None]] = {}
        self._task_sleepers: dict[int, tuple[anyio.Event, int]] = {}
        self._next_id = 0
        self._spins: dict[int, tuple[int, int]] = {}  # thread: (instant, waits already due)

    def now_ns(self) -> int:
        with self._lock:
            return self._now

    def advance(self, ns: int) -> None:
        if not isinstance(ns, int) or ns < 0:
            raise ValueError(f"ns must be a non-negative int, got {ns!r}")
        with self._lock:
            self._now += ns
        self._wake_due()

    def set(self, now_ns: int) -> None:
        with self._lock:
            self._now = now_ns
        self._wake_due()

    def sleepers(self) -> int:
        """Threads and tasks currently waiting on this clock."""
        with self._lock:
            return len(self._thread_sleepers) + len(self._task_sleepers)

    def next_deadline_ns(self) -> int | None:
        """The earliest deadline a thread or task waits for (None: nobody waits)."""
        with self._lock:
            deadlines = [d for _, d in self._thread_sleepers.values() if d is not None]
            deadlines += [d for _, d in self._task_sleepers.values()]
        return min(deadlines, default=None)

    #: Whether moving time notifies the condition of each thread whose deadline came (a
    #: clock whose sleepers notice by themselves, as a real timeout does, sets it False).
    _notifies_sleepers = True

    def _wake_due(self) -> None:
        with self._lock:
            now = self._now
            sleepers = self._thread_sleepers.values() if self._notifies_sleepers else ()
            conds = [c for c, d in sleepers if d is not None and d <= now]
            events = [e for e, d in self._task_sleepers.values() if d <= now]
        # Taken outside our lock: a waiter holds its condition while it registers here.
        for cond in conds:
            with cond:
                cond.notify_all()
        for event in events:
            event.set()

    def wait_until_ns(self, cond: threading.Condition, deadline_ns: int | None) -> None:
        me = threading.get_ident()
        with self._lock:
            if deadline_ns is not None and deadline_ns <= self._now:
                self._count_spin(me, deadline_ns)
                return
            self._spins.pop(me, None)
            key = self._next_id
            self._next_id += 1
            self._thread_sleepers[key] = (cond, deadline_ns)
        try:
            if not self._block(cond, deadline_ns):
                raise TimeoutError(
                    f"ManualClock: a thread waited {HARD_DEADLINE_S:.0f} real seconds for "
                    f"deadline {deadline_ns} (now {self.now_ns()}) and nobody advanced the "
                    "clock or notified it: likely a lost wake-up or a deadlock"
                )
        finally:
            with self._lock:
                del self._thread_sleepers[key]

    def _count_spin(self, me: int, deadline_ns: int) -> None:
        """One more wait of thread ``me`` that was due already; with the clock frozen,
        :data:`SPIN_LIMIT` of them in a row is a busy loop: fail it in that thread."""
        instant, spins = self._spins.get(me, (self._now, 0))
        spins = spins + 1 if instant == self._now else 1
        self._spins[me] = (self._now, spins)
        if spins >= SPIN_LIMIT:
            del self._spins[me]
            raise RuntimeError(
                f"ManualClock: this thread asked {spins} times in a row to wait until "
                f"{deadline_ns}, already past at {self._now}, with the clock frozen: a busy "
                "loop (after the work due at an instant, wait for the next deadline, one "
                "strictly later)"
            )

    def _block(self, cond: threading.Condition, deadline_ns: int | None) -> bool:
        """Wait on ``cond`` (held) for a notify; False if none came within the hard deadline."""
        return cond.wait(HARD_DEADLINE_S)

    async def sleep_until_ns_async(self, deadline_ns: int) -> None:
        event = anyio.Event()
        with self._lock:
            if deadline_ns <= self._now:
                key = -1
            else:
                key = self._next_id
                self._next_id += 1
                self._task_sleepers[key] = (event, deadline_ns)
        if key == -1:
            await anyio.lowlevel.checkpoint()
            return
        try:
            with anyio.fail_after(HARD_DEADLINE_S):
                await event.wait()
        finally:
            with self._lock:
                del self._task_sleepers[key]


__all__ = [
    "HARD_DEADLINE_S",
    "NS_PER_MS",
    "NS_PER_S",
    "NS_PER_US",
    "SPIN_LIMIT",
    "Clock",
    "ManualClock",
    "MonotonicClock",
    "WaitingClock",
]
