"""``kata pair``: an interview session — notes, a timer with swaps, a rubric sheet.

The loop is :class:`~katas._cli.practice.PairSession`; this module connects it to a
kata's interviewer notes, its suite and the recorded progress.
"""

from __future__ import annotations

import argparse
import datetime as dt

from rich.markdown import Markdown
from rich.rule import Rule
from rich.table import Table
from rich.text import Text

from katas._cli.cli_debug import DEFAULT_MINUTES as DEBUG_MINUTES
from katas._cli.cli_debug import debug_round
from katas._cli.cli_review import review_round
from katas._cli.cli_sessions import (
    NS_PER_MIN,
    add_session_arguments,
    ask_rubric,
    learners_impl,
    minutes_arg,
    print_prompt,
    save_attempt,
)
from katas._cli.cliutil import (
    Command,
    Context,
    UserError,
    check_profile,
    display_paths,
    is_learners_code,
    read_text,
    shorten,
    stage_file_or_error,
    suites_or_error,
)
from katas._cli.practice import PairSession, SessionKey, tally
from katas._cli.state import Attempt, clock_text
from katas._cli.summary import print_summary
from katas._registry.catalog import Kata, Stage, display_path
from katas._registry.notes import (
    CLARIFYING,
    LADDER,
    READ_ALOUD,
    InterviewerNotes,
    Part,
    interviewer_notes,
    is_section,
    rubric_axes,
)
from katas._registry.suites import SuiteRun, run_suite
from katas._runtime.clock import NS_PER_S


def _swap_minutes(text: str) -> float:
    return 0.0 if text.strip() in ("0", "0.0") else minutes_arg(text)


# --- kata pair -------------------------------------------------------------------------------


ABOUT = "About this stage"


def note_pages(notes: InterviewerNotes) -> list[Part]:
    """The notes in the order the interviewer needs them: what to read aloud, the clarifying
    questions and their answers, then every other part in file order (the stage's untitled
    introduction as "About this stage", the follow-up ladder after the stage's follow-ups)."""
    parts: list[Part] = []
    for part in notes.stage_parts:
        parts.append(part if part.title else Part(ABOUT, part.body))
        if part.title.lower().startswith("follow-up") and notes.ladder:
            parts.append(Part(LADDER, notes.ladder))
    if notes.ladder and not any(p.title == LADDER for p in parts):
        parts.append(Part(LADDER, notes.ladder))
    first = [p for p in parts if is_section(p.title, READ_ALOUD)][:1]
    first += [p for p in parts if is_section(p.title, CLARIFYING)][:1]
    return [*first, *(p for p in parts if p not in first)]


def _notes_or_error(kata: Kata, stage: Stage, text: str) -> list[Part]:
    notes = interviewer_notes(text, stage.section)
    if notes is None:
        raise UserError(f"{display_path(kata.interviewer)} has no '## {stage.section}' section")
    return note_pages(notes)


def _print_page(ctx: Context, page: Part) -> None:
    ctx.out.print(Markdown(f"### {page.title}\n\n{page.body}"))


#: The key that leaves the notes for the timer at once (Enter, or any other key, pages on).
START_KEY = "s"


def _page_key(ctx: Context, question: str) -> str | None:
    """The key pressed after ``question``, read at once as the session's keys are (no
    Enter needed); None if nobody is at the keyboard."""
    if not ctx.terminal.interactive:
        return None
    ctx.out.print(Text(question), end="")
    key: str | None = None
    with ctx.terminal.keys():
        while key is None:
            key = ctx.terminal.wait_key(NS_PER_S)
    ctx.out.print()
    return key


