"""The stage-1 rules as models: what each step of a continuous batcher
(:class:`BatchingRules`) or of the static baseline (:class:`StaticRules`) must schedule,
preempt, emit and finish — written as plainly as the prompt reads, with no concern for
speed, so that a test can compare a batcher with it step by step.

The model knows each request's output in advance (its unbatched generation, which a
correct batcher reproduces exactly), so it needs no model of the GPU: only counts of
tokens computed and blocks held per request, a free count, a waiting list and a running
list.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

from katas.dynamic_batcher.api import FinishReason, Policy, Request, RequestMetrics, StepOutput


class Step(NamedTuple):
    """What one step does, as a model says it (and, by :func:`step_of`, as a batcher's
    ``StepOutput`` says it), so a failure names the parts that differ."""

    scheduled: list[tuple[str, int]]  # in scheduling order
    preempted: tuple[str, ...]
    emitted: dict[str, tuple[int, ...]]
    finished: dict[str, FinishReason]


def step_of(out: StepOutput) -> Step:
    """A batcher's step, as the models say one."""
    return Step(list(out.scheduled.items()), tuple(out.preempted), dict(out.tokens),
                dict(out.finished))  # fmt: skip


@dataclass
class _State:
    request: Request
    output: tuple[int, ...]  # all it will emit
    order: int
    emitted: int = 0
    computed: int = 0
    blocks: int = 0

    @property
    def known(self) -> int:
        return len(self.request.prompt) + self.emitted


class BatchingRules:
    """A continuous batcher's required behaviour, one step at a time."""

    def __init__(
        self,
        outputs: Mapping[str, tuple[int, ...]],
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        num_blocks: int,
        block_size: int,
        policy: Policy = "fcfs",
    ) -> None:
        self.outputs = outputs
        self.max_seqs = max_num_seqs
        self.budget = max_num_batched_tokens
        self.free = num_blocks
        self.block_size = block_size
        self.policy = policy
        self.states: dict[str, _State] = {}
        self.waiting: list[str] = []
        self.running: list[str] = []

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def _rank(self, rid: str) -> tuple[int, int]:
        """Under ``priority``: smaller first, ties by submission; the largest is the least
        important."""
        state = self.states[rid]
        return (state.request.priority, state.order)

    def submit(self, request: Request) -> None:
        rid = request.rid
        self.states[rid] = _State(request, self.outputs[rid], len(self.states))
        if self.policy == "priority":  # everyone by priority, the preempted too
            self.waiting = sorted([*self.waiting, rid], key=self._rank)
        else:  # fcfs: behind everyone (the preempted are at the front)
            self.waiting.append(rid)

    def _drop(self, rid: str) -> None:
        state = self.states[rid]
        self.free += state.blocks
        state.blocks = 0
        if rid in self.running:
            self.running.remove(rid)
        if rid in self.waiting:
            self.waiting.remove(rid)

    def abort(self, rid: str) -> None:
        self._drop(rid)

    def step(self, now_ns: int) -> Step:
        finished: dict[str, FinishReason] = {}
        for rid in [*self.running, *self.waiting]:
            deadline = self.states[rid].request.deadline_ns
            if deadline is not None and now_ns >= deadline:
                self._drop(rid)
                finished[rid] = "deadline"
        plan: dict[str, int] = {}  # in scheduling order
        preempted: list[str] = []
        left = self.budget
        for rid in list(self.running):  # in admission order, whatever the policy
            if len(plan) == self.max_seqs or left == 0:
                break
            if rid not in self.running:
                continue  # preempted in this step for someone before it
            s = self.states[rid]
            n = min(s.known - s.computed, left)
            while self._blocks_for(s.computed + n) - s.blocks > self.free:
                victim = self._victim()
                self._preempt(victim)
                preempted.append(victim)
                if victim in plan:  # scheduled earlier in this step: its tokens go back
                    left += plan.pop(victim)
                if victim == rid:
                    break
            if rid not in self.running:
                break
            self._take(s, n)
            plan[rid] = n
            left -= n
        while not preempted and self.waiting and left > 0 and len(self.running) < self.max_seqs:
            rid = self.waiting[0]
            s = self.states[rid]
            n = min(s.known - s.computed, left)
            if self._blocks_for(s.computed + n) - s.blocks > self.free:
                break  # nobody overtakes it
            self.waiting.pop(0)
            self.running.append(rid)
            self._take(s, n)
            plan[rid] = n
            left -= n
        tokens: dict[str, tuple[int, ...]] = {}
        for rid, n in plan.items():
            s = self.states[rid]
            s.computed += n
            if s.computed < s.known:
                continue  # a prefill chunk that is not the prompt's last
            token = s.output[s.emitted]
            s.emitted += 1
            tokens[rid] = (token,)
            if s.emitted == len(s.output):
                self._drop(rid)
                finished[rid] = "stop" if token in s.request.stop_tokens else "length"
        return Step(list(plan.items()), tuple(preempted), tokens, finished)

    def _take(self, s: _State, n: int) -> None:
        more = self._blocks_for(s.computed + n) - s.blocks
        self.free -= more
        s.blocks += more

    def _victim(self) -> str:
        """Who gives way: ``fcfs``, the most recently admitted; ``priority``, the least
        important running request, wherever it is."""
        if self.policy == "priority":
            return max(self.running, key=self._rank)
        return self.running[-1]

    def _preempt(self, rid: str) -> None:
        s = self.states[rid]
        self._drop(rid)
        s.computed = 0
        if self.policy == "priority":  # back by its priority, not to the front
            self.waiting = sorted([*self.waiting, rid], key=self._rank)
        else:
            self.waiting.insert(0, rid)


