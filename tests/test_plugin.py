"""The pytest side of the harness as a learner meets it: the README's loop, run as written.

Each check runs ``pytest`` on a real kata in a subprocess, the way a learner types it.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping

import pytest
from _support import KATA_ENV, embedded_env

from katas._kit.impl import REPO_ROOT


def learner_pytest(
    *args: str, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``pytest ARGS`` from the repository root, with the learner's defaults."""
    run_env = {k: v for k, v in embedded_env().items() if k not in KATA_ENV}
    run_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=REPO_ROOT,
        env=run_env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


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


def test_base_reference_runs_the_stage_that_k_selects() -> None:
    """The README's loop: ``-k "stage2 and core" --base=reference`` is one stage's run, the
    earlier stage from the reference (so only stage 2's stub is reported missing)."""
    run = learner_pytest(
        "katas/rate_limiter", "-k", "stage2 and core", "--base=reference", "-rf", "--tb=line"
    )
    out = run.stdout + run.stderr
    assert run.returncode == 1, f"exit code {run.returncode}:\n{out[-2000:]}"
    failed = [ln for ln in out.splitlines() if ln.startswith("FAILED ")]
    assert failed and all("test_stage2.py" in ln for ln in failed), out[-2000:]
    assert "ThreadSafeLimiter" in out and "TokenBucket" not in out.split("short test summary")[-1]


def test_base_reference_over_several_stages_is_refused_in_one_line() -> None:
    run = learner_pytest("katas/rate_limiter", "--base=reference")
    assert run.returncode == 4, f"exit code {run.returncode}:\n{run.stdout}{run.stderr}"
    assert "one stage's suite at a time" in run.stdout + run.stderr


def test_help_works_with_a_bad_profile() -> None:
    run = learner_pytest("--help", env={"KATA_PROFILE": "bogus"})
    assert run.returncode == 0 and "--impl" in run.stdout
