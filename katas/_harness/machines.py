"""Drivers derived from a state machine's own rules, so that a model's rules are declared
once.

A hypothesis ``RuleBasedStateMachine`` declares each of its rules with the strategies of
its arguments. A suite sometimes drives the same machine a second way as well — a
``@given`` test that draws a whole list of steps, so that it takes ``@example``s and
shrinks as one list. A second driver that types the rules' strategies again by hand runs
only the rules it was told of: a rule added to the machine later goes unrun there, and
nothing says so. A :class:`Driver` is derived from the machine instead: its steps are
drawn from the machine's own rules, their own argument strategies, and a step whose
preconditions do not hold is skipped, as hypothesis skips it.

The convention, which ``tests/test_model_drivers.py`` checks in every suite file a
``kata.toml`` names (knowing no kata):

- a suite drives a state machine outside hypothesis's own runner only through a
  :class:`Driver`, bound to a module-level name of the suite file
  (``QUEUE_STEPS = Driver(QueueMachine)``);
- the state machines of a suite are the ``RuleBasedStateMachine`` subclasses its module
  holds (defined there or imported), and its drivers the :class:`Driver` instances it
  holds;
- every machine of a suite that is a driver's machine, or a subclass or a base of one,
  is covered: some driver of the same suite runs every one of its rules. (A machine
  extended with more rules needs a driver of its own: a driver builds, and runs the
  rules of, the class it was derived from.)
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine

from katas._harness.walks import Step


def _gathered(machine: type[RuleBasedStateMachine], what: str) -> list[Any]:
    """``what`` ("rules", "initializers" or "invariants") as hypothesis gathers them for
    ``machine``: from ``setup_state()``, or, in older releases, from the class methods
    ``rules()``, ``initialize_rules()`` and ``invariants()``. Each record gives the rule's
    function, its argument strategies and its preconditions."""
    setup_state = getattr(machine, "setup_state", None)
    if setup_state is not None:
        return list(getattr(setup_state(), what))
    older = {"rules": "rules", "initializers": "initialize_rules", "invariants": "invariants"}
    return list(getattr(machine, older[what])())


def rules_of(machine: type[RuleBasedStateMachine]) -> dict[str, Any]:
    """The machine's rules (hypothesis's ``Rule`` records), by function name."""
    return {rule.function.__name__: rule for rule in _gathered(machine, "rules")}


class Driver:
    """Steps drawn from ``machine``'s own rules, and the run that applies them to a fresh
    machine: its initializer, each step whose preconditions hold (then the invariants),
    and its teardown, as hypothesis runs them."""

    def __init__(self, machine: type[RuleBasedStateMachine]) -> None:
        self.machine = machine
        self.rules = rules_of(machine)
        for name, rule in self.rules.items():
            if rule.targets or rule.bundles:
                raise TypeError(f"{machine.__name__}.{name}: a driver draws no bundles")
        initializers = _gathered(machine, "initializers")
        if len(initializers) > 1:
            raise TypeError(f"{machine.__name__}: a driver runs one @initialize rule at most")
        self.initializer = initializers[0] if initializers else None
        self.invariants = _gathered(machine, "invariants")

    @property
    def rule_names(self) -> frozenset[str]:
        """The rules this driver's steps are drawn from."""
        return frozenset(self.rules)

    def steps(
        self, *, min_size: int = 0, max_size: int | None = None
    ) -> st.SearchStrategy[list[Step]]:
        """Lists of steps (a walk's ``(rule, arguments)``), each a rule of the machine,
        in name order, with arguments drawn from that rule's own strategies."""
        one = st.one_of(
            *(
                st.tuples(st.just(name), st.fixed_dictionaries(dict(rule.arguments)))
                for name, rule in sorted(self.rules.items())
            )
        )
        return st.lists(one, min_size=min_size, max_size=max_size)

    def run(self, steps: Sequence[Step], **setup: Any) -> None:
        """Run ``steps`` on a fresh machine, its ``@initialize`` rule called with ``setup``.
        A step whose preconditions do not hold now is skipped."""
        machine = self.machine()
        try:
            if self.initializer is not None:
                self.initializer.function(machine, **setup)
            for name, arguments in steps:
                rule = self.rules[name]
                if not all(holds(machine) for holds in rule.preconditions):
                    continue
                rule.function(machine, **arguments)
                for invariant in self.invariants:
                    if all(holds(machine) for holds in invariant.preconditions):
                        invariant.function(machine)
        finally:
            machine.teardown()


def machines_in(module: ModuleType) -> list[type[RuleBasedStateMachine]]:
    """The state machines a suite module holds (defined there or imported)."""
    return [
        value
        for value in vars(module).values()
        if isinstance(value, type)
        and issubclass(value, RuleBasedStateMachine)
        and value is not RuleBasedStateMachine
    ]


def drivers_in(module: ModuleType) -> list[Driver]:
    """The derived drivers a suite module holds."""
    return [value for value in vars(module).values() if isinstance(value, Driver)]


def uncovered(module: ModuleType) -> dict[str, set[str]]:
    """Per machine of the suite that is a driver's machine, or a subclass or a base of
    one, the rules no driver of the suite runs (machines fully covered are left out)."""
    drivers = drivers_in(module)
    out: dict[str, set[str]] = {}
    for machine in machines_in(module):
        related = [
            d for d in drivers if issubclass(machine, d.machine) or issubclass(d.machine, machine)
        ]
        if not related:
            continue
        wanted = set(rules_of(machine))
        best = min((wanted - d.rule_names for d in related), key=len)
        if best:
            out[machine.__qualname__] = best
    return out


__all__ = ["Driver", "Step", "drivers_in", "machines_in", "rules_of", "uncovered"]
