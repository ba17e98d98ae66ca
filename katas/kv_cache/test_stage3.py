"""Stage 3 suite: a cache sharded over Redis nodes (see katas/kv_cache/README.md).

Core: ``HashRing`` (consistent hashing with virtual nodes) and ``ShardedCache`` (R
replicas, failover, epochs on rejoin) over three Redis nodes — three fakeredis servers
by default, three private ``redis-server`` processes with
``KATA_REDIS_SERVER=redis-server``. The near cache (extended) has its own file,
test_stage3_near.py.

The map of this file:

- ring, examples: preference lists, bad input (a name of the wrong type), the empty
  ring, balance, adding and removing a node, placement by the set of nodes, the same
  placement in every process;
- ring, properties: the same bounds on drawn node names, counts and vnodes;
- cache, examples: JSON round trips, delete's answer, exactly R replicas on its ring,
  TTLs (the PX sent, exactly), bad arguments and clients;
- cache, faults: failover (a miss is none, nor a last replica down), writes needing one
  replica, epochs on rejoin (the probe already under the new one) and their reclaiming
  (on a node full of other keys too), restarts, the probe interval, timeouts, BUSY,
  errors that are no outage;
- the state machine (``_testing/shards.py``): one client's reads while nodes stop, start
  and restart — never an older value.

How the ring's statistics are checked without flakiness (``_testing/rings.py``):

- The spec's own bounds (max load <= 1.25x the mean; adding an (n+1)-th node moves
  0.8-1.2x of a 1/(n+1) share) are checked on fixed node names ``node-0 ...`` with 160
  vnodes: deterministic, and with margin for any sound ring (a node's share has a
  relative spread of about 1/sqrt(vnodes), 8% at 160).
- The hypothesis properties draw node names, counts and vnodes, and bound the same
  quantities by ``SIGMAS`` standard deviations derived from vnodes and the number of
  keys: ``sqrt(1/vnodes + nodes/keys)``. A ring without working virtual nodes (spread
  about 1) fails them; a sound one essentially never does.
- What must hold exactly — keys move only onto an added node, only off a removed one,
  the same placement in every process — is checked exactly.
"""

from __future__ import annotations

import json
import os
import threading
from collections import Counter
from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st

from katas._harness.child import run_once
from katas._harness.marks import core, processes, rule
from katas._harness.redis import RedisEnv
from katas._harness.story import check, expect, not_refused
from katas._harness.under_test import stage
from katas._registry import impl
from katas.kv_cache._testing import placement
from katas.kv_cache._testing.refusals import refusal
from katas.kv_cache._testing.rings import (
    KEYS,
    PROPERTY_KEYS,
    SIGMAS,
    fail_fast_on_stubs,  # noqa: F401 (autouse)
    node_names,
    owners,
    ring,
    sigma,
    vnode_counts,
)
from katas.kv_cache._testing.shards import (
    MISS,
    NODES,
    ShardedCacheMachine,
    after_100_calls,
    behind_a_proxy,
    heavy,
    holders,
    make_cache,
    node_stats,
    read_despite_faults,
    recorded_cache,
    sharded,
    stored,
)
from katas.kv_cache._testing.wire import HoldBefore, Sent, ttl_ms
from katas.kv_cache.api import NS_PER_MS, NS_PER_S, ManualClock, NoReplicaAvailable

pytestmark = [pytest.mark.stage(3)]

# --------------------------------------------------------------------------- ring: examples


@core
@rule("preference-lists")
def test_stage3_preference_list_is_distinct_nodes_clockwise() -> None:
    r = ring(["a", "b", "c", "d"])
    for key in KEYS[:500]:
        full = r.nodes_for(key, 4)
        assert sorted(full) == ["a", "b", "c", "d"], (
            f"nodes_for({key!r}, 4) on a 4-node ring is every node once; got {full}"
        )
        for m in (1, 2, 3):
            assert r.nodes_for(key, m) == full[:m], (
                f"a preference list is one walk round the ring, so "
                f"nodes_for({key!r}, {m}) is a prefix of nodes_for({key!r}, 4)={full}; "
                f"got {r.nodes_for(key, m)}"
            )
        assert r.node_for(key) == full[0]
        assert r.nodes_for(key, 9) == full, "more than the ring holds: every node, once"
    assert r.nodes == ["a", "b", "c", "d"] and len(r) == 4 and "c" in r and "e" not in r
    assert r.vnodes == 160


@core
@rule("ring-bad-input")
def test_stage3_ring_rejects_bad_input() -> None:
    for bad in (0, -1, 2**16 + 1, 2**63):  # 2^63 would allocate until the process died
        with pytest.raises(ValueError, match="vnodes"):
            ring(["a"], vnodes=bad)
    with pytest.raises(ValueError, match="'a'"):
        ring(["a", "b", "a"])
    r = ring(["a", "b"])
    with pytest.raises(ValueError, match="'b'"):
        r.add("b")
    with pytest.raises(ValueError, match="'zed'"):
        r.remove("zed")
    for n in (0, -2):
        with pytest.raises(ValueError, match="n"):
            r.nodes_for("k", n)
    placed = {key: r.nodes_for(key, 2) for key in KEYS[:50]}
    with pytest.raises(ValueError, match="node"):
        r.add("\ud800")  # a lone surrogate: UTF-8 cannot encode it, so it cannot be hashed
    with pytest.raises(TypeError, match="key"):
        r.nodes_for(1, 1)  # type: ignore[arg-type]  # a key that is no str, on purpose
    assert r.nodes == ["a", "b"], "a refused add/remove changes nothing"
    moved = [key for key in placed if r.nodes_for(key, 2) != placed[key]]
    assert not moved, f"a refused add must leave no virtual node behind: {moved[:5]} moved"
    with pytest.raises(TypeError, match="nodes"):
        ring("abc")  # type: ignore[arg-type]  # three nodes 'a', 'b', 'c'? A mistake: refuse
    empty = ring([])
    with pytest.raises(TypeError, match="key"):
        empty.nodes_for(1, 1)  # type: ignore[arg-type]  # an empty ring checks its input too
    for n in (0, -2):
        with pytest.raises(ValueError, match="n"):
            empty.nodes_for("k", n)


@core
@rule("ring-bad-input")
def test_stage3_a_node_name_that_is_not_a_str_is_a_type_error() -> None:
    r = ring(["a", "b"])
    placed = {key: r.nodes_for(key, 2) for key in KEYS[:50]}
    got: dict[str, str] = {}
    bad_names: tuple[Any, ...] = (1, None, b"c")
    for bad in bad_names:
        got[f"HashRing([{bad!r}])"] = refusal(partial(ring, [bad]))
        got[f"ring.add({bad!r})"] = refusal(partial(r.add, bad))
    moved = [key for key in placed if r.nodes_for(key, 2) != placed[key]]
    check(
        got == dict.fromkeys(got, "TypeError") and r.nodes == ["a", "b"] and not moved,
        f"a node name that is not a str is a TypeError, as a key that is not a str is (a "
        f"ValueError is for a str the ring cannot take), and a refused add changes nothing. "
        f"Expected TypeError from each call and the ring ['a', 'b'] as placed; got {got}, "
        f"nodes {r.nodes}, keys moved {moved[:5]}",
    )


