"""Every rule of every stage's prompt has a test, and every test says which rules it checks.

A rule is a list item of a stage's section of ``katas/<kata>/README.md`` that starts with
``§id`` (see :mod:`katas._registry.rules`); a test declares what it checks with
``@pytest.mark.rule("id", ...)``. The suites are collected once (``--collect-only``), with
each test's stage and rules written by the plugin's ``--kata-collected``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _support import committed_stubs, embedded_env, learner_pytest, stage_suites

from katas._registry.catalog import Catalog
from katas._registry.impl import REPO_ROOT
from katas._registry.rules import ID_PATTERN, Rule, all_rules, plain, stage_rules
from katas._registry.suites import run_suite

SUITES = stage_suites()
CATALOG = Catalog(REPO_ROOT / "katas")


def _rules(kata: str) -> dict[int, dict[str, Rule]]:
    entry = CATALOG.get(kata)
    text = entry.prompt.read_text(encoding="utf-8")
    return all_rules(text, {s.number: s.section for s in entry.stages})


def _collect(*args: str) -> subprocess.CompletedProcess[str]:
    """``pytest --collect-only -q ARGS`` of the reference's suites."""
    return learner_pytest("--collect-only", "--impl=solutions", *args)


@pytest.fixture(scope="module")
def collected() -> Iterator[dict[str, dict[str, Any]]]:
    """``{nodeid: {kata, stage, part, rules}}`` of every kata test."""
    with tempfile.TemporaryDirectory(prefix="kata-rules-") as tmp:
        out = Path(tmp) / "collected.json"
        run = _collect("katas", "--kata-collected", str(out))
        assert run.returncode == 0, f"collecting the suites failed:\n{run.stdout[-3000:]}"
        yield json.loads(out.read_text())


CASES = [pytest.param(k, s, id=f"{k}-stage{s}") for k, s in SUITES]


@pytest.mark.parametrize(("kata", "stage"), CASES)
def test_every_rule_of_the_prompt_has_a_test(
    kata: str, stage: int, collected: dict[str, dict[str, Any]]
) -> None:
    rules = _rules(kata).get(stage, {})
    assert rules, f"katas/{kata}/README.md: stage {stage} has no rules marked with §id"
    declared = {r for t in collected.values() if t["kata"] == kata for r in t["rules"]}
    untested = [rule.quote(stage) for rule_id, rule in rules.items() if rule_id not in declared]
    assert not untested, (
        f"{kata} stage {stage}: rules no test declares (@pytest.mark.rule):\n  "
        + "\n  ".join(untested)
    )


@pytest.mark.parametrize(("kata", "stage"), CASES)
def test_every_test_declares_rules_of_its_own_stage(
    kata: str, stage: int, collected: dict[str, dict[str, Any]]
) -> None:
    rules = _rules(kata).get(stage, {})
    mine = {n: t for n, t in collected.items() if t["kata"] == kata and t["stage"] == stage}
    assert mine, f"{kata} stage {stage}: no test collected"
    bare = sorted({n.split("[")[0] for n, t in mine.items() if not t["rules"]})
    assert not bare, (
        f"{kata} stage {stage}: tests that declare no rule (@pytest.mark.rule):\n  "
        + "\n  ".join(bare)
    )
    unknown = sorted(
        {f"{n.split('[')[0]}: §{r}" for n, t in mine.items() for r in t["rules"] if r not in rules}
    )
    assert not unknown, (
        f"{kata} stage {stage}: tests declare rules that are not in stage {stage} of "
        f"katas/{kata}/README.md:\n  " + "\n  ".join(unknown)
    )


# --- the parser ----------------------------------------------------------------------------

PROMPT = """\
# A kata

- §not-a-rule **outside every stage** is ignored.

## Stage 1 — Single-threaded

### The rules (each one has a test)

- §fresh **A new key is fresh**: a full bucket,
  an empty log.
- §exact-retry **Exact retry.** `retry_after_ns` rounds *up*.
  - a nested note stays with its rule
- A plain item is not a rule.

```text
- §in-a-fence is not a rule
```

## Stage 2

- §stage-two Only in stage 2.
"""


def test_rules_are_list_items_that_start_with_their_id() -> None:
    rules = stage_rules(PROMPT, "Stage 1")
    assert list(rules) == ["fresh", "exact-retry"]
    assert rules["fresh"].text == "A new key is fresh: a full bucket, an empty log."
    assert rules["exact-retry"].text == (
        "Exact retry. retry_after_ns rounds up. - a nested note stays with its rule"
    )
    assert list(stage_rules(PROMPT, "Stage 2")) == ["stage-two"]
    assert rules["fresh"].quote(1) == (
        "rule §fresh (stage 1): A new key is fresh: a full bucket, an empty log."
    )


