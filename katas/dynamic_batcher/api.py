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
from types import TracebackType
from typing import Literal, NamedTuple, Protocol, TypeVar

#: Why a request finished: a stop token, ``max_new_tokens``, its deadline, ``abort()``.
FinishReason = Literal["stop", "length", "deadline", "abort"]
#: The order waiting requests are admitted in.
Policy = Literal["fcfs", "priority"]


class RequestRejected(ValueError):
    """``submit`` refuses a request: a duplicate id, or one that could never finish
    (its prompt + ``max_new_tokens`` - 1 tokens, the most it ever has in KV since the
    newest token is never written, need more KV blocks than the pool has)."""


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


class PagedBatcher(Batcher, Protocol):
    """A continuous batcher over paged KV blocks, as the tests read it: stage 1's
    ``ContinuousBatcher`` (and stage 2's prefix-caching one). Besides what a
    :class:`Batcher` is driven by, where its blocks and its requests are."""

    def free_blocks(self) -> int:
        """Blocks no request holds."""
        ...

    def blocks_of(self, rid: str) -> tuple[int, ...]:
        """``rid``'s block table (``()`` if none, or finished)."""
        ...

    def running(self) -> list[str]:
        """The running requests, in admission order."""
        ...

    def waiting(self) -> list[str]:
        """The waiting requests, in the order they will be admitted."""
        ...


# -- stage 2: the engine and the request batcher ---------------------------------------


class Overloaded(Exception):
    """``AsyncEngine.generate`` refuses a request: the waiting queue is full.
    ``retry_after_ns``: when retrying can first succeed (nothing leaves the queue before
    the step in flight ends)."""

    def __init__(self, message: str, *, retry_after_ns: int) -> None:
        super().__init__(message)
        self.retry_after_ns = retry_after_ns


class EngineClosed(Exception):
    """The engine (or request batcher) is draining or closed: no new work is accepted."""


class ReaderStalled(Exception):
    """A stream's reader left a token untaken for ``max_stall_ns``: its request was
    aborted and the tokens it had not taken were dropped."""


class ReplicaError(Exception):
    """A replica's answer broke off or made no sense: the connection died mid-stream, an
    unexpected status, a body that is not an event stream, a truncated or garbled event."""


@dataclass(slots=True)
class Delivery:
    """What one read of a stream returns: every token produced since the reader's last
    read, in order (several when the reader was slower than the engine), and, on the
    stream's last delivery, why the request finished (its ``tokens`` may then be empty).

    A value: never change one after it is returned. It is not ``frozen``: one is built
    per token a reader takes, and a frozen dataclass sets each field through
    ``object.__setattr__`` (0.3 µs here, against 0.13 µs with ``slots``), so it is not
    hashable either."""

    tokens: tuple[int, ...]
    finish_reason: FinishReason | None = None


class TokenStream(Protocol):
    """One request's tokens for one reader: ``async for delivery in stream``, or
    ``async with stream: ...`` to close it on the way out.

    Each read returns a :class:`Delivery` with every token produced since the previous
    read (at least one), or, last, the finish reason with whatever was still untaken;
    then ``StopAsyncIteration``."""

    @property
    def rid(self) -> str: ...

    def __aiter__(self) -> TokenStream: ...

    async def __anext__(self) -> Delivery: ...

    async def aclose(self) -> None:
        """Stop reading: the request is aborted if it has not finished."""
        ...

    async def __aenter__(self) -> TokenStream: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...


@dataclass(frozen=True)
class EngineStatistics:
    """An :class:`AsyncEngine` at one instant, in simulated time (the engine's clock).

    ``waiting``/``running``: the batcher's queues; ``streams``: requests admitted and not
    finished (their end not yet handed to their stream); ``output_tokens``:
    tokens produced by every step so far; ``tokens_per_s``: those tokens over the time
    from the first step's start to the last step's end (0.0 before any step). TTFT and
    TPOT are over the requests that finished, by nearest rank (``p`` % of ``n`` values:
    the ``ceil(p * n / 100)``-th smallest), None without any value."""

    waiting: int
    running: int
    streams: int
    steps: int
    output_tokens: int
    tokens_per_s: float
    ttft_p50_ns: int | None
    ttft_p99_ns: int | None
    tpot_p50_ns: float | None
    tpot_p99_ns: float | None


