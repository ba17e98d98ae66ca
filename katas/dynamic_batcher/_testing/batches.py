"""Drivers for the stage-2 request batcher's tests: a model for ``fn`` the test
controls, callers that record what ``submit`` gave them, and waits that settle every
task before a test looks.

:class:`Model` records every batch and the instant it was called, and where a test says
so holds the batch until the test releases it; :class:`Caller` runs one ``submit`` in a
cancel scope of its own. Time is a ``ManualClock`` that moves only when the test
advances it; :func:`settle` (the harness's) lets every task run until all of them wait.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.abc

from katas._harness.under_test import stage
from katas._harness.virtual_time import settle
from katas._runtime.clock import NS_PER_MS, ManualClock
from katas._runtime.todo import Todo
from katas.dynamic_batcher.api import BatchStatistics, EngineClosed, RequestBatcher

#: The max_queue_delay_ns of most tests: 100 ms.
DELAY = 100 * NS_PER_MS
#: The request batcher under test, over a :class:`Model` (any item in, a string out).
ItemBatcher = RequestBatcher[object, str]


# -- the test's side: a model for fn, callers, waits --------------------------------------


def answer(item: object) -> str:
    """What the model answers for one item: derived from the item, so a caller that gets
    another caller's result shows."""
    return f"embedding of {item!r}"


class Poisoned(Exception):
    """What the model raises for a batch holding one of its poison items."""


class Model:
    """The ``fn`` under the batcher. Records each call's items (``batches``), the clock's
    time at the call (``times``) and how it ended (``ended``: "returned", "raised",
    "cancelled", "" while it runs), and answers each item with :func:`answer`.

    ``held``: each call waits until the test releases it (``release(n)``,
    ``release_all()``). ``failures[n]``: call n raises that exception; a batch holding an
    item of ``poison`` raises a fresh :class:`Poisoned` (kept in ``raised[n]``);
    ``counts[n]``: call n returns that many results instead of one per item;
    ``answers[item]``: the result for that item instead of :func:`answer`'s (None, 0, …);
    ``at_end[n]``: called in call n once it is released, just before it returns or raises,
    with no await after it (a caller it cancels has its outcome before it runs again).
    """

    def __init__(self, clock: ManualClock, *, held: bool = False) -> None:
        self.clock = clock
        self.held = held
        self.batches: list[list[Any]] = []
        self.times: list[int] = []
        self.ended: list[str] = []
        self.failures: dict[int, BaseException] = {}
        self.raised: dict[int, BaseException] = {}
        self.counts: dict[int, int] = {}
        self.poison: frozenset[Any] = frozenset()
        self.answers: dict[Any, Any] = {}
        self.at_end: dict[int, Callable[[], None]] = {}
        self._gates: list[anyio.Event] = []
        self._all_released = False

    async def __call__(self, items: Sequence[Any]) -> list[Any]:
        n = len(self.batches)
        self.batches.append(list(items))
        self.times.append(self.clock.now_ns())
        self.ended.append("")
        gate = anyio.Event()
        self._gates.append(gate)
        if self._all_released:
            gate.set()
        try:
            if self.held:
                await gate.wait()
            else:
                await anyio.lowlevel.checkpoint()  # a real model awaits its device
        except anyio.get_cancelled_exc_class():
            self.ended[n] = "cancelled"
            raise
        if n in self.at_end:
            self.at_end[n]()
        error = self.failures.get(n)
        if error is None and self.poison.intersection(self.batches[n]):
            error = Poisoned(f"batch {n} holds a poison item")
        if error is not None:
            self.raised[n] = error
            self.ended[n] = "raised"
            raise error
        results = [self.answers.get(item, answer(item)) for item in items]
        if n in self.counts:
            results = (results + [answer("an extra item")] * self.counts[n])[: self.counts[n]]
        self.ended[n] = "returned"
        return results

    def release(self, n: int) -> None:
        self._gates[n].set()

    def release_all(self) -> None:
        self._all_released = True
        for gate in self._gates:
            gate.set()

    def describe(self) -> str:
        calls = [f"{b} at {t}" for b, t in zip(self.batches, self.times, strict=True)]
        return f"fn was called with {calls or 'nothing'}"


_NOTHING: Any = object()


