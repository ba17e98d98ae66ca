"""Stage 3 reference: a cache sharded over Redis nodes by a consistent-hash ring.

Design (see katas/kv_cache/README.md):

- ``HashRing``: every node owns ``vnodes`` points on a 64-bit circle, the first 8 bytes
  of ``blake2b(f"{node}#{i}")`` — a hash every process computes alike (Python's
  ``hash(str)`` is salted per process, so two gateways would disagree on every key).
  The points are kept sorted with their owners; a key's preference list is the walk
  clockwise from ``blake2b(key)``'s point (the first point at or after it, wrapping),
  collecting distinct owners. Adding a node only inserts its points, so the only keys
  that move are those whose walk now meets the new node first: they move onto it and
  nowhere else; removing a node moves only its keys. Ties between equal points go to
  the smaller node name, so placement never depends on the order nodes were added.
- ``ShardedCache``: a key lives on the first ``replicas`` nodes of its preference list
  under ``f"{key_prefix}{epoch}:{key}"``, its value as JSON. A write goes to every
  replica it can reach; a read asks them in preference order and the first hit wins
  (a miss or a failure moves on to the next). A node that raises ``ConnectionError`` or
  ``TimeoutError`` is marked down and skipped for ``probe_interval_ns`` — a dead node
  must not cost every request a socket timeout — and then tried again.
- Epochs: while a node is down this client's writes skip it, so when it comes back its
  copies may be stale. The first successful call after a node was marked down bumps
  the node's epoch, so its old key names are never read again and the next replica
  answers until new writes reach it. The abandoned copies are then deleted a batch at
  a time (one ``SCAN … MATCH <prefix><old epoch>:*`` page and an ``UNLINK`` after each
  later call on that node), so memory follows live keys even with ``ttl_ns=None``, and
  no call pays for more than one page, however large the node.
- ``NearCache`` (extended): a stage-1 cache in this process in front of a
  ``ShardedCache`` whose writes publish invalidations. Every write runs one script per
  replica that does SET (or DEL) and PUBLISH of the key together — atomically, so no
  reader can see the new value without the message being on its way, and a writer that
  dies between the two cannot leave near caches stale forever. A listener thread per
  node applies the messages. Three rules keep it coherent:

  1. a miss first stores a placeholder, then reads Redis, and stores the reply only if
     its placeholder is still there — an invalidation (or a flush) that overtakes the
     reply removes the placeholder, so the stale reply is dropped;
  2. a writer removes its own local entry after its remote write (read-your-writes)
     and never stores the value it wrote: another writer's invalidation may already
     have come and gone, so only a read can know what Redis holds now;
  3. when a node's channel drops, messages may be lost, so the whole local cache
     (placeholders too) is flushed, and keys on that node are not cached again until
     the channel is subscribed again.

  A channel that dies without an error (a silent half-open connection) is not noticed;
  a ``TTLCache`` as the local cache bounds how long such an entry can be served.
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import json
import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import redis

from katas.kv_cache.api import (
    NS_PER_MS,
    NS_PER_S,
    Clock,
    MonotonicClock,
    NearStatistics,
    NodeStatistics,
    NoReplicaAvailable,
    check_client,
    to_json,
    unavailable,
)

T = TypeVar("T")

#: What ends a near cache's subscription: the connection refused, reset, or timed out.
DISCONNECTED = (redis.ConnectionError, redis.TimeoutError, OSError)

_MISSING: Any = object()
_log = logging.getLogger(__name__)

# A write that also tells near caches: one script, so SET and PUBLISH happen together.
_PUT_AND_PUBLISH = """
if ARGV[2] == '0' then
  redis.call('SET', KEYS[1], ARGV[1])
