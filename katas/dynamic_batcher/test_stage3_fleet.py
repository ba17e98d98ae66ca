"""Stage 3, whole fleets: properties over many requests and drawn faults, then real
replica processes (see katas/dynamic_batcher/README.md, "Stage 3").

The properties run the router over in-process replicas in virtual time, as
``test_stage3.py`` does: no token lost or repeated whatever fails and when (hypothesis
draws the kills, breaks and stops), no replica above 1.5x the mean load under the
imbalance guard, prefix affinity at least twice round-robin's cache hits. The last tests
start real replica processes serving over loopback HTTP, and kill, stop and restart them
with real signals, or put a server answering garbage in the fleet.

Map: failover · epoch · router-stall · route-balance · route-affinity · probe ·
router-bad-input, each over a whole fleet.
"""

from __future__ import annotations

import signal

import anyio
import anyio.abc
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from katas._harness.marks import anyio_test, core, extended, processes, rule
from katas._harness.profiles import examples
from katas._registry import impl
from katas.dynamic_batcher._testing import replica
from katas.dynamic_batcher._testing.engine import STEP_NS, T0, request
from katas.dynamic_batcher._testing.fleet import STALL, WITHIN, Fleet, expect_whole, serving
from katas.dynamic_batcher._testing.http_link import HttpLink
from katas.dynamic_batcher._testing.real_fleet import (
    GARBAGE,
    consume_real,
    finish_real,
    garbage_server,
    links_to,
    real_expected,
    real_router,
    real_routing,
    replica_at_token,
    replicas,
    start_real,
    stream_until,
)
from katas.dynamic_batcher._testing.routes import shared
from katas.dynamic_batcher.api import Completion, Request

pytestmark = [pytest.mark.stage(3)]


# -- the fleet's properties ---------------------------------------------------------------------


@core
@rule("failover", "epoch", "router-stall")
@anyio_test
@settings(max_examples=examples(25), deadline=None)
@given(
    faults=st.lists(
        st.tuples(
            st.sampled_from(["kill", "break", "stop", "restart"]),
            st.integers(0, 5),  # which request it hits
            st.integers(1, 14),  # at which token
        ),
        min_size=1,
        max_size=3,
    )
)
@example(faults=[("kill", 0, 2), ("kill", 0, 3), ("break", 0, 1)])
async def test_stage3_no_token_is_lost_or_repeated_whatever_fails_and_when(
    faults: list[tuple[str, int, int]],
) -> None:
    fleet = Fleet()
    reqs = [request(f"r{i}", 3 + 2 * i, 8 + i) for i in range(6)]
    want = fleet.expected(reqs)
    story = ["six requests over a, b and c"]
    async with fleet.routing(reqs, stall_timeout_ns=STALL, max_failovers=5) as clients:
        readers = clients.readers
        for kind, which, at in sorted(faults, key=lambda f: f[2]):
            rid = reqs[which].rid
            if readers[rid].ended != "reading" or len(readers[rid].tokens) >= at:
                continue

            def reached(rid: str = rid, at: int = at) -> bool:
                return len(readers[rid].tokens) >= at or readers[rid].ended != "reading"

            await fleet.time.run_until(reached, within_ns=WITHIN, what=f"{rid} at token {at}")
            where = clients.router.replicas.replica_of(rid)
            if where is None:
                continue
            replica = fleet[where]
            story.append(f"at +{fleet.now - T0} ns ({rid} at token {at}): {kind} {where}")
            if kind == "kill":
                replica.kill()
            elif kind == "break":
                replica.break_stream(rid, after=0)
            elif kind == "restart":
                replica.restart()
            else:
                replica.stop()
                await fleet.time.advance(STALL + STEP_NS)
                replica.resume()
                story.append(f"  resumed at +{fleet.now - T0} ns")
            # Once the router has moved rid off that replica, a supervisor restarts
            # the others that died, and a probe brings every live one back.

            def moved(rid: str = rid, where: str = where) -> bool:
                return bool(clients.router.replicas.replica_of(rid) != where)

            await fleet.time.run_until(
                moved, within_ns=WITHIN, what=f"the router to move {rid} off {where}"
            )
            for other in fleet.replicas.values():
                if other is not replica and other.dead:
                    other.restart()
                    story.append(f"  {other.name} restarted")
            await clients.router.check_health()
        for replica in fleet.replicas.values():
            if replica.dead:
                replica.restart()
        await clients.router.check_health()
        await clients.finish()
    expect_whole(readers, want, "\n    ".join(story))


@core
@rule("route-balance")
@anyio_test
async def test_stage3_under_the_guard_no_replica_carries_more_than_1_5x_the_mean() -> None:
    fleet = Fleet(names=("a", "b", "c", "d"), replica={"max_num_seqs": 16})
    # One shared prefix pulls every request to one replica; lengths are uneven.
    reqs = [Request(f"r{i}", shared(7, 6, 1 + i % 3, i), 8 + (i * 37) % 41) for i in range(48)]
    worst: list[tuple[float, dict[str, int]]] = []
    async with fleet.routing(
        balance_abs_tokens=32, balance_rel=1.2, affinity_threshold=0.5
    ) as clients:
        for i, r in enumerate(reqs):
            clients.start([r])
            loads = clients.router.statistics().outstanding
            mean = sum(loads.values()) / len(loads)
            if i >= 8:
                worst.append((max(loads.values()) / mean, dict(loads)))
            if i % 4 == 3:
                await fleet.time.advance(STEP_NS)
        await clients.finish()
    ratio, loads = max(worst, key=lambda w: w[0])
    assert ratio <= 1.5, (
        "48 requests sharing one prefix, uneven budgets, balance_abs_tokens=32, "
        f"balance_rel=1.2: the most loaded replica must stay within 1.5x the mean; worst "
        f"{ratio:.2f}x with loads {loads}"
    )


