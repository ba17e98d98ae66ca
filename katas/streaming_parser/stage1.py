"""Stage 1 — a sans-I/O Server-Sent Events parser (core: no limits; extended: limits), and
the chat-delta assembler (extended).

The prompt is katas/streaming_parser/README.md; run the suite with
``pytest katas/streaming_parser -k stage1`` (``-k "stage1 and core"`` for the core).

Rules the parser follows (the suite checks each one):

- The body is UTF-8: a character split between chunks is one character, invalid bytes
  become U+FFFD (never an exception); one BOM at the very start is stripped.
- Lines end with CRLF, LF or a lone CR — nothing else (no ``str.splitlines``). A CR
  ends its line at once; an LF right after it, even in the next chunk, is skipped.
- ``:`` starts a comment; a field is the text before the first colon, its value the
  text after it minus one leading space; no colon: the whole line, empty value.
- ``data`` appends value + LF; ``event`` sets the type; ``id`` sets the ID buffer
  unless it contains NUL (empty clears it); ``retry`` only if ASCII digits only.
- A blank line sets ``last_event_id`` from the ID buffer, then dispatches the event if
  there is data (the last LF removed, type ``"message"`` by default), and starts over.
- Each event is returned by the ``feed`` that brought its blank line; ``close()``
  discards an unterminated event and readies the parser for a new stream, keeping
  ``last_event_id`` and ``retry_ms``.
- Extended: a line over ``max_line_bytes`` or an event's data over ``max_event_bytes``
  raises ``ParseError`` (``offset``, and ``events`` completed earlier in that feed),
  and every later call raises it again; linear time under any chunking.
"""

from __future__ import annotations

# TODO(stage1): implement every class and method below; delete each
# `raise Todo()` as you go.
from katas._runtime.todo import Todo
from katas.streaming_parser.api import (
    DEFAULT_MAX_EVENT_BYTES,
    DEFAULT_MAX_LINE_BYTES,
    ChatCompletion,
    ParseError,
    ServerSentEvent,
)

__all__ = ["ChatStreamAssembler", "EventStreamParser", "ParseError"]


class EventStreamParser:
    """Bytes of a ``text/event-stream`` body in, dispatched events out."""

    def __init__(
        self,
        *,
        max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
        max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES,
    ) -> None:
        """Both limits are ints >= 1 (ValueError, TypeError for a non-int, naming it)."""
        raise Todo()

    @property
    def last_event_id(self) -> str:
        """The ID of the last event dispatched in full (``""`` if none): what a client
        resuming the stream sends as ``Last-Event-ID``."""
        raise Todo()

    @property
    def retry_ms(self) -> int | None:
        """The reconnection time the stream last set with a valid ``retry:`` (else None)."""
        raise Todo()

    def feed(self, data: bytes) -> list[ServerSentEvent]:
        """Parse the next chunk; return the events it completed, in order."""
        raise Todo()

    def close(self) -> list[ServerSentEvent]:
        """End this stream: an unterminated event is discarded (it was never complete).

        The parser is then ready for the next response of the same source, keeping
        ``last_event_id`` and ``retry_ms``.
        """
        raise Todo()


class ChatStreamAssembler:
    """Folds ``chat.completion.chunk`` events into the final choices."""

    def __init__(self) -> None:
        raise Todo()

    @property
    def done(self) -> bool:
        """Whether ``data: [DONE]`` has ended the stream."""
        raise Todo()

    def add(self, event: ServerSentEvent) -> None:
        """Fold one event in; a malformed chunk raises :class:`ParseError` and changes
        nothing."""
        raise Todo()

    def result(self) -> ChatCompletion:
        """What the stream has folded into so far."""
        raise Todo()
