"""``kata start``: a timed practice attempt at a stage.

The loop is :class:`~katas._cli.practice.SoloSession`; this module connects it to a
kata's files, its suite and the recorded progress.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from rich.markdown import Markdown
from rich.rule import Rule
from rich.text import Text

from katas._cli.cli_hint import reveal_next_hint, stage_hints
from katas._cli.cli_sessions import (
    NS_PER_MIN,
    SessionRuns,
    add_session_arguments,
    learners_impl,
    poll_seconds,
    save_attempt,
)
from katas._cli.cliutil import (
    YES,
    Command,
    Context,
    UserError,
    check_profile,
    display_paths,
    is_learners_code,
    markdown_sections,
    stage_file_or_error,
    suites_or_error,
)
from katas._cli.interview import InterviewKeys
from katas._cli.practice import SoloOutcome, SoloSession, tally
from katas._cli.state import Attempt, StateError, clock_text
from katas._cli.summary import nothing_selected, print_summary, show_run
from katas._cli.watch import Watcher
from katas._registry.catalog import CatalogError, Kata, Stage, Unit, display_path
from katas._registry.notes import is_section
from katas._registry.suites import SuiteProcess, SuiteRun
from katas._runtime.clock import NS_PER_S

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


def _check_configuration(ctx: Context, kata: Kata, stage: Stage) -> tuple[list[Path], str]:
    """What stops an attempt before its clock starts, each as one line: a missing suite or
    stage file, a bad ``KATA_IMPL`` or ``KATA_PROFILE``. Returns the suites and the impl."""
    suites = suites_or_error(kata, stage)
    stage_file_or_error(kata, stage)
    impl = learners_impl(ctx)
    check_profile()
    return suites, impl


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
    """A run of the session's selected part; if no test is marked core, the whole suite's
    instead (``whole``: every test, no stop at a failure)."""

    def __init__(self, session: StartSession, whole: bool) -> None:
        self._session = session
        self._whole = whole
        self._run = session.start_part(whole)

    def wait(self, timeout_s: float | None = None) -> SuiteRun | None:
        result = self._run.wait(timeout_s)
        if result is None:
            return None
        if self._session.core and nothing_selected(result):
            self._session.core = False  # no test is marked core: the whole suite it is
            self._run = self._session.start_part(self._whole)
            return None
        return result

    def kill(self) -> None:
        self._run.kill()


class StartSession:
    """One ``kata start``: what the attempt runs and what it has seen so far.

    :class:`~katas._cli.practice.SoloSession` drives the clock, the keys and the runs; it
    calls back :meth:`on_result`, :meth:`on_hint` and :meth:`on_green`, and this object
    keeps what they learn (the part watched, the times to green, the runs finished) for
    :meth:`attempt`, the record of the attempt once it is over.
    """

    def __init__(self, args: argparse.Namespace, ctx: Context) -> None:
        self.ctx = ctx
        self.kata = kata = ctx.catalog.get(args.kata)
        self.stage = stage = kata.stage(args.stage)
        if args.interview and args.unit:
            raise UserError("--interview is the whole stage as an interview: leave out --unit")
        self.unit = stage.unit(args.unit) if args.unit else None
        self.suites, self.impl = _check_configuration(ctx, kata, stage)
        self.interview = InterviewKeys(ctx, kata, stage) if args.interview else None
        self.state = ctx.state()  # an unusable state file stops us before the clock starts
        self.base: str | None = args.base
        self.minutes: float = args.minutes if args.minutes is not None else stage.timebox_minutes
        self.timebox_ns = int(self.minutes * NS_PER_MIN)
        self.core = not args.full  # the part watched: the core tests, or the whole suite
        self.greens: list[tuple[int, bool]] = []  # (time to green, whether of the core only)
        self.finished = 0  # runs finished
        self.first_run_wall: float | None = None  # when the first run started
        self.runs: SessionRuns  # from run()

    @property
    def title(self) -> str:
        return f"{self.kata.name} stage {self.stage.number}"

    @property
    def number(self) -> int:
        """This attempt's number among the stage's."""
        return len(self.state.attempts_of(self.kata.name, self.stage.number)) + 1

    def introduce(self, prompt: bool) -> None:
        """The stage's summary (with ``prompt``; an interview's read-aloud prompt instead),
        the attempt's rule and what to do."""
        kata, stage, unit = self.kata, self.stage, self.unit
        if self.interview:
            self.interview.introduce()
        elif prompt:
            _print_prompt_summary(self.ctx, kata, stage, self.minutes, unit)
        number = self.number
        part = "the core tests" if self.core else "the whole suite"
        part += f" of the {unit.name} unit" if unit else ""
        self.ctx.out.print(
            Rule(f"{self.title} · attempt {number} · {clock_text(self.timebox_ns)}"),
        )
        self.ctx.out.print(
            f"Edit {display_path(kata.path / unit.file if unit else kata.stub_path(stage))}; "
            f"every save re-runs {part} of "
            f"{display_paths(self.suites)}, what failed last first, up to the first failure. "
            "Keys: r run now, a run all (no stop), h next hint, q stop.",
            highlight=False,
        )

    def start_part(self, whole: bool) -> SuiteProcess:
        """A run of the part watched: failed first, stopping at a failure unless ``whole``."""
        if self.first_run_wall is None:
            self.first_run_wall = self.ctx.wall()
        return self.runs.start(
            self.suites,
            impl=self.impl,
            whole=whole,
            core_only=self.core,
            base=self.base,
            keyword=self.unit.keyword if self.unit else None,
        )

    def start_run(self, whole: bool) -> _CoreElseWhole:
        return _CoreElseWhole(self, whole)

    def on_result(self, result: SuiteRun, elapsed_ns: int) -> None:
        """A line for each finished run, and its first few failures."""
        self.finished += 1
        if self.finished == 1 and result.config_error:  # nothing the learner's code can fix
            raise UserError(result.config_error)
        if self.finished == 1 and result.run_error:
            raise UserError(result.run_error)
        show_run(self.ctx, result, elapsed_ns)

    def on_hint(self) -> None:
        try:
            if not reveal_next_hint(self.ctx, self.kata, self.stage):
                self.ctx.out.print("No more hints for this stage.", style="dim")
        except (UserError, StateError) as exc:
            self.ctx.out.print(f"no hint: {exc}", style="yellow")

    def on_green(self, result: SuiteRun, green_ns: int) -> str | None:
        """Say so; with an extended part, offer to go on with the whole suite (what to
        watch then), else None: the attempt is over."""
        out, stage = self.ctx.out, self.stage
        self.greens.append((green_ns, self.core))
        if len(self.greens) > 1:
            out.print(
                Text(
                    f"✓ the whole suite is green too, at {clock_text(green_ns)}", style="bold green"
                )
            )
            return None
        # the stage's best (a unit's attempt is never the stage's)
        best = None if self.unit else self.state.best_seconds(self.kata.name, stage.number)
        note = ""
        if best is not None:
            note = (
                " — a new best!"
                if green_ns / NS_PER_S < best
                else f" (best {clock_text(int(best * NS_PER_S))})"
            )
        what = " (the core)" if self.core and stage.extended else ""
        out.print(Text(f"✓ green in {clock_text(green_ns)}{what}{note}", style="bold green"))
        if not (self.core and stage.extended):
            return None
        answer = self.ctx.terminal.ask(
            f"Keep going on the extended part ({stage.extended}) with the whole suite? [y/N] "
        )
        if answer is None or answer.strip().lower() not in YES:
            return None
        self.core = False
        out.print(
            "Watching the whole suite now; the time to green of the core is kept.",
            style="dim",
            highlight=False,
        )
        return "the whole suite"

    def run(self, poll_ns: int) -> SoloOutcome:
        """Watch and run until green, the timebox's end or q: how the attempt ended."""
        self.runs = SessionRuns("kata-start-")
        interview = self.interview
        if interview:
            interview.first_run_wall = lambda: self.first_run_wall
            interview.open()
        try:
            return SoloSession(
                clock=self.ctx.clock,
                terminal=self.ctx.terminal,
                console=self.ctx.out,
                timebox_ns=self.timebox_ns,
                watcher=Watcher([self.kata.path]),
                start_run=self.start_run,
                on_result=self.on_result,
                on_hint=self.on_hint,
                on_green=self.on_green,
                title=self.title,
                poll_ns=poll_ns,
                keys=interview.keys() if interview else {},
                run_at_start=interview is None,  # an interview's first run is the learner's
            ).run()
        finally:
            self.runs.close()
            if interview:
                interview.close()

    def recorded_run(self, outcome: SoloOutcome) -> SuiteRun | None:
        """What the attempt is measured on: the run that first went green (the core's, when
        the learner went on to the whole suite), unless the whole suite went green too."""
        if outcome.result == "green" or outcome.green is None:
            return outcome.last
        return outcome.green

    def attempt(self, outcome: SoloOutcome, started_wall: float) -> Attempt:
        recorded = self.recorded_run(outcome)
        passed, ran = tally(recorded) if recorded is not None else (0, 0)
        greens = self.greens
        continued = bool(greens) and not self.core and greens[0][1]
        return Attempt(
            kata=self.kata.name,
            stage=self.stage.number,
            mode="solo",
            started=started_wall,
            seconds=outcome.elapsed_ns / NS_PER_S,
            timebox_minutes=self.minutes,
            green_seconds=None if outcome.green_ns is None else outcome.green_ns / NS_PER_S,
            result="green" if outcome.green_ns is not None else outcome.result,
            passed=passed,
            total=ran,
            runs=outcome.runs,
            core_only=greens[0][1] if greens else self.core,
            base=self.base or "own",
            learners_code=is_learners_code(None),
            unit=self.unit.name if self.unit else None,
            went_on=continued,
            whole_green_seconds=greens[1][0] / NS_PER_S if continued and len(greens) > 1 else None,
        )

    def tell_the_end(self, outcome: SoloOutcome) -> None:
        """What comes next after green; what still fails (and a hint) at the timebox's end."""
        ctx, kata, stage, unit = self.ctx, self.kata, self.stage, self.unit
        if outcome.result == "green":
            after = _after_stage(ctx, kata, stage)
            if self.core and stage.extended:  # the extended part is still to do
                again = f" --unit {unit.name}" if unit else ""
                extended = (
                    f"kata start {kata.name} {stage.number}{again} --full (the extended part)"
                )
                ctx.out.print(
                    f"Next: {extended}" + (f", or {after}" if after else ""), highlight=False
                )
            elif after:
                ctx.out.print(f"Next: {after}", highlight=False)
            else:
                ctx.out.print(
                    "That was the last stage of the last kata: kata progress shows them all."
                )
            ctx.out.print(
                f"Reference and common mistakes: kata reveal {kata.name} {stage.number}",
                style="dim",
                highlight=False,
            )
            if not self.interview and not unit:
                ctx.out.print(
                    f"The interview's other rounds on this stage: kata start {kata.name} "
                    f"{stage.number} --interview · kata debug {kata.name} {stage.number} · "
                    f"kata review {kata.name} {stage.number}",
                    style="dim",
                    highlight=False,
                )
        elif outcome.result == "timeout":
            ctx.out.print(Text(f"⏰ time is up ({clock_text(self.timebox_ns)}).", style="bold red"))
            if outcome.last is not None:
                ctx.out.print("Still failing:")
                notes = ["core"] if self.core else []
                print_summary(ctx.out, outcome.last, kata, stage, notes=notes)
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