@core
@rule("route-affinity")
@anyio_test
async def test_stage3_prefix_affinity_gets_at_least_twice_round_robins_cache_hits() -> None:
    families, per_family = 5, 6  # over four replicas, round-robin moves every family
    reqs = [
        Request(f"f{f}-{i}", shared(f, 8, 3, i), 4)
        for i in range(per_family)
        for f in range(families)
    ]

    async def run(routed: bool) -> int:
        fleet = Fleet(names=("a", "b", "c", "d"))
        async with fleet.running():
            if routed:
                router = fleet.router(affinity_threshold=0.5, balance_abs_tokens=10_000)
                async with serving(router):
                    for r in reqs:
                        await fleet.consume(router.generate(r))
            else:
                names = list(fleet.replicas)
                for i, r in enumerate(reqs):
                    completion = fleet[names[i % len(names)]].stream(r)
                    done = anyio.Event()

                    async def read(
                        completion: Completion = completion, done: anyio.Event = done
                    ) -> None:
                        async for _ in completion:
                            pass
                        done.set()

                    async with anyio.create_task_group() as tg:
                        tg.start_soon(read)
                        await fleet.time.run_until(done.is_set, within_ns=WITHIN, what="a request")
                    await completion.aclose()
        return fleet.hits()

    affine, round_robin = await run(True), await run(False)
    assert affine >= 2 * round_robin, (
        f"{families} prompt families of 8 shared blocks, {per_family} requests each, one at "
        f"a time: routing by prefix must get at least twice round-robin's prefix-cache hits "
        f"(real hits of the replicas' caches). Got {affine} hit tokens, round-robin "
        f"{round_robin}"
    )


# -- real replica processes over loopback HTTP -------------------------------------------------


@core
@rule("failover")
@anyio_test
@processes
async def test_stage3_real_a_replica_killed_mid_stream_loses_and_repeats_nothing(
    impl_selection: impl.Selection,
) -> None:
    reqs = [request(f"r{i}", 5 + i, 40) for i in range(6)]
    want = real_expected(reqs)
    with replicas(impl_selection, "a", "b", "c") as procs:
        async with real_routing(links_to(procs), reqs) as (router, readers):
            victim = await replica_at_token(router, readers, "r0", 5)
            procs[victim].kill()  # SIGKILL
            await finish_real(readers)
            stats = router.statistics()
    expect_whole(readers, want, f"replica {victim} got SIGKILL while r0 had 5 of 40 tokens")
    assert victim in stats.down and stats.failovers >= 1, f"got {stats}"


@extended
@rule("epoch", "router-stall")
@anyio_test
@processes
async def test_stage3_real_a_stopped_replica_that_continues_injects_nothing(
    impl_selection: impl.Selection,
) -> None:
    reqs = [request(f"r{i}", 4 + i, 30) for i in range(3)]
    want = real_expected(reqs)
    with replicas(impl_selection, "a", "b") as procs:
        async with real_routing(links_to(procs), reqs) as (router, readers):
            victim = await replica_at_token(router, readers, "r0", 3)
            procs[victim].process.send(signal.SIGSTOP)
            try:
                await stream_until(
                    readers,
                    lambda: router.replicas.replica_of("r0") not in (None, victim),
                    "r0 to fail over after the stall timeout",
                )
            finally:
                procs[victim].process.send(signal.SIGCONT)  # the zombie wakes up
            await finish_real(readers)
            # The clients' tokens first: a zombie's tokens fail the test at once, before
            # the real-time wait for the replica to see its old connection closed.
            expect_whole(
                readers, want, f"replica {victim} got SIGSTOP at r0's 3rd token, then SIGCONT"
            )
            procs[victim].wait_for("disconnected r0")  # its old connection was closed
            await router.check_health()
            stats = router.statistics()
    assert stats.down == (), f"the resumed replica answers its probe again: {stats}"


@extended
@rule("probe")
@anyio_test
@processes
async def test_stage3_real_a_replica_restarted_on_its_port_is_routed_again(
    impl_selection: impl.Selection,
) -> None:
    with replicas(impl_selection, "a", "b") as procs:
        router = real_router(links_to(procs))
        async with serving(router):
            port = procs["a"].port
            procs["a"].kill()
            await router.check_health()
            assert router.statistics().down == ("a",), "a was killed: its probe fails"
            with replica.running(
                impl_selection, "a", batcher="prefix", suite_stage=3, port=port
            ) as again:
                await router.check_health()
                assert router.statistics().down == (), "a is back on its port: up again"
                router.replicas.drain("b")
                reader = start_real(router, [request("back", 3, 4)], None)
                await consume_real(reader["back"])
                again.wait_for("finished back")
    assert reader["back"].tokens == real_expected([request("back", 3, 4)])["back"]


@extended
@rule("failover", "router-bad-input")
@anyio_test
@pytest.mark.parametrize("answer", sorted(GARBAGE))
@processes
async def test_stage3_real_a_replica_answering_garbage_is_a_failure_not_a_crash(
    impl_selection: impl.Selection, answer: str
) -> None:
    reqs = [request(f"r{i}", 3 + i, 6) for i in range(3)]
    want = real_expected(reqs)
    with replicas(impl_selection, "good") as procs:
        async with garbage_server(GARBAGE[answer]) as url:
            links = [HttpLink("bad", url), HttpLink("good", procs["good"].url)]
            async with real_routing(links, reqs) as (router, readers):
                await finish_real(readers)
                stats = router.statistics()
    expect_whole(readers, want, f"replica 'bad' answered {answer}")
    assert stats.down == ("bad",), f"a replica answering {answer} is down: got {stats.down}"
