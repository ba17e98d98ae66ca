"""Reference solution, stage 1: a sans-I/O Server-Sent Events parser, and chat deltas.

:class:`EventStreamParser` is the WHATWG "event stream interpretation" algorithm over
bytes: it owns no socket and no clock, so the same object serves a blocking client, an
async one, or a test that feeds it one byte at a time. Lines are cut on the bytes CR
and LF (never on what ``str.splitlines`` also splits on), then decoded whole: a CR or
an LF is never part of a multi-byte UTF-8 sequence, so a character split between two
chunks is decoded once, from both halves. Each chunk is scanned once and the pending
partial line only ever grows at its end, so the work is linear in the input however it
is chunked.

:class:`ChatStreamAssembler` folds the events of an OpenAI-style
``chat.completion.chunk`` stream into the final choices.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from katas._runtime.checks import positive_int
from katas.streaming_parser.api import (
    DEFAULT_MAX_EVENT_BYTES,
    DEFAULT_MAX_LINE_BYTES,
    ChatCompletion,
    Choice,
    ParseError,
    ServerSentEvent,
    ToolCall,
    Usage,
)

_BOM = b"\xef\xbb\xbf"
_LF, _CR = 0x0A, 0x0D
#: ``ServerSentEvent(*fields)`` without the named tuple's keyword-handling ``__new__``:
#: half the cost, and a stream builds one event per token.
_new_event = functools.partial(tuple.__new__, ServerSentEvent)
#: A line's end, kept by split(): CRLF, a lone CR, or LF.
_LINE_END_KEPT = re.compile(rb"(\r\n|\r|\n)")


def _as_bytes(data: object) -> bytes:
    if not isinstance(data, bytearray | memoryview):
        raise TypeError(f"data must be bytes, got {type(data).__name__}")
    return bytes(data)


class EventStreamParser:
    """Bytes of a ``text/event-stream`` body in, dispatched events out."""

    def __init__(
        self,
        *,
        max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
        max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES,
    ) -> None:
        self._max_line = positive_int("max_line_bytes", max_line_bytes)
        self._max_event = positive_int("max_event_bytes", max_event_bytes)
        self._last_event_id = ""  # survives close(): what a reconnect sends
        self._retry_ms: int | None = None
        self._broken: ParseError | None = None
        self._new_stream()

    def _new_stream(self) -> None:
        self._fed = 0  # bytes of this stream fed before the current chunk
        self._pending = bytearray()  # a line whose end has not arrived
        self._first_line = True  # a BOM may open it: its bytes are not yet known
        self._skip_lf = False  # the last chunk ended in CR: an LF next is its CRLF's
        # The fast path's condition in one flag: not broken, not at the start of a
        # stream, not waiting to skip an LF.
        self._plain = False
        self._data: list[bytes] = []  # the event's data values
        self._size = 0  # their bytes, one LF each included
        self._type = b""
        self._id = self._last_event_id
        self._retry: int | None = None

    @property
    def last_event_id(self) -> str:
        """The ID of the last event dispatched in full (``""`` if none): what a client
        resuming the stream sends as ``Last-Event-ID``."""
        return self._last_event_id

    @property
    def retry_ms(self) -> int | None:
        """The reconnection time the stream last set with a valid ``retry:`` (else None)."""
        return self._retry_ms

    def feed(self, data: bytes) -> list[ServerSentEvent]:
        """Parse the next chunk; return the events it completed, in order."""
        if (
            self._plain
            and type(data) is bytes
            and _LF not in data  # an int: a byte search, 10x faster than b"\n" in data
            and _CR not in data
            and len(self._pending) + len(data) <= self._max_line
        ):
            # Inside a line (small chunks of a long one): nothing to cut, only to keep.
            self._pending += data
            self._fed += len(data)
            return []
        if type(data) is not bytes:
            data = _as_bytes(data)
        if self._broken is not None:
            raise self._broken
        events: list[ServerSentEvent] = []
        try:
            self._cut(data, events)
        except ParseError as exc:
            self._broken = ParseError(str(exc), offset=exc.offset)
            self._plain = False
            raise ParseError(str(exc), offset=exc.offset, events=events) from None
        return events

    def close(self) -> list[ServerSentEvent]:
        """End this stream: an unterminated event is discarded (it was never complete).

        The parser is then ready for the next response of the same source, keeping
        ``last_event_id`` and ``retry_ms``.
        """
        if self._broken is not None:
            raise self._broken
        self._new_stream()
        return []

    def _cut(self, chunk: bytes, events: list[ServerSentEvent]) -> None:
        """Cut ``chunk`` into lines and interpret the complete ones (WHATWG).

        The hot path — a ``data:`` line, a blank line — is inline; the other fields go
        through :meth:`_field`. Stream offsets are worked out only for an error.
        """
        if not chunk:
            return  # (and a CR at the end of the last chunk still waits for its LF)
        if self._first_line:
            opened = self._open(chunk)
            if opened is None:
                return
            chunk = opened
        start = self._fed - len(self._pending)  # where the pending line starts
        self._fed += len(chunk)
        if self._skip_lf:
            self._skip_lf = False
            if chunk[:1] == b"\n":  # the LF of the CRLF whose CR ended the last chunk
                chunk = chunk[1:]
                start += 1  # (the pending line is empty: a CR ended the last one)
        ends: list[int] | None = None  # the length of each line's end, when not all 1
        if _CR in chunk:
            parts = _LINE_END_KEPT.split(chunk)
            lines, ends = parts[0::2], [len(end) for end in parts[1::2]]
            self._skip_lf = chunk[-1:] == b"\r"
        else:
            lines = chunk.split(b"\n")
        tail = lines.pop()
        pending = self._pending
        if lines and pending:
            pending += lines[0]
            lines[0] = bytes(pending)
            pending.clear()
        max_line, max_event = self._max_line, self._max_event
        data = self._data
        for line in lines:
            n = len(line)
            if n > max_line:
                raise self._line_too_long(_line_start(start, lines, ends, line))
            if line.startswith(b"data:"):
                value = line[6:] if n > 5 and line[5] == 0x20 else line[5:]  # one space
                self._size += len(value) + 1
                if self._size > max_event:
                    raise self._event_too_long(_line_start(start, lines, ends, line))
                data.append(value)
            elif not n:  # a blank line: dispatch
                self._last_event_id = self._id  # even when no event is dispatched
                if data:
                    kind = self._type
                    text = data[0] if len(data) == 1 else b"\n".join(data)
                    events.append(
                        _new_event(
                            (
                                kind.decode("utf-8", "replace") if kind else "message",
                                text.decode("utf-8", "replace"),
                                self._id,
                                self._retry,
                            )
                        )
                    )
                    data.clear()
                    self._size = 0
                self._type = b""
                self._retry = None
            elif line[0] != 0x3A:  # not a comment
                self._field(line, start, lines, ends)
        if len(pending) + len(tail) > max_line:
            raise self._line_too_long(self._fed - len(tail) - len(pending))
        pending += tail
        self._plain = not self._skip_lf

    def _open(self, chunk: bytes) -> bytes | None:
        """The start of a stream: the bytes from its first one on, a BOM stripped, once
        they show whether a BOM opens it (its three bytes may come one at a time);
        None while they do not yet."""
        head = bytes(self._pending) + chunk  # at most two bytes are pending here
        if len(head) < len(_BOM) and _BOM.startswith(head):
            self._pending += chunk
            self._fed += len(chunk)
            return None
        self._first_line = False
        self._fed -= len(self._pending)  # the pending bytes come again, at head's start
        self._pending.clear()
        if head.startswith(_BOM):
            self._fed += len(_BOM)  # stripped, but counted in the stream's offsets
            head = head[len(_BOM) :]
        return head

    def _field(self, line: bytes, start: int, lines: list[bytes], ends: list[int] | None) -> None:
        name, colon, value = line.partition(b":")
        if colon and value[:1] == b" ":
            value = value[1:]
        if name == b"data":  # "data" without a colon: an empty value
            self._size += len(value) + 1
            if self._size > self._max_event:
                raise self._event_too_long(_line_start(start, lines, ends, line))
            self._data.append(value)
        elif name == b"event":
            self._type = value
        elif name == b"id":
            if b"\0" not in value:
                self._id = value.decode("utf-8", "replace")
        elif name == b"retry" and value.isdigit():
            # ASCII digits only (bytes.isdigit): int() would also take " 5", "+5", "٥",
            # "1_000"; an empty value is no digit.
            self._retry = self._retry_ms = int(value)
        # any other field is ignored

    def _line_too_long(self, line_start: int) -> ParseError:
        return ParseError(
            f"a line is longer than max_line_bytes={self._max_line}",
            offset=line_start + self._max_line,
        )

    def _event_too_long(self, line_start: int) -> ParseError:
        return ParseError(
            f"an event's data is longer than max_event_bytes={self._max_event}",
            offset=line_start,
        )


def _line_start(start: int, lines: list[bytes], ends: list[int] | None, line: bytes) -> int:
    """The stream offset of ``line`` (found by identity) among ``lines``, the first of
    which starts at ``start``; ``ends`` are their line ends' lengths (None: all LF)."""
    for i, other in enumerate(lines):
        if other is line:
            return start + i + sum(map(len, lines[:i])) + (sum(ends[:i]) - i if ends else 0)
    raise AssertionError("the line is not among the lines")  # pragma: no cover


