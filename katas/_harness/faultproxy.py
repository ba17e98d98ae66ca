"""An in-process TCP proxy that puts network faults between a client and a server.

A test points its client at :class:`FaultProxy` instead of the server and then says
what the network does:

- ``outage()``: every open connection is reset and new ones are reset on accept, so
  the client sees "connection refused/reset" at once;
- ``blackhole()``: connections are accepted and requests swallowed, never answered,
  so only a client-side socket timeout ends the wait (the failure that hangs
  services whose clients have none);
- ``drop_replies()``: requests still reach the server, which applies them, but every
  reply is discarded, so the client times out not knowing its write happened (the
  ambiguous failure a retry with an idempotency key must survive);
- ``busy()``: every command is answered ``-BUSY …`` without reaching the server, as a
  server busy with a long script answers (``busy-reply-threshold``); the stream stays in
  step, so ``heal()`` keeps the connections;
- ``truncate_next_reply(n)``: the next connection gets only the first ``n`` bytes of
  the server's reply, then is reset — a cut at an exact byte of a response (inside a
  header, a chunk, an event);
- ``set_latency_ns(ns)``: every client→server chunk is delayed (real time);
- ``heal()``: forward again. Connections that lost bytes in a blackhole or lost
  replies in ``drop_replies`` are reset, as their protocol stream is no longer in step.

It also counts what the client asked for: ``round_trips`` (a client send after the
previous reply, so a pipeline is one) and ``commands`` (parsed from the client's
RESP arrays). Loopback only; one daemon thread per direction per connection; every
wait is bounded, and :meth:`close` joins the threads with a deadline.
"""

from __future__ import annotations

import contextlib
import select
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

Fault = Literal["none", "outage", "blackhole", "drop_replies", "busy"]
_FORWARDING: tuple[Fault, ...] = ("none", "drop_replies")  # faults that still reach the server

#: What a server running a script past ``busy-reply-threshold`` answers every command.
BUSY_REPLY = (
    b"-BUSY Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSCRIPT.\r\n"
)
#: How a server that is up but cannot serve now answers, by code: what :meth:`FaultProxy.
#: refuse` sends (Redis's own texts).
UNAVAILABLE_REPLIES = {
    "BUSY": BUSY_REPLY,
    "LOADING": b"-LOADING Redis is loading the dataset in memory\r\n",
    "MASTERDOWN": b"-MASTERDOWN Link with MASTER is down and replica-serve-stale-data is "
    b"set to 'no'.\r\n",
    "TRYAGAIN": b"-TRYAGAIN Multiple keys request during rehashing of slot\r\n",
    "CLUSTERDOWN": b"-CLUSTERDOWN The cluster is down\r\n",
}
_POLL_S = 0.02  # how often blocked threads look at the stop flag
_JOIN_DEADLINE_S = 5.0
_CONNECT_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class ProxyCounts:
    """What the client sent through the proxy since the last ``reset_counts()``."""

    round_trips: int
    commands: tuple[str, ...]  # upper-cased command names, in order
    connections: int  # connections accepted
    refused: int = 0  # connections reset on accept, during an outage


class RespCommandParser:
    """Splits a client's byte stream into command names (RESP arrays or inline commands)."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[str]:
        """Add bytes; return the names of the commands now complete."""
        self._buf += data
        names: list[str] = []
        while True:
            parsed = self._parse_one()
            if parsed is None:
                return names
            consumed, name = parsed
            del self._buf[:consumed]
            names.append(name)

    def _parse_one(self) -> tuple[int, str] | None:
        buf = self._buf
        end = buf.find(b"\r\n")
        if end < 0:
            return None
        if buf[:1] != b"*":  # inline command: one line of words
            words = bytes(buf[:end]).split()
            return end + 2, (words[0].decode("latin-1").upper() if words else "")
        count = int(buf[1:end])
        pos = end + 2
        first = ""
        for i in range(count):
            line_end = buf.find(b"\r\n", pos)
            if line_end < 0 or buf[pos : pos + 1] != b"$":
                return None
            size = int(buf[pos + 1 : line_end])
            start = line_end + 2
            if len(buf) < start + size + 2:
                return None
            if i == 0:
                first = bytes(buf[start : start + size]).decode("latin-1").upper()
            pos = start + size + 2
        return pos, first


def _reset(sock: socket.socket) -> None:
    """Close with an RST (SO_LINGER 0): the peer fails now instead of seeing a clean EOF."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


