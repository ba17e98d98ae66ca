"""Pictures of simulated runs: terminal charts in plain text and Unicode block characters,
and an optional PNG (matplotlib, the ``[plot]`` extra, imported only when asked for).

- :func:`occupancy_chart`: per run, slot occupancy (an area chart) and queue depth (a
  sparkline) over simulated time, every run on the same time axis — static batching's
  sawtooth next to continuous batching's full slots.
- :func:`distribution_chart`: a horizontal histogram of TTFT, TPOT or any values.

Every line is at most ``width`` characters.
"""

from __future__ import annotations

import bisect
import importlib
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from katas._runtime.clock import NS_PER_MS, NS_PER_S, NS_PER_US

if TYPE_CHECKING:  # simulate imports this module: no import cycle at run time
    from .simulate import Report, StepSample

#: Eighth blocks, growing upwards (index = eighths filled) and rightwards.
_UP = " ▁▂▃▄▅▆▇█"
_RIGHT = " ▏▎▍▌▋▊▉█"
_GUTTER = 7  # " 100% ┤", "queue │": the labels left of the plot


def format_ns(ns: float) -> str:
    """A duration in the unit that reads best: ``850 ns``, ``12.5 µs``, ``5.40 ms``, ``9.41 s``."""
    size = abs(ns)
    for unit, name in ((NS_PER_S, "s"), (NS_PER_MS, "ms"), (NS_PER_US, "µs")):
        if size >= unit:
            value = ns / unit
            digits = 0 if abs(value) >= 100 else 1 if abs(value) >= 10 else 2
            return f"{value:.{digits}f} {name}"
    return f"{ns:.0f} ns"


