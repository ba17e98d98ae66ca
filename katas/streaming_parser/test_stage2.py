"""Stage 2: many streams on one anyio loop — order, isolation, backpressure, idle timeouts,
cancellation and shutdown (see katas/streaming_parser/README.md, "Stage 2").

How these tests stay deterministic: every upstream is a source the test controls
(:mod:`katas.streaming_parser._testing.mux`) that records each pull and each
``aclose()``; time is a ``ManualClock`` that moves only when the test advances it; the
test waits for observable states (a pull waiting, an event delivered) or lets the loop
settle (every task waiting) instead of sleeping, and every wait has a hard real-time
deadline that fails with what was awaited. Every test runs on asyncio and on trio.

Map (rules in brackets): in order, exactly once [in-order] · one stream's trouble is its
own [isolation] · backpressure [backpressure] · ``cancel()`` [cancel-one] · every source
closed [close-source] · leaving the block [shutdown] · idle timeouts, extended
[idle-timeout] · a cancelled consumer, extended [waiter-cancelled] · bad arguments,
extended [stage2-bad-arguments].

The drivers — a mux on a test clock, taking and ending under deadlines, the idle-timeout
probes — are in :mod:`katas.streaming_parser._testing.streams`.
"""

from __future__ import annotations

from collections.abc import Sequence

import anyio
import anyio.abc
import pytest
from hypothesis import given

from katas._harness.marks import core, extended, rule
from katas._harness.story import check, not_refused
from katas._harness.under_test import stage
from katas._harness.waiting import bounded
from katas._runtime.clock import NS_PER_S, ManualClock
from katas._runtime.todo import Todo
from katas.streaming_parser._testing import sse
from katas.streaming_parser._testing.mux import (
    END,
    ChannelSource,
    Consumer,
    IterableOnly,
    ListSource,
    NoCloseSource,
    settle,
    sse_events,
)
from katas.streaming_parser._testing.streams import (
    IDLE,
    SMALL_LINES,
    TOO_LONG,
    Scenario,
    contains,
    drain,
    expect_end,
    new_mux,
    next_pull,
    nothing_escapes,
    outcome_of,
    quiet_stream_in_a_new_mux,
    scenarios,
    still_open,
    streams_of_bodies,
    take,
    timed_out,
    until,
)
from katas.streaming_parser.api import MuxedStream, ParseError, ServerSentEvent, StreamTimeout

pytestmark = [pytest.mark.stage(2), pytest.mark.anyio]

E = ServerSentEvent


# --- in order, exactly once -----------------------------------------------------------------


@core
@rule("in-order")
async def test_stage2_each_stream_delivers_its_events_in_order_exactly_once_then_ends() -> None:
    cases = streams_of_bodies()
    with bounded("three streams read to their end"):
        async with new_mux(max_buffered=2) as mux, anyio.create_task_group() as tg:
            opened = []
            for name, body, chunks in cases:
                stream = mux.open(name, ListSource(chunks, name=name))
                consumer = Consumer(stream)
                tg.start_soon(consumer.run)
                opened.append((name, body, chunks, stream, consumer))
    for name, body, chunks, stream, consumer in opened:
        want = sse.interpret(body)
        check(
            consumer.events == want.events and consumer.outcome == END,
            f"in-order: stream {name!r} fed {chunks!r} (an unterminated tail, if any, is "
            f"discarded)\n  expected events {want.events} then {END}\n"
            f"  got             {consumer.events} then {outcome_of(consumer)}",
        )
        check(stream.name == name, f"EventStream.name must be {name!r}, got {stream.name!r}")
        check(
            stream.last_event_id == want.last_event_id,
            f"stream {name!r}: last_event_id after reading it all must be "
            f"{want.last_event_id!r} (stage 1's parser), got {stream.last_event_id!r}",
        )


@core
@rule("in-order")
async def test_stage2_the_unterminated_tail_of_an_ended_source_is_discarded() -> None:
    source = ChannelSource("tail")
    async with new_mux() as mux:
        stream = mux.open("tail", source)
        source.push(b"data: a\n\ndata: b\n", b"data: c")  # b's blank line never comes
        source.end()
        got = await take(stream, "the complete event")
        check(got == E(data="a"), f"in-order: the first event must be data 'a', got {got}")
        await expect_end(
            stream,
            "in-order: the source ended inside the event 'b\\nc' (no blank line): stage 1's "
            "close() discards it, and the iteration ends",
        )
        await expect_end(stream, "in-order: after the end, __anext__ keeps ending (not again)")


@core
@rule("in-order", "backpressure")
@given(case=scenarios())
async def test_stage2_random_chunkings_and_interleavings_deliver_every_stream_in_order(
    case: Scenario,
) -> None:
    bodies, chunkings, max_buffered, order = case
    count = len(bodies)
    # Whatever the reading: at most max_buffered events, plus those of one chunk.
    bound = max_buffered + max(c.count(b"\n") + c.count(b"\r") for cs in chunkings for c in cs)
    got: list[list[ServerSentEvent]] = [[] for _ in range(count)]
    ended = [False] * count
    with bounded(f"{count} streams read to their end, taken in the order {order}"):
        async with new_mux(max_buffered=max_buffered) as mux:
            streams = [
                mux.open(f"s{i}", ListSource(chunks, name=f"s{i}"))
                for i, chunks in enumerate(chunkings)
            ]
            drain = [j for j in range(count) for _ in range(len(bodies[j]) + 2)]
            for i in order + drain:
                if ended[i]:
                    continue
                try:
                    got[i].append(await streams[i].__anext__())
                except StopAsyncIteration:
                    ended[i] = True
                for s in streams:
                    check(
                        s.buffered <= bound,
                        f"backpressure: stream {s.name!r} holds {s.buffered} events; "
                        f"max_buffered={max_buffered} (and one chunk) allow at most {bound}",
                    )
    for i in range(count):
        want = sse.interpret(bodies[i]).events
        check(
            ended[i] and got[i] == want,
            f"in-order: stream s{i} fed {chunkings[i]!r} (max_buffered={max_buffered}, "
            f"takes in the order {order})\n  expected {want} then the end\n"
            f"  got      {got[i]}{' then the end' if ended[i] else ' and no end'}",
        )