@core
@rule("ring-bad-input", "cache-bad-input")
def test_stage3_vnodes_at_both_ends_of_the_range_are_accepted(redis_env: RedisEnv) -> None:
    for vnodes in (1, 2**16):
        with not_refused(
            f"vnodes may be anything in [1, 65536], both ends included: "
            f"HashRing(['a', 'b'], vnodes={vnodes})",
            ValueError,
        ):
            r = ring(["a", "b"], vnodes=vnodes)
        expect(r.vnodes, vnodes, f"HashRing(['a', 'b'], vnodes={vnodes}).vnodes")
        placed = sorted(r.nodes_for(k, 2) for k in KEYS[:3])
        check(all(sorted(p) == ["a", "b"] for p in placed), f"vnodes={vnodes}: {placed}")
    clients = {name: node.client() for name, node in zip(NODES, redis_env.servers(3), strict=True)}
    with not_refused("ShardedCache(nodes, vnodes=65536) must be accepted", ValueError):
        cache = sharded(clients, vnodes=2**16)
    expect(cache.ring.vnodes, 2**16, "ShardedCache(nodes, vnodes=65536).ring.vnodes")


@core
@rule("empty-ring")
def test_stage3_empty_ring() -> None:
    r = ring([])
    assert r.nodes_for("k", 2) == [] and len(r) == 0
    with pytest.raises(LookupError):
        r.node_for("k")
    r.add("only")
    assert r.node_for("k") == "only" and r.nodes_for("k", 3) == ["only"]
    r.remove("only")
    assert r.nodes_for("k", 1) == []


@core
@rule("balance")
@pytest.mark.parametrize("n", [3, 5, 8])
def test_stage3_load_is_balanced_with_160_vnodes(n: int) -> None:
    names = [f"node-{i}" for i in range(n)]
    load = Counter(owners(ring(names), KEYS))
    mean = len(KEYS) / n
    worst, count = max(load.items(), key=lambda item: item[1])
    assert count <= 1.25 * mean, (
        f"with 160 vnodes no node may hold more than 1.25x the mean share; over "
        f"{len(KEYS)} keys on {n} nodes the mean is {mean:.0f} but {worst} holds {count} "
        f"({count / mean:.2f}x) — are the virtual nodes really spread over the ring? "
        f"load: {dict(sorted(load.items()))}"
    )


@core
@rule("add-node")
@pytest.mark.parametrize("n", [3, 5, 8])
def test_stage3_adding_a_node_moves_a_fair_share_only_onto_it(n: int) -> None:
    names = [f"node-{i}" for i in range(n)]
    r = ring(names)
    before = owners(r, KEYS)
    r.add(f"node-{n}")
    after = owners(r, KEYS)
    moved = [(k, a, b) for k, a, b in zip(KEYS, before, after, strict=True) if a != b]
    elsewhere = [m for m in moved if m[2] != f"node-{n}"]
    assert not elsewhere, (
        f"adding node-{n} may move keys only onto node-{n}; "
        f"{len(elsewhere)} moved elsewhere, e.g. {elsewhere[:3]} (modulo hashing?)"
    )
    share = len(moved) / len(KEYS) * (n + 1)
    assert 0.8 <= share <= 1.2, (
        f"adding an {n + 1}th node should move about 1/{n + 1} of the keys "
        f"(0.8x..1.2x); it moved {len(moved)} of {len(KEYS)} = {share:.2f}x that share"
    )


@core
@rule("remove-node")
@pytest.mark.parametrize("n", [4, 6])
def test_stage3_removing_a_node_moves_only_its_keys(n: int) -> None:
    names = [f"node-{i}" for i in range(n)]
    r = ring(names)
    before = owners(r, KEYS)
    r.remove("node-1")
    after = owners(r, KEYS)
    wrong = [(k, a, b) for k, a, b in zip(KEYS, before, after, strict=True) if a != b]
    wrong = [m for m in wrong if m[1] != "node-1"]
    assert not wrong, (
        f"removing node-1 may move only the keys node-1 held; {len(wrong)} others "
        f"moved, e.g. {wrong[:3]}"
    )
    assert "node-1" not in after


@core
@rule("placement-by-set")
def test_stage3_placement_ignores_the_order_nodes_joined() -> None:
    names = [f"node-{i}" for i in range(6)]
    grown = ring([])
    for name in reversed(names):
        grown.add(name)
    first = ring(names)
    reference = [first.nodes_for(k, 3) for k in KEYS[:2_000]]
    for other in (ring(list(reversed(names))), grown):
        got = [other.nodes_for(k, 3) for k in KEYS[:2_000]]
        diff = [(k, a, b) for k, a, b in zip(KEYS, reference, got, strict=False) if a != b]
        assert not diff, (
            f"placement must depend on the set of nodes only, not on the order "
            f"they joined; {len(diff)} keys differ, e.g. {diff[:2]}"
        )


@core
@rule("stable-hash")
@processes
def test_stage3_placement_is_identical_across_processes(impl_selection: impl.Selection) -> None:
    nodes = [f"cache-{i}.internal" for i in range(5)]
    keys = KEYS[:1_000]
    mine = ring(nodes)
    here = [mine.nodes_for(k, 3) for k in keys]
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        placed = run_once(
            placement.TARGET, impl_selection, stdin=json.dumps([nodes, keys]), env=env
        )
        there = json.loads(placed)
        diff = [(k, a, b) for k, a, b in zip(keys, here, there, strict=True) if a != b]
        assert not diff, (
            f"every process must place every key on the same nodes; with "
            f"PYTHONHASHSEED={seed} {len(diff)} of {len(keys)} keys differ, e.g. {diff[:2]} — "
            f"Python's hash() of a str is salted per process: use hashlib"
        )


# --------------------------------------------------------------------------- ring: properties


@core
@rule("add-node")
@given(names=node_names, vnodes=vnode_counts, data=st.data())
def test_stage3_property_adding_a_node_moves_keys_only_onto_it(
    names: list[str], vnodes: int, data: st.DataObject
) -> None:
    new = data.draw(st.text(alphabet="ABCDEFXYZ_", min_size=1, max_size=8), label="new")
    r = ring(names, vnodes)
    before = [r.nodes_for(k, 3) for k in PROPERTY_KEYS]
    r.add(new)
    after = [r.nodes_for(k, 3) for k in PROPERTY_KEYS]
    moved = 0
    for key, b, a in zip(PROPERTY_KEYS, before, after, strict=True):
        rest = [m for m in a if m != new]
        assert rest == b[: len(rest)], (
            f"adding {new!r} to {names} may only insert {new!r} into a key's "
            f"preference list; {key!r}: before {b}, after {a}"
        )
        moved += a[0] != b[0]
    n = len(names)
    share = moved / len(PROPERTY_KEYS) * (n + 1)
    tolerance = SIGMAS * sigma(vnodes, n + 1, len(PROPERTY_KEYS))
    assert abs(share - 1) <= tolerance, (
        f"adding a {n + 1}th node with {vnodes} vnodes should move about 1/{n + 1} "
        f"of the keys (within {tolerance:.2f} of it); it moved {share:.2f}x that share"
    )


