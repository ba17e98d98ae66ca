"""Child processes that die with the process that started them.

Every process the harness, the registry or the ``kata`` command starts and may leave
running (a suite run, a C build, a private ``redis-server``, an HTTP replica, a forked
test, the warm process and its runs) is started with ``**dies_with_parent()`` (or calls
its ``preexec_fn`` itself after a fork); the one-shot ``git`` and ``patch`` calls, which
end in moments, are not. On Linux the kernel then sends the child SIGKILL when its
parent goes, whatever ends the parent — SIGTERM, Ctrl-C, SIGKILL — so a stopped
``pytest`` leaves nothing running: each level of children takes the next one with it.

The kernel ties the child to the *thread* that started it, not to the process: start a
child from a thread that outlives it — pytest's main thread, or a thread that waits for
the child (a suite run in a pool) — never from a pooled worker that may idle out while
the child should run on (``anyio.to_thread``'s threads do). Where there is no ``prctl``
(not Linux) the keyword arguments are empty and children outlive their parent as before.
A ``preexec_fn`` makes :mod:`subprocess` fork rather than vfork, and runs in the child
before exec; this one only calls ``prctl`` and ``getppid``, which need no lock a thread of
the parent could hold.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
from collections.abc import Callable
from typing import TypedDict

#: prctl(2)'s option that sets the parent-death signal.
_PR_SET_PDEATHSIG = 1


def _load_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:  # pragma: no cover - a Linux without a loadable libc
        return None
    prctl: Callable[..., int] = libc.prctl
    return prctl


#: Resolved once, in the parent: the child between fork and exec only calls it.
_PRCTL = _load_prctl()


class PopenTie(TypedDict, total=False):
    """The keyword arguments :func:`dies_with_parent` gives."""

    preexec_fn: Callable[[], None]


def dies_with_parent() -> PopenTie:
    """Keyword arguments for :class:`subprocess.Popen` (and ``run``) that end the child
    with this process (see the module)."""
    if _PRCTL is None:
        return {}
    parent = os.getpid()
    prctl = _PRCTL

    def tie() -> None:  # runs in the child, between fork and exec
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the tie was made
            os._exit(1)

    return {"preexec_fn": tie}


__all__ = ["PopenTie", "dies_with_parent"]