class Engine(Protocol):
    """Serves many streaming readers from one continuous batcher, in simulated time:
    stage 2's ``AsyncEngine`` (and what each replica of stage 3 runs). ``async with`` it
    to run its loop; leaving the block closes it."""

    async def __aenter__(self) -> Engine: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None: ...

    def generate(self, request: Request) -> TokenStream:
        """Admit ``request`` (its arrival stamped now) and return its stream:
        :class:`Overloaded` when the waiting queue is full, :class:`EngineClosed` once
        draining or closed."""
        ...

    async def drain(self) -> None:
        """Refuse new requests; return once every admitted one has finished."""
        ...

    async def aclose(self) -> None:
        """Abort every request (each stream ends with reason ``abort``) and stop."""
        ...

    def statistics(self) -> EngineStatistics: ...


#: What a request batcher's caller submits (its ``fn`` takes a batch of them).
Item = TypeVar("Item", contravariant=True)
#: What the caller gets back for its item (``fn`` returns one per item).
Result = TypeVar("Result", covariant=True)


class RequestBatcher(Protocol[Item, Result]):
    """Batches concurrent callers' items into calls of one function: stage 2's
    ``DynamicBatcher``. ``async with`` it; each ``submit`` waits for its item's result."""

    async def __aenter__(self) -> RequestBatcher[Item, Result]: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None: ...

    async def submit(self, item: Item) -> Result:
        """Queue ``item`` and return its result once its batch is done (or raise the
        batch's error); :class:`EngineClosed` while closing or after."""
        ...

    def statistics(self) -> BatchStatistics: ...


@dataclass(frozen=True)
class BatchStatistics:
    """A :class:`DynamicBatcher` at one instant: items ``queued`` (not yet sent), batches
    ``in_flight`` (sent, ``fn`` not returned), and ``dispatched`` batches so far with the
    ``sizes`` of each, in order."""

    queued: int
    in_flight: int
    dispatched: int
    sizes: tuple[int, ...]


def block_hash(parent: int | None, tokens: Sequence[int]) -> int:
    """The prefix cache's key of one full KV block: Python's tuple hash of the key of the
    block before it (``parent``; None for a request's first block, hashed as -1, a value
    ``hash`` never returns) and the block's tokens. Chained, so a key names the whole
    prefix up to and including its block (vLLM's ``hash_block_tokens``)."""
    return hash((-1 if parent is None else parent, tuple(tokens)))


@dataclass(frozen=True)
class PrefixCacheStatistics:
    """A ``PrefixCachingBatcher``'s cache since it was built. Each admission (a new
    request's, or a preempted one's again) is one of ``lookups``: it queries its known
    tokens (``queried_tokens``) and is served ``hit_tokens`` of them from cached blocks.
    ``cached_blocks``: blocks that hold a key now, in use or free; ``evictions``: cached
    blocks whose key was dropped because the block was taken for new tokens."""

    lookups: int
    queried_tokens: int
    hit_tokens: int
    cached_blocks: int
    evictions: int

    @property
    def hit_rate(self) -> float:
        """``hit_tokens / queried_tokens`` (0.0 before any lookup)."""
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class CachingBatcher(PagedBatcher, Protocol):
    """A paged batcher with automatic prefix caching: stage 2's ``PrefixCachingBatcher``.
    Its :meth:`blocks_of` includes the blocks it shares; :meth:`free_blocks` counts the
    free queue, cached blocks included."""

    def cache_statistics(self) -> PrefixCacheStatistics: ...


# -- stage 3: the router over replicas ------------------------------------------------------

#: Why the router sent a request where it did.
RouteReason = Literal["affinity", "least-loaded", "balance"]


@dataclass(frozen=True)
class Route:
    """One routing decision: the ``replica`` chosen, ``why``, and how many leading full
    blocks of the prompt the router believes that replica has cached (``matched_blocks``)."""

    replica: str
    why: RouteReason
    matched_blocks: int = 0


class Completion(Protocol):
    """One attempt's answer from one replica: ``async for tokens, finish_reason in it``.

    Each item is one event of the replica's stream: the tokens of one delivery, and None
    — or, on the last item, why the request finished. The first read connects: it raises
    :class:`Overloaded` when the replica refuses (HTTP 429); any read raises
    :class:`ReplicaError` when the replica's answer breaks off or makes no sense.
    ``aclose()`` ends the attempt (the replica aborts the request)."""

    def __aiter__(self) -> Completion: ...

    async def __anext__(self) -> tuple[tuple[int, ...], FinishReason | None]: ...

    async def aclose(self) -> None: ...


class ReplicaLink(Protocol):
    """How the router reaches one replica: over loopback HTTP in a real fleet, in process
    in most tests. The harness provides both; the router only routes."""

    @property
    def name(self) -> str: ...

    def stream(self, request: Request) -> Completion:
        """Ask the replica to generate ``request`` (nothing is sent before the first read)."""
        ...

    async def healthy(self) -> bool:
        """Probe the replica: True if it answers that it serves. A stopped replica never
        answers, so the caller bounds the wait; a dead one raises or says False."""
        ...


