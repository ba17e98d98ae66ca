"""One engine replica in its own process: the stage-3 suite's OpenAI-style server.

Run by the harness's child runner, with the selection of the implementation under test::

    python -m katas._harness.child katas.dynamic_batcher._testing.replica:serve \\
        [--impl …] [--base …] --name a [--port P] [--batcher continuous|prefix] \\
        [--max-waiting N] [--max-num-seqs N] [--step-us N] …

It builds a ``FakeModel(shared_reads=True)``, the implementation's batcher over it (stage
1's ``ContinuousBatcher``, or stage 2's ``PrefixCachingBatcher`` with ``--batcher
prefix``) and its stage-2 ``AsyncEngine`` on real time: a ``MonotonicClock`` (its sleeps
are ``anyio.sleep``) with every step taking a fixed ``--step-us`` (1 ms by default). It
serves HTTP/1.1 on loopback — anyio for the sockets, h11 for the protocol, one
connection per request (``Connection: close``):

- ``POST /v1/completions`` with a JSON body ``{"prompt": [ids], "max_tokens": n,
  "stream": true, "request_id": "r1", "stop": [ids], "priority": p}`` (``stop`` and
  ``priority`` optional) → ``200 text/event-stream``, one event per delivery::

      data: {"id": "r1", "choices": [{"tokens": [5, 9], "finish_reason": null}]}

  the last one with its ``finish_reason`` (``stop``, ``length``, ``deadline``,
  ``abort``), then ``data: [DONE]``. A reader the engine stalled gets
  ``data: {"id": "r1", "error": "…"}`` then ``data: [DONE]``.
  ``Overloaded`` → ``429`` with ``Retry-After`` (whole seconds, rounded up) and
  ``x-retry-after-ns``; a body that is not JSON or not a valid request (or a request
  the batcher rejects) → ``400``; the engine closed → ``503``. A client that goes away
  mid-stream closes its stream: the engine aborts its request.
- ``GET /health`` → ``200``; ``GET /stats`` → ``200`` JSON: ``engine`` (the engine's
  ``statistics()``), ``cache`` (the batcher's ``cache_statistics()``, null without a
  prefix cache), ``finished`` (request id → finish reason, from the batcher's metrics)
  and ``replica`` (counts: ``requests``, ``streamed``, ``overloaded``, ``rejected``,
  ``disconnected``).

Lines it prints (flushed at once)::

    listening <port>
    request <rid>
    overloaded <rid> <retry_after_ns>
    finished <rid> <finish_reason>
    disconnected <rid>         the client went away before the stream's end
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import signal
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from types import ModuleType
from typing import Any

import anyio
import anyio.abc
import h11

from katas._harness.child import ChildProcess, say
from katas._harness.http_replica import head, serve_one, stream_head
from katas._registry import impl
from katas._runtime.clock import NS_PER_S, NS_PER_US, MonotonicClock
from katas.dynamic_batcher.api import (
    Engine,
    EngineClosed,
    Overloaded,
    PagedBatcher,
    ReaderStalled,
    Request,
    StepOutput,
    TokenStream,
)

from .model import FakeModel

TARGET = "katas.dynamic_batcher._testing.replica:serve"
KATA = "dynamic_batcher"
COMPLETIONS = "/v1/completions"
HEALTH = "/health"
STATS = "/stats"
DONE = b"data: [DONE]\n\n"
#: The model every replica serves, unless its options say otherwise.
VOCAB, SEED, BLOCK_SIZE, NUM_BLOCKS = 1_000, 7, 4, 256
_MAX_REQUEST = 1024 * 1024


def model(
    vocab: int = VOCAB, seed: int = SEED, num_blocks: int = NUM_BLOCKS, block_size: int = BLOCK_SIZE
) -> FakeModel:
    """The model of a replica with these options: what ``reference_outputs`` needs."""
    return FakeModel(vocab, seed, num_blocks, block_size, shared_reads=True)


def event(payload: dict[str, Any]) -> bytes:
    """One ``text/event-stream`` event carrying ``payload`` as JSON."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def request_body(request: Request) -> dict[str, Any]:
    """The JSON body of ``POST /v1/completions`` for ``request`` (its arrival and
    deadline are the replica's business: its own clock stamps them)."""
    body: dict[str, Any] = {
        "prompt": list(request.prompt),
        "max_tokens": request.max_new_tokens,
        "stream": True,
        "request_id": request.rid,
    }
    if request.stop_tokens:
        body["stop"] = sorted(request.stop_tokens)
    if request.priority:
        body["priority"] = request.priority
    return body


