"""The static baseline driven step by step against its rules
(:class:`~katas.dynamic_batcher._testing.rules.StaticRules`): the runs hypothesis draws
for it — submissions with deadlines on either side of a step's instant and at it, stop
tokens, aborts between steps — on a clock of irregular steps, and the driver that
compares every step, the batch and the metrics with the rules.

Time is the ``now_ns`` each step is given (:meth:`StaticRun.now_ns`); nothing sleeps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

from katas._harness.story import Story
from katas._harness.under_test import stage
from katas.dynamic_batcher.api import Request

from .rules import StaticRules, step_of
from .trace import Slotted, ceil_div, model, req, submit_new, unbatched

#: How many steps a drawn run may take before it must be done (far more than it needs).
MAX_STEPS = 300


@dataclass(frozen=True)
class StaticRun:
    """A static batcher's run: its settings, what happens before each step (``(n,
    "submit", request)`` or ``(n, "abort", rid)``, before step n, 1-based; an abort never
    before step 2) and its clock: step 1 at ``start_ns``, each next one ``gaps_ns``
    later, in turn."""

    batch_size: int
    num_blocks: int
    block_size: int
    events: tuple[tuple[int, str, Any], ...]
    start_ns: int = 0
    gaps_ns: tuple[int, ...] = (1_000_000,)

    def now_ns(self, n: int) -> int:
        """The ``now_ns`` of step ``n`` (1-based)."""
        gaps = self.gaps_ns
        return self.start_ns + sum(gaps[i % len(gaps)] for i in range(n - 1))


@st.composite
def static_runs(draw: st.DrawFn) -> StaticRun:
    """A static batcher's settings, its clock, and its events: up to 7 requests, some with
    a stop token (their own 2nd token), some with a deadline 1 ns before, at or 1 ns after
    a step's ``now_ns``, some aborted after a step."""
    block_size = draw(st.integers(1, 4), label="block_size")
    batch_size = draw(st.integers(1, 4), label="batch_size")
    start_ns = draw(st.sampled_from([0, 1, 1_000_000]), label="start_ns")
    gaps = draw(st.lists(st.integers(1, 2_000_000), min_size=1, max_size=4), label="gaps_ns")
    clock = StaticRun(batch_size, 1, block_size, (), start_ns, tuple(gaps))
    events: list[tuple[int, str, Any]] = []
    worst = 1
    for i in range(draw(st.integers(1, 7), label="requests")):
        prompt, new = draw(st.integers(1, 10)), draw(st.integers(1, 6))
        worst = max(worst, ceil_div(prompt + new - 1, block_size))  # its longest KV
        at = draw(st.integers(1, 6))
        options: dict[str, Any] = {"arrival_ns": max(0, clock.now_ns(at) - 1)}
        if draw(st.booleans()):
            when = clock.now_ns(at + draw(st.integers(0, 8)))
            options["deadline_ns"] = when + draw(st.sampled_from([-1, 0, 1]))
        r = req(f"r{i}", prompt, new, **options)
        if draw(st.booleans()):
            stop = {unbatched(r, block_size)[:2][-1]}
            r = req(f"r{i}", prompt, new, stop_tokens=stop, **options)
        events.append((at, "submit", r))
        if draw(st.integers(0, 3)) == 0:
            events.append((max(2, at + draw(st.integers(0, 6))), "abort", r.rid))
    num_blocks = draw(st.integers(worst, worst * 3), label="num_blocks")
    ordered = sorted(events, key=lambda e: (e[0], e[1] == "abort"))
    return StaticRun(batch_size, num_blocks, block_size, tuple(ordered), start_ns, tuple(gaps))


def drive_static(run: StaticRun) -> None:
    """Run a ``StaticBatcher`` through ``run`` beside :class:`StaticRules`: after every
    step its output, its batch and its metrics, and after every abort its metrics, must
    be the rules' (the batch and the requests finished in one step in any order; the
    metrics in the order the requests finished)."""
    outputs = {r.rid: unbatched(r, run.block_size) for _, kind, r in run.events if kind == "submit"}
    rules = StaticRules(outputs, batch_size=run.batch_size, num_blocks=run.num_blocks,
                        block_size=run.block_size)  # fmt: skip
    m = model(run.num_blocks, run.block_size)
    b: Slotted = stage().StaticBatcher(m, batch_size=run.batch_size)
    n = 1
    story = Story(
        f"a StaticBatcher(batch_size={run.batch_size}) over {run.num_blocks} blocks of "
        f"{run.block_size}; t= is the now_ns of the latest step:",
        lambda: rules.now_ns or 0,
    )
    last = max(at for at, _, _ in run.events)
    for n in range(1, MAX_STEPS + 1):
        for at, kind, what in run.events:
            if at != n:
                continue
            if kind == "submit":
                submit_new(b, m, what)
                rules.submit(what)
                story.add(f"before step {n}: submit {_told(what)}")
            else:
                b.abort(what)
                rules.abort(what)
                story.add(f"before step {n}: abort {what}")
                _expect_metrics(story, b, rules, f"after the abort of {what}")
        if n > last and not b.has_unfinished():
            return
        now = run.now_ns(n)
        got = step_of(b.step(now))
        want = rules.step(now)
        story.expect(
            got._replace(scheduled=sorted(got.scheduled)),
            want._replace(scheduled=sorted(want.scheduled)),
            f"static, finish: step {n} (now_ns {now}) is not the one the rules make",
        )
        story.add(f"step {n} at {now}: scheduled {dict(want.scheduled)}, emitted "
                  f"{want.emitted}, finished {want.finished}")  # fmt: skip
        story.expect(
            sorted(b.running()), sorted(rules.running), f"static: the batch after step {n}"
        )
        _expect_metrics(story, b, rules, f"after step {n}")
    story.check(False, "liveness", f"still unfinished after {MAX_STEPS} steps")


def _told(r: Request) -> str:
    return (f"{r.rid} (prompt {len(r.prompt)}, max_new_tokens {r.max_new_tokens}, deadline "
            f"{r.deadline_ns}, stop {set(r.stop_tokens)})")  # fmt: skip


def _expect_metrics(story: Story, b: Slotted, rules: StaticRules, when: str) -> None:
    got = b.metrics()
    story.expect(
        {m.rid: m for m in got},
        {m.rid: m for m in rules.metrics},
        f"metrics {when}: each finished request once, first_token_ns the now_ns of the step "
        "that emitted its first token, finish_ns that of the step that finished it (an "
        "abort: the latest step's)",
    )
    order = [m.finish_ns for m in got]
    story.check(
        order == sorted(order),
        f"metrics {when}: in the order the requests finished",
        f"finish_ns in the order listed: {order}",
    )


__all__ = ["MAX_STEPS", "StaticRun", "drive_static", "static_runs"]
