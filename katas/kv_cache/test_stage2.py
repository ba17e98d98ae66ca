"""Stage 2 suite: a cache for many threads and tasks (see katas/kv_cache/README.md).

Core: ``ConcurrentCache`` — exact stats and capacity under racing threads, per-key
linearizability, single-flight ``get_or_load``, user code outside the lock. Extended:
``AsyncCache`` on asyncio and trio, with the cancellation rules.

How these tests stay deterministic: loaders block on events the test sets
(``_testing/loaders.py``), and the test sequences threads and tasks by
``load_statistics()`` (loads in flight, waiters) instead of sleeping, probing the
cache's lock from another thread (``_testing/locks.py``); every wait has a hard
real-time deadline and every thread is a daemon. Races are provoked with many threads
under a tiny ``sys.setswitchinterval`` and judged by exact counts and by a
linearizability search over the recorded history.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from functools import partial

import anyio
import pytest

from katas._harness.history import Call, check_per_key
from katas._harness.interleave import (
    Gate,
    Parked,
    announce_waits,
    pause_after_unlocks,
    pause_after_wakes,
    pause_in_updates,
)
from katas._harness.marks import anyio_test, core, extended, rule
from katas._harness.story import check
from katas._harness.under_test import stage
from katas._harness.virtual_time import settle
from katas._harness.waiting import (
    DEADLINE_S,
    Thread,
    eventually,
    eventually_async,
    spawn,
    tiny_switch_interval,
)
from katas.kv_cache._testing.caches import (
    EVICTED,
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
from katas.kv_cache._testing.flights import promptly
from katas.kv_cache._testing.loaders import (
    AsyncFlight,
    AsyncLoader,
    Loader,
    load_outcome,
    racing_tasks,
)
from katas.kv_cache._testing.locks import (
    GRACE_S,
    PROMPTLY_S,
    another_thread_blocks_on,
    check_not_held,
    flight_joined,
    free_while,
    free_while_loading,
    loading,
    loads,
    reentering,
    waiting_now,
    write_meanwhile,
)
from katas.kv_cache.api import (
    EvictingCache,
    LoadingCache,
    LoadStatistics,
    ManualClock,
    RemovalCause,
)

pytestmark = [pytest.mark.stage(2)]


# --------------------------------------------------------------------------- core


@core
@rule("exact-under-threads")
@pytest.mark.parametrize("kind", ["LRUCache", "TTLCache"])
def test_stage2_racing_threads_keep_exact_stats_and_capacity(kind: str) -> None:
    evicted: list[object] = []
    cache = concurrent(
        32, kind, on_evict=lambda k, v, c: evicted.append(k) if c is EVICTED else None
    )
    gets_per_thread, threads = 3_000, 8

    def work(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(gets_per_thread):
            key = rng.randrange(64)
            if cache.get(key) is None:
                cache.put(key, key + 1)

    with tiny_switch_interval():
        workers = [spawn(partial(work, s), f"t{s}") for s in range(threads)]
        for w in workers:
            w.outcome("racing gets and puts must finish")
    stats = cache.statistics()
    assert stats.hits + stats.misses == gets_per_thread * threads, (
        f"{threads} threads made {gets_per_thread * threads} gets, but hits + misses "
        f"= {stats.hits} + {stats.misses} = {stats.hits + stats.misses}: counts were lost "
        f"(an unlocked `+= 1` is a read, an add and a write)"
    )
    assert stats.evictions == len(evicted) and len(cache) <= 32 and stats.size == len(cache), (
        f"after the race, evictions {stats.evictions} must equal the EVICTED "
        f"callbacks ({len(evicted)}) and the cache must hold at most 32: {stats}"
    )


@core
@rule("single-flight", "statistics")
def test_stage2_concurrent_misses_call_the_loader_once_and_share_one_object() -> None:
    cache, loader = concurrent(), Loader()
    threads = [spawn(lambda: cache.get_or_load("k", loader), "leader")]
    loading(cache, loader)
    # Only now the 15 others: each finds the load in flight and must join it at once.
    threads += [spawn(lambda: cache.get_or_load("k", loader), f"t{i}") for i in range(15)]
    eventually(
        lambda: loads(cache).waiters == 15 or loader.calls > 1,
        "15 callers waiting for the one load already running — a miss of a key being "
        "loaded joins its flight; it must not queue behind a lock held by the loader",
    )
    loader.release.set()
    check(
        loader.calls <= 1,
        f"a miss of a key whose load is running must join that flight; the loader "
        f"was called {loader.calls} times for one key (single-flight: once)",
    )
    results = [t.outcome("a waiter must get the loaded value") for t in threads]
    assert loader.calls == 1, (
        f"16 concurrent misses of one key must run the loader ONCE (single-flight); "
        f"it ran {loader.calls} times — a stampede on the backend"
    )
    assert all(r is results[0] for r in results) and cache.get("k") is results[0], (
        "every caller of the flight receives the very same object, and it is cached"
    )
    assert loads(cache) == LoadStatistics(1, 0, 0, 0), loads(cache)


@core
@rule("single-flight")
def test_stage2_every_waiter_gets_the_value_of_a_load_landing_as_it_wakes() -> None:
    """The leader stops right after it wakes the waiters (each wake-up it sends through
    threading), until they are done: a waiter that is woken before the value is handed
    to the flight returns something else, on every run."""
    cache = concurrent()
    value = object()
    threads: list[Thread] = []

    def load() -> object:
        pause_after_wakes(lambda: all(not t.is_alive() for t in threads[1:]))
        return value

    loader = Loader(lambda n: load())
    get = partial(cache.get_or_load, "k", loader)
    threads.append(spawn(get, "leader"))
    loading(cache, loader)
    threads += [spawn(get, f"waiter-{i}") for i in range(3)]
    flight_joined(cache, loader, 3, "3 callers waiting for the load")
    loader.release.set()
    got = [t.outcome("a caller of a landing load must return") for t in threads]
    assert all(r is value for r in got) and cache.get("k") is value, (
        f"every caller of a flight receives the very object its loader returned, and it "
        f"is cached — hand the value to the flight before waking its waiters: the loader "
        f"returned {value}; the leader and its 3 waiters got {got}; the cache holds "
        f"{cache.get('k')}"
    )


@core
@rule("load-error")
def test_stage2_every_waiter_gets_the_error_of_a_load_failing_as_it_wakes() -> None:
    """The leader stops right after each lock it releases once its loader has raised,
    until its waiters are done: a waiter that is woken before the error is handed to the
    flight returns instead of raising, on every run."""
    cache = concurrent()
    boom = RuntimeError("model server 503")
    waiters: list[Thread] = []

    def load() -> object:
        woken = lambda: all(not t.is_alive() for t in waiters)  # noqa: E731
        pause_after_unlocks(type(cache).__module__, woken, woken)
        raise boom

    loader = Loader(lambda n: load())
    call = partial(load_outcome, cache, "k", loader)
    leader = spawn(call, "leader")
    loading(cache, loader)
    waiters += [spawn(call, f"waiter-{i}") for i in range(3)]
    flight_joined(cache, loader, 3, "3 callers waiting for the load")
    loader.release.set()
    got = [t.outcome("a caller of a failing load must return") for t in [leader, *waiters]]
    assert all(r is boom for r in got), (
        f"load-error: the loader raised {boom!r}; the leader and its 3 waiters must each "
        f"raise that very exception — hand the error to the flight before waking its "
        f"waiters; they got {got}"
    )


@core
@rule("load-reentrant", "load-error")
def test_stage2_a_loader_asking_for_its_own_key_fails_instead_of_deadlocking() -> None:
    cache = concurrent()
    loader, held = reentering(cache, "k")  # get_or_load('k') inside: waits for itself?

    caller = spawn(lambda: cache.get_or_load("k", loader), "caller")
    caller.join(PROMPTLY_S)  # the refusal takes microseconds; a deadlock never ends
    check_not_held(held)
    check(
        not caller.is_alive(),
        f"get_or_load('k') from inside the loader of 'k' had not returned after {PROMPTLY_S} s: "
        "it waits for itself, for ever, and so will every later caller of 'k' — raise "
        "RuntimeError instead",
    )
    with pytest.raises(RuntimeError):
        caller.outcome("a loader that calls get_or_load for its own key must not hang")
        raise AssertionError("get_or_load from inside its own loader returned: RuntimeError")
    check(
        cache.get_or_load("k", lambda: "later") == "later",
        "after the refused reentrant call the key must be free: the next miss loads again",
    )


@core
@rule("load-error", "statistics")
def test_stage2_a_loader_exception_reaches_every_waiter_and_is_not_cached() -> None:
    cache = concurrent()
    boom = RuntimeError("model server 503")
    release = threading.Event()
    calls = []

    def failing() -> object:
        calls.append(1)
        release.wait(DEADLINE_S)
        raise boom

    threads = [spawn(partial(load_outcome, cache, "k", failing), f"t{i}") for i in range(5)]
    eventually(lambda: len(calls) >= 1, "a miss to call the loader")
    free_while_loading(cache, release.set)
    eventually(lambda: loads(cache).waiters == 4 or len(calls) > 1, "4 callers waiting")
    release.set()
    check(len(calls) <= 1, f"5 misses of one key called the loader {len(calls)} times")
    errors = [t.outcome("a waiter of a failed load must return") for t in threads]
    assert all(e is boom for e in errors) and len(calls) == 1, (
        f"the loader's exception must reach every caller of its flight (one call); "
        f"got {errors}, {len(calls)} calls"
    )
    assert "k" not in cache and cache.get_or_load("k", lambda: "fine") == "fine", (
        "a failure is not cached: the next call loads again"
    )
    assert loads(cache) == LoadStatistics(loads=2, failures=1, in_flight=0, waiters=0), (
        f"after the failed load (its 4 waiters gone, each with the error) and one more "
        f"load: 2 loads, 1 failure, nothing in flight, no one waiting; got {loads(cache)}"
    )


@core
@rule("parallel-keys", "no-user-code-under-lock")
def test_stage2_misses_of_different_keys_load_in_parallel() -> None:
    cache, loader = concurrent(), Loader(lambda n: n)
    threads = [spawn(partial(cache.get_or_load, k, loader), f"t{k}") for k in range(4)]
    try:
        loading(cache, loader)  # a lock held across the first load: told in GRACE_S
        deadline = time.monotonic() + 1.0  # four threads start in microseconds, not seconds
        while loader.calls < 4 and time.monotonic() < deadline:
            time.sleep(0.001)
        check(
            loader.calls == 4,
            f"4 misses of 4 different keys must load in parallel — the loader must not "
            f"run under the cache's lock (that serialises every miss); within 1 s only "
            f"{loader.calls} of the 4 loads had started",
        )
    finally:
        loader.release.set()
    for t in threads:
        t.outcome("a load must finish")


@core
@rule("no-user-code-under-lock")
def test_stage2_on_evict_and_weigh_run_outside_the_lock() -> None:
    """User code that touches the cache from another thread must not block on it."""
    blocked: list[str] = []

    def uses_the_cache(what: str) -> None:
        if another_thread_blocks_on(cache):
            blocked.append(what)

    def weigh(value: object) -> int:
        uses_the_cache("weigh")
        return 1

    def on_evict(key: object, value: object, cause: RemovalCause) -> None:
        uses_the_cache("on_evict")

    cache = concurrent(1, max_weight=10, weigh=weigh, on_evict=on_evict)
    cache.put("a", 1)
    cache.put("b", 2)  # evicts a
    assert not blocked, (
        f"{blocked} ran while the cache's lock was held: another thread's get "
        "blocked. Call weigh before taking the lock, and run on_evict after releasing it"
    )


@core
@rule("no-user-code-under-lock")
def test_stage2_on_evict_may_wait_for_another_threads_eviction() -> None:
    """on_evict waits for another thread whose put evicts too, and so calls on_evict
    itself: neither call may wait for the other."""
    heard: list[object] = []
    blocked: list[str] = []

    def on_evict(key: object, value: object, cause: RemovalCause) -> None:
        heard.append(key)
        if key == "a":  # the first eviction waits for another thread's
            other = threading.Thread(target=lambda: cache.put("c", 3), daemon=True)
            other.start()
            other.join(1.0)
            if other.is_alive():
                blocked.append("put('c', 3)")

    cache = concurrent(1, on_evict=on_evict)
    cache.put("a", 1)
    cache.put("b", 2)  # evicts a
    check(
        not blocked and heard == ["a", "b"],
        "no-user-code-under-lock: a cache of 1; put a, then b (evicts a); on_evict('a') "
        "waits for another thread's put('c', 3), which evicts b and calls on_evict('b'). "
        "A callback that uses the cache from another thread must not block: expected on_evict "
        f"for a, then b, and no wait; got on_evict for {heard}"
        + (f", and {blocked[0]} still blocked after 1 s" if blocked else ""),
    )


#: Every call of the wrapper, as the bare stage-1 cache answers it (a miss of
#: ``get_or_load`` is its ``get`` and then the ``put`` of what was loaded).
_CALLS: dict[str, tuple[Callable[[LoadingCache], object], Callable[[EvictingCache], object]]] = {
    "get": (lambda c: c.get("a"), lambda c: c.get("a")),
    "put": (lambda c: c.put("d", 4), lambda c: c.put("d", 4)),
    "delete": (lambda c: c.delete("a"), lambda c: c.delete("a")),
    "clear": (lambda c: c.clear(), lambda c: c.clear()),
    "len": (len, len),
    "in": (lambda c: "a" in c, lambda c: "a" in c),
    "iteration": (list, list),
    "statistics": (lambda c: c.statistics(), lambda c: c.statistics()),
    "get_or_load": (lambda c: c.get_or_load("a", lambda: "loaded"), lambda c: _load(c, "a")),
}


def _load(cache: EvictingCache, key: str) -> None:
    """A miss of ``get_or_load`` on the bare cache: its ``get``, then the loaded value's ``put``."""
    cache.get(key)
    cache.put(key, "loaded")


