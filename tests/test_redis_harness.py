"""The Redis harness itself: its three modes, its fault proxy and its server clock.

Private-server and external-server modes need ``redis-server`` on PATH (or
``KATA_REDIS_SERVER``); the external mode is simulated with a private server this
test starts itself.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from katas._harness import redis as redis_harness
from katas._harness.faultproxy import RespCommandParser
from katas._harness.redis import FROZEN_START_NS, ProcessNode, RedisEnv
from katas._runtime.clients import check_client, unavailable

SERVER_CMD = shlex.split(os.environ.get("KATA_REDIS_SERVER") or "redis-server")
needs_server = pytest.mark.skipif(
    shutil.which(SERVER_CMD[0]) is None, reason=f"{SERVER_CMD[0]} is not installed"
)


@pytest.fixture
def fake_env() -> Iterator[RedisEnv]:
    with RedisEnv(server_command=None, url=None) as env:
        yield env


@pytest.fixture
def server_env() -> Iterator[RedisEnv]:
    if shutil.which(SERVER_CMD[0]) is None:
        pytest.skip(f"{SERVER_CMD[0]} is not installed")
    with RedisEnv(server_command=SERVER_CMD, url=None, faults=True, realtime=True) as env:
        yield env


@pytest.fixture(params=["fakeredis", "server"])
def any_env(request: pytest.FixtureRequest) -> RedisEnv:
    return request.getfixturevalue(f"{'fake' if request.param == 'fakeredis' else 'server'}_env")  # type: ignore[no-any-return]


# --------------------------------------------------------------------------- RESP


def test_resp_parser_splits_commands_across_chunks() -> None:
    parser = RespCommandParser()
    wire = b"*2\r\n$3\r\nGET\r\n$1\r\nk\r\n*3\r\n$7\r\nevalsha\r\n$2\r\nab\r\n$1\r\n0\r\nPING\r\n"
    names: list[str] = []
    for i in range(0, len(wire), 5):  # in awkward pieces, like TCP may deliver them
        names += parser.feed(wire[i : i + 5])
    assert names == ["GET", "EVALSHA", "PING"]


def test_resp_parser_waits_for_a_whole_bulk_string() -> None:
    parser = RespCommandParser()
    assert parser.feed(b"*1\r\n$4\r\nPI") == []
    assert parser.feed(b"NG\r\n") == ["PING"]


# --------------------------------------------------------------------------- modes


def test_fakeredis_mode_is_fresh_per_env_and_shares_data_over_tcp() -> None:
    with RedisEnv() as first:
        first.client().set(first.prefix + "k", b"1")
        tcp = first.server().tcp_client()
        assert tcp.get(first.prefix + "k") == b"1", "TcpFakeServer serves the same FakeServer"
        script = tcp.register_script("return redis.call('INCR', KEYS[1])")
        assert script(keys=[first.prefix + "n"]) == 1, "Lua runs over TCP"
    with RedisEnv() as second:
        assert second.mode == "fakeredis"
        assert second.keys("") == [], "every env gets a fresh FakeServer"


#: A GET-then-SET on a fresh key: the script that finds it missing claims it.
RACING_SCRIPT = (
    "local g = redis.call('GET', KEYS[1]) or '' "
    "local x = 0 for i = 1, 2000 do x = x + i end "
    "if g == '' then g = ARGV[1]; redis.call('SET', KEYS[1], g) end return g"
)


def _race_scripts(env: RedisEnv, clients: int) -> list[Any]:
    """What each of ``clients`` clients racing :data:`RACING_SCRIPT` on one key got."""
    scripts = [c.register_script(RACING_SCRIPT) for c in env.clients(clients)]
    barrier = threading.Barrier(len(scripts))
    got: list[Any] = [None] * len(scripts)

    def run(i: int) -> None:
        barrier.wait(10)
        got[i] = scripts[i](keys=[f"{env.prefix}gen"], args=[str(i)])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(scripts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return got


def test_fakeredis_runs_each_script_alone_as_redis_does() -> None:
    # Exactly one of eight racing scripts may see the key missing: fakeredis alone lets
    # two through in ~15% of such races; the harness serialises its scripts per server.
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for race in range(40):
            with RedisEnv() as env:
                assert env.mode == "fakeredis"
                got = _race_scripts(env, 8)
            assert len(set(got)) == 1, f"race {race}: two scripts saw the key missing: {got}"
    finally:
        sys.setswitchinterval(old)


def test_another_process_reaches_the_same_data_with_lua(any_env: RedisEnv) -> None:
    """Worker processes connect by URL (fakeredis: to its TcpFakeServer) and run scripts."""
    node = any_env.server()
    code = (
        "import redis, sys; r = redis.Redis.from_url(sys.argv[1], socket_timeout=5); "
        "print(r.eval(\"return redis.call('INCRBY', KEYS[1], 41)\", 1, sys.argv[2]))"
    )
    key = any_env.prefix + "shared"
    node.client().set(key, 1)
    done = subprocess.run(
        [sys.executable, "-c", code, node.url, key], capture_output=True, text=True, timeout=60
    )
    assert done.stdout.strip() == "42", done.stderr
    assert node.client().get(key) == b"42"


def test_clients_have_a_socket_timeout_and_no_hidden_retries(any_env: RedisEnv) -> None:
    kwargs = any_env.client().get_connection_kwargs()
    assert kwargs["socket_timeout"] is not None
    retry = kwargs.get("retry")
    assert retry is None or retry.get_retries() == 0


def test_async_clients_work_in_every_mode(any_env: RedisEnv) -> None:
    async def main() -> bytes | None:
        client = any_env.async_client()
        try:
            await client.set(any_env.prefix + "a", b"x")
            value = await client.get(any_env.prefix + "a")
            return value if isinstance(value, bytes) else None
        finally:
            await client.aclose()

    assert asyncio.run(main()) == b"x"


def test_restart_loses_data_and_scripts_then_serves_again(any_env: RedisEnv) -> None:
    node = any_env.fault_server()
    client = node.client()
    client.set(any_env.prefix + "k", b"1")
    sha = client.script_load("return 1")
    node.restart()
    assert client.get(any_env.prefix + "k") is None, "no persistence: data is gone"
    assert client.script_exists(sha) == [False], "and so is the script cache"


def test_script_flush_empties_the_script_cache(any_env: RedisEnv) -> None:
    node = any_env.fault_server()
    client = node.client()
    sha = client.script_load("return 1")
    node.script_flush()
    assert client.script_exists(sha) == [False]


def test_stop_refuses_connections_until_start(any_env: RedisEnv) -> None:
    node = any_env.fault_server()
    client = node.tcp_client(socket_timeout=1)
    client.set(any_env.prefix + "k", b"1")
    node.stop()
    with pytest.raises(redis.ConnectionError):
        client.get(any_env.prefix + "k")
    node.start()
    assert client.ping()


def test_servers_are_independent(any_env: RedisEnv) -> None:
    a, b, c = any_env.servers(3)
    a.client().set("same", b"a")
    b.client().set("same", b"b")
    assert (a.client().get("same"), b.client().get("same"), c.client().get("same")) == (
        b"a",
        b"b",
        None,
    )


@needs_server
def test_private_server_process_is_killed_at_teardown() -> None:
    with RedisEnv(server_command=SERVER_CMD) as env:
        node = env.server()
        assert isinstance(node, ProcessNode)
        pid = node.pid
        assert env.client().ping()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.01)
    pytest.fail(f"redis-server {pid} still runs after the env closed")


def _ports_taken_first(monkeypatch: pytest.MonkeyPatch, taken: list[int]) -> list[list[int]]:
    """Make the harness's next port draw hand out ``taken`` (ports already in use), as a
    draw does when another process binds a port between its probe and our server's bind;
    every later draw is a real one. Returns the draws made."""
    real = redis_harness._free_ports
    draws: list[list[int]] = []

    def draw(n: int) -> list[int]:
        ports = real(n) if draws else [*taken[:n], *real(n)[len(taken[:n]) :]]
        draws.append(ports)
        return ports

    monkeypatch.setattr(redis_harness, "_free_ports", draw)
    return draws


@needs_server
def test_a_port_another_server_took_is_never_mistaken_for_ours(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Another process's server answers PING on the port drawn for ours: that is not ours
    starting. Ours cannot bind the port, so the harness draws another."""
    first = ProcessNode(SERVER_CMD)
    try:
        first.client().set("whose", b"first")
        draws = _ports_taken_first(monkeypatch, [first.port])
        second = ProcessNode(SERVER_CMD)
        try:
            assert len(draws) == 2, f"the taken port must cost a second draw: {draws}"
            assert second.port != first.port and second.pid != first.pid
            assert second.client().get("whose") is None, "the second node is the first one"
        finally:
            second.close()
    finally:
        first.close()


