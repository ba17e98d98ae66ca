"""The ``kata`` command: list, show and test the katas described by kata.toml files, and
practise them — timed attempts, hints, pairing sessions, progress.

Everything a kata-specific command needs comes from :mod:`katas._registry.catalog`, so a new
kata needs no change here. Each subcommand is a :class:`Command` (its arguments and a
``run`` function returning the exit code) in :data:`COMMANDS`; ``start`` lives in
:mod:`katas._cli.cli_start`, ``pair`` in :mod:`katas._cli.cli_pair`, ``hint``, ``reveal``,
``reset``, ``bench`` and ``progress`` in :mod:`katas._cli.cli_study`. A stage suite runs through
:func:`katas._registry.suites.run_suite`, which prints nothing, so timed practice and watching
reuse it. Progress lives in the user's state directory (:mod:`katas._cli.state`).
Exit codes: 0 success (for ``test``: every selected test passed), 1 tests failed or
could not run, 2 bad input (including an unusable state file), 130 interrupted.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import textwrap
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import NoReturn

from rich import box
from rich.console import Console
from rich.markdown import Markdown
from rich.table import Table
from rich.text import Text

from katas._cli import cli_coderpad, cli_pair, cli_start, cli_study
from katas._cli.cliutil import (
    Command,
    Context,
    UserError,
    add_kata,
    add_kata_stage,
    check_profile,
    crash_line,
    display_paths,
    impl_or_error,
    is_learners_code,
    markdown_sections,
    print_summary,
    read_text,
    record_run,
    shorten,
    stage_file_or_error,
    stage_number,
    stage_prompt,
    suites_or_error,
)
from katas._cli.practice import clock_text
from katas._cli.state import ENV_STATE_DIR, State, StateError, StateStore, stage_key
from katas._cli.terminal import Terminal
from katas._registry.catalog import ENV_ROOT, Catalog, CatalogError, Kata, Stage, display_path
from katas._registry.impl import ENV_IMPL, ENV_PROFILE, add_selection_options
from katas._registry.suites import run_suite
from katas._runtime.clock import NS_PER_S, Clock

# --- the parser --------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line, not a usage block."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


# --- kata list: the catalogue and where the learner is -----------------------------------

#: The terminal width from which ``kata list`` also shows each stage's core part.
WIDE = 120
#: The least room the core part gets in the wide layout (before the titles get all they want).
CORE_MIN = 40
_GAP = 2  # spaces between columns
_STATUS_STYLE = {"passed": "green", "failing": "red", "reset": "yellow", "not started": "dim"}


def _best_text(state: State, kata: Kata, stage: Stage) -> str:
    seconds = state.best_seconds(kata.name, stage.number)
    return "—" if seconds is None else clock_text(int(seconds * NS_PER_S))


def catalog_table(
    katas: Sequence[Kata],
    state: State,
    *,
    width: int = 80,
    mark: tuple[str, int] | None = None,
) -> Table:
    """One line per kata stage: number, title, timebox, your status, best time, attempts.

    Each kata starts with a line of its name (and, when wide, its summary). From
    :data:`WIDE` columns the stage's core part is a column too. Titles and core parts are
    shortened to fit ``width`` (``kata show`` prints them whole). ``mark`` (kata, stage),
    the stage in progress or the next one, gets a "▸".
    """
    wide = width >= WIDE
    rows: list[list[str]] = []  # number, title, timebox, [core,] status, best, attempts
    for kata in katas:
        for stage in kata.stages:
            number = ("▸" if mark == (kata.name, stage.number) else "") + str(stage.number)
            rows.append(
                [
                    number,
                    stage.title,
                    f"{stage.timebox_minutes} min",
                    *([stage.core] if wide else []),
                    state.status(kata.name, stage.number),
                    _best_text(state, kata, stage),
                    str(len(state.attempts_of(kata.name, stage.number))),
                ]
            )
    headers = ["#", "stage", "time", *(["core part"] if wide else []), "status", "best", "attempts"]
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    fixed = [i for i in range(len(headers)) if headers[i] not in ("stage", "core part")]
    room = max(10, width - sum(widths[i] for i in fixed) - _GAP * (len(headers) - 1))
    title_width = min(widths[1], max(room - CORE_MIN, room // 2)) if wide else room
    core_width = room - title_width

    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True)
    for header in headers:
        table.add_column(
            header,
            justify="right" if header in ("#", "time", "best", "attempts") else "left",
            no_wrap=True,
            overflow="ellipsis",
        )
    rows_iter = iter(rows)
    for kata in katas:
        about = [Text(shorten(kata.summary, core_width), style="dim")] if wide else []
        table.add_row("", Text(kata.name, style="bold"), "", *about, "", "", "")
        for _ in kata.stages:
            row = next(rows_iter)
            cells: list[str | Text] = [row[0], shorten(row[1], title_width), row[2]]
            if wide:
                cells.append(Text(shorten(row[3], core_width), style="dim"))
            status = row[-3]
            cells += [Text(status, style=_STATUS_STYLE.get(status, "")), row[-2], row[-1]]
            table.add_row(*cells)
    return table


@dataclass(frozen=True)
class WhereAmI:
    """The learner's position: stages green, the stage in progress, what to run next."""

    summary: str  # "3 of 9 stages green · in progress: rate_limiter 2 (failing, 4/9 passed)"
    command: str  # "kata start rate_limiter 2"
    why: str  # what follows the command on its line: " · core: …", ", then kata start …"
    stage: tuple[Kata, Stage] | None  # the stage in progress, or the one to do next


