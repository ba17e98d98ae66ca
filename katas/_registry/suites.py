"""Running one stage suite in a pytest subprocess and reading back what each test did.

The ``kata`` command and the repository's own checks both use :func:`run_suite`, so both
judge a run the same way: from the JSON the plugin's ``--kata-report`` writes, not from
pytest's text. A suite runs from its project root (the directory above the folder of
katas) with this harness importable and loaded, so a folder of katas outside the checkout
(``KATA_ROOT``) runs exactly like the repository's own.

:func:`start_suite` is the same run without waiting for it (``kata start`` keeps reading
keys and watching files meanwhile): a :class:`SuiteProcess` in a process group of its
own, so that killing it also ends whatever the learner's code started, an endless loop
included. :func:`run_suite` is that run, waited for.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

from katas._registry.catalog import PACKAGE_ROOT, Catalog, load_kata
from katas._registry.impl import ENV_PROFILE, implementation
from katas._registry.warm import WarmStart
from katas._runtime.children import dies_with_parent

PLUGIN = "katas._harness.pytest_plugin"
#: The installed pytest plugins a suite run uses, loaded by name with autoload off. An
#: autoloaded plugin has the asserts of every module of its distribution rewritten (about
#: 120 modules of hypothesis, anyio and pytest-benchmark); where bytecode is not written
#: (PYTHONDONTWRITEBYTECODE) that is redone by every run, 2 s of a 5 s suite.
INSTALLED_PLUGINS = (
    "_hypothesis_pytestplugin",
    "anyio.pytest_plugin",
    "pytest_timeout",
    "pytest_benchmark.plugin",
)


@dataclass(frozen=True)
class TestResult:
    """One test's entry in the ``--kata-report`` JSON."""

    __test__ = False  # a result, not a pytest test class

    nodeid: str
    outcome: str  # passed | failed | skipped
    kind: str | None  # for failures: not_implemented | assertion | error
    message: str  # the failure's first line
    #: what the learner needs besides: the line saying what was expected and what came
    #: (or pytest's ``assert 3 == 4``), or for an error where in their code it was raised
    detail: str = ""

    @property
    def test_id(self) -> str:
        """The test's id inside its file, with parameters: ``test_x[trio]``; a stateful
        test's is its class (``TestStage1LRUModel``), not hypothesis's ``…::runTest``."""
        return self.nodeid.split("::", 1)[-1].removesuffix("::runTest")

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
    #: how many tests pytest selected (None: not known); more than ran when the run
    #: stopped at its first failure (``-x``)
    selected: int | None = None
    #: the rule ids each selected test declares, by node id (``@pytest.mark.rule``)
    rules: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def by_outcome(self, outcome: str) -> list[TestResult]:
        return [r for r in self.results if r.outcome == outcome]

    def named(self, name: str) -> list[TestResult]:
        """Results of the test function or stateful class ``name`` (all parametrizations),
        or of one parametrization, named with its id (``test_x[full]``)."""
        return [r for r in self.results if r.name == name or r.test_id == name]

    def failures(self, kind: str | None = None) -> list[TestResult]:
        return [r for r in self.by_outcome("failed") if kind is None or r.kind == kind]

    def failure_groups(
        self, kinds: Sequence[str] = ("assertion", "error")
    ) -> list[tuple[TestResult, ...]]:
        """The failures of ``kinds``, those with the same kind and message together (a syntax
        error fails every test alike), in order of the first of each group."""
        groups: dict[tuple[str | None, str], list[TestResult]] = {}
        for kind in kinds:
            for failure in self.failures(kind):
                groups.setdefault((failure.kind, failure.message), []).append(failure)
        return [tuple(group) for group in groups.values()]

    def troubles(self) -> str:
        """``", 2 timed out, 1 crashed"``: the failures a tally names besides its count
        (a test past its deadline, a test whose process died); "" for none."""
        counts = (
            (len(self.failures("timeout")), "timed out"),
            (len(self.failures("crashed")), "crashed"),
        )
        return "".join(f", {count} {words}" for count, words in counts if count)

    @property
    def not_run(self) -> int:
        """Selected tests that never ran: the run stopped at a failure (``-x``) first."""
        return max(0, self.selected - len(self.results)) if self.selected is not None else 0

    @property
    def collection_error(self) -> str | None:
        """One line for what kept pytest from collecting the suite, if that is why nothing
        ran: :func:`collection_error` of the output."""
        return None if self.results else collection_error(self.output)

    @property
    def run_error(self) -> str | None:
        """One line if pytest could not run the suite at all (a usage or internal error, not
        a failing or uncollectable suite): :func:`run_error` of the output."""
        if self.results or self.returncode not in (2, 3, 4) or self.collection_error:
            return None
        return run_error(self.returncode, self.output)

    @property
    def config_error(self) -> str | None:
        """The one line of a configuration error that stopped pytest before any test ran
        (exit code 2 and an ``ERROR:`` line: a bad ``--impl``, a Redis that does not
        answer), which no change to the code under test can fix."""
        if self.results or self.returncode != 2:
            return None
        errors = [ln for ln in self.output.splitlines() if ln.startswith("ERROR:")]
        return errors[-1].removeprefix("ERROR:").strip() if errors else None

    @property
    def ok(self) -> bool:
        """Every selected test ran and none failed."""
        return self.returncode == 0 and bool(self.by_outcome("passed")) and not self.failures()


