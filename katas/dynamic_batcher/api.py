"""The dynamic-batcher contract: types shared by stubs, solutions and tests. Do not edit.

A batcher turns :class:`Request` objects into model steps. The model (the harness's
``FakeModel``, a stand-in for a GPU) owns the KV cache: a pool of ``num_blocks`` blocks
of ``block_size`` token slots each. Each step the batcher hands it one
:class:`SeqSlice` per scheduled request — the tokens to compute now, where they start,
and the request's block table — and gets back the next token of every request whose
known tokens are all computed. What one step did is a :class:`StepOutput`; what a
request lived through is its :class:`RequestMetrics`.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple, Protocol

#: Why a request finished: a stop token, ``max_new_tokens``, its deadline, ``abort()``.
FinishReason = Literal["stop", "length", "deadline", "abort"]
#: The order waiting requests are admitted in.
Policy = Literal["fcfs", "priority"]


class RequestRejected(ValueError):
    """``submit`` refuses a request: a duplicate id, or one that could never finish
    (its prompt and ``max_new_tokens`` need more KV blocks than the pool has)."""


@dataclass(frozen=True)
class Request:
    """One generation request. ``prompt`` is token ids (ints >= 0, at least one);
    ``priority``: smaller runs first under the ``priority`` policy (ties by arrival);
    ``deadline_ns``: the request finishes with reason ``deadline`` at the first step whose
    ``now_ns`` is at or past it."""

    rid: str
    prompt: tuple[int, ...]
    max_new_tokens: int
    stop_tokens: Collection[int] = frozenset()  # held as a frozenset
    priority: int = 0
    arrival_ns: int = 0
    deadline_ns: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.rid, str) or not self.rid:
            raise ValueError(f"rid must be a non-empty str, got {self.rid!r}")
        prompt = tuple(self.prompt)
        if not prompt or not all(isinstance(t, int) and t >= 0 for t in prompt):
            raise ValueError(f"prompt must be one or more token ids >= 0, got {self.prompt!r}")
        object.__setattr__(self, "prompt", prompt)
        object.__setattr__(self, "stop_tokens", frozenset(self.stop_tokens))
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int):
            raise TypeError(f"max_new_tokens must be an int, got {self.max_new_tokens!r}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


class SeqSlice(NamedTuple):
    """What one step computes for one request: ``tokens`` written to the request's KV at
    positions ``start_pos``, ``start_pos + 1``, …, through ``block_table`` (position p
    lives in block ``block_table[p // block_size]``, slot ``p % block_size``). ``last``:
    the slice ends at the request's last known token, so the model samples the next one
    (False for a prefill chunk that is not the prompt's last)."""

    rid: str
    tokens: tuple[int, ...]
    start_pos: int
    block_table: tuple[int, ...]
    last: bool = True


class Model(Protocol):
    """What a batcher drives (the harness's ``FakeModel`` implements it)."""

    @property
    def num_blocks(self) -> int: ...

    @property
    def block_size(self) -> int: ...

    def forward(self, slices: Sequence[SeqSlice]) -> dict[str, int | None]:
        """Compute every slice; for each, the next token if it is ``last``, else None."""
        ...


@dataclass(frozen=True)
class StepOutput:
    """What one ``step()`` did.

    ``scheduled``: tokens computed per request, in scheduling order; ``tokens``: the
    output tokens emitted (streamed) per request; ``finished``: requests that finished,
    with why; ``preempted``: requests preempted (their KV freed, to be recomputed).
    """

    now_ns: int
    scheduled: Mapping[str, int] = field(default_factory=dict)
    tokens: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    finished: Mapping[str, FinishReason] = field(default_factory=dict)
    preempted: tuple[str, ...] = ()

    @property
    def scheduled_tokens(self) -> int:
        return sum(self.scheduled.values())


@dataclass(frozen=True)
class RequestMetrics:
    """One finished request, in the times of the steps that served it."""

    rid: str
    arrival_ns: int
    first_token_ns: int | None  # the step that emitted its first token (None: none)
    finish_ns: int
    output_tokens: int
    finish_reason: FinishReason
    preemptions: int

    @property
    def ttft_ns(self) -> int | None:
        """Time to first token: first token − arrival."""
        return None if self.first_token_ns is None else self.first_token_ns - self.arrival_ns

    @property
    def tpot_ns(self) -> float | None:
        """Time per output token after the first: (finish − first) / (tokens − 1)."""
        if self.first_token_ns is None or self.output_tokens < 2:
            return None
        return (self.finish_ns - self.first_token_ns) / (self.output_tokens - 1)


class Batcher(Protocol):
    """What ``simulate()`` drives: ``ContinuousBatcher`` and ``StaticBatcher`` both."""

    def submit(self, request: Request) -> None: ...

    def step(self, now_ns: int) -> StepOutput: ...

    def abort(self, rid: str) -> None: ...

    def has_unfinished(self) -> bool: ...

    def metrics(self) -> list[RequestMetrics]: ...


__all__ = [
    "Batcher",
    "FinishReason",
    "Model",
    "Policy",
    "Request",
    "RequestMetrics",
    "RequestRejected",
    "SeqSlice",
    "StepOutput",
]
