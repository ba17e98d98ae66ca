"""The pieces under ``kata start``: the suite run that goes on while the session reads keys
(:class:`~katas._kit.suites.SuiteProcess`), the failure detail the report carries, alike
failures shown once.

Everything runs against a tiny kata, ``calc``, made in a temporary folder (``KATA_ROOT``),
with progress in a temporary state directory.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from _support import (
    CALC_SOLUTION,
    CALC_SUITE,
    calc_project,
    private_state,
    write,
)

from katas._kit.cli import main
from katas._kit.pytest_plugin import assertion_detail
from katas._kit.suites import SuiteRun, run_suite, start_suite

#: A hard deadline for anything a test waits for in real time.
DEADLINE_S = 30.0

TOML = """\
title = "Calculator"
summary = "A kata that exists only for the CLI's own tests."

[[stages]]
number = 1
title = "Add and multiply"
timebox_minutes = 10
core = "Calc.add, Calc.mul"
extended = "Calc.sub"

[[stages]]
number = 2
title = "Divide"
timebox_minutes = 10
core = "Calc.div"
"""

README = """\
# Calculator

INTRO_MARK

## Stage 1

### The problem

STAGE1_MARK: add and multiply.

STAGE1_SECOND_MARK: the rest of the prompt.

## Stage 2

STAGE2_MARK
"""

HINTS = """\
# Calculator — hints

## Stage 1

### Hint 1

HINT_ONE_MARK: use `+`.

### Hint 2

HINT_TWO_MARK: use `*`.
"""

STUB = """\
class Calc:
    def add(self, a: int, b: int) -> int:
        raise NotImplementedError("Calc.add — stage 1, see calc/README.md")

    def mul(self, a: int, b: int) -> int:
        raise NotImplementedError("Calc.mul — stage 1, see calc/README.md")

    def sub(self, a: int, b: int) -> int:
        raise NotImplementedError("Calc.sub — stage 1, see calc/README.md")
"""

#: The stage-1 suite with one more core test that fails the way real suites do: the
#: invariant first, expected and got below it.
SUITE = (
    CALC_SUITE
    + """

@pytest.mark.core
def test_stage1_add_is_symmetric(stage_module):
    got = stage_module.Calc().add(3, 2)
    assert got == 5, f"stage 1: add(3, 2) is add(2, 3)\\n  expected 5\\n  got      {got}"
"""
)

#: add and mul wrong alike, sub right.
OFF_BY_ONE = CALC_SOLUTION.replace("return a + b", "return a + b + 1")

#: ``mul`` misses its colon: a syntax error on line 5.
SYNTAX_ERROR = CALC_SOLUTION.replace(
    "def mul(self, a: int, b: int) -> int:", "def mul(self, a: int, b: int) -> int"
)

#: A stage whose add never returns, after saying so in ``LOOPING`` (with the pid of a
#: process it started, which must go when the run is killed).
ENDLESS = """\
import os
import subprocess
import sys


class Calc:
    def add(self, a: int, b: int) -> int:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        with open(os.environ.get("LOOPING", os.devnull), "w") as mark:
            mark.write(str(child.pid))
        while True:
            pass

    def mul(self, a: int, b: int) -> int:
        return a * b

    def sub(self, a: int, b: int) -> int:
        return a - b
"""


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A project with one kata, ``calc`` (two stages in kata.toml, a suite for stage 1)."""
    project = tmp_path / "proj"
    calc_project(
        project,
        monkeypatch,
        kata={
            "kata.toml": TOML,
            "README.md": README,
            "HINTS.md": HINTS,
            "stage1.py": STUB,
            "test_stage1.py": SUITE,
        },
        solution=CALC_SOLUTION,
    )
    private_state(tmp_path, monkeypatch)
    return project


def _stage_file(project: Path) -> Path:
    return project / "katas" / "calc" / "stage1.py"


def _suite(project: Path) -> Path:
    return project / "katas" / "calc" / "test_stage1.py"


def _state_file(project: Path) -> Path:
    return project.parent / "xdg-state" / "infra-katas" / "state.json"


def _attempts(project: Path) -> list[dict[str, Any]]:
    attempts: list[dict[str, Any]] = json.loads(_state_file(project).read_text())["attempts"]
    return attempts


