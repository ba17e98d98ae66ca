"""Driving a stage-2 mux: building one on a test clock, taking from its streams under
deadlines, and the probes of the idle-timeout tests.

The sources the mux reads and the consumers that read its streams are in
:mod:`.mux`; here is what a test does with them. :func:`take` and :func:`expect_end`
read one step of a :class:`~katas.streaming_parser.api.MuxedStream`, :func:`reads` a few
(the loop settled between them), :func:`drain` the rest, and fail, saying what was
awaited, past a real-time deadline;
:func:`nothing_escapes` turns a stream's error that leaked out of the mux's block into a
failure that names the rule. The idle-timeout probes — :func:`quiet_stream`,
:func:`next_pull`, :func:`still_open`, :func:`timed_out` — each wait for the loop to
settle before they look, so a test moves the clock only while every task waits.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager, suppress

import anyio.abc
from hypothesis import strategies as st

from katas._harness.story import check
from katas._harness.under_test import stage
from katas._harness.waiting import bounded, eventually_async
from katas._runtime.clock import NS_PER_S, ManualClock
from katas._runtime.todo import Todo
from katas.streaming_parser.api import Multiplexer, MuxedStream, ServerSentEvent, StreamTimeout

from . import sse
from .mux import END, ChannelSource, Consumer, settle, sse_events

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

#: The idle timeout of the tests that time a stream out: 30 s on the test's clock.
IDLE = 30 * NS_PER_S
#: The line limit of the tests that provoke a ParseError: 64 bytes.
SMALL_LINES = 64
#: An event whose data line is over :data:`SMALL_LINES`.
TOO_LONG = b"data: " + b"x" * 100 + b"\n\n"


def new_mux(**options: object) -> Multiplexer:
    """The stage's StreamMux on a ManualClock (time moves only when a test says so)."""
    options.setdefault("clock", ManualClock())
    mux: Multiplexer = stage().StreamMux(**options)
    return mux


async def take(stream: MuxedStream, what: str) -> ServerSentEvent:
    """The stream's next event (hard deadline)."""
    with bounded(f"{what}: an event from stream {stream.name!r}"):
        event = await stream.__anext__()
    return event


async def expect_end(stream: MuxedStream, why: str) -> None:
    """The stream's next ``__anext__`` raises StopAsyncIteration (hard deadline)."""
    __tracebackhide__ = True
    outcome = END
    waiting = f"{why}: stream {stream.name!r}'s __anext__ to raise StopAsyncIteration"
    with bounded(waiting), suppress(StopAsyncIteration):
        outcome = f"it returned {await stream.__anext__()}"
    check(
        outcome == END,
        f"{why}: stream {stream.name!r}'s __anext__ must raise StopAsyncIteration; {outcome}",
    )


async def drain(
    stream: MuxedStream, what: str, most: int = 100
) -> tuple[list[ServerSentEvent], str | BaseException]:
    """Every event the stream still gives, read in this task under a hard deadline, and
    how its iteration then ended: :data:`END`, or the exception ``__anext__`` raised."""
    events: list[ServerSentEvent] = []
    with bounded(f"{what}: stream {stream.name!r} read to its end"):
        while len(events) < most:
            try:
                events.append(await stream.__anext__())
            except StopAsyncIteration:
                return events, END
            except Todo:
                raise
            except Exception as exc:  # the stream's error: what the test checks
                return events, exc
    return events, f"more than {most} events"


async def reads(stream: MuxedStream, count: int, what: str) -> list[str]:
    """What ``count`` reads of the stream give, as a message shows them (``event 'data'``,
    :data:`END` or the exception): the first at once, each other once every task waits —
    so whatever a task of the mux still does between two reads has been done."""
    got: list[str] = []
    for n in range(count):
        if n:
            await settle()
        try:
            with bounded(f"{what}: read {n + 1} of stream {stream.name!r}"):
                got.append(f"event {(await stream.__anext__()).data!r}")
        except StopAsyncIteration:
            got.append(END)
        except Todo:
            raise
        except Exception as exc:  # the stream's error: what the test checks
            got.append(repr(exc))
    return got


async def until(pred: Callable[[], bool], what: str) -> None:
    """Wait until ``pred()`` holds (hard deadline), failing with ``what`` was awaited."""
    await eventually_async(pred, what)


def contains(exc: BaseException, kind: type[BaseException]) -> bool:
    """``exc`` is a ``kind``, or an exception group holding one."""
    if isinstance(exc, kind):
        return True
    if isinstance(exc, BaseExceptionGroup):
        return any(contains(e, kind) for e in exc.exceptions)
    return False


@contextmanager
def nothing_escapes(what: str) -> Iterator[None]:
    """A stream's trouble is its own: leaving the mux's block must not raise it."""
    try:
        yield
    except Exception as exc:
        if contains(exc, Todo) or contains(exc, AssertionError):
            raise
        raise AssertionError(
            f"{what}, leaving the mux's `async with` block raised {exc!r}: a stream's error "
            "belongs to its stream (its consumer gets it from __anext__), never to the mux"
        ) from exc


def outcome_of(consumer: Consumer) -> str:
    """How the consumer's iteration ended, as a message shows it."""
    out = consumer.outcome
    return repr(out) if isinstance(out, BaseException) else str(out)


# --- what the in-order tests read ----------------------------------------------------------


