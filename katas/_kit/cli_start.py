"""``kata start``: a timed practice attempt at a stage.

The loop is :class:`~katas._kit.practice.SoloSession`; this module connects it to a
kata's files, its suite and the recorded progress.
"""

from __future__ import annotations

import argparse
import os

from rich.markdown import Markdown
from rich.rule import Rule
from rich.text import Text

from katas._kit.catalog import Kata, Stage, display_path
from katas._kit.cli_sessions import (
    NS_PER_MIN,
    add_session_arguments,
    learners_impl,
    save_attempt,
)
from katas._kit.cli_study import reveal_next_hint, stage_hints
from katas._kit.cliutil import (
    Command,
    Context,
    UserError,
    is_learners_code,
    not_implemented_names,
    print_summary,
    read_text,
    stage_prompt,
    suite_or_error,
)
from katas._kit.clock import NS_PER_S
from katas._kit.practice import SoloSession, clock_text, tally
from katas._kit.state import Attempt, StateError
from katas._kit.suites import SuiteRun, run_suite
from katas._kit.watch import Watcher


def _poll_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.05 <= value <= 60:
        raise argparse.ArgumentTypeError(f"must be between 0.05 and 60 seconds, got {text!r}")
    return value


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
    impl = learners_impl(ctx)
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
    if save_attempt(ctx, attempt, last, kata, stage):
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
    add_session_arguments(parser, "the timebox")
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
)

__all__ = ["COMMANDS"]
