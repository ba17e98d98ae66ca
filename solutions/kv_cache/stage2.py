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
- Both share one base, ``_Wrapper``, which holds everything but ``get_or_load``. Every
  call on the inner cache goes through ``_Wrapper._run``: it makes the call under the
  lock (for the async cache, a ``nullcontext``), takes the removals the call caused and
  hands them to ``on_evict`` once the lock is released, even if the call raised. The one
  exception is a sync leader: what its miss removed waits until its flight has landed.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Awaitable, Callable, Hashable, Iterator
from typing import Any, Generic, TypeVar

import anyio

from katas.kv_cache.api import CacheStats, LoadStatistics, RemovalCause

_MISSING: Any = object()
Removal = tuple[Any, Any, RemovalCause]
_T = TypeVar("_T")
#: What a flight's waiters block on: a thread's event, or a task's.
_E = TypeVar("_E", threading.Event, anyio.Event)


class _Flight(Generic[_E]):
    """One load in progress: what its waiters receive when it lands."""

    __slots__ = ("done", "error", "leader", "retry", "stale", "value")

    def __init__(self, done: _E, leader: object) -> None:
        self.done: _E = done
        self.leader = leader  # the thread or task running the loader
        self.value: Any = None
        self.error: BaseException | None = None
        self.stale = False  # the key was written meanwhile: do not cache this value
        self.retry = False  # async: the leader was cancelled; a waiter loads again


def _not_its_own_loader(key: Any, flight: _Flight[Any], caller: object) -> None:
    """A loader that asks for its own key would wait for itself for ever, and every later
    caller of the key with it: refuse. (The loader then fails, and so does its flight.)"""
    if flight.leader == caller:
        raise RuntimeError(
            f"get_or_load({key!r}) was called from inside its own loader: it would wait for itself"
        )


class _Wrapper(Generic[_E]):
    """What both caches share: the inner cache behind a lock, callback capture, flights,
    counters, and every method but ``get_or_load``."""

    def __init__(self, inner: Any, lock: contextlib.AbstractContextManager[Any]) -> None:
        for name in ("get", "put", "delete", "statistics", "on_evict", "weigh", "max_weight"):
            if not hasattr(inner, name):
                raise TypeError(f"inner must be a stage-1 cache (no {name!r}): {inner!r}")
        self._inner = inner
        self._lock = lock
        self._on_evict = inner.on_evict  # the user's; the inner now reports to us
        self._removed: list[Removal] = []
        inner.on_evict = lambda key, value, cause: self._removed.append((key, value, cause))
        self._flights: dict[Any, _Flight[_E]] = {}
        self._loads = self._failures = self._waiters = 0

    def _run(self, call: Callable[[], _T]) -> _T:
        """``call()`` under the lock; then the removals it caused go to ``on_evict``.

        Any call on the inner cache may remove entries (a put evicts, a TTL cache expires
        on reads too, and may on ``in`` and iteration), so each goes through here: the
        user's callback runs only after the lock is released, and may use the cache.
        """
        removed: list[Removal] = []
        try:
            return self._locked(call, removed)
        finally:  # even if the call raised: its removals are its own, not the next call's
            self._hand_on(removed)

    def _locked(self, call: Callable[[], _T], removed: list[Removal]) -> _T:
        """``call()`` under the lock; the removals it caused join ``removed``, even if it
        raised, for the caller to hand on once the lock is released."""
        with self._lock:
            try:
                return call()
            finally:
                removed += self._removed
                self._removed = []

    def _hand_on(self, removed: list[Removal]) -> None:
        if self._on_evict is not None:
            for key, value, cause in removed:
                self._on_evict(key, value, cause)

    def _weight(self, value: Any) -> int | None:
        """The value's weight, computed by the caller before any lock is taken."""
        weigh = self._inner.weigh
        return None if weigh is None or self._inner.max_weight is None else weigh(value)

    # What runs under the lock, through _run: a write makes a load of its key in flight
    # stale, and a flight lands with its outcome.

    def _put(self, key: Any, value: Any, weight: int | None) -> None:
        self._inner.put(key, value, weight=weight)
        self._written(key)

    def _delete(self, key: Any) -> bool:
        found = bool(self._inner.delete(key))
        self._written(key)
        return found

    def _clear(self) -> None:
        self._inner.clear()
        for flight in self._flights.values():
            flight.stale = True

    def _written(self, key: Any) -> None:
        flight = self._flights.get(key)
        if flight is not None:
            flight.stale = True

    def _land(self, key: Any, flight: _Flight[_E], value: Any, weight: int | None) -> None:
        """The load succeeded: cache its value, unless the key was written while it
        loaded, and hand it to the waiters."""
        del self._flights[key]
        if not flight.stale:
            with contextlib.suppress(ValueError):  # too heavy to cache: still the answer
                self._inner.put(key, value, weight=weight)
        flight.value = value
        flight.done.set()

    def _fail(self, key: Any, flight: _Flight[_E]) -> None:
        """The load failed (``flight.error``), or its async leader was cancelled
        (``flight.retry``): nothing is cached; the waiters wake and read which."""
        del self._flights[key]
        self._failures += 1
        flight.done.set()

    # The cache's API.

    def get(self, key: Hashable, default: Any = None) -> Any:
        return self._run(lambda: self._inner.get(key, default))

    def put(self, key: Hashable, value: Any) -> None:
        weight = self._weight(value)  # user code: never under the lock
        self._run(lambda: self._put(key, value, weight))

    def delete(self, key: Hashable) -> bool:
        return self._run(lambda: self._delete(key))

    def clear(self) -> None:
        self._run(self._clear)

    def load_statistics(self) -> LoadStatistics:
        with self._lock:
            return LoadStatistics(self._loads, self._failures, len(self._flights), self._waiters)

    def statistics(self) -> CacheStats:
        stats: CacheStats = self._run(lambda: self._inner.statistics())
        return stats

    def __len__(self) -> int:
        return self._run(lambda: len(self._inner))

    def __contains__(self, key: object) -> bool:
        return self._run(lambda: key in self._inner)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._run(lambda: list(self._inner)))


