"""Reference solution, stage 3: one event stream, resumed across replicas.

The source is a loop of connections around one stage-1 parser. The parser is the whole
of exactly-once: it dispatches only events whose blank line arrived, its
``last_event_id`` is the ID of the last of them, and ``close()`` between responses
discards a cut event while keeping that ID and the server's ``retry``. A reconnect
sends that ID, so the server resumes right after the last event the caller got.

Everything else is about *when* and *where* to reconnect: after the server's
``retry``, doubled for each attempt in a row that delivered nothing, capped and
jittered (so a thousand clients cut by one failure do not come back in lockstep), each
attempt to the next replica. Which answers are worth another attempt follows the API
clients, not the browser: 5xx, 429 and network errors are; 204 is the server's "stop";
any other answer will not change by asking again.
"""

from __future__ import annotations

import random as _random
from collections import deque
from collections.abc import AsyncIterator, Sequence
from types import TracebackType

import anyio
import httpx

from katas._runtime.checks import positive_int
from katas._runtime.clock import NS_PER_MS, NS_PER_S, MonotonicClock, WaitingClock
from katas.streaming_parser.api import (
    DEFAULT_MAX_EVENT_BYTES,
    DEFAULT_MAX_LINE_BYTES,
    EventSourceError,
    ParseError,
    ServerSentEvent,
)

from .stage1 import EventStreamParser

_RETRY_AFTER = (429, 503)  # the statuses whose Retry-After header is a wait


