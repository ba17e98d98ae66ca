"""The ``kata`` command end to end: list, show, test, and one-line errors.

``show`` and ``test`` run against a tiny kata made in a temporary folder (``KATA_ROOT``),
so these checks do not depend on the rate limiter's prompt or suites being written.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, cast

import _support
import pytest
from _support import calc_project, private_state, write
from rich.console import Console

from katas._cli import cli_bench, cli_test
from katas._cli.cli import main, markdown_sections
from katas._cli.cliutil import shorten
from katas._cli.state import Attempt, StateStore
from katas._cli.summary import failure_lines, print_summary
from katas._harness import bench
from katas._registry import catalog as cat
from katas._registry.suites import SuiteRun, TestResult, run_suite

REPO = Path(__file__).resolve().parents[1]

CALC_TOML = """\
title = "Calculator"
summary = "A kata that exists only for the CLI's own tests."
tags = ["toy"]

[[stages]]
number = 1
title = "Add and multiply"
timebox_minutes = 15
core = "Calc.add, Calc.mul"
extended = "Calc.sub, Calc.div"

[[stages]]
number = 2
title = "Everything at once"
timebox_minutes = 30
core = "Calc.pow"
"""

CALC_README = """\
# Calculator

INTRO_MARK: build a calculator.

## Interface

SHARED_MARK: integers only.

## Stage 1 — add and multiply

STAGE1_MARK

```
## a heading inside a code block stays in stage 1
```

## Stage 2

STAGE2_MARK
"""

# The learner's working copy: add works, mul is a stub, sub is wrong, div crashes.
CALC_STAGE1 = """\
from katas._runtime.todo import Todo


class Calc:
    def add(self, a: int, b: int) -> int:
        return a + b

    def mul(self, a: int, b: int) -> int:
        raise Todo()

    def sub(self, a: int, b: int) -> int:
        return b - a

    def div(self, a: int, b: int) -> int:
        return {}[a]
"""

CALC_SOLUTION = (
    _support.CALC_SOLUTION
    + """
    def div(self, a: int, b: int) -> int:
        return a // b
"""
)

# Six tests: the shared add, mul (core) and sub, then three more extended ones.
CALC_SUITE = (
    _support.CALC_SUITE
    + """

@pytest.mark.extended
def test_stage1_mul_by_zero(stage_module):
    assert stage_module.Calc().mul(7, 0) == 0


@pytest.mark.extended
def test_stage1_div(stage_module):
    assert stage_module.Calc().div(7, 2) == 3


@pytest.mark.extended
def test_stage1_profile():
    import os

    assert os.environ.get("KATA_PROFILE", "dev") == os.environ.get("EXPECT_PROFILE", "dev")
"""
)


@pytest.fixture(autouse=True)
def _private_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Progress goes to a temporary state directory, never the user's."""
    private_state(tmp_path, monkeypatch)


