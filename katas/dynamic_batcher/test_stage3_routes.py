"""Stage 3, the routing policy: ``ReplicaSet`` without I/O (see
katas/dynamic_batcher/README.md, "Stage 3"; ``-k routes``).

Each rule at its boundary — the token where a request's prefill charge ends, the load
difference where the imbalance guard trips, the matched block where affinity starts —
then a state machine that compares the set with
:class:`~katas.dynamic_batcher._testing.routes.RoutesModel`, the rules written plainly
from the prompt. The router's own tests are in ``test_stage3.py``, the fleet's
properties and the real processes in ``test_stage3_fleet.py``.

Map: route-load · route-available · route-balance · route-affinity · route-least-loaded
· route-history · routes-bad-input · the state machine.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import pytest
from hypothesis import settings

from katas._harness.marks import core, extended, rule
from katas._harness.profiles import examples
from katas._harness.story import expect
from katas._harness.under_test import stage
from katas.dynamic_batcher._testing.routes import (
    BLOCK,
    RoutesMachine,
    expect_matched,
    expect_route,
    keys,
    not_a_number_of_its_kind,
    replica_set,
)
from katas.dynamic_batcher.api import Route, RoutingPolicy

pytestmark = [pytest.mark.stage(3)]


# -- ReplicaSet ------------------------------------------------------------------------------


def prompt_of(n: int, seed: int = 0) -> tuple[int, ...]:
    return tuple((seed * 131 + i * 17 + 3) % 1000 for i in range(n))


def served_by_a(p: tuple[int, ...]) -> RoutingPolicy:
    """Replicas a and b, where a has served a request of prompt ``p`` to its end: a
    remembers p's blocks, and neither carries any load."""
    rs = replica_set(("a", "b"))
    rs.assign("a", "r1", p, 1)
    rs.release("r1")
    return rs


def back_after(p: tuple[int, ...], away: Literal["drained", "down"]) -> RoutingPolicy:
    """Replicas a and b, where a served ``p``, then was away and came back: drained and
    restored (still running, its cache intact), or marked down and up (its cache lost)."""
    rs = served_by_a(p)
    if away == "drained":
        rs.drain("a")
        rs.restore("a")
    else:
        rs.mark_down("a")
        rs.mark_up("a")
    return rs


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
@rule("route-load")
def test_stage3_routes_a_replica_down_or_draining_still_counts_in_every_load() -> None:
    """A replica's health says where new work goes, not what is owed: the requests still
    assigned to a replica marked down or draining weigh in ``load``, ``loads`` and
    ``total_load`` alike until they are released."""
    rs = replica_set()
    rs.assign("a", "r1", prompt_of(10), 5)  # 15
    rs.assign("b", "r2", prompt_of(3), 7)  # 10
    rs.assign("c", "r3", prompt_of(2), 2)  # 4
    rs.progress("r2", 3)  # 4 left
    steps = ["assign a r1 (10 + 5)", "assign b r2 (3 + 7)", "assign c r3 (2 + 2)", "progress r2 3"]
    for call, name in (("mark_down", "a"), ("drain", "b"), ("mark_down", "c"), ("drain", "c")):
        getattr(rs, call)(name)
        steps.append(f"{call} {name}")
        got = ([rs.load(n) for n in "abc"], rs.loads(), rs.total_load())
        want = ([15, 4, 4], {"a": 15, "b": 4, "c": 4}, 23)
        expect(
            got,
            want,
            "route-load: a replica's loads count every request assigned to it, up, down or "
            "draining, and total_load() is their sum; after "
            f"{', '.join(steps)}: ([load(a), load(b), load(c)], loads(), total_load())",
        )
    rs.release("r1")
    rs.release("r3")
    expect(
        (rs.loads(), rs.total_load()),
        ({"a": 0, "b": 4, "c": 0}, 4),
        "route-load: releasing the requests of the replicas down removes their tokens, and "
        "only then: (loads(), total_load())",
    )


