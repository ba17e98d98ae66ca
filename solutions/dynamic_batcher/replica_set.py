"""Reference solution, stage 3, sans I/O: the router's picture of its replicas.

Which replicas may take work (up and not draining), how much each has outstanding, and
which prompt prefixes each has probably cached — and, from that picture alone, where
the next request goes. No sockets, no clock: the router (stage3.py) tells it what
happened, as h11's state machine is told what bytes arrived.

Load is counted in tokens, not requests: a request with a 4 000-token prompt costs a
replica hundreds of times a 10-token one, and SGLang's router, which counts requests,
can pile long prompts on one replica while the counts look even. A request weighs its
prompt plus its token budget until its first token arrives (its prefill is then done),
and its remaining budget after.

The prefix picture is the router's own routing history — the chained keys of the full
blocks of every prompt it sent to a replica, as the replica's prefix cache keys them —
kept in LRU order and bounded, because the replica's cache is bounded too. It is a
guess: a replica may have evicted what the router remembers, and a crashed one has lost
it all, so a replica that goes down is forgotten.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field
from fractions import Fraction

from katas._runtime.checks import positive_int
from katas.dynamic_batcher.api import Route, block_hash


@dataclass
class _Replica:
    up: bool = True
    draining: bool = False
    load: int = 0  # outstanding tokens of the requests assigned to it
    history: OrderedDict[int, None] = field(default_factory=OrderedDict)  # block keys, LRU first


@dataclass
class _Charge:
    replica: str
    prompt: int  # charged until the first token
    budget: int  # tokens still to come


def _ratio(x: float) -> tuple[int, int]:
    """``x`` as written (1.4 is 7/5), as a numerator and a denominator, so that the routing
    compares integers exactly; infinity as 1/0, which no finite ratio exceeds."""
    if x == math.inf:
        return 1, 0
    exact = Fraction(str(x))  # a float's repr is the shortest decimal that reads back as it
    return exact.numerator, exact.denominator


def prefix_keys(prompt: Sequence[int], block_size: int) -> Iterator[int]:
    """The chained keys of ``prompt``'s full blocks, first block first."""
    key: int | None = None
    for start in range(0, len(prompt) - block_size + 1, block_size):
        key = block_hash(key, prompt[start : start + block_size])
        yield key


