"""Reference solution, stage 2: the request batcher for models that answer in one piece
(embeddings), as Triton's dynamic batcher and Ray Serve's ``@serve.batch``.

Callers queue their items; one task, the dispatcher, sends the queue's oldest items as
a batch when ``max_batch_size`` of them wait, or when the oldest has waited
``max_queue_delay_ns`` since its own ``submit``. It sleeps on the injected clock until
that instant, and any change to the queue (a new item, a caller that left) cuts the
sleep short, so it re-reads the queue and sleeps again: the deadline is always the
current oldest item's, never one left over from an item that is gone.

Each batch runs in a task of its own, so a slow ``fn`` never holds back the next
batch, and ends by handing every caller of the batch its outcome: its own result, or
the batch's error. Everything runs on one event loop, so no lock is needed: between two
awaits the dispatcher, the batches and the callers see each other's state whole.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from types import TracebackType
from typing import Generic, TypeVar

import anyio
import anyio.abc
import anyio.lowlevel

from katas._runtime.checks import positive_int
from katas._runtime.clock import WaitingClock
from katas.dynamic_batcher.api import BatchStatistics, EngineClosed

T = TypeVar("T")
R = TypeVar("R")


class _Ticket(Generic[T, R]):
    """One submitted item: when it arrived, and what its caller gets."""

    __slots__ = ("arrival_ns", "done", "item", "outcome", "queued")

    def __init__(self, item: T, arrival_ns: int) -> None:
        self.item = item
        self.arrival_ns = arrival_ns
        self.queued = True  # in the queue: neither sent nor dropped
        self.outcome: tuple[R] | BaseException | None = None
        self.done = anyio.Event()

    def settle(self, outcome: tuple[R] | BaseException) -> None:
        """Hand the caller its outcome (the first one given counts)."""
        if self.outcome is None:
            self.outcome = outcome
            self.done.set()


class DynamicBatcher(Generic[T, R]):
    """Batches concurrent ``submit`` calls into calls of ``fn``: ``async with`` it."""

    def __init__(
        self,
        fn: Callable[[Sequence[T]], Awaitable[Sequence[R]]],
        *,
        max_batch_size: int,
        max_queue_delay_ns: int,
        clock: WaitingClock,
    ) -> None:
        if not callable(fn):
            raise ValueError(f"fn must be an async callable, got {fn!r}")
        self._max = positive_int("max_batch_size", max_batch_size)
        if type(max_queue_delay_ns) is not int:
            raise TypeError(f"max_queue_delay_ns must be an int of ns, got {max_queue_delay_ns!r}")
        if max_queue_delay_ns < 0:
            raise ValueError(f"max_queue_delay_ns must be >= 0, got {max_queue_delay_ns}")
        if not isinstance(clock, WaitingClock):
            raise ValueError(f"clock must be a WaitingClock, got {clock!r}")
        self._fn = fn
        self._delay = max_queue_delay_ns
        self._clock = clock
        self._queue: deque[_Ticket[T, R]] = deque()
        self._tasks: anyio.abc.TaskGroup | None = None
        self._closing = False
        self._nap: anyio.CancelScope | None = None  # the dispatcher's sleep, while it sleeps
        self._in_flight = 0
        self._sizes: list[int] = []

    async def __aenter__(self) -> DynamicBatcher[T, R]:
        if self._tasks is not None:
            raise RuntimeError("a DynamicBatcher is entered once")
        self._tasks = anyio.create_task_group()
        await self._tasks.__aenter__()
        self._tasks.start_soon(self._dispatch, name="batch dispatcher")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        assert self._tasks is not None
        self._closing = True
        if isinstance(exc, anyio.get_cancelled_exc_class()):
            self._tasks.cancel_scope.cancel()  # cancelled: stop now, send nothing more
        else:
            self._wake()  # drain: the dispatcher sends what is queued at once
        try:
            # The block's own exception is not the task group's to wrap: it propagates
            # unchanged once every batch has ended.
            await self._tasks.__aexit__(None, None, None)
        finally:
            # Only a cancellation leaves anything here: items never sent, and batches
            # cancelled before they ended (those callers are told by _run). Telling
            # them needs no await, so no shield.
            while self._queue:
                ticket = self._queue.popleft()
                ticket.queued = False
                ticket.settle(EngineClosed("the DynamicBatcher closed before sending this item"))

    async def submit(self, item: T) -> R:
        """Queue ``item``; return its result once its batch is done (or raise the batch's
        error). Cancelled before the batch is sent, the item is never sent."""
        if self._tasks is None:
            raise RuntimeError("submit() needs the DynamicBatcher's `async with` block")
        if self._closing:
            raise EngineClosed("the DynamicBatcher is closing or closed: submit() refused")
        ticket: _Ticket[T, R] = _Ticket(item, self._clock.now_ns())
        self._queue.append(ticket)
        self._wake()
        try:
            await ticket.done.wait()
            # Cancelled after its outcome was set, before it ran again: the cancellation
            # still wins (the wait itself returns normally then).
            await anyio.lowlevel.checkpoint_if_cancelled()
        finally:
            if ticket.queued:  # the caller left before its batch was sent
                ticket.queued = False
                self._queue.remove(ticket)
                self._wake()  # the oldest item, so the deadline, may have changed
        outcome = ticket.outcome
        if isinstance(outcome, BaseException):
            raise outcome
        assert outcome is not None
        return outcome[0]

    def statistics(self) -> BatchStatistics:
        """Items queued (not sent), batches in flight, batches dispatched and their sizes."""
        return BatchStatistics(
            queued=len(self._queue),
            in_flight=self._in_flight,
            dispatched=len(self._sizes),
            sizes=tuple(self._sizes),
        )

    # --- the batcher's tasks --------------------------------------------------------------

    def _wake(self) -> None:
        """The queue changed: cut the dispatcher's sleep short (it re-reads the queue)."""
        if self._nap is not None:
            self._nap.cancel()

    async def _dispatch(self) -> None:
        """Send each batch when it is full or due; when closing, everything at once."""
        queue = self._queue
        while True:
            if queue and (
                len(queue) >= self._max
                or self._closing
                or self._clock.now_ns() >= queue[0].arrival_ns + self._delay
            ):
                self._send()
                continue
            if self._closing:
                return
            with anyio.CancelScope() as self._nap:
                if queue:
                    await self._clock.sleep_until_ns_async(queue[0].arrival_ns + self._delay)
                else:
                    await anyio.sleep_forever()
            self._nap = None

    def _send(self) -> None:
        """Start a batch of the oldest items, in the order they came."""
        assert self._tasks is not None
        batch = [self._queue.popleft() for _ in range(min(self._max, len(self._queue)))]
        for ticket in batch:
            ticket.queued = False
        self._sizes.append(len(batch))
        self._in_flight += 1
        self._tasks.start_soon(self._run, batch)

    async def _run(self, batch: list[_Ticket[T, R]]) -> None:
        """Call ``fn`` once for the batch; every caller of it gets its outcome."""
        try:
            results = await self._fn([ticket.item for ticket in batch])
            if len(results) != len(batch):
                raise RuntimeError(
                    f"fn returned {len(results)} results for a batch of {len(batch)} items: "
                    "it must return exactly one result per item, in the items' order"
                )
        except Exception as exc:  # the batch's error is its callers' (all of them), only
            for ticket in batch:
                ticket.settle(exc)
        else:
            for ticket, result in zip(batch, results, strict=True):
                ticket.settle((result,))
        finally:
            self._in_flight -= 1
            # Cancelled (the block was): no caller of the batch is left waiting.
            for ticket in batch:
                ticket.settle(EngineClosed("the DynamicBatcher closed while this batch ran"))


__all__ = ["DynamicBatcher"]