@core
@rule("remove-node")
@given(names=node_names.filter(lambda ns: len(ns) >= 2), vnodes=vnode_counts, data=st.data())
def test_stage3_property_removing_a_node_moves_only_its_keys(
    names: list[str], vnodes: int, data: st.DataObject
) -> None:
    gone = data.draw(st.sampled_from(names), label="removed")
    r = ring(names, vnodes)
    before = [r.nodes_for(k, 2) for k in PROPERTY_KEYS]
    r.remove(gone)
    after = [r.nodes_for(k, 2) for k in PROPERTY_KEYS]
    for key, b, a in zip(PROPERTY_KEYS, before, after, strict=True):
        kept = [m for m in b if m != gone]
        assert a[: len(kept)] == kept and gone not in a, (
            f"removing {gone!r} from {names} may only drop it from a key's "
            f"preference list; {key!r}: before {b}, after {a}"
        )
    r.add(gone)
    back = [r.nodes_for(k, 2) for k in PROPERTY_KEYS]
    assert back == before, "removing a node and adding it back restores placement"


@core
@rule("balance")
@given(names=node_names.filter(lambda ns: len(ns) >= 2), vnodes=vnode_counts)
def test_stage3_property_load_is_within_the_spread_of_vnodes(names: list[str], vnodes: int) -> None:
    n = len(names)
    load = Counter(owners(ring(names, vnodes), PROPERTY_KEYS))
    mean = len(PROPERTY_KEYS) / n
    bound = mean * (1 + SIGMAS * sigma(vnodes, n, len(PROPERTY_KEYS)))
    worst, count = max(load.items(), key=lambda item: item[1])
    assert count <= bound, (
        f"with {vnodes} vnodes a node's share spreads by about 1/sqrt({vnodes}); "
        f"on {names} the mean is {mean:.0f} keys but {worst!r} holds {count} "
        f"(bound {bound:.0f}): load {dict(load)}"
    )


# --------------------------------------------------------------------------- cache: examples


@core
@rule("round-trip", "cache-bad-input")
def test_stage3_a_value_json_would_change_or_refuse_is_refused_before_any_write(
    redis_env: RedisEnv,
) -> None:
    cache, nodes, prefix = make_cache(redis_env)
    deep: Any = "leaf"
    for _ in range(5000):
        deep = [deep]
    bad = {
        "int and str keys": {1: "a", "1": "b"},  # JSON would keep one of the two
        "a set": {1, 2},
        "NaN": float("nan"),
        "5 000 levels deep": deep,  # json would raise RecursionError
    }
    for what, value in bad.items():
        with pytest.raises(TypeError, match="value"):
            cache.put("k", value)
            raise AssertionError(f"put of {what} was accepted")
    assert not holders(nodes, redis_env, prefix, "k"), "a refused put writes nothing"


@core
@rule("round-trip")
def test_stage3_put_get_delete_round_trip_as_json(redis_env: RedisEnv) -> None:
    cache, _, _ = make_cache(redis_env)
    values: dict[str, object] = {
        "int": 7,
        "zero": 0,
        "empty": "",
        "none": None,
        "list": [1, "two", {"three": 3.5}],
        "dict": {"tokens": [101, 102], "model": "m"},
        "unicode": "naïve ☃",
    }
    for key, value in values.items():
        cache.put(key, value)
    for key, value in values.items():
        got = cache.get(key, MISS)
        assert got == value and got is not MISS, (
            f"get({key!r}) returns what put stored (falsy values and None included); got {got!r}"
        )
    assert cache.get("never-written") is None and cache.get("never-written", 5) == 5
    cache.put("int", 8)
    assert cache.get("int") == 8, "a put replaces the value on every replica"
    assert cache.delete("int") is True
    assert cache.get("int", MISS) is MISS, "a deleted key is gone from every replica"
    assert cache.delete("int") is False, "delete of an absent key: False"


@core
@rule("replicas")
@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_stage3_each_key_lives_on_exactly_its_replicas(redis_env: RedisEnv, replicas: int) -> None:
    cache, nodes, prefix = make_cache(redis_env, replicas=replicas)
    expected_ring = ring(list(NODES))
    keys = stored(cache, "doc", lambda key: {"k": key}, 60)
    for key in keys:
        want = expected_ring.nodes_for(key, replicas)
        assert cache.replicas_for(key) == want, (
            f"a key's replicas are the first {replicas} nodes of its preference "
            f"list on HashRing({list(NODES)}, vnodes=160): {key!r} -> {want}, "
            f"got {cache.replicas_for(key)}"
        )
        got = holders(nodes, redis_env, prefix, key)
        assert got == set(want), (
            f"{key!r} must be written to exactly its {replicas} replicas {want}; "
            f"it is on {sorted(got)}"
        )
        for name in want:
            assert cache.key_name(name, key) == f"{prefix}0:{key}", (
                "key names are f'{key_prefix}{epoch}:{key}', every epoch starting at 0"
            )
            raw = nodes[name].client().get(f"{prefix}0:{key}")
            assert raw is not None and json.loads(raw) == {"k": key}, "values are stored as JSON"
    spread = Counter(n for key in keys for n in holders(nodes, redis_env, prefix, key))
    assert sum(spread.values()) == replicas * len(keys)


@core
@rule("replicas")
def test_stage3_the_cache_shows_its_ring(redis_env: RedisEnv) -> None:
    cache, _, _ = make_cache(redis_env, vnodes=64)
    r = cache.ring
    got = (r.nodes, r.vnodes, len(r))
    check(
        got == (sorted(NODES), 64, 3),
        f"ShardedCache(three nodes, vnodes=64).ring is the HashRing it places keys on: "
        f"expected nodes {sorted(NODES)}, vnodes 64, 3 nodes; got {got}",
    )
    same = ring(list(NODES), 64)
    wrong = [k for k in KEYS[:200] if not r.nodes_for(k, 2) == cache.replicas_for(k) ==
             same.nodes_for(k, 2)]  # fmt: skip
    check(
        not wrong,
        f"cache.ring.nodes_for(key, 2) is replicas_for(key), and HashRing(nodes, vnodes=64)'s "
        f"placement: {len(wrong)} keys differ, e.g. {wrong[:3]}",
    )


#: Which of a key's three replicas still hold it when delete comes.
_HELD_BY: list[tuple[int, ...]] = [(0,), (1,), (2,), (0, 2), (0, 1, 2), ()]


@core
@rule("round-trip")
@pytest.mark.parametrize("held", _HELD_BY, ids=lambda h: "held-by-" + "".join(map(str, h)))
def test_stage3_delete_is_true_if_any_replica_held_the_key(
    redis_env: RedisEnv, held: tuple[int, ...]
) -> None:
    cache, nodes, _ = make_cache(redis_env, replicas=3)
    key = "prompt:1"
    cache.put(key, "v")
    replicas = cache.replicas_for(key)
    for i, name in enumerate(replicas):
        if i not in held:  # gone from this replica already (expired, restarted, evicted)
            nodes[name].client().delete(cache.key_name(name, key))
    got = cache.delete(key)
    holding = [replicas[i] for i in held]
    check(
        got is bool(held),
        f"put({key!r}) on replicas {replicas}; only {holding or 'none'} still hold it; "
        f"delete must return True if any replica held it, False if none did; got {got!r}",
    )
    left = [n for n in replicas if nodes[n].client().get(cache.key_name(n, key)) is not None]
    check(not left, f"delete removes the key from every replica; still on {left}")


