"""The prefix cache's model-based test: a prefix-caching batcher and
:class:`~katas.dynamic_batcher._testing.prefix.PrefixRules` (the rules written plainly)
under random submissions, steps and aborts, compared after every rule; and the walks
every run replays first, the boundaries random steps reach only sometimes.
"""

from __future__ import annotations

from typing import Any

import hypothesis.stateful as stateful
import pytest
from hypothesis import strategies as st

from katas._harness.story import Story
from katas._harness.walks import Walk
from katas.dynamic_batcher.api import CachingBatcher, Policy, Request, RequestRejected

from .prefix import BASES, LONGEST, PrefixRules, prefix_batcher, prefix_model, shape, toks
from .rules import step_of
from .trace import STEP_NS, ceil_div, unbatched


class PrefixCacheMachine(stateful.RuleBasedStateMachine):
    """A prefix-caching batcher and :class:`PrefixRules` under random submissions (prompts
    that share prefixes, chat turns that extend an earlier request's prompt and answer),
    steps and aborts, compared after every rule: what each step schedules, preempts,
    emits and finishes; the queues; which positions share a block; the free count; the
    statistics; and, read off the batcher alone, ref counts and conservation."""

    def __init__(self) -> None:
        super().__init__()
        self.requests: list[Request] = []
        self.steps = 0
        self.story = Story("", lambda: self.steps * STEP_NS)

    @stateful.initialize(
        block_size=st.integers(1, 4), max_num_seqs=st.integers(1, 3),
        extra_budget=st.integers(0, 9), policy=st.sampled_from(["fcfs", "priority"]),
        spare=st.integers(0, 3),
    )  # fmt: skip
    def build(
        self, block_size: int, max_num_seqs: int, extra_budget: int, policy: Policy, spare: int
    ) -> None:
        num_blocks = ceil_div(LONGEST, block_size) + spare
        config: dict[str, Any] = {
            "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max_num_seqs + extra_budget,
            "num_blocks": num_blocks,
            "block_size": block_size,
            "policy": policy,
        }
        self.m = prefix_model(num_blocks, block_size)
        self.b: CachingBatcher = prefix_batcher(
            self.m, **{k: v for k, v in config.items() if "block" not in k}
        )
        self.spec = PrefixRules(**config)
        self.story.add(f"PrefixCachingBatcher({config}), step n at n * {STEP_NS} ns")

    def _submit(self, prompt: tuple[int, ...], new: int, **options: Any) -> None:
        rid = f"r{len(self.requests)}"
        r = Request(rid, prompt, new, **options)
        said = (
            f"before step {self.steps + 1}: submit {rid} (prompt {list(prompt)}, "
            f"max_new_tokens {new}, {options or 'no options'})"
        )
        if ceil_div(len(prompt) + new - 1, self.m.block_size) > self.m.num_blocks:
            self.story.add(f"{said}: refused (it could never finish)")
            with pytest.raises(RequestRejected):
                self.b.submit(r)
            return
        self.story.add(said)
        self.requests.append(r)
        self.b.submit(r)
        self.spec.submit(r, unbatched(r, self.m.block_size))

    @stateful.rule(
        base=st.integers(0, 1), cut=st.integers(0, 12), own=st.integers(0, 3),
        new=st.integers(1, 6), priority=st.integers(0, 2), stop=st.booleans(),
        deadline=st.none() | st.integers(0, 8),
    )  # fmt: skip
    def submit(
        self, base: int, cut: int, own: int, new: int, priority: int, stop: bool,
        deadline: int | None,
    ) -> None:  # fmt: skip
        i = len(self.requests)
        prompt = BASES[base][:cut] + toks(1000 + 10 * i, own if cut + own else 1)
        options: dict[str, Any] = {"priority": priority}
        if deadline is not None:
            options["deadline_ns"] = (self.steps + 1 + deadline) * STEP_NS
        if stop:  # its own 2nd token: some stop early, some never
            plain = Request("probe", prompt, new)
            options["stop_tokens"] = {unbatched(plain, self.m.block_size)[:2][-1]}
        self._submit(prompt, new, **options)

    @stateful.rule(index=st.integers(0, 50), own=st.integers(1, 3), new=st.integers(1, 6))
    def follow_up(self, index: int, own: int, new: int) -> None:
        """The next turn of a chat: an earlier request's prompt, its whole answer, more."""
        if not self.requests:
            return
        earlier = self.requests[index % len(self.requests)]
        answer = unbatched(earlier, self.m.block_size)
        self._submit(earlier.prompt + answer + toks(1000 + 10 * len(self.requests), own), new)

    @stateful.rule(index=st.integers(0, 50))
    def abort(self, index: int) -> None:
        if not self.requests:
            return
        rid = self.requests[index % len(self.requests)].rid
        self.story.add(f"before step {self.steps + 1}: abort {rid}")
        self.b.abort(rid)
        self.spec.abort(rid)

    @stateful.rule()
    def step(self) -> None:
        self.steps += 1
        got = step_of(self.b.step(self.steps * STEP_NS))
        want = self.spec.step(self.steps * STEP_NS)
        self.story.expect(
            got,
            want,
            f"step {self.steps} is not the one the rules make (a request admitted with a hit "
            "computes only what the cache did not have)",
        )
        self.story.add(
            f"step {self.steps}: scheduled {want.scheduled}, preempted {list(want.preempted)}"
        )

    @stateful.rule()
    def run_out(self) -> None:
        """Step until nothing is left (the frees, the queue, what stays cached)."""
        for _ in range(60):
            if not self.spec.seqs:
                break
            self.step()

    @stateful.invariant()
    @stateful.precondition(lambda self: hasattr(self, "b"))
    def blocks_agree(self) -> None:
        rids = list(self.spec.seqs)
        tables = {rid: tuple(self.b.blocks_of(rid)) for rid in rids}
        holders: dict[int, int] = {}
        for rid in rids:
            for block in set(tables[rid]):
                holders[block] = holders.get(block, 0) + 1
        free = self.b.free_blocks()
        self.story.check(
            len(holders) + free == self.m.num_blocks
            and all(len(set(t)) == len(t) for t in tables.values()),
            "prefix-refcount: every block is held (by one request or several: its ref count) "
            "or free, never both and never lost",
            f"{len(holders)} held + {free} free != {self.m.num_blocks}; tables {tables}",
        )
        want = shape({rid: self.spec.seqs[rid].blocks for rid in rids})
        self.story.check(
            shape(tables) == want,
            "prefix-hit: which positions share a block (blocks numbered by first appearance; "
            "the same number is one block, held by each)",
            f"expected {want}, got {shape(tables)}",
        )
        self.story.check(
            (list(self.b.running()), list(self.b.waiting()))
            == (self.spec.running, self.spec.waiting),
            "the queues, in admission order",
            f"running {self.b.running()} and waiting {self.b.waiting()}: expected "
            f"{self.spec.running} and {self.spec.waiting}",
        )
        stats = self.b.cache_statistics()
        want_stats = self.spec.statistics()
        self.story.check(
            free == len(self.spec.free) and stats == want_stats,
            "prefix-lru / prefix-statistics: the free queue and the statistics",
            f"expected {len(self.spec.free)} free blocks and {want_stats}; got {free} and {stats}",
        )


