"""Code under test in a child process: one runner, one process handle.

The runner (``python -m katas._harness.child MODULE:FUNCTION [--impl …] [--base …]
[ARGS …]``) resolves the implementation selection exactly as pytest does, imports
``MODULE`` — an entry point a kata owns, in ``katas/<kata>/_testing/`` — and calls
``FUNCTION(selection, ARGS)``, whose return value is the exit code. The harness knows
no kata: the entry point builds whatever the kata's test needs from the selection.

A child speaks in lines on stdout (:func:`say` flushes each one at once, so a test can
follow it and strike at an exact point) and reads lines on stdin if it wants to be told
when to go on. The test side, :class:`ChildProcess`, starts one, waits for its lines
with hard deadlines, sends it real signals, and shows its transcript when a wait fails.
A child that keeps reporting it found nothing to do (its ``idle`` line) while a test
knows work is due fails the wait at once (``idle_polls``), instead of when the deadline
runs out: a stalled child is a red run of a second, not of fifteen.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence

from katas._harness.waiting import patience
from katas._registry import impl
from katas._runtime.children import dies_with_parent

#: Real seconds a test waits for a child's line before it fails.
LINE_DEADLINE_S = 15.0
CLOSED = "<closed>"

EntryPoint = Callable[[impl.Selection, list[str]], int]


def say(line: str) -> None:
    """Print one line for the test, at once."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _entry(target: str) -> EntryPoint:
    module, sep, function = target.partition(":")
    if not sep or not module or not function:
        raise SystemExit(f"child: expected MODULE:FUNCTION, got {target!r}")
    found: EntryPoint = getattr(importlib.import_module(module), function)
    return found


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m katas._harness.child", description=__doc__.split("\n\n")[1]
    )
    parser.add_argument("target", help="MODULE:FUNCTION, the kata's entry point")
    impl.add_selection_options(parser.add_argument)
    args, rest = parser.parse_known_args(argv)
    selection = impl.resolve(args.impl, args.base)
    return _entry(args.target)(selection, rest)


def command(target: str, selection: impl.Selection, argv: Sequence[str] = ()) -> list[str]:
    """The command line that runs ``target`` in a child with ``selection``."""
    return [sys.executable, "-m", __name__, target, *impl.selection_argv(selection), *argv]


def run_once(
    target: str,
    selection: impl.Selection,
    argv: Sequence[str] = (),
    *,
    stdin: str = "",
    env: dict[str, str] | None = None,
    deadline_s: float = 60.0,
) -> str:
    """Run a child to completion (hard deadline) and return its stdout; a child that fails
    or outlives the deadline is an AssertionError showing the end of its stderr."""
    try:
        done = subprocess.run(
            command(target, selection, argv),
            input=stdin,
            capture_output=True,
            text=True,
            timeout=deadline_s,
            cwd=impl.REPO_ROOT,
            env=env,
            check=False,
            **dies_with_parent(),
        )
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the child {target} ran past {deadline_s:.0f} s") from None
    if done.returncode != 0:
        raise AssertionError(
            f"the child {target} exited with {done.returncode}:\n{done.stderr[-2000:]}"
        )
    return done.stdout


