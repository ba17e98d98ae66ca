"""Whole flights of stage 2, and the two wrappers side by side with the bare stage-1 cache.

:func:`caught` is what one caller got, value or exception; :func:`thread_flight` and
:func:`async_flight` run a leader and its waiters through one load of ``"k"`` and tell
what each caller got, giving up at once on a caller that can no longer be woken.
:class:`Mirror` makes the same calls on a wrapper (``ConcurrentCache`` or
``AsyncCache``) and on a bare stage-1 cache built alike, and hears both ``on_evict``\\ s:
the wrapper must answer, raise and remove exactly as the cache it wraps.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Hashable
from typing import Any, cast

import anyio

from katas._harness.story import check
from katas._harness.under_test import stage
from katas._harness.waiting import eventually_async, spawn
from katas.kv_cache._testing.caches import Log
from katas.kv_cache._testing.loaders import Loader, racing_tasks
from katas.kv_cache._testing.locks import PROMPTLY_S, flight_joined, loading, loads
from katas.kv_cache.api import AsyncLoadingCache, CacheStats, EvictingCache, LoadingCache

_MISSING: Any = object()
#: What a caller got that was still waiting when the test gave up on its flight.
STRANDED = "<still waiting: its flight was never finished>"
#: A key no cache can hold.
UNHASHABLE: Any = ["not", "hashable"]
#: The two stage-2 wrappers, by class name.
WRAPPERS = ["ConcurrentCache", "AsyncCache"]

Wrapped = LoadingCache | AsyncLoadingCache


def caught(call: Callable[[], object]) -> object:
    """``call()``'s value, or the ``Exception`` it raised."""
    try:
        return call()
    except Exception as error:
        return error


def promptly(cache: LoadingCache, key: Hashable, loader: Callable[[], object]) -> object:
    """What ``get_or_load(key, loader)`` got (value or exception), called from a thread of
    its own; a call that needs no other thread returns in microseconds, or never: judged
    after :data:`PROMPTLY_S`, not the hard deadline."""
    caller = spawn(lambda: caught(lambda: cache.get_or_load(key, loader)), f"get {key!r}")
    caller.join(PROMPTLY_S)
    check(not caller.is_alive(), f"get_or_load({key!r}), which waits for no other thread, hung")
    return caller.outcome(f"get_or_load({key!r})")


def weigh_refusing_bad(value: str) -> int:
    """A value weighs its length, but ``"bad"`` weighs -1, a weight no cache takes."""
    return -1 if value == "bad" else len(value)


def thread_flight(
    cache: LoadingCache, loader: Loader, waiters: int, meanwhile: Callable[[], object] = list
) -> list[object]:
    """A leader's ``get_or_load("k", loader)`` in a thread, ``waiters`` more that join its
    flight, then ``meanwhile()`` and the loader released: what each caller got (value or
    exception, the leader first)."""
    call = lambda: caught(lambda: cache.get_or_load("k", loader))  # noqa: E731
    threads = [spawn(call, "leader")]
    loading(cache, loader)
    threads += [spawn(call, f"waiter-{i}") for i in range(waiters)]
    flight_joined(cache, loader, waiters, f"{waiters} callers waiting for the load")
    meanwhile()
    loader.release.set()
    return [t.outcome("a caller of the flight returns") for t in threads]


async def async_flight(
    cache: AsyncLoadingCache,
    loader: Callable[[], Awaitable[object]],
    release: anyio.Event,
    waiters: int,
    meanwhile: Callable[[], object] = list,
) -> list[object]:
    """A leader's ``get_or_load("k", loader)`` in a task, ``waiters`` more that join its
    flight, then ``meanwhile()`` and ``release`` set: what each caller got (value or
    exception, the leader first). Once the leader is done with its flight still
    registered, nobody can wake the callers left: they are given up at once, as
    :data:`STRANDED`."""
    got: dict[int, object] = {}

    async def call(i: int) -> None:
        try:
            got[i] = await cache.get_or_load("k", loader)
        except Exception as error:
            got[i] = error

    async with racing_tasks() as tg:
        tg.start_soon(call, 0)
        await eventually_async(lambda: loads(cache).in_flight == 1 or 0 in got, "the load")
        for i in range(1, waiters + 1):
            tg.start_soon(call, i)
        await eventually_async(
            lambda: loads(cache).waiters == waiters or loads(cache).loads > 1,
            f"{waiters} callers waiting for the load",
        )
        meanwhile()
        release.set()
        await eventually_async(
            lambda: len(got) == waiters + 1 or (0 in got and loads(cache).in_flight > 0),
            "every caller of the flight done",
        )
        tg.cancel_scope.cancel()
    return [got.get(i, STRANDED) for i in range(waiters + 1)]


