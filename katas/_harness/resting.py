"""A component at rest on a frozen clock: every thread a test started is asleep on the
clock (or held by the test at a gate), so nothing more can happen until the test acts.

A test that knows this judges at once what a wait would otherwise watch for until its
deadline — a thread that will never return, a count that will never be reached — so a
red run stays short (:func:`katas._harness.waiting.at_rest`). :class:`WatchedClock` is a
``ManualClock`` that knows who sleeps on it; :func:`rest_on` registers it for the test;
:func:`wait_at` holds a thread for the test without keeping the component from rest.
"""

from __future__ import annotations

import threading
import time

from katas._harness.waiting import DEADLINE_S, at_rest, eventually, threads_before_test
from katas._runtime.clock import HARD_DEADLINE_S, ManualClock

#: The threads waiting in :func:`wait_at`, by ident, and the event they wait for.
_AT_GATES: dict[int, threading.Event] = {}


class WatchedClock(ManualClock):
    """A ManualClock that knows which threads sleep on it, and until when: so a test can
    tell when every thread of a component is parked — nothing can happen until the clock
    moves — instead of watching for a while that nothing happens."""

    def __init__(self, start_ns: int = 0) -> None:
        super().__init__(start_ns)
        self._asleep: dict[int, tuple[int | None, threading.Condition]] = {}
        self._watch = threading.Lock()

    def wait_until_ns(self, cond: threading.Condition, deadline_ns: int | None) -> None:
        me = threading.get_ident()
        with self._watch:
            self._asleep[me] = (deadline_ns, cond)
        try:
            super().wait_until_ns(cond, deadline_ns)
        finally:
            with self._watch:
                self._asleep.pop(me, None)

    def deadlines(self) -> dict[str, int | None]:
        """The deadline each thread asleep here waits for (None: no deadline), by name."""
        with self._watch:
            asleep = dict(self._asleep)
        names = {t.ident: t.name for t in threading.enumerate()}
        return {names.get(ident, str(ident)): deadline for ident, (deadline, _) in asleep.items()}

    def asleep(self, thread: threading.Thread) -> bool:
        """``thread`` sleeps on this clock, until a deadline after now or none."""
        with self._watch:
            deadline, _ = self._asleep.get(thread.ident or 0, (0, None))
        return deadline is None or deadline > self.now_ns()

    def parked(self, others: set[threading.Thread], busy: set[int]) -> bool:
        """Every thread not in ``others`` (those alive before the test) and not ``busy``
        (held by the test, e.g. in a handler) sleeps here with a deadline after now."""
        now = self.now_ns()
        with self._watch:
            asleep = dict(self._asleep)
        threads = [t for t in threading.enumerate() if t not in others and t.ident not in busy]
        if not all(t.ident in asleep for t in threads):
            return False
        sleeping = [asleep[t.ident] for t in threads if t.ident is not None]
        if any(deadline is not None and deadline <= now for deadline, _ in sleeping):
            return False
        # A thread notified (by the component, not the clock) but not yet running still
        # shows as asleep here; its condition no longer counts it among its waiters.
        on: dict[int, tuple[threading.Condition, int]] = {}
        for _, cond in sleeping:
            on[id(cond)] = (cond, on.get(id(cond), (cond, 0))[1] + 1)
        return all(len(cond._waiters) >= n for cond, n in on.values())  # type: ignore[attr-defined]

    def settle(self, others: set[threading.Thread], busy: set[int]) -> None:
        """Wait (hard deadline) until every thread of the component is parked on the clock."""
        eventually(
            lambda: self.parked(others, busy),
            "every thread of the component asleep on the clock (none busy, none due)",
        )


class SelfWakingClock(WatchedClock):
    """A WatchedClock on which a deadline wakes only the thread that waited for it, as a
    real timeout does: moving time notifies no condition. A component that counts on
    its waiters' timeouts to wake the others (``notify()`` where several must look again)
    loses a wake-up here, as it would on a real clock; on a plain ManualClock the clock's
    ``notify_all`` would hide it."""

    _notifies_sleepers = False
    POLL_S = 0.001  # real seconds between a timed sleeper's looks at the frozen time

    def _block(self, cond: threading.Condition, deadline_ns: int | None) -> bool:
        if deadline_ns is None:  # stays in its place among the condition's waiters
            return cond.wait(HARD_DEADLINE_S)
        give_up = time.monotonic() + HARD_DEADLINE_S
        while self.now_ns() < deadline_ns:
            if cond.wait(self.POLL_S):
                return True
            if time.monotonic() > give_up:
                return False
        return True


def held() -> set[int]:
    """The threads waiting at a gate (:func:`wait_at`) the test has not opened yet."""
    return {t for t, event in list(_AT_GATES.items()) if not event.is_set()}


def wait_at(event: threading.Event, what: str) -> None:
    """Wait (hard deadline) until the test sets ``event``: held there by the test, the
    thread does not keep its component from coming to rest (:func:`rest_on`)."""
    me = threading.get_ident()
    _AT_GATES[me] = event
    try:
        assert event.wait(DEADLINE_S), f"{what} waited for the test too long"
    finally:
        del _AT_GATES[me]


def rest_on(clock: WatchedClock) -> None:
    """From now on in this test, a wait ends as soon as every thread the test started is
    asleep on ``clock`` (but those held at a gate): at rest on a frozen clock, the
    component does nothing more until the test acts, so a red run judges at once instead
    of waiting out a deadline."""
    before = threads_before_test()

    def resting() -> bool:  # with no thread of the test's own (an async test), never
        started = any(t not in before for t in threading.enumerate())
        return started and clock.parked(before, held())

    at_rest(resting)


__all__ = ["SelfWakingClock", "WatchedClock", "held", "rest_on", "wait_at"]