@core
@rule("no-user-code-under-lock", "exact-under-threads")
@pytest.mark.parametrize("call", list(_CALLS))
def test_stage2_each_call_hands_on_the_removals_it_caused_before_it_returns(call: str) -> None:
    """A TTL cache whose entries have all expired, side by side with the bare stage-1
    cache: after the call, ``on_evict`` has heard exactly what the bare cache reports for
    it — whichever call it is (a TTL cache expires on reads and on ``len()`` too)."""
    wrapped, bare = _CALLS[call]
    log, bare_log = Log(), Log()
    clock, bare_clock = ManualClock(START), ManualClock(START)
    cache = wrap(stage(1).TTLCache(3, TTL, clock=clock, on_evict=log))
    alone = stage(1).TTLCache(3, TTL, clock=bare_clock, on_evict=bare_log)
    for key, value in [("a", 1), ("b", 2), ("c", 3)]:
        cache.put(key, value)
        alone.put(key, value)
    for c in (clock, bare_clock):
        c.advance(TTL + 1)  # every entry has expired; none was reclaimed yet
    log.take()
    bare_log.take()
    wrapped(cache)
    bare(alone)
    assert log.calls == bare_log.calls, (
        f"{call} on a cache whose 3 entries expired: on_evict must hear, by the time the "
        f"call returns, what that call removed — as the stage-1 cache alone reports it "
        f"(removals are collected under the lock and handed on after it, by the call that "
        f"caused them, not by some later call): expected {bare_log.calls}, got {log.calls}"
    )


