"""Stage 1 reference: LRU, TTL and LFU caches with count and weight capacity.

Design (see katas/kv_cache/README.md):

- ``LRUCache``: one ``OrderedDict`` is the whole structure — a hash map threaded by a
  doubly linked list in C, so ``move_to_end`` and ``popitem(last=False)`` are O(1).
  The least recently used entry is first; a hit or an update moves a key to the end.
- ``TTLCache``: the same LRU order, plus each key's deadline (expire-after-write) and
  a heap of ``(deadline, seq, key)`` with lazy deletion, so the earliest deadline is
  always on top whatever the clock does (``ManualClock.set`` may step back). Expired
  entries go lazily (a ``get`` that finds one), by bounded active cleanup (each ``put``
  pops at most ``_ACTIVE_LIMIT`` expired entries), and all at once when room is needed:
  a full cache drops expired entries before it evicts a live one.
- ``LFUCache``: O(1) with frequency buckets — a linked list of buckets in increasing
  frequency, each an ``OrderedDict`` of its keys (least recently accessed first, for
  the tie-break). A hit moves a key to the next bucket, created on demand.
- Every write validates first (weight included) and evicts after inserting, from the
  cold end, so the key just written is never the victim and a refused write changes
  nothing. Removals are collected and ``on_evict`` runs once the structure is
  consistent again — and stage 2 can swap ``on_evict`` and pass ``weight=`` to run all
  user code outside its lock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator
from heapq import heapify, heappop, heappush
from typing import Any

from katas._runtime.checks import positive_int
from katas.kv_cache.api import CacheStats, Clock, OnEvict, RemovalCause, Weigher

EVICTED, EXPIRED = RemovalCause.EVICTED, RemovalCause.EXPIRED
EXPLICIT, REPLACED = RemovalCause.EXPLICIT, RemovalCause.REPLACED

#: The most expired entries one put reclaims beyond what it needs (bounded work).
_ACTIVE_LIMIT = 8

_MISSING: Any = object()


def _unhashable(key: object) -> TypeError:
    return TypeError(f"key must be hashable, got {type(key).__name__} {key!r}")


class _Cache:
    """What the three caches share: capacity, weights, stats and removal callbacks."""

    _data: dict[Any, Any]  # each cache's entries

    def __init__(
        self,
        maxsize: int,
        max_weight: int | None,
        weigh: Weigher | None,
        on_evict: OnEvict | None,
    ) -> None:
        self._maxsize = positive_int("maxsize", maxsize)
        self._max_weight = None if max_weight is None else positive_int("max_weight", max_weight)
        if weigh is not None and not callable(weigh):
            raise TypeError(f"weigh must be callable, got {weigh!r}")
        if weigh is not None and max_weight is None:
            raise ValueError("weigh needs max_weight: a weight without a capacity bounds nothing")
        if on_evict is not None and not callable(on_evict):
            raise TypeError(f"on_evict must be callable, got {on_evict!r}")
        self._weigh = weigh
        #: Called as ``on_evict(key, value, cause)`` for every value that leaves.
        self.on_evict = on_evict
        self._weights: dict[Any, int] = {}  # only when max_weight is set
        self._weight = 0
        self._hits = self._misses = self._evictions = self._expirations = 0
        self._removed: list[tuple[Any, Any, RemovalCause]] = []

    @property
    def maxsize(self) -> int:
        return self._maxsize

    @property
    def max_weight(self) -> int | None:
        return self._max_weight

    @property
    def weigh(self) -> Weigher | None:
        """The weigher (None: every entry weighs 1 and only maxsize bounds the cache)."""
        return self._weigh

    def _weight_of(self, key: Hashable, value: Any, weight: int | None) -> int:
        """The value's weight, validated before anything changes."""
        try:
            hash(key)  # an unhashable key fails here, before any change
        except TypeError:
            raise _unhashable(key) from None
        if self._max_weight is None:
            return 0
        if weight is None:
            weight = 1 if self._weigh is None else self._weigh(value)
        if type(weight) is not int or weight < 0:
            raise ValueError(f"weigh must return an int >= 0, got {weight!r} for key {key!r}")
        if weight > self._max_weight:
            raise ValueError(
                f"value for key {key!r} weighs {weight}, more than max_weight={self._max_weight}"
            )
        return weight

    def _held(self, key: object) -> bool:
        """Whether ``key`` is in the structure (live or not); TypeError naming ``key``."""
        try:
            return key in self._data
        except TypeError:
            raise _unhashable(key) from None

    def _over(self, size: int) -> bool:
        return size > self._maxsize or (
            self._max_weight is not None and self._weight > self._max_weight
        )

    def _removal(self, key: Any, value: Any, cause: RemovalCause) -> None:
        """Account for a removal; its callback runs later, in :meth:`_notify`."""
        if self._max_weight is not None:
            self._weight -= self._weights.pop(key)
        if cause is EVICTED:
            self._evictions += 1
        elif cause is EXPIRED:
            self._expirations += 1
        if self.on_evict is not None:
            self._removed.append((key, value, cause))

    def _notify(self) -> None:
        """Run the collected callbacks, now that the structure is consistent."""
        removed, self._removed = self._removed, []
        callback = self.on_evict
        if callback is not None:
            for key, value, cause in removed:
                callback(key, value, cause)

    def _stats(self, size: int) -> CacheStats:
        weight = self._weight if self._max_weight is not None else size
        return CacheStats(
            self._hits, self._misses, self._evictions, self._expirations, size, weight
        )