@pytest.fixture
def kata_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A catalogue with one kata, ``calc``, that the CLI is pointed at through KATA_ROOT."""
    return calc_project(
        tmp_path / "proj",
        monkeypatch,
        kata={
            "kata.toml": CALC_TOML,
            "README.md": CALC_README,
            "stage1.py": CALC_STAGE1,
            "test_stage1.py": CALC_SUITE,
            "INTERVIEWER.md": "# Calculator\n\n## Stage 1\n\n### Read aloud\n\nAdd.\n",
            "bench_stage1.py": "def test_bench_stage1_nothing():\n    pass\n",
        },
        solution=CALC_SOLUTION,
    )


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n{err}"
    assert "Traceback" not in err
    return lines[0]


# --- the real catalogue ------------------------------------------------------------------


def test_cli_real_rate_limiter_metadata_is_valid() -> None:
    kata = cat.Catalog(cat.PACKAGE_ROOT).get("rate_limiter")
    assert [(s.number, s.timebox_minutes) for s in kata.stages] == [(1, 45), (2, 45), (3, 60)]
    assert "TokenBucket" in kata.stages[0].core and "SlidingLog" in kata.stages[0].core
    assert "GCRA" in kata.stages[0].extended
    assert [s.suite for s in kata.stages] == ["test_stage1.py", "test_stage2.py", "test_stage3.py"]
    assert [s.stub for s in kata.stages] == ["stage1.py", "stage2.py", "stage3.py"]
    assert [s.section for s in kata.stages] == ["Stage 1", "Stage 2", "Stage 3"]


def test_cli_every_kata_toml_in_the_repository_is_valid() -> None:
    katas = cat.Catalog(cat.PACKAGE_ROOT).katas()
    assert "rate_limiter" in [k.name for k in katas]


def test_cli_every_kata_toml_names_stub_and_suite_files_that_exist() -> None:
    katas = cat.Catalog(REPO / "katas").katas()
    assert katas, "no katas/*/kata.toml in the repository"
    missing = [
        f"{kata.name}/{cat.MANIFEST} stage {stage.number}: {what} {path.name} does not exist"
        for kata in katas
        for stage in kata.stages
        for what, path in [("stub", kata.stub_path(stage))]
        + [("suite", p) for p in kata.suite_paths(stage)]
        if not path.is_file()
    ]
    assert not missing, "kata.toml names files that are not there:\n" + "\n".join(missing)


def test_cli_list_shows_rate_limiter_stages_and_timeboxes(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(cat.ENV_ROOT, raising=False)
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.chdir(REPO)
    assert main(["list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    first = next(i for i, line in enumerate(lines) if line.split()[:1] == ["rate_limiter"])
    mine = lines[first + 1 : first + 4]
    assert [row.split()[0].lstrip("▸") for row in mine] == ["1", "2", "3"], lines
    assert "Single-threaded" in mine[0] and "Concurrent" in mine[1], mine
    assert "Distributed" in mine[2], mine
    assert [row.split(" min")[0].split()[-1] for row in mine] == ["45", "45", "60"], mine
    assert "TokenBucket, SlidingLog" in mine[0]  # the core part, in the wide layout


def test_cli_default_root_is_the_checkout_around_the_working_directory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(cat.ENV_ROOT, raising=False)
    monkeypatch.chdir(REPO / "katas" / "rate_limiter")
    assert cat.default_root() == REPO / "katas"
    monkeypatch.chdir("/")
    assert cat.default_root() == cat.PACKAGE_ROOT


# --- show --------------------------------------------------------------------------------


def test_cli_show_prints_the_whole_prompt(
    kata_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["show", "calc"]) == 0
    out = capsys.readouterr().out
    for mark in ("INTRO_MARK", "SHARED_MARK", "STAGE1_MARK", "STAGE2_MARK"):
        assert mark in out, out


def test_cli_show_stage_prints_the_intro_and_that_stage_only(
    kata_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["show", "calc", "1"]) == 0
    out = capsys.readouterr().out
    assert "INTRO_MARK" in out and "SHARED_MARK" in out and "STAGE1_MARK" in out, out
    assert "a heading inside a code block" in out, out
    assert "STAGE2_MARK" not in out, out
    assert "15 min" in out and "Calc.add, Calc.mul" in out, out

    assert main(["show", "calc", "stage2"]) == 0
    out = capsys.readouterr().out
    assert "INTRO_MARK" in out and "STAGE2_MARK" in out, out
    assert "STAGE1_MARK" not in out, out


def test_cli_show_without_a_prompt_is_one_line(
    kata_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (kata_root / "calc" / "README.md").unlink()
    assert main(["show", "calc"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "README.md does not exist" in line, line


def test_cli_show_stage_without_its_section_is_one_line(
    kata_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write(kata_root / "calc" / "README.md", "# Calculator\n\n## Stage 1\n\nonly one\n")
    assert main(["show", "calc", "2"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "'## Stage 2'" in line, line


# --- test --------------------------------------------------------------------------------


def test_cli_test_summarises_failures_by_kind(
    kata_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["test", "calc", "1"]) == 1
    out = capsys.readouterr().out
    assert "2/6 passed" in out, out  # add and profile pass
    assert "2 tests not implemented yet: Calc.mul" in out, out
    assert "test_stage1_sub — sub(5, 3) must be 2, got -2" in out, out
    assert "test_stage1_div — KeyError" in out, out
    assert "Traceback" not in out


def test_cli_test_passes_against_another_impl_and_selects_core(
    kata_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    reference = kata_root.parent / "solutions"
    assert main(["test", "calc", "1", "--impl", str(reference)]) == 0
    assert "6/6 passed" in capsys.readouterr().out
    assert main(["test", "calc", "1", "--impl", str(reference), "--core"]) == 0
    assert "2/2 passed" in capsys.readouterr().out


def test_cli_test_thorough_profile_and_pytest_arguments(
    kata_root: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EXPECT_PROFILE", "thorough")
    assert main(["test", "calc", "1", "--thorough", "--", "-k", "profile"]) == 0
    assert "1/1 passed" in capsys.readouterr().out


def test_cli_runs_as_a_module(kata_root: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "katas._cli.cli", "test", "calc", "1", "--", "-k", "add"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1/1 passed" in proc.stdout, proc.stdout


# --- bad input: one line on stderr, exit code 2 ------------------------------------------


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["show", "calk"], "did you mean calc?"),
        (["test", "calc", "3"], "calc has stages 1–2, got stage 3"),
        (["test", "calc", "2"], "test_stage2.py does not exist"),
        (["test", "calc", "one"], "STAGE must be a stage number"),
        (["test", "calc"], "required: STAGE"),
        (["test", "calc", "1", "--impl", "/nonexistent/dir"], "--impl must be"),
        (["list", "--", "-x"], "takes no arguments after --"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(
    kata_root: Path, capsys: pytest.CaptureFixture[str], argv: list[str], expected: str
) -> None:
    assert main(argv) == 2
    captured = capsys.readouterr()
    line = _one_error_line(captured.err)
    assert expected in line, line
    assert captured.out == ""


@pytest.mark.parametrize(
    ("toml", "expected"),
    [
        ("title = [", "invalid TOML"),
        (CALC_TOML.replace('title = "Calculator"\n', ""), "title is missing"),
        (
            CALC_TOML.replace("timebox_minutes = 30", 'timebox_minutes = "30"'),
            "stages[1].timebox_minutes must be a positive integer",
        ),
        (
            CALC_TOML.replace("timebox_minutes = 15", "timebox_minute = 15"),
            "stages[0].timebox_minute is not a known field (did you mean 'timebox_minutes'?)",
        ),
        (CALC_TOML.replace("number = 2", "number = 3"), "stages[1].number must be 2"),
        (
            CALC_TOML.replace('core = "Calc.pow"', 'core = "Calc.pow"\nsuite = "../x.py"'),
            "stages[1].suite must be a .py file name",
        ),
        (CALC_TOML.split("[[stages]]")[0], "stages must be one or more"),
    ],
)
def test_cli_broken_kata_toml_names_the_file_and_field(
    kata_root: Path, capsys: pytest.CaptureFixture[str], toml: str, expected: str
) -> None:
    write(kata_root / "calc" / "kata.toml", toml)
    for argv in (["list"], ["show", "calc"]):
        assert main(argv) == 2
        line = _one_error_line(capsys.readouterr().err)
        assert "calc/kata.toml: " in line and expected in line, line


def test_cli_help_for_every_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for command in ("list", "show", "test", "start", "pair", "hint", "reveal", "reset"):
        assert command in out
        assert main([command, "--help"]) == 0
        assert f"usage: kata {command}" in capsys.readouterr().out
    assert main(["test", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--impl" in out and "--core" in out and "--thorough" in out and "exit code" in out


def test_cli_stage_prompt_keeps_fenced_headings() -> None:
    headings = [h for h, _ in markdown_sections(CALC_README)]
    assert headings == [None, "Calculator", "Interface", "Stage 1 — add and multiply", "Stage 2"]


def test_cli_test_reports_a_suite_that_cannot_be_collected(
    kata_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write(kata_root / "calc" / "test_stage1.py", "def test_stage1_broken(:\n")
    assert main(["test", "calc", "1"]) == 1
    out = capsys.readouterr().out
    assert "SyntaxError" in out and "pytest could not run" in out, out


def test_cli_test_shows_every_timed_out_test_and_where_its_code_was(
    kata_root: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An endless loop is a failure line per test that ran past its deadline, not a gap
    between "2/6 passed" and the six tests."""
    looping = CALC_STAGE1.replace("return b - a", "while True:\n            a += 1")
    write(
        kata_root / "calc" / "stage1.py",
        looping.replace("return {}[a]", "while b:\n            a -= 1"),
    )
    write(kata_root.parent / "pytest.ini", "[pytest]\ntimeout = 60\n")  # the hook's switch
    monkeypatch.setenv("KATA_TEST_TIMEOUT", "1")
    assert main(["test", "calc", "1"]) == 1
    out = capsys.readouterr().out
    lines = out.splitlines()
    for test, where in (("test_stage1_sub", "in sub"), ("test_stage1_div", "in div")):
        (line,) = [ln for ln in lines if f"timeout: {test} ran past 1 s" in ln]
        assert line.startswith("! ") and "it was at stage1.py:" in line and where in line, out
    assert "2/6 passed, 2 timed out" in out, out


