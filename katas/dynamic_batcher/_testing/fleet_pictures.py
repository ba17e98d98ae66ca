"""Routing over replicas, drawn: load and prefix-cache hits under round-robin and under
the Router, and a stream that survives a SIGKILL — in the terminal, or as a PNG.

    python -m katas.dynamic_batcher._testing.fleet_pictures               # your stage 3
    python -m katas.dynamic_batcher._testing.fleet_pictures --impl=solutions --png fleet.png

Both run the stage-3 suite's fleet (:mod:`.fleet`): in-process replicas — the
implementation's stage-2 ``AsyncEngine`` over its ``PrefixCachingBatcher`` — on one
``ManualClock``, every engine step one ``STEP_NS``, moved by ``VirtualTime``: the same
pictures on every run, in about two seconds.

1. **Load.** One shared-prefix workload (:class:`LoadSetup`: twelve 48-token system
   prompts, each request its own suffix, exponential output lengths up to 400: uneven
   work) arrives over time at three replicas (Poisson, 0.4 requests a step), once under
   round-robin and once under the implementation's ``Router``. After every step, each
   replica's outstanding tokens: what a request weighs while it is there — its prompt
   plus its budget until its first token arrives, then the budget left (the weight the
   Router's statistics use; the reference's agree with the meter at every step).
   Round-robin sends request *i* to replica *i* mod 3: :class:`RoundRobin`, a bare
   relay with no load, no prefixes and no failover, so the baseline is plain. Both runs
   are measured by the same :class:`Meter` around each replica's link, never by the
   router's own account; the cache hits are the replicas' own (``SimReplica.hits()``,
   as the suite counts them). The Router has the suite's settings (``Fleet.router``'s).
2. **Failover.** Six requests stream over three replicas; a few steps in, the replica
   serving the first is SIGKILLed (``SimReplica.kill()``: its streams break at their
   next read). A row per request, a column per engine step, each token lettered by the
   replica that streamed it, the kill marked — and whether every stream came out whole.

``--png`` needs the plotting extra (``pip install -e '.[plot]'``). A Router (or anything
the replicas need) still a stub stops it with one line that names what it needs.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType, TracebackType
from typing import Any

import anyio
import anyio.abc

from katas._harness.story import check
from katas._harness.virtual_time import VirtualTime
from katas._registry import impl
from katas._runtime.clock import ManualClock
from katas._runtime.todo import Todo
from katas.dynamic_batcher.api import (
    Completion,
    Delivery,
    FinishReason,
    Overloaded,
    ReplicaError,
    ReplicaLink,
    Request,
    StreamRouter,
)

from . import workload
from .engine import STEP_NS, T0, VOCAB, request
from .fleet import ROUTER_SETTINGS, SEED, SimReplica
from .fleet_charts import Attempt, LoadRun, Timeline, load_chart, save_png, timeline_chart
from .model import FakeModel, reference_outputs

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

KATA = "dynamic_batcher"
NAMES = ("a", "b", "c")
#: What each stage gives the pictures, named when it is still a stub.
NEEDS = {
    1: "your stage 1 (the replicas' batchers stand on it)",
    2: "PrefixCachingBatcher and AsyncEngine (stage 2): every replica runs them",
    3: "ReplicaSet and Router (stage 3, core)",
}
#: Simulated time a picture's run may take before it is called stuck (the reference's
#: load runs take ~600 steps, its failover run ~35).
WITHIN_NS = 20_000 * STEP_NS


class NotWritten(Exception):
    """Something the pictures run is still a stub; the message is the one line to show."""


@dataclass(frozen=True)
class LoadSetup:
    """The load picture's workload and replicas. Twelve system prompts of 12 blocks
    each are more than one replica's cache holds next to its running requests: spread
    over every replica they evict each other; kept apart, each replica holds its own."""

    requests: int = 200
    n_prefixes: int = 12
    prefix_len: int = 48
    suffix_len: tuple[int, int] = (1, 16)
    mean_output: float = 40.0
    max_output: int = 400
    per_step: float = 0.4  # arrivals per engine step, on average (Poisson)
    seed: int = 5
    num_blocks: int = 128  # per replica, of block_size 4

    def workload(self) -> list[Request]:
        return workload.shared_prefixes(
            self.requests,
            n_prefixes=self.n_prefixes,
            prefix_len=self.prefix_len,
            mean_output=self.mean_output,
            seed=self.seed,
            suffix_len=self.suffix_len,
            max_output=self.max_output,
            rate_per_s=self.per_step * 1e9 / STEP_NS,
            vocab_size=VOCAB,
        )


# -- the meter: one account of every attempt, whatever routes it ------------------------------
def original_of(attempt: Request, originals: Mapping[str, Request]) -> Request:
    """The client's request that ``attempt`` (what a router sent a replica) continues: a
    request whose prompt starts ``attempt``'s (a failover resubmits the prompt and the
    tokens accepted), the one of the same id first, then one whose id starts the
    attempt's (the reference sends ``rid#k`` after a failover), then the longest prompt."""

    def continued(o: Request) -> bool:
        return attempt.prompt[: len(o.prompt)] == o.prompt

    same = originals.get(attempt.rid)
    if same is not None and continued(same):
        return same
    found = [o for o in originals.values() if continued(o)]
    if not found:
        raise LookupError(
            f"the router sent {attempt.rid!r}, whose prompt continues none of the requests "
            "its clients sent"
        )
    return max(found, key=lambda o: (attempt.rid.startswith(o.rid), len(o.prompt)))


