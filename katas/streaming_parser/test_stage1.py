"""Stage 1: the sans-I/O SSE parser and the chat-delta assembler (see
katas/streaming_parser/README.md, "Stage 1").

Each rule of the prompt is checked at its boundary by an example — the split inside the
CRLF, the byte past the limit — and all of them at once by a property: random bodies,
split at random and at the awkward places, must give what the plain oracle
(:func:`~katas.streaming_parser._testing.sse.interpret`) gives for the whole body.

Map (rules in brackets):

- UTF-8 and the BOM [utf8, bom];
- lines [line-ends, cr-at-once];
- fields and dispatch [fields, dispatch, no-data, id, retry];
- chunking and the end of a stream [no-holding, close], with the any-split property;
- limits (extended) [limits, linear, bad-arguments];
- the assembler (extended) [deltas, choices, tool-calls, finish, chat-errors, recorded].

The drivers live in ``_testing/``: :mod:`~katas.streaming_parser._testing.parsers` (a new
parser fed chunks, the two sides of a limit), :mod:`~katas.streaming_parser._testing.chat`
(chunks written as a server sends them), :mod:`~katas.streaming_parser._testing.sse` (the
oracle, bodies and splits) and :mod:`~katas.streaming_parser._testing.recorded`.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from katas._harness.marks import core, extended, rule
from katas._harness.story import check, expect, not_refused
from katas._harness.under_test import stage
from katas.streaming_parser._testing import recorded, sse
from katas.streaming_parser._testing.chat import assemble, call, chunk, delta, new_assembler
from katas.streaming_parser._testing.parsers import (
    CHUNKINGS,
    accepted,
    cpu_seconds_to_feed_a_line,
    expect_events,
    expect_refused_at,
    feeds_until_refused,
    new_parser,
    parse,
    refusal,
)
from katas.streaming_parser.api import DEFAULT_MAX_LINE_BYTES, ParseError, ServerSentEvent

pytestmark = [pytest.mark.stage(1)]

E = ServerSentEvent


# --- UTF-8 and the BOM --------------------------------------------------------------------


@core
@rule("utf8")
def test_stage1_a_character_split_between_chunks_is_one_character() -> None:
    body = "data: é€😀\n\n".encode()
    for chunks in sse.every_split(body):
        expect_events(chunks, [E(data="é€😀")], "a multi-byte character split across chunks")


@core
@rule("utf8")
@pytest.mark.parametrize(
    "raw",
    [
        pytest.param(b"\xff", id="never-valid"),
        pytest.param(b"\x80x", id="lone-continuation"),
        pytest.param(b"\xe2\x82", id="truncated-at-line-end"),
        pytest.param(b"\xf0\x9f\x98x", id="truncated-before-ascii"),
        pytest.param(b"\xc0\xaf", id="overlong"),
        pytest.param(b"\xed\xa0\x80", id="surrogate"),
    ],
)
def test_stage1_invalid_utf8_becomes_replacement_characters(raw: bytes) -> None:
    body = b"data: <" + raw + b">\n\n"
    want = [E(data="<" + raw.decode("utf-8", "replace") + ">")]
    for chunks in ([body], [body[i : i + 1] for i in range(len(body))]):
        expect_events(chunks, want, f"invalid UTF-8 {raw!r} (one U+FFFD per maximal invalid part)")


@core
@rule("utf8", "id")
def test_stage1_invalid_utf8_in_any_field_becomes_replacement_characters() -> None:
    # Not only data: the type and the id are decoded the same way, and a field that is
    # ignored (an unknown name, a retry that is not digits) is ignored without an error.
    body = b"\xff: x\nretry: 5\xff\nevent: <\xff>\nid: <\xc3>\ndata: <\x80>\n\n"
    want = [E(event="<\ufffd>", data="<\ufffd>", id="<\ufffd>")]
    for chunks in ([body], [body[i : i + 1] for i in range(len(body))]):
        p = new_parser()
        with not_refused(
            f"utf8: feeding {chunks!r}: invalid bytes become U+FFFD", UnicodeDecodeError
        ):
            got = [e for batch in sse.feed_all(p, chunks) for e in batch]
        expect(
            (got, p.last_event_id, p.retry_ms),
            (want, "<\ufffd>", None),
            f"utf8: feeding {chunks!r}: every field's invalid bytes become U+FFFD "
            "(events, last_event_id, retry_ms — 'retry: 5\\xff' is not digits)",
        )


@core
@rule("bom")
def test_stage1_one_bom_at_the_start_is_stripped_even_split() -> None:
    body = sse.BOM + b"data: a\n\n"
    for chunks in sse.every_split(body):
        expect_events(chunks, [E(data="a")], "the BOM opens the stream")


@core
@rule("bom")
def test_stage1_only_the_first_bom_is_stripped() -> None:
    # A second BOM is part of the first field's name ("\ufeffdata": unknown, ignored).
    expect_events([sse.BOM + sse.BOM + b"data: a\n\ndata: b\n\n"], [E(data="b")], "a second BOM")
    # A BOM after the start is data.
    expect_events([b"data: a\n\n" + sse.BOM + b"data: b\n\n"], [E(data="a")], "a BOM mid-stream")
    expect_events([b"data: " + sse.BOM + b"x\n\n"], [E(data="\ufeffx")], "a BOM inside a value")
    # However the stream is split: a later chunk that begins with one keeps it.
    for chunks in sse.every_split(b"data: a" + sse.BOM + b"b\n\n" + sse.BOM + b"data: c\n\n"):
        expect_events(chunks, [E(data="a\ufeffb")], "a BOM that begins a later chunk")


# --- lines ----------------------------------------------------------------------------------


@core
@rule("line-ends")
@pytest.mark.parametrize("end", [b"\n", b"\r", b"\r\n"], ids=["LF", "CR", "CRLF"])
def test_stage1_crlf_lf_and_cr_end_lines_alike(end: bytes) -> None:
    lines = [b"event: x", b"data: a", b"data: b", b"", b"data: c", b""]
    body = end.join(lines) + end
    want = [E(event="x", data="a\nb"), E(data="c")]
    for chunks in sse.every_split(body):
        expect_events(chunks, want, f"lines ended by {end!r}")


@core
@rule("line-ends")
@pytest.mark.parametrize("char", ["\u2028", "\u2029", "\x85", "\x0b", "\x0c", "\x1c", "\x1e"])
def test_stage1_other_line_separators_are_data(char: str) -> None:
    body = f"data: a{char}b\n\n".encode()
    expect_events(
        [body], [E(data=f"a{char}b")], f"{char!r} is not a line end (str.splitlines says it is)"
    )


@core
@rule("cr-at-once")
def test_stage1_an_event_ending_in_cr_is_dispatched_by_the_same_feed() -> None:
    p = new_parser()
    expect(p.feed(b"data: a\r\r"), [E(data="a")], "feed(b'data: a\\r\\r') must dispatch at once")
    expect(
        p.feed(b"\ndata: b\r\n\r\n"),
        [E(data="b")],
        "the LF after the CR is that CRLF's, not a blank line",
    )


@core
@rule("cr-at-once")
def test_stage1_the_lf_of_a_crlf_split_across_chunks_is_skipped() -> None:
    # Were the LF a line of its own, it would dispatch "a" before "b" arrives.
    expect_events([b"data: a\r", b"\ndata: b\n\n"], [E(data="a\nb")], "CR | LF split across chunks")
    expect_events(
        [b"data: a\r", b"", b"\ndata: b\n\n"], [E(data="a\nb")], "an empty chunk in between"
    )
    expect_events([b"data: a\r", b"\n", b"\n"], [E(data="a")], "the LF alone, then a blank line")
    # Only an LF *directly* after the CR is skipped: here the next chunk starts otherwise,
    # and the LF that ends "data: b" is a line end of its own.
    expect_events([b"data: a\r", b"data: b", b"\n\n"], [E(data="a\nb")], "CR | a line | LF LF")
    # A lone CR followed by a CR is two line ends: the second one is the blank line.
    expect_events([b"data: a\r", b"\r"], [E(data="a")], "CR | CR")


# --- fields and dispatch -------------------------------------------------------------------


@core
@rule("fields")
@pytest.mark.parametrize(
    ("line", "expected"),
    [
        pytest.param(b"data:x", [E(data="x")], id="no-space"),
        pytest.param(b"data: x", [E(data="x")], id="one-space"),
        pytest.param(b"data: ", [E(data="")], id="one-space-and-nothing-after"),
        pytest.param(b"data:  x", [E(data=" x")], id="two-spaces-one-kept"),
        pytest.param(b"data:\tx", [E(data="\tx")], id="a-tab-is-not-a-space"),
        pytest.param(b"data: a:b", [E(data="a:b")], id="first-colon-splits"),
        pytest.param(b"data", [E(data="")], id="no-colon-empty-value"),
        pytest.param(b"data:", [E(data="")], id="empty-value"),
        pytest.param(b"Data: x", [], id="names-are-case-sensitive"),
        pytest.param(b"data : x", [], id="a-space-before-the-colon-is-the-name"),
        pytest.param(b": data: x", [], id="comment"),
        pytest.param(b":", [], id="empty-comment"),
        pytest.param(b"foo: x", [], id="unknown-field"),
    ],
)
def test_stage1_a_line_is_a_comment_or_a_field_and_its_value(
    line: bytes, expected: list[ServerSentEvent]
) -> None:
    expect_events([line + b"\n\n"], expected, f"the line {line!r}")


@core
@rule("dispatch")
def test_stage1_a_blank_line_dispatches_data_joined_with_lf() -> None:
    expect_events([b"data: a\ndata: b\n\n"], [E(data="a\nb")], "two data lines")
    expect_events([b"data: a\ndata:\n\n"], [E(data="a\n")], "only the last LF is removed")
    expect_events([b"data\ndata\n\n"], [E(data="\n")], "two empty data lines")
    expect_events([b"event: x\nevent: y\ndata: a\n\n"], [E(event="y", data="a")], "the last type")
    expect_events(
        [b"event: x\ndata: a\n\ndata: b\n\n"],
        [E(event="x", data="a"), E(data="b")],
        "the type starts over after a dispatch",
    )
    expect_events([b"event:\ndata: a\n\n"], [E(data="a")], "an empty type is a message")


@core
@rule("no-data")
@pytest.mark.parametrize(
    "block",
    [b"event: x\n", b"id: 1\n", b"retry: 5\n", b": keepalive\n", b"foo: 1\n", b""],
    ids=["event", "id", "retry", "comment", "unknown", "nothing"],
)
def test_stage1_a_block_without_data_dispatches_nothing(block: bytes) -> None:
    expect_events([block + b"\n"], [], f"the block {block!r} has no data line")
    # And it leaves nothing behind for the next event but its id: no type, no retry.
    got = parse([block + b"\ndata: a\n\n"])
    expect(
        [(e.event, e.data, e.retry) for e in got],
        [("message", "a", None)],
        f"after the data-less block {block!r}: one message 'a' with retry None (events: {got})",
    )


@core
@rule("id")
def test_stage1_last_event_id_moves_only_at_a_blank_line() -> None:
    p = new_parser()
    p.feed(b"id: 1\ndata: a\n")
    check(p.last_event_id == "", "last_event_id changed before the event's blank line arrived")
    got = p.feed(b"\n")
    expect(
        (got, p.last_event_id),
        ([E(data="a", id="1")], "1"),
        "the blank line dispatches a with id 1 and sets last_event_id (events, last_event_id)",
    )
    expect(p.feed(b"data: b\n\n"), [E(data="b", id="1")], "a later event keeps the id")
    p.feed(b"id: 2\n\n")
    check(p.last_event_id == "2", "a block of only id: still moves last_event_id")


@core
@rule("id")
@pytest.mark.parametrize(
    ("line", "expected_id"),
    [
        pytest.param(b"id", "", id="no-colon-clears"),
        pytest.param(b"id:", "", id="empty-clears"),
        pytest.param(b"id: a\x00b", "7", id="nul-is-ignored"),
        pytest.param(b"id:  8", " 8", id="one-space-removed"),
        pytest.param(b"ID: 9", "7", id="case-sensitive"),
    ],
)
def test_stage1_an_id_line_sets_clears_or_is_ignored(line: bytes, expected_id: str) -> None:
    got = parse([b"id: 7\ndata: a\n\n" + line + b"\ndata: b\n\n"])
    expect([e.id for e in got], ["7", expected_id], f"after id 7, the line {line!r}: the ids")


@core
@rule("id", "close")
def test_stage1_an_unterminated_id_never_becomes_the_last_event_id() -> None:
    p = new_parser()
    p.feed(b"id: 1\ndata: a\n\nid: 2\ndata: b\n")
    p.close()
    expect(p.last_event_id, "1", "event 2 never completed, so a resume must ask from 1")
    expect(
        p.feed(b"data: c\n\n"),
        [E(data="c", id="1")],
        "the unterminated block's id 2 must not reach the next stream's events",
    )


@core
@rule("retry")
def test_stage1_a_valid_retry_sets_retry_ms_and_the_events_retry() -> None:
    p = new_parser()
    expect(
        p.feed(b"retry: 3000\ndata: a\n\ndata: b\n\n"),
        [E(data="a", retry=3000), E(data="b")],
        "retry belongs to its own event: a retry=3000, b retry=None",
    )
    expect(p.retry_ms, 3000, "retry_ms must stay 3000")
    p.feed(b"retry: 0\n\n")
    expect(p.retry_ms, 0, "retry: 0 is valid")


@core
@rule("retry", "close")
def test_stage1_retry_ms_moves_at_its_line_even_in_an_event_never_completed() -> None:
    p = new_parser()
    p.feed(b"id: 1\ndata: a\n\nretry: 250\ndata: b\n")
    expect(
        p.retry_ms,
        250,
        "retry: 'retry: 250' arrived, its event's blank line not yet: retry_ms is the "
        "reconnection time from that line on (unlike last_event_id)",
    )
    p.close()
    expect(
        (p.retry_ms, p.last_event_id),
        (250, "1"),
        "close() discarded the event 'b' that carried 'retry: 250': retry_ms stays 250, "
        "last_event_id stays '1' (retry_ms, last_event_id)",
    )
    expect(
        p.feed(b"data: c\n\n"),
        [E(data="c", id="1")],
        "the discarded event's retry is not the next event's (its retry is None)",
    )


@core
@rule("retry")
@pytest.mark.parametrize(
    "value",
    [
        pytest.param(b"1.5", id="decimal"),
        pytest.param(b"-1", id="negative"),
        pytest.param(b"+5", id="plus-sign"),
        pytest.param(b"5s", id="unit"),
        pytest.param(b"", id="empty"),
        pytest.param(b" 5", id="leading-space"),
        pytest.param(b"1_000", id="underscore"),
        pytest.param("٣".encode(), id="arabic-indic-digit"),
        pytest.param(b"0x10", id="hex"),
        pytest.param(b"1 ", id="trailing-space"),
    ],
)
def test_stage1_a_retry_that_is_not_ascii_digits_is_ignored(value: bytes) -> None:
    p = new_parser()
    got = p.feed(b"retry: 100\n\nretry: " + value + b"\ndata: a\n\n")
    expect(
        (got, p.retry_ms),
        ([E(data="a")], 100),
        f"retry: {value!r} must be ignored: a with retry None, and retry_ms stays 100",
    )
    got = p.feed(b"retry: 200\nretry: " + value + b"\ndata: b\n\n")
    expect(
        (got, p.retry_ms),
        ([E(data="b", retry=200)], 200),
        f"retry: 200, then retry: {value!r} in the same event: the second line is ignored, "
        "so b keeps retry 200 (and retry_ms is 200)",
    )


# --- chunking and the end of a stream ----------------------------------------------------


@core
@rule("no-holding")
def test_stage1_each_event_comes_out_of_the_feed_that_completed_it() -> None:
    body = b"data: a\n\nid: 1\ndata: b\r\n\r\nevent: x\rdata: c\r\r" + sse.BOM + b"data: d\n\n"
    p = new_parser()
    for i in range(len(body)):
        got = p.feed(body[i : i + 1])
        expected = sse.interpret(body[: i + 1]).events[len(sse.interpret(body[:i]).events) :]
        expect(got, expected, f"feeding byte {i} ({body[i : i + 1]!r}) after {body[:i]!r}")


@core
@rule("no-holding", "line-ends", "utf8", "fields", "dispatch", "no-data", "id")
@given(st.data())
def test_stage1_any_split_gives_the_events_of_the_whole_body(data: st.DataObject) -> None:
    body = data.draw(sse.bodies(), "body")
    chunks = data.draw(sse.splits(body), "chunks")
    want = sse.interpret(body)
    p = new_parser()
    got = [event for batch in sse.feed_all(p, chunks) for event in batch]
    expect(got, want.events, f"feeding {chunks!r}")
    expect(
        (p.last_event_id, p.retry_ms),
        (want.last_event_id, want.retry_ms),
        f"feeding {chunks!r}: (last_event_id, retry_ms)",
    )


@core
@rule("close", "retry", "id")
@pytest.mark.parametrize("line", [b"retry: 500", b"id: 7", b"data: x"], ids=["retry", "id", "data"])
def test_stage1_close_never_ends_the_pending_line(line: bytes) -> None:
    p = new_parser()
    p.feed(b"retry: 50\nid: 3\n\n" + line)
    expect(p.close(), [], f"close() after {line!r} with no line end")
    expect(
        (p.last_event_id, p.retry_ms, p.feed(b"\n\n")),
        ("3", 50, []),
        f"close: the stream ended inside the line {line!r}, so that line never arrived: "
        "(last_event_id, retry_ms) stay as they were, and the next stream starts with "
        "nothing pending; (last_event_id, retry_ms, the events of a blank line next)",
    )


@core
@rule("close")
def test_stage1_close_discards_the_unterminated_event_and_starts_a_new_stream() -> None:
    p = new_parser()
    p.feed(b"retry: 50\nid: 3\ndata: a\n\ndata: half")
    expect(p.close(), [], "close() must not dispatch the unterminated event")
    p.feed(b"data: a whole line\n")
    expect(
        p.close(),
        [],
        "close() after a whole data line but no blank line: that event never completed, "
        "so it is discarded too",
    )
    expect(
        (p.last_event_id, p.retry_ms),
        ("3", 50),
        "close() keeps last_event_id and retry_ms for the reconnect",
    )
    # The next stream starts clean: its first bytes are not glued to "half", a BOM opens it.
    expect(p.feed(sse.BOM + b"data: b\n\n"), [E(data="b", id="3")], "after close()")
    p.feed(b"data: c\r")
    p.close()
    expect(
        p.feed(b"\ndata: d\n\n"),
        [E(data="d", id="3")],
        "a new stream's first LF is a blank line, not the old CR's LF",
    )
    p.feed(b"event: cut\nretry: 70\nid: 9\ndata: e")  # every field of an event, cut off
    p.close()
    expect(
        p.feed(b"data: f\n\n"),
        [E(data="f", id="3")],
        "event: cut, retry: 70, id: 9 and data: e belonged to an event close() discarded: "
        "the next stream's first event has the type message, no retry of its own and the "
        "last event id (retry_ms did move to 70 at its line)",
    )


# --- limits -----------------------------------------------------------------------------------


@extended
@rule("limits", "line-ends")
def test_stage1_an_offset_after_a_crlf_split_across_chunks_counts_its_lf() -> None:
    line = b"data: " + b"x" * 20  # 26 bytes: 6 past a limit of 20
    # "data: a\r" is bytes 0-7, its LF byte 8: the long line starts at 9, and the first
    # byte past the limit is 9 + 20.
    expect_refused_at(
        [b"data: a\r", b"\n" + line], 9 + 20,
        "a CRLF split across chunks is 2 bytes of the stream: the LF skipped at the start "
        "of the second chunk counts, so the line after it starts at 9",
        max_line_bytes=20,
    )  # fmt: skip
    expect_refused_at(
        [b"data: a\r", b"\ndata: " + b"y" * 30 + b"\n"], 9,
        "the data: line that breaks the event limit starts at 9, after the CR (7) and the LF "
        "(8) of a CRLF split across chunks",
        max_event_bytes=20,
    )  # fmt: skip


@extended
@rule("limits")
def test_stage1_a_line_at_the_limit_passes_and_one_byte_more_is_refused() -> None:
    got = accepted([b"data:abc\r\n\r\n"], max_line_bytes=8)
    expect(got, [E(data="abc")], "an 8-byte line (line end not counted) fits")
    for chunks in ([b"data: 1\n\ndata:abcd\n"], [b"data: 1\n\nda", b"ta:ab", b"cd\n"]):
        why = "the 9-byte line starts at offset 9, so the first byte past the limit is at 17"
        expect_refused_at(chunks, 9 + 8, f"{why} (ParseError.offset)", max_line_bytes=8)
    exc, p = refusal([b"data: 1\n\ndata: 2\n\ndata:abcd\n"], max_line_bytes=8)
    expect(
        exc.events,
        (E(data="1"), E(data="2")),
        "the events completed before the error in the same feed are kept (ParseError.events)",
    )
    with pytest.raises(ParseError):
        p.feed(b"data: 3\n\n")


@extended
@rule("limits", "fields")
@pytest.mark.parametrize(
    "line",
    [
        pytest.param(b": 1234567", id="comment"),
        pytest.param(b"data:abcd", id="data"),
        pytest.param(b"event:abc", id="event"),
        pytest.param(b"id:123456", id="id"),
        pytest.param(b"retry:123", id="retry"),
        pytest.param(b"foo:12345", id="unknown-field"),
        pytest.param(b"123456789", id="no-colon"),
    ],
)
def test_stage1_every_kind_of_line_counts_against_the_line_limit(line: bytes) -> None:
    # A 9-byte line against max_line_bytes=8, after a 2-byte blank line: the first byte
    # past the limit is at 2 + 8. Whole (the line complete in one chunk), cut before its
    # LF, and byte by byte (the line pending).
    body = b"\r\n" + line + b"\n"
    for chunks in ([body], [body[:-1], body[-1:]], [body[i : i + 1] for i in range(len(body))]):
        expect_refused_at(
            chunks,
            2 + 8,
            f"the {len(line)}-byte line {line!r} is over max_line_bytes=8 — every line counts, "
            "whatever it is (ParseError.offset: the first byte past the limit)",
            max_line_bytes=8,
        )
    fits = b"\r\n" + line[:-1] + b"\n\n"
    accepted([fits], max_line_bytes=8)  # the same line, one byte shorter: within it


@extended
@rule("limits", "close")
@pytest.mark.parametrize(
    ("chunks", "limits"),
    [
        pytest.param([b"data: 1\n\ndata:abcd\n"], {"max_line_bytes": 8}, id="line-limit"),
        pytest.param([b"data: 1\n\n", b"data: 1234"], {"max_line_bytes": 8}, id="pending-line"),
        pytest.param([b"data: 12345678\ndata: 9\n\n"], {"max_event_bytes": 10}, id="event-limit"),
    ],
)
def test_stage1_a_refused_parser_refuses_every_call_close_included(
    chunks: list[bytes], limits: dict[str, int]
) -> None:
    exc, p = refusal(chunks, **limits)
    calls = [
        ("close()", p.close),
        ("feed(b'data: 2\\n\\n') after close()", lambda: p.feed(b"data: 2\n\n")),
        ("close() again", p.close),
        ("feed(b'')", lambda: p.feed(b"")),
    ]
    for what, refused_call in calls:
        try:
            out = refused_call()
        except ParseError as again:
            expect(
                (again.offset, again.events),
                (exc.offset, ()),
                f"limits: after {chunks!r} was refused ({limits}), {what} raises that same "
                "error (ParseError.offset); its events are the ones this call completed, "
                "none (the first error handed on the events before it)",
            )
            continue
        pytest.fail(
            f"limits: after feeding {chunks!r} raised ParseError ({limits}), the parser "
            f"refuses every call with that error — close() too, and every feed after it; "
            f"{what} returned {out!r}"
        )


@extended
@rule("limits", "bom")
def test_stage1_a_bom_is_not_part_of_the_first_line_however_it_is_split() -> None:
    # The BOM is stripped before lines are cut: it never counts against the line limit,
    # but its bytes count in the stream's offsets.
    fits, too_long = sse.BOM + b"data:abc\n\n", sse.BOM + b"data:abcd\n"
    for chunks in sse.every_split(fits):
        expect(accepted(chunks, max_line_bytes=8), [E(data="abc")], f"feeding {chunks!r}")
    for chunks in sse.every_split(too_long):
        why = "the line starts after the 3-byte BOM, so the first byte past the limit is at 11"
        expect_refused_at(chunks, 3 + 8, f"{why} (ParseError.offset)", max_line_bytes=8)


@extended
@rule("limits")
def test_stage1_an_event_at_the_limit_passes_and_one_byte_more_is_refused() -> None:
    # Event size: the data values plus one LF each. "12345678" + LF = 9, "9" + LF = 2.
    got = accepted([b"data: 12345678\ndata:\n\n"], max_event_bytes=10)
    expect(got, [E(data="12345678\n")], "an event of exactly 10 bytes fits")
    exc, _ = refusal([b"data: a\n\ndata: 12345678\ndata: 9\n\n"], max_event_bytes=10)
    expect(exc.offset, 24, "the data line that breaks the limit starts at offset 24")
    expect(exc.events, (E(data="a"),), "the event before it is kept (ParseError.events)")
    # Bytes, not characters: "é" is 2 bytes, so "ééé" + LF is 7 bytes (4 characters).
    expect(accepted(["data: ééé\n\n".encode()], max_event_bytes=7), [E(data="ééé")], "7 bytes")
    exc, _ = refusal(["data: ééé\n\n".encode()], max_event_bytes=6)
    expect(exc.offset, 0, "'ééé' + LF is 7 bytes (4 characters): past max_event_bytes=6")


@extended
@rule("limits", "fields")
@pytest.mark.parametrize(
    ("body", "offset"),
    [
        # A bare "data" is a data field with an empty value: 1 byte (its LF) each.
        pytest.param(b"data\ndata\ndata\ndata\n\n", 15, id="bare-data"),
        pytest.param(b"data:\ndata:\ndata:\ndata:\n\n", 18, id="empty-data"),
        pytest.param(b"data: ab\ndata\n\n", 9, id="value-then-bare"),
        pytest.param(b"data\ndata:ab\n\n", 5, id="bare-then-value"),
    ],
)
def test_stage1_every_data_line_counts_against_the_event_limit(body: bytes, offset: int) -> None:
    for chunks in ([body], [body[i : i + 1] for i in range(len(body))]):
        expect_refused_at(
            chunks,
            offset,
            "max_event_bytes=3: every data line adds its value plus one LF — a bare 'data' "
            f"(no colon) adds 1 — and the data line that passes 3 starts at {offset} "
            "(ParseError.offset)",
            max_event_bytes=3,
        )
    within = body[: body.rindex(b"data")] + b"\n"  # the same event without its last line
    accepted([within], max_event_bytes=3)


@extended
@rule("limits", "close")
def test_stage1_close_starts_the_next_stream_within_fresh_limits() -> None:
    p = new_parser(max_line_bytes=16, max_event_bytes=10)
    p.feed(b"data: 12345678\n")  # 9 of the event's 10 bytes; the event never completes
    p.close()
    with not_refused(
        "limits: close() discarded the event of 9 bytes; the next stream's event of 3 bytes "
        "(max_event_bytes=10) is within the limit",
        ParseError,
    ):
        got = p.feed(b"data: 12\n\n")
    expect(got, [E(data="12")], "after close(), a new event within max_event_bytes=10")
    p.feed(b"data: 1234567")  # a 13-byte line pending, never ended
    p.close()
    with not_refused(
        "limits: close() discarded the pending 13-byte line; the next stream's 14-byte line "
        "(max_line_bytes=16) is within the limit",
        ParseError,
    ):
        got = p.feed(b"data: 12345678\n\n")
    expect(got, [E(data="12345678")], "after close(), a new line within max_line_bytes=16")
    p.close()
    with pytest.raises(ParseError) as refused:
        p.feed(b"data: a\n\ndata: 123456789012\n")
        raise AssertionError("limits: an 18-byte line, max_line_bytes=16, was accepted")
    check(
        refused.value.offset == 25,
        "limits: after close(), offsets count from the new stream's first byte: its "
        "line 'data: 123456789012' starts at 9, so its 17th byte is at offset 25; got "
        f"{refused.value.offset} ({refused.value})",
    )


@extended
@rule("limits")
def test_stage1_the_default_limits_take_a_mebibyte_line() -> None:
    line = b"data:" + b"x" * (DEFAULT_MAX_LINE_BYTES - 5)
    got = accepted([line + b"\n\n"])
    expect(
        [len(event.data) for event in got],
        [DEFAULT_MAX_LINE_BYTES - 5],
        "a line of exactly 1 MiB fits the default limit: one event (the lengths of its data)",
    )
    exc, _ = refusal([line + b"x\n\n"])
    expect(exc.offset, DEFAULT_MAX_LINE_BYTES, "one byte more is refused (ParseError.offset)")


@extended
@rule("limits")
@pytest.mark.parametrize(
    ("piece", "limits"),
    [
        pytest.param(b"x" * 4096, {"max_line_bytes": 65_536}, id="endless-line"),
        pytest.param(b"data: " + b"x" * 4090 + b"\n", {"max_event_bytes": 65_536}, id="event"),
        # 4000 bare "data" lines: 4000 bytes of data a chunk (an LF each).
        pytest.param(b"data\n" * 4000, {"max_event_bytes": 65_536}, id="bare-data-lines"),
    ],
)
def test_stage1_a_hostile_stream_is_refused_once_past_its_limit(
    piece: bytes, limits: dict[str, int]
) -> None:
    fed = feeds_until_refused(piece, limits)
    check(
        fed == 17,
        f"{len(piece)}-byte chunks against a limit of {limits}: the 17th chunk passes it, "
        f"but the refusal came at chunk {fed}",
    )


@extended
@rule("limits")
def test_stage1_the_event_limit_counts_each_event_on_its_own() -> None:
    # "0123456789abcde" + LF = 16 bytes: each event is exactly at the limit, the stream far
    # past it.
    p = new_parser(max_event_bytes=16)
    for i in range(100):
        with not_refused(f"event {i + 1} of 16 bytes is within max_event_bytes=16", ParseError):
            got = p.feed(b"data: 0123456789abcde\n\n")
        expect(
            got,
            [E(data="0123456789abcde")],
            f"event {i + 1} of 16 bytes, within max_event_bytes=16, is dispatched (the limit is "
            "per event, not per stream)",
        )


@extended
@rule("limits")
def test_stage1_keepalive_comments_never_reach_a_limit() -> None:
    p = new_parser(max_line_bytes=64, max_event_bytes=64)
    for n in range(2000):
        expect(p.feed(b": keepalive\n"), [], f"keep-alive comment {n + 1} (limits of 64 bytes)")
    expect(p.feed(b"data: a\n\n"), [E(data="a")], "an event after 2000 keep-alive comments")


@extended
@rule("linear")
def test_stage1_a_long_line_costs_linear_time_in_small_chunks() -> None:
    # A ratio of two sizes, each the best of five runs taken in turn (so that a burst of
    # load on a shared machine hits both alike), each run stopped once it is clearly too
    # slow: a quadratic buffer takes ~16x for 4x the bytes. First 256 KiB against 1 MiB
    # (a quadratic one fails fast), then the prompt's 1 MiB against 4 MiB.
    for small in (1 << 18, 1 << 20):
        base = big = float("inf")
        for _ in range(5):
            base = min(base, cpu_seconds_to_feed_a_line(small))
            big = min(big, cpu_seconds_to_feed_a_line(4 * small, 8 * base))
        check(
            big <= 8 * base,
            f"a {4 * small >> 10} KiB line in 64-byte chunks took more than 8x the CPU time "
            f"of a {small >> 10} KiB one ({base * 1e3:.1f} ms): the work is not linear",
        )


@extended
@rule("bad-arguments")
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"max_line_bytes": 0}, ValueError, "max_line_bytes"),
        ({"max_event_bytes": -1}, ValueError, "max_event_bytes"),
        ({"max_line_bytes": "64"}, TypeError, "max_line_bytes"),
        ({"max_event_bytes": True}, TypeError, "max_event_bytes"),
        ({"max_line_bytes": 1.5}, TypeError, "max_line_bytes"),
    ],
)
def test_stage1_a_bad_limit_is_refused_naming_it(
    kwargs: dict[str, object], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        stage().EventStreamParser(**kwargs)


@extended
@rule("bad-arguments")
@pytest.mark.parametrize(
    "data", ["data: a\n\n", None, 12, [10]], ids=["str", "None", "int", "list"]
)
def test_stage1_feed_refuses_what_is_not_bytes(data: object) -> None:
    p = new_parser()
    with pytest.raises(TypeError, match="data"):
        p.feed(data)  # type: ignore[arg-type]  # not bytes, on purpose
    expect(p.feed(b"data: a\n\n"), [E(data="a")], "a refused feed must change nothing")


@extended
@rule("bad-arguments", "cr-at-once")
def test_stage1_feed_takes_any_bytes_like_chunk() -> None:
    # bytes, bytearray and memoryview (a slice of a larger buffer too) are all bytes-like;
    # a chunk of each kind continues what the one before left (a CR, a half character).
    buffer = bytearray("xxdata: b€\r\n\r\n".encode())
    chunks: list[object] = [
        bytearray(b"data: a\r"),
        memoryview(b"\n\n"),
        memoryview(buffer)[2:10],  # "data: b" and the first byte of the euro sign
        bytes(buffer[10:]),
    ]
    p = new_parser()
    got: list[ServerSentEvent] = []
    for n, piece in enumerate(chunks):
        with not_refused(
            f"bad-arguments: feed({piece!r}): feed takes any bytes-like chunk (bytes, "
            f"bytearray, memoryview); chunk {n} of {chunks!r}",
            TypeError,
        ):
            got += p.feed(piece)  # type: ignore[arg-type]  # bytes-like, not bytes
    expect(
        got,
        [E(data="a"), E(data="b€")],
        f"bad-arguments: feeding the bytes-like chunks {chunks!r}: the same events as bytes",
    )


# --- the assembler -------------------------------------------------------------------------


@extended
@rule("deltas")
def test_stage1_content_and_refusal_concatenate_from_the_first_string() -> None:
    result = assemble(
        [
            chunk(delta(0, role="assistant", content=None, refusal=None)),
            chunk(delta(0, content="")),
            chunk(delta(0, content="Hel")),
            chunk(delta(0, content="lo")),
        ]
    )
    (choice,) = result.choices
    expect(
        (choice.role, choice.content, choice.refusal),
        ("assistant", "Hello", None),
        "(role, content, refusal): content from its first string on, refusal None (no string sent)",
    )
    (choice,) = assemble([chunk(delta(0, content=None, refusal=""))]).choices
    expect(
        (choice.content, choice.refusal),
        (None, ""),
        f"a refusal of '' is a string, a content of null is not: (content, refusal) of {choice}",
    )
    (choice,) = assemble([chunk(delta(0, content="", refusal=None))]).choices
    expect(
        (choice.content, choice.refusal),
        ("", None),
        f"a content of '' is a string, a refusal of null is not: (content, refusal) of {choice}",
    )


@extended
@rule("deltas")
def test_stage1_the_role_is_the_last_one_sent() -> None:
    result = assemble(
        [
            chunk(delta(0, role="assistant", content=""), delta(1, role="assistant")),
            chunk(delta(0, role="tool", content="a"), delta(1, content="b")),
            chunk(delta(0, content="c"), delta(1, role=None, content="d")),
        ]
    )
    expect(
        [(c.index, c.role, c.content) for c in result.choices],
        [(0, "tool", "ac"), (1, "assistant", "bd")],
        "deltas: choice 0 was sent role 'assistant', then 'tool': the last one sent wins; a "
        "delta without a role (or a null one) keeps it, as choice 1 shows",
    )


@extended
@rule("choices")
def test_stage1_interleaved_choices_never_mix() -> None:
    result = assemble(
        [
            chunk(delta(2, content="c")),
            chunk(delta(0, content="a")),
            chunk(delta(1, content="b"), delta(0, content="A")),
            chunk(delta(2, content="C", finish="stop")),
            chunk(delta(1, content="B", finish="length")),
        ]
    )
    expect(
        [(c.index, c.content, c.finish_reason) for c in result.choices],
        [(0, "aA", None), (1, "bB", "length"), (2, "cC", "stop")],
        "each delta goes to the choice its index names, listed by index",
    )


@extended
@rule("tool-calls")
def test_stage1_tool_call_fragments_join_their_own_call() -> None:
    result = assemble(
        [
            chunk(delta(0, tool_calls=[call(0, "", "call_a", "get_weather")])),
            chunk(delta(0, tool_calls=[call(0, '{"ci')])),
            chunk(delta(0, tool_calls=[call(1, '{"t', "call_b", "get_stock")])),
            chunk(delta(0, tool_calls=[call(0, 'ty": "X"}'), call(1, 'icker": "Y"}')])),
            chunk(delta(0, finish="tool_calls")),
        ]
    )
    expect(
        [(t.index, t.id, t.name, t.arguments) for t in result.choices[0].tool_calls],
        [
            (0, "call_a", "get_weather", '{"city": "X"}'),
            (1, "call_b", "get_stock", '{"ticker": "Y"}'),
        ],
        "fragments join the call their index names, in order",
    )


@extended
@rule("tool-calls", "choices")
def test_stage1_each_choice_has_tool_calls_of_its_own() -> None:
    """Two choices each call a tool at index 0, their fragments interleaved: a tool
    call's index counts inside its choice, so each choice lists its own call."""
    result = assemble(
        [
            chunk(delta(0, tool_calls=[call(0, '{"a"', "call_a", "f")])),
            chunk(delta(1, tool_calls=[call(0, '{"b"', "call_b", "g")])),
            chunk(delta(1, tool_calls=[call(0, ": 2}")]), delta(0, tool_calls=[call(0, ": 1}")])),
        ]
    )
    expect(
        [[(t.index, t.id, t.name, t.arguments) for t in c.tool_calls] for c in result.choices],
        [[(0, "call_a", "f", '{"a": 1}')], [(0, "call_b", "g", '{"b": 2}')]],
        "choices 0 and 1 each call a tool at index 0, interleaved: each choice's tool "
        "calls are its own (keyed by the index inside the choice)",
    )


