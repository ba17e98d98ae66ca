"""Reference solution, stage 1: continuous batching over paged KV blocks.

Each ``step()`` is one forward pass, planned in three moves (vLLM's scheduler, and
Orca's iteration-level scheduling before it):

1. **Running requests first, in admission order**: each needs the tokens it knows but
   has not computed — 1 for a decode, the rest of its prompt for a prefill — and gets
   what is left of the step's token budget, in order. A long prompt is so cut into
   chunks, and the decodes admitted before it never wait for it.
2. **Blocks for what was scheduled**: a request holds exactly
   ``ceil(tokens in KV / block_size)`` blocks. When the pool runs dry, a running request
   is preempted — its blocks freed, its KV to be recomputed from its prompt and the
   tokens it already produced. Under ``fcfs`` it is the most recently admitted, and it
   goes to the front of the queue: the oldest requests always progress, so no livelock.
   Under ``priority`` it is the least important, by ``(priority, submission)``, even
   one scheduled earlier in the step (its chunk leaves the step), and it goes back into
   the queue by its priority — vLLM's v1 scheduler, both ways.

   Moves 1 and 2 are the hot path, ``schedule`` over the running requests' int32
   columns (running.py), and so is its counterpart after the forward pass, ``apply``:
   in Python, or the kata's C with ``hotpath="c"``. The kernels' victim is the last
   row, the ``fcfs`` one; a ``priority`` step that runs short is scheduled by running.py's
   ``schedule_by_rank`` instead, on either path.
3. **Waiting requests fill the rest of the budget**, in policy order, while there are
   free slots and blocks — but not in a step that preempted (a step short of blocks
   has no business admitting more).

Recomputing a preempted request replays its known tokens into fresh blocks; the model
then samples the token after them, so nothing it streamed is streamed again.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field

from katas._runtime.checks import positive_int
from katas.dynamic_batcher.api import (
    FinishReason,
    Model,
    Policy,
    Request,
    RequestMetrics,
    RequestRejected,
    SeqSlice,
    StepOutput,
)

from .running import Hotpath, RunningRows, blocks_for


def fill_token_budget(
    need: Sequence[int], token_budget: int, max_seqs: int
) -> tuple[list[int], int, int]:
    """The hot path's Python twin (``hp_fill_token_budget`` in csrc/hotpath.h): chunks
    in order, each clamped to the budget left, stopping at the first request that would
    get nothing or after ``max_seqs``; ``(chunks, requests scheduled, tokens)``. The
    batcher itself runs this rule inside running.py's ``schedule``, blocks included."""
    chunks = [0] * len(need)
    left = token_budget
    seqs = 0
    for i, n in enumerate(need):
        if left == 0 or seqs == max_seqs:
            break
        chunks[i] = take = n if n < left else left
        left -= take
        seqs += 1
    return chunks, seqs, token_budget - left


@dataclass(eq=False)
class _Seq:
    """One request's state inside the batcher."""

    request: Request
    order: int  # submission order: FCFS, and the tie-break under priorities
    output: list[int] = field(default_factory=list)
    # The static batcher's KV (the continuous one keeps its running requests' in columns).
    computed: int = 0  # tokens written to KV
    blocks: list[int] = field(default_factory=list)
    first_token_ns: int | None = None
    preemptions: int = 0

    @property
    def known(self) -> int:
        return len(self.request.prompt) + len(self.output)

    def tokens(self, start: int, stop: int) -> tuple[int, ...]:
        prompt = self.request.prompt
        p = len(prompt)
        if stop <= p:
            return prompt[start:stop]
        if start >= p:  # a decode, or a recompute past the prompt
            return tuple(self.output[start - p : stop - p])
        return (*prompt[start:], *self.output[: stop - p])

    def key(self, policy: Policy) -> tuple[int, int]:
        return (self.request.priority if policy == "priority" else 0, self.order)


def _queue_by_key(waiting: list[_Seq], seq: _Seq, policy: Policy) -> None:
    """Insert ``seq`` into ``waiting``, kept in key order, after any of an equal key: a
    bisection, so a thousand submits read about ten keys each, not the whole queue."""
    bisect.insort(waiting, seq, key=lambda s: s.key(policy))