@extended
@rule("route-load")
def test_stage3_routes_a_refused_assign_charges_and_remembers_nothing() -> None:
    """Assigning a ``rid`` already assigned is a ``ValueError``, to a replica that does not
    exist a ``KeyError``: either way nothing is charged, no prefix is remembered, and the
    ``rid`` stays where it was (or unassigned). Every call naming an unknown replica is a
    ``KeyError``."""
    rs = replica_set()
    p, q = prompt_of(3 * BLOCK), prompt_of(2 * BLOCK, seed=5)
    rs.assign("a", "r1", p, 5)
    with pytest.raises(ValueError, match="r1"):
        rs.assign("b", "r1", q, 7)
    with pytest.raises(KeyError):
        rs.assign("nowhere", "r2", q, 7)
    got = (rs.loads(), rs.replica_of("r1"), rs.replica_of("r2"), rs.matched_blocks("b", q))
    want = ({"a": len(p) + 5, "b": 0, "c": 0}, "a", None, 0)
    assert got == want, (
        f"r1 ({len(p)} + 5 tokens) on a; then assign('b', 'r1', …) (already assigned) and "
        "assign('nowhere', 'r2', …) were refused, so they charged nothing and b remembers "
        "no block: expected (loads, replica_of r1, replica_of r2, b's matched blocks) = "
        f"{want}\n  got {got}"
    )
    rs.assign("b", "r2", q, 7)  # r2 was never assigned: it may be now
    rs.release("r1")
    assert rs.loads() == {"a": 0, "b": len(q) + 7, "c": 0}, (
        f"r1 released, r2 on b: expected a 0 and b {len(q) + 7}, got {rs.loads()}"
    )
    for call in ("mark_down", "mark_up", "drain", "restore", "load", "is_up", "is_draining"):
        with pytest.raises(KeyError):
            getattr(rs, call)("nowhere")
    with pytest.raises(KeyError):
        rs.matched_blocks("nowhere", p)


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
    rs = served_by_a(p)
    rs.drain("a")
    expect_route(rs.pick(p), Route("b", "least-loaded"), "a has p's prefix but is draining")
    rs.restore("a")
    expect_route(rs.pick(p, exclude={"a"}), Route("b", "least-loaded"), "a is excluded")
    expect_route(rs.pick(p), Route("a", "affinity", 4), "a is back: its prefix counts again")


