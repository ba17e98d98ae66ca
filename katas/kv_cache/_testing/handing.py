"""Who hands on a removal (stage 2): a wrapped TTL cache whose entries have expired, the
``on_evict`` that records which thread heard each removal, and a stage-1 TTL cache that
reclaims expired entries while it looks (``in``, iteration), as stage 1 allows.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any, cast

from katas._harness.under_test import stage
from katas.kv_cache._testing.caches import START, TTL, wrap
from katas.kv_cache.api import ExpiringCache, LoadingCache, ManualClock, RemovalCause

#: One removal as heard: (key, cause, the name of the thread that heard it).
HeardOn = tuple[Any, RemovalCause, str]


class ThreadLog:
    """An ``on_evict`` recording each removal with the thread it was handed on in, and
    running ``then(key, cause)`` after recording it (a callback's own use of the cache)."""

    def __init__(self, then: Callable[[Any, RemovalCause], None] | None = None) -> None:
        self.calls: list[HeardOn] = []
        self.then = then

    def __call__(self, key: Any, value: Any, cause: RemovalCause) -> None:
        self.calls.append((key, cause, threading.current_thread().name))
        if self.then is not None:
            self.then(key, cause)

    def __repr__(self) -> str:
        return "log"


def expired_ttl(log: ThreadLog, keys: str = "k") -> tuple[LoadingCache, ManualClock]:
    """A ``ConcurrentCache`` over a stage-1 ``TTLCache(4, TTL)`` reporting to ``log``,
    each of ``keys`` put at ``START`` and the clock moved past their deadline: every one
    has expired, none was reclaimed yet."""
    clock = ManualClock(START)
    cache = wrap(stage(1).TTLCache(4, TTL, clock=clock, on_evict=log))
    for key in keys:
        cache.put(key, f"old {key}")
    clock.advance(TTL + 1)
    return cache, clock


def reclaiming_ttl(clock: ManualClock, on_evict: Callable[..., None]) -> ExpiringCache:
    """A stage-1 ``TTLCache(4, TTL)`` (the one under test) whose ``in`` and iteration
    first reclaim every expired entry, reporting each ``EXPIRED``: what stage 1's
    pure-observations rule allows a TTL cache to do while it looks."""
    base: type[Any] = stage(1).TTLCache

    class Reclaiming(base):  # type: ignore[misc]
        def __contains__(self, key: object) -> bool:
            self.expire()
            return bool(super().__contains__(key))

        def __iter__(self) -> Iterator[Any]:
            self.expire()
            return iter(list(super().__iter__()))

    return cast(ExpiringCache, Reclaiming(4, TTL, clock=clock, on_evict=on_evict))


__all__ = ["HeardOn", "ThreadLog", "expired_ttl", "reclaiming_ttl"]
