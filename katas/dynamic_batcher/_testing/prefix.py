"""Drivers for the stage-2 prefix cache's tests: a run that checks every step, and a
model of the rules written from the prompt alone.

The model is the harness's ``FakeModel(shared_reads=True)``: requests may share blocks
they only read, but a block written in a step must be in no other request's table, and
every token is sampled from what is read back from the blocks — so a block freed while
shared, evicted while in use or recomputed into the wrong place changes what a request
generates, and ``reference_outputs`` is what each request generates alone. A request's
hits are read from what a step schedules: the tokens served from the cache are not
computed. A :class:`Run` checks after every step what holds whatever the cache did (the
caps, the block counts, the conservation of blocks); :class:`PrefixRules`, written from
the rules alone (it never reads the batcher's internals), says what every step must do
(:mod:`.prefix_machine` compares the two). The seed, the vocabulary, the step clock and
``unbatched`` are stage 1's (:mod:`.trace`).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from katas._harness.story import check
from katas._harness.under_test import stage
from katas.dynamic_batcher._testing.model import FakeModel, reference_outputs
from katas.dynamic_batcher.api import (
    CachingBatcher,
    FinishReason,
    Policy,
    PrefixCacheStatistics,
    Request,
    StepOutput,
)

from .rules import Step
from .trace import SEED, STEP_NS, VOCAB, ceil_div


def prefix_model(num_blocks: int = 16, block_size: int = 4) -> FakeModel:
    return FakeModel(VOCAB, SEED, num_blocks, block_size, shared_reads=True)


def prefix_batcher(m: FakeModel, **options: Any) -> CachingBatcher:
    """The learner's ``PrefixCachingBatcher`` over ``m``'s pool (4 seqs, 16 tokens unless
    told)."""
    options.setdefault("max_num_seqs", 4)
    options.setdefault("max_num_batched_tokens", 16)
    b: CachingBatcher = stage().PrefixCachingBatcher(
        m, num_blocks=m.num_blocks, block_size=m.block_size, **options
    )
    return b


def toks(first: int, n: int) -> tuple[int, ...]:
    """``n`` tokens of their own: ``first``, ``first + 1``, …"""
    return tuple(range(first, first + n))


@dataclass
class Run:
    """A prefix-caching batcher driven step by step and checked after each one, by rules
    that hold whatever the cache holds: the caps, running requests first, no admission
    in a step that preempted, block conservation, ceil(tokens in KV / block_size) blocks
    per request, no partial or freshly written block shared, and the statistics'
    lookups, queried tokens and hits. A request's hit is read off its admission step: it
    holds ``hit / block_size`` blocks more than its chunk needs."""

    b: CachingBatcher
    m: FakeModel
    max_num_seqs: int
    budget: int
    submitted: dict[str, Request] = field(default_factory=dict)
    streamed: dict[str, list[int]] = field(default_factory=dict)
    finished: dict[str, str] = field(default_factory=dict)
    in_kv: dict[str, int] = field(default_factory=dict)
    #: rid -> tokens served from the cache at each of its admissions (None: it finished in
    #: that step, so its table could not be read)
    hits: dict[str, list[int | None]] = field(default_factory=dict)
    outputs: list[StepOutput] = field(default_factory=list)
    lookups: int = 0
    queried: int = 0
    hit_tokens: int = 0

    @property
    def bs(self) -> int:
        return self.m.block_size

    def submit(self, *requests: Request) -> None:
        for r in requests:
            self.b.submit(r)
            self.submitted[r.rid] = r

    def abort(self, rid: str) -> None:
        self.b.abort(rid)
        if rid not in self.finished:
            self.finished[rid] = "abort"
            self.in_kv[rid] = 0
        self.check_blocks(f"abort({rid!r})")

    def known(self, rid: str) -> int:
        return len(self.submitted[rid].prompt) + len(self.streamed.get(rid, ()))

    def step(self) -> StepOutput:
        n = len(self.outputs) + 1
        running, waiting = list(self.b.running()), list(self.b.waiting())
        known = {rid: self.known(rid) for rid in running + waiting}
        out: StepOutput = self.b.step(n * STEP_NS)
        self.outputs.append(out)
        where = f"step {n} (scheduled {dict(out.scheduled)}, preempted {list(out.preempted)})"
        check(
            out.scheduled_tokens <= self.budget and len(out.scheduled) <= self.max_num_seqs,
            f"prefix-stage1 (caps): {where}: {out.scheduled_tokens} tokens for "
            f"{len(out.scheduled)} requests, over max_num_batched_tokens={self.budget} or "
            f"max_num_seqs={self.max_num_seqs}",
        )
        order = list(out.scheduled)
        admitted = [rid for rid in order if rid not in running]
        check(
            order == [rid for rid in order if rid in running] + admitted
            and admitted == [rid for rid in waiting if rid in admitted],
            f"prefix-stage1 (running-first): {where}: the running requests {running} come "
            f"first, in admission order, then the waiting ones {waiting} in theirs",
        )
        check(
            not (out.preempted and admitted),
            f"prefix-stage1 (preemption): {where}: a step that preempted admits nobody, "
            f"yet {admitted} were admitted",
        )
        for rid in out.preempted:
            self.in_kv[rid] = 0
        written: dict[str, range] = {}
        fresh = 0  # tokens served from the cache to the admissions read off their tables
        unread = False
        for rid, count in out.scheduled.items():
            start = self.in_kv.get(rid, 0)
            if rid in admitted:
                self.lookups += 1
                self.queried += known[rid]
                held = len(self.b.blocks_of(rid))
                hit = (held - ceil_div(count, self.bs)) * self.bs if held else None
                unread = unread or hit is None
                if hit is not None:
                    limit = (known[rid] - 1) // self.bs * self.bs
                    check(
                        0 <= hit <= limit,
                        f"prefix-last-token: {where}: {rid} (known {known[rid]} tokens) was "
                        f"admitted computing {count} and holds {held} blocks of {self.bs}, "
                        f"so {hit} tokens came from the cache; that must be 0 to {limit}: "
                        "whole blocks, never the block of its last known token",
                    )
                    fresh += hit
                    start = hit
                self.hits.setdefault(rid, []).append(hit)
            self.in_kv[rid] = start + count
            written[rid] = range(start // self.bs, ceil_div(start + count, self.bs))
        for rid, tokens in out.tokens.items():
            check(rid not in self.finished, f"finish: {where}: {rid} emitted after it finished")
            self.streamed.setdefault(rid, []).extend(tokens)
        for rid, reason in out.finished.items():
            check(rid not in self.finished, f"finish: {where}: {rid} finished twice")
            self.finished[rid] = reason
            self.in_kv[rid] = 0
        stats: PrefixCacheStatistics = self.b.cache_statistics()
        check(
            (stats.lookups, stats.queried_tokens) == (self.lookups, self.queried),
            f"prefix-statistics: after {where}: {self.lookups} admissions so far, which "
            f"queried {self.queried} known tokens; cache_statistics() says {stats}",
        )
        step_hits = stats.hit_tokens - self.hit_tokens
        self.hit_tokens = stats.hit_tokens
        check(
            step_hits == fresh or (step_hits > fresh and unread),
            f"prefix-statistics: {where}: the requests admitted were served {fresh} tokens "
            f"from the cache (read off their blocks), but hit_tokens grew by {step_hits}",
        )
        self.check_blocks(where, written)
        return out

    def check_blocks(self, where: str, written: Mapping[str, range] | None = None) -> None:
        tables = {rid: tuple(self.b.blocks_of(rid)) for rid in self.submitted}
        holders: dict[int, list[str]] = {}
        for rid, blocks in tables.items():
            want = ceil_div(self.in_kv.get(rid, 0), self.bs)
            check(
                len(blocks) == want,
                f"prefix-stage1 (blocks): after {where}: {rid} has {self.in_kv.get(rid, 0)} "
                f"tokens in KV (those served from the cache included), so it holds "
                f"ceil(…/{self.bs}) = {want} blocks; it holds {list(blocks)}",
            )
            check(
                len(set(blocks)) == len(blocks),
                f"prefix-refcount: after {where}: {rid} holds a block twice: {list(blocks)}",
            )
            for block in blocks:
                holders.setdefault(block, []).append(rid)
        free = self.b.free_blocks()
        check(
            len(holders) + free == self.m.num_blocks,
            f"prefix-refcount: after {where}: {len(holders)} blocks are held and "
            f"free_blocks() says {free}: held + free must be num_blocks="
            f"{self.m.num_blocks} (a shared block is held once however many share it; a "
            "cached block nobody holds is free). Held: "
            f"{ {rid: list(t) for rid, t in tables.items() if t} }",
        )
        stats = self.b.cache_statistics()
        check(
            0 <= stats.cached_blocks <= self.m.num_blocks,
            f"prefix-statistics: {stats.cached_blocks} cached blocks in a pool of "
            f"{self.m.num_blocks}",
        )
        for block, rids in holders.items():
            if len(rids) < 2:
                continue
            for rid in rids:
                index = tables[rid].index(block)
                check(
                    index < self.in_kv.get(rid, 0) // self.bs,
                    f"prefix-no-shared-writes: after {where}: block {block} is shared by "
                    f"{rids}, but it is {rid}'s block {index}, which is not full ({rid} has "
                    f"{self.in_kv.get(rid, 0)} tokens in KV): only full blocks are shared",
                )
                check(
                    written is None or index not in written.get(rid, range(0)),
                    f"prefix-no-shared-writes: after {where}: {rid} wrote its block {index} "
                    f"(block {block}) in this step, and {[r for r in rids if r != rid]} "
                    "share it already: a block is cached only after the step that fills it",
                )

    def run(
        self,
        arrivals: Mapping[int, Sequence[Request]] = {},
        aborts: Mapping[int, str] = {},
        max_steps: int = 500,
    ) -> None:
        """Step until nothing is unfinished and every arrival is in; ``arrivals[n]`` are
        submitted before step n (1-based), ``aborts[n]`` aborted then if unfinished."""
        last = max([*arrivals, *aborts], default=0)
        while True:
            n = len(self.outputs) + 1
            self.submit(*arrivals.get(n, ()))
            rid = aborts.get(n)
            if rid in self.submitted and rid not in self.finished:
                self.abort(rid)
            if n > last and not self.b.has_unfinished():
                return
            check(
                n <= max_steps,
                f"liveness: unfinished after {max_steps} steps: running "
                f"{self.b.running()}, waiting {self.b.waiting()}",
            )
            self.step()

    def rows(self) -> str:
        return "\n".join(
            f"    step {i}: scheduled {dict(o.scheduled)}  preempted {list(o.preempted)}  "
            f"finished {dict(o.finished)}"
            for i, o in enumerate(self.outputs, 1)
        )

    def assert_transparent(self) -> None:
        alone = reference_outputs(self.submitted.values(), self.m)
        for rid in self.submitted:
            if self.finished.get(rid) not in ("stop", "length"):
                continue
            want, got = alone[rid], tuple(self.streamed.get(rid, ()))
            check(
                got == want,
                f"prefix-transparency: {rid} streamed {list(got)}, but alone it generates "
                f"{list(want)}: the model reads every token back from the blocks you name, "
                "so a shared block freed, evicted or written while in use changes it\n"
                f"{self.rows()}",
            )


def run_of(m: FakeModel | None = None, **options: Any) -> Run:
    m = m or prefix_model()
    b = prefix_batcher(m, **options)
    return Run(b, m, options.get("max_num_seqs", 4), options.get("max_num_batched_tokens", 16))


#: A system prompt of two full blocks of 4.
S = toks(100, 8)


# -- the model: every step as the rules make it


@dataclass(eq=False)
class Slot:
    """A block of the model's pool: how many requests hold it, and the prefix it caches
    (every token up to its end: what its chained key stands for; None: no key)."""

    refs: int = 0
    prefix: tuple[int, ...] | None = None


@dataclass(eq=False)
class Seq:
    request: Request
    output: tuple[int, ...]  # all it will emit (its unbatched generation)
    order: int
    emitted: int = 0
    computed: int = 0
    blocks: list[Slot] = field(default_factory=list)

    @property
    def tokens(self) -> tuple[int, ...]:
        return self.request.prompt + self.output[: self.emitted]

    @property
    def known(self) -> int:
        return len(self.request.prompt) + self.emitted


class PrefixRules:
    """A prefix-caching batcher's required behaviour, one step at a time, read from the
    rules: stage 1's scheduling, with blocks that are shared, counted and kept. Written
    for plainness, not speed: the free queue is a list, a key is the whole prefix."""

    def __init__(
        self, *, max_num_seqs: int, max_num_batched_tokens: int, num_blocks: int,
        block_size: int, policy: Policy,
    ) -> None:  # fmt: skip
        self.max_seqs, self.budget = max_num_seqs, max_num_batched_tokens
        self.bs, self.policy = block_size, policy
        self.free = [Slot() for _ in range(num_blocks)]  # the front is taken first
        self.cache: dict[tuple[int, ...], Slot] = {}
        self.seqs: dict[str, Seq] = {}
        self.waiting: list[str] = []
        self.running: list[str] = []
        self.submitted = 0
        self.lookups = self.queried = self.hits = self.evictions = 0

    def statistics(self) -> PrefixCacheStatistics:
        return PrefixCacheStatistics(
            self.lookups, self.queried, self.hits, len(self.cache), self.evictions
        )

    def _rank(self, rid: str) -> tuple[int, int]:
        s = self.seqs[rid]
        return (s.request.priority if self.policy == "priority" else 0, s.order)

    def submit(self, request: Request, output: tuple[int, ...]) -> None:
        self.seqs[request.rid] = Seq(request, output, self.submitted)
        self.submitted += 1
        if self.policy == "priority":
            self.waiting = sorted([*self.waiting, request.rid], key=self._rank)
        else:
            self.waiting.append(request.rid)

    def _release(self, s: Seq) -> None:
        for slot in reversed(s.blocks):  # last block first
            slot.refs -= 1
            assert slot.refs >= 0, "the model's own ref count went negative"
            if slot.refs == 0:
                self.free.append(slot)  # its prefix, if any, stays cached
        s.blocks = []

    def _drop(self, rid: str) -> None:
        self._release(self.seqs.pop(rid))
        for queue in (self.running, self.waiting):
            if rid in queue:
                queue.remove(rid)

    def abort(self, rid: str) -> None:
        if rid in self.seqs:
            self._drop(rid)

    def _take(self) -> Slot:
        slot = self.free.pop(0)
        if slot.prefix is not None:
            del self.cache[slot.prefix]
            slot.prefix = None
            self.evictions += 1
        slot.refs = 1
        return slot

    def _blocks_for(self, tokens: int) -> int:
        return ceil_div(tokens, self.bs)

    def _preempt(self, rid: str) -> None:
        s = self.seqs[rid]
        self._release(s)
        s.computed = 0
        self.running.remove(rid)
        if self.policy == "priority":
            self.waiting = sorted([*self.waiting, rid], key=self._rank)
        else:
            self.waiting.insert(0, rid)

    def _lookup(self, s: Seq) -> list[Slot]:
        hits = []
        for i in range((s.known - 1) // self.bs):  # never the last known token's block
            slot = self.cache.get(s.tokens[: (i + 1) * self.bs])
            if slot is None:
                break
            hits.append(slot)
        return hits

    def step(self, now_ns: int) -> Step:
        finished: dict[str, FinishReason] = {}
        for rid in [*self.running, *self.waiting]:
            deadline = self.seqs[rid].request.deadline_ns
            if deadline is not None and now_ns >= deadline:
                self._drop(rid)
                finished[rid] = "deadline"
        plan: dict[str, int] = {}
        preempted: list[str] = []
        left = self.budget
        for rid in list(self.running):
            if len(plan) == self.max_seqs or left == 0:
                break
            if rid not in self.running:
                continue
            s = self.seqs[rid]
            n = min(s.known - s.computed, left)
            while self._blocks_for(s.computed + n) - len(s.blocks) > len(self.free):
                victim = self.running[-1]
                if self.policy == "priority":
                    victim = max(self.running, key=self._rank)
                self._preempt(victim)
                preempted.append(victim)
                left += plan.pop(victim, 0)
                if victim == rid:
                    break
            if rid not in self.running:
                break
            s.blocks += [
                self._take() for _ in range(self._blocks_for(s.computed + n) - len(s.blocks))
            ]
            plan[rid] = n
            left -= n
        while not preempted and self.waiting and left > 0 and len(self.running) < self.max_seqs:
            rid = self.waiting[0]
            s = self.seqs[rid]
            hits = self._lookup(s)
            computed = len(hits) * self.bs
            n = min(s.known - computed, left)
            new = self._blocks_for(computed + n) - len(hits)
            if sum(slot.refs == 0 for slot in hits) + new > len(self.free):
                break
            for slot in hits:
                if slot.refs == 0:
                    self.free.remove(slot)
                slot.refs += 1
            s.blocks, s.computed = hits, computed
            s.blocks += [self._take() for _ in range(new)]
            self.lookups += 1
            self.queried += s.known
            self.hits += computed
            self.running.append(self.waiting.pop(0))
            plan[rid] = n
            left -= n
        tokens: dict[str, tuple[int, ...]] = {}
        for rid, n in plan.items():
            s = self.seqs[rid]
            for i in range(s.computed // self.bs, (s.computed + n) // self.bs):
                prefix = s.tokens[: (i + 1) * self.bs]
                if prefix not in self.cache:  # one block per key: the first to fill it
                    self.cache[prefix] = s.blocks[i]
                    s.blocks[i].prefix = prefix
            s.computed += n
            if s.computed < s.known:
                continue
            token = s.output[s.emitted]
            s.emitted += 1
            tokens[rid] = (token,)
            if s.emitted == len(s.output):
                self._drop(rid)
                finished[rid] = "stop" if token in s.request.stop_tokens else "length"
        return Step(list(plan.items()), tuple(preempted), tokens, finished)


def shape(tables: Mapping[str, Sequence[Hashable]]) -> dict[str, list[int]]:
    """Block tables with each block renamed by its first appearance (rids in sorted order):
    two sets of tables have the same shape when the same positions share a block."""
    names: dict[Hashable, int] = {}
    return {rid: [names.setdefault(b, len(names)) for b in tables[rid]] for rid in sorted(tables)}


#: Two prefixes of 12 tokens (three blocks of 4) that requests start with.
BASES = (toks(500, 12), toks(600, 12))
#: The most KV a request of ``submit`` holds: a cut of 12, 3 tokens of its own, 6 new.
LONGEST = 12 + 3 + 6 - 1
