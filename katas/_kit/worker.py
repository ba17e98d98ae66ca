"""Job-queue worker processes for stage-3 fault tests: ``python -m katas._kit.worker``.

The process side (:func:`main`) builds a Redis client, the selected implementation's
``RedisJobQueue`` and ``RedisWorker`` (``--impl``/``--base`` as for pytest, so a worker
runs exactly the code under test), and runs the test handler. It prints one line per
event, flushed at once, so a test can follow it and strike at an exact point::

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

The test side (:class:`WorkerProcess`) starts one, waits for its lines with hard
deadlines, and sends it real signals. A test that knows a job is due says so
(``idle_polls``): a worker that keeps finding nothing to claim then fails the wait at
once, instead of when the deadline runs out — a lost job is a red run of a second, not
of fifteen.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

#: Real seconds a test waits for a worker's line before it fails.
LINE_DEADLINE_S = 15.0
#: Empty claims in a row after which a worker that should have found a due job has failed.
DUE_IDLE_POLLS = 25
IDLE = "IDLE"
HOLD_POINTS = ("claimed", "after_effect")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m katas._kit.worker",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--impl", default=None, help="katas, solutions, or a directory")
    p.add_argument("--base", default=None, choices=["own", "reference"])
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


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def handle(lease: Any, payload: Any) -> Any:
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
                _say(IDLE)
            return lease

    return ClaimsShown


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    from katas._kit import impl

    stage3 = impl.resolve(args.impl, args.base).stage("job_scheduler", 3)
    from katas.job_scheduler.api import RetryPolicy

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

    def on_event(event: str, lease: Any) -> None:
        job, token = (lease.job_id, lease.token) if lease is not None else ("-", "-")
        _say(f"EVENT {event} {job} {token}")
        if event == args.hold_at:
            _say(f"HOLD {event} {job} {token}")
            release_hold.wait()  # a line on stdin, or the signal the test came to send
            release_hold.clear()

    def read_stdin() -> None:
        for _line in sys.stdin:
            release_hold.set()

    threading.Thread(target=read_stdin, daemon=True).start()
    every = 2**62 if args.no_heartbeat else args.heartbeat_every_ns
    worker = stage3.RedisWorker(
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
    _say(f"READY {os.getpid()}")
    worker.run(max_jobs=args.max_jobs)
    _say(f"EXIT {'stopped' if stopped.is_set() else 'max_jobs'}")
    return 0


class WorkerProcess:
    """A worker process a test started: its output lines, stdin, and real signals."""

    def __init__(self, argv: Sequence[str], *, name: str = "worker") -> None:
        self.name = name
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "katas._kit.worker", *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
        )
        self._lines: list[str] = []
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self._proc.pid

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            with self._cond:
                self._lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._lines.append("<closed>")
            self._cond.notify_all()

    def lines(self, prefix: str = "") -> list[str]:
        """Every line so far that starts with ``prefix``."""
        with self._cond:
            return [line for line in self._lines if line.startswith(prefix)]

    def transcript(self, last: int = 40) -> str:
        """The last ``last`` lines, each run of IDLE lines shown as one."""
        shown: list[str] = []
        idle = 0
        with self._cond:
            for line in [*self._lines, ""]:
                if line == IDLE:
                    idle += 1
                    continue
                if idle:
                    shown.append(f"{IDLE} x{idle}  (claims that found nothing)")
                    idle = 0
                shown.append(line)
        return "\n".join(f"    {self.name}| {line}" for line in shown[:-1][-last:])

    def idle_run(self) -> int:
        """How many claims in a row, up to now, found nothing."""
        with self._cond:
            run = 0
            for line in reversed(self._lines):
                if line != IDLE:
                    break
                run += 1
            return run

    def _given_up(self, deadline: float, deadline_s: float, idle_polls: int | None) -> str:
        """Why a wait ends unfulfilled now (its deadline passed, or a due job went unclaimed
        ``idle_polls`` times in a row), or "" to wait on."""
        if idle_polls is not None and self.idle_run() >= idle_polls:
            return f"its last {idle_polls} claims found nothing, with a job due"
        if time.monotonic() >= deadline:
            return f"{deadline_s:.0f} real seconds passed"
        return ""

    def wait_for(
        self,
        prefix: str,
        *,
        count: int = 1,
        deadline_s: float = LINE_DEADLINE_S,
        idle_polls: int | None = None,
    ) -> str:
        """Wait (hard deadline) until ``count`` lines start with ``prefix``; the last one.

        ``idle_polls``: a job is due for this worker, so ``idle_polls`` empty claims in a
        row fail the wait at once.
        """
        deadline = time.monotonic() + deadline_s
        with self._cond:
            while True:
                found = [line for line in self._lines if line.startswith(prefix)]
                if len(found) >= count:
                    return found[count - 1]
                closed = "<closed>" in self._lines
                why = "it exited" if closed else self._given_up(deadline, deadline_s, idle_polls)
                if why:
                    raise AssertionError(
                        f"{self.name} never printed {prefix!r} (x{count}): {why}.\n"
                        f"  its output:\n{self.transcript()}"
                    )
                self._cond.wait(0.05)

    def go(self) -> None:
        """Let a worker holding at a point go on."""
        assert self._proc.stdin is not None
        self._proc.stdin.write("go\n")
        self._proc.stdin.flush()

    def send(self, sig: signal.Signals) -> None:
        """Send a real signal (SIGKILL, SIGSTOP, SIGCONT, SIGTERM …)."""
        if self._proc.poll() is None:
            os.kill(self._proc.pid, sig)

    def wait(self, deadline_s: float = LINE_DEADLINE_S, *, idle_polls: int | None = None) -> int:
        """Wait (hard deadline) for the process to exit and its output to be read; its
        return code. ``idle_polls`` as for :meth:`wait_for`."""
        deadline = time.monotonic() + deadline_s
        while True:
            try:
                code = self._proc.wait(min(0.05, max(0.0, deadline - time.monotonic())))
                break
            except subprocess.TimeoutExpired:
                why = self._given_up(deadline, deadline_s, idle_polls)
                if why:
                    raise AssertionError(
                        f"{self.name} did not exit: {why}.\n  its output:\n{self.transcript()}"
                    ) from None
        self._reader.join(deadline_s)  # every line it printed is in lines() now
        return code

    def close(self) -> None:
        if self._proc.poll() is None:
            os.kill(self._proc.pid, signal.SIGCONT)  # a stopped process ignores nothing else
            self._proc.kill()
        self._proc.wait(LINE_DEADLINE_S)
        self._reader.join(LINE_DEADLINE_S)
        for stream in (self._proc.stdin, self._proc.stdout):
            if stream is not None:
                stream.close()


if __name__ == "__main__":
    sys.exit(main())