def where_am_i(katas: Sequence[Kata], state: State) -> WhereAmI:
    """Where the learner is, from the recorded progress.

    The stage in progress is the one worked on last (a run, an attempt, a reset) that is
    not green now: carry on with it. Without one, the next stage is the one after the
    stage that went green last, else the first one not green: read its prompt, then time
    yourself. Once everything is green: a timed attempt at the stage never timed, or the
    slowest one.
    """
    stages = [(kata, stage) for kata in katas for stage in kata.stages]
    if not stages:
        return WhereAmI("no stages yet", "kata --help", "", None)
    green = [state.green(k.name, s.number) for k, s in stages]
    head = f"{sum(green)} of {len(stages)} stages green"
    when = [state.last_activity(k.name, s.number) for k, s in stages]
    # the stages worked on, the latest first (on a tie, the earlier stage first)
    touched = sorted(
        (i for i in range(len(stages)) if when[i] is not None),
        key=lambda i: (when[i], -i),
        reverse=True,
    )
    in_progress = [i for i in touched if not green[i]]
    if in_progress:
        kata, stage = stages[in_progress[0]]
        return WhereAmI(
            f"{head} · in progress: {kata.name} {stage.number} ({_how_far(state, kata, stage)})",
            f"kata start {kata.name} {stage.number}",
            f" · core: {stage.core}",
            (kata, stage),
        )
    if all(green):
        timed = [(state.best_seconds(k.name, s.number), i) for i, (k, s) in enumerate(stages)]
        never = [i for seconds, i in timed if seconds is None]
        index = never[0] if never else max(timed, key=lambda t: t[0] or 0.0)[1]
        kata, stage = stages[index]
        best = _best_text(state, kata, stage)
        return WhereAmI(
            f"{head} — all done. With a friend: kata pair KATA STAGE",
            f"kata start {kata.name} {stage.number}",
            " (green, never timed)" if never else f" (beat your slowest best, {best})",
            (kata, stage),
        )
    index = green.index(False)
    last_green = [i for i in touched if green[i]][:1]
    if last_green and last_green[0] + 1 < len(stages):
        after = last_green[0] + 1
        if stages[after][0] is stages[after - 1][0] and not green[after]:
            index = after  # the next stage of the kata that went green last
    kata, stage = stages[index]
    newcomer = not touched and not state.attempts
    return WhereAmI(
        f"{head} · new here: begin with the first stage's prompt"
        if newcomer
        else f"{head} · next: {kata.name} {stage.number}",
        f"kata show {kata.name} {stage.number}",
        f", then kata start {kata.name} {stage.number} ({stage.timebox_minutes} min)",
        (kata, stage),
    )


def _how_far(state: State, kata: Kata, stage: Stage) -> str:
    """``failing, 4/9 passed`` or ``reset to the stub``: the state of a stage in progress."""
    status = state.status(kata.name, stage.number)
    if status == "reset":
        return "reset to the stub"
    result = state.results.get(stage_key(kata.name, stage.number), {})
    passed, total = result.get("passed"), result.get("total")
    if isinstance(passed, int) and isinstance(total, int) and total:
        return f"{status}, {passed}/{total} passed"
    return status


def print_where_am_i(ctx: Context, katas: Sequence[Kata], state: State) -> WhereAmI:
    """The catalogue table, then where the learner is and the command to run next."""
    where = where_am_i(katas, state)
    mark = (where.stage[0].name, where.stage[1].number) if where.stage else None
    ctx.out.print(catalog_table(katas, state, width=ctx.out.width, mark=mark))
    ctx.out.print()
    _one_line(ctx, Text(where.summary, style="bold"))
    line = Text("Next: ")
    line.append(where.command, style="bold cyan")
    room = ctx.out.width - len(line)
    line.append(shorten(where.why, room) if room > 10 else "")
    _one_line(ctx, line)
    return where