def load(cache: Wrapped, key: Hashable, value: object) -> object:
    """``get_or_load(key)`` of a loader that returns ``value``, on either wrapper (the
    async one on an event loop of its own)."""
    return load_by(cache, key, lambda: value)


def load_by(cache: Wrapped, key: Hashable, make: Callable[[], object]) -> object:
    """``get_or_load(key)`` of a loader that returns what ``make()`` returns (or raises
    what it raises), on either wrapper (the async one on an event loop of its own)."""
    if not isinstance(cache, stage(2).AsyncCache):
        return cast(LoadingCache, cache).get_or_load(key, make)

    async def loader() -> object:
        return make()

    async def main() -> object:
        return await cast(AsyncLoadingCache, cache).get_or_load(key, loader)

    return anyio.run(main)


def bare_load(cache: EvictingCache, key: Hashable, value: object) -> object:
    """What :func:`load` is on the bare cache: its ``get``, then the ``put`` of a miss."""
    got = cache.get(key, _MISSING)
    if got is not _MISSING:
        return got
    cache.put(key, value)
    return value


class Mirror:
    """A stage-2 wrapper (``wrapper``: its class name) around a stage-1 ``LRUCache`` and
    the same cache bare, both built with ``kw``, each heard by a :class:`Log`."""

    def __init__(self, wrapper: str, maxsize: int = 4, **kw: Any) -> None:
        self.log, self.bare_log = Log(), Log()
        inner = stage(1).LRUCache(maxsize, on_evict=self.log, **kw)
        self.cache: Wrapped = getattr(stage(2), wrapper)(inner)
        self.bare: EvictingCache = stage(1).LRUCache(maxsize, on_evict=self.bare_log, **kw)
        self.steps: list[str] = []

    def both(
        self,
        what: str,
        wrapped: Callable[[Wrapped], object],
        bare: Callable[[EvictingCache], object],
    ) -> tuple[object, object]:
        """Make the call ``what`` on both: what each returned, or raised."""
        self.steps.append(what)
        return caught(lambda: wrapped(self.cache)), caught(lambda: bare(self.bare))

    def put(self, key: Hashable, value: object) -> tuple[object, object]:
        """``put(key, value)`` on both."""
        return self.both(
            f"put({key!r}, {value!r})", lambda c: c.put(key, value), lambda b: b.put(key, value)
        )

    def load(self, key: Hashable, value: object) -> tuple[object, object]:
        """``get_or_load(key)`` of a loader returning ``value`` on both (:func:`load`)."""
        return self.both(
            f"get_or_load({key!r}) of {value!r}",
            lambda c: load(c, key, value),
            lambda b: bare_load(b, key, value),
        )

    def state(self) -> tuple[list[object], CacheStats, list[object]]:
        """The wrapper's keys, statistics and every removal heard."""
        return list(self.cache), self.cache.statistics(), list(self.log.calls)

    def bare_state(self) -> tuple[list[object], CacheStats, list[object]]:
        """The same of the bare cache."""
        return list(self.bare), self.bare.statistics(), list(self.bare_log.calls)

    def differs(self) -> str:
        """How the wrapper's state differs from the bare cache's ('' if it does not)."""
        mine, theirs = self.state(), self.bare_state()
        if mine == theirs:
            return ""
        return (
            f"after {'; '.join(self.steps)}: the wrapper holds {mine[0]}, {mine[1]}, "
            f"on_evict heard {mine[2]}; the bare stage-1 cache holds {theirs[0]}, "
            f"{theirs[1]}, on_evict heard {theirs[2]}"
        )


__all__ = [
    "STRANDED",
    "UNHASHABLE",
    "WRAPPERS",
    "Mirror",
    "Wrapped",
    "async_flight",
    "bare_load",
    "caught",
    "load",
    "load_by",
    "promptly",
    "thread_flight",
    "weigh_refusing_bad",
]
