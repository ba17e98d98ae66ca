"""The routing rules of stage 3 written plainly from the prompt, and the state machine
that compares the learner's ``ReplicaSet`` with them; prompts that share prefixes.

:class:`RoutesModel` keeps, per replica, whether it is up or draining, the weight of
each request assigned to it and its routing history as a list of block keys (least
recently used first), and answers ``pick`` by the prompt's sentences in order: the
imbalance guard, then affinity, then the least loaded.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from fractions import Fraction

import hypothesis.stateful as stateful
from hypothesis import strategies as st

from katas._harness.story import check
from katas._harness.under_test import stage
from katas.dynamic_batcher.api import Route, RoutingPolicy, block_hash

BLOCK = 4


def keys(prompt: Sequence[int], block_size: int = BLOCK) -> list[int]:
    """The chained keys of ``prompt``'s full blocks (api.block_hash)."""
    out: list[int] = []
    parent: int | None = None
    for i in range(len(prompt) // block_size):
        parent = block_hash(parent, prompt[i * block_size : (i + 1) * block_size])
        out.append(parent)
    return out


def shared(
    prefix: int, blocks: int, tail: int, rid: int, block_size: int = BLOCK
) -> tuple[int, ...]:
    """A prompt of ``blocks`` full blocks common to every prompt of prefix ``prefix``, then
    ``tail`` tokens of its own (``rid`` makes them distinct)."""
    head = tuple((prefix * 97 + i * 13) % 1000 for i in range(blocks * block_size))
    return head + tuple((rid * 31 + prefix * 7 + i * 11 + 500) % 1000 for i in range(tail))


def expect_matched(got: int, want: int, situation: str) -> None:
    """How many leading blocks of a prompt a replica's history matches."""
    __tracebackhide__ = True
    check(got == want, f"{situation}\n  expected matched_blocks {want}\n  got              {got}")


def expect_route(got: Route | None, want: Route | None, situation: str) -> None:
    __tracebackhide__ = True
    check(got == want, f"{situation}\n  expected pick() = {want}\n  got               {got}")


@dataclass
class _Replica:
    up: bool = True
    draining: bool = False
    history: list[int] = field(default_factory=list)  # LRU first


@dataclass
class _Request:
    replica: str
    prompt: int
    budget: int
    started: bool = False


@dataclass
class RoutesModel:
    names: Sequence[str]
    block_size: int
    balance_abs_tokens: int
    balance_rel: float
    affinity_threshold: float
    history_blocks: int
    replicas: dict[str, _Replica] = field(default_factory=dict)
    requests: dict[str, _Request] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.replicas = {n: _Replica() for n in self.names}

    def load(self, name: str) -> int:
        return sum(
            (0 if r.started else r.prompt) + r.budget
            for r in self.requests.values()
            if r.replica == name
        )

    def loads(self) -> dict[str, int]:
        return {n: self.load(n) for n in self.names}

    def available(self) -> list[str]:
        return [n for n in self.names if self.replicas[n].up and not self.replicas[n].draining]

    def matched(self, name: str, prompt: Sequence[int]) -> int:
        history = set(self.replicas[name].history)
        n = 0
        for key in keys(prompt, self.block_size):
            if key not in history:
                break
            n += 1
        return n

    def pick(self, prompt: Sequence[int], exclude: Collection[str] = ()) -> Route | None:
        names = [n for n in self.available() if n not in exclude]
        if not names:
            return None
        loads = {n: self.load(n) for n in names}
        least = min(names, key=lambda n: (loads[n], names.index(n)))
        most = max(loads.values())
        rel = Fraction(str(self.balance_rel))  # exactly, as written: 1.4 is 7/5
        if most - loads[least] > self.balance_abs_tokens and most > rel * loads[least]:
            return Route(least, "balance")
        full = len(prompt) // self.block_size
        best = min(names, key=lambda n: (-self.matched(n, prompt), loads[n], names.index(n)))
        m = self.matched(best, prompt)
        if full and m > 0 and m >= Fraction(str(self.affinity_threshold)) * full:
            return Route(best, "affinity", m)
        return Route(least, "least-loaded")

    def assign(self, name: str, rid: str, prompt: Sequence[int], max_new_tokens: int) -> None:
        self.requests[rid] = _Request(name, len(prompt), max_new_tokens)
        history = self.replicas[name].history
        for key in reversed(keys(prompt, self.block_size)):  # the first block last
            if key in history:
                history.remove(key)
            history.append(key)
        del history[: max(0, len(history) - self.history_blocks)]

    def progress(self, rid: str, tokens: int) -> None:
        r = self.requests.get(rid)
        if r is not None and tokens > 0:
            r.started = True
            r.budget = max(0, r.budget - tokens)

    def release(self, rid: str) -> None:
        self.requests.pop(rid, None)

    def mark_down(self, name: str) -> None:
        self.replicas[name].up = False
        self.replicas[name].history.clear()

    def mark_up(self, name: str) -> None:
        self.replicas[name].up = True


def replica_set(
    names: Sequence[str] = ("a", "b", "c"),
    *,
    block_size: int = BLOCK,
    balance_abs_tokens: int = 1_000,
    balance_rel: float = 1.5,
    affinity_threshold: float = 0.5,
    history_blocks: int = 1_000,
) -> RoutingPolicy:
    """The learner's ``ReplicaSet`` (the suite's defaults: guard and history out of the way)."""
    rs: RoutingPolicy = stage().ReplicaSet(
        list(names),
        block_size=block_size,
        balance_abs_tokens=balance_abs_tokens,
        balance_rel=balance_rel,
        affinity_threshold=affinity_threshold,
        history_blocks=history_blocks,
    )
    return rs


#: The settings of ``ReplicaSet`` and ``Router`` that count something (tokens, blocks, ns,
#: failovers): ints, and a bool is none.
COUNTS = frozenset(
    {
        "block_size",
        "history_blocks",
        "balance_abs_tokens",
        "max_outstanding_tokens",
        "retry_after_ns",
        "stall_timeout_ns",
        "probe_interval_ns",
        "probe_timeout_ns",
        "max_failovers",
    }
)
#: The settings that are fractions or factors: an int or a float, never a bool.
FACTORS = frozenset({"balance_rel", "affinity_threshold"})


def not_a_number_of_its_kind(param: str, value: object) -> bool:
    """Whether ``value`` is no number of the kind the setting ``param`` takes — a bool, a
    str, NaN, or a float where an int counts something — which the rules let a
    constructor refuse with ``TypeError`` or ``ValueError``; a number of the right kind
    out of range, or a bad value of any other setting, is a ``ValueError``."""
    if param not in COUNTS | FACTORS:
        return False
    if isinstance(value, bool) or not isinstance(value, int | float):
        return True
    if isinstance(value, float) and math.isnan(value):
        return True
    return param in COUNTS and not isinstance(value, int)


class RoutesMachine(stateful.RuleBasedStateMachine):
    """The learner's ReplicaSet against the rules written plainly (routes.RoutesModel)."""

    NAMES = ("b", "c", "a")  # the order given is not the names' order

    def __init__(self) -> None:
        super().__init__()
        self.rs: RoutingPolicy  # from build()
        self.model: RoutesModel | None = None
        self.steps: list[str] = []
        self.next_rid = 0

    @stateful.initialize(
        abs_tokens=st.integers(0, 40),
        rel=st.sampled_from([1.0, 1.25, 1.5, 2.0]),
        threshold=st.sampled_from([0.25, 0.5, 1.0]),
        history=st.integers(1, 12),
    )
    def build(self, abs_tokens: int, rel: float, threshold: float, history: int) -> None:
        self.rs = replica_set(
            self.NAMES,
            balance_abs_tokens=abs_tokens,
            balance_rel=rel,
            affinity_threshold=threshold,
            history_blocks=history,
        )
        self.model = RoutesModel(self.NAMES, BLOCK, abs_tokens, rel, threshold, history)
        self.steps = [
            f"ReplicaSet({list(self.NAMES)}, block_size={BLOCK}, balance_abs_tokens={abs_tokens}, "
            f"balance_rel={rel}, affinity_threshold={threshold}, history_blocks={history})"
        ]

    def _prompt(self, family: int, blocks: int, tail: int) -> tuple[int, ...]:
        return shared(family, blocks, tail, self.next_rid)

    @stateful.rule(
        family=st.integers(0, 2),
        blocks=st.integers(0, 4),
        tail=st.integers(0, 5),
        budget=st.integers(1, 30),
        exclude=st.sets(st.sampled_from(NAMES), max_size=2),
    )
    def route(self, family: int, blocks: int, tail: int, budget: int, exclude: set[str]) -> None:
        assert self.model is not None
        prompt = self._prompt(family, blocks, tail) or (1,)
        want = self.model.pick(prompt, exclude)
        got = self.rs.pick(prompt, exclude=exclude)
        self.steps.append(
            f"pick(prefix family {family}, {blocks} shared blocks + {tail} own tokens, "
            f"exclude={sorted(exclude)})"
        )
        assert got == want, self._say(f"expected {want}\n  got      {got}")
        if got is not None:
            rid = f"r{self.next_rid}"
            self.next_rid += 1
            self.rs.assign(got.replica, rid, prompt, budget)
            self.model.assign(got.replica, rid, prompt, budget)
            self.steps.append(f"assign({got.replica!r}, {rid!r}, …, {budget})")

    @stateful.rule(which=st.integers(0, 50), tokens=st.integers(0, 12))
    def progress(self, which: int, tokens: int) -> None:
        assert self.model is not None
        if not self.model.requests:
            return
        rid = sorted(self.model.requests)[which % len(self.model.requests)]
        self.rs.progress(rid, tokens)
        self.model.progress(rid, tokens)
        self.steps.append(f"progress({rid!r}, {tokens})")

    @stateful.rule(which=st.integers(0, 50))
    def release(self, which: int) -> None:
        assert self.model is not None
        if not self.model.requests:
            return
        rid = sorted(self.model.requests)[which % len(self.model.requests)]
        self.rs.release(rid)
        self.model.release(rid)
        self.steps.append(f"release({rid!r})")

    @stateful.rule(
        name=st.sampled_from(NAMES), what=st.sampled_from(["down", "up", "drain", "restore"])
    )
    def health(self, name: str, what: str) -> None:
        assert self.model is not None
        call = {"down": "mark_down", "up": "mark_up", "drain": "drain", "restore": "restore"}[what]
        getattr(self.rs, call)(name)
        if what == "down":
            self.model.mark_down(name)
        elif what == "up":
            self.model.mark_up(name)
        else:
            self.model.replicas[name].draining = what == "drain"
        self.steps.append(f"{call}({name!r})")

    @stateful.invariant()
    def loads_agree(self) -> None:
        if self.model is None:
            return
        want, got = self.model.loads(), self.rs.loads()
        assert got == want, self._say(f"loads(): expected {want}\n  got      {got}")
        assert self.rs.available() == self.model.available(), self._say(
            f"available(): expected {self.model.available()}, got {self.rs.available()}"
        )

    def _say(self, what: str) -> str:
        return "after\n    " + "\n    ".join(self.steps[-12:]) + "\n  " + what


__all__ = [
    "BLOCK",
    "COUNTS",
    "FACTORS",
    "RoutesMachine",
    "RoutesModel",
    "keys",
    "not_a_number_of_its_kind",
    "replica_set",
    "shared",
]
