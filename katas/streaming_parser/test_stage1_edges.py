"""Stage 1, the edges of its rules (see katas/streaming_parser/README.md, "Stage 1"): what a
feed refused for the line it leaves unfinished still owes its caller, and the chunks a
server streaming with ``include_usage`` sends, whose ``usage`` is null until the last.

Plain examples, as in ``test_stage1.py``: the parser is fed chunks, the assembler events;
no clock, no threads. The expected events come from the oracle
(:func:`~katas.streaming_parser._testing.sse.interpret`) of the bytes before the refusal.

Map (rules in brackets): a refusal at a feed's last, unfinished line, extended [limits, id,
retry] · a null usage in any chunk, extended [finish].
"""

from __future__ import annotations

import pytest

from katas._harness.marks import extended, rule
from katas._harness.story import expect, not_refused
from katas.streaming_parser._testing import sse
from katas.streaming_parser._testing.chat import NULL, chunk, delta, new_assembler
from katas.streaming_parser._testing.parsers import accepted, refusal
from katas.streaming_parser.api import ParseError, ServerSentEvent, Usage

pytestmark = [pytest.mark.stage(1)]

E = ServerSentEvent

# --- a refusal at a feed's unfinished line ---------------------------------------------------

#: Two events, the second with an id and a retry, each line ended by LF; then a line of
#: 11 bytes, one past max_line_bytes=10, that the feed leaves without its line end.
BEFORE = b"data: 0\n\nid: 5\nretry: 70\ndata: 1\n\n"
OVER, AT = b"data: 12345", b"data: 1234"
CRLF = BEFORE.replace(b"\n", b"\r\n")


@extended
@rule("limits", "id", "retry")
@pytest.mark.parametrize(
    "chunks",
    [
        pytest.param([BEFORE], id="one-feed-lf"),
        pytest.param([BEFORE.replace(b"\n", b"\r")], id="one-feed-cr"),
        pytest.param([CRLF], id="one-feed-crlf"),
        pytest.param([BEFORE[:20], BEFORE[20:]], id="a-pending-line-ended-first"),
        pytest.param([BEFORE[:-1], BEFORE[-1:]], id="only-the-blank-line-first"),
        pytest.param([CRLF[:-2], CRLF[-2:]], id="crlf-blank-line-first"),
    ],
)
def test_stage1_a_feed_refused_at_its_unfinished_line_keeps_what_its_lines_did(
    chunks: list[bytes],
) -> None:
    """The last chunk ends its lines, then starts one past the limit: the lines before it
    were complete, so they count as they would without it — their events handed on in
    the error, the last event id and the retry they set kept."""
    body = b"".join(chunks)
    whole, earlier = sse.interpret(body), sse.interpret(b"".join(chunks[:-1]))
    owed = tuple(whole.events[len(earlier.events) :])
    within = accepted([*chunks[:-1], chunks[-1] + AT], max_line_bytes=10)
    expect(within, whole.events, f"limits: {chunks!r}, then {AT!r} (10 bytes) is within the limit")
    exc, parser = refusal([*chunks[:-1], chunks[-1] + OVER], max_line_bytes=10)
    expect(
        (exc.events, exc.offset, parser.last_event_id, parser.retry_ms),
        (owed, len(body) + 10, whole.last_event_id, whole.retry_ms),
        f"limits: feeding {chunks!r} with {OVER!r} (11 bytes, max_line_bytes=10) at the end of "
        "the last chunk: that feed's complete lines came first, so its ParseError holds the "
        "events they completed and its offset is the first byte past the limit; the "
        "last_event_id and retry_ms they set stay (events, offset, last_event_id, retry_ms)",
    )


# --- a null usage --------------------------------------------------------------------------

#: What the result holds after a chunk: choice 0's (content, finish_reason) once it has
#: begun, and the usage.
Fold = tuple[list[tuple[str, str | None]], Usage | None]


@extended
@rule("finish")
def test_stage1_a_null_usage_in_any_chunk_changes_nothing() -> None:
    """With ``include_usage`` on, a server sends ``"usage": null`` on every chunk but the
    usage-only one: before it, in a chunk of deltas or of none, and after it."""
    usage = Usage(prompt_tokens=3, completion_tokens=1, total_tokens=4)
    counts = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
    steps: list[tuple[ServerSentEvent, Fold]] = [
        (chunk(usage=NULL), ([], None)),
        (chunk(delta(0, role="assistant", content=""), usage=NULL), ([("", None)], None)),
        (chunk(delta(0, content="Hi", finish="stop"), usage=NULL), ([("Hi", "stop")], None)),
        (chunk(usage=counts), ([("Hi", "stop")], usage)),
        (chunk(usage=NULL), ([("Hi", "stop")], usage)),
        (chunk(delta(0), usage=NULL), ([("Hi", "stop")], usage)),
    ]
    assembler = new_assembler()
    for n, (event, want) in enumerate(steps, start=1):
        with not_refused(
            f"finish: chunk {n}, {event.data}: a null usage changes nothing, and is no "
            "malformed chunk",
            ParseError,
        ):
            assembler.add(event)
        result = assembler.result()
        expect(
            ([(c.content, c.finish_reason) for c in result.choices], result.usage),
            want,
            f"finish: after chunk {n}, {event.data}: a null usage sets nothing and erases "
            "nothing; the usage-only chunk alone sets it (choice 0's (content, finish_reason), "
            "usage)",
        )