def _solve(project: Path, text: str = CALC_SOLUTION) -> Callable[[], None]:
    return lambda: write(_stage_file(project), text)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (Linux /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _group_members(pgid: int) -> list[int]:
    """Live processes of process group ``pgid``."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


def _until(check: Callable[[], bool], what: str, timeout_s: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"{what} within {timeout_s} s"
        time.sleep(0.02)


# --- the run that goes on while the session reads keys -----------------------------------------


def test_suite_process_killed_mid_run_takes_its_whole_process_group_along(
    project: Path, tmp_path: Path
) -> None:
    write(_stage_file(project), ENDLESS)
    looping = tmp_path / "looping"
    run = start_suite(_suite(project), env=dict(os.environ, LOOPING=str(looping)))
    try:
        _until(lambda: looping.is_file() and looping.read_text().isdigit(), "the loop starts")
        child = int(looping.read_text())
        assert _alive(child) and run.pid in _group_members(run.pid)
        assert run.poll() is None and run.wait(0.01) is None  # endless: still running
        run.kill()
        assert run.poll() is None and run.wait(0) is None  # a killed run has no result
        _until(lambda: not _group_members(run.pid), "every process of the group is gone")
        assert not _alive(child)
        run.kill()  # a no-op the second time
    finally:
        run.kill()


def test_run_suite_past_its_timeout_kills_the_run(project: Path, tmp_path: Path) -> None:
    write(_stage_file(project), ENDLESS)
    looping = tmp_path / "looping"
    env = dict(os.environ, LOOPING=str(looping))
    for timeout_s in (3, 6, 12):  # on a busy machine pytest may need longer to reach the loop
        with pytest.raises(subprocess.TimeoutExpired):
            run_suite(
                _suite(project), env=env, keyword="add and not symmetric", timeout_s=timeout_s
            )
        if looping.is_file() and looping.read_text().isdigit():
            break
    child = int(looping.read_text())
    _until(lambda: not _alive(child), "the run's own child process is gone")


def test_suite_process_result_reads_like_run_suite(project: Path) -> None:
    write(_stage_file(project), OFF_BY_ONE)
    blocking = run_suite(_suite(project))
    run = start_suite(_suite(project))
    result = run.wait(DEADLINE_S)
    assert isinstance(result, SuiteRun)
    assert run.poll() is result and run.wait(0) is result
    run.kill()  # finished: nothing to kill, the result stays
    assert run.poll() is result
    assert result.returncode == blocking.returncode == 1
    assert result.results == blocking.results
    assert "failed" in result.output
    by_name = {r.test_id: r for r in result.results}
    assert by_name["test_stage1_add"].message == "assert 6 == 5"
    assert by_name["test_stage1_add_is_symmetric"].detail == "expected 5, got 6"
    assert by_name["test_stage1_sub"].outcome == "passed"


def test_report_detail_of_errors_and_syntax_errors(project: Path) -> None:
    write(_stage_file(project), CALC_SOLUTION.replace("return a * b", "return a * None"))
    result = run_suite(_suite(project), keyword="mul")
    (failure,) = result.failures()
    assert failure.kind == "error" and failure.message.startswith("TypeError: unsupported")
    assert failure.detail == "stage1.py:6 in mul: return a * None", failure

    write(_stage_file(project), SYNTAX_ERROR)
    result = run_suite(_suite(project))
    assert {(r.kind, r.message, r.detail) for r in result.results} == {
        (
            "error",
            "SyntaxError: expected ':' (stage1.py, line 5)",
            "def mul(self, a: int, b: int) -> int",
        )
    }


@pytest.mark.parametrize(
    ("text", "detail"),
    [
        (  # a story: its conclusion
            "stage 1: the decision differs\n  t=+0 acquire -> D(1)\n"
            "  => remaining: expected 0, got -1\nassert D(1) == D(0)",
            "remaining: expected 0, got -1",
        ),
        (  # expected and got on lines of their own, and a line with both
            "stage 1: not yet\n    expected D(0)\n    got      D(-1)\n    (remaining: expected 0, "
            "got -1)\nassert D(...) == D(...)",
            "remaining: expected 0, got -1",
        ),
        ("stage 1: add\n  expected 5\n  got      6\nassert 6 == 5", "expected 5, got 6"),
        (  # the first line says it, at its end: a narrow screen cuts it off
            "stage 1: keys in recency order, least recent first: expected ['c'], got ['a']\nassert",
            "expected ['c'], got ['a']",
        ),
        ("sub(5, 3) must be 2, got 8\nassert 8 == 2\n +  where 8 = sub(5, 3)", "assert 8 == 2"),
        (  # pytest abbreviated both sides: its diff says more
            "stage 1: heard\nassert [('k', 'old',...)] == [('k', 'old',...)]\n  \n"
            "  At index 0 diff: ('k', 'old', 'replaced') != ('k', 'old', 'expired')\n"
            "  Use -v to get more diff",
            "At index 0 diff: ('k', 'old', 'replaced') != ('k', 'old', 'expired')",
        ),
        ("assert 6 == 5\n +  where 6 = add(2, 3)", ""),  # a bare assert: the message says it
        ("stage 1: ack was accepted (expected StaleLease)", ""),
    ],
)
def test_assertion_detail_is_the_expected_got_line(text: str, detail: str) -> None:
    assert assertion_detail(text) == detail


# --- kata test's summary and the start view: details, alike failures once --------------------


def test_cli_test_summary_shows_details_and_collapses_alike_failures(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write(_stage_file(project), OFF_BY_ONE.replace("return a * b", 'raise ValueError("boom")'))
    assert main(["test", "calc", "1"]) == 1
    out = capsys.readouterr().out
    assert "✗ test_stage1_add — assert 6 == 5" in out, out
    assert "✗ test_stage1_add_is_symmetric — stage 1: add(3, 2) is add(2, 3)" in out, out
    assert "\n    expected 5, got 6\n" in out, out
    assert "! test_stage1_mul — ValueError: boom\n    stage1.py:6 in mul: raise" in out, out

    write(
        _stage_file(project),
        CALC_SOLUTION.replace("return a + b", 'raise ValueError("boom")').replace(
            "return a * b", 'raise ValueError("boom")'
        ),
    )
    assert main(["test", "calc", "1"]) == 1
    out = capsys.readouterr().out
    assert out.count("ValueError: boom") == 1, out
    assert "! test_stage1_add — ValueError: boom" in out, out
    assert (
        "… and 2 more tests with this error: test_stage1_mul, test_stage1_add_is_symmetric" in out
    )


def test_cli_test_shows_a_syntax_error_once_with_its_line(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write(_stage_file(project), SYNTAX_ERROR)
    assert main(["test", "calc", "1"]) == 1
    out = capsys.readouterr().out
    line = "! SyntaxError: expected ':' (stage1.py, line 5) — in all 4 tests"
    assert line in out and out.count("SyntaxError") == 1, out
    assert "    def mul(self, a: int, b: int) -> int\n" in out, out
    assert "0/4 passed" in out, out
