"""Reference solution, stage 3: a router over engine replicas that die mid-stream.

The router keeps one client stream per request and runs each *attempt* — the request
on one replica — as a task of its own that pumps the replica's events into the
client's stream. Where an attempt goes is the business of ``ReplicaSet``
(replica_set.py), which knows nothing of sockets; this module does the I/O, the
failures and the time.

Failover is what makes the stream whole. The router keeps every token it accepted; when
the replica dies (its stream breaks, it stays silent for ``stall_timeout_ns``, or a
probe finds it down), every request in flight there is resubmitted elsewhere as its
prompt *plus the tokens already accepted*, with the budget that is left. The model is
deterministic, so the new replica continues exactly where the old one stopped, and the
client's stream carries every token once.

Each request has an ownership epoch, bumped at every failover; an attempt applies its
tokens only while its epoch is the request's. A replica that was stopped (SIGSTOP)
and comes back (SIGCONT) may still hold events for a request that has moved on: the
epoch drops them, however the old attempt's teardown and the new attempt interleave.

Everything runs on one event loop, so between two awaits the router's state is whole.
Cleanup that awaits (closing an attempt's connection) runs shielded, as trio teaches:
a cancelled client must still leave nothing open behind it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType

import anyio
import anyio.abc
import anyio.lowlevel

from katas._runtime.checks import positive_int
from katas._runtime.clock import WaitingClock
from katas.dynamic_batcher.api import (
    Delivery,
    FinishReason,
    Overloaded,
    ReplicaError,
    ReplicaLink,
    Request,
    RouterStatistics,
    TokenStream,
)

from .reader import ReaderEnd
from .replica_set import ReplicaSet


@dataclass
class _Attempt:
    """The request on one replica, from its start to its end or its failover."""

    replica: str
    epoch: int
    scope: anyio.CancelScope


class _RoutedStream(ReaderEnd):
    """One request's tokens for its client, across every replica it runs on."""

    def __init__(self, router: Router, request: Request) -> None:
        self._router = router
        self.request = request
        self.accepted: list[int] = []  # every token the router took from a replica
        self._taken = 0  # of which the client has read this many
        self.reason: FinishReason | None = None
        self.error: Exception | None = None
        self.over = False  # the last delivery was taken, or the client left
        self.epoch = 0
        self.attempt: _Attempt | None = None
        self.failovers = 0
        self.attempts = 0  # attempts started, refused ones included
        self.refusals: dict[str, int] = {}  # replicas that answered 429 since the last start

    @property
    def rid(self) -> str:
        return self.request.rid

    @property
    def ended(self) -> bool:
        return self.reason is not None or self.error is not None

    def resubmission(self) -> Request:
        """The request as the next replica must see it: the prompt and every token
        accepted so far, and the budget that is left; after the first attempt, under an
        id of its own (``rid#n``), since a replica refuses an id it has already seen."""
        r = self.request
        return Request(
            r.rid if self.attempts == 0 else f"{r.rid}#{self.attempts}",
            r.prompt + tuple(self.accepted),
            r.max_new_tokens - len(self.accepted),
            r.stop_tokens,
            priority=r.priority,
        )

    def _take(self) -> Delivery | None:
        if self.over:
            raise StopAsyncIteration
        fresh = tuple(self.accepted[self._taken :])
        if fresh or self.reason is not None:
            self._taken = len(self.accepted)
            self.over = self.reason is not None
            return Delivery(fresh, self.reason)
        if self.error is not None:
            self.over = True
            raise self.error
        return None  # the read parks (ReaderEnd)

    def _leave(self) -> None:
        if not self.over:
            self.over = True
            self._router._left(self)
            self._wake()


