"""``kata list`` (and ``kata`` alone): the catalogue of kata stages with the learner's
progress, where they are and the command to run next.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from rich import box
from rich.table import Table
from rich.text import Text

from katas._cli.cliutil import Command, Context, UserError, shorten
from katas._cli.state import Practice
from katas._registry.catalog import Kata, display_path

#: The terminal width from which ``kata list`` also shows each stage's core part.
WIDE = 120
#: The least room the core part gets in the wide layout (before the titles get all they want).
CORE_MIN = 40
_GAP = 2  # spaces between columns
_STATUS_STYLE = {"passed": "green", "failing": "red", "reset": "yellow", "not started": "dim"}


def catalog_table(
    katas: Sequence[Kata],
    state: Practice,
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
                    state.best_text(kata.name, stage.number),
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


def print_where_am_i(ctx: Context, katas: Sequence[Kata], state: Practice) -> None:
    """The catalogue table, then where the learner is and the command to run next."""
    where = state.where(katas)
    mark = (where.stage[0].name, where.stage[1].number) if where.stage else None
    ctx.out.print(catalog_table(katas, state, width=ctx.out.width, mark=mark))
    ctx.out.print()
    _one_line(ctx, Text(where.summary, style="bold"))
    line = Text("Next: ")
    line.append(where.command, style="bold cyan")
    room = ctx.out.width - len(line)
    line.append(shorten(where.why, room) if room > 10 else "")
    _one_line(ctx, line)


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


COMMAND = Command(
    "list",
    "list the katas and their stages",
    "List every kata stage: its title, timebox and the core part the timebox is for, "
    "with your progress: status (not started, failing, passed), best time to green "
    "and number of attempts.",
    lambda parser: None,
    run_list,
)

__all__ = ["COMMAND", "catalog_table", "print_where_am_i", "run_overview"]
