"""Telling a failure: the one vocabulary every suite uses.

A failing kata test says which rule broke, the steps that led there and what was
expected against what came. Four helpers say it, and nothing here names a kata:

- :func:`expect` compares a value with the one the rule asks for and, for records
  (dataclasses, named tuples), names the fields that differ;
- :func:`check` fails with a message a test wrote itself, alone (an ``assert`` would add
  pytest's rendering of the same comparison);
- :func:`not_refused` wraps a call the rule says must go through: a refusal (an exception)
  fails the test by assertion, as a wrong answer would, never as an error;
- :class:`Story` keeps the operations a test ran, stamped with the time on its clock,
  and tells them, the last ones if there are many, under the rule that broke.

Each raises ``AssertionError`` with its traceback frame hidden, so pytest shows the
test's line and the message, once.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator

#: How many of a story's last steps a failure shows.
SHOWN_STEPS = 40


def differences(want: object, got: object) -> str:
    """``field: expected x, got y`` for each field in which two records of one type
    differ (dataclasses and named tuples); ``expected x, got y`` for anything else."""
    if type(want) is type(got):
        if dataclasses.is_dataclass(want) and not isinstance(want, type):
            names = [f.name for f in dataclasses.fields(want)]
        else:
            names = list(getattr(want, "_fields", ()))
        diffs = [
            f"{n}: expected {getattr(want, n)!r}, got {getattr(got, n)!r}"
            for n in names
            if getattr(want, n) != getattr(got, n)
        ]
        if diffs:
            return "; ".join(diffs)
    return f"expected {want!r}, got {got!r}"


def expect(got: object, want: object, what: str) -> None:
    """Fail unless ``got == want``: ``what``, then expected and got, then the fields
    that differ when they are records."""
    __tracebackhide__ = True
    if got != want:
        detail = differences(want, got)
        fields = f"\n  ({detail})" if not detail.startswith("expected ") else ""
        raise AssertionError(f"{what}\n  expected {want}\n  got      {got}{fields}")


def check(ok: object, message: str) -> None:
    """Fail with ``message`` alone unless ``ok`` is true."""
    __tracebackhide__ = True
    if not ok:
        raise AssertionError(message)


@contextlib.contextmanager
def not_refused(what: str, *refusals: type[Exception]) -> Iterator[None]:
    """The block must not raise ``refusals`` (default: any exception): one that does
    fails with ``what`` (the call, and why it must go through), then what it raised."""
    __tracebackhide__ = True
    caught = refusals or (Exception,)
    try:
        yield
    except caught as error:
        raise AssertionError(f"{what}; it raised {type(error).__name__}: {error}") from None


class Story:
    """The steps a test has taken, each stamped ``t=`` with its clock's time since
    ``origin_ns``, to tell under the rule that broke: ``Story(title, clock.now_ns)``."""

    def __init__(self, title: str, now_ns: Callable[[], int], origin_ns: int = 0) -> None:
        self.now_ns, self.origin_ns = now_ns, origin_ns
        self.lines = [title] if title else []

    def add(self, text: str) -> None:
        self.lines.append(f"  t=+{self.now_ns() - self.origin_ns:<14} {text}")

    def tell(self, invariant: str, detail: str) -> str:
        """The failure's text: the rule, the steps (the last :data:`SHOWN_STEPS`), what
        came instead."""
        steps = self.lines
        if len(steps) > SHOWN_STEPS + 1:
            steps = [steps[0], "  …", *steps[-SHOWN_STEPS:]]
        return "\n".join([invariant, *steps, f"  => {detail}"])

    def check(self, ok: object, invariant: str, detail: str) -> None:
        """Fail unless ``ok``, telling the story."""
        __tracebackhide__ = True
        if not ok:
            raise AssertionError(self.tell(invariant, detail))

    def expect(self, got: object, want: object, invariant: str) -> None:
        """Fail unless ``got == want``, telling the story and the fields that differ."""
        __tracebackhide__ = True
        if got != want:
            raise AssertionError(self.tell(invariant, differences(want, got)))


__all__ = ["SHOWN_STEPS", "Story", "check", "differences", "expect", "not_refused"]
