"""Stage 2 suite, the edges: what the wrappers must keep of the cache they wrap, and the
corners of a flight (see katas/kv_cache/README.md).

- The wrapper is transparent: side by side with the bare stage-1 cache (``Mirror``,
  ``_testing/flights.py``), a bad key, a value too heavy and a bad weight raise as the
  stage-1 cache raises them and change nothing; weights — none given, or zero — come out
  as the stage-1 cache counts them, and ``weigh`` stays outside the lock whatever it
  returns (exact-under-threads, no-user-code-under-lock).
- A flight's corners, threads and tasks alike: a falsy loaded value reaches every waiter,
  and a waiter waits for a load that outlasts any timeout it could pick — its timed waits
  end at once (``_testing/timeouts.py``), no real time passes (single-flight); a write
  makes only its own key's load stale (write-beats-load); a loader may load other keys,
  never its own at any depth (load-reentrant); however a load ends — cached, too heavy,
  written over, failed — the next miss loads again (flight-unregistered).
- Races forced in a call's gaps (``_testing/races.py``): a lazily iterated stage-1 cache
  changed between two items (one-lock); a leader stopped after each lock section it
  leaves, where the counts are read, and before each count it writes back, where another
  key's load runs through (statistics); a write stopped after its lock section, where
  the load it beats lands (write-beats-load).
- Who hands on a removal (``_testing/handing.py``): the call that caused it, whichever
  it is — a miss that found its own key expired (its callback may ask for the key, or
  fail, and the load is never left in flight), a call refused by raising, a look (``in``,
  iteration) over a stage-1 TTL cache that reclaims while it looks
  (no-user-code-under-lock).
- Async: waiters of a load that is not cached (too heavy, or written over) still get its
  value; a ``weigh`` that raises fails the flight for every caller and frees the key; a
  refused reentrant call leaves no waiter; every call hands on the removals it caused,
  the landing of a load included.

Time and faults: loaders block on events the test releases once ``load_statistics()``
shows every caller waiting; a caller that can no longer be woken (its flight still
registered once its leader is done) is given up at once; every wait has a hard deadline.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import cast

import anyio
import pytest

from katas._harness.marks import anyio_test, core, extended, rule
from katas._harness.story import check
from katas._harness.under_test import stage
from katas._harness.waiting import DEADLINE_S, eventually, eventually_async, spawn
from katas.kv_cache._testing.caches import (
    EXPIRED,
    START,
    TTL,
    Log,
    async_cache,
    concurrent,
    fail_fast_on_stage2_stubs,  # noqa: F401 (autouse)
    lru,
    wrap,
)
from katas.kv_cache._testing.flights import (
    STRANDED,
    UNHASHABLE,
    WRAPPERS,
    Mirror,
    Wrapped,
    async_flight,
    bare_load,
    caught,
    load,
    load_by,
    promptly,
    thread_flight,
    weigh_refusing_bad,
)
from katas.kv_cache._testing.handing import ThreadLog, expired_ttl, reclaiming_ttl
from katas.kv_cache._testing.loaders import AsyncLoader, Loader, racing_tasks
from katas.kv_cache._testing.locks import (
    GRACE_S,
    PROMPTLY_S,
    loading,
    loads,
    stats_now,
    write_meanwhile,
)
from katas.kv_cache._testing.races import (
    LazilyIterated,
    landing_in_the_gaps_of,
    leader_raced_in_its_gaps,
)
from katas.kv_cache._testing.timeouts import TimeFlies
from katas.kv_cache.api import (
    AsyncLoadingCache,
    EvictingCache,
    LoadingCache,
    LoadStatistics,
    ManualClock,
    RemovalCause,
)

pytestmark = [pytest.mark.stage(2)]


#: What the bare stage-1 cache refuses — a key it cannot hold, on every entry point, a
#: value too heavy, a bad weight — and the parameter its error names: the wrapper's call
#: (a miss of get_or_load being the bare cache's get) must refuse it alike.
_REFUSED: dict[str, tuple[Callable[[Wrapped], object], Callable[[EvictingCache], object], str]] = {
    "get": (lambda c: c.get(UNHASHABLE), lambda b: b.get(UNHASHABLE), "key"),
    "put": (lambda c: c.put(UNHASHABLE, "v"), lambda b: b.put(UNHASHABLE, "v"), "key"),
    "delete": (lambda c: c.delete(UNHASHABLE), lambda b: b.delete(UNHASHABLE), "key"),
    "in": (lambda c: UNHASHABLE in c, lambda b: UNHASHABLE in b, "key"),
    "get_or_load": (
        lambda c: load(c, UNHASHABLE, "v"),
        lambda b: bare_load(b, UNHASHABLE, "v"),
        "key",
    ),
    "too-heavy": (lambda c: c.put("k", "x" * 6), lambda b: b.put("k", "x" * 6), "max_weight"),
    "bad-weight": (lambda c: c.put("k", "bad"), lambda b: b.put("k", "bad"), "weigh"),
}


@core
@rule("exact-under-threads")
@pytest.mark.parametrize("case", list(_REFUSED))
@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_stage2_the_wrapper_refuses_what_the_stage1_cache_refuses(wrapper: str, case: str) -> None:
    """Every stage-1 rule holds through the wrapper, its refusals too: an unhashable key
    on every entry point, a value heavier than max_weight, a bad weight — each raises what
    the bare cache raises, naming the same parameter, and changes nothing."""
    wrapped, bare, names = _REFUSED[case]
    mirror = Mirror(wrapper, 4, max_weight=5, weigh=weigh_refusing_bad)
    mirror.put("k", "old")
    mirror.put("a", "xy")
    got, want = mirror.both(case, wrapped, bare)
    check(
        isinstance(want, Exception) and type(got) is type(want) and names in str(got),
        f"{wrapper} over LRUCache(4, max_weight=5, weigh=len, 'bad' weighing -1): {case} "
        f"must raise as the stage-1 cache does — {type(want).__name__} naming {names!r} "
        f"({want}); got {got!r}",
    )
    differs = mirror.differs()
    check(not differs, f"{wrapper}: a refused {case} changes nothing — {differs}")


#: The weights a wrapper may be given: none at all, a capacity without a weigher (every
#: entry weighs 1), a weigher (some values weigh 0).
_WEIGHTS: dict[str, dict[str, object]] = {
    "counted": {},
    "max_weight-only": {"max_weight": 3},
    "weighed": {"max_weight": 6, "weigh": len},
}


@core
@rule("exact-under-threads")
@pytest.mark.parametrize("weights", list(_WEIGHTS))
@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_stage2_the_wrapper_weighs_as_the_stage1_cache_does(wrapper: str, weights: str) -> None:
    """Puts and loads through the wrapper and the same calls on the bare cache: keys,
    statistics (weight included) and removals stay the same after every call."""
    mirror = Mirror(wrapper, 10, **_WEIGHTS[weights])
    steps: list[tuple[str, str, str]] = [
        ("put", "a", "x"),
        ("put", "b", ""),
        ("load", "c", "xyz"),
        ("put", "d", "xy"),
        ("load", "e", ""),
        ("load", "b", "not loaded"),
        ("put", "c", "x"),
        ("load", "f", "xyzw"),
        ("put", "g", "x"),
    ]
    for what, key, value in steps:
        got = mirror.put(key, value) if what == "put" else mirror.load(key, value)
        differs = mirror.differs() or ("" if got[0] == got[1] else f"returned {got}")
        check(
            not differs,
            f"{wrapper} over LRUCache(10, {weights}): the wrapper weighs each value as the "
            f"stage-1 cache does (each entry weighs 1 without weigh) — {differs}",
        )


@core
@rule("no-user-code-under-lock")
def test_stage2_weigh_runs_outside_the_lock_whatever_weight_it_gives() -> None:
    """A value may weigh 0: that is a weight like any other, passed on, never weighed
    again by the inner cache under the lock — on put and on get_or_load alike."""
    blocked: list[str] = []

    def weigh(value: str) -> int:
        if stats_now(cache) is None:  # load_statistics() from another thread: the lock
            blocked.append(f"weigh({value!r})")
        return len(value)

    cache = concurrent(4, max_weight=10, weigh=weigh)
    cache.put("empty", "")
    cache.put("full", "abc")
    cache.get_or_load("loaded empty", lambda: "")
    cache.get_or_load("loaded full", lambda: "xyz")
    check(
        not blocked and len(cache) == 4,
        f"weigh (len) ran while the cache's lock was held: {blocked} — weigh each value "
        f"before taking the lock and hand its weight to the inner put, a weight of 0 "
        f"too; {len(cache)} of 4 keys held",
    )


@core
@rule("single-flight", "load-hit")
@pytest.mark.parametrize("value", [None, 0, "", False, []], ids=repr)
def test_stage2_every_caller_of_a_flight_gets_a_falsy_loaded_value(value: object) -> None:
    cache = concurrent()
    loader = Loader(lambda n: value)
    got = thread_flight(cache, loader, 2)
    check(
        all(g is value for g in got) and cache.get("k", "MISS") is value,
        f"a leader and 2 waiters of one load that returns {value!r}: each receives that very "
        f"object (a falsy value is a value, not a missing one), and it is cached; they got "
        f"{got}, the cache holds {cache.get('k', 'MISS')!r}",
    )


@core
@rule("single-flight")
def test_stage2_a_waiter_waits_for_the_load_however_long_it_lasts() -> None:
    """A load may last longer than any timeout a waiter could pick. The leader's load is
    held open; its 3 waiters find every timed wait they make end at once, as if the load
    had outlasted it (``TimeFlies``, ``_testing/timeouts.py``). Once each sleeps (or
    has returned), the load lands: they all waited for it, and got its very object."""
    cache, loader = concurrent(), Loader()
    call = lambda: caught(lambda: cache.get_or_load("k", loader))  # noqa: E731
    leader = spawn(call, "leader")
    loading(cache, loader)
    with TimeFlies() as flies:
        for i in range(3):
            flies.spawn(call, f"waiter-{i}")
        eventually(  # (a waiter that returns while the load is held has not waited)
            lambda: loads(cache).waiters == 3 or not all(t.is_alive() for t in flies.threads),
            "3 callers waiting for the load",
        )
        flies.settle()
        early = loader.calls
        loader.release.set()
        got = [t.outcome("a caller of the flight returns") for t in [leader, *flies.threads]]
    check(
        loader.calls == 1 and all(g is got[0] for g in got) and cache.get("k") is got[0],
        "steps: a load of 'k' is held open; 3 more callers miss 'k' and join its flight; "
        "for them, every timed wait ends at once (the load outlasts any timeout); then the "
        "load lands. Single flight: a waiter waits for its flight however long the load "
        "lasts — one that gives up and loads 'k' itself calls the backend again and returns "
        "another object; one that gives up and raises fails a load that succeeded. "
        f"Expected 1 loader call and one object for all 4 callers, cached; "
        f"got {loader.calls} loader calls ({early} before the load landed), the leader and "
        f"waiters got {got}, the cache holds {cache.get('k')!r}; timed waits cut short in "
        f"{flies.cut_short or 'no waiter'}",
    )


@core
@rule("write-beats-load", "single-flight")
@pytest.mark.parametrize("write", ["put", "delete"])
def test_stage2_a_write_makes_only_its_own_keys_load_stale(write: str) -> None:
    """Loads of 'k' and 'j' in flight; 'j' and an unrelated key are written meanwhile:
    'j''s load is stale, 'k''s is cached all the same."""
    cache = concurrent()
    load_k, load_j = Loader(lambda n: ["k loaded"]), Loader(lambda n: ["j loaded"])
    leaders = [spawn(lambda: cache.get_or_load("k", load_k), "leader of k")]
    loading(cache, load_k)
    leaders.append(spawn(lambda: cache.get_or_load("j", load_j), "leader of j"))
    loading(cache, load_j)
    for key in ("j", "other"):
        cache.put(key, "written meanwhile") if write == "put" else cache.delete(key)
    load_k.release.set()
    load_j.release.set()
    got_k, got_j = (t.outcome("a leader returns") for t in leaders)
    held = cache.get("k"), cache.get("j")
    want_j = "written meanwhile" if write == "put" else None
    check(
        held[0] is got_k and held[1] == want_j and got_j == ["j loaded"],
        f"loads of 'k' and 'j' in flight, a {write} of 'j' and of 'other' meanwhile: only "
        f"'j''s load is stale — 'k' caches {got_k!r}, 'j' keeps the {write} ({want_j!r}); "
        f"the cache holds k={held[0]!r}, j={held[1]!r}",
    )


@core
@rule("load-reentrant", "load-error")
def test_stage2_a_loader_may_load_other_keys_but_never_its_own() -> None:
    cache = concurrent()
    cache.put("cached", "hit")

    def load_doc() -> object:  # a document loads its chunk, and reads a cached key
        if stats_now(cache) is None:  # under the lock: a call on the cache never returns
            return "a loader that ran under the cache's lock"
        return ("doc", cache.get_or_load("chunk", lambda: "chunk"),
                cache.get_or_load("cached", lambda: "not a hit"))  # fmt: skip

    def load_a() -> object:  # a's loader loads b, whose loader asks for a
        return cache.get_or_load("b", lambda: cache.get_or_load("a", lambda: "inner a"))

    doc = promptly(cache, "doc", load_doc)
    check(
        doc == ("doc", "chunk", "hit") and cache.get("chunk") == "chunk",
        "the loader of 'doc' calls get_or_load('chunk') and get_or_load('cached'): only a "
        "loader asking for its own key is refused, another key loads (or hits) as from "
        f"anywhere; got {doc!r}, chunk cached: {cache.get('chunk')!r}",
    )
    cycle = promptly(cache, "a", load_a)
    check(
        isinstance(cycle, RuntimeError)
        and (loads(cache).in_flight, loads(cache).waiters) == (0, 0),
        "the loader of 'a' loads 'b', whose loader asks for 'a' in the same thread: it would "
        f"wait for itself — RuntimeError, and both loads fail; got {cycle!r}, {loads(cache)}",
    )
    again = cache.get_or_load("a", lambda: "a"), cache.get_or_load("b", lambda: "b")
    check(again == ("a", "b"), f"after the refusal both keys load again; got {again}")


#: Another thread's call between two items of an iteration, each one changing the LRU
#: cache that holds a, b and c.
_MID_ITERATION: dict[str, Callable[[LoadingCache], object]] = {
    "get": lambda c: c.get("a"),
    "put": lambda c: c.put("d", "d"),
    "delete": lambda c: c.delete("b"),
    "clear": lambda c: c.clear(),
}


@core
@rule("one-lock")
@pytest.mark.parametrize("call", list(_MID_ITERATION))
def test_stage2_iteration_walks_the_inner_cache_under_the_lock_even_a_lazy_one(
    call: str,
) -> None:
    """A stage-1 cache may iterate lazily (a generator over its dict): the wrapper walks
    it whole under the lock, and hands out what it read, so another thread's call between
    two items changes nothing of what the iteration yields."""
    inner = LazilyIterated(lru(16))
    cache = wrap(inner)
    for key in "abc":
        cache.put(key, key)
    keys = iter(cache)
    first = caught(lambda: next(keys))
    other = spawn(lambda: _MID_ITERATION[call](cache), f"{call} from another thread")
    # Done in microseconds; one that waits for a lock held between items is judged by
    # test_stage2_an_iterator_holds_no_lock_between_its_items: the rest frees it here.
    other.join(GRACE_S)
    rest = caught(lambda: list(keys))
    other.outcome(f"the {call} from another thread")
    check(
        (first, rest) == ("a", ["b", "c"]),
        f"over a stage-1 LRUCache holding a, b, c whose iteration is lazy: iter(cache), one "
        f"item, then another thread's {call}, then the rest. Every walk of the inner cache "
        f"holds the lock, none while another thread's call is in progress: the iteration "
        f"yields a, b, c, all read at once under the lock; got {first!r}, then {rest!r}",
    )


@core
@rule("statistics", "exact-under-threads")
def test_stage2_load_statistics_count_every_load_whatever_runs_in_a_leaders_gaps() -> None:
    """A leader whose load fails stops right after each lock section it leaves, where
    load_statistics() is read; once its flight is registered, it also stops before
    writing back any count it read, while another key's failing load runs through. Every
    load started is counted from the step that registers it, and no count is lost."""
    cache = concurrent()
    boom = RuntimeError("model server 503")

    def failing() -> object:
        raise boom

    def racer(n: int) -> object:
        return caught(lambda: cache.get_or_load(f"racer {n}", failing))

    got, seen, racers = leader_raced_in_its_gaps(cache, "k", failing, racer)
    torn = [s for s in seen if s.loads != s.in_flight + s.failures]
    check(
        got is boom and not torn,
        "a load of 'k' that fails, other keys' failing loads racing it: whenever the leader "
        "leaves a lock section, every load started is either in flight or failed (none "
        "lands), so loads = in_flight + failures — a load is counted in the step that "
        f"registers its flight; got {got!r}, and in its gaps {torn}",
    )
    want = LoadStatistics(1 + len(racers), 1 + len(racers), 0, 0)
    check(
        loads(cache) == want,
        f"a failing load of 'k', and {len(racers)} failing loads of other keys run while "
        f"its leader stood between reading a count and writing it back: every count is "
        f"exact under racing threads — expected {want}, got {loads(cache)}",
    )


@core
@rule("write-beats-load")
@pytest.mark.parametrize("write", ["put", "delete", "clear"])
def test_stage2_a_write_beats_a_load_that_lands_right_after_it(write: str) -> None:
    """A load of 'k' is in flight; a write of 'k' stops right after each lock section it
    leaves, and the load lands then, whole. The write was made while the load ran: it
    wins, whichever of its steps the landing followed."""
    cache, loader = concurrent(), Loader(lambda n: ["loaded (stale)"])
    leader = spawn(lambda: cache.get_or_load("k", loader), "leader")
    loading(cache, loader)
    landing_in_the_gaps_of(cache, loader, leader, lambda: write_meanwhile(cache, write), write)
    loaded = leader.outcome("the leader returns")
    want = "written meanwhile" if write == "put" else None
    held = cache.get("k")
    check(
        loaded == ["loaded (stale)"] and held == want,
        f"a load of 'k' in flight; {write} of 'k', and the load landing right after the "
        f"{write}'s lock section: the {write} is newer than the load, so the loaded value "
        f"goes to its caller but is not cached over it — marking the load stale is part of "
        f"the write's one step; the leader got {loaded!r}, the cache holds {held!r} "
        f"(expected {want!r})",
    )


def _weigh_refusing_unweighable(value: str) -> int:
    if value == "unweighable":
        raise ValueError("cannot weigh this")
    return len(value)


def _failing_load(cache: Wrapped) -> object:
    raise RuntimeError("model server 503")


def _deleting_its_key(cache: Wrapped) -> object:
    """A loader that deletes 'k' while it loads it — unless it runs under the cache's
    lock, where its delete would wait for ever."""
    if stats_now(cast(LoadingCache, cache)) is None:
        return "a loader that ran under the cache's lock"
    cache.delete("k")
    return "loaded"


#: Every way a load of 'k' ends — its value cached, not cached (too heavy, or written
#: over while it ran), or failed (the loader raised, or weigh did) — as the inner LRU
#: cache's keywords and what the loader does, given the cache.
_ENDINGS: dict[str, tuple[dict[str, object], Callable[[Wrapped], object]]] = {
    "cached": ({}, lambda c: "loaded"),
    "too-heavy": ({"max_weight": 5, "weigh": len}, lambda c: "x" * 10),
    "written-over": ({}, _deleting_its_key),
    "loader-raised": ({}, _failing_load),
    "weigh-raised": (
        {"max_weight": 20, "weigh": _weigh_refusing_unweighable},
        lambda c: "unweighable",
    ),
}


@core
@rule("flight-unregistered", "load-too-heavy", "statistics")
@pytest.mark.parametrize("ending", list(_ENDINGS))
@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_stage2_however_a_load_ends_the_next_miss_loads_again(wrapper: str, ending: str) -> None:
    """A load of 'k' ends — cached, not cached, or failed — and 'k' is missing again (a
    cached value deleted): nothing is in flight any more, and the next miss of 'k' calls
    its loader, on either wrapper."""
    kw, loader = _ENDINGS[ending]
    cache: Wrapped = getattr(stage(2), wrapper)(lru(4, **kw))
    first = caught(lambda: load_by(cache, "k", lambda: loader(cache)))
    if ending == "cached":
        cache.delete("k")
    stats = loads(cache)
    check(
        (stats.in_flight, stats.waiters, "k" in cache) == (0, 0, False),
        f"{wrapper}: a load of 'k' ended ({ending}: got {first!r}) and 'k' is not cached: "
        f"a finished flight is gone — nothing in flight, nobody waiting; got {stats}, "
        f"'k' cached: {'k' in cache}",
    )
    again = caught(lambda: load_by(cache, "k", lambda: "loaded again"))
    check(
        again == "loaded again" and loads(cache).loads == 2,
        f"{wrapper}: after a load of 'k' ended ({ending}), the next miss of 'k' loads "
        f"again — it neither gets the old flight's outcome nor waits for it; got {again!r}, "
        f"{loads(cache)}",
    )


#: What ``on_evict`` does on hearing that 'k', the key its own miss found expired, is
#: gone: asks for 'k' from another thread, asks for it from its own thread, or fails.
_ON_ITS_OWN_EXPIRY = {
    "other-thread": "it asks for 'k' from another thread",
    "same-thread": "it asks for 'k' from its own thread",
    "raises": "it raises",
}


@core
@rule("no-user-code-under-lock", "flight-unregistered")
@pytest.mark.parametrize("callback", list(_ON_ITS_OWN_EXPIRY))
def test_stage2_a_miss_hands_on_its_keys_expiry_without_holding_up_the_key(callback: str) -> None:
    """get_or_load('k') finds 'k' expired: the EXPIRED its miss caused is handed on by
    that call, outside the lock, and the callback may use the cache — ask for 'k' from
    another thread (which must not block), from its own thread (it is inside no loader),
    or raise. Whatever it does, the load of 'k' is never left in flight."""
    asked: list[object] = []

    def then(key: object, cause: RemovalCause) -> None:
        if (key, cause) != ("k", EXPIRED):
            return
        if callback == "raises":
            raise OSError("callback failed")

        def ask() -> object:
            return caught(lambda: cache.get_or_load("k", lambda: "callback's load"))

        if callback == "same-thread":
            asked.append(ask())
            return
        other = spawn(ask, "another thread")
        other.join(PROMPTLY_S)  # a call that waits for no other thread returns at once
        asked.append(STRANDED if other.is_alive() else other.result)

    cache, _ = expired_ttl(ThreadLog(then))
    outer = spawn(lambda: caught(lambda: cache.get_or_load("k", lambda: "loaded")), "outer")
    got = outer.outcome("get_or_load('k') returns")
    stats = loads(cache)
    ok = got == "loaded" or (callback == "raises" and isinstance(got, OSError))
    answered = callback == "raises" or (
        len(asked) == 1 and asked[0] != STRANDED and not isinstance(asked[0], Exception)
    )
    check(
        ok and answered and (stats.in_flight, stats.waiters) == (0, 0),
        f"steps: 'k' put, then expired; get_or_load('k') misses it (the TTL cache reports "
        f"it EXPIRED) and loads 'loaded'; on_evict for that EXPIRED: "
        f"{_ON_ITS_OWN_EXPIRY[callback]}. The "
        f"callback runs after the lock is released, by the call that caused it, and may use "
        f"the cache — one that asks for 'k' from another thread must not block, one in its "
        f"own thread is inside no loader — and however it ends, no load of 'k' is left in "
        f"flight. Expected 'loaded' (or, the callback raising, its OSError), the callback's "
        f"call answered, nothing in flight; got {got!r}, the callback's call got {asked}, "
        f"{stats}",
    )
    again = promptly(cache, "k", lambda: "loaded again")
    check(
        again in ("loaded", "loaded again"),
        f"after that, get_or_load('k') hits or loads again; got {again!r}",
    )


@core
@rule("no-user-code-under-lock", "load-reentrant")
def test_stage2_a_call_that_raises_still_hands_on_what_it_removed() -> None:
    """The loader of 'k' writes 'k', lets it expire, then asks for 'k' itself: that call
    looks 'k' up (a hit would be its answer), the TTL cache reports it EXPIRED, and the
    call is refused (RuntimeError). It caused that removal: it hands it on before the
    RuntimeError reaches the loader, in the loader's thread — not some later call."""
    log = ThreadLog()
    cache, clock = expired_ttl(log, keys="")

    def loader() -> object:
        cache.put("k", "written meanwhile")
        clock.advance(TTL)  # at its deadline: expired
        refused = caught(lambda: cache.get_or_load("k", lambda: "inner"))
        return refused, list(log.calls)

    got = promptly(cache, "k", loader)
    refused, heard = got if isinstance(got, tuple) else (got, None)
    want = [("k", EXPIRED, "get 'k'")]
    check(
        isinstance(refused, RuntimeError) and heard == want,
        "steps: get_or_load('k') in thread \"get 'k'\"; its loader puts 'k', moves the clock "
        "to k's deadline and calls get_or_load('k') (refused: RuntimeError). The removals a "
        "call causes are handed on by that call before it returns, even by raising: "
        f"expected RuntimeError, with on_evict having heard {want} (key, cause, thread) by "
        f"then; got {refused!r}, heard {heard}",
    )


