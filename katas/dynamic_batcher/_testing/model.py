"""The simulated model: a KV pool the batcher writes through block tables, a next token
computed from what is read back from that pool, and a cost model standing in for GPU time.

:class:`FakeModel` is what a batcher drives (it implements ``api.Model``). Each
``forward`` first checks every slice (block ids in the pool, a block table long enough
for the positions written, no block in two requests' tables at once), then writes each
slice's tokens into its blocks, then — for every ``last`` slice — reads positions
``0 .. end`` back *from the blocks* and hashes them into the next token. The slice's
own tokens never reach the hash directly, so a wrong block table, a block freed and
reused while still in use, KV kept (not recomputed) after a preemption, or a
``start_pos`` off by one all change what the request generates.

The hash is the chain prefix caches use (vLLM's block hash): each full block hashes
``(hash of the blocks before it, its tokens)``, then the partial last block's tokens
and the length are folded in, mixed with the seed, mod ``vocab_size``. A full block's
hash is cached under its block id and write count (and the chain hash it extended), so
a decode hashes no full block again: one cache probe per full block and at most
``block_size - 1`` tail tokens per read. The chain ignores *which* physical blocks hold
the tokens, so every correct batcher — any block layout, any chunking, any batch
mates — produces exactly :func:`reference_generation`'s tokens.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import cast

from katas._runtime.clock import NS_PER_MS, NS_PER_US
from katas.dynamic_batcher.api import Request, SeqSlice, StepOutput

# -- the cost model: a stand-in for GPU time -------------------------------------------
#: Every step pays a launch-and-sync overhead, however little it computes.
STEP_OVERHEAD_NS = 5 * NS_PER_MS
#: Each prompt (or recomputed) token a step computes: prefill is compute-bound.
PREFILL_TOKEN_NS = 100 * NS_PER_US
#: Each sequence a step decodes (one token each): decode is bound by reading its KV.
DECODE_SEQ_NS = 50 * NS_PER_US


def step_cost_ns(prefill_tokens: int, decode_seqs: int) -> int:
    """Simulated duration of one model step: ``STEP_OVERHEAD_NS`` (5 ms) +
    ``PREFILL_TOKEN_NS`` (0.1 ms) per prefill token + ``DECODE_SEQ_NS`` (0.05 ms) per
    decoding sequence. Round numbers of a plausible shape, not a measured GPU."""
    if prefill_tokens < 0 or decode_seqs < 0:
        raise ValueError(f"negative work: {prefill_tokens=}, {decode_seqs=}")
    return STEP_OVERHEAD_NS + prefill_tokens * PREFILL_TOKEN_NS + decode_seqs * DECODE_SEQ_NS


def work_of(out: StepOutput) -> tuple[int, int]:
    """``(prefill_tokens, decode_seqs)`` of one step: a request that computed exactly one
    token *and* emitted one is a decode; every token of any other scheduled request (a
    prompt chunk, the last chunk, a recompute) is a prefill token."""
    prefill = decodes = 0
    for rid, n in out.scheduled.items():
        if n == 1 and out.tokens.get(rid):
            decodes += 1
        elif n > 0:
            prefill += n
    return prefill, decodes


def step_time_ns(out: StepOutput) -> int:
    """The simulated duration of the step that produced ``out`` (:func:`step_cost_ns`)."""
    return step_cost_ns(*work_of(out))


# -- hashing ----------------------------------------------------------------------------
_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_BLOCK_TAG = 0xB10C
_FNV_PRIME = 0x100000001B3


def _where(rid: str) -> str:
    """How a failure message names the request at fault (built only to raise)."""
    return f"FakeModel.forward: request {rid!r}"


def _mix(x: int) -> int:
    """splitmix64's finaliser: a cheap, well-spread 64-bit hash of an int (explicit, so
    outputs do not depend on Python's ``hash``)."""
    x &= _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def _fold(h: int, tokens: Iterable[int]) -> int:
    """Fold tokens into ``h``, FNV-1a style: each step is a bijection of ``h`` (and of the
    token), so changing any one token always changes the result; ``_mix`` spreads it."""
    for t in tokens:
        h = ((h ^ (t & _MASK)) * _FNV_PRIME) & _MASK
    return h


@dataclass(frozen=True)
class ForwardRecord:
    """What one ``forward`` call computed, in the cost model's terms: a one-token slice
    that samples is a decode; every token of any other slice is a prefill token."""

    rids: tuple[str, ...]
    prefill_tokens: int
    decode_seqs: int
    sampled: int  # slices that returned a token (``last``)


