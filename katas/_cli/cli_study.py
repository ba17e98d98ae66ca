"""``kata hint``, ``reveal``, ``reset``, ``bench`` and ``progress``: the commands around an
attempt. Each reads only the kata's own files (HINTS.md, the reference next to the folder
of katas, the classic-bug catalogue, bench files) and the recorded progress.
"""

from __future__ import annotations

import argparse
import datetime as dt
import difflib
import importlib.util
import json
import os
import re
import sys
import tempfile
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from rich import box
from rich.markdown import Markdown
from rich.rule import Rule
from rich.syntax import Syntax
from rich.table import Table
from rich.text import Text

from katas._cli.cliutil import (
    Command,
    Context,
    UserError,
    add_kata_stage,
    check_profile,
    impl_or_error,
    print_summary,
    read_text,
)
from katas._cli.practice import clock_text
from katas._cli.pristine import PristineError, pristine_stub
from katas._cli.state import Attempt, State, StateError
from katas._registry import mutants
from katas._registry.catalog import Kata, Stage, display_path
from katas._registry.impl import add_selection_options
from katas._registry.notes import Part, hints
from katas._registry.suites import run_suite
from katas._runtime.clock import NS_PER_S

# --- kata hint -------------------------------------------------------------------------------


def stage_hints(kata: Kata, stage: Stage) -> list[Part]:
    """The stage's hints from HINTS.md; a :class:`UserError` if the file or section is missing."""
    found = hints(read_text(kata.hints, f"the hints of {kata.name}"), stage.section)
    if found is None:
        raise UserError(f"{display_path(kata.hints)} has no '## {stage.section}' section")
    return found


def _print_hint(
    ctx: Context, kata: Kata, stage: Stage, number: int, hint: Part, total: int
) -> None:
    ctx.out.print(Rule(f"{kata.name} stage {stage.number} · hint {number} of {total}"))
    ctx.out.print(Markdown(hint.body))


def reveal_next_hint(ctx: Context, kata: Kata, stage: Stage) -> bool:
    """Print the next unrevealed hint and remember it; False if every hint was shown."""
    found = stage_hints(kata, stage)
    with ctx.store.update() as state:
        shown = state.hints_revealed(kata.name, stage.number)
        if shown >= len(found):
            return False
        state.reveal_hint(kata.name, stage.number, shown + 1)
    _print_hint(ctx, kata, stage, shown + 1, found[shown], len(found))
    left = len(found) - shown - 1
    ctx.out.print(
        f"{left} more hint{'s' if left != 1 else ''} for this stage"
        + (f": kata hint {kata.name} {stage.number}" if left else "."),
        style="dim",
    )
    return True


def run_hint(args: argparse.Namespace, ctx: Context) -> int:
    kata = ctx.catalog.get(args.kata)
    stage = kata.stage(args.stage)
    found = stage_hints(kata, stage)
    if not found:
        ctx.out.print(f"{display_path(kata.hints)} has no hints for {stage.section}.")
        return 0
    state = ctx.state()
    if args.all:
        if not state.passed(kata.name, stage.number):
            raise UserError(
                f"--all shows every hint once {kata.name} stage {stage.number} has passed; "
                f"until then one at a time: kata hint {kata.name} {stage.number}"
            )
        with ctx.store.update() as changing:
            changing.reveal_hint(kata.name, stage.number, len(found))
        for number, hint in enumerate(found, 1):
            _print_hint(ctx, kata, stage, number, hint, len(found))
        return 0
    if args.again:
        shown = state.hints_revealed(kata.name, stage.number)
        if not shown:
            ctx.out.print(f"No hints shown yet: kata hint {kata.name} {stage.number}")
        for number, hint in enumerate(found[:shown], 1):
            _print_hint(ctx, kata, stage, number, hint, len(found))
        return 0
    if not reveal_next_hint(ctx, kata, stage):
        ctx.out.print(
            f"All {len(found)} hints for {kata.name} stage {stage.number} are shown; "
            f"read them again with kata hint {kata.name} {stage.number} --again."
        )
    return 0


def _configure_hint(parser: argparse.ArgumentParser) -> None:
    add_kata_stage(parser)
    which = parser.add_mutually_exclusive_group()
    which.add_argument(
        "--all", action="store_true", help="every hint of the stage (only once it has passed)"
    )
    which.add_argument("--again", action="store_true", help="the hints already shown, again")


# --- kata reveal -----------------------------------------------------------------------------


def reference_file(ctx: Context, kata: Kata, path: Path) -> Path:
    """The reference of the learner's file ``path``: the same place under ``solutions/``."""
    return ctx.catalog.project_root / "solutions" / kata.name / path.relative_to(kata.path)


def common_mistakes(ctx: Context, kata: Kata, stage: Stage) -> list[mutants.Mutant]:
    """The stage's classic-bug catalogue entries (``tests/mutants/<kata>/stageN_*.diff``)."""
    folder = ctx.catalog.project_root / "tests" / "mutants" / kata.name
    found: list[mutants.Mutant] = []
    for path in sorted(folder.glob(f"stage{stage.number}_*.diff")):
        try:
            found.append(mutants.parse(path))
        except (ValueError, OSError, UnicodeDecodeError):
            continue  # a malformed entry is the catalogue check's to report, not ours
    return found


