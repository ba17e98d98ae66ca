"""Stage 3 suite, the queue on a Redis Cluster (see katas/job_scheduler/README.md, "On a
Redis Cluster").

Map: every key a call writes is one its script declared in KEYS (declared-keys; on every
Redis, fakeredis included: the client's own EVALSHA arguments are compared with what
changed under the test's prefix) · on a real cluster of the test's own (``redis_cluster``:
skipped unless ``KATA_REDIS_CLUSTER`` or ``KATA_REDIS_SERVER`` names a ``redis-server``)
— a cluster client accepted and a retrying one refused, the queue in one slot
(cluster-client, hash-tag-slot) · the queue's slot moved step by step (MIGRATING and
IMPORTING, keys moved a few at a time, SETSLOT) while several clients work, replayed in
op order through the exact model; a queue holding every kind of key, its slot just
MIGRATING, where no call may run halfway; a worker riding it out (cluster-reshard) · the
queue's master killed and started again empty (dead-master) · the cluster in ``fail``
state, every call an unavailability (cluster-down).

Time: the declared-keys walk freezes fakeredis's clock and moves it (on a real server it
waits, at most 301 ms a step); the cluster tests run on real time and wait only for the
cluster (a master to be seen failing, a slot's TRYAGAIN), every wait with a deadline. The
whole stage-3 suite also runs on a shared cluster with ``KATA_REDIS_CLUSTER=redis-server``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import redis
from redis.crc import key_slot

from katas._harness.marks import core, extended, rule
from katas._harness.redis import RedisEnv
from katas._harness.redis_cluster import LocalCluster
from katas._harness.story import check, expect, not_refused
from katas._harness.under_test import stage
from katas._harness.waiting import eventually, spawn
from katas.job_scheduler._testing.cluster import (
    Traffic,
    cluster_queue,
    declared,
    every_call,
    record_scripts,
)
from katas.job_scheduler._testing.redis_queues import (
    MS,
    claim,
    effect_store,
    fail_fast_on_redis_stubs,  # noqa: F401 (autouse)
    new_queue,
)
from katas.job_scheduler._testing.replay import Replay, model_for
from katas.job_scheduler._testing.states import READY, SUCCEEDED
from katas.job_scheduler.api import (
    JobNotFound,
    Lease,
    RetryPolicy,
    SharedJobQueue,
    StaleLease,
    Worker,
    unavailable,
)

pytestmark = [pytest.mark.stage(3)]

#: Long enough never to run out while a test waits for the cluster.
CLUSTER_LEASE = 30_000 * MS
NO_RETRY_DELAY = RetryPolicy(0, 0, "none")


@rule("declared-keys")
@core
@pytest.mark.realtime
def test_stage3_every_key_a_call_writes_is_declared_to_its_script(redis_env: RedisEnv) -> None:
    """A walk through every call and every path a script settles by (a lease expiring into
    a retry and into a death, a delayed job coming due, retention, an idempotency record
    expiring). After each call, every key under the queue's prefix that it created,
    changed or deleted must be among the KEYS its script declared — the client's own
    EVALSHA arguments say which."""
    redis_env.freeze_time()
    client = redis_env.client()
    sent = record_scripts(client)
    queue = new_queue(
        redis_env, client, lease_ns=300 * MS, retry=RetryPolicy(10 * MS, 10 * MS, "none"),
        max_attempts=2, retention_ns=100 * MS, dedup_ttl_ns=100 * MS,
    )  # fmt: skip
    store = effect_store(queue)
    steps: list[str] = []
    leases: dict[str, Lease] = {}

    def call(what: str, act: Callable[[], Any]) -> Any:
        before = redis_env.contents()
        sent.clear()
        try:
            got: Any = act()
        except (StaleLease, JobNotFound) as e:
            got = type(e).__name__
        after = redis_env.contents()
        changed = {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}
        keys, scripts = declared(sent)
        steps.append(f"  {what} -> {got}")
        check(
            changed <= keys,
            f"{what} changed keys its script did not declare in KEYS: "
            f"{sorted(changed - keys)} (it declared {sorted(keys)} in {scripts} script "
            "call(s)). Redis Cluster routes a script by the keys it declares and, while the "
            "queue's slot moves, checks that this node holds them: a key built inside the "
            "script goes unseen. The calls so far:\n" + "\n".join(steps),
        )
        return got

    def wait(ms: int) -> None:
        redis_env.pass_time(ms * MS)
        steps.append(f"  ({ms} ms pass)")

    a = call("enqueue a (key k1)", lambda: queue.enqueue("a", idempotency_key="k1"))
    call("enqueue b (in 250 ms)", lambda: queue.enqueue("b", delay_ns=250 * MS))
    c = call("enqueue c (priority 1)", lambda: queue.enqueue("c", priority=1))
    call("enqueue a again (key k1)", lambda: queue.enqueue("a'", idempotency_key="k1"))
    leases["c"] = call("claim (c)", lambda: claim(queue))
    leases["c"] = call("heartbeat c", lambda: queue.heartbeat(leases["c"]))
    call("commit c's effect", lambda: store.commit(leases["c"], "c done"))
    call("ack c", lambda: queue.ack(leases["c"], "ok"))
    leases["a"] = call("claim (a)", lambda: claim(queue))
    call("is_current a", lambda: queue.is_current(leases["a"]))
    call("nack a (retry in 10 ms)", lambda: queue.nack(leases["a"], "503"))
    wait(20)
    call("get a (due again: settled to READY)", lambda: queue.get(a).state)
    leases["a"] = call("claim (a, attempt 2)", lambda: claim(queue))
    call("release a", lambda: queue.release(leases["a"]))
    call("cancel a (READY)", lambda: queue.cancel(a))
    wait(250)  # b is due
    leases["b"] = call("claim (b: its delay settled)", lambda: claim(queue))
    wait(301)  # b's lease runs out
    call("reap (b's expiry: a retry)", queue.reap)
    wait(20)
    leases["b"] = call("claim (b, attempt 2)", lambda: claim(queue))
    wait(301)
    call("next_due_ns (b's expiry: b dies)", queue.next_due_ns)
    call("dead_letters", queue.dead_letters)
    b = leases["b"].job_id
    call("redrive b", lambda: queue.redrive(b))
    call("enqueue d (key k1, expired)", lambda: queue.enqueue("d", idempotency_key="k1"))
    call("statistics", queue.statistics)
    call("effects", store.effects)
    wait(101)  # c and a are past their retention
    call("get c (forgotten)", lambda: queue.get(c))
    cancelled = call("cancel b (READY)", lambda: queue.cancel(b))
    call("the zombie's ack on b", lambda: queue.ack(leases["b"]))
    expect(cancelled, True, "the walk's last cancel: b, redriven, was READY")


# --- on a real cluster of the test's own ---------------------------------------------------


@rule("cluster-client", "hash-tag-slot")
@core
def test_stage3_a_cluster_client_is_accepted_and_a_retrying_one_refused(
    redis_cluster: LocalCluster,
) -> None:
    """Two queues on a cluster client run a job each, every key of a queue in one slot;
    the same cluster reached by a client with redis-py's default retries is refused."""
    from redis.cluster import RedisCluster

    queues: dict[str, SharedJobQueue] = {}
    for name in ("emails", "thumbnails"):
        with not_refused(
            "a RedisCluster (with a socket timeout and no retries) is accepted wherever a "
            "redis.Redis is, by RedisJobQueue too",
            TypeError,
        ):
            queues[name] = cluster_queue(
                redis_cluster, "q1:", name=name, lease_ns=CLUSTER_LEASE, retry=NO_RETRY_DELAY
            )
    for name, queue in queues.items():
        job_id = queue.enqueue({"queue": name})
        lease = claim(queue, "w1")
        check(
            effect_store(queue).commit(lease, name) is True,
            f"a RedisCluster with a socket timeout and no retries is accepted where a "
            f"redis.Redis is: on queue {name!r}, the claimed job's effect is committed",
        )
        queue.ack(lease, "done")
        expect(queue.get(job_id).state, SUCCEEDED, f"queue {name!r}: the job, acked")
        keys = redis_cluster.keys(f"q1:{{{name}}}")
        slots = {key_slot(k.encode()) for k in keys}
        check(
            len(slots) == 1,
            f"every key of queue {name!r} is in one slot (its name is the hash tag); they are "
            f"in slots {sorted(slots)}: {keys}",
        )
    host, port = redis_cluster.addresses()[0].split(":")
    retrying = RedisCluster(host=host, port=int(port), socket_timeout=2)  # redis-py retries
    try:
        with pytest.raises(ValueError, match="client"):
            cluster_queue(redis_cluster, "q1:", retrying, lease_ns=CLUSTER_LEASE,
                          retry=NO_RETRY_DELAY)  # fmt: skip
            raise AssertionError(
                "RedisJobQueue over a RedisCluster that keeps redis-py's default retries "
                "was accepted: a reply lost after a script ran would run it again"
            )
    finally:
        retrying.close()