# --- isolation ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "trouble",
    [
        pytest.param("raises", marks=[core, rule("isolation")]),
        pytest.param("raises-anything", marks=[extended, rule("isolation")]),
        pytest.param("parse-error", marks=[core, rule("isolation")]),
        pytest.param("cancel", marks=[core, rule("isolation", "cancel-one")]),
        pytest.param("timeout", marks=[extended, rule("isolation", "idle-timeout")]),
    ],
)
async def test_stage2_one_streams_trouble_ends_that_stream_only(trouble: str) -> None:
    clock = ManualClock()
    idle = IDLE if trouble == "timeout" else None
    names = ("healthy-1", "troubled", "healthy-2")
    sources = {name: ChannelSource(name) for name in names}
    boom: Exception = ConnectionResetError("upstream reset")
    if trouble == "raises-anything":  # not an I/O error: a source's bug is its own too
        boom = LookupError("no such shard in the upstream's routing table")
    with (
        bounded(f"three streams, one of which {trouble}, read to their end"),
        nothing_escapes(f"after one stream's {trouble}"),
    ):
        async with (
            new_mux(
                clock=clock, idle_timeout_ns=idle, max_buffered=4, max_line_bytes=SMALL_LINES
            ) as mux,
            anyio.create_task_group() as tg,
        ):
            streams = {name: mux.open(name, sources[name]) for name in names}
            consumers = {name: Consumer(streams[name]) for name in names}
            for consumer in consumers.values():
                tg.start_soon(consumer.run)
            for name in names:
                sources[name].push(f"data: {name} 0\n\n".encode())
            await until(
                lambda: all(len(c.events) == 1 and c.waiting for c in consumers.values()),
                "each of the three consumers to get its first event and wait for the next",
            )
            troubled = sources["troubled"]
            if trouble.startswith("raises"):
                troubled.fail(boom)
            elif trouble == "parse-error":
                troubled.push(b"data: troubled 1\n\n" + TOO_LONG)
            elif trouble == "cancel":
                streams["troubled"].cancel()
            else:  # the troubled source goes quiet; the healthy ones go on
                await settle()
                clock.advance(IDLE - 1)
                for name in ("healthy-1", "healthy-2"):
                    sources[name].push(f"data: {name} 1\n\n".encode())
                await until(
                    lambda: all(len(consumers[n].events) == 2 for n in ("healthy-1", "healthy-2")),
                    "the healthy streams' second events, sent 1 ns before the idle timeout",
                )
                await settle()
                clock.advance(1)
            await until(
                lambda: consumers["troubled"].done, f"the troubled stream to end ({trouble})"
            )
            # The others go on as if nothing happened.
            for name in ("healthy-1", "healthy-2"):
                if trouble != "timeout":
                    sources[name].push(f"data: {name} 1\n\n".encode())
                sources[name].push(f"data: {name} 2\n\ndata: {name} 3\n\n".encode())
                sources[name].end()
    for name in ("healthy-1", "healthy-2"):
        want = [E(data=f"{name} {n}") for n in range(4)]
        got = consumers[name]
        check(
            got.events == want and got.outcome == END,
            f"isolation: while another stream {trouble}, {name!r} must deliver all it was "
            f"sent\n  expected {want} then {END}\n  got      {got.events} then {outcome_of(got)}",
        )
        check(sources[name].closed_once(), f"close-source: {sources[name].describe()}")
    got = consumers["troubled"]
    before = [E(data="troubled 0")] + ([E(data="troubled 1")] if trouble == "parse-error" else [])
    check(
        got.events == before,
        f"isolation: the troubled stream ({trouble}) must first deliver every event completed "
        f"before it (a ParseError's own events included)\n  expected {before}\n"
        f"  got      {got.events}",
    )
    out = got.outcome
    if trouble.startswith("raises"):
        ok, want_end = out is boom, f"the source's own exception {boom!r}"
    elif trouble == "parse-error":
        ok, want_end = isinstance(out, ParseError), "ParseError (a line over max_line_bytes=64)"
        if ok:
            assert isinstance(out, ParseError)
            check(
                set(out.events) <= set(got.events),
                f"isolation: the ParseError's own events {out.events} must be among those "
                f"delivered {got.events}",
            )
    elif trouble == "cancel":
        ok, want_end = out == END, f"{END} (cancel() ends the iteration)"
    else:
        ok = isinstance(out, StreamTimeout) and out.name == "troubled"
        want_end = f"StreamTimeout('troubled', {IDLE})"
    check(ok, f"isolation: the troubled stream ({trouble}) must end with {want_end}, got {out!r}")
    check(sources["troubled"].closed_once(), f"close-source: {sources['troubled'].describe()}")


