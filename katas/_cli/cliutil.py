"""What the ``kata`` subcommands share: the context, bad-input errors, text shortened to fit,
reading a kata's files, the checks before a run, and the learner's summary of a suite run.

Split out of :mod:`katas._cli.cli` so that the command modules (``cli_start``, ``cli_pair``,
``cli_study``) and the command table can import it without importing each other.
"""

from __future__ import annotations

import argparse
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.text import Text

from katas._cli.state import State, StateStore
from katas._cli.terminal import KeyboardTerminal, Terminal
from katas._registry.catalog import Catalog, Kata, Stage, display_path
from katas._registry.crashes import crash_message, died_of, dying_test
from katas._registry.impl import ENV_IMPL, NOT_IMPLEMENTED, profile_name
from katas._registry.notes import is_section, sections
from katas._registry.suites import SuiteRun, TestResult, resolve_impl
from katas._runtime.clock import Clock, MonotonicClock


class UserError(Exception):
    """Bad input: reported as one line on stderr, exit code 2."""


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

    def state(self) -> State:
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


# --- the summary of a run ------------------------------------------------------------------


def not_implemented_names(failures: Sequence[TestResult]) -> list[str]:
    """``TokenBucket.try_acquire`` from "not implemented yet: TokenBucket.try_acquire — …"."""
    names: dict[str, None] = {}
    for failure in failures:
        text = failure.message.removeprefix(NOT_IMPLEMENTED).strip()
        match = re.match(r"[A-Za-z_][\w.]*", text)
        names[match.group(0) if match else text or "?"] = None
    return list(names)


#: The tag the plugin puts before a failed assertion's message (``stage 1: ``).
_STAGE_TAG = re.compile(r"^stage \d+: ")
#: The kinds of failure shown a line each, in this order: a wrong result, an exception, a
#: test that ran past its deadline, a test whose process died (a C crash). A kind the
#: plugin adds later comes after them; only "not implemented yet" is counted, not listed.
SHOWN_KINDS = ("assertion", "error", "timeout", "crashed")
#: Kinds whose message names the test itself ("timeout: test_x ran past 2 s … — it was at
#: stage1.py:12 in f"): their line is the message alone, each test's own.
_SELF_NAMED = ("timeout", "crashed")


def shown_kinds(result: SuiteRun) -> list[str]:
    """The kinds of :data:`SHOWN_KINDS` and any other failing kind but "not implemented
    yet": what :func:`failure_lines` lists."""
    found = {f.kind for f in result.failures() if f.kind} - {"not_implemented"}
    return [*SHOWN_KINDS, *sorted(found - set(SHOWN_KINDS))]


def _where_part(message: str) -> str:
    """``it was at stage1.py:12 in f`` from a self-named message: its part after the last
    " — " (where the code was), or ""."""
    return message.rsplit(" — ", 1)[1] if " — " in message else ""


def failure_lines(
    result: SuiteRun, *, limit: int | None = None, width: int | None = None
) -> list[Text]:
    """The real failures (assertions, errors, timeouts, crashes) of a run, one group of
    alike ones at a time.

    Failures with the same kind and message are one line (a syntax error in a stage file
    fails every test alike: ``! SyntaxError: … (stage1.py, line 12) — in all 52 tests``),
    then their first test's detail (what was expected and what came), then ``… and N more
    tests with this error``. A timeout or a crash is a line of its own per test, its
    message (which names the test and where the code was). Past ``limit`` groups, one line
    counts the rest. ``width``: the lines are cut there, so a detail the first line says
    is repeated if the cut would hide it.
    """
    groups = result.failure_groups(shown_kinds(result))
    ran = len(result.by_outcome("passed")) + len(result.failures())

    def said(message: str) -> str:  # the run's own line names the stage; once is enough
        return _STAGE_TAG.sub("", message, count=1)

    lines: list[Text] = []
    for group in groups if limit is None else groups[:limit]:
        first = group[0]
        line = Text("✗ " if first.kind == "assertion" else "! ", style="red bold")
        everywhere = 1 < len(group) == ran
        self_named = first.kind in _SELF_NAMED and first.name in first.message
        detail = first.detail
        if everywhere:
            line.append(said(first.message))
            line.append(f" — in all {len(group)} tests", style="bold")
        elif self_named:
            line.append(said(first.message))
            detail = detail or _where_part(first.message)
        else:
            line.append(first.test_id, style="bold")
            line.append(f" — {said(first.message)}")
        lines.append(line)
        hidden = width is not None and line.cell_len > width
        if detail and (detail not in first.message or hidden):
            lines.append(Text(f"    {detail}"))
        if len(group) > 1 and not everywhere:
            others = [r.test_id for r in group[1:]]
            names = ", ".join(others[:3]) + ("…" if len(others) > 3 else "")
            noun = "test" if len(others) == 1 else "tests"
            lines.append(
                Text(f"  … and {len(others)} more {noun} with this error: {names}", style="dim")
            )
    if limit is not None and len(groups) > limit:
        rest = sum(len(group) for group in groups[limit:])
        lines.append(Text(f"… and {rest} more failing", style="dim"))
    return lines


def crash_line(returncode: int, output: str) -> str | None:
    """One line for a run that a signal ended (``returncode`` negative, as subprocess gives
    it): ``crashed: test_x — the process died of SIGSEGV at stage1.py:16 in div: …``, the
    test and the learner's frame read from the fault handler's dump in ``output`` where it
    has them (:mod:`katas._registry.crashes`). None for a run that exited."""
    if returncode >= 0:
        return None
    return crash_message(dying_test(output), died_of(-returncode), output)


def print_summary(
    out: Console,
    result: SuiteRun,
    kata: Kata,
    stage: Stage,
    *,
    notes: Sequence[str] = (),
    rerun: str | None = None,
) -> None:
    """The learner's view of a run: passed/total and the failures (:func:`failure_lines`).

    ``notes`` qualify the run ("core", "impl solutions"); ``rerun`` is the command whose
    verbose form the learner is pointed to for a failure's details.
    """
    passed = len(result.by_outcome("passed"))
    skipped = len(result.by_outcome("skipped"))
    ran = passed + len(result.failures())
    for line in failure_lines(result):
        out.print(line, soft_wrap=True)
    missing = result.failures("not_implemented")
    if missing:
        names = not_implemented_names(missing)
        shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
        noun = "test" if len(missing) == 1 else "tests"
        out.print(
            Text(f"… {len(missing)} {noun} not implemented yet: {shown}", style="yellow"),
            soft_wrap=True,
        )
    tally = Text(f"{passed}/{ran} passed", style="bold " + ("green" if result.ok else "red"))
    tally.append(result.troubles(), style="red")
    if skipped:
        tally.append(f", {skipped} skipped")
    tally.append(f" in {result.seconds:.1f}s — {kata.name} stage {stage.number}: {stage.title}")
    if notes:
        tally.append(f" ({', '.join(notes)})")
    out.print(tally, soft_wrap=True)
    detailed = result.failures("assertion") + result.failures("error")
    if detailed and rerun:
        out.print(
            f"Details: {rerun} -v -- -k {detailed[0].name}",
            style="dim",
            highlight=False,
            soft_wrap=True,
        )


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
