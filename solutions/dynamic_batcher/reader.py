"""The reader's end of a token stream, shared by the engine's streams (stage 2) and the
router's (stage 3).

A reader can leave in three ways — it closes the stream, it leaves ``async with``, it is
cancelled while it waits for a read — and each comes down to the stream's ``_leave()``,
which is synchronous: cleanup that never awaits cannot itself be cancelled halfway.

A read parks on the event loop's own primitive, not on an ``anyio.Event``: with a
thousand streams a step wakes hundreds of readers, one per token, and on asyncio an
``anyio.Event`` made and waited for each wake-up costs three times a bare future
(about 14 µs a token against 4.5 here: the engine's whole budget). trio's equivalent is
``wait_task_rescheduled``. Cancellation stays anyio's: it cancels the future (asyncio)
or calls the abort function (trio), and the read leaves as below.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from types import TracebackType
from typing import TypeVar

import anyio.lowlevel
import sniffio

_R = TypeVar("_R", bound="ReaderEnd")


class ReaderEnd:
    """Iteration, ``async with`` and ``aclose()`` for a stream whose reader may leave.
    A subclass writes ``__anext__`` (parking in ``_wait()`` when it has nothing to hand
    over) and ``_leave()``; its producer calls ``_wake()`` when it has something."""

    _unpark: Callable[[], object] | None = None  # set while a read is parked

    def __aiter__(self: _R) -> _R:
        return self

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

    async def _wait(self) -> None:
        """Park the read until ``_wake()``; a read cancelled here means the reader left."""
        try:
            if sniffio.current_async_library() == "trio":
                await self._park_trio()
            else:
                parked = asyncio.get_running_loop().create_future()
                self._unpark = functools.partial(_resolve, parked)
                await parked
        except BaseException:
            self._leave()
            raise

    async def _park_trio(self) -> None:
        import trio.lowlevel  # only ever reached on trio

        task = trio.lowlevel.current_task()

        def abort(_: object) -> trio.lowlevel.Abort:
            self._unpark = None  # cancelled: nothing left to reschedule
            return trio.lowlevel.Abort.SUCCEEDED

        self._unpark = lambda: trio.lowlevel.reschedule(task)
        await trio.lowlevel.wait_task_rescheduled(abort)

    def _wake(self) -> None:
        # Something to unpark only while a read waits: most deliveries find it busy.
        unpark, self._unpark = self._unpark, None
        if unpark is not None:
            unpark()

    def _leave(self) -> None:
        raise NotImplementedError


def _resolve(parked: asyncio.Future[None]) -> None:
    if not parked.done():  # done: cancelled, its reader is leaving
        parked.set_result(None)


__all__ = ["ReaderEnd"]
