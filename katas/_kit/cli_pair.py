"""``kata pair``: an interview session — notes, a timer with swaps, a rubric sheet.

The loop is :class:`~katas._kit.practice.PairSession`; this module connects it to a
kata's interviewer notes, its suite and the recorded progress.
"""

from __future__ import annotations

import argparse
import datetime as dt
from typing import Any

from rich.markdown import Markdown
from rich.rule import Rule
from rich.table import Table
from rich.text import Text

from katas._kit.catalog import Kata, Stage, display_path
from katas._kit.cli_sessions import (
    NS_PER_MIN,
    add_session_arguments,
    learners_impl,
    minutes_arg,
    save_attempt,
)
from katas._kit.cliutil import (
    Command,
    Context,
    UserError,
    check_profile,
    is_learners_code,
    print_summary,
    read_text,
    stage_file_or_error,
    suite_or_error,
)
from katas._kit.clock import NS_PER_S
from katas._kit.notes import LADDER, interviewer_notes, rubric_axes
from katas._kit.practice import PairSession, clock_text, tally
from katas._kit.suites import SuiteRun, run_suite


def _swap_minutes(text: str) -> float:
    return 0.0 if text.strip() in ("0", "0.0") else minutes_arg(text)


# --- kata pair -------------------------------------------------------------------------------


def _print_notes(ctx: Context, kata: Kata, stage: Stage, text: str) -> None:
    notes = interviewer_notes(text, stage.section)
    if notes is None:
        raise UserError(f"{display_path(kata.interviewer)} has no '## {stage.section}' section")
    ctx.out.print(Rule(f"interviewer notes · {kata.name} stage {stage.number}: {stage.title}"))
    ladder_shown = False
    for part in notes.stage_parts:
        ctx.out.print(Markdown(f"### {part.title}\n\n{part.body}" if part.title else part.body))
        if part.title.lower().startswith("follow-up") and notes.ladder and not ladder_shown:
            ctx.out.print(Markdown(f"### {LADDER}\n\n{notes.ladder}"))
            ladder_shown = True
    if notes.ladder and not ladder_shown:
        ctx.out.print(Markdown(f"### {LADDER}\n\n{notes.ladder}"))


_SCORES = {"s": "strong", "a": "acceptable", "w": "weak"}


def _rubric(ctx: Context, axes: list[tuple[str, list[str]]], sheet: list[dict[str, str]]) -> None:
    """Ask for a score and evidence per axis into ``sheet`` (blanks if nobody can answer)."""
    for axis, _levels in axes:
        score = evidence = ""
        answer = ctx.terminal.ask(f"{axis}: strong/acceptable/weak? [s/a/w, Enter skips] ")
        if answer is not None:
            score = _SCORES.get(answer.strip().lower()[:1], "")
            evidence = (
                ctx.terminal.ask(f"{axis}: evidence (a line they wrote or said): ") or ""
            ).strip()
        sheet.append({"axis": axis, "score": score, "evidence": evidence})


def _sheet_markdown(
    kata: Kata,
    stage: Stage,
    when: str,
    length: str,
    swaps: int,
    result: SuiteRun | None,
    axes: list[tuple[str, list[str]]],
    sheet: list[dict[str, str]],
) -> str:
    passed, ran = tally(result) if result is not None else (0, 0)
    lines = [
        f"# Rubric sheet — {kata.name} stage {stage.number}: {stage.title}",
        "",
        f"- date: {when}",
        f"- length: {length} (swaps: {swaps})",
        f"- suite: {passed}/{ran} passed" if result is not None else "- suite: not run",
        "",
        "| axis | score (strong / acceptable / weak) | evidence |",
        "|---|---|---|",
    ]
    lines += [f"| {row['axis']} | {row['score']} | {row['evidence']} |" for row in sheet]
    if result is not None and result.failures():
        lines += ["", "## Failing tests", ""]
        lines += [f"- {f.test_id}: {f.message}" for f in result.failures()]
    if any(levels for _, levels in axes):
        lines += ["", "## The rubric", ""]
        lines += ["| axis | strong | acceptable | weak |", "|---|---|---|---|"]
        lines += [f"| {axis} | {' | '.join(levels)} |" for axis, levels in axes]
    return "\n".join(lines) + "\n"


