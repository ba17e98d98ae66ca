"""The pytest side of the harness, loaded by the repository's root ``conftest.py``.

- ``--impl katas|solutions|PATH`` (or ``KATA_IMPL``) and ``--base own|reference`` choose
  what is tested; tests receive stage modules only through the ``kata`` fixture.
- A stub's ``NotImplementedError`` becomes one line: ``not implemented yet: ...``.
- ``--kata-report FILE`` writes each test's outcome and failure kind as JSON, which the
  repository's own checks and the ``kata`` command read.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import signal
import sys
import sysconfig
import threading
import traceback
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, ModuleType
from typing import Any

import pytest

from katas._kit import impl as _impl
from katas._kit import profiles
from katas._kit.impl import NOT_IMPLEMENTED

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

#: The Redis fixtures come with the harness, also when it is loaded with ``-p``.
pytest_plugins = ["katas._kit.redis"]


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kata")
    group.addoption(
        "--impl",
        default=None,
        help="implementation to test: katas (default), solutions, or a directory laid out "
        "like solutions/ (env KATA_IMPL)",
    )
    group.addoption(
        "--base",
        default=None,
        choices=["own", "reference"],
        help="earlier stages: the tested implementation's own (default) or the reference's",
    )
    group.addoption("--kata-report", default=None, help="write per-test outcomes as JSON here")
    group.addoption(
        "--kata-collected",
        default=None,
        help="write each collected kata test's kata, stage, part and rules as JSON here",
    )


MARKERS = (
    "stage(n): the kata stage a test belongs to (select with -k stageN)",
    "core: the part of a stage a strong candidate finishes within the timebox",
    "extended: the part of a stage that deepens the kata beyond the timebox",
    "realtime: waits for real Redis expiry (short, bounded)",
    "rule(*ids): the rules of the stage's prompt this test checks (§id in the kata README)",
)


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> int | None:
    """A mistyped ``--impl``, ``KATA_IMPL`` or ``KATA_PROFILE`` is one line and exit code 2,
    before anything is collected (not an INTERNALERROR traceback)."""
    if config.getoption("help") or config.getoption("version", 0):
        return None
    try:
        profiles.test_seconds(_impl.profile_name())
        config.stash[_selection_key] = _impl.resolve(
            config.getoption("--impl"), config.getoption("--base")
        )
    except ValueError as exc:
        sys.stderr.write(f"ERROR: {exc}\n")
        return 2
    return None


def pytest_configure(config: pytest.Config) -> None:
    for marker in MARKERS:
        config.addinivalue_line("markers", marker)
    with contextlib.suppress(ValueError):  # reported by pytest_cmdline_main; --help gets here
        budget = profiles.ShrinkBudget(profiles.load())
        config.pluginmanager.register(_ShrinkHooks(budget), "kata-shrink-budget")
    if _selection_key not in config.stash:  # pytest.main() with the plugin as an object
        config.stash[_selection_key] = _impl.resolve(
            config.getoption("--impl"), config.getoption("--base")
        )
    config.stash[_report_key] = {}


_selection_key = pytest.StashKey[_impl.Selection]()
_report_key = pytest.StashKey[dict[str, dict[str, Any]]]()


class _ShrinkHooks:
    """Moves the run's :class:`profiles.ShrinkBudget` along: set before each test, one
    more failure after each failed one."""

    def __init__(self, budget: profiles.ShrinkBudget) -> None:
        self.budget = budget

    def pytest_runtest_setup(self) -> None:
        self.budget.before_test()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.failed and report.when == "call":
            self.budget.failed()


@dataclass(frozen=True)
class Kata:
    """The stage modules of one kata, from the selected implementation.

    With ``--base=reference``, stages below the suite's own come from the reference.
    """

    name: str
    selection: _impl.Selection
    suite_stage: int | None = None

    def stage(self, n: int) -> ModuleType:
        if self.selection.base == "reference" and self.suite_stage and n < self.suite_stage:
            self.selection.stage(self.name, self.suite_stage)  # seeds the swap first
            return importlib.import_module(f"solutions.{self.name}.stage{n}")
        return self.selection.stage(self.name, n)


@pytest.fixture(scope="session")
def impl_selection(pytestconfig: pytest.Config) -> _impl.Selection:
    """The resolved ``--impl`` / ``--base`` choice."""
    return pytestconfig.stash[_selection_key]


@pytest.fixture(scope="module")
def kata(request: pytest.FixtureRequest, impl_selection: _impl.Selection) -> Kata:
    """The kata whose folder holds the requesting test file."""
    marker = request.node.get_closest_marker("stage")
    return Kata(
        Path(request.path).parent.name, impl_selection, int(marker.args[0]) if marker else None
    )


@pytest.fixture(scope="module")
def stage_module(request: pytest.FixtureRequest, kata: Kata) -> ModuleType:
    """The stage module named by the test file's ``stage(N)`` marker."""
    marker = next((m for m in request.node.iter_markers("stage")), None)
    if marker is None:
        raise pytest.UsageError(f"{request.path}: set pytestmark = [pytest.mark.stage(N)]")
    return kata.stage(int(marker.args[0]))


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Every anyio test runs on asyncio and on trio."""
    return str(request.param)


def _walk(exc: BaseException) -> Iterator[BaseException]:
    """The exception, its causes/contexts and the members of exception groups."""
    seen: set[int] = set()
    stack = [exc]
    while stack:
        e = stack.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        if isinstance(e, BaseExceptionGroup):
            stack.extend(e.exceptions)
        for linked in (e.__cause__, e.__context__):
            if linked is not None:
                stack.append(linked)


def classify(exc: BaseException) -> tuple[str, str]:
    """``(kind, message)``: kind is ``not_implemented``, ``assertion`` or ``error``."""
    for e in _walk(exc):
        if isinstance(e, NotImplementedError):
            return "not_implemented", NOT_IMPLEMENTED + (str(e) or type(e).__name__)
    top = exc
    if isinstance(top, BaseExceptionGroup):
        leaves = [e for e in _walk(top) if not isinstance(e, BaseExceptionGroup)]
        if leaves and all(isinstance(e, AssertionError | pytest.fail.Exception) for e in leaves):
            return "assertion", str(leaves[0]).splitlines()[0] if str(leaves[0]) else "assert"
    if isinstance(top, AssertionError | pytest.fail.Exception):
        text = str(top)
        return "assertion", text.splitlines()[0] if text else "assertion failed"
    return "error", f"{type(top).__name__}: {top}".splitlines()[0]


#: Where the report's ``detail`` is cut: one line a learner reads, not a wall of text.
DETAIL_CHARS = 400
#: A line saying both what was expected and what came instead.
_EXPECTED_GOT = re.compile(r"\bexpected\b.*\bgot\b|\bgot\b.*\bexpected\b", re.IGNORECASE)
_EXPECTED_OR_GOT = re.compile(r"\b(?:expected|got)\b", re.IGNORECASE)
#: What pytest appends to a long explanation (a suite may quote one in its message).
_PYTEST_NOTES = ("...Full output truncated, use '-vv' to show", "Use -v to get more diff")
#: pytest's explanation of an ``assert a == b``: the difference itself.
_PYTEST_DIFF = re.compile(
    r"^(?:At index \d+ diff: .+|(?:Left|Right) contains .+|[\w.]+: .+ != .+)$"
)


def assertion_detail(text: str) -> str:
    """The line of an assertion's text a learner needs besides its first one.

    Suites write ``stage 1: <invariant>``, then the steps taken, then what was expected
    and what came (``=> remaining: expected 0, got -1``, a line with both words, or an
    ``expected X`` line above a ``got Y`` one); pytest adds its ``assert 3 == 4``. In that
    order of preference; the first line's own expected/got part if it says it (a narrow
    screen cuts long first lines off before it); "" if nothing says more.
    """
    for note in _PYTEST_NOTES:
        text = text.replace(note, "")
    lines = [" ".join(line.split()) for line in text.splitlines()]
    lines = [line for line in lines if line]
    if not lines:
        return ""
    head, rest = lines[0], lines[1:]
    for line in rest:
        if line.startswith("=>"):
            return line.removeprefix("=>").strip()
    for line in rest:
        if _EXPECTED_GOT.search(line) and not line.startswith(("assert ", "+ ")):
            return line[1:-1] if line.startswith("(") and line.endswith(")") else line
    for i in range(1, len(rest)):
        if rest[i - 1].startswith("expected ") and rest[i].startswith("got "):
            return f"{rest[i - 1]}, {rest[i]}"
    if _EXPECTED_GOT.search(head):
        found = _EXPECTED_OR_GOT.search(head)
        return head[found.start() :] if found else head
    diffs = [line for line in rest if _PYTEST_DIFF.match(line)]
    if head.startswith("assert "):  # a bare assert: pytest's line is the message already
        return diffs[0] if diffs else ""
    compared = next((line for line in rest if line.startswith("assert ")), "")
    if "..." in compared and diffs:  # pytest abbreviated both sides; its diff says more
        return diffs[0]
    return compared


_LIBRARIES = {Path(p).resolve() for p in (sysconfig.get_paths()["stdlib"], sys.prefix)}
_HARNESS = Path(__file__).resolve().parent


def _learners_frame(exc: BaseException) -> str:
    """``stage1.py:12 in add: return a + None``: the innermost frame of the traceback
    outside the harness, the standard library and installed packages (the learner's code,
    else the test), or ""."""
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if frame.filename.startswith("<"):
            continue
        path = Path(frame.filename).resolve()
        if _HARNESS in path.parents or any(lib in path.parents for lib in _LIBRARIES):
            continue
        line = f": {frame.line.strip()}" if frame.line and frame.line.strip() else ""
        return f"{path.name}:{frame.lineno} in {frame.name}{line}"
    return ""


def failure_detail(exc: BaseException, kind: str) -> str:
    """The report's ``detail`` of a failure :func:`classify` called ``kind``: for an
    assertion :func:`assertion_detail`; for an error where it was raised (a syntax error:
    the offending line); "" for a stub's NotImplementedError. At most DETAIL_CHARS."""
    if kind == "not_implemented":
        return ""
    focus = exc
    if isinstance(exc, BaseExceptionGroup):  # what classify read the message from
        leaves = [e for e in _walk(exc) if not isinstance(e, BaseExceptionGroup)]
        if leaves:
            focus = leaves[0]
    if kind == "assertion":
        detail = assertion_detail(str(focus))
    elif isinstance(focus, SyntaxError):
        detail = " ".join((focus.text or "").split())
    else:
        where = _learners_frame(focus)
        detail = where if focus is exc else f"{type(focus).__name__}: {focus} — {where}"
    if len(detail) > DETAIL_CHARS:
        detail = detail[: DETAIL_CHARS - 1] + "…"
    return detail


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every kata test says which part of its stage it belongs to: core or extended."""
    unmarked = [
        item.nodeid
        for item in items
        if item.get_closest_marker("stage") is not None
        and item.get_closest_marker("core") is None
        and item.get_closest_marker("extended") is None
    ]
    if unmarked:
        raise pytest.UsageError(
            "kata tests must be marked @pytest.mark.core or @pytest.mark.extended: "
            + ", ".join(unmarked)
        )


def _collected(items: list[pytest.Item]) -> dict[str, dict[str, Any]]:
    """``{nodeid: {kata, stage, part, rules}}`` of the kata tests among ``items``."""
    found: dict[str, dict[str, Any]] = {}
    for item in items:
        stage = item.get_closest_marker("stage")
        if stage is None:
            continue
        found[item.nodeid] = {
            "kata": item.path.parent.name,
            "stage": int(stage.args[0]),
            "part": "core" if item.get_closest_marker("core") else "extended",
            "rules": sorted({str(a) for m in item.iter_markers("rule") for a in m.args}),
        }
    return found


def pytest_collection_finish(session: pytest.Session) -> None:
    """``--base=reference`` covers one stage: checked on what ``-k``/``-m`` kept, so
    ``pytest katas/K -k "stage2 and core" --base=reference`` runs as the README says."""
    path = session.config.getoption("--kata-collected")
    if path:
        Path(path).write_text(json.dumps(_collected(session.items), indent=1))
    selection = session.config.stash[_selection_key]
    stages = {m.args[0] for item in session.items if (m := item.get_closest_marker("stage"))}
    if selection.base == "reference" and len(stages) > 1:
        raise pytest.UsageError(
            "--base=reference runs one stage's suite at a time (select it with -k stageN): "
            "it swaps the earlier stages for the reference's"
        )


def _where(frame: FrameType) -> str:
    """``stage1.py:145 in _decide``: the innermost frame outside the harness and libraries
    (the learner's code, else the test), or the innermost one."""
    innermost = frame
    while frame is not None:
        path = Path(frame.f_code.co_filename)
        if "site-packages" not in path.parts and "_kit" not in path.parts:
            break
        frame = frame.f_back  # type: ignore[assignment]
    found = frame or innermost
    return f"{Path(found.f_code.co_filename).name}:{found.f_lineno} in {found.f_code.co_name}"


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> bool | None:
    """A kata test's hard deadline (:func:`profiles.test_seconds`: the profile's, or
    ``KATA_TEST_TIMEOUT``), as :class:`profiles.TestTimedOut` raised in the test (one
    line, past hypothesis), not pytest-timeout's stack dump of every thread. A test that
    ignores it (stuck in C) ends the run a minute later. The repository's own checks keep
    pytest-timeout's.
    """
    if item.get_closest_marker("stage") is None:
        return None
    if threading.current_thread() is not threading.main_thread():  # pragma: no cover
        return None
    profile = _impl.profile_name()
    seconds = profiles.test_seconds(profile)
    name = item.nodeid.split("::", 1)[-1]
    message = (
        f"timeout: {name} ran past {seconds:g} s under the {profile} profile "
        "(an endless loop or a wait that never ends?)"
    )

    def expire(signum: int, frame: FrameType | None) -> None:
        where = f" — it was at {_where(frame)}" if frame is not None else ""
        raise profiles.TestTimedOut(message + where)

    def stuck() -> None:  # the test never returned to Python: nothing else can end it
        sys.stderr.write(f"\n{message}; it did not stop, so the run ends here\n")
        sys.stderr.flush()
        os._exit(3)

    backstop = threading.Timer(seconds + 60, stuck)
    backstop.daemon = True

    def cancel() -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        backstop.cancel()

    item.cancel_timeout = cancel  # type: ignore[attr-defined]  # read by pytest-timeout
    signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    backstop.start()
    return True


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    record = item.config.stash[_report_key]
    if call.excinfo is not None and report.failed:
        kind, message = classify(call.excinfo.value)
        if kind == "not_implemented":
            report.longrepr = message  # one clear line instead of a traceback wall
        detail = failure_detail(call.excinfo.value, kind)
        record[item.nodeid] = {"outcome": "failed", "kind": kind, "message": message}
        record[item.nodeid]["detail"] = detail
    elif call.when == "call" or (report.skipped and item.nodeid not in record):
        record.setdefault(
            item.nodeid, {"outcome": report.outcome, "kind": None, "message": "", "detail": ""}
        )
    return report


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = session.config.getoption("--kata-report")
    if path:
        Path(path).write_text(json.dumps(session.config.stash[_report_key], indent=1))
