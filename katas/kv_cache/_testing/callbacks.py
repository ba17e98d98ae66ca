"""Whether ``on_evict`` sees a consistent cache: a stage-1 cache whose callback looks
at it (pure observations only) at every removal, through every way a value can leave.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

from katas.kv_cache._testing.caches import REPLACED, START, TTL, make
from katas.kv_cache.api import EvictingCache, ExpiringCache, ManualClock, RemovalCause


def consistency_problems(kind: str, weighted: bool) -> list[str]:
    """What a ``kind`` cache's ``on_evict`` found wrong while its removal was reported
    (each with the steps so far); empty if it always saw the cache consistent: the
    victim gone (or, REPLACED, the new value in place), within capacity."""
    clock = ManualClock(START)
    problems: list[str] = []
    where = f"{kind}{' by weight' if weighted else ''}"
    writing: list[str] = []  # the key of the put under way, if one is

    def on_evict(key: Any, value: Any, cause: RemovalCause) -> None:
        held = list(cache)  # pure observations only
        inside = key in cache
        if cause is REPLACED and not inside:
            problems.append(f"{cause.name} of {key!r}: the new value is not in place")
        # An update makes its key the most recently used: in place means there too.
        if cause is REPLACED and kind != "LFUCache" and held[-1:] != [key]:
            problems.append(f"{cause.name} of {key!r}: it is not the most recent yet {held}")
        if writing and writing[0] not in held:
            problems.append(f"{cause.name} of {key!r}: the key written, {writing[0]!r}, "
                            "is not in the cache yet")  # fmt: skip
        if cause is not REPLACED and (inside or key in held):
            problems.append(f"{cause.name} of {key!r}: it is still in the cache")
        if len(held) > cache.maxsize:
            problems.append(f"{cause.name} of {key!r}: {len(held)} keys > maxsize")
        if weighted and kind != "TTLCache" and cache.statistics().weight > (cache.max_weight or 0):
            weight = cache.statistics().weight
            problems.append(f"{cause.name} of {key!r}: weight {weight} > {cache.max_weight}")

    kw: dict[str, Any] = {"on_evict": on_evict}
    if weighted:
        kw |= {"max_weight": 6, "weigh": len}
    cache: EvictingCache = make(kind, 3, clock, **kw)

    def put(key: str, value: str) -> None:
        writing.append(key)
        try:
            cache.put(key, value)
        finally:
            writing.clear()

    def put_each(keys: str) -> None:
        for k in keys:
            put(k, "x")

    steps: list[tuple[str, Callable[[], Any]]] = [
        ("put a, b, c", lambda: put_each("abc")),
        ("put d (evicts)", lambda: put("d", "x")),
        ("put d again (replaces)", lambda: put("d", "y")),
        ("put b again (replaces the least recent)", lambda: put("b", "y")),
        # By weight, a heavier value needs room: c is evicted after d's REPLACED is
        # collected, and both are reported once the cache is back within max_weight.
        ("put d heavier (replaces, and evicts by weight)", lambda: put("d", "yyyyy")),
        ("delete c", lambda: cache.delete("c")),
        ("put e (a heavy one)", lambda: put("e", "eeee" if weighted else "e")),
        ("clear", lambda: cache.clear()),
    ]
    if kind == "TTLCache":
        expiring = cast(ExpiringCache, cache)  # make("TTLCache") built it
        steps += [
            ("put f, g", lambda: put_each("fg")),
            ("at their deadline", lambda: clock.advance(TTL)),
            ("get f", lambda: cache.get("f")),
            ("expire()", lambda: expiring.expire()),
        ]
    done: list[str] = []
    for what, step in steps:
        step()
        done.append(what)
        if problems:
            return [f"{where}: {p} (after {'; '.join(done)})" for p in problems]
    return []
