"""Driving a stage-3 source against the replicas, and the verdicts on what it did.

:func:`run` is most tests: reset the replicas to a stream and a fault schedule, read
the whole stream with a new :class:`~katas.streaming_parser.api.EventSource` on a
:class:`~.replicas.JumpingClock`, and return a :class:`Run` — the events, how the
iteration ended, every request as the replicas saw it, every wait the client chose.
Tests that act while the stream is read (a kill, a stall, an ``aclose()``) use
:func:`reading`, whose :class:`Reader` reads in a task of the test.

The verdicts say what broke in the words of the rule: :func:`expect_exactly_once`
(every event once, in order, then the expected end), :func:`expect_resumes` (each
request's ``Last-Event-ID``) and :func:`expect_waits` (each backoff within its range,
or exactly a ``Retry-After``: :class:`Floor`). :func:`next_outcome` is what one more
``__anext__`` does.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import anyio
import httpx

from katas._harness.story import check
from katas._harness.under_test import stage
from katas._harness.waiting import DEADLINE_S, bounded, eventually_async
from katas._runtime.clock import NS_PER_MS, NS_PER_S
from katas._runtime.todo import Todo
from katas.streaming_parser.api import EventSource, ServerSentEvent

from .mux import END, settle
from .replica import Block
from .replicas import JumpingClock, ReplicaSet, Request, events_of, resumes, show_requests

#: The client's own timeouts (real seconds): a hang fails a test, it never stalls it.
CLIENT_TIMEOUT = httpx.Timeout(5.0)


@dataclass
class Run:
    """What the caller got, how it ended, and what the replicas saw."""

    events: list[ServerSentEvent]
    outcome: str | BaseException
    requests: list[Request]
    sleeps_ns: list[int]
    again: str = END  # what one more __anext__ after the end did
    #: With ``run(..., watch_retry=True)``: the source's ``retry_ms`` as each wait began,
    #: then once more after the iteration ended.
    retries_ms: list[int] = field(default_factory=list)

    def summary(self) -> str:
        """The requests, as the replicas saw them, and what the caller got: the end of
        every failure message about a run."""
        out = self.outcome if isinstance(self.outcome, str) else repr(self.outcome)
        return (
            f"  the requests, as the replicas saw them:\n{show_requests(self.requests)}\n"
            f"  the caller got {len(self.events)} events, then {out}"
        )


def new_source(client: httpx.AsyncClient, urls: Sequence[str], **options: object) -> EventSource:
    """The stage's ResumableEventSource over ``urls``, on a :class:`JumpingClock` with a
    seeded random unless ``options`` say otherwise."""
    options.setdefault("clock", JumpingClock())
    options.setdefault("random", random.Random(7))
    # More than any schedule's failures in a row; a client that retries what it must not
    # (a 204) gives up soon, so its red run stays short. The max_attempts tests set theirs.
    options.setdefault("max_attempts", 12)
    source: EventSource = stage().ResumableEventSource(client, urls, **options)
    return source


async def consume(
    source: EventSource, runaway: int, events: list[ServerSentEvent] | None = None
) -> tuple[list[ServerSentEvent], str | BaseException]:
    """Every event of ``source`` (at most ``runaway``: a loop of duplicates ends), each
    appended to ``events`` as it comes, and how the iteration ended."""
    events = [] if events is None else events
    try:
        async for event in source:
            events.append(event)
            if len(events) > runaway:
                return events, "too many events (a loop of duplicates?)"
    except Todo:
        raise
    except Exception as exc:  # the source's error: what the test checks
        return events, exc
    return events, END


class Reader:
    """Reads a source in a task of the test: the events so far, the outcome once done."""

    def __init__(self, source: EventSource) -> None:
        self.source = source
        self.events: list[ServerSentEvent] = []
        self.outcome: str | BaseException | None = None

    async def run(self) -> None:
        _, self.outcome = await consume(self.source, 40, self.events)

    async def delivered(self, count: int) -> None:
        await eventually_async(
            lambda: len(self.events) >= count, f"the first {count} events to be delivered"
        )

    async def finished(self, what: str, seconds: float = DEADLINE_S) -> None:
        with bounded(what, seconds):
            while self.outcome is None:
                await anyio.sleep(0.01)

    def result(self, replicas: ReplicaSet, sleeps_ns: Sequence[int] = ()) -> Run:
        """What it read, as a :class:`Run` with the replicas' requests so far."""
        return Run(self.events, self.outcome or END, replicas.requests(), list(sleeps_ns))


