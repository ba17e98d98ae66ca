"""httpx transports for the stage-3 tests of ``aclose()``: what a client may be built on,
where closing a response is not as quick, or not as loud, as on a plain HTTP/1.1
connection.

httpx's own transport closes a response's connection in a shielded scope, and closing
it wakes a read waiting on it: a source that closes the response unshielded, or that
leaves a waiting read to be woken by that close, passes over it. Other transports do
neither, and a source is given whatever client its caller built:

- :class:`ClosingLate` wraps a real transport; closing one of its responses takes a
  scheduler pass first (as sending an HTTP/2 ``RST_STREAM`` or a TLS ``close_notify``
  does), so a close made in a cancelled scope and not shielded never happens. It counts
  the responses it opened and those closed.
- :class:`Holding` is a replica in memory: a response head and some bytes, then nothing,
  and closing the response does not wake a read waiting on it (as on an HTTP/2
  connection the response shares with other streams); with ``head`` False, the head
  itself never comes. The reads it holds end when the client is closed.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
import anyio.lowlevel
import httpx


class ClosingLate(httpx.AsyncBaseTransport):
    """``inner``'s responses, each closed a scheduler pass after it is asked to be."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner
        self.opened = 0
        self.closed = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        assert isinstance(response.stream, httpx.AsyncByteStream)  # an async transport's
        self.opened += 1
        return httpx.Response(
            status_code=response.status_code,
            headers=response.headers,
            stream=_ClosingLateStream(response.stream, self),
            extensions=response.extensions,
        )

    async def aclose(self) -> None:
        await self.inner.aclose()


class _ClosingLateStream(httpx.AsyncByteStream):
    def __init__(self, inner: httpx.AsyncByteStream, owner: ClosingLate) -> None:
        self._inner = inner
        self._owner = owner

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._inner:
            yield chunk

    async def aclose(self) -> None:
        await anyio.lowlevel.checkpoint()  # where a cancelled, unshielded close ends
        await self._inner.aclose()
        self._owner.closed += 1


class Holding(httpx.AsyncBaseTransport):
    """Answers every request with a ``200`` event stream of ``body``, then holds: no byte
    more until the client is closed (``head`` False: not even the head)."""

    def __init__(self, body: bytes, *, head: bool = True) -> None:
        self.body = body
        self.head = head
        self.requests = 0
        self.closed = 0  # responses closed by their reader
        self.released = anyio.Event()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.requests += 1
        if not self.head:
            await self.released.wait()
            raise httpx.ConnectError("the client was closed", request=request)
        headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        return httpx.Response(200, headers=headers, stream=_HeldStream(self))

    async def aclose(self) -> None:
        self.released.set()


class _HeldStream(httpx.AsyncByteStream):
    def __init__(self, owner: Holding) -> None:
        self._owner = owner

    async def __aiter__(self) -> AsyncIterator[bytes]:
        if self._owner.body:
            yield self._owner.body
        await self._owner.released.wait()  # a close of this response does not end it

    async def aclose(self) -> None:
        self._owner.closed += 1


__all__ = ["ClosingLate", "Holding"]