class ConcurrentCache(_Wrapper[threading.Event]):
    """Any stage-1 cache, safe for many threads, with single-flight ``get_or_load``."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner, threading.Lock())

    def get_or_load(self, key: Hashable, loader: Callable[[], Any]) -> Any:
        """The cached value, or ``loader()``'s — run once for all concurrent misses."""
        removed: list[Removal] = []
        try:
            value, flight, leader = self._locked(lambda: self._join(key), removed)
            if flight is None:
                return value
            if leader:
                # What the miss removed (the key's own expiry, say) is handed on once the
                # flight has landed or failed: a callback asking for the key then finds it
                # cached, or free — not a load that cannot start until the callback returns.
                return self._lead(key, flight, loader, removed)
        finally:
            self._hand_on(removed)
        flight.done.wait()  # the leader always sets it, whatever its loader does
        with self._lock:
            self._waiters -= 1
        if flight.error is not None:
            raise flight.error
        return flight.value

    def _join(self, key: Any) -> tuple[Any, _Flight[threading.Event] | None, bool]:
        """Under the lock: the cached value, or the key's flight and whether we lead it."""
        value = self._inner.get(key, _MISSING)
        if value is not _MISSING:
            return value, None, False
        flight = self._flights.get(key)
        if flight is not None:
            _not_its_own_loader(key, flight, threading.get_ident())
            self._waiters += 1
            return value, flight, False
        flight = self._flights[key] = _Flight(threading.Event(), threading.get_ident())
        self._loads += 1
        return value, flight, True

    def _lead(
        self,
        key: Any,
        flight: _Flight[threading.Event],
        loader: Callable[[], Any],
        removed: list[Removal],
    ) -> Any:
        """Runs the loader and lands (or fails) the flight; what that removes joins
        ``removed``, which the caller hands on."""
        try:
            value = loader()
            weight = self._weight(value)
        except BaseException as error:
            flight.error = error
            self._locked(lambda: self._fail(key, flight), removed)
            raise
        self._locked(lambda: self._land(key, flight, value, weight), removed)
        return value


class AsyncCache(_Wrapper[anyio.Event]):
    """Any stage-1 cache for the tasks of one anyio event loop, with single-flight loads."""

    def __init__(self, inner: Any) -> None:
        # One event loop, and nothing awaits while the cache is read or written: no lock.
        super().__init__(inner, contextlib.nullcontext())

    async def get_or_load(self, key: Hashable, loader: Callable[[], Awaitable[Any]]) -> Any:
        """The cached value, or ``await loader()``'s — awaited once for concurrent misses."""
        while True:
            value = self.get(key, _MISSING)
            if value is not _MISSING:
                return value
            flight = self._flights.get(key)
            if flight is None:
                return await self._lead(key, loader)
            _not_its_own_loader(key, flight, anyio.get_current_task().id)
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
        flight = self._flights[key] = _Flight(anyio.Event(), anyio.get_current_task().id)
        self._loads += 1
        try:
            value = await loader()
            weight = self._weight(value)
        except anyio.get_cancelled_exc_class():
            flight.retry = True  # not the load's fault: a waiter tries again
            self._run(lambda: self._fail(key, flight))
            raise
        except BaseException as error:
            flight.error = error
            self._run(lambda: self._fail(key, flight))
            raise
        self._run(lambda: self._land(key, flight, value, weight))
        return value
