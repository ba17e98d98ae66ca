"""Stage 3: a router over replicas that die mid-stream (see
katas/dynamic_batcher/README.md, "Stage 3").

The ``Router`` runs over :class:`~katas.dynamic_batcher._testing.fleet.SimReplica`
replicas: your stage-2 engine over your prefix-caching batcher, in process, on one
``ManualClock`` moved by :class:`~katas._harness.virtual_time.VirtualTime`, every step
one ``STEP_NS``. A request alone on a replica gets its k-th token at ``k`` steps after
it reached the replica, so a test knows the instant of every token, and places each
fault on one: a replica killed as the n-th token of a request reaches the router, a
stream broken after n tokens, a replica stopped (SIGSTOP) between two tokens and
resumed after the router gave up on it. Every client's stream is compared with what its
request generates alone: nothing lost, nothing twice.

The stage's other suites: ``test_stage3_silence.py`` (silence, probes and the epoch),
``test_stage3_routes.py`` (``ReplicaSet``, the routing policy without I/O),
``test_stage3_edges.py`` (ids in flight, and streams after their end or their client's
``aclose()``) and ``test_stage3_fleet.py`` (properties drawn by hypothesis over whole
fleets, and real replica processes killed and stopped with real signals).

Map: relaying (relay) · admission (router-admission) · replicas that refuse
(replica-429) · failover (failover, failover-cap) · clients that leave (client-leaves) ·
draining (router-drain) · closing (router-close) · statistics (router-statistics) · bad
input (router-bad-input).
"""

from __future__ import annotations

import math
from typing import Any

import anyio
import anyio.abc
import pytest

from katas._harness.marks import anyio_test, core, extended, rule
from katas._harness.story import check, expect
from katas.dynamic_batcher._testing.engine import (
    STEP_NS,
    T0,
    Reader,
    ReadOnlyClock,
    expect_ending,
    request,
)
from katas.dynamic_batcher._testing.fleet import (
    STALL,
    WITHIN,
    Fleet,
    expect_whole,
    serving,
)
from katas.dynamic_batcher._testing.routes import not_a_number_of_its_kind, shared
from katas.dynamic_batcher.api import Overloaded, ReplicaError, Request, RouterStatistics

pytestmark = [pytest.mark.stage(3)]


@core
@rule("relay")
@anyio_test
async def test_stage3_each_client_gets_what_its_request_generates() -> None:
    fleet = Fleet()
    reqs = [request(f"r{i}", 5 + i, 6 + i, stop_tokens={3} if i == 2 else ()) for i in range(5)]
    want = fleet.expected(reqs)
    readers, _ = await fleet.serve(reqs)
    expect_whole(readers, want, "five requests over three healthy replicas")
    for rid, reader in readers.items():
        # the finish reason the replica sent
        stopped = want[rid] and want[rid][-1] == 3 and rid == "r2"
        expect_ending(rid, reader, "stop" if stopped else "length")


@core
@rule("relay")
@anyio_test
async def test_stage3_a_slow_client_gets_what_arrived_merged_into_one_read() -> None:
    fleet = Fleet()
    r = request("slow", 4, 8)
    want = fleet.expected([r])["slow"]
    async with fleet.routing() as clients:
        stream = clients.router.generate(r)
        await fleet.time.advance_to(T0 + 3 * STEP_NS)
        first = await stream.__anext__()
        assert first.tokens == want[:3] and first.finish_reason is None, (
            "three tokens arrived while the client read nothing: one read returns all "
            f"three, merged.\n  expected {list(want[:3])}\n  got      {first}"
        )
        await fleet.time.advance_to(T0 + 20 * STEP_NS)
        last = await stream.__anext__()
        assert last.tokens == want[3:] and last.finish_reason == "length", (
            f"the rest, with the finish reason: expected {list(want[3:])} 'length', got {last}"
        )
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()


@core
@rule("route-load")
@anyio_test
async def test_stage3_the_router_charges_a_replica_until_the_first_token_then_the_budget() -> None:
    fleet = Fleet()
    r = request("r", 10, 6)
    async with fleet.routing() as clients:
        stream = clients.router.generate(r)
        load = clients.router.statistics().outstanding
        assert load == {"a": 16, "b": 0, "c": 0}, (
            f"at generate(): a 10-token prompt with budget 6 weighs 16 on 'a'; got {load}"
        )
        await fleet.time.advance_to(T0 + STEP_NS)
        load = clients.router.statistics().outstanding
        assert load["a"] == 5, (
            f"the first token arrived at +{STEP_NS} ns: the prompt is done, 5 tokens of "
            f"budget left; expected load 5, got {load}"
        )
        await fleet.time.advance_to(T0 + 6 * STEP_NS)
        assert clients.router.statistics().outstanding["a"] == 0
        await fleet.consume(stream)


# -- admission -----------------------------------------------------------------------------


@core
@rule("router-admission")
@anyio_test
async def test_stage3_admission_takes_the_budget_exactly_and_refuses_one_token_more() -> None:
    fleet = Fleet()
    async with fleet.routing(max_outstanding_tokens=40, retry_after_ns=777) as clients:
        s1 = clients.router.generate(request("r1", 10, 10))  # 20
        try:
            s2 = clients.router.generate(request("r2", 10, 10))  # 40: exactly the budget
        except Overloaded as exc:
            raise AssertionError(
                "r1 weighs 20 and r2 20: 40 tokens outstanding is exactly "
                f"max_outstanding_tokens=40, and reaching it is admitted; got {exc!r}"
            ) from None
        with pytest.raises(Overloaded) as refused:
            clients.router.generate(request("r3", 1, 1))
        assert refused.value.retry_after_ns == 777, (
            "the router's 429 carries retry_after_ns as configured: expected 777, got "
            f"{refused.value.retry_after_ns}"
        )
        assert clients.router.statistics().refused == 1
        await fleet.time.advance_to(T0 + STEP_NS)  # both past their prefill: 9 + 9
        s3 = clients.router.generate(request("r3", 10, 10))  # 18 + 20 = 38
        for s in (s1, s2, s3):
            await fleet.consume(s)


