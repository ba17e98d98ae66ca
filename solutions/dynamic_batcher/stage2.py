"""Reference solution, stage 2: a streaming engine over the stage-1 batcher; a request
batcher for models that answer in one piece (request_batches.py); and stage 1's batcher
with automatic prefix caching (prefix_cache.py).

The engine is one task, as vLLM's engine core loop: step the batcher, let the step's
simulated GPU time pass on the clock, then hand each request's new tokens to its
stream. A stream only buffers, so a slow reader costs the loop nothing; what a reader
has not taken yet is merged into its next read (vLLM's output collector), which bounds
its buffer by the request's own ``max_new_tokens``. Four things end a request early, and
each goes through ``ContinuousBatcher.abort``, which frees its blocks at once: its
reader closes the stream or is cancelled, its reader stalls, its deadline passes (the
batcher's own rule), the engine closes.

Everything runs on one event loop and the batcher is synchronous, so no lock is
needed: between two awaits, the engine and the streams see each other's state whole.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from itertools import chain
from types import TracebackType
from typing import Literal, TypeVar

import anyio
import anyio.abc
import anyio.lowlevel

from katas._runtime.checks import positive_int
from katas._runtime.clock import WaitingClock
from katas.dynamic_batcher.api import (
    Delivery,
    EngineClosed,
    EngineStatistics,
    FinishReason,
    Overloaded,
    ReaderStalled,
    Request,
    StepOutput,
    TokenStream,
)

from .prefix_cache import PrefixCachingBatcher
from .reader import ReaderEnd
from .request_batches import DynamicBatcher
from .stage1 import ContinuousBatcher

_State = Literal["new", "open", "draining", "closed"]
_V = TypeVar("_V", int, float)


class _Stream(ReaderEnd):
    """One request's tokens for one reader: ``async for delivery in stream``."""

    def __init__(self, engine: AsyncEngine, rid: str, arrival_ns: int) -> None:
        self._engine = engine
        self._rid = rid
        # Produced, not yet taken: one tuple per step, handed over as it is to a reader
        # that keeps up (one step's tokens a read), joined for one that fell behind.
        self._pending: list[tuple[int, ...]] = []
        self._since_ns = 0  # when the oldest pending token was produced
        self._reason: FinishReason | None = None  # the request finished, and why
        self._error: ReaderStalled | None = None
        self._over = False  # the last delivery was taken, or the reader left
        # Timings in simulated time, for the engine's statistics.
        self.arrival_ns = arrival_ns
        self.first_ns: int | None = None
        self.last_ns = 0
        self.produced = 0

    @property
    def rid(self) -> str:
        return self._rid

    def _take(self) -> Delivery | None:
        if self._pending:  # first: the case of every read of a reader that keeps up
            steps, self._pending = self._pending, []
            tokens = steps[0] if len(steps) == 1 else tuple(chain.from_iterable(steps))
            self._engine._unread.pop(self._rid, None)
            self._over = self._reason is not None
            return Delivery(tokens, self._reason)
        if self._over:
            raise StopAsyncIteration
        if self._error is not None:
            self._over = True
            raise self._error
        if self._reason is None:
            return None  # the read parks (ReaderEnd)
        self._over = True
        return Delivery((), self._reason)

    # -- the engine's side -------------------------------------------------------------
    def _push(self, tokens: tuple[int, ...], at_ns: int) -> bool:
        """Buffer ``tokens``; True if the buffer was empty: the stall clock starts, and a
        read may be parked (with tokens buffered, none is)."""
        started = not self._pending
        self._pending.append(tokens)
        self.last_ns = at_ns
        self.produced += len(tokens)
        if started:
            self._since_ns = at_ns
            if self.first_ns is None:
                self.first_ns = at_ns
            self._wake()
        return started

    def _end(self, reason: FinishReason) -> None:
        self._reason = reason
        self._wake()

    def _stall(self, error: ReaderStalled) -> None:
        self._pending.clear()  # the point of aborting: a stalled reader holds nothing
        self._error = error
        self._wake()

    def _leave(self) -> None:
        if not self._over:
            self._over = True
            self._pending.clear()
            self._engine._left(self)
            self._wake()  # a read waiting in another task ends too