class LRUCache(_Cache):
    """At most ``maxsize`` entries (and ``max_weight``); evicts the least recently used."""

    def __init__(
        self,
        maxsize: int,
        *,
        max_weight: int | None = None,
        weigh: Weigher | None = None,
        on_evict: OnEvict | None = None,
    ) -> None:
        super().__init__(maxsize, max_weight, weigh, on_evict)
        self._data: OrderedDict[Any, Any] = OrderedDict()

    def get(self, key: Hashable, default: Any = None) -> Any:
        """The value for ``key`` (a hit: now the most recently used), or ``default``."""
        # The hot path: one lookup, no exception on a miss (raising costs ~10 lookups; a
        # try block costs nothing until it catches).
        try:
            value = self._data.get(key, _MISSING)
        except TypeError:
            raise _unhashable(key) from None
        if value is _MISSING:
            self._misses += 1
            return default
        self._data.move_to_end(key)
        self._hits += 1
        return value

    def put(self, key: Hashable, value: Any, *, weight: int | None = None) -> None:
        """Insert or replace; evict least recently used entries until within capacity.

        ``weight``: the value's weight, already computed (stage 2 weighs outside its lock).
        """
        if self._max_weight is not None:
            self._put_weighted(key, value, self._weight_of(key, value, weight))
            return
        data = self._data
        try:
            old = data.get(key, _MISSING)  # an unhashable key raises here, before any change
        except TypeError:
            raise _unhashable(key) from None
        data[key] = value  # a new key goes last: the most recently used
        if old is not _MISSING:
            data.move_to_end(key)
            self._removal(key, old, REPLACED)
            self._notify()
        elif len(data) > self._maxsize:  # one in, so exactly one out; never the new key
            # The hot miss path, inlined: the structure is consistent, so notify at once.
            victim, gone = data.popitem(last=False)
            self._evictions += 1
            if self.on_evict is not None:
                self.on_evict(victim, gone, EVICTED)

    def _put_weighted(self, key: Hashable, value: Any, w: int) -> None:
        data = self._data
        old = data.get(key, _MISSING)
        data[key] = value
        data.move_to_end(key)
        if old is not _MISSING:
            self._removal(key, old, REPLACED)
        self._weights[key] = w
        self._weight += w
        while self._over(len(data)):  # as many as needed; the key just written is last
            victim, gone = data.popitem(last=False)
            self._removal(victim, gone, EVICTED)
        if self._removed:
            self._notify()

    def delete(self, key: Hashable) -> bool:
        """Remove ``key``; True if it was there."""
        try:
            value = self._data.pop(key, _MISSING)
        except TypeError:
            raise _unhashable(key) from None
        if value is _MISSING:
            return False
        self._removal(key, value, EXPLICIT)
        self._notify()
        return True

    def clear(self) -> None:
        """Remove every entry (cause EXPLICIT)."""
        while self._data:
            self._removal(*self._data.popitem(last=False), EXPLICIT)
        self._notify()

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key: object) -> bool:
        return self._held(key)

    def __iter__(self) -> Iterator[Any]:
        """Keys, least recently used first (a snapshot)."""
        return iter(list(self._data))

    def statistics(self) -> CacheStats:
        return self._stats(len(self._data))