class Router:
    """Routes streaming requests over replicas, and keeps each stream whole when a
    replica dies under it."""

    def __init__(
        self,
        replicas: Sequence[ReplicaLink],
        *,
        clock: WaitingClock,
        block_size: int,
        max_outstanding_tokens: int,
        retry_after_ns: int,
        stall_timeout_ns: int,
        probe_interval_ns: int,
        probe_timeout_ns: int,
        max_failovers: int = 3,
        balance_abs_tokens: int = 256,
        balance_rel: float = 1.5,
        affinity_threshold: float = 0.5,
        history_blocks: int = 4096,
    ) -> None:
        if not callable(getattr(clock, "sleep_until_ns_async", None)):
            raise ValueError(f"clock must be a WaitingClock, got {clock!r}")
        links = list(replicas)
        self.replicas = ReplicaSet(
            [link.name for link in links],
            block_size=block_size,
            balance_abs_tokens=balance_abs_tokens,
            balance_rel=balance_rel,
            affinity_threshold=affinity_threshold,
            history_blocks=history_blocks,
        )
        self._links = {link.name: link for link in links}
        self._clock = clock
        self._max_outstanding = positive_int("max_outstanding_tokens", max_outstanding_tokens)
        self._retry_after = positive_int("retry_after_ns", retry_after_ns)
        self._stall = positive_int("stall_timeout_ns", stall_timeout_ns)
        self._probe_interval = positive_int("probe_interval_ns", probe_interval_ns)
        self._probe_timeout = positive_int("probe_timeout_ns", probe_timeout_ns)
        if (
            isinstance(max_failovers, bool)
            or not isinstance(max_failovers, int)
            or max_failovers < 0
        ):
            raise ValueError(f"max_failovers must be an int >= 0, got {max_failovers!r}")
        self._max_failovers = max_failovers
        self._streams: dict[str, _RoutedStream] = {}  # requests not ended, by id
        self._in_flight = dict.fromkeys(self._links, 0)  # attempts on each replica
        # Each replica's last event, or the start of its first attempt after it was idle.
        self._heard = dict.fromkeys(self._links, 0)
        self._tasks: anyio.abc.TaskGroup | None = None
        self._background = anyio.CancelScope()  # the watchdog and the prober
        self._state = "new"
        self._started = 0  # the clock's reading when the router was entered
        self._attempt_started = anyio.Event()  # wakes an idle watchdog
        self._attempt_ended = anyio.Event()  # wakes drain()
        # Statistics.
        self._routed = dict.fromkeys(self._links, 0)
        self._by_affinity = self._by_balance = self._failover_count = self._refused = 0

    # -- lifetime ---------------------------------------------------------------------------
    async def __aenter__(self) -> Router:
        if self._state != "new":
            raise RuntimeError("a Router is entered once")
        self._started = self._clock.now_ns()
        self._tasks = anyio.create_task_group()
        await self._tasks.__aenter__()
        self._tasks.start_soon(self._run_background)
        self._state = "open"
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        self._close()
        assert self._tasks is not None
        return await self._tasks.__aexit__(exc_type, exc, tb)

    async def aclose(self) -> None:
        """End every stream (``ReplicaError``), close every attempt, stop probing."""
        self._close()
        await anyio.lowlevel.checkpoint()

    def _close(self) -> None:
        if self._state == "closed":
            return
        self._state = "closed"
        for stream in list(self._streams.values()):
            self._end(stream, error=ReplicaError(f"the router closed: {stream.rid!r} ended"))
        self._background.cancel()

    # -- the client's side ------------------------------------------------------------------
    def generate(self, request: Request) -> TokenStream:
        """Admit ``request`` and route it; its stream raises ``Overloaded`` on the first
        read if every replica refuses it, ``ReplicaError`` if it cannot be served."""
        if not isinstance(request, Request):
            raise TypeError(f"request must be an api.Request, got {request!r}")
        if self._state != "open":
            if self._state == "new":
                raise RuntimeError("generate() needs the router running: `async with`")
            raise ReplicaError(f"the router is closed: request {request.rid!r} refused")
        if request.rid in self._streams:
            raise ValueError(f"request {request.rid!r} is already in flight")
        weight = len(request.prompt) + request.max_new_tokens
        if weight > self._max_outstanding:
            raise ValueError(
                f"request {request.rid!r} weighs {weight} tokens, more than "
                f"max_outstanding_tokens={self._max_outstanding}: it could never be admitted"
            )
        if self.replicas.total_load() + weight > self._max_outstanding:
            self._refused += 1
            raise Overloaded(
                f"request {request.rid!r} refused: {self.replicas.total_load()} tokens "
                f"outstanding, +{weight} exceeds max_outstanding_tokens={self._max_outstanding}",
                retry_after_ns=self._retry_after,
            )
        if not self.replicas.available():
            raise ReplicaError(f"request {request.rid!r}: no replica is up and not draining")
        stream = self._streams[request.rid] = _RoutedStream(self, request)
        self._start(stream)
        return stream

    def _left(self, stream: _RoutedStream) -> None:
        """The client closed its stream or was cancelled: its attempt ends now."""
        if self._streams.get(stream.rid) is stream:
            self._stop_attempt(stream)
            del self._streams[stream.rid]

    # -- attempts ---------------------------------------------------------------------------
    def _start(self, stream: _RoutedStream) -> None:
        """Route ``stream``'s request (as it now stands) and start its attempt; end the
        stream if no replica can take it."""
        request = stream.resubmission()
        route = self.replicas.pick(request.prompt, exclude=stream.refusals)
        if route is None:
            if stream.refusals:
                retry = min(stream.refusals.values())
                self._end(
                    stream,
                    error=Overloaded(
                        f"request {stream.rid!r}: every replica refused it", retry_after_ns=retry
                    ),
                )
            else:
                self._end(stream, error=ReplicaError(f"request {stream.rid!r}: no replica left"))
            return
        self._by_affinity += route.why == "affinity"
        self._by_balance += route.why == "balance"
        self._routed[route.replica] += 1
        stream.attempts += 1
        self.replicas.assign(route.replica, stream.rid, request.prompt, request.max_new_tokens)
        if not self._in_flight[route.replica]:
            self._heard[route.replica] = self._clock.now_ns()  # its silence starts now
        self._in_flight[route.replica] += 1
        attempt = _Attempt(route.replica, stream.epoch, anyio.CancelScope())
        stream.attempt = attempt
        assert self._tasks is not None
        self._tasks.start_soon(self._pump, stream, attempt, request)
        self._attempt_started.set()

    async def _pump(self, stream: _RoutedStream, attempt: _Attempt, request: Request) -> None:
        """Carry one attempt's events into the client's stream, until it ends or is
        superseded."""
        completion = self._links[attempt.replica].stream(request)
        try:
            with attempt.scope:
                async for tokens, reason in completion:
                    if stream.epoch != attempt.epoch:
                        return  # superseded: a late event of an attempt that lost the request
                    self._accept(stream, attempt, tokens, reason)
                    if reason is not None:
                        return
                raise ReplicaError(f"replica {attempt.replica!r}: the stream ended unfinished")
        except Overloaded as busy:
            if stream.epoch == attempt.epoch:
                self._refused_by(stream, attempt, busy.retry_after_ns)
        except ReplicaError as error:
            if stream.epoch == attempt.epoch:
                self._replica_failed(attempt.replica, f"{error}")
        finally:
            with anyio.CancelScope(shield=True):
                await completion.aclose()
            self._attempt_ended.set()
            self._attempt_ended = anyio.Event()

    def _accept(
        self,
        stream: _RoutedStream,
        attempt: _Attempt,
        tokens: tuple[int, ...],
        reason: FinishReason | None,
    ) -> None:
        self._heard[attempt.replica] = self._clock.now_ns()
        stream.refusals.clear()
        room = stream.request.max_new_tokens - len(stream.accepted)
        stream.accepted.extend(tokens[:room])  # a replica never gets to exceed the budget
        self.replicas.progress(stream.rid, len(tokens))
        if reason is not None:
            self._end(stream, reason=reason)
        else:
            stream._wake()

    def _refused_by(self, stream: _RoutedStream, attempt: _Attempt, retry_after_ns: int) -> None:
        """A replica answered 429: not a failure; try the others."""
        self._stop_attempt(stream)
        stream.refusals[attempt.replica] = retry_after_ns
        self._start(stream)

    def _replica_failed(self, name: str, why: str) -> None:
        """``name`` is down: every request in flight there fails over, each once."""
        self._replicas_failed({name: why})

    def _replicas_failed(self, whys: dict[str, str]) -> None:
        """Every replica named is down; then every request in flight on one fails over,
        each once — after all are marked, so that none moves onto another of them."""
        for name in whys:
            self.replicas.mark_down(name)
        moving = [
            (s, whys[s.attempt.replica])
            for s in self._streams.values()
            if s.attempt and s.attempt.replica in whys
        ]
        for stream, why in moving:
            self._fail_over(stream, why)

    def _fail_over(self, stream: _RoutedStream, why: str) -> None:
        self._stop_attempt(stream)
        # The replica may die between its last token and the event that ends the request.
        if stream.accepted and stream.accepted[-1] in stream.request.stop_tokens:
            self._end(stream, reason="stop")
            return
        if len(stream.accepted) >= stream.request.max_new_tokens:
            self._end(stream, reason="length")  # nothing left to generate
            return
        if stream.failovers >= self._max_failovers:
            self._end(
                stream,
                error=ReplicaError(
                    f"request {stream.rid!r}: failed over {stream.failovers} times "
                    f"(max_failovers), last: {why}"
                ),
            )
            return
        stream.failovers += 1
        self._failover_count += 1
        stream.refusals.clear()
        self._start(stream)

    def _stop_attempt(self, stream: _RoutedStream) -> None:
        """End ``stream``'s attempt: a new epoch, its task cancelled, its load released."""
        stream.epoch += 1
        if stream.attempt is not None:
            stream.attempt.scope.cancel()
            self._in_flight[stream.attempt.replica] -= 1
            stream.attempt = None
        self.replicas.release(stream.rid)

    def _end(
        self,
        stream: _RoutedStream,
        *,
        reason: FinishReason | None = None,
        error: Exception | None = None,
    ) -> None:
        self._stop_attempt(stream)
        stream.reason, stream.error = reason, error
        self._streams.pop(stream.rid, None)
        stream._wake()

    # -- health -----------------------------------------------------------------------------
    async def _run_background(self) -> None:
        with self._background:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._watch_silence)
                tg.start_soon(self._probe_forever)

    async def _watch_silence(self) -> None:
        """Presume dead a replica that has requests in flight and has sent nothing for
        ``stall_timeout_ns``. Silence is the replica's, not a request's: a request may
        wait in a busy replica's queue for long, while the replica streams others."""
        while True:
            busy = [name for name, n in self._in_flight.items() if n]
            if not busy:
                self._attempt_started = anyio.Event()
                await self._attempt_started.wait()
                continue
            now = self._clock.now_ns()
            since = min(self._heard[name] for name in busy)
            if now - since < self._stall:
                await self._clock.sleep_until_ns_async(since + self._stall)
                continue
            # Every replica silent this long is down at once, before any request moves.
            self._replicas_failed(
                {
                    name: f"replica {name!r} silent for {now - self._heard[name]} ns with "
                    f"requests in flight (stall_timeout_ns={self._stall})"
                    for name in busy
                    if now - self._heard[name] >= self._stall
                }
            )

    async def _probe_forever(self) -> None:
        due = self._started + self._probe_interval  # the first round: from the router's start
        while True:
            await self._clock.sleep_until_ns_async(due)
            await self.check_health()
            due = self._clock.now_ns() + self._probe_interval

    async def check_health(self) -> None:
        """Probe every replica at once, each for at most ``probe_timeout_ns``: one that
        answers is up (again); one that does not is down, its requests failed over."""
        results: dict[str, bool] = {}
        async with anyio.create_task_group() as tg:
            for name in self._links:
                tg.start_soon(self._probe, name, results)
        for name, ok in results.items():
            if ok:
                self.replicas.mark_up(name)
        self._replicas_failed(
            {
                name: f"replica {name!r} failed its health probe"
                for name, ok in results.items()
                if not ok and self.replicas.is_up(name)
            }
        )

    async def _probe(self, name: str, results: dict[str, bool]) -> None:
        results[name] = False
        deadline = self._clock.now_ns() + self._probe_timeout
        async with anyio.create_task_group() as tg:

            async def ask() -> None:
                # Whatever goes wrong in a probe, the replica did not say it serves.
                with contextlib.suppress(Exception):
                    results[name] = await self._links[name].healthy() is True
                tg.cancel_scope.cancel()

            async def timer() -> None:
                await self._clock.sleep_until_ns_async(deadline)
                tg.cancel_scope.cancel()

            tg.start_soon(ask)
            tg.start_soon(timer)

    # -- draining ---------------------------------------------------------------------------
    async def drain(self, name: str) -> None:
        """Route nothing more to ``name`` (failovers included), and return once every
        request in flight there has ended."""
        if name not in self._links:
            raise ValueError(f"no replica named {name!r}")
        self.replicas.drain(name)
        while self._in_flight[name]:
            await self._attempt_ended.wait()
        await anyio.lowlevel.checkpoint()

    def restore(self, name: str) -> None:
        """Route to ``name`` again after a drain."""
        if name not in self._links:
            raise ValueError(f"no replica named {name!r}")
        self.replicas.restore(name)

    # -- observation ------------------------------------------------------------------------
    def statistics(self) -> RouterStatistics:
        names = list(self._links)
        return RouterStatistics(
            routed=dict(self._routed),
            by_affinity=self._by_affinity,
            by_balance=self._by_balance,
            failovers=self._failover_count,
            refused=self._refused,
            outstanding=self.replicas.loads(),
            down=tuple(n for n in names if not self.replicas.is_up(n)),
            draining=tuple(n for n in names if self.replicas.is_draining(n)),
        )


__all__ = ["ReplicaSet", "Router"]
