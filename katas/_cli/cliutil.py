"""What the ``kata`` subcommands share: the context, bad-input errors, their arguments,
text shortened to fit, reading a kata's files and the checks before a run.

Every verb module (``cli_list``, ``cli_start``, …) and the command table in
:mod:`katas._cli.cli` import it, so no verb module imports another for these.
"""

from __future__ import annotations

import argparse
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console

from katas._cli.state import Practice, StateStore
from katas._cli.terminal import KeyboardTerminal, Terminal
from katas._registry.catalog import Catalog, Kata, Stage, display_path
from katas._registry.impl import ENV_IMPL, profile_name
from katas._registry.notes import is_section, sections
from katas._registry.suites import SuiteRun, resolve_impl
from katas._runtime.clock import Clock, MonotonicClock


class UserError(Exception):
    """Bad input: reported as one line on stderr, exit code 2."""


#: The answers to a [y/N] question that mean yes.
YES = ("y", "yes")


# --- arguments ---------------------------------------------------------------------------


def stage_number(text: str) -> int:
    """``2`` or ``stage2``."""
    match = re.fullmatch(r"(?:stage)?\s*(\d+)", text.strip(), re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"STAGE must be a stage number like 1, got {text!r}")
    return int(match.group(1))


@dataclass
class Context:
    """What every subcommand gets besides its arguments.

    ``clock`` (integer nanoseconds), ``terminal`` (keys and questions) and ``wall``
    (epoch seconds, for the dates in the history) are injected by tests.
    """

    catalog: Catalog
    out: Console
    passthrough: list[str] = field(default_factory=list)  # the arguments after ``--``
    store: StateStore = field(default_factory=StateStore)
    clock: Clock = field(default_factory=MonotonicClock)
    terminal: Terminal = field(default_factory=KeyboardTerminal)
    wall: Callable[[], float] = time.time

    def state(self) -> Practice:
        """The recorded progress (a :class:`~katas._cli.state.StateError` if unusable)."""
        return self.store.load()


@dataclass(frozen=True)
class Command:
    """One subcommand: how it reads its arguments and what it does."""

    name: str
    summary: str  # one line, in ``kata --help``
    description: str  # the top of ``kata NAME --help``
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace, Context], int]
    takes_passthrough: bool = False  # accepts ``-- extra args``


def add_kata(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "kata", metavar="KATA", help="kata name, as in `kata list` (e.g. rate_limiter)"
    )


def add_stage(parser: argparse.ArgumentParser, optional: bool = False) -> None:
    parser.add_argument(
        "stage",
        metavar="STAGE",
        type=stage_number,
        nargs="?" if optional else None,
        help="stage number (1, 2, 3)",
    )


def add_kata_stage(parser: argparse.ArgumentParser, optional: bool = False) -> None:
    """``KATA STAGE``: what most subcommands act on (``STAGE`` may be left out if optional)."""
    add_kata(parser)
    add_stage(parser, optional)


# --- text that fits ----------------------------------------------------------------------

#: Words a shortened title does not end on ("token bucket and…" reads as "token bucket…").
_DANGLING = frozenset(("a", "an", "and", "at", "by", "for", "in", "of", "on", "or", "per", "the"))


def shorten(text: str, width: int) -> str:
    """``text`` if it fits in ``width`` characters, else cut at a word boundary with "…".

    A cut after a comma is preferred when it keeps most of the room, so a title reads as
    its first items ("Concurrent: striped locks…"), never as half a word.
    """
    if len(text) <= width:
        return text
    if width <= 1:
        return "…" if width == 1 else ""
    room = text[: width - 1]
    comma = room.rfind(",")
    if text[len(room)] == ",":
        cut = room
    elif comma >= 0.6 * len(room):
        cut = room[:comma]
    elif text[len(room)] == " ":
        cut = room
    else:
        cut = room[: room.rfind(" ")] if " " in room else room
    words = cut.rstrip(" ,:;—-").split(" ")
    while len(words) > 1 and words[-1].lower() in _DANGLING:
        words.pop()
    return " ".join(words).rstrip(" ,:;—-") + "…"


# --- a kata's files ----------------------------------------------------------------------


def markdown_sections(text: str) -> list[tuple[str | None, str]]:
    """Split at level-1/2 headings (outside code fences): ``(heading or None, chunk)``."""
    return sections(text, 2)


def stage_prompt(text: str, kata: Kata, stage: Stage, source: Path) -> str:
    """The prompt's introduction (everything before the first stage section) and ``stage``'s."""
    chunks = markdown_sections(text)
    stage_headings = [s.section for s in kata.stages]
    intro: list[str] = []
    for heading, chunk in chunks:
        if any(is_section(heading, name) for name in stage_headings):
            break
        intro.append(chunk)
    mine = [chunk for heading, chunk in chunks if is_section(heading, stage.section)]
    if not mine:
        raise UserError(f"{display_path(source)} has no '## {stage.section}' section")
    return "".join(intro).rstrip() + "\n\n" + "".join(mine)


def read_text(path: Path, what: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"{display_path(path)} does not exist yet ({what})") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{display_path(path)}: cannot read: {exc}") from None


def stage_file_or_error(kata: Kata, stage: Stage) -> Path:
    """The learner's stage file, or a :class:`UserError` saying how to get the stub back."""
    path = kata.stub_path(stage)
    if not path.is_file():
        raise UserError(
            f"{display_path(path)} does not exist (your stage file); "
            f"restore the stub with: kata reset {kata.name} {stage.number}"
        )
    return path


def impl_or_error(spec: str | None, ctx: Context) -> str:
    """``--impl`` (or ``KATA_IMPL``) as :func:`resolve_impl` gives it to pytest, or a
    :class:`UserError` naming what is wrong with it."""
    try:
        return resolve_impl(spec, ctx.catalog.root)
    except ValueError as exc:
        raise UserError(str(exc)) from None


def check_profile() -> str:
    """``KATA_PROFILE``'s hypothesis profile, or a :class:`UserError` naming the valid ones."""
    try:
        return profile_name()
    except ValueError as exc:
        raise UserError(str(exc)) from None


def suites_or_error(kata: Kata, stage: Stage) -> list[Path]:
    """The stage's suite files, or a :class:`UserError` naming a missing one and the
    kata.toml."""
    suites = kata.suite_paths(stage)
    for suite in suites:
        if not suite.is_file():
            raise UserError(
                f"{display_path(suite)} does not exist (a suite of {kata.name} stage "
                f"{stage.number}, named in {display_path(kata.manifest)})"
            )
    return suites


def display_paths(paths: list[Path]) -> str:
    """``a.py``, or ``a.py and b.py``, or ``a.py, b.py and c.py``, as :func:`display_path`."""
    shown = [display_path(p) for p in paths]
    return shown[0] if len(shown) == 1 else ", ".join(shown[:-1]) + " and " + shown[-1]


def is_learners_code(impl_spec: str | None) -> bool:
    """Whether a run tests the learner's own files (so its result counts as progress)."""
    spec = impl_spec or os.environ.get(ENV_IMPL) or "katas"
    return spec == "katas"


def record_run(ctx: Context, kata: Kata, stage: Stage, result: SuiteRun) -> None:
    """Remember a run of the learner's code: ``kata list`` shows its status."""
    passed = len(result.by_outcome("passed"))
    total = passed + len(result.failures())
    with ctx.store.update() as state:
        state.record_result(
            kata.name, stage.number, ok=result.ok, passed=passed, total=total, at=ctx.wall()
        )
