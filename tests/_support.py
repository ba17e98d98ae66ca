"""Shared helpers for the repository's own checks (imported as ``_support``)."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import MappingProxyType
from typing import Any, Generic, TypeVar

import pytest

from katas._cli.cli import main
from katas._registry.catalog import ENV_ROOT, Catalog
from katas._registry.impl import REPO_ROOT
from katas._runtime.children import dies_with_parent
from katas._runtime.clock import NS_PER_S, ManualClock

T = TypeVar("T")
REDIS_ENV = ("KATA_REDIS_SERVER", "KATA_REDIS_URL", "KATA_REDIS_CLUSTER")


def _catalog() -> Catalog:
    return Catalog(REPO_ROOT / "katas")


def stage_suites() -> list[tuple[str, int]]:
    """Every (kata, stage) of the registry whose suite exists, in order."""
    return [
        (kata.name, stage.number)
        for kata in sorted(_catalog().katas(), key=lambda k: k.name)
        for stage in kata.stages
        if all(p.is_file() for p in kata.suite_paths(stage))
    ]


def suite_files() -> list[Path]:
    """Every suite file a ``kata.toml`` names (and the repository holds), sorted."""
    return sorted(
        path
        for kata in _catalog().katas()
        for stage in kata.stages
        for path in kata.suite_paths(stage)
        if path.is_file()
    )


def suite_id(path: Path) -> str:
    """``kata/test_stageN.py``: a suite file as a test id names it."""
    return f"{path.parent.name}/{path.name}"


def uses_redis(kata: str, stage: int) -> bool:
    """What the stage's kata.toml says: its suite needs Redis."""
    return _catalog().get(kata).stage(stage).redis


def embedded_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for a run on the embedded fakeredis (real-server variables off):
    this process's, or ``base`` (a pool's runs take the one they were started with, not
    what a check running meanwhile has set)."""
    return {k: v for k, v in (os.environ if base is None else base).items() if k not in REDIS_ENV}


def learners_env() -> dict[str, str]:
    """The environment of a learner's plain run: the embedded fakeredis and the default
    (``dev``) hypothesis profile, whatever ``KATA_PROFILE`` this process has."""
    return {k: v for k, v in embedded_env().items() if k != "KATA_PROFILE"}


def real_redis_configured() -> bool:
    """A real server or an external one is configured (a cluster is its own mode)."""
    return any(os.environ.get(k) for k in ("KATA_REDIS_SERVER", "KATA_REDIS_URL"))


def cluster_configured() -> bool:
    return bool(os.environ.get("KATA_REDIS_CLUSTER"))


def uses_cluster(kata: str, stage: int) -> bool:
    """What the stage's kata.toml says: its prompt promises a Redis Cluster."""
    return _catalog().get(kata).stage(stage).cluster


def committed_text(path: Path) -> str:
    """``path``'s text as committed (git's HEAD); the working tree's if git does not know
    it yet (or there is no git)."""
    rel = path.relative_to(REPO_ROOT).as_posix()
    shown = subprocess.run(
        ["git", "show", f"HEAD:{rel}"], cwd=REPO_ROOT, capture_output=True, text=True, check=False
    )
    return shown.stdout if shown.returncode == 0 else path.read_text()


def learner_files() -> list[Path]:
    """Every file a learner edits: each stage's ``files`` in its kata's ``kata.toml``."""
    found = {p for kata in _catalog().katas() for s in kata.stages for p in kata.learner_paths(s)}
    return sorted(found)


