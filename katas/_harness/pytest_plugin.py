"""The pytest side of the harness, loaded by the repository's root ``conftest.py``.

- ``--impl katas|solutions|PATH`` (or ``KATA_IMPL``) and ``--base own|reference`` choose
  what is tested; tests reach stage modules only through :func:`under_test.stage` (or
  the ``kata`` and ``stage_module`` fixtures, which give the same modules).
- A stub's ``Todo`` becomes one line: ``not implemented yet: ...``, reported
  as a failure of the test even where a fixture met it; a run of nothing but those ends
  with where to start. A test past its deadline is one line too.
- A failing test quotes the rules of the prompt it checks (``@pytest.mark.rule``), and
  its traceback leaves out hypothesis's engine and the harness.
- ``--kata-report FILE`` writes each test's outcome and failure kind as JSON, which the
  repository's own checks and the ``kata`` command read.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import sys
import threading
from collections.abc import Callable, Generator
from pathlib import Path
from types import FrameType, ModuleType
from typing import Any

import pytest

from katas._harness import isolation, preflight, profiles, waiting
from katas._harness import under_test as _stages
from katas._harness.failures import (
    classify,
    failed_record,
    failure_detail,
    is_noise,
    machine_of,
    part_of,
    running_place,
    start_hint,
    tell_once,
)
from katas._harness.under_test import KataUnderTest
from katas._harness.waiting import patience
from katas._registry import impl as _impl
from katas._registry.catalog import CatalogError, load_kata
from katas._registry.rules import Rule, all_rules
from katas._runtime.native import BuildError

#: The Redis fixtures come with the harness, also when it is loaded with ``-p``.
pytest_plugins = ["katas._harness.redis_fixture"]


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kata")
    _impl.add_selection_options(group.addoption)
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
    "processes: starts OS processes of the code under test (seconds of wall time)",
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
_stages_key = pytest.StashKey[set[tuple[Path, int]]]()  # (kata folder, stage) of the selected


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


@pytest.fixture(scope="session")
def impl_selection(pytestconfig: pytest.Config) -> _impl.Selection:
    """The resolved ``--impl`` / ``--base`` choice."""
    return pytestconfig.stash[_selection_key]


def _kata_of(node: pytest.Item | pytest.Collector, selection: _impl.Selection) -> KataUnderTest:
    """The kata whose folder holds ``node``'s file, with the suite's stage."""
    marker = node.get_closest_marker("stage")
    return KataUnderTest(node.path.parent.name, selection, int(marker.args[0]) if marker else None)


@pytest.fixture(scope="module")
def kata(request: pytest.FixtureRequest, impl_selection: _impl.Selection) -> KataUnderTest:
    """The kata whose folder holds the requesting test file."""
    return _kata_of(request.node, impl_selection)


@pytest.fixture(scope="module")
def stage_module(request: pytest.FixtureRequest, kata: KataUnderTest) -> ModuleType:
    """The stage module named by the test file's ``stage(N)`` marker: ``stage()``."""
    if kata.suite_stage is None:
        raise pytest.UsageError(f"{request.path}: set pytestmark = [pytest.mark.stage(N)]")
    return kata.stage(kata.suite_stage)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """``stage()`` reaches this test's kata while it runs (fixtures included); the
    waits of the last test leave no rest checks behind."""
    waiting.begin_test()
    if item.get_closest_marker("stage") is not None:
        _stages.running(_kata_of(item, item.config.stash[_selection_key]))


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    _stages.running(None)


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Every anyio test runs on asyncio and on trio."""
    return str(request.param)


@functools.cache
def _prompt_rules(kata_dir: Path) -> dict[int, dict[str, Rule]]:
    """The rules of the kata in ``kata_dir`` by stage ({} if it has no readable prompt)."""
    try:
        kata = load_kata(kata_dir)
        text = kata.prompt.read_text(encoding="utf-8")
        return all_rules(text, {stage.number: stage.section for stage in kata.stages})
    except (CatalogError, OSError, ValueError):
        return {}


def rules_of(item: pytest.Item) -> list[str]:
    """The rules ``item`` declares, quoted from its stage of the prompt."""
    stage = item.get_closest_marker("stage")
    if stage is None:
        return []
    number = int(stage.args[0])
    known = _prompt_rules(item.path.parent).get(number, {})
    ids = dict.fromkeys(str(a) for m in item.iter_markers("rule") for a in m.args)
    return [known[i].quote(number) if i in known else f"rule §{i} (stage {number})" for i in ids]


def _quiet_tracebacks(item: pytest.Item) -> None:
    """Leave hypothesis's engine and the harness out of ``item``'s tracebacks (a learner
    reads their code and the test; nothing is left out if nothing else remains)."""
    original = item._traceback_filter

    def filtered(excinfo: pytest.ExceptionInfo[BaseException]) -> Any:
        kept = original(excinfo)
        entries = [entry for entry in kept if not is_noise(str(entry.path))]
        # hypothesis's @given calls the test from a frame of the same name at its
        # decorators: keep the frame of the body only
        entries = [
            entry
            for i, entry in enumerate(entries)
            if not any(
                later.path == entry.path and later.name == entry.name for later in entries[i + 1 :]
            )
        ]
        return type(kept)(entries) if entries else kept

    setattr(item, "_traceback_filter", filtered)  # noqa: B010  (a private hook of pytest)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every kata test says which part of its stage it belongs to: core or extended."""
    for item in items:
        if item.get_closest_marker("stage") is not None and hasattr(item, "_traceback_filter"):
            _quiet_tracebacks(item)
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
            "part": part_of(item),
            "rules": sorted({str(a) for m in item.iter_markers("rule") for a in m.args}),
        }
    return found