class _Link:
    """One proxied connection: the client socket, the upstream socket and two pumps."""

    def __init__(self, proxy: FaultProxy, client: socket.socket, upstream: socket.socket | None):
        self.proxy = proxy
        self.client = client
        self.upstream = upstream
        self.closed = threading.Event()
        self.tainted = False  # bytes were dropped: the RESP stream is out of step
        self.awaiting_reply = False
        self.reply_budget: int | None = None  # bytes of reply left to forward, if limited
        self.parser = RespCommandParser()
        self.threads = [
            threading.Thread(target=self._pump_up, daemon=True, name="faultproxy-up"),
            threading.Thread(target=self._pump_down, daemon=True, name="faultproxy-down"),
        ]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def close(self) -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        _reset(self.client)
        if self.upstream is not None:
            _reset(self.upstream)

    def _recv(self, sock: socket.socket) -> bytes | None:
        """Next chunk, b"" at EOF, None when nothing arrived within the poll interval."""
        try:
            ready, _, _ = select.select([sock], [], [], _POLL_S)
            if not ready:
                return None
            return sock.recv(65536)
        except (OSError, ValueError):
            return b""

    def _pump_up(self) -> None:
        """Client → server: count, maybe delay, forward (or swallow in a blackhole)."""
        while not self.closed.is_set():
            data = self._recv(self.client)
            if data is None:
                continue
            if not data:
                break
            fault = self.proxy.fault
            if fault == "busy":  # answered here, one error per command: still in step
                commands = self.proxy._count(self, data)
                self.awaiting_reply = False
                try:
                    self.client.sendall(self.proxy.refusal * commands)
                except OSError:
                    break
                continue
            if fault not in _FORWARDING or self.upstream is None:
                self.tainted = True  # swallowed: never answered
                continue
            if fault == "drop_replies":
                self.tainted = True  # applied, but its reply is lost (or comes after heal)
            self.proxy._count(self, data)
            delay = self.proxy.latency_ns
            if delay:
                time.sleep(delay / 1e9)
            try:
                self.upstream.sendall(data)
            except OSError:
                break
        self.close()

    def _pump_down(self) -> None:
        """Server → client: forward replies (or drop them in a blackhole/drop_replies)."""
        while not self.closed.is_set():
            if self.upstream is None:
                if self.closed.wait(_POLL_S):
                    break
                continue
            data = self._recv(self.upstream)
            if data is None:
                continue
            if not data:
                break
            self.awaiting_reply = False  # the server answered, delivered or not
            if self.proxy.fault != "none":
                self.tainted = True
                continue
            if self.reply_budget is not None:
                data = data[: self.reply_budget]
                self.reply_budget -= len(data)
            try:
                self.client.sendall(data)
            except OSError:
                break
            if self.reply_budget == 0:
                break  # truncated: reset both sides
        self.close()


