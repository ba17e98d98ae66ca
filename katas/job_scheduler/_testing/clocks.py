"""Test clocks of the job scheduler's suites: a WatchedClock that can wake its sleepers
late, and the heartbeat check that stages 2 and 3 share."""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Literal

from katas._harness.resting import WatchedClock
from katas._harness.story import Story, check
from katas._harness.waiting import eventually
from katas._runtime.clock import HARD_DEADLINE_S

#: A lease a third of which is a whole number: the default heartbeat interval (lease // 3).
LONG_LEASE = 3_000


class LateWakes(WatchedClock):
    """A WatchedClock that can wake threads late, as a busy machine does: between
    :meth:`hold_wakes` and :meth:`let_wake`, a thread that would return from a wait on
    this clock (notified, or at its deadline) sleeps on instead — its condition released,
    shown asleep with no deadline — so a test can move the clock between an event (a
    claim) and the moment another thread of the component notices it."""

    def __init__(self, start_ns: int) -> None:
        super().__init__(start_ns)
        self._spared: set[int] | None = None  # while holding: the threads never held
        self._held: dict[int, threading.Condition] = {}  # by thread: what it waits on

    def hold_wakes(self, but: set[threading.Thread]) -> None:
        """From now on, hold every waking thread but those of ``but``."""
        with self._watch:
            self._spared = {t.ident for t in but if t.ident is not None}

    def let_wake(self) -> None:
        """Stop holding; return once every held thread is running again (so a
        :meth:`settle` after it sees each one asleep again, not still held)."""
        with self._watch:
            self._spared = None
            waiting = list(self._held.values())
        for cond in waiting:
            with cond:
                cond.notify_all()
        eventually(lambda: not self.held(), "the threads this clock held to run again")

    def held(self) -> int:
        """How many threads are held now."""
        with self._watch:
            return len(self._held)

    def wait_until_ns(self, cond: threading.Condition, deadline_ns: int | None) -> None:
        super().wait_until_ns(cond, deadline_ns)
        me = threading.get_ident()
        # ``cond`` is held from here on but inside ``cond.wait``: let_wake's notify
        # cannot come between a look at the hold and the wait, so none is lost.
        with self._watch:
            if self._spared is None or me in self._spared:
                return
            self._held[me] = cond
            self._asleep[me] = (None, cond)
        give_up = time.monotonic() + HARD_DEADLINE_S  # a test that never lets go
        try:
            while time.monotonic() < give_up:
                with self._watch:
                    if self._spared is None:
                        return
                cond.wait(max(0.0, give_up - time.monotonic()))
        finally:
            with self._watch:
                self._held.pop(me, None)
                self._asleep.pop(me, None)


#: Which waiter of a condition a ``notify()`` wakes first (see :class:`OrderedClock`).
WakeOrder = Literal["oldest", "newest", "soonest"]
WAKE_ORDERS: tuple[WakeOrder, ...] = ("oldest", "newest", "soonest")


class _Waiters(deque[Any]):
    """A condition's queue of waiters in the order an :class:`OrderedClock` chooses;
    ``notify()`` wakes the first."""

    def __init__(self, waiters: deque[Any], clock: OrderedClock) -> None:
        super().__init__(waiters)
        self._clock = clock
        self._deadlines: dict[int, float] = {}  # by id(waiter): until when its thread sleeps

    def append(self, waiter: Any) -> None:  # called by the thread that starts to wait
        order = self._clock.order
        if order == "oldest":
            super().append(waiter)
        elif order == "newest":
            self.appendleft(waiter)
        else:  # "soonest": ahead of every waiter due later or never
            self._deadlines = {id(w): self._deadlines.get(id(w), math.inf) for w in self}
            due = self._clock.deadline_of_this_thread()
            later = (i for i, w in enumerate(self) if self._deadlines[id(w)] > due)
            self.insert(next(later, len(self)), waiter)
            self._deadlines[id(waiter)] = due