def _one_line(ctx: Context, text: Text | str, style: str = "") -> None:
    """Print ``text`` on one line, shortened with "…" to the terminal's width."""
    ctx.out.print(text, style=style, no_wrap=True, overflow="ellipsis", highlight=False)


def run_list(args: argparse.Namespace, ctx: Context) -> int:
    katas = ctx.catalog.katas()
    if not katas:
        raise UserError(f"no katas found: no */kata.toml under {display_path(ctx.catalog.root)}")
    print_where_am_i(ctx, katas, ctx.state())
    _one_line(ctx, "Also: kata show|test|hint KATA STAGE · kata progress (your history)", "dim")
    return 0


def run_overview(args: argparse.Namespace, ctx: Context) -> int:
    """``kata`` alone: ``kata list``, and where to find every command."""
    code = run_list(args, ctx)
    ctx.out.print("Every command: kata --help", style="dim", highlight=False)
    return code


# --- kata show ---------------------------------------------------------------------------


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


# --- kata test ---------------------------------------------------------------------------


def rerun_argv(args: argparse.Namespace, kata: Kata, stage: Stage) -> list[str]:
    """``kata test`` with the options that chose what a run tested (impl, base, core, thorough)."""
    argv = ["kata", "test", kata.name, str(stage.number)]
    if args.impl:
        argv += ["--impl", args.impl]
    if args.base:
        argv += ["--base", args.base]
    argv += ["--unit", args.unit] if args.unit else []
    argv += ["--core"] * args.core + ["--thorough"] * args.thorough
    return argv


def run_test(args: argparse.Namespace, ctx: Context) -> int:
    kata = ctx.catalog.get(args.kata)
    stage = kata.stage(args.stage)
    unit = stage.unit(args.unit) if args.unit else None  # its -k selects its tests alone
    impl = impl_or_error(args.impl, ctx)
    if not args.thorough:  # --thorough sets the profile itself
        check_profile()
    suites = suites_or_error(kata, stage)
    if is_learners_code(args.impl):
        stage_file_or_error(kata, stage)
    with ExitStack() as stack:
        if not args.verbose:  # pytest's output is kept for the summary; show that it runs
            stack.enter_context(ctx.out.status(f"Running {kata.name} stage {stage.number}…"))
        result = run_suite(
            suites,
            impl=impl,
            base=args.base,
            keyword=unit.keyword if unit else None,
            core_only=args.core,
            thorough=args.thorough,
            pytest_args=ctx.passthrough,
            live=args.verbose,
            cache=True,  # the learner's own runs: `-- --lf` reruns what failed last
            timeout_s=None,
        )
    if result.returncode == 4:  # pytest's usage error: bad pass-through arguments
        errors = [
            ln.split("error:", 1)[-1].strip() for ln in result.output.splitlines() if "error:" in ln
        ]
        raise UserError(
            f"pytest rejected the arguments after --: {(errors or ['see pytest --help'])[-1]}"
        )
    if result.config_error:  # nothing the learner's code can fix: exit code 2, one line
        raise UserError(result.config_error)
    crashed = crash_line(result.returncode, result.output)
    if not result.results:
        if result.returncode == 5:
            ctx.out.print("No tests were selected.", style="yellow", highlight=False)
        elif crashed:  # a signal ended pytest before it reported: one line, never "0/0"
            ctx.out.print(
                Text("! ", style="red bold")
                + Text(crashed)
                + Text(" — no test was reported; the ones after it did not run", style="dim"),
                soft_wrap=True,
            )
        else:  # one line for why (a syntax error with its line), the whole output with -v
            why = result.collection_error or result.run_error
            if result.output and (args.verbose or why is None):
                ctx.out.print(Text(result.output.rstrip()))
            said = f"pytest could not run {display_paths(suites)} (exit code {result.returncode})"
            if result.collection_error:
                said += f": {result.collection_error}"
            elif result.run_error:  # it says "pytest could not run the suite" itself
                said = result.run_error
            ctx.out.print(
                said
                + ("." if why is None else "")
                + (
                    ""
                    if args.verbose or why is None
                    else f" Details: {shlex.join(rerun_argv(args, kata, stage))} -v"
                ),
                style="red",
                highlight=False,
                soft_wrap=True,
            )
        return 1
    notes = [
        f"impl {args.impl}" if args.impl else "",
        f"base {args.base}" if args.base else "",
        f"unit {unit.name}: {unit.file}" if unit else "",
        "core" if args.core else "",
        "thorough" if args.thorough else "",
    ]
    # "Details:" reruns this very selection, verbosely, for the first failure. The summary
    # appends "-v -- -k TEST" to the command, so with arguments after -- it is built here.
    rerun = rerun_argv(args, kata, stage)
    plain = not args.verbose and not ctx.passthrough
    notes = [n for n in notes if n]
    print_summary(
        ctx.out, result, kata, stage, notes=notes, rerun=shlex.join(rerun) if plain else None
    )
    detailed = result.failures("assertion") + result.failures("error")
    if detailed and ctx.passthrough and not args.verbose:
        details = shlex.join([*rerun, "-v", "--", *ctx.passthrough, "-k", detailed[0].name])
        ctx.out.print(f"Details: {details}", style="dim", highlight=False, soft_wrap=True)
    if crashed:  # a signal ended the run after some tests were reported
        ctx.out.print(Text("! ", style="red bold") + Text(crashed), soft_wrap=True)
    elif result.returncode not in (0, 1) and result.output:  # e.g. a collection error
        ctx.out.print(Text(result.output.rstrip()))
    # (a unit's run is not the stage's: the progress file keeps one result a stage)
    if is_learners_code(args.impl) and not ctx.passthrough and not args.base and not unit:
        try:  # the learner's own full or core run: progress `kata list` shows
            record_run(ctx, kata, stage, result)
        except StateError as exc:
            print(f"kata test: warning: not recorded: {exc}", file=sys.stderr)
    return 0 if result.ok else 1


