"""Sources and consumers for the stage-2 suite: upstreams the test controls, and waits that
end by a deadline.

A source is what ``StreamMux.open`` reads: an async iterator of bytes. These record what
the mux did to them — how many chunks it pulled, whether a pull is waiting right now,
how often it called ``aclose()`` and whether that close ran to its end — so a test can
say "exactly two chunks were pulled" or "closed once" instead of guessing from timing.
Any of them can hold its ``aclose()`` until the test lets it finish (``hold_close``,
``release_close``): the instant between "the mux is closing the source" and "closed".


- :class:`ChannelSource`: the test pushes chunks (``push``), ends it (``end``) or makes
  its next pull raise (``fail``); a pull with nothing pushed waits for the test.
- :class:`ListSource`: its chunks are there at once; after them it ends, or raises.
- :class:`NoCloseSource`: a :class:`ListSource` without ``aclose`` (the mux must not
  need one).
- :class:`IterableOnly`: an async iterable that is not an async iterator (``open()``
  must refuse it).

:class:`Consumer` takes a stream's events in a task and records them and how the
iteration ended. :func:`bounded` turns a wait that overruns its deadline into an
assertion that says what was awaited; ``settle`` (the harness's) lets every task run
until all of them wait. What a test does with a mux — build it, take from it, probe its idle
timeouts — is in :mod:`.streams`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

import anyio
import anyio.lowlevel

from katas._harness.virtual_time import settle
from katas._harness.waiting import bounded
from katas._runtime.todo import Todo
from katas.streaming_parser.api import MuxedStream, ServerSentEvent


class _Recording:
    """What every test source records about the mux's calls."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.pulls = 0  # __anext__ calls (chunks asked for)
        self.chunks_given = 0
        self.waiting = False  # a pull is waiting for the test to push something
        self.aclose_calls = 0
        self.aclose_finished = 0  # closes that ran to their end (not cut by a cancellation)
        self.pulls_after_close = 0
        self._close_gate: anyio.Event | None = None  # set: aclose() waits for it

    def hold_close(self) -> None:
        """From now on ``aclose()`` waits, once called, until :meth:`release_close`."""
        self._close_gate = anyio.Event()

    def release_close(self) -> None:
        """Let a held ``aclose()`` (now or later) run to its end."""
        if self._close_gate is not None:
            self._close_gate.set()

    def _pulled(self) -> None:
        self.pulls += 1
        if self.aclose_calls:
            self.pulls_after_close += 1

    async def _close(self) -> None:
        self.aclose_calls += 1
        # A real close does I/O: it awaits. Cut by a cancellation, it leaves the
        # connection open — a mux closes its sources where cancellation cannot reach.
        await anyio.lowlevel.checkpoint()
        await anyio.lowlevel.checkpoint()
        if self._close_gate is not None:
            await self._close_gate.wait()  # the test's deadline bounds this
        self.aclose_finished += 1

    def closed_once(self) -> bool:
        return self.aclose_calls == 1 and self.aclose_finished == 1

    def describe(self) -> str:
        return (
            f"source {self.name!r}: {self.pulls} pulls, {self.chunks_given} chunks given, "
            f"aclose() called {self.aclose_calls}x ({self.aclose_finished} ran to the end), "
            f"{self.pulls_after_close} pulls after aclose, waiting now: {self.waiting}"
        )


class _End:
    pass


_END = _End()


