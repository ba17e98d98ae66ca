"""Reference solution, stage 2 (extended): automatic prefix caching, as vLLM enables it
by default.

Requests that share a prefix — one system prompt, the earlier turns of a chat — share
the KV blocks of that prefix instead of computing it again. Three pieces (vLLM's
``BlockPool`` and ``KVCacheManager``):

1. **Keys.** Every full block of a request's tokens has a key,
   ``block_hash(key of the block before, its tokens)``: chained, so equal keys mean
   equal prefixes, not only equal blocks. A block is cached under its key once the step
   that fills it has run, one block per key (the first to fill it). A partial block has
   no key and is never shared, so no block is written while another request reads it.
2. **Ref counts and an LRU free queue.** A block's ref count is the number of running
   requests that hold it. At 0 it joins the back of the free queue and keeps its key: it
   is still a hit until an allocation takes it from the front (the least recently freed
   first) and drops the key. A request releases its blocks last block first, so its
   tail is evicted before the head that other requests are likelier to share.
3. **Lookup at admission.** A waiting request shares the longest run of cached blocks
   that match its known tokens, block 0 onward — but never the block of its last known
   token, which must be computed for the model to sample the next one. The tokens of
   the shared blocks count as computed: no budget, no prefill. A free shared block
   leaves the queue first, so the request's own new blocks cannot evict it.

Scheduling is stage 1's, request by request in plain Python (the C kernels assume that
a block has one owner): running requests first, then admissions, preemption by
recompute. A preempted request's recompute looks the cache up again, and usually finds
its own blocks there.
"""

from __future__ import annotations

from collections import OrderedDict

from katas.dynamic_batcher.api import (
    FinishReason,
    Model,
    Policy,
    PrefixCacheStatistics,
    Request,
    SeqSlice,
    StepOutput,
    block_hash,
)

from .running import blocks_for
from .stage1 import _Batcher, _check_config, _queue_by_key, _Seq


class _Pool:
    """The KV blocks: ref counts, the free queue, and the cached blocks by key."""

    def __init__(self, num_blocks: int) -> None:
        self.refs = [0] * num_blocks
        # Free blocks, the least recently freed at the front. An OrderedDict pops its
        # front and drops any member in O(1). A fresh pool hands out 0, 1, 2, ...
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.key_of: dict[int, int] = {}  # block -> its key (cached blocks only)
        self.block_of: dict[int, int] = {}  # key -> its block
        self.evictions = 0

    def allocate(self) -> int:
        """A block for new tokens: the front of the free queue, its key dropped."""
        block, _ = self.free.popitem(last=False)
        key = self.key_of.pop(block, None)
        if key is not None:
            del self.block_of[key]
            self.evictions += 1
        self.refs[block] = 1
        return block

    def share(self, block: int) -> None:
        """One more holder of a cached block; a free one leaves the queue, key kept."""
        if self.refs[block] == 0:
            del self.free[block]
        self.refs[block] += 1

    def release(self, blocks: list[int]) -> None:
        """One holder less for each block, last block first; one that nobody holds any
        more joins the back of the free queue, key kept."""
        for block in reversed(blocks):
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self.free[block] = None

    def cache(self, block: int, key: int) -> None:
        """``block`` was just filled; a key already cached keeps its block."""
        if key not in self.block_of:
            self.block_of[key] = block
            self.key_of[block] = key


