"""Stage 3 benchmarks: collected only when this file is named on the command line.

    python -m pytest katas/dynamic_batcher/bench_stage3.py --impl=solutions --benchmark-only -q

Both run the implementation's ``Router`` on real time (``MonotonicClock``) over real
replica processes (:mod:`._testing.replica`: the implementation's stage-2 engine over its
``PrefixCachingBatcher``, every step a fixed ``step_us`` of real time, serving SSE on
loopback), each reached through an ``HttpLink`` (:mod:`._testing.http_link`).

- ``overhead``: 64 clients at once stream 64 tokens each through the Router over one
  replica, against the same clients streaming from that replica directly
  (``stream_completion``); wall time per streamed token, router over direct. Same
  replica, fresh prompts every round (its prefix cache never serves one round from
  another), contenders in turn. The replica steps every 1 ms (its default) with room
  for all 64 at once. The spec's target: <= 1.3x. Also printed, informational: the
  client process's CPU per token (the median round's), router over direct — what the
  router itself costs, whether or not the wall clock shows it.
- ``failover``: three replicas, six requests streaming through the Router; once the
  first has 10 tokens, the replica serving it is SIGKILLed, and the time until that
  request's stream yields a token that another replica streamed is measured, in the
  replicas' steps; the median of the runs is reported, informational (the spec sets no
  number). Twice: with 2 ms and with 10 ms steps, because the time is a fixed part
  (the dead process torn down before the kernel closes its sockets, a new connection,
  Python on both ends) and a part in steps (the new replica admits the resubmitted
  prompt + accepted tokens at its next step and prefills it in one).

Contenders run in turn within every round (:func:`katas._harness.bench.interleaved`);
ratios go to ``extra_info`` (``kata bench`` reads them) and stdout. Informational:
benchmarks never fail CI.

Measured here (the reference as ``--impl``; 2 shared cores, client and replicas on the
same machine; the file takes ~16 s, mostly starting replica processes):

- overhead: 0.88-1.23x over seven runs, 0.98-1.05x in the last three (~46 against ~45
  µs a token), so the target is met; the spread of single rounds is wide (0.44-2.3x).
  A round is not the engine's 64 steps (~65 ms) but ~190-280 ms: at 64 streams each
  process spends ~40-50 µs of CPU a token — the replica an SSE event per token (JSON,
  h11, a socket write), the client h11 and JSON — and the two share the two cores, so
  the replica's own CPU sets the pace and what the router adds in the client mostly
  hides behind it. The client's CPU: 1.15-1.17x with the router (~46 against ~40 µs a
  token), its relay (a task switch, an event, a ``Delivery``) partly paid back by
  merged deliveries when the client falls behind.
- failover: median 4.4-5.8 steps of 2 ms (8.9-11.6 ms; single runs 3.3-14 steps) and
  2.14-2.23 steps of 10 ms (21.4-22.3 ms). Timed piece by piece: ~3.5 ms from the
  SIGKILL until the client's socket sees the connection end (a bare
  ``stream_completion`` sees the same 3.1-4.0 ms: the process's teardown, presumably,
  as Linux frees its memory before it closes its files), the router's failover at once
  (one ``ReplicaError``, a new attempt 0.1 ms later), then the new attempt's first
  token ~5-9 ms later at 2 ms steps: half a step on average until the
  busy replica's next step, one prefill step, ~0.5-1 ms a real step over its nominal
  time, and loopback HTTP. Both step times fit one line: a failover costs ~1.5 engine
  steps plus ~7 ms (3 + 7 = 10 ms at 2 ms steps, 15 + 7 = 22 ms at 10 ms steps).
"""

from __future__ import annotations

import math
import signal
import statistics
import time
from collections.abc import Iterator, Mapping
from types import ModuleType
from typing import Any

import anyio
import pytest