class ResumableEventSource:
    """Every event of one SSE endpoint, in order, exactly once, across reconnects and
    replicas: ``async with ResumableEventSource(client, urls) as source: async for …``."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        urls: Sequence[str],
        *,
        clock: WaitingClock | None = None,
        random: _random.Random | None = None,
        retry_ms: int = 1000,
        max_backoff_ms: int = 30_000,
        max_attempts: int = 8,
        idle_timeout_s: float | None = None,
        max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
        max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES,
    ) -> None:
        if isinstance(urls, str) or not isinstance(urls, Sequence):
            raise TypeError(f"urls must be a sequence of URLs, got {urls!r}")
        if not urls or not all(isinstance(u, str) and u for u in urls):
            raise ValueError(f"urls must hold at least one URL, each a non-empty str: {urls!r}")
        if idle_timeout_s is not None and (
            isinstance(idle_timeout_s, bool)
            or not isinstance(idle_timeout_s, (int, float))
            or not idle_timeout_s > 0
        ):
            raise ValueError(f"idle_timeout_s must be None or seconds > 0, got {idle_timeout_s!r}")
        self._client = client
        self._urls = list(urls)
        self._clock = clock if clock is not None else MonotonicClock()
        self._random = random if random is not None else _random.Random()
        self._retry_ms = positive_int("retry_ms", retry_ms)
        self._max_backoff_ms = positive_int("max_backoff_ms", max_backoff_ms)
        self._max_attempts = positive_int("max_attempts", max_attempts)
        self._idle_timeout_s = idle_timeout_s
        self._parser = EventStreamParser(
            max_line_bytes=max_line_bytes, max_event_bytes=max_event_bytes
        )
        self._events: deque[ServerSentEvent] = deque()
        self._response: httpx.Response | None = None
        self._url = ""  # the URL of the open response
        self._chunks: AsyncIterator[bytes] | None = None
        self._next_url = 0
        self._connected_once = False
        self._failures = 0  # attempts in a row that delivered no event
        self._delivered = False  # the open response has delivered an event
        self._retry_after_ns = 0  # the last 429/503's Retry-After
        self._error: BaseException | None = None  # to raise once the events before it are out
        self._ended = False
        self._scope: anyio.CancelScope | None = None  # the __anext__ that is waiting, if any

    @property
    def last_event_id(self) -> str:
        """The ID of the last event delivered (what a reconnect sends)."""
        return self._parser.last_event_id

    @property
    def retry_ms(self) -> int:
        """The reconnection time: the server's last valid ``retry``, else the constructor's."""
        server = self._parser.retry_ms
        return server if server is not None else self._retry_ms

    async def __aenter__(self) -> ResumableEventSource:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop: the open response is closed and a waiting ``__anext__`` ends at once."""
        self._ended = True
        self._events.clear()
        if self._scope is not None:
            self._scope.cancel()
        await self._disconnect()

    def __aiter__(self) -> ResumableEventSource:
        return self

    async def __anext__(self) -> ServerSentEvent:
        with anyio.CancelScope() as self._scope:
            try:
                while not self._events and self._error is None and not self._ended:
                    await self._step()
            finally:
                self._scope = None
        if self._events:
            return self._events.popleft()
        if self._error is not None:
            error, self._error = self._error, None
            self._ended = True
            raise error
        raise StopAsyncIteration

    async def _step(self) -> None:
        """Read the next chunk of the open response, or open one."""
        if self._chunks is None:
            await self._connect()
            return
        try:
            chunk = await self._chunks.__anext__()
        except StopAsyncIteration:  # the server ended the response: resume where it ended
            await self._dropped()
            return
        except httpx.TransportError as exc:  # reset, cut, or idle past the read timeout
            await self._dropped(exc)
            return
        try:
            events = self._parser.feed(chunk)
        except ParseError as exc:  # a hostile or broken server: asking again won't help
            self._events.extend(exc.events)
            self._error = exc
            await self._disconnect()
            return
        if events:
            self._delivered = True
            self._failures = 0
            self._events.extend(events)

    async def _dropped(self, cause: BaseException | None = None) -> None:
        if not self._delivered:
            self._failures += 1
        await self._disconnect()
        self._parser.close()  # a cut event is discarded; the ID and retry are kept
        self._check_attempts(self._url, None, cause)

    async def _connect(self) -> None:
        if self._connected_once:
            await self._backoff()
        self._connected_once = True
        url = self._urls[self._next_url]
        self._next_url = (self._next_url + 1) % len(self._urls)  # failover: the next replica
        headers = {"Accept": "text/event-stream", "Cache-Control": "no-cache"}
        if self._parser.last_event_id:  # an empty header would mean "from the start"
            headers["Last-Event-ID"] = self._parser.last_event_id
        request = self._client.build_request("GET", url, headers=headers, timeout=self._timeout())
        try:
            response = await self._client.send(request, stream=True)
        except httpx.TransportError as exc:  # refused, reset, timed out: a replica is down
            self._failures += 1
            self._check_attempts(url, None, exc)
            return
        status = response.status_code
        content_type = response.headers.get("content-type", "")
        if status == 200 and content_type.partition(";")[0].strip().lower() == "text/event-stream":
            self._response, self._chunks = response, response.aiter_bytes()
            self._url = url
            self._delivered = False
            return
        await response.aclose()
        if status == 204:  # the server says the stream is over
            self._ended = True
        elif status == 429 or 500 <= status <= 599:
            self._failures += 1
            self._retry_after_ns = _retry_after_ns(response) if status in _RETRY_AFTER else 0
            self._check_attempts(url, status)
        else:
            what = f"status {status}" if status != 200 else f"content type {content_type!r}"
            self._error = EventSourceError(f"{url} answered {what}", url=url, status=status)

    def _check_attempts(
        self, url: str, status: int | None, cause: BaseException | None = None
    ) -> None:
        if self._failures >= self._max_attempts:
            self._error = EventSourceError(
                f"{self._failures} attempts in a row delivered no event; the last, to {url}, "
                + (f"answered {status}" if status else f"ended: {cause or 'no event'}"),
                url=url,
                status=status,
            )
            self._error.__cause__ = cause

    async def _backoff(self) -> None:
        """Wait before a reconnection: the server's retry, doubled for each attempt in a
        row that delivered nothing, capped, drawn from [d/2, d] (equal jitter: never less
        than half, so a server's retry is roughly kept, and never in lockstep)."""
        k = max(1, self._failures)
        d_ns = min(self._max_backoff_ms, self.retry_ms * 2 ** min(k - 1, 62)) * NS_PER_MS
        wait_ns = max(int(self._random.uniform(d_ns / 2, d_ns)), self._retry_after_ns)
        self._retry_after_ns = 0
        await self._clock.sleep_until_ns_async(self._clock.now_ns() + wait_ns)

    def _timeout(self) -> httpx.Timeout:
        own = self._client.timeout
        if self._idle_timeout_s is None:
            return own
        return httpx.Timeout(
            connect=own.connect, read=self._idle_timeout_s, write=own.write, pool=own.pool
        )

    async def _disconnect(self) -> None:
        response, self._response, self._chunks = self._response, None, None
        if response is not None:
            with anyio.CancelScope(shield=True):  # closed even when cancelled: no leak
                await response.aclose()


def _retry_after_ns(response: httpx.Response) -> int:
    """A Retry-After of delay-seconds, in ns (an HTTP date, or garbage, counts as none)."""
    value = response.headers.get("retry-after", "").strip()
    return int(value) * NS_PER_S if value.isascii() and value.isdigit() else 0


__all__ = ["EventSourceError", "ResumableEventSource"]