@core
@rule("router-admission")
@anyio_test
async def test_stage3_admission_refuses_what_could_never_fit_and_a_duplicate_id() -> None:
    fleet = Fleet()
    async with fleet.routing(max_outstanding_tokens=40) as clients:
        with pytest.raises(ValueError, match="max_outstanding_tokens"):
            clients.router.generate(request("huge", 30, 11))
        s = clients.router.generate(request("r1", 3, 3))
        with pytest.raises(ValueError, match="r1"):
            clients.router.generate(request("r1", 3, 3))
        await fleet.consume(s)
        s = clients.router.generate(request("r1", 3, 3))  # finished: the id is free again
        await fleet.consume(s)


@core
@rule("router-admission")
@anyio_test
async def test_stage3_no_replica_up_and_not_draining_is_a_replica_error() -> None:
    fleet = Fleet(names=("a", "b"))
    async with fleet.routing() as clients:
        clients.router.replicas.drain("a")
        clients.router.replicas.mark_down("b")
        with pytest.raises(ReplicaError):
            clients.router.generate(request("r1", 3, 3))


@extended
@rule("router-admission", "router-statistics")
@anyio_test
async def test_stage3_admission_checks_the_id_the_weight_the_load_then_the_replicas() -> None:
    fleet = Fleet(names=("a",))
    async with fleet.routing(max_outstanding_tokens=20) as clients:
        router = clients.router
        first = router.generate(request("r1", 6, 7))  # weighs 13, stays on a
        drained = anyio.Event()

        async def drain() -> None:
            await router.drain("a")
            drained.set()

        clients.tasks.start_soon(drain)
        await fleet.time.settle()
        assert router.replicas.available() == [] and not drained.is_set(), (
            "setup: a drains with r1 in flight: no replica is up and not draining"
        )
        steps = [  # (request, what generate() must raise, why)
            (request("r1", 1, 1), ValueError, "r1 is in flight: the id comes first"),
            (request("huge", 10, 11), ValueError, "21 tokens > 20: it could never fit"),
            (request("r2", 6, 7), Overloaded, "13 + 13 > 20: overloaded before no replica"),
            (request("r3", 3, 4), ReplicaError, "13 + 7 fits: only then, no replica"),
        ]
        for r, error, why in steps:
            try:
                router.generate(r)
            except Exception as exc:
                got: object = exc
            else:
                got = "a stream"
            assert isinstance(got, error), (
                "router-admission: the checks go in that order: an id in flight, too heavy, "
                "overloaded, no replica. One replica, a, draining with r1 (13 tokens) in "
                f"flight, max_outstanding_tokens=20: generate({r.rid}, weighs "
                f"{len(r.prompt) + r.max_new_tokens}) must raise {error.__name__} ({why}); "
                f"got {got!r}"
            )
        assert router.statistics().refused == 1, (
            "router-statistics: refused counts the router's own Overloaded only (r2): got "
            f"{router.statistics().refused}"
        )
        await fleet.consume(first)
        await fleet.time.settle()
        assert drained.is_set(), "drain('a') returns once r1 has ended"


# -- replicas that refuse -----------------------------------------------------------------------


@extended
@rule("replica-429", "failover-cap")
@anyio_test
async def test_stage3_a_replica_429_costs_no_failover() -> None:
    fleet = Fleet(names=("a", "b"))
    r = request("r", 4, 8)
    want = fleet.expected([r])
    fleet["a"].refuse(1, 5_000)  # r's first attempt goes to b instead
    fleet["b"].break_stream("r", after=2)  # ... whose answer breaks: r's one failover
    readers, stats = await fleet.serve([r], max_failovers=1)
    expect_whole(
        readers,
        want,
        "max_failovers=1: a answered r with a 429, so r went to b (a 429 costs no "
        "failover); b's answer broke after 2 tokens: r's first failover, back to a",
    )
    assert stats.failovers == 1, f"one failover (b's broken answer), not the 429: {stats}"


@extended
@rule("failover")
@anyio_test
async def test_stage3_a_stream_that_ends_without_a_finish_reason_fails_over_at_once() -> None:
    fleet = Fleet(names=("a", "b"))
    r = request("r", 6, 12)
    want = fleet.expected([r])
    fleet["a"].end_quietly("r", after=3)  # a closes r's stream cleanly, unfinished
    async with fleet.routing([r]) as clients:
        await fleet.time.advance_to(T0 + 8 * STEP_NS)
        on_b = [x.rid.partition("#")[0] for x in fleet["b"].seen]
        await clients.finish()
    assert on_b == ["r"], (
        "a's stream of r ended after 3 tokens with no finish reason: that is a failure "
        f"like a broken one, so r fails over to b at that instant — not after the "
        f"{STALL // STEP_NS}-step silence timeout. By +{8 * STEP_NS} ns b had seen {on_b}"
    )
    expect_whole(clients.readers, want, "a ended r's stream quietly after 3 tokens")


