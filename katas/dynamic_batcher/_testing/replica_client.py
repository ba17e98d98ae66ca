"""A client of one replica (:mod:`.replica`): one streamed completion over HTTP/1.1.

::

    async with stream_completion("http://127.0.0.1:8000", request) as completion:
        async for tokens, finish_reason in completion:
            ...

(``async for`` on it directly works too; leaving early without ``async with`` leaves the
connection to :meth:`CompletionStream.aclose`.) Each item is one event of the replica:
the tokens of one delivery, and ``None`` — or, on the last, why the request finished.
A ``429`` raises :class:`~katas.dynamic_batcher.api.Overloaded` with the replica's
``retry_after_ns``; anything else that is not a whole, well-formed stream — a refused or
dead connection (before the answer or mid-stream), another status, a body that is not
``text/event-stream``, a truncated or garbled event, an error event, silence past
``idle_timeout_s`` — raises :class:`~katas.dynamic_batcher.api.ReplicaError`. Closing the
stream before its end closes the connection: the replica aborts the request.
"""

from __future__ import annotations

import contextlib
import json
from types import TracebackType
from typing import Any, get_args
from urllib.parse import urlsplit

import anyio
import anyio.abc
import h11

from katas._runtime.clock import NS_PER_S
from katas.dynamic_batcher.api import FinishReason, Overloaded, ReplicaError, Request

from .replica import COMPLETIONS, request_body

#: What one item of a completion is: a delivery's tokens, and the finish reason on the last.
Item = tuple[tuple[int, ...], FinishReason | None]
_REASONS = frozenset(get_args(FinishReason))
_MAX_EVENT = 1024 * 1024


