"""Stage 2's races, forced where they happen (``katas/_harness/interleave.py``), so that a
wrapper that does in two steps what must be one fails on every run, at once.

- :class:`LazilyIterated` is a stage-1 cache whose iteration is lazy, as one written as a
  generator over its own dict is: a wrapper that hands out its iterator instead of a
  snapshot taken under the lock walks the inner cache outside the lock.
- :func:`leader_raced_in_its_gaps` runs a leader of ``get_or_load`` stopped in its gaps:
  right after each lock section it leaves, ``load_statistics()`` is read; before each
  write-back of a count it read, another key's whole load runs through.
- :func:`landing_in_the_gaps_of` runs a call stopped right after each lock section it
  leaves, where a held load lands, whole, before the call goes on.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

from katas._harness.interleave import Parked, pause_after_unlocks, pause_in_updates
from katas._harness.waiting import Thread, spawn
from katas.kv_cache._testing.loaders import Loader
from katas.kv_cache._testing.locks import loads
from katas.kv_cache.api import LoadingCache, LoadStatistics

#: How long a stop inside a lock section lasts: a racer there can only wait for it.
STOP_S = 0.2


class LazilyIterated(Parked):
    """A stage-1 cache (``inner``) whose iteration is lazy, as one written as a generator
    over its own dict is: ``iter()`` returns before it reads anything, each step reads the
    keys as they are then (a call on the inner cache), and keys changed since the walk
    began fail it, as a dict's iterator fails (``RuntimeError``). Every other call is the
    inner cache's own."""

    def __iter__(self) -> Iterator[Any]:
        began: list[Any] | None = None
        taken = 0
        while True:
            keys = list(Parked.__iter__(self))
            if began is None:
                began = keys
            elif keys != began:
                raise RuntimeError(f"cache changed during iteration: {began} became {keys}")
            if taken == len(keys):
                return
            yield keys[taken]
            taken += 1


def leader_raced_in_its_gaps(
    cache: LoadingCache,
    key: str,
    loader: Callable[[], object],
    racer: Callable[[int], object],
) -> tuple[object, list[LoadStatistics], list[Thread]]:
    """``get_or_load(key, loader)`` in a thread of its own, stopped in its gaps: right
    after each lock section it leaves, ``load_statistics()`` is read (what any thread may
    see then); once it has left one (its flight is registered), before each write-back of
    a field it read on the same line (``self.loads += 1``), a fresh thread runs
    ``racer(i)`` through, whole, while it waits. Inside a lock section the racer waits
    for the lock instead, and the stop ends after :data:`STOP_S`.

    What the call got (value or exception), the statistics read in its gaps, and the
    racers, all returned."""
    module = type(cache).__module__
    seen: list[LoadStatistics] = []
    racers: list[Thread] = []
    left_a_lock = threading.Event()

    def look() -> bool:  # right after a lock section: read the counts, and go on
        seen.append(loads(cache))
        left_a_lock.set()
        return True

    def race() -> bool:  # asked once at each write-back, before it stops there
        if left_a_lock.is_set():
            n = len(racers)
            racers.append(spawn(lambda: racer(n), f"racer {n}"))
        return False  # never done: stop at every write-back

    def raced() -> bool:
        return not racers or not racers[-1].is_alive()

    def lead() -> object:
        pause_after_unlocks(module, look, lambda: False)
        pause_in_updates(module, raced, race, deadline_s=STOP_S)
        try:
            return cache.get_or_load(key, loader)
        except Exception as error:
            return error

    got = spawn(lead, "leader").outcome(f"get_or_load({key!r}), stopped in its gaps")
    for thread in racers:
        thread.outcome("a racer's get_or_load of another key")
    return got, seen, racers


def landing_in_the_gaps_of(
    cache: LoadingCache, loader: Loader, leader: Thread, call: Callable[[], object], name: str
) -> object:
    """``call()`` in a thread of its own, stopped right after each lock section it
    leaves: in the first gap the held ``loader`` is released and its ``leader`` lands
    the load, whole, before ``call`` goes on. What ``call`` returned."""

    def landed() -> bool:
        loader.release.set()
        return not leader.is_alive()

    def stopped() -> object:
        pause_after_unlocks(type(cache).__module__, landed, landed, deadline_s=2.0)
        return call()

    got = spawn(stopped, name).outcome(f"{name}, a load landing in its gaps")
    loader.release.set()  # a call with no lock section of its own: the load lands now
    return got


__all__ = ["STOP_S", "LazilyIterated", "landing_in_the_gaps_of", "leader_raced_in_its_gaps"]