@extended
@rule("replica-429")
@anyio_test
async def test_stage3_a_replica_that_refuses_is_skipped_not_failed() -> None:
    fleet = Fleet()
    r = request("r", 4, 4)
    want = fleet.expected([r])
    fleet["a"].refuse(1, 5_000)
    readers, stats = await fleet.serve([r])
    expect_whole(readers, want, "a answered 429 at the first read")
    assert [x.rid for x in fleet["b"].seen] == ["r#1"], (
        "a refused: the request goes to the next replica, b, as its second attempt (id "
        f"'r#1'); b saw {fleet['b'].seen}"
    )
    assert stats.down == () and stats.failovers == 0 and stats.refused == 0, (
        "a 429 is not a failure: nothing is down and nothing failed over; nor is it a "
        f"refusal of the router's (`refused` counts its own Overloaded); got {stats}"
    )


@extended
@rule("replica-429", "router-statistics")
@anyio_test
async def test_stage3_when_every_replica_refuses_the_read_raises_the_smallest_retry_hint() -> None:
    fleet = Fleet()
    for name, hint in (("a", 9_000), ("b", 4_000), ("c", 6_000)):
        fleet[name].refuse(1, hint)
    async with fleet.routing() as clients:
        stream = clients.router.generate(request("r", 4, 4))
        with pytest.raises(Overloaded) as refused:
            await stream.__anext__()
        assert refused.value.retry_after_ns == 4_000, (
            "a, b and c answered 429 with hints 9000, 4000 and 6000 ns: the client may "
            f"retry at the first of them, 4000; got {refused.value.retry_after_ns}"
        )
        stats = clients.router.statistics()
        expect(
            (stats.down, stats.refused, stats.failovers, stats.routed),
            ((), 0, 0, {"a": 1, "b": 1, "c": 1}),
            "replica-429, router-statistics: every replica refused r, so its read raised "
            "Overloaded; yet the replicas' 429s are no failure (nothing down, no failover) "
            "and not the router's own Overloaded (refused counts generate()'s alone), and "
            "each of r's three attempts was started, one on each replica, refused or not: "
            "(down, refused, failovers, routed)",
        )


# -- failover ----------------------------------------------------------------------------------