def streams_of_bodies() -> list[tuple[str, bytes, list[bytes]]]:
    """``(name, body, chunks)`` of three streams: one whole with an unterminated tail, one
    byte by byte, one cut at the awkward places."""
    bodies = {
        "whole": sse_events("a", "b", "c", id_prefix="w") + b"data: unterminated tail",
        "byte-by-byte": "data: é€😀\r\n\r\ndata: 2\rid: x\r\rdata: 3\n".encode(),
        "awkward": sse.BOM + "event: t\ndata: U+2028 \u2028 ok\r\n\r\n: c\ndata: 4\n\n".encode(),
    }
    out = []
    for name, body in bodies.items():
        if name == "whole":
            chunks = [body]
        elif name == "byte-by-byte":
            chunks = [body[i : i + 1] for i in range(len(body))]
        else:
            chunks = sse.cut(body, sse.awkward_offsets(body))
        out.append((name, body, chunks))
    return out


#: Bodies, their chunkings, max_buffered and the order the consumer takes in.
Scenario = tuple[list[bytes], list[list[bytes]], int, list[int]]


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    """A :data:`Scenario`, all drawn before the test's coroutine runs (a draw inside the
    event loop is not safe)."""
    count = draw(st.integers(1, 3), label="streams")
    bodies = [draw(sse.bodies(max_lines=12), label=f"body {i}") for i in range(count)]
    chunkings = [draw(sse.splits(body), label=f"chunks {i}") for i, body in enumerate(bodies)]
    max_buffered = draw(st.integers(1, 3), label="max_buffered")
    order = draw(st.lists(st.integers(0, count - 1), max_size=40), label="takes")
    return bodies, chunkings, max_buffered, order


# --- the idle-timeout probes ---------------------------------------------------------------


async def quiet_stream(
    mux: Multiplexer, tg: anyio.abc.TaskGroup, source: ChannelSource
) -> tuple[MuxedStream, Consumer]:
    """Open ``source`` (nothing pushed), read it in a task of ``tg``, and wait until the
    mux waits for its first chunk."""
    stream = mux.open(source.name, source)
    consumer = Consumer(stream)
    tg.start_soon(consumer.run)
    await until(lambda: source.waiting and consumer.waiting, "the mux waiting for a chunk")
    await settle()
    return stream, consumer


@asynccontextmanager
async def quiet_stream_in_a_new_mux(
    name: str, what: str, **options: object
) -> AsyncIterator[tuple[ManualClock, ChannelSource, MuxedStream, Consumer]]:
    """A new mux (``options``) on a ManualClock, with one :func:`quiet_stream` named
    ``name``, all under a hard deadline for ``what``: (the clock, the source, the stream,
    its consumer) — the scene of the idle-timeout tests, where only the clock moves."""
    clock, source = ManualClock(), ChannelSource(name)
    with bounded(what):
        async with new_mux(clock=clock, **options) as mux, anyio.create_task_group() as tg:
            stream, consumer = await quiet_stream(mux, tg, source)
            yield clock, source, stream, consumer


async def next_pull(source: ChannelSource, when: str) -> None:
    """Wait until the mux asks the source for its next chunk (or the stream has ended)."""
    __tracebackhide__ = True
    await until(lambda: source.waiting or source.aclose_calls > 0, f"the next pull {when}")
    await settle()
    check(
        source.aclose_calls == 0,
        f"idle-timeout: {when}, the stream must still be open and reading; it ended: "
        f"{source.describe()}",
    )


async def still_open(consumer: Consumer, source: ChannelSource, when: str) -> None:
    """Once the loop settles, the stream has not ended and its source is not closed."""
    __tracebackhide__ = True
    await settle()
    check(
        not consumer.done and source.aclose_calls == 0,
        f"idle-timeout: {when}, the stream must still be open; it ended with "
        f"{outcome_of(consumer)} ({source.describe()})",
    )


async def timed_out(
    consumer: Consumer, source: ChannelSource, stream: MuxedStream, when: str
) -> None:
    """The consumer got ``StreamTimeout(stream.name, IDLE)``, and the source is closed."""
    __tracebackhide__ = True
    await until(lambda: consumer.done, f"idle-timeout: StreamTimeout {when}")
    out = consumer.outcome
    check(
        isinstance(out, StreamTimeout),
        f"idle-timeout: {when}, the consumer must get StreamTimeout; got {outcome_of(consumer)}",
    )
    assert isinstance(out, StreamTimeout)  # for the type checker: checked just above
    check(
        (out.name, out.idle_timeout_ns) == (stream.name, IDLE),
        f"StreamTimeout names the stream and the timeout: expected ({stream.name!r}, {IDLE}), "
        f"got ({out.name!r}, {out.idle_timeout_ns!r})",
    )
    await until(lambda: source.aclose_calls > 0, "close-source: aclose() after the timeout")


__all__ = [
    "IDLE",
    "SMALL_LINES",
    "TOO_LONG",
    "Scenario",
    "contains",
    "drain",
    "expect_end",
    "new_mux",
    "next_pull",
    "nothing_escapes",
    "outcome_of",
    "quiet_stream",
    "quiet_stream_in_a_new_mux",
    "reads",
    "scenarios",
    "still_open",
    "streams_of_bodies",
    "take",
    "timed_out",
    "until",
]
