"""The KV-cache contract: types shared by stubs, solutions and tests. Do not edit.

Keys are any hashable values; capacity is counted in entries (``maxsize``) and,
optionally, in weight (``max_weight``, with ``weigh(value) -> int``). Every time and
duration is an integer number of nanoseconds from an injected :class:`Clock`.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable, Hashable, Iterator
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


class EvictingCache(Cache, Protocol):
    """A stage-1 cache (``LRUCache``, ``TTLCache``, ``LFUCache``): a :class:`Cache` with
    its capacity, and the seam stage 2 uses to run user code outside its lock."""

    #: Called as ``on_evict(key, value, cause)`` for every value that leaves; a plain
    #: attribute, read at each removal (None: nobody listens).
    on_evict: OnEvict | None

    @property
    def maxsize(self) -> int:
        """The most entries it holds."""
        ...

    @property
    def max_weight(self) -> int | None:
        """The most total weight it holds (None: entries are counted, not weighed)."""
        ...

    @property
    def weigh(self) -> Weigher | None:
        """The weigher (None: every entry weighs 1)."""
        ...

    def put(self, key: Hashable, value: Any, *, weight: int | None = None) -> None:
        """Insert or replace, evicting from the cold end as the capacity requires;
        ``weight``: the value's weight computed beforehand (``weigh`` is then not called)."""
        ...

    def clear(self) -> None:
        """Remove every entry (cause EXPLICIT; EXPIRED for an expired one)."""
        ...


class ExpiringCache(EvictingCache, Protocol):
    """A stage-1 cache whose entries expire ``ttl_ns`` after they were written (``TTLCache``)."""

    @property
    def ttl_ns(self) -> int: ...

    def expire(self) -> int:
        """Reclaim every expired entry now; return how many went (cause EXPIRED)."""
        ...


class FrequencyCache(EvictingCache, Protocol):
    """A stage-1 cache that evicts the least frequently used entry (``LFUCache``)."""

    def frequency(self, key: Hashable) -> int:
        """How often ``key`` was written or hit since it entered (0 if not held)."""
        ...


__all__ = [
    "NS_PER_MS",
    "NS_PER_S",
    "Cache",
    "CacheStats",
    "Clock",
    "EvictingCache",
    "ExpiringCache",
    "FrequencyCache",
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


class LoadingCache(Cache, Protocol):
    """A cache many threads share (``ConcurrentCache``): single-flight loading, and the
    counters tests sequence threads by."""

    def clear(self) -> None: ...

    def get_or_load(self, key: Hashable, loader: Callable[[], Any]) -> Any:
        """The cached value, or ``loader()``'s: run once for all concurrent misses of
        ``key``, its value (or its exception) handed to every caller of that flight."""
        ...

    def load_statistics(self) -> LoadStatistics: ...


class AsyncLoadingCache(Cache, Protocol):
    """A cache the tasks of one anyio event loop share (``AsyncCache``): the same as
    :class:`LoadingCache`, with a loader that is awaited."""

    def clear(self) -> None: ...

    async def get_or_load(self, key: Hashable, loader: Callable[[], Awaitable[Any]]) -> Any:
        """The cached value, or ``await loader()``'s: awaited once for concurrent misses;
        a cancelled leader's waiters load again."""
        ...

    def load_statistics(self) -> LoadStatistics: ...


__all__ += ["AsyncLoadingCache", "LoadStatistics", "LoadingCache"]


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


class Ring(Protocol):
    """A consistent-hash ring (``HashRing``): each node owns ``vnodes`` points, a key's
    preference list is the distinct nodes met walking clockwise from its point."""

    @property
    def vnodes(self) -> int: ...

    @property
    def nodes(self) -> list[str]:
        """The nodes on the ring, sorted by name."""
        ...

    def __len__(self) -> int: ...

    def __contains__(self, node: object) -> bool: ...

    def add(self, node: str) -> None:
        """Put ``node``'s points on the ring (``ValueError`` if it is there)."""
        ...

    def remove(self, node: str) -> None:
        """Take ``node``'s points off the ring (``ValueError`` if it is not there)."""
        ...

    def nodes_for(self, key: str, n: int) -> list[str]:
        """The ``min(n, len(self))`` distinct nodes clockwise from ``key``'s point."""
        ...

    def node_for(self, key: str) -> str:
        """The first node of ``key``'s preference list (``LookupError`` on an empty ring)."""
        ...


class RemoteCache(Protocol):
    """A cache over several Redis nodes (``ShardedCache``): each key on the first
    ``replicas`` nodes of its preference list, reads failing over, epochs on rejoin.
    Remote: no ``len`` or iteration, and values are JSON."""

    @property
    def ring(self) -> Ring:
        """The ring it places keys with."""
        ...

    @property
    def channel(self) -> str | None:
        """The channel every write publishes its key on (None: writes do not publish)."""
        ...

    @property
    def clients(self) -> dict[str, Any]:
        """Each node's client (a ``redis.Redis``), by node name. (Typed ``Any``: the
        contract names no third-party type, so that stage 1 needs no Redis client.)"""
        ...

    def replicas_for(self, key: str) -> list[str]:
        """The nodes that hold ``key``, in preference order."""
        ...

    def key_name(self, node: str, key: str) -> str:
        """The Redis key under which ``node`` holds ``key`` now: ``f"{prefix}{epoch}:{key}"``."""
        ...

    def get(self, key: str, default: Any = None) -> Any:
        """The first hit among ``key``'s live replicas, in preference order, or ``default``."""
        ...

    def put(self, key: str, value: Any) -> None:
        """Write ``value`` to every reachable replica (``NoReplicaAvailable``: none)."""
        ...

    def delete(self, key: str) -> bool:
        """Remove ``key`` from every reachable replica; True if one of them held it."""
        ...

    def statistics(self) -> dict[str, NodeStatistics]:
        """What this client has seen of each node, by node name."""
        ...


__all__ += ["RemoteCache", "Ring"]


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


class CoherentCache(Protocol):
    """A local cache in front of a :class:`RemoteCache` that publishes its writes
    (``NearCache``), kept coherent by invalidation messages; the listeners it starts
    call :meth:`invalidate`, :meth:`channel_lost` and :meth:`channel_ready`, and a test
    may call them itself to deliver messages in any order."""

    @property
    def remote(self) -> RemoteCache: ...

    @property
    def subscribed(self) -> frozenset[str]:
        """The nodes whose invalidation channel is subscribed now."""
        ...

    def get(self, key: str, default: Any = None) -> Any:
        """A local hit, or the remote value (kept if no invalidation overtook it)."""
        ...

    def put(self, key: str, value: Any) -> None:
        """Write through; this client's next get sees it."""
        ...

    def delete(self, key: str) -> bool:
        """Delete through; True if a replica held it."""
        ...

    def statistics(self) -> NearStatistics: ...

    def invalidate(self, key: str) -> None:
        """A write to ``key`` happened somewhere: drop it, or the read in flight."""
        ...

    def channel_lost(self, node: str) -> None:
        """``node``'s channel dropped: flush everything."""
        ...

    def channel_ready(self, node: str) -> None:
        """``node``'s channel is subscribed: keys on it may be cached again."""
        ...

    def start(self) -> CoherentCache:
        """Start one listener thread per node (``RuntimeError`` if already started)."""
        ...

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the listeners."""
        ...

    def __enter__(self) -> CoherentCache: ...

    def __exit__(self, *exc_info: object) -> None: ...


__all__ += ["CoherentCache"]