def suite_files(kata: str, stage: int, root: Path = PACKAGE_ROOT) -> list[Path]:
    """The suite files of ``kata`` stage ``stage`` in the folder of katas ``root``
    (kata.toml)."""
    found = load_kata(root / kata)
    return found.suite_paths(found.stage(stage))


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
            detail=str(entry.get("detail") or ""),
        )
        for nodeid, entry in data.items()
        if isinstance(entry, dict)
    )


def read_rules(path: Path) -> dict[str, tuple[str, ...]] | None:
    """Each test the plugin's ``--kata-collected`` file lists (by node id) and the rule ids
    it declares (None: no such file)."""
    try:
        data: Any = json.loads(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    if not isinstance(data, dict):
        return None
    return {
        str(nodeid): tuple(str(r) for r in test.get("rules", ()))
        for nodeid, test in data.items()
        if isinstance(test, dict)
    }


def resolve_impl(spec: str | None, root: Path) -> str:
    """``--impl`` for a suite under the folder of katas ``root``: a PATH is made absolute.

    Without ``spec``: ``KATA_IMPL``, else ``root``'s own stage files (``katas`` in a
    checkout). ValueError if a PATH is not a directory.
    """
    catalog = Catalog(root.resolve())
    # A folder of katas outside the package: its own stage files are the implementation.
    return implementation(spec, "katas" if catalog.is_package else str(catalog.root))


class _Process(Protocol):
    """What a run needs of its process: a :class:`subprocess.Popen` or a forked run."""

    pid: int

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


class SuiteProcess:
    """A suite run in progress: pytest in a subprocess that leads a process group of its own.

    :meth:`poll` and :meth:`wait` give the :class:`SuiteRun` once pytest has exited, read
    exactly as :func:`run_suite` reads it (with how many tests were selected, so a run
    that stopped at its first failure says how many it left); :meth:`kill` ends the run
    and every process in its group, so a learner's endless loop (or a server it started)
    goes too. The output goes to a file, not a pipe, so nobody has to read it while the
    run goes on. A killed run has no result. With ``warm``, pytest is forked from that
    warm process (:mod:`katas._registry.warm`) where it can be.
    """

    def __init__(
        self,
        cmd: Sequence[str],
        cwd: Path,
        env: Mapping[str, str],
        warm: WarmStart | None = None,
    ) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="kata-report-")
        self.report = Path(self._tmp.name) / "report.json"
        self._collected = Path(self._tmp.name) / "collected.json"
        output = Path(self._tmp.name) / "output.txt"
        self._output: IO[bytes] = output.open("w+b")
        self.cmd = [*cmd, "--kata-report", str(self.report)]
        self.cmd += ["--kata-collected", str(self._collected)]
        self._started = time.monotonic()
        self._result: SuiteRun | None = None
        self.killed = False
        try:
            forked = warm.fork(self.cmd, cwd, env, output) if warm else None
            self._proc: _Process = forked or subprocess.Popen(
                self.cmd,
                cwd=cwd,
                env=dict(env),
                stdin=subprocess.DEVNULL,  # the keyboard is the session's, never a test's
                stdout=self._output,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group, and no Ctrl-C of ours
                **dies_with_parent(),
            )
        except BaseException:
            self._cleanup()
            raise

    @property
    def pid(self) -> int:
        """pytest's process id, which is also its process group's id."""
        return self._proc.pid

    def poll(self) -> SuiteRun | None:
        """The result if pytest has exited, else None; never waits."""
        if self._result is None and not self.killed and self._proc.poll() is not None:
            self._finish()
        return self._result

    def wait(self, timeout_s: float | None = None) -> SuiteRun | None:
        """Wait at most ``timeout_s`` (None: for ever) for the result; None if not there yet."""
        if self._result is None and not self.killed:
            try:
                self._proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                return None
            self._finish()
        return self._result

    def kill(self) -> None:
        """End the run now, with everything in its process group (a no-op once finished)."""
        if self._result is not None or self.killed:
            return
        self.killed = True
        if self._proc.returncode is None:  # not reaped yet, so the group id is still its own
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._proc.pid, signal.SIGKILL)
        self._proc.wait()
        self._cleanup()

    def _finish(self) -> None:
        seconds = time.monotonic() - self._started
        self._output.seek(0)
        output = self._output.read().decode(errors="replace")
        rules = read_rules(self._collected)
        self._result = SuiteRun(
            self._proc.wait(),  # it has exited: its code, at once
            read_report(self.report),
            output,
            seconds,
            None if rules is None else len(rules),
            rules or {},
        )
        self._cleanup()

    def _cleanup(self) -> None:
        self._output.close()
        self._tmp.cleanup()


