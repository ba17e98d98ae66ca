"""``kata start`` end to end, and the pieces under it: the suite run that goes on while the
session reads keys (:class:`~katas._registry.suites.SuiteProcess`), the failure detail the
report carries, alike failures shown once, the next step after green, bad configuration.

Everything runs against a tiny kata, ``calc``, made in a temporary folder (``KATA_ROOT``),
with progress in a temporary state directory. Sessions run on a ManualClock driven by a
scripted terminal; a run in progress is either a real pytest subprocess (the clock stands
still while it runs, so it takes no scripted time) or a scripted run whose waiting moves
the clock. Two tests run a real session in tmux and read the screen.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest
from _support import (
    CALC_KATA,
    CALC_README,
    CALC_README_STAGE2,
    CALC_SOLUTION,
    CALC_SUITE,
    CALC_TOML,
    CALC_TOML_STAGE2,
    ScriptedTerminal,
    Tmux,
    attempts,
    practice_project,
    run_kata,
    state,
    state_file,
    write,
)
from rich.console import Console

from katas._cli.cli import main
from katas._cli.cli_start import _after_stage
from katas._cli.cliutil import Context
from katas._cli.practice import SoloOutcome, SoloSession, verdict
from katas._cli.summary import print_failing_lines, show_difference
from katas._cli.watch import Watcher
from katas._harness.failures import assertion_detail
from katas._registry import catalog as cat
from katas._registry.suites import SuiteRun, TestResult, run_suite, start_suite
from katas._registry.warm import WarmStart
from katas._runtime.clock import NS_PER_S, ManualClock

#: A hard deadline for anything a test waits for in real time.
DEADLINE_S = 30.0

#: calc with a second stage, so that green names the next one.
TOML = CALC_TOML + CALC_TOML_STAGE2

README = CALC_README + CALC_README_STAGE2

#: The stage-1 suite with one more core test that fails the way real suites do: the
#: invariant first, expected and got below it.
SUITE = (
    CALC_SUITE
    + """

@pytest.mark.core
def test_stage1_add_is_symmetric(stage_module):
    got = stage_module.Calc().add(3, 2)
    assert got == 5, f"add(3, 2) is add(2, 3)\\n  expected 5\\n  got      {got}"
"""
)

#: add and mul wrong alike, sub right.
OFF_BY_ONE = CALC_SOLUTION.replace("return a + b", "return a + b + 1")

#: ``mul`` misses its colon: a syntax error on line 5.
SYNTAX_ERROR = CALC_SOLUTION.replace(
    "def mul(self, a: int, b: int) -> int:", "def mul(self, a: int, b: int) -> int"
)

#: A stage whose add never returns: a plain endless loop on line 4.
HANGS = CALC_SOLUTION.replace("return a + b", "while True:\n            pass")

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
    kata = {**CALC_KATA, "kata.toml": TOML, "README.md": README, "test_stage1.py": SUITE}
    return practice_project(tmp_path, monkeypatch, kata=kata)


def _stage_file(project: Path) -> Path:
    return project / "katas" / "calc" / "stage1.py"


def _suite(project: Path) -> Path:
    return project / "katas" / "calc" / "test_stage1.py"


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


def _parent(pid: int) -> int:
    """The parent process id of ``pid`` (Linux /proc)."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


# --- the run that goes on while the session reads keys -----------------------------------------


@pytest.fixture(params=["cold", "warm"])
def warm(request: pytest.FixtureRequest) -> Iterator[WarmStart | None]:
    """No warm start (pytest started as a process of its own), or one (forked from it)."""
    if request.param == "cold":
        yield None
        return
    found = WarmStart()
    yield found
    found.close()


def test_suite_process_killed_mid_run_takes_its_whole_process_group_along(
    project: Path, tmp_path: Path, warm: WarmStart | None
) -> None:
    write(_stage_file(project), ENDLESS)
    looping = tmp_path / "looping"
    run = start_suite(_suite(project), env=dict(os.environ, LOOPING=str(looping)), warm=warm)
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