class RoutingPolicy(Protocol):
    """Where each attempt of a request goes, with no I/O and no clock: stage 3's
    ``ReplicaSet``. It keeps each replica's health, load in tokens and prefix history;
    the router tells it what happened and asks it where to go. Unknown replica names
    raise KeyError."""

    def available(self) -> list[str]:
        """Replicas that may take a request now: up and not draining, in the order given."""
        ...

    def load(self, name: str) -> int:
        """``name``'s outstanding tokens."""
        ...

    def loads(self) -> dict[str, int]:
        """Every replica's load, in the order given (down ones included)."""
        ...

    def total_load(self) -> int: ...

    def is_up(self, name: str) -> bool: ...

    def is_draining(self, name: str) -> bool: ...

    def matched_blocks(self, name: str, prompt: Sequence[int]) -> int:
        """Leading full blocks of ``prompt`` in ``name``'s routing history."""
        ...

    def pick(self, prompt: Sequence[int], *, exclude: Collection[str] = ()) -> Route | None:
        """Where ``prompt`` should go (None: no replica may take it); changes nothing."""
        ...

    def assign(self, name: str, rid: str, prompt: Sequence[int], max_new_tokens: int) -> None:
        """``rid`` now runs on ``name``: charge its weight, record its prompt's blocks."""
        ...

    def progress(self, rid: str, tokens: int) -> None:
        """``tokens`` more tokens of ``rid`` arrived."""
        ...

    def release(self, rid: str) -> None:
        """``rid`` left its replica: what is left of its weight comes off."""
        ...

    def replica_of(self, rid: str) -> str | None: ...

    def mark_down(self, name: str) -> None:
        """``name`` failed: no request goes there, and its history is forgotten."""
        ...

    def mark_up(self, name: str) -> None: ...

    def drain(self, name: str) -> None: ...

    def restore(self, name: str) -> None: ...


class StreamRouter(Protocol):
    """Routes streaming requests over replicas and keeps each stream whole when a
    replica dies under it: stage 3's ``Router``. ``async with`` it to run its watchdog
    and prober; leaving the block closes it."""

    async def __aenter__(self) -> StreamRouter: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None: ...

    async def aclose(self) -> None:
        """End every stream not ended yet (:class:`ReplicaError`), stop probing."""
        ...

    def generate(self, request: Request) -> TokenStream:
        """Admit ``request`` and start its first attempt; return its stream at once:
        :class:`Overloaded` past ``max_outstanding_tokens``, :class:`ReplicaError` when
        no replica may take it or once closed."""
        ...

    async def check_health(self) -> None:
        """Probe every replica at once; one that did not answer True is down."""
        ...

    async def drain(self, name: str) -> None:
        """Route nothing more to ``name``; return once nothing runs there."""
        ...

    def restore(self, name: str) -> None:
        """Route to ``name`` again after a drain."""
        ...

    def statistics(self) -> RouterStatistics: ...


@dataclass(frozen=True)
class RouterStatistics:
    """A router at one instant. ``routed``: attempts sent to each replica (first attempts,
    failovers and retries after a 429); ``by_affinity`` / ``by_balance``: routes chosen
    for a cached prefix / by the imbalance guard; ``failovers``: requests moved off a
    failed replica (under the cap, with budget left; counted even if no replica could
    then take one);
    ``refused``: requests the router itself refused (``Overloaded``); ``outstanding``:
    each replica's load in tokens; ``down`` and ``draining``: replicas out of routing."""

    routed: Mapping[str, int]
    by_affinity: int
    by_balance: int
    failovers: int
    refused: int
    outstanding: Mapping[str, int]
    down: tuple[str, ...]
    draining: tuple[str, ...]


__all__ = [
    "BatchStatistics",
    "Batcher",
    "CachingBatcher",
    "Completion",
    "Delivery",
    "Engine",
    "EngineClosed",
    "EngineStatistics",
    "FinishReason",
    "Model",
    "Overloaded",
    "PagedBatcher",
    "Policy",
    "PrefixCacheStatistics",
    "ReaderStalled",
    "ReplicaError",
    "ReplicaLink",
    "Request",
    "RequestBatcher",
    "RequestMetrics",
    "RequestRejected",
    "Route",
    "RouteReason",
    "RouterStatistics",
    "RoutingPolicy",
    "SeqSlice",
    "StepOutput",
    "StreamRouter",
    "TokenStream",
    "block_hash",
]
