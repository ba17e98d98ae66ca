"""Stage 3 — a cache sharded over Redis nodes, with replicas and failover.

Core: :class:`HashRing` (consistent hashing with virtual nodes) and
:class:`ShardedCache` (R replicas per key, reads failing over, epochs on rejoin). The
prompt is katas/kv_cache/README.md; the suite runs on fakeredis by default and on
private ``redis-server`` processes with ``KATA_REDIS_SERVER=redis-server``.

Rules the suite checks:

- **A stable hash.** Every process must place every key on the same nodes: hash with
  ``hashlib`` (e.g. ``blake2b``), never Python's ``hash()``, which is salted per process.
- **Virtual nodes.** Each node owns ``vnodes`` points on the ring. With 160 vnodes no
  node holds more than 1.25× the mean share; adding an (n+1)-th node moves between
  0.8× and 1.2× of a 1/(n+1) share of the keys, *all onto the new node*; removing a
  node moves only the keys it held. Placement does not depend on the order in which
  nodes were added.
- **Preference lists.** ``nodes_for(key, n)`` is the ``n`` distinct nodes met walking
  clockwise from the key's point (all of them if the ring has fewer);
  ``nodes_for(key, m)`` is a prefix of ``nodes_for(key, n)`` for m < n, and
  ``node_for(key) == nodes_for(key, 1)[0]``.
- **Replicas.** ``ShardedCache`` keeps a key on the first ``replicas`` nodes of its
  preference list, under the Redis key ``f"{key_prefix}{epoch}:{key}"`` (every node's
  epoch starts at 0), its value as JSON. ``put`` writes every replica it can reach;
  ``get`` asks them in preference order and the first hit wins.
- **Failover.** A node that raises ``redis.ConnectionError`` or ``redis.TimeoutError``
  is marked down and skipped for ``probe_interval_ns`` (by ``clock``), then tried
  again. ``get`` never raises for a down node: it moves on, and returns ``default`` if
  no replica has the key. ``put`` and ``delete`` raise ``NoReplicaAvailable`` only when
  none of the key's replicas could be reached.
- **Epochs.** A node that comes back after being marked down must never serve a value
  it missed while down: the first successful call to it bumps its epoch by one, so its
  old key names are never read again.

Extended — :class:`NearCache`, a local stage-1 cache in front of a ``ShardedCache``:

- **Writes publish.** A ``ShardedCache`` built with ``channel=`` runs, on each replica,
  ONE script that does the SET (or DEL) and ``PUBLISH channel key`` together; no other
  command on that node.
- **Reads are local when they can be.** A hit in the local cache touches no Redis.
- **Placeholders.** A miss stores a placeholder for the key before it reads Redis (a
  plain GET) and stores the reply only if its placeholder is still there: an
  invalidation or a flush that overtakes the reply wins, the reply is discarded. A
  placeholder goes in with ``put(key, placeholder, weight=0)``: a weighted local
  cache's ``weigh`` sees values only; a value too heavy for it is returned, not kept.
- **Read-your-writes.** After ``put``/``delete`` returns, this client's ``get`` sees
  that write (or a newer one) — without waiting for any message.
- **Flush on a dropped channel.** When a node's channel drops, the whole local cache
  is flushed (placeholders too), and a key is cached only while the channels of all
  its replicas are subscribed.
- :meth:`NearCache.start` runs one listener thread per node; the listeners call
  :meth:`NearCache.invalidate`, :meth:`NearCache.channel_ready` and
  :meth:`NearCache.channel_lost`, which the suite also calls itself to deliver
  messages in adversarial orders (a near cache that is not started caches nothing
  until ``channel_ready`` has been called for a key's replicas).
"""

from __future__ import annotations

# TODO(stage3): implement every class and method below; delete each
# `raise Todo()` as you go.
from collections.abc import Iterable, Mapping
from typing import Any

import redis

from katas._runtime.todo import Todo
from katas.kv_cache.api import (
    NS_PER_MS,
    NS_PER_S,
    Clock,
    NearStatistics,
    NodeStatistics,
    NoReplicaAvailable,
)


class HashRing:
    """A consistent-hash ring with ``vnodes`` virtual nodes per node (stable across processes).

    ``vnodes < 1``, a duplicate node (here or in :meth:`add`) or an empty or non-str
    node name raise ``ValueError`` naming it.
    """

    def __init__(self, nodes: Iterable[str], *, vnodes: int = 160) -> None:
        raise Todo()

    @property
    def vnodes(self) -> int:
        raise Todo()

    @property
    def nodes(self) -> list[str]:
        """The nodes on the ring, sorted by name."""
        raise Todo()

    def __len__(self) -> int:
        raise Todo()

    def __contains__(self, node: object) -> bool:
        raise Todo()

    def add(self, node: str) -> None:
        """Put ``node``'s ``vnodes`` points on the ring (``ValueError`` if it is there)."""
        raise Todo()

    def remove(self, node: str) -> None:
        """Take ``node``'s points off the ring (``ValueError`` if it is not there)."""
        raise Todo()

    def nodes_for(self, key: str, n: int) -> list[str]:
        """The ``min(n, len(self))`` distinct nodes clockwise from ``key``'s point.

        ``n < 1`` raises ``ValueError``; an empty ring gives ``[]``.
        """
        raise Todo()

    def node_for(self, key: str) -> str:
        """The first node of ``key``'s preference list (``LookupError`` on an empty ring)."""
        raise Todo()


