"""Waiters for whom time flies: a load that lasts longer than any timeout, with no real wait.

A waiter that gives up on a flight after a while — one second, one minute: whatever the
code under test picked — shows only when a load lasts longer than that. Inside
:class:`TimeFlies`, the threads it spawns find every timed wait they make through
``threading.Condition`` (``wait`` and ``wait_for``, which ``Event.wait``,
``Barrier.wait`` and ``Future.result`` wait in) cut to a zero timeout: what a timeout
that has already passed does — a wake-up already sent is taken, none is awaited. So for
them, any load the test holds open has lasted longer than their timeout, on every run,
while the test spends microseconds. A wait without a timeout is left as it is, and
:meth:`TimeFlies.settle` tells when each of them sleeps in one (or has returned): the
moment nothing more happens until the test lets the load land.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import Any

from katas._harness.waiting import QUIET_S, Thread, spawn

_POLL_S = 0.0005


class TimeFlies:
    """While entered, the threads started by :meth:`spawn` see every timed wait they make
    in ``threading.Condition`` end at once, as if its timeout had passed; no other thread
    is touched. :attr:`cut_short` names each thread whose timed wait was cut so."""

    def __init__(self) -> None:
        self.threads: list[Thread] = []
        self.cut_short: list[str] = []
        self._hurried: set[int] = set()
        self._asleep: dict[int, int] = {}  # untimed waits in progress, by thread
        self._saved: tuple[Any, Any] | None = None

    def spawn(self, fn: Callable[[], Any], name: str) -> Thread:
        """Start ``fn`` in a daemon thread for which time flies."""

        def hurried() -> Any:
            self._hurried.add(threading.get_ident())
            return fn()

        thread = spawn(hurried, name)
        self.threads.append(thread)
        return thread

    def settle(self, watch_s: float = QUIET_S) -> None:
        """Return once every thread spawned here has returned or sleeps in a wait with no
        timeout — or, at the latest, after ``watch_s`` (a thread that waits some other
        way, on a lock held for it, is never seen asleep: no failure here)."""
        give_up = time.monotonic() + watch_s
        while not self._settled() and time.monotonic() < give_up:
            time.sleep(_POLL_S)

    def _settled(self) -> bool:
        return all(not t.is_alive() or self._asleep.get(t.ident or 0, 0) > 0 for t in self.threads)

    @contextmanager
    def _waiting(self, timeout: float | None) -> Iterator[float | None]:
        """The timeout a wait of the calling thread gets: cut to zero if the thread is
        hurried; a hurried thread's wait with no timeout is noted while it lasts."""
        me = threading.get_ident()
        if me not in self._hurried:
            yield timeout
        elif timeout is not None:
            if threading.current_thread().name not in self.cut_short:
                self.cut_short.append(threading.current_thread().name)
            yield 0
        else:
            self._asleep[me] = self._asleep.get(me, 0) + 1
            try:
                yield None
            finally:
                self._asleep[me] -= 1

    def __enter__(self) -> TimeFlies:
        wait, wait_for = self._saved = threading.Condition.wait, threading.Condition.wait_for

        def timed_wait(cond: threading.Condition, timeout: float | None = None) -> bool:
            with self._waiting(timeout) as cut:
                return wait(cond, cut)

        def timed_wait_for(
            cond: threading.Condition, predicate: Callable[[], Any], timeout: float | None = None
        ) -> Any:
            with self._waiting(timeout) as cut:
                return wait_for(cond, predicate, cut)

        self._patch({"wait": timed_wait, "wait_for": timed_wait_for})
        return self

    @staticmethod
    def _patch(methods: dict[str, Any]) -> None:
        for name, method in methods.items():
            setattr(threading.Condition, name, method)

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._saved is not None:
            self._patch({"wait": self._saved[0], "wait_for": self._saved[1]})
            self._saved = None


__all__ = ["TimeFlies"]
