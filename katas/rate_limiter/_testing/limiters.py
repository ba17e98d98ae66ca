"""Driving a stage-1 limiter beside its exact model: the configurations (``Setup``), the
operations hypothesis draws (``Op``, declared once in ``OPERATIONS``: the differential
tests' lists and the state machine's rules are both drawn from it), the run that compares
every Decision, and the fixed run per limiter (``BOUNDARY_RUNS``) every comparison makes
before its drawn ones."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from fractions import Fraction
from types import ModuleType
from typing import Any, Literal, TypeVar, assert_never, get_args

import pytest
from hypothesis import strategies as st

from katas._harness.machines import Operations
from katas._harness.marks import core, extended
from katas._harness.story import Story
from katas.rate_limiter._testing.models import (
    FixedWindowModel,
    Model,
    SlidingLogModel,
    SlidingWindowCounterModel,
    TokenBucketModel,
)
from katas.rate_limiter.api import (
    NS_PER_S,
    Decision,
    ManualClock,
    MultiRateLimiter,
    RateLimiter,
    SweepableLimiter,
)

START_NS = 10_000 * NS_PER_S  # far from 0, so clock steps back stay positive
KEYS = ("alice", "bob", "carol")
Algo = Literal["token_bucket", "sliding_log", "gcra", "fixed_window", "sliding_window_counter"]
ALGOS: tuple[Algo, ...] = (
    "token_bucket",
    "sliding_log",
    "gcra",
    "fixed_window",
    "sliding_window_counter",
)
CORE_ALGOS = ("token_bucket", "sliding_log")

#: The rules about a Decision's fields that any example or model run of any algorithm
#: checks at once (each test adds the rules of its own algorithm).
DECISION_RULES = ("fresh", "allowed-consumes", "limit-field", "remaining-floored", "retry-field")


def by_algo(algos: Iterable[Algo] = ALGOS) -> list[Any]:
    """Parameters for a test run on each algorithm, marked core or extended."""
    return [pytest.param(a, marks=core if a in CORE_ALGOS else extended, id=a) for a in algos]


# --------------------------------------------------------------------------------------
# Configurations: how to build an implementation and its model
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Setup:
    algo: Algo
    limit: int
    rate: Fraction = Fraction(1)  # token bucket, GCRA
    window_ns: int = NS_PER_S  # windows
    align: str = "epoch"  # fixed window

    def __str__(self) -> str:
        rate = str(self.rate.numerator) if self.rate.denominator == 1 else repr(self.rate)
        return {
            "token_bucket": f"TokenBucket(capacity={self.limit}, refill_per_s={rate})",
            "gcra": f"GCRA(rate_per_s={rate}, burst={self.limit})",
            "sliding_log": f"SlidingLog(limit={self.limit}, window_ns={self.window_ns})",
            "fixed_window": f"FixedWindow(limit={self.limit}, window_ns={self.window_ns}, "
            f"align={self.align!r})",
            "sliding_window_counter": f"SlidingWindowCounter(limit={self.limit}, "
            f"window_ns={self.window_ns})",
        }[self.algo]

    def build(
        self, stage: ModuleType, clock: ManualClock, auto_sweep: bool = True
    ) -> SweepableLimiter:
        rate: int | Fraction = self.rate.numerator if self.rate.denominator == 1 else self.rate
        limiter: SweepableLimiter
        if self.algo == "token_bucket":
            limiter = stage.TokenBucket(
                capacity=self.limit, refill_per_s=rate, clock=clock, auto_sweep=auto_sweep
            )
        elif self.algo == "gcra":
            limiter = stage.GCRA(
                rate_per_s=rate, burst=self.limit, clock=clock, auto_sweep=auto_sweep
            )
        elif self.algo == "sliding_log":
            limiter = stage.SlidingLog(
                limit=self.limit, window_ns=self.window_ns, clock=clock, auto_sweep=auto_sweep
            )
        elif self.algo == "fixed_window":
            limiter = stage.FixedWindow(
                limit=self.limit,
                window_ns=self.window_ns,
                clock=clock,
                align=self.align,
                auto_sweep=auto_sweep,
            )
        else:
            limiter = stage.SlidingWindowCounter(
                limit=self.limit, window_ns=self.window_ns, clock=clock, auto_sweep=auto_sweep
            )
        return limiter

    def model(self) -> Model[Any]:
        if self.algo in ("token_bucket", "gcra"):
            return TokenBucketModel(self.limit, self.rate)
        if self.algo == "sliding_log":
            return SlidingLogModel(self.limit, self.window_ns)
        if self.algo == "fixed_window":
            return FixedWindowModel(self.limit, self.window_ns, self.align)
        return SlidingWindowCounterModel(self.limit, self.window_ns)

    @property
    def scale_ns(self) -> int:
        """The natural time step: one unit's refill, or one window."""
        if self.algo in ("token_bucket", "gcra"):
            return math.ceil(NS_PER_S / self.rate)
        return self.window_ns

    @property
    def recovery_ns(self) -> int:
        """From any state (clock monotonic), a key is fresh again after this long."""
        if self.algo in ("token_bucket", "gcra"):
            return math.ceil(self.limit * NS_PER_S / self.rate)
        return 2 * self.window_ns


