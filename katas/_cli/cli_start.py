"""``kata start``: a timed practice attempt at a stage.

The loop is :class:`~katas._cli.practice.SoloSession`; this module connects it to a
kata's files, its suite and the recorded progress.
"""

from __future__ import annotations

import argparse
import os
import re
import tempfile
from collections.abc import Callable

from rich.markdown import Markdown
from rich.rule import Rule
from rich.text import Text

from katas._cli.cli_sessions import (
    NS_PER_MIN,
    add_session_arguments,
    learners_impl,
    save_attempt,
)
from katas._cli.cli_study import reveal_next_hint, stage_hints
from katas._cli.cliutil import (
    Command,
    Context,
    UserError,
    check_profile,
    crash_line,
    display_paths,
    failure_lines,
    is_learners_code,
    markdown_sections,
    not_implemented_names,
    print_summary,
    stage_file_or_error,
    suites_or_error,
)
from katas._cli.practice import SoloSession, clock_text, tally, verdict
from katas._cli.state import Attempt, StateError
from katas._cli.watch import Watcher
from katas._registry.catalog import CatalogError, Kata, Stage, Unit, display_path
from katas._registry.notes import is_section
from katas._registry.suites import SuiteProcess, SuiteRun, start_suite
from katas._registry.warm import WarmStart
from katas._runtime.clock import NS_PER_S

YES = ("y", "yes")


def _poll_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.05 <= value <= 60:
        raise argparse.ArgumentTypeError(f"must be between 0.05 and 60 seconds, got {text!r}")
    return value


# --- a line cut where it differs ---------------------------------------------------------------

#: One compared pair of a failure's detail: ``expected X, got Y`` (several, as ``field:
#: expected X, got Y`` apart by "; "), pytest's ``X != Y`` and ``assert X == Y``.
_COMPARED = (
    re.compile(r"expected (?P<expected>.+?), got (?P<got>.+?)(?=; [\w.\[\]]+: expected |$)"),
    re.compile(r"(?P<got>[^\s:][^:]*?) != (?P<expected>.+)$"),
    re.compile(r"^\s*assert (?P<got>.+?) == (?P<expected>.+)$"),
)
#: Characters kept before the first difference of a pair, so it reads in context.
CONTEXT_CHARS = 12


def _common_length(one: str, other: str) -> int:
    """How many characters ``one`` and ``other`` have alike from the start."""
    pairs = zip(one, other, strict=False)
    return next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(one), len(other)))