class Meter:
    """Wraps each replica's link: every attempt a router starts there (the request, its
    output position, each event and when it came) and each replica's outstanding tokens."""

    def __init__(self, clock: ManualClock, originals: Mapping[str, Request]) -> None:
        self.clock = clock
        self.originals = originals
        self.loads: dict[str, int] = {}
        self.attempts: list[Attempt] = []

    def link(self, inner: ReplicaLink) -> MeteredLink:
        self.loads[inner.name] = 0
        return MeteredLink(self, inner)


class MeteredLink:
    """A link that reports to its :class:`Meter` (an ``api.ReplicaLink``)."""

    def __init__(self, meter: Meter, inner: ReplicaLink) -> None:
        self._meter = meter
        self._inner = inner

    @property
    def name(self) -> str:
        return self._inner.name

    def stream(self, request: Request) -> MeteredCompletion:
        return MeteredCompletion(self._meter, self._inner, request)

    async def healthy(self) -> bool:
        return await self._inner.healthy()


class MeteredCompletion:
    """One attempt, charged to its replica from the moment the router asks for it."""

    def __init__(self, meter: Meter, link: ReplicaLink, request: Request) -> None:
        self._meter = meter
        self._inner = link.stream(request)
        self._name = link.name
        original = original_of(request, meter.originals)
        # a failover resubmits the prompt plus every token accepted: where this one starts
        offset = len(request.prompt) - len(original.prompt)
        self.attempt = Attempt(link.name, original.rid, offset, meter.clock.now_ns() - T0)
        meter.attempts.append(self.attempt)
        self._prompt, self._budget = len(request.prompt), request.max_new_tokens
        meter.loads[link.name] += self._prompt + self._budget

    def _release(self) -> None:
        self._meter.loads[self._name] -= self._prompt + self._budget
        self._prompt = self._budget = 0

    def __aiter__(self) -> MeteredCompletion:
        return self

    async def __anext__(self) -> tuple[tuple[int, ...], FinishReason | None]:
        try:
            tokens, reason = await self._inner.__anext__()
        except BaseException:
            self._release()
            raise
        self.attempt.events.append((self._meter.clock.now_ns() - T0, tokens))
        taken = min(len(tokens), self._budget)
        self._meter.loads[self._name] -= self._prompt + taken
        self._prompt, self._budget = 0, self._budget - taken
        if reason is not None:
            self._release()
        return tokens, reason

    async def aclose(self) -> None:
        self._release()
        await self._inner.aclose()


# -- the baseline ------------------------------------------------------------------------------
class RoundRobin:
    """Request *i* goes to replica *i* mod *n*; its events are relayed as they come. No
    load, no prefixes, no failover: the router a first draft would be."""

    def __init__(self, links: Sequence[ReplicaLink]) -> None:
        self._links = list(links)
        self._next = 0

    async def __aenter__(self) -> RoundRobin:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    def generate(self, request: Request) -> Relay:
        link = self._links[self._next % len(self._links)]
        self._next += 1
        return Relay(link.stream(request))


class Relay:
    """One replica's completion as a client's token stream."""

    def __init__(self, completion: Completion) -> None:
        self._completion = completion

    def __aiter__(self) -> Relay:
        return self

    async def __anext__(self) -> Delivery:
        tokens, reason = await self._completion.__anext__()
        return Delivery(tokens, reason)

    async def __aenter__(self) -> Relay:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._completion.aclose()


