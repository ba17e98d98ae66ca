"""Reading a process that died of a signal: which signal, which test, and where its code
was — from Python's fault handler's dump, which pytest and the harness's forked tests
print on a fatal signal (``File "/x/stage1.py", line 16 in div``, innermost first).

The harness (a forked test that died) and the ``kata`` command (a whole run that died)
both say a crash in one line made here: ``crashed: test_x — the process died of SIGSEGV
at running.py:105 in schedule: <that line of code>``.
"""

from __future__ import annotations

import contextlib
import re
import signal
import sysconfig
from pathlib import Path

#: One frame of the fault handler's dump.
FAULT_FRAME = re.compile(r'^\s*File "(?P<path>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)', re.M)
#: Python's own installation (its library and the installed packages): frames there are
#: not the code a learner reads.
_INSTALLED = tuple(
    Path(sysconfig.get_paths()[key]).resolve()
    for key in ("stdlib", "platstdlib", "purelib", "platlib")
)


def signal_name(number: int) -> str:
    """``SIGSEGV`` for 11 (``signal 99`` for a number with no name)."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def died_of(number: int) -> str:
    """``the process died of SIGSEGV``: how a crash line says a signal ended the run."""
    return f"the process died of {signal_name(number)}"


def where_it_died(dump: str) -> str:
    """`` at running.py:105 in schedule: <the line>``: the innermost frame of the dump
    outside Python's installation (the call into C that never returned); "" if none."""
    for frame in FAULT_FRAME.finditer(dump):
        path = frame["path"]
        if path.startswith("<") or any(Path(path).resolve().is_relative_to(p) for p in _INSTALLED):
            continue
        text = ""
        with contextlib.suppress(OSError, IndexError, ValueError):
            text = Path(path).read_text(errors="replace").splitlines()[int(frame["line"]) - 1]
        shown = f" at {Path(path).name}:{frame['line']} in {frame['func']}"
        return shown + (f": {text.strip()}" if text.strip() else "")
    return ""


def dying_test(dump: str) -> str:
    """The test function among the dump's frames ("" if none is named ``test…``)."""
    return next((m["func"] for m in FAULT_FRAME.finditer(dump) if m["func"].startswith("test")), "")


def crash_message(test: str, how: str, dump: str) -> str:
    """The one line: ``crashed: TEST — HOW`` and where, from ``dump``."""
    return f"crashed: {test + ' — ' if test else ''}{how}{where_it_died(dump)}"


__all__ = ["FAULT_FRAME", "crash_message", "died_of", "dying_test", "signal_name", "where_it_died"]