@extended
@rule("tool-calls")
def test_stage1_a_tool_calls_id_and_name_come_from_the_first_fragment_that_has_them() -> None:
    result = assemble(
        [
            chunk(delta(0, tool_calls=[call(0, '{"a"', "call_a", "f"), call(1, "", "call_c")])),
            chunk(delta(0, tool_calls=[call(0, ": 1", "call_b", "g"), call(1, "{", name="h")])),
            chunk(delta(0, tool_calls=[call(0, "}", name="k"), call(1, "}", "call_d", "m")])),
        ]
    )
    expect(
        [(t.index, t.id, t.name, t.arguments) for t in result.choices[0].tool_calls],
        [(0, "call_a", "f", '{"a": 1}'), (1, "call_c", "h", "{}")],
        "tool-calls: a call's id and name are those of the first fragment that carries "
        "each (call 0: id call_a then call_b, name f then g, k; call 1: id call_c, its "
        "name first in the second fragment, h); later ones never replace them",
    )


@extended
@rule("tool-calls")
def test_stage1_tool_calls_are_listed_by_index_whatever_order_they_began_in() -> None:
    result = assemble(
        [
            chunk(delta(0, tool_calls=[call(1, "{}", "call_b", "g")])),
            chunk(delta(0, tool_calls=[call(0, "{}", "call_a", "f")])),
        ]
    )
    expect(
        [(t.index, t.id) for t in result.choices[0].tool_calls],
        [(0, "call_a"), (1, "call_b")],
        "tool-calls: call 1's first fragment came before call 0's; the calls are keyed, "
        "and listed, by their index",
    )


