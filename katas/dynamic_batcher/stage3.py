"""Stage 3 — a router over engine replicas that die mid-stream, with prefix affinity.

The prompt is katas/dynamic_batcher/README.md, "Stage 3"; run the suite with
``pytest katas/dynamic_batcher -k stage3`` (``-k routes`` for the routing policy alone,
``-k "stage3 and core"`` for the core). Two classes: ``ReplicaSet``, the routing policy
with no I/O and no clock, and ``Router``, which does the streams, the failures and the
time, and asks its ``ReplicaSet`` where each attempt goes.

Rules (the suite checks each one):

- ReplicaSet (``-k routes``). A request weighs ``len(prompt) + max_new_tokens`` on its
  replica from ``assign`` until its first tokens arrive (``progress``), then its budget
  left, never below 0; ``release`` removes what is left.
- ``pick`` considers the replicas up, not draining and not in ``exclude`` (None if there
  is none). When their max load − min load > ``balance_abs_tokens`` and max load >
  ``balance_rel`` × min load, the least loaded wins ("balance"). Otherwise the one with
  the most leading full prompt blocks in its routing history ("affinity"), if that count
  is > 0 and ≥ ``affinity_threshold`` × ``len(prompt) // block_size``. Otherwise the
  least loaded ("least-loaded"). Ties: the lighter load, then the order given.
- ``assign`` records the chained keys (``api.block_hash``) of the prompt's full blocks
  as most recently used, last block first, so that block 0 ends up the most recent (the
  last to go); at most ``history_blocks`` keys per replica, the least recently used
  dropped first. ``mark_down`` forgets the replica's history.
- Router. ``generate()`` raises ``Overloaded(retry_after_ns=retry_after_ns)`` when the
  tokens outstanding + the request's weight > ``max_outstanding_tokens``; ValueError for
  a request heavier than that alone and for an id in flight; ReplicaError when no
  replica is up and not draining.
- A read returns every token accepted since the last read, merged; the last one carries
  the finish reason; then the iteration stops.
- A replica's 429 (``Overloaded`` from its Completion) is no failure: try the others.
  When every one refuses, the client's read raises ``Overloaded`` with the smallest
  ``retry_after_ns``.
- A broken stream (ReplicaError), a busy replica silent for ``stall_timeout_ns``, or a
  failed health probe (every ``probe_interval_ns``, each bounded by
  ``probe_timeout_ns``) marks the replica down, and every request on it fails over at
  that instant: its prompt + every token accepted, the budget left, the same stop
  tokens and priority, under the attempt's own id (``rid``, then ``rid#n`` after n
  attempts), to a replica picked as usual. The client sees each token once. No budget
  left: reason "length". At most ``max_failovers`` per request, then ReplicaError.
- An ownership epoch per request, bumped at every failover: a superseded attempt's
  tokens never reach the client, and its Completion is closed at once.
- A client that closes its stream or is cancelled ends its attempt at once (the replica
  aborts) and releases its load.
- ``drain(name)`` routes nothing more there and returns when nothing runs there;
  ``aclose()`` ends every stream with ReplicaError and stops probing.
"""

from __future__ import annotations

# TODO(stage3): implement every class and method below; delete each
# `raise Todo()` as you go. Build on your stage-2 engine (the replicas run it).
from collections.abc import Collection, Sequence
from types import TracebackType

from katas._runtime.clock import WaitingClock
from katas._runtime.todo import Todo
from katas.dynamic_batcher.api import (
    Delivery,
    ReplicaLink,
    Request,
    Route,
    RouterStatistics,
    TokenStream,
)


def _prefix_keys(prompt: Sequence[int], block_size: int) -> list[int]:
    """The chained keys of ``prompt``'s full blocks, block 0 first: each is
    ``api.block_hash(key of the block before, the block's tokens)`` (``None`` before block
    0), the keys the replicas' prefix caches use. A partial last block has none."""
    raise Todo()