def show_notes(ctx: Context, kata: Kata, stage: Stage, pages: list[Part]) -> bool:
    """Print the notes a part at a time, a key press before each next one (s: start the
    timer now); all at once if nobody is at the keyboard. Whether they were paged (so the
    read-aloud part has scrolled away)."""
    ctx.out.print(Rule(f"interviewer notes · {kata.name} stage {stage.number}: {stage.title}"))
    paged = True
    for number, page in enumerate(pages, 1):
        if number > 1 and paged:
            rest = f" ({number} of {len(pages)}) · {START_KEY}: start the timer "
            title = shorten(page.title.lower(), ctx.out.width - len("Enter: ") - len(rest) - 1)
            key = _page_key(ctx, f"Enter: {title}{rest}")
            if key is None:
                paged = False  # nobody at the keyboard: the rest at once, as a handout
            elif key.lower() == START_KEY:
                return True
        _print_page(ctx, page)
    if paged and _page_key(ctx, "Enter starts the timer ") is None:
        paged = False
    return paged


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


class _SessionKeys:
    """What the interviewer's keys do while the timer runs (it keeps running): n pages
    through the notes, p shows the candidate's prompt; and the swaps it announces."""

    def __init__(self, ctx: Context, kata: Kata, stage: Stage, pages: list[Part]) -> None:
        self.ctx, self.kata, self.stage, self.pages = ctx, kata, stage, pages
        self.page = 0  # the next page n shows

    def next_note(self) -> None:
        out, pages = self.ctx.out, self.pages
        if not pages:
            out.print("No interviewer notes for this stage.", style="dim")
            return
        number = self.page % len(pages)
        self.page = number + 1
        out.print(Rule(f"notes {number + 1} of {len(pages)}", style="dim"))
        _print_page(self.ctx, pages[number])

    def prompt(self) -> None:
        print_prompt(self.ctx, self.kata, self.stage, "the candidate's prompt")

    def on_swap(self, number: int, at_ns: int) -> None:
        self.ctx.out.print(
            Text(
                f"⇄ [{clock_text(at_ns)}] swap {number}: driver and navigator change places",
                style="bold magenta",
            )
        )


