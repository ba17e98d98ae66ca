"""HTTP/1.1 for the replica processes a kata's tests start: one h11 request per
connection on loopback, ``Connection: close``, answers built from these heads.

A replica answers each connection in :func:`serve_one`: a client that goes away ends
its connection quietly, and a bug in an answer is said on the replica's output (where
the test reads it) instead of taking the whole replica down.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable

import anyio
import anyio.abc
import h11

from .child import say


def head(status: int, headers: list[tuple[str, str]]) -> h11.Response:
    """A response head that closes the connection after the body."""
    return h11.Response(
        status_code=status, headers=[*headers, ("Connection", "close"), ("Server", "replica")]
    )


def stream_head(content_type: str = "text/event-stream") -> h11.Response:
    """The head of a ``200`` event stream."""
    return head(200, [("Content-Type", content_type), ("Cache-Control", "no-cache")])


async def serve_one(
    stream: anyio.abc.SocketStream,
    answer: Callable[[h11.Connection], Awaitable[None]],
    *,
    max_request: int,
) -> None:
    """Answer one connection with ``answer`` (given a fresh server-side h11 connection
    that buffers at most ``max_request`` bytes of a request), then close it."""
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=max_request)
    try:
        await answer(conn)
    except (anyio.BrokenResourceError, anyio.ClosedResourceError, h11.ProtocolError, OSError):
        pass  # the client went away: its connection is over, the replica is not
    except Exception as exc:  # a bug here must show, and not take the replica down
        say(f"error {exc!r}")
    finally:
        with contextlib.suppress(Exception):
            await stream.aclose()


__all__ = ["head", "serve_one", "stream_head"]