#: The looks a TTL cache may reclaim in (``iter``, not ``list(cache)``, which asks len()).
_LOOKS: dict[str, Callable[[LoadingCache | EvictingCache], object]] = {
    "in": lambda c: "a" in c,
    "iteration": lambda c: list(iter(c)),
}


@core
@rule("no-user-code-under-lock", "one-lock")
@pytest.mark.parametrize("call", list(_LOOKS))
def test_stage2_a_look_that_reclaims_hands_on_its_removals(call: str) -> None:
    """A stage-1 TTL cache may reclaim expired entries while it looks (``in``,
    iteration), reporting them EXPIRED. Wrapped, side by side with the bare one: by the
    time the look returns, on_evict has heard what the bare cache reports for it."""
    look = _LOOKS[call]
    log, bare_log = Log(), Log()
    clock, bare_clock = ManualClock(START), ManualClock(START)
    cache = wrap(reclaiming_ttl(clock, log))
    alone = reclaiming_ttl(bare_clock, bare_log)
    for c in (cache, alone):
        c.put("a", 1)
        c.put("b", 2)
    for t in (clock, bare_clock):
        t.advance(TTL)  # both expired, neither reclaimed yet
    log.take()
    bare_log.take()
    got, want = look(cache), look(alone)
    check(
        got == want and log.calls == bare_log.calls,
        f"over a TTL cache whose in and iteration reclaim what has expired: 'a' and 'b' "
        f"put, then both at their deadline; {call} must answer as the bare cache ({want!r}) "
        f"and hand on what it removed before it returns, as the bare cache reports it: "
        f"expected {bare_log.calls}, got {got!r} and {log.calls}",
    )