@rule("cluster-reshard", "declared-keys", "op-order")
@core
def test_stage3_a_reshard_mid_traffic_loses_nothing_and_numbers_nothing_twice(
    redis_cluster: LocalCluster,
) -> None:
    """Three clients (a connection and a queue object each) make random calls in rounds;
    between two rounds the queue's slot takes one step of a reshard, as ``redis-cli
    --cluster reshard`` does it. Every call either ran — and then, sorted by op, the exact
    model gives what it gave — or raised an unavailability having run nowhere."""
    options: dict[str, Any] = {
        "lease_ns": CLUSTER_LEASE, "retry": NO_RETRY_DELAY, "max_attempts": 3,
    }  # fmt: skip
    traffic = Traffic([cluster_queue(redis_cluster, "rs:", **options) for _ in range(3)], 7)
    traffic.round("before the move", 8)
    keys = redis_cluster.keys("rs:")
    slot = key_slot(keys[0].encode())
    source = redis_cluster.owner(slot)
    target = redis_cluster.other_master(source)
    redis_cluster.begin_migration(slot, target)
    traffic.round("the target IMPORTING, the owner MIGRATING", 3)
    _move_keys(redis_cluster, slot, target, 2)
    traffic.round("2 of the queue's keys moved", 3)
    _move_keys(redis_cluster, slot, target)
    traffic.round("the rest moved", 3)
    refused_while_moving = len(traffic.refused)
    redis_cluster.finish_migration(slot, target)
    traffic.round("the slot handed over (SETSLOT NODE)", 8)
    for n, leases in traffic.leases.items():  # finish what each client holds
        for lease in leases:
            traffic.call(n, "the drain", "ack", lease, "done")
    while (c := traffic.call(0, "the drain", "claim", "w0")) is not None and c.outcome[1]:
        traffic.call(0, "the drain", "commit", c.outcome[1], "drained")
        traffic.call(0, "the drain", "ack", c.outcome[1], "done")
    story = (
        f"the queue's keys {keys} (slot {slot}) moved from port {source.port} to port "
        f"{target.port}; calls refused while it moved:\n  " + "\n  ".join(traffic.refused)
    )
    check(
        not traffic.errors,
        "while the queue's slot moves, a call either runs whole or raises an unavailability "
        "(TRYAGAIN, which redis-py raises as ClusterError once its tries run out): never "
        "another error. Raised:\n  " + "\n  ".join(traffic.errors) + "\n" + story,
    )
    expect(
        len(traffic.refused) - refused_while_moving, 0,
        "after the slot is handed over, redis-py follows MOVED: no call is refused\n" + story,
    )  # fmt: skip
    ops = sorted(c.stamp.op for c in traffic.calls)
    check(
        ops == list(range(1, len(ops) + 1)),
        "op numbers are issued once each, by the calls that ran: 1, 2, 3 … with no gap (a gap "
        "is a script that ran although its call was refused) and no repeat (a script run on "
        f"the empty target numbers from 1 again); got {ops}\n" + story,
    )
    replay = Replay(model_for(options), f"3 clients on RedisJobQueue({options}) during a reshard")
    replay.check_real_time_order(traffic.calls)
    for c in sorted(traffic.calls, key=lambda c: c.stamp.op):
        replay.check(c)
    queue = traffic.queues[0]
    expect(
        (queue.statistics().pending, effect_store(queue).effects()),
        (0, {replay.ids[seq]: effect for seq, effect in replay.effects.items()}),
        "after the reshard and the drain: no job pending, and each job's first committed "
        "effect, once\n" + story,
    )