def test_suite_process_result_reads_like_run_suite(project: Path, warm: WarmStart | None) -> None:
    write(_stage_file(project), OFF_BY_ONE)
    blocking = run_suite(_suite(project))
    run = start_suite(_suite(project), warm=warm)
    result = run.wait(DEADLINE_S)
    assert isinstance(result, SuiteRun)
    assert run.poll() is result and run.wait(0) is result
    run.kill()  # finished: nothing to kill, the result stays
    assert run.poll() is result
    assert result.returncode == blocking.returncode == 1
    assert result.results == blocking.results
    assert "failed" in result.output
    by_name = {r.test_id: r for r in result.results}
    assert by_name["test_stage1_add"].message == "stage 1: assert 6 == 5"  # tagged by the plugin
    assert by_name["test_stage1_add_is_symmetric"].detail == "expected 5, got 6"
    assert by_name["test_stage1_sub"].outcome == "passed"


def test_warm_start_forks_each_run_in_its_own_environment_and_ends_with_close(
    project: Path, tmp_path: Path
) -> None:
    write(_stage_file(project), OFF_BY_ONE)
    warm = WarmStart()
    try:
        first = start_suite(_suite(project), warm=warm)
        server = _parent(first.pid)
        assert server != os.getpid()
        ran = first.wait(DEADLINE_S)
        second = start_suite(_suite(project), warm=warm)
        assert _parent(second.pid) == server  # the same warm process
        again = second.wait(DEADLINE_S)
        assert ran is not None and again is not None and ran.results == again.results
        assert ran.returncode == again.returncode == 1
        write(_stage_file(project), ENDLESS)  # writes its pid to $LOOPING, then loops
        looping = tmp_path / "looping"
        elsewhere = start_suite(
            _suite(project), warm=warm, env=dict(os.environ, LOOPING=str(looping))
        )
        assert _parent(elsewhere.pid) == server  # another environment: forked all the same
        _until(lambda: looping.is_file() and looping.read_text().isdigit(), "it sees $LOOPING")
        elsewhere.kill()
    finally:
        warm.close()
    _until(lambda: not _alive(server), "the warm process ends with close")


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
    assert "✗ test_stage1_add_is_symmetric — add(3, 2) is add(2, 3)" in out, out
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