# --------------------------------------------------------------------------- async


@extended
@rule("async-single-flight", "load-hit")
@anyio_test
async def test_stage2_async_every_caller_of_a_flight_gets_a_falsy_loaded_value() -> None:
    falsy: list[object] = [None, 0, "", False, []]
    for value in falsy:
        cache, release = async_cache(), anyio.Event()

        async def loader(value: object = value, release: anyio.Event = release) -> object:
            await release.wait()
            return value

        got = await async_flight(cache, loader, release, 2)
        check(
            all(g is value for g in got) and cache.get("k", "MISS") is value,
            f"AsyncCache: a leader and 2 waiters of one load that returns {value!r}: each "
            f"receives that very object, and it is cached; they got {got}",
        )


@extended
@rule("async-single-flight", "load-too-heavy", "write-beats-load")
@pytest.mark.parametrize("meanwhile", ["too-heavy", "put", "delete", "clear"])
@anyio_test
async def test_stage2_async_every_caller_gets_a_loaded_value_that_is_not_cached(
    meanwhile: str,
) -> None:
    """The loaded value is not cached — too heavy, or the key written while it loaded —
    yet it is the answer for every caller of its flight, waiters included."""
    cache = stage(2).AsyncCache(lru(4, max_weight=20, weigh=len))
    release, calls = anyio.Event(), list[int]()

    async def loader() -> object:
        calls.append(1)
        await release.wait()
        return ["x"] * (30 if meanwhile == "too-heavy" else 1)

    write = list if meanwhile == "too-heavy" else lambda: write_meanwhile(cache, meanwhile)
    got = await async_flight(cache, loader, release, 2, write)
    check(
        len(calls) == 1 and isinstance(got[0], list) and all(g is got[0] for g in got),
        f"AsyncCache: a leader and 2 waiters of one load, {meanwhile} meanwhile — the value is "
        f"not cached, yet every caller of the flight receives that very object, and the "
        f"loader runs once; got {got}, {len(calls)} loader calls",
    )


