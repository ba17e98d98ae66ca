"""The pytest side of the harness as a learner meets it: the README's loop, run as written.

Each check runs ``pytest`` on a real kata in a subprocess, the way a learner types it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from _support import (
    CALC_SOLUTION,
    calc_project,
    committed_stubs,
    committed_text,
    learner_pytest,
)

from katas._harness.failures import classify, failing_rule, failure_detail, regex_mismatch
from katas._registry import mutants
from katas._registry.impl import REPO_ROOT
from katas._registry.suites import run_suite


@pytest.mark.parametrize(
    ("args", "env", "named"),
    [
        pytest.param(["--impl=solution"], {}, "'solution'", id="impl-typo"),
        pytest.param([], {"KATA_IMPL": "/nope"}, "'/nope'", id="KATA_IMPL-missing-dir"),
        pytest.param([], {"KATA_PROFILE": "bogus"}, "'bogus'", id="KATA_PROFILE-typo"),
    ],
)
def test_a_mistyped_selection_is_one_line_and_exit_code_2(
    args: list[str], env: dict[str, str], named: str
) -> None:
    run = learner_pytest("katas/rate_limiter", "-k", "stage1", *args, env=env)
    lines = [ln for ln in (run.stdout + run.stderr).splitlines() if ln.strip()]
    assert run.returncode == 2, f"exit code {run.returncode}:\n{run.stdout}{run.stderr}"
    assert len(lines) == 1, "one line, no traceback:\n" + "\n".join(lines)
    assert named in lines[0], f"the line names the bad value {named}: {lines[0]}"
    valid = ("'katas', 'solutions'",) if "impl" in lines[0].lower() else ("dev", "ci", "thorough")
    assert all(v in lines[0] for v in valid), f"the line lists the valid values: {lines[0]}"


@pytest.fixture(scope="module")
def stubs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The committed stubs, laid out like solutions/ (a learner's edits are not stubs)."""
    return committed_stubs(tmp_path_factory.mktemp("stubs"))


def test_base_reference_runs_the_stage_that_k_selects(stubs: Path) -> None:
    """The README's loop: ``-k "stage2 and core" --base=reference`` is one stage's run, the
    earlier stage from the reference (so only stage 2's stub is reported missing)."""
    run = learner_pytest(
        "katas/rate_limiter", "-k", "stage2 and core", "--base=reference", "-rf", "--tb=line",
        f"--impl={stubs}",
    )  # fmt: skip
    out = run.stdout + run.stderr
    assert run.returncode == 1, f"exit code {run.returncode}:\n{out[-2000:]}"
    failed = [ln for ln in out.splitlines() if ln.startswith("FAILED ")]
    assert failed and all("/test_stage2" in ln for ln in failed), out[-2000:]
    assert "ThreadSafeLimiter" in out and "TokenBucket" not in out.split("short test summary")[-1]


def test_base_reference_over_several_stages_tests_each_stage_over_the_references(
    tmp_path: Path,
) -> None:
    """An implementation whose stage 1 is the stub and whose stage 2 is written: with
    --base=reference, one run fails stage 1 (the implementation's own, untouched) and
    passes stage 2 (over the reference's stage 1)."""
    impl = tmp_path / "impl" / "rate_limiter"
    shutil.copytree(REPO_ROOT / "solutions" / "rate_limiter", impl)
    (impl / "stage1.py").write_text(committed_text(REPO_ROOT / "katas/rate_limiter/stage1.py"))
    run = learner_pytest(
        "katas/rate_limiter", "-k", "(stage1 or stage2) and core", f"--impl={impl.parent}",
        "--base=reference", "-rf", "--tb=line",
    )  # fmt: skip
    out = run.stdout + run.stderr
    failed = [ln for ln in out.splitlines() if ln.startswith("FAILED ")]
    assert failed and all("/test_stage1" in ln for ln in failed), out[-2000:]
    assert "not implemented yet: TokenBucket" in out, out[-2000:]
    assert " passed" in out.splitlines()[-1], out[-2000:]