@core
@rule("failover", "route-load", "route-history")
@anyio_test
async def test_stage3_a_replica_dying_mid_stream_is_continued_elsewhere_exactly_once() -> None:
    fleet = Fleet()
    r = request("r", 9, 12, priority=3, stop_tokens={1_001})  # a stop token never generated
    want = fleet.expected([r])
    fleet["a"].die_after("r", 5)
    async with fleet.routing([r]) as clients:
        await fleet.time.advance_to(T0 + 5 * STEP_NS)
        first = [(x.rid, x.priority, x.stop_tokens) for x in fleet["a"].seen]
        assert first == [("r", 3, frozenset({1_001}))], (
            "the first attempt is the request itself, its priority and stop tokens "
            f"included: a saw {first}"
        )
        seen = [
            (x.rid, x.prompt, x.max_new_tokens, x.priority, x.stop_tokens) for x in fleet["b"].seen
        ]
        resubmitted = ("r#1", r.prompt + want["r"][:5], 12 - 5, 3, frozenset({1_001}))
        assert seen == [resubmitted], (
            "a died as the 5th token of r reached the router: at that instant r is sent "
            "to b as its prompt plus the 5 tokens already streamed, with 7 tokens of "
            "budget left, its priority and stop tokens, under the id of its second "
            "attempt, 'r#1' (id, prompt, budget, priority, stop tokens).\n  expected b to see "
            f"{[resubmitted]}\n  b saw            {seen}"
        )
        loads = clients.router.statistics().outstanding
        assert loads == {"a": 0, "b": 9 + 5 + 7, "c": 0}, (
            "at the failover a's charge is released and b is charged for the resubmission: "
            f"its 14-token prompt and 7 tokens of budget. Expected {{'a': 0, 'b': 21, "
            f"'c': 0}}, got {loads}"
        )
        await fleet.time.advance_to(T0 + 6 * STEP_NS)  # the first token of r#1, from b
        expect(
            (
                clients.router.statistics().outstanding["b"],
                clients.router.replicas.matched_blocks("b", resubmitted[1]),
            ),
            (7 - 1, len(resubmitted[1]) // fleet.block_size),
            "route-load, route-history: b runs the resubmission, so that is what it is "
            "charged with and what it remembers. One step after the failover b streamed its "
            "first token of r#1: r weighs the budget left, 12 - 5 - 1 = 6 tokens, and b's "
            "history holds every full block of the 14-token prompt it was sent, r's "
            "prompt and the 5 tokens a streamed. (b's load, b's matched blocks of that "
            "prompt)",
        )
        await clients.finish()
    expect_whole(clients.readers, want, "a died after streaming 5 of 12 tokens")


@extended
@rule("failover")
@anyio_test
async def test_stage3_no_attempt_carries_the_clients_arrival_or_deadline() -> None:
    """The router forwards a request's prompt, budget, stop tokens and priority, not its
    ``arrival_ns`` or ``deadline_ns``: each replica stamps its own arrival, and an instant
    of the client's means nothing on a replica's clock. The first attempt as much as the
    attempts after a failover."""
    fleet = Fleet()
    plain = request("r", 6, 12, priority=2)
    r = Request("r", plain.prompt, 12, priority=2, arrival_ns=T0 - 7, deadline_ns=T0 + 3 * STEP_NS)
    want = fleet.expected([plain])
    fleet["a"].die_after("r", 5)
    async with fleet.routing([r]) as clients:
        await fleet.time.advance_to(T0 + 5 * STEP_NS)
        sent = [
            (name, x.rid, x.priority, x.arrival_ns == r.arrival_ns, x.deadline_ns)
            for name in fleet.names
            for x in fleet[name].seen
        ]
        expect(
            sent,
            [("a", "r", 2, False, None), ("b", "r#1", 2, False, None)],
            f"r arrived with arrival_ns={r.arrival_ns} and deadline_ns={r.deadline_ns} (3 "
            "steps after T0) and priority 2; a died at r's 5th token. Each attempt carries "
            "the priority but neither the client's arrival nor its deadline: (replica, id, "
            "priority, arrival_ns is the client's, deadline_ns) of every attempt",
        )
        await clients.finish()
    expect_whole(clients.readers, want, "r's deadline was the client's: no replica ends r by it")


@extended
@rule("failover", "route-affinity")
@anyio_test
@pytest.mark.parametrize("case", ["threshold", "longer-match"])
async def test_stage3_a_failover_is_routed_for_the_prompt_it_resubmits(case: str) -> None:
    """The failover is picked as usual for what the next replica will prefill — the
    prompt and every token accepted — not for the client's prompt: its full blocks set
    the affinity threshold, and their keys are what a replica's history may match."""
    names = ("a", "b", "c") if case == "threshold" else ("a", "c", "b")
    fleet = Fleet(names=names)
    p = shared(1, 2, 0, 0)  # 8 tokens: two full blocks
    r = Request("r", p, 12)
    tokens = fleet.expected([r])["r"]
    resubmitted = p + tokens[:8]  # four full blocks, p's two first
    threshold = 0.75 if case == "threshold" else 0.5
    fleet["a"].die_after("r", 8)
    async with fleet.routing(affinity_threshold=threshold) as clients:
        with clients.only("c"):
            await fleet.consume(clients.router.generate(Request("seed-c", p, 2)))
        if case == "longer-match":
            with clients.only("b"):
                await fleet.consume(clients.router.generate(Request("seed-b", resubmitted, 2)))
        with clients.only("a"):
            clients.start([r])
        await clients.finish()
        stats = clients.router.statistics()
    went = [(name, x.rid) for name in names for x in fleet[name].seen if x.rid[0] == "r"]
    if case == "threshold":
        story = (
            "c was sent r's 8-token prompt before (2 full blocks); r ran on a, which died at "
            "its 8th token. The resubmission, prompt + 8 tokens, has 4 full blocks, of which "
            "c remembers 2: below affinity_threshold=0.75 x 4, so r#1 goes to the least "
            "loaded, b (b and c idle, b first)"
        )
    else:
        story = (
            "replicas a, c, b; c was sent r's prompt (2 blocks), b the prompt + the 8 tokens "
            "r goes on to generate (4 blocks); r ran on a, which died at its 8th token. The "
            "resubmission's 4 full blocks match 4 on b and 2 on c: r#1 goes to b by affinity"
        )
    expect(
        (went, stats.by_affinity),
        ([("a", "r"), ("b", "r#1")], 0 if case == "threshold" else 1),
        f"{story}. (attempts of r as (replica, id), by_affinity)",
    )
    expect_whole(clients.readers, {"r": tokens}, story)


@extended
@rule("failover")
@anyio_test
async def test_stage3_a_replica_that_had_the_request_takes_it_again_under_a_new_id() -> None:
    fleet = Fleet(names=("a", "b"))
    r = request("r", 6, 12)
    want = fleet.expected([r])
    fleet["a"].break_stream("r", after=2)  # a lives on, marked down
    fleet["b"].die_after("r", 3)
    async with fleet.routing([r]) as clients:
        await fleet.time.advance_to(T0 + 2 * STEP_NS)
        await clients.router.check_health()  # a answers: up again
        await clients.finish()
    expect_whole(clients.readers, want, "a broke r's stream at token 2; b died at r's 5th token")
    ids = [x.rid for x in fleet["a"].seen]
    assert ids == ["r", "r#2"], (
        "r came back to a on its third attempt: a replica refuses an id it has seen, so every "
        f"attempt after the first goes out as rid#n. a saw {ids}, expected ['r', 'r#2']"
    )


@core
@rule("failover")
@anyio_test
async def test_stage3_every_request_on_a_dead_replica_fails_over_at_that_instant() -> None:
    fleet = Fleet(names=("a", "b", "c"))
    reqs = [request(f"r{i}", 4 + i, 10) for i in range(6)]  # two per replica
    want = fleet.expected(reqs)
    async with fleet.routing(reqs) as clients:
        on_a = sorted(x.rid for x in fleet["a"].seen) or sorted(
            rid for rid in want if clients.router.replicas.replica_of(rid) == "a"
        )
        await fleet.time.advance_to(T0 + 3 * STEP_NS + 1)
        on_a = sorted(x.rid for x in fleet["a"].seen)
        assert len(on_a) == 2, f"expected two requests on a, got {on_a}"
        fleet["a"].kill()
        await fleet.time.settle()
        moved = sorted(
            x.rid.partition("#")[0]
            for n in ("b", "c")
            for x in fleet[n].seen
            if x.rid.partition("#")[0] in on_a
        )
        assert moved == on_a, (
            f"a was killed at +{3 * STEP_NS + 1} ns with {on_a} in flight: each fails over "
            f"at that instant, once. Resubmitted by then: {moved}"
        )
        stats = await clients.finish()
    expect_whole(clients.readers, want, "a killed with two requests in flight")
    assert stats.failovers == 2 and stats.down == ("a",), (
        f"two failovers, a down: got failovers={stats.failovers}, down={stats.down}"
    )


@core
@rule("failover")
@anyio_test
async def test_stage3_a_broken_answer_is_a_replica_failure_not_a_crash() -> None:
    fleet = Fleet()
    r = request("r", 6, 9)
    want = fleet.expected([r])
    fleet["a"].break_stream("r", after=3)
    readers, stats = await fleet.serve([r])
    expect_whole(readers, want, "a's answer broke (a truncated event) after 3 tokens")
    assert stats.down == ("a",), f"a replica whose answer broke is down: got down={stats.down}"


@extended
@rule("failover")
@anyio_test
@pytest.mark.parametrize("max_failovers", [3, 0])
async def test_stage3_a_replica_dying_after_its_last_token_ends_the_stream_unresubmitted(
    max_failovers: int,
) -> None:
    fleet = Fleet()
    r = request("r", 5, 6)
    want = fleet.expected([r])
    fleet["a"].die_after("r", 6)
    readers, stats = await fleet.serve([r], max_failovers=max_failovers)
    story = (
        f"a died right after the 6th and last token, before its finish event "
        f"(max_failovers={max_failovers})"
    )
    expect_whole(readers, want, story)
    assert readers["r"].reason == "length", (
        f"{story}: no budget left, so the stream finishes with 'length' — the failover cap "
        f"does not apply to a request that is over; got {readers['r'].reason!r}"
    )
    others = [x for n in ("b", "c") for x in fleet[n].seen]
    assert others == [], f"nothing is left to generate, so nothing is resubmitted: {others}"
    assert stats.failovers == 0 and stats.down == ("a",), (
        f"{story}: a is down, but no request failed over; got failovers={stats.failovers}, "
        f"down={stats.down}"
    )


@extended
@rule("failover", "failover-cap", "router-statistics")
@anyio_test
@pytest.mark.parametrize("max_failovers", [3, 0])
async def test_stage3_a_replica_dying_right_after_a_stop_token_ends_the_stream_with_stop(
    max_failovers: int,
) -> None:
    fleet = Fleet()
    plain = request("r", 6, 12)
    tokens = fleet.expected([plain])["r"]
    k = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])  # a fresh token
    r = request("r", 6, 12, stop_tokens={tokens[k]})
    fleet["a"].die_after("r", k + 1)  # dies with the stop token, before its finish event
    readers, stats = await fleet.serve([r], max_failovers=max_failovers)
    story = f"a died as stop token {tokens[k]} arrived (max_failovers={max_failovers})"
    expect_whole(readers, {"r": tokens[: k + 1]}, story)
    assert readers["r"].reason == "stop", (
        f"{story}: the last token accepted was a stop token: the request is over, reason "
        f"'stop', whatever the failover cap, though budget is left; got "
        f"{readers['r'].reason!r}"
    )
    resent = [x.rid for n in ("b", "c") for x in fleet[n].seen]
    assert resent == [], f"{story}: a finished request is not resubmitted: {resent}"
    assert stats.failovers == 0 and stats.down == ("a",), (
        f"router-statistics: {story}: a is down, but a request that ended with its stop "
        f"token did not fail over; got failovers={stats.failovers}, down={stats.down}"
    )


