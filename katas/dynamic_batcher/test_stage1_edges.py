"""Stage 1, the static baseline's edges: the rules that govern ``StaticBatcher`` as much as
``ContinuousBatcher`` — deadlines, abort, metrics — each at its boundary (see
katas/dynamic_batcher/README.md, "Stage 1").

A static batch forms only when the last one is gone, so the instant a deadline meets the
forming of a batch is where the order of the two shows: a request at or past its deadline
finishes before anything is scheduled, and never takes a seat of the batch formed in that
step. Time is the ``now_ns`` each step is given, on clocks of irregular steps (the first
at 0), so a finish time taken from anything but the step's own ``now_ns`` shows; nothing
sleeps. Every step is also compared with the static rules written plainly
(:class:`~katas.dynamic_batcher._testing.rules.StaticRules`, driven by
:mod:`katas.dynamic_batcher._testing.static`) on drawn runs.

The stage's other suites: ``test_stage1.py`` (the continuous batcher, and the static
baseline's batches) and ``test_stage1_hotpath.py`` (the C hot path, ``-k hotpath``).

Map: deadlines against the forming of a batch (finish, static) · the metrics' instants,
aborts included (metrics, abort, static) · any run, every step as the static rules make
it (static, finish, abort, metrics).
"""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings

from katas._harness.marks import extended, rule
from katas._harness.profiles import examples
from katas._harness.story import Story, check, expect
from katas._harness.under_test import stage
from katas.dynamic_batcher._testing.static import StaticRun, drive_static, static_runs
from katas.dynamic_batcher._testing.trace import STEP_NS, Slotted, model, req
from katas.dynamic_batcher.api import RequestMetrics

pytestmark = pytest.mark.stage(1)


def _static(batch_size: int, num_blocks: int = 64) -> Slotted:
    b: Slotted = stage().StaticBatcher(model(num_blocks), batch_size=batch_size)
    return b


# --- deadlines against the forming of a batch -------------------------------------------------

#: D's deadline against step 3's ``now_ns`` (when its batch forms): before, at, or 1 ns after.
DEADLINE_OFFSETS = [
    pytest.param(-1, True, id="a-ns-before-the-step"),
    pytest.param(0, True, id="at-the-step"),
    pytest.param(1, False, id="a-ns-after-the-step"),
]


@extended
@rule("finish", "static")
@pytest.mark.parametrize(("offset", "due"), DEADLINE_OFFSETS)
def test_stage1_the_static_batcher_finishes_past_deadlines_before_it_forms_a_batch(
    offset: int, due: bool
) -> None:
    """A (2 tokens) runs alone at steps 1 and 2; D, E and F wait. Step 3's batch forms
    after the deadlines are done: a D already due finishes there, unscheduled, and E and
    F take the two seats; a D not yet due is seated with E, and F waits."""
    b = _static(batch_size=2)
    b.submit(req("A", 3, 2))
    b.step(STEP_NS)  # A alone: D, E and F are submitted after its batch formed
    deadline = 3 * STEP_NS + offset
    for r in (req("D", 3, 4, deadline_ns=deadline), req("E", 3, 4), req("F", 3, 4)):
        b.submit(r)
    story = Story(f"StaticBatcher(batch_size=2); D's deadline is {deadline} ns:", lambda: 0)
    story.add(f"step 1 at {STEP_NS} ns: A's batch; then submit D, E and F")
    second = b.step(2 * STEP_NS)
    story.add(f"step 2 at {2 * STEP_NS} ns: scheduled {dict(second.scheduled)}, finished "
              f"{dict(second.finished)}; then step 3 at {3 * STEP_NS} ns")  # fmt: skip
    story.expect(dict(second.finished), {"A": "length"}, "setup: A finishes at step 2")
    out = b.step(3 * STEP_NS)
    if due:
        want_scheduled, want_finished = {"E": 3, "F": 3}, {"D": "deadline"}
        why = (
            "reached: D finishes first, with 'deadline', before anything is scheduled, and "
            "E and F take the batch's two seats"
        )
    else:
        want_scheduled, want_finished = {"D": 3, "E": 3}, {}
        why = "not reached: D and E, the first two waiting, are the batch, and F waits"
    story.expect(
        (dict(out.scheduled), dict(out.finished)),
        (want_scheduled, want_finished),
        f"finish, static: at step 3 ({3 * STEP_NS} ns) the batch is empty and a new one "
        f"forms; D's deadline, {deadline} ns, is {why} — expected (scheduled, finished)",
    )
    story.expect(sorted(b.running()), sorted(want_scheduled), "static: the batch after step 3")