def pytest_collection_finish(session: pytest.Session) -> None:
    """The stages of what ``-k``/``-m`` kept (the start hint names one), and the
    ``--kata-collected`` file."""
    session.config.stash[_stages_key] = {
        (item.path.parent, int(m.args[0]))
        for item in session.items
        if (m := item.get_closest_marker("stage"))
    }
    path = session.config.getoption("--kata-collected")
    if path:
        Path(path).write_text(json.dumps(_collected(session.items), indent=1))
    if not session.config.getoption("collectonly"):
        _preflight(session)


def _preflight(session: pytest.Session) -> None:
    """Check once what every test needs (:mod:`preflight`): a dead Redis ends the run
    (exit code 2), a stage that does not import fails its tests in one line and ends the
    run, a C module that does not build is said once."""
    config = session.config
    items = [item for item in session.items if item.get_closest_marker("stage")]
    if not items:
        return
    reporter = config.pluginmanager.get_plugin("terminalreporter")

    def say(line: str) -> None:
        if reporter is not None:
            reporter.write_line(line, red=True, bold=True)

    if any("redis_env" in getattr(item, "fixturenames", ()) for item in items):
        why = preflight.redis_failure()
        if why:
            sys.stderr.write(f"ERROR: {why}\n")
            pytest.exit("the configured Redis does not answer", returncode=2)
    selection = config.stash[_selection_key]
    by_stage: dict[tuple[Path, int], list[pytest.Item]] = {}
    for item in items:
        by_stage.setdefault((item.path.parent, _stage_of(item)), []).append(item)
    record = config.stash[_report_key]
    broken = []
    for (folder, number), stage_items in sorted(by_stage.items()):
        exc = preflight.stage_failure(KataUnderTest(folder.name, selection, number), number)
        if exc is None:
            continue
        broken.append(preflight.import_failure(exc))
        kind, message = classify(exc)  # recorded as each test would have met it
        detail = failure_detail(exc, kind)
        for item in stage_items:
            record[item.nodeid] = failed_record(item, kind, message, detail)
    if broken:
        for why in dict.fromkeys(broken):
            say(why)
        pytest.exit("the code under test does not import: no test ran", returncode=1)
    for (folder, number), stage_items in sorted(by_stage.items()):
        if not preflight.reaches_c(stage_items, folder, number):
            continue
        for module in preflight.native_modules(folder):
            why = preflight.build_failure(KataUnderTest(folder.name, selection, number), module)
            if why:
                say(f"{why}  (the tests that need it fail with this line)")


def _stage_of(item: pytest.Item) -> int:
    marker = item.get_closest_marker("stage")
    return int(marker.args[0]) if marker else 0


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> bool | None:
    """A kata test's hard deadline (:func:`profiles.test_seconds`: ``KATA_TEST_TIMEOUT``
    as set, or the profile's, stretched on a busy machine by :func:`waiting.patience`), as
    :class:`profiles.TestTimedOut` raised in the test (one line, past hypothesis), not
    pytest-timeout's stack dump of every thread. A test that ignores it (stuck in C) ends
    the run a minute later. The repository's own checks keep pytest-timeout's.
    """
    if item.get_closest_marker("stage") is None:
        return None
    if threading.current_thread() is not threading.main_thread():  # pragma: no cover
        return None
    profile = _impl.profile_name()
    seconds = profiles.test_seconds(profile)
    busy = 1.0 if os.environ.get(profiles.ENV_TEST_TIMEOUT) else patience()  # as set
    name = item.nodeid.split("::", 1)[-1]
    stretched = f" ({seconds:g} s × {busy:.1f}, the machine's load per core)" if busy > 1 else ""
    seconds *= busy
    message = (
        f"timeout: {name} ran past {seconds:.0f} s under the {profile} profile{stretched} "
        "(an endless loop or a wait that never ends?)"
    )

    def expire(signum: int, frame: FrameType | None) -> None:
        where = f" — it was at {running_place(frame)}" if frame is not None else ""
        raise profiles.TestTimedOut(message + where)

    def arm() -> None:
        signal.signal(signal.SIGALRM, expire)
        signal.setitimer(signal.ITIMER_REAL, seconds)

    if isolation.wanted(item):  # armed in the child that runs it, which this run outlasts
        item.stash[_forked_key] = (arm, seconds + FORKED_GRACE_S)
        item.cancel_timeout = lambda: None  # type: ignore[attr-defined]
        return True

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
    arm()
    backstop.start()
    return True


