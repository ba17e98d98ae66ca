"""Redis for stage-3 suites: one fixture, three modes, and the faults a test injects.

``redis_env`` (a pytest fixture, :mod:`katas._harness.redis_fixture`) hands a test a
:class:`RedisEnv`. What serves it depends on the environment:

1. default — **fakeredis**: a fresh ``FakeServer`` per test, in-process; when a real
   TCP endpoint is needed (a proxy, a worker process) a ``TcpFakeServer`` on a
   loopback port serves the same data.
2. ``KATA_REDIS_SERVER=redis-server`` (a command or path) — **private servers**:
   ``redis-server --save '' --appendonly no --port <free> --bind 127.0.0.1``, one per
   node the test asks for, killed at teardown. They can be stopped, paused, restarted
   (losing everything, as without persistence) and flushed for real.
3. ``KATA_REDIS_URL=redis://…`` — an **external server**: every test gets a fresh key
   prefix, and keys under it are deleted afterwards. It is never flushed, restarted or
   stopped: tests marked ``redis_faults`` skip — unless ``KATA_REDIS_SERVER`` is set
   too, in which case private servers serve those tests (and multi-node tests) and the
   external server the rest.
4. ``KATA_REDIS_CLUSTER=redis-server`` — a **Redis Cluster**: three masters started
   with that command (:mod:`katas._harness.redis_cluster`), shared by the session, every
   client a ``RedisCluster``; each test gets a fresh key prefix, cleaned afterwards. Tests
   that restart, stop or flush a server, or need several independent servers, get
   private single servers started with the same command.

Faults: :meth:`RedisEnv.proxy` puts a :class:`~katas._harness.faultproxy.FaultProxy`
between a client and a node (outage, blackhole, dropped replies, latency, round-trip
counting — it only
affects the test's own connections, so it works in every mode); ``node.restart()``,
``node.stop()``/``start()``, ``node.script_flush()`` act on the server itself.

Time: Redis time is real. In fakeredis mode :meth:`RedisEnv.freeze_time` stops the
server clock at a fixed instant (``time`` patched inside fakeredis, in-process) and
:meth:`RedisEnv.pass_time` moves it, without sleeping; on a real server it
sleeps, which only tests marked ``realtime`` may do (≤ 500 ms a call).

Isolation: keys a test writes should start with ``env.prefix`` (or a
``env.fresh_prefix()`` per hypothesis example). Clients come with a socket timeout and
no automatic retries, so a fault shows up as one exception, not as hidden waiting.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import types
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlparse

import fakeredis
import pytest
import redis
import redis.asyncio
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry

from katas._harness.faultproxy import UNAVAILABLE_REPLIES, FaultProxy
from katas._harness.redis_fixture import ENV_CLUSTER, ENV_SERVER, ENV_URL
from katas._runtime.children import dies_with_parent
from katas._runtime.clock import NS_PER_S

Mode = Literal["fakeredis", "server", "url", "cluster"]

#: Real seconds a private server may take to answer PING before the test fails.
START_DEADLINE_S = 10.0
#: Default client socket timeout (seconds): a hung server fails a test, never hangs it.
DEFAULT_SOCKET_TIMEOUT_S = 5.0
#: Where fakeredis's server clock stands when a test freezes it (2023-11-14T22:13:20Z).
FROZEN_START_NS = 1_700_000_000 * NS_PER_S
#: The longest real wait ``pass_time`` performs on a real server.
MAX_REAL_WAIT_NS = 500_000_000

_FAULTS_REASON = (
    "needs a Redis server the harness may restart, stop or flush; KATA_REDIS_URL points at "
    "an external server it must not touch. Set KATA_REDIS_SERVER=redis-server as well to run "
    "it on a private server."
)


def client_kwargs(**overrides: Any) -> dict[str, Any]:
    """Connection options for test clients: bounded socket waits, no hidden retries."""
    kwargs: dict[str, Any] = {
        "socket_timeout": DEFAULT_SOCKET_TIMEOUT_S,
        "socket_connect_timeout": DEFAULT_SOCKET_TIMEOUT_S,
        "retry": Retry(NoBackoff(), 0),
    }
    kwargs.update(overrides)
    return kwargs


def _async_kwargs(**overrides: Any) -> dict[str, Any]:
    kwargs = client_kwargs(**overrides)
    if isinstance(kwargs.get("retry"), Retry):  # redis.asyncio has its own Retry class
        import redis.asyncio.retry

        kwargs["retry"] = redis.asyncio.retry.Retry(NoBackoff(), 0)
    return kwargs


# --------------------------------------------------------------------------- time


class _FakeTimeModule(types.ModuleType):
    """Stands in for ``time`` inside fakeredis: ``time()`` reads the frozen server clock."""

    def __init__(self, source: _FrozenServerClock) -> None:
        super().__init__("time")
        self._source = source

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)

    def time(self) -> float:
        return self._source.now_ns / NS_PER_S

    def time_ns(self) -> int:
        return self._source.now_ns


class _FrozenServerClock:
    """fakeredis's clock, frozen at install and moved only by :meth:`advance`."""

    def __init__(self) -> None:
        # A fixed instant (whole µs, so TIME reads back exactly what a test set): runs
        # repeat exactly, windows aligned to the epoch included.
        self.now_ns = FROZEN_START_NS
        self._patched: list[tuple[types.ModuleType, Any]] = []
        fake = _FakeTimeModule(self)
        for name, module in list(sys.modules.items()):
            if name.startswith("fakeredis") and getattr(module, "time", None) is time:
                self._patched.append((module, time))
                module.time = fake  # type: ignore[attr-defined]

    def advance(self, ns: int) -> None:
        self.now_ns += ns

    def restore(self) -> None:
        for module, original in self._patched:
            module.time = original  # type: ignore[attr-defined]
        self._patched.clear()


