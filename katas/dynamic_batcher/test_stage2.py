"""Stage 2: the streaming engine, the request batcher and automatic prefix caching (see
katas/dynamic_batcher/README.md, "Stage 2").

The engine: one loop in simulated time, streams that merge what a slow reader has not
taken, readers that leave or stall, bounded admission, drain and close, statistics.
Time is a ``ManualClock`` moved by the test's
:class:`~katas._harness.virtual_time.VirtualTime`, only when every task waits; steps
take a fixed simulated time (1 µs) unless a test says otherwise, so the instant of
every step's start and end is known; readers take deliveries at instants the test
chooses, never at an instant a step ends. The model is the harness's ``FakeModel``:
every stream is compared with what its request generates alone.

The request batcher (``-k batches``): full and due batches, order, result routing,
errors, cancellation, concurrent batches and closing. ``fn`` is a model the test
controls (:mod:`katas.dynamic_batcher._testing.batches`: it records every batch and the
instant it was called, and can hold a batch until the test releases it); the test lets
every task run until all of them wait before it looks, and reads ``statistics()``
instead of guessing from timing.

Automatic prefix caching (extended, ``-k prefix``): a ``FakeModel(shared_reads=True)``
lets requests share the blocks they only read, and samples every token from what it
reads back, so a block freed while shared, evicted in use or recomputed into the wrong
place changes the output; :mod:`katas.dynamic_batcher._testing.prefix` holds a run that
checks every step and a model of the rules, written from the prompt alone, that a state
machine compares with the batcher.

Every async test runs on asyncio and on trio. Map: the loop (§engine-loop, §engine-arrival) ·
streams (§stream, §no-stall) · readers that leave (§reader-leaves) · a thousand clients
· overload (§overload) · stalls (§stall) · deadlines (§engine-deadline) · drain and
close (§drain, §aclose) · statistics (§engine-statistics) · bad input
(§stage2-bad-input) · the request batcher (§batch-full, §batch-delay, §batch-order,
§batch-routing, §batch-errors, §batch-cancel, §batch-concurrent, §batch-statistics,
§batch-close, §batch-bad-input) · prefix caching (§prefix-keys, §prefix-hit,
§prefix-last-token, §prefix-no-shared-writes, §prefix-refcount, §prefix-lru,
§prefix-preemption, §prefix-transparency, §prefix-stage1, §prefix-statistics,
§prefix-bad-input).
"""

from __future__ import annotations

import math
import random
import re
import sys
from collections.abc import Sequence
from typing import Any, cast

import anyio
import hypothesis.stateful as stateful
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from katas._harness.profiles import examples
from katas._harness.under_test import stage
from katas._harness.virtual_time import SETTLE_S, settle
from katas._harness.walks import Walk, walked
from katas._runtime.clock import NS_PER_S, ManualClock
from katas._runtime.todo import Todo
from katas.dynamic_batcher._testing.batches import (
    DELAY,
    Caller,
    Model,
    answer,
    bounded,
    expect_nothing_sent,
    expect_results,
    expect_sent,
    new_batcher,
    outcomes,
    serving,
    settled,
    stats,
    submit,
)
from katas.dynamic_batcher._testing.engine import (
    STEP_NS,
    T0,
    Reader,
    Rig,
    fixed_step,
    request,
)
from katas.dynamic_batcher._testing.model import step_time_ns
from katas.dynamic_batcher._testing.prefix import (
    BASES,
    LONGEST,
    TICK_NS,
    PrefixRules,
    S,
    ceil_div,
    expect,
    prefix_batcher,
    prefix_model,
    run_of,
    shape,
    toks,
    unbatched,
)
from katas.dynamic_batcher._testing.rules import BatchingRules
from katas.dynamic_batcher._testing.workload import shared_prefixes
from katas.dynamic_batcher.api import (
    BatchStatistics,
    Delivery,
    EngineClosed,
    Overloaded,
    Policy,
    PrefixCacheStatistics,
    ReaderStalled,
    Request,
    RequestRejected,
)

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

pytestmark = [pytest.mark.stage(2), pytest.mark.anyio]
core = pytest.mark.core
extended = pytest.mark.extended
rule = pytest.mark.rule

#: Long enough for any test's requests to finish, in simulated ns.
WITHIN = 10_000 * STEP_NS


def _ended(readers: dict[str, Reader]) -> bool:
    return all(r.ended != "reading" for r in readers.values())


async def take(stream: Any, what: str) -> Delivery:
    """The stream's next delivery; anything else it raises fails the test, saying so."""
    try:
        delivery: Delivery = await stream.__anext__()
    except (ReaderStalled, StopAsyncIteration, EngineClosed) as e:
        raise AssertionError(f"{what}: expected a delivery, the read raised {e!r}") from e
    return delivery


def tokens_of(deliveries: list[tuple[int, Delivery]]) -> tuple[int, ...]:
    return tuple(t for _, d in deliveries for t in d.tokens)


def show(deliveries: list[tuple[int, Delivery]]) -> str:
    """Deliveries as ``+ns: tokens reason`` (times from T0)."""
    return "; ".join(
        f"+{at - T0}: {list(d.tokens)}{' ' + d.finish_reason if d.finish_reason else ''}"
        for at, d in deliveries
    )


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
        want = "stop" if rid == "c" and expected[rid][-1] == 5 else "length"
        assert reader.reason == want, (
            f"request {rid}: the last delivery's reason is {reader.reason!r}, expected {want!r}"
        )
        assert all(d.finish_reason is None for _, d in reader.taken[:-1]), (
            f"request {rid}: only the last delivery carries a finish reason: {show(reader.taken)}"
        )
        assert reader.ended == "end", f"request {rid}: after the last delivery the iteration stops"


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
        await rig.time.advance(2 * STEP_NS)
        assert rig.engine.statistics().steps == 2, "a request wakes the idle engine at once"
        await stream.aclose()


@core
@rule("engine-arrival")
async def test_stage2_generate_stamps_the_arrival_with_the_clocks_time() -> None:
    rig = Rig()
    async with rig.engine, anyio.create_task_group() as tg:
        await rig.time.advance(12_345)
        reader = Reader(rig.engine.generate(request("a", 2, 2, arrival_ns=5)), rig.clock)
        tg.start_soon(reader.run)
        await rig.time.run_until(
            lambda: reader.ended != "reading", within_ns=WITHIN, what="the stream to end"
        )
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
    async with rig.engine, anyio.create_task_group() as tg:
        reader = Reader(rig.engine.generate(r), rig.clock, pace_ns=2_300)
        tg.start_soon(reader.run)
        await rig.time.run_until(
            lambda: reader.ended != "reading", within_ns=WITHIN, what="the stream to end"
        )
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
    async with rig.engine, anyio.create_task_group() as tg:
        rig.engine.generate(idle)  # nobody reads it
        reader = Reader(rig.engine.generate(busy), rig.clock)
        tg.start_soon(reader.run)
        await rig.time.run_until(
            lambda: reader.ended != "reading", within_ns=WITHIN, what="the busy stream to end"
        )
    times = [at - T0 for at, _ in reader.taken]
    assert times == [STEP_NS * (i + 1) for i in range(len(want))], (
        "the loop never waits for a reader: the busy reader gets a token at every step's "
        f"end (+{STEP_NS}, +{2 * STEP_NS}, …), got them at {times}"
    )
    assert reader.tokens == want


# -- readers that leave -----------------------------------------------------------------


async def _leave_by_aclose(stream: Any, reader_scope: anyio.CancelScope) -> None:
    await stream.aclose()


async def _leave_by_cancel(stream: Any, reader_scope: anyio.CancelScope) -> None:
    reader_scope.cancel()


LEAVES = {"aclose": _leave_by_aclose, "cancelled in __anext__": _leave_by_cancel}


WHEN = ["waiting", "prefill", "decode"]


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
        await rig.time.advance_to(T0 + 10 * STEP_NS)
        rig.engine.generate(request("d", 2, 9))  # the same id, later: not a duplicate
        await rig.engine.aclose()


