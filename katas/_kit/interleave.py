"""Forcing an interleaving: park a thread at a named point, run another through, release.

A race "between the check and the act" (a lock released early, a check and a join under
two acquisitions, user code called under a lock) shows up by luck in a burst of threads,
and on every run once a test parks one thread exactly there:

    gate = Gate("inside the loader")
    t = spawn(lambda: cache.get_or_load("k", gate.wrap(load)), "leader")
    gate.wait_arrived()            # the leader is inside its loader now
    ...                            # run the other thread through, assert what it sees
    gate.open()
    t.outcome("the leader returns once released")

:class:`Parked` does the same for calls on an object the code under test holds (its inner
cache, its queue): the chosen methods park at a gate before they run, while the calling
thread holds whatever lock it took around the call. Every wait has a hard deadline.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection
from typing import Any, TypeVar

from katas._kit.waiting import DEADLINE_S

T = TypeVar("T")


class Gate:
    """A point where threads park until the test opens it.

    ``pass_through()`` is called by the code being held (a loader, a handler, a wrapped
    method); the test waits for ``arrivals`` with :meth:`wait_arrived` and lets them go
    with :meth:`open`. Once open, the gate stays open. A ``limit`` parks only the first
    ``limit`` arrivals; later ones pass at once.
    """

    def __init__(self, name: str, *, tag: str = "stage 2", limit: int | None = None) -> None:
        self.name = name
        self.tag = tag
        self.limit = limit
        self.arrivals = 0
        self._opened = threading.Event()
        self._changed = threading.Condition()

    def pass_through(self) -> None:
        with self._changed:
            self.arrivals += 1
            parked = self.limit is None or self.arrivals <= self.limit
            self._changed.notify_all()
        if parked and not self._opened.wait(DEADLINE_S):
            raise AssertionError(
                f"{self.tag}: a thread waited at the gate '{self.name}' for "
                f"{DEADLINE_S:.0f} real seconds: the test never opened it"
            )

    def wrap(self, fn: Callable[..., T]) -> Callable[..., T]:
        """``fn`` that first passes through this gate."""

        def gated(*args: Any, **kwargs: Any) -> T:
            self.pass_through()
            return fn(*args, **kwargs)

        return gated

    def wait_arrived(self, count: int = 1) -> None:
        """Wait (hard deadline) until ``count`` threads have reached the gate."""
        with self._changed:
            ok = self._changed.wait_for(lambda: self.arrivals >= count, DEADLINE_S)
        assert ok, (
            f"{self.tag}: within {DEADLINE_S:.0f} real seconds, expected {count} thread(s) "
            f"at '{self.name}', saw {self.arrivals}"
        )

    def open(self) -> None:
        self._opened.set()

    @property
    def is_open(self) -> bool:
        return self._opened.is_set()


class Parked:
    """Stands in for ``inner``: calls to the methods in ``at`` pass through ``gate`` first.

    Every other attribute is ``inner``'s own. :attr:`inside` counts calls in progress on
    any method, so a test can see whether two threads are ever inside at once.
    """

    def __init__(self, inner: Any, gate: Gate, at: Collection[str]) -> None:
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_gate", gate)
        object.__setattr__(self, "_at", frozenset(at))
        object.__setattr__(self, "_count", threading.Lock())
        object.__setattr__(self, "inside", 0)
        object.__setattr__(self, "most_inside", 0)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            with self._count:
                object.__setattr__(self, "inside", self.inside + 1)
                object.__setattr__(self, "most_inside", max(self.most_inside, self.inside))
            try:
                if name in self._at:
                    self._gate.pass_through()
                return attr(*args, **kwargs)
            finally:
                with self._count:
                    object.__setattr__(self, "inside", self.inside - 1)

        return call

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._inner, name, value)

    def __len__(self) -> int:
        return len(self._inner)


__all__ = ["Gate", "Parked"]
