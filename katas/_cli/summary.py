"""The learner's view of a suite run: the tally, one line per failure (alike ones once),
what is not implemented yet, and an expected/got line cut where the values differ.

``kata test``, ``kata start``, ``kata pair`` and ``kata bench`` all tell a run this way;
everything comes from the plugin's report (:class:`~katas._registry.suites.SuiteRun`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from rich.console import Console
from rich.text import Text

from katas._cli.cliutil import Context
from katas._cli.practice import verdict
from katas._cli.state import clock_text
from katas._registry.catalog import Kata, Stage
from katas._registry.crashes import crash_message, died_of, dying_test
from katas._registry.impl import NOT_IMPLEMENTED
from katas._registry.suites import SuiteRun, TestResult


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


def crash_line(result: SuiteRun) -> str | None:
    """One line for a run that a signal ended (its exit code negative, as subprocess gives
    it): ``crashed: test_x — the process died of SIGSEGV at stage1.py:16 in div: …``, the
    test and the learner's frame read from the fault handler's dump in ``output`` where it
    has them (:mod:`katas._registry.crashes`). None for a run that exited."""
    if result.returncode >= 0:
        return None
    return crash_message(dying_test(result.output), died_of(-result.returncode), result.output)


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


def nothing_selected(result: SuiteRun) -> bool:
    """Whether the run selected no test at all (``-m core`` with no core test, a unit's
    ``-k`` matching none): the plugin's list of collected tests is empty. A run shown live
    has no such list (pytest writes to the terminal), so its exit code says it."""
    if result.results or result.collection_error:
        return False
    return result.selected == 0 if result.selected is not None else result.returncode == 5


# --- a line cut where it differs ---------------------------------------------------------------

#: One compared pair of a failure's detail: ``expected X, got Y`` (several, as ``field:
#: expected X, got Y`` apart by "; "), pytest's ``X != Y`` and ``assert X == Y``.
_COMPARED = (
    re.compile(r"expected (?P<expected>.+?), got (?P<got>.+?)(?=; [\w.\[\]]+: expected |$)"),
    re.compile(r"(?P<got>[^\s:][^:]*?) != (?P<expected>.+)$"),
    re.compile(r"^\s*assert (?P<got>.+?) == (?P<expected>.+)$"),
)
#: Characters kept before the first difference of a pair, so it reads in context.
CONTEXT_CHARS = 12


def _common_length(one: str, other: str) -> int:
    """How many characters ``one`` and ``other`` have alike from the start."""
    pairs = zip(one, other, strict=False)
    return next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(one), len(other)))


def show_difference(line: str, width: int) -> str:
    """``line`` fitted into ``width`` so that each compared pair shows where it differs.

    A line that fits stays as it is. Otherwise each expected and got value starts a few
    characters before their first difference ("…" for the common part left out) and is
    cut, with "…", to its share of the room: the differing characters stay in sight, not
    behind the end of the screen.
    """
    if len(line) <= width:
        return line
    pairs: list[re.Match[str]] = []
    for pattern in _COMPARED:
        pairs = list(pattern.finditer(line))
        if pairs:
            break
    if not pairs:
        return line
    values = sum(len(pair["expected"]) + len(pair["got"]) for pair in pairs)
    room = max(2 * CONTEXT_CHARS, (width - (len(line) - values)) // (2 * len(pairs)))
    pieces: list[str] = []
    done = 0
    for pair in pairs:
        same = _common_length(pair["expected"], pair["got"])
        start = same - CONTEXT_CHARS if same > CONTEXT_CHARS + 1 else 0
        for name in sorted(("expected", "got"), key=pair.start):
            value = pair[name]
            shown = "…" + value[start:] if start else value
            pieces += [
                line[done : pair.start(name)],
                shown[: room - 1] + "…" if len(shown) > room else shown,
            ]
            done = pair.end(name)
    return "".join(pieces) + line[done:]


def _showing_difference(line: Text, width: int) -> Text:
    """A plain line (a failure's detail) through :func:`show_difference`; a styled one
    (a failure's first line, its detail repeated below it when cut) as it is."""
    return line if line.spans else Text(show_difference(line.plain, width), style=line.style)


def print_failing_lines(ctx: Context, result: SuiteRun, limit: int = 3) -> None:
    """The first few real failures (alike ones once), then the not-implemented ones."""
    width = max(20, ctx.out.width - 2)
    for line in failure_lines(result, limit=limit, width=width):
        # A detail (indented) wraps: an expected/got pair is already cut around where it
        # differs, and a compiler's error line must show whole.
        detail = line.plain.startswith("    ")
        ctx.out.print(
            Text("  ") + _showing_difference(line, width),
            overflow="fold" if detail else "ellipsis",
            no_wrap=not detail,
        )
    missing = result.failures("not_implemented")
    if missing:
        names = not_implemented_names(missing)
        shown = ", ".join(names[:6]) + ("…" if len(names) > 6 else "")
        ctx.out.print(
            Text(f"  … {len(missing)} not implemented yet: {shown}", style="yellow"),
            overflow="ellipsis",
            no_wrap=True,
        )


def show_run(ctx: Context, result: SuiteRun, elapsed_ns: int) -> None:
    """A finished run of a timed session: one line (``[mm:ss] 3/4 passed in 1.2s``, or how
    the process died), then its first few failures."""
    out = ctx.out
    line = Text(f"[{clock_text(elapsed_ns)}] ", style="dim")
    crashed = None if result.results else crash_line(result)
    if crashed:  # the process died: no test reported, so no tally either
        line.append(crashed, style="bold red")
    else:
        line.append(verdict(result), style="bold " + ("green" if result.ok else "red"))
    line.append(f"{', after' if crashed else ' in'} {result.seconds:.1f}s")
    if result.not_run and not crashed:
        line.append(" (a runs them all)", style="dim")
    out.print(line, overflow="ellipsis", no_wrap=True)
    if crashed:
        return  # its one line says all there is
    if result.results:
        if not result.ok:
            print_failing_lines(ctx, result)
    elif result.collection_error:
        error = Text("  ! ", style="red bold")
        error.append(result.collection_error)
        error.append(" — pytest could not collect the suite", style="dim")
        out.print(error, overflow="ellipsis", no_wrap=True)
    elif nothing_selected(result):
        out.print("  No tests were selected.", style="yellow", highlight=False)
    elif result.run_error:
        out.print(Text(f"  ! {result.run_error}", style="red"))


__all__ = [
    "SHOWN_KINDS",
    "crash_line",
    "failure_lines",
    "not_implemented_names",
    "nothing_selected",
    "print_failing_lines",
    "print_summary",
    "show_difference",
    "show_run",
]