class Caller:
    """One task calling ``submit(item)`` in a cancel scope of its own (``cancel()``).
    Records what it got: ``result``, ``error`` (the exception submit raised) or
    ``cancelled``. A stub's ``Todo`` is not an outcome: it propagates."""

    def __init__(self, batcher: ItemBatcher, item: Any, order: list[Any] | None = None) -> None:
        self.batcher = batcher
        self.item = item
        self.order = order  # where to note the item as submit() is called
        self.scope = anyio.CancelScope()
        self.result: Any = _NOTHING
        self.error: BaseException | None = None
        self.cancelled = False
        self.done = False

    async def run(self) -> None:
        try:
            with self.scope:
                if self.order is not None:
                    self.order.append(self.item)
                self.result = await self.batcher.submit(self.item)
            self.cancelled = self.scope.cancelled_caught
        except Todo:
            raise
        except Exception as exc:  # what submit raised: what the test checks
            self.error = exc
        finally:
            self.done = True

    def cancel(self) -> None:
        self.scope.cancel()

    def outcome(self) -> str:
        if self.error is not None:
            return f"raised {self.error!r}"
        if self.result is not _NOTHING:
            return f"returned {self.result!r}"
        return "was cancelled" if self.cancelled else "is still waiting"


async def settled(pred: Callable[[], bool], what: str) -> None:
    """Let every task run until all of them wait; then ``pred()`` must hold: with the
    clock still, nothing more will happen."""
    await settle()
    assert pred(), f"once every task waits (the clock still), expected {what}"


def new_batcher(model: Model, *, max_batch_size: int, delay: int = DELAY) -> ItemBatcher:
    batcher: ItemBatcher = stage().DynamicBatcher(
        model, max_batch_size=max_batch_size, max_queue_delay_ns=delay, clock=model.clock
    )
    return batcher


@asynccontextmanager
async def serving(batcher: ItemBatcher, model: Model) -> AsyncIterator[ItemBatcher]:
    """``async with batcher``; a test that fails leaves no batch held, so closing ends."""
    async with batcher:
        try:
            yield batcher
        finally:
            model.release_all()


async def submit(tg: anyio.abc.TaskGroup, batcher: ItemBatcher, item: Any) -> Caller:
    """Start a caller of ``submit(item)`` and let every task run until all wait."""
    caller = Caller(batcher, item)
    tg.start_soon(caller.run, name=f"submit({item!r})")
    await settle()
    return caller


async def outcomes(callers: Sequence[Caller], what: str) -> None:
    """Let every task run until all wait; by then every caller must have its outcome."""
    await settle()
    waiting = [c.item for c in callers if not c.done]
    assert not waiting, (
        f"{what}: once every task waits, every caller must have its outcome; still waiting "
        f"in submit(): {waiting}"
    )


def stats(batcher: ItemBatcher) -> BatchStatistics:
    got = batcher.statistics()
    assert isinstance(got, BatchStatistics), f"statistics() must return BatchStatistics: {got!r}"
    return got


def expect_results(callers: Sequence[Caller], why: str) -> None:
    wrong = [c for c in callers if c.result != answer(c.item) or c.error is not None]
    assert not wrong, f"{why}: each caller must get fn's result for its own item\n" + "\n".join(
        f"  submit({c.item!r}) {c.outcome()}; expected {answer(c.item)!r}" for c in wrong
    )


def expect_nothing_sent(model: Model, batcher: ItemBatcher, why: str) -> None:
    assert not model.batches and stats(batcher).dispatched == 0, (
        f"{why}: no batch may be sent yet; {model.describe()}, statistics() {stats(batcher)}"
    )


def expect_capped_and_in_order(
    model: Model, callers: list[Caller], order: list[str], size: int, why: str
) -> None:
    """Every accepted item sent once, oldest first (``order``: as submit() was called),
    in batches of at most ``size``; each of their callers got its own result."""
    accepted = [c for c in callers if not isinstance(c.error, EngineClosed)]
    items = [i for i in order if i in {c.item for c in accepted}]
    # Batches sent at one instant run concurrently: fn may see them in either order.
    batches = sorted(model.batches, key=lambda batch: order.index(batch[0]))
    sent = [item for batch in batches for item in batch]
    assert all(len(batch) <= size for batch in model.batches) and sent == items, (
        f"{why}: every batch holds at most max_batch_size={size} items, the oldest first; "
        f"expected the items {items} in batches of at most {size}, got {model.describe()}"
    )
    expect_results(accepted, why)


async def expect_sent(model: Model, batches: list[list[Any]], at: int, why: str) -> None:
    await settle()
    assert model.batches == batches and model.times[-1] == at, (
        f"{why}\n  expected fn called with {batches}, the last at {at}\n  got {model.describe()}"
    )
