"""The event stream interpretation as a test oracle, and the bodies and splits to feed.

:func:`interpret` is the WHATWG algorithm written the plainest way there is — the
whole body at once, a regular expression for line ends, one decode per line — so that
it can be read against the standard line by line. A parser fed the same bytes in any
chunks must agree with it; :func:`bodies` and :func:`splits` draw inputs that crowd the
places where streaming parsers go wrong.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from hypothesis import strategies as st

from katas.streaming_parser.api import EventParser, ServerSentEvent

BOM = b"\xef\xbb\xbf"
_LINE_END = re.compile(rb"\r\n|\r|\n")


@dataclass
class Outcome:
    """What a stream (so far) dispatched, and the state a resuming client needs."""

    events: list[ServerSentEvent] = field(default_factory=list)
    last_event_id: str = ""
    retry_ms: int | None = None


def interpret(body: bytes, last_event_id: str = "", retry_ms: int | None = None) -> Outcome:
    """The events of ``body``, one stream read to its end (or to where it is cut): what
    its complete lines dispatch; the unterminated last line and event are dropped."""
    out = Outcome(last_event_id=last_event_id, retry_ms=retry_ms)
    if body.startswith(BOM):
        body = body[len(BOM) :]
    lines = _LINE_END.split(body)[:-1]  # the last piece has no line end (or is empty)
    data: list[str] = []
    kind = ""
    id_buffer = last_event_id
    retry: int | None = None
    for raw in lines:
        line = raw.decode("utf-8", "replace")
        if line == "":
            out.last_event_id = id_buffer
            if data:
                out.events.append(
                    ServerSentEvent(kind or "message", "\n".join(data), id_buffer, retry)
                )
            data, kind, retry = [], "", None
            continue
        if line.startswith(":"):
            continue
        name, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if name == "data":
            data.append(value)
        elif name == "event":
            kind = value
        elif name == "id":
            if "\0" not in value:
                id_buffer = value
        elif name == "retry" and value and all("0" <= c <= "9" for c in value):
            retry = out.retry_ms = int(value)
    return out


def feed_all(parser: EventParser, chunks: Sequence[bytes]) -> list[list[ServerSentEvent]]:
    """``parser.feed`` each chunk; the events of each call."""
    return [parser.feed(chunk) for chunk in chunks]


def cut(body: bytes, at: Sequence[int]) -> list[bytes]:
    """``body`` split at the offsets ``at`` (sorted, deduplicated, inside the body)."""
    points = [0, *sorted({p for p in at if 0 < p < len(body)}), len(body)]
    return [body[a:b] for a, b in itertools.pairwise(points)]


def every_split(body: bytes) -> list[list[bytes]]:
    """The body whole, byte by byte, and cut once at every offset."""
    return [[body], [body[i : i + 1] for i in range(len(body))]] + [
        [body[:i], body[i:]] for i in range(1, len(body))
    ]


def awkward_offsets(body: bytes) -> list[int]:
    """Where a split hurts: after every CR, inside every multi-byte character and BOM."""
    points = []
    for i, byte in enumerate(body):
        if byte == 0x0D or 0x80 <= byte < 0xC0 or byte >= 0xC0:
            points.append(i + 1)  # after a CR; inside or at the end of a sequence
        if 0x80 <= byte < 0xC0:
            points.append(i)  # before a continuation byte
    return points


# --- strategies -----------------------------------------------------------------------------

#: Characters that stress a parser: separators str.splitlines splits on, a NUL, the
#: colon and space of the field syntax, multi-byte characters of every length, a BOM.
_TEXT = st.one_of(
    st.sampled_from(["a", "z", " ", ":", "\0", "\u2028", "\u2029", "\x85", "\x0b", "\x0c"]),
    st.sampled_from(["é", "€", "😀", "\ufeff", "\ufffd", "٣", "5", "0"]),
)
_NAMES = st.sampled_from(["data", "data", "data", "event", "id", "retry", "Data", "x", ""])
_RAW = st.sampled_from([b"\xff", b"\xc3", b"\xe2\x82", b"\xf0\x9f\x98", b"\x80", b"\xed\xa0\x80"])


@st.composite
def _line(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["field", "field", "field", "blank", "blank", "comment", "raw"]))
    if kind == "blank":
        return b""
    value = "".join(draw(st.lists(_TEXT, max_size=6))).encode()
    if kind == "comment":
        return b":" + value
    if kind == "raw":
        return draw(st.lists(_RAW, min_size=1, max_size=3).map(b"".join)) + value
    name = draw(_NAMES).encode()
    if name == b"retry" and draw(st.booleans()):
        value = draw(st.sampled_from([b"0", b"5", b"1000", b"007"]))
    separator = draw(st.sampled_from([b":", b": ", b":  ", b""]))
    return name + separator + (value if separator else b"")


@st.composite
def bodies(draw: st.DrawFn, max_lines: int = 24) -> bytes:
    """A body of fields, comments, blank lines and raw bytes, each line ended by CRLF, LF
    or CR at random, maybe opened by a BOM, maybe cut before its end."""
    lines = draw(st.lists(_line(), max_size=max_lines))
    ends = st.sampled_from([b"\n", b"\r", b"\r\n"])
    body = b"".join(line + draw(ends) for line in lines)
    if draw(st.booleans()):
        body = BOM + body
    if body and draw(st.booleans()):
        body = body[: draw(st.integers(0, len(body)))]
    return body


@st.composite
def splits(draw: st.DrawFn, body: bytes) -> list[bytes]:
    """``body`` in chunks, half the cuts at the awkward places (:func:`awkward_offsets`)."""
    if not body:
        return [body]
    awkward = awkward_offsets(body)
    anywhere = st.integers(1, max(1, len(body) - 1))
    where = st.one_of(st.sampled_from(awkward), anywhere) if awkward else anywhere
    return cut(body, draw(st.lists(where, max_size=12)))


__all__ = [
    "BOM",
    "Outcome",
    "awkward_offsets",
    "bodies",
    "cut",
    "every_split",
    "feed_all",
    "interpret",
    "splits",
]
