"""The streaming-parser contract: types shared by stubs, solutions and tests. Do not edit.

A ``text/event-stream`` body is bytes in, events out: :class:`ServerSentEvent` is one
dispatched event, exactly as the WHATWG "event stream interpretation" algorithm defines
it; :class:`ParseError` is input the parser refuses (a line or an event over its
limit, a malformed chat chunk), and :class:`StreamTimeout` and :class:`EventSourceError`
how the stages that do I/O end a stream. The chat types are what a ``chat.completion.chunk``
stream folds into.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

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


__all__ = [
    "DEFAULT_MAX_EVENT_BYTES",
    "DEFAULT_MAX_LINE_BYTES",
    "ChatCompletion",
    "Choice",
    "EventSourceError",
    "ParseError",
    "ServerSentEvent",
    "StreamTimeout",
    "ToolCall",
    "Usage",
]
