"""Tests that may crash the process run in a forked child of it, one test per child.

A learner's C can write past an array or read through a bad pointer; in the pytest
process that is a segfault that ends the whole run with no summary. So every test of a
kata with a C module (see :mod:`katas._runtime.native`) runs in a child forked from the
pytest process: the child runs the test's whole protocol and sends its reports back; a
child that dies of a signal becomes one failed test — which test, the signal, and the
line of Python that called into C (faulthandler's dump) — and the run goes on with the
next test. A forked child inherits everything imported before it (the stage module, and
its C module when a test of the C unit is selected: the run's pre-flight imports them),
so it costs milliseconds; a test outside the C unit that needs the C builds it itself.
"""

from __future__ import annotations

import faulthandler
import gc
import json
import os
import select
import signal
import tempfile
import time
from collections.abc import Callable
from typing import Any

import pytest
from _pytest.runner import runtestprotocol

from katas._harness.failures import failed_record
from katas._harness.preflight import native_modules
from katas._registry import crashes
from katas._runtime.children import dies_with_parent

#: The exit code of a child that ran its test and sent its reports.
_SENT = 0


def wanted(item: pytest.Item) -> bool:
    """Whether ``item`` runs in a child: a kata test whose kata has a C module, when this
    platform can fork and nobody debugs the run (``--pdb`` needs the terminal here) —
    benchmarks excepted, whose results must reach the run's report."""
    if not hasattr(os, "fork") or item.config.getoption("usepdb", False):
        return False
    if "benchmark" in getattr(item, "fixturenames", ()):
        return False  # pytest-benchmark keeps its results in this process, for its report
    return item.get_closest_marker("stage") is not None and bool(native_modules(item.path.parent))


def run_forked(
    item: pytest.Item,
    nextitem: pytest.Item | None,
    records: dict[str, dict[str, Any]],
    *,
    arm: Callable[[], None],
    deadline_s: float,
) -> None:
    """Run ``item``'s protocol in a forked child and log its reports here; a child that
    dies is logged as the test's failure, with the record the ``kata`` command reads.

    ``arm`` starts the test's own deadline in the child (timers do not survive a fork);
    a child still running ``deadline_s`` after it started (stuck in C, past its own
    deadline) is killed here.
    """
    config = item.config
    ihook = item.ihook
    ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    tie = dies_with_parent().get("preexec_fn")  # made here: it checks for this parent
    with tempfile.TemporaryFile() as dump:
        read_end, write_end = os.pipe()
        gc.freeze()  # the child's collector leaves the parent's objects (and pages) alone
        pid = os.fork()
        if pid == 0:  # the child: run the test, send the reports, and leave at once
            os.close(read_end)
            if tie is not None:
                tie()  # a child stuck in C goes when this run goes, whatever ends it
            _child(item, nextitem, records, write_end, dump.fileno(), arm)
        gc.unfreeze()
        os.close(write_end)
        try:
            sent, stuck = _read_until_closed(read_end, time.monotonic() + deadline_s)
        except BaseException:  # Ctrl-C of the run: its test's child goes first
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise
        status = _stop(pid) if stuck else os.waitpid(pid, 0)[1]
        name = item.nodeid.split("::", 1)[-1]
        if stuck:
            dump.seek(0)
            message = (
                f"timeout: {name} was still running {deadline_s:g} s after it started and "
                "did not stop at its deadline (stuck in C?), so it was killed; it was"
                + (crashes.where_it_died(dump.read().decode(errors="replace")) or " somewhere")
            )
            _log_death(item, "timeout", message, records)
        elif os.WIFEXITED(status) and os.WEXITSTATUS(status) == _SENT and sent:
            payload = json.loads(sent)
            for data in payload["reports"]:
                report = config.hook.pytest_report_from_serializable(config=config, data=data)
                ihook.pytest_runtest_logreport(report=report)
            records.update(payload["records"])
        else:  # died of a signal ("crashed"), or left without its reports ("error")
            dump.seek(0)
            message = crash_message(name, status, dump.read().decode(errors="replace"))
            _log_death(item, "crashed" if os.WIFSIGNALED(status) else "error", message, records)
    ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)


#: Real seconds a stuck child has to write faulthandler's dump before it is killed.
_DUMP_GRACE_S = 2.0


def _stop(pid: int) -> int:
    """End a stuck child, first with SIGABRT (faulthandler dumps where it is), then, if
    it is still there, SIGKILL; its wait status."""
    os.kill(pid, signal.SIGABRT)
    deadline = time.monotonic() + _DUMP_GRACE_S
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    return os.waitpid(pid, 0)[1]


def _read_until_closed(fd: int, deadline: float) -> tuple[bytes, bool]:
    """Everything written to the pipe ``fd`` until its writer closes it; ``(data, True)``
    if the deadline came first. Closes ``fd``."""
    chunks: list[bytes] = []
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return b"".join(chunks), True
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return b"".join(chunks), False
            chunks.append(chunk)
    finally:
        os.close(fd)


def _child(
    item: pytest.Item,
    nextitem: pytest.Item | None,
    records: dict[str, dict[str, Any]],
    write_end: int,
    dump_fd: int,
    arm: Callable[[], None],
) -> None:
    code = 1
    try:
        faulthandler.enable(file=dump_fd, all_threads=False)
        arm()
        before = set(records)
        reports = runtestprotocol(item, log=False, nextitem=nextitem)
        signal.setitimer(signal.ITIMER_REAL, 0)  # the deadline armed for this test
        hook = item.config.hook
        payload = {
            "reports": [
                hook.pytest_report_to_serializable(config=item.config, report=r) for r in reports
            ],
            "records": {k: v for k, v in records.items() if k not in before or k == item.nodeid},
        }
        with os.fdopen(write_end, "wb") as pipe:
            pipe.write(json.dumps(payload).encode())
        code = _SENT
    finally:
        os._exit(code)  # never the parent's atexit, fixtures' finalizers or buffers


def crash_message(name: str, status: int, dump: str) -> str:
    """One line for a child that did not come back: which test, how it ended, where."""
    if os.WIFSIGNALED(status):
        how = crashes.died_of(os.WTERMSIG(status))
    else:
        how = f"the process exited with code {os.WEXITSTATUS(status)} before it reported"
    return crashes.crash_message(name, how, dump)


def _log_death(
    item: pytest.Item, kind: str, message: str, records: dict[str, dict[str, Any]]
) -> None:
    """Log the failure of a child that did not come back: ``kind`` is ``crashed``,
    ``timeout`` or (it exited without its reports) ``error``."""
    hint = (
        "The C under test crashed the process. For the C line, run its C unit tests under "
        "AddressSanitizer and UBSan (the README's C section says how)."
        if kind == "crashed"
        else ""  # a timeout says it all; an exit without reports is no crash of C
    )
    report = pytest.TestReport(
        item.nodeid,
        item.location,
        {kw: 1 for kw in item.keywords},
        "failed",
        f"{message}\n{hint}".strip(),
        "call",
        user_properties=list(item.user_properties),
    )
    # no detail: the hint is in pytest's report; the kata command shows one line
    records[item.nodeid] = failed_record(item, kind, message)
    item.ihook.pytest_runtest_logreport(report=report)