def parse_request(raw: bytes) -> Request:
    """The request a body asks for; ValueError (or TypeError) saying what is wrong."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"the body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object")
    if body.get("stream") is not True:
        raise ValueError('only streaming is served: "stream" must be true')
    rid, prompt, stop = body.get("request_id"), body.get("prompt"), body.get("stop", [])
    if not isinstance(rid, str):
        raise ValueError('"request_id" must be a string')
    for name, ids in (("prompt", prompt), ("stop", stop)):
        if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in ids
        ):
            raise ValueError(f'"{name}" must be a list of token ids')
    priority = body.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValueError('"priority" must be an int')
    assert isinstance(prompt, list) and isinstance(stop, list)
    return Request(
        rid,
        tuple(prompt),
        body.get("max_tokens"),  # type: ignore[arg-type]  # Request checks it
        frozenset(stop),
        priority=priority,
    )


@dataclass
class Counts:
    """What a replica did, for ``/stats``."""

    requests: int = 0
    streamed: int = 0
    overloaded: int = 0
    rejected: int = 0
    disconnected: int = 0


@dataclass
class Server:
    """The HTTP side of one replica: its engine, its batcher, its counts."""

    engine: Engine  # the implementation's AsyncEngine
    batcher: PagedBatcher  # the batcher under it
    counts: Counts = field(default_factory=Counts)

    async def handle(self, stream: anyio.abc.SocketStream) -> None:
        async def answer(conn: h11.Connection) -> None:
            got = await _request(stream, conn)
            if got is not None:
                await self._answer(stream, conn, *got)

        await serve_one(stream, answer, max_request=_MAX_REQUEST)

    async def _answer(
        self,
        stream: anyio.abc.SocketStream,
        conn: h11.Connection,
        request: h11.Request,
        body: bytes,
    ) -> None:
        async def send(event: h11.Response | h11.Data | h11.EndOfMessage) -> None:
            data = conn.send(event)
            if data:
                await stream.send(data)

        async def plain(
            status: int, text: str, headers: list[tuple[str, str]] | None = None
        ) -> None:
            await _plain(send, status, text, headers or [])

        method = request.method.decode("latin-1")
        path = request.target.decode("latin-1").partition("?")[0]
        if path in (HEALTH, STATS):
            if method != "GET":
                await plain(405, f"{path} answers GET\n")
            elif path == HEALTH:
                await plain(200, "ok\n")
            else:
                await _json(send, 200, self.stats())
            return
        if path != COMPLETIONS:
            await plain(404, f"no such path: {path}\n")
            return
        if method != "POST":
            await plain(405, f"{COMPLETIONS} answers POST\n")
            return
        self.counts.requests += 1
        try:
            wanted = parse_request(body)
        except (ValueError, TypeError) as exc:
            self.counts.rejected += 1
            await plain(400, f"{exc}\n")
            return
        say(f"request {wanted.rid}")
        try:
            tokens = self.engine.generate(wanted)
        except Overloaded as busy:
            self.counts.overloaded += 1
            say(f"overloaded {wanted.rid} {busy.retry_after_ns}")
            retry_s = max(1, math.ceil(busy.retry_after_ns / NS_PER_S))
            headers = [
                ("Retry-After", str(retry_s)),
                ("x-retry-after-ns", str(busy.retry_after_ns)),
            ]
            await plain(429, f"{busy}\n", headers)
            return
        except EngineClosed as exc:
            await plain(503, f"{exc}\n")
            return
        except (ValueError, TypeError) as exc:  # RequestRejected among them
            self.counts.rejected += 1
            await plain(400, f"{exc}\n")
            return
        self.counts.streamed += 1
        await self._stream(stream, send, wanted.rid, tokens)

    async def _stream(
        self,
        stream: anyio.abc.SocketStream,
        send: Callable[[Any], Any],
        rid: str,
        tokens: TokenStream,
    ) -> None:
        """Each delivery of ``tokens`` as one event (one chunk), until the end or until the
        client goes away; leaving closes the stream (aborting an unfinished request)."""
        ended = False
        async with tokens, anyio.create_task_group() as tg:

            async def client_gone() -> None:
                with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError, OSError):
                    while await stream.receive():
                        pass  # a client sends nothing more after its request
                tg.cancel_scope.cancel()

            tg.start_soon(client_gone)
            try:
                await send(stream_head())
                try:
                    async for delivery in tokens:
                        choice: dict[str, Any] = {
                            "tokens": list(delivery.tokens),
                            "finish_reason": None,
                        }
                        if delivery.finish_reason is not None:
                            choice["finish_reason"] = delivery.finish_reason
                            say(f"finished {rid} {delivery.finish_reason}")
                        await send(h11.Data(data=event({"id": rid, "choices": [choice]})))
                except ReaderStalled as exc:
                    say(f"finished {rid} stalled")
                    await send(h11.Data(data=event({"id": rid, "error": str(exc)})))
                await send(h11.Data(data=DONE))
                await send(h11.EndOfMessage())
                ended = True
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                pass
            finally:
                tg.cancel_scope.cancel()
        if not ended:
            self.counts.disconnected += 1
            say(f"disconnected {rid}")

    def stats(self) -> dict[str, Any]:
        cache = getattr(self.batcher, "cache_statistics", None)
        return {
            "engine": asdict(self.engine.statistics()),
            "cache": asdict(cache()) if cache is not None else None,
            "finished": {m.rid: m.finish_reason for m in self.batcher.metrics()},
            "replica": asdict(self.counts),
        }


async def _request(
    stream: anyio.abc.SocketStream, conn: h11.Connection
) -> tuple[h11.Request, bytes] | None:
    """The request on ``conn`` and its whole body (None: the client left first)."""
    request: h11.Request | None = None
    body = bytearray()
    while True:
        got = conn.next_event()
        if got is h11.NEED_DATA:
            try:
                data = await stream.receive()
            except anyio.EndOfStream:
                return None
            conn.receive_data(data)
        elif isinstance(got, h11.Request):
            request = got
        elif isinstance(got, h11.Data):
            body += got.data
            if len(body) > _MAX_REQUEST:
                raise h11.LocalProtocolError("request body too large", 413)
        elif isinstance(got, h11.EndOfMessage) and request is not None:
            return request, bytes(body)
        else:
            return None


async def _plain(
    send: Callable[[Any], Any], status: int, text: str, headers: list[tuple[str, str]]
) -> None:
    data = text.encode()
    await send(
        head(
            status,
            [("Content-Type", "text/plain"), ("Content-Length", str(len(data))), *headers],
        )
    )
    await send(h11.Data(data=data))
    await send(h11.EndOfMessage())


async def _json(send: Callable[[Any], Any], status: int, payload: dict[str, Any]) -> None:
    data = json.dumps(payload).encode()
    await send(
        head(status, [("Content-Type", "application/json"), ("Content-Length", str(len(data)))])
    )
    await send(h11.Data(data=data))
    await send(h11.EndOfMessage())


# --- the child ------------------------------------------------------------------------------


def _options(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="replica")
    parser.add_argument("--name", required=True)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--suite-stage", type=int, default=2, help="the stage of the suite")
    parser.add_argument("--batcher", choices=("continuous", "prefix"), default="continuous")
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--num-blocks", type=int, default=NUM_BLOCKS)
    parser.add_argument("--block-size", type=int, default=BLOCK_SIZE)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    parser.add_argument("--max-waiting", type=int, default=64)
    parser.add_argument("--max-stall-ms", type=int, default=5_000)
    parser.add_argument("--step-us", type=int, default=1_000, help="real time of every step")
    return parser.parse_args(argv)


def _batcher(
    selection: impl.Selection, options: argparse.Namespace
) -> tuple[PagedBatcher, ModuleType]:
    """The implementation's batcher over the replica's model, and its stage-2 module."""
    top = max(2, options.suite_stage)
    stage2 = selection.stage(KATA, 2, top=top)
    kind = (
        stage2.PrefixCachingBatcher
        if options.batcher == "prefix"
        else selection.stage(KATA, 1, top=top).ContinuousBatcher
    )
    batcher: PagedBatcher = kind(
        model(options.vocab, options.seed, options.num_blocks, options.block_size),
        max_num_seqs=options.max_num_seqs,
        max_num_batched_tokens=options.max_num_batched_tokens,
        num_blocks=options.num_blocks,
        block_size=options.block_size,
    )
    return batcher, stage2


async def _main(selection: impl.Selection, options: argparse.Namespace) -> None:
    batcher, stage2 = _batcher(selection, options)
    step_ns: int = options.step_us * NS_PER_US

    def step_time_ns(out: StepOutput) -> int:
        return step_ns

    engine: Engine = stage2.AsyncEngine(
        batcher,
        clock=MonotonicClock(),
        step_time_ns=step_time_ns,
        max_waiting=options.max_waiting,
        max_stall_ns=options.max_stall_ms * NS_PER_S // 1000,
    )
    server = Server(engine, batcher)
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=options.port)
    async with engine, listener:
        say(f"listening {listener.extra(anyio.abc.SocketAttribute.local_port)}")
        await listener.serve(server.handle)


def serve(selection: impl.Selection, argv: list[str]) -> int:
    """The child runner's entry point: serve the implementation's engine until killed."""
    anyio.run(_main, selection, _options(argv))
    return 0


# --- the test's side ------------------------------------------------------------------------


class ReplicaProcess:
    """A replica the test started (``options``: the child's flags, ``max_waiting=1`` for
    ``--max-waiting 1``): its URL, real signals, and a hard deadline on every wait."""

    def __init__(self, selection: impl.Selection, name: str = "a", **options: object) -> None:
        argv = ["--name", name]
        for key, value in options.items():
            argv += [f"--{key.replace('_', '-')}", str(value)]
        self.name = name
        self.process = ChildProcess(TARGET, selection, argv, name=f"replica {name}")
        try:
            self.port = int(self.process.wait_for("listening ").split()[1])
        except BaseException:
            self.process.close()
            raise

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_for(self, prefix: str, *, count: int = 1) -> str:
        """The replica's ``count``-th line starting with ``prefix`` (hard deadline)."""
        return self.process.wait_for(prefix, count=count)

    def kill(self) -> None:
        """SIGKILL: the replica dies as a crashed host does, its sockets closed by the kernel."""
        self.process.send(signal.SIGKILL)
        self.process.wait()

    def close(self) -> None:
        self.process.close()


@contextlib.contextmanager
def running(
    selection: impl.Selection, name: str = "a", **options: object
) -> Iterator[ReplicaProcess]:
    """A replica for the length of the block, killed on the way out."""
    replica = ReplicaProcess(selection, name, **options)
    try:
        yield replica
    finally:
        replica.close()


__all__ = [
    "COMPLETIONS",
    "ReplicaProcess",
    "Server",
    "event",
    "model",
    "parse_request",
    "request_body",
    "running",
    "serve",
]