def test_help_works_with_a_bad_profile() -> None:
    run = learner_pytest("--help", env={"KATA_PROFILE": "bogus"})
    assert run.returncode == 0 and "--impl" in run.stdout


# --- how a red run reads ---------------------------------------------------------------------


def test_an_untouched_stub_fails_every_test_and_says_where_to_start(stubs: Path) -> None:
    run = learner_pytest(
        "katas/rate_limiter", "-k", "stage1", "--tb=line", "-rfE", f"--impl={stubs}"
    )
    out = run.stdout + run.stderr
    lines = out.splitlines()
    assert run.returncode == 1, out[-2000:]
    assert not [ln for ln in lines if ln.startswith("ERROR ")], "stub tests are FAILED, never ERROR"
    assert f"start with TokenBucket (core) in {stubs}/rate_limiter/stage1.py" in lines[-2], lines[
        -3:
    ]
    assert " failed" in lines[-1] and "error" not in lines[-1], lines[-1]


def test_an_untouched_c_stub_says_to_start_in_the_c_file(stubs: Path) -> None:
    run = learner_pytest("katas/dynamic_batcher", "-k", "hotpath", f"--impl={stubs}")
    lines = (run.stdout + run.stderr).splitlines()
    assert run.returncode == 1, lines[-20:]
    assert lines[-2].endswith(
        f"start with hp_fill_token_budget (core) in {stubs}/dynamic_batcher/csrc/hotpath.c"
    ), lines[-3:]


def test_a_stage_2_stub_on_an_unwritten_stage_1_points_at_base_reference(stubs: Path) -> None:
    run = learner_pytest(
        "katas/rate_limiter", "-k", "stage2 and core", "--tb=no", f"--impl={stubs}"
    )
    assert "stop in stage 1: write that first, or add --base=reference" in run.stdout


def _looping_copy(tmp_path: Path) -> Path:
    """A copy of the reference whose token bucket never returns from a decision."""
    impl = tmp_path / "impl"
    shutil.copytree(REPO_ROOT / "solutions", impl, ignore=shutil.ignore_patterns("*.so", "csrc"))
    stage1 = impl / "rate_limiter" / "stage1.py"
    text = stage1.read_text()
    decide = text.index("    def _decide(", text.index("class TokenBucket"))
    body = text.index("\n", decide) + 1
    stage1.write_text(text[:body] + "        while cost > 0:\n            pass\n" + text[body:])
    return impl


def test_a_test_past_its_deadline_is_one_line_naming_it_the_profile_and_the_place(
    tmp_path: Path,
) -> None:
    impl = _looping_copy(tmp_path)
    run = learner_pytest(
        "katas/rate_limiter/test_stage1.py",
        "katas/rate_limiter/test_stage1_properties.py",
        f"--impl={impl}",
        "-k",
        "token_bucket_matches_exact_model or token_bucket_example_from_the_prompt",
        env={"KATA_TEST_TIMEOUT": "1"},
    )
    out = run.stdout + run.stderr
    timeouts = [ln for ln in out.splitlines() if ln.startswith("timeout: ")]
    assert run.returncode == 1 and len(timeouts) == 2, out[-3000:]
    for line in timeouts:
        assert "ran past 1 s under the dev profile" in line, line
        assert "stage1.py:" in line and "in _decide" in line, f"says where the code was: {line}"
    assert "Flaky" not in out and "Traceback" not in out and "+++ Timeout" not in out, out[-3000:]