@pytest.mark.parametrize(
    "trouble",
    [
        pytest.param("raises", marks=[core, rule("isolation")]),
        pytest.param("parse-error", marks=[core, rule("isolation")]),
        pytest.param("timeout", marks=[extended, rule("isolation", "idle-timeout")]),
    ],
)
async def test_stage2_events_before_the_trouble_wait_for_a_consumer_that_reads_late(
    trouble: str,
) -> None:
    clock, source = ManualClock(), ChannelSource("read late")
    idle = IDLE if trouble == "timeout" else None
    boom = ConnectionResetError("upstream reset")
    want = [E(data="a"), E(data="b")] + ([E(data="c")] if trouble == "parse-error" else [])
    with bounded(f"a stream ended by {trouble}, read after it ended"):
        async with new_mux(clock=clock, idle_timeout_ns=idle, max_line_bytes=SMALL_LINES) as mux:
            stream = mux.open(source.name, source)
            source.push(b"data: a\n\ndata: b\n\n")
            await until(lambda: stream.buffered == 2 and source.waiting, "events a and b read")
            await settle()
            if trouble == "raises":
                source.fail(boom)
            elif trouble == "parse-error":
                source.push(b"data: c\n\n" + TOO_LONG)
            else:
                clock.advance(IDLE)
            await until(lambda: source.aclose_calls > 0, f"the source closed after {trouble}")
            await settle()
            got, err = await drain(stream, f"the events before {trouble}, then its error")
            if isinstance(err, BaseException):
                await expect_end(stream, f"isolation: after the error of {trouble}")
    right = (
        err is boom
        if trouble == "raises"
        else isinstance(err, ParseError if trouble == "parse-error" else StreamTimeout)
    )
    check(
        got == want and right,
        f"isolation: the stream ended by {trouble} while its consumer was not reading; "
        f"the consumer, reading later, first gets every event completed before it, then the "
        f"error\n  expected {want} then {trouble}\n  got      {got} then {err!r}",
    )


# --- backpressure -------------------------------------------------------------------------


@extended
@rule("backpressure")
async def test_stage2_each_streams_parser_has_the_muxs_own_limits() -> None:
    """``max_line_bytes`` bounds a line and ``max_event_bytes`` an event, for every
    stream, as in stage 1: with lines of at most 64 bytes and events of at most 4 096, an
    event of four 34-byte data values (139 bytes of data) passes, a 100-byte line does not."""
    value = "y" * 34
    source = ListSource([f"data: {value}\n".encode() * 4 + b"\n", TOO_LONG], name="limits")
    async with new_mux(max_line_bytes=SMALL_LINES, max_event_bytes=4096) as mux:
        stream = mux.open("limits", source)
        try:
            first: object = await take(stream, "the four-line event")
        except ParseError as error:
            first = error
        want = E(data="\n".join([value] * 4))
        check(
            first == want,
            f"max_line_bytes={SMALL_LINES}, max_event_bytes=4096: an event of four lines of "
            f"40 bytes is within both limits\n  expected {want}\n  got      {first!r}",
        )
        try:
            second: object = await take(stream, "the 100-byte line")
        except ParseError as error:
            second = error
        check(
            isinstance(second, ParseError),
            f"a data line of 100 bytes is over max_line_bytes={SMALL_LINES}: ParseError; got "
            f"{second!r}",
        )


@core
@rule("backpressure")
async def test_stage2_a_full_stream_pulls_no_chunk_until_its_consumer_takes_one() -> None:
    slow_source = ListSource([f"data: {n}\n\n".encode() for n in range(50)], name="slow")
    fast_source = ListSource([f"data: f{n}\n\n".encode() for n in range(10)], name="fast")
    async with new_mux(max_buffered=2) as mux:
        slow = mux.open("slow", slow_source)
        await settle()
        check(
            (slow_source.pulls, slow.buffered) == (2, 2),
            "backpressure: max_buffered=2, one event per chunk, the consumer took nothing: "
            f"exactly 2 chunks may be pulled and 2 events held; pulled {slow_source.pulls}, "
            f"holding {slow.buffered} — a full stream must not pull another chunk",
        )
        fast = mux.open("fast", fast_source)
        fast_got = [await take(fast, "the fast stream, beside a full one") for _ in range(10)]
        await expect_end(fast, "the fast stream's source ended")
        check(
            fast_got == [E(data=f"f{n}") for n in range(10)],
            f"backpressure: a full stream slows its own producer only; the fast one got {fast_got}",
        )
        for n in range(3):
            got = await take(slow, "the slow stream's next event")
            check(got == E(data=str(n)), f"in-order: event {n} of 'slow' must be {n}, got {got}")
            await settle()
            check(
                (slow_source.pulls, slow.buffered) == (3 + n, 2),
                f"backpressure: after the consumer took {n + 1} event(s) from a full stream "
                f"(max_buffered=2), exactly one more chunk each time: {3 + n} pulls, 2 held; "
                f"got {slow_source.pulls} pulls, {slow.buffered} held",
            )


@core
@rule("backpressure")
async def test_stage2_a_chunk_of_several_events_fills_the_buffer_past_its_limit_once() -> None:
    # Each chunk completes 3 events; max_buffered=2. The chunk's events are read whole
    # ("one chunk's events"); the next chunk is pulled only once fewer than 2 wait.
    chunks = [sse_events(*(f"{n}.{k}" for k in range(3))) for n in range(10)]
    source = ListSource(chunks, name="bursty")
    async with new_mux(max_buffered=2) as mux:
        stream = mux.open("bursty", source)
        steps = [("nothing taken", 1, 3), ("1 taken: 2 wait", 1, 2), ("2 taken: 1 waits", 2, 4)]
        for n, (when, pulls, held) in enumerate(steps):
            if n:
                got = await take(stream, when)
                check(got == E(data=f"0.{n - 1}"), f"in-order: event 0.{n - 1} first, got {got}")
            await settle()
            check(
                (source.pulls, stream.buffered) == (pulls, held),
                f"backpressure: chunks of 3 events, max_buffered=2, {when}: the mux pulls the "
                f"next chunk only while fewer than 2 events wait, and buffered counts every "
                f"event read but not taken — expected {pulls} pull(s), {held} buffered; got "
                f"{source.pulls} pull(s), {stream.buffered} buffered",
            )


# --- cancel() -------------------------------------------------------------------------------


