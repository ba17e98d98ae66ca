"""Stage 3: a router over replicas that die mid-stream (see katas/dynamic_batcher/README.md,
"Stage 3").

``ReplicaSet`` (``-k routes``) is routing without I/O: each rule at its boundary (the
token where a request's prefill charge ends, the load difference where the imbalance
guard trips, the matched block where affinity starts), then a state machine that
compares it with :class:`~katas.dynamic_batcher._testing.routes.RoutesModel`, the rules
written plainly from the prompt.

The ``Router`` runs over :class:`~katas.dynamic_batcher._testing.fleet.SimReplica`
replicas: your stage-2 engine over your prefix-caching batcher, in process, on one
``ManualClock`` moved by :class:`~katas._harness.virtual_time.VirtualTime`, every step
one ``STEP_NS``. A request alone on a replica gets its k-th token at ``k`` steps after
it reached the replica, so a test knows the instant of every token, and places each
fault on one: a replica killed as the n-th token of a request reaches the router, a
stream broken after n tokens, a replica stopped (SIGSTOP) between two tokens and
resumed after the router gave up on it. Every client's stream is compared with what its
request generates alone: nothing lost, nothing twice. Hypothesis draws fault schedules.
The last tests run real replica processes over loopback HTTP, killed and stopped with
real signals.

Map: routes (§route-load, §route-available, §route-balance, §route-affinity,
§route-least-loaded, §route-history, §routes-bad-input) · relaying (§relay) · admission
(§router-admission) · replicas that refuse (§replica-429) · failover (§failover,
§failover-cap) · silence and probes (§router-stall, §probe) · the epoch (§epoch) · clients that
leave (§client-leaves) · draining (§router-drain) · closing (§router-close) · statistics
(§router-statistics) · bad input (§router-bad-input) · the fleet's properties (load
within 1.5× the mean, affinity ≥ 2× round-robin's cache hits) · real processes.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from typing import Any

import anyio
import anyio.abc
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from katas._harness.profiles import examples
from katas._harness.under_test import stage
from katas._registry import impl
from katas.dynamic_batcher._testing import replica
from katas.dynamic_batcher._testing.engine import STEP_NS, T0, Reader, request
from katas.dynamic_batcher._testing.fleet import Fleet, serving
from katas.dynamic_batcher._testing.http_link import HttpLink
from katas.dynamic_batcher._testing.real_fleet import (
    GARBAGE,
    consume_real,
    garbage_server,
    real_expected,
    real_router,
    replicas,
    start_real,
    stream_until,
)
from katas.dynamic_batcher._testing.routes import BLOCK, RoutesMachine, keys, replica_set, shared
from katas.dynamic_batcher.api import (
    Overloaded,
    ReplicaError,
    Request,
    Route,
    RouterStatistics,
)

pytestmark = [pytest.mark.stage(3)]
core = pytest.mark.core
extended = pytest.mark.extended
rule = pytest.mark.rule
anyio_test = pytest.mark.anyio

#: Long enough for any test's requests to finish, in simulated ns.
WITHIN = 100_000 * STEP_NS
STALL = 50 * STEP_NS
PROBE_TIMEOUT = 20 * STEP_NS


# -- ReplicaSet ------------------------------------------------------------------------------


def prompt_of(n: int, seed: int = 0) -> tuple[int, ...]:
    return tuple((seed * 131 + i * 17 + 3) % 1000 for i in range(n))


def expect_route(got: Any, want: Route | None, situation: str) -> None:
    assert got == want, f"{situation}\n  expected pick() = {want}\n  got               {got}"


@core
@rule("route-load")
def test_stage3_routes_a_request_weighs_its_prompt_and_budget_until_its_first_tokens() -> None:
    rs = replica_set()
    rs.assign("a", "r1", prompt_of(10), 5)
    steps = [("assign r1 (prompt 10, max_new_tokens 5)", 15)]
    assert rs.load("a") == 15, f"{steps}: expected load('a') == 15, got {rs.load('a')}"
    rs.progress("r1", 0)
    steps.append(("progress r1 by 0 (an event with no token)", 15))
    assert rs.load("a") == 15, (
        "no token arrived, so the prefill is not known to be done: the prompt still weighs."
        f"\n  steps {steps}\n  got load('a') = {rs.load('a')}"
    )
    rs.progress("r1", 1)
    steps.append(("progress r1 by 1 (its prefill is done)", 4))
    assert rs.load("a") == 4, (
        "after the first token the prompt no longer weighs, only the budget left "
        f"(5 - 1):\n  steps {steps}\n  got load('a') = {rs.load('a')}"
    )
    rs.progress("r1", 3)
    assert rs.load("a") == 1, f"budget 5 - 4 tokens: expected 1, got {rs.load('a')}"
    rs.progress("r1", 3)
    assert rs.load("a") == 0, (
        f"more tokens than the budget left never make a load negative: got {rs.load('a')}"
    )
    rs.release("r1")
    assert rs.load("a") == 0 and rs.total_load() == 0


@core
@rule("route-load")
def test_stage3_routes_loads_add_up_and_release_removes_what_is_left() -> None:
    rs = replica_set()
    rs.assign("a", "r1", prompt_of(10), 5)
    rs.assign("a", "r2", prompt_of(3), 7)
    rs.assign("b", "r3", prompt_of(2), 2)
    assert rs.loads() == {"a": 25, "b": 4, "c": 0}, (
        f"a carries 10+5 and 3+7, b 2+2: expected {{'a': 25, 'b': 4, 'c': 0}}, got {rs.loads()}"
    )
    assert rs.total_load() == 29, f"total_load(): expected 29, got {rs.total_load()}"
    rs.progress("r2", 2)
    rs.release("r1")
    assert rs.loads() == {"a": 5, "b": 4, "c": 0}, (
        "release r1 before its first token (all 15 go), r2 past its prefill with 5 left: "
        f"expected {{'a': 5, 'b': 4, 'c': 0}}, got {rs.loads()}"
    )
    rs.release("r2")
    rs.release("nobody")
    rs.progress("nobody", 3)
    assert rs.loads() == {"a": 0, "b": 4, "c": 0}, (
        f"release and progress of an unknown id change nothing: got {rs.loads()}"
    )


@core
@rule("route-available")
def test_stage3_routes_pick_only_replicas_up_and_not_draining_and_not_excluded() -> None:
    rs = replica_set()
    p = prompt_of(2)
    assert rs.available() == ["a", "b", "c"], f"available(): got {rs.available()}"
    rs.mark_down("a")
    rs.drain("b")
    assert rs.available() == ["c"], f"a down, b draining: expected ['c'], got {rs.available()}"
    expect_route(rs.pick(p), Route("c", "least-loaded"), "a is down and b draining")
    expect_route(rs.pick(p, exclude={"c"}), None, "a down, b draining, c excluded")
    flags = {n: (rs.is_up(n), rs.is_draining(n)) for n in "abc"}
    assert flags == {"a": (False, False), "b": (True, True), "c": (True, False)}, (
        f"(is_up, is_draining) of each: got {flags}"
    )
    rs.mark_up("a")
    rs.restore("b")
    assert rs.available() == ["a", "b", "c"], (
        f"mark_up and restore put them back, in the order given: got {rs.available()}"
    )
    expect_route(rs.pick(p, exclude=["a"]), Route("b", "least-loaded"), "a excluded")


@core
@rule("route-available", "route-affinity")
def test_stage3_routes_affinity_never_picks_a_draining_or_excluded_replica() -> None:
    p = prompt_of(16, seed=9)
    rs = replica_set(("a", "b"))
    rs.assign("a", "r1", p, 1)
    rs.release("r1")
    rs.drain("a")
    expect_route(rs.pick(p), Route("b", "least-loaded"), "a has p's prefix but is draining")
    rs.restore("a")
    expect_route(rs.pick(p, exclude={"a"}), Route("b", "least-loaded"), "a is excluded")
    expect_route(rs.pick(p), Route("a", "affinity", 4), "a is back: its prefix counts again")


@extended
@rule("route-available", "route-history")
def test_stage3_routes_a_drained_replica_keeps_its_history() -> None:
    rs = replica_set(("a", "b"))
    p = prompt_of(16, seed=7)
    rs.assign("a", "r1", p, 1)
    rs.release("r1")
    rs.drain("a")
    rs.restore("a")
    assert rs.matched_blocks("a", p) == 4, (
        "a drained replica keeps running and keeps its cache: drain and restore leave its "
        f"history as it was (4 blocks of p); got matched_blocks {rs.matched_blocks('a', p)}"
    )


@core
@rule("route-least-loaded")
def test_stage3_routes_the_least_loaded_wins_and_ties_go_in_the_order_given() -> None:
    rs = replica_set(("y", "z", "x"))  # the order given is not the names' order
    p = prompt_of(3)
    expect_route(rs.pick(p), Route("y", "least-loaded"), "replicas y, z, x, all idle")
    rs.assign("y", "r1", prompt_of(3), 4)
    expect_route(rs.pick(p), Route("z", "least-loaded"), "y carries 7, z and x nothing")
    rs.assign("z", "r2", prompt_of(2), 2)
    expect_route(rs.pick(p), Route("x", "least-loaded"), "y 7, z 4, x 0")
    rs.assign("x", "r3", prompt_of(1), 3)
    expect_route(rs.pick(p), Route("z", "least-loaded"), "y 7, z 4, x 4: a tie goes to z")


@core
@rule("route-balance")
def test_stage3_routes_the_imbalance_guard_needs_both_thresholds_strictly() -> None:
    p = prompt_of(3)
    # abs 10, rel 1.5: b = 10 each time; a's load moves across both thresholds.
    cases = [(20, False), (21, True)]  # difference 10 is not > 10; 11 is (and 21 > 15)
    for a_load, trips in cases:
        rs = replica_set(("a", "b"), balance_abs_tokens=10, balance_rel=1.5)
        rs.assign("a", "ra", prompt_of(a_load - 1), 1)
        rs.assign("b", "rb", prompt_of(9), 1)
        want = Route("b", "balance" if trips else "least-loaded")
        expect_route(rs.pick(p), want, f"loads a={a_load}, b=10, balance_abs_tokens=10, rel=1.5")
    cases = [(15, False), (16, True)]  # 15 is not > 1.5 x 10; 16 is (difference > 0)
    for a_load, trips in cases:
        rs = replica_set(("a", "b"), balance_abs_tokens=0, balance_rel=1.5)
        rs.assign("a", "ra", prompt_of(a_load - 1), 1)
        rs.assign("b", "rb", prompt_of(9), 1)
        want = Route("b", "balance" if trips else "least-loaded")
        expect_route(rs.pick(p), want, f"loads a={a_load}, b=10, balance_abs_tokens=0, rel=1.5")


@core
@rule("route-balance")
def test_stage3_routes_the_imbalance_guard_overrides_affinity() -> None:
    rs = replica_set(("a", "b"), balance_abs_tokens=10, balance_rel=1.5)
    cached = prompt_of(16, seed=1)
    rs.assign("a", "r1", cached, 20)  # a: 36 tokens, and the prefix
    expect_route(
        rs.pick(cached),
        Route("b", "balance"),
        "a holds the whole prefix but carries 36 tokens against b's 0 (> 10 and > 1.5 x 0): "
        "the guard ignores affinity",
    )
    rs2 = replica_set(("a", "b"), balance_abs_tokens=100, balance_rel=1.5)
    rs2.assign("a", "r1", cached, 20)
    expect_route(
        rs2.pick(cached),
        Route("a", "affinity", 4),
        "the same, with balance_abs_tokens=100: 36 - 0 is not > 100, so affinity decides",
    )


@core
@rule("route-affinity")
def test_stage3_routes_affinity_starts_at_the_threshold_of_full_blocks() -> None:
    base = prompt_of(32, seed=2)  # 8 full blocks
    for matched, want_affinity in [(4, True), (3, False)]:
        rs = replica_set(("a", "b"), affinity_threshold=0.5)
        rs.assign("b", "other", prompt_of(1), 1)  # b is lighter only after a's charge
        rs.assign("a", "seed", base[: matched * BLOCK] + (999,) * 2, 0 + 1)
        rs.release("seed")
        rs.release("other")
        rs.assign("a", "x", prompt_of(1), 1)  # a carries 2: least-loaded would be b
        got = rs.pick(base)
        want = Route("a", "affinity", matched) if want_affinity else Route("b", "least-loaded")
        expect_route(
            got,
            want,
            f"a's history holds the first {matched} of the prompt's 8 full blocks, "
            "affinity_threshold=0.5 (4 blocks needed); a carries 2 tokens, b none",
        )


@core
@rule("route-affinity")
def test_stage3_routes_affinity_takes_the_longest_match_then_the_lighter_load() -> None:
    base = prompt_of(24, seed=3)  # 6 full blocks
    rs = replica_set(("a", "b", "c"), affinity_threshold=0.25)
    rs.assign("a", "ra", base[:8], 1)  # 2 blocks
    rs.assign("b", "rb", base[:16], 1)  # 4 blocks
    rs.assign("c", "rc", (*base[:16], 1, 2, 3), 1)  # 4 blocks, and 3 tokens heavier
    expect_route(
        rs.pick(base),
        Route("b", "affinity", 4),
        "a matches 2 blocks, b and c 4 (c carries more): the longest match, then the lighter",
    )
    rs.release("rc")
    rs.assign("c", "rc2", prompt_of(1, seed=9), 0 + 1)
    assert rs.load("b") == 17 and rs.load("c") == 2
    expect_route(rs.pick(base), Route("c", "affinity", 4), "b and c match 4; c is lighter")


@core
@rule("route-affinity")
def test_stage3_routes_a_match_counts_leading_chained_blocks_only() -> None:
    p = prompt_of(16, seed=4)
    other_first = (7, 7, 7, 7, *p[4:])  # blocks 2-4 have the same tokens, another first block
    rs = replica_set(("a", "b"), affinity_threshold=0.25)
    rs.assign("a", "r1", other_first, 1)
    assert rs.matched_blocks("a", p) == 0, (
        "a block's key chains every block before it (api.block_hash(parent, tokens)): the "
        "same tokens after a different first block are a different prefix. Expected "
        f"matched_blocks 0, got {rs.matched_blocks('a', p)}"
    )
    rs.assign("b", "r2", p[:9], 1)  # 2 full blocks and one token
    rs.assign("a", "r3", (*p[:4], 7, 7, 7, 7), 1)  # p's block 0, then other tokens
    rs.assign("a", "r4", (7, 7, 7, 7, *p[4:8]), 1)  # p's block 1, after another block 0
    assert rs.matched_blocks("a", p[:8]) == 1, (
        "a was sent p's block 0 (r3), and p's block 1 only after a different block 0 (r4): "
        "p's first two blocks match 1, since block 1's key chains block 0's; got "
        f"{rs.matched_blocks('a', p[:8])}"
    )
    assert rs.matched_blocks("b", p) == 2, (
        "only full blocks are remembered: a 9-token prompt leaves 2 blocks (block_size 4); "
        f"got {rs.matched_blocks('b', p)}"
    )
    assert rs.matched_blocks("b", p[:3]) == 0, "a prompt shorter than a block matches nothing"
    expect_route(
        rs.pick(p[:3]),
        Route("b", "least-loaded"),
        "a 3-token prompt has no full block: b is lighter",
    )


@core
@rule("route-history")
def test_stage3_routes_history_uses_the_replicas_own_block_keys() -> None:
    p = prompt_of(12, seed=5)
    rs = replica_set(("a",))
    rs.assign("a", "r1", p, 1)
    want = keys(p)
    assert len(want) == 3
    for n in range(4):
        got = rs.matched_blocks("a", p[: n * BLOCK])
        assert got == n, f"the first {n} blocks of a routed prompt: expected {n}, got {got}"


@extended
@rule("route-history")
def test_stage3_routes_history_is_bounded_least_recently_used_first() -> None:
    rs = replica_set(("a", "b"), history_blocks=4)
    pa, pb, pc = prompt_of(8, 10), prompt_of(8, 11), prompt_of(8, 12)
    rs.assign("a", "1", pa, 1)
    rs.assign("a", "2", pb, 1)
    rs.assign("a", "3", pa, 1)  # pa used again: pb is now the least recently used
    rs.assign("a", "4", pc, 1)  # 6 keys > 4: pb's two go
    got = {name: rs.matched_blocks("a", p) for name, p in (("pa", pa), ("pb", pb), ("pc", pc))}
    assert got == {"pa": 2, "pb": 0, "pc": 2}, (
        "history_blocks=4; routed pa, pb, pa again, pc: pb's blocks are the least recently "
        f"used and go first. Expected {{'pa': 2, 'pb': 0, 'pc': 2}}, got {got}"
    )
    rs2 = replica_set(("a",), history_blocks=4)
    rs2.assign("a", "1", pa, 1)
    rs2.assign("a", "2", pb, 1)
    rs2.pick(pa)  # looking is not routing
    rs2.matched_blocks("a", pa)
    rs2.assign("a", "3", pc, 1)
    got = {name: rs2.matched_blocks("a", p) for name, p in (("pa", pa), ("pb", pb), ("pc", pc))}
    assert got == {"pa": 0, "pb": 2, "pc": 2}, (
        "history_blocks=4; routed pa, pb, then pick(pa) and matched_blocks(pa), then routed "
        "pc: only assign records, so pa is still the least recently used and goes. Expected "
        f"{{'pa': 0, 'pb': 2, 'pc': 2}}, got {got}"
    )


@extended
@rule("route-history")
def test_stage3_routes_a_prompt_longer_than_the_history_keeps_its_first_blocks() -> None:
    rs = replica_set(("a",), history_blocks=2)
    p = prompt_of(4 * BLOCK, seed=8)
    rs.assign("a", "r1", p, 1)
    got = rs.matched_blocks("a", p)
    assert got == 2, (
        "history_blocks=2 and a 4-block prompt: the first blocks, which every longer prompt "
        "shares, are recorded last (most recently used), so the last blocks go and the "
        f"first two are still matched. Expected matched_blocks 2, got {got}"
    )


@core
@rule("route-history")
def test_stage3_routes_a_replica_marked_down_forgets_its_history() -> None:
    p = prompt_of(16, seed=6)
    rs = replica_set(("a", "b"))
    rs.assign("a", "r1", p, 1)
    rs.release("r1")
    rs.mark_down("a")
    rs.mark_up("a")
    assert rs.matched_blocks("a", p) == 0, (
        "a replica that went down lost its cache (a crash, a restart): mark_down forgets "
        f"what it was sent. Got matched_blocks {rs.matched_blocks('a', p)} after down and up"
    )
    expect_route(rs.pick(p), Route("a", "least-loaded"), "nothing remembered, both idle")


@extended
@rule("routes-bad-input")
@pytest.mark.parametrize(
    ("param", "value"),
    [
        ("names", []),
        ("names", ["a", "a"]),
        ("names", "ab"),
        ("names", ["a", ""]),
        ("block_size", 0),
        ("balance_abs_tokens", -1),
        ("balance_rel", 0.5),
        ("affinity_threshold", 0.0),
        ("affinity_threshold", 1.5),
        ("history_blocks", 0),
    ],
)
def test_stage3_routes_refuse_a_nonsense_configuration(param: str, value: Any) -> None:
    options: dict[str, Any] = {
        "block_size": 4,
        "balance_abs_tokens": 1,
        "balance_rel": 1.5,
        "affinity_threshold": 0.5,
        "history_blocks": 10,
    }
    names: Any = ["a", "b"]
    if param == "names":
        names = value
    else:
        options[param] = value
    with pytest.raises(ValueError, match=param):
        stage().ReplicaSet(names, **options)


RoutesMachine.TestCase.settings = settings(max_examples=examples(200), stateful_step_count=30)
test_stage3_routes_agree_with_the_rules_written_plainly = core(
    rule("route-load", "route-balance", "route-affinity", "route-history")(RoutesMachine.TestCase)
)


# -- the Router, over replicas in process ----------------------------------------------------


def ended(readers: dict[str, Reader]) -> bool:
    return all(r.ended != "reading" for r in readers.values())


def start(router: Any, fleet: Fleet, requests: Sequence[Request], tg: Any) -> dict[str, Reader]:
    readers = {r.rid: Reader(router.generate(r), fleet.clock) for r in requests}
    for reader in readers.values():
        tg.start_soon(reader.run)
    return readers


def expect_whole(readers: dict[str, Reader], want: dict[str, tuple[int, ...]], story: str) -> None:
    for rid, reader in readers.items():
        assert reader.error is None, f"{story}\n  request {rid}: its stream raised {reader.ended}"
        got = reader.tokens
        if got != want[rid]:
            n = len(want[rid])
            extra = [t for t in got[n:]]
            raise AssertionError(
                f"{story}\n  request {rid}: the client must get every token exactly once, in "
                f"order\n  expected {list(want[rid])}\n  got      {list(got)}"
                + (f"\n  ({len(got) - n} tokens too many: {extra})" if len(got) > n else "")
            )


async def finish(
    fleet: Fleet, readers: dict[str, Reader], what: str = "every stream to end"
) -> None:
    await fleet.time.run_until(lambda: ended(readers), within_ns=WITHIN, what=what)


async def consume(fleet: Fleet, stream: Any) -> Reader:
    """Read ``stream`` to its end, moving virtual time as needed."""
    reader = Reader(stream, fleet.clock)
    async with anyio.create_task_group() as tg:
        tg.start_soon(reader.run)
        await finish(fleet, {"r": reader}, f"the stream of {stream.rid!r} to end")
    return reader


@core
@rule("relay")
@anyio_test
async def test_stage3_each_client_gets_what_its_request_generates() -> None:
    fleet = Fleet()
    reqs = [request(f"r{i}", 5 + i, 6 + i, stop_tokens={3} if i == 2 else ()) for i in range(5)]
    want = fleet.expected(reqs)
    async with fleet.running():
        router = fleet.router()
        async with serving(router), anyio.create_task_group() as tg:
            readers = start(router, fleet, reqs, tg)
            await finish(fleet, readers)
    expect_whole(readers, want, "five requests over three healthy replicas")
    for rid, reader in readers.items():
        want_reason = "stop" if want[rid] and want[rid][-1] == 3 and rid == "r2" else "length"
        assert reader.reason == want_reason, (
            f"request {rid}: the last delivery carries the finish reason the replica sent: "
            f"expected {want_reason!r}, got {reader.reason!r}"
        )
        assert all(d.finish_reason is None for _, d in reader.taken[:-1]), (
            f"request {rid}: only the last delivery carries a finish reason"
        )
        assert reader.ended == "end", f"request {rid}: after the last delivery, the iteration stops"


@core
@rule("relay")
@anyio_test
async def test_stage3_a_slow_client_gets_what_arrived_merged_into_one_read() -> None:
    fleet = Fleet()
    r = request("slow", 4, 8)
    want = fleet.expected([r])["slow"]
    async with fleet.running():
        router = fleet.router()
        async with serving(router):
            stream = router.generate(r)
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
    async with fleet.running():
        router = fleet.router()
        async with serving(router):
            stream = router.generate(r)
            load = router.statistics().outstanding
            assert load == {"a": 16, "b": 0, "c": 0}, (
                f"at generate(): a 10-token prompt with budget 6 weighs 16 on 'a'; got {load}"
            )
            await fleet.time.advance_to(T0 + STEP_NS)
            load = router.statistics().outstanding
            assert load["a"] == 5, (
                f"the first token arrived at +{STEP_NS} ns: the prompt is done, 5 tokens of "
                f"budget left; expected load 5, got {load}"
            )
            await fleet.time.advance_to(T0 + 6 * STEP_NS)
            assert router.statistics().outstanding["a"] == 0
            await consume(fleet, stream)


# -- admission -----------------------------------------------------------------------------


@core
@rule("router-admission")
@anyio_test
async def test_stage3_admission_takes_the_budget_exactly_and_refuses_one_token_more() -> None:
    fleet = Fleet()
    async with fleet.running():
        router = fleet.router(max_outstanding_tokens=40, retry_after_ns=777)
        async with serving(router):
            s1 = router.generate(request("r1", 10, 10))  # 20
            try:
                s2 = router.generate(request("r2", 10, 10))  # 40: exactly the budget
            except Overloaded as exc:
                raise AssertionError(
                    "r1 weighs 20 and r2 20: 40 tokens outstanding is exactly "
                    f"max_outstanding_tokens=40, and reaching it is admitted; got {exc!r}"
                ) from None
            with pytest.raises(Overloaded) as refused:
                router.generate(request("r3", 1, 1))
            assert refused.value.retry_after_ns == 777, (
                "the router's 429 carries retry_after_ns as configured: expected 777, got "
                f"{refused.value.retry_after_ns}"
            )
            assert router.statistics().refused == 1
            await fleet.time.advance_to(T0 + STEP_NS)  # both past their prefill: 9 + 9
            s3 = router.generate(request("r3", 10, 10))  # 18 + 20 = 38
            for s in (s1, s2, s3):
                await consume(fleet, s)


@core
@rule("router-admission")
@anyio_test
async def test_stage3_admission_refuses_what_could_never_fit_and_a_duplicate_id() -> None:
    fleet = Fleet()
    async with fleet.running():
        router = fleet.router(max_outstanding_tokens=40)
        async with serving(router):
            with pytest.raises(ValueError, match="max_outstanding_tokens"):
                router.generate(request("huge", 30, 11))
            s = router.generate(request("r1", 3, 3))
            with pytest.raises(ValueError, match="r1"):
                router.generate(request("r1", 3, 3))
            await consume(fleet, s)
            s = router.generate(request("r1", 3, 3))  # finished: the id is free again
            await consume(fleet, s)


@core
@rule("router-admission")
@anyio_test
async def test_stage3_no_replica_up_and_not_draining_is_a_replica_error() -> None:
    fleet = Fleet(names=("a", "b"))
    async with fleet.running():
        router = fleet.router()
        async with serving(router):
            router.replicas.drain("a")
            router.replicas.mark_down("b")
            with pytest.raises(ReplicaError):
                router.generate(request("r1", 3, 3))


# -- replicas that refuse -----------------------------------------------------------------------


@extended
@rule("replica-429")
@anyio_test
async def test_stage3_a_replica_that_refuses_is_skipped_not_failed() -> None:
    fleet = Fleet()
    r = request("r", 4, 4)
    want = fleet.expected([r])
    fleet["a"].refuse(1, 5_000)
    async with fleet.running():
        router = fleet.router()
        async with serving(router), anyio.create_task_group() as tg:
            readers = start(router, fleet, [r], tg)
            await finish(fleet, readers)
            stats = router.statistics()
    expect_whole(readers, want, "a answered 429 at the first read")
    assert [x.rid for x in fleet["b"].seen] == ["r#1"], (
        "a refused: the request goes to the next replica, b, as its second attempt (id "
        f"'r#1'); b saw {fleet['b'].seen}"
    )
    assert stats.down == () and stats.failovers == 0, (
        f"a 429 is not a failure: nothing is down and nothing failed over; got {stats}"
    )


@extended
@rule("replica-429")
@anyio_test
async def test_stage3_when_every_replica_refuses_the_read_raises_the_smallest_retry_hint() -> None:
    fleet = Fleet()
    for name, hint in (("a", 9_000), ("b", 4_000), ("c", 6_000)):
        fleet[name].refuse(1, hint)
    async with fleet.running():
        router = fleet.router()
        async with serving(router):
            stream = router.generate(request("r", 4, 4))
            with pytest.raises(Overloaded) as refused:
                await stream.__anext__()
            assert refused.value.retry_after_ns == 4_000, (
                "a, b and c answered 429 with hints 9000, 4000 and 6000 ns: the client may "
                f"retry at the first of them, 4000; got {refused.value.retry_after_ns}"
            )
            assert router.statistics().down == ()


# -- failover ----------------------------------------------------------------------------------


@core
@rule("failover")
@anyio_test
async def test_stage3_a_replica_dying_mid_stream_is_continued_elsewhere_exactly_once() -> None:
    fleet = Fleet()
    r = request("r", 9, 12, priority=3, stop_tokens={1_001})  # a stop token never generated
    want = fleet.expected([r])
    fleet["a"].die_after("r", 5)
    async with fleet.running():
        router = fleet.router()
        async with serving(router), anyio.create_task_group() as tg:
            readers = start(router, fleet, [r], tg)
            await fleet.time.advance_to(T0 + 5 * STEP_NS)
            first = [(x.rid, x.priority, x.stop_tokens) for x in fleet["a"].seen]
            assert first == [("r", 3, frozenset({1_001}))], (
                "the first attempt is the request itself, its priority and stop tokens "
                f"included: a saw {first}"
            )
            seen = [
                (x.rid, x.prompt, x.max_new_tokens, x.priority, x.stop_tokens)
                for x in fleet["b"].seen
            ]
            resubmitted = ("r#1", r.prompt + want["r"][:5], 12 - 5, 3, frozenset({1_001}))
            assert seen == [resubmitted], (
                "a died as the 5th token of r reached the router: at that instant r is sent "
                "to b as its prompt plus the 5 tokens already streamed, with 7 tokens of "
                "budget left, its priority and stop tokens, under the id of its second "
                "attempt, 'r#1' (id, prompt, budget, priority, stop tokens).\n  expected b to see "
                f"{[resubmitted]}\n  b saw            {seen}"
            )
            loads = router.statistics().outstanding
            assert loads == {"a": 0, "b": 9 + 5 + 7, "c": 0}, (
                "at the failover a's charge is released and b is charged for the resubmission: "
                f"its 14-token prompt and 7 tokens of budget. Expected {{'a': 0, 'b': 21, "
                f"'c': 0}}, got {loads}"
            )
            await finish(fleet, readers)
    expect_whole(readers, want, "a died after streaming 5 of 12 tokens")


@extended
@rule("failover")
@anyio_test
async def test_stage3_a_replica_that_had_the_request_takes_it_again_under_a_new_id() -> None:
    fleet = Fleet(names=("a", "b"))
    r = request("r", 6, 12)
    want = fleet.expected([r])
    fleet["a"].break_stream("r", after=2)  # a lives on, marked down
    fleet["b"].die_after("r", 3)
    async with fleet.running():
        router = fleet.router()
        async with serving(router), anyio.create_task_group() as tg:
            readers = start(router, fleet, [r], tg)
            await fleet.time.advance_to(T0 + 2 * STEP_NS)
            await router.check_health()  # a answers: up again
            await finish(fleet, readers)
    expect_whole(readers, want, "a broke r's stream at token 2; b died at r's 5th token")
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
    async with fleet.running():
        router = fleet.router()
        async with serving(router), anyio.create_task_group() as tg:
            readers = start(router, fleet, reqs, tg)
            on_a = sorted(x.rid for x in fleet["a"].seen) or sorted(
                rid for rid in want if router.replicas.replica_of(rid) == "a"
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
            await finish(fleet, readers)
            stats = router.statistics()
    expect_whole(readers, want, "a killed with two requests in flight")
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
    async with fleet.running():
        router = fleet.router()
        async with serving(router), anyio.create_task_group() as tg:
            readers = start(router, fleet, [r], tg)
            await finish(fleet, readers)
            stats = router.statistics()
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
    async with fleet.running():
        router = fleet.router(max_failovers=max_failovers)
        async with serving(router), anyio.create_task_group() as tg:
            readers = start(router, fleet, [r], tg)
            await finish(fleet, readers)
            stats = router.statistics()
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
@rule("failover")
@anyio_test
async def test_stage3_a_replica_dying_right_after_a_stop_token_ends_the_stream_with_stop() -> None:
    fleet = Fleet()
    plain = request("r", 6, 12)
    tokens = fleet.expected([plain])["r"]
    k = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])  # a fresh token
    r = request("r", 6, 12, stop_tokens={tokens[k]})
    fleet["a"].die_after("r", k + 1)  # dies with the stop token, before its finish event
    async with fleet.running():
        router = fleet.router()
        async with serving(router), anyio.create_task_group() as tg:
            readers = start(router, fleet, [r], tg)
            await finish(fleet, readers)
    expect_whole(readers, {"r": tokens[: k + 1]}, f"a died as stop token {tokens[k]} arrived")
    assert readers["r"].reason == "stop", (
        f"the last token accepted was a stop token: the request is over, reason 'stop'; "
        f"got {readers['r'].reason!r}"
    )
    resent = [x.rid for n in ("b", "c") for x in fleet[n].seen]
    assert resent == [], f"a finished request is not resubmitted: {resent}"


@core
@rule("failover")
@anyio_test
async def test_stage3_a_stream_that_breaks_moves_every_request_off_its_replica() -> None:
    fleet = Fleet()
    reqs = [request("r1", 4, 12), request("r2", 5, 12), request("r3", 6, 12)]
    want = fleet.expected(reqs)
    async with fleet.running():
        router = fleet.router(balance_abs_tokens=1_000)
        async with serving(router), anyio.create_task_group() as tg:
            readers = start(router, fleet, reqs[:2], tg)  # r1 on a, r2 on b
            router.replicas.drain("b")
            router.replicas.drain("c")
            readers |= start(router, fleet, reqs[2:], tg)  # r3 on a too
            router.replicas.restore("b")
            router.replicas.restore("c")
            on_a = sorted(x.rid for x in fleet["a"].seen) or ["r1", "r3"]
            fleet["a"].break_stream("r1", after=3)  # only r1's answer breaks; a lives on

            def resubmitted() -> list[str]:
                return sorted(
                    x.rid for n in ("b", "c") for x in fleet[n].seen if x.rid.endswith("#1")
                )

            await fleet.time.run_until(
                lambda: bool(resubmitted()), within_ns=WITHIN, what="r1's stream to break"
            )
            assert resubmitted() == ["r1#1", "r3#1"], (
                "r1 and r3 ran on a; r1's stream broke after 3 tokens: a is down, so every "
                f"request on it fails over at that instant, r3 too. Resubmitted: {resubmitted()}"
            )
            await finish(fleet, readers)
    assert sorted(on_a) == ["r1", "r3"]
    expect_whole(readers, want, "r1's stream on a broke after 3 tokens; r3 was on a too")


@extended
@rule("relay", "failover-cap")
@anyio_test
async def test_stage3_a_stream_that_ends_in_error_first_delivers_what_it_accepted() -> None:
    fleet = Fleet()
    r = request("r", 4, 12)
    want = fleet.expected([r])["r"]
    fleet["a"].die_after("r", 3)
    async with fleet.running():
        router = fleet.router(max_failovers=0)
        async with serving(router):
            stream = router.generate(r)
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
    async with fleet.running():
        router = fleet.router()
        async with serving(router), anyio.create_task_group() as tg:
            readers = start(router, fleet, [r], tg)
            await finish(fleet, readers)
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
    async with fleet.running():
        router = fleet.router()
        async with serving(router), anyio.create_task_group() as tg:
            readers = start(router, fleet, [r], tg)
            await finish(fleet, readers)
    expect_whole(
        readers,
        want,
        "a answered 429, b took r and died before its first token: the failover is a new "
        "start, a's old refusal no longer counts, and a takes r",
    )


@extended
@rule("failover-cap")
@anyio_test
async def test_stage3_a_request_fails_over_at_most_max_failovers_times() -> None:
    for cap, survives in ((1, False), (2, True)):
        fleet = Fleet()
        r = request("r", 6, 12)
        want = fleet.expected([r])
        fleet["a"].die_after("r", 2)
        fleet["b"].die_after("r", 2)  # b's own 2nd token: the request's 4th
        async with fleet.running():
            router = fleet.router(max_failovers=cap)
            async with serving(router), anyio.create_task_group() as tg:
                readers = start(router, fleet, [r], tg)
                await finish(fleet, readers)
        reader = readers["r"]
        if survives:
            expect_whole(readers, want, "a died at token 2, b at token 4, max_failovers=2")
        else:
            assert isinstance(reader.error, ReplicaError), (
                "a died at token 2 (failover 1 of 1), then b at token 4: max_failovers=1 "
                f"ends the stream with ReplicaError; it ended {reader.ended}"
            )
            assert reader.tokens == want["r"][:4], (
                f"the tokens before the end are still delivered once: {reader.tokens}"
            )


# -- silence, probes and the epoch ---------------------------------------------------------


@extended
@rule("router-stall")
@anyio_test
async def test_stage3_a_silent_replica_is_presumed_dead_at_the_stall_timeout() -> None:
    fleet = Fleet()
    r, other = request("r", 6, 12), request("other", 3, 80)
    want = fleet.expected([r, other])
    async with fleet.running():
        router = fleet.router(stall_timeout_ns=STALL)
        async with serving(router), anyio.create_task_group() as tg:
            readers = start(router, fleet, [r, other], tg)
            await fleet.time.advance_to(T0 + 4 * STEP_NS)  # the 4th token arrives
            assert router.replicas.replica_of("other") == "b"
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
            assert router.statistics().down == ("a",)
            assert router.replicas.replica_of("other") == "b", (
                "only the silent replica's requests move: 'other' streams on from b"
            )
            await finish(fleet, readers)
    expect_whole(readers, want, "a stopped after 4 tokens, while b streamed on")


@extended
@rule("router-stall")
@anyio_test
async def test_stage3_silence_is_counted_from_the_attempts_start() -> None:
    fleet = Fleet()
    r = request("r", 6, 5)
    want = fleet.expected([r])
    fleet["a"].stop()
    async with fleet.running():
        router = fleet.router(stall_timeout_ns=STALL)
        async with serving(router), anyio.create_task_group() as tg:
            readers = start(router, fleet, [r], tg)
            await fleet.time.advance_to(T0 + STALL - 1)
            assert fleet["b"].seen == [], "no failover before the timeout"
            await fleet.time.advance_to(T0 + STALL)
            assert [x.rid for x in fleet["b"].seen] == ["r#1"], (
                "a stopped before its first token: silence counts from the attempt's start, "
                f"so r fails over at +{STALL} ns"
            )
            await finish(fleet, readers)
    expect_whole(readers, want, "a was stopped from the start")


@extended
@rule("router-stall")
@anyio_test
async def test_stage3_a_replica_that_keeps_streaming_is_never_presumed_dead() -> None:
    fleet = Fleet()
    r = request("long", 4, 200)  # 200 steps, far longer than the stall timeout
    want = fleet.expected([r])
    async with fleet.running():
        router = fleet.router(stall_timeout_ns=STALL)
        async with serving(router), anyio.create_task_group() as tg:
            readers = start(router, fleet, [r], tg)
            await finish(fleet, readers)
            stats = router.statistics()
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
    async with fleet.running():
        router = fleet.router(stall_timeout_ns=STALL)
        async with serving(router), anyio.create_task_group() as tg:
            readers = start(router, fleet, reqs, tg)
            await finish(fleet, readers)
            stats = router.statistics()
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
    async with fleet.running():
        router = fleet.router(stall_timeout_ns=STALL)
        async with serving(router), anyio.create_task_group() as tg:
            router.replicas.drain("b")
            readers = start(router, fleet, [r1], tg)
            await fleet.time.advance_to(T0 + STEP_NS)  # r1's first token: a's last event
            fleet["a"].stop()
            await fleet.time.advance_to(T0 + STEP_NS + STALL // 2)
            readers |= start(router, fleet, [r2], tg)  # to a, silent for STALL / 2 already
            router.replicas.restore("b")
            await fleet.time.advance_to(T0 + STEP_NS + STALL - 1)
            assert fleet["b"].seen == [], "a's silence has not reached the timeout yet"
            await fleet.time.advance_to(T0 + STEP_NS + STALL)
            moved = sorted(x.rid for x in fleet["b"].seen)
            assert moved == ["r1#1", "r2#1"], (
                f"a was last heard at +{STEP_NS} ns; r2 started there at "
                f"+{STEP_NS + STALL // 2} ns, which is not a sign of life: at "
                f"+{STEP_NS + STALL} ns a is presumed dead and both fail over. b saw {moved}"
            )
            await finish(fleet, readers)
    expect_whole(readers, want, "a stopped after r1's first token; r2 sent to it later")


@extended
@rule("epoch")
@anyio_test
async def test_stage3_a_stopped_replica_that_comes_back_injects_nothing() -> None:
    fleet = Fleet()
    r = request("r", 6, 12)
    want = fleet.expected([r])
    async with fleet.running():
        router = fleet.router(stall_timeout_ns=STALL)
        async with serving(router), anyio.create_task_group() as tg:
            readers = start(router, fleet, [r], tg)
            await fleet.time.advance_to(T0 + 3 * STEP_NS)
            fleet["a"].stop()
            await fleet.time.advance_to(T0 + 3 * STEP_NS + STALL)
            assert fleet["a"].closed == 1, (
                "r failed over at the stall timeout: its attempt on a is superseded, and its "
                f"connection is closed at once; a's connections closed: {fleet['a'].closed}"
            )
            fleet["a"].resume()  # SIGCONT: a wakes up with r's tokens in its buffers
            await finish(fleet, readers)
    expect_whole(readers, want, "a stopped after 3 tokens, failed over, then resumed (SIGCONT)")


@extended
@rule("epoch")
@anyio_test
async def test_stage3_an_event_read_just_before_a_failover_is_dropped() -> None:
    fleet = Fleet()
    reqs = [request("r1", 4, 12), request("r2", 5, 12)]
    want = fleet.expected(reqs)
    async with fleet.running():
        router = fleet.router()
        async with serving(router), anyio.create_task_group() as tg:
            for name in ("b", "c"):
                router.replicas.drain(name)
            readers = start(router, fleet, reqs, tg)  # both on a
            for name in ("b", "c"):
                router.replicas.restore(name)
            # Both answers break at their 3rd token, which a's step hands to both pumps at
            # once: whichever runs first fails a over, and the other is already holding its
            # 3rd token — an event of an attempt that has just lost its request.
            fleet["a"].break_stream("r1", after=3)
            fleet["a"].break_stream("r2", after=3)
            await finish(fleet, readers)
    expect_whole(readers, want, "r1 and r2 on a, both answers broken at the 3rd token, in one step")


@extended
@rule("epoch")
@anyio_test
async def test_stage3_a_zombie_resumed_at_the_failover_instant_injects_nothing() -> None:
    fleet = Fleet()
    r = request("r", 6, 12)
    want = fleet.expected([r])
    async with fleet.running():
        router = fleet.router(stall_timeout_ns=STALL)
        async with serving(router), anyio.create_task_group() as tg:
            readers = start(router, fleet, [r], tg)
            await fleet.time.advance_to(T0 + 2 * STEP_NS)
            fleet["a"].stop()
            await fleet.time.advance_to(T0 + 2 * STEP_NS + STALL - 1)
            fleet["a"].resume()
            fleet["a"].stop()  # a's next event is ready, held at the instant of the timeout
            await fleet.time.advance_to(T0 + 2 * STEP_NS + STALL)
            fleet["a"].resume()
            await finish(fleet, readers)
    expect_whole(readers, want, "a's late event released at the instant r failed over")


@extended
@rule("probe")
@anyio_test
async def test_stage3_a_probe_waits_at_most_the_probe_timeout() -> None:
    fleet = Fleet()
    async with fleet.running():
        router = fleet.router(probe_timeout_ns=PROBE_TIMEOUT)
        async with serving(router), anyio.create_task_group() as tg:
            fleet["b"].stop()
            done = anyio.Event()

            async def probe() -> None:
                await router.check_health()
                done.set()

            tg.start_soon(probe)
            await fleet.time.advance_to(T0 + PROBE_TIMEOUT - 1)
            assert not done.is_set() and router.statistics().down == (), (
                f"b does not answer its probe: before probe_timeout_ns={PROBE_TIMEOUT} it is "
                f"not yet down; got down={router.statistics().down}"
            )
            await fleet.time.advance_to(T0 + PROBE_TIMEOUT)
            assert done.is_set(), "check_health() returns once every probe answered or timed out"
            assert router.statistics().down == ("b",), (
                f"b did not answer within the probe timeout: down; got {router.statistics().down}"
            )
            fleet["b"].resume()
            await router.check_health()
            assert router.statistics().down == (), "b answers again: it is up again"


@extended
@rule("probe")
@anyio_test
async def test_stage3_probes_run_at_once_and_any_exception_is_a_failed_probe() -> None:
    fleet = Fleet(names=("a", "b", "c"))
    async with fleet.running():
        router = fleet.router(probe_timeout_ns=PROBE_TIMEOUT)
        async with serving(router), anyio.create_task_group() as tg:
            fleet["a"].stop()
            fleet["b"].stop()
            fleet["c"].probe_error = OSError("connection reset by peer")
            done: list[int] = []

            async def probe() -> None:
                await router.check_health()
                done.append(fleet.now)

            tg.start_soon(probe)
            await fleet.time.run_until(lambda: bool(done), within_ns=WITHIN, what="the round")
            assert done == [T0 + PROBE_TIMEOUT], (
                "a and b do not answer: the replicas are probed at once, so the round ends "
                f"when both probes time out together, at +{PROBE_TIMEOUT} ns; it ended at "
                f"{[t - T0 for t in done]}"
            )
            assert router.statistics().down == ("a", "b", "c"), (
                "c's probe raised OSError: any exception is a failed probe, and c is down "
                f"(a and b did not answer); got down={router.statistics().down}"
            )
            fleet["a"].resume()
            fleet["b"].resume()


@extended
@rule("probe")
@anyio_test
async def test_stage3_the_next_probe_round_is_an_interval_after_the_last_one_ends() -> None:
    fleet = Fleet(names=("a", "b"))
    interval = 1_000 * STEP_NS
    async with fleet.running():
        router = fleet.router(probe_interval_ns=interval, probe_timeout_ns=PROBE_TIMEOUT)
        async with serving(router):
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
async def test_stage3_a_failed_probe_fails_over_the_replicas_requests_at_once() -> None:
    fleet = Fleet()
    r = request("r", 6, 12)
    want = fleet.expected([r])
    async with fleet.running():
        router = fleet.router(stall_timeout_ns=WITHIN, probe_timeout_ns=PROBE_TIMEOUT)
        async with serving(router), anyio.create_task_group() as tg:
            readers = start(router, fleet, [r], tg)
            await fleet.time.advance_to(T0 + 3 * STEP_NS)
            fleet["a"].stop()
            tg.start_soon(router.check_health)
            await fleet.time.advance_to(T0 + 3 * STEP_NS + PROBE_TIMEOUT)
            assert [x.rid for x in fleet["b"].seen] == ["r#1"], (
                "a failed its probe: its request fails over at that instant, long before the "
                "stall timeout"
            )
            await finish(fleet, readers)
    expect_whole(readers, want, "a stopped, found down by a probe")


@extended
@rule("probe")
@anyio_test
async def test_stage3_the_router_probes_on_its_own_and_brings_a_restarted_replica_back() -> None:
    fleet = Fleet()
    interval = 1_000 * STEP_NS
    async with fleet.running():
        router = fleet.router(probe_interval_ns=interval, probe_timeout_ns=PROBE_TIMEOUT)
        async with serving(router):
            fleet["c"].kill()
            await fleet.time.run_until(
                lambda: router.statistics().down == ("c",),
                within_ns=2 * interval + PROBE_TIMEOUT,
                what="the router's own probe to find c dead",
            )
            fleet["c"].restart()
            await fleet.time.run_until(
                lambda: router.statistics().down == (),
                within_ns=2 * interval + PROBE_TIMEOUT,
                what="the router's own probe to find c back after its restart",
            )


@extended
@rule("probe", "route-history")
@anyio_test
async def test_stage3_a_replica_back_from_the_dead_is_not_routed_for_its_old_cache() -> None:
    fleet = Fleet(names=("a", "b"))
    prompt = shared(1, 4, 2, 0)
    first, again = Request("r1", prompt, 2), Request("r2", (*prompt[:-1], 5), 2)
    async with fleet.running():
        router = fleet.router(affinity_threshold=0.5)
        async with serving(router):
            await consume(fleet, router.generate(first))
            assert fleet["a"].seen and fleet["a"].seen[0].rid == "r1"
            fleet["a"].restart()
            router.replicas.mark_down("a")
            await router.check_health()
            assert router.statistics().down == ()
            stream = router.generate(again)
            why = router.statistics().by_affinity
            await consume(fleet, stream)
    assert why == 0, (
        "a restarted (its cache is empty) and was marked down, then up: the router forgot "
        "what it had sent there, so r2 is routed by load, not by affinity; by_affinity = "
        f"{why}"
    )


# -- clients that leave ------------------------------------------------------------------------


@core
@rule("client-leaves")
@anyio_test
async def test_stage3_a_client_that_leaves_ends_its_attempt_at_once() -> None:
    fleet = Fleet()
    async with fleet.running():
        router = fleet.router()
        async with serving(router):
            stream = router.generate(request("r", 6, 50))
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
            assert router.statistics().outstanding == {"a": 0, "b": 0, "c": 0}, (
                f"its load is released: got {router.statistics().outstanding}"
            )


@extended
@rule("client-leaves")
@anyio_test
async def test_stage3_the_id_of_a_client_that_left_is_free_again() -> None:
    fleet = Fleet()
    async with fleet.running():
        router = fleet.router()
        async with serving(router):
            stream = router.generate(request("r", 6, 50))
            await fleet.time.advance_to(T0 + 2 * STEP_NS)
            await stream.aclose()
            try:
                again = router.generate(request("r", 6, 3))
            except ValueError as exc:
                raise AssertionError(
                    f"r's client left: its id is free again, not 'in flight'; got {exc!r}"
                ) from None
            reader = await consume(fleet, again)
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
                start(router, fleet, [request("r1", 4, 50), request("r2", 5, 50)], tg)
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
    async with fleet.running():
        router = fleet.router()
        async with serving(router), anyio.create_task_group() as tg:
            reader = Reader(router.generate(request("r", 6, 50)), fleet.clock)
            scope = anyio.CancelScope()

            async def read() -> None:
                with scope:
                    await reader.run()

            tg.start_soon(read)
            await fleet.time.advance_to(T0 + 3 * STEP_NS + 1)
            scope.cancel()
            await fleet.time.settle()
            assert fleet["a"].closed == 1 and not fleet["a"].batcher.has_unfinished(), (
                "the client was cancelled while waiting for a token: its attempt ends at once"
            )
            assert router.statistics().outstanding["a"] == 0


# -- draining and closing ----------------------------------------------------------------------


@extended
@rule("router-drain")
@anyio_test
async def test_stage3_drain_routes_nothing_more_and_returns_when_the_last_request_ends() -> None:
    fleet = Fleet(names=("a", "b"))
    r = request("r", 4, 10)
    async with fleet.running():
        router = fleet.router()
        async with serving(router), anyio.create_task_group() as tg:
            readers = start(router, fleet, [r], tg)  # on a
            drained_at: list[int] = []

            async def drain() -> None:
                await router.drain("a")
                drained_at.append(fleet.now)

            tg.start_soon(drain)
            await fleet.time.settle()
            later = router.generate(request("later", 4, 2))
            assert router.replicas.replica_of("later") == "b", "a is draining: new work goes to b"
            readers["later"] = Reader(later, fleet.clock)
            tg.start_soon(readers["later"].run)
            fleet["b"].die_after("later", 1)
            await finish(fleet, readers)
            await fleet.time.settle()
    assert drained_at == [T0 + 10 * STEP_NS], (
        f"drain('a') returns when r, the last request on a, ends at +{10 * STEP_NS} ns; "
        f"it returned at {[t - T0 for t in drained_at]}"
    )
    router.restore("a")
    assert router.replicas.available() == ["a"], "restore('a') puts a back into routing"
    assert isinstance(readers["later"].error, ReplicaError), (
        "b died under 'later', and a is draining: failovers do not go to a draining replica "
        f"either, so it has nowhere to go; the stream ended {readers['later'].ended}"
    )


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
            readers = start(router, fleet, [request("r", 4, 100)], tg)
            await fleet.time.advance_to(T0 + 3 * STEP_NS)
            await router.aclose()
            await fleet.time.settle()
            assert isinstance(readers["r"].error, ReplicaError), (
                f"aclose() ends an open stream with ReplicaError; it ended {readers['r'].ended}"
            )
            with pytest.raises(ReplicaError):
                router.generate(request("late", 2, 2))
            assert fleet["a"].closed == 1, "its attempt's connection is closed"


# -- statistics and bad input ------------------------------------------------------------------


@extended
@rule("router-statistics")
@anyio_test
async def test_stage3_statistics_count_routes_failovers_and_refusals() -> None:
    fleet = Fleet(names=("a", "b"))
    prompt = shared(3, 4, 1, 0)
    fleet["a"].die_after("r2", 2)
    async with fleet.running():
        router = fleet.router(max_outstanding_tokens=60, affinity_threshold=0.5)
        async with serving(router):
            await consume(fleet, router.generate(Request("r1", prompt, 3)))
            stream = router.generate(Request("r2", (*prompt[:-1], 9), 4))  # affinity: a
            with pytest.raises(Overloaded):
                router.generate(Request("big", (1,) * 40, 20))
            await consume(fleet, stream)
            stats = router.statistics()
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
    ],
)
def test_stage3_the_router_refuses_a_nonsense_configuration(param: str, value: Any) -> None:
    fleet = Fleet()
    wrong = (TypeError, ValueError) if value is True else ValueError  # not an int: either
    with pytest.raises(wrong, match=param):
        fleet.router(**{param: value})


@extended
@rule("router-bad-input")
@anyio_test
async def test_stage3_generate_refuses_what_is_not_a_request() -> None:
    fleet = Fleet()
    async with fleet.running():
        router = fleet.router()
        async with serving(router):
            with pytest.raises(TypeError):
                router.generate(("r", (1, 2), 3))


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
    async with fleet.running():
        router = fleet.router(stall_timeout_ns=STALL, max_failovers=5)
        async with serving(router), anyio.create_task_group() as tg:
            readers = start(router, fleet, reqs, tg)
            for kind, which, at in sorted(faults, key=lambda f: f[2]):
                rid = reqs[which].rid
                if readers[rid].ended != "reading" or len(readers[rid].tokens) >= at:
                    continue

                def reached(rid: str = rid, at: int = at) -> bool:
                    return len(readers[rid].tokens) >= at or readers[rid].ended != "reading"

                await fleet.time.run_until(reached, within_ns=WITHIN, what=f"{rid} at token {at}")
                where = router.replicas.replica_of(rid)
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
                    return bool(router.replicas.replica_of(rid) != where)

                await fleet.time.run_until(
                    moved, within_ns=WITHIN, what=f"the router to move {rid} off {where}"
                )
                for other in fleet.replicas.values():
                    if other is not replica and other.dead:
                        other.restart()
                        story.append(f"  {other.name} restarted")
                await router.check_health()
            for replica in fleet.replicas.values():
                if replica.dead:
                    replica.restart()
            await router.check_health()
            await finish(fleet, readers)
    expect_whole(readers, want, "\n    ".join(story))


@core
@rule("route-balance")
@anyio_test
async def test_stage3_under_the_guard_no_replica_carries_more_than_1_5x_the_mean() -> None:
    fleet = Fleet(names=("a", "b", "c", "d"), replica={"max_num_seqs": 16})
    # One shared prefix pulls every request to one replica; lengths are uneven.
    reqs = [Request(f"r{i}", shared(7, 6, 1 + i % 3, i), 8 + (i * 37) % 41) for i in range(48)]
    worst: list[tuple[float, dict[str, int]]] = []
    async with fleet.running():
        router = fleet.router(balance_abs_tokens=32, balance_rel=1.2, affinity_threshold=0.5)
        async with serving(router), anyio.create_task_group() as tg:
            readers: dict[str, Reader] = {}
            for i, r in enumerate(reqs):
                readers[r.rid] = Reader(router.generate(r), fleet.clock)
                tg.start_soon(readers[r.rid].run)
                loads = router.statistics().outstanding
                mean = sum(loads.values()) / len(loads)
                if i >= 8:
                    worst.append((max(loads.values()) / mean, dict(loads)))
                if i % 4 == 3:
                    await fleet.time.advance(STEP_NS)
            await finish(fleet, readers)
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
                        await consume(fleet, router.generate(r))
            else:
                names = list(fleet.replicas)
                for i, r in enumerate(reqs):
                    completion = fleet[names[i % len(names)]].stream(r)
                    done = anyio.Event()

                    async def read(completion: Any = completion, done: anyio.Event = done) -> None:
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
async def test_stage3_real_a_replica_killed_mid_stream_loses_and_repeats_nothing(
    impl_selection: impl.Selection,
) -> None:
    reqs = [request(f"r{i}", 5 + i, 40) for i in range(6)]
    want = real_expected(reqs)
    with replicas(impl_selection, "a", "b", "c") as procs:
        links = [HttpLink(n, p.url) for n, p in procs.items()]
        router = real_router(links)
        async with serving(router), anyio.create_task_group() as tg:
            readers = start_real(router, reqs, tg)
            await stream_until(readers, lambda: len(readers["r0"].tokens) >= 5, "r0 at token 5")
            victim = router.replicas.replica_of("r0")
            procs[victim].kill()  # SIGKILL
            await stream_until(readers, lambda: ended(readers), "every stream to end")
            stats = router.statistics()
    expect_whole(readers, want, f"replica {victim} got SIGKILL while r0 had 5 of 40 tokens")
    assert victim in stats.down and stats.failovers >= 1, f"got {stats}"


@extended
@rule("epoch", "router-stall")
@anyio_test
async def test_stage3_real_a_stopped_replica_that_continues_injects_nothing(
    impl_selection: impl.Selection,
) -> None:
    reqs = [request(f"r{i}", 4 + i, 30) for i in range(3)]
    want = real_expected(reqs)
    with replicas(impl_selection, "a", "b") as procs:
        links = [HttpLink(n, p.url) for n, p in procs.items()]
        router = real_router(links)
        async with serving(router), anyio.create_task_group() as tg:
            readers = start_real(router, reqs, tg)
            await stream_until(readers, lambda: len(readers["r0"].tokens) >= 3, "r0 at token 3")
            victim = router.replicas.replica_of("r0")
            assert victim is not None
            procs[victim].process.send(signal.SIGSTOP)
            try:
                await stream_until(
                    readers,
                    lambda: router.replicas.replica_of("r0") not in (None, victim),
                    "r0 to fail over after the stall timeout",
                )
            finally:
                procs[victim].process.send(signal.SIGCONT)  # the zombie wakes up
            await stream_until(readers, lambda: ended(readers), "every stream to end")
            procs[victim].wait_for("disconnected r0")  # its old connection was closed
            await router.check_health()
            stats = router.statistics()
    expect_whole(readers, want, f"replica {victim} got SIGSTOP at r0's 3rd token, then SIGCONT")
    assert stats.down == (), f"the resumed replica answers its probe again: {stats}"


@extended
@rule("probe")
@anyio_test
async def test_stage3_real_a_replica_restarted_on_its_port_is_routed_again(
    impl_selection: impl.Selection,
) -> None:
    with replicas(impl_selection, "a", "b") as procs:
        links = [HttpLink(n, p.url) for n, p in procs.items()]
        router = real_router(links)
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
async def test_stage3_real_a_replica_answering_garbage_is_a_failure_not_a_crash(
    impl_selection: impl.Selection, answer: str
) -> None:
    reqs = [request(f"r{i}", 3 + i, 6) for i in range(3)]
    want = real_expected(reqs)
    with replicas(impl_selection, "good") as procs:
        async with garbage_server(GARBAGE[answer]) as url:
            links = [HttpLink("bad", url), HttpLink("good", procs["good"].url)]
            router = real_router(links)
            async with serving(router), anyio.create_task_group() as tg:
                readers = start_real(router, reqs, tg)
                await stream_until(readers, lambda: ended(readers), "every stream to end")
                stats = router.statistics()
    expect_whole(readers, want, f"replica 'bad' answered {answer}")
    assert stats.down == ("bad",), f"a replica answering {answer} is down: got {stats.down}"
