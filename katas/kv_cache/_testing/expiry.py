"""TTL caches set up at the edges of expiry's bookkeeping (stage 1): an expired entry
behind a pile of stale deadlines, and a heavy put that needs the room of more expired
entries than one bounded sweep reclaims.

Each builder returns the cache, its clock, its :class:`Log` and the steps it took, in
words, for the failure message.
"""

from __future__ import annotations

from katas.kv_cache._testing.caches import START, TTL, Log, make
from katas.kv_cache.api import ExpiringCache, ManualClock

#: More than any bounded sweep may reclaim in one put (the prompt's bound is 64).
BEYOND_ONE_SWEEP = 80


def behind_stale_deadlines(
    stale: str, count: int = BEYOND_ONE_SWEEP
) -> tuple[ExpiringCache, ManualClock, Log, list[str]]:
    """A TTL cache whose only entry expired at ``START + TTL`` is ``"a"``, with ``count``
    stale deadlines (of a key ``updated`` again and again, or of keys ``deleted``) ahead
    of its own in deadline order, and 100 live entries so that no rule about reclaiming
    stale bookkeeping (in proportion to the live entries) clears them first. The clock
    is left at ``START``: the test moves it to the deadline."""
    clock, log = ManualClock(START + 1), Log()
    cache = make("TTLCache", 1_000, clock, on_evict=log)
    for n in range(100):
        cache.put(("live", n), n)  # deadline START + 1 + TTL: live at START + TTL
    steps = [f"TTLCache(1000, ttl_ns={TTL}); at START + 1: put 100 keys"]
    for n in range(count):
        clock.set(START - count + n)  # every stale deadline before a's
        if stale == "updated":
            cache.put("a", f"A{n}")
        else:
            cache.put(("d", n), n)
            cache.delete(("d", n))
    clock.set(START)
    cache.put("a", "A")
    if stale == "updated":
        steps.append(f"clock set back; put 'a' {count} times, then at START its last value 'A'")
    else:
        steps.append(f"clock set back; put and delete {count} keys, then at START put('a', 'A')")
    log.take()
    return cache, clock, log, steps


def heavy_put_needing_every_expired_slot(
    update: bool,
) -> tuple[ExpiringCache, ManualClock, Log, list[str]]:
    """A TTL cache of ``max_weight=100`` (a value weighs its length) holding 90 entries of
    weight 1 that expire at ``START + TTL``, and two live ones colder than all of them:
    ``"live"`` (weight 5) and ``"m"`` (weight 1). The clock is left at ``START + TTL``,
    where a put of weight 80 (a new key, or ``m`` itself when ``update``) needs the room
    of every expired entry but no live one's."""
    clock, log = ManualClock(START), Log()
    cache = make("TTLCache", 1_000, clock, max_weight=100, weigh=len, on_evict=log)
    for n in range(90):
        cache.put(("old", n), "x")
    clock.advance(TTL // 2)
    cache.put("live", "lllll")
    cache.put("m", "m")
    for n in range(90):
        cache.get(("old", n))  # 'live' and 'm' are now the coldest
    clock.advance(TTL // 2)
    log.take()
    steps = [
        f"TTLCache(1000, ttl_ns={TTL}, max_weight=100, weigh=len)",
        "at START: put 90 keys of weight 1",
        "at START + TTL/2: put('live', 'lllll') and put('m', 'm'); get each of the 90 "
        "(live and m are now the least recently used); weight 96",
        "at START + TTL the 90 expire",
    ]
    return cache, clock, log, steps


__all__ = ["BEYOND_ONE_SWEEP", "behind_stale_deadlines", "heavy_put_needing_every_expired_slot"]