# -- stalls -----------------------------------------------------------------------------


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
    async with rig.engine, anyio.create_task_group() as tg:
        stream = rig.engine.generate(short)
        reader = Reader(rig.engine.generate(long), rig.clock)
        tg.start_soon(reader.run)
        await rig.time.run_until(
            lambda: reader.ended != "reading", within_ns=WITHIN, what="the long stream to end"
        )
        got = await take(stream, "a read of the finished request, long after it finished")
    assert got == Delivery(want, "length"), (
        "a request that finished is not aborted for a slow reader (it holds no blocks, "
        f"its tokens are bounded): expected {Delivery(want, 'length')}, got {got}"
    )


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
    async with rig.engine, anyio.create_task_group() as tg:
        reader = Reader(rig.engine.generate(r), rig.clock)
        tg.start_soon(reader.run)
        await rig.time.run_until(
            lambda: reader.ended != "reading", within_ns=WITHIN, what="the stream to end"
        )
    assert reader.tokens == want and reader.reason == "deadline", (
        f"deadline +{deadline - T0}: the first step at or past it finishes the request; "
        f"expected {list(want)} then reason 'deadline', got {show(reader.taken)}"
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
@rule("aclose")
async def test_stage2_aclose_aborts_everything_and_each_stream_ends_with_abort() -> None:
    rig = Rig()
    a = request("a", 3, 9)
    want = rig.expected([a])["a"]
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


# -- bad input --------------------------------------------------------------------------


@extended
@rule("stage2-bad-input")
@pytest.mark.parametrize(
    "field, value",
    [("max_waiting", 0), ("max_waiting", -1), ("max_waiting", "8"), ("max_stall_ns", 0),
     ("max_stall_ns", 1.5), ("max_waiting", True), ("step_time_ns", None), ("clock", None)],
)  # fmt: skip
async def test_stage2_the_engine_refuses_nonsense_naming_the_parameter(
    field: str, value: object
) -> None:
    rig = Rig()
    kwargs: dict[str, Any] = {
        "clock": rig.clock, "step_time_ns": fixed_step(), "max_waiting": 4, "max_stall_ns": 10,
    }  # fmt: skip
    kwargs[field] = value
    wrong_type = not isinstance(value, int) or isinstance(value, bool)  # TypeError will do
    with pytest.raises((TypeError, ValueError) if wrong_type else ValueError, match=field):
        type(rig.engine)(rig.batcher, **kwargs)


@extended
@rule("stage2-bad-input")
@pytest.mark.parametrize("bad", [0, -5, True, 2.0])
async def test_stage2_a_step_time_that_is_not_a_positive_int_is_an_error(bad: object) -> None:
    rig = Rig(step_time_ns=lambda out: cast(int, bad))  # a wrong cost model
    with pytest.raises(BaseException) as raised:
        async with rig.engine:
            rig.engine.generate(request("a"))
            await rig.time.advance(STEP_NS)
    leaves = [raised.value]
    while isinstance(leaves[-1], BaseExceptionGroup):
        leaves.append(leaves[-1].exceptions[0])
    assert isinstance(leaves[-1], ValueError) and "step_time_ns" in str(leaves[-1]), (
        f"a step time of {bad!r} is a ValueError naming step_time_ns, got {leaves[-1]!r}"
    )


@extended
@rule("stage2-bad-input")
async def test_stage2_generate_needs_a_running_engine() -> None:
    rig = Rig()
    with pytest.raises(RuntimeError):
        rig.engine.generate(request("a"))


# -- the request batcher: a full batch is sent at once ------------------------------


@core
@rule("batch-full", "batch-statistics")
@pytest.mark.parametrize("size", [1, 4])
async def test_stage2_batches_a_full_batch_is_sent_at_once(size: int) -> None:
    clock = ManualClock()
    model = Model(clock)
    t0 = clock.now_ns()
    with bounded(f"a batch of {size} to fill and be sent"):
        async with (
            anyio.create_task_group() as tg,
            serving(new_batcher(model, max_batch_size=size), model) as b,
        ):
            assert stats(b) == BatchStatistics(0, 0, 0, ()), (
                f"§batch-statistics: a new batcher: expected {BatchStatistics(0, 0, 0, ())}, "
                f"got {stats(b)}"
            )
            callers = []
            for n in range(size - 1):
                callers.append(await submit(tg, b, f"x{n}"))
                expect_nothing_sent(model, b, f"§batch-full: {n + 1} of max_batch_size={size}")
                assert stats(b) == BatchStatistics(n + 1, 0, 0, ()), (
                    f"§batch-statistics: {n + 1} item(s) queued, nothing sent: expected "
                    f"{BatchStatistics(n + 1, 0, 0, ())}, got {stats(b)}"
                )
            callers.append(await submit(tg, b, "last"))
            items = [c.item for c in callers]
            await expect_sent(
                model,
                [items],
                t0,
                f"§batch-full: the item that makes max_batch_size={size} is queued sends the "
                "batch at once, the clock not moved",
            )
            await outcomes(callers, "a full batch")
            expect_results(callers, "§batch-full")
            assert stats(b) == BatchStatistics(0, 0, 1, (size,)), (
                f"§batch-statistics: one batch of {size} sent and done: expected "
                f"{BatchStatistics(0, 0, 1, (size,))}, got {stats(b)}"
            )
            extra = await submit(tg, b, "next")
            if size > 1:
                assert len(model.batches) == 1 and stats(b).queued == 1, (
                    f"§batch-full: the item after a full batch waits for the next one: "
                    f"{model.describe()}, statistics() {stats(b)}"
                )
                clock.advance(DELAY)
            await outcomes([extra], "the item after a full batch")
            expect_results([extra], "§batch-full: the item after a full batch")


# -- the delay, from the oldest item's own submit --------------------------------------


@core
@rule("batch-delay")
async def test_stage2_batches_a_lone_item_is_sent_exactly_when_its_delay_is_up() -> None:
    clock = ManualClock()
    model = Model(clock)
    with bounded("a lone item to be sent at its delay"):
        async with (
            anyio.create_task_group() as tg,
            serving(new_batcher(model, max_batch_size=8), model) as b,
        ):
            clock.advance(3)
            t0 = clock.now_ns()
            caller = await submit(tg, b, "a")
            clock.advance(DELAY - 1)
            await settle()
            expect_nothing_sent(
                model,
                b,
                f"§batch-delay: 1 ns before the item's delay (submitted at {t0}, "
                f"max_queue_delay_ns={DELAY}, now {clock.now_ns()})",
            )
            clock.advance(1)
            await expect_sent(
                model,
                [["a"]],
                t0 + DELAY,
                f"§batch-delay: at the instant the item has waited max_queue_delay_ns "
                f"(submitted at {t0}, now {t0 + DELAY})",
            )
            await outcomes([caller], "the lone item")
            expect_results([caller], "§batch-delay")
            clock.advance(1)
            await settle()
            assert stats(b).sizes == (1,), f"§batch-delay: sent once, got {stats(b)}"


@core
@rule("batch-delay")
async def test_stage2_batches_the_delay_counts_from_the_oldest_items_own_submit() -> None:
    clock = ManualClock()
    model = Model(clock)
    with bounded("two items to be sent at the oldest one's delay"):
        async with (
            anyio.create_task_group() as tg,
            serving(new_batcher(model, max_batch_size=8), model) as b,
        ):
            start = clock.now_ns()
            clock.advance(10 * DELAY)  # long after the batcher started
            t1 = clock.now_ns()
            first = await submit(tg, b, "first")
            expect_nothing_sent(
                model,
                b,
                f"§batch-delay: an item submitted at {t1}, {10 * DELAY} ns after the "
                f"batcher started (at {start}); its delay counts from its own submit",
            )
            clock.advance(DELAY // 2)
            second = await submit(tg, b, "second")
            clock.advance(DELAY // 2 - 1)
            await settle()
            expect_nothing_sent(
                model, b, f"§batch-delay: 1 ns before the oldest item's delay ({t1} + {DELAY})"
            )
            clock.advance(1)
            await expect_sent(
                model,
                [["first", "second"]],
                t1 + DELAY,
                f"§batch-delay: the batch goes when its OLDEST item has waited "
                f"max_queue_delay_ns (submitted at {t1}); a later item (at {t1 + DELAY // 2}) "
                "does not restart the timer",
            )
            await outcomes([first, second], "the two items")
            expect_results([first, second], "§batch-delay")


@core
@rule("batch-delay")
async def test_stage2_batches_the_delay_does_not_count_from_the_last_dispatch() -> None:
    clock = ManualClock()
    model = Model(clock)
    with bounded("items to be sent at their own delays after earlier batches"):
        async with (
            anyio.create_task_group() as tg,
            serving(new_batcher(model, max_batch_size=2), model) as b,
        ):
            t0 = clock.now_ns()
            callers = [await submit(tg, b, "a")]
            clock.advance(1)
            callers.append(await submit(tg, b, "b"))  # full: sent at t0 + 1
            clock.advance(1)
            callers.append(await submit(tg, b, "c"))  # the remainder, submitted at t0 + 2
            await expect_sent(model, [["a", "b"]], t0 + 1, "§batch-full: a and b fill a batch")
            clock.advance(DELAY - 2)  # t0 + DELAY: the full batch's instant + DELAY - 1
            await settle()
            assert len(model.batches) == 1, (
                f"§batch-delay: item c was submitted at {t0 + 2}; its delay ends at "
                f"{t0 + 2 + DELAY}, not {DELAY} after the last batch was sent ({t0 + 1}); "
                f"now {clock.now_ns()}: {model.describe()}"
            )
            clock.advance(1)
            await settle()
            assert len(model.batches) == 1, (
                f"§batch-delay: 1 ns before item c's delay (now {clock.now_ns()}), nothing may be "
                f"sent: {model.describe()}"
            )
            clock.advance(1)
            t_c = t0 + 2 + DELAY
            await expect_sent(model, [["a", "b"], ["c"]], t_c, "§batch-delay: c at its own delay")
            # A batch sent by the delay: the next item's delay is its own too.
            clock.advance(DELAY // 2)
            callers.append(await submit(tg, b, "d"))
            clock.advance(DELAY // 2)  # t_c + DELAY: the last dispatch + DELAY
            await settle()
            assert len(model.batches) == 2, (
                f"§batch-delay: item d was submitted at {t_c + DELAY // 2}: {DELAY} ns after the "
                f"last dispatch ({t_c}) is not its delay; {model.describe()}"
            )
            clock.advance(DELAY // 2)
            await expect_sent(
                model,
                [["a", "b"], ["c"], ["d"]],
                t_c + DELAY // 2 + DELAY,
                "§batch-delay: d at its delay",
            )
            await outcomes(callers, "four items")
            expect_results(callers, "§batch-delay")


@extended
@rule("batch-delay")
async def test_stage2_batches_a_zero_delay_sends_each_item_without_waiting() -> None:
    clock = ManualClock()
    model = Model(clock)
    with bounded("items sent with max_queue_delay_ns=0"):
        async with (
            anyio.create_task_group() as tg,
            serving(new_batcher(model, max_batch_size=8, delay=0), model) as b,
        ):
            callers = [await submit(tg, b, "a")]
            await expect_sent(
                model,
                [["a"]],
                clock.now_ns(),
                "§batch-delay: max_queue_delay_ns=0 waits for nothing",
            )
            callers.append(await submit(tg, b, "b"))
            await expect_sent(
                model, [["a"], ["b"]], clock.now_ns(), "§batch-delay: max_queue_delay_ns=0"
            )
            await outcomes(callers, "two items, no delay")
            expect_results(callers, "§batch-delay")


# -- order, and each caller its own result ---------------------------------------------


@core
@rule("batch-order", "batch-routing")
async def test_stage2_batches_hold_the_oldest_items_in_submission_order() -> None:
    clock = ManualClock()
    model = Model(clock)
    items = ["a", "b", "c", "d", "e", "f", "g"]
    with bounded("seven items in batches of three"):
        async with (
            anyio.create_task_group() as tg,
            serving(new_batcher(model, max_batch_size=3), model) as b,
        ):
            callers = [await submit(tg, b, item) for item in items]
            clock.advance(DELAY)
            want = [["a", "b", "c"], ["d", "e", "f"], ["g"]]
            await expect_sent(
                model,
                want,
                clock.now_ns(),
                "§batch-order: seven items submitted one after the other, max_batch_size=3: "
                "the oldest first, each batch in submission order",
            )
            await outcomes(callers, "seven items")
            expect_results(callers, "§batch-routing")


class _Rule:
    """The rule, as the test's own model: at every instant, each full batch is sent, and
    each batch whose oldest item has waited ``delay``; the oldest items first, at most
    ``max_batch`` a batch."""

    def __init__(self, max_batch: int, delay: int) -> None:
        self.max_batch = max_batch
        self.delay = delay
        self.now = 0
        self.queue: list[tuple[int, int]] = []  # (submitted at, item)
        self.batches: list[list[int]] = []

    def at(self, now: int) -> None:
        self.now = now
        self._flush()

    def submit(self, item: int) -> None:
        self.queue.append((self.now, item))
        self._flush()

    def next_deadline(self) -> int:
        return self.queue[0][0] + self.delay

    def _flush(self) -> None:
        while self.queue and (
            len(self.queue) >= self.max_batch or self.next_deadline() <= self.now
        ):
            self.batches.append([item for _, item in self.queue[: self.max_batch]])
            del self.queue[: self.max_batch]


@st.composite
def _workloads(draw: st.DrawFn) -> tuple[int, int, list[int], list[int], frozenset[int]]:
    """max_batch_size, max_queue_delay_ns, the time before each submit, the items (distinct,
    so a result routed to the wrong caller shows) and the poison items."""
    max_batch = draw(st.integers(1, 6), label="max_batch_size")
    delay = draw(st.sampled_from([0, 1, 5, DELAY]), label="max_queue_delay_ns")
    items = draw(
        st.lists(st.integers(-999, 999), min_size=1, max_size=20, unique=True), label="items"
    )
    near = sorted({0, 1, max(delay - 1, 0), delay, delay + 1, delay // 2})
    gap = st.one_of(st.sampled_from(near), st.integers(0, 2 * delay + 1))
    gaps = draw(st.lists(gap, min_size=len(items), max_size=len(items)), label="gaps")
    poison = draw(st.sets(st.sampled_from(items), max_size=2), label="poison")
    return max_batch, delay, gaps, items, frozenset(poison)


@core
@rule("batch-full", "batch-delay", "batch-order", "batch-routing", "batch-errors")
@given(case=_workloads())
async def test_stage2_batches_every_caller_gets_its_own_result_under_random_workloads(
    case: tuple[int, int, list[int], list[int], frozenset[int]],
) -> None:
    max_batch, delay, gaps, items, poison = case
    clock = ManualClock(start_ns=0)
    model = Model(clock)
    model.poison = poison
    expected = _Rule(max_batch, delay)
    callers: list[Caller] = []
    setup = f"max_batch_size={max_batch}, max_queue_delay_ns={delay}, poison items {sorted(poison)}"
    done: list[str] = []

    async def check(event: str) -> None:
        done.append(event)
        await settle()
        assert model.batches == expected.batches, (
            f"§batch-full, §batch-delay, §batch-order: {setup}; after\n    "
            + "\n    ".join(done)
            + f"\n  expected fn called with {expected.batches}\n  got {model.describe()}"
        )

    with bounded(f"every caller's outcome ({setup}, items {items}, gaps {gaps})"):
        async with (
            anyio.create_task_group() as tg,
            serving(new_batcher(model, max_batch_size=max_batch, delay=delay), model) as b,
        ):
            for gap, item in zip(gaps, items, strict=True):
                if gap:
                    clock.advance(gap)
                    expected.at(clock.now_ns())
                    await check(f"the clock moved to {clock.now_ns()}")
                callers.append(await submit(tg, b, item))
                expected.submit(item)
                await check(f"submit({item}) at {clock.now_ns()}")
            while expected.queue:  # each remaining batch, at its oldest item's deadline
                clock.advance(expected.next_deadline() - clock.now_ns())
                expected.at(clock.now_ns())
                await check(f"the clock moved to {clock.now_ns()}")
            await outcomes(callers, setup)
    batch_of = {item: n for n, batch in enumerate(model.batches) for item in batch}
    for c in callers:
        n = batch_of[c.item]
        if n in model.raised:
            assert c.error is model.raised[n], (
                f"§batch-errors: {setup}: fn raised {model.raised[n]!r} for batch {n} "
                f"{model.batches[n]}; every caller of that batch gets that exception; "
                f"submit({c.item!r}) {c.outcome()}"
            )
        else:
            assert c.result == answer(c.item) and c.error is None, (
                f"§batch-routing: {setup}: submit({c.item!r}) (batch {n}: {model.batches[n]}) "
                f"must return {answer(c.item)!r}; it {c.outcome()}"
            )


@core
@rule("batch-full", "batch-routing", "batch-statistics")
@pytest.mark.parametrize("size", [8, 5])
async def test_stage2_batches_64_concurrent_callers_each_get_their_own_result(size: int) -> None:
    clock = ManualClock()
    model = Model(clock)
    items = [f"req-{n}" for n in range(64)]
    full, rest = divmod(64, size)
    with bounded(f"64 concurrent callers, max_batch_size={size}"):
        async with (
            anyio.create_task_group() as tg,
            serving(new_batcher(model, max_batch_size=size), model) as b,
        ):
            callers = [Caller(b, item) for item in items]
            for c in callers:
                tg.start_soon(c.run)  # all at once: no caller waits for another
            await settle()
            assert stats(b).sizes == (size,) * full and stats(b).queued == rest, (
                f"§batch-full: 64 callers at one instant, max_batch_size={size}: {full} full "
                f"batches at once and {rest} item(s) left waiting for the delay; got "
                f"statistics() {stats(b)}"
            )
            clock.advance(DELAY)
            await outcomes(callers, "64 concurrent callers")
            expect_results(callers, "§batch-routing: 64 concurrent callers")
            sent = sorted(item for batch in model.batches for item in batch)
            assert sent == sorted(items), f"§batch-routing: each item sent once, got {sent}"
            want = BatchStatistics(
                0, 0, full + (rest > 0), (size,) * full + ((rest,) if rest else ())
            )
            assert stats(b) == want, f"§batch-statistics: expected {want}, got {stats(b)}"


@extended
@rule("batch-routing")
@pytest.mark.parametrize("returned", [2, 4, 0], ids=["fewer", "more", "none"])
async def test_stage2_batches_a_wrong_number_of_results_fails_every_caller_of_the_batch(
    returned: int,
) -> None:
    clock = ManualClock()
    model = Model(clock)
    model.counts[0] = returned
    with bounded(f"a batch of 3 whose fn returned {returned} results"):
        async with (
            anyio.create_task_group() as tg,
            serving(new_batcher(model, max_batch_size=3), model) as b,
        ):
            callers = [await submit(tg, b, item) for item in ("a", "b", "c")]
            await outcomes(callers, f"fn returned {returned} results for 3 items")
            for c in callers:
                err = c.error
                assert isinstance(err, RuntimeError) and all(
                    re.search(rf"\b{n}\b", str(err)) for n in (3, returned)
                ), (
                    f"§batch-routing: fn returned {returned} results for a batch of 3 items: "
                    f"every caller of the batch gets a RuntimeError naming both counts; "
                    f"submit({c.item!r}) {c.outcome()}"
                )
            after = [await submit(tg, b, item) for item in ("d", "e", "f")]
            await outcomes(after, "the next batch")
            expect_results(after, "§batch-routing: the batcher keeps serving after a bad batch")


# -- errors ----------------------------------------------------------------------------


class Boom(Exception):
    """fn's own error."""


@core
@rule("batch-errors", "batch-concurrent")
@pytest.mark.parametrize("failing", [0, 1], ids=["first-fails", "second-fails"])
async def test_stage2_batches_an_exception_fails_exactly_the_callers_of_its_batch(
    failing: int,
) -> None:
    clock = ManualClock()
    model = Model(clock, held=True)
    boom = Boom(f"the model failed on batch {failing}")
    model.failures[failing] = boom
    with bounded("two batches in flight, one of which fails"):
        async with (
            anyio.create_task_group() as tg,
            serving(new_batcher(model, max_batch_size=2), model) as b,
        ):
            batches = [[await submit(tg, b, f"{n}.{k}") for k in range(2)] for n in range(2)]
            await settled(lambda: len(model.batches) == 2, "two full batches, both in flight")
            for n in (1, 0):
                model.release(n)
                await outcomes(batches[n], f"batch {n}")
            for c in batches[failing]:
                assert c.error is boom, (
                    f"§batch-errors: fn raised {boom!r} for batch {failing} "
                    f"{model.batches[failing]}: EVERY caller of that batch gets that exception; "
                    f"submit({c.item!r}) {c.outcome()}"
                )
            expect_results(
                batches[1 - failing],
                f"§batch-errors: batch {failing} failed; batch {1 - failing} is not its business",
            )
            after = [await submit(tg, b, item) for item in ("x", "y")]
            model.release(2)
            await outcomes(after, "a batch after the failed one")
            expect_results(after, "§batch-errors: the batcher keeps serving after fn raised")
            assert stats(b) == BatchStatistics(0, 0, 3, (2, 2, 2)), (
                f"§batch-statistics: three batches of 2 ended, one by an exception: expected "
                f"{BatchStatistics(0, 0, 3, (2, 2, 2))}, got {stats(b)}"
            )


# -- cancellation ----------------------------------------------------------------------


@core
@rule("batch-cancel")
async def test_stage2_batches_a_caller_cancelled_before_its_batch_is_sent_sends_nothing() -> None:
    clock = ManualClock()
    model = Model(clock)
    with bounded("a batch of 3 without the cancelled caller's item"):
        async with (
            anyio.create_task_group() as tg,
            serving(new_batcher(model, max_batch_size=3), model) as b,
        ):
            a = await submit(tg, b, "a")
            gone = await submit(tg, b, "gone")
            gone.cancel()
            await settled(lambda: gone.done, "the cancelled caller to leave submit()")
            assert gone.cancelled and stats(b).queued == 1, (
                f"§batch-cancel: a caller cancelled before its batch was sent takes its item "
                f"out of the queue: it {gone.outcome()}, statistics() {stats(b)}"
            )
            c = await submit(tg, b, "c")
            expect_nothing_sent(
                model,
                b,
                "§batch-cancel: 'a' and 'c' queued, 'gone' cancelled: 2 of "
                "max_batch_size=3 (a cancelled item does not count towards full)",
            )
            d = await submit(tg, b, "d")
            await expect_sent(
                model,
                [["a", "c", "d"]],
                clock.now_ns(),
                "§batch-cancel: the batch is a, c, d — the cancelled item is never sent",
            )
            await outcomes([a, c, d], "the batch without the cancelled item")
            expect_results([a, c, d], "§batch-cancel: a cancelled caller blocks no one")


@extended
@rule("batch-cancel", "batch-delay")
async def test_stage2_batches_the_delay_counts_from_the_oldest_item_left_after_a_cancel() -> None:
    clock = ManualClock()
    model = Model(clock)
    with bounded("the item left after a cancellation, at its own delay"):
        async with (
            anyio.create_task_group() as tg,
            serving(new_batcher(model, max_batch_size=8), model) as b,
        ):
            lone = await submit(tg, b, "lone")
            lone.cancel()
            await settled(lambda: lone.done, "the lone caller to leave submit()")
            clock.advance(2 * DELAY)
            await settle()
            expect_nothing_sent(
                model, b, "§batch-cancel: the only item was cancelled; past its delay"
            )
            t0 = clock.now_ns()
            oldest = await submit(tg, b, "oldest")
            clock.advance(DELAY // 4)
            kept = await submit(tg, b, "kept")
            oldest.cancel()
            await settled(lambda: oldest.done, "the oldest caller to leave submit()")
            clock.advance(DELAY - DELAY // 4)  # the cancelled item's delay
            await settle()
            expect_nothing_sent(
                model,
                b,
                f"§batch-cancel: the oldest item (at {t0}) was cancelled: the delay "
                f"now counts from 'kept' (at {t0 + DELAY // 4}); now {clock.now_ns()}",
            )
            clock.advance(DELAY // 4 - 1)
            await settle()
            expect_nothing_sent(model, b, "§batch-cancel: 1 ns before the delay of 'kept'")
            clock.advance(1)
            await expect_sent(
                model, [["kept"]], t0 + DELAY // 4 + DELAY, "§batch-delay: 'kept' at its delay"
            )
            await outcomes([kept], "'kept'")
            expect_results([kept], "§batch-cancel")


@extended
@rule("batch-cancel")
async def test_stage2_batches_a_caller_cancelled_after_its_batch_was_sent_blocks_no_one() -> None:
    clock = ManualClock()
    model = Model(clock, held=True)
    with bounded("a batch whose first caller was cancelled while fn ran"):
        async with (
            anyio.create_task_group() as tg,
            serving(new_batcher(model, max_batch_size=3), model) as b,
        ):
            callers = [await submit(tg, b, item) for item in ("a", "b", "c")]
            await settled(lambda: len(model.batches) == 1, "the full batch sent")
            callers[0].cancel()
            await settled(lambda: callers[0].done, "the cancelled caller to leave submit()")
            assert callers[0].cancelled, f"the cancelled caller {callers[0].outcome()}"
            assert stats(b).in_flight == 1, f"the batch is still in flight: {stats(b)}"
            model.release(0)
            await outcomes(callers[1:], "the callers left in the batch")
            expect_results(
                callers[1:],
                "§batch-cancel: the first caller was cancelled after the batch was sent: its "
                "result is dropped, the others get theirs",
            )
            more = [await submit(tg, b, item) for item in ("d", "e", "f")]
            model.release(1)
            await outcomes(more, "the next batch")
            expect_results(more, "§batch-cancel: the batcher keeps serving")
            assert stats(b) == BatchStatistics(0, 0, 2, (3, 3)), (
                f"§batch-statistics: two batches of 3 sent and done, got {stats(b)}"
            )


# -- batches overlap -------------------------------------------------------------------


@core
@rule("batch-concurrent", "batch-statistics")
async def test_stage2_batches_a_slow_batch_holds_back_neither_the_next_nor_its_callers() -> None:
    clock = ManualClock()
    model = Model(clock, held=True)
    with bounded("three batches in flight at once"):
        async with (
            anyio.create_task_group() as tg,
            serving(new_batcher(model, max_batch_size=2), model) as b,
        ):
            first = [await submit(tg, b, item) for item in ("a", "b")]
            await settled(lambda: len(model.batches) == 1, "the first batch sent")
            second = [await submit(tg, b, item) for item in ("c", "d")]
            await settled(
                lambda: len(model.batches) == 2,
                "§batch-concurrent: the second batch (full) sent while the first is still in fn",
            )
            third = [await submit(tg, b, "e")]
            clock.advance(DELAY)
            await settled(
                lambda: len(model.batches) == 3,
                "§batch-concurrent: the third batch (due) sent while two are still in fn",
            )
            await settle()
            assert stats(b) == BatchStatistics(0, 3, 3, (2, 2, 1)), (
                f"§batch-statistics: three batches in flight: expected "
                f"{BatchStatistics(0, 3, 3, (2, 2, 1))}, got {stats(b)}"
            )
            for n, group in ((2, third), (1, second), (0, first)):
                model.release(n)
                await outcomes(group, f"batch {n}")
                expect_results(group, f"§batch-concurrent: batch {n} released")
                waiting = [c.item for g in (first, second)[:n] for c in g if c.done]
                assert not waiting, (
                    f"§batch-concurrent: only batch {n} was released, yet {waiting} got outcomes"
                )
            assert stats(b) == BatchStatistics(0, 0, 3, (2, 2, 1)), (
                f"§batch-statistics: every batch done, got {stats(b)}"
            )


# -- closing ---------------------------------------------------------------------------


@core
@rule("batch-close")
@pytest.mark.parametrize(
    "how", ["normally", "by an exception"], ids=["normally", "by-an-exception"]
)
async def test_stage2_batches_leaving_the_block_sends_what_is_queued_and_waits(how: str) -> None:
    clock = ManualClock()
    model = Model(clock, held=True)
    b = new_batcher(model, max_batch_size=3)
    exited = False
    late: list[Caller] = []

    async def closer(tg: anyio.abc.TaskGroup) -> None:
        """While __aexit__ drains: check it, try a late submit, then let fn finish."""
        await settled(
            lambda: len(model.batches) == 2,
            f"§batch-close: leaving the block ({how}) sends the queued items at once, the "
            "clock not moved",
        )
        assert not exited, "§batch-close: __aexit__ returned while batches were in flight"
        late.append(await submit(tg, b, "late"))
        model.release_all()

    with bounded(f"the block left {how} to drain"):
        async with anyio.create_task_group() as tg:
            try:
                async with b:
                    in_flight = [await submit(tg, b, item) for item in ("a", "b", "c")]
                    queued = [await submit(tg, b, item) for item in ("d", "e")]
                    assert len(model.batches) == 1 and stats(b).queued == 2, (
                        f"one full batch held in fn, two items queued: {model.describe()}, "
                        f"statistics() {stats(b)}"
                    )
                    tg.start_soon(closer, tg)
                    if how == "by an exception":
                        raise Boom("the block failed")
            except Boom:
                pass
            except BaseExceptionGroup as group:
                if group.subgroup(Todo) is not None:
                    raise
                raise AssertionError(
                    f"§batch-close: the block's own exception propagates unchanged, not wrapped "
                    f"in a group: got {group!r}"
                ) from group
            else:
                assert how == "normally", "§batch-close: the block's exception must propagate"
            exited = True
            assert (
                model.batches == [["a", "b", "c"], ["d", "e"]] and model.times[1] == model.times[0]
            ), (
                f"§batch-close: the queued items are sent at once, when the block is left "
                f"(not at their delay); {model.describe()}"
            )
            assert all(e == "returned" for e in model.ended), (
                f"§batch-close: __aexit__ returns once every batch has ended: {model.ended}"
            )
            await outcomes(in_flight + queued, "the drained batches")
            expect_results(in_flight + queued, f"§batch-close: the block left {how}")
            assert late and isinstance(late[0].error, EngineClosed), (
                f"§batch-close: submit() while the batcher closes raises EngineClosed; "
                f"it {late[0].outcome() if late else 'never ran'}"
            )
            assert stats(b) == BatchStatistics(0, 0, 2, (3, 2)), f"closed: {stats(b)}"


def expect_capped_and_in_order(
    model: Model, callers: list[Caller], order: list[str], size: int, why: str
) -> None:
    """Every accepted item sent once, oldest first (``order``: as submit() was called),
    in batches of at most ``size``; each of their callers got its own result."""
    accepted = [c for c in callers if not isinstance(c.error, EngineClosed)]
    items = [i for i in order if i in {c.item for c in accepted}]
    # Batches sent at one instant run concurrently: fn may see them in either order.
    batches = sorted(model.batches, key=lambda batch: order.index(batch[0]))
    sent = [item for batch in batches for item in batch]
    assert all(len(batch) <= size for batch in model.batches) and sent == items, (
        f"{why}: every batch holds at most max_batch_size={size} items, the oldest first; "
        f"expected the items {items} in batches of at most {size}, got {model.describe()}"
    )
    expect_results(accepted, why)


@extended
@rule("batch-close", "batch-order")
async def test_stage2_batches_a_drain_of_more_than_a_batch_sends_several() -> None:
    clock = ManualClock()
    model = Model(clock)
    b = new_batcher(model, max_batch_size=2)
    order: list[str] = []
    callers = [Caller(b, item, order) for item in ("a", "b", "c", "d", "e")]
    with bounded("the block left with five items queued to drain"):
        async with anyio.create_task_group() as tg, b:
            for caller in callers:  # queued before the batcher's task runs (asyncio)
                tg.start_soon(caller.run)
            await anyio.lowlevel.checkpoint()
    await outcomes(callers, "the drained batches")
    expect_capped_and_in_order(model, callers, order, 2, "§batch-close: items queued at close")


@extended
@rule("batch-order", "batch-delay")
async def test_stage2_batches_items_queued_when_a_batch_falls_due_go_in_several() -> None:
    clock = ManualClock()
    model = Model(clock)
    b = new_batcher(model, max_batch_size=2)
    order: list[str] = []
    with bounded("a due batch with four items queued"):
        async with anyio.create_task_group() as tg, serving(b, model):
            first = await submit(tg, b, "a")
            order.append("a")
            callers = [first] + [Caller(b, item, order) for item in ("b", "c", "d")]
            for caller in callers[1:]:  # queued in the tick 'a' falls due
                tg.start_soon(caller.run)
            clock.advance(DELAY)
            await settle()
            clock.advance(DELAY)  # what was left (if 'a' went before the others queued)
            await outcomes(callers, "the due batches")
    expect_capped_and_in_order(
        model, callers, order, 2, "§batch-order: items queued when 'a' fell due"
    )


@extended
@rule("batch-close")
async def test_stage2_batches_leaving_by_cancellation_cancels_fn_and_tells_every_caller() -> None:
    clock = ManualClock()
    model = Model(clock, held=True)
    b = new_batcher(model, max_batch_size=2)
    entered = anyio.Event()
    callers: list[Caller] = []

    async def block(tg: anyio.abc.TaskGroup) -> None:
        async with b:
            callers.extend([await submit(tg, b, item) for item in ("a", "b", "c")])
            entered.set()
            await anyio.sleep_forever()

    with bounded("the block, cancelled, to return"):
        async with anyio.create_task_group() as tg:
            async with anyio.create_task_group() as runner:
                runner.start_soon(block, tg)
                await entered.wait()
                runner.cancel_scope.cancel()
            await outcomes(callers, "a cancelled batcher's callers")
    assert model.batches == [["a", "b"]] and model.ended == ["cancelled"], (
        f"§batch-close: the task running the block was cancelled: fn's call in flight is "
        f"cancelled and nothing more is sent; {model.describe()}, ended {model.ended}"
    )
    wrong = [c for c in callers if not isinstance(c.error, EngineClosed)]
    assert not wrong, "§batch-close: every caller still waiting gets EngineClosed:\n" + "\n".join(
        f"  submit({c.item!r}) {c.outcome()}" for c in wrong
    )
    with bounded("submit() after the block to raise", SETTLE_S), pytest.raises(EngineClosed):
        await b.submit("late")
        raise AssertionError("§batch-close: submit() after the block must raise EngineClosed")


@extended
@rule("batch-close")
async def test_stage2_batches_submit_outside_the_block_is_refused() -> None:
    clock = ManualClock()
    model = Model(clock)
    b = new_batcher(model, max_batch_size=2)
    with (
        bounded("submit() before the block to raise", SETTLE_S),
        pytest.raises(RuntimeError, match="async with"),
    ):
        await b.submit("early")
        raise AssertionError("§batch-close: submit() before `async with` must raise RuntimeError")
    with bounded("a batcher entered twice to raise", SETTLE_S):
        async with b:
            with pytest.raises(RuntimeError):
                async with b:
                    raise AssertionError("§batch-close: a batcher is entered once")
    with bounded("submit() after the block to raise", SETTLE_S), pytest.raises(EngineClosed):
        await b.submit("late")
        raise AssertionError("§batch-close: submit() after the block must raise EngineClosed")
    assert not model.batches, f"nothing was submitted: {model.describe()}"


# -- bad input -------------------------------------------------------------------------


async def _fn(items: Sequence[Any]) -> list[Any]:
    return list(items)


@extended
@rule("batch-bad-input")
@pytest.mark.parametrize(
    ("name", "value", "kind"),
    [
        ("max_batch_size", 0, ValueError),
        ("max_batch_size", -1, ValueError),
        ("max_batch_size", 2.0, TypeError),
        ("max_batch_size", "8", TypeError),
        ("max_batch_size", True, TypeError),
        ("max_queue_delay_ns", -1, ValueError),
        ("max_queue_delay_ns", 0.5, TypeError),
        ("max_queue_delay_ns", 1e6, TypeError),
        ("max_queue_delay_ns", None, TypeError),
        ("max_queue_delay_ns", True, TypeError),
        ("fn", None, ValueError),
        ("fn", "embed", ValueError),
        ("clock", None, ValueError),
        ("clock", "monotonic", ValueError),
    ],
)
async def test_stage2_batches_bad_input_names_the_parameter(
    name: str, value: object, kind: type[Exception]
) -> None:
    cls = stage().DynamicBatcher
    good: dict[str, Any] = {"max_batch_size": 1, "max_queue_delay_ns": 0, "clock": ManualClock()}
    cls(_fn, **good)  # the smallest valid values are fine
    args: dict[str, Any] = {"fn": _fn, **good, name: value}
    fn = args.pop("fn")
    with pytest.raises(kind) as caught:
        cls(fn, **args)
        raise AssertionError(
            f"§batch-bad-input: DynamicBatcher({name}={value!r}) must raise {kind.__name__}"
        )
    assert name in str(caught.value), (
        f"§batch-bad-input: DynamicBatcher({name}={value!r}) raised {caught.value!r}: the "
        f"message must name {name}"
    )


# -- prefix caching: the worked example, step by step ----------------------------------


@extended
@rule(
    "prefix-hit", "prefix-last-token", "prefix-keys", "prefix-lru", "prefix-preemption",
    "prefix-statistics",
)  # fmt: skip
def test_stage2_prefix_the_worked_example_step_by_step() -> None:
    t = run_of(prefix_model(num_blocks=9), max_num_seqs=4, max_num_batched_tokens=16)
    arrivals = {
        1: [Request("A", S + toks(200, 3), 2)],
        2: [Request("B", S + toks(300, 5), 5)],
        3: [Request("C", S, 5)],
        4: [Request("D", toks(400, 12), 5)],
    }
    # (scheduled, (lookups, queried, hits, cached blocks, evictions), why) of steps 1-4
    want = [
        ({"A": 11}, (1, 11, 0, 2, 0),
         "nothing is cached yet: A computes its 11 tokens; its blocks 0 and 1 are full and "
         "cached after the step"),
        ({"A": 1, "B": 5}, (2, 24, 8, 4, 0),
         "B's first two blocks are S's, cached: B shares them and computes its 5 tokens"),
        ({"B": 1, "C": 4}, (3, 32, 12, 4, 0),
         "C's prompt is S, all cached, but the block that holds its last token is computed "
         "again: C shares one block and computes 4 tokens into a block of its own, which "
         "stays uncached (its key is cached already)"),
        ({"B": 1, "C": 1, "D": 12}, (4, 44, 12, 6, 1),
         "D takes the two blocks never used, then the least recently freed: A's last "
         "block, whose key is evicted"),
    ]  # fmt: skip
    for n, (scheduled, counts, why) in enumerate(want, 1):
        t.submit(*arrivals[n])
        out = t.step()
        got = (dict(out.scheduled), t.b.cache_statistics())
        expect(
            got == (scheduled, PrefixCacheStatistics(*counts)),
            f"§prefix-hit: the README's worked example, step {n}: {why}. Expected scheduled "
            f"{scheduled} and {PrefixCacheStatistics(*counts)}; got {got[0]} and {got[1]}\n"
            f"{t.rows()}",
        )
    shared = (t.b.blocks_of("B")[0], t.b.blocks_of("C")[0])
    expect(
        shared[0] == shared[1] and t.b.blocks_of("B")[1] != t.b.blocks_of("C")[1],
        f"§prefix-last-token: after step 4, B and C share S's first block and not its second "
        f"(C computed its own); B holds {t.b.blocks_of('B')}, C {t.b.blocks_of('C')}",
    )
    t.run()
    t.assert_transparent()
    expect(
        t.hits["D"] == [0, 8],
        f"§prefix-preemption: D is preempted at step 5 and its recompute finds its first "
        f"two blocks still cached (8 tokens); its admissions were served {t.hits['D']}\n"
        f"{t.rows()}",
    )


# -- prefix caching: keys: chained, full blocks only, one block per key ----------------


@extended
@rule("prefix-keys")
def test_stage2_prefix_the_same_block_after_a_different_prefix_is_no_hit() -> None:
    x, y, z = toks(10, 4), toks(20, 4), toks(30, 4)
    t = run_of()
    t.submit(Request("XY", x + y, 1))
    t.step()
    cases = [("ZY", z + y + (1,), 9, "its block 1 holds XY's block 1's tokens, after a "
              "different block 0: a key names the whole prefix, not the block alone"),
             ("YX", y + x + (1,), 9, "the blocks of XY in the other order"),
             ("XY+", x + y + (1,), 1, "the same prefix: both blocks are hits")]  # fmt: skip
    for rid, prompt, want, why in cases:
        t.submit(Request(rid, prompt, 1))
        got = dict(t.step().scheduled)
        expect(
            got == {rid: want},
            f"§prefix-keys: after XY ({list(x + y)}) is cached, {rid} ({list(prompt)}) must "
            f"compute {want} tokens — {why}; step scheduled {got}\n{t.rows()}",
        )
    t.assert_transparent()


@extended
@rule("prefix-keys", "prefix-no-shared-writes")
def test_stage2_prefix_a_block_is_cached_once_the_step_that_fills_it_has_run() -> None:
    t = run_of(max_num_batched_tokens=32)
    t.submit(Request("A", (*S, 1), 6), Request("B", (*S, 2), 6))
    got = dict(t.step().scheduled)
    expect(
        got == {"A": 9, "B": 9} and not set(t.b.blocks_of("A")) & set(t.b.blocks_of("B")),
        "§prefix-no-shared-writes: A and B share S but are admitted in the same step: A's "
        "blocks are written in that step, so B cannot share them (nor A B's); both compute "
        f"9 tokens into blocks of their own. Scheduled {got}, A holds "
        f"{t.b.blocks_of('A')}, B {t.b.blocks_of('B')}",
    )
    t.submit(Request("C", (*S, 3), 2))
    got = dict(t.step().scheduled)
    a, b, c = (t.b.blocks_of(rid) for rid in "ABC")
    expect(
        got.get("C") == 1 and c[:2] == a[:2] and not set(c) & set(b),
        "§prefix-keys: one block per key, the first to fill it: A, scheduled before B, "
        f"cached S's two blocks; C shares A's, not B's, and computes 1 token. Scheduled "
        f"{got}; A holds {a}, B {b}, C {c}",
    )
    t.run()
    t.assert_transparent()


@extended
@rule("prefix-no-shared-writes", "prefix-hit")
def test_stage2_prefix_a_partial_block_is_never_shared() -> None:
    t = run_of()
    t.submit(Request("A", toks(10, 6), 8))  # one full block, one half full
    t.step()
    t.submit(Request("B", (*toks(10, 6), 99), 2), Request("C", toks(10, 6), 2))
    got = dict(t.step().scheduled)
    a = t.b.blocks_of("A")
    expect(
        got == {"A": 1, "B": 3, "C": 2},
        "§prefix-no-shared-writes: A's prompt is 6 tokens in blocks of 4: block 0 is full "
        "and cached, block 1 is partial — A writes its next tokens there — so it has no key "
        "and is never shared. B (A's prompt + 1) shares block 0 and computes 3 tokens, C "
        f"(A's prompt) shares block 0 and computes 2; scheduled {got}\n{t.rows()}",
    )
    for rid in "BC":
        mine = t.b.blocks_of(rid)
        expect(
            mine[0] == a[0] and a[1] not in mine,
            f"§prefix-no-shared-writes: {rid} shares A's block 0 ({a[0]}) and not its partial "
            f"block 1 ({a[1]}); it holds {mine}",
        )
    t.run()
    t.assert_transparent()


# -- prefix caching: hits and the last token -------------------------------------------


@extended
@rule("prefix-hit", "prefix-statistics")
def test_stage2_prefix_a_shared_system_prompt_saves_exactly_its_full_blocks() -> None:
    system = toks(100, 10)  # two full blocks of 4, and 2 tokens that share a block
    m = prefix_model(num_blocks=24)
    t = run_of(m, max_num_seqs=8, max_num_batched_tokens=64)
    first = [Request("r0", system + toks(200, 3), 4)]
    rest = [Request(f"r{i}", system + toks(200 + 10 * i, 3), 4) for i in range(1, 6)]
    t.submit(*first)
    t.step()
    t.submit(*rest)
    got = dict(t.step().scheduled)
    want = {"r0": 1, **{r.rid: 5 for r in rest}}
    expect(
        got == want,
        "§prefix-hit: r0 (a system prompt of 10 tokens + 3 of its own) cached the prompt's "
        "two full blocks; r1..r5 (the same system prompt, 3 tokens of their own) share "
        "them and compute 13 - 8 = 5 tokens each — the system prompt's last 2 tokens share "
        f"a block with each request's own and are computed; expected {want}, got {got}",
    )
    t.run()
    stats = t.b.cache_statistics()
    expect(
        (stats.lookups, stats.queried_tokens, stats.hit_tokens) == (6, 78, 40)
        and m.prefill_tokens == 78 - 40,
        "§prefix-statistics: 6 admissions queried 6 × 13 = 78 prompt tokens and 5 × 8 = 40 "
        f"were served from the cache, so the model prefilled 38; got {stats}, the model "
        f"prefilled {m.prefill_tokens}",
    )
    t.assert_transparent()


@extended
@rule("prefix-hit")
def test_stage2_prefix_tokens_served_from_the_cache_cost_no_budget() -> None:
    t = run_of(max_num_batched_tokens=8)
    t.submit(Request("A", (*S, 1), 6))
    t.step()
    t.step()  # A's prompt of 9 in chunks of 8 and 1: S's two blocks are cached
    t.submit(Request("B", S + toks(20, 5), 2), Request("C", toks(40, 3), 2))
    got = dict(t.step().scheduled)
    expect(
        got == {"A": 1, "B": 5, "C": 2},
        "§prefix-hit: budget 8: A decodes (1); B (S + 5 tokens: 13) is served S's 8 tokens "
        "from the cache and computes 5 — only those are charged — so C gets the 2 left; "
        f"expected {{'A': 1, 'B': 5, 'C': 2}}, got {got}\n{t.rows()}",
    )
    t.run()
    t.assert_transparent()


@extended
@rule("prefix-last-token")
@pytest.mark.parametrize(
    ("extra", "want", "why"),
    [
        pytest.param(0, 4, "exactly two full blocks, both cached: the block that holds "
                     "its last token is computed again, all 4 tokens of it", id="full-blocks"),
        pytest.param(1, 1, "two full blocks and one token: both blocks are hits, the last "
                     "token is computed", id="one-past"),
        pytest.param(-1, 3, "a block and 3 tokens: the first block is a hit; the second "
                     "is cached full, but this prompt fills 3 of its slots", id="one-short"),
    ],
)  # fmt: skip
def test_stage2_prefix_the_last_prompt_token_is_always_computed(
    extra: int, want: int, why: str
) -> None:
    t = run_of()
    t.submit(Request("first", (*S, 7), 1))  # caches S's two blocks
    t.step()
    prompt = S + (7,) * extra if extra >= 0 else S[:extra]
    t.submit(Request("again", prompt, 3))
    out = t.step()
    expect(
        dict(out.scheduled) == {"again": want} and "again" in out.tokens,
        f"§prefix-last-token: a prompt of {len(prompt)} tokens after S ({len(S)} tokens, two "
        f"blocks of 4) is cached — {why}: it computes {want} and the model samples its first "
        f"token; scheduled {dict(out.scheduled)}, emitted {dict(out.tokens)}",
    )
    t.run()
    t.assert_transparent()


@extended
@rule("prefix-hit")
def test_stage2_prefix_a_chat_turn_reuses_the_previous_turn_and_its_answer() -> None:
    t = run_of()
    first = Request("turn1", toks(10, 6), 7)
    t.submit(first)
    t.run()
    answer = tuple(t.streamed["turn1"])  # 6 + 6 tokens were in KV: three full blocks
    second = Request("turn2", first.prompt + answer + toks(50, 3), 2)
    t.submit(second)
    got = dict(t.step().scheduled)
    expect(
        got == {"turn2": 4},
        "§prefix-hit: turn 1 put its 6-token prompt and 6 of its 7 answer tokens in KV (the "
        "last token is never written): three full blocks, cached as they filled, generated "
        "tokens and all. Turn 2 (turn 1's prompt, its answer, 3 new tokens: 16) shares them "
        f"and computes 16 - 12 = 4 tokens; scheduled {got}",
    )
    t.run()
    t.assert_transparent()


# -- prefix caching: ref counts, the free queue, eviction ------------------------------


@extended
@rule("prefix-lru", "prefix-refcount", "prefix-statistics")
@pytest.mark.parametrize(
    ("again", "want", "why"),
    [
        pytest.param("X", 5, "X's blocks were freed first, so one of them is the one "
                     "evicted — its last block, released before its first: X's first block "
                     "is still a hit (4 tokens), its second is not", id="freed-first"),
        pytest.param("Y", 1, "Y's blocks were freed after X's: both are still cached (8 "
                     "tokens)", id="freed-last"),
    ],
)  # fmt: skip
def test_stage2_prefix_eviction_takes_the_least_recently_freed_block_first(
    again: str, want: int, why: str
) -> None:
    prompts = {"X": toks(10, 8), "Y": toks(30, 8)}
    t = run_of(prefix_model(num_blocks=7))
    t.run({1: [Request("X", prompts["X"], 1)], 2: [Request("Y", prompts["Y"], 1)]})
    # The free queue: the 3 blocks never used, then X's 2 (last first), then Y's 2.
    t.submit(Request("Z", toks(50, 16), 1))  # 4 blocks: the 3 never used, then 1 more
    t.step()
    stats = t.b.cache_statistics()
    expect(
        (stats.cached_blocks, stats.evictions, t.b.free_blocks()) == (7, 1, 7),
        "§prefix-lru: X and Y (8 tokens each) cached two blocks each and finished, then Z "
        "(16 tokens) took the 3 blocks never used and one cached block: 1 eviction, 7 "
        f"cached blocks (3 + Z's 4), 7 free; got {stats}, free {t.b.free_blocks()}",
    )
    rid = again + "2"
    t.submit(Request(rid, prompts[again] + (5,), 2))
    got = dict(t.step().scheduled)
    expect(
        got == {rid: want},
        f"§prefix-lru: {rid} is {again}'s prompt and one token more — {why}: it computes "
        f"{want}; scheduled {got}\n{t.rows()}",
    )
    expect(
        t.b.free_blocks() == 4,
        f"§prefix-lru: {rid} holds 3 blocks now, its hits among them: a cached free block "
        f"that a request reuses leaves the free queue; free_blocks() is "
        f"{t.b.free_blocks()}, expected 7 - 3 = 4",
    )
    t.submit(Request("W", toks(600, 16), 1))  # exactly the 4 blocks left
    t.run()
    t.assert_transparent()


@extended
@rule("prefix-refcount", "prefix-lru")
def test_stage2_prefix_a_reused_free_block_is_never_handed_out_again() -> None:
    t = run_of(prefix_model(num_blocks=6))
    t.run({1: [Request("A", S, 1)]})  # S's two blocks cached, then free
    t.submit(Request("B", S + toks(20, 4), 3))  # shares both, takes 1 + 1 more
    t.step()
    b = t.b.blocks_of("B")
    expect(
        t.b.free_blocks() == 6 - len(b) == 3,
        f"§prefix-lru: B shares S's two cached blocks, free until now, and takes one "
        f"new block: it holds {b}; the shared blocks left the free queue, so 6 - 3 = 3 "
        f"are free, got {t.b.free_blocks()}",
    )
    t.submit(Request("C", toks(50, 12), 2))  # every free block
    t.run()
    t.assert_transparent()


@extended
@rule("prefix-refcount", "prefix-transparency")
def test_stage2_prefix_aborting_one_of_two_sharers_leaves_the_other_its_blocks() -> None:
    t = run_of(prefix_model(num_blocks=7))
    t.submit(Request("A", (*S, 1), 8))
    t.step()
    t.submit(Request("B", (*S, 2), 8))
    t.step()
    a, b = t.b.blocks_of("A"), t.b.blocks_of("B")
    expect(a[:2] == b[:2], f"§prefix-hit: B shares S's two blocks with A: A {a}, B {b}")
    t.abort("A")  # checks held + free = num_blocks
    expect(
        t.b.blocks_of("B") == b and t.b.free_blocks() == 7 - len(b),
        f"§prefix-refcount: A is aborted: its own block goes back to the free queue, the "
        f"two it shares stay B's (their ref count drops to 1, not 0): B holds "
        f"{t.b.blocks_of('B')} (was {b}), free {t.b.free_blocks()}, expected {7 - len(b)}",
    )
    t.submit(Request("C", toks(300, 16), 2))  # needs every free block
    t.run()
    t.assert_transparent()  # B read its shared blocks to the end


# -- prefix caching: preemption --------------------------------------------------------


@extended
@rule("prefix-preemption", "prefix-lru", "prefix-transparency")
def test_stage2_prefix_a_preempted_request_recomputes_from_the_cache() -> None:
    t = run_of(prefix_model(num_blocks=5), max_num_batched_tokens=8)
    t.submit(Request("A", toks(10, 4), 9))
    t.step()
    t.submit(Request("B", toks(20, 9), 5))
    for _ in range(4):
        t.step()
    out = t.step()
    expect(
        out.preempted == ("B",),
        f"§prefix-stage1 (§preemption): at step 6 A needs a block and none is free: B, the "
        f"newest, gives way\n{t.rows()}",
    )
    t.run()
    resumed = t.outputs[9]  # step 10: A finished at step 9, and its blocks are free
    expect(
        dict(resumed.scheduled) == {"B": 4} and t.hits["B"] == [0, 8],
        "§prefix-preemption: B held two full blocks and a partial one when it was "
        "preempted; it released them last first, so A took the partial one and the two "
        "full ones stayed cached. B's recompute (its 9 prompt tokens and 3 it generated) "
        "shares them and computes 12 - 8 = 4 tokens, where stage 1 recomputes all 12; "
        f"step 10 scheduled {dict(resumed.scheduled)}, B's admissions were served "
        f"{t.hits['B']}\n{t.rows()}",
    )
    t.assert_transparent()
    expect(
        {m.rid: m.preemptions for m in t.b.metrics()} == {"A": 0, "B": 1},
        f"§prefix-stage1 (§metrics): B was preempted once: {t.b.metrics()}",
    )


@extended
@rule("prefix-hit", "prefix-transparency")
def test_stage2_prefix_a_lookup_stops_at_the_first_block_not_cached() -> None:
    """A key can stay cached behind one that is gone: B's third block (after the shared
    prefix P) outlives A's copies of P's blocks, which D evicts. C = P + B's next block +
    more must then share nothing: its lookup misses at block 0 and stops there."""
    t = run_of(prefix_model(num_blocks=10), max_num_seqs=4, max_num_batched_tokens=32)
    p, q, r = toks(100, 8), toks(50, 4), toks(60, 4)
    t.run(
        {
            1: [Request("A", p, 1), Request("B", (*p, *q, 9), 10)],
            2: [Request("D", toks(300, 24), 1)],
            3: [Request("C", (*p, *q, *r, 7), 3)],
        }
    )
    expect(
        t.hits["C"] == [0],
        "§prefix-hit: C's first block (P's first) is no longer cached, so its lookup stops "
        "there and shares nothing — not a later block whose key happens to be cached; C's "
        f"admissions were served {t.hits['C']} tokens\n{t.rows()}",
    )
    t.assert_transparent()


@extended
@rule("prefix-preemption", "prefix-stage1")
def test_stage2_prefix_victims_give_way_until_the_chunk_has_its_blocks() -> None:
    """Under priority, U's chunk needs two blocks and none is free: Y (the least
    important) frees one, which is not enough, so X gives way too."""
    t = run_of(
        prefix_model(num_blocks=6), max_num_seqs=4, max_num_batched_tokens=16, policy="priority"
    )
    t.run(
        {
            1: [Request("X", (1, 2), 10, priority=5), Request("Y", (3, 4), 10, priority=6)],
            2: [Request("U", toks(10, 24), 1, priority=0)],
        }
    )
    step3 = t.outputs[2]
    expect(
        (dict(step3.scheduled), step3.preempted) == ({"U": 10}, ("Y", "X")),
        "§prefix-preemption: at step 3 U's chunk (10 tokens) needs 2 blocks and none is "
        "free; victims are taken one at a time until it has them — Y, then X — expected "
        f"scheduled {{'U': 10}}, preempted ('Y', 'X'); got {dict(step3.scheduled)}, "
        f"{step3.preempted}\n{t.rows()}",
    )
    t.assert_transparent()


# -- prefix caching: any workload ------------------------------------------------------

Case = tuple[dict[str, Any], dict[int, list[Request]], dict[int, str]]


@st.composite
def shared_prefix_workloads(draw: st.DrawFn) -> Case:
    """The harness's ``shared_prefixes`` workload (a few common prefixes, suffixes of
    their own), arriving over a few steps, on a pool from barely enough for the largest
    request (preemptions) to plenty, with a few aborts."""
    block_size = draw(st.integers(1, 4), label="block_size")
    seqs = draw(st.integers(1, 4), label="max_num_seqs")
    budget = draw(st.integers(seqs, 16), label="max_num_batched_tokens")
    n = draw(st.integers(2, 8), label="requests")
    workload = shared_prefixes(
        n, n_prefixes=draw(st.integers(1, 2)), prefix_len=draw(st.integers(0, 12)),
        mean_output=4, max_output=8, suffix_len=(1, 6), vocab_size=50,
        seed=draw(st.integers(0, 2**16), label="seed"),
    )  # fmt: skip
    arrivals: dict[int, list[Request]] = {}
    for r in workload:
        arrivals.setdefault(draw(st.integers(1, 6)), []).append(r)
    worst = max(ceil_div(len(r.prompt) + r.max_new_tokens - 1, block_size) for r in workload)
    config = {
        "num_blocks": draw(st.integers(worst, worst * 3), label="num_blocks"),
        "block_size": block_size,
        "max_num_seqs": seqs,
        "max_num_batched_tokens": budget,
        "policy": draw(st.sampled_from(["fcfs", "priority"]), label="policy"),
    }
    rids = [r.rid for r in workload]
    aborts = draw(st.dictionaries(st.integers(1, 12), st.sampled_from(rids), max_size=2))
    return config, arrivals, aborts


def _config(num_blocks: int, budget: int = 16, block_size: int = 4) -> dict[str, Any]:
    return {"num_blocks": num_blocks, "block_size": block_size, "max_num_seqs": 4,
            "max_num_batched_tokens": budget, "policy": "fcfs"}  # fmt: skip


#: The preemption test's run: B is preempted holding two full blocks and a partial one.
PREEMPTED: Case = (
    _config(5, budget=8),
    {1: [Request("A", toks(10, 4), 9)], 2: [Request("B", toks(20, 9), 5)]},
    {},
)
#: The abort test's run: A, sharing S with B, is aborted while both decode.
ABORTED: Case = (
    _config(7),
    {1: [Request("A", (*S, 1), 8)], 2: [Request("B", (*S, 2), 8)],
     3: [Request("C", toks(300, 16), 2)]},
    {3: "A"},
)  # fmt: skip
#: Three sharers of S on a pool so tight that they preempt one another.
CROWDED: Case = (
    _config(6, budget=8),
    {1: [Request("A", (*S, 1), 9)], 2: [Request("B", (*S, 2), 9), Request("C", S, 9)]},
    {},
)  # fmt: skip


@extended
@rule("prefix-transparency", "prefix-stage1", "prefix-refcount", "prefix-no-shared-writes")
@given(case=shared_prefix_workloads())
@example(case=PREEMPTED)
@example(case=ABORTED)
@example(case=CROWDED)
@settings(max_examples=examples(at_ci=100))
def test_stage2_prefix_any_shared_prefix_workload_keeps_every_output(case: Case) -> None:
    config, arrivals, aborts = case
    config = dict(config)  # an explicit example's dict is reused
    t = run_of(prefix_model(config.pop("num_blocks"), config.pop("block_size")), **config)
    t.run(arrivals, aborts, max_steps=600)
    never = set(t.submitted) - set(t.finished)
    expect(not never, f"§prefix-stage1 (§finish): every request finishes once; never: {never}")
    reasons = {m.rid: m.finish_reason for m in t.b.metrics()}
    expect(
        reasons == t.finished and len(t.b.metrics()) == len(t.finished),
        f"§prefix-stage1 (§metrics): metrics() lists each finished request once, with its "
        f"reason: expected {t.finished}, got {reasons}",
    )
    expect(
        t.b.free_blocks() == t.m.num_blocks,
        f"§prefix-refcount: with every request finished, every block is free (cached or "
        f"not): free_blocks() is {t.b.free_blocks()} of {t.m.num_blocks}",
    )
    t.assert_transparent()


@st.composite
def distinct_prompt_runs(draw: st.DrawFn) -> tuple[dict[str, Any], list[tuple[int, str, Any]]]:
    """Requests whose prompts share no first token, on a pool with room for all of them
    at their longest (nobody is preempted, so nothing is ever looked up twice): what
    happens before each step — submissions (some with a priority, a stop token or a
    deadline) and aborts."""
    block_size = draw(st.integers(1, 4), label="block_size")
    seqs = draw(st.integers(1, 4), label="max_num_seqs")
    config: dict[str, Any] = {
        "block_size": block_size,
        "max_num_seqs": seqs,
        "max_num_batched_tokens": draw(st.integers(seqs, 12), label="budget"),
        "policy": draw(st.sampled_from(["fcfs", "priority"]), label="policy"),
    }
    events: list[tuple[int, str, Any]] = []
    pool = 0
    for i in range(draw(st.integers(1, 8), label="requests")):
        prompt, new = toks(100 * i + 1, draw(st.integers(1, 14))), draw(st.integers(1, 8))
        pool += ceil_div(len(prompt) + new - 1, block_size)
        at = draw(st.integers(1, 8))
        options: dict[str, Any] = {"priority": draw(st.integers(0, 2))}
        if draw(st.booleans()):
            options["deadline_ns"] = (at + draw(st.integers(0, 12))) * TICK_NS
        r = Request(f"r{i}", prompt, new, **options)
        if draw(st.booleans()):  # stop at its own 2nd token: some stop early, some never
            stop = {unbatched(r, block_size)[:2][-1]}
            r = Request(f"r{i}", prompt, new, stop_tokens=stop, **options)
        events.append((at, "submit", r))
        if draw(st.integers(0, 4)) == 0:
            events.append((at + draw(st.integers(0, 6)), "abort", r.rid))
    config["num_blocks"] = pool
    return config, sorted(events, key=lambda e: (e[0], e[1] == "abort"))


@extended
@rule("prefix-stage1")
@given(case=distinct_prompt_runs())
@settings(max_examples=examples(at_ci=60))
def test_stage2_prefix_with_nothing_shared_every_step_is_stage_ones(
    case: tuple[dict[str, Any], list[tuple[int, str, Any]]],
) -> None:
    config, events = case
    config = dict(config)
    block_size = config["block_size"]
    outputs = {r.rid: unbatched(r, block_size) for _, kind, r in events if kind == "submit"}
    rules = BatchingRules(outputs, **config)
    t = run_of(prefix_model(config.pop("num_blocks"), config.pop("block_size")), **config)
    last = max(at for at, _, _ in events)
    for n in range(1, 400):
        for at, kind, what in events:
            if at == n and kind == "submit":
                t.submit(what)
                rules.submit(what)
            elif at == n and what not in t.finished:
                t.abort(what)
                rules.abort(what)
        if n > last and not t.b.has_unfinished():
            break
        out = t.step()
        plan, preempted, tokens, finished = rules.step(n * TICK_NS)
        got = (list(out.scheduled.items()), tuple(out.preempted), dict(out.tokens),
               dict(out.finished))  # fmt: skip
        expect(
            got == (plan, preempted, tokens, finished),
            f"§prefix-stage1: with no prompt sharing a block, step {n} must be the one stage "
            f"1's rules make ({config}):\n  expected scheduled {plan}, preempted "
            f"{list(preempted)}, emitted {tokens}, finished {finished}\n  got      scheduled "
            f"{got[0]}, preempted {list(got[1])}, emitted {got[2]}, finished {got[3]}\n"
            f"{t.rows()[-2500:]}",
        )
    expect(not t.b.has_unfinished(), f"liveness: unfinished after 400 steps\n{t.rows()[-2000:]}")


class PrefixCacheMachine(stateful.RuleBasedStateMachine):
    """A prefix-caching batcher and :class:`PrefixRules` under random submissions (prompts
    that share prefixes, chat turns that extend an earlier request's prompt and answer),
    steps and aborts, compared after every rule: what each step schedules, preempts,
    emits and finishes; the queues; which positions share a block; the free count; the
    statistics; and, read off the batcher alone, ref counts and conservation."""

    def __init__(self) -> None:
        super().__init__()
        self.history: list[str] = []
        self.requests: list[Request] = []
        self.steps = 0

    @stateful.initialize(
        block_size=st.integers(1, 4), max_num_seqs=st.integers(1, 3),
        extra_budget=st.integers(0, 9), policy=st.sampled_from(["fcfs", "priority"]),
        spare=st.integers(0, 3),
    )  # fmt: skip
    def build(
        self, block_size: int, max_num_seqs: int, extra_budget: int, policy: Policy, spare: int
    ) -> None:
        num_blocks = ceil_div(LONGEST, block_size) + spare
        config: dict[str, Any] = {
            "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max_num_seqs + extra_budget,
            "num_blocks": num_blocks,
            "block_size": block_size,
            "policy": policy,
        }
        self.m = prefix_model(num_blocks, block_size)
        self.b = prefix_batcher(self.m, **{k: v for k, v in config.items() if "block" not in k})
        self.spec = PrefixRules(**config)
        self.history.append(f"PrefixCachingBatcher({config})")

    def fail(self, what: str) -> str:
        steps = "\n".join(f"    {h}" for h in self.history[-20:])
        return f"{what}\n  what happened (the last 20):\n{steps}"

    def _submit(self, prompt: tuple[int, ...], new: int, **options: Any) -> None:
        rid = f"r{len(self.requests)}"
        r = Request(rid, prompt, new, **options)
        self.history.append(
            f"before step {self.steps + 1}: submit {rid} (prompt {list(prompt)}, "
            f"max_new_tokens {new}, {options or 'no options'})"
        )
        if ceil_div(len(prompt) + new - 1, self.m.block_size) > self.m.num_blocks:
            with pytest.raises(RequestRejected):
                self.b.submit(r)
            self.history[-1] += ": refused (it could never finish)"
            return
        self.requests.append(r)
        self.b.submit(r)
        self.spec.submit(r, unbatched(r, self.m.block_size))

    @stateful.rule(
        base=st.integers(0, 1), cut=st.integers(0, 12), own=st.integers(0, 3),
        new=st.integers(1, 6), priority=st.integers(0, 2), stop=st.booleans(),
        deadline=st.none() | st.integers(0, 8),
    )  # fmt: skip
    def submit(
        self, base: int, cut: int, own: int, new: int, priority: int, stop: bool,
        deadline: int | None,
    ) -> None:  # fmt: skip
        i = len(self.requests)
        prompt = BASES[base][:cut] + toks(1000 + 10 * i, own if cut + own else 1)
        options: dict[str, Any] = {"priority": priority}
        if deadline is not None:
            options["deadline_ns"] = (self.steps + 1 + deadline) * TICK_NS
        if stop:  # its own 2nd token: some stop early, some never
            plain = Request("probe", prompt, new)
            options["stop_tokens"] = {unbatched(plain, self.m.block_size)[:2][-1]}
        self._submit(prompt, new, **options)

    @stateful.rule(index=st.integers(0, 50), own=st.integers(1, 3), new=st.integers(1, 6))
    def follow_up(self, index: int, own: int, new: int) -> None:
        """The next turn of a chat: an earlier request's prompt, its whole answer, more."""
        if not self.requests:
            return
        earlier = self.requests[index % len(self.requests)]
        answer = unbatched(earlier, self.m.block_size)
        self._submit(earlier.prompt + answer + toks(1000 + 10 * len(self.requests), own), new)

    @stateful.rule(index=st.integers(0, 50))
    def abort(self, index: int) -> None:
        if not self.requests:
            return
        rid = self.requests[index % len(self.requests)].rid
        self.history.append(f"before step {self.steps + 1}: abort {rid}")
        self.b.abort(rid)
        self.spec.abort(rid)

    @stateful.rule()
    def step(self) -> None:
        self.steps += 1
        out = self.b.step(self.steps * TICK_NS)
        plan, preempted, tokens, finished = self.spec.step(self.steps * TICK_NS)
        got = (list(out.scheduled.items()), tuple(out.preempted), dict(out.tokens),
               dict(out.finished))  # fmt: skip
        expect(
            got == (plan, preempted, tokens, finished),
            self.fail(
                f"step {self.steps} is not the one the rules make:\n"
                f"  expected scheduled {plan}, preempted {list(preempted)}, emitted {tokens}, "
                f"finished {finished}\n  got      scheduled {got[0]}, preempted "
                f"{list(got[1])}, emitted {got[2]}, finished {got[3]}\n  (a request admitted "
                "with a hit computes only what the cache did not have)"
            ),
        )
        self.history.append(f"step {self.steps}: scheduled {plan}, preempted {list(preempted)}")

    @stateful.rule()
    def run_out(self) -> None:
        """Step until nothing is left (the frees, the queue, what stays cached)."""
        for _ in range(60):
            if not self.spec.seqs:
                break
            self.step()

    @stateful.invariant()
    @stateful.precondition(lambda self: hasattr(self, "b"))
    def blocks_agree(self) -> None:
        rids = list(self.spec.seqs)
        tables = {rid: tuple(self.b.blocks_of(rid)) for rid in rids}
        holders: dict[int, int] = {}
        for rid in rids:
            for block in set(tables[rid]):
                holders[block] = holders.get(block, 0) + 1
        free = self.b.free_blocks()
        expect(
            len(holders) + free == self.m.num_blocks
            and all(len(set(t)) == len(t) for t in tables.values()),
            self.fail(
                f"§prefix-refcount: every block is held (by one request or several: its ref "
                f"count) or free, never both and never lost: {len(holders)} held + {free} "
                f"free != {self.m.num_blocks}; tables {tables}"
            ),
        )
        want = shape({rid: self.spec.seqs[rid].blocks for rid in rids})
        expect(
            shape(tables) == want,
            self.fail(
                "§prefix-hit: which positions share a block (blocks numbered by first "
                f"appearance; the same number is one block, held by each):\n  expected "
                f"{want}\n  got      {shape(tables)}"
            ),
        )
        expect(
            (list(self.b.running()), list(self.b.waiting()))
            == (self.spec.running, self.spec.waiting),
            self.fail(
                f"running {self.b.running()} and waiting {self.b.waiting()}: expected "
                f"{self.spec.running} and {self.spec.waiting}"
            ),
        )
        stats = self.b.cache_statistics()
        want_stats = self.spec.statistics()
        expect(
            free == len(self.spec.free) and stats == want_stats,
            self.fail(
                f"§prefix-lru / §prefix-statistics: expected {len(self.spec.free)} free "
                f"blocks and {want_stats}; got {free} and {stats}"
            ),
        )


def _build(block_size: int, max_num_seqs: int, extra_budget: int, policy: str, spare: int) -> Any:
    return ("build", {"block_size": block_size, "max_num_seqs": max_num_seqs,
                      "extra_budget": extra_budget, "policy": policy, "spare": spare})  # fmt: skip


def _submit(base: int, cut: int, own: int, new: int, priority: int = 0, stop: bool = False,
            deadline: int | None = None) -> Any:  # fmt: skip
    return ("submit", {"base": base, "cut": cut, "own": own, "new": new, "priority": priority,
                       "stop": stop, "deadline": deadline})  # fmt: skip


_STEP: Any = ("step", {})
_RUN_OUT: Any = ("run_out", {})

#: The walks every run of the model test replays before its random steps: the
#: boundaries random steps reach only sometimes.
PREFIX_WALKS: dict[str, Walk] = {
    # Two sharers of a prefix, one of them finished; a long request then needs the whole
    # pool: the least recently freed cached blocks go first, the shared ones last; a chat
    # turn on the first request finds what is left.
    "evicted": [
        _build(4, 2, 6, "fcfs", 0), _submit(0, 8, 1, 2), _STEP, _submit(0, 8, 2, 3), _STEP,
        _STEP, _submit(1, 12, 3, 5), _RUN_OUT, ("follow_up", {"index": 0, "own": 1, "new": 2}),
        _RUN_OUT,
    ],
    # Three requests sharing twelve tokens on a pool too small for all of them: a victim's
    # shared blocks free nothing, so the victims keep coming; each recompute is a hit.
    "crowded": [
        _build(2, 3, 3, "fcfs", 0), _submit(0, 12, 1, 5), _STEP, _submit(0, 12, 2, 5), _STEP,
        _submit(0, 12, 3, 5), _STEP, _STEP, _STEP, _STEP, _RUN_OUT,
    ],
    # Priorities, a deadline and an abort among sharers: the victim is the least important,
    # wherever it is; a deadline and an abort free shared blocks only when the last holder
    # goes.
    "priority": [
        _build(2, 2, 6, "priority", 0), _submit(0, 8, 1, 6, priority=2), _STEP, _STEP,
        _submit(0, 8, 3, 6, priority=0), _STEP, _STEP, _STEP, _STEP,
        _submit(0, 12, 0, 6, priority=1, deadline=4), _STEP, _STEP, ("abort", {"index": 1}),
        _STEP, _RUN_OUT,
    ],
}  # fmt: skip

TestStage2PrefixCacheMatchesTheModel = extended(
    rule(
        "prefix-keys", "prefix-hit", "prefix-last-token", "prefix-no-shared-writes",
        "prefix-refcount", "prefix-lru", "prefix-preemption", "prefix-statistics",
        "prefix-stage1",
    )(walked(PrefixCacheMachine, PREFIX_WALKS))
)  # fmt: skip
TestStage2PrefixCacheMatchesTheModel.settings = settings(stateful_step_count=40)


# -- prefix caching: bad input ---------------------------------------------------------


@extended
@rule("prefix-bad-input")
@pytest.mark.parametrize(
    ("name", "options"),
    [
        pytest.param("max_num_seqs", {"max_num_seqs": 0}, id="no-seqs"),
        pytest.param("max_num_batched_tokens", {"max_num_batched_tokens": 0}, id="no-budget"),
        pytest.param(
            "max_num_batched_tokens",
            {"max_num_seqs": 8, "max_num_batched_tokens": 7},
            id="budget-under-the-seqs",
        ),
        pytest.param("max_num_seqs", {"max_num_seqs": True}, id="seqs-a-bool"),
        pytest.param("num_blocks", {"num_blocks": 15}, id="not-the-models-pool"),
        pytest.param("block_size", {"block_size": 8}, id="not-the-models-blocks"),
        pytest.param("policy", {"policy": "lifo"}, id="unknown-policy"),
    ],
)
def test_stage2_prefix_bad_configurations_are_refused_by_name(
    name: str, options: dict[str, Any]
) -> None:
    m = prefix_model()
    config = {"max_num_seqs": 4, "max_num_batched_tokens": 16, "num_blocks": 16, "block_size": 4}
    config.update(options)
    with pytest.raises((ValueError, TypeError)) as caught:
        stage().PrefixCachingBatcher(m, **config)
    expect(
        name in str(caught.value),
        f"§prefix-bad-input: {options} must be refused naming {name!r}, got {caught.value!r}",
    )


@extended
@rule("prefix-bad-input")
def test_stage2_prefix_submit_rejects_duplicates_and_requests_that_could_never_finish() -> None:
    t = run_of(prefix_model(num_blocks=4))
    t.submit(Request("A", S, 9))  # 8 + 9 - 1 = 16 tokens in KV at most: the whole pool
    with pytest.raises(RequestRejected, match="A"):
        t.b.submit(Request("A", S, 2))
    with pytest.raises(RequestRejected, match="big"):
        t.b.submit(Request("big", S, 10))  # 17 tokens: 5 blocks of 4 > 4
    t.run()
    t.submit(Request("again", S, 9))  # S is cached: the same bound, and it still just fits
    with pytest.raises(RequestRejected, match="A"):
        t.b.submit(Request("A", S, 1))  # finished, still an id already submitted
    t.run()
    expect(
        t.finished == {"A": "length", "again": "length"} and t.hits["again"] == [4],
        f"§prefix-bad-input: a refused request changes nothing; A and again finish, again "
        f"served S's first block from the cache; finished {t.finished}, hits {t.hits}",
    )
    t.assert_transparent()
