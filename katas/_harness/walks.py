"""Fixed walks for stateful model tests: the boundaries every run reaches.

Hypothesis's stateful tests take no explicit examples, so a rule's boundary (a full
cache's next put, the very instant of a deadline) is met only when random steps happen to
reach it, and which runs do changes with hypothesis's version. A walk is a fixed list of
``(rule, arguments)`` steps; :func:`walked` gives the machine's ``TestCase``, which
replays every walk on a fresh machine, the invariants checked after each step as
hypothesis checks them, before hypothesis explores at random.

A rule that draws from ``st.data()`` gets its values from :class:`Drawn`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from hypothesis.stateful import RuleBasedStateMachine

Step = tuple[str, Mapping[str, Any]]
Walk = Sequence[Step]


class Drawn:
    """Stands for ``st.data()`` in a walk: each ``draw`` returns the next given value."""

    def __init__(self, *values: Any) -> None:
        self.values = values
        self._left = list(values)

    def draw(self, strategy: object, label: object = None) -> Any:
        if not self._left:
            raise LookupError(f"the walk gave no value for a draw from {strategy!r}")
        return self._left.pop(0)


def _fresh(value: Any) -> Any:
    return Drawn(*value.values) if isinstance(value, Drawn) else value


def replay(machine_type: type[RuleBasedStateMachine], walk: Walk) -> None:
    """Run ``walk`` on a fresh machine: each step, then the invariants; then teardown.

    Steps call the rules directly, so a walk must respect their preconditions itself.
    """
    machine = machine_type()
    try:
        for name, arguments in walk:
            # A fresh Drawn each time: a walk may be replayed again.
            fresh = {k: _fresh(v) for k, v in arguments.items()}
            try:
                getattr(machine, name)(**fresh)
                for invariant in getattr(machine, "invariants", ()):
                    if all(check(machine) for check in invariant.preconditions):
                        invariant.function(machine)
            except AssertionError as failure:  # as hypothesis notes a failing step
                shown = ", ".join(f"{k}={v!r}" for k, v in arguments.items())
                failure.add_note(f"state.{name}({shown})")
                raise
    finally:
        machine.teardown()


def walked(machine_type: type[RuleBasedStateMachine], walks: Mapping[str, Walk]) -> type[Any]:
    """``machine_type.TestCase``, whose run replays ``walks`` before hypothesis explores.

    A failing walk raises the machine's own assertion, with a note naming the walk.
    """
    base: type[Any] = machine_type.TestCase

    class Walked(base):  # type: ignore[misc]
        def runTest(self) -> None:
            for name, walk in walks.items():
                try:
                    replay(machine_type, walk)
                except AssertionError as failure:
                    failure.add_note(f"(in the fixed walk {name!r}, before any random steps)")
                    raise
            super().runTest()

    runner: Any = Walked.runTest
    runner.is_hypothesis_test = True
    runner._hypothesis_state_machine_class = machine_type
    Walked.__name__, Walked.__qualname__ = base.__name__, base.__qualname__
    return Walked
