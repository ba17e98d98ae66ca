"""``kata hint``: the stage's hints from the kata's HINTS.md, one at a time; the ones
revealed are remembered (``kata start`` reveals them with h too).
"""

from __future__ import annotations

import argparse

from rich.markdown import Markdown
from rich.rule import Rule

from katas._cli.cliutil import Command, Context, UserError, add_kata_stage, read_text
from katas._registry.catalog import Kata, Stage, display_path
from katas._registry.notes import Part, hints


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


COMMAND = Command(
    "hint",
    "show the next hint for a stage",
    "Show the next hint for the stage from the kata's HINTS.md, one at a time; the "
    "hints you have seen are remembered (and counted in `kata progress`). --again "
    "shows them again; --all shows every hint once the stage has passed.",
    _configure_hint,
    run_hint,
)

__all__ = ["COMMAND", "reveal_next_hint", "stage_hints"]
