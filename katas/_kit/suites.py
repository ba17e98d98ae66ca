"""Running one stage suite in a pytest subprocess and reading back what each test did.

The ``kata`` command and the repository's own checks both use :func:`run_suite`, so both
judge a run the same way: from the JSON the plugin's ``--kata-report`` writes, not from
pytest's text. A suite runs from its project root (the directory above the folder of
katas) with this harness importable and loaded, so a folder of katas outside the checkout
(``KATA_ROOT``) runs exactly like the repository's own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from katas._kit.catalog import PACKAGE_ROOT, Catalog
from katas._kit.impl import ENV_IMPL, ENV_PROFILE

PLUGIN = "katas._kit.pytest_plugin"


@dataclass(frozen=True)
class TestResult:
    """One test's entry in the ``--kata-report`` JSON."""

    __test__ = False  # a result, not a pytest test class

    nodeid: str
    outcome: str  # passed | failed | skipped
    kind: str | None  # for failures: not_implemented | assertion | error
    message: str

    @property
    def test_id(self) -> str:
        """The test's id inside its file, with parameters: ``test_x[trio]``."""
        return self.nodeid.split("::", 1)[-1]

    @property
    def name(self) -> str:
        """The test function or stateful class, without parameters: what ``-k`` selects."""
        return self.test_id.split("::")[0].split("[")[0]


@dataclass(frozen=True)
class SuiteRun:
    """One run of a stage suite."""

    returncode: int  # pytest's exit code
    results: tuple[TestResult, ...]
    output: str  # pytest's stdout and stderr; empty when it was shown live
    seconds: float

    def by_outcome(self, outcome: str) -> list[TestResult]:
        return [r for r in self.results if r.outcome == outcome]

    def named(self, name: str) -> list[TestResult]:
        """Results of the test function or stateful class ``name`` (all parametrizations)."""
        return [r for r in self.results if r.name == name]

    def failures(self, kind: str | None = None) -> list[TestResult]:
        return [r for r in self.by_outcome("failed") if kind is None or r.kind == kind]

    @property
    def ok(self) -> bool:
        """Every selected test ran and none failed."""
        return self.returncode == 0 and bool(self.by_outcome("passed")) and not self.failures()


def suite_file(kata: str, stage: int, root: Path = PACKAGE_ROOT) -> Path:
    """The default suite of ``kata`` stage ``stage`` in the folder of katas ``root``."""
    return root / kata / f"test_stage{stage}.py"


def read_report(path: Path) -> tuple[TestResult, ...]:
    """Parse the plugin's ``--kata-report`` file (missing or unreadable: no results)."""
    try:
        data: Any = json.loads(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return ()
    if not isinstance(data, dict):
        return ()
    return tuple(
        TestResult(
            nodeid=str(nodeid),
            outcome=str(entry.get("outcome", "failed")),
            kind=entry.get("kind"),
            message=str(entry.get("message") or ""),
        )
        for nodeid, entry in data.items()
        if isinstance(entry, dict)
    )


def resolve_impl(spec: str | None, root: Path) -> str:
    """``--impl`` for a suite under the folder of katas ``root``: a PATH is made absolute.

    Without ``spec``: ``KATA_IMPL``, else ``root``'s own stage files (``katas`` in a
    checkout). ValueError if a PATH is not a directory.
    """
    catalog = Catalog(root.resolve())
    spec = spec or os.environ.get(ENV_IMPL) or ("katas" if catalog.is_package else "")
    if not spec:  # a folder of katas outside the package: its own stage files are the impl
        return str(catalog.root)
    if spec in ("katas", "solutions"):
        return spec
    path = Path(spec).expanduser().resolve()
    if not path.is_dir():
        raise ValueError(
            "--impl must be 'katas', 'solutions' or a directory laid out like solutions/, "
            f"got {spec!r}"
        )
    return str(path)


def run_suite(
    suite: Path,
    *,
    impl: str | None = None,
    base: str | None = None,
    keyword: str | None = None,
    core_only: bool = False,
    thorough: bool = False,
    pytest_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    live: bool = False,
    cache: bool = False,
    timeout_s: float | None = 900,
) -> SuiteRun:
    """Run the suite file ``suite`` (``<katas>/<kata>/test_stageN.py``); print nothing.

    ``impl`` as :func:`resolve_impl` reads it; ``keyword`` is pytest's ``-k``; ``core_only``
    selects ``-m core``; ``thorough`` sets the ``thorough`` hypothesis profile. ``env`` is
    the subprocess's whole environment (default: this process's). With ``live`` pytest
    writes to this terminal as it goes. ``cache`` keeps pytest's cache (``--lf``); checks
    leave it off so their deliberate failures never become "last failed". Test failures
    are results, never exceptions; ValueError for a bad ``impl``.
    """
    suite = suite.resolve()
    catalog = Catalog(suite.parent.parent)
    cwd = catalog.project_root
    # The harness the subprocess imports: the checkout's own, or the one running now.
    harness = cwd if catalog.is_package else PACKAGE_ROOT.parent
    run_env = dict(os.environ if env is None else env)
    run_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(harness), run_env.get("PYTHONPATH", "")) if p
    )
    if thorough:
        run_env[ENV_PROFILE] = "thorough"
    with tempfile.TemporaryDirectory(prefix="kata-report-") as tmp:
        report = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "pytest", str(suite.relative_to(cwd)), "-q"]
        cmd += ["-p", PLUGIN]  # a no-op in a checkout (conftest.py loads it); needed elsewhere
        cmd += ["--impl", resolve_impl(impl, catalog.root), "--kata-report", str(report)]
        if not cache:
            cmd += ["-p", "no:cacheprovider"]
        if base:
            cmd += ["--base", base]
        if keyword:
            cmd += ["-k", keyword]
        if core_only:
            cmd += ["-m", "core"]
        cmd += list(pytest_args)
        started = time.monotonic()
        if live:
            shown = subprocess.run(cmd, cwd=cwd, env=run_env, timeout=timeout_s, check=False)
            returncode, output = shown.returncode, ""
        else:
            captured = subprocess.run(
                cmd,
                cwd=cwd,
                env=run_env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                errors="replace",
                timeout=timeout_s,
                check=False,
            )
            returncode, output = captured.returncode, captured.stdout
        seconds = time.monotonic() - started
        return SuiteRun(returncode, read_report(report), output, seconds)
