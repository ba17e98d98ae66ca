"""Stage 3 suite, extended: the near cache (see katas/kv_cache/README.md) — a stage-1
LRU in front of a ``ShardedCache(channel=)``, kept coherent by invalidations.

The map of this file:

- writes publish: one script per replica that sets (or deletes) and publishes the key;
- bad arguments, two racing start()s, a key the ring refuses (no miss); a local hit
  touches no Redis (a stored None or falsy value is a value, kept near too); a weighted
  local cache weighs values only;
- read-your-writes without waiting for a message; another client's write arrives by
  message;
- placeholders: an invalidation that overtakes a reply wins, a writer never caches what
  it wrote, each read stores only over its own placeholder, a get that finds another
  read's placeholder misses, a miss is not cached, a get that raised leaves no
  placeholder behind;
- a writer forgets its local entry after its remote write, found or not;
- a listener calls channel_ready only once the server confirmed the subscription;
- dropped channels: a flush, nothing cached while down, a read in flight across a drop,
  a node killed and restarted, a key cached only while all its replicas are subscribed,
  a TTL local cache bounding a channel that died silently;
- the state machine (``_testing/near.py``): messages late, in any order, or lost.

These tests order events on purpose. A ``Tap`` (``_testing/wire.py``) holds a client's
reply to one command — the command ran on the server, its reply is read but not yet
returned — so the test can make another client write "while the reply is on the wire";
a ``HoldBefore`` holds a command before it is sent, and a ``HeldSubscribe`` a listener's
SUBSCRIBE, until the test lets it go.
Messages are delivered either by the near cache's own listeners (and then the test waits
for the count in statistics()), or, for a near cache that is not started, by the test
calling invalidate / channel_lost / channel_ready itself, in whatever order it likes.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator, Sized
from functools import partial
from typing import Any

import pytest
import redis
from hypothesis import settings

from katas._harness.interleave import pause_after_unlocks
from katas._harness.marks import extended, rule
from katas._harness.redis import RedisEnv
from katas._harness.story import check, not_refused
from katas._harness.under_test import stage
from katas._harness.waiting import DEADLINE_S, eventually, spawn
from katas._harness.walks import walked
from katas.kv_cache._testing.caches import lru
from katas.kv_cache._testing.near import (
    NEAR_WALKS,
    HeldWrite,
    NearCacheMachine,
    NearFleet,
    Subscribers,
    cut,
    heal,
    held_read,
    near_cache,
    near_stats,
    reply_lands,
    unstarted,
)
from katas.kv_cache._testing.refusals import RETURNED, refusal, two_racing_starts
from katas.kv_cache._testing.rings import fail_fast_on_stubs  # noqa: F401 (autouse)
from katas.kv_cache._testing.shards import MISS, NODES, heavy, sharded
from katas.kv_cache._testing.wire import HeldSubscribe, Holds
from katas.kv_cache.api import NS_PER_S, ManualClock, NoReplicaAvailable

pytestmark = [pytest.mark.stage(3)]


@pytest.fixture
def fleet(redis_env: RedisEnv) -> Iterator[NearFleet]:
    f = NearFleet(redis_env)
    yield f
    f.close()


@extended
@rule("near-one-script", "near-message-is-the-key")
def test_stage3_near_a_write_is_one_script_per_replica_that_sets_and_publishes(
    fleet: NearFleet,
) -> None:
    proxies = fleet.proxies()
    writer = fleet.sharded({n: fleet.nodes[n].proxied_client(p) for n, p in proxies.items()})
    listeners = {}
    for name, node in fleet.nodes.items():
        # redis-py types pubsub() from 8.2 on; before, the call is untyped
        pubsub = node.client().pubsub()  # type: ignore[no-untyped-call, unused-ignore]
        pubsub.subscribe(fleet.channel)
        assert pubsub.get_message(timeout=DEADLINE_S)["type"] == "subscribe"
        listeners[name] = pubsub
    key = "prompt:42"
    writer.put(key, "warm-up")  # the first calls may also load the scripts
    writer.delete(key)
    for pubsub in listeners.values():
        while pubsub.get_message(timeout=0.2) is not None:
            pass
    for p in proxies.values():
        p.reset_counts()
    writer.put(key, {"tokens": [1, 2]})
    replicas = writer.replicas_for(key)
    for name, proxy in proxies.items():
        sent = proxy.counts().commands
        if name in replicas:
            assert sent in (("EVALSHA",), ("EVAL",)), (
                f"near cache: put on a ShardedCache with channel= sends each replica ONE "
                f"script (SET and PUBLISH together, atomically); replica {name} got {sent}"
            )
            message = listeners[name].get_message(timeout=DEADLINE_S)
            assert message is not None and message["data"] in (key, key.encode()), (
                f"near cache: the script publishes the key on {fleet.channel!r} of each "
                f"replica it writes; {name} published {message}"
            )
            raw = fleet.nodes[name].client().get(writer.key_name(name, key))
            assert raw is not None and json.loads(raw) == {"tokens": [1, 2]}
        else:
            assert sent == (), f"near cache: {name} is not a replica of {key!r}: got {sent}"
            assert listeners[name].get_message(timeout=0.1) is None
    for p in proxies.values():
        p.reset_counts()
    assert writer.delete(key) is True
    for name in replicas:
        sent = proxies[name].counts().commands
        assert sent in (("EVALSHA",), ("EVAL",)), (
            f"near cache: delete is one script per replica too (DEL and PUBLISH); "
            f"replica {name} got {sent}"
        )
        message = listeners[name].get_message(timeout=DEADLINE_S)
        assert message is not None and message["data"] in (key, key.encode()), message
    for pubsub in listeners.values():
        pubsub.close()


@extended
@rule("near-one-script", "near-other-writes")
@pytest.mark.parametrize(
    "held", [(0, 1), (0,), (1,), ()], ids=lambda h: "held-by-" + ("".join(map(str, h)) or "none")
)
def test_stage3_near_a_delete_publishes_on_every_replica_whether_or_not_it_held_the_key(
    fleet: NearFleet, held: tuple[int, ...]
) -> None:
    key = "prompt:43"
    replicas = fleet.writer.replicas_for(key)
    with Subscribers(fleet) as subscribers:
        fleet.writer.put(key, "v")
        for i, name in enumerate(replicas):
            if i not in held:  # gone from this replica already (expired, evicted, restarted)
                fleet.nodes[name].client().delete(fleet.writer.key_name(name, key))
        for name in NODES:
            subscribers.heard(name)  # the put's messages: not what this test is about
        found = fleet.writer.delete(key)
        heard = {name: subscribers.heard(name) for name in NODES}
    want = {name: [key] if name in replicas else [] for name in NODES}
    holding = [replicas[i] for i in held]
    check(
        found is bool(held) and heard == want,
        f"near cache: {key!r} lives on {replicas}, and only {holding or 'none'} still hold it "
        f"when another client deletes it: each replica's script does DEL and PUBLISH, whatever "
        f"DEL found — a near cache may hold a value Redis no longer has, and only the message "
        f"removes it. Expected delete -> {bool(held)} and the key published on each replica "
        f"{want}; got delete -> {found!r}, published {heard}",
    )


@extended
@rule("near-listener", "near-one-script")
def test_stage3_near_the_remote_shows_its_channel_and_clients(fleet: NearFleet) -> None:
    clients = {n: node.client() for n, node in fleet.nodes.items()}
    plain = sharded(clients, replicas=2, key_prefix=fleet.prefix)
    publishing = sharded(clients, replicas=2, key_prefix=fleet.prefix, channel="inv")
    got = (plain.channel, publishing.channel)
    check(
        got == (None, "inv"),
        f"ShardedCache(...).channel is None without channel= (writes do not publish), and "
        f"'inv' with channel='inv'; got {got}",
    )
    for cache in (plain, publishing):
        shown = cache.clients
        same = sorted(shown) == sorted(clients) and all(shown[n] is clients[n] for n in clients)
        check(
            same,
            f"ShardedCache(nodes).clients is each node's client by node name — the very "
            f"clients given (the near cache's listeners subscribe on them); got {shown}",
        )


@extended
@rule("near-bad-input")
def test_stage3_near_rejects_bad_arguments(fleet: NearFleet) -> None:
    clients = {n: node.client() for n, node in fleet.nodes.items()}
    plain = sharded(clients, replicas=2, key_prefix=fleet.prefix)
    with pytest.raises(ValueError, match="remote"):
        near_cache(plain, lru(10))
    used = lru(10)
    used.put("k", 1)
    with pytest.raises(ValueError, match="local"):
        near_cache(fleet.writer, used)
    with pytest.raises(ValueError, match="reconnect_ns"):
        near_cache(fleet.writer, lru(10), reconnect_ns=-1)
    with not_refused("reconnect_ns=0 (resubscribe at once) is not negative: accepted", ValueError):
        fleet.adopt(near_cache(fleet.writer, lru(10), reconnect_ns=0))
    with pytest.raises(ValueError, match="channel"):
        sharded(clients, replicas=2, channel="")


@extended
@rule("near-bad-input")
def test_stage3_near_starts_once_and_close_joins_its_listeners(fleet: NearFleet) -> None:
    before = set(threading.enumerate())
    near, _ = fleet.near()
    listeners = set(threading.enumerate()) - before
    check(bool(listeners), "a started near cache runs one listener thread per node")
    with pytest.raises(RuntimeError):
        near.start()
        raise AssertionError("start() of a started near cache must raise RuntimeError")
    check(
        set(threading.enumerate()) - before == listeners,
        "a refused second start() starts no second listener",
    )
    near.close()
    alive = [t.name for t in listeners if t.is_alive()]
    check(not alive, f"close() stops the listeners and joins each: still running {alive}")


@extended
@rule("near-listener")
def test_stage3_near_two_racing_starts_start_it_once(fleet: NearFleet) -> None:
    clients = {n: node.client() for n, node in fleet.nodes.items()}
    near = fleet.adopt(near_cache(fleet.sharded(clients), lru(10)))
    before = set(threading.enumerate())
    first, second = two_racing_starts(near)
    listeners = [t.name for t in set(threading.enumerate()) - before if t.is_alive()]
    check(
        sorted([first, second]) == sorted([RETURNED, "RuntimeError"])
        and len(listeners) == len(NODES),
        f"near cache: two threads call start() at once, the first held at its first loop "
        f"step (building its listeners) until the second's start() has ended. One start() "
        f"runs one listener per node, the other raises RuntimeError (already started): the "
        f"check and the claim are one step under the lock. Expected one {RETURNED} and one "
        f"RuntimeError, {len(NODES)} listeners; got first: {first}, second: {second}, "
        f"listeners {sorted(listeners)}",
    )


@extended
@rule("near-bad-input", "near-local-hit")
def test_stage3_near_a_key_the_ring_refuses_is_no_miss(fleet: NearFleet) -> None:
    near = unstarted(fleet, set(NODES))
    bad_keys: tuple[Any, ...] = (1, b"k")
    got = {repr(key): refusal(partial(near.get, key)) for key in bad_keys}
    s = near_stats(near)
    check(
        got == dict.fromkeys(got, "TypeError") and (s.hits, s.misses) == (0, 0),
        f"near cache: get(1) and get(b'k') raise TypeError, as the ring refuses a key that "
        f"is not a str — before any lookup is counted: misses counts the gets that went to "
        f"Redis, and these went nowhere. Expected TypeError for each and hits 0, misses 0; "
        f"got {got}, {s}",
    )


@extended
@rule("near-local-hit")
def test_stage3_near_a_hit_touches_no_redis(fleet: NearFleet) -> None:
    proxies = fleet.proxies()
    clients = {n: fleet.nodes[n].proxied_client(p) for n, p in proxies.items()}
    near = unstarted(fleet, set(NODES), clients=clients)
    fleet.writer.put("k", [1, 2, 3])
    assert near.get("k") == [1, 2, 3]
    for p in proxies.values():
        p.reset_counts()
    for _ in range(5):
        assert near.get("k") == [1, 2, 3]
    sent = {name: p.counts().commands for name, p in proxies.items()}
    assert all(not c for c in sent.values()), (
        f"near cache: a key read once (channels subscribed) is served from the local "
        f"cache; 5 more gets sent {sent}"
    )
    s = near_stats(near)
    assert (s.hits, s.misses) == (5, 1), f"near cache: 1 miss then 5 hits: {s}"


#: Values a near cache must tell from a miss, by what they are: JSON null and the falsy.
NOTHING_LIKE_A_MISS: dict[str, object] = {
    "None": None,
    "0": 0,
    "empty str": "",
    "False": False,
    "[]": [],
    "{}": {},
}


@extended
@rule("near-local-hit", "round-trip")
@pytest.mark.parametrize("value", list(NOTHING_LIKE_A_MISS.values()), ids=list(NOTHING_LIKE_A_MISS))
def test_stage3_near_a_stored_none_or_falsy_value_is_a_value(
    fleet: NearFleet, value: object
) -> None:
    """A stored None, 0 or "" is a value: the near cache returns it (not the caller's
    default), and keeps it near like any other — the next gets are hits."""
    proxies = fleet.proxies()
    clients = {n: fleet.nodes[n].proxied_client(p) for n, p in proxies.items()}
    near = unstarted(fleet, set(NODES), clients=clients)
    fleet.writer.put("k", value)
    first = near.get("k", MISS)
    for p in proxies.values():
        p.reset_counts()
    again = [near.get("k", MISS) for _ in range(5)]
    sent = {name: p.counts().commands for name, p in proxies.items() if p.counts().commands}
    s = near_stats(near)
    got = [first, *again]
    check(
        all(g is not MISS and type(g) is type(value) and g == value for g in got)
        and not sent
        and (s.hits, s.misses) == (5, 1),
        f"near cache: another client put('k', {value!r}); six gets of 'k' with a default. A "
        f"stored {value!r} is a value, not a miss: each get returns it, never the default, "
        f"and the first one keeps it near, so the next five are hits that send Redis "
        f"nothing. Expected {[value] * 6}, 1 miss and 5 hits; got "
        f"{['MISS' if g is MISS else g for g in got]}, {s}, commands sent by the last five "
        f"gets: {sent or 'none'}",
    )


@extended
@rule("near-weighted")
def test_stage3_near_a_weighted_local_cache_weighs_values_only(fleet: NearFleet) -> None:
    weighed: list[object] = []

    def weigh(value: Sized) -> int:
        weighed.append(value)
        return len(value)

    local = lru(10, max_weight=5, weigh=weigh)
    near = near_cache(fleet.writer, local)
    for name in NODES:
        near.channel_ready(name)
    fleet.writer.put("short", "abc")
    fleet.writer.put("long", "abcdefgh")
    assert near.get("short") == "abc" and near.get("short") == "abc"
    got = [near.get("long"), near.get("long")]
    assert got == ["abcdefgh", "abcdefgh"], (
        "near cache: a value heavier than the local cache's max_weight is still the "
        f"answer, just not kept near; got {got}"
    )
    assert all(isinstance(v, str) for v in weighed), (
        f"near cache: the user's weigh must only ever see values, never a placeholder "
        f"(store placeholders with weight=0); it saw {weighed}"
    )
    s = near_stats(near)
    assert (s.hits, s.misses) == (1, 3), (
        f"near cache: 'short' is cached (1 miss, 1 hit), 'long' is not (2 misses): {s}"
    )


@extended
@rule("near-weighted", "near-placeholder")
def test_stage3_near_placeholders_take_no_room_from_the_values(fleet: NearFleet) -> None:
    local = lru(2, max_weight=4, weigh=len)  # room for two entries, of weight 4 in all
    near = unstarted(fleet, set(NODES), local)
    fleet.writer.put("full", "abcd")  # weighs max_weight exactly
    fleet.writer.put("long", "abcdefgh")  # too heavy to keep near
    got = [near.get("full"), near.get("long"), near.get("absent", MISS)]
    kept = list(local)
    again = near.get("full")
    s = near_stats(near)
    check(
        got == ["abcd", "abcdefgh", MISS] and kept == ["full"] and again == "abcd" and s.hits == 1,
        f"near cache: a local LRUCache(2, max_weight=4, weigh=len); get 'full' ('abcd', weight "
        f"4: kept), 'long' ('abcdefgh': returned, too heavy to keep) and 'absent' (a miss), "
        f"then 'full' again. Each read's placeholder weighs 0 and goes once the read is over, "
        f"whatever its reply: the local cache keeps only 'full', and the last get is a hit. "
        f"Got {[g if g is not MISS else 'MISS' for g in got]}, local holding {kept}, then "
        f"{again!r}; {s}",
    )


@extended
@rule("near-read-your-writes")
def test_stage3_near_reads_its_own_writes_without_waiting_for_a_message(
    fleet: NearFleet,
) -> None:
    near, _ = fleet.near(started=False)  # nobody delivers messages: only its own writes count
    fleet.writer.put("k", "v1")
    assert near.get("k") == "v1" and near.get("k") == "v1"
    near.put("k", "v2")
    got = near.get("k")
    assert got == "v2", (
        f"near cache: put('k', 'v2') returned, so this client's get must see 'v2' at once "
        f"(read-your-writes) — not its cached 'v1', and not after some message; got {got!r}"
    )
    assert near.delete("k") is True
    got = near.get("k", MISS)
    assert got is MISS, f"near cache: after its own delete the key is gone; got {got!r}"
    near.put("k", "v3")
    assert near.get("k") == "v3" and near.get("k") == "v3"


@extended
@rule("near-read-your-writes")
def test_stage3_near_a_delete_forgets_the_local_entry_even_if_redis_had_none(
    fleet: NearFleet,
) -> None:
    near, _ = fleet.near(started=False)  # nobody delivers messages
    fleet.writer.put("k", "v1")
    assert near.get("k") == "v1" and near.get("k") == "v1"  # cached
    fleet.writer.delete("k")  # another client's delete: its message never comes
    found = near.delete("k")
    got = near.get("k", MISS)
    check(
        found is False and got is MISS,
        "near cache: steps: 'v1' cached; another client deletes 'k' (its message is never "
        "delivered); this client's delete('k') finds nothing in Redis (False) — and still, "
        "once it returned, this client's get must see the key gone (read-your-writes: the "
        f"writer drops its local entry after every write, found or not); got delete -> "
        f"{found!r}, get -> {'MISS' if got is MISS else repr(got)}",
    )


@extended
@rule("near-read-your-writes", "near-placeholder")
@pytest.mark.parametrize("write", ["put", "delete"])
def test_stage3_near_a_writer_forgets_its_entry_after_the_remote_write(
    fleet: NearFleet, write: str
) -> None:
    held = HeldWrite(fleet, "prompt:9", write)
    near, key, first = held.near, held.key, held.first
    assert near.get(key) == "v0"
    held.start()
    # The write is not on the server yet. Another thread of this client reads the key.
    near.get(key)
    held.finish()
    want = "v1" if write == "put" else MISS
    got = near.get(key, MISS)
    check(
        got is want or got == want,
        f"near cache: steps: 'v0' cached; this client's {write} of {key!r} starts, and "
        f"before its script reaches {first} another thread's get reads the key ('v0'); then "
        f"the {write} returns (no message delivered). Its get must see the write: expected "
        f"{'MISS' if want is MISS else repr(want)}, got {'MISS' if got is MISS else repr(got)} "
        f"— the writer drops its local entry after the remote write, not before (a read in "
        f"between re-caches the old value)",
    )


@extended
@rule("near-other-writes", "near-listener")
@pytest.mark.parametrize("k", ["k", "café ☕"], ids=["ascii", "non-ascii"])
def test_stage3_near_another_clients_write_arrives_by_message(fleet: NearFleet, k: str) -> None:
    near, _ = fleet.near()
    fleet.put_heard(near, k, "v1", since=0)  # no late message of it can count for 'v2'
    assert near.get(k) == "v1" and near.get(k) == "v1"
    fleet.put_heard(near, k, "v2", since=near_stats(near).invalidations)
    got = near.get(k)
    assert got == "v2", (
        f"near cache: 'v1' was cached; another client put 'v2' and its invalidations "
        f"were applied, so get({k!r}) must be 'v2'; got {got!r} (the message is the key "
        "as the caller named it)"
    )
    assert near.get(k) == "v2"
    fleet.writer.delete(k)
    eventually(
        lambda: near.get(k, MISS) is MISS,
        f"another client's delete({k!r}) to reach this near cache by an invalidation message "
        "(it held 'v2')",
    )


@extended
@rule("near-placeholder", "near-no-lock-over-io")
def test_stage3_near_an_invalidation_that_overtakes_the_reply_wins(fleet: NearFleet) -> None:
    near, taps = fleet.near(taps=("GET",))
    fleet.put_heard(near, "k", "v1", since=0)  # no late message of it can take the placeholder
    tap, reader = held_read(fleet, near, taps, "k")
    # The reply 'v1' is on the wire. Another client writes; both replicas' messages land.
    fleet.put_heard(near, "k", "v2", since=near_stats(near).invalidations)
    got = reply_lands(tap, reader, near, read="v1")
    assert got == "v2", (
        "near cache: steps: get('k') misses and reads 'v1' from Redis; before that reply "
        "is stored, another client puts 'v2' and its invalidation arrives; then the reply "
        f"lands. It must be discarded (its placeholder is gone), so get('k') == 'v2'; got "
        f"{got!r} — the near cache stored a reply the invalidation had overtaken"
    )
    assert near_stats(near).discarded == 1, near_stats(near)


@extended
@rule("near-writer-never-stores", "near-no-lock-over-io")
def test_stage3_near_a_writer_never_caches_the_value_it_wrote(fleet: NearFleet) -> None:
    near, taps = fleet.near(taps=("EVALSHA", "EVAL"))
    near.put("k", "v0")  # loads the scripts
    v0_messages = fleet.copies("k", "v0")  # counted, not awaited: they may still be in flight
    last = fleet.writer.replicas_for("k")[-1]
    taps[last].arm()
    writer = spawn(lambda: near.put("k", "v1"), "writer")
    assert taps[last].reached.wait(DEADLINE_S), "near cache: put runs a script per replica"
    # 'v1' is on every replica, the last reply on the wire: another client overwrites it,
    # and every message so far (of 'v0', 'v1' and 'v2') is applied before the put returns.
    fleet.put_heard(near, "k", "v2", since=0, also=v0_messages + fleet.copies("k", "v1"))
    taps[last].release.set()
    writer.outcome("the held put must finish")
    got = near.get("k")
    assert got == "v2", (
        "near cache: steps: put('k', 'v1') writes both replicas; before it returns, "
        "another client puts 'v2' and every invalidation has arrived; then put returns. "
        f"Redis holds 'v2', so get('k') == 'v2'; got {got!r} — a writer must not store the "
        "value it wrote (a later write's invalidation may already have come and gone)"
    )


@extended
@rule("near-flush", "near-recache", "near-listener")
def test_stage3_near_flushes_when_its_channel_drops(fleet: NearFleet) -> None:
    proxies = fleet.proxies()
    near, _ = fleet.near(pubsub_proxies=proxies)
    fleet.put_heard(near, "k", "v1", since=0)  # only the flush may take 'v1' out
    assert near.get("k") == "v1" and near.get("k") == "v1"
    cut(proxies, near)
    fleet.writer.put("k", "v2")  # its invalidation cannot reach the near cache
    got = near.get("k")
    assert got == "v2", (
        "near cache: steps: 'v1' cached; every invalidation channel drops; another client "
        f"puts 'v2' (the message is lost). get('k') must be 'v2' — got {got!r}: a dropped "
        "channel means lost messages, so the whole local cache must be flushed"
    )
    fleet.writer.put("k", "v3")
    got = near.get("k")
    assert got == "v3", (
        "near cache: while the channels are down nothing may be cached (no message would "
        f"invalidate it): after another put of 'v3', get('k') must be 'v3'; got {got!r}"
    )
    heal(proxies, near)
    hits = near_stats(near).hits
    assert near.get("k") == "v3" and near.get("k") == "v3"
    assert near_stats(near).hits == hits + 1, (
        "near cache: once the channels are subscribed again, reads are cached again"
    )
    fleet.writer.put("k", "v4")
    eventually(lambda: near.get("k") == "v4", "invalidations to flow again")


@extended
@rule("near-flush", "near-placeholder")
def test_stage3_near_a_read_in_flight_across_a_drop_is_not_cached(fleet: NearFleet) -> None:
    proxies = fleet.proxies()
    near, taps = fleet.near(pubsub_proxies=proxies, taps=("GET",))
    fleet.put_heard(near, "k", "v1", since=0)  # only the flush may take the placeholder
    tap, reader = held_read(fleet, near, taps, "k")
    cut(proxies, near)
    fleet.writer.put("k", "v2")  # lost to the near cache
    heal(proxies, near)
    got = reply_lands(tap, reader, near, read="v1")
    assert got == "v2", (
        "near cache: steps: get('k') reads 'v1'; before the reply is stored the channels "
        "drop, another client puts 'v2' (message lost), the channels come back; then the "
        f"reply lands. It must be discarded (the flush took its placeholder); got {got!r}"
    )


@extended
@rule("near-flush", "near-listener")
def test_stage3_near_a_channel_that_stays_down_is_flushed_once(fleet: NearFleet) -> None:
    proxies = fleet.proxies()
    near, _ = fleet.near(pubsub_proxies=proxies)
    before = near_stats(near).flushes
    for p in proxies.values():
        p.reset_counts()
    cut(proxies, near)
    eventually(
        lambda: all(p.counts().refused >= 3 for p in proxies.values()),
        "each listener to try to subscribe again 3 times while its node is unreachable",
    )
    flushes = near_stats(near).flushes - before
    check(
        flushes == len(NODES),
        f"near cache: the {len(NODES)} channels dropped and stayed down while each listener "
        f"tried 3 times to subscribe again: one flush per channel lost ({len(NODES)}), none "
        f"for an attempt that never subscribed; got {flushes}",
    )
    heal(proxies, near)


@extended
@rule("near-node-restart", "near-listener")
@pytest.mark.redis_faults
def test_stage3_near_a_node_killed_and_restarted(fleet: NearFleet) -> None:
    near, _ = fleet.near()
    keys = [f"doc:{i}" for i in range(30)]
    for key in keys:  # each put's messages applied: only n0's death may take 'old' out
        fleet.put_heard(near, key, "old", since=near_stats(near).invalidations)
        assert near.get(key) == "old"
    fleet.nodes["n0"].stop()
    eventually(
        lambda: "n0" not in near.subscribed,
        "the near cache to notice n0's channel dropped when n0 stopped",
    )
    for key in keys:
        fleet.writer.put(key, "new")
    for key in keys:
        got = near.get(key)
        assert got == "new", (
            f"near cache: n0 died (its channel with it), other nodes took the write of "
            f"{key!r}; the near cache must not serve 'old'; got {got!r}"
        )
    fleet.nodes["n0"].start()
    eventually(
        lambda: near.subscribed == set(NODES),
        "the near cache to subscribe n0's channel again after n0 restarted",
    )
    for key in keys:
        assert near.get(key) == "new"


@extended
@rule("near-listener", "near-all-replicas-subscribed")
def test_stage3_near_a_channel_is_ready_only_once_the_server_confirmed_it(
    fleet: NearFleet,
) -> None:
    clients = {n: node.client() for n, node in fleet.nodes.items()}
    held = {n: HeldSubscribe(c) for n, c in clients.items()}
    near = fleet.adopt(near_cache(fleet.sharded(clients), lru(100)))
    near.start()
    for h in held.values():
        h.wait_held()  # each listener sent SUBSCRIBE; the server has not seen it
    early = near.subscribed
    fleet.writer.put("k", "v1")
    first = near.get("k")
    fleet.writer.put("k", "v2")  # published while no subscription is on any server
    for h in held.values():
        h.release()
    eventually(
        lambda: near.subscribed == set(NODES),
        "the near cache's channels to be subscribed once the SUBSCRIBEs reach the servers",
    )
    got = near.get("k")
    check(
        not early and (first, got) == ("v1", "v2"),
        f"near cache: steps: started, each listener's SUBSCRIBE held back before the server "
        f"saw it; get('k') reads 'v1'; another client puts 'v2' (its message reaches no "
        f"one); the SUBSCRIBEs arrive and are confirmed; get('k'). channel_ready comes only "
        f"with the confirmation: expected subscribed empty before it (got {sorted(early)}), "
        f"and 'v1' then 'v2' (got {first!r} then {got!r}) — a channel taken as ready when "
        f"SUBSCRIBE was only sent caches values whose invalidations nobody hears",
    )


@extended
@rule("near-all-replicas-subscribed", "near-recache")
def test_stage3_near_caches_a_key_only_while_all_its_replicas_are_subscribed(
    fleet: NearFleet,
) -> None:
    key = "prompt:7"
    fleet.writer.put(key, "v")
    replicas = fleet.writer.replicas_for(key)
    other = next(n for n in NODES if n not in replicas)
    subsets = [set(), {replicas[0]}, {replicas[1]}, {other}, {replicas[0], other}]
    subsets.append({replicas[1], other})
    for ready in subsets:
        near = unstarted(fleet, ready)
        got = [near.get(key), near.get(key)]
        s = near_stats(near)
        check(
            got == ["v", "v"] and (s.hits, s.misses) == (0, 2),
            f"near cache: {key!r} lives on {replicas}; with only {sorted(ready)} "
            f"subscribed a write could reach a replica whose channel nobody hears, so get "
            f"reads through and caches nothing: two gets, both misses (each went to Redis), "
            f"0 hits; got {got}, {s}",
        )
    near = unstarted(fleet, set(NODES))
    near.channel_lost(other)  # not a replica of the key: it flushes, but the key may stay
    got = [near.get(key), near.get(key)]
    check(
        got == ["v", "v"] and near_stats(near).hits == 1,
        f"near cache: with both replicas {replicas} subscribed (only {other} lost) the "
        f"key is cached: the second get is a hit; got {got}, {near_stats(near)}",
    )


@extended
@rule("near-placeholder")
@pytest.mark.parametrize("stored", [True, False], ids=["a-stored-key", "an-absent-key"])
def test_stage3_near_a_get_that_finds_a_placeholder_misses(fleet: NearFleet, stored: bool) -> None:
    near, taps = fleet.near(started=False, taps=("GET",))
    key, want = ("k", "v1") if stored else ("absent", "default")
    if stored:
        fleet.writer.put(key, "v1")
    tap = taps[fleet.writer.replicas_for(key)[0]]
    tap.arm()
    first = spawn(lambda: near.get(key, "default"), "first reader")
    check(tap.reached.wait(DEADLINE_S), "near cache: a miss must GET from Redis")
    # The first read's placeholder is in the local cache, its reply on the wire.
    second = spawn(lambda: near.get(key, "default"), "second reader")
    got = second.outcome("a get that finds another read's placeholder reads Redis itself")
    tap.release.set()
    first.outcome("the first read returns")
    s = near_stats(near)
    check(
        got == want and (s.hits, s.misses) == (0, 2),
        f"near cache: steps: {'put(k, v1) by another client; ' if stored else ''}a get of "
        f"{key!r} misses and its reply is held on the wire; a second get of {key!r} finds "
        f"the first one's placeholder. A placeholder is never a value: the second get "
        f"misses and returns {want!r} (what Redis holds, or its default); got {got!r}, "
        f"hits {s.hits}, misses {s.misses} (expected 0 and 2)",
    )


@extended
@rule("near-placeholder", "near-other-writes")
def test_stage3_near_a_miss_is_not_cached(fleet: NearFleet) -> None:
    near, _ = fleet.near(started=False)  # nobody delivers messages
    got = [near.get("nokey", "d1"), near.get("nokey"), near.get("nokey", "d2")]
    s = near_stats(near)
    check(
        got == ["d1", None, "d2"] and (s.hits, s.misses) == (0, 3),
        f"near cache: three gets of a key Redis does not hold, with defaults 'd1', none and "
        f"'d2': a miss is not cached, so each asks Redis and returns its own default; "
        f"expected ['d1', None, 'd2'] with 3 misses; got {got}, {s}",
    )
    fleet.writer.put("nokey", "v")  # its message is never delivered
    got_after = near.get("nokey", MISS)
    check(
        got_after == "v",
        f"near cache: another client puts 'nokey' (no message delivered): a miss was never "
        f"cached, so this get must find 'v'; got {'MISS' if got_after is MISS else got_after!r}",
    )


@extended
@rule("near-placeholder", "only-outages-fail-over")
@pytest.mark.parametrize("position", [0, 1], ids=["first-replica", "second-replica"])
def test_stage3_near_a_get_that_raised_leaves_no_placeholder(
    fleet: NearFleet, position: int
) -> None:
    """A read that ends by an error (a WRONGTYPE reply: not an outage, so it propagates)
    is over too: its placeholder goes, as after a value or a miss. Left behind, it would
    hold a slot of the local cache that no read will ever land on, pushing out values."""
    local = lru(2)
    near = unstarted(fleet, set(NODES), local)  # nobody delivers messages
    fleet.writer.put("hot", "h")
    fleet.writer.put("warm", "w")
    key = "wrong-type"
    replicas = fleet.writer.replicas_for(key)
    holder = replicas[position]  # before it, the key's replicas miss: the read goes on
    fleet.nodes[holder].client().rpush(fleet.writer.key_name(holder, key), "not a string")
    assert near.get("hot") == "h"  # kept near
    with pytest.raises(redis.ResponseError):
        near.get(key)
        raise AssertionError(
            f"near cache: get({key!r}) with a list under its key name on {holder} must raise "
            f"the WRONGTYPE reply (an error that is not an outage propagates)"
        )
    kept = list(local)
    assert near.get("warm") == "w"
    before = near_stats(near)
    got = near.get("hot")
    after = near_stats(near)
    check(
        kept == ["hot"] and got == "h" and after.hits == before.hits + 1,
        f"near cache: a local LRUCache(2); get('hot') keeps 'h' near; get({key!r}) raises, "
        f"{holder} (replica {position + 1} of {replicas}) answering WRONGTYPE; get('warm') "
        f"reads 'w'. A read that raised is over: its placeholder goes, so the local cache "
        f"holds 'hot' alone, then 'hot' and 'warm', and 'hot' is still a hit. Local cache "
        f"after the error: {kept} (expected ['hot']); get('hot') -> {got!r}, "
        f"{'a hit' if after.hits == before.hits + 1 else 'a miss: pushed out'}",
    )


@extended
@rule("near-own-placeholder", "near-placeholder")
def test_stage3_near_each_read_stores_only_over_its_own_placeholder(fleet: NearFleet) -> None:
    key = "prompt:8"
    clients = {n: node.client() for n, node in fleet.nodes.items()}
    first = fleet.writer.replicas_for(key)[0]
    holds = Holds(clients[first], "GET")
    near = unstarted(fleet, set(NODES), clients=clients)
    fleet.writer.put(key, "v1")
    holds.armed = True
    try:
        early = spawn(lambda: near.get(key), "early reader")
        holds.wait(1)  # its reply 'v1' is on the wire
        fleet.writer.put(key, "v2")
        near.invalidate(key)  # the message of 'v2' removes the early read's placeholder
        late = spawn(lambda: near.get(key), "late reader")
        holds.wait(2)  # its reply 'v2' is on the wire, its placeholder in the cache
        holds.held[0].set()  # the early reply ('v1') lands first
        assert early.outcome("the early read returns") == "v1"
        holds.held[1].set()
        assert late.outcome("the late read returns") == "v2"
    finally:
        holds.release_all()
    got = near.get(key)
    check(
        got == "v2",
        "near cache: steps: a get reads 'v1'; another client puts 'v2' and its message "
        "removes that read's placeholder; a second get puts its own placeholder and reads "
        "'v2'; the 'v1' reply lands, then the 'v2' one. A reply is stored only over its own "
        f"placeholder, so 'v1' is discarded and 'v2' kept; get('k') must be 'v2', got {got!r}",
    )
    check(near_stats(near).discarded == 1, f"near cache: one discarded: {near_stats(near)}")


@extended
@rule("near-own-placeholder", "near-placeholder")
@pytest.mark.parametrize("lands_first", ["early-lands-first", "late-lands-first"])
@pytest.mark.parametrize("early_reads", ["a-value", "a-miss"])
def test_stage3_near_a_reply_that_finds_another_reads_placeholder_leaves_it_alone(
    fleet: NearFleet, early_reads: str, lands_first: str
) -> None:
    key = "prompt:8"
    clients = {n: node.client() for n, node in fleet.nodes.items()}
    first, second = fleet.writer.replicas_for(key)
    holds = {name: Holds(clients[name], "GET") for name in (first, second)}
    near = unstarted(fleet, set(NODES), clients=clients)  # the test delivers the one message
    if early_reads == "a-value":
        fleet.writer.put(key, "v1")
    for h in holds.values():
        h.armed = True
    try:
        early = spawn(lambda: near.get(key, MISS), "early reader")
        holds[first].wait(1)
        if early_reads == "a-miss":  # a miss on the first replica goes on to the second
            holds[first].held[0].set()
            holds[second].wait(1)
        early_reply = holds[second if early_reads == "a-miss" else first].held[0]
        fleet.writer.put(key, "v2")
        near.invalidate(key)  # the message of 'v2' removes the early read's placeholder
        late = spawn(lambda: near.get(key, MISS), "late reader")
        holds[first].wait(2)  # its reply 'v2' is on the wire, its placeholder in the cache
        late_reply = holds[first].held[1]
        want_early = "v1" if early_reads == "a-value" else MISS
        landings = [(early_reply, early, want_early), (late_reply, late, "v2")]
        if lands_first == "late-lands-first":
            landings.reverse()
        for reply, reader, want in landings:
            reply.set()
            answer = reader.outcome("a held read returns")
            check(
                answer is want or answer == want,
                f"near cache: a held read returns what Redis answered it, "
                f"{'MISS' if want is MISS else repr(want)}; got "
                f"{'MISS' if answer is MISS else repr(answer)}",
            )
    finally:
        for h in holds.values():
            h.release_all()
    before = near_stats(near)
    got = near.get(key, MISS)
    after = near_stats(near)
    shown = "'v1'" if early_reads == "a-value" else "a miss"
    check(
        got == "v2" and after.hits == before.hits + 1 and before.discarded == 1,
        f"near cache: steps: a get of {key!r} reads {shown}, its reply held on the wire; "
        f"another client puts 'v2' and its message removes that read's placeholder; a second "
        f"get puts its own placeholder and reads 'v2'; the replies land, "
        f"{'the early one first' if lands_first == 'early-lands-first' else 'the late one first'}"
        f". Each read stores (or, for a miss, removes) only its own placeholder: the early "
        f"reply is discarded and leaves the late read's slot alone, and 'v2' is kept — the next "
        f"get is a hit. Expected 'v2', a hit and 1 discarded; got "
        f"{'MISS' if got is MISS else repr(got)}, {after.hits - before.hits} hit, "
        f"{before.discarded} discarded",
    )


@extended
@rule("near-read-your-writes", "near-placeholder")
@pytest.mark.parametrize("write", ["put", "delete"])
def test_stage3_near_a_write_drops_the_placeholder_of_a_read_in_flight(
    fleet: NearFleet, write: str
) -> None:
    key = "prompt:8"
    clients = {n: node.client() for n, node in fleet.nodes.items()}
    holds = Holds(clients[fleet.writer.replicas_for(key)[0]], "GET")
    near = unstarted(fleet, set(NODES), clients=clients)  # nobody delivers messages
    fleet.writer.put(key, "v1")
    holds.armed = True
    try:
        reader = spawn(lambda: near.get(key), "reader")
        holds.wait(1)  # its reply 'v1' is on the wire, its placeholder in the cache
        near.put(key, "v2") if write == "put" else near.delete(key)
        holds.held[0].set()
        assert reader.outcome("the read in flight returns") == "v1"
    finally:
        holds.release_all()
    want = "v2" if write == "put" else MISS
    got = near.get(key, MISS)
    check(
        got == want,
        f"near cache: steps: a get of {key!r} reads 'v1', its reply held on the wire; this "
        f"client's {write} returns; the reply lands. The writer drops its local entry after "
        f"the write, a placeholder too, so the old reply is not stored: get must see the "
        f"write ({'MISS' if want is MISS else repr(want)}), got "
        f"{'MISS' if got is MISS else repr(got)}",
    )


@extended
@rule("near-read-your-writes")
@pytest.mark.parametrize("write", ["put", "delete"])
def test_stage3_near_a_write_that_raised_still_forgets_the_local_entry(
    fleet: NearFleet, write: str
) -> None:
    key = "prompt:9"
    proxies = fleet.proxies()
    clients = {n: fleet.nodes[n].proxied_client(p) for n, p in proxies.items()}
    near = unstarted(fleet, set(NODES), clients=clients)  # nobody delivers messages
    fleet.writer.put(key, "v1")
    assert near.get(key) == "v1" and near.get(key) == "v1"  # cached
    for p in proxies.values():
        p.outage()
    try:
        near.put(key, "v2") if write == "put" else near.delete(key)
    except NoReplicaAvailable:
        pass
    else:
        raise AssertionError(f"near cache: a {write} with every node unreachable must raise")
    for p in proxies.values():
        p.heal()
    before = near_stats(near)
    near.get(key)
    after = near_stats(near)
    check(
        (after.hits, after.misses) == (before.hits, before.misses + 1),
        f"near cache: 'v1' cached; this client's {write} raised (every node unreachable) — "
        f"a write that fails may still have reached a replica, so the writer drops its "
        f"local entry after a failure too: the next get must go to Redis (a miss), not "
        f"serve 'v1' (a hit); statistics before {before}, after {after}",
    )


@extended
@rule("near-no-lock-over-io")
@pytest.mark.parametrize("write", ["put", "delete"])
def test_stage3_near_a_write_on_the_wire_holds_up_no_hit_and_no_message(
    fleet: NearFleet, write: str
) -> None:
    held = HeldWrite(fleet, "prompt:9", write)
    near = held.near
    fleet.writer.put("other", "o")
    assert near.get("other") == "o"  # cached: the next get is a hit
    held.start()
    try:

        def hit_and_message() -> object:
            got = near.get("other")
            near.invalidate("elsewhere")
            return got

        got = spawn(hit_and_message, "hit and message").outcome(
            f"a hit on another key and a message for another key, while this client's "
            f"{write} waits for {held.first}: the near cache never holds its lock over a network "
            f"call, so neither waits for the {write}"
        )
        check(
            got == "o" and held.still_held(),
            f"near cache: while this client's {write} waits for {held.first}, a hit on "
            f"'other' returns 'o' at once, without waiting for the {write} — got {got!r}, "
            f"{'before' if held.still_held() else 'only after'} the {write} went on",
        )
    finally:
        held.finish()


@extended
@rule("near-placeholder", "near-own-placeholder")
def test_stage3_near_a_reply_is_stored_in_the_lock_section_that_found_its_placeholder(
    fleet: NearFleet,
) -> None:
    key = "prompt:8"
    clients = {n: node.client() for n, node in fleet.nodes.items()}
    holds = Holds(clients[fleet.writer.replicas_for(key)[0]], "GET")
    module = stage().NearCache.__module__
    arm, landing, invalidated = threading.Event(), threading.Event(), threading.Event()
    base: type[Any] = stage(1).LRUCache

    class Local(base):  # type: ignore[misc]
        """Once armed, the reader's look for its placeholder makes it stop right after
        each lock section it leaves, until the message below has been applied."""

        def get(self, k: str, default: Any = None) -> Any:
            if arm.is_set() and not landing.is_set():
                landing.set()
                pause_after_unlocks(module, invalidated.is_set, invalidated.is_set, 0.2)
            return super().get(k, default)

    near = unstarted(
        fleet, set(NODES), Local(100), clients=clients
    )  # the test delivers the one message
    fleet.writer.put(key, "v1")
    holds.armed = True
    try:
        reader = spawn(lambda: near.get(key), "reader")
        holds.wait(1)  # its reply 'v1' is on the wire, its placeholder in the cache
        fleet.writer.put(key, "v2")  # another client's write; its message comes below
        arm.set()
        holds.held[0].set()  # the reply lands
        check(landing.wait(DEADLINE_S), "near cache: the reply must look for its placeholder")
        near.invalidate(key)  # the message of 'v2', as the reply is being stored
        invalidated.set()
        assert reader.outcome("the read returns") == "v1"
    finally:
        holds.release_all()
    got = near.get(key)
    check(
        got == "v2",
        "near cache: steps: a get reads 'v1'; another client puts 'v2'; the reply lands and "
        "finds its placeholder, and the message of 'v2' arrives right after that look. The "
        "look and the store are one lock section: either the reply is stored before the "
        "message (which then drops it) or the message takes the placeholder first. "
        f"get('k') must be 'v2', got {got!r} — the reply was stored after the message, "
        "in a second lock section",
    )


@extended
@rule("near-ttl-bound")
def test_stage3_near_a_ttl_local_cache_bounds_a_silent_channel(fleet: NearFleet) -> None:
    clock, ttl = ManualClock(), 10 * NS_PER_S
    near = unstarted(fleet, set(NODES), stage(1).TTLCache(100, ttl, clock=clock))
    fleet.writer.put("k", "v1")
    assert near.get("k") == "v1"
    fleet.writer.put("k", "v2")  # its messages never come: a channel that died silently
    clock.advance(ttl - 1)
    stale = near.get("k")
    clock.advance(1)
    fresh = near.get("k")
    check(
        (stale, fresh) == ("v1", "v2"),
        f"near cache: with a TTLCache(ttl_ns=10 s) as the local cache and no message ever "
        f"delivered, 'v1' may be served until 10 s after it was fetched, and not at 10 s: "
        f"expected 'v1' then 'v2', got {stale!r} then {fresh!r}",
    )


TestStage3NearCacheAdversarialOrder = extended(
    pytest.mark.rule("near-guarantee", "near-placeholder", "near-read-your-writes")(
        walked(NearCacheMachine, NEAR_WALKS)
    )
)
TestStage3NearCacheAdversarialOrder.settings = settings(heavy, stateful_step_count=40)