from katas._harness.bench import Contender, interleaved, report, say
from katas._registry import impl as _impl
from katas._runtime.clock import NS_PER_S, NS_PER_US, MonotonicClock
from katas.dynamic_batcher._testing import replica
from katas.dynamic_batcher._testing.fleet_pictures import original_of
from katas.dynamic_batcher._testing.http_link import HttpLink
from katas.dynamic_batcher._testing.model import reference_outputs
from katas.dynamic_batcher._testing.replica_client import CompletionStream, stream_completion
from katas.dynamic_batcher.api import FinishReason, Request

pytestmark = [pytest.mark.stage(3)]

BLOCK = replica.BLOCK_SIZE
#: A router that never gives up on a replica here but for a broken connection.
ROUTER_SETTINGS = {
    "block_size": BLOCK,
    "max_outstanding_tokens": 10**9,
    "retry_after_ns": NS_PER_S,
    "stall_timeout_ns": 30 * NS_PER_S,
    "probe_interval_ns": 600 * NS_PER_S,
    "probe_timeout_ns": NS_PER_S,
}


class Prompts:
    """Fresh prompts: a replica's prefix cache never serves one round from another's."""

    def __init__(self) -> None:
        self._n = 0

    def requests(self, n: int, tokens: int, tag: str) -> list[Request]:
        out = []
        for _ in range(n):
            self._n += 1
            base = self._n * 8
            prompt = tuple((base + i * 7919) % replica.VOCAB for i in range(8))
            out.append(Request(f"{tag}{self._n}", prompt, tokens))
        return out


def router_for(stage_module: ModuleType, links: list[Any]) -> Any:
    return stage_module.Router(links, clock=MonotonicClock(), **ROUTER_SETTINGS)


# -- the router's cost per token ------------------------------------------------------------
CLIENTS = 64
TOKENS = 64
ROUNDS = 11
NUM_BLOCKS = 4096  # every request's KV at once: no preemption
OVERHEAD_REPLICA = {
    "batcher": "prefix",
    "max_num_seqs": CLIENTS,
    "max_num_batched_tokens": 1024,
    "num_blocks": NUM_BLOCKS,
    "max_waiting": 2 * CLIENTS,
    "step_us": 1_000,
    "suite_stage": 3,
}


@pytest.mark.core
def test_bench_stage3_router_overhead_per_streamed_token(
    benchmark: Any,
    stage_module: ModuleType,
    impl_selection: _impl.Selection,
    capsys: pytest.CaptureFixture[str],
) -> None:
    benchmark.group = f"stage3 {CLIENTS} clients x {TOKENS} tokens over one replica process"
    prompts = Prompts()
    outputs: dict[str, list[tuple[Request, tuple[int, ...]]]] = {"router": [], "direct": []}
    cpu_s: dict[str, list[float]] = {"router": [], "direct": []}  # this process's, a round

    def timed_cpu(name: str, main: Any) -> None:
        start = time.process_time()
        anyio.run(main)
        cpu_s[name].append(time.process_time() - start)

    with replica.running(impl_selection, "a", **OVERHEAD_REPLICA) as server:
        link = HttpLink("a", server.url)

        def through_router() -> None:
            async def main() -> None:
                batch = prompts.requests(CLIENTS, TOKENS, "r")
                got: dict[str, list[int]] = {r.rid: [] for r in batch}

                async def client(r: Request) -> None:
                    async with router.generate(r) as stream:
                        async for delivery in stream:
                            got[r.rid].extend(delivery.tokens)

                async with (
                    router_for(stage_module, [link]) as router,
                    anyio.create_task_group() as tg,
                ):
                    for r in batch:
                        tg.start_soon(client, r)
                outputs["router"] += [(r, tuple(got[r.rid])) for r in batch]

            timed_cpu("router", main)

        def direct() -> None:
            async def main() -> None:
                batch = prompts.requests(CLIENTS, TOKENS, "d")
                got: dict[str, list[int]] = {r.rid: [] for r in batch}

                async def client(r: Request) -> None:
                    async with stream_completion(server.url, r, idle_timeout_s=None) as stream:
                        async for tokens, _ in stream:
                            got[r.rid].extend(tokens)

                async with anyio.create_task_group() as tg:
                    for r in batch:
                        tg.start_soon(client, r)
                outputs["direct"] += [(r, tuple(got[r.rid])) for r in batch]

            timed_cpu("direct", main)

        per_token = interleaved(
            benchmark,
            {
                "router": Contender(through_router, CLIENTS * TOKENS),
                "direct": Contender(direct, CLIENTS * TOKENS),
            },
            ROUNDS,
        )
    model = replica.model(num_blocks=NUM_BLOCKS)
    for name, done in outputs.items():
        expected = reference_outputs([r for r, _ in done], model)
        wrong = [r.rid for r, tokens in done if tokens != expected[r.rid]]
        assert not wrong, f"{name}: {len(wrong)} streams are not their generation: {wrong[:5]}"
    if math.isnan(per_token["router"]):
        return
    # the median round's: how much the client's work is depends on how its reads merged
    cpu = {name: statistics.median(taken) / (CLIENTS * TOKENS) for name, taken in cpu_s.items()}
    say(
        capsys,
        ", ".join(f"{name} {s * 1e6:.1f} µs a token" for name, s in per_token.items())
        + f" (a round: {CLIENTS * TOKENS} tokens, {OVERHEAD_REPLICA['step_us']} µs steps); "
        "the client's CPU: "
        + ", ".join(f"{name} {s * 1e6:.1f} µs a token" for name, s in cpu.items()),
    )
    report(
        benchmark, capsys, "router_vs_direct_per_token", per_token["router"] / per_token["direct"],
        "<= 1.3",
    )  # fmt: skip
    report(
        benchmark, capsys, "router_vs_direct_client_cpu_per_token",
        cpu["router"] / cpu["direct"], "informational",
    )  # fmt: skip