@extended
@rule("finish")
def test_stage1_a_null_finish_reason_or_usage_after_them_changes_nothing() -> None:
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    result = assemble(
        [
            chunk(delta(0, content="x", finish="stop"), delta(1, content="y")),
            chunk(delta(0), delta(1, content="z", finish="length")),  # choice 0: null
            chunk(usage=usage),
            chunk(delta(1)),  # usage absent, finish_reason null
        ]
    )
    got = ([c.finish_reason for c in result.choices], result.usage)
    check(
        got[0] == ["stop", "length"] and got[1] is not None and got[1].total_tokens == 5,
        f"finish: choice 0 finished with 'stop', then a chunk carried it again with "
        f"finish_reason null; the usage chunk came, then a chunk without usage. A null or "
        f"absent field records nothing: expected finish reasons ['stop', 'length'] and "
        f"total_tokens 5; got {got}",
    )


@extended
@rule("finish")
def test_stage1_usage_and_done_end_the_stream() -> None:
    assembler = new_assembler()
    for event in [
        chunk(delta(0, content="x", finish="stop")),
        chunk(usage={"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}),
    ]:
        assembler.add(event)
    check(not assembler.done, "done only at data: [DONE]")
    assembler.add(E(data="[DONE]"))
    result = assembler.result()
    check(
        result.done and result.usage is not None and result.usage.total_tokens == 4,
        f"after the usage chunk and [DONE]: done, with total_tokens 4; got {result}",
    )
    expect(result.choices[0].finish_reason, "stop", "the choice's finish_reason")
    with pytest.raises(ParseError, match="DONE"):
        assembler.add(chunk(delta(0, content="late")))


@extended
@rule("finish", "chat-errors")
@pytest.mark.parametrize(
    "late",
    [
        pytest.param(chunk(delta(0, content="late")), id="chunk"),
        pytest.param(E(event="ping", data="{}"), id="ping"),
        pytest.param(E(event="error", data='{"error": "late"}'), id="error"),
        pytest.param(E(event="error", data='{"error": "late"}', id="9"), id="error-with-id"),
        pytest.param(E(data="[DONE]"), id="done-again"),
        pytest.param(E(data="not json"), id="not-json"),
    ],
)
def test_stage1_an_event_of_any_type_after_done_is_refused(late: ServerSentEvent) -> None:
    assembler = new_assembler()
    assembler.add(chunk(delta(0, content="x")))
    assembler.add(E(data="[DONE]"))
    before = assembler.result()
    try:
        assembler.add(late)
    except ParseError as refused:
        message = str(refused)
    else:
        pytest.fail(
            f"finish: after data: [DONE], every event raises ParseError — one of another type "
            f"too; {late} was accepted"
        )
    expect(assembler.result(), before, "finish: the refused event changes nothing")
    # Being after [DONE] is what is wrong with it, whatever else is (an error event, data
    # that is not JSON): its message says so.
    prefix = "event 3" + (f" (id {late.id!r})" if late.id else "") + ": "
    check(
        message.startswith(prefix) and "[DONE]" in message,
        f"chat-errors, finish: {late}, the third event, came after data: [DONE]; its "
        f"ParseError begins {prefix!r} and holds '[DONE]', whatever its type; the message "
        f"was {message!r}",
    )


MALFORMED = [
    pytest.param("not json", id="not-json"),
    pytest.param("[1, 2]", id="not-an-object"),
    pytest.param('{"choices": {}}', id="choices-not-a-list"),
    pytest.param('{"choices": [{"delta": {"content": "x"}}]}', id="no-index"),
    pytest.param('{"choices": [{"index": "0", "delta": {}}]}', id="index-not-int"),
    pytest.param('{"choices": [{"index": true, "delta": {}}]}', id="index-bool"),
    pytest.param(
        '{"choices": [{"index": 0, "delta": {"tool_calls": [{"index": false}]}}]}',
        id="tool-call-index-bool",
    ),
    pytest.param('{"choices": [{"index": 0, "delta": {"content": 5}}]}', id="content-not-str"),
    pytest.param(
        '{"choices": [{"index": 0, "delta": {"content": "ok"}}, {"index": 1, "delta": 3}]}',
        id="second-choice-bad",
    ),
    pytest.param(
        '{"choices": [{"index": 0, "delta": {"tool_calls": [{"function": {}}]}}]}',
        id="tool-call-no-index",
    ),
    pytest.param('{"choices": [], "usage": {"total_tokens": "4"}}', id="usage-not-counts"),
    # Usage is three int counts: one missing, null or not an int is not a count of 0.
    pytest.param('{"choices": [], "usage": {}}', id="usage-empty"),
    pytest.param(
        '{"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}',
        id="usage-count-missing",
    ),
    pytest.param(
        '{"choices": [], "usage": {"prompt_tokens": null, "completion_tokens": 1, '
        '"total_tokens": 4}}',
        id="usage-count-null",
    ),
    pytest.param(
        '{"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1.0, '
        '"total_tokens": 4}}',
        id="usage-count-float",
    ),
    pytest.param('{"choices": [], "usage": [3, 1, 4]}', id="usage-not-an-object"),
    pytest.param(
        '{"choices": [{"index": 0, "delta": {"content": "x"}}], '
        '"usage": {"completion_tokens": 1, "total_tokens": 4}}',
        id="valid-delta-usage-count-missing",
    ),
    # A valid delta, and something wrong elsewhere in the same chunk: nothing is applied.
    pytest.param(
        '{"choices": [{"index": 0, "delta": {"content": "x", "role": "tool"}}], '
        '"usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": "3"}}',
        id="valid-delta-bad-usage",
    ),
    pytest.param(
        '{"id": 5, "choices": [{"index": 0, "delta": {"content": "x"}}]}',
        id="valid-delta-bad-id",
    ),
    pytest.param(
        '{"choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": 1}]}',
        id="valid-delta-bad-finish-reason",
    ),
    # Every string field of a delta, a tool call and the chunk, and every nested shape.
    pytest.param('{"choices": [{"index": 0, "delta": {"role": 1}}]}', id="role-not-str"),
    pytest.param('{"choices": [{"index": 0, "delta": {"refusal": 7}}]}', id="refusal-not-str"),
    pytest.param('{"model": 3, "choices": []}', id="model-not-str"),
    pytest.param('{"choices": [{"index": -1, "delta": {}}]}', id="index-negative"),
    pytest.param(
        '{"choices": [{"index": 0, "delta": {"tool_calls": {"index": 0}}}]}',
        id="tool-calls-not-a-list",
    ),
    pytest.param(
        '{"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": 9}]}}]}',
        id="tool-call-id-not-str",
    ),
    pytest.param(
        '{"choices": [{"index": 0, "delta": {"tool_calls": '
        '[{"index": 0, "function": {"name": ["f"]}}]}}]}',
        id="tool-call-name-not-str",
    ),
    pytest.param(
        '{"choices": [{"index": 0, "delta": {"tool_calls": '
        '[{"index": 0, "function": {"arguments": {"a": 1}}}]}}]}',
        id="tool-call-arguments-not-str",
    ),
    pytest.param(
        '{"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": "f"}]}}]}',
        id="tool-call-function-not-an-object",
    ),
]


@extended
@rule("chat-errors")
@pytest.mark.parametrize("data", MALFORMED)
def test_stage1_a_malformed_chunk_is_refused_naming_it_and_changes_nothing(data: str) -> None:
    assembler = new_assembler()
    assembler.add(chunk(delta(0, content="kept")))
    before = assembler.result()
    with pytest.raises(ParseError, match=r"event 2 \(id '42'\)"):
        assembler.add(E(data=data, id="42"))
    expect(assembler.result(), before, "a refused chunk must change nothing in the result")


@extended
@rule("chat-errors")
@pytest.mark.parametrize("data", MALFORMED[2:])
def test_stage1_a_malformed_first_chunk_leaves_the_result_as_it_was(data: str) -> None:
    # The same shapes, as the stream's first chunk, with an id and a model of their own.
    body = {"id": "chatcmpl-9", "model": "m-9"} | json.loads(data)
    assembler = new_assembler()
    with pytest.raises(ParseError):
        assembler.add(E(data=json.dumps(body)))
    expect(
        assembler.result(),
        new_assembler().result(),
        f"chat-errors: the first chunk, {json.dumps(body)}, is refused; the result must be "
        "a fresh assembler's (its id and model too: nothing of a refused chunk is kept)",
    )


@extended
@rule("chat-errors", "finish")
def test_stage1_an_assembler_error_names_the_event_by_its_place_among_all_events() -> None:
    # n counts every event given to add(), from 1: ignored, refused and folded ones alike.
    steps: list[tuple[ServerSentEvent, str | None, str]] = [
        (E(event="ping", data="{}"), None, ""),
        (chunk(delta(0, content="x")), None, ""),
        (E(data="not json", id="7"), "event 3 (id '7'): ", ""),
        (E(event="error", data='{"error": "overloaded"}'), "event 4: ", "overloaded"),
        (E(data="[DONE]", id="8"), None, ""),
        (E(event="ping", data="{}", id="8"), "event 6 (id '8'): ", "[DONE]"),
    ]
    assembler = new_assembler()
    for n, (event, prefix, inside) in enumerate(steps, start=1):
        if prefix is None:
            assembler.add(event)
            continue
        with pytest.raises(ParseError) as caught:
            assembler.add(event)
            raise AssertionError(f"chat-errors: event {n}, {event}, must raise ParseError")
        message = str(caught.value)
        check(
            message.startswith(prefix) and inside in message,
            f"chat-errors: the error for event {n} ({event}) begins {prefix!r} — n counts "
            f"every event given to add(), of any type, from 1; then the ID if it has one"
            + (f" — and holds {inside!r}" if inside else "")
            + f"; the message was {message!r}",
        )


@extended
@rule("chat-errors")
def test_stage1_an_error_event_raises_and_other_types_are_ignored() -> None:
    assembler = new_assembler()
    assembler.add(E(event="ping", data="{}"))
    assembler.add(E(event="ping", data="[DONE]"))  # not a chunk: not the end either
    check(
        not assembler.result().done,
        "chat-errors: an event of type 'ping' is ignored, even one whose data is [DONE]: "
        "result().done must stay False",
    )
    assembler.add(chunk(delta(0, content="x")))
    with pytest.raises(ParseError, match="overloaded"):
        assembler.add(E(event="error", data='{"error": "overloaded"}'))
    expect(
        assembler.result().choices[0].content,
        "x",
        "the ping event is ignored; the error event changes nothing (content)",
    )


@extended
@rule("recorded")
@pytest.mark.parametrize("how", CHUNKINGS)
@pytest.mark.parametrize("stream", recorded.recorded(), ids=lambda r: r.name.split(".")[0])
def test_stage1_recorded_streams_assemble_to_their_expected_result(
    stream: recorded.Recorded, how: str
) -> None:
    events = parse(CHUNKINGS[how](stream.body))
    expect(recorded.summary(assemble(events)), stream.expected, f"{stream.name} fed {how}")