def test_cli_start_view_shows_details_and_a_syntax_error_once(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The first run and one after ``a`` run every test; a save runs what failed last
    first and stops at the first failure."""
    write(_stage_file(project), OFF_BY_ONE)
    code, _ = run_kata(
        ["start", "calc", "1", "--no-prompt"],
        events=[
            (10, _solve(project, SYNTAX_ERROR)),
            (20, "a"),
            (30, _solve(project, OFF_BY_ONE)),
            (40, "q"),
        ],
    )
    out = capsys.readouterr().out
    assert code == 1, out
    assert "[00:00] 1/3 passed in" in out and "\n      expected 5, got 6\n" in out, out
    assert "[00:20] 0/3 passed in" in out, out
    assert out.count("SyntaxError: expected ':'") == 2, out  # once a run
    assert "— in all 3 tests" in out, out
    # all three failed last; test_stage1_add runs first, fails, and the run stops there
    assert "[00:30] 0 passed, then a failure; 2 not run in" in out, out
    assert "s (a runs them all)\n  ✗ test_stage1_add — assert 6 == 5\n" in out, out


#: A core test whose expected and got values are alike for 150 characters.
ROW_TEST = """

@pytest.mark.core
def test_stage1_adds_a_row(stage_module):
    calc = stage_module.Calc()
    want = [1000 + i for i in range(30)]
    got = [calc.add(1000, i) for i in range(30)]
    assert got == want, f"each sum of the row\\n  expected {want}\\n  got      {got}"
"""

#: add is one off for b == 25 only: the row differs at its 26th number.
ONE_SUM_OFF = CALC_SOLUTION.replace("return a + b", "return a + b + (b == 25)")


#: Thirty numbers, and the same with the 26th one off.
ROW = list(range(1000, 1030))
ROW_OFF = [*range(1000, 1025), 1026, *range(1026, 1030)]


@pytest.mark.parametrize(
    ("line", "width", "shown"),
    [
        ("    expected 5, got 6", 30, "    expected 5, got 6"),  # it fits: as it is
        (
            f"    expected {ROW}, got {ROW_OFF}",
            100,
            "    expected …3, 1024, 1025, 1026, 1027, 1028, 1029], "
            "got …3, 1024, 1026, 1026, 1027, 1028, 1029]",
        ),
        (
            "    At index 0 diff: "
            "'abcdefghijklmnopqrstuvwxyz-0123456789-left' != "
            "'abcdefghijklmnopqrstuvwxyz-0123456789-right'",
            80,
            "    At index 0 diff: …-0123456789-left' != …-0123456789-right'",
        ),
        (  # several fields: each pair is cut around its own difference
            f"    n: expected 1, got 2; m: expected 'x{'y' * 60}a', got 'x{'y' * 60}b'",
            80,
            "    n: expected 1, got 2; m: expected …yyyyyyyyyyyya', got …yyyyyyyyyyyyb'",
        ),
    ],
)
def test_show_difference_keeps_the_first_difference_in_sight(
    line: str, width: int, shown: str
) -> None:
    assert show_difference(line, width) == shown
    assert len(shown) <= width


def test_cli_start_cuts_a_long_expected_got_line_around_the_difference(
    project: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "100")
    write(_suite(project), SUITE + ROW_TEST)
    write(_stage_file(project), ONE_SUM_OFF)
    code, _ = run_kata(["start", "calc", "1", "--no-prompt"], events=[(5, "q")])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "✗ test_stage1_adds_a_row — each sum of the row" in out, out
    (detail,) = [line for line in out.splitlines() if line.startswith("      expected ")]
    assert len(detail) <= 100, detail
    assert "1024, 1025, 1026" in detail and "1024, 1026, 1026" in detail, detail


#: A stage whose add kills the test process with SIGSEGV, as a crash in C would.
CRASHES = "import os\nimport signal\n\n\n" + CALC_SOLUTION.replace(
    "return a + b", "os.kill(os.getpid(), signal.SIGSEGV)\n        return 0"
)


def test_cli_start_a_crashed_run_is_one_crashed_line_never_0_of_0(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write(_stage_file(project), CRASHES)
    code, _ = run_kata(["start", "calc", "1", "--no-prompt"], events=[(10, _solve(project))])
    out = capsys.readouterr().out
    assert code == 0, out
    crashed = [line for line in out.splitlines() if line.startswith("[") and "crashed" in line]
    assert len(crashed) == 1, out
    (line,) = crashed
    assert "] crashed: test_stage1_add — the process died of SIGSEGV at stage1.py:" in line, out
    # one line, no more: the signal, where, and the line of code
    assert re.search(r"stage1\.py:\d+ in add: os\.kill\(.*\), after \d+\.\ds$", line), line
    assert "0/0 passed" not in out, out
    assert "green in 00:10" in out, out


def test_cli_start_shows_a_syntax_error_that_stops_collection_once_and_goes_on(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A suite that imports the stage file itself: a syntax error there stops collection,
    so there are no results at all; the line is found in pytest's output."""
    importing = "import os, sys\nsys.path.insert(0, os.path.dirname(__file__))\nimport stage1\n"
    write(_suite(project), importing + SUITE)
    write(_stage_file(project), SYNTAX_ERROR)
    code, _ = run_kata(["start", "calc", "1", "--no-prompt"], events=[(30, _solve(project))])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "[00:00] 0/0 passed" in out, out
    assert "! SyntaxError: expected ':' (stage1.py, line 5) — pytest could not collect" in out
    assert out.count("SyntaxError") == 1, out
    assert "green in 00:30" in out, out


# --- a session while tests run: scripted runs -------------------------------------------------


def _result(*outcomes: str) -> SuiteRun:
    results = tuple(
        TestResult(f"t.py::test_{i}", o, None if o == "passed" else "assertion", "")
        for i, o in enumerate(outcomes)
    )
    return SuiteRun(1 if "failed" in outcomes else 0, results, "", 1.0)


class ScriptedRun:
    """A run that finishes ``takes_s`` of clock time after it starts (None: never); waiting
    for it moves the clock, as real time passes while a real run goes on."""

    def __init__(
        self, clock: ManualClock, result: SuiteRun, takes_s: float | None, whole: bool = True
    ) -> None:
        self.clock = clock
        self.result = result
        self.whole = whole  # every test, or what failed last first up to the first failure
        self.done_ns = None if takes_s is None else clock.now_ns() + int(takes_s * NS_PER_S)
        self.killed = False

    def wait(self, timeout_s: float | None = None) -> SuiteRun | None:
        assert not self.killed, "waited for a killed run"
        now = self.clock.now_ns()
        if self.done_ns is not None and self.done_ns <= now:
            return self.result
        step = round((timeout_s or 0) * NS_PER_S)
        if self.done_ns is not None and self.done_ns <= now + step:
            self.clock.advance(self.done_ns - now)
            return self.result
        self.clock.advance(step)
        return None

    def kill(self) -> None:
        self.killed = True


@contextlib.contextmanager
def _scripted_session(
    tmp_path: Path,
    runs: Sequence[tuple[SuiteRun, float | None]],
    events: Sequence[tuple[float, str | Callable[[], None]]],
    timebox_s: float = 600,
) -> Iterator[tuple[SoloSession, list[ScriptedRun], list[tuple[SuiteRun, int]], io.StringIO]]:
    clock = ManualClock()
    started: list[ScriptedRun] = []
    finished: list[tuple[SuiteRun, int]] = []
    script = list(runs)

    def start_run(whole: bool) -> ScriptedRun:
        result, takes_s = script.pop(0)
        started.append(ScriptedRun(clock, result, takes_s, whole))
        return started[-1]

    out = io.StringIO()
    write(tmp_path / "kata" / "stage1.py", "")
    session = SoloSession(
        clock=clock,
        terminal=ScriptedTerminal(clock, events),
        console=Console(file=out, width=100),
        timebox_ns=int(timebox_s * NS_PER_S),
        watcher=Watcher([tmp_path / "kata"]),
        start_run=start_run,
        on_result=lambda result, ns: finished.append((result, ns)),
        on_hint=lambda: None,
    )
    yield session, started, finished, out


def _seconds(outcome: SoloOutcome) -> float:
    return outcome.elapsed_ns / NS_PER_S


def test_session_q_while_a_run_goes_on_ends_at_once_and_kills_it(tmp_path: Path) -> None:
    with _scripted_session(tmp_path, [(_result("passed"), None)], [(5, "q")]) as scripted:
        session, started, finished, _ = scripted
        outcome = session.run()
    assert outcome.result == "stopped" and 5 <= _seconds(outcome) <= 5.1, outcome
    assert [run.killed for run in started] == [True] and finished == []
    assert outcome.runs == 0 and outcome.last is None


def test_session_ctrl_c_while_a_run_goes_on_kills_it(tmp_path: Path) -> None:
    with _scripted_session(tmp_path, [(_result("passed"), None)], [(3, "^C")]) as scripted:
        session, started, _, _ = scripted
        outcome = session.run()
    assert outcome.result == "interrupted" and [run.killed for run in started] == [True]


def test_session_r_and_a_save_while_a_run_goes_on_start_a_fresh_one(tmp_path: Path) -> None:
    failing, green = _result("failed", "passed"), _result("passed", "passed")
    runs = [(failing, None), (failing, None), (green, 2)]
    events: list[tuple[float, str | Callable[[], None]]] = [
        (3, "r"),
        (7, lambda: write(tmp_path / "kata" / "stage1.py", "x = 1\n")),
    ]
    with _scripted_session(tmp_path, runs, events) as (session, started, finished, out):
        outcome = session.run()
    assert [run.killed for run in started] == [True, True, False]
    assert outcome.result == "green" and outcome.restarts == 2, outcome
    assert finished == [(green, finished[0][1])] and outcome.runs == 1
    assert 7 <= (outcome.green_ns or 0) / NS_PER_S <= 7.6, outcome  # the save's run
    shown = out.getvalue()
    assert "[00:03] restarted: run now" in shown and "restarted: saved stage1.py" in shown, shown


def test_session_runs_all_first_and_after_a_but_up_to_a_failure_after_a_save_or_r(
    tmp_path: Path,
) -> None:
    failing = _result("failed", "passed")
    runs = [(failing, 1.0)] * 4 + [(_result("passed", "passed"), 1.0)]
    events: list[tuple[float, str | Callable[[], None]]] = [
        (3, lambda: write(tmp_path / "kata" / "stage1.py", "x = 1\n")),
        (6, "r"),
        (9, "A"),
        (12, "a"),
    ]
    with _scripted_session(tmp_path, runs, events) as (session, started, _, _):
        outcome = session.run()
    assert [run.whole for run in started] == [True, False, False, True, True], started
    assert outcome.result == "green" and outcome.restarts == 0, outcome


def test_session_timebox_ends_during_a_run(tmp_path: Path) -> None:
    runs = [(_result("failed"), 2), (_result("passed"), None)]
    with _scripted_session(tmp_path, runs, [(4, "r")], timebox_s=10) as scripted:
        session, started, finished, _ = scripted
        outcome = session.run()
    assert outcome.result == "timeout" and _seconds(outcome) == 10, outcome
    assert [run.killed for run in started] == [False, True]
    assert outcome.last is finished[0][0] and outcome.runs == 1  # the run that finished


def test_session_keeps_watching_after_green_if_asked(tmp_path: Path) -> None:
    core, whole = _result("passed"), _result("passed", "passed")
    runs = [(core, 1), (_result("passed", "failed"), 1), (whole, 1)]
    with _scripted_session(tmp_path, runs, [(30, "r")]) as (session, _, finished, _):
        greens: list[int] = []

        def on_green(result: SuiteRun, ns: int) -> str | None:
            greens.append(ns)
            return "the whole suite" if len(greens) == 1 else None

        session.on_green = on_green
        outcome = session.run()
    assert outcome.result == "green" and outcome.green is core and outcome.last is whole
    assert outcome.green_ns == 0 and greens == [0, 30 * NS_PER_S], outcome
    assert [r for r, _ in finished] == [core, runs[1][0], whole]


# --- green: the next step ---------------------------------------------------------------------


def test_cli_start_summarises_the_prompt_and_offers_the_extended_part(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, terminal = run_kata(["start", "calc", "1"], events=[(90, _solve(project))])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "Calculator — stage 1: Add and multiply · timebox 10 min" in out, out
    assert "core: Calc.add, Calc.mul · extended: Calc.sub" in out, out
    assert "STAGE1_MARK" in out and "STAGE1_SECOND_MARK" not in out, out  # its first paragraph
    assert "INTRO_MARK" not in out and "kata show calc 1" in out, out
    assert "0/3 passed" in out and "3/3 passed" in out, out  # the core: add, mul, symmetric
    assert "green in 01:30 (the core)" in out, out
    assert terminal.asked == [
        "Keep going on the extended part (Calc.sub) with the whole suite? [y/N] "
    ]
    assert "Next: kata start calc 1 --full (the extended part), or kata start calc 2" in out, out
    (attempt,) = attempts(project)
    assert attempt["result"] == "green" and attempt["mode"] == "solo"
    assert 90 <= float(attempt["green_seconds"]) <= 91, attempt
    assert attempt["timebox_minutes"] == 10 and attempt["runs"] == 2
    assert attempt["passed"] == 3 and attempt["total"] == 3 and attempt["hints_used"] == 0
    assert attempt["core_only"] is True and "whole_green_seconds" not in attempt

    # `list` now shows the stage passed, with its best time and one attempt
    assert main(["list"]) == 0
    row = next(ln for ln in capsys.readouterr().out.splitlines() if "Add and multiply" in ln)
    assert "passed" in row and "01:30" in row and row.rstrip().endswith("1"), row


def test_cli_start_banner_names_the_timebox_in_force(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _ = run_kata(["start", "calc", "1", "--minutes", "2.5"], events=[(5, "q")])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "Calculator — stage 1: Add and multiply · timebox 2.5 min" in out, out
    assert "timebox 10 min" not in out and "attempt 1 · 02:30" in out, out
    (attempt,) = attempts(project)
    assert attempt["timebox_minutes"] == 2.5, attempt


def test_cli_start_goes_on_with_the_whole_suite_and_then_names_the_next_stage(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sub_wrong = CALC_SOLUTION.replace("return a - b", "return b - a")
    code, terminal = run_kata(
        ["start", "calc", "1", "--no-prompt"],
        events=[(60, _solve(project, sub_wrong)), (100, _solve(project))],
        answers=["y"],
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert len(terminal.asked) == 1, terminal.asked
    assert "green in 01:00 (the core)" in out and "Watching the whole suite now" in out, out
    assert "3/4 passed" in out and "test_stage1_sub" in out, out  # the whole suite: sub fails
    assert "the whole suite is green too, at 01:40" in out, out
    assert "Next: kata start calc 2 (stage 2: Divide)" in out, out
    (attempt,) = attempts(project)
    assert attempt["result"] == "green" and attempt["core_only"] is True
    assert 60 <= attempt["green_seconds"] <= 61 and 100 <= attempt["whole_green_seconds"] <= 101
    assert attempt["passed"] == attempt["total"] == 4, attempt


def test_cli_start_a_green_core_kept_when_the_whole_suite_runs_out_of_time(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sub_wrong = CALC_SOLUTION.replace("return a - b", "return b - a")
    code, _ = run_kata(
        ["start", "calc", "1", "--no-prompt", "--minutes", "2"],
        events=[(60, _solve(project, sub_wrong))],
        answers=["y", "n"],
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "time is up" in out and "test_stage1_sub" in out, out
    assert "The core went green at 01:00: that is what is recorded." in out, out
    (attempt,) = attempts(project)
    assert attempt["result"] == "green" and attempt["whole_green_seconds"] is None
    assert attempt["passed"] == attempt["total"] == 3, attempt  # the core's run


def test_cli_start_at_timeout_shows_what_fails_and_offers_the_next_hint(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, terminal = run_kata(
        ["start", "calc", "1", "--minutes", "2", "--no-prompt"], answers=["y"]
    )
    out = capsys.readouterr().out
    assert code == 1, out
    assert "STAGE1_MARK" not in out
    assert "time is up" in out and "Still failing" in out, out
    assert "not implemented yet: Calc.add, Calc.mul" in out, out
    assert terminal.asked == ["Show hint 1 of 2? [y/N] "]
    assert "HINT_ONE_MARK" in out and "HINT_TWO_MARK" not in out, out
    (attempt,) = attempts(project)
    assert attempt["result"] == "timeout" and attempt["green_seconds"] is None
    assert attempt["seconds"] == 120 and attempt["hints_used"] == 1
    assert state(project)["hints"] == {"calc/1": 1}


def test_cli_start_keys_run_now_hint_and_ctrl_c_records_the_attempt(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _ = run_kata(
        ["start", "calc", "1", "--no-prompt", "--full"],
        events=[(10, "h"), (20, "r"), (30, "^C")],
    )
    out = capsys.readouterr().out
    assert code == 130, out
    assert "HINT_ONE_MARK" in out, out
    assert "[00:00] 0/4 passed in" in out, out  # the first run: all of --full's 4 tests
    assert "[00:20] 0 passed, then a failure; 3 not run" in out, out  # "run now": to a failure
    assert "interrupted after 00:30" in out, out
    (attempt,) = attempts(project)
    assert attempt["result"] == "interrupted" and attempt["runs"] == 2
    assert attempt["hints_used"] == 1 and attempt["core_only"] is False

    # a second attempt counts separately and `progress` lists both
    code, _ = run_kata(["start", "calc", "1", "--no-prompt"], events=[(5, "q")])
    assert code == 1
    capsys.readouterr()
    assert main(["progress"]) == 0
    out = capsys.readouterr().out
    assert "interrupted" in out and "stopped" in out, out
    assert "failing" in out, out


def test_cli_watcher_sees_saves_creations_and_deletions(tmp_path: Path) -> None:
    write(tmp_path / "a.py", "x = 1\n")
    watcher = Watcher([tmp_path])
    assert watcher.poll() == []
    write(tmp_path / "a.py", "x = 22\n")
    write(tmp_path / "__pycache__" / "a.cpython.py", "ignored")
    write(tmp_path / "notes.txt", "ignored")
    assert watcher.poll() == [tmp_path / "a.py"]
    write(tmp_path / "b.py", "")
    (tmp_path / "a.py").unlink()
    assert watcher.poll() == [tmp_path / "a.py", tmp_path / "b.py"]
    assert watcher.poll() == []


def test_after_the_last_stage_comes_the_next_kata(project: Path) -> None:
    write(project / "katas" / "zeta" / "kata.toml", TOML.replace("Calculator", "Zeta"))
    catalog = cat.Catalog.discover()
    kata = catalog.get("calc")
    ctx = Context(catalog, Console(file=io.StringIO()))
    assert _after_stage(ctx, kata, kata.stage(1)) == "kata start calc 2 (stage 2: Divide)"
    assert _after_stage(ctx, kata, kata.stage(2)).startswith("kata start zeta 1 (the next kata")
    zeta = catalog.get("zeta")
    assert _after_stage(ctx, zeta, zeta.stage(2)) == ""


# --- bad configuration: one line, no attempt ---------------------------------------------------


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        ("KATA_PROFILE", "bogus", "KATA_PROFILE must be one of dev, ci, thorough, mutant"),
        ("KATA_IMPL", "/nope", "KATA_IMPL must be 'katas', 'solutions' or a directory"),
    ],
)
def test_cli_start_with_a_bad_environment_is_one_line_and_no_attempt(
    project: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    value: str,
    expected: str,
) -> None:
    monkeypatch.setenv(name, value)
    code, _ = run_kata(["start", "calc", "1"])
    captured = capsys.readouterr()
    assert code == 2, captured
    (line,) = captured.err.strip().splitlines()
    assert line.startswith("kata start: error: ") and expected in line and repr(value) in line
    assert captured.out == ""  # before the clock starts: no prompt, no countdown
    assert not state_file(project).exists()


def test_cli_start_stops_if_the_first_run_cannot_run_at_all(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    unmarked = "\n\ndef test_stage1_unmarked(stage_module):\n    pass\n"
    write(_suite(project), SUITE + unmarked)
    code, _ = run_kata(["start", "calc", "1", "--no-prompt"])
    captured = capsys.readouterr()
    assert code == 2, captured
    (line,) = captured.err.strip().splitlines()
    assert "pytest could not run the suite (exit code 4)" in line, line
    assert "must be marked @pytest.mark.core or @pytest.mark.extended" in line, line
    assert not state_file(project).exists()


# --- a real terminal: tmux ---------------------------------------------------------------------


@pytest.fixture
def tmux_session(project: Path, tmp_path: Path) -> Iterator[Callable[..., Tmux]]:
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not on PATH")
    sessions: list[Tmux] = []

    def start(args: str, env: Mapping[str, str] | None = None) -> Tmux:
        sessions.append(Tmux(project, tmp_path, args, env))
        return sessions[-1]

    yield start
    for session in sessions:
        session.close()


def test_tmux_r_restarts_and_q_stops_an_endless_run_at_once(
    project: Path, tmux_session: Callable[[str], Tmux]
) -> None:
    write(_stage_file(project), ENDLESS)
    tmux = tmux_session("start calc 1 --no-prompt --poll 0.2")
    first = tmux.wait_for("running 1s… (start)", "left of 10:00")  # the countdown ticks
    countdown = next(line for line in first.splitlines() if "left of 10:00" in line)
    tmux.press("r")
    tmux.wait_for("restarted: run now")
    later = tmux.wait_for("running 1s… (run now)")
    assert countdown not in later, later
    tmux.press("q")  # acts at once, mid-run: the wait's deadline is the bound
    final = tmux.wait_for("KATA_EXIT=", timeout_s=15)
    assert "Attempt stopped after" in final and "KATA_EXIT=1" in final, final
    (attempt,) = attempts(project)
    assert attempt["result"] == "stopped" and attempt["runs"] == 0, attempt


def test_tmux_shows_expected_and_got_a_syntax_error_once_a_hint_and_the_next_step(
    project: Path, tmux_session: Callable[[str], Tmux]
) -> None:
    write(_stage_file(project), OFF_BY_ONE)
    tmux = tmux_session("start calc 1 --poll 0.2")
    shown = tmux.wait_for("1/3 passed in", "expected 5, got 6")
    assert "STAGE1_MARK" in shown and "kata show calc 1" in shown, shown
    assert "━" in shown, shown
    write(_stage_file(project), SYNTAX_ERROR)
    shown = tmux.wait_for("SyntaxError: expected ':'")
    assert shown.count("SyntaxError: expected ':'") == 1, shown
    assert "a run all" in shown, shown  # the key, in the live line's help
    tmux.press("a")  # every test again: the same error, once more
    _until(lambda: tmux.screen().count("SyntaxError: expected ':'") == 2, "a run of all")
    tmux.press("h")
    tmux.wait_for("HINT_ONE_MARK")
    _solve(project)()
    shown = tmux.wait_for("with the whole suite? [y/N]", "3/3 passed", "green in")
    assert "3/3 passed" in shown and "green in" in shown, shown
    tmux.press("Enter")  # no: the suggestions, and the attempt ends green
    final = tmux.wait_for("KATA_EXIT=")
    assert "Next: kata start calc 1 --full" in final and "KATA_EXIT=0" in final, final
    (attempt,) = attempts(project)
    assert attempt["result"] == "green" and attempt["hints_used"] == 1, attempt


def test_cli_start_a_unit_names_its_file_and_runs_its_tests_alone(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    unit = (
        '\nfiles = ["stage1.py", "csrc/calc.c"]\n\n[[stages.units]]\nname = "adding"\n'
        'keyword = "add"\nfile = "csrc/calc.c"\ncore = "calc_add in C"\n'
    )
    toml = TOML.replace('extended = "Calc.sub"\n', 'extended = "Calc.sub"\n' + unit)
    write(project / "katas" / "calc" / "kata.toml", toml)
    code, _ = run_kata(["start", "calc", "1", "--unit", "adding"], events=[(30, _solve(project))])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "unit adding, alone: calc_add in C" in out and "extended:" not in out, out
    assert "csrc/calc.c; every save re-runs the core tests of the adding unit" in out, out
    assert "0/2 passed" in out and "2/2 passed" in out, out  # add and add_is_symmetric only
    assert "Next: kata start calc 1 --unit adding --full (the extended part)" in out, out
    (attempt,) = attempts(project)
    assert attempt["unit"] == "adding" and attempt["result"] == "green", attempt
    assert state(project)["results"] == {}  # a unit's green is not the stage's


def test_tmux_an_endless_loop_is_a_failure_line_naming_each_test_that_timed_out(
    project: Path, tmux_session: Callable[..., Tmux]
) -> None:
    write(_stage_file(project), HANGS)
    tmux = tmux_session("start calc 1 --no-prompt --poll 0.2", {"KATA_TEST_TIMEOUT": "2"})
    shown = tmux.wait_for(
        "1/3 passed, 2 timed out in", "! timeout: test_stage1_add_is_symmetric ran past 2 s"
    )
    assert "! timeout: test_stage1_add ran past 2 s" in shown, shown
    assert re.search(r"it was at stage1\.py:[34] in add", shown), shown  # where the code was
    write(_stage_file(project), HANGS)  # a save: what failed last first, up to one failure
    tmux.wait_for("0 passed, then a failure, 1 timed out; 2 not run")
    # The run's own timeout line is drawn after its summary line: wait for it too.
    timed_out = "! timeout: test_stage1_add ran past 2 s"
    _until(lambda: tmux.screen().count(timed_out) == 2, "the re-run's timeout line")
    tmux.press("q")
    tmux.wait_for("KATA_EXIT=1")


def test_the_watcher_shows_a_compilers_error_line_whole() -> None:
    # The compiler's first error says what to fix at its end: cut, it would say nothing.
    compiler = "csrc/hotpath.c:24:5: error: expected expression before 'hp_int' (line end)"
    message = f"BuildError: the C of dynamic_batcher._hotpath does not build: {compiler}"
    results = tuple(
        TestResult(f"t.py::test_{i}", "failed", "error", message, compiler) for i in range(3)
    )
    screen = io.StringIO()
    ctx = cast(Context, SimpleNamespace(out=Console(file=screen, width=60)))
    print_failing_lines(ctx, SuiteRun(1, results, "", 1.0))
    shown = "".join(screen.getvalue().split())  # the folded lines, joined
    assert "".join(compiler.split()) in shown, screen.getvalue()


def test_the_watcher_says_crashed_for_each_test_a_crash_in_c_failed() -> None:
    # The harness runs a kata's C tests in forked children: a segfault fails its test only.
    crashed = [
        f"crashed: test_{i} — the process died of SIGSEGV at running.py:105 in schedule"
        for i in range(2)
    ]
    results = (
        TestResult("t.py::test_0", "failed", "crashed", crashed[0]),
        TestResult("t.py::test_1", "failed", "crashed", crashed[1]),
        TestResult("t.py::test_2", "passed", None, ""),
    )
    screen = io.StringIO()
    ctx = cast(Context, SimpleNamespace(out=Console(file=screen, width=200)))
    print_failing_lines(ctx, SuiteRun(1, results, "", 1.0))
    shown = screen.getvalue().splitlines()
    assert [line.strip() for line in shown if "crashed:" in line] == [f"! {c}" for c in crashed]


def test_the_watchers_headline_counts_the_tests_that_timed_out_or_crashed() -> None:
    results = (
        TestResult("t.py::test_0", "passed", None, ""),
        TestResult("t.py::test_1", "failed", "timeout", "timeout: test_1 ran past 30 s"),
        TestResult("t.py::test_2", "failed", "crashed", "crashed: test_2 — SIGSEGV"),
        TestResult("t.py::test_3", "failed", "assertion", "assert 1 == 2"),
    )
    assert verdict(SuiteRun(1, results, "", 1.0)) == "1/4 passed, 1 timed out, 1 crashed"
    stopped = SuiteRun(1, results[:2], "", 1.0, selected=4)
    assert verdict(stopped) == "1 passed, then a failure, 1 timed out; 2 not run"
