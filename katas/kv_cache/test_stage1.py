"""Stage 1 suite: caches with eviction (see katas/kv_cache/README.md).

Core: ``LRUCache`` and ``TTLCache`` by count, with ``on_evict`` and ``stats()``.
Extended: weights (``max_weight``, ``weigh``) and ``LFUCache``.

Examples read like the prompt; state machines compare every observable result — values,
eviction order, recency order, callbacks, stats — with an O(n) list ``Model`` written
here from the rules (never reading an implementation), by count and by weight: a
count-only model misses the weight bugs. Time is a ``ManualClock``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from katas.kv_cache.api import CacheStats, ManualClock, RemovalCause

pytestmark = [pytest.mark.stage(1)]

core = pytest.mark.core
extended = pytest.mark.extended

EVICTED, EXPIRED = RemovalCause.EVICTED, RemovalCause.EXPIRED
EXPLICIT, REPLACED = RemovalCause.EXPLICIT, RemovalCause.REPLACED
START = 1_000_000
TTL = 1_000

_STAGE: dict[str, ModuleType] = {}


def stage() -> ModuleType:
    return _STAGE["module"]


@pytest.fixture(autouse=True)
def _fail_fast_on_stubs(stage_module: ModuleType) -> None:
    """Build a cache first: on a stub this fails at once with "not implemented yet"."""
    _STAGE["module"] = stage_module
    stage_module.LRUCache(1)


class Log:
    """Records ``on_evict`` calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, Any, RemovalCause]] = []
        self.taken: list[tuple[Any, Any, RemovalCause]] = []  # what take() last returned

    def __call__(self, key: Any, value: Any, cause: RemovalCause) -> None:
        self.calls.append((key, value, cause))

    def take(self) -> list[tuple[Any, Any, RemovalCause]]:
        self.taken, self.calls = self.calls, []
        return self.taken


def make(kind: str, maxsize: int, clock: ManualClock | None = None, **kw: Any) -> Any:
    cls = getattr(stage(), kind)
    if kind == "TTLCache":
        return cls(maxsize, kw.pop("ttl_ns", TTL), clock=clock or ManualClock(START), **kw)
    return cls(maxsize, **kw)


# --------------------------------------------------------------------------- examples


@core
@pytest.mark.parametrize("kind", ["LRUCache", "TTLCache"])
def test_stage1_evicts_the_least_recently_used(kind: str) -> None:
    log = Log()
    cache = make(kind, 3, on_evict=log)
    for key in "abc":
        cache.put(key, key.upper())
    assert cache.get("a") == "A"  # a is now the most recently used: b is the coldest
    cache.put("d", "D")
    assert log.take() == [("b", "B", EVICTED)], (
        "stage 1: with a, b, c held and a just read, putting d must evict b (the least "
        f"recently used); on_evict heard {log.taken}"
    )
    assert list(cache) == ["c", "a", "d"], (
        f"stage 1: keys in recency order, least recent first: expected ['c', 'a', 'd'], "
        f"got {list(cache)}"
    )


@core
@pytest.mark.parametrize("kind", ["LRUCache", "TTLCache"])
def test_stage1_holds_exactly_maxsize_entries(kind: str) -> None:
    cache = make(kind, 3)
    for n in range(3):
        cache.put(n, n)
    assert len(cache) == 3 and cache.stats().evictions == 0, (
        f"stage 1: a cache of maxsize 3 holds 3 entries without evicting; it holds "
        f"{len(cache)} after {cache.stats().evictions} evictions"
    )
    cache.put(3, 3)
    assert len(cache) == 3 and list(cache) == [1, 2, 3], (
        f"stage 1: the 4th put evicts exactly one entry, the oldest: {list(cache)}"
    )


@core
@pytest.mark.parametrize("kind", ["LRUCache", "TTLCache"])
def test_stage1_update_is_not_an_insert(kind: str) -> None:
    log = Log()
    cache = make(kind, 2, on_evict=log)
    cache.put("a", 1)
    cache.put("b", 2)
    cache.put("a", 10)  # full, but a is already here: replace, refresh, evict nothing
    assert log.take() == [("a", 1, REPLACED)] and list(cache) == ["b", "a"], (
        "stage 1: putting an existing key replaces its value (on_evict hears REPLACED), "
        f"makes it the most recent and evicts nothing; heard {log.taken}, "
        f"keys {list(cache)}"
    )
    cache.put("c", 3)
    assert log.take() == [("b", 2, EVICTED)], "stage 1: b was the least recently used"
    assert cache.get("a") == 10


