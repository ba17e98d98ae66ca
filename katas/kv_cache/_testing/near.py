"""Driving near caches: a fleet of three nodes with a writer that publishes, near caches
built over it (started, so their listeners deliver messages, or not, so the test
delivers them itself), cutting and healing their channels, and the state machine that
delivers messages late, in any order, or loses them in a drop.

Reads are held on the wire with :mod:`katas.kv_cache._testing.wire`'s ``Tap``.
"""

from __future__ import annotations

import json
import time
from types import TracebackType
from typing import Any

import redis
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

from katas._harness.faultproxy import FaultProxy
from katas._harness.redis import RedisEnv
from katas._harness.story import check
from katas._harness.under_test import stage
from katas._harness.waiting import DEADLINE_S, Thread, eventually, spawn
from katas._harness.walks import Drawn, Walk
from katas.kv_cache._testing.caches import lru
from katas.kv_cache._testing.shards import MACHINE_KEYS, MISS, NODES, sharded
from katas.kv_cache._testing.wire import HoldBefore, Tap
from katas.kv_cache.api import CoherentCache, EvictingCache, NearStatistics, RemoteCache


def near_cache(remote: RemoteCache, local: EvictingCache, **kw: Any) -> CoherentCache:
    """The stage under test's ``NearCache`` with ``local`` in front of ``remote``."""
    near: CoherentCache = stage().NearCache(remote, local, **kw)
    return near


class NearFleet:
    """Three nodes, a writer (``ShardedCache`` that publishes) and near caches to test."""

    def __init__(self, redis_env: RedisEnv, replicas: int = 2) -> None:
        self.env = redis_env
        self.nodes = dict(zip(NODES, redis_env.servers(len(NODES)), strict=True))
        self.prefix = redis_env.fresh_prefix()
        self.channel = f"{self.prefix}invalidations"
        self.replicas = replicas
        self._near: list[CoherentCache] = []
        self.writer = self.sharded({n: node.client() for n, node in self.nodes.items()})

    def sharded(self, clients: dict[str, redis.Redis]) -> RemoteCache:
        """A ``ShardedCache`` over ``clients`` that publishes on the fleet's channel."""
        return sharded(
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
        pubsub_proxies: dict[str, FaultProxy] | None = None,
        taps: tuple[str, ...] = (),
    ) -> tuple[CoherentCache, dict[str, Tap]]:
        """A near cache (LRU of 1000), its taps per node; started: wait for its channels."""
        clients = {n: node.client() for n, node in self.nodes.items()}
        if pubsub_proxies:  # its channels (only) go through these proxies
            for name, proxy in pubsub_proxies.items():
                via = self.nodes[name].proxied_client(proxy)
                clients[name].pubsub = via.pubsub  # type: ignore[method-assign]
        tapped = {n: Tap(c, *taps) for n, c in clients.items()} if taps else {}
        near = near_cache(self.sharded(clients), lru(1000))
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

    def adopt(self, near: CoherentCache) -> CoherentCache:
        """A near cache the test built itself, closed with the fleet."""
        self._near.append(near)
        return near

    def proxies(self) -> dict[str, FaultProxy]:
        """A fresh fault proxy in front of each node, by node name."""
        return {name: self.env.proxy(node) for name, node in self.nodes.items()}

    def put_heard(
        self, near: CoherentCache, key: str, value: object, *, since: int, also: int = 0
    ) -> None:
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

    def copies(self, key: str, value: object) -> int:
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


class Subscribers:
    """A plain subscriber to the fleet's channel on each node: what each node publishes.
    :meth:`heard` tells a message from silence at once: it publishes a marker on that
    node and returns what arrived before it (one server's messages arrive in order)."""

    MARKER = "--end of what was published--"

    def __init__(self, fleet: NearFleet) -> None:
        self._fleet = fleet
        self._pubsubs: dict[str, Any] = {}
        for name, node in fleet.nodes.items():
            # redis-py types pubsub() from 8.2 on; before, the call is untyped
            pubsub = node.client().pubsub()  # type: ignore[no-untyped-call, unused-ignore]
            self._pubsubs[name] = pubsub
            pubsub.subscribe(fleet.channel)
            self._next(name, f"the confirmation of a SUBSCRIBE on {name}")

    def _next(self, name: str, what: str) -> dict[str, Any]:
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline:
            message = self._pubsubs[name].get_message(timeout=DEADLINE_S)
            if message is not None:
                return dict(message)
        check(False, f"within {DEADLINE_S:.0f} s, expected {what}")
        raise AssertionError(what)  # check raised already

    def heard(self, name: str) -> list[str]:
        """The messages ``name`` published on the channel since the last look."""
        self._fleet.nodes[name].client().publish(self._fleet.channel, self.MARKER)
        got: list[str] = []
        while True:
            message = self._next(name, f"the marker published on {name} to arrive")
            if message["type"] != "message":
                continue
            data = message["data"]
            text = data.decode() if isinstance(data, bytes) else str(data)
            if text == self.MARKER:
                return got
            got.append(text)

    def __enter__(self) -> Subscribers:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for pubsub in self._pubsubs.values():
            pubsub.close()


def held_read(
    fleet: NearFleet, near: CoherentCache, taps: dict[str, Tap], key: str
) -> tuple[Tap, Thread]:
    """A ``near.get(key)`` in a thread, its reply from the key's first replica held on
    the wire: (the tap to release, the thread)."""
    tap = taps[fleet.writer.replicas_for(key)[0]]
    tap.arm()
    reader = spawn(lambda: near.get(key), "reader")
    check(tap.reached.wait(DEADLINE_S), "near cache: a miss must GET from Redis")
    return tap, reader


