"""Options of the repository's own checks.

``pytest`` runs every check except the classic-bug catalogue sweep, which runs one whole
stage suite per entry (about 175 entries, most of the machine's time): ``pytest
--catalogue`` adds it, and CI always does.
"""

from __future__ import annotations

import pytest

CATALOGUE_MARK = "catalogue"


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


_left_out_key = pytest.StashKey[int]()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    left_out = terminalreporter.config.stash.get(_left_out_key, 0)
    if left_out:
        terminalreporter.write_line(
            f"{left_out} bug-catalogue checks were not run: `pytest --catalogue` adds them "
            "(one stage-suite run per entry, about 7 minutes more on 2 cores)"
        )
