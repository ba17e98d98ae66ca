"""A real Redis Cluster on loopback: several ``redis-server --cluster-enabled yes``
processes joined with ``redis-cli --cluster create``, for the stage-3 tests that move
slots and kill masters while work runs.

Each node is a :class:`~katas._harness.redis.ProcessNode` (a private server without
persistence, its own folder holding its ``nodes.conf``, killed with the test). A
:class:`LocalCluster` knows which master owns each slot and can:

- move a slot to another master as ``redis-cli --cluster reshard`` does, one step at a
  time so a test runs work between them: :meth:`LocalCluster.begin_migration` (the target
  ``IMPORTING``, the owner ``MIGRATING``: a key already moved answers ``ASK``, a
  multi-key command whose keys are split answers ``TRYAGAIN``),
  :meth:`LocalCluster.move_keys` (``MIGRATE`` a batch of the slot's keys) and
  :meth:`LocalCluster.finish_migration` (``SETSLOT … NODE`` everywhere: ``MOVED``);
- kill a master and start it again (:meth:`LocalCluster.kill`, :meth:`LocalCluster.revive`):
  without replicas the cluster goes to ``fail`` and every node answers ``CLUSTERDOWN``
  until the master is back — with an empty dataset, as a restarted server without
  persistence has.

Clients (:meth:`LocalCluster.client`) are redis-py's ``RedisCluster``, with the harness's
socket timeout and no retries, so a fault shows up as one exception.

A suite runs on a cluster with ``KATA_REDIS_CLUSTER=redis-server``: then ``redis_env``
serves each test from one cluster shared by the session (:func:`shared_cluster`), through
a :class:`ClusterNode` — the same surface as a single server's node, its clients cluster
clients, its proxy a :class:`ClusterProxy` (one fault proxy per master, every fault on
all of them, the client's view of the cluster remapped to the proxies).
"""

from __future__ import annotations

import atexit
import contextlib
import queue
import shutil
import subprocess
import threading
import time
from concurrent.futures import Future
from typing import Any

import redis
import redis.asyncio.cluster
from redis.cluster import RedisCluster
from redis.crc import key_slot

from katas._harness.faultproxy import FaultProxy, ProxyCounts
from katas._harness.redis import (
    START_DEADLINE_S,
    ProcessNode,
    SharedNode,
    _async_kwargs,
    _glob_escape,
    client_kwargs,
)

#: Slots in a Redis Cluster.
SLOTS = 16384
#: How long a node waits before it calls an unreachable master failing (ms); short, so
#: a test that kills a master sees the cluster fail within about a second.
NODE_TIMEOUT_MS = 1000
#: Real seconds the cluster may take to agree on a state a test waits for.
STATE_DEADLINE_S = 15.0


class ClusterError(RuntimeError):
    """The cluster could not be started or did not reach the state a test waited for."""


