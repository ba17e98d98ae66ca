"""Running one stage suite in a subprocess and reading back what each test did.

Used by the ``kata`` command and by the repository's own checks, so both judge a run
the same way: from the JSON that ``--kata-report`` writes, not from pytest's text.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from katas._kit.impl import REPO_ROOT


@dataclass(frozen=True)
class TestResult:
    nodeid: str
    outcome: str  # passed | failed | skipped
    kind: str | None  # not_implemented | assertion | error, for failures
    message: str

    @property
    def name(self) -> str:
        """The test function or class name, without parameters."""
        return self.nodeid.split("::")[1].split("[")[0] if "::" in self.nodeid else self.nodeid


@dataclass(frozen=True)
class SuiteRun:
    returncode: int
    output: str
    results: list[TestResult] = field(default_factory=list)

    def by_outcome(self, outcome: str) -> list[TestResult]:
        return [r for r in self.results if r.outcome == outcome]

    def named(self, name: str) -> list[TestResult]:
        """Results of the test function or stateful class ``name`` (all parametrizations)."""
        return [r for r in self.results if r.name == name]


def suite_file(kata: str, stage: int, root: Path = REPO_ROOT) -> Path:
    return root / "katas" / kata / f"test_stage{stage}.py"


def run_suite(
    kata: str,
    stage: int,
    *,
    impl: str = "katas",
    base: str | None = None,
    keyword: str | None = None,
    pytest_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    timeout_s: float = 900,
    root: Path = REPO_ROOT,
) -> SuiteRun:
    """Run ``katas/<kata>/test_stage<stage>.py`` against ``impl``; never raises on failures."""
    with tempfile.TemporaryDirectory(prefix="kata-report-") as tmp:
        report = Path(tmp) / "report.json"
        argv = [
            sys.executable,
            "-m",
            "pytest",
            str(suite_file(kata, stage, root)),
            f"--impl={impl}",
            f"--kata-report={report}",
            "-q",
            "-p",
            "no:cacheprovider",
        ]
        if base:
            argv.append(f"--base={base}")
        if keyword:
            argv += ["-k", keyword]
        argv += list(pytest_args)
        proc = subprocess.run(
            argv,
            cwd=root,
            env={**os.environ, **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
        results = []
        if report.exists():
            data = json.loads(report.read_text())
            results = [
                TestResult(nodeid, r["outcome"], r["kind"], r["message"])
                for nodeid, r in data.items()
            ]
    return SuiteRun(proc.returncode, proc.stdout + proc.stderr, results)