class ReplicaSet:
    """Health, load and prefix history of named replicas; ``pick`` routes a prompt."""

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
        if (
            isinstance(names, str)
            or not names
            or len(set(names)) != len(names)
            or not all(isinstance(n, str) and n for n in names)
        ):
            raise ValueError(f"names must be distinct non-empty names, at least one: {names!r}")
        if (
            isinstance(balance_abs_tokens, bool)
            or not isinstance(balance_abs_tokens, int)
            or (balance_abs_tokens < 0)
        ):
            raise ValueError(f"balance_abs_tokens must be an int >= 0, got {balance_abs_tokens!r}")
        if (
            isinstance(balance_rel, bool)
            or not isinstance(balance_rel, int | float)
            or not (balance_rel >= 1.0)
        ):
            raise ValueError(f"balance_rel must be a number >= 1.0, got {balance_rel!r}")
        if (
            isinstance(affinity_threshold, bool)
            or not isinstance(affinity_threshold, int | float)
            or not (0.0 < affinity_threshold <= 1.0)
        ):
            raise ValueError(
                f"affinity_threshold must be a fraction in (0, 1], got {affinity_threshold!r}"
            )
        self._block_size = positive_int("block_size", block_size)
        self._abs = balance_abs_tokens
        self._rel = _ratio(balance_rel)
        self._threshold = _ratio(affinity_threshold)
        self._history_blocks = positive_int("history_blocks", history_blocks)
        self._replicas = {name: _Replica() for name in names}  # in the order given
        self._charges: dict[str, _Charge] = {}

    # -- what the router asks ---------------------------------------------------------------
    def available(self) -> list[str]:
        """Replicas that may take a request now: up and not draining, in the order given."""
        return [n for n, r in self._replicas.items() if r.up and not r.draining]

    def load(self, name: str) -> int:
        return self._replicas[name].load

    def loads(self) -> dict[str, int]:
        return {n: r.load for n, r in self._replicas.items()}

    def total_load(self) -> int:
        return sum(r.load for r in self._replicas.values())

    def is_up(self, name: str) -> bool:
        return self._replicas[name].up

    def is_draining(self, name: str) -> bool:
        return self._replicas[name].draining

    def matched_blocks(self, name: str, prompt: Sequence[int]) -> int:
        """Leading full blocks of ``prompt`` the router sent to ``name`` before."""
        history = self._replicas[name].history
        matched = 0
        for key in prefix_keys(prompt, self._block_size):
            if key not in history:
                break
            matched += 1
        return matched

    def pick(self, prompt: Sequence[int], *, exclude: Collection[str] = ()) -> Route | None:
        """Where ``prompt`` should go (None: no replica may take it).

        The imbalance guard first: when the most and least loaded candidates differ by
        more than ``balance_abs_tokens`` *and* the most loaded carries more than
        ``balance_rel`` times the least, affinity is ignored and the least loaded wins.
        Otherwise the candidate with the longest remembered prefix, if it covers at
        least ``affinity_threshold`` of the prompt's full blocks; else the least loaded.
        Ties go to the lighter load, then to the order the replicas were given in.
        """
        names = [n for n in self.available() if n not in exclude]
        if not names:
            return None
        order = {n: i for i, n in enumerate(names)}
        lightest = min(names, key=lambda n: (self.load(n), order[n]))
        heaviest = max(self.load(n) for n in names)
        low = self.load(lightest)
        rel, rel_den = self._rel
        if heaviest - low > self._abs and heaviest * rel_den > low * rel:
            return Route(lightest, "balance")
        full = len(prompt) // self._block_size
        if full:
            matched = {n: self.matched_blocks(n, prompt) for n in names}
            best = min(names, key=lambda n: (-matched[n], self.load(n), order[n]))
            share, share_den = self._threshold
            if matched[best] and matched[best] * share_den >= share * full:
                return Route(best, "affinity", matched[best])
        return Route(lightest, "least-loaded")

    # -- what the router tells it -----------------------------------------------------------
    def assign(self, name: str, rid: str, prompt: Sequence[int], max_new_tokens: int) -> None:
        """``rid`` now runs on ``name``: charge its tokens and remember its prefix."""
        if rid in self._charges:
            raise ValueError(f"request {rid!r} is already assigned")
        replica = self._replicas[name]
        self._charges[rid] = _Charge(name, len(prompt), max_new_tokens)
        replica.load += len(prompt) + max_new_tokens
        history = replica.history
        # Last block first: the first blocks, which every longer prompt shares, are the
        # most recently used and the last to go.
        for key in reversed(list(prefix_keys(prompt, self._block_size))):
            history[key] = None
            history.move_to_end(key)
        while len(history) > self._history_blocks:
            history.popitem(last=False)

    def progress(self, rid: str, tokens: int) -> None:
        """``tokens`` more tokens of ``rid`` arrived: its prefill is over, its budget shrinks."""
        charge = self._charges.get(rid)
        if charge is None or tokens <= 0:
            return
        done = charge.prompt + min(tokens, charge.budget)
        charge.prompt, charge.budget = 0, charge.budget - min(tokens, charge.budget)
        self._replicas[charge.replica].load -= done

    def release(self, rid: str) -> None:
        """``rid`` left its replica (finished, failed over, or its client went away)."""
        charge = self._charges.pop(rid, None)
        if charge is not None:
            self._replicas[charge.replica].load -= charge.prompt + charge.budget

    def replica_of(self, rid: str) -> str | None:
        charge = self._charges.get(rid)
        return None if charge is None else charge.replica

    def mark_down(self, name: str) -> None:
        """``name`` failed: no request goes there, and what it had cached is forgotten."""
        replica = self._replicas[name]
        replica.up = False
        replica.history.clear()

    def mark_up(self, name: str) -> None:
        self._replicas[name].up = True

    def drain(self, name: str) -> None:
        self._replicas[name].draining = True

    def restore(self, name: str) -> None:
        self._replicas[name].draining = False


__all__ = ["ReplicaSet", "prefix_keys"]