class CompletionStream:
    """One streamed completion: ``async for tokens, finish_reason in it``."""

    def __init__(
        self,
        url: str,
        request: Request,
        *,
        connect_timeout_s: float = 5.0,
        idle_timeout_s: float | None = 10.0,
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"a replica's URL is http://host:port[/path], got {url!r}")
        self.url = url
        self.request = request
        self._host = parts.hostname
        self._port = parts.port or 80
        self._path = parts.path if parts.path not in ("", "/") else COMPLETIONS
        self._connect_timeout_s = connect_timeout_s
        self._idle_timeout_s = idle_timeout_s
        self._sock: anyio.abc.SocketStream | None = None
        self._conn = h11.Connection(h11.CLIENT)
        self._buffer = b""
        self._started = False
        self._finished = False  # the finish reason arrived
        self._done = False  # [DONE] arrived
        self._over = False  # nothing more to read: the end, an error, or aclose()

    # -- the iteration ----------------------------------------------------------------------
    def __aiter__(self) -> CompletionStream:
        return self

    async def __anext__(self) -> Item:
        if self._over:
            raise StopAsyncIteration
        try:
            if not self._started:
                self._started = True
                await self._open()
            item = await self._next_item()
        except BaseException:
            await self.aclose()
            raise
        if item is None:
            await self.aclose()
            raise StopAsyncIteration
        return item

    async def aclose(self) -> None:
        """Stop reading; an unfinished completion's connection closes (the replica then
        aborts the request)."""
        self._over = True
        sock, self._sock = self._sock, None
        if sock is not None:
            with contextlib.suppress(Exception):
                await sock.aclose()

    async def __aenter__(self) -> CompletionStream:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    # -- the wire ---------------------------------------------------------------------------
    def _fail(self, why: str) -> ReplicaError:
        return ReplicaError(f"replica {self.url}, request {self.request.rid!r}: {why}")

    async def _open(self) -> None:
        body = json.dumps(request_body(self.request)).encode()
        try:
            with anyio.fail_after(self._connect_timeout_s):
                self._sock = await anyio.connect_tcp(self._host, self._port)
        except (OSError, TimeoutError) as exc:
            raise self._fail(f"cannot connect: {exc!r}") from exc
        head = h11.Request(
            method="POST",
            target=self._path,
            headers=[
                ("Host", f"{self._host}:{self._port}"),
                ("Content-Type", "application/json"),
                ("Accept", "text/event-stream"),
                ("Content-Length", str(len(body))),
            ],
        )
        data = b"".join(
            self._conn.send(e) or b"" for e in (head, h11.Data(data=body), h11.EndOfMessage())
        )
        try:
            await self._sock.send(data)
        except (OSError, anyio.BrokenResourceError) as exc:
            raise self._fail(f"the connection died sending the request: {exc!r}") from exc
        response = await self._event()
        if not isinstance(response, h11.Response):
            raise self._fail(f"expected a response, got {response!r}")
        headers = {k.decode().lower(): v.decode("latin-1") for k, v in response.headers}
        if response.status_code == 429:
            text = await self._rest_of_body()
            raise Overloaded(
                f"replica {self.url} refused {self.request.rid!r}: {text.strip()}",
                retry_after_ns=_retry_after_ns(headers),
            )
        if response.status_code != 200:
            text = await self._rest_of_body()
            raise self._fail(f"status {response.status_code}: {text.strip()[:200]}")
        kind = headers.get("content-type", "").partition(";")[0].strip().lower()
        if kind != "text/event-stream":
            raise self._fail(f"the body is not an event stream (Content-Type {kind!r})")

    async def _event(self) -> Any:
        """The next h11 event of the response (reading the socket as needed)."""
        while True:
            try:
                got = self._conn.next_event()
            except h11.RemoteProtocolError as exc:
                raise self._fail(f"the answer broke HTTP/1.1: {exc}") from exc
            if got is not h11.NEED_DATA:
                return got
            assert self._sock is not None
            try:
                if self._idle_timeout_s is None:
                    data = await self._sock.receive()
                else:
                    with anyio.fail_after(self._idle_timeout_s):
                        data = await self._sock.receive()
            except anyio.EndOfStream:
                data = b""  # h11 says whether the answer was whole
            except TimeoutError as exc:
                raise self._fail(f"silent for {self._idle_timeout_s} s") from exc
            except (OSError, anyio.BrokenResourceError, anyio.ClosedResourceError) as exc:
                raise self._fail(f"the connection died: {exc!r}") from exc
            try:
                self._conn.receive_data(data)
            except h11.RemoteProtocolError as exc:
                raise self._fail(f"the connection died: {exc}") from exc

    async def _rest_of_body(self) -> str:
        """The body of a short non-stream answer (its first 64 KiB)."""
        body = b""
        while len(body) < 65536:
            got = await self._event()
            if isinstance(got, h11.Data):
                body += got.data
            else:
                break
        return body.decode("utf-8", "replace")

    async def _next_item(self) -> Item | None:
        """The next delivery; None after ``[DONE]`` and the response's clean end."""
        while True:
            end = self._buffer.find(b"\n\n")
            if end >= 0:
                block, self._buffer = self._buffer[:end], self._buffer[end + 2 :]
                item = self._interpret(block)
                if item is not None:
                    return item
                if self._done:
                    await self._expect_end()
                    return None
                continue
            if len(self._buffer) > _MAX_EVENT:
                raise self._fail(f"an event longer than {_MAX_EVENT} bytes")
            got = await self._event()
            if isinstance(got, h11.Data):
                self._buffer += bytes(got.data)
            elif isinstance(got, h11.EndOfMessage):
                what = "a truncated event" if self._buffer.strip() else "no [DONE]"
                raise self._fail(f"the stream ended with {what}")
            else:
                raise self._fail(f"unexpected {got!r} in the stream")

    def _interpret(self, block: bytes) -> Item | None:
        """One event block: its item, or None for ``[DONE]`` or a comment-only block."""
        data: list[str] = []
        for raw in block.split(b"\n"):
            try:
                line = raw.decode("utf-8").rstrip("\r")
            except UnicodeDecodeError:
                raise self._fail(f"an event that is not UTF-8: {block[:80]!r}") from None
            if line.startswith(":"):
                continue
            field, colon, value = line.partition(":")
            if field != "data" or not colon:
                raise self._fail(f"a garbled event line: {line[:80]!r}")
            data.append(value[1:] if value.startswith(" ") else value)
        if not data:
            return None
        text = "\n".join(data)
        if text == "[DONE]":
            if not self._finished:
                raise self._fail("[DONE] before any finish reason")
            self._done = True
            return None
        if self._finished:
            raise self._fail(f"an event after the finish reason: {text[:80]!r}")
        return self._item(text)

    def _item(self, text: str) -> Item:
        try:
            payload = json.loads(text)
        except json.JSONDecodeError:
            raise self._fail(f"an event that is not JSON: {text[:80]!r}") from None
        if not isinstance(payload, dict) or payload.get("id") != self.request.rid:
            raise self._fail(f"an event not of this request: {text[:80]!r}")
        if "error" in payload:
            raise self._fail(f"the replica ended the stream: {payload['error']}")
        choices = payload.get("choices")
        if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
            raise self._fail(f"an event without one choice: {text[:80]!r}")
        tokens, reason = choices[0].get("tokens"), choices[0].get("finish_reason")
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens
        ):
            raise self._fail(f"an event whose tokens are not token ids: {text[:80]!r}")
        if reason is not None and reason not in _REASONS:
            raise self._fail(f"an unknown finish reason {reason!r}")
        if reason is None and not tokens:
            raise self._fail("an event with neither tokens nor a finish reason")
        self._finished = reason is not None
        return tuple(tokens), reason

    async def _expect_end(self) -> None:
        if self._buffer.strip():
            raise self._fail(f"bytes after [DONE]: {self._buffer[:80]!r}")
        while True:
            got = await self._event()
            if isinstance(got, h11.EndOfMessage):
                return
            if not isinstance(got, h11.Data) or bytes(got.data).strip():
                raise self._fail(f"something after [DONE]: {got!r}")


def _retry_after_ns(headers: dict[str, str]) -> int:
    """A 429's wait: ``x-retry-after-ns``, else ``Retry-After`` seconds, else 1 s."""
    for name, scale in (("x-retry-after-ns", 1), ("retry-after", NS_PER_S)):
        value = headers.get(name, "").strip()
        if value.isdigit():
            return max(1, int(value) * scale)
    return NS_PER_S


def stream_completion(
    url: str,
    request: Request,
    *,
    connect_timeout_s: float = 5.0,
    idle_timeout_s: float | None = 10.0,
) -> CompletionStream:
    """Stream ``request`` from the replica at ``url`` (``http://host:port``, the path
    ``/v1/completions`` unless the URL names one). Connects on the first read."""
    return CompletionStream(
        url, request, connect_timeout_s=connect_timeout_s, idle_timeout_s=idle_timeout_s
    )


__all__ = ["CompletionStream", "Item", "stream_completion"]