class FaultProxy:
    """A loopback TCP proxy to ``upstream`` that can fail on command. Use as a context manager."""

    def __init__(self, upstream: tuple[str, int], *, listen_host: str = "127.0.0.1") -> None:
        if listen_host not in ("127.0.0.1", "::1", "localhost"):
            raise ValueError(f"listen_host must be a loopback address, got {listen_host!r}")
        self.upstream = upstream
        self.fault: Fault = "none"
        self.refusal = BUSY_REPLY  # what a "busy" proxy answers each command
        self.latency_ns = 0
        self._lock = threading.Lock()
        self._links: list[_Link] = []
        self._round_trips = 0
        self._commands: list[str] = []
        self._connections = 0
        self._refused = 0
        self._truncations: deque[int] = deque()
        self._stop = threading.Event()
        self._listener = socket.create_server((listen_host, 0))
        self._listener.settimeout(_POLL_S)
        self._acceptor = threading.Thread(target=self._accept_loop, daemon=True, name="faultproxy")
        self._acceptor.start()

    # -- where clients connect -------------------------------------------------------
    @property
    def address(self) -> tuple[str, int]:
        host, port = self._listener.getsockname()[:2]
        return str(host), int(port)

    @property
    def host(self) -> str:
        return self.address[0]

    @property
    def port(self) -> int:
        return self.address[1]

    # -- faults ----------------------------------------------------------------------
    def outage(self) -> None:
        """Reset every connection now and every new one on accept, until ``heal()``."""
        self.fault = "outage"
        self._close_links(lambda link: True)

    def blackhole(self) -> None:
        """Accept and swallow: requests are never answered, until ``heal()``."""
        self.fault = "blackhole"

    def drop_replies(self) -> None:
        """Forward requests (the server applies them) but discard replies, until ``heal()``."""
        self.fault = "drop_replies"

    def busy(self) -> None:
        """Answer every command ``-BUSY …`` without forwarding it, until ``heal()``."""
        self.refuse("BUSY")

    def refuse(self, code: str) -> None:
        """Answer every command with the error reply ``code`` (a key of
        :data:`UNAVAILABLE_REPLIES`: ``BUSY``, ``LOADING``, ``MASTERDOWN``, ``TRYAGAIN``,
        ``CLUSTERDOWN``) without forwarding it, until ``heal()``."""
        if code not in UNAVAILABLE_REPLIES:
            raise ValueError(f"code must be one of {sorted(UNAVAILABLE_REPLIES)}, got {code!r}")
        self.refusal = UNAVAILABLE_REPLIES[code]
        self.fault = "busy"

    def heal(self) -> None:
        """Forward again; connections that lost bytes meanwhile are reset."""
        self.fault = "none"
        self._close_links(lambda link: link.tainted or link.upstream is None)

    def truncate_next_reply(self, nbytes: int) -> None:
        """The next connection accepted forwards only the first ``nbytes`` bytes of the
        server's reply (``0``: none), then is reset. Calls queue up, one per connection."""
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
            raise ValueError(f"nbytes must be a non-negative int, got {nbytes!r}")
        with self._lock:
            self._truncations.append(nbytes)

    def set_latency_ns(self, ns: int) -> None:
        """Delay each client→server chunk by ``ns`` (real time; 0 turns it off)."""
        if not isinstance(ns, int) or isinstance(ns, bool) or ns < 0:
            raise ValueError(f"ns must be a non-negative int, got {ns!r}")
        self.latency_ns = ns

    def drop_connections(self) -> None:
        """Reset every open connection once (a network blip); new ones are accepted."""
        self._close_links(lambda link: True)

    # -- counting --------------------------------------------------------------------
    def counts(self) -> ProxyCounts:
        with self._lock:
            return ProxyCounts(
                self._round_trips, tuple(self._commands), self._connections, self._refused
            )

    def reset_counts(self) -> None:
        with self._lock:
            self._round_trips = 0
            self._commands.clear()
            self._connections = 0
            self._refused = 0

    def _count(self, link: _Link, data: bytes) -> int:
        """Count what ``data`` completes; how many commands it completes."""
        names = link.parser.feed(data)
        with self._lock:
            if not link.awaiting_reply:
                self._round_trips += 1
                link.awaiting_reply = True
            self._commands.extend(names)
        return len(names)

    # -- plumbing --------------------------------------------------------------------
    def _close_links(self, which: Callable[[_Link], bool]) -> None:
        with self._lock:
            chosen = [link for link in self._links if which(link)]
            self._links = [link for link in self._links if link not in chosen]
        for link in chosen:
            link.close()

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.setblocking(True)
            if self.fault == "outage":
                with self._lock:
                    self._refused += 1
                _reset(client)
                continue
            upstream: socket.socket | None = None
            if self.fault in _FORWARDING:
                try:
                    upstream = socket.create_connection(self.upstream, _CONNECT_TIMEOUT_S)
                    upstream.settimeout(None)
                except OSError:
                    _reset(client)  # the server itself is down: the client sees it too
                    continue
            link = _Link(self, client, upstream)
            with self._lock:
                if self._truncations:
                    link.reply_budget = self._truncations.popleft()
                self._connections += 1
                self._links.append(link)
                # drop links that ended on their own, so a long test does not accumulate them
                self._links = [x for x in self._links if not x.closed.is_set()]
            link.start()

    def close(self) -> None:
        """Stop accepting, reset every connection and join the threads (bounded)."""
        self._stop.set()
        self._listener.close()
        with self._lock:
            links, self._links = self._links, []
        for link in links:
            link.close()
        threads = [self._acceptor, *(t for link in links for t in link.threads)]
        for t in threads:
            if t.is_alive() and t is not threading.current_thread():
                t.join(_JOIN_DEADLINE_S)

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


__all__ = ["Fault", "FaultProxy", "ProxyCounts", "RespCommandParser"]
