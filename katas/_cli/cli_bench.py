"""``kata bench``: the stage's benchmark file run on the learner's code, its ratios (read
from the run's ``--benchmark-json``) against the kata's targets.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import tempfile
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from rich import box
from rich.table import Table
from rich.text import Text

from katas._cli.cliutil import (
    Command,
    Context,
    UserError,
    add_kata_stage,
    check_profile,
    impl_or_error,
)
from katas._cli.summary import print_summary
from katas._registry.impl import add_selection_options
from katas._registry.suites import run_suite

#: What ``katas._harness.bench.report`` records in a benchmark's ``extra_info``
#: (``--benchmark-json`` writes it): ``{RATIOS: {label: {"value", "target", "met"}}}``.
#: The CLI never imports the harness (it runs in the child), so the names are repeated.
RATIOS = "ratios"
#: Caps every benchmark's rounds in the child (``katas._harness.bench.capped_rounds``).
ENV_BENCH_ROUNDS = "KATA_BENCH_ROUNDS"


@dataclass(frozen=True)
class Ratio:
    """One ratio a bench file reported."""

    benchmark: str  # the benchmark test's name, with its parameters
    label: str
    value: float
    target: str
    met: bool | None  # None: the target is read by eye (~1, informational)
    spread: tuple[float, float] | None = None  # low and high of its rounds' own ratios
    noise: bool = False  # the spread holds the target: one run cannot tell


def _spread(recorded: object) -> tuple[float, float] | None:
    """``[low, high]`` as the harness records a ratio's spread, or None."""
    if not isinstance(recorded, list) or len(recorded) != 2:
        return None
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in recorded):
        return None
    return float(recorded[0]), float(recorded[1])


def bench_ratios(data: object) -> list[Ratio]:
    """The ratios in the contents of a ``--benchmark-json`` file, in the order of its
    benchmarks; whatever does not look like one is skipped."""
    found: list[Ratio] = []
    benchmarks = data.get("benchmarks") if isinstance(data, dict) else None
    for entry in benchmarks if isinstance(benchmarks, list) else []:
        extra = entry.get("extra_info") if isinstance(entry, dict) else None
        recorded = extra.get(RATIOS) if isinstance(extra, dict) else None
        for label, ratio in recorded.items() if isinstance(recorded, dict) else []:
            value = ratio.get("value") if isinstance(ratio, dict) else None
            if not isinstance(value, int | float) or isinstance(value, bool):
                continue
            met = ratio.get("met")
            found.append(
                Ratio(
                    benchmark=str(entry.get("name", "")),
                    label=str(label),
                    value=float(value),
                    target=str(ratio.get("target", "")),
                    met=met if isinstance(met, bool) else None,
                    spread=_spread(ratio.get("spread")),
                    noise=ratio.get("noise") is True,
                )
            )
    return found


