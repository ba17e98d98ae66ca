"""Drivers for the stage-2 engine's suite: an engine on a ``FakeModel`` in virtual time,
and readers that take a stream's deliveries at chosen instants.

:class:`Rig` builds the learner's stage-1 ``ContinuousBatcher`` over a ``FakeModel``,
the stage-2 ``AsyncEngine`` over it, and a :class:`~katas._harness.virtual_time.VirtualTime`
to move the clock; ``fixed_step`` makes every step take the same time, so a test knows
the instant of every step's start and end. A :class:`Reader` records each delivery
with the instant it was taken, and what ended its stream.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio

from katas._harness.story import check
from katas._harness.under_test import stage
from katas._harness.virtual_time import VirtualTime
from katas._runtime.clock import NS_PER_S, ManualClock, WaitingClock
from katas._runtime.todo import Todo
from katas.dynamic_batcher.api import (
    Delivery,
    Engine,
    FinishReason,
    PagedBatcher,
    Request,
    StepOutput,
    TokenStream,
)

from .model import FakeModel, reference_outputs

#: The engine's clock starts here (a step of the tests' fixed cost is 1 µs).
T0 = 1_000 * NS_PER_S
STEP_NS = 1_000
VOCAB = 1_000


def fixed_step(ns: int = STEP_NS) -> Callable[[StepOutput], int]:
    """Every step takes ``ns``: a test knows each step's start and end."""
    return lambda out: ns


class ReadOnlyClock:
    """A clock that tells the time and cannot wait: not a waiting clock (bad input)."""

    def now_ns(self) -> int:
        return T0


@dataclass
class Rig:
    """An engine over the learner's stage-1 batcher, in virtual time."""

    max_num_seqs: int = 4
    max_num_batched_tokens: int = 64
    num_blocks: int = 64
    block_size: int = 4
    max_waiting: int = 64
    max_stall_ns: int = 1_000 * STEP_NS
    step_time_ns: Callable[[StepOutput], int] = field(default_factory=fixed_step)
    seed: int = 7

    def __post_init__(self) -> None:
        self.clock = ManualClock(T0)
        self.time = VirtualTime(self.clock)
        self.model = FakeModel(VOCAB, self.seed, self.num_blocks, self.block_size)
        self.batcher: PagedBatcher = stage(1).ContinuousBatcher(
            self.model,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            num_blocks=self.num_blocks,
            block_size=self.block_size,
        )
        self.engine = self.engine_with()

    def engine_with(self, **changed: object) -> Engine:
        """An engine over this rig's batcher, with the rig's settings but ``changed`` (a
        bad-input test spoils one of them)."""
        settings: dict[str, Any] = {
            "clock": self.clock,
            "step_time_ns": self.step_time_ns,
            "max_waiting": self.max_waiting,
            "max_stall_ns": self.max_stall_ns,
            **changed,
        }
        engine: Engine = stage().AsyncEngine(self.batcher, **settings)
        return engine

    @property
    def now(self) -> int:
        return self.clock.now_ns()

    def expected(self, requests: Sequence[Request]) -> dict[str, tuple[int, ...]]:
        """What each request generates alone (batching is invisible)."""
        return reference_outputs(requests, self.model)

    async def consume(
        self, stream: TokenStream, what: str = "the stream to end", *, pace_ns: int = 0
    ) -> Reader:
        """Read ``stream`` to its end (``pace_ns`` between reads), moving virtual time as
        needed; ``what`` names the wait if it never ends."""
        reader = Reader(stream, self.clock, pace_ns)
        async with anyio.create_task_group() as tg:
            tg.start_soon(reader.run)
            await self.time.run_until(
                lambda: reader.ended != "reading", within_ns=10_000 * STEP_NS, what=what
            )
        return reader

    def holds(self, rid: str) -> bool:
        """The batcher still has ``rid`` (waiting or running)."""
        return rid in self.batcher.running() or rid in self.batcher.waiting()


def request(rid: str, prompt_len: int = 3, max_new_tokens: int = 5, **kw: Any) -> Request:
    """A request whose prompt is derived from its id (distinct requests, distinct tokens)."""
    base = sum(map(ord, rid))
    prompt = tuple((base * 31 + i * 7) % VOCAB for i in range(prompt_len))
    return Request(rid, prompt, max_new_tokens, **kw)


@dataclass
class Reader:
    """Reads one stream to its end; ``pace_ns`` between reads (0: as fast as it can)."""

    stream: TokenStream
    clock: WaitingClock
    pace_ns: int = 0
    taken: list[tuple[int, Delivery]] = field(default_factory=list)
    ended: str = "reading"  # "end", or the exception that ended it (repr)
    error: BaseException | None = None

    @property
    def tokens(self) -> tuple[int, ...]:
        return tuple(t for _, d in self.taken for t in d.tokens)

    @property
    def reason(self) -> FinishReason | None:
        return self.taken[-1][1].finish_reason if self.taken else None

    async def run(self) -> None:
        try:
            while True:
                if self.pace_ns:
                    await self.clock.sleep_until_ns_async(self.clock.now_ns() + self.pace_ns)
                try:
                    delivery = await self.stream.__anext__()
                except StopAsyncIteration:
                    self.ended = "end"
                    return
                self.taken.append((self.clock.now_ns(), delivery))
        except anyio.get_cancelled_exc_class():
            self.ended = "cancelled"
            raise
        except Exception as e:
            self.ended = repr(e)
            self.error = e


async def outcome_of_a_read(stream: TokenStream) -> str:
    """What one read of ``stream`` does, told: a delivery (its tokens and finish reason),
    the end of the iteration, or the type of the exception it raised."""
    try:
        delivery = await stream.__anext__()
    except StopAsyncIteration:
        return "StopAsyncIteration"
    except Exception as error:
        return f"raised {type(error).__name__}"
    return f"a delivery {list(delivery.tokens)} {delivery.finish_reason}"


def admission(generate: Callable[[Request], object], request: Request) -> str:
    """What ``generate(request)`` (an engine's or a router's) does, told: "admitted", or
    the type of what it raised (a stub's ``Todo`` propagates)."""
    try:
        generate(request)
    except Todo:
        raise
    except Exception as error:
        return f"raised {type(error).__name__}"
    return "admitted"


def show(deliveries: list[tuple[int, Delivery]]) -> str:
    """Deliveries as ``+ns: tokens reason`` (times from T0)."""
    return "; ".join(
        f"+{at - T0}: {list(d.tokens)}{' ' + d.finish_reason if d.finish_reason else ''}"
        for at, d in deliveries
    )


def expect_ending(rid: str, reader: Reader, reason: FinishReason) -> None:
    """How a stream that ran to its end ends, from an engine or through a router alike:
    its last delivery, and that one alone, carries the finish reason ``reason``, and the
    iteration stops after it."""
    __tracebackhide__ = True
    check(
        reader.reason == reason,
        f"request {rid}: the last delivery carries the finish reason: expected {reason!r}, "
        f"got {reader.reason!r}",
    )
    check(
        all(d.finish_reason is None for _, d in reader.taken[:-1]),
        f"request {rid}: only the last delivery carries a finish reason: {show(reader.taken)}",
    )
    check(
        reader.ended == "end",
        f"request {rid}: after the last delivery the iteration stops; it ended {reader.ended}",
    )


__all__ = [
    "STEP_NS",
    "T0",
    "VOCAB",
    "Reader",
    "Rig",
    "admission",
    "expect_ending",
    "fixed_step",
    "outcome_of_a_read",
    "request",
    "show",
]