def test_cli_test_a_crash_is_a_failure_line_never_0_of_0(
    kata_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A segfault in the code under test: a line saying "crashed", which test and where."""
    crashing = CALC_STAGE1.replace(
        "return {}[a]", "import ctypes\n\n        return len(ctypes.string_at(0))"
    )
    write(kata_root / "calc" / "stage1.py", crashing)
    assert main(["test", "calc", "1"]) == 1
    out = capsys.readouterr().out
    (line,) = [ln for ln in out.splitlines() if "crashed" in ln]
    assert "test_stage1_div" in line and "SIGSEGV" in line, out
    assert "0/0 passed" not in out, out


def test_cli_test_shows_the_pattern_and_the_message_a_raises_match_met(
    kata_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    suite = (
        CALC_SUITE
        + """

@pytest.mark.extended
def test_stage1_div_by_zero(stage_module):
    with pytest.raises(ZeroDivisionError, match="by zero"):
        stage_module.Calc().div(7, 0)
"""
    )
    write(kata_root / "calc" / "test_stage1.py", suite)
    write(
        kata_root / "calc" / "stage1.py",
        CALC_SOLUTION.replace("return a // b", "raise ZeroDivisionError('b is 0')"),
    )
    assert main(["test", "calc", "1", "--", "-k", "div_by_zero"]) == 1
    out = capsys.readouterr().out
    (line,) = [ln for ln in out.splitlines() if "test_stage1_div_by_zero" in ln and "✗" in ln]
    assert line.endswith(
        "Regex pattern did not match: expected a message matching 'by zero', got 'b is 0'"
    ), out


def test_cli_failure_lines_show_timeouts_and_crashes_the_plugin_reports() -> None:
    """The report's own timeout and crashed records: a line each, the message alone (it
    names the test), and the tally counts them."""
    timeout = (
        "timeout: test_stage1_sub ran past 2 s under the dev profile — it was at s.py:3 in sub"
    )
    crashed = "crashed: test_stage1_div — the process died of SIGSEGV in hp_schedule (hotpath.c:57)"
    run = SuiteRun(
        1,
        (
            TestResult("t.py::test_stage1_add", "passed", None, ""),
            TestResult("t.py::test_stage1_sub", "failed", "timeout", timeout),
            TestResult("t.py::test_stage1_div", "failed", "crashed", crashed),
            TestResult("t.py::test_stage1_odd", "failed", "new_kind", "something new"),
        ),
        "",
        1.0,
    )
    shown = [line.plain for line in failure_lines(run)]
    assert shown == [f"! {timeout}", f"! {crashed}", "! test_stage1_odd — something new"]
    narrow = [line.plain for line in failure_lines(run, width=40)]
    assert narrow[:2] == [f"! {timeout}", "    it was at s.py:3 in sub"], narrow
    console = Console(width=200, record=True, file=io.StringIO())
    kata = cat.Catalog(REPO / "katas").get("rate_limiter")
    print_summary(console, run, kata, kata.stage(1))
    assert "1/4 passed, 1 timed out, 1 crashed" in console.export_text()


def test_cli_test_rejected_pytest_arguments_are_one_line(
    kata_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["test", "calc", "1", "--", "--no-such-pytest-option"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "pytest rejected the arguments after --" in line and "--no-such-pytest-option" in line


# --- where am I: `kata` and `kata list` ------------------------------------------------------

STAGE_ROW = re.compile(r"^\s*▸?\d+\s\s")


def _real_catalogue(monkeypatch: pytest.MonkeyPatch, columns: int = 80) -> list[cat.Kata]:
    monkeypatch.delenv(cat.ENV_ROOT, raising=False)
    monkeypatch.setenv("COLUMNS", str(columns))
    monkeypatch.chdir(REPO)
    return cat.Catalog(REPO / "katas").katas()


def _record(kata: str, stage: int, ok: bool, at: float, passed: int = 3, total: int = 3) -> None:
    with StateStore().update() as state:
        state.record_result(kata, stage, ok=ok, passed=passed if ok else 1, total=total, at=at)


def _overview(capsys: pytest.CaptureFixture[str], argv: list[str], stages: int) -> list[str]:
    """What ``kata``/``kata list`` printed, checked to fit 80 columns with a line per stage."""
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    too_long = [line for line in lines if len(line) > 80]
    assert not too_long, "\n".join(too_long)
    rows = [line for line in lines if STAGE_ROW.match(line)]
    assert len(rows) == stages, "\n".join(lines)
    assert all(" min " in row and row.rstrip()[-1].isdigit() for row in rows), rows
    return lines


def test_cli_overview_for_a_newcomer_fits_80_columns(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    katas = _real_catalogue(monkeypatch)
    stages = sum(len(k.stages) for k in katas)
    first = katas[0]
    lines = _overview(capsys, ["list"], stages)
    assert len(lines) <= stages + len(katas) + 6, "\n".join(lines)  # fits a 24-line terminal
    text = "\n".join(lines)
    assert f"0 of {stages} stages green" in text and "new here" in text, text
    assert f"Next: kata show {first.name} 1, then kata start {first.name} 1" in text, text
    assert next(ln for ln in lines if STAGE_ROW.match(ln)).lstrip().startswith("▸1"), text
    for kata in katas:
        assert kata.name in [ln.strip() for ln in lines], text  # a line of its own
    assert "kata --help" not in text

    bare = _overview(capsys, [], stages)  # `kata` alone: the same, and where the rest is
    assert bare[: len(lines)] == lines
    assert bare[len(lines) :] == ["Every command: kata --help"], bare


def test_cli_overview_mid_stage_names_the_stage_in_progress_and_the_next_command(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    katas = _real_catalogue(monkeypatch)
    stages = sum(len(k.stages) for k in katas)
    one, two = katas[0].name, katas[1].name
    _record(one, 1, ok=True, at=100)
    _record(two, 1, ok=False, at=150, total=9)  # an older failing run elsewhere
    _record(one, 2, ok=False, at=200, total=9)
    text = "\n".join(_overview(capsys, ["list"], stages))
    assert f"1 of {stages} stages green · in progress: {one} 2 (failing, 1/9 passed)" in text
    assert f"Next: kata start {one} 2 · core: {katas[0].stages[1].core[:20]}" in text, text
    marked = [ln for ln in text.splitlines() if "▸" in ln]
    assert len(marked) == 1 and marked[0].lstrip().startswith("▸2"), text

    _record(one, 2, ok=True, at=300)  # green now: the other failing stage is in progress
    text = "\n".join(_overview(capsys, ["list"], stages))
    assert f"2 of {stages} stages green · in progress: {two} 1 (failing" in text, text
    _record(two, 1, ok=True, at=400)  # nothing failing: the stage after the last green one
    text = "\n".join(_overview(capsys, ["list"], stages))
    assert f"3 of {stages} stages green · next: {two} 2" in text, text
    assert f"Next: kata show {two} 2, then kata start {two} 2" in text, text


def test_cli_overview_when_everything_is_green(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    katas = _real_catalogue(monkeypatch)
    stages = [(k.name, s.number) for k in katas for s in k.stages]
    with StateStore().update() as state:
        for index, (kata, stage) in enumerate(stages):
            state.record_result(kata, stage, ok=True, passed=3, total=3, at=float(index))
            seconds = 300.0 if (kata, stage) == stages[-2] else 60.0
            state.attempts.append(Attempt.from_json(_green_attempt(kata, stage, seconds)))
    text = "\n".join(_overview(capsys, ["list"], len(stages)))
    assert f"{len(stages)} of {len(stages)} stages green — all done" in text, text
    kata, stage = stages[-2]  # the slowest best time
    assert f"Next: kata start {kata} {stage} (beat your slowest best, 05:00)" in text, text


def _green_attempt(kata: str, stage: int, seconds: float) -> dict[str, object]:
    return {
        "kata": kata,
        "stage": stage,
        "mode": "solo",
        "started": 1_000.0,
        "seconds": seconds,
        "timebox_minutes": 45,
        "green_seconds": seconds,
        "result": "green",
        "passed": 2,
        "total": 2,
        "learners_code": True,
    }


@pytest.mark.parametrize("columns", [60, 100, 120, 200])
def test_cli_list_fits_any_width_with_one_line_per_stage(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, columns: int
) -> None:
    katas = _real_catalogue(monkeypatch, columns)
    assert main(["list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in lines) <= columns, "\n".join(lines)
    assert len([ln for ln in lines if STAGE_ROW.match(ln)]) == sum(len(k.stages) for k in katas)
    assert ("core part" in lines[0]) == (columns >= 120), lines[0]


def test_cli_shorten_cuts_titles_at_words() -> None:
    assert shorten("Add and multiply", 16) == "Add and multiply"
    title = "Single-threaded: token bucket and sliding log"
    assert shorten(title, 39) == "Single-threaded: token bucket…"  # not "… and…"
    assert shorten("Concurrent: single-flight loading, user code outside the lock", 39) == (
        "Concurrent: single-flight loading…"
    )
    assert shorten("Concurrent: worker pools, heartbeats, graceful shutdown", 37) == (
        "Concurrent: worker pools, heartbeats…"
    )
    assert len(shorten(title, 5)) <= 5 and shorten(title, 0) == ""


# --- status: what the learner's code does now, after a reset too -----------------------------


def _row(capsys: pytest.CaptureFixture[str], title: str = "Add and multiply") -> str:
    capsys.readouterr()
    assert main(["list"]) == 0
    return next(ln for ln in capsys.readouterr().out.splitlines() if title in ln)


def test_cli_reset_makes_the_status_reset_and_keeps_the_history(
    kata_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    project = kata_root.parent
    _support.git(project, "init", "-q")
    _support.git(project, "add", "-A")
    _support.git(project, "commit", "-qm", "the kata")
    stage1 = kata_root / "calc" / "stage1.py"
    write(stage1, CALC_SOLUTION)
    with StateStore().update() as state:  # an earlier timed attempt went green in 01:30
        state.attempts.append(Attempt.from_json(_green_attempt("calc", 1, 90.0)))
    assert main(["test", "calc", "1"]) == 0
    row = _row(capsys)
    assert "passed" in row and "01:30" in row and row.rstrip().endswith("1"), row

    assert main(["reset", "calc", "1", "--yes"], wall=lambda: 2_000.0) == 0
    assert stage1.read_text() == CALC_STAGE1
    row = _row(capsys)
    assert "reset" in row and "passed" not in row, row
    assert "01:30" in row and row.rstrip().endswith("1"), row  # the history is kept
    assert "0 of 2 stages green · in progress: calc 1 (reset to the stub)" in _status(capsys)
    assert main(["reveal", "calc", "1"]) == 0  # it did pass once: the reference is unlocked
    capsys.readouterr()

    assert main(["test", "calc", "1"]) == 1  # the next run says what the code does now
    row = _row(capsys)
    assert "failing" in row and "01:30" in row, row


def _status(capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["list"]) == 0
    return capsys.readouterr().out


def test_cli_a_version_1_state_file_still_loads(
    kata_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Written by the command before "reset" existed: status came from ever_passed."""
    path = Path(StateStore().path)
    old = {
        "version": 1,
        "attempts": [_green_attempt("calc", 1, 90.0)],
        "hints": {"calc/1": 1},
        "results": {
            "calc/1": {"ever_passed": True, "last_ok": False, "passed": 1, "total": 6, "at": 5.0},
            "calc/2": {"ever_passed": False, "last_ok": False, "passed": 0, "total": 1, "at": 6.0},
        },
    }
    write(path, json.dumps(old))
    row = _row(capsys)
    assert "failing" in row and "01:30" in row, row  # what the code does now; best kept
    assert "failing" in _row(capsys, "Everything at once")
    assert main(["reveal", "calc", "1"]) == 0  # it passed once
    capsys.readouterr()
    state = StateStore().load()
    assert state.passed("calc", 1) and not state.green("calc", 1)
    state.record_reset("calc", 1, at=7.0)
    state.record_reset("calc", 3, at=7.0)  # no history: stays "not started"
    assert state.status("calc", 1) == "reset" and state.status("calc", 3) == "not started"
    assert state.passed("calc", 1) and state.best_seconds("calc", 1) == 90.0
    state.record_result("calc", 1, ok=True, passed=6, total=6, at=8.0)
    assert state.status("calc", 1) == "passed"


