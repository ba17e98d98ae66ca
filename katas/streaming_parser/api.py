"""The streaming-parser contract: types shared by stubs, solutions and tests. Do not edit.

A ``text/event-stream`` body is bytes in, events out: :class:`ServerSentEvent` is one
dispatched event, exactly as the WHATWG "event stream interpretation" algorithm defines
it; :class:`ParseError` is input the parser refuses (a line or an event over its
limit, a malformed chat chunk), and :class:`StreamTimeout` and :class:`EventSourceError`
how the stages that do I/O end a stream. The chat types are what a ``chat.completion.chunk``
stream folds into.

The Protocols are what each stage builds, as its callers (and the suites) use it:
:class:`EventParser` and :class:`ChatAssembler` (stage 1), :class:`Multiplexer` and the
:class:`MuxedStream` it opens (stage 2), :class:`EventSource` (stage 3).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import NamedTuple, Protocol

#: The default limits: a line of 1 MiB, an event's data of 8 MiB.
DEFAULT_MAX_LINE_BYTES = 1 << 20
DEFAULT_MAX_EVENT_BYTES = 1 << 23


class ServerSentEvent(NamedTuple):
    """One dispatched event (a named tuple: immutable, and cheap to build — a stream
    makes one per token).

    ``event`` is its type (``"message"`` unless an ``event:`` field set one); ``data``
    the lines of its ``data:`` fields joined by LF; ``id`` the stream's last event ID as
    this event's dispatch set it (``""`` if none); ``retry`` the reconnection time, in
    milliseconds, that a valid ``retry:`` field of this event's block set (else None).
    """

    event: str = "message"
    data: str = ""
    id: str = ""
    retry: int | None = None


class ParseError(ValueError):
    """Input the parser refuses; nothing it completed before is lost.

    ``offset`` is the byte offset in the stream (counted from its first byte, a BOM
    included) of the first byte past the limit, or of the line that broke it; None
    for an error that is not about one byte (a malformed chat chunk). ``events`` holds
    the events completed earlier in the same call, so a caller can still deliver them.
    """

    def __init__(
        self, message: str, *, offset: int | None = None, events: Sequence[ServerSentEvent] = ()
    ) -> None:
        super().__init__(message)
        self.offset = offset
        self.events: tuple[ServerSentEvent, ...] = tuple(events)


class StreamTimeout(TimeoutError):
    """A stream's source yielded no chunk for the idle timeout (stage 2)."""

    def __init__(self, name: str, idle_timeout_ns: int) -> None:
        super().__init__(f"stream {name!r}: no chunk for {idle_timeout_ns} ns")
        self.name = name
        self.idle_timeout_ns = idle_timeout_ns


class EventSourceError(Exception):
    """A resumable source gave up (stage 3): a replica's answer no retry can change (a
    status other than 200, 204, 429 and 5xx, or a 200 that is not ``text/event-stream``),
    or ``max_attempts`` attempts in a row that delivered no event. ``url`` and ``status``
    are those of the answer that ended it (``status`` None: no answer, a network error).
    """

    def __init__(self, message: str, *, url: str | None, status: int | None = None) -> None:
        super().__init__(message)
        self.url = url
        self.status = status


# --- what a chat.completion.chunk stream folds into ---------------------------------------


@dataclass(frozen=True)
class ToolCall:
    """One tool call of a choice: ``id`` and ``name`` arrive once, ``arguments`` (a JSON
    text, possibly incomplete if the stream was cut) in pieces."""

    index: int
    id: str | None
    name: str | None
    arguments: str


@dataclass(frozen=True)
class Choice:
    """One choice, assembled: ``content`` and ``refusal`` stay None until a delta carries
    a string for them (``""`` included), then concatenate every piece in order."""

    index: int
    role: str | None
    content: str | None
    refusal: str | None
    tool_calls: tuple[ToolCall, ...]  # by their index
    finish_reason: str | None


