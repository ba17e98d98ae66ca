"""Stage 3 suite: a cache sharded over Redis nodes (see katas/kv_cache/README.md).

Core: ``HashRing`` (consistent hashing with virtual nodes) and ``ShardedCache`` (R
replicas, failover, epochs on rejoin) over three Redis nodes — three fakeredis servers
by default, three private ``redis-server`` processes with
``KATA_REDIS_SERVER=redis-server``.

How the ring's statistics are checked without flakiness:

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

The state machine keeps its own model of what one client has written and deleted,
and checks every read against it while nodes stop, start and restart.
"""

from __future__ import annotations

import json
import math
import os
import threading
from collections import Counter
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from katas._harness.child import run_once
from katas._harness.profiles import heavy_examples
from katas._harness.redis import RedisEnv, RedisNode
from katas._harness.under_test import stage
from katas._harness.waiting import DEADLINE_S, eventually, spawn
from katas._harness.walks import Drawn, Walk, walked
from katas._registry import impl
from katas.kv_cache._testing import placement
from katas.kv_cache.api import (
    NS_PER_S,
    ManualClock,
    NearStatistics,
    NodeStatistics,
    NoReplicaAvailable,
)

pytestmark = [pytest.mark.stage(3)]

core = pytest.mark.core
extended = pytest.mark.extended

#: The keys whose placement the ring tests measure.
KEYS = [f"user:{i}" for i in range(20_000)]
#: Fewer keys for the hypothesis properties (many examples).
PROPERTY_KEYS = KEYS[:4_000]
#: Standard deviations the hypothesis properties allow (a sound ring: ~never exceeded).
SIGMAS = 5
NODES = ("n0", "n1", "n2")
MISS: Any = object()  # a get's default: tells "absent" from a stored None
MACHINE_KEYS = ("k0", "k1", "k2")


heavy = settings(
    max_examples=heavy_examples(),
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    deadline=None,
)


@pytest.fixture(autouse=True)
def _fail_fast_on_stubs(stage_module: ModuleType) -> None:
    """Build a ring first: on a stub this fails at once with "not implemented yet"."""
    stage_module.HashRing(["a"])


def ring(nodes: list[str], vnodes: int = 160) -> Any:
    return stage().HashRing(nodes, vnodes=vnodes)


def owners(r: Any, keys: list[str]) -> list[str]:
    return [r.node_for(k) for k in keys]


def sigma(vnodes: int, nodes: int, keys: int) -> float:
    """Relative spread of one node's share: the ring's arcs plus sampling ``keys`` keys."""
    return math.sqrt(1 / vnodes + nodes / keys)


def make_cache(
    redis_env: RedisEnv, *, replicas: int = 2, prefix: str | None = None, **kw: Any
) -> tuple[Any, dict[str, RedisNode], str]:
    """A ShardedCache over three servers: (cache, name -> node, key prefix)."""
    nodes = dict(zip(NODES, redis_env.servers(len(NODES)), strict=True))
    prefix = prefix if prefix is not None else redis_env.fresh_prefix()
    kw.setdefault("probe_interval_ns", 0)
    cache = stage().ShardedCache(
        {name: node.client() for name, node in nodes.items()},
        replicas=replicas,
        key_prefix=prefix,
        **kw,
    )
    return cache, nodes, prefix


def holders(nodes: dict[str, RedisNode], redis_env: RedisEnv, prefix: str, key: str) -> set[str]:
    """The nodes holding some Redis key for ``key`` under ``prefix`` (any epoch)."""
    return {
        name
        for name, node in nodes.items()
        if any(n.endswith(f":{key}") for n in redis_env.keys(prefix, node=node))
    }


# --------------------------------------------------------------------------- ring: examples


@core
@pytest.mark.rule("preference-lists")
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
@pytest.mark.rule("ring-bad-input")
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
        r.nodes_for(1, 1)
    assert r.nodes == ["a", "b"], "a refused add/remove changes nothing"
    moved = [key for key in placed if r.nodes_for(key, 2) != placed[key]]
    assert not moved, f"a refused add must leave no virtual node behind: {moved[:5]} moved"
    with pytest.raises(TypeError, match="nodes"):
        ring("abc")  # type: ignore[arg-type]  # three nodes 'a', 'b', 'c'? A mistake: refuse


@core
@pytest.mark.rule("empty-ring")
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
@pytest.mark.rule("balance")
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
@pytest.mark.rule("add-node")
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
@pytest.mark.rule("remove-node")
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
@pytest.mark.rule("placement-by-set")
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
@pytest.mark.rule("stable-hash")
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

node_names = st.lists(
    st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-.:", min_size=1, max_size=12),
    min_size=1,
    max_size=7,
    unique=True,
)
vnode_counts = st.sampled_from([160, 640])