@asynccontextmanager
async def reading(urls: Sequence[str], **options: object) -> AsyncIterator[Reader]:
    """A new source over ``urls``, read by a task of the test; closed on the way out."""
    async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT) as client:
        source = new_source(client, urls, **options)
        async with source, anyio.create_task_group() as tg:
            reader = Reader(source)
            tg.start_soon(reader.run)
            yield reader


@asynccontextmanager
async def held_mid_stream(
    replicas: ReplicaSet,
    blocks: Sequence[Block],
    at: int,
    delivered: int,
    names: Sequence[str] | None = None,
    **options: object,
) -> AsyncIterator[Reader]:
    """Reset the replicas to serve ``blocks``, replica a holding its connection at body
    offset ``at``; read them with a new source (over the replicas ``names``, or all of
    them: URLs of this reset's generation), and yield its reader once a holds and
    ``delivered`` events have arrived: the scene of the tests that kill, stall or restart
    a replica in the middle of a stream."""
    replicas.reset(blocks, [f"hold:{at}"])
    urls = [replicas.url(name) for name in names or replicas.names]
    async with reading(urls, **options) as reader:
        await eventually_async(lambda: replicas.held() == ["a"], "replica a to hold")
        await reader.delivered(delivered)
        yield reader


async def run(
    replicas: ReplicaSet,
    blocks: Sequence[Block],
    actions: Sequence[str] = (),
    *,
    urls: Sequence[str] | None = None,
    reset: bool = True,
    what: str = "the source to deliver the stream and end",
    clock: JumpingClock | None = None,
    client_timeout: httpx.Timeout = CLIENT_TIMEOUT,
    watch_retry: bool = False,
    **options: object,
) -> Run:
    """Reset the replicas to serve ``blocks`` with ``actions`` (unless the test did, with
    ``reset=False``), read the whole stream with a new source over a client with
    ``client_timeout``, and return what happened (with ``watch_retry``, the source's
    ``retry_ms`` as each wait began and at the end: :attr:`Run.retries_ms`)."""
    __tracebackhide__ = True
    if reset:
        replicas.reset(blocks, actions)
    clock = JumpingClock() if clock is None else clock
    events: list[ServerSentEvent] = []
    outcome: str | BaseException = "no end within 10 real seconds"
    again = END
    retries: list[int] = []
    async with httpx.AsyncClient(timeout=client_timeout) as client:
        source = new_source(client, urls or replicas.urls, clock=clock, **options)
        if watch_retry:
            clock.on_sleep = lambda: retries.append(source.retry_ms)
        with anyio.move_on_after(10.0) as scope:
            async with source:
                events, outcome = await consume(source, 3 * len(blocks) + 10, events)
                await settle()
                if watch_retry:
                    retries.append(source.retry_ms)
                again = await next_outcome(source)
    result = Run(events, outcome, replicas.requests(), clock.sleeps_ns, again, retries)
    check(
        not scope.cancelled_caught,
        f"within 10 real seconds, expected {what}.\n  the requests, as the replicas "
        f"saw them:\n{show_requests(result.requests)}\n  the client waited "
        f"{len(clock.sleeps_ns)} times",
    )
    return result


async def next_outcome(source: EventSource) -> str:
    """What one ``__anext__`` of ``source`` does, said: :data:`END`, the error's repr, or
    the event it returned."""
    try:
        event = await source.__anext__()
    except StopAsyncIteration:
        return END
    except Todo:
        raise
    except Exception as exc:
        return repr(exc)
    return f"the event {event}"


# --- the verdicts ------------------------------------------------------------------------------


