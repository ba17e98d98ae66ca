"""``kata debug``: the debugging round — a working copy of a stage's reference with one
catalogue bug in it (two with ``--bugs 2``), an incident report instead of the bug's
name, and a timer; solved when the copy passes the whole stage suite again.

The copy lives in the state directory, never among the learner's files. Entries are
drawn so that none repeats before every entry of the kata was drawn, and within that
the stages the learner has passed come first. ``kata debug --reveal`` shows the last
round's entries once it is over.
"""

from __future__ import annotations

import argparse
import difflib
import random
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

from rich.rule import Rule
from rich.syntax import Syntax
from rich.text import Text

from katas._cli.cli_reveal import common_mistakes
from katas._cli.cli_sessions import NS_PER_MIN, SessionRuns, minutes_arg, poll_seconds
from katas._cli.cliutil import (
    Command,
    Context,
    UserError,
    add_stage,
    check_profile,
    impl_or_error,
    suites_or_error,
)
from katas._cli.practice import SoloOutcome, SoloSession
from katas._cli.state import Round, StateError, clock_text
from katas._cli.summary import show_run
from katas._cli.watch import Watcher
from katas._registry import mutants
from katas._registry.catalog import Kata, Stage, display_path
from katas._registry.suites import SuiteProcess, SuiteRun
from katas._runtime.clock import NS_PER_S

#: The timebox of a round unless ``--minutes`` says otherwise.
DEFAULT_MINUTES = 30.0
#: What the round's copy may be edited in: these files count for "lines changed".
_SOURCE_SUFFIXES = (".py", ".c", ".h", ".lua")


# --- drawing the entries -----------------------------------------------------------------


def draw_order(
    entries: Sequence[mutants.Mutant], drawn: dict[str, int], passed: set[int], rng: random.Random
) -> list[mutants.Mutant]:
    """``entries`` in the order a round takes them: the least drawn first (so none repeats
    before every one was drawn), of a passed stage before the others, at random among
    equals."""

    def rank(entry: mutants.Mutant) -> tuple[int, bool]:
        return drawn.get(entry.name, 0), entry.stage not in passed

    shuffled = list(entries)
    rng.shuffle(shuffled)
    return sorted(shuffled, key=rank)  # stable: random among equals


# --- the working copy --------------------------------------------------------------------


def _sources(tree: Path) -> dict[str, list[str]]:
    """Every source file under ``tree`` (relative path -> lines)."""
    found: dict[str, list[str]] = {}
    for path in sorted(tree.rglob("*")):
        if path.suffix in _SOURCE_SUFFIXES and path.is_file():
            try:
                found[str(path.relative_to(tree))] = path.read_text().splitlines()
            except (OSError, UnicodeDecodeError):
                continue
    return found


def lines_changed(before: dict[str, list[str]], tree: Path) -> int:
    """Lines added or removed in ``tree``'s sources since ``before``."""
    after = _sources(tree)
    count = 0
    for name in before.keys() | after.keys():
        for line in difflib.unified_diff(before.get(name, []), after.get(name, []), n=0):
            if line.startswith(("+", "-")) and not line.startswith(("+++", "---")):
                count += 1
    return count


def lay_out(ctx: Context, kata: Kata, stage: Stage, entries: list[mutants.Mutant]) -> Path:
    """A fresh copy of the kata's references with ``entries`` applied, under the state
    directory: ``debug/<kata>-stage<N>-<k>``."""
    folder = ctx.store.directory / "debug"
    folder.mkdir(parents=True, exist_ok=True)
    k = 1
    while (folder / f"{kata.name}-stage{stage.number}-{k}").exists():
        k += 1
    dest = folder / f"{kata.name}-stage{stage.number}-{k}"
    staging = Path(tempfile.mkdtemp(prefix=".laying-", dir=folder))
    try:
        tree = staging / "impl"
        _copy_kata(ctx, kata, tree)
        for entry in entries:
            mutants.apply(entry, tree)
        tree.rename(dest)  # whole or not at all
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return dest


def _pick(
    ctx: Context, kata: Kata, stage_number: int | None, bugs: int, seed: int | None
) -> tuple[Stage, list[mutants.Mutant]]:
    """The round's stage and entries: the first in :func:`draw_order`, and with ``bugs``
    2 the next of its stage whose diff applies on top of it."""
    state = ctx.state()
    stages = [kata.stage(stage_number)] if stage_number is not None else list(kata.stages)
    entries = [e for s in stages for e in common_mistakes(ctx, kata, s) if mutants.shows_here(e)]
    if not entries:
        where = f"stage {stage_number} of {kata.name}" if stage_number else kata.name
        raise UserError(f"{where} has no catalogue entry this machine can run a round of")
    passed = {s.number for s in kata.stages if state.passed(kata.name, s.number)}
    order = draw_order(entries, state.times_drawn(kata.name), passed, random.Random(seed))
    chosen = [order[0]]
    for entry in order[1:]:
        if len(chosen) == bugs:
            break
        if entry.stage == chosen[0].stage and _apply_together(ctx, kata, [*chosen, entry]):
            chosen.append(entry)
    if len(chosen) < bugs:
        raise UserError(
            f"{kata.name} stage {chosen[0].stage}: no second catalogue entry applies "
            f"together with the first; try --bugs 1"
        )
    return kata.stage(chosen[0].stage), chosen