def test_a_repeated_rule_id_is_an_error() -> None:
    with pytest.raises(ValueError, match="§fresh appears twice"):
        stage_rules("## Stage 1\n\n- §fresh one\n- §fresh two\n", "Stage 1")
    with pytest.raises(ValueError, match="§x appears in stages 1 and 2"):
        two = "## Stage 1\n\n- §x one\n\n## Stage 2\n\n- §x two\n"
        all_rules(two, {1: "Stage 1", 2: "Stage 2"})


def test_plain_text_drops_markdown_emphasis() -> None:
    assert plain("**bold** and *it* and `code`  \n more") == "bold and it and code more"
    assert ID_PATTERN.match("exact-retry") and not ID_PATTERN.match("Exact_retry")


# --- practice units: each test of a stage in exactly one unit -------------------------------

UNITS = [pytest.param(k, s, id=f"{k}-stage{s}") for k, s in SUITES if CATALOG.get(k).stage(s).units]


def _selected(kata: str, stage: int, keyword: str) -> set[str]:
    """The node ids pytest's ``-k keyword`` selects from the stage's suite (the reference)."""
    entry = CATALOG.get(kata)
    suites = [p.relative_to(REPO_ROOT).as_posix() for p in entry.suite_paths(entry.stage(stage))]
    suite = " ".join(suites)
    run = _collect(*suites, "-k", keyword)
    assert run.returncode in (0, 5), f"collecting {suite} -k {keyword!r} failed:\n{run.stdout}"
    return {line for line in run.stdout.splitlines() if "::" in line}


@pytest.mark.parametrize(("kata", "stage"), UNITS)
def test_the_units_of_a_stage_select_each_of_its_tests_exactly_once(
    kata: str, stage: int, collected: dict[str, dict[str, Any]]
) -> None:
    units = CATALOG.get(kata).stage(stage).units
    tests = {n for n, t in collected.items() if t["kata"] == kata and t["stage"] == stage}
    chosen = {u.name: _selected(kata, stage, u.keyword) for u in units}
    for unit in units:
        assert chosen[unit.name], f"{kata} stage {stage}: unit {unit.name} selects no test"
    twice = sorted(n for n in tests if sum(n in c for c in chosen.values()) > 1)
    never = sorted(tests - set().union(*chosen.values()))
    named = ", ".join(f"{u.name}: -k {u.keyword!r}" for u in units)
    assert not twice and not never, (
        f"{kata} stage {stage}: the units ({named}) "
        "must select each test exactly once (rename a test or a parameter id that matches "
        "another unit's keyword):\n  in two units: "
        + (", ".join(twice) or "none")
        + "\n  in none: "
        + (", ".join(never) or "none")
    )


#: The stages whose units are written in different files. Where every unit of a stage is
#: written in one file, a unit alone is the reference itself: the whole suite passing on
#: it (tests/test_suites.py) says it already.
UNITS_APART = [
    pytest.param(k, s, id=f"{k}-stage{s}")
    for k, s in SUITES
    if len({u.file for u in CATALOG.get(k).stage(s).units}) > 1
]


@pytest.mark.parametrize(("kata", "stage"), UNITS_APART)
def test_each_unit_goes_green_alone_on_the_reference(kata: str, stage: int, tmp_path: Path) -> None:
    """A unit's tests pass on the reference with every other unit's file the committed stub:
    a unit never needs another one written (a test that does skips, saying why)."""
    entry = CATALOG.get(kata)
    units = entry.stage(stage).units
    stubs = committed_stubs(tmp_path / "stubs")
    for unit in units:
        impl = tmp_path / unit.name
        shutil.copytree(REPO_ROOT / "solutions", impl, ignore=shutil.ignore_patterns("__pycache__"))
        for other in {u.file for u in units} - {unit.file}:
            shutil.copyfile(stubs / kata / other, impl / kata / other)
        run = run_suite(
            entry.suite_paths(entry.stage(stage)),
            impl=str(impl),
            keyword=unit.keyword,
            env=embedded_env(),
        )
        failed = [f"{r.nodeid}: {r.message}" for r in run.failures()]
        assert run.ok, (
            f"{kata} stage {stage}: unit {unit.name} (-k {unit.keyword!r}) is not green on the "
            f"reference with the other units' stubs (exit code {run.returncode}):\n  "
            + "\n  ".join(failed or [run.output[-2000:]])
        )
