"""Reference solution, stage 2: many event streams on one anyio loop.

Each stream is one task of the mux's task group, inside a cancel scope of its own: the
task pulls chunks from its source, feeds its stage-1 parser, and queues the events for
the stream's consumer. The queue is the backpressure: the task pulls a chunk only while
fewer than ``max_buffered`` events wait. A second task per stream, the watchdog, sleeps
on the injected clock until the source's idle deadline; a chunk moves the deadline,
and while the task waits for its consumer there is no deadline at all.

Nothing a stream does can reach another: the stream task catches every error of its
source and parser and hands it to its own consumer, after the events before it. Only
cancellation crosses a task boundary, and only downwards: ``cancel()`` cancels one
stream's scope, leaving the ``async with`` block cancels them all, and every source is
closed in a shielded ``finally`` so that it is closed even then.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import AsyncIterator
from types import TracebackType
from typing import Final

import anyio
import anyio.abc

from katas._runtime.checks import positive_int
from katas._runtime.clock import MonotonicClock, WaitingClock
from katas.streaming_parser.api import (
    DEFAULT_MAX_EVENT_BYTES,
    DEFAULT_MAX_LINE_BYTES,
    ParseError,
    ServerSentEvent,
    StreamTimeout,
)

from .stage1 import EventStreamParser

#: What a stream's end is when it is not an error: its source ended, or it was cancelled.
_ENDED: Final = StopAsyncIteration


class EventStream:
    """The events of one source, for one consumer: ``async for event in stream``."""

    def __init__(self, mux: StreamMux, name: str, source: AsyncIterator[bytes]) -> None:
        self._mux = mux
        self._name = name
        self._source = source
        self._parser = EventStreamParser(
            max_line_bytes=mux._max_line, max_event_bytes=mux._max_event
        )
        self._events: deque[ServerSentEvent] = deque()
        # Set once: _ENDED, or the error to raise (then _ENDED: an error is raised once).
        self._end: BaseException | type[StopAsyncIteration] | None = None
        self._changed = anyio.Event()  # an event queued or the end: wakes the consumer
        self._room = anyio.Event()  # an event taken: wakes the stream task
        self._scope = anyio.CancelScope()  # cancelled before it is entered works too
        self._deadline: int | None = None  # the source's idle deadline while pulling
        self._armed = anyio.Event()  # a deadline was set: wakes the watchdog
        # How the reading ended (the source's end, its error, a timeout), told to the
        # consumer once the source is closed.
        self._outcome: BaseException | type[StopAsyncIteration] = _ENDED

    @property
    def name(self) -> str:
        return self._name

    @property
    def buffered(self) -> int:
        """Events read from the source that the consumer has not taken yet."""
        return len(self._events)

    @property
    def last_event_id(self) -> str:
        """The parser's: the ID of the last event dispatched in full."""
        return self._parser.last_event_id

    def cancel(self) -> None:
        """End this stream now: stop reading, drop what is buffered, close the source."""
        self._events.clear()
        self._finish(_ENDED)
        self._scope.cancel()

    def __aiter__(self) -> EventStream:
        return self

    async def __anext__(self) -> ServerSentEvent:
        while True:
            if self._events:
                event = self._events.popleft()
                self._room.set()
                self._room = anyio.Event()
                return event
            if self._end is not None:
                end, self._end = self._end, _ENDED
                raise end
            # Waiting takes nothing: a consumer cancelled here loses no event.
            await self._changed.wait()

    # --- the stream's tasks -------------------------------------------------------------

    def _finish(self, end: BaseException | type[StopAsyncIteration]) -> None:
        if self._end is None:
            self._end = end
            self._wake_consumer()

    def _wake_consumer(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    async def _run(self) -> None:
        """The stream task: read until the source ends, fails, times out or is cancelled;
        then close the source, and only then tell the consumer how it ended."""
        try:
            with self._scope:
                async with anyio.create_task_group() as tasks:
                    idle = self._mux._idle
                    if idle is not None:
                        tasks.start_soon(self._watch, idle, tasks.cancel_scope)
                    await self._read(idle)
                    tasks.cancel_scope.cancel()  # the watchdog's job is done
        finally:
            with anyio.CancelScope(shield=True):  # closed even when cancelled
                aclose = getattr(self._source, "aclose", None)
                if aclose is not None:
                    with contextlib.suppress(Exception):  # closed, whatever it says
                        await aclose()
            self._finish(self._outcome)  # (a no-op after cancel(): it ended already)

    async def _read(self, idle: int | None) -> None:
        clock = self._mux._clock
        try:
            # Checked, not left to the cancel scope: a source that never awaits has no checkpoint.
            while self._end is None:
                if len(self._events) >= self._mux._max_buffered:
                    self._deadline = None  # waiting for the consumer is not idleness
                    await self._room.wait()
                    continue
                if idle is not None and self._deadline is None:
                    self._deadline = clock.now_ns() + idle
                    self._armed.set()
                    self._armed = anyio.Event()
                try:
                    chunk = await self._source.__anext__()
                except StopAsyncIteration:
                    self._parser.close()  # an unterminated tail was never an event
                    return
                if self._end is not None:  # cancelled during the pull: its chunk is dropped
                    return
                if idle is not None:
                    self._deadline = clock.now_ns() + idle
                events = self._parser.feed(chunk)
                if events:
                    self._events.extend(events)
                    self._wake_consumer()
        except ParseError as exc:
            self._events.extend(exc.events)  # completed before the error: delivered first
            self._outcome = exc
        except Exception as exc:  # the source's own failure is this stream's only
            self._outcome = exc

    async def _watch(self, idle: int, reading: anyio.CancelScope) -> None:
        """Sleep until the idle deadline; if it holds when reached, time the stream out."""
        clock = self._mux._clock
        while True:
            deadline = self._deadline
            if deadline is None:
                await self._armed.wait()
                continue
            await clock.sleep_until_ns_async(deadline)
            if self._deadline is not None and clock.now_ns() >= self._deadline:
                self._outcome = StreamTimeout(self._name, idle)
                reading.cancel()
                return


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
        if clock is not None and not isinstance(clock, WaitingClock):
            raise TypeError(f"clock must be a WaitingClock, got {clock!r}")
        self._clock: WaitingClock = clock or MonotonicClock()
        self._idle = (
            None if idle_timeout_ns is None else positive_int("idle_timeout_ns", idle_timeout_ns)
        )
        self._max_buffered = positive_int("max_buffered", max_buffered)
        self._max_line = positive_int("max_line_bytes", max_line_bytes)
        self._max_event = positive_int("max_event_bytes", max_event_bytes)
        self._streams: dict[str, EventStream] = {}
        self._tasks: anyio.abc.TaskGroup | None = None
        self._closed = False

    async def __aenter__(self) -> StreamMux:
        if self._tasks is not None or self._closed:
            raise RuntimeError("a StreamMux is entered once")
        self._tasks = anyio.create_task_group()
        await self._tasks.__aenter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool:
        assert self._tasks is not None
        self._closed = True
        for stream in self._streams.values():
            stream.cancel()
        # The block's own exception is not the task group's to wrap: it propagates
        # unchanged once every stream task has finished.
        await self._tasks.__aexit__(None, None, None)
        return False

    def open(self, name: str, source: AsyncIterator[bytes]) -> EventStream:
        """Start reading ``source`` as the stream ``name``."""
        if self._tasks is None or self._closed:
            raise RuntimeError("open() needs the StreamMux's async with block")
        if not isinstance(name, str):
            raise TypeError(f"name must be a str, got {type(name).__name__}")
        if name in self._streams:
            raise ValueError(f"name {name!r} is already open")
        if not callable(getattr(source, "__anext__", None)):
            raise TypeError(f"source must be an async iterator, got {type(source).__name__}")
        stream = EventStream(self, name, source)
        self._streams[name] = stream
        self._tasks.start_soon(self._run, stream, name=f"stream {name}")
        return stream

    async def _run(self, stream: EventStream) -> None:
        try:
            await stream._run()
        finally:
            self._streams.pop(stream.name, None)


__all__ = ["EventStream", "EventStreamParser", "StreamMux", "StreamTimeout"]