@core
@pytest.mark.parametrize("kind", ["LRUCache", "TTLCache"])
@pytest.mark.parametrize("value", [0, "", None, False, []])
def test_stage1_falsy_values_are_hits(kind: str, value: Any) -> None:
    cache = make(kind, 2)
    cache.put("k", value)
    assert cache.get("k", "missing") == value and "k" in cache, (
        f"stage 1: a stored {value!r} must be found (a hit), not treated as a miss"
    )
    assert (cache.stats().hits, cache.stats().misses) == (1, 0), cache.stats()


@core
@pytest.mark.parametrize("kind", ["LRUCache", "TTLCache"])
def test_stage1_contains_len_and_iteration_do_not_refresh_recency(kind: str) -> None:
    cache = make(kind, 2)
    cache.put("a", 1)
    cache.put("b", 2)
    assert "a" in cache and len(cache) == 2 and list(cache) == ["a", "b"]
    cache.put("c", 3)
    assert "a" not in cache and "b" in cache, (
        "stage 1: `in`, len() and iteration are observations: checking `'a' in cache` must "
        "not make a recently used, so c evicts a"
    )
    assert cache.stats().hits == 0, "stage 1: observations are not gets: no hit counted"


@core
@pytest.mark.parametrize("kind", ["LRUCache", "TTLCache"])
def test_stage1_delete_clear_and_callbacks(kind: str) -> None:
    log = Log()
    cache = make(kind, 3, on_evict=log)
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.delete("a") is True and cache.delete("a") is False
    assert log.take() == [("a", 1, EXPLICIT)]
    cache.put("c", 3)
    cache.clear()
    assert sorted(log.take()) == [("b", 2, EXPLICIT), ("c", 3, EXPLICIT)]
    assert len(cache) == 0 and list(cache) == []
    for n in range(5):  # after a delete, the order structure must not hold ghosts
        cache.put(n, n)
    assert list(cache) == [2, 3, 4] and [c for _, _, c in log.take()] == [EVICTED, EVICTED]


@core
@pytest.mark.parametrize("kind", ["LRUCache", "TTLCache"])
def test_stage1_stats_are_consistent(kind: str) -> None:
    log = Log()
    cache = make(kind, 2, on_evict=log)
    for key in ["a", "b", "a", "c", "b", "d", "a"]:
        if cache.get(key) is None:
            cache.put(key, key)
    stats = cache.stats()
    evicted = sum(c is EVICTED for _, _, c in log.calls)
    assert stats == CacheStats(1, 6, evicted, 0, 2, 2) and evicted == 4, (
        f"stage 1: 7 gets (1 hit: the second a), 6 puts into 2 slots (4 evictions): "
        f"expected hits 1, misses 6, evictions 4, size 2; got {stats}"
    )


@core
@pytest.mark.parametrize("kind", ["LRUCache", "TTLCache"])
def test_stage1_only_evictions_count_as_evictions(kind: str) -> None:
    cache = make(kind, 2)
    cache.put("a", 1)
    cache.put("a", 2)  # REPLACED
    cache.put("b", 3)
    cache.delete("b")  # EXPLICIT
    cache.put("c", 4)
    cache.put("d", 5)  # EVICTED: a
    assert cache.stats().evictions == 1, (
        f"stage 1: evictions counts removals to make room only — not replacements or "
        f"deletes; one eviction happened, stats say {cache.stats()}"
    )


@core
def test_stage1_ttl_entry_is_gone_exactly_at_its_deadline() -> None:
    clock, log = ManualClock(START), Log()
    cache = make("TTLCache", 4, clock, ttl_ns=TTL, on_evict=log)
    cache.put("k", "v")
    clock.advance(TTL - 1)
    assert cache.get("k") == "v" and "k" in cache, "stage 1: alive 1 ns before the deadline"
    clock.advance(1)
    assert "k" not in cache and len(cache) == 0 and list(cache) == [], (
        "stage 1: an entry written at t is live iff now < t + ttl_ns: at the deadline it is "
        "gone from `in`, len() and iteration"
    )
    assert cache.get("k", "gone") == "gone" and log.take() == [("k", "v", EXPIRED)], (
        "stage 1: get at the deadline misses, and on_evict hears EXPIRED once"
    )
    assert cache.stats().expirations == 1 and cache.stats().misses == 1