@core
@rule("cancel-one")
async def test_stage2_cancel_ends_the_iteration_of_a_consumer_waiting_right_now() -> None:
    source, other_source = ChannelSource("cancelled"), ChannelSource("neighbour")
    with bounded("a cancelled stream and its neighbour to finish"):
        async with new_mux() as mux, anyio.create_task_group() as tg:
            stream = mux.open("cancelled", source)
            other = mux.open("neighbour", other_source)
            consumer = Consumer(stream)
            tg.start_soon(consumer.run)
            source.push(b"data: a\n\n")
            await until(lambda: consumer.waiting and len(consumer.events) == 1, "event a taken")
            await until(lambda: source.waiting, "the mux to wait for the source's next chunk")
            await settle()
            stream.cancel()
            await until(
                lambda: consumer.done,
                "cancel-one: the consumer waiting in __anext__ to end its iteration at cancel()",
            )
            check(
                consumer.outcome == END,
                f"cancel-one: a consumer waiting in __anext__ when cancel() was called must see "
                f"its iteration end (StopAsyncIteration), got {outcome_of(consumer)}",
            )
            await until(lambda: source.aclose_calls > 0, "cancel-one: the source's aclose()")
            await settle()
            check(
                source.pulls == 2 and not source.waiting and source.closed_once(),
                "cancel-one: cancel() stops the reading (the waiting pull abandoned, no new "
                f"one) and closes the source once: {source.describe()}",
            )
            other_source.push(b"data: still here\n\n")
            got = await take(other, "the neighbour of a cancelled stream")
            check(got == E(data="still here"), f"isolation: the neighbour got {got}")
            other_source.end()
            await expect_end(other, "the neighbour's source ended")


@core
@rule("cancel-one")
async def test_stage2_cancel_drops_what_was_buffered_and_twice_is_harmless() -> None:
    source = ListSource([f"data: {n}\n\n".encode() for n in range(10)], name="full")
    async with new_mux(max_buffered=3) as mux:
        stream = mux.open("full", source)
        await settle()
        check(stream.buffered == 3, f"3 events buffered before cancel(), got {stream.buffered}")
        stream.cancel()
        await expect_end(
            stream, "cancel-one: cancel() drops the 3 buffered events; the iteration ends now"
        )
        check(
            stream.buffered == 0,
            f"cancel-one: cancel() drops what was buffered; buffered is {stream.buffered}",
        )
        stream.cancel()  # twice: harmless
        await until(lambda: source.aclose_calls > 0, "cancel-one: the source's aclose()")
        await settle()
        check(
            source.pulls == 3 and source.closed_once(),
            f"cancel-one: nothing more read after cancel(), the source closed once: "
            f"{source.describe()}",
        )
        await expect_end(stream, "cancel-one: after cancel() twice")


@core
@rule("cancel-one", "close-source")
async def test_stage2_cancel_after_the_end_is_harmless() -> None:
    ended_source = ListSource([b"data: a\n\n"], name="ended")
    failed_source = ListSource([b"data: b\n\n"], then=OSError("reset"), name="failed")
    with nothing_escapes("after cancel() of streams that had ended"):
        async with new_mux() as mux:
            ended = mux.open("ended", ended_source)
            failed = mux.open("failed", failed_source)
            assert await take(ended, "the only event") == E(data="a")
            await expect_end(ended, "its source ended")
            assert await take(failed, "the only event") == E(data="b")
            with bounded("the failed stream's error"), pytest.raises(OSError):
                await failed.__anext__()
            for stream in (ended, failed, ended, failed):
                stream.cancel()  # after the end: harmless (and twice)
            await settle()
            await expect_end(ended, "cancel-one: cancel() after the end")
    for source in (ended_source, failed_source):
        check(
            source.closed_once() and source.pulls == 2,
            f"close-source: a stream that ended, then was cancelled, closes its source once: "
            f"{source.describe()}",
        )


@core
@rule("cancel-one")
async def test_stage2_cancel_ends_the_iteration_before_the_source_is_closed() -> None:
    source = ChannelSource("slow to close")
    source.hold_close()  # its aclose() waits until the test lets it finish
    with bounded("a stream cancelled while its source takes its time to close"):
        async with new_mux() as mux, anyio.create_task_group() as tg:
            try:
                stream = mux.open(source.name, source)
                consumer = Consumer(stream)
                tg.start_soon(consumer.run)
                source.push(b"data: a\n\n")
                await until(
                    lambda: len(consumer.events) == 1 and consumer.waiting and source.waiting,
                    "event a taken, the consumer waiting for the next",
                )
                await settle()
                stream.cancel()
                await until(lambda: source.aclose_calls == 1, "cancel-one: the source's aclose()")
                await settle()
                check(
                    consumer.outcome == END and source.aclose_finished == 0,
                    "cancel-one: cancel() ends the iteration now — the consumer waiting in "
                    "__anext__ gets StopAsyncIteration at once, not once the source's aclose() "
                    f"has returned (it is still closing); the consumer got "
                    f"{outcome_of(consumer) if consumer.done else 'nothing yet'}: "
                    f"{source.describe()}",
                )
            finally:
                source.release_close()
    check(source.closed_once(), f"close-source: {source.describe()}")


@pytest.mark.parametrize(
    "ending",
    [
        pytest.param("an error", marks=[core, rule("cancel-one", "isolation")], id="error"),
        pytest.param("a ParseError", marks=[core, rule("cancel-one", "isolation")], id="parse"),
        pytest.param(
            "a timeout", marks=[extended, rule("cancel-one", "idle-timeout")], id="timeout"
        ),
    ],
)
async def test_stage2_cancel_while_the_source_closes_after_an_error_ends_the_iteration(
    ending: str,
) -> None:
    # The stream ends for its consumer once its source is closed; a cancel() before that
    # — the reading stopped by an error or a timeout, aclose() not yet returned — wins.
    clock, source = ManualClock(), ChannelSource("closing")
    idle = IDLE if ending == "a timeout" else None
    source.hold_close()
    with bounded(f"a stream cancelled while its source closes after {ending}"):
        async with (
            new_mux(clock=clock, idle_timeout_ns=idle, max_line_bytes=SMALL_LINES) as mux,
            anyio.create_task_group() as tg,
        ):
            try:
                stream = mux.open(source.name, source)
                source.push(b"data: a\n\n")
                await until(lambda: stream.buffered == 1 and source.waiting, "event a read")
                await settle()
                if ending == "an error":
                    source.fail(OSError("upstream reset"))
                elif ending == "a ParseError":
                    source.push(TOO_LONG)
                else:
                    clock.advance(IDLE)
                await until(lambda: source.aclose_calls == 1, f"aclose() after {ending}")
                await settle()
                stream.cancel()  # the source is still closing
                consumer = Consumer(stream)
                tg.start_soon(consumer.run)
                await settle()
                check(
                    (consumer.events, consumer.outcome) == ([], END),
                    f"cancel-one: {ending} stopped the reading and the mux is closing the "
                    "source (aclose() not returned yet) when cancel() is called: the stream "
                    "has not ended yet, so cancel() ends it — buffered events dropped, "
                    f"StopAsyncIteration, not the error; the consumer got {consumer.events} "
                    f"then {outcome_of(consumer) if consumer.done else 'nothing yet'}",
                )
            finally:
                source.release_close()
            await until(lambda: source.aclose_finished == 1, "the source's aclose() to return")
            await expect_end(stream, f"cancel-one: cancelled while closing after {ending}")
    check(source.closed_once(), f"close-source: {source.describe()}")


