"""Stage 1 — caches with eviction: LRU and TTL (core), weights and LFU (extended).

The prompt is katas/kv_cache/README.md; run the suite with
``pytest katas/kv_cache -k stage1`` (``-k "stage1 and core"`` for the core).

Rules every cache follows (the suite checks each one):

- Capacity: at most ``maxsize`` entries and, when ``max_weight`` is set, a total weight
  of at most ``max_weight`` (``weigh(value)``, default 1 per entry) after every call.
- ``put`` of a new key inserts it as the most recently used, then evicts from the cold
  end as many entries as the capacity requires — never the key just written. ``put``
  of an existing key is not an insert: it replaces the value (``on_evict(key, old,
  REPLACED)``), adjusts the weight by the difference, refreshes recency, and evicts only
  if the new weight requires it.
- A value heavier than ``max_weight``, a ``weigh`` that returns a negative number or a
  non-int, or an unhashable key: ``ValueError``/``TypeError``, and nothing changes.
- ``get`` is a hit (and refreshes recency) for any stored value, falsy ones included.
- ``in`` and ``len()`` and iteration are pure observations: no recency or frequency
  change. Iteration yields live keys, least recently used first.
- ``on_evict(key, value, cause)`` is called once per value that leaves, after the
  cache is consistent again; ``statistics()`` counts hits, misses, evictions (cause EVICTED
  only) and expirations (cause EXPIRED).
- Stage 2 runs all user code outside its lock: ``on_evict`` is a plain attribute it may
  replace, ``weigh`` a property it may call itself, and ``put(…, weight=w)`` takes a
  weight computed beforehand (then ``weigh`` is not called).
- ``TTLCache``: expire-after-write — an entry is live iff ``now < written_at + ttl_ns``
  (gone exactly at the deadline); an update restarts the deadline; expired entries are
  never returned, counted or iterated; they are reclaimed lazily, by bounded active
  cleanup (each ``put`` reclaims at least one and at most 64 expired entries while any
  remain), and all at once when room is needed: a full cache drops expired entries
  before it evicts a live one.
- ``LFUCache``: a new key has frequency 1; hits and updates add 1; the victim has the
  lowest frequency, ties broken by the least recently accessed; every operation O(1).
"""

from __future__ import annotations

# TODO(stage1): implement every class and method below; delete each
# `raise Todo()` as you go.
from collections.abc import Hashable, Iterator
from typing import Any

from katas._runtime.todo import Todo
from katas.kv_cache.api import CacheStats, Clock, OnEvict, Weigher


class LRUCache:
    """At most ``maxsize`` entries (and ``max_weight``); evicts the least recently used.

    ``maxsize`` >= 1; ``max_weight`` (>= 1) with ``weigh(value) -> int`` (default: each
    entry weighs 1) bounds the total weight too; ``weigh`` without ``max_weight`` is a
    ValueError. ``on_evict(key, value, cause)`` hears of every removal.
    """

    on_evict: OnEvict | None

    def __init__(
        self,
        maxsize: int,
        *,
        max_weight: int | None = None,
        weigh: Weigher | None = None,
        on_evict: OnEvict | None = None,
    ) -> None:
        raise Todo()

    @property
    def maxsize(self) -> int:
        raise Todo()

    @property
    def max_weight(self) -> int | None:
        raise Todo()

    @property
    def weigh(self) -> Weigher | None:
        """The weigher (None: every entry weighs 1)."""
        raise Todo()

    def get(self, key: Hashable, default: Any = None) -> Any:
        """The value for ``key`` (a hit: now the most recently used), or ``default``."""
        raise Todo()

    def put(self, key: Hashable, value: Any, *, weight: int | None = None) -> None:
        """Insert or replace; evict least recently used entries until within capacity.

        ``weight``: the value's weight computed beforehand (``weigh`` is then not called).
        """
        raise Todo()

    def delete(self, key: Hashable) -> bool:
        """Remove ``key`` (cause EXPLICIT); True if it was there."""
        raise Todo()

    def clear(self) -> None:
        """Remove every entry (cause EXPLICIT)."""
        raise Todo()

    def __len__(self) -> int:
        raise Todo()

    def __contains__(self, key: object) -> bool:
        raise Todo()

    def __iter__(self) -> Iterator[Any]:
        """Keys, least recently used first."""
        raise Todo()

    def statistics(self) -> CacheStats:
        raise Todo()


class TTLCache(LRUCache):
    """An LRU cache whose entries expire ``ttl_ns`` (>= 1) after they were written,
    by ``clock``."""

    def __init__(
        self,
        maxsize: int,
        ttl_ns: int,
        *,
        clock: Clock,
        max_weight: int | None = None,
        weigh: Weigher | None = None,
        on_evict: OnEvict | None = None,
    ) -> None:
        raise Todo()

    @property
    def ttl_ns(self) -> int:
        raise Todo()

    def get(self, key: Hashable, default: Any = None) -> Any:
        """The value for ``key`` if live (a hit), else ``default`` (an expired one goes,
        cause EXPIRED, and counts as a miss)."""
        raise Todo()

    def put(self, key: Hashable, value: Any, *, weight: int | None = None) -> None:
        """Insert or replace (the deadline restarts); expired entries go before live ones."""
        raise Todo()

    def delete(self, key: Hashable) -> bool:
        """Remove ``key``; True if it was live (an expired one goes as EXPIRED: False)."""
        raise Todo()

    def clear(self) -> None:
        """Remove every entry (EXPIRED for expired ones, EXPLICIT for the rest)."""
        raise Todo()

    def expire(self) -> int:
        """Reclaim every expired entry now; return how many went."""
        raise Todo()

    def __len__(self) -> int:
        raise Todo()

    def __contains__(self, key: object) -> bool:
        raise Todo()

    def __iter__(self) -> Iterator[Any]:
        raise Todo()

    def statistics(self) -> CacheStats:
        raise Todo()


class LFUCache:
    """Evicts the least frequently used entry (ties: the least recently accessed), O(1).

    Parameters as for :class:`LRUCache`.
    """

    on_evict: OnEvict | None

    def __init__(
        self,
        maxsize: int,
        *,
        max_weight: int | None = None,
        weigh: Weigher | None = None,
        on_evict: OnEvict | None = None,
    ) -> None:
        raise Todo()

    @property
    def maxsize(self) -> int:
        raise Todo()

    @property
    def max_weight(self) -> int | None:
        raise Todo()

    @property
    def weigh(self) -> Weigher | None:
        raise Todo()

    def get(self, key: Hashable, default: Any = None) -> Any:
        """The value for ``key`` (a hit: its frequency grows by 1), or ``default``."""
        raise Todo()

    def put(self, key: Hashable, value: Any, *, weight: int | None = None) -> None:
        """Insert (frequency 1) or replace (frequency + 1); evict the least frequent."""
        raise Todo()

    def delete(self, key: Hashable) -> bool:
        raise Todo()

    def clear(self) -> None:
        raise Todo()

    def frequency(self, key: Hashable) -> int:
        """How often ``key`` was written or hit since it entered (0 if not held)."""
        raise Todo()

    def __len__(self) -> int:
        raise Todo()

    def __contains__(self, key: object) -> bool:
        raise Todo()

    def __iter__(self) -> Iterator[Any]:
        """Keys in eviction order: lowest frequency first, then least recently accessed."""
        raise Todo()

    def statistics(self) -> CacheStats:
        raise Todo()