def learner_edits() -> list[str]:
    """The learner files that differ from their committed version (repository-relative):
    a learner's work in progress. The repository's checks judge the committed stubs and
    leave these to their kata suites, which judge a learner's code."""
    paths = [p.relative_to(REPO_ROOT).as_posix() for p in learner_files()]
    try:
        diff = subprocess.run(
            ["git", "diff", "--name-only", "HEAD", "--", *paths],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            check=False,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    return sorted(diff.stdout.split()) if diff.returncode == 0 else []


def committed_stubs(dest: Path) -> Path:
    """Lay out the committed stubs of every kata under ``dest`` like ``solutions/``.

    Files come from git's HEAD, so the check holds even in a learner's working copy
    where ``katas/`` has been edited; files git does not know yet come from the tree.
    """
    for kata in _catalog().katas():
        out = dest / kata.name
        out.mkdir(parents=True)
        (out / "__init__.py").write_text("")
        for stub in sorted({p for stage in kata.stages for p in kata.learner_paths(stage)}):
            target = out / stub.relative_to(kata.path)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(committed_text(stub))
    return dest


class Pool(Generic[T]):
    """Independent subprocess checks (whole suite runs), run in the background while
    pytest walks its tests; ``result(key)`` waits for one of them.

    Every pool of the session shares one executor, two runs a core, because a run waits
    about as much as it computes (a cluster starting, a red test's deadline running
    out): the catalogue sweep took 435 s instead of about 600 s with one a core, with
    the same verdicts. ``KATA_POOL_WIDTH`` sets another width: three a core took CI's
    ``--catalogue`` pass from 631 s to 549 s, but a CPU-time ratio test failed once under
    that load. A module that defines ``start_runs(items)`` and ``POOL_ORDER`` has its pool
    started as soon as the session is collected (:func:`start_pools`), lowest order
    first, so its runs overlap the checks that come before it.
    """

    def __init__(self, jobs: Mapping[Hashable, Callable[[], T]]) -> None:
        executor = _executor()
        self._futures = {key: executor.submit(job) for key, job in jobs.items()}

    def result(self, key: Hashable) -> T:
        return self._futures[key].result()

    def shutdown(self) -> None:
        for future in self._futures.values():
            future.cancel()


#: Pools started at collection, by test module, until its fixture takes its own.
_STARTED: dict[Path, Pool[Any]] = {}


@functools.cache
def _executor() -> ThreadPoolExecutor:
    """The session's one executor (made on first use)."""
    width = int(os.environ.get("KATA_POOL_WIDTH", 0)) or 2 * (os.cpu_count() or 1)
    return ThreadPoolExecutor(max_workers=width, thread_name_prefix="pool")


def _items_of(items: Sequence[pytest.Item], path: Path) -> list[pytest.Item]:
    return [i for i in items if i.path == path]


def start_pools(items: Sequence[pytest.Item]) -> None:
    """Start the pool of every selected module that has one (``conftest`` calls this once
    the session is collected)."""
    modules = {item.module for item in items if isinstance(item, pytest.Function)}
    starters = sorted((m for m in modules if hasattr(m, "start_runs")), key=lambda m: m.POOL_ORDER)
    for module in starters:
        path = Path(module.__file__)
        _STARTED[path] = module.start_runs(_items_of(items, path))


def module_pool(
    request: pytest.FixtureRequest, start: Callable[[list[pytest.Item]], Pool[T]]
) -> Pool[T]:
    """The requesting module's pool: the one started at collection, else started now."""
    started = _STARTED.pop(request.path, None)
    if started is not None:
        return started
    return start(_items_of(request.session.items, request.path))


def selected(items: Sequence[pytest.Item], test: str) -> list[dict[str, Any]]:
    """The parameters of every selected item of ``test`` among ``items``.

    A pool starts only the runs that pytest's selection (``-k``, node ids) kept.
    """
    return [
        dict(item.callspec.params)
        for item in items
        if isinstance(item, pytest.Function)
        and item.originalname == test
        and hasattr(item, "callspec")
    ]


# --- a tiny kata for the ``kata`` command's checks ------------------------------------------

#: The fake ``calc`` kata's kata.toml: one stage, add and mul core, sub extended. A check that
#: needs a second stage adds one after (``CALC_TOML + CALC_TOML_STAGE2``).
CALC_TOML = """\
title = "Calculator"
summary = "A kata that exists only for the CLI's own tests."

[[stages]]
number = 1
title = "Add and multiply"
timebox_minutes = 10
core = "Calc.add, Calc.mul"
extended = "Calc.sub"
"""

#: A second stage for ``CALC_TOML``.
CALC_TOML_STAGE2 = """\

[[stages]]
number = 2
title = "Divide"
timebox_minutes = 10
core = "Calc.div"
"""

#: The prompt: ``kata start`` summarises stage 1 by its first paragraph (STAGE1_MARK, not
#: STAGE1_SECOND_MARK); ``kata pair``'s p shows all of it (PROMPT_MARK too). A check that
#: needs a second stage adds ``CALC_README_STAGE2`` after.
CALC_README = """\
# Calculator

INTRO_MARK

## Stage 1

### The problem

STAGE1_MARK: add and multiply.

STAGE1_SECOND_MARK: the rest of the prompt.

PROMPT_MARK: integers only.
"""

#: The prompt of ``CALC_TOML_STAGE2``.
CALC_README_STAGE2 = """\

## Stage 2

STAGE2_MARK
"""

#: Two hints for stage 1, revealed one at a time.
CALC_HINTS = """\
# Calculator — hints

## Stage 1

### Hint 1

HINT_ONE_MARK: use `+`.

### Hint 2

HINT_TWO_MARK: use `*`.
"""

#: The interviewer's notes; ``kata pair`` pages them, one mark a part.
CALC_INTERVIEWER = """\
# Calculator — interviewer notes

## How to run a session

Be kind.

## The follow-up ladder

LADDER_MARK: now with fractions.

## Stage 1 — Add and multiply

ABOUT_MARK: the candidate edits calc/stage1.py.

### Timebox: 10 minutes

TIMEBOX_MARK

### Read aloud

> READ_ALOUD_MARK: build a calculator.

### Clarifying questions and the answers to give

| a strong candidate asks | answer |
|---|---|
| CLARIFY_MARK: negative numbers? *(key)* <!-- also: numbers below zero; minus numbers --> | Yes. |
| What happens on integer overflow? *(key)* | Python ints do not overflow. |
| Which Python version? | 3.10 and up. |

### Follow-ups for this stage

FOLLOWUP_MARK

### Rubric

| axis | strong | acceptable | weak |
|---|---|---|---|
| Problem solving | asks first | asks some | asks none |
| Communication | narrates | explains | silent |

### Curveballs

- **CURVEBALL_MARK — "now divide".** What does 1/0 return?
"""

#: The pristine stub ``stage1.py`` the learner starts from (a docstring is still a stub).
CALC_STUB = '''\
from katas._runtime.todo import Todo


class Calc:
    def add(self, a: int, b: int) -> int:
        """a + b"""
        raise Todo()

    def mul(self, a: int, b: int) -> int:
        raise Todo()

    def sub(self, a: int, b: int) -> int:
        raise Todo()
'''

#: The reference ``stage1.py`` of the fake ``calc`` kata; a kata's checks may add methods after.
CALC_SOLUTION = """\
class Calc:
    def add(self, a: int, b: int) -> int:
        return a + b

    def mul(self, a: int, b: int) -> int:
        return a * b

    def sub(self, a: int, b: int) -> int:
        return a - b
"""

#: Catalogue entries of the fake ``calc`` kata (diffs against ``CALC_SOLUTION``), every
#: header line carrying a mark, so a check sees which of them a command shows.
CALC_SUB_SWAPPED = """\
# bug: BUG_MARK subtracts the wrong way round
# why: WHY_MARK a - b and b - a differ
# symptom: SYMPTOM_MARK the ledger's balances come out negated after every withdrawal
# rationale: RATIONALE_MARK read the operands in declaration order
# catches: test_stage1_sub
--- a/calc/stage1.py
+++ b/calc/stage1.py
@@ -7,2 +7,2 @@
     def sub(self, a: int, b: int) -> int:
-        return a - b
+        return b - a
"""
CALC_ADD_OFF_BY_ONE = """\
# bug: ADD_BUG_MARK adds one too many
# why: every sum is off by one
# symptom: OTHER_SYMPTOM_MARK totals are always one more than the receipts say
# rationale: ADD_RATIONALE_MARK count the carry explicitly
# catches: test_stage1_add
--- a/calc/stage1.py
+++ b/calc/stage1.py
@@ -1,3 +1,3 @@
 class Calc:
     def add(self, a: int, b: int) -> int:
-        return a + b
+        return a + b + 1
"""

#: The stage-1 suite of the fake ``calc`` kata: add and mul are core, sub is extended; a
#: kata's checks may add tests after.
CALC_SUITE = """\
import pytest

pytestmark = [pytest.mark.stage(1)]


@pytest.mark.core
def test_stage1_add(stage_module):
    assert stage_module.Calc().add(2, 3) == 5


@pytest.mark.core
def test_stage1_mul(stage_module):
    assert stage_module.Calc().mul(2, 3) == 6


@pytest.mark.extended
def test_stage1_sub(stage_module):
    got = stage_module.Calc().sub(5, 3)
    assert got == 2, f"sub(5, 3) must be 2, got {got}"
"""

#: The files of ``katas/calc`` for the practice commands' checks; a check changes or adds
#: some with ``{**CALC_KATA, "kata.toml": CALC_TOML + CALC_TOML_STAGE2}``.
CALC_KATA: Mapping[str, str] = MappingProxyType(
    {
        "kata.toml": CALC_TOML,
        "README.md": CALC_README,
        "HINTS.md": CALC_HINTS,
        "INTERVIEWER.md": CALC_INTERVIEWER,
        "stage1.py": CALC_STUB,
        "test_stage1.py": CALC_SUITE,
    }
)

#: What the ``kata`` command and the fake suite read from the environment: cleared for a check.
KATA_ENV = ("KATA_IMPL", "KATA_BASE", "KATA_PROFILE", "EXPECT_PROFILE", "PYTEST_ADDOPTS")


def write(path: Path, text: str) -> None:
    """Write ``text`` to ``path``, making its folders."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def private_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Keep the ``kata`` command's progress in ``tmp_path/xdg-state``, never the user's."""
    state = tmp_path / "xdg-state"
    monkeypatch.setenv("XDG_STATE_HOME", str(state))
    monkeypatch.delenv("KATA_STATE_DIR", raising=False)
    return state


def calc_project(
    project: Path,
    monkeypatch: pytest.MonkeyPatch,
    *,
    kata: Mapping[str, str] = CALC_KATA,
    solution: str = CALC_SOLUTION,
    mutants: Mapping[str, str] | None = None,
) -> Path:
    """A project with one kata, ``calc``, that the ``kata`` command is pointed at (KATA_ROOT).

    ``kata`` holds the files of ``<project>/katas/calc`` (kata.toml, README.md, stage1.py,
    test_stage1.py, …; ``__init__.py`` is added; ``CALC_KATA`` unless told), ``solution`` is
    the reference's ``solutions/calc/stage1.py`` (``CALC_SOLUTION``) and ``mutants`` the bug
    catalogue in ``tests/mutants/calc``.
    The environment variables the command reads are cleared and the console is wide.
    Returns ``<project>/katas``.
    """
    root = project / "katas"
    for name, text in {"__init__.py": "", **kata}.items():
        write(root / "calc" / name, text)
    write(project / "solutions" / "calc" / "__init__.py", "")
    write(project / "solutions" / "calc" / "stage1.py", solution)
    for name, text in (mutants or {}).items():
        write(project / "tests" / "mutants" / "calc" / name, text)
    monkeypatch.setenv(ENV_ROOT, str(root))
    for name in KATA_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("COLUMNS", "200")
    return root


def practice_project(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    *,
    kata: Mapping[str, str] = CALC_KATA,
    mutants: Mapping[str, str] | None = None,
) -> Path:
    """The :func:`calc_project` ``tmp_path/proj`` with the reference ``CALC_SOLUTION`` and
    progress in :func:`private_state`, so :func:`state` reads it. Returns the project."""
    project = tmp_path / "proj"
    calc_project(project, monkeypatch, kata=kata, mutants=mutants)
    private_state(tmp_path, monkeypatch)
    return project


def state_file(project: Path) -> Path:
    """The ``kata`` command's progress of a :func:`practice_project`."""
    return project.parent / "xdg-state" / "infra-katas" / "state.json"


def state(project: Path) -> dict[str, Any]:
    """The progress of a :func:`practice_project`, as the ``kata`` command wrote it."""
    data: dict[str, Any] = json.loads(state_file(project).read_text())
    return data


def attempts(project: Path) -> list[dict[str, Any]]:
    """The timed attempts in the progress of a :func:`practice_project`, oldest first."""
    found: list[dict[str, Any]] = state(project)["attempts"]
    return found


def learner_pytest(
    *args: str, env: Mapping[str, str] | None = None, quiet: bool = True
) -> subprocess.CompletedProcess[str]:
    """``pytest ARGS`` from the repository root as a learner types it (``quiet``: ``-q``),
    on the embedded Redis and with no kata variable set but ``env``'s."""
    run_env = {k: v for k, v in embedded_env().items() if k not in KATA_ENV}
    run_env.update(env or {})
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            *(["-q"] if quiet else []),
            "-p",
            "no:cacheprovider",
            *args,
        ],
        cwd=REPO_ROOT,
        env=run_env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        **dies_with_parent(),
    )