@pytest.mark.parametrize(
    "ending",
    [
        pytest.param("its end", marks=[core, rule("cancel-one")], id="end"),
        pytest.param("an error", marks=[core, rule("cancel-one", "isolation")], id="error"),
        pytest.param("a ParseError", marks=[core, rule("cancel-one", "isolation")], id="parse"),
        pytest.param(
            "a timeout", marks=[extended, rule("cancel-one", "idle-timeout")], id="timeout"
        ),
    ],
)
async def test_stage2_cancel_after_the_end_drops_the_events_and_keeps_the_error(
    ending: str,
) -> None:
    clock, source = ManualClock(), ChannelSource("ended")
    idle = IDLE if ending == "a timeout" else None
    boom = OSError("upstream reset")
    with bounded(f"a stream ended by {ending}, then cancelled"), nothing_escapes(ending):
        async with new_mux(clock=clock, idle_timeout_ns=idle, max_line_bytes=SMALL_LINES) as mux:
            stream = mux.open(source.name, source)
            source.push(b"data: a\n\ndata: b\n\n")
            await until(lambda: stream.buffered == 2 and source.waiting, "events a and b read")
            await settle()
            if ending == "its end":
                source.end()
            elif ending == "an error":
                source.fail(boom)
            elif ending == "a ParseError":
                source.push(TOO_LONG)
            else:
                clock.advance(IDLE)
            await until(lambda: source.aclose_finished == 1, f"the source closed after {ending}")
            await settle()
            stream.cancel()  # after the end
            got, err = await drain(stream, f"cancel() after {ending}")
            if isinstance(err, BaseException):
                await expect_end(stream, f"cancel-one: after cancel() and the error of {ending}")
    if ending == "its end":
        right, want = err == END, END
    elif ending == "an error":
        right, want = err is boom, repr(boom)
    elif ending == "a ParseError":
        right, want = isinstance(err, ParseError), "the ParseError"
    else:
        right, want = isinstance(err, StreamTimeout), "the StreamTimeout"
    check(
        right and got == [],
        f"cancel-one: the stream had ended by {ending} (its source closed), events a and b "
        f"not taken, when cancel() was called: cancel() still drops the events, but keeps "
        f"how the stream ended — the next __anext__ must raise {want}; got {got} then "
        f"{err!r}",
    )
    check(source.closed_once(), f"close-source: {source.describe()}")


# --- every source is closed -----------------------------------------------------------------


@pytest.mark.parametrize(
    "ending",
    [
        pytest.param("its end", marks=[core, rule("close-source", "in-order")], id="end"),
        pytest.param("an error", marks=[core, rule("close-source", "isolation")], id="error"),
        pytest.param(
            "a ParseError", marks=[core, rule("close-source", "isolation")], id="parse-error"
        ),
        pytest.param("cancel()", marks=[core, rule("close-source", "cancel-one")], id="cancel"),
        pytest.param("the shutdown", marks=[core, rule("close-source", "shutdown")], id="shutdown"),
        pytest.param(
            "a timeout", marks=[extended, rule("close-source", "idle-timeout")], id="timeout"
        ),
    ],
)
async def test_stage2_whatever_ends_a_stream_closes_its_source_exactly_once(ending: str) -> None:
    clock, source = ManualClock(), ChannelSource("upstream")
    idle = IDLE if ending == "a timeout" else None
    with bounded(f"a stream ended by {ending}"), nothing_escapes(f"after {ending}"):
        async with (
            anyio.create_task_group() as tg,
            new_mux(clock=clock, idle_timeout_ns=idle, max_line_bytes=SMALL_LINES) as mux,
        ):
            stream = mux.open("upstream", source)
            consumer = Consumer(stream)
            tg.start_soon(consumer.run)
            source.push(b"data: a\n\n")
            await until(lambda: len(consumer.events) == 1, "the first event")
            if ending == "its end":
                source.end()
            elif ending == "an error":
                source.fail(OSError("connection reset"))
            elif ending == "a ParseError":
                source.push(TOO_LONG)
            elif ending == "cancel()":
                stream.cancel()
            elif ending == "a timeout":
                await settle()
                clock.advance(IDLE)
            if ending != "the shutdown":
                await until(lambda: source.aclose_calls > 0, f"aclose() after {ending}")
                await settle()
                check(
                    source.aclose_calls == 1,
                    f"close-source: after {ending}: {source.describe()} (exactly once)",
                )
    check(
        source.closed_once() and source.pulls_after_close == 0,
        f"close-source: a stream ended by {ending}, then the mux left: the source's aclose() "
        f"called exactly once (and run to its end), nothing pulled after: {source.describe()}",
    )
    check(consumer.done, f"the consumer's iteration must have ended after {ending}")


