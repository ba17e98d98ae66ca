"""Stage 2 benchmarks: collected only when this file is named on the command line.

    python -m pytest katas/dynamic_batcher/bench_stage2.py --impl=solutions --benchmark-only -q

- ``engine``: 1 000 clients stream their requests through the implementation's
  ``AsyncEngine`` (each reads as fast as it can, on asyncio), against the bare stage-1
  loop — submit everything, ``step()`` until nothing is unfinished — on the same
  workload with the same batcher class. Both run over the ``FakeModel``; the engine's
  clock jumps to each step's end at once (``JumpingClock``), so what is measured is the
  async layer's cost in real CPU time. The spec's target: the engine's tokens per
  second >= 0.7x the bare loop's. A third contender, the ``async floor``
  (:func:`async_floor`), is the least any async layer can cost: the same clients
  reading with ``async for`` from bare futures, and none of the engine's work.
- ``batches``: 64 callers at once through the implementation's ``DynamicBatcher``
  (``max_batch_size=16``: four full batches), through the reference's, and one model
  call per request, against a model whose call costs ``COST_PER_CALL + COST_PER_ITEM * n``
  for a batch of n — an embedding model's shape, where the fixed part dwarfs the
  per-item part. The cost is a CPU spin, not a sleep: the model is one device, so its
  calls cannot overlap (64 concurrent sleeps would all end together and make batching
  look useless), and the batcher's own work runs on the same thread, paid in full. The
  spec's target: >= 5x one call per request (the cost model alone allows 11.7x).

Measured here (the reference as ``--impl``; 2 shared cores): batches 5.1-8.8x on asyncio
and trio, by machine (a round of 64 requests in ~8 ms batched, ~68 ms one by one; the
batcher's own work is ~9 µs a request). The engine: 0.64-0.66x the bare loop, short of
the spec's 0.7x, and the async floor itself only 0.70-0.75x: every client takes each
token as it comes, so every token costs a future, a wake-up through asyncio's loop and
a resumed ``async for`` (~2.7 µs beside the bare loop's ~6.8 µs a token; anyio's
spawning of the 1 000 clients is ~0.3 µs of it), and the engine runs at 0.88-0.94x its
floor. Earlier references measured 0.63-0.64x (each step's tokens copied into a list
and out again), 0.60-0.61x (a frozen ``Delivery`` too), 0.56-0.59x (each read through a
coroutine of its own, asking sniffio for its loop) and 0.42-0.50x (a read parked on an
``anyio.Event``): reader.py says why none of these is done now. Neither inlining the
stream's calls into the loop, nor uvloop (0.61x), nor a read that returns the future
itself with the delivery as its result (no coroutine per read; 0.63-0.67x) gained
anything beyond the noise. A reader
that falls behind takes many tokens per wake-up (the merged delivery), which is where a
real server recovers it.

Contenders run in turn within every round (:func:`katas._harness.bench.interleaved`);
ratios go to ``extra_info`` (``kata bench`` reads them) and stdout. Informational:
benchmarks never fail CI.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from katas._harness.bench import Contender, interleaved, report, say
from katas._harness.under_test import stage
from katas._harness.virtual_time import JumpingClock
from katas._registry import impl as _impl
from katas._runtime.clock import NS_PER_MS, MonotonicClock
from katas.dynamic_batcher._testing.model import FakeModel, step_time_ns
from katas.dynamic_batcher.api import Request

pytestmark = [pytest.mark.stage(2)]

CLIENTS = 1000
ROUNDS = 5
BLOCK = 16
BLOCKS = 4096


def workload() -> list[Request]:
    rng = random.Random(11)
    return [
        Request(f"r{i}", tuple(rng.randrange(32_000) for _ in range(rng.randint(8, 64))),
                rng.randint(16, 96))
        for i in range(CLIENTS)
    ]  # fmt: skip


def continuous_batcher(stage1: ModuleType) -> Any:
    model = FakeModel(vocab_size=32_000, seed=3, num_blocks=BLOCKS, block_size=BLOCK)
    return stage1.ContinuousBatcher(
        model, max_num_seqs=256, max_num_batched_tokens=2048, num_blocks=BLOCKS,
        block_size=BLOCK,
    )  # fmt: skip


@pytest.mark.core
def test_bench_stage2_engine_vs_bare_step_loop(
    benchmark: Any, stage_module: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    benchmark.group = f"stage2 {CLIENTS} streaming clients (interleaved)"
    requests = workload()
    stage1 = stage(1)
    tokens = {"engine": 0, "bare loop": 0, "async floor": 0}

    def bare() -> None:
        b = continuous_batcher(stage1)
        for r in requests:
            b.submit(r)
        now = 0
        produced = 0
        while b.has_unfinished():
            out = b.step(now)
            produced += sum(len(t) for t in out.tokens.values())
            now += step_time_ns(out)
        tokens["bare loop"] = produced

    def engine() -> None:
        got = [0]

        async def main() -> None:
            b = continuous_batcher(stage1)
            async with (
                stage_module.AsyncEngine(
                    b, clock=JumpingClock(), step_time_ns=step_time_ns,
                    max_waiting=CLIENTS, max_stall_ns=10**15,
                ) as eng,
                anyio.create_task_group() as tg,
            ):  # fmt: skip

                async def client(r: Request) -> None:
                    async for delivery in eng.generate(r):
                        got[0] += len(delivery.tokens)

                for r in requests:
                    tg.start_soon(client, r)

        anyio.run(main)
        tokens["engine"] = got[0]

    per_run = interleaved(
        benchmark,
        {
            "engine": Contender(engine, 1),
            "bare loop": Contender(bare, 1),
            "async floor": Contender(lambda: async_floor(stage1, requests, tokens), 1),
        },
        ROUNDS,
    )
    assert tokens["engine"] == tokens["bare loop"] == tokens["async floor"] > 0, (
        f"the three produced {tokens}"
    )
    if math.isnan(per_run["engine"]):
        return
    say(
        capsys,
        ", ".join(f"{n} {s * 1e3:.0f} ms for {tokens[n]} tokens" for n, s in per_run.items()),
    )
    report(benchmark, capsys, "engine_vs_bare_step_loop",
           per_run["bare loop"] / per_run["engine"], ">= 0.7")  # fmt: skip
    report(benchmark, capsys, "async_floor_vs_bare_step_loop",
           per_run["bare loop"] / per_run["async floor"], "informational")  # fmt: skip
    report(benchmark, capsys, "engine_vs_async_floor",
           per_run["async floor"] / per_run["engine"], "informational")  # fmt: skip


def async_floor(stage1: ModuleType, requests: list[Request], tokens: dict[str, int]) -> None:
    """What asyncio allows at best: the same clients, each reading with ``async for``
    from an iterator that parks on one bare future per read and gets the step's tokens
    as the future's result, and a loop that only steps and wakes. No ``Delivery``, no
    merging, no stall clock, no statistics, no cleanup of a reader that leaves: none of
    what the engine must do. A bound to read the engine's ratio against, not a design."""
    got = [0]
    parked: dict[str, asyncio.Future[tuple[int, ...]]] = {}
    finished: set[str] = set()

    class Reads:
        def __init__(self, rid: str) -> None:
            self.rid = rid

        def __aiter__(self) -> Reads:
            return self

        async def __anext__(self) -> tuple[int, ...]:
            if self.rid in finished:
                raise StopAsyncIteration
            future = parked[self.rid] = asyncio.Future()
            return await future

    async def client(rid: str) -> None:
        async for step_tokens in Reads(rid):
            got[0] += len(step_tokens)

    async def steps(b: Any, clock: JumpingClock) -> None:
        while b.has_unfinished():
            now = clock.now_ns()
            out = b.step(now)
            await clock.sleep_until_ns_async(now + step_time_ns(out))
            finished.update(out.finished)
            for rid in out.tokens.keys() | out.finished.keys():
                future = parked.pop(rid, None)
                if future is not None:
                    future.set_result(out.tokens.get(rid, ()))

    async def main() -> None:
        b = continuous_batcher(stage1)
        async with anyio.create_task_group() as tg:
            for r in requests:
                b.submit(r)
                tg.start_soon(client, r.rid)
            tg.start_soon(steps, b, JumpingClock())

    anyio.run(main)
    tokens["async floor"] = got[0]