# --------------------------------------------------------------------------- nodes


class RedisNode(ABC):
    """One Redis server a test talks to (fake, private process, or external)."""

    kind: Mode
    #: restart/stop/start/flushall/script_flush act on this server
    can_fault: bool
    #: other tests use it too: a test's keys are deleted by prefix, never flushed
    shared: bool = False

    def __init__(self) -> None:
        self._clients: list[redis.Redis] = []
        self._proxies: list[FaultProxy] = []

    # -- clients ---------------------------------------------------------------------
    def client(self, **kwargs: Any) -> redis.Redis:
        """A new synchronous client (closed at teardown)."""
        c = self._new_client(**client_kwargs(**kwargs))
        self._clients.append(c)
        return c

    def async_client(self, **kwargs: Any) -> redis.asyncio.Redis:
        """A new ``redis.asyncio`` client; ``await client.aclose()`` it in your event loop."""
        return self._new_async_client(**_async_kwargs(**kwargs))

    def tcp_client(self, **kwargs: Any) -> redis.Redis:
        """A client over a real TCP connection (fakeredis: to its TcpFakeServer)."""
        host, port = self.address()
        c = redis.Redis(host=host, port=port, **client_kwargs(**kwargs))
        self._clients.append(c)
        return c

    def proxy(self) -> FaultProxy:
        """A fresh :class:`FaultProxy` in front of this node (closed at teardown)."""
        p = FaultProxy(self.address())
        self._proxies.append(p)
        return p

    def proxied_client(self, proxy: FaultProxy, **kwargs: Any) -> redis.Redis:
        """A client that reaches this node through ``proxy``."""
        c = redis.Redis(host=proxy.host, port=proxy.port, **client_kwargs(**kwargs))
        self._clients.append(c)
        return c

    def proxied_async_client(self, proxy: FaultProxy, **kwargs: Any) -> redis.asyncio.Redis:
        """A ``redis.asyncio`` client through ``proxy``; aclose() it in your event loop."""
        return redis.asyncio.Redis(host=proxy.host, port=proxy.port, **_async_kwargs(**kwargs))

    def time_us(self) -> int:
        """The server's ``TIME`` in integer microseconds."""
        seconds, micros = self._admin().time()
        return int(seconds) * 1_000_000 + int(micros)

    @abstractmethod
    def address(self) -> tuple[str, int]:
        """A loopback (or external) TCP endpoint serving this node."""

    @property
    def url(self) -> str:
        host, port = self.address()
        return f"redis://{host}:{port}/0"

    @abstractmethod
    def _new_client(self, **kwargs: Any) -> redis.Redis: ...

    @abstractmethod
    def _new_async_client(self, **kwargs: Any) -> redis.asyncio.Redis: ...

    @abstractmethod
    def _admin(self) -> redis.Redis: ...

    # -- faults on the server itself -------------------------------------------------
    def flushall(self) -> None:
        """Delete every key on this server."""
        self._require_faults("flushall")
        self._admin().flushall()

    def script_flush(self) -> None:
        """Empty the server's script cache (the next EVALSHA gets NOSCRIPT)."""
        self._require_faults("script_flush")
        self._admin().script_flush()

    @abstractmethod
    def stop(self) -> None:
        """Take the server down (connections fail) until :meth:`start`."""

    @abstractmethod
    def start(self) -> None:
        """Bring a stopped server back on the same address, with whatever it kept."""

    @abstractmethod
    def restart(self) -> None:
        """Crash and start again without persistence: data and scripts are gone."""

    def delete_prefix(self, prefix: str) -> None:
        """Delete every key starting with ``prefix`` (a :attr:`shared` node's cleanup)."""
        raise NotImplementedError(f"{type(self).__name__} is private: it is dropped whole")

    def _require_faults(self, what: str) -> None:
        if not self.can_fault:
            pytest.skip(f"{what}: {_FAULTS_REASON}")

    def close(self) -> None:
        for p in self._proxies:
            p.close()
        for c in self._clients:
            c.close()
        self._proxies.clear()
        self._clients.clear()