class AsyncEngine:
    """Serves many streaming readers from one continuous batcher, in simulated time."""

    def __init__(
        self,
        batcher: ContinuousBatcher,
        *,
        clock: WaitingClock,
        step_time_ns: Callable[[StepOutput], int],
        max_waiting: int,
        max_stall_ns: int,
    ) -> None:
        if not isinstance(clock, WaitingClock):
            raise ValueError(f"clock must be a WaitingClock, got {clock!r}")
        if not callable(step_time_ns):
            raise ValueError(f"step_time_ns must be callable, got {step_time_ns!r}")
        self._batcher = batcher
        self._clock = clock
        self._step_time = step_time_ns
        self._max_waiting = positive_int("max_waiting", max_waiting)
        self._max_stall = positive_int("max_stall_ns", max_stall_ns)
        self._state: _State = "new"
        self._tasks: anyio.abc.TaskGroup | None = None
        # The loop's own scope: cancelling the task group's would cancel the body of
        # the caller's `async with` too, which runs inside it.
        self._loop_scope = anyio.CancelScope()
        self._streams: dict[str, _Stream] = {}  # requests not finished, by id
        # Streams of unfinished requests holding untaken tokens. Tokens are buffered at
        # step ends, in time order, and a stream leaves when its reader takes them, so
        # insertion order is the order of their oldest tokens: the stalled are in front.
        self._unread: dict[str, _Stream] = {}
        self._work = anyio.Event()  # a request arrived: wakes an idle loop
        self._stepped = anyio.Event()  # a step ended: wakes drain()
        self._step_end: int | None = None  # the end of the step in flight
        # Statistics.
        self._steps = 0
        self._tokens = 0
        self._first_start: int | None = None
        self._last_end = 0
        self._ttft: list[int] = []
        self._tpot: list[float] = []

    # -- lifetime ------------------------------------------------------------------------
    async def __aenter__(self) -> AsyncEngine:
        if self._state != "new":
            raise RuntimeError("an AsyncEngine is entered once")
        self._tasks = anyio.create_task_group()
        await self._tasks.__aenter__()
        self._tasks.start_soon(self._loop)
        self._state = "open"
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        self._close()  # no await: the block may be leaving because it was cancelled
        assert self._tasks is not None
        return await self._tasks.__aexit__(exc_type, exc, tb)

    def generate(self, request: Request) -> TokenStream:
        """Admit ``request`` (its arrival stamped now) and return its stream."""
        if self._state != "open":
            if self._state == "new":
                raise RuntimeError("generate() needs the engine running: `async with`")
            raise EngineClosed(f"the engine is {self._state}: request {request.rid!r} refused")
        if not isinstance(request, Request):
            raise TypeError(f"request must be an api.Request, got {request!r}")
        now = self._clock.now_ns()
        # Every waiting request has a stream: only with that many streams can the queue
        # be full, and only then is it worth building the batcher's list to count it.
        if (
            len(self._streams) >= self._max_waiting
            and len(self._batcher.waiting()) >= self._max_waiting
        ):
            # Nothing leaves the queue before the step in flight ends; with none in
            # flight the next one starts at once.
            left = 0 if self._step_end is None else self._step_end - now
            raise Overloaded(
                f"request {request.rid!r} refused: {self._max_waiting} requests already "
                "wait (max_waiting)",
                retry_after_ns=max(1, left),
            )
        self._batcher.submit(replace(request, arrival_ns=now))
        stream = self._streams[request.rid] = _Stream(self, request.rid, now)
        self._work.set()
        return stream

    async def drain(self) -> None:
        """Refuse new requests, and return once every admitted one has finished and its
        last tokens are in its stream."""
        if self._state == "open":
            self._state = "draining"
        while self._state == "draining" and (
            self._batcher.has_unfinished() or self._step_end is not None
        ):
            await self._stepped.wait()
        await anyio.lowlevel.checkpoint()

    async def aclose(self) -> None:
        """Abort every request (each stream ends with its untaken tokens and reason
        ``abort``) and stop the loop; leaving ``async with`` waits for it to end."""
        self._close()
        await anyio.lowlevel.checkpoint()

    def _close(self) -> None:
        if self._state != "closed":
            self._state = "closed"
            now = self._clock.now_ns()
            for stream in list(self._streams.values()):
                self._batcher.abort(stream.rid)
                stream._end("abort")
                self._finished(stream, now)
            self._unread.clear()
            self._stepped.set()  # a drain() in progress returns
            self._loop_scope.cancel()

    # -- the loop -------------------------------------------------------------------------
    async def _loop(self) -> None:
        with self._loop_scope:
            await self._steps_forever()

    async def _steps_forever(self) -> None:
        batcher, clock = self._batcher, self._clock
        while True:
            if not batcher.has_unfinished():
                # Idle: a drain() whose last request ended without a step (its reader
                # left before the loop ran) returns too.
                self._stepped.set()
                self._stepped = anyio.Event()
                self._work = anyio.Event()
                await self._work.wait()
                continue
            now = clock.now_ns()
            self._abort_stalled(now)
            if not batcher.has_unfinished():
                continue
            out = batcher.step(now)
            cost = self._step_time(out)
            if isinstance(cost, bool) or not isinstance(cost, int) or cost <= 0:
                raise ValueError(f"step_time_ns must return an int > 0 of ns, got {cost!r}")
            if self._first_start is None:
                self._first_start = now
            self._step_end = end = now + cost
            await clock.sleep_until_ns_async(end)  # the GPU computes the step
            self._step_end = None
            self._deliver(out, end)
            self._stepped.set()
            self._stepped = anyio.Event()

    def _deliver(self, out: StepOutput, now: int) -> None:
        self._steps += 1
        self._last_end = now
        streams, unread = self._streams, self._unread
        for rid, tokens in out.tokens.items():
            stream = streams.get(rid)
            if stream is not None and stream._push(tokens, now):  # None: its reader left
                unread[rid] = stream
        self._tokens += sum(map(len, out.tokens.values()))
        for rid, reason in out.finished.items():
            stream = streams.get(rid)
            if stream is not None:
                stream._end(reason)
                self._finished(stream, now)

    def _abort_stalled(self, now: int) -> None:
        for stream in list(self._unread.values()):
            if now - stream._since_ns < self._max_stall:
                break  # the rest are younger
            self._batcher.abort(stream.rid)
            stream._stall(
                ReaderStalled(
                    f"request {stream.rid!r} aborted at {now} ns: its reader left a token "
                    f"untaken since {stream._since_ns} ns (max_stall_ns={self._max_stall})"
                )
            )
            self._finished(stream, now)

    # -- the streams' side ---------------------------------------------------------------
    def _left(self, stream: _Stream) -> None:
        if self._streams.get(stream.rid) is stream:
            self._batcher.abort(stream.rid)  # frees its blocks now
            self._finished(stream, self._clock.now_ns())

    def _finished(self, stream: _Stream, now: int) -> None:
        del self._streams[stream.rid]
        self._unread.pop(stream.rid, None)
        if stream.first_ns is not None:
            self._ttft.append(stream.first_ns - stream.arrival_ns)
            if stream.produced >= 2:
                self._tpot.append((stream.last_ns - stream.first_ns) / (stream.produced - 1))

    # -- observation ---------------------------------------------------------------------
    def statistics(self) -> EngineStatistics:
        elapsed = 0 if self._first_start is None else self._last_end - self._first_start
        return EngineStatistics(
            waiting=len(self._batcher.waiting()),
            running=len(self._batcher.running()),
            streams=len(self._streams),
            steps=self._steps,
            output_tokens=self._tokens,
            tokens_per_s=self._tokens * 1e9 / elapsed if elapsed > 0 else 0.0,
            ttft_p50_ns=_nearest_rank(self._ttft, 50),
            ttft_p99_ns=_nearest_rank(self._ttft, 99),
            tpot_p50_ns=_nearest_rank(self._tpot, 50),
            tpot_p99_ns=_nearest_rank(self._tpot, 99),
        )


def _nearest_rank(values: list[_V], p: int) -> _V | None:
    """The ``ceil(p * n / 100)``-th smallest of ``values`` (None if there are none)."""
    if not values:
        return None
    return sorted(values)[math.ceil(p * len(values) / 100) - 1]


__all__ = ["AsyncEngine", "DynamicBatcher", "PrefixCachingBatcher"]
