"""Run a batcher over a workload in simulated time, and report what it achieved.

:func:`simulate` is the GPU's clock: time starts at 0 and moves only by the cost of
each step (``model.step_cost_ns`` by default), or jumps to the next arrival when the
batcher is idle. Before every step it submits each request whose ``arrival_ns`` has
been reached. It stops when everything has arrived and nothing is unfinished, and
fails (an AssertionError: liveness) past ``max_steps``.

A step's cost is derived from its :class:`~katas.dynamic_batcher.api.StepOutput`: a
request that computed exactly one token *and* emitted a token in that step is one
**decode**; every token of any other scheduled request (a prompt chunk, the last chunk
that emits the first token, a recompute after preemption) is a **prefill** token. A
one-token prompt therefore costs as a decode — as it does on a GPU.

The :class:`Report`'s TTFT and TPOT are measured by the simulator from the stream
itself — the step that emitted a request's first token, the step that finished it,
the tokens it emitted — with the spec's definitions: TTFT = first token − arrival,
TPOT = (finish − first token) / (output tokens − 1). ``Report.metrics`` is what the
batcher's own ``metrics()`` says, so a test can hold one against the other.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from katas._harness.story import check, expect
from katas._runtime.clock import NS_PER_S
from katas.dynamic_batcher.api import Batcher, FinishReason, Request, RequestMetrics

from .charts import distribution_chart, format_ns, occupancy_chart, percentile, save_png
from .model import step_cost_ns, work_of

#: ``cost(prefill_tokens, decode_seqs) -> ns``
CostModel = Callable[[int, int], int]


@dataclass(frozen=True)
class StepSample:
    """One step of a run: when it started and how long it took, requests it computed
    tokens for (``running``) and submitted unfinished ones it did not (``waiting``:
    queued, preempted, or held back by a static batch)."""

    now_ns: int
    cost_ns: int
    running: int
    waiting: int
    prefill_tokens: int
    decode_seqs: int


@dataclass(frozen=True)
class Report:
    """What one run achieved, in simulated time (integer ns from 0)."""

    slots: int  # the batcher's capacity in requests (max_num_seqs, batch_size)
    steps: int
    start_ns: int  # the first arrival
    end_ns: int  # when the last step ended
    series: tuple[StepSample, ...]
    metrics: tuple[RequestMetrics, ...]  # the batcher's metrics(), in its order
    outputs: Mapping[str, tuple[int, ...]]  # the tokens streamed per request, in order
    ttft_ns: tuple[int, ...]  # measured, per request with a first token (arrival order)
    tpot_ns: tuple[float, ...]  # measured, per request with >= 2 tokens (arrival order)
    prefill_tokens: int
    decode_seqs: int
    preemptions: int
    finish_reasons: Mapping[str, FinishReason] = field(default_factory=dict)

    @property
    def makespan_ns(self) -> int:
        """First arrival to the end of the last step."""
        return self.end_ns - self.start_ns

    @property
    def output_tokens(self) -> int:
        return sum(len(t) for t in self.outputs.values())

    @property
    def throughput(self) -> float:
        """Output tokens per simulated second over the makespan."""
        return self.output_tokens * NS_PER_S / self.makespan_ns if self.makespan_ns else 0.0

    @property
    def mean_occupancy(self) -> float:
        """The mean over steps of running requests / slots (1.0: every slot busy)."""
        if not self.series:
            return 0.0
        return sum(s.running for s in self.series) / (len(self.series) * self.slots)

    @property
    def occupancy_while_queued(self) -> float:
        """Mean occupancy over the steps that left a request waiting: how full the slots
        are while there is demand (a drain tail with an empty queue is no scheduler's
        fault). 0.0 if no step left one waiting."""
        loaded = [s.running for s in self.series if s.waiting > 0]
        return sum(loaded) / (len(loaded) * self.slots) if loaded else 0.0

    def summary(self) -> str:
        """A few lines: steps, time, throughput, occupancy, TTFT and TPOT."""

        def spread(values: Sequence[float]) -> str:
            if not values:
                return "n/a"
            ordered = sorted(values)
            return (
                f"p50 {format_ns(percentile(ordered, 50))}, p99 "
                f"{format_ns(percentile(ordered, 99))}, max {format_ns(ordered[-1])}"
            )

        return "\n".join(
            [
                f"{len(self.outputs)} requests, {self.output_tokens} output tokens in "
                f"{self.steps} steps over {format_ns(self.makespan_ns)} "
                f"({self.throughput:,.0f} tokens/s)",
                f"slot occupancy {self.mean_occupancy:.1%} of {self.slots} "
                f"({self.occupancy_while_queued:.1%} while requests wait); "
                f"{self.prefill_tokens} prefill tokens, {self.decode_seqs} decodes, "
                f"{self.preemptions} preemptions",
                f"TTFT {spread(self.ttft_ns)}",
                f"TPOT {spread(self.tpot_ns)}",
            ]
        )


def simulate(
    batcher: Batcher,
    workload: Sequence[Request],
    *,
    slots: int,
    cost: CostModel = step_cost_ns,
    max_steps: int | None = None,
) -> Report:
    """Run ``workload`` through ``batcher`` in simulated time (see the module's doc).

    ``slots``: the batcher's capacity, the denominator of occupancy. ``max_steps``: the
    liveness bound; by default 10 × every token the workload could ever compute (each
    prompt and output token once), + 100 — far more than any correct batcher needs.
    """
    if slots < 1:
        raise ValueError(f"slots must be >= 1, got {slots}")
    arrivals = sorted(workload, key=lambda r: r.arrival_ns)  # stable: ties keep their order
    if max_steps is None:
        max_steps = 10 * sum(len(r.prompt) + r.max_new_tokens for r in arrivals) + 100
    by_rid = {r.rid: r for r in arrivals}
    if len(by_rid) != len(arrivals):
        raise ValueError("the workload has duplicate request ids")

    now = arrivals[0].arrival_ns if arrivals else 0
    start = now
    nxt = 0  # the next request to submit
    unfinished: dict[str, None] = {}  # submitted, not finished (insertion-ordered)
    outputs: dict[str, list[int]] = {}
    first_token: dict[str, int] = {}
    finished_at: dict[str, int] = {}
    reasons: dict[str, FinishReason] = {}
    series: list[StepSample] = []
    prefill_total = decode_total = preemptions = 0
    while True:
        while nxt < len(arrivals) and arrivals[nxt].arrival_ns <= now:
            request = arrivals[nxt]
            batcher.submit(request)
            unfinished[request.rid] = None
            outputs[request.rid] = []
            nxt += 1
        if not batcher.has_unfinished():
            check(
                not unfinished,
                f"simulate: the batcher has nothing unfinished at {now} ns, but "
                f"{_few(unfinished)} were submitted and never reported finished",
            )
            if nxt == len(arrivals):
                break
            now = arrivals[nxt].arrival_ns  # idle: jump to the next arrival
            continue
        check(
            unfinished,
            f"simulate: every submitted request was reported finished, yet the batcher's "
            f"has_unfinished() is still True at {now} ns (a finished request left running?)",
        )
        check(
            len(series) < max_steps,
            f"simulate: liveness — {len(series)} steps (max_steps) and "
            f"{len(unfinished)} requests still unfinished at {now} ns: "
            f"{_few(unfinished)}; every request must finish in a bounded number of steps",
        )

        out = batcher.step(now)
        expect(out.now_ns, now, f"simulate: step({now}) returned another now_ns")
        stray = [r for r in (*out.scheduled, *out.tokens, *out.finished, *out.preempted)
                 if r not in unfinished]  # fmt: skip
        check(
            not stray,
            f"simulate: step at {now} ns reports requests {stray}, already finished "
            f"({[r for r in stray if r in finished_at]}) or never submitted",
        )
        prefill, decodes = work_of(out)
        running = sum(1 for n in out.scheduled.values() if n > 0)
        for rid, tokens in out.tokens.items():
            if tokens and rid not in first_token:
                first_token[rid] = now
            outputs[rid].extend(tokens)
        waiting = len(unfinished) - running  # every scheduled rid is unfinished (checked)
        for rid, reason in out.finished.items():
            del unfinished[rid]
            finished_at[rid] = now
            reasons[rid] = reason
        step_ns = cost(prefill, decodes)
        if step_ns <= 0:
            raise ValueError(f"the cost model must return > 0 ns, got {step_ns}")
        series.append(StepSample(now, step_ns, running, waiting, prefill, decodes))
        prefill_total += prefill
        decode_total += decodes
        preemptions += len(out.preempted)
        now += step_ns

    ttft, tpot = [], []
    for rid in outputs:  # in arrival order
        if rid in first_token:
            ttft.append(first_token[rid] - by_rid[rid].arrival_ns)
            n = len(outputs[rid])
            if n >= 2:
                tpot.append((finished_at[rid] - first_token[rid]) / (n - 1))
    return Report(
        slots=slots,
        steps=len(series),
        start_ns=start,
        end_ns=now if series else start,
        series=tuple(series),
        metrics=tuple(batcher.metrics()),
        outputs={rid: tuple(tokens) for rid, tokens in outputs.items()},
        ttft_ns=tuple(ttft),
        tpot_ns=tuple(tpot),
        prefill_tokens=prefill_total,
        decode_seqs=decode_total,
        preemptions=preemptions,
        finish_reasons=reasons,
    )


def _few(rids: Mapping[str, None] | Sequence[str], limit: int = 5) -> str:
    names = list(rids)
    shown = ", ".join(repr(r) for r in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


__all__ = [
    "CostModel",
    "Report",
    "StepSample",
    "distribution_chart",
    "occupancy_chart",
    "save_png",
    "simulate",
]
