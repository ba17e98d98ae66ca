"""``kata test``: run a stage's suite once and summarise it; a run of the learner's own
code is recorded as the stage's progress.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from contextlib import ExitStack

from rich.text import Text

from katas._cli.cliutil import (
    Command,
    Context,
    UserError,
    add_kata_stage,
    check_profile,
    display_paths,
    impl_or_error,
    is_learners_code,
    record_run,
    stage_file_or_error,
    suites_or_error,
)
from katas._cli.state import StateError
from katas._cli.summary import crash_line, nothing_selected, print_summary
from katas._registry.catalog import Kata, Stage
from katas._registry.impl import ENV_PROFILE, add_selection_options
from katas._registry.suites import run_suite


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
    crashed = crash_line(result)
    if not result.results:
        if nothing_selected(result):
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


COMMAND = Command(
    "test",
    "run a stage's tests and summarise them",
    "Run the stage's test suite with pytest and summarise it: how many passed, one line "
    "per failure, and which parts are not implemented yet. Arguments after `--` go to "
    "pytest unchanged (e.g. -- -x -k token_bucket).\n\n"
    "exit code: 0 when every selected test passed, 1 otherwise, 2 on bad input",
    _configure_test,
    run_test,
    takes_passthrough=True,
)

__all__ = ["COMMAND", "rerun_argv"]
