"""``kata reveal``: the reference solution as a diff against the learner's file, and the
stage's common mistakes (the classic-bug catalogue), once the stage has passed.
"""

from __future__ import annotations

import argparse
import difflib
from pathlib import Path

from rich.rule import Rule
from rich.syntax import Syntax
from rich.text import Text

from katas._cli.cliutil import Command, Context, UserError, add_kata_stage, read_text
from katas._registry import mutants
from katas._registry.catalog import Kata, Stage, display_path


def reference_file(ctx: Context, kata: Kata, path: Path) -> Path:
    """The reference of the learner's file ``path``: the same place under ``solutions/``."""
    return ctx.catalog.project_root / "solutions" / kata.name / path.relative_to(kata.path)


def common_mistakes(ctx: Context, kata: Kata, stage: Stage) -> list[mutants.Mutant]:
    """The stage's classic-bug catalogue entries (``tests/mutants/<kata>/stageN_*.diff``)."""
    folder = ctx.catalog.project_root / "tests" / "mutants" / kata.name
    found: list[mutants.Mutant] = []
    for path in sorted(folder.glob(f"stage{stage.number}_*.diff")):
        try:
            found.append(mutants.parse(path))
        except (ValueError, OSError, UnicodeDecodeError):
            continue  # a malformed entry is the catalogue check's to report, not ours
    return found


def run_reveal(args: argparse.Namespace, ctx: Context) -> int:
    kata = ctx.catalog.get(args.kata)
    stage = kata.stage(args.stage)
    if not args.force and not ctx.state().passed(kata.name, stage.number):
        raise UserError(
            f"{kata.name} stage {stage.number} has not passed yet, so the reference stays "
            f"hidden; get it green (kata test {kata.name} {stage.number}) or use --force"
        )
    ctx.out.print(Rule(f"{kata.name} stage {stage.number}: the reference (-) and yours (+)"))
    for path in kata.learner_paths(stage):
        reference = reference_file(ctx, kata, path)
        theirs = read_text(reference, "the reference solution")
        mine = read_text(path, "your stage file")
        diff = list(
            difflib.unified_diff(
                theirs.splitlines(keepends=True),
                mine.splitlines(keepends=True),
                fromfile=f"reference {display_path(reference)}",
                tofile=f"yours {display_path(path)}",
                n=args.context,
            )
        )
        if diff:
            ctx.out.print(Syntax("".join(diff), "diff", theme="ansi_dark", word_wrap=True))
        else:
            ctx.out.print(f"Your {display_path(path)} is identical to the reference.")
    found = common_mistakes(ctx, kata, stage)
    ctx.out.print(Rule(f"common mistakes in stage {stage.number} ({len(found)})"))
    if not found:
        ctx.out.print("No catalogue entries for this stage yet.", style="dim")
    for mutant in found:
        line = Text("• ", style="bold")
        line.append(mutant.bug)
        line.append(f"  ({mutant.path.stem})", style="dim")
        ctx.out.print(line, soft_wrap=True)
    return 0


def _configure_reveal(parser: argparse.ArgumentParser) -> None:
    add_kata_stage(parser)
    parser.add_argument(
        "--force", action="store_true", help="show the reference even before the stage passed"
    )
    parser.add_argument(
        "--context", type=int, default=3, metavar="N", help="lines of context in the diff (3)"
    )


COMMAND = Command(
    "reveal",
    "compare your stage file with the reference",
    "Show the reference solution of the stage as a diff against your file (reference "
    "lines -, yours +), and the stage's common mistakes: the classic-bug catalogue in "
    "tests/mutants/<kata>/, one line each. Only once the stage has passed, or with "
    "--force.",
    _configure_reveal,
    run_reveal,
)

__all__ = ["COMMAND", "common_mistakes", "reference_file"]