class ChildProcess:
    """A child process a test started: its output lines, its stdin, real signals."""

    def __init__(
        self,
        target: str,
        selection: impl.Selection,
        argv: Sequence[str] = (),
        *,
        name: str = "child",
        idle: str | None = None,
    ) -> None:
        self.name = name
        self.idle = idle
        self._proc = subprocess.Popen(
            command(target, selection, argv),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            **dies_with_parent(),
        )
        self._lines: list[str] = []
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self._proc.pid

    def alive(self) -> bool:
        """The process has not exited (a stopped one is alive)."""
        return self._proc.poll() is None

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            with self._cond:
                self._lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._lines.append(CLOSED)
            self._cond.notify_all()

    def lines(self, prefix: str = "") -> list[str]:
        """Every line so far that starts with ``prefix``."""
        with self._cond:
            return [line for line in self._lines if line.startswith(prefix)]

    def transcript(self, last: int = 40) -> str:
        """The last ``last`` lines, each run of idle lines shown as one."""
        shown: list[str] = []
        idle = 0
        with self._cond:
            for line in [*self._lines, ""]:
                if self.idle is not None and line == self.idle:
                    idle += 1
                    continue
                if idle:
                    shown.append(f"{self.idle} x{idle}  (found nothing to do)")
                    idle = 0
                shown.append(line)
        return "\n".join(f"    {self.name}| {line}" for line in shown[:-1][-last:])

    def idle_run(self) -> int:
        """How many idle lines in a row, up to now."""
        with self._cond:
            run = 0
            for line in reversed(self._lines):
                if line != self.idle:
                    break
                run += 1
            return run

    def _given_up(self, deadline: float, deadline_s: float, idle_polls: int | None) -> str:
        """Why a wait ends unfulfilled now (its deadline passed, or the child found nothing
        to do ``idle_polls`` times in a row with work due), or "" to wait on."""
        if idle_polls is not None and self.idle_run() >= idle_polls:
            return f"it found nothing to do {idle_polls} times in a row, with work due"
        if time.monotonic() >= deadline:
            return f"{deadline_s:.0f} real seconds passed"
        return ""

    def wait_for(
        self,
        prefix: str,
        *,
        count: int = 1,
        deadline_s: float = LINE_DEADLINE_S,
        idle_polls: int | None = None,
    ) -> str:
        """Wait (hard deadline) until ``count`` lines start with ``prefix``; the last one.

        ``idle_polls``: work is due for this child, so that many idle lines in a row fail
        the wait at once.
        """
        deadline_s *= patience()
        deadline = time.monotonic() + deadline_s
        with self._cond:
            while True:
                found = [line for line in self._lines if line.startswith(prefix)]
                if len(found) >= count:
                    return found[count - 1]
                closed = CLOSED in self._lines
                why = "it exited" if closed else self._given_up(deadline, deadline_s, idle_polls)
                if why:
                    raise AssertionError(
                        f"{self.name} never printed {prefix!r} (x{count}): {why}.\n"
                        f"  its output:\n{self.transcript()}"
                    )
                self._cond.wait(0.05)

    def tell(self, line: str = "go") -> None:
        """Write one line to the child's stdin."""
        assert self._proc.stdin is not None
        self._proc.stdin.write(line + "\n")
        self._proc.stdin.flush()

    def send(self, sig: signal.Signals) -> None:
        """Send a real signal (SIGKILL, SIGSTOP, SIGCONT, SIGTERM …)."""
        if self.alive():
            os.kill(self._proc.pid, sig)

    def wait(self, deadline_s: float = LINE_DEADLINE_S, *, idle_polls: int | None = None) -> int:
        """Wait (hard deadline) for the child to exit and its output to be read; its
        return code. ``idle_polls`` as for :meth:`wait_for`."""
        deadline_s *= patience()
        deadline = time.monotonic() + deadline_s
        while True:
            try:
                code = self._proc.wait(min(0.05, max(0.0, deadline - time.monotonic())))
                break
            except subprocess.TimeoutExpired:
                why = self._given_up(deadline, deadline_s, idle_polls)
                if why:
                    raise AssertionError(
                        f"{self.name} did not exit: {why}.\n  its output:\n{self.transcript()}"
                    ) from None
        self._reader.join(deadline_s)  # every line it printed is in lines() now
        return code

    def close(self) -> None:
        """Kill the child if it still runs (waking a stopped one first); reap it."""
        if self.alive():
            os.kill(self._proc.pid, signal.SIGCONT)  # a stopped process ignores nothing else
            self._proc.kill()
        self._proc.wait(LINE_DEADLINE_S)
        self._reader.join(LINE_DEADLINE_S)
        for stream in (self._proc.stdin, self._proc.stdout):
            if stream is not None:
                stream.close()


if __name__ == "__main__":
    sys.exit(main())
