"""No process outlives its run: whatever ends a ``pytest`` or a ``kata`` run, every process
it started, and every process those started, goes with it (katas/_runtime/children.py).

Each test starts a real run that starts real children — three HTTP replica servers in
processes of their own, under a suite run — waits until they are up, ends the run with a
real signal, and then checks that every process that was below it is gone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _support import embedded_env, kata_command

from katas._registry.impl import REPO_ROOT

#: A check that runs a stage suite whose tests start three replica processes each.
SUITE_CHECK = "test_reference_passes_every_stage_suite and streaming_parser-stage3"
#: Real seconds for the children to come up, and for them to be gone.
UP_DEADLINE_S = 60.0
GONE_DEADLINE_S = 10.0


def _process_table() -> dict[int, tuple[int, str]]:
    """``{pid: (parent pid, start time)}`` of every process (the start time tells a
    reused pid from the process it stood for)."""
    table = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # it exited while we looked
            continue
        table[int(entry.name)] = (int(fields[1]), fields[19])
    return table


def _below(root: int) -> dict[int, str]:
    """``{pid: start time}`` of every process descended from ``root``."""
    table = _process_table()
    found: dict[int, str] = {}
    frontier = [root]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, started) in table.items():
            if ppid == parent and pid not in found:
                found[pid] = started
                frontier.append(pid)
    return found


def _alive(processes: dict[int, str]) -> list[int]:
    table = _process_table()
    return sorted(p for p, started in processes.items() if table.get(p, (0, ""))[1] == started)


def _end_and_check(argv: list[str], at_least: int, sig: signal.Signals, tmp: Path) -> None:
    """Start ``argv``, wait for ``at_least`` processes below it, end it with ``sig``, and
    check that none of them outlives it. What the ended run could not clean up (its
    temporary folders) is left in ``tmp``, not in the machine's temporary folder."""
    run = subprocess.Popen(
        argv,
        cwd=REPO_ROOT,
        env={**embedded_env(), "KATA_TEST_TIMEOUT": "120", "TMPDIR": str(tmp)},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + UP_DEADLINE_S
        while time.monotonic() < deadline and run.poll() is None:
            if len(_below(run.pid)) >= at_least:
                break
            time.sleep(0.1)
        below = _below(run.pid)
        assert len(below) >= at_least, (
            f"the run never had {at_least} processes below it (it had {len(below)}; "
            f"exit code {run.poll()})"
        )
        os.kill(run.pid, sig)
        run.wait(GONE_DEADLINE_S)
        deadline = time.monotonic() + GONE_DEADLINE_S
        while _alive(below) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(below), (
            f"{sig.name} of {' '.join(argv[:4])} … left {len(_alive(below))} of the "
            f"{len(below)} processes it had started running: {_alive(below)}"
        )
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()


pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="children die with their parent on Linux"
)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=lambda s: s.name)
def test_ending_pytest_ends_every_process_it_started(sig: signal.Signals, tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    argv += ["tests/test_suites.py", "-k", SUITE_CHECK]
    # the suite run's pytest, then the replicas below it
    _end_and_check(argv, at_least=4, sig=sig, tmp=tmp_path)


def test_ending_kata_test_ends_the_suite_run_and_its_children(tmp_path: Path) -> None:
    argv = [*kata_command(), "test", "streaming_parser", "3", "--impl=solutions"]
    # the suite run's pytest, then the replicas below it
    _end_and_check(argv, at_least=4, sig=signal.SIGTERM, tmp=tmp_path)
