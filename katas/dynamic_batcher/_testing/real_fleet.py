"""Drivers for the stage-3 suite's tests on real replica processes over loopback HTTP:
the router under test on a real clock, replicas with prefix caching started through the
child runner, a hard deadline on every wait, and a server that answers garbage.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import anyio
import anyio.abc

from katas._harness.under_test import stage
from katas._registry import impl
from katas._runtime.clock import NS_PER_MS, NS_PER_S, MonotonicClock
from katas.dynamic_batcher.api import ReplicaLink, Request, StreamRouter

from . import replica
from .engine import Reader
from .fleet import RouterUnderTest, ended, serving
from .http_link import HttpLink
from .model import reference_outputs

#: A real step: long enough for the router to act between two tokens on a loaded machine.
REAL_STEP_US = 2_000
REAL_DEADLINE_S = 30.0


def real_router(links: Sequence[ReplicaLink], **options: Any) -> RouterUnderTest:
    settings: dict[str, Any] = {
        "clock": MonotonicClock(),
        "block_size": replica.BLOCK_SIZE,
        "max_outstanding_tokens": 1_000_000,
        "retry_after_ns": NS_PER_S,
        "stall_timeout_ns": 400 * NS_PER_MS,
        "probe_interval_ns": 3_600 * NS_PER_S,  # the tests probe when they choose
        "probe_timeout_ns": 200 * NS_PER_MS,
    }
    settings.update(options)
    router: RouterUnderTest = stage().Router(links, **settings)
    return router


@contextlib.contextmanager
def replicas(selection: impl.Selection, *names: str) -> Iterator[dict[str, Any]]:
    """Replica processes running your stage-2 engine with prefix caching, killed on the
    way out. Your stage 2 is built here first, so a stub says so in this process."""
    stage(2).PrefixCachingBatcher(
        replica.model(),
        max_num_seqs=1,
        max_num_batched_tokens=8,
        num_blocks=replica.NUM_BLOCKS,
        block_size=replica.BLOCK_SIZE,
    )
    with contextlib.ExitStack() as stack:
        yield {
            n: stack.enter_context(
                replica.running(selection, n, batcher="prefix", suite_stage=3, step_us=REAL_STEP_US)
            )
            for n in names
        }


def real_expected(requests: Sequence[Request]) -> dict[str, tuple[int, ...]]:
    return reference_outputs(requests, replica.model())


def start_real(
    router: StreamRouter, requests: Sequence[Request], tg: anyio.abc.TaskGroup | None
) -> dict[str, Reader]:
    readers = {r.rid: Reader(router.generate(r), MonotonicClock()) for r in requests}
    if tg is not None:
        for reader in readers.values():
            tg.start_soon(reader.run)
    return readers


def links_to(procs: dict[str, Any]) -> list[ReplicaLink]:
    """An HTTP link to each running replica process, by its name."""
    return [HttpLink(n, p.url) for n, p in procs.items()]


@contextlib.asynccontextmanager
async def real_routing(
    links: Sequence[ReplicaLink], requests: Sequence[Request], **options: Any
) -> AsyncIterator[tuple[RouterUnderTest, dict[str, Reader]]]:
    """The router under test over ``links``, serving, with a client task reading each of
    ``requests``: the arrangement of the tests on real processes, said once."""
    router = real_router(links, **options)
    async with serving(router), anyio.create_task_group() as tg:
        yield router, start_real(router, requests, tg)


async def replica_at_token(
    router: RouterUnderTest, readers: dict[str, Reader], rid: str, n: int
) -> str:
    """Wait in real time until ``rid``'s client has ``n`` tokens: the replica that
    streams ``rid`` then, where a test places its fault."""
    await stream_until(readers, lambda: len(readers[rid].tokens) >= n, f"{rid} at token {n}")
    where = router.replicas.replica_of(rid)
    if where is None:
        raise AssertionError(f"{rid}, streaming its token {n}, runs on no replica")
    return where


async def finish_real(readers: dict[str, Reader]) -> None:
    """Wait in real time (a hard deadline) until every stream has ended."""
    await stream_until(readers, lambda: ended(readers), "every stream to end")


async def consume_real(reader: Reader) -> None:
    with anyio.fail_after(REAL_DEADLINE_S):
        await reader.run()


async def stream_until(readers: dict[str, Reader], done: Any, what: str) -> None:
    """Wait in real time (a hard deadline) until ``done()``."""
    try:
        with anyio.fail_after(REAL_DEADLINE_S):
            while not done():
                await anyio.sleep(REAL_STEP_US / 1e6 / 4)
    except TimeoutError:
        got = {rid: (len(r.tokens), r.ended) for rid, r in readers.items()}
        raise AssertionError(
            f"waited {REAL_DEADLINE_S:.0f} s for {what}; streams (tokens, state): {got}"
        ) from None


#: What a broken replica answers to any request.
GARBAGE = {
    "a 500": b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 5\r\n\r\noops\n",
    "a 200 that is not an event stream": (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 3\r\n\r\nhi\n"
    ),
    "a truncated event": (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
        b'data: {"id": "r0", "choi'
    ),
    "an event that is not JSON": (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
        b"data: {{{\n\n"
    ),
    "a closed connection": b"",
}


@contextlib.asynccontextmanager
async def garbage_server(answer: bytes) -> AsyncIterator[str]:
    """A server on loopback that answers every connection with ``answer``, then closes it;
    ``/health`` too, so a probe never brings it back."""

    async def serve(conn: Any) -> None:
        async with conn:
            with contextlib.suppress(Exception):
                await conn.receive()
                if answer:
                    await conn.send(answer)

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, serve)
        yield f"http://127.0.0.1:{port}"
        tg.cancel_scope.cancel()


__all__ = [
    "GARBAGE",
    "REAL_DEADLINE_S",
    "REAL_STEP_US",
    "consume_real",
    "finish_real",
    "garbage_server",
    "links_to",
    "real_expected",
    "real_router",
    "real_routing",
    "replica_at_token",
    "replicas",
    "start_real",
    "stream_until",
]