@core
@rule("write-beats-load")
@pytest.mark.parametrize("write", ["put", "delete", "clear"])
def test_stage2_a_write_during_a_load_wins_over_the_loaded_value(write: str) -> None:
    cache, loader = concurrent(), Loader(lambda n: ["loaded (stale)"])
    leader = spawn(lambda: cache.get_or_load("k", loader), "leader")
    loading(cache, loader)
    waiter = spawn(lambda: cache.get_or_load("k", loader), "waiter")
    flight_joined(cache, loader, 1, "a second miss of 'k' joins its flight")
    write_meanwhile(cache, write)
    loader.release.set()
    loaded, joined = leader.outcome("the leader returns"), waiter.outcome("the waiter returns")
    assert loaded == ["loaded (stale)"] and joined is loaded, (
        f"a {write} while the key's load was in flight: the loaded value still goes to "
        f"every caller of the flight, the very same object; the leader got {loaded!r}, "
        f"the waiter {joined!r}"
    )
    expected = "written meanwhile" if write == "put" else None
    assert cache.get("k") == expected, (
        f"a {write} while the key's load was in flight is newer than the load: "
        f"the loaded value goes to its callers but must not be cached over the {write}; "
        f"the cache holds {cache.get('k')!r}"
    )
    cache.delete("k")
    again = cache.get_or_load("k", lambda: "loaded again")
    assert again == "loaded again" and loads(cache).in_flight == 0, (
        f"after that load finished (its value not cached) and 'k' was deleted, the next "
        f"miss loads again: a finished flight is unregistered, written over or not; got "
        f"{again!r}, {loads(cache)}"
    )


@core
@rule("flight-unregistered")
def test_stage2_a_key_loads_again_after_it_was_deleted() -> None:
    cache = concurrent()
    assert cache.get_or_load("k", lambda: 1) == 1
    cache.delete("k")
    got = cache.get_or_load("k", lambda: 2)
    assert got == 2 and loads(cache).in_flight == 0, (
        f"after its load finished and the key was deleted, the next miss must load "
        f"again (a finished flight is unregistered); got {got!r}, {loads(cache)}"
    )


