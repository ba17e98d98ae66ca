"""Stage 3 benchmarks: ring lookups, near-cache hits, the price of publishing writes.

Collected only when this file is named on the command line (the suites are
``test_*.py``; ``pytest katas/kv_cache -k stage3`` never picks this file up)::

    KATA_REDIS_SERVER=redis-server \\
        pytest katas/kv_cache/bench_stage3.py --impl=solutions --benchmark-only -q

The Redis is the suites' (``katas/_harness/redis.py``): **fakeredis by default**, where
the Redis-backed groups are only a smoke run with small sizes — their cost is
fakeredis's Python (and Lua emulation, for the publishing scripts), not a server, so
their ratios mean little. ``KATA_REDIS_SERVER=redis-server`` starts three private real
servers for the file (the mode whose numbers mean something); each group prints which
one served it. Client and servers share the machine (2 cores here).

Every group runs its contenders in turn within every round (each round starting with
the next one), so that drift on a shared machine hits them alike, and reports the
ratios of each one's best round in ``extra_info`` (``--benchmark-json``) and on stdout
(printed even without ``-s``). The spec sets no target for stage 3: every ratio is
informational (and benchmarks never fail CI):

- ring lookups (core): ``nodes_for(key, 2)`` on a ``HashRing`` of 10 nodes x 160
  virtual nodes, over a fixed set of 20 000 keys — the implementation under test
  against the reference (throughput ratio), and one lookup's cost in µs. No Redis.
- near hit (extended): ``NearCache.get`` of a key it holds against ``ShardedCache.get``
  of the same key (a Redis round trip to its first replica): the speed-up, and the
  near hit against the reference's. The near caches are never started: each node's
  channel is marked ready with ``channel_ready``, as the suite does. A started one
  would add a listener thread per node, idle on an empty channel, that measures
  nothing here but its wake-ups competing for the GIL; what a hit costs is a lock and
  an LRU lookup either way.
- write price (extended): ``put`` through a ``ShardedCache(channel=...)`` (one
  SET+PUBLISH script per replica, 2 replicas) against a plain ``ShardedCache``'s
  ``put`` (one SET per replica), same servers, same clients, same keys; and the
  publishing put against the reference's. Nobody is subscribed (a subscriber would
  add the fan-out of each message to the server's cost).
- Zipf reads (extended): Zipf(1.25) over 5 000 keys (all present in Redis), read
  through a ``NearCache`` with a stage-1 ``LRUCache(500)`` in front, against the bare
  ``ShardedCache`` under it: the hit rate (from ``statistics()``; ours and the
  reference's see the same sequence through the same LRU, so they must agree) and
  the throughput ratio.

Values are 100-character strings (JSON-encoded); every ``ShardedCache`` has 2
replicas over the same three nodes and its own key prefix.

Measured here (the reference under test; 2 shared cores, other jobs running, so the
round trips swing with the load while the interleaved ratios hold); the file takes
about 4 s on fakeredis and 15 s on real servers:

- ring: 1.76-1.80 µs per ``nodes_for(key, 2)`` (blake2b of the key, a bisect over
  1 600 points, a short walk), 0.99-1.00x the reference against itself; placements
  agree.
- near hit: 0.42-0.43 µs (a lock and an LRU lookup), 0.98-1.01x the reference.
  Against ``ShardedCache.get`` on real servers (54-131 µs a round trip, with the load):
  126-303x; on fakeredis (~33 µs): 75-80x.
- write price: the publishing put costs 1.04-1.39x the plain one on real servers
  (160-280 µs against 121-271 µs for two replicas; the README's 131 against 115 µs a
  call is 1.14x), 0.95-1.05x the reference's; on fakeredis 2.84-2.99x (~250 against
  ~85 µs: its Lua emulation, not a server's cost).
- Zipf reads: hit rate 0.8695-0.8712 (ours and the reference agree exactly), and
  6.4-7.2x the bare ``ShardedCache``'s reads/s on real servers (6.3-6.7x on
  fakeredis); 0.88-1.04x the reference.
- against redis-py's client cache: 5.7x its reads/s (34 200 against 6 000). Its hit is
  no local lookup: each cached ``get`` still reads the connection's socket for pushed
  invalidations (three ``recv`` calls a hit), ~120 µs a hit against ~185 µs for a
  plain ``GET``, where the near cache's hit is a lock and an LRU lookup (0.4 µs).
"""

