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

The other way round fits a suite whose list-of-steps tests are written in a type of its
own (an ``Op`` dataclass, whose ``@example``s and fixed runs are lists of ``Op``, compared
step by step against a model): the operations are declared once, as :class:`Operations`
(every kind of the ``Op`` type, with how to draw one in a context), the lists of
operations are drawn from that declaration, and so are the machine's rules —
``@OPERATIONS.machine()`` gives the machine one rule per kind, named as the kind, which
draws an operation of that kind as the lists draw it and hands it to the machine's
``apply``. The convention's second form, checked as well:

- every state machine a suite holds that is derived from a declaration (or subclasses
  one) walks every kind of its ``Op`` type — each has a draw in the declaration and a rule
  (or an every-step invariant) of the machine;
- and has no rule of the machine of its own beyond them, unless marked :func:`machine_only` with the
  reason the lists do not run it (a fault they do not inject).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from types import ModuleType
from typing import Any, Generic, Protocol, TypeVar

from hypothesis import stateful
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine

from katas._harness.walks import Drawn, Step


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


# --- the second form: rules derived from a declaration of operations ------------------

C = TypeVar("C")  # what a draw depends on: a configuration, say (hashable)
OpT = TypeVar("OpT")  # the suite's operation type
O_contra = TypeVar("O_contra", contravariant=True)
C_co = TypeVar("C_co", covariant=True)
M = TypeVar("M", bound=type[RuleBasedStateMachine])
F = TypeVar("F", bound=Callable[..., object])

#: A kind's draw: the strategy of one operation of that kind in a context, or
#: ``st.nothing()`` where the kind does not apply (the machine's rule is then disabled).
#: A draw that is a ``one_of`` of n branches weighs n among the other kinds' branches.
Draw = Callable[[C], st.SearchStrategy[OpT]]

_DECLARED = "_operations_declared"
_MACHINE_ONLY = "_machine_only"


class _Walking(Protocol[C_co, O_contra]):
    """What a machine derived from :class:`Operations` defines."""

    def draws(self) -> C_co:
        """The context its operations are drawn in now."""

    def apply(self, op: O_contra) -> None:
        """Apply one operation (and check what it must)."""


class Operations(Generic[C, OpT]):
    """A model test's operations, declared once: every kind of the suite's operation type
    (``kinds``, the values of its ``Literal``), each with its :data:`Draw`; ``kind_of``
    reads an operation's kind. The lists of operations and a machine's rules are both
    derived from it, so that a kind is walked by both or declared missing."""

    def __init__(
        self, kinds: Iterable[str], draws: Mapping[str, Draw[C, OpT]], kind_of: Callable[[OpT], str]
    ) -> None:
        self.kinds = tuple(kinds)
        self.draws = dict(draws)  # in the order of the branches they give
        self.kind_of = kind_of
        unknown = set(self.draws) - set(self.kinds)
        if unknown:
            raise TypeError(f"draws for kinds the operation type has not: {sorted(unknown)}")
        self._drawn: dict[tuple[str, C], st.SearchStrategy[OpT]] = {}

    def draw(self, kind: str, context: C) -> st.SearchStrategy[OpT]:
        """One operation of ``kind`` in ``context`` (strategies are built once a context)."""
        key = (kind, context)
        if key not in self._drawn:
            self._drawn[key] = self.draws[kind](context)
        return self._drawn[key]

    def one(self, context: C) -> st.SearchStrategy[OpT]:
        """One operation of any kind, each kind's branches in declaration order."""
        return st.one_of(*(self.draw(kind, context) for kind in self.draws))

    def lists(
        self, context: C, *, min_size: int = 0, max_size: int | None = None
    ) -> st.SearchStrategy[list[OpT]]:
        return st.lists(self.one(context), min_size=min_size, max_size=max_size)

    def machine(self, *, every_step: Mapping[str, OpT] | None = None) -> Callable[[M], M]:
        """A class decorator: the machine gets a rule per declared kind, named as the kind,
        that draws one operation of it as the lists do (disabled where the draw is empty)
        and calls the machine's ``apply``; a kind of ``every_step`` is instead applied,
        as the given operation, after every step (an invariant named as the kind)."""
        always = dict(every_step or {})
        if set(always) - set(self.draws):
            raise TypeError(
                f"every_step names undeclared kinds: {sorted(set(always) - set(self.draws))}"
            )

        def derive(machine: M) -> M:
            for needed in ("draws", "apply"):
                if not callable(getattr(machine, needed, None)):
                    raise TypeError(f"{machine.__name__} derived from operations needs {needed}()")
            for kind in self.draws:
                if kind in vars(machine):
                    raise TypeError(f"{machine.__name__}.{kind}: a declared kind's rule is derived")
                made = self._invariant(kind, always[kind]) if kind in always else self._rule(kind)
                made.__qualname__ = f"{machine.__qualname__}.{kind}"
                setattr(machine, kind, made)
            setattr(machine, _DECLARED, (self, frozenset(always)))
            return machine

        return derive

    def _rule(self, kind: str) -> Callable[..., None]:
        def walk(machine: _Walking[C, OpT], data: st.DataObject) -> None:
            __tracebackhide__ = True  # the failure is the machine's apply's
            machine.apply(data.draw(self.draw(kind, machine.draws()), label=kind))

        walk.__name__ = kind
        walk.__doc__ = f"One {kind!r} operation, drawn as the lists of operations draw it."

        def applies(machine: _Walking[C, OpT]) -> bool:
            return not self.draw(kind, machine.draws()).is_empty

        return stateful.precondition(applies)(stateful.rule(data=st.data())(walk))

    def _invariant(self, kind: str, op: OpT) -> Callable[..., None]:
        def walk(machine: _Walking[C, OpT]) -> None:
            __tracebackhide__ = True
            machine.apply(op)

        walk.__name__ = kind
        walk.__doc__ = f"The {kind!r} operation, after every step."
        return stateful.invariant()(walk)

    def walk(self, machine: type[RuleBasedStateMachine], ops: Iterable[OpT]) -> list[Step]:
        """``ops`` as steps of ``machine``'s derived rules (for a fixed walk, see
        :mod:`katas._harness.walks`); a kind applied after every step is left out."""
        _, always = declared_by(machine) or (self, frozenset())
        return [
            (self.kind_of(op), {"data": Drawn(op)}) for op in ops if self.kind_of(op) not in always
        ]