#: What a run runs: one suite file, or a stage's several (all in one kata folder).
Suite = Path | Sequence[Path]


def _suite_command(
    suite: Suite,
    *,
    impl: str | None,
    base: str | None,
    keyword: str | None,
    core_only: bool,
    thorough: bool,
    pytest_args: Sequence[str],
    env: Mapping[str, str] | None,
    cache: bool,
) -> tuple[list[str], Path, dict[str, str]]:
    """``(argv without --kata-report, cwd, env)`` of one suite run."""
    files = [p.resolve() for p in ([suite] if isinstance(suite, Path) else suite)]
    if not files:
        raise ValueError("suite must name at least one file")
    catalog = Catalog(files[0].parent.parent)
    cwd = catalog.project_root
    # The harness the subprocess imports: the checkout's own, or the one running now.
    harness = cwd if catalog.is_package else PACKAGE_ROOT.parent
    run_env = dict(os.environ if env is None else env)
    run_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(harness), run_env.get("PYTHONPATH", "")) if p
    )
    if thorough:
        run_env[ENV_PROFILE] = "thorough"
    cmd = [sys.executable, "-m", "pytest", *(str(p.relative_to(cwd)) for p in files), "-q"]
    cmd += ["-p", PLUGIN]  # a no-op in a checkout (conftest.py loads it); needed elsewhere
    run_env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    for plugin in INSTALLED_PLUGINS:
        cmd += ["-p", plugin]
    # pytest-timeout arms a test's deadline only where a timeout is configured (a folder of
    # katas outside the checkout has none); the plugin sets each kata test's own, so any
    # positive number does, and a --timeout among pytest_args still wins.
    cmd += ["-o", "timeout=120"]
    cmd += ["--impl", resolve_impl(impl, catalog.root)]
    if not cache:
        cmd += ["-p", "no:cacheprovider"]
    if base:
        cmd += ["--base", base]
    if keyword:
        cmd += ["-k", keyword]
    if core_only:
        cmd += ["-m", "core"]
    cmd += list(pytest_args)
    return cmd, cwd, run_env


def start_suite(
    suite: Suite,
    *,
    impl: str | None = None,
    base: str | None = None,
    keyword: str | None = None,
    core_only: bool = False,
    thorough: bool = False,
    pytest_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    cache: bool = False,
    warm: WarmStart | None = None,
) -> SuiteProcess:
    """Start the run :func:`run_suite` makes (the same arguments) and return at once;
    forked from ``warm`` where it can be."""
    cmd, cwd, run_env = _suite_command(
        suite,
        impl=impl,
        base=base,
        keyword=keyword,
        core_only=core_only,
        thorough=thorough,
        pytest_args=pytest_args,
        env=env,
        cache=cache,
    )
    return SuiteProcess(cmd, cwd, run_env, warm)