from __future__ import annotations

import functools
import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import accumulate
from types import ModuleType
from typing import Any

import pytest
import redis

from katas._harness.bench import Contender, interleaved, report, say
from katas._harness.redis import RedisEnv
from katas._registry import impl as _impl

pytestmark = [pytest.mark.stage(3)]

NODES = ("n0", "n1", "n2")
REPLICAS = 2
RING_NODES = 10
VNODES = 160
RING_KEYS = 20_000  # lookups per contender per round
RING_ROUNDS = 11
VALUE = "v" * 100
ZIPF_S = 1.25
ZIPF_KEYS = 5_000
LOCAL_SIZE = 500
ZIPF_WARMUP = 5_000  # untimed reads through each near cache first
CHANNEL = "bench-invalidations"
INFORMATIONAL = "none (informational)"


@dataclass(frozen=True)
class Scale:
    """How much work a Redis-backed group does: full on real servers, a smaller run on
    fakeredis."""

    near_hits: int  # local hits per round
    remote_gets: int  # round trips per round
    puts: int  # puts per round (each one write per replica)
    zipf_reads: int  # reads per round of the Zipf workload
    rounds: int


@pytest.fixture(scope="module")
def bench_env() -> Iterator[RedisEnv]:
    """One Redis setup for the whole file (every contender on the same servers), chosen
    as for the suites: fakeredis, or ``KATA_REDIS_SERVER`` / ``KATA_REDIS_URL``."""
    with RedisEnv.from_environment(name="bench") as env:
        yield env


@pytest.fixture(scope="module")
def clients(bench_env: RedisEnv) -> dict[str, redis.Redis]:
    """One client per node, shared by every cache of the file."""
    return {name: node.client() for name, node in zip(NODES, bench_env.servers(3), strict=True)}


@pytest.fixture(scope="module")
def scale(bench_env: RedisEnv) -> Scale:
    if bench_env.mode == "fakeredis":
        return Scale(near_hits=50_000, remote_gets=500, puts=200, zipf_reads=1_000, rounds=7)
    return Scale(near_hits=100_000, remote_gets=1_000, puts=300, zipf_reads=2_000, rounds=11)


@pytest.fixture(scope="module")
def reference() -> ModuleType:
    """The reference stage 3, whatever ``--impl`` says."""
    return _impl.resolve("solutions").stage("kv_cache", 3)


@pytest.fixture(scope="module")
def reference_lru() -> Any:
    """The reference stage 1's LRUCache, the local cache of the reference near cache."""
    return _impl.resolve("solutions").stage("kv_cache", 1).LRUCache


def where(env: RedisEnv) -> str:
    if env.mode == "fakeredis":
        return "fakeredis: Redis numbers mean little; KATA_REDIS_SERVER=redis-server for real"
    return f"{env.mode}: real Redis on loopback, sharing this machine's cores"


def sharded(
    stage: ModuleType,
    env: RedisEnv,
    clients: dict[str, redis.Redis],
    *,
    channel: str | None = None,
    prefix: str | None = None,
) -> Any:
    """A ShardedCache over the file's nodes, under a fresh key prefix (unless given)."""
    return stage.ShardedCache(
        clients,
        replicas=REPLICAS,
        key_prefix=env.fresh_prefix() if prefix is None else prefix,
        probe_interval_ns=0,
        channel=channel,
    )


def near_cache(stage: ModuleType, remote: Any, local: Any) -> Any:
    """A near cache that is not started, every node's channel marked ready."""
    near = stage.NearCache(remote, local)
    for node in remote.clients:
        near.channel_ready(node)
    return near


def repeat(call: Any, arg: str, n: int) -> Contender:
    """``n`` calls of ``call(arg)`` a round."""
    args = [arg] * n

    def run() -> None:
        for a in args:
            call(a)

    return Contender(run, n)


# --- ring lookups ----------------------------------------------------------------------


@functools.cache
def ring_keys() -> list[str]:
    rng = random.Random(5)
    return [f"user:{rng.getrandbits(48):012x}" for _ in range(RING_KEYS)]


def lookups(stage: ModuleType) -> Contender:
    ring = stage.HashRing([f"node-{i}" for i in range(RING_NODES)], vnodes=VNODES)
    nodes_for, keys = ring.nodes_for, ring_keys()

    def run() -> None:
        for key in keys:
            nodes_for(key, REPLICAS)

    return Contender(run, len(keys))


