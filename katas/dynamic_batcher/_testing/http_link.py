"""A replica process as the router reaches it: an ``api.ReplicaLink`` over loopback HTTP.

::

    with replica.running(selection, "a", batcher="prefix") as a:
        link = HttpLink("a", a.url)
        async with Router([link], ...) as router:
            ...

``stream(request)`` is :func:`~.replica_client.stream_completion` with no idle timeout
(the router, not the link, decides how long silence may last: its ``stall_timeout_ns``),
so a killed replica is a ``ReplicaError`` at the next read and a stopped one is silence.
``healthy()`` asks ``GET /health``: True on ``200``, False on any other status; a
connection refused or broken, or an answer that is not HTTP, is a ``ReplicaError``. A
stopped replica accepts the connection (the kernel does) and never answers: the caller
bounds the wait, as ``ReplicaLink`` says.
"""

from __future__ import annotations

from urllib.parse import urlsplit

import anyio
import anyio.abc
import h11

from katas.dynamic_batcher.api import ReplicaError, Request

from .replica import HEALTH
from .replica_client import CompletionStream, stream_completion

_MAX_ANSWER = 64 * 1024


class HttpLink:
    """One replica at ``url`` (``http://127.0.0.1:PORT``), named ``name`` for the router."""

    def __init__(self, name: str, url: str, *, connect_timeout_s: float = 5.0) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"a replica's URL is http://host:port, got {url!r}")
        self._name = name
        self.url = url
        self._host = parts.hostname
        self._port = parts.port or 80
        self._connect_timeout_s = connect_timeout_s

    @property
    def name(self) -> str:
        return self._name

    def __repr__(self) -> str:
        return f"HttpLink({self._name!r}, {self.url!r})"

    def stream(self, request: Request) -> CompletionStream:
        """``request`` streamed from the replica (connects on the first read)."""
        return stream_completion(
            self.url, request, connect_timeout_s=self._connect_timeout_s, idle_timeout_s=None
        )

    async def healthy(self) -> bool:
        """``GET /health``: True if the replica answers ``200``."""
        return await probe_health(self.url, connect_timeout_s=self._connect_timeout_s)


async def probe_health(url: str, *, connect_timeout_s: float = 5.0) -> bool:
    """Whether the replica at ``url`` answers ``GET /health`` with ``200`` (False for
    another status; ``ReplicaError`` if it cannot be reached or its answer is not HTTP).
    Unbounded once connected: the caller bounds the wait."""
    parts = urlsplit(url)
    host, port = parts.hostname or "", parts.port or 80

    def failed(why: str) -> ReplicaError:
        return ReplicaError(f"replica {url}: health probe: {why}")

    try:
        with anyio.fail_after(connect_timeout_s):
            sock = await anyio.connect_tcp(host, port)
    except (OSError, TimeoutError) as exc:
        raise failed(f"cannot connect: {exc!r}") from exc
    conn = h11.Connection(h11.CLIENT)
    async with sock:
        ask = h11.Request(
            method="GET",
            target=HEALTH,
            headers=[("Host", f"{host}:{port}"), ("Connection", "close")],
        )
        try:
            await sock.send((conn.send(ask) or b"") + (conn.send(h11.EndOfMessage()) or b""))
        except (OSError, anyio.BrokenResourceError) as exc:
            raise failed(f"the connection died: {exc!r}") from exc
        status = None
        read = 0
        while True:
            try:
                got = conn.next_event()
            except h11.RemoteProtocolError as exc:
                raise failed(f"the answer broke HTTP/1.1: {exc}") from exc
            if isinstance(got, h11.Response):
                status = got.status_code
            elif isinstance(got, h11.Data):
                read += len(got.data)
                if read > _MAX_ANSWER:
                    raise failed(f"an answer longer than {_MAX_ANSWER} bytes")
            elif isinstance(got, h11.EndOfMessage):
                assert status is not None  # h11 gives the head before the end
                return status == 200
            elif got is h11.NEED_DATA:
                try:
                    data = await sock.receive()
                except anyio.EndOfStream:
                    data = b""  # h11 then says whether the answer was whole
                except (OSError, anyio.BrokenResourceError) as exc:
                    raise failed(f"the connection died: {exc!r}") from exc
                conn.receive_data(data)
            elif isinstance(got, h11.ConnectionClosed):
                raise failed("the connection closed with no answer")
            # else an informational (1xx) head: the answer follows


__all__ = ["HttpLink", "probe_health"]