else
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
end
redis.call('PUBLISH', ARGV[3], ARGV[4])
return 1
"""
_DELETE_AND_PUBLISH = """
local removed = redis.call('DEL', KEYS[1])
redis.call('PUBLISH', ARGV[1], ARGV[2])
return removed
"""


def _point(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def _name(what: str, value: object) -> str:
    """A node name or a key: a str that UTF-8 can encode (the ring hashes its bytes)."""
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str, got {value!r}")
    try:
        value.encode()
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} must be encodable as UTF-8, got {value!r}: {e}") from None
    return value


#: Virtual nodes per node at most: beyond it a ring costs memory, not balance.
MAX_VNODES = 2**16
#: The longest TTL: the put script reads it as a Lua double, exact below 2^53 (ms).
MAX_TTL_MS = 2**52
#: Keys one sweep step asks SCAN for: a page costs the server about as much as a GET.
SWEEP_COUNT = 256


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


class HashRing:
    """A consistent-hash ring with ``vnodes`` virtual nodes per node (stable across processes)."""

    def __init__(self, nodes: Iterable[str], *, vnodes: int = 160) -> None:
        if isinstance(vnodes, bool) or not isinstance(vnodes, int) or not 1 <= vnodes <= MAX_VNODES:
            raise ValueError(f"vnodes must be an int in [1, {MAX_VNODES}], got {vnodes!r}")
        if isinstance(nodes, str):
            raise TypeError(f"nodes must be an iterable of node names, not the str {nodes!r}")
        self._vnodes = vnodes
        self._ring: list[tuple[int, str]] = []  # (point, node), sorted
        self._nodes: set[str] = set()
        for node in nodes:
            self.add(node)

    @property
    def vnodes(self) -> int:
        return self._vnodes

    @property
    def nodes(self) -> list[str]:
        """The nodes on the ring, sorted by name."""
        return sorted(self._nodes)

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, node: object) -> bool:
        return node in self._nodes

    def add(self, node: str) -> None:
        if not _name("a node name", node):
            raise ValueError(f"a node name must be a non-empty str, got {node!r}")
        if node in self._nodes:
            raise ValueError(f"node {node!r} is already on the ring")
        points = [(_point(f"{node}#{i}"), node) for i in range(self._vnodes)]  # before any change
        self._nodes.add(node)
        self._ring.extend(points)
        self._ring.sort()

    def remove(self, node: str) -> None:
        if node not in self._nodes:
            raise ValueError(f"node {node!r} is not on the ring")
        self._nodes.remove(node)
        self._ring = [entry for entry in self._ring if entry[1] != node]

    def nodes_for(self, key: str, n: int) -> list[str]:
        _name("key", key)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be an int >= 1, got {n!r}")
        want = min(n, len(self._nodes))
        if not want:
            return []
        ring = self._ring
        i = bisect.bisect_left(ring, (_point(key), ""))
        found: list[str] = []
        for step in range(len(ring)):
            node = ring[(i + step) % len(ring)][1]
            if node not in found:
                found.append(node)
                if len(found) == want:
                    break
        return found

    def node_for(self, key: str) -> str:
        if not self._nodes:
            raise LookupError("the ring is empty: add a node first")
        return self.nodes_for(key, 1)[0]


@dataclass
class _Node:
    name: str
    client: redis.Redis
    put_script: Any = None  # redis Script objects, when writes publish
    delete_script: Any = None
    epoch: int = 0
    retired: list[int] = field(default_factory=list)  # epochs whose copies remain
    cursor: int = 0  # the sweep's SCAN cursor in retired[0]
    sweeping: bool = False
    down: bool = False
    retry_at_ns: int = 0
    hits: int = 0
    misses: int = 0
    errors: int = 0
    failovers: int = 0


class ShardedCache:
    """A key-value cache over several Redis nodes: consistent hashing, R replicas, failover.

    Limits of a per-client epoch: the epoch lives in this client only. Another client
    that never saw the node fail keeps reading its old epoch and may read a value this
    client overwrote while the node was down; a new process starts at epoch 0 and can
    read copies an older client abandoned; two clients that bumped at different times
    stop sharing that node's copies (each reads through to the next replica). A fleet
    needs the epoch from one place all clients consult — a membership service, or a
    generation key the node's supervisor sets when it restarts.
    """

    def __init__(
        self,
        nodes: Mapping[str, redis.Redis],
        *,
        replicas: int = 2,
        vnodes: int = 160,
        key_prefix: str = "kv:",
        ttl_ns: int | None = None,
        probe_interval_ns: int = NS_PER_S,
        clock: Clock | None = None,
        channel: str | None = None,
    ) -> None:
        if not nodes:
            raise ValueError("nodes must name at least one Redis node")
        for name, client in nodes.items():  # a socket timeout; no retry that writes twice
            check_client(client, f"nodes[{name!r}]")
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
            raise ValueError(f"replicas must be an int >= 1, got {replicas!r}")
        if replicas > len(nodes):
            raise ValueError(f"replicas={replicas} exceeds the {len(nodes)} nodes given")
        if ttl_ns is not None and (
            isinstance(ttl_ns, bool)
            or not isinstance(ttl_ns, int)
            or not 0 < ttl_ns <= MAX_TTL_MS * NS_PER_MS
        ):
            raise ValueError(
                f"ttl_ns must be a positive int of at most 2^52 ms, or None, got {ttl_ns!r}"
            )
        if (
            isinstance(probe_interval_ns, bool)
            or not isinstance(probe_interval_ns, int)
            or probe_interval_ns < 0
        ):
            raise ValueError(f"probe_interval_ns must be an int >= 0, got {probe_interval_ns!r}")
        if channel is not None and (not isinstance(channel, str) or not channel):
            raise ValueError(f"channel must be a non-empty str or None, got {channel!r}")
        self._ring = HashRing(nodes, vnodes=vnodes)
        self._nodes = {name: _Node(name, client) for name, client in nodes.items()}
        self._channel = channel
        if channel is not None:
            for node in self._nodes.values():
                node.put_script = node.client.register_script(_PUT_AND_PUBLISH)
                node.delete_script = node.client.register_script(_DELETE_AND_PUBLISH)
        self._replicas = replicas
        self._prefix = key_prefix
        self._px = None if ttl_ns is None else -(-ttl_ns // NS_PER_MS)  # whole ms, rounded up
        self._probe_ns = probe_interval_ns
        self._clock: Clock = clock if clock is not None else MonotonicClock()
        self._lock = threading.Lock()  # node state and counters only; never held over I/O

    @property
    def ring(self) -> HashRing:
        return self._ring

    @property
    def channel(self) -> str | None:
        """The channel every write publishes its key on (None: writes do not publish)."""
        return self._channel

    @property
    def clients(self) -> dict[str, redis.Redis]:
        """Each node's client, by node name."""
        return {name: node.client for name, node in self._nodes.items()}

    def replicas_for(self, key: str) -> list[str]:
        """The nodes that hold ``key``, in preference order."""
        return self._ring.nodes_for(key, self._replicas)

    def key_name(self, node: str, key: str) -> str:
        """The Redis key under which ``node`` holds ``key`` now."""
        return f"{self._prefix}{self._nodes[node].epoch}:{key}"

    # -- one call on one node --------------------------------------------------------
    def _call(self, node: _Node, key: str, op: Callable[[redis.Redis, str], T]) -> T | Any:
        """``op(client, name)`` on ``node``, or _MISSING if it is (or just went) down."""
        with self._lock:
            probing = node.down
            if probing and self._clock.now_ns() < node.retry_at_ns:
                return _MISSING
            epoch = node.epoch + 1 if probing else node.epoch
        try:
            result = op(node.client, f"{self._prefix}{epoch}:{key}")
        except redis.RedisError as error:
            if not unavailable(error):  # a bug (a script error) is raised
                raise
            self._mark_down(node)
            return _MISSING
        with self._lock:
            if node.down and node.epoch + 1 == epoch:  # back: its old copies are retired
                node.retired.append(node.epoch)
                node.epoch, node.down = epoch, False
            sweep = bool(node.retired) and not node.sweeping
            node.sweeping |= sweep
        if sweep:
            self._sweep_step(node)
        return result

    def _sweep_step(self, node: _Node) -> None:
        """Delete one SCAN page of the oldest retired epoch's copies on ``node``."""
        epoch, cursor = node.retired[0], node.cursor
        pattern = f"{_glob_escape(self._prefix)}{epoch}:*"
        try:
            cursor, names = node.client.scan(cursor, match=pattern, count=SWEEP_COUNT)
            if names:
                node.client.unlink(*names)
        except redis.RedisError as error:
            with self._lock:
                node.sweeping = False
            if not unavailable(error):
                raise
            self._mark_down(node)  # the page is tried again once the node is back
            return
        with self._lock:
            node.sweeping = False
            node.cursor = cursor
            if cursor == 0:  # the whole keyspace was walked: that epoch is gone
                node.retired.pop(0)

    def _mark_down(self, node: _Node) -> None:
        with self._lock:
            node.errors += 1
            node.down = True
            node.retry_at_ns = self._clock.now_ns() + self._probe_ns

    # -- the cache -------------------------------------------------------------------
    def get(self, key: str, default: Any = None) -> Any:
        replicas = self.replicas_for(key)
        for i, name in enumerate(replicas, 1):
            node = self._nodes[name]
            raw = self._call(node, key, lambda c, k: c.get(k))
            if raw is _MISSING:
                if i < len(replicas):  # a failover goes on to a later replica
                    with self._lock:
                        node.failovers += 1
                continue
            with self._lock:
                if raw is None:
                    node.misses += 1
                else:
                    node.hits += 1
            if raw is not None:
                return json.loads(raw)
        return default

    def put(self, key: str, value: Any) -> None:
        data = to_json("value", value)  # what JSON cannot encode, or would change: refused
        px, channel = self._px, self._channel

        def write(node: _Node) -> Any:
            if channel is None:
                return self._call(node, key, lambda c, k: c.set(k, data, px=px))
            args = [data, px or 0, channel, key]
            return self._call(node, key, lambda c, k: node.put_script(keys=[k], args=args))

        written = [write(self._nodes[name]) for name in self.replicas_for(key)]
        if all(w is _MISSING for w in written):
            raise NoReplicaAvailable(
                f"put({key!r}): none of its replicas {self.replicas_for(key)} is reachable"
            )

    def delete(self, key: str) -> bool:
        channel = self._channel

        def remove(node: _Node) -> Any:
            if channel is None:
                return self._call(node, key, lambda c, k: c.delete(k))
            args = [channel, key]
            return self._call(node, key, lambda c, k: node.delete_script(keys=[k], args=args))

        removed = [remove(self._nodes[name]) for name in self.replicas_for(key)]
        if all(r is _MISSING for r in removed):
            raise NoReplicaAvailable(
                f"delete({key!r}): none of its replicas {self.replicas_for(key)} is reachable"
            )
        return any(r is not _MISSING and r > 0 for r in removed)

    def statistics(self) -> dict[str, NodeStatistics]:
        with self._lock:
            return {
                name: NodeStatistics(n.hits, n.misses, n.errors, n.failovers, n.epoch, n.down)
                for name, n in self._nodes.items()
            }