@rule("cluster-reshard", "declared-keys")
@core
def test_stage3_a_migrating_slot_runs_no_call_halfway_on_a_queue_holding_every_key(
    redis_cluster: LocalCluster,
) -> None:
    """The queue holds a key of every kind — ready, leased, succeeded, cancelled and dead
    jobs, an idempotency record, and one delayed job, due, that the next call's settle
    moves (emptying its key) — when its slot starts migrating, no key moved yet. The old
    owner still holds every key a script reads or writes: each call, the reads included
    (they settle first), must either run whole or be refused having changed nothing."""
    queue = cluster_queue(
        redis_cluster, "ek:", lease_ns=CLUSTER_LEASE, retry=NO_RETRY_DELAY, max_attempts=1
    )
    queue.enqueue("acked")
    queue.ack(claim(queue), "ok")
    queue.enqueue("dead")
    queue.nack(claim(queue), "boom")
    queue.enqueue("leased")
    lease = claim(queue)
    queue.cancel(queue.enqueue("cancelled"))
    ready = queue.enqueue("ready", idempotency_key="k")
    keys = redis_cluster.keys("ek:")
    slot = key_slot(keys[0].encode())
    source = redis_cluster.owner(slot)
    target = redis_cluster.other_master(source)
    admin = source.client()
    queue.enqueue("due", delay_ns=20 * MS)
    enqueued_us = source.time_us()
    eventually(lambda: source.time_us() > enqueued_us + 20_000, "the delayed job to be due")
    held = redis_cluster.keys("ek:")
    redis_cluster.begin_migration(slot, target)
    wrong: list[str] = []
    for name, call in every_call(queue, lease, ready):
        keys = redis_cluster.keys("ek:")
        before = _dumps(admin, keys)
        try:
            call()
        except Exception as error:  # the test reports what escaped
            after, now = _dumps(admin, keys), redis_cluster.keys("ek:")
            changed = sorted({k for k in keys if before[k] != after[k]} | (set(now) - set(keys)))
            if not unavailable(error):
                wrong.append(f"{name} raised {type(error).__name__}: {error}")
            elif changed:
                wrong.append(
                    f"{name} was refused ({type(error).__name__}: {error}) but changed "
                    f"{[k.removeprefix('ek:') for k in changed]}: half a script ran"
                )
    check(
        not wrong,
        f"the queue's slot {slot} MIGRATING from port {source.port} to port {target.port}, "
        f"no key moved, the old owner holding all of {[k.removeprefix('ek:') for k in held]} "
        "and a delayed job due: Redis checks a script's declared keys once, before it runs, "
        "and every command inside it again — a command on a key the script itself emptied "
        "finds it 'moved' and fails the script halfway, its writes kept. A call must run "
        "whole or be refused having run nowhere (HINTS.md shows one way to keep scripts off "
        "a moving slot). Got:\n  " + "\n  ".join(wrong),
    )


