"""Stage 3, the router's silence and probes, and the epoch (see
katas/dynamic_batcher/README.md, "Stage 3"; ``-k stage3``).

A replica that stops answering mid-stream (SIGSTOP, in process: its events held) is
left after ``stall_timeout_ns`` of silence, counted per replica, and its requests fail
over at that instant; health probes find a replica down or up again, each within
``probe_timeout_ns``, a round's verdicts all applied before its failovers; and a
replica that comes back (SIGCONT) cannot inject a token into a request that moved on:
each attempt's epoch fences it. Built as ``test_stage3.py`` builds its fleets.

Map: silence (router-stall) · probes (probe), and their end at ``aclose()``
(router-close) · the epoch (epoch).
"""

from __future__ import annotations

import anyio
import anyio.abc
import pytest

from katas._harness.marks import anyio_test, extended, rule
from katas._harness.story import expect
from katas.dynamic_batcher._testing.engine import STEP_NS, T0, request
from katas.dynamic_batcher._testing.fleet import (
    PROBE_TIMEOUT,
    STALL,
    WITHIN,
    Fleet,
    expect_whole,
    serving,
)
from katas.dynamic_batcher._testing.routes import shared
from katas.dynamic_batcher.api import Request

pytestmark = [pytest.mark.stage(3)]


# -- silence, probes and the epoch ---------------------------------------------------------


@extended
@rule("router-stall")
@anyio_test
async def test_stage3_a_silent_replica_is_presumed_dead_at_the_stall_timeout() -> None:
    fleet = Fleet()
    r, other = request("r", 6, 12), request("other", 3, 80)
    want = fleet.expected([r, other])
    async with fleet.routing([r, other], stall_timeout_ns=STALL) as clients:
        await fleet.time.advance_to(T0 + 4 * STEP_NS)  # the 4th token arrives
        assert clients.router.replicas.replica_of("other") == "b"
        fleet["a"].stop()
        last = T0 + 4 * STEP_NS
        await fleet.time.advance_to(last + STALL - 1)
        assert fleet["c"].seen == [], (
            f"a's last event was at +{4 * STEP_NS} ns; at {STALL - 1} ns of silence "
            f"(stall_timeout_ns={STALL}) it is not yet presumed dead"
        )
        await fleet.time.advance_to(last + STALL)
        assert [x.rid for x in fleet["c"].seen] == ["r#1"], (
            f"at exactly {STALL} ns of silence a is presumed dead and r fails over to c "
            "(b carries 'other')"
        )
        assert clients.router.statistics().down == ("a",)
        assert clients.router.replicas.replica_of("other") == "b", (
            "only the silent replica's requests move: 'other' streams on from b"
        )
        await clients.finish()
    expect_whole(clients.readers, want, "a stopped after 4 tokens, while b streamed on")


@extended
@rule("router-stall")
@anyio_test
async def test_stage3_silence_is_counted_from_the_attempts_start() -> None:
    fleet = Fleet()
    r = request("r", 6, 5)
    want = fleet.expected([r])
    fleet["a"].stop()
    async with fleet.routing([r], stall_timeout_ns=STALL) as clients:
        await fleet.time.advance_to(T0 + STALL - 1)
        assert fleet["b"].seen == [], "no failover before the timeout"
        await fleet.time.advance_to(T0 + STALL)
        assert [x.rid for x in fleet["b"].seen] == ["r#1"], (
            "a stopped before its first token: silence counts from the attempt's start, "
            f"so r fails over at +{STALL} ns"
        )
        await clients.finish()
    expect_whole(clients.readers, want, "a was stopped from the start")


@extended
@rule("router-stall")
@anyio_test
async def test_stage3_a_replica_that_keeps_streaming_is_never_presumed_dead() -> None:
    fleet = Fleet()
    r = request("long", 4, 200)  # 200 steps, far longer than the stall timeout
    want = fleet.expected([r])
    readers, stats = await fleet.serve([r], stall_timeout_ns=STALL)
    expect_whole(readers, want, "one long healthy stream")
    assert stats.failovers == 0 and stats.down == (), (
        f"silence is measured from the last event, not the start: got {stats}"
    )


