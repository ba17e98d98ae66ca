"""Stage 2: the streaming engine (see katas/dynamic_batcher/README.md, "Stage 2").

One loop in simulated time, streams that merge what a slow reader has not taken,
readers that leave or stall, bounded admission, drain and close, statistics. Time is a
``ManualClock`` moved by the test's :class:`~katas._harness.virtual_time.VirtualTime`,
only when every task waits; steps take a fixed simulated time (1 µs) unless a test says
otherwise, so the instant of every step's start and end is known; readers take
deliveries at instants the test chooses, never at an instant a step ends. The model is
the harness's ``FakeModel``: every stream is compared with what its request generates
alone. Every async test runs on asyncio and on trio.

The stage's other suites: ``test_stage2_batches.py`` (the request batcher,
``-k batches``) and ``test_stage2_prefix.py`` (automatic prefix caching, ``-k prefix``).

Map: the loop (engine-loop, engine-arrival) · streams (stream, no-stall) · readers that
leave (reader-leaves) · a thousand clients · overload (overload) · stalls (stall) ·
deadlines (engine-deadline) · drain and close (drain, aclose) · statistics
(engine-statistics) · bad input (stage2-bad-input).
"""

from __future__ import annotations

import math
import random
import sys
from collections.abc import Sequence
from typing import cast

import anyio
import pytest

from katas._harness.marks import core, extended, rule
from katas._harness.story import Story, check
from katas._runtime.clock import NS_PER_S
from katas.dynamic_batcher._testing.edges import SleepOnlyClock
from katas.dynamic_batcher._testing.engine import (
    STEP_NS,
    T0,
    Reader,
    ReadOnlyClock,
    Rig,
    admission,
    expect_ending,
    request,
    show,
)
from katas.dynamic_batcher._testing.model import step_time_ns
from katas.dynamic_batcher.api import (
    Delivery,
    EngineClosed,
    Overloaded,
    ReaderStalled,
    Request,
    RequestRejected,
    StepOutput,
    TokenStream,
)

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

pytestmark = [pytest.mark.stage(2), pytest.mark.anyio]

#: Long enough for any test's requests to finish, in simulated ns.
WITHIN = 10_000 * STEP_NS


def _ended(readers: dict[str, Reader]) -> bool:
    return all(r.ended != "reading" for r in readers.values())


async def take(stream: TokenStream, what: str) -> Delivery:
    """The stream's next delivery; anything else it raises fails the test, saying so."""
    try:
        delivery: Delivery = await stream.__anext__()
    except (ReaderStalled, StopAsyncIteration, EngineClosed) as e:
        raise AssertionError(f"{what}: expected a delivery, the read raised {e!r}") from e
    return delivery


def tokens_of(deliveries: list[tuple[int, Delivery]]) -> tuple[int, ...]:
    return tuple(t for _, d in deliveries for t in d.tokens)


# -- the loop -------------------------------------------------------------------------


@core
@rule("engine-loop", "stream")
async def test_stage2_each_stream_gets_what_its_request_generates_alone() -> None:
    rig = Rig()
    requests = [request("a", 3, 5), request("b", 9, 7), request("c", 1, 4, stop_tokens={5})]
    expected = rig.expected(requests)
    async with rig.engine, anyio.create_task_group() as tg:
        readers = {r.rid: Reader(rig.engine.generate(r), rig.clock) for r in requests}
        for reader in readers.values():
            tg.start_soon(reader.run)
        await rig.time.run_until(
            lambda: _ended(readers), within_ns=WITHIN, what="every stream to end"
        )
    for rid, reader in readers.items():
        assert reader.error is None, f"{rid}: the stream raised {reader.ended}"
        assert reader.tokens == expected[rid], (
            f"request {rid}: the stream must carry exactly what the request generates "
            f"alone\n  expected {list(expected[rid])}\n  got      {list(reader.tokens)}"
        )
        expect_ending(rid, reader, "stop" if rid == "c" and expected[rid][-1] == 5 else "length")


@core
@rule("engine-loop")
async def test_stage2_tokens_reach_the_stream_at_the_end_of_their_step() -> None:
    rig = Rig()
    r = request("a", 3, 3)
    want = rig.expected([r])["a"]
    async with rig.engine, anyio.create_task_group() as tg:
        reader = Reader(rig.engine.generate(r), rig.clock)
        tg.start_soon(reader.run)
        await rig.time.advance_to(T0 + STEP_NS - 1)
        assert reader.taken == [], (
            "a step's tokens reach the stream when its simulated time has passed: one "
            f"step takes {STEP_NS} ns, yet at +{STEP_NS - 1} ns the reader had {show(reader.taken)}"
        )
        await rig.time.advance_to(T0 + 3 * STEP_NS)
    expected = [
        (T0 + STEP_NS, Delivery((want[0],))),
        (T0 + 2 * STEP_NS, Delivery((want[1],))),
        (T0 + 3 * STEP_NS, Delivery((want[2],), "length")),
    ]
    assert reader.taken == expected, (
        f"one token per step, each at its step's end:\n  expected {show(expected)}\n"
        f"  got      {show(reader.taken)}"
    )


