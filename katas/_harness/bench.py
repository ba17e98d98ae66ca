"""Helpers shared by the katas' benchmark files (``katas/*/bench_stage*.py``).

A benchmark that compares contenders — the implementation under test, the reference,
an anchor library, a floor — runs them with :func:`interleaved`: in turn within every
round, so that drift on a shared machine hits them alike, and keeps each one's best
round. Every ratio is measured inside the one benchmark test that ran its contenders
(never from results a test before it left behind), so a ratio does not depend on which
tests ran or in what order.

:func:`report` records a ratio, its target and whether the target is met in the
benchmark's ``extra_info`` (under :data:`RATIOS`, which ``--benchmark-json`` writes and
``kata bench`` reads back: ``katas._cli.cli_bench.bench_ratios``), and prints it as one
line (:func:`ratio_line`) with :func:`say`, which writes past pytest's capture, so the
numbers show even without ``-s``.
``KATA_BENCH_ROUNDS`` (``kata bench --rounds N``) caps every benchmark's rounds, for a
quick run whose numbers are rougher.

The ``benchmark`` fixture is passed in, never imported: this module needs neither
pytest nor pytest-benchmark at run time, so importing it stays as light as the rest of
:mod:`katas._harness`.
"""

from __future__ import annotations

import math
import os
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pytest

#: The ``extra_info`` key of a benchmark's ratios: ``{label: {"value", "target", "met"}}``,
#: and where the rounds tell it, ``"spread": [low, high]`` and ``"noise"`` (:func:`report`).
RATIOS = "ratios"
#: The ``extra_info`` key of every round :func:`interleaved` ran, the warm-up included (as
#: in each contender's best): ``{name: [seconds per op, …]}``, one entry a round.
ROUNDS = "round_seconds_per_op"
#: Caps the rounds of every benchmark (a positive integer): a quick, rougher run.
ENV_ROUNDS = "KATA_BENCH_ROUNDS"
#: A target that can be checked: a comparison with a number, at the start of the text
#: (``>= 5``, ``<= 1.5 here``, ``== 1``); anything else (``~1``, ``informational``) is
#: read by eye.
_TARGET = re.compile(r"^\s*(?P<op>>=|<=|==|≥|≤|>|<)\s*(?P<number>[-+]?\d+(?:\.\d*)?)")
#: A target read by eye around a number: ``~1``.
_ABOUT = re.compile(r"^\s*~\s*(?P<number>[-+]?\d+(?:\.\d*)?)")


def capped_rounds(wanted: int) -> int:
    """``wanted`` rounds, or ``KATA_BENCH_ROUNDS`` if that is fewer (ValueError if it is
    not a positive integer)."""
    cap = os.environ.get(ENV_ROUNDS, "").strip()
    if not cap:
        return wanted
    if not cap.isdigit() or int(cap) < 1:
        raise ValueError(f"{ENV_ROUNDS} must be a positive integer, not {cap!r}")
    return min(wanted, int(cap))


@dataclass
class Contender:
    """One contender of :func:`interleaved`: ``run`` is its timed round of ``ops``
    operations; ``setup``, if any, runs untimed before every round (a top-up that keeps
    the workload's size, say). With ``self_timed``, ``run`` returns the seconds of the
    part it timed itself (threads released together, their start not timed)."""

    run: Callable[[], object]
    ops: int
    setup: Callable[[], object] | None = None
    self_timed: bool = False


def interleaved(
    benchmark: Any, contenders: Mapping[str, Contender], rounds: int
) -> dict[str, float]:
    """Rounds that run every contender once, in turn (each round starting with the next
    one), so drift on a shared machine hits them alike; ``{name: seconds per op}`` of
    each one's best round, also recorded as ``extra_info["ops_per_s[name]"]``. Every
    contender's ``setup`` runs (untimed) before every round, the one warm-up round
    included. ``rounds`` is capped by ``KATA_BENCH_ROUNDS``. Under
    ``--benchmark-disable`` (one round, nothing measured) every value is NaN."""
    best = dict.fromkeys(contenders, math.inf)
    taken: dict[str, list[float]] = {name: [] for name in contenders}
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
            took = contender.run()
            seconds = time.perf_counter() - start
            if contender.self_timed:
                assert isinstance(took, float), f"{name}: a self-timed run returns seconds"
                seconds = took
            best[name] = min(best[name], seconds)
            taken[name].append(seconds)

    benchmark.pedantic(
        one_round, setup=setup, rounds=capped_rounds(rounds), iterations=1, warmup_rounds=1
    )
    if benchmark.stats is None:  # --benchmark-disable: nothing was measured
        return dict.fromkeys(contenders, math.nan)
    per_op = {name: best[name] / contenders[name].ops for name in contenders}
    for name, seconds in per_op.items():
        benchmark.extra_info[f"ops_per_s[{name}]"] = round(1 / seconds)
    benchmark.extra_info[ROUNDS] = {
        name: [seconds / contenders[name].ops for seconds in taken[name]] for name in contenders
    }
    return per_op


