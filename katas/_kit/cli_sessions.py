"""``kata start`` (a timed practice attempt) and ``kata pair`` (an interview session).

The loops are :class:`~katas._kit.practice.SoloSession` and
:class:`~katas._kit.practice.PairSession`; this module connects them to a kata's files,
its suite and the recorded progress.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
from typing import Any

from rich.markdown import Markdown
from rich.rule import Rule
from rich.table import Table
from rich.text import Text

from katas._kit.catalog import Kata, Stage, display_path
from katas._kit.cli_study import reveal_next_hint, stage_hints
from katas._kit.cliutil import (
    Command,
    Context,
    UserError,
    add_kata_stage,
    is_learners_code,
    not_implemented_names,
    print_summary,
    read_text,
    stage_prompt,
    suite_or_error,
)
from katas._kit.clock import NS_PER_S
from katas._kit.notes import LADDER, interviewer_notes, rubric_axes
from katas._kit.practice import PairSession, SoloSession, clock_text, tally
from katas._kit.state import Attempt, StateError
from katas._kit.suites import SuiteRun, resolve_impl, run_suite
from katas._kit.watch import Watcher

NS_PER_MIN = 60 * NS_PER_S


def _minutes(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of minutes, got {text!r}") from None
    if not value > 0 or value > 24 * 60:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1440 minutes, got {text!r}")
    return value


def _impl(ctx: Context) -> str:
    """The learner's code (or ``KATA_IMPL``), as :func:`resolve_impl` gives it to pytest."""
    try:
        return resolve_impl(None, ctx.catalog.root)
    except ValueError as exc:  # a KATA_IMPL that is not a directory
        raise UserError(str(exc)) from None


def _poll_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.05 <= value <= 60:
        raise argparse.ArgumentTypeError(f"must be between 0.05 and 60 seconds, got {text!r}")
    return value


def _swap_minutes(text: str) -> float:
    return 0.0 if text.strip() in ("0", "0.0") else _minutes(text)


def _add_session_arguments(parser: argparse.ArgumentParser, length: str) -> None:
    """``KATA STAGE [--minutes N]``, what a timed session takes; ``length`` names the minutes."""
    add_kata_stage(parser)
    parser.add_argument(
        "--minutes",
        type=_minutes,
        metavar="N",
        help=f"{length} (default: the stage's timebox_minutes in kata.toml)",
    )


def _save_attempt(
    ctx: Context, attempt: Attempt, last: SuiteRun | None, kata: Kata, stage: Stage
) -> bool:
    """Record ``attempt`` (and the last run's result); False, with a warning, if impossible."""
    try:
        with ctx.store.update() as state:
            attempt["hints_used"] = max(
                0, state.hints_revealed(kata.name, stage.number) - attempt.pop("_hints_before", 0)
            )
            state.attempts.append(attempt)
            if last is not None and attempt.get("learners_code"):
                passed, total = tally(last)
                state.record_result(
                    kata.name, stage.number, ok=last.ok, passed=passed, total=total, at=ctx.wall()
                )
        return True
    except StateError as exc:
        print(f"kata: error: this attempt was not recorded: {exc}", file=sys.stderr)
        return False


def _failing_lines(ctx: Context, result: SuiteRun, limit: int = 3) -> None:
    """The first few real failures, then the not-implemented ones on one line."""
    real = result.failures("assertion") + result.failures("error")
    for failure in real[:limit]:
        line = Text("  ✗ ", style="red")
        line.append(failure.test_id, style="bold")
        line.append(f" — {failure.message}")
        ctx.out.print(line, overflow="ellipsis", no_wrap=True)
    if len(real) > limit:
        ctx.out.print(f"  … and {len(real) - limit} more failing", style="dim")
    missing = result.failures("not_implemented")
    if missing:
        names = not_implemented_names(missing)
        shown = ", ".join(names[:6]) + ("…" if len(names) > 6 else "")
        ctx.out.print(
            Text(f"  … {len(missing)} not implemented yet: {shown}", style="yellow"),
            overflow="ellipsis",
            no_wrap=True,
        )


