"""Stage 2 — a cache for many threads and tasks, with single-flight loading.

Core: :class:`ConcurrentCache` — thread-safe around any stage-1 cache, with
``get_or_load``. Extended: :class:`AsyncCache` — the same for the tasks of one anyio
event loop (asyncio and trio). The prompt is katas/kv_cache/README.md; run the suite
with ``pytest katas/kv_cache -k stage2`` (``-k "stage2 and core"`` for the core).

Rules the suite checks:

- Every call is safe from any number of threads; the inner cache's rules (capacity,
  recency, TTL, stats) hold exactly as in stage 1 — no lost counts, no torn entries.
  Per key, every history of get/put/delete is linearizable.
- **User code never runs under the lock**: not a loader, not ``on_evict``, not
  ``weigh``. A callback that uses the cache, or a slow loader, must not block others.
  (Stage 1 gives you the seam: ``inner.on_evict`` is an attribute you may replace,
  ``inner.weigh`` a property you may call yourself, ``inner.put(k, v, weight=w)``.)
- ``get_or_load(key, loader)``: a hit returns the cached value; concurrent misses of
  one key call ``loader()`` once and all receive the very same object. If the loader
  raises, every caller of that flight gets that exception, nothing is cached, and the
  next call loads again. Misses of different keys load in parallel. A ``put`` or
  ``delete`` of the key while its load runs wins: the loaded value is returned to its
  callers but not cached over the newer write.
- ``load_statistics()`` reports loads started, failures, loads in flight and waiters, so
  tests sequence threads without sleeping.
- Async (extended): the same on one event loop. A cancelled waiter just stops waiting
  (the load goes on for the others); a cancelled leader does not strand its waiters:
  one of them loads again.
"""

from __future__ import annotations

# TODO(stage2): implement every class and method below; delete each
# `raise Todo()` as you go.
from collections.abc import Awaitable, Callable, Hashable, Iterator
from typing import Any

from katas._runtime.todo import Todo
from katas.kv_cache.api import CacheStats, LoadStatistics


class ConcurrentCache:
    """Any stage-1 cache (``inner``), safe for many threads, with single-flight loads."""

    def __init__(self, inner: Any) -> None:
        raise Todo()

    def get(self, key: Hashable, default: Any = None) -> Any:
        raise Todo()

    def put(self, key: Hashable, value: Any) -> None:
        """Insert or replace (``weigh`` and ``on_evict`` run outside the lock)."""
        raise Todo()

    def delete(self, key: Hashable) -> bool:
        raise Todo()

    def clear(self) -> None:
        raise Todo()

    def get_or_load(self, key: Hashable, loader: Callable[[], Any]) -> Any:
        """The cached value, or ``loader()``'s — run once for all concurrent misses."""
        raise Todo()

    def load_statistics(self) -> LoadStatistics:
        raise Todo()

    def statistics(self) -> CacheStats:
        """The inner cache's statistics."""
        raise Todo()

    def __len__(self) -> int:
        raise Todo()

    def __contains__(self, key: object) -> bool:
        raise Todo()

    def __iter__(self) -> Iterator[Any]:
        raise Todo()


class AsyncCache:
    """Any stage-1 cache for the tasks of one anyio event loop, with single-flight loads."""

    def __init__(self, inner: Any) -> None:
        raise Todo()

    def get(self, key: Hashable, default: Any = None) -> Any:
        raise Todo()

    def put(self, key: Hashable, value: Any) -> None:
        raise Todo()

    def delete(self, key: Hashable) -> bool:
        raise Todo()

    def clear(self) -> None:
        raise Todo()

    async def get_or_load(self, key: Hashable, loader: Callable[[], Awaitable[Any]]) -> Any:
        """The cached value, or ``await loader()``'s — awaited once for concurrent misses;
        a cancelled leader's waiters load again."""
        raise Todo()

    def load_statistics(self) -> LoadStatistics:
        raise Todo()

    def statistics(self) -> CacheStats:
        raise Todo()

    def __len__(self) -> int:
        raise Todo()

    def __contains__(self, key: object) -> bool:
        raise Todo()

    def __iter__(self) -> Iterator[Any]:
        raise Todo()
