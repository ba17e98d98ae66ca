"""A job-queue worker process for the stage-3 fault tests, run by the harness's child
runner: ``python -m katas._harness.child katas.job_scheduler._testing.worker:run``.

It builds a Redis client, the selected implementation's ``RedisJobQueue`` and
``RedisWorker`` (``--impl``/``--base`` as for pytest, so a worker runs exactly the code
under test), and runs the test handler. It prints one line per event, flushed at once,
so a test can follow it and strike at an exact point::

    READY <pid>
    EVENT <event> <job_id> <token>      claimed, committed, duplicate, after_effect, acked,
                                        failed, lost, released (see RedisWorker)
    EVENT unavailable - -               Redis could not be reached (the worker waits)
    HOLD <point> <job_id> <token>       --hold-at <point>: then it waits for a line on stdin
    IDLE                                a claim found nothing (printed by this runner)
    EXIT <reason>                       max_jobs, or stopped (SIGTERM/SIGINT)

``--hold-at claimed|after_effect`` holds after that event until the test writes a line
to stdin — or sends the signal it came for. SIGTERM and SIGINT stop the worker
gracefully (``--grace-ns`` for the running job). The test handler reads the payload, a
dict: ``effect`` (what the job returns: its effect; default the payload itself),
``work_ms`` (real milliseconds of work), ``crash`` (SIGKILL itself: a poison job that
takes its worker down), ``fail`` (raise ``RuntimeError`` with that text).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from katas._harness.child import say
from katas._registry import impl
from katas.job_scheduler.api import Lease, RetryPolicy, Worker

TARGET = "katas.job_scheduler._testing.worker:run"
#: Empty claims in a row after which a worker that should have found a due job has failed.
DUE_IDLE_POLLS = 25
IDLE = "IDLE"
HOLD_POINTS = ("claimed", "after_effect")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=f"python -m katas._harness.child {TARGET}",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--url", required=True, help="redis://host:port/db")
    p.add_argument("--name", default="jobs", help="the queue's name")
    p.add_argument("--key-prefix", default="q:")
    p.add_argument("--worker-id", required=True)
    p.add_argument("--lease-ns", type=int, required=True)
    p.add_argument("--max-attempts", type=int, default=3)
    p.add_argument("--backoff-base-ns", type=int, default=0)
    p.add_argument("--backoff-cap-ns", type=int, default=0)
    p.add_argument("--jitter", default="none")
    p.add_argument("--heartbeat-every-ns", type=int, default=None)
    p.add_argument("--no-heartbeat", action="store_true", help="never extend a lease")
    p.add_argument("--poll-ns", type=int, default=10_000_000)
    p.add_argument("--hold-at", choices=HOLD_POINTS, default=None)
    p.add_argument("--max-jobs", type=int, default=None)
    p.add_argument("--grace-ns", type=int, default=0, help="for the job running at SIGTERM")
    p.add_argument("--socket-timeout", type=float, default=1.0)
    return p


def handle(lease: Lease, payload: Any) -> Any:
    """The test handler (see the module docstring): returns the job's effect."""
    if not isinstance(payload, dict):
        return payload
    if payload.get("crash"):
        os.kill(os.getpid(), signal.SIGKILL)
    if payload.get("work_ms"):
        time.sleep(payload["work_ms"] / 1000)
    if payload.get("fail"):
        raise RuntimeError(str(payload["fail"]))
    return payload.get("effect", payload)


def _claims_shown(queue_class: type) -> type:
    """``queue_class``, unchanged except that a claim which finds nothing prints IDLE."""

    class ClaimsShown(queue_class):  # type: ignore[misc]
        def claim(self, *args: Any, **kwargs: Any) -> Any:
            lease = super().claim(*args, **kwargs)
            if lease is None:
                say(IDLE)
            return lease

    return ClaimsShown


def run(selection: impl.Selection, argv: list[str]) -> int:
    """The entry point: one worker of the selected implementation (see the docstring)."""
    args = _parser().parse_args(argv)
    stage3 = selection.stage("job_scheduler", 3)
    client = redis.Redis.from_url(
        args.url,
        socket_timeout=args.socket_timeout,
        socket_connect_timeout=args.socket_timeout,
        retry=Retry(NoBackoff(), 0),  # an outage shows up as one error, handled by the worker
    )
    queue = _claims_shown(stage3.RedisJobQueue)(
        client,
        lease_ns=args.lease_ns,
        retry=RetryPolicy(args.backoff_base_ns, args.backoff_cap_ns, args.jitter),
        max_attempts=args.max_attempts,
        name=args.name,
        key_prefix=args.key_prefix,
    )
    release_hold = threading.Event()

    def on_event(event: str, lease: Lease | None) -> None:
        job, token = (lease.job_id, lease.token) if lease is not None else ("-", "-")
        say(f"EVENT {event} {job} {token}")
        if event == args.hold_at:
            say(f"HOLD {event} {job} {token}")
            release_hold.wait()  # a line on stdin, or the signal the test came to send
            release_hold.clear()

    def read_stdin() -> None:
        for _line in sys.stdin:
            release_hold.set()

    threading.Thread(target=read_stdin, daemon=True).start()
    every = 2**62 if args.no_heartbeat else args.heartbeat_every_ns
    worker: Worker = stage3.RedisWorker(
        queue,
        handle,
        worker_id=args.worker_id,
        heartbeat_every_ns=every,
        poll_ns=args.poll_ns,
        on_event=on_event,
    )
    stopped = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        stopped.set()
        worker.stop(args.grace_ns)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    say(f"READY {os.getpid()}")
    worker.run(max_jobs=args.max_jobs)
    say(f"EXIT {'stopped' if stopped.is_set() else 'max_jobs'}")
    return 0
