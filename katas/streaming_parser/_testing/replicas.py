"""The stage-3 suite's side of the replicas: start them, tell them what to serve and how to
fail, see what each request carried, kill and restart them.

A :class:`ReplicaSet` runs each replica (:mod:`.replica`) in its own process through the
harness's child runner, all reading one event log and one fault schedule in a
directory of the test's. ``reset(blocks, actions)`` starts a test: the log it streams
and what the next connections get, in the order they arrive at any replica, so a
schedule says "the 1st connection is cut at byte 40, the 2nd gets a 503" whichever
replica the client picks. ``requests()`` is every request of the test as the replicas
saw it (which replica, its ``Last-Event-ID``). ``kill``/``stop`` send real signals.

:class:`JumpingClock` is the client's time: a wait on it takes no real time and is
recorded, so a test checks every backoff the client chose without waiting for any.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import anyio
import anyio.lowlevel
import pytest

from katas._harness.child import ChildProcess
from katas._harness.http_replica import stream_head
from katas._harness.waiting import DEADLINE_S
from katas._registry import impl
from katas._runtime.clock import ManualClock
from katas.streaming_parser.api import ServerSentEvent

from . import replica as _replica
from .replica import Block, target, wire
from .sse import interpret

TARGET = "katas.streaming_parser._testing.replica:serve"


def token_blocks(count: int, *, retry_ms: int | None = None, start: int = 1) -> list[Block]:
    """A log of ``count`` token events with IDs, each block written a different way (LF,
    CRLF, CR; a comment; two data lines; non-ASCII text), the first with ``retry``."""
    blocks = []
    for n in range(start, start + count):
        text = ["token", "é€", "😀 two", "x"][n % 4]
        end = ["\n", "\r\n", "\r", "\n"][n % 4]
        lines = [f"id: {n}", f"data: {text} {n}"]
        if n % 3 == 0:
            lines.insert(0, ": keep-alive")
        if n % 5 == 0:
            lines.append(f"data: line two of {n}")
        if n == start and retry_ms is not None:
            lines.append(f"retry: {retry_ms}")
        blocks.append(Block(end.join([*lines, "", ""]).encode(), str(n)))
    return blocks


def events_of(blocks: Sequence[Block]) -> list[ServerSentEvent]:
    """What a client that got every block exactly once dispatches (the oracle's reading)."""
    return interpret(b"".join(b.raw for b in blocks)).events


def body_offsets(blocks: Sequence[Block]) -> list[int]:
    """The body offset just past each block."""
    ends, total = [], 0
    for block in blocks:
        total += len(block.raw)
        ends.append(total)
    return ends


#: The idle timeout of the stage-3 tests that stall a replica (real seconds).
IDLE_S = 0.3
#: The log most stage-3 tests serve, and the body offset just past each of its blocks.
BLOCKS = token_blocks(8)
ENDS = body_offsets(BLOCKS)


def stream_wire(blocks: Sequence[Block]) -> tuple[bytes, list[int]]:
    """The bytes a replica writes when it serves ``blocks`` from the start, and the wire
    offset just past each block's bytes."""
    return wire(stream_head(), [b.raw for b in blocks])


def resumes(blocks: Sequence[Block], actions: Sequence[str]) -> list[str | None]:
    """The ``Last-Event-ID`` of each request a correct client makes against ``actions``
    (None: no header), up to the one answered 204 — the protocol played by a model."""
    sent: list[str | None] = []
    last_id = ""
    for seq in range(len(actions) + 2):
        sent.append(last_id or None)
        rest = _replica.remaining(list(blocks), last_id)
        action = actions[seq] if seq < len(actions) else "serve"
        kind, _, arg = action.partition(":")
        if rest is None or (not rest and kind == "serve"):
            break
        body = b"".join(b.raw for b in rest)
        if kind in ("cut", "end", "hold"):
            body = body[: int(arg)]
        elif kind not in ("serve", "trickle"):
            continue  # an error answer: nothing delivered
        last_id = interpret(body, last_id).last_event_id
    return sent


@dataclass(frozen=True)
class Request:
    """One request, as the replica that got it saw it."""

    seq: int  # its place among the test's requests, at every replica
    replica: str
    last_event_id: str | None  # None: no Last-Event-ID header
    accept: str | None
    cache_control: str | None
    action: str  # what the schedule made it

    def show(self) -> str:
        lei = (
            "no Last-Event-ID"
            if self.last_event_id is None
            else f"Last-Event-ID {self.last_event_id!r}"
        )
        return f"#{self.seq + 1} to {self.replica}, {lei} -> {self.action}"


def show_requests(requests: Sequence[Request]) -> str:
    """Requests as a failure shows them: one a line, indented."""
    return "\n".join(f"    {r.show()}" for r in requests) or "    (no request)"


class JumpingClock(ManualClock):
    """Sleeps take no real time: a sleep moves the clock to its deadline. ``sleeps_ns``
    records each one's length (0 for a deadline already due). With ``jumping`` False
    it is a :class:`ManualClock` that records: a sleep waits for the test to advance.
    ``on_sleep``, if set, is called as each sleep begins: what the source says while it
    backs off."""

    def __init__(self, *, jumping: bool = True) -> None:
        super().__init__()
        self.jumping = jumping
        self.sleeps_ns: list[int] = []
        self.on_sleep: Callable[[], object] | None = None

    async def sleep_until_ns_async(self, deadline_ns: int) -> None:
        self.sleeps_ns.append(max(0, deadline_ns - self.now_ns()))
        if self.on_sleep is not None:
            self.on_sleep()
        if not self.jumping:
            await super().sleep_until_ns_async(deadline_ns)
            return
        if deadline_ns > self.now_ns():
            self.set(deadline_ns)
        await anyio.lowlevel.checkpoint()


class ReplicaSet:
    """Replica processes of one module of tests; each test starts with :meth:`reset`."""

    def __init__(self, selection: impl.Selection, directory: Path, names: Sequence[str]) -> None:
        self.selection = selection
        self.directory = directory
        self.names = list(names)
        self.generation = 0
        self.ports: dict[str, int] = {}
        self.processes: dict[str, ChildProcess] = {}
        self.stopped: set[str] = set()
        self.retired: list[ChildProcess] = []  # killed and restarted: their lines still count
        _replica.write_log(directory, [])
        _replica.write_schedule(directory, 0, [])
        for name in self.names:
            self._spawn(name)
        for name in self.names:
            self._await_listening(name)

    # -- processes -------------------------------------------------------------------------
    def _spawn(self, name: str) -> None:
        argv = [
            "--name",
            name,
            "--dir",
            str(self.directory),
            "--port",
            str(self.ports.get(name, 0)),
        ]
        self.processes[name] = ChildProcess(TARGET, self.selection, argv, name=f"replica {name}")

    def _await_listening(self, name: str) -> None:
        line = self.processes[name].wait_for("listening ")
        self.ports[name] = int(line.split()[1])

    def url(self, name: str, port: int | None = None) -> str:
        """The URL of replica ``name`` for this test (through ``port``, if given)."""
        return f"http://127.0.0.1:{port or self.ports[name]}{target(self.generation)}"

    @property
    def urls(self) -> list[str]:
        return [self.url(name) for name in self.names]

    def kill(self, name: str) -> None:
        """SIGKILL: the replica dies as a crashed host does, its sockets closed by the kernel."""
        process = self.processes[name]
        process.send(signal.SIGKILL)
        process.wait()
        self.stopped.discard(name)

    def stop(self, name: str) -> None:
        """SIGSTOP: the replica stalls, its connections open and silent."""
        self.processes[name].send(signal.SIGSTOP)
        self.stopped.add(name)

    def resume(self, name: str) -> None:
        self.processes[name].send(signal.SIGCONT)
        self.stopped.discard(name)

    def alive(self, name: str) -> bool:
        return self.processes[name].alive()

    def restart(self, name: str) -> None:
        """Start a killed replica again, on its port."""
        if self.alive(name):
            self.kill(name)
        self.processes[name].close()
        self.retired.append(self.processes[name])
        deadline = time.monotonic() + DEADLINE_S
        while True:  # the kernel may hold the port a moment after the kill
            self._spawn(name)
            try:
                self._await_listening(name)
                return
            except AssertionError:
                self.processes[name].close()
                if time.monotonic() > deadline:
                    raise

    def go(self, name: str) -> None:
        """A held answer of ``name`` goes on."""
        self.processes[name].tell("go")

    # -- a test ----------------------------------------------------------------------------
    def reset(self, blocks: Sequence[Block], actions: Sequence[str] = ()) -> None:
        """A new test: every replica streams ``blocks``; the test's requests get ``actions``
        in order (then ``serve``). Replicas a test killed or stopped are back; answers
        an earlier test left held or silent are reset."""
        for name in self.names:
            if name in self.stopped:
                self.resume(name)
            if not self.alive(name):
                self.restart(name)
            else:
                self.processes[name].tell("drop")
        self.generation += 1
        _replica.write_log(self.directory, list(blocks))
        _replica.write_schedule(self.directory, self.generation, list(actions))

    def requests(self) -> list[Request]:
        """Every request of this test so far, in the order they arrived (each replica
        counts a request before it answers, so none the client saw an answer to is
        missing: its line is waited for)."""
        expected = _replica.taken(self.directory)
        deadline = time.monotonic() + DEADLINE_S
        while True:
            found = self._requests()
            if len(found) >= expected or time.monotonic() > deadline:
                return found
            time.sleep(0.001)

    def _requests(self) -> list[Request]:
        found = []
        prefix = f"request {self.generation} "
        for process in [*self.retired, *self.processes.values()]:
            for line in process.lines(prefix):
                _, _, seq, payload = line.split(" ", 3)
                seen = json.loads(payload)
                found.append(
                    Request(
                        int(seq),
                        seen["name"],
                        seen["last_event_id"],
                        seen["accept"],
                        seen["cache_control"],
                        seen["action"],
                    )
                )
        return sorted(found, key=lambda r: r.seq)

    def held(self) -> list[str]:
        """The replicas holding an answer of this test (``hold:`` actions)."""
        prefix = f"held {self.generation} "
        return [name for name, p in self.processes.items() if p.lines(prefix)]

    def show(self) -> str:
        """Every request of this test so far, one a line (:func:`show_requests`)."""
        return show_requests(self.requests())

    def close(self) -> None:
        for process in self.processes.values():
            process.close()


def module_replicas(
    selection: impl.Selection, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ReplicaSet]:
    """Three replicas, a, b and c, for every test of a module (each test resets them),
    closed after the last: what each stage-3 suite file's ``replicas`` fixture yields."""
    started = ReplicaSet(selection, tmp_path_factory.mktemp("replicas"), ["a", "b", "c"])
    try:
        yield started
    finally:
        started.close()


__all__ = [
    "Block",
    "JumpingClock",
    "ReplicaSet",
    "Request",
    "body_offsets",
    "events_of",
    "module_replicas",
    "resumes",
    "show_requests",
    "stream_wire",
    "token_blocks",
]