def read_ratios(path: Path) -> list[Ratio]:
    """The ratios in the ``--benchmark-json`` file ``path``; none if it is missing or
    not JSON (a run that stopped before its benchmarks)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return []
    return bench_ratios(data)


def ratios_table(title: str, ratios: Sequence[Ratio], prefix: str = "") -> Table:
    """One row per ratio: its benchmark (``prefix`` cut off), measure, value, target, met."""
    table = Table(box=box.SIMPLE_HEAD, title=title)
    table.add_column("benchmark", style="dim")
    table.add_column("measure", style="bold")
    table.add_column("ratio", justify="right")
    table.add_column("rounds", justify="right")
    table.add_column("target")
    table.add_column("met")
    for ratio in ratios:
        met = {True: "[green]yes[/]", False: "[red]no[/]", None: "[dim]—[/]"}[ratio.met]
        if ratio.noise:
            met = f"{met} [yellow](noise)[/]" if ratio.met is not None else "[yellow]noise[/]"
        spread = ratio.spread
        table.add_row(
            Text(ratio.benchmark.removeprefix(prefix)),
            Text(ratio.label),
            f"{ratio.value:.3f}",
            Text(f"{spread[0]:.3f}–{spread[1]:.3f}" if spread else "—", style="dim"),
            Text(ratio.target),
            met,
        )
    return table


#: The footnote under a table with a ratio :attr:`Ratio.noise` marks.
NOISE_NOTE = (
    "(noise): the ratio of single rounds (the rounds column, low–high) fell on both sides "
    "of the target, or of 1 for a ~ target: this run cannot tell, and a verdict may flip "
    "on the next one. More rounds on a quieter machine narrow it."
)


#: The extra that installs the anchor libraries the benchmarks compare with.
BENCH_EXTRA = 'pip install -e ".[bench]"'
#: A bench file's ``pytest.importorskip("name", …)``: an anchor it skips without.
_ANCHOR = re.compile(r"""importorskip\(\s*["'](?P<name>[\w.]+)["']""")


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a broken one
        return False


def missing_anchors(bench_file: Path) -> list[str]:
    """The anchor libraries ``bench_file`` skips without (its ``importorskip`` calls) that
    are not installed here, where the benchmarks run too."""
    try:
        text = bench_file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return []
    names = dict.fromkeys(m["name"] for m in _ANCHOR.finditer(text))
    return [name for name in names if not _installed(name)]


def run_bench(args: argparse.Namespace, ctx: Context) -> int:
    kata = ctx.catalog.get(args.kata)
    stage = kata.stage(args.stage)
    path = kata.bench_path(stage)
    if not path.is_file():
        raise UserError(f"{kata.name} stage {stage.number} has no benchmarks ({path.name})")
    impl = impl_or_error(args.impl, ctx)
    check_profile()
    missing = missing_anchors(path)
    env = None
    if args.rounds is not None:
        if args.rounds < 1:
            raise UserError(f"--rounds must be at least 1, not {args.rounds}")
        env = {**os.environ, ENV_BENCH_ROUNDS: str(args.rounds)}
    with ExitStack() as stack:
        report = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kata-bench-")))
        report /= "benchmarks.json"
        if not args.verbose:
            stack.enter_context(ctx.out.status(f"Benchmarking {kata.name} stage {stage.number}…"))
        result = run_suite(
            path,
            impl=impl,
            pytest_args=["--benchmark-only", f"--benchmark-json={report}", *ctx.passthrough],
            env=env,
            live=args.verbose,
            timeout_s=None,
        )
        ratios = read_ratios(report)
    if ratios:
        title = f"{kata.name} stage {stage.number}: ratios"
        if args.rounds is not None:
            title += f" (at most {args.rounds} rounds: rough)"
        prefix = f"test_bench_stage{stage.number}_"
        ctx.out.print(ratios_table(title, ratios, prefix))
        if any(r.noise for r in ratios):
            ctx.out.print(NOISE_NOTE, style="yellow", highlight=False)
    elif not args.verbose and not missing:
        ctx.out.print("No ratios were reported.", style="yellow")
    if missing:
        said = ("No ratios were reported: t" if not ratios else "T") + (
            f"he benchmarks compare with {', '.join(missing)}, not installed: {BENCH_EXTRA} "
            "installs the anchor libraries."
        )
        ctx.out.print(Text(said, style="yellow"), soft_wrap=True)  # Text: "[bench]" is no markup
    skipped = result.by_outcome("skipped")
    for reason in dict.fromkeys(r.message for r in skipped if r.message):
        ctx.out.print(f"skipped: {reason}", style="yellow", highlight=False)
    if result.failures():
        print_summary(ctx.out, result, kata, stage, notes=["benchmarks"])
        return 1
    if not result.results and (missing or (result.output and not args.verbose)):
        if not missing:  # pytest's own words say why nothing ran
            ctx.out.print(Text(result.output.rstrip()))
        return 1
    ctx.out.print(
        "Benchmarks never fail: a target that is not met is reported, not an error.",
        style="dim",
    )
    return 0


def _configure_bench(parser: argparse.ArgumentParser) -> None:
    add_kata_stage(parser)
    add_selection_options(parser.add_argument, base=False)
    parser.add_argument(
        "--rounds",
        type=int,
        metavar="N",
        help=f"at most N rounds per benchmark (sets {ENV_BENCH_ROUNDS}): quicker, rougher",
    )
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="show pytest-benchmark's own tables"
    )


COMMAND = Command(
    "bench",
    "benchmark your stage against the reference and the anchor library",
    "Run the stage's benchmark file (bench_stageN.py) on your code (or --impl) with "
    "pytest-benchmark, and print the ratios against the reference and the library you "
    "would otherwise use, beside the kata's targets and whether each is met (read from "
    "the run's --benchmark-json). --rounds N caps every benchmark's rounds for a quick, "
    "rougher run. The anchors come with `pip install -e .[bench]`. Arguments after "
    "`--` go to pytest.",
    _configure_bench,
    run_bench,
    takes_passthrough=True,
)

__all__ = [
    "COMMAND",
    "ENV_BENCH_ROUNDS",
    "RATIOS",
    "Ratio",
    "bench_ratios",
    "missing_anchors",
    "ratios_table",
    "read_ratios",
]