def reply_lands(tap: Tap, reader: Thread, near: CoherentCache, read: object) -> object:
    """Release the reply :func:`held_read` held; its read must return ``read`` (what the
    server answered). Then read the key ``"k"`` again: what the near cache serves now."""
    tap.release.set()
    got = reader.outcome("the held read must finish")
    assert got == read, f"the held read must return what Redis answered, {read!r}; got {got!r}"
    return near.get("k")


def near_stats(near: CoherentCache) -> NearStatistics:
    """``near.statistics()``, checked to be a NearStatistics."""
    stats = near.statistics()
    assert isinstance(stats, NearStatistics), f"statistics() returned {stats!r}"
    return stats


def cut(proxies: dict[str, FaultProxy], near: CoherentCache) -> None:
    """Every channel of ``near`` drops (an outage on each proxy); wait until it noticed."""
    before = near_stats(near).flushes
    for p in proxies.values():
        p.outage()
    eventually(
        lambda: not near.subscribed and near_stats(near).flushes > before,
        "the near cache to notice its channels dropped (subscribed() empty, a flush counted)",
    )


def heal(proxies: dict[str, FaultProxy], near: CoherentCache) -> None:
    """The proxies heal; wait until ``near`` has subscribed every channel again."""
    for p in proxies.values():
        p.heal()
    eventually(
        lambda: near.subscribed == set(NODES),
        "the near cache to subscribe its channels again after they came back",
    )


class HeldWrite:
    """An unstarted near cache over clients of its own (``"v0"`` put under ``key`` by the
    fleet's writer, which loads the scripts), whose ``write`` of ``key`` (``"put"`` of
    ``"v1"``, or ``"delete"``) the test starts with :meth:`start`: it is held before its
    script reaches the key's first replica until :meth:`finish`."""

    def __init__(self, fleet: NearFleet, key: str, write: str) -> None:
        clients = {n: node.client() for n, node in fleet.nodes.items()}
        self.key, self.write = key, write
        self.first = fleet.writer.replicas_for(key)[0]
        self._hold = HoldBefore(clients[self.first], "EVALSHA", "EVAL")
        self.near = unstarted(fleet, set(NODES), clients=clients)  # nobody delivers messages
        fleet.writer.put(key, "v0")
        self._writer: Thread | None = None

    def start(self) -> None:
        """This client's write starts; return once it is held on the wire."""
        self._hold.arm()
        near, key = self.near, self.key
        act = (lambda: near.put(key, "v1")) if self.write == "put" else lambda: near.delete(key)
        self._writer = spawn(act, "writer")
        check(
            self._hold.reached.wait(DEADLINE_S),
            f"near cache: {self.write} runs a script on {self.first}",
        )

    def still_held(self) -> bool:
        """The write is still held on the wire (the test has not let it go, nor has the
        hold given up waiting for the test)."""
        return not self._hold.release.is_set() and not self._hold.gave_up.is_set()

    def finish(self) -> None:
        """Let the write go on; return once it has."""
        self._hold.release.set()
        if self._writer is not None:
            self._writer.outcome(f"the held {self.write} must finish")


def unstarted(
    fleet: NearFleet,
    ready: set[str],
    local: EvictingCache | None = None,
    clients: dict[str, redis.Redis] | None = None,
) -> CoherentCache:
    """A near cache that is not started, with ``channel_ready`` called for ``ready``: the
    test delivers (or withholds) every message. Over the fleet's writer, or a cache of
    its own over ``clients`` (e.g. clients a test holds replies of)."""
    local = lru(100) if local is None else local
    near = near_cache(fleet.writer if clients is None else fleet.sharded(clients), local)
    for name in sorted(ready):
        near.channel_ready(name)
    return near


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

        def publishing(clients: dict[str, redis.Redis]) -> RemoteCache:
            return sharded(
                clients,
                replicas=2,
                key_prefix=self.env.prefix,
                channel=channel,
            )

        self.other = publishing({n: node.client() for n, node in self.nodes.items()})
        clients = {n: node.client() for n, node in self.nodes.items()}
        self.taps = {n: Tap(c, "GET") for n, c in clients.items()}
        self.near = near_cache(publishing(clients), lru(100))
        for name in NODES:
            self.near.channel_ready(name)
        self.versions: dict[str, list[object]] = {k: [MISS] for k in MACHINE_KEYS}
        self.floor = dict.fromkeys(MACHINE_KEYS, 0)
        self.queued: list[tuple[str, int]] = []  # (key, version index)
        self.held: tuple[str, str, int, Thread] | None = None  # key, node, version, thread
        self.counter = 0
        self.log: list[str] = []

    def teardown(self) -> None:
        if self.held is not None:
            self.taps[self.held[1]].release.set()
        self.env.close()

    def _wrote(self, key: str, value: object) -> int:
        self.versions[key].append(value)
        index = len(self.versions[key]) - 1
        self.queued += [(key, index)] * 2
        return index

    def _show(self, value: object) -> str:
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

    def _check(self, key: str, got: object, allowed: list[object], what: str) -> None:
        check(
            any(got is a or got == a for a in allowed),
            f"near cache: {what} {key!r} returned {self._show(got)}; allowed (no older "
            f"than the last delivered invalidation, own write or flush): "
            f"{[self._show(a) for a in allowed]}. Steps:\n  " + "\n  ".join(self.log[-20:]),
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
        check(
            self.taps[node].reached.wait(DEADLINE_S),
            f"near cache: a get right after an invalidation of {key!r} must GET it from "
            f"its first replica {node}",
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