@core
def test_stage1_ttl_update_restarts_the_deadline() -> None:
    clock = ManualClock(START)
    cache = make("TTLCache", 4, clock)
    cache.put("k", 1)
    clock.advance(TTL - 10)
    cache.put("k", 2)
    clock.advance(TTL - 1)
    assert cache.get("k") == 2, "stage 1: an update restarts the entry's time to live"
    clock.advance(1)
    assert cache.get("k") is None
    stats = cache.stats()
    assert (stats.hits, stats.misses, stats.expirations) == (1, 1, 1), (
        f"stage 1: a get that finds only an expired entry is a miss, and the entry expires: {stats}"
    )


@core
def test_stage1_a_put_over_an_expired_key_is_not_a_replacement() -> None:
    clock, log = ManualClock(START), Log()
    cache = make("TTLCache", 4, clock, on_evict=log)
    cache.put("k", "old")
    clock.advance(TTL)  # "old" has expired, unobserved
    cache.put("k", "new")
    assert log.take() == [("k", "old", EXPIRED)], (
        "stage 1: the old value had expired before the put: on_evict must hear it as "
        f"EXPIRED (it was never replaced while live); heard {log.taken}"
    )
    assert cache.get("k") == "new" and cache.stats().expirations == 1


@core
def test_stage1_a_full_ttl_cache_drops_expired_entries_before_evicting_a_live_one() -> None:
    clock, log = ManualClock(START), Log()
    cache = make("TTLCache", 3, clock, on_evict=log)
    cache.put("old", 0)
    clock.advance(TTL // 2)
    cache.put("live-1", 1)
    cache.put("live-2", 2)
    cache.get("old")  # the most recently used, but about to expire
    clock.advance(TTL // 2)  # "old" expires now
    cache.put("new", 3)
    assert [c for _, _, c in log.take()] == [EXPIRED] and list(cache) == [
        "live-1", "live-2", "new"
    ], (
        "stage 1: when room is needed, expired entries go first: no live entry may be "
        f"evicted while an expired one takes a slot; keys {list(cache)}"
    )  # fmt: skip


@core
def test_stage1_ttl_survives_a_clock_stepping_back() -> None:
    clock = ManualClock(START)
    cache = make("TTLCache", 10, clock)
    cache.put("a", 1)  # deadline START + TTL
    clock.set(START - 5 * TTL)
    cache.put("b", 2)  # deadline START - 4 TTL: earlier than a's
    clock.set(START)
    assert "b" not in cache and cache.get("a") == 1, (
        "stage 1: deadlines are written_at + ttl_ns on the injected clock, even when the "
        "clock steps back: b (written 5 TTL earlier on the clock) is expired, a is live"
    )
    assert len(cache) == 1


_BAD: list[Any] = [
    ("maxsize zero", lambda: make("LRUCache", 0), ValueError, "maxsize"),
    ("maxsize float", lambda: make("LRUCache", 1.5), TypeError, "maxsize"),  # type: ignore[arg-type]
    ("ttl zero", lambda: make("TTLCache", 2, ttl_ns=0), ValueError, "ttl_ns"),
    ("ttl negative", lambda: make("TTLCache", 2, ttl_ns=-1), ValueError, "ttl_ns"),
]


@core
@pytest.mark.parametrize(("call", "error", "name"), [pytest.param(*b[1:], id=b[0]) for b in _BAD])
def test_stage1_bad_parameters_raise_naming_them(
    call: Callable[[], Any], error: type[Exception], name: str
) -> None:
    with pytest.raises(error) as raised:
        call()
        raise AssertionError(f"stage 1: a bad {name} was accepted")
    assert name in str(raised.value), f"stage 1: the error must name {name}: {raised.value!r}"


@core
@pytest.mark.parametrize("kind", ["LRUCache", "TTLCache"])
def test_stage1_an_unhashable_key_raises_and_changes_nothing(kind: str) -> None:
    log = Log()
    cache = make(kind, 2, on_evict=log)
    cache.put("a", 1)
    cache.put("b", 2)
    with pytest.raises(TypeError):
        cache.put(["not", "hashable"], 3)
        raise AssertionError("stage 1: an unhashable key was accepted")
    assert list(cache) == ["a", "b"] and log.calls == [], (
        f"stage 1: a refused put must change nothing: keys {list(cache)}, heard {log.calls}"
    )


# --------------------------------------------------------------------------- extended


@extended
@pytest.mark.parametrize("kind", ["LRUCache", "TTLCache", "LFUCache"])
def test_stage1_weight_update_subtracts_the_old_weight(kind: str) -> None:
    log = Log()
    cache = make(kind, 10, max_weight=10, weigh=len, on_evict=log)
    cache.put("a", "xxx")  # weight 3
    cache.put("a", "yyy")  # still 3 in all, not 6
    cache.put("b", "zzzz")  # 7
    cache.put("c", "www")  # 10: exactly full
    assert [c for _, _, c in log.calls] == [REPLACED] and cache.stats().weight == 10, (
        f"stage 1: replacing a value of weight 3 by one of weight 3 leaves the total at 3, "
        f"so b (4) and c (3) fit exactly; heard {log.calls}, {cache.stats()}"
    )


@extended
@pytest.mark.parametrize("kind", ["LRUCache", "TTLCache", "LFUCache"])
def test_stage1_a_heavy_value_evicts_as_many_entries_as_needed(kind: str) -> None:
    log = Log()
    cache = make(kind, 10, max_weight=10, weigh=len, on_evict=log)
    for key in "abc":
        cache.put(key, "xxx")  # 9 in all
    cache.put("d", "x" * 8)  # 17: a, b and c must go
    assert [k for k, _, c in log.calls if c is EVICTED] == ["a", "b", "c"], (
        f"stage 1: one heavy value may need several evictions, coldest first; heard {log.calls}"
    )
    assert list(cache) == ["d"] and cache.stats().weight == 8


@extended
@pytest.mark.parametrize("kind", ["LRUCache", "TTLCache", "LFUCache"])
def test_stage1_an_oversize_value_raises_and_changes_nothing(kind: str) -> None:
    log = Log()
    cache = make(kind, 10, max_weight=10, weigh=len, on_evict=log)
    cache.put("a", "xxx")
    cache.put("b", "yyy")
    for key in ("c", "a"):  # a new key, and an existing one
        with pytest.raises(ValueError) as raised:
            cache.put(key, "z" * 11)
            raise AssertionError("stage 1: a value heavier than max_weight was accepted")
        assert "max_weight" in str(raised.value), raised.value
    assert log.calls == [] and list(cache) == ["a", "b"] and cache.get("a") == "xxx", (
        f"stage 1: a value heavier than max_weight must raise BEFORE anything changes (no "
        f"flush, no replacement): heard {log.calls}, keys {list(cache)}"
    )


@extended
@pytest.mark.parametrize("kind", ["LRUCache", "TTLCache", "LFUCache"])
@pytest.mark.parametrize("weight", [-1, 1.5, "3"])
def test_stage1_a_bad_weight_raises_and_changes_nothing(kind: str, weight: Any) -> None:
    log = Log()
    cache = make(kind, 10, max_weight=10, weigh=lambda v: weight, on_evict=log)
    with pytest.raises(ValueError) as raised:
        cache.put("a", 1)
        raise AssertionError(f"stage 1: weigh returning {weight!r} was accepted")
    assert "weigh" in str(raised.value), raised.value
    assert len(cache) == 0 and cache.stats().weight == 0 and log.calls == []


@extended
def test_stage1_weigh_without_max_weight_is_refused() -> None:
    with pytest.raises(ValueError) as raised:
        make("LRUCache", 4, weigh=len)
    assert "max_weight" in str(raised.value)


@extended
def test_stage1_lfu_evicts_the_least_frequent_then_least_recently_accessed() -> None:
    log = Log()
    cache = make("LFUCache", 3, on_evict=log)
    for key in "acb":  # inserted a, c, b — but accessed below as b before c
        cache.put(key, key)
    for key in ("a", "a", "b", "c"):  # frequencies: a 3, b 2, c 2; b accessed before c
        cache.get(key)
    assert [cache.frequency(k) for k in "abc"] == [3, 2, 2]
    cache.put("d", "d")
    assert log.take() == [("b", "b", EVICTED)], (
        f"stage 1: b and c tie at frequency 2; b was accessed less recently (though "
        f"inserted after c), so b goes; heard {log.taken}"
    )
    cache.put("e", "e")  # d has frequency 1: the least frequent
    assert log.take() == [("d", "d", EVICTED)]
    cache.put("c", "C")  # an update adds 1 too: c 3, after a (3, accessed earlier)
    assert cache.frequency("c") == 3 and list(cache) == ["e", "a", "c"], list(cache)


@extended
def test_stage1_lfu_observations_do_not_count_as_accesses() -> None:
    cache = make("LFUCache", 2)
    cache.put("a", 1)
    cache.put("b", 2)
    for _ in range(5):
        assert "a" in cache and len(cache) == 2 and list(cache)
    cache.put("c", 3)
    assert "a" not in cache, "stage 1: `in` must not raise a's frequency"


@extended
def test_stage1_expired_entries_never_pile_up() -> None:
    """Bounded active cleanup: each put reclaims at least one expired entry while any
    remain, and never more than 64 unless it needs the room."""
    clock, log = ManualClock(START), Log()
    cache = make("TTLCache", 10_000, clock, on_evict=log)
    for n in range(500):
        cache.put(("old", n), n)
    clock.advance(TTL)
    reclaimed = []
    for n in range(600):
        cache.put(("new", n), n)
        reclaimed.append(len(log.take()))
        if sum(reclaimed) == 500:
            break
    assert sum(reclaimed) == 500 and all(1 <= r <= 64 for r in reclaimed), (
        f"stage 1: 500 expired entries must be reclaimed by later puts, at least 1 and at "
        f"most 64 per put; reclaimed per put: {reclaimed[:20]}… in all {sum(reclaimed)}"
    )


# --------------------------------------------------------------------------- the model


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

    def put(self, key: Any, value: Any, weight: int, now: int) -> list[tuple[Any, Any, Any]]:
        """The non-EXPIRED callbacks this put makes, in order."""
        self.settle(now)
        heard: list[tuple[Any, Any, Any]] = []
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

    def order(self) -> list[Any]:
        if self.kind == "LFUCache":
            return [e.key for e in sorted(self.entries, key=lambda x: (x.freq, x.tick))]
        return [e.key for e in self.entries]


KEYS = st.sampled_from(["a", "b", "c", "d", "e", "f"])


class CacheMachine(RuleBasedStateMachine):
    """A cache and its model under random operations, compared at every step."""

    kind = "LRUCache"
    weighted = False

    def __init__(self) -> None:
        super().__init__()
        self.clock = ManualClock(START)
        self.log = Log()
        self.history: list[str] = []

    @initialize(maxsize=st.integers(1, 6), max_weight=st.integers(3, 12))
    def build(self, maxsize: int, max_weight: int) -> None:
        kw: dict[str, Any] = {"on_evict": self.log}
        if self.weighted:
            kw |= {"max_weight": max_weight, "weigh": lambda v: v % 7}
        self.cache = make(self.kind, maxsize, self.clock, **kw)
        ttl = TTL if self.kind == "TTLCache" else None
        self.model = Model(self.kind, maxsize, max_weight if self.weighted else None, ttl)
        self.history.append(f"{self.kind}({maxsize}, {kw})")

    def fail(self, what: str) -> str:
        steps = "\n".join(f"    {h}" for h in self.history[-15:])
        return f"stage 1: {what}\n  the last steps:\n{steps}"

    def heard(self, expected: list[tuple[Any, Any, Any]]) -> None:
        calls = self.log.take()
        now = self.clock.now_ns()
        for key, value, cause in calls:
            if cause is EXPIRED:
                assert self.model.dead.get(key, object()) == value or any(
                    e.key == key and e.value == value and self.model.expired(e, now)
                    for e in self.model.entries
                ), self.fail(f"on_evict({key!r}, {value!r}, EXPIRED) for an entry not expired")
                self.model.dead.pop(key, None)
                self.model.expirations += 1
        others = [c for c in calls if c[2] is not EXPIRED]
        assert others == expected, self.fail(
            f"on_evict calls: expected {expected} (and any EXPIRED), got {calls}"
        )

    @rule(key=KEYS, value=st.integers(0, 20))
    def put(self, key: str, value: int) -> None:
        self.history.append(f"put({key!r}, {value})")
        weight = value % 7
        if self.weighted and weight > self.model.max_weight:  # type: ignore[operator]
            with pytest.raises(ValueError):
                self.cache.put(key, value)
            self.heard([])
            return
        expected = self.model.put(key, value, weight if self.weighted else 1, self.clock.now_ns())
        self.cache.put(key, value)
        self.heard(expected)

    @rule(key=KEYS)
    def get(self, key: str) -> None:
        self.history.append(f"get({key!r})")
        hit, value = self.model.get(key, self.clock.now_ns())
        got = self.cache.get(key, "MISS")
        assert got == (value if hit else "MISS"), self.fail(
            f"get({key!r}): expected {value if hit else 'a miss'}, got {got!r}"
        )
        self.heard([])

    @rule(key=KEYS)
    def delete(self, key: str) -> None:
        self.history.append(f"delete({key!r})")
        value = e.value if (e := self.model.find(key)) else None
        expected = self.model.delete(key, self.clock.now_ns())
        got = self.cache.delete(key)
        assert got is expected, self.fail(f"delete({key!r}): expected {expected}, got {got}")
        self.heard([(key, value, EXPLICIT)] if expected else [])

    @precondition(lambda self: self.kind == "TTLCache")
    @rule(ns=st.sampled_from([1, 250, 499, 500, 999, 1_000]))
    def advance(self, ns: int) -> None:
        self.history.append(f"advance({ns})")
        self.clock.advance(ns)

    # A rule, not an invariant: len() and stats() may reclaim expired entries, and
    # observing after every step would hide a get or put that mishandles one.
    @rule()
    def observations_agree(self) -> None:
        now = self.clock.now_ns()
        self.model.settle(now)
        keys = self.model.order()
        assert list(self.cache) == keys and len(self.cache) == len(keys), self.fail(
            f"held keys (in eviction order): expected {keys}, got {list(self.cache)} "
            f"(len {len(self.cache)})"
        )
        for key in ["a", "b", "c", "d", "e", "f"]:
            assert (key in self.cache) == (key in keys), self.fail(f"{key!r} in cache")
        self.heard([])  # observing may reclaim expired entries: EXPIRED calls only
        stats = self.cache.stats()
        self.heard([])
        m = self.model
        weight = sum(e.weight for e in m.entries) if self.weighted else len(keys)
        want = CacheStats(m.hits, m.misses, m.evictions, m.expirations, len(keys), weight)
        assert stats == want, self.fail(f"stats(): expected {want}, got {stats}")


def machine(kind: str, weighted: bool) -> type[RuleBasedStateMachine]:
    return type(f"{kind}{'Weighted' if weighted else ''}Machine", (CacheMachine,),
                {"kind": kind, "weighted": weighted})  # fmt: skip


TestStage1LRUMatchesTheModel = core(machine("LRUCache", False).TestCase)
TestStage1TTLMatchesTheModel = core(machine("TTLCache", False).TestCase)
TestStage1WeightedLRUMatchesTheModel = extended(machine("LRUCache", True).TestCase)
TestStage1WeightedTTLMatchesTheModel = extended(machine("TTLCache", True).TestCase)
TestStage1LFUMatchesTheModel = extended(machine("LFUCache", False).TestCase)
TestStage1WeightedLFUMatchesTheModel = extended(machine("LFUCache", True).TestCase)
for _case in (
    TestStage1LRUMatchesTheModel, TestStage1TTLMatchesTheModel,
    TestStage1WeightedLRUMatchesTheModel, TestStage1WeightedTTLMatchesTheModel,
    TestStage1LFUMatchesTheModel, TestStage1WeightedLFUMatchesTheModel,
):  # fmt: skip
    _case.settings = settings(stateful_step_count=40)
del _case  # a module-level TestCase name would be collected a second time