@core
@rule("ttl-replicas")
@pytest.mark.parametrize("channel", [None, "invalidations"], ids=["plain", "publishing"])
def test_stage3_ttl_is_set_on_every_replica(redis_env: RedisEnv, channel: str | None) -> None:
    cache, nodes, _ = make_cache(redis_env, ttl_ns=5 * NS_PER_S, channel=channel)
    cache.put("session", "s1")
    for name in cache.replicas_for("session"):
        pttl = nodes[name].client().pttl(cache.key_name(name, "session"))
        assert 0 < pttl <= 5_000, (
            f"ttl_ns=5 s puts a 5 000 ms TTL on every replica (channel={channel!r}: "
            f"{'the write script' if channel else 'a plain SET'}); {name}: PTTL {pttl}"
        )
    untimed, nodes2, _ = make_cache(redis_env, channel=channel)
    untimed.put("forever", 1)
    name = untimed.replicas_for("forever")[0]
    assert nodes2[name].client().pttl(untimed.key_name(name, "forever")) == -1


@core
@rule("cache-bad-input")
def test_stage3_cache_rejects_bad_arguments(redis_env: RedisEnv) -> None:
    nodes = dict(zip(NODES, redis_env.servers(3), strict=True))
    clients = {name: node.client() for name, node in nodes.items()}
    cls = stage().ShardedCache
    bad: list[tuple[str, Callable[[], object]]] = [
        ("no nodes", lambda: cls({})),
        ("replicas=0", lambda: cls(clients, replicas=0)),
        ("replicas=4 on 3 nodes", lambda: cls(clients, replicas=4)),
        ("ttl_ns=0", lambda: cls(clients, ttl_ns=0)),
        ("ttl_ns=-1", lambda: cls(clients, ttl_ns=-1)),
        ("ttl_ns=10^25 (past 2^52 ms)", lambda: cls(clients, ttl_ns=10**25)),
        ("ttl_ns=2^52 ms + 1 ns", lambda: cls(clients, ttl_ns=2**52 * NS_PER_MS + 1)),
        ("vnodes=0", lambda: cls(clients, vnodes=0)),
        ("vnodes=65537", lambda: cls(clients, vnodes=2**16 + 1)),
        ("probe_interval_ns=-1", lambda: cls(clients, probe_interval_ns=-1)),
    ]
    for what, build in bad:
        with pytest.raises(ValueError):
            build()
            pytest.fail(f"ShardedCache({what}) must raise ValueError")


@core
@rule("client-contract")
def test_stage3_a_node_client_that_hangs_or_retries_is_refused(redis_env: RedisEnv) -> None:
    good = {name: node.client() for name, node in zip(NODES, redis_env.servers(3), strict=True)}
    # Nothing is sent to the refused client (its port is closed): the check comes first.
    for flaw, client in [
        ("has no socket_timeout", redis.Redis(port=1)),
        ("retries failed commands (redis-py's default)", redis.Redis(port=1, socket_timeout=0.2)),
    ]:
        with pytest.raises(ValueError) as refused:
            sharded({**good, "c": client}, replicas=2)
        assert "nodes['c']" in str(refused.value), (
            f"a node's client that {flaw} must be refused with a ValueError naming the node "
            f"(nodes['c']); got {refused.value}"
        )


# --------------------------------------------------------------------------- cache: faults


@core
@rule("failover")
@pytest.mark.redis_faults
def test_stage3_reads_fail_over_when_a_node_stops(redis_env: RedisEnv) -> None:
    cache, nodes, _ = make_cache(redis_env)
    keys = stored(cache, "prompt", str.upper)
    nodes["n0"].stop()
    for key in keys:
        got = read_despite_faults(
            cache, key, "a read must fail over, not raise, when a node is down"
        )
        assert got == key.upper(), (
            f"with n0 down, {key!r} (replicas {cache.replicas_for(key)}) must be read "
            f"from a live replica; got {got!r}"
        )
    s = node_stats(cache, "n0")
    assert s.errors >= 1 and s.down and s.failovers >= 1, (
        f"n0 failed, so it is marked down and reads failed over: {s}"
    )
    first = [k for k in keys if cache.replicas_for(k)[0] == "n0"]
    assert first and s.failovers >= len(first), s


@core
@rule("writes-need-one-replica")
@pytest.mark.redis_faults
def test_stage3_writes_need_one_reachable_replica(redis_env: RedisEnv) -> None:
    cache, nodes, _ = make_cache(redis_env)
    keys = [f"emb:{i}" for i in range(40)]
    nodes["n0"].stop()
    nodes["n1"].stop()
    for key in keys:
        if set(cache.replicas_for(key)) == {"n0", "n1"}:
            with pytest.raises(NoReplicaAvailable):
                cache.put(key, 1)
                pytest.fail(f"{key!r}: all replicas down, so put must raise")
            with pytest.raises(NoReplicaAvailable):
                cache.delete(key)
            assert cache.get(key, MISS) is MISS, "no replica reachable: get returns default"
        else:
            cache.put(key, 2)
            assert cache.get(key) == 2, (
                f"{key!r} has a live replica (n2): put skips the down ones and "
                f"get reads the live one"
            )
            assert cache.delete(key) is True
    assert node_stats(cache, "n2").errors == 0


@core
@rule("rejoin-new-epoch", "miss-falls-through")
@pytest.mark.redis_faults
def test_stage3_rejoining_node_never_serves_what_it_missed(redis_env: RedisEnv) -> None:
    cache, nodes, prefix = make_cache(redis_env)
    keys = stored(cache, "chunk", lambda key: "old")
    old_names = {k: cache.key_name("n0", k) for k in keys}
    nodes["n0"].stop()
    for key in keys:
        cache.put(key, "new")
    nodes["n0"].start()
    for key in keys:
        got = cache.get(key, MISS)
        assert got != "old", (
            f"n0 missed the write of {key!r} while it was down and still holds "
            f"'old'; when it comes back it must never serve it (take a new epoch); got "
            f"{got!r} (replicas {cache.replicas_for(key)})"
        )
        assert got == "new", (
            f"{key!r}: n0 is back under a new epoch, where it holds nothing yet; "
            f"its miss must fall through to the next replica, which has 'new'; got "
            f"{'MISS' if got is MISS else repr(got)} (replicas {cache.replicas_for(key)})"
        )
    s = node_stats(cache, "n0")
    assert not s.down and s.epoch >= 1, f"n0 is back, under a new epoch: {s}"
    for key in keys:
        cache.put(key, "newer")
    for key in keys:
        assert cache.get(key) == "newer"
        assert holders(nodes, redis_env, prefix, key) >= set(cache.replicas_for(key))
        if "n0" in cache.replicas_for(key):
            fresh = cache.key_name("n0", key)
            assert fresh != old_names[key], "a new epoch means new key names"
            raw = nodes["n0"].client().get(fresh)
            assert raw is not None and json.loads(raw) == "newer", (
                f"once back, n0 receives writes again ({key!r} under {fresh!r})"
            )


