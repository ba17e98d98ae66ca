"""Interview mode (``kata start KATA N --interview``): the questions a learner types are
answered as the interviewer's notes say, and the attempt records what was asked when.

The matcher is measured on ``tests/interview/asked.toml``: how candidates phrase each
clarifying question of every real stage (and questions no row answers), written from the
notes by someone who saw neither the matcher nor the notes' hidden phrasings. Sessions run
on the tiny ``calc`` kata on a ManualClock (scripted keys and answers), and once in a real
terminal (tmux).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from _support import (
    CALC_SOLUTION,
    Tmux,
    attempts,
    practice_project,
    run_kata,
    state_file,
    write,
)

from katas._cli.asking import QuestionMatcher
from katas._cli.cli import main
from katas._cli.state import Asked, Attempt, Interview
from katas._registry import catalog as cat
from katas._registry.impl import REPO_ROOT
from katas._registry.notes import clarifying_questions, curveballs

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ASKED = Path(__file__).parent / "interview" / "asked.toml"

#: What the matcher must reach on the phrasings written blind: the share of questions a
#: row answers that get that row's answer; of those, the share answered as another row;
#: the share of questions no row answers that get the stock answer.
RIGHT_AT_LEAST = 0.82
WRONG_AT_MOST = 0.09
STOCK_AT_LEAST = 0.70
#: Other phrasings (``<!-- also: … -->``) each clarifying question has in INTERVIEWER.md.
ALSO_AT_LEAST = 3


def _real_stages() -> Iterator[tuple[cat.Kata, cat.Stage, str]]:
    for kata in cat.Catalog(REPO_ROOT / "katas").katas():
        text = kata.interviewer.read_text(encoding="utf-8")
        for stage in kata.stages:
            yield kata, stage, text


def test_the_matcher_answers_phrasings_written_blind_as_the_notes_do() -> None:
    probes = tomllib.loads(ASKED.read_text(encoding="utf-8"))["asked"]
    by_stage: dict[tuple[str, int], list[dict[str, str]]] = defaultdict(list)
    for probe in probes:
        by_stage[(probe["kata"], probe["stage"])].append(probe)
    right, wrong, stock, answerable, unanswerable = 0, 0, 0, 0, 0
    misses: list[str] = []
    for kata, stage, text in _real_stages():
        questions = clarifying_questions(text, stage.section)
        matcher = QuestionMatcher(questions)
        texts = {q.text for q in questions}
        for probe in by_stage.pop((kata.name, stage.number), []):
            means = probe["means"] or None
            assert means is None or means in texts, (
                f"{ASKED.name}: {probe['text']!r} means {means!r}, which is no longer a "
                f"clarifying question of {kata.name} stage {stage.number}: update the file"
            )
            found = matcher.match(probe["text"])
            got = found.text if found else None
            answerable += means is not None
            unanswerable += means is None
            right += means is not None and got == means
            wrong += means is not None and got is not None and got != means
            stock += means is None and got is None
            if got != means:
                misses.append(f"{kata.name} {stage.number}: {probe['text']!r} → {got!r}")
    assert not by_stage, f"{ASKED.name} names stages that do not exist: {sorted(by_stage)}"
    report = (
        f"right {right}/{answerable}, answered as another row {wrong}/{answerable}, stock "
        f"answer {stock}/{unanswerable}; some of what it got wrong (asked → answered as):\n  "
        + "\n  ".join(misses[:12])
    )
    assert right >= RIGHT_AT_LEAST * answerable, report
    assert wrong <= WRONG_AT_MOST * answerable, report
    assert stock >= STOCK_AT_LEAST * unanswerable, report


def test_every_clarifying_question_has_other_phrasings_and_every_stage_a_curveball() -> None:
    """A new row without ``<!-- also: … -->`` is matched on its own words only."""
    short: list[str] = []
    for kata, stage, text in _real_stages():
        for question in clarifying_questions(text, stage.section):
            if len(question.also) < ALSO_AT_LEAST or "<!--" in question.text:
                short.append(f"{kata.name} {stage.number}: {question.text!r} ({question.also})")
        assert curveballs(text, stage.section), f"{kata.name} {stage.number}: no curveball"
    assert not short, (
        f"clarifying questions in INTERVIEWER.md with fewer than {ALSO_AT_LEAST} other "
        "phrasings (`<!-- also: a; b; c -->` at the end of the question's cell):\n  "
        + "\n  ".join(short)
    )


def test_an_interview_record_round_trips_and_says_what_was_asked_when() -> None:
    record = Interview(
        asked=[
            Asked("below zero?", "negatives?", 12.0, before_first_run=True),
            Asked("sky colour?", None, 20.0, before_first_run=True),
            Asked("overflow?", "overflow?", 90.0, before_first_run=False),
        ],
        key=["negatives?", "overflow?", "division?"],
        prompt_opened_seconds=30.5,
        curveball="- now divide",
    )
    assert record.key_asked(before_first_run=True) == ["negatives?"]
    assert record.key_asked(before_first_run=False) == ["negatives?", "overflow?"]
    assert record.key_missed() == ["division?"]
    attempt = Attempt("calc", 1, "interview", 1.0, 60.0, 10.0, 50.0, "green", 3, 3)
    attempt.interview = record
    again = Attempt.from_json(json.loads(json.dumps(attempt.to_json())))
    assert again.interview == record and again.to_json() == attempt.to_json()
    odd = {**attempt.to_json(), "interview": "hand-edited"}  # kept as the file had it
    assert Attempt.from_json(odd).to_json()["interview"] == "hand-edited"


# --- the session --------------------------------------------------------------------------


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    return practice_project(tmp_path, monkeypatch)


def _solve(project: Path) -> Callable[[], None]:
    return lambda: write(project / "katas" / "calc" / "stage1.py", CALC_SOLUTION)


def test_an_interview_answers_records_and_ends_with_what_was_missed(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    events: list[tuple[float, str | Callable[[], None]]] = [
        (5, "?"),
        (8, "?"),
        (9, "?"),
        (20, "p"),
        (25, "r"),
        (40, "?"),
        (60, _solve(project)),
    ]
    answers = [
        "can the numbers be below zero",  # a key question, in other words
        "what colour should the output be",  # no row answers it
        "   ",  # an empty question: nothing asked
        "which python version",  # after the first run; not key
        "n",  # green: no going on to the extended part
        "s",
        "asked before coding",
        "w",
        "",
    ]
    code, _ = run_kata(["start", "calc", "1", "--interview"], events, answers)
    out = capsys.readouterr().out
    assert code == 0, out
    intro = out.split("· attempt 1 ·")[0]  # read aloud, not the prompt's summary
    assert "READ_ALOUD_MARK" in intro and "STAGE1_MARK" not in intro, intro
    assert "(heard as: CLARIFY_MARK: negative numbers?)" in out and "Yes." in out, out
    assert "Your call: state your assumption" in out and "No question asked." in out, out
    assert "PROMPT_MARK" in out, out  # p: the whole prompt
    assert "1 of 2 asked before your first run" in out, out
    assert "✓ CLARIFY_MARK: negative numbers?" in out, out
    assert "✗ What happens on integer overflow? (never asked)" in out, out
    assert "Python ints do not overflow." in out, out  # a missed question's answer
    assert "You opened the whole prompt at 00:20." in out, out
    assert "CURVEBALL_MARK" in out and "asks first" in out, out  # curveball; the rubric
    (attempt,) = attempts(project)
    assert attempt["mode"] == "interview" and attempt["result"] == "green", attempt
    record = attempt["interview"]
    assert [(a["means"], a["before_first_run"]) for a in record["asked"]] == [
        ("CLARIFY_MARK: negative numbers?", True),
        (None, True),
        ("Which Python version?", False),
    ], record
    assert record["prompt_opened_seconds"] == 20.0 and "CURVEBALL_MARK" in record["curveball"]
    assert attempt["rubric"] == [
        {"axis": "Problem solving", "score": "strong", "evidence": "asked before coding"},
        {"axis": "Communication", "score": "weak", "evidence": ""},
    ], attempt
    code, _ = run_kata(["progress"])
    shown = capsys.readouterr().out
    assert "interview green" in shown and "1/2 key" in shown, shown
    assert "What happens on integer overflow?" in shown and "at 00:20" in shown, shown
    assert "s w" in shown, shown  # the self-assessment


def test_an_interview_never_runs_before_the_learner_does(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _ = run_kata(["start", "calc", "1", "--interview", "--minutes", "1"], [(30, "q")])
    out = capsys.readouterr().out
    assert code == 1 and "passed" not in out.split("Attempt stopped")[0], out
    (attempt,) = attempts(project)
    assert attempt["runs"] == 0 and attempt["interview"]["asked"] == [], attempt


def test_interview_bad_input_is_one_line(project: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _ = run_kata(["start", "calc", "1", "--interview", "--unit", "adding"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "leave out --unit" in err, err
    notes = project / "katas" / "calc" / "INTERVIEWER.md"
    text = notes.read_text(encoding="utf-8")
    write(notes, text.replace("### Read aloud", "### Aloud, read"))
    code, _ = run_kata(["start", "calc", "1", "--interview"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "nothing to read aloud" in err, err
    assert not state_file(project).exists()


def test_kata_ask_answers_and_counts_for_the_interview_in_progress(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["ask", "calc", "1", "can", "numbers", "be", "below", "zero"]) == 0
    out = capsys.readouterr().out
    assert "(heard as: CLARIFY_MARK: negative numbers?)" in out and "Yes." in out, out
    assert "Recorded" not in out, out  # no interview runs

    def asked_elsewhere() -> None:  # kata ask in another terminal, while the clock runs
        assert main(["ask", "calc", "1", "what about integer overflow"]) == 0

    events: list[tuple[float, str | Callable[[], None]]] = [
        (5, asked_elsewhere),
        (30, _solve(project)),
    ]
    code, _ = run_kata(["start", "calc", "1", "--interview"], events, ["n"])
    out = capsys.readouterr().out
    assert code == 0 and "Recorded with the interview in progress." in out, out
    assert "✓ What happens on integer overflow?" in out, out
    (attempt,) = attempts(project)
    (asked,) = attempt["interview"]["asked"]
    assert asked["means"] == "What happens on integer overflow?" and asked["before_first_run"]
    assert main(["ask", "calc", "1", "what about integer overflow"]) == 0  # it is over
    assert "Recorded" not in capsys.readouterr().out
    killed = subprocess.Popen(["true"])  # an interview whose process is gone
    killed.wait()
    write(state_file(project).parent / "interview" / "calc-stage1.live", str(killed.pid))
    assert main(["ask", "calc", "1", "what about integer overflow"]) == 0
    assert "Recorded" not in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["ask", "calc", "1", "  "], "the question is empty"),
        (["ask", "calc", "1"], "the question is empty"),
        (["ask", "nope", "1", "why?"], "nope"),
        (["ask", "calc", "9", "why?"], "9"),
    ],
)
def test_kata_ask_bad_input_is_one_line(
    project: Path, capsys: pytest.CaptureFixture[str], argv: list[str], says: str
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err, err


def test_a_corrupted_state_file_stops_an_interview_before_its_clock(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write(state_file(project), "{not json")
    code, _ = run_kata(["start", "calc", "1", "--interview"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert state_file(project).read_text() == "{not json"


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not on PATH")
def test_tmux_an_interview_asks_two_opens_the_prompt_goes_green_and_shows_it(
    project: Path, tmp_path: Path
) -> None:
    tmux = Tmux(project, tmp_path, "start calc 1 --interview --poll 0.2")
    try:
        tmux.wait_for("READ_ALOUD_MARK", "? ask · p the prompt")
        tmux.press("?")
        tmux.wait_for("Your question")
        tmux.press("is a minus number allowed")
        tmux.press("Enter")
        tmux.wait_for("(heard as: CLARIFY_MARK: negative numbers?)")
        tmux.press("?")  # typed at once, before the question's prompt shows: nothing lost
        tmux.press("what font size is the output")
        tmux.press("Enter")
        tmux.wait_for("Your call: state your assumption")
        tmux.press("p")
        tmux.wait_for("PROMPT_MARK")
        _solve(project)()
        tmux.wait_for("green in", "with the whole suite? [y/N]")
        tmux.press("Enter")
        tmux.wait_for("Problem solving: strong/acceptable/weak?")
        for key in ("a", "Enter", "Enter", "s", "Enter", "Enter"):  # score, no evidence
            tmux.press(key)
        shown = tmux.wait_for("KATA_EXIT=0")
        assert "✓ CLARIFY_MARK: negative numbers?" in shown, shown
        assert "✗ What happens on integer overflow? (never asked)" in shown, shown
        assert "You opened the whole prompt at" in shown, shown
    finally:
        tmux.close()
    (attempt,) = attempts(project)
    assert attempt["mode"] == "interview" and len(attempt["interview"]["asked"]) == 2, attempt
    assert [row["score"] for row in attempt["rubric"]] == ["acceptable", "strong"], attempt


def test_a_green_solo_attempt_names_the_interview_rounds_of_its_stage(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _ = run_kata(["start", "calc", "1"], [(10, _solve(project))], ["n"])
    out = " ".join(capsys.readouterr().out.split())
    assert code == 0, out
    assert "kata start calc 1 --interview · kata debug calc 1 · kata review calc 1" in out, out
