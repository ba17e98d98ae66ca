"""Boundary-biased hypothesis strategies that every suite can use.

A property test reaches a rule's boundary only when its draws land on it: ``t =
deadline - 1, deadline, deadline + 1``, a size at its limit and one past it. Uniform
draws almost never do. These strategies mix the boundaries into the draws, so every run
meets them, and they shrink towards the boundary itself.
"""

from __future__ import annotations

from collections.abc import Iterable

from hypothesis import strategies as st


def around(*points: int, spread: int = 1) -> st.SearchStrategy[int]:
    """``p - spread … p + spread`` for each point: the values on and beside a boundary."""
    values = sorted({p + d for p in points for d in range(-spread, spread + 1)})
    return st.sampled_from(values)


def near(points: Iterable[int], lo: int, hi: int, *, spread: int = 1) -> st.SearchStrategy[int]:
    """Integers in ``[lo, hi]``, half of them on or beside one of ``points``."""
    edges = sorted({v for p in points for v in range(p - spread, p + spread + 1) if lo <= v <= hi})
    anywhere = st.integers(lo, hi)
    return st.one_of(st.sampled_from(edges), anywhere) if edges else anywhere


def steps_to(deadline: int, *, spread: int = 1) -> st.SearchStrategy[int]:
    """Clock advances that land on ``deadline - spread … deadline + spread`` (from 0)."""
    return around(deadline, spread=spread).filter(lambda v: v >= 0)


def sizes(limit: int) -> st.SearchStrategy[int]:
    """Sizes biased to ``0, 1, limit - 1, limit, limit + 1``, else anything up to twice it."""
    return near([0, limit], 0, max(1, 2 * limit))


__all__ = ["around", "near", "sizes", "steps_to"]