class TTLCache(LRUCache):
    """An LRU cache whose entries expire ``ttl_ns`` after they were written."""

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
        super().__init__(maxsize, max_weight=max_weight, weigh=weigh, on_evict=on_evict)
        self._ttl = positive_int("ttl_ns", ttl_ns)
        if not callable(getattr(clock, "now_ns", None)):
            raise TypeError(f"clock must have now_ns(), got {clock!r}")
        self._clock = clock
        self._deadline: dict[Any, tuple[int, int]] = {}  # key -> (deadline, seq)
        self._heap: list[tuple[int, int, Any]] = []  # (deadline, seq, key); seq breaks ties
        self._seq = 0

    @property
    def ttl_ns(self) -> int:
        return self._ttl

    def get(self, key: Hashable, default: Any = None) -> Any:
        """The value for ``key`` if live (a hit), else ``default`` (an expired one goes)."""
        try:
            value = self._data.get(key, _MISSING)
        except TypeError:
            raise _unhashable(key) from None
        if value is _MISSING:
            self._misses += 1
            return default
        if self._deadline[key][0] <= self._clock.now_ns():  # gone exactly at the deadline
            self._misses += 1
            self._drop(key, EXPIRED)
            self._notify()
            return default
        self._data.move_to_end(key)
        self._hits += 1
        return value

    def put(self, key: Hashable, value: Any, *, weight: int | None = None) -> None:
        """Insert or replace (the deadline restarts); expired entries go before live ones."""
        w = self._weight_of(key, value, weight)
        now = self._clock.now_ns()
        data = self._data
        if key in data and self._deadline[key][0] <= now:
            self._drop(key, EXPIRED)  # an expired value is not "replaced": it expired
        old = data.get(key, _MISSING)
        data[key] = value
        data.move_to_end(key)
        if old is not _MISSING:
            self._removal(key, old, REPLACED)
        if self._max_weight is not None:
            self._weights[key] = w
            self._weight += w
        self._seq += 1
        self._deadline[key] = entry = (now + self._ttl, self._seq)
        heappush(self._heap, (*entry, key))
        self._expire(now, _ACTIVE_LIMIT)
        if self._over(len(data)):
            self._expire(now, None)  # room is needed: every expired entry goes first
            while self._over(len(data)):
                victim = next(iter(data))
                self._drop(victim, EVICTED)
        if len(self._heap) > 2 * len(data) + 64:  # stale entries of updated keys linger
            self._heap = [(*self._deadline[k], k) for k in data]
            heapify(self._heap)
        if self._removed:
            self._notify()

    def delete(self, key: Hashable) -> bool:
        """Remove ``key`` if held; True if it was live (an expired one goes as EXPIRED)."""
        if not self._held(key):
            return False
        live = self._deadline[key][0] > self._clock.now_ns()
        self._drop(key, EXPLICIT if live else EXPIRED)
        self._notify()
        return live

    def clear(self) -> None:
        """Remove every entry (EXPIRED for the expired ones, EXPLICIT for the rest)."""
        self._expire(self._clock.now_ns(), None)
        while self._data:
            self._drop(next(iter(self._data)), EXPLICIT)
        self._heap.clear()
        self._notify()

    def expire(self) -> int:
        """Drop every expired entry now; return how many went."""
        before = self._expirations
        self._expire(self._clock.now_ns(), None)
        self._notify()
        return self._expirations - before

    def __len__(self) -> int:
        self.expire()
        return len(self._data)

    def __contains__(self, key: object) -> bool:
        try:
            entry = self._deadline.get(key)
        except TypeError:
            raise _unhashable(key) from None
        return entry is not None and entry[0] > self._clock.now_ns()

    def __iter__(self) -> Iterator[Any]:
        now = self._clock.now_ns()
        return iter([k for k in self._data if self._deadline[k][0] > now])

    def statistics(self) -> CacheStats:
        self.expire()
        return self._stats(len(self._data))

    def _drop(self, key: Any, cause: RemovalCause) -> None:
        del self._deadline[key]  # its heap entry goes stale
        self._removal(key, self._data.pop(key), cause)

    def _expire(self, now: int, limit: int | None) -> None:
        """Drop expired entries, earliest deadline first (at most ``limit``)."""
        heap, deadline = self._heap, self._deadline
        while heap and heap[0][0] <= now and (limit is None or limit > 0):
            at, seq, key = heappop(heap)
            if deadline.get(key) == (at, seq):  # else stale: updated or removed since
                self._drop(key, EXPIRED)
                if limit is not None:
                    limit -= 1


class _Bucket:
    """The keys of one frequency, least recently accessed first; a node of a list."""

    __slots__ = ("freq", "keys", "next", "prev")

    def __init__(self, freq: int, prev: _Bucket | None, nxt: _Bucket | None) -> None:
        self.freq = freq
        self.keys: OrderedDict[Any, None] = OrderedDict()
        self.prev = prev
        self.next = nxt


