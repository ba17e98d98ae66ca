"""``kata review``: the review round — a short series of changes to a stage's reference,
each proposed with a plausible one-line rationale; some are catalogue bugs, some sound
changes (``tests/reviews/``, each proven by the stage suite). The learner approves or
rejects each and, rejecting, names the rule it breaks (``§id``); the score and the right
answers follow, and the round is recorded.

A bug's rules are those its catching tests declare (``@pytest.mark.rule``), read from
one ``--collect-only`` of the stage suite on the reference.
"""

from __future__ import annotations

import argparse
import random

from rich.rule import Rule
from rich.syntax import Syntax
from rich.table import Table
from rich.text import Text

from katas._cli.cli_reveal import common_mistakes
from katas._cli.cliutil import (
    Command,
    Context,
    UserError,
    add_kata_stage,
    impl_or_error,
    suites_or_error,
)
from katas._cli.state import Round, StateError, clock_text
from katas._registry import mutants
from katas._registry.catalog import Kata, Stage
from katas._registry.suites import run_suite
from katas._runtime.clock import NS_PER_S

#: Changes in a round unless ``--changes`` says otherwise; about a third are sound.
DEFAULT_CHANGES = 6
APPROVE = ("a", "approve", "y", "yes")
REJECT = ("r", "reject", "n", "no")
#: How often a question is asked again after an answer it cannot read.
RETRIES = 3


