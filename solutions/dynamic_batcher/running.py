"""The running requests' KV bookkeeping as int32 columns (csrc/hotpath.h's ``hp_state``),
and the two kernels a step runs over them, ``schedule`` and ``apply``: in C (the kata's
``_hotpath``) or in their Python twin, the same algorithm over the same columns.

Row ``i`` is the ``i``-th running request in admission order. The columns *are* the
state, kept from step to step: a call into C passes pointers, never builds a column.

The kernels' victim is positional, the last row: the ``fcfs`` rule. The ``priority``
rule's victim is the least important running request, found by a search, so a step that
runs short under it is scheduled by :meth:`RunningRows.schedule_by_rank`, plain Python
shared by both paths (a shortage is rare, and costs a recompute anyway).
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from typing import Literal, Protocol

Hotpath = Literal["python", "c"]


def _zeros(n: int) -> array.array[int]:
    return array.array("i", bytes(4 * n))


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)  # ceil: a partly filled block is a whole block


class RunningRows:
    """``hp_state``: per row ``known`` (tokens the request knows), ``computed`` (tokens in
    its KV), ``held`` (its blocks, ``ceil(computed / block_size)``) and a block table of
    ``stride`` entries a row; the free-block stack; and the step's ``chunk`` and
    ``finished`` columns."""

    def __init__(self, capacity: int, num_blocks: int, block_size: int, hotpath: Hotpath) -> None:
        self.rows, self.block_size, self.stride, self.n = capacity, block_size, 1, 0
        self.known, self.computed, self.held = _zeros(capacity), _zeros(capacity), _zeros(capacity)
        self.chunk, self.finished = _zeros(capacity), _zeros(capacity)
        self.zero_column = _zeros(capacity)  # clears a column with one slice copy
        self.table = _zeros(capacity)
        # Block 0 on top, so a fresh pool hands out 0, 1, 2, ...
        self.free_ids = array.array("i", range(num_blocks - 1, -1, -1))
        self.free_top = num_blocks
        self._kernels: Kernels = _C() if hotpath == "c" else _Python()

    # -- the step ---------------------------------------------------------------------
    def schedule(self, token_budget: int, max_seqs: int) -> tuple[int, int, int]:
        """``hp_schedule``: ``(rows scheduled, tokens, rows preempted)``; the preempted are
        rows ``n .. n + preempted`` afterwards, the first preempted last."""
        return self._kernels.schedule(self, token_budget, max_seqs)

    def schedule_unless_short(self, token_budget: int, max_seqs: int) -> tuple[int, int] | None:
        """``schedule`` when the free stack covers every grant: ``(rows scheduled, tokens)``.
        When it does not, the kernel would preempt the newest row: the state is put back as
        it was, and None says so. Only the rows in use are saved, a copy in C each."""
        n, top = self.n, self.free_top
        held, computed, free = self.held[:n], self.computed[:n], self.free_ids[:top]
        seqs, tokens, preempted = self._kernels.schedule(self, token_budget, max_seqs)
        if not preempted:
            return seqs, tokens
        # The kernel wrote n, free_top, held, the victims' computed, the stack above its
        # old top and table entries past a row's old held, which nothing reads.
        self.n, self.free_top = n, top
        self.held[:n], self.computed[:n], self.free_ids[:top] = held, computed, free
        return None

    def schedule_by_rank(
        self, token_budget: int, max_seqs: int, rank: Sequence[tuple[int, int]]
    ) -> tuple[int, int, list[int]]:
        """The kernel's budget and blocks, row by row, but out of blocks the running row of
        the largest ``rank[row]`` gives way, wherever it is (vLLM's priority policy). A
        victim already scheduled in this step takes its blocks back to the stack and its
        chunk back to the budget, for the rows after. ``(rows scheduled, tokens, the
        victims' rows before the call, in preemption order)``; the rows left keep their
        order, so the scheduled ones are rows 0 .. seqs again."""
        known, computed, held, table = self.known, self.computed, self.held, self.table
        free, stride, bs, top = self.free_ids, self.stride, self.block_size, self.free_top
        alive = list(range(self.n))  # the rows still running, in order
        granted: dict[int, int] = {}  # row -> chunk: alive[:k], the rows scheduled so far
        victims: list[int] = []
        left, k = token_budget, 0
        while k < len(alive) and k < max_seqs and left > 0:
            i = alive[k]
            want = known[i] - computed[i]
            take = want if want < left else left
            missing = blocks_for(computed[i] + take, bs) - held[i]
            own = False
            while missing > top and not own:
                victim = max(alive, key=rank.__getitem__)  # the least important
                alive.remove(victim)
                victims.append(victim)
                base = victim * stride
                for b in range(held[victim] - 1, -1, -1):  # last block first
                    free[top] = table[base + b]
                    top += 1
                held[victim] = computed[victim] = 0
                if victim in granted:  # scheduled before row i: no longer
                    left += granted.pop(victim)
                    k -= 1
                own = victim == i
            if own:  # it was its own victim: scheduling ends with it
                break
            base = i * stride
            for _ in range(missing):
                top -= 1
                table[base + held[i]] = free[top]
                held[i] += 1
            granted[i] = take
            left -= take
            k += 1
        chunk = self.chunk
        for j, i in enumerate(alive):  # close ranks in order: a row only moves down
            if j != i:
                known[j], computed[j], held[j] = known[i], computed[i], held[i]
                table[j * stride : j * stride + held[i]] = table[i * stride : i * stride + held[i]]
            chunk[j] = granted.get(i, 0)
        chunk[len(alive) :] = self.zero_column[len(alive) :]
        self.n, self.free_top = len(alive), top
        return k, token_budget - left, victims

    def admit(self, known: int, token_budget: int) -> int:
        """Append a request that knows ``known`` tokens and has none in KV, granted
        ``min(known, token_budget)`` and their blocks; 0 (nothing changed) when the free
        stack is short. Only right after a ``schedule`` that scheduled every row."""
        chunk = min(known, token_budget)
        need = blocks_for(chunk, self.block_size)
        if need > self.free_top:
            return 0
        i, base = self.n, self.n * self.stride
        for k in range(need):
            self.free_top -= 1
            self.table[base + k] = self.free_ids[self.free_top]
        self.known[i], self.computed[i], self.held[i], self.chunk[i] = known, 0, need, chunk
        self.n += 1
        return chunk

    def apply(self, seqs: int) -> None:
        """``hp_apply`` with the rows flagged in ``finished``, whose flags are then cleared."""
        n = self.n
        self._kernels.apply(self, seqs)
        self.finished[:n] = self.zero_column[:n]

    def release(self, row: int) -> None:
        """Finish one row now (an abort, a deadline): its blocks back, the rest move down."""
        self.finished[row] = 1
        self.apply(0)

    # -- what the batcher reads -------------------------------------------------------
    def blocks(self, row: int) -> tuple[int, ...]:
        base = row * self.stride
        return tuple(self.table[base : base + self.held[row]])

    def widen(self, stride: int) -> None:
        """Give every table row room for ``stride`` blocks (a request's worst case)."""
        if stride <= self.stride:
            return
        table = _zeros(self.rows * stride)
        for i in range(self.n):
            held, old = self.held[i], i * self.stride
            table[i * stride : i * stride + held] = self.table[old : old + held]
        self.table, self.stride = table, stride


class Kernels(Protocol):
    def schedule(
        self, r: RunningRows, token_budget: int, max_seqs: int
    ) -> tuple[int, int, int]: ...
    def apply(self, r: RunningRows, seqs: int) -> None: ...


class _C:
    def __init__(self) -> None:
        from . import _hotpath  # built on first import (katas/_runtime/native.py)

        self._hot = _hotpath

    def schedule(self, r: RunningRows, token_budget: int, max_seqs: int) -> tuple[int, int, int]:
        seqs, tokens, preempted, r.n, r.free_top = self._hot.schedule(
            r.known, r.computed, r.held, r.table, r.free_ids, r.chunk, n=r.n,
            free_top=r.free_top, stride=r.stride, block_size=r.block_size,
            token_budget=token_budget, max_seqs=max_seqs,
        )  # fmt: skip
        return seqs, tokens, preempted

    def apply(self, r: RunningRows, seqs: int) -> None:
        r.n, r.free_top = self._hot.apply(
            r.known, r.computed, r.held, r.table, r.free_ids, r.chunk, r.finished, n=r.n,
            free_top=r.free_top, stride=r.stride, block_size=r.block_size, seqs=seqs,
        )  # fmt: skip


class _Python:
    """The twin: hotpath.c's loops, line for line, over the same columns."""

    def schedule(self, r: RunningRows, token_budget: int, max_seqs: int) -> tuple[int, int, int]:
        known, computed, held, table, free = r.known, r.computed, r.held, r.table, r.free_ids
        chunk, bs, stride = r.chunk, r.block_size, r.stride
        left, seqs, preempted, n, top = token_budget, 0, 0, r.n, r.free_top
        while seqs < n and seqs < max_seqs and left > 0:
            i = seqs
            want = known[i] - computed[i]
            granted = want if want < left else left
            missing = -(-(computed[i] + granted) // bs) - held[i]
            while missing > top:
                n -= 1  # the most recently admitted gives its blocks
                base = n * stride
                for k in range(held[n] - 1, -1, -1):  # last block first
                    free[top] = table[base + k]
                    top += 1
                held[n] = computed[n] = 0  # recompute: the KV is gone
                preempted += 1
                if n == i:
                    break
            if n == i:  # it was its own victim: scheduling ends with it
                break
            base = i * stride
            for _ in range(missing):
                top -= 1
                table[base + held[i]] = free[top]
                held[i] += 1
            chunk[i] = granted
            left -= granted
            seqs += 1
        chunk[seqs:] = r.zero_column[seqs:]
        r.n, r.free_top = n, top
        return seqs, token_budget - left, preempted

    def apply(self, r: RunningRows, seqs: int) -> None:
        known, computed, held, table, free = r.known, r.computed, r.held, r.table, r.free_ids
        chunk, finished, stride, top = r.chunk, r.finished, r.stride, r.free_top
        for i in range(seqs):
            computed[i] += chunk[i]
            if computed[i] == known[i] and not finished[i]:
                known[i] += 1  # it sampled the token after the known ones, and goes on
        # One pass: a finished row's blocks go back in row order, and a kept row moves down
        # only over rows already passed, so no row is overwritten before it is read.
        kept = 0
        for i in range(r.n):
            if finished[i]:
                base = i * stride
                for k in range(held[i] - 1, -1, -1):
                    free[top] = table[base + k]
                    top += 1
                continue
            if kept != i:
                known[kept], computed[kept], held[kept] = known[i], computed[i], held[i]
                dst, src = kept * stride, i * stride
                table[dst : dst + held[i]] = table[src : src + held[i]]
            kept += 1
        r.n, r.free_top = kept, top