class LFUCache(_Cache):
    """Evicts the least frequently used entry (ties: the least recently accessed); O(1)."""

    def __init__(
        self,
        maxsize: int,
        *,
        max_weight: int | None = None,
        weigh: Weigher | None = None,
        on_evict: OnEvict | None = None,
    ) -> None:
        super().__init__(maxsize, max_weight, weigh, on_evict)
        self._data: dict[Any, Any] = {}
        self._bucket_of: dict[Any, _Bucket] = {}
        self._head = _Bucket(0, None, None)  # sentinel: head.next is the lowest frequency

    def get(self, key: Hashable, default: Any = None) -> Any:
        """The value for ``key`` (a hit: its frequency grows by 1), or ``default``."""
        try:
            value = self._data.get(key, _MISSING)
        except TypeError:
            raise _unhashable(key) from None
        if value is _MISSING:
            self._misses += 1
            return default
        self._touch(key)
        self._hits += 1
        return value

    def put(self, key: Hashable, value: Any, *, weight: int | None = None) -> None:
        """Insert (frequency 1) or replace (frequency + 1); evict the least frequent."""
        w = self._weight_of(key, value, weight)
        old = self._data.get(key, _MISSING)
        self._data[key] = value
        if old is _MISSING:
            first = self._head.next
            if first is None or first.freq != 1:
                first = self._link(1, self._head)
            first.keys[key] = None
            self._bucket_of[key] = first
        else:
            self._touch(key)
            self._removal(key, old, REPLACED)
        if self._max_weight is not None:
            self._weights[key] = w
            self._weight += w
        while self._over(len(self._data)):
            self._evict_one(spare=key)
        if self._removed:
            self._notify()

    def delete(self, key: Hashable) -> bool:
        """Remove ``key``; True if it was there."""
        if not self._held(key):
            return False
        self._unlink_key(key)
        self._removal(key, self._data.pop(key), EXPLICIT)
        self._notify()
        return True

    def clear(self) -> None:
        """Remove every entry (cause EXPLICIT)."""
        for key in list(self._data):
            self._unlink_key(key)
            self._removal(key, self._data.pop(key), EXPLICIT)
        self._notify()

    def frequency(self, key: Hashable) -> int:
        """How often ``key`` was written or hit since it entered (0 if not held)."""
        if not self._held(key):
            return 0
        return self._bucket_of[key].freq

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key: object) -> bool:
        return self._held(key)

    def __iter__(self) -> Iterator[Any]:
        """Keys in eviction order: lowest frequency first, then least recently accessed."""
        out: list[Any] = []
        bucket = self._head.next
        while bucket is not None:
            out.extend(bucket.keys)
            bucket = bucket.next
        return iter(out)

    def statistics(self) -> CacheStats:
        return self._stats(len(self._data))

    def _link(self, freq: int, after: _Bucket) -> _Bucket:
        bucket = _Bucket(freq, after, after.next)
        if after.next is not None:
            after.next.prev = bucket
        after.next = bucket
        return bucket

    def _unlink_key(self, key: Any) -> _Bucket | None:
        """Take ``key`` out of its bucket (dropping the bucket if emptied); the bucket
        before it, which a moved key's new bucket goes after."""
        bucket = self._bucket_of.pop(key)
        del bucket.keys[key]
        if bucket.keys:
            return bucket
        prev = bucket.prev
        assert prev is not None  # only the sentinel has no prev
        prev.next = bucket.next
        if bucket.next is not None:
            bucket.next.prev = prev
        return prev

    def _touch(self, key: Any) -> None:
        bucket = self._bucket_of[key]
        freq = bucket.freq + 1
        if len(bucket.keys) == 1 and (bucket.next is None or bucket.next.freq != freq):
            bucket.freq = freq  # alone in its bucket: the bucket itself moves up (a hot key)
            return
        before = self._unlink_key(key)
        assert before is not None
        nxt = before.next
        target = nxt if nxt is not None and nxt.freq == freq else self._link(freq, before)
        target.keys[key] = None  # the most recently accessed of its frequency
        self._bucket_of[key] = target

    def _evict_one(self, spare: Any) -> None:
        """Evict the coldest entry other than ``spare`` (the key being written)."""
        bucket = self._head.next
        while bucket is not None:
            for victim in bucket.keys:
                if victim != spare:
                    self._unlink_key(victim)
                    self._removal(victim, self._data.pop(victim), EVICTED)
                    return
            bucket = bucket.next
        raise RuntimeError("unreachable: the spared key alone always fits")