def percentile(ordered: Sequence[float], q: float) -> float:
    """The nearest-rank ``q``-th percentile of already sorted, non-empty ``ordered``."""
    if not ordered:
        raise ValueError("percentile of no values")
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def occupancy_chart(reports: Mapping[str, Report], width: int = 72, height: int = 10) -> str:
    """Slot occupancy (running / slots, ``height`` rows) and queue depth (one row, scaled
    to the largest queue of all runs) over simulated time, one panel per run."""
    if width < 24 or height < 2:
        raise ValueError(f"need width >= 24 and height >= 2, got {width} x {height}")
    plot_w = width - _GUTTER
    runs = list(reports.values())
    t0 = min((r.start_ns for r in runs), default=0)
    t1 = max((r.end_ns for r in runs), default=0)
    t1 = max(t1, t0 + plot_w)  # at least 1 ns per column
    edges = [t0 + (t1 - t0) * c // plot_w for c in range(plot_w + 1)]
    qmax = max((s.waiting for r in runs for s in r.series), default=0)
    lines = ["occupancy: running / slots; queue: requests waiting; x: simulated time"]
    for name, r in reports.items():
        occupancy = [v / r.slots for v in _columns(r.series, edges, lambda s: s.running)]
        queue = _columns(r.series, edges, lambda s: s.waiting)
        deepest = max((s.waiting for s in r.series), default=0)
        lines += [
            "",
            f"{name}: {r.steps} steps, {format_ns(r.makespan_ns)}, occupancy "
            f"{r.mean_occupancy:.0%} of {r.slots}, queue ≤ {deepest}",
        ]
        for row in range(height - 1, -1, -1):  # the top row first
            label = (
                " 100% ┤" if row == height - 1 else "  50% ┤" if 2 * row == height else "      │"
            )
            cells = []
            for value in occupancy:
                eighths = round(min(1.0, max(0.0, value)) * height * 8)
                cells.append(_UP[min(8, max(0, eighths - 8 * row))])
            lines.append(label + "".join(cells))
        lines.append("   0% └" + "─" * plot_w)
        spark = []
        for depth in queue:
            level = 0 if qmax == 0 else round(depth / qmax * 8)
            spark.append(_UP[max(level, 1 if depth > 0 else 0)])
        lines.append("queue │" + "".join(spark))
    end = format_ns(t1 - t0)
    lines.append(" " * _GUTTER + "0" + end.rjust(plot_w - 1))
    return "\n".join(_fit(line, width) for line in lines)


def distribution_chart(
    values: Sequence[float],
    *,
    title: str = "",
    bins: int = 10,
    width: int = 72,
    fmt: Callable[[float], str] = format_ns,
) -> str:
    """A histogram of ``values`` in ``bins`` equal-width bins (one row each, a bar and a
    count), under a title line with n, p50, p99 and max; ``fmt`` renders a value."""
    if width < 24 or bins < 1:
        raise ValueError(f"need width >= 24 and bins >= 1, got {width}, {bins}")
    ordered = sorted(values)
    name = title or "values"
    if not ordered:
        return _fit(f"{name}: no values", width)
    lo, hi = ordered[0], ordered[-1]
    if hi == lo:
        bins = 1
    counts = [0] * bins
    for v in ordered:
        counts[0 if hi == lo else min(bins - 1, int((v - lo) * bins / (hi - lo)))] += 1
    labels = [fmt(lo + (hi - lo) * i / bins) for i in range(bins + 1)]
    lw = max(len(label) for label in labels)
    cw = len(str(max(counts)))
    bar_w = max(1, width - (2 * lw + 1) - 2 - 1 - cw)  # "lo–hi │" bar " " count
    lines = [
        f"{name}: n={len(ordered)}, p50 {fmt(percentile(ordered, 50))}, "
        f"p99 {fmt(percentile(ordered, 99))}, max {fmt(hi)}"
    ]
    for i, count in enumerate(counts):
        eighths = round(count / max(counts) * bar_w * 8)
        bar = "█" * (eighths // 8) + (_RIGHT[eighths % 8] if eighths % 8 else "")
        if count and not bar:
            bar = "▏"
        span = f"{labels[i]:>{lw}}–{labels[i + 1]:<{lw}}"
        lines.append(f"{span} │{bar:<{bar_w}} {count:>{cw}}")
    return "\n".join(_fit(line, width) for line in lines)


def save_png(
    reports: Mapping[str, Report], path: str | os.PathLike[str], *, dpi: int = 120
) -> None:
    """Occupancy and queue depth over simulated time as a PNG (needs matplotlib)."""
    try:
        figure_module: Any = importlib.import_module("matplotlib.figure")
    except ImportError as exc:
        raise RuntimeError("save_png needs matplotlib: pip install 'infra-katas[plot]'") from exc
    # A bare Figure (no pyplot): no global state, no GUI backend, nothing to close.
    fig = figure_module.Figure(figsize=(10, 6), layout="constrained")
    occupancy, queue = fig.subplots(2, 1, sharex=True)
    for name, r in reports.items():
        xs = [s.now_ns / NS_PER_S for s in r.series]
        occupancy.step(xs, [s.running / r.slots for s in r.series], where="post", label=name)
        queue.step(xs, [s.waiting for s in r.series], where="post", label=name)
    occupancy.set_ylabel("slot occupancy")
    occupancy.set_ylim(0, 1.05)
    occupancy.legend(loc="lower right")
    queue.set_ylabel("queue depth")
    queue.set_xlabel("simulated time (s)")
    fig.savefig(os.fspath(path), dpi=dpi)


def _columns(
    series: Sequence[StepSample], edges: list[int], value: Callable[[StepSample], float]
) -> list[float]:
    """The time-weighted mean of ``value`` over each column ``[edges[c], edges[c+1])``;
    a step spans ``[now_ns, now_ns + cost_ns)``, and time with no step counts as 0."""
    acc = [0.0] * (len(edges) - 1)
    for s in series:
        a, b = s.now_ns, s.now_ns + s.cost_ns
        v = value(s)
        c = max(0, bisect.bisect_right(edges, a) - 1)
        while c < len(acc) and edges[c] < b:
            overlap = min(b, edges[c + 1]) - max(a, edges[c])
            if overlap > 0:
                acc[c] += v * overlap
            c += 1
    return [acc[c] / (edges[c + 1] - edges[c]) for c in range(len(acc))]


def _fit(line: str, width: int) -> str:
    return line if len(line) <= width else line[: width - 1] + "…"


__all__ = ["distribution_chart", "format_ns", "occupancy_chart", "percentile", "save_png"]