def _dumps(owner: redis.Redis, keys: list[str]) -> dict[str, bytes | None]:
    """What the slot's owner holds of each key (None: gone — a migrating slot answers ASK
    for a key its owner does not hold)."""
    held: dict[str, bytes | None] = {}
    for key in keys:
        try:
            held[key] = owner.dump(key)
        except redis.exceptions.AskError:
            held[key] = None
    return held


@rule("cluster-reshard", "worker-outage", "busy-unavailable")
@extended
def test_stage3_a_worker_rides_out_a_reshard_of_its_queues_slot(
    redis_cluster: LocalCluster,
) -> None:
    """A worker's job is in its handler when the slot starts moving; it commits and acks
    with the queue's keys split between two masters, then the move ends. It never crashes,
    and every job is done once."""
    released = threading.Event()

    def handler(lease: Lease, payload: Any) -> Any:
        if payload == 0:
            released.wait(10)
        return payload

    events: list[tuple[str, str | None]] = []
    worker = _worker(redis_cluster, "rw:", handler, events)
    queue = cluster_queue(redis_cluster, "rw:", lease_ns=CLUSTER_LEASE, retry=NO_RETRY_DELAY)
    ids = [queue.enqueue(n) for n in range(6)]
    thread = spawn(lambda: worker.run(max_jobs=6), "cluster-worker")
    eventually(lambda: ("claimed", ids[0]) in events, "the worker to claim the first job")
    slot = key_slot(redis_cluster.keys("rw:")[0].encode())
    target = redis_cluster.other_master(redis_cluster.owner(slot))
    redis_cluster.begin_migration(slot, target)
    _move_keys(redis_cluster, slot, target, 2)
    released.set()
    eventually(lambda: len(events) > 1, "the worker's next step once its handler returned")
    _move_keys(redis_cluster, slot, target)
    redis_cluster.finish_migration(slot, target)
    try:
        thread.outcome("the worker to finish its 6 jobs once the slot has moved")
    except redis.RedisError as crash:
        raise AssertionError(
            f"the worker crashed while its queue's slot moved: {type(crash).__name__}: "
            f"{crash} — a refused call is an unavailability: wait poll_ns and try again"
        ) from None
    expect(
        effect_store(queue).effects(),
        {job_id: n for n, job_id in enumerate(ids)},
        f"every job's effect once, after the reshard (the worker's events: {events})",
    )


