"""The one way a suite reaches the code under test: ``stage()`` — also from helpers and
hypothesis state machines, which cannot take fixtures.

``stage()`` is the stage module of the suite now running (its ``stage(N)`` marker),
``stage(n)`` another stage of the same kata — from the reference when ``--base=reference``
and ``n`` is below the suite's stage — and ``module(name)`` another module of the kata
under test, such as the C extension a stage also builds. The plugin sets the running
suite before each test and clears it after; outside a test, ``stage()`` is an error that
says so.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

from katas._registry import impl


@dataclass(frozen=True)
class KataUnderTest:
    """The stage modules of one kata, from the selected implementation.

    With ``--base=reference``, stages below the suite's own come from the reference.
    """

    name: str
    selection: impl.Selection
    suite_stage: int | None = None

    def stage(self, n: int) -> ModuleType:
        """Stage ``n`` as this suite tests it (see :meth:`impl.Selection.stage`)."""
        return self.selection.stage(self.name, n, top=max(n, self.suite_stage or n))

    def module(self, name: str) -> ModuleType:
        """The module ``name`` of this kata, from the selected implementation."""
        return importlib.import_module(f"{self.selection.package}.{self.name}.{name}")


_running: list[KataUnderTest] = []


def running(kata: KataUnderTest | None) -> None:
    """Set (or, with None, clear) the kata of the test now running: the plugin's job."""
    _running[:] = [] if kata is None else [kata]


def stage(n: int | None = None) -> ModuleType:
    """The stage module under test (``n``: another stage of the same kata)."""
    if not _running:
        raise RuntimeError("stage() reaches the code under test only while a kata test runs")
    kata = _running[0]
    number = kata.suite_stage if n is None else n
    if number is None:
        raise RuntimeError(f"{kata.name}: the suite has no stage(N) marker")
    return kata.stage(number)


def module(name: str) -> ModuleType:
    """Another module of the kata under test (``_hotpath``), from the implementation."""
    if not _running:
        raise RuntimeError("module() reaches the code under test only while a kata test runs")
    return _running[0].module(name)
