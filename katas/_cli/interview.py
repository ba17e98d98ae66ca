"""Interview mode (``kata start KATA N --interview``): the stage as an interviewer gives it.

The learner hears only the read-aloud prompt of the stage's INTERVIEWER.md and asks
clarifying questions in their own words (``?``); each is answered as the notes say, or
with the stock answer when the notes do not answer it (:mod:`katas._cli.asking`). The
whole written prompt stays one key away (``p``), and opening it is recorded. At the end:
which key questions (those whose answer changes the code) were asked before the first
run, later or never, a curveball to think about, and a self-assessment on the stage's
rubric, all saved with the attempt (:class:`~katas._cli.state.Interview`).

A question may also come from another terminal (``kata ask KATA N "…"``): while an
interview of that stage runs, its ``.live`` file in the state directory names its
process, and ``kata ask`` appends each question to the interview's inbox, which the
session reads when the learner next asks a question and when its clock stops.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from rich.markdown import Markdown
from rich.rule import Rule
from rich.table import Table
from rich.text import Text

from katas._cli.asking import STOCK_ANSWER, QuestionMatcher
from katas._cli.cli_sessions import ask_rubric, print_prompt
from katas._cli.cliutil import Context, UserError, read_text
from katas._cli.practice import SessionKey
from katas._cli.state import Asked, Attempt, Interview, clock_text
from katas._registry.catalog import Kata, Stage, display_path
from katas._registry.notes import (
    READ_ALOUD,
    Question,
    clarifying_questions,
    curveballs,
    rubric_axes,
    stage_part,
)
from katas._runtime.clock import NS_PER_S

ASK_KEY = "?"
PROMPT_KEY = "p"


def _inbox(ctx: Context, kata: Kata, stage: Stage) -> tuple[Path, Path]:
    """The live marker and the inbox of ``kata`` ``stage``'s interview, in the state dir."""
    folder = ctx.store.directory / "interview"
    name = f"{kata.name}-stage{stage.number}"
    return folder / f"{name}.live", folder / f"{name}.jsonl"


def answer(ctx: Context, matcher: QuestionMatcher, text: str) -> Question | None:
    """Print the interviewer's answer to ``text``: the row it was heard as and its answer,
    or the stock answer. The row, or None."""
    question = matcher.match(text)
    if question is None:
        ctx.out.print(Text.assemble(("Interviewer: ", "bold"), STOCK_ANSWER))
        return None
    ctx.out.print(Text(f"(heard as: {question.text})", style="dim"), highlight=False)
    ctx.out.print(Markdown(f"**Interviewer:** {question.answer}"))
    return question


def matcher_of(ctx: Context, kata: Kata, stage: Stage) -> QuestionMatcher:
    notes = read_text(kata.interviewer, f"the interviewer notes of {kata.name}")
    return QuestionMatcher(clarifying_questions(notes, stage.section))


def post(ctx: Context, kata: Kata, stage: Stage, text: str, means: str | None) -> bool:
    """Hand a question asked with ``kata ask`` to the running interview of the stage;
    False if none is running."""
    live, inbox = _inbox(ctx, kata, stage)
    try:
        os.kill(int(live.read_text(encoding="utf-8")), 0)
    except (OSError, ValueError):  # no interview, or its process is gone (killed)
        return False
    line = json.dumps({"text": text, "means": means, "wall": ctx.wall()})
    with inbox.open("a", encoding="utf-8") as file:
        file.write(line + "\n")
    return True