@rule("dead-master", "restart-fence", "worker-outage", "busy-unavailable")
@extended
def test_stage3_the_queues_master_killed_and_revived_empty_is_waited_out(
    redis_cluster: LocalCluster,
) -> None:
    """The master serving the queue is SIGKILLed while a worker's handler runs a job and a
    zombie holds another lease: every call raises an unavailability (the cluster goes to
    ``fail``); the worker waits. The master comes back without its data — a lost store."""
    released = threading.Event()

    def handler(lease: Lease, payload: Any) -> Any:
        if payload == "first":
            released.wait(10)
        return payload

    events: list[tuple[str, str | None]] = []
    worker = _worker(redis_cluster, "dm:", handler, events)
    queue = cluster_queue(redis_cluster, "dm:", lease_ns=CLUSTER_LEASE, retry=NO_RETRY_DELAY)
    first = queue.enqueue("first")
    thread = spawn(lambda: worker.run(), "cluster-worker")
    eventually(lambda: ("claimed", first) in events, "the worker to claim the first job")
    queue.enqueue("the zombie's")
    zombie = claim(queue, "zombie")
    owner = redis_cluster.owner(key_slot(redis_cluster.keys("dm:")[0].encode()))
    redis_cluster.kill(owner)
    _all_unavailable(queue, zombie, first, "its master killed")
    redis_cluster.wait_state("fail")
    _all_unavailable(queue, zombie, first, "its master dead, the cluster in 'fail'")
    released.set()
    eventually(lambda: ("unavailable", None) in events, "the worker to meet the dead master")
    check(thread.is_alive(), f"the worker waits out a dead master; it returned: {events}")
    redis_cluster.revive(owner)
    eventually(
        lambda: ("lost", first) in events,
        f"the worker, its master back without the job, to drop it as lost (events: {events})",
    )
    zombie_calls: list[tuple[str, Callable[[], object]]] = [
        ("commit", lambda: effect_store(queue).commit(zombie, "late")),
        ("ack", lambda: queue.ack(zombie)),
    ]
    for what, zombie_call in zombie_calls:
        with pytest.raises((StaleLease, JobNotFound)):
            zombie_call()
            raise AssertionError(
                f"the zombie's {what} (lease {zombie}) was accepted by a store that was lost "
                "and started again"
            )
    after = queue.enqueue("after")
    check(
        after not in (first, zombie.job_id),
        f"a store started again never reissues an id: {after} was {first} or {zombie.job_id}",
    )
    eventually(lambda: ("acked", after) in events, "the worker to run the job enqueued after")
    worker.stop()
    thread.outcome("the worker to stop")
    expect(effect_store(queue).effects(), {after: "after"}, "the effects the new store holds")