# -- the failover -------------------------------------------------------------------------------
#: Real step times of the failover's replicas: the failover has fixed costs (a process
#: torn down, a connection) and costs in steps (the new replica's), told apart by two.
FAILOVER_STEPS_US = (2_000, 10_000)
FAILOVER_RUNS = 7
STREAMS = 6
KILL_AFTER = 10  # tokens of the watched request
FAILOVER_REPLICA = {"batcher": "prefix", "num_blocks": 1024, "suite_stage": 3}


class Watched:
    """A link that notes, per request its clients sent, which replica each attempt went
    to and how many tokens it streamed (an attempt after a failover may have an id of the
    router's making: :func:`original_of` tells whose it is)."""

    def __init__(
        self,
        inner: HttpLink,
        originals: Mapping[str, Request],
        attempts: dict[str, list[tuple[str, list[int]]]],
    ) -> None:
        self._inner = inner
        self._originals = originals
        self._attempts = attempts

    @property
    def name(self) -> str:
        return self._inner.name

    def stream(self, request: Request) -> Counted:
        count = [0]
        rid = original_of(request, self._originals).rid
        self._attempts.setdefault(rid, []).append((self.name, count))
        return Counted(self._inner.stream(request), count)

    async def healthy(self) -> bool:
        return await self._inner.healthy()


class Counted:
    """A completion that counts the tokens it streamed."""

    def __init__(self, inner: CompletionStream, count: list[int]) -> None:
        self._inner = inner
        self._count = count

    def __aiter__(self) -> Counted:
        return self

    async def __anext__(self) -> tuple[tuple[int, ...], FinishReason | None]:
        tokens, reason = await self._inner.__anext__()
        self._count[0] += len(tokens)
        return tokens, reason

    async def aclose(self) -> None:
        await self._inner.aclose()


class Fleet:
    """Three replica processes stepping every ``step_us``; a killed one is replaced."""

    def __init__(self, selection: _impl.Selection, step_us: int) -> None:
        self.selection = selection
        self.step_us = step_us
        self.processes: dict[str, replica.ReplicaProcess] = {}
        for name in ("a", "b", "c"):
            self.replace(name)

    def replace(self, name: str) -> None:
        old = self.processes.pop(name, None)
        if old is not None:
            old.close()
        self.processes[name] = replica.ReplicaProcess(
            self.selection, name, step_us=self.step_us, **FAILOVER_REPLICA
        )

    def close(self) -> None:
        for process in self.processes.values():
            process.close()


