"""What ``kata start`` (:mod:`katas._cli.cli_start`) and ``kata pair``
(:mod:`katas._cli.cli_pair`) share: the session arguments, the implementation a session
tests, and recording an attempt with the progress it made.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from katas._cli.cliutil import Context, add_kata_stage, impl_or_error
from katas._cli.practice import tally
from katas._cli.state import Attempt, StateError
from katas._registry.suites import SuiteProcess, SuiteRun, start_suite
from katas._registry.warm import WarmStart
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


def poll_seconds(text: str) -> float:
    """``--poll``: how often a session looks for saved files, 0.05 to 60 seconds."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.05 <= value <= 60:
        raise argparse.ArgumentTypeError(f"must be between 0.05 and 60 seconds, got {text!r}")
    return value


class SessionRuns:
    """What the suite runs of one timed session share: pytest's cache of what failed last
    (the session's own; the project's stays as it is) and one process that has imported
    pytest and the libraries every run imports, to fork each run from. ``close()`` it."""

    def __init__(self, prefix: str) -> None:
        self._cache = tempfile.TemporaryDirectory(prefix=prefix)
        self._warm = WarmStart()
        # a save within a second never runs stale
        self._env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")

    def start(
        self,
        suites: Sequence[Path],
        *,
        impl: str,
        whole: bool,
        core_only: bool,
        base: str | None = None,
        keyword: str | None = None,
    ) -> SuiteProcess:
        """A run that takes what failed last first and stops at a failure unless ``whole``."""
        order = ["-o", f"cache_dir={self._cache.name}", "--failed-first"]
        return start_suite(
            suites,
            impl=impl,
            base=base,
            keyword=keyword,
            core_only=core_only,
            env=self._env,
            pytest_args=order + ([] if whole else ["-x"]),
            cache=True,
            warm=self._warm,
        )

    def close(self) -> None:
        self._warm.close()
        self._cache.cleanup()


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


__all__ = [
    "NS_PER_MIN",
    "SessionRuns",
    "add_session_arguments",
    "learners_impl",
    "minutes_arg",
    "poll_seconds",
    "save_attempt",
]