@extended
@rule("load-error", "flight-unregistered", "async-single-flight")
@anyio_test
async def test_stage2_async_a_weigh_that_raises_fails_the_load_for_every_caller() -> None:
    def weigh(value: object) -> int:
        if value == "unweighable":
            raise ValueError("cannot weigh this")
        return 1

    cache = stage(2).AsyncCache(lru(4, max_weight=5, weigh=weigh))
    release = anyio.Event()

    async def loader() -> object:
        await release.wait()
        return "unweighable"

    got = await async_flight(cache, loader, release, 2)
    stats = loads(cache)
    check(
        isinstance(got[0], ValueError) and all(g is got[0] for g in got),
        f"AsyncCache: weigh raised for the loaded value, which fails that load like a loader "
        f"exception: the leader and its 2 waiters each raise that very ValueError; got {got}, "
        f"{stats}" + (" — the flight was never finished" if STRANDED in got else ""),
    )

    async def later() -> str:
        return "later"

    with anyio.fail_after(DEADLINE_S):
        again = await cache.get_or_load("k", later)
    check(
        (stats.in_flight, again, "k" in cache) == (0, "later", True),
        f"after the failed load nothing is in flight and the next miss loads again; "
        f"got {stats}, then {again!r}",
    )


@extended
@rule("load-reentrant", "statistics")
@anyio_test
async def test_stage2_async_a_refused_reentrant_call_leaves_no_waiter_behind() -> None:
    cache = async_cache()

    async def inner() -> str:
        return "inner"

    async def loader() -> object:
        return await cache.get_or_load("k", inner)

    with anyio.fail_after(DEADLINE_S):
        try:
            got: object = await cache.get_or_load("k", loader)
        except RuntimeError as error:
            got = error
    check(
        isinstance(got, RuntimeError) and loads(cache) == LoadStatistics(1, 1, 0, 0),
        f"AsyncCache: get_or_load('k') from inside k's own loader is refused (RuntimeError) "
        f"and fails that load: 1 load, 1 failure, nothing in flight, nobody waiting; got "
        f"{got!r}, {loads(cache)}",
    )