#: A forked test still running this long past its deadline is killed (see isolation).
FORKED_GRACE_S = 5.0
_forked_key = pytest.StashKey[tuple[Callable[[], None], float]]()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
    """A test of a kata with C runs in a forked child (:mod:`isolation`), so a crash in
    the C under test is that test's failure and the run goes on."""
    if _forked_key not in item.stash:  # pytest-timeout's wrapper has set it by now
        if not isolation.wanted(item):
            return None
        seconds = profiles.test_seconds(_impl.profile_name())
        item.stash[_forked_key] = (lambda: None, seconds + FORKED_GRACE_S)
    arm, deadline_s = item.stash[_forked_key]
    records = item.config.stash[_report_key]
    isolation.run_forked(item, nextitem, records, arm=arm, deadline_s=deadline_s)
    return True


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    stage = item.get_closest_marker("stage")
    # A unittest-style test (a state machine's) keeps its failure aside until pytest's own
    # hook, after this one, moves it to ``call``: tell it before pytest formats it.
    kept = getattr(item, "_excinfo", None) or [call.excinfo]
    if kept[0] is not None and stage is not None:
        tell_once(kept[0].value, int(stage.args[0]), machine_of(item))
    report = yield
    record = item.config.stash[_report_key]
    if call.excinfo is not None and report.failed:
        kind, message = classify(call.excinfo.value)
        unbuilt = isinstance(call.excinfo.value, BuildError)  # said once, before the tests
        if kind in ("not_implemented", "timeout") or unbuilt:
            report.longrepr = message  # one clear line instead of a traceback wall
            if call.when == "setup":  # a fixture met the stub: the test's own failure
                report.when = "call"
        rules = rules_of(item) if kind != "not_implemented" and not unbuilt else []
        if rules:
            title = "the rule it checks" if len(rules) == 1 else "the rules it checks"
            report.sections.append((title, "\n".join(rules)))
        detail = failure_detail(call.excinfo.value, kind)
        record[item.nodeid] = failed_record(item, kind, message, detail, rules)
    elif call.when == "call" or (report.skipped and item.nodeid not in record):
        # a skip keeps its reason (pytest's longrepr for a skip: path, line, reason)
        reason = report.longrepr[2] if report.skipped and isinstance(report.longrepr, tuple) else ""
        record.setdefault(
            item.nodeid,
            {
                "outcome": report.outcome,
                "kind": None,
                "message": str(reason).removeprefix("Skipped: "),
                "detail": "",
            },
        )
    return report


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_terminal_summary(
    terminalreporter: Any, config: pytest.Config
) -> Generator[None, None, None]:
    """A run whose failures are all "not implemented yet" ends saying where to start
    (after pytest's short summary, just above its count)."""
    yield
    _where_to_start(terminalreporter, config)


def _where_to_start(terminalreporter: Any, config: pytest.Config) -> None:
    record = config.stash.get(_report_key, {})
    failed = [r for r in record.values() if r["outcome"] == "failed"]
    missing = [(r["part"], r["message"]) for r in failed if r["kind"] == "not_implemented"]
    if not missing or len(missing) != len(failed):
        return
    stages = config.stash.get(_stages_key, set())
    if len(stages) != 1:
        return
    folder, stage = next(iter(stages))
    kata = folder.name
    home = Path(config.stash[_selection_key].spec)
    with contextlib.suppress(ValueError):  # a PATH under the working directory: shown short
        home = home.resolve().relative_to(Path.cwd()) if home.is_absolute() else home
    with contextlib.suppress(CatalogError):  # a kata folder without kata.toml: no hint
        found = load_kata(folder).stage(stage)

        def file_for(message: str) -> str:
            return f"{home.as_posix()}/{kata}/{found.file_for(message)}"

        terminalreporter.write_line(start_hint(missing, stage, file_for), yellow=True, bold=True)


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = session.config.getoption("--kata-report")
    if path:
        Path(path).write_text(json.dumps(session.config.stash[_report_key], indent=1))
