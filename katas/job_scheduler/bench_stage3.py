"""Stage 3 benchmarks: the Redis queue against the least its round trips can cost.

Collected only when this file is named on the command line (the suites are
``test_*.py``; ``pytest katas/job_scheduler -k stage3`` never picks this file up)::

    KATA_REDIS_SERVER=redis-server \\
        pytest katas/job_scheduler/bench_stage3.py --impl=solutions --benchmark-only -q

The Redis is the suites' (``katas/_harness/redis.py``): **fakeredis by default**, where
this file is only a smoke run with small sizes — its cost is fakeredis's Python and
Lua emulation, not a server, so its numbers and ratios mean nothing.
``KATA_REDIS_SERVER=redis-server`` starts a private real server for the file (the only
mode whose numbers mean something); ``KATA_REDIS_URL`` points at an external one.
Client and server share the machine, so on a small or shared one (2 cores here) the
server's script time and the client's encoding compete for the same cores.

Each group runs its contenders — the implementation under test (``--impl``), the
reference and a floor — in turn within every round (each round starting with the next
one), so that drift on a shared machine hits them alike, and reports the ratios of
their best rounds in ``extra_info`` (``--benchmark-json``, which ``kata bench`` reads)
and on stdout (printed even without ``-s``). The spec's targets — informational,
benchmarks never fail CI (nothing here asserts a ratio or a count):

- one round trip per transition — enqueue, claim, heartbeat, commit, ack, nack —
  counted by a :class:`~katas._harness.faultproxy.FaultProxy` after a warm-up cycle that
  loads the scripts: exactly 1.00 each.
- claim + ack with 1 000 jobs queued: >= 0.8x the cycles/s of a bare floor of two
  trivial ``EVALSHA`` calls per cycle (an ``INCR``, then an ``HSET`` of its result —
  the least two round trips can cost) on a real server.
- enqueue against a bare one-line ``EVALSHA`` (``INCR``): no spec target, reported.
- growth: claim + ack with 64x the jobs queued over 1x; no spec target — claim is
  O(log n) (a sorted-set pop), so it stays near 1x, and a scan of the queue shows up
  as tens of x.
- against huey (``RedisHuey``), the Redis-backed queue a Python user would otherwise
  pick for background jobs: a job's whole life, enqueue → dequeue → finish, three round
  trips on either side (huey: ``LPUSH``, ``BRPOP``, the result's ``HSET``; the queue:
  enqueue, claim, ack) on the same server in the same run; its target: at least huey's
  jobs/s. The work differs in the queue's favour of guarantees, not speed: huey's
  dequeue pops the job, so a worker that dies before finishing loses it, and nothing
  fences a stalled worker; the queue's claim is a lease that expires back into the
  queue, every transition is checked against its fencing token, and a failure is
  retried with backoff up to a dead-letter state.

Measured here on the real server (2 shared cores, loopback): the reference takes one
round trip per transition and reaches 0.45-0.55x the two-script floor on claim + ack
and about 0.4-0.6x the one-script floor on enqueue; the 64x queue costs 0.9-1.0x. Where
the time goes (INFO commandstats, 2 000 calls each): a claim runs ~44 µs on the server
and an ack ~75 µs, against ~4.6 µs for a floor script given the same 13 keys and
arguments. The shared prelude alone costs ~23 µs: ~10 µs for TIME, the ``ops`` counter
and the ``wake``/``gen`` read, ~8 µs for building its 24 local functions and the
attribute table anew on every call (an ``EVALSHA`` runs the whole script each time).
An ack also moves the job's 15 fields from ``jobs`` to ``done`` (HMGET, HSET, HDEL)
and sets three TTLs. The client encodes 13 keys and 3-5 arguments per call. Reaching
0.8x needs about 100 µs off a cycle, so a new layout (one field per job, moved whole)
and Redis Functions (helpers built once, at load) rather than trimming.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import pytest
import redis

from katas._harness.bench import Contender, capped_rounds, interleaved, report, say
from katas._harness.redis import RedisEnv
from katas._registry import impl as _impl
from katas.job_scheduler.api import NS_PER_S, Lease, RetryPolicy

pytestmark = [pytest.mark.stage(3)]

#: The floor's scripts: the least one round trip to a script can cost.
TAKE = "return redis.call('INCR', KEYS[1])"
FINISH = "return redis.call('HSET', KEYS[1], 'last', ARGV[1])"
TRANSITIONS = ("enqueue", "claim", "heartbeat", "commit", "ack", "nack")


@dataclass(frozen=True)
class Scale:
    """How much work a benchmark does: full on a real server, a smoke run on fakeredis."""

    ops: int  # claim+ack cycles (or enqueues) per round
    rounds: int
    queued: int  # jobs queued before the claim+ack rounds (the growth test's 1x)
    lifecycles: int  # lifecycles counted through the proxy


@pytest.fixture(scope="module")
def bench_env() -> Iterator[RedisEnv]:
    """One Redis for the whole file (every contender on the same server), chosen as for
    the suites: fakeredis, or ``KATA_REDIS_SERVER`` / ``KATA_REDIS_URL``."""
    with RedisEnv.from_environment(name="bench") as env:
        yield env


@pytest.fixture(scope="module")
def scale(bench_env: RedisEnv) -> Scale:
    if bench_env.mode == "fakeredis":
        return Scale(ops=50, rounds=3, queued=50, lifecycles=10)
    return Scale(ops=500, rounds=15, queued=1_000, lifecycles=200)


@pytest.fixture(scope="module")
def reference() -> ModuleType:
    """The reference stage 3, whatever ``--impl`` says."""
    return _impl.resolve("solutions").stage("job_scheduler", 3)


def where(env: RedisEnv) -> str:
    if env.mode == "fakeredis":
        return "fakeredis — numbers mean nothing; KATA_REDIS_SERVER=redis-server for real ones"
    return f"{env.mode} (real Redis on loopback, sharing this machine's cores)"


def on_a_real_server(env: RedisEnv, target: str) -> str:
    """A spec target, which holds on a real server only: fakeredis's numbers mean nothing."""
    where = f"{target} on a real server"
    return f"none on fakeredis ({where})" if env.mode == "fakeredis" else where


