"""The reader's end of a token stream, shared by the engine's streams (stage 2) and the
router's (stage 3).

A reader can leave in three ways — it closes the stream, it leaves ``async with``, it is
cancelled while it waits for a read — and each comes down to the stream's ``_leave()``,
which is synchronous: cleanup that never awaits cannot itself be cancelled halfway.

A read is on the hot path: with a thousand streams a step wakes hundreds of readers,
one per token, and each wake-up must cost little beside the model's own work. So a read
parks on the event loop's own primitive — a bare future on asyncio, trio's
``wait_task_rescheduled`` — not on an ``anyio.Event`` (three times the cost on asyncio),
finds out which loop it runs on once per stream, not once per read, and awaits the
future from ``__anext__`` itself, with no coroutine in between. Cancellation stays
anyio's: it cancels the future (asyncio) or calls the abort function (trio), and the
read leaves as above.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any, NamedTuple, TypeVar

import anyio.lowlevel
import sniffio

from katas.dynamic_batcher.api import Delivery

_R = TypeVar("_R", bound="ReaderEnd")


class ReaderEnd:
    """Iteration, ``async with`` and ``aclose()`` for a stream whose reader may leave.
    A subclass writes ``_take()`` (the next delivery, or None while there is nothing to
    hand over) and ``_leave()``; its producer calls ``_wake()`` when it has something."""

    _loop: _Loop | None = None  # found at the first read that parks
    _parked: Any = None  # the parked read: its future (asyncio) or task (trio)

    def __aiter__(self: _R) -> _R:
        return self

    async def __anext__(self) -> Delivery:
        while (delivery := self._take()) is None:
            loop = self._loop or self._find_loop()
            try:
                await loop.park(self)
            except BaseException:  # cancelled while parked: the reader left
                self._parked = None
                self._leave()
                raise
        return delivery

    async def aclose(self) -> None:
        """Stop reading: the request ends if it has not finished."""
        self._leave()
        await anyio.lowlevel.checkpoint()

    async def __aenter__(self: _R) -> _R:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._leave()

    def _wake(self) -> None:
        # Something to unpark only while a read waits: most deliveries find it busy.
        parked, self._parked = self._parked, None
        if parked is not None:
            assert self._loop is not None
            self._loop.unpark(parked)

    def _find_loop(self) -> _Loop:
        self._loop = _TRIO if sniffio.current_async_library() == "trio" else _ASYNCIO
        return self._loop

    def _take(self) -> Delivery | None:
        raise NotImplementedError

    def _leave(self) -> None:
        raise NotImplementedError


class _Loop(NamedTuple):
    park: Callable[[ReaderEnd], Awaitable[None]]
    unpark: Callable[[Any], None]


def _park_asyncio(reader: ReaderEnd) -> asyncio.Future[None]:
    # asyncio.Future() finds the running loop in C: loop.create_future() is Python.
    parked: asyncio.Future[None] = asyncio.Future()
    reader._parked = parked
    return parked


def _unpark_asyncio(parked: asyncio.Future[None]) -> None:
    if not parked.done():  # done: cancelled, its reader is leaving
        parked.set_result(None)


def _park_trio(reader: ReaderEnd) -> Awaitable[None]:
    import trio.lowlevel  # only ever reached on trio

    def abort(_: object) -> trio.lowlevel.Abort:
        reader._parked = None  # cancelled: nothing left to reschedule
        return trio.lowlevel.Abort.SUCCEEDED

    reader._parked = trio.lowlevel.current_task()
    return trio.lowlevel.wait_task_rescheduled(abort)


def _unpark_trio(parked: Any) -> None:
    import trio.lowlevel

    trio.lowlevel.reschedule(parked)


_ASYNCIO = _Loop(_park_asyncio, _unpark_asyncio)
_TRIO = _Loop(_park_trio, _unpark_trio)

__all__ = ["ReaderEnd"]