class _Placeholder:
    """Stands in the local cache for a read in flight; only its own reply may replace it."""

    __slots__ = ()


class NearCache:
    """A local cache in front of a ``ShardedCache``, kept coherent by invalidation messages.

    ``remote`` must publish its writes (built with ``channel=``); ``local`` is an empty
    stage-1 cache (an ``LRUCache``, or a ``TTLCache`` to bound how long an entry can be
    served if a channel fails silently). :meth:`start` runs one listener thread per node;
    :meth:`invalidate`, :meth:`channel_lost` and :meth:`channel_ready` are what the
    listeners call, and a test may call them itself to deliver messages in any order.
    Values are shared with every caller that gets them: treat them as immutable.
    """

    def __init__(
        self, remote: ShardedCache, local: Any, *, reconnect_ns: int = 50 * NS_PER_MS
    ) -> None:
        if remote.channel is None:
            raise ValueError("remote must publish its writes: build it with channel=...")
        if len(local):
            raise ValueError(f"local must be an empty cache, it holds {len(local)} entries")
        if isinstance(reconnect_ns, bool) or not isinstance(reconnect_ns, int) or reconnect_ns < 0:
            raise ValueError(f"reconnect_ns must be an int >= 0, got {reconnect_ns!r}")
        self._remote = remote
        self._channel: str = remote.channel
        self._local = local
        self._reconnect_s = reconnect_ns / NS_PER_S
        self._lock = threading.Lock()  # the local cache and the counters; never held over I/O
        self._subscribed: set[str] = set()
        self._hits = self._misses = self._invalidations = self._flushes = self._discarded = 0
        self._stopping = threading.Event()
        self._listeners: list[threading.Thread] = []
        self._started = False

    @property
    def remote(self) -> ShardedCache:
        return self._remote

    @property
    def subscribed(self) -> frozenset[str]:
        """The nodes whose invalidation channel is subscribed now."""
        with self._lock:
            return frozenset(self._subscribed)

    # -- the cache -------------------------------------------------------------------
    def get(self, key: str, default: Any = None) -> Any:
        with self._lock:
            found = self._local.get(key, _MISSING)
            if found is not _MISSING and not isinstance(found, _Placeholder):
                self._hits += 1
                return found
            replicas = self._remote.replicas_for(key)  # a key it refuses goes nowhere: no miss
            self._misses += 1
            mine = None
            if self._subscribed.issuperset(replicas):
                mine = _Placeholder()  # rule 1: claim the slot before asking Redis
                self._local.put(key, mine, weight=0)  # a user's weigh never sees it
        value: Any = _MISSING
        try:
            value = self._remote.get(key, _MISSING)
        finally:  # on an error too: the placeholder must not stay behind
            if mine is not None:
                self._land(key, mine, value)
        return default if value is _MISSING else value

    def _land(self, key: str, mine: _Placeholder, value: Any) -> None:
        """Store a read's reply if its placeholder is still there (rule 1), else drop it."""
        with self._lock:
            if self._local.get(key, None) is not mine:
                self._discarded += 1  # overtaken: what we read may already be stale
            elif value is _MISSING:
                self._local.delete(key)
            else:
                try:
                    self._local.put(key, value)
                except ValueError:  # heavier than the local max_weight: still the answer
                    self._local.delete(key)

    def put(self, key: str, value: Any) -> None:
        try:
            self._remote.put(key, value)
        finally:  # rule 2; also after a failure, which may have reached some replica
            self._forget(key)

    def delete(self, key: str) -> bool:
        try:
            return self._remote.delete(key)
        finally:
            self._forget(key)

    def _forget(self, key: str) -> None:
        with self._lock:
            self._local.delete(key)

    def statistics(self) -> NearStatistics:
        with self._lock:
            return NearStatistics(
                self._hits, self._misses, self._invalidations, self._flushes, self._discarded
            )

    # -- what the channel tells us ---------------------------------------------------
    def invalidate(self, key: str) -> None:
        """A write to ``key`` happened somewhere: drop it (or the read in flight)."""
        with self._lock:
            self._invalidations += 1
            self._local.delete(key)

    def channel_lost(self, node: str) -> None:
        """``node``'s channel dropped: messages may be lost, so forget everything (rule 3)."""
        with self._lock:
            self._subscribed.discard(node)
            self._flushes += 1
            self._local.clear()

    def channel_ready(self, node: str) -> None:
        """``node``'s channel is subscribed: its keys may be cached again."""
        with self._lock:
            self._subscribed.add(node)

    # -- the listeners ---------------------------------------------------------------
    def start(self) -> NearCache:
        with self._lock:  # claimed before any thread exists: two racing starts, one wins
            if self._started:
                raise RuntimeError("this near cache is already started")
            self._started = True
        for name, client in self._remote.clients.items():
            thread = threading.Thread(
                target=self._listen, args=(name, client), name=f"near-{name}", daemon=True
            )
            thread.start()
            self._listeners.append(thread)
        return self

    def close(self, timeout_s: float = 5.0) -> None:
        self._stopping.set()
        for thread in self._listeners:
            thread.join(timeout_s)

    def __enter__(self) -> NearCache:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _listen(self, node: str, client: redis.Redis) -> None:
        while not self._stopping.is_set():
            # redis-py types pubsub() from 8.2 on; before, the call is untyped
            pubsub = client.pubsub()  # type: ignore[no-untyped-call, unused-ignore]
            ready = False
            try:
                pubsub.subscribe(self._channel)
                while not self._stopping.is_set():
                    message = pubsub.get_message(timeout=0.05)
                    if message is None:
                        continue
                    if message["type"] == "subscribe":
                        ready = True
                        self.channel_ready(node)
                    elif message["type"] == "message":
                        data = message["data"]
                        self.invalidate(data.decode() if isinstance(data, bytes) else data)
            except DISCONNECTED:
                pass
            except Exception:  # a bug must not end the listener silently: log, resubscribe
                _log.exception("near-cache listener of node %r failed", node)
            finally:
                if ready:
                    self.channel_lost(node)
                with contextlib.suppress(*DISCONNECTED):
                    pubsub.close()
            self._stopping.wait(self._reconnect_s)


__all__ = ["HashRing", "NearCache", "NoReplicaAvailable", "ShardedCache"]