#: The commands that run a script. fakeredis does not run them atomically against each
#: other when clients of one server call them from several threads (measured: of eight
#: racing GET-then-SET scripts, two both saw the key missing in ~15% of the races), while
#: Redis runs each script alone — the property every stage-3 script relies on.
_SCRIPT_COMMANDS = frozenset({"EVAL", "EVALSHA", "EVAL_RO", "EVALSHA_RO", "FCALL", "FCALL_RO"})


class _AtomicScripts(fakeredis.FakeRedis):
    """A fakeredis client whose scripts run one at a time per server, as on Redis."""

    def __init__(self, *args: Any, script_lock: threading.RLock, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._script_lock = script_lock

    def execute_command(self, *args: Any, **options: Any) -> Any:
        name = args[0].decode() if isinstance(args[0], bytes) else str(args[0])
        run = super().execute_command  # redis-py's is untyped
        if name.upper() in _SCRIPT_COMMANDS:
            with self._script_lock:
                return run(*args, **options)  # type: ignore[no-untyped-call]
        return run(*args, **options)  # type: ignore[no-untyped-call]


class FakeNode(RedisNode):
    """A fakeredis ``FakeServer``; a ``TcpFakeServer`` shares it when TCP is needed."""

    kind: Mode = "fakeredis"
    can_fault = True

    def __init__(self) -> None:
        super().__init__()
        self.server = fakeredis.FakeServer()
        self._script_lock = threading.RLock()  # see _AtomicScripts
        self._tcp: fakeredis.TcpFakeServer | None = None
        self._tcp_thread: threading.Thread | None = None
        self._port = 0
        self._had_tcp = False

    def address(self) -> tuple[str, int]:
        if self._tcp is None:
            self._serve_tcp()
        return "127.0.0.1", self._port

    def _serve_tcp(self) -> None:
        tcp = fakeredis.TcpFakeServer(("127.0.0.1", self._port))
        tcp.fake_server = self.server  # serve this node's data, not a server of its own
        self._port = int(tcp.server_address[1])
        self._tcp = tcp
        self._tcp_thread = threading.Thread(
            target=tcp.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._tcp_thread.start()

    def _stop_tcp(self) -> None:
        if self._tcp is not None:
            self._tcp.shutdown()
            self._tcp.server_close()
            self._tcp = None
        if self._tcp_thread is not None:
            self._tcp_thread.join(5.0)
            self._tcp_thread = None

    def _new_client(self, **kwargs: Any) -> redis.Redis:
        kwargs.pop("retry", None)
        return _AtomicScripts(server=self.server, script_lock=self._script_lock, **kwargs)

    def _new_async_client(self, **kwargs: Any) -> redis.asyncio.Redis:
        kwargs.pop("retry", None)
        return fakeredis.FakeAsyncRedis(server=self.server, **kwargs)

    def _admin(self) -> redis.Redis:
        return fakeredis.FakeRedis(server=self.server)

    def stop(self) -> None:
        had_tcp = self._tcp is not None
        self._stop_tcp()
        self._had_tcp = had_tcp
        self.server.connected = False  # in-process clients now raise ConnectionError

    def start(self) -> None:
        self.server.connected = True
        if getattr(self, "_had_tcp", False):
            self._serve_tcp()  # same port: clients and proxies reconnect to it

    def restart(self) -> None:
        self.stop()
        self.server.connected = True
        admin = self._admin()
        admin.flushall()
        admin.script_flush()
        self.start()

    def close(self) -> None:
        super().close()
        self._stop_tcp()


def _free_ports(n: int) -> list[int]:
    """``n`` distinct loopback ports free now (all bound at once, then released)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in sockets]


#: Private servers still running: killed at interpreter exit if a teardown never ran.
_LIVE: set[ProcessNode] = set()


@atexit.register
def _kill_leftovers() -> None:
    for node in list(_LIVE):
        node.close()


class ProcessNode(RedisNode):
    """A private ``redis-server`` process on a loopback port, without persistence."""

    kind: Mode = "server"
    can_fault = True

    def __init__(self, command: list[str], *, cluster_bus: bool = False) -> None:
        """``cluster_bus``: a cluster node, whose bus port is chosen free as its port is
        (the default, the port + 10 000, may be taken or not exist)."""
        super().__init__()
        self._command = command
        self._dir = Path(tempfile.mkdtemp(prefix="kata-redis-"))
        self._proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self._admin_client: redis.Redis | None = None
        try:
            for _attempt in range(3):  # a free port can be taken between probe and bind
                if cluster_bus:
                    self.port, bus = _free_ports(2)
                    self._command = [*command, "--cluster-port", str(bus)]
                else:
                    (self.port,) = _free_ports(1)
                if self._spawn(raise_on_exit=False):
                    break
            else:
                raise RuntimeError(f"could not start {command!r} in three attempts")
        except BaseException as error:
            # Nothing will close a node that never started: its folder goes now, and
            # what its log said goes into the error instead of a path to a deleted file.
            self._kill()
            log = self._log_tail()
            shutil.rmtree(self._dir, ignore_errors=True)
            if not isinstance(error, RuntimeError):
                raise
            said = str(error).replace(f": see {self._dir / 'redis.log'}", "")
            raise RuntimeError(f"{said}; its log ended with:\n{log}" if log else said) from None
        _LIVE.add(self)

    def _log_tail(self, lines: int = 5) -> str:
        """The last lines the server logged, and wrote to stderr before its log opened
        (a bad option); "" if none."""
        said = []
        for name in ("redis.log", "stderr.log"):
            with contextlib.suppress(OSError):
                said += (self._dir / name).read_text(errors="replace").splitlines()[-lines:]
        return "\n".join(said)

    def _spawn(self, *, raise_on_exit: bool = True) -> bool:
        argv = [
            *self._command,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--daemonize", "no",
            "--dir", str(self._dir),
            "--logfile", str(self._dir / "redis.log"),
        ]  # fmt: skip
        with open(self._dir / "stderr.log", "ab") as stderr:  # errors before the log opens
            self._proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                **dies_with_parent(),
            )
        deadline = time.monotonic() + START_DEADLINE_S
        probe = redis.Redis(host="127.0.0.1", port=self.port, **client_kwargs(socket_timeout=1.0))
        try:
            while time.monotonic() < deadline:
                if self._proc.poll() is not None:
                    if raise_on_exit:
                        raise RuntimeError(
                            f"redis-server exited ({self._proc.returncode}) on port {self.port}: "
                            f"see {self._dir / 'redis.log'}"
                        )
                    return False
                try:
                    if probe.ping():
                        if self._is_ours(probe):
                            return True
                        # Another process's server took the port between probe and bind:
                        # ours cannot bind it, and must not pass for the one answering.
                        self._kill()
                        if raise_on_exit:
                            raise RuntimeError(
                                f"port {self.port} is now another redis-server's: cannot start "
                                "this one again on it"
                            )
                        return False
                except redis.ConnectionError:
                    time.sleep(0.005)
        finally:
            probe.close()
        self._kill()
        raise RuntimeError(
            f"redis-server on port {self.port} did not answer PING within "
            f"{START_DEADLINE_S:.0f} s: see {self._dir / 'redis.log'}"
        )

    def _is_ours(self, probe: redis.Redis) -> bool:
        """Whether the server answering on our port is the one we started: it runs in our
        own temporary folder."""
        folder = probe.config_get("dir").get("dir")
        return folder is not None and os.path.realpath(folder) == os.path.realpath(self._dir)

    def _kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()  # a crash: nothing is saved (and nothing would be)
            self._proc.wait(START_DEADLINE_S)
        self._proc = None
        if self._admin_client is not None:
            self._admin_client.close()
            self._admin_client = None

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise RuntimeError("server is stopped")
        return self._proc.pid

    def address(self) -> tuple[str, int]:
        return "127.0.0.1", self.port

    def _new_client(self, **kwargs: Any) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, **kwargs)

    def _new_async_client(self, **kwargs: Any) -> redis.asyncio.Redis:
        return redis.asyncio.Redis(host="127.0.0.1", port=self.port, **kwargs)

    def _admin(self) -> redis.Redis:
        if self._admin_client is None:
            self._admin_client = redis.Redis(host="127.0.0.1", port=self.port, **client_kwargs())
        return self._admin_client

    def stop(self) -> None:
        self._kill()

    def start(self) -> None:
        if self._proc is None:
            self._spawn()

    def restart(self) -> None:
        self._kill()
        self._spawn()

    def pause(self) -> None:
        """SIGSTOP the server: connections stay open, nothing answers (until resume)."""
        os.kill(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def close(self) -> None:
        super().close()
        if self._proc is not None and self._proc.poll() is None:
            os.kill(self._proc.pid, signal.SIGCONT)  # a paused server would ignore nothing else
        self._kill()
        shutil.rmtree(self._dir, ignore_errors=True)
        _LIVE.discard(self)


class SharedNode(RedisNode):
    """A Redis other tests use too (an external server, the session's cluster): never
    flushed, restarted or stopped — a test's keys are deleted by prefix afterwards."""

    can_fault = False
    shared = True

    def __init__(self) -> None:
        super().__init__()
        self._admin_client: redis.Redis | RedisCluster | None = None

    def stop(self) -> None:
        self._require_faults("stop")

    def start(self) -> None:
        self._require_faults("start")

    def restart(self) -> None:
        self._require_faults("restart")

    def close(self) -> None:
        super().close()
        if self._admin_client is not None:
            self._admin_client.close()
            self._admin_client = None


class ExternalNode(SharedNode):
    """The server at ``KATA_REDIS_URL``."""

    kind: Mode = "url"

    def __init__(self, url: str) -> None:
        super().__init__()
        self._url = url
        parsed = urlparse(url)
        self._host = parsed.hostname or "127.0.0.1"
        self._port = parsed.port or 6379

    @property
    def url(self) -> str:
        return self._url

    def address(self) -> tuple[str, int]:
        if urlparse(self._url).scheme not in ("redis", "rediss"):
            pytest.skip(f"{self._url}: a TCP endpoint is needed (a proxy or worker reaches it)")
        return self._host, self._port

    def _new_client(self, **kwargs: Any) -> redis.Redis:
        return redis.Redis.from_url(self._url, **kwargs)

    def _new_async_client(self, **kwargs: Any) -> redis.asyncio.Redis:
        return redis.asyncio.Redis.from_url(self._url, **kwargs)

    def proxied_client(self, proxy: FaultProxy, **kwargs: Any) -> redis.Redis:
        # keep the URL's credentials and database, change only where we connect
        parsed = urlparse(self._url)
        userinfo = parsed.netloc.rpartition("@")[0]
        netloc = f"{userinfo}@" if userinfo else ""
        url = parsed._replace(netloc=f"{netloc}{proxy.host}:{proxy.port}").geturl()
        c = redis.Redis.from_url(url, **client_kwargs(**kwargs))
        self._clients.append(c)
        return c

    def _admin(self) -> redis.Redis:
        if self._admin_client is None:  # one, kept open (a cluster client finds its slots once)
            self._admin_client = self._new_client(**client_kwargs())
        return self._admin_client  # type: ignore[return-value]  # a RedisCluster serves as one

    def delete_prefix(self, prefix: str) -> None:
        """Delete every key starting with ``prefix`` (SCAN, so the server is not blocked)."""
        admin = self._admin()
        batch: list[Any] = []
        for key in admin.scan_iter(match=_glob_escape(prefix) + "*", count=500):
            batch.append(key)
            if len(batch) >= 500:
                admin.delete(*batch)
                batch.clear()
        if batch:
            admin.delete(*batch)


def _glob_escape(text: str) -> str:
    return "".join("\\" + ch if ch in "*?[]\\" else ch for ch in text)


# --------------------------------------------------------------------------- env


class RedisEnv:
    """What a stage-3 test uses: nodes, clients, proxies, a key prefix, server time."""

    def __init__(
        self,
        *,
        server_command: list[str] | None = None,
        url: str | None = None,
        cluster_command: list[str] | None = None,
        faults: bool = False,
        realtime: bool = False,
        name: str = "test",
    ) -> None:
        if url is not None and faults and server_command is None and cluster_command is None:
            pytest.skip(_FAULTS_REASON)
        # private single servers (faults, several nodes) start with the cluster's command
        self._server_command = server_command or cluster_command
        self._cluster_command = cluster_command
        self._url = url
        self._faults = faults
        self._realtime = realtime
        self._name = name
        self._nodes: list[RedisNode] = []
        self._primary: RedisNode | None = None
        self._prefixes: list[str] = []
        self._frozen: _FrozenServerClock | None = None
        self._shared_clients: list[redis.Redis] = []
        # Tests call server()/clients() from their own threads: created once, under a lock.
        self._lock = threading.RLock()
        self.prefix = self.fresh_prefix()

    @classmethod
    def from_environment(
        cls, *, faults: bool = False, realtime: bool = False, name: str = "test"
    ) -> RedisEnv:
        """Choose the mode from ``KATA_REDIS_SERVER`` / ``KATA_REDIS_URL`` /
        ``KATA_REDIS_CLUSTER``."""
        command = os.environ.get(ENV_SERVER) or None
        cluster = os.environ.get(ENV_CLUSTER) or None
        return cls(
            server_command=shlex.split(command) if command else None,
            url=os.environ.get(ENV_URL) or None,
            cluster_command=shlex.split(cluster) if cluster else None,
            faults=faults,
            realtime=realtime,
            name=name,
        )

    # -- what serves the test --------------------------------------------------------
    @property
    def mode(self) -> Mode:
        """Who serves :meth:`server`: ``fakeredis``, ``server`` (private), ``url`` or
        ``cluster``."""
        if self._cluster_command is not None and not self._faults:
            return "cluster"
        if self._url is not None and not self._faults:
            return "url"
        return "server" if self._server_command is not None else "fakeredis"

    @property
    def refusals(self) -> tuple[str, ...]:
        """The replies a proxy's ``refuse(code)`` stands in for here: every one of
        :data:`UNAVAILABLE_REPLIES`, but only ``BUSY`` and ``LOADING`` on a cluster — a
        cluster client answers the others by asking the cluster for its slots, which a
        real cluster never refuses so (its real ``CLUSTERDOWN`` and ``TRYAGAIN`` are
        what the tests with a cluster of their own make)."""
        if self.mode == "cluster":
            return ("BUSY", "LOADING")
        return tuple(sorted(UNAVAILABLE_REPLIES))

    @property
    def time_is_controlled(self) -> bool:
        """True when :meth:`pass_time` moves server time without waiting (fakeredis)."""
        return self.mode == "fakeredis"

    def _new_private(self) -> RedisNode:
        node: RedisNode = (
            ProcessNode(self._server_command) if self._server_command is not None else FakeNode()
        )
        self._nodes.append(node)
        return node

    def server(self) -> RedisNode:
        """The test's Redis (created on first use)."""
        with self._lock:
            return self._server()

    def _server(self) -> RedisNode:
        if self._primary is None:
            if self.mode == "cluster":
                from katas._harness.redis_cluster import ClusterNode, shared_cluster

                assert self._cluster_command is not None
                self._primary = ClusterNode(shared_cluster(self._cluster_command))
                self._nodes.append(self._primary)
            elif self.mode == "url":
                assert self._url is not None
                self._primary = ExternalNode(self._url)
                self._nodes.append(self._primary)
            else:
                self._primary = self._new_private()
        return self._primary

    def servers(self, n: int) -> list[RedisNode]:
        """``n`` independent servers (the first is :meth:`server` unless that is external)."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if self.mode in ("url", "cluster"):
            if n == 1:
                return [self.server()]
            if self._server_command is None:
                pytest.skip(
                    f"needs {n} independent Redis servers; KATA_REDIS_URL is one. Set "
                    "KATA_REDIS_SERVER=redis-server too to run it on private servers."
                )
            return [self._new_private() for _ in range(n)]
        return [self.server()] + [self._new_private() for _ in range(n - 1)]

    def fault_server(self) -> RedisNode:
        """A server the test may stop, restart and flush (skips on an external server)."""
        if self.server().can_fault:
            return self.server()
        if self._server_command is None:
            pytest.skip(_FAULTS_REASON)
        return self._new_private()

    def client(self, **kwargs: Any) -> redis.Redis:
        """A new client of :meth:`server`."""
        return self.server().client(**kwargs)

    def clients(self, n: int) -> list[redis.Redis]:
        """``n`` clients of :meth:`server`, each with its own pool — like ``n`` nodes.

        Created on first use and reused by later calls (and hypothesis examples), so an
        example costs no new connections.
        """
        with self._lock:
            while len(self._shared_clients) < n:
                self._shared_clients.append(self.client())
            return self._shared_clients[:n]

    def async_client(self, **kwargs: Any) -> redis.asyncio.Redis:
        """A ``redis.asyncio`` client of :meth:`server` (aclose it in your loop)."""
        return self.server().async_client(**kwargs)

    def proxy(self, node: RedisNode | None = None) -> FaultProxy:
        """A fault-injecting proxy in front of ``node`` (default :meth:`server`)."""
        return (node or self.server()).proxy()

    # -- keys ------------------------------------------------------------------------
    def fresh_prefix(self) -> str:
        """A key prefix no other test or example uses (cleaned at teardown)."""
        prefix = f"kata:{self._name[:40]}:{uuid.uuid4().hex[:12]}:"
        self._prefixes.append(prefix)
        return prefix

    def keys(self, prefix: str | None = None, node: RedisNode | None = None) -> list[str]:
        """Keys under ``prefix`` (default :attr:`prefix`) on ``node``, as text, sorted."""
        admin = (node or self.server())._admin()
        pattern = _glob_escape(prefix if prefix is not None else self.prefix) + "*"
        return sorted(
            k.decode() if isinstance(k, bytes) else str(k)
            for k in admin.scan_iter(match=pattern, count=1000)
        )

    def contents(self, prefix: str | None = None, node: RedisNode | None = None) -> dict[str, Any]:
        """Every key under ``prefix`` (default :attr:`prefix`) on ``node`` and what it
        holds, by type (to prove that a call changed nothing; TTLs are left out)."""
        admin = self.admin(node)
        read: dict[str, Callable[[str], Any]] = {
            "string": admin.get,
            "hash": admin.hgetall,
            "set": lambda k: sorted(admin.smembers(k)),
            "zset": lambda k: admin.zrange(k, 0, -1, withscores=True),
            "list": lambda k: admin.lrange(k, 0, -1),
        }
        out: dict[str, Any] = {}
        for key in self.keys(prefix, node):
            kind = admin.type(key)
            kind = kind.decode() if isinstance(kind, bytes) else str(kind)
            out[key] = (kind, read[kind](key) if kind in read else None)
        return out

    def admin(self, node: RedisNode | None = None) -> redis.Redis:
        """The administration client of ``node`` (default :meth:`server`; one, kept open):
        what a test reads the server's keys with, apart from the code under test's own."""
        return (node or self.server())._admin()

    def lose_keys(self) -> None:
        """Every key of this test gone at once, as with a master back empty (a restart
        without persistence), but with no restart: connections and scripts live on."""
        node = self.server()
        if node.shared:
            node.delete_prefix(self.prefix)
        else:
            node.flushall()

    # -- time ------------------------------------------------------------------------
    def freeze_time(self) -> None:
        """fakeredis: stop the server clock now (it then moves only by pass_time)."""
        if self.time_is_controlled and self._frozen is None:
            self._frozen = _FrozenServerClock()

    def pass_time(self, ns: int) -> None:
        """Let ``ns`` of server time pass: moved instantly on fakeredis, slept on real servers.

        On a real server this sleeps, so the test must be marked ``realtime`` and each
        wait is at most 500 ms.
        """
        if not isinstance(ns, int) or isinstance(ns, bool) or ns < 0:
            raise ValueError(f"ns must be a non-negative int, got {ns!r}")
        if self.time_is_controlled:
            self.freeze_time()
            assert self._frozen is not None
            self._frozen.advance(ns)
            return
        if not self._realtime:
            raise pytest.UsageError(
                "pass_time on a real Redis server sleeps: mark the test @pytest.mark.realtime"
            )
        if ns > MAX_REAL_WAIT_NS:
            raise pytest.UsageError(f"pass_time({ns}) on a real server exceeds 500 ms")
        time.sleep(ns / NS_PER_S)

    def step_time_back(self, ns: int) -> None:
        """fakeredis: move the server clock ``ns`` back, as a failover to a server whose
        clock lags does. A real server's clock cannot be moved: the test is skipped."""
        if not isinstance(ns, int) or isinstance(ns, bool) or ns < 0:
            raise ValueError(f"ns must be a non-negative int, got {ns!r}")
        if not self.time_is_controlled:
            pytest.skip("steps the server clock back: only fakeredis's clock can be moved")
        self.freeze_time()
        assert self._frozen is not None
        self._frozen.advance(-ns)

    # -- teardown --------------------------------------------------------------------
    def close(self) -> None:
        if self._frozen is not None:
            self._frozen.restore()
            self._frozen = None
        for node in self._nodes:
            if node.shared:
                for prefix in self._prefixes:
                    node.delete_prefix(prefix)
            node.close()
        self._nodes.clear()
        self._primary = None
        self._shared_clients.clear()

    def __enter__(self) -> RedisEnv:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


__all__ = [
    "DEFAULT_SOCKET_TIMEOUT_S",
    "ENV_SERVER",
    "ENV_URL",
    "ExternalNode",
    "FakeNode",
    "FaultProxy",
    "Mode",
    "ProcessNode",
    "RedisEnv",
    "RedisNode",
    "SharedNode",
    "client_kwargs",
]