def _configure_test(parser: argparse.ArgumentParser) -> None:
    add_kata_stage(parser)
    add_selection_options(parser.add_argument)
    parser.add_argument(
        "--core", action="store_true", help="only the core tests (what the timebox is for)"
    )
    parser.add_argument(
        "--unit",
        metavar="NAME",
        help="only the tests of one unit of the stage, practised alone (kata show lists "
        "them, e.g. a C hot path and the Python around it)",
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
    add_kata(parser)
    parser.add_argument(
        "stage",
        metavar="STAGE",
        type=stage_number,
        nargs="?",
        help="only the introduction and this stage's section",
    )


COMMANDS: tuple[Command, ...] = (
    Command(
        "list",
        "list the katas and their stages",
        "List every kata stage: its title, timebox and the core part the timebox is for, "
        "with your progress: status (not started, failing, passed), best time to green "
        "and number of attempts.",
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
    *cli_start.COMMANDS,
    *cli_pair.COMMANDS,
    *cli_study.COMMANDS,
    *cli_coderpad.COMMANDS,
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
        "  kata test rate_limiter 1 --impl solutions -- -x\n"
        "  kata start rate_limiter 1 --minutes 30\n"
        "  kata pair rate_limiter 2 --swap 15\n\n"
        f"environment:\n  {ENV_ROOT}     the folder of katas (default: the checkout you are in)\n"
        f"  {ENV_IMPL}     the default --impl\n"
        f"  {ENV_PROFILE}  hypothesis profile: dev (default), ci or thorough\n"
        f"  {ENV_STATE_DIR} where progress is kept (default: "
        "$XDG_STATE_HOME/infra-katas, else ~/.local/state/infra-katas)",
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


def main(
    argv: Sequence[str] | None = None,
    *,
    clock: Clock | None = None,
    terminal: Terminal | None = None,
    wall: Callable[[], float] | None = None,
) -> int:
    """Run the ``kata`` command; return its exit code.

    ``clock`` (integer nanoseconds), ``terminal`` and ``wall`` (epoch seconds) replace the
    real ones, so tests run timed sessions without waiting.
    """
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
    if args.command is None:  # where the learner is, and where the commands are
        args.command, args.run = "list", run_overview
    if passthrough and not args.takes_passthrough:
        print(f"kata {args.command}: error: takes no arguments after --", file=sys.stderr)
        return 2
    try:
        ctx = Context(Catalog.discover(), Console(highlight=False), passthrough, StateStore())
        if clock is not None:
            ctx.clock = clock
        if terminal is not None:
            ctx.terminal = terminal
        if wall is not None:
            ctx.wall = wall
        code: int = args.run(args, ctx)
        return code
    except (CatalogError, UserError, StateError) as exc:
        print(f"kata {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kata: interrupted", file=sys.stderr)
        return 130


__all__ = ["COMMANDS", "Command", "Context", "UserError", "main", "markdown_sections"]

if __name__ == "__main__":
    sys.exit(main())