@core
@rule("failover")
@anyio_test
async def test_stage3_a_stream_that_breaks_moves_every_request_off_its_replica() -> None:
    fleet = Fleet()
    reqs = [request("r1", 4, 12), request("r2", 5, 12), request("r3", 6, 12)]
    want = fleet.expected(reqs)
    async with fleet.routing(reqs[:2], balance_abs_tokens=1_000) as clients:  # r1 on a, r2 on b
        clients.router.replicas.drain("b")
        clients.router.replicas.drain("c")
        clients.start(reqs[2:])  # r3 on a too
        clients.router.replicas.restore("b")
        clients.router.replicas.restore("c")
        on_a = sorted(x.rid for x in fleet["a"].seen) or ["r1", "r3"]
        fleet["a"].break_stream("r1", after=3)  # only r1's answer breaks; a lives on

        def resubmitted() -> list[str]:
            return sorted(x.rid for n in ("b", "c") for x in fleet[n].seen if x.rid.endswith("#1"))

        await fleet.time.run_until(
            lambda: bool(resubmitted()), within_ns=WITHIN, what="r1's stream to break"
        )
        assert resubmitted() == ["r1#1", "r3#1"], (
            "r1 and r3 ran on a; r1's stream broke after 3 tokens: a is down, so every "
            f"request on it fails over at that instant, r3 too. Resubmitted: {resubmitted()}"
        )
        await clients.finish()
    assert sorted(on_a) == ["r1", "r3"]
    expect_whole(clients.readers, want, "r1's stream on a broke after 3 tokens; r3 was on a too")


@extended
@rule("relay", "failover-cap")
@anyio_test
async def test_stage3_a_stream_that_ends_in_error_first_delivers_what_it_accepted() -> None:
    fleet = Fleet()
    r = request("r", 4, 12)
    want = fleet.expected([r])["r"]
    fleet["a"].die_after("r", 3)
    async with fleet.routing(max_failovers=0) as clients:
        stream = clients.router.generate(r)
        await fleet.time.advance_to(T0 + 10 * STEP_NS)  # the client read nothing yet
        try:
            first = await stream.__anext__()
        except ReplicaError as exc:
            raise AssertionError(
                "the stream ended in error after the router accepted 3 tokens the client "
                f"had not read: its first read delivers them; it raised {exc!r} instead"
            ) from None
        assert first.tokens == want[:3], (
            "a died after 3 tokens and max_failovers=0 ends the stream in error; the "
            "client, which had read nothing, first gets the 3 tokens the router "
            f"accepted. Expected {list(want[:3])}, got {first}"
        )
        with pytest.raises(ReplicaError):
            await stream.__anext__()
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()


@extended
@rule("relay")
@anyio_test
async def test_stage3_the_router_accepts_no_token_past_the_budget() -> None:
    fleet = Fleet()
    r = request("r", 4, 6)
    want = fleet.expected([r])
    for sim in fleet.replicas.values():
        sim.babble("r")  # its last event carries a 7th token
    readers, _ = await fleet.serve([r])
    expect_whole(readers, want, "the replica sent 7 tokens for max_new_tokens=6")