class LocalCluster:
    """``masters`` private ``redis-server`` processes in one cluster, slots split evenly."""

    def __init__(
        self, masters: int = 3, command: list[str] | None = None, *, full_coverage: bool = True
    ) -> None:
        """``full_coverage=False``: a dead master takes down only its own slots, the others
        keep serving (``cluster-require-full-coverage no``); by default the whole cluster
        answers ``CLUSTERDOWN`` until it is back, as Redis does."""
        if masters < 3:
            raise ValueError(f"masters must be at least 3 (redis-cli's minimum), got {masters}")
        self.nodes: list[ProcessNode] = _READY.take(masters, tuple(command or ["redis-server"]))
        if full_coverage:
            return
        try:
            for node in self.nodes:
                _call(node, "CONFIG", "SET", "cluster-require-full-coverage", "no")
                node._command = [*node._command, "--cluster-require-full-coverage", "no"]
        except BaseException:
            self.close()
            raise

    # --- what the cluster looks like --------------------------------------------------------

    def addresses(self) -> list[str]:
        return [f"127.0.0.1:{node.port}" for node in self.nodes]

    def node_id(self, node: ProcessNode) -> str:
        found = _call(node, "CLUSTER", "MYID")
        return found.decode() if isinstance(found, bytes) else str(found)

    def owner(self, slot: int) -> ProcessNode:
        """The master that serves ``slot`` now (as a live master sees the slot map)."""
        for node in self._live():
            for start, end, master, *_ in _call(node, "CLUSTER", "SLOTS"):
                if start <= slot <= end:
                    return self._by_port(int(master[1]))
            break
        raise ClusterError(f"no master serves slot {slot}")

    def owner_of(self, key: str) -> ProcessNode:
        return self.owner(key_slot(key.encode()))

    def keys(self, prefix: str) -> list[str]:
        """Every key starting with ``prefix``, on every live master, as text, sorted."""
        names: list[str] = []
        for node in self._live():
            for key in node._admin().scan_iter(match=_glob_escape(prefix) + "*", count=1000):
                names.append(key.decode() if isinstance(key, bytes) else str(key))
        return sorted(names)

    def other_master(self, node: ProcessNode) -> ProcessNode:
        """A master other than ``node``: where a test moves ``node``'s slot."""
        return next(n for n in self.nodes if n is not node)

    def state(self, node: ProcessNode | None = None) -> str:
        """``ok`` or ``fail``, as ``node`` (default: the first live one) reports it."""
        return _state(node or self._live()[0])

    def wait_state(self, state: str) -> None:
        """Wait (real time) until every live node reports ``state``."""
        _wait_state(self._live(), state)

    # --- clients ----------------------------------------------------------------------------

    def client(self, **overrides: Any) -> RedisCluster:
        """A cluster client with the harness's socket timeout and no retries."""
        options = client_kwargs(**overrides)
        host, port = self.addresses()[0].split(":")
        return RedisCluster(host=host, port=int(port), **options)

    # --- moving a slot ----------------------------------------------------------------------

    def begin_migration(self, slot: int, target: ProcessNode) -> None:
        """The target imports ``slot``, its owner migrates it: from now on a key the owner
        no longer holds is answered with ``ASK``."""
        source = self.owner(slot)
        if source is target:
            raise ValueError(f"slot {slot} is already served by port {target.port}")
        _call(target, "CLUSTER", "SETSLOT", slot, "IMPORTING", self.node_id(source))
        _call(source, "CLUSTER", "SETSLOT", slot, "MIGRATING", self.node_id(target))

    def move_keys(self, slot: int, target: ProcessNode, count: int | None = None) -> int:
        """``MIGRATE`` up to ``count`` (default: all) of ``slot``'s keys from its owner to
        ``target``; how many moved."""
        source = self.owner(slot)
        moved = 0
        while count is None or moved < count:
            batch = 100 if count is None else min(100, count - moved)
            keys = _call(source, "CLUSTER", "GETKEYSINSLOT", slot, batch)
            if not keys:
                break
            _call(source, "MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", *keys)
            moved += len(keys)
        return moved

    def finish_migration(self, slot: int, target: ProcessNode) -> None:
        """Every master now says ``target`` serves ``slot`` (``MOVED`` from the others)."""
        target_id = self.node_id(target)
        for node in [target, *(n for n in self._live() if n is not target)]:
            _call(node, "CLUSTER", "SETSLOT", slot, "NODE", target_id)

    def migrate(self, slot: int, target: ProcessNode) -> None:
        """Move ``slot`` and all its keys to ``target`` at once."""
        self.begin_migration(slot, target)
        self.move_keys(slot, target)
        self.finish_migration(slot, target)

    # --- faults -----------------------------------------------------------------------------

    def kill(self, node: ProcessNode) -> None:
        """SIGKILL ``node``; the others call it failing after :data:`NODE_TIMEOUT_MS`."""
        node.stop()

    def revive(self, node: ProcessNode) -> None:
        """Start ``node`` again (same port, same ``nodes.conf``: same id and slots, no
        data) and wait until the cluster is ``ok``."""
        node.start()
        self.wait_state("ok")

    # --- the end ----------------------------------------------------------------------------

    def close(self) -> None:
        for node in self.nodes:
            node.close()
        self.nodes = []

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _live(self) -> list[ProcessNode]:
        live = [n for n in self.nodes if n._proc is not None]
        if not live:
            raise ClusterError("every node is stopped")
        return live

    def _by_port(self, port: int) -> ProcessNode:
        for node in self.nodes:
            if node.port == port:
                return node
        raise ClusterError(f"no node of this cluster listens on port {port}")


