"""Stage 2 — many event streams on one anyio loop (asyncio and trio).

The prompt is katas/streaming_parser/README.md; run the suite with
``pytest katas/streaming_parser -k stage2`` (``-k "stage2 and core"`` for the core).

Rules (the suite checks each one):

- Each stream's consumer gets its events in order, exactly once, then
  ``StopAsyncIteration`` when the source ends (its unterminated tail discarded).
- A source that raises, a ``ParseError``, an idle timeout or a ``cancel()`` ends that
  stream only — its consumer first gets the events completed before it, then the error.
- Backpressure: a stream's next chunk is pulled only while fewer than ``max_buffered``
  of its events wait for its consumer.
- Idle timeout (extended): no chunk for ``idle_timeout_ns`` on the injected clock ends
  the stream with ``StreamTimeout``, once; every chunk restarts the timer, and so does
  taking an event from a full buffer.
- ``cancel()`` stops reading, closes the source, drops the buffer and ends the
  consumer's iteration at once. Every source's ``aclose()`` is called exactly once,
  whatever ends its stream.
- Leaving the ``async with`` block cancels every stream and returns only when no task
  of the mux is left; ``open()`` afterwards raises ``RuntimeError``.
- A consumer cancelled while waiting in ``__anext__`` loses no event (extended).
"""

from __future__ import annotations

# TODO(stage2): implement every class and method below; delete each
# `raise Todo()` as you go. Build on your stage-1 EventStreamParser.
from collections.abc import AsyncIterator
from types import TracebackType

from katas._runtime.clock import WaitingClock
from katas._runtime.todo import Todo
from katas.streaming_parser.api import (
    DEFAULT_MAX_EVENT_BYTES,
    DEFAULT_MAX_LINE_BYTES,
    ServerSentEvent,
    StreamTimeout,
)

from .stage1 import EventStreamParser

__all__ = ["EventStream", "EventStreamParser", "StreamMux", "StreamTimeout"]


class EventStream:
    """The events of one source, for one consumer: ``async for event in stream``."""

    def __init__(self, mux: StreamMux, name: str, source: AsyncIterator[bytes]) -> None:
        raise Todo()

    @property
    def name(self) -> str:
        raise Todo()

    @property
    def buffered(self) -> int:
        """Events read from the source that the consumer has not taken yet."""
        raise Todo()

    @property
    def last_event_id(self) -> str:
        """The parser's: the ID of the last event dispatched in full."""
        raise Todo()

    def cancel(self) -> None:
        """End this stream now: stop reading, drop what is buffered, close the source."""
        raise Todo()

    def __aiter__(self) -> EventStream:
        raise Todo()

    async def __anext__(self) -> ServerSentEvent:
        raise Todo()


class StreamMux:
    """Reads many event streams at once: ``async with StreamMux(...) as mux``."""

    def __init__(
        self,
        *,
        clock: WaitingClock | None = None,
        idle_timeout_ns: int | None = None,
        max_buffered: int = 64,
        max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
        max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES,
    ) -> None:
        """``clock`` defaults to the monotonic clock; the ints must be >= 1 (ValueError,
        TypeError for a non-int, naming them); ``idle_timeout_ns=None`` waits forever."""
        raise Todo()

    async def __aenter__(self) -> StreamMux:
        raise Todo()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool:
        raise Todo()

    def open(self, name: str, source: AsyncIterator[bytes]) -> EventStream:
        """Start reading ``source`` as the stream ``name``."""
        raise Todo()
