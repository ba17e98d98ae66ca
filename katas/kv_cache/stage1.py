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
  cache is consistent again; ``stats()`` counts hits, misses, evictions (cause EVICTED
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
# `raise NotImplementedError(...)` as you go.
from collections.abc import Hashable, Iterator
from typing import Any

from katas.kv_cache.api import CacheStats, Clock, OnEvict, Weigher

_WHERE = "stage 1, see katas/kv_cache/README.md"


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
        raise NotImplementedError(f"LRUCache.__init__ — {_WHERE}")

    @property
    def maxsize(self) -> int:
        raise NotImplementedError(f"LRUCache.maxsize — {_WHERE}")

    @property
    def max_weight(self) -> int | None:
        raise NotImplementedError(f"LRUCache.max_weight — {_WHERE}")

    @property
    def weigh(self) -> Weigher | None:
        """The weigher (None: every entry weighs 1)."""
        raise NotImplementedError(f"LRUCache.weigh — {_WHERE}")

    def get(self, key: Hashable, default: Any = None) -> Any:
        """The value for ``key`` (a hit: now the most recently used), or ``default``."""
        raise NotImplementedError(f"LRUCache.get — {_WHERE}")

    def put(self, key: Hashable, value: Any, *, weight: int | None = None) -> None:
        """Insert or replace; evict least recently used entries until within capacity.

        ``weight``: the value's weight computed beforehand (``weigh`` is then not called).
        """
        raise NotImplementedError(f"LRUCache.put — {_WHERE}")

    def delete(self, key: Hashable) -> bool:
        """Remove ``key`` (cause EXPLICIT); True if it was there."""
        raise NotImplementedError(f"LRUCache.delete — {_WHERE}")

    def clear(self) -> None:
        """Remove every entry (cause EXPLICIT)."""
        raise NotImplementedError(f"LRUCache.clear — {_WHERE}")

    def __len__(self) -> int:
        raise NotImplementedError(f"LRUCache.__len__ — {_WHERE}")

    def __contains__(self, key: object) -> bool:
        raise NotImplementedError(f"LRUCache.__contains__ — {_WHERE}")

    def __iter__(self) -> Iterator[Any]:
        """Keys, least recently used first."""
        raise NotImplementedError(f"LRUCache.__iter__ — {_WHERE}")

    def stats(self) -> CacheStats:
        raise NotImplementedError(f"LRUCache.stats — {_WHERE}")


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
        raise NotImplementedError(f"TTLCache.__init__ — {_WHERE}")

    @property
    def ttl_ns(self) -> int:
        raise NotImplementedError(f"TTLCache.ttl_ns — {_WHERE}")

    def get(self, key: Hashable, default: Any = None) -> Any:
        """The value for ``key`` if live (a hit), else ``default`` (an expired one goes,
        cause EXPIRED, and counts as a miss)."""
        raise NotImplementedError(f"TTLCache.get — {_WHERE}")

    def put(self, key: Hashable, value: Any, *, weight: int | None = None) -> None:
        """Insert or replace (the deadline restarts); expired entries go before live ones."""
        raise NotImplementedError(f"TTLCache.put — {_WHERE}")

    def delete(self, key: Hashable) -> bool:
        """Remove ``key``; True if it was live (an expired one goes as EXPIRED: False)."""
        raise NotImplementedError(f"TTLCache.delete — {_WHERE}")

    def clear(self) -> None:
        """Remove every entry (EXPIRED for expired ones, EXPLICIT for the rest)."""
        raise NotImplementedError(f"TTLCache.clear — {_WHERE}")

    def expire(self) -> int:
        """Reclaim every expired entry now; return how many went."""
        raise NotImplementedError(f"TTLCache.expire — {_WHERE}")

    def __len__(self) -> int:
        raise NotImplementedError(f"TTLCache.__len__ — {_WHERE}")

    def __contains__(self, key: object) -> bool:
        raise NotImplementedError(f"TTLCache.__contains__ — {_WHERE}")

    def __iter__(self) -> Iterator[Any]:
        raise NotImplementedError(f"TTLCache.__iter__ — {_WHERE}")

    def stats(self) -> CacheStats:
        raise NotImplementedError(f"TTLCache.stats — {_WHERE}")


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
        raise NotImplementedError(f"LFUCache.__init__ — {_WHERE}")

    @property
    def maxsize(self) -> int:
        raise NotImplementedError(f"LFUCache.maxsize — {_WHERE}")

    @property
    def max_weight(self) -> int | None:
        raise NotImplementedError(f"LFUCache.max_weight — {_WHERE}")

    @property
    def weigh(self) -> Weigher | None:
        raise NotImplementedError(f"LFUCache.weigh — {_WHERE}")

    def get(self, key: Hashable, default: Any = None) -> Any:
        """The value for ``key`` (a hit: its frequency grows by 1), or ``default``."""
        raise NotImplementedError(f"LFUCache.get — {_WHERE}")

    def put(self, key: Hashable, value: Any, *, weight: int | None = None) -> None:
        """Insert (frequency 1) or replace (frequency + 1); evict the least frequent."""
        raise NotImplementedError(f"LFUCache.put — {_WHERE}")

    def delete(self, key: Hashable) -> bool:
        raise NotImplementedError(f"LFUCache.delete — {_WHERE}")

    def clear(self) -> None:
        raise NotImplementedError(f"LFUCache.clear — {_WHERE}")

    def frequency(self, key: Hashable) -> int:
        """How often ``key`` was written or hit since it entered (0 if not held)."""
        raise NotImplementedError(f"LFUCache.frequency — {_WHERE}")

    def __len__(self) -> int:
        raise NotImplementedError(f"LFUCache.__len__ — {_WHERE}")

    def __contains__(self, key: object) -> bool:
        raise NotImplementedError(f"LFUCache.__contains__ — {_WHERE}")

    def __iter__(self) -> Iterator[Any]:
        """Keys in eviction order: lowest frequency first, then least recently accessed."""
        raise NotImplementedError(f"LFUCache.__iter__ — {_WHERE}")

    def stats(self) -> CacheStats:
        raise NotImplementedError(f"LFUCache.stats — {_WHERE}")