@core
@rule("reclaim-old-epochs")
@pytest.mark.redis_faults
def test_stage3_copies_under_an_abandoned_epoch_are_reclaimed(redis_env: RedisEnv) -> None:
    cache, nodes, prefix = make_cache(redis_env)  # ttl_ns=None: nothing expires by itself
    keys = [f"doc:{i}" for i in range(60)]
    first_on_n0 = [k for k in keys if cache.replicas_for(k)[0] == "n0"]
    held = sum("n0" in cache.replicas_for(k) for k in keys)
    for _ in range(5):
        for key in keys:
            cache.put(key, "v")
        nodes["n0"].stop()
        cache.get(first_on_n0[0])  # n0 is marked down
        nodes["n0"].start()
        cache.get(first_on_n0[0])  # ... and back, under the next epoch
    epoch, stale = after_100_calls(redis_env, cache, nodes["n0"], prefix, first_on_n0)
    assert epoch == 5, f"n0 was stopped and started 5 times: expected epoch 5, got {epoch}"
    assert not stale, (
        f"n0 rejoined 5 times; each time it held {held} keys under the epoch it left, never "
        f"read again (ttl_ns=None). After 100 more calls on n0, expected no key of an older "
        f"epoch (reclaimed a batch per call), got {len(stale)}: "
        f"{[k.removeprefix(prefix) for k in stale[:4]]}"
    )


@core
@rule("reclaim-old-epochs")
@pytest.mark.redis_faults
def test_stage3_old_copies_are_reclaimed_on_a_node_full_of_other_keys(
    redis_env: RedisEnv,
) -> None:
    base = redis_env.fresh_prefix()
    # The cache's keys sort after 400 keys that are not its own: on a server that scans
    # in key order (fakeredis), the first pages hold none of the copies.
    cache, nodes, prefix = make_cache(redis_env, prefix=f"{base}z:")
    others = {f"{base}a:{i:04}": "other" for i in range(400)}
    keys = [f"doc:{i}" for i in range(60)]
    first_on_n0 = [k for k in keys if cache.replicas_for(k)[0] == "n0"]
    for _ in range(2):
        for key in keys:
            cache.put(key, "v")
        nodes["n0"].stop()
        cache.get(first_on_n0[0])  # n0 is marked down
        nodes["n0"].start()  # (a redis-server process comes back empty: write them again)
        nodes["n0"].client().mset(others)
        cache.get(first_on_n0[0])  # ... and back, under the next epoch
    epoch, stale = after_100_calls(redis_env, cache, nodes["n0"], prefix, first_on_n0)
    kept = len(redis_env.keys(f"{base}a:", node=nodes["n0"]))
    check(
        epoch == 2 and not stale and kept == 400,
        f"n0 holds 400 keys that are not the cache's, and rejoined twice, each time holding "
        f"its copies under the epoch it left (ttl_ns=None). After 100 more calls on n0, "
        f"expected epoch 2, no key of an older epoch and the 400 others untouched; got epoch "
        f"{epoch}, {len(stale)} old copies ({[k.removeprefix(prefix) for k in stale[:4]]}), "
        f"{kept} others — a SCAN page that matches nothing is not the end of the walk, "
        f"only the cursor's return to 0 is",
    )


@core
@rule("reclaim-old-epochs")
@pytest.mark.redis_faults
def test_stage3_a_call_sweeps_one_page_never_the_whole_node(redis_env: RedisEnv) -> None:
    """n0 holds 400 keys that are not the cache's and its copies under epoch 0; it is
    found busy, then back under epoch 1. Each of the next calls on n0 sweeps one page —
    one SCAN — so that no call pays for walking the whole node."""
    servers = dict(zip(NODES, redis_env.servers(len(NODES)), strict=True))
    proxy = redis_env.proxy(servers["n0"])
    clients = {name: node.client() for name, node in servers.items()}
    clients["n0"] = servers["n0"].proxied_client(proxy)
    clock, base = ManualClock(), redis_env.fresh_prefix()
    cache = sharded(
        clients, key_prefix=f"{base}z:", replicas=2, probe_interval_ns=NS_PER_S, clock=clock
    )
    keys = [f"doc:{i}" for i in range(60)]
    on_n0 = [k for k in keys if cache.replicas_for(k)[0] == "n0"]
    for key in keys:
        cache.put(key, "v")
    servers["n0"].client().mset({f"{base}a:{i:04}": "other" for i in range(400)})
    proxy.busy()
    cache.get(on_n0[0])  # n0 answers BUSY: down
    proxy.heal()
    clock.advance(NS_PER_S)
    sent = Sent(clients["n0"])
    scans: list[int] = []
    for key in on_n0[:6]:  # the first probes n0 back under epoch 1; the next ones sweep
        start = len(sent.commands)
        cache.get(key)
        scans.append(sum(c[0].upper() == "SCAN" for c in sent.commands[start:]))
    check(
        max(scans) <= 1 and sum(scans) >= 1,
        f"n0 back under epoch 1, its old copies among 400 other keys: each call on it sweeps "
        f"a bounded batch, one SCAN page (and an UNLINK); SCANs sent by each of 6 gets on n0 "
        f"keys: {scans}",
    )


@core
@rule("reclaim-old-epochs")
@pytest.mark.redis_faults
def test_stage3_a_sweep_step_cut_by_an_outage_resumes_once_the_node_is_back(
    redis_env: RedisEnv,
) -> None:
    """The node stops answering in the middle of a sweep step, between the call that
    found it back and that step's SCAN: the step fails, the node is down again. Once it
    answers again, sweeping goes on — a step that failed must not leave the node marked
    as being swept for ever."""
    servers = dict(zip(NODES, redis_env.servers(len(NODES)), strict=True))
    proxy = redis_env.proxy(servers["n0"])
    clients = {name: node.client() for name, node in servers.items()}
    clients["n0"] = servers["n0"].proxied_client(proxy)
    held = HoldBefore(clients["n0"], "SCAN")
    clock, prefix = ManualClock(), redis_env.fresh_prefix()
    cache = sharded(clients, key_prefix=prefix, replicas=2, probe_interval_ns=NS_PER_S, clock=clock)
    keys = [f"doc:{i}" for i in range(60)]
    first_on_n0 = [k for k in keys if cache.replicas_for(k)[0] == "n0"]
    for key in keys:
        cache.put(key, "v")
    proxy.busy()
    cache.get(first_on_n0[0])  # n0 answers BUSY: down
    proxy.heal()
    clock.advance(NS_PER_S)
    held.arm()
    probe = threading.Thread(target=lambda: cache.get(first_on_n0[0]), daemon=True)
    probe.start()  # n0 is back under epoch 1, and this call sweeps a page of epoch 0
    check(held.reached.wait(10), "the first call on n0 back under a new epoch must SCAN")
    proxy.busy()  # ... and n0 is unavailable again when that SCAN reaches it
    held.release.set()
    probe.join(10)
    check(not probe.is_alive(), "the get whose sweep step failed never returned")
    proxy.heal()
    clock.advance(NS_PER_S)
    epoch, stale = after_100_calls(redis_env, cache, servers["n0"], prefix, first_on_n0)
    check(
        epoch == 2 and not stale,
        f"n0 held 60 keys' copies under epoch 0; it answered BUSY, came back under epoch 1, "
        f"and answered BUSY again to the SCAN of the first sweep step; then it came back "
        f"under epoch 2. After 100 more calls on n0 expected epoch 2 and no copy of an older "
        f"epoch (the sweep resumes once n0 answers); got epoch {epoch}, {len(stale)} old "
        f"copies ({[k.removeprefix(prefix) for k in stale[:4]]})",
    )