RATES = st.one_of(
    st.integers(1, 4).map(Fraction),
    st.builds(Fraction, st.integers(1, 9), st.integers(2, 9)),
)
WINDOWS = st.one_of(st.integers(1, 30), st.integers(1_000, 10 * NS_PER_S))


@functools.cache  # building strategies is slow; draws from one are cheap
def setups(algo: Algo) -> st.SearchStrategy[Setup]:
    limits = st.integers(1, 6)
    if algo in ("token_bucket", "gcra"):
        return st.builds(Setup, st.just(algo), limits, rate=RATES)
    if algo == "fixed_window":
        aligns = st.sampled_from(["epoch", "first_hit"])
        return st.builds(Setup, st.just(algo), limits, window_ns=WINDOWS, align=aligns)
    return st.builds(Setup, st.just(algo), limits, window_ns=WINDOWS)


# --------------------------------------------------------------------------------------
# Failing fast on stubs
# --------------------------------------------------------------------------------------

F = TypeVar("F", bound=Callable[..., Any])


def needs(*parts: str) -> Callable[[F], F]:
    """Declare which limiters a property test drives (besides its ``algo`` parameter)."""

    def mark(test: F) -> F:
        test.kata_needs = parts  # type: ignore[attr-defined]
        return test

    return mark


def smoke(stage: ModuleType, part: str) -> None:
    """Call every public method once; a stub's Todo surfaces here."""
    clock = ManualClock(START_NS)
    if part == "header":
        stage.retry_after_header(D(False, 1, 0, 1, 1))
        return
    if part == "multi":
        multi: MultiRateLimiter = stage.MultiLimiter(
            {"n": Setup("token_bucket", 3).build(stage, clock)}
        )
        multi.try_acquire("smoke", {"n": 1})
        multi.peek("smoke", {"n": 1})
        multi.refund("smoke", {"n": 1})
        multi.reset("smoke")
        multi.sweep()
        return
    limiter = Setup(part, 3).build(stage, clock)  # type: ignore[arg-type]
    limiter.try_acquire("smoke")
    limiter.peek("smoke")
    limiter.refund("smoke", 1)
    limiter.tracked_keys()
    limiter.sweep()
    limiter.reset("smoke")


def smoke_needs(request: pytest.FixtureRequest, stage_module: ModuleType) -> None:
    """Before hypothesis searches, call what the test drives once (an autouse fixture).

    On a stub this fails at once with "not implemented yet: ..." instead of letting
    hypothesis shrink a Todo. What it drives: the parts :func:`needs` declared on the
    test or its class, and its ``algo`` parameter. (State machines, being unittest
    classes, also find the stage module here.)
    """
    parts = list(getattr(request.function, "kata_needs", ()))
    parts += getattr(request.cls, "kata_needs", ()) if request.cls is not None else ()
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and "algo" in callspec.params:
        parts.append(callspec.params["algo"])
    for part in parts:
        smoke(stage_module, part)


