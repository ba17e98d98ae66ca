"""Stage 1 suite: caches with eviction (see katas/kv_cache/README.md).

Core: ``LRUCache`` and ``TTLCache`` by count, with ``on_evict`` and ``statistics()``.
Extended: weights (``max_weight``, ``weigh``) and ``LFUCache``.

The map of this file:

- examples, core: LRU order, capacity, update-not-insert, falsy hits, pure observations,
  delete and clear, the counters, TTL deadlines, bad parameters, unhashable keys;
- examples, extended: weights (update, heavy values, oversize, bad weights), LFU;
- boundaries: each rule at its edge on every path — the instants around a deadline, a
  weight at and past the limit, every way a value can leave (``on_evict`` sees a
  consistent cache, and may be assigned later);
- the model tests: state machines (``_testing/machine.py``) compare every observable
  result — values, eviction order, recency order, callbacks, stats — with an O(n) list
  model written from the rules (``_testing/model.py``), by count and by weight.

Time is a ``ManualClock``; caches are built by ``_testing/caches.py``'s ``make``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, cast

import pytest
from hypothesis import settings

from katas._harness.marks import core, extended, rule
from katas._harness.story import check, expect, not_refused
from katas.kv_cache._testing.caches import (
    ALL_KINDS,
    EVICTED,
    EXPIRED,
    EXPLICIT,
    REPLACED,
    START,
    TTL,
    Heard,
    Log,
    fail_fast_on_stage1_stubs,  # noqa: F401 (autouse)
    heard,
    make,
    weighed_by_length,
)
from katas.kv_cache._testing.callbacks import consistency_problems
from katas.kv_cache._testing.expiry import (
    BEYOND_ONE_SWEEP,
    behind_stale_deadlines,
    heavy_put_needing_every_expired_slot,
)
from katas.kv_cache._testing.flights import caught
from katas.kv_cache._testing.keys import KEYED_CALLS, UNHASHABLE_KEYS, full_cache, observe
from katas.kv_cache._testing.machine import model_test
from katas.kv_cache.api import CacheStats, ExpiringCache, ManualClock

pytestmark = [pytest.mark.stage(1)]


# --------------------------------------------------------------------------- examples


@core
@rule("lru-order", "iteration-order")
@pytest.mark.parametrize("kind", ["LRUCache", "TTLCache"])
def test_stage1_evicts_the_least_recently_used(kind: str) -> None:
    cache, log = heard(kind, 3)
    for key in "abc":
        cache.put(key, key.upper())
    assert cache.get("a") == "A"  # a is now the most recently used: b is the coldest
    cache.put("d", "D")
    assert log.take() == [("b", "B", EVICTED)], (
        "with a, b, c held and a just read, putting d must evict b (the least "
        f"recently used); on_evict heard {log.taken}"
    )
    assert list(cache) == ["c", "a", "d"], (
        f"keys in recency order, least recent first: expected ['c', 'a', 'd'], got {list(cache)}"
    )


@core
@rule("capacity", "writer-not-victim")
@pytest.mark.parametrize("kind", ["LRUCache", "TTLCache"])
def test_stage1_holds_exactly_maxsize_entries(kind: str) -> None:
    cache = make(kind, 3)
    for n in range(3):
        cache.put(n, n)
    assert len(cache) == 3 and cache.statistics().evictions == 0, (
        f"a cache of maxsize 3 holds 3 entries without evicting; it holds "
        f"{len(cache)} after {cache.statistics().evictions} evictions"
    )
    cache.put(3, 3)
    assert len(cache) == 3 and list(cache) == [1, 2, 3], (
        f"the 4th put evicts exactly one entry, the oldest: {list(cache)}"
    )


@core
@rule("update-not-insert")
@pytest.mark.parametrize("kind", ["LRUCache", "TTLCache"])
def test_stage1_update_is_not_an_insert(kind: str) -> None:
    cache, log = heard(kind, 2)
    cache.put("a", 1)
    cache.put("b", 2)
    cache.put("a", 10)  # full, but a is already here: replace, refresh, evict nothing
    assert log.take() == [("a", 1, REPLACED)] and list(cache) == ["b", "a"], (
        "putting an existing key replaces its value (on_evict hears REPLACED), "
        f"makes it the most recent and evicts nothing; heard {log.taken}, "
        f"keys {list(cache)}"
    )
    cache.put("c", 3)
    assert log.take() == [("b", 2, EVICTED)], "b was the least recently used"
    assert cache.get("a") == 10


@core
@rule("falsy-hits")
@pytest.mark.parametrize("kind", ["LRUCache", "TTLCache"])
@pytest.mark.parametrize("value", [0, "", None, False, []])
def test_stage1_falsy_values_are_hits(kind: str, value: object) -> None:
    cache = make(kind, 2)
    cache.put("k", value)
    assert cache.get("k", "missing") == value and "k" in cache, (
        f"a stored {value!r} must be found (a hit), not treated as a miss"
    )
    assert (cache.statistics().hits, cache.statistics().misses) == (1, 0), cache.statistics()


@core
@rule("pure-observations")
@pytest.mark.parametrize("kind", ["LRUCache", "TTLCache"])
def test_stage1_contains_len_and_iteration_do_not_refresh_recency(kind: str) -> None:
    cache = make(kind, 2)
    cache.put("a", 1)
    cache.put("b", 2)
    assert "a" in cache and len(cache) == 2 and list(cache) == ["a", "b"]
    cache.put("c", 3)
    assert "a" not in cache and "b" in cache, (
        "`in`, len() and iteration are observations: checking `'a' in cache` must "
        "not make a recently used, so c evicts a"
    )
    assert cache.statistics().hits == 0, "observations are not gets: no hit counted"


@core
@rule("delete", "clear", "no-ghosts")
@pytest.mark.parametrize("kind", ["LRUCache", "TTLCache"])
def test_stage1_delete_clear_and_callbacks(kind: str) -> None:
    cache, log = heard(kind, 3)
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
@rule("stats", "counters")
@pytest.mark.parametrize("kind", ["LRUCache", "TTLCache"])
def test_stage1_stats_are_consistent(kind: str) -> None:
    cache, log = heard(kind, 2)
    for key in ["a", "b", "a", "c", "b", "d", "a"]:
        if cache.get(key) is None:
            cache.put(key, key)
    stats = cache.statistics()
    evicted = sum(c is EVICTED for _, _, c in log.calls)
    assert stats == CacheStats(1, 6, evicted, 0, 2, 2) and evicted == 4, (
        f"7 gets (1 hit: the second a), 6 puts into 2 slots (4 evictions): "
        f"expected hits 1, misses 6, evictions 4, size 2; got {stats}"
    )


@core
@rule("counters")
@pytest.mark.parametrize("kind", ["LRUCache", "TTLCache"])
def test_stage1_only_evictions_count_as_evictions(kind: str) -> None:
    cache = make(kind, 2)
    cache.put("a", 1)
    cache.put("a", 2)  # REPLACED
    cache.put("b", 3)
    cache.delete("b")  # EXPLICIT
    cache.put("c", 4)
    cache.put("d", 5)  # EVICTED: a
    assert cache.statistics().evictions == 1, (
        f"evictions counts removals to make room only — not replacements or "
        f"deletes; one eviction happened, stats say {cache.statistics()}"
    )


@core
@rule("ttl-boundary")
def test_stage1_ttl_entry_is_gone_exactly_at_its_deadline() -> None:
    clock, log = ManualClock(START), Log()
    cache = make("TTLCache", 4, clock, ttl_ns=TTL, on_evict=log)
    cache.put("k", "v")
    clock.advance(TTL - 1)
    assert cache.get("k") == "v" and "k" in cache, "alive 1 ns before the deadline"
    clock.advance(1)
    assert "k" not in cache and len(cache) == 0 and list(cache) == [], (
        "an entry written at t is live iff now < t + ttl_ns: at the deadline it is "
        "gone from `in`, len() and iteration"
    )
    assert cache.get("k", "gone") == "gone" and log.take() == [("k", "v", EXPIRED)], (
        "get at the deadline misses, and on_evict hears EXPIRED once"
    )
    assert cache.statistics().expirations == 1 and cache.statistics().misses == 1


@core
@rule("ttl-update")
def test_stage1_ttl_update_restarts_the_deadline() -> None:
    clock = ManualClock(START)
    cache = make("TTLCache", 4, clock)
    cache.put("k", 1)
    clock.advance(TTL - 10)
    cache.put("k", 2)
    clock.advance(TTL - 1)
    assert cache.get("k") == 2, "an update restarts the entry's time to live"
    clock.advance(1)
    assert cache.get("k") is None
    stats = cache.statistics()
    assert (stats.hits, stats.misses, stats.expirations) == (1, 1, 1), (
        f"a get that finds only an expired entry is a miss, and the entry expires: {stats}"
    )


@core
@rule("ttl-put-over-expired")
def test_stage1_a_put_over_an_expired_key_is_not_a_replacement() -> None:
    clock, log = ManualClock(START), Log()
    cache = make("TTLCache", 4, clock, on_evict=log)
    cache.put("k", "old")
    clock.advance(TTL)  # "old" has expired, unobserved
    cache.put("k", "new")
    assert log.take() == [("k", "old", EXPIRED)], (
        "the old value had expired before the put: on_evict must hear it as "
        f"EXPIRED (it was never replaced while live); heard {log.taken}"
    )
    assert cache.get("k") == "new" and cache.statistics().expirations == 1


@core
@rule("ttl-full-drops-expired", "ttl-lru")
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
        "when room is needed, expired entries go first: no live entry may be "
        f"evicted while an expired one takes a slot; keys {list(cache)}"
    )  # fmt: skip


@core
@rule("ttl-clock-steps")
def test_stage1_ttl_survives_a_clock_stepping_back() -> None:
    clock = ManualClock(START)
    cache = make("TTLCache", 10, clock)
    cache.put("a", 1)  # deadline START + TTL
    clock.set(START - 5 * TTL)
    cache.put("b", 2)  # deadline START - 4 TTL: earlier than a's
    clock.set(START)
    assert "b" not in cache and cache.get("a") == 1, (
        "deadlines are written_at + ttl_ns on the injected clock, even when the "
        "clock steps back: b (written 5 TTL earlier on the clock) is expired, a is live"
    )
    assert len(cache) == 1


_BAD: list[tuple[str, Callable[[], object], type[Exception], str]] = [
    ("maxsize-zero", lambda: make("LRUCache", 0), ValueError, "maxsize"),
    ("maxsize-float", lambda: make("LRUCache", 1.5), TypeError, "maxsize"),  # type: ignore[call-overload]
    ("ttl-zero", lambda: make("TTLCache", 2, ttl_ns=0), ValueError, "ttl_ns"),
    ("ttl-negative", lambda: make("TTLCache", 2, ttl_ns=-1), ValueError, "ttl_ns"),
    ("ttl-float", lambda: make("TTLCache", 2, ttl_ns=1.5), TypeError, "ttl_ns"),
]


@core
@rule("bad-parameters")
@pytest.mark.parametrize(("call", "error", "name"), [pytest.param(*b[1:], id=b[0]) for b in _BAD])
def test_stage1_bad_parameters_raise_naming_them(
    call: Callable[[], object], error: type[Exception], name: str
) -> None:
    with pytest.raises(error) as raised:
        call()
        raise AssertionError(f"a bad {name} was accepted")
    assert name in str(raised.value), f"the error must name {name}: {raised.value!r}"


@core
@rule("unhashable")
@pytest.mark.parametrize("kind", ["LRUCache", "TTLCache"])
def test_stage1_an_unhashable_key_raises_and_changes_nothing(kind: str) -> None:
    cache, log = heard(kind, 2)
    cache.put("a", 1)
    cache.put("b", 2)
    before = cache.statistics()
    calls: dict[str, Callable[[Any], object]] = {
        "put": lambda k: cache.put(k, 3), "get": cache.get, "delete": cache.delete,
        "in": lambda k: k in cache,
    }  # fmt: skip
    for name, call in calls.items():
        try:
            call(["not", "hashable"])
        except TypeError as e:
            assert "key" in str(e), (
                f"{name} with the key ['not', 'hashable'] must raise a TypeError naming the "
                f"parameter key; got TypeError: {e}"
            )
        else:
            raise AssertionError(f"{name} accepted the unhashable key ['not', 'hashable']")
    assert list(cache) == ["a", "b"] and log.calls == [], (
        f"a refused call must change nothing: keys {list(cache)}, heard {log.calls}"
    )
    assert cache.statistics() == before, (
        f"a refused call counts nothing: {before} -> {cache.statistics()}"
    )


_CONFIGS = [
    pytest.param(kind, weighted, marks=core if kind != "LFUCache" and not weighted else extended,
                 id=f"{kind}{'-weighted' if weighted else ''}")
    for weighted in (False, True) for kind in ALL_KINDS
]  # fmt: skip


@rule("unhashable")
@pytest.mark.parametrize(("kind", "weighted"), _CONFIGS)
def test_stage1_an_unhashable_key_is_refused_first_on_every_entry_point(
    kind: str, weighted: bool
) -> None:
    """Every call taking a key, on a fresh full cache each time: a TypeError naming key
    comes before any other refusal of the call (a value too heavy, a bad weight), and
    the cache is left exactly as its twin that never saw the call."""
    for call, run in KEYED_CALLS.items():
        for shape, key in UNHASHABLE_KEYS.items():
            cache, log, steps = full_cache(kind, weighted)
            twin, twin_log, _ = full_cache(kind, weighted)
            what = f"{steps}; then {call} with the unhashable key {key!r} ({shape})"
            got = caught(partial(run, cache, key))
            check(
                isinstance(got, TypeError) and "key" in str(got),
                f"{what} must raise a TypeError naming the parameter key, before any other "
                f"check; got {type(got).__name__}: {got}"
                if isinstance(got, Exception)
                else f"{what} must raise a TypeError naming key; it returned {got!r}",
            )
            expect(log.take(), [], f"{what}: a refused call reports nothing to on_evict")
            expect(
                observe(kind, cache, log),
                observe(kind, twin, twin_log),
                f"{what} must change nothing (compared with a twin cache that never saw it)",
            )


# --------------------------------------------------------------------------- extended


@extended
@rule("weight-update", "weight-capacity")
@pytest.mark.parametrize("kind", ALL_KINDS)
def test_stage1_weight_update_subtracts_the_old_weight(kind: str) -> None:
    cache, log = weighed_by_length(kind)
    cache.put("a", "xxx")  # weight 3
    cache.put("a", "yyy")  # still 3 in all, not 6
    cache.put("b", "zzzz")  # 7
    cache.put("c", "www")  # 10: exactly full
    assert [c for _, _, c in log.calls] == [REPLACED] and cache.statistics().weight == 10, (
        f"replacing a value of weight 3 by one of weight 3 leaves the total at 3, "
        f"so b (4) and c (3) fit exactly; heard {log.calls}, {cache.statistics()}"
    )


@extended
@rule("heavy-evicts-many", "weight-capacity")
@pytest.mark.parametrize("kind", ALL_KINDS)
def test_stage1_a_heavy_value_evicts_as_many_entries_as_needed(kind: str) -> None:
    cache, log = weighed_by_length(kind)
    for key in "abc":
        cache.put(key, "xxx")  # 9 in all
    cache.put("d", "x" * 8)  # 17: a, b and c must go
    assert [k for k, _, c in log.calls if c is EVICTED] == ["a", "b", "c"], (
        f"one heavy value may need several evictions, coldest first; heard {log.calls}"
    )
    assert list(cache) == ["d"] and cache.statistics().weight == 8


@extended
@rule("oversize")
@pytest.mark.parametrize("kind", ALL_KINDS)
def test_stage1_an_oversize_value_raises_and_changes_nothing(kind: str) -> None:
    cache, log = weighed_by_length(kind)
    cache.put("a", "xxx")
    cache.put("b", "yyy")
    for key in ("c", "a"):  # a new key, and an existing one
        with pytest.raises(ValueError) as raised:
            cache.put(key, "z" * 11)
            raise AssertionError("a value heavier than max_weight was accepted")
        assert "max_weight" in str(raised.value), raised.value
    assert log.calls == [] and list(cache) == ["a", "b"] and cache.get("a") == "xxx", (
        f"a value heavier than max_weight must raise BEFORE anything changes (no "
        f"flush, no replacement): heard {log.calls}, keys {list(cache)}"
    )


@extended
@rule("bad-weight")
@pytest.mark.parametrize("kind", ALL_KINDS)
@pytest.mark.parametrize("weight", [-1, 1.5, "3", True, False])
def test_stage1_a_bad_weight_raises_and_changes_nothing(kind: str, weight: Any) -> None:
    cache, log = heard(kind, 10, max_weight=10, weigh=lambda v: weight)
    with pytest.raises(ValueError) as raised:
        cache.put("a", 1)
        raise AssertionError(f"weigh returning {weight!r} was accepted")
    assert "weigh" in str(raised.value), raised.value
    assert len(cache) == 0 and cache.statistics().weight == 0 and log.calls == []


_BAD_WEIGHTS: list[tuple[str, dict[str, Any], type[Exception]]] = [
    ("weigh-without-max_weight", {"weigh": len}, ValueError),
    ("max_weight-zero", {"max_weight": 0}, ValueError),
    ("max_weight-negative", {"max_weight": -1}, ValueError),
    ("max_weight-float", {"max_weight": 1.5}, TypeError),
]


@extended
@rule("weigh-needs-max-weight", "weight-capacity", "bad-parameters")
@pytest.mark.parametrize("kind", ALL_KINDS)
@pytest.mark.parametrize(("given", "error"), [pytest.param(*b[1:], id=b[0]) for b in _BAD_WEIGHTS])
def test_stage1_bad_weight_parameters_raise_naming_max_weight(
    kind: str, given: dict[str, Any], error: type[Exception]
) -> None:
    """On every cache: ``weigh`` without ``max_weight``, or a ``max_weight`` that is not an
    int >= 1, is refused at construction with an error naming ``max_weight``."""
    with pytest.raises(error) as raised:
        make(kind, 4, **given)
        raise AssertionError(f"{kind}(4, {given}) was accepted")
    check(
        "max_weight" in str(raised.value),
        f"{kind}(4, {given}): the {error.__name__} must name max_weight: {raised.value!r}",
    )


@extended
@rule("lfu-victim", "lfu-frequency")
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
        f"b and c tie at frequency 2; b was accessed less recently (though "
        f"inserted after c), so b goes; heard {log.taken}"
    )
    cache.put("e", "e")  # d has frequency 1: the least frequent
    assert log.take() == [("d", "d", EVICTED)]
    cache.put("c", "C")  # an update adds 1 too: c 3, after a (3, accessed earlier)
    assert cache.frequency("c") == 3 and list(cache) == ["e", "a", "c"], list(cache)


@extended
@rule("lfu-frequency", "pure-observations")
def test_stage1_lfu_observations_do_not_count_as_accesses() -> None:
    cache = make("LFUCache", 2)
    cache.put("a", 1)
    cache.put("b", 2)
    for _ in range(5):
        assert "a" in cache and len(cache) == 2 and list(cache)
    cache.put("c", 3)
    assert "a" not in cache, "`in` must not raise a's frequency"


@extended
@rule("active-expiry")
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
        f"500 expired entries must be reclaimed by later puts, at least 1 and at "
        f"most 64 per put; reclaimed per put: {reclaimed[:20]}… in all {sum(reclaimed)}"
    )


@extended
@rule("active-expiry")
@pytest.mark.parametrize("stale", ["updated", "deleted"])
def test_stage1_a_put_reclaims_an_expired_entry_behind_stale_deadlines(stale: str) -> None:
    cache, clock, log, steps = behind_stale_deadlines(stale)
    clock.set(START + TTL)  # a's deadline: a is the only expired entry
    cache.put("z", "z")
    heard = log.take()
    check(
        ("a", "A", EXPIRED) in heard,
        "each put reclaims at least one expired entry while any remain, and the deadlines "
        "of keys updated or deleted since are no expired entries. Steps: "
        + "; ".join(steps)
        + f"; at START + TTL put('z', 'z'), while {BEYOND_ONE_SWEEP} stale deadlines "
        f"({stale}) lie ahead of a's. Expected on_evict('a', 'A', EXPIRED) from that put; "
        f"heard {heard} — a sweep that counts stale bookkeeping against its limit reclaims "
        "nothing",
    )


@extended
@rule("active-expiry", "ttl-full-drops-expired", "heavy-evicts-many")
@pytest.mark.parametrize("update", [False, True], ids=["a-new-key", "an-update"])
def test_stage1_a_put_needing_room_drops_every_expired_entry_first(update: bool) -> None:
    cache, _, log, steps = heavy_put_needing_every_expired_slot(update)
    key = "m" if update else "heavy"
    cache.put(key, "h" * 80)
    heard = log.take()
    evicted = [c for c in heard if c[2] is EVICTED]
    expired = sum(c[2] is EXPIRED for c in heard)
    check(
        not evicted and expired == 90 and "live" in cache,
        "a put that needs room drops every expired entry before it evicts a live one, "
        "however many there are (a bounded sweep is not enough). Steps: "
        + "; ".join(steps)
        + f"; put({key!r}, 'h' * 80): it needs the room of all 90 expired entries, and "
        f"then fits (5 + {0 if update else 1} + 80 <= 100). Expected 90 EXPIRED and no "
        f"EVICTED; heard {expired} EXPIRED and evicted {evicted}",
    )


# --------------------------------------------------------------------------- boundaries
#
# Each rule at its boundary, on every path: the instants around a deadline, a weight at
# and past the limit, every way a value can leave.


def _boundary_cache(maxsize: int = 4) -> tuple[ExpiringCache, ManualClock, Log]:
    """A TTL cache holding ``k`` (written at START, deadline START + TTL)."""
    clock, log = ManualClock(START), Log()
    cache = make("TTLCache", maxsize, clock, ttl_ns=TTL, on_evict=log)
    cache.put("k", "v")
    return cache, clock, log


#: op name -> (what to do, what it returns/hears while live, and once expired)
_AT_DEADLINE: dict[str, tuple[Callable[[ExpiringCache], object], object, object]] = {
    "get": (lambda c: c.get("k", "gone"), "v", "gone"),
    "in": (lambda c: "k" in c, True, False),
    "len": (lambda c: len(c), 1, 0),
    "iter": (lambda c: list(c), ["k"], []),
    "statistics().size": (lambda c: c.statistics().size, 1, 0),
    "delete": (lambda c: c.delete("k"), True, False),
    "expire()": (lambda c: c.expire(), 0, 1),
    "put over it": (lambda c: c.put("k", "w"), None, None),
    "clear": (lambda c: c.clear(), None, None),
}
#: What on_evict hears from each op, while live and once expired.
_HEARD: dict[str, tuple[list[Heard], list[Heard]]] = {
    "get": ([], [("k", "v", EXPIRED)]),
    "delete": ([("k", "v", EXPLICIT)], [("k", "v", EXPIRED)]),
    "put over it": ([("k", "v", REPLACED)], [("k", "v", EXPIRED)]),
    "clear": ([("k", "v", EXPLICIT)], [("k", "v", EXPIRED)]),
    "expire()": ([], [("k", "v", EXPIRED)]),
}


@core
@rule("ttl-boundary", "ttl-delete", "ttl-put-over-expired", "clear", "expire")
@pytest.mark.parametrize("offset", [-1, 0, 1], ids=["deadline-1", "deadline", "deadline+1"])
@pytest.mark.parametrize("op", list(_AT_DEADLINE))
def test_stage1_ttl_every_path_at_the_deadline(op: str, offset: int) -> None:
    cache, clock, log = _boundary_cache()
    clock.set(START + TTL + offset)
    do, live, expired = _AT_DEADLINE[op]
    alive = offset < 0
    got = do(cache)
    want = live if alive else expired
    when = f"at deadline{offset:+d} ns" if offset else "at the deadline exactly"
    check(
        got == want,
        f"put('k', 'v') at t with ttl_ns={TTL}; {op} {when} must give {want!r} "
        f"(live iff now < t + ttl_ns); got {got!r}",
    )
    heard = log.take()
    expired_heard = [c for c in heard if c[2] is EXPIRED]
    if op in _HEARD:
        want_heard = _HEARD[op][0 if alive else 1]
        check(
            heard == want_heard,
            f"{op} {when}: on_evict must hear {want_heard} (an entry at or past "
            f"its deadline leaves as EXPIRED, a live one as EXPLICIT/REPLACED); heard {heard}",
        )
    else:  # an observation may reclaim the expired entry, as EXPIRED, at most once
        check(
            heard == expired_heard and len(heard) <= (0 if alive else 1),
            f"{op} {when} is an observation: it may only reclaim an expired entry "
            f"(EXPIRED, once); heard {heard}",
        )
    stats = cache.statistics()
    log.take()
    check(
        stats.expirations == (0 if alive else 1),
        f"{op} {when}: expirations must be {0 if alive else 1}; {stats}",
    )


@core
@rule("ttl-delete")
def test_stage1_ttl_delete_at_the_deadline() -> None:
    for offset in (-1, 0, 1):
        cache, clock, log = _boundary_cache()
        clock.set(START + TTL + offset)
        got = cache.delete("k")
        cause = EXPLICIT if offset < 0 else EXPIRED
        check(
            got is (offset < 0) and log.take() == [("k", "v", cause)],
            f"delete('k') at deadline{offset:+d} ns must return {offset < 0} and report "
            f"{cause.name} (live iff now < deadline; an expired entry leaves as EXPIRED); got "
            f"{got!r}, heard {log.taken}",
        )


@core
@rule("ttl-full-drops-expired", "ttl-boundary")
@pytest.mark.parametrize("offset", [-1, 0, 1], ids=["deadline-1", "deadline", "deadline+1"])
def test_stage1_ttl_a_full_cache_at_the_deadline(offset: int) -> None:
    cache, clock, log = _boundary_cache(maxsize=1)
    clock.set(START + TTL + offset)
    cache.put("new", "n")
    want = [("k", "v", EVICTED if offset < 0 else EXPIRED)]
    check(
        log.take() == want,
        f"a full TTLCache(1) holding k, put of another key at deadline{offset:+d}: "
        f"k must leave as {want[0][2].name} (expired entries go before live ones, and k is "
        f"expired from its deadline on); heard {log.taken}",
    )


@core
@rule("clear", "counters")
def test_stage1_ttl_clear_reports_expired_entries_as_expired() -> None:
    clock, log = ManualClock(START), Log()
    cache = make("TTLCache", 4, clock, ttl_ns=TTL, on_evict=log)
    cache.put("old", 1)
    clock.advance(TTL // 2)
    cache.put("live", 2)
    clock.advance(TTL // 2)  # old's deadline exactly
    cache.clear()
    heard = sorted(log.take(), key=lambda c: str(c[0]))
    check(
        heard == [("live", 2, EXPLICIT), ("old", 1, EXPIRED)],
        "clear() on a TTL cache reports an entry already expired as EXPIRED (its "
        f"time ran out before clear came) and a live one as EXPLICIT; heard {heard}",
    )
    stats = cache.statistics()
    check(
        (stats.expirations, stats.evictions, stats.size) == (1, 0, 0),
        f"after clear() the expired entry is counted in expirations: {stats}",
    )


#: What each call that must settle every expired entry returns, with 100 expired and 3
#: live: (the call, what it returns).
_SETTLES_ALL: dict[str, tuple[Callable[[ExpiringCache], object], object]] = {
    "clear()": (lambda c: c.clear(), None),
    "expire()": (lambda c: c.expire(), 100),
    "len()": (lambda c: len(c), 3),
    "statistics().size": (lambda c: c.statistics().size, 3),
}


@core
@rule("clear", "expire", "ttl-boundary", "counters")
@pytest.mark.parametrize("op", list(_SETTLES_ALL))
def test_stage1_ttl_every_expired_entry_is_settled_however_many(op: str) -> None:
    clock, log = ManualClock(START), Log()
    cache = make("TTLCache", 200, clock, on_evict=log)
    for n in range(100):
        cache.put(("old", n), n)
    clock.advance(TTL // 2)
    for n in range(3):
        cache.put(("live", n), n)
    clock.advance(TTL // 2)  # the 100 old ones expire now
    do, want = _SETTLES_ALL[op]
    got = do(cache)
    heard = log.take()
    expired = sum(c[2] is EXPIRED for c in heard)
    explicit = sum(c[2] is EXPLICIT for c in heard)
    steps = (
        f"TTLCache(200, ttl_ns={TTL}): 100 keys put at START, 3 at START + TTL/2; at "
        f"START + TTL (the 100 expire) {op}"
    )
    expect(got, want, f"{steps} returns {want!r}: every expired entry counts, however many")
    if op == "clear()":
        check(
            (expired, explicit) == (100, 3),
            f"{steps}: clear reports each of the 100 expired entries EXPIRED (their time ran "
            f"out before clear came) and the 3 live ones EXPLICIT; heard {expired} EXPIRED "
            f"and {explicit} EXPLICIT",
        )
    elif op == "expire()":
        check(expired == 100, f"{steps}: expire() reports all 100 EXPIRED; heard {expired}")
    stats = cache.statistics()
    expired += sum(c[2] is EXPIRED for c in log.take())
    size = 0 if op == "clear()" else 3
    check(
        stats.expirations == expired and stats.size == size,
        f"{steps}; then statistics(): expirations counts exactly the EXPIRED callbacks "
        f"({expired}) and size the live entries ({size}): {stats}",
    )


@core
@rule("expire", "counters")
def test_stage1_ttl_expire_counts_the_entries_that_went() -> None:
    clock, log = ManualClock(START), Log()
    cache = make("TTLCache", 10, clock, on_evict=log)
    steps = "put a, put a again, put b, delete b, put c, put d at START; at START + TTL get d"
    cache.put("a", 1)
    cache.put("a", 2)  # its first deadline is stale bookkeeping now
    cache.put("b", 3)
    cache.delete("b")  # so is b's
    cache.put("c", 4)
    cache.put("d", 5)
    clock.advance(TTL)
    cache.get("d")  # d goes here, lazily
    log.take()
    gone = cache.expire()
    heard = log.take()
    check(
        gone == 2 and sorted(heard) == [("a", 2, EXPIRED), ("c", 4, EXPIRED)],
        f"{steps}; then expire() reclaims a and c and returns how many went: 2 (not the "
        f"deadlines it looked at: a's old one, b's and d's went with their writes); got "
        f"expire() -> {gone}, heard {heard}",
    )
    again = cache.expire()
    check(again == 0, f"a second expire() finds nothing left: returns 0, got {again}")


def _expect_consistent(cases: list[tuple[str, bool]]) -> None:
    problems = [p for kind, weighted in cases for p in consistency_problems(kind, weighted)]
    check(
        not problems,
        "on_evict must run only once the cache is consistent again (the victim "
        "gone, within capacity):\n  " + "\n  ".join(problems),
    )


@core
@rule("callback-consistent")
def test_stage1_on_evict_sees_a_consistent_cache() -> None:
    _expect_consistent([("LRUCache", False), ("TTLCache", False)])


@extended
@rule("callback-consistent")
def test_stage1_on_evict_sees_a_consistent_cache_by_weight_and_in_lfu() -> None:
    _expect_consistent([("LFUCache", False)] + [(k, True) for k in ALL_KINDS])


@extended
@rule("callback-consistent", "heavy-evicts-many", "weight-update")
@pytest.mark.parametrize("kind", ALL_KINDS)
def test_stage1_a_put_reports_its_own_key_first_then_what_it_pushed_out(kind: str) -> None:
    cache, log = weighed_by_length(kind)
    cache.put("x", "aaaa")
    cache.put("y", "aaa")
    cache.put("k", "bb")  # weight 9 of 10
    cache.put("k", "b" * 9)  # 4 + 3 + 9 = 16: x and y must go
    expect(
        log.take(),
        [("k", "bb", REPLACED), ("x", "aaaa", EVICTED), ("y", "aaa", EVICTED)],
        f"{kind}(10, max_weight=10, weigh=len): put x 'aaaa', y 'aaa', k 'bb', then put('k', "
        f"'b' * 9). Within one put the key written is reported first (REPLACED), then what "
        f"the put pushed out, coldest first; the on_evict calls",
    )
    check(
        list(cache) == ["k"] and cache.statistics().weight == 9,
        f"{kind}: only k is left, weight 9: {list(cache)}, {cache.statistics()}",
    )


@extended
@rule("callback-consistent", "ttl-put-over-expired", "active-expiry")
def test_stage1_ttl_a_put_over_an_expired_key_reports_it_before_what_it_pushed_out() -> None:
    clock, log = ManualClock(START), Log()
    cache = make("TTLCache", 10, clock, max_weight=10, weigh=len, on_evict=log)
    cache.put("k", "bb")
    cache.put("old", "o")
    clock.advance(TTL // 2)
    cache.put("x", "aaaa")
    clock.advance(TTL // 2)  # k and old expire
    cache.put("k", "b" * 9)  # 9 + 4 = 13 once old is gone: x must go too
    expect(
        log.take(),
        [("k", "bb", EXPIRED), ("old", "o", EXPIRED), ("x", "aaaa", EVICTED)],
        f"TTLCache(10, ttl_ns={TTL}, max_weight=10, weigh=len): at START put k 'bb' and old "
        f"'o', at START + TTL/2 put x 'aaaa', at START + TTL put('k', 'b' * 9). The key "
        f"written is reported first (its old value EXPIRED), then what the put pushed out: "
        f"expired entries, then evictions; the on_evict calls",
    )


@extended
@rule("callback-consistent", "ttl-put-over-expired", "active-expiry")
@pytest.mark.parametrize("written", ["live", "expired"])
def test_stage1_ttl_a_put_reports_its_own_key_before_older_expired_entries(written: str) -> None:
    clock, log = ManualClock(START), Log()
    cache = make("TTLCache", 10, clock, on_evict=log)
    cache.put("old", "o")  # expires first
    clock.advance(1 if written == "expired" else TTL // 2)
    cache.put("k", "v1")
    clock.set(START + TTL + 1)  # old has expired; k too, if it was written at START + 1
    cache.put("k", "v2")  # room is plenty: only the bounded cleanup reclaims old
    own = ("k", "v1", EXPIRED if written == "expired" else REPLACED)
    allowed = [[own, ("old", "o", EXPIRED)]] + ([[own]] if written == "expired" else [])
    got = log.take()
    check(
        got in allowed,
        f"TTLCache(10, ttl_ns={TTL}): put old 'o' at START, k 'v1' at START + "
        f"{1 if written == 'expired' else TTL // 2}, then put('k', 'v2') at START + TTL + 1 "
        f"(old expired, k {written}). Within one put the key written is reported first, "
        f"before the expired entries its cleanup reclaims, even those that expired earlier: "
        f"expected one of {allowed} as the on_evict calls, got {got}",
    )


_BAD_PUT_WEIGHTS: list[tuple[Any, str]] = [
    (-1, "weigh"), (1.5, "weigh"), ("3", "weigh"), (True, "weigh"), (False, "weigh"),
    (11, "max_weight"),
]  # fmt: skip


@extended
@rule("put-weight")
def test_stage1_a_weight_given_to_put_is_validated_like_weighs() -> None:
    for kind in ALL_KINDS:
        for weight, names in _BAD_PUT_WEIGHTS:
            _check_put_weight(kind, weight, names)


def _check_put_weight(kind: str, weight: Any, names: str) -> None:
    weighed: list[object] = []
    log = Log()

    def weigh(value: object) -> int:
        weighed.append(value)
        return 1

    cache = make(kind, 10, max_weight=10, weigh=weigh, on_evict=log)
    cache.put("a", "x")
    weighed.clear()
    for key in ("a", "b"):  # an existing key, and a new one
        try:
            cache.put(key, "y", weight=weight)
        except ValueError as e:
            check(names in str(e), f"{kind}: the ValueError must name {names}: {e!r}")
        else:
            raise AssertionError(
                f"{kind}(10, max_weight=10).put({key!r}, 'y', weight={weight!r}) must "
                f"raise ValueError naming {names}: a weight given to put is validated like "
                f"weigh's result"
            )
    check(
        log.calls == [] and list(cache) == ["a"] and cache.statistics().weight == 1,
        f"{kind}: a refused weight={weight!r} changes nothing: heard {log.calls}, "
        f"keys {list(cache)}, {cache.statistics()}",
    )
    cache.put("f", "ffff", weight=5)
    check(
        weighed == [] and cache.statistics().weight == 6,
        f"{kind}: put('f', 'ffff', weight=5) takes the weight given (total 1 + 5 = 6) "
        f"and does not call weigh; weigh saw {weighed}, {cache.statistics()}",
    )


@core
@rule("capacity", "ttl-boundary")
@pytest.mark.parametrize("kind", ["LRUCache", "TTLCache"])
def test_stage1_the_properties_say_how_the_cache_was_built(kind: str) -> None:
    clock = ManualClock(START)
    cache = make(kind, 3, clock, ttl_ns=7 * TTL) if kind == "TTLCache" else make(kind, 3)
    got = (cache.maxsize, cache.max_weight, cache.weigh)
    check(
        got == (3, None, None),
        f"{kind}(3) without weights: maxsize 3, max_weight None, weigh None (every entry "
        f"weighs 1); got (maxsize, max_weight, weigh) = {got}",
    )
    for n in range(cache.maxsize + 1):
        cache.put(n, n)
    check(len(cache) == 3, f"{kind}(3) holds maxsize = 3 entries: {list(cache)}")
    if kind == "TTLCache":
        expiring = cast(ExpiringCache, cache)  # make("TTLCache") built it
        check(expiring.ttl_ns == 7 * TTL, f"ttl_ns is the one given, {7 * TTL}: {expiring.ttl_ns}")
        expiring.put("k", "v")
        clock.advance(expiring.ttl_ns - 1)
        alive = "k" in expiring
        clock.advance(1)
        check(
            alive and "k" not in expiring,
            f"an entry lives exactly ttl_ns = {expiring.ttl_ns}: live 1 ns before, gone at it",
        )


@extended
@rule("weight-capacity", "weigh-needs-max-weight")
@pytest.mark.parametrize("kind", ALL_KINDS)
def test_stage1_the_weight_properties_are_the_ones_given(kind: str) -> None:
    def weigh(value: str) -> int:
        return len(value)

    cache = make(kind, 10, max_weight=8, weigh=weigh)
    got = (cache.maxsize, cache.max_weight, cache.weigh)
    check(
        got == (10, 8, weigh),
        f"{kind}(10, max_weight=8, weigh=weigh): the read-only properties give back what "
        f"was given (stage 2 weighs with cache.weigh before it takes its lock); got "
        f"(maxsize, max_weight, weigh) = {got}",
    )
    counted = make(kind, 10, max_weight=8)
    unweighed = (counted.max_weight, counted.weigh)
    check(
        unweighed == (8, None),
        f"{kind}(10, max_weight=8) without weigh: max_weight 8, weigh None (every entry "
        f"weighs 1); got {unweighed}",
    )
    for n in range(9):
        counted.put(n, "v")
    check(len(counted) == 8, f"{kind}: max_weight=8 of weight 1 each holds 8: {list(counted)}")


@extended
@rule("put-weight")
@pytest.mark.parametrize("kind", ALL_KINDS)
def test_stage1_without_max_weight_a_weight_is_ignored(kind: str) -> None:
    # Ignored, not validated: weights that would be refused with a max_weight too.
    weights: tuple[Any, ...] = (7, -1, 1.5, 10**9)
    for weight in weights:
        cache = make(kind, 2)
        steps = f"{kind}(2): put('a', 1, weight={weight!r}), put('b', 2, weight={weight!r})"
        with not_refused(f"{steps}: without max_weight, weight= is ignored, not validated"):
            cache.put("a", 1, weight=weight)
            cache.put("b", 2, weight=weight)
        stats = cache.statistics()
        check(
            (stats.size, stats.weight) == (2, 2) and list(cache) == ["a", "b"],
            f"{steps}; without max_weight every entry weighs 1 (weight= is ignored): {stats}",
        )


@extended
@rule("put-weight", "weight-capacity", "stats")
@pytest.mark.parametrize("kind", ALL_KINDS)
def test_stage1_with_max_weight_and_no_weigh_a_weight_given_counts(kind: str) -> None:
    """``weigh`` defaults to 1 per entry, yet a weight given to ``put`` is the weight
    computed beforehand: it bounds the cache and is what ``statistics()`` sums."""
    cache = make(kind, 10, max_weight=10)
    cache.put("a", "x", weight=6)
    cache.put("b", "y", weight=3)
    steps = f"{kind}(10, max_weight=10) without weigh: put('a', weight=6), put('b', weight=3)"
    stats = cache.statistics()
    check(
        (stats.size, stats.weight) == (2, 9),
        f"{steps}: the weights given are the entries' weights, size 2 and weight 9; got {stats}",
    )
    cache.put("c", "z", weight=4)
    stats = cache.statistics()
    check(
        sorted(cache) == ["b", "c"] and stats.weight == 7,
        f"{steps}, put('c', weight=4): 13 > max_weight 10, so 'a' (least recently used, "
        f"weight 6) is evicted and 7 remain; got keys {sorted(cache)}, {stats}",
    )


@core
@rule("on-evict-attribute")
@pytest.mark.parametrize("kind", ALL_KINDS)
def test_stage1_on_evict_can_be_assigned_later(kind: str) -> None:
    cache, log = make(kind, 1), Log()
    cache.put("a", 1)
    cache.on_evict = log
    cache.put("b", 2)
    cache.put("b", 3)
    cache.delete("b")
    check(
        log.take() == [("a", 1, EVICTED), ("b", 2, REPLACED), ("b", 3, EXPLICIT)],
        f"on_evict is a plain attribute read at each removal: a callback assigned "
        f"after the cache was built hears every later removal; heard {log.taken}",
    )
    cache.on_evict = None
    cache.put("c", 1)
    cache.put("d", 1)
    check(log.calls == [], f"on_evict = None silences it; heard {log.calls}")


@extended
@rule("lfu-frequency")
def test_stage1_lfu_a_key_that_comes_back_starts_at_one() -> None:
    cache = make("LFUCache", 2)
    cache.put("a", 1)
    for _ in range(3):
        cache.get("a")
    cache.put("a", 2)
    check(cache.frequency("a") == 5, f"1 + 3 hits + 1 update: {cache.frequency('a')}")
    check(cache.frequency("zz") == 0, "frequency of a key not held is 0")
    cache.delete("a")
    check(cache.frequency("a") == 0, "a deleted key has frequency 0")
    cache.put("a", 3)
    check(
        cache.frequency("a") == 1,
        f"a key that leaves and comes back starts again at 1; got {cache.frequency('a')}",
    )
    cache.put("b", 1)
    cache.get("b")
    cache.put("c", 1)  # a (1) is the victim, not b (2)
    check(
        list(cache) == ["c", "b"],
        f"a's old count is forgotten, so a (frequency 1) was evicted: {list(cache)}",
    )


@extended
@rule("bounded-memory", "ttl-boundary", "expire")
def test_stage1_ttl_expiry_stays_exact_with_far_more_stale_deadlines_than_entries() -> None:
    """Ten keys written 1 ns apart and then read in the reverse order (so recency order is
    the reverse of deadline order), then one hot key updated 20 000 times: 19 999 stale
    deadlines behind 11 live entries. The bookkeeping must be reclaimed (memory bounded by
    capacity) and expiry must stay exact, at each of the ten deadlines, for the keys
    written before all that."""
    import tracemalloc

    clock, log = ManualClock(START), Log()
    ttl = TTL * 100
    cache = make("TTLCache", 11, clock, ttl_ns=ttl)
    for n in range(10):
        clock.set(START + n)
        cache.put(n, n)  # deadline START + n + ttl
    for n in reversed(range(10)):
        cache.get(n)  # least recently used first: 9, 8, ..., 0 — deadlines in reverse
    clock.set(START + 10)
    for n in range(200):
        cache.put("hot", n)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for n in range(200, 20_000):
            cache.put("hot", n)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    check(
        grown < 256 * 1024,
        f"20 000 updates of one key grew the cache's memory by {grown // 1024} KiB: "
        "the stale deadlines of updated keys must be reclaimed (in proportion to the live "
        "entries), not kept until they expire",
    )
    cache.on_evict = log
    steps = (
        f"TTLCache(11, ttl_ns={ttl}): put key n at START + n for n = 0..9; get 9, 8, ..., 0; "
        "put('hot', ...) 20 000 times at START + 10"
    )
    for n in range(10):
        clock.set(START + n + ttl - 1)
        live = (cache.expire(), len(cache))
        check(
            live == (0, 11 - n),
            f"{steps}. 1 ns before key {n}'s deadline, keys {n}..9 and 'hot' are live: "
            f"expected expire() -> 0 and len {11 - n}, got {live}",
        )
        clock.set(START + n + ttl)
        gone = (cache.expire(), len(cache), cache.statistics().expirations)
        check(
            gone == (1, 10 - n, n + 1),
            f"{steps}. At key {n}'s deadline exactly it expires: expected expire() -> 1, "
            f"len {10 - n}, expirations {n + 1}; got {gone} (keys {list(cache)}) — the "
            "deadline bookkeeping lost its order while it reclaimed the stale deadlines",
        )
    heard = [k for k, _, c in log.take() if c is EXPIRED]
    check(heard == list(range(10)), f"EXPIRED heard for 0..9 in order; heard {heard}")
    check(list(cache) == ["hot"], f"only 'hot' is left: {list(cache)}")


# --------------------------------------------------------------------- the model tests


_MODEL_RULES = (
    "capacity", "lru-order", "iteration-order", "writer-not-victim", "update-not-insert",
    "delete", "no-ghosts", "counters", "stats", "pure-observations",
)  # fmt: skip
_TTL_RULES = ("ttl-boundary", "ttl-lru", "ttl-update", "ttl-delete", "ttl-put-over-expired",
              "ttl-full-drops-expired")  # fmt: skip
_WEIGHT_RULES = ("weight-capacity", "weight-update", "heavy-evicts-many", "oversize")
_LFU_RULES = ("lfu-victim", "lfu-frequency")
lru_rules = pytest.mark.rule(*_MODEL_RULES)
ttl_rules = pytest.mark.rule(*_MODEL_RULES, *_TTL_RULES)
weight_rules = pytest.mark.rule(*_WEIGHT_RULES)
lfu_rules = pytest.mark.rule(*_MODEL_RULES, *_LFU_RULES)


TestStage1LRUMatchesTheModel = core(lru_rules(model_test("LRUCache", False)))
TestStage1TTLMatchesTheModel = core(ttl_rules(model_test("TTLCache", False)))
TestStage1WeightedLRUMatchesTheModel = extended(
    weight_rules(lru_rules(model_test("LRUCache", True)))
)
TestStage1WeightedTTLMatchesTheModel = extended(
    weight_rules(ttl_rules(model_test("TTLCache", True)))
)
TestStage1LFUMatchesTheModel = extended(lfu_rules(model_test("LFUCache", False)))
TestStage1WeightedLFUMatchesTheModel = extended(
    weight_rules(lfu_rules(model_test("LFUCache", True)))
)
for _case in (
    TestStage1LRUMatchesTheModel, TestStage1TTLMatchesTheModel,
    TestStage1WeightedLRUMatchesTheModel, TestStage1WeightedTTLMatchesTheModel,
    TestStage1LFUMatchesTheModel, TestStage1WeightedLFUMatchesTheModel,
):  # fmt: skip
    _case.settings = settings(stateful_step_count=40)
del _case  # a module-level TestCase name would be collected a second time
