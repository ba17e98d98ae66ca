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
  the node's epoch, so its old key names are never read again (they linger until
  their TTL, or until Redis's eviction policy reclaims them) and the next replica
  answers until new writes reach it.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import redis

from katas.kv_cache.api import (
    NS_PER_MS,
    NS_PER_S,
    Clock,
    MonotonicClock,
    NodeStatistics,
    NoReplicaAvailable,
)

T = TypeVar("T")

#: What makes a node "down": it did not answer (refused, reset, or timed out).
UNAVAILABLE = (redis.ConnectionError, redis.TimeoutError)

_MISSING: Any = object()


def _point(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class HashRing:
    """A consistent-hash ring with ``vnodes`` virtual nodes per node (stable across processes)."""

    def __init__(self, nodes: Iterable[str], *, vnodes: int = 160) -> None:
        if isinstance(vnodes, bool) or not isinstance(vnodes, int) or vnodes < 1:
            raise ValueError(f"vnodes must be an int >= 1, got {vnodes!r}")
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
        if not isinstance(node, str) or not node:
            raise ValueError(f"a node name must be a non-empty str, got {node!r}")
        if node in self._nodes:
            raise ValueError(f"node {node!r} is already on the ring")
        self._nodes.add(node)
        self._ring.extend((_point(f"{node}#{i}"), node) for i in range(self._vnodes))
        self._ring.sort()

    def remove(self, node: str) -> None:
        if node not in self._nodes:
            raise ValueError(f"node {node!r} is not on the ring")
        self._nodes.remove(node)
        self._ring = [entry for entry in self._ring if entry[1] != node]

    def nodes_for(self, key: str, n: int) -> list[str]:
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
    epoch: int = 0
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
    ) -> None:
        if not nodes:
            raise ValueError("nodes must name at least one Redis node")
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
            raise ValueError(f"replicas must be an int >= 1, got {replicas!r}")
        if replicas > len(nodes):
            raise ValueError(f"replicas={replicas} exceeds the {len(nodes)} nodes given")
        if ttl_ns is not None and (
            isinstance(ttl_ns, bool) or not isinstance(ttl_ns, int) or ttl_ns <= 0
        ):
            raise ValueError(f"ttl_ns must be a positive int or None, got {ttl_ns!r}")
        if (
            isinstance(probe_interval_ns, bool)
            or not isinstance(probe_interval_ns, int)
            or probe_interval_ns < 0
        ):
            raise ValueError(f"probe_interval_ns must be an int >= 0, got {probe_interval_ns!r}")
        self._ring = HashRing(nodes, vnodes=vnodes)
        self._nodes = {name: _Node(name, client) for name, client in nodes.items()}
        self._replicas = replicas
        self._prefix = key_prefix
        self._px = None if ttl_ns is None else -(-ttl_ns // NS_PER_MS)  # whole ms, rounded up
        self._probe_ns = probe_interval_ns
        self._clock: Clock = clock if clock is not None else MonotonicClock()
        self._lock = threading.Lock()  # node state and counters only; never held over I/O

    @property
    def ring(self) -> HashRing:
        return self._ring

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
        except UNAVAILABLE:
            with self._lock:
                node.errors += 1
                node.down = True
                node.retry_at_ns = self._clock.now_ns() + self._probe_ns
            return _MISSING
        with self._lock:
            if node.down and node.epoch + 1 == epoch:  # back: its old copies are retired
                node.epoch, node.down = epoch, False
        return result

    # -- the cache -------------------------------------------------------------------
    def get(self, key: str, default: Any = None) -> Any:
        for name in self.replicas_for(key):
            node = self._nodes[name]
            raw = self._call(node, key, lambda c, k: c.get(k))
            if raw is _MISSING:
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
        data = json.dumps(value)  # a value JSON cannot encode fails before any write
        px = self._px
        written = [
            self._call(self._nodes[name], key, lambda c, k: c.set(k, data, px=px))
            for name in self.replicas_for(key)
        ]
        if all(w is _MISSING for w in written):
            raise NoReplicaAvailable(
                f"put({key!r}): none of its replicas {self.replicas_for(key)} is reachable"
            )

    def delete(self, key: str) -> bool:
        removed = [
            self._call(self._nodes[name], key, lambda c, k: c.delete(k))
            for name in self.replicas_for(key)
        ]
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


__all__ = ["HashRing", "NoReplicaAvailable", "ShardedCache"]