class OrderedClock(WatchedClock):
    """A WatchedClock that decides which waiter a ``notify()`` wakes, on each condition
    a thread waits on through this clock: with :attr:`order` ``"oldest"`` the oldest
    (as CPython does), ``"newest"`` the newest, ``"soonest"`` the one asleep until the
    earliest deadline (a heartbeat thread with a job to beat, before an idle worker who
    waits for that job's lease to expire). A component whose every waiter may be woken
    by one ``notify()`` shows a lost wake-up on every run once a test tries each order,
    instead of when the threads happen to queue up so."""

    def __init__(self, start_ns: int) -> None:
        super().__init__(start_ns)
        self.order: WakeOrder = "oldest"

    def deadline_of_this_thread(self) -> float:
        """Until when the calling thread sleeps on this clock (inf: no deadline)."""
        with self._watch:
            deadline, _ = self._asleep.get(threading.get_ident(), (None, None))
        return math.inf if deadline is None else deadline

    def wait_until_ns(self, cond: threading.Condition, deadline_ns: int | None) -> None:
        if not isinstance(cond._waiters, _Waiters):  # type: ignore[attr-defined]
            cond._waiters = _Waiters(cond._waiters, self)  # type: ignore[attr-defined]
        super().wait_until_ns(cond, deadline_ns)


def beats_at_a_third(
    heartbeats: Callable[[], int],
    expiry: Callable[[], int | None],
    clock: WatchedClock,
    settle: Callable[[], None],
    who: str = "the pool",
    lease: int = LONG_LEASE,
) -> None:
    """One job leased at the clock's start, its handler parked, heartbeat_every_ns=None:
    no heartbeat at claim + lease // 3 - 1; one at that instant exactly (extending the
    lease to then + lease, where ``expiry`` can tell); the next a third later again.
    ``settle()`` returns once nothing can happen until the clock moves."""
    start, third = clock.now_ns(), lease // 3
    for beat in (1, 2):
        due = start + beat * third
        clock.set(due - 1)
        settle()
        check(
            heartbeats() == beat - 1,
            f"{who}: {heartbeats()} heartbeat(s) by {due - 1 - start} ns after the claim, "
            f"expected {beat - 1}: with heartbeat_every_ns=None the interval is a third "
            f"of the lease ({lease} // 3 = {third} ns), so heartbeat {beat} is due at "
            f"{due - start} ns and not before",
        )
        clock.set(due)
        settle()
        check(
            heartbeats() == beat,
            f"{who}: at {due - start} ns after the claim (= {beat} × lease // 3) "
            f"{heartbeats()} heartbeat(s) had happened, expected {beat}; every thread is "
            f"asleep on the clock, so nothing more happens before the clock moves: the "
            f"default interval (heartbeat_every_ns=None) must be a third of the lease, "
            f"{third} ns",
        )
        expires = expiry()
        if expires is None:
            continue  # the lease's expiry is not on this clock
        check(
            expires == due + lease,
            f"{who}: heartbeat {beat} at {due - start} ns must extend the lease to "
            f"{due + lease - start} ns after the claim; it expires at "
            f"{expires - start}",
        )


#: The heartbeat interval of the clock-jump checks, and (time since the claim, heartbeats
#: made by then) on a clock that jumps from the claim to 2.5 intervals: one heartbeat
#: there and then; the next is due an interval after it (1 050), not at 3 intervals (900).
JUMP_EVERY = 300
AFTER_A_JUMP = [(750, 1), (899, 1), (900, 1), (1_049, 1), (1_050, 2), (1_349, 2), (1_350, 3)]


def judge_beats_after_a_jump(story: Story, who: str, at: int, beats: int, want: int) -> None:
    """One step of :data:`AFTER_A_JUMP`: ``beats`` heartbeats counted at claim + ``at``."""
    story.add(f"clock at claim + {at}: {beats} heartbeat(s)")
    story.check(
        beats == want,
        f"{who}: each heartbeat is due heartbeat_every_ns={JUMP_EVERY} after the last one was "
        "made (the claim, for the first): a clock that jumps past several intervals gets one "
        "heartbeat then, and the next an interval later",
        f"at claim + {at} expected {want} heartbeat(s), got {beats}",
    )