def run_pair(args: argparse.Namespace, ctx: Context) -> int:
    kata = ctx.catalog.get(args.kata)
    if args.round == "debug":
        minutes = args.minutes or DEBUG_MINUTES
        return debug_round(ctx, kata, args.stage, seed=args.seed, minutes=minutes, paired=True)
    if args.round == "review":
        return review_round(ctx, kata, args.stage, seed=args.seed, paired=True)
    stage = kata.stage(args.stage)
    suites = suites_or_error(kata, stage)
    text = read_text(kata.interviewer, f"the interviewer notes of {kata.name}")
    pages = _notes_or_error(kata, stage, text)
    impl = learners_impl(ctx)
    check_profile()
    if is_learners_code(None):
        stage_file_or_error(kata, stage)
    state = ctx.state()  # an unusable state file stops us before the session starts
    minutes = args.minutes if args.minutes is not None else stage.timebox_minutes
    timebox_ns = int(minutes * NS_PER_MIN)
    swap_ns = int(args.swap * NS_PER_MIN)
    paged = False if args.no_notes else show_notes(ctx, kata, stage, pages)
    ctx.out.print(Rule(f"pairing · {kata.name} stage {stage.number} · {clock_text(timebox_ns)}"))
    if paged and pages and is_section(pages[0].title, READ_ALOUD):  # it scrolled away
        _print_page(ctx, pages[0])
    ctx.out.print(
        f"The candidate reads: kata show {kata.name} {stage.number}, and edits "
        f"{display_path(kata.stub_path(stage))}."
        + (f" Driver and navigator swap every {clock_text(swap_ns)}." if swap_ns else ""),
        highlight=False,
    )
    keys = _SessionKeys(ctx, kata, stage, pages)
    started_wall = ctx.wall()
    outcome = PairSession(
        clock=ctx.clock,
        terminal=ctx.terminal,
        console=ctx.out,
        timebox_ns=timebox_ns,
        swap_ns=swap_ns,
        on_swap=keys.on_swap,
        title=f"{kata.name} stage {stage.number}",
        keys={
            "n": SessionKey("next note", keys.next_note),
            "p": SessionKey("the prompt", keys.prompt),
        },
    ).run()
    ended = {
        "timeout": "Time is up.",
        "stopped": "Session ended.",
        "interrupted": "Session ended (Ctrl-C).",
    }
    ctx.out.print(Text(ended[outcome.result], style="bold"))
    result: SuiteRun | None = None
    try:
        with ctx.out.status(f"Running {kata.name} stage {stage.number} on the candidate's code…"):
            result = run_suite(suites, impl=impl, timeout_s=None)
        if result.results:
            print_summary(ctx.out, result, kata, stage)
        else:  # nothing ran: pytest's own words say why
            ctx.out.print(Text(result.output.rstrip()[-2000:]))
            ctx.out.print(
                f"pytest could not run {display_paths(suites)} (exit code {result.returncode}).",
                style="red",
                highlight=False,
            )
    except KeyboardInterrupt:
        ctx.out.print("The suite run was interrupted.", style="yellow")
    axes = rubric_axes(text, stage.section)
    sheet: list[dict[str, str]] = []
    try:
        ask_rubric(ctx, axes, sheet, "a line they wrote or said")
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
    attempt = Attempt(
        kata=kata.name,
        stage=stage.number,
        mode="pair",
        started=started_wall,
        seconds=outcome.elapsed_ns / NS_PER_S,
        timebox_minutes=minutes,
        green_seconds=None,
        result=outcome.result,
        passed=passed,
        total=ran,
        swaps=outcome.swaps,
        rubric=sheet,
        learners_code=is_learners_code(None),
    )
    try:
        path = ctx.store.save_file(f"sheets/{kata.name}-stage{stage.number}-{stamp}.md", markdown)
        attempt.sheet = str(path)
        ctx.out.print(f"Rubric sheet saved to {path} — fill it in there.", highlight=False)
    except OSError as exc:
        ctx.out.print(f"could not save the rubric sheet: {exc}", style="yellow")
    save_attempt(ctx, attempt, state.hints_revealed(kata.name, stage.number), result)
    if result is None:  # Ctrl-C stopped the suite: nobody knows whether it passes
        return 130
    return 0 if result.ok else 1


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
        "--round",
        choices=["coding", "debug", "review"],
        default="coding",
        help="coding (default): the stage itself; debug: a debugging round on a copy of the "
        "reference with a catalogue bug, its incident read to the candidate and the bug "
        "shown to you; review: proposed changes, the candidate's verdicts typed by you",
    )
    parser.add_argument(
        "--seed", type=int, help="with --round: fix the random choice of bugs or changes"
    )
    parser.add_argument(
        "--no-notes",
        action="store_true",
        help="do not print the interviewer notes first (n still shows them in the session)",
    )


COMMAND = Command(
    "pair",
    "interviewer mode: notes, timer with swaps, rubric sheet",
    "Run a pairing session. First the interviewer notes of the stage from the kata's "
    "INTERVIEWER.md, a part at a time (Enter shows the next, s starts the timer at once; "
    "all at once without a terminal): what to read aloud, the clarifying questions a strong"
    " candidate asks and the answers, then the timebox, the follow-ups and the follow-up "
    "ladder, the rubric. Then a timer announcing a driver/navigator swap every --swap "
    "minutes, with the read-aloud part above it; n shows the notes again a part at a time, "
    "p the candidate's prompt. At the end (time up, q or Ctrl-C) the stage's suite runs on "
    "the candidate's code and a rubric sheet is printed, filled in at the prompt if there "
    "is a terminal (s, a or w and a line of evidence per axis; Enter skips), and saved with"
    " the attempt in the state directory.\n\n"
    "--round debug or --round review runs the stage's other interview rounds instead, as "
    "kata debug and kata review do, with the interviewer at the keyboard: the debugging "
    "round also shows you the planted bug, its diff and the tests that catch it; in the "
    "review round you type the candidate's verdicts. Both are recorded as paired rounds "
    "(kata progress)."
    "\n\n"
    "exit code: 0 the candidate's suite passed, 1 it did not, 2 bad input, 130 Ctrl-C "
    "during the suite run",
    _configure_pair,
    run_pair,
)

__all__ = ["COMMAND"]