def _build(block_size: int, max_num_seqs: int, extra_budget: int, policy: str, spare: int) -> Any:
    return ("build", {"block_size": block_size, "max_num_seqs": max_num_seqs,
                      "extra_budget": extra_budget, "policy": policy, "spare": spare})  # fmt: skip


def _submit(base: int, cut: int, own: int, new: int, priority: int = 0, stop: bool = False,
            deadline: int | None = None) -> Any:  # fmt: skip
    return ("submit", {"base": base, "cut": cut, "own": own, "new": new, "priority": priority,
                       "stop": stop, "deadline": deadline})  # fmt: skip


_STEP: Any = ("step", {})
_RUN_OUT: Any = ("run_out", {})

#: The walks every run of the model test replays before its random steps: the
#: boundaries random steps reach only sometimes.
PREFIX_WALKS: dict[str, Walk] = {
    # Two sharers of a prefix, one of them finished; a long request then needs the whole
    # pool: the least recently freed cached blocks go first, the shared ones last; a chat
    # turn on the first request finds what is left.
    "evicted": [
        _build(4, 2, 6, "fcfs", 0), _submit(0, 8, 1, 2), _STEP, _submit(0, 8, 2, 3), _STEP,
        _STEP, _submit(1, 12, 3, 5), _RUN_OUT, ("follow_up", {"index": 0, "own": 1, "new": 2}),
        _RUN_OUT,
    ],
    # Three requests sharing twelve tokens on a pool too small for all of them: a victim's
    # shared blocks free nothing, so the victims keep coming; each recompute is a hit.
    "crowded": [
        _build(2, 3, 3, "fcfs", 0), _submit(0, 12, 1, 5), _STEP, _submit(0, 12, 2, 5), _STEP,
        _submit(0, 12, 3, 5), _STEP, _STEP, _STEP, _STEP, _RUN_OUT,
    ],
    # Priorities, a deadline and an abort among sharers: the victim is the least important,
    # wherever it is; a deadline and an abort free shared blocks only when the last holder
    # goes.
    "priority": [
        _build(2, 2, 6, "priority", 0), _submit(0, 8, 1, 6, priority=2), _STEP, _STEP,
        _submit(0, 8, 3, 6, priority=0), _STEP, _STEP, _STEP, _STEP,
        _submit(0, 12, 0, 6, priority=1, deadline=4), _STEP, _STEP, ("abort", {"index": 1}),
        _STEP, _RUN_OUT,
    ],
    # Under priority, the least important request is scheduled first in the step that
    # preempts it: its chunk leaves the step and its token goes back to the budget, so the
    # prompt chunk scheduled after it gets one token more.
    "victim-scheduled-first": [
        _build(4, 3, 4, "priority", 0), _submit(1, 1, 3, 6, priority=2), _STEP,
        _submit(0, 0, 3, 6, priority=0), _STEP, _submit(0, 12, 3, 2, priority=0), _STEP,
        _STEP, _RUN_OUT,
    ],
    # A prompt of 2 beside a longer request on a pool of 5: it is preempted with two full
    # blocks that its own output filled, and its recompute shares them (the lookup covers
    # the generated tokens, not the prompt alone).
    "own-output": [
        _build(4, 2, 6, "fcfs", 0), _submit(0, 0, 4, 9), _STEP, _submit(0, 0, 2, 12), _RUN_OUT,
    ],
}  # fmt: skip


__all__ = ["PREFIX_WALKS", "PrefixCacheMachine"]