class _Blocks:
    """The pool's free list (a stack: the block freed last is reused first)."""

    def __init__(self, num_blocks: int) -> None:
        self.free = list(range(num_blocks - 1, -1, -1))

    def grow(self, seq: _Seq, tokens: int, block_size: int) -> bool:
        """Give ``seq`` the blocks for ``tokens`` in KV; False (nothing taken) if short."""
        missing = blocks_for(tokens, block_size) - len(seq.blocks)
        if missing > len(self.free):
            return False
        for _ in range(missing):
            seq.blocks.append(self.free.pop())
        return True

    def release(self, seq: _Seq) -> None:
        self.free.extend(reversed(seq.blocks))
        seq.blocks.clear()


def _kv_tokens(request: Request) -> int:
    """The most tokens ``request`` ever has in KV: its prompt and every output token but
    the last, which is sampled and never written."""
    return len(request.prompt) + request.max_new_tokens - 1


def _check_request(request: Request, seen: set[str], num_blocks: int, block_size: int) -> None:
    if not isinstance(request, Request):
        raise TypeError(f"request must be an api.Request, got {request!r}")
    if request.rid in seen:
        raise RequestRejected(f"request id {request.rid!r} was already submitted")
    tokens = _kv_tokens(request)
    worst = blocks_for(tokens, block_size)
    if worst > num_blocks:
        raise RequestRejected(
            f"request {request.rid!r} can never finish: its prompt ({len(request.prompt)}) "
            f"and max_new_tokens ({request.max_new_tokens}) put up to {tokens} tokens in "
            f"KV, {worst} blocks of {block_size}; the pool has {num_blocks}"
        )


def _check_pool(model: Model, num_blocks: int, block_size: int) -> None:
    if (model.num_blocks, model.block_size) != (num_blocks, block_size):
        raise ValueError(
            f"num_blocks={num_blocks} and block_size={block_size} must be the model's KV "
            f"pool ({model.num_blocks} blocks of {model.block_size})"
        )


def _check_config(
    model: Model,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    num_blocks: int,
    block_size: int,
    policy: Policy,
) -> tuple[int, int]:
    """A continuous batcher's settings, refused by name unless they make sense:
    ``(max_num_seqs, max_num_batched_tokens)``."""
    max_seqs = positive_int("max_num_seqs", max_num_seqs)
    budget = positive_int("max_num_batched_tokens", max_num_batched_tokens)
    if budget < max_seqs:  # a full batch of decodes must fit one step
        raise ValueError(
            f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= "
            f"max_num_seqs ({max_num_seqs}): otherwise running requests can starve"
        )
    positive_int("num_blocks", num_blocks)
    positive_int("block_size", block_size)
    _check_pool(model, num_blocks, block_size)
    if policy not in ("fcfs", "priority"):
        raise ValueError(f"policy must be 'fcfs' or 'priority', got {policy!r}")
    return max_seqs, budget


class _Batcher:
    """What both batchers share: the requests not finished, in a waiting and a running
    list; finishing, whatever the reason; the finished requests' metrics."""

    def __init__(self, model: Model) -> None:
        self._model = model
        self._num_blocks, self._block_size = model.num_blocks, model.block_size
        self._waiting: list[_Seq] = []
        self._running: list[_Seq] = []  # in admission order
        self._seqs: dict[str, _Seq] = {}  # every request not finished
        self._seen: set[str] = set()
        self._done: list[RequestMetrics] = []
        self._now = 0

    def _new(self, request: Request) -> _Seq:
        _check_request(request, self._seen, self._num_blocks, self._block_size)
        self._seen.add(request.rid)
        seq = self._seqs[request.rid] = _Seq(request, order=len(self._seen))
        return seq

    def abort(self, rid: str) -> None:
        """Finish ``rid`` now (reason ``abort``), whatever its state; nothing of it is
        emitted afterwards. A finished request: nothing to do; an unknown one: KeyError."""
        seq = self._seqs.get(rid)
        if seq is None:
            if rid in self._seen:
                return
            raise KeyError(f"no request {rid!r} was submitted")
        self._finish(seq, self._now, "abort")

    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    def metrics(self) -> list[RequestMetrics]:
        return list(self._done)

    def running(self) -> list[str]:
        return [s.request.rid for s in self._running]

    def _past_deadlines(self, now_ns: int) -> dict[str, FinishReason]:
        """Finish every request whose deadline ``now_ns`` has reached (before scheduling)."""
        self._now = now_ns
        finished: dict[str, FinishReason] = {}
        for seq in [*self._running, *self._waiting]:
            deadline = seq.request.deadline_ns
            if deadline is not None and now_ns >= deadline:
                self._finish(seq, now_ns, "deadline")
                finished[seq.request.rid] = "deadline"
        return finished

    def _sampled(self, seq: _Seq, token: int, now_ns: int) -> FinishReason | None:
        """Record ``token``, the request's next; why that ends it, if it does."""
        seq.output.append(token)
        if seq.first_token_ns is None:
            seq.first_token_ns = now_ns
        reason: FinishReason | None = None
        if token in seq.request.stop_tokens:
            reason = "stop"
        elif len(seq.output) >= seq.request.max_new_tokens:
            reason = "length"
        return reason

    def _finish(self, seq: _Seq, now_ns: int, reason: FinishReason) -> None:
        if seq in self._running:
            self._stop_running(seq)
        else:
            self._waiting.remove(seq)
        self._record(seq, now_ns, reason)

    def _stop_running(self, seq: _Seq) -> None:
        """Take a running request out, its KV freed."""
        raise NotImplementedError

    def _record(self, seq: _Seq, now_ns: int, reason: FinishReason) -> None:
        del self._seqs[seq.request.rid]
        r = seq.request
        self._done.append(
            RequestMetrics(
                r.rid, r.arrival_ns, seq.first_token_ns, now_ns, len(seq.output), reason,
                seq.preemptions,
            )
        )  # fmt: skip