# -- the runs ----------------------------------------------------------------------------------
@dataclass
class _Fleet:
    """Replicas from ``stage2`` on one virtual clock, each behind a meter's link."""

    stage2: ModuleType
    originals: Mapping[str, Request]
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        self.clock = ManualClock(T0)
        self.time = VirtualTime(self.clock)
        self.replicas = {
            n: SimReplica(n, self.clock, stage2=self.stage2, **self.options) for n in NAMES
        }
        self.meter = Meter(self.clock, self.originals)
        self.links = [self.meter.link(r) for r in self.replicas.values()]

    def hits(self) -> tuple[int, int]:
        """Prompt tokens served from the replicas' caches, and queried, over all lives."""
        hits = sum(r.hits() for r in self.replicas.values())
        return hits, hits + sum(r.computed_prompt_tokens() for r in self.replicas.values())


#: Builds a router over the links on the run's clock.
MakeRouter = Callable[[list[MeteredLink], ManualClock], Any]


async def _load_run(
    name: str, make_router: MakeRouter, stage2: ModuleType, s: LoadSetup
) -> LoadRun:
    requests = s.workload()
    fleet = _Fleet(stage2, {r.rid: r for r in requests}, {"num_blocks": s.num_blocks})
    # built before the replicas start: an unwritten Router is named before stage 2 is
    router = make_router(fleet.links, fleet.clock)
    got: dict[str, list[int]] = {r.rid: [] for r in requests}
    refused: list[str] = []
    ended: list[str] = []
    samples: list[tuple[int, dict[str, int]]] = [(0, dict(fleet.meter.loads))]

    async def client(r: Request) -> None:
        await fleet.clock.sleep_until_ns_async(T0 + r.arrival_ns)
        try:
            # the engine stamps arrivals with its own clock: the workload's offset is ours
            async with router.generate(dataclasses.replace(r, arrival_ns=0)) as stream:
                async for delivery in stream:
                    got[r.rid].extend(delivery.tokens)
        except (Overloaded, ReplicaError):
            refused.append(r.rid)
        finally:
            ended.append(r.rid)

    async with anyio.create_task_group() as tasks:
        for replica in fleet.replicas.values():
            replica.start(tasks)
        async with router, anyio.create_task_group() as clients:
            for r in requests:
                clients.start_soon(client, r)
            while len(ended) < len(requests):
                check(
                    fleet.clock.now_ns() - T0 <= WITHIN_NS,
                    f"{name}: the workload did not end in {WITHIN_NS} ns",
                )
                await fleet.time.advance(STEP_NS)
                samples.append((fleet.clock.now_ns() - T0, dict(fleet.meter.loads)))
        stats = router.statistics() if hasattr(router, "statistics") else None
        for replica in fleet.replicas.values():
            replica.kill()
    expected = reference_outputs(requests, FakeModel(VOCAB, SEED, 256, 4))
    hits, queried = fleet.hits()
    routes = ""
    if stats is not None:
        routes = f"{stats.by_affinity} by affinity, {stats.by_balance} by the imbalance guard"
    return LoadRun(
        name=name,
        replicas=NAMES,
        step_ns=STEP_NS,
        samples=tuple(samples),
        requests=len(requests),
        whole=sum(tuple(got[r.rid]) == expected[r.rid] for r in requests),
        refused=len(refused),
        hit_tokens=hits,
        prompt_tokens=queried,
        routes=routes,
    )