# --- kata start ------------------------------------------------------------------------------


def run_start(args: argparse.Namespace, ctx: Context) -> int:
    kata = ctx.catalog.get(args.kata)
    stage = kata.stage(args.stage)
    suite = suite_or_error(kata, stage)
    if not kata.stub_path(stage).is_file():
        raise UserError(f"{display_path(kata.stub_path(stage))} does not exist (your stage file)")
    impl = _impl(ctx)
    state = ctx.state()  # an unusable state file stops us before the clock starts
    number = len(state.attempts_of(kata.name, stage.number)) + 1
    minutes = args.minutes if args.minutes is not None else stage.timebox_minutes
    timebox_ns = int(minutes * NS_PER_MIN)
    if not args.no_prompt:
        text = read_text(kata.prompt, f"the prompt of {kata.name}")
        ctx.out.print(Markdown(stage_prompt(text, kata, stage, kata.prompt)))
    core_only = not args.full
    part = "the core tests" if core_only else "the whole suite"
    ctx.out.print(
        Rule(f"{kata.name} stage {stage.number} · attempt {number} · {clock_text(timebox_ns)}"),
    )
    ctx.out.print(
        f"Edit {display_path(kata.stub_path(stage))}; every save re-runs {part} of "
        f"{display_path(suite)}. Keys: r run now, h next hint, q stop.",
        highlight=False,
    )
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")  # a save within a second never runs stale
    selection = {"core": core_only}

    def run_tests() -> SuiteRun:
        result = run_suite(
            suite, impl=impl, base=args.base, core_only=selection["core"], env=env, timeout_s=None
        )
        if selection["core"] and result.returncode == 5 and not result.results:
            selection["core"] = False  # no test is marked core: the whole suite it is
            result = run_suite(suite, impl=impl, base=args.base, env=env, timeout_s=None)
        return result

    def on_result(result: SuiteRun, elapsed_ns: int) -> None:
        passed, ran = tally(result)
        line = Text(f"[{clock_text(elapsed_ns)}] ", style="dim")
        line.append(f"{passed}/{ran} passed", style="bold " + ("green" if result.ok else "red"))
        line.append(f" in {result.seconds:.1f}s")
        ctx.out.print(line)
        if not result.results and result.output:
            ctx.out.print(Text(result.output.rstrip()[-2000:]))
        elif not result.ok:
            _failing_lines(ctx, result)

    def on_hint() -> None:
        try:
            if not reveal_next_hint(ctx, kata, stage):
                ctx.out.print("No more hints for this stage.", style="dim")
        except (UserError, StateError) as exc:
            ctx.out.print(f"no hint: {exc}", style="yellow")

    session = SoloSession(
        clock=ctx.clock,
        terminal=ctx.terminal,
        console=ctx.out,
        timebox_ns=timebox_ns,
        watcher=Watcher([kata.path]),
        run_tests=run_tests,
        on_result=on_result,
        on_hint=on_hint,
        title=f"{kata.name} stage {stage.number}",
        poll_ns=int(args.poll * NS_PER_S),
    )
    started_wall = ctx.wall()
    outcome = session.run()
    last = outcome.last
    passed, ran = tally(last) if last is not None else (0, 0)
    attempt: Attempt = {
        "kata": kata.name,
        "stage": stage.number,
        "mode": "solo",
        "started": started_wall,
        "seconds": outcome.elapsed_ns / NS_PER_S,
        "timebox_minutes": minutes,
        "green_seconds": None if outcome.green_ns is None else outcome.green_ns / NS_PER_S,
        "result": outcome.result,
        "passed": passed,
        "total": ran,
        "runs": outcome.runs,
        "core_only": selection["core"],
        "base": args.base or "own",
        "learners_code": is_learners_code(None),
        "_hints_before": state.hints_revealed(kata.name, stage.number),
    }
    if outcome.result == "green" and outcome.green_ns is not None:
        best = state.best_seconds(kata.name, stage.number)
        note = ""
        if best is not None:
            note = (
                " — a new best!"
                if outcome.green_ns / NS_PER_S < best
                else f" (best {clock_text(int(best * NS_PER_S))})"
            )
        ctx.out.print(Text(f"✓ green in {clock_text(outcome.green_ns)}{note}", style="bold green"))
        ctx.out.print(
            f"Next: kata test {kata.name} {stage.number} (the extended part), "
            f"kata reveal {kata.name} {stage.number} (reference and common mistakes).",
            style="dim",
            highlight=False,
        )
    elif outcome.result == "timeout":
        ctx.out.print(Text(f"⏰ time is up ({clock_text(timebox_ns)}).", style="bold red"))
        if last is not None:
            ctx.out.print("Still failing:")
            print_summary(ctx.out, last, kata, stage, notes=["core"] if selection["core"] else [])
        try:
            _offer_hint(ctx, kata, stage)
        except KeyboardInterrupt:  # the attempt is still recorded below
            ctx.out.print()
    else:
        how = "interrupted" if outcome.result == "interrupted" else "stopped"
        ctx.out.print(f"Attempt {how} after {clock_text(outcome.elapsed_ns)}.")
    if _save_attempt(ctx, attempt, last, kata, stage):
        ctx.out.print(f"Recorded: kata progress {kata.name}", style="dim", highlight=False)
    if outcome.result == "green":
        return 0
    return 130 if outcome.result == "interrupted" else 1