@needs_server
def test_a_cluster_node_whose_bus_port_is_taken_draws_both_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A cluster node's bus port is drawn with its port, and drawn again with it when the
    server cannot start: a bus port another server holds must not fail every attempt."""
    other = ProcessNode(SERVER_CMD)
    try:
        (free,) = redis_harness._free_ports(1)
        draws = _ports_taken_first(monkeypatch, [free, other.port])
        node = ProcessNode([*SERVER_CMD, "--cluster-enabled", "yes"], cluster_bus=True)
        try:
            assert len(draws) == 2, f"the taken bus port must cost a second draw: {draws}"
            assert node.client().cluster("MYID"), "a cluster node"
            bus = node.client().config_get("cluster-port")["cluster-port"]
            assert bus == str(draws[1][1]) != str(other.port), f"bus {bus}, draws {draws}"
        finally:
            node.close()
    finally:
        other.close()


@needs_server
def test_a_node_that_cannot_start_says_why_and_leaves_no_folder(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A server that exits at start (here: an option it does not know) fails the node with
    what its log said; nothing will close that node, so its folder is gone already."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(RuntimeError) as failed:
        ProcessNode([*SERVER_CMD, "--no-such-option", "1"])
    message = str(failed.value)
    assert "could not start" in message and "no-such-option" in message.split("\n", 1)[1], (
        f"the error must quote the server's log: {message!r}"
    )
    assert list(tmp_path.iterdir()) == [], "the node's folder must not outlive it"


@needs_server
def test_paused_server_times_out_then_resumes(server_env: RedisEnv) -> None:
    node = server_env.server()
    assert isinstance(node, ProcessNode)
    client = node.client(socket_timeout=0.1)
    client.ping()
    node.pause()
    with pytest.raises(redis.TimeoutError):
        client.ping()
    node.resume()
    assert node.client().ping()


# --------------------------------------------------------------------------- external


@pytest.fixture
def external() -> Iterator[ProcessNode]:
    """A server standing in for KATA_REDIS_URL: started here, not by the env under test."""
    if shutil.which(SERVER_CMD[0]) is None:
        pytest.skip(f"{SERVER_CMD[0]} is not installed")
    node = ProcessNode(SERVER_CMD)
    try:
        yield node
    finally:
        node.close()


def test_external_server_keys_under_the_prefix_are_deleted(external: ProcessNode) -> None:
    other = external.client()
    other.set("not-ours", b"keep")
    with RedisEnv(url=external.url) as env:
        assert env.mode == "url"
        env.client().set(env.prefix + "a", b"1")
        second = env.fresh_prefix()
        env.client().set(second + "b", b"2")
        assert env.keys() == [env.prefix + "a"]
    assert other.keys("*") == [b"not-ours"], "only the env's prefixes are cleaned, nothing else"


def test_external_server_is_never_restarted_or_flushed(external: ProcessNode) -> None:
    with RedisEnv(url=external.url) as env:
        for act in (env.server().restart, env.server().script_flush, env.server().flushall):
            with pytest.raises(pytest.skip.Exception, match="KATA_REDIS_SERVER"):
                act()
        with pytest.raises(pytest.skip.Exception, match="independent"):
            env.servers(2)
        with pytest.raises(pytest.skip.Exception):
            env.fault_server()
    with pytest.raises(pytest.skip.Exception, match="restart"):
        RedisEnv(url=external.url, faults=True)


def test_external_plus_private_servers_split_the_work(external: ProcessNode) -> None:
    with RedisEnv(url=external.url, server_command=SERVER_CMD) as env:
        assert env.server().kind == "url"
        assert env.fault_server().kind == "server"
        assert [n.kind for n in env.servers(2)] == ["server", "server"]
    with RedisEnv(url=external.url, server_command=SERVER_CMD, faults=True) as env:
        assert env.mode == "server" and env.server().can_fault


def test_proxy_reaches_an_external_server(external: ProcessNode) -> None:
    with RedisEnv(url=external.url) as env:
        proxy = env.proxy()
        client = env.server().proxied_client(proxy)
        assert client.ping()
        proxy.outage()
        with pytest.raises(redis.ConnectionError):
            client.ping()


# --------------------------------------------------------------------------- proxy


def test_proxy_counts_round_trips_and_commands(any_env: RedisEnv) -> None:
    proxy = any_env.proxy()
    client = any_env.server().proxied_client(proxy)
    client.ping()  # connection handshake happens here
    proxy.reset_counts()
    client.set(any_env.prefix + "a", b"1")
    pipe = client.pipeline(transaction=False)
    pipe.get(any_env.prefix + "a")
    pipe.incr(any_env.prefix + "n")
    pipe.get(any_env.prefix + "n")
    pipe.execute()
    counts = proxy.counts()
    assert counts.round_trips == 2, "one SET, then one pipeline"
    assert counts.commands == ("SET", "GET", "INCRBY", "GET")


def test_proxy_outage_refuses_then_heals(any_env: RedisEnv) -> None:
    proxy = any_env.proxy()
    client = any_env.server().proxied_client(proxy, socket_timeout=2)
    assert client.ping()
    proxy.outage()
    with pytest.raises(redis.ConnectionError):
        client.ping()
    with pytest.raises(redis.ConnectionError):  # new connections too
        any_env.server().proxied_client(proxy, socket_timeout=2).ping()
    proxy.heal()
    assert client.ping()


def test_proxy_blackhole_needs_a_socket_timeout_then_heals(any_env: RedisEnv) -> None:
    proxy = any_env.proxy()
    client = any_env.server().proxied_client(proxy, socket_timeout=0.1)
    assert client.ping()
    proxy.blackhole()
    with pytest.raises(redis.TimeoutError):
        client.ping()
    proxy.heal()
    assert client.ping()


def test_proxy_drop_replies_applies_the_write_but_loses_the_reply(any_env: RedisEnv) -> None:
    proxy = any_env.proxy()
    client = any_env.server().proxied_client(proxy, socket_timeout=0.2)
    assert client.ping()
    key = any_env.prefix + "k"
    proxy.reset_counts()
    proxy.drop_replies()
    start = time.monotonic()
    with pytest.raises(redis.TimeoutError):
        client.set(key, b"v")
    assert any_env.server().client().get(key) == b"v", "the server applied the write"
    assert "SET" in proxy.counts().commands, "the command was sent, so it is counted"
    proxy.heal()
    assert client.get(key) == b"v", "after heal() the client reconnects cleanly"
    assert time.monotonic() - start < 5, "one socket timeout, not a hang"


def test_proxy_latency_still_forwards(any_env: RedisEnv) -> None:
    proxy = any_env.proxy()
    proxy.set_latency_ns(5_000_000)
    client = any_env.server().proxied_client(proxy)
    assert client.ping()
    with pytest.raises(ValueError, match="ns"):
        proxy.set_latency_ns(-1)


# --------------------------------------------------------------------------- time


def test_fakeredis_time_is_frozen_and_moved_by_pass_time(fake_env: RedisEnv) -> None:
    client = fake_env.client()
    fake_env.freeze_time()
    start = fake_env.server().time_us()
    assert start * 1000 == FROZEN_START_NS
    client.set(fake_env.prefix + "k", b"1", px=1500)
    fake_env.pass_time(1_000_000_000)
    assert client.pttl(fake_env.prefix + "k") == 500
    fake_env.pass_time(501_000_000)  # Redis expires a key once now > deadline (in ms)
    assert client.get(fake_env.prefix + "k") is None, "expired once server time passed"
    assert fake_env.server().time_us() == start + 1_501_000
    fake_env.close()
    assert abs(fake_env.server().time_us() / 1e6 - time.time()) < 60, "real time restored"


@needs_server
def test_pass_time_on_a_real_server_needs_the_realtime_mark() -> None:
    with RedisEnv(server_command=SERVER_CMD, realtime=False) as env:
        assert not env.time_is_controlled
        with pytest.raises(pytest.UsageError, match="realtime"):
            env.pass_time(1_000_000)
    with RedisEnv(server_command=SERVER_CMD, realtime=True) as env:
        with pytest.raises(pytest.UsageError, match="500 ms"):
            env.pass_time(600_000_000)
        before = env.server().time_us()
        env.pass_time(20_000_000)
        assert env.server().time_us() - before >= 20_000


@pytest.mark.redis_faults
def test_fixture_follows_the_environment(redis_env: RedisEnv) -> None:
    expected = "server" if os.environ.get("KATA_REDIS_SERVER") else "fakeredis"
    assert redis_env.mode == expected, "a redis_faults test never gets the external server"
    assert redis_env.server().can_fault


# --------------------------------------------------------------------------- cluster


@needs_server
@pytest.mark.skipif(shutil.which("redis-cli") is None, reason="redis-cli is not installed")
def test_a_local_cluster_moves_a_slot_step_by_step_and_fails_without_a_master() -> None:
    from redis.crc import key_slot

    from katas._harness.redis_cluster import LocalCluster

    with LocalCluster(command=SERVER_CMD) as cluster:
        client = cluster.client()
        keys = [f"{{queue}}:{i}" for i in range(30)]
        for i, key in enumerate(keys):
            client.set(key, i)
        slot = key_slot(b"queue")
        source = cluster.owner(slot)
        target = next(n for n in cluster.nodes if n is not source)
        cluster.begin_migration(slot, target)
        assert cluster.move_keys(slot, target, count=10) == 10
        # half moved: a key on either side is still read (ASK), a split multi-key call is not
        assert [client.get(k) for k in keys] == [str(i).encode() for i in range(30)]
        with pytest.raises(redis.RedisError):
            client.mget(keys)
        cluster.move_keys(slot, target)
        cluster.finish_migration(slot, target)
        assert cluster.owner(slot) is target
        assert client.mget(keys) == [str(i).encode() for i in range(30)]
        cluster.kill(target)
        cluster.wait_state("fail")
        other = next(f"k{i}" for i in range(100) if cluster.owner_of(f"k{i}") is source)
        with pytest.raises(redis.exceptions.ClusterDownError):
            client.get(other)
        cluster.revive(target)
        assert client.get(keys[0]) is None  # a master without persistence comes back empty
        assert cluster.state() == "ok"


@needs_server
@pytest.mark.skipif(shutil.which("redis-cli") is None, reason="redis-cli is not installed")
def test_clusters_built_ahead_are_fresh_and_a_partial_one_stays_partial_after_a_revive() -> None:
    """From the second cluster a run takes on, more are built behind it (a new master
    waits two seconds to turn ok): each is a cluster of its own, empty, ok;
    ``full_coverage=False`` is set on a cluster taken ready-made, and kept by a master
    that is started again; the session's end closes the spares nobody took."""
    from katas._harness.redis_cluster import _READY, LocalCluster, close_spares

    with LocalCluster(command=SERVER_CMD) as first:
        first.client().set("k", 1)
        ports = {node.port for node in first.nodes}
    with LocalCluster(command=SERVER_CMD, full_coverage=False) as second:
        assert not ports & {node.port for node in second.nodes}, "a cluster was reused"
        client = second.client()
        assert client.get("k") is None and second.state() == "ok"
        dead = second.owner_of("k")
        second.kill(dead)
        second.revive(dead)
        alive = next(n for n in second.nodes if n is not dead)
        assert (
            dead._admin().config_get("cluster-require-full-coverage")
            == alive._admin().config_get("cluster-require-full-coverage")
            == {"cluster-require-full-coverage": "no"}
        )
    with LocalCluster(command=SERVER_CMD, full_coverage=False) as third:  # built ahead
        assert third.state() == "ok"
        assert {
            n._admin().config_get("cluster-require-full-coverage")["cluster-require-full-coverage"]
            for n in third.nodes
        } == {"no"}
    spares = [node for cluster in _READY._ahead.values() for f in cluster for node in f.result()]
    assert spares, "no cluster was built ahead of a third"
    close_spares()
    assert all(node._proc is None for node in spares), "a spare outlived close_spares()"


