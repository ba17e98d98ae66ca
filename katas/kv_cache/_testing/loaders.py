"""Loaders the stage-2 tests control: each blocks until the test releases it (a hard
real-time deadline for the threaded one), and counts its calls, so a test knows how
many loads a cache started."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import anyio
import anyio.abc

from katas._harness.waiting import DEADLINE_S
from katas.kv_cache._testing.caches import async_cache
from katas.kv_cache.api import AsyncLoadingCache, LoadingCache


def load_outcome(cache: LoadingCache, key: str, loader: Callable[[], object]) -> object:
    """``cache.get_or_load(key, loader)``'s value, or the ``RuntimeError`` it raised (a
    failed load reaches every caller of its flight): what a caller's thread got."""
    try:
        return cache.get_or_load(key, loader)
    except RuntimeError as error:
        return error


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
    """An async loader that waits until the test releases it (hard deadline); counts
    calls. Each load returns a fresh object, so callers sharing one flight share one
    object. The deadline is its own: a load the code under test shields from
    cancellation still ends, and the test fails instead of hanging."""

    def __init__(self) -> None:
        self.release = anyio.Event()
        self.calls = 0

    async def __call__(self) -> object:
        self.calls += 1
        with anyio.move_on_after(DEADLINE_S):
            await self.release.wait()
        return object()


class AsyncFlight:
    """An ``AsyncCache`` whose key ``"k"`` is loaded by a held :class:`AsyncLoader`, and
    what each task that asked for it got: the common ground of the async single-flight
    tests, which start callers, cancel some and release the loader."""

    def __init__(self) -> None:
        self.cache: AsyncLoadingCache = async_cache()
        self.loader = AsyncLoader()
        self.results: list[object] = []

    async def call(self) -> None:
        """One caller of ``get_or_load("k")``; records what it got."""
        self.results.append(await self.cache.get_or_load("k", self.loader))


@asynccontextmanager
async def racing_tasks(deadline_s: float = 3 * DEADLINE_S) -> AsyncIterator[anyio.abc.TaskGroup]:
    """A task group for the racing callers of one test, under a hard deadline (a lost
    wake-up fails the test instead of hanging it)."""
    with anyio.fail_after(deadline_s):
        async with anyio.create_task_group() as tg:
            yield tg