class ReplicaSet:
    """Health, load and prefix history of named replicas; ``pick`` routes a prompt.

    Sans I/O, as h11's state machine: no sockets, no clock, no tasks. The router tells it
    what happened (``assign``, ``progress``, ``release``, ``mark_down`` …) and asks it
    where the next attempt goes. Unknown replica names raise KeyError.
    """

    def __init__(
        self,
        names: Sequence[str],
        *,
        block_size: int,
        balance_abs_tokens: int,
        balance_rel: float,
        affinity_threshold: float,
        history_blocks: int,
    ) -> None:
        """``names``: the replicas, in the order ties are broken by; at least one, all
        distinct. ``block_size``: the replicas' KV block size (an int >= 1).
        ``balance_abs_tokens`` (an int >= 0) and ``balance_rel`` (>= 1.0): the imbalance
        guard. ``affinity_threshold``: the fraction of the prompt's full blocks a
        remembered prefix must cover, in (0, 1]. ``history_blocks``: the most block keys
        remembered per replica (an int >= 1). Every replica starts up, not draining, with
        no load and no history. A bad argument raises ValueError (TypeError for a
        non-int count) naming it."""
        raise Todo()

    # -- what the router asks ---------------------------------------------------------------
    def available(self) -> list[str]:
        """Replicas that may take a request now: up and not draining, in the order given."""
        raise Todo()

    def load(self, name: str) -> int:
        """``name``'s outstanding tokens: the weight of every request assigned to it."""
        raise Todo()

    def loads(self) -> dict[str, int]:
        """Every replica's load, in the order given (down ones included)."""
        raise Todo()

    def total_load(self) -> int:
        raise Todo()

    def is_up(self, name: str) -> bool:
        raise Todo()

    def is_draining(self, name: str) -> bool:
        raise Todo()

    def matched_blocks(self, name: str, prompt: Sequence[int]) -> int:
        """Leading full blocks of ``prompt`` the router sent to ``name`` before: its keys
        from block 0 on, up to the first not in ``name``'s history. Reads the history
        without touching its order."""
        raise Todo()

    def pick(self, prompt: Sequence[int], *, exclude: Collection[str] = ()) -> Route | None:
        """Where ``prompt`` should go (None: no replica may take it), among the replicas
        up, not draining and not in ``exclude``; changes nothing.

        The imbalance guard first: when the most and least loaded candidates differ by
        more than ``balance_abs_tokens`` *and* the most loaded carries more than
        ``balance_rel`` times the least, the least loaded wins (``why="balance"``).
        Otherwise the candidate with the most matched blocks, if that is > 0 and at least
        ``affinity_threshold`` × ``len(prompt) // block_size`` (``"affinity"``, with
        ``matched_blocks``). Otherwise the least loaded (``"least-loaded"``). Ties go to
        the lighter load, then to the order the replicas were given in.
        """
        raise Todo()

    # -- what the router tells it -----------------------------------------------------------
    def assign(self, name: str, rid: str, prompt: Sequence[int], max_new_tokens: int) -> None:
        """``rid`` now runs on ``name``: charge ``len(prompt) + max_new_tokens``, and record
        the keys of the prompt's full blocks as most recently used, last block first, so
        that block 0 is the most recent (at most ``history_blocks`` kept, the least
        recently used dropped first). ValueError if ``rid`` is assigned already."""
        raise Todo()

    def progress(self, rid: str, tokens: int) -> None:
        """``tokens`` more tokens of ``rid`` arrived: its prompt is no longer charged, and
        its budget shrinks by ``tokens`` (never below 0). Nothing for an unknown ``rid`` or
        ``tokens <= 0``."""
        raise Todo()

    def release(self, rid: str) -> None:
        """``rid`` left its replica (finished, failed over, or its client went away):
        what is left of its weight comes off. Nothing for an unknown ``rid``."""
        raise Todo()

    def replica_of(self, rid: str) -> str | None:
        """The replica ``rid`` is assigned to (None: none)."""
        raise Todo()

    def mark_down(self, name: str) -> None:
        """``name`` failed: no request goes there, and its history is forgotten (a crashed
        replica has lost its cache)."""
        raise Todo()

    def mark_up(self, name: str) -> None:
        raise Todo()

    def drain(self, name: str) -> None:
        raise Todo()

    def restore(self, name: str) -> None:
        raise Todo()