def _copy_kata(ctx: Context, kata: Kata, tree: Path) -> None:
    """The references of ``kata`` alone (the other katas' stay unseen), laid out as
    ``solutions/`` is: ``tree/<kata>/``, and the package's own top-level files."""
    solutions = ctx.catalog.project_root / "solutions"
    mutants.copy_solutions(solutions / kata.name, tree / kata.name)
    for path in solutions.glob("*.py"):
        shutil.copy2(path, tree / path.name)


def _apply_together(ctx: Context, kata: Kata, entries: list[mutants.Mutant]) -> bool:
    with tempfile.TemporaryDirectory(prefix="kata-debug-") as tmp:
        tree = Path(tmp) / "impl"
        _copy_kata(ctx, kata, tree)
        try:
            for entry in entries:
                mutants.apply(entry, tree)
        except ValueError:
            return False
    return True


# --- the round ---------------------------------------------------------------------------


class DebugSession:
    """One round: the copy, its suite runs (the whole stage suite, stopping at the first
    failure after a save), and what :class:`~katas._cli.practice.SoloSession` reports."""

    def __init__(
        self, ctx: Context, kata: Kata, stage: Stage, entries: list[mutants.Mutant], copy: Path
    ) -> None:
        self.ctx, self.kata, self.stage, self.entries, self.copy = ctx, kata, stage, entries, copy
        self.suites = suites_or_error(kata, stage)
        self.impl = impl_or_error(str(copy), ctx)
        self.start = _sources(copy)
        self.hints = 0
        self.runs: SessionRuns  # from run()

    def start_run(self, whole: bool) -> SuiteProcess:
        return self.runs.start(self.suites, impl=self.impl, whole=whole, core_only=False)

    def on_result(self, result: SuiteRun, elapsed_ns: int) -> None:
        if result.config_error:  # nothing a fix in the copy can change
            raise UserError(result.config_error)
        show_run(self.ctx, result, elapsed_ns)

    def on_hint(self) -> None:
        """First where the bug is (its files), then how many lines the planted change
        spans; the lines themselves wait for ``kata debug --reveal``."""
        self.hints += 1
        files = sorted({f for e in self.entries for f in mutants.touched_files(e)})
        if self.hints == 1:
            where = ", ".join(str(self.copy / f) for f in files)
            self.ctx.out.print(f"Hint: look in {where}", highlight=False)
        else:
            changed = sum(len(mutants.changed_lines(e)) for e in self.entries)
            self.ctx.out.print(
                f"Hint: the planted change spans {changed} line(s) of the reference (removed "
                "or added); no more hints — kata debug --reveal shows it once the round ends.",
                highlight=False,
            )

    def run(self, timebox_ns: int, poll_ns: int) -> SoloOutcome:
        self.runs = SessionRuns("kata-debug-")
        try:
            return SoloSession(
                clock=self.ctx.clock,
                terminal=self.ctx.terminal,
                console=self.ctx.out,
                timebox_ns=timebox_ns,
                watcher=Watcher([self.copy]),
                start_run=self.start_run,
                on_result=self.on_result,
                on_hint=self.on_hint,
                title=f"debugging {self.kata.name} stage {self.stage.number}",
                poll_ns=poll_ns,
            ).run()
        finally:
            self.runs.close()


def _incident(ctx: Context, kata: Kata, stage: Stage, entries: list[mutants.Mutant]) -> None:
    out = ctx.out
    out.print(Rule(f"incident · {kata.name} stage {stage.number} · {stage.title}"))
    for n, entry in enumerate(entries, 1):
        label = f"Report {n}: " if len(entries) > 1 else "Report: "
        line = Text(label, style="bold")
        line.append(entry.symptom or "the stage's suite fails on this build; find out why.")
        out.print(line)


def run_debug(args: argparse.Namespace, ctx: Context) -> int:
    if args.reveal:
        return _reveal(ctx)
    if args.kata is None:
        raise UserError("name a kata: kata debug KATA [STAGE] (or kata debug --reveal)")
    return debug_round(
        ctx,
        ctx.catalog.get(args.kata),
        args.stage,
        bugs=args.bugs,
        seed=args.seed,
        minutes=args.minutes or DEFAULT_MINUTES,
        poll_s=args.poll,
    )