@core
@rule("reclaim-old-epochs", "rejoin-new-epoch")
@pytest.mark.redis_faults
def test_stage3_a_node_that_rejoins_again_mid_sweep_reclaims_both_old_epochs(
    redis_env: RedisEnv,
) -> None:
    base = redis_env.fresh_prefix()
    servers = dict(zip(NODES, redis_env.servers(len(NODES)), strict=True))
    proxy = redis_env.proxy(servers["n0"])  # outages that keep n0's data
    clients = {name: node.client() for name, node in servers.items()}
    clients["n0"] = servers["n0"].proxied_client(proxy)
    prefix = f"{base}z:"  # the cache's keys sort after 1 000 that are not its own
    cache = sharded(clients, replicas=2, key_prefix=prefix, probe_interval_ns=0)
    servers["n0"].client().mset({f"{base}a:{i:04}": "other" for i in range(1000)})
    keys = [f"doc:{i}" for i in range(60)]
    first_on_n0 = [k for k in keys if cache.replicas_for(k)[0] == "n0"]
    for key in keys:
        cache.put(key, "v0")  # copies on n0 under epoch 0

    def outage_then(probe: Callable[[], object]) -> None:
        proxy.outage()
        cache.get(first_on_n0[0])  # n0 is marked down
        proxy.heal()
        probe()  # ... and back, under the next epoch

    outage_then(lambda: cache.put(first_on_n0[0], "v1"))  # epoch 1; the probe writes under it
    outage_then(lambda: cache.get(first_on_n0[0]))  # epoch 2, before epoch 0's walk could end
    epoch, stale = after_100_calls(redis_env, cache, servers["n0"], prefix, first_on_n0)
    kept = len(redis_env.keys(f"{base}a:", node=servers["n0"]))
    check(
        epoch == 2 and not stale and kept == 1000,
        f"n0 (1 000 keys that are not the cache's, scanned first) lost its connection twice: "
        f"the first rejoin's probe was a put (a copy under epoch 1), the second came right "
        f"after, before the walk of epoch 0's copies could end — two abandoned epochs to "
        f"reclaim at once, each walked whole from its own start. After 100 more calls on "
        f"n0 expected epoch 2, no key of an older epoch and the 1 000 others untouched; got "
        f"epoch {epoch}, {len(stale)} old copies "
        f"({[k.removeprefix(prefix) for k in stale[:4]]}), {kept} others",
    )


@core
@rule("restarted-node")
@pytest.mark.redis_faults
def test_stage3_killed_and_restarted_node_falls_back_or_misses(redis_env: RedisEnv) -> None:
    cache, nodes, _ = make_cache(redis_env)
    keys = stored(cache, "kv", lambda key: key)
    nodes["n1"].restart()  # a crash without persistence: n1 lost everything
    for key in keys:
        got = read_despite_faults(cache, key, "after a node restart reads must not raise")
        assert got in (key, MISS), f"{key!r}: the value or a miss; got {got!r}"
    for key in keys:
        cache.put(key, key + "!")
    for key in keys:
        assert cache.get(key) == key + "!", "writes after the restart read back"


@core
@rule("probe-interval", "miss-falls-through")
@pytest.mark.redis_faults
def test_stage3_a_down_node_is_probed_only_after_the_interval(redis_env: RedisEnv) -> None:
    clock = ManualClock()
    cache, nodes, _ = make_cache(redis_env, probe_interval_ns=NS_PER_S, clock=clock)
    key = next(k for k in KEYS if cache.replicas_for(k)[0] == "n0")
    cache.put(key, "v")
    nodes["n0"].stop()
    assert cache.get(key) == "v"
    assert node_stats(cache, "n0").errors == 1
    nodes["n0"].start()
    clock.advance(NS_PER_S - 1)
    assert cache.get(key) == "v"
    s = node_stats(cache, "n0")
    assert (s.errors, s.hits + s.misses, s.down) == (1, 0, True), (
        f"a node marked down is skipped for probe_interval_ns (1 s) — not even "
        f"tried, so a dead node costs no socket timeout per request: {s}"
    )
    clock.advance(1)
    assert cache.get(key) == "v", (
        "n0 is back but under a new epoch: it misses, and the next replica answers"
    )
    s = node_stats(cache, "n0")
    assert (s.hits + s.misses, s.down, s.epoch) == (1, False, 1), (
        f"after probe_interval_ns n0 is tried again, answers, and takes epoch 1: {s}"
    )


@core
@rule("failover", "miss-falls-through", "probe-interval")
@pytest.mark.redis_faults
def test_stage3_a_miss_is_no_failover(redis_env: RedisEnv) -> None:
    clock = ManualClock()
    cache, nodes, _ = make_cache(redis_env, probe_interval_ns=NS_PER_S, clock=clock)
    key = next(k for k in KEYS if cache.replicas_for(k)[0] == "n0")
    second = cache.replicas_for(key)[1]
    got = cache.get(key, MISS)  # never written: both replicas answer a miss
    before = {n: (s.misses, s.failovers) for n, s in cache.statistics().items()}
    check(
        got is MISS and before["n0"] == (1, 0) and before[second] == (1, 0),
        f"all nodes up; get({key!r}) of a key never written: n0 (its first replica) and "
        f"{second} each answer a miss — counted in misses, and no failover (a node that "
        f"answers was neither down nor failing); (misses, failovers) per node: {before}",
    )
    cache.put(key, "v")
    nodes["n0"].stop()
    cache.get(key)  # n0 fails: down, one failover
    nodes["n0"].start()
    clock.advance(NS_PER_S)
    got = cache.get(key)  # the probe: n0 is back under epoch 1, misses, falls through
    s = node_stats(cache, "n0")
    check(
        got == "v" and (s.errors, s.failovers, s.misses, s.down) == (1, 1, 2, False),
        f"put({key!r}, 'v'); stop n0; get (n0 fails: 1 error, 1 failover); start n0; 1 s "
        f"later get: n0 answers under its new epoch without the key — a miss that falls "
        f"through to {second}, not a failover. Expected 'v' and n0 with errors 1, "
        f"failovers 1, misses 2, up; got {got!r}, {s}",
    )


