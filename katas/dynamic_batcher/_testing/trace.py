"""Drivers for the stage-1 suite: a continuous batcher run step by step and checked
after every step, the workloads hypothesis draws for it, and the static baseline's
occupancy.

How the tests see inside the batcher without trusting it: the model is the harness's
``FakeModel``, which samples each next token from what it reads back out of the KV
blocks, so a request whose blocks were shared, freed too early or not recomputed gets
different tokens than it would alone — and :func:`unbatched` is what it would get
alone. A :class:`Trace` drives the batcher step by step and checks, after every step,
the caps and the blocks each request must hold (counted from the tokens it was
scheduled, not from the batcher's own state). Time is the ``now_ns`` each step is
given; nothing sleeps. Stage 2's prefix-cache drivers (:mod:`.prefix`) share the
model's seed and vocabulary, and the step clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import pytest
from hypothesis import strategies as st

from katas._harness.story import check
from katas._harness.under_test import stage
from katas._runtime.todo import Todo
from katas.dynamic_batcher.api import (
    Batcher,
    PagedBatcher,
    Request,
    RequestMetrics,
    RequestRejected,
    StepOutput,
)

from .model import FakeModel, reference_generation

VOCAB = 1000
SEED = 7
STEP_NS = 1_000_000  # the now_ns of step n is n * STEP_NS


def model(num_blocks: int = 64, block_size: int = 4) -> FakeModel:
    return FakeModel(vocab_size=VOCAB, seed=SEED, num_blocks=num_blocks, block_size=block_size)


def batcher(m: FakeModel, **options: Any) -> PagedBatcher:
    """The learner's ``ContinuousBatcher`` over ``m``'s pool (4 seqs, 8 tokens unless told)."""
    options.setdefault("max_num_seqs", 4)
    options.setdefault("max_num_batched_tokens", 8)
    b: PagedBatcher = stage().ContinuousBatcher(
        m, num_blocks=m.num_blocks, block_size=m.block_size, **options
    )
    return b


def req(rid: str, prompt_len: int, new: int = 4, **options: Any) -> Request:
    prompt = tuple((len(rid) * 31 + i * 7) % VOCAB for i in range(prompt_len))
    return Request(rid, prompt, new, **options)


def unbatched(request: Request, block_size: int = 4) -> tuple[int, ...]:
    """The tokens ``request`` generates alone (its stop tokens and max_new_tokens)."""
    return reference_generation(
        request.prompt, request.max_new_tokens, request.stop_tokens,
        vocab_size=VOCAB, seed=SEED, block_size=block_size,
    )  # fmt: skip


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def submit_new(b: Batcher, m: FakeModel, r: Request) -> None:
    """``b.submit(r)``, for a request never submitted: refusing one whose KV fits the pool
    fails by its rule, saying why (a refusal of one that does not fit is raised as is)."""
    try:
        b.submit(r)
    except RequestRejected as exc:
        refused = exc
    else:
        return
    tokens = len(r.prompt) + r.max_new_tokens - 1
    blocks = ceil_div(tokens, m.block_size)
    check(
        blocks > m.num_blocks,
        f"stage1-bad-input: {r.rid} (prompt {len(r.prompt)}, max_new_tokens "
        f"{r.max_new_tokens}) was refused, but it never has more than {tokens} tokens "
        f"in KV (the newest token is never written): ceil({tokens}/{m.block_size}) = "
        f"{blocks} blocks, and the pool has {m.num_blocks}; got {refused!r}",
    )
    raise refused


@dataclass
class Trace:
    """A batcher driven step by step, checked after each one."""

    b: PagedBatcher
    m: FakeModel
    max_num_seqs: int
    budget: int
    outputs: list[StepOutput] = field(default_factory=list)
    streamed: dict[str, list[int]] = field(default_factory=dict)
    finished: dict[str, str] = field(default_factory=dict)
    in_kv: dict[str, int] = field(default_factory=dict)  # tokens scheduled since admission
    submitted: dict[str, Request] = field(default_factory=dict)
    blocks: list[dict[str, tuple[int, ...]]] = field(default_factory=list)  # after each step

    def submit(self, *requests: Request) -> None:
        for r in requests:
            submit_new(self.b, self.m, r)
            self.submitted[r.rid] = r

    def step(self) -> StepOutput:
        n = len(self.outputs) + 1
        out: StepOutput = self.b.step(n * STEP_NS)
        self.outputs.append(out)
        where = f"step {n} (scheduled {dict(out.scheduled)}, preempted {list(out.preempted)})"
        assert out.scheduled_tokens <= self.budget, (
            f"caps: {where}: {out.scheduled_tokens} tokens scheduled, over "
            f"max_num_batched_tokens={self.budget}"
        )
        assert len(out.scheduled) <= self.max_num_seqs, (
            f"caps: {where}: {len(out.scheduled)} requests in one step, over "
            f"max_num_seqs={self.max_num_seqs}"
        )
        running = self.b.running()
        assert len(running) <= self.max_num_seqs, (
            f"caps: after {where}: {len(running)} running, over max_num_seqs="
            f"{self.max_num_seqs}: {running}"
        )
        for rid in out.preempted:
            self.in_kv[rid] = 0
        for rid, count in out.scheduled.items():
            self.in_kv[rid] = self.in_kv.get(rid, 0) + count
        for rid, tokens in out.tokens.items():
            assert rid not in self.finished, (
                f"finish: {where}: {rid} emitted {tokens} after it finished ({self.finished[rid]})"
            )
            self.streamed.setdefault(rid, []).extend(tokens)
        for rid, reason in out.finished.items():
            assert rid not in self.finished, f"finish: {rid} finished twice ({where})"
            self.finished[rid] = reason
            self.in_kv[rid] = 0
        self.check_blocks(where)
        held = {rid: tuple(self.b.blocks_of(rid)) for rid in self.submitted}
        self.blocks.append({rid: blocks for rid, blocks in held.items() if blocks})
        return out

    def check_blocks(self, where: str) -> None:
        held: dict[int, str] = {}
        bs = self.m.block_size
        for rid in self.submitted:
            blocks = self.b.blocks_of(rid)
            want = ceil_div(self.in_kv.get(rid, 0), bs)
            assert len(blocks) == want, (
                f"blocks: after {where}: {rid} has {self.in_kv.get(rid, 0)} tokens in KV, "
                f"so it holds ceil({self.in_kv.get(rid, 0)}/{bs}) = {want} blocks; it holds "
                f"{len(blocks)}: {list(blocks)}"
            )
            for block in blocks:
                assert block not in held, (
                    f"blocks: after {where}: block {block} is held by {held[block]} and {rid}"
                )
                held[block] = rid
        free = self.b.free_blocks()
        assert len(held) + free == self.m.num_blocks, (
            f"blocks: after {where}: {len(held)} blocks held + {free} free != "
            f"num_blocks={self.m.num_blocks} (blocks lost or made up)"
        )

    def run(
        self,
        arrivals: Mapping[int, Sequence[Request]] = {},
        max_steps: int = 500,
        aborts: Mapping[int, str] = {},
    ) -> None:
        """Step until nothing is unfinished and every arrival is in; ``arrivals[n]`` are
        submitted before step n (1-based), and ``aborts[n]`` aborted then if unfinished."""
        last = max(arrivals, default=0)
        while True:
            n = len(self.outputs) + 1
            self.submit(*arrivals.get(n, ()))
            rid = aborts.get(n)
            if rid in self.submitted and rid not in self.finished:
                self.b.abort(rid)
                self.finished[rid] = "abort"
                self.in_kv[rid] = 0
            if n > last and not self.b.has_unfinished():
                return
            assert n <= max_steps, (
                f"liveness: still unfinished after {max_steps} steps: running "
                f"{self.b.running()}, waiting {self.b.waiting()}"
            )
            self.step()

    def rows(self) -> str:
        return "\n".join(
            f"    step {i}: scheduled {dict(o.scheduled)}  emitted {dict(o.tokens)}  "
            f"preempted {list(o.preempted)}  finished {dict(o.finished)}"
            for i, o in enumerate(self.outputs, 1)
        )


def metrics_seen(t: Trace) -> dict[str, RequestMetrics]:
    """The metrics each request a step finished must have, read off the steps alone (step
    n runs at ``n * STEP_NS``): its first token is the first step that emitted one for it,
    its finish the step that finished it, its preemptions the steps that preempted it.
    Requests aborted between steps are left out (no step finished them)."""
    seen: dict[str, RequestMetrics] = {}
    first: dict[str, int] = {}
    emitted: dict[str, int] = {}
    preemptions: dict[str, int] = {}
    for n, out in enumerate(t.outputs, 1):
        for rid in out.preempted:
            preemptions[rid] = preemptions.get(rid, 0) + 1
        for rid, tokens in out.tokens.items():
            first.setdefault(rid, n * STEP_NS)
            emitted[rid] = emitted.get(rid, 0) + len(tokens)
        for rid, reason in out.finished.items():
            seen[rid] = RequestMetrics(
                rid, t.submitted[rid].arrival_ns, first.get(rid), n * STEP_NS,
                emitted.get(rid, 0), reason, preemptions.get(rid, 0),
            )  # fmt: skip
    return seen


def trace(m: FakeModel | None = None, **options: Any) -> Trace:
    m = m or model()
    b = batcher(m, **options)
    return Trace(b, m, options.get("max_num_seqs", 4), options.get("max_num_batched_tokens", 8))


def assert_transparent(t: Trace, rids: Iterable[str] | None = None) -> None:
    for rid in rids if rids is not None else t.submitted:
        r = t.submitted[rid]
        if t.finished.get(rid) not in ("stop", "length"):
            continue
        want = unbatched(r, t.m.block_size)
        got = tuple(t.streamed.get(rid, ()))
        assert got == want, (
            f"transparency: {rid} streamed {list(got)}, but alone it generates {list(want)} "
            "(the model reads each token back from the blocks you name: a wrong block "
            f"table, a block freed too early or a missed recompute changes it)\n{t.rows()}"
        )


# -- the C twin

#: Where the C unit's "not implemented yet" points (the binding's Todo names its contract).
C_CONTRACT = "csrc/hotpath.h"


@contextmanager
def with_the_c_unit() -> Iterator[None]:
    """Run a ``hotpath="c"`` batcher; skip the test, saying why, while the C unit (``-k
    hotpath``, csrc/hotpath.c) is not written yet: the batcher is a unit of its own, and
    the twin is checked once both are written."""
    try:
        yield
    except Todo as exc:
        if C_CONTRACT not in str(exc):
            raise
        pytest.skip(f"hotpath-twin needs the C unit too (-k hotpath): not implemented yet: {exc}")


# -- workloads hypothesis draws


@st.composite
def workloads(draw: st.DrawFn) -> tuple[dict[str, Any], dict[int, list[Request]], dict[int, str]]:
    block_size = draw(st.integers(1, 5), label="block_size")
    seqs = draw(st.integers(1, 4), label="max_num_seqs")
    budget = draw(st.integers(seqs, 16), label="max_num_batched_tokens")
    count = draw(st.integers(1, 7), label="requests")
    arrivals: dict[int, list[Request]] = {}
    worst = 1
    for i in range(count):
        prompt = draw(st.integers(1, 20))
        new = draw(st.integers(1, 10))
        worst = max(worst, ceil_div(prompt + new - 1, block_size))  # its longest KV
        at = draw(st.integers(1, 6))
        priority = draw(st.integers(0, 2))
        arrivals.setdefault(at, []).append(req(f"r{i}", prompt, new, priority=priority))
    # from barely enough for the largest request (preemptions) to plenty
    num_blocks = draw(st.integers(worst, worst * 3), label="num_blocks")
    aborts = draw(
        st.dictionaries(
            st.integers(1, 12), st.sampled_from([f"r{i}" for i in range(count)]), max_size=2
        )
    )
    config = {"num_blocks": num_blocks, "block_size": block_size, "max_num_seqs": seqs,
              "max_num_batched_tokens": budget,
              "policy": draw(st.sampled_from(["fcfs", "priority"]), label="policy")}  # fmt: skip
    return config, arrivals, aborts


def draw_run_config(draw: st.DrawFn) -> dict[str, Any]:
    """A drawn run's batcher settings, all but ``num_blocks`` (the pool follows from the
    requests drawn after them)."""
    block_size = draw(st.integers(1, 4), label="block_size")
    seqs = draw(st.integers(1, 4), label="max_num_seqs")
    return {
        "block_size": block_size,
        "max_num_seqs": seqs,
        "max_num_batched_tokens": draw(st.integers(seqs, 12), label="budget"),
        "policy": draw(st.sampled_from(["fcfs", "priority"]), label="policy"),
    }


def draw_submission(draw: st.DrawFn, plain: Request, at: int, block_size: int) -> Request:
    """``plain`` as submitted before step ``at``: a drawn priority, sometimes a deadline,
    and sometimes a stop token, its own 2nd token (some stop early, some never)."""
    options: dict[str, Any] = {"priority": draw(st.integers(0, 2))}
    if draw(st.booleans()):
        options["deadline_ns"] = (at + draw(st.integers(0, 12))) * STEP_NS
    r = Request(plain.rid, plain.prompt, plain.max_new_tokens, **options)
    if draw(st.booleans()):
        stop = {unbatched(r, block_size)[:2][-1]}
        r = Request(plain.rid, plain.prompt, plain.max_new_tokens, stop_tokens=stop, **options)
    return r


@st.composite
def runs(draw: st.DrawFn) -> tuple[dict[str, Any], list[tuple[int, str, Any]]]:
    """A configuration, and what happens before each step: submissions (some with a
    priority, a stop token or a deadline) and aborts."""
    config = draw_run_config(draw)
    block_size = config["block_size"]
    events: list[tuple[int, str, Any]] = []
    worst = 1
    for i in range(draw(st.integers(1, 8), label="requests")):
        prompt, new = draw(st.integers(1, 14)), draw(st.integers(1, 8))
        worst = max(worst, ceil_div(prompt + new - 1, block_size))  # its longest KV
        at = draw(st.integers(1, 8))
        r = draw_submission(draw, req(f"r{i}", prompt, new), at, block_size)
        events.append((at, "submit", r))
        if draw(st.integers(0, 5)) == 0:
            events.append((at + draw(st.integers(0, 6)), "abort", r.rid))
    config["num_blocks"] = draw(st.integers(worst, worst * 2), label="num_blocks")
    return config, sorted(events, key=lambda e: (e[0], e[1] == "abort"))


# -- continuous against static


class Slotted(Batcher, Protocol):
    """A batcher whose running requests can be counted: both of stage 1's."""

    def running(self) -> list[str]: ...


