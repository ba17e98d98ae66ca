"""``kata debug``: a round lays out a bugged copy of the reference outside the learner's
files, reports the incident (never the bug), re-runs the stage suite on the copy until it
passes, records time, runs and lines changed; ``--reveal`` shows the entry afterwards;
entries never repeat before every one was drawn, passed stages first.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from _support import (
    CALC_ADD_OFF_BY_ONE,
    CALC_SOLUTION,
    CALC_SUB_SWAPPED,
    practice_project,
    run_kata,
    state,
    write,
)

from katas._cli.cli import main
from katas._cli.cli_debug import draw_order
from katas._registry import mutants

NEEDS_CLUSTER = """\
# bug: multiplies by zero on a cluster
# why: only a real cluster shows it
# symptom: CLUSTER_SYMPTOM_MARK products vanish when the shards move
# catches: test_stage1_mul
# needs: cluster
--- a/calc/stage1.py
+++ b/calc/stage1.py
@@ -4,2 +4,2 @@
     def mul(self, a: int, b: int) -> int:
-        return a * b
+        return a * 0
"""


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.delenv("KATA_REDIS_CLUSTER", raising=False)
    monkeypatch.delenv("KATA_REDIS_SERVER", raising=False)
    return practice_project(
        tmp_path, monkeypatch, mutants={"stage1_sub_swapped.diff": CALC_SUB_SWAPPED}
    )


def _copies(project: Path) -> list[Path]:
    return sorted((project.parent / "xdg-state" / "infra-katas" / "debug").glob("calc-*"))


def _fix_the_copy(project: Path) -> None:
    (copy,) = _copies(project)
    write(copy / "calc" / "stage1.py", CALC_SOLUTION)


def test_cli_debug_reports_the_incident_and_records_the_fix(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    learners = (project / "katas" / "calc" / "stage1.py").read_text()
    code, _ = run_kata(["debug", "calc", "1"], events=[(75, lambda: _fix_the_copy(project))])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "SYMPTOM_MARK" in out, out
    assert "BUG_MARK" not in out and "WHY_MARK" not in out, "the report never names the bug"
    assert "[00:00] 2/3 passed" in out, out  # the first run: the whole suite, sub fails
    assert "solved in 01:15: 2 run(s), 2 line(s) changed" in out, out
    (copy,) = _copies(project)
    assert project not in copy.parents, "the copy lives outside the learner's project"
    assert (project / "katas" / "calc" / "stage1.py").read_text() == learners
    (round_,) = state(project)["rounds"]
    assert round_["entries"] == ["calc/stage1_sub_swapped"] and round_["result"] == "solved"
    assert round_["seconds"] == 75 and round_["runs"] == 2 and round_["lines_changed"] == 2
    assert round_["copy"] == str(copy)

    assert main(["progress"]) == 0
    shown = capsys.readouterr().out
    assert "interview rounds" in shown and "solved" in shown and "01:15" in shown, shown

    assert main(["debug", "--reveal"]) == 0
    shown = capsys.readouterr().out
    assert "BUG_MARK" in shown and "WHY_MARK" in shown and "+        return b - a" in shown
    assert "test_stage1_sub" in shown, shown


def test_cli_debug_given_up_is_recorded_unsolved_and_a_hint_says_where(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _ = run_kata(["debug", "calc"], events=[(10, "h"), (20, "q")])
    out = capsys.readouterr().out
    assert code == 1, out
    (copy,) = _copies(project)
    assert f"Hint: look in {copy / 'calc' / 'stage1.py'}" in out, out
    assert "Round over (stopped) after 00:20, not solved" in out, out
    (round_,) = state(project)["rounds"]
    assert round_["result"] == "stopped" and round_["hints_used"] == 1
    assert round_["lines_changed"] == 0


def test_cli_debug_never_repeats_an_entry_before_every_one_was_drawn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("KATA_REDIS_CLUSTER", raising=False)
    monkeypatch.delenv("KATA_REDIS_SERVER", raising=False)
    project = practice_project(
        tmp_path,
        monkeypatch,
        mutants={
            "stage1_sub_swapped.diff": CALC_SUB_SWAPPED,
            "stage1_add_off_by_one.diff": CALC_ADD_OFF_BY_ONE,
            "stage1_mul_by_zero.diff": NEEDS_CLUSTER,
        },
    )
    for seed in (1, 2, 3):  # whatever the draw, the second round takes the other entry
        code, _ = run_kata(["debug", "calc", "--seed", str(seed)], events=[(1, "q")])
        assert code == 1
    out = capsys.readouterr().out
    assert "CLUSTER_SYMPTOM_MARK" not in out, "an entry that needs a cluster is never drawn here"
    drawn = [r["entries"] for r in state(project)["rounds"]]
    assert sorted(drawn[0] + drawn[1]) == ["calc/stage1_add_off_by_one", "calc/stage1_sub_swapped"]
    assert drawn[2][0] in {"calc/stage1_add_off_by_one", "calc/stage1_sub_swapped"}

    # two bugs at once: both reported, both in the one copy
    code, _ = run_kata(["debug", "calc", "--bugs", "2"], events=[(1, "q")])
    out = capsys.readouterr().out
    assert code == 1 and "Report 1:" in out and "Report 2:" in out, out
    last = sorted(_copies(project), key=lambda p: p.stat().st_mtime)[-1]
    text = (last / "calc" / "stage1.py").read_text()
    assert "return b - a" in text and "return a + b + 1" in text, text


def _entry(tmp_path: Path, stage: int, slug: str) -> mutants.Mutant:
    path = tmp_path / "calc" / f"stage{stage}_{slug}.diff"
    return mutants.Mutant(path, "calc", stage, slug, "bug", "why", ("t",))


def test_draw_order_takes_the_least_drawn_and_passed_stages_first(tmp_path: Path) -> None:
    one_a, one_b = _entry(tmp_path, 1, "a"), _entry(tmp_path, 1, "b")
    two_a = _entry(tmp_path, 2, "a")
    entries = [one_a, one_b, two_a]
    for seed in range(20):
        rng = random.Random(seed)
        assert draw_order(entries, {}, {2}, rng)[0] == two_a, "a passed stage first"
        drawn = {two_a.name: 1}
        assert draw_order(entries, drawn, {2}, rng)[0] in (one_a, one_b), "then the undrawn"
        drawn = {two_a.name: 1, one_a.name: 1, one_b.name: 1}
        assert draw_order(entries, drawn, {2}, rng)[0] == two_a, "a new cycle: passed first"
    firsts = {draw_order(entries, {}, set(), random.Random(s))[0] for s in range(40)}
    assert firsts == set(entries), "at random among equals"


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["debug"], "name a kata"),
        (["debug", "--reveal"], "no debugging round yet"),
        (["debug", "calc", "3"], "stage 3"),
        (["debug", "calc", "--bugs", "2"], "no second catalogue entry"),
        (["debug", "calc", "--bugs", "3"], "invalid choice"),
    ],
)
def test_cli_debug_bad_input_is_one_line(
    project: Path, capsys: pytest.CaptureFixture[str], argv: list[str], says: str
) -> None:
    code, _ = run_kata(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert says in err and len(err.strip().splitlines()) == 1, err
    assert not _copies(project), "a refused round lays nothing out"


def test_cli_pair_round_debug_shows_the_interviewer_the_bug_and_records_a_paired_round(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _ = run_kata(
        ["pair", "calc", "1", "--round", "debug"], [(30, lambda: _fix_the_copy(project))]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    report, rest = " ".join(out.split()).split("for the interviewer only")
    assert "SYMPTOM_MARK" in report and "BUG_MARK" not in report, report
    assert "The candidate finds it and fixes it there" in report, report
    assert "BUG_MARK" in rest and "WHY_MARK" in rest and "test_stage1_sub" in rest, rest
    assert "solved in 00:30" in rest, rest
    (round_,) = state(project)["rounds"]
    assert round_["mode"] == "debug" and round_["paired"] is True and round_["result"] == "solved"
    assert main(["progress"]) == 0
    assert "debug (paired)" in capsys.readouterr().out
