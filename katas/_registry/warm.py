"""A warm start for suite runs: those of one ``kata start`` session, or of a check that
starts hundreds (the bug-catalogue sweep).

A run that stops at its first failure spends most of its time before the first test:
on rate limiter stage 1, 0.7 s a run, of which about 0.45 s is importing pytest,
hypothesis and trio (``python -X importtime``). :class:`WarmStart` keeps one process that
has imported them and forks each run from there, so a run pays for the learner's code,
the harness and the suite only, which it imports fresh.

A forked run is what :func:`~katas._registry.suites.start_suite` starts otherwise: pytest
with the same arguments, in a process group of its own (killing the group ends it and
whatever it started), its output in a file, stdin closed; it dies with the warm process,
which dies with the session (and ends when the session closes its stdin).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from katas._runtime.children import dies_with_parent

#: The warm process, a module of the harness that this module only names (the registry
#: never imports pytest itself): it forks a run per request (see its docstring).
SERVER = "katas._harness.warm_server"


class WarmStart:
    """The warm process of a session, started with its first run; :meth:`close` ends it.

    Each run gets its own working directory and environment. Runs that are not ``python
    -m pytest`` are not forked (:meth:`fork` returns None): the caller starts them as
    usual. Threads may fork and wait on runs at the same time.
    """

    def __init__(self) -> None:
        self._server: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()  # one reader and one writer of the warm process
        self._pending = b""
        self._exits: dict[int, int] = {}
        self._started: list[int] = []

    def fork(
        self, cmd: Sequence[str], cwd: Path, env: Mapping[str, str], output: Path
    ) -> ForkedRun | None:
        """Start ``cmd`` (``python -m pytest ARGS``) forked from the warm process, its output
        to ``output``; None if this run cannot be forked."""
        if list(cmd[:3]) != [sys.executable, "-m", "pytest"]:
            return None
        with self._lock:
            if self._server is None:
                self._server = subprocess.Popen(
                    [sys.executable, "-m", SERVER],
                    cwd=cwd,
                    env=dict(env),
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    start_new_session=True,  # no Ctrl-C of ours; the session ends it
                    **dies_with_parent(),
                )
            if self._server.poll() is not None:
                return None
            assert self._server.stdin is not None
            request = [list(cmd[3:]), str(output), str(cwd), dict(env)]
            try:
                self._server.stdin.write(json.dumps(request).encode() + b"\n")
                self._server.stdin.flush()
            except OSError:
                return None
            # Once asked, the run is forked: wait for its pid (starting it a second time,
            # cold, would give two runs one report file), unless the warm process died.
            while not self._started:
                if self._server.poll() is not None:
                    return None
                self._read(0.05)
            return ForkedRun(self, self._started.pop(0))

    def _read(self, timeout_s: float) -> None:
        """Read what the warm process said within ``timeout_s``."""
        assert self._server is not None and self._server.stdout is not None
        stdout = self._server.stdout.fileno()
        ready, _, _ = select.select([stdout], [], [], max(0.0, timeout_s))
        if not ready:
            return
        data = os.read(stdout, 65536)
        if not data:  # the warm process is gone, and its runs with it
            time.sleep(timeout_s)
            return
        self._pending += data
        while b"\n" in self._pending:
            line, self._pending = self._pending.split(b"\n", 1)
            words = line.decode().split()
            if words[:1] == ["started"]:
                pid = int(words[1])
                # pids are reused (32 768 of them on many machines): an exit said for an
                # earlier run of this pid is not this run's
                self._exits.pop(pid, None)
                self._started.append(pid)
            elif words[:1] == ["exit"]:
                self._exits[int(words[1])] = int(words[2])

    def returncode(self, pid: int, timeout_s: float | None) -> int | None:
        """Run ``pid``'s exit code, waiting at most ``timeout_s`` (None: for ever)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            with self._lock:
                if pid in self._exits:
                    return self._exits[pid]
                if self._server is None or self._server.poll() is not None:
                    if self._server is not None:
                        self._read(0)
                    return self._exits.get(pid, -signal.SIGKILL)  # died with the warm process
                left = 0.5 if deadline is None else deadline - time.monotonic()
                if left <= 0:
                    return None
                # short reads: another thread waiting on its own run takes the lock between
                self._read(min(left, 0.05))

    def close(self) -> None:
        """End the warm process and any run it still has (a no-op if none was started)."""
        if self._server is None:
            return
        server, self._server = self._server, None
        with contextlib.suppress(OSError):
            if server.stdin is not None:
                server.stdin.close()
        try:
            server.wait(5)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        if server.stdout is not None:
            server.stdout.close()


class ForkedRun:
    """A run forked from a :class:`WarmStart`, as much of a :class:`subprocess.Popen` as
    a suite run uses."""

    def __init__(self, warm: WarmStart, pid: int) -> None:
        self._warm = warm
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._warm.returncode(self.pid, 0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._warm.returncode(self.pid, timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired([str(self.pid)], timeout or 0)
        return self.returncode


__all__ = ["ForkedRun", "WarmStart"]