def show_difference(line: str, width: int) -> str:
    """``line`` fitted into ``width`` so that each compared pair shows where it differs.

    A line that fits stays as it is. Otherwise each expected and got value starts a few
    characters before their first difference ("…" for the common part left out) and is
    cut, with "…", to its share of the room: the differing characters stay in sight, not
    behind the end of the screen.
    """
    if len(line) <= width:
        return line
    pairs: list[re.Match[str]] = []
    for pattern in _COMPARED:
        pairs = list(pattern.finditer(line))
        if pairs:
            break
    if not pairs:
        return line
    values = sum(len(pair["expected"]) + len(pair["got"]) for pair in pairs)
    room = max(2 * CONTEXT_CHARS, (width - (len(line) - values)) // (2 * len(pairs)))
    pieces: list[str] = []
    done = 0
    for pair in pairs:
        same = _common_length(pair["expected"], pair["got"])
        start = same - CONTEXT_CHARS if same > CONTEXT_CHARS + 1 else 0
        for name in sorted(("expected", "got"), key=pair.start):
            value = pair[name]
            shown = "…" + value[start:] if start else value
            pieces += [
                line[done : pair.start(name)],
                shown[: room - 1] + "…" if len(shown) > room else shown,
            ]
            done = pair.end(name)
    return "".join(pieces) + line[done:]


def _showing_difference(line: Text, width: int) -> Text:
    """A plain line (a failure's detail) through :func:`show_difference`; a styled one
    (a failure's first line, its detail repeated below it when cut) as it is."""
    return line if line.spans else Text(show_difference(line.plain, width), style=line.style)


def _failing_lines(ctx: Context, result: SuiteRun, limit: int = 3) -> None:
    """The first few real failures (alike ones once), then the not-implemented ones."""
    width = max(20, ctx.out.width - 2)
    for line in failure_lines(result, limit=limit, width=width):
        # A detail (indented) wraps: an expected/got pair is already cut around where it
        # differs, and a compiler's error line must show whole.
        detail = line.plain.startswith("    ")
        ctx.out.print(
            Text("  ") + _showing_difference(line, width),
            overflow="fold" if detail else "ellipsis",
            no_wrap=not detail,
        )
    missing = result.failures("not_implemented")
    if missing:
        names = not_implemented_names(missing)
        shown = ", ".join(names[:6]) + ("…" if len(names) > 6 else "")
        ctx.out.print(
            Text(f"  … {len(missing)} not implemented yet: {shown}", style="yellow"),
            overflow="ellipsis",
            no_wrap=True,
        )


# --- before the clock starts -----------------------------------------------------------------


def _first_paragraph(text: str, stage: Stage) -> str:
    """The first paragraph of the stage's section of the prompt (under its sub-headings)."""
    for heading, chunk in markdown_sections(text):
        if not is_section(heading, stage.section):
            continue
        body = chunk.split("\n", 1)[1] if "\n" in chunk else ""
        for paragraph in re.split(r"\n[ \t]*>?[ \t]*\n", body):
            paragraph = paragraph.strip()
            if paragraph and not paragraph.startswith(("#", "```", "|", "<!--")):
                return paragraph
    return ""


def _print_prompt_summary(
    ctx: Context, kata: Kata, stage: Stage, minutes: float, unit: Unit | None
) -> None:
    """What the stage (or its ``unit`` practised alone) asks, in a few lines, and where to
    read all of it; ``minutes`` is the timebox in force (``--minutes``, else the stage's)."""
    head = Text(f"{kata.title} — stage {stage.number}: {stage.title}", style="bold")
    head.append(f" · timebox {minutes:g} min", style="dim")
    ctx.out.print(head)
    part = Text(f"unit {unit.name}, alone: " if unit else "core: ", style="dim")
    part.append(unit.core if unit else stage.core)
    if stage.extended and not unit:
        part.append(" · extended: ", style="dim")
        part.append(stage.extended)
    ctx.out.print(part)
    try:
        paragraph = _first_paragraph(kata.prompt.read_text(encoding="utf-8"), stage)
    except (OSError, UnicodeDecodeError):
        paragraph = ""
    if paragraph:
        ctx.out.print(Markdown(paragraph))
    ctx.out.print(
        f"The whole prompt: kata show {kata.name} {stage.number} "
        f'(or {display_path(kata.prompt)}, "## {stage.section}")',
        style="dim",
        highlight=False,
    )


def _check_configuration(ctx: Context, kata: Kata, stage: Stage) -> str:
    """What stops an attempt before its clock starts, each as one line: a missing suite or
    stage file, a bad ``KATA_IMPL`` or ``KATA_PROFILE``. Returns the impl to test."""
    suites_or_error(kata, stage)
    stage_file_or_error(kata, stage)
    impl = learners_impl(ctx)
    check_profile()
    return impl


# --- after green -----------------------------------------------------------------------------


def _after_stage(ctx: Context, kata: Kata, stage: Stage) -> str:
    """The command for what comes after a green stage: the next stage, else the next kata
    ("" after the last stage of the last kata)."""
    later = [s for s in kata.stages if s.number == stage.number + 1]
    if later:
        return (
            f"kata start {kata.name} {later[0].number} (stage {later[0].number}: {later[0].title})"
        )
    try:
        names = [k.name for k in ctx.catalog.katas()]
    except CatalogError:
        names = []
    after = names[names.index(kata.name) + 1 :] if kata.name in names else []
    if after:
        return f"kata start {after[0]} 1 (the next kata: that was the last stage of {kata.name})"
    return ""


class _CoreElseWhole:
    """A run of the selected part; if no test is marked core, the whole suite's instead.
    ``start(core, whole)`` starts one (``whole``: every test, no stop at a failure)."""

    def __init__(
        self,
        start: Callable[[bool, bool], SuiteProcess],
        selection: dict[str, bool],
        whole: bool,
    ) -> None:
        self._start = start
        self._selection = selection
        self._whole = whole
        self._run = start(selection["core"], whole)

    def wait(self, timeout_s: float | None = None) -> SuiteRun | None:
        result = self._run.wait(timeout_s)
        if result is None:
            return None
        if self._selection["core"] and result.returncode == 5 and not result.results:
            self._selection["core"] = False  # no test is marked core: the whole suite it is
            self._run = self._start(False, self._whole)
            return None
        return result

    def kill(self) -> None:
        self._run.kill()


# --- kata start ------------------------------------------------------------------------------


def run_start(args: argparse.Namespace, ctx: Context) -> int:
    kata = ctx.catalog.get(args.kata)
    stage = kata.stage(args.stage)
    unit = stage.unit(args.unit) if args.unit else None
    suites = suites_or_error(kata, stage)
    impl = _check_configuration(ctx, kata, stage)
    state = ctx.state()  # an unusable state file stops us before the clock starts
    number = len(state.attempts_of(kata.name, stage.number)) + 1
    minutes = args.minutes if args.minutes is not None else stage.timebox_minutes
    timebox_ns = int(minutes * NS_PER_MIN)
    if not args.no_prompt:
        _print_prompt_summary(ctx, kata, stage, minutes, unit)
    core_only = not args.full
    part = "the core tests" if core_only else "the whole suite"
    part += f" of the {unit.name} unit" if unit else ""
    ctx.out.print(
        Rule(f"{kata.name} stage {stage.number} · attempt {number} · {clock_text(timebox_ns)}"),
    )
    ctx.out.print(
        f"Edit {display_path(kata.path / unit.file if unit else kata.stub_path(stage))}; "
        f"every save re-runs {part} of "
        f"{display_paths(suites)}, what failed last first, up to the first failure. "
        "Keys: r run now, a run all (no stop), h next hint, q stop.",
        highlight=False,
    )
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")  # a save within a second never runs stale
    selection = {"core": core_only}
    greens: list[tuple[int, bool]] = []  # (time to green, whether of the core only)
    finished = [0]

    # pytest's cache of what failed last, the session's own (the project's stays as it is)
    cache = tempfile.TemporaryDirectory(prefix="kata-start-")
    warm = WarmStart()  # pytest and the libraries every run imports, imported once

    def start_part(core: bool, whole: bool) -> SuiteProcess:
        order = ["-o", f"cache_dir={cache.name}", "--failed-first"] + ([] if whole else ["-x"])
        return start_suite(
            suites,
            impl=impl,
            base=args.base,
            keyword=unit.keyword if unit else None,
            core_only=core,
            env=env,
            pytest_args=order,
            cache=True,
            warm=warm,
        )

    def start_run(whole: bool) -> _CoreElseWhole:
        return _CoreElseWhole(start_part, selection, whole)

    def on_result(result: SuiteRun, elapsed_ns: int) -> None:
        finished[0] += 1
        if finished[0] == 1 and result.config_error:  # nothing the learner's code can fix
            raise UserError(result.config_error)
        if finished[0] == 1 and result.run_error:
            raise UserError(result.run_error)
        line = Text(f"[{clock_text(elapsed_ns)}] ", style="dim")
        crashed = None if result.results else crash_line(result.returncode, result.output)
        if crashed:  # the process died: no test reported, so no tally either
            line.append(crashed, style="bold red")
        else:
            line.append(verdict(result), style="bold " + ("green" if result.ok else "red"))
        line.append(f"{', after' if crashed else ' in'} {result.seconds:.1f}s")
        if result.not_run and not crashed:
            line.append(" (a runs them all)", style="dim")
        ctx.out.print(line, overflow="ellipsis", no_wrap=True)
        if crashed:
            return  # its one line says all there is
        if result.results:
            if not result.ok:
                _failing_lines(ctx, result)
        elif result.collection_error:
            error = Text("  ! ", style="red bold")
            error.append(result.collection_error)
            error.append(" — pytest could not collect the suite", style="dim")
            ctx.out.print(error, overflow="ellipsis", no_wrap=True)
        elif result.returncode == 5:
            ctx.out.print("  No tests were selected.", style="yellow", highlight=False)
        elif result.run_error:
            ctx.out.print(Text(f"  ! {result.run_error}", style="red"))

    def on_hint() -> None:
        try:
            if not reveal_next_hint(ctx, kata, stage):
                ctx.out.print("No more hints for this stage.", style="dim")
        except (UserError, StateError) as exc:
            ctx.out.print(f"no hint: {exc}", style="yellow")

    def on_green(result: SuiteRun, green_ns: int) -> str | None:
        greens.append((green_ns, selection["core"]))
        if len(greens) > 1:
            ctx.out.print(
                Text(
                    f"✓ the whole suite is green too, at {clock_text(green_ns)}", style="bold green"
                )
            )
            return None
        best = None if unit else state.best_seconds(kata.name, stage.number)  # the stage's
        note = ""
        if best is not None:
            note = (
                " — a new best!"
                if green_ns / NS_PER_S < best
                else f" (best {clock_text(int(best * NS_PER_S))})"
            )
        what = " (the core)" if selection["core"] and stage.extended else ""
        ctx.out.print(Text(f"✓ green in {clock_text(green_ns)}{what}{note}", style="bold green"))
        if not (selection["core"] and stage.extended):
            return None
        answer = ctx.terminal.ask(
            f"Keep going on the extended part ({stage.extended}) with the whole suite? [y/N] "
        )
        if answer is None or answer.strip().lower() not in YES:
            return None
        selection["core"] = False
        ctx.out.print(
            "Watching the whole suite now; the time to green of the core is kept.",
            style="dim",
            highlight=False,
        )
        return "the whole suite"

    session = SoloSession(
        clock=ctx.clock,
        terminal=ctx.terminal,
        console=ctx.out,
        timebox_ns=timebox_ns,
        watcher=Watcher([kata.path]),
        start_run=start_run,
        on_result=on_result,
        on_hint=on_hint,
        on_green=on_green,
        title=f"{kata.name} stage {stage.number}",
        poll_ns=int(args.poll * NS_PER_S),
    )
    started_wall = ctx.wall()
    try:
        outcome = session.run()
    finally:
        warm.close()
        cache.cleanup()
    last = outcome.last
    # What the attempt is measured on: the run that first went green (the core's, when the
    # learner went on to the whole suite), unless the whole suite went green too.
    recorded = last if outcome.result == "green" or outcome.green is None else outcome.green
    passed, ran = tally(recorded) if recorded is not None else (0, 0)
    attempt: Attempt = {
        "kata": kata.name,
        "stage": stage.number,
        "mode": "solo",
        "started": started_wall,
        "seconds": outcome.elapsed_ns / NS_PER_S,
        "timebox_minutes": minutes,
        "green_seconds": None if outcome.green_ns is None else outcome.green_ns / NS_PER_S,
        "result": "green" if outcome.green_ns is not None else outcome.result,
        "passed": passed,
        "total": ran,
        "runs": outcome.runs,
        "core_only": greens[0][1] if greens else selection["core"],
        "base": args.base or "own",
        "learners_code": is_learners_code(None),
        **({"unit": unit.name} if unit else {}),
        "_hints_before": state.hints_revealed(kata.name, stage.number),
    }
    continued = bool(greens) and not selection["core"] and greens[0][1]
    if continued:
        attempt["whole_green_seconds"] = greens[1][0] / NS_PER_S if len(greens) > 1 else None
    if outcome.result == "green":
        after = _after_stage(ctx, kata, stage)
        if selection["core"] and stage.extended:  # the extended part is still to do
            again = f" --unit {unit.name}" if unit else ""
            extended = f"kata start {kata.name} {stage.number}{again} --full (the extended part)"
            ctx.out.print(f"Next: {extended}" + (f", or {after}" if after else ""), highlight=False)
        elif after:
            ctx.out.print(f"Next: {after}", highlight=False)
        else:
            ctx.out.print("That was the last stage of the last kata: kata progress shows them all.")
        ctx.out.print(
            f"Reference and common mistakes: kata reveal {kata.name} {stage.number}",
            style="dim",
            highlight=False,
        )
    elif outcome.result == "timeout":
        ctx.out.print(Text(f"⏰ time is up ({clock_text(timebox_ns)}).", style="bold red"))
        if last is not None:
            ctx.out.print("Still failing:")
            print_summary(ctx.out, last, kata, stage, notes=["core"] if selection["core"] else [])
        else:
            ctx.out.print("No run finished in the timebox.")
        try:
            _offer_hint(ctx, kata, stage)
        except KeyboardInterrupt:  # the attempt is still recorded below
            ctx.out.print()
    else:
        how = "interrupted" if outcome.result == "interrupted" else "stopped"
        ctx.out.print(f"Attempt {how} after {clock_text(outcome.elapsed_ns)}.")
    if outcome.result != "green" and outcome.green_ns is not None:
        ctx.out.print(
            f"The core went green at {clock_text(outcome.green_ns)}: that is what is recorded.",
            highlight=False,
        )
    # A unit's run is not the stage's result (the progress file keeps one a stage).
    if save_attempt(ctx, attempt, None if unit else recorded, kata, stage):
        ctx.out.print(f"Recorded: kata progress {kata.name}", style="dim", highlight=False)
    if outcome.result == "interrupted":
        return 130
    return 0 if outcome.green_ns is not None else 1


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
    elif answer.strip().lower() in YES:
        reveal_next_hint(ctx, kata, stage)


def _configure_start(parser: argparse.ArgumentParser) -> None:
    add_session_arguments(parser, "the timebox")
    parser.add_argument(
        "--base",
        choices=["own", "reference"],
        help="earlier stages: your own (default) or the reference solutions'",
    )
    parser.add_argument(
        "--unit",
        metavar="NAME",
        help="practise one unit of the stage alone: its file, its tests (kata show lists "
        "them, e.g. a C hot path and the Python around it)",
    )
    parser.add_argument(
        "--full",
        action="store_true",
        help="re-run the whole stage suite, not only its core tests (time to green is then "
        "measured on the whole suite)",
    )
    parser.add_argument(
        "--no-prompt",
        action="store_true",
        help="do not print the stage's summary first (kata show prints the whole prompt)",
    )
    parser.add_argument(
        "--poll",
        type=_poll_seconds,
        default=0.25,
        metavar="SECONDS",
        help="how often to look for saved files (0.25)",
    )


COMMANDS: tuple[Command, ...] = (
    Command(
        "start",
        "a timed practice attempt at a stage",
        "Start a timed attempt: print what the stage asks (its title, core, timebox and the "
        "first paragraph of its prompt; kata show prints all of it), count down its timebox "
        "(from kata.toml, or --minutes), and re-run the stage's core tests every time you "
        "save a file in the kata folder (polling; press r to run now), with passed/total as "
        "a progress bar. A save (or r) runs what failed last first and stops at the first "
        "failure, for an answer in seconds; the first run, and one after pressing a, run "
        "every test. "
        "Keys act at once, also while tests run: r starts a fresh run, a one of every test, "
        "q stops. When the tests go green the time to green is recorded and the next step "
        "offered (the extended part, or the next stage); at the end of the timebox you see "
        "what still fails and are offered the next hint. q or Ctrl-C ends the attempt, "
        "which is recorded too (kata progress).\n\n"
        "exit code: 0 green, 1 not green (time up or stopped), 2 bad input, 130 Ctrl-C",
        _configure_start,
        run_start,
    ),
)

__all__ = ["COMMANDS"]