@core
@rule("failover")
@pytest.mark.redis_faults
@pytest.mark.parametrize("replicas", [1, 2])
def test_stage3_a_down_last_replica_is_no_failover(redis_env: RedisEnv, replicas: int) -> None:
    cache, nodes, _ = make_cache(
        redis_env, replicas=replicas, probe_interval_ns=NS_PER_S, clock=ManualClock()
    )
    last = next(k for k in KEYS if cache.replicas_for(k)[-1] == "n0")
    first = next(k for k in KEYS if cache.replicas_for(k)[0] == "n0")
    nodes["n0"].stop()
    got = cache.get(last, MISS)  # never written: the replicas before n0 miss, n0 fails
    s = node_stats(cache, "n0")
    story = (
        f"replicas={replicas}; stop n0; get({last!r}) (replicas {cache.replicas_for(last)}, "
        f"never written): n0, its last replica, fails — the get has no later replica to go "
        f"on to, so that is an error and no failover"
    )
    check(
        got is MISS and (s.errors, s.down, s.failovers) == (1, True, 0),
        f"{story}. Expected the default and n0 with errors 1, down, failovers 0; got "
        f"{'MISS' if got is MISS else repr(got)}, {s}",
    )
    cache.get(first, MISS)  # n0 is down: skipped, the get goes on if a replica follows
    went_on = int(replicas > 1)
    s = node_stats(cache, "n0")
    check(
        s.failovers == went_on,
        f"{story}; then get({first!r}) (replicas {cache.replicas_for(first)}): n0 is down "
        f"and skipped, and the get goes on to a later replica only if there is one. "
        f"Expected n0's failovers {went_on}; got {s}",
    )


@core
@rule("rejoin-new-epoch", "probe-interval")
@pytest.mark.redis_faults
@pytest.mark.parametrize("op", ["get", "put", "delete"])
def test_stage3_the_probe_of_a_rejoining_node_already_uses_its_new_epoch(
    redis_env: RedisEnv, op: str
) -> None:
    clock = ManualClock()
    cache, nodes, prefix, sent = recorded_cache(redis_env, probe_interval_ns=NS_PER_S, clock=clock)
    key = next(k for k in KEYS if cache.replicas_for(k)[0] == "n0")
    cache.put(key, "old")
    nodes["n0"].stop()
    cache.get(key)  # n0 is marked down
    nodes["n0"].start()
    clock.advance(NS_PER_S)
    sent["n0"].commands.clear()
    probe: dict[str, Callable[[], object]] = {
        "get": lambda: cache.get(key), "put": lambda: cache.put(key, "new"),
        "delete": lambda: cache.delete(key),
    }  # fmt: skip
    got = probe[op]()
    named = sent["n0"].naming(key)
    new_name = f"{prefix}1:{key}"
    check(
        bool(named) and new_name in named[0][1:],
        f"put({key!r}, 'old'); stop n0 (its first replica); a get marks it down; start n0; "
        f"1 s later {op} probes n0. The probe already uses n0's new epoch: its command must "
        f"name {new_name!r}, never {prefix}0:{key!r}; n0 was sent {named[:3]}",
    )
    if op == "get":
        expect(
            got, "old", f"the probing get: n0 misses under epoch 1; {key!r} from the next replica"
        )
    s = node_stats(cache, "n0")
    check((s.epoch, s.down) == (1, False), f"the probe found n0 back, at epoch 1: {s}")


@core
@rule("rejoin-new-epoch")
@pytest.mark.redis_faults
@pytest.mark.parametrize("op", ["get", "put", "delete"])
def test_stage3_two_probes_racing_bump_the_epoch_once(redis_env: RedisEnv, op: str) -> None:
    """Two calls probe a rejoined node at once: both were sent under its new epoch, and
    only the first to succeed bumps it. The other, back later, must not bump again: that
    would abandon what the first wrote under the epoch it had just taken."""
    clock = ManualClock()
    nodes = dict(zip(NODES, redis_env.servers(len(NODES)), strict=True))
    clients = {name: node.client() for name, node in nodes.items()}
    held = HoldBefore(clients["n0"], *_EVERY_COMMAND)
    prefix = redis_env.fresh_prefix()
    cache = sharded(clients, key_prefix=prefix, replicas=2, probe_interval_ns=NS_PER_S, clock=clock)
    key = next(k for k in KEYS if cache.replicas_for(k)[0] == "n0")
    second = cache.replicas_for(key)[1]
    cache.put(key, "old")
    nodes["n0"].stop()
    cache.get(key)  # n0 is marked down
    nodes["n0"].start()
    clock.advance(NS_PER_S)
    held.arm()
    first: dict[str, Callable[[], object]] = {
        "get": lambda: cache.get(key), "put": lambda: cache.put(key, "first"),
        "delete": lambda: cache.delete(key),
    }  # fmt: skip
    slow = threading.Thread(target=first[op], daemon=True)
    slow.start()
    check(held.reached.wait(10), f"{op}({key!r}) must probe n0, its first replica")
    cache.put(key, "new")  # the other probe: n0 answers, back under epoch 1
    held.release.set()
    slow.join(10)
    check(not slow.is_alive(), f"the {op} held on its probe of n0 never returned")
    story = (
        f"put({key!r}, 'old'); stop n0 (its first replica); a get marks it down; start n0; "
        f"1 s later a {op} probes n0 and its command is held before it is sent; meanwhile "
        f"put({key!r}, 'new') probes n0 too and finds it back; then the held {op} goes on"
    )
    s = node_stats(cache, "n0")
    check(
        (s.epoch, s.down) == (1, False),
        f"{story}. Only the first successful probe bumps n0's epoch, once: expected n0 up at "
        f"epoch 1, got {s}",
    )
    if op != "delete":
        nodes[second].stop()
        expected = "new" if op == "get" else "first"
        expect(
            cache.get(key, MISS), expected,
            f"{story}; then stop {second}, the other replica: n0 holds the last write under "
            f"epoch 1, the epoch both probes wrote under",
        )  # fmt: skip


#: Whatever a call sends first: the probe is held before it, whichever command it is.
_EVERY_COMMAND = ("GET", "SET", "DEL", "UNLINK", "EVAL", "EVALSHA", "MGET", "PSETEX", "EXISTS")


@core
@rule("one-timeout")
@pytest.mark.realtime
def test_stage3_a_node_that_stops_answering_costs_one_timeout(redis_env: RedisEnv) -> None:
    """A blackholed node (accepts, never answers): one socket timeout, then skipped."""
    cache, proxy, clock = behind_a_proxy(redis_env, socket_timeout=0.2)
    keys = [k for k in KEYS[:300] if cache.replicas_for(k)[0] == "n0"][:10]
    for key in keys:
        cache.put(key, key)
    proxy.blackhole()
    got: list[object] = []
    reader = threading.Thread(target=lambda: got.extend(cache.get(k, MISS) for k in keys))
    reader.daemon = True
    reader.start()
    reader.join(10)
    assert not reader.is_alive(), "reads hung on a node that never answers"
    assert got == keys, (
        f"a node that times out (redis.TimeoutError) is failed over like one that "
        f"refuses connections; got {got}"
    )
    s = node_stats(cache, "n0")
    assert (s.errors, s.down, s.failovers) == (1, True, len(keys)), (
        f"the first read pays one socket timeout and marks n0 down; the other "
        f"{len(keys) - 1} skip it for probe_interval_ns instead of each waiting again: {s}"
    )
    proxy.heal()
    clock.advance(NS_PER_S)
    assert cache.get(keys[0]) == keys[0]
    s = node_stats(cache, "n0")
    assert not s.down and s.epoch >= 1, f"n0 answers again, under a new epoch: {s}"