@extended
@rule("replica-429")
@anyio_test
async def test_stage3_a_failover_forgets_the_refusals_before_it() -> None:
    fleet = Fleet(names=("a", "b"))
    r = request("r", 4, 8)
    want = fleet.expected([r])
    fleet["a"].refuse(1, 5_000)  # a refuses once: r goes to b
    fleet["b"].die_after("r", 0)  # b dies before r's first event
    readers, _ = await fleet.serve([r])
    expect_whole(
        readers,
        want,
        "a answered 429, b took r and died before its first token: the failover is a new "
        "start, a's old refusal no longer counts, and a takes r",
    )


@extended
@rule("failover-cap", "router-statistics")
@anyio_test
async def test_stage3_a_request_fails_over_at_most_max_failovers_times() -> None:
    for cap, survives in ((0, False), (1, False), (2, True)):
        fleet = Fleet()
        r = request("r", 6, 12)
        want = fleet.expected([r])
        fleet["a"].die_after("r", 2)
        fleet["b"].die_after("r", 2)  # b's own 2nd token: the request's 4th
        readers, stats = await fleet.serve([r], max_failovers=cap)
        reader = readers["r"]
        story = f"a died at r's token 2, then b at r's token 4, max_failovers={cap}"
        if survives:
            expect_whole(readers, want, story)
        else:
            assert isinstance(reader.error, ReplicaError), (
                f"{story}: failure {cap + 1} finds the cap reached and ends the stream with "
                f"ReplicaError; it ended {reader.ended}"
            )
            seen = 2 * (cap + 1)
            assert reader.tokens == want["r"][:seen], (
                f"{story}: the tokens before the end are still delivered once: expected "
                f"{list(want['r'][:seen])}, got {list(reader.tokens)}"
            )
        assert stats.failovers == cap, (
            f"router-statistics: {story}: failovers counts each failure under the cap, so "
            f"{cap}; the failure that finds the cap reached ends the stream and is not a "
            f"failover. Got failovers={stats.failovers}"
        )


# -- clients that leave ------------------------------------------------------------------------


@core
@rule("client-leaves")
@anyio_test
async def test_stage3_a_client_that_leaves_ends_its_attempt_at_once() -> None:
    fleet = Fleet()
    async with fleet.routing() as clients:
        stream = clients.router.generate(request("r", 6, 50))
        await fleet.time.advance_to(T0 + 3 * STEP_NS)
        await stream.__anext__()
        await stream.aclose()
        await fleet.time.settle()
        assert fleet["a"].closed == 1, (
            "the client closed its stream: the router closes its connection to the replica "
            f"at once (the replica aborts the request); connections closed: {fleet['a'].closed}"
        )
        assert not fleet["a"].batcher.has_unfinished(), (
            "the replica still runs the request its client left"
        )
        assert clients.router.statistics().outstanding == {"a": 0, "b": 0, "c": 0}, (
            f"its load is released: got {clients.router.statistics().outstanding}"
        )


@extended
@rule("client-leaves")
@anyio_test
async def test_stage3_the_id_of_a_client_that_left_is_free_again() -> None:
    fleet = Fleet()
    async with fleet.routing() as clients:
        stream = clients.router.generate(request("r", 6, 50))
        await fleet.time.advance_to(T0 + 2 * STEP_NS)
        await stream.aclose()
        try:
            again = clients.router.generate(request("r", 6, 3))
        except ValueError as exc:
            raise AssertionError(
                f"r's client left: its id is free again, not 'in flight'; got {exc!r}"
            ) from None
        reader = await fleet.consume(again)
    assert reader.error is None and len(reader.tokens) == 3


@extended
@rule("client-leaves", "router-close")
@anyio_test
async def test_stage3_an_attempt_is_closed_even_when_the_routers_host_is_cancelled() -> None:
    fleet = Fleet()
    async with fleet.running():
        with anyio.CancelScope() as host:
            router = fleet.router()
            async with serving(router), anyio.create_task_group() as tg:
                fleet.start(router, [request("r1", 4, 50), request("r2", 5, 50)], tg)
                await fleet.time.advance_to(T0 + 3 * STEP_NS)
                host.cancel()  # the task serving the router is cancelled mid-stream
        closed = {n: (r.opened, r.closed) for n, r in fleet.replicas.items()}
    assert all(o == c for o, c in closed.values()), (
        "the router's host was cancelled with two attempts streaming: each attempt's "
        "connection is still closed (a close that awaits must be shielded from the "
        f"cancellation); (opened, closed) per replica: {closed}"
    )


@core
@rule("client-leaves")
@anyio_test
async def test_stage3_a_cancelled_client_ends_its_attempt_at_once() -> None:
    fleet = Fleet()
    async with fleet.routing() as clients:
        reader = Reader(clients.router.generate(request("r", 6, 50)), fleet.clock)
        scope = anyio.CancelScope()

        async def read() -> None:
            with scope:
                await reader.run()

        clients.tasks.start_soon(read)
        await fleet.time.advance_to(T0 + 3 * STEP_NS + 1)
        scope.cancel()
        await fleet.time.settle()
        assert fleet["a"].closed == 1 and not fleet["a"].batcher.has_unfinished(), (
            "the client was cancelled while waiting for a token: its attempt ends at once"
        )
        assert clients.router.statistics().outstanding["a"] == 0


# -- draining and closing ----------------------------------------------------------------------


