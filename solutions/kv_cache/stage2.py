"""Stage 2 reference: a thread-safe cache with single-flight loading, and its async twin.

Design (see katas/kv_cache/README.md):

- :class:`ConcurrentCache` puts one lock around any stage-1 cache and never runs user
  code under it: ``weigh`` is called before the lock is taken (and its result passed as
  ``put(..., weight=)``), ``on_evict`` is swapped for a collector whose removals are
  replayed to the user's callback after the lock is released, and loaders run outside
  it. A callback that uses the cache, or a slow loader, therefore never deadlocks or
  serialises the others.
- ``get_or_load`` is single-flight: the first miss of a key becomes the leader and runs
  the loader; concurrent misses of that key wait on its flight and receive the very
  same object, or the very same exception (a failure is not cached: the next call
  loads again). A ``put`` or ``delete`` of the key while a load is in flight makes that
  load stale: its value is still returned to its callers, but not cached over the
  newer write.
- :class:`AsyncCache` does the same on one anyio event loop (asyncio or trio), where no
  lock is needed: nothing awaits between reading and writing the cache. The leader
  runs the loader in its own task. A cancelled waiter just stops waiting; a cancelled
  leader wakes its waiters with "retry", and the first of them leads a new load.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Awaitable, Callable, Hashable, Iterator
from typing import Any

import anyio

from katas.kv_cache.api import CacheStats, LoadStatistics, RemovalCause

_MISSING: Any = object()
Removal = tuple[Any, Any, RemovalCause]


class _Flight:
    """One load in progress: what its waiters receive when it lands."""

    __slots__ = ("done", "error", "retry", "stale", "value")

    def __init__(self, done: threading.Event | anyio.Event) -> None:
        self.done = done
        self.value: Any = None
        self.error: BaseException | None = None
        self.stale = False  # the key was written meanwhile: do not cache this value
        self.retry = False  # async: the leader was cancelled; a waiter loads again


class _Wrapper:
    """What both caches share: the inner cache, callback capture, flights, counters."""

    def __init__(self, inner: Any) -> None:
        for name in ("get", "put", "delete", "stats", "on_evict", "weigh", "max_weight"):
            if not hasattr(inner, name):
                raise TypeError(f"inner must be a stage-1 cache (no {name!r}): {inner!r}")
        self._inner = inner
        self._on_evict = inner.on_evict  # the user's; the inner now reports to us
        self._removed: list[Removal] = []
        inner.on_evict = lambda key, value, cause: self._removed.append((key, value, cause))
        self._flights: dict[Any, _Flight] = {}
        self._loads = self._failures = self._waiters = 0

    def _weight(self, value: Any) -> int | None:
        """The value's weight, computed by the caller before any lock is taken."""
        weigh = self._inner.weigh
        return None if weigh is None or self._inner.max_weight is None else weigh(value)

    def _take_removed(self) -> list[Removal]:
        removed, self._removed = self._removed, []
        return removed

    def _notify(self, removed: list[Removal]) -> None:
        if self._on_evict is not None:
            for key, value, cause in removed:
                self._on_evict(key, value, cause)

    def _written(self, key: Any) -> None:
        flight = self._flights.get(key)
        if flight is not None:
            flight.stale = True

    def _keep(self, key: Any, value: Any, weight: int | None, flight: _Flight) -> None:
        """Cache a loaded value, unless the key was written while it loaded."""
        if not flight.stale:
            with contextlib.suppress(ValueError):  # too heavy to cache: still the answer
                self._inner.put(key, value, weight=weight)

    def _load_statistics(self) -> LoadStatistics:
        return LoadStatistics(self._loads, self._failures, len(self._flights), self._waiters)