class StaticRules:
    """The static baseline's required behaviour, one step at a time, and the metrics it
    must report. A step first finishes every request whose deadline its ``now_ns`` has
    reached, running or waiting (finish); then, only if the batch is empty, takes waiting
    requests in submission order, up to ``batch_size``, while each one's longest KV
    (prompt + ``max_new_tokens`` - 1 tokens) fits the blocks left (static); then every
    request of the batch computes what it has not (its prompt, then one token) and emits
    its next token. An abort finishes its request at the latest step's ``now_ns``."""

    def __init__(
        self,
        outputs: Mapping[str, tuple[int, ...]],
        *,
        batch_size: int,
        num_blocks: int,
        block_size: int,
    ) -> None:
        self.outputs = outputs
        self.batch_size = batch_size
        self.free = num_blocks
        self.block_size = block_size
        self.states: dict[str, _State] = {}
        self.waiting: list[str] = []
        self.running: list[str] = []  # the batch, in admission order
        self.first_token_ns: dict[str, int] = {}
        self.metrics: list[RequestMetrics] = []  # in the order they finished
        self.now_ns: int | None = None  # the latest step's

    def submit(self, request: Request) -> None:
        rid = request.rid
        self.states[rid] = _State(request, self.outputs[rid], len(self.states))
        self.waiting.append(rid)

    def abort(self, rid: str) -> None:
        """Finish ``rid`` at the latest step (the model claims nothing before the first)."""
        if self.now_ns is None:
            raise ValueError("the static model has no step to finish an abort at yet")
        if rid in self.running or rid in self.waiting:
            self._finish(rid, self.now_ns, "abort")

    def _finish(self, rid: str, now_ns: int, reason: FinishReason) -> None:
        state = self.states[rid]
        self.free += state.blocks
        state.blocks = 0
        if rid in self.running:
            self.running.remove(rid)
        else:
            self.waiting.remove(rid)
        r = state.request
        self.metrics.append(
            RequestMetrics(rid, r.arrival_ns, self.first_token_ns.get(rid), now_ns,
                           state.emitted, reason, 0)
        )  # fmt: skip

    def step(self, now_ns: int) -> Step:
        self.now_ns = now_ns
        finished: dict[str, FinishReason] = {}
        for rid in [*self.running, *self.waiting]:
            deadline = self.states[rid].request.deadline_ns
            if deadline is not None and now_ns >= deadline:
                self._finish(rid, now_ns, "deadline")
                finished[rid] = "deadline"
        if not self.running:  # a new batch, only once the last one is gone
            while self.waiting and len(self.running) < self.batch_size:
                s = self.states[self.waiting[0]]
                longest = -(-(len(s.request.prompt) + s.request.max_new_tokens - 1)
                            // self.block_size)  # fmt: skip
                if longest > self.free:
                    break
                self.free -= longest
                s.blocks = longest
                self.running.append(self.waiting.pop(0))
        plan = [(rid, self.states[rid].known - self.states[rid].computed) for rid in self.running]
        tokens: dict[str, tuple[int, ...]] = {}
        for rid, n in plan:
            s = self.states[rid]
            s.computed += n
            token = s.output[s.emitted]
            s.emitted += 1
            tokens[rid] = (token,)
            self.first_token_ns.setdefault(rid, now_ns)
            if s.emitted == len(s.output):
                reason: FinishReason = "stop" if token in s.request.stop_tokens else "length"
                self._finish(rid, now_ns, reason)
                finished[rid] = reason
        return Step(plan, (), tokens, finished)


__all__ = ["BatchingRules", "StaticRules", "Step", "step_of"]
