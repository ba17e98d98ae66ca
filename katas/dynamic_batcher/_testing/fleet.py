"""Drivers for the stage-3 suite: replicas in process and in virtual time, that die,
stop and come back exactly when a test says.

A :class:`SimReplica` is one replica as the router sees it through
:class:`~katas.dynamic_batcher.api.ReplicaLink`: your stage-2 ``AsyncEngine`` over your
``PrefixCachingBatcher`` on the fleet's ``ManualClock``, every step one ``STEP_NS``. Its
faults are the real ones, placed at a token:

- ``kill()`` — SIGKILL: every open stream breaks (``ReplicaError``) at its next read,
  nothing new connects, probes fail; the engine and its cache are gone.
- ``die_after(rid, n)`` — the replica dies the moment the ``n``-th token it sends for
  ``rid`` (any attempt of it: ``rid`` or ``rid#k``) has reached the router (the rest of
  that event is lost with it).
- ``stop()`` / ``resume()`` — SIGSTOP / SIGCONT: streams and probes hang; what the
  engine produced meanwhile arrives late, after ``resume()``.
- ``break_stream(rid, after=n)`` — one stream's answer breaks after ``n`` tokens (a
  garbled event): the process lives on.
- ``restart()`` — a fresh engine under the same name, its cache empty.
- ``refuse(n, retry_after_ns)`` — the next ``n`` connections are answered 429.
- ``babble(rid)`` — the last event of ``rid`` carries one token past its budget.
- ``probe_error`` — an exception every health probe raises while it is set; ``probes``
  records the instant of every probe.

A :class:`Fleet` holds the replicas, the clock and :class:`VirtualTime`, and builds the
router under test over them with the suite's defaults; ``Fleet.routing`` arranges a
router test at once (the fleet running, the router serving, its :class:`Clients`
started), and ``Fleet.serve`` runs the clients to their ends besides.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Protocol, TypeVar

import anyio
import anyio.abc
import anyio.lowlevel

from katas._harness.story import check
from katas._harness.under_test import stage
from katas._harness.virtual_time import VirtualTime
from katas._runtime.clock import ManualClock
from katas.dynamic_batcher.api import (
    CachingBatcher,
    Engine,
    FinishReason,
    Overloaded,
    PrefixCacheStatistics,
    ReplicaError,
    Request,
    RouterStatistics,
    RoutingPolicy,
    StepOutput,
    StreamRouter,
    TokenStream,
)

from .engine import STEP_NS, T0, VOCAB, Reader
from .model import FakeModel, reference_outputs

SEED = 7
#: The suite's stall timeout: 50 steps of silence and a replica is presumed dead.
STALL = 50 * STEP_NS
#: The suite's probe timeout: a health probe unanswered for 20 steps has failed.
PROBE_TIMEOUT = 20 * STEP_NS
#: The router's settings in the suite (and the pictures), besides its clock and block size.
ROUTER_SETTINGS: dict[str, int] = {
    "max_outstanding_tokens": 1_000_000,
    "retry_after_ns": 1_000 * STEP_NS,
    "stall_timeout_ns": STALL,
    "probe_interval_ns": 10_000 * STEP_NS,
    "probe_timeout_ns": PROBE_TIMEOUT,
}


@dataclass
class SimReplica:
    """One replica in process (see the module's docstring)."""

    name: str
    clock: ManualClock
    num_blocks: int = 256
    block_size: int = 4
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 64
    max_waiting: int = 64
    step_ns: int = STEP_NS
    #: Every request this replica was asked to generate, in order (resubmissions too).
    seen: list[Request] = field(default_factory=list)
    #: Streams opened and closed by the router (a stream is closed when the router is done).
    opened: int = 0
    closed: int = 0
    lives: int = 0  # 1 after the first start, +1 per restart
    #: The stage-2 module whose engine it runs: the code under test's unless given (a
    #: picture runs outside a test, on a selection's module).
    stage2: ModuleType | None = None

    def __post_init__(self) -> None:
        self.dead = True
        self._running = anyio.Event()
        self._running.set()
        self._fault: tuple[str, int] | None = None  # die after this token of this request
        self._breaks: dict[str, int] = {}
        self._quiet_ends: dict[str, int] = {}
        self._refusals: list[int] = []  # retry hints of the next connections refused
        self._babbles: set[str] = set()
        self.probes: list[int] = []  # the instant of every health probe it received
        self.probe_error: Exception | None = None  # raised by every probe while set
        self._tasks: anyio.abc.TaskGroup | None = None
        self._killed = anyio.Event()
        self.batcher: CachingBatcher  # each life's, from start()
        self.engine: Engine
        self.caches: list[PrefixCacheStatistics] = []  # of engines killed or restarted

    # -- life --------------------------------------------------------------------------------
    def start(self, tasks: anyio.abc.TaskGroup) -> None:
        self._tasks = tasks
        # shared_reads: with a prefix cache, two requests read one cached block in a step
        model = FakeModel(VOCAB, SEED, self.num_blocks, self.block_size, shared_reads=True)
        stage2 = self.stage2 or stage(2)
        self.batcher = stage2.PrefixCachingBatcher(
            model,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            num_blocks=self.num_blocks,
            block_size=self.block_size,
        )
        step_ns = self.step_ns

        def step_time(out: StepOutput) -> int:
            return step_ns

        self.engine = stage2.AsyncEngine(
            self.batcher,
            clock=self.clock,
            step_time_ns=step_time,
            max_waiting=self.max_waiting,
            max_stall_ns=10
            ** 15,  # the router reads what it gets; a stopped link is not a slow reader
        )
        self._killed = anyio.Event()
        self.dead = False
        self.lives += 1
        tasks.start_soon(self._serve, self.engine, self._killed)

    async def _serve(self, engine: Engine, killed: anyio.Event) -> None:
        async with engine:
            await killed.wait()

    def kill(self) -> None:
        if not self.dead:
            self.dead = True
            self.caches.append(self.batcher.cache_statistics())
            self._killed.set()
            self._running.set()  # a killed process is not stopped any more

    def restart(self) -> None:
        assert self._tasks is not None
        self.kill()
        self._running = anyio.Event()
        self._running.set()
        self.start(self._tasks)

    def stop(self) -> None:
        self._running = anyio.Event()

    def resume(self) -> None:
        self._running.set()

    @property
    def stopped(self) -> bool:
        return not self._running.is_set()

    def die_after(self, rid: str, tokens: int) -> None:
        self._fault = (rid, tokens)

    def break_stream(self, rid: str, *, after: int) -> None:
        self._breaks[rid] = after

    def end_quietly(self, rid: str, *, after: int) -> None:
        """End ``rid``'s stream cleanly after ``after`` tokens, with no finish reason (a
        replica that closed the response early, or sent ``[DONE]`` too soon)."""
        self._quiet_ends[rid] = after

    def babble(self, rid: str) -> None:
        """Send one token more than ``rid``'s budget, with its last event."""
        self._babbles.add(rid)

    def refuse(self, n: int, retry_after_ns: int) -> None:
        self._refusals += [retry_after_ns] * n

    def hits(self) -> int:
        """Prompt tokens served from this replica's prefix cache, over all its lives."""
        now = 0 if self.dead else self.batcher.cache_statistics().hit_tokens
        return now + sum(c.hit_tokens for c in self.caches)

    def computed_prompt_tokens(self) -> int:
        """Prompt tokens this replica queried and had to compute (all lives)."""
        stats = list(self.caches) + ([] if self.dead else [self.batcher.cache_statistics()])
        return sum(c.queried_tokens - c.hit_tokens for c in stats)

    # -- the link ----------------------------------------------------------------------------
    def stream(self, request: Request) -> SimCompletion:
        return SimCompletion(self, request)

    async def healthy(self) -> bool:
        self.probes.append(self.clock.now_ns())
        await self._running.wait()
        if self.dead:
            raise ReplicaError(f"replica {self.name!r}: connection refused")
        if self.probe_error is not None:
            raise self.probe_error
        return True

    async def wait_running(self) -> None:
        """Wait while stopped. A running replica's event is handed over at once, with no
        checkpoint: a read that woke with an event returns it, whatever happened since."""
        if not self._running.is_set():
            await self._running.wait()

    def _cut(self, rid: str, had: int, tokens: tuple[int, ...]) -> tuple[int, str] | None:
        """How many of ``tokens`` get through before a fault, and which fault."""
        if (
            self._fault is not None
            and self._fault[0] == rid
            and had + len(tokens) >= self._fault[1]
        ):
            return self._fault[1] - had, "die"
        broken = self._breaks.get(rid)
        if broken is not None and had + len(tokens) >= broken:
            return broken - had, "break"
        quiet = self._quiet_ends.get(rid)
        if quiet is not None and had + len(tokens) >= quiet:
            return quiet - had, "end"
        return None


class SimCompletion:
    """One attempt's stream from a :class:`SimReplica` (an ``api.Completion``)."""

    def __init__(self, replica: SimReplica, request: Request) -> None:
        self.replica = replica
        self.request = request
        self._stream: TokenStream | None = None
        self._life = -1
        self._had = 0  # tokens delivered
        self._over = False
        self._broken: str | None = None
        self.closed = False

    def __aiter__(self) -> SimCompletion:
        return self

    async def __anext__(self) -> tuple[tuple[int, ...], FinishReason | None]:
        r = self.replica
        if self._over:
            raise StopAsyncIteration
        if self._broken is not None:
            raise ReplicaError(self._broken)
        if self._stream is None:
            await r.wait_running()  # a stopped process accepts the connection, then says nothing
            await anyio.lowlevel.checkpoint()  # connecting is a round trip
            if r.dead:
                raise ReplicaError(f"replica {r.name!r}: connection refused")
            r.opened += 1
            if r._refusals:
                raise Overloaded(f"replica {r.name!r}: 429", retry_after_ns=r._refusals.pop(0))
            r.seen.append(self.request)
            self._life = r.lives
            try:
                self._stream = r.engine.generate(self.request)
            except Overloaded:
                raise
            except (ValueError, TypeError) as exc:
                raise ReplicaError(f"replica {r.name!r}: status 400: {exc}") from None
        try:
            delivery = await self._stream.__anext__()
        except StopAsyncIteration:
            delivery = None
        await r.wait_running()  # stopped: the event waits in the replica until SIGCONT
        if r.dead or r.lives != self._life:
            raise ReplicaError(f"replica {r.name!r}: the connection died mid-stream")
        if delivery is None:
            raise ReplicaError(f"replica {r.name!r}: the stream ended with no [DONE]")
        tokens, reason = tuple(delivery.tokens), delivery.finish_reason
        client_rid = self.request.rid.partition("#")[0]  # any attempt of the client's request
        cut = r._cut(client_rid, self._had, tokens)
        if cut is not None:
            keep, kind = cut
            tokens, reason = tokens[:keep], None
            if kind == "die":
                r._fault = None
                r.kill()
            elif kind == "end":  # these tokens, then the stream just stops
                del r._quiet_ends[client_rid]
                self._over = True
                if not tokens:
                    raise StopAsyncIteration
                self._had += len(tokens)
                return tokens, None
            else:
                del r._breaks[client_rid]
                self._broken = f"replica {r.name!r}: a truncated event"
            if not tokens:
                raise ReplicaError(
                    self._broken or f"replica {r.name!r}: the connection died mid-stream"
                )
        if reason is not None and client_rid in r._babbles:
            tokens += tokens[-1:] or (0,)  # one token past the budget, with the last event
        self._had += len(tokens)
        self._over = reason is not None
        return tokens, reason

    async def aclose(self) -> None:
        """Close the connection: an await, as a socket's close is, so a close that is not
        shielded from a cancellation never happens."""
        if self.closed:
            return
        if self._stream is not None and not self.replica.dead:
            await self._stream.aclose()
        else:
            await anyio.lowlevel.checkpoint()
        self.closed = True
        self.replica.closed += 1


class RouterUnderTest(StreamRouter, Protocol):
    """The router as the suite reads it: an ``api.StreamRouter`` whose routing policy, the
    ``ReplicaSet`` it asks, is in sight (``replicas``)."""

    @property
    def replicas(self) -> RoutingPolicy: ...


R = TypeVar("R", bound=StreamRouter)

#: Long enough for any test's requests to finish, in simulated ns.
WITHIN = 100_000 * STEP_NS

#: Real seconds a router may take to leave its ``async with`` once its streams are over.
EXIT_S = 2.0


@contextlib.asynccontextmanager
async def serving(router: R, *, exit_s: float = EXIT_S) -> AsyncIterator[R]:
    """``async with router``, with a bound on leaving it. A router whose exit waits for a
    task that never ends — an attempt it superseded and never cancelled, blocked on a
    replica that will not speak again — fails in ``exit_s`` real seconds, saying so,
    instead of hanging the run until a hard deadline."""
    stuck = False
    async with anyio.create_task_group() as guard:
        async with router:
            try:
                yield router
            finally:

                async def watchdog() -> None:
                    nonlocal stuck
                    await anyio.sleep(exit_s)
                    stuck = True
                    guard.cancel_scope.cancel()  # the router's tasks with it

                guard.start_soon(watchdog)
        guard.cancel_scope.cancel()
    check(
        not stuck,
        f"leaving the router's `async with` did not return within {exit_s:g} real "
        "seconds: a task of the router never ended — an attempt it superseded or "
        "closed without cancelling, still reading a replica (rules epoch and router-close)",
    )


@dataclass
class Fleet:
    """Replicas named ``names`` on one virtual clock (``replica`` options for each)."""

    names: Sequence[str] = ("a", "b", "c")
    replica: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.clock = ManualClock(T0)
        self.time = VirtualTime(self.clock)
        self.replicas = {n: SimReplica(n, self.clock, **self.replica) for n in self.names}
        self.block_size = next(iter(self.replicas.values())).block_size

    def __getitem__(self, name: str) -> SimReplica:
        return self.replicas[name]

    @property
    def now(self) -> int:
        return self.clock.now_ns()

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Fleet]:
        async with anyio.create_task_group() as tasks:
            for replica in self.replicas.values():
                replica.start(tasks)
            try:
                yield self
            finally:
                for replica in self.replicas.values():
                    replica.kill()

    def router(self, **options: Any) -> RouterUnderTest:
        """The router under test over every replica, with the suite's defaults."""
        settings: dict[str, Any] = {
            "clock": self.clock,
            "block_size": self.block_size,
            **ROUTER_SETTINGS,
        }
        settings.update(options)
        router: RouterUnderTest = stage().Router(list(self.replicas.values()), **settings)
        return router

    def expected(self, requests: Sequence[Request]) -> dict[str, tuple[int, ...]]:
        """What each request generates (on any replica: they serve one model)."""
        model = FakeModel(VOCAB, SEED, 256, self.block_size, shared_reads=True)
        return reference_outputs(requests, model)

    def hits(self) -> int:
        return sum(r.hits() for r in self.replicas.values())

    # -- clients ---------------------------------------------------------------------------
    def start(
        self, router: StreamRouter, requests: Sequence[Request], tg: anyio.abc.TaskGroup
    ) -> dict[str, Reader]:
        """A client task for each request, reading its stream from ``router``."""
        readers = {r.rid: Reader(router.generate(r), self.clock) for r in requests}
        for reader in readers.values():
            tg.start_soon(reader.run)
        return readers

    async def finish(self, readers: dict[str, Reader], what: str = "every stream to end") -> None:
        """Move virtual time until every reader's stream has ended."""
        await self.time.run_until(lambda: ended(readers), within_ns=WITHIN, what=what)

    @contextlib.asynccontextmanager
    async def routing(
        self, requests: Sequence[Request] = (), **options: Any
    ) -> AsyncIterator[Clients]:
        """The fleet running, the router under test (``options`` over the suite's defaults)
        serving it, and a client task started for each of ``requests``: the arrangement
        of nearly every router test, said once."""
        async with self.running():
            router = self.router(**options)
            async with serving(router), anyio.create_task_group() as tasks:
                yield Clients(self, router, tasks, self.start(router, requests, tasks))

    async def serve(
        self, requests: Sequence[Request], **options: Any
    ) -> tuple[dict[str, Reader], RouterStatistics]:
        """Every request's client read to its end through a router with ``options``: the
        readers, and the router's statistics once the last stream ended."""
        async with self.routing(requests, **options) as clients:
            stats = await clients.finish()
        return clients.readers, stats

    async def consume(self, stream: TokenStream) -> Reader:
        """Read ``stream`` to its end, moving virtual time as needed."""
        reader = Reader(stream, self.clock)
        async with anyio.create_task_group() as tg:
            tg.start_soon(reader.run)
            await self.finish({"r": reader}, f"the stream of {stream.rid!r} to end")
        return reader


