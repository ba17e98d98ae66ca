"""Stage 2, the edges of its rules (see katas/streaming_parser/README.md, "Stage 2"): what a
source may do at its edges (an empty chunk, an ``aclose()`` that raises, a stream ended
before its reading began, a pull that never awaits), where the idle timer starts and what
restarts it, and the two fields a gateway reads while events wait for their consumer
(``buffered``, ``last_event_id``).

Deterministic as ``test_stage2.py`` is: sources the test controls, a ``ManualClock`` that
moves only when a test says so, waits for observable states under hard deadlines. Every
test runs on asyncio and on trio.

Map (rules in brackets): a source's edges [in-order, isolation, close-source, cancel-one]
· backpressure's default [backpressure] · the fields [isolation, in-order] · the idle
timer's start and restarts, extended [idle-timeout].
"""

from __future__ import annotations

import anyio
import pytest

from katas._harness.marks import core, extended, rule
from katas._harness.story import check
from katas._harness.waiting import bounded
from katas._runtime.clock import ManualClock
from katas.streaming_parser._testing.mux import END, ChannelSource, Consumer, settle, sse_events
from katas.streaming_parser._testing.streams import (
    IDLE,
    SMALL_LINES,
    TOO_LONG,
    drain,
    expect_end,
    new_mux,
    next_pull,
    nothing_escapes,
    outcome_of,
    quiet_stream_in_a_new_mux,
    reads,
    still_open,
    take,
    timed_out,
    until,
)
from katas.streaming_parser.api import ParseError, ServerSentEvent, StreamTimeout

pytestmark = [pytest.mark.stage(2), pytest.mark.anyio]

E = ServerSentEvent


class FailingClose(ChannelSource):
    """A source whose ``aclose()`` raises once it has closed (a connection reset while
    closing): closed all the same."""

    async def aclose(self) -> None:
        await self._close()
        raise ConnectionResetError("connection reset while closing")


# --- a source's edges -------------------------------------------------------------------


@core
@rule("in-order")
async def test_stage2_an_empty_chunk_is_a_chunk_not_the_end() -> None:
    """A source may yield ``b""`` (a flush with nothing in it): the stream reads on; only
    the source's own end ends it."""
    source = ChannelSource("flushes", [b"data: a\n\n", b"", b"", b"data: b\n\n"])
    source.end()
    with bounded("a stream with empty chunks read to its end"):
        async with new_mux() as mux:
            events, how = await drain(mux.open(source.name, source), "empty chunks")
    check(
        (events, how) == ([E(data="a"), E(data="b")], END),
        f"in-order: chunks b'data: a\\n\\n', b'', b'', b'data: b\\n\\n', then the end: an "
        f"empty chunk carries nothing and ends nothing; got {events} then {how!r}",
    )


@core
@rule("close-source", "isolation")
async def test_stage2_a_source_whose_aclose_raises_ends_only_its_own_stream() -> None:
    bad, good = FailingClose("bad close"), ChannelSource("good")
    with bounded("two streams, one whose aclose() raises"), nothing_escapes("aclose() raised"):
        async with new_mux() as mux, anyio.create_task_group() as tg:
            consumers = [Consumer(mux.open(s.name, s)) for s in (bad, good)]
            for consumer in consumers:
                tg.start_soon(consumer.run)
            bad.push(b"data: a\n\n")
            bad.end()
            await until(lambda: consumers[0].done, "the stream whose aclose() raises ends")
            good.push(b"data: b\n\n")
            await until(lambda: consumers[1].events == [E(data="b")], "the other stream reads on")
            good.end()
    got = [(c.events, outcome_of(c)) for c in consumers]
    check(
        got == [([E(data="a")], END), ([E(data="b")], END)] and bad.aclose_calls == 1,
        "close-source: a source ended and its aclose() raised (a reset while closing): it "
        "is closed all the same, its consumer ends as its source did (StopAsyncIteration) "
        f"and the other stream goes on; got {got}, {bad.describe()}",
    )


@core
@rule("close-source", "cancel-one", "shutdown")
@pytest.mark.parametrize("how", ["cancel()", "the block's end"])
async def test_stage2_a_stream_ended_before_its_reading_began_still_closes_its_source(
    how: str,
) -> None:
    """``open()`` then at once — before the mux's task for it has run — ``cancel()``, or
    the end of the ``async with`` block: the source is still closed, exactly once."""
    source = ChannelSource("never read")
    with bounded(f"a stream ended by {how} before it was read"):
        async with new_mux() as mux:
            stream = mux.open(source.name, source)
            if how == "cancel()":
                stream.cancel()
                await settle()
                await expect_end(stream, "cancel-one: cancelled before its first pull")
    check(
        source.closed_once(),
        f"close-source: whatever ends a stream — here {how}, right after open(), before "
        f"anything was read — the mux calls its source's aclose() exactly once: "
        f"{source.describe()}",
    )


