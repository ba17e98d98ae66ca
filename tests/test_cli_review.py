"""``kata review``: proposed changes (catalogue bugs and sound changes), each approved or
rejected with the rule it breaks; the score, the right answers, the round recorded.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from _support import (
    CALC_ADD_OFF_BY_ONE,
    CALC_KATA,
    CALC_README,
    CALC_SUB_SWAPPED,
    CALC_SUITE,
    practice_project,
    run_kata,
    state,
    write,
)

from katas._cli.cli import main
from katas._cli.cli_review import compose
from katas._registry import mutants

README = CALC_README.replace(
    "PROMPT_MARK: integers only.",
    "PROMPT_MARK: integers only.\n\n"
    "- §sums **Sums are exact**: add(a, b) is a + b.\n"
    "- §sub-order **In order**: sub(a, b) is a - b.\n",
)
SUITE = CALC_SUITE.replace(
    "@pytest.mark.core\ndef test_stage1_add",
    '@pytest.mark.core\n@pytest.mark.rule("sums")\ndef test_stage1_add',
).replace(
    "@pytest.mark.extended\ndef test_stage1_sub",
    '@pytest.mark.extended\n@pytest.mark.rule("sub-order")\ndef test_stage1_sub',
)

MUL_COMMUTED = """\
# rationale: SOUND_RATIONALE_MARK write the product in the order the docs use
# sound: SOUND_WHY_MARK integer multiplication commutes
--- a/calc/stage1.py
+++ b/calc/stage1.py
@@ -4,2 +4,2 @@
     def mul(self, a: int, b: int) -> int:
-        return a * b
+        return b * a
"""


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    project = practice_project(
        tmp_path,
        monkeypatch,
        kata={**CALC_KATA, "README.md": README, "test_stage1.py": SUITE},
        mutants={
            "stage1_sub_swapped.diff": CALC_SUB_SWAPPED,
            "stage1_add_off_by_one.diff": CALC_ADD_OFF_BY_ONE,
        },
    )
    write(project / "tests" / "reviews" / "calc" / "stage1_mul_commuted.diff", MUL_COMMUTED)
    return project


def _order(project: Path, seed: int) -> list[str]:
    """The slugs of the changes ``--changes 3 --seed SEED`` shows, in order."""
    folder = project / "tests" / "mutants" / "calc"
    bugs = [mutants.parse(p) for p in sorted(folder.glob("*.diff"))]
    sound = mutants.load_sound("calc", project / "tests" / "reviews")
    return [c.slug for c in compose(bugs, sound, 3, random.Random(seed))]


def test_cli_review_scores_the_verdicts_and_the_rules_named(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    order = _order(project, 5)
    assert sorted(order) == ["add_off_by_one", "mul_commuted", "sub_swapped"]
    answers = {  # right verdicts; the sub's rule named right, the add's not
        "sub_swapped": ["r", "§sub-order"],
        "add_off_by_one": ["r", "sub-order"],
        "mul_commuted": ["a"],
    }
    code, terminal = run_kata(
        ["review", "calc", "1", "--changes", "3", "--seed", "5"],
        answers=[a for slug in order for a in answers[slug]],
    )
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert "RATIONALE_MARK read the operands" in out and "SOUND_RATIONALE_MARK" in out, out
    assert "+        return b * a" in out, out
    assert "3/3 verdicts right · 1/2 rules named right" in out, out
    assert "BUG_MARK" in out and "SOUND_WHY_MARK" in out and "§sums" in out, out
    assert terminal.asked.count("approve or reject? [a/r] ") == 3
    (round_,) = state(project)["rounds"]
    assert round_["mode"] == "review" and round_["result"] == "done"
    assert round_["verdicts_right"] == 3 and round_["rules_right"] == 1
    assert round_["rules_asked"] == 2 and len(round_["entries"]) == 3

    assert main(["progress"]) == 0
    shown = capsys.readouterr().out
    assert "review" in shown and "3/3 right" in shown and "rules 1/2" in shown, shown


def test_cli_review_asks_again_and_a_round_left_early_is_recorded_as_stopped(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    order = _order(project, 1)
    first = "a" if order[0] == "mul_commuted" else "r"
    code, _ = run_kata(
        ["review", "calc", "1", "--changes", "3", "--seed", "1"],
        answers=["maybe", first, "", ""],
    )
    out = capsys.readouterr().out
    assert code == 1, out
    assert "answer one of: a, approve" in out, out
    assert "1/1 verdicts right" in out and "stopped early" in out, out
    (round_,) = state(project)["rounds"]
    assert round_["result"] == "stopped" and round_["verdicts_right"] == 1


@pytest.mark.parametrize(
    ("argv", "answers", "says"),
    [
        (["review", "calc", "1"], None, "run it in a terminal"),
        (["review", "nope", "1"], [], "nope"),
        (["review", "calc", "4"], [], "stage 4"),
        (["review", "calc", "1", "--changes", "1"], [], "from 2 to 20"),
    ],
)
def test_cli_review_bad_input_is_one_line(
    project: Path,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    answers: list[str] | None,
    says: str,
) -> None:
    code, _ = run_kata(argv, answers=answers)
    err = capsys.readouterr().err
    assert code == 2, err
    assert says in err and len(err.strip().splitlines()) == 1, err


def test_cli_review_without_sound_changes_says_so(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (project / "tests" / "reviews" / "calc" / "stage1_mul_commuted.diff").unlink()
    code, _ = run_kata(["review", "calc", "1"], answers=[])
    err = capsys.readouterr().err
    assert code == 2 and "no review material yet (2 proposed bug(s), 0 sound" in err, err


def test_cli_pair_round_review_takes_the_candidates_verdicts_and_records_a_paired_round(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    order = _order(project, 5)
    verdicts = {"sub_swapped": ["r", "§sub-order"], "add_off_by_one": ["a"], "mul_commuted": ["a"]}
    run_kata(
        ["pair", "calc", "1", "--round", "review", "--seed", "5"],
        answers=[a for slug in order for a in verdicts[slug]] + ["q"] * 10,
    )
    out = capsys.readouterr().out
    assert "Show each change to the candidate" in out, out
    (round_,) = state(project)["rounds"]
    assert round_["mode"] == "review" and round_["paired"] is True, round_
    assert main(["progress"]) == 0
    assert "review (paired)" in capsys.readouterr().out
