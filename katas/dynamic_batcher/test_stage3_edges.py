"""Stage 3, the edges of a request's life in the router: when its id is in flight, and
what its stream does once it ended or its client left (see
katas/dynamic_batcher/README.md, "Stage 3").

Built as ``test_stage3.py`` builds its fleets: the ``Router`` over in-process replicas on
one ``ManualClock`` moved by virtual time, every step one ``STEP_NS``. Each test places
its request's end — finished, ended in error, refused by ``generate()`` — on an instant,
leaves the end unread, and then uses the id again, closes the old stream, or reads it.

Map: an id in flight (router-admission) · an id in flight is refused as such, before the
weight, the load and the replicas are looked at (router-admission) · a refused
``generate()`` admits nothing (router-admission) · reads after ``aclose()``
(client-leaves) · an old stream closed after its id was reused (client-leaves).
"""

from __future__ import annotations

import pytest

from katas._harness.marks import anyio_test, extended, rule
from katas._harness.story import expect, not_refused
from katas.dynamic_batcher._testing.engine import (
    STEP_NS,
    T0,
    Reader,
    admission,
    outcome_of_a_read,
    request,
)
from katas.dynamic_batcher._testing.fleet import Fleet, expect_whole
from katas.dynamic_batcher.api import Overloaded, ReplicaError

pytestmark = [pytest.mark.stage(3)]


@extended
@rule("router-admission", "relay")
@anyio_test
async def test_stage3_an_id_is_free_once_its_stream_ended_read_or_not() -> None:
    fleet = Fleet()
    done, failed = request("done", 4, 3), request("failed", 5, 6)
    want = fleet.expected([done, failed])
    fleet["b"].die_after("failed", 2)
    async with fleet.routing(max_failovers=0) as clients:
        router = clients.router
        old = {"done": router.generate(done), "failed": router.generate(failed)}  # a, b
        await fleet.time.advance_to(T0 + 10 * STEP_NS)
        story = (
            "'done' (3 tokens) finished on a at +3 steps, 'failed' ended in error when b "
            "died at its 2nd token (max_failovers=0); neither client has read anything yet"
        )
        new = {}
        for r in (done, failed):  # to c: a replica refuses an id it has seen
            with (
                clients.only("c"),
                not_refused(
                    f"router-admission: {story}. An id is in flight while its stream has not "
                    f"ended, whether its client read the end or not: generate({r.rid!r}) again "
                    "must be admitted",
                    ValueError,
                ),
            ):
                new[r.rid] = router.generate(r)
        outcomes = [await outcome_of_a_read(old["done"]) for _ in range(2)]
        outcomes += [await outcome_of_a_read(old["failed"]) for _ in range(3)]
        expect(
            outcomes,
            [
                f"a delivery {list(want['done'])} length",
                "StopAsyncIteration",
                f"a delivery {list(want['failed'][:2])} None",
                "raised ReplicaError",
                "StopAsyncIteration",
            ],
            f"relay: {story}; then both ids were used again. The old streams are still "
            "the old requests': 'done' delivers its tokens and 'length', then stops; "
            "'failed' its 2 tokens, then its ReplicaError, then stops. Reads of the old "
            "'done' (2), then of the old 'failed' (3)",
        )
        readers = {rid: await fleet.consume(stream) for rid, stream in new.items()}
    expect_whole(readers, want, f"{story}; then both were sent again, under the same ids")


@extended
@rule("router-admission", "router-statistics")
@anyio_test
async def test_stage3_an_id_in_flight_is_a_value_error_whatever_else_would_refuse_it() -> None:
    fleet = Fleet(names=("a",))
    async with fleet.routing(max_outstanding_tokens=20) as clients:
        router = clients.router
        first = router.generate(request("r1", 6, 7))  # 13 tokens on a
        before = router.statistics()
        again = {  # r1 again, under the same id, weighing
            "7 tokens (13 + 7 = 20, it fits)": request("r1", 3, 4),
            "8 tokens (13 + 8 = 21, one over the budget)": request("r1", 4, 4),
            "21 tokens (more than the budget alone)": request("r1", 10, 11),
        }
        got = {}
        for replicas in ("a up", "a draining"):
            if replicas == "a draining":
                router.replicas.drain("a")  # no replica is up and not draining
            for weighs, r in again.items():
                got[f"{replicas}, r1 weighing {weighs}"] = admission(router.generate, r)
        router.replicas.restore("a")
        story = (
            "one replica, a, max_outstanding_tokens=20, r1 (13 tokens) in flight on it; "
            "generate(r1) again, with a up, then with a draining"
        )
        expect(
            got,
            dict.fromkeys(got, "raised ValueError"),
            f"router-admission: {story}. The checks go in that order: an id in flight, too "
            "heavy, overloaded, no replica — so r1, in flight, is a ValueError whatever it "
            "weighs and wherever it could go. What each generate() raised",
        )
        expect(
            router.statistics(),
            before,
            f"router-admission, router-statistics: {story}; each raised ValueError: nothing "
            "was started, and none is a refusal of the router's own (refused counts its "
            "Overloaded). statistics() against what it was before",
        )
        reader = await fleet.consume(first)
    expect((reader.error, len(reader.tokens)), (None, 7), "r1, the one admitted, runs to its end")


