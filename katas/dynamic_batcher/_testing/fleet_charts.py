"""Pictures of a fleet's runs (:mod:`.fleet_pictures`): terminal charts in plain text and
Unicode block characters, and an optional PNG (matplotlib, the ``[plot]`` extra, imported
only when asked for).

- :func:`load_chart`: per run, the replicas' mean load and the most loaded one over
  simulated time (an area chart), and each replica's load (a sparkline), every run on one
  scale — round-robin's spread next to the router's even load — with the prefix-cache
  hits of each.
- :func:`timeline_chart`: a row per request, a column per engine step, each token
  lettered by the replica that streamed it, and the instant a replica was killed.

Every line is at most ``width`` characters (ANSI colours, when asked for, aside).
"""

from __future__ import annotations

import importlib
import itertools
import os
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .charts import format_ns

_UP = " ▁▂▃▄▅▆▇█"
_GUTTER = 7
_COLORS = ("34", "33", "35", "36", "32", "31")  # ANSI: blue, yellow, magenta, cyan, …


@dataclass
class Attempt:
    """One request on one replica, as the replica's link saw it: where in the request's
    output its tokens start (``offset``: tokens accepted before it), when it started, and
    each event with the time it came (ns since the run's start)."""

    replica: str
    rid: str
    offset: int
    start_ns: int
    events: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)


@dataclass(frozen=True)
class LoadRun:
    """One run of the load picture: each replica's outstanding tokens after every step,
    and what the replicas' prefix caches served."""

    name: str
    replicas: tuple[str, ...]
    step_ns: int
    samples: tuple[tuple[int, Mapping[str, int]], ...]  # (ns since the start, loads)
    requests: int
    whole: int  # requests whose stream is exactly their unbroken generation
    refused: int  # requests refused or failed (Overloaded, ReplicaError)
    hit_tokens: int
    prompt_tokens: int  # prompt tokens the replicas looked up (hits + computed)
    routes: str = ""  # how the router chose, from its statistics

    @property
    def max_over_mean(self) -> float:
        """The most loaded replica's load over the replicas' mean, both integrated over
        time (1.0: always even)."""
        top = sum(max(loads.values()) for _, loads in self.samples)
        mean = sum(sum(loads.values()) / len(loads) for _, loads in self.samples)
        return top / mean if mean else float("nan")

    @property
    def peak(self) -> int:
        return max((max(loads.values()) for _, loads in self.samples), default=0)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def end_ns(self) -> int:
        return self.samples[-1][0] if self.samples else 0


@dataclass(frozen=True)
class Timeline:
    """The failover picture's run: every attempt, what each client got, and the kill."""

    replicas: tuple[str, ...]
    step_ns: int
    killed: str
    kill_ns: int  # since the run's start
    attempts: tuple[Attempt, ...]
    outputs: Mapping[str, tuple[int, ...]]  # what each client read
    expected: Mapping[str, tuple[int, ...]]  # each request's unbroken generation
    ended: Mapping[str, str]  # "end", or what ended the stream
    failovers: int

    def tokens_of(self, rid: str) -> list[tuple[int, str] | None]:
        """For each token the client read: when it came and which replica streamed it
        (None if no attempt streamed that position: a router that made one up). A later
        attempt starts where the router's accepted tokens end, so it wins a position."""
        found: list[tuple[int, str] | None] = [None] * len(self.outputs.get(rid, ()))
        for attempt in (a for a in self.attempts if a.rid == rid):
            position = attempt.offset
            for at, tokens in attempt.events:
                for _ in tokens:
                    if position < len(found):
                        found[position] = (at, attempt.replica)
                    position += 1
        return found

    @property
    def broken(self) -> list[str]:
        """Requests whose stream is not exactly their unbroken generation."""
        return [
            rid
            for rid in self.outputs
            if self.outputs[rid] != self.expected.get(rid) or self.ended.get(rid) != "end"
        ]


