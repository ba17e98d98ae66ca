"""The shape of a suite file: a map first, tests soon, one vocabulary for failures.

Every suite file a ``kata.toml`` names (an AST and text check, nothing run):

- opens with its map, a docstring, and reaches its first test within
  :data:`FIRST_TEST_BY` lines (what is longer than a test's own setup lives in the
  kata's ``_testing/``);
- stays under :data:`MAX_LINES` lines (a stage with two subjects names two files);
- defines no failure-telling helper of its own (``Story``, ``expect``, ``check``, a field
  diff): ``katas._harness.story`` is the one vocabulary;
- writes no rule marker by hand: a rule id is declared with ``@pytest.mark.rule``, and
  the plugin quotes the rule in the failure report, so ``§`` appears only in prompts.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from _support import suite_files, suite_id

#: The line a suite's first test must start by.
FIRST_TEST_BY = 150
#: The most lines a suite file may have.
MAX_LINES = 1_300
#: Names a suite must take from the harness instead of defining.
HARNESS_ONLY = {"Story", "expect", "check", "diff", "diff_fields", "differences"}

SUITES = suite_files()


@pytest.mark.parametrize("path", SUITES, ids=suite_id)
def test_a_suite_starts_with_its_map_and_reaches_a_test_soon(path: Path) -> None:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    assert ast.get_docstring(tree), (
        f"{suite_id(path)}: a suite file opens with its map (a docstring)"
    )
    starts = [  # a test's first line: its first decorator's, or its def's
        min([node.lineno, *(d.lineno for d in node.decorator_list)])
        for node in tree.body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
        and node.name.lower().startswith("test")
    ]
    assert starts, f"{suite_id(path)}: no test"
    first = min(starts)
    assert first <= FIRST_TEST_BY, (
        f"{suite_id(path)}: the first test starts at line {first}; move drivers and models to "
        f"the kata's _testing/ so it starts by line {FIRST_TEST_BY}"
    )


@pytest.mark.parametrize("path", SUITES, ids=suite_id)
def test_a_suite_file_stays_readable_in_length(path: Path) -> None:
    lines = len(path.read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_LINES, (
        f"{suite_id(path)}: {lines} lines (at most {MAX_LINES}): split the stage by subject "
        "(kata.toml's suite = [...]) or move helpers to the kata's _testing/"
    )


@pytest.mark.parametrize("path", SUITES, ids=suite_id)
def test_a_suite_tells_failures_with_the_harness_and_no_hand_typed_rule_marker(
    path: Path,
) -> None:
    text = path.read_text(encoding="utf-8")
    tree = ast.parse(text)
    own = sorted(
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.ClassDef)
        and node.name in HARNESS_ONLY
        and node.col_offset == 0
    )
    assert not own, (
        f"{suite_id(path)} defines {own}: use katas._harness.story (expect, check, Story, "
        "differences) instead"
    )
    marked = [n for n, line in enumerate(text.splitlines(), 1) if "§" in line]
    assert not marked, (
        f"{suite_id(path)}: a hand-typed § on lines {marked[:10]}: name the rule with "
        "@pytest.mark.rule and by its id in prose"
    )