# --- kata start ------------------------------------------------------------------------------


def run_start(args: argparse.Namespace, ctx: Context) -> int:
    session = StartSession(args, ctx)
    session.introduce(prompt=not args.no_prompt)
    started_wall = ctx.wall()
    outcome = session.run(int(args.poll * NS_PER_S))
    attempt = session.attempt(outcome, started_wall)
    session.tell_the_end(outcome)
    if session.interview:
        session.interview.end(attempt, session.number)
    hints_before = session.state.hints_revealed(session.kata.name, session.stage.number)
    # A unit's run is not the stage's result (the progress file keeps one a stage).
    last = None if session.unit else session.recorded_run(outcome)
    if save_attempt(ctx, attempt, hints_before, last):
        ctx.out.print(f"Recorded: kata progress {session.kata.name}", style="dim", highlight=False)
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
        "--interview",
        action="store_true",
        help="practise the stage as an interview: only the read-aloud prompt; ? asks a "
        "clarifying question in your own words, p opens the whole prompt (recorded); at the "
        "end, the key questions you asked and missed, a curveball and a self-assessment",
    )
    parser.add_argument(
        "--no-prompt",
        action="store_true",
        help="do not print the stage's summary first (kata show prints the whole prompt)",
    )
    parser.add_argument(
        "--poll",
        type=poll_seconds,
        default=0.25,
        metavar="SECONDS",
        help="how often to look for saved files (0.25)",
    )


COMMAND = Command(
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
    "With --interview the stage is given as in an interview: the interviewer's read-aloud "
    "prompt only, and nothing runs until you save or press r. ? asks a clarifying question "
    "in your own words, answered as the interviewer's notes say (or: your call, state your "
    "assumption); p opens the whole written prompt, which is recorded. At the end: the key "
    "questions (whose answers change the code) you asked before your first run, later or "
    "never, a curveball to think about, and a self-assessment on the stage's rubric, all "
    "saved with the attempt.\n\n"
    "exit code: 0 green, 1 not green (time up or stopped), 2 bad input, 130 Ctrl-C",
    _configure_start,
    run_start,
)

__all__ = ["COMMAND"]