@extended
@rule("async-single-flight", "load-reentrant")
@anyio_test
async def test_stage2_async_a_loader_may_load_other_keys_but_never_its_own() -> None:
    cache = async_cache()

    def returning(value: object) -> Callable[[], Awaitable[object]]:
        async def loader() -> object:
            return value

        return loader

    async def load_doc() -> object:
        return "doc", await cache.get_or_load("chunk", returning("chunk"))

    async def load_b() -> object:
        return await cache.get_or_load("a", returning("inner a"))

    async def load_a() -> object:
        return await cache.get_or_load("b", load_b)

    with anyio.fail_after(DEADLINE_S):
        doc = await cache.get_or_load("doc", load_doc)
        try:
            cycle: object = await cache.get_or_load("a", load_a)
        except RuntimeError as error:
            cycle = error
    check(
        doc == ("doc", "chunk") and isinstance(cycle, RuntimeError),
        f"AsyncCache: the loader of 'doc' loads 'chunk' (another key: allowed), the loader of "
        f"'a' loads 'b', whose loader asks for 'a' in the same task (refused: RuntimeError); "
        f"got {doc!r} and {cycle!r}",
    )


@extended
@rule("write-beats-load", "async-single-flight")
@pytest.mark.parametrize("write", ["put", "delete"])
@anyio_test
async def test_stage2_async_a_write_makes_only_its_own_keys_load_stale(write: str) -> None:
    cache = async_cache()
    loaders = {"k": AsyncLoader(), "j": AsyncLoader()}
    got: dict[str, object] = {}

    async def call(key: str) -> None:
        got[key] = await cache.get_or_load(key, loaders[key])

    async with racing_tasks() as tg:
        for key in loaders:
            tg.start_soon(call, key)
        await eventually_async(lambda: loads(cache).in_flight == 2, "both loads in flight")
        for key in ("j", "other"):
            cache.put(key, "written meanwhile") if write == "put" else cache.delete(key)
        for loader in loaders.values():
            loader.release.set()
    want_j = "written meanwhile" if write == "put" else None
    held = cache.get("k"), cache.get("j")
    check(
        held[0] is got["k"] and held[1] == want_j,
        f"AsyncCache: loads of 'k' and 'j' in flight, a {write} of 'j' and of 'other' "
        f"meanwhile: only 'j''s load is stale — 'k' caches what it loaded; the cache holds "
        f"k={held[0]!r} (loaded {got['k']!r}), j={held[1]!r}",
    )


