"""Stage 1 — continuous batching over paged KV blocks.

The prompt is katas/dynamic_batcher/README.md; run the suite with
``pytest katas/dynamic_batcher -k "not hotpath"`` (``-k "core and not hotpath"`` for
the core; the C hot path is ``-k hotpath``).

Rules (the suite checks each one):

- Each ``step(now_ns)`` schedules running requests first, in admission order under
  either policy (a decode needs 1 token, a prefill the rest of its prompt), then fills
  what is left of the token budget with waiting requests' prompt chunks, in policy order.
- Every step: scheduled tokens <= max_num_batched_tokens, running <= max_num_seqs.
- A request holds exactly ceil(tokens in KV / block_size) blocks; blocks are conserved.
- Out of blocks, a running request is preempted (its blocks freed, recomputed later):
  ``fcfs``, the most recently admitted, to the front of the queue; ``priority``, the
  least important by (priority, submission), even one already scheduled in this step
  (its chunk's tokens go back to the budget), back into the queue by its priority.
  Admit nothing in a step that preempted.
- A request finishes on a stop token, max_new_tokens or its deadline; abort() frees it.
- submit() rejects a duplicate id and a request that could never finish: one whose
  prompt + max_new_tokens - 1 tokens (the newest token is never in KV) need more blocks
  than the pool has (RequestRejected).
"""

from __future__ import annotations

# TODO(stage1): implement every function and method below; delete each `raise Todo()`
# as you go.
from collections.abc import Sequence
from typing import Literal

from katas._runtime.todo import Todo
from katas.dynamic_batcher.api import (
    Model,
    Policy,
    Request,
    RequestMetrics,
    RequestRejected,
    StepOutput,
)

Hotpath = Literal["python", "c"]

__all__ = ["ContinuousBatcher", "RequestRejected", "StaticBatcher", "fill_token_budget"]


def fill_token_budget(
    need: Sequence[int], token_budget: int, max_seqs: int
) -> tuple[list[int], int, int]:
    """The hot path, in Python (csrc/hotpath.h's ``hp_fill_token_budget``): each request
    in order gets ``min(need[i], budget left)``; stop at the first that would get nothing
    or after ``max_seqs``. Returns ``(chunks, requests scheduled, tokens scheduled)``."""
    raise Todo()


class ContinuousBatcher:
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
        """``num_blocks``/``block_size`` must be the model's pool; ints >= 1, and
        ``max_num_batched_tokens >= max_num_seqs`` (ValueError naming them).
        ``hotpath="c"`` schedules with this kata's C module (``from . import _hotpath``)."""
        raise Todo()

    def submit(self, request: Request) -> None:
        """Queue ``request``: ``fcfs``, behind every waiting request; ``priority``, by
        ``(priority, submission)``. RequestRejected for an id already submitted, and for
        one whose ``ceil((len(prompt) + max_new_tokens - 1) / block_size)`` exceeds
        ``num_blocks``: its newest token is never written to KV, so that is the most KV
        it ever holds, and more than the pool means it could never finish."""
        raise Todo()

    def step(self, now_ns: int) -> StepOutput:
        """One forward pass: deadlines, the running requests in admission order (blocks,
        and preemption when the pool runs dry), then admissions unless it preempted."""
        raise Todo()

    def abort(self, rid: str) -> None:
        """Finish ``rid`` now (reason ``abort``) in any state; a finished one: nothing to
        do; an unknown one: KeyError."""
        raise Todo()

    def has_unfinished(self) -> bool:
        raise Todo()

    def metrics(self) -> list[RequestMetrics]:
        """The finished requests' metrics, in the order they finished."""
        raise Todo()

    # -- what the tests read ---------------------------------------------------------------
    def free_blocks(self) -> int:
        raise Todo()

    def blocks_of(self, rid: str) -> tuple[int, ...]:
        """The blocks ``rid`` holds (``()`` if none, or finished)."""
        raise Todo()

    def running(self) -> list[str]:
        """The running requests, in admission order."""
        raise Todo()

    def waiting(self) -> list[str]:
        """The waiting requests, in the order they will be admitted."""
        raise Todo()


class StaticBatcher:
    """The baseline: admits a batch of up to ``batch_size`` only when the last batch has
    finished, reserving KV for each request's longest output up front (its prompt +
    ``max_new_tokens`` - 1 tokens: the last token is never written)."""

    def __init__(self, model: Model, *, batch_size: int) -> None:
        raise Todo()

    def submit(self, request: Request) -> None:
        raise Todo()

    def step(self, now_ns: int) -> StepOutput:
        raise Todo()

    def abort(self, rid: str) -> None:
        raise Todo()

    def has_unfinished(self) -> bool:
        raise Todo()

    def metrics(self) -> list[RequestMetrics]:
        raise Todo()

    def running(self) -> list[str]:
        raise Todo()
