"""Check 5: the code type-checks under ``mypy --strict`` and is ``ruff`` clean."""

from __future__ import annotations

import subprocess
import sys

from katas._registry.impl import REPO_ROOT


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *argv], cwd=REPO_ROOT, capture_output=True, text=True, check=False
    )


def test_mypy_strict_is_clean() -> None:
    result = _run("mypy", "--strict", "katas", "solutions", "tests")
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]


def test_ruff_is_clean() -> None:
    result = _run("ruff", "check", ".")
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