@extended
@rule("router-stall")
@anyio_test
async def test_stage3_a_request_waiting_in_a_busy_replicas_queue_is_not_silence() -> None:
    fleet = Fleet(names=("a",), replica={"max_num_seqs": 1})
    reqs = [request("first", 3, 4 * STALL // STEP_NS), request("queued", 3, 5)]
    want = fleet.expected(reqs)
    readers, stats = await fleet.serve(reqs, stall_timeout_ns=STALL)
    expect_whole(
        readers,
        want,
        f"'queued' waits {4 * STALL} ns behind 'first' on a replica that runs one sequence "
        f"at a time (stall_timeout_ns={STALL}): silence is the replica's, and a streams "
        "'first' all along",
    )
    assert stats.down == () and stats.failovers == 0, f"nothing was silent: got {stats}"


@extended
@rule("router-stall")
@anyio_test
async def test_stage3_a_new_request_on_a_silent_replica_does_not_restart_its_silence() -> None:
    fleet = Fleet(names=("a", "b"))
    r1, r2 = request("r1", 4, 20), request("r2", 5, 20)
    want = fleet.expected([r1, r2])
    async with fleet.routing(stall_timeout_ns=STALL) as clients:
        clients.router.replicas.drain("b")
        clients.start([r1])
        await fleet.time.advance_to(T0 + STEP_NS)  # r1's first token: a's last event
        fleet["a"].stop()
        await fleet.time.advance_to(T0 + STEP_NS + STALL // 2)
        clients.start([r2])  # to a, silent for STALL / 2 already
        clients.router.replicas.restore("b")
        await fleet.time.advance_to(T0 + STEP_NS + STALL - 1)
        assert fleet["b"].seen == [], "a's silence has not reached the timeout yet"
        await fleet.time.advance_to(T0 + STEP_NS + STALL)
        moved = sorted(x.rid for x in fleet["b"].seen)
        assert moved == ["r1#1", "r2#1"], (
            f"a was last heard at +{STEP_NS} ns; r2 started there at "
            f"+{STEP_NS + STALL // 2} ns, which is not a sign of life: at "
            f"+{STEP_NS + STALL} ns a is presumed dead and both fail over. b saw {moved}"
        )
        await clients.finish()
    expect_whole(clients.readers, want, "a stopped after r1's first token; r2 sent to it later")


@extended
@rule("router-stall", "failover-cap")
@anyio_test
async def test_stage3_replicas_silent_together_are_all_down_before_any_request_moves() -> None:
    fleet = Fleet(names=("a", "b", "c"))
    # x on a, y on b (the lighter of the two after the failover), z streaming on c
    x, y, z = request("x", 3, 8), request("y", 3, 2), request("z", 3, 40 + STALL // STEP_NS)
    want = fleet.expected([x, y, z])
    fleet["a"].stop()
    fleet["b"].stop()  # a and b silent from their attempts' start, both at +0
    async with fleet.routing([x, y, z], stall_timeout_ns=STALL, max_failovers=1) as clients:
        placed = {rid: clients.router.replicas.replica_of(rid) for rid in "xyz"}
        assert placed == {"x": "a", "y": "b", "z": "c"}, f"setup: got {placed}"
        await fleet.time.advance_to(T0 + STALL)
        stats = clients.router.statistics()
        expect(
            (stats.down, sorted(r.rid for r in fleet["c"].seen), stats.routed, stats.failovers),
            (("a", "b"), ["x#1", "y#1", "z"], {"a": 1, "b": 1, "c": 3}, 2),
            f"x on a and y on b, both replicas stopped from the start; z streams on c. At "
            f"+{STALL} ns (stall_timeout_ns) a and b are silent for the timeout at the same "
            "instant: both are down before any request moves, so x and y each fail over "
            "once, to c — x never moves onto b, silent as long. (down, the attempts c saw, "
            "routed, failovers)",
        )
        fleet["a"].resume()
        fleet["b"].resume()
        await clients.finish()
    expect_whole(
        clients.readers,
        want,
        "a and b silent at one instant, max_failovers=1: x failed over once, to c",
    )


@extended
@rule("epoch")
@anyio_test
async def test_stage3_a_stopped_replica_that_comes_back_injects_nothing() -> None:
    fleet = Fleet()
    r = request("r", 6, 12)
    want = fleet.expected([r])
    async with fleet.routing([r], stall_timeout_ns=STALL) as clients:
        await fleet.time.advance_to(T0 + 3 * STEP_NS)
        fleet["a"].stop()
        await fleet.time.advance_to(T0 + 3 * STEP_NS + STALL)
        assert fleet["a"].closed == 1, (
            "r failed over at the stall timeout: its attempt on a is superseded, and its "
            f"connection is closed at once; a's connections closed: {fleet['a'].closed}"
        )
        fleet["a"].resume()  # SIGCONT: a wakes up with r's tokens in its buffers
        await clients.finish()
    expect_whole(
        clients.readers, want, "a stopped after 3 tokens, failed over, then resumed (SIGCONT)"
    )


@extended
@rule("epoch")
@anyio_test
async def test_stage3_an_event_read_just_before_a_failover_is_dropped() -> None:
    fleet = Fleet()
    reqs = [request("r1", 4, 12), request("r2", 5, 12)]
    want = fleet.expected(reqs)
    async with fleet.routing() as clients:
        for name in ("b", "c"):
            clients.router.replicas.drain(name)
        clients.start(reqs)  # both on a
        for name in ("b", "c"):
            clients.router.replicas.restore(name)
        # Both answers break at their 3rd token, which a's step hands to both pumps at
        # once: whichever runs first fails a over, and the other is already holding its
        # 3rd token — an event of an attempt that has just lost its request.
        fleet["a"].break_stream("r1", after=3)
        fleet["a"].break_stream("r2", after=3)
        await clients.finish()
    expect_whole(
        clients.readers, want, "r1 and r2 on a, both answers broken at the 3rd token, in one step"
    )


@extended
@rule("epoch")
@anyio_test
async def test_stage3_a_zombie_resumed_at_the_failover_instant_injects_nothing() -> None:
    fleet = Fleet()
    r = request("r", 6, 12)
    want = fleet.expected([r])
    async with fleet.routing([r], stall_timeout_ns=STALL) as clients:
        await fleet.time.advance_to(T0 + 2 * STEP_NS)
        fleet["a"].stop()
        await fleet.time.advance_to(T0 + 2 * STEP_NS + STALL - 1)
        fleet["a"].resume()
        fleet["a"].stop()  # a's next event is ready, held at the instant of the timeout
        await fleet.time.advance_to(T0 + 2 * STEP_NS + STALL)
        fleet["a"].resume()
        await clients.finish()
    expect_whole(clients.readers, want, "a's late event released at the instant r failed over")


@extended
@rule("epoch", "client-leaves")
@anyio_test
@pytest.mark.parametrize("fault", ["broken", "ended unfinished"])
async def test_stage3_a_failure_read_by_a_superseded_attempt_fails_nothing(fault: str) -> None:
    """The epoch fences an attempt's failures as it fences its tokens. rA's client leaves
    at the very instant rA's read on a wakes with a failure (a's answer to rA breaks, or
    ends with no finish reason): that read belongs to an attempt that has just lost its
    request, and says nothing of a, which goes on streaming rB."""
    fleet = Fleet(names=("a", "b"))
    ra, rb = request("rA", 4, 20), request("rB", 5, 20)
    want = fleet.expected([rb])
    async with fleet.routing() as clients:
        with clients.only("a"):
            stream = clients.router.generate(ra)
            clients.start([rb])
        await fleet.time.advance_to(T0 + 2 * STEP_NS)
        had = len((await stream.__anext__()).tokens)  # rA's tokens so far: 1 or 2
        fleet["a"].stop()  # a's next events wait in a
        if fault == "broken":
            fleet["a"].break_stream("rA", after=had)  # rA's next read raises ReplicaError
        else:
            fleet["a"].end_quietly("rA", after=had)  # rA's stream ends, unfinished
        await fleet.time.advance_to(T0 + 3 * STEP_NS)  # a's next step is done, held
        fleet["a"].resume()  # both reads wake: rA's with its failure
        await stream.aclose()  # ... and before it runs, rA's client leaves
        await fleet.time.settle()
        stats = clients.router.statistics()
        expect(
            (stats.down, stats.failovers, [x.rid for x in fleet["b"].seen]),
            ((), 0, []),
            f"rA and rB stream from a; a is held after its next step, in which rA's "
            f"answer {fault} (after the {had} tokens it had). a resumes, and rA's client "
            "closes its stream before rA's read runs: the read's failure belongs to a "
            "superseded attempt (its epoch is not rA's any more), so a is not marked down "
            "and rB does not move. (down, failovers, "
            "attempts b saw)",
        )
        await clients.finish()
    expect_whole(clients.readers, want, f"rA's superseded attempt on a {fault}")


@extended
@rule("probe", "failover")
@anyio_test
async def test_stage3_a_probe_round_applies_its_verdicts_before_its_failovers() -> None:
    fleet = Fleet(names=("a", "b"))
    r = request("r", 4, 12)
    want = fleet.expected([r])
    async with fleet.routing(probe_timeout_ns=PROBE_TIMEOUT) as clients:
        fleet["b"].kill()
        await clients.router.check_health()
        assert clients.router.statistics().down == ("b",), "setup: b is down"
        clients.start([r])  # on a, the only replica up
        await fleet.time.advance_to(fleet.now + 2 * STEP_NS)
        fleet["b"].restart()  # b is back; only a probe can tell the router
        fleet["a"].stop()  # a stops answering: its stream and its probe alike
        clients.tasks.start_soon(clients.router.check_health)
        await clients.finish()
    expect_whole(
        clients.readers,
        want,
        "r streaming on a, b down; then b restarted and a stopped, and one probe round "
        "finds a down and b up. The round's verdicts all apply before its failovers, so r "
        "moves to b",
    )


@extended
@rule("probe")
@anyio_test
async def test_stage3_a_probe_waits_at_most_the_probe_timeout() -> None:
    fleet = Fleet()
    async with fleet.routing(probe_timeout_ns=PROBE_TIMEOUT) as clients:
        fleet["b"].stop()
        done = anyio.Event()

        async def probe() -> None:
            await clients.router.check_health()
            done.set()

        clients.tasks.start_soon(probe)
        await fleet.time.advance_to(T0 + PROBE_TIMEOUT - 1)
        assert not done.is_set() and clients.router.statistics().down == (), (
            f"b does not answer its probe: before probe_timeout_ns={PROBE_TIMEOUT} it is "
            f"not yet down; got down={clients.router.statistics().down}"
        )
        await fleet.time.advance_to(T0 + PROBE_TIMEOUT)
        assert done.is_set(), "check_health() returns once every probe answered or timed out"
        assert clients.router.statistics().down == ("b",), (
            "b did not answer within the probe timeout: down; got "
            f"{clients.router.statistics().down}"
        )
        fleet["b"].resume()
        await clients.router.check_health()
        assert clients.router.statistics().down == (), "b answers again: it is up again"


@extended
@rule("probe")
@anyio_test
async def test_stage3_probes_run_at_once_and_any_exception_is_a_failed_probe() -> None:
    fleet = Fleet(names=("a", "b", "c"))
    async with fleet.routing(probe_timeout_ns=PROBE_TIMEOUT) as clients:
        fleet["a"].stop()
        fleet["b"].stop()
        fleet["c"].probe_error = OSError("connection reset by peer")
        done: list[int] = []

        async def probe() -> None:
            await clients.router.check_health()
            done.append(fleet.now)

        clients.tasks.start_soon(probe)
        await fleet.time.run_until(lambda: bool(done), within_ns=WITHIN, what="the round")
        assert done == [T0 + PROBE_TIMEOUT], (
            "a and b do not answer: the replicas are probed at once, so the round ends "
            f"when both probes time out together, at +{PROBE_TIMEOUT} ns; it ended at "
            f"{[t - T0 for t in done]}"
        )
        assert clients.router.statistics().down == ("a", "b", "c"), (
            "c's probe raised OSError: any exception is a failed probe, and c is down "
            f"(a and b did not answer); got down={clients.router.statistics().down}"
        )
        fleet["a"].resume()
        fleet["b"].resume()


@extended
@rule("probe")
@anyio_test
async def test_stage3_the_next_probe_round_is_an_interval_after_the_last_one_ends() -> None:
    fleet = Fleet(names=("a", "b"))
    interval = 1_000 * STEP_NS
    async with fleet.routing(probe_interval_ns=interval, probe_timeout_ns=PROBE_TIMEOUT):
        fleet["b"].stop()  # every round lasts the probe timeout
        await fleet.time.run_until(
            lambda: len(fleet["a"].probes) >= 3, within_ns=WITHIN, what="three rounds"
        )
        fleet["b"].resume()
    rounds = [t - T0 for t in fleet["a"].probes[:3]]
    want = [interval, 2 * interval + PROBE_TIMEOUT, 3 * interval + 2 * PROBE_TIMEOUT]
    assert rounds == want, (
        f"probe_interval_ns={interval}, and each round lasts probe_timeout_ns="
        f"{PROBE_TIMEOUT} (b never answers): rounds start {interval} ns after the router "
        f"starts, then {interval} ns after each round ends. Expected {want}, got {rounds}"
    )


@extended
@rule("probe")
@anyio_test
async def test_stage3_the_first_probe_round_is_an_interval_after_the_router_starts() -> None:
    fleet = Fleet(names=("a",))
    interval = 1_000 * STEP_NS
    async with fleet.running(), serving(fleet.router(probe_interval_ns=interval)):
        # The router started at +0; time moves before its own tasks first run.
        fleet.clock.advance(interval // 2)
        await fleet.time.advance_to(T0 + interval - 1)
        before = [t - T0 for t in fleet["a"].probes]
        await fleet.time.advance_to(T0 + interval)
        at = [t - T0 for t in fleet["a"].probes]
    expect(
        (before, at),
        ([], [interval]),
        f"probe_interval_ns={interval}; the router entered at +0, and the clock moved to "
        f"+{interval // 2} before anything else ran: the first round is due {interval} ns "
        "after the router starts, not after its tasks first run. (the instants, ns from the "
        f"start, of a's probes at +{interval - 1} and at +{interval})",
    )


@extended
@rule("router-close", "probe")
@anyio_test
async def test_stage3_aclose_stops_probing_at_once_not_when_the_block_is_left() -> None:
    fleet = Fleet(names=("a", "b"))
    interval = 1_000 * STEP_NS
    async with fleet.routing(probe_interval_ns=interval) as clients:
        await fleet.time.advance_to(T0 + 2 * interval - STEP_NS)  # one round, at +interval
        await clients.router.aclose()  # a step before the second round is due
        await fleet.time.advance_to(T0 + 6 * interval)  # still inside the router's block
        probed = {name: [t - T0 for t in r.probes] for name, r in fleet.replicas.items()}
    expect(
        probed,
        {"a": [interval], "b": [interval]},
        f"router-close, probe: probe_interval_ns={interval}, so the first round probed a "
        f"and b at +{interval} ns; aclose() at +{2 * interval - STEP_NS} ns, one step before "
        "the second round, stops probing then, not when the router's `async with` is left "
        f"(here at +{6 * interval} ns): no probe after it. The instants (ns from the start) "
        "of every probe each replica received",
    )


@extended
@rule("probe")
@anyio_test
async def test_stage3_a_failed_probe_fails_over_the_replicas_requests_at_once() -> None:
    fleet = Fleet()
    r = request("r", 6, 12)
    want = fleet.expected([r])
    async with fleet.routing(
        [r], stall_timeout_ns=WITHIN, probe_timeout_ns=PROBE_TIMEOUT
    ) as clients:
        await fleet.time.advance_to(T0 + 3 * STEP_NS)
        fleet["a"].stop()
        clients.tasks.start_soon(clients.router.check_health)
        await fleet.time.advance_to(T0 + 3 * STEP_NS + PROBE_TIMEOUT)
        assert [x.rid for x in fleet["b"].seen] == ["r#1"], (
            "a failed its probe: its request fails over at that instant, long before the "
            "stall timeout"
        )
        await clients.finish()
    expect_whole(clients.readers, want, "a stopped, found down by a probe")


@extended
@rule("probe", "failover")
@anyio_test
async def test_stage3_probe_verdicts_apply_once_the_whole_round_is_over() -> None:
    fleet = Fleet(names=("a", "b", "c"))
    r = request("r", 6, 40)  # still streaming when the round ends
    want = fleet.expected([r])
    async with fleet.routing(
        [r], stall_timeout_ns=WITHIN, probe_timeout_ns=PROBE_TIMEOUT
    ) as clients:
        start = T0 + 3 * STEP_NS
        await fleet.time.advance_to(start)
        fleet["a"].probe_error = OSError("connection reset by peer")  # fails at once
        fleet["b"].stop()  # its probe times out at the round's end
        clients.tasks.start_soon(clients.router.check_health)
        await fleet.time.advance_to(start + PROBE_TIMEOUT - 1)
        story = (
            "r streams from a; a probe round starts: a's probe fails at once, b's "
            f"never answers (probe_timeout_ns={PROBE_TIMEOUT})"
        )
        expect(
            (
                clients.router.statistics().down,
                [(name, x.rid) for name in "abc" for x in fleet[name].seen],
            ),
            ((), [("a", "r")]),
            f"{story}. 1 ns before the round ends: (down, attempts seen by the replicas) — "
            "no verdict applies until every probe answered or timed out, so r is still a's",
        )
        await fleet.time.advance_to(start + PROBE_TIMEOUT)
        expect(
            (clients.router.statistics().down, [x.rid for x in fleet["c"].seen]),
            (("a", "b"), ["r#1"]),
            f"{story}. When the round ends: a and b are down at once, and r fails over "
            "once, to c — never to b, whose probe was still out",
        )
        fleet["a"].probe_error = None
        fleet["b"].resume()
        await clients.finish()
    expect_whole(clients.readers, want, "a failed its probe, b's timed out, in one round")


@extended
@rule("probe", "router-drain")
@anyio_test
async def test_stage3_a_draining_replica_is_probed_too_and_found_down() -> None:
    fleet = Fleet(names=("a", "b"))
    r = request("r", 6, 12)
    want = fleet.expected([r])
    async with fleet.routing(
        [r], stall_timeout_ns=WITHIN, probe_timeout_ns=PROBE_TIMEOUT
    ) as clients:  # r on a
        drained: list[int] = []

        async def drain() -> None:
            await clients.router.drain("a")
            drained.append(fleet.now)

        clients.tasks.start_soon(drain)
        await fleet.time.advance_to(T0 + 3 * STEP_NS)
        fleet["a"].stop()  # a stops answering: streams and probes alike
        clients.tasks.start_soon(clients.router.check_health)
        await fleet.time.advance_to(T0 + 3 * STEP_NS + PROBE_TIMEOUT)
        probed = {name: len(fleet[name].probes) for name in ("a", "b")}
        assert probed == {"a": 1, "b": 1}, (
            f"probe: every replica is probed, a draining one too: probes received {probed}"
        )
        stats = clients.router.statistics()
        assert stats.down == ("a",) and [x.rid for x in fleet["b"].seen] == ["r#1"], (
            "probe: a is draining with r in flight, and stopped: its probe goes unanswered "
            f"for probe_timeout_ns={PROBE_TIMEOUT}, so a is down and r fails over to b at "
            f"that instant; got down={stats.down}, b saw {[x.rid for x in fleet['b'].seen]}"
        )
        await fleet.time.settle()
        assert drained == [T0 + 3 * STEP_NS + PROBE_TIMEOUT], (
            f"router-drain: r left a at the failover, so drain('a') returns then; returned "
            f"at {[t - T0 for t in drained]}"
        )
        fleet["a"].resume()
        await clients.finish()
    expect_whole(clients.readers, want, "a stopped while draining, found down by a probe")


@extended
@rule("probe")
@anyio_test
async def test_stage3_the_router_probes_on_its_own_and_brings_a_restarted_replica_back() -> None:
    fleet = Fleet()
    interval = 1_000 * STEP_NS
    async with fleet.routing(probe_interval_ns=interval, probe_timeout_ns=PROBE_TIMEOUT) as clients:
        fleet["c"].kill()
        await fleet.time.run_until(
            lambda: clients.router.statistics().down == ("c",),
            within_ns=2 * interval + PROBE_TIMEOUT,
            what="the router's own probe to find c dead",
        )
        fleet["c"].restart()
        await fleet.time.run_until(
            lambda: clients.router.statistics().down == (),
            within_ns=2 * interval + PROBE_TIMEOUT,
            what="the router's own probe to find c back after its restart",
        )


@extended
@rule("probe", "route-history")
@anyio_test
async def test_stage3_a_probe_round_keeps_the_history_of_a_replica_that_stayed_up() -> None:
    fleet = Fleet(names=("a", "b", "c"))
    prompt = shared(2, 4, 2, 0)
    first, again = Request("r1", prompt, 2), Request("r2", (*prompt[:-1], 5), 2)
    async with fleet.routing(affinity_threshold=0.5, probe_timeout_ns=PROBE_TIMEOUT) as clients:
        with clients.only("b"):
            await fleet.consume(clients.router.generate(first))
        assert [x.rid for x in fleet["b"].seen] == ["r1"], "setup: r1 served by b"
        fleet["c"].kill()
        await clients.router.check_health()  # a and b answer; c is down
        fleet["c"].restart()
        await clients.router.check_health()  # all three answer; c is up again
        stats = clients.router.statistics()
        assert stats.down == () and stats.by_affinity == 0, f"setup: got {stats}"
        remembered = clients.router.replicas.matched_blocks("b", again.prompt)
        stream = clients.router.generate(again)
        by_affinity = clients.router.statistics().by_affinity
        await fleet.consume(stream)
    expect(
        (remembered, by_affinity, [x.rid for x in fleet["b"].seen]),
        (4, 1, ["r1", "r2"]),
        "r1 (4 full blocks + 2 tokens) served by b; c killed, a probe round (c down); c "
        "restarted, a probe round (c up again). b answered both rounds and never went "
        "down, so it keeps its history (only a replica that was down comes back with an "
        "empty one), and r2, r1's prompt but its last token, goes to b by affinity. "
        "(b's matched_blocks for r2 after the rounds, by_affinity, the ids b saw)",
    )


@extended
@rule("probe", "route-history")
@anyio_test
async def test_stage3_a_replica_back_from_the_dead_is_not_routed_for_its_old_cache() -> None:
    fleet = Fleet(names=("a", "b"))
    prompt = shared(1, 4, 2, 0)
    first, again = Request("r1", prompt, 2), Request("r2", (*prompt[:-1], 5), 2)
    async with fleet.routing(affinity_threshold=0.5) as clients:
        await fleet.consume(clients.router.generate(first))
        assert fleet["a"].seen and fleet["a"].seen[0].rid == "r1"
        fleet["a"].restart()
        clients.router.replicas.mark_down("a")
        await clients.router.check_health()
        assert clients.router.statistics().down == ()
        stream = clients.router.generate(again)
        why = clients.router.statistics().by_affinity
        await fleet.consume(stream)
    assert why == 0, (
        "a restarted (its cache is empty) and was marked down, then up: the router forgot "
        "what it had sent there, so r2 is routed by load, not by affinity; by_affinity = "
        f"{why}"
    )