@extended
@rule("router-drain")
@anyio_test
async def test_stage3_drain_routes_nothing_more_and_returns_when_the_last_request_ends() -> None:
    fleet = Fleet(names=("a", "b"))
    r = request("r", 4, 10)
    async with fleet.routing([r]) as clients:  # on a
        drained_at: list[int] = []

        async def drain() -> None:
            await clients.router.drain("a")
            drained_at.append(fleet.now)

        clients.tasks.start_soon(drain)
        await fleet.time.settle()
        later = clients.router.generate(request("later", 4, 2))
        assert clients.router.replicas.replica_of("later") == "b", (
            "a is draining: new work goes to b"
        )
        clients.readers["later"] = Reader(later, fleet.clock)
        clients.tasks.start_soon(clients.readers["later"].run)
        fleet["b"].die_after("later", 1)
        await clients.finish()
        await fleet.time.settle()
    assert drained_at == [T0 + 10 * STEP_NS], (
        f"drain('a') returns when r, the last request on a, ends at +{10 * STEP_NS} ns; "
        f"it returned at {[t - T0 for t in drained_at]}"
    )
    clients.router.restore("a")
    assert clients.router.replicas.available() == ["a"], "restore('a') puts a back into routing"
    assert isinstance(clients.readers["later"].error, ReplicaError), (
        "b died under 'later', and a is draining: failovers do not go to a draining replica "
        f"either, so it has nowhere to go; the stream ended {clients.readers['later'].ended}"
    )


@extended
@rule("router-drain")
@anyio_test
async def test_stage3_draining_a_replica_with_nothing_in_flight_returns_at_once() -> None:
    fleet = Fleet(names=("a", "b"))
    async with fleet.routing([request("r", 4, 30)]) as clients:  # r on a; b has nothing
        drained: list[int] = []

        async def drain() -> None:
            await clients.router.drain("b")
            drained.append(fleet.now)

        clients.tasks.start_soon(drain)
        await fleet.time.settle()  # every task runs until it waits; the clock stays put
        assert drained == [T0], (
            "router-drain: b has nothing in flight, so drain('b') returns at once, with no "
            "time passing on the router's clock (r, on a, is not b's to wait for); it "
            f"returned at {[t - T0 for t in drained]} (no entry: it is still waiting)"
        )
        assert clients.router.statistics().draining == ("b",)
        await clients.finish()


@extended
@rule("router-drain", "probe")
@anyio_test
async def test_stage3_restoring_a_replica_that_went_down_while_draining_leaves_it_down() -> None:
    """Draining and health are two states: ``restore`` ends a drain and nothing more. A
    replica found down while it drained stays down after ``restore``, routed nothing,
    until a probe finds it up."""
    fleet = Fleet(names=("a", "b"))
    r = request("r", 4, 12)
    want = fleet.expected([r])
    fleet["a"].break_stream("r", after=3)  # a's answer breaks; the process lives on
    async with fleet.routing([r]) as clients:  # r on a
        router = clients.router
        drained = anyio.Event()

        async def drain() -> None:
            await router.drain("a")
            drained.set()

        clients.tasks.start_soon(drain)
        await fleet.time.advance_to(T0 + 3 * STEP_NS)
        check(
            drained.is_set() and router.statistics().down == ("a",),
            "setup: a, draining, broke r's answer at its 3rd token: a is down, r moved to b, "
            f"and drain('a') returned; got down={router.statistics().down}, drain returned: "
            f"{drained.is_set()}",
        )
        router.restore("a")
        later = router.generate(request("later", 4, 2))
        stats = router.statistics()
        expect(
            (stats.down, stats.draining, router.replicas.available(), stats.routed),
            (("a",), (), ["b"], {"a": 1, "b": 2}),
            "router-drain: restore('a') ends a's drain, and that alone: a went down while it "
            "drained, and only a probe that finds it up brings it back; so it stays down and "
            "'later', sent after restore('a'), goes to b. (down, draining, available(), "
            "routed: r on a, then r#1 and 'later' on b)",
        )
        await router.check_health()
        expect(router.statistics().down, (), "probe: a answers its probe, so it is up again")
        await fleet.consume(later)
        await clients.finish()
    expect_whole(clients.readers, want, "a broke r's answer at its 3rd token while draining")


@extended
@rule("router-close")
@anyio_test
async def test_stage3_closing_the_router_ends_every_stream() -> None:
    fleet = Fleet()
    async with fleet.running():
        router = fleet.router()
        with pytest.raises(RuntimeError):
            router.generate(request("early", 2, 2))
        async with serving(router), anyio.create_task_group() as tg:
            with pytest.raises(RuntimeError):
                async with router:
                    pass  # a second entry, while the router is open
            readers = fleet.start(router, [request("r", 4, 100)], tg)
            await fleet.time.advance_to(T0 + 3 * STEP_NS)
            await router.aclose()
            await fleet.time.settle()
            assert isinstance(readers["r"].error, ReplicaError), (
                f"aclose() ends an open stream with ReplicaError; it ended {readers['r'].ended}"
            )
            with pytest.raises(ReplicaError):
                router.generate(request("late", 2, 2))
            assert fleet["a"].closed == 1, "its attempt's connection is closed"
        with pytest.raises(RuntimeError):
            async with router:
                pass  # entering it again once it is closed: entered twice all the same


@extended
@rule("router-drain")
@anyio_test
async def test_stage3_draining_or_restoring_an_unknown_replica_is_a_value_error() -> None:
    fleet = Fleet(names=("a", "b"))
    async with fleet.routing([request("r", 4, 30)]) as clients:
        router = clients.router
        for call in ("drain", "restore"):
            try:
                if call == "drain":
                    await router.drain("nowhere")
                else:
                    router.restore("nowhere")
            except ValueError as error:
                assert "nowhere" in str(error), f"{call}'s ValueError must name it: {error}"
            except Exception as error:  # the policy's KeyError, say
                raise AssertionError(
                    f"{call}('nowhere') of a router over a and b raised {type(error).__name__}: "
                    f"{error}; an unknown replica name is a ValueError"
                ) from None
            else:
                raise AssertionError(f"{call}('nowhere') of a router over a and b returned")
        assert router.statistics().draining == (), "a refused drain drains nothing"
        await clients.finish()