def first_difference(want: Sequence[ServerSentEvent], got: Sequence[ServerSentEvent]) -> str:
    """Where two event lists first differ, as a failure shows it (``none`` if they do not)."""
    for i, (w, g) in enumerate(zip(want, got, strict=False)):
        if w != g:
            return f"event #{i + 1}: expected {w}\n{'':21}got {g}"
    if len(got) > len(want):
        return f"event #{len(want) + 1}: expected none more, got {got[len(want)]}"
    if len(got) < len(want):
        return f"event #{len(got) + 1}: expected {want[len(got)]}, got none"
    return "none"


def expect_exactly_once(result: Run, blocks: Sequence[Block], why: str, outcome: str = END) -> None:
    """The caller got every event of ``blocks`` once, in order, then ``outcome``."""
    __tracebackhide__ = True
    want = events_of(blocks)
    check(
        result.events == want,
        f"exactly-once: {why}: the caller must get every event once, in order "
        f"({len(want)} events), then {outcome}.\n  first difference: "
        f"{first_difference(want, result.events)}\n{result.summary()}",
    )
    check(
        result.outcome == outcome,
        f"{why}: the stream must end with {outcome}.\n{result.summary()}",
    )


def expect_resumes(result: Run, blocks: Sequence[Block], actions: Sequence[str]) -> None:
    """Each request's Last-Event-ID is the ID of the last event delivered before it."""
    __tracebackhide__ = True
    want = resumes(blocks, actions)
    got = [r.last_event_id for r in result.requests]
    i = next(
        (i for i, (w, g) in enumerate(zip(want, got, strict=False)) if w != g),
        min(len(want), len(got)),
    )
    expected = "the end (the 204 came before)" if i >= len(want) else _header(want[i])
    sent = "no request" if i >= len(got) else _header(got[i])
    check(
        got == want,
        f"last-event-id: request #{i + 1} must carry {expected} — the ID of the last "
        f"event delivered before it — but it carried {sent}.\n{result.summary()}",
    )


def _header(value: str | None) -> str:
    return "no Last-Event-ID header" if value is None else f"Last-Event-ID {value!r}"


@dataclass(frozen=True)
class Floor:
    """A wait a ``Retry-After`` sets: exactly ``seconds`` (longer than the time drawn)."""

    seconds: int


def expect_waits(result: Run, ds_ms: Sequence[int | Floor], why: str) -> None:
    """One wait a reconnection, each drawn from [d/2, d] ms for its ``d`` in ``ds_ms`` —
    or, for a :class:`Floor`, exactly its seconds."""
    __tracebackhide__ = True
    got = result.sleeps_ns
    shown = ", ".join(f"{ns / NS_PER_MS:g}" for ns in got)
    check(
        len(got) == len(ds_ms),
        f"backoff: {why}: {len(ds_ms)} reconnections, so {len(ds_ms)} waits on the "
        f"injected clock; got {len(got)}: [{shown}] ms\n{result.summary()}",
    )
    for n, (ns, d) in enumerate(zip(got, ds_ms, strict=True)):
        if isinstance(d, Floor):
            check(
                ns == d.seconds * NS_PER_S,
                f"backoff: {why}: wait #{n + 1} follows a Retry-After: {d.seconds}: it must "
                f"be exactly {d.seconds * 1000} ms (the time drawn is shorter), got "
                f"{ns / NS_PER_MS:g} ms. All waits: [{shown}] ms\n{result.summary()}",
            )
            continue
        check(
            d * NS_PER_MS // 2 <= ns <= d * NS_PER_MS,
            f"backoff: {why}: wait #{n + 1} must be drawn from [{d / 2:g}, {d}] ms "
            f"(d = {d} ms), got {ns / NS_PER_MS:g} ms. All waits: [{shown}] ms\n"
            f"{result.summary()}",
        )


__all__ = [
    "CLIENT_TIMEOUT",
    "Floor",
    "Reader",
    "Run",
    "consume",
    "expect_exactly_once",
    "expect_resumes",
    "expect_waits",
    "first_difference",
    "held_mid_stream",
    "new_source",
    "next_outcome",
    "reading",
    "run",
]
