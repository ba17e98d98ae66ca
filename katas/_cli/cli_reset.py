"""``kata reset``: the stage file back to its pristine committed stub, the learner's
version kept in the state directory's archive first.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from collections.abc import Sequence
from pathlib import Path

from katas._cli.cliutil import YES, Command, Context, UserError, add_kata_stage
from katas._cli.pristine import PristineError, pristine_stub
from katas._cli.state import StateError
from katas._registry.catalog import Kata, Stage, display_path


def run_reset(args: argparse.Namespace, ctx: Context) -> int:
    kata = ctx.catalog.get(args.kata)
    stages = [kata.stage(args.stage)] if args.stage is not None else list(kata.stages)
    changes: list[tuple[Path, str, str]] = []  # (file, its pristine text, which commit)
    for path in dict.fromkeys(p for stage in stages for p in kata.learner_paths(stage)):
        try:
            text, commit = pristine_stub(path)
        except PristineError as exc:
            raise UserError(str(exc)) from None
        current = path.read_text(encoding="utf-8") if path.exists() else None
        if current == text:
            ctx.out.print(f"{display_path(path)} is already the pristine stub.", style="dim")
        else:
            changes.append((path, text, commit))
    if not changes:
        _record_reset(ctx, kata, stages)
        return 0
    names = ", ".join(display_path(p) for p, _, _ in changes)
    stamp = dt.datetime.fromtimestamp(ctx.wall()).strftime("%Y%m%d-%H%M%S")
    archive = ctx.store.directory / "archive" / kata.name / stamp
    if not args.yes:
        answer = ctx.terminal.ask(
            f"Restore {names} to the committed stub? Your version is kept in {archive}. [y/N] "
        )
        if answer is None:
            raise UserError("asks before restoring; run with --yes to confirm without a terminal")
        if answer.strip().lower() not in YES:
            ctx.out.print("Nothing was changed.")
            return 1
    for path, text, commit in changes:
        if path.exists():
            kept = ctx.store.save_file(
                f"archive/{kata.name}/{stamp}/{path.name}", path.read_text(encoding="utf-8")
            )
            ctx.out.print(f"kept your {path.name} as {kept}", style="dim")
        tmp = path.with_name(f".{path.name}.kata-reset")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
        ctx.out.print(f"restored {display_path(path)} (the stub of commit {commit})")
    _record_reset(ctx, kata, stages)
    return 0


def _record_reset(ctx: Context, kata: Kata, stages: Sequence[Stage]) -> None:
    """Each stage's file is the stub now: ``kata list`` says "reset" (its history stays)."""
    try:
        if all(ctx.state().status(kata.name, s.number) == "not started" for s in stages):
            return  # nothing recorded, so nothing to change (and no state file to make)
        with ctx.store.update() as state:
            for stage in stages:
                state.record_reset(kata.name, stage.number, at=ctx.wall())
    except StateError as exc:
        print(f"kata reset: warning: the progress does not show the reset: {exc}", file=sys.stderr)


def _configure_reset(parser: argparse.ArgumentParser) -> None:
    add_kata_stage(parser, optional=True)
    parser.add_argument("-y", "--yes", action="store_true", help="do not ask first")


COMMAND = Command(
    "reset",
    "restore the pristine stub of a stage (or of every stage)",
    "Restore the stage file(s) to the stub as committed in git, after asking (--yes "
    "skips the question). Your version is first kept in the state directory's "
    "archive/, so nothing you wrote is lost. The stage's status in `kata list` becomes "
    "'reset' until its next run; its history (attempts, best time, whether it ever "
    "passed) is kept.",
    _configure_reset,
    run_reset,
)

__all__ = ["COMMAND"]