def run_reveal(args: argparse.Namespace, ctx: Context) -> int:
    kata = ctx.catalog.get(args.kata)
    stage = kata.stage(args.stage)
    if not args.force and not ctx.state().passed(kata.name, stage.number):
        raise UserError(
            f"{kata.name} stage {stage.number} has not passed yet, so the reference stays "
            f"hidden; get it green (kata test {kata.name} {stage.number}) or use --force"
        )
    ctx.out.print(Rule(f"{kata.name} stage {stage.number}: the reference (-) and yours (+)"))
    for path in kata.learner_paths(stage):
        reference = reference_file(ctx, kata, path)
        theirs = read_text(reference, "the reference solution")
        mine = read_text(path, "your stage file")
        diff = list(
            difflib.unified_diff(
                theirs.splitlines(keepends=True),
                mine.splitlines(keepends=True),
                fromfile=f"reference {display_path(reference)}",
                tofile=f"yours {display_path(path)}",
                n=args.context,
            )
        )
        if diff:
            ctx.out.print(Syntax("".join(diff), "diff", theme="ansi_dark", word_wrap=True))
        else:
            ctx.out.print(f"Your {display_path(path)} is identical to the reference.")
    found = common_mistakes(ctx, kata, stage)
    ctx.out.print(Rule(f"common mistakes in stage {stage.number} ({len(found)})"))
    if not found:
        ctx.out.print("No catalogue entries for this stage yet.", style="dim")
    for mutant in found:
        line = Text("• ", style="bold")
        line.append(mutant.bug)
        line.append(f"  ({mutant.path.stem})", style="dim")
        ctx.out.print(line, soft_wrap=True)
    return 0


def _configure_reveal(parser: argparse.ArgumentParser) -> None:
    add_kata_stage(parser)
    parser.add_argument(
        "--force", action="store_true", help="show the reference even before the stage passed"
    )
    parser.add_argument(
        "--context", type=int, default=3, metavar="N", help="lines of context in the diff (3)"
    )


# --- kata reset ------------------------------------------------------------------------------


def run_reset(args: argparse.Namespace, ctx: Context) -> int:
    kata = ctx.catalog.get(args.kata)
    stages = [kata.stage(args.stage)] if args.stage is not None else list(kata.stages)
    changes: list[tuple[Path, str, str]] = []  # (file, its pristine text, which commit)
    for path in dict.fromkeys(p for stage in stages for p in kata.learner_paths(stage)):
        try:
            text, commit = pristine_stub(path)
        except PristineError as exc:
            raise UserError(str(exc)) from None
        current = path.read_text(encoding="utf-8") if path.exists() else None
        if current == text:
            ctx.out.print(f"{display_path(path)} is already the pristine stub.", style="dim")
        else:
            changes.append((path, text, commit))
    if not changes:
        _record_reset(ctx, kata, stages)
        return 0
    names = ", ".join(display_path(p) for p, _, _ in changes)
    stamp = dt.datetime.fromtimestamp(ctx.wall()).strftime("%Y%m%d-%H%M%S")
    archive = ctx.store.directory / "archive" / kata.name / stamp
    if not args.yes:
        answer = ctx.terminal.ask(
            f"Restore {names} to the committed stub? Your version is kept in {archive}. [y/N] "
        )
        if answer is None:
            raise UserError("asks before restoring; run with --yes to confirm without a terminal")
        if answer.strip().lower() not in ("y", "yes"):
            ctx.out.print("Nothing was changed.")
            return 1
    for path, text, commit in changes:
        if path.exists():
            kept = ctx.store.save_file(
                f"archive/{kata.name}/{stamp}/{path.name}", path.read_text(encoding="utf-8")
            )
            ctx.out.print(f"kept your {path.name} as {kept}", style="dim")
        tmp = path.with_name(f".{path.name}.kata-reset")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
        ctx.out.print(f"restored {display_path(path)} (the stub of commit {commit})")
    _record_reset(ctx, kata, stages)
    return 0


def _record_reset(ctx: Context, kata: Kata, stages: Sequence[Stage]) -> None:
    """Each stage's file is the stub now: ``kata list`` says "reset" (its history stays)."""
    try:
        if all(ctx.state().status(kata.name, s.number) == "not started" for s in stages):
            return  # nothing recorded, so nothing to change (and no state file to make)
        with ctx.store.update() as state:
            for stage in stages:
                state.record_reset(kata.name, stage.number, at=ctx.wall())
    except StateError as exc:
        print(f"kata reset: warning: the progress does not show the reset: {exc}", file=sys.stderr)


def _configure_reset(parser: argparse.ArgumentParser) -> None:
    add_kata_stage(parser, optional=True)
    parser.add_argument("-y", "--yes", action="store_true", help="do not ask first")


# --- kata bench ------------------------------------------------------------------------------


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