def priorities(n: int) -> list[int]:
    return [random.Random(7 + i).randrange(10) for i in range(n)]


def new_queue(stage: ModuleType, env: RedisEnv, client: redis.Redis | None = None) -> Any:
    """A queue under a fresh prefix whose leases never expire during a run, with the
    default retention (a day), as a service runs it: finished jobs are kept, so no call
    in the timed rounds has anything due to settle."""
    return stage.RedisJobQueue(
        env.client() if client is None else client,
        lease_ns=3_600 * NS_PER_S,
        retry=RetryPolicy(NS_PER_S, 60 * NS_PER_S),
        max_attempts=3,
        rng=random.Random(1),
        key_prefix=env.fresh_prefix(),
    )


def server_us_per_call(
    env: RedisEnv, run: Callable[[], object], setup: Callable[[], object] | None
) -> float | None:
    """On a private server, the server's own µs per ``EVALSHA`` during one more ``run``
    (INFO commandstats before and after): what the scripts cost without the client and
    the network. None in the other modes."""
    if env.mode != "server":
        return None
    if setup is not None:
        setup()
    admin = env.client()

    def stats() -> tuple[float, float]:
        row = admin.info("commandstats").get("cmdstat_evalsha", {})
        return float(row.get("calls", 0)), float(row.get("usec", 0))

    calls0, usec0 = stats()
    run()
    calls1, usec1 = stats()
    return (usec1 - usec0) / (calls1 - calls0) if calls1 > calls0 else None


# --- claim + ack runs ------------------------------------------------------------------


def claim_ack_run(
    stage: ModuleType, env: RedisEnv, scale: Scale, queued: int
) -> tuple[Callable[[], None], Callable[[], None]]:
    """``(run, top_up)``: a queue holding ``queued`` READY jobs; ``run`` claims and acks
    ``scale.ops`` of them, ``top_up`` (untimed, before every round) enqueues as many, so
    the queue keeps its size and never runs dry."""
    queue = new_queue(stage, env)
    for i, p in enumerate(priorities(queued)):
        queue.enqueue(i, priority=p)
    work = priorities(scale.ops)
    enqueue, claim, ack = queue.enqueue, queue.claim, queue.ack

    def top_up() -> None:
        for p in work:
            enqueue(p, priority=p)

    def run() -> None:
        for _ in work:
            ack(claim("w"))

    return run, top_up


def two_script_run(env: RedisEnv, scale: Scale) -> Callable[[], None]:
    """The floor: per cycle, one ``INCR`` script, then one ``HSET`` of its result."""
    client = env.client()
    prefix = env.fresh_prefix()
    take, finish = client.register_script(TAKE), client.register_script(FINISH)
    counter, done = [prefix + "seq"], [prefix + "done"]

    def run() -> None:
        for _ in range(scale.ops):
            n = take(keys=counter, client=client)
            finish(keys=done, args=[n], client=client)

    return run


# --- round trips per transition, through the counting proxy ----------------------------