@dataclass
class Clients:
    """A router serving a running :class:`Fleet`, and the clients reading from it, by
    request id (from :meth:`Fleet.routing`)."""

    fleet: Fleet
    router: RouterUnderTest
    tasks: anyio.abc.TaskGroup
    readers: dict[str, Reader]

    def start(self, requests: Sequence[Request]) -> None:
        """More clients, started now, one for each of ``requests``."""
        self.readers |= self.fleet.start(self.router, requests, self.tasks)

    @contextlib.contextmanager
    def only(self, name: str) -> Iterator[None]:
        """Inside the block the router may route to ``name`` alone: every other replica
        available is drained, and restored when the block ends."""
        others = [n for n in self.router.replicas.available() if n != name]
        for other in others:
            self.router.replicas.drain(other)
        try:
            yield
        finally:
            for other in others:
                self.router.replicas.restore(other)

    async def finish(self) -> RouterStatistics:
        """Move virtual time until every client's stream has ended; the router's
        statistics then."""
        await self.fleet.finish(self.readers)
        return self.router.statistics()


def ended(readers: dict[str, Reader]) -> bool:
    return all(r.ended != "reading" for r in readers.values())


def expect_whole(readers: dict[str, Reader], want: dict[str, tuple[int, ...]], story: str) -> None:
    """Each client got exactly what its request generates: every token once, in order."""
    for rid, reader in readers.items():
        assert reader.error is None, f"{story}\n  request {rid}: its stream raised {reader.ended}"
        got, n = reader.tokens, len(want[rid])
        extra = f"\n  ({len(got) - n} tokens too many: {list(got[n:])})" if len(got) > n else ""
        assert got == want[rid], (
            f"{story}\n  request {rid}: the client must get every token exactly once, in "
            f"order\n  expected {list(want[rid])}\n  got      {list(got)}{extra}"
        )


__all__ = [
    "EXIT_S",
    "PROBE_TIMEOUT",
    "ROUTER_SETTINGS",
    "SEED",
    "STALL",
    "WITHIN",
    "Clients",
    "Fleet",
    "RouterUnderTest",
    "SimCompletion",
    "SimReplica",
    "ended",
    "expect_whole",
    "serving",
]