@extended
@rule("finish", "static")
def test_stage1_a_static_batch_emptied_by_a_deadline_is_refilled_in_that_step() -> None:
    """D runs alone (batch_size 1) and reaches its deadline at step 3; W waits. Step 3
    finishes D before anything is scheduled, so its batch is empty, and W's batch forms
    and prefills in that same step: no step runs empty while a request waits."""
    b = _static(batch_size=1)
    b.submit(req("D", 3, 10, deadline_ns=3 * STEP_NS))
    b.submit(req("W", 2, 3))
    outs = [b.step(n * STEP_NS) for n in (1, 2, 3)]
    got = [(dict(o.scheduled), dict(o.finished)) for o in outs]
    want = [({"D": 3}, {}), ({"D": 1}, {}), ({"W": 2}, {"D": "deadline"})]
    expect(
        got,
        want,
        "finish, static: D (deadline at step 3) runs alone at steps 1 and 2; step 3 finishes "
        "it first, with 'deadline', before anything is scheduled, which leaves the batch "
        "empty: W's batch forms and prefills at step 3. (scheduled, finished) per step",
    )
    expect(b.running(), ["W"], "static: the batch after step 3")


# --- the metrics' instants, aborts included ---------------------------------------------------


@extended
@rule("metrics", "abort", "static")
def test_stage1_the_static_batchers_metrics_take_each_steps_own_now() -> None:
    """Steps at 0, 100, 130, 170 and 250 ns, batch_size 1: A (3 tokens) runs from 0 to 130;
    W, waiting, is aborted after the step of 100 ns; C is submitted and aborted after the
    step of 170 ns, which ran nothing; R runs at 250 ns and is aborted after it. Each
    finishes at a step's own ``now_ns``: an abort at the latest step's."""
    b = _static(batch_size=1)
    b.submit(req("A", 3, 3, arrival_ns=0))
    b.submit(req("W", 2, 2, arrival_ns=0))
    latest = [0]  # the latest step's now_ns, for the story's t=
    story = Story("StaticBatcher(batch_size=1), A and W submitted:", lambda: latest[0])
    for now, act in ((0, ""), (100, "W"), (130, ""), (170, "C"), (250, "R")):
        latest[0] = now
        if now == 250:
            b.submit(req("R", 2, 5, arrival_ns=200))
        out = b.step(now)
        story.add(f"step at {now} ns: scheduled {dict(out.scheduled)}, finished "
                  f"{dict(out.finished)}")  # fmt: skip
        if act == "C":
            b.submit(req("C", 2, 2, arrival_ns=170))
        if act:
            b.abort(act)
            story.add(f"abort {act}")
    want = {
        "W": RequestMetrics("W", 0, None, 100, 0, "abort", 0),
        "A": RequestMetrics("A", 0, 0, 130, 3, "length", 0),
        "C": RequestMetrics("C", 170, None, 170, 0, "abort", 0),
        "R": RequestMetrics("R", 200, 250, 250, 1, "abort", 0),
    }
    got = b.metrics()
    story.expect(
        {m.rid: m for m in got},
        want,
        "metrics, abort: first_token_ns is the now_ns of the step that emitted the first "
        "token, finish_ns that of the step that finished the request; an abort finishes it "
        "at the step of the abort, the latest step, whatever that step ran",
    )
    check(
        [m.rid for m in got] == list(want),
        f"metrics: listed in the order they finished, {list(want)}; got {[m.rid for m in got]}",
    )


# --- any run, every step as the static rules make it ------------------------------------------

#: Step 3's batch forms as D (waiting) reaches its deadline: E and F are seated, not D.
DEADLINE_AT_THE_FORMING = StaticRun(
    batch_size=2,
    num_blocks=16,
    block_size=4,
    events=(
        (1, "submit", req("A", 3, 2)),
        (2, "submit", req("D", 3, 4, deadline_ns=2_000_000)),
        (2, "submit", req("E", 3, 4)),
        (2, "submit", req("F", 3, 4)),
    ),
    gaps_ns=(500_000, 1_500_000),
)

#: Aborts after steps at irregular instants: of a running, a waiting and a finished request.
ABORTS_BETWEEN_STEPS = StaticRun(
    batch_size=1,
    num_blocks=16,
    block_size=4,
    events=(
        (1, "submit", req("A", 3, 4)),
        (1, "submit", req("B", 2, 3)),
        (2, "abort", "B"),
        (3, "abort", "A"),
        (3, "submit", req("C", 2, 2)),
        (6, "abort", "C"),
    ),
    start_ns=1_000,
    gaps_ns=(70, 30, 400),
)


@extended
@rule("static", "finish", "abort", "metrics")
@given(case=static_runs())
@example(case=DEADLINE_AT_THE_FORMING)
@example(case=ABORTS_BETWEEN_STEPS)
@settings(max_examples=examples(at_ci=60))
def test_stage1_every_static_step_is_the_one_the_static_rules_make(case: StaticRun) -> None:
    drive_static(case)