# -- the request batcher ---------------------------------------------------------------

CALLERS = 64
MAX_BATCH = 16
COST_PER_CALL_S = 1e-3
COST_PER_ITEM_S = 25e-6
DELAY_NS = 2 * NS_PER_MS  # never reached: every batch here is full
BATCH_ROUNDS = 15


def reference() -> ModuleType:
    return _impl.resolve("solutions").stage("dynamic_batcher", 2)


def spin(seconds: float) -> None:
    """Keep the CPU busy for ``seconds``: the device's time, which nothing overlaps."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class Embedder:
    """The model: one call costs ``COST_PER_CALL_S + COST_PER_ITEM_S * n``."""

    def __init__(self) -> None:
        self.calls = 0
        self.items = 0

    async def __call__(self, items: Sequence[int]) -> list[int]:
        self.calls += 1
        self.items += len(items)
        spin(COST_PER_CALL_S + COST_PER_ITEM_S * len(items))
        await anyio.lowlevel.checkpoint()
        return [2 * item + 1 for item in items]


def batched(cls: Any, backend: str, model: Embedder) -> Contender:
    """A round: 64 callers submit through a fresh batcher of ``cls``."""

    async def round_() -> None:
        got = [0] * CALLERS

        async def caller(i: int) -> None:
            got[i] = await batcher.submit(i)

        batcher = cls(
            model, max_batch_size=MAX_BATCH, max_queue_delay_ns=DELAY_NS, clock=MonotonicClock()
        )
        async with batcher, anyio.create_task_group() as tg:
            for i in range(CALLERS):
                tg.start_soon(caller, i)
        assert got == [2 * i + 1 for i in range(CALLERS)], "a caller got another's result"

    return Contender(lambda: anyio.run(round_, backend=backend), CALLERS)


def one_by_one(backend: str, model: Embedder) -> Contender:
    """A round: 64 callers, each awaiting the model with its own item."""

    async def round_() -> None:
        got = [0] * CALLERS

        async def caller(i: int) -> None:
            (got[i],) = await model([i])

        async with anyio.create_task_group() as tg:
            for i in range(CALLERS):
                tg.start_soon(caller, i)
        assert got == [2 * i + 1 for i in range(CALLERS)], "a caller got another's result"

    return Contender(lambda: anyio.run(round_, backend=backend), CALLERS)


@pytest.mark.extended
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_bench_stage2_batches_64_callers_against_one_call_per_request(
    benchmark: Any, stage_module: ModuleType, backend: str, capsys: pytest.CaptureFixture[str]
) -> None:
    benchmark.group = f"stage2 DynamicBatcher, {CALLERS} callers at once ({backend})"
    models = {name: Embedder() for name in ("yours", "reference", "one by one")}
    per_request = interleaved(
        benchmark,
        {
            "DynamicBatcher": batched(stage_module.DynamicBatcher, backend, models["yours"]),
            "reference": batched(reference().DynamicBatcher, backend, models["reference"]),
            "one call per request": one_by_one(backend, models["one by one"]),
        },
        BATCH_ROUNDS,
    )
    yours = models["yours"]
    rounds = yours.items // CALLERS
    assert yours.calls == rounds * (CALLERS // MAX_BATCH), (
        f"{CALLERS} callers at once, max_batch_size={MAX_BATCH}: {CALLERS // MAX_BATCH} full "
        f"batches a round expected; {yours.calls} calls in {rounds} rounds"
    )
    if math.isnan(per_request["DynamicBatcher"]):
        return
    say(
        capsys,
        ", ".join(f"{name} {s * 1e6:.1f} µs a request" for name, s in per_request.items()),
    )
    report(
        benchmark,
        capsys,
        f"batched_vs_one_call_per_request[{backend}]",
        per_request["one call per request"] / per_request["DynamicBatcher"],
        ">= 5",
    )
    report(
        benchmark,
        capsys,
        f"yours_vs_reference[{backend}]",
        per_request["reference"] / per_request["DynamicBatcher"],
        "~1",
    )