# -- the load picture -----------------------------------------------------------------------------
def load_chart(runs: Mapping[str, LoadRun], width: int = 72, height: int = 8) -> str:
    """Each run's load over simulated time: an area chart of the replicas' mean (█) and
    of the most loaded replica above it (░), ``height`` rows on one scale for every run,
    then a sparkline per replica on the run's own scale, then the run's figures."""
    if width < 32 or height < 2:
        raise ValueError(f"need width >= 32 and height >= 2, got {width} x {height}")
    plot_w = width - _GUTTER
    scale = max((r.peak for r in runs.values()), default=0) or 1
    t1 = max((r.end_ns for r in runs.values()), default=0)
    lines = textwrap.wrap(
        "load: each replica's outstanding tokens after every engine step (a request "
        "weighs its prompt + budget until its first token, then the budget left); █ the "
        f"replicas' mean, ░ up to the most loaded one; one scale for all (top: {scale} "
        "tokens); x: simulated time",
        width,
    )
    for r in runs.values():
        columns = _load_columns(r, t1, plot_w)
        lines += ["", f"{r.name}:"]
        for row in range(height - 1, -1, -1):
            label = f"{scale:>5} ┤" if row == height - 1 else "      │"
            cells = []
            for mean, top, _ in columns:
                middle = (row + 0.5) / height * scale
                cells.append("█" if mean >= middle else "░" if top >= middle else " ")
            lines.append(label + "".join(cells))
        lines.append("    0 └" + "─" * plot_w)
        own = r.peak or 1  # each replica against the others: this run's own scale
        lines.append(f"{'':>5} │each replica, top {own} tokens:")
        for name in r.replicas:
            spark = []
            for _, _, each in columns:
                level = round(each.get(name, 0) / own * 8)
                spark.append(_UP[max(level, 1 if each.get(name, 0) > 0 else 0)])
            lines.append(f"{name:>5} │" + "".join(spark))
        lines += _load_figures(r)
    steps = f"{t1 // max(1, min(r.step_ns for r in runs.values()))} steps" if runs else ""
    lines.append(" " * _GUTTER + "0" + steps.rjust(plot_w - 1))
    lines += _comparison(runs)
    return "\n".join(_fit(line, width) for line in lines)


def _load_columns(r: LoadRun, t1: int, plot_w: int) -> list[tuple[float, float, dict[str, float]]]:
    """Per column of ``[0, t1)``: the mean over its samples of the replicas' mean load,
    of the top load, and of each replica's load (the last sample before, if none)."""
    out: list[tuple[float, float, dict[str, float]]] = []
    samples = list(r.samples)
    i = 0
    last: Mapping[str, int] = samples[0][1] if samples else {}
    for c in range(plot_w):
        end = (t1 or 1) * (c + 1) / plot_w
        taken: list[Mapping[str, int]] = []
        while i < len(samples) and samples[i][0] < end:
            taken.append(samples[i][1])
            i += 1
        if taken:
            last = taken[-1]
        elif samples and samples[-1][0] < end - (t1 or 1) / plot_w:
            last = dict.fromkeys(r.replicas, 0)  # past the run's end
        taken = taken or [last]
        n = len(taken)
        mean = sum(sum(x.values()) / max(1, len(x)) for x in taken) / n
        top = sum(max(x.values(), default=0) for x in taken) / n
        each = {name: sum(x.get(name, 0) for x in taken) / n for name in r.replicas}
        out.append((mean, top, each))
    return out


def _load_figures(r: LoadRun) -> list[str]:
    lines = [
        f"  max/mean load {r.max_over_mean:.2f} (over time; 1.00 is even), peak {r.peak} tokens",
        f"  prefix-cache hits: {r.hit_tokens} of {r.prompt_tokens} prompt tokens "
        f"({r.hit_rate:.0%})",
    ]
    if r.routes:
        lines.append(f"  routes: {r.routes}")
    if r.whole != r.requests or r.refused:
        lines.append(
            f"  ! {r.requests - r.whole} of {r.requests} streams not whole "
            f"({r.refused} refused or failed)"
        )
    return lines