def run_pair(args: argparse.Namespace, ctx: Context) -> int:
    kata = ctx.catalog.get(args.kata)
    stage = kata.stage(args.stage)
    suite = suite_or_error(kata, stage)
    text = read_text(kata.interviewer, f"the interviewer notes of {kata.name}")
    impl = learners_impl(ctx)
    check_profile()
    if is_learners_code(None):
        stage_file_or_error(kata, stage)
    state = ctx.state()  # an unusable state file stops us before the session starts
    minutes = args.minutes if args.minutes is not None else stage.timebox_minutes
    timebox_ns = int(minutes * NS_PER_MIN)
    swap_ns = int(args.swap * NS_PER_MIN)
    if not args.no_notes:
        _print_notes(ctx, kata, stage, text)
    ctx.out.print(Rule(f"pairing · {kata.name} stage {stage.number} · {clock_text(timebox_ns)}"))
    ctx.out.print(
        f"The candidate reads: kata show {kata.name} {stage.number}, and edits "
        f"{display_path(kata.stub_path(stage))}."
        + (f" Driver and navigator swap every {clock_text(swap_ns)}." if swap_ns else ""),
        highlight=False,
    )

    def on_swap(number: int, at_ns: int) -> None:
        ctx.out.print(
            Text(
                f"⇄ [{clock_text(at_ns)}] swap {number}: driver and navigator change places",
                style="bold magenta",
            )
        )

    started_wall = ctx.wall()
    outcome = PairSession(
        clock=ctx.clock,
        terminal=ctx.terminal,
        console=ctx.out,
        timebox_ns=timebox_ns,
        swap_ns=swap_ns,
        on_swap=on_swap,
        title=f"{kata.name} stage {stage.number}",
    ).run()
    ended = {
        "timeout": "Time is up.",
        "stopped": "Session ended.",
        "interrupted": "Session ended (Ctrl-C).",
    }
    ctx.out.print(Text(f"{ended[outcome.result]} Running the suite…", style="bold"))
    result: SuiteRun | None = None
    try:
        result = run_suite(suite, impl=impl, timeout_s=None)
        print_summary(ctx.out, result, kata, stage)
    except KeyboardInterrupt:
        ctx.out.print("The suite run was interrupted.", style="yellow")
    axes = rubric_axes(text, stage.section)
    sheet: list[dict[str, str]] = []
    try:
        _rubric(ctx, axes, sheet)
    except KeyboardInterrupt:  # keep what was scored; the rest stays blank
        ctx.out.print()
    scored = {row["axis"] for row in sheet}
    sheet += [{"axis": a, "score": "", "evidence": ""} for a, _ in axes if a not in scored]
    when = dt.datetime.fromtimestamp(started_wall).strftime("%Y-%m-%d %H:%M")
    table = Table(title=f"rubric sheet · {kata.name} stage {stage.number}", show_lines=True)
    for column in ("axis", "score (strong / acceptable / weak)", "evidence"):
        table.add_column(column)
    for row in sheet:
        table.add_row(row["axis"], row["score"], row["evidence"])
    ctx.out.print(table)
    markdown = _sheet_markdown(
        kata, stage, when, clock_text(outcome.elapsed_ns), outcome.swaps, result, axes, sheet
    )
    stamp = dt.datetime.fromtimestamp(started_wall).strftime("%Y%m%d-%H%M%S")
    passed, ran = tally(result) if result is not None else (0, 0)
    attempt: dict[str, Any] = {
        "kata": kata.name,
        "stage": stage.number,
        "mode": "pair",
        "started": started_wall,
        "seconds": outcome.elapsed_ns / NS_PER_S,
        "timebox_minutes": minutes,
        "green_seconds": None,
        "result": outcome.result,
        "passed": passed,
        "total": ran,
        "swaps": outcome.swaps,
        "rubric": sheet,
        "learners_code": is_learners_code(None),
        "_hints_before": state.hints_revealed(kata.name, stage.number),
    }
    try:
        path = ctx.store.save_file(f"sheets/{kata.name}-stage{stage.number}-{stamp}.md", markdown)
        attempt["sheet"] = str(path)
        ctx.out.print(f"Rubric sheet saved to {path} — fill it in there.", highlight=False)
    except OSError as exc:
        ctx.out.print(f"could not save the rubric sheet: {exc}", style="yellow")
    save_attempt(ctx, attempt, result, kata, stage)
    return 0


def _configure_pair(parser: argparse.ArgumentParser) -> None:
    add_session_arguments(parser, "the session's length")
    parser.add_argument(
        "--swap",
        type=_swap_minutes,
        default=15.0,
        metavar="M",
        help="announce a driver/navigator swap every M minutes (default 15; 0: never)",
    )
    parser.add_argument(
        "--no-notes", action="store_true", help="do not print the interviewer notes first"
    )


COMMANDS: tuple[Command, ...] = (
    Command(
        "pair",
        "interviewer mode: notes, timer with swaps, rubric sheet",
        "Run a pairing session: print the interviewer notes of the stage from the kata's "
        "INTERVIEWER.md (what to read aloud, the clarifying questions a strong candidate "
        "asks and the answers, the follow-up ladder, the rubric), then a timer announcing "
        "a driver/navigator swap every --swap minutes. At the end (time up, q or Ctrl-C) "
        "the stage's suite runs on the candidate's code and a rubric sheet is printed, "
        "filled in at the prompt if there is a terminal, and saved with the attempt in "
        "the state directory.",
        _configure_pair,
        run_pair,
    ),
)

__all__ = ["COMMANDS"]