async def _failover(stage3: ModuleType, stage2: ModuleType, kill_step: int) -> Timeline:
    requests = [request(f"r{i}", 9, 32) for i in range(6)]
    fleet = _Fleet(stage2, {r.rid: r for r in requests})
    router = stage3.Router(fleet.links, clock=fleet.clock, block_size=4, **ROUTER_SETTINGS)
    got: dict[str, list[int]] = {r.rid: [] for r in requests}
    ended: dict[str, str] = {}

    async def client(r: Request) -> None:
        try:
            async with router.generate(r) as stream:
                async for delivery in stream:
                    got[r.rid].extend(delivery.tokens)
            ended[r.rid] = "end"
        except Exception as exc:  # what ended it goes into the picture
            ended[r.rid] = repr(exc)

    async with anyio.create_task_group() as tasks:
        for replica in fleet.replicas.values():
            replica.start(tasks)
        async with router, anyio.create_task_group() as clients:
            for r in requests:
                clients.start_soon(client, r)
            await fleet.time.advance(kill_step * STEP_NS + 1)  # just after a step's tokens
            serving = [a.replica for a in fleet.meter.attempts if a.rid == requests[0].rid]
            killed = serving[-1]
            fleet.replicas[killed].kill()
            kill_ns = fleet.clock.now_ns() - T0
            await fleet.time.run_until(
                lambda: len(ended) == len(requests), within_ns=WITHIN_NS, what="every stream's end"
            )
        failovers = router.statistics().failovers
        for replica in fleet.replicas.values():
            replica.kill()
    expected = reference_outputs(requests, FakeModel(VOCAB, SEED, 256, 4))
    return Timeline(
        replicas=NAMES,
        step_ns=STEP_NS,
        killed=killed,
        kill_ns=kill_ns,
        attempts=tuple(fleet.meter.attempts),
        outputs={rid: tuple(tokens) for rid, tokens in got.items()},
        expected=expected,
        ended=ended,
        failovers=failovers,
    )


# -- what the CLI calls --------------------------------------------------------------------------
def _stages(selection: impl.Selection) -> tuple[ModuleType, ModuleType]:
    return selection.stage(KATA, 3), selection.stage(KATA, 2, top=3)


def _todo(exc: BaseException) -> Todo | None:
    """The ``Todo`` that ``exc`` is or holds: anyio groups what tasks raise, and a stub's
    ``Todo`` may be the context of what an unwinding router raised next."""
    seen: set[int] = set()
    stack = [exc]
    while stack:
        e = stack.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, Todo):
            return e
        if isinstance(e, BaseExceptionGroup):
            stack.extend(e.exceptions)
        stack.extend(x for x in (e.__cause__, e.__context__) if x is not None)
    return None


def _run(main: Callable[[], Any]) -> Any:
    try:
        return anyio.run(main)
    except BaseException as exc:
        todo = _todo(exc)
        if todo is None:
            raise
        what, _, where = str(todo).partition(" — ")
        stage = next((n for n in NEEDS if f"stage {n}," in where), 3)
        raise NotWritten(
            f"the picture needs {NEEDS[stage]} — not implemented yet: {what}"
        ) from None


def load_runs(selection: impl.Selection, setup: LoadSetup = LoadSetup()) -> dict[str, LoadRun]:
    """The load picture's two runs, round-robin first; NotWritten names a stub."""
    stage3, stage2 = _stages(selection)

    def round_robin(links: list[MeteredLink], clock: ManualClock) -> RoundRobin:
        return RoundRobin(links)

    def router(links: list[MeteredLink], clock: ManualClock) -> StreamRouter:
        mine: StreamRouter = stage3.Router(links, clock=clock, block_size=4, **ROUTER_SETTINGS)
        return mine

    async def both() -> dict[str, LoadRun]:
        # the Router's run first: a stub Router is named even when stage 2 is one too
        mine = await _load_run("router", router, stage2, setup)
        return {"round-robin": await _load_run("round-robin", round_robin, stage2, setup),
                "router": mine}  # fmt: skip

    found: dict[str, LoadRun] = _run(both)
    return found


def timeline(selection: impl.Selection, kill_step: int = 12) -> Timeline:
    """The failover picture's run: the replica serving ``r0`` killed after ``kill_step``
    steps; NotWritten names a stub."""
    stage3, stage2 = _stages(selection)
    found: Timeline = _run(lambda: _failover(stage3, stage2, kill_step))
    return found


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m katas.dynamic_batcher._testing.fleet_pictures", description=__doc__
    )
    impl.add_selection_options(parser.add_argument, base=True)
    parser.add_argument("--png", type=Path, help="also save the pictures to this PNG")
    args = parser.parse_args(argv)
    selection = impl.resolve(args.impl, args.base)
    try:
        runs = load_runs(selection)
        failover = timeline(selection)
    except NotWritten as exc:
        print(exc, file=sys.stderr)
        return 1
    color = sys.stdout.isatty() and "NO_COLOR" not in os.environ
    print(load_chart(runs))
    print()
    print(timeline_chart(failover, color=color))
    if args.png is not None:
        save_png(runs, failover, args.png)
        print(f"saved {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