# --------------------------------------------------------------------------------------
# Operations, and running them on an implementation and its model side by side
# --------------------------------------------------------------------------------------

OpKind = Literal["acquire", "peek", "refund", "reset", "advance", "back", "sweep", "tracked"]


@dataclass(frozen=True)
class Op:
    kind: OpKind
    key: str = "alice"
    n: int = 0

    def __str__(self) -> str:
        return {
            "acquire": f"try_acquire({self.key!r}, {self.n})",
            "peek": f"peek({self.key!r}, {self.n})",
            "refund": f"refund({self.key!r}, {self.n})",
            "reset": f"reset({self.key!r})",
            "advance": f"clock.advance({self.n})",
            "back": f"clock.set(now - {self.n})   # the clock steps back",
            "sweep": "sweep()",
            "tracked": "tracked_keys()",
        }[self.kind]


@functools.cache  # building strategies is slow; draws from one are cheap
def durations(setup: Setup) -> st.SearchStrategy[int]:
    """Time steps around a limiter's interesting boundaries, and long idle periods."""
    scale = setup.scale_ns
    return st.one_of(
        st.integers(0, 3),
        st.integers(0, 2 * scale),
        st.sampled_from(sorted({max(1, scale - 1), scale, scale + 1, scale // 2 + 1})),
        st.integers(setup.recovery_ns, 3 * setup.recovery_ns),
    )


@dataclass(frozen=True)
class Traffic:
    """What the operations drawn for a limiter depend on: its configuration, whether its
    clock may step back, and the keys (the first gets most of the traffic)."""

    setup: Setup
    steps_back: bool = False
    keys: tuple[str, ...] = KEYS

    def key(self) -> st.SearchStrategy[str]:
        return st.sampled_from([self.keys[0], *self.keys])

    def cost(self) -> st.SearchStrategy[int]:
        return st.integers(1, self.setup.limit + 1)  # limit + 1 can never fit


#: Every kind of operation, declared once, with how to draw one: the differential tests'
#: lists (:func:`operations`) and ``LimiterMachine``'s rules (one a kind) are both drawn
#: from it. A draw of n branches weighs n: acquires come thrice as often, clock moves twice.
OPERATIONS: Operations[Traffic, Op] = Operations(
    get_args(OpKind),
    {
        "acquire": lambda t: st.one_of(
            st.builds(Op, st.just("acquire"), t.key(), t.cost()),
            st.builds(Op, st.just("acquire"), t.key(), t.cost()),
            st.builds(Op, st.just("acquire"), t.key(), st.just(1)),
        ),
        "peek": lambda t: st.builds(Op, st.just("peek"), t.key(), t.cost()),
        "refund": lambda t: st.builds(
            Op, st.just("refund"), t.key(), st.integers(1, t.setup.limit + 2)
        ),
        "advance": lambda t: st.one_of(
            st.builds(Op, st.just("advance"), n=durations(t.setup)),
            st.builds(Op, st.just("advance"), n=durations(t.setup)),
        ),
        "reset": lambda t: st.builds(Op, st.just("reset"), t.key()),
        "tracked": lambda t: st.builds(Op, st.just("tracked")),
        "back": lambda t: (
            st.builds(Op, st.just("back"), n=durations(t.setup)) if t.steps_back else st.nothing()
        ),
        # Sweeping forgets a fresh key's stored time, which a later step back below it
        # could reveal: with a clock that steps back, only reset() forgets keys.
        "sweep": lambda t: st.nothing() if t.steps_back else st.builds(Op, st.just("sweep")),
    },
    kind_of=lambda op: op.kind,
)


@functools.cache  # building strategies is slow; draws from one are cheap
def operations(
    setup: Setup, *, steps_back: bool = False, keys: tuple[str, ...] = KEYS
) -> st.SearchStrategy[list[Op]]:
    """A differential test's operations: 10 to 40 drawn from :data:`OPERATIONS`."""
    return OPERATIONS.lists(Traffic(setup, steps_back, keys), min_size=10, max_size=40)


def run_against_model(
    limiter: RateLimiter,
    model: Model[Any],
    clock: ManualClock,
    ops: Iterable[Op],
    title: str = "",
    *,
    story: Story | None = None,
) -> None:
    """Apply ``ops`` to both; every Decision and every tracked_keys() must be equal.

    A failure tells the operations so far: those of ``story`` when a caller keeps one
    across several runs (a state machine), else those of this run, under ``title``.
    """
    __tracebackhide__ = True  # the assertion message tells the story
    story = story if story is not None else Story(title, clock.now_ns, START_NS)
    for op in ops:
        now = clock.now_ns()
        if op.kind == "acquire" or op.kind == "peek":
            commit = op.kind == "acquire"
            got = limiter.try_acquire(op.key, op.n) if commit else limiter.peek(op.key, op.n)
            want = model.decide(op.key, op.n, now, commit=commit)
            story.add(f"{op} -> {got}")
            story.expect(got, want, "the decision differs from the exact model")
        elif op.kind == "refund":
            limiter.refund(op.key, op.n)
            model.refund(op.key, op.n, now)
            story.add(str(op))
        elif op.kind == "reset":
            limiter.reset(op.key)
            model.reset(op.key)
            story.add(str(op))
        elif op.kind == "advance":
            clock.advance(op.n)
            story.add(str(op))
        elif op.kind == "back":
            clock.set(now - op.n)
            story.add(str(op))
        elif op.kind == "sweep":
            story.add(f"{op} -> {limiter.sweep()}")
            again = limiter.sweep()
            story.check(
                again == 0,
                "a second sweep at the same instant has nothing left to forget",
                f"sweep() returned {again}",
            )
        elif op.kind != "tracked":  # checked below, as after every change of keys
            assert_never(op.kind)
        if op.kind in ("tracked", "sweep", "refund", "reset"):
            story.expect(
                limiter.tracked_keys(),
                model.tracked(clock.now_ns()),
                "tracked_keys() counts the keys whose state differs from fresh",
            )


#: A fixed run per limiter that every comparison with the exact model makes before its
#: drawn ones, so that each meets its boundaries on every run: a retry_after that is a
#: fraction of a nanosecond past a whole one (3 per second), the very instant a window
#: lets go of what it counted, a denial that must leave no trace behind, a sliding-log
#: refund larger than the newest request (it takes back units of the one before too).
BOUNDARY_RUNS: dict[Algo, tuple[Setup, tuple[Op, ...]]] = {
    "token_bucket": (Setup("token_bucket", 3, Fraction(3)), (
        Op("acquire", n=3), Op("acquire", n=1), Op("advance", n=NS_PER_S // 3),
        Op("acquire", n=1), Op("advance", n=1), Op("acquire", n=1), Op("acquire", n=4),
    )),
    "gcra": (Setup("gcra", 2, Fraction(3)), (
        Op("acquire", n=2), Op("acquire", n=1), Op("advance", n=NS_PER_S // 3),
        Op("acquire", n=1), Op("advance", n=1), Op("acquire", n=1), Op("acquire", n=3),
    )),
    "sliding_log": (Setup("sliding_log", 3, window_ns=1_000), (
        Op("acquire", n=3), Op("advance", n=1), Op("acquire", n=1), Op("advance", n=998),
        Op("acquire", n=1), Op("advance", n=1), Op("acquire", n=2), Op("advance", n=1),
        Op("acquire", n=1), Op("refund", n=3), Op("peek", n=3), Op("tracked"),
    )),
    "fixed_window": (Setup("fixed_window", 2, window_ns=1_000), (
        Op("acquire", n=2), Op("advance", n=999), Op("acquire", n=1), Op("advance", n=1),
        Op("acquire", n=2), Op("acquire", n=1), Op("tracked"),
    )),
    "sliding_window_counter": (Setup("sliding_window_counter", 2, window_ns=1_000), (
        Op("acquire", n=2), Op("advance", n=1_000), Op("acquire", n=1), Op("advance", n=500),
        Op("acquire", n=1), Op("advance", n=500), Op("acquire", n=2), Op("tracked"),
    )),
}  # fmt: skip


def run_boundaries(stage: ModuleType, algo: Algo, *, auto_sweep: bool) -> None:
    """The limiter's :data:`BOUNDARY_RUNS` entry against the exact model."""
    __tracebackhide__ = True
    setup, ops = BOUNDARY_RUNS[algo]
    clock = ManualClock(START_NS)
    limiter = setup.build(stage, clock, auto_sweep=auto_sweep)
    title = f"{setup} with auto_sweep={auto_sweep} (the fixed run, before any drawn one):"
    run_against_model(limiter, setup.model(), clock, ops, title)


def check_against_model(
    stage: ModuleType, data: st.DataObject, algo: Algo, *, steps_back: bool
) -> None:
    __tracebackhide__ = True  # the assertion message tells the story
    run_boundaries(stage, algo, auto_sweep=not steps_back)
    setup = data.draw(setups(algo), label="setup")
    # With a clock that steps back the limiter must keep its keys (see operations()).
    auto_sweep = False if steps_back else data.draw(st.booleans(), label="auto_sweep")
    clock = ManualClock(START_NS)
    limiter = setup.build(stage, clock, auto_sweep=auto_sweep)
    ops = data.draw(operations(setup, steps_back=steps_back), label="ops")
    run_against_model(limiter, setup.model(), clock, ops, f"{setup} with auto_sweep={auto_sweep}:")


def admit_all(limiter: RateLimiter, clock: ManualClock, ops: Iterable[Op]) -> None:
    """Apply ``ops`` to a limiter without checking anything (a history to build on)."""
    for op in ops:
        if op.kind == "acquire":
            limiter.try_acquire(op.key, op.n)
        elif op.kind == "peek":
            limiter.peek(op.key, op.n)
        elif op.kind == "refund":
            limiter.refund(op.key, op.n)
        elif op.kind == "reset":
            limiter.reset(op.key)
        elif op.kind == "advance":
            clock.advance(op.n)
        elif op.kind == "back":
            clock.set(clock.now_ns() - op.n)
        elif op.kind == "sweep":
            limiter.sweep()
        elif op.kind == "tracked":
            limiter.tracked_keys()
        else:
            assert_never(op.kind)


def state_of(limiter: RateLimiter, key: str, limit: int) -> Decision:
    """The key's current remaining/reset, read without changing anything.

    A cost above the limit can never fit, so this peek is denied whatever the state.
    """
    return limiter.peek(key, limit + 1)


def D(allowed: bool, limit: int, remaining: int, retry: int | None, reset: int) -> Decision:
    return Decision(allowed, limit, remaining, retry, reset)


S_ = NS_PER_S  # seconds, for readable examples


class StepsBackAfterPeek:
    """A stage-1 limiter whose clock steps back ``ns`` right after its first ``peek``.

    What a clock stepping back between a ``MultiLimiter``'s look at a limit (its peek)
    and its charge (its try_acquire) does: the charge is decided at an earlier time than
    the look. Every other call goes straight to ``inner``.
    """

    def __init__(self, inner: SweepableLimiter, clock: ManualClock, ns: int) -> None:
        self.inner, self.clock, self.ns = inner, clock, ns
        self.stepped = False

    def peek(self, key: str, cost: int = 1) -> Decision:
        decision = self.inner.peek(key, cost)
        if not self.stepped:
            self.stepped = True
            self.clock.set(self.clock.now_ns() - self.ns)
        return decision

    def try_acquire(self, key: str, cost: int = 1) -> Decision:
        return self.inner.try_acquire(key, cost)

    def refund(self, key: str, cost: int) -> None:
        self.inner.refund(key, cost)

    def reset(self, key: str) -> None:
        self.inner.reset(key)

    def tracked_keys(self) -> int:
        return self.inner.tracked_keys()

    def sweep(self) -> int:
        return self.inner.sweep()