@core
@rule("close-source")
async def test_stage2_a_source_without_aclose_is_fine() -> None:
    sources = [NoCloseSource([b"data: a\n\n"] * n, name=f"s{n}") for n in (1, 5, 9)]
    with (
        bounded("streams of sources without aclose()"),
        nothing_escapes("streams whose sources have no aclose()"),
    ):
        async with new_mux(max_buffered=2) as mux:
            ended, cancelled, _shut_down = (mux.open(s.name, s) for s in sources)
            assert await take(ended, "the only event") == E(data="a")
            await expect_end(ended, "its source ended (no aclose() to call)")
            await settle()
            cancelled.cancel()
            await expect_end(cancelled, "cancel-one: cancelled (no aclose() to call)")


# --- shutdown ---------------------------------------------------------------------------


class Boom(Exception):
    """The exception the body of the block raises."""


@core
@rule("shutdown", "close-source")
@pytest.mark.parametrize(
    "how",
    ["normally", "by an exception", "by cancellation"],
    ids=["normally", "by-an-exception", "by-cancellation"],
)
async def test_stage2_leaving_the_block_cancels_every_stream_and_waits_for_it(how: str) -> None:
    waiting = ChannelSource("waiting at its source")
    full = ListSource([f"data: {n}\n\n".encode() for n in range(20)], name="full buffer")
    watched = ChannelSource("consumer waiting")
    ended = ListSource([b"data: last\n\n"], name="ended")
    failed = ListSource([], then=OSError("upstream reset"), name="failed, error unread")
    sources: list[ChannelSource | ListSource] = [waiting, full, watched, ended, failed]
    mux = new_mux(max_buffered=2)
    streams: dict[str, MuxedStream] = {}
    readers: dict[str, Consumer] = {}
    ready = anyio.Event()

    async def block(consumers: anyio.abc.TaskGroup) -> None:
        async with mux:
            for source in sources:
                streams[source.name] = mux.open(source.name, source)
            consumer = Consumer(streams["consumer waiting"])
            consumers.start_soon(consumer.run)
            readers["consumer"] = consumer
            assert await take(streams["ended"], "the only event") == E(data="last")
            await expect_end(streams["ended"], "its source ended")
            await until(
                lambda: waiting.waiting and watched.waiting and consumer.waiting,
                "two streams waiting for their sources, a consumer waiting in __anext__",
            )
            await settle()
            check(streams["full buffer"].buffered == 2, "a full stream: 2 events buffered")
            ready.set()
            if how == "by an exception":
                raise Boom("the handler failed")
            if how == "by cancellation":
                await anyio.sleep_forever()

    with bounded(f"the mux's `async with` block, left {how}, to return from __aexit__"):
        async with anyio.create_task_group() as consumers:
            if how == "by cancellation":
                async with anyio.create_task_group() as runner:
                    runner.start_soon(block, consumers)
                    await ready.wait()
                    runner.cancel_scope.cancel()  # the task running the block is cancelled
            elif how == "by an exception":
                propagated = False
                try:
                    await block(consumers)
                except Exception as exc:
                    if not contains(exc, Boom) or contains(exc, Todo):
                        raise
                    check(
                        type(exc) is Boom,
                        "shutdown: the block's own exception comes out of __aexit__ as it was "
                        f"raised, Boom('the handler failed'), never wrapped; got {exc!r}",
                    )
                    propagated = True
                check(propagated, "the block's exception (Boom) must propagate")
            else:
                with nothing_escapes("leaving normally, with a stream whose error was unread"):
                    await block(consumers)
            # __aexit__ has returned: every source must be closed already, not later.
            for source in sources:
                check(
                    source.closed_once() and not source.waiting,
                    f"shutdown: when __aexit__ (left {how}) returns, every stream is cancelled "
                    f"and its source closed — no task of the mux left running: "
                    f"{source.describe()}",
                )
    consumer = readers["consumer"]
    check(
        consumer.outcome == END,
        f"shutdown: a consumer waiting in __anext__ when the block was left {how} must see its "
        f"iteration end (StopAsyncIteration), got {outcome_of(consumer)}",
    )
    for name in ("waiting at its source", "full buffer", "consumer waiting", "ended"):
        await expect_end(streams[name], f"shutdown: iterating {name!r} after the block")
    for source in sources:
        check(
            source.closed_once() and source.pulls_after_close == 0, f"shutdown: {source.describe()}"
        )
    with pytest.raises(RuntimeError):
        mux.open("late", ListSource([]))
        raise AssertionError(f"shutdown: open() after the block (left {how}) must raise")


@core
@rule("shutdown")
async def test_stage2_leaving_the_block_leaves_an_ended_stream_what_it_ended_with() -> None:
    boom = OSError("upstream reset")
    ended = ListSource([sse_events("a", "b")], name="ended, events unread")
    failed = ListSource([sse_events("c")], then=boom, name="failed, events and error unread")
    with bounded("two streams that ended before the block was left"), nothing_escapes("ended"):
        async with new_mux(max_buffered=8) as mux:
            streams = [mux.open(source.name, source) for source in (ended, failed)]
            await until(lambda: ended.closed_once() and failed.closed_once(), "both streams to end")
            await settle()
    got = [await drain(stream, "an ended stream, after the block") for stream in streams]
    want = [([E(data="a"), E(data="b")], END), ([E(data="c")], boom)]
    check(
        got == want,
        "shutdown: a stream that had already ended when the block was left keeps what it "
        f"ended with — its events not yet taken, then its end or its error; expected {want}, "
        f"got {got}",
    )


# --- idle timeout (extended) ----------------------------------------------------------------