@needs_server
@pytest.mark.skipif(shutil.which("redis-cli") is None, reason="redis-cli is not installed")
def test_the_sessions_end_closes_the_shared_cluster_and_its_folders() -> None:
    """The session's shared cluster ends with the session (``pytest_unconfigure``), not at
    interpreter exit: a run forked from the warm process ends with ``os._exit``, and its
    nodes, killed with it, left their folders behind."""
    from katas._harness import redis_cluster

    shared = redis_cluster.shared_cluster(SERVER_CMD)
    nodes = list(shared.nodes)
    folders = [node._dir for node in nodes]
    assert nodes and all(folder.exists() for folder in folders)
    redis_cluster.close_session()
    assert all(node._proc is None for node in nodes), "a shared node outlived the session"
    assert not [f for f in folders if f.exists()], "the shared cluster's folders are left"
    assert redis_cluster.shared_cluster(SERVER_CMD) is not shared, "a closed cluster reused"
    redis_cluster.close_session()


@pytest.mark.parametrize(
    "error",
    [
        redis.exceptions.ClusterDownError("The cluster is down"),
        redis.exceptions.MasterDownError("Link with MASTER is down"),
        redis.exceptions.TryAgainError("Multiple keys request during rehashing of slot"),
        redis.exceptions.ClusterError("TTL exhausted."),
        redis.ResponseError("CLUSTERDOWN The cluster is down"),
        redis.exceptions.BusyLoadingError("Redis is loading the dataset in memory"),
        redis.exceptions.RedisClusterUnreachableError("Redis Cluster cannot be connected."),
    ],
    ids=lambda e: type(e).__name__,
)
def test_redis_py_typed_cluster_replies_are_unavailability(error: Exception) -> None:
    """redis-py cuts the reply's code (CLUSTERDOWN, TRYAGAIN, MASTERDOWN) from the text of
    the error it types: the type alone must say "cannot serve now". A cluster client that
    reaches no node raises RedisClusterUnreachableError, which is not even a RedisError."""
    assert unavailable(error), f"{type(error).__name__}: {error}"
    assert not unavailable(redis.ResponseError("WRONGTYPE Operation against a key"))


