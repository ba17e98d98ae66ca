"""The ``kata`` command: ``list``, ``show`` and ``test`` the katas described by kata.toml files.

Everything a kata-specific command needs comes from :mod:`katas._kit.catalog`, so a new
kata needs no change here. Each subcommand is a :class:`Command` (its arguments and a
``run`` function returning the exit code) in :data:`COMMANDS`; a stage suite runs through
:func:`katas._kit.suites.run_suite`, which prints nothing, so timed practice and watching
can reuse it. Exit codes: 0 success (for ``test``: every selected
test passed), 1 tests failed or could not run, 2 bad input, 130 interrupted.
"""

from __future__ import annotations

import argparse
import re
import sys
import textwrap
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

from rich import box
from rich.console import Console
from rich.markdown import Markdown
from rich.table import Table
from rich.text import Text

from katas._kit.catalog import (
    ENV_ROOT,
    Catalog,
    CatalogError,
    Kata,
    Stage,
    display_path,
)
from katas._kit.impl import ENV_IMPL, ENV_PROFILE, NOT_IMPLEMENTED
from katas._kit.suites import SuiteRun, TestResult, resolve_impl, run_suite


class UserError(Exception):
    """Bad input: reported as one line on stderr, exit code 2."""


# --- the parser --------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line, not a usage block."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


def _stage_number(text: str) -> int:
    """``2`` or ``stage2``."""
    match = re.fullmatch(r"(?:stage)?\s*(\d+)", text.strip(), re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"STAGE must be a stage number like 1, got {text!r}")
    return int(match.group(1))


@dataclass
class Context:
    """What every subcommand gets besides its arguments."""

    catalog: Catalog
    out: Console
    passthrough: list[str] = field(default_factory=list)  # the arguments after ``--``


@dataclass(frozen=True)
class Command:
    """One subcommand: how it reads its arguments and what it does."""

    name: str
    summary: str  # one line, in ``kata --help``
    description: str  # the top of ``kata NAME --help``
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace, Context], int]
    takes_passthrough: bool = False  # accepts ``-- extra args``


def _add_kata(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "kata", metavar="KATA", help="kata name, as in `kata list` (e.g. rate_limiter)"
    )


# --- kata list ---------------------------------------------------------------------------

#: An extra ``kata list`` column: a header and the cell for one stage (status, best time …).
StageColumn = tuple[str, Callable[[Kata, Stage], str]]


def catalog_table(katas: Sequence[Kata], extra_columns: Sequence[StageColumn] = ()) -> Table:
    """One row per kata stage: title, timebox, core part (and any ``extra_columns``)."""
    table = Table(box=box.SIMPLE_HEAD, show_lines=False, pad_edge=False)
    table.add_column("kata", style="bold", no_wrap=True)
    table.add_column("stage", justify="right", no_wrap=True)
    table.add_column("title")
    table.add_column("timebox", justify="right", no_wrap=True)
    table.add_column("core part")
    for header, _ in extra_columns:
        table.add_column(header)
    for kata in katas:
        for stage in kata.stages:
            first = stage.number == 1
            last = stage is kata.stages[-1]
            table.add_row(
                kata.name if first else "",
                str(stage.number),
                stage.title,
                f"{stage.timebox_minutes} min",
                stage.core,
                *(cell(kata, stage) for _, cell in extra_columns),
                end_section=last,
            )
    return table


def run_list(args: argparse.Namespace, ctx: Context) -> int:
    katas = ctx.catalog.katas()
    if not katas:
        raise UserError(f"no katas found: no */kata.toml under {display_path(ctx.catalog.root)}")
    ctx.out.print(catalog_table(katas))
    ctx.out.print(
        "prompt: kata show KATA [STAGE] · tests: kata test KATA STAGE [--core]",
        style="dim",
        highlight=False,
    )
    return 0


# --- kata show ---------------------------------------------------------------------------

_HEADING = re.compile(r"^(#{1,2})\s+(.*?)\s*#*\s*$")
_FENCE = re.compile(r"^\s*(```|~~~)")


def markdown_sections(text: str) -> list[tuple[str | None, str]]:
    """Split at level-1/2 headings (outside code fences): ``(heading or None, chunk)``."""
    chunks: list[tuple[str | None, list[str]]] = [(None, [])]
    fence: str | None = None
    for line in text.splitlines(keepends=True):
        marker = _FENCE.match(line)
        if marker:
            fence = None if fence == marker.group(1) else fence or marker.group(1)
        heading = _HEADING.match(line) if fence is None else None
        if heading:
            chunks.append((heading.group(2), [line]))
        else:
            chunks[-1][1].append(line)
    return [(title, "".join(lines)) for title, lines in chunks]


def _is_section(heading: str | None, section: str) -> bool:
    """``## Stage 1`` and ``## Stage 1 — Single-threaded`` are "Stage 1"; ``Stage 10`` is not."""
    if heading is None or not heading.lower().startswith(section.lower()):
        return False
    rest = heading[len(section) :]
    return not rest or not rest[0].isalnum()