@extended
@rule("idle-timeout", "close-source")
async def test_stage2_a_quiet_source_times_out_at_the_deadline_exactly_once() -> None:
    async with quiet_stream_in_a_new_mux(
        "quiet", "a quiet stream to time out", idle_timeout_ns=IDLE
    ) as (clock, source, stream, consumer):
        clock.advance(IDLE - 1)
        await still_open(consumer, source, "1 ns before the idle timeout")
        clock.advance(1)
        await timed_out(consumer, source, stream, "at the idle timeout")
        clock.advance(10 * IDLE)
        await settle()
        check(
            source.pulls == 1 and source.closed_once(),
            "idle-timeout: after the timeout nothing more is read, and the source is "
            f"closed once: {source.describe()}",
        )
        await expect_end(stream, "idle-timeout: StreamTimeout is raised exactly once")


@extended
@rule("idle-timeout")
async def test_stage2_every_chunk_restarts_the_idle_timer() -> None:
    async with quiet_stream_in_a_new_mux(
        "slow upstream", "a slow upstream to time out", idle_timeout_ns=IDLE
    ) as (clock, source, stream, consumer):
        clock.advance(IDLE - 1)
        source.push(b"data: a\n\n")  # a chunk 1 ns before the deadline
        await until(lambda: consumer.events == [E(data="a")], "event a")
        await next_pull(source, "after a chunk 1 ns before the idle timeout")
        clock.advance(IDLE - 1)
        source.push(b"data: b")  # a chunk without a complete event restarts it too
        await until(lambda: source.chunks_given == 2, "the chunk without an event pulled")
        await next_pull(source, "after a chunk without an event")
        clock.advance(IDLE - 1)
        await still_open(
            consumer, source, "IDLE - 1 ns after the last chunk (2 IDLE after the start)"
        )
        clock.advance(1)
        await timed_out(consumer, source, stream, "IDLE ns after the last chunk")
        check(
            consumer.events == [E(data="a")],
            f"idle-timeout: one event, then the timeout; got {consumer.events}",
        )


@extended
@rule("idle-timeout", "backpressure")
async def test_stage2_time_blocked_on_a_full_buffer_is_not_idleness() -> None:
    clock, source = ManualClock(), ChannelSource("fast upstream")
    with bounded("a full stream, then a quiet one, to time out"):
        async with new_mux(clock=clock, idle_timeout_ns=IDLE, max_buffered=1) as mux:
            stream = mux.open(source.name, source)
            source.push(b"data: a\n\n")
            await until(lambda: stream.buffered == 1, "the one event max_buffered=1 allows")
            await settle()
            clock.advance(5 * IDLE)  # the consumer is slow; the source is not idle
            await settle()
            check(
                source.aclose_calls == 0 and stream.buffered == 1 and source.pulls == 1,
                "idle-timeout: time spent waiting for the consumer (the buffer full, no chunk "
                f"asked for) is not the source's idleness; after 5 IDLE: {source.describe()}, "
                f"{stream.buffered} event(s) buffered",
            )
            assert await take(stream, "event a") == E(data="a")  # the timer restarts now
            await next_pull(
                source,
                "after 5 IDLE on a full buffer, the consumer took the event (the time the "
                "buffer was full is not idleness)",
            )
            clock.advance(IDLE - 1)
            await settle()
            check(
                source.aclose_calls == 0,
                "idle-timeout: taking an event from a full buffer restarts the timer; IDLE - 1 "
                f"ns after it the stream ended: {source.describe()}",
            )
            clock.advance(1)
            with (
                bounded("StreamTimeout IDLE after the buffer had room again"),
                pytest.raises(StreamTimeout),
            ):
                await stream.__anext__()
                raise AssertionError("idle-timeout: __anext__ returned: StreamTimeout")


@extended
@rule("idle-timeout")
async def test_stage2_no_idle_timeout_waits_forever() -> None:
    async with quiet_stream_in_a_new_mux("patient", "a stream without idle timeout") as (
        clock,
        source,
        _,
        consumer,
    ):
        for _ in range(3):
            clock.advance(10**6 * IDLE)
            await still_open(consumer, source, "with idle_timeout_ns=None, a year later")
        source.push(b"data: late\n\n")
        source.end()
        await until(lambda: consumer.done, "the late event and the end")
    check(
        consumer.events == [E(data="late")] and consumer.outcome == END,
        f"idle-timeout: idle_timeout_ns=None waits forever: expected the late event then "
        f"{END}, got {consumer.events} then {outcome_of(consumer)}",
    )


# --- a cancelled consumer (extended) --------------------------------------------------------


@extended
@rule("waiter-cancelled")
@pytest.mark.parametrize(
    "order",
    [
        "cancelled, then an event arrives",
        "cancelled as an event arrives",
        "cancelled once its event was handed over",
    ],
    ids=["then-an-event", "as-an-event-arrives", "once-handed-over"],
)
async def test_stage2_a_cancelled_consumer_loses_no_event(order: str) -> None:
    source = ChannelSource("upstream")
    scope = anyio.CancelScope()
    got: list[ServerSentEvent] = []
    state = {"entered": False, "left": False}

    async def impatient(stream: MuxedStream) -> None:
        try:
            with scope:
                state["entered"] = True
                got.append(await stream.__anext__())
        finally:
            state["left"] = True

    with bounded(f"a consumer cancelled in __anext__ ({order})"):
        async with new_mux() as mux, anyio.create_task_group() as tg:
            stream = mux.open("upstream", source)
            tg.start_soon(impatient, stream)
            await until(lambda: state["entered"] and source.waiting, "the consumer to wait")
            await settle()  # the consumer is parked in __anext__
            if order == "cancelled, then an event arrives":
                scope.cancel()
                await until(lambda: state["left"], "the cancelled consumer to leave __anext__")
                source.push(b"data: 1\n\n")
            elif order == "cancelled as an event arrives":
                scope.cancel()
                source.push(b"data: 1\n\n")
            else:
                # Cancelled by the reading task itself, the instant after it handed event 1
                # on (its next pull): the consumer may have been woken but has not run yet.
                source.on_pull = lambda n: scope.cancel() if n == 2 else None
                source.push(b"data: 1\n\n")
            await until(lambda: state["left"], "the cancelled consumer to leave __anext__")
            await settle()
            source.push(b"data: 2\n\n")
            source.end()
            # The rest of the stream, from another task: a lost event shows at once as a
            # short list, instead of a wait for an event that never comes.
            taken = list(got) + [event async for event in stream]
    check(
        taken == [E(data="1"), E(data="2")],
        f"waiter-cancelled: a consumer waiting in __anext__ was cancelled ({order}); what it "
        f"got ({got}) and what the next __anext__ calls got must be events 1, 2, each once; "
        f"got {taken}",
    )
    check(source.closed_once(), f"the stream ended by its source: {source.describe()}")