class ContinuousBatcher(_Batcher):
    """Iteration-level scheduling with a token budget, chunked prefill and paged KV."""

    def __init__(
        self,
        model: Model,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        num_blocks: int,
        block_size: int,
        policy: Policy = "fcfs",
        hotpath: Hotpath = "python",
    ) -> None:
        self._max_seqs, self._budget = _check_config(
            model, max_num_seqs, max_num_batched_tokens, num_blocks, block_size, policy
        )
        if hotpath not in ("python", "c"):
            raise ValueError(f"hotpath must be 'python' or 'c', got {hotpath!r}")
        super().__init__(model)  # waiting: in admission order, the preempted first
        self._policy: Policy = policy
        self._rows = RunningRows(self._max_seqs, num_blocks, block_size, hotpath)

    # -- the interface ------------------------------------------------------------------
    def submit(self, request: Request) -> None:
        seq = self._new(request)
        self._rows.widen(blocks_for(_kv_tokens(seq.request), self._block_size))
        if self._policy == "priority":
            _queue_by_key(self._waiting, seq, self._policy)
        else:  # fcfs: behind every other, the preempted in front included
            self._waiting.append(seq)

    def step(self, now_ns: int) -> StepOutput:
        finished = self._past_deadlines(now_ns)
        seqs, tokens, preempted = self._schedule_running()
        if not preempted:
            seqs += self._admit(self._budget - tokens)
        scheduled, emitted = self._run(seqs, now_ns, finished)
        return StepOutput(now_ns, scheduled, emitted, finished, preempted)

    # -- one step -----------------------------------------------------------------------
    def _schedule_running(self) -> tuple[int, int, tuple[str, ...]]:
        """Moves 1 and 2; the rows scheduled are rows 0 .. seqs."""
        if self._policy == "priority":
            return self._schedule_by_priority()
        rows = self._rows
        seqs, tokens, count = rows.schedule(self._budget, self._max_seqs)
        if not count:
            return seqs, tokens, ()
        victims = self._running[rows.n :]  # the first preempted is the last of them
        del self._running[rows.n :]
        for seq in victims:
            seq.preemptions += 1
        self._waiting[0:0] = victims  # to the front, in admission order
        return seqs, tokens, tuple(v.request.rid for v in reversed(victims))

    def _schedule_by_priority(self) -> tuple[int, int, tuple[str, ...]]:
        """Moves 1 and 2 under ``priority``: the kernel's schedule when nobody runs short,
        else the least important give way, wherever they are, and queue by priority."""
        rows = self._rows
        plain = rows.schedule_unless_short(self._budget, self._max_seqs)
        if plain is not None:
            return (*plain, ())
        ranks = [seq.key(self._policy) for seq in self._running]
        seqs, tokens, gone = rows.schedule_by_rank(self._budget, self._max_seqs, ranks)
        victims = [self._running[row] for row in gone]
        dropped = set(gone)
        self._running = [seq for row, seq in enumerate(self._running) if row not in dropped]
        for seq in victims:
            seq.preemptions += 1
            _queue_by_key(self._waiting, seq, self._policy)  # not first
        return seqs, tokens, tuple(v.request.rid for v in victims)

    def _admit(self, budget: int) -> int:
        """Move 3, after a schedule of every running row: how many were admitted."""
        admitted = 0
        while self._waiting and budget > 0 and self._rows.n < self._max_seqs:
            seq = self._waiting[0]
            chunk = self._rows.admit(seq.known, budget)
            if not chunk:
                break  # no preemption to admit: the queue waits for blocks
            self._running.append(self._waiting.pop(0))
            budget -= chunk
            admitted += 1
        return admitted

    def _run(
        self, seqs: int, now_ns: int, finished: dict[str, FinishReason]
    ) -> tuple[dict[str, int], dict[str, tuple[int, ...]]]:
        """The forward pass over rows 0 .. seqs, then ``apply``: ``(scheduled, emitted)``."""
        rows, running = self._rows, self._running
        known, computed, chunk = rows.known, rows.computed, rows.chunk
        slices = []
        for i in range(seqs):
            seq, start = running[i], computed[i]
            stop = start + chunk[i]
            slices.append(
                SeqSlice(seq.request.rid, seq.tokens(start, stop), start, rows.blocks(i),
                         stop == known[i])
            )  # fmt: skip
        sampled = self._model.forward(slices) if slices else {}
        emitted: dict[str, tuple[int, ...]] = {}
        done: list[tuple[_Seq, FinishReason]] = []
        for i, piece in enumerate(slices):
            if not piece.last:
                continue
            token = sampled[piece.rid]
            if token is None:
                raise RuntimeError(f"the model sampled nothing for the last slice of {piece.rid}")
            emitted[piece.rid] = (token,)
            reason = self._sampled(running[i], token, now_ns)
            if reason is not None:
                rows.finished[i] = 1
                done.append((running[i], reason))
                finished[piece.rid] = reason
        rows.apply(seqs)
        if done:
            gone = {seq for seq, _ in done}
            self._running = [seq for seq in running if seq not in gone]
            for seq, reason in done:
                self._record(seq, now_ns, reason)
        return {p.rid: len(p.tokens) for p in slices}, emitted

    def _stop_running(self, seq: _Seq) -> None:
        row = self._running.index(seq)
        self._rows.release(row)
        del self._running[row]

    # -- for tests and reports ----------------------------------------------------------
    def free_blocks(self) -> int:
        return self._rows.free_top

    def blocks_of(self, rid: str) -> tuple[int, ...]:
        seq = self._seqs.get(rid)
        if seq is None or seq not in self._running:
            return ()
        return self._rows.blocks(self._running.index(seq))

    def waiting(self) -> list[str]:
        return [s.request.rid for s in self._waiting]