class InterviewKeys:
    """One interview-mode attempt: the read-aloud prompt, the questions asked and the
    prompt opened while the clock runs (from :meth:`open` to :meth:`close`), and the end
    screen. ``first_run_wall`` says when the first run of the suite started, if one has.
    """

    def __init__(self, ctx: Context, kata: Kata, stage: Stage) -> None:
        self.ctx, self.kata, self.stage = ctx, kata, stage
        self.notes = read_text(kata.interviewer, f"the interviewer notes of {kata.name}")
        self.read_aloud = stage_part(self.notes, stage.section, READ_ALOUD)
        if not self.read_aloud:
            raise UserError(
                f"{display_path(kata.interviewer)} has no '### {READ_ALOUD}' part for "
                f"'## {stage.section}': interview mode has nothing to read aloud"
            )
        questions = clarifying_questions(self.notes, stage.section)
        self.matcher = QuestionMatcher(questions)
        self.record = Interview(key=[q.text for q in questions if q.key])
        self.started_ns = 0
        self.started_wall = 0.0
        #: when the first run started (wall clock), None before it
        self.first_run_wall: Callable[[], float | None] = lambda: None
        self._live, self._inbox = _inbox(ctx, kata, stage)
        self._read = 0  # lines of the inbox taken in

    def open(self) -> None:
        """The clock starts: ``kata ask`` of this stage reaches this session from now on."""
        self.started_ns = self.ctx.clock.now_ns()
        self.started_wall = self.ctx.wall()
        try:
            self._live.parent.mkdir(parents=True, exist_ok=True)
            self._inbox.write_text("", encoding="utf-8")
            self._live.write_text(str(os.getpid()), encoding="utf-8")
        except OSError:  # kata ask will not reach this session; the ? key still does
            pass

    def close(self) -> None:
        self._take_inbox()
        self._live.unlink(missing_ok=True)
        self._inbox.unlink(missing_ok=True)

    def _take_inbox(self) -> None:
        """The questions ``kata ask`` posted since the last look."""
        try:
            lines = self._inbox.read_text(encoding="utf-8").splitlines()
        except OSError:
            return
        first_run = self.first_run_wall()
        for line in lines[self._read :]:
            try:
                data = json.loads(line)
                wall = float(data["wall"])
                means = data["means"] if isinstance(data["means"], str) else None
                asked = Asked(
                    str(data["text"]),
                    means,
                    max(0.0, wall - self.started_wall),
                    before_first_run=first_run is None or wall < first_run,
                )
            except (ValueError, KeyError, TypeError):
                continue
            self.record.asked.append(asked)
        self._read = len(lines)
        self.record.asked.sort(key=lambda a: a.seconds)

    def _seconds(self) -> float:
        return (self.ctx.clock.now_ns() - self.started_ns) / NS_PER_S

    def introduce(self) -> None:
        """The read-aloud prompt, as the interviewer would say it, and what to do."""
        out = self.ctx.out
        out.print(
            Text(
                f"{self.kata.title} — stage {self.stage.number}: {self.stage.title} · interview",
                style="bold",
            )
        )
        out.print(Markdown(self.read_aloud))
        out.print(
            f"Ask what you need before you code: {ASK_KEY} asks a clarifying question, in your "
            f"own words, and the interviewer answers. {PROMPT_KEY} opens the whole written "
            "prompt (the end screen says when you did). Nothing runs until you save or press r.",
            highlight=False,
        )

    def keys(self) -> dict[str, SessionKey]:
        return {
            ASK_KEY: SessionKey("ask", self.ask, reads=True),
            PROMPT_KEY: SessionKey("the prompt", self.prompt),
        }

    def ask(self) -> None:
        """Read a question, answer it as the notes do (or with the stock answer)."""
        self._take_inbox()
        text = self.ctx.terminal.ask("Your question (Enter: back to the clock): ")
        if text is None or not text.strip():
            self.ctx.out.print("No question asked.", style="dim")
            return
        question = answer(self.ctx, self.matcher, text)
        self.record.asked.append(
            Asked(
                text.strip(),
                question.text if question else None,
                self._seconds(),
                before_first_run=self.first_run_wall() is None,
            )
        )

    def prompt(self) -> None:
        """The whole written prompt; the first time is recorded."""
        if self.record.prompt_opened_seconds is None:
            self.record.prompt_opened_seconds = self._seconds()
        print_prompt(self.ctx, self.kata, self.stage, "the whole prompt (opening it is recorded)")

    # --- after the clock -----------------------------------------------------------------

    def _questions(self) -> None:
        out, record = self.ctx.out, self.record
        early = record.key_asked(before_first_run=True)
        late = [q for q in record.key_asked(before_first_run=False) if q not in early]
        answers = {q.text: q.answer for q in self.matcher.questions}
        out.print(
            f"Key questions (their answers change the code): {len(early)} of "
            f"{len(record.key)} asked before your first run.",
            highlight=False,
        )
        for question in early:
            out.print(Text.assemble(("  ✓ ", "green"), question))
        for question in late:
            out.print(Text.assemble(("  ~ ", "yellow"), question, (" (after a run)", "dim")))
        for question in record.key_missed():
            out.print(Text.assemble(("  ✗ ", "red"), question, (" (never asked)", "dim")))
            out.print(Markdown(f"Answer: {answers.get(question, '')}"), style="dim")
        others = len(record.asked) - len([a for a in record.asked if a.means in record.key])
        if others:
            out.print(f"Other questions asked: {others}.", style="dim", highlight=False)
        opened = record.prompt_opened_seconds
        out.print(
            "You never opened the whole prompt."
            if opened is None
            else f"You opened the whole prompt at {clock_text(int(opened * NS_PER_S))}.",
            highlight=False,
        )

    def _curveball(self, number: int) -> None:
        balls = curveballs(self.notes, self.stage.section)
        if not balls:
            return
        ball = balls[(number - 1) % len(balls)]
        self.record.curveball = ball
        self.ctx.out.print("To think about next, as the interviewer would ask it:")
        self.ctx.out.print(Markdown(ball))

    def _self_assessment(self, attempt: Attempt) -> None:
        axes = rubric_axes(self.notes, self.stage.section)
        table = Table(title="the rubric: where do you stand?", show_lines=True)
        for column in ("axis", "strong", "acceptable", "weak"):
            table.add_column(column)
        for axis, levels in axes:
            table.add_row(axis, *[*levels, "", "", ""][:3])
        self.ctx.out.print(table)
        sheet: list[dict[str, str]] = []
        try:
            ask_rubric(self.ctx, axes, sheet, "a line you wrote or said")
        except KeyboardInterrupt:  # keep what was scored; the rest stays blank
            self.ctx.out.print()
        scored = {row["axis"] for row in sheet}
        sheet += [{"axis": a, "score": "", "evidence": ""} for a, _ in axes if a not in scored]
        attempt.rubric = sheet

    def end(self, attempt: Attempt, number: int) -> None:
        """The end screen (attempt ``number`` of the stage); fills in ``attempt``'s
        interview record and self-assessment."""
        self.ctx.out.print(Rule("the interview"))
        self._questions()
        self._curveball(number)
        self._self_assessment(attempt)
        attempt.mode = "interview"
        attempt.interview = self.record


__all__ = ["ASK_KEY", "PROMPT_KEY", "InterviewKeys", "answer", "matcher_of", "post"]
