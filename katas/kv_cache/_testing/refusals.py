"""Refusals observed, not assumed (stage 3): what a call raised, and two ``start()``
calls raced at the gap between a check and its act.

A test that wants a ``TypeError`` and gets a ``ValueError`` should fail by its own
assertion, naming both, not by the other exception escaping ``pytest.raises``.
"""

from __future__ import annotations

from collections.abc import Callable

from katas._harness.interleave import pause_in_loops
from katas._harness.waiting import Thread, spawn
from katas.kv_cache.api import CoherentCache

#: How long (real seconds) the first start() stands at each loop step for the second to
#: finish: a start() that holds its lock across the loop only waits this out.
START_GAP_S = 0.25


#: What :func:`refusal` says of a call that raised nothing.
RETURNED = "returned"


def refusal(call: Callable[[], object]) -> str:
    """The name of the exception ``call()`` raised, or :data:`RETURNED`."""
    try:
        call()
    except Exception as error:  # the test names what it wanted and what came
        return type(error).__name__
    return RETURNED


def ended(thread: Thread, what: str) -> str:
    """Join ``thread`` (hard deadline): the name of what it raised, or :data:`RETURNED`."""
    return refusal(lambda: thread.outcome(what))


def two_racing_starts(near: CoherentCache) -> list[str]:
    """Two threads call ``near.start()``; the first stands before the first loop step it
    takes in the near cache's module (past any check start() makes first: building its
    listeners) until the second's start() has ended. What each raised, in that order."""
    module = type(near).__module__
    second: list[Thread] = []

    def second_ended() -> bool:
        if not second:  # the first has reached a loop: the second goes now
            second.append(spawn(near.start, "the second start()"))
        return not second[0].is_alive()

    def first() -> object:
        pause_in_loops(module, second_ended, lambda: bool(second), deadline_s=START_GAP_S)
        return near.start()

    one = ended(spawn(first, "the first start()"), "the first start() returns or raises")
    if not second:  # no loop in that module: the two starts simply follow each other
        second.append(spawn(near.start, "the second start()"))
    return [one, ended(second[0], "the second start() returns or raises")]