@core
@rule("busy-unavailable")
def test_stage3_a_busy_node_is_failed_over_like_a_down_one(redis_env: RedisEnv) -> None:
    """A node answering ``BUSY`` (a long script running there) is unavailable: skipped for
    the probe interval, its replicas answer; nothing raises."""
    cache, proxy, clock = behind_a_proxy(redis_env)
    key = next(k for k in KEYS if cache.replicas_for(k)[0] == "n0")
    cache.put(key, "v")
    proxy.busy()
    try:
        got = cache.get(key, MISS)
        cache.put(key, "w")
    except redis.ResponseError as exc:
        pytest.fail(f"a BUSY reply is an unavailability, failed over, not raised: {exc!r}")
    s = node_stats(cache, "n0")
    check(
        got == "v" and (s.errors, s.down) == (1, True),
        f"n0 answered BUSY: one error, n0 down, the next replica's value; got {got!r}, {s}",
    )
    proxy.heal()
    clock.advance(NS_PER_S)
    assert cache.get(key) == "w", "after the probe interval n0 is tried again"


@core
@rule("failed-probe", "probe-interval", "rejoin-new-epoch")
@pytest.mark.redis_faults
def test_stage3_a_failed_probe_starts_another_interval(redis_env: RedisEnv) -> None:
    clock = ManualClock()
    cache, nodes, _ = make_cache(redis_env, probe_interval_ns=NS_PER_S, clock=clock)
    key = next(k for k in KEYS if cache.replicas_for(k)[0] == "n0")
    cache.put(key, "v")
    nodes["n0"].stop()
    ops: list[tuple[str, Callable[[], object]]] = [
        ("get", lambda: cache.get(key)),
        ("put", lambda: cache.put(key, "v")),
        ("delete", lambda: cache.delete(key)),
    ]
    cache.get(key)  # n0 fails: down, errors 1, next probe at 1 s
    errors = 1
    for what, op in ops:
        clock.advance(NS_PER_S)
        op()  # the probe: n0 is still stopped, so it fails again
        errors += 1
        s = node_stats(cache, "n0")
        check(
            (s.errors, s.down, s.epoch) == (errors, True, 0),
            f"after probe_interval_ns a {what} probes the down node n0, which is still "
            f"stopped: one more error ({errors}), still down, and still epoch 0 (only a "
            f"probe that succeeds bumps it); got {s}",
        )
        clock.advance(NS_PER_S - 1)
        op()
        s = node_stats(cache, "n0")
        check(
            s.errors == errors,
            f"a failed probe starts another probe_interval_ns: 1 ns before it ends, "
            f"a {what} must not try n0 again (errors stay {errors}); got {s} — without a new "
            f"interval a dead node costs every request a timeout again",
        )
        clock.advance(1)
        op()
        errors += 1
        check(
            node_stats(cache, "n0").errors == errors,
            f"at the end of the new interval a {what} probes n0 again: {node_stats(cache, 'n0')}",
        )
    nodes["n0"].start()
    clock.advance(NS_PER_S)
    cache.get(key)  # the probe that succeeds
    s = node_stats(cache, "n0")
    check(
        (s.down, s.epoch) == (False, 1),
        f"n0 failed {errors - 1} probes, then one succeeded: the first successful call "
        f"after it was marked down bumps its epoch by one, so it is up at epoch 1; got {s}",
    )


@core
@rule("only-outages-fail-over")
def test_stage3_an_error_that_is_not_an_outage_propagates(redis_env: RedisEnv) -> None:
    cache, nodes, _ = make_cache(redis_env)
    key = "prompt:typed"
    cache.put(key, "v")
    first = cache.replicas_for(key)[0]
    client = nodes[first].client()
    name = cache.key_name(first, key)
    client.delete(name)
    client.lpush(name, "not a string")  # a GET of it is a WRONGTYPE error
    try:
        got = cache.get(key, MISS)
    except redis.ResponseError:
        pass
    else:
        raise AssertionError(
            f"a WRONGTYPE reply from {first} is not an outage: get must raise "
            f"redis.ResponseError, not fail over; it returned "
            f"{'MISS' if got is MISS else repr(got)}"
        )
    s = node_stats(cache, first)
    check(
        (s.down, s.errors) == (False, 0),
        f"only ConnectionError and TimeoutError mark a node down; {first}: {s}",
    )


@core
@rule("ttl-replicas")
def test_stage3_a_ttl_is_whole_milliseconds_rounded_up(redis_env: RedisEnv) -> None:
    cache, nodes, _ = make_cache(redis_env, ttl_ns=1)
    try:
        cache.put("blink", 1)
    except redis.ResponseError as e:
        raise AssertionError(
            f"ttl_ns=1 is 1 ms (whole ms, rounded up), never 0: put raised {e!r}"
        ) from e
    for name in cache.replicas_for("blink"):
        pttl = nodes[name].client().pttl(cache.key_name(name, "blink"))
        check(
            pttl in (-2, 0, 1),
            f"ttl_ns=1 gives every replica's copy a 1 ms TTL (rounded up); {name}: PTTL {pttl}",
        )


#: ttl_ns -> the whole ms, rounded up, that every replica's SET carries; the last is the
#: longest TTL there is (2^52 ms).
_PX = {1: 1, NS_PER_MS: 1, NS_PER_MS + 1: 2, 5 * NS_PER_S: 5_000, 5 * NS_PER_S + 1: 5_001}
_PX[2**52 * NS_PER_MS] = 2**52


@core
@rule("ttl-replicas", "cache-bad-input")
@pytest.mark.parametrize("ttl_ns", list(_PX))
def test_stage3_the_ttl_sent_is_exactly_the_whole_ms_rounded_up(
    redis_env: RedisEnv, ttl_ns: int
) -> None:
    with not_refused(f"ShardedCache(ttl_ns={ttl_ns}): any ttl_ns up to 2^52 ms is accepted"):
        cache, _, _, sent = recorded_cache(redis_env, ttl_ns=ttl_ns)
    cache.put("session", "s1")
    for name in cache.replicas_for("session"):
        commands = sent[name].naming("session")
        ttls = [ms for c in commands if (ms := ttl_ms(c)) is not None]
        check(
            ttls == [_PX[ttl_ns]],
            f"ShardedCache(ttl_ns={ttl_ns}).put('session', 's1'): replica {name} must get "
            f"the TTL in whole ms, rounded up — PX {_PX[ttl_ns]}, no ms more; the TTLs it "
            f"was sent: {ttls} (as SET … PX n, PSETEX or PEXPIRE), commands {commands}",
        )


# --------------------------------------------------------------------------- stateful


TestStage3ShardedCacheModel = core(
    pytest.mark.rule("never-older")(pytest.mark.redis_faults(ShardedCacheMachine.TestCase))
)
TestStage3ShardedCacheModel.settings = settings(heavy, stateful_step_count=30)