def kata_command() -> list[str]:
    """The ``kata`` command of this environment, to run as a process."""
    script = Path(sys.executable).with_name("kata")
    return [str(script)] if script.exists() else [sys.executable, "-m", "katas._cli.cli"]


def kata_process(*args: str, cwd: Path = REPO_ROOT) -> subprocess.CompletedProcess[str]:
    """Run ``kata ARGS`` as a process in ``cwd`` with no terminal (stdin is /dev/null)."""
    return subprocess.run(
        [*kata_command(), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        stdin=subprocess.DEVNULL,
        **dies_with_parent(),
    )


# --- a scripted terminal and clock for the ``kata`` command's timed sessions ----------------


class ScriptedTerminal:
    """Keys and actions at given (ManualClock) times, and answers to questions, in order.

    Waiting moves the clock, never sleeps. ``screen`` (e.g. reading ``capsys``) is called
    at every question, so ``shown`` holds what was printed before each one and ``asked``
    the questions: what a person at the terminal saw when asked.
    """

    def __init__(
        self,
        clock: ManualClock,
        events: Sequence[tuple[float, str | Callable[[], None]]] = (),
        answers: list[str] | None = None,
        screen: Callable[[], str] | None = None,
    ) -> None:
        self.clock = clock
        self.start = clock.now_ns()
        self.events = sorted(events, key=lambda e: e[0])
        self.answers = answers
        self.screen = screen
        self.asked: list[str] = []
        self.shown: list[str] = []
        self.waits = 0

    @property
    def interactive(self) -> bool:
        return self.answers is not None

    def keys(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def wait_key(self, timeout_ns: int) -> str | None:
        self.waits += 1
        assert self.waits < 100_000, "the session never ended"
        self.clock.advance(max(0, timeout_ns))
        elapsed = (self.clock.now_ns() - self.start) / NS_PER_S
        while self.events and self.events[0][0] <= elapsed:
            _, action = self.events.pop(0)
            if isinstance(action, str):
                if action == "^C":
                    raise KeyboardInterrupt
                return action
            action()
        return None

    def ask(self, question: str) -> str | None:
        self.asked.append(question)
        if self.screen is not None:
            self.shown.append(self.screen())
        if self.answers is None:
            return None
        return self.answers.pop(0) if self.answers else ""


def run_kata(
    argv: list[str],
    events: Sequence[tuple[float, str | Callable[[], None]]] = (),
    answers: list[str] | None = None,
    *,
    wall: float = 1_800_000_000.0,
    screen: Callable[[], str] | None = None,
) -> tuple[int, ScriptedTerminal]:
    """Run ``kata *argv`` in this process on a ManualClock and a :class:`ScriptedTerminal`
    (``events``, ``answers``, ``screen``) with the wall clock at ``wall``; its exit code
    and the terminal."""
    clock = ManualClock()
    terminal = ScriptedTerminal(clock, events, answers, screen)
    code = main(argv, clock=clock, terminal=terminal, wall=lambda: wall)
    return code, terminal


def git(cwd: Path, *args: str) -> None:
    """Run git in ``cwd`` with a throwaway identity (checks that need a history)."""
    subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false", *args],
        cwd=cwd,
        check=True,
        capture_output=True,
    )


class Tmux:
    """One ``kata …`` command in a detached tmux session of its own (``project``'s katas,
    its private state), read off the screen: a real terminal for the session loops."""

    def __init__(
        self, project: Path, tmp_path: Path, args: str, env: Mapping[str, str] | None = None
    ) -> None:
        self.tmux = ["tmux", "-L", f"kata-start-{os.getpid()}-{tmp_path.name}", "-f", "/dev/null"]
        env = {
            **(env or {}),
            "PATH": os.environ["PATH"],
            "HOME": str(tmp_path),
            "TERM": "xterm-256color",
            ENV_ROOT: str(project / "katas"),
            "XDG_STATE_HOME": os.environ["XDG_STATE_HOME"],  # the project's private state
            "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
        }
        settings = [f"{k}={v}" for k, v in env.items()]
        kata = kata_command()
        command = " ".join(["env", "-i", *settings, *kata, args, "; echo KATA_EXIT=$?; sleep 60"])
        subprocess.run(
            [*self.tmux, "new-session", "-d", "-s", "kata", "-x", "120", "-y", "40", command],
            check=True,
        )

    def screen(self) -> str:
        shown = subprocess.run(
            [*self.tmux, "capture-pane", "-p", "-J", "-S", "-200", "-t", "kata"],
            capture_output=True,
            text=True,
            check=False,
        )
        return shown.stdout

    def wait_for(self, *texts: str, timeout_s: float = 30.0) -> str:
        """The screen once every one of ``texts`` is on it.

        A report reaches the pane in more than one write (tmux draws what has arrived), so
        a test waits for all it will read, never for its first line alone.
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            shown = self.screen()
            if all(text in shown for text in texts):
                return shown
            time.sleep(0.05)
        shown = self.screen()
        missing = [text for text in texts if text not in shown]
        raise AssertionError(f"{missing!r} never appeared on the screen:\n{shown}")

    def press(self, key: str) -> None:
        subprocess.run([*self.tmux, "send-keys", "-t", "kata", key], check=True)

    def close(self) -> None:
        subprocess.run([*self.tmux, "kill-server"], capture_output=True, check=False)
