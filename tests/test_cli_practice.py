"""``kata hint``, ``reveal``, ``reset``, ``bench``, ``progress`` end to end (``kata start``:
test_cli_start.py; ``kata pair``: test_cli_pair.py).

Everything runs against a tiny kata, ``calc``, made in a temporary folder (``KATA_ROOT``)
with its own reference, bug catalogue and git history, and progress kept in a temporary
state directory (``XDG_STATE_HOME``). Questions are answered by a scripted terminal.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _support import (
    CALC_KATA,
    CALC_SOLUTION,
    CALC_STUB,
    CALC_SUB_SWAPPED,
    git,
    kata_process,
    practice_project,
    run_kata,
    state,
    state_file,
    write,
)

from katas._cli.cli import main
from katas._cli.pristine import looks_like_stub
from katas._cli.state import StateStore
from katas._registry import catalog as cat
from katas._registry.notes import clarifying_questions, hints, rubric_axes

REPO = Path(__file__).resolve().parents[1]

BENCH = """\
import pytest

from katas._harness.bench import report

pytestmark = [pytest.mark.stage(1), pytest.mark.core]


def test_bench_stage1_add(benchmark, stage_module, capsys):
    calc = stage_module.Calc()
    benchmark.pedantic(lambda: calc.add(1, 2), rounds=3, iterations=1)
    report(benchmark, capsys, "speed_vs_reference", 1.25, "~1")
    report(benchmark, capsys, "speedup_vs_floor", 2.5, ">= 3")
    print("\\n  printed_not_reported = 9.99   (target: ~1)")  # a printed line is not a ratio
"""


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A project with one kata: ``<project>/katas/calc``, ``solutions/``, ``tests/mutants``."""
    return practice_project(
        tmp_path,
        monkeypatch,
        kata={**CALC_KATA, "bench_stage1.py": BENCH},
        mutants={"stage1_sub_swapped.diff": CALC_SUB_SWAPPED},
    )


def _solve(project: Path) -> None:
    write(project / "katas" / "calc" / "stage1.py", CALC_SOLUTION)


# --- hint, reveal, reset, bench, progress ----------------------------------------------------