def stage_prompt(text: str, kata: Kata, stage: Stage, source: Path) -> str:
    """The prompt's introduction (everything before the first stage section) and ``stage``'s."""
    sections = markdown_sections(text)
    stage_headings = [s.section for s in kata.stages]
    intro: list[str] = []
    for heading, chunk in sections:
        if any(_is_section(heading, name) for name in stage_headings):
            break
        intro.append(chunk)
    mine = [chunk for heading, chunk in sections if _is_section(heading, stage.section)]
    if not mine:
        raise UserError(f"{display_path(source)} has no '## {stage.section}' section")
    return "".join(intro).rstrip() + "\n\n" + "".join(mine)


def _read(path: Path, what: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"{display_path(path)} does not exist yet ({what})") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{display_path(path)}: cannot read: {exc}") from None


def run_show(args: argparse.Namespace, ctx: Context) -> int:
    kata = ctx.catalog.get(args.kata)
    stage = kata.stage(args.stage) if args.stage is not None else None
    text = _read(kata.prompt, f"the prompt of {kata.name}")
    if stage is not None:
        text = stage_prompt(text, kata, stage, kata.prompt)
    ctx.out.print(Markdown(text))
    if stage is not None:
        footer = Text(f"\nStage {stage.number} · timebox {stage.timebox_minutes} min · core: ")
        footer.append(stage.core)
        if stage.extended:
            footer.append(f" · extended: {stage.extended}")
        footer.append(f"\nRun its tests: kata test {kata.name} {stage.number} [--core]")
        ctx.out.print(footer, style="dim")
    return 0


# --- kata test ---------------------------------------------------------------------------


def _not_implemented_names(failures: Sequence[TestResult]) -> list[str]:
    """``TokenBucket.try_acquire`` from "not implemented yet: TokenBucket.try_acquire — …"."""
    names: dict[str, None] = {}
    for failure in failures:
        text = failure.message.removeprefix(NOT_IMPLEMENTED).strip()
        match = re.match(r"[A-Za-z_][\w.]*", text)
        names[match.group(0) if match else text or "?"] = None
    return list(names)


def print_summary(
    out: Console,
    result: SuiteRun,
    kata: Kata,
    stage: Stage,
    *,
    notes: Sequence[str] = (),
    rerun: str | None = None,
) -> None:
    """The learner's view of a run: passed/total and one line per failure.

    ``notes`` qualify the run ("core", "impl solutions"); ``rerun`` is the command whose
    verbose form the learner is pointed to for a failure's details.
    """
    passed = len(result.by_outcome("passed"))
    skipped = len(result.by_outcome("skipped"))
    ran = passed + len(result.failures())
    for failure in result.failures("assertion") + result.failures("error"):
        line = Text("✗ " if failure.kind == "assertion" else "! ", style="red bold")
        line.append(failure.test_id, style="bold")
        line.append(f" — {failure.message}")
        out.print(line, soft_wrap=True)
    missing = result.failures("not_implemented")
    if missing:
        names = _not_implemented_names(missing)
        shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
        noun = "test" if len(missing) == 1 else "tests"
        out.print(
            Text(f"… {len(missing)} {noun} not implemented yet: {shown}", style="yellow"),
            soft_wrap=True,
        )
    tally = Text(f"{passed}/{ran} passed", style="bold " + ("green" if result.ok else "red"))
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


def run_test(args: argparse.Namespace, ctx: Context) -> int:
    kata = ctx.catalog.get(args.kata)
    stage = kata.stage(args.stage)
    try:
        impl = resolve_impl(args.impl, ctx.catalog.root)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    suite = kata.suite_path(stage)
    if not suite.is_file():
        raise UserError(
            f"{display_path(suite)} does not exist (the suite of {kata.name} stage "
            f"{stage.number}, named in {display_path(kata.manifest)})"
        )
    with ExitStack() as stack:
        if not args.verbose:  # pytest's output is kept for the summary; show that it runs
            stack.enter_context(ctx.out.status(f"Running {kata.name} stage {stage.number}…"))
        result = run_suite(
            suite,
            impl=impl,
            base=args.base,
            core_only=args.core,
            thorough=args.thorough,
            pytest_args=ctx.passthrough,
            live=args.verbose,
            cache=True,  # the learner's own runs: `-- --lf` reruns what failed last
            timeout_s=None,
        )
    rerun = f"kata test {kata.name} {stage.number}" + (f" --impl {args.impl}" if args.impl else "")
    if result.returncode == 4:  # pytest's usage error: bad pass-through arguments
        errors = [
            ln.split("error:", 1)[-1].strip() for ln in result.output.splitlines() if "error:" in ln
        ]
        raise UserError(
            f"pytest rejected the arguments after --: {(errors or ['see pytest --help'])[-1]}"
        )
    if not result.results:
        if result.returncode == 5:
            ctx.out.print("No tests were selected.", style="yellow", highlight=False)
        else:
            if result.output:
                ctx.out.print(Text(result.output.rstrip()))
            ctx.out.print(
                f"pytest could not run {display_path(suite)} (exit code {result.returncode}).",
                style="red",
                highlight=False,
            )
        return 1
    notes = [
        f"impl {args.impl}" if args.impl else "",
        "core" if args.core else "",
        "thorough" if args.thorough else "",
    ]
    print_summary(
        ctx.out,
        result,
        kata,
        stage,
        notes=[n for n in notes if n],
        rerun=None if args.verbose else rerun,
    )
    if result.returncode not in (0, 1) and result.output:  # e.g. a collection error
        ctx.out.print(Text(result.output.rstrip()))
    return 0 if result.ok else 1