@pytest.mark.core
def test_bench_stage3_ring_lookups(
    benchmark: Any,
    stage_module: ModuleType,
    reference: ModuleType,
    capsys: pytest.CaptureFixture[str],
) -> None:
    benchmark.group = "stage3 HashRing.nodes_for(key, 2), 10 nodes x 160 vnodes (interleaved)"
    mine, theirs = lookups(stage_module), lookups(reference)
    first = stage_module.HashRing([f"node-{i}" for i in range(RING_NODES)], vnodes=VNODES)
    ref = reference.HashRing([f"node-{i}" for i in range(RING_NODES)], vnodes=VNODES)
    agree = all(first.nodes_for(k, REPLICAS) == ref.nodes_for(k, REPLICAS) for k in ring_keys())
    per_op = interleaved(benchmark, {"HashRing": mine, "reference": theirs}, rounds=RING_ROUNDS)
    if math.isnan(per_op["HashRing"]):
        return
    say(
        capsys,
        f"nodes_for(key, 2): {per_op['HashRing'] * 1e6:.2f} µs per lookup; reference "
        f"{per_op['reference'] * 1e6:.2f} µs; placements "
        + ("agree with the reference's" if agree else "DIFFER from the reference's"),
    )
    benchmark.extra_info["placements_agree"] = agree
    report(benchmark, capsys, "ring_lookup_us", per_op["HashRing"] * 1e6, INFORMATIONAL)
    report(
        benchmark,
        capsys,
        "ring_lookup_speed_vs_reference",
        per_op["reference"] / per_op["HashRing"],
        "~1",
    )


# --- near hit against a round trip -----------------------------------------------------


@pytest.mark.extended
def test_bench_stage3_near_hit_vs_round_trip(
    benchmark: Any,
    kata: Any,
    stage_module: ModuleType,
    reference: ModuleType,
    reference_lru: Any,
    bench_env: RedisEnv,
    clients: dict[str, redis.Redis],
    scale: Scale,
    capsys: pytest.CaptureFixture[str],
) -> None:
    benchmark.group = "stage3 NearCache hit vs ShardedCache.get of the same key (interleaved)"
    key = "system-prompt"
    mine = near_cache(
        stage_module,
        sharded(stage_module, bench_env, clients, channel=CHANNEL),
        kata.stage(1).LRUCache(LOCAL_SIZE),
    )
    theirs = near_cache(
        reference,
        sharded(reference, bench_env, clients, channel=CHANNEL),
        reference_lru(LOCAL_SIZE),
    )
    for near in (mine, theirs):
        near.put(key, VALUE)
        assert near.get(key) == VALUE  # the miss that fills the local cache
    per_op = interleaved(
        benchmark,
        {
            "near hit": repeat(mine.get, key, scale.near_hits),
            "reference near hit": repeat(theirs.get, key, scale.near_hits),
            "ShardedCache.get": repeat(mine.remote.get, key, scale.remote_gets),
        },
        rounds=scale.rounds,
    )
    if math.isnan(per_op["near hit"]):
        return
    stats = mine.statistics()
    say(
        capsys,
        f"near hit {per_op['near hit'] * 1e6:.2f} µs; reference near hit "
        f"{per_op['reference near hit'] * 1e6:.2f} µs; ShardedCache.get "
        f"{per_op['ShardedCache.get'] * 1e6:.1f} µs; near statistics: {stats.hits:,} hits, "
        f"{stats.misses} misses   [{where(bench_env)}]",
    )
    report(
        benchmark,
        capsys,
        "near_hit_speedup_vs_remote_get",
        per_op["ShardedCache.get"] / per_op["near hit"],
        INFORMATIONAL,
    )
    report(
        benchmark,
        capsys,
        "near_hit_speed_vs_reference",
        per_op["reference near hit"] / per_op["near hit"],
        "~1",
    )


# --- the price of publishing writes ----------------------------------------------------


def puts(cache: Any, n: int) -> Contender:
    """``n`` puts a round, over ``n`` keys (the same ones every round)."""
    keys = [f"w{i}" for i in range(n)]
    put = cache.put

    def run() -> None:
        for key in keys:
            put(key, VALUE)

    return Contender(run, n)


