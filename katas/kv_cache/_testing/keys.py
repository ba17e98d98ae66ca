"""Keys no cache can hold, and every call that takes a key (stage 1): the cases of the
rule that an unhashable key is refused, with a ``TypeError`` naming ``key``, before
anything changes.

:data:`UNHASHABLE_KEYS` are the keys (a tuple holding a list looks hashable to
``isinstance(key, Hashable)`` and is not); :data:`KEYED_CALLS` every entry point a key
reaches, the puts among them with a value that is refused on its own too (heavier than
``max_weight``, a bad ``weight=``, one ``weigh`` cannot weigh), so that only a key
checked first gives the ``TypeError``. :func:`full_cache` builds a cache whose next
insert must evict (a TTL cache with an entry expired at this very instant), and
:func:`observe` is everything a test can see of it, to compare with a twin built alike.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

from katas.kv_cache._testing.caches import START, TTL, Log, heard
from katas.kv_cache.api import EvictingCache, FrequencyCache, ManualClock

#: Keys whose hash raises ``TypeError``, by name.
UNHASHABLE_KEYS: dict[str, Any] = {
    "list": ["not", "hashable"],
    "dict": {"not": "hashable"},
    "tuple holding a list": ("looks", ["hashable"]),
}

#: The most weight :func:`full_cache`'s weighted caches hold.
MAX_WEIGHT = 10

#: Every call that takes a key, by how a failure names it.
KEYED_CALLS: dict[str, Callable[[EvictingCache, Any], object]] = {
    "put(key, 'v')": lambda c, k: c.put(k, "v"),
    "put(key, 'v', weight=1)": lambda c, k: c.put(k, "v", weight=1),
    "put of a value heavier than max_weight": lambda c, k: c.put(k, "x" * (MAX_WEIGHT + 1)),
    "put(key, 'v', weight=max_weight + 1)": lambda c, k: c.put(k, "v", weight=MAX_WEIGHT + 1),
    "put(key, 'v', weight=-1)": lambda c, k: c.put(k, "v", weight=-1),
    "put(key, 'v', weight=1.5)": lambda c, k: c.put(k, "v", weight=1.5),  # type: ignore[arg-type]
    "put(key, 'v', weight=True)": lambda c, k: c.put(k, "v", weight=True),
    "put of a value weigh=len cannot weigh (an int)": lambda c, k: c.put(k, 5),
    "get(key)": lambda c, k: c.get(k),
    "get(key, 'default')": lambda c, k: c.get(k, "default"),
    "delete(key)": lambda c, k: c.delete(k),
    "key in cache": lambda c, k: k in c,
}


def full_cache(kind: str, weighted: bool) -> tuple[EvictingCache, Log, str]:
    """A cache of class ``kind`` and maxsize 3 (``weighted``: also ``max_weight`` 10 and
    ``weigh=len``), full: a, b, c put (``"aaa"``, … : weight 9) and a read, so that any
    insert must evict. A TTL cache's clock is left at a's deadline exactly: a has just
    expired, and any put must reclaim it. Its log, and the steps, in words."""
    clock = ManualClock(START)
    kw: dict[str, Any] = {"max_weight": MAX_WEIGHT, "weigh": len} if weighted else {}
    cache, log = heard(kind, 3, clock=clock, **kw) if kind == "TTLCache" else heard(kind, 3, **kw)
    cache.put("a", "aaa")
    clock.advance(TTL // 2)
    cache.put("b", "bbb")
    cache.put("c", "ccc")
    cache.get("a")
    cache.get("b")
    built = f"{kind}(3{', max_weight=10, weigh=len' if weighted else ''})"
    steps = f"{built}: put a, b, c ('aaa', 'bbb', 'ccc'); get a, b"
    if kind == "TTLCache":
        clock.set(START + TTL)
        steps = f"{built}: put a; +{TTL // 2} ns: put b, c; get a, b; now a's deadline"
    return cache, log, steps


def observe(kind: str, cache: EvictingCache, log: Log) -> dict[str, object]:
    """All a test sees of a cache of :func:`full_cache`: its keys in order, which of a, b,
    c it holds, its length, statistics and (LFU) frequencies, and what on_evict heard
    meanwhile (a TTL cache may reclaim its expired entry while it is looked at)."""
    seen: dict[str, object] = {"keys": list(cache), "in": {k: k in cache for k in "abc"}}
    seen["len"] = len(cache)
    seen["statistics"] = cache.statistics()
    if kind == "LFUCache":
        seen["frequency"] = {k: cast(FrequencyCache, cache).frequency(k) for k in "abc"}
    seen["heard"] = log.take()
    return seen


__all__ = ["KEYED_CALLS", "MAX_WEIGHT", "UNHASHABLE_KEYS", "full_cache", "observe"]