def _comparison(runs: Mapping[str, LoadRun]) -> list[str]:
    if len(runs) < 2:
        return []
    names = list(runs)
    first, *rest = names
    out = []
    for name in rest:
        a, b = runs[name], runs[first]
        out.append(
            f"{name} vs {first}: max/mean {a.max_over_mean:.2f} vs {b.max_over_mean:.2f}, "
            f"cache hits {a.hit_rate:.0%} vs {b.hit_rate:.0%}"
        )
    return out


# -- the failover picture -------------------------------------------------------------------------
def timeline_chart(t: Timeline, width: int = 72, *, color: bool = False) -> str:
    """A row per request, a column per engine step (the step that produced the token):
    each token's replica as its letter (a capital: several tokens in one step), ``·``
    while the request waits for one, ``▼`` over the step in which ``killed`` died."""
    rids = sorted(t.outputs, key=_natural)
    gutter = max((len(rid) for rid in rids), default=2) + 2
    plot_w = max(1, width - gutter - 1)
    placed = {rid: t.tokens_of(rid) for rid in rids}
    last = max((x[0] for found in placed.values() for x in found if x), default=0)
    steps = max(_column(last, t.step_ns) + 1, t.kill_ns // t.step_ns + 1)
    kill_col = t.kill_ns // t.step_ns
    letters = {name: name[:1] for name in t.replicas}
    lines = textwrap.wrap(
        "failover: a row per request, a column per engine step; each token is the letter "
        f"of the replica that streamed it ({', '.join(t.replicas)}), a capital if it "
        f"streamed several in one step; · waiting for a token; ▼ replica {t.killed} "
        f"SIGKILLed (during step {kill_col})",
        width,
    )
    lines += ["", " " * (gutter + 1 + kill_col) + f"▼ kill {t.killed}"]
    for rid in rids:
        found = placed[rid]
        cells: list[tuple[str, str | None]] = [(" ", None)] * steps
        first = min((a.start_ns for a in t.attempts if a.rid == rid), default=0)
        end = max((x[0] for x in found if x), default=first)
        for col in range(first // t.step_ns, _column(end, t.step_ns) + 1):
            cells[col] = ("·", None)
        per_col: dict[int, list[str]] = {}
        for x in found:
            if x is not None:
                per_col.setdefault(_column(x[0], t.step_ns), []).append(x[1])
        for col, who in per_col.items():
            letter = letters.get(who[-1], "?")
            cells[col] = (letter.upper() if len(who) > 1 else letter, who[-1])
        if len(cells) > plot_w:  # longer than the width: the rest is cut, and says so
            cells = [*cells[: plot_w - 1], ("…", None)]
        if color:
            shown = "".join(_paint(ch, who, t.replicas) for ch, who in cells)
        else:
            shown = "".join(ch for ch, _ in cells)
        lines.append(f"{rid:<{gutter}}│{shown}")
    lines.append(" " * gutter + "└" + "─" * min(steps, plot_w))
    axis = f"{steps} steps of {format_ns(t.step_ns)}"
    lines.append(" " * (gutter + 1) + "0" + axis.rjust(max(len(axis), min(steps, plot_w) - 1)))
    for rid in rids:
        lines.append(_row_summary(rid, placed[rid], t))
    broken = t.broken
    verdict = (
        f"NOT WHOLE: {', '.join(broken)} did not get their unbroken generation"
        if broken
        else "every stream whole: each request got its unbroken generation, each token "
        f"once ({t.failovers} failovers)"
    )
    lines += textwrap.wrap(verdict, width)
    return "\n".join(line if color else _fit(line, width) for line in lines)


def _row_summary(rid: str, found: list[tuple[int, str] | None], t: Timeline) -> str:
    counts: dict[str, int] = {}
    for x in found:
        counts[x[1] if x else "?"] = counts.get(x[1] if x else "?", 0) + 1
    # each replica once, in the order it first streamed the request
    order = list(dict.fromkeys(x[1] if x else "?" for x in found))
    parts = ", ".join(f"{counts[who]} from {who}" for who in order)
    cols = sorted({_column(x[0], t.step_ns) for x in found if x})
    gaps = sum(b - a - 1 for a, b in itertools.pairwise(cols))
    gap = f", {gaps} step{'s' if gaps != 1 else ''} without a token" if gaps else ""
    return f"  {rid}: {len(found)} tokens: {parts or 'none'}{gap}"


def _column(at_ns: int, step_ns: int) -> int:
    """The step that produced a token that came at ``at_ns`` (a step's tokens come at its
    end: the one ending at ``k * step_ns`` is step ``k - 1``)."""
    return max(0, (at_ns - 1) // step_ns)


def _paint(ch: str, who: str | None, replicas: Sequence[str]) -> str:
    if who is None or who not in replicas:
        return ch
    code = _COLORS[list(replicas).index(who) % len(_COLORS)]
    return f"\x1b[{code}m{ch}\x1b[0m"


def _natural(rid: str) -> tuple[str, int]:
    head = rid.rstrip("0123456789")
    tail = rid[len(head) :]
    return head, int(tail) if tail else -1


def _fit(line: str, width: int) -> str:
    return line if len(line) <= width else line[: width - 1] + "…"


# -- the PNG --------------------------------------------------------------------------------------
def save_png(
    runs: Mapping[str, LoadRun],
    timeline: Timeline,
    path: str | os.PathLike[str],
    *,
    dpi: int = 120,
) -> None:
    """The load of every run and the failover timeline as a PNG (needs matplotlib)."""
    try:
        figure_module: Any = importlib.import_module("matplotlib.figure")
    except ImportError as exc:
        raise RuntimeError("save_png needs matplotlib: pip install 'infra-katas[plot]'") from exc
    fig = figure_module.Figure(figsize=(10, 3 * (len(runs) + 1)), layout="constrained")
    axes = fig.subplots(len(runs) + 1, 1)
    colors = {name: f"C{i}" for i, name in enumerate(timeline.replicas)}
    scale = max((r.peak for r in runs.values()), default=0) or 1
    for ax, r in zip(axes, runs.values(), strict=False):
        xs = [at / r.step_ns for at, _ in r.samples]
        for name in r.replicas:
            ys = [loads.get(name, 0) for _, loads in r.samples]
            ax.step(xs, ys, where="post", label=name, color=colors.get(name), linewidth=0.9)
        means = [sum(loads.values()) / len(loads) for _, loads in r.samples]
        ax.step(xs, means, where="post", label="mean", color="black", linestyle="--")
        ax.set_ylim(0, scale * 1.05)
        ax.set_ylabel("outstanding tokens")
        ax.set_title(
            f"{r.name}: max/mean {r.max_over_mean:.2f}, cache hits {r.hit_rate:.0%}", loc="left"
        )
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    runs_end = axes[len(runs) - 1] if runs else None
    if runs_end is not None:
        runs_end.set_xlabel("simulated time (engine steps)")
    ax = axes[-1]
    rids = sorted(timeline.outputs, key=_natural)
    for row, rid in enumerate(rids):
        for x in timeline.tokens_of(rid):
            if x is not None:  # at the instant it came: the end of the step that made it
                ax.scatter([x[0] / timeline.step_ns], [row], color=colors.get(x[1], "grey"), s=12)
    ax.axvline(timeline.kill_ns / timeline.step_ns, color="red", linestyle=":")
    ax.set_yticks(range(len(rids)), rids)
    ax.invert_yaxis()
    ax.set_xlabel("simulated time (engine steps)")
    ax.set_title(
        f"failover: each token coloured by its replica; {timeline.killed} SIGKILLed at the "
        "dotted line",
        loc="left",
    )
    handles = [
        ax.scatter([], [], color=c, s=12, label=name) for name, c in colors.items()
    ]  # the legend's swatches
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.savefig(os.fspath(path), dpi=dpi)


__all__ = ["Attempt", "LoadRun", "Timeline", "load_chart", "save_png", "timeline_chart"]