@pytest.mark.extended
def test_bench_stage3_write_price_of_publishing(
    benchmark: Any,
    stage_module: ModuleType,
    reference: ModuleType,
    bench_env: RedisEnv,
    clients: dict[str, redis.Redis],
    scale: Scale,
    capsys: pytest.CaptureFixture[str],
) -> None:
    benchmark.group = "stage3 put: ShardedCache(channel=) vs plain, 2 replicas (interleaved)"
    per_op = interleaved(
        benchmark,
        {
            "put, channel=": puts(
                sharded(stage_module, bench_env, clients, channel=CHANNEL), scale.puts
            ),
            "put, plain": puts(sharded(stage_module, bench_env, clients), scale.puts),
            "reference put, channel=": puts(
                sharded(reference, bench_env, clients, channel=CHANNEL), scale.puts
            ),
        },
        rounds=scale.rounds,
    )
    if math.isnan(per_op["put, channel="]):
        return
    say(
        capsys,
        "µs per put (one write per replica): "
        + ", ".join(f"{name} {s * 1e6:.0f}" for name, s in per_op.items())
        + f"   [{where(bench_env)}]",
    )
    report(
        benchmark,
        capsys,
        "publishing_put_cost_over_plain",
        per_op["put, channel="] / per_op["put, plain"],
        INFORMATIONAL,
    )
    report(
        benchmark,
        capsys,
        "publishing_put_speed_vs_reference",
        per_op["reference put, channel="] / per_op["put, channel="],
        "~1",
    )


# --- Zipf reads through a near cache ---------------------------------------------------


@functools.cache
def zipf_keys(n: int) -> list[str]:
    """``n`` draws of Zipf(ZIPF_S) over ZIPF_KEYS keys (ranks shuffled onto the names)."""
    cum = list(accumulate(1 / r**ZIPF_S for r in range(1, ZIPF_KEYS + 1)))
    names = [f"doc:{i}" for i in range(ZIPF_KEYS)]
    random.Random(2).shuffle(names)
    return [names[r] for r in random.Random(1).choices(range(ZIPF_KEYS), cum_weights=cum, k=n)]


def zipf_rounds(scale: Scale) -> tuple[list[str], list[list[str]]]:
    """The warm-up reads, then one chunk of reads a round (and one for the warm-up round)."""
    n = scale.zipf_reads
    stream = zipf_keys(ZIPF_WARMUP + (scale.rounds + 1) * n)
    rest = stream[ZIPF_WARMUP:]
    return stream[:ZIPF_WARMUP], [rest[i : i + n] for i in range(0, len(rest), n)]


def filled(stage: ModuleType, env: RedisEnv, clients: dict[str, redis.Redis]) -> Any:
    """A publishing ShardedCache holding all ZIPF_KEYS keys (written by a plain one under
    the same prefix: plain SETs, so filling costs no scripts)."""
    prefix = env.fresh_prefix()
    plain = sharded(stage, env, clients, prefix=prefix)
    for i in range(ZIPF_KEYS):
        plain.put(f"doc:{i}", VALUE)
    return sharded(stage, env, clients, channel=CHANNEL, prefix=prefix)


def reads(get: Any, chunks: list[list[str]]) -> Contender:
    """Each round reads the next chunk of the stream (every contender runs once a round,
    so all of them read the same chunk in the same round)."""
    turn = [0]

    def run() -> None:
        keys = chunks[turn[0] % len(chunks)]
        turn[0] += 1
        for key in keys:
            get(key)

    return Contender(run, len(chunks[0]))