# --- chat deltas -------------------------------------------------------------------------


class _Call:
    __slots__ = ("arguments", "id", "name")

    def __init__(self) -> None:
        self.id: str | None = None
        self.name: str | None = None
        self.arguments: list[str] = []


class _Choice:
    __slots__ = ("calls", "content", "finish_reason", "refusal", "role")

    def __init__(self) -> None:
        self.role: str | None = None
        self.content: list[str] | None = None
        self.refusal: list[str] | None = None
        self.calls: dict[int, _Call] = {}
        self.finish_reason: str | None = None


class ChatStreamAssembler:
    """Folds ``chat.completion.chunk`` events into the final choices."""

    def __init__(self) -> None:
        self._choices: dict[int, _Choice] = {}
        self._id: str | None = None
        self._model: str | None = None
        self._usage: Usage | None = None
        self._done = False
        self._seen = 0

    @property
    def done(self) -> bool:
        """Whether ``data: [DONE]`` has ended the stream."""
        return self._done

    def add(self, event: ServerSentEvent) -> None:
        """Fold one event in; a malformed chunk raises :class:`ParseError` and changes
        nothing."""
        if not isinstance(event, ServerSentEvent):
            raise TypeError(f"event must be a ServerSentEvent, got {type(event).__name__}")
        self._seen += 1
        where = f"event {self._seen}" + (f" (id {event.id!r})" if event.id else "")
        if self._done:
            raise ParseError(f"{where}: an event after data: [DONE]")
        if event.event == "error":
            raise ParseError(f"{where}: the server sent an error event: {event.data[:200]}")
        if event.event != "message":
            return  # another type of event is not a chunk
        if event.data == "[DONE]":
            self._done = True
            return
        try:
            chunk = json.loads(event.data)
        except ValueError as exc:
            raise ParseError(f"{where}: malformed JSON: {exc}") from None
        # Everything is checked before anything changes.
        updates = _parse_chunk(chunk, where)
        chunk_id, model = _text(chunk, "id", where), _text(chunk, "model", where)
        self._id = self._id or chunk_id
        self._model = self._model or model
        if updates.usage is not None:
            self._usage = updates.usage
        for index, delta, finish in updates.choices:
            self._apply(self._choices.setdefault(index, _Choice()), delta, finish)

    def _apply(self, choice: _Choice, delta: _Delta, finish: str | None) -> None:
        if delta.role is not None:
            choice.role = delta.role
        if delta.content is not None:
            if choice.content is None:
                choice.content = []
            choice.content.append(delta.content)
        if delta.refusal is not None:
            if choice.refusal is None:
                choice.refusal = []
            choice.refusal.append(delta.refusal)
        for index, call_id, name, arguments in delta.calls:
            call = choice.calls.setdefault(index, _Call())
            call.id = call.id or call_id
            call.name = call.name or name
            if arguments:
                call.arguments.append(arguments)
        if finish is not None:
            choice.finish_reason = finish

    def result(self) -> ChatCompletion:
        """What the stream has folded into so far."""
        return ChatCompletion(
            id=self._id,
            model=self._model,
            choices=tuple(
                Choice(
                    index=index,
                    role=c.role,
                    content=None if c.content is None else "".join(c.content),
                    refusal=None if c.refusal is None else "".join(c.refusal),
                    tool_calls=tuple(
                        ToolCall(i, call.id, call.name, "".join(call.arguments))
                        for i, call in sorted(c.calls.items())
                    ),
                    finish_reason=c.finish_reason,
                )
                for index, c in sorted(self._choices.items())
            ),
            usage=self._usage,
            done=self._done,
        )