_PLAIN: dict[str, Callable[[AsyncLoadingCache | EvictingCache], object]] = {
    "get": lambda c: c.get("a"),
    "put": lambda c: c.put("d", 4),
    "delete": lambda c: c.delete("a"),
    "clear": lambda c: c.clear(),
    "len": len,
    "in": lambda c: "a" in c,
    "iteration": list,
    "statistics": lambda c: c.statistics(),
}


@extended
@rule("no-user-code-under-lock")
@pytest.mark.parametrize("call", [*_PLAIN, "get_or_load"])
@anyio_test
async def test_stage2_async_each_call_hands_on_the_removals_it_caused_before_it_returns(
    call: str,
) -> None:
    """An AsyncCache over a TTL cache whose entries have all expired, side by side with
    the bare cache: after the call, on_evict has heard what the bare cache reports for it
    — a miss of get_or_load being its get and the put of what was loaded."""
    log, bare_log = Log(), Log()
    clock, bare_clock = ManualClock(START), ManualClock(START)
    cache: AsyncLoadingCache = stage(2).AsyncCache(
        stage(1).TTLCache(3, TTL, clock=clock, on_evict=log)
    )
    alone: EvictingCache = stage(1).TTLCache(3, TTL, clock=bare_clock, on_evict=bare_log)
    for key, value in [("a", 1), ("b", 2), ("c", 3)]:
        cache.put(key, value)
        alone.put(key, value)
    for c in (clock, bare_clock):
        c.advance(TTL + 1)  # every entry has expired; none was reclaimed yet
    log.take()
    bare_log.take()
    if call == "get_or_load":

        async def loader() -> str:
            return "loaded"

        with anyio.fail_after(DEADLINE_S):
            await cache.get_or_load("a", loader)
        bare_load(alone, "a", "loaded")
    else:
        _PLAIN[call](cache)
        _PLAIN[call](alone)
    check(
        log.calls == bare_log.calls,
        f"AsyncCache: {call} on a cache whose 3 entries expired — on_evict must hear, by the "
        f"time the call returns, what that call removed, as the stage-1 cache alone reports "
        f"it (not some later call): expected {bare_log.calls}, got {log.calls}",
    )