class _RoutedStream:
    """One request's tokens for its client, across every replica it runs on: what
    ``generate()`` returns (it implements ``api.TokenStream``). A sketch — the request,
    every token accepted from a replica and how many the client has taken, the finish
    reason or the error once known, the current attempt (its replica, its epoch, a cancel
    scope, when it was last heard from), the failovers so far, the replicas that answered
    429 since its last start, an event the reader waits on; shape it as you like."""

    def __init__(self, router: Router, request: Request) -> None:
        raise Todo()

    @property
    def rid(self) -> str:
        raise Todo()

    def resubmission(self) -> Request:
        """The request as the next replica must see it: the prompt and every token
        accepted so far, ``max_new_tokens`` minus those tokens, the same stop tokens and
        priority; its id is ``rid`` for the first attempt and ``rid#n`` for the one after
        ``n`` attempts started (refused ones included): a replica refuses an id it has
        seen."""
        raise Todo()

    def __aiter__(self) -> _RoutedStream:
        raise Todo()

    async def __anext__(self) -> Delivery:
        """Every token accepted since the last read, merged; the last delivery with the
        finish reason; then StopAsyncIteration. A stream that ended in error delivers its
        tokens first, then raises the error once. Waits while there is nothing new;
        cancelled while waiting, the client is gone (its attempt ends)."""
        raise Todo()

    async def aclose(self) -> None:
        """The client leaves: its attempt ends now (the replica aborts)."""
        raise Todo()

    async def __aenter__(self) -> _RoutedStream:
        raise Todo()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        raise Todo()


class Router:
    """Routes streaming requests over replicas, and keeps each stream whole when a
    replica dies under it.

    ``async with Router(links, ...) as router:`` starts its background work (the silence
    watchdog and the prober); leaving the block calls :meth:`aclose`. Each attempt — one
    request on one replica — runs as a task of its own that carries the replica's events
    into the client's stream; where it goes is the ``ReplicaSet``'s decision.
    """

    def __init__(
        self,
        replicas: Sequence[ReplicaLink],
        *,
        clock: WaitingClock,
        block_size: int,
        max_outstanding_tokens: int,
        retry_after_ns: int,
        stall_timeout_ns: int,
        probe_interval_ns: int,
        probe_timeout_ns: int,
        max_failovers: int = 3,
        balance_abs_tokens: int = 256,
        balance_rel: float = 1.5,
        affinity_threshold: float = 0.5,
        history_blocks: int = 4096,
    ) -> None:
        """``replicas``: one link per replica (distinct names). ``max_outstanding_tokens``:
        the tokens the router carries at most over all replicas; ``retry_after_ns``: the
        hint its own refusals carry. ``stall_timeout_ns``: the silence after which a
        replica with requests in flight is presumed dead. ``probe_interval_ns``,
        ``probe_timeout_ns``: the health probes. ``max_failovers``: per request (an int
        >= 0). The rest are the ``ReplicaSet``'s. Every duration is ns on ``clock``. A
        bad argument raises ValueError (TypeError for a non-int) naming it; a clock that
        cannot wait is a ValueError."""
        raise Todo()

    async def __aenter__(self) -> Router:
        """Start the background tasks (a task group). A router is entered once."""
        raise Todo()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        """Close (as :meth:`aclose`), then return once every task has ended."""
        raise Todo()

    async def aclose(self) -> None:
        """End every stream not ended yet (``ReplicaError``), close every attempt, stop
        probing; ``generate()`` raises ``ReplicaError`` from then on."""
        raise Todo()

    def generate(self, request: Request) -> TokenStream:
        """Admit ``request`` and start its first attempt; return its stream at once (it
        never awaits). ``Overloaded`` when the tokens outstanding + its weight exceed
        ``max_outstanding_tokens``; ValueError for a request heavier than that alone or
        an id in flight; ``ReplicaError`` when no replica is up and not draining, or once
        closed; TypeError for a non-Request; RuntimeError before the ``async with``."""
        raise Todo()

    async def check_health(self) -> None:
        """Probe every replica at once, each for at most ``probe_timeout_ns`` on the
        clock; once every probe has answered or timed out, one that answered True is up
        (again), one that did not is down and its requests fail over."""
        raise Todo()

    async def drain(self, name: str) -> None:
        """Route nothing more to ``name`` (failovers included), and return once every
        request in flight there has left it. ValueError for an unknown name."""
        raise Todo()

    def restore(self, name: str) -> None:
        """Route to ``name`` again after a drain. ValueError for an unknown name."""
        raise Todo()

    def statistics(self) -> RouterStatistics:
        raise Todo()


__all__ = ["ReplicaSet", "Router"]