# --- bad arguments (extended) ---------------------------------------------------------------


@extended
@rule("stage2-bad-arguments")
async def test_stage2_bad_arguments_name_the_parameter() -> None:
    async with new_mux() as mux:  # a valid mux first
        mux.open("probe", ListSource([]))
    mux_cls = stage().StreamMux
    bad: list[tuple[str, object, type[Exception]]] = [
        ("max_buffered", 0, ValueError),
        ("max_buffered", -1, ValueError),
        ("max_buffered", 2.0, TypeError),
        ("max_buffered", "2", TypeError),
        ("max_buffered", None, TypeError),
        ("max_buffered", True, TypeError),  # a bool is no int here
        ("idle_timeout_ns", 0, ValueError),
        ("idle_timeout_ns", -NS_PER_S, ValueError),
        ("idle_timeout_ns", 1.5, TypeError),
        ("idle_timeout_ns", "30", TypeError),
        ("idle_timeout_ns", True, TypeError),
    ]
    for name, value, kind in bad:
        with pytest.raises(kind) as caught:
            mux_cls(clock=ManualClock(), **{name: value})
            raise AssertionError(f"StreamMux({name}={value!r}) must raise {kind.__name__}")
        check(
            name in str(caught.value),
            f"StreamMux({name}={value!r}) raised {caught.value!r}: the message must name {name}",
        )
    mux_cls(clock=ManualClock(), idle_timeout_ns=None, max_buffered=1)  # both fine
    mux_cls(clock=ManualClock(), idle_timeout_ns=1)
    async with new_mux() as mux:
        mux.open("req-1", ChannelSource("req-1"))
        with pytest.raises(ValueError) as caught_value:
            mux.open("req-1", ChannelSource("again"))
            raise AssertionError("open() of a name already open must raise ValueError")
        check(
            "req-1" in str(caught_value.value),
            f"open('req-1') twice raised {caught_value.value!r}: the message must name 'req-1'",
        )
        not_async: Sequence[object] = (
            [b"data: a\n\n"],
            iter([b"data: a\n\n"]),
            b"data: a\n\n",
            IterableOnly(),  # async iterable, but not an iterator: no __anext__
        )
        for n, source in enumerate(not_async):
            with pytest.raises(TypeError) as caught_type:
                mux.open(f"sync-{n}", source)  # type: ignore[arg-type]  # on purpose
                raise AssertionError(f"open() of {source!r} (not an async iterator): TypeError")
            check(
                "source" in str(caught_type.value),
                f"open(name, {source!r}) raised {caught_type.value!r}: the message must name "
                "the source",
            )
        ok = ChannelSource("fine")
        mux.open("fine", ok)
        ok.end()
        again = ChannelSource("sync-0, good this time")
        with not_refused(
            "open('sync-0', a list) was refused with a TypeError, so it never took the name: "
            "open('sync-0', an async iterator) must work now",
            ValueError,
        ):
            mux.open("sync-0", again)
        again.end()


@extended
@rule("stage2-bad-arguments")
@pytest.mark.parametrize(
    "ending", ["its end", "an error", "cancel()"], ids=["end", "error", "cancel"]
)
async def test_stage2_a_name_is_free_again_once_its_stream_has_ended(ending: str) -> None:
    # Ended: its source ended, failed or was cancelled, and is closed — whether or not its
    # consumer has taken what it ended with.
    chunks = [sse_events("a", "b")]
    first_source: ChannelSource | ListSource = (
        ChannelSource("first", chunks)
        if ending == "cancel()"
        else ListSource(chunks, then=OSError("reset") if ending == "an error" else None)
    )
    second_source = ListSource([sse_events("c")], name="second")
    first_source.hold_close()  # until its aclose() returns, the stream has not ended
    with bounded(f"a name opened again after {ending}"), nothing_escapes(ending):
        async with new_mux(max_buffered=8) as mux:
            first = mux.open("req-1", first_source)
            await until(lambda: first.buffered == 2, "the first stream's two events read")
            if ending == "cancel()":
                first.cancel()
            try:
                await until(lambda: first_source.aclose_calls == 1, f"aclose() after {ending}")
                await settle()
                early = ListSource([], name="too-early")
                with pytest.raises(ValueError):
                    mux.open("req-1", early)
                    raise AssertionError(
                        f"stage2-bad-arguments: the stream 'req-1' stopped reading ({ending}) "
                        f"but its source's aclose() has not returned: it has not ended, the "
                        f"name is still open, and open('req-1', ...) must raise ValueError; "
                        f"it opened a second stream under it"
                    )
            finally:
                first_source.release_close()
            await until(first_source.closed_once, f"the first stream ended by {ending}")
            await settle()
            with not_refused(
                f"stage2-bad-arguments: the stream 'req-1' has ended ({ending}; its source "
                f"closed, {first.buffered} event(s) not taken yet): the name is no longer "
                f"open, and open('req-1', ...) must take it again",
                ValueError,
            ):
                second = mux.open("req-1", second_source)
            got = await drain(second, "the new stream under the old name")
    check(
        got == ([E(data="c")], END),
        f"the stream opened again as 'req-1' reads its own source: expected ([c], {END}), "
        f"got {got}",
    )
    if ending == "its end":
        left = await drain(first, "the old stream, its name taken again")
        check(
            left == ([E(data="a"), E(data="b")], END),
            f"the old stream keeps its own events when its name is taken again, got {left}",
        )