def _offer_hint(ctx: Context, kata: Kata, stage: Stage) -> None:
    try:
        total = len(stage_hints(kata, stage))
        shown = ctx.state().hints_revealed(kata.name, stage.number)
    except (UserError, StateError):
        return
    if shown >= total:
        return
    answer = ctx.terminal.ask(f"Show hint {shown + 1} of {total}? [y/N] ")
    if answer is None:
        ctx.out.print(
            f"The next hint: kata hint {kata.name} {stage.number} ({shown + 1} of {total})",
            highlight=False,
        )
    elif answer.strip().lower() in ("y", "yes"):
        reveal_next_hint(ctx, kata, stage)


def _configure_start(parser: argparse.ArgumentParser) -> None:
    _add_session_arguments(parser, "the timebox")
    parser.add_argument(
        "--base",
        choices=["own", "reference"],
        help="earlier stages: your own (default) or the reference solutions'",
    )
    parser.add_argument(
        "--full",
        action="store_true",
        help="re-run the whole stage suite, not only its core tests (time to green is then "
        "measured on the whole suite)",
    )
    parser.add_argument("--no-prompt", action="store_true", help="do not print the prompt first")
    parser.add_argument(
        "--poll",
        type=_poll_seconds,
        default=0.5,
        metavar="SECONDS",
        help="how often to look for saved files (0.5)",
    )


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
    impl = _impl(ctx)
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
    _save_attempt(ctx, attempt, result, kata, stage)
    return 0


def _configure_pair(parser: argparse.ArgumentParser) -> None:
    _add_session_arguments(parser, "the session's length")
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
        "start",
        "a timed practice attempt at a stage",
        "Start a timed attempt: print the stage's prompt, count down its timebox (from "
        "kata.toml, or --minutes), and re-run the stage's core tests every time you save a "
        "file in the kata folder (polling; press r to run now), with passed/total as a "
        "progress bar. When the tests go green the time to green is recorded; at the end "
        "of the timebox you see what still fails and are offered the next hint. q or "
        "Ctrl-C ends the attempt, which is recorded too (kata progress).\n\n"
        "exit code: 0 green, 1 not green (time up or stopped), 2 bad input, 130 Ctrl-C",
        _configure_start,
        run_start,
    ),
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