class StaticBatcher(_Batcher):
    """The baseline: a batch of up to ``batch_size`` is admitted only when the last one
    has finished, with the KV for each request's longest possible output reserved up
    front; slots of requests that finish early stay empty until the whole batch is done."""

    def __init__(self, model: Model, *, batch_size: int) -> None:
        self._batch_size = positive_int("batch_size", batch_size)
        super().__init__(model)
        self._pool = _Blocks(model.num_blocks)

    def submit(self, request: Request) -> None:
        self._waiting.append(self._new(request))

    def step(self, now_ns: int) -> StepOutput:
        finished = self._past_deadlines(now_ns)
        if not self._running:
            self._form_batch()
        slices = [
            SeqSlice(s.request.rid, s.tokens(s.computed, s.known), s.computed, tuple(s.blocks))
            for s in self._running
        ]
        sampled = self._model.forward(slices) if slices else {}
        emitted: dict[str, tuple[int, ...]] = {}
        for seq in list(self._running):
            rid = seq.request.rid
            seq.computed = seq.known
            token = sampled[rid]
            assert token is not None
            emitted[rid] = (token,)
            reason = self._sampled(seq, token, now_ns)
            if reason is not None:
                self._finish(seq, now_ns, reason)
                finished[rid] = reason
        scheduled = {s.rid: len(s.tokens) for s in slices}
        return StepOutput(now_ns, scheduled, emitted, finished)

    def _form_batch(self) -> None:
        while self._waiting and len(self._running) < self._batch_size:
            seq = self._waiting[0]
            if not self._pool.grow(seq, _kv_tokens(seq.request), self._block_size):
                break  # its worst case does not fit next to the batch's: next batch
            self._running.append(self._waiting.pop(0))

    def _stop_running(self, seq: _Seq) -> None:
        self._running.remove(seq)
        self._pool.release(seq)


__all__ = ["ContinuousBatcher", "StaticBatcher", "fill_token_budget"]
