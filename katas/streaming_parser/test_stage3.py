"""Stage 3: one stream resumed across replicas — exactly once and in order, Last-Event-ID,
failover, backoff, the answers that stop it (see katas/streaming_parser/README.md,
"Stage 3").

How these tests stay deterministic with real servers: the replicas
(:mod:`katas.streaming_parser._testing.replicas`) are real HTTP/1.1 servers on loopback,
each in its own process, but what each connection gets is written down before the test
starts — "the 1st connection is reset after 40 bytes of body, the 2nd gets a 503" —
in the order connections arrive at any replica, and each replica prints what every
request carried. A cut lands on the byte the test chose, and the test knows which
event it split. Kills and stalls are real signals, sent when the replica says it has
sent the bytes the test waited for. The client's waits are on a clock that jumps (a
backoff takes no real time, and the test reads every wait the client chose); only an
idle timeout is real time, a fraction of a second. Every test runs on asyncio and trio.

Map (rules in brackets): exactly once, in order [exactly-once, reconnect] ·
Last-Event-ID [last-event-id] · failover [failover] · stop and fatal answers [stop,
fatal] · backoff and giving up, extended [backoff, give-up] · idle timeouts, extended
[stalled-connection] · ``aclose()``, extended [aclose] · bad arguments, extended
[stage3-bad-arguments].

The drivers are in ``_testing/``: :mod:`~katas.streaming_parser._testing.resumable` (a
source read to its end — ``run`` — or by a task, and the verdicts: exactly once, the
resumes, the waits) and :mod:`~katas.streaming_parser._testing.schedules` (cuts at
chosen bytes, random fault schedules).
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import anyio
import httpx
import pytest
from hypothesis import given, settings

from katas._harness.faultproxy import FaultProxy
from katas._harness.marks import core, extended, processes, rule
from katas._harness.profiles import heavy_examples
from katas._harness.story import check
from katas._harness.waiting import bounded, eventually_async
from katas._registry import impl
from katas._runtime.clock import NS_PER_MS, NS_PER_S
from katas.streaming_parser._testing.mux import END, settle
from katas.streaming_parser._testing.replica import Block
from katas.streaming_parser._testing.replicas import (
    BLOCKS,
    ENDS,
    IDLE_S,
    JumpingClock,
    ReplicaSet,
    body_offsets,
    events_of,
    module_replicas,
    show_requests,
    stream_wire,
    token_blocks,
)
from katas.streaming_parser._testing.resumable import (
    CLIENT_TIMEOUT,
    Floor,
    Reader,
    Run,
    expect_exactly_once,
    expect_resumes,
    expect_waits,
    held_mid_stream,
    new_source,
    next_outcome,
    run,
)
from katas.streaming_parser._testing.schedules import Schedule, awkward, cuts_at, schedules
from katas.streaming_parser.api import EventSourceError, ParseError

pytestmark = [pytest.mark.stage(3), pytest.mark.anyio]


@pytest.fixture(scope="module")
def replicas(
    impl_selection: impl.Selection, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ReplicaSet]:
    """Three replicas, a, b and c, for every test of the module (each test resets them)."""
    yield from module_replicas(impl_selection, tmp_path_factory)


# --- exactly once, in order ----------------------------------------------------------------


@core
@rule("exactly-once", "stop", "last-event-id")
@processes
async def test_stage3_a_whole_stream_is_delivered_and_the_204_after_it_stops(
    replicas: ReplicaSet,
) -> None:
    result = await run(replicas, BLOCKS)
    expect_exactly_once(result, BLOCKS, "one connection served the whole stream")
    check(
        [(r.replica, r.last_event_id) for r in result.requests] == [("a", None), ("b", "8")],
        "stop: the response ended after event 8, so the source reconnects with "
        "Last-Event-ID '8' to the next replica, which answers 204 — and that is the end: "
        f"two requests.\n{result.summary()}",
    )


@core
@rule("exactly-once", "reconnect", "last-event-id")
@processes
async def test_stage3_a_reset_anywhere_in_an_event_loses_and_repeats_nothing(
    replicas: ReplicaSet,
) -> None:
    actions = cuts_at(BLOCKS, awkward(BLOCKS))
    result = await run(replicas, BLOCKS, actions)
    expect_exactly_once(
        result,
        BLOCKS,
        "each connection was reset at an awkward byte (inside an id: line, "
        "between a CR and its LF, at an event's end)",
    )
    expect_resumes(result, BLOCKS, actions)


@core
@rule("exactly-once", "reconnect")
@processes
async def test_stage3_a_response_that_ends_inside_an_event_does_not_deliver_it(
    replicas: ReplicaSet,
) -> None:
    actions = cuts_at(BLOCKS, awkward(BLOCKS), kind="end")
    result = await run(replicas, BLOCKS, actions)
    expect_exactly_once(
        result,
        BLOCKS,
        "each response ended cleanly in the middle of an event: the "
        "unterminated event is discarded (stage 1's close()), and comes again whole",
    )
    expect_resumes(result, BLOCKS, actions)


@core
@rule("exactly-once", "reconnect", "last-event-id")
@settings(max_examples=heavy_examples())
@given(case=schedules())
@processes
async def test_stage3_any_schedule_of_faults_delivers_every_event_once(
    replicas: ReplicaSet, case: Schedule
) -> None:
    blocks, actions = case
    result = await run(replicas, blocks, actions)
    expect_exactly_once(result, blocks, f"the connections got {actions or 'no fault'}")
    expect_resumes(result, blocks, actions)


@core
@rule("exactly-once", "reconnect")
@processes
async def test_stage3_a_cut_at_an_exact_byte_of_the_wire_through_a_proxy(
    replicas: ReplicaSet,
) -> None:
    wire, ends = stream_wire(BLOCKS)
    head = wire.index(b"\r\n\r\n") + 4
    inside_third = ends[2] - len(BLOCKS[2].raw) // 2
    places = {
        "inside the response head": head // 2,
        "right after the head": head,
        "inside the second event's chunk-size line": ends[0] + 3,
        "inside the third event": inside_third,
        "at the fourth event's last byte": ends[3] - 1,
    }
    with FaultProxy(("127.0.0.1", replicas.ports["a"])) as proxy:
        for place, nbytes in places.items():
            replicas.reset(BLOCKS)
            proxy.truncate_next_reply(nbytes)
            urls = [replicas.url("a", port=proxy.port), replicas.url("b")]
            result = await run(replicas, BLOCKS, urls=urls, reset=False)
            expect_exactly_once(
                result,
                BLOCKS,
                f"a proxy cut the first connection {place} (after {nbytes} bytes of the reply)",
            )


# --- Last-Event-ID ---------------------------------------------------------------------------


@core
@rule("last-event-id")
@processes
async def test_stage3_every_request_asks_for_an_event_stream_and_no_empty_id_is_sent(
    replicas: ReplicaSet,
) -> None:
    actions = ["cut:5", "status:503", "end:3", f"cut:{ENDS[0] + 4}"]
    result = await run(replicas, BLOCKS, actions)
    expect_exactly_once(result, BLOCKS, f"the connections got {actions}")
    for request in result.requests:
        check(
            (request.accept, request.cache_control) == ("text/event-stream", "no-cache"),
            f"last-event-id: every request sends Accept: text/event-stream and "
            f"Cache-Control: no-cache; request #{request.seq + 1} sent Accept "
            f"{request.accept!r}, Cache-Control {request.cache_control!r}",
        )
    sent = [r.last_event_id for r in result.requests]
    check(
        sent[:4] == [None, None, None, None] and sent[4] == "1",
        "last-event-id: no event was delivered before the 4th request, so requests 1-4 "
        "send no Last-Event-ID header at all (an empty one is not the same); the 5th "
        f"resumes after event '1'. Sent: {sent}\n{result.summary()}",
    )


@core
@rule("last-event-id")
@processes
async def test_stage3_the_id_sent_is_the_last_delivered_events_not_a_cut_ones(
    replicas: ReplicaSet,
) -> None:
    third = ENDS[1]
    after_id = third + BLOCKS[2].raw.index(b"id: 3") + len("id: 3") + 1
    result = await run(replicas, BLOCKS, [f"cut:{after_id}"])
    check(
        result.requests[1:2] and result.requests[1].last_event_id == "2",
        "last-event-id: the cut came right after the `id: 3` line of event 3, whose blank "
        "line never arrived: the last event delivered is '2', and that is what the "
        "reconnection sends (an ID takes effect when its event is dispatched).\n"
        + result.summary(),
    )
    expect_exactly_once(result, BLOCKS, "a cut just after an id: line")


@core
@rule("last-event-id")
@processes
async def test_stage3_the_last_event_id_outlives_its_connection(replicas: ReplicaSet) -> None:
    blocks = [
        Block(b"id: 1\ndata: a\n\n", "1"),
        Block(b"data: b, no id of its own\n\n", "1"),
        Block(b"id: 3\ndata: c\n\n", "3"),
    ]
    result = await run(replicas, blocks, [f"end:{len(blocks[0].raw)}"])
    expect_exactly_once(result, blocks, "the first response ended after event '1'")
    check(
        result.events[1].id == "1",
        "last-event-id: event b has no id: line and came on the second connection; the "
        "ID before the reconnect is still the stream's, so b's id is '1', got "
        f"{result.events[1].id!r} (one stage-1 parser for the whole stream)",
    )


@core
@rule("last-event-id")
@pytest.mark.parametrize(
    "clearing",
    [b"id:\ndata: b\n\n", b"id\n\n"],
    ids=["an-event-with-an-empty-id", "a-block-of-only-id"],
)
@processes
async def test_stage3_an_id_the_server_cleared_is_not_sent(
    replicas: ReplicaSet, clearing: bytes
) -> None:
    blocks = [
        Block(b"id: 1\ndata: a\n\n", "1"),
        Block(clearing, ""),
        Block(b"id: 3\ndata: c\n\n", "3"),
    ]
    # The 1st response ends after event a: the 2nd request sends Last-Event-ID '1'. The
    # 2nd response clears the ID, then ends: the 3rd request must send none.
    actions = [f"end:{len(blocks[0].raw)}", f"end:{len(blocks[1].raw)}"]
    result = await run(replicas, blocks, actions)
    # With no ID to resume from, the server starts the stream over: that is the protocol.
    expect_resumes(result, blocks, actions)
    check(
        result.events == events_of(blocks[:2]) + events_of(blocks) and result.outcome == END,
        f"last-event-id: the 2nd request resumed from ID '1'; its response cleared the ID "
        f"({clearing!r}) and ended: the 3rd request sends no Last-Event-ID (not the '1' "
        f"sent before), and the server sends the stream again from its start\n"
        f"{result.summary()}",
    )


# --- failover ----------------------------------------------------------------------------------


@core
@rule("failover", "reconnect")
@processes
async def test_stage3_each_attempt_goes_to_the_next_replica_cycling(replicas: ReplicaSet) -> None:
    actions = ["status:503", "refuse", "status:500", "cut:30", "status:429", "end:70"]
    result = await run(replicas, BLOCKS, actions)
    expect_exactly_once(result, BLOCKS, f"the connections got {actions}")
    got = [r.replica for r in result.requests]
    check(
        got == ["a", "b", "c", "a", "b", "c", "a", "b"][: len(got)] and len(got) == 8,
        "failover: the first request goes to urls[0], each reconnection to the next URL, "
        f"cycling: a, b, c, a, b, c, a, b; got {got}\n{result.summary()}",
    )


@core
@rule("failover")
@processes
async def test_stage3_a_replica_that_is_down_costs_one_attempt(replicas: ReplicaSet) -> None:
    middle = ENDS[0] + 5
    replicas.reset(BLOCKS, [f"cut:{middle}"])
    replicas.kill("b")
    result = await run(replicas, BLOCKS, reset=False, what="failover past a dead replica")
    expect_exactly_once(result, BLOCKS, "replica b was down (killed)")
    got = [r.replica for r in result.requests]
    check(
        got == ["a", "c", "a"],
        "failover: a cut → b (down: refused, one attempt) → c, which serves the rest → a, "
        f"which answers 204; the replicas that answered must be a, c, a, got {got}\n"
        f"{result.summary()}",
    )
    check(
        len(result.sleeps_ns) == 3,
        f"backoff: three reconnections, three waits; the client waited {len(result.sleeps_ns)} "
        "times",
    )


@core
@rule("failover", "exactly-once")
@processes
async def test_stage3_a_replica_killed_mid_event_is_failed_over_exactly_once(
    replicas: ReplicaSet,
) -> None:
    inside_fourth = ENDS[2] + 4
    async with held_mid_stream(replicas, BLOCKS, inside_fourth, 3) as reader:
        replicas.kill("a")  # SIGKILL, with 4 bytes of event 4 on the wire
        await reader.finished("the source to fail over and finish the stream")
    result = reader.result(replicas)
    expect_exactly_once(result, BLOCKS, "replica a was SIGKILLed 4 bytes into event 4")
    check(
        (result.requests[1].replica, result.requests[1].last_event_id) == ("b", "3"),
        "failover: after a's death the source goes to b and resumes after event '3'\n"
        f"{result.summary()}",
    )


@core
@rule("exactly-once", "reconnect")
@processes
async def test_stage3_a_replica_restarted_is_resumed_from(replicas: ReplicaSet) -> None:
    clock = JumpingClock(jumping=False)
    inside_second = ENDS[0] + 3
    async with held_mid_stream(
        replicas, BLOCKS, inside_second, 1, names=["a"], clock=clock
    ) as reader:
        replicas.kill("a")
        await eventually_async(lambda: clock.sleepers() == 1, "the source to back off")
        clock.advance(clock.sleeps_ns[-1])  # its attempt finds a down
        await eventually_async(
            lambda: len(clock.sleeps_ns) == 2 and clock.sleepers() == 1,
            "a refused attempt, then a second backoff",
        )
        replicas.restart("a")
        clock.jumping = True
        clock.advance(clock.sleeps_ns[-1])
        await reader.finished("the source to resume from the restarted replica")
    result = reader.result(replicas, clock.sleeps_ns)
    expect_exactly_once(result, BLOCKS, "replica a was killed, then restarted on its port")
    check(
        [r.last_event_id for r in result.requests][:2] == [None, "1"],
        "reconnect: the first request sends no Last-Event-ID, the one after event 1 sends "
        f"'1'\n{result.summary()}",
    )


# --- stop and fatal answers -------------------------------------------------------------------


@core
@rule("stop")
@processes
async def test_stage3_204_ends_the_stream_and_nothing_more_is_requested(
    replicas: ReplicaSet,
) -> None:
    two = ENDS[1]
    result = await run(replicas, BLOCKS, [f"end:{two}", "status:204"])
    ok = (result.events, result.outcome) == (events_of(BLOCKS[:2]), END)
    check(
        ok and len(result.requests) == 2 and result.again == END,
        "stop: events 1 and 2, then a 204: the iteration ends there (and a later "
        "__anext__ ends it again), and nothing more is requested (a 204 is not retried); "
        f"one more __anext__ gave {result.again}\n{result.summary()}",
    )


@core
@rule("fatal")
@pytest.mark.parametrize("status", [301, 307, 400, 401, 404, 428, 430, 499])
@processes
async def test_stage3_a_status_no_retry_changes_is_fatal(replicas: ReplicaSet, status: int) -> None:
    result = await run(replicas, BLOCKS, [f"status:{status}"])
    err = result.outcome
    check(
        isinstance(err, EventSourceError) and err.status == status,
        f"fatal: a {status} is raised as EventSourceError(status={status}), got "
        f"{err!r}\n{result.summary()}",
    )
    check(len(result.requests) == 1, f"fatal: a {status} is not retried\n{result.summary()}")
    assert isinstance(err, EventSourceError)  # for the type checker: checked above
    check(err.url == replicas.url("a"), f"EventSourceError.url must be {replicas.url('a')!r}")


@core
@rule("reconnect")
@pytest.mark.parametrize("status", [429, 500, 503, 599])
@processes
async def test_stage3_a_5xx_or_429_is_retried(replicas: ReplicaSet, status: int) -> None:
    result = await run(replicas, BLOCKS, [f"status:{status}"])
    expect_exactly_once(result, BLOCKS, f"the first answer was a {status}, then the stream")


@core
@rule("fatal")
@pytest.mark.parametrize(
    ("content_type", "fatal"),
    [
        pytest.param("text/plain", True, id="text-plain"),
        pytest.param("application/json", True, id="json"),
        pytest.param("text/event-streams", True, id="event-streams"),
        pytest.param("none", True, id="no-content-type"),
        pytest.param("Text/Event-Stream; charset=utf-8", False, id="event-stream-with-charset"),
        # whitespace may stand before the ';' of the parameters (OWS), a space or a tab
        pytest.param("text/event-stream ; charset=utf-8", False, id="space-before-parameters"),
        pytest.param("text/event-stream\t;charset=utf-8", False, id="tab-before-parameters"),
        pytest.param("TEXT/EVENT-STREAM", False, id="upper-case"),
    ],
)
@processes
async def test_stage3_only_a_200_event_stream_is_read(
    replicas: ReplicaSet, content_type: str, fatal: bool
) -> None:
    result = await run(replicas, BLOCKS, [f"type:{content_type}"])
    if not fatal:
        expect_exactly_once(result, BLOCKS, f"Content-Type {content_type!r} is an event stream")
        return
    err = result.outcome
    check(
        isinstance(err, EventSourceError) and err.status == 200 and not result.events,
        f"fatal: a 200 with Content-Type {content_type!r} (none: no such header) is not an "
        f"event stream: EventSourceError(status=200) and no event, got {err!r}\n"
        f"{result.summary()}",
    )
    check(len(result.requests) == 1, f"fatal: it is not retried\n{result.summary()}")


@core
@rule("fatal")
@processes
async def test_stage3_events_before_a_fatal_answer_are_kept_and_then_it_is_over(
    replicas: ReplicaSet,
) -> None:
    two = ENDS[1]
    result = await run(replicas, BLOCKS, [f"end:{two}", "status:404"])
    events, outcome = result.events, result.outcome
    check(
        events == events_of(BLOCKS[:2]) and isinstance(outcome, EventSourceError),
        f"fatal: events 1 and 2, then EventSourceError for the 404; got {events} then {outcome!r}",
    )
    check(
        result.again == END,
        f"fatal: after an error the source is over: the next __anext__ raises "
        f"StopAsyncIteration, got {result.again}",
    )
    check(
        len(result.requests) == 2,
        f"fatal: two requests, the second answered 404, none after it\n{result.summary()}",
    )


@extended
@rule("fatal")
@processes
async def test_stage3_a_parse_error_is_raised_after_the_events_before_it(
    replicas: ReplicaSet,
) -> None:
    blocks = [*BLOCKS[:2], Block(b"id: 3\ndata: " + b"x" * 100 + b"\n\n", "3"), *BLOCKS[3:]]
    result = await run(replicas, blocks, max_line_bytes=64)
    check(
        result.events == events_of(blocks[:2]) and isinstance(result.outcome, ParseError),
        "fatal: event 3's line is over max_line_bytes=64: events 1 and 2, then the "
        f"ParseError (a server that sends it once sends it again: no retry)\n{result.summary()}",
    )
    check(len(result.requests) == 1, f"fatal: a ParseError is not retried\n{result.summary()}")


@extended
@rule("fatal")
@processes
async def test_stage3_a_parse_error_comes_after_the_events_of_its_own_chunk(
    replicas: ReplicaSet,
) -> None:
    bad = Block(b"id: 4\ndata: " + b"x" * 100 + b"\n\n", "4")
    blocks = [*BLOCKS[:3], bad, *BLOCKS[4:]]
    ends = body_offsets(blocks)
    # The first response: event 1, then a clean end. The second: events 2 and 3 and the
    # line over the limit in one chunk (one write of the replica): the ParseError's own.
    actions = [f"end:{ends[0]}", f"end:{ends[3] - ends[0]}"]
    result = await run(replicas, blocks, actions, max_line_bytes=64)
    check(
        result.events == events_of(blocks[:3]) and isinstance(result.outcome, ParseError),
        "fatal: the second response sent events 2 and 3 and then a line over "
        "max_line_bytes=64, all in one chunk: the caller gets events 1, 2 and 3 — those "
        "completed before the error, in its chunk too — then the ParseError"
        f"\n{result.summary()}",
    )
    check(len(result.requests) == 2, f"fatal: a ParseError is not retried\n{result.summary()}")


# --- backoff and giving up ---------------------------------------------------------------------


@extended
@rule("backoff")
@processes
async def test_stage3_waits_double_from_retry_up_to_the_cap_and_reset_after_an_event(
    replicas: ReplicaSet,
) -> None:
    actions = ["status:503"] * 5
    result = await run(replicas, BLOCKS, actions, retry_ms=100, max_backoff_ms=700)
    expect_exactly_once(result, BLOCKS, "five 503s, then the stream")
    expect_waits(
        result,
        [100, 200, 400, 700, 700, 100],
        "retry_ms=100, max_backoff_ms=700: five failures in a row wait d = 100, 200, 400, "
        "then the cap (800 > 700), 700; the stream then delivered events, so the "
        "reconnection after it waits d = 100 again",
    )


@extended
@rule("backoff")
@processes
async def test_stage3_the_servers_retry_sets_the_base_and_outlives_its_connection(
    replicas: ReplicaSet,
) -> None:
    blocks = token_blocks(6, retry_ms=250)
    two = body_offsets(blocks)[1]
    result = await run(replicas, blocks, [f"end:{two}", "status:503", "status:503"])
    expect_exactly_once(result, blocks, "events 1-2, two 503s, the rest")
    expect_waits(
        result,
        [250, 250, 500, 250],
        "event 1 set `retry: 250`, so d = 250 (not retry_ms=1000), on every later "
        "connection too: after events 1-2, after a 503, after a second 503 (500), and "
        "after the rest",
    )


@extended
@rule("backoff")
@processes
async def test_stage3_waits_are_jittered_with_the_injected_random(replicas: ReplicaSet) -> None:
    actions = ["status:503"] * 6

    async def jittered(seed: int) -> Run:
        return await run(
            replicas,
            BLOCKS,
            actions,
            random=random.Random(seed),
            retry_ms=1000,
            max_backoff_ms=1000,
        )

    first = await jittered(1)
    expect_waits(first, [1000] * 7, "d is capped at 1000 ms for every wait")
    check(
        len(set(first.sleeps_ns)) > 1,
        f"backoff: seven waits of d = 1000 ms, all {first.sleeps_ns[0] / NS_PER_MS:g} ms: "
        "a wait is drawn from [d/2, d], so that clients cut by one failure spread out",
    )
    again = await jittered(1)
    other = await jittered(2)
    check(
        again.sleeps_ns == first.sleeps_ns and other.sleeps_ns != first.sleeps_ns,
        "backoff: the jitter comes from the injected random: the same seed must give the "
        f"same waits, another seed others.\n  seed 1: {first.sleeps_ns}\n  seed 1 again: "
        f"{again.sleeps_ns}\n  seed 2: {other.sleeps_ns}",
    )


@extended
@rule("backoff")
@processes
async def test_stage3_retry_after_of_a_429_or_503_is_a_floor(replicas: ReplicaSet) -> None:
    actions = ["status:503:7", "status:429:3", "status:503:0"]
    result = await run(replicas, BLOCKS, actions, retry_ms=100)
    expect_exactly_once(result, BLOCKS, f"the connections got {actions}")
    waits = result.sleeps_ns
    check(
        waits[:2] == [7 * NS_PER_S, 3 * NS_PER_S],
        "backoff: a 503 with Retry-After: 7 waits at least 7 s, a 429 with Retry-After: 3 "
        "at least 3 s (the backoff itself, d = 100 and 200 ms, is shorter); got "
        f"{[w / NS_PER_MS for w in waits[:2]]} ms\n{result.summary()}",
    )
    check(
        200 * NS_PER_MS <= waits[2] <= 400 * NS_PER_MS,
        "backoff: Retry-After: 0 sets no floor: the third wait is the backoff, from "
        f"[200, 400] ms; got {waits[2] / NS_PER_MS:g} ms",
    )


@extended
@rule("backoff")
@processes
async def test_stage3_a_retry_after_shorter_than_the_draw_changes_no_wait(
    replicas: ReplicaSet,
) -> None:
    said = ["status:503:1", "status:429:1", "end:5"]
    silent = ["status:503:0", "status:429:0", "end:5"]
    results = [
        await run(replicas, BLOCKS, actions, random=random.Random(7), retry_ms=4000)
        for actions in (said, silent)
    ]
    for actions, result in zip((said, silent), results, strict=True):
        expect_exactly_once(result, BLOCKS, f"the connections got {actions}")
    check(
        results[0].sleeps_ns == results[1].sleeps_ns,
        "backoff: retry_ms=4000, so the waits after the 503 and the 429 are drawn from "
        "[2, 4] s and [4, 8] s; a Retry-After of 1 s is shorter: the wait is the larger, "
        "the draw — and the draw is made anyway, so every later wait is what the same "
        f"seed gives without Retry-After.\n  with Retry-After: 1  {results[0].sleeps_ns}"
        f"\n  with Retry-After: 0  {results[1].sleeps_ns}",
    )


@extended
@rule("backoff")
@processes
async def test_stage3_retry_after_sets_the_next_wait_only_even_past_the_cap(
    replicas: ReplicaSet,
) -> None:
    actions = ["status:503:30", "refuse", "status:429:5", "end:5"]
    result = await run(replicas, BLOCKS, actions, retry_ms=100, max_backoff_ms=1000)
    expect_exactly_once(result, BLOCKS, f"the connections got {actions}")
    expect_waits(
        result,
        [Floor(30), 200, Floor(5), 800, 100],
        "retry_ms=100, max_backoff_ms=1000: the wait after a 503 with Retry-After: 30 is "
        "30 s — Retry-After ranks above the cap — and it sets that one wait only: after "
        "the refused connection that follows, d = 200; after a 429 with Retry-After: 5, "
        "5 s; after the empty response, d = 800; after the stream, d = 100",
    )


@extended
@rule("backoff")
@processes
async def test_stage3_retry_after_on_another_status_is_ignored(replicas: ReplicaSet) -> None:
    actions = ["status:500:10", "status:502:10", "status:504:10", "status:599:10"]
    result = await run(replicas, BLOCKS, actions, retry_ms=100)
    expect_exactly_once(result, BLOCKS, f"the connections got {actions}")
    expect_waits(
        result,
        [100, 200, 400, 800, 100],
        "only a 429 or a 503 sets a floor: a 500, 502, 504 or 599 with Retry-After: 10 "
        "waits the backoff drawn from d = 100, 200, 400, 800 ms",
    )


@extended
@rule("backoff")
@pytest.mark.parametrize("retry", [250, 0])  # 0: reconnect at once, a value like any other
@processes
async def test_stage3_a_retry_in_an_event_cut_by_a_drop_sets_the_next_wait(
    replicas: ReplicaSet, retry: int
) -> None:
    blocks = [
        Block(b"id: 1\ndata: a\n\n", "1"),
        Block(b"id: 2\nretry: %d\ndata: b\n\n" % retry, "2"),
        Block(b"id: 3\ndata: c\n\n", "3"),
    ]
    cut = len(blocks[0].raw) + blocks[1].raw.index(b"data")
    result = await run(replicas, blocks, [f"cut:{cut}"])
    expect_exactly_once(result, blocks, "a reset after event 2's retry: line, before its data")
    expect_waits(
        result,
        [retry, retry],
        f"the connection was reset after event 2's `retry: {retry}` line but before its "
        f"blank line: retry is in force from its line on (stage 1's retry_ms), so the "
        f"reconnection waits d = {retry}, not retry_ms=1000 — and again after the stream",
    )


@extended
@rule("give-up")
@pytest.mark.parametrize(
    ("fault", "status"),
    [("status:503", 503), ("status:429", 429), ("refuse", None), ("cut:5", None), ("end:5", None)],
)
@processes
async def test_stage3_max_attempts_in_a_row_without_an_event_give_up(
    replicas: ReplicaSet, fault: str, status: int | None
) -> None:
    result = await run(replicas, BLOCKS, [fault] * 4, max_attempts=3)
    err = result.outcome
    check(
        isinstance(err, EventSourceError) and err.status == status,
        f"give-up: three attempts in a row delivered no event ({fault}): max_attempts=3 "
        f"raises EventSourceError(status={status}), got {err!r}\n{result.summary()}",
    )
    check(
        len(result.requests) == 3 and len(result.sleeps_ns) == 2,
        "give-up: exactly max_attempts=3 attempts, with a wait between them, and none "
        f"after the last (waits: {len(result.sleeps_ns)})\n{result.summary()}",
    )


@extended
@rule("give-up")
@processes
async def test_stage3_an_attempt_that_delivers_starts_the_count_again(
    replicas: ReplicaSet,
) -> None:
    one = ENDS[0]
    actions = ["status:503", "status:503", f"end:{one}", "status:503", "refuse"]
    result = await run(replicas, BLOCKS, actions, max_attempts=3)
    expect_exactly_once(
        result,
        BLOCKS,
        f"max_attempts=3 with {actions}: never 3 attempts in a row without "
        "an event (the third delivered event 1)",
    )


@extended
@rule("give-up", "backoff")
@pytest.mark.parametrize("fault", ["end:0", "cut:0", "end:5"])
@processes
async def test_stage3_each_response_after_a_delivering_one_counts_if_it_delivers_nothing(
    replicas: ReplicaSet, fault: str
) -> None:
    actions = [f"end:{ENDS[0]}", fault, fault, fault]
    result = await run(replicas, BLOCKS, actions, max_attempts=3)
    err = result.outcome
    check(
        result.events == events_of(BLOCKS[:1])
        and isinstance(err, EventSourceError)
        and err.status is None
        and len(result.requests) == 4,
        f"give-up: the 1st response delivered event 1; each of the next three answered 200 "
        f"and delivered nothing ({fault}): three attempts in a row without an event, so "
        f"max_attempts=3 gives up after the 4th request with EventSourceError(status=None) "
        f"— a 200 that ends or is cut is no error status\n{result.summary()}",
    )
    expect_waits(
        result,
        [1000, 1000, 2000],
        f"k counts each response that delivered no event ({fault}), whatever the one before "
        "it delivered: d = 1000 after event 1 (k = 1 at least), then 1000, 2000",
    )


@extended
@rule("give-up")
@pytest.mark.parametrize(
    ("actions", "replica", "status"),
    [
        pytest.param(["refuse", "refuse"], "b", None, id="never-connected"),
        pytest.param([f"end:{ENDS[0]}", "refuse", "refuse"], "c", None, id="refused"),
        pytest.param([f"end:{ENDS[0]}", "end:0", "refuse"], "c", None, id="empty-then-refused"),
        pytest.param([f"end:{ENDS[0]}", "refuse", "end:0"], "c", None, id="refused-then-empty"),
        pytest.param([f"end:{ENDS[0]}", "refuse", "status:502"], "c", 502, id="refused-then-502"),
    ],
)
@processes
async def test_stage3_giving_up_names_the_last_attempts_url_and_status(
    replicas: ReplicaSet, actions: list[str], replica: str, status: int | None
) -> None:
    result = await run(replicas, BLOCKS, actions, max_attempts=2)
    err = result.outcome
    got = (err.url, err.status) if isinstance(err, EventSourceError) else err
    check(
        got == (replicas.url(replica), status) and len(result.requests) == len(actions),
        f"give-up: with max_attempts=2 and {actions}, the last attempt went to replica "
        f"{replica}: EventSourceError's (url, status) must be that attempt's "
        f"({replicas.url(replica)!r}, {status}) — not the URL of a response read before; "
        f"got {got!r}\n{result.summary()}",
    )


# --- idle timeout ------------------------------------------------------------------------------


@extended
@rule("stalled-connection", "failover")
@processes
async def test_stage3_a_stalled_replica_is_left_after_the_idle_timeout(
    replicas: ReplicaSet,
) -> None:
    inside_third = ENDS[1] + 6
    async with held_mid_stream(replicas, BLOCKS, inside_third, 2, idle_timeout_s=IDLE_S) as reader:
        replicas.stop("a")  # SIGSTOP: the connection stays open, and silent
        await reader.finished(f"the idle timeout ({IDLE_S} s) to move the source to b", 10 * IDLE_S)
    result = reader.result(replicas)
    expect_exactly_once(result, BLOCKS, "replica a stalled (SIGSTOP) inside event 3")
    check(
        result.requests[1].replica == "b",
        f"failover: after replica a stalled, the next attempt goes to b\n{result.summary()}",
    )


@extended
@rule("stalled-connection")
@processes
async def test_stage3_a_response_that_never_sends_a_byte_is_dropped(replicas: ReplicaSet) -> None:
    with bounded(f"the idle timeout ({IDLE_S} s) to end the silent response", 10 * IDLE_S):
        result = await run(replicas, BLOCKS, ["silent"], idle_timeout_s=IDLE_S)
    expect_exactly_once(result, BLOCKS, "the first response sent its head, then nothing")


@extended
@rule("stalled-connection")
@processes
async def test_stage3_without_an_idle_timeout_the_clients_own_read_timeout_holds(
    replicas: ReplicaSet,
) -> None:
    own = httpx.Timeout(5.0, read=IDLE_S)
    with bounded(f"the client's own read timeout ({IDLE_S} s) to end the silence", 10 * IDLE_S):
        result = await run(replicas, BLOCKS, ["silent"], idle_timeout_s=None, client_timeout=own)
    expect_exactly_once(
        result,
        BLOCKS,
        f"idle_timeout_s=None over a client whose own read timeout is {IDLE_S} s; the first "
        "response sent its head, then nothing: None leaves the client's timeouts, so that "
        "response is dropped after the client's read timeout",
    )


@extended
@rule("stalled-connection")
@processes
async def test_stage3_bytes_that_keep_coming_slowly_keep_the_connection(
    replicas: ReplicaSet,
) -> None:
    blocks = token_blocks(5)
    result = await run(replicas, blocks, ["trickle:120"], idle_timeout_s=IDLE_S)
    expect_exactly_once(result, blocks, "an event every 0.12 s, idle_timeout_s=0.3")
    check(
        len(result.requests) == 2,
        "stalled-connection: the idle timeout is between bytes, not for the whole response: an "
        f"event every 0.12 s never idles 0.3 s, so one connection, then the 204\n"
        f"{result.summary()}",
    )


# --- aclose ------------------------------------------------------------------------------------


@extended
@rule("aclose")
@processes
async def test_stage3_aclose_while_reading_ends_the_iteration_at_once(
    replicas: ReplicaSet,
) -> None:
    inside_second = ENDS[0] + 3
    replicas.reset(BLOCKS, [f"hold:{inside_second}"])
    async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT) as client:
        source = new_source(client, replicas.urls)
        reader = Reader(source)
        async with anyio.create_task_group() as tg:
            tg.start_soon(reader.run)
            await eventually_async(lambda: replicas.held() == ["a"], "replica a to hold")
            await reader.delivered(1)
            with bounded("aclose() to return"):
                await source.aclose()
            await reader.finished("the waiting __anext__ to end at once after aclose()", 2.0)
    check(
        (reader.events, reader.outcome) == (events_of(BLOCKS[:1]), END),
        "aclose: aclose() while __anext__ waits for event 2's bytes: the iteration ends "
        f"(StopAsyncIteration) after event 1; got {reader.events} then {reader.outcome!r}",
    )
    await eventually_async(
        lambda: bool(replicas.processes["a"].lines(f"closed {replicas.generation} ")),
        "aclose: the replica to see its connection closed by aclose()",
    )
    await settle()
    check(len(replicas.requests()) == 1, f"aclose: nothing after aclose()\n{replicas.show()}")


@extended
@rule("aclose")
@processes
async def test_stage3_aclose_during_a_backoff_ends_at_once(replicas: ReplicaSet) -> None:
    clock = JumpingClock(jumping=False)
    replicas.reset(BLOCKS, ["status:503"])
    async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT) as client:
        source = new_source(client, replicas.urls, clock=clock)
        reader = Reader(source)
        async with anyio.create_task_group() as tg:
            tg.start_soon(reader.run)
            await eventually_async(lambda: clock.sleepers() == 1, "the source to back off")
            with bounded("aclose() to return"):
                await source.aclose()
            await reader.finished("the __anext__ waiting in its backoff to end at once", 2.0)
        clock.advance(60 * NS_PER_S)
        await settle()
    check(
        (reader.events, reader.outcome) == ([], END),
        f"aclose: the iteration ends at once, got {reader.events} then {reader.outcome!r}",
    )
    check(len(replicas.requests()) == 1, f"aclose: nothing after aclose()\n{replicas.show()}")


@extended
@rule("aclose")
@pytest.mark.parametrize("how", ["normally", "by-cancellation"])
@processes
async def test_stage3_leaving_the_block_closes_the_response(replicas: ReplicaSet, how: str) -> None:
    inside_second = ENDS[0] + 3
    replicas.reset(BLOCKS, [f"hold:{inside_second}"])
    async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT) as client:
        with bounded("leaving the source's block"), anyio.CancelScope() as scope:
            async with new_source(client, replicas.urls) as source:
                first = await source.__anext__()
                await eventually_async(lambda: replicas.held() == ["a"], "replica a to hold")
                if how == "by-cancellation":  # the task in the block is cancelled mid-read
                    scope.cancel()
                    await source.__anext__()
        assert first == events_of(BLOCKS)[0]
        await eventually_async(
            lambda: bool(replicas.processes["a"].lines(f"closed {replicas.generation} ")),
            f"aclose: the replica to see its connection closed when the block was left {how} "
            "(closing the response is shielded from the cancellation that left it)",
        )


@extended
@rule("aclose")
@pytest.mark.parametrize(
    "when", ["before-any-anext", "after-an-event", "with-an-event-queued", "by-leaving-the-block"]
)
@processes
async def test_stage3_after_aclose_every_anext_ends_and_nothing_is_requested(
    replicas: ReplicaSet, when: str
) -> None:
    # with-an-event-queued: events 1 and 2 come in one send, then the replica holds; the
    # first __anext__ returns event 1, and event 2 waits in the source.
    replicas.reset(BLOCKS, [f"hold:{ENDS[1]}"] if when == "with-an-event-queued" else [])
    got = []
    async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT) as client:
        source = new_source(client, replicas.urls)
        with bounded(f"aclose() {when}, then three __anext__ calls"):
            if when == "by-leaving-the-block":
                async with source:
                    got.append(await source.__anext__())
            else:
                if when != "before-any-anext":
                    got.append(await source.__anext__())
                await source.aclose()
            after = [await next_outcome(source) for _ in range(3)]
        await settle()
    requests = replicas.requests()
    check(
        got == events_of(BLOCKS)[: len(got)] and after == [END] * 3,
        f"aclose: after aclose() ({when}), every __anext__ raises StopAsyncIteration at "
        f"once (what was buffered is dropped); got {after}",
    )
    check(
        len(requests) == len(got),
        f"aclose: nothing is requested after aclose() ({when}): {len(got)} request(s) "
        f"expected\n{show_requests(requests)}",
    )


# --- bad arguments -----------------------------------------------------------------------------


@extended
@rule("stage3-bad-arguments")
@pytest.mark.parametrize(
    ("name", "value", "urls"),
    [
        ("urls", None, []),
        ("urls", None, "http://127.0.0.1:1/stream"),
        ("urls", None, [""]),
        ("urls", None, [1]),
        ("urls", None, {"http://127.0.0.1:1/stream"}),  # a set: no order to fail over in
        ("retry_ms", 0, None),
        ("retry_ms", 1.5, None),
        ("retry_ms", True, None),  # a bool is no int of milliseconds
        ("retry_ms", "1000", None),
        ("max_backoff_ms", 0, None),
        ("max_backoff_ms", 1.5, None),
        ("max_backoff_ms", True, None),
        ("max_attempts", 0, None),
        ("max_attempts", 2.0, None),
        ("max_attempts", True, None),
        ("idle_timeout_s", 0, None),
        ("idle_timeout_s", -1.0, None),
        ("idle_timeout_s", "1", None),
        ("idle_timeout_s", True, None),  # a bool is no number of seconds
        ("idle_timeout_s", float("nan"), None),  # NaN is not > 0, though not <= 0 either
        ("idle_timeout_s", -0.0, None),
    ],
)
@processes
async def test_stage3_bad_arguments_are_refused_by_name(
    replicas: ReplicaSet, name: str, value: object, urls: object
) -> None:
    replicas.reset(BLOCKS)
    options = {} if name == "urls" else {name: value}
    shown = urls if name == "urls" else value
    bad_urls = replicas.urls if urls is None else urls
    async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT) as client:
        try:
            accepted = new_source(client, bad_urls, **options)  # type: ignore[arg-type]
        except (ValueError, TypeError) as error:
            refused: Exception = error
        else:
            await accepted.aclose()
            raise AssertionError(
                f"stage3-bad-arguments: ResumableEventSource(..., {name}={shown!r}) must "
                f"raise ValueError or TypeError naming {name!r} in the constructor; it was "
                "accepted"
            )
    check(
        name in str(refused),
        f"stage3-bad-arguments: {name}={shown!r} must be refused with a message naming "
        f"{name!r}, got {refused!r}",
    )


@extended
@rule("stage3-bad-arguments")
@processes
async def test_stage3_nothing_is_requested_before_the_first_anext(replicas: ReplicaSet) -> None:
    replicas.reset(BLOCKS)
    async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT) as client:
        source = new_source(client, replicas.urls)
        await settle()
        check(replicas.requests() == [], "the constructor must not connect")
        check(
            (source.last_event_id, source.retry_ms) == ("", 1000),
            "before any event: last_event_id '' and retry_ms the constructor's 1000, got "
            f"{(source.last_event_id, source.retry_ms)}",
        )
        await source.aclose()
        for seconds in (2, 0.25, None):  # seconds > 0, an int or a float, or None
            try:
                other = new_source(client, replicas.urls, idle_timeout_s=seconds)
            except (TypeError, ValueError) as error:
                raise AssertionError(
                    f"idle_timeout_s={seconds!r} is a valid timeout (None, or seconds > 0), "
                    f"refused with {error!r}"
                ) from None
            await other.aclose()
        try:
            entered = new_source(client, tuple(replicas.urls))
        except (TypeError, ValueError) as error:
            raise AssertionError(
                f"urls as a tuple is a sequence of non-empty strings, refused with {error!r}"
            ) from None
        async with entered:
            await settle()
            check(
                replicas.requests() == [],
                "entering the source's `async with` must not connect either: nothing is "
                f"requested before the first __anext__; requested {replicas.requests()}",
            )