@extended
@rule("route-available", "route-history")
def test_stage3_routes_a_drained_replica_keeps_its_history() -> None:
    p = prompt_of(16, seed=7)
    expect_matched(
        back_after(p, "drained").matched_blocks("a", p),
        4,
        "a drained replica keeps running and keeps its cache: drain and restore leave its "
        "history as it was (4 blocks of p)",
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
    # rel 1.5: b = 10 each time; a's load moves across both thresholds.
    cases = [
        (10, 20, False),  # abs 10: a difference of 10 is not > 10;
        (10, 21, True),  # 11 is (and 21 > 15)
        (0, 15, False),  # abs 0: 15 is not > 1.5 x 10;
        (0, 16, True),  # 16 is (difference > 0)
    ]
    for balance_abs, a_load, trips in cases:
        rs = replica_set(("a", "b"), balance_abs_tokens=balance_abs, balance_rel=1.5)
        rs.assign("a", "ra", prompt_of(a_load - 1), 1)
        rs.assign("b", "rb", prompt_of(9), 1)
        want = Route("b", "balance" if trips else "least-loaded")
        loads = f"loads a={a_load}, b=10, balance_abs_tokens={balance_abs}, rel=1.5"
        expect_route(rs.pick(p), want, loads)


@extended
@rule("route-balance")
def test_stage3_routes_the_imbalance_guard_compares_the_ratio_exactly() -> None:
    p = prompt_of(3)
    big = 2**53  # past a float's exact integers
    # (balance_rel, a's load, b's load, trips): a ratio of exactly balance_rel does not trip
    cases = [
        (1.4, 63, 45, False),  # 63 / 45 is 1.4 exactly (45 x 1.4 in floats: 62.999...)
        (1.4, 64, 45, True),
        (1.5, 3 * big + 3, 2 * big + 2, False),  # exactly 1.5, in ints no float holds
        (1.5, 3 * big + 4, 2 * big + 2, True),
    ]
    for rel, a_load, b_load, trips in cases:
        rs = replica_set(("a", "b"), balance_abs_tokens=0, balance_rel=rel)
        rs.assign("a", "ra", prompt_of(1), a_load - 1)
        rs.assign("b", "rb", prompt_of(1, seed=1), b_load - 1)
        expect_route(
            rs.pick(p),
            Route("b", "balance" if trips else "least-loaded"),
            f"loads a={a_load}, b={b_load}, balance_abs_tokens=0, balance_rel={rel}: the "
            f"guard trips only when a > {rel} x b, compared exactly, {rel} as written",
        )


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


@extended
@rule("route-affinity")
def test_stage3_routes_the_affinity_threshold_is_compared_exactly() -> None:
    base = prompt_of(100 * BLOCK, seed=4)  # 100 full blocks
    for matched, want_affinity in [(55, True), (54, False)]:
        rs = replica_set(("a", "b"), affinity_threshold=0.55)
        rs.assign("a", "seed", base[: matched * BLOCK], 1)
        rs.release("seed")
        rs.assign("a", "x", prompt_of(1), 1)  # a carries 2: least-loaded would be b
        want = Route("a", "affinity", matched) if want_affinity else Route("b", "least-loaded")
        expect_route(
            rs.pick(base),
            want,
            f"a's history holds the first {matched} of the prompt's 100 full blocks, "
            "affinity_threshold=0.55: 0.55 x 100 is exactly 55 blocks (55.000...01 in "
            "floats), so 55 matched blocks reach it; a carries 2 tokens, b none",
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
    expect_matched(
        rs.matched_blocks("a", p),
        0,
        "a block's key chains every block before it (api.block_hash(parent, tokens)): the "
        "same tokens after a different first block are a different prefix",
    )
    rs.assign("b", "r2", p[:9], 1)  # 2 full blocks and one token
    rs.assign("a", "r3", (*p[:4], 7, 7, 7, 7), 1)  # p's block 0, then other tokens
    rs.assign("a", "r4", (7, 7, 7, 7, *p[4:8]), 1)  # p's block 1, after another block 0
    expect_matched(
        rs.matched_blocks("a", p[:8]),
        1,
        "a was sent p's block 0 (r3), and p's block 1 only after a different block 0 (r4): "
        "p's first two blocks match 1, since block 1's key chains block 0's",
    )
    expect_matched(
        rs.matched_blocks("b", p),
        2,
        "only full blocks are remembered: a 9-token prompt leaves 2 blocks (block_size 4)",
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
    expect_matched(
        rs.matched_blocks("a", p),
        2,
        "history_blocks=2 and a 4-block prompt: the first blocks, which every longer prompt "
        "shares, are recorded last (most recently used), so the last blocks go and the "
        "first two are still matched",
    )


@core
@rule("route-history")
def test_stage3_routes_a_replica_marked_down_forgets_its_history() -> None:
    p = prompt_of(16, seed=6)
    rs = back_after(p, "down")
    expect_matched(
        rs.matched_blocks("a", p),
        0,
        "a replica that went down lost its cache (a crash, a restart): mark_down forgets "
        "what it was sent, and after down and up nothing of p is matched",
    )
    expect_route(rs.pick(p), Route("a", "least-loaded"), "nothing remembered, both idle")


@core
@rule("route-history")
def test_stage3_routes_mark_up_of_a_replica_already_up_keeps_every_history() -> None:
    p, q = prompt_of(16, seed=5), prompt_of(12, seed=8)
    rs = replica_set(("a", "b", "c"))
    rs.assign("a", "r1", p, 1)
    rs.assign("b", "r2", q, 1)
    rs.release("r1")
    rs.release("r2")
    rs.drain("b")
    for name in ("a", "b", "c"):  # a probe round: every replica answered, so each is up
        rs.mark_up(name)
    steps = (
        "assign('a', 'r1', p, 1), assign('b', 'r2', q, 1), both released; drain('b'); then "
        "mark_up('a'), mark_up('b'), mark_up('c'), as a probe round that finds every "
        "replica healthy does. None was down: only mark_down forgets a history, mark_up "
        "only routes to the replica again"
    )
    expect(
        {"a": rs.matched_blocks("a", p), "b": rs.matched_blocks("b", q)},
        {"a": 4, "b": 3},
        f"{steps}. matched_blocks of p on a and of q on b (p's 4 and q's 3 full blocks)",
    )
    rs.restore("b")
    expect_route(rs.pick(p), Route("a", "affinity", 4), f"{steps}; restore('b'); pick(p)")
    expect_route(rs.pick(q), Route("b", "affinity", 3), f"{steps}; restore('b'); pick(q)")


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
        ("balance_abs_tokens", True),  # a bool is no number of tokens
        ("history_blocks", True),
        ("balance_rel", 0.5),
        ("affinity_threshold", 0.0),
        ("affinity_threshold", 1.5),
        ("history_blocks", 0),
        # Not a number of the right kind: a count of tokens or blocks is an int, a bool
        # is no number, and NaN is no number at all (nor inside any interval).
        ("balance_abs_tokens", 32.5),
        ("block_size", 4.5),
        ("history_blocks", 10.5),
        ("balance_rel", True),
        ("balance_rel", "2"),
        ("balance_rel", math.nan),
        ("affinity_threshold", True),
        ("affinity_threshold", math.nan),
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
    wrong = (TypeError, ValueError) if not_a_number_of_its_kind(param, value) else ValueError
    with pytest.raises(wrong, match=param):
        stage().ReplicaSet(names, **options)


RoutesMachine.TestCase.settings = settings(max_examples=examples(200), stateful_step_count=30)
test_stage3_routes_agree_with_the_rules_written_plainly = core(
    rule("route-load", "route-balance", "route-affinity", "route-history")(RoutesMachine.TestCase)
)
