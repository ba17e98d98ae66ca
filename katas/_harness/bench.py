"""Helpers shared by the katas' benchmark files (``katas/*/bench_stage*.py``).

A benchmark that compares contenders — the implementation under test, the reference,
an anchor library, a floor — runs them with :func:`interleaved`: in turn within every
round, so that drift on a shared machine hits them alike, and keeps each one's best
round. :func:`report` records a ratio in the benchmark's ``extra_info`` (what
``--benchmark-json`` writes) and prints it with :func:`say`, which writes past pytest's
capture, so the numbers show even without ``-s``.

The ``benchmark`` fixture is passed in, never imported: this module needs neither
pytest nor pytest-benchmark at run time, so importing it stays as light as the rest of
:mod:`katas._harness`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pytest


@dataclass
class Contender:
    """One contender of :func:`interleaved`: ``run`` is its timed round of ``ops``
    operations; ``setup``, if any, runs untimed before every round (a top-up that keeps
    the workload's size, say)."""

    run: Callable[[], object]
    ops: int
    setup: Callable[[], object] | None = None


def interleaved(
    benchmark: Any, contenders: Mapping[str, Contender], rounds: int
) -> dict[str, float]:
    """Rounds that run every contender once, in turn (each round starting with the next
    one), so drift on a shared machine hits them alike; ``{name: seconds per op}`` of
    each one's best round, also recorded as ``extra_info["ops_per_s[name]"]``. Every
    contender's ``setup`` runs (untimed) before every round, the one warm-up round
    included. Under ``--benchmark-disable`` (one round, nothing measured) every value
    is NaN."""
    best = dict.fromkeys(contenders, math.inf)
    order = list(contenders.items())
    turn = [0]

    def setup() -> None:  # returns None: pytest-benchmark takes a result as arguments
        for contender in contenders.values():
            if contender.setup is not None:
                contender.setup()

    def one_round() -> None:
        first = turn[0] % len(order)
        turn[0] += 1
        for name, contender in order[first:] + order[:first]:
            start = time.perf_counter()
            contender.run()
            best[name] = min(best[name], time.perf_counter() - start)

    benchmark.pedantic(one_round, setup=setup, rounds=rounds, iterations=1, warmup_rounds=1)
    if benchmark.stats is None:  # --benchmark-disable: nothing was measured
        return dict.fromkeys(contenders, math.nan)
    per_op = {name: best[name] / contenders[name].ops for name in contenders}
    for name, seconds in per_op.items():
        benchmark.extra_info[f"ops_per_s[{name}]"] = round(1 / seconds)
    return per_op


def say(capsys: pytest.CaptureFixture[str], line: str) -> None:
    """Print ``line`` (indented, after a blank line) past pytest's output capture."""
    with capsys.disabled():
        print(f"\n  {line}")


def report(
    benchmark: Any, capsys: pytest.CaptureFixture[str], label: str, ratio: float, target: str
) -> None:
    """Record ``ratio`` as ``extra_info[label]`` and print it beside the spec's target."""
    benchmark.extra_info[label] = round(ratio, 3)
    say(capsys, f"{label} = {ratio:.3f}   (target: {target})")