class ConcurrentCache(_Wrapper):
    """Any stage-1 cache, safe for many threads, with single-flight ``get_or_load``."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self._lock = threading.Lock()

    def get(self, key: Hashable, default: Any = None) -> Any:
        with self._lock:
            value = self._inner.get(key, default)
            removed = self._take_removed()  # a TTL cache may expire the entry it found
        self._notify(removed)
        return value

    def put(self, key: Hashable, value: Any) -> None:
        weight = self._weight(value)  # user code: never under the lock
        with self._lock:
            self._inner.put(key, value, weight=weight)
            self._written(key)
            removed = self._take_removed()
        self._notify(removed)

    def delete(self, key: Hashable) -> bool:
        with self._lock:
            found = bool(self._inner.delete(key))
            self._written(key)
            removed = self._take_removed()
        self._notify(removed)
        return found

    def clear(self) -> None:
        with self._lock:
            self._inner.clear()
            for flight in self._flights.values():
                flight.stale = True
            removed = self._take_removed()
        self._notify(removed)

    def get_or_load(self, key: Hashable, loader: Callable[[], Any]) -> Any:
        """The cached value, or ``loader()``'s — run once for all concurrent misses."""
        with self._lock:
            value = self._inner.get(key, _MISSING)
            removed = self._take_removed()
            flight = None
            if value is _MISSING:
                flight = self._flights.get(key)
                leader = flight is None
                if flight is None:
                    flight = self._flights[key] = _Flight(threading.Event())
                    self._loads += 1
                else:
                    self._waiters += 1
        self._notify(removed)
        if flight is None:
            return value
        if leader:
            return self._lead(key, flight, loader)
        assert isinstance(flight.done, threading.Event)
        flight.done.wait()  # the leader always sets it, whatever its loader does
        with self._lock:
            self._waiters -= 1
        if flight.error is not None:
            raise flight.error
        return flight.value

    def _lead(self, key: Any, flight: _Flight, loader: Callable[[], Any]) -> Any:
        try:
            value = loader()
            weight = self._weight(value)
        except BaseException as error:
            with self._lock:
                del self._flights[key]
                self._failures += 1
            flight.error = error
            assert isinstance(flight.done, threading.Event)
            flight.done.set()
            raise
        with self._lock:
            del self._flights[key]
            self._keep(key, value, weight, flight)
            removed = self._take_removed()
        flight.value = value
        assert isinstance(flight.done, threading.Event)
        flight.done.set()
        self._notify(removed)
        return value

    def statistics(self) -> LoadStatistics:
        with self._lock:
            return self._load_statistics()

    def stats(self) -> CacheStats:
        with self._lock:
            stats: CacheStats = self._inner.stats()
            removed = self._take_removed()
        self._notify(removed)
        return stats

    def __len__(self) -> int:
        with self._lock:
            size = len(self._inner)
            removed = self._take_removed()
        self._notify(removed)
        return size

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._inner

    def __iter__(self) -> Iterator[Any]:
        with self._lock:
            return iter(list(self._inner))


class AsyncCache(_Wrapper):
    """Any stage-1 cache for the tasks of one anyio event loop, with single-flight loads."""

    def get(self, key: Hashable, default: Any = None) -> Any:
        value = self._inner.get(key, default)
        self._notify(self._take_removed())
        return value

    def put(self, key: Hashable, value: Any) -> None:
        self._inner.put(key, value, weight=self._weight(value))
        self._written(key)
        self._notify(self._take_removed())

    def delete(self, key: Hashable) -> bool:
        found = bool(self._inner.delete(key))
        self._written(key)
        self._notify(self._take_removed())
        return found

    def clear(self) -> None:
        self._inner.clear()
        for flight in self._flights.values():
            flight.stale = True
        self._notify(self._take_removed())

    async def get_or_load(self, key: Hashable, loader: Callable[[], Awaitable[Any]]) -> Any:
        """The cached value, or ``await loader()``'s — awaited once for concurrent misses."""
        while True:
            value = self.get(key, _MISSING)
            if value is not _MISSING:
                return value
            flight = self._flights.get(key)
            if flight is None:
                return await self._lead(key, loader)
            assert isinstance(flight.done, anyio.Event)
            self._waiters += 1
            try:
                await flight.done.wait()  # a cancelled waiter just leaves
            finally:
                self._waiters -= 1
            if flight.error is not None:
                raise flight.error
            if not flight.retry:
                return flight.value
            # The leader was cancelled: loop, and the first waiter to get here leads.

    async def _lead(self, key: Any, loader: Callable[[], Awaitable[Any]]) -> Any:
        flight = self._flights[key] = _Flight(anyio.Event())
        self._loads += 1
        try:
            value = await loader()
            weight = self._weight(value)
        except anyio.get_cancelled_exc_class():
            flight.retry = True  # not the load's fault: a waiter tries again
            self._finish(key, flight)
            raise
        except BaseException as error:
            flight.error = error
            self._finish(key, flight)
            raise
        self._keep(key, value, weight, flight)
        flight.value = value
        self._finish(key, flight)
        self._notify(self._take_removed())
        return value

    def _finish(self, key: Any, flight: _Flight) -> None:
        del self._flights[key]
        if flight.error is not None or flight.retry:
            self._failures += 1
        flight.done.set()

    def statistics(self) -> LoadStatistics:
        return self._load_statistics()

    def stats(self) -> CacheStats:
        stats: CacheStats = self._inner.stats()
        self._notify(self._take_removed())
        return stats

    def __len__(self) -> int:
        size = len(self._inner)
        self._notify(self._take_removed())
        return size

    def __contains__(self, key: object) -> bool:
        return key in self._inner

    def __iter__(self) -> Iterator[Any]:
        return iter(list(self._inner))