@rule("cluster-down", "busy-unavailable")
@extended
def test_stage3_a_failed_cluster_makes_every_call_an_unavailability(
    redis_cluster: LocalCluster,
) -> None:
    """Another master dies and the cluster goes to ``fail``: the queue's own master answers
    CLUSTERDOWN to every call. Each raises an unavailability and changes nothing; once the
    cluster is ``ok``, the queue holds what it held."""
    queue = cluster_queue(redis_cluster, "cd:", lease_ns=CLUSTER_LEASE, retry=NO_RETRY_DELAY)
    job_id = queue.enqueue("held")
    queue.enqueue("waiting")
    lease = claim(queue)
    owner = redis_cluster.owner(key_slot(redis_cluster.keys("cd:")[0].encode()))
    victim = redis_cluster.other_master(owner)
    redis_cluster.kill(victim)
    redis_cluster.wait_state("fail")
    _all_unavailable(queue, lease, job_id, "the cluster in 'fail' (another master dead)")
    redis_cluster.revive(victim)
    queue.ack(lease, "done")
    stats = queue.statistics()
    expect(
        (queue.get(job_id).state, stats.ready, stats.succeeded),
        (SUCCEEDED, 1, 1),
        "the cluster back to 'ok': the lease held through the failure is still live (acked), "
        "the other job still READY — the refused calls changed nothing",
    )
    expect(queue.get(queue.enqueue("new")).state, READY, "a new job after the failure")


def _move_keys(cluster: LocalCluster, slot: int, target: Any, count: int | None = None) -> None:
    """Move ``count`` of the slot's keys (default: the rest), as a reshard does."""
    try:
        cluster.move_keys(slot, target, count)
    except redis.ResponseError as error:
        raise AssertionError(
            f"the reshard could not move the queue's keys ({error}): the target, still "
            "IMPORTING, already holds a key of the queue: a script ran there (sent by ASK, "
            "as the keys it declared were not on the old owner) and wrote it while the rest "
            "of the queue was still on the old owner — a script must declare every key it "
            "touches, so that it runs only where all of them are"
        ) from None


def _worker(
    cluster: LocalCluster,
    prefix: str,
    handler: Callable[[Lease, Any], Any],
    events: list[tuple[str, str | None]],
) -> Worker:
    """A worker of the implementation under test on a queue of ``cluster``, polling every
    10 ms, its events appended to ``events``."""

    def on_event(event: str, lease: Lease | None) -> None:
        events.append((event, None if lease is None else lease.job_id))

    queue = cluster_queue(cluster, prefix, lease_ns=CLUSTER_LEASE, retry=NO_RETRY_DELAY)
    worker: Worker = stage().RedisWorker(
        queue, handler, worker_id="w1", poll_ns=10 * MS, on_event=on_event
    )
    return worker


def _all_unavailable(queue: SharedJobQueue, lease: Lease, job_id: str, when: str) -> None:
    """Every public call raises an error ``api.unavailable`` accepts, and nothing else."""
    wrong: list[str] = []
    for name, call in every_call(queue, lease, job_id):
        try:
            got = call()
        except Exception as error:  # the test reports what escaped
            if not unavailable(error):
                wrong.append(f"{name} raised {type(error).__name__}: {error}")
        else:
            wrong.append(f"{name} returned {got!r}")
    check(
        not wrong,
        f"with the queue's {when}, every call raises what api.unavailable() calls an "
        "unavailability (ConnectionError, ClusterDownError …), for the caller to see and a "
        "worker to wait out — got:\n  " + "\n  ".join(wrong),
    )
