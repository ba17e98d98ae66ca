"""What ``kata start`` (:mod:`katas._cli.cli_start`) and ``kata pair``
(:mod:`katas._cli.cli_pair`) share: the session arguments, the implementation a session
tests, and recording an attempt with the progress it made.
"""

from __future__ import annotations

import argparse
import sys

from katas._cli.cliutil import Context, add_kata_stage, impl_or_error
from katas._cli.practice import tally
from katas._cli.state import Attempt, StateError
from katas._registry.suites import SuiteRun
from katas._runtime.clock import NS_PER_S

NS_PER_MIN = 60 * NS_PER_S


def minutes_arg(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of minutes, got {text!r}") from None
    if not value > 0 or value > 24 * 60:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1440 minutes, got {text!r}")
    return value


def learners_impl(ctx: Context) -> str:
    """The learner's code (or ``KATA_IMPL``), as :func:`resolve_impl` gives it to pytest."""
    return impl_or_error(None, ctx)


def add_session_arguments(parser: argparse.ArgumentParser, length: str) -> None:
    """``KATA STAGE [--minutes N]``, what a timed session takes; ``length`` names the minutes."""
    add_kata_stage(parser)
    parser.add_argument(
        "--minutes",
        type=minutes_arg,
        metavar="N",
        help=f"{length} (default: the stage's timebox_minutes in kata.toml)",
    )


def save_attempt(ctx: Context, attempt: Attempt, hints_before: int, last: SuiteRun | None) -> bool:
    """Record ``attempt`` (and the last run's result); False, with a warning, if impossible.

    ``hints_before``: the hints of the stage revealed when the attempt began.
    """
    try:
        with ctx.store.update() as state:
            ran = (last.ok, *tally(last)) if last is not None else None
            state.record_attempt(attempt, hints_before, ran, ctx.wall())
        return True
    except StateError as exc:
        print(f"kata: error: this attempt was not recorded: {exc}", file=sys.stderr)
        return False


__all__ = ["NS_PER_MIN", "add_session_arguments", "learners_impl", "minutes_arg", "save_attempt"]