def debug_round(
    ctx: Context,
    kata: Kata,
    stage_number: int | None,
    *,
    bugs: int = 1,
    seed: int | None = None,
    minutes: float = DEFAULT_MINUTES,
    poll_s: float = 0.25,
    paired: bool = False,
) -> int:
    """One debugging round (``paired``: run by an interviewer in ``kata pair``, who also
    sees what was planted); its exit code."""
    check_profile()
    stage, entries = _pick(ctx, kata, stage_number, bugs, seed)
    copy = lay_out(ctx, kata, stage, entries)
    session = DebugSession(ctx, kata, stage, entries, copy)
    timebox_ns = int(minutes * NS_PER_MIN)
    _incident(ctx, kata, stage, entries)
    who = "The candidate finds it and fixes it" if paired else "Find it and fix it"
    ctx.out.print(
        f"A build of {kata.name} stage {stage.number} is in {copy} (the kata's references, "
        f"with the fault somewhere in them). {who} there: "
        f"every save re-runs the stage suite on the copy. Solved when every test passes "
        f"again. Keys: r run now, a run all, h hint, q give up. Timebox "
        f"{clock_text(timebox_ns)}.",
        highlight=False,
    )
    if paired:
        ctx.out.print(Rule("for the interviewer only: what was planted"))
        for entry in entries:
            show_entry(ctx, entry)
        ctx.out.print(Rule())
    started = ctx.wall()
    outcome = session.run(timebox_ns, int(poll_s * NS_PER_S))
    result = "solved" if outcome.green_ns is not None else outcome.result
    record = Round(
        mode="debug",
        kata=kata.name,
        stage=stage.number,
        entries=[e.name for e in entries],
        copy=str(copy),
        started=started,
        seconds=(outcome.green_ns or outcome.elapsed_ns) / NS_PER_S,
        result=result,
        runs=outcome.runs,
        lines_changed=lines_changed(session.start, copy),
        hints_used=session.hints,
        paired=paired,
    )
    _tell_the_end(ctx, record)
    try:
        with ctx.store.update() as state:
            state.rounds.append(record)
    except StateError as exc:
        ctx.out.print(f"kata: error: this round was not recorded: {exc}", style="red")
    if outcome.result == "interrupted":
        return 130
    return 0 if record.solved else 1


def _tell_the_end(ctx: Context, record: Round) -> None:
    at = clock_text(int((record.seconds or 0) * NS_PER_S))
    if record.solved:
        ctx.out.print(
            Text(
                f"✓ solved in {at}: {record.runs} run(s), {record.lines_changed} line(s) changed",
                style="bold green",
            )
        )
    else:
        ctx.out.print(f"Round over ({record.result}) after {at}, not solved.", highlight=False)
    ctx.out.print("What it was: kata debug --reveal", style="dim", highlight=False)


def _reveal(ctx: Context) -> int:
    rounds = [r for r in ctx.state().rounds if r.mode == "debug"]
    if not rounds:
        raise UserError("no debugging round yet: kata debug KATA starts one")
    last = rounds[-1]
    root = ctx.catalog.project_root / "tests" / "mutants"
    ctx.out.print(
        Rule(f"{last.kata} stage {last.stage}: {last.result} · {display_path(Path(last.copy))}")
    )
    for name in last.entries:
        path = root / f"{name}.diff"
        try:
            entry = mutants.parse(path)
        except (OSError, ValueError):
            ctx.out.print(f"{name}: the entry is no longer in the catalogue", style="yellow")
            continue
        show_entry(ctx, entry)
    return 0


def show_entry(ctx: Context, entry: mutants.Mutant) -> None:
    """A catalogue entry in full: the bug, why it matters, its diff, the tests that catch it."""
    line = Text("The bug: ", style="bold")
    line.append(entry.bug)
    ctx.out.print(line)
    ctx.out.print(Text(f"Why it matters: {entry.why}"))
    ctx.out.print(Syntax(mutants.body(entry), "diff", theme="ansi_dark", word_wrap=True))
    ctx.out.print(f"The tests that catch it: {', '.join(entry.catches)}", style="dim")


def _configure_debug(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("kata", metavar="KATA", nargs="?", help="kata name, as in `kata list`")
    add_stage(parser, optional=True)
    parser.add_argument(
        "--bugs", type=int, choices=[1, 2], default=1, help="bugs planted at once (1)"
    )
    parser.add_argument(
        "--minutes", type=minutes_arg, metavar="N", help=f"the timebox ({DEFAULT_MINUTES:g})"
    )
    parser.add_argument(
        "--seed", type=int, help="fix the random choice among equally drawn entries"
    )
    parser.add_argument(
        "--poll", type=poll_seconds, default=0.25, metavar="SECONDS", help=argparse.SUPPRESS
    )
    parser.add_argument("--reveal", action="store_true", help="show what the last round's bug was")


COMMAND = Command(
    "debug",
    "a debugging round: find and fix a planted bug from an incident report",
    "Lay out a copy of a stage's reference solution with one bug from the classic-bug "
    "catalogue planted in it (two with --bugs 2), outside your own files, and show the "
    "incident as a user or an on-call engineer would report it — never the bug's name. "
    "Every save in the copy re-runs the stage suite on it; the round is solved when the "
    "whole suite passes, and the time, the runs and the lines you changed are recorded "
    "(kata progress). Without a STAGE the entry comes from a stage you have passed, when "
    "there is one; no entry repeats before every entry of the kata was drawn. Afterwards "
    "kata debug --reveal shows the entry.\n\n"
    "exit code: 0 solved, 1 not solved, 2 bad input, 130 Ctrl-C",
    _configure_debug,
    run_debug,
)

__all__ = ["COMMAND", "debug_round", "draw_order", "lay_out", "lines_changed", "show_entry"]