@core
@rule("engine-loop")
async def test_stage2_an_idle_engine_waits_without_stepping() -> None:
    rig = Rig()
    async with rig.engine:
        await rig.time.advance(STEP_NS * 50)
        stats = rig.engine.statistics()
        assert stats.steps == 0, f"no request, yet the engine ran {stats.steps} steps"
        assert rig.clock.next_deadline_ns() is None, (
            "an idle engine waits for a request, not for the clock (a polling loop?)"
        )
        stream = rig.engine.generate(request("a", 2, 2))
        await rig.time.advance(STEP_NS // 2)
        in_flight = rig.engine.statistics().steps
        assert in_flight == 0, (
            f"engine-statistics: steps counts the steps completed; half-way through the "
            f"first one it is 0, got {in_flight}"
        )
        await rig.time.advance(2 * STEP_NS - STEP_NS // 2)
        assert rig.engine.statistics().steps == 2, "a request wakes the idle engine at once"
        await stream.aclose()


@extended
@rule("engine-loop", "engine-deadline")
async def test_stage2_a_loop_that_wakes_late_steps_at_the_clocks_now() -> None:
    """The clock passes the end of step 1 (+1000) before the loop wakes, to +1300, as a
    real clock overshoots a sleep: the next step is step(now) at +1300, not at +1000 —
    so a deadline of +1200 has passed when it starts."""
    steps = Steps()
    rig = Rig(step_time_ns=steps)
    a, b = request("a", 3, 4), request("b", 3, 9, deadline_ns=T0 + 1_200)
    async with rig.engine:
        streams = [rig.engine.generate(r) for r in (a, b)]
        await rig.time.settle()  # step 1 runs until +1000
        rig.clock.set(T0 + STEP_NS + 300)
        got = [await rig.consume(stream, f"{stream.rid}'s stream to end") for stream in streams]
    starts = sorted(steps.scheduled)
    check(
        starts == [0, 1_300, 2_300, 3_300],
        "engine-loop: step 1 ran from +0 to +1000; the loop woke at +1300 (the clock had "
        "moved on): each step is step(now) with the clock's now, then lasts 1000 ns — "
        f"expected steps starting at +0, +1300, +2300, +3300; got {starts}",
    )
    check(
        (len(got[1].tokens), got[1].reason) == (1, "deadline"),
        "engine-deadline: b's deadline is +1200; the step after step 1 starts at +1300, past "
        f"it: b ends there with its one token and reason 'deadline'; got {show(got[1].taken)}",
    )


@core
@rule("engine-arrival")
async def test_stage2_generate_stamps_the_arrival_with_the_clocks_time() -> None:
    rig = Rig()
    async with rig.engine:
        await rig.time.advance(12_345)
        await rig.consume(rig.engine.generate(request("a", 2, 2, arrival_ns=5)))
    [metrics] = rig.batcher.metrics()
    assert metrics.arrival_ns == T0 + 12_345, (
        f"generate() submits with arrival_ns = the clock's now ({T0 + 12_345}); the batcher "
        f"saw {metrics.arrival_ns}"
    )
    assert rig.engine.statistics().ttft_p50_ns == STEP_NS


# -- streams ----------------------------------------------------------------------------


@core
@rule("stream")
async def test_stage2_a_slow_readers_untaken_tokens_are_merged_into_its_next_read() -> None:
    rig = Rig()
    r = request("a", 3, 5)
    want = rig.expected([r])["a"]
    async with rig.engine:
        reader = await rig.consume(rig.engine.generate(r), pace_ns=2_300)
    expected = [
        (T0 + 2_300, Delivery(want[0:2])),
        (T0 + 4_600, Delivery(want[2:4])),
        (T0 + 6_900, Delivery(want[4:5], "length")),
    ]
    assert reader.taken == expected, (
        "each read returns every token produced since the previous one, in order:\n"
        f"  expected {show(expected)}\n  got      {show(reader.taken)}"
    )


@core
@rule("no-stall")
async def test_stage2_a_reader_that_takes_nothing_does_not_slow_the_others() -> None:
    rig = Rig()
    idle, busy = request("idle", 3, 8), request("busy", 3, 6)
    want = rig.expected([busy])["busy"]
    async with rig.engine:
        rig.engine.generate(idle)  # nobody reads it
        reader = await rig.consume(rig.engine.generate(busy), "the busy stream to end")
    times = [at - T0 for at, _ in reader.taken]
    assert times == [STEP_NS * (i + 1) for i in range(len(want))], (
        "the loop never waits for a reader: the busy reader gets a token at every step's "
        f"end (+{STEP_NS}, +{2 * STEP_NS}, …), got them at {times}"
    )
    assert reader.tokens == want


# -- readers that leave -----------------------------------------------------------------


async def _leave_by_aclose(stream: TokenStream, reader_scope: anyio.CancelScope) -> None:
    await stream.aclose()


async def _leave_by_cancel(stream: TokenStream, reader_scope: anyio.CancelScope) -> None:
    reader_scope.cancel()


LEAVES = {"aclose": _leave_by_aclose, "cancelled in __anext__": _leave_by_cancel}


WHEN = ["waiting", "prefill", "decode"]


@extended
@rule("reader-leaves")
@pytest.mark.parametrize("how", ["aclose", "async with"])
async def test_stage2_a_reader_leaving_inside_a_cancelled_scope_still_aborts(how: str) -> None:
    rig = Rig()
    async with rig.engine:
        stream = rig.engine.generate(request("a", 3, 20))
        await rig.time.advance_to(T0 + 1_500)  # decoding
        with anyio.CancelScope() as scope:
            scope.cancel()  # the reader's task is being cancelled as it leaves
            if how == "aclose":
                await stream.aclose()
            else:
                async with stream:
                    pass
        freed = rig.batcher.free_blocks() == rig.num_blocks
        assert not rig.holds("a") and freed, (
            f"reader-leaves: the reader left by {how} inside a cancelled scope (a task "
            "being cancelled, as trio and anyio shield cleanup): the request must be "
            "aborted at that instant all the same, its blocks back in the pool — leave "
            "first, then any checkpoint; got still held: "
            f"{rig.holds('a')}, free blocks {rig.batcher.free_blocks()} of {rig.num_blocks}"
        )


@core
@rule("reader-leaves")
@pytest.mark.parametrize("when", WHEN)
async def test_stage2_a_reader_that_closes_its_stream_aborts_its_request_at_once(
    when: str,
) -> None:
    await _leaving(when, "aclose")


@core
@rule("reader-leaves")
@pytest.mark.parametrize("when", WHEN)
async def test_stage2_a_reader_cancelled_while_waiting_aborts_its_request_at_once(
    when: str,
) -> None:
    await _leaving(when, "cancelled in __anext__")


async def _leaving(when: str, how: str) -> None:
    """The reader of "a" or "b" leaves (``how``) while its request is ``when``."""
    # max_num_seqs=1: "b" waits behind "a"; a budget of 4 cuts "a"'s 10-token prompt.
    rig = Rig(max_num_seqs=1, max_num_batched_tokens=4, num_blocks=16)
    a, b = request("a", 10, 6), request("b", 3, 4)
    leaver = {"waiting": "b", "prefill": "a", "decode": "a"}[when]
    stayer = "a" if leaver == "b" else "b"
    at = {"waiting": T0 + 1_500, "prefill": T0 + 1_500, "decode": T0 + 4_500}[when]
    want = rig.expected([a, b])
    async with rig.engine, anyio.create_task_group() as tg:
        streams = {r.rid: rig.engine.generate(r) for r in (a, b)}
        readers = {rid: Reader(s, rig.clock) for rid, s in streams.items()}
        scopes = {rid: anyio.CancelScope() for rid in streams}

        async def read(rid: str) -> None:
            with scopes[rid]:
                await readers[rid].run()

        for rid in streams:
            tg.start_soon(read, rid)
        await rig.time.advance_to(at)
        assert rig.holds(leaver), f"setup: {leaver!r} must still be in the batcher at +{at - T0}"
        await LEAVES[how](streams[leaver], scopes[leaver])
        await rig.time.settle()
        assert not rig.holds(leaver), (
            f"request {leaver!r}'s reader left ({how}) while it was {when}: the request "
            "must be aborted at that instant, before the next step; the batcher still has "
            f"it (running {rig.batcher.running()}, waiting {rig.batcher.waiting()})"
        )
        held = set(rig.batcher.blocks_of(stayer))
        assert rig.batcher.free_blocks() == rig.num_blocks - len(held), (
            f"after {leaver!r} was aborted, every block but {stayer!r}'s must be free: "
            f"free {rig.batcher.free_blocks()} of {rig.num_blocks}, {stayer!r} holds {len(held)}"
        )
        taken_then = list(readers[leaver].taken)
        await rig.time.run_until(
            lambda: readers[stayer].ended != "reading",
            within_ns=WITHIN,
            what=f"{stayer!r}'s stream to end",
        )
    assert readers[stayer].tokens == want[stayer], f"the other request, {stayer!r}, is unaffected"
    assert readers[leaver].taken == taken_then, (
        f"nothing of {leaver!r} is delivered after its reader left: "
        f"{show(readers[leaver].taken[len(taken_then) :])}"
    )
    if how == "aclose":
        with pytest.raises(StopAsyncIteration):
            await streams[leaver].__anext__()


@core
@rule("reader-leaves")
async def test_stage2_leaving_the_streams_async_with_block_aborts_it() -> None:
    rig = Rig()
    async with rig.engine:
        async with rig.engine.generate(request("a", 3, 9)) as stream:
            await rig.time.advance_to(T0 + 1_500)
            first = await take(stream, "the first read, at +1500")
            assert len(first.tokens) == 1
        assert not rig.holds("a"), "leaving `async with stream` aborts the request at once"
        assert rig.batcher.free_blocks() == rig.num_blocks


@extended
@rule("reader-leaves")
async def test_stage2_a_read_after_leaving_stops_even_with_tokens_untaken() -> None:
    rig = Rig()
    async with rig.engine:
        stream = rig.engine.generate(request("a", 3, 9))
        await rig.time.advance_to(T0 + 2 * STEP_NS + STEP_NS // 2)  # 2 tokens untaken
        await stream.aclose()
        try:
            got: object = await stream.__anext__()
        except StopAsyncIteration:
            got = "StopAsyncIteration"
    assert got == "StopAsyncIteration", (
        "two tokens were delivered and never taken when the reader closed its stream: "
        f"nothing of it is delivered afterwards, a read stops the iteration; got {got}"
    )


@extended
@rule("reader-leaves")
@pytest.mark.parametrize("how", ["aclose", "async with"])
@pytest.mark.parametrize("untaken", ["tokens", "nothing"])
async def test_stage2_a_read_after_leaving_a_finished_stream_stops(how: str, untaken: str) -> None:
    """The request finished before its reader left: nothing to abort, but the reader has
    left all the same, and its reads stop the iteration — whether its last delivery held
    tokens (length) or none (deadline)."""
    rig = Rig()
    deadline = T0 + 2_500 if untaken == "nothing" else None
    async with rig.engine:
        stream = rig.engine.generate(request("a", 3, 3 if untaken == "tokens" else 9,
                                             deadline_ns=deadline))  # fmt: skip
        if untaken == "nothing":
            await rig.time.advance_to(T0 + 3_500)  # tokens at +1000 … +3000, all taken
            await take(stream, "the read at +3500")
        await rig.time.advance_to(T0 + 6 * STEP_NS)  # finished: its last delivery waits
        assert rig.engine.statistics().streams == 0, "setup: the request has finished"
        if how == "aclose":
            await stream.aclose()
        else:
            async with stream:
                pass
        try:
            got: object = await stream.__anext__()
        except StopAsyncIteration:
            got = "StopAsyncIteration"
    check(
        got == "StopAsyncIteration",
        f"reader-leaves: the request had finished ({'length' if deadline is None else 'deadline'}"
        f", its last delivery untaken, with {untaken}) when its reader left by {how}: reads "
        f"after leaving stop the iteration; got {got}",
    )


@core
@rule("reader-leaves", "engine-statistics")
async def test_stage2_a_reader_that_leaves_gets_nothing_of_the_step_in_flight() -> None:
    rig = Rig()
    async with rig.engine:
        stream = rig.engine.generate(request("a", 3, 9))
        await rig.time.advance_to(T0 + STEP_NS // 2)  # step 1 computes its first token
        await stream.aclose()
        assert rig.engine.statistics().streams == 0, (
            "a request whose reader left is finished at that instant: streams must be 0 "
            f"right after aclose(), got {rig.engine.statistics().streams}"
        )
        await rig.time.advance_to(T0 + 2 * STEP_NS)
        stats = rig.engine.statistics()
    assert stats.ttft_p50_ns is None, (
        "the reader left before step 1 ended, so the token of that step in flight must not "
        "be delivered to its stream: no first delivery, no TTFT; got "
        f"ttft_p50_ns={stats.ttft_p50_ns}"
    )


@core
@rule("reader-leaves", "overload", "stream")
async def test_stage2_a_thousand_clients_some_refused_some_leaving() -> None:
    """1 000 clients at once; up to 300 wait, the rest are refused and retry after the
    hint; one in ten leaves at a random instant. Every client that stays gets exactly
    what its request generates alone; every block is free at the end."""
    rig = Rig(max_num_seqs=64, max_num_batched_tokens=256, num_blocks=512, max_waiting=300,
              step_time_ns=step_time_ns)  # fmt: skip
    rng = random.Random(2026)
    requests = [request(f"r{i}", rng.randint(1, 12), rng.randint(1, 16)) for i in range(1000)]
    want = rig.expected(requests)
    leaving = [r for r in requests if rng.random() < 0.1]
    leaves = {r.rid: T0 + rng.randint(0, 40_000 * STEP_NS) for r in leaving}
    readers: dict[str, Reader] = {}
    refusals: list[tuple[str, int]] = []
    done: set[str] = set()

    async def client(r: Request) -> None:
        jitter = random.Random(r.rid)  # one per client: task order varies by backend
        while True:
            try:
                stream = rig.engine.generate(r)
                break
            except Overloaded as e:
                refusals.append((r.rid, e.retry_after_ns))
                assert e.retry_after_ns >= 1
                # Clients jitter their retries (at least the hint), as real ones should.
                backoff = e.retry_after_ns * jitter.randint(1, 64)
                await rig.clock.sleep_until_ns_async(rig.now + backoff)
        reader = readers[r.rid] = Reader(stream, rig.clock)
        with anyio.CancelScope() as scope:
            if r.rid in leaves:

                async def leave() -> None:
                    await rig.clock.sleep_until_ns_async(leaves[r.rid])
                    scope.cancel()

                async with anyio.create_task_group() as inner:
                    inner.start_soon(leave)
                    await reader.run()
                    inner.cancel_scope.cancel()
            else:
                await reader.run()
        done.add(r.rid)

    async with rig.engine, anyio.create_task_group() as tg:
        for r in requests:
            tg.start_soon(client, r)
        await rig.time.run_until(
            lambda: len(done) == len(requests), within_ns=10**12, what="every client to finish"
        )
        stats = rig.engine.statistics()
    assert refusals, "setup: 1 000 clients at once must overflow max_waiting=300"
    for rid, reader in readers.items():
        if rid in leaves and reader.ended == "cancelled":
            continue
        assert reader.error is None, f"client {rid}: {reader.ended}"
        assert reader.tokens == want[rid], (
            f"client {rid}: expected {list(want[rid])}, got {list(reader.tokens)}"
        )
    assert rig.batcher.free_blocks() == rig.num_blocks, (
        f"every request finished or left, yet {rig.num_blocks - rig.batcher.free_blocks()} "
        "blocks are still held: a leaving client's blocks were not freed"
    )
    assert (stats.waiting, stats.running, stats.streams) == (0, 0, 0)


# -- overload ---------------------------------------------------------------------------


@core
@rule("overload")
async def test_stage2_generate_refuses_at_max_waiting_with_the_time_left_in_the_step() -> None:
    rig = Rig(max_num_seqs=1, max_waiting=2)
    async with rig.engine:
        rig.engine.generate(request("a", 2, 9))
        rig.engine.generate(request("b", 2, 9))
        with pytest.raises(Overloaded) as refused:
            rig.engine.generate(request("c", 2, 9))
        assert refused.value.retry_after_ns == 1, (
            "no step in flight: the next starts at once, so retry_after_ns is 1 ns, got "
            f"{refused.value.retry_after_ns}"
        )
        await rig.time.advance_to(T0 + 300)  # step 1 (a admitted) ends at +1000
        assert rig.batcher.waiting() == ["b"], "setup: a runs, b waits"
        rig.engine.generate(request("c", 2, 9))  # 1 waiting < 2: admitted
        with pytest.raises(Overloaded) as refused:
            rig.engine.generate(request("d", 2, 9))
        assert refused.value.retry_after_ns == 700, (
            "retry_after_ns is the time left in the step in flight (ends at +1000, now "
            f"+300): 700, got {refused.value.retry_after_ns}"
        )
        assert not rig.holds("d"), "a refused request is not submitted"
        rig.clock.set(T0 + STEP_NS)  # the step ends now; the loop has not run yet
        with pytest.raises(Overloaded) as refused:
            rig.engine.generate(request("d", 2, 9))
        assert refused.value.retry_after_ns == 1, (
            "a refusal at the very instant the step in flight ends (+1000, before the loop "
            "ran): the time left is 0, and retry_after_ns is at least 1 ns, got "
            f"{refused.value.retry_after_ns}"
        )
        await rig.time.advance_to(T0 + 10 * STEP_NS)
        rig.engine.generate(request("d", 2, 9))  # the same id, later: not a duplicate
        await rig.engine.aclose()


@extended
@rule("overload")
@pytest.mark.parametrize("late", [-1, 0, 1, 250])
async def test_stage2_a_refusal_as_the_step_in_flight_ends_hints_at_least_1ns(late: int) -> None:
    """The clock reaches (or passes) the end of the step in flight before the loop has
    run: the queue is still full, and the time left is 1, 0 or less — the hint is 1 ns."""
    rig = Rig(max_num_seqs=1, max_waiting=1)
    async with rig.engine:
        rig.engine.generate(request("a", 2, 9))
        await rig.time.settle()  # step 1 (a admitted) runs until +1000
        rig.engine.generate(request("b", 2, 9))  # waits behind a
        rig.clock.set(T0 + STEP_NS + late)  # the loop has not run yet
        with pytest.raises(Overloaded) as refused:
            rig.engine.generate(request("c", 2, 9))
        got = refused.value.retry_after_ns
        await rig.engine.aclose()
    check(
        got == max(1, -late),
        f"overload: a refusal at +{STEP_NS + late}, the step in flight ending at +{STEP_NS} "
        f"(the loop not yet run): retry_after_ns is the time left, never less than 1 ns: "
        f"expected {max(1, -late)}, got {got}",
    )


@extended
@rule("overload", "engine-statistics")
async def test_stage2_a_request_the_batcher_refuses_leaves_no_stream_behind() -> None:
    rig = Rig()
    streams: dict[str, int] = {}
    try:
        async with rig.engine:
            stream = rig.engine.generate(request("a", 2, 3))
            too_big = request("big", rig.num_blocks * rig.block_size + 1, 1)
            for refused, why in ((request("a", 2, 3), "a second 'a'"), (too_big, "'big'")):
                with pytest.raises(RequestRejected):
                    rig.engine.generate(refused)
                streams[why] = rig.engine.statistics().streams
            reader = await rig.consume(stream, "the first 'a''s stream to end")
    finally:  # checked first: an engine left with a stream of a refused request may fail
        check(  # to close it, and that error would hide this one
            set(streams.values()) == {1},
            "generate() of a second 'a', then of 'big' (more KV than the pool holds) raised "
            "RequestRejected: nothing was admitted, so only the first 'a' is a stream "
            f"(requests admitted and not finished); statistics().streams after each: {streams}",
        )
    check(
        len(reader.tokens) == 3 and reader.reason == "length",
        "the first 'a' keeps its stream after a second 'a' was refused: its 3 tokens and "
        f"its end come to its reader, got {show(reader.taken)}",
    )


# -- stalls -----------------------------------------------------------------------------


@extended
@rule("stall", "reader-leaves")
@pytest.mark.parametrize("then", ["read-again", "aclose-first"])
async def test_stage2_a_stalled_stream_raises_once_then_stops(then: str) -> None:
    rig = Rig(max_stall_ns=3 * STEP_NS)
    async with rig.engine:
        stream = rig.engine.generate(request("a", 3, 20))
        await rig.time.advance_to(T0 + 4 * STEP_NS)  # stalled: aborted at +4000
        assert not rig.holds("a"), "setup: the stalled request is aborted at +4000"
        if then == "read-again":
            with pytest.raises(ReaderStalled):
                await stream.__anext__()
            what = "the read after the one that raised ReaderStalled"
        else:
            await stream.aclose()
            what = "a read of the stalled stream after aclose()"
        try:
            got: object = await stream.__anext__()
        except StopAsyncIteration:
            return
        except ReaderStalled:
            got = "ReaderStalled again"
        pytest.fail(f"{what} must stop the iteration (ReaderStalled is raised once); got {got}")


@extended
@rule("stall")
async def test_stage2_a_token_untaken_for_max_stall_ns_aborts_at_the_next_step() -> None:
    rig = Rig(max_stall_ns=3 * STEP_NS)
    async with rig.engine:
        stream = rig.engine.generate(request("a", 3, 20))
        # The first token is produced at +1000; +4000 is the first step start at which
        # it has waited 3000 ns.
        await rig.time.advance_to(T0 + 4 * STEP_NS - 1)
        assert rig.holds("a"), "at +3999 the oldest untaken token has waited 2999 ns < max_stall_ns"
        await rig.time.advance_to(T0 + 4 * STEP_NS)
        assert not rig.holds("a"), (
            "the first token (produced at +1000) was still untaken when the step at +4000 "
            "started: max_stall_ns (3000) reached, the request must be aborted then"
        )
        assert rig.batcher.free_blocks() == rig.num_blocks
        with pytest.raises(ReaderStalled):
            await stream.__anext__()


@extended
@rule("stall")
async def test_stage2_every_stalled_reader_is_aborted_at_the_same_step() -> None:
    rig = Rig(max_stall_ns=3 * STEP_NS)
    async with rig.engine:
        streams = [rig.engine.generate(request(rid, 3, 20)) for rid in ("a", "b", "c")]
        await rig.time.advance_to(T0 + 4 * STEP_NS - 1)
        assert all(rig.holds(s.rid) for s in streams), "at +3999 nobody has stalled yet"
        await rig.time.advance_to(T0 + 4 * STEP_NS)
        still = [s.rid for s in streams if rig.holds(s.rid)]
        assert not still, (
            "three readers, each with a token untaken since +1000: the step at +4000 aborts "
            f"every one of them, yet {still} still run"
        )
        for stream in streams:
            with pytest.raises(ReaderStalled):
                await stream.__anext__()


@extended
@rule("stall")
async def test_stage2_a_reader_that_keeps_up_never_hides_one_that_stalled() -> None:
    rig = Rig(max_stall_ns=3 * STEP_NS)
    async with rig.engine, anyio.create_task_group() as tg:
        keeps_up = Reader(rig.engine.generate(request("a", 3, 20)), rig.clock)
        tg.start_soon(keeps_up.run)
        stalled = rig.engine.generate(request("b", 3, 20))
        await rig.time.advance_to(T0 + 4 * STEP_NS - 1)
        assert rig.holds("b")
        await rig.time.advance_to(T0 + 4 * STEP_NS)
        assert (rig.holds("a"), rig.holds("b")) == (True, False), (
            "at +4000, 'b' has a token untaken since +1000 (stalled) while 'a' took every "
            "token as it came (not stalled, whatever it took before): expected a running "
            f"and b aborted, got a {'running' if rig.holds('a') else 'aborted'}, "
            f"b {'running' if rig.holds('b') else 'aborted'}"
        )
        await stalled.aclose()
        await rig.time.run_until(
            lambda: keeps_up.ended != "reading", within_ns=WITHIN, what="a's stream to end"
        )
    assert keeps_up.error is None and len(keeps_up.tokens) == 20


@extended
@rule("stall")
async def test_stage2_taking_a_delivery_restarts_the_stall_measure() -> None:
    rig = Rig(max_stall_ns=3 * STEP_NS)
    async with rig.engine:
        stream = rig.engine.generate(request("a", 3, 20))
        await rig.time.advance_to(T0 + 4 * STEP_NS - 1)
        got = await take(stream, "a read at +3999 (nothing has waited max_stall_ns)")
        assert len(got.tokens) == 3
        # The next token is produced at +4000: stalled from the step at +7000.
        await rig.time.advance_to(T0 + 7 * STEP_NS - 1)
        assert rig.holds("a"), (
            "the reader took everything at +3999; the oldest untaken token is from +4000, "
            "so at +6999 it has not waited max_stall_ns"
        )
        await rig.time.advance_to(T0 + 7 * STEP_NS)
        assert not rig.holds("a"), "the token of +4000, untaken at +7000: stalled"
        await stream.aclose()


@extended
@rule("stall")
async def test_stage2_a_finished_request_is_never_stalled() -> None:
    rig = Rig(max_stall_ns=2 * STEP_NS)
    short, long = request("short", 3, 2), request("long", 3, 12)
    want = rig.expected([short])["short"]
    async with rig.engine:
        stream = rig.engine.generate(short)
        await rig.consume(rig.engine.generate(long), "the long stream to end")
        got = await take(stream, "a read of the finished request, long after it finished")
    assert got == Delivery(want, "length"), (
        "a request that finished is not aborted for a slow reader (it holds no blocks, "
        f"its tokens are bounded): expected {Delivery(want, 'length')}, got {got}"
    )


class Steps:
    """A step time (every step ``STEP_NS``) that notes what each step scheduled, by the
    instant it started."""

    def __init__(self) -> None:
        self.scheduled: dict[int, list[str]] = {}

    def __call__(self, out: StepOutput) -> int:
        self.scheduled[out.now_ns - T0] = list(out.scheduled)
        return STEP_NS


@extended
@rule("stall", "engine-loop", "engine-statistics")
@pytest.mark.parametrize("company", ["alone", "beside-a-reader"])
async def test_stage2_a_stalled_request_is_aborted_before_its_step_not_after(company: str) -> None:
    steps = Steps()
    rig = Rig(max_stall_ns=3 * STEP_NS, step_time_ns=steps)
    async with rig.engine, anyio.create_task_group() as tg:
        stalled = rig.engine.generate(request("stalled", 3, 5))  # the README's example
        reader = None
        if company == "beside-a-reader":
            reader = Reader(rig.engine.generate(request("busy", 3, 8)), rig.clock)
            tg.start_soon(reader.run)
        await rig.time.advance_to(T0 + 6 * STEP_NS)
        with pytest.raises(ReaderStalled):
            await stalled.__anext__()
        stats = rig.engine.statistics()
        if reader is not None:
            await rig.time.run_until(
                lambda: reader.ended != "reading", within_ns=WITHIN, what="busy's stream to end"
            )
    at_4 = steps.scheduled.get(4 * STEP_NS)
    story = (
        "stall: max_stall_ns=3000 and nobody reads 'stalled' (prompt 3, max_new_tokens 5): "
        "its first token, delivered at +1000, has waited 3000 ns when the step at +4000 "
        "starts, so it is aborted at that step's start, before the batcher steps"
    )
    if company == "alone":
        assert at_4 is None and (stats.steps, stats.output_tokens) == (4, 4), (
            f"{story}: with nothing else unfinished that step does not happen at all (its "
            f"5th token is never computed, and would have finished it). Expected steps "
            f"at +0 … +3000 only, steps=4 and output_tokens=4; got steps at "
            f"{sorted(steps.scheduled)}, steps={stats.steps}, "
            f"output_tokens={stats.output_tokens}"
        )
    else:
        assert at_4 == ["busy"], (
            f"{story}: the step at +4000 computes only 'busy'; it scheduled {at_4} "
            f"(every step: {steps.scheduled})"
        )
        assert reader is not None and reader.error is None and len(reader.tokens) == 8


# -- deadlines --------------------------------------------------------------------------


@extended
@rule("engine-deadline")
@pytest.mark.parametrize("offset, tokens", [(0, 3), (1, 4)])
async def test_stage2_a_deadline_ends_the_stream_with_reason_deadline(
    offset: int, tokens: int
) -> None:
    rig = Rig()
    deadline = T0 + 3 * STEP_NS + offset
    r = request("a", 3, 9, deadline_ns=deadline)
    want = rig.expected([r])["a"][:tokens]
    async with rig.engine:
        reader = await rig.consume(rig.engine.generate(r))
    assert reader.tokens == want and reader.reason == "deadline", (
        f"deadline +{deadline - T0}: the first step at or past it finishes the request; "
        f"expected {list(want)} then reason 'deadline', got {show(reader.taken)}"
    )
    ends = T0 + (tokens + 1) * STEP_NS  # the step that starts at or past the deadline ends
    assert reader.taken[-1][0] == ends, (
        f"deadline +{deadline - T0}: the step starting at +{ends - STEP_NS - T0} finishes the "
        f"request, and the stream's last delivery comes at that step's end, +{ends - T0}; "
        f"got {show(reader.taken)}"
    )


# -- drain and close --------------------------------------------------------------------


@extended
@rule("drain")
async def test_stage2_drain_refuses_new_requests_and_returns_when_all_have_finished() -> None:
    rig = Rig()
    a, b = request("a", 3, 3), request("b", 3, 5)
    want = rig.expected([a, b])
    drained_at: list[int] = []
    async with rig.engine, anyio.create_task_group() as tg:
        streams = {r.rid: rig.engine.generate(r) for r in (a, b)}

        async def drain() -> None:
            await rig.engine.drain()
            drained_at.append(rig.now)

        tg.start_soon(drain)
        await rig.time.settle()
        with pytest.raises(EngineClosed):
            rig.engine.generate(request("c"))
        await rig.time.run_until(
            lambda: bool(drained_at), within_ns=WITHIN, what="drain() to return"
        )
        assert drained_at == [T0 + 5 * STEP_NS], (
            f"drain() returns when the last request's last delivery is made (+5000), "
            f"returned at +{drained_at[0] - T0}"
        )
        for rid, stream in streams.items():
            got = [d async for d in stream]
            assert tokens_of([(0, d) for d in got]) == want[rid], (
                f"after drain(), {rid!r}'s reader still takes everything"
            )


@extended
@rule("drain")
@pytest.mark.parametrize("busy", ["idle", "finished", "running"])
async def test_stage2_drain_refuses_new_requests_from_the_call_on_busy_or_idle(busy: str) -> None:
    """Whatever the engine holds when ``drain()`` is called — nothing ever, requests that
    have all finished, or one still running — ``generate()`` raises ``EngineClosed`` from
    the call on: while ``drain()`` waits, and after it has returned. An idle engine has
    nothing to finish: its ``drain()`` returns without the clock moving."""
    rig = Rig()
    story = Story(f"drain() on an engine that is {busy}", rig.clock.now_ns, T0)
    drained_at: list[int] = []
    async with rig.engine, anyio.create_task_group() as tg:
        if busy != "idle":
            stream = rig.engine.generate(request("a", 3, 3))
            story.add("generate(a): 3 tokens to make")
            if busy == "finished":
                await rig.consume(stream, "a's stream to end")
                story.add("a's stream read to its end")

        async def drain() -> None:
            await rig.engine.drain()
            drained_at.append(rig.now)

        called = rig.now
        tg.start_soon(drain)
        await rig.time.settle()
        story.add(f"drain() called; it {'returned' if drained_at else 'waits'}")
        if busy != "running":
            story.expect(drained_at, [called], "drain: nothing unfinished: drain() returns at once")
        late = admission(rig.engine.generate, request("late"))
        story.add(f"generate(late) {late}")
        story.expect(late, "raised EngineClosed", "drain: from the call on, generate() refuses")
        await rig.time.run_until(
            lambda: bool(drained_at), within_ns=WITHIN, what="drain() to return"
        )
        story.add("drain() returned")
        later = admission(rig.engine.generate, request("later"))
        story.add(f"generate(later) {later}")
        story.expect(
            later, "raised EngineClosed", "drain: after drain() returned, generate() refuses"
        )
        held = [rid for rid in ("late", "later") if rig.holds(rid)]
        story.expect(held, [], "drain: a refused request is never submitted to the batcher")


@extended
@rule("drain", "reader-leaves")
async def test_stage2_drain_returns_when_the_last_reader_leaves_before_any_step() -> None:
    """The only request's reader leaves at the instant the request was admitted, while
    ``drain()`` waits: once the request is aborted nothing is left to finish, and
    ``drain()`` returns — at that instant if no step had started, else when the step in
    flight ends. The reader is woken before the request wakes the loop, so where the
    event loop keeps the order of wake-ups (asyncio) it leaves before any step."""
    rig = Rig()
    story = Story("drain() while the only reader leaves", rig.clock.now_ns, T0)
    go, watch = anyio.Event(), anyio.Event()
    streams: list[TokenStream] = []
    drained_at: list[int] = []
    waiting = anyio.CancelScope()

    async def leave() -> None:
        await go.wait()
        await streams[0].aclose()
        story.add(f"a's reader left; {rig.engine.statistics().steps} steps taken")

    async def watcher() -> None:  # ends a drain() that nothing can end any more
        await watch.wait()
        try:
            await rig.time.run_until(
                lambda: bool(drained_at), within_ns=WITHIN, what="drain() to return"
            )
        except AssertionError as stuck:
            story.add(f"drain() still waits: {stuck}")
            waiting.cancel()

    async with rig.engine, anyio.create_task_group() as tg:
        tg.start_soon(leave)
        tg.start_soon(watcher)
        await rig.time.settle()
        go.set()
        streams.append(rig.engine.generate(request("a", 3, 5)))
        watch.set()
        story.add("generate(a), its reader told to leave; drain() called")
        with waiting:
            await rig.engine.drain()
            drained_at.append(rig.now)
            story.add("drain() returned")
        steps = rig.engine.statistics().steps
        story.expect(
            drained_at,
            [T0 + steps * STEP_NS],
            f"drain: the only request aborted ({steps} steps taken): drain() returns then",
        )
        story.expect(rig.holds("a"), False, "reader-leaves: the request is aborted at once")


@extended
@rule("aclose")
async def test_stage2_aclose_aborts_everything_and_each_stream_ends_with_abort() -> None:
    rig = Rig()
    a = request("a", 3, 9)
    want = rig.expected([a])["a"]
    body_ran_on = False
    async with rig.engine:
        stream = rig.engine.generate(a)
        await rig.time.advance_to(T0 + 2_500)
        await rig.engine.aclose()
        assert not rig.holds("a") and rig.batcher.free_blocks() == rig.num_blocks
        got = await take(stream, "the read after aclose()")
        assert got == Delivery(want[:2], "abort"), (
            f"the stream's last delivery: its untaken tokens and reason 'abort'; got {got}"
        )
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()
        with pytest.raises(EngineClosed):
            rig.engine.generate(request("b"))
        await rig.engine.aclose()  # twice is fine
        await rig.time.settle()
        body_ran_on = True  # aclose() stops the engine's loop, not the caller's block
    assert body_ran_on, "the code after aclose() in `async with engine` must run"
    assert rig.clock.next_deadline_ns() is None, "leaving the block, no task of the engine is left"


# -- statistics -------------------------------------------------------------------------


def nearest_rank(values: Sequence[float], p: int) -> float | None:
    return sorted(values)[math.ceil(p * len(values) / 100) - 1] if values else None


@extended
@rule("engine-statistics")
async def test_stage2_statistics_follow_their_definitions() -> None:
    rig = Rig(max_num_seqs=2, step_time_ns=step_time_ns)
    rng = random.Random(5)
    requests = [request(f"r{i}", rng.randint(1, 9), rng.randint(1, 7)) for i in range(7)]
    arrivals: dict[str, int] = {}
    readers: dict[str, Reader] = {}
    async with rig.engine, anyio.create_task_group() as tg:
        empty = rig.engine.statistics()
        before = (empty.steps, empty.output_tokens, empty.tokens_per_s, empty.ttft_p50_ns)
        assert before == (0, 0, 0.0, None), f"before any step: {empty}"
        for i, r in enumerate(requests):
            await rig.time.advance_to(T0 + i * 3_333_333)
            arrivals[r.rid] = rig.now
            readers[r.rid] = Reader(rig.engine.generate(r), rig.clock)
            tg.start_soon(readers[r.rid].run)
        await rig.time.settle()
        mid = rig.engine.statistics()
        queues = (len(rig.batcher.waiting()), len(rig.batcher.running()))
        assert (mid.waiting, mid.running) == queues, f"waiting, running: {mid}"
        await rig.time.run_until(
            lambda: _ended(readers), within_ns=10**12, what="every stream to end"
        )
        stats = rig.engine.statistics()
        await rig.time.advance(NS_PER_S)
        later = rig.engine.statistics()
    broken = {rid: rd.ended for rid, rd in readers.items() if rd.ended != "end" or not rd.taken}
    assert not broken, f"every stream must end normally, with its tokens: {broken}"
    ttft = [rd.taken[0][0] - arrivals[rid] for rid, rd in readers.items()]
    tpot = [(rd.taken[-1][0] - rd.taken[0][0]) / (len(rd.tokens) - 1)
            for rd in readers.values() if len(rd.tokens) >= 2]  # fmt: skip
    tokens = sum(len(rd.tokens) for rd in readers.values())
    expected = {
        "output_tokens": tokens,
        "ttft_p50_ns": nearest_rank(ttft, 50), "ttft_p99_ns": nearest_rank(ttft, 99),
        "tpot_p50_ns": nearest_rank(tpot, 50), "tpot_p99_ns": nearest_rank(tpot, 99),
        "streams": 0,
    }  # fmt: skip
    got = {k: getattr(stats, k) for k in expected}
    assert got == expected, f"statistics():\n  expected {expected}\n  got      {got}"
    assert stats.steps == rig.model.forward_calls, (
        f"steps: one per batcher step, {rig.model.forward_calls}; got {stats.steps}"
    )
    span = max(rd.taken[-1][0] for rd in readers.values()) - arrivals["r0"]
    assert stats.tokens_per_s == pytest.approx(tokens * 1e9 / span), (
        "tokens_per_s: output tokens over first step's start → last step's end"
    )
    assert later.tokens_per_s == stats.tokens_per_s, (
        "tokens_per_s ends at the last step's end, not now: idle time after it changes "
        f"nothing; {stats.tokens_per_s} at the last step, {later.tokens_per_s} a second later"
    )


@extended
@rule("engine-statistics", "reader-leaves", "stall")
async def test_stage2_statistics_count_the_requests_that_ended_early() -> None:
    rig = Rig(max_stall_ns=3 * STEP_NS)
    async with rig.engine:
        left = rig.engine.generate(request("left", 3, 20))
        rig.engine.generate(request("stalled", 3, 20))  # never read
        await rig.time.advance_to(T0 + 1_500)
        first = await take(left, "left's read at +1500")
        await rig.time.advance_to(T0 + 2_500)
        second = await take(left, "left's read at +2500")
        await left.aclose()  # step 3 (+2000 to +3000) is computing left's 3rd token
        await rig.time.advance_to(T0 + 10 * STEP_NS)  # stalled is aborted at +4000
        stats = rig.engine.statistics()
    assert (len(first.tokens), len(second.tokens)) == (1, 1), f"setup: {first}, {second}"
    got = (stats.steps, stats.output_tokens, stats.tokens_per_s)
    assert got == (4, 7, 7 * 1e9 / (4 * STEP_NS)), (
        "engine-statistics: 'left' reads at +1500 and +2500, then leaves while step 3 (+2000 "
        "to +3000) computes its 3rd token; 'stalled' is never read: it gets tokens at +1000 "
        "… +4000 and is aborted when the step at +4000 starts, which then does not run "
        "(nothing is left). output_tokens counts every token those 4 steps produced: "
        "'left' 3 (the one its reader left behind included) and 'stalled' 4. Expected "
        f"(steps, output_tokens, tokens_per_s) = (4, 7, {7 * 1e9 / (4 * STEP_NS)}), got {got}"
    )
    latency = (stats.ttft_p50_ns, stats.ttft_p99_ns, stats.tpot_p50_ns, stats.tpot_p99_ns)
    assert latency == (STEP_NS, STEP_NS, STEP_NS, STEP_NS), (
        "engine-statistics: a request whose reader left, or stalled, has finished too (any "
        "reason), with the deliveries its stream got: 'left' at +1000 and +2000, 'stalled' "
        "at +1000 … +4000; each TTFT and TPOT is 1000 ns. Expected "
        f"(ttft p50, p99, tpot p50, p99) = (1000, 1000, 1000, 1000), got {latency}"
    )


@extended
@rule("engine-statistics", "reader-leaves")
async def test_stage2_a_request_whose_reader_left_has_latencies_of_its_own() -> None:
    rig = Rig()
    async with rig.engine:
        left = rig.engine.generate(request("left", 3, 20))
        await rig.time.advance_to(T0 + 2_500)
        got = await take(left, "the read at +2500")
        await left.aclose()
        await rig.time.advance_to(T0 + 10 * STEP_NS)
        stats = rig.engine.statistics()
    assert len(got.tokens) == 2, f"setup: tokens delivered at +1000 and +2000, got {got}"
    latency = (stats.ttft_p50_ns, stats.tpot_p50_ns)
    assert latency == (STEP_NS, STEP_NS), (
        "engine-statistics: the only request, 'left', got deliveries at +1000 and +2000, "
        "then its reader left: it finished (any reason counts), so TTFT = 1000 and TPOT = "
        f"(2000 - 1000) / (2 - 1) = 1000; expected (ttft p50, tpot p50) = (1000, 1000), got "
        f"{latency}"
    )


@extended
@rule("engine-statistics", "stall", "aclose", "engine-deadline")
@pytest.mark.parametrize("ending", ["stalled", "engine closed", "deadline", "reader left"])
async def test_stage2_a_request_that_ended_early_has_latencies_of_its_own(ending: str) -> None:
    """The only request gets tokens at +1000, +2000, … and ends early, each way a request
    can: it counts in TTFT and TPOT like one that ran to its end."""
    rig = Rig(max_stall_ns=4 * STEP_NS)
    deadline = T0 + 3_500 if ending == "deadline" else None
    async with rig.engine:
        stream = rig.engine.generate(request("a", 3, 20, deadline_ns=deadline))
        if ending == "stalled":  # never read: aborted at +5000, after 5 tokens
            await rig.time.advance_to(T0 + 10 * STEP_NS)
        else:
            await rig.time.advance_to(T0 + 3_500)
            await take(stream, "the read at +3500")  # no stall: tokens at +1000 … +4000
            await rig.time.advance_to(T0 + 4_500)
            if ending == "engine closed":
                await rig.engine.aclose()
            elif ending == "reader left":
                await stream.aclose()
            await rig.time.advance_to(T0 + 10 * STEP_NS)
        stats = rig.engine.statistics()
    latency = (stats.ttft_p50_ns, stats.ttft_p99_ns, stats.tpot_p50_ns, stats.tpot_p99_ns)
    check(
        stats.streams == 0 and latency == (STEP_NS, STEP_NS, STEP_NS, STEP_NS),
        f"engine-statistics: the only request ({ending}) had its deliveries at +1000, "
        "+2000, … one a step: it finished (any reason counts), so TTFT = 1000 and TPOT = "
        "1000; expected streams 0 and (ttft p50, p99, tpot p50, p99) = (1000, 1000, 1000, "
        f"1000), got streams {stats.streams} and {latency}",
    )


@extended
@rule("engine-statistics")
@pytest.mark.parametrize("n", [4, 53])
async def test_stage2_percentiles_are_nearest_ranks(n: int) -> None:
    """n requests one after another (max_num_seqs=1), two tokens each; every step a cost
    of its own, so every TTFT and every TPOT differs. p50 and p99 are the
    ceil(p·n/100)-th smallest: with 53 values the 27th and the 53rd, not the 26th and
    the 52nd; with 4 the 2nd and the 4th."""
    costs = iter(random.Random(n).sample(range(STEP_NS, 100 * STEP_NS), 2 * n))
    rig = Rig(max_num_seqs=1, step_time_ns=lambda out: next(costs))
    requests = [request(f"r{i}", 3, 2) for i in range(n)]
    async with rig.engine, anyio.create_task_group() as tg:
        readers = {r.rid: Reader(rig.engine.generate(r), rig.clock) for r in requests}
        for reader in readers.values():
            tg.start_soon(reader.run)
        await rig.time.run_until(
            lambda: _ended(readers), within_ns=10**9, what="every stream to end"
        )
        stats = rig.engine.statistics()
    assert all(len(rd.tokens) == 2 for rd in readers.values()), "setup: two tokens each"
    ttft = [rd.taken[0][0] - T0 for rd in readers.values()]
    tpot = [float(rd.taken[-1][0] - rd.taken[0][0]) for rd in readers.values()]
    want = (nearest_rank(ttft, 50), nearest_rank(ttft, 99),
            nearest_rank(tpot, 50), nearest_rank(tpot, 99))  # fmt: skip
    got = (stats.ttft_p50_ns, stats.ttft_p99_ns, stats.tpot_p50_ns, stats.tpot_p99_ns)
    check(
        got == want,
        f"engine-statistics: {n} distinct TTFTs and TPOTs; p50 and p99 by nearest rank, the "
        f"ceil(p*{n}/100)-th smallest (ranks {math.ceil(50 * n / 100)} and "
        f"{math.ceil(99 * n / 100)}): expected (ttft p50, p99, tpot p50, p99) = {want}, "
        f"got {got}",
    )


@extended
@rule("engine-statistics")
async def test_stage2_tokens_per_s_spans_the_idle_time_between_steps() -> None:
    """Idle until +5000; a runs 3 steps (+5000 to +8000); idle again; b runs 2 steps
    (+20000 to +22000). 5 tokens over the span from the first step's start to the last
    step's end: 17 µs, idle time included."""
    rig = Rig()
    async with rig.engine:
        await rig.time.advance(5 * STEP_NS)
        await rig.consume(rig.engine.generate(request("a", 3, 3)), "a's stream to end")
        await rig.time.advance_to(T0 + 20 * STEP_NS)
        await rig.consume(rig.engine.generate(request("b", 3, 2)), "b's stream to end")
        stats = rig.engine.statistics()
    want = 5 * 1e9 / (17 * STEP_NS)
    check(
        (stats.steps, stats.output_tokens) == (5, 5) and stats.tokens_per_s == pytest.approx(want),
        "engine-statistics: 5 steps, 5 tokens, the first step starting at +5000 and the "
        "last ending at +22000, idle from +8000 to +20000: tokens_per_s = 5 tokens over "
        f"17000 ns = {want}; got steps {stats.steps}, output_tokens {stats.output_tokens}, "
        f"tokens_per_s {stats.tokens_per_s}",
    )


# -- bad input --------------------------------------------------------------------------


@extended
@rule("stage2-bad-input")
@pytest.mark.parametrize(
    "field, value",
    [("max_waiting", 0), ("max_waiting", -1), ("max_waiting", "8"), ("max_stall_ns", 0),
     ("max_stall_ns", 1.5), ("max_waiting", True), ("step_time_ns", None), ("clock", None),
     ("max_stall_ns", True), ("max_stall_ns", False), ("max_stall_ns", "8"),
     ("max_stall_ns", -1), ("max_waiting", 1.5), ("max_waiting", False),
     pytest.param("clock", ReadOnlyClock(), id="clock-that-cannot-wait")],
)  # fmt: skip
async def test_stage2_the_engine_refuses_nonsense_naming_the_parameter(
    field: str, value: object
) -> None:
    rig = Rig()
    wrong_type = not isinstance(value, int) or isinstance(value, bool)  # TypeError will do
    with pytest.raises((TypeError, ValueError) if wrong_type else ValueError, match=field):
        rig.engine_with(**{field: value})


@extended
@rule("stage2-bad-input")
@pytest.mark.parametrize(
    "field, value",
    [("step_time_ns", None), ("step_time_ns", STEP_NS), ("step_time_ns", "1us"),
     ("clock", None), ("clock", 5), pytest.param("clock", ReadOnlyClock(), id="read-only"),
     pytest.param("clock", SleepOnlyClock(), id="no-time")],
)  # fmt: skip
async def test_stage2_a_step_time_or_clock_the_engine_cannot_use_is_a_value_error(
    field: str, value: object
) -> None:
    rig = Rig()
    try:
        rig.engine_with(**{field: value})
    except ValueError as e:
        raised: BaseException | None = e
    except TypeError as e:
        raised = e
    else:
        raised = None
    check(
        isinstance(raised, ValueError) and field in str(raised),
        f"stage2-bad-input: {field}={value!r} (not a callable step time, or not a waiting "
        f"clock) is a ValueError naming {field}; got {raised!r}",
    )


@extended
@rule("stage2-bad-input")
@pytest.mark.parametrize("bad", [0, -5, True, 2.0])
@pytest.mark.parametrize("at", ["first", "third"])  # a wrong cost model, from the start or later
async def test_stage2_a_step_time_that_is_not_a_positive_int_is_an_error(
    bad: object, at: str
) -> None:
    costs = iter([STEP_NS, STEP_NS] if at == "third" else [])
    rig = Rig(step_time_ns=lambda out: next(costs, cast(int, bad)))
    with pytest.raises(BaseException) as raised:
        async with rig.engine:
            rig.engine.generate(request("a", 2, 8))
            await rig.time.advance(3 * STEP_NS)
    leaves = [raised.value]
    while isinstance(leaves[-1], BaseExceptionGroup):
        leaves.append(leaves[-1].exceptions[0])
    assert isinstance(leaves[-1], ValueError) and "step_time_ns" in str(leaves[-1]), (
        f"a step time of {bad!r} (on the {at} step) is a ValueError naming step_time_ns, "
        f"got {leaves[-1]!r}"
    )


@extended
@rule("stage2-bad-input")
async def test_stage2_generate_needs_a_running_engine() -> None:
    rig = Rig()
    with pytest.raises(RuntimeError):
        rig.engine.generate(request("a"))