def _configure_test(parser: argparse.ArgumentParser) -> None:
    _add_kata(parser)
    parser.add_argument("stage", metavar="STAGE", type=_stage_number, help="stage number (1, 2, 3)")
    parser.add_argument(
        "--impl",
        metavar="katas|solutions|PATH",
        help="what to test: your working copy 'katas' (default; env KATA_IMPL), the reference "
        "'solutions', or a directory laid out like solutions/",
    )
    parser.add_argument(
        "--base",
        choices=["own", "reference"],
        help="earlier stages come from the tested implementation (own, default) or from the "
        "reference solutions",
    )
    parser.add_argument(
        "--core", action="store_true", help="only the core tests (what the timebox is for)"
    )
    parser.add_argument(
        "--thorough",
        action="store_true",
        help=f"run property tests with many more examples ({ENV_PROFILE}=thorough; slow)",
    )
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="show pytest's own output as it runs (tracebacks, falsifying examples)",
    )


# --- the command table and main ----------------------------------------------------------


def _configure_show(parser: argparse.ArgumentParser) -> None:
    _add_kata(parser)
    parser.add_argument(
        "stage",
        metavar="STAGE",
        type=_stage_number,
        nargs="?",
        help="only the introduction and this stage's section",
    )


COMMANDS: tuple[Command, ...] = (
    Command(
        "list",
        "list the katas and their stages",
        "List every kata stage: its title, timebox and the core part the timebox is for.",
        lambda parser: None,
        run_list,
    ),
    Command(
        "show",
        "print a kata's prompt",
        "Print the kata's prompt (its README.md); with STAGE, the introduction and that "
        "stage's section only.",
        _configure_show,
        run_show,
    ),
    Command(
        "test",
        "run a stage's tests and summarise them",
        "Run the stage's test suite with pytest and summarise it: how many passed, one line "
        "per failure, and which parts are not implemented yet. Arguments after `--` go to "
        "pytest unchanged (e.g. -- -x -k token_bucket).\n\n"
        "exit code: 0 when every selected test passed, 1 otherwise, 2 on bad input",
        _configure_test,
        run_test,
        takes_passthrough=True,
    ),
)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kata",
        description="Practise systems-coding katas: read a prompt, implement a stage, run its "
        "tests.",
        epilog="examples:\n"
        "  kata list\n"
        "  kata show rate_limiter 1\n"
        "  kata test rate_limiter 1 --core\n"
        "  kata test rate_limiter 1 --impl solutions -- -x\n\n"
        f"environment:\n  {ENV_ROOT}     the folder of katas (default: the checkout you are in)\n"
        f"  {ENV_IMPL}     the default --impl\n"
        f"  {ENV_PROFILE}  hypothesis profile: dev (default), ci or thorough",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for command in COMMANDS:
        p = sub.add_parser(
            command.name,
            help=command.summary,
            description="\n\n".join(
                textwrap.fill(p, 78) for p in command.description.split("\n\n")
            ),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        command.configure(p)
        if command.takes_passthrough:
            usage = p.format_usage().removeprefix("usage: ").rstrip()
            p.usage = f"{usage} [-- PYTEST_ARGS ...]"
        p.set_defaults(run=command.run, takes_passthrough=command.takes_passthrough)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``kata`` command; return its exit code."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    passthrough: list[str] = []
    if "--" in args_list:
        cut = args_list.index("--")
        args_list, passthrough = args_list[:cut], args_list[cut + 1 :]
    parser = build_parser()
    try:
        args = parser.parse_args(args_list)
    except SystemExit as exc:  # --help, or a usage error already reported in one line
        return exc.code if isinstance(exc.code, int) else 2
    if args.command is None:
        parser.print_help()
        return 0
    if passthrough and not args.takes_passthrough:
        print(f"kata {args.command}: error: takes no arguments after --", file=sys.stderr)
        return 2
    try:
        ctx = Context(Catalog.discover(), Console(highlight=False), passthrough)
        code: int = args.run(args, ctx)
        return code
    except (CatalogError, UserError) as exc:
        print(f"kata {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kata: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