def machine_only(reason: str) -> Callable[[F], F]:
    """Marks a rule of a machine derived from :class:`Operations` that the lists of
    operations do not run, with the reason (put it above ``@rule``)."""

    def mark(f: F) -> F:
        setattr(f, _MACHINE_ONLY, reason)
        return f

    return mark


def declared_by(
    machine: type[RuleBasedStateMachine],
) -> tuple[Operations[object, object], frozenset[str]] | None:
    """The declaration ``machine`` (or a base of it) was derived from, and the kinds it
    applies after every step; None for a machine written by hand."""
    found: tuple[Operations[object, object], frozenset[str]] | None = getattr(
        machine, _DECLARED, None
    )
    return found


def unwalked(module: ModuleType) -> dict[str, list[str]]:
    """Per machine of the suite derived from a declaration of operations, what one of its
    two drivers runs and the other does not: a kind of the operation type with no draw (so
    neither a list nor a rule has it), a declared kind with no rule (nor every-step
    invariant) of the machine, a rule of the machine that is no declared kind and is not
    marked :func:`machine_only`. Machines with nothing missing are left out."""
    out: dict[str, list[str]] = {}
    for machine in machines_in(module):
        found = declared_by(machine)
        if found is None:
            continue
        operations, _ = found
        rules = rules_of(machine)
        walked = set(rules) | {i.function.__name__ for i in _gathered(machine, "invariants")}
        problems = [
            f"kind {k!r} has no draw: no list nor rule walks it"
            for k in operations.kinds
            if k not in operations.draws
        ]
        problems += [
            f"kind {k!r} has no rule of the machine" for k in operations.draws if k not in walked
        ]
        for name, made in sorted(rules.items()):
            own = (getattr(machine, name, None), made.function)
            if name not in operations.draws and not any(hasattr(f, _MACHINE_ONLY) for f in own):
                problems.append(f"rule {name!r} draws no kind the lists draw (nor is machine_only)")
        if problems:
            out[machine.__qualname__] = problems
    return out


__all__ = [
    "Draw",
    "Driver",
    "Operations",
    "Step",
    "declared_by",
    "drivers_in",
    "machine_only",
    "machines_in",
    "rules_of",
    "uncovered",
    "unwalked",
]
