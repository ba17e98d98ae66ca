"""Check 5: the code type-checks under ``mypy --strict`` and is ``ruff`` clean.

They judge the repository: a learner file that differs from its committed stub (work in
progress) is left out of both, and the run says so in one line (tests/conftest.py). A
learner's code is judged by its kata suite, not by the repository's linters.
"""

from __future__ import annotations

import re
import subprocess
import sys

from _support import learner_edits

from katas._registry.impl import REPO_ROOT

#: What pyproject.toml's [tool.mypy] leaves out (a command-line --exclude replaces it).
MYPY_EXCLUDED = ("^build/", "^tests/mutants/")


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *argv], cwd=REPO_ROOT, capture_output=True, text=True, check=False
    )


def test_mypy_strict_is_clean() -> None:
    edits = learner_edits()
    excluded = "|".join([*MYPY_EXCLUDED, *(f"^{re.escape(path)}$" for path in edits)])
    # A stub that imports an edited one (stage 2's ``from .stage1 import``) would have mypy
    # follow it back in: followed modules stay silent; every other file is named here.
    follow = ["--follow-imports=silent"] if edits else []
    result = _run("mypy", "--strict", *follow, "--exclude", excluded, "katas", "solutions", "tests")
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]


def test_ruff_is_clean() -> None:
    left_out = [arg for path in learner_edits() for arg in ("--extend-exclude", path)]
    result = _run("ruff", "check", *left_out, ".")
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