@core
@pytest.mark.rule("add-node")
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
@pytest.mark.rule("remove-node")
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
@pytest.mark.rule("balance")
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
@pytest.mark.rule("round-trip", "cache-bad-input")
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
@pytest.mark.rule("round-trip")
def test_stage3_put_get_delete_round_trip_as_json(redis_env: RedisEnv) -> None:
    cache, _, _ = make_cache(redis_env)
    values: dict[str, Any] = {
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
@pytest.mark.rule("replicas")
@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_stage3_each_key_lives_on_exactly_its_replicas(redis_env: RedisEnv, replicas: int) -> None:
    cache, nodes, prefix = make_cache(redis_env, replicas=replicas)
    expected_ring = ring(list(NODES))
    keys = [f"doc:{i}" for i in range(60)]
    for key in keys:
        cache.put(key, {"k": key})
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
@pytest.mark.rule("ttl-replicas")
def test_stage3_ttl_is_set_on_every_replica(redis_env: RedisEnv) -> None:
    cache, nodes, _ = make_cache(redis_env, ttl_ns=5 * NS_PER_S)
    cache.put("session", "s1")
    for name in cache.replicas_for("session"):
        pttl = nodes[name].client().pttl(cache.key_name(name, "session"))
        assert 0 < pttl <= 5_000, (
            f"ttl_ns=5 s puts a 5 000 ms TTL on every replica; {name}: PTTL {pttl}"
        )
    untimed, nodes2, _ = make_cache(redis_env)
    untimed.put("forever", 1)
    name = untimed.replicas_for("forever")[0]
    assert nodes2[name].client().pttl(untimed.key_name(name, "forever")) == -1


@core
@pytest.mark.rule("cache-bad-input")
def test_stage3_cache_rejects_bad_arguments(redis_env: RedisEnv) -> None:
    nodes = dict(zip(NODES, redis_env.servers(3), strict=True))
    clients = {name: node.client() for name, node in nodes.items()}
    cls = stage().ShardedCache
    bad: list[tuple[str, Callable[[], Any]]] = [
        ("no nodes", lambda: cls({})),
        ("replicas=0", lambda: cls(clients, replicas=0)),
        ("replicas=4 on 3 nodes", lambda: cls(clients, replicas=4)),
        ("ttl_ns=0", lambda: cls(clients, ttl_ns=0)),
        ("ttl_ns=-1", lambda: cls(clients, ttl_ns=-1)),
        ("ttl_ns=10^25 (past 2^52 ms)", lambda: cls(clients, ttl_ns=10**25)),
        ("vnodes=0", lambda: cls(clients, vnodes=0)),
        ("probe_interval_ns=-1", lambda: cls(clients, probe_interval_ns=-1)),
    ]
    for what, build in bad:
        with pytest.raises(ValueError):
            build()
            pytest.fail(f"ShardedCache({what}) must raise ValueError")


@core
@pytest.mark.rule("client-contract")
def test_stage3_a_node_client_that_hangs_or_retries_is_refused(redis_env: RedisEnv) -> None:
    good = {name: node.client() for name, node in zip(NODES, redis_env.servers(3), strict=True)}
    # Nothing is sent to the refused client (its port is closed): the check comes first.
    for flaw, client in [
        ("has no socket_timeout", redis.Redis(port=1)),
        ("retries failed commands (redis-py's default)", redis.Redis(port=1, socket_timeout=0.2)),
    ]:
        with pytest.raises(ValueError) as refused:
            stage().ShardedCache({**good, "c": client}, replicas=2)
        assert "nodes['c']" in str(refused.value), (
            f"a node's client that {flaw} must be refused with a ValueError naming the node "
            f"(nodes['c']); got {refused.value}"
        )


# --------------------------------------------------------------------------- cache: faults


def _stats(cache: Any, name: str) -> NodeStatistics:
    s = cache.statistics()[name]
    assert isinstance(s, NodeStatistics), s
    return s


@core
@pytest.mark.rule("failover")
@pytest.mark.redis_faults
def test_stage3_reads_fail_over_when_a_node_stops(redis_env: RedisEnv) -> None:
    cache, nodes, _ = make_cache(redis_env)
    keys = [f"prompt:{i}" for i in range(40)]
    for key in keys:
        cache.put(key, key.upper())
    nodes["n0"].stop()
    for key in keys:
        try:
            got = cache.get(key, MISS)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            pytest.fail(f"a read must fail over, not raise, when a node is down: {exc!r}")
        assert got == key.upper(), (
            f"with n0 down, {key!r} (replicas {cache.replicas_for(key)}) must be read "
            f"from a live replica; got {got!r}"
        )
    s = _stats(cache, "n0")
    assert s.errors >= 1 and s.down and s.failovers >= 1, (
        f"n0 failed, so it is marked down and reads failed over: {s}"
    )
    first = [k for k in keys if cache.replicas_for(k)[0] == "n0"]
    assert first and s.failovers >= len(first), s


@core
@pytest.mark.rule("writes-need-one-replica")
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
    assert _stats(cache, "n2").errors == 0


@core
@pytest.mark.rule("rejoin-new-epoch", "miss-falls-through")
@pytest.mark.redis_faults
def test_stage3_rejoining_node_never_serves_what_it_missed(redis_env: RedisEnv) -> None:
    cache, nodes, prefix = make_cache(redis_env)
    keys = [f"chunk:{i}" for i in range(40)]
    for key in keys:
        cache.put(key, "old")
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
    s = _stats(cache, "n0")
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
@pytest.mark.rule("reclaim-old-epochs")
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
    for i in range(100):
        cache.get(first_on_n0[i % len(first_on_n0)])
    epoch = _stats(cache, "n0").epoch
    assert epoch == 5, f"n0 was stopped and started 5 times: expected epoch 5, got {epoch}"
    current = f"{prefix}{epoch}:"
    stale = [k for k in redis_env.keys(prefix, node=nodes["n0"]) if not k.startswith(current)]
    assert not stale, (
        f"n0 rejoined 5 times; each time it held {held} keys under the epoch it left, never "
        f"read again (ttl_ns=None). After 100 more calls on n0, expected no key of an older "
        f"epoch (reclaimed a batch per call), got {len(stale)}: "
        f"{[k.removeprefix(prefix) for k in stale[:4]]}"
    )


@core
@pytest.mark.rule("restarted-node")
@pytest.mark.redis_faults
def test_stage3_killed_and_restarted_node_falls_back_or_misses(redis_env: RedisEnv) -> None:
    cache, nodes, _ = make_cache(redis_env)
    keys = [f"kv:{i}" for i in range(40)]
    for key in keys:
        cache.put(key, key)
    nodes["n1"].restart()  # a crash without persistence: n1 lost everything
    for key in keys:
        try:
            got = cache.get(key, MISS)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            pytest.fail(f"after a node restart reads must not raise: {exc!r}")
        assert got in (key, MISS), f"{key!r}: the value or a miss; got {got!r}"
    for key in keys:
        cache.put(key, key + "!")
    for key in keys:
        assert cache.get(key) == key + "!", "writes after the restart read back"


@core
@pytest.mark.rule("probe-interval", "miss-falls-through")
@pytest.mark.redis_faults
def test_stage3_a_down_node_is_probed_only_after_the_interval(redis_env: RedisEnv) -> None:
    clock = ManualClock()
    cache, nodes, _ = make_cache(redis_env, probe_interval_ns=NS_PER_S, clock=clock)
    key = next(k for k in KEYS if cache.replicas_for(k)[0] == "n0")
    cache.put(key, "v")
    nodes["n0"].stop()
    assert cache.get(key) == "v"
    assert _stats(cache, "n0").errors == 1
    nodes["n0"].start()
    clock.advance(NS_PER_S - 1)
    assert cache.get(key) == "v"
    s = _stats(cache, "n0")
    assert (s.errors, s.hits + s.misses, s.down) == (1, 0, True), (
        f"a node marked down is skipped for probe_interval_ns (1 s) — not even "
        f"tried, so a dead node costs no socket timeout per request: {s}"
    )
    clock.advance(1)
    assert cache.get(key) == "v", (
        "n0 is back but under a new epoch: it misses, and the next replica answers"
    )
    s = _stats(cache, "n0")
    assert (s.hits + s.misses, s.down, s.epoch) == (1, False, 1), (
        f"after probe_interval_ns n0 is tried again, answers, and takes epoch 1: {s}"
    )


def behind_a_proxy(redis_env: RedisEnv, **client: Any) -> tuple[Any, Any, ManualClock]:
    """A cache over three nodes, ``n0`` reached through a fault proxy (``client``: its
    client's options); a 1 s probe interval on a ManualClock. (cache, proxy, clock)."""
    servers = dict(zip(NODES, redis_env.servers(len(NODES)), strict=True))
    proxy = redis_env.proxy(servers["n0"])
    clients = {name: node.client() for name, node in servers.items()}
    clients["n0"] = servers["n0"].proxied_client(proxy, **client)
    clock = ManualClock()
    cache = stage().ShardedCache(
        clients,
        replicas=2,
        key_prefix=redis_env.fresh_prefix(),
        probe_interval_ns=NS_PER_S,
        clock=clock,
    )
    return cache, proxy, clock


@core
@pytest.mark.rule("one-timeout")
@pytest.mark.realtime
def test_stage3_a_node_that_stops_answering_costs_one_timeout(redis_env: RedisEnv) -> None:
    """A blackholed node (accepts, never answers): one socket timeout, then skipped."""
    cache, proxy, clock = behind_a_proxy(redis_env, socket_timeout=0.2)
    keys = [k for k in KEYS[:300] if cache.replicas_for(k)[0] == "n0"][:10]
    for key in keys:
        cache.put(key, key)
    proxy.blackhole()
    got: list[Any] = []
    reader = threading.Thread(target=lambda: got.extend(cache.get(k, MISS) for k in keys))
    reader.daemon = True
    reader.start()
    reader.join(10)
    assert not reader.is_alive(), "reads hung on a node that never answers"
    assert got == keys, (
        f"a node that times out (redis.TimeoutError) is failed over like one that "
        f"refuses connections; got {got}"
    )
    s = _stats(cache, "n0")
    assert (s.errors, s.down, s.failovers) == (1, True, len(keys)), (
        f"the first read pays one socket timeout and marks n0 down; the other "
        f"{len(keys) - 1} skip it for probe_interval_ns instead of each waiting again: {s}"
    )
    proxy.heal()
    clock.advance(NS_PER_S)
    assert cache.get(keys[0]) == keys[0]
    s = _stats(cache, "n0")
    assert not s.down and s.epoch >= 1, f"n0 answers again, under a new epoch: {s}"


@core
@pytest.mark.rule("busy-unavailable")
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
    s = _stats(cache, "n0")
    expect(
        got == "v" and (s.errors, s.down) == (1, True),
        f"n0 answered BUSY: one error, n0 down, the next replica's value; got {got!r}, {s}",
    )
    proxy.heal()
    clock.advance(NS_PER_S)
    assert cache.get(key) == "w", "after the probe interval n0 is tried again"


def expect(ok: bool, message: str) -> None:
    """Fail with ``message`` alone (an ``assert`` would add pytest's diff of the same)."""
    if not ok:
        raise AssertionError(message)


@core
@pytest.mark.rule("failed-probe", "probe-interval")
@pytest.mark.redis_faults
def test_stage3_a_failed_probe_starts_another_interval(redis_env: RedisEnv) -> None:
    clock = ManualClock()
    cache, nodes, _ = make_cache(redis_env, probe_interval_ns=NS_PER_S, clock=clock)
    key = next(k for k in KEYS if cache.replicas_for(k)[0] == "n0")
    cache.put(key, "v")
    nodes["n0"].stop()
    ops: list[tuple[str, Callable[[], Any]]] = [
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
        s = _stats(cache, "n0")
        expect(
            (s.errors, s.down) == (errors, True),
            f"after probe_interval_ns a {what} probes the down node n0, which is still "
            f"stopped: one more error ({errors}), still down; got {s}",
        )
        clock.advance(NS_PER_S - 1)
        op()
        s = _stats(cache, "n0")
        expect(
            s.errors == errors,
            f"a failed probe starts another probe_interval_ns: 1 ns before it ends, "
            f"a {what} must not try n0 again (errors stay {errors}); got {s} — without a new "
            f"interval a dead node costs every request a timeout again",
        )
        clock.advance(1)
        op()
        errors += 1
        expect(
            _stats(cache, "n0").errors == errors,
            f"at the end of the new interval a {what} probes n0 again: {_stats(cache, 'n0')}",
        )


@core
@pytest.mark.rule("only-outages-fail-over")
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
    s = _stats(cache, first)
    expect(
        (s.down, s.errors) == (False, 0),
        f"only ConnectionError and TimeoutError mark a node down; {first}: {s}",
    )


@core
@pytest.mark.rule("ttl-replicas")
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
        expect(
            pttl in (-2, 0, 1),
            f"ttl_ns=1 gives every replica's copy a 1 ms TTL (rounded up); {name}: PTTL {pttl}",
        )


# --------------------------------------------------------------------------- stateful


class ShardedCacheMachine(RuleBasedStateMachine):
    """One client's puts, gets and deletes while nodes stop, start and restart.

    The model holds, per key, the last value this client wrote (or MISS) and whether a
    read must return exactly that: after a put with all its replicas up and untouched
    since, and always after a delete or for a key never written. Otherwise a read may
    also miss — but it never returns any other value: values are unique, so a stale
    one would be caught.
    """

    def __init__(self) -> None:
        super().__init__()
        self.env = RedisEnv.from_environment(faults=True, name="stage3-shard-machine")
        self.nodes = dict(zip(NODES, self.env.servers(len(NODES)), strict=True))
        self.cache = stage().ShardedCache(
            {name: node.client() for name, node in self.nodes.items()},
            replicas=2,
            key_prefix=self.env.prefix,
            probe_interval_ns=0,
        )
        self.stopped: set[str] = set()
        self.model: dict[str, tuple[Any, bool]] = {}
        self.counter = 0
        self.log: list[str] = []

    @initialize()
    def start_full(self) -> None:
        self.log.append("3 nodes up, replicas=2")
        for key in MACHINE_KEYS:  # every key has a value a faulty node could serve stale
            self.put(key)

    def teardown(self) -> None:
        self.env.close()

    def _touch(self, name: str) -> None:
        """A fault on ``name``: reads of its keys may now miss."""
        for key, (value, _) in self.model.items():
            if value is not MISS and name in self.cache.replicas_for(key):
                self.model[key] = (value, False)

    @rule(key=st.sampled_from(MACHINE_KEYS))
    def put(self, key: str) -> None:
        self.counter += 1
        value = f"{key}-v{self.counter}"
        replicas = set(self.cache.replicas_for(key))
        self.log.append(f"put({key!r}, {value!r}) replicas={self.cache.replicas_for(key)}")
        if replicas <= self.stopped:
            with pytest.raises(NoReplicaAvailable):
                self.cache.put(key, value)
            old, _ = self.model.get(key, (MISS, True))
            self.model[key] = (old, old is MISS)
            return
        self.cache.put(key, value)
        self.model[key] = (value, not (replicas & self.stopped))

    @rule(key=st.sampled_from(MACHINE_KEYS))
    def delete(self, key: str) -> None:
        replicas = set(self.cache.replicas_for(key))
        self.log.append(f"delete({key!r}) replicas={self.cache.replicas_for(key)}")
        if replicas <= self.stopped:
            with pytest.raises(NoReplicaAvailable):
                self.cache.delete(key)
            old, _ = self.model.get(key, (MISS, True))
            self.model[key] = (old, old is MISS)
            return
        self.cache.delete(key)
        self.model[key] = (MISS, True)

    @rule(key=st.sampled_from(MACHINE_KEYS))
    def get(self, key: str) -> None:
        got = self.cache.get(key, MISS)
        self.log.append(f"get({key!r}) -> {'MISS' if got is MISS else repr(got)}")
        want, exact = self.model.get(key, (MISS, True))
        allowed = [want] if exact else [want, MISS]
        assert any(got is a or got == a for a in allowed), (
            f"one client's reads return its last write or, after a fault on a "
            f"replica, a miss — never an older value. {key!r}: expected "
            f"{'MISS' if want is MISS else repr(want)}{'' if exact else ' or MISS'}, got "
            f"{'MISS' if got is MISS else repr(got)}. Steps:\n  " + "\n  ".join(self.log[-15:])
        )

    @precondition(lambda self: len(self.stopped) < len(NODES))
    @rule(name=st.sampled_from(NODES))
    def stop(self, name: str) -> None:
        if name in self.stopped:
            return
        self.nodes[name].stop()
        self.stopped.add(name)
        self._touch(name)
        self.log.append(f"stop {name}")

    @precondition(lambda self: bool(self.stopped))
    @rule(name=st.sampled_from(NODES))
    def start(self, name: str) -> None:
        if name not in self.stopped:
            return
        self.nodes[name].start()
        self.stopped.discard(name)
        self.log.append(f"start {name}")

    @rule(name=st.sampled_from(NODES), key=st.sampled_from(MACHINE_KEYS))
    def write_while_down(self, name: str, key: str) -> None:
        """The classic: a node misses a write while down, then comes back."""
        was_down = name in self.stopped
        self.stop(name)
        self.put(key)
        if not was_down:
            self.start(name)

    @rule(name=st.sampled_from(NODES))
    def restart(self, name: str) -> None:
        if name in self.stopped:
            return
        self.nodes[name].restart()
        self._touch(name)
        self.log.append(f"restart {name} (data lost)")


TestStage3ShardedCacheModel = core(
    pytest.mark.rule("never-older")(pytest.mark.redis_faults(ShardedCacheMachine.TestCase))
)
TestStage3ShardedCacheModel.settings = settings(heavy, stateful_step_count=30)


# --------------------------------------------------------------------------- near cache
#
# The near-cache tests order events on purpose. A Tap holds a client's reply to one
# command — the command ran on the server, its reply is read but not yet returned — so
# the test can make another client write "while the reply is on the wire". Messages are
# delivered either by the near cache's own listeners (and then the test waits for the
# count in statistics()), or, for a near cache that is not started, by the test calling
# invalidate / channel_lost / channel_ready itself, in whatever order it likes.


class Tap:
    """Holds the ``skip + 1``-th reply to one of ``commands`` on ``client`` once armed.

    Every redis-py command goes through ``client.execute_command``; the tap replaces it
    on this one client object (a registered script's EVALSHA goes through it too).
    """

    def __init__(self, client: redis.Redis, *commands: str) -> None:
        self._inner: Callable[..., Any] = client.execute_command
        self._commands = {c.upper() for c in commands}
        self._armed = 0
        self._lock = threading.Lock()
        self.reached = threading.Event()
        self.release = threading.Event()
        client.execute_command = self._execute  # type: ignore[method-assign]

    def arm(self, skip: int = 0) -> None:
        self.reached.clear()
        self.release.clear()
        with self._lock:
            self._armed = skip + 1

    def _execute(self, *args: Any, **options: Any) -> Any:
        result = self._inner(*args, **options)
        with self._lock:
            hold = False
            if self._armed and str(args[0]).upper() in self._commands:
                self._armed -= 1
                hold = self._armed == 0
        if hold:
            self.reached.set()
            self.release.wait(DEADLINE_S)
        return result


class NearFleet:
    """Three nodes, a writer (``ShardedCache`` that publishes) and near caches to test."""

    def __init__(self, redis_env: RedisEnv, replicas: int = 2) -> None:
        self.env = redis_env
        self.nodes = dict(zip(NODES, redis_env.servers(len(NODES)), strict=True))
        self.prefix = redis_env.fresh_prefix()
        self.channel = f"{self.prefix}invalidations"
        self.replicas = replicas
        self._near: list[Any] = []
        self.writer = self.sharded({n: node.client() for n, node in self.nodes.items()})

    def sharded(self, clients: dict[str, redis.Redis]) -> Any:
        return stage().ShardedCache(
            clients,
            replicas=self.replicas,
            key_prefix=self.prefix,
            probe_interval_ns=0,
            channel=self.channel,
        )

    def near(
        self,
        *,
        started: bool = True,
        pubsub_proxies: dict[str, Any] | None = None,
        taps: tuple[str, ...] = (),
    ) -> tuple[Any, dict[str, Tap]]:
        """A near cache (LRU of 1000), its taps per node; started: wait for its channels."""
        clients = {n: node.client() for n, node in self.nodes.items()}
        if pubsub_proxies:  # its channels (only) go through these proxies
            for name, proxy in pubsub_proxies.items():
                via = self.nodes[name].proxied_client(proxy)
                clients[name].pubsub = via.pubsub  # type: ignore[method-assign]
        tapped = {n: Tap(c, *taps) for n, c in clients.items()} if taps else {}
        near = stage().NearCache(self.sharded(clients), stage(1).LRUCache(1000))
        self._near.append(near)
        if started:
            near.start()
            eventually(
                lambda: near.subscribed == set(NODES),
                "a started near cache to subscribe the channel of all three nodes",
            )
        else:
            for name in NODES:
                near.channel_ready(name)
        return near, tapped

    def proxies(self) -> dict[str, Any]:
        """A fresh fault proxy in front of each node, by node name."""
        return {name: self.env.proxy(node) for name, node in self.nodes.items()}

    def put_heard(self, near: Any, key: str, value: Any, *, since: int, also: int = 0) -> None:
        """The writer puts ``value``; wait until ``near`` has applied, counting from its
        ``since`` invalidations, every message of that put (one per replica written) and
        ``also`` more."""
        self.writer.put(key, value)
        messages = also + self.copies(key, value)
        eventually(
            lambda: near_stats(near).invalidations >= since + messages,
            f"{messages} invalidation messages (one per replica written by the put of "
            f"{value!r}{' and the earlier ones' if also else ''}) to be applied",
        )

    def copies(self, key: str, value: Any) -> int:
        """How many nodes hold ``value`` for ``key`` now: the messages its put published."""
        return sum(
            1
            for name, node in self.nodes.items()
            if (raw := node.client().get(self.writer.key_name(name, key))) is not None
            and json.loads(raw) == value
        )

    def close(self) -> None:
        for near in self._near:
            near.close()


@pytest.fixture
def fleet(redis_env: RedisEnv) -> Any:
    f = NearFleet(redis_env)
    yield f
    f.close()


def held_read(fleet: NearFleet, near: Any, taps: dict[str, Tap], key: str) -> tuple[Tap, Any]:
    """A ``near.get(key)`` in a thread, its reply from the key's first replica held on
    the wire: (the tap to release, the thread)."""
    tap = taps[fleet.writer.replicas_for(key)[0]]
    tap.arm()
    reader = spawn(lambda: near.get(key), "reader")
    assert tap.reached.wait(DEADLINE_S), "near cache: a miss must GET from Redis"
    return tap, reader


def near_stats(near: Any) -> NearStatistics:
    stats = near.statistics()
    assert isinstance(stats, NearStatistics), f"statistics() returned {stats!r}"
    return stats


@extended
@pytest.mark.rule("near-one-script", "near-message-is-the-key")
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
@pytest.mark.rule("near-bad-input")
def test_stage3_near_rejects_bad_arguments(fleet: NearFleet) -> None:
    clients = {n: node.client() for n, node in fleet.nodes.items()}
    plain = stage().ShardedCache(clients, replicas=2, key_prefix=fleet.prefix)
    with pytest.raises(ValueError, match="remote"):
        stage().NearCache(plain, stage(1).LRUCache(10))
    used = stage(1).LRUCache(10)
    used.put("k", 1)
    with pytest.raises(ValueError, match="local"):
        stage().NearCache(fleet.writer, used)
    with pytest.raises(ValueError, match="reconnect_ns"):
        stage().NearCache(fleet.writer, stage(1).LRUCache(10), reconnect_ns=-1)
    with pytest.raises(ValueError, match="channel"):
        stage().ShardedCache(clients, replicas=2, channel="")


@extended
@pytest.mark.rule("near-local-hit")
def test_stage3_near_a_hit_touches_no_redis(fleet: NearFleet) -> None:
    proxies = fleet.proxies()
    clients = {n: fleet.nodes[n].proxied_client(p) for n, p in proxies.items()}
    near = stage().NearCache(fleet.sharded(clients), stage(1).LRUCache(100))
    for name in NODES:
        near.channel_ready(name)
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


@extended
@pytest.mark.rule("near-weighted")
def test_stage3_near_a_weighted_local_cache_weighs_values_only(fleet: NearFleet) -> None:
    weighed: list[Any] = []

    def weigh(value: Any) -> int:
        weighed.append(value)
        return len(value)

    local = stage(1).LRUCache(10, max_weight=5, weigh=weigh)
    near = stage().NearCache(fleet.writer, local)
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
@pytest.mark.rule("near-read-your-writes")
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
@pytest.mark.rule("near-other-writes", "near-listener")
def test_stage3_near_another_clients_write_arrives_by_message(fleet: NearFleet) -> None:
    near, _ = fleet.near()
    fleet.writer.put("k", "v1")
    assert near.get("k") == "v1" and near.get("k") == "v1"
    fleet.put_heard(near, "k", "v2", since=near_stats(near).invalidations)
    got = near.get("k")
    assert got == "v2", (
        "near cache: 'v1' was cached; another client put 'v2' and its invalidations "
        f"were applied, so get('k') must be 'v2'; got {got!r}"
    )
    assert near.get("k") == "v2"
    fleet.writer.delete("k")
    eventually(
        lambda: near.get("k", MISS) is MISS,
        "another client's delete('k') to reach this near cache by an invalidation message "
        "(it held 'v2')",
    )


@extended
@pytest.mark.rule("near-placeholder", "near-no-lock-over-io")
def test_stage3_near_an_invalidation_that_overtakes_the_reply_wins(fleet: NearFleet) -> None:
    near, taps = fleet.near(taps=("GET",))
    fleet.writer.put("k", "v1")
    tap, reader = held_read(fleet, near, taps, "k")
    # The reply 'v1' is on the wire. Another client writes; both replicas' messages land.
    fleet.put_heard(near, "k", "v2", since=near_stats(near).invalidations)
    tap.release.set()
    assert reader.outcome("the held read must finish") == "v1"
    got = near.get("k")
    assert got == "v2", (
        "near cache: steps: get('k') misses and reads 'v1' from Redis; before that reply "
        "is stored, another client puts 'v2' and its invalidation arrives; then the reply "
        f"lands. It must be discarded (its placeholder is gone), so get('k') == 'v2'; got "
        f"{got!r} — the near cache stored a reply the invalidation had overtaken"
    )
    assert near_stats(near).discarded == 1, near_stats(near)


@extended
@pytest.mark.rule("near-writer-never-stores", "near-no-lock-over-io")
def test_stage3_near_a_writer_never_caches_the_value_it_wrote(fleet: NearFleet) -> None:
    near, taps = fleet.near(taps=("EVALSHA", "EVAL"))
    near.put("k", "v0")  # loads the scripts
    last = fleet.writer.replicas_for("k")[-1]
    before = near_stats(near).invalidations
    taps[last].arm()
    writer = spawn(lambda: near.put("k", "v1"), "writer")
    assert taps[last].reached.wait(DEADLINE_S), "near cache: put runs a script per replica"
    # 'v1' is on every replica, the last reply on the wire: another client overwrites it.
    fleet.put_heard(near, "k", "v2", since=before, also=fleet.copies("k", "v1"))
    taps[last].release.set()
    writer.outcome("the held put must finish")
    got = near.get("k")
    assert got == "v2", (
        "near cache: steps: put('k', 'v1') writes both replicas; before it returns, "
        "another client puts 'v2' and every invalidation has arrived; then put returns. "
        f"Redis holds 'v2', so get('k') == 'v2'; got {got!r} — a writer must not store the "
        "value it wrote (a later write's invalidation may already have come and gone)"
    )


def _cut(proxies: dict[str, Any], near: Any) -> None:
    before = near_stats(near).flushes
    for p in proxies.values():
        p.outage()
    eventually(
        lambda: not near.subscribed and near_stats(near).flushes > before,
        "the near cache to notice its channels dropped (subscribed() empty, a flush counted)",
    )


def _heal(proxies: dict[str, Any], near: Any) -> None:
    for p in proxies.values():
        p.heal()
    eventually(
        lambda: near.subscribed == set(NODES),
        "the near cache to subscribe its channels again after they came back",
    )


@extended
@pytest.mark.rule("near-flush", "near-recache", "near-listener")
def test_stage3_near_flushes_when_its_channel_drops(fleet: NearFleet) -> None:
    proxies = fleet.proxies()
    near, _ = fleet.near(pubsub_proxies=proxies)
    fleet.writer.put("k", "v1")
    assert near.get("k") == "v1" and near.get("k") == "v1"
    _cut(proxies, near)
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
    _heal(proxies, near)
    hits = near_stats(near).hits
    assert near.get("k") == "v3" and near.get("k") == "v3"
    assert near_stats(near).hits == hits + 1, (
        "near cache: once the channels are subscribed again, reads are cached again"
    )
    fleet.writer.put("k", "v4")
    eventually(lambda: near.get("k") == "v4", "invalidations to flow again")


@extended
@pytest.mark.rule("near-flush", "near-placeholder")
def test_stage3_near_a_read_in_flight_across_a_drop_is_not_cached(fleet: NearFleet) -> None:
    proxies = fleet.proxies()
    near, taps = fleet.near(pubsub_proxies=proxies, taps=("GET",))
    fleet.writer.put("k", "v1")
    tap, reader = held_read(fleet, near, taps, "k")
    _cut(proxies, near)
    fleet.writer.put("k", "v2")  # lost to the near cache
    _heal(proxies, near)
    tap.release.set()
    assert reader.outcome("the held read must finish") == "v1"
    got = near.get("k")
    assert got == "v2", (
        "near cache: steps: get('k') reads 'v1'; before the reply is stored the channels "
        "drop, another client puts 'v2' (message lost), the channels come back; then the "
        f"reply lands. It must be discarded (the flush took its placeholder); got {got!r}"
    )


@extended
@pytest.mark.rule("near-node-restart", "near-listener")
@pytest.mark.redis_faults
def test_stage3_near_a_node_killed_and_restarted(fleet: NearFleet) -> None:
    near, _ = fleet.near()
    keys = [f"doc:{i}" for i in range(30)]
    for key in keys:
        fleet.writer.put(key, "old")
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


class Holds:
    """Holds every reply to one of ``commands`` on ``client`` while armed, each on its own
    event, in the order they come: ``wait(n)`` for the n-th, ``release(n)`` lets it go."""

    def __init__(self, client: redis.Redis, *commands: str) -> None:
        self._inner: Callable[..., Any] = client.execute_command
        self._commands = {c.upper() for c in commands}
        self._cond = threading.Condition()
        self.armed = False
        self.held: list[threading.Event] = []
        client.execute_command = self._execute  # type: ignore[method-assign]

    def _execute(self, *args: Any, **options: Any) -> Any:
        result = self._inner(*args, **options)
        if not self.armed or str(args[0]).upper() not in self._commands:
            return result
        release = threading.Event()
        with self._cond:
            self.held.append(release)
            self._cond.notify_all()
        release.wait(DEADLINE_S)
        return result

    def wait(self, count: int) -> None:
        with self._cond:
            ok = self._cond.wait_for(lambda: len(self.held) >= count, DEADLINE_S)
        assert ok, f"near cache: expected {count} GET replies held, saw {len(self.held)}"

    def release_all(self) -> None:
        self.armed = False
        for event in self.held:
            event.set()


def _unstarted(fleet: NearFleet, ready: set[str], local: Any = None) -> Any:
    """A near cache that is not started, with ``channel_ready`` called for ``ready``."""
    local = stage(1).LRUCache(100) if local is None else local
    near = stage().NearCache(fleet.writer, local)
    for name in sorted(ready):
        near.channel_ready(name)
    return near


@extended
@pytest.mark.rule("near-all-replicas-subscribed", "near-recache")
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
        near = _unstarted(fleet, ready)
        got = [near.get(key), near.get(key)]
        s = near_stats(near)
        expect(
            got == ["v", "v"] and s.hits == 0,
            f"near cache: {key!r} lives on {replicas}; with only {sorted(ready)} "
            f"subscribed a write could reach a replica whose channel nobody hears, so get "
            f"reads through and caches nothing: two gets, 0 hits; got {got}, {s}",
        )
    near = _unstarted(fleet, set(NODES))
    near.channel_lost(other)  # not a replica of the key: it flushes, but the key may stay
    got = [near.get(key), near.get(key)]
    expect(
        got == ["v", "v"] and near_stats(near).hits == 1,
        f"near cache: with both replicas {replicas} subscribed (only {other} lost) the "
        f"key is cached: the second get is a hit; got {got}, {near_stats(near)}",
    )


@extended
@pytest.mark.rule("near-own-placeholder", "near-placeholder")
def test_stage3_near_each_read_stores_only_over_its_own_placeholder(fleet: NearFleet) -> None:
    key = "prompt:8"
    clients = {n: node.client() for n, node in fleet.nodes.items()}
    first = fleet.writer.replicas_for(key)[0]
    holds = Holds(clients[first], "GET")
    near = stage().NearCache(fleet.sharded(clients), stage(1).LRUCache(100))
    for name in NODES:
        near.channel_ready(name)
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
    expect(
        got == "v2",
        "near cache: steps: a get reads 'v1'; another client puts 'v2' and its message "
        "removes that read's placeholder; a second get puts its own placeholder and reads "
        "'v2'; the 'v1' reply lands, then the 'v2' one. A reply is stored only over its own "
        f"placeholder, so 'v1' is discarded and 'v2' kept; get('k') must be 'v2', got {got!r}",
    )
    expect(near_stats(near).discarded == 1, f"near cache: one discarded: {near_stats(near)}")


@extended
@pytest.mark.rule("near-ttl-bound")
def test_stage3_near_a_ttl_local_cache_bounds_a_silent_channel(fleet: NearFleet) -> None:
    clock, ttl = ManualClock(), 10 * NS_PER_S
    near = _unstarted(fleet, set(NODES), stage(1).TTLCache(100, ttl, clock=clock))
    fleet.writer.put("k", "v1")
    assert near.get("k") == "v1"
    fleet.writer.put("k", "v2")  # its messages never come: a channel that died silently
    clock.advance(ttl - 1)
    stale = near.get("k")
    clock.advance(1)
    fresh = near.get("k")
    expect(
        (stale, fresh) == ("v1", "v2"),
        f"near cache: with a TTLCache(ttl_ns=10 s) as the local cache and no message ever "
        f"delivered, 'v1' may be served until 10 s after it was fetched, and not at 10 s: "
        f"expected 'v1' then 'v2', got {stale!r} then {fresh!r}",
    )


class NearCacheMachine(RuleBasedStateMachine):
    """Adversarial delivery: messages arrive late, in any order, or are lost in a drop.

    The near cache under test is not started: the machine is its channel. Every write
    (another client's, or its own) queues one message per replica; ``deliver`` hands
    any queued message to ``invalidate``; ``drop``/``ready`` play a channel that drops
    and comes back. A read may be held with its reply on the wire while other rules
    run. The model keeps each key's versions (values are unique) and a floor per key:
    the newest version a read must at least return — raised by a delivered message of
    that write, by this client's own write (read-your-writes) and by a flush.
    """

    def __init__(self) -> None:
        super().__init__()
        self.env = RedisEnv.from_environment(faults=False, name="stage3-near-machine")
        self.nodes = dict(zip(NODES, self.env.servers(len(NODES)), strict=True))
        channel = f"{self.env.prefix}invalidations"

        def sharded(clients: dict[str, redis.Redis]) -> Any:
            return stage().ShardedCache(
                clients,
                replicas=2,
                key_prefix=self.env.prefix,
                channel=channel,
            )

        self.other = sharded({n: node.client() for n, node in self.nodes.items()})
        clients = {n: node.client() for n, node in self.nodes.items()}
        self.taps = {n: Tap(c, "GET") for n, c in clients.items()}
        self.near = stage().NearCache(sharded(clients), stage(1).LRUCache(100))
        for name in NODES:
            self.near.channel_ready(name)
        self.versions: dict[str, list[Any]] = {k: [MISS] for k in MACHINE_KEYS}
        self.floor = dict.fromkeys(MACHINE_KEYS, 0)
        self.queued: list[tuple[str, int]] = []  # (key, version index)
        self.held: tuple[str, str, int, Any] | None = None  # key, node, version, thread
        self.counter = 0
        self.log: list[str] = []

    def teardown(self) -> None:
        if self.held is not None:
            self.taps[self.held[1]].release.set()
        self.env.close()

    def _wrote(self, key: str, value: Any) -> int:
        self.versions[key].append(value)
        index = len(self.versions[key]) - 1
        self.queued += [(key, index)] * 2
        return index

    def _show(self, value: Any) -> str:
        return "MISS" if value is MISS else repr(value)

    @rule(key=st.sampled_from(MACHINE_KEYS))
    def other_puts(self, key: str) -> None:
        self.counter += 1
        value = f"{key}-v{self.counter}"
        self.other.put(key, value)
        self._wrote(key, value)
        self.log.append(f"another client: put({key!r}, {value!r})")

    @rule(key=st.sampled_from(MACHINE_KEYS))
    def other_deletes(self, key: str) -> None:
        self.other.delete(key)
        self._wrote(key, MISS)
        self.log.append(f"another client: delete({key!r})")

    @precondition(lambda self: self.held is None)
    @rule(key=st.sampled_from(MACHINE_KEYS))
    def own_put(self, key: str) -> None:
        self.counter += 1
        value = f"{key}-v{self.counter}"
        self.near.put(key, value)
        self.floor[key] = self._wrote(key, value)
        self.log.append(f"near cache: put({key!r}, {value!r})")

    @precondition(lambda self: bool(self.queued))
    @rule(data=st.data())
    def deliver(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.queued) - 1), label="message")
        key, index = self.queued.pop(i)
        self.near.invalidate(key)
        self.floor[key] = max(self.floor[key], index)
        self.log.append(f"deliver the message of {key!r} version {index}")

    @precondition(lambda self: self.held is None)
    @rule(name=st.sampled_from(NODES), key=st.sampled_from(MACHINE_KEYS))
    def drop(self, name: str, key: str) -> None:
        # Every drop meets its boundary: a value cached just before, made stale by a
        # write whose message is still in flight when the channel drops.
        self.get(key)
        self.other_puts(key)
        self.near.channel_lost(name)
        self.queued.clear()  # whatever was in flight is lost with the channel
        for k in MACHINE_KEYS:
            self.floor[k] = len(self.versions[k]) - 1
        self.log.append(f"channel of {name} drops (queued messages lost)")
        self.get(key)

    @rule(name=st.sampled_from(NODES))
    def ready(self, name: str) -> None:
        self.near.channel_ready(name)
        self.log.append(f"channel of {name} subscribed")

    def _check(self, key: str, got: Any, allowed: list[Any], what: str) -> None:
        assert any(got is a or got == a for a in allowed), (
            f"near cache: {what} {key!r} returned {self._show(got)}; allowed (no older "
            f"than the last delivered invalidation, own write or flush): "
            f"{[self._show(a) for a in allowed]}. Steps:\n  " + "\n  ".join(self.log[-20:])
        )

    @rule(key=st.sampled_from(MACHINE_KEYS))
    def get(self, key: str) -> None:
        if self.held is not None and self.held[0] == key:
            return  # the held read's placeholder is what this race is about
        got = self.near.get(key, MISS)
        self.log.append(f"near cache: get({key!r}) -> {self._show(got)}")
        self._check(key, got, self.versions[key][self.floor[key] :], "get")

    @precondition(lambda self: self.held is None)
    @rule(key=st.sampled_from(MACHINE_KEYS))
    def begin_read(self, key: str) -> None:
        node = self.near.remote.replicas_for(key)[0]
        self.near.invalidate(key)  # a duplicate message (harmless): this read must miss
        self.taps[node].arm()
        thread = spawn(lambda: self.near.get(key, MISS), f"held-{key}")
        assert self.taps[node].reached.wait(DEADLINE_S), (
            f"near cache: a get right after an invalidation of {key!r} must GET it from "
            f"its first replica {node}"
        )
        version = len(self.versions[key]) - 1
        self.held = (key, node, version, thread)
        self.log.append(f"near cache: get({key!r}) reads version {version} from Redis; reply held")

    @precondition(lambda self: self.held is not None)
    @rule()
    def finish_read(self) -> None:
        assert self.held is not None
        key, node, version, thread = self.held
        self.held = None
        self.taps[node].release.set()
        got = thread.outcome("the held read must finish")
        self.log.append(f"the held reply of {key!r} lands -> {self._show(got)}")
        # Not older than when it was read (a miss there may go on to the next replica).
        self._check(key, got, self.versions[key][version:], "the held get")


#: Before its random steps the machine always meets a drop (see ``drop``) with a value
#: cached, the channel coming back, and a read held across another client's write and
#: its message.
NEAR_WALKS: dict[str, Walk] = {
    "a drop": [
        ("other_puts", {"key": MACHINE_KEYS[0]}), ("get", {"key": MACHINE_KEYS[0]}),
        ("drop", {"name": NODES[0], "key": MACHINE_KEYS[0]}), ("ready", {"name": NODES[0]}),
        ("get", {"key": MACHINE_KEYS[0]}),
        ("begin_read", {"key": MACHINE_KEYS[0]}), ("other_puts", {"key": MACHINE_KEYS[0]}),
        ("deliver", {"data": Drawn(0)}), ("finish_read", {}), ("get", {"key": MACHINE_KEYS[0]}),
    ],
}  # fmt: skip

TestStage3NearCacheAdversarialOrder = extended(
    pytest.mark.rule("near-guarantee", "near-placeholder", "near-read-your-writes")(
        walked(NearCacheMachine, NEAR_WALKS)
    )
)
TestStage3NearCacheAdversarialOrder.settings = settings(heavy, stateful_step_count=40)
