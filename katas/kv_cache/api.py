"""The KV-cache contract: types shared by stubs, solutions and tests. Do not edit.

Keys are any hashable values; capacity is counted in entries (``maxsize``) and,
optionally, in weight (``max_weight``, with ``weigh(value) -> int``). Every time and
duration is an integer number of nanoseconds from an injected :class:`Clock`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from katas._runtime.clients import check_client, to_json, unavailable
from katas._runtime.clock import NS_PER_MS, NS_PER_S, Clock, ManualClock, MonotonicClock


class RemovalCause(enum.Enum):
    """Why an entry left the cache (what ``on_evict`` is told)."""

    EVICTED = "evicted"  # pushed out to make room: the only cause counted in evictions
    EXPIRED = "expired"  # its time to live ran out
    EXPLICIT = "explicit"  # delete(), or clear()
    REPLACED = "replaced"  # put() of an existing key replaced this value


#: ``on_evict(key, value, cause)``: called once for every value that leaves the cache.
OnEvict = Callable[[Any, Any, RemovalCause], None]
#: ``weigh(value) -> int``: a value's weight (an ``int`` >= 0) when ``max_weight`` is set.
Weigher = Callable[[Any], int]


@dataclass(frozen=True)
class CacheStats:
    """A snapshot of a cache's counters since it was built.

    ``hits`` + ``misses`` is the number of ``get`` calls; ``evictions`` counts removals
    with cause EVICTED only, ``expirations`` those with cause EXPIRED. ``size`` and
    ``weight`` are what the cache holds now (live entries only).
    """

    hits: int
    misses: int
    evictions: int
    expirations: int
    size: int
    weight: int

    @property
    def hit_rate(self) -> float:
        """hits / (hits + misses); 0.0 before the first get."""
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class Cache(Protocol):
    """What every cache of this kata offers."""

    def get(self, key: Hashable, default: Any = None) -> Any:
        """The value for ``key`` (a hit, refreshing recency/frequency), or ``default``."""
        ...

    def put(self, key: Hashable, value: Any) -> None:
        """Insert or replace ``key``'s value, evicting others as the capacity requires."""
        ...

    def delete(self, key: Hashable) -> bool:
        """Remove ``key``; True if it was there (cause EXPLICIT)."""
        ...

    def __len__(self) -> int:
        """Live entries held (a pure observation)."""
        ...

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is held and live (a pure observation: no recency change)."""
        ...

    def __iter__(self) -> Iterator[Any]:
        """Live keys, least recently used first (a pure observation)."""
        ...

    def statistics(self) -> CacheStats: ...


__all__ = [
    "NS_PER_MS",
    "NS_PER_S",
    "Cache",
    "CacheStats",
    "Clock",
    "ManualClock",
    "MonotonicClock",
    "OnEvict",
    "RemovalCause",
    "Weigher",
    "check_client",
    "to_json",
    "unavailable",
]


# --- Stage 2: concurrent caches ------------------------------------------------------


@dataclass(frozen=True)
class LoadStatistics:
    """What a concurrent cache's ``get_or_load`` is doing (counts since it was built).

    - ``loads``: loader calls started; ``failures``: those that raised (or, async, were
      cancelled); ``in_flight``: loads running now; ``waiters``: callers waiting now
      for a load another caller leads (tests sequence threads and tasks by these).
    """

    loads: int
    failures: int
    in_flight: int
    waiters: int


__all__ += ["LoadStatistics"]


# --- Stage 3: a sharded, replicated cache over Redis nodes ---------------------------


class NoReplicaAvailable(Exception):
    """A write (``put``/``delete``) reached none of its key's replicas."""


@dataclass(frozen=True)
class NodeStatistics:
    """What one client of a sharded cache has seen of one node (counts since it was built).

    - ``hits`` / ``misses``: gets this node answered with / without a value;
    - ``errors``: calls to it that raised ``ConnectionError`` or ``TimeoutError``;
    - ``failovers``: gets that went on to a later replica because this node was marked
      down or just failed;
    - ``epoch``: the generation its key names carry now; ``down``: marked down now.
    """

    hits: int
    misses: int
    errors: int
    failovers: int
    epoch: int
    down: bool


__all__ += ["NoReplicaAvailable", "NodeStatistics"]


@dataclass(frozen=True)
class NearStatistics:
    """What a near cache has done (counts since it was built).

    - ``hits``: gets served from the local cache; ``misses``: gets that went to Redis;
    - ``invalidations``: invalidation messages applied (one per key per message);
    - ``flushes``: times the whole local cache was dropped because a channel was lost;
    - ``discarded``: replies not stored because an invalidation or a flush overtook them.
    """

    hits: int
    misses: int
    invalidations: int
    flushes: int
    discarded: int


__all__ += ["NearStatistics"]