def test_a_failing_test_quotes_the_rules_it_checks(tmp_path: Path) -> None:
    impl = _looping_copy(tmp_path)
    stage1 = impl / "rate_limiter" / "stage1.py"
    stage1.write_text(stage1.read_text().replace("        while cost > 0:\n            pass\n", ""))
    bucket = stage1.read_text()
    stage1.write_text(bucket.replace("or cost < 1:", "or cost < 0:", 1))  # cost 0 accepted
    assert stage1.read_text() != bucket, "the reference changed: pick another one-line bug"
    run = learner_pytest("katas/rate_limiter/test_stage1.py", f"--impl={impl}", "-k", "bad_cost")
    out = run.stdout
    assert run.returncode == 1, out[-3000:]
    assert "the rule it checks" in out or "the rules it checks" in out, out[-3000:]
    assert "rule §" in out and "(stage 1): " in out, out[-3000:]


def test_a_failed_comparison_is_explained_once_and_tagged_by_its_stage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A message that says what was expected and what came is not followed by pytest's
    ``assert 8 == 2`` of the same values; a bare assert keeps it (it is the only place the
    values appear). Both start with the stage the test's marker names, typed nowhere."""
    wrong = CALC_SOLUTION.replace("a + b", "a * b").replace("a - b", "a + b")
    root = calc_project(tmp_path / "proj", monkeypatch, solution=wrong)
    reference = str(root.parent / "solutions")
    run = run_suite(
        root / "calc" / "test_stage1.py", impl=reference, pytest_args=["-k", "add or sub"]
    )
    out = run.output
    assert "AssertionError: stage 1: sub(5, 3) must be 2, got 8" in out, out
    assert "assert 8 == 2" not in out, f"the explanation is printed twice:\n{out}"
    assert "AssertionError: stage 1: assert 6 == 5" in out, out
    messages = {r.name: r.message for r in run.failures()}
    assert messages["test_stage1_sub"] == "stage 1: sub(5, 3) must be 2, got 8", messages


@pytest.mark.parametrize(
    "text",
    [
        # pytest 9's wording, then the one before it
        "Regex pattern did not match.\n  Expected regex: 'by zero'\n  Actual message: 'b is 0'",
        "Regex pattern did not match.\n Regex: 'by zero'\n Input: 'b is 0'",
    ],
)
def test_a_raises_match_failure_says_the_pattern_and_the_message(text: str) -> None:
    said = "expected a message matching 'by zero', got 'b is 0'"
    kind, message = classify(AssertionError(f"stage 1: {text}"))
    assert (kind, message) == ("assertion", f"stage 1: Regex pattern did not match: {said}")
    assert failure_detail(AssertionError(text), kind) == said
    assert regex_mismatch("stage 1: sub(5, 3) must be 2\nRegex: 'x'\nInput: 'y'") == ""


def test_a_failing_state_machine_names_itself_and_its_rule_not_run_test(tmp_path: Path) -> None:
    """hypothesis runs a state machine as ``…::runTest``: the failure's line names the
    machine and the rule whose step failed, and the report's id is the test class."""
    entry = mutants.parse(
        REPO_ROOT / "tests/mutants/kv_cache/stage1_contains_refreshes_recency.diff"
    )
    impl = mutants.materialise(entry, tmp_path / "impl")
    run = run_suite(
        REPO_ROOT / "katas/kv_cache/test_stage1.py",
        impl=str(impl),
        pytest_args=["-k", "LRUMatchesTheModel and not Weighted"],
    )
    [failure] = run.failures()
    assert failure.test_id == "TestStage1LRUMatchesTheModel", failure.nodeid
    assert failure.message.startswith("stage 1: LRUCacheMachine, rule "), failure.message
    assert "stage 1: LRUCacheMachine, rule " in run.output, run.output[-3000:]


def test_the_failing_rule_is_the_last_step_before_teardown() -> None:
    failure = AssertionError("held keys differ")
    for note in ("Failing test case: <state machine>", "state = M()", "state.put(k=2)"):
        failure.add_note(note)
    failure.add_note("state.get()")
    failure.add_note("state.teardown()")
    assert failing_rule(failure) == "get"
    assert failing_rule(AssertionError("no notes")) is None
