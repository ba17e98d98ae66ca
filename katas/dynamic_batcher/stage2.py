"""Stage 2 — a streaming engine on anyio (asyncio and trio), automatic prefix caching,
and a request batcher.

The prompt is katas/dynamic_batcher/README.md, "Stage 2"; run the suite with
``pytest katas/dynamic_batcher -k stage2`` (``-k "stage2 and core and not batches"`` for
the engine's core, ``-k batches`` for the request batcher, ``-k prefix`` for the cache).

Rules (the suite checks each one):

- One loop task steps your stage-1 batcher: ``step(now)``, then the step's simulated
  time (``step_time_ns(output)``) passes on the clock, then the step's tokens reach the
  streams. An idle engine waits without stepping.
- ``generate()`` stamps the request's arrival with the clock's time; with
  ``max_waiting`` requests already waiting it raises ``Overloaded`` carrying
  ``retry_after_ns``: the time left in the step in flight (1 ns when none is).
- A read returns every token produced since the last read, merged, and on the last
  delivery the finish reason; then the iteration stops.
- A reader that closes its stream or is cancelled aborts its request at once: its
  blocks are freed and nothing of it is delivered afterwards.
- A token left untaken for ``max_stall_ns`` aborts its request at the next step's
  start; the reader's next read raises ``ReaderStalled``.
- ``drain()`` refuses new requests and returns when every admitted one has finished;
  ``aclose()`` aborts everything (each stream's last delivery has reason ``abort``).
- ``statistics()``: queues, steps, tokens per second, TTFT and TPOT percentiles.
- DynamicBatcher (``-k batches``): a batch is sent when ``max_batch_size`` items wait,
  or at the instant its oldest item has waited ``max_queue_delay_ns`` since its own
  submit; items in submission order, never more than ``max_batch_size``. Each caller
  gets the result at its item's index; ``fn``'s exception (or a wrong number of
  results: RuntimeError) fails every caller of that batch and no other. Batches run
  concurrently.
- A caller cancelled before its batch is sent takes its item out (it counts neither
  towards full nor towards the delay); after, its result is dropped.
- Leaving the block sends what is queued at once and waits for every batch; submit()
  then raises EngineClosed (RuntimeError before the block).
- PrefixCachingBatcher (extended): stage 1's batcher, with every full KV block keyed
  by ``api.block_hash(key of the block before, its tokens)`` once the step that fills it
  has run. An admission shares the longest run of cached blocks matching its known
  tokens, never the block of its last token; those tokens are not scheduled. Blocks are
  ref-counted; one nobody holds joins the back of a free queue and keeps its key until
  an allocation takes it from the front (its key evicted). Release last block first.
"""

from __future__ import annotations

# TODO(stage2): implement every class and method below; delete each
# `raise Todo()` as you go. Build on your stage-1 ContinuousBatcher.
from collections.abc import Awaitable, Callable, Sequence
from types import TracebackType
from typing import Generic, TypeVar

from katas._runtime.clock import WaitingClock
from katas._runtime.todo import Todo
from katas.dynamic_batcher.api import (
    BatchStatistics,
    Delivery,
    EngineStatistics,
    Model,
    Policy,
    PrefixCacheStatistics,
    Request,
    RequestMetrics,
    StepOutput,
    TokenStream,
)

from .stage1 import ContinuousBatcher

T = TypeVar("T")
R = TypeVar("R")


class _Stream:
    """One request's tokens for one reader: what ``generate()`` returns (it implements
    ``api.TokenStream``). A sketch — a buffer of untaken tokens, the finish reason once
    known, an event the reader waits on; shape it as you like."""

    def __init__(self, engine: AsyncEngine, rid: str, arrival_ns: int) -> None:
        raise Todo()

    @property
    def rid(self) -> str:
        raise Todo()

    def __aiter__(self) -> _Stream:
        raise Todo()

    async def __anext__(self) -> Delivery:
        """The next delivery; waits while nothing is untaken. Cancelled while waiting,
        the reader is gone: its request is aborted."""
        raise Todo()

    async def aclose(self) -> None:
        """Stop reading: the request is aborted if it has not finished."""
        raise Todo()

    async def __aenter__(self) -> _Stream:
        raise Todo()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        raise Todo()


class AsyncEngine:
    """Serves many streaming readers from one continuous batcher, in simulated time.

    ``async with AsyncEngine(batcher, ...) as engine:`` starts the loop task; leaving
    the block calls :meth:`aclose` and returns once the loop has ended.
    ``step_time_ns(output)``: how long the step that produced ``output`` takes on the
    GPU (an int > 0). ``max_waiting``: requests the batcher may hold waiting before
    :meth:`generate` refuses more. ``max_stall_ns``: how long a produced token may stay
    untaken before its request is aborted.
    """

    def __init__(
        self,
        batcher: ContinuousBatcher,
        *,
        clock: WaitingClock,
        step_time_ns: Callable[[StepOutput], int],
        max_waiting: int,
        max_stall_ns: int,
    ) -> None:
        raise Todo()

    async def __aenter__(self) -> AsyncEngine:
        raise Todo()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        raise Todo()

    def generate(self, request: Request) -> TokenStream:
        """Admit ``request`` with its arrival stamped now, and return its stream.
        ``Overloaded`` when ``max_waiting`` requests wait; ``EngineClosed`` once
        draining or closed; the batcher's ``RequestRejected`` as it is."""
        raise Todo()

    async def drain(self) -> None:
        """Refuse new requests; return once every admitted request has finished and its
        last delivery is in its stream."""
        raise Todo()

    async def aclose(self) -> None:
        """Abort every request (each stream ends with its untaken tokens and reason
        ``abort``) and stop the loop."""
        raise Todo()

    def statistics(self) -> EngineStatistics:
        raise Todo()


