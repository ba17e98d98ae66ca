"""The ``kata`` command: list, show and test the katas described by kata.toml files, and
practise them — timed attempts, hints, pairing sessions, progress.

Everything a kata-specific command needs comes from :mod:`katas._registry.catalog`, so a new
kata needs no change here. Each subcommand is a :class:`Command` (its arguments and a
``run`` function returning the exit code), the ``COMMAND`` of a module of its own
(``kata start`` in :mod:`katas._cli.cli_start`, and so on); this module holds the parser
and :func:`main`. What the verbs share: :mod:`katas._cli.cliutil` (the context, arguments,
the checks before a run), :mod:`katas._cli.summary` (the learner's view of a run),
:mod:`katas._cli.cli_sessions` (timed sessions), :mod:`katas._cli.practice` (their loops)
and :mod:`katas._cli.state` (the progress, in the user's state directory). A stage suite
runs through :func:`katas._registry.suites.run_suite`, which prints nothing.
Exit codes: 0 success (for ``test``: every selected test passed), 1 tests failed or
could not run, 2 bad input (including an unusable state file), 130 interrupted.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections.abc import Callable, Sequence
from typing import NoReturn

from rich.console import Console

from katas._cli import (
    cli_ask,
    cli_bench,
    cli_coderpad,
    cli_debug,
    cli_hint,
    cli_list,
    cli_pair,
    cli_progress,
    cli_reset,
    cli_reveal,
    cli_review,
    cli_show,
    cli_start,
    cli_test,
)
from katas._cli.cliutil import Command, Context, UserError, markdown_sections
from katas._cli.state import ENV_STATE_DIR, StateError, StateStore
from katas._cli.terminal import Terminal
from katas._registry.catalog import ENV_ROOT, Catalog, CatalogError
from katas._registry.impl import ENV_IMPL, ENV_PROFILE
from katas._runtime.clock import Clock

# --- the parser --------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line, not a usage block."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


# --- the command table and main ----------------------------------------------------------

#: Every subcommand, in the order ``kata --help`` lists them.
COMMANDS: tuple[Command, ...] = (
    cli_list.COMMAND,
    cli_show.COMMAND,
    cli_test.COMMAND,
    cli_start.COMMAND,
    cli_ask.COMMAND,
    cli_pair.COMMAND,
    cli_hint.COMMAND,
    cli_reveal.COMMAND,
    cli_reset.COMMAND,
    cli_debug.COMMAND,
    cli_review.COMMAND,
    cli_bench.COMMAND,
    cli_progress.COMMAND,
    cli_coderpad.COMMAND,
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
        "  kata pair rate_limiter 2 --swap 15\n"
        "  kata debug rate_limiter\n"
        "  kata review rate_limiter 2\n\n"
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
        args.command, args.run = "list", cli_list.run_overview
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