@core
@rule("cancel-one")
@pytest.mark.parametrize(
    "when", ["before its task ran", "between two pulls", "during a pull", "as its pull wakes"]
)
async def test_stage2_nothing_reaches_the_consumer_after_cancel_even_from_a_pull_that_never_awaits(
    when: str,
) -> None:
    """A pull that returns without awaiting (its chunks already there) passes no
    checkpoint, so a cancellation cannot stop it: whenever ``cancel()`` comes — right
    after ``open()``, while the mux's task is woken for its next pull, from inside a
    pull, or as a waiting pull wakes with two chunks — no event read after it reaches the
    consumer, whose next ``__anext__`` and every later one raise StopAsyncIteration."""
    chunks = [sse_events(str(n)) for n in range(1, 9)]
    source = ChannelSource("never awaits", [] if when == "as its pull wakes" else chunks)
    with bounded(f"a stream cancelled {when}"):
        async with new_mux(max_buffered=1) as mux, anyio.create_task_group() as tg:
            stream = mux.open(source.name, source)
            got: list[str] = []
            if when == "before its task ran":
                stream.cancel()
            elif when == "between two pulls":
                await settle()  # event 1 buffered: full, the mux waits for room
                await take(stream, "event 1")  # room: the mux's task is woken...
                stream.cancel()  # ...and cancelled before it ran
            elif when == "during a pull":
                source.on_pull = lambda _: stream.cancel()  # from inside the mux's first pull
                await settle()
            else:
                consumer = Consumer(stream)
                tg.start_soon(consumer.run)
                await until(lambda: consumer.waiting and source.waiting, "both waiting")
                await settle()
                source.push(*chunks[:2])  # the waiting pull is woken...
                stream.cancel()  # ...and cancelled before it ran
                await until(lambda: consumer.done, "the consumer's iteration to end")
                got = [f"event {e.data!r}" for e in consumer.events] + [outcome_of(consumer)]
            got += await reads(stream, 4 - len(got), f"after cancel() {when}")
    check(
        got == [END] * 4,
        f"cancel-one: cancel() {when} ends the consumer's iteration for good — its next "
        "__anext__ and every later one raise StopAsyncIteration, and nothing read after "
        "cancel() reaches it, even from a source whose pull returns without awaiting (a "
        "cancellation only arrives at a checkpoint, and such a pull passes none); what the "
        f"consumer got after cancel(), reading now and again once the loop settled: {got} "
        f"({source.describe()})",
    )


# --- backpressure's default ---------------------------------------------------------------


@core
@rule("backpressure")
async def test_stage2_max_buffered_defaults_to_64() -> None:
    source = ChannelSource("fast", [f"data: {i}\n\n".encode() for i in range(100)])
    with bounded("a mux with the default max_buffered, its consumer taking nothing"):
        async with new_mux() as mux:
            stream = mux.open(source.name, source)
            await until(lambda: stream.buffered >= 64, "64 events buffered")
            await settle()
            got = (stream.buffered, source.pulls)
            stream.cancel()
    check(
        got == (64, 64),
        "backpressure: StreamMux() without max_buffered holds 64 events, and pulls nothing "
        f"more until one is taken: (buffered, chunks pulled) = {got}",
    )


# --- the fields ----------------------------------------------------------------------------


@core
@rule("isolation")
async def test_stage2_buffered_counts_the_events_a_parse_error_came_with() -> None:
    """A chunk completes two events, then breaks the line limit: the two wait for the
    consumer before the error, and ``buffered`` counts them down as they are taken."""
    source = ChannelSource("breaks", [b"data: a\n\ndata: b\n\n" + TOO_LONG])
    with bounded("a ParseError's events taken one by one"):
        async with new_mux(max_line_bytes=SMALL_LINES) as mux:
            stream = mux.open(source.name, source)
            await until(lambda: source.aclose_calls > 0, "the stream ends on its ParseError")
            await settle()
            counts = [stream.buffered]
            taken = [await take(stream, "a"), await take(stream, "b")]
            counts.append(stream.buffered)
            with pytest.raises(ParseError):
                await stream.__anext__()
            counts.append(stream.buffered)
    check(
        (taken, counts) == ([E(data="a"), E(data="b")], [2, 0, 0]),
        "isolation: a chunk completing a and b, then a line past max_line_bytes: a and b "
        "wait before the ParseError, and buffered counts them (2, then 0 once taken, and "
        f"0 after the error); got events {taken} and buffered {counts}",
    )


@core
@rule("in-order")
async def test_stage2_last_event_id_is_the_parsers_while_events_wait() -> None:
    """``last_event_id`` is the parser's — what a reconnect sends — not the id of the last
    event queued or taken: an id-only block moves it, and events still waiting do not
    hold it back."""
    source = ChannelSource("ids", [b"id: 1\ndata: a\n\nid: 2\ndata: b\n\nid: 7\n\n"])
    with bounded("events waiting, then taken"):
        async with new_mux() as mux:
            stream = mux.open(source.name, source)
            await until(lambda: stream.buffered == 2, "a and b buffered")
            await next_pull(source, "after the chunk")
            waiting = stream.last_event_id
            await take(stream, "a")
            await take(stream, "b")
            taken = stream.last_event_id
            stream.cancel()
    check(
        (waiting, taken) == ("7", "7"),
        "in-order: 'id: 1 a, id: 2 b, then a block with only id: 7': last_event_id is the "
        "parser's, '7' (stage 1: it moves at every blank line, event or not), while a and "
        f"b wait and after they are taken; got {waiting!r} while waiting, {taken!r} after",
    )


