"""The warm process of a ``kata start`` session (:mod:`katas._registry.warm` starts it).

It imports what every suite run imports (pytest, hypothesis, anyio, trio, redis-py and
fakeredis), then forks one run per request line on stdin — ``[pytest arguments, output
file, working directory, environment]`` as JSON (the last two may be left out: the warm
process's own) — and says
``started PID`` and, once that run has ended, ``exit PID CODE`` on stdout (a negative
code: the signal that ended it). Each run leads a process group of its own, writes to
its output file, reads nothing, and dies with this process, which ends when its stdin
closes (taking any run still going with it).

Run as ``python -m katas._harness.warm_server``.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import select
import signal
import sys
import traceback
from collections.abc import Callable
from typing import NoReturn

import pytest

from katas._runtime.children import dies_with_parent

#: What every run imports: imported once here, inherited by every fork. (None of them
#: reads the environment when imported, so a run's own environment still applies.) Not
#: the plugins a run names with ``-p``: pytest rewrites their asserts as it imports them,
#: and warns about one imported before; what they import is preloaded instead.
PRELOADED = (
    "hypothesis",
    "anyio",
    "anyio._backends._asyncio",
    "anyio._backends._trio",
    "trio",
    "redis",
    "fakeredis",
    "pytest_benchmark.fixture",
    "pytest_benchmark.session",
)
#: Where the warm process started: ``python -m`` put it first on ``sys.path``.
_HOME = os.getcwd()


def _say(text: str) -> None:
    os.write(1, (text + "\n").encode())


def _run(
    args: list[str],
    output: str,
    tie: Callable[[], None] | None,
    cwd: str | None = None,
    env: dict[str, str] | None = None,
) -> NoReturn:
    """The forked child: pytest ``args``, its output to ``output``, in ``cwd`` with the
    environment ``env`` (default: the warm process's); never returns. ``tie`` (made in
    the warm process, before the fork) ends it with the warm process."""
    os.setsid()
    if tie is not None:
        tie()
    if cwd is not None and cwd != _HOME:
        os.chdir(cwd)
        if sys.path and sys.path[0] == _HOME:
            sys.path[0] = cwd
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
        # what a fresh interpreter would have put on sys.path from this run's PYTHONPATH
        extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[1:1] = [p for p in extra if p not in sys.path]
    fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    sys.argv = ["pytest", *args]
    code = 3
    try:
        code = int(pytest.main(args))
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def _preload() -> None:
    """Import what every run imports, and do once what every run would redo."""
    from _pytest.config import default_plugins  # pytest's own plugins: never rewritten

    for name in (*PRELOADED, *(f"_pytest.{plugin}" for plugin in default_plugins)):
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    # Hypothesis scans every module imported so far for constants at each run's
    # collection (0.1 s); the scan remembers what it has seen, and the forks inherit it.
    with contextlib.suppress(Exception):  # a private function: an optimisation only
        from hypothesis.internal.conjecture.providers import _get_local_constants

        _get_local_constants()
    # Every run ends with pytest's gc.collect(), twice (unraisable exceptions): frozen,
    # what was loaded here is not walked again by each fork (0.05 s a collect).
    gc.collect()
    gc.freeze()


def main() -> None:
    _preload()
    tie = dies_with_parent().get("preexec_fn")  # made here: it checks for this parent
    running: set[int] = set()
    pending = b""
    while True:
        ready, _, _ = select.select([0], [], [], 0.02 if running else None)
        for pid in list(running):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                running.discard(pid)
                _say(f"exit {pid} {os.waitstatus_to_exitcode(status)}")
        if not ready:
            continue
        data = os.read(0, 65536)
        if not data:
            break
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            args, output, *where = json.loads(line)
            pid = os.fork()
            if pid == 0:
                _run(args, output, tie, *where)
            running.add(pid)
            _say(f"started {pid}")
    for pid in running:
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)


if __name__ == "__main__":
    main()
