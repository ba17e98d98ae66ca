"""A model's rules are declared once: every state machine a suite also drives a second way
is driven by a driver derived from the machine's own rules, which runs every one of them —
or, the other way round, has its rules derived from the suite's declared operations, which
its lists of operations are drawn from too, so that both walk every kind.

A second driver that retypes a machine's rules by hand runs only the rules it was told
of, so a rule added to the machine later goes unrun there without anyone noticing. The
convention that makes the check possible, knowing no kata, is
:mod:`katas._harness.machines`'s: a suite drives a machine outside hypothesis's runner
through a module-level ``Driver(machine)``; each machine of a suite that is a driver's
machine (or a subclass or a base of one) must have a driver of that suite running every
one of its rules. Its second form: a machine derived from an ``Operations`` declaration
(``@OPERATIONS.machine()``) must walk every kind of the operation type, and have no rule
beyond them unless marked ``machine_only``. Each suite file a ``kata.toml`` names is
imported, nothing run.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

import pytest
from _support import suite_files, suite_id
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from katas._harness.machines import (
    Driver,
    Operations,
    machine_only,
    machines_in,
    rules_of,
    uncovered,
    unwalked,
)
from katas._harness.walks import replay

SUITES = suite_files()


@pytest.mark.parametrize("path", SUITES, ids=suite_id)
def test_every_driven_machine_has_every_rule_run_by_a_derived_driver(path: Path) -> None:
    module = importlib.import_module(f"katas.{path.parent.name}.{path.stem}")
    missing = uncovered(module)
    assert not missing, f"{suite_id(path)}: rules of its state machines no driver of it runs: " + (
        "; ".join(f"{machine}: {sorted(rules)}" for machine, rules in sorted(missing.items()))
    )


@pytest.mark.parametrize("path", SUITES, ids=suite_id)
def test_every_machine_derived_from_operations_walks_exactly_their_kinds(path: Path) -> None:
    module = importlib.import_module(f"katas.{path.parent.name}.{path.stem}")
    missing = unwalked(module)
    assert not missing, (
        f"{suite_id(path)}: its lists of operations and its state machines walk different "
        "kinds: "
        + "; ".join(f"{machine}: {', '.join(gaps)}" for machine, gaps in sorted(missing.items()))
    )


# --- the convention itself, on a machine of its own -------------------------------------


class _Counter(RuleBasedStateMachine):
    @initialize(start=st.integers(0, 3))
    def build(self, start: int) -> None:
        self.value, self.calls = start, [f"build({start})"]

    @rule(by=st.integers(1, 2))
    def add(self, by: int) -> None:
        self.value += by
        self.calls.append("add")

    @precondition(lambda self: self.value > 0)
    @rule()
    def halve(self) -> None:
        self.value //= 2
        self.calls.append("halve")


class _MoreCounter(_Counter):
    @rule()
    def double(self) -> None:
        self.value *= 2


def test_a_driver_runs_the_machines_own_rules_and_skips_what_its_preconditions_refuse() -> None:
    driver = Driver(_Counter)
    assert driver.rule_names == {"add", "halve"}
    seen: list[_Counter] = []

    class Watched(_Counter):
        def teardown(self) -> None:
            seen.append(self)

    Driver(Watched).run([("halve", {}), ("add", {"by": 2}), ("halve", {})], start=0)
    assert seen[0].calls == ["build(0)", "add", "halve"] and seen[0].value == 1


def test_a_machine_extended_with_rules_its_driver_does_not_run_is_reported() -> None:
    module = type(importlib)("fake_suite")
    module.__dict__.update(_Counter=_Counter, _MoreCounter=_MoreCounter, STEPS=Driver(_Counter))
    assert machines_in(module) == [_Counter, _MoreCounter]
    assert uncovered(module) == {"_MoreCounter": {"double"}}
    module.__dict__["MORE_STEPS"] = Driver(_MoreCounter)
    assert uncovered(module) == {}
    assert set(rules_of(_MoreCounter)) == {"add", "halve", "double"}


# --- the second form, on operations of its own --------------------------------------------

_Kind = Literal["add", "halve", "read"]


@dataclass(frozen=True)
class _Op:
    kind: _Kind
    by: int = 0


_OPS: Operations[int, _Op] = Operations(
    get_args(_Kind),
    {
        "add": lambda most: st.builds(_Op, st.just("add"), st.integers(1, most)),
        "halve": lambda most: st.just(_Op("halve")) if most > 1 else st.nothing(),
        "read": lambda most: st.just(_Op("read")),
    },
    kind_of=lambda op: op.kind,
)


@_OPS.machine(every_step={"read": _Op("read")})
class _Walker(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.most, self.seen = 2, list[_Op]()

    def draws(self) -> int:
        return self.most

    def apply(self, op: _Op) -> None:
        self.seen.append(op)


class _WalkerWithFlush(_Walker):
    @rule()
    def flush(self) -> None:
        self.seen.clear()


class _WalkerWithOwnFlush(_Walker):
    @machine_only("a fault the lists do not inject")
    @rule()
    def flush(self) -> None:
        self.seen.clear()


#: An operation type grown by a kind nobody declared a draw for.
_WIDER: Operations[int, _Op] = Operations([*get_args(_Kind), "double"], _OPS.draws, _OPS.kind_of)


@_WIDER.machine(every_step={"read": _Op("read")})
class _Wider(RuleBasedStateMachine):
    draws, apply = _Walker.draws, _Walker.apply


class _Shadowed(_Walker):
    def add(self) -> None:  # a plain method hiding the derived rule
        pass


def test_a_machine_derived_from_operations_has_a_rule_a_kind() -> None:
    assert set(rules_of(_Walker)) == {"add", "halve"}  # "read" is applied after every step
    seen: list[_Walker] = []

    class Watched(_Walker):
        def teardown(self) -> None:
            seen.append(self)

    replay(Watched, _OPS.walk(_Walker, [_Op("add", 2), _Op("read"), _Op("halve")]))
    assert seen[0].seen == [_Op("add", 2), _Op("read"), _Op("halve"), _Op("read")]
    module = type(importlib)("fake_suite")
    module.__dict__.update(_Walker=_Walker, _WalkerWithOwnFlush=_WalkerWithOwnFlush)
    assert unwalked(module) == {}


def test_a_rule_beyond_the_kinds_or_a_kind_without_a_draw_is_reported() -> None:
    module = type(importlib)("fake_suite")
    module.__dict__.update(_WalkerWithFlush=_WalkerWithFlush)
    assert unwalked(module) == {
        "_WalkerWithFlush": ["rule 'flush' draws no kind the lists draw (nor is machine_only)"]
    }
    module.__dict__.update(_WalkerWithFlush=_Walker, _Wider=_Wider, _Shadowed=_Shadowed)
    assert unwalked(module) == {
        "_Wider": ["kind 'double' has no draw: no list nor rule walks it"],
        "_Shadowed": ["kind 'add' has no rule of the machine"],
    }
