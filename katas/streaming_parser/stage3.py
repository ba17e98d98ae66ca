"""Stage 3 — one event stream, resumed across replicas (httpx, on anyio).

The prompt is katas/streaming_parser/README.md; run the suite with
``pytest katas/streaming_parser -k stage3`` (``-k "stage3 and core"`` for the core).

Rules (the suite checks each one):

- The caller gets every event exactly once, in order, across every reconnect: only
  events whose blank line arrived are delivered.
- Every request sends ``Accept: text/event-stream`` and ``Cache-Control: no-cache``; a
  reconnection sends ``Last-Event-ID`` (the last delivered event's ID), none while it is
  empty. The ID outlives a connection.
- A refused or reset connection, a response that ends, an idle timeout, a 5xx or a
  429 reconnect — each attempt to the next URL in ``urls``, cycling.
- Before a reconnection: wait (injected clock, injected random) uniformly in [d/2, d],
  d = min(max_backoff_ms, retry * 2**(k-1)) ms, retry the server's last ``retry:``
  (else ``retry_ms``), k the attempts in a row that delivered no event (at least 1);
  at least ``Retry-After`` seconds after a 429 or 503 that sends one.
- ``max_attempts`` attempts in a row without an event: ``EventSourceError``.
- 204: the end. Any other status, a 200 that is not ``text/event-stream``, or a
  ``ParseError``: raised (after the events before it), no retry.
- ``idle_timeout_s``: a response silent that many real seconds counts as dropped.
- ``aclose()`` closes the response; a waiting ``__anext__`` ends at once.
"""

from __future__ import annotations

# TODO(stage3): implement every method below; delete each `raise Todo()` as you go.
# Build on your stage-1 EventStreamParser: one parser for the whole stream, fed each
# response's bytes, and close()d when a response ends.
import random as _random
from collections.abc import Sequence
from types import TracebackType

import httpx

from katas._runtime.clock import WaitingClock
from katas._runtime.todo import Todo
from katas.streaming_parser.api import (
    DEFAULT_MAX_EVENT_BYTES,
    DEFAULT_MAX_LINE_BYTES,
    EventSourceError,
    ServerSentEvent,
)

from .stage1 import EventStreamParser

__all__ = ["EventSourceError", "EventStreamParser", "ResumableEventSource"]


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
        """Nothing is requested before the first ``__anext__``. ``clock`` defaults to the
        monotonic clock, ``random`` to a fresh ``random.Random()``."""
        raise Todo()

    @property
    def last_event_id(self) -> str:
        """The ID of the last event delivered (what a reconnect sends)."""
        raise Todo()

    @property
    def retry_ms(self) -> int:
        """The reconnection time: the server's last valid ``retry``, else the constructor's."""
        raise Todo()

    async def __aenter__(self) -> ResumableEventSource:
        raise Todo()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        raise Todo()

    async def aclose(self) -> None:
        """Stop: close the open response; a waiting ``__anext__`` ends at once."""
        raise Todo()

    def __aiter__(self) -> ResumableEventSource:
        raise Todo()

    async def __anext__(self) -> ServerSentEvent:
        raise Todo()
