"""The stage-1 caches' exact behaviour, written from the rules (never from an
implementation): one plain list, least recently used first, O(n) per operation.

The state machines of :mod:`katas.kv_cache._testing.machine` compare every observable
result of a cache with it — values, eviction order, recency order, callbacks, stats —
by count and by weight (a count-only model misses the weight bugs).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from katas.kv_cache._testing.caches import EVICTED, EXPLICIT, REPLACED, Heard


@dataclass
class Entry:
    key: Any
    value: Any
    weight: int
    deadline: int | None
    freq: int = 1
    tick: int = 0


@dataclass
class Model:
    """One cache's exact behaviour: a plain list, least recently used first."""

    kind: str
    maxsize: int
    max_weight: int | None
    ttl: int | None
    entries: list[Entry] = field(default_factory=list)
    dead: dict[Any, Any] = field(default_factory=dict)  # expired, not yet reported
    ticks: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    expirations: int = 0

    def find(self, key: Any) -> Entry | None:
        return next((e for e in self.entries if e.key == key), None)

    def expired(self, e: Entry, now: int) -> bool:
        return e.deadline is not None and now >= e.deadline

    def settle(self, now: int) -> None:
        """Expired entries leave the live list (the cache reports them when it likes)."""
        for e in [e for e in self.entries if self.expired(e, now)]:
            self.entries.remove(e)
            self.dead[e.key] = e.value

    def touch(self, e: Entry) -> None:
        self.ticks += 1
        e.freq, e.tick = e.freq + 1, self.ticks
        self.entries.remove(e)
        self.entries.append(e)

    def get(self, key: Any, now: int) -> tuple[bool, Any]:
        self.settle(now)
        e = self.find(key)
        if e is None:
            self.misses += 1
            return False, None
        self.hits += 1
        self.touch(e)
        return True, e.value

    def put(self, key: Any, value: Any, weight: int, now: int) -> list[Heard]:
        """The non-EXPIRED callbacks this put makes, in order."""
        self.settle(now)
        heard: list[Heard] = []
        deadline = None if self.ttl is None else now + self.ttl
        e = self.find(key)
        if e is not None:
            heard.append((key, e.value, REPLACED))
            e.value, e.weight, e.deadline = value, weight, deadline
            self.touch(e)
        else:
            self.ticks += 1
            self.entries.append(Entry(key, value, weight, deadline, 1, self.ticks))
        while len(self.entries) > self.maxsize or (
            self.max_weight is not None and sum(x.weight for x in self.entries) > self.max_weight
        ):
            others = [x for x in self.entries if x.key != key]
            victim = (
                min(others, key=lambda x: (x.freq, x.tick))
                if self.kind == "LFUCache"
                else others[0]
            )
            self.entries.remove(victim)
            self.evictions += 1
            heard.append((victim.key, victim.value, EVICTED))
        return heard

    def delete(self, key: Any, now: int) -> bool:
        self.settle(now)
        e = self.find(key)
        if e is None:
            return False
        self.entries.remove(e)
        return True

    def clear(self, now: int) -> list[Heard]:
        """Every live entry leaves, EXPLICIT (the expired ones were gone before)."""
        self.settle(now)
        gone = [(e.key, e.value, EXPLICIT) for e in self.entries]
        self.entries.clear()
        return gone

    def order(self) -> list[Any]:
        if self.kind == "LFUCache":
            return [e.key for e in sorted(self.entries, key=lambda x: (x.freq, x.tick))]
        return [e.key for e in self.entries]