class ClusterProxy:
    """A :class:`FaultProxy` in front of each master, driven as one: a fault, a latency or
    a count covers the whole cluster as a client sees it."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.by_address: dict[tuple[str, int], FaultProxy] = {}
        for node in cluster.nodes:
            self.by_address[("127.0.0.1", node.port)] = FaultProxy(("127.0.0.1", node.port))

    def remap(self, address: tuple[str, int]) -> tuple[str, int]:
        """Where a client reaches the node the cluster announces at ``address``."""
        proxy = self.by_address.get(address)
        return proxy.address if proxy is not None else address

    @property
    def _proxies(self) -> list[FaultProxy]:
        return list(self.by_address.values())

    @property
    def address(self) -> tuple[str, int]:
        return self._proxies[0].address

    @property
    def host(self) -> str:
        return self.address[0]

    @property
    def port(self) -> int:
        return self.address[1]

    def outage(self) -> None:
        for p in self._proxies:
            p.outage()

    def blackhole(self) -> None:
        for p in self._proxies:
            p.blackhole()

    def drop_replies(self) -> None:
        for p in self._proxies:
            p.drop_replies()

    def busy(self) -> None:
        for p in self._proxies:
            p.busy()

    def refuse(self, code: str) -> None:
        for p in self._proxies:
            p.refuse(code)

    def heal(self) -> None:
        for p in self._proxies:
            p.heal()

    def truncate_next_reply(self, nbytes: int) -> None:
        for p in self._proxies:
            p.truncate_next_reply(nbytes)

    def set_latency_ns(self, ns: int) -> None:
        for p in self._proxies:
            p.set_latency_ns(ns)

    def drop_connections(self) -> None:
        for p in self._proxies:
            p.drop_connections()

    def counts(self) -> ProxyCounts:
        counts = [p.counts() for p in self._proxies]
        return ProxyCounts(
            sum(c.round_trips for c in counts),
            tuple(command for c in counts for command in c.commands),
            sum(c.connections for c in counts),
            sum(c.refused for c in counts),
        )

    def reset_counts(self) -> None:
        for p in self._proxies:
            p.reset_counts()

    def close(self) -> None:
        for p in self._proxies:
            p.close()


class ClusterNode(SharedNode):
    """The session's shared cluster as a test's Redis."""

    kind = "cluster"

    def __init__(self, cluster: LocalCluster) -> None:
        super().__init__()
        self.cluster = cluster

    def address(self) -> tuple[str, int]:
        host, port = self.cluster.addresses()[0].split(":")
        return host, int(port)

    def _new_client(self, **kwargs: Any) -> RedisCluster:  # type: ignore[override]
        host, port = self.address()
        return RedisCluster(host=host, port=port, **kwargs)

    def _new_async_client(self, **kwargs: Any) -> redis.asyncio.cluster.RedisCluster:  # type: ignore[override]
        host, port = self.address()
        return redis.asyncio.cluster.RedisCluster(host=host, port=port, **kwargs)

    def tcp_client(self, **kwargs: Any) -> RedisCluster:  # type: ignore[override]
        return self.client(**kwargs)  # type: ignore[return-value]

    def proxy(self) -> ClusterProxy:  # type: ignore[override]
        p = ClusterProxy(self.cluster)
        self._proxies.append(p)  # type: ignore[arg-type]
        return p

    def proxied_client(  # type: ignore[override]
        self, proxy: FaultProxy | ClusterProxy, **kwargs: Any
    ) -> RedisCluster:
        if not isinstance(proxy, ClusterProxy):
            raise TypeError(f"a cluster is reached through a ClusterProxy, got {proxy!r}")
        c = RedisCluster(
            host=proxy.host, port=proxy.port, address_remap=proxy.remap, **client_kwargs(**kwargs)
        )
        self._clients.append(c)  # type: ignore[arg-type]
        return c

    def proxied_async_client(  # type: ignore[override]
        self, proxy: FaultProxy | ClusterProxy, **kwargs: Any
    ) -> redis.asyncio.cluster.RedisCluster:
        if not isinstance(proxy, ClusterProxy):
            raise TypeError(f"a cluster is reached through a ClusterProxy, got {proxy!r}")
        return redis.asyncio.cluster.RedisCluster(
            host=proxy.host, port=proxy.port, address_remap=proxy.remap, **_async_kwargs(**kwargs)
        )

    def time_us(self) -> int:
        seconds, micros = _call(self.cluster.nodes[0], "TIME")
        return int(seconds) * 1_000_000 + int(micros)

    def _admin(self) -> RedisCluster:  # type: ignore[override]
        if not isinstance(self._admin_client, RedisCluster):
            self._admin_client = self._new_client(**client_kwargs())
        return self._admin_client

    def delete_prefix(self, prefix: str) -> None:
        """Delete every key starting with ``prefix``, on every master."""
        for node in self.cluster.nodes:
            admin = node._admin()
            for key in admin.scan_iter(match=_glob_escape(prefix) + "*", count=500):
                admin.delete(key)


def _build(masters: int, command: tuple[str, ...]) -> list[ProcessNode]:
    """``masters`` new nodes joined in one cluster, every slot served: state ``ok``."""
    cli = shutil.which("redis-cli")
    if cli is None:
        raise ClusterError("redis-cli is not installed: it creates the cluster")
    nodes: list[ProcessNode] = []
    try:
        cluster = ["--cluster-enabled", "yes", "--cluster-node-timeout", str(NODE_TIMEOUT_MS)]
        for _ in range(masters):
            nodes.append(ProcessNode([*command, *cluster], cluster_bus=True))
        addresses = [f"127.0.0.1:{node.port}" for node in nodes]
        created = subprocess.run(
            [cli, "--cluster", "create", *addresses, "--cluster-yes"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        if created.returncode != 0:
            raise ClusterError(f"redis-cli --cluster create failed: {created.stdout[-800:]}")
        _wait_state(nodes, "ok")
    except BaseException:
        for node in nodes:
            node.close()
        raise
    return nodes


#: What a cluster is built from: its masters' count and their command.
_Key = tuple[int, tuple[str, ...]]


class _Ready:
    """Clusters built ahead of the tests that take them.

    A new master turns ``ok`` no sooner than two seconds after it started (Redis's
    ``CLUSTER_WRITABLE_DELAY``: a rebooted master gives the cluster time to reconfigure
    it), which made every test with a cluster of its own wait two seconds. So from the
    second cluster a run takes on, more are started behind it: as many wait ready as
    were taken before, up to :data:`AHEAD`. A run that needs one cluster builds no spare;
    one that needs a dozen finds most of them ready. The builders are daemon threads that
    live as long as the process (a node dies with the thread that started it).
    :func:`close_spares` ends the spares nobody took when the session ends (a run forked
    from the warm process ends with ``os._exit``: no atexit handler would).
    """

    AHEAD = 3

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[tuple[_Key, Future[list[ProcessNode]]]] = queue.SimpleQueue()
        self._builders = 0
        self._ahead: dict[_Key, list[Future[list[ProcessNode]]]] = {}
        self._taken: dict[_Key, int] = {}

    def take(self, masters: int, command: tuple[str, ...]) -> list[ProcessNode]:
        key = (masters, command)
        with self._lock:
            ahead = self._ahead.setdefault(key, [])
            self._taken[key] = taken = self._taken.get(key, 0) + 1
            ready = ahead.pop(0) if ahead else None
            while len(ahead) < min(taken - 1, self.AHEAD):
                future: Future[list[ProcessNode]] = Future()
                self._jobs.put((key, future))
                ahead.append(future)
                if self._builders < self.AHEAD:
                    self._builders += 1
                    threading.Thread(target=self._builder, name="cluster", daemon=True).start()
        return _build(*key) if ready is None else ready.result()

    def close(self) -> None:
        """Close every spare: those still being built are waited for (their build is
        bounded by the nodes' start and state deadlines, about two seconds as a rule)."""
        with self._lock:
            spares = [future for ahead in self._ahead.values() for future in ahead]
            self._ahead.clear()
            self._taken.clear()
        for future in spares:
            if future.cancel():
                continue
            with contextlib.suppress(BaseException):  # a failed build left no node
                for node in future.result():
                    node.close()

    def _builder(self) -> None:
        """A builder thread: builds the clusters asked for, one at a time, for ever."""
        while True:
            key, future = self._jobs.get()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(_build(*key))
                except BaseException as exc:  # the test that takes it raises it
                    future.set_exception(exc)


_READY = _Ready()


def close_spares() -> None:
    """End the clusters built ahead that no test took (the session is over)."""
    _READY.close()


def close_session() -> None:
    """End what the session started and no test ends: the spares no test took and the
    shared cluster. A run forked from the warm process ends with ``os._exit``, so no
    atexit handler does it there (and the nodes, killed with their parent, would leave
    their folders behind)."""
    global _SHARED
    close_spares()
    if _SHARED is not None:
        _SHARED.close()
        _SHARED = None


def _wait_state(nodes: list[ProcessNode], state: str) -> None:
    """Wait (real time) until every live node of ``nodes`` reports ``state``."""
    deadline = time.monotonic() + STATE_DEADLINE_S
    while True:
        try:
            if all(_state(node) == state for node in nodes if node._proc is not None):
                return
        except redis.RedisError:
            pass
        if time.monotonic() > deadline:
            raise ClusterError(f"the cluster did not reach state {state!r} in time")
        time.sleep(0.02)


def _state(node: ProcessNode) -> str:
    """``ok`` or ``fail``, as ``node`` reports it."""
    info = _call(node, "CLUSTER", "INFO")
    text = info.decode() if isinstance(info, bytes) else str(info)
    for line in text.splitlines():
        if line.startswith("cluster_state:"):
            return line.split(":", 1)[1].strip()
    raise ClusterError(f"CLUSTER INFO without cluster_state: {text[:200]}")


_SHARED: LocalCluster | None = None


def shared_cluster(command: list[str]) -> LocalCluster:
    """The session's cluster, started on first use and stopped when the session ends
    (:func:`close_session`) or, outside pytest, at interpreter exit."""
    global _SHARED
    if _SHARED is None or not _SHARED.nodes:
        _SHARED = LocalCluster(command=command)
        atexit.register(_SHARED.close)
    return _SHARED


def _call(node: ProcessNode, *command: Any) -> Any:
    """``command`` on ``node``'s own administration client (kept open by the node)."""
    return node._admin().execute_command(*command)  # type: ignore[no-untyped-call]


__all__ = [
    "NODE_TIMEOUT_MS",
    "SLOTS",
    "START_DEADLINE_S",
    "ClusterError",
    "ClusterNode",
    "ClusterProxy",
    "LocalCluster",
    "close_session",
    "close_spares",
    "shared_cluster",
]
