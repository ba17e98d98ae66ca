"""``kata pair`` end to end: paged notes, keys in the session, the suite, the rubric sheet.

Runs against a tiny kata, ``calc``, made in a temporary folder (``KATA_ROOT``), with
progress in a temporary state directory. The session runs on a ManualClock driven by a
scripted terminal, so a 10-minute interview takes as long as its one suite run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
from _support import (
    CALC_SOLUTION,
    ScriptedTerminal,
    attempts,
    practice_project,
    run_kata,
    write,
)

from katas._cli import cli_pair
from katas._cli.cli import main

#: The marks of the notes' pages in the order the interviewer sees them.
PAGES = [
    "READ_ALOUD_MARK",
    "CLARIFY_MARK",
    "ABOUT_MARK",
    "TIMEBOX_MARK",
    "FOLLOWUP_MARK",
    "LADDER_MARK",
    "asks first",
    "CURVEBALL_MARK",
]


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    return practice_project(tmp_path, monkeypatch)


def _pair(
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    events: Sequence[tuple[float, str | Callable[[], None]]] = (),
    answers: list[str] | None = None,
) -> tuple[int, ScriptedTerminal, str]:
    """Run ``kata pair``; its exit code, the terminal, and everything it printed."""
    printed: list[str] = []

    def screen() -> str:
        printed.append(capsys.readouterr().out)
        return printed[-1]

    code, terminal = run_kata(["pair", *argv], events, answers, screen=screen)
    screen()
    return code, terminal, "".join(printed)


def test_cli_pair_pages_the_notes_then_times_swaps_and_saves_the_rubric_sheet(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    seen: list[str] = []

    def look() -> None:  # what the interviewer sees when the pager waits for a key
        seen.append(capsys.readouterr().out)

    keys = ["\n"] * (len(PAGES) - 1) + ["\n"]  # Enter for each next part, Enter starts the timer
    events: list[tuple[float, str | Callable[[], None]]] = []
    for second, key in enumerate(keys, 1):
        events += [(second - 0.5, look), (second, key)]
    rubric = ["s", "asked about negatives first", "w", "silent for a while"]
    code, terminal, rest = _pair(
        capsys, ["calc", "1", "--minutes", "3", "--swap", "1"], events=events, answers=rubric
    )
    out = "".join(seen) + rest
    assert code == 1, out  # the stub: the candidate's suite did not pass
    # one part per key press, the read-aloud part first, and only it before the first one
    for number, (mark, shown) in enumerate(zip(PAGES, seen, strict=True)):
        assert mark in shown, f"part {number + 1} ({mark}) missing:\n{shown}"
        assert not any(m in shown for m in PAGES[number + 1 :]), shown
    assert "Enter: clarifying questions" in seen[0], seen[0]
    assert "(2 of 8) · s: start the timer" in seen[0], seen[0]
    assert seen[-1].rstrip().endswith("Enter starts the timer"), seen[-1]
    # the timer starts under what to read aloud, printed again
    session = out.split("pairing · calc stage 1")[1]
    assert "READ_ALOUD_MARK" in session and "CLARIFY_MARK" not in session, session
    assert "[01:00] swap 1" in session and "[02:00] swap 2" in session, session
    assert "swap 3" not in session  # the session ends at 03:00
    assert "Time is up" in session and "0/3 passed" in session, session
    axes = [q.split(":")[0] for q in terminal.asked]
    assert axes == ["Problem solving"] * 2 + ["Communication"] * 2
    (attempt,) = attempts(project)
    assert attempt["mode"] == "pair" and attempt["swaps"] == 2 and attempt["seconds"] == 180
    assert attempt["rubric"] == [
        {"axis": "Problem solving", "score": "strong", "evidence": "asked about negatives first"},
        {"axis": "Communication", "score": "weak", "evidence": "silent for a while"},
    ]
    sheet = Path(str(attempt["sheet"])).read_text()
    assert sheet.startswith("# Rubric sheet — calc stage 1"), sheet
    assert "| Problem solving | strong | asked about negatives first |" in sheet
    assert "- suite: 0/3 passed" in sheet and "test_stage1_add" in sheet
    assert "| Communication | narrates | explains | silent |" in sheet


def test_cli_pair_s_starts_the_timer_at_once_and_n_and_p_show_notes_and_prompt_in_the_session(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, terminal, out = _pair(
        capsys,
        ["calc", "1", "--swap", "0"],
        # s after the read-aloud part, with no Enter: straight to the timer
        events=[(1, "s"), (10, "n"), (20, "N"), (30, "p"), (40, "q")],
        answers=[],
    )
    assert code == 1, out
    assert terminal.asked[0].startswith("Problem solving")  # the pager asked no line
    notes, session = out.split("pairing · calc stage 1")
    assert "Enter: clarifying questions" in notes and "Enter starts the timer" not in out
    assert "READ_ALOUD_MARK" in notes and "CLARIFY_MARK" not in notes, notes
    assert "n next note · p the prompt" not in out  # the live line is a terminal's only
    first, second = session.split("notes 1 of 8")[1].split("notes 2 of 8")
    assert "READ_ALOUD_MARK" in first and "CLARIFY_MARK" not in first, session
    assert "CLARIFY_MARK" in second and "PROMPT_MARK" in second.split("prompt · kata show")[1]
    assert "Session ended" in session, session


def test_cli_pair_without_a_terminal_prints_every_note_at_once_and_a_blank_sheet(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, terminal, out = _pair(capsys, ["calc", "1", "--swap", "0"], events=[(60, "q")])
    assert code == 1, out
    notes = out.split("pairing · calc stage 1")[0]
    positions = [notes.index(mark) for mark in PAGES]
    assert positions == sorted(positions), notes
    assert "Enter: clarifying questions" not in out  # nobody to press a key
    assert all(q.startswith(("Problem solving", "Communication")) for q in terminal.asked)
    (attempt,) = attempts(project)
    assert [row["score"] for row in attempt["rubric"]] == ["", ""]


def test_cli_pair_exit_code_is_0_when_the_candidates_suite_passes(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write(project / "katas" / "calc" / "stage1.py", CALC_SOLUTION)
    code, _, out = _pair(capsys, ["calc", "1", "--no-notes", "--swap", "0"], events=[(125, "q")])
    assert code == 0, out
    assert "READ_ALOUD_MARK" not in out and "swap" not in out.lower().replace("--swap", "")
    assert "Session ended" in out and "3/3 passed" in out, out
    (attempt,) = attempts(project)
    assert attempt["result"] == "stopped" and 125 <= float(attempt["seconds"]) <= 126


def test_cli_pair_an_invalid_score_is_asked_again_and_enter_skips(
    project: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cli_pair, "run_suite", _no_suite)
    code, terminal, out = _pair(
        capsys,
        ["calc", "1", "--no-notes", "--swap", "0"],
        events=[(1, "q")],
        answers=["x", "Acc", "asked some", ""],
    )
    assert code == 130, out  # the suite run was interrupted
    assert "'x' is not a score" in out, out
    questions = [q.split("?")[0] for q in terminal.asked]
    assert questions == [
        "Problem solving: strong/acceptable/weak",
        "Problem solving: strong/acceptable/weak",
        "Problem solving: evidence (a line they wrote or said): ",
        "Communication: strong/acceptable/weak",  # Enter: no evidence asked
    ]
    (attempt,) = attempts(project)
    assert attempt["rubric"] == [
        {"axis": "Problem solving", "score": "acceptable", "evidence": "asked some"},
        {"axis": "Communication", "score": "", "evidence": ""},
    ]


def _no_suite(*args: object, **kwargs: object) -> None:
    raise KeyboardInterrupt  # Ctrl-C while the suite runs


def test_cli_pair_help_names_the_keys_and_the_exit_code(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["pair", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "n shows the notes again" in out and "p the candidate's prompt" in out, out
    assert "exit code: 0 the candidate's suite passed, 1 it did not" in out, out
