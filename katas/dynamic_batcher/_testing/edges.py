"""Stage-2 edge helpers: a clock that cannot tell the time (bad input), and a result
sequence that runs a hook while the batcher hands its results out (a cancellation that
lands after a caller's result was handed out, before that caller runs again)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar, overload

T = TypeVar("T")


class SleepOnlyClock:
    """A clock that can sleep and cannot tell the time: not a waiting clock (bad input)."""

    async def sleep_until_ns_async(self, deadline_ns: int) -> None:
        return None


class Handout(Sequence[T]):
    """``fn``'s results; the first read of the result at index ``at`` (by index or by
    iteration) first calls ``hook``, once. A batcher that hands results out one by one
    has handed out every result before ``at`` by then; ``fired`` tells it ran."""

    def __init__(self, results: Sequence[T], *, at: int, hook: Callable[[], None]) -> None:
        self._results = list(results)
        self._at = at
        self._hook = hook
        self.fired = False

    def _reach(self, index: int) -> None:
        if index == self._at and not self.fired:
            self.fired = True
            self._hook()

    def __len__(self) -> int:
        return len(self._results)

    @overload
    def __getitem__(self, index: int) -> T: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[T]: ...
    def __getitem__(self, index: int | slice) -> T | Sequence[T]:
        if isinstance(index, slice):
            for i in range(*index.indices(len(self._results))):
                self._reach(i)
            return self._results[index]
        self._reach(index % len(self._results) if index < 0 else index)
        return self._results[index]

    def __iter__(self) -> Iterator[T]:
        for i, result in enumerate(self._results):
            self._reach(i)
            yield result


__all__ = ["Handout", "SleepOnlyClock"]