@dataclass(frozen=True)
class Usage:
    """The token counts of the final, usage-only chunk."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


@dataclass(frozen=True)
class ChatCompletion:
    """The state a stream has folded into so far: its choices by index, its usage once
    reported, and whether ``data: [DONE]`` has ended it."""

    id: str | None
    model: str | None
    choices: tuple[Choice, ...]
    usage: Usage | None
    done: bool


# --- what each stage builds ---------------------------------------------------------------


class EventParser(Protocol):
    """A sans-I/O ``text/event-stream`` parser (stage 1's ``EventStreamParser``): bytes in,
    each event out of the ``feed`` that brought its blank line. One parser reads one
    source across its responses: ``close()`` ends a response, the ID and the reconnection
    time stay."""

    @property
    def last_event_id(self) -> str:
        """The ID of the last event dispatched in full (``""`` if none): what a client
        resuming the stream sends as ``Last-Event-ID``."""
        ...

    @property
    def retry_ms(self) -> int | None:
        """The reconnection time the stream last set with a valid ``retry:`` (else None)."""
        ...

    def feed(self, data: bytes) -> list[ServerSentEvent]:
        """Parse the next chunk; return the events it completed, in order. A line or an
        event over its limit raises :class:`ParseError`, then every later call does."""
        ...

    def close(self) -> list[ServerSentEvent]:
        """End this response: an unterminated event is discarded, and the parser is ready
        for the next response, keeping ``last_event_id`` and ``retry_ms``."""
        ...


class ChatAssembler(Protocol):
    """Folds the events of a ``chat.completion.chunk`` stream into a
    :class:`ChatCompletion` (stage 1's ``ChatStreamAssembler``)."""

    @property
    def done(self) -> bool:
        """Whether ``data: [DONE]`` has ended the stream."""
        ...

    def add(self, event: ServerSentEvent) -> None:
        """Fold one event in; a malformed chunk, an ``error`` event or a chunk after
        ``[DONE]`` raises :class:`ParseError` and changes nothing."""
        ...

    def result(self) -> ChatCompletion:
        """What the stream has folded into so far."""
        ...


class MuxedStream(Protocol):
    """The events of one source of a :class:`Multiplexer`, for one consumer (stage 2's
    ``EventStream``): ``async for event in stream`` gets them in order, exactly once,
    then ``StopAsyncIteration`` — or, after the events completed before it, the error that
    ended this stream only."""

    @property
    def name(self) -> str:
        """The name it was opened with."""
        ...

    @property
    def buffered(self) -> int:
        """Events read from the source that the consumer has not taken yet."""
        ...

    @property
    def last_event_id(self) -> str:
        """Its parser's: the ID of the last event dispatched in full."""
        ...

    def cancel(self) -> None:
        """End this stream now: stop reading, drop what is buffered, close the source; a
        consumer waiting in ``__anext__`` sees its iteration end."""
        ...

    def __aiter__(self) -> MuxedStream: ...

    async def __anext__(self) -> ServerSentEvent: ...


class Multiplexer(Protocol):
    """Reads many event streams on one loop (stage 2's ``StreamMux``):
    ``async with mux: stream = mux.open(name, source)``. Leaving the block cancels every
    stream and returns once none of its tasks is left."""

    async def __aenter__(self) -> Multiplexer: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool: ...

    def open(self, name: str, source: AsyncIterator[bytes]) -> MuxedStream:
        """Start reading ``source`` (an async iterator of chunks) as the stream ``name``;
        a name already open, a source that is not an async iterator or a mux already
        left is refused."""
        ...


class EventSource(Protocol):
    """Every event of one SSE endpoint, in order, exactly once, across reconnects and
    replicas (stage 3's ``ResumableEventSource``):
    ``async with source: async for event in source``. It ends with ``StopAsyncIteration``
    (a 204) or raises :class:`EventSourceError` or :class:`ParseError`."""

    @property
    def last_event_id(self) -> str:
        """The ID of the last event delivered: what a reconnection sends."""
        ...

    @property
    def retry_ms(self) -> int:
        """The reconnection time: the server's last valid ``retry``, else the constructor's."""
        ...

    async def __aenter__(self) -> EventSource: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None: ...

    async def aclose(self) -> None:
        """Stop: close the open response; a waiting ``__anext__`` ends at once."""
        ...

    def __aiter__(self) -> EventSource: ...

    async def __anext__(self) -> ServerSentEvent: ...


__all__ = [
    "DEFAULT_MAX_EVENT_BYTES",
    "DEFAULT_MAX_LINE_BYTES",
    "ChatAssembler",
    "ChatCompletion",
    "Choice",
    "EventParser",
    "EventSource",
    "EventSourceError",
    "Multiplexer",
    "MuxedStream",
    "ParseError",
    "ServerSentEvent",
    "StreamTimeout",
    "ToolCall",
    "Usage",
]