class ChannelSource(_Recording):
    """An upstream the test feeds: ``push(chunk, ...)``, then ``end()`` or ``fail(exc)``.

    A pull with nothing queued waits (``waiting`` is True meanwhile) until the test
    pushes; a cancelled pull takes nothing. ``on_pull(n)``, if set, is called at the start
    of the n-th pull, in the mux's reading task: the instant the mux is done with the
    chunk before (its events handed on), before anything else runs.
    """

    def __init__(self, name: str = "channel", chunks: Sequence[bytes] = ()) -> None:
        super().__init__(name)
        self._queue: deque[bytes | BaseException | _End] = deque(chunks)
        self._arrived = anyio.Event()
        self.on_pull: Callable[[int], None] | None = None

    def push(self, *chunks: bytes) -> None:
        self._queue.extend(chunks)
        self._arrived.set()

    def end(self) -> None:
        self._queue.append(_END)
        self._arrived.set()

    def fail(self, exc: BaseException) -> None:
        self._queue.append(exc)
        self._arrived.set()

    def queued(self) -> int:
        return len(self._queue)

    def __aiter__(self) -> ChannelSource:
        return self

    async def __anext__(self) -> bytes:
        self._pulled()
        if self.on_pull is not None:
            self.on_pull(self.pulls)
        while not self._queue:
            if self._arrived.is_set():
                self._arrived = anyio.Event()
            self.waiting = True
            try:
                await self._arrived.wait()  # the test's deadline bounds this, not the source
            finally:
                self.waiting = False
        item = self._queue.popleft()
        if isinstance(item, _End):
            self._queue.appendleft(item)  # ended stays ended
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        self.chunks_given += 1
        return item

    async def aclose(self) -> None:
        await self._close()


class NoCloseSource(_Recording):
    """Chunks that are there at once, then the end — or ``then`` raised; no ``aclose``:
    the mux closes a source only if it can."""

    def __init__(
        self, chunks: Sequence[bytes], *, then: BaseException | None = None, name: str = "no-aclose"
    ) -> None:
        super().__init__(name)
        self._chunks = list(chunks)
        self._then = then

    def __aiter__(self) -> NoCloseSource:
        return self

    async def __anext__(self) -> bytes:
        self._pulled()
        if self.chunks_given < len(self._chunks):
            self.chunks_given += 1
            return self._chunks[self.chunks_given - 1]
        if self._then is not None:
            raise self._then
        raise StopAsyncIteration


class ListSource(NoCloseSource):
    """A :class:`NoCloseSource` that records its ``aclose``."""

    def __init__(
        self, chunks: Sequence[bytes], *, then: BaseException | None = None, name: str = "list"
    ) -> None:
        super().__init__(chunks, then=then, name=name)

    async def aclose(self) -> None:
        await self._close()


class IterableOnly:
    """An async iterable that is not an async iterator: it has ``__aiter__`` (a
    :class:`ListSource` of one event) but no ``__anext__``."""

    def __aiter__(self) -> ListSource:
        return ListSource([b"data: a\n\n"], name="behind an iterable")


#: How a consumer's iteration ended normally.
END = "StopAsyncIteration"


class Consumer:
    """Iterates a stream (``async for``) in a task: every event in ``events``, then in
    ``outcome`` :data:`END` or the exception the stream raised. ``waiting`` is True while
    it is inside ``__anext__``. A stub's ``Todo`` is not an outcome: it propagates."""

    def __init__(self, stream: MuxedStream) -> None:
        self.stream = stream
        self.events: list[ServerSentEvent] = []
        self.outcome: str | BaseException | None = None
        self.waiting = False

    @property
    def done(self) -> bool:
        return self.outcome is not None

    async def run(self) -> None:
        iterator = self.stream.__aiter__()
        while True:
            self.waiting = True
            try:
                event = await iterator.__anext__()
            except StopAsyncIteration:
                self.outcome = END
                return
            except Todo:
                raise
            except Exception as exc:  # the stream's error: what the test checks
                self.outcome = exc
                return
            finally:
                self.waiting = False
            self.events.append(event)


def sse_events(*data: str, id_prefix: str | None = None) -> bytes:
    """One ``data:`` event per item (with ``id: <prefix><n>`` if a prefix is given)."""
    out = []
    for n, item in enumerate(data):
        head = f"id: {id_prefix}{n}\n" if id_prefix is not None else ""
        out.append(f"{head}data: {item}\n\n")
    return "".join(out).encode()


__all__ = [
    "END",
    "ChannelSource",
    "Consumer",
    "IterableOnly",
    "ListSource",
    "NoCloseSource",
    "bounded",
    "settle",
    "sse_events",
]