@pytest.fixture(params=FAILOVER_STEPS_US, ids=lambda us: f"{us}us_steps")
def fleet(request: pytest.FixtureRequest, impl_selection: _impl.Selection) -> Iterator[Fleet]:
    started = Fleet(impl_selection, request.param)
    try:
        yield started
    finally:
        started.close()


@pytest.mark.extended
def test_bench_stage3_sigkill_to_the_next_token_on_another_replica(
    benchmark: Any,
    stage_module: ModuleType,
    fleet: Fleet,
    capsys: pytest.CaptureFixture[str],
) -> None:
    benchmark.group = f"stage3 SIGKILL to the next token, {fleet.step_us} µs steps"
    prompts = Prompts()
    took_s: list[float] = []
    whole: list[bool] = []
    killed: list[str] = []

    def one_failover() -> float:
        async def main() -> float:
            batch = prompts.requests(STREAMS, 400, "f")
            originals = {r.rid: r for r in batch}
            attempts: dict[str, list[tuple[str, list[int]]]] = {}
            links = [
                Watched(HttpLink(n, p.url), originals, attempts) for n, p in fleet.processes.items()
            ]
            watched = batch[0].rid
            got: dict[str, list[int]] = {r.rid: [] for r in batch}
            moment: dict[str, float] = {}
            reached = anyio.Event()
            dead: list[str] = []

            async def client(r: Request) -> None:
                async with router.generate(r) as stream:
                    async for delivery in stream:
                        got[r.rid].extend(delivery.tokens)
                        if r.rid != watched:
                            continue
                        if len(got[watched]) >= KILL_AFTER:
                            reached.set()
                        if dead and "token" not in moment:
                            # tokens past what the dead replica streamed came from another
                            streamed = sum(c[0] for n, c in attempts[watched] if n == dead[0])
                            if len(got[watched]) > streamed:
                                moment["token"] = time.perf_counter()
                                tg.cancel_scope.cancel()

            async with router_for(stage_module, links) as router, anyio.create_task_group() as tg:
                for r in batch:
                    tg.start_soon(client, r)
                with anyio.fail_after(30):
                    await reached.wait()
                victim = attempts[watched][-1][0]
                dead.append(victim)
                moment["kill"] = time.perf_counter()
                fleet.processes[victim].process.send(signal.SIGKILL)
                await anyio.sleep(30)  # the watched client cancels it when its token comes
                raise AssertionError("no token from another replica within 30 s")
            killed.append(victim)
            prefix = got[watched]
            expected = reference_outputs([batch[0]], replica.model())[watched]
            whole.append(tuple(prefix) == expected[: len(prefix)])
            return moment["token"] - moment["kill"]

        seconds = anyio.run(main)
        took_s.append(seconds)
        fleet.replace(killed[-1])  # untimed work, but inside the round: the next one needs it
        return seconds

    interleaved(benchmark, {"failover": Contender(one_failover, 1, self_timed=True)}, FAILOVER_RUNS)
    assert all(whole), "a stream lost or repeated a token across the failover"
    if benchmark.stats is None:
        return
    step_s = fleet.step_us * NS_PER_US / NS_PER_S
    steps = sorted(s / step_s for s in took_s)
    benchmark.extra_info["failover_steps"] = [round(s, 2) for s in steps]
    say(
        capsys,
        f"SIGKILL to the next token on another replica, {len(steps)} runs, in steps of "
        f"{fleet.step_us} µs: "
        + ", ".join(f"{s:.2f}" for s in steps)
        + f" (median {statistics.median(took_s) * 1e3:.1f} ms)",
    )
    report(
        benchmark, capsys, f"sigkill_to_next_token_steps_median[{fleet.step_us}us]",
        statistics.median(steps), "informational",
    )  # fmt: skip