def steps_and_occupancy(b: Slotted, requests: Sequence[Request], slots: int) -> tuple[int, float]:
    """Run every request (all arrived at 0) to the end: the model steps, and the mean
    share of slots running over the steps that started with a request still waiting
    (the drain at the end, when nobody waits, says nothing about the batcher)."""
    for r in requests:
        b.submit(r)
    steps = backlog_steps = occupied = emitted = 0
    most = sum(r.max_new_tokens for r in requests)
    while b.has_unfinished():
        steps += 1
        assert steps <= 8 * most // slots + 1000, f"liveness: unfinished after {steps} steps"
        waiting = len(requests) - len(b.metrics()) - len(b.running())
        emitted += sum(len(t) for t in b.step(steps * STEP_NS).tokens.values())
        assert emitted <= most, (
            f"finish: by step {steps}, {emitted} tokens emitted, more than the {most} the "
            "requests' max_new_tokens allow: a finished request is still being decoded"
        )
        if waiting:
            backlog_steps += 1
            occupied += len(b.running())
    return steps, occupied / max(1, backlog_steps * slots)


__all__ = [
    "C_CONTRACT",
    "SEED",
    "STEP_NS",
    "VOCAB",
    "Slotted",
    "Trace",
    "assert_transparent",
    "batcher",
    "ceil_div",
    "draw_run_config",
    "draw_submission",
    "metrics_seen",
    "model",
    "req",
    "runs",
    "steps_and_occupancy",
    "submit_new",
    "trace",
    "unbatched",
    "with_the_c_unit",
    "workloads",
]