@extended
@rule("router-admission")
@anyio_test
async def test_stage3_a_refused_generate_admits_nothing_and_leaves_its_id_free() -> None:
    fleet = Fleet(names=("a",))
    async with fleet.routing(max_outstanding_tokens=20) as clients:
        router = clients.router
        router.replicas.mark_down("a")
        with pytest.raises(ReplicaError):
            router.generate(request("r1", 3, 3))  # no replica up
        router.replicas.mark_up("a")
        with pytest.raises(ValueError, match="max_outstanding_tokens"):
            router.generate(request("r2", 10, 11))  # 21 tokens: it could never fit
        first = router.generate(request("r0", 6, 7))  # 13
        with pytest.raises(Overloaded):
            router.generate(request("r3", 6, 7))  # 13 + 13 > 20
        stats = router.statistics()
        story = (
            "one replica, a, max_outstanding_tokens=20: generate(r1) with a down raised "
            "ReplicaError, generate(r2) of 21 tokens ValueError, and with r0 (13 tokens) in "
            "flight generate(r3) of 13 Overloaded"
        )
        expect(
            (stats.routed, stats.outstanding),
            ({"a": 1}, {"a": 13}),
            f"router-admission: {story}. A refused generate() starts nothing: (routed, "
            "outstanding) count r0 alone",
        )
        await fleet.consume(first)
        for rid in ("r1", "r2", "r3"):
            with not_refused(
                f"router-admission: {story}; r0 has ended. {rid} was refused, never "
                f"admitted, so its id is not in flight: generate({rid!r}) must be admitted",
                ValueError,
            ):
                stream = router.generate(request(rid, 3, 3))
            reader = await fleet.consume(stream)
            expect((reader.error, len(reader.tokens)), (None, 3), f"{rid}, admitted at last")


@extended
@rule("client-leaves")
@anyio_test
async def test_stage3_reads_after_aclose_stop_whatever_the_stream_still_held() -> None:
    fleet = Fleet()
    fleet["b"].die_after("failed", 2)
    async with fleet.routing(max_failovers=0) as clients:
        router = clients.router
        streams = {
            "finished": router.generate(request("finished", 4, 3)),  # on a
            "failed": router.generate(request("failed", 5, 6)),  # on b, which dies
            "streaming": router.generate(request("streaming", 6, 50)),  # on c
        }
        await fleet.time.advance_to(T0 + 10 * STEP_NS)
        outcomes = {}
        for name, stream in streams.items():
            await stream.aclose()
            outcomes[name] = await outcome_of_a_read(stream)
        expect(
            outcomes,
            dict.fromkeys(streams, "StopAsyncIteration"),
            "client-leaves: reads after aclose() stop the iteration, whatever the stream "
            "still held for its client: 'finished' its last tokens and 'length', 'failed' "
            "its 2 tokens and its ReplicaError (b died, max_failovers=0), 'streaming' 10 "
            "tokens; none was read before aclose(). The read after aclose() of each",
        )
        expect(
            router.statistics().outstanding,
            {"a": 0, "b": 0, "c": 0},
            "client-leaves: every request ended or was left: nothing is outstanding",
        )


@extended
@rule("client-leaves", "router-admission")
@anyio_test
async def test_stage3_an_old_stream_closed_after_its_id_was_reused_leaves_the_new_one_alone() -> (
    None
):
    fleet = Fleet()
    again = request("r", 6, 8)  # the same id, another request
    want = fleet.expected([again])
    async with fleet.routing() as clients:
        router = clients.router
        old = router.generate(request("r", 4, 3))
        await fleet.time.advance_to(T0 + 5 * STEP_NS)  # r finished at +3 steps, unread
        with (  # to b: a replica refuses an id it has seen
            clients.only("b"),
            not_refused("router-admission: r finished: generate('r') again", ValueError),
        ):
            new = router.generate(again)
        reader = Reader(new, fleet.clock)
        clients.tasks.start_soon(reader.run)
        await fleet.time.advance_to(T0 + 7 * STEP_NS)  # two tokens of the new r
        await old.aclose()
        await fleet.time.settle()
        story = (
            "r finished on a at +3 steps, its end unread; at +5 steps a new request went "
            "out to b under the id r; at +7 steps, two of its tokens streamed, the client "
            "of the old r closed its stream"
        )
        expect(
            (router.replicas.replica_of("r"), sum(router.statistics().outstanding.values())),
            ("b", 8 - 2),
            f"client-leaves: {story}. Closing a stream ends its own request, and the old r "
            "had ended: the new r still runs, charged its budget left (replica_of('r'), "
            "outstanding tokens)",
        )
        with pytest.raises(ValueError, match="r"):
            router.generate(request("r", 2, 2))  # the new r is in flight
        await fleet.finish({"r": reader})
    expect_whole({"r": reader}, want, story)