@pytest.mark.extended  # heartbeat is stage 3's extended part
def test_bench_stage3_round_trips_per_transition(
    benchmark: Any,
    stage_module: ModuleType,
    bench_env: RedisEnv,
    scale: Scale,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Each lifecycle: enqueue, claim, heartbeat, commit, ack; enqueue, claim, nack — each
    step's round trips counted by the proxy (its latency is the proxy's, not Redis's)."""
    benchmark.group = "stage3 one job lifecycle through the counting proxy"
    proxy = bench_env.proxy()
    queue = new_queue(stage_module, bench_env, bench_env.server().proxied_client(proxy))
    store = stage_module.RedisEffectStore(queue)
    trips: dict[str, list[int]] = {name: [] for name in TRANSITIONS}
    commands: set[str] = set()

    def step(name: str, call: Callable[[], Any]) -> Any:
        proxy.reset_counts()
        out = call()
        counts = proxy.counts()
        trips[name].append(counts.round_trips)
        commands.update(counts.commands)
        return out

    def lifecycle() -> None:
        step("enqueue", lambda: queue.enqueue("a"))
        lease: Lease = step("claim", lambda: queue.claim("w"))
        lease = step("heartbeat", lambda: queue.heartbeat(lease))
        step("commit", lambda: store.commit(lease, 1))
        step("ack", lambda: queue.ack(lease, 1))
        step("enqueue", lambda: queue.enqueue("b"))
        failed: Lease = step("claim", lambda: queue.claim("w"))
        step("nack", lambda: queue.nack(failed, "boom"))

    lifecycle()  # warm-up: loads every script (NOSCRIPT, then SCRIPT LOAD)
    for counted in trips.values():
        counted.clear()
    commands.clear()
    benchmark.pedantic(
        lifecycle, rounds=capped_rounds(scale.lifecycles), iterations=1, warmup_rounds=0
    )

    others = sorted(commands - {"EVALSHA"})
    say(
        capsys,
        "round trips per transition, counted by the proxy"
        + (f"; commands besides EVALSHA: {', '.join(others)}" if others else "")
        + f"   [{where(bench_env)}]",
    )
    for name, counted in trips.items():
        if counted:
            report(
                benchmark, capsys, f"round_trips_per_{name}", sum(counted) / len(counted), "== 1"
            )


# --- claim + ack, against two bare scripts ---------------------------------------------


@pytest.mark.core
def test_bench_stage3_claim_ack(
    benchmark: Any,
    stage_module: ModuleType,
    reference: ModuleType,
    bench_env: RedisEnv,
    scale: Scale,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The ratios: floor, reference and queue in turn within every round."""
    benchmark.group = "stage3 claim+ack, 1 000 queued (interleaved: floor, reference, queue)"
    ours = claim_ack_run(stage_module, bench_env, scale, scale.queued)
    floor = two_script_run(bench_env, scale)
    theirs = claim_ack_run(reference, bench_env, scale, scale.queued)
    best = interleaved(
        benchmark,
        {
            "queue": Contender(ours[0], scale.ops, setup=ours[1]),
            "two_scripts": Contender(floor, scale.ops),
            "reference": Contender(theirs[0], scale.ops, setup=theirs[1]),
        },
        rounds=scale.rounds,
    )
    queue = best["queue"]
    if math.isnan(queue):  # --benchmark-disable: nothing was measured
        return
    say(
        capsys,
        f"claim+ack: {1 / queue:,.0f} cycles/s; two bare scripts {1 / best['two_scripts']:,.0f}"
        f"/s; reference {1 / best['reference']:,.0f}/s   [{where(bench_env)}]",
    )
    report(
        benchmark,
        capsys,
        "rate_vs_two_scripts",
        best["two_scripts"] / queue,
        on_a_real_server(bench_env, ">= 0.80"),
    )
    report(benchmark, capsys, "speed_vs_reference", best["reference"] / queue, "~1")
    ours_us = server_us_per_call(bench_env, *ours)
    floor_us = server_us_per_call(bench_env, floor, None)
    if ours_us is not None and floor_us is not None:
        benchmark.extra_info["server_us_per_script"] = round(ours_us, 1)
        benchmark.extra_info["server_us_per_floor_script"] = round(floor_us, 1)
        say(capsys, f"server time per script call: queue {ours_us:.1f} µs, floor {floor_us:.1f} µs")


# --- enqueue, against one bare script --------------------------------------------------


def enqueue_run(stage: ModuleType, env: RedisEnv, scale: Scale) -> Callable[[], None]:
    """Each call enqueues ``scale.ops`` jobs (the queue grows by that much per round)."""
    queue = new_queue(stage, env)
    work = priorities(scale.ops)
    enqueue = queue.enqueue

    def run() -> None:
        for p in work:
            enqueue(p, priority=p)

    return run


def one_script_run(env: RedisEnv, scale: Scale) -> Callable[[], None]:
    """The floor: one ``INCR`` script per enqueue."""
    client = env.client()
    take, counter = client.register_script(TAKE), [env.fresh_prefix() + "seq"]

    def run() -> None:
        for _ in range(scale.ops):
            take(keys=counter, client=client)

    return run


@pytest.mark.core
def test_bench_stage3_enqueue(
    benchmark: Any,
    stage_module: ModuleType,
    reference: ModuleType,
    bench_env: RedisEnv,
    scale: Scale,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The ratios: floor, reference and queue in turn within every round."""
    benchmark.group = "stage3 enqueue (interleaved: floor, reference, queue)"
    best = interleaved(
        benchmark,
        {
            "queue": Contender(enqueue_run(stage_module, bench_env, scale), scale.ops),
            "one_script": Contender(one_script_run(bench_env, scale), scale.ops),
            "reference": Contender(enqueue_run(reference, bench_env, scale), scale.ops),
        },
        rounds=scale.rounds,
    )
    queue = best["queue"]
    if math.isnan(queue):  # --benchmark-disable: nothing was measured
        return
    say(
        capsys,
        f"enqueue: {1 / queue:,.0f} jobs/s; one bare script {1 / best['one_script']:,.0f}/s; "
        f"reference {1 / best['reference']:,.0f}/s   [{where(bench_env)}]",
    )
    report(
        benchmark,
        capsys,
        "enqueue_rate_vs_one_script",
        best["one_script"] / queue,
        "none in the spec; informational",
    )
    report(benchmark, capsys, "enqueue_speed_vs_reference", best["reference"] / queue, "~1")


# --- growth: claim + ack as the queue grows --------------------------------------------


@pytest.mark.core
def test_bench_stage3_claim_ack_as_the_queue_grows(
    benchmark: Any,
    stage_module: ModuleType,
    bench_env: RedisEnv,
    scale: Scale,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """1 000 and 64 000 jobs queued on a real server (50 and 3 200 on fakeredis)."""
    benchmark.group = "stage3 claim+ack, 1x and 64x queued (interleaved)"
    small = claim_ack_run(stage_module, bench_env, scale, scale.queued)
    big = claim_ack_run(stage_module, bench_env, scale, 64 * scale.queued)
    per_op = interleaved(
        benchmark,
        {
            "claim+ack 1x": Contender(small[0], scale.ops, setup=small[1]),
            "claim+ack 64x": Contender(big[0], scale.ops, setup=big[1]),
        },
        rounds=scale.rounds,
    )
    if math.isnan(per_op["claim+ack 1x"]):
        return
    report(
        benchmark,
        capsys,
        "cost_64x_over_1x",
        per_op["claim+ack 64x"] / per_op["claim+ack 1x"],
        "none in the spec; O(log n) claim stays near 1",
    )


# --- against huey: a job's whole life ----------------------------------------------------


def lifecycle_run(stage: ModuleType, env: RedisEnv, scale: Scale) -> Callable[[], None]:
    """Per job: enqueue, claim, ack — every job claimed as soon as it is queued."""
    queue = new_queue(stage, env)
    enqueue, claim, ack = queue.enqueue, queue.claim, queue.ack

    def run() -> None:
        for i in range(scale.ops):
            enqueue(i)
            ack(claim("w"))

    return run


def huey_run(env: RedisEnv, scale: Scale) -> Callable[[], None]:
    """Per job: enqueue (calling the task), dequeue, execute (which stores its result),
    as huey's consumer does it, through a client of the same server made as the queue's."""
    huey_lib = pytest.importorskip("huey", reason="the anchors come with `pip install -e .[bench]`")
    pool = env.client().connection_pool
    huey = huey_lib.RedisHuey(env.fresh_prefix(), connection_pool=pool)

    @huey.task()  # type: ignore[untyped-decorator]
    def job(i: int) -> int:
        return i

    def run() -> None:
        for i in range(scale.ops):
            job(i)
            huey.execute(huey.dequeue())

    return run


@pytest.mark.core
def test_bench_stage3_lifecycle_vs_huey(
    benchmark: Any,
    stage_module: ModuleType,
    bench_env: RedisEnv,
    scale: Scale,
    capsys: pytest.CaptureFixture[str],
) -> None:
    benchmark.group = "stage3 enqueue+claim+ack vs huey (interleaved)"
    best = interleaved(
        benchmark,
        {
            "queue": Contender(lifecycle_run(stage_module, bench_env, scale), scale.ops),
            "huey": Contender(huey_run(bench_env, scale), scale.ops),
        },
        rounds=scale.rounds,
    )
    if math.isnan(best["queue"]):
        return
    say(
        capsys,
        f"a job's life: {1 / best['queue']:,.0f} jobs/s; huey {1 / best['huey']:,.0f}/s   "
        f"[{where(bench_env)}]",
    )
    report(
        benchmark, capsys, "lifecycle_rate_vs_huey", best["huey"] / best["queue"],
        on_a_real_server(bench_env, ">= 1.0"),
    )  # fmt: skip