@needs_server
@pytest.mark.skipif(shutil.which("redis-cli") is None, reason="redis-cli is not installed")
def test_a_cluster_client_that_retries_is_refused_and_one_that_does_not_is_accepted() -> None:
    from redis.cluster import RedisCluster

    from katas._harness.redis_cluster import LocalCluster

    with LocalCluster(command=SERVER_CMD) as cluster:
        check_client(cluster.client())
        host, port = cluster.addresses()[0].split(":")
        default = RedisCluster(host=host, port=int(port), socket_timeout=0.2)
        try:
            with pytest.raises(ValueError, match="retries"):
                check_client(default)
        finally:
            default.close()


@needs_server
@pytest.mark.skipif(shutil.which("redis-cli") is None, reason="redis-cli is not installed")
def test_cluster_mode_serves_a_test_from_a_shared_cluster_and_cleans_its_keys() -> None:
    """KATA_REDIS_CLUSTER's mode: cluster clients of one cluster for every test, keys
    deleted by prefix afterwards on every master, faults on private single servers, and
    a ClusterProxy that takes the whole cluster down and back for a client behind it."""
    from redis.cluster import RedisCluster

    from katas._harness.redis_cluster import ClusterNode

    env = RedisEnv(cluster_command=SERVER_CMD, name="cluster-mode")
    try:
        assert env.mode == "cluster" and isinstance(env.server(), ClusterNode)
        client = env.client()
        assert isinstance(client, RedisCluster)
        names = [f"{env.prefix}{i}" for i in range(20)]  # spread over the masters
        for name in names:
            client.set(name, "1")
        assert env.keys() == sorted(names)
        node = env.server()
        assert isinstance(node, ClusterNode)
        cluster = node.cluster
        assert len({cluster.owner_of(n).port for n in names}) > 1, "all keys on one master"
        proxy = env.proxy()
        behind = env.server().proxied_client(proxy)
        assert behind.get(names[0]) == b"1"
        proxy.reset_counts()
        behind.get(names[0])  # the same master: its connection is open
        assert proxy.counts().round_trips == 1
        proxy.outage()
        with pytest.raises(redis.ConnectionError):
            behind.get(names[2])
        proxy.heal()
        assert behind.get(names[3]) == b"1"
        assert env.fault_server() is not env.server()  # a private server for faults
    finally:
        env.close()
    assert cluster.keys(env.prefix) == [], "the test's keys outlive it"