class ShardedCache:
    """A key-value cache over several Redis nodes: consistent hashing, R replicas, failover.

    ``nodes`` maps node names (the ring's nodes) to their clients. Bad input raises
    ``ValueError``: no nodes, ``replicas < 1`` or more than the nodes given, a
    non-positive ``ttl_ns`` (``None``: no expiry; else rounded up to whole
    milliseconds), a negative ``probe_interval_ns``, an empty ``channel``. ``clock``
    (default: monotonic) paces only the probing of nodes marked down. With ``channel``
    (extended), every write also publishes its key there, in the same script.

    Document here the limits of a per-client epoch: what can another client, or a new
    process, still read from a node that rejoined?
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
        raise Todo()

    @property
    def ring(self) -> HashRing:
        """The ring this cache places keys with."""
        raise Todo()

    @property
    def channel(self) -> str | None:
        """The channel every write publishes its key on (None: writes do not publish)."""
        raise Todo()

    @property
    def clients(self) -> dict[str, redis.Redis]:
        """Each node's client, by node name."""
        raise Todo()

    def replicas_for(self, key: str) -> list[str]:
        """The nodes that hold ``key``, in preference order."""
        raise Todo()

    def key_name(self, node: str, key: str) -> str:
        """The Redis key under which ``node`` holds ``key`` now: ``f"{prefix}{epoch}:{key}"``."""
        raise Todo()

    def get(self, key: str, default: Any = None) -> Any:
        """The first hit among ``key``'s live replicas, in preference order, or ``default``."""
        raise Todo()

    def put(self, key: str, value: Any) -> None:
        """Write ``value`` (JSON) to every reachable replica (``NoReplicaAvailable``: none)."""
        raise Todo()

    def delete(self, key: str) -> bool:
        """Remove ``key`` from every reachable replica; True if one of them held it."""
        raise Todo()

    def statistics(self) -> dict[str, NodeStatistics]:
        """Per node: hits, misses, errors, failovers, epoch, and whether it is marked down."""
        raise Todo()


class NearCache:
    """A local cache in front of a ``ShardedCache``, kept coherent by invalidation messages.

    ``remote`` must publish its writes (built with ``channel=``, else ``ValueError``);
    ``local`` is an empty stage-1 cache (``ValueError`` if it holds entries) — an
    ``LRUCache``, or a ``TTLCache`` to bound how long an entry can be served if a
    channel dies silently. ``reconnect_ns`` (>= 0, else ``ValueError``) is the pause
    before a listener subscribes again after its channel dropped.
    """

    def __init__(
        self, remote: ShardedCache, local: Any, *, reconnect_ns: int = 50 * NS_PER_MS
    ) -> None:
        raise Todo()

    @property
    def remote(self) -> ShardedCache:
        raise Todo()

    @property
    def subscribed(self) -> frozenset[str]:
        """The nodes whose invalidation channel is subscribed now."""
        raise Todo()

    def get(self, key: str, default: Any = None) -> Any:
        """A local hit, or the remote value (cached if no invalidation overtook it)."""
        raise Todo()

    def put(self, key: str, value: Any) -> None:
        """Write through to the remote cache; this client's next get sees it."""
        raise Todo()

    def delete(self, key: str) -> bool:
        """Delete through to the remote cache; True if a replica held it."""
        raise Todo()

    def statistics(self) -> NearStatistics:
        """Hits, misses, invalidations applied, flushes, replies discarded."""
        raise Todo()

    def invalidate(self, key: str) -> None:
        """A write to ``key`` happened somewhere: drop it, or the read in flight."""
        raise Todo()

    def channel_lost(self, node: str) -> None:
        """``node``'s channel dropped: messages may be lost, so flush everything."""
        raise Todo()

    def channel_ready(self, node: str) -> None:
        """``node``'s channel is subscribed: keys on it may be cached again."""
        raise Todo()

    def start(self) -> NearCache:
        """Start one listener thread per node (``RuntimeError`` if already started)."""
        raise Todo()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the listeners (join each with ``timeout_s``)."""
        raise Todo()

    def __enter__(self) -> NearCache:
        raise Todo()

    def __exit__(self, *exc_info: object) -> None:
        raise Todo()


__all__ = ["HashRing", "NearCache", "NoReplicaAvailable", "ShardedCache"]
