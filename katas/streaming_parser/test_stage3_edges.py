"""Stage 3, the edges of its rules (see katas/streaming_parser/README.md, "Stage 3"): which
answer is the stream (a 200, and not another status carrying an event stream), which
limit bounds what, what counts as an attempt that delivered nothing however a response
ends, the backoff at its smallest and at its cap, the ``retry_ms`` in force at each
wait, ``Retry-After`` values that are no seconds, and
``aclose()`` over transports that close late or do not wake a waiting read.

Deterministic as ``test_stage3.py`` is, on the same replicas (real HTTP/1.1 servers on
loopback, each connection's fate written down before the test starts) and the same
jumping clock (every backoff recorded, none waited for); the ``aclose()`` tests build
their client on a transport of :mod:`katas.streaming_parser._testing.transports`: a real
one whose closes take a scheduler pass, or one in memory that holds its answer. Every
test runs on asyncio and trio.

Map (rules in brackets): another status carrying an event stream [fatal, reconnect] ·
each limit at its exact value, extended [fatal] · a response that delivered is no failed
attempt, however it ends, extended [give-up, backoff] · waits of a few milliseconds,
a wait at the cap drawn as one whose d is the cap, ``retry_ms`` the one in force at each
wait, ``Retry-After`` that is not delay-seconds, extended [backoff] · ``aclose()``: the
response closed however the block is left, a waiting read ended that closing would not
end, extended [aclose].
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

import anyio
import httpx
import pytest

from katas._harness.marks import core, extended, processes, rule
from katas._harness.story import check
from katas._harness.waiting import bounded, eventually_async
from katas._registry import impl
from katas._runtime.clock import NS_PER_MS
from katas.streaming_parser._testing.mux import END, settle
from katas.streaming_parser._testing.replica import Block
from katas.streaming_parser._testing.replicas import (
    BLOCKS,
    ENDS,
    IDLE_S,
    ReplicaSet,
    body_offsets,
    events_of,
    module_replicas,
    token_blocks,
)
from katas.streaming_parser._testing.resumable import (
    CLIENT_TIMEOUT,
    Reader,
    expect_exactly_once,
    expect_resumes,
    expect_waits,
    new_source,
    run,
)
from katas.streaming_parser._testing.schedules import at_and_over_a_limit, cuts_at
from katas.streaming_parser._testing.transports import ClosingLate, Holding
from katas.streaming_parser.api import (
    DEFAULT_MAX_EVENT_BYTES,
    DEFAULT_MAX_LINE_BYTES,
    EventSourceError,
    ParseError,
)

pytestmark = [pytest.mark.stage(3), pytest.mark.anyio]

#: The limit the limit tests set (the other one stays at its default, far above).
LIMIT = 64


@pytest.fixture(scope="module")
def replicas(
    impl_selection: impl.Selection, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ReplicaSet]:
    """Three replicas, a, b and c, for every test of the module (each test resets them)."""
    yield from module_replicas(impl_selection, tmp_path_factory)


class LeftTheBlock(Exception):
    """What a caller's code raises inside the source's ``async with``."""


# --- which answer is the stream ----------------------------------------------------------------


@core
@rule("fatal", "reconnect")
@pytest.mark.parametrize("status", [201, 202, 203, 206, 226, 299, 302, 404, 429, 500, 503])
@processes
async def test_stage3_an_event_stream_under_another_status_than_200_is_not_read(
    replicas: ReplicaSet, status: int
) -> None:
    action = f"stream:{status}"
    result = await run(replicas, BLOCKS, [action])
    if status == 429 or status >= 500:
        expect_exactly_once(
            result, BLOCKS, f"the first answer was a {status} carrying the whole event stream"
        )
        expect_resumes(result, BLOCKS, [action])  # its events were not read: asked again
        return
    err = result.outcome
    check(
        isinstance(err, EventSourceError)
        and err.status == status
        and not result.events
        and len(result.requests) == 1,
        f"fatal: the first answer was a {status} with Content-Type text/event-stream and "
        f"the stream as its body: only a 200 is the stream, so EventSourceError(status="
        f"{status}), no event read from it, and no second request; got {err!r}\n"
        f"{result.summary()}",
    )


# --- the limits --------------------------------------------------------------------------------


@extended
@rule("fatal")
@pytest.mark.parametrize("limit", ["max_line_bytes", "max_event_bytes"])
@processes
async def test_stage3_each_limit_bounds_what_it_names_from_one_byte_over_it(
    replicas: ReplicaSet, limit: str
) -> None:
    blocks = at_and_over_a_limit(BLOCKS, limit, LIMIT)
    line = LIMIT if limit == "max_line_bytes" else DEFAULT_MAX_LINE_BYTES
    event = LIMIT if limit == "max_event_bytes" else DEFAULT_MAX_EVENT_BYTES
    result = await run(replicas, blocks, max_line_bytes=line, max_event_bytes=event)
    what = (
        f"event 3 has a data line of exactly {LIMIT} bytes, event 4 a comment line of {LIMIT + 1}"
        if limit == "max_line_bytes"
        else f"event 3 has exactly {LIMIT} bytes of data (its values, one LF each), event 4 "
        f"{LIMIT + 1}, in lines of about 20 bytes"
    )
    check(
        result.events == events_of(blocks[:3]) and isinstance(result.outcome, ParseError),
        f"fatal: {limit}={LIMIT}, the other limit at its default; {what}: event 3 is "
        "within the limit and delivered, event 4 is over it: events 1-3, then the "
        f"ParseError — each limit bounds what it is named for\n{result.summary()}",
    )
    check(len(result.requests) == 1, f"fatal: a ParseError is not retried\n{result.summary()}")


# --- counting the attempts that delivered nothing -----------------------------------------------


@extended
@rule("give-up", "backoff")
@pytest.mark.parametrize("how", ["end", "cut", "stall"])
@processes
async def test_stage3_a_response_that_delivered_is_no_failed_attempt_however_it_ends(
    replicas: ReplicaSet, how: str
) -> None:
    # stall: the replica holds after event 1 and the idle timeout drops the connection
    first = f"hold:{ENDS[0]}" if how == "stall" else f"{how}:{ENDS[0]}"
    actions = [first, "status:503", "status:503", "status:503"]
    result = await run(
        replicas, BLOCKS, actions, max_attempts=3, retry_ms=100, idle_timeout_s=IDLE_S
    )
    err = result.outcome
    ended = {"end": "ended cleanly", "cut": "was reset", "stall": "went silent past the timeout"}
    check(
        result.events == events_of(BLOCKS[:1])
        and isinstance(err, EventSourceError)
        and err.status == 503
        and len(result.requests) == 4,
        f"give-up: the 1st response delivered event 1, then {ended[how]}: an attempt that "
        "delivered an event starts the count again, however its response ends — so with "
        "max_attempts=3 the three 503s after it are three attempts in a row without an "
        "event: EventSourceError(status=503) after the 4th request, not before\n"
        f"{result.summary()}",
    )
    expect_waits(
        result,
        [100, 100, 200],
        f"retry_ms=100; the response that delivered event 1 {ended[how]}: k is at least 1 "
        "after it (d = 100), then counts the 503s only: d = 100 after the first, 200 after "
        "the second",
    )


# --- the backoff at its edges --------------------------------------------------------------------


@extended
@rule("backoff")
@processes
async def test_stage3_a_wait_of_a_few_milliseconds_is_drawn_to_the_nanosecond(
    replicas: ReplicaSet,
) -> None:
    actions = ["status:503"] * 4
    result = await run(replicas, BLOCKS, actions, retry_ms=1, max_backoff_ms=5)
    expect_exactly_once(result, BLOCKS, "four 503s, then the stream")
    expect_waits(
        result,
        [1, 2, 4, 5, 1],
        "retry_ms=1, max_backoff_ms=5: d = 1, 2, 4, then the cap 5, and 1 after the stream; "
        "each wait is drawn from [d/2, d] in nanoseconds — a draw rounded to whole "
        "milliseconds falls below d/2 (0 ms for d = 1)",
    )


@extended
@rule("backoff")
@processes
async def test_stage3_a_wait_at_the_cap_is_drawn_as_one_whose_d_is_the_cap(
    replicas: ReplicaSet,
) -> None:
    blocks, told = token_blocks(5), token_blocks(5, retry_ms=5000)

    def one_by_one(served: list[Block]) -> list[str]:  # each response ends after an event
        return cuts_at(served, body_offsets(served)[:-1], kind="end")

    # Every wait of every run has d = 1000 ms: by the retry itself, or by the cap.
    ways = {
        "retry_ms=1000, max_backoff_ms=30000, a response an event": (
            blocks,
            one_by_one(blocks),
            1000,
            30_000,
        ),
        "retry_ms=1001, one over max_backoff_ms=1000, a response an event": (
            blocks,
            one_by_one(blocks),
            1001,
            1000,
        ),
        "the server's `retry: 5000`, over max_backoff_ms=1000, a response an event": (
            told,
            one_by_one(told),
            1000,
            1000,
        ),
        "retry_ms=1000 doubled past max_backoff_ms=1000 by four 503s, then the stream": (
            blocks,
            ["status:503"] * 4,
            1000,
            1000,
        ),
    }
    results = {}
    for way, (served, actions, retry, cap) in ways.items():
        result = await run(
            replicas, served, actions, random=random.Random(7), retry_ms=retry, max_backoff_ms=cap
        )
        expect_exactly_once(result, served, way)
        expect_waits(result, [1000] * 5, f"{way}: d = min(max_backoff_ms, retry × 2^(k−1)) = 1000")
        results[way] = result.sleeps_ns
    first, *others = ways
    for way in others:
        check(
            results[way] == results[first],
            "backoff: d = min(max_backoff_ms, retry × 2^(k−1)) is 1000 ms at each of five waits "
            "of both runs, and the wait is drawn from [d/2, d] for that d with the injected "
            "random (seed 7 in both): a d the cap brought down to 1000 is drawn as one that "
            "is 1000 by itself, never from the range of the d before the cap and then cut "
            "to the cap.\n"
            f"  {first}: {[ns / NS_PER_MS for ns in results[first]]} ms\n"
            f"  {way}: {[ns / NS_PER_MS for ns in results[way]]} ms",
        )


@extended
@rule("backoff")
@processes
async def test_stage3_retry_ms_is_the_one_in_force_at_each_wait(replicas: ReplicaSet) -> None:
    blocks = [
        Block(b"id: 1\ndata: a\n\n", "1"),
        Block(b"id: 2\nretry: 250\ndata: b\n\n", "2"),
        Block(b"id: 3\nretry: 1.5\ndata: c\n\n", "3"),  # not a valid retry: ignored
        Block(b"id: 4\nretry: 40\ndata: d\n\n", "4"),
    ]
    ends = body_offsets(blocks)
    # 1st response: event 1, then a clean end. 2nd: reset after event 2's retry: line,
    # before its data. 3rd: events 2 and 3, then a clean end. 4th: event 4 and the end.
    actions = [f"end:{ends[0]}", f"cut:{blocks[1].raw.index(b'data')}", f"end:{ends[2] - ends[0]}"]
    result = await run(replicas, blocks, actions, watch_retry=True)
    expect_exactly_once(result, blocks, f"the connections got {actions}")
    expect_waits(result, [1000, 250, 250, 40], "retry 1000 (retry_ms), then 250, 250, then 40")
    check(
        result.retries_ms == [1000, 250, 250, 40, 40],
        "backoff: the source's retry_ms is the one in force — the server's last valid "
        "retry:, the constructor's 1000 until one arrives, from its line on. At the four "
        "waits and after the end it must read 1000 (no retry: yet), 250 (event 2's line, "
        "its event cut), 250 (`retry: 1.5` is not valid), 40 (event 4's), 40; got "
        f"{result.retries_ms}\n{result.summary()}",
    )


#: Retry-After values that are not delay-seconds (ASCII digits only): no floor at all.
NOT_SECONDS = ["+5", "1_0", "5.5", "1e1", "-5", "\u0665", "0x10", "Wed, 21 Oct 2015 07:28:00 GMT"]


@extended
@rule("backoff")
@processes
async def test_stage3_a_retry_after_that_is_not_delay_seconds_sets_no_floor(
    replicas: ReplicaSet,
) -> None:
    actions = [f"status:{(503, 429)[n % 2]}:{value}" for n, value in enumerate(NOT_SECONDS)]
    result = await run(replicas, BLOCKS, actions, retry_ms=100, max_backoff_ms=100)
    expect_exactly_once(result, BLOCKS, f"the connections got {actions}")
    expect_waits(
        result,
        [100] * (len(actions) + 1),
        f"each 503 or 429 sent a Retry-After that is not a number of seconds "
        f"({', '.join(repr(v) for v in NOT_SECONDS)}): only ASCII digits are seconds, "
        "anything else (a sign, a fraction, an exponent, an underscore, a digit of another "
        "script, an HTTP date) sets no floor, and each wait is the backoff, d = 100 ms",
    )


# --- aclose ------------------------------------------------------------------------------------


@extended
@rule("aclose")
@pytest.mark.parametrize("how", ["by-an-exception", "by-cancellation", "aclose-when-cancelled"])
@processes
async def test_stage3_the_response_is_closed_however_the_source_is_left(
    replicas: ReplicaSet, how: str
) -> None:
    replicas.reset(BLOCKS, [f"hold:{ENDS[0] + 3}"])
    transport = ClosingLate(httpx.AsyncHTTPTransport())
    async with httpx.AsyncClient(transport=transport, timeout=CLIENT_TIMEOUT) as client:
        source = new_source(client, replicas.urls)
        with (
            bounded(f"leaving the source's block {how}"),
            anyio.CancelScope() as scope,
            contextlib.suppress(LeftTheBlock),
        ):
            async with source:
                first = await source.__anext__()
                await eventually_async(lambda: replicas.held() == ["a"], "replica a to hold")
                if how == "by-an-exception":  # the caller's code fails inside the block
                    raise LeftTheBlock
                scope.cancel()
                if how == "by-cancellation":  # cancelled while waiting for event 2's bytes
                    await source.__anext__()
                await source.aclose()  # aclose-when-cancelled: in a cancelled scope
        opened, closed = transport.opened, transport.closed
    assert first == events_of(BLOCKS)[0]
    check(
        (opened, closed) == (1, 1),
        f"aclose: the source's block was left {how.replace('-', ' ')}, its response open "
        "(replica a holding it inside event 2): leaving the block, or aclose(), closes "
        "that response even in a cancelled scope (shielded: closing it may take a "
        f"scheduler pass, as on this client's transport); {opened} response(s) opened, "
        f"{closed} closed",
    )


@extended
@rule("aclose")
@pytest.mark.parametrize("waiting", ["for-the-head", "for-a-byte"])
async def test_stage3_aclose_ends_a_wait_that_closing_the_response_would_not(
    waiting: str,
) -> None:
    body = BLOCKS[0].raw + BLOCKS[1].raw[:3]  # event 1, then 3 bytes of event 2
    transport = Holding(body, head=waiting == "for-a-byte")
    async with httpx.AsyncClient(transport=transport, timeout=CLIENT_TIMEOUT) as client:
        source = new_source(client, ["http://replica.test/stream"])
        reader = Reader(source)
        async with anyio.create_task_group() as tg:
            tg.start_soon(reader.run)
            await eventually_async(lambda: transport.requests == 1, "the first request")
            if waiting == "for-a-byte":
                await reader.delivered(1)
            await settle()  # the reader waits, in the transport
            with bounded("aclose() to return"):
                await source.aclose()
            await settle()
            outcome = reader.outcome
            tg.cancel_scope.cancel()  # a reader still waiting: the test has its answer
    want = events_of(BLOCKS[:1]) if waiting == "for-a-byte" else []
    check(
        (reader.events, outcome) == (want, END),
        f"aclose: aclose() while __anext__ waited {waiting.replace('-', ' ')}, on a "
        "transport where closing the response does not wake a read (as on an HTTP/2 "
        "connection shared with other streams): the waiting __anext__ must end with "
        f"StopAsyncIteration at once, by aclose() itself; got {reader.events} then "
        f"{outcome if outcome is not None else 'still waiting'}",
    )
    check(
        transport.requests == 1 and transport.closed == int(waiting == "for-a-byte"),
        f"aclose: one request, its response closed by aclose(), and none after it; "
        f"{transport.requests} request(s), {transport.closed} response(s) closed",
    )
