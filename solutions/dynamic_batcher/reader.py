"""The reader's end of a token stream, shared by the engine's streams (stage 2) and the
router's (stage 3).

A reader can leave in three ways — it closes the stream, it leaves ``async with``, it is
cancelled while it waits for a read — and each comes down to the stream's ``_leave()``,
which is synchronous: cleanup that never awaits cannot itself be cancelled halfway.
"""

from __future__ import annotations

from types import TracebackType
from typing import TypeVar

import anyio
import anyio.lowlevel

_R = TypeVar("_R", bound="ReaderEnd")


class ReaderEnd:
    """Iteration, ``async with`` and ``aclose()`` for a stream whose reader may leave.
    A subclass writes ``__anext__`` (parking in ``_wait()`` when it has nothing to hand
    over) and ``_leave()``; its producer calls ``_wake()`` when it has something."""

    _changed: anyio.Event | None = None  # set while the reader waits

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
        self._changed = changed = anyio.Event()
        try:
            await changed.wait()
        except BaseException:
            self._leave()
            raise

    def _wake(self) -> None:
        # An event only while the reader waits: most deliveries find it busy elsewhere.
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    def _leave(self) -> None:
        raise NotImplementedError


__all__ = ["ReaderEnd"]