class _Delta:
    __slots__ = ("calls", "content", "refusal", "role")

    def __init__(self) -> None:
        self.role: str | None = None
        self.content: str | None = None
        self.refusal: str | None = None
        self.calls: list[tuple[int, str | None, str | None, str]] = []


class _Chunk:
    __slots__ = ("choices", "usage")

    def __init__(self) -> None:
        self.choices: list[tuple[int, _Delta, str | None]] = []
        self.usage: Usage | None = None


def _text(obj: dict[str, Any], key: str, where: str) -> str | None:
    value = obj.get(key)
    if value is not None and not isinstance(value, str):
        raise ParseError(f"{where}: {key} must be a string, got {type(value).__name__}")
    return value


def _index(obj: dict[str, Any], where: str) -> int:
    value = obj.get("index")
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ParseError(f"{where}: index must be an int >= 0, got {value!r}")
    return value


def _object(value: Any, what: str, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ParseError(f"{where}: {what} must be an object, got {type(value).__name__}")
    return value


def _parse_chunk(raw: Any, where: str) -> _Chunk:
    chunk = _object(raw, "the chunk", where)
    out = _Chunk()
    choices = chunk.get("choices", [])
    if not isinstance(choices, list):
        raise ParseError(f"{where}: choices must be a list, got {type(choices).__name__}")
    for raw_choice in choices:
        choice = _object(raw_choice, "a choice", where)
        delta_obj = _object(choice.get("delta") or {}, "a delta", where)
        delta = _Delta()
        delta.role = _text(delta_obj, "role", where)
        delta.content = _text(delta_obj, "content", where)
        delta.refusal = _text(delta_obj, "refusal", where)
        calls = delta_obj.get("tool_calls") or []
        if not isinstance(calls, list):
            raise ParseError(f"{where}: tool_calls must be a list, got {type(calls).__name__}")
        for raw_call in calls:
            call = _object(raw_call, "a tool call", where)
            function = _object(call.get("function") or {}, "a tool call's function", where)
            arguments = _text(function, "arguments", where) or ""
            entry = (_index(call, where), _text(call, "id", where), _text(function, "name", where))
            delta.calls.append((*entry, arguments))
        out.choices.append((_index(choice, where), delta, _text(choice, "finish_reason", where)))
    usage = chunk.get("usage")
    if usage is not None:
        usage = _object(usage, "usage", where)
        counts: list[int] = []
        for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
            n = usage.get(key)
            if isinstance(n, bool) or not isinstance(n, int):
                raise ParseError(f"{where}: usage.{key} must be an int, got {n!r}")
            counts.append(n)
        out.usage = Usage(*counts)
    return out


__all__ = ["ChatStreamAssembler", "EventStreamParser", "ParseError"]
