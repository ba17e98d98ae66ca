"""``kata progress``: every recorded attempt, and a summary per kata stage."""

from __future__ import annotations

import argparse
import datetime as dt
from collections.abc import Sequence

from rich import box
from rich.table import Table

from katas._cli.cliutil import Command, Context
from katas._cli.state import Attempt, Round, clock_text
from katas._runtime.clock import NS_PER_S


def _duration(seconds: float | None) -> str:
    return "—" if seconds is None else clock_text(int(seconds * NS_PER_S))


def _when(started: float | None) -> str:
    """When an attempt or a round began (epoch s), as ``12-05 14:30``."""
    if started is None:
        return "?"
    return dt.datetime.fromtimestamp(started).strftime("%m-%d %H:%M")


def progress_table(attempts: Sequence[Attempt]) -> Table:
    table = Table(box=box.SIMPLE_HEAD, title="attempts", pad_edge=False, collapse_padding=True)
    for column in ("when", "kata", "stage", "result", "green", "length", "tests"):
        table.add_column(
            column,
            justify="right" if column in ("stage", "tests") else "left",
            no_wrap=column in ("when", "kata", "result"),
        )
    table.add_column("hints", justify="right")
    for attempt in attempts:
        result = attempt.result if attempt.mode == "solo" else f"{attempt.mode} {attempt.result}"
        said = attempt.to_json()  # as the file says it, even where a hand edit left it odd
        passed, total = said.get("passed"), said.get("total")
        table.add_row(
            _when(attempt.started),
            attempt.kata,
            str(said.get("stage", "?")),
            f"[green]{result}[/]" if said.get("green_seconds") is not None else result,
            _duration(attempt.green_seconds),
            _duration(attempt.seconds),
            f"{passed}/{total}" if total is not None else "—",
            str(said.get("hints_used", 0)),
        )
    return table


def interviews_table(attempts: Sequence[Attempt]) -> Table:
    """Interview-mode attempts: the key questions asked before the first run and missed,
    when the whole prompt was opened, and the self-assessment (s/a/w per rubric axis)."""
    table = Table(box=box.SIMPLE_HEAD, title="interviews", pad_edge=False)
    for column in ("when", "kata", "stage", "asked first", "missed", "prompt", "self"):
        table.add_column(column, justify="right" if column == "stage" else "left")
    for attempt in attempts:
        record = attempt.interview
        if record is None:
            continue
        early = len(record.key_asked(before_first_run=True))
        opened = record.prompt_opened_seconds
        scores = " ".join((row.get("score") or "-")[:1] for row in attempt.rubric or [])
        table.add_row(
            _when(attempt.started),
            attempt.kata,
            str(attempt.stage),
            f"{early}/{len(record.key)} key",
            "; ".join(record.key_missed()) or "—",
            "never" if opened is None else f"at {_duration(opened)}",
            scores or "—",
        )
    return table


def rounds_table(rounds: Sequence[Round]) -> Table:
    """The debugging and review rounds: what was solved or judged right, how fast."""
    table = Table(box=box.SIMPLE_HEAD, title="interview rounds", pad_edge=False)
    for column in ("when", "round", "kata", "stage", "result", "time", "detail"):
        table.add_column(column, justify="right" if column == "stage" else "left")
    for round_ in rounds:
        if round_.mode == "review":
            result = f"{round_.verdicts_right}/{len(round_.entries)} right"
            detail = f"rules {round_.rules_right}/{round_.rules_asked}"
        else:
            result = f"[green]{round_.result}[/]" if round_.solved else round_.result
            detail = (
                f"{len(round_.entries)} bug(s), {round_.runs} run(s), "
                f"{round_.lines_changed} line(s), {round_.hints_used} hint(s)"
            )
        table.add_row(
            _when(round_.started),
            f"{round_.mode} (paired)" if round_.paired else round_.mode,
            round_.kata,
            str(round_.stage),
            result,
            _duration(round_.seconds),
            detail,
        )
    return table


def run_progress(args: argparse.Namespace, ctx: Context) -> int:
    state = ctx.state()
    wanted = ctx.catalog.get(args.kata).name if args.kata else None
    attempts = [a for a in state.attempts if wanted is None or a.kata == wanted]
    attempts.sort(key=lambda a: (a.kata, str(a.stage), a.started or 0))
    rounds = [r for r in state.rounds if wanted is None or r.kata == wanted]
    if rounds:
        ctx.out.print(rounds_table(rounds))
    if not attempts and not state.results and not state.hints:
        if not rounds:
            ctx.out.print("No attempts yet: kata start KATA STAGE begins one.")
        return 0
    if attempts:
        ctx.out.print(progress_table(attempts))
    if any(a.interview is not None for a in attempts):
        ctx.out.print(interviews_table(attempts))
    summary = Table(box=box.SIMPLE_HEAD, title="per stage")
    for column in ("kata", "stage", "status", "attempts", "best", "hints shown"):
        summary.add_column(column)
    keys = sorted(
        {(a.kata, a.stage) for a in attempts if a.stage is not None}
        | {
            (k.split("/")[0], int(k.split("/")[1]))
            for k in [*state.results, *state.hints]
            if k.count("/") == 1 and k.split("/")[1].isdigit()
        }
    )
    for kata_name, number in keys:
        if wanted is not None and kata_name != wanted:
            continue
        summary.add_row(
            kata_name,
            str(number),
            state.status(kata_name, number),
            str(len(state.attempts_of(kata_name, number))),
            _duration(state.best_seconds(kata_name, number)),
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


COMMAND = Command(
    "progress",
    "your history: attempts, times to green, hints used",
    "Show every recorded attempt (solo, interview and pairing) with its result, time to "
    "green (green), length, tests passed and hints used; for interviews the key questions "
    "asked before the first run and missed, when the whole prompt was opened and the "
    "self-assessment (s/a/w per rubric axis); a summary per kata stage, and the "
    "interview rounds (kata debug: result, time, runs, lines changed; kata review: "
    "verdicts and rules right).",
    _configure_progress,
    run_progress,
)

__all__ = ["COMMAND", "interviews_table", "progress_table", "rounds_table"]