class DynamicBatcher(Generic[T, R]):
    """Batches concurrent ``submit`` calls into calls of ``fn``: ``async with`` it."""

    def __init__(
        self,
        fn: Callable[[Sequence[T]], Awaitable[Sequence[R]]],
        *,
        max_batch_size: int,
        max_queue_delay_ns: int,
        clock: WaitingClock,
    ) -> None:
        """``fn`` takes a batch of items and returns one result per item, in order.
        ``max_batch_size``: an int >= 1; ``max_queue_delay_ns``: an int >= 0 (TypeError if
        not an int, ValueError if below). ``fn`` not callable, ``clock`` not a
        WaitingClock: ValueError. Each error names the parameter."""
        raise Todo()

    async def __aenter__(self) -> DynamicBatcher[T, R]:
        """Start the batcher's tasks (a task group). A batcher is entered once."""
        raise Todo()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        """Close: refuse new items (EngineClosed), send what is queued at once, return
        when every batch has ended. Left by a cancellation: cancel the batches in flight,
        send nothing more, and every caller still waiting gets EngineClosed."""
        raise Todo()

    async def submit(self, item: T) -> R:
        """Queue ``item``; return ``fn``'s result for it once its batch is done, or raise
        the batch's error. A batch is sent when ``max_batch_size`` items wait, or when its
        oldest item has waited ``max_queue_delay_ns`` since its own ``submit``.

        Cancelled before its batch is sent, the item leaves the queue and is never sent;
        after, its result is dropped. Before the ``async with`` block: RuntimeError; while
        the batcher closes or after: EngineClosed."""
        raise Todo()

    def statistics(self) -> BatchStatistics:
        """Items queued (not sent), batches in flight, batches dispatched and their sizes."""
        raise Todo()


class PrefixCachingBatcher:
    """Stage 1's continuous batching, with automatic prefix caching: full KV blocks are
    shared between requests with the same prefix, and kept after use until their room is
    needed. The model must be built with ``shared_reads=True`` (``FakeModel``)."""

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
        """As stage 1's ``ContinuousBatcher`` (without ``hotpath``): ``num_blocks`` and
        ``block_size`` are the model's pool, ints >= 1, ``max_num_batched_tokens >=
        max_num_seqs``, ``policy`` ``"fcfs"`` or ``"priority"`` (ValueError or TypeError
        naming the parameter)."""
        raise Todo()

    def submit(self, request: Request) -> None:
        """Queue ``request`` as stage 1 does; RequestRejected for an id already submitted
        and for one whose ``ceil((len(prompt) + max_new_tokens - 1) / block_size)``
        exceeds ``num_blocks`` (a shared block still counts in its table)."""
        raise Todo()

    def step(self, now_ns: int) -> StepOutput:
        """Stage 1's step. An admission first looks its known tokens up: it shares the
        longest run of cached full blocks that match them, block 0 onward, at most
        ``(known - 1) // block_size`` of them (the last known token is always computed),
        and schedules only the rest (``scheduled`` counts what is computed). It is
        admitted only if its free hits and its new blocks fit the free queue. After the
        forward pass, every block a slice filled is cached under its key, unless that key
        is cached already (one block per key)."""
        raise Todo()

    def abort(self, rid: str) -> None:
        """Finish ``rid`` now (reason ``abort``) in any state, its blocks released; a
        finished one: nothing to do; an unknown one: KeyError."""
        raise Todo()

    def has_unfinished(self) -> bool:
        raise Todo()

    def metrics(self) -> list[RequestMetrics]:
        """The finished requests' metrics, in the order they finished."""
        raise Todo()

    def cache_statistics(self) -> PrefixCacheStatistics:
        """``lookups``: admissions so far (a preempted request's again included);
        ``queried_tokens``: their known tokens; ``hit_tokens``: those served from cached
        blocks; ``cached_blocks``: blocks with a key now, held or free; ``evictions``:
        keys dropped because their block was allocated for new tokens."""
        raise Todo()

    # -- what the tests read ---------------------------------------------------------------
    def free_blocks(self) -> int:
        """Blocks that no request holds — cached or not: the free queue's length."""
        raise Todo()

    def blocks_of(self, rid: str) -> tuple[int, ...]:
        """``rid``'s block table, shared blocks included (``()`` if none, or finished)."""
        raise Todo()

    def running(self) -> list[str]:
        """The running requests, in admission order."""
        raise Todo()

    def waiting(self) -> list[str]:
        """The waiting requests, in the order they will be admitted."""
        raise Todo()


__all__ = ["AsyncEngine", "DynamicBatcher", "PrefixCachingBatcher"]