def round_spread(rounds: object, ratio: float) -> tuple[float, float] | None:
    """``(low, high)`` of ``ratio`` round by round: ``ratio`` is one contender's best round
    over another's (``per_op["reference"] / per_op["yours"]``), so the pair whose best
    rounds in ``rounds`` (:data:`ROUNDS`) give it is found, and each round's ratio of the
    two taken. None if no pair gives ``ratio`` (a ratio scaled or measured otherwise) or
    there was one round."""
    if not isinstance(rounds, dict) or not math.isfinite(ratio):
        return None
    times = {
        name: [float(t) for t in taken]
        for name, taken in rounds.items()
        if isinstance(taken, list) and len(taken) > 1 and all(t > 0 for t in taken)
    }
    for top, over in ((a, b) for a in times for b in times if a != b):
        if len(times[top]) != len(times[over]):
            continue
        if math.isclose(min(times[top]) / min(times[over]), ratio, rel_tol=1e-9):
            each = [t / u for t, u in zip(times[top], times[over], strict=True)]
            return min(each), max(each)
    return None


def within_noise(spread: tuple[float, float], target: str) -> bool:
    """Whether rounds whose ratios spread over ``spread`` cannot tell the verdict: the
    spread holds the target's number (``>= 1.5``: 1.5; ``~1``: 1), or 1 for a target
    with none (``informational``: which contender is faster)."""
    low, high = spread
    found = _TARGET.match(target) or _ABOUT.match(target)
    line = float(found["number"]) if found else 1.0
    return low <= line <= high


def say(capsys: pytest.CaptureFixture[str], line: str) -> None:
    """Print ``line`` (indented, after a blank line) past pytest's output capture."""
    with capsys.disabled():
        print(f"\n  {line}")


def verdict(value: float, target: str) -> bool | None:
    """Whether ``value`` meets ``target``: a bool if the target starts with a comparison
    (``>= 5``, ``<= 1.5``, ``== 1``), else None (``~1``, ``informational``: by eye); None
    for a value that is not a finite number."""
    found = _TARGET.match(target)
    if found is None or not math.isfinite(value):
        return None
    op, number = found["op"], float(found["number"])
    if op in (">=", "≥"):
        return value >= number
    if op in ("<=", "≤"):
        return value <= number
    if op == ">":
        return value > number
    if op == "<":
        return value < number
    return math.isclose(value, number, rel_tol=1e-9, abs_tol=1e-9)


def ratio_line(
    label: str,
    value: float,
    target: str,
    met: bool | None,
    spread: tuple[float, float] | None = None,
) -> str:
    """The one line a ratio is printed as: ``speedup_vs_limits = 5.210   (target: >= 5)
    met``, then, with the ``spread`` of its rounds, ``rounds 4.900–5.600`` and, if they
    hold the target (:func:`within_noise`), ``: within noise``."""
    mark = "" if met is None else ("   met" if met else "   NOT MET")
    line = f"{label} = {value:.3f}   (target: {target}){mark}"
    if spread is not None:
        line += f"   rounds {spread[0]:.3f}–{spread[1]:.3f}"
        line += ": within noise" if within_noise(spread, target) else ""
    return line


def report(
    benchmark: Any, capsys: pytest.CaptureFixture[str], label: str, ratio: float, target: str
) -> None:
    """Record ``ratio`` as ``extra_info["ratios"][label]`` (value, target, met; with the
    spread of its rounds where :func:`round_spread` finds it, and whether that spread is
    :func:`within_noise`) and print it beside the target."""
    met = verdict(ratio, target)
    recorded: dict[str, Any] = {"value": round(ratio, 3), "target": target, "met": met}
    spread = round_spread(benchmark.extra_info.get(ROUNDS), ratio)
    if spread is not None:
        recorded["spread"] = [round(spread[0], 3), round(spread[1], 3)]
        recorded["noise"] = within_noise(spread, target)
    benchmark.extra_info.setdefault(RATIOS, {})[label] = recorded
    say(capsys, ratio_line(label, ratio, target, met, spread))
