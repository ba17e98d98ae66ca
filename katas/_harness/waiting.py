"""Waiting in concurrency tests: hard real-time deadlines, never bare sleeps.

Tests sequence threads and tasks by observable state (a component's ``statistics()``),
polling with :func:`eventually`; every wait ends by a deadline, so a deadlock fails the
test in seconds instead of hanging the suite. Threads are daemons. Messages say what
did not happen; the plugin adds the stage (from the test's marker).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import anyio

#: Real seconds within which something that should happen promptly must have happened
#: (on a machine with a core for each thing running: see :func:`patience`).
DEADLINE_S = 5.0
#: Real seconds during which something that must NOT happen is watched for.
QUIET_S = 0.05
_POLL_S = 0.0005
#: How long a join waits between two looks at whether the component came to rest.
_JOIN_SLICE_S = 0.005


#: A fixed stretch of every hard deadline instead of the machine's load (1: never).
ENV_PATIENCE = "KATA_PATIENCE"


def patience() -> float:
    """How many times longer a hard deadline lasts on this machine now: the runnable
    load per core (the last minute's average), at least 1 — or ``KATA_PATIENCE``.

    A hard deadline is there to end a hang, not to judge speed: on a laptop busy with a
    build, or a machine running suites side by side, a correct test gets a fraction of a
    core, and its deadlines stretch with it — on an idle machine nothing changes.
    """
    text = os.environ.get(ENV_PATIENCE)
    if not text:
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0  # not on Windows
        return max(1.0, load / (os.cpu_count() or 1))
    try:
        return max(1.0, float(text))
    except ValueError:
        raise ValueError(f"{ENV_PATIENCE} must be a number, got {text!r}") from None


@contextmanager
def tiny_switch_interval() -> Iterator[None]:
    """Make the interpreter switch threads as often as it can: races show up."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


class Thread(threading.Thread):
    """A daemon thread running ``fn``; :meth:`outcome` joins it with a hard deadline."""

    def __init__(self, fn: Callable[[], Any], name: str) -> None:
        super().__init__(name=name, daemon=True)
        self._fn = fn
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self._fn()
        except BaseException as e:  # re-raised in the test's thread by outcome()
            self.error = e

    def outcome(self, what: str) -> Any:
        """Join (hard deadline); re-raise what ``fn`` raised, else return its result. If
        the component comes to rest (:func:`at_rest`) with the thread still in it, two
        looks a poll apart, judge then: it can no longer return."""
        seconds = DEADLINE_S * patience()
        deadline = time.monotonic() + seconds
        rested = False
        while self.is_alive() and time.monotonic() < deadline:
            self.join(_JOIN_SLICE_S)
            if self.is_alive() and _rested_short_of(lambda: not self.is_alive()):
                rested = True
                break
        assert not self.is_alive(), (
            f"{self.name} did not return — {what}: every thread of the test came to rest "
            f"with it still inside (asleep on the test's clock, none due), so it never "
            f"will{_why()}"
            if rested
            else f"{self.name} did not return within {seconds:.0f} real seconds — {what}{_why()}"
        )
        if self.error is not None:
            raise self.error
        return self.result


def spawn(fn: Callable[[], Any], name: str) -> Thread:
    """Start ``fn`` in a daemon :class:`Thread`."""
    thread = Thread(fn, name)
    thread.start()
    return thread


# --- at rest: nothing more can happen until the test acts ----------------------------

#: Checks a test's fixtures register (:func:`at_rest`): each says whether the component
#: under test has come to rest, e.g. every thread it started asleep on a frozen test
#: clock. Forgotten after each test (:func:`begin_test`).
_rest_checks: list[Callable[[], bool]] = []
_threads_before: set[threading.Thread] = set()


#: What killed threads of the component during the current test (their name and error):
#: a wait that ends short names them, since a dead thread is why nothing more happens.
_deaths: list[str] = []


class _DeathRecorder:
    """``threading.excepthook`` that notes each thread death, then passes it on."""

    def __init__(self, chained: Callable[[threading.ExceptHookArgs], Any]) -> None:
        self._chained = chained

    def __call__(self, args: threading.ExceptHookArgs) -> None:
        name = args.thread.name if args.thread is not None else "a thread"
        _deaths.append(f"{name}: {args.exc_type.__name__}: {args.exc_value}")
        self._chained(args)


def begin_test() -> None:
    """A test begins (the plugin calls this): no rest checks, no thread deaths, and the
    threads alive now are not the test's."""
    global _threads_before
    _rest_checks.clear()
    _deaths.clear()
    _threads_before = set(threading.enumerate())
    if not isinstance(threading.excepthook, _DeathRecorder):  # wrap the current hook
        threading.excepthook = _DeathRecorder(threading.excepthook)


def _why() -> str:
    """The thread deaths of this test, as a clause for a failed wait's message."""
    return f" — meanwhile a thread died of an error: {'; '.join(_deaths)}" if _deaths else ""


def threads_before_test() -> set[threading.Thread]:
    """The threads that were alive when the current test began (none of them its own)."""
    return set(_threads_before)


def at_rest(check: Callable[[], bool]) -> None:
    """Register, for the current test, a check that the component has come to rest:
    while it holds, :func:`eventually` and :meth:`Thread.outcome` judge at once instead
    of waiting out their deadline for what can no longer happen (a red run stays short)."""
    _rest_checks.append(check)


def _resting() -> bool:
    return any(check() for check in _rest_checks)


def _rested_short_of(done: Callable[[], bool]) -> bool:
    """The component is at rest with ``done()`` still false, at two looks a poll apart
    (a thread woken between them is not at rest at the second): nothing more can happen."""
    if not (_rest_checks and _resting()):
        return False
    time.sleep(_POLL_S)
    return not done() and _resting()


def eventually(pred: Callable[[], bool], what: str) -> None:
    """Wait (hard real-time deadline) until ``pred()``; polling only. If the component
    comes to rest (:func:`at_rest`) short of it, two looks a poll apart, judge then."""
    seconds = DEADLINE_S * patience()
    deadline = time.monotonic() + seconds
    rested = False
    while not pred() and time.monotonic() < deadline:
        if _rested_short_of(pred):
            rested = True
            break
        time.sleep(_POLL_S)
    if rested:
        assert pred(), (
            f"expected {what}, but everything came to rest short of it (every thread "
            f"asleep on the test's clock, none due): nothing more can happen{_why()}"
        )
    assert pred(), f"within {seconds:.0f} real seconds, expected {what}{_why()}"


def stays(pred: Callable[[], bool], what: str) -> None:
    """Watch for :data:`QUIET_S` that ``pred()`` keeps holding."""
    deadline = time.monotonic() + QUIET_S
    while time.monotonic() < deadline:
        assert pred(), f"expected {what} to keep holding, but it changed"
        time.sleep(_POLL_S)


@contextmanager
def bounded(what: str, seconds: float | None = None) -> Iterator[None]:
    """Run the block of an async test under a hard real-time deadline (``DEADLINE_S``,
    stretched by :func:`patience`, unless ``seconds``); past it, fail saying ``what`` was
    awaited, instead of hanging the suite or raising a bare TimeoutError."""
    limit = DEADLINE_S * patience() if seconds is None else seconds
    with anyio.move_on_after(limit) as scope:
        yield
    if scope.cancelled_caught:
        raise AssertionError(f"within {limit:g} real seconds, expected {what}")


async def eventually_async(pred: Callable[[], bool], what: str) -> None:
    """Wait (hard real-time deadline) until ``pred()``, letting other tasks run."""
    with anyio.move_on_after(DEADLINE_S):
        while not pred():
            await anyio.sleep(_POLL_S)
    assert pred(), f"within {DEADLINE_S:.0f} real seconds, expected {what}"


async def stays_async(pred: Callable[[], bool], what: str) -> None:
    """Watch for :data:`QUIET_S` that ``pred()`` keeps holding, letting other tasks run."""
    with anyio.move_on_after(QUIET_S):
        while True:
            assert pred(), f"expected {what} to keep holding, but it changed"
            await anyio.sleep(_POLL_S)