class FakeModel:
    """A deterministic stand-in for an LLM on a GPU: it owns the paged KV pool."""

    def __init__(
        self,
        vocab_size: int,
        seed: int,
        num_blocks: int,
        block_size: int,
        *,
        shared_reads: bool = False,
    ) -> None:
        """``shared_reads=True`` lets requests share blocks they only read (prefix
        caching); a block written in a step must still be in no other request's table."""
        for name, value in (
            ("vocab_size", vocab_size),
            ("num_blocks", num_blocks),
            ("block_size", block_size),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"FakeModel: {name} must be an int >= 1, got {value!r}")
        self.vocab_size = vocab_size
        self.seed = seed
        self.shared_reads = shared_reads
        self._num_blocks = num_blocks
        self._block_size = block_size
        self._root = _mix(seed ^ _GOLDEN)
        self._slots: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self._writes = [0] * num_blocks
        # block -> (write count, chain hash it extended, its chain hash)
        self._chain: dict[int, tuple[int, int, int]] = {}
        self._checked_tables: dict[str, tuple[int, ...]] = {}  # rid -> its last good table
        #: One record per ``forward`` call, in order.
        self.steps: list[ForwardRecord] = []
        #: Full blocks hashed (chain-cache misses): once per block filled, not per read.
        self.hashed_blocks = 0
        self._prefill_tokens = 0
        self._decode_seqs = 0

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def forward_calls(self) -> int:
        return len(self.steps)

    @property
    def prefill_tokens(self) -> int:
        """Prefill tokens computed over all calls (see :class:`ForwardRecord`)."""
        return self._prefill_tokens

    @property
    def decode_seqs(self) -> int:
        """Decodes computed over all calls."""
        return self._decode_seqs

    def block_tokens(self, block: int) -> tuple[int | None, ...]:
        """The token in each slot of ``block`` (None: never written)."""
        return tuple(self._slots[block])

    def writes(self, block: int) -> int:
        """How many token writes ``block`` has taken."""
        return self._writes[block]

    def forward(self, slices: Sequence[SeqSlice]) -> dict[str, int | None]:
        """Check every slice, write all of them, then sample each ``last`` one (None for
        a chunk that is not last). A rejected call writes nothing."""
        slices = list(slices)
        self._check(slices)
        bs, slots, writes = self._block_size, self._slots, self._writes
        for s in slices:
            for pos, token in enumerate(s.tokens, s.start_pos):
                block = s.block_table[pos // bs]
                slots[block][pos % bs] = token
                writes[block] += 1
        out: dict[str, int | None] = {}
        prefill = decodes = sampled = 0
        for s in slices:
            if s.last:
                out[s.rid] = self._read_next(s.rid, s.start_pos + len(s.tokens), s.block_table)
                sampled += 1
            else:
                out[s.rid] = None
            if s.last and len(s.tokens) == 1:
                decodes += 1
            else:
                prefill += len(s.tokens)
        self.steps.append(ForwardRecord(tuple(out), prefill, decodes, sampled))
        self._prefill_tokens += prefill
        self._decode_seqs += decodes
        return out

    # -- internals ------------------------------------------------------------------------
    def _check(self, slices: list[SeqSlice]) -> None:
        bs = self._block_size
        seen: set[str] = set()
        in_tables = 0
        union: set[int] = set()
        for s in slices:
            rid = s.rid
            if rid in seen:
                raise AssertionError(f"{_where(rid)} has two slices in one step (one per request)")
            seen.add(rid)
            if not s.tokens:
                raise AssertionError(
                    f"{_where(rid)}: an empty slice (a scheduled request computes >= 1)"
                )
            for t in s.tokens:
                if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                    raise AssertionError(f"{_where(rid)}: tokens must be ints >= 0, got {t!r}")
            if isinstance(s.start_pos, bool) or not isinstance(s.start_pos, int):
                raise AssertionError(
                    f"{_where(rid)}: start_pos must be an int, got {s.start_pos!r}"
                )
            if s.start_pos < 0:
                raise AssertionError(f"{_where(rid)}: start_pos {s.start_pos} < 0")
            end = s.start_pos + len(s.tokens)  # positions start_pos .. end - 1 are written
            table = s.block_table
            need = -(-end // bs)
            if len(table) < need:
                raise AssertionError(
                    f"{_where(rid)} writes positions {s.start_pos}..{end - 1}, but its block table "
                    f"{tuple(table)} ({len(table)} blocks of {bs}) covers positions "
                    f"0..{len(table) * bs - 1}: position {len(table) * bs} has no block "
                    f"(with {end} tokens in KV it needs ceil({end} / {bs}) = {need} blocks)"
                )
            # A request's table rarely changes between steps: check it entry by entry
            # only when it did (the cross-request check below runs every step).
            if self._checked_tables.get(rid) != table:
                self._check_table(_where(rid), table)
                self._checked_tables[rid] = tuple(table)
            in_tables += len(table)
            union.update(table)
        if len(union) != in_tables:  # some block is in two tables: find it, say who
            self._check_sharing(slices)

    def _check_table(self, where: str, table: Sequence[int]) -> None:
        bs, n = self._block_size, self._num_blocks
        first_index: dict[int, int] = {}
        for i, block in enumerate(table):
            span = f"block_table[{i}] = {block!r} (positions {i * bs}..{(i + 1) * bs - 1})"
            if isinstance(block, bool) or not isinstance(block, int) or not 0 <= block < n:
                raise AssertionError(f"{where}: {span} is not a block of the pool (0..{n - 1})")
            if block in first_index:
                j = first_index[block]
                raise AssertionError(
                    f"{where}: block {block} is in its block table twice, at indexes {j} and "
                    f"{i}: positions {j * bs} and {i * bs} would share a slot"
                )
            first_index[block] = i

    def _check_sharing(self, slices: list[SeqSlice]) -> None:
        """Fail on a block in two requests' tables — unless ``shared_reads`` and no
        request writes it this step."""
        bs = self._block_size
        holders: dict[int, list[tuple[str, int]]] = {}  # block -> (rid, table index)
        written: dict[int, tuple[str, int]] = {}
        for s in slices:
            for i, block in enumerate(s.block_table):
                holders.setdefault(block, []).append((s.rid, i))
            end = s.start_pos + len(s.tokens)
            for i in range(s.start_pos // bs, -(-end // bs)):
                written[s.block_table[i]] = (s.rid, i)
        for block, held in holders.items():
            if len(held) < 2:
                continue
            if self.shared_reads:
                if block not in written:
                    continue  # a shared prefix block, read by all and written by none
                writer = written[block]
                pair = [writer, next(h for h in held if h[0] != writer[0])]
            else:
                pair = held[:2]
            (a, ai), (b, bi) = pair
            raise AssertionError(
                f"FakeModel.forward: block {block} is owned by two requests in one step — "
                f"{a!r} (its positions {ai * bs}..{(ai + 1) * bs - 1}) and {b!r} (its "
                f"positions {bi * bs}..{(bi + 1) * bs - 1}): a block freed while still in a "
                "table, or handed out twice"
            )

    def _read_next(self, rid: str, end: int, table: Sequence[int]) -> int:
        """The next token after positions ``0 .. end - 1``, read back from ``table``."""
        bs, slots, writes, chain = self._block_size, self._slots, self._writes, self._chain
        h = self._root
        for i in range(end // bs):
            block = table[i]
            cached = chain.get(block)
            if cached is not None and cached[0] == writes[block] and cached[1] == h:
                h = cached[2]
                continue
            tokens = self._written(rid, i, block, slots[block])
            nxt = _mix(_fold(h ^ _BLOCK_TAG, tokens))
            chain[block] = (writes[block], h, nxt)
            self.hashed_blocks += 1
            h = nxt
        tail_len = end % bs
        if tail_len:
            i = end // bs
            h = _fold(h, self._written(rid, i, table[i], slots[table[i]][:tail_len]))
        return _mix(h ^ end) % self.vocab_size

    def _written(self, rid: str, index: int, block: int, tokens: list[int | None]) -> list[int]:
        """``tokens`` (slots of ``table[index]``, from slot 0), each of them written."""
        if None not in tokens:
            return cast("list[int]", tokens)
        slot = tokens.index(None)
        pos = index * self._block_size + slot
        raise AssertionError(
            f"FakeModel.forward: request {rid!r} reads position {pos} (block {block}, slot "
            f"{slot}), which nothing ever wrote: its KV there was never computed (after a "
            "preemption, recompute from position 0 — prompt and generated tokens — into "
            "the new blocks)"
        )


def reference_generation(
    prompt: Sequence[int],
    max_new_tokens: int,
    stop_tokens: Iterable[int] = (),
    *,
    vocab_size: int,
    seed: int,
    block_size: int,
) -> tuple[int, ...]:
    """The tokens one request generates alone — a fresh model, the whole prompt in one
    slice, then one token per step — ending at ``max_new_tokens`` or with (and including)
    the first stop token. The oracle for batching transparency: a batcher over a
    ``FakeModel(vocab_size, seed, …, block_size)`` must emit exactly these."""
    prompt = tuple(prompt)
    stops = frozenset(stop_tokens)
    blocks = -(-(len(prompt) + max_new_tokens) // block_size)
    model = FakeModel(vocab_size, seed, blocks, block_size)
    table = tuple(range(blocks))
    rid = "reference"
    out: list[int] = []
    piece, start = prompt, 0
    while True:
        token = model.forward([SeqSlice(rid, piece, start, table)])[rid]
        assert token is not None
        out.append(token)
        if token in stops or len(out) >= max_new_tokens:
            return tuple(out)
        start += len(piece)
        piece = (token,)


def reference_outputs(requests: Iterable[Request], like: FakeModel) -> dict[str, tuple[int, ...]]:
    """:func:`reference_generation` of each request, for a batcher driving ``like``."""
    return {
        r.rid: reference_generation(
            r.prompt,
            r.max_new_tokens,
            r.stop_tokens,
            vocab_size=like.vocab_size,
            seed=like.seed,
            block_size=like.block_size,
        )
        for r in requests
    }


__all__ = [
    "DECODE_SEQ_NS",
    "PREFILL_TOKEN_NS",
    "STEP_OVERHEAD_NS",
    "FakeModel",
    "ForwardRecord",
    "reference_generation",
    "reference_outputs",
    "step_cost_ns",
    "step_time_ns",
    "work_of",
]
