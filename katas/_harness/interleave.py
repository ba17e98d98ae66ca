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
thread holds whatever lock it took around the call. :func:`pause_after_wakes` stops a
thread right after each wake-up it sends (``Event.set``, ``Condition.notify``), so its
waiters run before its next line: "wake, then write" is caught on every run;
:func:`pause_after_unlocks` stops it right after each lock section it leaves, so the
others run in the gap: "check, unlock, act" is caught too; :func:`pause_in_updates`
stops it between reading a field and writing it back (``self.waiting -= 1``), so an
unlocked counter loses another thread's update on every run; :func:`pause_in_loops`
stops it before each step of a loop, so an unlocked walk over a shared dict meets another
thread's change; :func:`pause_before_locks` stops it before each ``with`` block, so what
it read before taking the lock is stale; and :func:`announce_waits` tells when a thread
has gone to sleep in threading's waits.
Every wait has a hard deadline.
"""

from __future__ import annotations

import dis
import functools
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterator
from types import FrameType
from typing import Any, TypeVar

from katas._harness.waiting import DEADLINE_S, eventually

T = TypeVar("T")


class Gate:
    """A point where threads park until the test opens it.

    ``pass_through()`` is called by the code being held (a loader, a handler, a wrapped
    method); the test waits for ``arrivals`` with :meth:`wait_arrived` and lets them go
    with :meth:`open`. Once open, the gate stays open. A ``limit`` parks only the first
    ``limit`` arrivals; later ones pass at once.
    """

    def __init__(self, name: str, *, limit: int | None = None) -> None:
        self.name = name
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
                f"a thread waited at the gate '{self.name}' for "
                f"{DEADLINE_S:.0f} real seconds: the test never opened it"
            )

    def wrap(self, fn: Callable[..., T]) -> Callable[..., T]:
        """``fn`` that first passes through this gate."""

        def gated(*args: Any, **kwargs: Any) -> T:
            self.pass_through()
            return fn(*args, **kwargs)

        return gated

    def wait_arrived(self, count: int = 1) -> None:
        """Wait (hard deadline, or until the component is at rest) until ``count``
        threads have reached the gate."""
        eventually(
            lambda: self.arrivals >= count,
            f"{count} thread(s) at '{self.name}'",
        )

    def open(self) -> None:
        self._opened.set()

    @property
    def is_open(self) -> bool:
        return self._opened.is_set()


class Parked:
    """Stands in for ``inner``: calls to the methods in ``at`` pass through ``gate`` first.

    Every other attribute is ``inner``'s own; ``len()``, ``in`` and iteration are calls
    like the others. :attr:`inside` counts calls in progress, :attr:`most_inside` the most
    ever at once, and :attr:`overlaps` names each call that began while another was inside
    (with ``let_in``, each call first gives other threads the chance to come in: a missing
    lock shows up on every run). Names in ``ignore`` (the inner object's own callables, like
    a ``weigh`` function) are handed out as they are.
    """

    def __init__(
        self,
        inner: Any,
        gate: Gate | None = None,
        at: Collection[str] = (),
        *,
        let_in: bool = False,
        ignore: Collection[str] = (),
    ) -> None:
        state = dict(
            _inner=inner,
            _gate=gate,
            _at=frozenset(at),
            _let_in=let_in,
            _ignore=frozenset(ignore),
            _changed=threading.Condition(),
            inside=0,
            most_inside=0,
            overlaps=[],
        )
        for name, value in state.items():
            object.__setattr__(self, name, value)

    def wait_overlaps(self, count: int, timeout_s: float) -> None:
        """Wait at most ``timeout_s`` until ``count`` calls overlapped another (no failure:
        the caller asserts on :attr:`overlaps`)."""
        with self._changed:
            self._changed.wait_for(lambda: len(self.overlaps) >= count, timeout_s)

    def _call(self, name: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        with self._changed:
            if self.inside:
                self.overlaps.append(name)
                self._changed.notify_all()
            object.__setattr__(self, "inside", self.inside + 1)
            object.__setattr__(self, "most_inside", max(self.most_inside, self.inside))
        try:
            if self._let_in:
                time.sleep(0)
            if self._gate is not None and name in self._at:
                self._gate.pass_through()
            return fn(*args, **kwargs)
        finally:
            with self._changed:
                object.__setattr__(self, "inside", self.inside - 1)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if not callable(attr) or name in self._ignore:
            return attr
        return functools.partial(self._call, name, attr)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._inner, name, value)

    def __len__(self) -> int:
        return int(self._call("__len__", self._inner.__len__))

    def __contains__(self, key: object) -> bool:
        return bool(self._call("__contains__", self._inner.__contains__, key))

    def __iter__(self) -> Iterator[Any]:
        return iter(self._call("__iter__", self._inner.__iter__))


#: threading's own wake-ups: Event.set, and Condition.notify and notify_all (which
#: Semaphore, Barrier and queue.Queue wake their waiters through).
_WAKES = frozenset({"set", "notify", "notify_all"})


def pause_after_wakes(woken: Callable[[], bool], deadline_s: float = 0.05) -> None:
    """From now on, the calling thread stops right after each wake-up it sends through
    threading's primitives, until ``woken()`` holds (the woken threads are done) or
    ``deadline_s`` has passed; once ``woken()`` holds it stops no more.

    A waker that wakes its waiters before it writes what they read ("set, then store the
    value") is caught in the act: the waiters run through while it stands between the
    two, on every run — a switch interval would almost never cut it there. Call it from
    the thread under test (a loader's last line); it ends with that thread.
    """

    def stop_after_a_wake(frame: Any, event: str, arg: object) -> None:
        if event != "return" or frame.f_code.co_name not in _WAKES:
            return
        if frame.f_globals.get("__name__") != "threading":
            return
        deadline = time.monotonic() + deadline_s
        while not woken() and time.monotonic() < deadline:
            time.sleep(0.0005)
        if woken():
            sys.setprofile(None)

    sys.setprofile(stop_after_a_wake)


#: How a lock section ends: ``Lock``/``RLock`` ``__exit__`` or ``release`` (C calls), and
#: ``Condition.__exit__`` (threading's own Python code).
_UNLOCKS = frozenset({"__exit__", "release"})


def pause_after_unlocks(
    module: str, woken: Callable[[], bool], done: Callable[[], bool], deadline_s: float = 0.05
) -> None:
    """From now on, the calling thread stops right after each lock it releases in the
    code of ``module`` (the component under test), until ``woken()`` holds or
    ``deadline_s`` has passed; once ``done()`` holds it stops no more.

    A component that does in two lock sections what must be one ("claim, unlock, then
    record the claim") is caught between them: the other threads take the lock in the
    gap, on every run. Call it from the thread under test (a wrapped call it makes).
    """

    def released_here(frame: Any, event: str, arg: Any) -> bool:
        if event == "c_return":  # a Lock's or RLock's own method, called from ``frame``
            name = getattr(arg, "__name__", "")
            return name in _UNLOCKS and frame.f_globals.get("__name__") == module
        if event != "return" or frame.f_code.co_name != "__exit__":
            return False
        caller = frame.f_back
        return (
            frame.f_globals.get("__name__") == "threading"
            and caller is not None
            and caller.f_globals.get("__name__") == module
        )

    def stop_after_an_unlock(frame: Any, event: str, arg: Any) -> None:
        if not released_here(frame, event, arg):
            return
        if done():
            sys.setprofile(None)
            return
        deadline = time.monotonic() + deadline_s
        while not woken() and time.monotonic() < deadline:
            time.sleep(0.0005)

    sys.setprofile(stop_after_an_unlock)


#: The reads and writes of a field :func:`_updates` pairs: an attribute's (by name), a
#: subscript's (any: ``d[k] += 1`` reads and writes whatever ``d[k]`` is).
_READS, _WRITES = (
    frozenset({"LOAD_ATTR", "BINARY_SUBSCR"}),
    frozenset({"STORE_ATTR", "STORE_SUBSCR"}),
)


def _field(ins: dis.Instruction) -> object:
    return ins.argval if ins.opname.endswith("_ATTR") else "[]"


def _updates(code: Any) -> frozenset[int]:
    """Where ``code`` writes back a field it read on the same line: the offsets of each
    ``STORE_ATTR`` of an attribute loaded on its line (``self.n -= 1``, ``self.n = self.n
    + 1``) and each ``STORE_SUBSCR`` after a subscript read on its line (``d[k] += 1``)."""
    found: set[int] = set()
    read_on: dict[int | None, set[object]] = {}
    for ins in dis.get_instructions(code):
        line = ins.positions.lineno if ins.positions else None
        if ins.opname in _READS:
            read_on.setdefault(line, set()).add(_field(ins))
        elif ins.opname in _WRITES and _field(ins) in read_on.get(line, ()):
            found.add(ins.offset)
    return frozenset(found)


def pause_in_updates(
    module: str, woken: Callable[[], bool], done: Callable[[], bool], deadline_s: float = 0.05
) -> None:
    """From now on, the calling thread stops right before each write of a field it read
    on the same line (``self.waiting -= 1``, ``counts[key] += 1``) in the code of
    ``module``, until ``woken()`` holds or ``deadline_s`` has passed; once ``done()``
    holds it stops no more.

    An update made outside the lock that guards the field loses the updates other
    threads make while it stands between its read and its write — on every run, where a
    switch interval would cut it there once in a million. Inside the lock the others
    wait, and the stop ends at its deadline. Call it from the thread under test.
    """
    _pause_at(_updates, module, woken, done, deadline_s)


def pause_in_loops(
    module: str, woken: Callable[[], bool], done: Callable[[], bool], deadline_s: float = 0.05
) -> None:
    """From now on, the calling thread stops before each step of every loop (each
    ``for``, each comprehension's) in the code of ``module``, until ``woken()`` holds or
    ``deadline_s`` has passed; once ``done()`` holds it stops no more.

    A walk over a shared collection made outside the lock that guards it meets the
    changes other threads make between two of its steps: a dict that changed size during
    iteration, a count read half before and half after. Inside the lock the others wait,
    and each stop ends at its deadline. Call it from the thread under test.
    """
    _pause_at(_loop_steps, module, woken, done, deadline_s)


def pause_before_locks(
    module: str, woken: Callable[[], bool], done: Callable[[], bool], deadline_s: float = 0.05
) -> None:
    """From now on, the calling thread stops right before each ``with`` block it enters
    in the code of ``module`` (taking a lock, most often), until ``woken()`` holds or
    ``deadline_s`` has passed; once ``done()`` holds it stops no more.

    What the thread read before the block is stale by the time it is inside: another
    thread changed it in the gap. A read made under the lock sees the change. Call it
    from the thread under test.
    """
    _pause_at(_with_blocks, module, woken, done, deadline_s)


def _pause_at(
    spots: Callable[[Any], frozenset[int]],
    module: str,
    woken: Callable[[], bool],
    done: Callable[[], bool],
    deadline_s: float,
) -> None:
    """Trace the calling thread's frames of ``module`` by opcode, stopping at the
    offsets ``spots(code)`` finds (see :func:`pause_in_updates`)."""
    offsets: dict[Any, frozenset[int]] = {}

    def stop_at_a_spot(frame: Any, event: str, arg: Any) -> Any:
        if event != "opcode":
            return stop_at_a_spot
        code = frame.f_code
        where = offsets.get(code)
        if where is None:
            where = offsets[code] = spots(code)
        if frame.f_lasti in where:
            if done():
                sys.settrace(None)
                frame.f_trace = None
                return None
            deadline = time.monotonic() + deadline_s
            while not woken() and time.monotonic() < deadline:
                time.sleep(0.0005)
        return stop_at_a_spot

    def in_module(frame: Any, event: str, arg: Any) -> Any:
        if frame.f_globals.get("__name__") != module:
            return None
        frame.f_trace_opcodes = True
        return stop_at_a_spot

    sys.settrace(in_module)
    # The module's frames already running stop too: a handler or a loader calls this,
    # and the code that called it does its updates once it returns.
    caller: FrameType | None = sys._getframe(2)
    while caller is not None:
        if caller.f_globals.get("__name__") == module:
            caller.f_trace_opcodes = True
            caller.f_trace = stop_at_a_spot
        caller = caller.f_back


def _with_blocks(code: Any) -> frozenset[int]:
    """The offsets of ``code``'s ``BEFORE_WITH``: each ``with`` block it enters."""
    return frozenset(
        ins.offset for ins in dis.get_instructions(code) if ins.opname == "BEFORE_WITH"
    )


def _loop_steps(code: Any) -> frozenset[int]:
    """The offsets of ``code``'s ``FOR_ITER``: each step of a loop or comprehension."""
    return frozenset(ins.offset for ins in dis.get_instructions(code) if ins.opname == "FOR_ITER")


def announce_waits(asleep: threading.Event) -> None:
    """From now on, the calling thread sets ``asleep`` whenever it starts waiting in
    threading's ``wait`` (an ``Event``'s, a ``Condition``'s): the moment another thread
    may act on the state it left behind. Call it from that thread."""

    def on_wait(frame: Any, event: str, arg: object) -> None:
        if event != "call" or frame.f_code.co_name != "wait":
            return
        if frame.f_globals.get("__name__") == "threading":
            asleep.set()

    sys.setprofile(on_wait)


__all__ = [
    "Gate",
    "Parked",
    "announce_waits",
    "pause_after_unlocks",
    "pause_after_wakes",
    "pause_before_locks",
    "pause_in_loops",
    "pause_in_updates",
]
