"""Probing a concurrent cache's lock from the outside, and the counters tests sequence
threads by: ``load_statistics()`` takes the lock, so a probe thread that cannot get an
answer within :data:`GRACE_S` tells the test that user code runs under it."""

from __future__ import annotations

import threading
from collections.abc import Callable

from katas._harness.story import check
from katas._harness.waiting import DEADLINE_S, eventually, spawn
from katas.kv_cache._testing.loaders import Loader
from katas.kv_cache.api import AsyncLoadingCache, LoadingCache, LoadStatistics

#: How long a test gives a thread to get past a lock it must not get past.
GRACE_S = 0.2
#: How long a call that needs no other thread gets before it counts as stuck.
PROMPTLY_S = 1.0


def loads(cache: LoadingCache | AsyncLoadingCache) -> LoadStatistics:
    """``load_statistics()``, checked to be one."""
    stats = cache.load_statistics()
    assert isinstance(stats, LoadStatistics), f"load_statistics() returned {stats!r}"
    return stats


def stats_now(cache: LoadingCache) -> LoadStatistics | None:
    """``load_statistics()``, or None if the cache's lock is held past :data:`GRACE_S`."""
    probe = spawn(lambda: loads(cache), "probe")
    probe.join(GRACE_S)
    stats: LoadStatistics | None = None if probe.is_alive() else probe.result
    return stats


def another_thread_blocks_on(cache: LoadingCache) -> bool:
    """A ``get`` from another thread does not return within a second: the cache's lock is
    held. User code calls it to tell whether it runs under that lock."""
    other = threading.Thread(target=lambda: cache.get("probe"), daemon=True)
    other.start()
    other.join(1.0)
    return other.is_alive()


def write_meanwhile(cache: LoadingCache | AsyncLoadingCache, write: str) -> None:
    """The write named ``write`` ("put", "delete" or "clear") on key ``"k"``, made while
    its load is in flight: put stores ``"written meanwhile"``."""
    if write == "put":
        cache.put("k", "written meanwhile")
    elif write == "delete":
        cache.delete("k")
    else:
        cache.clear()


def waiting_now(cache: LoadingCache) -> bool:
    """Some caller waits for a flight (False if the lock cannot be had at once)."""
    stats = stats_now(cache)
    return stats is not None and stats.waiters > 0


def free_while(cache: LoadingCache, release: Callable[[], None], what: str) -> None:
    """User code is running (``what``): the cache's lock must be free (``load_statistics()``
    takes it). If it is held, fail now, after letting the user code go, rather than let
    every later step of the test wait out its deadline behind it."""
    free = stats_now(cache) is not None
    if not free:
        release()
    check(
        free,
        f"while {what}, load_statistics() could not take the cache's lock: user code runs "
        "under it, so every miss of any key, and every get and put, queues behind it",
    )


def free_while_loading(cache: LoadingCache, release: Callable[[], None]) -> None:
    """A loader is running: the cache's lock must be free (see :func:`free_while`)."""
    free_while(cache, release, "the loader ran")


def reentering(cache: LoadingCache, key: str) -> tuple[Callable[[], object], list[bool]]:
    """A loader of ``key`` that calls ``get_or_load(key)`` from inside itself, and a list
    that says whether it found the cache's lock held (it then returns at once instead: a
    reentrant call under a held lock deadlocks, and a test would wait out its deadline
    to tell, where the lock probe tells in :data:`GRACE_S`)."""
    held: list[bool] = []

    def loader() -> object:
        held.append(stats_now(cache) is None)
        if held[-1]:
            return "not called: the lock is held"
        return cache.get_or_load(key, lambda: "inner")

    return loader, held


def check_not_held(held: list[bool]) -> None:
    """The loader of :func:`reentering` found the cache's lock free."""
    check(
        not any(held),
        "the loader ran under the cache's lock (load_statistics() from another thread "
        f"could not take it within {GRACE_S} s): every miss of any key, and every get and "
        "put, queues behind a load, and a loader's own get_or_load deadlocks on it",
    )


def loading(cache: LoadingCache, loader: Loader) -> None:
    """Wait (hard deadline) until ``loader`` runs for a miss, and check the lock is free."""
    assert loader.entered.wait(DEADLINE_S), "a miss in get_or_load must call the loader"
    free_while_loading(cache, loader.release.set)


def flight_joined(cache: LoadingCache, loader: Loader, waiters: int, what: str) -> None:
    """Wait (hard deadline) until ``waiters`` callers wait for the load ``loader`` runs;
    judge at once if one of them called the loader instead of joining the flight."""
    eventually(lambda: loads(cache).waiters == waiters or loader.calls > 1, what)
    check(
        loader.calls == 1,
        f"{what}: a miss of a key whose load is running must join that flight, but the "
        f"loader was called {loader.calls} times for one key (single flight: once)",
    )
