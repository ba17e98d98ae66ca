"""Driving a sharded cache over three Redis nodes: building it (directly, or with one
node behind a fault proxy), reading what each node holds, and the state machine that
checks one client's reads while nodes stop, start and restart.

Nodes are three fakeredis servers by default, three private ``redis-server`` processes
with ``KATA_REDIS_SERVER=redis-server`` (``redis_env``, from the harness).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from katas._harness.faultproxy import FaultProxy
from katas._harness.profiles import heavy_examples
from katas._harness.redis import RedisEnv, RedisNode
from katas._harness.story import check
from katas._harness.under_test import stage
from katas.kv_cache._testing.rings import KEYS
from katas.kv_cache._testing.wire import Sent
from katas.kv_cache.api import (
    NS_PER_S,
    ManualClock,
    NodeStatistics,
    NoReplicaAvailable,
    RemoteCache,
)

#: The three nodes every stage-3 test runs on.
NODES = ("n0", "n1", "n2")
#: A get's default: tells "absent" from a stored None.
MISS: object = object()
#: The keys the state machines write and read.
MACHINE_KEYS = ("k0", "k1", "k2")

#: The settings of the stage-3 state machines (the profile's heavy example count).
heavy = settings(
    max_examples=heavy_examples(),
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    deadline=None,
)


def sharded(clients: dict[str, redis.Redis], **kw: Any) -> RemoteCache:
    """The stage under test's ``ShardedCache`` over ``clients`` (``kw``: its options)."""
    cache: RemoteCache = stage().ShardedCache(clients, **kw)
    return cache


def stored(
    cache: RemoteCache, kind: str, value: Callable[[str], object], count: int = 40
) -> list[str]:
    """Put the keys ``kind:0`` to ``kind:{count - 1}``, each with ``value(key)``, and
    return them: the data a faults test then reads across a stop or a restart."""
    keys = [f"{kind}:{i}" for i in range(count)]
    for key in keys:
        cache.put(key, value(key))
    return keys


def unencodable() -> dict[str, object]:
    """Values JSON would change or cannot encode, by what they are: a put refuses each
    with a ``TypeError`` naming ``value``."""
    deep: Any = "leaf"
    for _ in range(5000):
        deep = [deep]
    return {
        "int and str keys": {1: "a", "1": "b"},  # JSON would keep one of the two
        "a set": {1, 2},
        "NaN": float("nan"),
        "5 000 levels deep": deep,  # json would raise RecursionError
    }


def read_despite_faults(cache: RemoteCache, key: str, rule: str) -> Any:
    """``cache.get(key, MISS)``; a node's connection error or timeout escaping it fails
    the test, with ``rule`` (a read must fail over, or miss, instead)."""
    try:
        return cache.get(key, MISS)
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        pytest.fail(f"{rule}: {exc!r}")


def make_cache(
    redis_env: RedisEnv, *, replicas: int = 2, prefix: str | None = None, **kw: Any
) -> tuple[RemoteCache, dict[str, RedisNode], str]:
    """A ShardedCache over three servers: (cache, name -> node, key prefix)."""
    nodes = dict(zip(NODES, redis_env.servers(len(NODES)), strict=True))
    prefix = prefix if prefix is not None else redis_env.fresh_prefix()
    kw.setdefault("probe_interval_ns", 0)
    cache = sharded(
        {name: node.client() for name, node in nodes.items()},
        replicas=replicas,
        key_prefix=prefix,
        **kw,
    )
    return cache, nodes, prefix


def recorded_cache(
    redis_env: RedisEnv, **kw: Any
) -> tuple[RemoteCache, dict[str, RedisNode], str, dict[str, Sent]]:
    """As :func:`make_cache`, each node's client recording what it sends: (cache, name ->
    node, key prefix, name -> :class:`Sent`)."""
    nodes = dict(zip(NODES, redis_env.servers(len(NODES)), strict=True))
    prefix = redis_env.fresh_prefix()
    clients = {name: node.client() for name, node in nodes.items()}
    sent = {name: Sent(client) for name, client in clients.items()}
    kw.setdefault("probe_interval_ns", 0)
    kw.setdefault("replicas", 2)
    cache = sharded(clients, key_prefix=prefix, **kw)
    return cache, nodes, prefix, sent


def holders(nodes: dict[str, RedisNode], redis_env: RedisEnv, prefix: str, key: str) -> set[str]:
    """The nodes holding some Redis key for ``key`` under ``prefix`` (any epoch)."""
    return {
        name
        for name, node in nodes.items()
        if any(n.endswith(f":{key}") for n in redis_env.keys(prefix, node=node))
    }


def node_stats(cache: RemoteCache, name: str) -> NodeStatistics:
    """What ``cache`` has seen of node ``name``, checked to be a NodeStatistics."""
    s = cache.statistics()[name]
    assert isinstance(s, NodeStatistics), s
    return s


def next_probe_of_n0_in(
    cache: RemoteCache,
    clock: ManualClock,
    call: Callable[[], object],
    interval_ns: int,
    errors: int,
    story: str,
) -> None:
    """n0 is down, still failing, with ``errors`` errors so far: ``call`` must not try it
    before ``interval_ns`` from now (1 ns before, it is skipped), and must probe it at
    that very instant (one more error, and n0 still down). ``story`` says how n0 got
    there and names the instant."""
    clock.advance(interval_ns - 1)
    call()
    s = node_stats(cache, "n0")
    check(s.errors == errors, f"{story}. 1 ns before that instant, the call must not try n0: {s}")
    clock.advance(1)
    call()
    s = node_stats(cache, "n0")
    check(
        s.errors == errors + 1 and s.down,
        f"{story}. At that instant the call probes n0 again, and fails: {s}",
    )