class PrefixCachingBatcher(_Batcher):
    """Stage 1's continuous batching, with full KV blocks shared between requests that
    have the same prefix, and kept after use until their room is needed."""

    def __init__(
        self,
        model: Model,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        num_blocks: int,
        block_size: int,
        policy: Policy = "fcfs",
    ) -> None:
        self._max_seqs, self._budget = _check_config(
            model, max_num_seqs, max_num_batched_tokens, num_blocks, block_size, policy
        )
        super().__init__(model)
        self._policy: Policy = policy
        self._pool = _Pool(num_blocks)
        self._keys: dict[str, list[int]] = {}  # rid -> keys of its first full blocks
        self._lookups = self._queried = self._hits = 0

    # -- the interface ------------------------------------------------------------------
    def submit(self, request: Request) -> None:
        self._queue(self._new(request), preempted=False)

    def step(self, now_ns: int) -> StepOutput:
        finished = self._past_deadlines(now_ns)
        plan, victims = self._schedule_running()
        if not victims:
            self._admit(plan)
        scheduled, emitted = self._run(plan, now_ns, finished)
        return StepOutput(
            now_ns, scheduled, emitted, finished, tuple(v.request.rid for v in victims)
        )

    def cache_statistics(self) -> PrefixCacheStatistics:
        pool = self._pool
        return PrefixCacheStatistics(
            self._lookups, self._queried, self._hits, len(pool.block_of), pool.evictions
        )

    # -- one step -----------------------------------------------------------------------
    def _schedule_running(self) -> tuple[dict[_Seq, int], list[_Seq]]:
        """Stage 1's moves 1 and 2: ``(plan, victims)``, the plan in scheduling order."""
        plan: dict[_Seq, int] = {}
        victims: list[_Seq] = []
        left = self._budget
        for seq in list(self._running):
            if len(plan) == self._max_seqs or left == 0:
                break
            if seq in victims:
                continue  # preempted for a request before it
            take = min(seq.known - seq.computed, left)
            own = False
            # A victim's shared blocks stay held by the others: it may free none.
            while not own and not self._grow(seq, seq.computed + take):
                victim = self._running[-1]
                if self._policy == "priority":
                    victim = max(self._running, key=lambda s: s.key("priority"))
                self._preempt(victim)
                victims.append(victim)
                left += plan.pop(victim, 0)  # scheduled earlier in this step: no longer
                own = victim is seq
            if own:
                break  # it was its own victim: scheduling ends with it
            plan[seq] = take
            left -= take
        return plan, victims

    def _admit(self, plan: dict[_Seq, int]) -> None:
        """Move 3: waiting requests, each first served what the cache has of it."""
        pool, bs = self._pool, self._block_size
        left = self._budget - sum(plan.values())
        while self._waiting and left > 0 and len(self._running) < self._max_seqs:
            seq = self._waiting[0]
            hits = self._lookup(seq)
            computed = len(hits) * bs
            take = min(seq.known - computed, left)
            new = blocks_for(computed + take, bs) - len(hits)
            # A free hit leaves the free queue as surely as a new block does.
            if sum(pool.refs[b] == 0 for b in hits) + new > len(pool.free):
                break  # admission never preempts, and nobody overtakes it
            for block in hits:  # before any allocation, which could evict a free hit
                pool.share(block)
            seq.blocks, seq.computed = hits, computed
            self._grow(seq, computed + take)
            self._lookups += 1
            self._queried += seq.known
            self._hits += computed
            self._running.append(self._waiting.pop(0))
            plan[seq] = take
            left -= take

    def _run(
        self, plan: dict[_Seq, int], now_ns: int, finished: dict[str, FinishReason]
    ) -> tuple[dict[str, int], dict[str, tuple[int, ...]]]:
        """The forward pass, then each request's outcome: ``(scheduled, emitted)``."""
        slices = [
            SeqSlice(seq.request.rid, seq.tokens(seq.computed, seq.computed + take),
                     seq.computed, tuple(seq.blocks), seq.computed + take == seq.known)
            for seq, take in plan.items()
        ]  # fmt: skip
        sampled = self._model.forward(slices) if slices else {}
        emitted: dict[str, tuple[int, ...]] = {}
        for (seq, take), piece in zip(plan.items(), slices, strict=True):
            self._computed(seq, seq.computed + take)
            if not piece.last:
                continue
            token = sampled[piece.rid]
            if token is None:
                raise RuntimeError(f"the model sampled nothing for the last slice of {piece.rid}")
            emitted[piece.rid] = (token,)
            reason = self._sampled(seq, token, now_ns)
            if reason is not None:
                self._finish(seq, now_ns, reason)
                finished[piece.rid] = reason
        return {p.rid: len(p.tokens) for p in slices}, emitted

    # -- blocks and keys ----------------------------------------------------------------
    def _grow(self, seq: _Seq, tokens: int) -> bool:
        """New blocks for ``tokens`` in ``seq``'s KV; False (nothing taken) if short."""
        missing = blocks_for(tokens, self._block_size) - len(seq.blocks)
        if missing > len(self._pool.free):
            return False
        seq.blocks += [self._pool.allocate() for _ in range(missing)]
        return True

    def _lookup(self, seq: _Seq) -> list[int]:
        """The cached blocks of ``seq``'s longest cached prefix, never past the block
        before the one that holds its last known token."""
        hits = []
        for key in self._keys_of(seq, (seq.known - 1) // self._block_size):
            block = self._pool.block_of.get(key)
            if block is None:
                break
            hits.append(block)
        return hits

    def _keys_of(self, seq: _Seq, n: int) -> list[int]:
        """The keys of ``seq``'s first ``n`` full blocks (kept: a key never changes)."""
        keys = self._keys.setdefault(seq.request.rid, [])
        bs = self._block_size
        while len(keys) < n:
            i = len(keys)
            keys.append(block_hash(keys[-1] if keys else None, seq.tokens(i * bs, i * bs + bs)))
        return keys[:n]

    def _computed(self, seq: _Seq, computed: int) -> None:
        """``seq``'s KV holds ``computed`` tokens now: cache the blocks just filled."""
        bs = self._block_size
        keys = self._keys_of(seq, computed // bs)
        for i in range(seq.computed // bs, computed // bs):
            self._pool.cache(seq.blocks[i], keys[i])
        seq.computed = computed

    def _queue(self, seq: _Seq, *, preempted: bool) -> None:
        if self._policy == "priority":  # by (priority, submission), a victim too
            _queue_by_key(self._waiting, seq, self._policy)
        elif preempted:  # fcfs: a victim goes first (several: in admission order)
            self._waiting.insert(0, seq)
        else:
            self._waiting.append(seq)

    def _preempt(self, seq: _Seq) -> None:
        self._stop_running(seq)
        seq.computed = 0
        seq.preemptions += 1
        self._queue(seq, preempted=True)

    def _stop_running(self, seq: _Seq) -> None:
        self._pool.release(seq.blocks)
        seq.blocks = []
        self._running.remove(seq)

    def _record(self, seq: _Seq, now_ns: int, reason: FinishReason) -> None:
        self._keys.pop(seq.request.rid, None)
        super()._record(seq, now_ns, reason)

    # -- for tests and reports ----------------------------------------------------------
    def free_blocks(self) -> int:
        """Blocks nobody holds, cached or not."""
        return len(self._pool.free)

    def blocks_of(self, rid: str) -> tuple[int, ...]:
        seq = self._seqs.get(rid)
        return () if seq is None else tuple(seq.blocks)

    def waiting(self) -> list[str]:
        return [s.request.rid for s in self._waiting]


__all__ = ["PrefixCachingBatcher"]
