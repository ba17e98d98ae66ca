"""Driving a stage-1 parser: building one, feeding it chunks, telling what came out.

Every helper builds a new :class:`~katas.streaming_parser.api.EventParser` from the stage
under test, so a test reads as "these chunks give these events". The limits tests need
the two sides of a limit said apart: :func:`accepted` (within it: any ``ParseError``
fails the test) and :func:`refusal` (past it: the error, and the parser that raised it).
:func:`cpu_seconds_to_feed_a_line` is the linear-time test's measure.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence

import pytest

from katas._harness.story import expect
from katas._harness.under_test import stage
from katas.streaming_parser.api import EventParser, ParseError, ServerSentEvent

from . import sse


def new_parser(**limits: int) -> EventParser:
    """The stage's ``EventStreamParser``, with ``limits`` (``max_line_bytes``,
    ``max_event_bytes``) or the defaults."""
    parser: EventParser = stage().EventStreamParser(**limits)
    return parser


def parse(chunks: Sequence[bytes], **limits: int) -> list[ServerSentEvent]:
    """Every event a new parser returns, fed ``chunks`` one ``feed`` each."""
    return [event for batch in sse.feed_all(new_parser(**limits), chunks) for event in batch]


def expect_events(chunks: Sequence[bytes], want: list[ServerSentEvent], why: str = "") -> None:
    """Fail unless a new parser fed ``chunks`` returns exactly ``want``."""
    __tracebackhide__ = True
    expect(parse(chunks), want, f"{why + ': ' if why else ''}feeding {list(chunks)!r}")


def accepted(chunks: Sequence[bytes], **limits: int) -> list[ServerSentEvent]:
    """The events of ``chunks``; a ParseError fails the test (the input is within limits)."""
    try:
        return parse(chunks, **limits)
    except ParseError as exc:
        pytest.fail(f"feeding {list(chunks)!r} with {limits} is within them, but raised: {exc}")


def refusal(chunks: Sequence[bytes], **limits: int) -> tuple[ParseError, EventParser]:
    """The ParseError a new parser raises at some chunk of ``chunks``, and that parser; no
    error fails the test (the input is past a limit)."""
    parser = new_parser(**limits)
    for chunk in chunks:
        try:
            parser.feed(chunk)
        except ParseError as exc:
            return exc, parser
    pytest.fail(f"feeding {list(chunks)!r} with {limits} must raise ParseError")


def expect_refused_at(
    chunks: Sequence[bytes], offset: int, why: str, **limits: int
) -> tuple[ParseError, EventParser]:
    """The :func:`refusal` of ``chunks``, failing the test unless the error's offset (the
    first byte past the limit) is ``offset``; ``why`` says where that byte is."""
    __tracebackhide__ = True
    exc, parser = refusal(chunks, **limits)
    expect(exc.offset, offset, f"feeding {list(chunks)!r}: {why}")
    return exc, parser


def cpu_seconds_to_feed_a_line(size: int, budget: float = float("inf")) -> float:
    """CPU seconds of this process to feed one ``size``-byte line in 64-byte chunks, or
    inf once ``budget`` is spent. CPU time, not wall time: other processes sharing the
    machine do not count, only the work this parser does."""
    parser = new_parser(max_line_bytes=size + 16)
    chunk = b"x" * 64
    start = time.process_time()
    parser.feed(b"data:")
    for i in range(size // 64):
        parser.feed(chunk)
        if i % 256 == 0 and time.process_time() - start > budget:
            return float("inf")
    parser.feed(b"\n\n")
    return time.process_time() - start


def feeds_until_refused(piece: bytes, limits: dict[str, int], most: int = 1000) -> int:
    """How many times a new parser is fed ``piece`` until it raises ParseError (``most``
    if it never does)."""
    parser = new_parser(**limits)
    fed = 0
    while fed < most:
        fed += 1
        try:
            parser.feed(piece)
        except ParseError:
            break
    return fed


def _random_split(body: bytes, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    return sse.cut(body, [rng.randrange(1, len(body)) for _ in range(len(body) // 40)])


#: How a recorded body is fed: whole, byte by byte, or cut at random (seeded) places.
CHUNKINGS: dict[str, Callable[[bytes], list[bytes]]] = {
    "whole": lambda body: [body],
    "bytewise": lambda body: [body[i : i + 1] for i in range(len(body))],
    "random": lambda body: _random_split(body, len(body)),
}


__all__ = [
    "CHUNKINGS",
    "accepted",
    "cpu_seconds_to_feed_a_line",
    "expect_events",
    "feeds_until_refused",
    "new_parser",
    "parse",
    "refusal",
]
