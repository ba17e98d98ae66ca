"""Loaders the stage-2 tests control: each blocks until the test releases it (a hard
real-time deadline for the threaded one), and counts its calls, so a test knows how
many loads a cache started."""

from __future__ import annotations

import threading
from collections.abc import Callable

import anyio

from katas._harness.waiting import DEADLINE_S


class Loader:
    """A loader that blocks until the test releases it (hard deadline); counts calls."""

    def __init__(self, result: Callable[[int], object] = lambda n: object()) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()
        self.calls = 0
        self._result = result
        self._lock = threading.Lock()

    def __call__(self) -> object:
        with self._lock:
            self.calls += 1
            n = self.calls
        self.entered.set()
        self.release.wait(DEADLINE_S)
        return self._result(n)


class AsyncLoader:
    """An async loader that waits until the test releases it; counts calls. Each load
    returns a fresh object, so callers sharing one flight share one object."""

    def __init__(self) -> None:
        self.release = anyio.Event()
        self.calls = 0

    async def __call__(self) -> object:
        self.calls += 1
        await self.release.wait()
        return object()
