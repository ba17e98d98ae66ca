"""``kata show``: a kata's prompt, or its introduction and one stage's section."""

from __future__ import annotations

import argparse

from rich.markdown import Markdown
from rich.text import Text

from katas._cli.cliutil import Command, Context, add_kata, read_text, stage_number, stage_prompt


def run_show(args: argparse.Namespace, ctx: Context) -> int:
    kata = ctx.catalog.get(args.kata)
    stage = kata.stage(args.stage) if args.stage is not None else None
    text = read_text(kata.prompt, f"the prompt of {kata.name}")
    if stage is not None:
        text = stage_prompt(text, kata, stage, kata.prompt)
    ctx.out.print(Markdown(text))
    if stage is not None:
        footer = Text(f"\nStage {stage.number} · timebox {stage.timebox_minutes} min · core: ")
        footer.append(stage.core)
        if stage.extended:
            footer.append(f" · extended: {stage.extended}")
        footer.append(f"\nRun its tests: kata test {kata.name} {stage.number} [--core]")
        for unit in stage.units:  # each practised alone: kata test/start … --unit NAME
            alone = f"kata test {kata.name} {stage.number} --unit {unit.name}"
            footer.append(f"\nUnit {unit.name} ({unit.file}), alone: {alone} · {unit.core}")
        ctx.out.print(footer, style="dim")
    return 0


def _configure_show(parser: argparse.ArgumentParser) -> None:
    add_kata(parser)
    parser.add_argument(
        "stage",
        metavar="STAGE",
        type=stage_number,
        nargs="?",
        help="only the introduction and this stage's section",
    )


COMMAND = Command(
    "show",
    "print a kata's prompt",
    "Print the kata's prompt (its README.md); with STAGE, the introduction and that "
    "stage's section only.",
    _configure_show,
    run_show,
)

__all__ = ["COMMAND"]