def changes_arg(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 2 <= value <= 20:
        raise argparse.ArgumentTypeError(f"must be a number of changes from 2 to 20, got {text!r}")
    return value


def sound_changes(ctx: Context, kata: Kata, stage: Stage) -> list[mutants.Mutant]:
    """The stage's sound changes (``tests/reviews/<kata>/stageN_*.diff``)."""
    folder = ctx.catalog.project_root / "tests" / "reviews"
    return [m for m in mutants.load_sound(kata.name, folder) if m.stage == stage.number]


def compose(
    bugs: list[mutants.Mutant], sound: list[mutants.Mutant], count: int, rng: random.Random
) -> list[mutants.Mutant]:
    """``count`` changes in a random order: about a third sound (at least one of each kind
    when both exist), the rest bugs, as many as there are."""
    wanted_sound = min(len(sound), max(1, round(count / 3)) if bugs else count)
    wanted_bugs = min(len(bugs), count - wanted_sound)
    wanted_sound = min(len(sound), count - wanted_bugs)
    chosen = rng.sample(bugs, wanted_bugs) + rng.sample(sound, wanted_sound)
    rng.shuffle(chosen)
    return chosen


def rules_of_tests(ctx: Context, kata: Kata, stage: Stage) -> dict[str, set[str]]:
    """Each test of the stage suite (by its name with and without its parameters, and a
    state machine's by its class) and the rule ids it declares, from one
    ``--collect-only`` on the reference."""
    run = run_suite(
        suites_or_error(kata, stage),
        impl=impl_or_error("solutions", ctx),
        pytest_args=["--collect-only"],
        timeout_s=300,
    )
    if not run.rules:
        raise UserError(
            f"{kata.name} stage {stage.number}: its suite could not be collected "
            f"({run.config_error or run.collection_error or f'exit code {run.returncode}'})"
        )
    rules: dict[str, set[str]] = {}
    for nodeid, ids in run.rules.items():
        for name in nodeid.split("::")[1:]:  # a state machine's test is its class's
            for key in (name, name.partition("[")[0]):
                rules.setdefault(key, set()).update(ids)
    return rules


def broken_rules(entry: mutants.Mutant, rules: dict[str, set[str]]) -> set[str]:
    """The rules a catalogue entry breaks: those of the tests that catch it."""
    return {r for test in entry.catches for r in rules.get(test, set())}


class _Stopped(Exception):
    """The terminal gave no answer (end of input): the round stops here."""


def _ask(ctx: Context, question: str, valid: tuple[str, ...] | None) -> str:
    for _ in range(RETRIES):
        answer = ctx.terminal.ask(question)
        if answer is None:
            raise _Stopped
        answer = answer.strip().lower()
        if valid is None or answer in valid:
            return answer
        ctx.out.print(f"  answer one of: {', '.join(valid)}", style="yellow", highlight=False)
    raise _Stopped


def _show(ctx: Context, n: int, total: int, change: mutants.Mutant) -> None:
    ctx.out.print(Rule(f"change {n} of {total}"))
    line = Text("Proposed: ", style="bold")
    line.append(change.rationale)
    ctx.out.print(line)
    ctx.out.print(Syntax(mutants.body(change), "diff", theme="ansi_dark", word_wrap=True))


def run_review(args: argparse.Namespace, ctx: Context) -> int:
    kata = ctx.catalog.get(args.kata)
    return review_round(ctx, kata, args.stage, changes=args.changes, seed=args.seed)


def review_round(
    ctx: Context,
    kata: Kata,
    stage_number: int,
    *,
    changes: int = DEFAULT_CHANGES,
    seed: int | None = None,
    paired: bool = False,
) -> int:
    """One review round (``paired``: run by an interviewer in ``kata pair``, who types
    the candidate's verdicts); its exit code."""
    if not ctx.terminal.interactive:
        raise UserError("a review round asks a question for each change: run it in a terminal")
    stage = kata.stage(stage_number)
    ctx.state()  # an unusable state file stops us before the round starts
    bugs = [e for e in common_mistakes(ctx, kata, stage) if e.rationale and mutants.shows_here(e)]
    sound = sound_changes(ctx, kata, stage)
    if not bugs or not sound:
        raise UserError(
            f"{kata.name} stage {stage.number} has no review material yet "
            f"({len(bugs)} proposed bug(s), {len(sound)} sound change(s))"
        )
    shown = compose(bugs, sound, changes, random.Random(seed))
    ctx.out.print("Preparing the round (reading the stage's rules)…", style="dim")
    rules = rules_of_tests(ctx, kata, stage)
    ctx.out.print(
        f"Review {len(shown)} proposed changes to the reference of {kata.name} stage "
        f"{stage.number}. Approve (a) a change that keeps every rule of the prompt; reject "
        f"(r) one that breaks a rule, and name it (§id: kata show {kata.name} {stage.number} "
        "lists them).",
        highlight=False,
    )
    if paired:
        ctx.out.print(
            "Show each change to the candidate, ask them to think aloud, and type their "
            "verdict and the rule they name; the right answers follow the last change.",
            style="dim",
            highlight=False,
        )
    start_ns = ctx.clock.now_ns()
    started = ctx.wall()
    answers: list[tuple[mutants.Mutant, bool, str]] = []  # (change, approved, rule named)
    result = "done"
    try:
        for n, change in enumerate(shown, 1):
            _show(ctx, n, len(shown), change)
            verdict = _ask(ctx, "approve or reject? [a/r] ", APPROVE + REJECT)
            named = ""
            if verdict in REJECT:
                named = _ask(ctx, "which rule does it break? §id (Enter: skip) ", None)
            answers.append((change, verdict in APPROVE, named.lstrip("§")))
    except _Stopped:
        result = "stopped"
    seconds = (ctx.clock.now_ns() - start_ns) / NS_PER_S
    record = _score(ctx, kata, stage, answers, rules, started, seconds, result)
    record.paired = paired
    try:
        with ctx.store.update() as saved:
            saved.rounds.append(record)
    except StateError as exc:
        ctx.out.print(f"kata: error: this round was not recorded: {exc}", style="red")
    return 0 if result == "done" else 1


def _score(
    ctx: Context,
    kata: Kata,
    stage: Stage,
    answers: list[tuple[mutants.Mutant, bool, str]],
    rules: dict[str, set[str]],
    started: float,
    seconds: float,
    result: str,
) -> Round:
    table = Table(title="the right answers", show_lines=True)
    for column in ("#", "proposed", "yours", "right", "why"):
        table.add_column(column, overflow="fold")
    right = rules_right = rules_asked = 0
    for n, (change, approved, named) in enumerate(answers, 1):
        is_bug = not change.sound
        ok = approved != is_bug
        right += ok
        yours = "approve" if approved else "reject" + (f" §{named}" if named else "")
        if is_bug:
            broken = broken_rules(change, rules)
            answer = "reject" + (f" {' '.join('§' + r for r in sorted(broken))}" if broken else "")
            why = change.bug
            if not approved and broken:
                rules_asked += 1
                rules_right += named in broken
        else:
            answer, why = "approve", change.sound
        mark = "[green]✓[/]" if ok else "[red]✗[/]"
        table.add_row(f"{n} {mark}", change.rationale, yours, answer, why)
    ctx.out.print(table)
    total = len(answers)
    line = f"{right}/{total} verdicts right"
    if rules_asked:
        line += f" · {rules_right}/{rules_asked} rules named right"
    line += f" · {clock_text(int(seconds * NS_PER_S))}"
    if result == "stopped":
        line += " · stopped early"
    ctx.out.print(Text(line, style="bold"), highlight=False)
    return Round(
        mode="review",
        kata=kata.name,
        stage=stage.number,
        entries=[c.name for c, _, _ in answers],
        started=started,
        seconds=seconds,
        result=result,
        verdicts_right=right,
        rules_right=rules_right,
        rules_asked=rules_asked,
    )


def _configure_review(parser: argparse.ArgumentParser) -> None:
    add_kata_stage(parser)
    parser.add_argument(
        "--changes",
        type=changes_arg,
        default=DEFAULT_CHANGES,
        metavar="N",
        help=f"changes in the round ({DEFAULT_CHANGES})",
    )
    parser.add_argument("--seed", type=int, help="draw the same changes again (a number)")


COMMAND = Command(
    "review",
    "a review round: approve or reject proposed changes to a reference",
    "Show a short series of changes to the stage's reference solution, each proposed "
    "with a one-line rationale, as a teammate's pull request or an AI assistant's "
    "suggestion would be. Some are bugs from the classic-bug catalogue, some are sound. "
    "Approve or reject each; rejecting, name the rule of the prompt it breaks (§id). "
    "Then the score and the right answers: for a bug, what it breaks and the rules its "
    "tests check; for a sound change, why it is sound. Recorded in kata progress.\n\n"
    "exit code: 0 done, 1 stopped early, 2 bad input, 130 Ctrl-C",
    _configure_review,
    run_review,
)

__all__ = [
    "COMMAND",
    "DEFAULT_CHANGES",
    "broken_rules",
    "compose",
    "review_round",
    "rules_of_tests",
    "sound_changes",
]