@pytest.mark.extended
def test_bench_stage3_zipf_reads_through_a_near_cache(
    benchmark: Any,
    kata: Any,
    stage_module: ModuleType,
    reference: ModuleType,
    reference_lru: Any,
    bench_env: RedisEnv,
    clients: dict[str, redis.Redis],
    scale: Scale,
    capsys: pytest.CaptureFixture[str],
) -> None:
    benchmark.group = "stage3 Zipf(1.25) reads over 5 000 keys, NearCache LRU(500) (interleaved)"
    warmup, chunks = zipf_rounds(scale)
    mine_remote = filled(stage_module, bench_env, clients)
    mine = near_cache(stage_module, mine_remote, kata.stage(1).LRUCache(LOCAL_SIZE))
    theirs = near_cache(reference, filled(reference, bench_env, clients), reference_lru(LOCAL_SIZE))
    assert mine_remote.get(warmup[0]) == VALUE
    nears = {"NearCache": mine, "reference NearCache": theirs}
    for near in nears.values():  # untimed: the local caches hold their steady state
        for key in warmup:
            near.get(key)
    before = {name: near.statistics() for name, near in nears.items()}
    per_op = interleaved(
        benchmark,
        {
            "NearCache": reads(mine.get, chunks),
            "reference NearCache": reads(theirs.get, chunks),
            "bare ShardedCache": reads(mine_remote.get, chunks),
        },
        rounds=scale.rounds,
    )
    if math.isnan(per_op["NearCache"]):
        return
    hit_rates: dict[str, float] = {}
    for name, near in nears.items():  # over every timed round (the warm-up round too)
        after = near.statistics()
        hits = after.hits - before[name].hits
        misses = after.misses - before[name].misses
        hit_rates[name] = hits / (hits + misses)
        benchmark.extra_info[f"hit_rate[{name}]"] = round(hit_rates[name], 4)
    agree = len({round(rate, 6) for rate in hit_rates.values()}) == 1
    say(
        capsys,
        "reads/s: "
        + ", ".join(f"{name} {1 / s:,.0f}" for name, s in per_op.items())
        + "; hit rate: "
        + ", ".join(f"{name} {rate:.4f}" for name, rate in hit_rates.items())
        + ("   (agree)" if agree else "   DISAGREE")
        + f"   [{where(bench_env)}]",
    )
    report(benchmark, capsys, "near_zipf_hit_rate", hit_rates["NearCache"], INFORMATIONAL)
    report(
        benchmark,
        capsys,
        "near_zipf_speedup_vs_bare",
        per_op["bare ShardedCache"] / per_op["NearCache"],
        INFORMATIONAL,
    )
    report(
        benchmark,
        capsys,
        "near_zipf_speed_vs_reference",
        per_op["reference NearCache"] / per_op["NearCache"],
        "~1",
    )


@pytest.mark.extended
def test_bench_stage3_zipf_reads_vs_redis_py_client_cache(
    benchmark: Any,
    kata: Any,
    stage_module: ModuleType,
    bench_env: RedisEnv,
    clients: dict[str, redis.Redis],
    scale: Scale,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if bench_env.mode == "fakeredis":
        pytest.skip("redis-py's client-side cache needs a real server (KATA_REDIS_SERVER)")
    # redis-py refuses servers before 7.4 "to maximize compatibility with all Redis
    # products"; the tracking it relies on (CLIENT TRACKING, RESP3 pushes) is Redis 6's,
    # and Debian 12 ships 7.0. Let it run on the server this machine has.
    cache = pytest.importorskip("redis.cache", reason="redis-py's client cache: redis-py 5.1+")
    monkeypatch.setattr(redis.connection.CacheProxyConnection, "MIN_ALLOWED_VERSION", "6.0.0")
    benchmark.group = "stage3 Zipf(1.25) reads, NearCache LRU(500) vs redis-py cache(500)"
    warmup, chunks = zipf_rounds(scale)
    mine = near_cache(
        stage_module, filled(stage_module, bench_env, clients), kata.stage(1).LRUCache(LOCAL_SIZE)
    )
    node = bench_env.server()
    prefix, encoded = bench_env.fresh_prefix(), json.dumps(VALUE)
    node.client().mset({f"{prefix}doc:{i}": encoded for i in range(ZIPF_KEYS)})
    cached = node.client(protocol=3, cache_config=cache.CacheConfig(max_size=LOCAL_SIZE))

    def peer_get(key: str) -> Any:
        raw = cached.get(prefix + key)
        return None if raw is None else json.loads(raw)

    assert mine.get(warmup[0]) == peer_get(warmup[0]) == VALUE
    for key in warmup:  # untimed: both local caches hold their steady state
        mine.get(key)
        peer_get(key)
    per_op = interleaved(
        benchmark,
        {"NearCache": reads(mine.get, chunks), "redis-py cache": reads(peer_get, chunks)},
        rounds=scale.rounds,
    )
    if math.isnan(per_op["NearCache"]):
        return
    say(
        capsys,
        "reads/s: "
        + ", ".join(f"{name} {1 / s:,.0f}" for name, s in per_op.items())
        + f"   [{where(bench_env)}]",
    )
    report(
        benchmark, capsys, "near_zipf_rate_vs_redis_py_cache",
        per_op["redis-py cache"] / per_op["NearCache"], ">= 1.0",
    )  # fmt: skip