def run_suite(
    suite: Suite,
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
    warm: WarmStart | None = None,
) -> SuiteRun:
    """Run the suite file ``suite`` (``<katas>/<kata>/test_stageN.py``), or a stage's
    suite files together; print nothing.

    ``impl`` as :func:`resolve_impl` reads it; ``keyword`` is pytest's ``-k``; ``core_only``
    selects ``-m core``; ``thorough`` sets the ``thorough`` hypothesis profile. ``env`` is
    the subprocess's whole environment (default: this process's). With ``live`` pytest
    writes to this terminal as it goes (and reads it: ``--pdb`` works). ``cache`` keeps
    pytest's cache (``--lf``); checks leave it off so their deliberate failures never
    become "last failed". Test failures are results, never exceptions; ValueError for a
    bad ``impl``; subprocess.TimeoutExpired, the run killed, past ``timeout_s``. With
    ``warm`` (not ``live``) pytest is forked from that warm process.
    """
    options: dict[str, Any] = dict(
        impl=impl,
        base=base,
        keyword=keyword,
        core_only=core_only,
        thorough=thorough,
        pytest_args=pytest_args,
        env=env,
        cache=cache,
    )
    if not live:
        run = start_suite(suite, **options, warm=warm)
        try:
            result = run.wait(timeout_s)
            if result is None:
                raise subprocess.TimeoutExpired(run.cmd, timeout_s or 0)
            return result
        finally:
            run.kill()  # a timeout or Ctrl-C: the run goes too (a no-op once it finished)
    cmd, cwd, run_env = _suite_command(suite, **options)
    with tempfile.TemporaryDirectory(prefix="kata-report-") as tmp:
        report = Path(tmp) / "report.json"
        started = time.monotonic()
        shown = subprocess.run(
            [*cmd, "--kata-report", str(report)],
            cwd=cwd,
            env=run_env,
            timeout=timeout_s,
            check=False,
            **dies_with_parent(),
        )
        seconds = time.monotonic() - started
        return SuiteRun(shown.returncode, read_report(report), "", seconds)


# --- what stopped a run before any test ran ---------------------------------------------------

#: pytest's rendering of a SyntaxError: ``E     File "/x/stage1.py", line 12`` then, a few
#: lines on, ``E   SyntaxError: invalid syntax``.
_SYNTAX_FILE = re.compile(r'^E?\s*File "(?P<path>[^"]+)", line (?P<line>\d+)\s*$', re.M)
_SYNTAX_ERROR = re.compile(r"^E?\s*(?P<kind>(?:Syntax|Indentation|Tab)Error): (?P<text>.+)$", re.M)
_EXCEPTION_LINE = re.compile(r"^E\s+(?P<text>[A-Za-z_][\w.]*(?:Error|Exception|Exit)\b.*)$", re.M)


def syntax_error(output: str) -> str | None:
    """``SyntaxError: invalid syntax (stage1.py, line 12)`` from pytest's output, if it shows
    a syntax error (the form a SyntaxError's own ``str()`` has)."""
    for error in _SYNTAX_ERROR.finditer(output):
        files = list(_SYNTAX_FILE.finditer(output, 0, error.start()))
        if files:
            where = files[-1]
            name = Path(where["path"]).name
            return f"{error['kind']}: {error['text'].strip()} ({name}, line {where['line']})"
        return f"{error['kind']}: {error['text'].strip()}"
    return None


def collection_error(output: str) -> str | None:
    """One line for what kept pytest from collecting a suite, from its output: a syntax
    error with its file and line, else the exception pytest shows under ``ERROR
    collecting``; None if the output shows no collection error."""
    if "ERROR collecting" not in output and "error during collection" not in output:
        return None
    found = syntax_error(output)
    if found:
        return found
    lines = [m["text"].strip() for m in _EXCEPTION_LINE.finditer(output)]
    return lines[-1] if lines else "pytest could not collect the suite"


def run_error(returncode: int, output: str) -> str:
    """One line for why pytest could not run at all: the last ``ERROR:`` line it printed (a
    usage error, a bad ``KATA_PROFILE``), else its internal error, else its last line."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    errors = [ln.removeprefix("ERROR:").strip() for ln in lines if ln.startswith("ERROR:")]
    internal = [
        ln.removeprefix("INTERNALERROR>").strip()
        for ln in lines
        if ln.startswith("INTERNALERROR>") and ln.removeprefix("INTERNALERROR>").strip()
    ]
    text = (errors or internal or lines or ["no output"])[-1]
    return f"pytest could not run the suite (exit code {returncode}): {text}"