# --- bench: the ratios come from the run's --benchmark-json ---------------------------------


class _FakeBenchmark:
    """What :func:`katas._harness.bench.report` uses of pytest-benchmark's fixture."""

    def __init__(self) -> None:
        self.extra_info: dict[str, Any] = {}


class _CapturedCapsys:
    """A ``capsys`` whose ``disabled()`` leaves the capture on, so a test reads what
    :func:`katas._harness.bench.say` prints."""

    def disabled(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


def test_cli_bench_reads_the_ratios_from_a_benchmark_json(tmp_path: Path) -> None:
    path = tmp_path / "benchmarks.json"
    extra = {
        "ops_per_s[ours]": 123,  # not a ratio
        "ratios": {
            "speedup_vs_limits": {"value": 5.5, "target": ">= 5", "met": True},
            "speed_vs_reference": {"value": 0.98, "target": "~1", "met": None},
            "broken": {"target": "no value"},
        },
    }
    path.write_text(
        json.dumps(
            {
                "benchmarks": [
                    {"name": "test_bench_stage1_a", "extra_info": extra},
                    {"name": "test_bench_stage1_b[64x]", "extra_info": {}},
                    {
                        "name": "test_bench_stage1_c[64x]",
                        "extra_info": {"ratios": {"cost": {"value": 4, "target": "<= 3"}}},
                    },
                    "not a benchmark",
                ]
            }
        ),
        encoding="utf-8",
    )
    assert cli_bench.read_ratios(path) == [
        cli_bench.Ratio("test_bench_stage1_a", "speedup_vs_limits", 5.5, ">= 5", True),
        cli_bench.Ratio("test_bench_stage1_a", "speed_vs_reference", 0.98, "~1", None),
        cli_bench.Ratio("test_bench_stage1_c[64x]", "cost", 4.0, "<= 3", None),
    ]
    assert cli_bench.read_ratios(tmp_path / "missing.json") == []
    path.write_text("{not json", encoding="utf-8")
    assert cli_bench.read_ratios(path) == []
    assert cli_bench.bench_ratios([1, 2]) == []


def test_cli_bench_reads_what_the_harness_records(capsys: pytest.CaptureFixture[str]) -> None:
    """The writer (the harness, in the child) and the reader (the CLI) agree on the format."""
    fake, captured = _FakeBenchmark(), cast(Any, _CapturedCapsys())
    bench.report(fake, captured, "rate_vs_heapq", 0.2345, ">= 0.15")
    bench.report(fake, captured, "cost_64k_over_1k", 3.5, "<= 3 (O(log n))")
    bench.report(fake, captured, "round_trips", 1.0, "== 1")
    bench.report(fake, captured, "speed_vs_reference", 1.02, "~1")
    bench.report(fake, captured, "nothing_measured", math.nan, ">= 1")
    printed = [ln.strip() for ln in capsys.readouterr().out.splitlines() if ln.strip()]
    assert printed == [
        "rate_vs_heapq = 0.234   (target: >= 0.15)   met",
        "cost_64k_over_1k = 3.500   (target: <= 3 (O(log n)))   NOT MET",
        "round_trips = 1.000   (target: == 1)   met",
        "speed_vs_reference = 1.020   (target: ~1)",
        "nothing_measured = nan   (target: >= 1)",
    ]
    data = json.loads(json.dumps({"benchmarks": [{"name": "t", "extra_info": fake.extra_info}]}))
    got = [(r.label, r.value, r.met) for r in cli_bench.bench_ratios(data)]
    assert got[:4] == [
        ("rate_vs_heapq", 0.234, True),
        ("cost_64k_over_1k", 3.5, False),
        ("round_trips", 1.0, True),
        ("speed_vs_reference", 1.02, None),
    ]
    assert got[4][0] == "nothing_measured" and math.isnan(got[4][1]) and got[4][2] is None
    assert cli_bench.RATIOS == bench.RATIOS
    assert cli_bench.ENV_BENCH_ROUNDS == bench.ENV_ROUNDS


def test_cli_bench_without_the_bench_extra_names_the_anchor_and_the_install_command(
    kata_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bench_file = kata_root / "calc" / "bench_stage1.py"
    write(
        bench_file,
        "import pytest\n\n"
        'json = pytest.importorskip("json")\n'
        "anchor = pytest.importorskip(\n"
        '    "kata_anchor_not_installed", reason="the anchors come with the [bench] extra"\n'
        ")\n\n\n"
        "def test_bench_stage1_vs_anchor():\n    pass\n",
    )
    assert cli_bench.missing_anchors(bench_file) == ["kata_anchor_not_installed"]
    assert main(["bench", "calc", "1"]) == 1
    out = capsys.readouterr().out
    assert "No ratios were reported: the benchmarks compare with kata_anchor_not_installed, " in out
    assert 'pip install -e ".[bench]"' in out, out


class _RoundsBenchmark(_FakeBenchmark):
    """A benchmark fixture whose ``pedantic`` runs the warm-up and every round in turn."""

    stats: object = "measured"

    def pedantic(self, target: Any, *, setup: Any, rounds: int, **_: Any) -> None:
        for _round in range(rounds + 1):  # the warm-up round first
            setup()
            target()


def test_cli_bench_shows_the_spread_of_the_rounds_and_says_within_noise(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reference against itself: 0.8 from the best rounds, but its rounds went both
    ways of 1, so the table and the line say the ratio is within noise."""
    monkeypatch.delenv(bench.ENV_ROUNDS, raising=False)
    times = {"yours": [5.0, 4.0, 6.0], "reference": [4.0, 5.0, 3.2]}  # seconds per round
    contenders = {
        name: bench.Contender(functools.partial(next, iter(t)), 1, self_timed=True)
        for name, t in times.items()
    }
    fake, captured = _RoundsBenchmark(), cast(Any, _CapturedCapsys())
    per_op = bench.interleaved(fake, contenders, 2)
    assert per_op == {"yours": 4.0, "reference": 3.2}
    bench.report(fake, captured, "speed_vs_reference", per_op["reference"] / per_op["yours"], "~1")
    bench.report(fake, captured, "reference_speedup", per_op["yours"] / per_op["reference"], ">= 1")
    bench.report(fake, captured, "scaled", per_op["yours"] * 1e6, ">= 1")  # no pair gives it
    printed = [ln.strip() for ln in capsys.readouterr().out.splitlines() if ln.strip()]
    assert printed == [
        "speed_vs_reference = 0.800   (target: ~1)   rounds 0.533–1.250: within noise",
        "reference_speedup = 1.250   (target: >= 1)   met   rounds 0.800–1.875: within noise",
        "scaled = 4000000.000   (target: >= 1)   met",
    ]
    data = json.loads(json.dumps({"benchmarks": [{"name": "t", "extra_info": fake.extra_info}]}))
    ratios = cli_bench.bench_ratios(data)
    assert [(r.spread, r.noise) for r in ratios] == [
        ((0.533, 1.25), True),
        ((0.8, 1.875), True),
        (None, False),
    ]
    console = Console(width=160, record=True, file=io.StringIO())
    console.print(cli_bench.ratios_table("ratios", ratios))
    table = console.export_text()
    row = next(ln for ln in table.splitlines() if "speed_vs_reference" in ln)
    assert "0.533–1.250" in row and "noise" in row, table
    row = next(ln for ln in table.splitlines() if "reference_speedup" in ln)
    assert "yes (noise)" in row, table


def test_cli_bench_rounds_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(bench.ENV_ROUNDS, raising=False)
    assert bench.capped_rounds(15) == 15
    monkeypatch.setenv(bench.ENV_ROUNDS, "2")
    assert bench.capped_rounds(15) == 2 and bench.capped_rounds(1) == 1
    monkeypatch.setenv(bench.ENV_ROUNDS, "0")
    with pytest.raises(ValueError, match="positive integer"):
        bench.capped_rounds(15)


def test_cli_bench_real_short_run(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``kata bench rate_limiter 2`` on the reference, one round: its ratios table."""
    monkeypatch.delenv(cat.ENV_ROOT, raising=False)
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.chdir(REPO)
    assert main(["bench", "rate_limiter", "2", "--impl", "solutions", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert "rate_limiter stage 2: ratios (at most 1 rounds: rough)" in out, out
    row = next(ln for ln in out.splitlines() if "striped_speed_vs_global_lock" in ln)
    assert re.search(r"\d+\.\d{3}\s+informational", row), row


# --- test: one-line errors, and a Details command that reruns the same selection -------------


@pytest.mark.parametrize(
    ("env", "argv", "expected"),
    [
        *(
            (
                {"KATA_PROFILE": "bogus"},
                [command, "calc", "1"],
                "KATA_PROFILE must be one of dev, ci, thorough, mutant, got 'bogus'",
            )
            for command in ("test", "pair", "bench")
        ),
        ({}, ["test", "calc", "1", "--impl=solution"], "--impl must be 'katas', 'solutions' or"),
        ({"KATA_IMPL": "/nope"}, ["test", "calc", "1"], "KATA_IMPL must be 'katas', 'solutions'"),
        ({"KATA_IMPL": "/nope"}, ["pair", "calc", "1"], "got '/nope'"),
    ],
)
def test_cli_bad_environment_is_one_line_and_exit_2(
    kata_root: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    env: dict[str, str],
    argv: list[str],
    expected: str,
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(argv) == 2
    captured = capsys.readouterr()
    line = _one_error_line(captured.err)
    assert line.startswith(f"kata {argv[0]}: error: ") and expected in line, line
    assert captured.out == ""


@pytest.mark.parametrize("command", ["test", "pair"])
def test_cli_a_deleted_stage_file_is_one_line_pointing_at_reset(
    kata_root: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    (kata_root / "calc" / "stage1.py").unlink()
    assert main([command, "calc", "1"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "calc/stage1.py does not exist (your stage file)" in line, line
    assert line.endswith("restore the stub with: kata reset calc 1"), line
    reference = str(kata_root.parent / "solutions")
    assert main(["test", "calc", "1", "--impl", reference, "--", "-k", "add"]) == 0  # not yours


@pytest.mark.parametrize(
    ("options", "shown"),
    [
        (
            ["--base", "reference", "--core"],
            "kata test calc 1 --base reference --core -v -- -k test_stage1_mul",
        ),
        (
            ["--impl", "IMPL", "--thorough", "--", "--tb=short", "-k", "mul or sub"],
            "kata test calc 1 --impl IMPL --thorough -v -- --tb=short -k 'mul or sub' "
            "-k test_stage1_mul",
        ),
    ],
)
def test_cli_test_details_command_reruns_the_same_selection(
    kata_root: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    options: list[str],
    shown: str,
) -> None:
    wrong_mul = CALC_SOLUTION.replace("return a * b", "return a + b")
    write(kata_root / "calc" / "stage1.py", wrong_mul)  # the learner's copy
    impl = kata_root.parent / "mine"  # and another one, laid out like solutions/
    write(impl / "calc" / "__init__.py", "")
    write(impl / "calc" / "stage1.py", wrong_mul)
    options = [str(impl) if o == "IMPL" else o for o in options]
    calls: list[tuple[dict[str, Any], SuiteRun]] = []

    def recording_run_suite(suite: Path, **kwargs: Any) -> SuiteRun:
        result = run_suite(suite, **kwargs)
        calls.append((kwargs, result))
        return result

    monkeypatch.setattr(cli_test, "run_suite", recording_run_suite)
    assert main(["test", "calc", "1", *options]) == 1
    out = capsys.readouterr().out
    details = next(ln for ln in out.splitlines() if ln.startswith("Details: "))
    assert details == f"Details: {shown.replace('IMPL', str(impl))}", details

    argv = shlex.split(details.removeprefix("Details: "))
    assert argv[0] == "kata"
    assert main(argv[1:]) == 1
    (first, first_run), (again, again_run) = calls
    for option in ("impl", "base", "core_only", "thorough"):
        assert again[option] == first[option], option
    assert again["pytest_args"] == [*first["pytest_args"], "-k", "test_stage1_mul"]
    assert again["live"] is True
    # the same tests, narrowed to the failure (-k matches names containing it)
    assert {r.nodeid for r in again_run.results} == {
        r.nodeid for r in first_run.results if "test_stage1_mul" in r.name
    }
    assert "test_stage1_mul" in {r.name for r in again_run.results}


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not on PATH")
def test_cli_list_in_an_80_column_terminal(tmp_path: Path) -> None:
    """``kata list`` in a real 80×24 terminal: nothing wraps, and "Next:" is on screen.

    A list longer than the screen scrolls: the check reads the pane's history too."""
    socket = f"kata-list-{os.getpid()}"
    tmux = ["tmux", "-L", socket, "-f", "/dev/null"]
    kata = shlex.join(_support.kata_command())
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path),
        "TERM": "xterm-256color",
        "XDG_STATE_HOME": str(tmp_path / "xdg-state"),
        "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
    }
    assignments = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    command = f"cd {shlex.quote(str(REPO))} && env -u COLUMNS {assignments} {kata} list; "
    command += "echo KATA_EXIT=$?; sleep 30"
    subprocess.run(
        [*tmux, "new-session", "-d", "-s", "kata", "-x", "80", "-y", "24", command], check=True
    )
    try:
        deadline = time.monotonic() + 20
        screen = ""
        while time.monotonic() < deadline and "KATA_EXIT=" not in screen:
            time.sleep(0.1)
            shown = subprocess.run(
                [*tmux, "capture-pane", "-p", "-J", "-S", "-", "-t", "kata"],
                capture_output=True,
                text=True,
                check=False,
            )
            screen = shown.stdout
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True, check=False)
    assert "KATA_EXIT=0" in screen, screen
    lines = screen.rstrip().splitlines()
    assert max(len(line) for line in lines) <= 80, screen  # -J: a wrapped line would be joined
    stages = sum(len(k.stages) for k in cat.Catalog(REPO / "katas").katas())
    assert len([ln for ln in lines if STAGE_ROW.match(ln)]) == stages, screen
    assert lines[0].split()[:2] == ["#", "stage"], screen  # the header comes first
    assert any(ln.startswith("Next: kata show ") for ln in lines), screen


# --- practice units: a part of a stage run alone --------------------------------------------

#: calc's stage 1 in two units: ``adding`` (its add test alone) and ``rest``.
CALC_UNITS = """
[[stages.units]]
name = "adding"
keyword = "add"
file = "stage1.py"
core = "Calc.add"

[[stages.units]]
name = "rest"
keyword = "not add"
file = "stage1.py"
core = "Calc.mul, Calc.sub, Calc.div"
"""
CALC_TOML_UNITS = CALC_TOML.replace(
    'extended = "Calc.sub, Calc.div"\n', 'extended = "Calc.sub, Calc.div"\n' + CALC_UNITS
)


def test_cli_units_are_read_from_kata_toml_and_named_by_a_wrong_name(kata_root: Path) -> None:
    write(kata_root / "calc" / "kata.toml", CALC_TOML_UNITS)
    stage = cat.Catalog(kata_root).get("calc").stage(1)
    assert [(u.name, u.keyword, u.file) for u in stage.units] == [
        ("adding", "add", "stage1.py"),
        ("rest", "not add", "stage1.py"),
    ]
    assert stage.unit("rest").core == "Calc.mul, Calc.sub, Calc.div"
    with pytest.raises(cat.CatalogError, match="stage 1 has the units adding, rest, got 'x'"):
        stage.unit("x")
    with pytest.raises(cat.CatalogError, match="stage 2 has no units"):
        cat.Catalog(kata_root).get("calc").stage(2).unit("adding")


def test_cli_the_file_a_not_implemented_message_points_into() -> None:
    stage = cat.Catalog(REPO / "katas").get("dynamic_batcher").stage(1)
    c = "hp_schedule — see katas/dynamic_batcher/csrc/hotpath.h"
    assert stage.file_for(c) == "csrc/hotpath.c"
    assert stage.file_for("ContinuousBatcher.step — stage 1, see katas/x/README.md") == "stage1.py"


@pytest.mark.parametrize(
    ("units", "expected"),
    [
        (CALC_UNITS.replace('file = "stage1.py"', 'file = "x.c"', 1), "units[0].file must be one"),
        (CALC_UNITS.replace('name = "rest"', 'name = "adding"'), "units[1].name 'adding' names"),
        (CALC_UNITS.replace('keyword = "add"', 'keywords = "add"'), "units[0].keywords is not"),
        (CALC_UNITS.replace('core = "Calc.add"\n', ""), "units[0].core is missing"),
    ],
)
def test_cli_a_broken_unit_names_the_file_and_field(
    kata_root: Path, capsys: pytest.CaptureFixture[str], units: str, expected: str
) -> None:
    toml = CALC_TOML.replace('extended = "Calc.sub, Calc.div"\n', f'extended = "x"\n{units}')
    write(kata_root / "calc" / "kata.toml", toml)
    assert main(["list"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "calc/kata.toml: stages[0]." in line and expected in line, line


def test_cli_test_a_unit_runs_its_tests_alone_and_is_not_the_stages_result(
    kata_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write(kata_root / "calc" / "kata.toml", CALC_TOML_UNITS)
    assert main(["test", "calc", "1", "--unit", "adding"]) == 0  # green for the unit
    out = capsys.readouterr().out
    assert "1/1 passed" in out and "(unit adding: stage1.py)" in out, out
    assert main(["test", "calc", "1", "--unit", "rest"]) == 1
    out = capsys.readouterr().out
    assert "1/5 passed" in out and "test_stage1_sub" in out, out  # all but add: profile passes
    assert "kata test calc 1 --unit rest -v -- -k" in out, out  # details: the same unit
    assert StateStore().load().results == {}  # `kata list` still says what the stage does
    assert main(["show", "calc", "1"]) == 0
    out = capsys.readouterr().out
    assert "Unit adding (stage1.py), alone: kata test calc 1 --unit adding · Calc.add" in out
    assert main(["test", "calc", "1", "--unit", "nope"]) == 2
    assert "stage 1 has the units adding, rest, got 'nope'" in capsys.readouterr().err


def test_kata_test_with_a_redis_that_does_not_answer_is_a_configuration_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Said once, before any test runs, with exit code 2: no change to the code fixes it.
    monkeypatch.setenv("KATA_REDIS_URL", "redis://127.0.0.1:1/0")
    monkeypatch.delenv("KATA_REDIS_SERVER", raising=False)
    code = main(["test", "rate_limiter", "3", "--impl", "solutions"])
    captured = capsys.readouterr()
    out = captured.out + captured.err
    assert code == 2, out
    assert "KATA_REDIS_URL=redis://127.0.0.1:1/0: nothing answers at 127.0.0.1:1" in out, out
    assert len(out.strip().splitlines()) == 1, out


def test_a_units_attempt_is_green_for_the_unit_and_not_the_stage() -> None:
    from katas._cli.state import Practice

    unit = {"kata": "k", "stage": 1, "unit": "hotpath", "started": 1.0, "green_seconds": 60.0}
    stage = {"kata": "k", "stage": 1, "started": 2.0, "green_seconds": None}
    state = Practice([Attempt.from_json(unit), Attempt.from_json(stage)], {}, {})
    assert state.status("k", 1) == "failing" and state.best_seconds("k", 1) is None
    assert not state.passed("k", 1)
    assert state.units_attempted("k", 1) == ["hotpath"]
    assert state.unit_status("k", 1, "hotpath") == "passed"
    assert state.best_seconds("k", 1, "hotpath") == 60.0
