"""``kata ask``: a clarifying question, answered as the stage's interviewer notes say."""

from __future__ import annotations

import argparse

from katas._cli.cliutil import Command, Context, UserError, add_kata_stage
from katas._cli.interview import answer, matcher_of, post


def run_ask(args: argparse.Namespace, ctx: Context) -> int:
    kata = ctx.catalog.get(args.kata)
    stage = kata.stage(args.stage)
    text = " ".join(args.question).strip()
    if not text:
        raise UserError(f'the question is empty: kata ask {kata.name} {stage.number} "…"')
    question = answer(ctx, matcher_of(ctx, kata, stage), text)
    if post(ctx, kata, stage, text, question.text if question else None):
        ctx.out.print("Recorded with the interview in progress.", style="dim")
    return 0


def _configure_ask(parser: argparse.ArgumentParser) -> None:
    add_kata_stage(parser)
    parser.add_argument("question", metavar="QUESTION", nargs="*", help="in your own words")


COMMAND = Command(
    "ask",
    "ask the interviewer a clarifying question about a stage",
    "Answer a clarifying question about the stage as its INTERVIEWER.md says: the question "
    "it was heard as and the answer, or, when the notes do not answer it, the stock "
    "answer (your call: state your assumption). While kata start KATA N --interview runs "
    "(in another terminal), the question counts for that interview, as one asked with ? "
    "there does.\n\n"
    "exit code: 0 answered, 2 bad input (an empty question)",
    _configure_ask,
    run_ask,
)

__all__ = ["COMMAND"]
