"""Stage 1: continuous batching over paged KV — the budget and the caps, chunked prefill,
exact block accounting, preemption by recompute, admission order, finishing, abort,
metrics, the static baseline (see katas/dynamic_batcher/README.md, "Stage 1").

How these tests see inside the batcher without trusting it: the model is the harness's
``FakeModel``, which samples each next token from what it reads back out of the KV
blocks, so a request whose blocks were shared, freed too early or not recomputed gets
different tokens than it would alone — and ``unbatched`` is what it would get alone. A
:class:`~katas.dynamic_batcher._testing.trace.Trace` drives the batcher step by step and
checks, after every step, the caps and the blocks each request must hold (counted from
the tokens it was scheduled, not from the batcher's own state);
:class:`~katas.dynamic_batcher._testing.rules.BatchingRules`, the rules written plainly,
says what every step must be. Time is the ``now_ns`` each step is given; nothing sleeps.

The stage's other suites: ``test_stage1_hotpath.py`` (the C hot path, ``-k hotpath``)
and ``test_stage1_edges.py`` (the static baseline's deadlines, aborts and metrics).

Map: the worked example (running-first, chunked-prefill) · running first, the caps,
chunked prefill (running-first, caps, chunked-prefill) · the budget rule in Python,
``fill_token_budget`` (running-first) · blocks (blocks) · finishing
(finish, transparency) · preemption (preemption) · admission order (admission) · abort
(abort) · metrics (metrics) · the static baseline (static) · bad input
(stage1-bad-input) · the C twin (hotpath-twin) · any workload, every step as the rules
make it · continuous against static (continuous-wins).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any

import pytest
from hypothesis import example, given, settings

from katas._harness.marks import core, extended, rule
from katas._harness.profiles import examples
from katas._harness.story import Story, check, expect
from katas._harness.under_test import stage
from katas.dynamic_batcher._testing.configs import (
    accepted_configurations,
    bad_configurations,
    expect_refused_by_name,
)
from katas.dynamic_batcher._testing.hotpath import fill_model, hot_steps
from katas.dynamic_batcher._testing.rules import BatchingRules, step_of
from katas.dynamic_batcher._testing.trace import (
    STEP_NS,
    Trace,
    assert_transparent,
    batcher,
    ceil_div,
    metrics_seen,
    model,
    req,
    runs,
    steps_and_occupancy,
    submit_new,
    trace,
    unbatched,
    with_the_c_unit,
    workloads,
)
from katas.dynamic_batcher._testing.workload import COMPARISON
from katas.dynamic_batcher.api import Request, RequestMetrics, RequestRejected

pytestmark = pytest.mark.stage(1)


# --- the worked example, step by step ---------------------------------------------------------


@core
@rule("running-first", "chunked-prefill")
def test_stage1_the_worked_example_step_by_step() -> None:
    t = trace(max_num_batched_tokens=8, max_num_seqs=4)
    t.submit(req("A", 3, 5), req("B", 10, 5))
    rows = [dict(t.step().scheduled)]
    t.submit(req("C", 2, 5))
    rows += [dict(t.step().scheduled), dict(t.step().scheduled)]
    want = [{"A": 3, "B": 5}, {"A": 1, "B": 5, "C": 2}, {"A": 1, "B": 1, "C": 1}]
    assert rows == want, (
        "running-first: budget 8, A (prompt 3) and B (prompt 10), then C (prompt 2): "
        f"expected the README's table {want}, got {rows}"
    )
    assert [sorted(o.tokens) for o in t.outputs] == [["A"], ["A", "B", "C"], ["A", "B", "C"]], (
        "chunked-prefill: the step that computes a prompt's last chunk emits its first "
        f"token\n{t.rows()}"
    )


# --- running first, the caps, chunked prefill -------------------------------------------------


@core
@rule("running-first", "chunked-prefill")
def test_stage1_decodes_admitted_before_a_long_prompt_never_wait_for_it() -> None:
    t = trace(max_num_batched_tokens=8, max_num_seqs=4)
    t.submit(req("B", 2, 8))
    t.step()
    t.submit(req("A", 30, 2))
    for n in range(2, 7):
        got = dict(t.step().scheduled)
        want = {"B": 1, "A": 7} if n < 6 else {"B": 1, "A": 2}
        assert got == want, (
            f"running-first: step {n}: B decodes (1 token) before A's prompt takes the "
            f"rest of the budget (A: 30 tokens, in chunks of 7, then 2); expected {want}, "
            f"got {got}\n{t.rows()}"
        )


@core
@rule("running-first")
def test_stage1_a_request_behind_a_prefill_that_spends_the_budget_waits() -> None:
    t = trace(max_num_batched_tokens=8, max_num_seqs=4)
    t.submit(req("A", 30, 2), req("B", 1, 2))
    for n in range(1, 4):
        got = dict(t.step().scheduled)
        assert got == {"A": 8}, (
            f"running-first: step {n}: A's prompt (30 tokens) takes the whole budget of "
            f"8; B, behind it, gets nothing and waits (no skipping ahead); got {got}"
        )
    assert t.b.waiting() == ["B"], f"B must still be waiting, got {t.b.waiting()}"


@core
@rule("caps")
def test_stage1_max_num_seqs_is_a_hard_cap_on_admission() -> None:
    t = trace(max_num_batched_tokens=100, max_num_seqs=4)
    t.submit(*(req(f"r{i}", 1, 3) for i in range(6)))
    got = dict(t.step().scheduled)
    assert list(got) == ["r0", "r1", "r2", "r3"], (
        f"caps: max_num_seqs=4 with budget to spare: exactly r0..r3 run, got {list(got)}"
    )
    t.run()
    assert_transparent(t)


@core
@rule("caps", "chunked-prefill")
def test_stage1_the_last_admitted_prompt_is_clamped_to_the_budget_left() -> None:
    t = trace(max_num_batched_tokens=8, max_num_seqs=4)
    t.submit(req("A", 3, 2), req("B", 3, 2), req("C", 3, 2))
    got = dict(t.step().scheduled)
    assert got == {"A": 3, "B": 3, "C": 2}, (
        f"chunked-prefill: budget 8 and three prompts of 3: A 3, B 3, C the 2 left; got {got}"
    )
    assert sorted(t.outputs[0].tokens) == ["A", "B"], (
        "chunked-prefill: C's prompt is not finished, so only A and B emit a first token, "
        f"got {sorted(t.outputs[0].tokens)}"
    )


# --- the budget rule, in Python: fill_token_budget ------------------------------------------

#: ``(need, token_budget, max_seqs, (chunks, requests scheduled, tokens))`` at the
#: boundaries of the rule the running requests are scheduled by (running-first).
FILLS = [
    pytest.param([3, 2, 1], 5, 8, ([3, 2, 0], 2, 5), id="budget-spent-exactly"),
    pytest.param([8, 1], 8, 4, ([8, 0], 1, 8), id="the-next-gets-nothing"),
    pytest.param([5, 1, 1], 4, 8, ([4, 0, 0], 1, 4), id="clamped-then-nothing"),
    pytest.param([2, 5, 1], 4, 8, ([2, 2, 0], 2, 4), id="the-last-is-partial"),
    pytest.param([1, 1, 1, 1], 10, 2, ([1, 1, 0, 0], 2, 2), id="max-seqs-with-budget-left"),
    pytest.param([1, 1, 1], 10, 0, ([0, 0, 0], 0, 0), id="max-seqs-zero"),
    pytest.param([1, 2], 0, 4, ([0, 0], 0, 0), id="no-budget"),
    pytest.param([2, 2], 4, 2, ([2, 2], 2, 4), id="budget-cap-and-array-end-together"),
    pytest.param([], 10, 4, ([], 0, 0), id="no-requests"),
]


def _fill(need: list[int], token_budget: int, max_seqs: int) -> tuple[list[int], int, int]:
    chunks, seqs, tokens = stage().fill_token_budget(list(need), token_budget, max_seqs)
    return list(chunks), seqs, tokens


@core
@rule("running-first")
@pytest.mark.parametrize(("need", "token_budget", "max_seqs", "expected"), FILLS)
def test_stage1_fill_token_budget_serves_in_order_up_to_the_budget_and_the_cap(
    need: list[int], token_budget: int, max_seqs: int, expected: tuple[list[int], int, int]
) -> None:
    expect(
        _fill(need, token_budget, max_seqs),
        expected,
        f"running-first: fill_token_budget({need}, token_budget={token_budget}, "
        f"max_seqs={max_seqs}), the hot path's rule in Python: each request in order gets "
        "min(need, budget left), stopping at the first that would get nothing or after "
        "max_seqs, every other chunk 0; as (chunks, requests scheduled, tokens)",
    )


@core
@rule("running-first")
@given(hot_steps())
@example(([1, 1, 1], 10, 2))
@example(([4, 4, 4], 12, 1))
@example(([9, 1, 1], 8, 4))
def test_stage1_fill_token_budget_matches_the_plain_rule_on_random_columns(
    step: tuple[list[int], int, int],
) -> None:
    need, token_budget, max_seqs = step
    expect(
        _fill(need, token_budget, max_seqs),
        fill_model(need, token_budget, max_seqs),
        f"running-first: fill_token_budget(need={need}, token_budget={token_budget}, "
        f"max_seqs={max_seqs}) against the rule written plainly, as (chunks, requests "
        "scheduled, tokens)",
    )


# --- blocks -----------------------------------------------------------------------------------


@core
@rule("blocks")
def test_stage1_a_request_holds_ceil_of_its_kv_tokens_in_blocks() -> None:
    t = trace(model(num_blocks=16, block_size=4), max_num_batched_tokens=8, max_num_seqs=2)
    t.submit(req("A", 4, 6))
    held = []
    for _ in range(4):
        t.step()  # the Trace checks ceil(tokens in KV / 4) after every step
        held.append(len(t.b.blocks_of("A")))
    assert held == [1, 2, 2, 2], (
        "blocks: prompt of 4 (one full block), then one output token written per step: "
        f"1 block, then 2 once the 5th token is in KV; got {held}"
    )
    t.run()
    assert t.b.blocks_of("A") == () and t.b.free_blocks() == 16, (
        f"blocks: a finished request holds none; free {t.b.free_blocks()} of 16"
    )


# --- finishing --------------------------------------------------------------------------------


@core
@rule("finish", "transparency")
def test_stage1_a_request_finishes_on_its_stop_token_or_its_length() -> None:
    alone = unbatched(req("S", 5, 10))
    stop = alone[2]
    first = alone.index(stop)  # the stop token may come earlier than the third
    t = trace()
    t.submit(req("S", 5, 10, stop_tokens={stop}), req("L", 5, 3))
    t.run()
    assert t.finished == {"S": "stop", "L": "length"} or t.finished == {
        "L": "length",
        "S": "stop",
    }, f"finish: expected S stop and L length, got {t.finished}"
    assert t.streamed["S"] == list(alone[: first + 1]), (
        f"finish: S stops at its stop token {stop} (emitted, then finished): expected "
        f"{list(alone[: first + 1])}, got {t.streamed['S']}"
    )
    assert len(t.streamed["L"]) == 3, f"finish: L has max_new_tokens=3, got {t.streamed['L']}"
    assert_transparent(t)


@core
@rule("finish")
@pytest.mark.parametrize("arrival_ns", [0, STEP_NS // 2], ids=["arrived-at-0", "arrived-later"])
def test_stage1_a_deadline_finishes_the_request_at_the_first_step_at_or_past_it(
    arrival_ns: int,
) -> None:
    t = trace()  # deadline_ns is a time on the clock, not a timeout from the arrival
    t.submit(req("D", 3, 50, deadline_ns=3 * STEP_NS, arrival_ns=arrival_ns), req("W", 3, 5))
    t.step()
    t.step()
    out = t.step()
    assert out.finished.get("D") == "deadline" and "D" not in out.scheduled, (
        "finish: D's deadline is step 3's now_ns: it finishes there with 'deadline', "
        f"before anything is scheduled; step 3 scheduled {dict(out.scheduled)}, finished "
        f"{dict(out.finished)}"
    )
    assert t.b.blocks_of("D") == (), "finish: a request's blocks are freed when it finishes"
    t.run()


@core
@rule("finish")
def test_stage1_a_waiting_request_past_its_deadline_finishes_without_being_scheduled() -> None:
    t = trace(max_num_seqs=1)
    t.submit(req("W", 3, 5), req("D", 3, 4, deadline_ns=3 * STEP_NS))
    t.step()
    t.step()
    assert t.b.waiting() == ["D"], f"setup: max_num_seqs=1, D waits behind W: {t.b.waiting()}"
    out = t.step()
    assert out.finished.get("D") == "deadline" and "D" not in out.scheduled, (
        "finish: D, still waiting (max_num_seqs=1, W runs), has its deadline at step 3's "
        "now_ns: it finishes there with 'deadline', waiting or not, before anything is "
        f"scheduled; step 3 scheduled {dict(out.scheduled)}, finished {dict(out.finished)}"
        f"\n{t.rows()}"
    )
    assert t.b.waiting() == [] and t.b.has_unfinished(), (
        f"finish: D is no longer waiting; W still runs: waiting {t.b.waiting()}"
    )
    t.run()
    assert "D" not in t.streamed and t.finished == {"D": "deadline", "W": "length"}, (
        f"finish: D never ran and emitted nothing: streamed {t.streamed}, finished "
        f"{t.finished}\n{t.rows()}"
    )


@extended
@rule("finish")
@pytest.mark.parametrize("kind", ["continuous", "static"])
def test_stage1_a_stop_token_that_is_also_the_last_allowed_finishes_with_stop(kind: str) -> None:
    alone = unbatched(req("S", 5, 10))
    k = next(i for i in range(1, len(alone)) if alone[i] not in alone[:i])  # a fresh token
    r = req("S", 5, k + 1, stop_tokens={alone[k]})  # its stop token is its last allowed one
    m = model()
    b = trace(m).b if kind == "continuous" else stage().StaticBatcher(m, batch_size=2)
    b.submit(r)
    outs = [b.step(n * STEP_NS) for n in range(1, 2 * k + 4) if b.has_unfinished()]
    emitted = [t for out in outs for t in out.tokens.get("S", ())]
    reasons = [out.finished["S"] for out in outs if "S" in out.finished]
    assert emitted == list(alone[: k + 1]) and reasons == ["stop"], (
        f"finish ({kind} batcher): S has max_new_tokens={k + 1} and stop token "
        f"{alone[k]}, which is also its {k + 1}th token: the step that samples it finishes "
        f"S once, with reason 'stop' (stop wins over length). Expected tokens "
        f"{list(alone[: k + 1])} and reasons ['stop']; got {emitted} and {reasons}"
    )


# --- preemption -------------------------------------------------------------------------------


#: A pool of 4 blocks of 4: two requests that cannot both reach their length.
TIGHT = {"num_blocks": 4, "block_size": 4, "max_num_seqs": 4, "max_num_batched_tokens": 8}


def _tight() -> Trace:
    caps = {k: TIGHT[k] for k in ("max_num_seqs", "max_num_batched_tokens")}
    return trace(model(TIGHT["num_blocks"], TIGHT["block_size"]), **caps)


@extended
@rule("preemption", "admission", "transparency")
def test_stage1_out_of_blocks_the_most_recently_admitted_is_preempted() -> None:
    t = _tight()
    t.submit(req("A", 4, 9), req("B", 4, 9))
    for _ in range(5):
        t.step()
    t.submit(req("C", 1, 1))
    out = t.step()  # A's 9th token in KV needs a 3rd block; the pool is empty
    assert out.preempted == ("B",) and dict(out.scheduled) == {"A": 1}, (
        "preemption: step 6: A (admitted first) needs a block and none is free: B, the "
        "most recently admitted, is preempted, A gets its block, and nobody is admitted in "
        f"a step that preempted (C waits); got scheduled {dict(out.scheduled)}, preempted "
        f"{list(out.preempted)}\n{t.rows()}"
    )
    assert t.b.waiting() == ["B", "C"], (
        f"preemption: the preempted B goes to the front of the queue, got {t.b.waiting()}"
    )
    out = t.step()
    assert "C" not in out.scheduled, (
        "admission: B cannot be admitted yet (its recompute needs 2 blocks, 1 is free), "
        f"and nobody overtakes it: C must wait; step 7 scheduled {dict(out.scheduled)}"
    )
    t.run()
    assert_transparent(t)  # B's recompute: same tokens, none streamed twice
    assert {m.rid: m.preemptions for m in t.b.metrics()}["B"] == 1


@extended
@rule("preemption")
def test_stage1_the_request_that_needs_the_block_can_be_its_own_victim() -> None:
    t = _tight()
    t.submit(req("A", 3, 9), req("B", 4, 9))
    for _ in range(5):
        t.step()
    out = t.step()  # B's 9th token needs a 3rd block; B is the most recently admitted
    assert out.preempted == ("B",) and dict(out.scheduled) == {"A": 1}, (
        "preemption: step 6: B needs a block, none is free, and B itself is the most "
        "recently admitted: B is preempted and the step's scheduling ends; got scheduled "
        f"{dict(out.scheduled)}, preempted {list(out.preempted)}\n{t.rows()}"
    )
    t.run()
    assert_transparent(t)


@dataclass(frozen=True)
class Shortage:
    """A step that runs out of blocks under the ``priority`` policy: what arrives before
    which step, and what the short step must schedule and preempt."""

    config: dict[str, int]
    arrivals: dict[int, list[Request]]
    step: int
    scheduled: dict[str, int]
    preempted: tuple[str, ...]
    why: str


#: Each a boundary of the preemption rule's priority policy; the FCFS victim (the newest) differs in
#: every one, and each needs a rule the others do not.
SHORTAGES = {
    "already-scheduled": Shortage(
        TIGHT,
        {
            1: [req("L", 2, 9, priority=5)],
            2: [req("H", 4, 9, priority=1)],
            7: [req("A", 3, 2, priority=3), req("Z", 3, 2, priority=9)],
        },
        7,
        {"H": 1},
        ("L",),
        "H needs a block and none is free: L (priority 5) is the least important running "
        "request; admitted first, it was already scheduled in this step, and its chunk "
        "leaves the step. H, the newest, is not the victim",
    ),
    "tie": Shortage(
        TIGHT,
        {
            1: [req("E", 1, 12, priority=5)],
            2: [req("F", 3, 12, priority=5)],
            3: [req("H", 4, 12, priority=1)],
        },
        4,
        {"E": 1, "H": 1},
        ("F",),
        "H needs a block: E and F share priority 5, and of two requests of one priority "
        "the later submitted, F, is the less important; F already took a block in this "
        "step, and it goes back with the others",
    ),
    "after-it": Shortage(
        TIGHT,
        {
            1: [req("H", 1, 12, priority=1)],
            2: [req("L", 1, 12, priority=5)],
            3: [req("M", 4, 12, priority=3)],
        },
        5,
        {"H": 1, "M": 1},
        ("L",),
        "H needs a block: L (priority 5), admitted after H and not yet scheduled, gives "
        "way; M, admitted after L, is still scheduled",
    ),
    "own-victim": Shortage(
        TIGHT,
        {1: [req("L", 4, 9, priority=5)], 2: [req("H", 4, 9, priority=1)]},
        6,
        {},
        ("L",),
        "L needs a block and is itself the least important: it gives way and scheduling "
        "ends there, so H, admitted after it, gets nothing in this step",
    ),
    "tokens-back": Shortage(
        {"num_blocks": 5, "block_size": 4, "max_num_seqs": 4, "max_num_batched_tokens": 7},
        {
            1: [req("V", 4, 10, priority=9)],
            2: [req("H", 3, 10, priority=0)],
            3: [req("X", 16, 2, priority=0)],
        },
        4,
        {"H": 1, "X": 6},
        ("V",),
        "H needs a block: V (priority 9), scheduled first in this step, gives way and its "
        "1 token goes back to the budget, so X's prompt gets 7 - 1 (H) = 6 tokens, not 5",
    ),
}


def _priority_trace(case: Shortage) -> Trace:
    m = model(case.config["num_blocks"], case.config["block_size"])
    caps = {k: case.config[k] for k in ("max_num_seqs", "max_num_batched_tokens")}
    return trace(m, **caps, policy="priority")


@extended
@rule("preemption", "transparency")
@pytest.mark.parametrize("name", list(SHORTAGES))
def test_stage1_under_priority_the_least_important_running_request_gives_way(name: str) -> None:
    case = SHORTAGES[name]
    t = _priority_trace(case)
    for n in range(1, case.step + 1):
        t.submit(*case.arrivals.get(n, ()))
        out = t.step()
    got = (dict(out.scheduled), tuple(out.preempted))
    assert got == (case.scheduled, case.preempted), (
        f"preemption: priority policy, step {case.step}: {case.why}. Expected scheduled "
        f"{case.scheduled}, preempted {list(case.preempted)}; got scheduled {got[0]}, "
        f"preempted {list(got[1])}\n{t.rows()}"
    )
    t.run({n: rs for n, rs in case.arrivals.items() if n > case.step})
    assert_transparent(t)  # the victim recomputes: same tokens, none streamed twice


@extended
@rule("preemption", "admission")
def test_stage1_under_priority_a_victim_queues_by_its_priority_not_first() -> None:
    case = SHORTAGES["already-scheduled"]
    t = _priority_trace(case)
    for n in range(1, case.step + 1):
        t.submit(*case.arrivals.get(n, ()))
        out = t.step()
    assert out.preempted == ("L",), f"L gives way at step {case.step} (see the test above)"
    assert t.b.waiting() == ["A", "L", "Z"], (
        f"preemption: priority policy: L (priority 5), preempted at step {case.step}, goes "
        "back into the queue by its priority: behind A (priority 3, waiting) and ahead of "
        f"Z (priority 9, waiting), not to the front; waiting {t.b.waiting()}"
    )
    t.submit(req("B", 3, 2, priority=4))
    assert t.b.waiting() == ["A", "B", "L", "Z"], (
        "admission: priority policy: B (priority 4), submitted after L was preempted, "
        f"goes ahead of L (priority 5): a preempted request has no place of its own; "
        f"waiting {t.b.waiting()}"
    )
    out = t.step()
    assert "A" in out.scheduled and "L" not in out.scheduled, (
        "admission: priority policy: A (priority 3) is admitted before L (priority 5), "
        f"preempted or not; step {case.step + 1} scheduled {dict(out.scheduled)}\n{t.rows()}"
    )
    t.run()
    assert_transparent(t)


#: Two victims in one step: blocks of 2, a pool of 4, budget 8. A and B (prompts of 2)
#: and C and D (prompts of 1) fill the pool at step 1; at step 2 A and B each need a
#: second block and none is free, so two requests give way, one at a time; E arrives
#: before step 2 and waits. Priorities, for the priority policy: C the least important,
#: then D and E (E submitted after D), then A and B.
SEVERAL = {"num_blocks": 4, "block_size": 2, "max_num_seqs": 4, "max_num_batched_tokens": 8}
SEVERAL_ARRIVALS = {
    1: [req("A", 2, 3, priority=0), req("B", 2, 3, priority=0), req("C", 1, 3, priority=2),
        req("D", 1, 3, priority=1)],
    2: [req("E", 1, 3, priority=1)],
}  # fmt: skip


@dataclass(frozen=True)
class Victims:
    """What step 2 of :data:`SEVERAL_ARRIVALS` preempts, the queue after it, and the
    admissions of step 4 (A and B finish at step 3 and free the pool)."""

    preempted: tuple[str, ...]
    waiting: list[str]
    admitted: list[tuple[str, int]]
    why: str


VICTIMS = {
    "fcfs": Victims(
        ("D", "C"), ["C", "D", "E"], [("C", 2), ("D", 2), ("E", 1)],
        "A needs a block: D, the most recently admitted, gives way; then B needs one: C, "
        "now the most recently admitted, gives way. They go to the front of the queue in "
        "submission order, C before D (the first to give way last), both before E",
    ),
    "priority": Victims(
        ("C", "D"), ["D", "E", "C"], [("D", 2), ("E", 1), ("C", 2)],
        "A needs a block: C (priority 2), the least important, gives way; then B needs "
        "one: D (priority 1). Each goes back into the queue by its own priority: D, then "
        "E (priority 1, submitted after D), then C",
    ),
}  # fmt: skip


def _several(policy: str) -> Trace:
    caps = {k: SEVERAL[k] for k in ("max_num_seqs", "max_num_batched_tokens")}
    return trace(model(SEVERAL["num_blocks"], SEVERAL["block_size"]), **caps, policy=policy)


@extended
@rule("preemption", "admission")
@pytest.mark.parametrize("policy", list(VICTIMS))
def test_stage1_several_victims_of_one_step_give_way_and_queue_in_order(policy: str) -> None:
    case = VICTIMS[policy]
    t = _several(policy)
    t.submit(*SEVERAL_ARRIVALS[1])
    t.step()
    t.submit(*SEVERAL_ARRIVALS[2])
    out = t.step()
    got = (tuple(out.preempted), t.b.waiting())
    assert got == (case.preempted, case.waiting), (
        f"preemption: {policy}, step 2 (blocks of 2, a pool of 4 that A, B, C and D fill at "
        f"step 1): {case.why}. `preempted` lists the victims in the order they gave way. "
        f"Expected preempted {list(case.preempted)} and waiting {case.waiting}; got "
        f"preempted {list(got[0])} and waiting {got[1]}\n{t.rows()}"
    )
    t.step()  # A and B finish, their blocks back in the pool
    admitted = list(t.step().scheduled.items())
    assert admitted == case.admitted, (
        f"admission: {policy}, step 4: the pool is free again and the queue is "
        f"{case.waiting}: expected admissions (with their recompute) {case.admitted}, got "
        f"{admitted}\n{t.rows()}"
    )
    t.run()
    assert_transparent(t)


@extended
@rule("metrics", "preemption")
@pytest.mark.parametrize("policy", list(VICTIMS))
def test_stage1_a_preempted_request_keeps_the_time_of_its_first_token(policy: str) -> None:
    t = _several(policy)
    t.run(SEVERAL_ARRIVALS)
    want = metrics_seen(t)
    got: dict[str, RequestMetrics] = {m.rid: m for m in t.b.metrics()}
    assert got == want, (
        f"metrics: {policy}: C and D emit their first token at step 1 ({STEP_NS} ns) and "
        "are preempted at step 2: a preemption does not move first_token_ns (the first "
        "token was streamed then; the recompute streams nothing again), and preemptions "
        "counts each time a request gave way. Expected (from the steps)\n  "
        + "\n  ".join(str(want[rid]) for rid in sorted(want))
        + "\ngot\n  "
        + "\n  ".join(str(got[rid]) for rid in sorted(got))
        + f"\n{t.rows()}"
    )
    finishes = [m.finish_ns for m in t.b.metrics()]
    assert finishes == sorted(finishes), f"metrics: in the order they finished: {finishes}"


# --- admission order --------------------------------------------------------------------------


@core
@rule("admission")
def test_stage1_fcfs_admits_in_submission_order() -> None:
    t = trace(max_num_batched_tokens=8, max_num_seqs=4)
    t.submit(req("X", 8, 2), req("Y", 8, 2), req("Z", 8, 2))
    order = list(t.step().scheduled)
    assert order == ["X"] and t.b.waiting() == ["Y", "Z"], (
        f"admission: fcfs: X first, then Y, Z; step 1 scheduled {order}, waiting {t.b.waiting()}"
    )
    t.run()
    first: dict[str, int] = {}
    for n, out in enumerate(t.outputs, 1):
        for rid in out.tokens:
            first.setdefault(rid, n)
    assert sorted(first, key=first.__getitem__) == ["X", "Y", "Z"], (
        f"admission: fcfs: first tokens in submission order, got at steps {first}"
    )


@extended
@rule("admission")
def test_stage1_the_priority_policy_admits_the_smallest_priority_first() -> None:
    t = trace(max_num_batched_tokens=8, max_num_seqs=4, policy="priority")
    t.submit(
        req("low", 8, 2, priority=5),
        req("high", 8, 2, priority=1),
        req("mid-1", 8, 2, priority=3),
        req("mid-2", 8, 2, priority=3),
    )
    t.step()
    assert t.b.running() == ["high"] and t.b.waiting() == ["mid-1", "mid-2", "low"], (
        "admission: priority: smaller first (high=1, then the two 3s in submission "
        f"order, then low=5); running {t.b.running()}, waiting {t.b.waiting()}"
    )
    for gone in ("high", "low"):  # fewer requests in the batcher: the order goes on all the same
        t.b.abort(gone)
        t.finished[gone] = "abort"
    t.submit(req("mid-3", 8, 2, priority=3))
    assert t.b.waiting() == ["mid-1", "mid-2", "mid-3"], (
        "admission: priority ties go in submission order, counted over every request ever "
        "submitted: after 'high' and 'low' were aborted, 'mid-3' (priority 3) queues behind "
        f"mid-1 and mid-2, submitted before it; waiting {t.b.waiting()}"
    )


# --- abort ------------------------------------------------------------------------------------


@extended
@rule("abort")
def test_stage1_abort_frees_everything_in_any_state() -> None:
    t = trace(max_num_batched_tokens=8, max_num_seqs=1)
    t.submit(req("R", 6, 20), req("W", 3, 2))
    t.step()
    t.step()
    t.b.abort("R")  # running, holding blocks
    t.b.abort("W")  # waiting
    t.in_kv["R"] = 0
    t.finished.update(R="abort", W="abort")
    t.check_blocks("abort() of a running and a waiting request")
    assert (t.b.running(), t.b.waiting(), t.b.has_unfinished()) == ([], [], False), (
        f"abort: nothing left: running {t.b.running()}, waiting {t.b.waiting()}"
    )
    out = t.step()
    assert not out.tokens and not out.scheduled, f"abort: nothing emitted after, got {out}"
    reasons = {m.rid: m.finish_reason for m in t.b.metrics()}
    assert reasons == {"R": "abort", "W": "abort"}, f"abort: metrics say abort, got {reasons}"
    t.b.abort("R")  # finished: nothing to do
    with pytest.raises(KeyError):
        t.b.abort("never-submitted")


# --- metrics ----------------------------------------------------------------------------------


@extended
@rule("metrics")
def test_stage1_metrics_use_the_steps_now_and_the_exact_definitions() -> None:
    t = trace()
    t.submit(req("A", 3, 3, arrival_ns=0), req("B", 12, 2, arrival_ns=0))
    t.run()
    got = {m.rid: m for m in t.b.metrics()}
    a, b = got["A"], got["B"]
    assert (a.first_token_ns, a.finish_ns, a.output_tokens) == (STEP_NS, 3 * STEP_NS, 3), a
    assert (a.ttft_ns, a.tpot_ns) == (STEP_NS, STEP_NS), (
        f"metrics: TTFT = first − arrival = 1 step, TPOT = (finish − first) / 2 = 1 step; "
        f"got {a.ttft_ns}, {a.tpot_ns}"
    )
    assert b.first_token_ns == 2 * STEP_NS, (
        "metrics: B's prompt of 12 takes 5 of the budget at step 1 and its last 7 at step "
        f"2 (A decoding beside it): its first token is step 2's; got {b.first_token_ns}\n"
        f"{t.rows()}"
    )
    assert [m.rid for m in t.b.metrics()] == sorted(got, key=lambda r: got[r].finish_ns)


@extended
@rule("metrics", "finish")
def test_stage1_metrics_take_each_steps_own_now_even_0_and_past_a_deadline() -> None:
    """Steps at irregular instants, the first at 0: ``first_token_ns`` is 0 and stays 0,
    and a deadline passed between two steps finishes its request at the later step's
    ``now_ns``, not at the deadline."""
    b = batcher(model())
    b.submit(req("A", 3, 3, arrival_ns=0))
    b.submit(req("D", 3, 50, arrival_ns=0, deadline_ns=50))
    for now in (0, 100, 130):
        b.step(now)
    got = {m.rid: (m.first_token_ns, m.finish_ns, m.finish_reason) for m in b.metrics()}
    want = {"A": (0, 130, "length"), "D": (0, 100, "deadline")}
    check(
        got == want,
        f"steps at 0, 100 and 130 ns; A (3 tokens) and D (deadline 50 ns) prefill at 0 and "
        f"emit their first token then; D's deadline has passed at the step of 100 ns, which "
        f"finishes it, at its now_ns; A's third token comes at 130. Expected (first token, "
        f"finish, reason) {want}, got {got}",
    )


@extended
@rule("metrics", "abort")
def test_stage1_an_aborted_request_finishes_at_the_step_of_its_abort() -> None:
    """C emitted its first token at step 1 and was preempted at step 2 (no token then);
    aborted after step 2, it finishes at step 2's ``now_ns`` — the step of the abort, not
    its last token's (vLLM's convention)."""
    t = _several("fcfs")
    t.submit(*SEVERAL_ARRIVALS[1])
    t.step()
    t.submit(*SEVERAL_ARRIVALS[2])
    assert "C" in t.step().preempted, f"setup: C gives way at step 2\n{t.rows()}"
    t.b.abort("C")
    got = {m.rid: m for m in t.b.metrics()}.get("C")
    check(
        got is not None and (got.finish_ns, got.finish_reason) == (2 * STEP_NS, "abort"),
        f"C emitted a token at step 1 ({STEP_NS} ns), gave way at step 2 ({2 * STEP_NS} "
        f"ns) and was aborted after it: it finishes at the step of the abort, "
        f"{2 * STEP_NS} ns, reason abort; got {got}",
    )


# --- the static baseline ----------------------------------------------------------------------


@extended
@rule("static")
def test_stage1_the_static_batcher_waits_for_its_whole_batch() -> None:
    m = model()
    b = stage().StaticBatcher(m, batch_size=2)
    for r in (req("A", 3, 2), req("B", 3, 5), req("C", 3, 1)):
        b.submit(r)
    steps = []
    n = 0
    while b.has_unfinished() and n < 20:
        n += 1
        steps.append(b.step(n * STEP_NS))
    assert dict(steps[0].scheduled) == {"A": 3, "B": 3}, steps[0]
    assert [sorted(o.scheduled) for o in steps[1:5]] == [["A", "B"], ["B"], ["B"], ["B"]], (
        "static: A finishes at step 2, its slot stays empty while B decodes to step 5: "
        f"{[dict(o.scheduled) for o in steps]}"
    )
    assert dict(steps[5].scheduled) == {"C": 3}, (
        f"static: C is admitted only when the batch is empty (step 6), got {steps[5]}"
    )


# --- bad input --------------------------------------------------------------------------------


@core
@rule("stage1-bad-input")
def test_stage1_submit_rejects_duplicates_and_requests_that_could_never_finish() -> None:
    t = trace(model(num_blocks=4, block_size=4))
    t.submit(req("A", 3, 14))  # 3 + 14 - 1 = 16 tokens in KV at most: 4 blocks, the pool
    with pytest.raises(RequestRejected, match="A"):
        t.b.submit(req("A", 3, 2))
    with pytest.raises(RequestRejected, match="big"):
        t.b.submit(req("big", 3, 15))  # 17 tokens in KV: 5 blocks > 4, it could never finish
    t.run()
    assert t.finished == {"A": "length"}, f"a rejected request changes nothing: {t.finished}"
    bad: list[tuple[str, str, tuple[int, ...], int]] = [
        ("max_new_tokens", "x", (1,), 0),
        ("prompt", "x", (), 1),
        ("prompt", "x", (1, -2), 1),
        ("rid", "", (1,), 1),
    ]
    for name, rid, prompt, new in bad:
        with pytest.raises(ValueError, match=name):  # api.Request refuses it: never submitted
            Request(rid, prompt, new)


#: How a request can end up before its id is submitted again (each step at n * STEP_NS).
FATES = ["waiting", "running", "finished", "aborted", "past-its-deadline"]


@core
@rule("stage1-bad-input")
@pytest.mark.parametrize("fate", FATES)
def test_stage1_an_id_already_submitted_is_refused_whatever_became_of_it(fate: str) -> None:
    t = trace(max_num_seqs=1)
    t.submit(req("A", 3, 2, deadline_ns=2 * STEP_NS if fate == "past-its-deadline" else None))
    t.submit(req("B", 3, 3))  # waits behind A (max_num_seqs=1)
    rid = "B" if fate == "waiting" else "A"
    if fate == "running":
        t.step()
    elif fate == "aborted":
        t.b.abort("A")
        t.finished["A"] = "abort"
    elif fate in ("finished", "past-its-deadline"):
        t.step()
        t.step()
        assert "A" in t.finished, f"setup: A must have finished by step 2: {t.rows()}"
    again = req(rid, 1, 1)
    try:
        t.b.submit(again)
    except RequestRejected:
        pass
    else:
        raise AssertionError(
            f"stage1-bad-input: {rid!r} was submitted before and is now {fate}: submit() of "
            f"a request with the same id must raise RequestRejected — an id is refused once "
            f"submitted, finished or not — but it was accepted\n{t.rows()}"
        )
    t.run()
    assert set(t.finished) == {"A", "B"} and len(t.b.metrics()) == 2, (
        f"stage1-bad-input: the refused request changes nothing; finished {t.finished}, "
        f"metrics {[m.rid for m in t.b.metrics()]}"
    )
    assert_transparent(t)


#: (block_size, num_blocks, prompt, max_new_tokens) of a request whose KV at its longest,
#: prompt + max_new_tokens - 1 tokens (the newest token is never written), is the pool.
JUST_FITS = [
    pytest.param(4, 4, 3, 14, id="prompt-and-output"),
    pytest.param(4, 4, 16, 1, id="prompt-alone"),
    pytest.param(1, 5, 2, 4, id="blocks-of-one"),
    pytest.param(5, 3, 7, 9, id="last-block-full"),
]


@core
@rule("stage1-bad-input", "blocks")
@pytest.mark.parametrize(("block_size", "num_blocks", "prompt", "new"), JUST_FITS)
def test_stage1_a_request_whose_kv_just_fits_the_pool_is_accepted_and_finishes(
    block_size: int, num_blocks: int, prompt: int, new: int
) -> None:
    tokens = prompt + new - 1
    assert ceil_div(tokens, block_size) == num_blocks  # the case is at the boundary
    t = trace(model(num_blocks, block_size))
    t.submit(req("fits", prompt, new))  # a refusal fails here, by rule stage1-bad-input
    with pytest.raises(RequestRejected, match="more"):
        t.b.submit(req("more", prompt, new + 1))  # one token more: one block past the pool
    t.run()
    assert t.finished == {"fits": "length"}, (
        f"finish: the request that just fits runs alone to its length; finished {t.finished}"
        f"\n{t.rows()}"
    )
    assert_transparent(t)


@extended
@rule("static", "stage1-bad-input")
@pytest.mark.parametrize(("block_size", "num_blocks", "prompt", "new"), JUST_FITS)
def test_stage1_the_static_batcher_reserves_only_the_kv_a_request_can_write(
    block_size: int, num_blocks: int, prompt: int, new: int
) -> None:
    m = model(num_blocks, block_size)
    b = stage().StaticBatcher(m, batch_size=2)
    submit_new(b, m, req("fits", prompt, new))
    with pytest.raises(RequestRejected, match="more"):
        b.submit(req("more", prompt, new + 1))
    with pytest.raises(RequestRejected, match="fits"):
        b.submit(req("fits", 1, 1))  # an id already submitted
    emitted: list[int] = []
    steps = 0
    while b.has_unfinished() and steps < 2 * new:
        steps += 1
        emitted += b.step(steps * STEP_NS).tokens.get("fits", ())
    want = unbatched(req("fits", prompt, new), block_size)
    assert not b.has_unfinished() and tuple(emitted) == want, (
        f"static: a batch reserves each request's longest KV, prompt + max_new_tokens - 1 "
        f"= {prompt + new - 1} tokens, which fits the pool of {num_blocks} blocks of "
        f"{block_size}: the request runs and finishes; after {steps} steps, unfinished: "
        f"{b.has_unfinished()}, emitted {emitted}, alone it generates {list(want)}"
    )


@extended
@rule("static", "abort", "stage1-bad-input")
def test_stage1_the_static_batcher_aborts_in_any_state_and_refuses_an_id_again() -> None:
    m = model(num_blocks=4, block_size=4)
    b = stage().StaticBatcher(m, batch_size=2)
    for r in (req("A", 3, 14), req("B", 3, 14), req("C", 1, 1)):
        b.submit(r)  # A and B each reserve the whole pool (16 tokens of KV): one at a time
    first = b.step(STEP_NS)
    assert dict(first.scheduled) == {"A": 3}, f"setup: A's batch runs alone: {first}"
    b.abort("A")  # running, the whole pool reserved
    b.abort("C")  # waiting
    assert (b.running(), b.has_unfinished()) == ([], True), (
        f"abort: A is no longer running, B still waits: running {b.running()}"
    )
    outs = [b.step(n * STEP_NS) for n in range(2, 40) if b.has_unfinished()]
    assert outs and dict(outs[0].scheduled) == {"B": 3}, (
        "abort: A's reserved blocks return to the pool at its abort, so the next step forms "
        f"B's batch (B reserves the whole pool; C was aborted); got {outs[:1]}"
    )
    emitted = [t for out in outs for t in out.tokens.get("B", ())]
    gone = [(n, rid) for n, out in enumerate(outs, 2) for rid in out.tokens if rid != "B"]
    assert tuple(emitted) == unbatched(req("B", 3, 14)) and not gone, (
        f"abort: nothing of an aborted request is emitted afterwards (got {gone}); B runs to "
        f"its length: {emitted}"
    )
    reasons = {mt.rid: (mt.finish_reason, mt.output_tokens) for mt in b.metrics()}
    assert reasons == {"A": ("abort", 1), "C": ("abort", 0), "B": ("length", 14)}, (
        f"abort: the metrics of an aborted request say abort: {reasons}"
    )
    b.abort("A")  # finished: nothing to do
    with pytest.raises(KeyError):
        b.abort("never-submitted")
    for rid in ("A", "B", "C"):
        with pytest.raises(RequestRejected, match=rid):
            b.submit(req(rid, 1, 1))  # aborted or finished: still an id already submitted


@extended
@rule("stage1-bad-input", "caps")
@pytest.mark.parametrize(("options", "requests"), accepted_configurations())
def test_stage1_configurations_at_the_boundary_are_accepted_and_serve(
    options: dict[str, Any], requests: int
) -> None:
    config = {"max_num_seqs": 4, "max_num_batched_tokens": 8, **options}
    try:
        t = trace(model(), **config)
    except (ValueError, TypeError) as exc:
        raise AssertionError(
            f"stage1-bad-input: {config} is a valid configuration (max_num_batched_tokens may "
            f"equal max_num_seqs: a full batch of decodes fits one step), got {exc!r}"
        ) from None
    t.run({1: [req(f"r{i}", 3, 4) for i in range(requests)]})
    assert len(t.finished) == requests, f"every request finishes: {t.finished}"
    assert_transparent(t)


#: A valid configuration over :func:`model`'s pool, which the bad-input tests spoil.
VALID = {"max_num_seqs": 4, "max_num_batched_tokens": 8, "num_blocks": 64, "block_size": 4}


@extended
@rule("stage1-bad-input")
@pytest.mark.parametrize(
    ("name", "options"),
    [
        *bad_configurations(num_blocks=64),
        pytest.param("max_num_seqs", {"max_num_seqs": 2.0}, id="seqs-not-an-int"),
        # the id stays clear of the C unit's keyword: -k hotpath selects the C unit only
        pytest.param("hotpath", {"hotpath": "rust"}, id="unknown-path"),
    ],
)
def test_stage1_bad_configurations_are_refused_by_name(name: str, options: dict[str, Any]) -> None:
    config = VALID
    batcher = partial(stage().ContinuousBatcher, model())
    expect_refused_by_name(batcher, config, name, options, "stage1-bad-input")


@extended
@rule("stage1-bad-input", "static")
@pytest.mark.parametrize(
    ("name", "options"),
    [
        pytest.param("num_blocks", {"num_blocks": "64"}, id="blocks-a-str"),
        pytest.param("num_blocks", {"num_blocks": True}, id="blocks-a-bool"),
        pytest.param("block_size", {"block_size": 4.0}, id="block-size-a-float"),
        pytest.param(
            "max_num_batched_tokens", {"max_num_batched_tokens": True}, id="budget-a-bool"
        ),
        pytest.param(
            "max_num_batched_tokens", {"max_num_batched_tokens": 8.0}, id="budget-a-float"
        ),
        pytest.param("batch_size", {"batch_size": True}, id="static-batch-a-bool"),
        pytest.param("batch_size", {"batch_size": 2.0}, id="static-batch-a-float"),
    ],
)
def test_stage1_a_setting_that_is_not_an_int_is_a_type_error_naming_it(
    name: str, options: dict[str, Any]
) -> None:
    """A non-int setting is a ``TypeError`` naming it — checked before it is compared
    with anything (the model's pool, the other settings), which would refuse it for the
    wrong reason, or take ``True`` for 1."""
    if name == "batch_size":
        build: Any = partial(stage().StaticBatcher, model())
        config: dict[str, Any] = {}
    else:
        build = partial(stage().ContinuousBatcher, model())
        config = VALID
    with pytest.raises((TypeError, ValueError)) as caught:
        build(**{**config, **options})
        raise AssertionError(f"{options} was accepted")
    check(
        isinstance(caught.value, TypeError) and name in str(caught.value),
        f"{options}: not an int, so a TypeError naming {name}; got {caught.value!r}",
    )


@core
@rule("finish", "metrics")
def test_stage1_a_deadline_of_0_is_a_deadline() -> None:
    b = batcher(model())
    b.submit(req("A", 3, 4, deadline_ns=0))
    out = b.step(0)
    got = {m.rid: (m.finish_ns, m.finish_reason) for m in b.metrics()}
    check(
        dict(out.finished) == {"A": "deadline"} and got == {"A": (0, "deadline")},
        "finish: a request with deadline_ns=0 (a time, not 'none') finishes at the first "
        f"step at or past it, step(0), reason deadline; got {dict(out.finished)}, {got}",
    )


@core
@rule("abort", "metrics")
def test_stage1_an_abort_after_a_step_that_ran_nothing_finishes_at_that_step() -> None:
    """Two requests run at step 1; both reach their deadline at step 5, which schedules
    nothing (the model does not run). A request submitted and aborted after it finishes
    at step 5's ``now_ns``: the step of the abort is the latest step, whatever it ran."""
    b = batcher(model())
    for rid in ("A", "B"):
        b.submit(req(rid, 3, 9, deadline_ns=5 * STEP_NS))
    b.step(STEP_NS)
    out = b.step(5 * STEP_NS)
    b.submit(req("C", 3, 4))
    b.abort("C")
    got = {m.rid: (m.finish_ns, m.finish_reason) for m in b.metrics()}.get("C")
    check(
        dict(out.scheduled) == {} and got == (5 * STEP_NS, "abort"),
        f"A and B run at step 1 ({STEP_NS} ns) and reach their deadline at step 5 "
        f"({5 * STEP_NS} ns), which runs nothing; C, submitted and aborted after it, "
        f"finishes at step 5, reason abort; step 5 scheduled {dict(out.scheduled)}, C: {got}",
    )


# --- the C twin -------------------------------------------------------------------------------


@extended
@rule("hotpath-twin")
def test_stage1_the_c_hot_path_schedules_exactly_as_the_python_one() -> None:
    runs = []
    for hotpath in ("python", "c"):
        with with_the_c_unit() if hotpath == "c" else nullcontext():
            t = trace(model(num_blocks=6, block_size=4), hotpath=hotpath)
            t.run({1: [req("A", 9, 6), req("B", 2, 9)], 3: [req("C", 17, 3), req("D", 1, 4)]})
        runs.append([(dict(o.scheduled), dict(o.tokens), o.preempted) for o in t.outputs])
    assert runs[0] == runs[1], (
        "hotpath-twin: hotpath='c' must schedule every step as 'python' does\n"
        f"  python: {runs[0]}\n  c:      {runs[1]}"
    )


# --- any workload -----------------------------------------------------------------------------


#: The :data:`TIGHT` pool and its preemption, on every run of the workload tests: A and B
#: cannot both reach their length, and C arrives as B is preempted and recomputed.
TIGHT_ARRIVALS = {1: [req("A", 4, 9), req("B", 4, 9)], 6: [req("C", 1, 1)]}
#: ... and, the second time, a running request aborted mid-decode, its blocks due back.
TIGHT_ABORT = {1: [req("A", 4, 9), req("B", 4, 9)], 3: [req("C", 6, 4)]}
FCFS_TIGHT = {**TIGHT, "policy": "fcfs"}
#: Under priority, a chunk of r3's prompt needs more blocks than its first victim (r0,
#: the least important) holds: a second victim must give way before r3 takes its blocks.
PRIORITY_TWO_VICTIMS: tuple[dict[str, Any], dict[int, list[Request]], dict[int, str]] = (
    {"num_blocks": 8, "block_size": 2, "max_num_seqs": 4, "max_num_batched_tokens": 10,
     "policy": "priority"},
    {1: [req("r2", 6, 4, priority=2)], 3: [req("r0", 1, 6, priority=3)],
     4: [req("r1", 7, 5, priority=1), req("r3", 14, 3, priority=2)]},
    {},
)  # fmt: skip
#: A request preempted after many tokens recomputes them in chunks of a small budget:
#: a chunk past its prompt that is not its last reads the output's middle, not its tail.
CHUNKED_RECOMPUTE: tuple[dict[str, Any], dict[int, list[Request]], dict[int, str]] = (
    {"num_blocks": 7, "block_size": 4, "max_num_seqs": 3, "max_num_batched_tokens": 4,
     "policy": "fcfs"},
    {2: [req("r2", 3, 19)], 3: [req("r1", 1, 14)], 4: [req("r0", 3, 7)]},
    {},
)  # fmt: skip
#: More requests at once than ``max_num_seqs``, with budget and blocks to spare: the cap
#: alone holds the third back.
OVER_THE_CAP: tuple[dict[str, Any], dict[int, list[Request]], dict[int, str]] = (
    {"num_blocks": 16, "block_size": 4, "max_num_seqs": 2, "max_num_batched_tokens": 8,
     "policy": "fcfs"},
    {1: [req("A", 2, 3), req("B", 2, 3), req("C", 2, 3)]},
    {},
)  # fmt: skip


def _shortage(name: str) -> tuple[dict[str, Any], dict[int, list[Request]], dict[int, str]]:
    """A :data:`SHORTAGES` case as :func:`~katas.dynamic_batcher._testing.trace.workloads`
    draws one."""
    case = SHORTAGES[name]
    return {**case.config, "policy": "priority"}, case.arrivals, {}


@extended
@rule("hotpath-twin")
@given(case=workloads())
@example(case=(FCFS_TIGHT, TIGHT_ARRIVALS, {}))
@example(case=(FCFS_TIGHT, TIGHT_ABORT, {4: "A"}))
@example(case=OVER_THE_CAP)
@example(case=_shortage("already-scheduled"))
@example(case=_shortage("tokens-back"))
@example(case=({**SEVERAL, "policy": "fcfs"}, SEVERAL_ARRIVALS, {}))
@example(case=({**SEVERAL, "policy": "priority"}, SEVERAL_ARRIVALS, {}))
@example(case=PRIORITY_TWO_VICTIMS)
@example(case=CHUNKED_RECOMPUTE)
@settings(max_examples=examples(at_ci=30))
def test_stage1_the_c_hot_path_is_a_twin_on_any_workload(
    case: tuple[dict[str, Any], dict[int, list[Request]], dict[int, str]],
) -> None:
    config, arrivals, aborts = case
    runs = []
    for hotpath in ("python", "c"):
        caps = {k: config[k] for k in ("max_num_seqs", "max_num_batched_tokens", "policy")}
        with with_the_c_unit() if hotpath == "c" else nullcontext():
            t = trace(model(config["num_blocks"], config["block_size"]), **caps, hotpath=hotpath)
            t.run(arrivals, max_steps=600, aborts=aborts)
        runs.append([f"{row}  blocks {held}" for row, held in
                     zip(t.rows().splitlines(), t.blocks, strict=True)])  # fmt: skip
    python, c = runs
    first = next(
        (i for i, (a, b) in enumerate(zip(python, c, strict=False)) if a != b),
        min(len(python), len(c)),
    )
    assert python == c, (
        f"hotpath-twin: hotpath='c' must run every step as 'python' does ({config}); "
        f"they part at step {first + 1}:\n"
        f"  python:\n{chr(10).join(python[max(0, first - 1) : first + 1])}\n"
        f"  c:\n{chr(10).join(c[max(0, first - 1) : first + 1])}"
    )


@core
@rule("caps", "blocks", "finish", "transparency", "preemption")
@given(case=workloads())
@example(case=(FCFS_TIGHT, TIGHT_ARRIVALS, {}))
@example(case=(FCFS_TIGHT, TIGHT_ABORT, {4: "A"}))
@example(case=OVER_THE_CAP)
@example(case=_shortage("already-scheduled"))
@example(case=({**SEVERAL, "policy": "fcfs"}, SEVERAL_ARRIVALS, {}))
@example(case=({**SEVERAL, "policy": "priority"}, SEVERAL_ARRIVALS, {}))
@example(case=PRIORITY_TWO_VICTIMS)
@example(case=CHUNKED_RECOMPUTE)
@settings(max_examples=examples(at_ci=60))
def test_stage1_any_workload_keeps_every_invariant_and_every_output(
    case: tuple[dict[str, Any], dict[int, list[Request]], dict[int, str]],
) -> None:
    config, arrivals, aborts = case
    config = dict(config)  # an explicit example's dict is reused
    m = model(config.pop("num_blocks"), config.pop("block_size"))
    t = trace(m, **config)
    t.run(arrivals, max_steps=600, aborts=aborts)
    missing = set(t.submitted) - set(t.finished)
    assert not missing, f"finish: every request finishes exactly once; never: {missing}"
    assert_transparent(t)


def _tight_run(
    arrivals: dict[int, list[Request]],
    aborts: dict[int, str] | None = None,
    config: dict[str, Any] = FCFS_TIGHT,
) -> tuple[dict[str, Any], list[tuple[int, str, Any]]]:
    """A workload (the :data:`TIGHT` pool under ``fcfs`` unless told) as
    :func:`~katas.dynamic_batcher._testing.trace.runs`
    draws one: the config, then the events."""
    events: list[tuple[int, str, Any]] = [
        (at, "submit", r) for at, rs in arrivals.items() for r in rs
    ]
    events += [(at, "abort", rid) for at, rid in (aborts or {}).items()]
    return dict(config), events


#: :data:`SEVERAL_ARRIVALS` with deadlines at step 3 for D, preempted at step 2, and E,
#: never admitted: both are waiting when their deadline comes.
SEVERAL_DEADLINES = {
    1: [*SEVERAL_ARRIVALS[1][:3], req("D", 1, 3, priority=1, deadline_ns=3 * STEP_NS)],
    2: [req("E", 1, 3, priority=1, deadline_ns=3 * STEP_NS)],
}


def _shortage_run(name: str) -> tuple[dict[str, Any], list[tuple[int, str, Any]]]:
    """A :data:`SHORTAGES` case as :func:`~katas.dynamic_batcher._testing.trace.runs` draws one."""
    config, arrivals, _ = _shortage(name)
    return _tight_run(arrivals, config=config)


@core
@rule("running-first", "caps", "chunked-prefill", "preemption", "admission", "finish", "abort")
@given(case=runs())
@example(case=_tight_run(TIGHT_ARRIVALS))
@example(case=_tight_run(TIGHT_ABORT, {4: "A"}))
@example(case=_shortage_run("already-scheduled"))
@example(case=_shortage_run("tie"))
@example(case=_shortage_run("tokens-back"))
@example(case=_tight_run(SEVERAL_ARRIVALS, config={**SEVERAL, "policy": "fcfs"}))
@example(case=_tight_run(SEVERAL_ARRIVALS, config={**SEVERAL, "policy": "priority"}))
@example(case=_tight_run(SEVERAL_DEADLINES, config={**SEVERAL, "policy": "fcfs"}))
@settings(max_examples=examples(at_ci=80))
def test_stage1_every_step_is_the_one_the_rules_make(
    case: tuple[dict[str, Any], list[tuple[int, str, Any]]],
) -> None:
    config, events = case
    config = dict(config)  # an explicit example's dict is reused
    block_size = config["block_size"]
    outputs = {r.rid: unbatched(r, block_size) for _, kind, r in events if kind == "submit"}
    rules = BatchingRules(outputs, **config)
    story = Story(f"a run of {config}, each step at n * {STEP_NS} ns:", lambda: n * STEP_NS)
    m = model(config.pop("num_blocks"), config.pop("block_size"))
    t = trace(m, **config)
    last = max(at for at, _, _ in events)
    for n in range(1, 400):
        for at, kind, what in events:
            if at != n:
                continue
            if kind == "submit":
                t.submit(what)
                rules.submit(what)
                story.add(
                    f"before step {n}: submit {what.rid} (prompt {len(what.prompt)}, "
                    f"max_new_tokens {what.max_new_tokens}, priority {what.priority}, "
                    f"deadline {what.deadline_ns}, stop {set(what.stop_tokens)})"
                )
            elif what not in t.finished:
                t.b.abort(what)
                rules.abort(what)
                t.finished[what] = "abort"
                t.in_kv[what] = 0
                story.add(f"before step {n}: abort {what}")
        if n > last and not t.b.has_unfinished():
            break
        got = step_of(t.step())
        want = rules.step(n * STEP_NS)
        story.expect(got, want, f"step {n} is not the one the rules make")
        story.add(f"step {n}: scheduled {want.scheduled}, preempted {list(want.preempted)}, "
                  f"emitted {want.emitted}, finished {want.finished}")  # fmt: skip
    check(not t.b.has_unfinished(), f"liveness: unfinished after 400 steps\n{t.rows()[-2000:]}")


# --- continuous versus static ------------------------------------------------------------


@extended
@rule("continuous-wins", "static")
def test_stage1_continuous_batching_needs_far_fewer_steps_than_static() -> None:
    c = COMPARISON
    requests, slots = c.workload(), c.slots
    static_steps, static_occupancy = steps_and_occupancy(
        stage().StaticBatcher(model(c.num_blocks, c.block_size), batch_size=slots), requests, slots
    )
    m = model(c.num_blocks, c.block_size)
    b = batcher(m, max_num_seqs=slots, max_num_batched_tokens=c.token_budget)
    steps, occupancy = steps_and_occupancy(b, requests, slots)
    assert static_steps >= 2.5 * steps and occupancy >= 0.9, (
        f"continuous-wins: 256 requests, output lengths exponential (mean 128), 32 slots: "
        f"continuous took {steps} steps at {occupancy:.0%} occupancy, static {static_steps} "
        f"at {static_occupancy:.0%}; continuous must need ≥ 2.5× fewer steps "
        f"({static_steps / max(steps, 1):.2f}×) at ≥ 90% occupancy"
    )