@core
@rule("one-lock", "exact-under-threads")
def test_stage2_no_two_threads_are_ever_inside_the_inner_cache_at_once() -> None:
    """A turnstile around the inner cache: every call on it must hold the lock."""
    inner = lru(16)
    turnstile = Parked(inner, let_in=True, ignore={"weigh"})
    cache = wrap(turnstile)

    def work(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(300):
            key = rng.randrange(32)
            if cache.get(key) is None:
                cache.put(key, key)

    with tiny_switch_interval():
        for t in [spawn(partial(work, n), f"t{n}") for n in range(4)]:
            t.outcome("racing threads must finish")
    overlaps = turnstile.overlaps
    assert not overlaps, (
        f"two threads were inside the inner cache at once ({len(overlaps)} times, "
        f"e.g. in {sorted(set(overlaps))[:5]}): every call on it must hold the lock"
    )


@core
@rule("linearizable")
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_stage2_per_key_histories_are_linearizable(seed: int) -> None:
    cache = concurrent(10**6)  # unbounded: no eviction, so each key is a register
    calls: list[Call] = []
    lock = threading.Lock()

    def work(n: int) -> None:
        rng = random.Random(seed * 10 + n)
        for i in range(25):
            key = rng.choice("xyz")
            what = rng.choice(["get", "get", "put", "delete"])
            t0 = time.monotonic_ns()
            op: tuple[str, ...]
            result: object
            if what == "get":
                op, result = ("get",), cache.get(key, "MISS")
            elif what == "put":
                cache.put(key, f"t{n}-{i}")
                op, result = ("put", f"t{n}-{i}"), None
            else:
                op, result = ("delete",), cache.delete(key)
            with lock:
                calls.append(Call(f"t{n}", key, op, result, t0, time.monotonic_ns()))

    with tiny_switch_interval():
        threads = [spawn(partial(work, n), f"t{n}") for n in range(4)]
        for t in threads:
            t.outcome("a client thread must finish")

    def register(state: object, op: tuple[str, ...]) -> tuple[object, object]:
        if op[0] == "get":
            return state, state
        if op[0] == "put":
            return op[1], None
        return "MISS", state != "MISS"

    check_per_key(calls, "MISS", register)


@core
@rule("not-a-cache")
def test_stage2_bad_input_is_refused() -> None:
    with pytest.raises(TypeError):
        stage(2).ConcurrentCache(object())
        raise AssertionError("wrapping something that is not a cache was accepted")


@core
@rule("load-hit")
def test_stage2_get_or_load_on_a_hit_never_calls_the_loader() -> None:
    cache, calls = concurrent(), []

    def loader() -> str:
        calls.append(1)
        return "loaded"

    cache.put("k", "cached")
    first = cache.get_or_load("k", loader)
    assert cache.get_or_load("fresh", loader) == "loaded" and len(calls) == 1
    second = cache.get_or_load("fresh", loader)
    check(
        (first, second, len(calls)) == ("cached", "loaded", 1),
        f"get_or_load on a hit returns the cached value and never calls the loader: "
        f"a put value and a loaded one must both be hits; got {first!r} and {second!r} with "
        f"{len(calls)} loader calls (expected 1: the first miss of 'fresh')",
    )
    check(
        loads(cache).loads == 1 and cache.statistics().hits == 2,
        f"two hits, one load: {loads(cache)}, {cache.statistics()}",
    )


#: Values a cache must find although they test false.
FALSY: list[object] = [None, 0, "", False, []]


@core
@rule("load-hit")
@pytest.mark.parametrize("value", FALSY, ids=repr)
def test_stage2_get_or_load_hits_a_cached_falsy_value(value: object) -> None:
    cache, calls = concurrent(), []

    def loader() -> object:
        calls.append(1)
        return value

    cache.put("put", value)
    got = [cache.get_or_load("put", loader)]
    got += [cache.get_or_load("loaded", loader) for _ in range(3)]
    stats = cache.statistics()
    check(
        got == [value] * 4 and len(calls) == 1 and stats.hits == 3,
        f"put('put', {value!r}), then get_or_load('put', loader) once and "
        f"get_or_load('loaded', loader) three times, the loader returning {value!r}: a "
        f"cached {value!r} is a hit — expected {[value] * 4} with 1 loader call (the first "
        f"'loaded') and 3 hits; got {got} with {len(calls)} loader calls, {stats}",
    )


@core
@rule("single-flight")
def test_stage2_a_miss_racing_the_landing_of_a_load_joins_its_flight() -> None:
    """The miss's check and its join are one step: park it right after its check (in the
    on_evict of the expired entry it found), land the load, and it must not load again."""
    clock = ManualClock()
    gate = Gate("inside on_evict, after the second caller's check", limit=1)

    def on_evict(key: object, value: object, cause: RemovalCause) -> None:
        if cause is EXPIRED:
            gate.pass_through()

    inner = stage(1).TTLCache(100, 1_000, clock=clock, on_evict=on_evict)
    cache = wrap(inner)
    first, second = Loader(lambda n: "first load"), Loader(lambda n: "second load")
    second.release.set()
    leader = spawn(lambda: cache.get_or_load("k", first), "leader")
    loading(cache, first)
    cache.put("k", "written meanwhile")  # the load is stale now: it will not be cached
    clock.advance(1_000)  # ... and the write has expired: the next caller misses
    racer = spawn(lambda: cache.get_or_load("k", second), "racer")
    # The racer finds k expired and is parked in that entry's on_evict — unless it never
    # looked in the cache at all, and then it is done at once.
    # (Or it joined the flight without looking: then it waits, and the counters say so.)
    eventually(
        lambda: gate.arrivals >= 1 or not racer.is_alive() or waiting_now(cache),
        "the racer at the gate",
    )
    if not gate.arrivals:  # (a raise, not check: the message needs the racer's outcome)
        first.release.set()
        raise AssertionError(
            f"get_or_load('k') over an expired k returned {racer.outcome('')!r} without "
            f"looking in the cache (the expired entry was never found, no EXPIRED reported); "
            f"the second loader ran {second.calls} times"
        )

    # The racer is parked in on_evict, user code: the lock must be free, or the leader
    # could never land its load.
    def let_go() -> None:
        first.release.set()
        gate.open()

    free_while(cache, let_go, "on_evict ran")
    first.release.set()
    assert leader.outcome("the leader returns") == "first load"  # it has landed
    gate.open()
    got = racer.outcome("the racer returns")
    check(
        second.calls == 0 and got == "first load",
        "steps: a load of k is in flight; k is written and expires; a second caller "
        "checks the cache and misses — and before it goes on, the load lands. A miss joins "
        "the key's flight in the same step as its check (under one lock), so it receives "
        f"'first load' and the loader runs once; got {got!r}, {second.calls} second loads",
    )


@core
@rule("single-flight")
def test_stage2_a_miss_in_any_gap_of_the_landing_finds_the_value() -> None:
    """The leader's landing — its flight unregistered, its value cached — is one step: the
    leader stops right after each lock it releases once its loader has returned, and
    another thread's miss runs then. Whichever gap that is, the miss finds the value."""
    cache = concurrent()
    landed = threading.Event()

    def first_load(n: int) -> object:
        landed.set()  # the loader has returned: what the leader does next is the landing
        return "first load"

    first = Loader(first_load)
    second = Loader(lambda n: "second load")
    second.release.set()
    racers: list[Thread] = []

    def woken() -> bool:  # asked by the paused leader, after each lock it releases
        if not landed.is_set():
            return True  # not landing yet: no stop
        if not racers:
            racers.append(spawn(lambda: cache.get_or_load("k", second), "a miss in the gap"))
        return not racers[0].is_alive()

    def lead() -> object:
        pause_after_unlocks(type(cache).__module__, woken, lambda: False, deadline_s=2.0)
        return cache.get_or_load("k", first)

    leader = spawn(lead, "leader")
    loading(cache, first)
    first.release.set()
    assert leader.outcome("the leader returns") == "first load"
    got = racers[0].outcome("the miss in the gap") if racers else None
    check(
        bool(racers) and second.calls == 0 and got == "first load",
        f"a load of 'k' lands; right after each lock the leader then releases, another "
        f"thread calls get_or_load('k'). Unregistering the flight and caching its value "
        f"is one step under the lock, so that miss finds 'first load' and no second load "
        f"starts; got {got!r}, the second loader ran {second.calls} times",
    )


@core
@rule("no-user-code-under-lock", "exact-under-threads")
def test_stage2_a_call_hands_on_its_own_removals_even_if_another_comes_in_between() -> None:
    """A put evicts; right after each lock it releases, another thread's put evicts too.
    Each eviction is handed to ``on_evict`` by the call that caused it: the removals a
    call collected are its own once it leaves the lock, not the next caller's."""
    heard: list[tuple[object, str]] = []  # (evicted key, the thread that handed it on)

    def on_evict(key: object, value: object, cause: RemovalCause) -> None:
        heard.append((key, threading.current_thread().name))

    cache = wrap(lru(1, on_evict=on_evict))
    cache.put("a", 1)
    other: list[Thread] = []

    def woken() -> bool:  # asked by the paused first put, after each lock it releases
        if not other:
            other.append(spawn(lambda: cache.put("c", 3), "second put"))
        return not other[0].is_alive()

    def first_put() -> None:
        pause_after_unlocks(type(cache).__module__, woken, lambda: False, deadline_s=2.0)
        cache.put("b", 2)

    spawn(first_put, "first put").outcome("put('b') returns")
    if other:
        other[0].outcome("put('c') returns")
    # Whichever put reached the inner cache first evicted 'a'; the other, what it put.
    orders = ([("a", "first put"), ("b", "second put")], [("a", "second put"), ("c", "first put")])
    check(
        sorted(heard, key=str) in orders,
        f"capacity 1, holding 'a': put('b'), and right after each lock it releases, put('c') "
        f"from another thread. Each eviction is handed on by the call that caused it, before "
        f"it returns: expected {orders[0]} (or, had put('c') reached the cache first, "
        f"{orders[1]}); got {heard}",
    )


@core
@rule("linearizable")
@pytest.mark.parametrize("other", ["delete", "put"])
def test_stage2_a_delete_answers_for_what_it_did_whatever_runs_in_its_gaps(other: str) -> None:
    """``delete('k')`` stops right after each lock it releases, and another thread's
    ``delete('k')`` (or ``put('k')`` into the empty cache) runs then. Its answer must match
    its effect: True only if it removed the key, False only if it left the cache as it
    found it — two deletes of one key never both remove it."""
    cache = concurrent()
    if other == "delete":
        cache.put("k", "v")
    racer: list[Thread] = []

    def woken() -> bool:  # asked by the paused delete, after each lock it releases
        if not racer:
            call = (lambda: cache.delete("k")) if other == "delete" else lambda: cache.put("k", 2)
            racer.append(spawn(call, f"{other} in the gap"))
        return not racer[0].is_alive()

    def first_delete() -> bool:
        pause_after_unlocks(type(cache).__module__, woken, lambda: False, deadline_s=2.0)
        return cache.delete("k")

    removed = spawn(first_delete, "delete").outcome("delete('k') returns")
    theirs = racer[0].outcome(f"the {other} in the gap") if racer else None
    held = "k" in cache
    where = "held" if held else "gone"
    if other == "delete":
        ok = [removed, theirs].count(True) == 1 and not held
        story = "'k' held, two deletes of it: exactly one removed it and returns True"
        got = f"{removed} and {theirs}, 'k' {where}"
    else:
        ok = removed != held  # True: it removed the put's value; False: the value is there
        story = "an empty cache; delete('k'), and put('k') in its gap: True if it removed it"
        got = f"delete returned {removed}, and 'k' is {where} afterwards"
    check(ok, f"{story} (an answer matches its effect: linearizable per key); got {got}")


@core
@rule("one-lock")
def test_stage2_every_call_on_the_inner_cache_waits_for_the_lock() -> None:
    """Park one thread inside the inner cache's put (holding the lock), then try every
    other method from other threads: none may reach the inner cache until it is released."""
    gate = Gate("inside the inner cache's put", limit=1)
    inner = Parked(lru(16), gate, at={"put"})
    cache = wrap(inner)
    writer = spawn(lambda: cache.put("b", 2), "writer")
    gate.wait_arrived()
    calls: dict[str, Callable[[], object]] = {
        "get": lambda: cache.get("a"),
        "put": lambda: cache.put("c", 3),
        "delete": lambda: cache.delete("a"),
        "clear": lambda: cache.clear(),
        "in": lambda: "a" in cache,
        "len": lambda: len(cache),
        "iter": lambda: list(cache),
        "statistics": lambda: cache.statistics(),
        "get_or_load": lambda: cache.get_or_load("x", lambda: 0),
    }
    others = [spawn(fn, name) for name, fn in calls.items()]
    inner.wait_overlaps(len(calls), GRACE_S)  # only an unlocked call gets in: a short wait
    entered = list(inner.overlaps)
    gate.open()
    writer.outcome("the parked put returns")
    for t in others:
        t.outcome("every call returns once the put is done")
    check(
        not entered,
        f"while one thread was inside the inner cache's put (holding the lock), "
        f"these calls went into the inner cache too: {sorted(set(entered))} — every call on "
        f"the inner cache (get, put, delete, clear, in, len(), iteration, statistics()) must hold "
        f"the lock",
    )


@core
@rule("no-user-code-under-lock")
def test_stage2_get_or_load_weighs_outside_the_lock() -> None:
    blocked: list[str] = []

    def weigh(value: object) -> int:
        if another_thread_blocks_on(cache):
            blocked.append(f"weigh({value!r})")
        return 1

    cache = concurrent(4, max_weight=10, weigh=weigh)
    assert cache.get_or_load("k", lambda: "loaded") == "loaded"
    check(
        not blocked and cache.get("k") == "loaded",
        f"get_or_load on a weighted cache called {blocked} while holding the lock: "
        "another thread's get blocked. Weigh the loaded value before taking the lock to "
        "store it",
    )


@core
@rule("load-too-heavy")
def test_stage2_a_loaded_value_too_heavy_to_cache_is_still_returned() -> None:
    cache, loader = concurrent(4, max_weight=5, weigh=len), Loader(lambda n: "x" * 10)
    threads = [spawn(lambda: cache.get_or_load("k", loader), f"t{i}") for i in range(3)]
    loading(cache, loader)
    eventually(lambda: loads(cache).waiters == 2 or loader.calls > 1, "2 callers waiting")
    loader.release.set()
    got = [t.outcome("a caller of the heavy load returns") for t in threads]
    check(loader.calls == 1, f"3 misses, {loader.calls} loader calls (single flight)")
    check(
        got == ["x" * 10] * 3 and "k" not in cache,
        f"a loaded value heavier than max_weight=5 is still the answer for every "
        f"caller of its flight, it is just not cached; got {got}, cached: {'k' in cache}",
    )
    check(loads(cache).failures == 0, f"not a failure: {loads(cache)}")


@core
@rule("load-too-heavy")
def test_stage2_a_loaded_value_of_exactly_max_weight_is_cached() -> None:
    cache = concurrent(4, max_weight=5, weigh=len)
    got = cache.get_or_load("k", lambda: "x" * 5)
    check(
        got == "x" * 5 and "k" in cache,
        f"max_weight=5, weigh=len: a loaded value of weight 5 is not over max_weight, so it "
        f"is cached (only a value over it is not); got {got!r}, cached: {'k' in cache}",
    )


def _the_next_miss_loads_again(cache: LoadingCache) -> None:
    """After a failed load of 'k': a miss from another thread loads again, at once."""
    later = spawn(lambda: cache.get_or_load("k", lambda: "later"), "the next miss")
    check(
        later.outcome("the next miss of k, after the failed load") == "later",
        "the next miss of k loads again: the failed flight is gone",
    )


class _Abort(BaseException):
    """Not an Exception: what KeyboardInterrupt or a framework's own abort looks like."""


@core
@rule("load-error", "flight-unregistered")
def test_stage2_a_loader_raising_a_base_exception_fails_its_flight_like_any_other() -> None:
    cache = concurrent()

    def loader() -> object:
        raise _Abort("interrupted")

    with pytest.raises(_Abort):
        cache.get_or_load("k", loader)
        raise AssertionError("the loader's exception must reach its caller")
    stats = loads(cache)
    check(
        (stats.in_flight, stats.waiters) == (0, 0),
        f"a loader that raised a BaseException (not an Exception, like KeyboardInterrupt): "
        f"its flight failed like any other, so nothing is in flight any more; got {stats}",
    )
    _the_next_miss_loads_again(cache)


@core
@rule("load-error", "flight-unregistered", "no-user-code-under-lock")
def test_stage2_a_weigh_that_raises_fails_the_load_and_frees_the_key() -> None:
    def weigh(value: object) -> int:
        if value == "unweighable":
            raise ValueError("cannot weigh this")
        return 1

    cache = concurrent(4, max_weight=5, weigh=weigh)
    with pytest.raises(ValueError, match="cannot weigh"):
        cache.get_or_load("k", lambda: "unweighable")
        raise AssertionError("weigh's exception must reach the caller of get_or_load")
    stats = loads(cache)
    check(
        stats.in_flight == 0 and "k" not in cache,
        f"weigh raised for the loaded value: that load failed like a loader exception — "
        f"nothing cached, nothing left in flight; got {stats}, cached: {'k' in cache}",
    )
    _the_next_miss_loads_again(cache)


@core
@rule("load-reentrant", "statistics")
def test_stage2_a_refused_reentrant_call_leaves_no_waiter_behind() -> None:
    cache = concurrent()
    loader, held = reentering(cache, "k")
    got = promptly(cache, "k", loader)  # a hang fails within a second, not at the timeout
    check_not_held(held)
    stats = loads(cache)
    check(
        isinstance(got, RuntimeError) and (stats.in_flight, stats.waiters) == (0, 0),
        f"get_or_load('k') from inside k's own loader is refused (RuntimeError) and fails "
        f"that load: nobody waits, nothing is in flight; got {got!r}, {stats}",
    )


@core
@rule("statistics", "exact-under-threads")
def test_stage2_a_waiter_leaving_never_loses_another_callers_join() -> None:
    """A waiter of 'a' is woken; it stops between reading any count and writing it back,
    and meanwhile another caller joins the load of 'b'. The waiters count is exact: the
    joiner is still counted once both are done (an unlocked ``-=`` would write over it)."""
    cache, load_a, load_b = concurrent(), Loader(), Loader()
    spawn(lambda: cache.get_or_load("a", load_a), "leader of 'a'")
    loading(cache, load_a)
    spawn(lambda: cache.get_or_load("b", load_b), "leader of 'b'")
    loading(cache, load_b)
    joiner_asleep = threading.Event()
    joiners: list[Thread] = []

    def join_b() -> object:
        announce_waits(joiner_asleep)
        return cache.get_or_load("b", load_b)

    def woken() -> bool:  # asked by the paused waiter before each write-back
        if not load_a.release.is_set():
            return True  # still joining: no stop
        if not joiners:
            joiners.append(spawn(join_b, "joiner of 'b'"))
        return joiner_asleep.is_set()

    def wait_for_a() -> object:
        pause_in_updates(type(cache).__module__, woken, lambda: False, deadline_s=0.2)
        return cache.get_or_load("a", load_a)

    waiter = spawn(wait_for_a, "waiter of 'a'")
    flight_joined(cache, load_a, 1, "a second miss of 'a' joins its flight")
    load_a.release.set()
    waiter.outcome("the waiter of 'a' returns once its load lands")
    if not joiners:
        joiners.append(spawn(join_b, "joiner of 'b'"))
    eventually(lambda: loads(cache).waiters >= 1 or joiner_asleep.is_set(), "the joiner waits")
    stats = loads(cache)
    load_b.release.set()
    joiners[0].outcome("the joiner of 'b' returns")
    check(
        stats.waiters == 1,
        "loads of 'a' and 'b' in flight, a waiter on 'a'; 'a' lands, and while its waiter "
        "leaves (stopped between reading a count and writing it back) a caller joins 'b'. "
        f"Every count is exact under racing threads: 1 waiter (on 'b'), got {stats}",
    )


@core
@rule("one-lock", "no-user-code-under-lock")
def test_stage2_an_iterator_holds_no_lock_between_its_items() -> None:
    cache = concurrent()
    for key in "abc":
        cache.put(key, key)
    keys = iter(cache)
    first = next(keys)
    other = spawn(lambda: cache.get("b"), "a get from another thread, mid-iteration")
    other.join(PROMPTLY_S)
    check(
        not other.is_alive(),
        f"iter(cache) took {first!r}; while the caller's loop body runs, another thread's "
        f"get('b') must not wait: iteration holds the lock only for its call on the inner "
        f"cache (a snapshot), never between items; it had not returned after {PROMPTLY_S} s",
    )
    assert other.outcome("the get from another thread") == "b"
    assert sorted([first, *keys]) == ["a", "b", "c"]


@core
@rule("not-a-cache")
@pytest.mark.parametrize(
    "missing",
    [("on_evict", "weigh", "max_weight"), ("on_evict",), ("weigh",), ("max_weight",)],
    ids=["no-seam", "no-on_evict", "no-weigh", "no-max_weight"],
)
def test_stage2_a_cache_like_object_without_the_stage1_seams_is_refused(
    missing: tuple[str, ...],
) -> None:
    class LooksLikeACache:  # get/put/delete/statistics, and the seams not missing
        def get(self, key: object, default: object = None) -> object:
            return default

        def put(self, key: object, value: object) -> None: ...

        def delete(self, key: object) -> bool:
            return False

        def statistics(self) -> object:
            return None

    seams = {"on_evict": None, "weigh": None, "max_weight": None}
    for seam in seams.keys() - set(missing):
        setattr(LooksLikeACache, seam, seams[seam])
    what = f"an object with the Cache methods but no {' or '.join(missing)}"
    for name in ("ConcurrentCache", "AsyncCache"):
        try:
            getattr(stage(2), name)(LooksLikeACache())
        except TypeError:
            continue
        except Exception as error:  # an AttributeError deep in the constructor, say
            raise AssertionError(
                f"{name}({what}) raised {type(error).__name__}: {error}; it is not a "
                "stage-1 cache: TypeError"
            ) from None
        raise AssertionError(f"{name} accepted {what}: it is not a stage-1 cache")


# --------------------------------------------------------------------------- async


@extended
@rule("async-single-flight")
@anyio_test
async def test_stage2_async_concurrent_misses_await_the_loader_once() -> None:
    flight = AsyncFlight()
    cache, loader, results = flight.cache, flight.loader, flight.results
    async with racing_tasks() as tg:
        for _ in range(10):
            tg.start_soon(flight.call)
        await eventually_async(
            lambda: loads(cache).waiters == 9 or loader.calls > 1, "9 tasks waiting"
        )
        loader.release.set()
    assert loader.calls == 1 and len(results) == 10 and all(r is results[0] for r in results), (
        f"10 tasks missing one key must await the loader once and share its "
        f"result; the loader ran {loader.calls} times"
    )


@extended
@rule("load-reentrant", "async-single-flight")
@anyio_test
async def test_stage2_async_a_loader_asking_for_its_own_key_fails_instead_of_deadlocking() -> None:
    cache = async_cache()

    async def loader() -> object:
        async def inner() -> str:
            return "inner"

        return await cache.get_or_load("k", inner)  # waits for itself, if allowed

    with anyio.fail_after(DEADLINE_S):
        with pytest.raises(RuntimeError):
            await cache.get_or_load("k", loader)
            raise AssertionError("get_or_load from inside its own loader returned: RuntimeError")

        async def later() -> str:
            return "later"

        got = await cache.get_or_load("k", later)
    check(got == "later", "after the refused reentrant call the next miss loads again")


@extended
@rule("async-cancelled-waiter")
@anyio_test
async def test_stage2_async_a_cancelled_waiter_does_not_cancel_the_load() -> None:
    flight = AsyncFlight()
    cache, loader, results = flight.cache, flight.loader, flight.results
    scopes: list[anyio.CancelScope] = []

    async def impatient_call() -> None:
        with anyio.CancelScope() as scope:
            scopes.append(scope)
            await flight.call()

    async with racing_tasks() as tg:
        tg.start_soon(flight.call)  # the leader
        await eventually_async(lambda: loads(cache).in_flight == 1, "the load in flight")
        tg.start_soon(impatient_call)
        await eventually_async(lambda: loads(cache).waiters == 1, "a waiter")
        scopes[0].cancel()  # that caller gives up
        await eventually_async(lambda: loads(cache).waiters == 0, "the waiter gone")
        tg.start_soon(flight.call)
        await eventually_async(lambda: loads(cache).waiters == 1, "another waiter")
        loader.release.set()
    assert loader.calls == 1 and len(results) == 2 and results[0] is results[1], (
        f"a cancelled waiter must just leave: the load goes on for the others "
        f"(loader calls: {loader.calls}, results: {len(results)})"
    )


@extended
@rule("async-cancelled-leader")
@anyio_test
async def test_stage2_async_a_cancelled_leader_does_not_strand_its_waiters() -> None:
    flight = AsyncFlight()
    cache, loader, results = flight.cache, flight.loader, flight.results
    leader = anyio.CancelScope()

    async def lead() -> None:
        with leader:
            await flight.call()

    async with racing_tasks() as tg:
        tg.start_soon(lead)
        await eventually_async(lambda: loads(cache).in_flight == 1, "the leader loading")
        for _ in range(3):
            tg.start_soon(flight.call)
        await eventually_async(lambda: loads(cache).waiters == 3, "3 waiters")
        leader.cancel()  # the leader's caller went away
        try:
            await settle()  # every task waits again: the cancellation has been handled
            stats = loads(cache)
            check(
                loader.calls == 2 and stats.waiters == 2,
                f"the leader's caller was cancelled while 3 waiters waited for its load: "
                f"the leader leaves at once, one waiter leads a new load and two wait for "
                f"it — got {loader.calls} loader calls, {stats}",
            )
        finally:
            loader.release.set()  # whatever happened, every load ends
    assert len(results) == 3 and all(r is results[0] for r in results), (
        f"after the leader was cancelled, one waiter must load again and all three "
        f"waiters get that value; got {len(results)} results, loader calls {loader.calls}"
    )
    assert loads(cache).failures == 1, loads(cache)


@extended
@rule("async-single-flight", "load-error")
@anyio_test
async def test_stage2_async_a_loader_exception_reaches_every_waiter() -> None:
    cache = async_cache()
    release = anyio.Event()
    errors: list[BaseException] = []

    async def failing() -> object:
        await release.wait()
        raise RuntimeError("503")

    async def call() -> None:
        try:
            await cache.get_or_load("k", failing)
        except RuntimeError as e:
            errors.append(e)

    async with racing_tasks() as tg:
        for _ in range(4):
            tg.start_soon(call)
        await eventually_async(
            lambda: loads(cache).waiters == 3 or loads(cache).loads > 1, "3 waiters"
        )
        release.set()
    assert len(errors) == 4 and all(e is errors[0] for e in errors) and "k" not in cache, (
        f"the loader's exception reaches all 4 tasks and nothing is cached: {errors}"
    )
    assert loads(cache) == LoadStatistics(loads=1, failures=1, in_flight=0, waiters=0), (
        f"after the failed load (its 3 waiters gone, each with the error): 1 load, "
        f"1 failure, nothing in flight, no one waiting; got {loads(cache)}"
    )


@extended
@rule("load-hit", "async-single-flight")
@anyio_test
async def test_stage2_async_get_or_load_on_a_hit_never_calls_the_loader() -> None:
    cache, calls = async_cache(), []

    async def loader() -> str:
        calls.append(1)
        return "loaded"

    cache.put("k", "cached")
    first = await cache.get_or_load("k", loader)
    await cache.get_or_load("fresh", loader)
    second = await cache.get_or_load("fresh", loader)
    check(
        (first, second, len(calls)) == ("cached", "loaded", 1),
        f"AsyncCache.get_or_load on a hit returns the cached value and never awaits "
        f"the loader; got {first!r} and {second!r} with {len(calls)} loader calls "
        f"(expected 1: the first miss of 'fresh')",
    )


@extended
@rule("load-hit", "async-single-flight")
@anyio_test
async def test_stage2_async_get_or_load_hits_a_cached_falsy_value() -> None:
    for value in FALSY:
        cache, calls = async_cache(), list[int]()

        async def loader(value: object = value, calls: list[int] = calls) -> object:
            calls.append(1)
            return value

        cache.put("put", value)
        got = [await cache.get_or_load("put", loader)]
        got += [await cache.get_or_load("loaded", loader) for _ in range(3)]
        stats = cache.statistics()
        check(
            got == [value] * 4 and len(calls) == 1 and stats.hits == 3,
            f"AsyncCache: put('put', {value!r}), then get_or_load('put', loader) once and "
            f"get_or_load('loaded', loader) three times, the loader returning {value!r}: a "
            f"cached {value!r} is a hit — expected {[value] * 4} with 1 loader call and 3 "
            f"hits; got {got} with {len(calls)} loader calls, {stats}",
        )


@extended
@rule("no-user-code-under-lock", "async-cancelled-waiter")
@anyio_test
async def test_stage2_async_a_waiter_hands_on_what_its_read_removed() -> None:
    """The second miss of a key being loaded finds the key's entry (written during the
    load) expired, joins the flight, and is cancelled while it waits: the EXPIRED its read
    caused is handed on by that call, before it ends."""
    clock, log = ManualClock(START), Log()
    cache = stage(2).AsyncCache(stage(1).TTLCache(3, TTL, clock=clock, on_evict=log))
    loader = AsyncLoader()
    scopes: list[anyio.CancelScope] = []

    async def waiter() -> None:
        with anyio.CancelScope() as scope:
            scopes.append(scope)
            await cache.get_or_load("k", loader)

    async with racing_tasks() as tg:
        tg.start_soon(cache.get_or_load, "k", loader)  # the leader: 'k' is missing
        await eventually_async(lambda: loads(cache).in_flight == 1, "the load in flight")
        cache.put("k", "written meanwhile")
        clock.advance(TTL)  # that entry's deadline
        log.take()
        tg.start_soon(waiter)
        await eventually_async(lambda: loads(cache).waiters == 1, "the second miss waiting")
        scopes[0].cancel()
        await eventually_async(lambda: loads(cache).waiters == 0, "the waiter gone")
        heard = log.take()
        loader.release.set()
    check(
        heard == [("k", "written meanwhile", EXPIRED)],
        "no-user-code-under-lock: AsyncCache over a TTLCache; get_or_load('k') loading; "
        "put('k', 'written meanwhile'); at its deadline a second get_or_load('k') finds it "
        "expired, joins the flight, and is cancelled. The removal its read caused is handed "
        "to on_evict by that call, before it ends: expected on_evict('k', 'written "
        f"meanwhile', EXPIRED) by then; heard {heard}",
    )


@extended
@rule("statistics", "async-single-flight")
@anyio_test
async def test_stage2_async_statistics_are_the_inner_caches() -> None:
    inner = lru(2)
    cache = stage(2).AsyncCache(inner)
    cache.put("a", 1)
    cache.put("b", 2)
    cache.get("a")
    cache.get("zz")

    async def loader() -> int:
        return 3

    await cache.get_or_load("c", loader)  # a miss, then c evicts b
    got = cache.statistics()
    want = inner.statistics()
    check(
        got == want and (got.hits, got.misses, got.evictions, got.size) == (1, 2, 1, 2),
        f"AsyncCache(LRUCache(2)): put a, b; get a (hit), get zz (miss); get_or_load c (a "
        f"miss; c evicts b). statistics() is the inner cache's: expected {want} with hits 1, "
        f"misses 2, evictions 1, size 2; got {got}",
    )


@extended
@rule("write-beats-load")
@anyio_test
async def test_stage2_async_a_write_during_a_load_wins_over_the_loaded_value() -> None:
    for write in ("put", "delete", "clear"):
        await _async_write_during_a_load(write)


async def _async_write_during_a_load(write: str) -> None:
    flight = AsyncFlight()
    cache, results = flight.cache, flight.results
    async with racing_tasks() as tg:
        tg.start_soon(flight.call)
        await eventually_async(lambda: loads(cache).in_flight == 1, "the load in flight")
        write_meanwhile(cache, write)
        flight.loader.release.set()
    expected = "written meanwhile" if write == "put" else None
    got = cache.get("k")
    check(
        got == expected and len(results) == 1 and results[0] is not None,
        f"AsyncCache: a {write} while the key's load was in flight is newer than "
        f"the load: the loaded value goes to its caller but must not be cached over the "
        f"{write}; the cache holds {got!r}",
    )
