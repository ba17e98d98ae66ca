"""A model's rules are declared once: every state machine a suite also drives a second way
is driven by a driver derived from the machine's own rules, which runs every one of them.

A second driver that retypes a machine's rules by hand runs only the rules it was told
of, so a rule added to the machine later goes unrun there without anyone noticing. The
convention that makes the check possible, knowing no kata, is
:mod:`katas._harness.machines`'s: a suite drives a machine outside hypothesis's runner
through a module-level ``Driver(machine)``; each machine of a suite that is a driver's
machine (or a subclass or a base of one) must have a driver of that suite running every
one of its rules. Each suite file a ``kata.toml`` names is imported, nothing run.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from katas._harness.machines import Driver, machines_in, rules_of, uncovered
from katas._registry.catalog import Catalog
from katas._registry.impl import REPO_ROOT

SUITES = sorted(
    path
    for kata in Catalog(REPO_ROOT / "katas").katas()
    for stage in kata.stages
    for path in kata.suite_paths(stage)
    if path.is_file()
)


def _name(path: Path) -> str:
    return f"{path.parent.name}/{path.name}"


@pytest.mark.parametrize("path", SUITES, ids=_name)
def test_every_driven_machine_has_every_rule_run_by_a_derived_driver(path: Path) -> None:
    module = importlib.import_module(f"katas.{path.parent.name}.{path.stem}")
    missing = uncovered(module)
    assert not missing, f"{_name(path)}: rules of its state machines no driver of it runs: " + (
        "; ".join(f"{machine}: {sorted(rules)}" for machine, rules in sorted(missing.items()))
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
