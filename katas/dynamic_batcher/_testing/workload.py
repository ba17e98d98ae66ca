"""Seeded workloads: lists of requests with arrival times, for ``simulate``.

Every generator is a pure function of its arguments (a ``random.Random(seed)`` of its
own), so a workload is named by its call: ``exponential(200, mean_output=128, seed=7)``.
Prompt lengths are drawn uniformly from ``prompt_len`` (inclusive bounds), output
lengths from the generator's distribution, rounded and clamped to
``1 .. max_output``; prompt tokens uniformly from ``0 .. vocab_size - 1``. No request
has stop tokens, so each generates exactly its ``max_new_tokens``. Arrivals: all at 0
when ``rate_per_s`` is None, else a Poisson process of that rate (exponential gaps,
rounded to integer nanoseconds). Request ids are ``r0000``, ``r0001``, … in arrival
order.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from katas._runtime.clock import NS_PER_S
from katas.dynamic_batcher.api import Request

DEFAULT_PROMPT_LEN = (16, 64)
DEFAULT_MAX_OUTPUT = 1024
DEFAULT_VOCAB = 32_000


def exponential(
    n: int,
    *,
    mean_output: float,
    seed: int,
    prompt_len: tuple[int, int] = DEFAULT_PROMPT_LEN,
    max_output: int = DEFAULT_MAX_OUTPUT,
    rate_per_s: float | None = None,
    vocab_size: int = DEFAULT_VOCAB,
) -> list[Request]:
    """Output lengths exponential with mean ``mean_output``: the usual chat mix."""
    _check(n, prompt_len, max_output, vocab_size, mean_output=mean_output)
    rng = random.Random(seed)
    lengths = [rng.expovariate(1 / mean_output) for _ in range(n)]
    return _requests(
        rng, lengths, _arrivals(rng, n, rate_per_s), prompt_len, max_output, vocab_size
    )


def long_tailed(
    n: int,
    *,
    median_output: float,
    seed: int,
    sigma: float = 1.0,
    prompt_len: tuple[int, int] = DEFAULT_PROMPT_LEN,
    max_output: int = DEFAULT_MAX_OUTPUT,
    rate_per_s: float | None = None,
    vocab_size: int = DEFAULT_VOCAB,
) -> list[Request]:
    """Output lengths lognormal (median ``median_output``, shape ``sigma``): most short,
    a few very long — the mix where a static batch waits longest for its slowest member."""
    _check(n, prompt_len, max_output, vocab_size, mean_output=median_output)
    if sigma < 0:
        raise ValueError(f"sigma must be >= 0, got {sigma}")
    rng = random.Random(seed)
    mu = math.log(median_output)
    lengths = [rng.lognormvariate(mu, sigma) for _ in range(n)]
    return _requests(
        rng, lengths, _arrivals(rng, n, rate_per_s), prompt_len, max_output, vocab_size
    )


def bursts(
    n_bursts: int,
    burst_size: int,
    *,
    gap_ns: int,
    mean_output: float,
    seed: int,
    prompt_len: tuple[int, int] = DEFAULT_PROMPT_LEN,
    max_output: int = DEFAULT_MAX_OUTPUT,
    vocab_size: int = DEFAULT_VOCAB,
) -> list[Request]:
    """``n_bursts`` bursts of ``burst_size`` requests arriving at the same instant, the
    k-th at ``k * gap_ns``; output lengths exponential with mean ``mean_output``."""
    n = n_bursts * burst_size
    _check(n, prompt_len, max_output, vocab_size, mean_output=mean_output)
    if n_bursts < 0 or burst_size < 0 or gap_ns < 0:
        raise ValueError(f"need n_bursts, burst_size, gap_ns >= 0: {n_bursts, burst_size, gap_ns}")
    rng = random.Random(seed)
    lengths = [rng.expovariate(1 / mean_output) for _ in range(n)]
    arrivals = [k * gap_ns for k in range(n_bursts) for _ in range(burst_size)]
    return _requests(rng, lengths, arrivals, prompt_len, max_output, vocab_size)


def shared_prefixes(
    n: int,
    *,
    n_prefixes: int,
    prefix_len: int,
    mean_output: float,
    seed: int,
    suffix_len: tuple[int, int] = (1, 32),
    max_output: int = DEFAULT_MAX_OUTPUT,
    rate_per_s: float | None = None,
    vocab_size: int = DEFAULT_VOCAB,
) -> list[Request]:
    """Prompts that are one of ``n_prefixes`` common prefixes of ``prefix_len`` tokens (a
    system prompt, a few-shot preamble; drawn at random per request) followed by a suffix
    of its own — the workload prefix caching and prefix-affine routing are for. Output
    lengths exponential with mean ``mean_output``."""
    _check(n, suffix_len, max_output, vocab_size, mean_output=mean_output)
    if n_prefixes < 1 or prefix_len < 0:
        raise ValueError(f"need n_prefixes >= 1 and prefix_len >= 0: {n_prefixes}, {prefix_len}")
    rng = random.Random(seed)
    prefixes = [tuple(_tokens(rng, prefix_len, vocab_size)) for _ in range(n_prefixes)]
    lengths = [rng.expovariate(1 / mean_output) for _ in range(n)]
    arrivals = _arrivals(rng, n, rate_per_s)
    return [
        Request(
            _rid(i),
            prefixes[rng.randrange(n_prefixes)]
            + tuple(_tokens(rng, _draw(rng, suffix_len), vocab_size)),
            _clamp(length, max_output),
            arrival_ns=at,
        )
        for i, (length, at) in enumerate(zip(lengths, arrivals, strict=True))
    ]


# -- shared pieces ----------------------------------------------------------------------
def _check(
    n: int, lens: tuple[int, int], max_output: int, vocab_size: int, *, mean_output: float
) -> None:
    lo, hi = lens
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not 1 <= lo <= hi:
        raise ValueError(f"a length range needs 1 <= lo <= hi, got {lens}")
    if max_output < 1 or vocab_size < 1:
        raise ValueError(f"need max_output >= 1 and vocab_size >= 1: {max_output}, {vocab_size}")
    if not mean_output > 0:
        raise ValueError(f"the output length's mean (or median) must be > 0, got {mean_output}")


def _rid(i: int) -> str:
    return f"r{i:04d}"


def _draw(rng: random.Random, bounds: tuple[int, int]) -> int:
    return rng.randint(bounds[0], bounds[1])


def _tokens(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randrange(vocab_size) for _ in range(n)]


def _clamp(length: float, max_output: int) -> int:
    return max(1, min(max_output, round(length)))


def _arrivals(rng: random.Random, n: int, rate_per_s: float | None) -> list[int]:
    if rate_per_s is None:
        return [0] * n
    if not rate_per_s > 0:
        raise ValueError(f"rate_per_s must be > 0 (or None: all at t=0), got {rate_per_s}")
    mean_gap_ns = NS_PER_S / rate_per_s
    now, out = 0, []
    for _ in range(n):
        out.append(now)
        now += round(rng.expovariate(1 / mean_gap_ns))
    return out


def _requests(
    rng: random.Random,
    lengths: list[float],
    arrivals: list[int],
    prompt_len: tuple[int, int],
    max_output: int,
    vocab_size: int,
) -> list[Request]:
    return [
        Request(
            _rid(i),
            tuple(_tokens(rng, _draw(rng, prompt_len), vocab_size)),
            _clamp(length, max_output),
            arrival_ns=at,
        )
        for i, (length, at) in enumerate(zip(lengths, arrivals, strict=True))
    ]


def total_output_tokens(workload: Sequence[Request]) -> int:
    """Tokens the workload generates when nothing stops early: the sum of its budgets."""
    return sum(r.max_new_tokens for r in workload)


__all__ = [
    "bursts",
    "exponential",
    "long_tailed",
    "shared_prefixes",
    "total_output_tokens",
]


@dataclass(frozen=True)
class Comparison:
    """Continuous against static batching, as the suite's test and the pictures run it:
    every request at 0, output lengths exponential (the spec's mean of 128), ``slots``
    requests at a time, and a KV pool with room for every slot at its longest output."""

    requests: int = 256
    mean_output: int = 128
    seed: int = 11
    prompt_len: tuple[int, int] = (8, 64)
    max_output: int = 1024
    slots: int = 32
    block_size: int = 16
    token_budget: int = 2048

    def workload(self) -> list[Request]:
        return exponential(
            self.requests, mean_output=self.mean_output, seed=self.seed,
            prompt_len=self.prompt_len, max_output=self.max_output,
        )  # fmt: skip

    @property
    def num_blocks(self) -> int:
        return self.slots * -(-(self.prompt_len[1] + self.max_output) // self.block_size)


#: The comparison the suite asserts on and the pictures draw.
COMPARISON = Comparison()