# -- statistics and bad input ------------------------------------------------------------------


@extended
@rule("router-statistics")
@anyio_test
async def test_stage3_statistics_count_what_was_routed_failed_over_and_refused() -> None:
    fleet = Fleet(names=("a", "b"))
    prompt = shared(3, 4, 1, 0)
    fleet["a"].die_after("r2", 2)
    async with fleet.routing(max_outstanding_tokens=60, affinity_threshold=0.5) as clients:
        await fleet.consume(clients.router.generate(Request("r1", prompt, 3)))
        stream = clients.router.generate(Request("r2", (*prompt[:-1], 9), 4))  # affinity: a
        with pytest.raises(Overloaded):
            clients.router.generate(Request("big", (1,) * 40, 20))
        await fleet.consume(stream)
        stats = clients.router.statistics()
    want = RouterStatistics(
        routed={"a": 2, "b": 1},
        by_affinity=1,
        by_balance=0,
        failovers=1,
        refused=1,
        outstanding={"a": 0, "b": 0},
        down=("a",),
        draining=(),
    )
    assert stats == want, (
        "r1 to a (least loaded), r2 to a by affinity, r2 failed over to b, one request "
        f"refused.\n  expected {want}\n  got      {stats}"
    )


@extended
@rule("router-statistics", "replica-429")
@anyio_test
async def test_stage3_statistics_count_every_attempt_started_refused_ones_too() -> None:
    fleet = Fleet()
    system = shared(1, 2, 0, 0)  # two full blocks
    async with fleet.routing(balance_abs_tokens=32, balance_rel=1.5) as clients:
        router = clients.router
        await fleet.consume(router.generate(Request("r1", (*system, 7), 3)))  # a, by load
        fleet["a"].refuse(1, 5_000)
        await fleet.consume(router.generate(Request("r2", (*system, 8), 3)))  # a (affinity), b
        big = router.generate(request("big", 40, 40))  # a, by load: 80 tokens there
        fleet["b"].refuse(1, 5_000)
        await fleet.consume(router.generate(request("r3", 4, 3)))  # b (balance), c (balance)
        await fleet.consume(big)
        stats = router.statistics()
    want = RouterStatistics(
        routed={"a": 3, "b": 2, "c": 1},
        by_affinity=1,
        by_balance=2,
        failovers=0,
        refused=0,
        outstanding={"a": 0, "b": 0, "c": 0},
        down=(),
        draining=(),
    )
    expect(
        stats,
        want,
        "router-statistics: routed, by_affinity and by_balance count the attempts started, "
        "a replica's 429 or not. r1 went to a by load; r2 to a by affinity, which answered "
        "429, then to b by load; 'big' (80 tokens) to a by load; r3 to b by the imbalance "
        "guard, which answered 429, then to c by the guard. A 429 is no failover and not "
        "the router's own refusal",
    )


@extended
@rule("router-statistics")
@anyio_test
async def test_stage3_a_failure_no_replica_could_take_still_counts_as_a_failover() -> None:
    fleet = Fleet(names=("a",))
    fleet["a"].die_after("r", 2)
    readers, stats = await fleet.serve([request("r", 4, 10)])
    assert isinstance(readers["r"].error, ReplicaError), (
        f"a, the only replica, died under r: no replica to go on; r ended {readers['r'].ended}"
    )
    assert stats.failovers == 1, (
        "r's replica failed under the cap with budget left: that is a failover, even though "
        f"no replica could take it; expected failovers=1, got {stats}"
    )


@extended
@rule("router-bad-input")
@pytest.mark.parametrize(
    ("param", "value"),
    [
        ("max_outstanding_tokens", 0),
        ("retry_after_ns", 0),
        ("stall_timeout_ns", 0),
        ("probe_interval_ns", -5),
        ("probe_timeout_ns", 0),
        ("max_failovers", -1),
        ("max_failovers", True),
        ("retry_after_ns", True),
        ("block_size", 0),
        ("balance_rel", 0.9),
        ("affinity_threshold", 2),
        ("clock", object()),
        pytest.param("clock", ReadOnlyClock(), id="clock-that-cannot-wait"),
        # Not a number of the right kind (the ReplicaSet's settings included).
        ("max_outstanding_tokens", 1_000.5),
        ("balance_abs_tokens", 2.5),
        ("history_blocks", 8.5),
        ("balance_rel", True),
        ("affinity_threshold", True),
        ("affinity_threshold", math.nan),
    ],
)
def test_stage3_the_router_refuses_a_nonsense_configuration(param: str, value: Any) -> None:
    fleet = Fleet()
    wrong = (TypeError, ValueError) if not_a_number_of_its_kind(param, value) else ValueError
    with pytest.raises(wrong, match=param):
        try:
            fleet.router(**{param: value})
        except wrong:
            raise
        except Exception as error:  # it got past the check, and broke further on
            raise AssertionError(
                f"router-bad-input: Router({param}={value!r}) must be refused by the "
                f"constructor's checks ({wrong}) naming {param}; it raised {error!r}"
            ) from None


@extended
@rule("router-bad-input")
@anyio_test
async def test_stage3_generate_refuses_what_is_not_a_request() -> None:
    fleet = Fleet()
    async with fleet.routing() as clients:
        with pytest.raises(TypeError):
            clients.router.generate(("r", (1, 2), 3))  # type: ignore[arg-type]  # not a Request