def test_cli_hint_reveals_one_at_a_time_and_remembers(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    proc = kata_process("hint", "calc", "1")
    assert proc.returncode == 0, proc.stderr
    assert "HINT_ONE_MARK" in proc.stdout and "HINT_TWO_MARK" not in proc.stdout
    assert "1 more hint" in proc.stdout
    assert main(["hint", "calc", "1"]) == 0
    out = capsys.readouterr().out
    assert "HINT_TWO_MARK" in out and "HINT_ONE_MARK" not in out and "hint 2 of 2" in out
    assert main(["hint", "calc", "1"]) == 0
    assert "All 2 hints" in capsys.readouterr().out
    assert main(["hint", "calc", "1", "--again"]) == 0
    out = capsys.readouterr().out
    assert "HINT_ONE_MARK" in out and "HINT_TWO_MARK" in out
    assert state(project)["hints"] == {"calc/1": 2}

    assert main(["hint", "calc", "1", "--all"]) == 2  # not passed yet
    assert "--all shows every hint once calc stage 1 has passed" in capsys.readouterr().err


def test_cli_reveal_only_after_passing_or_forced_and_lists_common_mistakes(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["reveal", "calc", "1"]) == 2
    err = capsys.readouterr().err
    assert "has not passed yet" in err and "--force" in err, err
    assert main(["reveal", "calc", "1", "--force"]) == 0
    out = capsys.readouterr().out
    assert "+        raise Todo()" in out and "-        return a + b" in out, out
    assert "BUG_MARK subtracts the wrong way round" in out, out
    assert "stage1_sub_swapped" in out

    _solve(project)  # a green `kata test` of the learner's code unlocks reveal and hint --all
    assert main(["test", "calc", "1"]) == 0
    capsys.readouterr()
    assert main(["reveal", "calc", "1"]) == 0
    assert "identical to the reference" in capsys.readouterr().out
    assert main(["hint", "calc", "1", "--all"]) == 0
    out = capsys.readouterr().out
    assert "HINT_ONE_MARK" in out and "HINT_TWO_MARK" in out
    assert main(["list"]) == 0
    row = next(ln for ln in capsys.readouterr().out.splitlines() if "Add and multiply" in ln)
    assert "passed" in row and row.rstrip().endswith("0"), row  # passed, no timed attempt


def test_cli_test_on_another_impl_is_not_progress(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["test", "calc", "1", "--impl", str(project / "solutions")]) == 0
    assert not state_file(project).exists()
    assert main(["reveal", "calc", "1"]) == 2


def test_cli_reset_restores_the_pristine_stub_and_archives_yours(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stub = project / "katas" / "calc" / "stage1.py"
    git(project, "init", "-q")
    git(project, "add", "-A")
    git(project, "commit", "-qm", "stubs")
    _solve(project)
    git(project, "commit", "-qam", "my work, committed")  # HEAD is not pristine any more
    write(stub, CALC_SOLUTION + "# more work\n")

    code, terminal = run_kata(["reset", "calc", "1"], answers=["n"])
    assert code == 1 and stub.read_text().endswith("# more work\n")
    assert "Nothing was changed" in capsys.readouterr().out
    assert "Your version is kept in" in terminal.asked[0]

    code, _ = run_kata(["reset", "calc"], answers=None)  # no terminal, no --yes: refuses
    assert code == 2
    assert "--yes" in capsys.readouterr().err

    proc = kata_process("reset", "calc", "--yes")
    assert proc.returncode == 0, proc.stderr
    assert stub.read_text() == CALC_STUB
    archived = list((project.parent / "xdg-state" / "infra-katas" / "archive" / "calc").glob("*/*"))
    assert [p.read_text() for p in archived] == [CALC_SOLUTION + "# more work\n"]
    proc = kata_process("reset", "calc", "1", "--yes")
    assert proc.returncode == 0 and "already the pristine stub" in proc.stdout


def test_cli_reset_outside_git_is_one_line(
    project: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(project.parent))
    assert main(["reset", "calc", "1", "--yes"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not in a git checkout" in err, err


def test_cli_pristine_stub_detection() -> None:
    assert looks_like_stub(CALC_STUB)
    assert not looks_like_stub(CALC_SOLUTION)
    assert not looks_like_stub("x = 1\n")


def test_cli_bench_prints_the_ratios(
    project: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "120")
    assert main(["bench", "calc", "1", "--impl", str(project / "solutions")]) == 0
    out = capsys.readouterr().out
    rows = [ln.split() for ln in out.splitlines() if ln.strip().startswith("add ")]
    assert rows == [
        ["add", "speed_vs_reference", "1.250", "—", "~1", "—"],
        ["add", "speedup_vs_floor", "2.500", "—", ">=", "3", "no"],
    ], out
    assert "printed_not_reported" not in out  # the ratios come from the JSON, not the output
    assert main(["bench", "calc", "1"]) == 1  # the stub: not implemented yet
    assert "not implemented yet: Calc.add" in capsys.readouterr().out


# --- state: XDG, atomic, never lost ----------------------------------------------------------


def test_cli_state_lives_in_xdg_state_home_not_in_the_repository(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["hint", "calc", "1"]) == 0
    assert state_file(project).is_file()
    assert not list(project.rglob("state.json"))
    leftovers = [p.name for p in state_file(project).parent.iterdir()]
    assert sorted(leftovers) == ["state.json", "state.lock"], leftovers  # no temporary files


@pytest.mark.parametrize(
    "content", ["{not json", '{"version": 99, "attempts": [], "hints": {}, "results": {}}', "[]"]
)
def test_cli_corrupted_state_is_one_line_and_never_overwritten(
    project: Path, capsys: pytest.CaptureFixture[str], content: str
) -> None:
    path = state_file(project)
    write(path, content)
    for argv in (["list"], ["hint", "calc", "1"], ["progress"], ["start", "calc", "1"]):
        assert main(argv) == 2, argv
        captured = capsys.readouterr()
        err = captured.err.strip()
        assert len(err.splitlines()) == 1 and "Traceback" not in err, err
        assert str(path) in err and "nothing was changed" in err, err
        assert path.read_text() == content
    proc = kata_process("progress")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert path.read_text() == content


def test_cli_state_update_is_atomic(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "st")
    with store.update() as state:
        state.reveal_hint("calc", 1, 2)
    with pytest.raises(RuntimeError), store.update() as state:
        state.reveal_hint("calc", 1, 5)
        raise RuntimeError("a crash half-way through")
    assert store.load().hints == {"calc/1": 2}


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["start", "calk", "1"], "did you mean calc?"),
        (["start", "calc", "7"], "calc has stages 1–1, got stage 7"),
        (["pair", "calc", "2"], "got stage 2"),
        (["start", "calc", "1", "--minutes", "-3"], "--minutes: must be between"),
        (["hint", "calc"], "required: STAGE"),
        (["bench", "calc", "1", "--impl", "/nonexistent"], "--impl must be"),
    ],
)
def test_cli_practice_bad_input_is_one_line(
    project: Path, capsys: pytest.CaptureFixture[str], argv: list[str], expected: str
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expected in err, err


@pytest.mark.parametrize(
    ("missing", "argv", "expected"),
    [
        ("HINTS.md", ["hint", "calc", "1"], "HINTS.md does not exist"),
        ("INTERVIEWER.md", ["pair", "calc", "1"], "INTERVIEWER.md does not exist"),
        ("bench_stage1.py", ["bench", "calc", "1"], "has no benchmarks"),
        ("test_stage1.py", ["start", "calc", "1"], "test_stage1.py does not exist"),
    ],
)
def test_cli_practice_missing_files_are_one_line(
    project: Path,
    capsys: pytest.CaptureFixture[str],
    missing: str,
    argv: list[str],
    expected: str,
) -> None:
    (project / "katas" / "calc" / missing).unlink()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expected in err, err


def test_cli_help_for_the_practice_commands(capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("start", "pair", "hint", "reveal", "reset", "bench", "progress"):
        assert main([command, "--help"]) == 0
        out = capsys.readouterr().out
        assert f"usage: kata {command}" in out, out
    assert main(["start", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--minutes" in out and "time to green" in out and "exit code" in out


#: Clarifying questions of a stage marked key, at least: the interview mode asks for them.
KEY_QUESTIONS = 3


def test_cli_notes_of_every_real_kata_parse() -> None:
    """Every kata's HINTS.md and INTERVIEWER.md parse; the rate limiter's are complete;
    every stage has clarifying questions, some of them key."""
    for kata in cat.Catalog(REPO / "katas").katas():
        for stage in kata.stages:
            found = hints(kata.hints.read_text(), stage.section) if kata.hints.is_file() else None
            axes = (
                rubric_axes(kata.interviewer.read_text(), stage.section)
                if kata.interviewer.is_file()
                else []
            )
            if kata.name == "rate_limiter":
                assert found and len(found) >= 3, (stage.number, found)
                assert [a for a, _ in axes][:2] == ["Problem solving", "Correctness & complexity"]
            questions = clarifying_questions(kata.interviewer.read_text(), stage.section)
            key = [q for q in questions if q.key]
            assert len(key) >= KEY_QUESTIONS, (
                f"{kata.name} stage {stage.number}: {len(key)} of its {len(questions)} "
                f"clarifying questions are marked *(key)* in INTERVIEWER.md (the ones whose "
                f"answer changes the code); at least {KEY_QUESTIONS} expected"
            )


def test_cli_test_still_runs_with_a_corrupted_state_and_says_it_did_not_record(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = state_file(project)
    write(path, "{not json")
    assert main(["test", "calc", "1", "--core"]) == 1
    captured = capsys.readouterr()
    assert "0/2 passed" in captured.out
    err = captured.err.strip()
    assert len(err.splitlines()) == 1 and "warning: not recorded" in err, err
    assert path.read_text() == "{not json"
