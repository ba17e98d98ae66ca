"""Options of the repository's own checks.

``pytest`` runs every check except the classic-bug catalogue sweep, which runs a stage
suite once per entry, on its named tests and a sample of the others (about 700 entries,
most of the machine's time): ``pytest --catalogue`` adds it, and CI always does.
"""

from __future__ import annotations

import textwrap
import time
from collections import defaultdict

import pytest
from _support import learner_edits, start_pools

CATALOGUE_MARK = "catalogue"

#: Each check's budget in seconds of wall time on CI's 2 cores, sized for five katas (the
#: whole of CI is meant to stay near 15 minutes: 16 on a quiet machine). A check
#: over its budget is reported at the end of the run, never failed: timings are the
#: machine's, not the code's. The catalogue's budget is for ``--catalogue`` runs.
BUDGETS_S = {
    "test_catalogue": 900,
    "test_reviews": 240,
    "test_suites": 240,
    "test_cli_start": 90,
    "test_cli_pair": 45,
    "test_cli_practice": 45,
    "test_cli_debug": 45,
    "test_interview": 45,
    "test_cli": 60,
    "test_rules": 30,
    "test_lint": 60,
    "test_redis_harness": 60,
    "test_native": 30,
    "test_plugin": 45,
    "test_lifetime": 45,
    "test_preflight": 45,
}
#: Any other check.
DEFAULT_BUDGET_S = 15


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.getgroup("kata").addoption(
        "--catalogue",
        action="store_true",
        help="also run the classic-bug catalogue sweep (one suite run per entry; slow)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"{CATALOGUE_MARK}: the bug-catalogue sweep, run only with --catalogue"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--catalogue"):
        return
    kept = [item for item in items if item.get_closest_marker(CATALOGUE_MARK) is None]
    left_out = [item for item in items if item.get_closest_marker(CATALOGUE_MARK) is not None]
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = kept
        config.stash[_left_out_key] = len(left_out)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the whole-suite runs of the checks that pool them now, in the background,
    so that they overlap every check that comes before them."""
    start_pools(session.items)


_left_out_key = pytest.StashKey[int]()
_spent_key = pytest.StashKey[dict[str, float]]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> object:
    """Add each test's wall time (setup, call and teardown) to its check's."""
    start = time.monotonic()
    try:
        return (yield)
    finally:
        spent = item.config.stash.setdefault(_spent_key, defaultdict(float))
        spent[item.path.stem] += time.monotonic() - start


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    spent = terminalreporter.config.stash.get(_spent_key, {})
    if spent:
        figures = []
        for check, seconds in sorted(spent.items(), key=lambda kv: -kv[1]):
            budget = BUDGETS_S.get(check, DEFAULT_BUDGET_S)
            over = "  OVER BUDGET" if seconds > budget else ""
            figures.append(f"{check} {seconds:.0f}/{budget}{over}")
        text = "check budgets, s spent/budget: " + ", ".join(figures)
        for line in textwrap.wrap(text, 100, subsequent_indent="  "):
            terminalreporter.write_line(line)
    edits = [path for path in learner_edits() if path.endswith(".py")]  # what they read
    if edits:
        terminalreporter.write_line(
            f"left out of ruff and mypy as your work in progress: {', '.join(edits)} "
            "(the repository's checks judge the committed stubs; your code's is its kata suite)"
        )
    left_out = terminalreporter.config.stash.get(_left_out_key, 0)
    if left_out:
        terminalreporter.write_line(
            f"{left_out} bug-catalogue checks were not run: `pytest --catalogue` adds them "
            "(one stage-suite run per entry, about 8 minutes more on 2 quiet cores)"
        )
