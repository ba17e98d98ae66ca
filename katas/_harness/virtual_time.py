"""Virtual time for async tests: a :class:`ManualClock` that moves only when every task
waits, on asyncio and on trio.

A test drives time from its own task. :meth:`VirtualTime.settle` returns once every
other task is blocked (on an event, a lock, a clock deadline); :meth:`advance_to` then
moves the clock deadline by deadline — settling at each, so every task due at an instant
has run before time moves on — and :meth:`run_until` jumps from deadline to deadline
until a condition holds. Simulated seconds cost microseconds, and nothing depends on
how fast the machine is. Tasks woken at the same instant run in the backend's order,
so a test does not depend on the order of two tasks due at one instant.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import anyio
import anyio.lowlevel

from katas._runtime.clock import ManualClock

#: Consecutive scheduler passes that must find every task blocked.
_QUIET_PASSES = 2
#: Scheduler passes within which every task must be waiting, on either backend. Correct
#: code settles in a few dozen passes; a polling loop never does, and a low bound keeps
#: a red run (hypothesis shrinks a failure many times) fast. Passes, not seconds: on a
#: busy machine a pass takes longer, and the verdict must not change.
SETTLE_PASSES = 2_000
#: A bound in real seconds for a call that must return at once (never a settle's bound).
SETTLE_S = 2.0
_NEVER_WAITS = (
    "expected every task to be waiting (on an event or the clock) within {within}; one "
    "never waits: a polling loop — such as a task that sleeps again and again until a "
    "deadline that has passed"
)


def _asyncio_blocked(task: asyncio.Task[object]) -> bool:
    """A task waiting on a future that is not done yet (asyncio keeps it private)."""
    if task.done():
        return True
    waiter = getattr(task, "_fut_waiter", None)
    return waiter is not None and not waiter.done()


def _asyncio_quiet() -> bool:
    me = asyncio.current_task()
    return all(t is me or _asyncio_blocked(t) for t in asyncio.all_tasks())


def _on_asyncio() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # no asyncio loop: trio runs this task
        return False
    return True


async def settle() -> None:
    """Return once every other task of the test is blocked (an AssertionError if some
    task never waits: a polling loop)."""
    if _on_asyncio():
        await _asyncio_settle()
    else:
        await _trio_settle()


async def _asyncio_settle() -> None:
    quiet = 0
    for _ in range(SETTLE_PASSES):
        await asyncio.sleep(0)
        quiet = quiet + 1 if _asyncio_quiet() else 0
        if quiet >= _QUIET_PASSES:
            return
    raise AssertionError(_NEVER_WAITS.format(within=f"{SETTLE_PASSES} scheduler passes"))


async def _trio_settle() -> None:
    # trio's own wait is exact; a polling loop is told by the passes of its scheduler,
    # which an instrument counts (trio calls before_io_wait once a pass).
    import trio
    import trio.testing

    class Passes(trio.abc.Instrument):
        def __init__(self, scope: trio.CancelScope) -> None:
            self.scope, self.left = scope, SETTLE_PASSES

        def before_io_wait(self, timeout: float) -> None:
            self.left -= 1
            if self.left == 0:
                self.scope.cancel()

    with trio.CancelScope() as scope:
        passes = Passes(scope)
        trio.lowlevel.add_instrument(passes)
        try:
            await trio.testing.wait_all_tasks_blocked()
        finally:
            trio.lowlevel.remove_instrument(passes)
    if scope.cancelled_caught:
        raise AssertionError(_NEVER_WAITS.format(within=f"{SETTLE_PASSES} scheduler passes"))


class VirtualTime:
    """Moves ``clock`` for a test: only from the test's task, only when all else waits."""

    def __init__(self, clock: ManualClock) -> None:
        self.clock = clock

    @property
    def now_ns(self) -> int:
        return self.clock.now_ns()

    async def settle(self) -> None:
        await settle()

    async def advance_to(self, when_ns: int) -> None:
        """Move to ``when_ns`` through every deadline before it; settled at each."""
        clock = self.clock
        if when_ns < clock.now_ns():
            raise ValueError(f"virtual time moves forward: {when_ns} < now {clock.now_ns()}")
        await settle()
        while (due := clock.next_deadline_ns()) is not None and due <= when_ns:
            clock.advance(max(0, due - clock.now_ns()))
            await settle()
        clock.advance(when_ns - clock.now_ns())
        await settle()

    async def advance(self, ns: int) -> None:
        await self.advance_to(self.clock.now_ns() + ns)

    async def run_until(self, done: Callable[[], bool], *, within_ns: int, what: str) -> None:
        """Jump from deadline to deadline until ``done()``; an AssertionError naming
        ``what`` when every task waits with no deadline to reach, or past ``within_ns``."""
        clock = self.clock
        limit = clock.now_ns() + within_ns
        await settle()
        while not done():
            due = clock.next_deadline_ns()
            if due is None:
                raise AssertionError(
                    f"expected {what}, but every task waits and none waits for a time "
                    f"(simulated time {clock.now_ns()} ns): nothing more will happen"
                )
            if due > limit:
                raise AssertionError(
                    f"expected {what} within {within_ns} simulated ns, but it had not "
                    f"happened at {clock.now_ns()} ns"
                )
            clock.advance(max(0, due - clock.now_ns()))
            await settle()


class JumpingClock:
    """Simulated time for a benchmark with one sleeper: a sleep moves the clock to its
    deadline at once (after a checkpoint). Faster than :class:`VirtualTime`, and only
    right when nothing else waits on the clock."""

    def __init__(self, start_ns: int = 0) -> None:
        self._now = start_ns

    def now_ns(self) -> int:
        return self._now

    def wait_until_ns(self, cond: threading.Condition, deadline_ns: int | None) -> None:
        raise NotImplementedError("JumpingClock is for tasks, not threads")

    async def sleep_until_ns_async(self, deadline_ns: int) -> None:
        self._now = max(self._now, deadline_ns)
        await anyio.lowlevel.checkpoint()


__all__ = ["SETTLE_PASSES", "SETTLE_S", "JumpingClock", "VirtualTime", "settle"]