#: One call a test makes on a key: ``(cache, key)``.
Call = Callable[[RemoteCache, str], object]
#: The calls every rule of a node's life holds for, by name.
CALLS: dict[str, Call] = {
    "get": lambda cache, key: cache.get(key),
    "put": lambda cache, key: cache.put(key, "v"),
    "delete": lambda cache, key: cache.delete(key),
}


def after_100_calls(
    redis_env: RedisEnv,
    cache: RemoteCache,
    node: RedisNode,
    prefix: str,
    calls_on: list[str],
    call: Call = CALLS["get"],
) -> tuple[int, list[str]]:
    """100 more calls (gets unless ``call`` says), cycling through ``calls_on`` (keys
    whose first replica is ``node``, named ``n0``); then its epoch and the keys under
    ``prefix`` left on it under an older one: copies of an epoch it abandoned."""
    for i in range(100):
        call(cache, calls_on[i % len(calls_on)])
    epoch = node_stats(cache, "n0").epoch
    current = f"{prefix}{epoch}:"
    return epoch, [k for k in redis_env.keys(prefix, node=node) if not k.startswith(current)]


def behind_a_proxy(
    redis_env: RedisEnv, **client: Any
) -> tuple[RemoteCache, FaultProxy, ManualClock]:
    """A cache over three nodes, ``n0`` reached through a fault proxy (``client``: its
    client's options); a 1 s probe interval on a ManualClock. (cache, proxy, clock)."""
    servers = dict(zip(NODES, redis_env.servers(len(NODES)), strict=True))
    proxy = redis_env.proxy(servers["n0"])
    clients = {name: node.client() for name, node in servers.items()}
    clients["n0"] = servers["n0"].proxied_client(proxy, **client)
    clock = ManualClock()
    cache = sharded(
        clients,
        replicas=2,
        key_prefix=redis_env.fresh_prefix(),
        probe_interval_ns=NS_PER_S,
        clock=clock,
    )
    return cache, proxy, clock


@dataclass
class ProxiedN0:
    """A cache over three nodes whose ``n0`` is reached through a fault proxy (outages
    that keep n0's data, on fakeredis and on a real server alike), probing every 1 s on
    a ManualClock: see :func:`n0_behind_a_proxy`."""

    cache: RemoteCache
    servers: dict[str, RedisNode]
    proxy: FaultProxy
    #: n0's client, through the proxy: wrap it to record or hold what it sends.
    client: redis.Redis
    clock: ManualClock
    prefix: str

    def keys_at(self, position: int, count: int = 1) -> list[str]:
        """``count`` keys (of ``user:0`` …) whose ``position``-th replica is ``n0``."""
        found = [k for k in KEYS[:2_000] if self.cache.replicas_for(k)[position] == "n0"]
        return found[:count]

    def store_docs(self, value: str = "v0") -> list[str]:
        """Put ``doc:0`` … ``doc:59`` (copies on n0 under its epoch now): those whose first
        replica is n0, for the reclaim tests to reach n0 through."""
        docs = [f"doc:{i}" for i in range(60)]
        for key in docs:
            self.cache.put(key, value)
        return [k for k in docs if self.cache.replicas_for(k)[0] == "n0"]

    def marked_down(self, key: str) -> None:
        """An outage of n0 that a ``get(key)`` meets (n0 is marked down), then healed:
        n0 comes back at the next call that probes it."""
        self.proxy.outage()
        self.cache.get(key)
        self.proxy.heal()


def n0_behind_a_proxy(redis_env: RedisEnv, *, prefix: str | None = None, **kw: Any) -> ProxiedN0:
    """A ShardedCache over three nodes, ``n0`` behind a fault proxy; ``kw``: its options
    (2 replicas, a 1 s probe interval on a ManualClock unless given)."""
    servers = dict(zip(NODES, redis_env.servers(len(NODES)), strict=True))
    proxy = redis_env.proxy(servers["n0"])
    clients = {name: node.client() for name, node in servers.items()}
    clients["n0"] = servers["n0"].proxied_client(proxy)
    clock = kw.setdefault("clock", ManualClock())
    prefix = prefix if prefix is not None else redis_env.fresh_prefix()
    kw.setdefault("replicas", 2)
    kw.setdefault("probe_interval_ns", NS_PER_S)
    cache = sharded(clients, key_prefix=prefix, **kw)
    return ProxiedN0(cache, servers, proxy, clients["n0"], clock, prefix)


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
        self.cache = sharded(
            {name: node.client() for name, node in self.nodes.items()},
            replicas=2,
            key_prefix=self.env.prefix,
            probe_interval_ns=0,
        )
        self.stopped: set[str] = set()
        self.model: dict[str, tuple[object, bool]] = {}
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
        check(
            any(got is a or got == a for a in allowed),
            f"one client's reads return its last write or, after a fault on a "
            f"replica, a miss — never an older value. {key!r}: expected "
            f"{'MISS' if want is MISS else repr(want)}{'' if exact else ' or MISS'}, got "
            f"{'MISS' if got is MISS else repr(got)}. Steps:\n  " + "\n  ".join(self.log[-15:]),
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
