"""Building the caches under test, and hearing what leaves them: the stage-1 and stage-2
suites' common ground.

``make("TTLCache", 4, clock)`` builds a stage-1 cache by its class name (a TTL cache on
a :class:`ManualClock` at :data:`START` unless given one); :class:`Log` is an
``on_evict`` that records every call. ``concurrent`` and ``async_cache`` wrap a stage-1
cache in stage 2's ``ConcurrentCache`` and ``AsyncCache``.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Literal, overload

import pytest

from katas._harness.under_test import stage
from katas.kv_cache.api import (
    AsyncLoadingCache,
    EvictingCache,
    ExpiringCache,
    FrequencyCache,
    LoadingCache,
    ManualClock,
    RemovalCause,
)

EVICTED, EXPIRED = RemovalCause.EVICTED, RemovalCause.EXPIRED
EXPLICIT, REPLACED = RemovalCause.EXPLICIT, RemovalCause.REPLACED
#: The test clocks' start, and a TTL cache's time to live unless a test gives one.
START = 1_000_000
TTL = 1_000
#: The stage-1 caches, by class name.
ALL_KINDS = ["LRUCache", "TTLCache", "LFUCache"]


@pytest.fixture(autouse=True)
def fail_fast_on_stage1_stubs(stage_module: ModuleType) -> None:
    """Build a cache first: on a stub this fails at once with "not implemented yet". The
    stage-1 suite imports it, which makes it autouse there."""
    stage_module.LRUCache(1)


@pytest.fixture(autouse=True)
def fail_fast_on_stage2_stubs() -> None:
    """Wrap a cache first: on a stub this fails at once with "not implemented yet". The
    stage-2 suite imports it, which makes it autouse there."""
    stage(2).ConcurrentCache(stage(1).LRUCache(1))


#: One ``on_evict`` call: (key, value, cause).
Heard = tuple[Any, Any, RemovalCause]


class Log:
    """Records ``on_evict`` calls."""

    def __init__(self) -> None:
        self.calls: list[Heard] = []
        self.taken: list[Heard] = []  # what take() last returned

    def __call__(self, key: Any, value: Any, cause: RemovalCause) -> None:
        self.calls.append((key, value, cause))

    def __repr__(self) -> str:  # as the steps of a failure show it
        return "log"

    def take(self) -> list[Heard]:
        self.taken, self.calls = self.calls, []
        return self.taken


@overload
def make(
    kind: Literal["TTLCache"], maxsize: int, clock: ManualClock | None = None, **kw: Any
) -> ExpiringCache: ...
@overload
def make(
    kind: Literal["LFUCache"], maxsize: int, clock: ManualClock | None = None, **kw: Any
) -> FrequencyCache: ...
@overload
def make(kind: str, maxsize: int, clock: ManualClock | None = None, **kw: Any) -> EvictingCache: ...
def make(kind: str, maxsize: int, clock: ManualClock | None = None, **kw: Any) -> EvictingCache:
    """A stage-1 cache of class ``kind`` (``kw``: its keyword arguments; a TTL cache's
    ``ttl_ns`` defaults to :data:`TTL`, its clock to a ManualClock at :data:`START`)."""
    cls = getattr(stage(), kind)
    cache: EvictingCache
    if kind == "TTLCache":
        cache = cls(maxsize, kw.pop("ttl_ns", TTL), clock=clock or ManualClock(START), **kw)
    else:
        cache = cls(maxsize, **kw)
    return cache


def heard(kind: str, maxsize: int, **kw: Any) -> tuple[EvictingCache, Log]:
    """A stage-1 cache of class ``kind`` (as :func:`make` builds it) whose ``on_evict`` is
    a new :class:`Log`, and that log: how a test hears what leaves the cache."""
    log = Log()
    return make(kind, maxsize, on_evict=log, **kw), log


def weighed_by_length(kind: str) -> tuple[EvictingCache, Log]:
    """A cache of class ``kind`` with room for 10 entries and a weight of 10, where a
    value weighs its length, and its :class:`Log`: the weight examples' cache."""
    return heard(kind, 10, max_weight=10, weigh=len)


def concurrent(maxsize: int = 100, kind: str = "LRUCache", **kw: Any) -> LoadingCache:
    """Stage 2's ``ConcurrentCache`` around a stage-1 cache of class ``kind`` (a TTL
    cache's entries live for ever: the tests of stage 2 time nothing out)."""
    cls = getattr(stage(1), kind)
    inner: EvictingCache = (
        cls(maxsize, 10**15, clock=ManualClock(), **kw)
        if kind == "TTLCache"
        else cls(maxsize, **kw)
    )
    return wrap(inner)


def wrap(inner: object) -> LoadingCache:
    """Stage 2's ``ConcurrentCache`` around ``inner`` (a cache, or a harness's probe
    standing in for one)."""
    cache: LoadingCache = stage(2).ConcurrentCache(inner)
    return cache


def async_cache() -> AsyncLoadingCache:
    """Stage 2's ``AsyncCache`` around an LRU cache of 100."""
    cache: AsyncLoadingCache = stage(2).AsyncCache(stage(1).LRUCache(100))
    return cache


def lru(maxsize: int, **kw: Any) -> EvictingCache:
    """Stage 1's ``LRUCache`` from the stage under test's kata (stage 2 and 3 suites)."""
    cache: EvictingCache = stage(1).LRUCache(maxsize, **kw)
    return cache


__all__ = [
    "ALL_KINDS",
    "EVICTED",
    "EXPIRED",
    "EXPLICIT",
    "REPLACED",
    "START",
    "TTL",
    "Heard",
    "Log",
    "async_cache",
    "concurrent",
    "fail_fast_on_stage1_stubs",
    "fail_fast_on_stage2_stubs",
    "heard",
    "lru",
    "make",
    "weighed_by_length",
    "wrap",
]