# --- the idle timer, extended --------------------------------------------------------------


@extended
@rule("idle-timeout")
async def test_stage2_the_idle_timer_starts_at_the_first_pull() -> None:
    clock, source = ManualClock(), ChannelSource("late start")
    with bounded("a stream whose first pull comes late"):
        async with new_mux(clock=clock, idle_timeout_ns=IDLE) as mux:
            stream = mux.open(source.name, source)
            clock.advance(IDLE - 1)  # before the mux's task for it has run: no pull yet
            await next_pull(source, "the first pull, IDLE - 1 ns after open()")
            clock.advance(IDLE - 1)
            await settle()
            check(
                source.aclose_calls == 0,
                "idle-timeout: the timer starts with the first pull, IDLE - 1 ns after "
                f"open(); IDLE - 1 ns after that pull the stream ended: {source.describe()}",
            )
            clock.advance(1)
            _, how = await drain(stream, "IDLE after the first pull")
    check(
        isinstance(how, StreamTimeout),
        f"idle-timeout: IDLE after the first pull the stream times out; got {how!r}",
    )


@extended
@rule("idle-timeout")
async def test_stage2_an_empty_chunk_restarts_the_idle_timer() -> None:
    async with quiet_stream_in_a_new_mux(
        "keep-alive", "empty chunks as keep-alives", idle_timeout_ns=IDLE
    ) as (clock, source, stream, consumer):
        for _ in range(3):
            clock.advance(IDLE - 1)
            source.push(b"")  # an empty chunk is a chunk: the source is not idle
            await next_pull(source, "after an empty chunk IDLE - 1 ns after the last one")
        await still_open(consumer, source, "3 empty chunks later, IDLE - 1 ns apart")
        clock.advance(IDLE)
        await timed_out(consumer, source, stream, "IDLE after the last empty chunk")


@extended
@rule("idle-timeout")
async def test_stage2_taking_from_a_buffer_with_room_does_not_restart_the_timer() -> None:
    """Only a take from a *full* buffer restarts the timer: with room, the source could
    have been pulled all along, so its silence is idleness."""
    clock, source = ManualClock(), ChannelSource("goes quiet")
    with bounded("a quiet source whose consumer takes from a buffer with room"):
        async with new_mux(clock=clock, idle_timeout_ns=IDLE, max_buffered=4) as mux:
            stream = mux.open(source.name, source)
            source.push(b"data: a\n\ndata: b\n\n")
            await until(lambda: stream.buffered == 2, "a and b buffered")
            await next_pull(source, "after the chunk (2 of 4 buffered: room)")
            clock.advance(IDLE - 1)
            await take(stream, "a")
            await settle()
            clock.advance(1)
            events, how = await drain(stream, "IDLE after the last chunk")
    check(
        (events, isinstance(how, StreamTimeout)) == ([E(data="b")], True),
        "idle-timeout: the last chunk came at 0 and the consumer took a at IDLE - 1 from a "
        "buffer with room (2 of max_buffered=4): that restarts nothing, so at IDLE the "
        f"stream times out after b; got {events} then {how!r}",
    )


@extended
@rule("idle-timeout", "backpressure")
async def test_stage2_a_deadline_dropped_while_its_watchdog_slept_is_no_timeout() -> None:
    """The timer runs while the mux waits for a chunk; the chunk fills the buffer, so the
    mux stops pulling and the deadline no longer applies. When the instant it named comes,
    nothing times out: time waiting for the consumer is not idleness."""
    clock, source = ManualClock(), ChannelSource("fills the buffer")
    with bounded("a full buffer past the first deadline"):
        async with new_mux(clock=clock, idle_timeout_ns=IDLE, max_buffered=1) as mux:
            stream = mux.open(source.name, source)
            await next_pull(source, "the first pull: the timer runs")
            source.push(b"data: a\n\ndata: b\n\n")
            await until(lambda: stream.buffered == 2, "a and b buffered: full")
            await settle()
            clock.advance(IDLE)  # the first pull's deadline
            await settle()
            check(
                source.aclose_calls == 0,
                "idle-timeout: the buffer filled before the first pull's deadline, so the "
                "mux stopped pulling; at that deadline the source is not idle (the mux "
                f"waits for the consumer), yet the stream ended: {source.describe()}",
            )
            taken = [await take(stream, "a"), await take(stream, "b")]
            source.end()
            await expect_end(stream, "the source's end, after a and b")
    check(taken == [E(data="a"), E(data="b")], f"a then b, got {taken}")
