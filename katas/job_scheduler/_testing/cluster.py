"""The stage-3 queue on a Redis Cluster: the keys a script declares (seen from the client's
side), every public call at once, and several clients working while a slot moves, each
call recorded for the replay or as the unavailability the cluster answered."""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass, field
from typing import Any

import redis

from katas._harness.redis_cluster import LocalCluster
from katas._harness.under_test import stage
from katas.job_scheduler._testing.redis_queues import effect_store
from katas.job_scheduler._testing.replay import Call, perform
from katas.job_scheduler.api import Lease, SharedJobQueue, unavailable

#: What redis-py sends to run a script, and where its KEYS start: ``EVALSHA sha n k1 … kn``.
SCRIPT_COMMANDS = ("EVALSHA", "EVAL", "EVALSHA_RO", "EVAL_RO", "FCALL", "FCALL_RO")


def record_scripts(client: Any) -> list[tuple[Any, ...]]:
    """Every command ``client`` sends from now on, as its arguments (the client is changed
    in place, so the queue built on it is the one observed)."""
    sent: list[tuple[Any, ...]] = []
    send = client.execute_command

    def execute_command(*args: Any, **options: Any) -> Any:
        sent.append(args)
        return send(*args, **options)

    client.execute_command = execute_command
    return sent


def declared(sent: list[tuple[Any, ...]]) -> tuple[set[str], int]:
    """The keys the scripts among ``sent`` declared in KEYS, and how many scripts ran."""
    keys: set[str] = set()
    scripts = 0
    for args in sent:
        if str(args[0]).upper() not in SCRIPT_COMMANDS:
            continue
        scripts += 1
        numkeys = int(args[2])
        keys.update(k.decode() if isinstance(k, bytes) else str(k) for k in args[3 : 3 + numkeys])
    return keys, scripts


def cluster_queue(
    cluster: LocalCluster, prefix: str, client: Any = None, **options: Any
) -> SharedJobQueue:
    """A queue named ``jobs`` under ``prefix`` on ``cluster`` (a client of its own)."""
    settings: dict[str, Any] = {"max_attempts": 3, **options}
    queue: SharedJobQueue = stage().RedisJobQueue(
        cluster.client() if client is None else client, key_prefix=prefix, **settings
    )
    return queue


def every_call(queue: SharedJobQueue, lease: Lease, job_id: str) -> list[tuple[str, Any]]:
    """Every public call of the queue and its effect store, as (name, thunk), on a live
    ``lease`` and a known ``job_id``."""
    store = effect_store(queue)
    return [
        ("enqueue", lambda: queue.enqueue("x")),
        ("claim", lambda: queue.claim("w")),
        ("ack", lambda: queue.ack(lease)),
        ("nack", lambda: queue.nack(lease, "503")),
        ("get", lambda: queue.get(job_id)),
        ("next_due_ns", queue.next_due_ns),
        ("heartbeat", lambda: queue.heartbeat(lease)),
        ("release", lambda: queue.release(lease)),
        ("cancel", lambda: queue.cancel(job_id)),
        ("dead_letters", queue.dead_letters),
        ("redrive", lambda: queue.redrive(job_id)),
        ("is_current", lambda: queue.is_current(lease)),
        ("statistics", queue.statistics),
        ("reap", queue.reap),
        ("commit", lambda: store.commit(lease, "effect")),
        ("effects", store.effects),
    ]


@dataclass
class Traffic:
    """Clients (one queue object and connection each) making random calls in rounds; a
    test changes the cluster between two rounds. Every call lands in ``calls`` (it ran:
    stamped) or ``refused`` (it raised an unavailability); anything else a call raises is
    kept in ``errors``."""

    queues: list[SharedJobQueue]
    seed: int
    calls: list[Call] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    leases: dict[int, list[Lease]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def round(self, when: str, calls_each: int) -> None:
        """``calls_each`` calls from every client at once; returns when all are done."""
        start = threading.Barrier(len(self.queues))
        threads = [
            threading.Thread(target=self._client, args=(n, when, calls_each, start), daemon=True)
            for n in range(len(self.queues))
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
            assert not t.is_alive(), f"{when}: a client's calls did not end within 60 s"

    def _client(self, n: int, when: str, calls_each: int, start: threading.Barrier) -> None:
        rng = random.Random(f"{self.seed}:{when}:{n}")
        leases = self.leases.setdefault(n, [])
        start.wait(10)
        for i in range(calls_each):
            kind = rng.choice(["enqueue", "enqueue", "claim", "claim", "ack", "nack", "commit"])
            if kind in ("ack", "nack", "commit") and not leases:
                kind = "claim"
            args: tuple[Any, ...]
            if kind == "enqueue":
                args = ({"by": n, "when": when, "i": i}, rng.randint(0, 1), None, None)
            elif kind == "claim":
                args = (f"w{n}",)
            else:
                args = (rng.choice(leases[-3:]), {"ack": "done", "nack": "boom", "commit": i}[kind])
            self.call(n, when, kind, *args)

    def call(self, n: int, when: str, kind: str, *args: Any) -> Call | None:
        """One call by client ``n``, recorded; its record, or None if it did not run."""
        what = f"{when}: client {n}'s {kind}"
        try:
            c = perform(self.queues[n], kind, *args, who=f"c{n}")
        except redis.RedisError as error:
            with self._lock:
                if unavailable(error):
                    self.refused.append(f"{what} -> {type(error).__name__}: {error}")
                else:
                    self.errors.append(f"{what} raised {type(error).__name__}: {error}")
            return None
        except Exception as error:  # reported by the test, with the step it came at
            with self._lock:
                self.errors.append(f"{what} raised {type(error).__name__}: {error}")
            return None
        with self._lock:
            self.calls.append(c)
            if kind == "claim" and c.outcome[1] is not None:
                self.leases.setdefault(n, []).append(c.outcome[1])
        return c
