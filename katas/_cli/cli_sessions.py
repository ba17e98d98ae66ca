"""What ``kata start`` (:mod:`katas._cli.cli_start`), ``kata pair``
(:mod:`katas._cli.cli_pair`) and ``kata debug`` share: the session arguments, the
implementation a session tests, the prompt and the rubric, and recording an attempt with
the progress it made.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from rich.markdown import Markdown
from rich.rule import Rule

from katas._cli.cliutil import (
    Context,
    UserError,
    add_kata_stage,
    impl_or_error,
    read_text,
    stage_prompt,
)
from katas._cli.practice import tally
from katas._cli.state import Attempt, StateError
from katas._registry.catalog import Kata, Stage
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


_SCORES = {"s": "strong", "a": "acceptable", "w": "weak"}


def _score(answer: str) -> str | None:
    """``strong`` from s, st, strong (any case); "" for a blank answer; None if unknown."""
    word = answer.strip().lower()
    if not word:
        return ""
    return next((s for s in _SCORES.values() if s.startswith(word)), None)


def ask_rubric(
    ctx: Context, axes: list[tuple[str, list[str]]], sheet: list[dict[str, str]], evidence: str
) -> None:
    """Ask for a score and evidence (``evidence`` says what: "a line they wrote or said")
    per axis into ``sheet``; blanks if nobody can answer.

    A score that is not s/a/w is asked again; Enter skips the axis.
    """
    for axis, _levels in axes:
        score: str | None = None
        said = ""
        while score is None:
            answer = ctx.terminal.ask(f"{axis}: strong/acceptable/weak? [s/a/w, Enter skips] ")
            if answer is None:
                score = ""
                break
            score = _score(answer)
            if score is None:
                ctx.out.print(
                    f"  {answer.strip()!r} is not a score: s (strong), a (acceptable), "
                    "w (weak), or Enter to skip",
                    style="yellow",
                    highlight=False,
                )
        if score:
            said = (ctx.terminal.ask(f"{axis}: evidence ({evidence}): ") or "").strip()
        sheet.append({"axis": axis, "score": score, "evidence": said})


def print_prompt(ctx: Context, kata: Kata, stage: Stage, title: str) -> None:
    """The stage's whole written prompt, under a rule naming it ``title``."""
    try:
        readme = read_text(kata.prompt, f"the prompt of {kata.name}")
        ctx.out.print(Rule(f"{title} · kata show {kata.name} {stage.number}"))
        ctx.out.print(Markdown(stage_prompt(readme, kata, stage, kata.prompt)))
    except UserError as exc:
        ctx.out.print(f"no prompt: {exc}", style="yellow", highlight=False)


__all__ = [
    "NS_PER_MIN",
    "SessionRuns",
    "add_session_arguments",
    "ask_rubric",
    "learners_impl",
    "minutes_arg",
    "poll_seconds",
    "print_prompt",
    "save_attempt",
]
