"""One replica of an SSE endpoint, in its own process, for the stage-3 suite.

Run by the harness's child runner::

    python -m katas._harness.child katas.streaming_parser._testing.replica:serve \\
        --name a --dir DIR [--port P]

It is a real HTTP/1.1 server on loopback — anyio for the sockets, h11 for the protocol,
so every byte it writes is one the test can name (an ASGI server decides its own
chunking and flushing; here a cut lands on the byte the test chose). Every replica of a
test reads the same two files in ``DIR``:

- ``log.json``, the stream: its blocks (the raw ``text/event-stream`` bytes of one
  event each) with the last event ID a client has once it dispatched each. A request is
  answered from the block after the one whose ID its ``Last-Event-ID`` names (from the
  start without one); a client already past the last block gets ``204 No Content``.
- ``schedule.json``, what the next requests get, in the order they reach *any*
  replica (a counter under a file lock), for the test whose generation the request's
  path ends with (``/stream/<generation>``; a request of an earlier test gets 410):
  ``serve``, ``status:<code>[:<retry-after>]`` (a 3xx redirects to the same path; the
  retry-after is sent as its UTF-8 bytes, so a test can send one that is not ASCII),
  ``stream:<code>`` (the event stream, ``text/event-stream``, under another status),
  ``type:<content type>`` (``type:none``: no Content-Type at all), ``cut:<n>``
  (the first n bytes of the body, then a reset),
  ``end:<n>`` (n bytes, then a clean end of the response), ``hold:<n>`` (n bytes, then
  wait for ``go`` on stdin — or for the test's SIGKILL or SIGSTOP), ``silent`` (the
  head, then nothing), ``trickle:<ms>`` (serve, each event after a pause), ``refuse``
  (a reset before any answer). Past its end, ``serve``.

Lines it prints (flushed at once)::

    listening <port>
    request <generation> <seq> <json: name, last_event_id (null if absent), accept,
            cache_control, action>
    held <generation> <seq>           a hold: action has sent its bytes
    closed <generation> <seq>         the client closed a held or silent connection
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import socket
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import h11

from katas._harness.child import say
from katas._harness.http_replica import head, serve_one, stream_head
from katas._registry import impl

LOG = "log.json"
SCHEDULE = "schedule.json"
PATH = "/stream"
_MAX_REQUEST = 64 * 1024


@dataclass(frozen=True)
class Block:
    """One event of the log: its bytes on the wire, and the last event ID after it."""

    raw: bytes
    last_id: str


def write_log(directory: Path, blocks: list[Block]) -> None:
    entries = [{"raw": b.raw.decode("utf-8"), "last_id": b.last_id} for b in blocks]
    _write(directory / LOG, {"blocks": entries})


def read_log(directory: Path) -> list[Block]:
    data = json.loads((directory / LOG).read_text(encoding="utf-8"))
    return [Block(e["raw"].encode("utf-8"), e["last_id"]) for e in data["blocks"]]


def write_schedule(directory: Path, generation: int, actions: list[str]) -> None:
    with _locked(directory):
        _write(directory / SCHEDULE, {"generation": generation, "next": 0, "actions": actions})


def _write(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data), encoding="utf-8")
    tmp.replace(path)


@contextlib.contextmanager
def _locked(directory: Path) -> Any:
    with open(directory / "schedule.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def next_action(directory: Path, generation: int) -> tuple[int, str] | None:
    """Take the next action of the schedule of test ``generation``: (seq, action); None
    if that test is over (a request its client left behind, arriving late)."""
    with _locked(directory):
        data = json.loads((directory / SCHEDULE).read_text(encoding="utf-8"))
        if data["generation"] != generation:
            return None
        seq = data["next"]
        actions = data["actions"]
        action = actions[seq] if seq < len(actions) else "serve"
        data["next"] = seq + 1
        _write(directory / SCHEDULE, data)
    return seq, action


def target(generation: int) -> str:
    """The path a test's client asks for: the test's generation in it, so a request a
    finished test left behind cannot take an action of the next one."""
    return f"{PATH}/{generation}"


def taken(directory: Path) -> int:
    """How many actions of the schedule requests have taken so far."""
    with _locked(directory):
        data = json.loads((directory / SCHEDULE).read_text(encoding="utf-8"))
    return int(data["next"])


def remaining(blocks: list[Block], last_event_id: str | None) -> list[Block] | None:
    """The blocks after the first one ``last_event_id`` names; None for an ID the log
    never had. (Blocks without an ``id:`` share the ID before them: a client cut after
    one of them gets it again — why every event of a resumable stream needs an ID.)"""
    if not last_event_id:
        return blocks
    for i, block in enumerate(blocks):
        if block.last_id == last_event_id:
            return blocks[i + 1 :]
    return None


# --- the bytes of an answer -----------------------------------------------------------------

_REQUEST = b"GET " + target(1).encode() + b" HTTP/1.1\r\nHost: replica\r\n\r\n"


def wire(response: h11.Response, body: list[bytes]) -> tuple[bytes, list[int]]:
    """The bytes a replica writes for ``response`` with ``body`` (one chunk per part), and
    the wire offset just past each part — what a test needs to cut a connection through
    the fault proxy at an exact byte of the stream."""
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(_REQUEST)
    conn.next_event()
    out = bytearray(conn.send(response) or b"")
    ends = []
    for part in body:
        out += conn.send(h11.Data(data=part)) or b""
        ends.append(len(out) - 2)  # a chunk's data ends before its CRLF
    out += conn.send(h11.EndOfMessage()) or b""
    return bytes(out), ends


# --- serving --------------------------------------------------------------------------------


class Replica:
    def __init__(self, name: str, directory: Path) -> None:
        self.name = name
        self.directory = directory
        self.go = anyio.Event()
        self.drop = anyio.Event()

    async def handle(self, stream: anyio.abc.SocketStream) -> None:
        async def answer(conn: h11.Connection) -> None:
            request = await self._request(stream, conn)
            if request is not None:
                await self._answer(stream, conn, request)

        await serve_one(stream, answer, max_request=_MAX_REQUEST)

    async def _request(
        self, stream: anyio.abc.SocketStream, conn: h11.Connection
    ) -> h11.Request | None:
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                try:
                    data = await stream.receive()
                except anyio.EndOfStream:
                    return None
                conn.receive_data(data)
                continue
            return event if isinstance(event, h11.Request) else None

    async def _answer(
        self, stream: anyio.abc.SocketStream, conn: h11.Connection, request: h11.Request
    ) -> None:
        headers = {k.decode().lower(): v.decode("latin-1") for k, v in request.headers}
        path = request.target.decode("latin-1")
        generation = int(path.rpartition("/")[2]) if path.rpartition("/")[2].isdigit() else -1
        taken = next_action(self.directory, generation)
        if taken is None:
            say(f"stale {path}")
            await stream.send(conn.send(head(410, [])) or b"")
            await stream.send(conn.send(h11.EndOfMessage()) or b"")
            return
        seq, action = taken
        seen = {
            "name": self.name,
            "last_event_id": headers.get("last-event-id"),
            "accept": headers.get("accept"),
            "cache_control": headers.get("cache-control"),
            "action": action,
        }
        say(f"request {generation} {seq} {json.dumps(seen)}")
        kind, _, arg = action.partition(":")

        async def send(event: h11.Response | h11.Data | h11.EndOfMessage) -> None:
            data = conn.send(event)
            if data:
                await stream.send(data)

        if kind == "refuse":
            await _reset(stream)
            return
        if kind == "status":
            code, _, retry_after = arg.partition(":")
            extra = [("Location", path)] if code.startswith("3") else []  # asked again
            answer = head(int(code), [("Content-Type", "text/plain"), *extra])
            if retry_after:  # as bytes: h11 would refuse a str that is not ASCII
                fields = [*answer.headers, (b"Retry-After", retry_after.encode("utf-8"))]
                answer = h11.Response(status_code=int(code), headers=fields)
            await send(answer)
            if code not in ("204", "304"):  # answers that have no body
                await send(h11.Data(data=f"replica {self.name}: {code}\n".encode()))
            await send(h11.EndOfMessage())
            return
        blocks = remaining(read_log(self.directory), seen["last_event_id"])
        if blocks is None:
            await send(head(409, [("Content-Type", "text/plain")]))
            await send(h11.Data(data=b"unknown Last-Event-ID\n"))
            await send(h11.EndOfMessage())
            return
        if not blocks and kind == "serve":
            await send(head(204, []))
            await send(h11.EndOfMessage())
            return
        if kind == "type" and arg == "none":
            await send(head(200, [("Cache-Control", "no-cache")]))
        elif kind == "stream":  # the event stream under another status
            fields = [("Content-Type", "text/event-stream"), ("Cache-Control", "no-cache")]
            await send(head(int(arg), fields))
        else:
            await send(stream_head(arg if kind == "type" else "text/event-stream"))
        if kind == "silent":
            await self._released(stream, f"{generation} {seq}")
            return
        if kind not in ("cut", "end", "hold"):
            pause_s = int(arg) / 1000 if kind == "trickle" else 0.0
            for block in blocks:  # one chunk per event, as wire() counts them
                if pause_s:
                    await anyio.sleep(pause_s)
                await send(h11.Data(data=block.raw))
            await send(h11.EndOfMessage())
            return
        body = b"".join(b.raw for b in blocks)
        n = int(arg)
        if n:
            await send(h11.Data(data=body[:n]))
        if kind == "cut":
            await _reset(stream)
            return
        if kind == "hold":
            say(f"held {generation} {seq}")
            if not await self._released(stream, f"{generation} {seq}"):
                await _reset(stream)
                return
            if body[n:]:
                await send(h11.Data(data=body[n:]))
        await send(h11.EndOfMessage())  # for end: a clean end inside the stream

    async def _released(self, stream: anyio.abc.SocketStream, held: str) -> bool:
        """Wait for ``go`` (True), or ``drop`` on stdin or the client closing (False)."""
        go, drop = self.go, self.drop
        outcome = []
        async with anyio.create_task_group() as tg:

            async def until(event: anyio.Event, what: str) -> None:
                await event.wait()
                outcome.append(what)
                tg.cancel_scope.cancel()

            async def client_closed() -> None:
                with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError):
                    while await stream.receive():
                        pass  # a client sends nothing more after its request
                outcome.append("closed")
                say(f"closed {held}")
                tg.cancel_scope.cancel()

            tg.start_soon(until, go, "go")
            tg.start_soon(until, drop, "drop")
            tg.start_soon(client_closed)
        return outcome[:1] == ["go"]

    async def commands(self) -> None:
        """Lines on stdin: ``go`` lets held answers go on; ``drop`` resets them (a new test)."""
        while True:
            line = await anyio.to_thread.run_sync(sys.stdin.readline, abandon_on_cancel=True)
            if not line:
                return
            if line.strip() == "go":
                self.go.set()
                self.go = anyio.Event()
            elif line.strip() == "drop":
                self.drop.set()
                self.drop = anyio.Event()
                say("dropped")


async def _reset(stream: anyio.abc.SocketStream) -> None:
    """Abort the connection with an RST, as a crashed peer or a middlebox does."""
    sock: socket.socket = stream.extra(anyio.abc.SocketAttribute.raw_socket)
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(Exception):
        await stream.aclose()


async def _main(name: str, directory: Path, port: int) -> None:
    replica = Replica(name, directory)
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=port)
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(replica.commands)
        bound = listener.extra(anyio.abc.SocketAttribute.local_port)
        say(f"listening {bound}")
        await listener.serve(replica.handle)


def serve(selection: impl.Selection, argv: list[str]) -> int:
    """The child runner's entry point (the replica runs no code under test)."""
    del selection
    parser = argparse.ArgumentParser(prog="replica")
    parser.add_argument("--name", required=True)
    parser.add_argument("--dir", required=True, type=Path)
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    anyio.run(_main, args.name, args.dir, args.port)
    return 0