# --- kata progress ---------------------------------------------------------------------------


def _duration(seconds: object) -> str:
    if not isinstance(seconds, int | float):
        return "—"
    return clock_text(int(seconds * NS_PER_S))


def _when(attempt: Attempt) -> str:
    started = attempt.get("started")
    if not isinstance(started, int | float):
        return "?"
    return dt.datetime.fromtimestamp(started).strftime("%m-%d %H:%M")


def progress_table(state: State, attempts: Sequence[Attempt]) -> Table:
    table = Table(box=box.SIMPLE_HEAD, title="attempts", pad_edge=False, collapse_padding=True)
    for column in ("when", "kata", "stage", "result", "green", "length", "tests"):
        table.add_column(
            column,
            justify="right" if column in ("stage", "tests") else "left",
            no_wrap=column in ("when", "kata", "result"),
        )
    table.add_column("hints", justify="right")
    for attempt in attempts:
        result = str(attempt.get("result", "?"))
        if attempt.get("mode") == "pair":
            result = f"pair {result}"
        style = "green" if attempt.get("green_seconds") is not None else ""
        passed, total = attempt.get("passed"), attempt.get("total")
        table.add_row(
            _when(attempt),
            str(attempt.get("kata", "?")),
            str(attempt.get("stage", "?")),
            f"[{style}]{result}[/]" if style else result,
            _duration(attempt.get("green_seconds")),
            _duration(attempt.get("seconds")),
            f"{passed}/{total}" if total is not None else "—",
            str(attempt.get("hints_used", 0)),
        )
    return table


def run_progress(args: argparse.Namespace, ctx: Context) -> int:
    state = ctx.state()
    wanted = ctx.catalog.get(args.kata).name if args.kata else None
    attempts = [a for a in state.attempts if wanted is None or a.get("kata") == wanted]
    attempts.sort(key=lambda a: (str(a.get("kata")), str(a.get("stage")), a.get("started", 0)))
    if not attempts and not state.results and not state.hints:
        ctx.out.print("No attempts yet: kata start KATA STAGE begins one.")
        return 0
    if attempts:
        ctx.out.print(progress_table(state, attempts))
    summary = Table(box=box.SIMPLE_HEAD, title="per stage")
    for column in ("kata", "stage", "status", "attempts", "best", "hints shown"):
        summary.add_column(column)
    keys = sorted(
        {(str(a.get("kata")), a["stage"]) for a in attempts if isinstance(a.get("stage"), int)}
        | {
            (k.split("/")[0], int(k.split("/")[1]))
            for k in [*state.results, *state.hints]
            if k.count("/") == 1 and k.split("/")[1].isdigit()
        }
    )
    for kata_name, number in keys:
        if wanted is not None and kata_name != wanted:
            continue
        best = state.best_seconds(kata_name, number)
        summary.add_row(
            kata_name,
            str(number),
            state.status(kata_name, number),
            str(len(state.attempts_of(kata_name, number))),
            _duration(best),
            str(state.hints_revealed(kata_name, number)),
        )
        for unit in state.units_attempted(kata_name, number):  # green alone, not the stage
            summary.add_row(
                "",
                f"{number} unit {unit}",
                state.unit_status(kata_name, number, unit),
                str(len(state.learners_attempts(kata_name, number, unit))),
                _duration(state.best_seconds(kata_name, number, unit)),
                "",
            )
    ctx.out.print(summary)
    return 0


def _configure_progress(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("kata", metavar="KATA", nargs="?", help="only this kata")


COMMANDS: tuple[Command, ...] = (
    Command(
        "hint",
        "show the next hint for a stage",
        "Show the next hint for the stage from the kata's HINTS.md, one at a time; the "
        "hints you have seen are remembered (and counted in `kata progress`). --again "
        "shows them again; --all shows every hint once the stage has passed.",
        _configure_hint,
        run_hint,
    ),
    Command(
        "reveal",
        "compare your stage file with the reference",
        "Show the reference solution of the stage as a diff against your file (reference "
        "lines -, yours +), and the stage's common mistakes: the classic-bug catalogue in "
        "tests/mutants/<kata>/, one line each. Only once the stage has passed, or with "
        "--force.",
        _configure_reveal,
        run_reveal,
    ),
    Command(
        "reset",
        "restore the pristine stub of a stage (or of every stage)",
        "Restore the stage file(s) to the stub as committed in git, after asking (--yes "
        "skips the question). Your version is first kept in the state directory's "
        "archive/, so nothing you wrote is lost. The stage's status in `kata list` becomes "
        "'reset' until its next run; its history (attempts, best time, whether it ever "
        "passed) is kept.",
        _configure_reset,
        run_reset,
    ),
    Command(
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
    ),
    Command(
        "progress",
        "your history: attempts, times to green, hints used",
        "Show every recorded attempt (solo and pairing) with its result, time to green "
        "(green), length, tests passed and hints used, and a summary per kata stage.",
        _configure_progress,
        run_progress,
    ),
)

__all__ = ["COMMANDS", "reveal_next_hint", "stage_hints"]
